"""Prompt-prefix reuse across requests (csrc/slot_history.h): a request whose prompt begins with a
slot's whole kept history (a chat's next turn: the previous prompt and its reply) resumes from that
state and prefills only its new tokens; the answer's usage says how many it skipped
(prompt_tokens_details.cached_tokens, as OpenAI's), and its text is the text of a fresh sequence.

Driven through a server on loopback with the official `openai` client, as tests/test_server.py
does, on the tiny-vocabulary model whose greedy text never ends by itself (so every request runs
exactly max_tokens). Prompts are token ids: the engine matches tokens, and a random model's reply
text (mostly bytes that are not UTF-8) would not tokenize back into the ids it was made of.

Each test was seen to fail with a bug planted in the slot table (DELTASPEC_TEST_SLOT_BUG=NAME in
pytest's environment, which the server inherits); its docstring names the bug.
"""

from __future__ import annotations

import threading

import pytest

openai = pytest.importorskip("openai")  # CI installs it with the test extra: never skipped there

from deltaspec import Model
from deltaspec.testing.tiny_vocab import write_tiny_vocab_model
from test_server import ServerProcess, _never_ends

N_CTX = 512
PARALLEL = 4
N_GEN = 12


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_vocab_model(tmp_path_factory.mktemp("prefix") / "tiny.gguf", seed=0, weight_map=_never_ends)


@pytest.fixture(scope="module")
def reference(model_path):
    with Model(model_path, n_ctx=N_CTX, n_threads=1) as m:
        yield m


@pytest.fixture(scope="module")
def server(model_path):
    s = ServerProcess(model_path, "-np", str(PARALLEL), "-c", str(N_CTX), "--api-key", "test-key")
    yield s
    assert s.stop() == 0, "".join(s.log)


def fresh(reference: Model, prompt: list[int]):
    """Greedy continuation of `prompt` from an empty sequence (reset: the reference Model would
    otherwise resume from its own last generation)."""
    reference.reset()
    r = reference.generate(prompt, max_tokens=N_GEN, temperature=0)
    assert r.stats.cached_tokens == 0 and len(r.tokens) == N_GEN
    return r


def complete(client, prompt: list[int], stream: bool = False) -> tuple[str, int, int]:
    """(text, completion tokens, cached prompt tokens) of one greedy completion."""
    common = dict(model="tiny", prompt=prompt, max_tokens=N_GEN, temperature=0)
    if not stream:
        r = client.completions.create(**common)
        return r.choices[0].text, r.usage.completion_tokens, r.usage.prompt_tokens_details.cached_tokens
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **common))
    usage = chunks[-1].usage
    return ("".join(c.choices[0].text for c in chunks if c.choices), usage.completion_tokens,
            usage.prompt_tokens_details.cached_tokens)


def test_next_turn_resumes_from_its_own_history(server, reference):
    """Two conversations, turn by turn (A1, B1, A2, B2): each second turn resumes from its own first
    turn's state, kept in an idle slot and moved into the running one (B1 took the slot A1 left),
    prefills only its new tokens (cached_tokens = first prompt + reply - 1: the reply's last token
    was never evaluated), and its text equals a fresh sequence's. A prompt that differs inside every
    kept history resumes from none. Seen to fail with no_copy (A2 ran on B1's state) and
    length_only (A2 resumed from B1's history; with the second turns' checks taken out, the last
    prompt resumed from a history it does not begin with)."""
    client = server.client()
    first = {c: reference.tokenize(f"conversation {c}: hello there") for c in "AB"}
    turn1 = {c: fresh(reference, first[c]) for c in "AB"}
    for c in "AB":
        assert complete(client, first[c]) == (turn1[c].text, N_GEN, 0)
    for c, stream in (("A", False), ("B", True)):
        second = first[c] + turn1[c].tokens + reference.tokenize(f" and {c} asks again")
        want = fresh(reference, second)
        assert complete(client, second, stream) == (want.text, N_GEN, len(first[c]) + N_GEN - 1), c
    # the same tokens as A's whole conversation but for one inside the first prompt, and longer than
    # every kept history: nothing may resume
    other = list(first["A"])
    other[2] = (other[2] + 1) % 256
    other += turn1["A"].tokens + reference.tokenize(" and a much longer message than any turn so far")
    assert complete(client, other) == (fresh(reference, other).text, N_GEN, 0)


def test_concurrent_conversations_resume_only_their_own(server, reference):
    """Six clients at once (four slots), three turns each, every turn the previous prompt + reply
    + a new message: every answer equals a fresh sequence's text, whichever slot kept its history
    and whichever other conversation ran beside it, and the server's cached-token counter grew by
    what the answers say they skipped. Which concurrent turns resume depends on timing (a history
    finishing while every slot runs is lost), so that a turn does resume is asserted after the
    concurrent phase, where it does not: one more turn per client, one at a time. The conversation
    the engine finished last had no request waiting for its slot, so its history is kept and its
    next turn resumes; which conversation that was the clients cannot tell (under load the answers
    arrive in another order than the engine finished them), so at least one of these turns must
    resume from its whole kept state. Seen to fail with length_only (turns resumed from other
    clients' histories)."""
    n_clients, n_turns = 6, 3
    prompts = {}
    for c in range(n_clients):  # every turn's prompt and answer, worked out beforehand (one reference Model)
        p = reference.tokenize(f"client {c} " + "says hi " * (c % 3))
        for t in range(n_turns + 1):
            r = fresh(reference, p)
            prompts[c, t] = (p, r.text)
            p = p + r.tokens + reference.tokenize(f" turn {t + 1} of client {c}")
    before = server.metrics()["deltaspec_prompt_tokens_cached_total"]
    client = server.client()
    answers, errors, finished = {}, [], []
    barrier = threading.Barrier(n_clients)

    def conversation(c: int) -> None:
        try:
            barrier.wait()
            for t in range(n_turns):
                answers[c, t] = complete(client, prompts[c, t][0], stream=(c + t) % 2 == 1)
            finished.append(c)  # list.append is atomic: the order the last answers arrived in
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(n_clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    assert all(answers[c, 0][2] == 0 for c in range(n_clients))
    for c in reversed(finished):  # the follow-up turns, latest conversation first
        answers[c, n_turns] = complete(client, prompts[c, n_turns][0])
    wrong = [k for k in prompts if answers[k][:2] != (prompts[k][1], N_GEN)]
    assert not wrong, f"{len(wrong)} of {len(prompts)} turns differ from a fresh sequence, e.g. {wrong[0]}"
    # a kept state: the previous prompt and every reply token but the last (sampled, never fed)
    resumed = [c for c in finished if answers[c, n_turns][2] == len(prompts[c, n_turns - 1][0]) + N_GEN - 1]
    assert resumed, [answers[c, n_turns][2] for c in finished]
    cached = sum(answers[k][2] for k in answers)
    assert server.metrics()["deltaspec_prompt_tokens_cached_total"] - before == cached


def test_a_one_sequence_call_voids_the_kept_histories(model_path):
    """Model.add_request / step keep histories like the server; a one-sequence call in between
    (reset and eval on slot 0: other tokens, as many as the kept history) changes what slot 0 holds,
    so the next request that extends the old history starts fresh and still gets a fresh sequence's
    tokens. Seen to fail with no_forget (it resumed from the state eval() had left)."""
    def run(m: Model, prompt: list[int]):
        rid = m.add_request(prompt, max_tokens=N_GEN, temperature=0)
        while m.has_unfinished_requests:
            done = [o.result for o in m.step() if o.finished and o.request_id == rid]
        return done[0]

    with Model(model_path, n_ctx=N_CTX, n_threads=1, n_seq_max=2) as m:
        first = m.tokenize("a history kept in slot 0")
        r1 = run(m, first)
        second = first + r1.tokens + m.tokenize(" next")
        resumed = run(m, second)
        assert resumed.stats.cached_tokens == len(first) + N_GEN - 1  # the path under test ran
        third = second + resumed.tokens + m.tokenize(" again")
        m.reset()
        m.eval([(t + 7) % 256 for t in second + resumed.tokens[:-1]])  # same length as the kept history
        after = run(m, third)
        assert after.stats.cached_tokens == 0
        m.reset()
        assert after.tokens == m.generate(third, max_tokens=N_GEN, temperature=0).tokens
