"""Structured output with the model's own MTP head drafting: the head drafts within the grammar.

Each head row is masked with the grammar's state after the tokens drafted before it (as a draft
model's, tests/test_structured.py), so a greedy chain proposes the head's best allowed token,
a sampled chain draws from the masked row and reports that row's q, and a tree's children are
allowed tokens. DELTASPEC_DRAFT_IN_GRAMMAR=0 leaves the head unconstrained (its forbidden drafts
cut before verification), which the tests use as the contrast that shows the masking ran.

Planted bugs (DELTASPEC_TEST_GRAMMAR_BUG, csrc/token_constraint.h) run here and must turn the
tests red: "draft_unmasked" (the head's rows left unmasked) and "draft_q_unmasked" (a sampled
chain drawn from the masked row but reporting the unmasked row's q).
"""

import pytest

from deltaspec import Grammar, Model
from deltaspec.testing.json_schemas import BOUNDED_SCHEMAS
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path, write_tiny_vocab_model
from test_structured import (DIST_PARAMS, DIST_PROMPT, _assert_drafted_within_and_exact, _ascii_allowed,
                             _count_second_tokens, _second_token_marginal, _valid)

BUG = "DELTASPEC_TEST_GRAMMAR_BUG"
MAX_TOKENS = 300
SCHEMA = "lists"


@pytest.fixture(scope="module")
def oracle():
    """A target whose next token depends on the current one only (branch_scale 0) and an MTP head
    that computes exactly that (tests/test_mtp.py's oracle): masked with the same grammar state,
    the head's best allowed token is the masked target's, so every draft made within the grammar
    is accepted."""
    with Model(tiny_vocab_model_path(branch_scale=0.0, mtp=True), n_ctx=512, n_threads=1, progress=False) as m:
        yield m


@pytest.fixture(scope="module")
def grammar():
    return Grammar.from_json_schema(BOUNDED_SCHEMAS[SCHEMA])


@pytest.mark.parametrize("tree_budget", [0, 6], ids=["chains", "trees"])
def test_mtp_drafts_within_the_grammar(oracle, grammar, tree_budget, monkeypatch):
    """Greedy constrained output with the MTP head drafting equals plain constrained greedy; within
    the grammar no draft is cut and (the oracle head) every draft beyond the forced tokens is
    accepted; unconstrained (DELTASPEC_DRAFT_IN_GRAMMAR=0) the head's unmasked argmax is often
    forbidden and cut. Seen red with DELTASPEC_TEST_GRAMMAR_BUG=draft_unmasked (rows left
    unmasked: tokens cut, drafts rejected), run here; and before the head drafted within the
    grammar (grammar_draft_rows 0, tokens cut), the state DELTASPEC_DRAFT_IN_GRAMMAR=0 keeps."""
    kw = dict(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar, spec_type="mtp",
              draft_n_max=4, draft_n_min=1, tree_budget=tree_budget)
    for prompt in ("Hello",):
        plain = oracle.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar)
        _valid(plain, BOUNDED_SCHEMAS[SCHEMA])
        r = oracle.generate(prompt, **kw)
        st = r.stats
        print(f"{prompt!r}: drafted {st.n_drafted}, accepted {st.n_accepted}, forced {st.grammar_forced_tokens}, "
              f"draft rows {st.grammar_draft_rows}, cut {st.grammar_cut_tokens}, tree nodes {st.n_tree_nodes}")
        assert r.tokens == plain.tokens
        assert st.grammar_cut_tokens == 0 and st.grammar_draft_rows > 0
        assert st.n_drafted > st.grammar_forced_tokens + 10  # the head drafted, not only the grammar
        if tree_budget:
            assert st.n_tree_nodes > st.n_accepted  # trees branched: side nodes, rejected
        else:
            assert st.n_accepted == st.n_drafted
        monkeypatch.setenv("DELTASPEC_DRAFT_IN_GRAMMAR", "0")
        free = oracle.generate(prompt, **kw)
        monkeypatch.delenv("DELTASPEC_DRAFT_IN_GRAMMAR")
        assert free.tokens == plain.tokens
        assert free.stats.grammar_cut_tokens > 0 and free.stats.grammar_draft_rows == 0
        assert free.stats.n_accepted < st.n_accepted
        monkeypatch.setenv(BUG, "draft_unmasked")
        planted = oracle.generate(prompt, **kw)
        monkeypatch.delenv(BUG)
        assert planted.tokens == plain.tokens and planted.stats.grammar_cut_tokens > 0


# --- the sampled distribution ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharp_mtp(tmp_path_factory):
    """A random target with an MTP head that mixes in the hidden state, its head norm doubled
    (tests/test_speculative_sampling.py's markov_mtp, on the full tiny target): drafts agree with
    the target in part, and too sharply, so both outcomes of the accept rule are common."""
    path = tmp_path_factory.mktemp("structured_mtp") / "sharp-mtp.gguf"
    write_tiny_vocab_model(path, seed=0, mtp=True, mtp_hidden_scale=0.3,
                           weight_map=lambda name, x: x * 2.0 if name.endswith("nextn.shared_head_norm.weight") else x)
    with Model(path, n_ctx=128, n_threads=1, progress=False) as m:
        yield m


def _second_token_counts(model: Model, grammar, tree_budget: int):
    """test_structured's counts with the MTP head drafting."""
    return _count_second_tokens(lambda seed: model.generate(
        DIST_PROMPT, max_tokens=4, seed=seed, grammar=grammar, spec_type="mtp", draft_n_min=1, draft_n_max=4,
        tree_budget=tree_budget, **DIST_PARAMS), model.n_vocab)


@pytest.mark.parametrize("tree_budget", [0, 4], ids=["chains", "trees"])
def test_sampled_mtp_keeps_the_constrained_distribution(sharp_mtp, tree_budget):
    """Sampled drafts from the MTP head within a grammar that forbids most of what it would
    propose: the second token has the exact marginal of plain constrained sampling (chi-square over
    600 seeds), every draft drawn from the head's masked row, nothing cut. Chains: seen red with
    DELTASPEC_TEST_GRAMMAR_BUG=draft_q_unmasked (drawn from the masked row, the unmasked row's q
    reported, so drafts are accepted too often; measured p right 0.61, planted 4e-102), run here.
    Trees draw their children from the very distribution they report, so that mismatch cannot be
    planted in them; their planted run (draft_unmasked: rows left unmasked) shows the path
    assertion failing instead (forbidden children cut: 687; p right 0.73)."""
    grammar = Grammar.from_regex(r"[ -~]*")
    expected = _second_token_marginal(sharp_mtp, _ascii_allowed(sharp_mtp))
    _assert_drafted_within_and_exact(lambda: _second_token_counts(sharp_mtp, grammar, tree_budget), expected,
                                     *(("draft_unmasked", "path") if tree_budget else ("draft_q_unmasked", "distribution")))
