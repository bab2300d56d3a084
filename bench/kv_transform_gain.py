"""What a data-adapted transform would give tq3 over the random rotation, on the trained testbed's
real K and V rows (the question of issue 27's quality goal: why tq3 has ~3x q4_0's KL).

    python bench/kv_transform_gain.py [--model /work/testbed_files/target.gguf] [--windows 3]

tq3 already sits on its codebook's theory (relative MSE 0.031 against the Lloyd-Max distortion
0.034 of a rotated coordinate, bench/kv_quality.md), and the KL ratio tq3/q4_0 (~3x) follows the MSE
ratio, so the codebook, the per-vector scale and its fp16 storage are not what is missing: three bits
per coordinate after a random rotation cannot reach q4_0's 0.011 (even ideal vector quantization of
a Gaussian at 3 bits has 2^-6 = 0.016). What the random rotation gives away is the rows'
anisotropy: it spreads every direction's energy evenly, where transform coding would spend bits
where the variance is (gain = arithmetic / geometric mean of the covariance's eigenvalues). This
measures, per window (the repetitions: median [min-max]) and per attention layer and KV head:
  - the coding gain AM/GM of the rows' second-moment matrix;
  - relative MSE |x - x_hat|^2 / |x|^2 of tq3, tq4, q4_0, q4_0 after the rotation, and of a
    KLT codec: the eigenbasis of the first half of the window (calibration), bits per component by
    greedy reverse water-filling over Gaussian Lloyd-Max distortions at R = 2.5, 3, 4 bits per value
    (plus one fp16 scale per vector, as tq's), measured on the second half (out of sample).
The KLT codec is a numpy model (not a cache type); its eigenbasis would be a per-layer, per-head
D x D matrix computed once (conversion time or a prompt prefix). Mean-centering was also measured:
the per-head mean carries 7-9% of the energy, so centering gains under 10%.

Writes bench/results/latest/kv_transform_gain.json and its table (.md). No llama.cpp peer: llama.cpp
has no such codec (its q4_0 rotation is the row "q4_0+rot").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "testbed"))

DEFAULT_OUT = HERE / "results" / "latest" / "kv_transform_gain.json"
MAX_BITS = 6


def lloyd_max_tables():
    from deltaspec import tq_codebook as cb

    books = {b: np.asarray(cb.lloyd_max(None, b)[0]) for b in range(1, MAX_BITS + 1)}
    dist = np.array([1.0] + [cb.lloyd_max(None, b)[1] for b in range(1, MAX_BITS + 1)])
    return books, dist


def allocate(var: np.ndarray, total: int, dist: np.ndarray) -> np.ndarray:
    """Integer bits per component (0..MAX_BITS), `total` in all, each next bit where it lowers the
    expected distortion var_i * D(b_i) most (reverse water-filling with Lloyd-Max distortions)."""
    b = np.zeros(len(var), int)
    for _ in range(total):
        gain = var * (dist[b] - dist[np.minimum(b + 1, MAX_BITS)])
        gain[b >= MAX_BITS] = -1
        b[int(np.argmax(gain))] += 1
    return b


def klt_codec(cal: np.ndarray, rows: np.ndarray, bits_per_value: float, books, dist) -> np.ndarray:
    """rows quantized in the eigenbasis of cal's second moments; returns the reconstruction."""
    D = rows.shape[1]
    w, U = np.linalg.eigh(cal.T @ cal / len(cal))
    var = np.clip(w, 1e-12, None)
    b = allocate(var, int(round(bits_per_value * D)), dist)
    z = rows @ U
    g = np.sqrt((z ** 2).sum(1, keepdims=True) / var.sum())
    u = z / np.where(g == 0, 1, g) / np.sqrt(var)
    zq = np.zeros_like(z)
    for i in np.flatnonzero(b):
        c = books[b[i]]
        zq[:, i] = c[np.searchsorted((c[1:] + c[:-1]) / 2, u[:, i])] * np.sqrt(var[i])
    num, den = (z * zq).sum(1, keepdims=True), (zq * zq).sum(1, keepdims=True)
    scale = np.where(den > 0, num / np.where(den > 0, den, 1), 0).astype(np.float16).astype(np.float64)
    return (zq * scale) @ U.T


def baseline(rows: np.ndarray, name: str) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    from deltaspec import _core

    x = rows.astype(np.float32)
    D = x.shape[1]
    if name in ("tq3", "tq4"):
        bits = int(name[2])
        return _core.tq_rotate(_core.tq_dequantize_rotated(bits, _core.tq_quantize(bits, x), D), inverse=True)
    y = _core.tq_rotate(x) if name.endswith("+rot") else x
    t = GGMLQuantizationType.Q4_0
    back = quants.dequantize(quants.quantize(y, t), t).reshape(y.shape)
    return _core.tq_rotate(back, inverse=True) if name.endswith("+rot") else back


CODECS = ["tq3", "tq4", "q4_0", "q4_0+rot", "klt2.5", "klt3", "klt4"]
BITS = {"tq3": 3, "tq4": 4, "q4_0": 4.5, "q4_0+rot": 4.5, "klt2.5": 2.5, "klt3": 3, "klt4": 4}  # + fp16 scale for tq/klt


def measure_window(rows: dict[str, np.ndarray], n_tokens: int, n_head_kv: int, books, dist) -> list[dict]:
    out = []
    for kind, x in rows.items():
        D = x.shape[1]
        per = x.astype(np.float64).reshape(-1, n_tokens, n_head_kv, D)
        for layer in range(per.shape[0]):
            for h in range(n_head_kv):
                a = per[layer, :, h]
                cal, ev = a[: n_tokens // 2], a[n_tokens // 2:]
                ev_all = np.linalg.eigvalsh(a.T @ a / len(a)).clip(1e-12)
                row = {"kind": kind, "layer": layer, "head": h,
                       "coding_gain": float(ev_all.mean() / np.exp(np.log(ev_all).mean()))}
                for name in CODECS:
                    back = (klt_codec(cal, ev, float(name[3:]), books, dist) if name.startswith("klt")
                            else baseline(ev, name))
                    row[name] = float(((ev - back) ** 2).sum() / (ev ** 2).sum())
                out.append(row)
    return out


def table(results: list[dict]) -> str:
    windows = sorted({r["window"] for r in results})
    lines = ["| rows | coding gain AM/GM | " + " | ".join(f"{c} ({BITS[c]} b)" for c in CODECS) + " |",
             "|---|---:|" + "---:|" * len(CODECS)]
    for kind in ("k", "v"):
        def spread(key):
            vals = [statistics.mean(r[key] for r in results if r["window"] == w and r["kind"] == kind) for w in windows]
            return f"{statistics.median(vals):.4f} [{min(vals):.4f}-{max(vals):.4f}]"
        lines.append(f"| {kind.upper()} | {spread('coding_gain')} | " + " | ".join(spread(c) for c in CODECS) + " |")
    return "\n".join(lines)


def main():
    import kv_quality

    from deltaspec import Model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=kv_quality.DEFAULT_MODEL)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args()
    with Model(args.model, n_ctx=64, progress=False) as m:
        hp = m.hparams
        windows = kv_quality.heldout_windows(m, args.windows, 2048)  # the testbed's training context
    books, dist = lloyd_max_tables()
    results = []
    for w, window in enumerate(windows):
        rows = kv_quality.cache_rows(args.model, window[:-1], args.threads)
        for r in measure_window(rows, len(window) - 1, hp.n_head_kv, books, dist):
            results.append({"window": w, **r})
        print(f"window {w} done", file=sys.stderr, flush=True)
    md = (f"Relative MSE of real K/V rows of {args.model} (mean over attention layers and KV heads; median "
          f"[min-max] over {len(windows)} held-out windows of {len(windows[0]) - 1} tokens; KLT codecs "
          "calibrated on each window's first half, measured on its second half; "b": bits per value, plus "
          "16 bits per head vector for tq and klt, the scale)\n\n" + table(results))
    print(md)
    Path(args.out).write_text(json.dumps({"model": args.model, "results": results}, indent=1) + "\n")
    Path(args.out).with_suffix(".md").write_text(md + "\n")


if __name__ == "__main__":
    main()
