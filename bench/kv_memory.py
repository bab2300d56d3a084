"""KV cache bytes as the engine allocates them, per cache type, at several context lengths.

    python bench/kv_memory.py MODEL.gguf [--device cuda] [--types f16 q8_0 q4_0 tq4 tq3] [--out FILE.json]

For each type one engine is built at the largest context (default 262144) and its kv_cache_info()
read (the allocated tensors' bytes); the smaller contexts are that per-token size times n_ctx, which
kv_cache.kv_bytes_per_token must also give (checked here: a mismatch raises). Writes
bench/results/latest/kv_memory.json and prints a table (GiB).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "kv_memory.json"
CONTEXTS = [32768, 131072, 262144]
TYPES = ["f16", "q8_0", "q4_0", "tq4", "tq3"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--contexts", nargs="+", type=int, default=CONTEXTS)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    from deltaspec import Model
    from deltaspec.kv_cache import kv_bytes_per_token

    n_max = max(args.contexts)
    rows = []
    for t in args.types:
        with Model(args.model, n_ctx=n_max, device=args.device, type_k=t, type_v=t, progress=False) as m:
            info = m.kv_cache_info()
            hp = m.hparams
        per_token = info["kv_bytes"] / info["n_ctx"]
        if per_token != kv_bytes_per_token(hp, t, t):
            raise RuntimeError(f"{t}: allocated {per_token} B/token, kv_bytes_per_token says {kv_bytes_per_token(hp, t, t)}")
        types = {(a["type_k"], a["type_v"]) for a in info["attention_layers"]}
        if types != {(t, t)}:
            raise RuntimeError(f"asked for {t}, allocated {types}")
        rows.append({"type": t, "bytes_per_token": per_token, "allocated_n_ctx": info["n_ctx"],
                     "allocated_kv_bytes": info["kv_bytes"], "buffer": info["attention_layers"][0]["buffer"],
                     "kv_bytes": {n: int(per_token * n) for n in args.contexts}})
        print(f"  {t}: {per_token:.0f} B/token", file=sys.stderr, flush=True)
    result = {"what": "KV cache bytes as allocated (bench/kv_memory.py)", "model": args.model, "device": args.device,
              "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    f16 = next((r["bytes_per_token"] for r in rows if r["type"] == "f16"), None)
    print("| type | bytes/token | " + " | ".join(f"GiB at {n // 1024}K" for n in args.contexts) + " | vs f16 |")
    print("|---|---:|" + "---:|" * len(args.contexts) + "---:|")
    for r in rows:
        ratio = f"{f16 / r['bytes_per_token']:.2f}x" if f16 else "-"
        print(f"| {r['type']} | {r['bytes_per_token']:.0f} | "
              + " | ".join(f"{r['kv_bytes'][n] / 2**30:.2f}" for n in args.contexts) + f" | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
