"""What verifying a draft TREE costs next to one decode step (and llama.cpp's batch of the same width).

    python bench/tree_verify_cost.py MODEL.gguf [--device cuda] [--llama-bench BIN/llama-bench] [--out FILE.json]

A tree of N nodes is verified as T = 1 + N rows (the last committed token + the nodes) in one
target pass, Engine::verify_tree: each row attends to the committed KV rows and its own ancestors,
the DeltaNet layers run the parent-indexed rows ops. Widths N = 8, 16, 22 (DDTree's default budget
on the 27B; the issue's goal: 1 + 22 rows <= 1.5 decode steps), 32 and 64 (--widths).

The trees are DDTree-shaped: the top-1 chain (16 deep, or N when smaller) seeded first, then
best-first over synthetic per-depth marginals (rank r has probability ~ 0.5^r at every depth, so
the rest goes to the second-ranked siblings of the shallow nodes and their children), stored the
way the trees branch's builder stores them (parents first, chain first). Every measurement is a
median of --steps timings from Python after warm-up, at a context depth of --depth tokens:
* decode step: eval_argmax of one token (greedy decode, argmax on the device);
* tree verify: verify_tree(argmax=True) + keep_path([0]) (keep the root only: a fully rejected
  tree), and keep_path alone for the top-1 chain's first 8 nodes and for an 8-node path off the
  chain (its KV rows move);
* chain verify of the same T: eval_verify_argmax + keep(1), the chain path generate() takes with
  tree_budget = 0 (our chain kernel on CUDA), for comparison.
With --split-walks, the tree verifies are timed once more on a second load of the model whose rows
plans split a tree into two walks where that shortens it (DELTASPEC_ROWS_SPLIT=1: deltaspec_rows.h;
off by default), interleaved with the rest ("tree verify 1+N, split walks").
--reps repetitions run interleaved (every measurement once, then again); the table shows the
median over repetitions [min-max]. With --llama-bench, llama.cpp's cost of a T-token batch (pp T)
and of a decode step (tg) at the same depth come from llama-bench in the same run (-fa 1, -ngl 99,
f16 KV), one llama-bench process per repetition, interleaved with ours; its ratio is pp T's time
over one tg token's time.
"""

from __future__ import annotations

import argparse
import heapq
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "tree_verify_cost.json"
CHAIN_SEED = 16  # the top-1 chain seeded first (Luce's default block of 16)


def ddtree_parents(n_nodes: int, a: float = 0.3) -> list[int]:
    """Parents (-1: the root) of a DDTree-shaped tree of n_nodes: the top-1 chain seeded, then
    best-first by path score (the sum of log q along the path), every depth's marginal q(rank r) =
    (1 - a) a^r (top-1 0.7, second 0.21, ...)."""
    log_q = lambda r: np.log(1 - a) + r * np.log(a)  # noqa: E731
    parents = []
    heap = []  # (-score, node order, parent node, rank)
    score = 0.0
    for d in range(min(n_nodes, CHAIN_SEED)):
        parents.append(d - 1)
        heapq.heappush(heap, (-(score + log_q(1)), len(heap), d - 1, 1))  # its next-ranked sibling
        score += log_q(0)
    if len(parents) == CHAIN_SEED:  # the chain's leaf's first child
        heapq.heappush(heap, (-(score + log_q(0)), len(heap), CHAIN_SEED - 1, 0))
    while len(parents) < n_nodes and heap:
        neg, _, par, rank = heapq.heappop(heap)
        node = len(parents)
        parents.append(par)
        heapq.heappush(heap, (neg + log_q(rank) - log_q(rank + 1), len(heap) + node, par, rank + 1))
        heapq.heappush(heap, (neg - log_q(0), len(heap) + node, node, 0))  # its first child
    return parents


def path_to(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.insert(0, node)
        node = parents[node]
    return out


def timed(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def tree_case(engine, n: int, rng):
    """A DDTree-shaped tree of n nodes: its rows' parents (the root -1, each node's parent row = its
    parent node + 1) and tokens, and one verify of it that keeps the root only (a fully rejected tree)."""
    parents = np.array([-1] + [p + 1 for p in ddtree_parents(n)], dtype=np.int32)
    tokens = rng.integers(0, engine.hparams_n_vocab, size=n + 1).astype(np.int32)
    root = np.array([0], dtype=np.int32)

    def tree_once():
        engine.verify_tree(tokens, parents, argmax=True)
        engine.keep_path(root)

    return parents, tokens, tree_once


def measure_ours(engine, widths: list[int], steps: int, rng, mma_max_columns: int = 0) -> dict[str, float]:
    """One repetition: every measurement once (median of `steps` timings), in ms; with
    mma_max_columns, the tree and chain verifies wider than 32 rows once more with products up to
    that many columns on our tensor-core kernels (launches of up to 32), interleaved."""
    n_vocab = engine.hparams_n_vocab
    token = lambda: np.array([rng.integers(0, n_vocab)], dtype=np.int32)  # noqa: E731
    # every timed group starts at the same depth (each timing adds a token or a path to the sequence)
    engine.reset_to(engine.depth)
    out = {"decode step": 1e3 * timed(lambda: engine.eval_argmax(token()), steps)}
    for n in widths:
        parents, tokens, tree_once = tree_case(engine, n, rng)

        def chain_once():
            engine.eval_verify_argmax(tokens)
            engine.keep(1)

        engine.reset_to(engine.depth)
        out[f"tree verify 1+{n}"] = 1e3 * timed(tree_once, steps)
        engine.reset_to(engine.depth)
        out[f"chain verify 1+{n}"] = 1e3 * timed(chain_once, steps)
        if mma_max_columns and n + 1 > 32:
            from deltaspec import _core

            _core.cuda_set_mma_max_columns(mma_max_columns)
            try:
                engine.reset_to(engine.depth)
                out[f"tree verify 1+{n}, mma <= {mma_max_columns}"] = 1e3 * timed(tree_once, steps)
                engine.reset_to(engine.depth)
                out[f"chain verify 1+{n}, mma <= {mma_max_columns}"] = 1e3 * timed(chain_once, steps)
            finally:
                _core.cuda_set_mma_max_columns(0)
        for name, rows in (("chain path", [0] + list(range(1, min(9, n + 1)))),
                           ("off-chain path", off_chain_path(parents))):
            if rows is None:
                continue
            keeps = []
            for _ in range(steps):
                engine.verify_tree(tokens, parents, argmax=True)
                t0 = time.perf_counter()
                engine.keep_path(np.array(rows, dtype=np.int32))
                keeps.append(time.perf_counter() - t0)
                engine.reset_to(engine.depth)
            out[f"keep_path {name} of {len(rows)} rows, 1+{n}"] = 1e3 * statistics.median(keeps)
    return out


def measure_split_walks(engine, widths: list[int], steps: int, rng) -> dict[str, float]:
    """One repetition of the tree verifies alone (ms), on an engine whose plans split trees."""
    out = {}
    for n in widths:
        tree_once = tree_case(engine, n, rng)[2]
        engine.reset_to(engine.depth)
        out[f"tree verify 1+{n}, split walks"] = 1e3 * timed(tree_once, steps)
    return out


def off_chain_path(parents: np.ndarray) -> list[int] | None:
    """The longest root-to-leaf path (rows) that leaves the top-1 chain, at most 9 rows."""
    best = None
    for row in range(len(parents)):
        p = path_to(list(parents), row)
        if p != list(range(len(p))) and len(p) <= 9 and (best is None or len(p) > len(best)):
            best = p
    return best


class Engine:
    """The model's engine at a fixed context depth (keep_path grows the sequence: reset_to undoes it)."""

    def __init__(self, model, depth: int, rng):
        self._e = model._live()
        self.hparams_n_vocab = model.n_vocab
        self.depth = depth
        self._prefix = rng.integers(0, model.n_vocab, size=depth).astype(np.int32)
        self._e.reserve_slots(128)
        self.reset_to(depth)

    def reset_to(self, depth: int):
        self._e.reset()
        self._e.eval(self._prefix[:depth], logits="none")

    def __getattr__(self, name):
        return getattr(self._e, name)


def measure_llama(binary: str, model: str, widths: list[int], depth: int) -> dict[str, float]:
    """One llama-bench process: pp T and tg 32 at `depth`, f16 KV, flash attention, all layers on the GPU."""
    cmd = [binary, "-m", model, "-p", ",".join(str(1 + n) for n in widths), "-n", "32", "-d", str(depth),
           "-fa", "1", "-ngl", "99", "-ctk", "f16", "-ctv", "f16", "-r", "5", "-o", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    out = {}
    for rec in json.loads(p.stdout):
        n_prompt, n_gen, ns = rec["n_prompt"], rec["n_gen"], float(rec["avg_ns"])
        if n_gen and not n_prompt:
            out["decode step"] = ns / n_gen / 1e6
        elif n_prompt and not n_gen:
            out[f"batch of {n_prompt}"] = ns / 1e6
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--widths", default="8,16,22,32,64", help="tree nodes N, verified as 1 + N rows (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=20, help="timings per measurement (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default: %(default)s)")
    ap.add_argument("--depth", type=int, default=256, help="context tokens before measuring (default: %(default)s)")
    ap.add_argument("--llama-bench", help="llama-bench binary: llama.cpp's batch cost in the same run")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--mma-max-columns", type=int, default=0, metavar="N",
                    help="CUDA: also time the verifies wider than 32 rows with products up to N columns on "
                         "deltaspec's tensor-core kernels (launches of up to 32) instead of ggml's mmq")
    ap.add_argument("--split-walks", action="store_true",
                    help="also time the tree verifies on a second load whose plans split trees into two walks")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default: %(default)s)")
    args = ap.parse_args()

    import os

    from deltaspec import Model

    if args.mma_max_columns and not args.device.startswith("cuda"):
        raise SystemExit("tree_verify_cost: --mma-max-columns is a CUDA option (deltaspec's tensor-core kernels)")
    widths = [int(x) for x in args.widths.split(",")]
    if any(n < 1 for n in widths):
        raise SystemExit(f"tree_verify_cost: --widths must be positive integers, got {args.widths!r}")
    rng = np.random.default_rng(0)
    model = Model(args.model, n_ctx=args.depth + 1024, n_threads=args.threads, device=args.device, progress=False)
    engine = Engine(model, args.depth, rng)
    split = None
    if args.split_walks:
        before = os.environ.get("DELTASPEC_ROWS_SPLIT")
        os.environ["DELTASPEC_ROWS_SPLIT"] = "1"  # read when the engine is built
        try:
            split_model = Model(args.model, n_ctx=args.depth + 1024, n_threads=args.threads, device=args.device,
                                progress=False)
        finally:
            if before is None:
                os.environ.pop("DELTASPEC_ROWS_SPLIT")
            else:
                os.environ["DELTASPEC_ROWS_SPLIT"] = before
        split = Engine(split_model, args.depth, rng)
    for _ in range(3):  # warm-up: graphs built, CUDA graphs captured
        measure_ours(engine, widths, 2, rng, args.mma_max_columns)
        if split:
            measure_split_walks(split, widths, 2, rng)
    runs = []
    for rep in range(args.reps):
        print(f"repetition {rep + 1} of {args.reps}", file=sys.stderr, flush=True)
        ms = measure_ours(engine, widths, args.steps, rng, args.mma_max_columns)
        if split:
            ms.update(measure_split_walks(split, widths, args.steps, rng))
        runs.append({"side": "deltaspec", "rep": rep + 1, "ms": ms})
        if args.llama_bench:
            runs.append({"side": "llama.cpp", "rep": rep + 1,
                         "ms": measure_llama(args.llama_bench, args.model, widths, args.depth)})
    # verifies whose plan split the tree (the second load's, when there is one)
    split_walks = (split or engine).tree_stats["split_walks"]
    model.close()
    if split:
        split_model.close()

    def values(side, name):
        return [r["ms"][name] for r in runs if r["side"] == side and name in r["ms"]]

    step = statistics.median(values("deltaspec", "decode step"))
    rows = []
    for name in runs[0]["ms"]:
        v = values("deltaspec", name)
        rows.append(dict(side="deltaspec", what=name, ms=v, median_ms=statistics.median(v),
                         steps=statistics.median(v) / step))
    if args.llama_bench:
        l_step = statistics.median(values("llama.cpp", "decode step"))
        for name in next(r for r in runs if r["side"] == "llama.cpp")["ms"]:
            v = values("llama.cpp", name)
            rows.append(dict(side="llama.cpp", what=name, ms=v, median_ms=statistics.median(v),
                             steps=statistics.median(v) / l_step))

    print(f"Tree verify cost on {Path(args.model).name}, device {args.device}, depth {args.depth}; "
          f"ms = median over {args.reps} interleaved repetitions [min-max] of medians of {args.steps}; "
          f"{split_walks} tree verifies split into two walks\n")
    print("| side | what | ms | x own decode step |")
    print("|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['side']} | {r['what']} | {spread(r['ms'])} | {r['steps']:.2f} |")
    goal = next((r for r in rows if r["what"] == "tree verify 1+22"), None)
    if goal:
        print(f"\ngoal (issue 23): tree verify of 1 + 22 rows <= 1.5 decode steps: {goal['steps']:.2f} "
              f"({'met' if goal['steps'] <= 1.5 else 'NOT met'})")
    commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    meta = dict(model=str(args.model), device=args.device, depth=args.depth, steps=args.steps, reps=args.reps,
                widths=widths, split_walks=split_walks, machine=platform.node(), date=time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                commit=commit or None, llama_bench=args.llama_bench,
                env={k: v for k, v in sorted(os.environ.items()) if k.startswith("DELTASPEC_")})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows, runs=runs), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
