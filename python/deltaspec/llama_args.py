"""llama-cpp-python's constructor names (`Llama(model_path=..., n_gpu_layers=-1, seed=..., n_batch=...,
verbose=..., flash_attn=...)`) mapped onto `Model`'s, so code written for llama-cpp-python loads a
model here unchanged. This engine holds the whole model on one device, so `n_gpu_layers` says only
"on the GPU or not"."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import _core
from .devices import device_kind


@dataclass
class LoadChoice:
    path: str | os.PathLike[str]
    device: str
    n_ubatch: int
    seed: int | None            # the default sampling seed of generate(seed=None); None: random


def resolve(path: Any, model_path: Any, device: str | None, n_gpu_layers: Any, n_ubatch: int, n_batch: Any,
            seed: Any, flash_attn: Any) -> LoadChoice:
    """Model's own arguments from the llama-cpp-python names; conflicts and values that mean nothing
    here raise ValueError naming the argument."""
    if path is None and model_path is None:
        raise TypeError("Model() needs the GGUF path: Model(path) or Model(model_path=...)")
    if path is not None and model_path is not None and os.fspath(path) != os.fspath(model_path):
        raise ValueError(f"path {path!r} and model_path {model_path!r} disagree; pass one of them")
    if n_gpu_layers is not None:
        if isinstance(n_gpu_layers, bool) or not isinstance(n_gpu_layers, int) or n_gpu_layers < -1:
            raise ValueError(f"n_gpu_layers must be 0 (CPU), -1 or a layer count > 0 (the GPU), got {n_gpu_layers!r}")
        wanted = "cpu" if n_gpu_layers == 0 else "cuda"
        if device is not None and device_kind(device) != wanted:  # "cuda:1" is a GPU too
            raise ValueError(f"n_gpu_layers={n_gpu_layers} means device {wanted!r}, but device={device!r} was given")
        if wanted == "cuda" and not _core.has_device("cuda"):
            raise ValueError(f"n_gpu_layers={n_gpu_layers} asks for the GPU, but this build of deltaspec has no CUDA "
                             "device (built without CUDA, or no GPU visible); use n_gpu_layers=0 for the CPU")
        device = wanted if device is None else device
    if n_batch is not None:
        if isinstance(n_batch, bool) or not isinstance(n_batch, int) or n_batch < 1:
            raise ValueError(f"n_batch must be a positive integer, got {n_batch!r}")
        # llama.cpp caps the physical batch (n_ubatch) at the logical one; only the physical one exists here
        n_ubatch = min(n_ubatch, n_batch) if isinstance(n_ubatch, int) and not isinstance(n_ubatch, bool) else n_ubatch
    if flash_attn is False or (isinstance(flash_attn, str) and flash_attn.lower() in ("off", "disabled")):
        raise ValueError("flash_attn=False is not available: attention here always runs as ggml's flash attention")
    if not (flash_attn is None or flash_attn is True or flash_attn in ("on", "auto", "enabled")):
        raise ValueError(f"flash_attn must be None, True, 'on' or 'auto', got {flash_attn!r}")
    return LoadChoice(path if path is not None else model_path, "cpu" if device is None else device, n_ubatch,
                      default_seed(seed))


def default_seed(seed: Any) -> int | None:
    """The default sampling seed a constructor's (or Llama.set_seed's) `seed` gives: None for random."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -1 <= seed < 2**64):
        raise ValueError(f"seed must be -1 (random) or an integer in [0, 2**64), got {seed!r}")
    # llama.cpp's LLAMA_DEFAULT_SEED (0xFFFFFFFF) also means "random"
    return None if seed in (None, -1, 0xFFFFFFFF) else seed
