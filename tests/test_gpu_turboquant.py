"""The tq KV cache nodes on CUDA (ggml/cuda/deltaspec_tq.cu) against the CPU (runs only where a CUDA
build and a GPU exist). The engine with every cache pair on CUDA, tq and rotated types included, is
tests/test_gpu.py's test_cuda_kv_pair_matches_cpu.

Run on the GPU machine with: python -m pytest -q -m gpu tests/test_gpu_turboquant.py

Bitwise: the CUDA quantizer does the CPU codec's arithmetic step for step (ggml/deltaspec_tq.h), so
its bytes must equal the CPU's for every row, including rows whose values sit on a codebook threshold
and rows of zeros. Attention: CUDA decodes a tq side to F16 and runs ggml's flash attention, so it is
held to the CPU within a relative bound (F16 rounding of K/V and ggml's F16 accumulation). A
one-token step with both sides tq (head dim 128 or 256) runs deltaspec's in-place kernel instead
(tq_decode_attn); DELTASPEC_TQ_DECODE_KERNEL=0 sends it through the F16 path too, and both are tested.

Planted bugs: for the CPU side the CUDA results are compared with (DELTASPEC_TEST_TQ_BUG, read once per
process): uniform_codebook makes the CPU write other bytes than CUDA (the bitwise test fails);
v_not_rotated_back makes the CPU attention differ from CUDA's for a rotated V (the attention test fails).
On the CUDA side (read per call): cuda_q_rotated_back, test_planted_q_rotation_is_caught.

Where the bitwise test fails, bench/tq_cuda_diag.py says how (scales or codes, zero rows, misplaced
rows, run-to-run changes, which environment setting removes it) against the CPU and against the
kernel's own source run on the host.
"""

import numpy as np
import pytest

from deltaspec import _core


def _cuda_available() -> bool:
    return _core.has_device("cuda")


# a skipif mark, not a module-level skip: -m "not gpu" deselects these (tests/ci_skips.py)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="no CUDA device in this build "
                                                   "of deltaspec (CPU-only build or no GPU)")]

ATTENTION_REL = 5e-3  # CUDA vs CPU attention: max |difference| / max |value|
ROTATED_REL = 2e-3  # a rotated ggml cache against ggml's attention on rotated rows, both on CUDA


def _rows(rng, T, H, D):
    """Gaussian rows at many scales, rows with a few large channels, a zero row, and a row whose
    values are exact multiples of one step (ties against the thresholds are likelier)."""
    x = rng.standard_normal((T, H, D)) * rng.uniform(1e-3, 1e3, (T, H, 1))
    x[1::7, :, rng.choice(D, 4, replace=False)] *= 40
    x[2] = 0
    x[3] = np.round(rng.standard_normal((H, D)) * 4) / 4
    return x.astype(np.float32)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("D", [32, 64, 128, 256])
def test_cuda_quantizer_writes_the_cpus_bytes(bits, D):
    rng = np.random.default_rng(D * 10 + bits)
    T, H, n_rows = 300, 4, 512
    x = _rows(rng, T, H, D)
    idx = rng.permutation(n_rows)[:T].astype(np.int64)
    cuda = _core.tq_set_rows("cuda", bits, x, idx, n_rows)
    cpu = _core.tq_set_rows("cpu", bits, x, idx, n_rows)
    differing = np.flatnonzero((cuda != cpu).any(axis=1))
    assert differing.size == 0, f"tq{bits} D={D}: {differing.size} of {n_rows} cache rows differ, e.g. {differing[:5]}"


def _attention_inputs(T, D):
    rng = np.random.default_rng(T + D)
    H, Hkv, n_kv = 8, 2, 1024
    n_past = 900
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = (rng.standard_normal((n_kv, Hkv, D)) * 2).astype(np.float32)
    v = rng.standard_normal((n_kv, Hkv, D)).astype(np.float32)
    mask = np.where(np.arange(n_kv)[None, :] <= n_past + np.arange(T)[:, None], 0.0, -np.inf).astype(np.float32)
    return q, k, v, mask, 1 / np.sqrt(D)


# K of ggml's block types (rotated) only in batches: for one token ggml's vector kernel quantizes Q to
# q8_1 for a quantized K, where the CPU node dots F32 queries with the dequantized rows (on the H200,
# 2026-12-03: 0.026-0.031 of max |value| for q4_0+rot at T=1, 5e-3 or less at T=5 and 64);
# test_cuda_rotated_cache_is_ggml_on_rotated_rows covers them at every T against ggml itself.
ATTENTION_CASES = [(k, v, T) for k, v in [("tq3", "tq3"), ("tq4", "tq4"), ("tq3", "tq4"), ("tq3", "q4_0"),
                                          ("f16", "tq3"), ("q4_0+rot", "q4_0+rot"), ("q8_0+rot", "tq4")]
                   for T in (1, 5, 64) if T > 1 or not k.endswith("+rot")]


@pytest.mark.parametrize("type_k,type_v,T", ATTENTION_CASES)
@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("in_place", [True, False], ids=["decode_kernel", "f16_path"])
def test_cuda_attention_matches_cpu(type_k, type_v, T, D, in_place, monkeypatch):
    """One token (deltaspec's in-place kernel for tq/tq, else ggml's vector kernel), a short verify
    batch and a prefill batch (ggml's tensor-core kernel), GQA 4:1 as Qwen3.5-27B (24 query heads over
    4 KV heads at D=256), a causal mask."""
    if not in_place:
        monkeypatch.setenv("DELTASPEC_TQ_DECODE_KERNEL", "0")
    q, k, v, mask, scale = _attention_inputs(T, D)
    cuda = _core.tq_attention("cuda", q, k, v, mask, type_k, type_v, scale)
    cpu = _core.tq_attention("cpu", q, k, v, mask, type_k, type_v, scale)
    rel = float(np.abs(cuda - cpu).max() / np.abs(cpu).max())
    assert rel <= ATTENTION_REL, f"{type_k}/{type_v} T={T} D={D}: CUDA vs CPU max |diff| {rel:.3g} of max |value|"


@pytest.mark.parametrize("type_name", ["q4_0", "q8_0"])
@pytest.mark.parametrize("T", [1, 5, 64])
@pytest.mark.parametrize("D", [128, 256])
def test_cuda_rotated_cache_is_ggml_on_rotated_rows(type_name, T, D):
    """A rotated cache of a ggml type on CUDA is ggml's own cache and attention over rotated rows: the
    node's output equals ggml's attention on plain caches of that type (the same CUDA kernels) given
    R q, R k and R v, rotated back (R from the CPU codec, which the CUDA rotation equals bit for bit:
    tests/test_turboquant.py runs the kernel's source). Must fail with DELTASPEC_TEST_TQ_BUG=
    cuda_q_rotated_back (test_planted_q_rotation_is_caught)."""
    q, k, v, mask, scale = _attention_inputs(T, D)
    rot = lambda a: _core.tq_rotate(a.reshape(-1, D)).reshape(a.shape)
    rotated = _core.tq_attention("cuda", q, k, v, mask, f"{type_name}+rot", f"{type_name}+rot", scale)
    ggml = _core.tq_attention("cuda", rot(q), rot(k), rot(v), mask, type_name, type_name, scale)
    want = _core.tq_rotate(ggml.reshape(-1, D), inverse=True).reshape(ggml.shape)
    rel = float(np.abs(rotated - want).max() / np.abs(want).max())
    # equal rotations give equal caches and ~1e-7 here; the bound leaves room for a rare block-rounding
    # flip should the device's rotation differ from the CPU's in the last bit (the bitwise quantizer
    # test's business), while a rotation on the wrong side or in the wrong direction moves it by ~1
    assert rel <= ROTATED_REL, f"{type_name}+rot T={T} D={D}: max |diff| {rel:.3g} of max |value| from ggml on rotated rows"


def test_planted_q_rotation_is_caught(monkeypatch):
    """DELTASPEC_TEST_TQ_BUG=cuda_q_rotated_back (read per call by ggml/cuda/deltaspec_tq.cu: Q goes
    through R^T instead of R) turns the rotated-cache test and the tq attention test red."""
    monkeypatch.setenv("DELTASPEC_TEST_TQ_BUG", "cuda_q_rotated_back")
    with pytest.raises(AssertionError, match="from ggml on rotated rows"):
        test_cuda_rotated_cache_is_ggml_on_rotated_rows("q8_0", 5, 128)
    with pytest.raises(AssertionError, match="CUDA vs CPU"):
        test_cuda_attention_matches_cpu("tq4", "tq4", 5, 128, False, monkeypatch)
