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


def node_differences(model, rows: int, context: int, rng: np.random.Generator) -> list[dict]:
    """Where batch_vs_steps' difference arises: the step graphs' nodes (Engine capture_nodes) of the
    batch of `rows` tokens against those of the one-token steps, in the batch graph's order. The two
    kinds of graph differ in structure (the one-token step runs other DeltaNet ops), so a node is
    matched by its op, its first source (a weight's name, else that source's op), its row width and
    its occurrence among such nodes (the k-th product of blk.0.ffn_down.weight), and compared where the batch node holds the
    rows (its second numpy axis from the end is `rows`, each step's 1): row r of the batch node
    against step r's. Returns {index, op, source, width, occurrence, max_diff} per compared node
    (source: the node's first source, a weight's GGUF name where it is one)."""
    engine = model._live()
    before = rng.integers(0, model.n_vocab, size=context).tolist()
    ids = rng.integers(0, model.n_vocab, size=rows).tolist()

    def by_key(nodes):
        seen, out = {}, []
        for op, source, a in nodes:
            key = (op, source, a.shape[-1])
            k = seen.get(key, 0)
            seen[key] = k + 1
            out.append((key, k, a))
        return out

    engine.capture_nodes(True)
    try:
        model.reset()
        if before:
            model.eval(before)
        model.eval(ids, logits="all")
        batch = by_key(engine.captured_nodes())
        steps = []
        model.reset()
        if before:
            model.eval(before)
        for t in ids:
            model.eval([t])
            steps.append({(key, k): a for key, k, a in by_key(engine.captured_nodes())})
    finally:
        engine.capture_nodes(False)
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
