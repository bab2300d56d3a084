"""Stacked input projections (csrc/weights.h): the projections of a layer that multiply the same
input and share a type (DeltaNet qkv, gate z, beta, alpha; attention q, k, v; ffn gate and up) are
stored as one tensor, and the graph multiplies that stack once (a batch reads each projection as
strided columns of the product). The logits must be those of separate products
(DELTASPEC_STACK_PROJECTIONS=0), on a Q4_K model with Q4_K_M's Q6_K tensors mixed in, so that some
layers stack only part of their projections."""

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

# Layers 0-2 DeltaNet, 3 attention. As in a Q4_K_M file, some attn_qkv / attn_v are Q6_K.
SHAPE = dict(n_embd=256, n_ff=512)
MIXED = {"blk.0.attn_qkv.weight": "q6_k", "blk.3.attn_v.weight": "q6_k"}


@pytest.fixture(scope="module")
def mixed_q4k(tmp_path_factory):
    return write_tiny_vocab_model(tmp_path_factory.mktemp("stacks") / "mixed.gguf", quant="q4_k",
                                  tensor_quant=MIXED, **SHAPE)


def _deltanet(il, *names):
    return [f"blk.{il}.{n}.weight" for n in names]


def test_stacks_group_projections_of_one_type(mixed_q4k, monkeypatch):
    with Model(mixed_q4k, n_ctx=64) as m:
        stacks = m._engine.weight_stacks
    ffn = [[f"blk.{il}.ffn_gate.weight", f"blk.{il}.ffn_up.weight"] for il in range(4)]
    assert stacks == [
        ffn[0], _deltanet(0, "attn_gate", "ssm_beta", "ssm_alpha"),  # attn_qkv is Q6_K: alone
        ffn[1], _deltanet(1, "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
        ffn[2], _deltanet(2, "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
        ffn[3], _deltanet(3, "attn_q", "attn_k"),  # attn_v is Q6_K: alone
    ]
    monkeypatch.setenv("DELTASPEC_STACK_PROJECTIONS", "0")
    with Model(mixed_q4k, n_ctx=64) as m:
        assert m._engine.weight_stacks == []


def test_stacked_products_give_the_same_logits(mixed_q4k, monkeypatch):
    ids = np.random.default_rng(3).integers(0, 256, size=24).tolist()

    def run():
        with Model(mixed_q4k, n_ctx=64, n_threads=2) as m:
            rows = [m.eval(ids[:9], logits="all")]               # a batch: strided views of the stacks
            rows += [m.eval([t], logits="all") for t in ids[9:]]  # one token
            greedy = m.generate(ids[:5], max_tokens=24, temperature=0).tokens
        return np.concatenate(rows), greedy

    stacked, stacked_greedy = run()
    monkeypatch.setenv("DELTASPEC_STACK_PROJECTIONS", "0")
    separate, separate_greedy = run()
    # Separate products load each weight as a tensor of its own, so a wrong row offset or order in
    # the stack shows here; and every output row is the same dot product of the same quantized x,
    # whichever tensor holds the weights, so the logits are equal to the bit.
    np.testing.assert_array_equal(stacked, separate)
    assert stacked_greedy == separate_greedy

