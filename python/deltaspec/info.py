"""`deltaspec info`: what a qwen35 GGUF holds and what running it costs in memory."""

from __future__ import annotations

from collections import Counter

from .gguf_file import read_gguf
from .kv_cache import CACHE_TYPES, block_size, kv_bytes_per_token, padded_n_ctx
from .qwen35 import check_tensors, expected_tensors, read_hparams


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def describe(path: str, n_ctx: int = 4096) -> list[str]:
    """Report lines; memory is given for the context a Model(path, n_ctx=n_ctx) allocates (n_ctx
    rounded up to a multiple of 256)."""
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1:
        raise ValueError(f"n_ctx must be a positive integer, got {n_ctx!r}")
    n_ctx = padded_n_ctx(n_ctx)
    f = read_gguf(path)
    hp = read_hparams(f)
    check_tensors(hp, f)
    used = expected_tensors(hp, f)
    weight_bytes = sum(f.tensors[n].n_bytes for n in used)
    mix = Counter()
    for name in used:
        mix[f.tensors[name].type.name] += f.tensors[name].n_bytes
    n_attn = hp.n_attention_layers
    n_rec = hp.n_layer - n_attn
    kv_per_token_f16 = kv_bytes_per_token(hp, "f16", "f16")
    recurrent = hp.recurrent_state_bytes
    name = f.metadata.get("general.name", "")
    lines = [
        f"file            {path}",
        f"architecture    {f.metadata['general.architecture']}" + (f" ({name})" if name else ""),
        f"layers          {hp.n_layer} = {n_rec} Gated DeltaNet + {n_attn} gated attention",
        f"mtp             " + (f"{hp.n_layer_nextn} MTP (NextN) layer(s): --spec-type mtp drafts with it"
                               if hp.n_layer_nextn else "none (no MTP layer in this file)"),
        f"embedding       {hp.n_embd}, vocab {hp.n_vocab}, output {'tied' if hp.tied_output else 'untied'}",
        f"attention       {hp.n_head} heads / {hp.n_head_kv} KV heads x {hp.head_dim}, rope {hp.n_rot} dims, "
        f"base {hp.rope_freq_base:g}",
        f"deltanet        {hp.ssm_n_k_heads} key / {hp.ssm_n_v_heads} value heads x {hp.ssm_state_size}, "
        f"conv {hp.ssm_conv_kernel}",
        f"context (train) {hp.n_ctx_train}",
        f"weights         {_mib(weight_bytes)} in {len(used)} tensors; "
        + ", ".join(f"{t} {100 * b / weight_bytes:.1f}%" for t, b in mix.most_common()),
        f"recurrent state {_mib(recurrent)} per sequence",
        f"KV cache (f16)  {kv_per_token_f16:,} bytes/token, {_mib(kv_per_token_f16 * n_ctx)} at n_ctx={n_ctx}",
        f"total at n_ctx={n_ctx}: {_mib(weight_bytes + recurrent + kv_per_token_f16 * n_ctx)} (f16 KV)",
    ]
    lines.append(f"KV cache per type (K = V), at n_ctx={n_ctx}:")
    for name in CACHE_TYPES:
        if hp.head_dim % block_size(name) == 0:
            per_token = kv_bytes_per_token(hp, name, name)
            lines.append(f"  {name:<7} {per_token:>12,} bytes/token {_mib(per_token * n_ctx):>14}")
    return lines


def print_info(path: str, n_ctx: int = 4096) -> None:
    print("\n".join(describe(path, n_ctx)))
