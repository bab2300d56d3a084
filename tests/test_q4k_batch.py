"""Q4_K weights with multi-token batches, and what keeps ggml's AMX hazard away.

ggml's AMX matmul segfaulted for Q4_K weights when a batch had more than one token (llama.cpp built
with -march=native on a CPU with AMX). ggml takes that path only for weights placed in its AMX
buffer type; the engine puts weights in the plain CPU buffer, and the build compiles AMX out (also
with DELTASPEC_NATIVE=ON). `test_weights_avoid_amx` checks both directly. The machine these tests
were written on has no AMX, so the crash itself was never reproduced here.

`test_q4k_multi_token_batches` checks Q4_K correctness for batches of 64, 36, 7 and 1 tokens
against the same weights dequantized to F32 by gguf-py (an independent dequantizer, which agrees
bit for bit with ggml's own).
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize

from deltaspec import Model, _core
from deltaspec.qwen35 import mrope_sections
from deltaspec.qwen_vocab import gguf_tokenizer_metadata

E, L, H, HKV, D, FF = 256, 4, 4, 2, 64, 512
S, HK, HV, KC = 64, 2, 4, 4
C = (2 * HK + HV) * S


def _weights(rng) -> dict[str, np.ndarray]:
    """name -> float32 array in numpy (row-major, ggml shape reversed) order."""
    w = {"token_embd.weight": rng.standard_normal((248320, E)) * 0.5, "output_norm.weight": np.ones(E)}
    for i in range(L):
        b = f"blk.{i}."
        w |= {b + "attn_norm.weight": np.ones(E), b + "post_attention_norm.weight": np.ones(E),
              b + "ffn_gate.weight": rng.standard_normal((FF, E)) / 16, b + "ffn_up.weight": rng.standard_normal((FF, E)) / 16,
              b + "ffn_down.weight": rng.standard_normal((E, FF)) / 22}
        if (i + 1) % 4:
            w |= {b + "attn_qkv.weight": rng.standard_normal((C, E)) / 16,
                  b + "attn_gate.weight": rng.standard_normal((HV * S, E)) / 16,
                  b + "ssm_beta.weight": rng.standard_normal((HV, E)) / 16,
                  b + "ssm_alpha.weight": rng.standard_normal((HV, E)) / 16,
                  b + "ssm_dt.bias": rng.standard_normal(HV), b + "ssm_a": -np.exp(rng.standard_normal(HV) * 0.5),
                  b + "ssm_conv1d.weight": rng.standard_normal((C, KC)) / 2, b + "ssm_norm.weight": np.ones(S),
                  b + "ssm_out.weight": rng.standard_normal((E, HV * S)) / 16}
        else:
            w |= {b + "attn_q.weight": rng.standard_normal((2 * H * D, E)) / 16,
                  b + "attn_k.weight": rng.standard_normal((HKV * D, E)) / 16,
                  b + "attn_v.weight": rng.standard_normal((HKV * D, E)) / 16,
                  b + "attn_output.weight": rng.standard_normal((E, H * D)) / 16,
                  b + "attn_q_norm.weight": np.ones(D), b + "attn_k_norm.weight": np.ones(D)}
    return {k: v.astype(np.float32) for k, v in w.items()}


def _write(path, weights: dict[str, np.ndarray], quantized: bool) -> None:
    w = GGUFWriter(str(path), "qwen35")
    for key, value in {"context_length": 4096, "embedding_length": E, "block_count": L, "feed_forward_length": FF,
                       "attention.head_count": H, "attention.head_count_kv": HKV, "attention.key_length": D,
                       "attention.value_length": D, "rope.dimension_count": D // 4, "full_attention_interval": 4,
                       "ssm.conv_kernel": KC, "ssm.state_size": S, "ssm.group_count": HK, "ssm.time_step_rank": HV,
                       "ssm.inner_size": HV * S}.items():
        w.add_uint32(f"qwen35.{key}", value)
    w.add_float32("qwen35.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("qwen35.rope.freq_base", 1e7)
    w.add_array("qwen35.rope.dimension_sections", mrope_sections(D // 8))
    tok = gguf_tokenizer_metadata()
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])
    for name, x in weights.items():
        if quantized and x.ndim == 2 and "conv1d" not in name:
            w.add_tensor(name, _core.quantize(x, int(T.Q4_K)), raw_dtype=T.Q4_K)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("q4k")
    weights = _weights(np.random.default_rng(3))
    _write(root / "q4k.gguf", weights, quantized=True)
    # the reference holds exactly the values the Q4_K blocks encode, dequantized by gguf-py
    reference = {k: (dequantize(_core.quantize(x, int(T.Q4_K)), T.Q4_K).reshape(x.shape)
                     if x.ndim == 2 and "conv1d" not in k else x) for k, x in weights.items()}
    _write(root / "f32.gguf", reference, quantized=False)
    with Model(root / "q4k.gguf", n_ctx=256, n_ubatch=64) as q4k, Model(root / "f32.gguf", n_ctx=256) as f32:
        yield q4k, f32


def test_q4k_multi_token_batches(models):
    q4k, f32 = models
    ids = np.random.default_rng(0).integers(0, 248000, size=100).tolist()
    batched = q4k.logits(ids)                    # micro-batches of 64 and 36 tokens
    q4k.reset()
    rows = [q4k.eval(ids[:7], logits="all")] + [q4k.eval([t], logits="all") for t in ids[7:]]
    stepped = np.concatenate(rows)
    ref = f32.logits(ids)
    scale = ref.std()
    assert scale > 0.5
    # ggml quantizes activations to Q8_K for Q4_K matmuls (and picks other kernels for batches),
    # so neither path equals the F32 reference exactly. Measured on this model: RMS error 6% of
    # the logit std and 85% argmax agreement for both paths; a wrong kernel gives noise (100%).
    for name, got in (("batched", batched), ("stepped", stepped)):
        rms = np.sqrt(((got - ref) ** 2).mean()) / scale
        assert rms < 0.1, f"{name}: Q4_K vs dequantized F32 RMS error {rms:.3g} of the logit std"
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
    assert np.sqrt(((batched - stepped) ** 2).mean()) / scale < 0.1


def test_weights_avoid_amx(models):
    q4k, f32 = models
    # the mechanism: ggml-cpu's extra (AMX, repacking) matmuls only serve weights in those buffer types
    for model in (q4k, f32):
        assert model._engine.weight_buffer_types == ["CPU"]
    # and the build: AMX is neither compiled in (even -march=native builds) nor offered as a buffer
    assert not {"AMX_INT8", "AMX_TILE", "AMX_BF16"} & set(_core.cpu_features())
    assert "AMX" not in _core.cpu_extra_buffer_types()
