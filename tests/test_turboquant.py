"""The tq3/tq4 KV cache types (ggml/deltaspec_tq.h) on the CPU: codebook, rotation, round trip,
the quantize-on-write node and the attention node. The engine with tq caches (allocated types, the
planted all-F32 cache, logits against an F32 cache for every pair) is in tests/test_kv_cache_types.py;
CUDA against the CPU in tests/test_gpu_turboquant.py; quality on the trained testbed in
bench/kv_quality.py.

References: Max's 1960 table of Gaussian Lloyd-Max quantizers (the solver's Gaussian limit must give
it), scipy's Hadamard matrix (the fast rotation must equal H S / sqrt(D) built from it), numpy
attention over the dequantized cache (the attention node must equal it).

Planted bugs (DELTASPEC_TEST_TQ_BUG, read by ggml/deltaspec_tq_codec.h), each seen to fail the test
that names it:
  uniform_codebook    evenly spaced levels instead of Lloyd-Max: the distortion test (MSE 9-18% over
                      the codebook's; measured with it: tq3 D=256 ratio 1.13)
  no_rotation         R = I: the outlier test (error 3-10x the theory on spiky vectors) and the
                      rotation-matrix test
  v_not_rotated_back  the attention node leaves a tq V's output rotated: the attention test
  cuda_shuffle_partner  the host run of the CUDA kernels' source pairs the wrong lanes in a shuffle:
                      the kernel-source test
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from scipy.linalg import hadamard

from deltaspec import _core
from deltaspec import tq_codebook as cb

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "..", "ggml", "deltaspec_tq_codebook.h")

# Max (1960), "Quantizing for minimum distortion", Table I: N(0, 1), 8 and 16 levels
MAX_8_LEVELS = (0.2451, 0.7560, 1.344, 2.152)
MAX_8_MSE, MAX_16_MSE = 0.03455, 0.009497


def test_codebook_header_is_the_generators_output():
    """The committed header is what python/deltaspec/tq_codebook.py derives (no hand-edited numbers)."""
    with open(HEADER, encoding="utf-8") as fh:
        assert fh.read() == cb.header(), "regenerate: python -m deltaspec.tq_codebook ggml/deltaspec_tq_codebook.h"


def test_solver_reproduces_max_table():
    """The Lloyd-Max solver, run on N(0, 1), gives Max's published quantizers (the per-D codebooks
    come from the same solver on the exact law of a rotated coordinate)."""
    c8, mse8 = cb.lloyd_max(None, 3)
    assert np.allclose(c8[4:], MAX_8_LEVELS, atol=6e-4)
    assert mse8 == pytest.approx(MAX_8_MSE, abs=2e-5)
    assert cb.lloyd_max(None, 4)[1] == pytest.approx(MAX_16_MSE, abs=1e-5)
    # the exact law tends to the Gaussian as D grows: distortions rise towards Max's
    for bits, limit in ((3, MAX_8_MSE), (4, MAX_16_MSE)):
        d = [cb.lloyd_max(D, bits)[1] for D in cb.HEAD_DIMS]
        assert d == sorted(d) and d[-1] < limit


def test_rotation_is_hadamard_with_signs():
    """tq_rotate(x) = H S x / sqrt(D) with scipy's Sylvester Hadamard matrix, and inverse undoes it."""
    rng = np.random.default_rng(1)
    for D in cb.HEAD_DIMS:
        x = rng.standard_normal((5, D)).astype(np.float32)
        R = hadamard(D) @ np.diag(cb.signs(D)) / np.sqrt(D)
        assert np.allclose(_core.tq_rotate(x), x @ R.T, atol=1e-5), D
        assert np.allclose(_core.tq_rotate(_core.tq_rotate(x), inverse=True), x, atol=1e-5), D


def _relative_mse(bits, x):
    q = _core.tq_quantize(bits, x)
    back = _core.tq_rotate(_core.tq_dequantize_rotated(bits, q, x.shape[1]), inverse=True)
    return float(((x - back) ** 2).sum() / (x ** 2).sum())


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("D", [32, 64, 256])
def test_gaussian_round_trip_matches_codebook_distortion(bits, D):
    """On Gaussian vectors the relative MSE is the codebook's distortion E[(t - Q(t))^2] for the law
    of a rotated coordinate, less what the least-squares scale recovers (one free parameter per
    vector: measured 1 - 2/D relative; allowed 1 - 3/D). Fails with uniform_codebook."""
    x = np.random.default_rng(D + bits).standard_normal((3000, D)).astype(np.float32)
    theory = cb.lloyd_max(D, bits)[1]
    ratio = _relative_mse(bits, x) / theory
    assert 1 - 3 / D <= ratio <= 1.01, f"tq{bits} D={D}: MSE {ratio:.4f} x the codebook's {theory:.5f}"


@pytest.mark.parametrize("bits", [3, 4])
def test_rotation_makes_outlier_channels_harmless(bits):
    """Vectors whose energy sits in a few channels (as real keys' do) quantize as well as Gaussian
    ones once rotated: the error stays at the codebook's distortion. Fails with no_rotation."""
    D = 256
    rng = np.random.default_rng(bits)
    scale = np.full(D, 0.2, dtype=np.float32)
    scale[rng.choice(D, 6, replace=False)] = 8.0
    x = (rng.standard_normal((2000, D)) * scale).astype(np.float32)
    ratio = _relative_mse(bits, x) / cb.lloyd_max(D, bits)[1]
    assert ratio <= 1.1, f"tq{bits}: MSE {ratio:.2f} x the codebook's on spiky vectors"


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("D", [64, 256])
def test_cpu_write_node_equals_host_codec(bits, D):
    """The CPU backend's quantize-on-write node writes the host codec's bytes, into the rows asked
    (the other rows stay zero), for every head of every row."""
    rng = np.random.default_rng(7)
    T, H, n_rows = 37, 3, 64
    x = (rng.standard_normal((T, H, D)) * rng.uniform(0.01, 50, (T, H, 1))).astype(np.float32)
    idx = rng.permutation(n_rows)[:T].astype(np.int64)
    cache = _core.tq_set_rows("cpu", bits, x, idx, n_rows, n_threads=2)
    want = _core.tq_quantize(bits, x.reshape(T * H, D)).reshape(T, -1)
    assert np.array_equal(cache[idx], want)
    assert not cache[np.setdiff1d(np.arange(n_rows), idx)].any()


def _hard_rows(rng, T, H, D):
    """Gaussian head vectors at many scales (1e-3 .. 1e3), some with a few channels 40x larger, a row
    of zeros and a row of exact quarter multiples (ties are likelier): tests/test_gpu_turboquant.py's
    rows, where the device's bytes are held to the CPU's."""
    x = rng.standard_normal((T, H, D)) * rng.uniform(1e-3, 1e3, (T, H, 1))
    x[1::7, :, rng.choice(D, 4, replace=False)] *= 40
    x[2] = 0
    x[3] = np.round(rng.standard_normal((H, D)) * 4) / 4
    return x.astype(np.float32)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("D", [32, 64, 128, 256])
def test_cuda_kernel_source_writes_the_cpu_codecs_bytes(bits, D):
    """The CUDA quantizer and rotation kernels' source (ggml/cuda/deltaspec_tq_warp.cuh), compiled for
    the host with stand-ins of its intrinsics and run warp by warp in lockstep
    (csrc/tq_warp_emulation.cpp), gives the CPU codec's bytes for every head vector and the CPU
    rotation's floats bit for bit: the kernel does the codec's arithmetic in the codec's order. What
    this cannot see is the device itself (its compiler, its runtime): bench/tq_cuda_diag.py compares
    the device's bytes with these. Fails with DELTASPEC_TEST_TQ_BUG=cuda_shuffle_partner (the
    emulated shuffle pairs lanes l and l ^ 8 where the source asks l ^ 16)."""
    x = _hard_rows(np.random.default_rng(D * 10 + bits), 12, 4, D).reshape(-1, D)
    before = _core.tq_cuda_source_stats()
    got = _core.tq_quantize_cuda_source(bits, x)
    want = _core.tq_quantize(bits, x)
    differing = np.flatnonzero((got != want).any(axis=1))
    assert differing.size == 0, f"tq{bits} D={D}: {differing.size} of {len(x)} head vectors differ, e.g. {differing[:5]}"
    for inverse in (False, True):
        assert np.array_equal(_core.tq_rotate_cuda_source(x, inverse=inverse), _core.tq_rotate(x, inverse=inverse))
    after = _core.tq_cuda_source_stats()  # the kernels ran as warps, with their shuffles
    assert after["warps"] - before["warps"] == 3 * len(x)
    assert after["shuffles"] - before["shuffles"] > 32 * len(x) * 5


def _attention_reference(q, k, v, mask, scale):
    """softmax(q k^T * scale + mask) v per query head, GQA by head // (H / H_kv)."""
    T, H, D = q.shape
    group = H // k.shape[1]
    out = np.zeros((T, H, D))
    for h in range(H):
        s = q[:, h].astype(np.float64) @ k[:, h // group].T.astype(np.float64) * scale + mask
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // group]
    return out


def _as_cached(x, type_name):
    """What a cache of type_name gives back for x (n, H_kv, D): tq round trip, a rotated ggml type's
    (rotation, gguf-py's quantization, back), f16 or f32."""
    if type_name.endswith("+rot"):
        from gguf import GGMLQuantizationType, quants

        t = GGMLQuantizationType[type_name[:-4].upper()]
        y = _core.tq_rotate(x.reshape(-1, x.shape[2]))
        return _core.tq_rotate(quants.dequantize(quants.quantize(y, t), t).reshape(y.shape), inverse=True).reshape(x.shape)
    if type_name in ("tq3", "tq4"):
        bits, (n, Hkv, D) = int(type_name[2]), x.shape
        q = _core.tq_quantize(bits, x.reshape(-1, D))
        return _core.tq_rotate(_core.tq_dequantize_rotated(bits, q, D), inverse=True).reshape(x.shape)
    return x.astype(np.float16).astype(np.float32) if type_name == "f16" else x


@pytest.mark.parametrize("type_k,type_v", [("tq3", "tq3"), ("tq4", "tq3"), ("tq3", "f16"), ("f32", "tq4"),
                                           ("q4_0+rot", "q8_0+rot"), ("tq3", "q4_0+rot")])
@pytest.mark.parametrize("T", [1, 21])
def test_attention_node_equals_attention_over_the_cache(type_k, type_v, T):
    """The attention node (Q rotated when K is rotated, output rotated back when V is: tq or a
    rotated ggml type) gives numpy's attention over what the caches hold, within float rounding, with
    a causal mask and GQA 4:2. Fails with v_not_rotated_back (for a rotated V)."""
    rng = np.random.default_rng(T)
    H, Hkv, D, n_kv = 4, 2, 64, 256
    n_past = 200  # keys 0 .. n_past + t visible to query t
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = (rng.standard_normal((n_kv, Hkv, D)) * 2).astype(np.float32)
    v = rng.standard_normal((n_kv, Hkv, D)).astype(np.float32)
    mask = np.where(np.arange(n_kv)[None, :] <= n_past + np.arange(T)[:, None], 0.0, -np.inf).astype(np.float32)
    scale = 1 / np.sqrt(D)
    got = _core.tq_attention("cpu", q, k, v, mask, type_k, type_v, scale, n_threads=2)
    want = _attention_reference(q, _as_cached(k, type_k), _as_cached(v, type_v), mask, scale)
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max(), f"{type_k}/{type_v}"


@pytest.mark.parametrize("type_k,type_v", [("tq3", "tq4"), ("q4_0+rot", "f16")])
def test_attention_node_streams_are_separate_caches(type_k, type_v):
    """One node over N streams (a leading axis on q, k, v and mask: the engine's slots, and how
    tests/test_gpu_turboquant.py drives the in-place CUDA kernels with several streams) gives each
    stream's attention over its own rows, as N separate nodes do; n_kv = 300, not a multiple of 256.
    Seen to fail with the binding's stream stride (the view's nb3) set to 0: every stream then reads
    stream 0's rows."""
    rng = np.random.default_rng(5)
    N, H, Hkv, D, n_kv = 3, 6, 2, 64, 300
    q = rng.standard_normal((N, 1, H, D)).astype(np.float32)
    k = rng.standard_normal((N, n_kv, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((N, n_kv, Hkv, D)).astype(np.float32)
    mask = np.where(rng.random((N, 1, n_kv)) < 0.7, 0.0, -np.inf).astype(np.float32)
    got = _core.tq_attention("cpu", q, k, v, mask, type_k, type_v, 0.125)
    want = np.stack([_core.tq_attention("cpu", q[n], k[n], v[n], mask[n], type_k, type_v, 0.125) for n in range(N)])
    assert got.shape == (N, 1, H, D)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="shapes disagree"):
        _core.tq_attention("cpu", q, k[:2], v, mask, type_k, type_v, 0.125)


def test_bad_head_dim_is_refused():
    with pytest.raises(ValueError, match="head dim.*must be 32, 64, 128 or 256, got 96"):
        _core.tq_quantize(3, np.zeros((2, 96), np.float32))
    with pytest.raises(ValueError, match="bits must be 3"):
        _core.tq_quantize(5, np.zeros((2, 64), np.float32))


@pytest.mark.parametrize("bug,call", [
    ("uniform_codebook", "test_gaussian_round_trip_matches_codebook_distortion(3, 256)"),
    ("no_rotation", "test_rotation_makes_outlier_channels_harmless(3)"),
    ("v_not_rotated_back", "test_attention_node_equals_attention_over_the_cache('tq3', 'tq3', 1)"),
    ("cuda_shuffle_partner", "test_cuda_kernel_source_writes_the_cpu_codecs_bytes(3, 128)"),
])
def test_planted_bugs_are_caught(bug, call):
    """Each planted bug turns its test red (in a fresh process: the switch is read once per process)."""
    code = f"import sys; sys.path.insert(0, {HERE!r}); from test_turboquant import *; {call}"
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DELTASPEC_TEST_TQ_BUG": bug},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "AssertionError" in r.stderr, r.stderr[-2000:]  # (the same calls pass above)
