"""llama.cpp's convert_hf_to_gguf.py (from the pinned tree) for the testbed's own BPE vocabulary.

llama.cpp's converter names the pre-tokenizer by hashing the tokenizer's output on a fixed text, and
knows only published vocabularies' hashes. The testbed's BPE uses Qwen3.5's pipeline (qwen35
regex, byte-level, NFC) with its own merges, so this wrapper answers "qwen35" where the hash is
unknown, and changes nothing else: every tensor and every other key is the converter's own.

    python bench/testbed/llama_convert.py LLAMA_CPP_DIR [convert_hf_to_gguf.py arguments...]
"""

from __future__ import annotations

import sys
from pathlib import Path


def run(llama_dir: Path, argv: list[str]) -> None:
    sys.path.insert(0, str(llama_dir))
    sys.path.insert(1, str(llama_dir / "gguf-py"))
    import conversion.base as base

    known = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:  # an unpublished vocabulary: the testbed's is always Qwen3.5-style
            return "qwen35"

    base.TextModel.get_vocab_base_pre = vocab_base_pre
    import convert_hf_to_gguf
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2:])
