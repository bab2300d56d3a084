"""RoPE scaling (qwen35.rope.scaling.*): linear and YaRN against transformers, and the loader's
handling of every scaling key (what it derives, what it rejects)."""

import copy
import math

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.errors import HyperParameterError
from deltaspec.gguf_file import read_gguf
from deltaspec.qwen35 import read_hparams
from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

PROMPT_LEN = 83
TOL = 1e-3  # max |logit difference|, f32 weights and KV cache (as test_parity_transformers)


def _hf_logits(model, ids, rope_parameters=None):
    """transformers' logits, optionally with the rotary embedding rebuilt for other rope parameters."""
    import torch

    if rope_parameters is not None:
        model = copy.deepcopy(model)
        cfg = copy.deepcopy(model.config)
        cfg.rope_parameters = rope_parameters
        model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", ["rope_linear", "rope_yarn", "rope_yarn_tuned"])
def test_scaled_rope_matches_transformers(tmp_path, name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from deltaspec.convert import convert_hf_to_gguf
    from deltaspec.testing.tiny_models import ROPE_SCALING_CONFIGS, tiny_model_dir

    hf_dir = tiny_model_dir(name)
    path = convert_hf_to_gguf(hf_dir, tmp_path / f"{name}.gguf", outtype="f32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = np.random.default_rng(7).integers(0, 248000, PROMPT_LEN).tolist()
    ref = _hf_logits(hf, ids)
    with Model(path, n_ctx=256, n_ubatch=16, type_k="f32", type_v="f32") as m:
        assert m.hparams.rope_scaling.kind == ROPE_SCALING_CONFIGS[name]["rope_parameters"]["rope_type"]
        got = m.logits(ids)
        m.reset()  # prefill then single-token decode: positions come from the KV cache's rows too
        stepped = np.concatenate([m.eval(ids[:40], logits="all")] + [m.eval([t], logits="all") for t in ids[40:]])
    for what, ours in (("prefill", got), ("decode", stepped)):
        diff = np.abs(ours - ref).max()
        assert diff <= TOL, f"{name} {what}: max |logit diff| {diff:.3g} > {TOL}"
    # the scaling matters at these positions: unscaled RoPE (and, for the tuned YaRN, YaRN with the
    # default betas and attention factor, which the pinned llama.cpp would use) is far off
    rope = ROPE_SCALING_CONFIGS[name]["rope_parameters"]
    plain = {k: v for k, v in rope.items() if k in ("rope_theta", "partial_rotary_factor", "mrope_section",
                                                     "mrope_interleaved")} | {"rope_type": "default"}
    others = [plain]
    if name == "rope_yarn_tuned":
        others.append({k: v for k, v in rope.items() if k not in ("beta_fast", "beta_slow", "attention_factor")})
    for other in others:
        assert np.abs(_hf_logits(hf, ids, other) - ref).max() > 50 * TOL, other


def _hparams(tmp_path, **metadata):
    path = write_tiny_vocab_model(tmp_path / "m.gguf", metadata=metadata)
    return path, read_hparams(read_gguf(path))


def test_no_scaling_keys_is_plain_rope(tmp_path):
    _, hp = _hparams(tmp_path)
    rs = hp.rope_scaling
    assert (rs.kind, rs.freq_scale, rs.ext_factor, rs.attn_factor, rs.n_ctx_orig) == ("none", 1.0, 0.0, 1.0, 4096)


@pytest.mark.parametrize("metadata,expected", [
    # llama.cpp: a factor without a type is linear scaling; the old rope.scale_linear key counts too
    ({"rope.scaling.factor": 4.0}, ("linear", 0.25, 0.0, 1.0)),
    ({"rope.scale_linear": 2.0}, ("linear", 0.5, 0.0, 1.0)),
    ({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}, ("none", 1.0, 0.0, 1.0)),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 1.0}, ("linear", 1.0, 0.0, 1.0)),
    # YaRN: ggml multiplies 1 + 0.1 ln(4) into attn_factor itself; the default total is exactly that
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, ("yarn", 0.25, 1.0, 1.0)),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_attn_factor": 1.5},
     ("yarn", 0.25, 1.0, 1.5 / (1 + 0.1 * math.log(4.0)))),
])
def test_scaling_keys_become_ggml_parameters(tmp_path, metadata, expected):
    _, hp = _hparams(tmp_path, **metadata)
    rs = hp.rope_scaling
    assert (rs.kind, rs.freq_scale, rs.ext_factor) == expected[:3]
    assert rs.attn_factor == pytest.approx(expected[3], rel=1e-6)


def test_yarn_reads_its_context_and_betas(tmp_path):
    _, hp = _hparams(tmp_path, **{"rope.scaling.type": "yarn", "rope.scaling.factor": 8.0,
                                  "rope.scaling.original_context_length": 1024, "rope.scaling.yarn_beta_fast": 16.0,
                                  "rope.scaling.yarn_beta_slow": 2.0})
    rs = hp.rope_scaling
    assert (rs.n_ctx_orig, rs.beta_fast, rs.beta_slow) == (1024, 16.0, 2.0)


def test_linear_scaling_changes_the_logits(tmp_path):
    """The parameters reach the graph: the same weights give other logits with scaling on, and the
    same ones with scaling written but switched off (type none)."""
    ids = np.random.default_rng(1).integers(0, 265, 60).tolist()
    logits = {}
    for tag, metadata in (("plain", {}), ("linear", {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}),
                          ("none", {"rope.scaling.type": "none", "rope.scaling.factor": 4.0})):
        with Model(write_tiny_vocab_model(tmp_path / f"{tag}.gguf", metadata=metadata), n_ctx=256) as m:
            logits[tag] = m.logits(ids)
    np.testing.assert_array_equal(logits["none"], logits["plain"])
    assert np.abs(logits["linear"] - logits["plain"]).max() > 0.1


@pytest.mark.parametrize("metadata,key,value", [
    ({"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0}, "rope.scaling.type", "'longrope'"),
    ({"rope.scaling.type": 3}, "rope.scaling.type", "string"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": -2.0}, "rope.scaling.factor", "-2.0"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": float("nan")}, "rope.scaling.factor", "nan"),
    ({"rope.scaling.attn_factor": 2.0}, "rope.scaling.attn_factor", "2.0"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_ext_factor": 0.5},
     "rope.scaling.yarn_ext_factor", "0.5"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_log_multiplier": 0.1},
     "rope.scaling.yarn_log_multiplier", "0.1"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_beta_fast": 0.0},
     "rope.scaling.yarn_beta_fast", "0.0"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 0},
     "rope.scaling.original_context_length", "0"),
])
def test_unsupported_scaling_is_rejected_at_load(tmp_path, metadata, key, value):
    path = write_tiny_vocab_model(tmp_path / "m.gguf", metadata=metadata)
    with pytest.raises(HyperParameterError) as info:
        Model(path, n_ctx=64)
    message = str(info.value)
    assert str(path) in message and f"qwen35.{key}" in message and value in message, message
