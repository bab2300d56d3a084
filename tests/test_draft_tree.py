"""Draft trees (csrc/draft_tree.h, NgramDrafter::propose_tree in csrc/drafters.h, the draft model's in
csrc/batch_draft.h).

Best-first trees are compared with an independent reading of the rule: the top-1 chain down to
min(budget, max_depth), then the remaining budget as the highest-scoring other paths (score = sum of
log probabilities of the ranks along the path), in descending score order. N-gram trees are compared
with an independent trie of the continuations of every earlier occurrence of the matched suffix.
The draft model's tree is compared with the tree built from its distributions computed from scratch.

Each test was seen to fail once with a bug planted in the C++ (named in its docstring).
"""

import itertools

import numpy as np
import pytest
from deltaspec import Model, _core
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path
from sampling_reference import chi_square_p, expected_probs, penalize

V = 4


def q_table(seed: int, max_depth: int, sharp: float = 1.5, flat_root: bool = False) -> dict:
    """A fixed draft distribution for every token path up to max_depth (no ties)."""
    rng = np.random.default_rng(seed)
    table = {}
    for k in range(max_depth + 1):
        for path in itertools.product(range(V), repeat=k):
            logits = rng.normal(size=V) * sharp
            if flat_root and k == 0:
                logits = np.array([0.05, 0.0, -0.3, -0.35])  # a flat root: pure best-first branches there
            p = np.exp(logits - logits.max())
            table[path] = (p / p.sum()).astype(np.float32)
    return table


def as_dist(table):
    return lambda path: (list(range(V)), table[tuple(path)].tolist())


def node_paths(tree: dict) -> list[tuple]:
    paths = []
    for tok, par in zip(tree["token"], tree["parent"]):
        paths.append((paths[par] if par >= 0 else ()) + (tok,))
    return paths


def reference_best_first(table, budget, max_depth, max_children=V, chain_seeded=True) -> list[tuple]:
    """Chain first, then the best other paths by score, best first (ranks beyond max_children excluded)."""
    def children(path):
        probs = table[path].astype(np.float64)
        order = sorted(range(V), key=lambda t: (-probs[t], t))[:max_children]
        return [(path + (t,), np.log(probs[t])) for t in order]

    scored, frontier = {}, [((), 0.0)]
    while frontier:
        path, s = frontier.pop()
        if len(path) < max_depth:
            for child, lp in children(path):
                scored[child] = s + lp
                frontier.append((child, s + lp))
    chain = []
    if chain_seeded:
        for _ in range(min(budget, max_depth)):
            chain.append(children(chain[-1] if chain else ())[0][0])
    rest = sorted((p for p in scored if p not in chain), key=lambda p: -scored[p])
    return chain + rest[:budget - len(chain)]


@pytest.mark.parametrize("budget,max_depth,max_children", [(6, 3, 0), (10, 4, 0), (12, 3, 2), (3, 5, 0)])
def test_best_first_matches_reference(budget, max_depth, max_children):
    """Order, budget and chain seeding: node paths equal the reference's list exactly (so parents
    precede children, depth <= max_depth, the chain is nodes 0..L-1); every node the builder asked
    a distribution for may have children. Seen to fail with the chain seeding removed (the
    builder starting from the root's rank-0 candidate in the frontier) and with the sibling offered
    at rank + 2."""
    table = q_table(1, max_depth)
    tree = _core.tree_best_first(as_dist(table), budget, max_depth, max_children)
    ref = reference_best_first(table, budget, max_depth, max_children or V)
    assert node_paths(tree) == ref
    assert len(tree["token"]) == budget
    chain = min(budget, max_depth)
    assert tree["parent"][:chain] == list(range(-1, chain - 1))
    assert all(p < i for i, p in enumerate(tree["parent"]))
    assert tree["child_q"] == [-1] * budget and tree["dists"] == []  # chosen children: no q recorded
    # asked: the root, then every node that can still get children when it is added
    assert tree["asked"][0] == [] and all(tuple(a) in ref for a in tree["asked"][1:])
    assert all(len(a) < max_depth for a in tree["asked"])


def test_chain_seeding_keeps_the_top1_chain():
    """Where pure best-first would not verify the whole top-1 chain (a flat root, sharp below), the
    seeded tree still starts with it. Seen to fail with the chain seeding removed."""
    table = q_table(2, 5, sharp=0.7, flat_root=True)
    pure = reference_best_first(table, 6, 5, chain_seeded=False)
    seeded = reference_best_first(table, 6, 5)
    assert set(pure) != set(seeded)  # the case needs the seeding
    tree = _core.tree_best_first(as_dist(table), 6, 5)
    assert node_paths(tree) == seeded
    assert max(tree["depth"]) == 5


def test_sampled_children_are_draws_without_replacement():
    """sample_seed: the root's first two children (c1, c2) are distributed as two draws without
    replacement from q, P = q(a) q(b) / (1 - q(a)) (chi-square over 4000 trees), q is recorded
    for every node with children, and no two siblings share a token. Seen to fail with the Gumbel
    noise replaced by uniform noise."""
    q = np.array([0.5, 0.25, 0.15, 0.1], dtype=np.float32)
    counts = np.zeros((V, V))
    for seed in range(4000):
        t = _core.tree_from_marginals([(list(range(V)), q.tolist())], 2, 1, sample_seed=seed)
        assert t["parent"] == [-1, -1] and t["root_child_q"] == 0 and t["child_q"] == [-1, -1]
        counts[t["token"][0], t["token"][1]] += 1
    qd = q.astype(np.float64)
    exact = np.array([[qd[a] * qd[b] / (1 - qd[a]) if a != b else 0.0 for b in range(V)] for a in range(V)])
    assert counts[np.eye(V, dtype=bool)].sum() == 0
    mask = exact > 0
    assert chi_square_p(counts[mask], exact[mask]) > 1e-3

    table = q_table(3, 3)
    tree = _core.tree_best_first(as_dist(table), 9, 3, sample_seed=7)
    paths = node_paths(tree)
    for node in range(-1, len(paths)):
        kids = [i for i, p in enumerate(tree["parent"]) if p == node]
        qi = tree["root_child_q"] if node < 0 else tree["child_q"][node]
        if kids:
            ids, probs = tree["dists"][qi]
            path = () if node < 0 else paths[node]
            np.testing.assert_allclose(np.array(probs)[np.argsort(ids)], table[path], rtol=1e-6)
            toks = [tree["token"][k] for k in kids]
            assert len(set(toks)) == len(toks)


def test_marginals_share_one_q_per_depth():
    """A block drafter's per-depth marginals: chosen children follow the best-first reference with
    the marginal of each depth; sampled ones record the marginal of their depth (shared, not copied
    per node). Seen to fail with the depth index off by one."""
    rng = np.random.default_rng(4)
    marginals = [rng.dirichlet(np.ones(V)).astype(np.float32) for _ in range(3)]
    md = [(list(range(V)), m.tolist()) for m in marginals]
    table = {p: marginals[len(p)] for k in range(3) for p in itertools.product(range(V), repeat=k)}
    tree = _core.tree_from_marginals(md, 8, 5)
    assert node_paths(tree) == reference_best_first(table, 8, 3)
    s = _core.tree_from_marginals(md, 8, 5, sample_seed=1)
    assert s["root_child_q"] == 0 and [tuple(d) for d in s["dists"]] == [tuple(d) for d in md]
    expanded = [n for n, q in enumerate(s["child_q"]) if q >= 0]
    assert expanded and all(s["child_q"][n] == s["depth"][n] for n in expanded)
    assert all(s["child_q"][n] == -1 for n in range(8) if s["depth"][n] == 3)


def reference_ngram_tree(committed, budget, max_depth, max_ngram=3, min_ngram=1) -> list[tuple]:
    n = len(committed)
    for length in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        suffix = committed[n - length:]
        starts = [s for s in range(n - length - 1, -1, -1) if committed[s:s + length] == suffix]
        if not starts:
            continue
        paths = []
        for s in starts:
            cont = committed[s + length:s + length + max_depth]
            for k in range(1, len(cont) + 1):
                if tuple(cont[:k]) not in paths:
                    if len(paths) == budget:
                        break
                    paths.append(tuple(cont[:k]))
        return paths
    return []


def test_ngram_tree_branches_where_history_does():
    """The history continues "1 2 3" three different ways: the tree holds all of them, merged where
    they agree, the most recent (prompt lookup's chain) first. Seen to fail with insertion stopped
    after the first occurrence (no branching)."""
    committed = [1, 2, 3, 7, 8, 9, 5, 1, 2, 3, 7, 4, 6, 1, 2, 3, 5, 5, 0, 1, 2, 3]
    for budget, max_depth in [(16, 4), (6, 4), (16, 2), (3, 8)]:
        tree = _core.ngram_tree(committed, budget, max_depth)
        assert node_paths(tree) == reference_ngram_tree(committed, budget, max_depth)
        chain = min(len(tree["chain"]), budget)
        assert tree["token"][:chain] == tree["chain"][:chain] and tree["parent"][:chain] == list(range(-1, chain - 1))
    tree = _core.ngram_tree(committed, 16, 4)
    assert sorted(tok for tok, par in zip(tree["token"], tree["parent"]) if par == -1) == [5, 7]
    kids_of_7 = [tree["token"][i] for i, p in enumerate(tree["parent"]) if p >= 0 and node_paths(tree)[p] == (7,)]
    assert sorted(kids_of_7) == [4, 8]  # branching below the root too
    assert _core.ngram_tree([1, 2, 3, 4], 8, 4)["token"] == []  # no earlier occurrence: nothing


@pytest.fixture(scope="module")
def draft_model():
    with Model(tiny_vocab_model_path(), n_ctx=128, n_threads=1) as m:
        yield m


def ranking_probs(model, history, params):
    return expected_probs(penalize(model.logits(history)[-1], history, **params.get("pen", {})), **params["chain"])


@pytest.mark.parametrize("sampled", [False, True])
def test_model_drafter_tree_uses_the_draft_distribution_at_every_node(draft_model, sampled):
    """The draft model's trees (BatchModelDrafter, as the scheduler drafts them) over three rounds
    (the committed text grows by accepted paths): greedy, the tree equals the best-first tree built
    from the draft's softmax (top 32) computed from scratch at every node; sampling, every recorded
    q equals the sampling chain's distribution computed from scratch at that node's path. Covers
    each node's path evaluated from the committed state and the cost stated (catch-up tokens plus
    one draft step per node evaluated). Seen to fail with a node evaluated from its last token
    alone (not its whole path), and (cost) when a node's path counted its tokens."""
    m = draft_model
    prompt = m.tokenize("def f(x): return x")[:10]
    rounds = [prompt, prompt + [17, 40], prompt + [17, 40, 99, 3, 5]]
    if sampled:
        params = dict(temperature=0.9, top_k=12, top_p=0.95, min_p=0.0, repeat_penalty=1.2, penalty_last_n=8)
        ref = dict(chain=dict(temperature=0.9, top_k=12, top_p=0.95, min_p=0.0),
                   pen=dict(repeat_penalty=1.2, penalty_last_n=8))
    else:
        params = dict(temperature=0.0)
        ref = dict(chain=dict(temperature=1.0, top_k=32, top_p=1.0, min_p=0.0))
    sp = _core.SamplingParams()
    for k, v in params.items():
        setattr(sp, k, v)
    trees = _core.model_drafter_trees(m.path, m.hparams, rounds, 10, 4, sp, 128)
    assert len(trees) == 3
    synced = len(rounds[0]) - 1  # begin() read the prompt; the first round catches up on its first token
    for committed, tree in zip(rounds, trees):
        paths = node_paths(tree)
        assert len(paths) == 10 and max(tree["depth"]) == 4
        assert len({p[0] for p in paths}) > 1 or len({p[:2] for p in paths}) > 2  # it branched
        # step cost 1: the catch-up tokens, then one step per node that may get children
        expanded = sum(1 for n, d in enumerate(tree["depth"]) if d < 4 and n < 10 - 1)
        assert tree["cost"] == len(committed) - synced + expanded
        synced = len(committed)
        if not sampled:
            def dist(path, committed=committed):
                p = ranking_probs(m, committed + list(path), ref)
                ids = np.flatnonzero(p)
                return ids.tolist(), p[ids].astype(np.float32).tolist()
            assert paths == node_paths(_core.tree_best_first(dist, 10, 4))
            continue
        for node in range(-1, len(paths)):
            qi = tree["root_child_q"] if node < 0 else tree["child_q"][node]
            if qi < 0:
                continue
            ids, probs = tree["dists"][qi]
            full = np.zeros(m.n_vocab)
            full[ids] = probs
            expect = ranking_probs(m, committed + list(paths[node] if node >= 0 else ()), ref)
            np.testing.assert_allclose(full, expect, atol=2e-5)
