"""Host cost of sampled verification at the real vocabulary (CPU only, no model).

A sampled (T > 0) verify whose sampler the device's top rows cannot serve (top_k = 0, penalties,
bias) copies every row's logits to the host, and the walk turns each visited row into the
sampler's distribution there. This times exactly that host part through the same native code the
engine runs (csrc/tree_walk.cpp walk_tree, csrc/speculative.cpp accept_draft), on random logits of
the Qwen3.5 vocabulary (248320), for the samplers that matter:

  plain    temperature 1, top_k 0, top_p 1, min_p 0 (the full-vocabulary case)
  default  Model.generate's defaults (0.8, 40, 0.95, 0.05) on whole rows (penalties or bias
           force whole rows; without them the device's top rows serve it)
  greedy   temperature 0 on whole rows (penalties force it off the device argmax)

'chainQ' is the chain accept rule with a whole-vocabulary q (a model drafter sampling without
top-k), less the same call at temperature 0 (the binding converting q from Python lists).

Trees are built like the DFlash drafter builds them (build_from_marginals, children drawn for
sampled targets). 'agree' rows lift every node's token in its parent's row so the walk goes deep
(more rows visited per walk); 'random' rows leave the draft mostly rejected at the root.

Prints ms per walk and ms per visited row (median of the interleaved repetitions, with spread);
writes bench/results/latest/host_sampling.json.

    python bench/host_sampling_bench.py [--reps 3] [--budgets 16 32] [--walks 5] [--no-full-q]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import numpy as np

from deltaspec import _core
from deltaspec.sampling import SamplingOptions

N_VOCAB = 248320
SAMPLERS = {
    "plain": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "default": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "greedy": dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
}


def sampling(params: dict, seed: int):
    return SamplingOptions(**params, seed=seed).native()


def draft_tree(budget: int, depth: int, rng: np.random.Generator, sampled: bool) -> dict:
    marginals = []
    for _ in range(depth):
        ids = rng.choice(N_VOCAB, size=budget, replace=False).astype(int).tolist()
        probs = rng.dirichlet(np.ones(budget)).astype(np.float32).tolist()
        marginals.append((ids, probs))
    return _core.tree_from_marginals(marginals, budget, depth, 0, int(rng.integers(1 << 30)) if sampled else None,
                                     False)


def rows_for(tree: dict, rng: np.random.Generator, agree: bool) -> np.ndarray:
    rows = rng.normal(size=(1 + len(tree["token"]), N_VOCAB)).astype(np.float32) * 2.0
    if agree:  # each node's token likely under its parent's row: the walk goes deep
        for node, (tok, parent) in enumerate(zip(tree["token"], tree["parent"])):
            rows[parent + 1, tok] += 14.0
    return rows


def chain_case(n: int, rng: np.random.Generator, agree: bool, full_q: bool = False):
    tokens = rng.choice(N_VOCAB, size=n, replace=False).astype(int).tolist()
    if full_q:  # a model drafter sampling without top-k: q over the whole vocabulary
        q = rng.dirichlet(np.ones(N_VOCAB)).astype(np.float32)
        dists = [(list(range(N_VOCAB)), q.tolist())] * n
    else:
        dists = [([t], [1.0]) for t in tokens]
    rows = rng.normal(size=(n + 1, N_VOCAB)).astype(np.float32) * 2.0
    if agree:
        for i, t in enumerate(tokens):
            rows[i, t] += 14.0
    return tokens, dists, rows


def time_tree(sampler: str, budget: int, agree: bool, walks: int, seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    params = SAMPLERS[sampler]
    total, visited = 0.0, 0
    for w in range(walks):
        tree = draft_tree(budget, 15, rng, sampled=params["temperature"] > 0)
        rows = rows_for(tree, rng, agree)
        t0 = time.perf_counter()
        out = _core.walk_tree(tree, rows, sampling(params, seed + w), [1, 2, 3], "rejection")
        total += time.perf_counter() - t0
        visited += len(out["path"]) + 1
    return 1e3 * total / walks, 1e3 * total / visited


def time_chain(sampler: str, n: int, agree: bool, walks: int, seed: int, full_q: bool = False) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    params = SAMPLERS[sampler]
    total, visited = 0.0, 0
    for w in range(walks):
        tokens, dists, rows = chain_case(n, rng, agree, full_q)
        t0 = time.perf_counter()
        out = _core.accept_chain(rows, tokens, dists, sampling(params, seed + w), [1, 2, 3])
        total += time.perf_counter() - t0
        visited += out["n_accepted"] + 1
        if full_q:  # less what the binding spends converting q (the same call with a one-hot p)
            t0 = time.perf_counter()
            _core.accept_chain(rows, tokens, dists, sampling(SAMPLERS["greedy"], seed + w), [1, 2, 3])
            total -= time.perf_counter() - t0
    return 1e3 * total / walks, 1e3 * total / visited


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--walks", type=int, default=5)
    ap.add_argument("--no-full-q", action="store_true",
                    help="leave out chainQ (a build before the dense q lookup takes ~15 s per rejection there)")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "latest" / "host_sampling.json"))
    args = ap.parse_args()

    cases = []
    for sampler in SAMPLERS:
        for agree in (False, True):
            for b in args.budgets:
                cases.append(("tree", sampler, b, agree))
            cases.append(("chain", sampler, 15, agree))
        if sampler == "plain" and not args.no_full_q:
            cases.append(("chainQ", sampler, 4, False))  # whole-vocabulary q (model drafter, top_k 0)
    samples = {c: [] for c in cases}
    for rep in range(args.reps):  # interleaved: every case once per repetition
        for c in cases:
            kind, sampler, size, agree = c
            if kind == "tree":
                samples[c].append(time_tree(sampler, size, agree, args.walks, seed=100 * rep + 7))
            else:
                samples[c].append(time_chain(sampler, size, agree, args.walks, seed=100 * rep + 7, full_q=kind == "chainQ"))

    print(f"vocab {N_VOCAB}, {args.walks} walks per sample, {args.reps} interleaved repetitions (median [min-max])")
    print(f"{'kind':6} {'sampler':8} {'size':>4} {'rows':7} {'ms/walk':>22} {'ms/visited row':>22}")
    results = []
    for c in cases:
        kind, sampler, size, agree = c
        walk = [s[0] for s in samples[c]]
        row = [s[1] for s in samples[c]]
        fmt = lambda v: f"{statistics.median(v):8.2f} [{min(v):.2f}-{max(v):.2f}]"  # noqa: E731
        print(f"{kind:6} {sampler:8} {size:4d} {'agree' if agree else 'random':7} {fmt(walk):>22} {fmt(row):>22}")
        results.append(dict(kind=kind, sampler=sampler, size=size, rows="agree" if agree else "random",
                            ms_per_walk=walk, ms_per_visited_row=row,
                            ms_per_walk_median=statistics.median(walk), ms_per_row_median=statistics.median(row)))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(n_vocab=N_VOCAB, reps=args.reps, walks=args.walks, results=results), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
