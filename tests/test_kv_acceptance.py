"""bench/kv_acceptance.py's logic: the acceptance accounting, the per-type cache allocation it
asserts, and the paired bootstrap (bench/acceptance_stats.py) that decides "within noise".

Each test was seen to fail once with a planted bug:
- test_paired_interval_*: KV_ACCEPTANCE_PLANT=unpaired (the two runs' prompts resampled
  independently) -> "paired CI (-0.31, 0.41) for a shift of 0.0501".
- test_tiny_model_run_*: KV_ACCEPTANCE_PLANT=ignore_type (every run opened with the f16 cache) ->
  open_target raises "asked for the q4_0 cache, the engine allocated [('f16', 'f16')]"; and with
  one_generation counting n_tree_nodes as drafted (patched by hand) -> "sum(drafted) > 0" fails.
- test_token_agreement_known_answer: prefix_fraction counted from equal positions (patched by hand)
  -> the dicts differ.
- test_check_drafted_*: check_drafted looking at the first prompt's count only (patched by hand) ->
  the run whose first prompt drafted nothing raises where it must pass.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import acceptance_stats as st  # noqa: E402
import kv_acceptance as kva  # noqa: E402


def test_acceptance_length_is_the_pooled_ratio():
    # two prompts: 10 passes / 20 accepted and 30 passes / 0 accepted -> (20 + 40) / 40, not the mean
    # of the per-prompt ratios (3.0 and 1.0 -> 2.0)
    assert st.acceptance_length([10, 30], [20, 0]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="no target pass"):
        st.acceptance_length([0, 0], [0, 0])


def test_paired_interval_finds_a_shift_hidden_by_prompt_spread():
    """Prompts whose acceptance lengths spread from ~1.5 to ~4.5; the run accepts 0.05 more tokens per
    pass on every prompt. Paired, the interval holds the true shift and excludes 0; resampled
    independently it would span 0 (the prompts' spread is ~20x the shift)."""
    rng = np.random.default_rng(3)
    n = 48
    steps = rng.integers(20, 80, n).astype(float)
    ref_acc = np.round(steps * rng.uniform(0.5, 3.5, n))
    acc = ref_acc + np.round(0.05 * steps)
    true = st.acceptance_length(steps, acc) - st.acceptance_length(steps, ref_acc)
    got = st.paired_difference(steps, ref_acc, steps, acc)
    assert got["diff"] == pytest.approx(true)
    lo, hi = got["ci"]
    assert lo <= true <= hi and lo > 0 and got["excludes_zero"], f"paired CI {got['ci']} for a shift of {true:.4f}"
    assert hi - lo < 0.01, f"paired CI {got['ci']} is as wide as the prompts' spread"
    # the same run against itself: exactly 0, no width
    same = st.paired_difference(steps, ref_acc, steps, ref_acc)
    assert same["ci"] == (0.0, 0.0) and not same["excludes_zero"]
    # the single run's interval is as wide as the spread over prompts and holds its pooled AL
    lo1, hi1 = st.bootstrap_ci(steps, ref_acc)
    assert lo1 < st.acceptance_length(steps, ref_acc) < hi1 and hi1 - lo1 > 0.1


def test_token_agreement_known_answer():
    got = st.token_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 9, 7, 8]])
    # prompt 2 differs at index 1 and agrees again after: prefix 4 + 1 of 8, positions 7 of 8
    assert got == {"identical_prompts": 1, "prompts": 2, "prefix_fraction": 5 / 8, "position_fraction": 7 / 8}
    got = st.token_agreement([[1, 2]], [[1, 2, 3, 4]])  # shorter output: its missing tokens differ
    assert got["prefix_fraction"] == 0.5 and got["position_fraction"] == 0.5


def test_check_drafted_names_the_empty_run():
    ok = {"steps": [3, 4], "drafted": [0, 8], "accepted": [0, 2]}
    empty = {"steps": [3, 4], "drafted": [0, 0], "accepted": [0, 0]}
    kva.check_drafted({0.0: {"draft4": {"f16": ok, "q4_0": ok}}})
    with pytest.raises(AssertionError, match=r"T=0.0 draft4 q4_0"):
        kva.check_drafted({0.0: {"draft4": {"f16": ok, "q4_0": empty}}})


def test_tiny_model_run_uses_each_cache_type_and_counts_acceptance():
    """measure() on the tiny random model drafting for itself (a second instance of the same file,
    f16 cache): with the target's f16 cache the draft proposes the target's own greedy tokens, so
    every draft is accepted (known answer: accepted == drafted, AL = 1 + drafted / passes); the q4_0
    run really got the q4_0 cache (its bytes are q4_0's, asserted by open_target from the engine's
    tensors) and its counts are the engine's own per-generation stats."""
    from deltaspec import Model
    from deltaspec.testing.tiny_vocab import tiny_vocab_model_path

    path = tiny_vocab_model_path(n_layer=4, n_head=4, n_head_kv=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 24).tolist() for _ in range(3)]
    n_new, n_ctx = 40, 128
    counts, kv = kva.measure(path, path, None, 16, prompts, ["f16", "q4_0"], ["draft4"], 1, n_new, 0.0, [7], n_ctx)
    f16, q4 = counts["draft4"]["f16"], counts["draft4"]["q4_0"]
    assert sum(f16["drafted"]) > 0 and f16["accepted"] == f16["drafted"], f16
    assert f16["per_seed"][0] == pytest.approx(1 + sum(f16["drafted"]) / sum(f16["steps"]))
    assert kv["f16"]["type"] == "f16" and kv["q4_0"]["type"] == "q4_0"
    # q4_0: 18 bytes per 32 values against f16's 64
    assert kv["q4_0"]["kv_bytes"] * 64 == kv["f16"]["kv_bytes"] * 18, kv
    # the accounting is the engine's: one generation per prompt, counted as its stats say
    with Model(path, n_ctx=n_ctx, n_threads=1, type_k="q4_0", type_v="q4_0", progress=False) as m, \
            Model(path, n_ctx=n_ctx, n_threads=1, progress=False) as d:
        for i, p in enumerate(prompts):
            r = m.generate(p, max_tokens=n_new, temperature=0, top_k=0, top_p=1.0, min_p=0.0, seed=7 + i,
                           draft_model=d, draft_n_max=4, draft_n_min=4)
            assert (q4["steps"][i], q4["drafted"][i], q4["accepted"][i]) == (
                r.stats.n_steps, r.stats.n_drafted, r.stats.n_accepted)
            assert q4["tokens"][i] == list(r.tokens)
            assert st.acceptance_length(q4["steps"][i:i + 1], q4["accepted"][i:i + 1]) == pytest.approx(
                r.stats.mean_acceptance_length)
