"""What verifying a draft chain costs next to one decode step, and what rolling back costs.

    python bench/verify_cost.py MODEL.gguf [--device cuda] [--out verify.json]

For each chain length T (the last committed token + T-1 drafts) it times the target's verify pass
(`eval_verify_argmax`: every row's argmax, every token's recurrent state kept), then `keep(1)` (the
rollback a fully rejected draft needs), and compares both with a plain greedy decode step
(`eval_argmax` of one token); then keep(n) alone after the longest chain for n = 1, half of it
and all of it. Median of --steps timings after a warm-up, at a
context depth of --depth tokens. Speculative decoding pays off when verify(T) stays close to one
step: the goal for the GPU is verify(17) <= 1.3x a decode step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def timed(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chains", default="1,2,4,8,9,16,17,32", help="chain lengths T (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=20, help="timings per measurement (default: %(default)s)")
    ap.add_argument("--depth", type=int, default=256, help="context tokens before measuring (default: %(default)s)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    from deltaspec import Model

    chains = [int(x) for x in args.chains.split(",")]
    model = Model(args.model, n_ctx=args.depth + 4096, n_threads=args.threads, device=args.device, progress=False)
    engine = model._live()
    engine.reserve_slots(max(chains))
    rng = np.random.default_rng(0)
    n_vocab = model.n_vocab
    engine.eval(rng.integers(0, n_vocab, size=args.depth).astype(np.int32), logits="none")

    def token():
        return np.array([rng.integers(0, n_vocab)], dtype=np.int32)

    for _ in range(3):  # warm-up: graphs built, CUDA graphs captured
        engine.eval_argmax(token())
    step = timed(lambda: engine.eval_argmax(token()), args.steps)
    rows = [dict(T=1, kind="decode step (eval_argmax)", ms=1e3 * step, ratio=1.0)]
    for T in chains:
        batch = rng.integers(0, n_vocab, size=T).astype(np.int32)

        def verify():
            engine.eval_verify_argmax(batch)
            engine.keep(1)

        for _ in range(3):
            verify()
        t_both = timed(verify, args.steps)
        rows.append(dict(T=T, kind="verify + keep(1)", ms=1e3 * t_both, ratio=t_both / step))
    # rollback alone: keep(n) after a verify of the longest chain, timed on its own
    T = max(chains)
    longest = rng.integers(0, n_vocab, size=T).astype(np.int32)
    for n in sorted({1, max(1, T // 2), T}):
        keeps = []
        for _ in range(args.steps):
            engine.eval_verify_argmax(longest)
            t0 = time.perf_counter()
            engine.keep(n)
            keeps.append(time.perf_counter() - t0)
        t_keep = statistics.median(keeps)
        rows.append(dict(T=T, kind=f"keep({n}) alone (rollback)", ms=1e3 * t_keep, ratio=t_keep / step))
    model.close()

    print(f"Verify cost on {Path(args.model).name}, device {args.device}, depth {args.depth}, "
          f"median of {args.steps}\n")
    print("| T | what | ms | x decode step |")
    print("|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['T']} | {r['kind']} | {r['ms']:.3f} | {r['ratio']:.2f} |")
    if args.out:
        meta = dict(model=str(args.model), device=args.device, depth=args.depth, steps=args.steps,
                    machine=platform.node(), date=time.strftime("%Y-%m-%d %H:%M"))
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
