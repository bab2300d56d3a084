"""The sampler's candidate order at the real vocabulary (csrc/logit_order.h, csrc/sampler.cpp).

A sampler without top-k (top_k = 0, as sampled speculation at temperature 1 uses) orders the whole
row by logit before its softmax and draw. That order used to come from a comparison sort of all
248320 ids (~50 ms per row, most of a sampled tree round); it now comes from a linear radix
order. Two claims:

1. Same tokens: the radix order is the comparison's order, ties (to the lower id), -0.0 == +0.0
   and -inf included, so every seeded draw of the tree walk and of the chain accept rule is what
   the comparison sort gives. Compared against the comparison sort itself, re-enabled with
   DELTASPEC_TEST_SAMPLER_SORT=comparison, on rows full of ties. Seen to fail: with the -0.0
   canonicalization removed from descending_key (so -0.0 sorts after +0.0), the draws differed.
2. No comparison sort: a top_k = 0 walk and chain accept count 0 comparison sorts of more than
   Sampler::kRadixFrom candidates and at least one radix order (the path under test ran). Seen to
   fail: the same check under DELTASPEC_TEST_SAMPLER_SORT=comparison raises (asserted below).
   The same through generate(): a sampled speculative run (tree and chain) reports its sorts in
   GenerationStats (sampler_radix_sorts > 0, sampler_comparison_sorts == 0), red under the plant.
"""

import numpy as np
import pytest

from deltaspec import Model, _core
from deltaspec.sampling import SamplingOptions
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path

N_VOCAB = 248320
PLANT = "DELTASPEC_TEST_SAMPLER_SORT"
SAMPLERS = {
    "plain": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "top_p-min_p-T": dict(temperature=0.7, top_k=0, top_p=0.9, min_p=0.01),
    "top_k-1000": dict(temperature=1.3, top_k=1000, top_p=1.0, min_p=0.0),
}


def sampling(params: dict, seed: int):
    return SamplingOptions(**params, seed=seed).native()


def tied_rows(n: int, seed: int) -> np.ndarray:
    """Logits on a coarse grid (most tokens tie with thousands of others), with a block of
    -0.0 / +0.0 near the top and banned (-inf) tokens, so that the order among equals decides
    which token a draw lands on."""
    rng = np.random.default_rng(seed)
    rows = np.round(rng.normal(size=(n, N_VOCAB)) * 2.0) / 2.0 - 4.0
    for r in rows:
        zeros = rng.choice(N_VOCAB, size=3000, replace=False)
        r[zeros] = np.where(rng.random(3000) < 0.5, -0.0, 0.0)
        r[rng.choice(N_VOCAB, size=1000, replace=False)] = -np.inf
    return rows.astype(np.float32)


def chain_tree(tokens: list[int]) -> dict:
    return dict(token=tokens, parent=[i - 1 for i in range(len(tokens))], child_q=[-1] * len(tokens),
                root_child_q=-1, dists=[])


def walk(rows, tokens, params, seed):
    return _core.walk_tree(chain_tree(tokens), rows, sampling(params, seed), [1, 2, 3], "rejection")


def accept(rows, tokens, params, seed):
    return _core.accept_chain(rows, tokens, [], sampling(params, seed), [1, 2, 3])


@pytest.mark.parametrize("name", SAMPLERS)
def test_radix_order_draws_what_the_comparison_sort_draws(name, monkeypatch):
    params = SAMPLERS[name]
    rows = tied_rows(3, seed=4)
    tokens = [int(np.argmax(rows[0])), int(np.argmax(rows[1]))]  # accepted often: later rows get used too
    drawn = {}
    for plant in ("", "comparison"):
        monkeypatch.setenv(PLANT, plant)
        drawn[plant] = [(w["path"], w["next"], a["n_accepted"], a["next"])
                        for seed in range(12)
                        for w, a in [(walk(rows, tokens, params, seed), accept(rows, tokens, params, seed))]]
    assert drawn[""] == drawn["comparison"]
    assert len({d[1] for d in drawn[""]}) > 3  # the draws spread: a different order would show


def no_comparison_sort(out: dict) -> None:
    assert out["radix_sorts"] >= 1, out
    assert out["comparison_sorts"] == 0, out


def test_top_k0_orders_rows_without_a_comparison_sort(monkeypatch):
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(3, N_VOCAB)).astype(np.float32)
    tokens = [int(rng.integers(N_VOCAB)), int(rng.integers(N_VOCAB))]
    monkeypatch.delenv(PLANT, raising=False)
    no_comparison_sort(walk(rows, tokens, SAMPLERS["plain"], 0))
    no_comparison_sort(accept(rows, tokens, SAMPLERS["plain"], 0))
    monkeypatch.setenv(PLANT, "comparison")  # the old sort: the check must go red
    for out in (walk(rows, tokens, SAMPLERS["plain"], 0), accept(rows, tokens, SAMPLERS["plain"], 0)):
        with pytest.raises(AssertionError):
            no_comparison_sort(out)


def test_bad_plant_is_refused(monkeypatch):
    monkeypatch.setenv(PLANT, "heap")
    with pytest.raises(ValueError, match="DELTASPEC_TEST_SAMPLER_SORT"):
        walk(np.zeros((2, 8), np.float32), [1], SAMPLERS["plain"], 0)


def sorts_of(model, draft, tree_budget):
    r = model.generate([72, 101, 108, 108, 111, 32], max_tokens=8, seed=1, draft_model=draft, draft_n_max=3,
                       draft_n_min=1, tree_budget=tree_budget, **SAMPLERS["plain"])
    assert r.stats.n_drafted > 0  # speculation ran
    return r.stats.sampler_radix_sorts, r.stats.sampler_comparison_sorts


def test_generate_reports_no_comparison_sort(monkeypatch):
    """The tiny vocabulary (265 ids) is above Sampler::kRadixFrom, so top_k = 0 takes the radix order."""
    path = tiny_vocab_model_path()
    with Model(path, n_ctx=64, n_threads=1) as model, Model(path, n_ctx=64, n_threads=1) as draft:
        assert model.n_vocab > 256
        for budget in (4, 0):  # a tree walk, then the chain accept rule
            monkeypatch.delenv(PLANT, raising=False)
            radix, comparison = sorts_of(model, draft, budget)
            assert radix > 0 and comparison == 0, (budget, radix, comparison)
            monkeypatch.setenv(PLANT, "comparison")
            assert sorts_of(model, draft, budget)[1] > 0, budget
