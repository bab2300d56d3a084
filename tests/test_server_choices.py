"""The server's `n` (several choices for one request) and a completion's `echo`, driven with the official `openai` client
against a server started here on loopback (as tests/test_server.py does), on the tiny-vocabulary
model whose greedy text never ends by itself.

The claims: with a seed, choice i of a sampled request is Model.generate(seed=seed + i)'s text (so
the choices differ and an answer can be reproduced), streamed or not, in completions and chat; each
choice has its index and finish reason; the usage counts the prompt once and every choice's tokens;
a stream's chunks share one id, carry their choice's index, and end with one usage chunk and
[DONE]; with a server of one slot the choices run one after another and still all come back;
`n` out of [1, 16] is a 400 naming it. An array of prompts (texts or token ids) gets n choices per
prompt, prompt i's at indices i * n ..., each its prompt's answer (with its own echo), streamed or
not, the usage counting each prompt once; more than 64 requests in all is a 400. `echo` puts the prompt (as sent, or its token ids' text) before
each choice's text, streamed or not; echo in a chat is a 400 (echo with logprobs: test_server_logprobs.py).

Seen red with bugs planted in the server (DELTASPEC_TEST_SERVER_BUG): choices_same_seed (every
choice samples with the request's seed, so they are all choice 0), echo_dropped (echo ignored) and
first_prompt_only (every choice answers the first prompt).
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")  # CI installs it with the test extra: never skipped there

from deltaspec import Model
from deltaspec.chat import split_reasoning
from deltaspec.completions import apply_chat_template
from test_server import TEMPLATE, ServerProcess, files, post  # noqa: F401 (fixture)

N_CTX = 1024
N = 3
SEED = 1234
N_GEN = 24
PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "tell me more"}]


@pytest.fixture(scope="module")
def reference(files):
    with Model(files[0], n_ctx=N_CTX, n_threads=1) as m:
        yield m


@pytest.fixture(scope="module", params=["parallel 4", "parallel 1"])
def server(request, files):
    np_ = "4" if request.param == "parallel 4" else "1"
    s = ServerProcess(files[0], "-np", np_, "-c", str(N_CTX), "--chat-template-file", str(files[1]))
    yield s
    assert s.stop() == 0, "".join(s.log)


def expected(reference, prompt: str) -> list[tuple[str, int]]:
    """(text, tokens) of each choice: generate() with seed + i."""
    out = []
    for i in range(N):
        r = reference.generate(prompt, max_tokens=N_GEN, temperature=1.0, seed=SEED + i)
        out.append((r.text, r.stats.generated_tokens))
    return out


def test_completion_choices(server, reference):
    want = expected(reference, PROMPT)
    assert len({text for text, _ in want}) == N  # the seeds give different texts: the check can tell them apart
    client = server.client()
    common = dict(model="tiny", prompt=PROMPT, max_tokens=N_GEN, temperature=1.0, seed=SEED, n=N)
    r = client.completions.create(**common)
    assert [c.index for c in r.choices] == list(range(N))
    assert [c.text for c in r.choices] == [text for text, _ in want]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == sum(n for _, n in want)
    assert r.usage.prompt_tokens == len(reference.tokenize(PROMPT))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **common))
    assert len({c.id for c in chunks}) == 1
    texts, finishes = [""] * N, [None] * N
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.text
        finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [text for text, _ in want] and finishes == ["length"] * N
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_choices(server, reference):
    prompt = apply_chat_template(reference, CHAT, chat_template=TEMPLATE)
    want = [split_reasoning(text)[1] for text, _ in expected(reference, prompt)]
    client = server.client()
    common = dict(model="tiny", messages=CHAT, max_tokens=N_GEN, temperature=1.0, seed=SEED, n=N)
    r = client.chat.completions.create(**common)
    assert [c.index for c in r.choices] == list(range(N))
    assert [c.message.content for c in r.choices] == want
    chunks = list(client.chat.completions.create(stream=True, **common))
    texts, roles = [""] * N, [0] * N
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
    assert texts == want and roles == [1] * N


def test_n_out_of_range_is_a_400(server):
    for n in (0, 17, "two"):
        status, body = post(f"{server.url}/v1/completions", f'{{"model": "tiny", "prompt": "hi", "n": {n!r}}}'
                            .replace("'", '"').encode())
        assert status == 400 and body["error"]["param"] == "n", (n, body)


def test_completion_echo(server, reference):
    client = server.client()
    want = reference.generate(PROMPT, max_tokens=10, temperature=0).text
    ids = reference.tokenize(PROMPT)
    for prompt, shown in ((PROMPT, PROMPT), (ids, reference.detokenize(ids))):
        common = dict(model="tiny", prompt=prompt, max_tokens=10, temperature=0, echo=True, n=2)
        r = client.completions.create(**common)
        assert [c.text for c in r.choices] == [shown + want] * 2
        texts = ["", ""]
        for c in client.completions.create(stream=True, **common):
            for choice in c.choices:
                texts[choice.index] += choice.text
        assert texts == [shown + want] * 2
    status, body = post(f"{server.url}/v1/chat/completions",
                        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "echo": true}')
    assert status == 400 and body["error"]["param"] == "echo"


def test_an_array_of_prompts(server, reference):
    client = server.client()
    prompts = [PROMPT, "xyz xyz", reference.tokenize("hello there")]
    texts = [p if isinstance(p, str) else reference.detokenize(p) for p in prompts]
    want = [reference.generate(p, max_tokens=8, temperature=0).text for p in prompts]
    assert len(set(want)) == len(want), "the prompts must have different answers"
    n_prompt = [len(p) if isinstance(p, list) else len(reference.tokenize(p)) for p in prompts]
    common = dict(model="tiny", prompt=prompts, max_tokens=8, temperature=0, n=2, echo=True)
    r = client.completions.create(**common)
    assert [(c.index, c.text) for c in r.choices] == [(i, texts[i // 2] + want[i // 2]) for i in range(6)]
    assert r.usage.prompt_tokens == sum(n_prompt)
    assert r.usage.completion_tokens == 6 * 8
    streamed = [""] * 6
    for c in client.completions.create(stream=True, **common):
        for choice in c.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in r.choices]
    status, body = post(f"{server.url}/v1/completions",
                        ('{"model": "tiny", "prompt": [' + ", ".join(['"a"'] * 33) + '], "n": 2}').encode())
    assert status == 400 and body["error"]["param"] == "n", body
    status, body = post(f"{server.url}/v1/completions",
                        ('{"model": "tiny", "prompt": [' + ", ".join(['"a"'] * 65) + ']}').encode())
    assert status == 400 and body["error"]["param"] == "prompt", body
    status, body = post(f"{server.url}/v1/completions", b'{"model": "tiny", "prompt": ["a", []]}')
    assert status == 400 and body["error"]["param"] == "prompt", body
