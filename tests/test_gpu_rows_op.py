"""The rows ops on CUDA (ggml/cuda/deltaspec_rows.cu) against ggml's CUDA ops and against the rows ops
on the CPU, on chains, trees and batches of several slots, at Qwen3.5-27B's DeltaNet shapes (48 value
heads, 16 q/k heads, state 128, 10240 conv channels) and tiny ones (runs only where a CUDA build and a
GPU exist).

Run on the GPU machine with: python -m pytest -q -m gpu tests/test_gpu_rows_op.py

Bitwise on CUDA: the recurrence's token step and sums are those of ggml's CUDA kernel (and of
deltaspec's verify kernel, which ggml's op reaches for batches of state 128), and the conv's are
those of ggml's ssm-conv.cu, so a chain must give ggml's CUDA bits and a tree path its chain's.
Except at state 32: there the same expressions, compiled by nvcc inside ggml's kernel, come out with
other roundings than ours (seen on the H200: every state-32 chain, even of one row, differed), so a
state-32 chain is held to ggml's within REL and a state-32 tree path to the rows op's own chain over
that path, bitwise. Qwen3.5 and 3.6 have state 128 at every size.
Against the CPU the bound is relative (expf, fused multiply-adds and the order of sums differ).

Planted bugs (DELTASPEC_TEST_ROWS_BUG): cuda_continue (a branch keeps the state of the row walked
before it instead of reloading its parent's: trees fail, split or not), cuda_short_window (the conv gathers only the
parent: conv trees and chains longer than one row fail), and the CPU's (continue, slot0,
no_write_back, short_window) for the CUDA-vs-CPU comparisons.
"""

import numpy as np
import pytest

from deltaspec import _core
from rows_op_cases import (KEEP_STATE, SAVED, START, WALK_END, WRITE_BACK, chain, chain_conv, chain_deltanet, conv_inputs,
                           deltanet_inputs, paths, random_tree, rows_conv, rows_deltanet)


def _cuda_available() -> bool:
    return _core.has_device("cuda")


# A skipif mark, not a module-level skip: -m "not gpu" then deselects these tests instead of reporting
# a skip, which fails a CI=true run (tests/ci_skips.py).
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="no CUDA device in this build "
                                                   "of deltaspec (CPU-only build or no GPU)")]

QWEN27B = dict(S=128, H=48, Hk=16)
SHAPES = {"27b": QWEN27B, "s64": dict(S=64, H=4, Hk=2), "s32": dict(S=32, H=6, Hk=2)}
REL = 1e-4  # CUDA vs CPU: max |difference| / max |value|
BITWISE_WITH_GGML = (64, 128)  # states whose CUDA chains give ggml's CUDA bits (see above for 32)


def rel_error(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("R", [1, 17, 40])
def test_cuda_chain_is_ggml_cuda_bitwise(shape, R):
    """A chain on CUDA gives ggml_gated_delta_net's CUDA outputs and final state bit for bit, and the
    CPU's within REL. Seen to fail with DELTASPEC_TEST_ROWS_BUG=slot0 only where the CPU is
    compared (the chain uses slot 1)."""
    sh = SHAPES[shape]
    inp = deltanet_inputs(np.random.default_rng(R), R, sh["S"], sh["H"], sh["Hk"], n_slots=2)
    flags = [0] * (R - 1) + [WRITE_BACK]
    got = rows_deltanet("cuda", inp, chain(R), [1] * R, flags)
    ref = chain_deltanet("cuda", inp, list(range(R)), 1)
    if sh["S"] in BITWISE_WITH_GGML:
        assert np.array_equal(got["y"], ref["y"])
        assert np.array_equal(got["pool"][1], ref["state"])
    else:
        assert rel_error(got["y"], ref["y"]) < REL and rel_error(got["pool"][1], ref["state"]) < REL
    assert np.array_equal(got["pool"][0], inp["pool"][0])
    cpu = rows_deltanet("cpu", inp, chain(R), [1] * R, flags, n_threads=4)
    assert rel_error(got["y"], cpu["y"]) < REL and rel_error(got["pool"], cpu["pool"]) < REL


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("depth_first", [True, False], ids=["depth-first", "creation-order"])
def test_cuda_tree_paths_are_chains(shape, depth_first):
    """Every root-to-leaf path of a 23-row tree on CUDA gives its chain's CUDA bits (ggml's op on the
    path), outputs and leaf state (KEEP_STATE), and the CPU rows op's within REL. Seen to fail with
    DELTASPEC_TEST_ROWS_BUG=cuda_continue."""
    sh = SHAPES[shape]
    rng = np.random.default_rng(5)
    R = 23
    inp = deltanet_inputs(rng, R, sh["S"], sh["H"], sh["Hk"], n_slots=1)
    parent = random_tree(rng, R, depth_first)
    leaves = [p[-1] for p in paths(parent)]
    flags = [KEEP_STATE if r in leaves else 0 for r in range(R)]
    got = rows_deltanet("cuda", inp, parent, [0] * R, flags)
    assert len(leaves) > 1 and (got["rows"][:, START] >= 0).any(), "the tree must branch"
    assert np.array_equal(got["pool"], inp["pool"])
    for path in paths(parent):
        if sh["S"] in BITWISE_WITH_GGML:
            ref = chain_deltanet("cuda", inp, path, 0)
            ref_y, ref_state = ref["y"], ref["state"]
        else:  # the rows op itself over the path's rows, as a chain
            on_path = {name: np.ascontiguousarray(inp[name][path]) for name in ("q", "k", "v", "g", "beta")}
            ref = rows_deltanet("cuda", dict(on_path, pool=inp["pool"]), chain(len(path)), [0] * len(path),
                                [0] * (len(path) - 1) + [KEEP_STATE])
            ref_y, ref_state = ref["y"], ref["saved"][ref["rows"][len(path) - 1, SAVED]]
        assert np.array_equal(got["y"][path], ref_y), f"path {path}"
        assert np.array_equal(got["saved"][got["rows"][path[-1], SAVED]], ref_state), f"path {path}"
    cpu = rows_deltanet("cpu", inp, parent, [0] * R, flags, n_threads=4)
    assert rel_error(got["y"], cpu["y"]) < REL and rel_error(got["saved"], cpu["saved"]) < REL


def test_cuda_slots_decode_and_replay():
    """27B shapes. Decode of 32 sequences (32 roots of 32 slots, each writing back) gives each slot its
    one-token chain's CUDA state; a batch of three slots (a tree, a chain, a decode row, interleaved)
    gives the CPU rows op's results within REL and leaves an unused slot untouched; replaying the
    tree's longest path (other rows skipped) writes that path's state back. Seen to fail with
    DELTASPEC_TEST_ROWS_BUG=slot0 or no_write_back (through the CPU comparison) and cuda_continue."""
    rng = np.random.default_rng(9)
    S, H, Hk = QWEN27B["S"], QWEN27B["H"], QWEN27B["Hk"]
    N = 32
    inp = deltanet_inputs(rng, N, S, H, Hk, n_slots=N)
    order = rng.permutation(N).tolist()
    got = rows_deltanet("cuda", inp, [-1] * N, order, [WRITE_BACK] * N)
    for r, s in enumerate(order):
        ref = chain_deltanet("cuda", inp, [r], s)
        assert np.array_equal(got["pool"][s], ref["state"]) and np.array_equal(got["y"][r], ref["y"][0]), f"slot {s}"

    tree = random_tree(rng, 9)
    parent = tree + [-1, 9, 10, 11, -1]  # slot 2: the tree; slot 0: a 4-row chain; slot 3: one row
    slot = [2] * 9 + [0] * 4 + [3]
    R = len(parent)
    flags = [0] * 9 + [0, 0, 0, WRITE_BACK, WRITE_BACK]
    inp = deltanet_inputs(rng, R, S, H, Hk, n_slots=4)
    cuda = rows_deltanet("cuda", inp, parent, slot, flags)
    cpu = rows_deltanet("cpu", inp, parent, slot, flags, n_threads=4)
    assert rel_error(cuda["y"], cpu["y"]) < REL and rel_error(cuda["pool"], cpu["pool"]) < REL
    assert np.array_equal(cuda["pool"][1], inp["pool"][1]) and np.array_equal(cuda["pool"][2], inp["pool"][2])
    accepted = max(paths(tree), key=len)
    replay_slot = [2 if r in accepted else -1 for r in range(R)]
    replay = rows_deltanet("cuda", inp, parent, replay_slot, [WRITE_BACK if r == accepted[-1] else 0 for r in range(R)])
    assert np.array_equal(replay["pool"][2], chain_deltanet("cuda", inp, accepted, 2)["state"])


@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu-fused"])
@pytest.mark.parametrize("C,Kc,R", [(10240, 4, 1), (10240, 4, 23), (256, 3, 9), (256, 5, 40)])
def test_cuda_conv_chain_is_ggml_cuda_bitwise(silu, C, Kc, R):
    """The conv over a chain on CUDA gives ggml_ssm_conv's CUDA bits (also with the SiLU that
    ggml-cuda fuses into either node), the CPU's within REL, and its write-back stores the window
    after the chain exactly. Seen to fail with DELTASPEC_TEST_ROWS_BUG=cuda_short_window (R > 1)."""
    inp = conv_inputs(np.random.default_rng(R + Kc), R, C, Kc, n_slots=2)
    flags = [0] * (R - 1) + [WRITE_BACK]
    got = rows_conv("cuda", inp, chain(R), [1] * R, flags, silu=silu)
    sx = np.concatenate([inp["pool"][1], inp["x"].T], axis=1)
    ref = _core.ssm_conv("cuda", np.ascontiguousarray(sx[None]), inp["c"], silu=silu)[0]
    assert np.array_equal(got["y"], ref)
    assert np.array_equal(got["pool"][1], sx[:, -(Kc - 1):]) and np.array_equal(got["pool"][0], inp["pool"][0])
    cpu = rows_conv("cpu", inp, chain(R), [1] * R, flags, silu=silu, n_threads=4)
    assert rel_error(got["y"], cpu["y"]) < REL


def test_cuda_conv_tree_and_slots():
    """27B channels. The conv of a tree (slot 0) and a short chain (slot 1) in one batch: every path
    gives its chain's ggml_ssm_conv CUDA bits; a replay of the longest path writes back the window
    after it. Seen to fail with DELTASPEC_TEST_ROWS_BUG=cuda_short_window."""
    rng = np.random.default_rng(4)
    C, Kc = 10240, 4
    tree = random_tree(rng, 15)
    parent = tree + [-1, 15]
    slot = [0] * 15 + [1] * 2
    R = len(parent)
    inp = conv_inputs(rng, R, C, Kc, n_slots=2)
    got = rows_conv("cuda", inp, parent, slot, silu=True)
    for path in paths(parent):
        sx = np.concatenate([inp["pool"][slot[path[0]]], inp["x"][path].T], axis=1)
        ref = _core.ssm_conv("cuda", np.ascontiguousarray(sx[None]), inp["c"], silu=True)[0]
        assert np.array_equal(got["y"][path], ref), f"path {path}"
    accepted = max(paths(tree), key=len)
    replay = rows_conv("cuda", inp, parent, [0 if r in accepted else -1 for r in range(R)],
                       [WRITE_BACK if r == accepted[-1] else 0 for r in range(R)])
    _, window = chain_conv("cpu", inp, accepted, 0)
    assert np.array_equal(replay["pool"][0], window) and np.array_equal(replay["pool"][1], inp["pool"][1])


DDTREE_23 = [-1] + list(range(16)) + [0, 1, 17, 2, 18, 19]  # tree_verify_cost.py's 1 + 22 rows


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tree", ["ddtree", "depth-first", "creation-order"])
def test_cuda_split_walks_give_the_unsplit_bits(shape, tree):
    """A tree walked as two walks at once (its deepest path and, in other thread blocks, the other
    rows with their ancestors: deltaspec_rows.h) gives every row's output and every kept leaf state bit
    for bit as one walk on CUDA does, beside a chain of another slot that writes back. The split must
    happen (two walks for the tree's slot). Seen to fail with DELTASPEC_TEST_ROWS_BUG=cuda_continue."""
    sh = SHAPES[shape]
    rng = np.random.default_rng(11)
    parent = DDTREE_23 if tree == "ddtree" else random_tree(rng, 23, tree == "depth-first")
    T, C = len(parent), 5
    leaves = {p[-1] for p in paths(parent)}
    parent = parent + [-1] + [T + i for i in range(C - 1)]
    slot = [0] * T + [1] * C
    flags = [KEEP_STATE if r in leaves else 0 for r in range(T)] + [0] * (C - 1) + [WRITE_BACK]
    inp = deltanet_inputs(rng, T + C, sh["S"], sh["H"], sh["Hk"], n_slots=2)
    one = rows_deltanet("cuda", inp, parent, slot, flags)
    two = rows_deltanet("cuda", inp, parent, slot, flags, split=True)
    assert (two["rows"][:, WALK_END] >= 0).sum() == 3, "the tree's slot splits into two walks"
    assert np.array_equal(two["y"], one["y"]) and np.array_equal(two["pool"], one["pool"])
    for leaf in leaves:
        assert np.array_equal(two["saved"][two["rows"][leaf, SAVED]], one["saved"][one["rows"][leaf, SAVED]])
