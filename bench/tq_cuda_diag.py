"""Why the CUDA tq quantizer's bytes differ from the CPU's (tests/test_gpu_turboquant.py): a diagnostic
for the GPU machine, printing which candidate cause the device shows.

The kernel's source is not the cause by itself: compiled for the host and run lane by lane
(_core.tq_quantize_cuda_source, tests/test_turboquant.py) it writes the CPU codec's bytes for every
vector. So the device run differs from its own source's arithmetic, or the node does not run the
kernel on the data it is given. This prints, for the quantize-on-write node on CUDA against the CPU
and against the host run of the kernel source:
  - how many head vectors differ, and how: the fp16 scale only, the codes, or all-zero (unwritten)
    rows; which lanes' values carry the differing codes; the CUDA/CPU scale ratios;
  - whether CUDA's bytes for a vector are the CPU's bytes for another vector (rows misplaced);
  - whether a differing scale's low byte is the scale's value as a saturated integer (issue 27);
  - whether two runs on CUDA agree (a race shows as run-to-run differences);
  - the same count in fresh processes under CUDA_LAUNCH_BLOCKING=1, GGML_CUDA_PDL=0 +
    DELTASPEC_CUDA_PDL=0, GGML_CUDA_DISABLE_GRAPHS=1 and DELTASPEC_CUDA_KERNELS=0 (which setting
    makes it go away);
  - attention: CUDA's output against numpy attention over CUDA's own cache bytes (the attention
    kernels' share) and over the CPU's (the quantizer's share).
It ends with VERDICT lines.

Usage (GPU machine, after a CUDA build of deltaspec): python bench/tq_cuda_diag.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from deltaspec import _core

# the device under test; "cpu" turns this into a dry run of the script itself (everything agrees)
DEVICE = os.environ.get("TQ_DIAG_DEVICE", "cuda")


def hard_rows(rng, T, H, D):
    """tests/test_gpu_turboquant.py's rows."""
    x = rng.standard_normal((T, H, D)) * rng.uniform(1e-3, 1e3, (T, H, 1))
    x[1::7, :, rng.choice(D, 4, replace=False)] *= 40
    x[2] = 0
    x[3] = np.round(rng.standard_normal((H, D)) * 4) / 4
    return x.astype(np.float32)


def codes(bits, D, q):
    """(n, head bytes) -> (n, D) code indices, as the codec packs them."""
    qs = q[:, 2:].astype(np.int64)
    i = np.arange(D)
    if bits == 3:
        low = (qs[:, i // 4] >> (2 * (i % 4))) & 3
        high = (qs[:, D // 4 + i // 8] >> (i % 8)) & 1
        return low | high << 2
    return (qs[:, i // 2] >> (4 * (i % 2))) & 15


def scales(q):
    return q[:, :2].copy().view(np.float16).astype(np.float64).ravel()


def compare(bits, D, dev, ref, name):
    """Head vectors (n, head bytes) of the device against a reference: a dict of counts."""
    differ = (dev != ref).any(axis=1)
    zero = ~dev.any(axis=1) & ref.any(axis=1)
    d_dev, d_ref = scales(dev), scales(ref)
    c_dev, c_ref = codes(bits, D, dev), codes(bits, D, ref)
    code_differ = (c_dev != c_ref)
    rows = np.flatnonzero(differ & ~zero)
    lanes = np.bincount((np.nonzero(code_differ[rows])[1] // (D // 32)), minlength=32) if rows.size else np.zeros(32, int)
    ratio = d_dev[rows] / np.where(d_ref[rows] == 0, np.nan, d_ref[rows]) if rows.size else np.array([])
    # CUDA's bytes of a vector equal to the reference's bytes of another vector?
    ref_index = {bytes(r): i for i, r in enumerate(ref)}
    misplaced = sum(1 for i in rows if ref_index.get(bytes(dev[i]), i) != i)
    # issue 27's signature: the scale's high byte right and its low byte the scale's VALUE as a
    # saturated integer, min(255, trunc(d)) (what ptxas made of a byte-wise copy of the half)
    saturated = np.clip(np.trunc(d_ref), 0, 255).astype(np.uint8)
    low_is_value = (dev[:, 1] == ref[:, 1]) & (dev[:, 0] == saturated) & (dev[:, 0] != ref[:, 0])
    out = {
        "vs": name, "vectors": int(len(dev)), "differ": int(differ.sum()), "unwritten_zero": int(zero.sum()),
        "scale_only": int(((d_dev != d_ref) & ~code_differ.any(axis=1) & differ & ~zero).sum()),
        "codes_differ": int((code_differ.any(axis=1) & ~zero).sum()),
        "code_positions_differ_frac": float(code_differ[rows].mean()) if rows.size else 0.0,
        "max_code_step": int(np.abs(c_dev - c_ref)[rows].max()) if rows.size else 0,
        "scale_ratio_median": float(np.nanmedian(ratio)) if ratio.size else 1.0,
        "scale_ratio_spread": float(np.nanmax(np.abs(ratio - 1))) if ratio.size else 0.0,
        "misplaced": int(misplaced),
        "scale_low_byte_is_saturated_value": int(low_is_value[rows].sum()) if rows.size else 0,
        "differing_codes_by_lane": lanes.tolist(),
    }
    return out


def node_bytes(device, bits, x, idx, n_rows):
    return _core.tq_set_rows(device, bits, x, idx, n_rows)


def quantizer_report(bits, D, T=300, H=4, n_rows=512, seed=None):
    rng = np.random.default_rng(D * 10 + bits if seed is None else seed)
    x = hard_rows(rng, T, H, D)
    idx = rng.permutation(n_rows)[:T].astype(np.int64)
    hb = 2 + D * bits // 8
    cuda = node_bytes(DEVICE, bits, x, idx, n_rows)
    cuda2 = node_bytes(DEVICE, bits, x, idx, n_rows)
    cpu = node_bytes("cpu", bits, x, idx, n_rows)
    source = _core.tq_quantize_cuda_source(bits, x.reshape(-1, D)).reshape(T, H * hb)
    pick = lambda a: a[idx].reshape(T * H, hb)  # the written rows, head by head
    y = _core.tq_rotate(x.reshape(-1, D)).astype(np.float64)
    live = np.abs(y).sum(axis=1) > 0

    def rel_mse(q):  # the quantization error of the written vectors, relative to their energy
        yq = _core.tq_dequantize_rotated(bits, q, D).astype(np.float64)
        return float(np.mean(((yq - y) ** 2).sum(axis=1)[live] / (y ** 2).sum(axis=1)[live]))

    return {
        "rel_mse_cuda": rel_mse(pick(cuda)), "rel_mse_cpu": rel_mse(pick(cpu)),
        "bits": bits, "D": D,
        "cuda_vs_cpu": compare(bits, D, pick(cuda), pick(cpu), "cpu"),
        "cuda_vs_kernel_source_on_host": compare(bits, D, pick(cuda), source.reshape(T * H, hb), "source"),
        "cpu_vs_kernel_source_on_host": int((pick(cpu) != source.reshape(T * H, hb)).any(axis=1).sum()),
        "cuda_run_to_run_differ": int((cuda != cuda2).any(axis=1).sum()),
        "unwritten_rows_nonzero_on_cuda": int(np.delete(cuda, idx, axis=0).any(axis=1).sum()),
    }


def differing_in_fresh_process(env_extra):
    """The bitwise test's count (tq3, D=128, 100 rows of 4 heads) in a fresh process with env_extra set."""
    code = ("import numpy as np, sys; sys.path.insert(0, %r); import tq_cuda_diag as d; "
            "r = d.quantizer_report(3, 128, T=100); print(r['cuda_vs_cpu']['differ'])") % os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env_extra}, capture_output=True, text=True,
                       timeout=300)
    return p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else f"error: {p.stderr[-300:]}"


def attention(q, k, v, mask, scale):
    T, H, D = q.shape
    group = H // k.shape[1]
    out = np.zeros((T, H, D))
    for h in range(H):
        s = q[:, h].astype(np.float64) @ k[:, h // group].T.astype(np.float64) * scale + mask
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // group]
    return out


def attention_report(T=1, D=128, bits=3):
    """tests/test_gpu_turboquant.py's attention case (tq/tq), split into the quantizer's share and the
    attention kernels' share of the CUDA-CPU difference."""
    rng = np.random.default_rng(T + D)
    H, Hkv, n_kv, n_past = 8, 2, 1024, 900
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = (rng.standard_normal((n_kv, Hkv, D)) * 2).astype(np.float32)
    v = rng.standard_normal((n_kv, Hkv, D)).astype(np.float32)
    mask = np.where(np.arange(n_kv)[None, :] <= n_past + np.arange(T)[:, None], 0.0, -np.inf).astype(np.float32)
    scale = 1 / np.sqrt(D)
    t = f"tq{bits}"
    cuda = _core.tq_attention(DEVICE, q, k, v, mask, t, t, scale)
    cpu = _core.tq_attention("cpu", q, k, v, mask, t, t, scale)
    rows = np.arange(n_kv, dtype=np.int64)

    def cached(device, x):
        b = _core.tq_set_rows(device, bits, x, rows, n_kv).reshape(n_kv * Hkv, -1)
        y = _core.tq_dequantize_rotated(bits, b, D)
        return _core.tq_rotate(y, inverse=True).reshape(x.shape)

    over_cuda_cache = attention(q, cached(DEVICE, k), cached(DEVICE, v), mask, scale)
    over_cpu_cache = attention(q, cached("cpu", k), cached("cpu", v), mask, scale)
    rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())
    return {"T": T, "D": D, "type": t, "cuda_vs_cpu": rel(cuda, cpu),
            "cuda_vs_numpy_over_cuda_cache": rel(cuda, over_cuda_cache),
            "cpu_vs_numpy_over_cpu_cache": rel(cpu, over_cpu_cache)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    if DEVICE == "cuda" and not _core.has_device("cuda"):
        sys.exit("tq_cuda_diag: this deltaspec has no CUDA device")
    report = {"quantizer": [quantizer_report(b, D) for b in (3, 4) for D in (32, 128, 256)]}
    print(f"{'tq':>4} {'D':>4} | {'vs CPU: differ':>14} {'zero':>5} {'scale only':>10} {'codes':>6} {'code frac':>9} "
          f"{'max step':>8} {'scale ratio med / spread':>24} {'misplaced':>9} | {'vs source':>9} | {'CPU vs source':>13} | "
          f"{'run-to-run':>10} | {'stray rows':>10}")
    for r in report["quantizer"]:
        c, s = r["cuda_vs_cpu"], r["cuda_vs_kernel_source_on_host"]
        print(f"{r['bits']:>4} {r['D']:>4} | {c['differ']:>7}/{c['vectors']:<6} {c['unwritten_zero']:>5} {c['scale_only']:>10} "
              f"{c['codes_differ']:>6} {c['code_positions_differ_frac']:>9.3f} {c['max_code_step']:>8} "
              f"{c['scale_ratio_median']:>11.4f} / {c['scale_ratio_spread']:<10.4f} {c['misplaced']:>9} | {s['differ']:>9} | "
              f"{r['cpu_vs_kernel_source_on_host']:>13} | {r['cuda_run_to_run_differ']:>10} | {r['unwritten_rows_nonzero_on_cuda']:>10}")
    print("relative MSE of the written vectors (CUDA / CPU):",
          ", ".join(f"tq{r['bits']} D={r['D']}: {r['rel_mse_cuda']:.4f} / {r['rel_mse_cpu']:.4f}" for r in report["quantizer"]))
    worst = max(report["quantizer"], key=lambda r: r["cuda_vs_cpu"]["differ"])
    print("differing codes by lane (tq%d D=%d):" % (worst["bits"], worst["D"]), worst["cuda_vs_cpu"]["differing_codes_by_lane"])
    envs = {"default": {}, "CUDA_LAUNCH_BLOCKING=1": {"CUDA_LAUNCH_BLOCKING": "1"},
            "PDL off": {"GGML_CUDA_PDL": "0", "DELTASPEC_CUDA_PDL": "0"},
            "CUDA graphs off": {"GGML_CUDA_DISABLE_GRAPHS": "1"}, "deltaspec kernels off": {"DELTASPEC_CUDA_KERNELS": "0"}}
    report["fresh_process_differ_tq3_d128"] = {name: differing_in_fresh_process(e) for name, e in envs.items()}
    print("vectors differing (tq3 D=128, of 400) in a fresh process:", report["fresh_process_differ_tq3_d128"])
    report["attention"] = [attention_report(T, D, b) for T, D, b in ((1, 128, 3), (5, 256, 4))]
    for a in report["attention"]:
        print(f"attention {a['type']} T={a['T']} D={a['D']}: CUDA vs CPU {a['cuda_vs_cpu']:.4f}; CUDA vs numpy over "
              f"CUDA's own cache bytes {a['cuda_vs_numpy_over_cuda_cache']:.4f}; CPU vs numpy over the CPU's "
              f"{a['cpu_vs_numpy_over_cpu_cache']:.4f} (of max |value|)")
    q = report["quantizer"]
    n_vs_cpu = sum(r["cuda_vs_cpu"]["differ"] for r in q)
    n_vs_src = sum(r["cuda_vs_kernel_source_on_host"]["differ"] for r in q)
    n_cpu_src = sum(r["cpu_vs_kernel_source_on_host"] for r in q)
    print(f"VERDICT quantizer: CUDA differs from the CPU in {n_vs_cpu} vectors, from its own source run on the host in "
          f"{n_vs_src}; the CPU differs from that source in {n_cpu_src}")
    if n_vs_cpu == 0:
        print("VERDICT: CUDA writes the CPU's bytes (the bitwise test passes here)")
    elif n_cpu_src > 0 and n_vs_src == 0:
        print("VERDICT: the CPU node on this machine is the odd one (CUDA equals the kernel source's host run)")
    elif any(r["cuda_run_to_run_differ"] for r in q):
        print("VERDICT: CUDA's bytes change from run to run: a race (read before written, or streams)")
    elif sum(r["cuda_vs_cpu"]["unwritten_zero"] for r in q) == n_vs_cpu:
        print("VERDICT: the differing rows are all zero on CUDA: the kernel did not write them")
    elif sum(r["cuda_vs_cpu"]["misplaced"] for r in q) > 0:
        print("VERDICT: CUDA wrote other vectors' bytes into rows (indexing / strides)")
    elif sum(r["cuda_vs_cpu"]["scale_low_byte_is_saturated_value"] for r in q) == n_vs_cpu:
        print("VERDICT: every differing scale's low byte is min(255, trunc(d)): a float-to-integer conversion "
              "(F2I.U8.F16) in place of the low byte's store, as nvcc 13.0 compiled a byte-wise copy of the half "
              "(issue 27; tests/test_tq_sass.py checks the machine code)")
    elif sum(r["cuda_vs_cpu"]["scale_only"] for r in q) == n_vs_cpu:
        print("VERDICT: only the fp16 scales differ (codes equal): the scale's arithmetic or its fp16 rounding")
    else:
        print("VERDICT: the device's arithmetic differs from the kernel source's (codes differ; see the lanes and "
              "the fresh-process settings above)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
