"""add_request(prompt_logprobs=True): the scheduler scores a request's prompt (a completion's echo
with logprobs, what evaluation harnesses ask a server for).

The claims: each prompt token's entry is its log-probability given the tokens before it and the k
most probable tokens there, as a log-softmax written here computes them from Model.logits of the
whole prompt (to 1e-5: the engine rounds once to float), the first token's None; for several
requests at once, prompts split over steps by the prefill budget and prompts longer than a
micro-batch or than the 128 rows scored at a time; a prompt that extends a kept history is scored whole (nothing resumed); the entries
come in the RequestOutput of the step that completes the prompt and in the result; the tokens
after the prompt are generate()'s. max_tokens=0 scores the prompt alone (no token, "length"), and
a later request extending that prompt resumes from the state it left. Bad arguments raise.

Seen red with DELTASPEC_TEST_WRONG_LOGPROB_ROW=prompt_own_row (csrc/logprobs.h: each prompt token's
entry taken for the token before it): test_planted_own_row_is_caught runs the check with it.
"""

from __future__ import annotations

import numpy as np
import pytest

from deltaspec import Model
from test_server import _never_ends, write_tiny_vocab_model

K = 3
PROMPTS = ["abc abc abc abc", "hello world, this is a test of the scoring of prompts", "x",
           "the quick brown fox jumps over the lazy dog, twice: the quick brown fox jumps"]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_vocab_model(tmp_path_factory.mktemp("prompt_lp") / "tiny.gguf", seed=0, weight_map=_never_ends)


def reference_entries(model: Model, ids: list[int], k: int, pieces: int = 0) -> list:
    """(token, logprob, top k) of each prompt token from the logits of one evaluation of the prompt
    (pieces > 0: of evaluations of that many tokens at a time, as a prefill budget feeds it)."""
    if pieces:
        model.reset()
        logits = np.concatenate([model.eval(ids[i:i + pieces], logits="all") for i in range(0, len(ids), pieces)])
    else:
        logits = model.logits(ids)
    logits = logits.astype(np.float64)
    logp = logits - (np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1))[:, None]
    out = [(ids[0], None, None)]
    for i in range(1, len(ids)):
        row = logp[i - 1]
        top = sorted(range(len(row)), key=lambda t: (-row[t], t))[:k]
        out.append((ids[i], float(row[ids[i]]), [(t, float(row[t])) for t in top]))
    return out


def assert_entries_equal(got: list, want: list) -> None:
    assert [g[0] for g in got] == [w[0] for w in want]
    assert got[0][1] is None and got[0][2] is None
    for (token, lp, top), (_, wlp, wtop) in zip(got[1:], want[1:]):
        assert abs(lp - wlp) <= 1e-5, (token, lp, wlp)
        assert [t for t, _ in top] == [t for t, _ in wtop]
        assert max(abs(a - b) for (_, a), (_, b) in zip(top, wtop)) <= 1e-5


def run_scored(model: Model, prompts: list[list[int]], max_tokens: int = 6, **kw) -> tuple[dict, dict]:
    """Every request's result and the prompt entries of the step that completed its prompt."""
    ids = [model.add_request(p, temperature=0, max_tokens=max_tokens, logprobs=K, prompt_logprobs=True, **kw)
           for p in prompts]
    results, at_step = {}, {}
    while model.has_unfinished_requests:
        for out in model.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in at_step and (out.tokens or out.finished), "entries once, with the first token (or the finish)"
                at_step[out.request_id] = out.prompt_logprobs
            if out.finished:
                results[out.request_id] = out.result
    return [results[i] for i in ids], [at_step[i] for i in ids]


@pytest.mark.parametrize("n_ubatch", [512, 8])
def test_prompt_entries_equal_a_log_softmax_of_the_logits(path, n_ubatch):
    """Four prompts at once (two slots: they queue), whole or in micro-batches of 8 rows."""
    with Model(path, n_ctx=512, n_threads=2, n_seq_max=2, n_ubatch=n_ubatch) as m:
        prompts = [m.tokenize(t) for t in PROMPTS]
        want = [reference_entries(m, p, K) for p in prompts]
        greedy = []
        for p in prompts:
            m.reset()
            greedy.append(m.generate(p, temperature=0, max_tokens=6, logprobs=K))
        results, at_step = run_scored(m, prompts)
    for r, s, w, g in zip(results, at_step, want, greedy):
        assert_entries_equal(r.prompt_logprobs, w)
        assert s == r.prompt_logprobs
        assert r.tokens == g.tokens
        assert max(abs(a - b) for a, b in zip(r.logprobs, g.logprobs)) <= 1e-5
        assert r.stats.cached_tokens == 0


def test_a_prompt_split_by_the_prefill_budget(path):
    """A prefill budget of 7: the prompt is fed 7 tokens a step while another request decodes, and
    its entries are those of evaluations of 7 tokens at a time."""
    with Model(path, n_ctx=512, n_threads=2, n_seq_max=2) as m:
        prompt = m.tokenize(PROMPTS[3])
        want = reference_entries(m, prompt, K, pieces=7)
        m.set_prefill_budget(7)
        other = m.add_request("abc", temperature=0, max_tokens=40)
        m.step()  # the other request runs: the scored prompt is fed beside its decoding
        (r,), (at_step,) = run_scored(m, [prompt])
        m.cancel_request(other)
    assert len(prompt) > 3 * 7
    assert_entries_equal(r.prompt_logprobs, want)
    assert at_step == r.prompt_logprobs


def test_a_long_prompt_is_scored_128_rows_at_a_time(path):
    """A prompt of 300 tokens at n_ubatch 512: its entries are those of evaluations of 128 tokens at
    a time (the scheduler's bound on the logits it holds)."""
    with Model(path, n_ctx=512, n_threads=2) as m:
        prompt = (m.tokenize(PROMPTS[3] + " ") * 20)[:300]
        want = reference_entries(m, prompt, K, pieces=128)
        (r,), _ = run_scored(m, [prompt], max_tokens=2)
    assert len(prompt) == 300
    assert_entries_equal(r.prompt_logprobs, want)


def test_the_python_scorer_agrees_on_a_long_prompt(path):
    """deltaspec.logprobs.prompt_logprobs (create_completion's echo with logprobs, the one-request
    server's) scores 128 rows at a time too: on a 300-token prompt its entries are the scheduler's
    (a whole-prompt evaluation differs from either by about 1e-3 on this model: seen red with
    SCORED_ROWS set to 1000)."""
    from deltaspec import logprobs as lp

    with Model(path, n_ctx=512, n_threads=2) as m:
        prompt = (m.tokenize(PROMPTS[3] + " ") * 20)[:300]
        python = lp.prompt_logprobs(m, prompt, K)
        (r,), _ = run_scored(m, [prompt], max_tokens=1)
    assert_entries_equal(python, r.prompt_logprobs)


def test_a_prompt_that_extends_a_kept_history_is_scored_whole(path):
    """The second request's prompt begins with the first's prompt and output: a plain request
    resumes there (cached tokens), a scored one evaluates and scores every token."""
    with Model(path, n_ctx=512, n_threads=2, n_seq_max=2) as m:
        first = m.tokenize(PROMPTS[1])
        rid = m.add_request(first, temperature=0, max_tokens=5)
        while m.has_unfinished_requests:
            done = [o.result for o in m.step() if o.finished and o.request_id == rid] or None
        second = first + done[0].tokens + m.tokenize(" and more")
        plain = m.add_request(second, temperature=0, max_tokens=3)
        while m.has_unfinished_requests:
            resumed = [o.result for o in m.step() if o.finished and o.request_id == plain] or None
        assert resumed[0].stats.cached_tokens > 0, "the plain request did not resume: nothing was tested"
        (scored,), _ = run_scored(m, [second], max_tokens=3)
        assert scored.stats.cached_tokens == 0
        want = reference_entries(m, second, K)
    assert_entries_equal(scored.prompt_logprobs, want)


def test_max_tokens_0_scores_the_prompt_alone(path):
    """No token; the slot keeps the scored prompt's state, which a plain request extending the prompt
    resumes (its tokens are generate()'s)."""
    with Model(path, n_ctx=512, n_threads=2, n_seq_max=2) as m:
        prompt = m.tokenize(PROMPTS[1])
        longer = prompt + m.tokenize(" and then")
        m.reset()
        greedy = m.generate(longer, temperature=0, max_tokens=6)
        want = reference_entries(m, prompt, K)
        (r,), (at_step,) = run_scored(m, [prompt], max_tokens=0)
        assert r.tokens == [] and r.text == "" and r.finish_reason == "length"
        assert_entries_equal(r.prompt_logprobs, want)
        assert at_step == r.prompt_logprobs
        rid = m.add_request(longer, temperature=0, max_tokens=6)
        while m.has_unfinished_requests:
            resumed = [o.result for o in m.step() if o.finished and o.request_id == rid] or None
    assert resumed[0].stats.cached_tokens == len(prompt)
    assert resumed[0].tokens == greedy.tokens


def test_bad_arguments(path):
    with Model(path, n_ctx=256, n_threads=1) as m:
        with pytest.raises(ValueError, match="prompt_logprobs=True needs logprobs"):
            m.add_request("abc", max_tokens=2, prompt_logprobs=True)
        with pytest.raises(ValueError, match="0 only with prompt_logprobs"):
            m.add_request("abc", max_tokens=0, logprobs=1)
        with pytest.raises(TypeError, match="prompt_logprobs"):
            m.add_request("abc", max_tokens=2, logprobs=1, prompt_logprobs="yes")
        assert not m.has_unfinished_requests


def test_planted_own_row_is_caught(path, monkeypatch):
    """With each prompt token's entry taken for the token before it, the check above fails."""
    monkeypatch.setenv("DELTASPEC_TEST_WRONG_LOGPROB_ROW", "prompt_own_row")
    with Model(path, n_ctx=256, n_threads=2) as m:
        prompt = m.tokenize(PROMPTS[0])
        want = reference_entries(m, prompt, K)
        (r,), _ = run_scored(m, [prompt])
    with pytest.raises(AssertionError):
        assert_entries_equal(r.prompt_logprobs, want)
