"""Standalone check and timing of deltaspec's CUDA kernels (ggml/cuda/*.cuh) on the GPU.

    nvcc -O3 -arch=sm_90a -shared -Xcompiler -fPIC bench/kernels/kernels_capi.cu -o /tmp/libk.so
    python bench/kernels/kernels_bench.py /tmp/libk.so [--out kernels.json]

Three tables, for the Qwen3.5-27B shapes:
  * one column (a decode step): our Q4_K and Q6_K mat-vecs, each with the resident grid (blocks
    that stay resident walk many rows, x prepared once per block) and one block per 8 rows (plain
    Q4_K also with the resident grid and two rows a warp, the PAIRED form);
  * 1..32 columns (verifying a draft chain) with the Q4_K and Q6_K tensor-core kernels, next to
    one column (the mat-vec); --row-tiles times them at each given number of 16-row tiles per
    thread block, --k-splits at each number of thread blocks per cluster sharing a tile's k (0:
    the kernels' own choice of either).
Weights are random blocks (random quants and scales, random f16 d / dmin within sane ranges); the
reference is y = dequantize(W) @ x in float64 with gguf-py's own dequantizers (the llama.cpp
project's Python implementation), over the first 4096 rows; the kernels round x to int8 (per 16
values for one column, per 256 for several, as ggml's q8_1 / q8_K do per 32 / 256), which is the
few-1e-3 relative error the tables show.
Timing: CUDA events over repeated launches that cycle through enough copies of the matrix to
defeat the 50 MB L2, so every launch reads its weights from HBM; bandwidth = weight bytes / time,
next to a device-to-device copy measured in the same run. Needs torch with CUDA and gguf.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared bandwidth measurement
from decode_bench import device_bandwidth  # noqa: E402

Q4K, Q6K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
BLOCK_BYTES = {Q4K: 144, Q6K: 210}
CHECK_ROWS = 4096
# (type, name, rows, cols, gated): the mat-vecs of one Qwen3.5-27B decode step
ONE_COLUMN = [
    (Q4K, "ffn gate+up, fused SwiGLU", 17408, 5120, True),
    (Q4K, "ffn down", 5120, 17408, False),
    (Q4K, "DeltaNet qkv", 10240, 5120, False),
    (Q4K, "attention q+gate", 12288, 5120, False),
    (Q4K, "DeltaNet z", 6144, 5120, False),
    (Q4K, "DeltaNet qkv+z+beta+alpha stack", 16480, 5120, False),
    (Q4K, "attention q+gate+k stack", 13312, 5120, False),
    (Q4K, "ssm_out / attn_output", 5120, 6144, False),
    (Q4K, "DeltaNet alpha (split-K)", 48, 5120, False),
    (Q6K, "ffn down", 5120, 17408, False),
    (Q6K, "DeltaNet qkv", 10240, 5120, False),
    (Q6K, "attention v", 1024, 5120, False),
    (Q6K, "output head", 248320, 5120, False),
]
MULTI_COLUMN = [  # verify batches multiply the weight stacks (gate + up, DeltaNet qkv + z + beta + alpha)
    (Q4K, "ffn gate+up stack", 34816, 5120),
    (Q4K, "ffn down", 5120, 17408),
    (Q4K, "DeltaNet qkv+z+beta+alpha stack", 16480, 5120),
    (Q4K, "ssm_out / attn_output", 5120, 6144),
    (Q6K, "ffn down", 5120, 17408),
    (Q6K, "output head", 248320, 5120),
]
COLUMNS = [1, 2, 4, 8, 9, 16, 17, 24, 32]


def random_blocks(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    nb, size = rows * cols // 256, BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    if qtype == Q4K:  # d, dmin in the first 4 bytes
        blocks[:, 0:2] = rng.uniform(2e-3, 8e-3, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
        blocks[:, 2:4] = rng.uniform(0, 4e-3, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    else:  # d in the last 2 bytes; the int8 scales stay random
        blocks[:, 208:210] = rng.uniform(1e-4, 4e-4, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, cols // 256 * size)


def reference(qtype, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    rows = min(len(w), CHECK_ROWS)
    wf = dequantize(w[:rows], qtype).reshape(rows, -1).astype(np.float64)
    return wf @ x.astype(np.float64)


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got[: len(ref)] - ref).max() / np.abs(ref).max())


class Timer:
    """Mean microseconds per launch over launches that cycle through weight copies."""

    def __init__(self, iters: int):
        self.iters = iters
        self.t0, self.t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def __call__(self, launch, copies: int) -> float:
        for i in range(copies):
            launch(i)
        self.t0.record()
        for i in range(self.iters):
            launch(i % copies)
        self.t1.record()
        torch.cuda.synchronize()
        return self.t0.elapsed_time(self.t1) * 1e3 / self.iters


def device_copies(w: np.ndarray, dev, copies: int = 0) -> list:
    copies = copies or max(1, -(-400_000_000 // w.nbytes))
    return [torch.from_numpy(w).to(dev) for _ in range(copies)]


def check(rc: int) -> None:
    if rc:
        raise RuntimeError(f"kernel launch failed: CUDA error {rc}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lib")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--one-column-only", action="store_true", help="skip the 1..32 column table")
    ap.add_argument("--row-tiles", default="0",
                    help="comma-separated 16-row tiles per tensor-core thread block to time (0: the kernels' choice)")
    ap.add_argument("--k-splits", default="0",
                    help="comma-separated thread blocks per cluster sharing a tile's k to time (0: the kernels' choice)")
    ap.add_argument("--columns", default=",".join(map(str, COLUMNS)),
                    help="comma-separated column counts of the 1..32 column table (1: the mat-vec, always timed)")
    ap.add_argument("--matrix", default="",
                    help="time only the matrices whose name contains one of these comma-separated strings")
    ap.add_argument("--copies", type=int, default=0,
                    help="weight copies to cycle through (0: enough to defeat the L2; 1 for a profiler run)")
    ap.add_argument("--out")
    args = ap.parse_args()
    lib = ctypes.CDLL(args.lib)
    vp, ll = ctypes.c_void_p, ctypes.c_longlong
    lib.deltaspec_q4k_gemv.argtypes = [vp] * 4 + [ll] * 3 + [vp, ctypes.c_int, ctypes.c_int]
    lib.deltaspec_q6k_gemv.argtypes = [vp] * 3 + [ll] * 3 + [vp, ctypes.c_int]
    lib.deltaspec_mma_x_bytes.argtypes = [ll, ctypes.c_int]
    lib.deltaspec_mma_x_bytes.restype = ll
    lib.deltaspec_q4k_mma.argtypes = [vp, vp, ll, vp, ll, ll, ll, ctypes.c_int, ll, vp, vp, ctypes.c_int, ctypes.c_int]
    lib.deltaspec_q6k_mma.argtypes = lib.deltaspec_q4k_mma.argtypes
    row_tiles = [int(t) for t in args.row_tiles.split(",")]
    k_splits = [int(c) for c in args.k_splits.split(",")]
    columns = sorted({1} | {int(n) for n in args.columns.split(",")})
    if not all(1 <= n <= max(COLUMNS) for n in columns):
        ap.error(f"--columns: each count must be 1..{max(COLUMNS)}")
    rng = np.random.default_rng(0)
    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    timer = Timer(args.iters)
    copy_bw = device_bandwidth()

    one_col = []
    wanted = args.matrix.split(",")
    for qtype, name, rows, cols, gated in [m for m in ONE_COLUMN if any(w in m[1] for w in wanted)]:
        w = random_blocks(qtype, rows, cols, rng)
        g = random_blocks(qtype, rows, cols, rng) if gated else None
        x = rng.standard_normal(cols).astype(np.float32)
        ref = reference(qtype, w, x)
        if gated:
            gr = reference(qtype, g, x)
            ref = ref * gr / (1 + np.exp(-gr))
        wd = device_copies(w, dev, args.copies)
        gd = device_copies(g, dev, args.copies) if gated else None
        xd = torch.from_numpy(x).to(dev)
        yd = torch.empty(rows, dtype=torch.float32, device=dev)
        # grids: resident blocks walking the rows, one block per 8 rows, and (plain Q4_K) the
        # resident grid with two rows a warp (the PAIRED form)
        forms = [(1, 0), (0, 0)] + ([(1, 1)] if qtype == Q4K and not gated and rows >= 256 else [])
        for resident, paired in forms:
            def launch(i):
                if qtype == Q4K:
                    check(lib.deltaspec_q4k_gemv(wd[i].data_ptr(), gd[i].data_ptr() if gated else None, xd.data_ptr(),
                                                 yd.data_ptr(), rows, cols, w.shape[1], stream, resident, paired))
                else:
                    check(lib.deltaspec_q6k_gemv(wd[i].data_ptr(), xd.data_ptr(), yd.data_ptr(), rows, cols,
                                                 w.shape[1], stream, resident))

            yd.fill_(float("nan"))
            launch(0)
            torch.cuda.synchronize()
            err = rel_error(yd.cpu().numpy().astype(np.float64), ref)
            us = timer(launch, len(wd))
            nbytes = w.nbytes * (2 if gated else 1)
            one_col.append(dict(type=qtype.name, shape=name, rows=rows, cols=cols, gated=gated, resident=bool(resident),
                                paired=bool(paired), bytes=nbytes, us=us, tb_s=nbytes / (us * 1e-6) / 1e12, max_rel_error=err))
        del wd, gd

    multi = []
    for qtype, name, rows, cols in [] if args.one_column_only else [m for m in MULTI_COLUMN if any(w in m[1] for w in wanted)]:
        w = random_blocks(qtype, rows, cols, rng)
        wd = device_copies(w, dev, args.copies)
        x = rng.standard_normal((max(COLUMNS), cols)).astype(np.float32)
        ref_all = reference(qtype, w, x.T)  # (rows checked, columns)
        xd = torch.from_numpy(x).to(dev)
        yd = torch.empty((max(COLUMNS), rows), dtype=torch.float32, device=dev)
        scratch = torch.empty(lib.deltaspec_mma_x_bytes(cols, max(COLUMNS)), dtype=torch.uint8, device=dev)
        mma = lib.deltaspec_q4k_mma if qtype == Q4K else lib.deltaspec_q6k_mma
        one_us = None
        shapes = [(n, t, c) for n in columns for t in ([0] if n == 1 else row_tiles) for c in ([0] if n == 1 else k_splits)]
        for n, tiles, split in shapes:
            def launch(i):  # one column: the mat-vec in the form the engine picks (-1: its rule)
                if n == 1 and qtype == Q4K:
                    check(lib.deltaspec_q4k_gemv(wd[i].data_ptr(), None, xd.data_ptr(), yd.data_ptr(), rows, cols,
                                                 w.shape[1], stream, 1, -1))
                elif n == 1:
                    check(lib.deltaspec_q6k_gemv(wd[i].data_ptr(), xd.data_ptr(), yd.data_ptr(), rows, cols,
                                                 w.shape[1], stream, -1))
                else:
                    check(mma(wd[i].data_ptr(), xd.data_ptr(), cols, yd.data_ptr(), rows, rows, cols, n, w.shape[1],
                              scratch.data_ptr(), stream, tiles, split))

            yd.fill_(float("nan"))
            launch(0)
            torch.cuda.synchronize()
            got = yd[:n].cpu().numpy().astype(np.float64).T
            err = rel_error(got, ref_all[:, :n])
            us = timer(launch, len(wd))
            one_us = one_us or us
            multi.append(dict(type=qtype.name, shape=name, rows=rows, cols=cols, n=n, row_tiles=tiles, k_split=split,
                              bytes=w.nbytes, us=us,
                              tb_s=w.nbytes / (us * 1e-6) / 1e12, x_one_column=us / one_us, max_rel_error=err))
        del wd

    print(f"device copy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s\n")
    print("| type | mat-vec | rows x cols | grid | MB | us | TB/s | % of copy bw | max rel. error |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for r in one_col:
        dims = f"{r['rows']} x {r['cols']}{' x2' if r['gated'] else ''}"
        grid = "per 8 rows" if not r["resident"] else "resident, paired" if r["paired"] else "resident"
        print(f"| {r['type']} | {r['shape']} | {dims} | {grid} | "
              f"{r['bytes'] / 1e6:.1f} | {r['us']:.1f} | {r['tb_s']:.2f} | {100 * r['tb_s'] * 1e12 / copy_bw:.0f}% | "
              f"{r['max_rel_error']:.1e} |")
    print("\n| type | matrix | rows x cols | columns | row tiles | k split | us | x one column | weight TB/s | "
          "max rel. error |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in multi:
        tiles, split = r["row_tiles"] or "auto", r["k_split"] or "auto"
        print(f"| {r['type']} | {r['shape']} | {r['rows']} x {r['cols']} | {r['n']} | {tiles} | {split} | {r['us']:.1f} | "
              f"{r['x_one_column']:.2f} | {r['tb_s']:.2f} | {r['max_rel_error']:.1e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_bandwidth=copy_bw, one_column=one_col, multi_column=multi), f, indent=2)
    # x's int8 rounding gives a few 1e-3 (up to 1e-2 for Q6_K's random signed scales, whose sums
    # cancel); a wrong nibble, scale, row or column would be far above 2e-2
    return 0 if all(r["max_rel_error"] < 2e-2 for r in one_col + multi) else 1


if __name__ == "__main__":
    sys.exit(main())
