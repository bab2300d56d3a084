"""Where a decode step and a verify pass spend GPU time, kernel by kernel (Nsight Compute).

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \\
        python bench/kernel_profile.py run MODEL.gguf --what decode > decode.csv
    python bench/kernel_profile.py report decode.csv [verify.csv ...]

`run` loads the model on CUDA, prefills --depth tokens, warms the step up (graphs built, CUDA graphs
captured), then brackets exactly one step with cudaProfilerStart/Stop: a greedy decode step
(`--what decode`) or a verify pass of --chain tokens (`--what verify`). `report` groups the
kernels ncu measured into matmul / DeltaNet / attention / other and prints a markdown table.
Kernel times exclude launch gaps, so their sum is below the step's wall time.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import re
import sys
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
    m = Model(args.model, n_ctx=args.depth + 1024, device="cuda", progress=False)
    e = m._live()
    e.reserve_slots(args.chain)
    rng = np.random.default_rng(0)
    e.eval(rng.integers(0, m.n_vocab, size=args.depth).astype(np.int32), logits="none")
    chain = rng.integers(0, m.n_vocab, size=args.chain).astype(np.int32)
    one = np.array([7], dtype=np.int32)

    def step():
        if args.what == "decode":
            e.eval_argmax(one)
        else:
            e.eval_verify_argmax(chain)
            e.keep(1)

    for _ in range(4):
        step()
    cudart.cudaDeviceSynchronize()
    cudart.cudaProfilerStart()
    step()
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
            group = next((g for g, pat in GROUPS if re.search(pat, r[name_i])), "other elementwise")
            per_group[group] += float(r[value_i].replace(",", "")) * 1e-6  # ns -> ms
            n_kernels[group] += 1
        total = sum(per_group.values())
        print(f"\n{path}: {sum(n_kernels.values())} kernels, {total:.3f} ms of kernel time\n")
        print("| group | kernels | ms | share |")
        print("|---|---:|---:|---:|")
        for g, ms in sorted(per_group.items(), key=lambda kv: -kv[1]):
            print(f"| {g} | {n_kernels[g]} | {ms:.3f} | {100 * ms / total:.1f}% |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("model")
    r.add_argument("--what", choices=["decode", "verify"], default="decode")
    r.add_argument("--chain", type=int, default=17,
                   help="T, rows of the verify pass (default 17: generate()'s default draft_n_max 16 + 1)")
    r.add_argument("--depth", type=int, default=256)
    p = sub.add_parser("report")
    p.add_argument("csv", nargs="+")
    args = ap.parse_args()
    return run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    sys.exit(main())
