"""The tq KV cache nodes on CUDA (ggml/cuda/deltaspec_tq.cu) against the CPU (runs only where a CUDA
build and a GPU exist). The engine with every cache pair on CUDA, tq and rotated types included, is
tests/test_gpu.py's test_cuda_kv_pair_matches_cpu.

Run on the GPU machine with: python -m pytest -q -m gpu tests/test_gpu_turboquant.py

Bitwise: the CUDA quantizer does the CPU codec's arithmetic step for step (ggml/deltaspec_tq.h), so
its bytes must equal the CPU's for every row, including rows whose values sit on a codebook threshold
and rows of zeros. Attention: CUDA decodes a tq side to F16 and runs ggml's flash attention, so it is
held to the CPU within a relative bound (F16 rounding of K/V and ggml's F16 accumulation). A
one-token step with both sides tq (head dim 128 or 256) reads the tq rows in place instead, by the
tile kernel (tq_decode_attn_tile, the default) or the older warp-per-row kernel
(DELTASPEC_TQ_DECODE_KERNEL=warp, tq_decode_attn); DELTASPEC_TQ_DECODE_KERNEL=0 sends it through the
F16 path too. All three are tested, each test checking which one ran (_core.tq_cuda_decode_launches),
and the in-place kernels, F32 throughout like the CPU node, are held to a tighter bound.

Planted bugs: for the CPU side the CUDA results are compared with (DELTASPEC_TEST_TQ_BUG, read once per
process): uniform_codebook makes the CPU write other bytes than CUDA (the bitwise test fails);
v_not_rotated_back makes the CPU attention differ from CUDA's for a rotated V (the attention test fails).
On the CUDA side (read per call): cuda_q_rotated_back, test_planted_q_rotation_is_caught;
DELTASPEC_TEST_TQ_ATTN_BUG=skip_last_row (the tile kernel leaves out each tile's last row),
test_planted_tile_row_skip_is_caught.

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
# the in-place kernels against the CPU node: the same F32 arithmetic in another order, and the device's
# fast expf (the kernel's source run on the host against a float64 reference: ~1e-6)
IN_PLACE_REL = 2e-4
KERNEL_ENV = {"tile": None, "warp": "warp", "f16": "0"}  # DELTASPEC_TQ_DECODE_KERNEL (None: unset, the default)
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


def _select_kernel(monkeypatch, kernel):
    if KERNEL_ENV[kernel] is None:
        monkeypatch.delenv("DELTASPEC_TQ_DECODE_KERNEL", raising=False)
    else:
        monkeypatch.setenv("DELTASPEC_TQ_DECODE_KERNEL", KERNEL_ENV[kernel])


def _cuda_attention_by(kernel, *args):
    """_core.tq_attention on CUDA, asserting that exactly one attention step ran, by `kernel`."""
    before = _core.tq_cuda_decode_launches()
    assert before, "this CUDA build does not count its tq attention steps (ggml/cuda/deltaspec_tq.cu missing?)"
    out = _core.tq_attention("cuda", *args)
    after = _core.tq_cuda_decode_launches()
    ran = {name: after[name] - before[name] for name in after}
    assert ran == {name: int(name == kernel) for name in after}, f"expected one step by {kernel}, ran {ran}"
    return out


# every case through the F16 path, and the one-token tq/tq cases through both in-place kernels too
ATTENTION_RUNS = [(k, v, T, kernel) for k, v, T in ATTENTION_CASES
                  for kernel in (["tile", "warp", "f16"] if T == 1 and k.startswith("tq") and v.startswith("tq")
                                 else ["f16"])]


@pytest.mark.parametrize("type_k,type_v,T,kernel", ATTENTION_RUNS)
@pytest.mark.parametrize("D", [128, 256])
def test_cuda_attention_matches_cpu(type_k, type_v, T, D, kernel, monkeypatch):
    """One token (an in-place kernel for tq/tq, else ggml's vector kernel), a short verify batch and a
    prefill batch (ggml's tensor-core kernel), GQA 4:1 as Qwen3.5-27B (24 query heads over 4 KV heads
    at D=256), a causal mask."""
    _select_kernel(monkeypatch, kernel)
    in_place = kernel != "f16"
    q, k, v, mask, scale = _attention_inputs(T, D)
    cuda = _cuda_attention_by(kernel, q, k, v, mask, type_k, type_v, scale)
    cpu = _core.tq_attention("cpu", q, k, v, mask, type_k, type_v, scale)
    rel = float(np.abs(cuda - cpu).max() / np.abs(cpu).max())
    bound = IN_PLACE_REL if in_place else ATTENTION_REL
    assert rel <= bound, f"{type_k}/{type_v} T={T} D={D} {kernel}: CUDA vs CPU max |diff| {rel:.3g} of max |value|"


def _decode_inputs(D, G, n_kv, n_streams, Hkv):
    """One query per stream over n_kv rows (not a multiple of the tile kernel's 128): stream n sees rows
    up to n_kv - 1 - 300 n with holes every 13th row (masked rows inside tiles, and whole masked tiles
    at the end), the last stream only its first row (a split of a single visible row, the rest -inf)."""
    rng = np.random.default_rng(D * 100 + G * 10 + n_streams)
    H = Hkv * G
    q = rng.standard_normal((n_streams, 1, H, D)).astype(np.float32)
    k = (rng.standard_normal((n_streams, n_kv, Hkv, D)) * rng.uniform(0.5, 2.0, (n_streams, n_kv, Hkv, 1)))
    v = rng.standard_normal((n_streams, n_kv, Hkv, D))
    j = np.arange(n_kv)
    visible = np.stack([(j <= n_kv - 1 - 300 * n) & (j % 13 != 7) for n in range(n_streams)])
    if n_streams > 1:
        visible[-1] = j == 0
    mask = np.where(visible, 0.0, -np.inf)[:, None, :].astype(np.float32)
    return q, k.astype(np.float32), v.astype(np.float32), mask, 1 / np.sqrt(D)


DECODE_CASES = [(D, G, tk, tv) for D in (128, 256) for G in range(1, 9)
                for tk, tv in [("tq3", "tq3"), ("tq4", "tq4"), ("tq3", "tq4"), ("tq4", "tq3")]
                if G in (1, 6, 8) or (tk, tv) == ("tq3", "tq3")]


@pytest.mark.parametrize("D,G,type_k,type_v", DECODE_CASES)
@pytest.mark.parametrize("kernel", ["tile", "warp"])
def test_cuda_decode_kernels_match_cpu(D, G, type_k, type_v, kernel, monkeypatch):
    """The in-place one-token kernels against the CPU node: head dims 128 and 256, 1..8 query heads per
    KV head, every tq3/tq4 mix of K and V, 3 streams of one node (different visible lengths, masked
    rows inside and after tiles, a stream of a single visible row), n_kv = 1000 (a partial last tile).
    Must fail for the tile kernel with DELTASPEC_TEST_TQ_ATTN_BUG=skip_last_row
    (test_planted_tile_row_skip_is_caught)."""
    _select_kernel(monkeypatch, kernel)
    q, k, v, mask, scale = _decode_inputs(D, G, 1000, 3, Hkv=2)
    cuda = _cuda_attention_by(kernel, q, k, v, mask, type_k, type_v, scale)
    cpu = _core.tq_attention("cpu", q, k, v, mask, type_k, type_v, scale)
    assert cuda.shape == (3, 1, 2 * G, D)
    rel = float(np.abs(cuda - cpu).max() / np.abs(cpu).max())
    assert rel <= IN_PLACE_REL, f"{type_k}/{type_v} D={D} G={G} {kernel}: CUDA vs CPU max |diff| {rel:.3g} of max |value|"


@pytest.mark.parametrize("kernel", ["tile", "warp"])
def test_cuda_decode_kernels_long_cache(kernel, monkeypatch):
    """Qwen3.5-27B's attention shape (D=256, 24 query heads over 4 KV heads) over 40017 rows: the tile
    kernel's blocks walk several tiles each (its split aims at ~4 blocks per SM), the warp kernel's
    split is 157 chunks; tq3 K and V as the bench's cache."""
    _select_kernel(monkeypatch, kernel)
    q, k, v, mask, scale = _decode_inputs(256, 6, 40017, 1, Hkv=4)
    cuda = _cuda_attention_by(kernel, q, k, v, mask, "tq3", "tq3", scale)
    cpu = _core.tq_attention("cpu", q, k, v, mask, "tq3", "tq3", scale, n_threads=8)
    rel = float(np.abs(cuda - cpu).max() / np.abs(cpu).max())
    assert rel <= IN_PLACE_REL, f"tq3/tq3 n_kv=40017 {kernel}: CUDA vs CPU max |diff| {rel:.3g} of max |value|"


def test_planted_tile_row_skip_is_caught(monkeypatch):
    """DELTASPEC_TEST_TQ_ATTN_BUG=skip_last_row (read per call by ggml/cuda/deltaspec_tq.cu: the tile
    kernel leaves out the last row of every tile, as an off-by-one in its tile bounds would) turns the
    tile kernel's checks red and leaves the warp kernel's green. Written without a GPU (the kernel's
    source run on the host went red with it: tests/test_tq_attn_tile_host.py); on the GPU machine
    `DELTASPEC_TEST_TQ_ATTN_BUG=skip_last_row python -m pytest -q -m gpu tests/test_gpu_turboquant.py -k
    "decode_kernels and tile"` must fail, every case."""
    monkeypatch.setenv("DELTASPEC_TEST_TQ_ATTN_BUG", "skip_last_row")
    with pytest.raises(AssertionError, match="CUDA vs CPU"):
        test_cuda_decode_kernels_match_cpu(256, 6, "tq3", "tq3", "tile", monkeypatch)
    with pytest.raises(AssertionError, match="CUDA vs CPU"):
        test_cuda_attention_matches_cpu("tq4", "tq4", 1, 128, "tile", monkeypatch)
    test_cuda_decode_kernels_match_cpu(256, 6, "tq3", "tq3", "warp", monkeypatch)


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
        test_cuda_attention_matches_cpu("tq4", "tq4", 5, 128, "f16", monkeypatch)
