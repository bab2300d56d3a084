"""Convert a Hugging Face Qwen3.5 text checkpoint (safetensors) to a qwen35 GGUF.

The output matches what the pinned llama.cpp `convert_hf_to_gguf.py` writes for the same folder
(with `--no-mtp` when `mtp=False`): same tensor names, order, shapes, ggml types and bytes, same `qwen35.*` and tokenizer
metadata (tests/test_convert.py checks this against the real script). Only numpy and the `gguf`
package are needed; torch is used, when importable, for the one transcendental op (`-exp(A_log)`)
so its rounding is the reference converter's (a numpy fallback is at most 1 ulp off there).

Tensors are streamed: the tensor table is planned from the safetensors headers, then each tensor is
read (memory-mapped), transformed and written on its own, so memory stays near the largest tensor.
The MTP layer (`mtp.*`) is kept as llama.cpp keeps it: `blk.{n_layer}.*` plus `nextn.*`, block_count
extended and `nextn_predict_layers` written; `mtp=False` drops it (the GGUF then has no
`nextn_predict_layers`). Vision tensors are skipped.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import gguf

from .atomic_write import gguf_written_to
from .errors import ConversionError
from .qwen35 import rope_sections_problem

ARCH = "qwen35"
SUPPORTED_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")

_QT = gguf.GGMLQuantizationType
_FT = gguf.LlamaFileType
OUTTYPES: dict[str, tuple[gguf.LlamaFileType, gguf.GGMLQuantizationType]] = {
    "f32": (_FT.ALL_F32, _QT.F32),
    "f16": (_FT.MOSTLY_F16, _QT.F16),
    "bf16": (_FT.MOSTLY_BF16, _QT.BF16),
    "q8_0": (_FT.MOSTLY_Q8_0, _QT.Q8_0),
}

# Qwen3_5TextConfig's defaults: llama.cpp reads config.json through transformers' AutoConfig, which
# fills these in when a key is absent, so we do the same to write the same metadata.
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "tie_word_embeddings": False,
}
# llama.cpp's _Qwen35MRopeMixin writes this when rope_parameters has no mrope_section.
_DEFAULT_MROPE_SECTION = [11, 11, 10, 0]

# HF layer tensor suffix -> GGUF suffix (llama.cpp's tensor map for qwen35); the global tensors are
# in _expected_tensors
_COMMON_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_ATTN_LAYER = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_ATTN_BIASES = {  # optional (attention_bias=True); absent in released Qwen3.5
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
}
_LINEAR_LAYER = {
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}

# safetensors dtype -> (numpy storage dtype, whether it is widened to f32 before any math; the
# reference converter turns every dtype other than f16/f32 into f32 first)
_ST_DTYPES = {"F32": (np.float32, False), "F16": (np.float16, False),
              "BF16": (np.uint16, True), "F64": (np.float64, True)}


@dataclass
class _Source:
    path: Path
    offset: int
    dtype: str
    shape: tuple[int, ...]

    def load(self) -> np.ndarray:
        np_dtype, widen = _ST_DTYPES[self.dtype]
        count = int(np.prod(self.shape)) if self.shape else 1
        raw = np.fromfile(self.path, dtype=np_dtype, count=count, offset=self.offset)
        if raw.size != count:
            raise ConversionError(f"{self.path}: truncated (a tensor's data runs past the end of the file)")
        raw = raw.reshape(self.shape)
        if self.dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32) if widen else raw


@dataclass
class _Planned:
    gguf_name: str
    source: _Source
    transform: Callable[[np.ndarray], np.ndarray]
    shape: tuple[int, ...]  # numpy order, after the transform
    qtype: gguf.GGMLQuantizationType


def convert_hf_to_gguf(hf_dir: str | os.PathLike[str], out_path: str | os.PathLike[str],
                       outtype: str = "f16", *, mtp: bool = True, progress: bool = False) -> Path:
    """Write `out_path` (a qwen35 GGUF) from the Qwen3.5 checkpoint folder `hf_dir`; return its path.

    `outtype` is the type of the 2-D weights: "f32", "f16", "bf16" or "q8_0". Norms, `ssm_a`,
    `ssm_dt.bias` and `ssm_conv1d` stay F32, as llama.cpp's converter keeps them. `mtp`: keep the
    checkpoint's MTP layer, if it has one (llama.cpp's default; False is its `--no-mtp`).
    Raises `ConversionError` for a missing/unsupported folder, config or tensor.
    """
    folder, out = _conversion_paths(hf_dir, out_path, outtype, "a Hugging Face checkpoint folder")
    hp = _load_hparams(folder)
    sources = _index_safetensors(folder)
    hp["n_mtp"] = _mtp_layer_count(sources, hp) if mtp else 0
    ftype, default_qtype = OUTTYPES[outtype]
    plan = _plan_tensors(folder, hp, sources, default_qtype)
    log = (lambda msg: print(msg, file=sys.stderr)) if progress else (lambda msg: None)

    writer = planned_writer(ARCH, plan)
    writer.add_type(gguf.GGUFType.MODEL)
    _add_general_metadata(writer, folder)
    _add_hparams(writer, hp, ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocab(writer, folder, hp)
    write_planned(writer, plan, out, log)
    return out


def _conversion_paths(hf_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], outtype: str,
                      expected: str) -> tuple[Path, Path]:
    """The checked checkpoint folder and output path of a conversion (shared by every converter)."""
    if outtype not in OUTTYPES:
        raise ConversionError(f"outtype {outtype!r} is not one of {sorted(OUTTYPES)}")
    folder = Path(hf_dir).resolve()
    out = Path(out_path)
    if not folder.is_dir():
        raise ConversionError(f"{hf_dir}: not a directory (expected {expected})")
    if out.is_dir() or not out.resolve().parent.is_dir():
        raise ConversionError(f"{out}: expected a file path in an existing folder")
    return folder, out


def planned_writer(arch: str, plan: list[_Planned]) -> gguf.GGUFWriter:
    """A writer for `arch` holding the tensor table of `plan` (llama.cpp's converter adds the
    tensors before the metadata too, so general.size_label can count their parameters)."""
    writer = gguf.GGUFWriter(path=None, arch=arch)
    for p in plan:
        dtype = np.float32 if p.qtype == _QT.F32 else np.float16 if p.qtype == _QT.F16 else np.uint8
        shape = p.shape if dtype != np.uint8 else gguf.quant_shape_to_byte_shape(p.shape, p.qtype)
        writer.add_tensor_info(p.gguf_name, shape, np.dtype(dtype),
                               int(np.prod(shape)) * np.dtype(dtype).itemsize, raw_dtype=p.qtype)
    return writer


def write_planned(writer: gguf.GGUFWriter, plan: list[_Planned], out: Path, log: Callable[[str], None]) -> None:
    """Write the header, the metadata and each planned tensor, one at a time."""
    # write next to the target and rename, so a failure never leaves a truncated GGUF behind
    with gguf_written_to(out, writer) as tmp:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, p in enumerate(plan):
            data = gguf.quants.quantize(p.transform(p.source.load()), p.qtype)
            writer.write_tensor_data(data)
            log(f"[{i + 1}/{len(plan)}] {p.gguf_name} {p.qtype.name} {tuple(reversed(p.shape))}")


# ---------------------------------------------------------------------------------------------
# config


def _load_hparams(folder: Path) -> dict[str, Any]:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"{folder}: no config.json")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConversionError(f"{cfg_path}: not valid JSON ({e})") from None
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if isinstance(arch, str) and "DFlash" in arch:
        raise ConversionError(f"{cfg_path}: {arch} is a DFlash drafter: convert it for its target with "
                              "deltaspec.convert_dflash.convert_dflash_to_gguf (CLI: deltaspec convert ... --target T)")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(f"{cfg_path}: architecture {arch!r} is not supported "
                              f"(only {', '.join(SUPPORTED_ARCHITECTURES)})")
    if cfg.get("quantization_config"):
        raise ConversionError(f"{cfg_path}: pre-quantized checkpoints (quantization_config) are not supported")
    # VL checkpoints nest the text model's config; llama.cpp lifts it to the root the same way
    hp = {**_TEXT_DEFAULTS, **cfg, **(cfg.get("text_config") or {})}

    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in rope and key in hp:
            rope[key] = hp[key]
    rope.setdefault("rope_theta", 10000.0)
    rope.setdefault("partial_rotary_factor", 0.25)
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    hp["rope_parameters"] = rope
    # Sections the config gives are refused here as the loader would refuse them (a pair without a
    # section means different things to transformers and llama.cpp). Without them llama.cpp writes its
    # default whatever the rotary width, and so do we; the loader judges that file.
    if "mrope_section" in rope:
        sections = (list(rope["mrope_section"]) + [0, 0, 0, 0])[:4]
        problem = rope_sections_problem(sections, int(hp["head_dim"] * rope["partial_rotary_factor"]))
        if problem:
            raise ConversionError(f"{cfg_path}: rope_parameters.mrope_section = {problem}")

    n_layer = hp["num_hidden_layers"]
    if hp.get("layer_types") is None:  # transformers derives it from full_attention_interval
        interval = hp.get("full_attention_interval", 4)
        hp["layer_types"] = ["linear_attention" if (i + 1) % interval else "full_attention"
                             for i in range(n_layer)]
    types = hp["layer_types"]
    if len(types) != n_layer or not set(types) <= {"linear_attention", "full_attention"}:
        raise ConversionError(f"{cfg_path}: layer_types must list 'linear_attention'/'full_attention' "
                              f"for each of the {n_layer} layers, got {types!r}")
    if hp["linear_num_value_heads"] % hp["linear_num_key_heads"]:
        raise ConversionError(f"{cfg_path}: linear_num_value_heads ({hp['linear_num_value_heads']}) is not a "
                              f"multiple of linear_num_key_heads ({hp['linear_num_key_heads']})")
    hp["n_mtp"] = 0  # MTP layers kept: convert_hf_to_gguf counts them in the checkpoint's tensors
    return hp


def _add_hparams(w: gguf.GGUFWriter, hp: dict[str, Any], ftype: gguf.LlamaFileType) -> None:
    # same keys, values and order as llama.cpp's TextModel / Qwen3NextModel / _Qwen35MRopeMixin
    rope = hp["rope_parameters"]
    w.add_block_count(hp["num_hidden_layers"] + hp["n_mtp"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope_type, factor = rope.get("rope_type"), rope.get("factor")
    if rope_type == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif rope_type == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if (v := rope.get("extrapolation_factor")) is not None:
            w.add_rope_scaling_yarn_ext_factor(v)
        if (v := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
            w.add_rope_scaling_yarn_attn_factor(v)
        if (v := rope.get("beta_fast")) is not None:
            w.add_rope_scaling_yarn_beta_fast(v)
        if (v := rope.get("beta_slow")) is not None:
            w.add_rope_scaling_yarn_beta_slow(v)
    elif rope_type not in (None, "default", "linear", "yarn"):
        # llama.cpp only warns here, but then the engine would silently run unscaled RoPE
        raise ConversionError(f"rope_parameters.rope_type {rope_type!r} is not supported (default, linear, yarn)")
    if "mrope_section" in rope:
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0, 0, 0, 0])[:4])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_file_type(ftype)
    if hp["n_mtp"]:  # llama.cpp's _QwenMtpMixin writes it between the generic and the ssm.* keys
        w.add_uint32(f"{ARCH}.nextn_predict_layers", hp["n_mtp"])
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hp["linear_key_head_dim"])
    w.add_ssm_group_count(hp["linear_num_key_heads"])
    w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    # the PyPI gguf has no add_recurrent_layers yet; the key is llama.cpp's LLM_KV_ATTENTION_RECURRENT_LAYERS
    w.add_array(f"{ARCH}.attention.recurrent_layers",
                [t == "linear_attention" for t in hp["layer_types"]] + [False] * hp["n_mtp"])
    w.add_full_attention_interval(hp.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(hp["head_dim"] * rope["partial_rotary_factor"]))
    if "mrope_section" not in rope:
        w.add_rope_dimension_sections(_DEFAULT_MROPE_SECTION)


def _add_general_metadata(w: gguf.GGUFWriter, folder: Path) -> None:
    # gguf's own heuristics (model card, config `_name_or_path`, folder name, generation_config.json)
    total, shared, expert, n_expert = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, folder, None, total)
    if meta.name is None:
        meta.name = folder.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_expert)
    if meta.sampling_penalty_repeat is None:  # newer gguf-py (the pinned tree's) also reads this one
        gen = folder / "generation_config.json"
        if gen.is_file():
            try:
                meta.sampling_penalty_repeat = json.loads(gen.read_text(encoding="utf-8")).get("repetition_penalty")
            except json.JSONDecodeError:
                pass
    meta.set_gguf_meta_model(w)


# ---------------------------------------------------------------------------------------------
# tensors


def _index_safetensors(folder: Path) -> dict[str, _Source]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        parts = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    else:
        parts = sorted(p.name for p in folder.iterdir() if p.name.startswith("model") and p.name.endswith(".safetensors"))
    if not parts:
        raise ConversionError(f"{folder}: no model*.safetensors weight files")
    sources: dict[str, _Source] = {}
    for part in parts:
        path = folder / part
        if not path.is_file():
            raise ConversionError(f"{path}: listed in the safetensors index but missing")
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ConversionError(f"{path}: not a safetensors file") from None
        for name in sorted(k for k in header if k != "__metadata__"):  # llama.cpp orders by name too
            meta = header[name]
            sources[name] = _Source(path, 8 + n + meta["data_offsets"][0], meta["dtype"], tuple(meta["shape"]))
    return sources


def _mtp_layer_count(sources: dict[str, _Source], hp: dict[str, Any]) -> int:
    """MTP layers in the checkpoint: config.json's mtp_num_hidden_layers, else counted from the
    mtp.layers.* tensors (as llama.cpp counts them); 0 without mtp.* tensors."""
    names = [n.replace("language_model.", "").replace("model.mtp.", "mtp.", 1) for n in sources]
    if not any(n.startswith("mtp.") for n in names):
        return 0
    counted = {int(p[2]) for p in (n.split(".", 3) for n in names) if len(p) == 4 and p[1] == "layers" and p[2].isdecimal()}
    return int(hp.get("mtp_num_hidden_layers") or (max(counted) + 1 if counted else 0))


# mtp.<name> -> the layer-indexed name llama.cpp gives it (in block n_layer)
_MTP_GLOBAL = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "norm": "shared_head.norm"}


def _canonical_name(name: str, hp: dict[str, Any]) -> str | None:
    """The text-model name llama.cpp maps, or None for tensors it drops (vision, rope caches, and
    MTP when it is not kept). MTP tensors become those of blocks n_layer, n_layer + 1, ..."""
    name = name.replace("language_model.", "")
    if name.startswith("model.mtp."):
        name = name[len("model."):]
    if name.startswith("mtp."):
        if not hp["n_mtp"]:
            return None
        n, parts = hp["num_hidden_layers"], name.split(".", 3)
        if len(parts) == 4 and parts[1] == "layers" and parts[2].isdecimal():
            return f"model.layers.{n + int(parts[2])}.{parts[3]}"
        if len(parts) == 3 and parts[1] in _MTP_GLOBAL:
            return f"model.layers.{n}.{_MTP_GLOBAL[parts[1]]}.{parts[2]}"
        return name  # not an MTP tensor llama.cpp knows: refused below as unexpected
    if name.endswith(".rotary_emb.inv_freq"):
        return None
    if "visual." in name or "vision" in name or name.startswith(("mlp", "merger.")):
        return None
    return name


def _plan_tensors(folder: Path, hp: dict[str, Any], sources: dict[str, _Source],
                  default_qtype: gguf.GGMLQuantizationType) -> list[_Planned]:
    expected = _expected_tensors(hp)
    plan: list[_Planned] = []
    seen: set[str] = set()
    for hf_name, src in sources.items():
        name = _canonical_name(hf_name, hp)
        if name is None:
            continue
        if name not in expected:
            raise ConversionError(f"{folder}: unexpected tensor {hf_name!r} for this config")
        gguf_name, want_shape, transform = expected[name]
        if src.dtype not in _ST_DTYPES:
            raise ConversionError(f"{folder}: tensor {hf_name!r} has unsupported dtype {src.dtype}")
        if src.shape != want_shape:
            raise ConversionError(f"{folder}: tensor {hf_name!r} has shape {list(src.shape)}, "
                                  f"config.json implies {list(want_shape)}")
        shape = want_shape[:1] + want_shape[2:] if gguf_name.endswith("ssm_conv1d.weight") else want_shape
        seen.add(name)
        plan.append(_Planned(gguf_name, src, transform, shape, _tensor_qtype(gguf_name, shape, default_qtype)))
    missing = [n for n, (g, _, _) in expected.items()
               if n not in seen and not _optional(g, n, hp)]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConversionError(f"{folder}: missing weight tensors {missing[:5]}{more}")
    return plan


def _optional(gguf_name: str, hf_name: str, hp: dict[str, Any]) -> bool:
    if hf_name == "lm_head.weight":
        return bool(hp["tie_word_embeddings"])  # tied: llama.cpp reuses token_embd as the LM head
    return gguf_name.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"))


def _tensor_qtype(gguf_name: str, shape: tuple[int, ...], default: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    # llama.cpp's ModelBase.prepare_tensors rules: 1-D tensors, norms, the SSM conv kernel and
    # anything not named "*.weight" (ssm_a, ssm_dt.bias) stay F32
    if (len(shape) <= 1 or gguf_name.endswith("_norm.weight") or gguf_name.endswith(".ssm_conv1d.weight")
            or not gguf_name.endswith(".weight")):
        return _QT.F32
    block = gguf.GGML_QUANT_SIZES[default][0]
    if shape[-1] % block:  # llama.cpp falls back to F16 when gguf.quants cannot block the rows
        return _QT.F16
    return default


def _expected_tensors(hp: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...], Callable[[np.ndarray], np.ndarray]]]:
    """HF name -> (GGUF name, HF shape, transform) for every tensor the config implies."""
    E, F, V = hp["hidden_size"], hp["intermediate_size"], hp["vocab_size"]
    H, Hkv, D = hp["num_attention_heads"], hp["num_key_value_heads"], hp["head_dim"]
    Hk, Hv = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    Sk, Sv, K = hp["linear_key_head_dim"], hp["linear_value_head_dim"], hp["linear_conv_kernel_dim"]
    qk = 2 * Hk * Sk  # q and k rows/channels ahead of v in in_proj_qkv and conv1d
    C = qk + Hv * Sv
    tile = _make_tiler(Hk, Hv)

    same = _identity
    plus1 = _plus_one
    shapes_common = {"input_layernorm.weight": ((E,), plus1), "post_attention_layernorm.weight": ((E,), plus1),
                     "mlp.gate_proj.weight": ((F, E), same), "mlp.up_proj.weight": ((F, E), same),
                     "mlp.down_proj.weight": ((E, F), same)}
    shapes_attn = {"self_attn.q_proj.weight": ((2 * H * D, E), same), "self_attn.k_proj.weight": ((Hkv * D, E), same),
                   "self_attn.v_proj.weight": ((Hkv * D, E), same), "self_attn.o_proj.weight": ((E, H * D), same),
                   "self_attn.q_norm.weight": ((D,), plus1), "self_attn.k_norm.weight": ((D,), plus1),
                   "self_attn.q_proj.bias": ((2 * H * D,), same), "self_attn.k_proj.bias": ((Hkv * D,), same),
                   "self_attn.v_proj.bias": ((Hkv * D,), same), "self_attn.o_proj.bias": ((E,), same)}
    shapes_linear = {
        "linear_attn.in_proj_qkv.weight": ((C, E), lambda x: _tail_rows(x, qk, lambda v: tile(v, 0, Sv))),
        "linear_attn.in_proj_z.weight": ((Hv * Sv, E), lambda x: tile(x, 0, Sv)),
        "linear_attn.in_proj_b.weight": ((Hv, E), lambda x: tile(x, 0, 1)),
        "linear_attn.in_proj_a.weight": ((Hv, E), lambda x: tile(x, 0, 1)),
        "linear_attn.conv1d.weight": ((C, 1, K), lambda x: _tail_rows(x.reshape(C, K), qk, lambda v: tile(v, 0, Sv))),
        "linear_attn.dt_bias": ((Hv,), lambda x: tile(x, 0, 1)),
        "linear_attn.A_log": ((Hv,), lambda x: _neg_exp(tile(x, 0, 1))),
        "linear_attn.norm.weight": ((Sv,), same),  # the gated norm is not zero-centred: no +1
        "linear_attn.out_proj.weight": ((E, Hv * Sv), lambda x: tile(x, 1, Sv)),
    }
    names = {**_COMMON_LAYER, **_ATTN_LAYER, **_ATTN_BIASES, **_LINEAR_LAYER}
    out: dict[str, tuple[str, tuple[int, ...], Callable[[np.ndarray], np.ndarray]]] = {
        "model.embed_tokens.weight": ("token_embd.weight", (V, E), same),
        "model.norm.weight": ("output_norm.weight", (E,), plus1),
        "lm_head.weight": ("output.weight", (V, E), same),
    }
    n = hp["num_hidden_layers"]
    # MTP blocks are full-attention layers after the trunk
    n_mtp = hp["n_mtp"]
    for i, kind in enumerate(hp["layer_types"] + ["full_attention"] * n_mtp):
        table = {**shapes_common, **(shapes_linear if kind == "linear_attention" else shapes_attn)}
        for suffix, (shape, fn) in table.items():
            out[f"model.layers.{i}.{suffix}"] = (f"blk.{i}.{names[suffix]}", shape, fn)
    if n_mtp:
        for hf, gguf_name, shape, fn in (("eh_proj", "eh_proj", (E, 2 * E), same), ("enorm", "enorm", (E,), plus1),
                                         ("hnorm", "hnorm", (E,), plus1),
                                         ("shared_head.norm", "shared_head_norm", (E,), plus1)):
            out[f"model.layers.{n}.{hf}.weight"] = (f"blk.{n}.nextn.{gguf_name}.weight", shape, fn)
    return out


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _plus_one(x: np.ndarray) -> np.ndarray:
    # Qwen3.5 RMSNorm weights are zero-centred (scale = 1 + w); llama.cpp bakes the +1 in, in the
    # tensor's own dtype
    return x + x.dtype.type(1)


def _neg_exp(x: np.ndarray) -> np.ndarray:
    """-exp(A_log) = ssm_a, rounded as torch rounds it (the reference converter computes it in torch)."""
    try:
        import torch
    except ImportError:  # correctly rounded from float64: within 1 ulp of torch's result
        return (-np.exp(x.astype(np.float64))).astype(x.dtype)
    return (-torch.exp(torch.from_numpy(np.ascontiguousarray(x)))).numpy()


def _tail_rows(x: np.ndarray, start: int, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    return np.concatenate([x[:start], fn(x[start:])], axis=0)


def _make_tiler(hk: int, hv: int) -> Callable[[np.ndarray, int, int], np.ndarray]:
    """V-head reorder along an axis holding Hv heads of `hd` values: grouped by K head in HF
    ([g0v0..g0v(r-1), g1v0, ...]) -> tiled ([g0v0, g1v0, ..., g0v1, ...]), so that V head h uses
    K head h % Hk, ggml's broadcast rule. Identity when Hk == Hv."""
    r = hv // hk

    def tile(x: np.ndarray, axis: int, hd: int) -> np.ndarray:
        if hk == hv:
            return x
        shape = list(x.shape)
        split = shape[:axis] + [hk, r, hd] + shape[axis + 1:]
        return np.ascontiguousarray(np.swapaxes(x.reshape(split), axis, axis + 1)).reshape(shape)

    return tile


# ---------------------------------------------------------------------------------------------
# tokenizer


def _looks_special(token: str) -> bool:
    # llama.cpp's TextModel.does_token_look_special: control-like added tokens even if not "special"
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None


def _add_vocab(w: gguf.GGUFWriter, folder: Path, hp: dict[str, Any]) -> None:
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise ConversionError(f"{folder}: no tokenizer.json")
    tok = _read_json(tok_path)
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise ConversionError(f"{tok_path}: tokenizer model {model.get('type')!r} is not BPE (Qwen3.5 uses byte-level BPE)")
    tcfg_path = folder / "tokenizer_config.json"
    tcfg = _read_json(tcfg_path) if tcfg_path.is_file() else None
    added = tok.get("added_tokens") or []

    id_to_token = {i: t for t, i in model["vocab"].items()}
    added_by_id = {a["id"]: a for a in added}
    for a in added:
        id_to_token[a["id"]] = a["content"]
    vocab_size = hp["vocab_size"]
    if max(id_to_token) >= vocab_size:
        raise ConversionError(f"{tok_path}: token id {max(id_to_token)} >= config vocab_size {vocab_size}")

    # rows the tokenizer does not fill are padding, as in llama.cpp's get_vocab_base
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        token = id_to_token.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added_by_id:
            if added_by_id[i].get("special") or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")  # pre-normalise user-defined spaces
                types.append(gguf.TokenType.USER_DEFINED)
            tokens.append(token)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")  # Qwen3.5 is the only family accepted, so no hash detection
    w.add_token_list(tokens)
    w.add_token_types(types)

    merges = model.get("merges") or []
    if merges and not isinstance(merges[0], str):  # [a, b] pairs (tokenizers >= 0.20): spaces become U+0120
        merges = [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair)
                  for pair in merges]
    if not merges:  # llama.cpp would only warn, and write a vocabulary that cannot tokenize
        raise ConversionError(f"{tok_path}: no BPE merges")
    w.add_token_merges(merges)
    _add_special_tokens(w, folder, tok, tcfg, added)


_SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


def _add_special_tokens(w: gguf.GGUFWriter, folder: Path, tok: dict[str, Any],
                        tcfg: dict[str, Any] | None, added: list[dict[str, Any]]) -> None:
    """gguf-py's SpecialVocab as the pinned tree has it, for byte-level BPE tokenizers."""
    ids: dict[str, int] = {}
    add_flags: dict[str, bool] = {}
    post = tok.get("post_processor") or {}
    for proc in post.get("processors", [post]) if post else []:
        if proc.get("type") == "ByteLevel":  # adds no special tokens
            add_flags.setdefault("bos", False)
            add_flags.setdefault("eos", False)
    chat_template = None
    if tcfg:
        if not tcfg.get("bos_token") and tcfg.get("cls_token"):
            tcfg["bos_token"] = tcfg["cls_token"]
        if not tcfg.get("eos_token") and tcfg.get("sep_token"):
            tcfg["eos_token"] = tcfg["sep_token"]
        chat_template = tcfg.get("chat_template", _chat_template_file(folder))
        for typ in _SPECIAL_TYPES:
            flag = tcfg.get(f"add_{typ}_token")
            if isinstance(flag, bool):
                add_flags.setdefault(typ, flag)
            entry = tcfg.get(f"{typ}_token")
            content = entry.get("content") if isinstance(entry, dict) else entry
            if isinstance(content, str):
                tid = next((a.get("id") for a in added if a.get("content") == content), None)
                if isinstance(tid, int):
                    ids.setdefault(typ, tid)
    cfg = _read_json(folder / "config.json")
    for typ in _SPECIAL_TYPES:
        tid = cfg.get(f"{typ}_token_id")
        if tid is None:
            tid = (cfg.get("text_config") or {}).get(f"{typ}_token_id")
        if isinstance(tid, int) and not isinstance(tid, bool):
            ids.setdefault(typ, tid)
    for typ, tid in ids.items():
        getattr(w, f"add_{typ}_token_id")(tid)
    for typ, flag in add_flags.items():
        getattr(w, f"add_add_{typ}_token")(flag)
    if isinstance(chat_template, (str, list)):
        w.add_chat_template(chat_template)


def _chat_template_file(folder: Path) -> str | list[dict[str, str]] | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
        extra = sorted((folder / "additional_chat_templates").glob("*.jinja"))
        if not extra:
            return template
        return [{"name": "default", "template": template}] + [
            {"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in extra]
    js = folder / "chat_template.json"
    if js.is_file():
        return _read_json(js).get("chat_template")
    return None
