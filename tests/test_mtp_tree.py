"""MTP draft trees (spec_type "mtp" with tree_budget > 0): the head's top-1 chain with its next-best
tokens as extra leaves at each depth (csrc/mtp_drafter.h), verified in one target pass
(Engine::verify_rows) and kept along the accepted path (keep_paths, which keeps the path's tapped
hidden states for the head's catch-up).

Greedy: output equals plain greedy and the rounds accept exactly what a Python replay of the head
predicts; sampled: the exact-marginal test (test_speculative_sampling.py's harness and MTP model).
"""

from __future__ import annotations

import numpy as np

from deltaspec import Model
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path
from sampling_reference import chi_square_p
from test_mtp import mtp_rows
from test_speculative_sampling import COMPARED, N_TOKENS, exact_marginals, markov_mtp  # noqa: F401 (fixture)

N_SEEDS = 1500
PARAMS = dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0)
PROMPT = [72, 101, 108, 108, 111, 32]


def _rows_stats(m: Model) -> dict:
    return dict(m._live().rows_stats)


def test_greedy_mtp_trees_are_lossless_and_branch():
    """Trees of up to 6 nodes, 3 deep, from a random MTP head on a random target: exactly plain
    greedy's tokens; the trees branched (verify_rows ran on branched trees) and accepted more
    drafts than the head's chains of the same depth do (the side leaves get accepted). Seen to
    fail: ranking a greedy tree's candidates by the one-hot greedy distribution left nothing to
    branch to (0 branched verifies)."""
    with Model(tiny_vocab_model_path(mtp=True, mtp_hidden_scale=1.0), n_ctx=256, n_threads=1) as m:
        rng = np.random.default_rng(11)
        before = _rows_stats(m)
        tree_acc = chain_acc = nodes = 0
        for _ in range(6):
            prompt = rng.integers(0, 256, size=rng.integers(2, 20)).tolist()
            plain = m.generate(prompt, max_tokens=32, temperature=0)
            tree = m.generate(prompt, max_tokens=32, temperature=0, spec_type="mtp", draft_n_max=3, draft_n_min=1,
                              tree_budget=6)
            chain = m.generate(prompt, max_tokens=32, temperature=0, spec_type="mtp", draft_n_max=3, draft_n_min=1)
            assert tree.tokens == plain.tokens and tree.finish_reason == plain.finish_reason
            assert chain.tokens == plain.tokens
            tree_acc += tree.stats.n_accepted
            chain_acc += chain.stats.n_accepted
            nodes += tree.stats.n_tree_nodes
        after = _rows_stats(m)
        print("tree accepted", tree_acc, "chain accepted", chain_acc, "nodes", nodes, after)
        assert after["branched_calls"] - before["branched_calls"] > 20
        assert nodes > 0 and tree_acc > chain_acc


def test_tree_drafts_follow_the_target_hidden_states():
    """Trees one deep (draft_n_max 1) of `budget` leaves: a round accepts a draft exactly when the
    target's next token is among the head's top `budget` tokens (its ranking: softmax order, lowest
    id first on ties) after the committed text, the head run over every committed (token p, target
    hidden at p - 1) pair, as a Python replay computes them from one target pass over the final
    text. The head leans on its hidden input (test_mtp.py's setup), so a catch-up that read a
    rejected sibling's hidden state instead of the accepted leaf's accepts other drafts. Seen to
    fail: `DELTASPEC_TEST_TREE_BUG=taps_uncompacted pytest tests/test_mtp_tree.py` (keep_paths
    keeping the slot's first rows' taps; the switch is read once per process)."""
    budget = 3
    path = tiny_vocab_model_path(branch_scale=0.0, mtp=True, mtp_hidden_scale=0.5, mtp_branch_scale=1.0)
    n = 60

    def run(m, prompt):
        plain = m.generate(prompt, max_tokens=n, temperature=0)
        fast = m.generate(prompt, max_tokens=n, temperature=0, spec_type="mtp", draft_n_max=1, draft_n_min=1,
                          tree_budget=budget)
        assert fast.tokens == plain.tokens
        return plain, fast

    def replay(m, prompt, tokens):
        engine = m._engine
        text = prompt + tokens
        engine.set_taps([m.hparams.n_layer])
        try:
            m.logits(text)
            hidden = engine.tapped[:, 0]
        finally:
            engine.set_taps([])
        expected, off_chain, length = 0, 0, len(prompt) + 1  # the first token comes from the prefill
        while n - (length - len(prompt)) >= 2:  # a round drafts while 2 tokens are left to generate
            toks, prev = mtp_rows(text[:length], hidden[:length])
            engine.mtp_reset()
            logits = engine.mtp_eval(toks, prev)[0][-1]
            top = sorted(range(len(logits)), key=lambda i: (-logits[i], i))[:budget]
            hit = text[length] in top
            expected += hit
            off_chain += hit and text[length] != top[0]
            length += 2 if hit else 1
        return expected, off_chain

    results = []
    with Model(path, n_ctx=256, n_threads=1) as m:
        for prompt in ([72, 101, 108, 108, 111], [33, 40, 50], [1, 2, 3]):
            plain, fast = run(m, prompt)
            expected, off_chain = replay(m, prompt, plain.tokens)
            print(prompt, "accepted", fast.stats.n_accepted, "replay", expected, "off the chain", off_chain,
                  "nodes", fast.stats.n_tree_nodes)
            assert fast.stats.n_tree_nodes > 30 * budget // 2
            results.append((prompt, expected, off_chain, fast.stats.n_accepted))
        assert sum(r[2] for r in results) > 0  # side leaves were accepted: the catch-up after them is tested
    for prompt, expected, _, accepted in results:
        assert accepted == expected, prompt


def _sample(model):
    counts = {pos: np.zeros(model.n_vocab) for pos in COMPARED}
    before = _rows_stats(model)
    nodes = accepted = 0
    for seed in range(N_SEEDS):
        r = model.generate(PROMPT, max_tokens=N_TOKENS, seed=seed, spec_type="mtp", draft_n_max=2, draft_n_min=1,
                           tree_budget=4, **PARAMS)
        for pos in COMPARED:
            if len(r.tokens) > pos:
                counts[pos][r.tokens[pos]] += 1
        nodes += r.stats.n_tree_nodes
        accepted += r.stats.n_accepted
    after = _rows_stats(model)
    return counts, dict(nodes=nodes, accepted=accepted, branched=after["branched_calls"] - before["branched_calls"],
                        verified=after["calls"] - before["calls"])


def test_sampled_mtp_trees_have_exact_marginals(markov_mtp, monkeypatch):  # noqa: F811
    """Tokens 2 and 3 of runs drafting MTP trees (4 nodes, 2 deep: the chain's children drawn from
    the head's q without replacement, q recorded) follow the exact marginals; the trees branched in
    most rounds and drafts were accepted. Seen to fail with DELTASPEC_TEST_WRONG_TREE_RULE=no_residual
    (a rejected child leaves p as it was instead of norm(max(0, p - q))), the same seeds, asserted
    below."""
    exact = exact_marginals(markov_mtp, PROMPT, PARAMS)
    counts, stats = _sample(markov_mtp)
    print("right rule", stats)
    assert stats["verified"] > 0 and stats["branched"] > stats["verified"] // 2
    assert stats["accepted"] > 0
    right = [chi_square_p(counts[pos], exact[pos]) for pos in COMPARED]
    print("p right", right)
    assert min(right) > 1e-3

    monkeypatch.setenv("DELTASPEC_TEST_WRONG_TREE_RULE", "no_residual")
    wrong_counts, _ = _sample(markov_mtp)
    wrong = [chi_square_p(wrong_counts[pos], exact[pos]) for pos in COMPARED]
    print("p wrong", wrong)
    assert min(wrong) < 1e-6
