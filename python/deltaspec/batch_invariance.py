"""Batch-invariant models: Model(batch_invariant=True) or DELTASPEC_BATCH_INVARIANT=1.

By default a row's logits depend on the width of the batch that computes it (a one-token step, a
verify chain or tree, a prefill, a batch of sequences), so speculative greedy decoding can part
from plain greedy at a near-tie.

On the CPU the pinned ggml-cpu multiplies K-quant weights (Q2_K..Q6_K, IQ*) by batches of 8 or
more rows in its tiled kernel and by fewer rows with the per-row vec_dot; it attends with a tiled
kernel from 64 query rows on; and it splits a one-row attention over the threads once the KV cache
holds 512 cells (with 2+ threads). A batch-invariant CPU model runs its backend on ggml-cpu's
reference paths (ggml_backend_cpu_set_use_ref): vec_dot at every width, one attention kernel
whatever the rows and cells, no fused ops.

On CUDA a one-token step takes mat-vecs and flash attention's vector kernel where a batch takes
tensor-core and tile kernels, and ggml fuses ops into one-column products only. A batch-invariant
CUDA model's backend is registered with deltaspec's invariant routes (ggml/cuda/deltaspec_invariant.h):
Q4_K / Q6_K products on our tensor-core kernels at every width, other weights column by column,
ggml's one-column fusions run as separate ops, and one attention kernel that takes the cells a
query sees in order, whatever the batch or where a draft tree put them. Its attention reads F16,
BF16 or F32 caches (tq3 / tq4 caches are decoded to F16 first), so a quantized ggml cache type is
refused. On the CPU each row is then bitwise the same whatever batch computes it; on CUDA that
was measured on the synthetic 27B, the synthetic 0.8B and the tiny models (bench/README.md,
"Batch-invariant CUDA models").
"""

from __future__ import annotations

import os

from .errors import DeltaspecError

ENV = "DELTASPEC_BATCH_INVARIANT"


class BatchInvarianceError(DeltaspecError, ValueError):
    """DELTASPEC_BATCH_INVARIANT or the batch_invariant argument is malformed or cannot apply."""


def requested() -> bool | None:
    """DELTASPEC_BATCH_INVARIANT as a bool: None when unset or empty."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        raise BatchInvarianceError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


# The cache types a batch-invariant CUDA model attends over, and the element type its attention
# reads for each (tq rows are decoded to F16 first); K and V must read the same one.
_CUDA_CACHE_ELEMENTS = {"f16": "f16", "bf16": "bf16", "f32": "f32", "tq3": "f16", "tq4": "f16"}


def resolve(argument: bool | None, devices: list[str], type_k: str = "f16", type_v: str = "f16") -> bool:
    """A Model's choice: the argument when given, else the environment's (off when unset). On a
    model with a GPU, the cache types must be ones the invariant attention reads (BatchInvarianceError
    naming them otherwise)."""
    if argument is not None and not isinstance(argument, bool):
        raise BatchInvarianceError(f"batch_invariant must be True, False or None, got {argument!r}")
    on = argument if argument is not None else bool(requested())
    gpus = [d for d in devices if d != "cpu" and not d.startswith("rpc:")]
    if on and gpus:
        elements = {_CUDA_CACHE_ELEMENTS.get(t) for t in (type_k, type_v)}
        if None in elements or len(elements) != 1:
            source = "batch_invariant=True" if argument is not None else f"{ENV}=1"
            raise BatchInvarianceError(
                f"{source}: on {', '.join(gpus)} the KV cache must be f16, bf16, f32, tq3 or tq4 on both sides, read "
                f"as one element type (tq3 / tq4 as f16), got type_k={type_k!r}, type_v={type_v!r}")
    if on and any(d.startswith("rpc:") for d in devices):
        raise BatchInvarianceError("batch_invariant: a layer split over an RPC device has no batch-invariant mode")
    return on


def batch_invariant() -> bool:
    """What a Model built now without a batch_invariant argument takes: DELTASPEC_BATCH_INVARIANT
    from the environment (off when unset)."""
    return bool(requested())
