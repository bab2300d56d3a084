"""deltaspec.convert against llama.cpp's own convert_hf_to_gguf.py, on tiny random Qwen3.5 checkpoints.

The equivalence test compares every metadata key (type and value), every tensor (name, order,
shape, ggml type, bytes) and finally the whole file. No key is excluded: the general.* keys come
from the same gguf heuristics (folder name, generation_config.json) in both converters. Should one
ever have to be skipped, put it in NOT_COMPARED with the reason.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from gguf import GGUFWriter  # noqa: E402

from deltaspec import convert as C  # noqa: E402
from deltaspec.errors import ConversionError, DeltaspecError  # noqa: E402
from deltaspec.testing.tiny_models import MTP_CONFIGS, TINY_CONFIGS, check_not_flat, probe_logits, tiny_model_dir  # noqa: E402
from gguf_compare import assert_same_gguf, read_gguf_view  # noqa: E402
from upstream import llama_cpp_tree, run_reference_converter  # noqa: E402

NOT_COMPARED: dict[str, str] = {}  # metadata key -> why it may differ (none today)

# Each config with at least one outtype; every outtype at least once; the realistic bf16 -> q8_0.
CASES = [
    ("gdn_hk2_hv4_tied", "f32"),
    ("gdn_hk2_hv4_tied", "q8_0"),
    ("attn2_d32_untied", "f16"),
    ("mixed_s128_bf16", "bf16"),
    ("mixed_s128_bf16", "q8_0"),
]
# A checkpoint with an MTP layer: kept (llama.cpp's default) and dropped (its --no-mtp, our mtp=False).
MTP_CASES = [("mtp_attn2_untied", "f32", True), ("mtp_attn2_untied", "q8_0", False)]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """Each tiny model (cached build) seen through a scratch folder that adds the Qwen3.5 chat
    template from the llama.cpp tree; big files are symlinked, not copied."""
    template = (llama_cpp_tree() / "models" / "templates" / "Qwen3.5-4B.jinja").read_text(encoding="utf-8")
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for name in [*TINY_CONFIGS, *MTP_CONFIGS]:
        src = tiny_model_dir(name)
        dst = root / name
        dst.mkdir()
        for f in src.iterdir():
            if f.name != "chat_template.jinja":
                (dst / f.name).symlink_to(f)
        (dst / "chat_template.jinja").write_text(template, encoding="utf-8")
        dirs[name] = dst
    return dirs


@pytest.fixture(scope="module")
def reference(hf_dirs, tmp_path_factory) -> dict[tuple[str, str], Path]:
    out = tmp_path_factory.mktemp("ref")
    paths = {(name, t, False): out / f"{name}-{t}.gguf" for name, t in CASES}
    paths |= {(name, t, keep): out / f"{name}-{t}-mtp{int(keep)}.gguf" for name, t, keep in MTP_CASES}
    run_reference_converter([(hf_dirs[name], p, t, keep) for (name, t, keep), p in paths.items()])
    return paths


@pytest.fixture(scope="module")
def ours(hf_dirs, tmp_path_factory):
    """deltaspec's conversion of (name, outtype), made once per module."""
    out = tmp_path_factory.mktemp("ours")
    done: dict[tuple[str, str, bool], Path] = {}

    def get(name: str, outtype: str, mtp: bool = True) -> Path:
        if (name, outtype, mtp) not in done:
            done[name, outtype, mtp] = C.convert_hf_to_gguf(hf_dirs[name], out / f"{name}-{outtype}-mtp{int(mtp)}.gguf",
                                                            outtype=outtype, mtp=mtp)
        return done[name, outtype, mtp]

    return get


_read = read_gguf_view


@pytest.mark.parametrize("name,outtype", CASES, ids=[f"{n}-{t}" for n, t in CASES])
def test_matches_llama_cpp(name, outtype, reference, ours):
    _assert_same_gguf(ours(name, outtype), reference[(name, outtype, False)])


@pytest.mark.parametrize("name,outtype,keep", MTP_CASES, ids=[f"{n}-{t}-mtp{int(k)}" for n, t, k in MTP_CASES])
def test_mtp_layer_matches_llama_cpp(name, outtype, keep, reference, ours):
    """The MTP layer kept (blk.{n_layer}.* and nextn.*, block_count + 1, nextn_predict_layers) or
    dropped exactly as llama.cpp's converter does. Seen to fail: with the +1 of the MTP norms left
    out (enorm/hnorm/shared_head_norm) the kept case failed on 'blk.8.nextn.enorm.weight: bytes
    differ'; with nextn_predict_layers written after the ssm.* keys, on 'same keys, other order'."""
    mine = ours(name, outtype, mtp=keep)
    _assert_same_gguf(mine, reference[(name, outtype, keep)])
    kv, tensors = _read(mine)
    names = [t[0] for t in tensors]
    n_layer = MTP_CONFIGS[name]["num_hidden_layers"]
    assert (f"blk.{n_layer}.nextn.eh_proj.weight" in names) == keep
    assert ("qwen35.nextn_predict_layers" in kv) == keep
    assert kv["qwen35.block_count"][1] == n_layer + keep


def _assert_same_gguf(mine: Path, reference: Path) -> None:
    assert_same_gguf(mine, reference, NOT_COMPARED)
    ref_kv, _ = read_gguf_view(reference)
    assert ref_kv["tokenizer.ggml.pre"][1] == "qwen35"  # the reference hash-detected the real vocab
    assert "tokenizer.chat_template" in ref_kv


def test_v_heads_are_reordered(hf_dirs, ours):
    """With Hk != Hv the GGUF's per-V-head vectors must be in tiled order, not HF's grouped one."""
    hf = hf_dirs["gdn_hk2_hv4_tied"]
    a_log = safetensors_numpy.load_file(hf / "model.safetensors")["model.layers.0.linear_attn.A_log"]
    _, tensors = _read(ours("gdn_hk2_hv4_tied", "f32"))
    ssm_a = np.frombuffer(next(t[3] for t in tensors if t[0] == "blk.0.ssm_a"), np.float32)
    hk, hv = 2, 4
    tiled = a_log.reshape(hk, hv // hk).T.reshape(-1)  # [g0v0, g1v0, g0v1, g1v1]
    np.testing.assert_allclose(ssm_a, -np.exp(tiled), rtol=1e-6)
    assert not np.allclose(ssm_a, -np.exp(a_log), rtol=1e-6)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_transformers_loads_tiny_model(name):
    folder = tiny_model_dir(name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    check_not_flat(probe_logits(model))  # std over the vocab in [0.5, 10], argmax moves
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = "Hello, world! 3.14 你好 <|im_end|>"
    ids = tok.encode(text)
    assert 248046 in ids and tok.decode(ids) == text


def test_conditional_generation_layout(hf_dirs, ours, tmp_path):
    """A Qwen3_5ForConditionalGeneration folder (text under model.language_model.*, text_config,
    vision and MTP tensors) converts to the same tensors and qwen35/tokenizer keys."""
    src = hf_dirs["gdn_hk2_hv4_tied"]
    weights = safetensors_numpy.load_file(src / "model.safetensors")
    vl = {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()}
    vl["model.visual.blocks.0.attn.qkv.weight"] = np.ones((48, 16), np.float32)
    vl["mtp.fc.weight"] = np.ones((64, 128), np.float32)
    vl["mtp.layers.0.input_layernorm.weight"] = np.ones(64, np.float32)
    folder = tmp_path / "vl"
    folder.mkdir()
    safetensors_numpy.save_file(vl, folder / "model.safetensors")
    text_cfg = json.loads((src / "config.json").read_text())
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "tie_word_embeddings": text_cfg.pop("tie_word_embeddings"), "text_config": text_cfg,
           "vision_config": {"depth": 1, "hidden_size": 16}}
    text_cfg.pop("architectures")
    (folder / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(f, folder / f.name)

    # the stand-in MTP tensors above are not a whole MTP layer: dropped, as llama.cpp's --no-mtp does
    vl_kv, vl_t = _read(C.convert_hf_to_gguf(folder, tmp_path / "vl.gguf", outtype="f32", mtp=False))
    lm_kv, lm_t = _read(ours("gdn_hk2_hv4_tied", "f32"))
    assert [t[:3] for t in vl_t] == [t[:3] for t in lm_t]
    same = all(a[3] == b[3] for a, b in zip(vl_t, lm_t))
    assert same, "tensor bytes differ"
    for kv in (vl_kv, lm_kv):  # the folder name, hence general.name, differs by design
        for key in [k for k in kv if k.startswith("general.")]:
            del kv[key]
    assert sorted(vl_kv) == sorted(lm_kv)
    same = vl_kv == lm_kv
    assert same, [k for k in vl_kv if vl_kv[k] != lm_kv[k]]


# -------------------------------------------------------------------------------------------------
# errors and corner cases, on micro folders (no tokenizer needed: tensors are checked first)

_MICRO = {
    "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
    "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "layer_types": ["linear_attention", "full_attention"],
    "tie_word_embeddings": True,
}


def _micro(folder: Path, drop: str | None = None, reshape: str | None = None, **cfg) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**_MICRO, **cfg, "architectures": _MICRO["architectures"]}))
    hp = C._load_hparams(folder)
    (folder / "config.json").write_text(json.dumps({**_MICRO, **cfg}))
    tensors = {name: np.zeros(shape, np.float32) for name, (gguf_name, shape, _) in C._expected_tensors(hp).items()
               if not C._optional(gguf_name, name, {**hp, "tie_word_embeddings": True}) and name != drop}
    if reshape:
        tensors[reshape] = np.zeros((3, 3), np.float32)
    safetensors_numpy.save_file(tensors, folder / "model.safetensors")
    return folder


def test_error_missing_folder(tmp_path):
    with pytest.raises(ConversionError, match="not a directory"):
        C.convert_hf_to_gguf(tmp_path / "nope", tmp_path / "o.gguf")


def test_error_missing_config(tmp_path):
    with pytest.raises(ConversionError, match="no config.json"):
        C.convert_hf_to_gguf(tmp_path, tmp_path / "o.gguf")


def test_error_unsupported_architecture(tmp_path):
    _micro(tmp_path, architectures=["Qwen3ForCausalLM"])
    with pytest.raises(ConversionError, match="'Qwen3ForCausalLM' is not supported"):
        C.convert_hf_to_gguf(tmp_path, tmp_path / "o.gguf")


def test_error_missing_tensor(tmp_path):
    _micro(tmp_path, drop="model.layers.0.linear_attn.A_log")
    with pytest.raises(ConversionError, match=r"missing weight tensors \['model.layers.0.linear_attn.A_log'\]"):
        C.convert_hf_to_gguf(tmp_path, tmp_path / "o.gguf")
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written


def test_error_untied_without_lm_head(tmp_path):
    _micro(tmp_path, tie_word_embeddings=False)
    with pytest.raises(ConversionError, match="lm_head.weight"):
        C.convert_hf_to_gguf(tmp_path, tmp_path / "o.gguf")


def test_error_wrong_shape(tmp_path):
    _micro(tmp_path, reshape="model.layers.1.self_attn.q_proj.weight")
    with pytest.raises(ConversionError, match=r"q_proj.weight' has shape \[3, 3\], config.json implies \[128, 32\]"):
        C.convert_hf_to_gguf(tmp_path, tmp_path / "o.gguf")


def test_error_bad_outtype_and_no_tokenizer(tmp_path):
    _micro(tmp_path)
    with pytest.raises(ConversionError, match="outtype"):
        C.convert_hf_to_gguf(tmp_path, tmp_path / "o.gguf", outtype="q4_0")
    with pytest.raises(DeltaspecError, match="no tokenizer.json"):
        C.convert_hf_to_gguf(tmp_path, tmp_path / "o.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


def test_default_mrope_sections(tmp_path):
    """Without rope_parameters.mrope_section llama.cpp writes [11, 11, 10, 0] (the loader needs one)."""
    hp = C._load_hparams(_micro(tmp_path))
    w = GGUFWriter(None, C.ARCH)
    C._add_hparams(w, hp, C.OUTTYPES["f32"][0])
    kv = w.kv_data[0]
    assert kv["qwen35.rope.dimension_sections"].value == [11, 11, 10, 0]
    assert kv["qwen35.rope.dimension_count"].value == 8  # head_dim 32 * partial_rotary_factor 0.25
    assert kv["qwen35.rope.freq_base"].value == 10000.0
    assert kv["qwen35.attention.recurrent_layers"].value == [True, False]


def test_rope_scaling(tmp_path):
    hp = C._load_hparams(_micro(tmp_path))
    hp["rope_parameters"] = {**hp["rope_parameters"], "rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 262144}
    w = GGUFWriter(None, C.ARCH)
    C._add_hparams(w, hp, C.OUTTYPES["f16"][0])
    kv = w.kv_data[0]
    assert kv["qwen35.rope.scaling.type"].value == "yarn" and kv["qwen35.rope.scaling.factor"].value == 4.0
    assert kv["qwen35.rope.scaling.original_context_length"].value == 262144
    hp["rope_parameters"]["rope_type"] = "longrope"
    with pytest.raises(ConversionError, match="'longrope' is not supported"):
        C._add_hparams(GGUFWriter(None, C.ARCH), hp, C.OUTTYPES["f16"][0])


def test_neg_exp_without_torch_is_within_one_ulp(monkeypatch):
    x = np.random.default_rng(0).uniform(-5, 3, 4096).astype(np.float32)
    with_torch = C._neg_exp(x)
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # makes `import torch` fail
    without = C._neg_exp(x)
    ulps = np.abs(with_torch.view(np.int32).astype(np.int64) - without.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1
