"""Walking a verified draft tree (csrc/tree_walk.h): greedy follows the target's argmax, and both
sampled rules (per-node sampling and matching; multi-draft rejection sampling) are lossless.

Lossless is tested on exact marginals. A 4-token vocabulary has fixed target and draft logits for
every token prefix up to depth 3. Each trial is one speculative round: a best-first tree of 6
nodes drafted afresh from the draft's rows (children 'chosen' as the most probable tokens, or
'sampled' without replacement), walked with the target's rows. The round emits its accepted path
and the next token; the test completes that to 4 tokens by sampling the target token by token
(the exact p of each prefix), and the 4-token sequences must be distributed as sampling the target
4 times: a chi-square test against the enumerated exact distribution (256 sequences).

Power: the same test, on the same seeds, must reject the wrong rules planted with
DELTASPEC_TEST_WRONG_TREE_RULE (tree_walk.h): 'fresh_next' for matching, 'no_residual' and (on
sampled trees) 'no_q_update' for rejection sampling. Each case also asserts the walk branched: some
accepted paths leave the top-1 chain.
"""

import itertools

import numpy as np
import pytest

from deltaspec import _core
from sampling_reference import chi_square_p, expected_probs, penalize

V, D, BUDGET = 4, 3, 6
N_TRIALS = 30000
PROMPT = [0, 2, 1]
PLAIN = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
PENALIZED = dict(temperature=0.8, top_k=3, top_p=1.0, min_p=0.0, repeat_penalty=1.5, presence_penalty=0.3,
                 penalty_last_n=4)
PENALTY_KEYS = ("repeat_penalty", "presence_penalty", "frequency_penalty", "penalty_last_n")
PLANT = "DELTASPEC_TEST_WRONG_TREE_RULE"


def prefixes():
    return [p for k in range(D + 1) for p in itertools.product(range(V), repeat=k)]


def prefix_row(prefix) -> int:
    index = 0
    for t in prefix:
        index = index * V + t
    return sum(V ** k for k in range(len(prefix))) + index


def tables(seed: int, noise: float, scale: float = 1.0):
    """(target, draft) logits per prefix: the draft is the target scaled plus noise."""
    rng = np.random.default_rng(seed)
    target = (rng.normal(size=(len(prefixes()), V)) * 1.6).astype(np.float32)
    draft = (target * scale + rng.normal(size=target.shape) * noise).astype(np.float32)
    return target, draft


def sampling(params: dict, seed: int = 0):
    sp = _core.SamplingParams()
    for k, v in params.items():
        setattr(sp, k, v)
    sp.seed = seed
    return sp


def exact_p(target, params) -> np.ndarray:
    """The target's sampling distribution after every prefix (penalties see prompt + prefix)."""
    pen = {k: params[k] for k in PENALTY_KEYS if k in params}
    chain = {k: params[k] for k in ("temperature", "top_k", "top_p", "min_p")}
    return np.array([expected_probs(penalize(target[prefix_row(p)], PROMPT + list(p), **pen), **chain)
                     for p in prefixes()])


def complete(emitted: np.ndarray, P: np.ndarray, seed: int) -> np.ndarray:
    """Fill each row's -1 tail by sampling the target token by token."""
    rng = np.random.default_rng(seed)
    seq = emitted.copy()
    inner = np.zeros(len(seq), dtype=np.int64)
    for j in range(D + 1):
        rows = sum(V ** k for k in range(j)) + inner
        cum = np.cumsum(P[rows], axis=1)
        drawn = np.minimum((rng.random(len(seq))[:, None] >= cum).sum(axis=1), V - 1)
        seq[:, j] = np.where(seq[:, j] < 0, drawn, seq[:, j])
        inner = inner * V + seq[:, j]
    return seq


def exact_joint(P: np.ndarray) -> np.ndarray:
    probs = np.zeros(V ** (D + 1))
    for s in itertools.product(range(V), repeat=D + 1):
        probs[np.ravel_multi_index(s, (V,) * (D + 1))] = np.prod([P[prefix_row(s[:j])][s[j]] for j in range(D + 1)])
    return probs


def trials(target, draft, params, tree_kind, rule, seed=1):
    return _core.tree_walk_trials(target, draft, V, PROMPT, sampling(params, seed), tree_kind, BUDGET, D, rule,
                                  N_TRIALS, seed)


def p_value(out, P) -> float:
    seq = complete(out["emitted"], P, seed=5)
    counts = np.bincount(np.ravel_multi_index(seq.T, (V,) * (D + 1)), minlength=V ** (D + 1))
    return chi_square_p(counts.astype(np.float64), exact_joint(P))


CASES = {  # name -> (tree kind, rule, sampling params, planted wrong rules)
    "chosen-match": ("chosen", "match", PLAIN, ["fresh_next"]),
    "chosen-rejection": ("chosen", "rejection", PLAIN, ["no_residual"]),
    "sampled-match": ("sampled", "match", PLAIN, ["fresh_next"]),
    "sampled-rejection": ("sampled", "rejection", PLAIN, ["no_residual", "no_q_update"]),
    "sampled-rejection-penalties-top_k": ("sampled", "rejection", PENALIZED, ["no_residual"]),
    "chosen-match-penalties-top_k": ("chosen", "match", PENALIZED, ["fresh_next"]),
}


@pytest.mark.parametrize("case", CASES)
def test_sampled_walk_is_lossless(case, monkeypatch):
    """Exact marginals of the first 4 emitted tokens (module docstring); the planted wrong rules
    are rejected by the same test (p < 1e-6), the right one is not (p > 1e-3)."""
    tree_kind, rule, params, plants = CASES[case]
    target, draft = tables(seed=11, noise=1.0)
    P = exact_p(target, params)
    monkeypatch.delenv(PLANT, raising=False)
    out = trials(target, draft, params, tree_kind, rule)
    assert (out["n_nodes"] == BUDGET).all()
    assert out["left_chain"].mean() > 0.05  # branching happened
    assert (out["emitted"][:, 1] >= 0).mean() > 0.3  # rounds accepted a node
    assert p_value(out, P) > 1e-3
    for plant in plants:
        monkeypatch.setenv(PLANT, plant)
        assert p_value(trials(target, draft, params, tree_kind, rule), P) < 1e-6, plant


def iid_tree(draft, rng) -> dict:
    """SpecInfer's setting: the root's 3 children i.i.d. from q(root), each with 2 i.i.d. children."""
    tree = dict(token=[], parent=[], child_q=[], root_child_q=0, dists=[], draw="iid")

    def q_of(path):
        l = draft[prefix_row(path)].astype(np.float64)
        p = np.exp(l - l.max())
        return p / p.sum()

    def add(path, parent, k):
        q = q_of(path)
        tree["dists"].append((list(range(V)), q.astype(np.float32).tolist()))
        nodes = []
        for t in rng.choice(V, size=k, p=q):
            tree["token"].append(int(t))
            tree["parent"].append(parent)
            tree["child_q"].append(-1)
            nodes.append((len(tree["token"]) - 1, path + (int(t),)))
        return nodes

    for node, path in add((), -1, 3):
        tree["child_q"][node] = len(tree["dists"])
        add(path, node, 2)
    return tree


def test_rejection_is_lossless_on_iid_children(monkeypatch):
    """Children drawn i.i.d. (duplicates possible), q not renormalized between them: exact
    marginals of the first 3 emitted tokens (depth-2 trees, 3000 rounds, completed to 3 tokens);
    the planted 'no_residual' is rejected by the same test."""
    target, draft = tables(seed=3, noise=0.8)
    P = exact_p(target, PLAIN)
    rng = np.random.default_rng(0)
    trees = [iid_tree(draft, rng) for _ in range(3000)]

    def run():
        emitted = np.full((len(trees), D + 1), -1)
        for i, tree in enumerate(trees):
            paths = []
            for tok, par in zip(tree["token"], tree["parent"]):
                paths.append((paths[par] if par >= 0 else ()) + (tok,))
            rows = np.stack([target[0]] + [target[prefix_row(p)] for p in paths])
            w = _core.walk_tree(tree, rows, sampling(PLAIN, seed=i), PROMPT, "rejection")
            toks = [tree["token"][n] for n in w["path"]] + [w["next"]]
            emitted[i, :len(toks)] = toks
        seq = complete(emitted, P, seed=2)[:, :3]
        counts = np.bincount(np.ravel_multi_index(seq.T, (V,) * 3), minlength=V ** 3)
        exact = exact_joint(P).reshape((V,) * (D + 1)).sum(axis=-1).ravel()
        return chi_square_p(counts.astype(np.float64), exact), (emitted[:, 1] >= 0).mean()

    monkeypatch.delenv(PLANT, raising=False)
    p, accepted = run()
    assert p > 1e-3 and accepted > 0.3
    monkeypatch.setenv(PLANT, "no_residual")
    assert run()[0] < 1e-6


def argmax_reference(tree, rows, history, pen) -> tuple[list[int], int]:
    node, path, history = -1, [], list(history)
    while True:
        scores = penalize(rows[node + 1], history, **pen)
        best = int(np.argmax(scores))
        kids = [c for c, p in enumerate(tree["parent"]) if p == node and tree["token"][c] == best]
        if not kids:
            return path, best
        node = kids[0]
        path.append(node)
        history.append(best)


@pytest.mark.parametrize("pen", [{}, dict(repeat_penalty=2.0, penalty_last_n=3)])
def test_greedy_follows_the_argmax(pen):
    """Greedy sampling parameters: both rules accept the path along the target's (penalized)
    argmax, the next token is the argmax after it; without penalties the device-argmax walk agrees.
    Paths of 2+ nodes and paths off the top-1 chain occur. Seen to fail with walk_tree_argmax
    reading the parent's row (argmax[node] for argmax[node + 1])."""
    rng = np.random.default_rng(7)
    target, draft = tables(seed=5, noise=1.0)
    long_paths = off_chain = 0
    for trial in range(200):
        table = draft + rng.normal(size=draft.shape).astype(np.float32)
        tree = _core.tree_best_first(
            lambda path: (list(range(V)), np.exp(table[prefix_row(path)]).tolist()), BUDGET, D)
        paths = []
        for tok, par in zip(tree["token"], tree["parent"]):
            paths.append((paths[par] if par >= 0 else ()) + (tok,))
        rows = np.stack([target[0]] + [target[prefix_row(p)] for p in paths]) * 0.5 + rng.normal(
            size=(BUDGET + 1, V)).astype(np.float32)
        rows = rows.astype(np.float32)
        want_path, want_next = argmax_reference(tree, rows, PROMPT, pen)
        for rule in ("match", "rejection"):
            w = _core.walk_tree(tree, rows, sampling(dict(temperature=0.0) | pen, seed=trial), PROMPT, rule)
            assert (w["path"], w["next"]) == (want_path, want_next), rule
            assert w["history"] == PROMPT + [tree["token"][n] for n in want_path]
        if not pen:
            w = _core.walk_tree_argmax(tree, rows.argmax(axis=1).tolist())
            assert (w["path"], w["next"]) == (want_path, want_next)
        long_paths += len(want_path) >= 2
        off_chain += any(n >= D for n in want_path)
    assert long_paths > 10 and off_chain > 10


def test_bad_trees_and_plants_are_refused(monkeypatch):
    """Bad trees and plant names raise ValueError naming the node, field or variable. Seen to fail
    with walk_tree not calling DraftTree::check."""
    rows = np.zeros((3, V), dtype=np.float32)
    sp = sampling(PLAIN)
    with pytest.raises(ValueError, match="draft tree node 1: parent 1"):
        _core.walk_tree(dict(token=[1, 2], parent=[-1, 1]), rows, sp, PROMPT, "match")
    with pytest.raises(ValueError, match="draft tree node 1: token 9 outside the vocabulary"):
        _core.walk_tree(dict(token=[1, 9], parent=[-1, 0]), rows, sp, PROMPT, "match")
    with pytest.raises(ValueError, match="node 0: token 2 has probability 0 under the q it was drawn from"):
        _core.walk_tree(dict(token=[2, 1], parent=[-1, -1], child_q=[-1, -1], root_child_q=0,
                             dists=[([1, 3], [0.5, 0.5])]), rows, sp, PROMPT, "rejection")
    with pytest.raises(ValueError, match="rule must be 'match' or 'rejection'"):
        _core.walk_tree(dict(token=[1], parent=[-1]), rows[:2], sp, PROMPT, "greedy")
    monkeypatch.setenv(PLANT, "nonsense")
    with pytest.raises(ValueError, match="DELTASPEC_TEST_WRONG_TREE_RULE"):
        _core.walk_tree(dict(token=[1], parent=[-1]), rows[:2], sp, PROMPT, "match")


@pytest.mark.parametrize("drawn", [False, True])
def test_a_chain_walks_as_the_chain_rule(drawn):
    """A chain is the special case of a tree: walking chain_tree(draft) with the rejection rule
    gives, seed for seed, what the chain accept rule (speculative.h accept_draft) gives, for drafts
    drawn from q (q recorded) and chosen ones. Seen to fail with the rejection walk's acceptance
    test reading q(c) / p(c)."""
    rng = np.random.default_rng(9)
    target, draft = tables(seed=2, noise=0.7)
    differ = accepted_some = rejected_some = 0
    for seed in range(300):
        toks, dists, path = [], [], ()
        for _ in range(D):
            l = draft[prefix_row(path)].astype(np.float64)
            q = np.exp(l - l.max())
            q /= q.sum()
            t = int(rng.choice(V, p=q)) if drawn else int(np.argmax(q))
            toks.append(t)
            dists.append((list(range(V)), q.astype(np.float32).tolist()))
            path += (t,)
        rows = np.stack([target[prefix_row(path[:k])] for k in range(D + 1)])
        sp = sampling(PLAIN, seed=seed)
        chain = _core.accept_chain(rows, toks, dists if drawn else [], sp, PROMPT)
        tree = dict(token=toks, parent=list(range(-1, D - 1)), dists=dists if drawn else [],
                    child_q=list(range(1, D)) + [-1] if drawn else [-1] * D, root_child_q=0 if drawn else -1)
        walk = _core.walk_tree(tree, rows, sp, PROMPT, "rejection")
        differ += (len(walk["path"]), walk["next"], walk["history"]) != (chain["n_accepted"], chain["next"],
                                                                          chain["history"])
        accepted_some += chain["n_accepted"] > 0
        rejected_some += chain["n_accepted"] < D
    assert differ == 0
    assert accepted_some > 30 and rejected_some > 30
