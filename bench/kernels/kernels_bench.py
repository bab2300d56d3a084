"""Standalone check and timing of our Q4_K mat-vec kernel (ggml/cuda/q4k_gemv.cuh) on the GPU.

    nvcc -O3 -arch=sm_90a -shared -Xcompiler -fPIC bench/kernels/q4k_gemv_capi.cu -o /tmp/libq4k.so
    python bench/kernels/q4k_gemv_bench.py /tmp/libq4k.so [--out q4k.json]

For the 27B decode shapes: random Q4_K blocks (random nibbles and 6-bit scales, random f16 d and
dmin), the reference y = dequantize(W) @ x in float64 with gguf-py's own Q4_K dequantizer (the
llama.cpp project's Python implementation), and the kernel's relative error against it (the
kernel rounds x to int8 per 16 values, as ggml's own mat-vec rounds it to q8_1). Timing:
CUDA events over repeated launches that cycle through enough copies of the matrix to defeat the
50 MB L2, so every launch reads its weights from HBM; bandwidth = weight bytes / time, next to a
device-to-device copy measured in the same run. Needs torch with CUDA and gguf.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

BLOCK = 144  # bytes per 256 weights
# (name, rows, cols, gated): the Q4_K mat-vecs of one Qwen3.5-27B decode step
SHAPES = [
    ("ffn gate+up, fused SwiGLU", 17408, 5120, True),
    ("ffn down", 5120, 17408, False),
    ("DeltaNet qkv", 10240, 5120, False),
    ("attention q+gate", 12288, 5120, False),
    ("DeltaNet z", 6144, 5120, False),
    ("ssm_out / attn_output", 5120, 6144, False),
    ("DeltaNet alpha / beta", 48, 5120, False),
]


def random_q4k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    nb = rows * cols // 256
    blocks = rng.integers(0, 256, size=(nb, BLOCK), dtype=np.uint8)
    d = rng.uniform(2e-3, 8e-3, nb).astype(np.float16)
    dmin = rng.uniform(0, 4e-3, nb).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    blocks[:, 2:4] = dmin.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, cols // 256 * BLOCK)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lib")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rows-per-warp", default="1", help="kernel configurations to time, e.g. 1,2,4 (default: 1)")
    ap.add_argument("--out")
    args = ap.parse_args()
    lib = ctypes.CDLL(args.lib)
    lib.deltaspec_q4k_gemv.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_longlong] * 3
                                       + [ctypes.c_void_p, ctypes.c_int])
    rng = np.random.default_rng(0)
    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream

    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)  # copy bandwidth, read + write
    dst = torch.empty_like(big)
    for _ in range(3):
        dst.copy_(big)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(10):
        dst.copy_(big)
    t1.record()
    torch.cuda.synchronize()
    copy_bw = 2 * big.numel() * 10 / (t0.elapsed_time(t1) * 1e-3)
    del big, dst

    rows_out = []
    configs = [(rpw, shape) for rpw in map(int, args.rows_per_warp.split(",")) for shape in SHAPES]
    for rpw, (name, rows, cols, gated) in configs:
        w = random_q4k(rows, cols, rng)
        g = random_q4k(rows, cols, rng) if gated else None
        x = rng.standard_normal(cols).astype(np.float32)
        wf = dequantize(w, GGMLQuantizationType.Q4_K).reshape(rows, cols).astype(np.float64)
        ref = wf @ x
        if gated:
            gr = dequantize(g, GGMLQuantizationType.Q4_K).reshape(rows, cols).astype(np.float64) @ x
            ref = ref * gr / (1 + np.exp(-gr))
        nbytes = w.nbytes * (2 if gated else 1)
        copies = max(2, -(-400_000_000 // nbytes))
        wd = [torch.from_numpy(w).to(dev) for _ in range(copies)]
        gd = [torch.from_numpy(g).to(dev) for _ in range(copies)] if gated else [None] * copies
        xd = torch.from_numpy(x).to(dev)
        yd = torch.empty(rows, dtype=torch.float32, device=dev)

        def launch(i):
            gp = gd[i].data_ptr() if gated else None
            rc = lib.deltaspec_q4k_gemv(wd[i].data_ptr(), gp, xd.data_ptr(), yd.data_ptr(), rows, cols,
                                        w.shape[1], stream, rpw)
            if rc:
                raise RuntimeError(f"kernel launch failed: CUDA error {rc}")

        launch(0)
        torch.cuda.synchronize()
        got = yd.cpu().numpy().astype(np.float64)
        rel = float(np.abs(got - ref).max() / np.abs(ref).max())
        for i in range(copies):
            launch(i)
        t0.record()
        for i in range(args.iters):
            launch(i % copies)
        t1.record()
        torch.cuda.synchronize()
        us = t0.elapsed_time(t1) * 1e3 / args.iters
        rows_out.append(dict(rows_per_warp=rpw, shape=name, rows=rows, cols=cols, gated=gated, bytes=nbytes, us=us,
                             tb_s=nbytes / (us * 1e-6) / 1e12, max_rel_error=rel))
        del wd, gd

    print(f"device copy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s\n")
    print("| rows/warp | mat-vec | rows x cols | MB | us | TB/s | % of copy bw | max rel. error |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows_out:
        dims = f"{r['rows']} x {r['cols']}{' x2' if r['gated'] else ''}"
        print(f"| {r['rows_per_warp']} | {r['shape']} | {dims} | {r['bytes'] / 1e6:.1f} | "
              f"{r['us']:.1f} | {r['tb_s']:.2f} | {100 * r['tb_s'] * 1e12 / copy_bw:.0f}% | {r['max_rel_error']:.1e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_bandwidth=copy_bw, rows=rows_out), f, indent=2)
    # x is quantized to int8 per 16 values (ggml's q8_1 does it per 32): errors of a few 1e-3 of
    # max |y| are that rounding; a wrong nibble, scale or row would be far above 1e-2
    return 0 if all(r["max_rel_error"] < 1e-2 for r in rows_out) else 1


if __name__ == "__main__":
    sys.exit(main())
