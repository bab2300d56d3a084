"""KV-cache element types: names, sizes, and which (K, V) pairs each device runs.

Only the full-attention layers of a qwen35 model have a KV cache; the Gated DeltaNet layers keep a
fixed-size F32 recurrent state that no cache type changes (spec §7.1). The names are llama.cpp's
`-ctk/-ctv` values, plus deltaspec's own TurboQuant types `tq3` and `tq4` (ggml/deltaspec_tq.h): each
head vector of D values randomly rotated, then one 3- or 4-bit Lloyd-Max index per value and one fp16
scale per head vector, 3 + 16/D or 4 + 16/D bits per value (D = 256: 3.0625 and 4.0625; q4_0 is 4.5);
and the quantized ggml types with that rotation, `q4_0+rot` etc. (as llama.cpp rotates its quantized
caches, spec §7.2: outlier channels are spread over the head before a block's scale sees them).
Typical use before building an engine:

    validate_cache_types(type_k, type_v, device, hparams.head_dim)   # ValueError on a bad choice
    per_token = kv_bytes_per_token(hparams, type_k, type_v)

and, after, to see what the engine allocated: `Model.kv_cache_info()` (`allocated_state` below).
"""

from __future__ import annotations

from typing import Protocol

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from .devices import device_kind

# llama.cpp `common/arg.cpp kv_cache_types`, in its order. The native engine parses the same names.
CACHE_TYPES: dict[str, T] = {
    "f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1,
    "iq4_nl": T.IQ4_NL, "q5_0": T.Q5_0, "q5_1": T.Q5_1,
}
# deltaspec's TurboQuant types: name -> bits per index (ggml/deltaspec_tq.h). They run on both devices,
# for K or V or both, beside any type above on the other side.
TQ_CACHE_TYPES: dict[str, int] = {"tq3": 3, "tq4": 4}
TQ_HEAD_DIMS = (32, 64, 128, 256)
# The quantized ggml types holding rotated rows (format 1 of ggml/deltaspec_tq.h): name -> its ggml type.
ROTATED_CACHE_TYPES: dict[str, str] = {f"{n}+rot": n for n in ("q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")}
KV_CACHE_TYPES: tuple[str, ...] = (*CACHE_TYPES, *TQ_CACHE_TYPES, *ROTATED_CACHE_TYPES)  # every name -ctk/-ctv take
_ROTATED_FORMAT = 1
DEFAULT_CACHE_TYPE = "f16"
DEVICES = ("cpu", "cuda")

# CUDA flash attention (`ggml_cuda_fattn_kv_type_supported`, spec §6.3) accepts these for K and V,
# in any combination; IQ4_NL has no CUDA FA path (ggml would run the op on the CPU instead).
_CUDA_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")

# Which CUDA pairs are fast. Batches (prefill, speculative verification of several tokens) use the
# tensor-core MMA kernel, which converts any quantized K/V to F16 in a temporary buffer: every pair
# above works there. Single-token decode uses the vector kernel, which exists only for the pairs
# compiled in by GGML_CUDA_FA_QUANTS; ggml's default is the four below (deltaspec's CMakeLists does
# not change it). Any other pair still runs but ggml logs a warning and converts K and V to F16
# first: slow, and no memory saved during the step. F32 K/V are always cast (never a vec pair).
# GGML_CUDA_FA_QUANTS=all compiles all 49 pairs of {f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1}.
CUDA_VEC_PAIRS_DEFAULT: frozenset[tuple[str, str]] = frozenset(
    {("q4_0", "q4_0"), ("q8_0", "q8_0"), ("f16", "f16"), ("bf16", "bf16")})


class _KVHParams(Protocol):
    """What the size functions read; the engine's hyper-parameters (`deltaspec.qwen35.read_hparams`) have it."""
    n_head_kv: int
    head_dim: int

    @property
    def n_attention_layers(self) -> int: ...


def ggml_type(name: str) -> T:
    """The ggml type id of cache type `name` (e.g. "q8_0" -> GGMLQuantizationType.Q8_0); the tq types
    have none (ValueError)."""
    if name in TQ_CACHE_TYPES:
        raise ValueError(f"{name!r} is deltaspec's own cache type, not a ggml type")
    return CACHE_TYPES[ROTATED_CACHE_TYPES.get(_known(name, "type"), name)]


def block_size(name: str, head_dim: int | None = None) -> int:
    """Elements per quantization block (1 for f32/f16/bf16, 32 for the q*/iq4_nl types, the head
    vector for tq3/tq4, whose block is one head: pass head_dim)."""
    if name in TQ_CACHE_TYPES:
        if head_dim is None:
            raise ValueError(f"the block of {name!r} is one head vector: pass head_dim")
        return head_dim
    return GGML_QUANT_SIZES[ggml_type(name)][0]


def tq_head_bytes(name: str, head_dim: int) -> int:
    """Bytes of one head vector of a tq cache: an fp16 scale + head_dim indices of 3 or 4 bits."""
    return 2 + head_dim * TQ_CACHE_TYPES[name] // 8


def bytes_per_element(name: str, head_dim: int | None = None) -> float:
    """Average bytes per cached element, block scales included (q8_0: 34/32 = 1.0625; tq3 at
    head_dim 256: 98/256 = 0.3828)."""
    if name in TQ_CACHE_TYPES:
        return tq_head_bytes(name, block_size(name, head_dim)) / head_dim
    blck, size = GGML_QUANT_SIZES[ggml_type(name)]
    return size / blck


def fits_head_dim(name: str, head_dim: int) -> bool:
    """Whether a cache of type `name` holds heads of head_dim values (whole blocks; tq and rotated
    types: D in TQ_HEAD_DIMS)."""
    if name in TQ_CACHE_TYPES or name in ROTATED_CACHE_TYPES:
        return head_dim in TQ_HEAD_DIMS
    return head_dim % block_size(name) == 0


def engine_cache_args(type_k: str, type_v: str) -> dict[str, int]:
    """The engine's keyword arguments for a (type_k, type_v) pair: ggml type ids, and kv_format_k /
    kv_format_v: 1 for a rotated type, 3 or 4 for tq3 / tq4 (whose type id is then a placeholder the
    engine ignores), 0 otherwise."""
    out = {}
    for side, name in (("k", type_k), ("v", type_v)):
        _known(name, f"type_{side}")
        bits = TQ_CACHE_TYPES.get(name, 0)
        out[f"type_{side}"] = int(T.F16 if bits else ggml_type(name))
        out[f"kv_format_{side}"] = bits or (_ROTATED_FORMAT if name in ROTATED_CACHE_TYPES else 0)
    return out


def kv_bytes_per_token(hparams: _KVHParams, type_k: str = DEFAULT_CACHE_TYPE,
                       type_v: str = DEFAULT_CACHE_TYPE) -> int:
    """Bytes the KV cache grows by per token: every full-attention layer stores n_head_kv * head_dim
    elements for K and as many for V (recurrent layers add nothing per token).

    Exact, not averaged: each head's row is whole blocks, so the block size must divide head_dim
    (ValueError otherwise, as `validate_cache_types`).
    """
    per_layer = 0
    for param, name in (("type_k", type_k), ("type_v", type_v)):
        _known(name, param)
        _check_block(param, name, hparams.head_dim)
        if name in TQ_CACHE_TYPES:
            per_layer += hparams.n_head_kv * tq_head_bytes(name, hparams.head_dim)
            continue
        blck, size = GGML_QUANT_SIZES[ggml_type(name)]
        per_layer += hparams.n_head_kv * (hparams.head_dim // blck) * size
    return hparams.n_attention_layers * per_layer


def padded_n_ctx(n_ctx: int) -> int:
    """The context the engine allocates for `n_ctx`: rounded up to whole KV blocks, as llama.cpp does."""
    from . import _core  # this module is pure Python otherwise

    return -(-n_ctx // _core.kv_pad) * _core.kv_pad


def kv_cache_bytes(hparams: _KVHParams, n_ctx: int, type_k: str = DEFAULT_CACHE_TYPE,
                   type_v: str = DEFAULT_CACHE_TYPE) -> int:
    """Bytes of a KV cache holding n_ctx tokens (the engine may pad n_ctx up; pass the padded value)."""
    return n_ctx * kv_bytes_per_token(hparams, type_k, type_v)


def supported_types(device: str) -> tuple[str, ...]:
    """Cache type names usable for K or V on `device` ("cpu", "cuda" or "cuda:N": every GPU alike)."""
    device = device_kind(device)
    if device == "cpu":
        # ggml's CPU flash attention takes any K type with vec_dot and any V type with to_float; the
        # tq attention node any type with to_float beside a tq side.
        return KV_CACHE_TYPES
    if device == "cuda":
        # ggml's CUDA types (not iq4_nl: ggml-cuda has no flash attention for it), the tq types and
        # the rotated ones of those types. The tq quantizer writes the CPU's bytes on the H200 and the
        # attention over them matches the CPU's (tests/test_gpu_turboquant.py, test_gpu.py's pairs;
        # bench/results/latest/gpu_tq_tests.xml, tq_cuda_diag.md).
        return (*_CUDA_TYPES, *TQ_CACHE_TYPES, *(n for n, t in ROTATED_CACHE_TYPES.items() if t in _CUDA_TYPES))
    raise AssertionError(device)  # device_kind knows no other


def supported_pairs(device: str) -> frozenset[tuple[str, str]]:
    """All (type_k, type_v) pairs that run on `device`: 289 on the CPU (tq3/tq4 and the rotated types
    with anything), 225 on CUDA (no iq4_nl, plain or rotated: see supported_types).

    On CUDA only `CUDA_VEC_PAIRS_DEFAULT` are fast for single-token decode; see the comment there.
    """
    types = supported_types(device)
    return frozenset((k, v) for k in types for v in types)


def validate_cache_types(type_k: str, type_v: str, device: str = "cpu", head_dim: int | None = None) -> None:
    """Raise ValueError unless (type_k, type_v) runs on `device` and (when given) head_dim is a
    whole number of blocks of each type (llama.cpp refuses the same, src/llama-context.cpp)."""
    types = supported_types(device)  # also rejects an unknown device
    for param, name in (("type_k", type_k), ("type_v", type_v)):
        _known(name, param)
        if name not in types:
            raise ValueError(f"{param}={name!r} is not supported on {device} "
                             f"(supported on {device}: {', '.join(types)})")
        if head_dim is not None:
            _check_block(param, name, head_dim)


def allocated_state(tensors: list[dict], n_ctx: int) -> dict:
    """`Model.kv_cache_info()`'s dict from the engine's `state_info` (one dict per allocated state
    tensor: kind, layer, slot, type, nbytes, shape, buffer): the KV cache per attention layer and
    the recurrent state per Gated DeltaNet layer of one sequence slot (every slot is alike), the
    bytes of each slot, and byte totals over all slots. Every type and size is the allocated
    tensor's own, not the one asked for."""
    by_layer: dict[int, dict[str, dict]] = {}
    for t in tensors:
        if t.get("slot", 0) == 0:
            by_layer.setdefault(t["layer"], {})[t["kind"]] = t
    attention, recurrent = [], []
    for layer, kinds in sorted(by_layer.items()):
        if "k" in kinds:
            k, v = kinds["k"], kinds["v"]
            attention.append({"layer": layer, "type_k": k["type"], "type_v": v["type"], "k_bytes": k["nbytes"],
                              "v_bytes": v["nbytes"], "buffer": k["buffer"]})
        else:
            conv, ssm = kinds["conv"], kinds["ssm"]
            recurrent.append({"layer": layer, "conv_type": conv["type"], "conv_bytes": conv["nbytes"],
                              "ssm_type": ssm["type"], "ssm_bytes": ssm["nbytes"], "buffer": conv["buffer"]})

    def totals(ts: list[dict]) -> dict[str, int]:
        out = {kind: sum(t["nbytes"] for t in ts if t["kind"] in kinds)
               for kind, kinds in (("k", ("k",)), ("v", ("v",)), ("recurrent", ("conv", "ssm")))}
        out["total"] = sum(t["nbytes"] for t in ts)
        return out

    n_slots = 1 + max((t.get("slot", 0) for t in tensors), default=0)
    slots = []
    for s in range(n_slots):
        per = totals([t for t in tensors if t.get("slot", 0) == s])
        slots.append({"slot": s, "kv_bytes": per["k"] + per["v"], "recurrent_bytes": per["recurrent"],
                      "total_bytes": per["total"]})
    total = totals(tensors)
    return {
        "n_ctx": n_ctx,
        "n_seq_max": n_slots,
        "attention_layers": attention,
        "recurrent_layers": recurrent,
        "slots": slots,
        "k_bytes": total["k"],
        "v_bytes": total["v"],
        "kv_bytes": total["k"] + total["v"],
        "recurrent_bytes": total["recurrent"],
        "total_bytes": total["total"],
    }


def _known(name: str, param: str) -> str:
    if not isinstance(name, str) or name not in KV_CACHE_TYPES:
        raise ValueError(f"{param}={name!r} is not a KV cache type (supported: {', '.join(KV_CACHE_TYPES)})")
    return name


def _check_block(param: str, name: str, head_dim: int) -> None:
    if fits_head_dim(name, head_dim):
        return
    fits = ", ".join(n for n in KV_CACHE_TYPES if fits_head_dim(n, head_dim))
    if name in TQ_CACHE_TYPES or name in ROTATED_CACHE_TYPES:
        raise ValueError(f"{param}={name!r}: the head dim must be one of {TQ_HEAD_DIMS} (rotated as a whole), "
                         f"got {head_dim} (types that fit: {fits})")
    raise ValueError(f"{param}={name!r}: its block of {block_size(name)} elements does not divide the head dim "
                     f"{head_dim} (types that fit: {fits})")
