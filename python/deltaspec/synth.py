"""Synthetic Qwen3.5 GGUFs: the real checkpoints' shapes, metadata, tokenizer and quant mix, random weights.

    write_synthetic_gguf("qwen35-27b-q4km.gguf", "27b", "q4_k_m", seed=0)
    deltaspec synth --preset 27b --quant q4_k_m qwen35-27b-q4km.gguf

What is real:
* tensor names, ggml shapes and order, `qwen35.*` and `general.*` metadata of the released sizes
  (`PRESETS`; docs/reference/qwen35_ggml_spec.md §1.5, algorithms_brief.md §4.1). 2B is partly
  unverified (see its note).
* the tokenizer: `deltaspec.qwen_vocab.gguf_tokenizer_metadata()` (the real 248320-row vocabulary).
* the per-tensor ggml types: "f16" and "q8_0" as llama.cpp's convert_hf_to_gguf.py --outtype writes
  them, "q4_k_m" as llama-quantize Q4_K_M then turns such a file into (`tensor_plan`, rules below).

What is not: the weights are random, zero-mean, scaled so activations keep an O(1) RMS through all
layers and the logits have a std of about `LOGIT_STD` (`_init_std`).

Speed: quantizing billions of random floats would take hours, so each (ggml type, std) gets a pool of
`POOL_UNITS` random 256-value units quantized once with ggml's reference quantizer, and every
tensor row is filled with units drawn at random from the pool. Every ggml type here quantizes a
256-value unit independently of its neighbours (one K-quant super-block, eight Q8_0 blocks), so each
row is a valid row of that type, distributed like the quantization of iid N(0, std^2) values; rows
are all distinct (20+ units each). Data is produced by worker threads in chunks and streamed to
disk in file order, so memory stays at a few hundred MB whatever the model size.

Q4_K_M rules (llama.cpp src/llama-quant.cpp, `llama_tensor_get_type_impl`, as they apply to qwen35
tensor names; n_expert = 0, not Falcon, no imatrix, no overrides):
* not quantized (kept as the converter wrote them, F32): 1-D tensors (every norm, `ssm_a`,
  `ssm_dt.bias`), names not ending in "weight" (`ssm_a`), "_norm.weight", and `ssm_conv1d`;
* `output.weight` -> Q6_K; with tied embeddings (no `output.weight`) `token_embd.weight` -> Q6_K,
  untied `token_embd.weight` stays at the default Q4_K;
* "attn_v-like" tensors, i.e. names containing "attn_v.weight" or "attn_qkv.weight" (so the Gated
  DeltaNet `attn_qkv` counts too, and its dedicated ATTENTION_QKV -> Q5_K branch is unreachable):
  Q6_K when use_more_bits(i, n) else Q4_K, i = how many attn_v-like tensors llama-quantize visited
  before this one, n = their total count;
* `ffn_down`: Q6_K when use_more_bits(i, n_layer_all) else Q4_K, i = how many ffn_down were
  visited before, n_layer_all = block_count (trunk + MTP layers);
* everything else (attn_q/k/output, ffn_gate/up, attn_gate, ssm_alpha/beta/out, nextn.eh_proj) Q4_K;
* use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2 (integer division);
* a row length that the target type cannot block falls back (Q4_K -> Q5_0, Q6_K -> Q8_0, then F16),
  and `output` goes to Q8_0 then; no preset has such a row (all multiples of 256).
Not mapped: the 70B-only attn_v bump (`LLM_TYPE_70B`) and the n_expert == 8 rules cannot apply to
qwen35; the MXFP4/IQ*/Q2/Q3 branches belong to other file types.

Visiting order (which decides the counters above) is not the file order: llama.cpp's model loader
keeps the tensors in a map sorted by layer number ("blk.N." parsed as an integer; tensors outside
a block count as layer -1, so they come first) and then by name, and llama-quantize walks that map
(`_llama_loader_order`). Every qwen35 layer has exactly one attn_v-like tensor (attn_qkv in Gated
DeltaNet layers, attn_v in attention layers and the MTP layer) and one ffn_down, so in effect both
counters are the layer number: layer L gets Q6_K for both when use_more_bits(L, n_layer_all). The
file order (by Hugging Face name: `layers.0, layers.1, layers.10, ...`) would give other layers
Q6_K, e.g. blk.5.ffn_down and blk.6.attn_qkv (32 of 320 tensors differ for 0.8b), and another byte
count, since attn_qkv and attn_v differ in size. The loader's order depends on neither the file
order nor the shards (llama-quantize sorts by shard only with --keep-split), so a real checkpoint
quantized to Q4_K_M gets the same layers as this plan. tests/test_synth.py checks every preset's types
against `llama-quantize --dry-run` run on a header-only F16 file (`write_synthetic_gguf(hollow=True)`).

File order: the order convert_hf_to_gguf.py writes for a single-shard checkpoint, i.e. sorted by
Hugging Face tensor name (`lm_head` first, then `model.language_model.embed_tokens`, `layers.0`,
`layers.1`, `layers.10`, ..., `norm`, then `mtp.*`). It decides offsets only, not the quant mix.
"""

from __future__ import annotations

import functools
import math
import os
import struct
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import gguf
import numpy as np

from .atomic_write import gguf_written_to
from .cpu import default_threads
from .errors import DeltaspecError
from .qwen35_template import QWEN35_CHAT_TEMPLATE

ARCH = "qwen35"
_QT = gguf.GGMLQuantizationType
_FT = gguf.LlamaFileType

N_VOCAB = 248320  # every Qwen3.5 size [ext]; qwen_vocab.N_VOCAB (not imported: it needs tokenizers)
LOGIT_STD = 3.0   # target std of the logits (over the vocabulary) for a unit-RMS final hidden state
UNIT = 256        # values per pool unit: one K-quant super-block, 8 Q8_0 blocks
POOL_UNITS = 16384  # units per pool (a power of two <= 65536: indices are uint16)
CHUNK_UNITS = 1 << 17  # units per worker task (18 MB of Q4_K, 36 MB of Q8_0, 64 MB of F16)


class SynthError(DeltaspecError, ValueError):
    """A bad preset, quant type or output path for `write_synthetic_gguf`."""


# ---------------------------------------------------------------------------------------------
# presets


@dataclass(frozen=True)
class SynthPreset:
    """Hyper-parameters of one Qwen3.5 size, as its GGUF metadata states them."""
    name: str
    size_label: str
    n_layer: int            # trunk layers (block_count without the MTP layer)
    n_embd: int             # E
    n_ff: int               # dense SwiGLU width
    n_head: int             # H (full-attention query heads)
    n_head_kv: int          # Hkv
    ssm_n_k_heads: int      # Hk (ssm.group_count)
    ssm_n_v_heads: int      # Hv (ssm.time_step_rank)
    tied: bool              # no output.weight: the LM head is token_embd
    head_dim: int = 256     # D (attention.key_length = value_length)
    n_rot: int = 64         # head_dim * partial_rotary_factor 0.25
    ssm_state_size: int = 128  # S (linear_key_head_dim = linear_value_head_dim)
    ssm_conv_kernel: int = 4
    n_vocab: int = N_VOCAB
    full_attention_interval: int = 4
    n_ctx_train: int = 262144
    rope_freq_base: float = 1e7
    rms_eps: float = 1e-6
    rope_sections: tuple[int, int, int, int] = (11, 11, 10, 0)
    note: str = ""

    @property
    def conv_channels(self) -> int:  # C = 2*Hk*S + Hv*S
        return (2 * self.ssm_n_k_heads + self.ssm_n_v_heads) * self.ssm_state_size

    @property
    def ssm_inner_size(self) -> int:  # Dv = Hv*S
        return self.ssm_n_v_heads * self.ssm_state_size

    @property
    def recurrent(self) -> list[bool]:
        """Per trunk layer: True for Gated DeltaNet, False for gated full attention."""
        return [(i + 1) % self.full_attention_interval != 0 for i in range(self.n_layer)]

    @property
    def n_attention_layers(self) -> int:
        return self.recurrent.count(False)

    @property
    def recurrent_state_bytes(self) -> int:
        """f32 conv windows ((Kc-1) x C) and DeltaNet states (S x S x Hv) of the recurrent layers,
        as the engine allocates them per sequence (HParams::recurrent_state_bytes)."""
        per_layer = (self.ssm_conv_kernel - 1) * self.conv_channels + self.ssm_state_size ** 2 * self.ssm_n_v_heads
        return (self.n_layer - self.n_attention_layers) * per_layer * 4


# Sources: qwen35_ggml_spec.md §1.5 and algorithms_brief.md §4.1. Common to all: D 256, 64 rotary
# dims, S 128, conv kernel 4, vocab 248320, eps 1e-6, rope base 1e7, mrope [11,11,10,0], interval 4,
# context 262144 [ext]. The layer counts agree with llama.cpp's qwen35 size switch (24 -> 0.8B/2B,
# 32 -> 4B/9B, 64 -> 27B).
PRESETS: dict[str, SynthPreset] = {
    "0.8b": SynthPreset("0.8b", "0.8B", n_layer=24, n_embd=1024, n_ff=3584, n_head=8, n_head_kv=2,
                        ssm_n_k_heads=16, ssm_n_v_heads=16, tied=True),
    # UNVERIFIED: only hidden_size 2048 and 24 layers (llama.cpp's size switch) are confirmed. n_ff,
    # heads and tying follow the spec's table ("?" entries), i.e. 0.8B's layout with 2x width.
    # Plausibility: this preset's Q4_K_M is 1.25 GB; a published Qwen3.5-2B-Q4_K_M.gguf is 1.28 GB.
    "2b": SynthPreset("2b", "2B", n_layer=24, n_embd=2048, n_ff=6144, n_head=8, n_head_kv=2,
                      ssm_n_k_heads=16, ssm_n_v_heads=16, tied=True,
                      note="unverified: n_ff, heads, DeltaNet heads and tying are the spec's best guess"),
    "4b": SynthPreset("4b", "4B", n_layer=32, n_embd=2560, n_ff=9216, n_head=16, n_head_kv=4,
                      ssm_n_k_heads=16, ssm_n_v_heads=32, tied=True),
    "9b": SynthPreset("9b", "9B", n_layer=32, n_embd=4096, n_ff=12288, n_head=16, n_head_kv=4,
                      ssm_n_k_heads=16, ssm_n_v_heads=32, tied=False),
    "27b": SynthPreset("27b", "27B", n_layer=64, n_embd=5120, n_ff=17408, n_head=24, n_head_kv=4,
                       ssm_n_k_heads=16, ssm_n_v_heads=48, tied=False),
}

# Test-only sizes, same rules, not listed by the CLI: 4 layers (3 DeltaNet + 1 attention), Hv != Hk.
_PRIVATE_PRESETS: dict[str, SynthPreset] = {
    "_tiny": SynthPreset("_tiny", "tiny", n_layer=4, n_embd=256, n_ff=512, n_head=2, n_head_kv=1,
                         ssm_n_k_heads=2, ssm_n_v_heads=4, tied=False, note="test-only"),
    "_tiny_tied": SynthPreset("_tiny_tied", "tiny", n_layer=8, n_embd=256, n_ff=768, n_head=2, n_head_kv=1,
                              ssm_n_k_heads=1, ssm_n_v_heads=2, tied=True, note="test-only"),
}

QUANTS: dict[str, tuple[gguf.LlamaFileType, gguf.GGMLQuantizationType]] = {
    "q4_k_m": (_FT.MOSTLY_Q4_K_M, _QT.Q4_K),
    "q8_0": (_FT.MOSTLY_Q8_0, _QT.Q8_0),
    "f16": (_FT.MOSTLY_F16, _QT.F16),
}


def get_preset(preset: str | SynthPreset) -> SynthPreset:
    if isinstance(preset, SynthPreset):
        return preset
    p = (PRESETS.get(preset) or _PRIVATE_PRESETS.get(preset)) if isinstance(preset, str) else None
    if p is None:
        raise SynthError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    return p


def _check_quant(quant: str) -> None:
    if quant not in QUANTS:
        raise SynthError(f"unknown quant {quant!r}; expected one of {', '.join(QUANTS)}")


# ---------------------------------------------------------------------------------------------
# tensor plan


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]   # ggml order: shape[0] is the row length
    qtype: gguf.GGMLQuantizationType
    init: str                # "normal" (zero-mean, `std`), "norm" (1 + N(0, std)), "ssm_a", "dt_bias"
    std: float
    hf_name: str             # Hugging Face name, which orders the file

    @property
    def n_bytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        rows = math.prod(self.shape[1:])
        return rows * self.shape[0] // block * type_size


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fallback(qtype: gguf.GGMLQuantizationType, ne0: int) -> gguf.GGMLQuantizationType:
    """llama-quant.cpp's tensor_type_fallback for the types a Q4_K_M file uses."""
    if ne0 % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    qtype = {_QT.Q4_K: _QT.Q5_0, _QT.Q5_K: _QT.Q5_1, _QT.Q6_K: _QT.Q8_0}.get(qtype, qtype)
    return qtype if ne0 % gguf.GGML_QUANT_SIZES[qtype][0] == 0 else _QT.F16


def _converter_type(name: str, shape: tuple[int, ...], default: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """Type convert_hf_to_gguf.py --outtype writes: 1-D, norms, ssm_conv1d and non-".weight" stay
    F32; rows a block type cannot hold fall back to F16."""
    if (len(shape) <= 1 or name.endswith("_norm.weight") or ".ssm_conv1d." in name
            or not name.endswith(".weight")):
        return _QT.F32
    return default if shape[0] % gguf.GGML_QUANT_SIZES[default][0] == 0 else _QT.F16


def _llama_loader_order(names: Sequence[str]) -> list[int]:
    """Indices of `names` in the order llama.cpp's model loader keeps (and llama-quantize visits)
    tensors: by the layer number of a "blk.N." prefix (none: -1), then by name."""
    def key(i: int) -> tuple[int, str]:
        name = names[i]
        layer = -1
        if name.startswith("blk."):
            digits = name[4:].split(".", 1)[0]
            if digits.isdigit():
                layer = int(digits)
        return layer, name
    return sorted(range(len(names)), key=key)


def _q4_k_m_types(names: Sequence[str], shapes: Sequence[tuple[int, ...]], base: Sequence[gguf.GGMLQuantizationType],
                  n_layer_all: int) -> list[gguf.GGMLQuantizationType]:
    """llama-quantize Q4_K_M applied to a file whose types are `base` (the f16 mix); the result is in
    the order of `names`, the counters run in llama-quantize's visiting order."""
    tied = "output.weight" not in names
    n_attn_v = sum(1 for n in names if "attn_v.weight" in n or "attn_qkv.weight" in n)
    i_attn_v = i_ffn_down = 0
    out: list[gguf.GGMLQuantizationType] = list(base)
    for k in _llama_loader_order(names):
        name, shape = names[k], shapes[k]
        if (len(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name or "ssm_conv1d" in name):
            continue  # tensor_allows_quantization is false: the type stays as converted
        t = _QT.Q4_K
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            t = _QT.Q6_K if shape[0] % gguf.GGML_QUANT_SIZES[_QT.Q4_K][0] == 0 else _QT.Q8_0
        elif name == "token_embd.weight":
            pass
        elif "attn_v.weight" in name or "attn_qkv.weight" in name:
            if _use_more_bits(i_attn_v, n_attn_v):
                t = _QT.Q6_K
            i_attn_v += 1
        elif "ffn_down" in name:
            if _use_more_bits(i_ffn_down, n_layer_all):
                t = _QT.Q6_K
            i_ffn_down += 1
        out[k] = _fallback(t, shape[0])
    return out


def _hf_prefix(i: int, n_layer: int) -> str:
    return f"model.language_model.layers.{i}." if i < n_layer else f"mtp.layers.{i - n_layer}."


def tensor_plan(preset: str | SynthPreset, quant: str, *, mtp: bool = False) -> list[PlannedTensor]:
    """Every tensor of the synthetic file in file order, with its ggml shape, type and init."""
    p = get_preset(preset)
    _check_quant(quant)
    E, V, F, D = p.n_embd, p.n_vocab, p.n_ff, p.head_dim
    H, Hkv, S, Hv, C, K = p.n_head, p.n_head_kv, p.ssm_state_size, p.ssm_n_v_heads, p.conv_channels, p.ssm_conv_kernel
    n_layer_all = p.n_layer + (1 if mtp else 0)
    out_gain = 1.0 / math.sqrt(2 * p.n_layer)  # residual branches: GPT-2 style 1/sqrt(2L)
    norm_std = 0.05

    def w(fan_in: int, gain: float = 1.0) -> tuple[str, float]:
        return "normal", gain / math.sqrt(fan_in)

    # (hf name, gguf name, ggml shape, (init, std))
    raw: list[tuple[str, str, tuple[int, ...], tuple[str, float]]] = [
        ("model.language_model.embed_tokens.weight", "token_embd.weight", (E, V), w(E, LOGIT_STD)),
        ("model.language_model.norm.weight", "output_norm.weight", (E,), ("norm", norm_std)),
    ]
    if not p.tied:
        raw.append(("lm_head.weight", "output.weight", (E, V), w(E, LOGIT_STD)))
    for i in range(n_layer_all):
        hf, b = _hf_prefix(i, p.n_layer), f"blk.{i}."
        recurrent = i < p.n_layer and p.recurrent[i]
        raw += [
            (hf + "input_layernorm.weight", b + "attn_norm.weight", (E,), ("norm", norm_std)),
            (hf + "post_attention_layernorm.weight", b + "post_attention_norm.weight", (E,), ("norm", norm_std)),
            (hf + "mlp.gate_proj.weight", b + "ffn_gate.weight", (E, F), w(E)),
            (hf + "mlp.up_proj.weight", b + "ffn_up.weight", (E, F), w(E)),
            (hf + "mlp.down_proj.weight", b + "ffn_down.weight", (F, E), w(F, out_gain)),
        ]
        if recurrent:
            la = hf + "linear_attn."
            raw += [
                (la + "in_proj_qkv.weight", b + "attn_qkv.weight", (E, C), w(E)),
                (la + "in_proj_z.weight", b + "attn_gate.weight", (E, Hv * S), w(E)),
                (la + "in_proj_b.weight", b + "ssm_beta.weight", (E, Hv), w(E)),
                (la + "in_proj_a.weight", b + "ssm_alpha.weight", (E, Hv), w(E)),
                (la + "conv1d.weight", b + "ssm_conv1d.weight", (K, C), w(K)),
                (la + "dt_bias", b + "ssm_dt.bias", (Hv,), ("dt_bias", 0.5)),
                (la + "A_log", b + "ssm_a", (Hv,), ("ssm_a", 0.0)),
                (la + "norm.weight", b + "ssm_norm.weight", (S,), ("norm", norm_std)),  # plain w, ~1
                (la + "out_proj.weight", b + "ssm_out.weight", (Hv * S, E), w(Hv * S, out_gain)),
            ]
        else:
            sa = hf + "self_attn."
            raw += [
                (sa + "q_proj.weight", b + "attn_q.weight", (E, 2 * H * D), w(E)),
                (sa + "k_proj.weight", b + "attn_k.weight", (E, Hkv * D), w(E)),
                (sa + "v_proj.weight", b + "attn_v.weight", (E, Hkv * D), w(E)),
                (sa + "o_proj.weight", b + "attn_output.weight", (H * D, E), w(H * D, out_gain)),
                (sa + "q_norm.weight", b + "attn_q_norm.weight", (D,), ("norm", norm_std)),
                (sa + "k_norm.weight", b + "attn_k_norm.weight", (D,), ("norm", norm_std)),
            ]
        if i >= p.n_layer:  # the MTP block's extra tensors (converter's _QwenMtpMixin names)
            raw += [
                ("mtp.fc.weight", b + "nextn.eh_proj.weight", (2 * E, E), w(2 * E)),
                ("mtp.pre_fc_norm_embedding.weight", b + "nextn.enorm.weight", (E,), ("norm", norm_std)),
                ("mtp.pre_fc_norm_hidden.weight", b + "nextn.hnorm.weight", (E,), ("norm", norm_std)),
                ("mtp.norm.weight", b + "nextn.shared_head_norm.weight", (E,), ("norm", norm_std)),
            ]
    raw.sort(key=lambda r: r[0])

    fp16_default = _QT.F16 if quant != "q8_0" else _QT.Q8_0
    base = [_converter_type(g, shape, fp16_default) for _, g, shape, _ in raw]
    if quant == "q4_k_m":
        types = _q4_k_m_types([r[1] for r in raw], [r[2] for r in raw], base, n_layer_all)
    else:
        types = base
    return [PlannedTensor(g, shape, t, init, std, hf) for (hf, g, shape, (init, std)), t in zip(raw, types)]


def decode_weight_bytes(preset: str | SynthPreset, quant: str) -> int:
    """Weight bytes one decoded token reads: every trunk matrix and vector, the LM head (token_embd
    when tied), and one embedding row. KV cache and recurrent state traffic are not included."""
    p = get_preset(preset)
    plan = {t.name: t for t in tensor_plan(p, quant)}
    embd = plan["token_embd.weight"]
    total = sum(t.n_bytes for t in plan.values() if t.name != "token_embd.weight")
    return total + (embd.n_bytes if p.tied else embd.n_bytes // p.n_vocab)


def type_bytes(plan: Sequence[PlannedTensor]) -> dict[str, int]:
    """ggml type name -> bytes of tensor data in `plan`, largest first."""
    mix: dict[str, int] = {}
    for t in plan:
        mix[t.qtype.name] = mix.get(t.qtype.name, 0) + t.n_bytes
    return dict(sorted(mix.items(), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------------------------
# random data


def _quantize_units(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """(n, UNIT) float32 -> (n, unit_bytes) uint8 in ggml's format."""
    if qtype == _QT.F32:
        return values.astype(np.float32).view(np.uint8)
    if qtype == _QT.F16:
        return values.astype(np.float16).view(np.uint8)
    try:
        from . import _core
    except ImportError:
        _core = None
    if _core is not None:
        return np.asarray(_core.quantize(np.ascontiguousarray(values, dtype=np.float32), int(qtype)))
    try:  # gguf-py quantizes Q8_0 and a few others, but no k-quants
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        raise SynthError(f"writing {qtype.name} needs the native deltaspec._core (not built)") from None


class _Pools:
    """Per (type, std): POOL_UNITS quantized units of iid N(0, std^2) values, built on first use."""

    def __init__(self, seed: int, n_units: int = POOL_UNITS):
        self.seed, self.n_units = seed, n_units
        self._pools: dict[tuple[int, float], np.ndarray] = {}
        self._locks: dict[tuple[int, float], threading.Lock] = {}
        self._lock = threading.Lock()

    def build(self, qtype: gguf.GGMLQuantizationType, std: float) -> np.ndarray:
        key = (int(qtype), float(std))
        pool = self._pools.get(key)
        if pool is not None:
            return pool
        with self._lock:
            key_lock = self._locks.setdefault(key, threading.Lock())
        with key_lock:  # one thread quantizes a pool; the others wait for it
            pool = self._pools.get(key)
            if pool is None:
                # seeded by std alone: every type's pool quantizes the same floats
                rng = np.random.default_rng([self.seed, 1, int(np.float64(std).view(np.uint64))])
                values = rng.standard_normal((self.n_units, UNIT), dtype=np.float32) * np.float32(std)
                units = np.ascontiguousarray(_quantize_units(values, qtype))
                pool = units.view(np.dtype((np.void, units.shape[1]))).reshape(-1)
                self._pools[key] = pool
        return pool


def _small_tensor(t: PlannedTensor, rng: np.random.Generator) -> np.ndarray:
    """F32 tensors (norms, ssm_a, dt bias, conv kernel): generated directly."""
    n = math.prod(t.shape)
    if t.init == "norm":  # stored 1+w (ssm_norm: plain w, also ~1)
        x = 1.0 + t.std * rng.standard_normal(n)
    elif t.init == "ssm_a":  # -exp(A_log), A log-uniform in [1/64, 16]: slow to fast decays
        x = -np.exp(rng.uniform(math.log(1 / 64), math.log(16), n))
    elif t.init == "dt_bias":  # HF initialises dt_bias to ones
        x = 1.0 + t.std * rng.standard_normal(n)
    else:
        x = t.std * rng.standard_normal(n)
    return x.astype(np.float32)


def _tensor_chunks(t: PlannedTensor, index: int, seed: int, pools: _Pools) -> list[Callable[[], np.ndarray]]:
    """Jobs that produce `t`'s data in order, CHUNK_UNITS units each. The unit indices depend on
    (seed, tensor, chunk) only, so one seed gives the same float weights in every quant."""
    if t.init != "normal" or t.shape[0] % UNIT:
        # vectors, the conv kernel and odd row lengths: generated value by value (all small)
        def direct() -> np.ndarray:
            x = _small_tensor(t, np.random.default_rng([seed, 2, index]))
            return x if t.qtype == _QT.F32 else _quantize_units(x.reshape(-1, t.shape[0]), t.qtype)
        return [direct]
    n_units = math.prod(t.shape) // UNIT
    per_chunk = CHUNK_UNITS

    def job(c: int, lo: int, hi: int) -> np.ndarray:
        pool = pools.build(t.qtype, t.std)
        rng = np.random.default_rng([seed, 3, index, c])
        idx = np.frombuffer(rng.bytes(2 * (hi - lo)), dtype=np.uint16)
        if len(pool) != 65536:
            idx = idx & np.uint16(len(pool) - 1)
        return pool[idx.astype(np.intp)]

    return [lambda c=c, lo=lo: job(c, lo, min(lo + per_chunk, n_units))
            for c, lo in enumerate(range(0, n_units, per_chunk))]


# ---------------------------------------------------------------------------------------------
# writer


@dataclass
class SynthResult:
    path: Path
    n_bytes: int                 # file size
    seconds: float               # whole call, vocabulary and pools included
    type_bytes: dict[str, int] = field(default_factory=dict)  # ggml type -> tensor data bytes

    @property
    def mb_per_s(self) -> float:
        return self.n_bytes / 1e6 / self.seconds if self.seconds > 0 else float("inf")


def _add_metadata(w: gguf.GGUFWriter, p: SynthPreset, quant: str, seed: int, mtp: bool,
                  chat_template: str | None) -> None:
    ftype = QUANTS[quant][0]
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"Qwen3.5-{p.size_label} (synthetic)")
    w.add_basename("Qwen3.5")
    w.add_size_label(p.size_label)
    w.add_description(f"deltaspec synth: random weights (seed {seed}) with the shapes, metadata, tokenizer "
                      f"and {quant.upper()} tensor types of Qwen3.5-{p.size_label}; not a trained model")
    n_layer_all = p.n_layer + (1 if mtp else 0)
    # same keys and order as convert_hf_to_gguf.py for Qwen3_5ForConditionalGeneration
    w.add_block_count(n_layer_all)
    w.add_context_length(p.n_ctx_train)
    w.add_embedding_length(p.n_embd)
    w.add_feed_forward_length(p.n_ff)
    w.add_head_count(p.n_head)
    w.add_head_count_kv(p.n_head_kv)
    w.add_rope_dimension_sections(list(p.rope_sections))
    w.add_rope_freq_base(p.rope_freq_base)
    w.add_layer_norm_rms_eps(p.rms_eps)
    w.add_key_length(p.head_dim)
    w.add_value_length(p.head_dim)
    w.add_file_type(ftype)
    w.add_ssm_conv_kernel(p.ssm_conv_kernel)
    w.add_ssm_state_size(p.ssm_state_size)
    w.add_ssm_group_count(p.ssm_n_k_heads)
    w.add_ssm_time_step_rank(p.ssm_n_v_heads)
    w.add_ssm_inner_size(p.ssm_inner_size)
    w.add_array(f"{ARCH}.attention.recurrent_layers", p.recurrent + [False] * (n_layer_all - p.n_layer))
    w.add_full_attention_interval(p.full_attention_interval)
    w.add_rope_dimension_count(p.n_rot)
    if mtp:
        w.add_uint32(f"{ARCH}.nextn_predict_layers", n_layer_all - p.n_layer)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(w, QWEN35_CHAT_TEMPLATE if chat_template is None else chat_template)


class _PackedArray:
    """A GGUF array value already in its on-disk form (element type, count, items)."""

    def __init__(self, data: bytes):
        self.data = data

    def __len__(self) -> int:  # GGUFWriter checks arrays are non-empty sequences before packing
        return 1


class _Writer(gguf.GGUFWriter):
    """GGUFWriter that writes `_PackedArray` values as they are: packing the 248k-token vocabulary and
    247k merges element by element through gguf-py takes seconds; this takes none after the first."""

    def _pack_val(self, val: Any, vtype: gguf.GGUFValueType, add_vtype: bool,
                  sub_type: gguf.GGUFValueType | None = None) -> bytes:
        if isinstance(val, _PackedArray):
            return (struct.pack("<I", vtype) if add_vtype else b"") + val.data
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def _pack_strings(items: Sequence[str]) -> _PackedArray:
    enc = [s.encode("utf-8") for s in items]
    head = struct.pack("<IQ", gguf.GGUFValueType.STRING, len(enc))
    return _PackedArray(head + b"".join(struct.pack("<Q", len(b)) + b for b in enc))


def _pack_int32(items: Sequence[int]) -> _PackedArray:
    head = struct.pack("<IQ", gguf.GGUFValueType.INT32, len(items))
    return _PackedArray(head + np.asarray(items, dtype="<i4").tobytes())


@functools.lru_cache(maxsize=1)
def _packed_vocab() -> dict[str, _PackedArray]:
    from .qwen_vocab import gguf_tokenizer_metadata

    meta = gguf_tokenizer_metadata()
    return {"tokenizer.ggml.tokens": _pack_strings(meta["tokenizer.ggml.tokens"]),
            "tokenizer.ggml.token_type": _pack_int32(meta["tokenizer.ggml.token_type"]),
            "tokenizer.ggml.merges": _pack_strings(meta["tokenizer.ggml.merges"])}


def _add_tokenizer(w: gguf.GGUFWriter, chat_template: str | None) -> None:
    from .qwen_vocab import gguf_tokenizer_metadata

    typed = {
        "tokenizer.ggml.model": w.add_tokenizer_model, "tokenizer.ggml.pre": w.add_tokenizer_pre,
        "tokenizer.ggml.bos_token_id": w.add_bos_token_id, "tokenizer.ggml.eos_token_id": w.add_eos_token_id,
        "tokenizer.ggml.padding_token_id": w.add_pad_token_id, "tokenizer.ggml.add_bos_token": w.add_add_bos_token,
        "tokenizer.chat_template": w.add_chat_template,
    }
    packed = _packed_vocab()
    for key, value in gguf_tokenizer_metadata(chat_template).items():
        if key in packed:
            w.add_key_value(key, packed[key], gguf.GGUFValueType.ARRAY)
        elif key in typed:
            typed[key](value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)


def write_synthetic_gguf(path: str | os.PathLike[str], preset: str | SynthPreset, quant: str, seed: int = 0,
                         progress: Callable[[int, int, str], None] | None = None, *, mtp: bool = False,
                         chat_template: str | None = None, threads: int | None = None,
                         hollow: bool = False) -> SynthResult:
    """Write a synthetic qwen35 GGUF for `preset` (a `PRESETS` key) in `quant` ("q4_k_m", "q8_0",
    "f16"); the same arguments always give the same bytes.

    `progress(bytes_done, bytes_total, tensor_name)` is called after each tensor. `mtp` adds the MTP
    (NextN) layer the pinned converter exports by default (the engine does not run it; off by default,
    like `deltaspec convert`). `threads` producing data defaults to the usable CPUs.
    `chat_template` (Jinja text) goes into `tokenizer.chat_template`; None writes the Qwen3.5 template
    (deltaspec.qwen35_template), so a synthetic model chats like a real checkpoint.
    `hollow` writes the header, metadata and tensor infos only and extends the file to its full
    size with a hole: no disk used, the tensor data reads as zeros. It is for tools that read only
    the header (llama-quantize --dry-run), not a model to run.
    Raises SynthError for an unknown preset or quant or a bad output path.
    """
    t0 = time.perf_counter()
    p = get_preset(preset)
    _check_quant(quant)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise SynthError(f"seed must be a non-negative integer, got {seed!r}")
    out = Path(path)
    if out.is_dir() or not out.resolve().parent.is_dir():
        raise SynthError(f"{out}: expected a file path in an existing folder")
    plan = tensor_plan(p, quant, mtp=mtp)
    threads = threads or default_threads()

    writer = _Writer(path=None, arch=ARCH)
    for t in plan:
        shape = tuple(reversed(t.shape))  # numpy order
        if t.qtype in (_QT.F32, _QT.F16):
            dtype = np.dtype(np.float32 if t.qtype == _QT.F32 else np.float16)
        else:
            dtype, shape = np.dtype(np.uint8), gguf.quant_shape_to_byte_shape(shape, t.qtype)
        writer.add_tensor_info(t.name, shape, dtype, t.n_bytes, raw_dtype=t.qtype)
    _add_metadata(writer, p, quant, seed, mtp, chat_template)

    align = writer.data_alignment
    with gguf_written_to(out, writer) as tmp:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        _pad(fout, align)
        if hollow:  # GGUFWriter pads every tensor's data to the alignment
            fout.truncate(fout.tell() + sum(-(-t.n_bytes // align) * align for t in plan))
        else:
            _write_data(fout, plan, seed, threads, align, progress)
    return SynthResult(out, out.stat().st_size, time.perf_counter() - t0, type_bytes(plan))


def _write_data(fout: Any, plan: Sequence[PlannedTensor], seed: int, threads: int, align: int,
                progress: Callable[[int, int, str], None] | None) -> None:
    """Every tensor's data in file order, each padded to `align`, produced by `threads` workers."""
    total = sum(t.n_bytes for t in plan)
    pools = _Pools(seed)
    done = 0
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="synth") as ex:
        jobs = ((t, job) for i, t in enumerate(plan) for job in _tensor_chunks(t, i, seed, pools))
        pending: deque = deque()
        current, written = None, 0

        def finish_tensor() -> None:
            nonlocal done
            if written != current.n_bytes:
                raise AssertionError(f"{current.name}: wrote {written} bytes, expected {current.n_bytes}")
            _pad(fout, align)
            done += current.n_bytes
            if progress is not None:
                progress(done, total, current.name)

        def drain_one() -> None:
            nonlocal current, written
            t, fut = pending.popleft()
            if t is not current:
                if current is not None:
                    finish_tensor()
                current, written = t, 0
            data = fut.result()
            fout.write(memoryview(data).cast("B"))
            written += data.nbytes

        for t, job in jobs:
            pending.append((t, ex.submit(job)))
            if len(pending) >= threads + 4:
                drain_one()
        while pending:
            drain_one()
        if current is not None:
            finish_tensor()


def _pad(f: Any, align: int) -> None:
    pad = -f.tell() % align
    if pad:
        f.write(b"\0" * pad)


def print_progress(stream=sys.stderr) -> Callable[[int, int, str], None]:
    """A `progress` callback printing a line each time another 5% of the data is written."""
    state = {"next": 0.0, "t0": time.perf_counter()}

    def report(done: int, total: int, name: str) -> None:
        frac = done / total if total else 1.0
        if frac >= state["next"] or done == total:
            dt = time.perf_counter() - state["t0"]
            print(f"  {100 * frac:5.1f}%  {done / 1e9:7.2f} / {total / 1e9:.2f} GB  {done / 1e6 / max(dt, 1e-9):7.0f} MB/s"
                  f"  {name}", file=stream, flush=True)
            state["next"] = math.floor(frac * 20 + 1) / 20

    return report
