"""Sampled tree speculation is lossless end to end: generate(..., tree_budget=N) at temperature > 0
emits tokens distributed as plain sampling's, compared (chi-square) with exact marginals.

The setup is test_speculative_sampling.py's (its exact marginals, its draft that agrees with the
target in part), with trees: every run generates 4 tokens with draft_n_max=2, draft_n_min=1 and
tree_budget=4, so the tokens 2 and 3 come out of a walk of a drafted tree of up to 4 nodes (the
draft model's children drawn from its q without replacement, csrc/draft_tree.h), verified in one
target pass (Engine::verify_rows) and walked with the rejection rule (csrc/tree_walk.h), whose
accepted path keep_paths commits. The walk rules themselves are tested on synthetic trees in
test_tree_walk.py; this is the whole loop on a real target.

Power: DELTASPEC_TEST_WRONG_TREE_RULE=no_residual (a rejected child leaves p as it was instead of
norm(max(0, p - q))) with the same seeds is rejected.
"""

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path, write_tiny_vocab_model
from sampling_reference import chi_square_p
from test_speculative_sampling import COMPARED, N_TOKENS, exact_marginals

N_SEEDS = 1500
PARAMS = dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0)
PROMPT = [72, 101, 108, 108, 111, 32]


@pytest.fixture(scope="module")
def model_pair(tmp_path_factory):
    scale = {"blk.1.ffn_down.weight": 2.0, "output.weight": 2.0}
    path = tmp_path_factory.mktemp("spectreesample") / "draft.gguf"
    write_tiny_vocab_model(path, seed=0, weight_map=lambda name, x: x * scale.get(name, 1.0))
    with Model(tiny_vocab_model_path(), n_ctx=128, n_threads=1) as target, Model(path, n_ctx=128, n_threads=1) as draft:
        yield target, draft


def _sample(target, draft):
    counts = {pos: np.zeros(target.n_vocab) for pos in COMPARED}
    engine = target._live()
    before = dict(engine.rows_stats)
    nodes = accepted = 0
    for seed in range(N_SEEDS):
        r = target.generate(PROMPT, max_tokens=N_TOKENS, seed=seed, draft_model=draft, draft_n_max=2, draft_n_min=1,
                            tree_budget=4, **PARAMS)
        for pos in COMPARED:
            if len(r.tokens) > pos:
                counts[pos][r.tokens[pos]] += 1
        nodes += r.stats.n_tree_nodes
        accepted += r.stats.n_accepted
    after = engine.rows_stats
    return counts, dict(nodes=nodes, accepted=accepted, branched=after["branched_calls"] - before["branched_calls"],
                        verified=after["calls"] - before["calls"],
                        moved=after["kv_rows_moved"] - before["kv_rows_moved"])


def test_sampled_tree_speculation_has_exact_marginals(model_pair, monkeypatch):
    """Tokens 2 and 3 follow the exact marginals; trees branched in most rounds and paths off the
    first-drawn chain were accepted. Seen to fail with DELTASPEC_TEST_WRONG_TREE_RULE=no_residual
    (the same seeds, asserted below)."""
    target, draft = model_pair
    exact = exact_marginals(target, PROMPT, PARAMS)
    counts, stats = _sample(target, draft)
    print("right rule", stats)
    assert stats["verified"] > 0 and stats["branched"] > stats["verified"] // 2
    assert stats["accepted"] > 0 and stats["moved"] > 0
    right = [chi_square_p(counts[pos], exact[pos]) for pos in COMPARED]
    print("p right", right)
    assert min(right) > 1e-3

    monkeypatch.setenv("DELTASPEC_TEST_WRONG_TREE_RULE", "no_residual")
    wrong_counts, _ = _sample(target, draft)
    wrong = [chi_square_p(wrong_counts[pos], exact[pos]) for pos in COMPARED]
    print("p wrong", wrong)
    assert min(wrong) < 1e-6
