"""The fast path of whole-row sampling (csrc/logit_order.h, csrc/sampler.cpp, csrc/tree_walk.cpp).

A sampled verify whose sampler has no top-k turns every visited row into a distribution over the
whole vocabulary (248320 ids for Qwen3.5). On that fast path the radix order hands over the sorted
logits, the softmax reads them in order (one exp and one division per run of equal logits), and the
tree walk finds places only for the ids it reads and draws its residual in place. The plain path it
replaced stays behind DELTASPEC_TEST_SAMPLER_SORT=reference: the same radix order, a softmax that
gathers logits[ids[i]], and the residual drawn from a copied Distribution. Two claims:

1. Same tokens: seeded tree walks (children drawn from q, so residuals are taken and drawn) and
   chain accepts give the same path and token on both paths, on rows full of ties (a coarse grid,
   -0.0 / +0.0, -inf), with penalties, a logit bias, top-p / min-p and temperatures != 1, at the
   real vocabulary and on thousands of rows of small vocabularies (above Sampler::kRadixFrom, so
   the radix order applies). Seen to fail: with the softmax's run cache keyed on a logit's top 24
   bits (`bits >> 8` compared, so near-equal logits shared an exp), the draws differed.
2. The fast path ran: every whole row of a top_k = 0 walk and chain accept counts in in_order_rows.
   Seen to fail: under the reference plant the count is 0 (asserted below).
"""

import numpy as np
import pytest

from deltaspec import _core
from deltaspec.sampling import SamplingOptions

N_VOCAB = 248320
PLANT = "DELTASPEC_TEST_SAMPLER_SORT"
SAMPLERS = {
    "plain": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "top_p-min_p-T": dict(temperature=0.7, top_k=0, top_p=0.9, min_p=0.01),
    "penalties": dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.3, presence_penalty=0.5,
                      frequency_penalty=0.2),
}


def sampling(params: dict, seed: int, bias=()):
    return SamplingOptions(**params, seed=seed, logit_bias=bias).native()


def rows_of(rng: np.random.Generator, m: int, n_vocab: int, tied: bool) -> np.ndarray:
    if not tied:
        return (rng.normal(size=(m, n_vocab)) * 2.0).astype(np.float32)
    rows = np.round(rng.normal(size=(m, n_vocab)) * 2.0) / 2.0 - 4.0  # most tokens tie with many others
    k = max(2, n_vocab // 80)
    for r in rows:
        zeros = rng.choice(n_vocab, size=k, replace=False)
        r[zeros] = np.where(rng.random(k) < 0.5, -0.0, 0.0)
        r[rng.choice(n_vocab, size=k, replace=False)] = -np.inf
    return rows.astype(np.float32)


def sampled_tree(rng: np.random.Generator, n_vocab: int, budget: int, depth: int) -> tuple[dict, list]:
    marginals = []
    for _ in range(depth):
        ids = rng.choice(n_vocab, size=budget, replace=False).astype(int).tolist()
        marginals.append((ids, rng.dirichlet(np.ones(budget)).astype(np.float32).tolist()))
    return _core.tree_from_marginals(marginals, budget, depth, 0, int(rng.integers(1 << 30)), False), marginals


def draws(cases, monkeypatch, plant: str) -> tuple[list, int]:
    """(path, token) of every walk and (accepted, token) of every chain accept; the fast rows counted."""
    monkeypatch.setenv(PLANT, plant)
    out, in_order = [], 0
    for tree, marginals, rows, hist, params, seed, bias in cases:
        so = sampling(params, seed, bias)
        w = _core.walk_tree(tree, rows, so, list(hist), "rejection")
        n = min(4, len(tree["token"]))
        dists = [tuple(m) for m in marginals[:n]] if seed % 2 else []  # q-drawn and one-hot drafts
        a = _core.accept_chain(rows[:n + 1], tree["token"][:n], dists, so, list(hist))
        out.append((w["path"], w["next"], a["n_accepted"], a["next"]))
        in_order += w["in_order_rows"] + a["in_order_rows"]
    return out, in_order


def make_cases(rng: np.random.Generator, n_vocab: int, n_trees: int, seeds: int, budget: int) -> list:
    cases = []
    for t in range(n_trees):
        tree, marginals = sampled_tree(rng, n_vocab, budget, 5)
        rows = rows_of(rng, 1 + len(tree["token"]), n_vocab, tied=t % 2 == 0)
        if t % 3 != 2:  # each node's token likely in its parent's row: walks go deep, rows get visited
            for node, (tok, par) in enumerate(zip(tree["token"], tree["parent"])):
                rows[par + 1, tok] += np.log(n_vocab)
        hist = rng.choice(n_vocab, size=30).astype(int).tolist() + tree["token"][:2]  # penalties bite
        for name, params in SAMPLERS.items():
            for seed in range(seeds):
                bias = ((tree["token"][0], 1.5), (int(rng.integers(n_vocab)), float("-inf"))) if seed % 3 == 1 else ()
                cases.append((tree, marginals, rows, hist, params, seed, bias))
    return cases


@pytest.mark.parametrize("n_vocab,n_trees,seeds,budget", [(N_VOCAB, 6, 4, 8), (300, 120, 8, 12), (2000, 60, 8, 12)],
                         ids=["vocab248320", "vocab300", "vocab2000"])
def test_fast_path_draws_what_the_reference_draws(n_vocab, n_trees, seeds, budget, monkeypatch):
    cases = make_cases(np.random.default_rng(n_vocab), n_vocab, n_trees, seeds, budget)
    fast, in_order = draws(cases, monkeypatch, "")
    reference, reference_in_order = draws(cases, monkeypatch, "reference")
    assert in_order > len(cases) and reference_in_order == 0  # each side took its own path
    assert fast == reference
    assert len({d[1] for d in fast}) > min(len(fast), n_vocab) // 4  # spread: a changed probability would show
    assert any(d[0] for d in fast) and any(not d[0] for d in fast)  # accepted and rejected roots both seen


def fast_path_ran(out: dict, rows: int) -> None:
    assert out["in_order_rows"] == rows == out["radix_sorts"], out


def test_top_k0_rows_take_the_fast_path(monkeypatch):
    rng = np.random.default_rng(0)
    rows = (rng.normal(size=(3, N_VOCAB)) * 2.0).astype(np.float32)
    tokens = [int(rng.integers(N_VOCAB)), int(rng.integers(N_VOCAB))]
    rows[0, tokens[0]] += 30.0  # the first token is accepted: two rows visited by each
    chain = dict(token=tokens, parent=[-1, 0], child_q=[-1, -1], root_child_q=-1, dists=[])
    so = sampling(SAMPLERS["plain"], 0)
    for plant in ("", "reference"):
        monkeypatch.setenv(PLANT, plant)
        w = _core.walk_tree(chain, rows, so, [1, 2, 3], "rejection")
        a = _core.accept_chain(rows, tokens, [], so, [1, 2, 3])
        if plant == "":
            fast_path_ran(w, len(w["path"]) + 1)
            fast_path_ran(a, a["n_accepted"] + 1)
            assert len(w["path"]) >= 1
        else:  # the plain path: the check must go red
            for out, n in ((w, len(w["path"]) + 1), (a, a["n_accepted"] + 1)):
                with pytest.raises(AssertionError):
                    fast_path_ran(out, n)


def test_bad_plant_is_refused(monkeypatch):
    monkeypatch.setenv(PLANT, "fast")
    with pytest.raises(ValueError, match="DELTASPEC_TEST_SAMPLER_SORT"):
        _core.walk_tree(dict(token=[1], parent=[-1], child_q=[-1], root_child_q=-1, dists=[]),
                        np.zeros((2, 8), np.float32), sampling(SAMPLERS["plain"], 0), [], "rejection")
