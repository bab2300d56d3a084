"""`deltaspec` command line: subcommands follow llama.cpp's flag names where one exists."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert a Hugging Face Qwen3.5 text checkpoint to GGUF")
    p.add_argument("hf_dir", help="folder with config.json, *.safetensors and tokenizer files")
    p.add_argument("out", help="output .gguf path")
    p.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    p.set_defaults(run=_run_convert)

    p = sub.add_parser("info", help="print a qwen35 GGUF's architecture, sizes and quant mix")
    p.add_argument("model", help="path to a .gguf file")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size for the memory estimate")
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
    return parser


def _run_convert(args: argparse.Namespace) -> int:
    from .convert import convert_hf_to_gguf

    convert_hf_to_gguf(args.hf_dir, args.out, outtype=args.outtype)
    return 0


def _run_info(args: argparse.Namespace) -> int:
    from .info import print_info

    print_info(args.model, n_ctx=args.ctx_size)
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
    args = build_parser().parse_args(argv)
    from .errors import DeltaspecError

    try:
        return args.run(args)
    except DeltaspecError as e:
        print(f"deltaspec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
