"""`deltaspec.Llama`: `Model` under llama-cpp-python's class name, for code written against
`llama_cpp.Llama`. The differences are where llama-cpp-python works in bytes: `tokenize` takes
(text, add_bos, special) in that order and `detokenize` returns bytes."""

from __future__ import annotations

from typing import Sequence

from .model import Model


class Llama(Model):
    """`Model` with llama-cpp-python's byte-level tokenize / detokenize. Construct it as
    `Llama(model_path=..., n_ctx=..., n_gpu_layers=-1, seed=..., verbose=False)`."""

    def tokenize(self, text: bytes | str, add_bos: bool = True, special: bool = False) -> list[int]:
        return super().tokenize(text, special=special, add_bos=add_bos)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        """The bytes of `tokens` (prev_tokens is accepted for llama-cpp-python's signature: this
        byte-level BPE's pieces do not depend on the tokens before them)."""
        arr = self._token_array(tokens, "tokens", allow_empty=True)
        return self.tokenizer.decode_bytes(arr.tolist(), special=special)
