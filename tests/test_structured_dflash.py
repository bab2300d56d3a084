"""Structured output with a DFlash drafter: its blocks draft within the grammar.

One block pass gives each slot's top K candidates; a chain takes at each slot the best candidate
the grammar allows after the chain before it, and a DDTree node gets as children only its depth's
candidates the grammar allows after its path, renormalized (sampled children are drawn from, and
report, that q). DELTASPEC_DRAFT_IN_GRAMMAR=0 leaves the drafter unconstrained (its forbidden
drafts cut or pruned before verification), which the tests use as the contrast that shows the
masking ran.

The grammar here allows printable ASCII only, which forbids two of the three tokens the seed-3
drafter (deltaspec.testing.tiny_dflash.write_sharp_tiny_dflash) proposes most; the target is
pushed towards the third, "R" (logit_bias), so that drafts made within the grammar are accepted
in part. Unconstrained, the drafter's drafts are often cut. Planted bugs (DELTASPEC_TEST_GRAMMAR_BUG, csrc/token_constraint.h) run here and
must turn the tests red: "draft_unmasked" (candidates not cut by the grammar) and
"draft_q_unmasked" (a tree's children drawn from the allowed candidates, q reported uncut).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("dflash")

from deltaspec import Drafter, Grammar, Model  # noqa: E402
from deltaspec.testing.tiny_dflash import write_sharp_tiny_dflash  # noqa: E402
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path  # noqa: E402
from test_structured import (DIST_PARAMS, DIST_PROMPT, _assert_drafted_within_and_exact,  # noqa: E402
                             _ascii_allowed, _count_second_tokens, _second_token_marginal)

BUG = "DELTASPEC_TEST_GRAMMAR_BUG"
BIAS = {82: 4.0}  # "R", the drafter's favourite printable token


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny-vocabulary target and the seed-3 sharpened DFlash drafter on it."""
    with Model(tiny_vocab_model_path(), n_ctx=512, n_threads=1, progress=False) as target:
        path = write_sharp_tiny_dflash(target, tmp_path_factory.mktemp("structured_dflash") / "d.gguf")
        yield target, Drafter(path, target=target)


PRINTABLE = r"[ -~]*"  # the same allowed set at every position: a reference needs no grammar engine
N_CANDIDATES = 16  # DFlashDrafter::kConstrainedChainCandidates


def test_chain_within_the_grammar_is_the_reference(tiny):
    """Drafter.chain with a grammar equals a numpy reference on the same block (block_logits): per
    slot, of its top 16 the most probable printable one (what [ -~]* allows, told apart here
    without llguidance), the chain ending at a slot with none; without the grammar, the argmaxes.
    Seen red with the chain taking the first allowed token of the device's top K, which come in no
    particular order (other tokens, from the first slot)."""
    target, drafter = tiny
    allowed = _ascii_allowed(target)
    rng = np.random.default_rng(0)
    changed = 0
    for _ in range(6):
        ids = rng.integers(0, target.n_vocab, size=6).tolist()
        expected = []
        for row in drafter.block_logits(ids):
            top = np.argsort(-row, kind="stable")[:N_CANDIDATES]
            ok = [int(t) for t in top if allowed[t]]
            if not ok:
                break
            expected.append(ok[0])
        got = drafter.chain(ids, grammar=Grammar.from_regex(PRINTABLE))
        assert got == expected, ids
        free = drafter.chain(ids)
        assert free == drafter.block_top1(ids)
        changed += got != free
    assert changed > 0  # the grammar changed chains: the drafter's argmaxes are often not printable


def test_tree_within_the_grammar_is_the_reference(tiny):
    """Drafter.tree with a grammar equals the torch reference's DDTree builder (bench/testbed/ddtree.py)
    run on each depth's top K cut to the printable tokens, renormalized over them (what [ -~]*
    allows at any position, so every node of a depth has the same candidates). Seen red with the
    cut candidates not renormalized (scores of other depths then compare differently: other
    nodes)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "testbed"))
    import ddtree

    target, drafter = tiny
    allowed = _ascii_allowed(target)
    rng = np.random.default_rng(1)
    branched = 0
    for budget, max_depth in [(8, 5), (12, 7), (16, 4), (4, 3)]:
        ids = rng.integers(0, target.n_vocab, size=6).tolist()
        lp = torch.log_softmax(torch.tensor(drafter.block_logits(ids), dtype=torch.float64), -1)
        vals, toks = lp.topk(budget, -1)
        keep = torch.tensor(allowed)[toks]
        toks = [t[k] for t, k in zip(toks, keep)]
        vals = [v[k] - torch.logsumexp(v[k], 0) for v, k in zip(vals, keep)]
        width = max(len(t) for t in toks)  # padded with -inf scores: nodes the drafter does not have
        pad = np.full((len(toks), width), -np.inf)
        ids_pad = np.zeros((len(toks), width), dtype=np.int64)
        for d, (t, v) in enumerate(zip(toks, vals)):
            ids_pad[d, :len(t)], pad[d, :len(v)] = t.numpy(), v.numpy()
        ref = ddtree.build(ids_pad, pad, budget, max_depth=max_depth)
        n = sum(np.isfinite(ref.scores))  # the best-first order puts the padding's nodes last
        got = drafter.tree(ids, budget, max_depth, grammar=Grammar.from_regex(PRINTABLE))
        assert all(allowed[t] for t in got["token"])
        assert (got["token"], got["parent"], got["depth"]) == (ref.tokens[:n], ref.parents[:n], ref.depths[:n]), budget
        branched += len(set(got["parent"])) < len(got["parent"])
    assert branched >= 2


@pytest.mark.parametrize("tree_budget", [0, 8], ids=["chains", "ddtree8"])
def test_dflash_drafts_within_the_grammar(tiny, tree_budget, monkeypatch):
    """Greedy constrained output with DFlash drafting equals plain constrained greedy; within the
    grammar every draft is allowed (nothing cut) and more are accepted than unconstrained
    (DELTASPEC_DRAFT_IN_GRAMMAR=0), where the drafter's forbidden favourites are cut (measured,
    accepted within / unconstrained: chains 11 / 2, trees 21 / 15). Seen red with DELTASPEC_TEST_GRAMMAR_BUG=
    draft_unmasked (candidates not cut by the grammar: drafts cut), run here; and before DFlash
    drafted within the grammar (grammar_draft_rows 0, drafts cut), the state
    DELTASPEC_DRAFT_IN_GRAMMAR=0 keeps."""
    target, drafter = tiny
    grammar = Grammar.from_regex(r"[ -~]{60}")  # 60 characters: no early end
    kw = dict(max_tokens=80, temperature=0.0, grammar=grammar, logit_bias=BIAS)
    plain = target.generate("Hello", **kw)
    assert plain.finish_reason == "stop" and len(plain.text) == 60
    kw.update(draft_model=drafter, spec_type="dflash", draft_n_min=1, draft_n_max=6, tree_budget=tree_budget)
    r = target.generate("Hello", **kw)
    st = r.stats
    print(f"within: drafted {st.n_drafted}, accepted {st.n_accepted}, draft rows {st.grammar_draft_rows}, "
          f"cut {st.grammar_cut_tokens}, tree nodes {st.n_tree_nodes}")
    assert r.tokens == plain.tokens
    assert st.grammar_cut_tokens == 0 and st.grammar_draft_rows > 0 and st.n_drafted > 20
    if tree_budget:
        assert st.n_tree_nodes > 0
    monkeypatch.setenv("DELTASPEC_DRAFT_IN_GRAMMAR", "0")
    free = target.generate("Hello", **kw)
    monkeypatch.delenv("DELTASPEC_DRAFT_IN_GRAMMAR")
    print(f"unconstrained: drafted {free.stats.n_drafted}, accepted {free.stats.n_accepted}, "
          f"cut {free.stats.grammar_cut_tokens}")
    assert free.tokens == plain.tokens
    assert free.stats.grammar_cut_tokens > 0 and free.stats.grammar_draft_rows == 0
    assert st.n_accepted > free.stats.n_accepted
    monkeypatch.setenv(BUG, "draft_unmasked")
    planted = target.generate("Hello", **kw)
    monkeypatch.delenv(BUG)
    assert planted.tokens == plain.tokens and planted.stats.grammar_cut_tokens > 0


def _second_token_counts(target: Model, drafter: Drafter, grammar, tree_budget: int):
    """test_structured's counts with DFlash drafting, the target pushed by BIAS."""
    return _count_second_tokens(lambda seed: target.generate(
        DIST_PROMPT, max_tokens=4, seed=seed, grammar=grammar, draft_model=drafter, spec_type="dflash", draft_n_min=1,
        draft_n_max=4, tree_budget=tree_budget, logit_bias=BIAS, **DIST_PARAMS), target.n_vocab)


@pytest.mark.parametrize("tree_budget", [0, 4], ids=["chains", "ddtree4"])
def test_sampled_dflash_keeps_the_constrained_distribution(tiny, tree_budget):
    """Sampled speculation with DFlash drafting within the grammar: the second token has the exact
    marginal of plain constrained sampling (chi-square over 600 seeds), every draft allowed (nothing
    cut). Trees: seen red with DELTASPEC_TEST_GRAMMAR_BUG=draft_q_unmasked (children drawn from the
    allowed candidates, their q reported uncut, so drafts are accepted too often; measured p right
    0.86, planted 2e-14), run here. Chains are deterministic (their q one-hot: nothing to
    misreport); their planted run (draft_unmasked) shows the path assertion failing instead
    (forbidden drafts cut: 1234; p right 0.97)."""
    target, drafter = tiny
    grammar = Grammar.from_regex(r"[ -~]*")
    expected = _second_token_marginal(target, _ascii_allowed(target), BIAS)
    _assert_drafted_within_and_exact(lambda: _second_token_counts(target, drafter, grammar, tree_budget), expected,
                                     *(("draft_q_unmasked", "distribution") if tree_budget else ("draft_unmasked", "path")))
