"""`deltaspec.Llama`: `Model` under llama-cpp-python's class name, for code written against
`llama_cpp.Llama`. The differences are where llama-cpp-python works in bytes: `tokenize` takes
(text, add_bos, special) in that order and `detokenize` returns bytes."""

from __future__ import annotations

import os
from typing import Any, Sequence

from .chat_template_names import BUILTIN_CHAT_TEMPLATES
from .grammar import Grammar
from .llama_args import default_seed, llama_only_options
from .model import Model


class LlamaGrammar(Grammar):
    """llama-cpp-python's `LlamaGrammar` names on `Grammar`: from_string / from_file /
    from_json_schema take its `verbose` argument (nothing is printed here either way)."""

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True) -> "LlamaGrammar":
        return super().from_string(grammar)

    @classmethod
    def from_file(cls, file: str | os.PathLike[str], verbose: bool = True) -> "LlamaGrammar":
        return super().from_file(file)

    @classmethod
    def from_json_schema(cls, json_schema: str, verbose: bool = True) -> "LlamaGrammar":
        return super().from_json_schema(json_schema)


class _CallableInt(int):
    """An int that also answers a call with itself: `llm.n_ctx` is Model's int and llama-cpp-python's
    `llm.n_ctx()` works too."""

    def __call__(self) -> int:
        return int(self)


class Llama(Model):
    """`Model` with llama-cpp-python's byte-level tokenize / detokenize and its accessors (n_ctx(),
    n_vocab(), n_embd(), token_bos(), token_eos(), set_seed(), model_path). Construct it as
    `Llama(model_path=..., n_ctx=..., n_gpu_layers=-1, seed=..., verbose=False)`; llama-cpp-python's
    other options are taken where they change nothing here and refused otherwise
    (deltaspec.llama_args.llama_only_options), type_k / type_v also as ggml_type ids, and
    chat_format "chatml" or "qwen35" as the chat template of create_chat_completion /
    apply_chat_template (None: the GGUF's)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.chat_format = llama_only_options(kwargs)
        super().__init__(*args, **kwargs)

    def _with_chat_format(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.chat_format is not None and kwargs.get("chat_template") is None:
            kwargs["chat_template"] = BUILTIN_CHAT_TEMPLATES[self.chat_format]
        return kwargs

    def create_chat_completion(self, messages: Sequence[dict], stream: bool = False, **kwargs: Any):
        return super().create_chat_completion(messages, stream=stream, **self._with_chat_format(kwargs))

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return super().apply_chat_template(messages, add_generation_prompt, **self._with_chat_format(kwargs))

    @property
    def n_ctx(self) -> int:
        return _CallableInt(super().n_ctx)

    @property
    def n_vocab(self) -> int:
        return _CallableInt(super().n_vocab)

    def n_embd(self) -> int:
        return self.hparams.n_embd

    @property
    def model_path(self) -> str:
        return self.path

    def token_bos(self) -> int:
        """The BOS token's id, -1 when the vocabulary has none (llama.cpp's LLAMA_TOKEN_NULL)."""
        return -1 if self.tokenizer.bos_id is None else self.tokenizer.bos_id

    def token_eos(self) -> int:
        """The EOS token's id (Qwen3.5's <|im_end|> in chat models), -1 when the vocabulary has none."""
        return -1 if self.tokenizer.eos_id is None else self.tokenizer.eos_id

    def set_seed(self, seed: int) -> None:
        """The default sampling seed of later calls (seed=None); -1 (or 0xFFFFFFFF): random per call."""
        self._default_seed = default_seed(seed)

    def tokenize(self, text: bytes | str, add_bos: bool = True, special: bool = False) -> list[int]:
        return super().tokenize(text, special=special, add_bos=add_bos)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        """The bytes of `tokens` (prev_tokens is accepted for llama-cpp-python's signature: this
        byte-level BPE's pieces do not depend on the tokens before them)."""
        arr = self._token_array(tokens, "tokens", allow_empty=True)
        return self.tokenizer.decode_bytes(arr.tolist(), special=special)
