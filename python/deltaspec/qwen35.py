"""qwen35 hyper-parameters (read by the engine, csrc/hparams.cpp) and the tensor table they imply."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as T

from . import _core
from .errors import MissingTensorError, TensorShapeError, UnsupportedTensorTypeError
from .gguf_file import GGUFFile

ARCH = "qwen35"

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


# The hyper-parameters are the engine's own struct (csrc/hparams.h), read and checked by its GGUF
# reader (csrc/hparams.cpp): one definition and one reader for C++ and Python.
Qwen35HParams = _core.HParams


def read_hparams(f: GGUFFile) -> Qwen35HParams:
    """The hyper-parameters of `f` (already read by read_gguf, so structurally sound), from the
    engine's reader; problems raise MissingMetadataError, HyperParameterError,
    UnsupportedArchitectureError or MissingTensorError naming the file and the key."""
    return _core.read_hparams(f.path)


def mrope_sections(n_pairs: int) -> list[int]:
    """The M-RoPE sections (4 entries) that give every one of `n_pairs` rotary pairs a section under
    interleaved M-RoPE: [11, 11, 10, 0] for Qwen3.5's 32 pairs. With sections summing to n_pairs it
    is the only such split."""
    return list(_core.mrope_sections(n_pairs))


def rope_sections_problem(sections: list[int], n_rot: int) -> str | None:
    """What is wrong with M-RoPE `sections` over `n_rot` rotary dims, or None (the engine's rule,
    csrc/hparams.cpp: a rotary pair without a section has no single meaning and is refused)."""
    return _core.rope_sections_problem([int(x) for x in sections], n_rot) or None


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
