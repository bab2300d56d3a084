"""Prefill and decode speed, deltaspec vs llama.cpp (llama-bench) on the same GGUF, interleaved.

    python bench/decode_bench.py run    MODEL.gguf --llama-bench BIN/llama-bench [--reps 3] [--out FILE.json]
    python bench/decode_bench.py stock  MODEL.gguf --llama-bench BIN/llama-bench --stock-bench STOCK/llama-bench
    python bench/decode_bench.py report FILE.json [--model MODEL.gguf]      # the table again
    python bench/decode_bench.py ours   MODEL.gguf --out ours.json           # one measurement of deltaspec alone

Tests: pp512 (prompt of 512 tokens), tg128 (128 generated tokens after an empty context) and
tg128 at depth 16384 (after a 16384-token prompt), each with f16 and q4_0 KV caches, as
llama-bench measures them; on request (--tests, --cache-types) tg128 at depths 65536 and 131072 and
the KV types q8_0, tq3, tq4 and q4_0+rot (deltaspec's alone: llama.cpp has no tq types). deltaspec's numbers come from Model.generate's C++ loop (greedy, the
timed part is the decode loop, not the prefill) and Model.eval for prefill.

`run` alternates the two sides, each repetition a fresh process: deltaspec r1, llama.cpp r1,
deltaspec r2, llama.cpp r2, ... (--reps, default 3), so that drift of the machine (clocks,
temperature, a neighbour's load) lands on both sides alike. The table gives per side the median
and the spread (min-max) of the repetitions and the ratio of the medians; the JSON holds every
repetition. `stock` does the same for two llama-bench binaries: the one built with deltaspec's
dispatchers injected into ggml-cuda (switched off there) against a stock build of the same tree,
which shows that the injection leaves the peer's speed as it was.

The roofline is the bytes a decode step must read (every weight used per token, the KV rows at
that depth and the DeltaNet state read and written) over the device bandwidth measured in the
same run (a device to device copy through torch, when torch sees a GPU). Weights are synthetic
(`deltaspec synth`): the speed is that of the real model's shapes and quant mix, not of real
weights.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TESTS = [("pp512", 512, 0, 0), ("tg128", 0, 128, 0), ("tg128@d16384", 0, 128, 16384),
         ("tg128@d65536", 0, 128, 65536), ("tg128@d131072", 0, 128, 131072)]
DEFAULT_TESTS = ["pp512", "tg128", "tg128@d16384"]  # the long depths on request (--tests): minutes of prefill each
CACHE_TYPES = ["f16", "q4_0"]
# more for --cache-types: deltaspec's tq3/tq4 and rotated q4_0 (llama.cpp has no tq types; its q4_0
# cache is rotated already, spec §7.2, so its q4_0 row is the peer of both q4_0 rows)
MORE_CACHE_TYPES = ["q8_0", "tq3", "tq4", "q4_0+rot"]
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "decode_bench.json"


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 240000, size=n).tolist()


def _selected(tests: list[str] | None) -> list[tuple]:
    return [t for t in TESTS if t[0] in (tests or DEFAULT_TESTS)]


def measure_ours(model_path: str, device: str, tests: list[str] | None = None,
                 cache_types: list[str] | None = None, threads: int | None = None, seed: int = 0) -> list[dict]:
    """One measurement of every selected test and KV type, in this process."""
    from deltaspec import Model

    chosen = _selected(tests)
    n_ctx = max(n_prompt + depth + n_gen for _, n_prompt, n_gen, depth in chosen) + 64
    rows = []
    for ctk in cache_types or CACHE_TYPES:
        with Model(model_path, n_ctx=n_ctx, device=device, n_ubatch=512, type_k=ctk, type_v=ctk,
                   n_threads=threads) as m:
            m.generate(_prompt(8), max_tokens=4, temperature=0)  # warm-up: allocations, kernels
            for name, n_prompt, n_gen, depth in chosen:
                if n_prompt:
                    m.reset()
                    t0 = time.perf_counter()
                    m.eval(_prompt(n_prompt, seed), logits="last")
                    tok_s = n_prompt / (time.perf_counter() - t0)
                else:
                    res = m.generate(_prompt(max(depth, 1), seed), max_tokens=n_gen, temperature=0)
                    n = res.stats.generated_tokens - 1  # the first token comes from the prefill
                    tok_s = n / res.stats.decode_seconds
                rows.append({"test": name, "type_k": ctk, "tok_s": tok_s})
                print(f"  deltaspec {name:<14} {ctk:<5} {tok_s:9.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def measure_llama_bench(binary: str, model_path: str, tests: list[str] | None = None,
                        cache_types: list[str] | None = None, threads: int | None = None,
                        label: str = "llama.cpp") -> list[dict]:
    """One llama-bench process (-r 1) over every selected test and KV type."""
    chosen = _selected(tests)
    pp = [str(p) for _, p, _, _ in chosen if p] or ["0"]
    tg = [str(g) for _, _, g, _ in chosen if g] or ["0"]
    depths = sorted({d for _, _, _, d in chosen})
    rows = []
    for ctk in [t for t in cache_types or CACHE_TYPES if t in CACHE_TYPES + ["q8_0"]]:  # llama.cpp's own types
        cmd = [binary, "-m", model_path, "-p", ",".join(pp), "-n", ",".join(tg), "-d", ",".join(map(str, depths)),
               "-ctk", ctk, "-ctv", ctk, "-fa", "1", "-ngl", "99", "-r", "1", "-o", "json"]
        if threads:
            cmd += ["-t", str(threads)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        for rec in json.loads(p.stdout):
            n_prompt, n_gen, depth = rec["n_prompt"], rec["n_gen"], rec.get("n_depth", 0)
            if (n_prompt and n_gen) or (not n_prompt and not n_gen):
                continue
            if n_prompt and depth:  # llama-bench times pp512 at every depth; the comparison is at depth 0
                continue
            name = f"pp{n_prompt}" if n_prompt else (f"tg{n_gen}" if not depth else f"tg{n_gen}@d{depth}")
            if name not in [t[0] for t in chosen]:
                continue
            rows.append({"test": name, "type_k": ctk, "tok_s": float(rec["avg_ts"])})
            print(f"  {label} {name:<14} {ctk:<5} {rows[-1]['tok_s']:9.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def _ours_in_fresh_process(model: str, device: str, tests, cache_types, threads, seed: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ours.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "ours", model, "--device", device, "--out", str(out),
               "--seed", str(seed)]
        if tests:
            cmd += ["--tests", *tests]
        if cache_types:
            cmd += ["--cache-types", *cache_types]
        if threads:
            cmd += ["--threads", str(threads)]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def interleave(sides: list[tuple[str, callable]], reps: int, on_run=None, deadline: float | None = None) -> list[dict]:
    """Run side 1 rep 1, side 2 rep 1, side 1 rep 2, ...; every measurement tagged with its side and rep.

    on_run(runs) is called after each measurement (the caller saves what it has: a GPU call cut at
    its time limit keeps its finished repetitions). With deadline (a time.monotonic() value), a
    measurement that would end after it, judged by the side's previous one, is not started: the
    repetitions stop there, all sides having the same number where they can."""
    runs: list[dict] = []
    last_wall: dict[str, float] = {}
    for r in range(reps):
        if deadline is not None and r > 0 and time.monotonic() + sum(last_wall.values()) > deadline:
            print(f"deadline: stopping after {r} of {reps} repetitions", file=sys.stderr, flush=True)
            break
        for label, measure in sides:
            print(f"{label}, repetition {r + 1} of {reps}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            rows = measure(r)
            last_wall[label] = time.perf_counter() - t0
            runs.append({"side": label, "rep": r + 1, "wall_s": round(last_wall[label], 1), "rows": rows})
            if on_run is not None:
                on_run(runs)
    return runs


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def table(result: dict, model_path: str | None = None, bandwidth: float | None = None) -> str:
    """Median [min-max] of each side's repetitions per test and KV type, and the ratio of the medians."""
    a, b = (result["sides"] + ["-"])[:2]  # a run of deltaspec alone has one side
    reps: dict[tuple, dict[str, list[float]]] = {}
    for run in result["runs"]:
        for row in run["rows"]:
            reps.setdefault((row["test"], row["type_k"]), {}).setdefault(run["side"], []).append(row["tok_s"])
    n = max(run["rep"] for run in result["runs"])
    roof_col = bool(bandwidth and model_path)
    lines = [f"| test | KV | {a} tok/s, median [min-max] | {b} tok/s, median [min-max] | ratio of medians |"
             + (f" {a} % roofline |" if roof_col else ""),
             "|---|---|---:|---:|---:|" + ("---:|" if roof_col else "")]
    if len(result["sides"]) == 1:
        lines[0] = lines[0].replace(f" {b} tok/s, median [min-max] | ratio of medians |", "")
        lines[1] = lines[1][:-10]
    order = {t[0]: i for i, t in enumerate(TESTS)}
    def row_order(item):  # f16 KV first, then the tests in TESTS' order
        (test, ctk), _ = item
        return ctk != "f16", ctk, order.get(test, len(order))

    for (test, ctk), by_side in sorted(reps.items(), key=row_order):
        va, vb = by_side.get(a, []), by_side.get(b, [])
        ratio = f"{statistics.median(va) / statistics.median(vb):.2f}x" if va and vb else "-"
        line = (f"| {test} | {ctk} | {_spread(va) if va else '-'} | {_spread(vb) if vb else '-'} | {ratio} |"
                if len(result["sides"]) > 1 else f"| {test} | {ctk} | {_spread(va)} |")
        if roof_col:
            roof = ""
            if test.startswith("tg") and va:
                depth = int(test.split("@d")[1]) if "@d" in test else 0
                limit = bandwidth / bytes_per_token(model_path, depth, ctk)
                roof = f"{100 * statistics.median(va) / limit:.0f}% of {limit:.0f}"
            line += f" {roof} |"
        lines.append(line)
    if result.get("meta", {}).get("note"):
        lines.append("\n" + result["meta"]["note"] + ".")
    else:
        lines.append(f"\n{n} repetitions per side, interleaved ({a} r1, {b} r1, {a} r2, ...), each a fresh process."
                     if len(result["sides"]) > 1 else f"\n{n} repetitions, each a fresh process.")
    if bandwidth:
        lines.append(f"Measured device bandwidth (copy, read+write): {bandwidth / 1e12:.2f} TB/s.")
    return "\n".join(lines)


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


def _meta(args, what: str) -> dict:
    commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    return {"what": what, "model": str(args.model), "reps": args.reps, "tests": args.tests or DEFAULT_TESTS,
            "cache_types": args.cache_types or CACHE_TYPES, "machine": platform.node(),
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit or None,
            "device": getattr(args, "device", None)}


def _finish(result: dict, out: Path, model: str | None, bandwidth: float | None) -> None:
    result["meta"]["bandwidth"] = bandwidth
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result, model, bandwidth))


def _common(p: argparse.ArgumentParser, reps: int) -> None:
    p.add_argument("model")
    p.add_argument("--reps", type=int, default=reps, help="repetitions per side (default: %(default)s)")
    p.add_argument("--tests", nargs="+", choices=[t[0] for t in TESTS], help="a subset (default: all)")
    p.add_argument("--cache-types", nargs="+", choices=CACHE_TYPES + MORE_CACHE_TYPES, help="a subset (default: all)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for both sides")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="deltaspec vs llama-bench, interleaved")
    _common(r, 3)
    r.add_argument("--device", default="cuda")
    r.add_argument("--llama-bench", help="llama-bench binary (without it: deltaspec alone)")
    r.add_argument("--out", type=Path, default=DEFAULT_OUT)
    r.add_argument("--bandwidth", type=float, help="bytes/s; measured here when omitted")
    r.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="start no repetition that would end later than this (judged by the previous one)")
    s = sub.add_parser("stock", help="llama-bench with injected (switched-off) dispatchers vs a stock build")
    _common(s, 3)
    s.add_argument("--llama-bench", required=True, help="the build with deltaspec's kernels injected")
    s.add_argument("--stock-bench", required=True, help="the build of the same tree without them")
    s.add_argument("--out", type=Path, default=DEFAULT_OUT.with_name("stock_vs_injected.json"))
    o = sub.add_parser("ours", help="one measurement of deltaspec alone (one process)")
    o.add_argument("model")
    o.add_argument("--device", default="cuda")
    o.add_argument("--tests", nargs="+", choices=[t[0] for t in TESTS])
    o.add_argument("--cache-types", nargs="+", choices=CACHE_TYPES + MORE_CACHE_TYPES)
    o.add_argument("-t", "--threads", type=int, default=None)
    o.add_argument("--seed", type=int, default=0, help="prompt tokens' seed")
    o.add_argument("--out", required=True)
    c = sub.add_parser("report", help="print the table of a run's JSON")
    c.add_argument("result")
    c.add_argument("--model", help="the GGUF, for the roofline column")
    c.add_argument("--bandwidth", type=float, help="bytes/s (default: the one recorded in the JSON)")
    args = ap.parse_args(argv)

    if args.cmd == "ours":
        rows = measure_ours(args.model, args.device, args.tests, args.cache_types, args.threads, args.seed)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    elif args.cmd == "run":
        for p in (args.model, args.llama_bench or args.model):
            if not os.path.exists(p):
                raise SystemExit(f"decode_bench: {p} does not exist")
        sides = [("deltaspec", lambda rep: _ours_in_fresh_process(args.model, args.device, args.tests,
                                                                  args.cache_types, args.threads, rep))]
        if args.llama_bench:
            sides.append(("llama.cpp", lambda rep: measure_llama_bench(args.llama_bench, args.model, args.tests,
                                                                       args.cache_types, args.threads)))
        result = {"meta": _meta(args, "deltaspec vs llama.cpp"), "sides": [s[0] for s in sides], "runs": []}

        def save_partial(runs):  # what a run cut short leaves: the finished measurements
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({**result, "runs": runs, "partial": True}, indent=1) + "\n")

        deadline = time.monotonic() + args.deadline if args.deadline else None
        result["runs"] = interleave(sides, args.reps, on_run=save_partial, deadline=deadline)
        bw = args.bandwidth or (device_bandwidth() if args.device == "cuda" else None)
        _finish(result, args.out, args.model, bw)
    elif args.cmd == "stock":
        for p in (args.model, args.llama_bench, args.stock_bench):
            if not os.path.exists(p):
                raise SystemExit(f"decode_bench: {p} does not exist")
        args.tests = args.tests or ["pp512", "tg128"]
        args.cache_types = args.cache_types or ["f16"]
        sides = [("llama.cpp injected (off)", lambda rep: measure_llama_bench(
                     args.llama_bench, args.model, args.tests, args.cache_types, args.threads, "injected")),
                 ("llama.cpp stock", lambda rep: measure_llama_bench(
                     args.stock_bench, args.model, args.tests, args.cache_types, args.threads, "stock"))]
        result = {"meta": _meta(args, "llama.cpp with injected dispatchers (off) vs stock"),
                  "sides": [s[0] for s in sides], "runs": interleave(sides, args.reps)}
        _finish(result, args.out, None, None)
    else:
        result = json.loads(Path(args.result).read_text())
        print(table(result, args.model, args.bandwidth or result.get("meta", {}).get("bandwidth")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
