"""`Model.save_state()` / `Model.load_state()`, as llama-cpp-python's: a snapshot of the sequence (its
tokens, the KV rows it wrote and the Gated DeltaNet recurrent state) that a later generate() resumes
from without re-reading the tokens it holds.

A recurrent layer's state is the whole history folded into a fixed-size matrix; it cannot be cut
back to a prefix the way a KV cache can. So a snapshot is the only way to resume below the newest
position, and a resumed prompt must extend the snapshot's tokens exactly (generate() checks; any
other prompt starts from an empty sequence)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LlamaState:
    """A saved sequence. `tokens` are the ids the state holds, in order; `tensors` maps a state tensor
    ("k.3", "v.3": the first n_tokens KV rows; "conv.0", "ssm.0": the recurrent state) to its bytes.
    `model` identifies the file and cache types it is valid for."""
    tokens: tuple[int, ...]
    tensors: dict[str, bytes] = field(repr=False)
    model: dict

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.tensors.values())


def identity(model) -> dict:
    """What a state must have been saved from to load into `model`: the same weights' shapes and
    the same KV cache types (the bytes are in those types)."""
    hp = model.hparams
    info = model._live().state_info
    types = sorted({(t["kind"], t["type"]) for t in info if t["kind"] in ("k", "v", "conv", "ssm")})
    return {"n_vocab": hp.n_vocab, "n_embd": hp.n_embd, "n_layer": hp.n_layer, "state_types": types}


def save(model) -> LlamaState:
    from .generation import engine_of

    with engine_of(model) as engine:
        tokens = model._cached_tokens
        if tokens is None or len(tokens) != engine.n_past:
            raise RuntimeError("save_state(): the tokens in this model's sequence are not known (it was last "
                               "changed by a batch, a speculative run or a step()); generate() or eval() first")
        tensors = dict(engine.save_sequence())
        return LlamaState(tuple(tokens), tensors, identity(model))


def load(model, state: LlamaState) -> None:
    from .generation import engine_of

    if not isinstance(state, LlamaState):
        raise TypeError(f"load_state() takes a LlamaState from save_state(), got {type(state).__name__}")
    if state.model != identity(model):
        raise ValueError(f"load_state(): the state was saved from another model or KV cache types "
                         f"({state.model}); this model is {identity(model)}")
    with engine_of(model) as engine:
        model._cached_tokens = None
        if state.n_tokens > engine.n_ctx:
            raise ValueError(f"load_state(): the state holds {state.n_tokens} tokens, more than n_ctx = {engine.n_ctx}")
        engine.load_sequence(state.n_tokens, list(state.tensors.items()))
        model._cached_tokens = list(state.tokens)
