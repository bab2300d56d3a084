"""Where a decode step and a verify pass spend GPU time, kernel by kernel (Nsight Compute).

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \\
        python bench/kernel_profile.py run MODEL.gguf --what decode > decode.csv
    python bench/kernel_profile.py report decode.csv [verify.csv ...]

`run` loads the model on CUDA, prefills --depth tokens, warms the step up (graphs built, CUDA graphs
captured), then brackets exactly one step with cudaProfilerStart/Stop: a greedy decode step
(`--what decode`), a verify pass of --chain tokens (`--what verify`), a tree verify pass of 1 +
(--chain - 1) DDTree-shaped rows (`--what tree`, verify_tree alone) or the commit of its top-1
chain's first 9 rows after it (`--what keep-path`), or one scheduler step of --n-seqs sequences
decoding one row each (`--what batch`, add_request / step). `report` groups the
kernels ncu measured into matmul / DeltaNet / attention / other and prints a markdown table.
Kernel times exclude launch gaps, so their sum is below the step's wall time.

    python bench/kernel_profile.py run MODEL.gguf --what tree --chain 23 --trace tree.json
    python bench/kernel_profile.py trace tree.json [...]

`--trace` records the same bracketed step with torch's profiler instead (CUPTI's activity records:
every kernel of the process as it really ran, CUDA graph nodes included, nothing serialized; the
machine has no Nsight Systems) into a Chrome trace; `trace` reads such traces: per group the
kernels' time, the GPU's idle time just before them (the launch gaps and dependency waits that
group's kernels start after) and their share of the step's span (what each kernel adds to it past
the end of the kernels before: early-launched kernels overlap, so their times add up to more than
the span, these shares do not), and the span from the first kernel's start to the last one's end. `run` prints the step's wall time (Python, synchronized) to stderr.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import re
import sys
import time
from collections import defaultdict

import numpy as np

GROUPS = [  # first match wins
    ("matmul (deltaspec: q4k_gemv, q6k_gemv, q4k_mma, q6k_mma)", r"deltaspec_cuda::q[46]k_"),
    ("quantize activations (deltaspec: x for q4k_mma, q6k_mma)", r"deltaspec_cuda::quantize"),
    ("quantize activations (q8_1)", r"quantize"),  # before mmq: ggml's quantize_mmq_q8_1
    ("matmul (quantized mat-vec, mmvq)", r"mul_mat_vec_q"),
    ("matmul (quantized tiles, mmq)", r"mul_mat_q|mmq"),
    ("matmul (float)", r"mul_mat|gemm|mmf|cutlass|sm90_xmma"),
    ("gated delta net", r"gated_delta|deltanet"),
    ("conv / ssm_conv", r"ssm_conv|conv"),
    ("flash attention", r"flash_attn|fattn"),
    ("norms", r"norm"),
    ("copies / get_rows / set_rows / concat", r"cpy|copy|get_rows|set_rows|concat"),
    ("argmax", r"argmax"),
]


def run(args) -> int:
    from deltaspec import Model

    cudart = _cudart()
    if args.what == "batch":
        return run_batch(args, cudart)
    from tree_verify_cost import ddtree_parents

    m = Model(args.model, n_ctx=args.depth + 1024, device="cuda", progress=False)
    e = m._live()
    e.reserve_slots(args.chain)
    rng = np.random.default_rng(0)
    e.eval(rng.integers(0, m.n_vocab, size=args.depth).astype(np.int32), logits="none")
    chain = rng.integers(0, m.n_vocab, size=args.chain).astype(np.int32)
    parents = np.array([-1] + [p + 1 for p in ddtree_parents(args.chain - 1)], dtype=np.int32)
    one = np.array([7], dtype=np.int32)
    root, chain_path = np.array([0], dtype=np.int32), np.arange(min(9, args.chain), dtype=np.int32)

    def before():  # what runs unprofiled ahead of the profiled part
        if args.what == "keep-path":
            e.verify_tree(chain, parents, argmax=True)

    def profiled():
        if args.what == "decode":
            e.eval_argmax(one)
        elif args.what == "verify":
            e.eval_verify_argmax(chain)
            e.keep(1)
        elif args.what == "tree":
            e.verify_tree(chain, parents, argmax=True)
        else:
            e.keep_path(chain_path)

    def after():  # a tree verify is committed before the next (its root: the sequence grows by one)
        if args.what == "tree":
            e.keep_path(root)

    for _ in range(4):
        before()
        profiled()
        after()
    before()
    cudart.cudaDeviceSynchronize()
    if args.trace:
        import torch  # CUPTI through torch's profiler: sees ggml-cuda's kernels too (one process, one context)

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            profiled()
            cudart.cudaDeviceSynchronize()
            wall = time.perf_counter() - t0
        prof.export_chrome_trace(args.trace)
    else:
        cudart.cudaProfilerStart()
        t0 = time.perf_counter()
        profiled()
        cudart.cudaDeviceSynchronize()
        wall = time.perf_counter() - t0
        cudart.cudaProfilerStop()
    print(f"{args.what}: {1e3 * wall:.3f} ms wall (one step, synchronized)", file=sys.stderr)
    m.close()
    return 0


def run_batch(args, cudart) -> int:
    """One step of --n-seqs sequences (one greedy row each) through add_request / step."""
    from deltaspec import Model
    from deltaspec.sampling import SamplingOptions

    m = Model(args.model, n_ctx=args.depth + 64, device="cuda", n_seq_max=args.n_seqs, progress=False)
    engine = m._engine
    greedy = SamplingOptions(temperature=0.0).native()
    rng = np.random.default_rng(0)
    for _ in range(args.n_seqs):
        engine.add_request(rng.integers(0, m.n_vocab, size=args.depth).tolist(), 32, greedy, [], [])
    engine.step()  # admits and prefills every request
    for _ in range(4):
        engine.step()
    cudart.cudaDeviceSynchronize()
    cudart.cudaProfilerStart()
    engine.step()
    cudart.cudaDeviceSynchronize()
    cudart.cudaProfilerStop()
    m.close()
    return 0


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime ggml-cuda already loaded (for cudaProfilerStart/Stop)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("no CUDA runtime library found")


def report(args) -> int:
    for path in args.csv:
        per_group, n_kernels = defaultdict(float), defaultdict(int)
        with open(path, newline="") as f:
            rows = [r for r in csv.reader(line for line in f if line.startswith('"'))]
        header, rows = rows[0], rows[1:]
        name_i, metric_i = header.index("Kernel Name"), header.index("Metric Name")
        value_i = header.index("Metric Value")
        for r in rows:
            if r[metric_i] != "gpu__time_duration.sum":
                continue
            group = group_of(r[name_i])
            per_group[group] += float(r[value_i].replace(",", "")) * 1e-6  # ns -> ms
            n_kernels[group] += 1
        total = sum(per_group.values())
        print(f"\n{path}: {sum(n_kernels.values())} kernels, {total:.3f} ms of kernel time\n")
        print("| group | kernels | ms | share |")
        print("|---|---:|---:|---:|")
        for g, ms in sorted(per_group.items(), key=lambda kv: -kv[1]):
            print(f"| {g} | {n_kernels[g]} | {ms:.3f} | {100 * ms / total:.1f}% |")
    return 0


def group_of(kernel: str) -> str:
    return next((g for g, pat in GROUPS if re.search(pat, kernel)), "other elementwise")


def short_name(kernel: str) -> str:
    """The kernel's name without its parameter list (template arguments may hold parentheses too)."""
    return re.sub(r"\((?:[^()]|\([^()]*\))*\)\s*$", "", kernel)[:90]


def timeline_totals(kernels, key) -> tuple[dict, float]:
    """Per key(kernel name): [kernels, kernel ms, idle ms before them, share of the span in ms], and
    the span (ms), for kernels as (start, duration, name) in microseconds, sorted by start."""
    totals = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    end = kernels[0][0]
    for start, dur, name in kernels:
        gap = max(0.0, start - end)  # the GPU sat idle before this kernel began
        # what this kernel adds to the span: from the later of its start and the end of every kernel
        # before it, to its own end. An early-launched kernel's time includes its wait for the
        # kernel before, so kernel times overlap and add up to more than the span; these shares add
        # up to the span less the idle gaps: each kernel's cost on the critical path.
        mine = max(0.0, start + dur - max(start, end))
        t = totals[key(name)]
        t[0] += 1
        t[1] += dur * 1e-3
        t[2] += gap * 1e-3
        t[3] += mine * 1e-3
        end = max(end, start + dur)
    return dict(totals), (end - kernels[0][0]) * 1e-3


def trace(args) -> int:
    """Chrome traces of run --trace: per group of kernels their time, the idle time before them and
    their share of the step's span."""
    for path in args.trace_json:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        kernels = sorted((float(e["ts"]), float(e["dur"]), e["name"]) for e in events if e.get("cat") == "kernel")
        if not kernels:
            raise SystemExit(f"{path}: no kernel events")
        groups, span = timeline_totals(kernels, group_of)
        by_name, _ = timeline_totals(kernels, short_name)
        print(f"\n{path}: {len(kernels)} kernels over {span:.3f} ms (first start to last end), "
              f"{sum(t[1] for t in groups.values()):.3f} ms of kernel time, "
              f"{sum(t[2] for t in groups.values()):.3f} ms idle between them")
        header = "| kernels | kernel ms | idle ms before them | share of the span, ms |"
        for title, totals, n in (("group", groups, None), ("kernel (first 15 by share of the span)", by_name, 15)):
            print(f"\n| {title} {header}\n|---|---:|---:|---:|---:|")
            for name, (count, busy, idle, own) in sorted(totals.items(), key=lambda kv: -(kv[1][3] + kv[1][2]))[:n]:
                print(f"| {name if totals is groups else f'`{name}`'} | {count} | {busy:.3f} | {idle:.3f} | {own:.3f} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("model")
    r.add_argument("--what", choices=["decode", "verify", "tree", "keep-path", "batch"], default="decode")
    r.add_argument("--chain", type=int, default=17,
                   help="T, rows of the verify pass (default 17: generate()'s default draft_n_max 16 + 1)")
    r.add_argument("--n-seqs", type=int, default=16, help="sequences of --what batch")
    r.add_argument("--depth", type=int, default=256)
    r.add_argument("--trace", help="record the step with torch's profiler into this Chrome trace (JSON)")
    p = sub.add_parser("report")
    p.add_argument("csv", nargs="+")
    t = sub.add_parser("trace")
    t.add_argument("trace_json", nargs="+", help="Chrome traces written by run --trace")
    args = ap.parse_args()
    return {"run": run, "report": report, "trace": trace}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
