"""Tiny random DFlash drafters: the z-lab `dflash` package's torch DFlashDraftModel, and a GGUF of it
with the names and keys llama.cpp's converter writes for arch `dflash` (written here with gguf-py
directly, so tests need no tokenizer folder; tests/test_dflash.py also loads the converter's own
output).

torch, transformers and dflash are imported inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

TORCH_TO_GGUF = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
}
LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def dflash_config(n_embd: int, n_vocab: int, target_layer_ids: list[int], mask_token_id: int, *,
                  n_layer: int = 2, n_head: int = 4, n_head_kv: int = 2, head_dim: int = 32, n_ff: int = 128,
                  block_size: int = 8, rope_theta: float = 1e7, num_target_layers: int = 4,
                  causal: bool | None = None) -> dict[str, Any]:
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": n_embd, "intermediate_size": n_ff, "num_hidden_layers": n_layer,
        "num_attention_heads": n_head, "num_key_value_heads": n_head_kv, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "max_position_embeddings": 4096, "vocab_size": n_vocab,
        "attention_bias": False, "tie_word_embeddings": False, "block_size": block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id},
    }
    if causal is not None:  # what DFlashDraftModel reads (llama.cpp's converter: is_causal, else dflash_config.causal)
        cfg["is_causal"] = causal
    return cfg


def build_tiny_dflash(cfg: dict[str, Any], seed: int = 0) -> Any:
    """The float32 DFlashDraftModel for `cfg`, weights redrawn so that nothing is degenerate: matrices
    N(0, 1/fan_in), norm weights 1 + N(0, 0.2) (a norm applied twice or not at all shows)."""
    import torch
    from dflash import DFlashDraftModel
    from transformers import Qwen3Config

    config = Qwen3Config(**cfg)
    config.dflash_config = cfg["dflash_config"]
    config.block_size = cfg["block_size"]
    config.num_target_layers = cfg["num_target_layers"]
    if "is_causal" in cfg:
        config.is_causal = cfg["is_causal"]
    model = DFlashDraftModel(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[1]))
    return model


def write_sharp_tiny_dflash(target: Any, path: str | Path, seed: int = 3, sharpness: float = 3.0) -> Path:
    """A tiny random drafter for `target` (a deltaspec Model; features from its layers 0 and 2, mask
    token 5, block 8) as a GGUF at `path`, its output norm scaled by `sharpness`: logits scale with
    it, so the block's slots are sharp enough for trees several levels deep (a random drafter's are
    nearly flat). Seed 3's favourite tokens are 82, 225 and 19."""
    import torch

    cfg = dflash_config(target.hparams.n_embd, target.n_vocab, [0, 2], mask_token_id=5,
                        num_target_layers=target.hparams.n_layer)
    model = build_tiny_dflash(cfg, seed=seed)
    with torch.no_grad():
        model.norm.weight.mul_(sharpness)
    return write_dflash_gguf(model, cfg, path)


def write_dflash_gguf(model: Any, cfg: dict[str, Any], path: str | Path, tokens: list[str] | None = None,
                      qtype: str = "f32", arch: str = "dflash", skip: tuple[str, ...] = ()) -> Path:
    """The GGUF llama.cpp's converter would write for `model` (arch dflash, its keys and tensor
    names); `tokens`, when given, stand for the target's vocabulary copied into the file. `arch`
    and `skip` (GGUF tensor names left out) make broken files for tests."""
    import gguf

    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    # the installed gguf-py may predate these keys' helpers: written by name, typed as the tree's helpers do
    w.add_uint32(f"{arch}.block_size", cfg["block_size"])
    w.add_array(f"{arch}.target_layers", [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]])
    if "is_causal" in cfg:
        w.add_bool(f"{arch}.attention.causal", bool(cfg["is_causal"]))
    w.add_array(f"{arch}.rope.dimension_sections", [cfg["head_dim"] // 2, 0, 0, 0])
    w.add_uint32("tokenizer.ggml.mask_token_id", cfg["dflash_config"]["mask_token_id"])
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
    quant = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[qtype]
    for name, p in model.state_dict().items():
        if name in TORCH_TO_GGUF:
            out = TORCH_TO_GGUF[name]
        else:
            _, layer, rest = name.split(".", 2)
            out = f"blk.{layer}.{LAYER_TO_GGUF[rest.removesuffix('.weight')]}.weight"
        if out in skip:
            continue
        x = p.detach().float().numpy()
        if x.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            w.add_tensor(out, gguf.quants.quantize(x, quant), raw_dtype=quant)
        else:
            w.add_tensor(out, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_block_logits(model: Any, features: np.ndarray, anchor: int, embed: np.ndarray,
                           head: np.ndarray) -> np.ndarray:
    """The torch reference: logits (block_size - 1, n_vocab) of the block [anchor, mask...] placed
    after `features` (ctx, n_feat) at positions 0 .. ctx-1, as dflash_generate computes them (the
    target's embedding `embed` (n_vocab, E) and LM head `head` (n_vocab, E))."""
    import torch

    B = model.block_size
    ctx = features.shape[0]
    ids = torch.tensor([[anchor] + [model.mask_token_id] * (B - 1)])
    with torch.no_grad():
        noise = torch.nn.functional.embedding(ids, torch.from_numpy(embed))
        hidden = model(target_hidden=torch.from_numpy(features)[None], noise_embedding=noise,
                       position_ids=torch.arange(ctx + B)[None], use_cache=False)[:, 1 - B:, :]
        return (hidden @ torch.from_numpy(head).T)[0].numpy()
