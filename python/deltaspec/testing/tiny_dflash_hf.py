"""Tiny random DFlash drafter checkpoints as Hugging Face folders, for the converter tests.

The weights are the z-lab `dflash` package's DFlashDraftModel (tiny_dflash.build_tiny_dflash), saved
with its own save_pretrained. The config.json is either the one save_pretrained writes (transformers
5: rope_parameters, dtype) or, with `legacy=True`, the shape of the published z-lab configs (written
by transformers 4: top-level rope_theta, rope_scaling null, torch_dtype bfloat16, block_size at the top
level only), which transformers' AutoConfig, and so llama.cpp's converter, reads differently.

torch, transformers and dflash are imported inside the functions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import tiny_dflash as TD


def write_dflash_checkpoint(folder: str | Path, cfg: dict[str, Any], *, seed: int = 0, dtype: str = "float32",
                            legacy: bool = False) -> Path:
    """Save DFlashDraftModel(cfg) (random weights fixed by `seed`) into `folder`; return the folder.
    `cfg` is a tiny_dflash.dflash_config dict."""
    import torch

    folder = Path(folder)
    model = TD.build_tiny_dflash(cfg, seed=seed)
    model.config.architectures = ["DFlashDraftModel"]
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    if legacy:
        (folder / "config.json").write_text(json.dumps(_legacy_config(cfg, dtype), indent=2), encoding="utf-8")
    return folder


def _legacy_config(cfg: dict[str, Any], dtype: str) -> dict[str, Any]:
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "block_size", "num_target_layers",
            "dflash_config", "attention_bias", "tie_word_embeddings")
    out = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
           **{k: cfg[k] for k in keys}, "rope_theta": cfg["rope_theta"], "rope_scaling": None,
           "torch_dtype": dtype, "use_sliding_window": False, "sliding_window": None,
           "layer_types": ["full_attention"] * cfg["num_hidden_layers"], "transformers_version": "4.57.1"}
    if "is_causal" in cfg:
        out["is_causal"] = cfg["is_causal"]
    return out
