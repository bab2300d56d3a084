"""Acceptance of the two lossless tree walks (csrc/tree_walk.h) on synthetic distributions (CPU).

    python bench/tree_acceptance.py [--trials 10000] [--reps 3] [--out FILE.json]

A 16-token vocabulary with fixed random target logits for every prefix up to depth 4 (N(0, 2), and
a peaked target N(0, 4) closer to a code model's confident steps), and a draft related to it in a stated way (the same; the target plus Gaussian noise; sharper or
flatter). Each trial is one round: a best-first tree (draft_tree.h) of `budget` nodes, depth <= 4,
drafted afresh from the draft's rows, its children 'chosen' (most probable, no q) or 'sampled'
(drawn without replacement, q recorded), walked by 'match' (per-node sampling and matching) or
'rejection' (multi-draft rejection sampling), T = 1. Budget 4 is a chain. Reported: the mean
accepted path length per round (tokens per round = that + 1), median and spread (max - min) over
`reps` interleaved repetitions with different seeds. These are acceptance numbers of synthetic
distributions, not of a model: they compare the rules, they do not predict a model's speed-up.
On chosen children the two rules have the same law (rejection with one-hot q is matching), which
the table shows as a check.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from deltaspec import _core

V, D = 16, 4
BUDGETS = (4, 8, 16)
COMBOS = (("chosen", "match"), ("chosen", "rejection"), ("sampled", "match"), ("sampled", "rejection"))
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "tree_acceptance.json"


def drafts(target: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    noise = rng.normal(size=target.shape)
    return {
        "same": target,
        "noise 0.5": target + 0.5 * noise,
        "noise 1.5": target + 1.5 * noise,
        "sharper x2": 2.0 * target,
        "flatter x0.5": 0.5 * target,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    n_rows = sum(V ** k for k in range(D + 1))
    base = rng.normal(size=(n_rows, V))
    cases = {}
    for scale in (2.0, 4.0):
        target = (base * scale).astype(np.float32)
        for name, d in drafts(target, np.random.default_rng(1)).items():
            cases[f"N(0,{scale:g}) {name}"] = (target, d.astype(np.float32))
    sp = _core.SamplingParams()
    sp.temperature, sp.top_k, sp.top_p, sp.min_p = 1.0, 0, 1.0, 0.0

    results: dict[tuple, list[float]] = {}
    for rep in range(args.reps):  # interleaved: every cell once per repetition
        for name, (target, draft) in cases.items():
            for budget in BUDGETS:
                for kind, rule in COMBOS:
                    sp.seed = 1000 + rep
                    out = _core.tree_walk_trials(target, draft, V, [0], sp, kind, budget, D, rule, args.trials,
                                                 1000 + rep)
                    accepted = (out["emitted"] >= 0).sum(axis=1) - 1
                    results.setdefault((name, budget, kind, rule), []).append(float(accepted.mean()))

    rows = []
    header = f"{'target, draft':<22} {'budget':>6} " + " ".join(f"{k + '/' + r:>20}" for k, r in COMBOS)
    print(header)
    print("-" * len(header))
    for name in cases:
        for budget in BUDGETS:
            cells = []
            for kind, rule in COMBOS:
                v = results[(name, budget, kind, rule)]
                med, spread = float(np.median(v)), float(max(v) - min(v))
                cells.append(f"{med:>12.3f} ±{spread:<6.3f}")
                rows.append(dict(case=name, budget=budget, tree=kind, rule=rule, accepted_median=med,
                                 accepted_spread=spread, accepted_reps=v))
            print(f"{name:<22} {budget:>6} " + " ".join(f"{c:>20}" for c in cells))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        what="mean accepted tree path length per round (tokens per round = +1), synthetic distributions, CPU",
        vocab=V, max_depth=D, temperature=1.0, trials=args.trials, reps=args.reps, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
