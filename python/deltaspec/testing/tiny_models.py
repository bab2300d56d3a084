"""Tiny random Qwen3.5 Hugging Face checkpoints, deterministic, with the real Qwen3.5 tokenizer.

Every shape is small but legal for the ggml kernels the engine uses: DeltaNet head dim S in
{32, 64, 128} (ggml CUDA needs S in {16, 32, 64, 128}), conv channels C = 2*Hk*S + Hv*S a multiple
of 128, attention head dims 32/64. The vocabulary is the real 248,320-row one, because llama.cpp's
converter recognises the pre-tokenizer only by hashing the real tokenizer's output.

Weights are redrawn after transformers' init with per-tensor seeds and scales chosen so the model is
not degenerate: logits vary over the vocab (std of order 1-5) and from position to position, the
zero-centred norms are not all zero (so a missing +1 shows), and DeltaNet decays are mild (so the
recurrent state carries information across many tokens).

torch and transformers are imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

from ..qwen35 import mrope_sections

# Part of the cache key (with the generating sources' bytes): bump to force rebuilds by hand.
FORMAT_VERSION = 1

_COMMON: dict[str, Any] = {
    "vocab_size": 248320,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "linear_conv_kernel_dim": 4,
    "eos_token_id": 248046,  # <|im_end|>, as instruct checkpoints
}


def _rope(head_dim: int) -> dict[str, Any]:
    # partial rotary 0.25 as in Qwen3.5; the M-RoPE sections must give each of the n_rot/2 = head_dim/8
    # pairs a section (qwen35.py), as [11, 11, 10] does for Qwen3.5's 32
    sections = mrope_sections(head_dim // 8)[:3]
    return {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": sections, "mrope_interleaved": True}


TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # Hk != Hv (2 -> 4 value heads): exercises the grouped->tiled V-head reorder; S=32, C=256;
    # tied LM head; one full-attention layer (index 3) from the default interval of 4.
    "gdn_hk2_hv4_tied": {
        **_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "tie_word_embeddings": True, "rope_parameters": _rope(64),
    },
    # 8 layers with two full-attention layers (3, 7), GQA 4:1 with head_dim 32, Hk == Hv, S=64
    # (C=384); untied LM head.
    "attn2_d32_untied": {
        **_COMMON, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 2,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "tie_word_embeddings": False, "rope_parameters": _rope(32),
    },
    # Explicit, non-periodic layer_types (full attention first and in the middle), a 3:1 V/K head
    # ratio at the real model's S=128 (C=1280), hidden 128, tied, stored in bfloat16 like released
    # checkpoints.
    "mixed_s128_bf16": {
        **_COMMON, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 5,
        "layer_types": ["full_attention", "linear_attention", "full_attention",
                        "linear_attention", "linear_attention"],
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 6,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "tie_word_embeddings": True, "rope_parameters": _rope(64), "dtype": "bfloat16",
    },
}


def _scaled(base: str, **rope: Any) -> dict[str, Any]:
    cfg = TINY_CONFIGS[base]
    return {**cfg, "rope_parameters": {**cfg["rope_parameters"], **rope}}


# RoPE-scaled variants of the smallest checkpoint, for the engine's linear / YaRN RoPE against
# transformers'. Kept out of TINY_CONFIGS, which parametrizes many tests. n_rot = 16 with base 1e7
# and a 1024-token original context puts YaRN's ramp on the fastest 3 of the 8 frequency pairs.
ROPE_SCALING_CONFIGS: dict[str, dict[str, Any]] = {
    "rope_linear": _scaled("gdn_hk2_hv4_tied", rope_type="linear", factor=2.0),
    "rope_yarn": _scaled("gdn_hk2_hv4_tied", rope_type="yarn", factor=4.0, original_max_position_embeddings=1024),
    # every YaRN knob the GGUF carries away from its default
    "rope_yarn_tuned": _scaled("gdn_hk2_hv4_tied", rope_type="yarn", factor=4.0,
                               original_max_position_embeddings=1024, beta_fast=8.0, beta_slow=2.0,
                               attention_factor=1.25),
}
# Checkpoints that carry an MTP layer (mtp.*, as released Qwen3.5 checkpoints do; transformers
# ignores it, llama.cpp's converter keeps it as blk.{n_layer}.nextn.*). Untied, so the head's LM
# head is output.weight, not the embedding.
MTP_CONFIGS: dict[str, dict[str, Any]] = {
    "mtp_attn2_untied": {**TINY_CONFIGS["attn2_d32_untied"], "mtp_num_hidden_layers": 1},
}
_ALL_CONFIGS = {**TINY_CONFIGS, **ROPE_SCALING_CONFIGS, **MTP_CONFIGS}

# Recommended sampling written to generation_config.json (Qwen3.5's thinking-mode defaults), so the
# converters' general.sampling.* keys are exercised.
_GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}


def _param_init(name: str, shape: tuple[int, ...], gen: Any, cfg: Any) -> Any:
    """The redrawn value of parameter `name` (see the module docstring for the scales' purpose)."""
    import torch

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo

    E = cfg.hidden_size
    if name.endswith("A_log"):
        return uniform(0.02, 0.5).log()  # A in [0.02, 0.5]: decay exp(-A*dt) of 0.85..0.99 a step
    if name.endswith("dt_bias"):
        return normal(0.5, -1.0)  # softplus(dt_bias + a) ~ 0.3
    if name.endswith("linear_attn.norm.weight"):
        return normal(0.1, 1.0)  # plain scale (no +1 in HF or GGUF)
    if name.endswith(("norm.weight", "norm_embedding.weight", "norm_hidden.weight")):
        return normal(0.1)  # zero-centred: the model scales by 1 + w
    if name.endswith("conv1d.weight"):
        return normal(1.0 / shape[-1] ** 0.5)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return normal(3.0 / E ** 0.5)  # unit-RMS hidden state -> logits std ~3
    if len(shape) == 2:
        return normal(1.0 / shape[1] ** 0.5)  # unit-variance outputs per sub-layer
    raise ValueError(f"no init rule for parameter {name} {shape}")


def build_tiny_model(name: str, seed: int = 0) -> Any:
    """The float32 `Qwen3_5ForCausalLM` for TINY_CONFIGS[name] (or ROPE_SCALING_CONFIGS[name]),
    weights fixed by (name, seed)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    kwargs = dict(_ALL_CONFIGS[name])
    kwargs.pop("dtype", None)
    cfg = Qwen3_5TextConfig(**kwargs)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):
            # one generator per tensor, seeded by its name: values do not depend on module order
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}/{pname}".encode()))
            p.copy_(_param_init(pname, tuple(p.shape), gen, cfg))
    model.generation_config.update(**_GENERATION)
    return model


def mtp_tensors(name: str, seed: int = 0) -> dict[str, Any]:
    """The mtp.* tensors (float32) of MTP_CONFIGS[name]: one full-attention block, fc, the two input
    norms and the final norm, with Qwen3.5 checkpoints' names and shapes, drawn like the trunk's."""
    import torch
    from transformers import Qwen3_5TextConfig

    kwargs = dict(_ALL_CONFIGS[name])
    kwargs.pop("dtype", None)
    cfg = Qwen3_5TextConfig(**kwargs)
    E, F = cfg.hidden_size, cfg.intermediate_size
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = {"mtp.fc.weight": (E, 2 * E), "mtp.pre_fc_norm_embedding.weight": (E,),
              "mtp.pre_fc_norm_hidden.weight": (E,), "mtp.norm.weight": (E,)}
    block = {"input_layernorm.weight": (E,), "post_attention_layernorm.weight": (E,),
             "self_attn.q_proj.weight": (2 * H * D, E), "self_attn.k_proj.weight": (Hkv * D, E),
             "self_attn.v_proj.weight": (Hkv * D, E), "self_attn.o_proj.weight": (E, H * D),
             "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,),
             "mlp.gate_proj.weight": (F, E), "mlp.up_proj.weight": (F, E), "mlp.down_proj.weight": (E, F)}
    for i in range(cfg.mtp_num_hidden_layers):
        shapes.update({f"mtp.layers.{i}.{k}": v for k, v in block.items()})
    out = {}
    for pname, shape in sorted(shapes.items()):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}/{pname}".encode()))
        out[pname] = _param_init(pname, shape, gen, cfg)
    return out


def probe_logits(model: Any, n_tokens: int = 24, seed: int = 1) -> Any:
    """Logits [n_tokens, vocab] of a fixed pseudo-random prompt of ordinary (non-special) tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 248000, (1, n_tokens), generator=gen)
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


def check_not_flat(logits: Any) -> None:
    """Raise AssertionError unless logits vary over the vocab and their argmax moves with position."""
    std = logits.std(dim=-1)
    n_argmax = len(set(logits.argmax(dim=-1).tolist()))
    if not (0.5 <= float(std.min()) and float(std.max()) <= 10.0):
        raise AssertionError(f"logit std over the vocab out of [0.5, 10]: {std.tolist()}")
    if n_argmax < max(2, logits.shape[0] // 3):
        raise AssertionError(f"argmax takes only {n_argmax} values over {logits.shape[0]} positions")


def make_tiny_model(name: str, folder: str | os.PathLike[str], seed: int = 0,
                    chat_template: str | None = None) -> Path:
    """Write the tiny checkpoint `name` (a key of TINY_CONFIGS or ROPE_SCALING_CONFIGS) into `folder`
    and return it.

    The folder gets config.json, model.safetensors (float32, or bfloat16 where the config says
    `dtype`), generation_config.json and the real Qwen3.5 tokenizer files (with `chat_template`,
    when given, as its chat template).
    """
    import torch
    from ..qwen_vocab import write_hf_tokenizer

    if name not in _ALL_CONFIGS:
        raise KeyError(f"unknown tiny model {name!r}; have {sorted(_ALL_CONFIGS)}")
    folder = Path(folder)
    model = build_tiny_model(name, seed)
    check_not_flat(probe_logits(model))
    dtype = _ALL_CONFIGS[name].get("dtype")
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if name in MTP_CONFIGS:  # transformers drops mtp.*: add it to the saved weights
        from safetensors.torch import load_file, save_file

        weights = load_file(folder / "model.safetensors")
        weights.update({k: v.to(next(iter(weights.values())).dtype) for k, v in mtp_tensors(name, seed).items()})
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    write_hf_tokenizer(folder, chat_template=chat_template)
    return folder


def default_cache_dir() -> Path:
    """`$DELTASPEC_TEST_CACHE`, else a per-user folder in the system temp dir."""
    env = os.environ.get("DELTASPEC_TEST_CACHE")
    if env:
        return Path(env)
    return Path(tempfile.gettempdir()) / f"deltaspec-test-cache-{os.getuid() if hasattr(os, 'getuid') else 0}"


def _build_key(name: str, seed: int, chat_template: str | None) -> str:
    """Hash of everything the built files depend on, so a stale cached folder is never reused."""
    import torch
    import transformers

    h = hashlib.sha256()
    for part in (FORMAT_VERSION, name, seed, chat_template, torch.__version__, transformers.__version__):
        h.update(repr(part).encode())
    here = Path(__file__).resolve().parent.parent
    for src in (Path(__file__), here / "qwen_vocab.py", here / "tokenizer.py", here / "qwen35.py"):
        h.update(src.read_bytes() if src.is_file() else b"")
    return h.hexdigest()[:10]


def tiny_model_dir(name: str, *, seed: int = 0, chat_template: str | None = None,
                   cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder of tiny model `name`, built once into `cache_dir` (default `default_cache_dir()`).

    Keyed by a hash of the inputs and of the generating code; built in a scratch folder and renamed
    into place, so an interrupted build is never reused.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    # the folder name becomes general.name in converted GGUFs, so keep it readable
    final = root / f"{name}-{_build_key(name, seed, chat_template)}"
    if (final / "config.json").is_file() and (final / "tokenizer.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        make_tiny_model(name, scratch, seed=seed, chat_template=chat_template)
        try:
            scratch.rename(final)
        except OSError:  # built concurrently by another process: keep theirs
            if not (final / "config.json").is_file():
                raise
        for old in root.glob(f"{name}-*"):  # builds keyed by older code: ~100 MB each
            if old != final and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return final
