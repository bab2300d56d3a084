"""llama-server's /tokenize, /detokenize and /apply-template on our server (started here on
loopback, as tests/test_server.py does), on the tiny-vocabulary model, whose byte-level pieces
include some that are not whole UTF-8.

The claims: /tokenize gives Model.tokenize's ids (special tokens parsed unless parse_special is
false; add_special adds what tokenize(add_bos=True) adds), with_pieces each token's piece, the
text where it is whole UTF-8 and its bytes otherwise (llama-server's shapes); /detokenize gives
Model.detokenize(special=True)'s text (control tokens as their text, as llama-server's); /apply-template the prompt apply_chat_template renders; /props
the slot context, slots and chat template the server was started with; they answer with an API key
like the other routes, and bad bodies are 400s naming the field.

Seen red with the server's planted bug tokenize_plain (special tokens never parsed).
"""

from __future__ import annotations

import json

import pytest

from deltaspec import Model
from deltaspec.completions import apply_chat_template
from test_server import TEMPLATE, ServerProcess, files, post  # noqa: F401 (fixture)

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = "<|im_start|>user\nhá 😀 ok<|im_end|>"


@pytest.fixture(scope="module")
def server(files):
    s = ServerProcess(files[0], "-np", "1", "-c", "256", "--chat-template-file", str(files[1]), "--api-key", KEY)
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def reference(files):
    with Model(files[0], n_ctx=256, n_threads=1) as m:
        yield m


def call(server, route: str, body) -> tuple[int, dict]:
    return post(f"{server.url}{route}", json.dumps(body).encode(), AUTH)


def test_tokenize(server, reference):
    status, body = call(server, "/tokenize", {"content": TEXT})
    assert status == 200 and body["tokens"] == reference.tokenize(TEXT, special=True)
    assert len(body["tokens"]) < len(reference.tokenize(TEXT, special=False)), "no special token was parsed"
    status, body = call(server, "/tokenize", {"content": TEXT, "parse_special": False})
    assert body["tokens"] == reference.tokenize(TEXT, special=False)
    status, body = call(server, "/tokenize", {"content": "hi", "add_special": True})
    assert body["tokens"] == reference.tokenize("hi", add_bos=True)
    status, body = call(server, "/tokenize", {"content": TEXT, "with_pieces": True})
    pieces = [reference.tokenizer.token_to_piece(t) for t in reference.tokenize(TEXT, special=True)]
    assert [p["id"] for p in body["tokens"]] == reference.tokenize(TEXT, special=True)
    want = []
    for p in pieces:
        try:
            want.append(p.decode("utf-8"))
        except UnicodeDecodeError:
            want.append(list(p))
    assert [p["piece"] for p in body["tokens"]] == want
    assert any(isinstance(p, list) for p in want) and any(isinstance(p, str) for p in want)


def test_detokenize_and_apply_template(server, reference):
    ids = reference.tokenize(TEXT, special=True)
    status, body = call(server, "/detokenize", {"tokens": ids})
    assert status == 200 and body["content"] == reference.detokenize(ids, special=True) == TEXT
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    status, body = call(server, "/apply-template", {"messages": messages})
    assert status == 200 and body["prompt"] == apply_chat_template(reference, messages, chat_template=TEMPLATE)


@pytest.mark.parametrize("route,body,param", [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "a", "parse_special": 1}, "parse_special"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", [1, 2], None),
    ("/apply-template", {}, "messages"),
    ("/apply-template", {"messages": [{"role": "user"}]}, "messages"),
])
def test_bad_bodies_are_400s(server, route, body, param):
    status, answer = call(server, route, body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_the_api_key_is_required(server):
    status, body = post(f"{server.url}/tokenize", b'{"content": "a"}')
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_props(server, files):
    """llama-server's GET /props: each slot's context (-c), the slots (-np), the chat template the
    server renders with (--chat-template-file) and the sampling defaults."""
    status, props = post(f"{server.url}/props", None, AUTH, method="GET")
    assert status == 200, props
    assert props["default_generation_settings"]["n_ctx"] == 256 and props["total_slots"] == 1
    assert props["chat_template"] == files[1].read_text() == TEMPLATE
    assert props["model_alias"] == "tiny" and props["model_path"] == str(files[0])
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8  # generate()'s default
    assert post(f"{server.url}/props", None, method="GET")[0] == 401
