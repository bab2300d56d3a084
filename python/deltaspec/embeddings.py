"""Embeddings as llama-cpp-python's `embed` / `create_embedding`: the model's final hidden state (after
the output norm: what llama.cpp returns as embeddings, `t_embd`), pooled per input.

Pooling: "last" (default: the last token's state, which in a causal model has read the whole
input; Qwen3's embedding models pool so), "mean" over the tokens, or "none" (one vector per
token, as llama-cpp-python returns for a model without a pooling type). normalize=True divides
each vector by its Euclidean norm; off by default, as in llama-cpp-python's `embed`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

POOLINGS = ("last", "mean", "none")


def hidden_states(model, text: str) -> np.ndarray:
    """(n_tokens, n_embd) final hidden states of `text` on a fresh sequence."""
    return hidden_states_of_ids(model, model.tokenize(text, special=True))


def hidden_states_of_ids(model, ids: Sequence[int]) -> np.ndarray:
    """(n_tokens, n_embd) final hidden states of token ids on a fresh sequence."""
    from .generation import engine_of

    if not ids:
        raise ValueError("cannot embed an empty text (it has no tokens)")
    if len(ids) > model.n_ctx:
        raise ValueError(f"the text has {len(ids)} tokens but the context holds {model.n_ctx} (n_ctx)")
    with engine_of(model) as engine:
        model._cached_tokens = None
        engine.reset()
        try:
            return engine.eval_hidden(np.asarray(ids, dtype=np.int32))
        finally:
            engine.reset()
            model._cached_tokens = []


def embed(model, input: str | Sequence[str], normalize: bool = False, pooling: str = "last",
          return_count: bool = False) -> Any:
    """One embedding (a list of floats; a list of them per token for pooling "none") per input
    text; a str input gives one embedding, a list a list of them. return_count adds the token count."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be True or False, got {normalize!r}")
    single = isinstance(input, str)
    texts = [input] if single else input
    if isinstance(texts, (bytes, bytearray)) or not isinstance(texts, Sequence) or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"input must be a str or a list of str, got {input!r:.80}")
    out, n_tokens = [], 0
    for text in texts:
        h = hidden_states(model, text)
        n_tokens += len(h)
        vecs = pool(h, pooling, normalize)
        out.append(vecs.tolist() if pooling == "none" else vecs[0].tolist())
    result = out[0] if single else out
    return (result, n_tokens) if return_count else result


def pool(h: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    """(1, n_embd) float64 of (n_tokens, n_embd) hidden states (pooling "none": every row),
    each row divided by its Euclidean norm when `normalize`."""
    h = h.astype(np.float64)
    vecs = h[-1:] if pooling == "last" else h.mean(axis=0, keepdims=True) if pooling == "mean" else h
    if normalize:
        norms = np.linalg.norm(vecs, axis=1, keepdims=True)
        vecs = np.where(norms > 0, vecs / np.where(norms > 0, norms, 1), vecs)
    return vecs


def create_embedding(model, input: str | Sequence[str], model_name: str | None = None, **kwargs: Any) -> dict:
    """An OpenAI `list` of `embedding` objects, as llama-cpp-python's create_embedding."""
    texts = [input] if isinstance(input, str) else input
    vectors, n_tokens = embed(model, texts, return_count=True, **kwargs)
    return {"object": "list",
            "data": [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)],
            "model": model_name if model_name is not None else model.path,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
