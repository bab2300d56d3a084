"""Prefill and decode speed, deltaspec vs llama.cpp (llama-bench) on the same GGUF, in one run.

    python bench/decode_bench.py ours  MODEL.gguf --device cuda --out ours.json
    python bench/decode_bench.py peer  MODEL.gguf --llama-bench BIN/llama-bench --out peer.json
    python bench/decode_bench.py report ours.json peer.json --out report.md   # table + ratios + roofline

Tests: pp512 (prompt of 512 tokens), tg128 (128 generated tokens after an empty context) and
tg128 at depth 16384 (after a 16384-token prompt), each with f16 and q4_0 KV caches, as
llama-bench measures them. deltaspec's numbers come from Model.generate's C++ loop (greedy, the
timed part is the decode loop, not the prefill) and Model.eval for prefill. The roofline is the
bytes a decode step must read (every weight used per token, the KV rows at that depth and the
DeltaNet state read and written) over the device bandwidth measured in the same run (a device to
device copy through torch, when torch sees a GPU). Weights are synthetic (`deltaspec synth`):
the speed is that of the real model's shapes and quant mix, not of real weights.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TESTS = [("pp512", 512, 0, 0), ("tg128", 0, 128, 0), ("tg128@d16384", 0, 128, 16384)]
CACHE_TYPES = ["f16", "q4_0"]


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 240000, size=n).tolist()


def measure_ours(model_path: str, device: str, reps: int, tests: list[str] | None = None,
                 cache_types: list[str] | None = None) -> list[dict]:
    from deltaspec import Model

    rows = []
    for ctk in cache_types or CACHE_TYPES:
        with Model(model_path, n_ctx=16384 + 512, device=device, n_ubatch=512, type_k=ctk, type_v=ctk) as m:
            m.generate(_prompt(8), max_tokens=4, temperature=0)  # warm-up: allocations, kernels
            for name, n_prompt, n_gen, depth in TESTS:
                if tests and name not in tests:
                    continue
                speeds = []
                for r in range(reps):
                    if n_prompt:
                        m.reset()
                        t0 = time.perf_counter()
                        m.eval(_prompt(n_prompt, r), logits="last")
                        speeds.append(n_prompt / (time.perf_counter() - t0))
                    else:
                        res = m.generate(_prompt(max(depth, 1), r), max_tokens=n_gen, temperature=0)
                        n = res.stats.generated_tokens - 1  # the first token comes from the prefill
                        speeds.append(n / res.stats.decode_seconds)
                rows.append({"engine": "deltaspec", "test": name, "type_k": ctk, "type_v": ctk,
                             "tok_s": float(np.median(speeds)), "reps": speeds})
                print(f"deltaspec {name:<14} {ctk:<5} {rows[-1]['tok_s']:9.1f} tok/s", flush=True)
    return rows


def measure_peer(model_path: str, llama_bench: str, reps: int) -> list[dict]:
    rows = []
    for ctk in CACHE_TYPES:
        cmd = [llama_bench, "-m", model_path, "-p", "512", "-n", "128", "-d", "0,16384", "-ctk", ctk, "-ctv", ctk,
               "-fa", "1", "-ngl", "99", "-r", str(reps), "-o", "json"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        for rec in json.loads(out):
            n_prompt, n_gen, depth = rec["n_prompt"], rec["n_gen"], rec.get("n_depth", 0)
            if n_prompt and n_gen:
                continue
            if n_prompt and depth:  # llama-bench also times pp512 at depth; we compare pp at depth 0
                continue
            name = "pp512" if n_prompt else ("tg128" if not depth else f"tg128@d{depth}")
            rows.append({"engine": "llama.cpp", "test": name, "type_k": ctk, "type_v": ctk,
                         "tok_s": float(rec["avg_ts"]), "reps": rec.get("samples_ts", [])})
            print(f"llama.cpp {name:<14} {ctk:<5} {rows[-1]['tok_s']:9.1f} tok/s", flush=True)
    return rows


def device_bandwidth() -> float | None:
    """Bytes/s of a device-to-device copy (read + write counted), or None without a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)


def bytes_per_token(model_path: str, depth: int, ctk: str) -> int:
    from deltaspec.gguf_file import read_gguf
    from deltaspec.kv_cache import kv_bytes_per_token
    from deltaspec.qwen35 import expected_tensors, read_hparams

    f = read_gguf(model_path)
    hp = read_hparams(f)
    used = expected_tensors(hp, f)
    weights = sum(f.tensors[n].n_bytes for n in used if n != "token_embd.weight" or hp.tied_output)
    return weights + 2 * hp.recurrent_state_bytes + depth * kv_bytes_per_token(hp, ctk, ctk)


def report(ours: list[dict], peer: list[dict], model_path: str | None, bandwidth: float | None) -> str:
    key = {(r["test"], r["type_k"]): r["tok_s"] for r in peer}
    lines = ["| test | KV | deltaspec tok/s | llama.cpp tok/s | ratio | deltaspec % roofline |",
             "|---|---|---:|---:|---:|---:|"]
    for r in ours:
        p = key.get((r["test"], r["type_k"]))
        roof = ""
        if bandwidth and model_path and r["test"].startswith("tg"):
            depth = int(r["test"].split("@d")[1]) if "@d" in r["test"] else 0
            limit = bandwidth / bytes_per_token(model_path, depth, r["type_k"])
            roof = f"{100 * r['tok_s'] / limit:.0f}% of {limit:.0f}"
        lines.append(f"| {r['test']} | {r['type_k']} | {r['tok_s']:.1f} | {p:.1f} | {r['tok_s'] / p:.2f}x | {roof} |"
                     if p else f"| {r['test']} | {r['type_k']} | {r['tok_s']:.1f} | - | - | {roof} |")
    if bandwidth:
        lines.append(f"\nMeasured device bandwidth (copy, read+write): {bandwidth / 1e12:.2f} TB/s.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("ours")
    a.add_argument("model")
    a.add_argument("--device", default="cuda")
    a.add_argument("--reps", type=int, default=3)
    a.add_argument("--out", required=True)
    a.add_argument("--tests", nargs="+", choices=[t[0] for t in TESTS], help="a subset (default: all)")
    a.add_argument("--cache-types", nargs="+", choices=CACHE_TYPES, help="a subset (default: all)")
    b = sub.add_parser("peer")
    b.add_argument("model")
    b.add_argument("--llama-bench", required=True)
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--out", required=True)
    c = sub.add_parser("report")
    c.add_argument("ours")
    c.add_argument("peer")
    c.add_argument("--model")
    c.add_argument("--bandwidth", type=float, help="bytes/s; measured here when omitted")
    c.add_argument("--out")
    args = ap.parse_args(argv)
    if args.cmd == "ours":
        rows = measure_ours(args.model, args.device, args.reps, args.tests, args.cache_types)
        Path(args.out).write_text(json.dumps(rows, indent=1))
    elif args.cmd == "peer":
        Path(args.out).write_text(json.dumps(measure_peer(args.model, args.llama_bench, args.reps), indent=1))
    else:
        bw = args.bandwidth or device_bandwidth()
        text = report(json.loads(Path(args.ours).read_text()), json.loads(Path(args.peer).read_text()), args.model, bw)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
