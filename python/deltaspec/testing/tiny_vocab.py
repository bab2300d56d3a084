"""A tiny random qwen35 GGUF with a tiny byte-level vocabulary, written with numpy + gguf only.

The tiny HF checkpoints of `tiny_models` keep the real 248k vocabulary (for the converter), which
makes every load and every softmax expensive. This model has ~265 tokens: the 256 bytes (id == byte
value, texts in GPT-2's byte-to-unicode form), a few BPE merges, and the control tokens
`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (eos). It loads in milliseconds, a token costs well
under a millisecond on a CPU, and a full next-token distribution fits in a chi-square test.

Weights are scaled so the next-token softmax is peaked but not one-hot (entropy of a few bits, see
`DEFAULT_LOGIT_STD`) and changes with the context, which is what statistical sampling tests need.

    path = tiny_vocab_model_path()            # written once per process, in a temp folder
    model = deltaspec.Model(path, n_ctx=512)
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from typing import Callable
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from ..qwen35 import mrope_sections
from ..tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED, byte_to_unicode

# BPE merges as byte pairs, in rank order; each adds the concatenation as a token after the bytes.
MERGE_PAIRS: tuple[tuple[bytes, bytes], ...] = (
    (b" ", b"t"), (b"h", b"e"), (b"i", b"n"), (b" t", b"he"), (b"e", b"r"), (b"a", b"n"),
)
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TEXT = "<|im_end|>"  # as Qwen instruct checkpoints; <|endoftext|> is the pad (both end generation)
MIN_VOCAB = 256 + len(MERGE_PAIRS) + len(CONTROL_TOKENS)

# Std of the logits at the LM head (the final RMSNorm makes the hidden state unit-RMS). Measured on
# the default model (seed 0), first-step softmax over all 265 one-token prompts: entropy median
# 4.6 bits (10th percentile 3.0, min 0.85), top probability median 0.24 (max 0.91). The tail is
# thin (median smallest probability ~1e-7), so chi-square tests should pool rare tokens into a bin.
DEFAULT_LOGIT_STD = 2.5


@dataclass(frozen=True)
class TinyShape:
    """Model dimensions. Every value is legal for ggml's CPU and CUDA kernels: head_dim 64 (CUDA
    flash attention and its vector kernel need D % 64 == 0), DeltaNet S = 32, and conv channels
    C = (2*Hk + Hv) * S = 128."""
    n_embd: int = 64
    n_layer: int = 4               # with full_attention_interval 4: layers 0-2 DeltaNet, 3 attention
    full_attention_interval: int = 4
    n_ff: int = 128
    n_head: int = 2
    n_head_kv: int = 1
    head_dim: int = 64
    ssm_state: int = 32
    ssm_k_heads: int = 1
    ssm_v_heads: int = 2
    conv_kernel: int = 4
    n_ctx_train: int = 4096
    logit_std: float = DEFAULT_LOGIT_STD
    # Scale of every residual branch's output projection (ssm_out, attn_output, ffn_down). At 0 the
    # next token depends on the current token alone, though every layer still computes: greedy text
    # then settles into a cycle, a model whose output repeats itself (for prompt-lookup drafting).
    branch_scale: float = 1.0
    # An MTP layer after the trunk (blk.{n_layer}, nextn_predict_layers = 1), as Qwen3.5 files carry
    # one. Its eh_proj passes the embedding half through and adds mtp_hidden_scale times a random
    # mix of the hidden half; its attention and FFN outputs are scaled by mtp_branch_scale (by
    # default branch_scale, like the trunk's); its head is the trunk's (no shared_head_head), its head norm the trunk's output norm
    # (as shared_head_norm, so a test can sharpen it). With branch_scale 0 and mtp_hidden_scale 0 it
    # predicts exactly what the target predicts one token later (an oracle drafter); a larger scale
    # makes its drafts depend on the hidden state each token is paired with, and agree in part.
    mtp: bool = False
    mtp_hidden_scale: float = 0.0
    mtp_branch_scale: float | None = None  # the MTP block's own branch scale (None: branch_scale)

    @property
    def n_rot(self) -> int:
        return self.head_dim // 4  # Qwen3.5's partial_rotary_factor 0.25

    @property
    def rope_sections(self) -> list[int]:
        # the split real checkpoints use, scaled down: every rotary pair in a section (qwen35.py)
        return mrope_sections(self.n_rot // 2)

    @property
    def conv_channels(self) -> int:
        return (2 * self.ssm_k_heads + self.ssm_v_heads) * self.ssm_state


def tiny_vocab(n_vocab: int = MIN_VOCAB) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) for `tokenizer.ggml.*`: bytes, merge results, control tokens,
    then `[PADi]` rows of type UNUSED up to n_vocab (as Qwen pads its vocabulary)."""
    if n_vocab < MIN_VOCAB:
        raise ValueError(f"n_vocab must be at least {MIN_VOCAB} (bytes + merges + control tokens), got {n_vocab}")
    b2u = byte_to_unicode()

    def text(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    tokens = [b2u[b] for b in range(256)]
    merges = [f"{text(a)} {text(b)}" for a, b in MERGE_PAIRS]
    tokens += [text(a + b) for a, b in MERGE_PAIRS]
    types = [TOKEN_NORMAL] * len(tokens)
    tokens += list(CONTROL_TOKENS)
    types += [TOKEN_CONTROL] * len(CONTROL_TOKENS)
    n_pad = n_vocab - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(n_pad)]
    types += [TOKEN_UNUSED] * n_pad
    return tokens, types, merges


def _weights(sh: TinyShape, n_vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """name -> float32 array in numpy order (ggml shape reversed). Scales follow `tiny_models`:
    matrices N(0, 1/fan_in) so every sub-layer outputs ~unit variance, norms 1 + N(0, 0.1) (the
    converter bakes Qwen's +1 into them), mild DeltaNet decays so the state carries context."""
    E, F, D, H, Hkv = sh.n_embd, sh.n_ff, sh.head_dim, sh.n_head, sh.n_head_kv
    S, Hk, Hv, C = sh.ssm_state, sh.ssm_k_heads, sh.ssm_v_heads, sh.conv_channels

    def mat(n_out: int, n_in: int) -> np.ndarray:
        return rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.standard_normal(n)

    w = {
        # unit-variance embeddings: the token itself stays visible next to the sub-layer outputs
        "token_embd.weight": rng.standard_normal((n_vocab, E)),
        "output_norm.weight": norm(E),
        "output.weight": rng.standard_normal((n_vocab, E)) * (sh.logit_std / np.sqrt(E)),
    }
    for i in range(sh.n_layer):
        b = f"blk.{i}."
        w |= {b + "attn_norm.weight": norm(E), b + "post_attention_norm.weight": norm(E),
              b + "ffn_gate.weight": mat(F, E), b + "ffn_up.weight": mat(F, E),
              b + "ffn_down.weight": sh.branch_scale * mat(E, F)}
        if (i + 1) % sh.full_attention_interval:  # Gated DeltaNet layer
            w |= {b + "attn_qkv.weight": mat(C, E), b + "attn_gate.weight": mat(Hv * S, E),
                  b + "ssm_beta.weight": mat(Hv, E), b + "ssm_alpha.weight": mat(Hv, E),
                  b + "ssm_dt.bias": rng.normal(-1.0, 0.5, Hv),         # softplus(dt) ~ 0.3
                  b + "ssm_a": -rng.uniform(0.02, 0.5, Hv),             # -A: decay 0.85..0.99 a step
                  b + "ssm_conv1d.weight": rng.standard_normal((C, sh.conv_kernel)) / np.sqrt(sh.conv_kernel),
                  b + "ssm_norm.weight": norm(S),                       # plain weight, no +1 in Qwen
                  b + "ssm_out.weight": sh.branch_scale * mat(E, Hv * S)}
        else:  # gated full attention
            w |= {b + "attn_q.weight": mat(2 * H * D, E), b + "attn_k.weight": mat(Hkv * D, E),
                  b + "attn_v.weight": mat(Hkv * D, E), b + "attn_output.weight": sh.branch_scale * mat(E, H * D),
                  b + "attn_q_norm.weight": norm(D), b + "attn_k_norm.weight": norm(D)}
    if sh.mtp:  # drawn after the trunk: the trunk is the same with or without it
        b = f"blk.{sh.n_layer}."
        scale = sh.branch_scale if sh.mtp_branch_scale is None else sh.mtp_branch_scale
        w |= {b + "attn_norm.weight": norm(E), b + "post_attention_norm.weight": norm(E),
              b + "ffn_gate.weight": mat(F, E), b + "ffn_up.weight": mat(F, E),
              b + "ffn_down.weight": scale * mat(E, F),
              b + "attn_q.weight": mat(2 * H * D, E), b + "attn_k.weight": mat(Hkv * D, E),
              b + "attn_v.weight": mat(Hkv * D, E), b + "attn_output.weight": scale * mat(E, H * D),
              b + "attn_q_norm.weight": norm(D), b + "attn_k_norm.weight": norm(D),
              b + "nextn.eh_proj.weight": np.concatenate([np.eye(E), sh.mtp_hidden_scale * mat(E, E)], axis=1),
              b + "nextn.enorm.weight": np.ones(E), b + "nextn.hnorm.weight": norm(E),
              b + "nextn.shared_head_norm.weight": w["output_norm.weight"].copy()}
    return {k: v.astype(np.float32) for k, v in w.items()}


# Weight types `quant` may name: every type ggml quantizes to without an importance matrix that
# deltaspec's matmuls take (the IQ types need an imatrix; TQ/MXFP4 are not in qwen35 files).
QUANT_TYPES: dict[str, GGMLQuantizationType] = {t.name.lower(): t for t in (
    GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K)}


def quantizable(name: str, x: np.ndarray, qtype: GGMLQuantizationType) -> bool:
    """Whether `write_tiny_vocab_model(quant=...)` stores tensor `name` in `qtype`: a matrix (not the
    conv kernel, which the engine reads as F32) whose rows are a whole number of the type's blocks."""
    return x.ndim == 2 and not name.endswith("ssm_conv1d.weight") and x.shape[1] % GGML_QUANT_SIZES[qtype][0] == 0


def write_tiny_vocab_model(path: str | Path, n_vocab: int = MIN_VOCAB, seed: int = 0, quant: str | None = None,
                           metadata: dict[str, str | int | float] | None = None,
                           weight_map: Callable[[str, np.ndarray], np.ndarray] | None = None,
                           tensor_quant: dict[str, str] | None = None, **shape) -> Path:
    """Write the tiny-vocabulary qwen35 GGUF (tensors F32) to `path` and return it.

    `shape` overrides fields of `TinyShape` (n_embd, n_layer, head_dim, logit_std, ...). The same
    arguments always give the same bytes. quant (a key of QUANT_TYPES: "q4_k", "bf16", ...) stores
    every `quantizable` matrix in that type with ggml's own quantizer, the rest F32, as llama.cpp
    falls back for rows that are not whole blocks (k-quants need rows of 256: widen the shape).
    `metadata` adds `qwen35.<key>` entries (str, int as uint32, float as float32), e.g. rope scaling.
    `weight_map(name, array)` replaces each float32 weight before it is written (e.g. with its
    quantize-dequantize round trip, for a reference model).
    `tensor_quant` maps tensor names to a quant of their own, over `quant` (e.g. the Q6_K tensors
    of a Q4_K_M file).
    """
    for q in [quant, *(tensor_quant or {}).values()]:
        if q is not None and q not in QUANT_TYPES:
            raise ValueError(f"quant must be None or one of {sorted(QUANT_TYPES)}, got {q!r}")
    sh = replace(TinyShape(), **shape)  # TypeError names an unknown field
    tokens, types, merges = tiny_vocab(n_vocab)
    weights = _weights(sh, n_vocab, np.random.default_rng(seed))
    if weight_map is not None:
        weights = {name: np.asarray(weight_map(name, x), dtype=np.float32) for name, x in weights.items()}
    path = Path(path)
    w = GGUFWriter(str(path), "qwen35")
    w.add_name("deltaspec-tiny-vocab")
    for key, value in {"context_length": sh.n_ctx_train, "embedding_length": sh.n_embd,
                       "block_count": sh.n_layer + sh.mtp, "feed_forward_length": sh.n_ff,
                       "attention.head_count": sh.n_head, "attention.head_count_kv": sh.n_head_kv,
                       "attention.key_length": sh.head_dim, "attention.value_length": sh.head_dim,
                       "rope.dimension_count": sh.n_rot, "full_attention_interval": sh.full_attention_interval,
                       "ssm.conv_kernel": sh.conv_kernel, "ssm.state_size": sh.ssm_state,
                       "ssm.group_count": sh.ssm_k_heads, "ssm.time_step_rank": sh.ssm_v_heads,
                       "ssm.inner_size": sh.ssm_v_heads * sh.ssm_state}.items():
        w.add_uint32(f"qwen35.{key}", value)
    if sh.mtp:
        w.add_uint32("qwen35.nextn_predict_layers", 1)
    w.add_float32("qwen35.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("qwen35.rope.freq_base", 1e7)
    w.add_array("qwen35.rope.dimension_sections", sh.rope_sections)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index(EOS_TEXT))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    for key, value in (metadata or {}).items():
        _add_value(w, f"qwen35.{key}", value)
    unknown = set(tensor_quant or {}) - set(weights)
    if unknown:
        raise ValueError(f"tensor_quant names tensors the model does not have: {sorted(unknown)}")
    from .. import _core  # ggml's own quantizer (gguf-py cannot write k-quants)
    for name, x in weights.items():
        q = (tensor_quant or {}).get(name, quant)
        if q is not None and quantizable(name, x, QUANT_TYPES[q]):
            qtype = QUANT_TYPES[q]
            w.add_tensor(name, _core.quantize(np.ascontiguousarray(x), int(qtype)), raw_dtype=qtype)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_value(w: GGUFWriter, key: str, value: str | int | float) -> None:
    if isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, int) and not isinstance(value, bool):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        raise TypeError(f"metadata {key!r}: expected str, int or float, got {value!r}")


def cycle_prompt(model, start: int) -> list[int]:
    """For a model written with branch_scale=0: one period of the cycle its greedy text falls into
    from the token `start`, repeated twice. The model continues such a prompt with the same cycle."""
    tokens = model.generate([start], max_tokens=96, temperature=0).tokens
    tail = tokens[-32:]
    period = next((k for k in range(1, 16) if tail[k:] == tail[:-k]), None)
    if len(tokens) < 96 or period is None:
        raise ValueError(f"greedy text from token {start} does not settle into a short cycle")
    return tail[:period] * 2


_tmp_dir: Path | None = None


def _process_dir() -> Path:
    """A temp folder private to this process, removed at exit (so no stale file outlives a code change)."""
    global _tmp_dir
    if _tmp_dir is None:
        _tmp_dir = Path(tempfile.mkdtemp(prefix="deltaspec-tiny-vocab-"))
        atexit.register(shutil.rmtree, _tmp_dir, ignore_errors=True)
    return _tmp_dir


@lru_cache(maxsize=None)
def _cached(n_vocab: int, seed: int, shape_items: tuple) -> Path:
    sh = replace(TinyShape(), **dict(shape_items))
    # every parameter in the file name: distinct models never collide within the folder
    tag = "-".join(f"{v}" for v in asdict(sh).values())
    return write_tiny_vocab_model(_process_dir() / f"tiny-vocab-{n_vocab}-{seed}-{tag}.gguf", n_vocab, seed,
                                  **dict(shape_items))


def tiny_vocab_model_path(n_vocab: int = MIN_VOCAB, seed: int = 0, **shape) -> Path:
    """Path of `write_tiny_vocab_model(..., n_vocab, seed, **shape)`, written once per process into a
    temp folder of its own; later calls with the same arguments return the same file."""
    known = {f.name for f in fields(TinyShape)}
    unknown = sorted(set(shape) - known)
    if unknown:
        raise TypeError(f"unknown shape parameter(s) {unknown}; have {sorted(known)}")
    return _cached(int(n_vocab), int(seed), tuple(sorted(shape.items())))
