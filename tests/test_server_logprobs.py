"""The server's `logprobs` and `logit_bias`, driven with the official `openai` client against a server
started here on loopback (as tests/test_server.py does), on the tiny-vocabulary model whose greedy
text never ends by itself.

The claims: a greedy answer's log-probabilities (completions: `logprobs: k`; chat: `logprobs: true,
top_logprobs: k`) are what Model.generate(logprobs=k) gives for the same prompt (the same tokens and
alternatives; values to 1e-5, as a batched verify row may round differently from a decode row), in the
shapes create_completion / create_chat_completion return; a stream's chunks carry the same entries in the
same order, spread over the chunks as their text comes; with speculation the requests still draft.
`logit_bias` changes the answer as generate(logit_bias=...) does. A completion with `echo` and
`logprobs` lists the prompt's tokens first (the first one's null, the others' from a log-softmax
of Model.logits of the prompt written here), then the answer's, streamed or not.

Seen red with bugs planted in the server (DELTASPEC_TEST_SERVER_BUG, which the server inherits):
"logprobs_twice" (a stream's entries sent again at its end) and "bias_ignored" (logit_bias dropped);
and with DELTASPEC_TEST_WRONG_LOGPROB_ROW=next_row (the engine's, csrc/logprobs.h), which fails the
speculating servers' answers; the echo test with prompt_own_row (the engine's prompt entries each
taken for the token before it), which fails the batch servers' (the speculative loop scores the
prompt with deltaspec.logprobs), and with the server's echo_logprobs_dropped (the answer's entries
without the prompt's), which fails all three.
"""

from __future__ import annotations

import numpy as np
import pytest

openai = pytest.importorskip("openai")  # CI installs it with the test extra: never skipped there

from deltaspec import Model
from deltaspec import logprobs as lp
from deltaspec.completions import apply_chat_template
from test_server import TEMPLATE, ServerProcess, files, post  # noqa: F401 (fixture)

N_CTX = 1024
K = 3
N_GEN = 40
PROMPT = "abc abc abc abc abc abc abc"  # repetitive: prompt lookup drafts
CHAT = [{"role": "user", "content": "xyz xyz xyz xyz"}]
SERVERS = {  # how each server decodes: the batch scheduler, with or without a drafter, or generate().
    # The drafter is the model itself (-md, the same file): its greedy drafts are all accepted, so
    # most tokens come from verify rows other than the pending token's
    "batch": (),
    "batch speculative": ("-md", "SELF"),
    "speculative loop": ("-md", "SELF"),
}


@pytest.fixture(scope="module")
def reference(files):
    with Model(files[0], n_ctx=N_CTX, n_threads=1) as m:
        yield m


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request, files):
    flags = [str(files[0]) if f == "SELF" else f for f in SERVERS[request.param]]
    np_ = "1" if request.param == "speculative loop" else "2"
    s = ServerProcess(files[0], "-np", np_, *flags, "-c", str(N_CTX), "--chat-template-file", str(files[1]))
    s.kind = request.param
    yield s
    assert s.stop() == 0, "".join(s.log)


def _expected(reference, prompt: str, k: int, **kw):
    reference.reset()
    r = reference.generate(prompt, temperature=0, max_tokens=N_GEN, logprobs=k, **kw)
    return r, lp.generated_logprobs(reference.tokenizer, r)


def _completion_fields(d: dict) -> dict:
    return {key: d[key] for key in ("tokens", "text_offset", "token_logprobs", "top_logprobs")}


def _near(got, want) -> bool:
    """Equal structures, floats to 1e-5."""
    if isinstance(want, float) and isinstance(got, float):
        return abs(got - want) <= 1e-5
    if isinstance(want, dict):
        return isinstance(got, dict) and set(got) == set(want) and all(_near(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(_near(g, w) for g, w in zip(got, want))
    return got == want


def test_completion_logprobs_equal_generate(server, reference):
    """/v1/completions with logprobs: the non-streamed choice's logprobs are generate()'s in
    create_completion's shape; the stream's chunks, joined, are the same, and (batch scheduler) they
    arrive spread over the stream."""
    r, entries = _expected(reference, PROMPT, K)
    want = lp.completion_logprobs(reference.tokenizer, entries, 0)
    client = server.client()
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N_GEN, temperature=0, logprobs=K)
    assert got.choices[0].text == r.text
    assert _near(_completion_fields(got.choices[0].logprobs.model_dump()), want)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N_GEN, temperature=0, logprobs=K,
                                            stream=True))
    joined = {key: [] for key in want}
    with_entries = 0
    for c in chunks:
        if c.choices[0].logprobs is None:
            continue
        d = _completion_fields(c.choices[0].logprobs.model_dump())
        with_entries += bool(d["tokens"])
        for key in want:
            joined[key] += d[key]
    assert "".join(c.choices[0].text for c in chunks) == r.text
    assert _near(joined, want)
    assert with_entries > 1
    if server.kind != "batch":
        assert server.metrics()["deltaspec_draft_tokens_accepted_total"] > 0, "the server did not speculate"


def _prompt_entries(reference, prompt: str, k: int) -> list:
    """The prompt's (token, logprob, top k) entries, from a log-softmax of its logits written here."""
    ids = reference.tokenize(prompt)
    logits = reference.logits(ids).astype(np.float64)
    logp = logits - (np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1))[:, None]
    return [(ids[0], None, None)] + [
        (ids[i], float(logp[i - 1, ids[i]]), [(t, float(logp[i - 1, t])) for t in np.argsort(-logp[i - 1], kind="stable")[:k]])
        for i in range(1, len(ids))]


def _joined(chunks) -> dict:
    """A completion stream's logprobs fields, its chunks' joined in order."""
    joined = {key: [] for key in ("tokens", "text_offset", "token_logprobs", "top_logprobs")}
    for c in chunks:
        if c.choices[0].logprobs is not None:
            for key, values in _completion_fields(c.choices[0].logprobs.model_dump()).items():
                joined[key] += values
    return joined


def test_completion_echo_with_logprobs(server, reference):
    """echo and logprobs: the prompt's entries, then the answer's, offsets counted from the prompt's
    start; the stream's first chunk is the prompt with its entries."""
    r, entries = _expected(reference, PROMPT, K)
    want = lp.completion_logprobs(reference.tokenizer, _prompt_entries(reference, PROMPT, K) + entries, 0)
    assert want["token_logprobs"][0] is None and len(want["tokens"]) > len(entries) + 5
    client = server.client()
    common = dict(model="tiny", prompt=PROMPT, max_tokens=N_GEN, temperature=0, logprobs=K, echo=True)
    got = client.completions.create(**common)
    assert got.choices[0].text == PROMPT + r.text
    assert _near(_completion_fields(got.choices[0].logprobs.model_dump()), want)
    chunks = list(client.completions.create(stream=True, **common))
    assert chunks[0].choices[0].text == PROMPT
    assert _near(_joined(chunks), want)


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt(server, reference):
    """max_tokens 0 with echo and logprobs (OpenAI's legacy way to score a text): the prompt, its
    entries, no completion tokens, finish_reason "length"; without echo and logprobs a 400."""
    want = lp.completion_logprobs(reference.tokenizer, _prompt_entries(reference, PROMPT, K), 0)
    client = server.client()
    common = dict(model="tiny", prompt=PROMPT, max_tokens=0, temperature=0, logprobs=K, echo=True)
    got = client.completions.create(**common)
    assert got.choices[0].text == PROMPT and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 0
    assert _near(_completion_fields(got.choices[0].logprobs.model_dump()), want)
    chunks = list(client.completions.create(stream=True, **common))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert chunks[-1].choices[0].finish_reason == "length"
    assert _near(_joined(chunks), want)
    for body in (b'{"model": "tiny", "prompt": "hi", "max_tokens": 0}',
                 b'{"model": "tiny", "prompt": "hi", "max_tokens": 0, "echo": true}'):
        status, answer = post(f"{server.url}/v1/completions", body)
        assert status == 400 and answer["error"]["param"] == "max_tokens", answer


def test_chat_logprobs_equal_generate(server, reference):
    """/v1/chat/completions with logprobs and top_logprobs: OpenAI's content list, the entries of
    generate() on the rendered prompt, streamed or not; logprobs: true alone lists no alternatives."""
    prompt = apply_chat_template(reference, CHAT, chat_template=TEMPLATE)
    _, entries = _expected(reference, prompt, K)
    want = lp.chat_logprobs(reference.tokenizer, entries)["content"]
    client = server.client()
    common = dict(model="tiny", messages=CHAT, max_tokens=N_GEN, temperature=0, logprobs=True)
    got = client.chat.completions.create(top_logprobs=K, **common)
    assert _near([c.model_dump() for c in got.choices[0].logprobs.content], want)
    joined = []
    for c in client.chat.completions.create(top_logprobs=K, stream=True, **common):
        if c.choices and c.choices[0].logprobs is not None:
            joined += [e.model_dump() for e in c.choices[0].logprobs.content]
    assert _near(joined, want)
    bare = client.chat.completions.create(**common)
    assert [c.token for c in bare.choices[0].logprobs.content] == [e["token"] for e in want]
    assert all(c.top_logprobs == [] for c in bare.choices[0].logprobs.content)
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None


def test_logit_bias_changes_the_answer_as_generate(files, reference):
    """logit_bias {token id: bias}: the answer is generate(logit_bias=...)'s, and not the unbiased one
    (a bias of 100 on one token makes it win every step)."""
    s = ServerProcess(files[0], "-np", "2", "-c", str(N_CTX))
    try:
        client = s.client()
        token = reference.tokenize("q")[0]
        biased, _ = _expected(reference, PROMPT, 0, logit_bias={token: 100.0})
        plain, _ = _expected(reference, PROMPT, 0)
        assert biased.text != plain.text
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N_GEN, temperature=0,
                                        logit_bias={str(token): 100})
        assert got.choices[0].text == biased.text
    finally:
        assert s.stop() == 0
