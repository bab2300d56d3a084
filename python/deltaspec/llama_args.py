"""llama-cpp-python's constructor names (`Llama(model_path=..., n_gpu_layers=-1, seed=..., n_batch=...,
verbose=..., flash_attn=...)`) mapped onto `Model`'s, so code written for llama-cpp-python loads a
model here unchanged. This engine holds the whole model on one device, so `n_gpu_layers` says only
"on the GPU or not". Llama()'s other options, which have no counterpart here, are checked by
llama_only_options: taken where they change nothing, refused otherwise."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import _core
from .chat_template_names import BUILTIN_CHAT_TEMPLATES
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


# llama-cpp-python's Llama() options with no counterpart in this engine, each accepted where its
# value changes nothing here (its default, or a value this engine always has), refused otherwise:
# option -> (accepts(value), what is accepted). Wrappers such as LangChain's pass many of them.
def _is(*values: Any):
    """Accepts exactly these values: a bool only where a bool is listed, numbers equal to a listed number."""
    def accepts(v: Any) -> bool:
        return any(v is x if isinstance(x, bool) else
                   (isinstance(v, (int, float)) and not isinstance(v, bool) and v == x) for x in values)
    return accepts


def _any_bool(v: Any) -> bool:
    return isinstance(v, bool)


_NO_COUNTERPART = {
    "use_mmap": (_any_bool, "True or False (the weights are read into the device's buffers either way)"),
    "use_mlock": (_is(False), "False"),
    "numa": (_is(False, 0), "False or 0"),
    "logits_all": (_any_bool, "True or False (logprobs are computed whenever asked for)"),
    "embedding": (_any_bool, "True or False (embed() and create_embedding() always work)"),
    "offload_kqv": (_is(True), "True (a layer's KV cache lives with the layer)"),
    "op_offload": (lambda v: v is None or v is True, "None or True"),
    "swa_full": (lambda v: v is None or isinstance(v, bool), "None, True or False (qwen35 has no sliding window)"),
    "main_gpu": (_is(0), "0 (pick a GPU with device='cuda:N')"),
    "split_mode": (_is(0, 1), "0 or 1 (LLAMA_SPLIT_MODE_NONE / _LAYER; several devices: devices=, split='layer')"),
    "vocab_only": (_is(False), "False"),
    "last_n_tokens_size": (_is(64), "64 (the repeat penalty's window; per call: penalty_last_n=)"),
    "n_threads_batch": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0),
                        "None or a positive int (prompts run on n_threads)"),
    "rope_freq_base": (_is(0), "0 (the model's own base)"),
    "rope_freq_scale": (_is(0, 1), "0 or 1.0 (no scaling)"),
    "rope_scaling_type": (lambda v: v is None or v in (-1, 0), "None, -1 or 0 (the model's own RoPE)"),
    "yarn_ext_factor": (_is(-1), "-1.0"),
    "yarn_attn_factor": (_is(1), "1.0"),
    "yarn_beta_fast": (_is(32), "32.0"),
    "yarn_beta_slow": (_is(1), "1.0"),
    "yarn_orig_ctx": (_is(0), "0"),
    "pooling_type": (lambda v: v is None or v == -1, "None or -1 (pooling is embed()'s `pooling`)"),
    "lora_base": (lambda v: v is None, "None (no LoRA adapters)"),
    "lora_path": (lambda v: v is None, "None (no LoRA adapters)"),
    "lora_scale": (_is(1), "1.0"),
    "rpc_servers": (lambda v: v is None, "None (remote devices: devices=['rpc:HOST:PORT', ...])"),
    "kv_overrides": (lambda v: v is None or v == {}, "None"),
    "spm_infill": (_is(False), "False"),
    "chat_handler": (lambda v: v is None, "None (chat templates come from the GGUF or chat_format)"),
    "draft_model": (lambda v: v is None, "None (speculation is per call: draft_model=, spec_type=)"),
    "tokenizer": (lambda v: v is None, "None (the GGUF's tokenizer)"),
    "f16_kv": (_is(True), "True (the cache type is type_k / type_v)"),
    "n_parts": (_is(-1), "-1"),
    "no_perf": (_any_bool, "True or False"),
}

# ggml_type ids (ggml.h) llama-cpp-python takes for type_k / type_v, for the cache types named here
_GGML_TYPE_IDS = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 20: "iq4_nl", 30: "bf16"}


def llama_only_options(kwargs: dict[str, Any]) -> str | None:
    """Takes llama-cpp-python's Llama() options that have no counterpart here out of kwargs, each
    checked against what it may be (ValueError naming it and what is accepted), turns ggml_type ids
    in type_k / type_v into names, and returns chat_format (None, "chatml" or "qwen35")."""
    for name, (accepts, accepted) in _NO_COUNTERPART.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if not accepts(value):
                raise ValueError(f"Llama(): {name}={value!r} is not supported here; accepted: {accepted}")
    for name in ("type_k", "type_v"):
        value = kwargs.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            if value not in _GGML_TYPE_IDS:
                raise ValueError(f"Llama(): {name}={value} is not the ggml_type of a KV cache type here "
                                 f"(ids: {_GGML_TYPE_IDS}); or pass the name, e.g. {name}='q8_0'")
            kwargs[name] = _GGML_TYPE_IDS[value]
        elif value is None and name in kwargs:
            kwargs.pop(name)  # llama-cpp-python's default: the f16 cache
    chat_format = kwargs.pop("chat_format", None)
    if chat_format is not None and chat_format not in BUILTIN_CHAT_TEMPLATES:
        raise ValueError(f"Llama(): chat_format={chat_format!r} is not a format Qwen3.5 models speak; accepted: None "
                         f"(the GGUF's chat template) or one of {sorted(BUILTIN_CHAT_TEMPLATES)}")
    return chat_format
