"""`deltaspec` command line: subcommands follow llama.cpp's flag names where one exists."""

from __future__ import annotations

import argparse
import sys

from .devices import add_split_arguments, device_arg, device_kind, split_arg, split_from_flags


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .cli_args import StrictParser

    parser = StrictParser(prog="deltaspec", description=__doc__)
    parser.add_argument("--version", action="version", version=f"deltaspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")  # StrictParser too (parser_class)

    p = sub.add_parser("convert", help="convert a Hugging Face Qwen3.5 text checkpoint, or a DFlash drafter "
                                       "checkpoint (with --target), to GGUF")
    p.add_argument("hf_dir", help="folder with config.json, *.safetensors and tokenizer files (a DFlash drafter's "
                                  "folder has no tokenizer: see --target)")
    p.add_argument("out", help="output .gguf path")
    p.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    p.add_argument("--no-mtp", action="store_true",
                   help="drop the checkpoint's MTP layer (kept by default, as llama.cpp's converter keeps it)")
    p.add_argument("--target", "--target-model-dir", dest="target", metavar="TARGET",
                   help="for a DFlash drafter (DFlashDraftModel): its target model, as the HF folder or the qwen35 "
                        "GGUF, whose vocabulary the drafter's file carries and which it must fit")
    p.set_defaults(run=_run_convert)

    p = sub.add_parser("info", help="print a qwen35 GGUF's architecture, sizes and quant mix")
    p.add_argument("model", help="path to a .gguf file")
    p.add_argument("-c", "--ctx-size", type=_positive_int, default=4096,
                   help="context size for the memory estimate, rounded up to a multiple of 256 as Model "
                        "allocates it (default: %(default)s)")
    p.add_argument("-ts", "--tensor-split", default=None, metavar="N,N,...",
                   help="also show where a layer split with these shares puts the layers (as run --devices ... -ts)")
    p.set_defaults(run=_run_info)

    from .synth import PRESETS, QUANTS  # numpy + gguf only

    p = sub.add_parser("synth", help="write a synthetic (random-weight) Qwen3.5 GGUF with a real size's shapes, "
                                     "tokenizer and quant mix")
    p.add_argument("out", help="output .gguf path")
    p.add_argument("--preset", required=True, choices=list(PRESETS), help="model size")
    p.add_argument("--quant", default="q4_k_m", choices=list(QUANTS),
                   help="tensor types: llama-quantize Q4_K_M's mix, or convert_hf_to_gguf's q8_0 / f16")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed: same bytes)")
    p.add_argument("--mtp", action="store_true", help="also write the MTP (NextN) layer, as the converter does")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to store in the file")
    p.add_argument("-t", "--threads", type=int, default=None, help="worker threads (default: all usable CPUs)")
    p.set_defaults(run=_run_synth)

    _add_run_parser(sub)
    from .server.cli import add_serve_parser  # argparse only; the server's dependencies load when it runs

    add_serve_parser(sub)
    return parser


def _positive_int(text: str) -> int:
    """argparse type for counts that must be >= 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# --- run -------------------------------------------------------------------------------------------

RUN_DESCRIPTION = """Generate text from a prompt (-p / -f), or chat (-i), with llama.cpp's flag names and defaults.
Output streams to stdout; load progress and the timing line (one per reply with -i) go to stderr.
With -i (-cnv), -sys or -p / -f give the system message; type /exit (or end the input) to quit, /clear to start
over, and Ctrl-C to stop a reply."""

# Model / generate parameter -> the flag that sets it, to name the flag in error messages
RUN_FLAGS = {
    "n_ctx": "-c/--ctx-size", "n_threads": "-t/--threads", "n_ubatch": "-ub/--ubatch-size",
    "type_k": "-ctk/--cache-type-k", "type_v": "-ctv/--cache-type-v", "device": "--device",
    "devices": "--devices", "split": "-sm/--split-mode", "tensor_split": "-ts/--tensor-split",
    "max_tokens": "-n/--n-predict", "temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p",
    "min_p": "--min-p", "repeat_penalty": "--repeat-penalty", "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty", "penalty_last_n": "--repeat-last-n", "seed": "-s/--seed",
    "stop": "--stop", "draft_n_max": "--spec-draft-n-max", "draft_n_min": "--spec-draft-n-min",
    "draft_model": "-md/--model-draft", "spec_type": "--spec-type", "tree_budget": "--spec-tree-budget",
    "ignore_eos": "--ignore-eos", "reasoning_budget": "--reasoning-budget",
    "reasoning_budget_message": "--reasoning-budget-message",
}
# structured output (llama.cpp's spellings): flag -> how its value becomes a deltaspec.Grammar
GRAMMAR_FLAGS = {"--grammar": "text", "--grammar-file": "file", "-j/--json-schema": "schema",
                 "-jf/--json-schema-file": "schema file"}


class RunError(Exception):
    """A bad `run` argument or input: printed as one line, exit status 2."""


def _add_run_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text or chat with a qwen35 GGUF (llama-cli's flags)",
                       description=RUN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = _one_line_error(p)  # type: ignore[method-assign]
    p.add_argument("-m", "--model", required=True, metavar="FNAME", help="path to a qwen35 .gguf file")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", metavar="PROMPT", help="prompt to continue (with -i: the system message)")
    src.add_argument("-f", "--file", metavar="FNAME", help="read the prompt from a file (one trailing newline "
                                                           "is dropped, as llama.cpp does)")
    p.add_argument("-i", "--interactive", "-cnv", "--conversation", dest="interactive", action="store_true",
                   help="chat: read user turns from stdin, render them with the GGUF's chat template")
    p.add_argument("-no-cnv", "--no-conversation", dest="interactive", action="store_false",
                   help="complete the prompt, no chat (the default here)")
    p.add_argument("-sys", "--system-prompt", metavar="PROMPT", default=None,
                   help="with -i: the system message (as -p is there)")
    p.add_argument("-e", "--escape", dest="escape", action="store_true", default=True,
                   help="turn \\n \\r \\t \\' \\\" \\\\ \\xHH in -p, -f, -sys and --stop into the characters "
                        "they name (default: on, as llama.cpp)")
    p.add_argument("--no-escape", dest="escape", action="store_false", help="keep backslashes as typed")
    p.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=-1, metavar="N",
                   help="tokens to generate (per reply with -i); -1 = until an end token or a full context "
                        "(default: %(default)s)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, metavar="N",
                   help="context size in tokens; 0 = the model's training context (default: %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads (default: all usable CPUs)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, metavar="N",
                   help="llama.cpp's logical batch; the physical one is min(-b, -ub) (default: %(default)s)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, metavar="N",
                   help="largest batch of prompt tokens per graph (default: %(default)s)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", metavar="TYPE",
                   help="KV cache type for K: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1, or deltaspec's "
                        "TurboQuant tq3 / tq4 (3 / 4 bits per value + one fp16 scale per head) "
                        "(default: %(default)s)")
    p.add_argument("-ctv", "--cache-type-v", default="f16", metavar="TYPE",
                   help="KV cache type for V (default: %(default)s)")
    p.add_argument("--device", default=None, type=device_arg, metavar="{cpu,cuda,cuda:N}",
                   help="cuda = cuda:0, the first GPU (default: cpu, or as -ngl says)")
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", metavar="N", default=None,
                   help="the engine runs on one device, whole: 0 = CPU; N >= 1, 'all' = every layer on the GPU "
                        "(--device cuda); 'auto' = --device's choice (default: auto)")
    add_split_arguments(p, devices_type=split_arg)
    p.add_argument("-fa", "--flash-attn", choices=["on", "off", "auto"], default="auto",
                   help="attention always runs as ggml's flash attention here: on and auto accepted, off refused")
    p.add_argument("-v", "--verbose", "--log-verbose", action="store_true",
                   help="also print the settings in use to stderr")
    p.add_argument("--log-disable", action="store_true",
                   help="no load progress, banner, seed or timing lines on stderr (errors still print)")
    g = p.add_argument_group("sampling (llama.cpp's chain: penalties, top-k, top-p, min-p, temperature)")
    g.add_argument("--temp", type=float, default=0.8, metavar="N",
                   help="temperature; 0 = greedy (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=40, metavar="N", help="0 = off (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=0.95, metavar="N", help="1.0 = off (default: %(default)s)")
    g.add_argument("--min-p", type=float, default=0.05, metavar="N", help="0.0 = off (default: %(default)s)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, metavar="N", help="1.0 = off (default: %(default)s)")
    g.add_argument("--repeat-last-n", type=int, default=64, metavar="N",
                   help="tokens the penalties look back over; -1 = the whole context (default: %(default)s)")
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="N", help="(default: %(default)s)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="N", help="(default: %(default)s)")
    g.add_argument("-s", "--seed", type=int, default=-1, metavar="N", help="-1 = random (default: %(default)s)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="never end at an end-of-generation token (its logit is set to -inf): -n or the context ends "
                        "the text")
    g.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="tokens a <think> block may hold, then its </think> is forced; -1 = no budget, 0 = close "
                        "it at once (default: %(default)s)")
    g.add_argument("--reasoning-budget-message", default="", metavar="TEXT",
                   help="text forced before </think> when the reasoning budget runs out (default: none)")
    p.add_argument("--stop", action="extend", nargs="+", default=[], metavar="STR",
                   help="stop when the output contains STR (not printed); may be given several times")
    p.add_argument("--no-display-prompt", action="store_true", help="do not print the prompt before the output")
    g = p.add_argument_group("speculative decoding (lossless: greedy output and sampling distribution "
                             "are those of -m alone)")
    g.add_argument("-md", "--model-draft", metavar="FNAME", default=None,
                   help="draft model GGUF (same vocabulary as -m); turns on --spec-type draft-simple")
    g.add_argument("--spec-type", choices=["draft-simple", "ngram-simple", "mtp", "draft-mtp", "dflash", "draft-dflash"],
                   default=None,
                   help="draft-simple: the -md model drafts; ngram-simple: prompt lookup, drafts from the "
                        "text itself; mtp (llama.cpp: draft-mtp): the model's own MTP layer drafts; dflash "
                        "(llama.cpp: draft-dflash): -md is a DFlash block drafter, one pass drafts a block "
                        "(default: draft-simple with -md, else no speculation)")
    g.add_argument("--spec-draft-n-max", type=int, default=16, metavar="N",
                   help="most tokens drafted per step; the draft length adapts below it (default: %(default)s)")
    g.add_argument("--spec-draft-n-min", type=int, default=0, metavar="N",
                   help="fewest tokens drafted per step (default: %(default)s)")
    g.add_argument("--spec-tree-budget", type=int, default=0, metavar="N",
                   help="draft trees of up to N nodes (no deeper than --spec-draft-n-max), verified in one "
                        "pass (with --spec-type dflash: a DDTree tree over one block); 0: chains "
                        "(default: %(default)s)")
    g = p.add_argument_group("structured output (enforced while decoding, speculation included)")
    g.add_argument("--grammar", metavar="GRAMMAR", default=None,
                   help="GBNF grammar (llama.cpp's format; Lark with a start: rule) the output must match")
    g.add_argument("--grammar-file", metavar="FNAME", default=None, help="read --grammar from a file")
    g.add_argument("-j", "--json-schema", metavar="SCHEMA", default=None,
                   help='JSON schema the output must validate against, e.g. \'{"type": "object"}\'')
    g.add_argument("-jf", "--json-schema-file", metavar="FNAME", default=None, help="read -j from a file")
    p.add_argument("--chat-template", metavar="NAME|JINJA|FILE", default=None,
                   help="with -i: a chat template instead of the GGUF's: a built-in name (chatml, qwen35), "
                        "Jinja text or a file")
    p.add_argument("--chat-template-file", metavar="FILE", default=None, help="with -i: a Jinja chat template file")
    p.add_argument("--jinja", action="store_true", help="accepted: templates are always rendered with Jinja")
    p.add_argument("--chat-template-kwargs", metavar="JSON", default=None,
                   help='with -i: options for the chat template, e.g. \'{"enable_thinking": false}\' '
                        "(enable_thinking is the one understood)")
    p.set_defaults(run=_run_run)


def _one_line_error(parser: argparse.ArgumentParser):
    """argparse prints the whole usage before an error; `run` prints one line naming the flag."""

    def error(message: str):
        parser.exit(2, f"{parser.prog}: error: {message} (see {parser.prog} --help)\n")

    return error


def _flag_error(e: Exception) -> RunError:
    """A ValueError from Model / generate, prefixed with the flag whose value it is about."""
    import re

    msg = str(e)
    for name, flag in RUN_FLAGS.items():
        if re.search(rf"(?<![\w.-]){name}\b", msg):
            return RunError(f"{flag}: {msg}")
    return RunError(msg)


def _run_run(args: argparse.Namespace) -> int:
    from .errors import DeltaspecError

    prog = "deltaspec run"
    try:
        return _run(args)
    except RunError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
    except DeltaspecError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
    except ValueError as e:
        print(f"{prog}: error: {_flag_error(e)}", file=sys.stderr)
    except KeyboardInterrupt:  # while loading or generating without -i: stop quietly
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop without a traceback
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the final flush must not fail
        return 141
    return 2


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    """generate()'s keyword arguments, validated before the model loads (errors name the flag)."""
    from .generation import validate_stop
    from .sampling import SamplingOptions

    if args.seed < -1:
        raise RunError(f"-s/--seed: must be -1 (random) or >= 0, got {args.seed}")
    if args.n_predict < -1 or args.n_predict == 0:
        raise RunError(f"-n/--n-predict: must be -1 (until the context is full) or a positive number, "
                       f"got {args.n_predict}")
    kw = dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
              repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
              frequency_penalty=args.frequency_penalty, penalty_last_n=args.repeat_last_n,
              seed=None if args.seed == -1 else args.seed)
    if args.ignore_eos:
        kw["ignore_eos"] = True
    if args.reasoning_budget < -1:
        raise RunError(f"--reasoning-budget: must be -1 (no budget) or >= 0, got {args.reasoning_budget}")
    if args.reasoning_budget >= 0:
        kw["reasoning_budget"] = args.reasoning_budget
        if args.reasoning_budget_message:
            kw["reasoning_budget_message"] = _escaped(args, args.reasoning_budget_message)
    elif args.reasoning_budget_message:
        raise RunError("--reasoning-budget-message: needs --reasoning-budget N")
    args.stop = [_escaped(args, s) for s in args.stop]
    try:
        SamplingOptions(**{k: v for k, v in kw.items()
                           if k not in ("ignore_eos", "reasoning_budget", "reasoning_budget_message")})
        validate_stop(args.stop)
    except ValueError as e:
        raise _flag_error(e) from None
    kw.update(max_tokens=None if args.n_predict == -1 else args.n_predict, stop=args.stop or None)
    return kw


def _read_prompt(args: argparse.Namespace) -> str | None:
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise RunError(f"-f/--file: cannot read {args.file}: {why}") from None
        if text.endswith("\n"):
            text = text[:-1]
        if not text:
            raise RunError(f"-f/--file: {args.file} is empty")
        return _escaped(args, text)
    if args.prompt is not None and not args.prompt:
        raise RunError("-p/--prompt: the prompt is empty")
    return None if args.prompt is None else _escaped(args, args.prompt)


def _escaped(args: argparse.Namespace, text: str) -> str:
    from .cli_args import process_escapes

    return process_escapes(text) if args.escape else text


def _system_prompt(args: argparse.Namespace, prompt: str | None) -> str | None:
    """-i's system message: -sys, or -p / -f as before -sys existed (llama-cli takes -p as the first turn)."""
    if args.system_prompt is None:
        return prompt
    if not args.interactive:
        raise RunError("-sys/--system-prompt: only used with -i/-cnv (chat)")
    if prompt is not None:
        raise RunError("-sys/--system-prompt: give the system message once: -sys or -p/-f, not both")
    return _escaped(args, args.system_prompt)


def _chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template (Jinja text, or a file as a convenience) / --chat-template-file, read and compiled now."""
    import os

    from .chat import ChatTemplate
    from .errors import ChatTemplateError

    if args.chat_template is not None and args.chat_template_file is not None:
        raise RunError("--chat-template: give --chat-template or --chat-template-file, not both")
    flag, value = ("--chat-template", args.chat_template) if args.chat_template is not None else \
        ("--chat-template-file", args.chat_template_file)
    if value is None:
        return None
    if not args.interactive:
        raise RunError(f"{flag}: only used with -i/-cnv (chat)")
    is_text = flag == "--chat-template" and ("{{" in value or "{%" in value)
    if flag == "--chat-template" and not is_text and not os.path.isfile(value):
        from .chat_template_names import BUILTIN_CHAT_TEMPLATES

        if value not in BUILTIN_CHAT_TEMPLATES:
            raise RunError(f"--chat-template: {value!r} is neither a built-in template name "
                           f"({', '.join(BUILTIN_CHAT_TEMPLATES)}: the formats Qwen3.5 models speak), Jinja template "
                           "text nor a file; pass the template's Jinja text or --chat-template-file FILE")
        value, is_text = BUILTIN_CHAT_TEMPLATES[value], True
    if not is_text:
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise RunError(f"{flag}: cannot read {value}: {why}") from None
    try:
        ChatTemplate(value)
    except ChatTemplateError as e:
        raise RunError(f"{flag}: {e}") from None
    return value


def _device(args: argparse.Namespace) -> str:
    """-ngl for an engine that holds the whole model on one device: 0 = CPU, any layer count = GPU."""
    ngl = args.n_gpu_layers
    if ngl is None or ngl == "auto":
        return args.device or "cpu"
    if ngl == "all":
        wanted = "cuda"
    else:
        try:
            n = int(ngl)
        except ValueError:
            raise RunError(f"-ngl/--n-gpu-layers: expected a number, 'auto' or 'all', got {ngl!r}") from None
        if n < -1:  # llama.cpp: -1 = auto
            raise RunError(f"-ngl/--n-gpu-layers: must be >= 0, 'auto' or 'all', got {n}")
        if n == -1:
            return args.device or "cpu"
        wanted = "cuda" if n > 0 else "cpu"
    if args.device is not None and device_kind(args.device) != wanted:
        raise RunError(f"-ngl/--n-gpu-layers: {ngl} means --device {wanted}, but --device {args.device} was given")
    return wanted if args.device is None else args.device  # "cuda:1" stays that GPU


def _placement(args: argparse.Namespace) -> dict:
    """Model's device=, or with --devices its devices=, split= and tensor_split= (Model checks them)."""
    if args.devices is not None and args.device is not None:
        raise RunError(f"--device {args.device} and --devices {','.join(args.devices)}: pass one of them")
    try:
        split = split_from_flags(args.devices, args.split_mode, args.tensor_split, args.n_gpu_layers)
    except ValueError as e:
        raise RunError(str(e)) from None
    if split is None:
        return {"device": _device(args)}
    devices, shares = split
    return {"devices": devices, "split": args.split_mode or "layer", "tensor_split": shares or None}


def _check_ngl_device(args: argparse.Namespace, device: str | None) -> None:
    # a llama.cpp habit (-ngl 99) on a CPU-only build: say which flag asked for the GPU, before the
    # engine's own message (which knows only the device name) would
    from . import _core

    if device is None:  # --devices: Model checks each
        return
    if args.n_gpu_layers not in (None, "auto", "-1") and device_kind(device) == "cuda" and not _core.has_device("cuda"):
        raise RunError(f"-ngl/--n-gpu-layers {args.n_gpu_layers}: asks for the GPU, but this build of deltaspec "
                       "has no CUDA device; use -ngl 0 (CPU), or build with CUDA (README, Building)")


def _template_kwargs(args: argparse.Namespace) -> dict:
    if args.chat_template_kwargs is None:
        return {}
    import json

    try:
        kw = json.loads(args.chat_template_kwargs)
    except ValueError as e:
        raise RunError(f"--chat-template-kwargs: not valid JSON ({e})") from None
    if not isinstance(kw, dict) or set(kw) - {"enable_thinking"} or \
            not isinstance(kw.get("enable_thinking", True), bool):
        raise RunError('--chat-template-kwargs: expected a JSON object like {"enable_thinking": false}, '
                       f"got {args.chat_template_kwargs}")
    return kw


def _model_kwargs(args: argparse.Namespace) -> dict:
    for flag, value, lo in (("-t/--threads", args.threads, 1), ("-ub/--ubatch-size", args.ubatch_size, 1),
                            ("-b/--batch-size", args.batch_size, 1), ("-c/--ctx-size", args.ctx_size, 0)):
        if value is not None and value < lo:
            raise RunError(f"{flag}: must be >= {lo}, got {value}")
    n_ctx = args.ctx_size
    if n_ctx == 0:  # llama.cpp: 0 = the model's own context length
        from .gguf_file import read_gguf
        from .qwen35 import read_hparams

        n_ctx = read_hparams(read_gguf(args.model)).n_ctx_train
    # llama.cpp caps the physical batch at the logical one; this engine has only the physical one
    return dict(n_ctx=n_ctx, n_threads=args.threads, n_ubatch=min(args.batch_size, args.ubatch_size),
                **_placement(args), type_k=args.cache_type_k, type_v=args.cache_type_v,
                # -v: plain progress lines when stderr is not a terminal (a bar on one, as without -v)
                progress=False if args.log_disable else True if args.verbose else None)


def _spec_kwargs(args: argparse.Namespace) -> dict:
    """generate()'s speculative-decoding keyword arguments, checked before any model loads."""
    if args.model_draft is None and args.spec_type is None:
        for flag, value, default in (("--spec-draft-n-max", args.spec_draft_n_max, 16),
                                     ("--spec-draft-n-min", args.spec_draft_n_min, 0),
                                     ("--spec-tree-budget", args.spec_tree_budget, 0)):
            if value != default:
                raise RunError(f"{flag}: only used with -md/--model-draft or --spec-type")
        return {}
    if args.spec_type == "ngram-simple" and args.model_draft is not None:
        raise RunError("--spec-type: ngram-simple drafts from the text itself; do not pass -md/--model-draft")
    if args.spec_type in ("mtp", "draft-mtp") and args.model_draft is not None:
        raise RunError(f"--spec-type: {args.spec_type} drafts with the model's own MTP layer; do not pass -md/--model-draft")
    if args.spec_type in (None, "draft-simple", "dflash", "draft-dflash") and args.model_draft is None:
        raise RunError(f"--spec-type: {args.spec_type or 'draft-simple'} needs a draft model (-md/--model-draft FNAME)")
    for flag, value, lo in (("--spec-draft-n-max", args.spec_draft_n_max, 1),
                            ("--spec-draft-n-min", args.spec_draft_n_min, 0),
                            ("--spec-tree-budget", args.spec_tree_budget, 0)):
        if not lo <= value <= 256:
            raise RunError(f"{flag}: must be in [{lo}, 256], got {value}")
    if args.spec_draft_n_min > args.spec_draft_n_max:
        raise RunError(f"--spec-draft-n-min: {args.spec_draft_n_min} exceeds --spec-draft-n-max "
                       f"({args.spec_draft_n_max})")
    if args.model_draft is not None:
        import os

        if not os.path.isfile(args.model_draft):
            raise RunError(f"-md/--model-draft: no such file: {args.model_draft}")
    return dict(draft_model=args.model_draft, spec_type=args.spec_type or "draft-simple",
                draft_n_max=args.spec_draft_n_max, draft_n_min=args.spec_draft_n_min,
                tree_budget=args.spec_tree_budget)


def _grammar_kwargs(args: argparse.Namespace) -> dict:
    """generate()'s `grammar` from --grammar / --grammar-file / -j / -jf, compiled before the model loads."""
    from .errors import GrammarError
    from .grammar import Grammar

    given = {flag: value for flag, value in zip(GRAMMAR_FLAGS, (args.grammar, args.grammar_file, args.json_schema,
                                                               args.json_schema_file)) if value is not None}
    if not given:
        return {}
    if len(given) > 1:
        raise RunError(f"{' and '.join(given)}: give one grammar or JSON schema, not several")
    (flag, value), = given.items()
    try:
        if GRAMMAR_FLAGS[flag] == "text":
            grammar = Grammar.from_string(_escaped(args, value))
        elif GRAMMAR_FLAGS[flag] == "file":
            grammar = Grammar.from_file(value)
        elif GRAMMAR_FLAGS[flag] == "schema":
            grammar = Grammar.from_json_schema(value)
        else:
            try:
                with open(value, encoding="utf-8") as f:
                    grammar = Grammar.from_json_schema(f.read())
            except OSError as e:
                raise RunError(f"{flag}: cannot read {value}: {e.strerror}") from None
    except GrammarError as e:
        raise RunError(f"{flag}: {e}") from None
    return {"grammar": grammar}


def _run(args: argparse.Namespace) -> int:
    if args.flash_attn == "off":
        raise RunError("-fa/--flash-attn: off is not available: attention here always runs as ggml's flash "
                       "attention (on / auto)")
    prompt = _read_prompt(args)
    if prompt is None and not args.interactive:
        raise RunError("one of -p/--prompt, -f/--file or -i/--interactive is required")
    system = _system_prompt(args, prompt)
    sampling = _sampling_kwargs(args)
    sampling.update(_spec_kwargs(args))
    sampling.update(_grammar_kwargs(args))
    if "grammar" in sampling and "reasoning_budget" in sampling:
        raise RunError("--reasoning-budget: cannot be combined with a grammar or JSON schema (it constrains the "
                       "whole reply, a <think> block included)")
    template_kwargs = _template_kwargs(args)
    if template_kwargs and not args.interactive:
        raise RunError("--chat-template-kwargs: only used with -i/--interactive")
    if "grammar" in sampling and args.interactive:
        # the grammar constrains each whole reply: no reasoning block before it
        template_kwargs.setdefault("enable_thinking", False)
    template = _chat_template(args)
    if template is not None:
        template_kwargs["chat_template"] = template
    model_kwargs = _model_kwargs(args)
    if args.verbose and not args.log_disable:
        shown = {k: v for k, v in {**model_kwargs, **sampling}.items() if k != "progress"}
        print("deltaspec: " + ", ".join(f"{k}={v}" for k, v in shown.items()), file=sys.stderr)
    if hasattr(sys.stdout, "reconfigure"):  # never die on a character the terminal cannot show
        sys.stdout.reconfigure(errors="replace")

    from .model import Model

    _check_ngl_device(args, model_kwargs.get("device"))
    with Model(args.model, **model_kwargs) as model:
        log = not args.log_disable
        if args.interactive and "chat_template" not in template_kwargs:  # --chat-template's compiled already
            _check_model_template(model)
        if sampling["seed"] is None and sampling["temperature"] > 0:
            # llama.cpp draws a 32-bit seed and prints it so a run can be repeated with -s
            import secrets

            sampling["seed"] = secrets.randbits(32)
            if log:
                print(f"deltaspec: seed {sampling['seed']} (random; -s {sampling['seed']} repeats this run)",
                      file=sys.stderr)
        if args.interactive:
            return _chat(model, system, sampling, template_kwargs, log)
        return _complete(model, prompt, sampling, display_prompt=not args.no_display_prompt, log=log)


def _complete(model, prompt: str, sampling: dict, display_prompt: bool, log: bool) -> int:
    out = sys.stdout
    stream = model.generate(prompt, stream=True, **sampling)
    try:
        if display_prompt:
            out.write(prompt)
            out.flush()
        for piece in stream:
            out.write(piece)
            out.flush()
    finally:
        stream.close()  # cancels the generation when interrupted
    out.write("\n")
    out.flush()
    if log:
        _print_timing(stream.result, speculative="spec_type" in sampling)
    return 0


def _print_timing(r, speculative: bool) -> None:
    """llama-cli's closing line on stderr: prompt and generation speed, speculation, finish reason."""
    s = r.stats
    print(f"deltaspec: prompt {s.prompt_tokens} tokens in {1e3 * s.prefill_seconds:.1f} ms "
          f"({s.prefill_tokens_per_second:.1f} tok/s) | generated {s.generated_tokens} tokens in "
          f"{1e3 * s.decode_seconds:.1f} ms ({s.tokens_per_second:.1f} tok/s)"
          + (f" | drafted {s.n_drafted}, accepted {s.n_accepted} ({100 * s.acceptance_rate:.1f}%), "
             f"mean acceptance length {s.mean_acceptance_length:.2f}" if speculative else "")
          + (f", tree nodes {s.n_tree_nodes}" if s.n_tree_nodes else "")
          + f" | finish: {r.finish_reason}", file=sys.stderr)


def _read_turn(interactive: bool) -> str | None:
    """The next user line (None at end of input); raises KeyboardInterrupt on Ctrl-C."""
    if interactive:
        try:
            return input("> ")
        except EOFError:
            print()
            return None
    line = sys.stdin.readline()
    return line.rstrip("\r\n") if line else None


def _check_model_template(model) -> None:
    """-i without --chat-template: the GGUF's template must exist and compile, before any output."""
    from .chat import chat_template_from_metadata
    from .errors import ChatTemplateError

    if not model.metadata.get("tokenizer.chat_template"):
        raise RunError(f"-i/--interactive: {model.path} has no chat template (tokenizer.chat_template); "
                       "give one with --chat-template-file FILE")
    try:
        chat_template_from_metadata(model.metadata)  # a broken template fails now, not at the first turn
    except ChatTemplateError as e:
        raise RunError(f"-i/--interactive: {e}") from None


def _chat(model, system: str | None, sampling: dict, template_kwargs: dict, log: bool) -> int:
    from .chat import prompt_opens_reasoning, split_reasoning

    tty = sys.stdin.isatty()
    if tty:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    if log:
        print(f"deltaspec: chatting with {model.path}; /exit or end of input quits, /clear starts over, "
              "Ctrl-C stops a reply", file=sys.stderr)
    base = [{"role": "system", "content": system}] if system is not None else []
    messages = list(base)
    out = sys.stdout
    while True:
        try:
            line = _read_turn(tty)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        if line is None or line.strip() == "/exit":
            return 0
        if line.strip() == "/clear":
            messages = list(base)
            continue
        if not line.strip():
            continue
        turn = messages + [{"role": "user", "content": line}]
        text = []
        stream = None
        try:
            prompt = model.apply_chat_template(turn, **template_kwargs)
            # the reply as generated, reasoning included (as llama-cli shows it); split for the history below
            stream = model.generate(prompt, stream=True, **sampling)
            for piece in stream:
                text.append(piece)
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:  # cancel this reply; the turn is forgotten
            out.write("\n")
            out.flush()
            print("deltaspec: reply cancelled", file=sys.stderr)
            continue
        except ValueError as e:  # e.g. the conversation no longer fits the context
            out.write("\n")
            out.flush()
            print(f"deltaspec run: error: {_flag_error(e)} (/clear starts over)", file=sys.stderr)
            continue
        finally:
            if stream is not None:
                stream.close()
        out.write("\n")
        out.flush()
        if log:
            _print_timing(stream.result, speculative="spec_type" in sampling)
        reasoning, content = split_reasoning("".join(text), thinking_open=prompt_opens_reasoning(prompt))
        reply = {"role": "assistant", "content": content}
        if reasoning is not None:
            reply["reasoning_content"] = reasoning
        messages = turn + [reply]


def _run_convert(args: argparse.Namespace) -> int:
    from .convert import convert_hf_to_gguf
    from .convert_dflash import convert_dflash_to_gguf, is_dflash_checkpoint
    from .errors import ConversionError

    if is_dflash_checkpoint(args.hf_dir):
        if args.target is None:
            raise ConversionError(f"{args.hf_dir} is a DFlash drafter, which has no tokenizer of its own: give "
                                  "--target TARGET (the target model's HF folder or GGUF)")
        if args.no_mtp:
            raise ConversionError("--no-mtp: a DFlash drafter has no MTP layer")
        convert_dflash_to_gguf(args.hf_dir, args.out, args.target, outtype=args.outtype)
        return 0
    if args.target is not None:
        raise ConversionError(f"--target is for DFlash drafter checkpoints; {args.hf_dir} is not one")
    convert_hf_to_gguf(args.hf_dir, args.out, outtype=args.outtype, mtp=not args.no_mtp)
    return 0


def _run_info(args: argparse.Namespace) -> int:
    from .info import print_info

    shares = None
    if args.tensor_split is not None:
        from .devices import parse_shares

        try:
            shares = parse_shares(args.tensor_split)
        except (TypeError, ValueError) as e:
            print(f"deltaspec info: error: -ts/--tensor-split: {e}", file=sys.stderr)
            return 2
    print_info(args.model, n_ctx=args.ctx_size, tensor_split=shares)
    return 0


def _run_synth(args: argparse.Namespace) -> int:
    from .synth import SynthError, print_progress, write_synthetic_gguf

    template = None
    if args.chat_template is not None:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise SynthError(f"{args.chat_template}: cannot read the chat template ({e.strerror})") from None
    if args.seed < 0 or (args.threads is not None and args.threads < 1):
        raise SynthError("--seed must be >= 0 and --threads >= 1")
    r = write_synthetic_gguf(args.out, args.preset, args.quant, seed=args.seed, progress=print_progress(),
                             mtp=args.mtp, chat_template=template, threads=args.threads)
    mix = ", ".join(f"{t} {100 * b / sum(r.type_bytes.values()):.1f}%" for t, b in r.type_bytes.items())
    print(f"wrote {r.path}: {r.n_bytes / 1e9:.2f} GB in {r.seconds:.1f} s ({r.mb_per_s:.0f} MB/s); {mix}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # a bare `deltaspec` asks what the tool does: the full help, not an error
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    if args.command is None:  # only top-level flags, none of them --help / --version
        parser.error("a command is required (run, serve, info, convert, synth)")
    from .errors import DeltaspecError

    try:
        return args.run(args)
    except DeltaspecError as e:
        print(f"deltaspec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
