"""Structured output: grammars and JSON schemas enforced while decoding, with and without speculation.

The tiny models have random weights, so what they write unconstrained is byte soup: every output
here that parses and validates (jsonschema, an implementation independent of llguidance) does so
because the constraint held at every token. Greedy speculative output must be token-identical to
plain constrained output (drafts the grammar forbids cut, verify rows masked as plain decoding
masks them); sampled speculative output cannot be identical (rejection sampling draws from the
sampler's stream differently, with or without a grammar), so it is held to validity, to
reproducibility per seed, and to the plain constrained distribution (chi-square against exact
marginals).

Planted bugs (DELTASPEC_TEST_GRAMMAR_BUG, csrc/token_constraint.h) are run by the tests below and
must turn them red: "verify_unmasked" (verify rows not masked), "no_cut" (forbidden drafts
verified), "drop_rejected" (a sampled draft cut before its first forbidden token, which skews the
distribution); a constraint whose masks allow everything stands for a plain loop that skips the mask.
"""

import json
import os

import jsonschema
import numpy as np
import pytest

from deltaspec import Grammar, Model
from deltaspec.constraint import GrammarConstraint
from deltaspec.errors import GrammarError
from deltaspec.testing.json_schemas import BOUNDED_SCHEMAS
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path, write_tiny_vocab_model
from sampling_reference import chi_square_p, expected_probs

BUG = "DELTASPEC_TEST_GRAMMAR_BUG"
MAX_TOKENS = 400  # the tiny vocabulary spells JSON a byte a token; every schema below ends well within it

SCHEMAS = BOUNDED_SCHEMAS
PROMPTS = ["Hello", "the cat sat", "{"]
SEEDS = (0, 1, 2)
SAMPLED = dict(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target; a second load of it (self-draft: accepted where the grammar allows its argmax);
    an unrelated random model (drafts the grammar mostly forbids); a sharper copy of the target
    (the sampled-draft distribution test)."""
    root = tmp_path_factory.mktemp("structured")
    write_tiny_vocab_model(root / "random.gguf", seed=1)
    scale = {"blk.1.ffn_down.weight": 2.0, "output.weight": 2.0}
    write_tiny_vocab_model(root / "sharp.gguf", seed=0, weight_map=lambda name, x: x * scale.get(name, 1.0))
    kw = dict(n_ctx=512, n_threads=1, progress=False)
    loaded = {"target": Model(tiny_vocab_model_path(), **kw), "self": Model(tiny_vocab_model_path(), **kw),
              "random": Model(root / "random.gguf", **kw), "sharp": Model(root / "sharp.gguf", **kw)}
    yield loaded
    for m in loaded.values():
        m.close()


@pytest.fixture(scope="module")
def grammars():
    return {name: Grammar.from_json_schema(schema) for name, schema in SCHEMAS.items()}


def _spec(models, drafter: str) -> dict:
    if drafter == "none":
        return {}
    if drafter == "ngram":
        return dict(spec_type="ngram-simple", draft_n_max=8)
    return dict(draft_model=models[drafter], draft_n_max=8)


def _valid(result, schema: dict):
    """The output is a complete document (ended by the grammar, not by max_tokens) that validates."""
    assert result.finish_reason == "stop", (result.finish_reason, result.text)
    value = json.loads(result.text)
    jsonschema.validate(value, schema)
    assert result.stats.grammar_masked_rows >= 1
    return value


@pytest.mark.parametrize("drafter", ["none", "ngram", "self", "random"])
def test_every_output_validates(models, grammars, drafter):
    """Greedy and sampled (3 seeds), every schema and prompt, plain and with each drafter: every
    output is JSON that validates against its schema. Unconstrained the same calls give no JSON
    at all (checked). Seen red with DELTASPEC_TEST_GRAMMAR_BUG=verify_unmasked (the drafters:
    GrammarError, a forbidden token reached commit) and with masks that allow everything
    (test_planted_bugs_are_caught)."""
    target, spec = models["target"], _spec(models, drafter)
    n = rows = 0
    for name, schema in SCHEMAS.items():
        for prompt in PROMPTS:
            for sampling in [dict(temperature=0.0)] + [dict(SAMPLED, seed=s) for s in SEEDS]:
                r = target.generate(prompt, max_tokens=MAX_TOKENS, grammar=grammars[name], **sampling, **spec)
                _valid(r, schema)
                rows += r.stats.grammar_masked_rows
                n += 1
    assert rows >= n
    unconstrained = target.generate(PROMPTS[0], max_tokens=64, temperature=0.0, **spec).text
    with pytest.raises(ValueError):
        json.loads(unconstrained)


@pytest.mark.parametrize("drafter", ["ngram", "self", "random"])
def test_greedy_speculative_equals_plain(models, grammars, drafter):
    """Greedy constrained decoding with speculation is token-identical to plain greedy constrained
    decoding, for every schema and prompt. Drafts are proposed (and for ngram / self also
    accepted, so verify rows past the first decide tokens). Seen red with
    DELTASPEC_TEST_GRAMMAR_BUG=verify_unmasked (test_planted_bugs_are_caught)."""
    target, spec = models["target"], _spec(models, drafter)
    drafted = accepted = 0
    for name in SCHEMAS:
        for prompt in PROMPTS:
            plain = target.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammars[name])
            fast = target.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammars[name], **spec)
            assert fast.tokens == plain.tokens, (name, prompt, fast.text, plain.text)
            assert fast.finish_reason == plain.finish_reason == "stop"
            drafted += fast.stats.n_drafted
            accepted += fast.stats.n_accepted
    print(f"{drafter}: drafted {drafted}, accepted {accepted}")
    assert drafted > 0
    if drafter != "random":
        assert accepted > 0


def test_forbidden_drafts_are_cut(models, grammars, monkeypatch):
    """A draft model drafting unconstrained (DELTASPEC_DRAFT_IN_GRAMMAR=0; by default it drafts
    within the grammar, test_draft_model_drafts_within_the_grammar) proposes, being random, what
    the grammar mostly forbids: those tokens are cut before verification (grammar_cut_tokens > 0),
    the output is unchanged. With DELTASPEC_TEST_GRAMMAR_BUG=no_cut the count is 0 and more tokens
    are verified for the same output: the assertion on the count is seen to fail there."""
    monkeypatch.setenv("DELTASPEC_DRAFT_IN_GRAMMAR", "0")
    target = models["target"]
    kw = dict(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammars["record"], draft_model=models["random"],
              draft_n_max=8, draft_n_min=2)
    r = target.generate("Hello", **kw)
    _valid(r, SCHEMAS["record"])
    assert r.stats.grammar_cut_tokens > 0
    os.environ[BUG] = "no_cut"
    try:
        uncut = target.generate("Hello", **kw)
    finally:
        del os.environ[BUG]
    assert uncut.stats.grammar_cut_tokens == 0  # the planted bug is what the count above sees
    assert uncut.tokens == r.tokens and uncut.stats.n_drafted > r.stats.n_drafted


KEYED = {"type": "object", "properties": {
    "customer_name": {"type": "string", "maxLength": 8},
    "order_id": {"type": "integer", "minimum": 0, "maximum": 99},
    "express_delivery": {"type": "boolean"}},
    "required": ["customer_name", "order_id", "express_delivery"], "additionalProperties": False}


def _forced_run(models, grammar):
    target = models["target"]
    plain = target.generate("Hello", max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar)
    fast = target.generate("Hello", max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar, spec_type="ngram-simple",
                           draft_n_max=8)
    return plain, fast


def test_forced_tokens_are_drafted(models, monkeypatch):
    """Where the grammar forces the text (a key after its opening quote), those tokens are the
    draft, and every one of them is accepted (the masked target allows only them); greedy output
    is unchanged. Seen red with forced_tokens proposing a wrong token (the acceptance assertion)."""
    grammar = Grammar.from_json_schema(KEYED)
    plain, fast = _forced_run(models, grammar)
    _valid(fast, KEYED)
    assert fast.tokens == plain.tokens
    s = fast.stats
    assert s.grammar_forced_tokens >= len("customer_name" "order_id" "express_delivery") // 2
    assert s.n_accepted >= s.grammar_forced_tokens

    x = models["target"].tokenizer.encode("x")
    monkeypatch.setattr(GrammarConstraint, "forced_tokens", lambda self: x if self._matcher.compute_ff_tokens() else [])
    _, wrong = _forced_run(models, grammar)
    assert wrong.stats.n_accepted < wrong.stats.grammar_forced_tokens


def test_forced_tokens_are_drafted_while_the_drafter_pauses(models, monkeypatch):
    """A drafter that keeps failing (the random draft model; draft_n_min 0, so the loop pauses it)
    does not stop the grammar's forced tokens from being drafted: while the drafter pauses, what
    the grammar forces (the keys) is still the draft, all of it accepted, so the same text takes
    fewer target passes; greedy output is plain constrained greedy's (in a batch:
    test_batch_structured.py). Seen red with DELTASPEC_TEST_GRAMMAR_BUG=
    pause_blocks_forced (the pause stops the forced tokens too: fewer forced tokens drafted, more
    passes), run here."""
    grammar = Grammar.from_json_schema(KEYED)
    target = models["target"]
    plain = target.generate("Hello", max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar)
    kw = dict(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar, draft_model=models["random"], draft_n_max=8)

    def run():
        return target.generate("Hello", **kw)

    fixed = run()
    monkeypatch.setenv(BUG, "pause_blocks_forced")
    blocked = run()
    monkeypatch.delenv(BUG)
    f, b = fixed.stats, blocked.stats
    print(f"forced drafted {f.grammar_forced_tokens} vs {b.grammar_forced_tokens} with the pause blocking them; "
          f"passes {f.n_steps} vs {b.n_steps}; accepted {f.n_accepted} vs {b.n_accepted}")
    assert fixed.tokens == plain.tokens and blocked.tokens == plain.tokens
    assert f.n_accepted >= f.grammar_forced_tokens
    assert f.grammar_forced_tokens > b.grammar_forced_tokens and f.n_steps < b.n_steps


def test_seeded_sampling_is_reproducible(models, grammars):
    """Sampled constrained output with speculation: same seed, same tokens (and valid). Seen red with
    generation.py building no constraint for the request's grammar (the output was free text)."""
    target = models["target"]
    for drafter in ("ngram", "self"):
        kw = dict(max_tokens=MAX_TOKENS, grammar=grammars["lists"], **SAMPLED, **_spec(models, drafter))
        a, b = target.generate("Hello", seed=7, **kw), target.generate("Hello", seed=7, **kw)
        assert a.tokens == b.tokens
        _valid(a, SCHEMAS["lists"])


# --- the sampled speculative distribution ---------------------------------------------------------

N_SEEDS = 600
DIST_PARAMS = dict(temperature=1.0, top_k=8, top_p=1.0, min_p=0.0)
DIST_PROMPT = [72, 101, 108]  # "Hel"


def _ascii_allowed(model: Model) -> np.ndarray:
    """Which tokens `[ -~]*` allows, worked out here without llguidance: normal tokens whose bytes
    are all printable ASCII, and the end-of-generation tokens (the grammar is always complete)."""
    tok = model.tokenizer
    ok = np.array([tok.token_type(i) == 1 and all(32 <= b <= 126 for b in tok.token_to_piece(i))
                   for i in range(model.n_vocab)])
    ok[sorted(tok.eog_ids)] = True
    return ok


def _second_token_marginal(model: Model, allowed: np.ndarray, bias: dict[int, float] | None = None) -> np.ndarray:
    """Exact distribution of the second generated token under plain constrained sampling (with
    the logit_bias `bias`)."""
    def probs(history):
        logits = model.logits(history)[-1].astype(np.float64)
        for token, b in (bias or {}).items():
            logits[token] += b
        logits[~allowed] = -np.inf
        return expected_probs(logits, **DIST_PARAMS)

    first = probs(DIST_PROMPT)
    out = np.zeros(model.n_vocab)
    for t in np.flatnonzero(first):
        if not model.tokenizer.is_eog(int(t)):
            out += first[t] * probs(DIST_PROMPT + [int(t)])
    return out


def _count_second_tokens(run, n_vocab: int) -> tuple[np.ndarray, int, int, int]:
    """Second-token counts over N_SEEDS sampled runs (`run(seed)` -> a GenerationResult of
    DIST_PROMPT); the draft tokens (tree nodes) cut, the drafter rows masked and the tokens drafted,
    summed."""
    counts, cut, draft_rows, drafted = np.zeros(n_vocab), 0, 0, 0
    for seed in range(N_SEEDS):
        r = run(seed)
        cut += r.stats.grammar_cut_tokens
        draft_rows += r.stats.grammar_draft_rows
        drafted += r.stats.n_drafted
        if len(r.tokens) > 1:
            counts[r.tokens[1]] += 1
    return counts, cut, draft_rows, drafted


def _assert_drafted_within_and_exact(count, expected: np.ndarray, bug: str, bug_shows_in: str) -> None:
    """A drafter drafting within the grammar (`count()`: _count_second_tokens of its runs): nothing
    cut, drafter rows masked, tokens drafted, and the second token's exact marginal `expected`
    (chi-square); then with the planted `bug`, red where it shows: in the "distribution" (its p)
    or in the "path" (forbidden drafts cut)."""
    counts, cut, draft_rows, drafted = count()
    assert cut == 0 and draft_rows > 0 and drafted > N_SEEDS
    p_right = chi_square_p(counts, expected)
    os.environ[BUG] = bug
    try:
        planted, planted_cut, *_ = count()
    finally:
        del os.environ[BUG]
    p_planted = chi_square_p(planted, expected)
    print(f"p right {p_right:.3g}, planted {bug}: p {p_planted:.3g}, {planted_cut} cut")
    assert p_right > 1e-3
    if bug_shows_in == "distribution":
        assert p_planted < 1e-3
    else:
        assert planted_cut > 0


def _second_token_counts(models, grammar) -> tuple[np.ndarray, int, int, int]:
    """_count_second_tokens with the sharp draft model."""
    target = models["target"]
    return _count_second_tokens(lambda seed: target.generate(
        DIST_PROMPT, max_tokens=4, seed=seed, grammar=grammar, draft_model=models["sharp"], draft_n_min=1,
        draft_n_max=4, **DIST_PARAMS), target.n_vocab)


@pytest.mark.parametrize("in_grammar", [False, True], ids=["unconstrained", "within-grammar"])
def test_sampled_speculation_keeps_the_constrained_distribution(models, monkeypatch, in_grammar):
    """A sampled draft model (q: a sharper copy of the target) under a grammar that forbids about
    half of what it proposes unconstrained: the second token has the exact marginal of plain
    constrained sampling (chi-square over 600 seeds), the drafter either way:
    * unconstrained (DELTASPEC_DRAFT_IN_GRAMMAR=0): its second draft is often forbidden, and the
      first forbidden sampled draft must be kept for verification to reject (its row then draws
      from norm(max(0, p - q))). Seen red with DELTASPEC_TEST_GRAMMAR_BUG=drop_rejected, which
      draws that row from p instead (measured p-values: right 0.22, planted 5e-5), run here.
    * within the grammar (the default): each draft drawn from the draft's masked row, nothing
      cut, and q (what rejection sampling is told) that masked row's distribution. Seen red with
      draft_q_unmasked, which draws from the masked row but reports the unmasked row's q (about
      half the mass on each allowed token here, so drafts are accepted too often; measured: right
      0.9, planted 8e-23), run here."""
    if not in_grammar:
        monkeypatch.setenv("DELTASPEC_DRAFT_IN_GRAMMAR", "0")
    grammar = Grammar.from_regex(r"[ -~]*")
    expected = _second_token_marginal(models["target"], _ascii_allowed(models["target"]))
    counts, cut, draft_rows, drafted = _second_token_counts(models, grammar)
    if in_grammar:
        assert cut == 0 and draft_rows >= drafted > N_SEEDS  # every draft drawn within the grammar
    else:
        assert cut > 50 and draft_rows == 0  # forbidden drafts were frequent; the drafter drew unconstrained
    p_right = chi_square_p(counts, expected)
    os.environ[BUG] = "draft_q_unmasked" if in_grammar else "drop_rejected"
    try:
        planted, *_ = _second_token_counts(models, grammar)
    finally:
        del os.environ[BUG]
    p_planted = chi_square_p(planted, expected)
    print(f"p right {p_right:.3g}, planted {p_planted:.3g}")
    assert p_right > 1e-3
    assert p_planted < 1e-3


def test_draft_model_drafts_within_the_grammar(models, grammars, monkeypatch):
    """A draft model drafts within the grammar (each draft row masked with the grammar's state
    after the drafts before it): greedy output stays plain constrained greedy's, no draft token is
    cut, and a second load of the target (the self-draft) then proposes exactly what the masked
    target picks, so every draft it makes is accepted; unconstrained (DELTASPEC_DRAFT_IN_GRAMMAR=0)
    its unmasked argmax is mostly forbidden and cut. Seen red with
    DELTASPEC_TEST_GRAMMAR_BUG=draft_unmasked (the draft rows left unmasked: tokens cut), run here."""
    target = models["target"]
    kw = dict(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammars["lists"], draft_n_max=8)
    plain = target.generate("Hello", max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammars["lists"])
    for drafter in ("self", "random"):
        r = target.generate("Hello", draft_model=models[drafter], **kw)
        st = r.stats
        print(f"{drafter}: drafted {st.n_drafted}, accepted {st.n_accepted}, forced {st.grammar_forced_tokens}, "
              f"draft rows {st.grammar_draft_rows}, cut {st.grammar_cut_tokens}, steps {st.n_steps}")
        assert r.tokens == plain.tokens
        assert st.grammar_cut_tokens == 0 and st.grammar_draft_rows > 0
        if drafter == "self":
            assert st.n_accepted == st.n_drafted > st.grammar_forced_tokens
    monkeypatch.setenv("DELTASPEC_DRAFT_IN_GRAMMAR", "0")
    free = target.generate("Hello", draft_model=models["self"], **kw)
    assert free.tokens == plain.tokens and free.stats.grammar_cut_tokens > 0 and free.stats.grammar_draft_rows == 0
    monkeypatch.delenv("DELTASPEC_DRAFT_IN_GRAMMAR")
    monkeypatch.setenv(BUG, "draft_unmasked")
    planted = target.generate("Hello", draft_model=models["self"], **kw)
    assert planted.tokens == plain.tokens and planted.stats.grammar_cut_tokens > 0


# --- the pieces on their own -----------------------------------------------------------------------

def test_verify_rows_and_cuts(models, grammars):
    """The loops' helpers on numpy rows: verify row i is masked with the grammar's state after
    drafts[:i] (the same set a fresh constraint gives after committing them), a deterministic
    draft is cut at its first forbidden token, a sampled one keeps that token for rejection."""
    tok = models["target"].tokenizer
    n_vocab = models["target"].n_vocab
    g = grammars["record"]
    drafts = tok.encode('{"id":')
    c = GrammarConstraint(tok, g)
    rows = np.zeros((len(drafts) + 1, n_vocab), np.float32)
    c.mask_verify_rows(drafts, rows)
    assert c.n_masked_rows == len(drafts) + 1
    for i in range(len(drafts) + 1):
        fresh = GrammarConstraint(tok, g)
        for t in drafts[:i]:
            fresh.commit(t)
        row = np.zeros(n_vocab, np.float32)
        fresh.mask_row(row)
        assert np.array_equal(np.isfinite(rows[i]), np.isfinite(row)), i
    assert set(np.flatnonzero(np.isfinite(rows[0]))) == {tok.encode("{")[0]}
    bad = drafts + tok.encode("x") + drafts
    assert c.cut_draft(bad, sampled=False) == drafts
    assert c.cut_draft(bad, sampled=True) == drafts + tok.encode("x")
    assert c.n_cut_tokens == 2 * len(bad) - 2 * len(drafts) - 1
    with pytest.raises(GrammarError, match="not allowed"):
        c.commit(tok.encode("x")[0])


def test_planted_bugs_are_caught(models, grammars, monkeypatch):
    """The checks above, under the planted bugs: verify rows left unmasked make greedy speculation
    commit a forbidden token (GrammarError) or differ from plain decoding; masks that allow every
    token (the plain loop without its mask) make invalid output (GrammarError or no JSON)."""
    target = models["target"]
    kw = dict(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammars["text"])
    monkeypatch.setenv(BUG, "verify_unmasked")
    caught = 0
    for prompt in PROMPTS:
        plain = target.generate(prompt, **kw)
        try:
            fast = target.generate(prompt, draft_model=models["self"], draft_n_max=8, **kw)
            caught += fast.tokens != plain.tokens
        except GrammarError:
            caught += 1
    assert caught > 0
    monkeypatch.delenv(BUG)

    def allow_all(self, masks, drafts):
        masks[:] = 0xFFFFFFFF

    monkeypatch.setattr(GrammarConstraint, "fill_masks", allow_all)
    with pytest.raises(GrammarError, match="not allowed"):
        target.generate("Hello", **kw)


def test_grammar_formats(models):
    """GBNF (llama.cpp's format, llama-cpp-python's grammar=), Lark, regex and JSON schema given as
    text all constrain: outputs match their grammar exactly (checked with Python's re). Seen red with
    generation.py building no constraint for the request's grammar (the output was free text)."""
    import re

    target = models["target"]
    cases = [
        ('root ::= "yes" | "no" | "maybe"', r"yes|no|maybe"),
        ('root ::= [a-c]+ "-" digit digit\ndigit ::= [0-9]', r"[a-c]+-[0-9][0-9]"),
        ("start: WORD (\",\" WORD)*\nWORD: /[xyz]{1,3}/", r"[xyz]{1,3}(,[xyz]{1,3})*"),
        ("%llguidance {}\nstart: \"<\" /[0-9]+/ \">\"", r"<[0-9]+>"),
    ]
    for text, pattern in cases:
        for sampling in (dict(temperature=0.0), dict(SAMPLED, seed=3)):
            for spec in ({}, dict(spec_type="ngram-simple")):
                r = target.generate("Hello", max_tokens=60, grammar=text, **sampling, **spec)
                assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), (text, r.text)
    r = target.generate("Hello", max_tokens=60, temperature=0.0, grammar=Grammar.from_regex(r"[0-9]{3}-[a-f]{2}"))
    assert re.fullmatch(r"[0-9]{3}-[a-f]{2}", r.text)
    compact = {**SCHEMAS["record"], "x-guidance": {"whitespace_flexible": False}}  # the schema's own whitespace
    r = target.generate("Hello", max_tokens=MAX_TOKENS, temperature=0.0, grammar=Grammar.from_json_schema(compact))
    assert r.text == json.dumps(_valid(r, SCHEMAS["record"]), separators=(",", ":"))


def test_concurrent_sequences(tmp_path, grammars):
    """generate_batch and add_request / step with a grammar per request (the scheduler's batched
    decode masks each sequence's row with its own grammar): each result validates and equals
    generate() of that prompt alone, greedy and seeded. Seen red with masks that allow everything
    (GrammarError, as in test_planted_bugs_are_caught) and with the per-request constraint not
    passed to the scheduler (outputs were no JSON)."""
    names = list(SCHEMAS)
    per_prompt = [dict(grammar=grammars[name], seed=i) for i, name in enumerate(names)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    with Model(tiny_vocab_model_path(), n_ctx=512, n_threads=1, n_seq_max=3, progress=False) as m:
        for sampling in (dict(temperature=0.0), SAMPLED):
            batch = m.generate_batch(prompts, per_prompt=per_prompt, max_tokens=MAX_TOKENS, **sampling)
            for prompt, extra, name, r in zip(prompts, per_prompt, names, batch):
                _valid(r, SCHEMAS[name])
                alone = m.generate(prompt, max_tokens=MAX_TOKENS, **{**sampling, **extra})
                assert r.tokens == alone.tokens, name
        ids = {m.add_request(p, max_tokens=MAX_TOKENS, temperature=0.0, **extra): name
               for p, extra, name in zip(prompts, per_prompt, names)}
        done = {}
        while m.has_unfinished_requests:
            for out in m.step():
                if out.finished:
                    done[out.request_id] = out.result
        assert set(done) == set(ids)
        for request_id, name in ids.items():
            _valid(done[request_id], SCHEMAS[name])


def test_completion_and_stream(models):
    """create_completion(grammar=...) and streaming: the streamed text equals the result's text, and
    both validate. Seen red with generation.py building no constraint for the request's grammar."""
    target = models["target"]
    out = target.create_completion("Hello", max_tokens=MAX_TOKENS, temperature=0.0,
                                   grammar=Grammar.from_json_schema(SCHEMAS["record"]))
    jsonschema.validate(json.loads(out["choices"][0]["text"]), SCHEMAS["record"])
    stream = target.generate("Hello", max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                             grammar=Grammar.from_json_schema(SCHEMAS["lists"]), spec_type="ngram-simple")
    text = "".join(stream)
    assert text == stream.result.text
    jsonschema.validate(json.loads(text), SCHEMAS["lists"])


def test_chat_response_format_real_vocabulary(chat_gguf):
    """create_chat_completion(response_format=...) on the real 248k vocabulary with Qwen3.5's chat
    template: json_schema and json_object, plain, streamed and speculative; the message content
    validates (thinking is switched off for a constrained reply). Seen red with generation.py building
    no constraint for the request's grammar."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Answer in JSON."}]
    with Model(chat_gguf, n_ctx=1024, n_threads=1, progress=False) as m:
        r = m.create_chat_completion(messages, response_format=fmt, temperature=0.0, max_tokens=300)
        content = r["choices"][0]["message"]["content"]
        assert r["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(content), schema)
        chunks = m.create_chat_completion(messages, response_format=fmt, temperature=0.0, max_tokens=300,
                                          stream=True)
        streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert streamed == content
        spec = m.create_chat_completion(messages, response_format=fmt, temperature=0.0, max_tokens=300,
                                        spec_type="ngram-simple")
        assert spec["choices"][0]["message"]["content"] == content
        obj = m.create_chat_completion(messages, response_format={"type": "json_object"}, temperature=0.0,
                                       max_tokens=60)
        text = obj["choices"][0]["message"]["content"]
        assert text.lstrip().startswith("{")
        if obj["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)


def test_json_object_response_format_sampled_and_speculative(chat_gguf):
    """response_format {"type": "json_object"}, with llama-cpp-python's "schema" and without, greedy,
    sampled (3 seeds) and with n-gram speculation (drafts verified): every finished reply validates
    (against the schema, or as a JSON object), and the schema-bound replies all finish. Seen red with
    response_format_grammar ignoring json_object's "schema" (the replies were JSON objects with other
    keys) and with the speculative call ignoring response_format (free text)."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                               "ok": {"type": "boolean"}},
              "required": ["answer", "ok"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Say yes in JSON. yes yes yes"}]
    runs = [dict(temperature=0.0)] + [dict(temperature=1.0, seed=s) for s in (1, 2, 3)] + \
        [dict(temperature=0.0, spec_type="ngram-simple", draft_n_max=4, draft_n_min=1),
         dict(temperature=1.0, seed=4, spec_type="ngram-simple", draft_n_max=4, draft_n_min=1)]
    with Model(chat_gguf, n_ctx=1024, n_threads=1, progress=False) as m:
        for kw in runs:
            with_schema = m.create_chat_completion(messages, response_format={"type": "json_object", "schema": schema},
                                                   max_tokens=200, **kw)
            choice = with_schema["choices"][0]
            assert choice["finish_reason"] == "stop", (kw, choice)
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            free = m.create_chat_completion(messages, response_format={"type": "json_object"}, max_tokens=60, **kw)
            text = free["choices"][0]["message"]["content"]
            assert text.lstrip().startswith("{"), (kw, text)
            if free["choices"][0]["finish_reason"] == "stop":
                assert isinstance(json.loads(text), dict)
        # the speculative path ran: drafts were verified under the grammar (here the tokens the grammar
        # forces, which are drafted as a speculative round's draft)
        r = m.generate(m.apply_chat_template(messages, enable_thinking=False), max_tokens=200, temperature=0.0,
                       grammar=Grammar.from_json_schema(schema), spec_type="ngram-simple", draft_n_max=4, draft_n_min=1)
        jsonschema.validate(json.loads(r.text), schema)
        assert r.stats.n_drafted > 0


def test_bad_grammar_input(models, tmp_path):
    """Bad grammars, schemas and response formats raise GrammarError / ValueError naming the problem."""
    target = models["target"]
    with pytest.raises(GrammarError, match="nope"):
        Grammar.from_string('root ::= "a" | nope')
    with pytest.raises(GrammarError, match="objectx"):
        Grammar.from_json_schema({"type": "objectx"})
    with pytest.raises(GrammarError, match="not valid JSON"):
        Grammar.from_json_schema("{type: object}")
    with pytest.raises(GrammarError, match="regex"):
        Grammar.from_regex("a(")
    with pytest.raises(GrammarError, match="cannot read grammar file"):
        Grammar.from_file(tmp_path / "missing.gbnf")
    with pytest.raises(TypeError, match="grammar must be"):
        target.generate("Hello", grammar=42)
    with pytest.raises(GrammarError, match="response_format type"):
        target.create_chat_completion([{"role": "user", "content": "x"}], response_format={"type": "xml"})
    with pytest.raises(GrammarError, match="json_schema"):
        target.create_chat_completion([{"role": "user", "content": "x"}], response_format={"type": "json_schema"})
    with pytest.raises(ValueError, match="either response_format or grammar"):
        target.create_chat_completion([{"role": "user", "content": "x"}], response_format={"type": "json_object"},
                                      grammar='root ::= "a"')
    with pytest.raises(ValueError, match="tree_budget"):  # with a grammar too (trees + grammars: test_structured_tree.py)
        target.generate("Hello", grammar='root ::= "a"', spec_type="ngram-simple", tree_budget=-1)
    with pytest.raises(ValueError, match="DELTASPEC_TEST_GRAMMAR_BUG"):
        os.environ[BUG] = "bogus"
        try:
            target.generate("Hello", grammar='root ::= "a"')
        finally:
            del os.environ[BUG]


def test_cli_grammar_flags(tmp_path, capsys):
    """llama.cpp's --grammar, --grammar-file, -j and -jf: output matches; two at once, or a bad
    grammar, is a one-line error naming the flag. Seen red with generation.py building no constraint
    for the request's grammar (the output was no JSON)."""
    from deltaspec import cli

    base = ["run", "-m", str(tiny_vocab_model_path()), "-p", "Hello", "--temp", "0", "-n", "400", "-c", "512",
            "-t", "1", "--no-display-prompt", "--log-disable"]
    schema = json.dumps(SCHEMAS["record"])
    (tmp_path / "s.json").write_text(schema)
    (tmp_path / "g.gbnf").write_text('root ::= "yes" | "no"\n')
    for flags in (["-j", schema], ["-jf", str(tmp_path / "s.json")]):
        assert cli.main(base + flags) == 0
        jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMAS["record"])
    for flags in (["--grammar", 'root ::= "yes" | "no"'], ["--grammar-file", str(tmp_path / "g.gbnf")]):
        assert cli.main(base + flags) == 0
        assert capsys.readouterr().out.strip() in ("yes", "no")
    assert cli.main(base + ["--grammar", 'root ::= nope']) == 2
    assert "--grammar: invalid grammar" in capsys.readouterr().err
    assert cli.main(base + ["-j", schema, "--grammar", 'root ::= "a"']) == 2
    assert "give one grammar or JSON schema" in capsys.readouterr().err
