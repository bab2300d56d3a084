"""What committing a verified tree's accepted path costs (Engine::keep_path), per call, from Python.

    python bench/keep_path_host.py MODEL.gguf [--device cpu] [--taps 0,2,N] [--out FILE.json]

Rounds of verify_tree (a DDTree-shaped tree of 1 + --width rows, bench/tree_verify_cost.py's shapes)
then keep_path of one path, at a fixed context depth (each round's commit is undone by re-evaluating
the prefix, outside the timing). Paths: the top-1 chain's first 4 and 9 rows (no KV row moves) and
the longest path off the chain (its KV rows move); each timed with and without taps (the hidden
states a DFlash drafter reads: --taps layer ids, gathered in path order by the commit). Every
measurement is the median of --steps timings of keep_path alone; --reps repetitions run
interleaved (every measurement once, then again); the table shows the median over repetitions
[min-max]. "builds" is how many of the timed keep_path calls built their commit graph (the others
reused the last one). No llama.cpp peer: llama.cpp has no tree commit to compare with.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_verify_cost import ddtree_parents, off_chain_path  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "keep_path_host.json"


def measure(engine, prefix, tokens, parents, paths, taps, steps) -> dict[str, dict]:
    out = {}
    for with_taps in (False, True):
        engine.set_taps(taps if with_taps else [])
        for name, rows in paths.items():
            times = []
            builds = engine.tree_stats["keep_graph_builds"] if "keep_graph_builds" in engine.tree_stats else None
            for _ in range(steps):
                engine.reset()
                engine.eval(prefix, logits="none")
                engine.verify_tree(tokens, parents, argmax=True)
                t0 = time.perf_counter()
                engine.keep_path(rows)
                times.append(time.perf_counter() - t0)
            built = None if builds is None else engine.tree_stats["keep_graph_builds"] - builds
            out[f"{name}{' + taps' if with_taps else ''}"] = dict(ms=1e3 * statistics.median(times), builds=built)
    engine.set_taps([])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--width", type=int, default=22, help="tree nodes N, verified as 1 + N rows (default: %(default)s)")
    ap.add_argument("--taps", default=None, help="tapped layer ids (default: 1, n_layer / 2, n_layer)")
    ap.add_argument("--steps", type=int, default=30, help="timings per measurement (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default: %(default)s)")
    ap.add_argument("--depth", type=int, default=64, help="context tokens before each round (default: %(default)s)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default: %(default)s)")
    args = ap.parse_args()
    if args.width < 9:
        raise SystemExit(f"keep_path_host: --width must be at least 9 (a 9-row chain path), got {args.width}")

    from deltaspec import Model

    rng = np.random.default_rng(0)
    model = Model(args.model, n_ctx=args.depth + 512, n_threads=args.threads, device=args.device, progress=False)
    n_layer = model.hparams.n_layer
    taps = [int(x) for x in args.taps.split(",")] if args.taps else [1, n_layer // 2, n_layer]
    engine = model._live()
    engine.reserve_slots(128)
    prefix = rng.integers(0, model.n_vocab, size=args.depth).astype(np.int32)
    parents_l = [-1] + [p + 1 for p in ddtree_parents(args.width)]
    parents = np.array(parents_l, dtype=np.int32)
    tokens = rng.integers(0, model.n_vocab, size=len(parents)).astype(np.int32)
    paths = {"chain path of 4": np.arange(4, dtype=np.int32), "chain path of 9": np.arange(9, dtype=np.int32)}
    off = off_chain_path(parents)
    if off is not None:
        paths[f"off-chain path of {len(off)}"] = np.array(off, dtype=np.int32)
    measure(engine, prefix, tokens, parents, paths, taps, 3)  # warm-up
    runs = []
    for rep in range(args.reps):
        print(f"repetition {rep + 1} of {args.reps}", file=sys.stderr, flush=True)
        runs.append(measure(engine, prefix, tokens, parents, paths, taps, args.steps))
    model.close()

    print(f"keep_path on {Path(args.model).name}, device {args.device}, 1 + {args.width} rows, depth {args.depth}, "
          f"taps {taps}; ms = median over {args.reps} interleaved repetitions [min-max] of medians of {args.steps}\n")
    print("| path | ms | builds / calls |")
    print("|---|---:|---:|")
    rows = []
    for name in runs[0]:
        v = [r[name]["ms"] for r in runs]
        builds = [r[name]["builds"] for r in runs]
        rows.append(dict(what=name, ms=v, median_ms=statistics.median(v), builds=builds, calls=args.steps))
        b = "n/a" if builds[0] is None else f"{sum(builds)} / {args.reps * args.steps}"
        print(f"| {name} | {statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}] | {b} |")
    commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    meta = dict(model=str(args.model), device=args.device, width=args.width, depth=args.depth, taps=taps,
                steps=args.steps, reps=args.reps, machine=platform.node(),
                date=time.strftime("%Y-%m-%d %H:%M", time.gmtime()), commit=commit or None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows, runs=runs), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
