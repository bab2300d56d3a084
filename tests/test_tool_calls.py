"""Tool calls: a Qwen3.5 reply's <tool_call> blocks as OpenAI's `tool_calls` (deltaspec.tool_calls),
in create_chat_completion and the server's /v1/chat/completions, streamed or not.

The claims: the XML form the chat template shows the model (Qwen3-Coder's: <function=NAME>,
<parameter=ARG> lines; llama.cpp's parser for these models, common/parsers/qwen3-coder.cpp in the
pinned tree, reads values by the tool's schema the same way) gives each call's name and JSON
arguments (a "string" parameter keeps its text, "123" included; others are read as JSON); the
text around the calls is the content (None when blank); a block that does not close or has text
outside its parameters stays content; a stream's pieces, however cut, give the same content and
calls; end to end (the tiny real-vocabulary model, its reply forced by a GBNF grammar) the
message has the call and finish_reason "tool_calls", streamed as a `tool_calls` delta; without
tools, or with tool_choice "none", the reply is text; a forced call of a function that is not
among the tools is refused (forced calls themselves: test_tool_call_grammar.py).

Seen red with the parameter's schema ignored (every value read as JSON: "123" became 123) and with
the stream's held tail released early (a "<tool_call>" cut across two pieces leaked as text):
both by patching deltaspec.tool_calls for a run. The end-to-end tests also failed before the
grammar's forced text stopped coming back as user-defined tokens (<tool_call> is one; llguidance
sees it as special, never as a literal's text: deltaspec.constraint's encode gives its characters).
"""

from __future__ import annotations

import json
import random

import pytest

from deltaspec.tool_calls import ToolCallStream, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "code": {"type": "string"}, "opts": {"type": "object"}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


def block(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


REPLY = ("Checking both.\n\n" + block("get_weather", city="New York", days="3", code="123", opts='{"unit": "C"}')
         + "\n" + block("now") + "\nDone.")


def test_calls_and_content():
    content, calls = parse_tool_calls(REPLY, TOOLS)
    assert content == "Checking both.\n\n\n\nDone."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "New York", "days": 3, "code": "123",
                                                            "opts": {"unit": "C"}}
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_tool_calls(block("now"), TOOLS)[0] is None  # nothing but the call: no content


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=now>\n</function>\n",                      # never closes
    "<tool_call>\n<function=now>\nhello\n</function>\n</tool_call>",    # text outside parameters
    "<tool_call>\nnot a function\n</tool_call>",
    "plain text <tool_call",
])
def test_what_is_not_a_call_stays_content(text):
    assert parse_tool_calls(text, TOOLS) == (text, [])
    stream = ToolCallStream(TOOLS)
    shown, calls = stream.push(text)
    assert shown + stream.finish() == text and calls == []


def test_a_stream_cut_anywhere_gives_the_same_split():
    content, calls = parse_tool_calls(REPLY, TOOLS)
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(REPLY)), rng.randint(1, 12)))
        pieces = [REPLY[a:b] for a, b in zip([0] + cuts, cuts + [len(REPLY)])]
        stream, shown, got = ToolCallStream(TOOLS), [], []
        for p in pieces:
            s, c = stream.push(p)
            assert "<tool_call" not in s
            shown.append(s)
            got += c
        shown.append(stream.finish())
        assert "".join(shown) == content
        assert [c["function"] for c in got] == [c["function"] for c in calls]


# --- end to end: the reply forced by a grammar --------------------------------------------------

CALL = block("get_weather", city="Paris", days="2")
GRAMMAR = "root ::= " + json.dumps(CALL)
MESSAGES = [{"role": "user", "content": "Weather in Paris for two days?"}]


def test_create_chat_completion_returns_the_call(chat_gguf):
    from deltaspec import Model

    with Model(chat_gguf, n_ctx=512, n_threads=2) as m:
        out = m.create_chat_completion(MESSAGES, tools=TOOLS, grammar=GRAMMAR, max_tokens=64)
        msg = out["choices"][0]
        assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] is None
        [call] = msg["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
        chunks = list(m.create_chat_completion(MESSAGES, tools=TOOLS, grammar=GRAMMAR, max_tokens=64, stream=True))
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d] == [call["function"]]
        assert not any(d.get("content") for d in deltas)
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        plain = m.create_chat_completion(MESSAGES, tools=TOOLS, grammar=GRAMMAR, max_tokens=64, tool_choice="none")
        assert plain["choices"][0]["message"]["content"] == CALL and "tool_calls" not in plain["choices"][0]["message"]
        with pytest.raises(ValueError, match="tool_choice"):
            m.create_chat_completion(MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})


def test_server_returns_the_call(chat_gguf):
    pytest.importorskip("openai")
    from test_server import ServerProcess, post

    s = ServerProcess(chat_gguf, "-np", "2", "-c", "512")
    try:
        client = s.client()
        got = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, tools=TOOLS, max_tokens=64,
                                             extra_body={"grammar": GRAMMAR})
        choice = got.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls[0].function.name == "get_weather"
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 2}
        streamed = [c for c in client.chat.completions.create(model="tiny-chat", messages=MESSAGES, tools=TOOLS,
                                                              max_tokens=64, stream=True,
                                                              extra_body={"grammar": GRAMMAR})]
        calls = [tc for c in streamed if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
        assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
        assert streamed[-1].choices[0].finish_reason == "tool_calls"
        for body, param in (({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"), ({"grammar": "root ::= ("}, "grammar"),
                            ({"grammar": GRAMMAR, "response_format": {"type": "json_object"}}, "grammar")):
            status, answer = post(f"{s.url}/v1/chat/completions", json.dumps(
                {"model": "tiny-chat", "messages": MESSAGES, "tools": TOOLS, **body}).encode())
            assert status == 400 and answer["error"]["param"] == param, answer
    finally:
        assert s.stop() == 0
