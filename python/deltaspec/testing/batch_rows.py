"""Whether a model's rows depend on the batch computing them: the check behind batch_invariant."""

from __future__ import annotations

import numpy as np


def batch_vs_steps(model, rows: int, context: int, rng: np.random.Generator) -> float:
    """max |batch - steps|: the logits of `rows` random tokens computed in one batch against the
    same tokens as one-token steps, each after the same `context` random tokens (0.0: bitwise
    equal). The model's sequence is left holding the context and the tokens."""
    before = rng.integers(0, model.n_vocab, size=context).tolist()
    ids = rng.integers(0, model.n_vocab, size=rows).tolist()
    out = []
    for one_by_one in (False, True):
        model.reset()
        if before:
            model.eval(before)
        out.append(np.concatenate([model.eval([t]) for t in ids]) if one_by_one else model.eval(ids, logits="all"))
    return float(np.abs(out[0] - out[1]).max())
