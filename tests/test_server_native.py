"""llama-server's own /completion and /infill, and a completion's `suffix`, on a server started here
on loopback (as tests/test_server.py does) with the tiny real-vocabulary model (Qwen's FIM tokens),
and deltaspec.fim's prompts.

/completion answers generate()'s text for a text or token-id prompt in llama-server's shape
(stop_type "limit", "word" with the stopping word, "eos"), streamed or not; ignore_eos and
logit_bias ({"token id": bias}) act as generate()'s.

The claims: the infill prompt is llama-server's format_prompt_infill (pinned tree,
tools/server/server-common.cpp), written out here token by token from its layout: the repo-level
pattern with the extra files (Qwen has <|repo_name|> and <|file_sep|>), FIM_PRE prefix prompt
FIM_SUF suffix FIM_MID, the prefix cut to its last 3/4 of the batch and the suffix to its quarter;
/infill answers greedy requests with generate()'s text on that prompt in llama-server's shape
(content, stop_type "limit" / "eos", tokens_predicted / evaluated), streamed as {"content"} events
without [DONE]; a completion's `suffix` is generate() on FIM_PRE prompt FIM_SUF suffix FIM_MID; a
model without FIM tokens answers /infill with 501 and `suffix` with 400; bad fields are 400s.

Seen red with the server's planted bugs infill_suffix_dropped (the suffix left out of the prompt)
and no_validation (bad bodies reach the engine).
"""

from __future__ import annotations

import json
import urllib.request

import pytest

openai = pytest.importorskip("openai")  # CI installs it with the test extra: never skipped there

from deltaspec import Model
from deltaspec.fim import infill_ids, wrap
from test_server import ServerProcess, files, post  # noqa: F401 (fixture)

N_CTX = 512
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]


@pytest.fixture(scope="module")
def reference(chat_gguf):
    with Model(chat_gguf, n_ctx=N_CTX, n_threads=1) as m:
        yield m


@pytest.fixture(scope="module")
def server(chat_gguf):
    s = ServerProcess(chat_gguf, "-np", "2", "-c", str(N_CTX))
    yield s
    assert s.stop() == 0, "".join(s.log)


def test_infill_prompt_is_llama_servers(reference):
    tok = reference.tokenizer
    special = lambda text: reference.tokenize(text, special=True)  # noqa: E731
    plain = lambda text: reference.tokenize(text, special=False)  # noqa: E731
    [rep], [sep], [pre], [suf], [mid] = (special(t) for t in ("<|repo_name|>", "<|file_sep|>", "<|fim_prefix|>",
                                                              "<|fim_suffix|>", "<|fim_middle|>"))
    want = ([rep] + plain("myproject\n") + [sep] + plain("util.py\n") + plain(EXTRA[0]["text"]) + [sep]
            + plain("filename\n") + [pre] + plain(PREFIX) + special("# sum") + [suf] + plain(SUFFIX) + [mid])
    assert infill_ids(tok, PREFIX, SUFFIX, 4096, "# sum", EXTRA) == want
    # the extra context keeps what the context leaves beyond the batch, + 2: its last 2 tokens at 512
    assert infill_ids(tok, PREFIX, SUFFIX, 512, "# sum", EXTRA) == want[want.index(pre) - 2:]
    long_prefix = plain("x = 1\n" * 400)
    cut = infill_ids(tok, long_prefix, plain(SUFFIX * 100), N_CTX)
    assert cut == [pre] + long_prefix[-(3 * N_CTX // 4):] + [suf] + plain(SUFFIX * 100)[:N_CTX // 4 - 2] + [mid]
    assert wrap(tok, plain(PREFIX), plain(SUFFIX)) == [pre] + plain(PREFIX) + [suf] + plain(SUFFIX) + [mid]


def _post(server, route: str, body: dict) -> tuple[int, dict]:
    return post(f"{server.url}{route}", json.dumps(body).encode())


def test_infill_equals_generate(server, reference):
    ids = infill_ids(reference.tokenizer, PREFIX, SUFFIX, N_CTX, "", EXTRA)
    reference.reset()
    want = reference.generate(ids, temperature=0, max_tokens=12)
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "n_predict": 12,
            "temperature": 0, "t_max_predict_ms": 500, "cache_prompt": True}
    status, got = _post(server, "/infill", body)
    assert status == 200, got
    assert got["content"] == want.text and got["stop"] is True
    assert got["tokens_predicted"] == len(want.tokens) and got["tokens_evaluated"] == len(ids)
    assert got["stop_type"] == ("limit" if want.finish_reason == "length" else "eos")
    req = urllib.request.Request(f"{server.url}/infill", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == want.text
    assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1]) and len(events) > 2


def test_completion_suffix_equals_generate(server, reference):
    ids = wrap(reference.tokenizer, reference.tokenize(PREFIX, special=True), reference.tokenize(SUFFIX))
    reference.reset()
    want = reference.generate(ids, temperature=0, max_tokens=10)
    got = server.client().completions.create(model="tiny-chat", prompt=PREFIX, suffix=SUFFIX, max_tokens=10,
                                             temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.prompt_tokens == len(ids)
    status, answer = _post(server, "/v1/completions", {"model": "tiny-chat", "prompt": "a", "suffix": "b",
                                                        "echo": True})
    assert status == 400 and answer["error"]["param"] == "suffix"


@pytest.mark.parametrize("body,param", [
    ({"input_suffix": "b"}, "input_prefix"),
    ({"input_prefix": "a"}, "input_suffix"),
    ({"input_prefix": 1, "input_suffix": "b"}, "input_prefix"),
    ({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "x"}]}, "input_extra"),
    ({"input_prefix": "a", "input_suffix": "b", "n_predict": 0}, "n_predict"),
    ({"input_prefix": "a", "input_suffix": "b", "prompt": ["x"]}, "prompt"),
    ({"input_prefix": "a", "input_suffix": "b", "prompt": "x " * 600}, "prompt"),
])
def test_bad_infill_bodies_are_400s(server, body, param):
    status, answer = _post(server, "/infill", body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_a_model_without_fim_tokens(files):
    s = ServerProcess(files[0], "-np", "1", "-c", "128")
    try:
        status, answer = _post(s, "/infill", {"input_prefix": "a", "input_suffix": "b"})
        assert status == 501 and "fill-in-the-middle" in answer["error"]["message"]
        status, answer = _post(s, "/v1/completions", {"model": "tiny", "prompt": "a", "suffix": "b"})
        assert status == 400 and answer["error"]["param"] == "suffix"
    finally:
        assert s.stop() == 0


def _stream(server, route: str, body: dict) -> list[dict]:
    req = urllib.request.Request(f"{server.url}{route}", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        lines = r.read().decode().splitlines()
    assert "data: [DONE]" not in lines  # llama-server's own streams end without it
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_completion_native_equals_generate(server, reference):
    prompt = "def fib(n):"
    reference.reset()
    want = reference.generate(prompt, temperature=0, max_tokens=16)
    for p in (prompt, reference.tokenize(prompt, special=True)):
        status, got = _post(server, "/completion", {"prompt": p, "n_predict": 16, "temperature": 0,
                                                     "cache_prompt": True})
        assert status == 200 and got["content"] == want.text and got["stop"] is True, got
        assert got["stop_type"] == ("limit" if want.finish_reason == "length" else "eos")
        assert got["tokens_predicted"] == len(want.tokens)
    events = _stream(server, "/completion", {"prompt": prompt, "n_predict": 16, "temperature": 0})
    assert "".join(e["content"] for e in events) == want.text and events[-1]["stop"] is True
    # a stop word: the text is cut before it, and the answer names it
    word = next((want.text[i:i + 2] for i in range(2, len(want.text) - 2) if want.text[i:i + 2].strip()), None)
    assert word is not None, f"no stop word in {want.text!r}"
    status, got = _post(server, "/completion", {"prompt": prompt, "n_predict": 16, "temperature": 0, "stop": [word]})
    assert got["content"] == want.text[:want.text.index(word)]
    assert got["stop_type"] == "word" and got["stopping_word"] == word


def test_completion_native_bias_and_ignore_eos(server, reference):
    token = reference.tokenize("Hello", special=False)[0]
    reference.reset()
    want = reference.generate("x", temperature=0, max_tokens=6, logit_bias={token: 100.0}, ignore_eos=True)
    status, got = _post(server, "/completion", {"prompt": "x", "n_predict": 6, "temperature": 0,
                                                 "logit_bias": {str(token): 100}, "ignore_eos": True})
    assert status == 200 and got["content"] == want.text and got["tokens_predicted"] == 6
    for body, param in (({}, "prompt"), ({"prompt": "x", "n_predict": -5}, "n_predict"),
                        ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"), ({"prompt": 7}, "prompt")):
        status, answer = _post(server, "/completion", body)
        assert status == 400 and answer["error"]["param"] == param, answer


def test_grammar_on_the_generation_routes(server):
    """llama-server's `grammar` (GBNF) on /completion, /infill and /v1/completions: the text is one
    of the grammar's strings (the random model left alone writes anything else); a grammar that
    does not compile is a 400 naming it."""
    grammar = 'root ::= "yes" | "no"'
    for route, body in (("/completion", {"prompt": "Answer:", "n_predict": 8}),
                        ("/infill", {"input_prefix": "x = ", "input_suffix": "\n", "n_predict": 8}),
                        ("/v1/completions", {"model": "tiny-chat", "prompt": "Answer:", "max_tokens": 8})):
        status, got = _post(server, route, {**body, "temperature": 0, "grammar": grammar})
        assert status == 200, got
        text = got["content"] if "content" in got else got["choices"][0]["text"]
        assert text in ("yes", "no"), (route, text)
        status, answer = _post(server, route, {**body, "grammar": "root ::= ("})
        assert status == 400 and answer["error"]["param"] == "grammar", answer
