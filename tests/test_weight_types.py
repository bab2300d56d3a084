"""Every weight type ggml quantizes to without an importance matrix loads and computes right.

For each type a tiny-vocabulary model's matrices are quantized with ggml's quantizer and the
logits are compared (prefill in micro-batches, then single-token decode) with two F32 models:

- the same weights dequantized by gguf-py (an independent implementation): the tight check. What
  is left is ggml converting activations for the matmul (to F16 / BF16, or to Q8_0 / Q8_K blocks),
  so a wrong block layout or kernel shows as noise (RMS error ~1.4 logit std), far above the bound;
- the original float weights: a loose bound on the quantization error itself.

Bounds are relative RMS errors (RMS of the difference / std of the reference logits, 2.5 here),
about 1.5-2x what was measured on an AVX2 build (stated per type below).
"""

import numpy as np
import pytest
from gguf.quants import dequantize

from deltaspec import Model, _core
from deltaspec.gguf_file import read_gguf
from deltaspec.testing.tiny_vocab import QUANT_TYPES, quantizable, write_tiny_vocab_model

# Every matrix row a whole number of 256-value k-quant blocks: E = n_ff/2 = H*D = Hv*S = 256.
SHAPE = dict(n_embd=256, n_ff=512, n_head=4, ssm_v_heads=4, ssm_state=64)
N_PREFILL, N_DECODE = 72, 8  # prefill in micro-batches of 32, 32 and 8

# type: (bound vs dequantized, bound vs original F32); measured in comments
BOUNDS = {
    "f16": (0.002, 0.003),    # 0.0007, 0.0011
    "bf16": (0.012, 0.015),   # 0.0053, 0.0085
    "q8_0": (0.04, 0.05),     # 0.022, 0.030
    "q4_0": (0.04, 0.5),      # 0.022, 0.34
    "q4_1": (0.04, 0.45),     # 0.022, 0.30
    "q5_0": (0.04, 0.25),     # 0.021, 0.17
    "q5_1": (0.04, 0.25),     # 0.021, 0.16
    "q2_k": (0.06, 1.2),      # 0.036, 0.88 (2-bit weights of a random model: barely correlated)
    "q3_k": (0.06, 0.8),      # 0.034, 0.55
    "q4_k": (0.06, 0.45),     # 0.034, 0.30
    "q5_k": (0.06, 0.25),     # 0.034, 0.15
    "q6_k": (0.06, 0.12),     # 0.033, 0.078
}


def _logits(path, ids: list[int]) -> np.ndarray:
    with Model(path, n_ctx=256, n_ubatch=32, n_threads=2) as m:
        rows = [m.eval(ids[:N_PREFILL], logits="all")]
        rows += [m.eval([t], logits="all") for t in ids[N_PREFILL:]]
    return np.concatenate(rows)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight-types")
    ids = np.random.default_rng(0).integers(0, 265, N_PREFILL + N_DECODE).tolist()
    return root, ids, _logits(write_tiny_vocab_model(root / "f32.gguf", **SHAPE), ids)


def test_every_type_is_covered():
    assert set(BOUNDS) == set(QUANT_TYPES)


@pytest.mark.parametrize("quant", sorted(BOUNDS))
def test_weight_type_matches_dequantized_reference(setup, quant):
    root, ids, original = setup
    qtype = QUANT_TYPES[quant]

    def round_trip(name, x):
        if not quantizable(name, x, qtype):
            return x
        return dequantize(_core.quantize(np.ascontiguousarray(x), int(qtype)), qtype).reshape(x.shape)

    path = write_tiny_vocab_model(root / f"{quant}.gguf", quant=quant, **SHAPE)
    matrices = {name: t.type for name, t in read_gguf(path).tensors.items()
                if len(t.shape) == 2 and not name.endswith("ssm_conv1d.weight")}
    assert set(matrices.values()) == {qtype}, matrices  # every matrix, attention and DeltaNet, in the type
    got = _logits(path, ids)
    dequantized = _logits(write_tiny_vocab_model(root / f"{quant}-deq.gguf", weight_map=round_trip, **SHAPE), ids)
    scale = original.std()

    def rel_rms(a, b):
        return float(np.sqrt(((a - b) ** 2).mean()) / scale)

    bound_deq, bound_f32 = BOUNDS[quant]
    assert rel_rms(got, dequantized) <= bound_deq, f"{quant} vs dequantized: {rel_rms(got, dequantized):.4f}"
    assert rel_rms(got, original) <= bound_f32, f"{quant} vs original F32: {rel_rms(got, original):.4f}"
