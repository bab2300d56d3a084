"""Where a batch-invariant CUDA model's rows still part from its one-token steps, if they do: the
largest |batch - steps| logit difference (tests' batch_vs_steps: 12 rows after no context) of each
model under each environment variant, one process each (the variables are read when a model is
built), printed as a table and written as JSON.

    python bench/invariance_probe.py A.gguf B.gguf --variants "" "DELTASPEC_CUDA_DELTANET=0" --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def worker(path: str, rows: int, context: int) -> dict:
    import numpy as np

    from deltaspec import Model, _core
    from deltaspec.testing.batch_rows import batch_vs_steps

    before = [_core.cuda_invariant_count(w) for w in range(4)]
    with Model(path, device="cuda", n_ctx=1024, batch_invariant=True, progress=False) as m:
        diff = batch_vs_steps(m, rows, context, np.random.default_rng(rows))
    return {"max_diff": diff, "routes": [a - b for a, b in zip((_core.cuda_invariant_count(w) for w in range(4)), before)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--variants", nargs="+", default=[""], help="space-separated VAR=VALUE lists ('' = none)")
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--context", type=int, default=0)
    ap.add_argument("--out")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.rows, args.context)))
        return
    results = []
    for path in args.models:
        for variant in args.variants:
            env = {**os.environ, **dict(kv.split("=", 1) for kv in variant.split())}
            out = subprocess.run([sys.executable, __file__, "--worker", path, "--rows", str(args.rows),
                                  "--context", str(args.context)], env=env, capture_output=True, text=True)
            row = {"model": os.path.basename(path), "variant": variant or "(none)"}
            row.update(json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0
                       else {"error": out.stderr.strip().splitlines()[-1:]})
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
