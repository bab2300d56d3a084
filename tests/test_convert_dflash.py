"""deltaspec's DFlash drafter converter against llama.cpp's own convert_hf_to_gguf.py (its DFlashModel,
with --target-model-dir), on tiny random DFlashDraftModel checkpoints saved by the `dflash` package.

Every metadata key (type, value, order), every tensor (name, order, shape, ggml type, bytes) and then
the whole file are compared (tests/gguf_compare.py); no key is left out. The targets are the tiny
Qwen3.5 checkpoints (real vocabulary, so llama.cpp's converter recognises it), seen through scratch
folders that add a chat template, so the copied tokenizer keys include one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("dflash")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from deltaspec import convert_dflash as CD  # noqa: E402
from deltaspec.convert import convert_hf_to_gguf  # noqa: E402
from deltaspec.errors import ConversionError  # noqa: E402
from deltaspec.testing import tiny_dflash as TD  # noqa: E402
from deltaspec.testing.tiny_dflash_hf import write_dflash_checkpoint  # noqa: E402
from deltaspec.testing.tiny_models import TINY_CONFIGS, tiny_model_dir  # noqa: E402
from gguf_compare import assert_same_gguf, read_gguf_view  # noqa: E402
from upstream import llama_cpp_tree, run_reference_dflash_converter  # noqa: E402

V = 248320  # the tiny targets' (real) vocabulary

# name -> (target, write_dflash_checkpoint arguments, tiny_dflash.dflash_config arguments)
DRAFTERS = {
    # what save_pretrained writes today (rope_parameters, no is_causal), f32, 2 of the 4 target layers
    "plain": ("gdn_hk2_hv4_tied", dict(), dict(layer_ids=[0, 2], n_ff=128, block_size=8)),
    # a published z-lab config's shape (top-level rope_theta, torch_dtype), bf16 weights, is_causal
    # true (written after target_layers); n_ff 80 is not a multiple of Q8_0's 32-value blocks, so
    # ffn_down falls back to F16 under q8_0 as llama.cpp's converter falls back
    "legacy_bf16_causal": ("mixed_s128_bf16", dict(dtype="bfloat16", legacy=True),
                           dict(layer_ids=[0, 3, 4], n_ff=80, n_head=2, n_head_kv=1, head_dim=64, block_size=16,
                                causal=True)),
    # is_causal false: TextModel writes attention.causal among the generic keys, DFlashModel's own
    # write then keeps that slot
    "noncausal_flag": ("attn2_d32_untied", dict(seed=3), dict(layer_ids=[1, 4, 6], n_ff=64, causal=False)),
}
# Every outtype once (F16 as the q8_0 case's fallback for ffn_down, which is where the drafter
# path could differ from the qwen35 one; test_convert.py has f16 files whole). Each reference job
# costs ~5 s of CPU, mostly llama.cpp loading the 248k-token tokenizer.
CASES = [("plain", "f32"), ("legacy_bf16_causal", "q8_0"), ("noncausal_flag", "bf16")]


def _drafter_cfg(name: str) -> dict:
    target, _, kw = DRAFTERS[name]
    kw = dict(kw)
    t = TINY_CONFIGS[target]
    return TD.dflash_config(t["hidden_size"], V, kw.pop("layer_ids"), mask_token_id=248070,
                            num_target_layers=t["num_hidden_layers"], **kw)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Each drafter checkpoint, and each target seen through a scratch folder with a chat template."""
    template = (llama_cpp_tree() / "models" / "templates" / "Qwen3.5-4B.jinja").read_text(encoding="utf-8")
    root = tmp_path_factory.mktemp("dflash-hf")
    out = {}
    for target in sorted({t for t, _, _ in DRAFTERS.values()}):
        src, dst = tiny_model_dir(target), root / f"target-{target}"
        dst.mkdir()
        for f in src.iterdir():
            if f.name != "chat_template.jinja":
                (dst / f.name).symlink_to(f)
        (dst / "chat_template.jinja").write_text(template, encoding="utf-8")
        out[target] = dst
    for name, (_, write_kw, _) in DRAFTERS.items():
        out[name] = write_dflash_checkpoint(root / f"{name}-DFlash", _drafter_cfg(name), **write_kw)
    return out


@pytest.fixture(scope="module")
def reference(folders, tmp_path_factory) -> dict[tuple[str, str], Path]:
    out = tmp_path_factory.mktemp("dflash-ref")
    paths = {(name, t): out / f"{name}-{t}.gguf" for name, t in CASES}
    run_reference_dflash_converter([(folders[name], folders[DRAFTERS[name][0]], p, t) for (name, t), p in paths.items()])
    return paths


@pytest.fixture(scope="module")
def ours(folders, tmp_path_factory):
    """deltaspec's conversion of (drafter, outtype) for its target's HF folder, made once per module."""
    out = tmp_path_factory.mktemp("dflash-ours")
    done: dict[tuple[str, str], Path] = {}

    def get(name: str, outtype: str) -> Path:
        if (name, outtype) not in done:
            done[name, outtype] = CD.convert_dflash_to_gguf(folders[name], out / f"{name}-{outtype}.gguf",
                                                            folders[DRAFTERS[name][0]], outtype)
        return done[name, outtype]

    return get


@pytest.fixture(scope="module")
def target_gguf(folders, tmp_path_factory) -> Path:
    """The 'plain' drafter's target as a qwen35 GGUF (deltaspec's converter, f32)."""
    return convert_hf_to_gguf(folders["gdn_hk2_hv4_tied"], tmp_path_factory.mktemp("target") / "target.gguf",
                              outtype="f32")


@pytest.mark.parametrize("name,outtype", CASES, ids=[f"{n}-{t}" for n, t in CASES])
def test_matches_llama_cpp(name, outtype, reference, ours):
    """Byte-identical to llama.cpp's converter. Seen to fail: with attention.causal always written
    after target_layers, noncausal_flag failed on 'same keys, other order'; with ffn_gate and ffn_up
    swapped in the tensor map, plain-f32 on 'tensor names or order differ'; with the dimension
    sections written as [head_dim, 0, 0, 0], on 'dflash.rope.dimension_sections: ours ((9, 5),
    [32, 0, 0, 0]) != llama.cpp ((9, 5), [16, 0, 0, 0])'."""
    mine = ours(name, outtype)
    assert_same_gguf(mine, reference[(name, outtype)])
    kv, tensors = read_gguf_view(mine)
    cfg = _drafter_cfg(name)
    assert kv["general.architecture"][1] == "dflash"
    assert kv["dflash.target_layers"][1] == [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]
    assert kv["tokenizer.ggml.mask_token_id"][1] == 248070 and len(kv["tokenizer.ggml.tokens"][1]) == V
    assert "tokenizer.chat_template" in kv
    assert ("dflash.attention.causal" in kv) == ("is_causal" in cfg)
    types = {t[0]: t[2] for t in tensors}
    assert types["blk.0.attn_q_norm.weight"] == "F32" and types["fc.weight"] == outtype.upper()
    if outtype == "q8_0":
        assert types["blk.0.ffn_down.weight"] == "F16"  # rows of 80: not Q8_0-blockable


def test_target_gguf_gives_the_same_file(folders, ours, target_gguf, tmp_path):
    """The target given as its qwen35 GGUF (deltaspec's conversion, which test_convert.py holds
    byte-identical to llama.cpp's) gives the same drafter file as the target's HF folder: the
    GGUF's tokenizer keys are copied with their own types, in their order. Run through the CLI
    (`deltaspec convert DRAFTER OUT --target T.gguf`). Seen to fail with the copied scalars' types
    inferred from their values: 'tokenizer.ggml.eos_token_id: ours (5, 248046) != llama.cpp (4,
    248046)' (an INT32 where the file has a UINT32)."""
    from deltaspec.cli import main

    out = tmp_path / "via-gguf.gguf"
    assert main(["convert", str(folders["plain"]), str(out), "--outtype", "f32", "--target", str(target_gguf)]) == 0
    assert_same_gguf(out, ours("plain", "f32"))


# -------------------------------------------------------------------------------------------------
# bad input, each refused with the file, key or tensor named


def _micro(folder: Path, cfg: dict | None = None, drop: str | None = None, add: dict | None = None,
           reshape: str | None = None) -> Path:
    """A drafter folder with zero weights for `cfg` (default: 'plain's config)."""
    cfg = cfg or _drafter_cfg("plain")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    hp = CD._load_drafter_hparams(folder)
    tensors = {n: np.zeros(shape, np.float32) for n, (_, shape) in CD._expected_tensors(hp).items() if n != drop}
    if reshape:
        tensors[reshape] = np.zeros((3, 3), np.float32)
    tensors.update(add or {})
    safetensors_numpy.save_file(tensors, folder / "model.safetensors")
    return folder


def _edited(**changes) -> dict:
    cfg = _drafter_cfg("plain")
    for key, value in changes.items():
        if key.startswith("dflash_"):
            cfg["dflash_config"] = {**cfg["dflash_config"], key[len("dflash_"):]: value}
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize("changes,words", [
    (dict(architectures=["Qwen3_5ForCausalLM"]), r"'Qwen3_5ForCausalLM' is not a DFlash drafter"),
    (dict(architectures=["DFlash2DraftModel"]), "'DFlash2DraftModel'.*not supported"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=64), "layer_types"),
    (dict(dflash_output_multiplier=0.5), "dflash_config.output_multiplier asks for a logit scale"),
    (dict(dflash_mask_token_id=None), "dflash_config.mask_token_id is missing"),
    (dict(dflash_target_layer_ids=None), "dflash_config.target_layer_ids is missing"),
    (dict(head_dim=None), "head_dim missing"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7}), "'yarn'"),
], ids=["qwen35", "dflash2", "swa", "logit-scale", "no-mask", "no-layers", "no-head-dim", "yarn"])
def test_refuses_unsupported_configs(changes, words, tmp_path):
    cfg = _edited(**changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=words) as e:
        CD.convert_dflash_to_gguf(tmp_path, tmp_path / "o.gguf", tiny_model_dir("gdn_hk2_hv4_tied"))
    assert "config.json" in str(e.value)
    assert not list(tmp_path.glob("*.gguf*"))


@pytest.mark.parametrize("changes,words", [
    (dict(hidden_size=128), "hidden_size = 128, but the target .* has hidden size 64"),
    (dict(vocab_size=1000), "vocab_size = 1000, but the target .* has 248320 tokens"),
    (dict(dflash_target_layer_ids=[0, 4]), r"target_layer_ids = \[0, 4\]: \[4\] not among the target's 4 layers"),
    (dict(dflash_mask_token_id=V), "mask_token_id = 248320 is outside the target's vocabulary"),
], ids=["hidden", "vocab", "layers", "mask"])
def test_refuses_drafters_that_do_not_fit_the_target(changes, words, tmp_path):
    cfg = _edited(**changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=words):
        CD.convert_dflash_to_gguf(tmp_path, tmp_path / "o.gguf", tiny_model_dir("gdn_hk2_hv4_tied"))


def test_refuses_misfits_against_a_target_gguf(folders, ours, target_gguf, tmp_path):
    """A target given as a GGUF is checked the same way, and must be a qwen35 file."""
    cfg = _edited(hidden_size=128)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"hidden_size = 128, but the target \(.*target.gguf\) has hidden size 64"):
        CD.convert_dflash_to_gguf(tmp_path, tmp_path / "o.gguf", target_gguf)
    with pytest.raises(ConversionError, match="general.architecture is 'dflash'"):
        CD.convert_dflash_to_gguf(folders["plain"], tmp_path / "o.gguf", ours("plain", "f32"))


def test_refuses_bad_tensors_and_targets(tmp_path):
    target = tiny_model_dir("gdn_hk2_hv4_tied")
    with pytest.raises(ConversionError, match=r"missing weight tensors \['layers.1.self_attn.k_norm.weight'\]"):
        CD.convert_dflash_to_gguf(_micro(tmp_path / "a", drop="layers.1.self_attn.k_norm.weight"), tmp_path / "o.gguf", target)
    with pytest.raises(ConversionError, match=r"'layers.0.mlp.up_proj.weight' has shape \[3, 3\], config.json implies \[128, 64\]"):
        CD.convert_dflash_to_gguf(_micro(tmp_path / "b", reshape="layers.0.mlp.up_proj.weight"), tmp_path / "o.gguf", target)
    bias = {"layers.0.self_attn.q_proj.bias": np.zeros(128, np.float32)}
    with pytest.raises(ConversionError, match="unexpected tensor 'layers.0.self_attn.q_proj.bias'"):
        CD.convert_dflash_to_gguf(_micro(tmp_path / "c", add=bias), tmp_path / "o.gguf", target)
    good = _micro(tmp_path / "d")
    with pytest.raises(ConversionError, match="not a DFlash drafter"):  # a Qwen3.5 folder is no drafter
        CD.convert_dflash_to_gguf(target, tmp_path / "o.gguf", target)
    with pytest.raises(ConversionError, match="is a DFlash drafter: convert it for its target"):
        convert_hf_to_gguf(good, tmp_path / "o.gguf")  # and a drafter is no Qwen3.5 checkpoint
    with pytest.raises(ConversionError, match="neither a Hugging Face checkpoint folder nor a GGUF"):
        CD.convert_dflash_to_gguf(good, tmp_path / "o.gguf", tmp_path / "nothing")
    with pytest.raises(ConversionError, match="is a DFlash drafter"):  # a target folder that is not Qwen3.5
        CD.convert_dflash_to_gguf(good, tmp_path / "o.gguf", good)
    not_gguf = tmp_path / "t.gguf"
    not_gguf.write_bytes(b"junk" * 10)
    with pytest.raises(ConversionError, match="not a readable GGUF"):
        CD.convert_dflash_to_gguf(good, tmp_path / "o.gguf", not_gguf)
    assert not list(tmp_path.glob("o.gguf*"))


def test_cli_asks_for_the_target(folders, tmp_path, capsys):
    """`deltaspec convert DRAFTER OUT` without --target exits 2 saying the drafter needs one;
    --target (or llama.cpp's --target-model-dir) with a Qwen3.5 folder is refused. (The CLI's
    conversion itself: test_target_gguf_gives_the_same_file.)"""
    from deltaspec.cli import main

    target = str(folders["gdn_hk2_hv4_tied"])
    assert main(["convert", str(folders["plain"]), str(tmp_path / "x.gguf")]) == 2
    assert "DFlash drafter, which has no tokenizer of its own: give --target" in capsys.readouterr().err
    assert main(["convert", target, str(tmp_path / "y.gguf"), "--target-model-dir", target]) == 2
    assert "--target is for DFlash drafter checkpoints" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.gguf*"))
