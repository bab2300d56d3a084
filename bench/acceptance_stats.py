"""Acceptance length over prompts, with per-prompt bootstrap confidence intervals.

The mean acceptance length of a run is a ratio of sums over its prompts, (accepted + steps) / steps
(tokens committed per target pass, as bench/testbed/acceptance.py counts it), not the mean of the
prompts' own ratios: a prompt that needs many passes weighs more, exactly as in the pooled count.
The bootstrap therefore resamples prompts and recomputes the ratio of the resampled sums.

Comparing two runs on the same prompts (a KV cache type against the f16 cache) resamples the SAME
prompt indices for both (paired): prompts differ far more from each other than the two runs differ
on one prompt, and an unpaired interval would drown the difference in that between-prompt spread.
"""

from __future__ import annotations

import os

import numpy as np

N_BOOT = 4000


def acceptance_length(steps: np.ndarray, accepted: np.ndarray) -> float:
    """Tokens committed per target pass over all prompts: (sum accepted + sum steps) / sum steps."""
    steps, accepted = np.asarray(steps, np.float64), np.asarray(accepted, np.float64)
    total = steps.sum()
    if total <= 0:
        raise ValueError("acceptance_length: no target pass was counted (steps sum to 0)")
    return float((accepted.sum() + total) / total)


def _resampled_al(steps: np.ndarray, accepted: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Acceptance length of each bootstrap replicate: idx has shape (n_boot, n_prompts)."""
    s, a = steps[idx].sum(1), accepted[idx].sum(1)
    return (a + s) / s


def _indices(n: int, n_boot: int, seed: int) -> np.ndarray:
    if n < 2:
        raise ValueError(f"a bootstrap over prompts needs at least 2 prompts, got {n}")
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def bootstrap_ci(steps, accepted, n_boot: int = N_BOOT, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the acceptance length over prompts resampled with replacement."""
    steps, accepted = np.asarray(steps, np.float64), np.asarray(accepted, np.float64)
    reps = _resampled_al(steps, accepted, _indices(len(steps), n_boot, seed))
    lo, hi = np.quantile(reps, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def paired_difference(ref_steps, ref_accepted, steps, accepted, n_boot: int = N_BOOT, seed: int = 0,
                      level: float = 0.95) -> dict:
    """AL(run) - AL(ref) on the same prompts, and its bootstrap interval with the prompts resampled
    together (paired). {"diff", "ci": (lo, hi), "excludes_zero"}."""
    arrays = [np.asarray(x, np.float64) for x in (ref_steps, ref_accepted, steps, accepted)]
    if len({len(x) for x in arrays}) != 1:
        raise ValueError(f"paired_difference: both runs need one count per prompt, got lengths "
                         f"{[len(x) for x in arrays]}")
    ref_s, ref_a, s, a = arrays
    idx = _indices(len(s), n_boot, seed)
    # KV_ACCEPTANCE_PLANT=unpaired: the planted bug of tests/test_kv_acceptance.py (independent
    # resampling of the two runs, which the paired test must catch)
    ref_idx = (_indices(len(s), n_boot, seed + 1) if os.environ.get("KV_ACCEPTANCE_PLANT") == "unpaired" else idx)
    diffs = _resampled_al(s, a, idx) - _resampled_al(ref_s, ref_a, ref_idx)
    lo, hi = np.quantile(diffs, [(1 - level) / 2, (1 + level) / 2])
    diff = acceptance_length(s, a) - acceptance_length(ref_s, ref_a)
    return {"diff": float(diff), "ci": (float(lo), float(hi)), "excludes_zero": bool(lo > 0 or hi < 0)}


def token_agreement(runs: list[list[int]], refs: list[list[int]]) -> dict:
    """How far a run's outputs follow the reference's, prompt by prompt:
    identical_prompts: outputs equal as a whole; prefix_fraction: generated tokens before the first
    difference over all generated tokens (the share of text that is the reference's);
    position_fraction: positions holding the same token (after a divergence the texts may realign)."""
    if len(runs) != len(refs):
        raise ValueError(f"token_agreement: {len(runs)} outputs against {len(refs)} reference outputs")
    same = prefix = positions = total = 0
    for x, y in zip(runs, refs):
        n = max(len(x), len(y))
        first = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        same += x == y
        prefix += n if x == y else first
        positions += sum(u == v for u, v in zip(x, y))
        total += n
    return {"identical_prompts": same, "prompts": len(runs), "prefix_fraction": prefix / total if total else 1.0,
            "position_fraction": positions / total if total else 1.0}
