"""qwen35 hyper-parameters from GGUF metadata, and the tensor table they imply.

Key names and defaults follow llama.cpp's qwen35 loader in the pinned tree that
`deps/fetch_upstream.py` extracts into .deps/: `llama_model_base::load_hparams` in
src/llama-model.cpp and `llama_model_qwen35::load_arch_hparams` in src/models/qwen35.cpp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gguf import GGMLQuantizationType as T

from .errors import (HyperParameterError, MissingMetadataError, MissingTensorError, TensorShapeError,
                     UnsupportedArchitectureError, UnsupportedTensorTypeError)
from .gguf_file import GGUFFile

ARCH = "qwen35"
MAX_DIM = 1 << 20  # no real dimension comes near this; larger values mean a corrupt file

# Weight types a matmul may read (ggml's CPU and CUDA backends both handle these).
MATMUL_TYPES = frozenset({
    T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
    T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M, T.IQ4_NL, T.IQ4_XS, T.MXFP4,
})
# Vectors used by elementwise ops (norm weights, biases, decay, conv kernel) must be F32.
VECTOR_TYPES = frozenset({T.F32})


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling in ggml_rope_multi's terms; the defaults are plain RoPE."""
    kind: str = "none"        # rope.scaling.type: none, linear or yarn
    factor: float = 1.0       # context extension factor (rope.scaling.factor)
    freq_scale: float = 1.0   # 1 / factor
    ext_factor: float = 0.0   # YaRN's extrapolation mix (1 for YaRN)
    attn_factor: float = 1.0  # cos/sin scale before ggml multiplies in YaRN's 1 + 0.1 ln(factor)
    beta_fast: float = 32.0   # YaRN correction range, in rotations
    beta_slow: float = 1.0
    n_ctx_orig: int = 0       # YaRN's pre-training context (rope.scaling.original_context_length)


@dataclass
class Qwen35HParams:
    n_vocab: int
    n_embd: int
    n_layer: int            # trunk layers
    n_layer_nextn: int      # MTP layers stored after the trunk (not run yet)
    n_ctx_train: int
    rms_eps: float
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_freq_base: float
    rope_sections: list[int]
    ssm_conv_kernel: int
    ssm_state_size: int
    ssm_n_k_heads: int
    ssm_n_v_heads: int
    recurrent: list[bool] = field(repr=False)
    tied_output: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)

    @property
    def conv_channels(self) -> int:
        return (2 * self.ssm_n_k_heads + self.ssm_n_v_heads) * self.ssm_state_size

    @property
    def n_attention_layers(self) -> int:
        return self.recurrent.count(False)

    @property
    def recurrent_state_bytes(self) -> int:
        """F32 DeltaNet states plus conv windows of every recurrent layer, for one sequence."""
        per_layer = self.ssm_state_size ** 2 * self.ssm_n_v_heads + (self.ssm_conv_kernel - 1) * self.conv_channels
        return (self.n_layer - self.n_attention_layers) * per_layer * 4


def _get(f: GGUFFile, key: str, kind: type, default=None, required=False):
    full = f"{ARCH}.{key}"
    if full not in f.metadata and f.array(full) is None:
        if required:
            raise MissingMetadataError(f"{f.path}: required metadata key '{full}' is missing")
        return default
    value = f.metadata.get(full)
    if value is None:
        value = f.array(full)
    if kind is list:
        if not isinstance(value, list):
            raise HyperParameterError(f"{f.path}: metadata key '{full}' should be an array, got {value!r}")
        return value
    if isinstance(value, list):
        # per-layer arrays are allowed where the value is uniform (zeros mark layers without it)
        distinct = {v for v in value if v}
        if len(distinct) != 1:
            raise HyperParameterError(f"{f.path}: metadata key '{full}' varies per layer ({value}); "
                                      "deltaspec needs one value")
        value = distinct.pop()
    if kind is str and not isinstance(value, str):
        raise HyperParameterError(f"{f.path}: metadata key '{full}' should be a string, got {value!r}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise HyperParameterError(f"{f.path}: metadata key '{full}' should be an integer, got {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        raise HyperParameterError(f"{f.path}: metadata key '{full}' should be a number, got {value!r}")
    return kind(value)


def _dim(f: GGUFFile, key: str, value: int, lo: int = 1, hi: int = MAX_DIM) -> int:
    if not lo <= value <= hi:
        raise HyperParameterError(f"{f.path}: '{ARCH}.{key}' = {value} is outside the sane range [{lo}, {hi}]")
    return value


def mrope_sections(n_pairs: int) -> list[int]:
    """The M-RoPE sections (4 entries) that give every one of `n_pairs` rotary pairs a section under
    interleaved M-RoPE: [11, 11, 10, 0] for Qwen3.5's 32 pairs. With sections summing to n_pairs it
    is the only such split."""
    return [(n_pairs + 2) // 3, (n_pairs + 1) // 3, n_pairs // 3, 0]


def rope_sections_problem(sections: list[int], n_rot: int) -> str | None:
    """What is wrong with M-RoPE `sections` (4 entries) over `n_rot` rotary dims, or None.

    Interleaved M-RoPE (ggml's IMROPE, transformers' mrope_interleaved) gives pair i to section i % 3
    while i < 3 * that section's size. A pair left without a section is rotated by the text position in
    transformers but by the 4th position (0 for text) in llama.cpp and ggml, so such a file has no
    single meaning; real checkpoints never do it, and it is refused rather than silently computed
    one way."""
    n_pairs = n_rot // 2
    if any(x < 0 for x in sections) or sum(sections) != n_pairs:
        return f"{sections} must be >= 0 and sum to rope.dimension_count / 2 = {n_pairs}"
    orphans = [i for i in range(n_pairs) if not i < 3 * sections[i % 3]]
    if orphans:
        return (f"{sections} leave rotary pair(s) {orphans} of {n_pairs} without a section (pair i belongs to "
                f"section i % 3 while i < 3 * its size); transformers would rotate them by the text position, "
                f"llama.cpp by position 0. Expected {mrope_sections(n_pairs)}")
    return None


def _recurrent_layers(f: GGUFFile, n_layer_all: int, n_layer: int) -> list[bool]:
    flags = _get(f, "attention.recurrent_layers", list)
    if flags is not None:
        if len(flags) != n_layer_all:
            raise HyperParameterError(f"{f.path}: '{ARCH}.attention.recurrent_layers' has {len(flags)} entries, "
                                      f"expected block_count = {n_layer_all}")
        return [bool(x) for x in flags[:n_layer]]
    interval = _dim(f, "full_attention_interval", _get(f, "full_attention_interval", int, 4), 1, n_layer_all)
    return [(i + 1) % interval != 0 for i in range(n_layer)]


def _number(f: GGUFFile, key: str, default: float, lo: float = 0.0) -> float:
    """An optional float key that must be finite and > lo."""
    value = _get(f, key, float, default)
    if not (math.isfinite(value) and value > lo):
        raise HyperParameterError(f"{f.path}: '{ARCH}.{key}' = {value} must be a finite number > {lo}")
    return value


def _reject_unless(f: GGUFFile, key: str, neutral: float, why: str) -> None:
    value = _get(f, key, float, neutral)
    if value != neutral:
        raise HyperParameterError(f"{f.path}: '{ARCH}.{key}' = {value} is not supported (only {neutral}): {why}")


def _rope_scaling(f: GGUFFile, n_ctx_train: int) -> RopeScaling:
    """rope.scaling.* -> ggml_rope_multi's parameters, as llama.cpp derives them for qwen35
    (load_hparams, then llama_context's constructor) where llama.cpp and transformers agree.

    A missing type means linear, and a missing or zero factor means no scaling (llama.cpp). YaRN's
    beta_fast / beta_slow / attention factor follow the file when it has them, as transformers does
    with the config they were converted from (the pinned llama.cpp ignores these keys for qwen35 and
    always uses 32 / 1 / 1 + 0.1 ln(factor), so files that set them run differently there). Keys
    that neither reference defines for qwen35 are rejected rather than ignored."""
    kind = _get(f, "rope.scaling.type", str, "linear")
    if kind not in ("none", "linear", "yarn"):
        raise HyperParameterError(f"{f.path}: '{ARCH}.rope.scaling.type' = {kind!r} is not supported "
                                  "(none, linear, yarn)")
    _reject_unless(f, "rope.scaling.attn_factor", 1.0, "transformers has no such scale for qwen35")
    factor_key = "rope.scaling.factor" if f"{ARCH}.rope.scaling.factor" in f.metadata else "rope.scale_linear"
    factor = _get(f, factor_key, float, 0.0)
    if not (math.isfinite(factor) and factor >= 0.0):
        raise HyperParameterError(f"{f.path}: '{ARCH}.{factor_key}' = {factor} must be a finite number >= 0")
    if kind == "none" or factor == 0.0:
        return RopeScaling(n_ctx_orig=n_ctx_train)
    if kind == "linear":
        return RopeScaling("linear", factor, 1.0 / factor, n_ctx_orig=n_ctx_train)
    _reject_unless(f, "rope.scaling.yarn_ext_factor", 1.0, "transformers' YaRN always mixes fully")
    _reject_unless(f, "rope.scaling.yarn_log_multiplier", 0.0, "a DeepSeek-only YaRN variant")
    n_ctx_orig = _dim(f, "rope.scaling.original_context_length",
                      _get(f, "rope.scaling.original_context_length", int, n_ctx_train), 1, 1 << 24)
    # transformers' default attention factor; ggml multiplies 1 + 0.1 ln(factor) in by itself
    # whenever ext_factor != 0, so that part is divided out here (llama.cpp does the same)
    ggml_mscale = 1.0 + 0.1 * math.log(factor)
    if ggml_mscale <= 0.0:
        raise HyperParameterError(f"{f.path}: '{ARCH}.{factor_key}' = {factor} is too small for YaRN")
    attention = _number(f, "rope.scaling.yarn_attn_factor", max(ggml_mscale, 1.0))
    return RopeScaling("yarn", factor, 1.0 / factor, ext_factor=1.0, attn_factor=attention / ggml_mscale,
                       beta_fast=_number(f, "rope.scaling.yarn_beta_fast", 32.0),
                       beta_slow=_number(f, "rope.scaling.yarn_beta_slow", 1.0), n_ctx_orig=n_ctx_orig)


def read_hparams(f: GGUFFile) -> Qwen35HParams:
    arch = f.metadata.get("general.architecture")
    if arch is None:
        raise MissingMetadataError(f"{f.path}: required metadata key 'general.architecture' is missing")
    if arch != ARCH:
        raise UnsupportedArchitectureError(f"{f.path}: general.architecture is '{arch}', deltaspec runs '{ARCH}' "
                                           "(Qwen3.5 / Qwen3.6 dense)")
    req = dict(required=True)
    n_embd = _dim(f, "embedding_length", _get(f, "embedding_length", int, **req))
    n_layer_all = _dim(f, "block_count", _get(f, "block_count", int, **req), 1, 4096)
    n_nextn = _dim(f, "nextn_predict_layers", _get(f, "nextn_predict_layers", int, 0), 0, n_layer_all - 1)
    n_layer = n_layer_all - n_nextn
    n_head = _dim(f, "attention.head_count", _get(f, "attention.head_count", int, **req), 1, 4096)
    n_head_kv = _dim(f, "attention.head_count_kv", _get(f, "attention.head_count_kv", int, n_head), 1, n_head)
    if n_head % n_head_kv:
        raise HyperParameterError(f"{f.path}: attention.head_count {n_head} is not a multiple of "
                                  f"head_count_kv {n_head_kv}")
    head_dim = _dim(f, "attention.key_length", _get(f, "attention.key_length", int, n_embd // n_head))
    value_dim = _get(f, "attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise HyperParameterError(f"{f.path}: attention.value_length {value_dim} != key_length {head_dim}")
    n_rot = _dim(f, "rope.dimension_count", _get(f, "rope.dimension_count", int, head_dim), 2, head_dim)
    if n_rot % 2:
        raise HyperParameterError(f"{f.path}: rope.dimension_count {n_rot} must be even")
    sections = [int(x) for x in _get(f, "rope.dimension_sections", list, **req)]
    sections = (sections + [0, 0, 0, 0])[:4]
    problem = rope_sections_problem(sections, n_rot)
    if problem:
        raise HyperParameterError(f"{f.path}: '{ARCH}.rope.dimension_sections' = {problem}")
    rms_eps = _get(f, "attention.layer_norm_rms_epsilon", float, **req)
    if not 0.0 < rms_eps < 1.0:
        raise HyperParameterError(f"{f.path}: attention.layer_norm_rms_epsilon {rms_eps} is not in (0, 1)")
    freq_base = _get(f, "rope.freq_base", float, 10000.0)
    if not freq_base > 0.0:
        raise HyperParameterError(f"{f.path}: rope.freq_base {freq_base} must be > 0")

    conv_kernel = _dim(f, "ssm.conv_kernel", _get(f, "ssm.conv_kernel", int, **req), 2, 64)
    state = _dim(f, "ssm.state_size", _get(f, "ssm.state_size", int, **req), 1, 1024)
    n_k = _dim(f, "ssm.group_count", _get(f, "ssm.group_count", int, **req), 1, 4096)
    n_v = _dim(f, "ssm.time_step_rank", _get(f, "ssm.time_step_rank", int, **req), 1, 4096)
    inner = _get(f, "ssm.inner_size", int, **req)
    if n_v % n_k:
        raise HyperParameterError(f"{f.path}: ssm.time_step_rank (value heads) {n_v} is not a multiple of "
                                  f"ssm.group_count (key heads) {n_k}")
    if inner != n_v * state:
        raise HyperParameterError(f"{f.path}: ssm.inner_size {inner} != time_step_rank {n_v} * state_size {state}")

    n_ctx_train = _dim(f, "context_length", _get(f, "context_length", int, **req), 1, 1 << 24)
    recurrent = _recurrent_layers(f, n_layer_all, n_layer)

    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise MissingTensorError(f"{f.path}: tensor 'token_embd.weight' is missing")
    tokens = f.array("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if tokens is not None else (embd.shape[1] if len(embd.shape) > 1 else 0)
    return Qwen35HParams(
        n_vocab=_dim(f, "vocab", n_vocab, 1, 1 << 22), n_embd=n_embd, n_layer=n_layer, n_layer_nextn=n_nextn,
        n_ctx_train=n_ctx_train, rms_eps=rms_eps, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_rot=n_rot, rope_freq_base=freq_base, rope_sections=sections, ssm_conv_kernel=conv_kernel,
        ssm_state_size=state, ssm_n_k_heads=n_k, ssm_n_v_heads=n_v, recurrent=recurrent,
        tied_output="output.weight" not in f.tensors, rope_scaling=_rope_scaling(f, n_ctx_train))


def expected_tensors(hp: Qwen35HParams, f: GGUFFile) -> dict[str, tuple[tuple[int, ...], frozenset]]:
    """Name -> (ggml shape, allowed types) for every tensor the graph reads."""
    E, V, D = hp.n_embd, hp.n_vocab, hp.head_dim
    H, Hkv, S, Hv, C = hp.n_head, hp.n_head_kv, hp.ssm_state_size, hp.ssm_n_v_heads, hp.conv_channels
    want: dict[str, tuple[tuple[int, ...], frozenset]] = {
        "token_embd.weight": ((E, V), MATMUL_TYPES),
        "output_norm.weight": ((E,), VECTOR_TYPES),
    }
    if not hp.tied_output:
        want["output.weight"] = ((E, V), MATMUL_TYPES)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        up = f.tensors.get(b + "ffn_up.weight")
        n_ff = up.shape[1] if up is not None and len(up.shape) == 2 else -1
        want |= {
            b + "attn_norm.weight": ((E,), VECTOR_TYPES),
            b + "post_attention_norm.weight": ((E,), VECTOR_TYPES),
            b + "ffn_up.weight": ((E, n_ff), MATMUL_TYPES),
            b + "ffn_gate.weight": ((E, n_ff), MATMUL_TYPES),
            b + "ffn_down.weight": ((n_ff, E), MATMUL_TYPES),
        }
        if hp.recurrent[il]:
            want |= {
                b + "attn_qkv.weight": ((E, C), MATMUL_TYPES),
                b + "attn_gate.weight": ((E, Hv * S), MATMUL_TYPES),
                b + "ssm_beta.weight": ((E, Hv), MATMUL_TYPES),
                b + "ssm_alpha.weight": ((E, Hv), MATMUL_TYPES),
                b + "ssm_dt.bias": ((Hv,), VECTOR_TYPES),
                b + "ssm_a": ((Hv,), VECTOR_TYPES),
                b + "ssm_conv1d.weight": ((hp.ssm_conv_kernel, C), VECTOR_TYPES),
                b + "ssm_norm.weight": ((S,), VECTOR_TYPES),
                b + "ssm_out.weight": ((Hv * S, E), MATMUL_TYPES),
            }
        else:
            want |= {
                b + "attn_q.weight": ((E, 2 * H * D), MATMUL_TYPES),
                b + "attn_k.weight": ((E, Hkv * D), MATMUL_TYPES),
                b + "attn_v.weight": ((E, Hkv * D), MATMUL_TYPES),
                b + "attn_output.weight": ((H * D, E), MATMUL_TYPES),
                b + "attn_q_norm.weight": ((D,), VECTOR_TYPES),
                b + "attn_k_norm.weight": ((D,), VECTOR_TYPES),
            }
    return want


def _layer_kind_mismatch(hp: Qwen35HParams, f: GGUFFile, name: str) -> str | None:
    """Why a layer's tensor is missing when the file holds the other kind of layer there: the
    metadata's layer pattern (full_attention_interval or attention.recurrent_layers) disagrees with
    the tensors. Only Gated DeltaNet layers have ssm_a, only attention layers attn_q_norm, so a
    fused-QKV attention layer (which has neither of the other's) is not mistaken for one."""
    parts = name.split(".")
    if parts[0] != "blk" or not parts[1].isdigit():
        return None
    il = int(parts[1])
    other = f"blk.{il}.attn_q_norm.weight" if hp.recurrent[il] else f"blk.{il}.ssm_a"
    if other not in f.tensors:
        return None
    has, wants = ("full attention", "Gated DeltaNet") if hp.recurrent[il] else ("Gated DeltaNet", "full attention")
    return (f"layer {il} holds {has} tensors ('{other}'), but the metadata's layer pattern "
            f"('{ARCH}.full_attention_interval' or '{ARCH}.attention.recurrent_layers') makes it a {wants} layer")


def check_tensors(hp: Qwen35HParams, f: GGUFFile) -> None:
    for name, (shape, types) in expected_tensors(hp, f).items():
        info = f.tensors.get(name)
        if info is None:
            layer = _layer_kind_mismatch(hp, f, name)
            if layer:
                raise MissingTensorError(f"{f.path}: tensor '{name}' is missing: {layer}")
            fused = name.replace("attn_q.weight", "attn_qkv.weight")
            if fused != name and fused in f.tensors:
                # a missing tensor, not a bad type: the layout is what deltaspec does not run
                raise MissingTensorError(f"{f.path}: tensor '{name}' is missing: this file fuses the attention "
                                         f"Q/K/V projections into '{fused}' (llama.cpp's convert_hf_to_gguf.py "
                                         "--fuse-qkv); deltaspec needs separate attn_q/attn_k/attn_v, so convert "
                                         "without --fuse-qkv (or with `deltaspec convert`)")
            raise MissingTensorError(f"{f.path}: tensor '{name}' is missing")
        if info.shape != shape:
            # n_vocab comes from the token list, so a vocabulary mismatch surfaces here
            vocab = (f" (one row per token: tokenizer.ggml.tokens has {hp.n_vocab})"
                     if name in ("token_embd.weight", "output.weight") else "")
            raise TensorShapeError(f"{f.path}: tensor '{name}' has shape {list(info.shape)}, expected "
                                   f"{list(shape)}{vocab}")
        if info.type not in types:
            allowed = ", ".join(sorted(t.name for t in types))
            raise UnsupportedTensorTypeError(f"{f.path}: tensor '{name}' is {info.type.name}, expected one of "
                                             f"{allowed}")
