"""`deltaspec info`: what a qwen35 GGUF holds and what running it costs in memory."""

from __future__ import annotations

from collections import Counter

from .gguf_file import read_gguf
from .kv_cache import CACHE_TYPES, TQ_CACHE_TYPES, fits_head_dim, kv_bytes_per_token, padded_n_ctx
from .qwen35 import check_tensors, expected_tensors, read_hparams
from .slot_memory import format_slot_table, slot_table


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _split_lines(f, hp, used: list[str], shares: list[float]) -> list[str]:
    """Where a layer split with these shares puts each block and its weights (llama.cpp's rule,
    deltaspec.devices.layer_devices; the token embeddings stay on the CPU)."""
    from .devices import layer_devices

    n_blocks = hp.n_layer + hp.n_layer_nextn
    where = layer_devices(n_blocks, shares)
    placed = [0] * len(shares)
    for name in used:
        if name.startswith("blk."):
            placed[where[int(name.split(".")[1])]] += f.tensors[name].n_bytes
        elif name != "token_embd.weight":
            placed[where[-1]] += f.tensors[name].n_bytes
    lines = [f"layer split (-ts {','.join(f'{x:g}' for x in shares)}, llama.cpp's -sm layer rule); token embeddings "
             f"{_mib(f.tensors['token_embd.weight'].n_bytes)} on the CPU:"]
    for d in range(len(shares)):
        blocks = [il for il in range(n_blocks) if where[il] == d]
        span = ("no layers" if not blocks else f"layer {blocks[0]}" if len(blocks) == 1
                else f"layers {blocks[0]}-{blocks[-1]}")
        lines.append(f"  device {d}: {span}" + (" + output" if where[-1] == d else "") + f", {_mib(placed[d])}")
    return lines


def describe(path: str, n_ctx: int = 4096, tensor_split: list[float] | None = None) -> list[str]:
    """Report lines; memory is given for the context a Model(path, n_ctx=n_ctx) allocates (n_ctx
    rounded up to a multiple of 256); with tensor_split, where a layer split puts the layers."""
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
    for name in (*CACHE_TYPES, *TQ_CACHE_TYPES):  # a rotated type (q4_0+rot) takes its type's bytes
        if fits_head_dim(name, hp.head_dim):
            per_token = kv_bytes_per_token(hp, name, name)
            lines.append(f"  {name:<7} {per_token:>12,} bytes/token {_mib(per_token * n_ctx):>14}")
    lines += format_slot_table(slot_table(hp))
    if tensor_split:
        lines += _split_lines(f, hp, used, tensor_split)
    return lines


def print_info(path: str, n_ctx: int = 4096, tensor_split: list[float] | None = None) -> None:
    print("\n".join(describe(path, n_ctx, tensor_split)))
