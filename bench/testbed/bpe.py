"""A small byte-level BPE trained on the corpus, in the form deltaspec and llama.cpp both load.

The real Qwen3.5 vocabulary (248k rows) would make a trained embedding far larger than the files
the GPU machine can hand back, so the testbed trains its own: the same pipeline as Qwen3.5 (NFC,
the qwen35 pre-tokenizer regex, GPT-2 byte-to-unicode alphabet, BPE merges), a vocabulary of a few
thousand. Written as tokenizer.json, it converts to `tokenizer.ggml.model = gpt2`,
`tokenizer.ggml.pre = qwen35` (deltaspec's converter writes that pre-tokenizer name for every
Qwen3.5 folder; llama.cpp's converter is told the same by bench/testbed/llama_convert.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from deltaspec.tokenizer import PRE_TOKENIZER_REGEX

from shapes import EOS_TEXT, SPECIAL_TEXTS


def empty_tokenizer() -> tokenizers.Tokenizer:
    tk = tokenizers.Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tk.normalizer = normalizers.NFC()  # deltaspec normalises to NFC before splitting, as Qwen's do
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(PRE_TOKENIZER_REGEX["qwen35"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    return tk


def train(texts: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
    """BPE with the special tokens at ids 0, 1, then the 256 byte symbols, then merges."""
    tk = empty_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TEXTS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  min_frequency=2)
    tk.train_from_iterator(texts, trainer=trainer)
    if tk.get_vocab_size() != vocab_size:  # a corpus too small for the merges asked for
        raise ValueError(f"BPE training reached {tk.get_vocab_size()} tokens, expected {vocab_size}: corpus too small")
    return tk


def write_hf_files(tk: tokenizers.Tokenizer, folder: Path) -> None:
    """tokenizer.json + tokenizer_config.json, what both converters and transformers read."""
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TEXT, "pad_token": EOS_TEXT,
        "add_bos_token": False, "add_eos_token": False, "model_max_length": 4096,
    }, indent=1))
