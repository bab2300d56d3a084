"""Tree verification (Engine::verify_tree) and keeping one of its paths (Engine::keep_path).

The claims: every root-to-leaf path of a verified tree gives the logits that path gives as a chain
verify (eval_verify), and after keep_path(path) the sequence is the one that plainly evaluating the
path gives: the same recurrent state, the same KV rows, the same next logits. On the CPU with the
tiny-vocabulary model (F32 weights, which ggml-cpu multiplies row by row whatever the batch width;
the rows ops, which give ggml's own ops' bits on a chain; flash attention skipping masked rows, so
a path's keys are summed in the same order wherever they sit) all of it is bitwise, so the tests
ask for equality, not closeness.

Planted bugs (DELTASPEC_TEST_TREE_BUG, csrc/verify_tree.cpp), read once per process, each seen to
turn the tests named in its line red (run `DELTASPEC_TEST_TREE_BUG=<bug> pytest tests/test_tree_verify.py`):
  sibling_visible  each row sees every earlier row of the batch: test_tree_paths_equal_their_chains
                   (not the keep tests: the tiny model's one attention layer is its last, so the
                   mask reaches the logits only, never the kept state)
  row_position     a row's position is length + its index, not + its depth:
                   test_tree_paths_equal_their_chains, test_keep_path_equals_plain_evaluation,
                   test_keep_path_quantized_cache
  no_compaction    keep_path leaves the kept KV rows where the verify wrote them:
                   test_keep_path_equals_plain_evaluation, test_keep_path_quantized_cache
  parent_state     keep_path commits the recurrent state after the leaf's parent:
                   test_keep_path_equals_plain_evaluation, test_chain_tree_keep_equals_keep,
                   test_keep_path_quantized_cache
  taps_uncompacted keep_path keeps the tapped rows of the batch's first rows, not the path's:
                   test_keep_path_taps_equal_plain_run
  stale_keep_graph the commit graph (shared by keep_path and keep_paths) is reused when only its KV
                   moves differ: test_keep_path_equals_plain_evaluation,
                   test_keep_paths_of_one_slot_equal_keep_path
DELTASPEC_TEST_ROWS_BUG=no_compaction (csrc/rows.h: keep_paths leaves a kept path's KV rows where the
verify wrote them) turns test_keep_paths_of_one_slot_equal_keep_path red.
"""

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

PREFIX = [5, 77, 120, 33, 9, 201, 14]

# (tokens, parents): a DDTree-like tree (the top-1 chain first, then siblings and their children),
# a wide one (one root, many children, rows of one depth not adjacent), a chain, and a forest
# (two rows continuing the committed sequence).
TREES = {
    "ddtree": ([40, 41, 42, 43, 44, 50, 51, 52, 60, 61, 70],
               [-1, 0, 1, 2, 3, 0, 5, 1, 2, 8, 5]),
    "wide": ([40, 90, 91, 92, 93, 94, 95, 96, 97],
             [-1, 0, 0, 0, 1, 0, 4, 2, 4]),
    "chain": ([40, 41, 42, 43, 44, 45], [-1, 0, 1, 2, 3, 4]),
    "forest": ([40, 41, 90, 91, 42], [-1, 0, -1, 2, 1]),
}


def _paths(parents):
    """Every root-to-leaf path (and, for a leaf's ancestors, the prefixes are paths too)."""
    children = {i for p in parents for i in [p] if p >= 0}
    out = []
    for leaf in range(len(parents)):
        if leaf in children:
            continue
        path, r = [], leaf
        while r >= 0:
            path.insert(0, r)
            r = parents[r]
        out.append(path)
    return out


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_vocab_model(tmp_path_factory.mktemp("tree") / "tiny.gguf", seed=0)


@pytest.fixture(scope="module")
def pair(path):
    """Two loads of one file: one verifies trees, the other is the reference (chains, plain eval)."""
    kw = dict(n_ctx=256, n_threads=1)
    with Model(path, **kw) as tree, Model(path, **kw) as ref:
        ref._live().reserve_slots(16)
        yield tree, ref


def _state(model):
    return model._live().state_arrays()


def _assert_same_state(got_model, want_model):
    """Recurrent state bitwise; KV rows of the committed tokens bitwise (rows past them are dead)."""
    got, want = _state(got_model), _state(want_model)
    n = want_model.n_past
    assert got_model.n_past == n
    assert got.keys() == want.keys()
    for key in want:
        a, b = np.frombuffer(got[key], np.uint8), np.frombuffer(want[key], np.uint8)
        if key[0] in "kv":
            a = a.reshape(want_model.n_ctx, -1)[:n]
            b = b.reshape(want_model.n_ctx, -1)[:n]
        assert np.array_equal(a, b), key


@pytest.mark.parametrize("shape", sorted(TREES))
def test_tree_paths_equal_their_chains(pair, shape):
    """Each root-to-leaf path's rows of the tree's logits (and its device argmax) equal, bitwise, that
    path verified as a chain on its own. Seen to fail with DELTASPEC_TEST_TREE_BUG=sibling_visible and
    =row_position."""
    tree, ref = pair
    tokens, parents = TREES[shape]
    tree.reset()
    tree.eval(PREFIX)
    engine = tree._live()
    before = dict(engine.tree_stats)
    logits = engine.verify_tree(np.array(tokens, np.int32), np.array(parents, np.int32))
    assert tree.n_past == len(PREFIX)  # nothing committed
    stats = engine.tree_stats
    assert stats["verify_calls"] == before["verify_calls"] + 1
    assert stats["rows_op_nodes"] > before["rows_op_nodes"]  # the DeltaNet layers ran the rows ops
    branched = any(parents.count(p) > 1 for p in set(parents))
    assert stats["branched_calls"] == before["branched_calls"] + branched
    assert branched or shape == "chain"

    for p in _paths(parents):
        ref.reset()
        ref.eval(PREFIX)
        chain = ref._live().eval_verify(np.array([tokens[i] for i in p], np.int32))
        ref._live().keep(1)
        assert np.array_equal(logits[p], chain), f"path {p}"

    # the argmax variant: the same rows' argmax, computed on the device; it re-runs the tree, which
    # first drops the pending one
    argmax = engine.verify_tree(np.array(tokens, np.int32), np.array(parents, np.int32), argmax=True)
    assert np.array_equal(argmax, logits.argmax(axis=1))


@pytest.mark.parametrize("shape", ["ddtree", "wide", "forest"])
def test_keep_path_equals_plain_evaluation(pair, shape):
    """After keep_path(path) the recurrent state, the committed KV rows and the next step's logits
    equal, bitwise, those of evaluating the prefix and the path's tokens plainly; for every path of
    the tree (most need their KV rows moved) and for a shorter prefix of one. Seen to fail with
    DELTASPEC_TEST_TREE_BUG=no_compaction, =parent_state and =row_position."""
    tree, ref = pair
    tokens, parents = TREES[shape]
    paths = _paths(parents)
    paths.append(paths[-1][:2])
    moved = False
    for p in paths:
        tree.reset()
        tree.eval(PREFIX)
        engine = tree._live()
        engine.verify_tree(np.array(tokens, np.int32), np.array(parents, np.int32), argmax=True)
        before = engine.tree_stats["kv_rows_moved"]
        engine.keep_path(np.array(p, np.int32))
        moved |= engine.tree_stats["kv_rows_moved"] > before
        assert tree.n_past == len(PREFIX) + len(p)
        ref.reset()
        ref.eval(PREFIX + [tokens[i] for i in p])
        _assert_same_state(tree, ref)
        assert np.array_equal(tree.eval([99, 100]), ref.eval([99, 100])), f"path {p}"
    assert moved


def test_chain_tree_keep_equals_keep(pair):
    """A chain verified as a tree (parent = the row before) gives eval_verify's logits bitwise, and
    keep_path(first n rows) leaves the state keep(n) leaves. Seen to fail with
    DELTASPEC_TEST_TREE_BUG=parent_state."""
    tree, ref = pair
    tokens = [40, 41, 42, 43, 44, 45, 46, 47]
    for n in (1, 4, 8):
        tree.reset()
        tree.eval(PREFIX)
        ref.reset()
        ref.eval(PREFIX)
        got = tree._live().verify_tree(np.array(tokens, np.int32), np.arange(-1, len(tokens) - 1, dtype=np.int32))
        want = ref._live().eval_verify(np.array(tokens, np.int32))
        assert np.array_equal(got, want)
        tree._live().keep_path(np.arange(n, dtype=np.int32))
        ref._live().keep(n)
        _assert_same_state(tree, ref)


def test_keep_path_quantized_cache(path):
    """keep_path moves the path's KV rows as they are stored (q8_0 blocks copied, not re-quantized):
    the next logits equal plain evaluation's bitwise. Seen to fail with
    DELTASPEC_TEST_TREE_BUG=no_compaction (and =row_position, =parent_state)."""
    kw = dict(n_ctx=256, n_threads=1, type_k="q8_0", type_v="q8_0")
    tokens, parents = TREES["ddtree"]
    p = _paths(parents)[-1]  # the last leaf's path, off the first chain: its rows move
    assert p != list(range(len(p)))
    with Model(path, **kw) as tree, Model(path, **kw) as ref:
        tree.eval(PREFIX)
        tree._live().verify_tree(np.array(tokens, np.int32), np.array(parents, np.int32), argmax=True)
        tree._live().keep_path(np.array(p, np.int32))
        ref.eval(PREFIX + [tokens[i] for i in p])
        assert np.array_equal(tree.eval([99]), ref.eval([99]))


@pytest.mark.parametrize("shape", [dict(full_attention_interval=1, seed=3), dict(n_layer=8, seed=0),
                                   dict(n_layer=64, seed=2)],
                         ids=["attention-only", "8-layers", "27b-layer-count"])
def test_keep_path_other_layer_mixes(tmp_path, shape):
    """keep_path on a model without DeltaNet layers (nothing to replay, KV rows still move), on one
    with two attention layers (the first one's output reaches the later layers' kept state) and on
    the 27B's 64 layers (48 DeltaNet; keep_path's one graph for all of them once overflowed its node
    count at 8 layers), with a path whose every KV row moves by another distance: the next logits
    equal plain evaluation's bitwise. The 8-layer case was seen to fail with
    DELTASPEC_TEST_TREE_BUG=sibling_visible, =row_position, =no_compaction and =parent_state, the
    attention-only one with all but =parent_state."""
    path = write_tiny_vocab_model(tmp_path / "m.gguf", **shape)
    # the ddtree tree, then a comb: row 2k's children 2k+1 and 2k+2, so the path 0, 2, 4, 6, 8 moves
    # each of its rows by a distance of its own
    tokens, parents = TREES["ddtree"]
    tokens, parents = tokens + [80, 81, 82, 83, 84, 85, 86, 87], parents + [-1, 11, 11, 13, 13, 15, 15, 17]
    with Model(path, n_ctx=256, n_threads=1) as tree, Model(path, n_ctx=256, n_threads=1) as ref:
        for p in _paths(parents):
            tree.reset()
            tree.eval(PREFIX)
            tree._live().verify_tree(np.array(tokens, np.int32), np.array(parents, np.int32), argmax=True)
            tree._live().keep_path(np.array(p, np.int32))
            want = ref.logits(PREFIX + [tokens[i] for i in p] + [99])[-1]
            assert np.array_equal(tree.eval([99])[-1], want), f"path {p}"


def test_tree_bad_input(pair):
    tree, _ = pair
    tree.reset()
    tree.eval(PREFIX)
    engine = tree._live()
    with pytest.raises(ValueError, match="parent 2; a parent is an earlier row"):
        engine.verify_tree(np.array([1, 2, 3], np.int32), np.array([-1, 2, 0], np.int32))
    with pytest.raises(ValueError, match="one entry per token"):
        engine.verify_tree(np.array([1, 2, 3], np.int32), np.array([-1, 0], np.int32))
    with pytest.raises(IndexError, match="token id 100000 at row 1"):
        engine.verify_tree(np.array([1, 100000], np.int32), np.array([-1, 0], np.int32))
    with pytest.raises(RuntimeError, match="keep_path.*verify_tree"):
        engine.keep_path(np.array([0], np.int32))
    engine.verify_tree(np.array([1, 2, 3], np.int32), np.array([-1, 0, 0], np.int32), argmax=True)
    with pytest.raises(ValueError, match=r"path\[2\] = row 2 has parent 0, not row 1"):
        engine.keep_path(np.array([0, 1, 2], np.int32))
    with pytest.raises(ValueError, match=r"path\[0\] = row 1 has parent 0, not -1"):
        engine.keep_path(np.array([1], np.int32))
    with pytest.raises(ValueError, match="not a row of the batch"):
        engine.keep_path(np.array([0, 7], np.int32))
    tree.eval([99])  # anything else drops the tree: none of it is kept
    assert tree.n_past == len(PREFIX) + 1
    with pytest.raises(RuntimeError, match="keep_path"):
        engine.keep_path(np.array([0], np.int32))


def test_keep_path_taps_equal_plain_run(pair):
    """With taps set (what a DFlash or MTP drafter reads), rounds of verify_tree + keep_path leave the
    tapped rows a plain run over the committed tokens taps: the root and the accepted path's rows
    only, compacted in path order, over rounds whose paths leave the first chain, follow it, and
    keep the root alone; a dropped tree adds none. Seen to fail with
    DELTASPEC_TEST_TREE_BUG=taps_uncompacted (the batch's first rows kept: the unaccepted rows'
    features)."""
    tree, ref = pair
    n_layer = tree.hparams.n_layer
    layers = [0, 2, n_layer]
    tokens, parents = TREES["ddtree"]
    paths = _paths(parents)
    rounds = [paths[-1], paths[0], [0], paths[1], paths[-2][:3]]
    assert any(p != list(range(len(p))) for p in rounds)
    engine = tree._live()
    engine.set_taps(layers)
    try:
        tree.reset()
        tree.eval(PREFIX)
        engine.clear_tapped()
        committed = list(PREFIX)
        for i, p in enumerate(rounds):
            shifted = [t + 3 * i for t in tokens]  # each round drafts other tokens
            engine.verify_tree(np.array(shifted, np.int32), np.array(parents, np.int32), argmax=True)
            engine.keep_path(np.array(p, np.int32))
            committed += [shifted[r] for r in p]
        engine.verify_tree(np.array(tokens, np.int32), np.array(parents, np.int32), argmax=True)
        got = engine.tapped  # a tree not kept (yet) adds no rows
        assert engine.tapped_pos == len(PREFIX) and tree.n_past == len(committed)
        assert got.shape == (len(committed) - len(PREFIX), len(layers), tree.hparams.n_embd)
    finally:
        engine.set_taps([])
    ref_engine = ref._live()
    ref_engine.set_taps(layers)
    try:
        ref.reset()
        ref.eval(committed)
        want = ref_engine.tapped[len(PREFIX):]
    finally:
        ref_engine.set_taps([])
    assert np.array_equal(got, want), np.abs(got - want).max()


def test_keep_paths_of_one_slot_equal_keep_path(path, pair):
    """keep_path is keep_paths' commit on one slot: for every path of a tree, verify_rows + keep_paths
    of that tree in one slot leaves the recurrent state and committed KV rows verify_tree + keep_path
    leaves, bitwise; two slots verified in one pass, each keeping a path off its first chain (KV rows
    move in both), continue as plain evaluation does; rounds of one shape reuse the commit graph.
    Seen to fail with DELTASPEC_TEST_TREE_BUG=parent_state, =no_compaction and =stale_keep_graph, and
    with DELTASPEC_TEST_ROWS_BUG=no_compaction."""
    tree, ref = pair
    tokens, parents = TREES["ddtree"]
    paths = _paths(parents)
    with Model(path, n_ctx=256, n_threads=1, n_seq_max=2) as rows:
        engine = rows._live()
        moved = engine.rows_stats["kv_rows_moved"]
        for p in paths:
            tree.reset()
            tree.eval(PREFIX)
            tree._live().verify_tree(np.array(tokens, np.int32), np.array(parents, np.int32), argmax=True)
            tree._live().keep_path(np.array(p, np.int32))
            rows.reset()
            rows.eval(PREFIX)
            engine.verify_rows(np.array(tokens, np.int32), np.array(parents, np.int32), np.zeros(len(tokens), np.int32))
            engine.keep_paths([np.array(p, np.int32)])
            _assert_same_state(rows, tree)
        assert engine.rows_stats["kv_rows_moved"] > moved

        # two slots in one pass: slot 0 keeps the last leaf's path, slot 1 (its rows after slot 0's)
        # the second one's, each then equal to plain evaluation's next logits
        engine.reset_slot(0)
        engine.reset_slot(1)
        engine.eval_in_slot(0, np.array(PREFIX, np.int32))
        engine.eval_in_slot(1, np.array(PREFIX[:5], np.int32))
        T = len(tokens)
        both = np.array(tokens + [t + 1 for t in tokens], np.int32)
        both_parents = np.array(parents + [q + T if q >= 0 else -1 for q in parents], np.int32)
        engine.verify_rows(both, both_parents, np.repeat(np.array([0, 1], np.int32), T))
        keep0, keep1 = paths[-1], paths[1]
        assert keep0 != list(range(len(keep0))) and keep1 != list(range(len(keep1)))
        engine.keep_paths([np.array(keep0, np.int32), np.array([T + r for r in keep1], np.int32)])
        for slot, prefix, kept in ((0, PREFIX, [tokens[r] for r in keep0]), (1, PREFIX[:5], [tokens[r] + 1 for r in keep1])):
            assert engine.slot_n_past(slot) == len(prefix) + len(kept)
            want = ref.logits(prefix + kept + [99])[-1]
            assert np.array_equal(engine.eval_in_slot(slot, np.array([99], np.int32))[-1], want), f"slot {slot}"

    # rounds of one shape (a chain verified, its first 3 rows kept) build the commit graph once
    tree.reset()
    tree.eval(PREFIX)
    chain = [40, 41, 42, 43, 44, 45]
    builds = tree._live().tree_stats["keep_graph_builds"]
    for _ in range(4):
        tree._live().verify_tree(np.array(chain, np.int32), np.arange(-1, len(chain) - 1, dtype=np.int32), argmax=True)
        tree._live().keep_path(np.array([0, 1, 2], np.int32))
    assert tree._live().tree_stats["keep_graph_builds"] == builds + 1
    ref.reset()
    ref.eval(PREFIX + chain[:3] * 4)
    _assert_same_state(tree, ref)


@pytest.mark.parametrize("shape", ["ddtree", "wide"])
def test_split_walks_equal_one_walk(path, monkeypatch, shape):
    """An engine whose rows plans split a tree into two walks (DELTASPEC_ROWS_SPLIT=1:
    deltaspec_rows.h) verifies the tree into the same logits, bitwise, as one that walks it whole
    (=0, the default), and keep_path then leaves the same sequence; the split must have happened
    (tree_stats' split_walks). Seen to fail with Engine::rows_positions patched to give R positions
    whatever the switch (no room: no split), with the graph's walk bound patched to leave out the
    split's walk (the engine's plan check throws) and with DELTASPEC_TEST_ROWS_BUG=continue (the
    split walk's branches continue the row walked before them)."""
    tokens, parents = TREES[shape]
    kw = dict(n_ctx=256, n_threads=1)
    monkeypatch.setenv("DELTASPEC_ROWS_SPLIT", "1")
    split = Model(path, **kw)
    monkeypatch.setenv("DELTASPEC_ROWS_SPLIT", "0")
    whole = Model(path, **kw)
    with split, whole:
        got, want = [], []
        for model, out in ((split, got), (whole, want)):
            model.eval(PREFIX)
            engine = model._live()
            out.append(engine.verify_tree(np.array(tokens, np.int32), np.array(parents, np.int32)))
            engine.keep_path(np.array(_paths(parents)[-1], np.int32))
            out.append(model.eval([99, 100]))
        assert split._live().tree_stats["split_walks"] == 1 and whole._live().tree_stats["split_walks"] == 0
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        _assert_same_state(split, whole)
