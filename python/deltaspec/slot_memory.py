"""What one sequence slot costs: its KV cache rows and its recurrent state.

A Model with n_seq_max = N allocates N slots alike (Model.kv_cache_info()["slots"] lists them), so
the memory a server needs for N concurrent sequences at context n_ctx is the weights plus N times
this. The KV part grows with the context; the recurrent part (conv windows + DeltaNet states of the
Gated DeltaNet layers, f32) does not.
"""

from __future__ import annotations

from typing import Protocol

from .kv_cache import kv_bytes_per_token

# the contexts users ask about most: a chat, a long document, the model's long-context mode
REPORT_CONTEXTS = (4096, 32768, 131072)
REPORT_TYPES = ("f16", "q8_0", "q4_0")


class _SlotHParams(Protocol):
    n_head_kv: int
    head_dim: int

    @property
    def n_attention_layers(self) -> int: ...

    @property
    def recurrent_state_bytes(self) -> int: ...


def slot_bytes(hp: _SlotHParams, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> dict[str, int]:
    """{"kv": ..., "recurrent": ..., "total": ...} bytes of one slot holding n_ctx tokens."""
    kv = n_ctx * kv_bytes_per_token(hp, type_k, type_v)
    rec = int(hp.recurrent_state_bytes)
    return {"kv": kv, "recurrent": rec, "total": kv + rec}


def slot_table(hp: _SlotHParams, contexts=REPORT_CONTEXTS, types=REPORT_TYPES) -> list[dict]:
    """One entry per (context, cache type) with the bytes of one slot."""
    return [{"n_ctx": n, "type": t, **slot_bytes(hp, n, t, t)} for n in contexts for t in types
            if hp.head_dim % _block(t) == 0]


def _block(name: str) -> int:
    from .kv_cache import block_size

    return block_size(name)


def format_slot_table(rows: list[dict]) -> list[str]:
    mib = 2.0**20
    lines = ["memory per sequence slot (KV + recurrent state; n_seq_max slots are allocated alike):"]
    for r in rows:
        lines.append(f"  n_ctx {r['n_ctx']:>7,}  {r['type']:<5} KV {r['kv'] / mib:11,.1f} MiB"
                     f" + recurrent {r['recurrent'] / mib:7,.1f} MiB = {r['total'] / mib:11,.1f} MiB")
    return lines
