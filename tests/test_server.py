"""`deltaspec serve` end to end: a server started here on loopback with the tiny-vocabulary model,
driven with the official `openai` client (and raw HTTP where a client would never send the bytes).

The claims: greedy completions and chat completions, streamed or not, give exactly the text of
Model.generate() on the same file (the batch scheduler's rows are bitwise the single-sequence rows
on the CPU with this F32 model, see tests/test_batch.py), also with 50 clients at once; a client
that disconnects cancels its request and frees its slot; bad requests get 4xx JSON errors while the
server keeps serving; a full queue answers 429; SIGTERM lets running requests finish and exits 0;
memory stays flat over many requests; speculation is served at --parallel 1 and batched at --parallel N.

Each test was seen to fail with a bug planted in the server (DELTASPEC_TEST_SERVER_BUG=NAME in the
environment of pytest, which the server inherits; see deltaspec/server/planted.py); its docstring
names the bug.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import numpy as np
import pytest

# the GPU machine collects this file for its gpu-marked tests (none here) without the client;
# CI installs it with the test extra, so this never skips there
openai = pytest.importorskip("openai")

from deltaspec import Model
from deltaspec.chat import split_reasoning
from deltaspec.completions import apply_chat_template
from deltaspec.testing.tiny_vocab import CONTROL_TOKENS, MIN_VOCAB, tiny_vocab, write_tiny_vocab_model

N_CTX = 8192  # long enough that a greedy request of N_CTX - 100 tokens outlasts any disconnect
TINY_TOKENS = tiny_vocab(MIN_VOCAB)[0]
PARALLEL = 4
API_KEY = "test-key"
START_TIMEOUT = 60
# ChatML, as Qwen's templates render a conversation without tools or thinking
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ServerProcess:
    """`python -m deltaspec.server` on 127.0.0.1 with a free port; stopped with SIGTERM."""

    def __init__(self, model: Path, *flags: str, wait: bool = True):
        self.proc = subprocess.Popen([sys.executable, "-m", "deltaspec.server", "-m", str(model), "--port", "0",
                                      "-t", "1", "--log-level", "warning", *flags],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.log: list[str] = []
        self.url = None
        if wait:
            self.wait_listening()

    def wait_listening(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while self.url is None:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"the server exited ({self.proc.wait()}) before listening:\n{''.join(self.log)}")
            self.log.append(line)
            if "listening on http://" in line:
                self.url = line.split("listening on ")[1].strip()
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start in time:\n" + "".join(self.log))
        # keep draining stderr so the server never blocks on a full pipe
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", **{"api_key": API_KEY, "max_retries": 0, "timeout": 60, **kw})

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise
        return self.proc.returncode


def post(url: str, data: bytes, headers: dict | None = None, method: str = "POST") -> tuple[int, dict]:
    """Raw HTTP: (status, JSON body). Every answer of the server, error or not, must be JSON."""
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _never_ends(name: str, w: np.ndarray) -> np.ndarray:
    """The LM head with the control tokens' rows zeroed: their logits are exactly 0 while the top one
    of the other 262 is several units above, so greedy text never ends by itself and every greedy
    request runs exactly max_tokens (long requests for cancel and shutdown tests)."""
    if name == "output.weight":
        w = w.copy()
        w[[TINY_TOKENS.index(t) for t in CONTROL_TOKENS]] = 0
    return w


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    template = folder / "chatml.jinja"
    template.write_text(TEMPLATE)
    return write_tiny_vocab_model(folder / "tiny.gguf", seed=0, weight_map=_never_ends), template


@pytest.fixture(scope="module")
def reference(files):
    with Model(files[0], n_ctx=N_CTX, n_threads=1) as m:
        yield m


@pytest.fixture(scope="module")
def server(files):
    s = ServerProcess(files[0], "-np", str(PARALLEL), "-c", str(N_CTX), "--chat-template-file", str(files[1]),
                      "--api-key", API_KEY, "--queue-size", "64")
    yield s
    assert s.stop() == 0, "".join(s.log)


def expected(reference, prompt: str | list[dict], max_tokens: int, stop=None) -> str:
    text = prompt if isinstance(prompt, str) else apply_chat_template(reference, prompt, chat_template=TEMPLATE)
    r = reference.generate(text, temperature=0, max_tokens=max_tokens, stop=stop)
    return r.text if isinstance(prompt, str) else split_reasoning(r.text)[1]


def ask(client: openai.OpenAI, prompt: str | list[dict], max_tokens: int, stream: bool, stop=None):
    """(text, finish_reason, completion_tokens or None) of one greedy request."""
    common = dict(model="tiny", max_tokens=max_tokens, temperature=0, stream=stream, stop=stop)
    if isinstance(prompt, str):
        if not stream:
            r = client.completions.create(prompt=prompt, **common)
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
        chunks = list(client.completions.create(prompt=prompt, stream_options={"include_usage": True}, **common))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return text, finish[-1], chunks[-1].usage.completion_tokens
    if not stream:
        r = client.chat.completions.create(messages=prompt, **common)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    chunks = list(client.chat.completions.create(messages=prompt, **common))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    return text, chunks[-1].choices[0].finish_reason, None


def ask_concurrently(client: openai.OpenAI, prompts: list[str], max_tokens: list[int]):
    """ask() every prompt at once, one thread each, every other one streamed."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda k: ask(client, prompts[k], max_tokens[k], k % 2 == 1), range(len(prompts))))


def test_stream_text_never_splits_a_character_or_shows_a_stop_beginning(reference, monkeypatch):
    """The text deltas of a stream (deltaspec.server.text, byte tokens of the tiny vocabulary: id ==
    byte): a UTF-8 character split over two tokens comes out whole, a possible beginning of a stop
    string waits until it cannot be one, and finish() adds what the engine's final text has beyond
    what was shown. Seen to fail with no_holdback (every byte shown at once)."""
    from deltaspec.server.text import TextAssembler

    text = TextAssembler(reference.tokenizer, ["xyz"])
    assert text.push(list(b"ab")) == "ab"
    assert text.push(list("é".encode())[:1]) == ""          # half a character
    assert text.push(list("é".encode())[1:]) == "é"
    assert text.push(list(b" x")) == " "                    # "x" may start "xyz"
    assert text.push(list(b"y")) == ""                      # "xy" too
    assert text.push(list(b"q")) == "xyq"                   # not a stop after all
    assert text.push(list(b"x")) == ""
    assert text.finish("abé xyqx!") == "x!"                  # the engine's final text decides the end
    cut = TextAssembler(reference.tokenizer, ["xyz"])
    assert cut.push(list(b"ab x")) == "ab "
    assert cut.finish("ab ") == ""                          # "xyz" completed and was cut: nothing more


def test_greedy_requests_equal_generate(server, reference):
    """Completions and chat completions, streamed and not, one after another: each text is
    generate()'s, finish reasons and token counts agree; a stop string cuts the text where
    generate() cuts it. Seen to fail with prompt_tail (the prompt's last token dropped) and
    drop_finish (the held-back end of a stream never sent)."""
    client = server.client()
    cases = [("Once upon a time", 24), ("The answer is", 40), ([{"role": "user", "content": "hello there"}], 24),
             ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "why?"}], 32)]
    for prompt, n in cases:
        want = expected(reference, prompt, n)
        for stream in (False, True):
            text, finish, n_tokens = ask(client, prompt, n, stream)
            assert text == want, f"{prompt!r} stream={stream}"
            assert finish == reference.generate(prompt if isinstance(prompt, str) else
                                                apply_chat_template(reference, prompt, chat_template=TEMPLATE),
                                                temperature=0, max_tokens=n).finish_reason
            assert n_tokens in (None, n) or finish == "stop"
    # a stop string taken from the middle of the greedy text (printable ASCII: the random model's
    # text is mostly bytes that are not UTF-8, shown as U+FFFD): cut there, streamed or not
    full = expected(reference, "Once upon a time", 40)
    at = next(i for i in range(3, len(full)) if full[i:i + 2].isascii() and full[i:i + 2].isprintable())
    stop = full[at:at + 2]
    want = expected(reference, "Once upon a time", 40, stop=[stop])
    assert len(want) < len(full)
    for stream in (False, True):
        text, finish, _ = ask(client, "Once upon a time", 40, stream, stop=[stop])
        assert (text, finish) == (want, "stop")


def test_fifty_concurrent_clients(server, reference):
    """50 clients at once (4 slots, the rest queued), 3 requests each (completion, streamed chat,
    streamed completion), each followed by a request that fails (oversize prompt or unknown model):
    every good answer is complete and equals generate() for its own prompt; the server counts all
    150 finished and ends with nothing running or waiting. Seen to fail with
    cross_talk (each step's progress delivered to the first request of the step: the others never
    hear their end, their clients time out)."""
    jobs = []
    for i in range(50):
        for k, stream in enumerate((False, True, True)):
            n = 8 + (i * 3 + k) % 17
            prompt = (f"client {i} request {k}: tell me about {['cats', 'rivers', 'ice'][k]}" if k != 1 else
                      [{"role": "user", "content": f"client {i}: hello {k}"}])
            jobs.append((i, prompt, n, stream))
    want = {(i, str(p), n): expected(reference, p, n) for i, p, n, _ in jobs}
    before = server.metrics()

    client = server.client()  # thread-safe; its pool holds a connection per client thread

    def client_loop(i: int) -> list[tuple]:
        answers = []
        for j, p, n, stream in jobs:
            if j != i:
                continue
            answers.append((str(p), n, ask(client, p, n, stream)[0]))
            # a failing request between good ones, theirs or others': refused alone
            with pytest.raises(openai.BadRequestError if i % 2 else openai.NotFoundError):
                client.completions.create(model="tiny" if i % 2 else "other", prompt="x" * (N_CTX + i), max_tokens=4)
        return answers

    with ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(client_loop, range(50)))
    got = {(i, p, n): text for i, answers in enumerate(results) for p, n, text in answers}
    assert len(got) == len(jobs) == 150
    bad = [k for k in want if got.get(k) != want[k]]
    assert not bad, f"{len(bad)} of 150 answers differ from generate(), e.g. {bad[0]}"
    after = server.metrics()
    finished = sum(after[f'deltaspec_requests_finished_total{{reason="{r}"}}'] -
                   before[f'deltaspec_requests_finished_total{{reason="{r}"}}'] for r in ("stop", "length"))
    assert finished == 150
    assert after["deltaspec_requests_running"] == 0 and after["deltaspec_requests_waiting"] == 0


def _wait_until(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def test_disconnect_cancels_and_frees_the_slot(server):
    """A streamed request read for a few chunks and then dropped, and a non-streamed one whose
    client times out: both are cancelled in the engine (finish reason "cancelled") long before
    their max_tokens, and their slots are free again. Seen to fail with no_cancel_on_disconnect
    (they run to their end: nothing counted as cancelled)."""
    client = server.client()
    before = server.metrics()["deltaspec_requests_cancelled_total"]
    stream = client.completions.create(model="tiny", prompt="a long story", max_tokens=N_CTX - 100, temperature=0,
                                       stream=True)
    for _, _ in zip(range(3), stream):
        pass
    stream.close()  # the client hangs up mid-stream
    assert _wait_until(lambda: server.metrics()["deltaspec_requests_cancelled_total"] == before + 1), \
        "the dropped stream was not cancelled"
    with pytest.raises(openai.APITimeoutError):
        server.client(timeout=0.3).completions.create(model="tiny", prompt="another long story",
                                                      max_tokens=N_CTX - 100, temperature=0)
    assert _wait_until(lambda: server.metrics()["deltaspec_requests_cancelled_total"] == before + 2), \
        "the timed-out request was not cancelled"
    m = server.metrics()
    assert m["deltaspec_requests_running"] == 0 and m["deltaspec_requests_waiting"] == 0


BAD_REQUESTS = [  # (what, body or raw bytes, headers, status, error code)
    ("malformed JSON", b'{"model": "tiny", "prompt": "hi"', {}, 400, "invalid_json"),
    ("not an object", b'["tiny"]', {}, 400, "invalid_body"),
    ("unknown model", {"model": "gpt-4", "prompt": "hi"}, {}, 404, "model_not_found"),
    ("model of the wrong type", {"model": 7, "prompt": "hi"}, {}, 400, "invalid_type"),
    ("temperature a string", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, {}, 400, "invalid_type"),
    ("max_tokens a string", {"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, {}, 400, "invalid_type"),
    ("max_tokens zero", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, {}, 400, "invalid_value"),
    ("top_p out of range", {"model": "tiny", "prompt": "hi", "top_p": 3}, {}, 400, "invalid_value"),
    ("stop a number", {"model": "tiny", "prompt": "hi", "stop": 5}, {}, 400, "invalid_type"),
    ("stream a string", {"model": "tiny", "prompt": "hi", "stream": "yes"}, {}, 400, "invalid_type"),
    ("prompt a number", {"model": "tiny", "prompt": 12}, {}, 400, "invalid_type"),
    ("token id outside the vocabulary", {"model": "tiny", "prompt": [1, 99999]}, {}, 400, "invalid_value"),
    ("prompt longer than the context", {"model": "tiny", "prompt": "x" * (N_CTX + 10)}, {}, 400,
     "context_length_exceeded"),
    ("prompt + max_tokens beyond the context", {"model": "tiny", "prompt": "x" * 100, "max_tokens": N_CTX}, {}, 400,
     "context_length_exceeded"),
    ("n above 16", {"model": "tiny", "prompt": "hi", "n": 17}, {}, 400, "invalid_value"),
    ("best_of above 1", {"model": "tiny", "prompt": "hi", "best_of": 2}, {}, 400, "unsupported"),
    ("logprobs beyond 20", {"model": "tiny", "prompt": "hi", "logprobs": 21}, {}, 400, "invalid_value"),
    ("logprobs a boolean", {"model": "tiny", "prompt": "hi", "logprobs": True}, {}, 400, "invalid_type"),
    ("logit_bias key not a token id", {"model": "tiny", "prompt": "hi", "logit_bias": {"a": 1}}, {}, 400,
     "invalid_value"),
    ("logit_bias key outside the vocabulary", {"model": "tiny", "prompt": "hi", "logit_bias": {"99999": 1}}, {}, 400,
     "invalid_value"),
    ("logit_bias value out of range", {"model": "tiny", "prompt": "hi", "logit_bias": {"65": 101}}, {}, 400,
     "invalid_value"),
    ("logit_bias a list", {"model": "tiny", "prompt": "hi", "logit_bias": [1]}, {}, 400, "invalid_type"),
    ("no API key", {"model": "tiny", "prompt": "hi"}, {"Authorization": ""}, 401, "invalid_api_key"),
    ("prediction a string", {"model": "tiny", "prompt": "hi", "prediction": "abc"}, {}, 400, "invalid_type"),
    ("prediction of another type", {"model": "tiny", "prompt": "hi", "prediction": {"type": "diff", "content": "a"}},
     {}, 400, "invalid_value"),
    ("prediction content a number", {"model": "tiny", "prompt": "hi", "prediction": {"type": "content", "content": 3}},
     {}, 400, "invalid_type"),
    ("prediction parts not text", {"model": "tiny", "prompt": "hi",
                                   "prediction": {"type": "content", "content": [{"type": "image_url"}]}},
     {}, 400, "invalid_type"),
]
BAD_CHAT_REQUESTS = [
    ("messages not a list", {"model": "tiny", "messages": "hi"}, 400, "invalid_messages"),
    ("a message without content", {"model": "tiny", "messages": [{"role": "user"}]}, 400, "invalid_messages"),
    ("role of the wrong type", {"model": "tiny", "messages": [{"role": 3, "content": "x"}]}, 400, "invalid_messages"),
    ("oversize chat", {"model": "tiny", "messages": [{"role": "user", "content": "y" * N_CTX}]}, 400,
     "context_length_exceeded"),
    ("top_logprobs without logprobs", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                       "top_logprobs": 2}, 400, "invalid_value"),
    ("logprobs a number", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": 3}, 400,
     "invalid_type"),
    ("top_logprobs beyond 20", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                "top_logprobs": 25}, 400, "invalid_value"),
    ("response_format not an object", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                       "response_format": "json"}, 400, "invalid_type"),
    ("unknown response_format type", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                      "response_format": {"type": "xml"}}, 400, "invalid_response_format"),
    ("response_format schema that does not compile", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
     "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "objectx"}}}}, 400,
     "invalid_response_format"),
]


def test_bad_requests_get_json_errors_and_the_server_keeps_serving(server, reference):
    """Malformed JSON, wrong types, out-of-range values, oversize prompts, unknown models, unknown
    routes and methods, a missing API key: each gets its 4xx status and an OpenAI-shaped JSON error
    naming the problem, and a good request still gets generate()'s answer after each. The official
    client raises its typed errors. Seen to fail with no_validation (fields reach the engine
    unchecked: 500s and engine errors instead of 400s)."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    good = json.dumps({"model": "tiny", "prompt": "still there?", "max_tokens": 6, "temperature": 0}).encode()
    want = expected(reference, "still there?", 6)
    cases = [(w, "/v1/completions", b, h, s, c) for w, b, h, s, c in BAD_REQUESTS]
    cases += [(w, "/v1/chat/completions", b, {}, s, c) for w, b, s, c in BAD_CHAT_REQUESTS]
    for what, path, body, headers, status, code in cases:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        got_status, got = post(server.url + path, data, {**auth, **headers})
        assert (got_status, got.get("error", {}).get("code")) == (status, code), f"{what}: {got}"
        assert isinstance(got["error"]["message"], str) and got["error"]["message"], what
        assert post(server.url + "/v1/completions", good, auth)[1]["choices"][0]["text"] == want, f"after {what}"
    assert post(server.url + "/v1/nothing", good, auth)[0] == 404
    assert post(server.url + "/v1/completions", None, auth, method="GET")[0] == 405
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "z" * (N_CTX * 2)}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="hi", extra_body={"temperature": [1]})
    assert [m.id for m in client.models.list().data] == ["tiny"]
    m = server.metrics()
    assert m["deltaspec_requests_finished_total{reason=\"error\"}"] == 0  # every refusal was caught before the engine


def test_memory_is_flat_over_many_requests(server):
    """3000 requests (4 clients at a time, mixed streamed and not): the server's resident memory
    after the last is within 7 MiB of what it was after the first 1000. The warm-up is long because
    bounded structures fill over the first ~1000 requests (the engine's step graph cache meets new
    batch shapes, malloc's arenas grow): after it, 2000 more grew it by 1.5-3.6 MiB here.
    Seen to fail with leak_jobs (the engine loop keeps every finished request: about 5 MiB per 1000
    requests: 11.7 MiB over the 2000)."""
    client = server.client()

    def run(first: int, last: int, i: int) -> None:
        for k in range(first + i, last, 4):
            if k % 2:
                list(client.completions.create(model="tiny", prompt=f"request {k}", max_tokens=8, stream=True))
            else:
                client.completions.create(model="tiny", prompt=f"request {k}", max_tokens=8)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: run(0, 1000, i), range(4)))
    warm = server.rss()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: run(1000, 3000, i), range(4)))
    growth = server.rss() - warm
    print(f"resident memory: {warm / 2**20:.1f} MiB after 1000 requests, {growth / 2**20:+.2f} MiB after 2000 more")
    assert growth < 7 * 2**20, f"resident memory grew {growth / 2**20:.1f} MiB over 2000 requests"


def _request_in_thread(client, max_tokens: int, out: dict) -> threading.Thread:
    """A greedy completion in a thread of its own; `out` gets its finish reason and token count, or
    the exception it raised."""
    def run():
        try:
            r = client.completions.create(model="tiny", prompt="keep going", max_tokens=max_tokens, temperature=0)
            out["finish"], out["tokens"] = r.choices[0].finish_reason, r.usage.completion_tokens
        except Exception as e:  # reported by the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t


def test_full_queue_answers_429(files):
    """One slot and a queue of 2, both taken by long streams: 5 more requests get 429 at once with a
    JSON error (code queue_full), counted in /metrics; when the streams' clients hang up, the slot
    and the queue empty and the server serves again. Seen to fail with unbounded_queue (the 5 are
    queued instead: no 429, their clients time out)."""
    s = ServerProcess(files[0], "-np", "1", "-c", "16384", "--queue-size", "2")
    try:
        client = s.client()
        opened: list = []

        def hold(k: int) -> None:  # a stream that takes its place until its client hangs up
            stream = client.completions.create(model="tiny", prompt=f"hold {k}", max_tokens=16000, stream=True)
            opened.append(next(iter(stream)).choices[0].text is not None)
            release.wait(60)
            stream.close()

        release = threading.Event()
        holders = [threading.Thread(target=hold, args=(0,))]
        holders[0].start()
        assert _wait_until(lambda: s.metrics()["deltaspec_requests_running"] == 1)
        holders += [threading.Thread(target=hold, args=(k,)) for k in (1, 2)]
        for t in holders[1:]:
            t.start()
        assert _wait_until(lambda: s.metrics()["deltaspec_requests_waiting"] == 2)
        for _ in range(5):
            with pytest.raises(openai.RateLimitError) as e:
                s.client(timeout=10).completions.create(model="tiny", prompt="one more", max_tokens=4)
            assert e.value.code == "queue_full" and "retry" in e.value.message
        assert s.metrics()['deltaspec_requests_rejected_total{reason="queue_full"}'] == 5
        release.set()  # each holder hangs up once it has its first chunk: the next is admitted, and so on
        for t in holders:
            t.join(60)
        assert opened == [True] * 3
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens == 3
        assert s.metrics()["deltaspec_requests_cancelled_total"] == 3
    finally:
        assert s.stop() == 0


def test_sigterm_finishes_running_requests_and_exits_0(files):
    """SIGTERM while a long request runs: it still gets all its tokens (finish "length"), a new
    connection is refused, and the process exits with status 0. Seen to fail with
    cancel_on_shutdown (the running request is cut: finish "cancelled")."""
    s = ServerProcess(files[0], "-np", "2", "-c", "4096", "--timeout-graceful", "60")
    out: dict = {}
    first = s.client().completions.create(model="tiny", prompt="before", max_tokens=4)  # warm
    assert first.choices[0].finish_reason == "length"
    t = _request_in_thread(s.client(), 4000, out)  # half a second or more
    assert _wait_until(lambda: s.metrics()["deltaspec_requests_running"] == 1)
    s.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert out.get("finish") == "length" and out.get("tokens") == 4000, out
    assert s.proc.wait(30) == 0, "".join(s.log)
    with pytest.raises(openai.APIConnectionError):
        s.client().completions.create(model="tiny", prompt="after", max_tokens=4)


def test_speculation_per_request_at_parallel_1(files, reference):
    """--spec-type ngram-simple with --parallel 1: greedy answers equal generate() and /metrics
    counts drafted tokens. Seen to fail with spec_ignored (the drafter dropped: nothing drafted)."""
    s = ServerProcess(files[0], "-np", "1", "-c", str(N_CTX), "--spec-type", "ngram-simple",
                      "--chat-template-file", str(files[1]))
    try:
        client = s.client()
        prompt = "abc abc abc abc abc abc abc"  # repetitive: prompt lookup drafts
        for stream in (False, True):
            assert ask(client, prompt, 48, stream)[0] == expected(reference, prompt, 48)
        chat = [{"role": "user", "content": "xyz xyz xyz"}]
        assert ask(client, chat, 16, True)[0] == expected(reference, chat, 16)
        m = s.metrics()
        assert m["deltaspec_speculative"] == 1 and m["deltaspec_draft_tokens_total"] > 0
    finally:
        assert s.stop() == 0


def test_engine_failure_in_the_speculative_loop_answers_500_and_serving_goes_on(files, reference, monkeypatch):
    """An engine error in the one-request speculative loop (-np 1 with a drafter) answers that request
    with a 500 JSON error; the next request gets generate()'s answer and SIGTERM exits 0. The error
    is the engine's own: with DELTASPEC_TEST_WRONG_LOGPROB_ROW=next_row (csrc/logprobs.h) an accepted
    token is looked up among the top candidates of the row after its own, where it is missing.
    Seen red (the client timed out, the server never went idle) while SpeculativeBackend forgot its
    job before the loop's abandon() could fail it."""
    monkeypatch.setenv("DELTASPEC_TEST_WRONG_LOGPROB_ROW", "next_row")  # the server inherits it
    s = ServerProcess(files[0], "-np", "1", "-md", str(files[0]), "-c", str(N_CTX))
    try:
        client = s.client(timeout=30)
        prompt = "abc abc abc abc abc abc abc"
        with pytest.raises(openai.InternalServerError, match="top candidates"):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, logprobs=3)
        assert ask(client, prompt, 24, False)[0] == expected(reference, prompt, 24)
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_speculation_batched_at_parallel_n(files, reference, drafter):
    """--spec-type ngram-simple, or -md (the same file as its own draft model), with --parallel 3: 6
    concurrent greedy requests (3 wait for a slot) speculate together (each step verifies every running
    request's drafts in one pass, see tests/test_batch_speculative.py); each answer equals generate()
    and /metrics counts drafted and accepted tokens. Seen to fail with spec_ignored (the drafter
    dropped: nothing drafted)."""
    flags = ["--spec-type", "ngram-simple"] if drafter == "ngram" else ["-md", str(files[0])]
    s = ServerProcess(files[0], "-np", "3", "-c", str(N_CTX), *flags, "--chat-template-file", str(files[1]))
    try:
        client = s.client()
        prompts = [f"{w} {w} {w} {w} {w} {w}" for w in ("abc", "xyz", "the", "one two", "in an", "ab")]
        answers = ask_concurrently(client, prompts, [40 + 4 * k for k in range(len(prompts))])
        for k, (text, finish, _) in enumerate(answers):
            assert text == expected(reference, prompts[k], 40 + 4 * k), f"request {k}"
            assert finish == "length"
        m = s.metrics()
        assert m["deltaspec_speculative"] == 1 and m["deltaspec_draft_tokens_total"] > 0
        assert m["deltaspec_acceptance_rate"] > 0
    finally:
        assert s.stop() == 0


def test_prediction_drafts_from_the_predicted_text(files, reference):
    """A plain server (no drafter, --parallel 2): requests with OpenAI's `prediction` draft by lookup
    in it (deltaspec.prediction): answers equal generate() (chat with the prediction as text parts,
    completion as a string, streamed and not), /metrics counts drafted and accepted tokens, and the
    same requests without a prediction draft nothing. Seen to fail with the prediction dropped on the
    way to add_request (schemas._prediction returning {}: drafted 0)."""
    s = ServerProcess(files[0], "-np", "2", "-c", str(N_CTX), "--chat-template-file", str(files[1]))
    try:
        client = s.client()
        prompt, chat = "one two three four", [{"role": "user", "content": "abc xyz"}]
        for stream in (False, True):
            assert ask(client, prompt, 40, stream)[0] == expected(reference, prompt, 40)
        assert s.metrics()["deltaspec_draft_tokens_total"] == 0
        want = expected(reference, prompt, 40)
        common = dict(model="tiny", max_tokens=40, temperature=0)
        r = client.completions.create(prompt=prompt, extra_body={"prediction": {"type": "content", "content": want}},
                                      **common)
        assert r.choices[0].text == want
        chunks = client.completions.create(prompt=prompt, stream=True, **common,
                                           extra_body={"prediction": {"type": "content", "content": want}})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        want_chat = expected(reference, chat, 40)
        raw = reference.generate(apply_chat_template(reference, chat, chat_template=TEMPLATE), temperature=0,
                                 max_tokens=40).text  # the reply as the model writes it, reasoning block included
        r = client.chat.completions.create(messages=chat, prediction={"type": "content", "content": [
            {"type": "text", "text": raw[:len(raw) // 2]}, {"type": "text", "text": raw[len(raw) // 2:]}]}, **common)
        assert r.choices[0].message.content == want_chat
        m = s.metrics()
        assert m["deltaspec_draft_tokens_total"] > 0 and m["deltaspec_draft_tokens_accepted_total"] > 0, m
    finally:
        assert s.stop() == 0


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_chat_with_the_gguf_template_tools_and_thinking(chat_gguf):
    """The real-vocabulary tiny model carrying Qwen3.5's chat template (tests/conftest.py): chat
    requests with `tools` and enable_thinking on and off (llama-server's chat_template_kwargs), streamed
    and not, give Model.create_chat_completion()'s message (reasoning_content split off the same way).
    Seen to fail with prompt_tail (the rendered prompt's last token dropped)."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Oslo?"}]
    s = ServerProcess(chat_gguf, "-np", "2", "-c", "1024", wait=False)
    try:
        with Model(chat_gguf, n_ctx=1024, n_threads=1, progress=False) as model:  # loads while the server does
            s.wait_listening()
            client = s.client()
            for thinking in (True, False):
                want = model.create_chat_completion(messages, tools=TOOLS, max_tokens=12, temperature=0,
                                                    enable_thinking=thinking)["choices"][0]["message"]
                common = dict(model=Path(chat_gguf).stem, messages=messages, tools=TOOLS, max_tokens=12,
                              temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
                got = client.chat.completions.create(**common).choices[0].message
                assert (got.content, getattr(got, "reasoning_content", None)) == \
                    (want["content"], want.get("reasoning_content")), thinking
                deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **common)]
                assert "".join(d.content or "" for d in deltas) == want["content"]
                assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
                    want.get("reasoning_content", "")
                assert bool(want.get("reasoning_content")) == thinking  # both paths were exercised
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("flags", [("-np", "2"), ("-np", "2", "--spec-type", "ngram-simple"),
                                   ("-np", "1", "--spec-type", "ngram-simple")],
                         ids=["batched", "batched-speculative", "speculative"])
def test_chat_response_format(chat_gguf, flags):
    """response_format json_schema and json_object (with llama-cpp-python's "schema"), streamed and
    not, through the batched backend (with and without speculation) and the one-request speculative
    one: the reply validates against
    the schema and equals Model.create_chat_completion()'s (greedy). Seen to fail with parse_chat
    leaving the grammar out of the request's options (free text that is not JSON)."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "n"], "additionalProperties": False}
    formats = [{"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}},
               {"type": "json_object", "schema": schema}]
    messages = [{"role": "user", "content": "Answer in JSON."}]
    s = ServerProcess(chat_gguf, *flags, "-c", "1024", wait=False)
    try:
        with Model(chat_gguf, n_ctx=1024, n_threads=1, progress=False) as model:  # loads while the server does
            s.wait_listening()
            client = s.client()
            for fmt in formats:
                want = model.create_chat_completion(messages, response_format=fmt, max_tokens=200,
                                                    temperature=0)["choices"][0]["message"]["content"]
                common = dict(model=Path(chat_gguf).stem, messages=messages, max_tokens=200, temperature=0,
                              response_format=fmt)
                got = client.chat.completions.create(**common).choices[0]
                assert got.finish_reason == "stop" and got.message.content == want, fmt
                jsonschema.validate(json.loads(got.message.content), schema)
                streamed = "".join(c.choices[0].delta.content or "" for c in
                                   client.chat.completions.create(stream=True, **common) if c.choices)
                assert streamed == want
            with pytest.raises(openai.BadRequestError, match="enable_thinking"):
                client.chat.completions.create(model=Path(chat_gguf).stem, messages=messages, max_tokens=4,
                                               response_format=formats[0],
                                               extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    finally:
        assert s.stop() == 0
