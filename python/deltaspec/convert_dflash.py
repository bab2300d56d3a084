"""Convert a z-lab DFlash drafter checkpoint (`DFlashDraftModel`, safetensors) to a `dflash` GGUF.

The output matches what the pinned llama.cpp `convert_hf_to_gguf.py` writes for the same folder with
`--target-model-dir` (tests/test_convert_dflash.py checks it byte for byte): same tensor names, order,
types and bytes, same `dflash.*`, general and tokenizer keys in the same order.

The drafter has no tokenizer, embedding or LM head of its own: it drafts in its target's vocabulary
with the target's embedding and head. So the target is needed here too, for the vocabulary the file
carries and to check that the drafter fits it (hidden size, vocabulary size, the target layers it
reads). The target is given as its Hugging Face folder (what llama.cpp's converter takes) or as its
qwen35 GGUF, whose tokenizer keys are copied as they are.

Only the drafter deltaspec runs is converted: plain DFlash (every layer full, non-causal or causal
attention, unscaled NeoX RoPE, no biases). Variants that llama.cpp's converter would write but the
drafter would compute differently (DFlash2 convolutions, sliding windows, logit or value scales, a
mask embedding of the drafter's own, ...) are refused with the config key that asks for them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import gguf

from .convert import (OUTTYPES, _ST_DTYPES, _Planned, _Source, _add_general_metadata, _add_vocab, _conversion_paths,
                      _identity, _index_safetensors, _load_hparams, _read_json, _tensor_qtype, planned_writer, write_planned)
from .errors import ConversionError, DeltaspecError
from .gguf_file import read_gguf

ARCH = "dflash"
ARCHITECTURES = ("DFlashDraftModel",)
TARGET_ARCH = "qwen35"

# HF layer tensor suffix -> GGUF suffix (llama.cpp's tensor map for arch dflash)
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

# dflash_config (or top-level) keys of drafter variants deltaspec's DFlash drafter does not compute;
# llama.cpp's converter turns each into a key or tensor that deltaspec.Drafter refuses to load.
_UNSUPPORTED_DFLASH_KEYS = {
    "conv_kernel_size": "DFlash2 dynamic convolutions",
    "attention_value_scale": "a value scale",
    "output_multiplier": "a logit scale",
    "final_logit_softcapping": "logit soft-capping",
    "input_embedding_scale": "an embedding scale",
    "use_swa": "sliding-window attention",
}

# Qwen3Config's defaults for the keys that do not size a tensor: llama.cpp reads config.json through
# transformers' AutoConfig, which fills these in when a key is absent. Keys that size tensors are
# required instead (a drafter of another shape than the one written would be worse than an error).
_QWEN3_DEFAULTS: dict[str, Any] = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "vocab_size")


def is_dflash_checkpoint(hf_dir: str | os.PathLike[str]) -> bool:
    """Whether `hf_dir`'s config.json names a DFlash drafter architecture (supported or not)."""
    cfg_path = Path(hf_dir) / "config.json"
    try:
        archs = json.loads(cfg_path.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, json.JSONDecodeError, AttributeError):
        return False
    return bool(archs) and isinstance(archs[0], str) and "DFlash" in archs[0]


def convert_dflash_to_gguf(hf_dir: str | os.PathLike[str], out_path: str | os.PathLike[str],
                           target: str | os.PathLike[str], outtype: str = "f16", *, progress: bool = False) -> Path:
    """Write `out_path` (a `dflash` GGUF) from the DFlash checkpoint folder `hf_dir`; return its path.

    `target`: the target model the drafter was trained for, as its Hugging Face folder (config.json
    and tokenizer files) or its qwen35 GGUF; the file gets the target's vocabulary. `outtype` is the
    type of the 2-D weights ("f32", "f16", "bf16" or "q8_0"); norms stay F32 as llama.cpp keeps
    them. Raises `ConversionError` naming the file, key or tensor that is missing, unsupported or
    does not fit the target.
    """
    folder, out = _conversion_paths(hf_dir, out_path, outtype, "a DFlash checkpoint folder")
    hp = _load_drafter_hparams(folder)
    tgt = _load_target(Path(target))
    _check_fit(folder / "config.json", hp, tgt)
    ftype, default_qtype = OUTTYPES[outtype]
    plan = _plan_tensors(folder, hp, _index_safetensors(folder), default_qtype)
    log = (lambda msg: print(msg, file=sys.stderr)) if progress else (lambda msg: None)

    writer = planned_writer(ARCH, plan)
    writer.add_type(gguf.GGUFType.MODEL)
    _add_general_metadata(writer, folder)
    _add_hparams(writer, hp, ftype, tgt["mrope"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tgt["add_vocab"](writer)
    writer.add_uint32("tokenizer.ggml.mask_token_id", hp["mask_token_id"])
    write_planned(writer, plan, out, log)
    return out


# ---------------------------------------------------------------------------------------------
# the drafter's config


def _load_drafter_hparams(folder: Path) -> dict[str, Any]:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"{folder}: no config.json")
    cfg = _read_json(cfg_path)
    if not isinstance(cfg, dict):
        raise ConversionError(f"{cfg_path}: not a JSON object")
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch == "DFlash2DraftModel":
        raise ConversionError(f"{cfg_path}: architecture 'DFlash2DraftModel' (dynamic convolutions and a candidate "
                              "selector) is not supported; only DFlashDraftModel")
    if arch not in ARCHITECTURES:
        raise ConversionError(f"{cfg_path}: architecture {arch!r} is not a DFlash drafter (expected DFlashDraftModel)")
    if cfg.get("quantization_config"):
        raise ConversionError(f"{cfg_path}: pre-quantized checkpoints (quantization_config) are not supported")
    if (folder / "mask_embedding.pt").exists():
        raise ConversionError(f"{folder / 'mask_embedding.pt'}: drafters with a mask embedding of their own are not "
                              "supported (deltaspec's drafter embeds the mask token with the target's embedding)")
    missing = [k for k in _REQUIRED if not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool)]
    if missing:
        raise ConversionError(f"{cfg_path}: {', '.join(missing)} missing or not an integer")
    hp = {**_QWEN3_DEFAULTS, **cfg}
    dcfg = cfg.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        raise ConversionError(f"{cfg_path}: dflash_config is not an object")

    def unsupported(key: str, what: str) -> ConversionError:
        return ConversionError(f"{cfg_path}: {key} asks for {what}, which deltaspec's DFlash drafter does not implement")

    for key, what in _UNSUPPORTED_DFLASH_KEYS.items():
        for where, table in (("dflash_config.", dcfg), ("", cfg)):
            value = table.get(key)
            if value is not None and value is not False and not (key == "final_logit_softcapping" and not value):
                raise unsupported(f"{where}{key}", what)
    if cfg.get("use_sliding_window"):
        raise unsupported("use_sliding_window", "sliding-window attention")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        # the dflash package makes sliding_attention layers causal and windowed
        raise unsupported(f"layer_types = {layer_types}", "layers other than full attention")
    if cfg.get("attention_bias"):
        raise unsupported("attention_bias", "attention biases")
    if cfg.get("rope_is_neox_style", True) is not True:
        raise unsupported("rope_is_neox_style", "interleaved RoPE")

    # RoPE as transformers' AutoConfig standardizes it: rope_parameters (or the legacy rope_scaling
    # and top-level rope_theta); llama.cpp writes no scaling keys for rope_type "default"
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type not in (None, "default"):
        raise unsupported(f"rope_parameters.rope_type {rope_type!r}", "scaled RoPE")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise unsupported(f"partial_rotary_factor = {partial}", "partial RoPE")
    hp["rope_theta"] = rope["rope_theta"]
    hp["partial_rotary_factor"] = partial

    mask = dcfg.get("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool):
        raise ConversionError(f"{cfg_path}: dflash_config.mask_token_id is missing (the token that fills a block's "
                              "slots to predict)")
    hp["mask_token_id"] = mask
    layers = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    if (not isinstance(layers, list) or not layers
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        # the dflash package could derive them from num_target_layers, llama.cpp's converter would
        # then write none, and the file could not be loaded: ask for them instead
        raise ConversionError(f"{cfg_path}: dflash_config.target_layer_ids is missing or not a list of layer ids "
                              f"(got {layers!r})")
    hp["target_layer_ids"] = layers
    block = dcfg.get("block_size", cfg.get("block_size", 16))
    if not isinstance(block, int) or isinstance(block, bool) or not 2 <= block <= 256:
        raise ConversionError(f"{cfg_path}: block_size = {block!r} is not an integer in [2, 256]")
    hp["block_size"] = block
    causal = cfg.get("is_causal")
    hp["causal"] = dcfg.get("causal") if causal is None else causal
    if hp["num_attention_heads"] % hp["num_key_value_heads"]:
        raise ConversionError(f"{cfg_path}: num_attention_heads ({hp['num_attention_heads']}) is not a multiple of "
                              f"num_key_value_heads ({hp['num_key_value_heads']})")
    return hp


def _add_hparams(w: gguf.GGUFWriter, hp: dict[str, Any], ftype: gguf.LlamaFileType, target_mrope: bool) -> None:
    # same keys, values and order as llama.cpp's TextModel and DFlashModel set_gguf_parameters;
    # the PyPI gguf lacks the dflash helpers, so those keys are written by name with the tree's types
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    if hp.get("is_causal") is False:  # TextModel writes it here; DFlashModel's later write keeps this slot
        w.add_causal_attention(False)
    w.add_rope_freq_base(hp["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_file_type(ftype)
    if hp["partial_rotary_factor"] is not None:
        w.add_rope_dimension_count(int(hp["head_dim"] * hp["partial_rotary_factor"]))
    w.add_uint32(f"{ARCH}.block_size", hp["block_size"])
    # llama.cpp counts a target layer by its input: HF's output of layer i is the input of i + 1
    w.add_array(f"{ARCH}.target_layers", [i + 1 for i in hp["target_layer_ids"]])
    if hp["causal"] is not None:
        w.add_causal_attention(bool(hp["causal"]))
    if target_mrope:  # the drafter ropes on the temporal section only
        w.add_rope_dimension_sections([hp["head_dim"] // 2, 0, 0, 0])


# ---------------------------------------------------------------------------------------------
# the target


def _load_target(target: Path) -> dict[str, Any]:
    """What the conversion needs from the target: hidden size, layer count, vocabulary size, whether
    it uses M-RoPE, and a function that writes its vocabulary."""
    if target.is_dir():
        hp = _load_hparams(target)  # a Qwen3.5 checkpoint's config, checked as its own conversion checks it
        raw = _read_json(target / "config.json")
        text = raw.get("text_config", raw)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        return {"where": target / "config.json", "n_embd": hp["hidden_size"], "n_layer": hp["num_hidden_layers"],
                "n_vocab": hp["vocab_size"], "mrope": "mrope_section" in rope,
                "add_vocab": lambda w: _add_vocab(w, target, hp)}
    if target.is_file():
        try:
            f = read_gguf(target)
        except DeltaspecError as e:
            raise ConversionError(f"{target}: the target is not a readable GGUF ({e})") from None
        md = f.metadata
        arch = md.get("general.architecture")
        if arch != TARGET_ARCH:
            raise ConversionError(f"{target}: general.architecture is {arch!r}; DFlash drafters are converted for "
                                  f"{TARGET_ARCH} targets")
        tokens = md.get("tokenizer.ggml.tokens")
        for key in (f"{arch}.embedding_length", f"{arch}.block_count"):
            if not isinstance(md.get(key), int):
                raise ConversionError(f"{target}: metadata key {key!r} is missing")
        if not isinstance(tokens, list) or not tokens:
            raise ConversionError(f"{target}: metadata key 'tokenizer.ggml.tokens' is missing (the drafter takes the "
                                  "target's vocabulary)")
        keys = [k for k in md if k.startswith("tokenizer.")]

        def add_vocab(w: gguf.GGUFWriter) -> None:
            # the keys exactly as the target's converter wrote them, in the same order and types
            for key in keys:
                vtype = f.value_types[key]
                if isinstance(vtype, tuple):
                    w.add_key_value(key, md[key], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType(vtype[1]))
                else:
                    w.add_key_value(key, md[key], gguf.GGUFValueType(vtype))

        # a qwen35 GGUF always carries rope.dimension_sections (its loader needs them): M-RoPE
        return {"where": target, "n_embd": md[f"{arch}.embedding_length"],
                "n_layer": md[f"{arch}.block_count"] - int(md.get(f"{arch}.nextn_predict_layers", 0)),
                "n_vocab": len(tokens), "mrope": True, "add_vocab": add_vocab}
    raise ConversionError(f"{target}: the target is neither a Hugging Face checkpoint folder nor a GGUF file")


def _check_fit(cfg_path: Path, hp: dict[str, Any], tgt: dict[str, Any]) -> None:
    where = tgt["where"]
    if hp["hidden_size"] != tgt["n_embd"]:
        raise ConversionError(f"{cfg_path}: hidden_size = {hp['hidden_size']}, but the target ({where}) has hidden size "
                              f"{tgt['n_embd']}: this drafter was made for another target")
    if hp["vocab_size"] != tgt["n_vocab"]:
        raise ConversionError(f"{cfg_path}: vocab_size = {hp['vocab_size']}, but the target ({where}) has "
                              f"{tgt['n_vocab']} tokens: this drafter was made for another target")
    bad = [i for i in hp["target_layer_ids"] if not 0 <= i < tgt["n_layer"]]
    if bad:
        raise ConversionError(f"{cfg_path}: dflash_config.target_layer_ids = {hp['target_layer_ids']}: {bad} not among "
                              f"the target's {tgt['n_layer']} layers (0 .. {tgt['n_layer'] - 1}, {where})")
    if not 0 <= hp["mask_token_id"] < tgt["n_vocab"]:
        raise ConversionError(f"{cfg_path}: dflash_config.mask_token_id = {hp['mask_token_id']} is outside the target's "
                              f"vocabulary of {tgt['n_vocab']} ({where})")


# ---------------------------------------------------------------------------------------------
# tensors


def _expected_tensors(hp: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF name (without a `model.` prefix) -> (GGUF name, HF shape) for every tensor the config implies."""
    E, F, L = hp["hidden_size"], hp["intermediate_size"], hp["num_hidden_layers"]
    H, Hkv, D = hp["num_attention_heads"], hp["num_key_value_heads"], hp["head_dim"]
    out = {"fc.weight": ("fc.weight", (E, len(hp["target_layer_ids"]) * E)),
           "hidden_norm.weight": ("enc.output_norm.weight", (E,)),
           "norm.weight": ("output_norm.weight", (E,))}
    shapes = {"input_layernorm.weight": (E,), "post_attention_layernorm.weight": (E,),
              "self_attn.q_proj.weight": (H * D, E), "self_attn.k_proj.weight": (Hkv * D, E),
              "self_attn.v_proj.weight": (Hkv * D, E), "self_attn.o_proj.weight": (E, H * D),
              "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,),
              "mlp.gate_proj.weight": (F, E), "mlp.up_proj.weight": (F, E), "mlp.down_proj.weight": (E, F)}
    for i in range(L):
        for suffix, shape in shapes.items():
            out[f"layers.{i}.{suffix}"] = (f"blk.{i}.{_LAYER[suffix]}", shape)
    return out


def _plan_tensors(folder: Path, hp: dict[str, Any], sources: dict[str, _Source],
                  default_qtype: gguf.GGMLQuantizationType) -> list[_Planned]:
    expected = _expected_tensors(hp)
    plan: list[_Planned] = []
    seen: set[str] = set()
    for hf_name, src in sources.items():  # in name order, as llama.cpp's converter walks them
        name = hf_name.removeprefix("model.")
        if name not in expected:
            raise ConversionError(f"{src.path}: unexpected tensor {hf_name!r} for a DFlashDraftModel of this config "
                                  "(deltaspec's DFlash drafter has no biases, embedding, LM head or DFlash2 parts)")
        if name in seen:
            raise ConversionError(f"{folder}: tensor {name!r} appears twice (with and without 'model.')")
        gguf_name, want_shape = expected[name]
        if src.dtype not in _ST_DTYPES:
            raise ConversionError(f"{src.path}: tensor {hf_name!r} has unsupported dtype {src.dtype}")
        if src.shape != want_shape:
            raise ConversionError(f"{src.path}: tensor {hf_name!r} has shape {list(src.shape)}, "
                                  f"config.json implies {list(want_shape)}")
        seen.add(name)
        plan.append(_Planned(gguf_name, src, _identity, want_shape, _tensor_qtype(gguf_name, want_shape, default_qtype)))
    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConversionError(f"{folder}: missing weight tensors {missing[:5]}{more}")
    return plan
