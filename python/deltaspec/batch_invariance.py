"""Batch-invariant CPU matmuls: DELTASPEC_BATCH_INVARIANT=1.

The pinned ggml-cpu multiplies K-quant weights (Q2_K..Q6_K, IQ*) by batches of 8 or more rows in
its tiled kernel and by fewer rows with the per-row vec_dot; the two sum in another order, so a
row's logits depend on the width of the batch that computed it (a one-token step, a verify batch,
a prefill), and speculative greedy decoding can part from plain greedy at a near-tie. With
GGML_CPU_TILED_MM=0 every width takes vec_dot and each row is bitwise the same whatever batch
computes it (F32, F16, BF16 and the legacy quants are already: they have no tiled kernel, and
this build leaves llamafile's sgemm, which would take only batches of 2+ rows, out).

ggml reads GGML_CPU_TILED_MM once per process, at its first matmul, so this cannot be a Model
argument: DELTASPEC_BATCH_INVARIANT=1 in the environment (or os.environ before the first Model)
is translated into it when the process's first Model is built, and that choice then holds for
the process. A later Model that asks for another one gets BatchInvarianceError rather than
a setting that silently does not apply. Only the CPU backend is concerned.
"""

from __future__ import annotations

import os
import re

from .errors import DeltaspecError

ENV = "DELTASPEC_BATCH_INVARIANT"
GGML_TILED = "GGML_CPU_TILED_MM"          # 0: no tiled kernel at any width (ggml's master switch)
GGML_TILED_FORCE = "GGML_CPU_TILED_MM_FORCE"  # 1: tiled kernel at every width (also invariant)

_in_effect: bool | None = None  # fixed by the process's first Model: ggml has read its variables by then


class BatchInvarianceError(DeltaspecError, ValueError):
    """DELTASPEC_BATCH_INVARIANT is malformed, or asks for what this process can no longer do."""


def _atoi(text: str | None) -> int | None:
    # ggml parses its variables with atoi: leading digits count, anything else reads as 0
    if text is None:
        return None
    m = re.match(r"\s*[+-]?\d+", text)
    return int(m.group()) if m else 0


def requested() -> bool | None:
    """DELTASPEC_BATCH_INVARIANT as a bool: None when unset or empty."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        raise BatchInvarianceError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _ggml_invariant() -> bool:
    """Whether ggml's own variables, as set now, give batch-invariant CPU matmuls."""
    tiled = _atoi(os.environ.get(GGML_TILED))
    return tiled == 0 or _atoi(os.environ.get(GGML_TILED_FORCE)) == 1


def apply() -> bool:
    """Before a Model's engine is built: on the process's first call, translate the request into
    ggml's variable; afterwards, refuse a request the fixed choice does not meet. Returns whether
    the CPU matmuls are batch-invariant in this process."""
    global _in_effect
    want = requested()
    if _in_effect is None:
        if want:
            os.environ[GGML_TILED] = "0"
        elif want is False and _ggml_invariant():
            raise BatchInvarianceError(f"{ENV}=0 but {GGML_TILED}={os.environ.get(GGML_TILED)!r} / "
                                       f"{GGML_TILED_FORCE}={os.environ.get(GGML_TILED_FORCE)!r} make the CPU "
                                       f"matmuls batch-invariant; unset one or the other")
        _in_effect = _ggml_invariant()
    elif want is not None and want != _in_effect:
        raise BatchInvarianceError(
            f"{ENV}={int(want)} asked after this process's first Model, which fixed it at {int(_in_effect)}: "
            f"ggml reads {GGML_TILED} once per process; set {ENV} before the first Model is built")
    return _in_effect


def batch_invariant() -> bool:
    """Whether a row's logits on the CPU are bitwise the same whatever batch width computes them:
    the choice in effect once a Model has been built, else the one the environment would make."""
    if _in_effect is not None:
        return _in_effect
    return bool(requested()) or _ggml_invariant()
