"""Structured output with speculation for several sequences at once: generate_batch / add_request
with a grammar per request and a drafter (prompt lookup, a draft model or the model's MTP head;
chains or trees). A
constrained sequence drafts as generate() alone does (the tokens the grammar forces, else its
drafter's proposal cut or pruned by the grammar), and its rows of
the shared verify pass are masked with the grammar's state after their path.

The claims: each sequence gives exactly what generate() alone gives with the same drafter (tokens,
drafts, acceptance, the grammar's counts; greedy and seeded sampling); greedy, plain constrained
decoding's tokens; every output validates against its schema (jsonschema, independent of
llguidance); and the constrained sequences did draft (forced tokens, cut tokens, accepted drafts)
in passes shared with other sequences. CPU, one thread, F32 tiny-vocabulary model: the batch's rows
are bitwise the one-sequence rows.

Seen red with the scheduler's verify rows left unmasked (decode_speculative without
mask_verify_rows / mask_tree_rows: the greedy outputs part from plain decoding, and GrammarError),
with its forced-token drafting left out (draft_forced: other drafts than alone) and with
settle_draft not cutting (other drafts than alone); DELTASPEC_TEST_GRAMMAR_BUG=verify_unmasked
(csrc/token_constraint.h) turns test_planted_unmasked_rows_are_caught's run red, and the MTP test's
(its greedy outputs part from plain constrained decoding).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from deltaspec import Grammar, Model
from deltaspec.errors import GrammarError
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path, write_tiny_vocab_model
from batch_drafting import drafting
from test_structured import SCHEMAS

MAX_TOKENS = 400
BUG = "DELTASPEC_TEST_GRAMMAR_BUG"
PROMPTS = ["Hello", "the cat sat", "{", "a b c"]
NAMES = ["record", "lists", "text", "record"]
GRAMMAR_STATS = ("grammar_masked_rows", "grammar_cut_tokens", "grammar_forced_tokens", "grammar_draft_rows")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target with 3 slots, and an unrelated random model (3 slots) as draft model: drafting
    unconstrained, its drafts are mostly what the grammar forbids (cut) and sometimes what the
    target writes (accepted)."""
    path = write_tiny_vocab_model(tmp_path_factory.mktemp("batch_structured") / "random.gguf", seed=1)
    kw = dict(n_ctx=768, n_threads=1, n_seq_max=3, progress=False)
    with Model(tiny_vocab_model_path(), **kw) as target, Model(path, **kw) as draft:
        yield target, draft


@pytest.fixture(scope="module")
def grammars():
    return {name: Grammar.from_json_schema(schema) for name, schema in SCHEMAS.items()}


def _speculation(models, drafter: str, tree_budget: int) -> dict:
    spec = dict(spec_type="ngram-simple") if drafter == "ngram" else dict(draft_model=models[1])  # draft-model*
    return dict(spec, draft_n_max=8, draft_n_min=1, tree_budget=tree_budget)  # n_min 1: no pauses


def _grammar_stats(r) -> tuple:
    return tuple(getattr(r.stats, k) for k in GRAMMAR_STATS)


@pytest.mark.parametrize("tree_budget", [0, 6], ids=["chains", "trees"])
@pytest.mark.parametrize("drafter", ["ngram", "draft-model", "draft-model-unconstrained"])
def test_constrained_batch_speculation_equals_alone(models, grammars, drafter, tree_budget, monkeypatch):
    """4 prompts with 3 schemas on 3 slots, greedy and seeded sampling: each result validates and
    equals generate() alone with the same drafter and grammar (tokens, drafting, the grammar's
    counts), greedy also plain constrained decoding; the batch drafted forced tokens, accepted
    drafts, and verified drafts of 2+ sequences in one pass. The draft model drafts within the
    grammar (its rows masked, nothing cut) or, with DELTASPEC_DRAFT_IN_GRAMMAR=0
    (draft-model-unconstrained), unconstrained, its forbidden drafts cut."""
    if drafter == "draft-model-unconstrained":
        monkeypatch.setenv("DELTASPEC_DRAFT_IN_GRAMMAR", "0")
    target, _ = models
    spec = _speculation(models, drafter, tree_budget)
    per_prompt = [dict(grammar=grammars[name], seed=k) for k, name in enumerate(NAMES)]
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05)):
        batch = target.generate_batch(PROMPTS, per_prompt=per_prompt, max_tokens=MAX_TOKENS, **spec, **sampling)
        assert target.batch_spec_stats["multi_draft_passes"] > 0
        for k, (prompt, extra, name, r) in enumerate(zip(PROMPTS, per_prompt, NAMES, batch)):
            assert r.finish_reason == "stop", (name, r.text)
            jsonschema.validate(json.loads(r.text), SCHEMAS[name])
            alone = target.generate(prompt, max_tokens=MAX_TOKENS, **spec, **sampling, **extra)
            assert r.tokens == alone.tokens, f"prompt {k}: other tokens than alone"
            assert drafting(r) == drafting(alone), f"prompt {k}: other drafts than alone"
            assert _grammar_stats(r) == _grammar_stats(alone), f"prompt {k}: other grammar counts than alone"
            if sampling["temperature"] == 0.0:
                plain = target.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, grammar=extra["grammar"])
                assert r.tokens == plain.tokens, f"prompt {k}: other tokens than plain decoding"
        assert sum(r.stats.grammar_forced_tokens for r in batch) > 0, "no forced tokens drafted"
        assert sum(r.stats.n_accepted for r in batch) > 0, "no draft accepted"
        cut, draft_rows = (sum(getattr(r.stats, k) for r in batch) for k in ("grammar_cut_tokens", "grammar_draft_rows"))
        if drafter == "draft-model":
            assert cut == 0 and draft_rows > 0, "the draft model did not draft within the grammar"
        elif drafter == "draft-model-unconstrained":
            assert cut > 0 and draft_rows == 0, "no forbidden draft cut"


@pytest.fixture(scope="module")
def mtp_target():
    """A target with an MTP layer whose drafts agree in part (tests/test_batch_mtp.py's), 3 slots."""
    path = tiny_vocab_model_path(mtp=True, mtp_hidden_scale=0.5)
    with Model(path, n_ctx=768, n_threads=1, n_seq_max=3, progress=False) as m:
        yield m


@pytest.mark.parametrize("tree_budget", [0, 6], ids=["chains", "trees"])
def test_constrained_batch_mtp_equals_alone(mtp_target, grammars, tree_budget):
    """The same with the MTP head drafting (a head per sequence): each result equals generate()
    alone (tokens, drafting, the grammar's counts), greedy also plain constrained decoding; forced
    tokens drafted, drafts accepted, several sequences' drafts verified in one pass."""
    spec = dict(spec_type="mtp", draft_n_max=3, draft_n_min=1, tree_budget=tree_budget)
    per_prompt = [dict(grammar=grammars[name], seed=k) for k, name in enumerate(NAMES)]
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, top_k=40)):
        batch = mtp_target.generate_batch(PROMPTS, per_prompt=per_prompt, max_tokens=MAX_TOKENS, **spec, **sampling)
        assert mtp_target.batch_spec_stats["multi_draft_passes"] > 0
        for k, (prompt, extra, r) in enumerate(zip(PROMPTS, per_prompt, batch)):
            alone = mtp_target.generate(prompt, max_tokens=MAX_TOKENS, **spec, **sampling, **extra)
            assert r.tokens == alone.tokens, f"prompt {k}: other tokens than alone"
            assert drafting(r) == drafting(alone), f"prompt {k}: other drafts than alone"
            assert _grammar_stats(r) == _grammar_stats(alone), f"prompt {k}: other grammar counts than alone"
            if r.finish_reason == "stop":
                jsonschema.validate(json.loads(r.text), SCHEMAS[NAMES[k]])
            if sampling["temperature"] == 0.0:
                plain = mtp_target.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, grammar=extra["grammar"])
                assert r.tokens == plain.tokens, f"prompt {k}: other tokens than plain decoding"
        assert sum(r.stats.grammar_forced_tokens for r in batch) > 0, "no forced tokens drafted"
        assert sum(r.stats.n_accepted for r in batch) > 0, "no draft accepted"


def test_paused_drafter_forced_tokens_batch_equals_alone(models, grammars, monkeypatch):
    """The random draft model with draft_n_min 0, so that failing rounds pause it: each sequence of
    the batch drafts the grammar's forced tokens while its drafter pauses, as generate() alone does
    (tokens, drafting and grammar counts equal), greedy also plain constrained decoding's tokens.
    Seen red with DELTASPEC_TEST_GRAMMAR_BUG=pause_blocks_forced (fewer forced tokens drafted:
    the count assertion), run here. (A sequence whose last round drafts forced tokens during a
    pause: test_tool_call_grammar.py's batch comparison, seen red with that round's counts left
    out of the finished sequence's stats.)"""
    target, draft = models
    per_prompt = [dict(grammar=grammars[name]) for name in NAMES]
    options = dict(draft_model=draft, draft_n_max=8, temperature=0.0, max_tokens=MAX_TOKENS)

    def forced(batch):
        return sum(r.stats.grammar_forced_tokens for r in batch)

    batch = target.generate_batch(PROMPTS, per_prompt=per_prompt, **options)
    for k, (prompt, extra, r) in enumerate(zip(PROMPTS, per_prompt, batch)):
        alone = target.generate(prompt, **options, **extra)
        assert r.tokens == alone.tokens, f"prompt {k}: other tokens than alone"
        assert drafting(r) == drafting(alone), f"prompt {k}: other drafts than alone"
        assert _grammar_stats(r) == _grammar_stats(alone), f"prompt {k}: other grammar counts than alone"
        plain = target.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, **extra)
        assert r.tokens == plain.tokens, f"prompt {k}: other tokens than plain decoding"
    monkeypatch.setenv(BUG, "pause_blocks_forced")
    blocked = target.generate_batch(PROMPTS, per_prompt=per_prompt, **options)
    monkeypatch.delenv(BUG)
    print(f"forced tokens drafted {forced(batch)}, with the pause blocking them {forced(blocked)}")
    assert [r.tokens for r in blocked] == [r.tokens for r in batch]
    assert forced(batch) > forced(blocked)


def test_add_request_with_grammar_speculates(models, grammars):
    """add_request with a grammar and prompt lookup: the request drafts (forced tokens included) and
    its result equals generate() alone; its logprobs (raw logits) are those of generate() too."""
    target, _ = models
    spec = dict(spec_type="ngram-simple", draft_n_max=8)
    ids = {target.add_request(p, max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammars[name], logprobs=2, **spec): k
           for k, (p, name) in enumerate(zip(PROMPTS[:3], NAMES[:3]))}
    done = {}
    while target.has_unfinished_requests:
        for out in target.step():
            if out.finished:
                done[out.request_id] = out.result
    for request_id, k in ids.items():
        r = done[request_id]
        alone = target.generate(PROMPTS[k], max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammars[NAMES[k]],
                                logprobs=2, **spec)
        assert r.tokens == alone.tokens and drafting(r) == drafting(alone)
        assert r.logprobs == alone.logprobs and r.top_logprobs == alone.top_logprobs
        assert r.stats.grammar_forced_tokens > 0 and r.stats.n_drafted > 0


def test_planted_unmasked_rows_are_caught(models, grammars, monkeypatch):
    """DELTASPEC_TEST_GRAMMAR_BUG=verify_unmasked (no verify row masked): the batch's greedy output
    parts from plain constrained decoding, or a forbidden token reaches the grammar (GrammarError).
    Shows that the checks above see unmasked rows, which equal-to-alone alone would not (alone
    would be as wrong)."""
    target, _ = models
    spec = _speculation(models, "draft-model", 0)
    per_prompt = [dict(grammar=grammars[name]) for name in NAMES]
    plain = [target.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, **extra).tokens
             for p, extra in zip(PROMPTS, per_prompt)]
    monkeypatch.setenv(BUG, "verify_unmasked")
    per_prompt = [dict(grammar=grammars[name]) for name in NAMES]  # constraints made with the bug
    try:
        batch = target.generate_batch(PROMPTS, per_prompt=per_prompt, max_tokens=MAX_TOKENS, temperature=0.0, **spec)
    except GrammarError:
        return
    assert [r.tokens for r in batch] != plain
