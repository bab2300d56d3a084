"""Inputs, batch shapes and references for the rows ops' tests (test_rows_op.py on the CPU,
test_gpu_rows_op.py on CUDA): the parent-indexed DeltaNet recurrence and conv of
ggml/deltaspec_rows.h, through deltaspec._core's test-only single-op bindings.

The reference for a row is ggml's own op (ggml_gated_delta_net, ggml_ssm_conv) run on the path from
its root to it as one sequence, from its slot's committed state."""

import numpy as np

from deltaspec import _core

WRITE_BACK, KEEP_STATE = 1, 2  # DELTASPEC_ROW_* flags
# deltaspec_rows_col
PARENT, SLOT, FLAGS, SAVED, ORDER, START, WALK_END = range(7)


def deltanet_inputs(rng, R, S, H, Hk, n_slots):
    """What the model feeds the recurrence: l2-normed q and k, log-decay g <= 0, beta in (0, 1),
    and a pool of committed states, numpy order (R, heads, S)."""

    def l2(a):
        return (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)

    return dict(
        q=l2(rng.standard_normal((R, Hk, S))), k=l2(rng.standard_normal((R, Hk, S))),
        v=rng.standard_normal((R, H, S)).astype(np.float32),
        g=(-np.log1p(np.exp(rng.standard_normal((R, H, 1))))).astype(np.float32),
        beta=(1 / (1 + np.exp(-rng.standard_normal((R, H, 1))))).astype(np.float32),
        pool=(0.1 * rng.standard_normal((n_slots, H, S, S))).astype(np.float32))


def conv_inputs(rng, R, C, Kc, n_slots):
    return dict(pool=rng.standard_normal((n_slots, C, Kc - 1)).astype(np.float32),
                x=rng.standard_normal((R, C)).astype(np.float32),
                c=rng.standard_normal((C, Kc)).astype(np.float32))


def chain(n, first=0):
    """Parents of a chain of n rows starting at row `first` (its root)."""
    return [-1] + [first + i for i in range(n - 1)]


def random_tree(rng, n, depth_first=True):
    """Parents of a tree of n rows, root first: mostly the previous row (long chains, as a draft tree's
    seeded top-1 chain), otherwise any earlier row. depth_first reorders the rows so that each first
    child follows its parent (as the header recommends); otherwise they stay in creation order."""
    parent = [-1] + [r - 1 if rng.random() < 0.55 else int(rng.integers(0, r)) for r in range(1, n)]
    if not depth_first:
        return parent
    children = [[] for _ in range(n)]
    for r in range(1, n):
        children[parent[r]].append(r)
    order, stack = [], [0]
    while stack:
        r = stack.pop()
        order.append(r)
        stack.extend(reversed(children[r]))
    new_index = {old: i for i, old in enumerate(order)}
    return [-1 if parent[old] < 0 else new_index[parent[old]] for old in order]


def paths(parent):
    """Every root-to-leaf path of a parent list, as lists of rows."""
    has_child = set(p for p in parent if p >= 0)
    out = []
    for leaf in range(len(parent)):
        if leaf in has_child:
            continue
        path = [leaf]
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        out.append(path[::-1])
    return out


def i32(values):
    return np.asarray(values, dtype=np.int32)


def rows_deltanet(device, inp, parent, slot, flags=None, **kw):
    flags = np.zeros(len(parent), np.int32) if flags is None else i32(flags)
    return _core.rows_gated_delta_net(device, inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["pool"].copy(),
                                      i32(parent), i32(slot), flags, **kw)


def chain_deltanet(device, inp, path, slot, **kw):
    """ggml_gated_delta_net over the rows of `path` as one sequence, from pool[slot]."""
    pick = {name: np.ascontiguousarray(inp[name][path]) for name in ("q", "k", "v", "g", "beta")}
    return _core.gated_delta_net(device, pick["q"], pick["k"], pick["v"], pick["g"], pick["beta"],
                                 inp["pool"][slot][None].copy(), **kw)


def rows_conv(device, inp, parent, slot, flags=None, **kw):
    flags = np.zeros(len(parent), np.int32) if flags is None else i32(flags)
    return _core.rows_ssm_conv(device, inp["pool"].copy(), inp["x"], inp["c"], i32(parent), i32(slot), flags, **kw)


def chain_conv(device, inp, path, slot, **kw):
    """ggml_ssm_conv over [pool[slot] | x of the path's rows] (one sequence): y (len(path), C), and the
    window after the path's last row."""
    sx = np.concatenate([inp["pool"][slot], inp["x"][path].T], axis=1)
    y = _core.ssm_conv(device, np.ascontiguousarray(sx[None]), inp["c"], **kw)[0]
    return y, sx[:, -(inp["c"].shape[1] - 1):]
