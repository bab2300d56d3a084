"""The rows ops on the CPU (ggml/deltaspec_rows.h): the parent-indexed Gated DeltaNet recurrence and
causal conv over a batch of rows, against ggml's own ops run on each row's path as one sequence.

On the CPU the claims are bitwise: a chain gives ggml_gated_delta_net's and ggml_ssm_conv's bits,
every root-to-leaf path of a tree gives its chain's, rows of different slots give what each sequence
gives alone, and the pool changes only where a row writes back.

Each test names the planted bug it was seen to fail with: DELTASPEC_TEST_ROWS_BUG=<name> switches
it on in the op (ggml/cpu/deltaspec_rows_*cpu.cpp) or in the binding (csrc/rows_op_bindings.cpp), e.g.
    DELTASPEC_TEST_ROWS_BUG=continue python -m pytest -q tests/test_rows_op.py -k tree
"""

import numpy as np
import pytest

from deltaspec import _core
from rows_op_cases import (FLAGS, KEEP_STATE, ORDER, SAVED, START, WALK_END, WRITE_BACK, chain, chain_conv,
                           chain_deltanet, conv_inputs, deltanet_inputs, i32, paths, random_tree, rows_conv,
                           rows_deltanet)

THREADS = 2  # several threads split heads and walks (recurrence) and channels (conv)


@pytest.mark.parametrize("R,S,H,Hk", [(1, 32, 2, 2), (6, 32, 4, 2), (19, 64, 6, 3), (40, 128, 4, 1)])
def test_chain_is_ggml_bitwise(R, S, H, Hk):
    """A chain (parent = r-1, one slot, its last row writing back) gives ggml_gated_delta_net's
    outputs and final state bit for bit. Seen to fail with DELTASPEC_TEST_ROWS_BUG=plain_dot (a dot
    product summed in another order) and, where H_k < H, gqa_interleaved (q/k head h // (H/H_k)
    instead of h % H_k)."""
    rng = np.random.default_rng(R * 1000 + S)
    inp = deltanet_inputs(rng, R, S, H, Hk, n_slots=2)
    flags = [0] * (R - 1) + [WRITE_BACK]
    got = rows_deltanet("cpu", inp, chain(R), [1] * R, flags, n_threads=THREADS)
    ref = chain_deltanet("cpu", inp, list(range(R)), 1, n_threads=THREADS)
    # the path under test: one walk, a root from the pool, every other row continuing in place
    assert got["n_saved"] == 0 and got["rows"][0, WALK_END] == R and (got["rows"][1:, WALK_END] == -1).all()
    assert got["rows"][0, START] == -2 and (got["rows"][1:, START] == -1).all()
    assert np.array_equal(got["y"], ref["y"])
    assert np.array_equal(got["pool"][1], ref["state"])
    assert np.array_equal(got["pool"][0], inp["pool"][0])  # the other slot is left alone


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("depth_first", [True, False], ids=["depth-first", "creation-order"])
def test_tree_paths_are_chains(seed, depth_first):
    """Every root-to-leaf path of a 23-row tree (a draft tree's size) gives that path's chain bit for
    bit: the outputs of its rows, and the state after its leaf (kept with KEEP_STATE). Seen to fail
    with DELTASPEC_TEST_ROWS_BUG=continue (a row whose parent is not the row walked before it
    continues that row's state instead of reloading its parent's)."""
    rng = np.random.default_rng(seed)
    R, S, H, Hk = 23, 32, 4, 2
    inp = deltanet_inputs(rng, R, S, H, Hk, n_slots=1)
    parent = random_tree(rng, R, depth_first)
    leaves = [p[-1] for p in paths(parent)]
    flags = [KEEP_STATE if r in leaves else 0 for r in range(R)]
    got = rows_deltanet("cpu", inp, parent, [0] * R, flags, n_threads=THREADS)
    assert len(leaves) > 1 and (got["rows"][:, START] >= 0).any(), "the tree must branch"
    assert np.array_equal(got["pool"], inp["pool"]), "no row writes back: the pool stays"
    for path in paths(parent):
        ref = chain_deltanet("cpu", inp, path, 0, n_threads=THREADS)
        assert np.array_equal(got["y"][path], ref["y"]), f"path {path}"
        assert np.array_equal(got["saved"][got["rows"][path[-1], SAVED]], ref["state"]), f"path {path}"


def test_slots_are_independent():
    """Rows of three sequences interleaved in one batch (a 5-row chain, one decode row, a 7-row tree),
    each with its own slot of a 4-slot pool, give what each gives alone, and write back only their
    own slots. Seen to fail with DELTASPEC_TEST_ROWS_BUG=slot0 (every root starts from slot 0)."""
    rng = np.random.default_rng(7)
    S, H, Hk = 32, 4, 4
    sequences = {2: chain(5), 0: [-1], 3: random_tree(rng, 7)}  # slot -> parents within the sequence
    # interleave: each sequence's rows keep their order; parents are renumbered to batch rows
    owner = [s for s, par in sequences.items() for _ in par]
    rng.shuffle(owner)
    index, seen = {}, {s: 0 for s in sequences}
    for r, s in enumerate(owner):
        index[(s, seen[s])] = r
        seen[s] += 1
    R = len(owner)
    parent = [-1] * R
    for s, par in sequences.items():
        for i, p in enumerate(par):
            parent[index[(s, i)]] = -1 if p < 0 else index[(s, p)]
    last = {s: index[(s, len(par) - 1)] for s, par in sequences.items()}
    flags = [WRITE_BACK if r in (last[2], last[0]) else 0 for r in range(R)]  # the tree's slot stays
    inp = deltanet_inputs(rng, R, S, H, Hk, n_slots=4)
    got = rows_deltanet("cpu", inp, parent, owner, flags, n_threads=THREADS)
    assert (got["rows"][:3, WALK_END] > 0).all() and got["rows"][3, WALK_END] == -1  # three walks
    for s, par in sequences.items():
        rows = [index[(s, i)] for i in range(len(par))]
        for path in paths([-1 if parent[r] < 0 else rows.index(parent[r]) for r in rows]):
            batch_path = [rows[i] for i in path]
            ref = chain_deltanet("cpu", inp, batch_path, s, n_threads=THREADS)
            assert np.array_equal(got["y"][batch_path], ref["y"]), f"slot {s}, path {batch_path}"
            if s != 3:
                assert np.array_equal(got["pool"][s], ref["state"]), f"slot {s}"
    assert np.array_equal(got["pool"][3], inp["pool"][3]) and np.array_equal(got["pool"][1], inp["pool"][1])


def test_write_back_and_commit():
    """What commit needs. Decode of N sequences (N roots, each writing back its slot) leaves each slot at
    its one-token chain's state. A verified tree (no write-back) leaves the pool as it was; then
    (a) the same op over the same inputs with the rows off the accepted path skipped (slot -1) and the
    accepted leaf writing back puts that path's chain state in the slot, and (b) the verify's
    KEEP_STATE copy of the leaf is that same state. Seen to fail with
    DELTASPEC_TEST_ROWS_BUG=no_write_back (nothing is stored to the pool)."""
    rng = np.random.default_rng(11)
    S, H, Hk, N = 32, 2, 2, 3
    inp = deltanet_inputs(rng, N, S, H, Hk, n_slots=N)
    got = rows_deltanet("cpu", inp, [-1] * N, [2, 0, 1], [WRITE_BACK] * N, n_threads=THREADS)
    for r, s in enumerate([2, 0, 1]):
        assert np.array_equal(got["pool"][s], chain_deltanet("cpu", inp, [r], s)["state"]), f"slot {s}"

    R = 12
    inp = deltanet_inputs(rng, R, S, H, Hk, n_slots=2)
    parent = random_tree(rng, R)
    accepted = max(paths(parent), key=len)
    verify = rows_deltanet("cpu", inp, parent, [1] * R, [KEEP_STATE if r == accepted[-1] else 0 for r in range(R)])
    assert np.array_equal(verify["pool"], inp["pool"])
    ref = chain_deltanet("cpu", inp, accepted, 1)
    assert np.array_equal(verify["saved"][verify["rows"][accepted[-1], SAVED]], ref["state"])  # (b)
    slot = [1 if r in accepted else -1 for r in range(R)]
    replay = rows_deltanet("cpu", inp, parent, slot, [WRITE_BACK if r == accepted[-1] else 0 for r in range(R)])
    assert replay["n_saved"] == 0 and (replay["rows"][:, ORDER] >= 0).sum() == len(accepted)
    assert np.array_equal(replay["pool"][1], ref["state"])  # (a)
    assert np.array_equal(replay["pool"][0], inp["pool"][0])
    assert np.array_equal(replay["y"][accepted], verify["y"][accepted])


@pytest.mark.parametrize("Kc", [2, 3, 4, 5])
@pytest.mark.parametrize("R", [1, 2, 9])
def test_conv_chain_is_ggml_bitwise(Kc, R):
    """The conv over a chain gives ggml_ssm_conv's bits over [committed window | the chain's inputs]
    for every kernel size (GCC compiles ggml's loop with fused multiply-adds for some sizes and not
    for others), with 1 and 2 threads, and the chain's last row writes back the window after it.
    Seen to fail with DELTASPEC_TEST_ROWS_BUG=conv_order (the window's two oldest inputs swapped)."""
    rng = np.random.default_rng(Kc * 10 + R)
    C = 136  # not a multiple of the thread split or the vector width
    inp = conv_inputs(rng, R, C, Kc, n_slots=2)
    for threads in (1, 2):
        got = rows_conv("cpu", inp, chain(R), [1] * R, [0] * (R - 1) + [WRITE_BACK], n_threads=threads)
        y, window = chain_conv("cpu", inp, list(range(R)), 1, n_threads=threads)
        assert np.array_equal(got["y"], y), f"{threads} threads"
        assert np.array_equal(got["pool"][1], window) and np.array_equal(got["pool"][0], inp["pool"][0])


def test_conv_tree_and_slots():
    """The conv of a tree's rows gathers each window along the row's ancestors: every path gives its
    chain's bits, also where a path is shorter than the window (the slot's committed inputs fill in);
    rows of two slots give what each gives alone; replaying the accepted path (the other rows skipped)
    with its leaf writing back stores the window after that path. Seen to fail with
    DELTASPEC_TEST_ROWS_BUG=short_window (only the parent is gathered, the rest taken from the
    committed window)."""
    rng = np.random.default_rng(3)
    C, Kc = 64, 4
    tree = random_tree(rng, 15)
    parent = tree + [-1, 15, 15]  # slot 0: the tree; slot 1: a root with two children
    slot = [0] * 15 + [1] * 3
    inp = conv_inputs(rng, 18, C, Kc, n_slots=2)
    got = rows_conv("cpu", inp, parent, slot, n_threads=THREADS)
    assert any(len(p) > Kc for p in paths(tree)), "some window must come from ancestors only"
    assert np.array_equal(got["pool"], inp["pool"]), "no row writes back: the pool stays"
    for path in paths(parent):
        y, _ = chain_conv("cpu", inp, path, slot[path[0]], n_threads=THREADS)
        assert np.array_equal(got["y"][path], y), f"path {path}"
    accepted = max(paths(tree), key=len)
    replay = rows_conv("cpu", inp, parent, [0 if r in accepted else -1 for r in range(18)],
                       [WRITE_BACK if r == accepted[-1] else 0 for r in range(18)], n_threads=THREADS)
    y, window = chain_conv("cpu", inp, accepted, 0, n_threads=THREADS)
    assert np.array_equal(replay["pool"][0], window) and np.array_equal(replay["pool"][1], inp["pool"][1])
    assert np.array_equal(replay["y"][accepted], y)


def _deltanet_args(R=4, S=16, H=4, Hk=2, n_slots=2):
    inp = deltanet_inputs(np.random.default_rng(0), R, S, H, Hk, n_slots)
    return dict(device="cpu", **inp, parent=i32(chain(R)), slot=i32([0] * R), flags=i32([0] * R))


def _conv_args(R=4, C=8, Kc=4, n_slots=2):
    inp = conv_inputs(np.random.default_rng(0), R, C, Kc, n_slots)
    return dict(device="cpu", **inp, parent=i32(chain(R)), slot=i32([0] * R), flags=i32([0] * R))


def _with(args, **changes):
    return {**args, **{k: (i32(v) if k in ("parent", "slot", "flags") else v) for k, v in changes.items()}}


BAD_DELTANET = [
    ("parent not earlier", dict(parent=[-1, 0, 2, 2]), r"row 2: parent 2 must be an earlier row"),
    ("parent below -1", dict(parent=[-1, -2, 1, 2]), r"row 1: parent -2 must be an earlier row"),
    ("slot out of range", dict(slot=[0, 0, 0, 2]), r"row 3: slot 2 out of range \(0\.\.1"),
    ("slot differs from parent's", dict(slot=[0, 0, 1, 1]), r"row 2: slot 1 differs from its parent row 1's slot 0"),
    ("skipped parent", dict(slot=[0, -1, 0, 0]), r"row 2: .*a skipped row cannot be a parent"),
    ("two write-backs", dict(parent=[-1, -1, 0, 1], flags=[0, 0, 1, 1]), r"rows 2 and 3 both write back slot 0"),
    ("write-back not last", dict(flags=[0, 1, 0, 0]), r"row 1 writes back slot 0 but row 3 comes after it"),
    ("unknown flag", dict(flags=[0, 4, 0, 0]), r"row 1: flags 0x4"),
    ("row counts differ", dict(slot=[0, 0, 0]), r"one value per row"),
    ("q heads", dict(q=np.zeros((4, 3, 16), np.float32)), r"q and k must be \[S=16, H_k, R=4, 1\]"),
    ("k rows", dict(k=np.zeros((5, 2, 16), np.float32)), r"q and k must be"),
    ("g per channel", dict(g=np.zeros((4, 4, 16), np.float32)), r"g must be contiguous \[1, H_v=4, R=4, 1\]"),
    ("pool state size", dict(pool=np.zeros((2, 4, 16, 8), np.float32)), r"pool must be contiguous \[S=16, S, H_v=4"),
    ("rows tensor vs v", dict(parent=[-1, 0, 1], slot=[0, 0, 0], flags=[0, 0, 0]),
     r"rows must be a contiguous I32 tensor \[7, R = 4 \.\. 2 R\]"),
    ("too few saved states", dict(parent=[-1, 0, 0, 1], n_saved=0), r"n_saved 0 is less than the 2 saved states"),
]

BAD_CONV = [
    ("x channels", dict(x=np.zeros((4, 9), np.float32)), r"x must be \[C=8, R\]"),
    ("pool window", dict(pool=np.zeros((2, 8, 2), np.float32)), r"pool must be contiguous \[Kc-1=3, C=8, n_slots\]"),
    ("kernel too long", dict(c=np.zeros((8, 17), np.float32), pool=np.zeros((2, 8, 16), np.float32)),
     r"2 <= Kc <= 16"),
    ("slot out of range", dict(slot=[0, 0, 5, 5]), r"row 2: slot 5 out of range"),
]


@pytest.mark.parametrize("name,changes,message", BAD_DELTANET, ids=[c[0] for c in BAD_DELTANET])
def test_bad_deltanet_input_is_refused(name, changes, message):
    """Bad batches and shapes raise ValueError naming the row, tensor or parameter, before anything is
    built or computed. Seen to fail with DELTASPEC_TEST_ROWS_BUG=lenient (the binding skips every
    check and computes nothing, so no exception comes)."""
    with pytest.raises(ValueError, match=message):
        _core.rows_gated_delta_net(**_with(_deltanet_args(), **changes))


@pytest.mark.parametrize("name,changes,message", BAD_CONV, ids=[c[0] for c in BAD_CONV])
def test_bad_conv_input_is_refused(name, changes, message):
    """As test_bad_deltanet_input_is_refused, for the conv. Seen to fail with
    DELTASPEC_TEST_ROWS_BUG=lenient."""
    with pytest.raises(ValueError, match=message):
        _core.rows_ssm_conv(**_with(_conv_args(), **changes))


def test_plan_of_a_tree():
    """deltaspec_rows_plan's walk of a small tree, entry by entry: rows grouped by slot, each branch
    point saved once, each further child starting from it. Seen to fail with
    DELTASPEC_TEST_ROWS_BUG=lenient (no plan comes back)."""
    #   slot 1: 0 -> 1 -> 2, 1 -> 3 (branch at 1), 0 -> 5; slot 0: 4
    parent, slot = [-1, 0, 1, 1, -1, 0], [1, 1, 1, 1, 0, 1]
    plan = _core.rows_plan(i32(parent), i32(slot), i32([0, 0, 0, 0, 1, 2]), 2)
    assert plan is not None
    rows, n_saved = plan
    assert n_saved == 3  # rows 0 and 1 (branch points) and 5 (KEEP_STATE)
    assert rows[:, SAVED].tolist() == [0, 1, -1, -1, -1, 2]
    assert rows[:, ORDER].tolist() == [4, 0, 1, 2, 3, 5]
    assert rows[:, START].tolist() == [-2, -2, -1, -1, 1, 0]
    assert rows[:2, WALK_END].tolist() == [1, 6] and (rows[2:, WALK_END] == -1).all()
    assert rows[:, FLAGS].tolist() == [0, 0, 0, 0, 1, 2]


# DDTree's 1 + 22 rows as tree_verify_cost.py builds them: a 17-row chain, six side rows off its top
DDTREE_23 = [-1] + list(range(16)) + [0, 1, 17, 2, 18, 19]


def test_plan_splits_a_tree_into_two_walks():
    """With room for more positions (the rows tensor's P = 2 R), the plan walks DDTree's 23-row tree
    as its 17-row chain and, beside it, the six side rows with their three ancestors (9 rows) instead
    of 23 rows in one walk; each walk starts at the root, and the side walk's branches start from the
    states it saves itself. A chain, a slot with a write-back row and a plan without room are not
    split. Seen to fail with DELTASPEC_TEST_ROWS_BUG=split_no_ancestors (the side walk without the
    ancestors it shares with the chain: on the CPU, which runs the walks in order, its results would
    still come out right; on CUDA it would read states the other walk may not have written yet)."""
    R = len(DDTREE_23)
    rows, n_saved = _core.rows_plan(i32(DDTREE_23), i32([0] * R), i32([0] * R), 1, split=True)
    assert rows.shape == (2 * R, 7)
    assert rows[:2, WALK_END].tolist() == [17, 26] and (rows[2:, WALK_END] == -1).all()
    assert rows[:26, ORDER].tolist() == list(range(17)) + [0, 1, 2, 17, 18, 19, 20, 21, 22]
    saved = rows[:R, SAVED]
    assert n_saved == 6 and sorted(r for r in range(R) if saved[r] >= 0) == [0, 1, 2, 17, 18, 19]
    start_of_side = [-2, -1, -1] + [saved[p] for p in (0, 1, 17, 2, 18, 19)]
    assert rows[:17, START].tolist() == [-2] + [-1] * 16 and rows[17:26, START].tolist() == start_of_side

    unsplit, _ = _core.rows_plan(i32(DDTREE_23), i32([0] * R), i32([0] * R), 1)
    assert unsplit.shape == (R, 7) and unsplit[0, WALK_END] == R and unsplit[1, WALK_END] == -1
    for parent, flags in ((chain(R), [0] * R), (DDTREE_23, [0] * (R - 1) + [WRITE_BACK])):
        rows, _ = _core.rows_plan(i32(parent), i32([0] * R), i32(flags), 1, split=True)
        assert rows[0, WALK_END] == R and (rows[1:, WALK_END] == -1).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", ["ddtree", "depth-first", "creation-order"])
def test_split_walks_give_the_unsplit_bits(seed, shape):
    """A tree walked as two walks (its deepest path, and the other rows with their ancestors) gives
    every row's output and every kept state bit for bit as one walk does, and so every path its
    chain's; a second slot's chain beside it is left as it was. The split must happen (two walks for
    the tree's slot), and each walk must stand alone: it starts at a root and walks every row's
    parent before the row, so that walks running at once (CUDA) never wait on each other. Seen to
    fail with DELTASPEC_TEST_ROWS_BUG=split_no_ancestors (the side walk starts at its first side row:
    the bits still match on the CPU, the walks do not stand alone)."""
    rng = np.random.default_rng(100 + seed)
    S, H, Hk = 32, 4, 2
    tree = DDTREE_23 if shape == "ddtree" else random_tree(rng, 23, shape == "depth-first")
    T, C = len(tree), 5
    parent = tree + [-1] + [T + i for i in range(C - 1)]  # then a 5-row chain of slot 1
    slot = [0] * T + [1] * C
    leaves = {p[-1] for p in paths(tree)}
    flags = [KEEP_STATE if r in leaves else 0 for r in range(T)] + [0] * (C - 1) + [WRITE_BACK]
    inp = deltanet_inputs(rng, T + C, S, H, Hk, n_slots=2)
    one = rows_deltanet("cpu", inp, parent, slot, flags, n_threads=THREADS)
    two = rows_deltanet("cpu", inp, parent, slot, flags, n_threads=THREADS, split=True)
    walk_ends = two["rows"][:, WALK_END]
    assert (walk_ends >= 0).sum() == 3 and (one["rows"][:, WALK_END] >= 0).sum() == 2, "the tree's slot splits"
    assert walk_ends[2] == walk_ends[1] + C, "the chain's walk stays whole"
    begin = 0
    for end in walk_ends[walk_ends >= 0]:
        walk = two["rows"][begin:end, ORDER].tolist()
        assert parent[walk[0]] == -1 and all(parent[r] in walk[:i] for i, r in enumerate(walk) if i), walk
        begin = end
    assert np.array_equal(two["y"], one["y"])
    assert np.array_equal(two["pool"], one["pool"])
    for leaf in leaves:
        assert np.array_equal(two["saved"][two["rows"][leaf, SAVED]], one["saved"][one["rows"][leaf, SAVED]])


def test_the_walk_bound_is_what_the_op_looks_at():
    """A recurrence node's walk bound (deltaspec_rows_set_max_walks: the rows of CUDA thread blocks it
    launches) is also all the CPU op looks at: two slots' chains, each writing back, under a bound of
    2 give the unbounded result; under a bound of 1 the second slot's walk is not run (its state stays
    as it was), which is why the engine checks every plan against its graph's bound. Seen to fail
    with the CPU op counting walks up to the rows tensor's room instead (the bound ignored)."""
    rng = np.random.default_rng(3)
    inp = deltanet_inputs(rng, 6, 32, 4, 2, n_slots=2)
    parent, slot, flags = [-1, 0, 1, -1, 3, 4], [0, 0, 0, 1, 1, 1], [0, 0, WRITE_BACK, 0, 0, WRITE_BACK]
    free = rows_deltanet("cpu", inp, parent, slot, flags, n_threads=THREADS)
    both = rows_deltanet("cpu", inp, parent, slot, flags, n_threads=THREADS, max_walks=2)
    one = rows_deltanet("cpu", inp, parent, slot, flags, n_threads=THREADS, max_walks=1)
    assert np.array_equal(both["y"], free["y"]) and np.array_equal(both["pool"], free["pool"])
    assert not np.array_equal(free["pool"][1], inp["pool"][1]), "the second slot's chain writes back"
    assert np.array_equal(one["pool"][0], free["pool"][0]) and np.array_equal(one["pool"][1], inp["pool"][1])
