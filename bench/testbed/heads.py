"""The torch modules of the testbed beside transformers' target: the MTP head and the helpers that
run the target for its features and dflash's DFlashDraftModel on blocks at given anchors.

MTP follows Qwen3.5 checkpoints and llama.cpp's `graph_mtp` (qwen35_ggml_spec.md §4.2): the
token's embedding and the target's *normed* final hidden state of the previous position, each
RMS-normed, concatenated (embedding first), projected 2h -> h by `fc`, one gated full-attention
decoder block (transformers' Qwen3_5DecoderLayer, causal), a final norm and the target's LM head.
Module names are the checkpoint's `mtp.*` names, so `state_dict()` under the prefix "mtp." is what
llama.cpp's converter maps to `blk.{n_layer}.nextn.*`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm


def causal_mask(n: int, device) -> torch.Tensor:
    """[1, 1, n, n] bool, True where a query may see a key (sdpa's convention)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]


def text_positions(positions: torch.Tensor) -> torch.Tensor:
    """[B, T] positions -> the [3, B, T] M-RoPE form transformers' Qwen3.5 rotary takes (text: all equal)."""
    return positions[None].expand(3, *positions.shape)


class MTPHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        mtp_config = config.__class__(**{**config.to_dict(), "layer_types": ["full_attention"], "num_hidden_layers": 1})
        mtp_config._attn_implementation = "sdpa"
        h = config.hidden_size
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(mtp_config, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, token_embeddings: torch.Tensor, prev_hidden: torch.Tensor, position_embeddings,
                attention_mask: torch.Tensor) -> torch.Tensor:
        """token_embeddings, prev_hidden: [B, T, h] -> the head's normed output [B, T, h] (which is
        both the LM head's input and, when drafting further, the next step's prev_hidden)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(token_embeddings), self.pre_fc_norm_hidden(prev_hidden)], -1))
        out = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=attention_mask)
        x = out[0] if isinstance(out, tuple) else out
        return self.norm(x)


def target_features(target, ids: torch.Tensor, layer_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One target forward: (logits [B,T,V], normed final hidden [B,T,h], features [B,T,len(layer_ids)*h]).

    A feature of layer l is that decoder layer's output (the dflash package's hidden_states[l + 1]),
    taken with forward hooks so no transformers-version-specific output flag is needed."""
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for l in sorted(set(layer_ids)):
        def hook(_m, _inp, out, l=l):
            captured[l] = out[0] if isinstance(out, tuple) else out
        hooks.append(target.model.layers[l].register_forward_hook(hook))
    try:
        hidden = target.model(input_ids=ids).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
    logits = target.lm_head(hidden)
    return logits, hidden, torch.cat([captured[l] for l in layer_ids], -1)


def mtp_forward(mtp: MTPHead, target, tokens: torch.Tensor, prev_hidden: torch.Tensor,
                positions: torch.Tensor, at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP over a causal sequence of (token at p, target hidden at p-1) pairs -> (logits, hidden).
    at [B]: the logits of that position of each row only ([B, V]: the head's matrix product over
    every position is most of the cost when only one is read)."""
    emb = target.model.embed_tokens(tokens)
    pe = target.model.rotary_emb(emb, text_positions(positions))
    h = mtp(emb, prev_hidden, pe, causal_mask(tokens.shape[1], tokens.device))
    if at is not None:
        return target.lm_head(h[torch.arange(h.shape[0], device=h.device), at]), h
    return target.lm_head(h), h


def dflash_blocks(dflash, target, features: torch.Tensor, anchors: torch.Tensor, anchor_tokens: torch.Tensor,
                  mask_id: int) -> torch.Tensor:
    """DFlash logits for blocks opened at `anchors`: [B, A, block-1, V].

    features [B, S, F]: target features of every position of the row; anchors [B, A] (position of
    each block's first token, whose own feature is NOT visible, as at inference where the bonus
    token's features do not exist yet); anchor_tokens [B, A]. A block sees the context keys before
    its anchor and its own block both ways, never another block (the training mask of the DFlash
    recipe, algorithms_brief.md §1.5; with one anchor per row it is the inference forward)."""
    B, S, _ = features.shape
    A = anchors.shape[1]
    L = dflash.block_size
    dev = features.device
    block_tokens = torch.full((B, A, L), mask_id, dtype=torch.long, device=dev)
    block_tokens[:, :, 0] = anchor_tokens
    noise = target.model.embed_tokens(block_tokens.view(B, A * L))
    block_pos = (anchors[:, :, None] + torch.arange(L, device=dev)).view(B, A * L)
    ctx_pos = torch.arange(S, device=dev).expand(B, S)
    position_ids = torch.cat([ctx_pos, block_pos], 1)
    q_block = torch.arange(A * L, device=dev) // L                      # which block each query is in
    q_anchor = anchors.repeat_interleave(L, dim=1)                      # [B, A*L]: each query's anchor
    sees_ctx = ctx_pos[:, None, :] < q_anchor[:, :, None]               # context strictly before the anchor
    sees_block = (q_block[:, None] == q_block[None, :]).expand(B, -1, -1)
    mask = torch.cat([sees_ctx, sees_block], 2)[:, None]               # [B, 1, A*L, S + A*L]
    hidden = dflash(position_ids=position_ids, attention_mask=mask, noise_embedding=noise, target_hidden=features)
    hidden = hidden.view(B, A, L, -1)[:, :, 1:]
    return target.lm_head(hidden)
