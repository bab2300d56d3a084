"""The TurboQuant codebooks of deltaspec's tq3/tq4 KV cache, derived here and written into
ggml/deltaspec_tq_codebook.h (`python -m deltaspec.tq_codebook ggml/deltaspec_tq_codebook.h`).

Why these numbers (TurboQuant-MSE, Zandieh et al. 2025, arXiv 2504.19874):
a head vector x of D values is rotated, y = R x with R = H_D S / sqrt(D) (S: fixed random signs, H_D:
the Walsh-Hadamard matrix), and each coordinate is quantized on its own. For a vector of random
direction the rotated vector y / |y| is uniform on the sphere S^{D-1}, so each coordinate of
t = y / sigma, sigma = |y| / sqrt(D) (the block's RMS), has the density of sqrt(D) * u_1 for u uniform
on the sphere:

    f_D(t) ~ (1 - t^2 / D)^((D - 3) / 2)   on |t| < sqrt(D),   E[t^2] = 1,

a scaled Beta law that tends to N(0, 1) as D grows. The MSE-optimal scalar quantizer with 2^b levels
for that density is its Lloyd-Max quantizer (Lloyd 1957 / Max 1960): centroids are the conditional
means of their cells and cell boundaries the midpoints between neighbouring centroids. We solve that
fixed point by iteration with the density integrated numerically, once per head dim D (the law
depends on D) and bit width b, and write the centroids and the midpoints (the quantizer's thresholds)
as float literals, so that the CPU and CUDA quantizers compare against the same numbers.

The expected distortion E[(t - Q(t))^2] is the per-coordinate MSE relative to the block's mean square:
tests/test_turboquant.py holds the quantizer's measured error on Gaussian vectors to it. The Gaussian
limit (`lloyd_max(None, bits)`) reproduces Max's published table (8 levels: +-0.2451, 0.7560, 1.344,
2.152, MSE 0.03455; 16 levels: MSE 0.009497), which is how the solver itself is checked.

The signs S: 512 bits from splitmix64 seeded with SIGN_SEED (bit i of word i // 64 set = coordinate i
negated); a head of D values uses the first D.
"""

from __future__ import annotations

import sys
from functools import lru_cache

import numpy as np

HEAD_DIMS = (32, 64, 128, 256)  # power-of-two head dims the tq types serve (Qwen3.5: 256)
BITS = (3, 4)
SIGN_SEED = 0x7471_6b76_7369_676E  # "tqkvsign"
N_SIGN_BITS = 512


def _grid(head_dim: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Points and normalized density values of t's law (None: the Gaussian limit)."""
    lim = 12.0 if head_dim is None else min(12.0, float(np.sqrt(head_dim)))
    t = np.linspace(-lim, lim, 1_200_001)
    if head_dim is None:
        logf = -0.5 * t * t
    else:
        with np.errstate(divide="ignore"):
            logf = 0.5 * (head_dim - 3) * np.log(np.clip(1.0 - t * t / head_dim, 0.0, None))
    f = np.exp(logf - logf.max())
    return t, f / np.trapezoid(f, t)


def _cumulative(t: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Cumulative trapezoid integral of y over t, starting at 0."""
    out = np.zeros_like(y)
    out[1:] = np.cumsum(0.5 * (y[1:] + y[:-1]) * np.diff(t))
    return out


@lru_cache(maxsize=None)
def lloyd_max(head_dim: int | None, bits: int) -> tuple[tuple[float, ...], float]:
    """(centroids ascending, distortion E[(t - Q(t))^2]) of the 2^bits-level Lloyd-Max quantizer of
    f_D (head_dim=None: of N(0, 1))."""
    t, f = _grid(head_dim)
    mass, first = _cumulative(t, f), _cumulative(t, t * f)
    n = 1 << bits
    # start from equal-probability cells' means
    edges = np.interp(np.linspace(0, 1, n + 1), mass, t)
    c = np.empty(n)
    for _ in range(20000):
        m = np.interp(edges, t, mass)
        s = np.interp(edges, t, first)
        c_new = np.diff(s) / np.diff(m)
        if np.max(np.abs(c_new - c if np.isfinite(c).all() else np.inf)) < 1e-13:
            c = c_new
            break
        c = c_new
        edges = np.concatenate(([t[0]], 0.5 * (c[1:] + c[:-1]), [t[-1]]))
    c = 0.5 * (c - c[::-1])  # exactly symmetric (the law is)
    q = c[np.searchsorted(0.5 * (c[1:] + c[:-1]), t)]
    distortion = float(np.trapezoid((t - q) ** 2 * f, t))
    return tuple(float(x) for x in c), distortion


def midpoints(centroids: tuple[float, ...]) -> tuple[float, ...]:
    """The quantizer's thresholds: t goes to the centroid of the cell it falls in."""
    return tuple(0.5 * (a + b) for a, b in zip(centroids[:-1], centroids[1:]))


def sign_words() -> list[int]:
    """SIGN_SEED's splitmix64 stream: N_SIGN_BITS / 64 words of random signs."""
    out, state, mask = [], SIGN_SEED, (1 << 64) - 1
    for _ in range(N_SIGN_BITS // 64):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


def signs(head_dim: int) -> np.ndarray:
    """+1 / -1 per coordinate of a head of head_dim values."""
    words = sign_words()
    bits = np.array([(words[i // 64] >> (i % 64)) & 1 for i in range(head_dim)])
    return np.where(bits == 1, -1.0, 1.0)


def _floats(xs) -> str:
    return ", ".join(f"{np.float32(x)!r}f".replace("np.float32(", "").replace(")", "") for x in xs)


def header() -> str:
    """The text of ggml/deltaspec_tq_codebook.h."""
    lines = [
        "// Generated by python/deltaspec/tq_codebook.py (python -m deltaspec.tq_codebook <this file>); do not edit.",
        "// Lloyd-Max codebooks of the law of one coordinate of a randomly rotated head vector of D values,",
        "// scaled to unit mean square (f_D(t) ~ (1 - t^2/D)^((D-3)/2)); the derivation is in that module.",
        "#pragma once",
        "",
        "#include <stdint.h>",
        "",
        f"#define DELTASPEC_TQ_N_HEAD_DIMS {len(HEAD_DIMS)}",
        "// index of head dim D in the tables: D = 32 << index",
        "",
    ]
    # each table as an initializer macro (CUDA's __constant__ copies use it) and a host array
    def table(name: str, rows: list[tuple[str, str]], width: int) -> None:
        lines.append(f"#define {name.upper()}_INIT {{ \\")
        for values, comment in rows:
            lines.append(f"    {{{values}}},  /* {comment} */ \\")
        lines.append("}")
        lines.append(f"static const float {name}[DELTASPEC_TQ_N_HEAD_DIMS][{width}] = {name.upper()}_INIT;")

    for bits in BITS:
        n = 1 << bits
        lines.append(f"// {n} centroids ascending, then {n - 1} thresholds (midpoints), per head dim; "
                     f"expected distortion in the comment")
        table(f"deltaspec_tq{bits}_centroids",
              [(_floats(lloyd_max(d, bits)[0]), f"D={d}: E[(t-Q(t))^2] = {lloyd_max(d, bits)[1]:.6g}")
               for d in HEAD_DIMS], n)
        table(f"deltaspec_tq{bits}_thresholds",
              [(_floats(midpoints(lloyd_max(d, bits)[0])), f"D={d}") for d in HEAD_DIMS], n - 1)
        lines.append("")
    words = ", ".join(f"0x{w:016x}ull" for w in sign_words())
    lines.append(f"// random signs S: coordinate i is negated when bit i % 64 of word i / 64 is set "
                 f"(splitmix64, seed 0x{SIGN_SEED:016x})")
    lines.append(f"#define DELTASPEC_TQ_SIGNS_INIT {{{words}}}")
    lines.append(f"static const uint64_t deltaspec_tq_signs[{N_SIGN_BITS // 64}] = DELTASPEC_TQ_SIGNS_INIT;")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m deltaspec.tq_codebook <path of ggml/deltaspec_tq_codebook.h>", file=sys.stderr)
        return 2
    with open(argv[0], "w", encoding="utf-8") as fh:
        fh.write(header())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
