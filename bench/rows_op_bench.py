"""What the parent-indexed DeltaNet recurrence (ggml/deltaspec_rows.h) costs on one layer at
Qwen3.5-27B's shapes (48 value heads, 16 q/k heads, state 128), next to ggml_gated_delta_net.

    python bench/rows_op_bench.py [--device cuda] [--rows 23] [--reps 20] [--out FILE.json]

Each case is one graph holding the op 48 times (the 27B's DeltaNet layers) over the same inputs,
computed --reps times after a warm-up; the time per op is the graph's time / 48, so launch overhead
is amortized as in a model's graph (the figure includes ggml-cuda's graph launch, not only the
kernels). Cases, R = --rows:
* ggml chain R: ggml_gated_delta_net over R tokens (with deltaspec's kernels on, its verify kernel);
* rows chain R: the rows op on a chain of R rows (parent = previous row), one slot;
* rows tree R, depth-first: a draft-tree-shaped tree of R rows (mostly chains, some branches;
  first child right after its parent), its branch points saved and reloaded;
* rows tree R, creation order: the same kind of tree with rows in the order they were made
  (more reloads);
* ggml decode 1 and rows decode N = 1, 4, 16, 32: one token per sequence, N slots (what plain decoding
  of N sequences runs per layer; ggml's op would need N separate graphs or a batched state).
What it should show: rows chain R ~ ggml chain R (the same per-token work); a tree close to the
chain of the same R plus a few state reloads; decode N well below N x decode 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from rows_op_cases import chain, deltanet_inputs, paths, random_tree  # noqa: E402

from deltaspec import _core  # noqa: E402

LAYERS = 48
S, H, HK = 128, 48, 16


def rows_case(device, reps, parent, slot, n_slots, seed=0):
    R = len(parent)
    inp = deltanet_inputs(np.random.default_rng(seed), R, S, H, HK, n_slots)
    res = _core.rows_gated_delta_net(device, inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["pool"],
                                     np.asarray(parent, np.int32), np.asarray(slot, np.int32),
                                     np.zeros(R, np.int32), repeat=reps, copies=LAYERS)
    return res["seconds"] / LAYERS, int(res["n_saved"])


def ggml_case(device, reps, T, seed=0):
    inp = deltanet_inputs(np.random.default_rng(seed), T, S, H, HK, 1)
    res = _core.gated_delta_net(device, inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["pool"],
                                repeat=reps, copies=LAYERS)
    return res["seconds"] / LAYERS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=23, help="rows of the chain and tree cases (1 + 22 drafts)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    R = args.rows
    rng = np.random.default_rng(1)
    tree_df, tree_co = random_tree(rng, R, depth_first=True), random_tree(rng, R, depth_first=False)
    results = []

    def record(name, seconds, **extra):
        results.append({"case": name, "us_per_layer": seconds * 1e6, **extra})
        extras = "".join(f", {k} {v}" for k, v in extra.items())
        print(f"{name:34s} {seconds * 1e6:9.2f} us per layer{extras}", flush=True)

    record(f"ggml chain {R}", ggml_case(args.device, args.reps, R))
    t, _ = rows_case(args.device, args.reps, chain(R), [0] * R, 1)
    record(f"rows chain {R}", t)
    for name, tree in ((f"rows tree {R}, depth-first", tree_df), (f"rows tree {R}, creation order", tree_co)):
        t, n_saved = rows_case(args.device, args.reps, tree, [0] * R, 1)
        record(name, t, saved=n_saved, leaves=len(paths(tree)), depth=max(len(p) for p in paths(tree)))
    record("ggml decode 1", ggml_case(args.device, args.reps, 1))
    for n in (1, 4, 16, 32):
        t, _ = rows_case(args.device, args.reps, [-1] * n, list(range(n)), n)
        record(f"rows decode {n}", t)
    if args.out:
        args.out.write_text(json.dumps({"device": args.device, "rows": R, "layers": LAYERS, "results": results},
                                       indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
