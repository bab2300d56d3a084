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
    return parser


def _run_convert(args: argparse.Namespace) -> int:
    from .convert import convert_hf_to_gguf

    convert_hf_to_gguf(args.hf_dir, args.out, outtype=args.outtype)
    return 0


def _run_info(args: argparse.Namespace) -> int:
    from .info import print_info

    print_info(args.model, n_ctx=args.ctx_size)
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
