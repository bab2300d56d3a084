"""Batch-invariant CPU models: Model(batch_invariant=True) or DELTASPEC_BATCH_INVARIANT=1.

By default the pinned ggml-cpu computes a row in another order depending on the batch around it:
it multiplies K-quant weights (Q2_K..Q6_K, IQ*) by batches of 8 or more rows in its tiled kernel
and by fewer rows with the per-row vec_dot; it attends with a tiled kernel from 64 query rows on;
and it splits a one-row attention over the threads once the KV cache holds 512 cells (with 2+
threads). Each sums in another order than the path a one-token step takes, so a row's logits
depend on the width of the batch that computed it (a one-token step, a verify batch, a prefill),
and speculative greedy decoding can part from plain greedy at a near-tie.

A batch-invariant model runs its CPU backend on ggml-cpu's reference paths
(ggml_backend_cpu_set_use_ref): vec_dot at every width, one attention kernel whatever the rows
and cells, no fused ops. Each row is then bitwise the same whatever batch computes it. The choice
is the backend's, so it is made per Model; models on a GPU have no such mode (their verify
batches run tensor-core kernels, one-token steps mat-vecs).
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


def resolve(argument: bool | None, devices: list[str]) -> bool:
    """A Model's choice: the argument when given, else the environment's (off when unset). Asked
    for explicitly on a model with a GPU, it raises; the environment's request, which may be meant
    for the CPU models of the process, leaves such a model as it is."""
    if argument is not None and not isinstance(argument, bool):
        raise BatchInvarianceError(f"batch_invariant must be True, False or None, got {argument!r}")
    on_cpu = all(d == "cpu" for d in devices)
    if argument is not None:
        if argument and not on_cpu:
            raise BatchInvarianceError(
                f"batch_invariant=True: only a CPU model has a batch-invariant mode, and this one runs on "
                f"{', '.join(d for d in devices if d != 'cpu')}")
        return argument
    return bool(requested()) and on_cpu


def batch_invariant() -> bool:
    """What a CPU Model built now without a batch_invariant argument takes: DELTASPEC_BATCH_INVARIANT
    from the environment (off when unset)."""
    return bool(requested())
