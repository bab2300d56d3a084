"""KV-cache types: the size/validation table of `deltaspec.kv_cache`, and the engine run with every
(K, V) pair of cache types on the CPU against an F32 cache.

Model: the tiny byte-level vocabulary model (`tiny_vocab`, 265 tokens) with 8 layers, two of them
full attention (3, 7), GQA 4:1 (4 query heads, 1 KV head) of head dim 64 (two 32-blocks per row),
F32 weights. It loads in milliseconds and a token costs well under one, so all 121 pairs of the 9
ggml types and deltaspec's tq3/tq4 (ggml/deltaspec_tq.h) run in about 3 s, and each rotated ggml
type (`q4_0+rot` etc.) with itself, with f32 and f32 with it. A rotated type's tolerances and floor
are its plain type's (measured: the rotation lowers the error here, e.g. q4_0 rms/std 0.0224 ->
0.0199, q8_0 0.00149 -> 0.00120, q5_0 0.0100 -> 0.0092). Prompt: 100 fixed pseudo-random byte tokens, then 16 greedy tokens. Each pair is
checked three ways:

- allocated: `Model.kv_cache_info()` (read from the engine's ggml tensors) must report the asked-for
  K and V types at every attention layer, with n_ctx * row bytes computed here from gguf's
  GGML_QUANT_SIZES and the head sizes read from the GGUF, and F32 recurrent state of the size
  the GGUF's shapes give;
- close enough: compared with the f32/f32 cache on the prompt's logits (all 100 positions), and
  its greedy continuation with the f16/f16 cache's (the default); generate()'s greedy tokens must
  equal the eval loop's;
- lossy where it must be: every pair with a type narrower than F32 must move the logits by at
  least a floor (`ERROR_FLOOR`), and f32/f32 must give the reference bit for bit. The first two
  checks alone are one-sided: a cache that silently stays F32 passes them.

Measured (n_threads=1; std = std of the f32-cache logits = 2.53; "greedy" = tokens equal to the
f16 cache's before the first difference). Each row is the worst over the pairs whose looser type
is that one (e.g. the f16 row includes f32/f16, whose error is 3x f16/f16's; the 4-bit rows are
worst with an f32 K). Tolerances below are ~2.5x these:

    type     max|diff|/std  (pair)          rms/std   (pair)           greedy
    f16      0.00107        f32/f16         1.6e-04   f32/f16          16
    bf16     0.00396        f32/bf16        4.7e-04   bf16/bf16        16
    q8_0     0.0108         q8_0/q8_0       0.00149   q8_0/q8_0        16
    q5_1     0.0607         f32/q5_1        0.00834   q5_1/q5_1        15
    q5_0     0.0753         q5_1/q5_0       0.0100    q5_1/q5_0        15
    iq4_nl   0.147          f32/iq4_nl      0.0200    iq4_nl/iq4_nl    16
    q4_1     0.165          f32/q4_1        0.0192    q4_1/q4_1        16
    q4_0     0.215          f32/q4_0        0.0224    q4_0/q4_0        15
    tq4      0.355          tq4/tq3         0.0353    tq4/tq3          15 (tq4/tq4: 0.184, 0.0235, 16)
    tq3      0.355          f32/tq3         0.0392    tq3/tq3          5 (q4_1/tq3; others 15-16)

(f32/f32 is the reference itself: 0.) For scale: changing only the prompt's first token moves the
later positions' logits by max/std 4.3, rms/std 0.40, so a cache that loses or garbles context
fails these tolerances by an order of magnitude or more.

The smallest error, rms/std, over the pairs that hold each type (the other type anything, F32
included; the least is always with the other type F32, F16 or BF16), from which `ERROR_FLOOR` is
a third:

    f16 3.9e-05 (f16/f32)   bf16 3.3e-04 (bf16/f32)   q8_0 1.0e-03 (q8_0/f32)
    q5_1 5.0e-03            q5_0 5.5e-03              q4_1 1.03e-02   iq4_nl 1.04e-02   q4_0 1.17e-02
    tq4 1.28e-02 (tq4/f32)  tq3 2.19e-02 (tq3/f32)

With K = V, rms/std orders the types f16 5.1e-05 < bf16 4.7e-04 < q8_0 1.5e-03 < q5_1 8.3e-03,
q5_0 1.0e-02 < q4_1 1.9e-02, iq4_nl 2.0e-02, q4_0 2.2e-02, tq4 2.35e-02 < tq3 3.9e-02: each group at
least 1.6x the one before (within the 5-bit and the 4-bit groups the order is within noise, so it is
not asserted). On this random-weight model K and V are near Gaussian, where a per-block absmax scale
(q4_0's 4.5 bits) does as well as the rotation; bench/kv_quality.py measures the trained testbed.

Planted bug, seen to fail: DELTASPEC_TEST_FORCE_KV_F32=1 (read by the engine when it allocates the
state, csrc/state.cpp) makes every cache F32 whatever was asked. With it, the old checks (close
enough, greedy) still passed all 81 pairs; the allocated-type check and the error floor fail every
pair but f32/f32, and the ordering fails: `test_planted_all_f32_cache_is_caught` runs them under
the switch and asserts that they raise (tq3/tq4 pairs included: the switch allocates them F32 too).
"""

import functools
import itertools
import re

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader

from deltaspec import Model
from deltaspec.kv_cache import (CACHE_TYPES, CUDA_VEC_PAIRS_DEFAULT, KV_CACHE_TYPES, ROTATED_CACHE_TYPES,
                                TQ_CACHE_TYPES, block_size,
                                bytes_per_element, ggml_type, kv_bytes_per_token, kv_cache_bytes, supported_pairs,
                                supported_types, validate_cache_types)
from deltaspec.qwen35 import Qwen35HParams
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path

PROMPT = np.random.default_rng(0).integers(0, 256, size=100).tolist()
N_GEN = 16
N_CTX = 256  # a whole number of the engine's 256-row KV blocks: the engine allocates exactly this
# One thread: with two, ggml's workers spin-wait for each other, and on a busy 2-core machine a
# 16-token decode then took 1-6 s of CPU instead of 0.05 s.
N_THREADS = 1
# every pair of the plain and tq types; a rotated type with itself and with f32 on the other side
CPU_PAIRS = sorted({(k, v) for k, v in supported_pairs("cpu") if k not in ROTATED_CACHE_TYPES and v not in
                    ROTATED_CACHE_TYPES} | {p for r in ROTATED_CACHE_TYPES for p in ((r, r), (r, "f32"), ("f32", r))})

# Per cache type: (max|diff| / std, rms diff / std, greedy tokens that must equal the f16 cache's).
# ~2.5x the measured errors of the docstring table; greedy: all 16 for 8+ bit types, at least the
# first few where 4-5 bit noise can flip a near-tie.
TOLERANCE = {
    "f32": (1e-6, 1e-7, N_GEN),
    "f16": (0.003, 4e-4, N_GEN),
    "bf16": (0.01, 0.0012, N_GEN),
    "q8_0": (0.03, 0.004, N_GEN),
    "q5_0": (0.2, 0.025, 8),
    "q5_1": (0.2, 0.025, 8),
    "q4_0": (0.55, 0.06, 4),
    "q4_1": (0.45, 0.05, 4),
    "iq4_nl": (0.4, 0.05, 4),
    "tq4": (0.9, 0.09, 4),
    "tq3": (0.9, 0.1, 4),
}
TOLERANCE.update({r: TOLERANCE[t] for r, t in ROTATED_CACHE_TYPES.items()})
# Per cache type: the least rms diff / std a pair holding it must show against the f32 cache
# (a third of the least measured, docstring). f32/f32 must be exact instead.
ERROR_FLOOR = {"f32": 0.0, "f16": 1.3e-5, "bf16": 1.1e-4, "q8_0": 3.4e-4, "q5_0": 1.8e-3, "q5_1": 1.6e-3,
               "q4_0": 3.9e-3, "q4_1": 3.4e-3, "iq4_nl": 3.4e-3, "tq4": 4.2e-3, "tq3": 7.3e-3}
ERROR_FLOOR.update({r: ERROR_FLOOR[t] / 2 for r, t in ROTATED_CACHE_TYPES.items()})
# K = V pairs, from less to more error: each group's worst below the next group's best
ERROR_ORDER = [("f16",), ("bf16",), ("q8_0",), ("q5_0", "q5_1"), ("q4_0", "q4_1", "iq4_nl", "tq4"), ("tq3",)]


def _pair_tolerance(k: str, v: str) -> tuple[float, float, int]:
    tk, tv = TOLERANCE[k], TOLERANCE[v]
    return max(tk[0], tv[0]), max(tk[1], tv[1]), min(tk[2], tv[2])


@pytest.fixture(scope="module")
def gguf_path():
    return tiny_vocab_model_path(n_layer=8, n_head=4, n_head_kv=1)


def _run(path, type_k: str, type_v: str) -> tuple[np.ndarray, list[int], dict]:
    """Logits of PROMPT (all positions), the greedy continuation and kv_cache_info(), with the
    given cache types."""
    with Model(path, n_ctx=N_CTX, n_threads=N_THREADS, type_k=type_k, type_v=type_v) as m:
        info = m.kv_cache_info()
        logits = m.logits(PROMPT)
        last, greedy = logits[-1], []
        for _ in range(N_GEN):
            greedy.append(int(last.argmax()))
            last = m.eval([greedy[-1]])[-1]
        generated = m.generate(PROMPT, max_tokens=N_GEN, temperature=0).tokens  # may stop early at EOG
    assert generated == greedy[:len(generated)], f"{type_k}/{type_v}: generate() {generated} vs eval loop {greedy}"
    return logits, greedy, info


@pytest.fixture(scope="module")
def runs(gguf_path):
    """_run per pair, each pair run once for the module (the pair tests and the ordering share them)."""
    return functools.cache(lambda k, v: _run(gguf_path, k, v))


@pytest.fixture(scope="module")
def reference(runs):
    """(f32-cache logits, f16-cache greedy tokens)."""
    return runs("f32", "f32")[0], runs("f16", "f16")[1]


def _gguf_int(reader: GGUFReader, key: str) -> int:
    field = reader.fields[key]
    return int(field.parts[field.data[0]][0])


@functools.cache
def _expected_state(path) -> dict:
    """What the engine must allocate, from the GGUF's own metadata (read with gguf-py, not with
    deltaspec's reader): attention layers, K / V row widths, conv and DeltaNet state sizes."""
    r = GGUFReader(path)
    n_layer = _gguf_int(r, "qwen35.block_count")
    interval = _gguf_int(r, "qwen35.full_attention_interval")
    n_head_kv = _gguf_int(r, "qwen35.attention.head_count_kv")
    s, n_k, n_v = (_gguf_int(r, f"qwen35.ssm.{k}") for k in ("state_size", "group_count", "time_step_rank"))
    d_inner, kernel = _gguf_int(r, "qwen35.ssm.inner_size"), _gguf_int(r, "qwen35.ssm.conv_kernel")
    return {"attention": [il for il in range(n_layer) if (il + 1) % interval == 0],
            "recurrent": [il for il in range(n_layer) if (il + 1) % interval != 0],
            "k_width": n_head_kv * _gguf_int(r, "qwen35.attention.key_length"),
            "v_width": n_head_kv * _gguf_int(r, "qwen35.attention.value_length"),
            "head_dim": _gguf_int(r, "qwen35.attention.key_length"),
            "conv_bytes": 4 * (kernel - 1) * (d_inner + 2 * n_k * s), "ssm_bytes": 4 * s * s * n_v}


def _row_bytes(type_name: str, width: int, head_dim: int) -> int:
    if type_name in TQ_CACHE_TYPES:  # per head: an fp16 scale and head_dim indices of 3 or 4 bits
        return width // head_dim * (2 + head_dim * TQ_CACHE_TYPES[type_name] // 8)
    blck, size = GGML_QUANT_SIZES[CACHE_TYPES[ROTATED_CACHE_TYPES.get(type_name, type_name)]]
    assert width % blck == 0
    return width // blck * size


def check_allocated(path, info: dict, type_k: str, type_v: str, buffer: str = "CPU") -> None:
    """kv_cache_info() holds the asked-for types at every attention layer, in the bytes they take,
    in device buffers whose names start with `buffer` ("CUDA" for CUDA0, ...)."""
    want = _expected_state(path)
    pair = f"{type_k}/{type_v}"
    assert info["n_ctx"] == N_CTX
    assert [a["layer"] for a in info["attention_layers"]] == want["attention"], pair
    assert [r["layer"] for r in info["recurrent_layers"]] == want["recurrent"], pair
    k_bytes = N_CTX * _row_bytes(type_k, want["k_width"], want["head_dim"])
    v_bytes = N_CTX * _row_bytes(type_v, want["v_width"], want["head_dim"])
    for a in info["attention_layers"]:
        assert (a["type_k"], a["type_v"]) == (type_k, type_v), f"{pair}: layer {a['layer']} allocated {a}"
        assert (a["k_bytes"], a["v_bytes"]) == (k_bytes, v_bytes), f"{pair}: layer {a['layer']} allocated {a}"
        assert a["buffer"].startswith(buffer), f"{pair}: layer {a['layer']} in buffer {a['buffer']}"
    for r in info["recurrent_layers"]:
        assert (r["conv_type"], r["ssm_type"], r["conv_bytes"], r["ssm_bytes"]) == (
            "f32", "f32", want["conv_bytes"], want["ssm_bytes"]), f"{pair}: layer {r['layer']} allocated {r}"
        assert r["buffer"].startswith(buffer), f"{pair}: layer {r['layer']} in buffer {r['buffer']}"
    n_attn, n_rec = len(want["attention"]), len(want["recurrent"])
    assert (info["k_bytes"], info["v_bytes"]) == (n_attn * k_bytes, n_attn * v_bytes)
    assert info["kv_bytes"] == info["k_bytes"] + info["v_bytes"]
    assert info["recurrent_bytes"] == n_rec * (want["conv_bytes"] + want["ssm_bytes"])
    assert info["total_bytes"] == info["kv_bytes"] + info["recurrent_bytes"]


def rms_error(logits: np.ndarray, ref_logits: np.ndarray) -> float:
    return float(np.sqrt(np.mean((logits - ref_logits) ** 2)) / ref_logits.std())


def check_lossy(logits: np.ndarray, ref_logits: np.ndarray, type_k: str, type_v: str) -> None:
    """A cache narrower than F32 must show its rounding; f32/f32 must be exact."""
    if (type_k, type_v) == ("f32", "f32"):
        assert np.array_equal(logits, ref_logits), "f32/f32: logits differ from the f32 cache's"
        return
    floor = max(ERROR_FLOOR[type_k], ERROR_FLOOR[type_v])
    err = rms_error(logits, ref_logits)
    assert err >= floor, (f"{type_k}/{type_v}: rms diff {err:.3g} of the logit std, below the {floor:.3g} its "
                          "types must lose: is the cache really of these types?")


def check_order(runs) -> None:
    ref = runs("f32", "f32")[0]
    err = {t: rms_error(runs(t, t)[0], ref) for group in ERROR_ORDER for t in group}
    for lo, hi in zip(ERROR_ORDER, ERROR_ORDER[1:]):
        assert max(err[t] for t in lo) < min(err[t] for t in hi), f"rms errors out of order: {err}"


def test_every_cpu_pair_is_tested():
    plain = [t for t in KV_CACHE_TYPES if t not in ROTATED_CACHE_TYPES]
    assert set(itertools.product(plain, plain)) <= set(CPU_PAIRS)
    assert {k for k, _ in CPU_PAIRS} == {v for _, v in CPU_PAIRS} == set(KV_CACHE_TYPES)


@pytest.mark.parametrize("type_k,type_v", CPU_PAIRS, ids=lambda t: t)
def test_cache_type_matches_f32_cache(gguf_path, runs, reference, type_k, type_v):
    ref_logits, f16_greedy = reference
    logits, greedy, info = runs(type_k, type_v)
    check_allocated(gguf_path, info, type_k, type_v)
    check_lossy(logits, ref_logits, type_k, type_v)
    std = float(ref_logits.std())
    diff = np.abs(logits - ref_logits)
    max_rel = float(diff.max()) / std
    rms_rel = float(np.sqrt(np.mean(diff ** 2))) / std
    tol_max, tol_rms, n_greedy = _pair_tolerance(type_k, type_v)
    assert max_rel <= tol_max, f"{type_k}/{type_v}: max |diff| {max_rel:.3g} of the logit std (tolerance {tol_max})"
    assert rms_rel <= tol_rms, f"{type_k}/{type_v}: rms diff {rms_rel:.3g} of the logit std (tolerance {tol_rms})"
    assert greedy[:n_greedy] == f16_greedy[:n_greedy], (
        f"{type_k}/{type_v}: greedy {greedy} vs f16 cache {f16_greedy} (first {n_greedy} must agree)")


def test_error_grows_as_the_type_narrows(runs):
    check_order(runs)


@pytest.mark.parametrize("type_k,type_v", [("q5_1", "iq4_nl"), ("tq3", "q4_0+rot")])
def test_cache_types_survive_speculation(gguf_path, type_k, type_v):
    """Speculation keeps the asked-for cache types (tq and rotated ones too) and allocates nothing
    beyond the KV cache and the recurrent state: the scheduler's verify keeps the accepted path from
    the pass's own inputs (Engine::keep_paths), never from a saved copy of the state."""
    kw = dict(n_ctx=N_CTX, n_threads=N_THREADS, type_k=type_k, type_v=type_v)
    with Model(gguf_path, **kw) as m, Model(gguf_path, **kw) as draft:
        out = m.generate(PROMPT, max_tokens=N_GEN, temperature=0, draft_model=draft, draft_n_min=1)
        assert out.stats.n_drafted > 0
        info = m.kv_cache_info()
    want = _expected_state(gguf_path)
    assert {(a["type_k"], a["type_v"]) for a in info["attention_layers"]} == {(type_k, type_v)}
    assert info["kv_bytes"] == len(want["attention"]) * N_CTX * (
        _row_bytes(type_k, want["k_width"], want["head_dim"]) + _row_bytes(type_v, want["v_width"], want["head_dim"]))
    assert info["total_bytes"] == info["kv_bytes"] + info["recurrent_bytes"] > info["kv_bytes"]


def test_planted_all_f32_cache_is_caught(gguf_path, reference, monkeypatch):
    """The planted bug (DELTASPEC_TEST_FORCE_KV_F32=1: every cache allocated F32) passes the
    closeness checks, as it passed the old pair tests, and fails each new one."""
    ref_logits, _ = reference
    monkeypatch.setenv("DELTASPEC_TEST_FORCE_KV_F32", "1")
    forced = functools.cache(lambda k, v: _run(gguf_path, k, v))
    for type_k, type_v in [("q8_0", "q4_0"), ("f16", "f16"), ("f32", "iq4_nl"), ("bf16", "q5_1"), ("tq3", "tq4"),
                           ("tq4", "f16"), ("q4_0+rot", "q8_0+rot")]:
        logits, _, info = forced(type_k, type_v)
        assert np.array_equal(logits, ref_logits)  # the bug took effect: an F32 cache, exactly
        with pytest.raises(AssertionError, match=re.escape(f"{type_k}/{type_v}: layer 3 allocated")):
            check_allocated(gguf_path, info, type_k, type_v)
        with pytest.raises(AssertionError, match="below the"):
            check_lossy(logits, ref_logits, type_k, type_v)
    with pytest.raises(AssertionError, match="out of order"):
        check_order(forced)


# --- the table: sizes --------------------------------------------------------------------------------

def _hparams(n_layer: int, n_head_kv: int, head_dim: int, interval: int = 4) -> Qwen35HParams:
    """Only the fields kv_cache reads matter; layers (i+1) % interval == 0 are full attention."""
    hp = Qwen35HParams()
    hp.n_layer, hp.n_head, hp.n_head_kv, hp.head_dim = n_layer, n_head_kv, n_head_kv, head_dim
    hp.recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]
    return hp


QWEN35_27B = _hparams(64, 4, 256)   # 16 attention layers, K or V row per layer = 4*256 = 1024 elements
QWEN35_08B = _hparams(24, 2, 256)   # 6 attention layers, 512 elements
TINY_ATTN2 = _hparams(8, 1, 32)     # tiny attn2_d32_untied: 2 attention layers, 32 elements


@pytest.mark.parametrize("hp,type_k,type_v,expected", [
    # 27B, by hand: 16 layers * 1024 elements * bytes/element, once for K and once for V
    (QWEN35_27B, "f16", "f16", 64 * 1024),               # 16*1024*2*2
    (QWEN35_27B, "f32", "f32", 128 * 1024),              # 16*1024*4*2
    (QWEN35_27B, "bf16", "bf16", 64 * 1024),
    (QWEN35_27B, "q8_0", "q8_0", 34 * 1024),             # 1024/32 blocks * 34 B = 1088 per layer
    (QWEN35_27B, "q4_0", "q4_0", 18 * 1024),             # 32 blocks * 18 B = 576
    (QWEN35_27B, "iq4_nl", "iq4_nl", 18 * 1024),         # same block layout as q4_0
    (QWEN35_27B, "q4_1", "q4_1", 20 * 1024),             # 32 * 20 = 640
    (QWEN35_27B, "q5_0", "q5_0", 22 * 1024),             # 32 * 22 = 704
    (QWEN35_27B, "q5_1", "q5_1", 24 * 1024),             # 32 * 24 = 768
    (QWEN35_27B, "q8_0", "q4_0", 16 * (1088 + 576)),     # 26 KiB
    (QWEN35_27B, "f16", "q8_0", 16 * (2048 + 1088)),     # 49 KiB
    (QWEN35_08B, "f16", "f16", 6 * 512 * 2 * 2),         # 12 KiB
    (TINY_ATTN2, "f16", "f16", 2 * 32 * 2 * 2),          # 256 B
    (TINY_ATTN2, "q8_0", "f32", 2 * (34 + 128)),
    # tq: per head an fp16 scale + 3 or 4 bits per value: 27B tq3 = 16 layers * 4 heads * (2 + 96) B
    (QWEN35_27B, "tq3", "tq3", 16 * 4 * 98 * 2),         # 12544 B: 0.68x q4_0's 18432
    (QWEN35_27B, "tq4", "tq4", 16 * 4 * 130 * 2),        # 16640 B
    (QWEN35_27B, "tq3", "q8_0", 16 * (4 * 98 + 1088)),
    (TINY_ATTN2, "tq3", "tq4", 2 * ((2 + 12) + (2 + 16))),
    (QWEN35_27B, "q4_0+rot", "q8_0+rot", 16 * (576 + 1088)),  # a rotated type takes its type's bytes
])
def test_kv_bytes_per_token(hp, type_k, type_v, expected):
    assert kv_bytes_per_token(hp, type_k, type_v) == expected


def test_kv_cache_bytes_scales_with_context():
    assert kv_cache_bytes(QWEN35_27B, 4096) == 4096 * 64 * 1024  # 256 MiB at the f16 default


@pytest.mark.parametrize("name,blck,bpe,type_id", [
    ("f32", 1, 4.0, 0), ("f16", 1, 2.0, 1), ("bf16", 1, 2.0, 30), ("q8_0", 32, 34 / 32, 8),
    ("q4_0", 32, 18 / 32, 2), ("q4_1", 32, 20 / 32, 3), ("q5_0", 32, 22 / 32, 6), ("q5_1", 32, 24 / 32, 7),
    ("iq4_nl", 32, 18 / 32, 20),
])
def test_type_table(name, blck, bpe, type_id):
    assert block_size(name) == blck
    assert bytes_per_element(name) == pytest.approx(bpe)
    assert int(ggml_type(name)) == type_id


@pytest.mark.parametrize("name,head_dim,bpe", [("tq3", 256, 98 / 256), ("tq4", 256, 130 / 256), ("tq3", 64, 26 / 64),
                                                ("tq4", 32, 18 / 32)])
def test_tq_type_table(name, head_dim, bpe):
    assert block_size(name, head_dim) == head_dim  # one block = one head vector (one scale)
    assert bytes_per_element(name, head_dim) == pytest.approx(bpe)
    with pytest.raises(ValueError, match="not a ggml type"):
        ggml_type(name)


# --- the table: devices and validation ------------------------------------------------------------

def test_supported_pairs():
    assert len(supported_pairs("cpu")) == 17 * 17  # 9 ggml types, tq3, tq4, 6 rotated
    cuda = supported_pairs("cuda")
    assert len(cuda) == 15 * 15 and not any(t.startswith("iq4_nl") for p in cuda for t in p)
    assert CUDA_VEC_PAIRS_DEFAULT <= cuda
    # ggml-cuda has no flash attention for iq4_nl, plain or rotated; the tq types passed their H200 tests
    assert set(supported_types("cuda")) == {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "tq3", "tq4",
                                             "q8_0+rot", "q4_0+rot", "q4_1+rot", "q5_0+rot", "q5_1+rot"}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_validate_accepts_supported(device):
    for k, v in supported_pairs(device):
        validate_cache_types(k, v, device, head_dim=256)


@pytest.mark.parametrize("args,message", [
    (("q8", "f16", "cpu"), r"type_k='q8' is not a KV cache type \(supported: f32, f16, bf16, q8_0, q4_0, "
                           r"q4_1, iq4_nl, q5_0, q5_1, tq3, tq4, q8_0\+rot, q4_0\+rot, q4_1\+rot, iq4_nl\+rot, "
                           r"q5_0\+rot, q5_1\+rot\)"),
    (("f16", "Q8_0", "cpu"), r"type_v='Q8_0' is not a KV cache type"),
    (("f16", None, "cpu"), r"type_v=None is not a KV cache type"),
    (("f16", "iq4_nl", "cuda"), r"type_v='iq4_nl' is not supported on cuda \(supported on cuda: f32, f16, bf16, "
                                r"q8_0, q4_0, q4_1, q5_0, q5_1, tq3, tq4, q8_0\+rot, q4_0\+rot, q4_1\+rot, "
                                r"q5_0\+rot, q5_1\+rot\)"),
    (("iq4_nl+rot", "f16", "cuda"), r"type_k='iq4_nl\+rot' is not supported on cuda"),
    (("iq4_nl", "f16", "cuda"), r"type_k='iq4_nl' is not supported on cuda"),
    (("f16", "f16", "metal"), r"device must be 'cpu', 'cuda' or 'cuda:N' \(N: a GPU index, 0 the first\), got 'metal'"),
    (("q8_0", "f16", "cpu", 48), r"type_k='q8_0': its block of 32 elements does not divide the head dim 48 "
                                 r"\(types that fit: f32, f16, bf16\)"),
    (("f16", "q4_1", "cpu", 80), r"type_v='q4_1': its block of 32 elements does not divide the head dim 80"),
    (("tq3", "f16", "cpu", 96), r"type_k='tq3': the head dim must be one of \(32, 64, 128, 256\) \(rotated as a "
                                r"whole\), got 96"),
    (("f16", "tq4", "cpu", 512), r"type_v='tq4': the head dim must be one of"),
    (("q4_0+rot", "f16", "cpu", 96), r"type_k='q4_0\+rot': the head dim must be one of"),
])
def test_validate_errors(args, message):
    with pytest.raises(ValueError, match=message):
        validate_cache_types(*args)


def test_validate_block_size_only_checked_with_head_dim():
    validate_cache_types("q8_0", "q4_0", "cpu")            # head_dim unknown: not checked
    validate_cache_types("f16", "bf16", "cpu", head_dim=48)  # float types have blocks of 1


def test_kv_bytes_per_token_rejects_partial_blocks():
    with pytest.raises(ValueError, match=r"type_v='q4_0': its block of 32 elements does not divide the head dim 48"):
        kv_bytes_per_token(_hparams(4, 1, 48), "f16", "q4_0")
    with pytest.raises(ValueError, match=r"type_k='fp8'"):
        kv_bytes_per_token(QWEN35_27B, "fp8", "f16")
