"""Whether a model's rows depend on the batch computing them: the check behind batch_invariant."""

from __future__ import annotations

import numpy as np


def _batch_then_steps(model, rows: int, context: int, rng: np.random.Generator):
    """Draws `context` and `rows` random tokens, then evaluates the rows after the context once in one
    batch and once as one-token steps, yielding the logits after the batch, then after each step."""
    before = rng.integers(0, model.n_vocab, size=context).tolist()
    ids = rng.integers(0, model.n_vocab, size=rows).tolist()
    for one_by_one in (False, True):
        model.reset()
        if before:
            model.eval(before)
        if one_by_one:
            for t in ids:
                yield model.eval([t])
        else:
            yield model.eval(ids, logits="all")


def batch_vs_steps(model, rows: int, context: int, rng: np.random.Generator) -> float:
    """max |batch - steps|: the logits of `rows` random tokens computed in one batch against the
    same tokens as one-token steps, each after the same `context` random tokens (0.0: bitwise
    equal). The model's sequence is left holding the context and the tokens."""
    batch, *steps = _batch_then_steps(model, rows, context, rng)
    return float(np.abs(batch - np.concatenate(steps)).max())


def node_differences(model, rows: int, context: int, rng: np.random.Generator) -> list[dict]:
    """Where batch_vs_steps' difference arises: the step graphs' nodes (Engine capture_nodes) of the
    batch of `rows` tokens against those of the one-token steps, in the batch graph's order. The two
    kinds of graph differ in structure (the one-token step runs other DeltaNet ops), so a node is
    matched by its op, its first source (a weight's name, else that source's op), its row width and
    its occurrence among such nodes (the k-th product of blk.0.ffn_down.weight), and compared where
    the batch node holds the rows (its second numpy axis from the end is `rows`, each step's 1): row r
    of the batch node
    against step r's. Returns {index, op, source, width, occurrence, max_diff} per compared node
    (source: the node's first source, a weight's GGUF name where it is one)."""
    engine = model._live()

    def by_key(nodes):
        seen, out = {}, []
        for op, source, a in nodes:
            key = (op, source, a.shape[-1])
            k = seen.get(key, 0)
            seen[key] = k + 1
            out.append((key, k, a))
        return out

    engine.capture_nodes(True)
    try:  # the nodes of the last graph computed, after the batch and after each step
        captured = [by_key(engine.captured_nodes()) for _ in _batch_then_steps(model, rows, context, rng)]
    finally:
        engine.capture_nodes(False)
    batch = captured[0]
    steps = [{(key, k): a for key, k, a in nodes} for nodes in captured[1:]]
    out = []
    for index, (key, k, a) in enumerate(batch):
        if a.ndim < 2 or a.shape[-2] != rows:
            continue
        mine = [s.get((key, k)) for s in steps]
        if any(m is None or m.shape[-2] != 1 or m.shape[:-2] != a.shape[:-2] for m in mine):
            continue
        diff = max(float(np.abs(a[..., r, :] - mine[r][..., 0, :]).max()) for r in range(rows))
        out.append({"index": index, "op": key[0], "source": key[1], "width": key[2], "occurrence": k, "max_diff": diff})
    return out
