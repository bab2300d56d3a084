"""`deltaspec serve` and `python -m deltaspec.server`: flags (llama-server's names), model loading,
and the uvicorn server with graceful shutdown (SIGTERM / SIGINT: new requests are refused with 503,
running ones finish within --timeout-graceful seconds, then whatever is left is cancelled; exit 0)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from ..devices import DEVICE_KINDS, add_split_arguments, device_arg, device_kind, split_from_flags

DESCRIPTION = """Serve a qwen35 GGUF over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions (streamed as
server-sent events), /v1/embeddings, /v1/models, /health and /metrics (Prometheus), and llama-server's
/completion, /infill, /tokenize, /detokenize and /apply-template. --parallel N requests decode together in one
batch per step; more wait in a queue of --queue-size (then 429). -c is the context of each slot (llama-server
divides its -c among its -np slots). Speculative decoding (-md / --spec-type: a draft model, prompt lookup, a
DFlash drafter or the model's MTP layer) at any -np: every step verifies the drafts of all running requests in
one target pass. --replicas DEV,DEV,...: one copy of the model per device (and of the draft model), each with
its own -np slots, behind one queue."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, metavar="FNAME", help="path to a qwen35 .gguf file")
    p.add_argument("-a", "--alias", default=None, metavar="NAME",
                   help="the model's name in the API (default: the file name without .gguf)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one (default: %(default)s)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics (default: none)")
    p.add_argument("-np", "--parallel", type=int, default=4, metavar="N",
                   help="sequence slots: requests decoded together (default: %(default)s)")
    p.add_argument("--queue-size", type=int, default=256, metavar="N",
                   help="requests that may wait for a slot; beyond it 429 (default: %(default)s)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, metavar="N",
                   help="context of each slot in tokens: prompt + completion (default: %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N", help="CPU threads (default: all usable)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, metavar="N",
                   help="largest batch of prompt tokens per graph (default: %(default)s)")
    p.add_argument("--prefill-budget", type=int, default=512, metavar="N",
                   help="prompt tokens prefilled per engine step at most; the running requests decode in every "
                        "step, so new or long prompts do not stall them (a longer prompt is split over steps; "
                        "0: no limit; default: %(default)s)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", metavar="TYPE", help="KV cache type for K (default: f16)")
    p.add_argument("-ctv", "--cache-type-v", default="f16", metavar="TYPE", help="KV cache type for V (default: f16)")
    p.add_argument("--device", default=None, type=device_arg, metavar="{cpu,cuda,cuda:N}",
                   help="cuda = cuda:0, the first GPU (default: cpu, or cuda with -ngl > 0)")
    p.add_argument("--replicas", default=None, metavar="DEV,DEV,...",
                   help="one replica of the model per listed device (cpu, cuda, cuda:N; a device may repeat), "
                        "each with its own --parallel slots and -c context and, with -md, its own draft model; "
                        "one --queue-size for the whole server. Requests go to the replica that kept the "
                        "history their prompt extends (a chat's next turn), else to the least busy one. "
                        "A CPU replica runs -t threads: give -t cores / replicas (default: one replica, --device)")
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", default=None, metavar="N",
                   help="0 = CPU; N >= 1 or 'all' = the whole model on the GPU (--device cuda)")
    add_split_arguments(p, devices_note="; -md goes on the first")
    p.add_argument("-md", "--model-draft", default=None, metavar="FNAME",
                   help="draft model (spec-type draft-simple) or DFlash block drafter (spec-type draft-dflash)")
    p.add_argument("--spec-type", default=None,
                   choices=["draft-simple", "ngram-simple", "draft-dflash", "dflash", "draft-mtp", "mtp"],
                   help="speculative decoding: draft-simple (with -md), ngram-simple (prompt lookup), "
                        "draft-dflash (alias dflash; with -md a DFlash drafter: one pass drafts a block, each "
                        "request in its own drafter slot) or draft-mtp (alias mtp: the model's own MTP layer, "
                        "a head per request)")
    p.add_argument("--spec-draft-n-max", type=int, default=16, metavar="N", help="longest draft (default: %(default)s)")
    p.add_argument("--spec-draft-n-min", type=int, default=0, metavar="N", help="shortest draft (default: %(default)s)")
    p.add_argument("--spec-tree-budget", type=int, default=0, metavar="N",
                   help="draft trees of up to N nodes verified in one pass (draft-simple: best-first from the "
                        "draft model; ngram-simple: where the text went on differently; draft-dflash: DDTree over "
                        "one block; draft-mtp: the head's alternatives along its chain); 0: chains "
                        "(default: %(default)s)")
    p.add_argument("--pooling", default="last", choices=["last", "mean"],
                   help="/v1/embeddings: an input's embedding is its last token's final hidden state (last) or "
                        "their mean, normalized to length 1 (default: %(default)s)")
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the GGUF's")
    p.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="chat requests' default budget: tokens a <think> block may hold, then its </think> is "
                        "forced (a request's reasoning_budget_tokens, or Anthropic's thinking.budget_tokens, "
                        "sets its own); -1 = no budget, 0 = close it at once (default: %(default)s)")
    p.add_argument("--reasoning-budget-message", default="", metavar="TEXT",
                   help="text forced before </think> when a reasoning budget runs out (a request's "
                        "reasoning_budget_message sets its own; default: none)")
    p.add_argument("--timeout-graceful", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds running requests get to finish (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def build_parser() -> argparse.ArgumentParser:
    from ..cli_args import StrictParser

    p = StrictParser(prog="deltaspec serve", description=DESCRIPTION)
    add_arguments(p)
    return p


def add_serve_parser(sub) -> None:
    """The `serve` subcommand of the `deltaspec` CLI."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)", description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(run=run)


class ServeError(Exception):
    """A bad `serve` flag: printed as one line, exit status 2."""


def _device(args) -> str:
    if args.n_gpu_layers is None:
        return args.device or "cpu"
    wants_gpu = args.n_gpu_layers in ("all", "auto") or (args.n_gpu_layers.isdigit() and int(args.n_gpu_layers) > 0)
    if not (args.n_gpu_layers in ("all", "auto") or args.n_gpu_layers.isdigit()):
        raise ServeError(f"-ngl: expected a number of layers or 'all', got {args.n_gpu_layers!r}")
    device = "cuda" if wants_gpu else "cpu"
    if args.device is not None and device_kind(args.device) != device:
        raise ServeError(f"-ngl {args.n_gpu_layers} asks for {device} but --device is {args.device}")
    return device if args.device is None else args.device  # "cuda:1" stays that GPU


MAX_REPLICAS = 64


def _replica_devices(args) -> list[str] | None:
    """--replicas as a list of devices (None without it)."""
    if args.replicas is None:
        return None
    devices = [d.strip() for d in args.replicas.split(",")]
    for d in devices:
        try:
            device_kind(d, "--replicas: each device")
        except ValueError as e:
            raise ServeError(f"{e} (in --replicas {args.replicas!r})") from None
    if len(devices) > MAX_REPLICAS:
        raise ServeError(f"--replicas: at most {MAX_REPLICAS} devices, got {len(devices)}")
    if args.device is not None:  # kept for scripts that always pass --device (bench/server_bench.py --variant)
        if args.device not in DEVICE_KINDS:
            raise ServeError(f"--device {args.device} names one device, but --replicas names every replica's: "
                             "leave out --device, or give only the kind (cpu, cuda)")
        for d in devices:
            if device_kind(d) != args.device:
                raise ServeError(f"--device {args.device} but --replicas has {d}")
    if args.n_gpu_layers is not None:
        wanted = _device(args)
        for d in devices:
            if device_kind(d) != wanted:
                raise ServeError(f"-ngl {args.n_gpu_layers} asks for {wanted} but --replicas has {d}")
    from .. import _core

    for d in devices:  # before any replica loads (the engine would say so only when its turn came)
        if not _core.has_device(d):
            raise ServeError(f"--replicas: device {d!r} is not available in this build of deltaspec on this "
                             "machine (a CPU-only build, or no such GPU)")
    return devices


def _speculation(args) -> dict | None:
    if args.model_draft is None and args.spec_type is None:
        return None
    spec_type = args.spec_type or "draft-simple"
    if spec_type in ("draft-simple", "draft-dflash", "dflash") and args.model_draft is None:
        raise ServeError(f"--spec-type {spec_type} needs -md/--model-draft")
    if spec_type == "ngram-simple" and args.model_draft is not None:
        raise ServeError("--spec-type ngram-simple drafts from the text itself; leave out -md")
    if spec_type in ("draft-mtp", "mtp") and args.model_draft is not None:
        raise ServeError(f"--spec-type {spec_type} drafts with the model's own MTP layer; leave out -md")
    return {"spec_type": spec_type, "draft_model": args.model_draft, "draft_n_max": args.spec_draft_n_max,
            "draft_n_min": args.spec_draft_n_min, "tree_budget": args.spec_tree_budget}


def _served(model, args):
    from ..chat import ChatTemplate, chat_template_from_metadata
    from ..errors import ChatTemplateError
    from .schemas import Served

    if args.chat_template_file is not None:
        try:
            with open(args.chat_template_file, encoding="utf-8") as f:
                template = ChatTemplate(f.read())
        except OSError as e:
            raise ServeError(f"--chat-template-file: {e}") from None
    else:
        try:
            template = chat_template_from_metadata(model.metadata)
        except ChatTemplateError as e:
            logging.getLogger("deltaspec.server").warning("%s: /v1/chat/completions answers 400 (%s)", args.model, e)
            template = None
    if args.reasoning_budget < -1:
        raise ServeError(f"--reasoning-budget: must be -1 (no budget) or >= 0, got {args.reasoning_budget}")
    name = args.alias or os.path.basename(args.model).removesuffix(".gguf")
    return Served(name=name, n_ctx=model.n_ctx, tokenize=lambda text: model.tokenize(text, special=True),
                  n_vocab=model.n_vocab, template=template, aliases=(args.model, os.path.abspath(args.model)),
                  tokenizer=model.tokenizer, pooling=args.pooling,
                  reasoning_budget=None if args.reasoning_budget == -1 else args.reasoning_budget,
                  reasoning_budget_message=args.reasoning_budget_message)


def _layer_split(args) -> tuple[list[str], list[float]] | None:
    """--devices / -sm / -ts checked (None without --devices)."""
    if args.devices is not None:
        for flag, value in (("--device", args.device), ("--replicas", args.replicas)):
            if value is not None:
                raise ServeError(f"--devices {args.devices} and {flag} {value}: pass one of them")
    try:
        return split_from_flags(args.devices, args.split_mode, args.tensor_split, args.n_gpu_layers)
    except ValueError as e:
        raise ServeError(str(e)) from None


def _load(args, device: str, speculation: dict | None, split: tuple[list[str], list[float]] | None = None):
    """(Model, backend) on `device` (or split over split's devices): the target and, with -md, a draft
    model of its own there (on the split's first device)."""
    from ..model import Model
    from .backend import make_backend

    kwargs = {"n_threads": args.threads} if args.threads is not None else {}
    placement = {"device": device} if split is None else {"devices": split[0], "tensor_split": split[1] or None}
    model = Model(args.model, n_ctx=args.ctx_size, n_seq_max=args.parallel, n_ubatch=args.ubatch_size,
                  type_k=args.cache_type_k, type_v=args.cache_type_v, **placement, **kwargs)
    device = model.device
    if speculation and speculation["spec_type"] in ("draft-dflash", "dflash"):
        from ..dflash import Drafter  # on the target's device, a context slot per request

        speculation = {**speculation, "draft_model": Drafter(speculation["draft_model"], target=model)}
    elif speculation and speculation["draft_model"] is not None:
        # a slot per request: the batch backend drafts for every running request at once
        speculation = {**speculation, "draft_model": Model(speculation["draft_model"], n_ctx=args.ctx_size,
                                                            device=device, n_seq_max=args.parallel, **kwargs)}
    model.set_prefill_budget(args.prefill_budget)
    return model, make_backend(model, args.parallel, speculation)


def serve(args) -> int:
    import uvicorn

    from .app import Server, ServerState, create_app
    from .engine_loop import EngineLoop
    from .metrics import ServerMetrics
    from .replicas import ReplicaSet

    for flag, value in (("--parallel", args.parallel), ("--queue-size", args.queue_size), ("-c", args.ctx_size)):
        if value < 1:
            raise ServeError(f"{flag} must be >= 1, got {value}")
    if args.prefill_budget < 0:
        raise ServeError(f"--prefill-budget must be >= 0 (0: no limit), got {args.prefill_budget}")
    if not 0 <= args.port <= 65535:
        raise ServeError(f"--port must be in [0, 65535], got {args.port}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    speculation = _speculation(args)
    split = _layer_split(args)
    replica_devices = _replica_devices(args)
    if replica_devices is None:
        device = _device(args) if split is None else ",".join(split[0])
        model, backend = _load(args, None if split else device, speculation, split)
        metrics = ServerMetrics(backend.slots, args.queue_size, speculation is not None)
        engine = EngineLoop(backend, metrics, args.queue_size)
        slots = backend.slots
    else:
        device = ",".join(replica_devices)
        loaded = [_load(args, d, speculation) for d in replica_devices]
        model = loaded[0][0]  # every replica is the same file: any one tokenizes and describes it
        slots = sum(b.slots for _, b in loaded)
        metrics = ServerMetrics(slots, args.queue_size, speculation is not None,
                                replicas=[(d, b.slots) for d, (_, b) in zip(replica_devices, loaded)])
        engine = ReplicaSet(metrics, args.queue_size)
        for d, (_, backend) in zip(replica_devices, loaded):
            engine.add(d, backend)
    served = _served(model, args)
    info = {"n_ctx": model.n_ctx, "n_vocab": model.n_vocab, "parallel": slots, "device": device,
            "speculation": None if speculation is None else speculation["spec_type"]}
    if replica_devices is not None:
        info["replicas"] = replica_devices
    state = ServerState(served, engine, metrics, args.api_key, int(time.time()), info)
    config = uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.timeout_graceful, access_log=False)
    Server(config, engine).run()
    return 0


def run(args) -> int:
    try:
        return serve(args)
    except ServeError as e:
        print(f"deltaspec serve: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    from ..errors import DeltaspecError

    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except DeltaspecError as e:
        print(f"deltaspec serve: error: {e}", file=sys.stderr)
        return 2
