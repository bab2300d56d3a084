"""deltaspec serve against llama-server, built from the same source distribution, on the same GGUF
(the tiny real-vocabulary model with Qwen3.5's template): Anthropic's /v1/messages and OpenAI's
/v1/responses, which both servers turn into a chat for the model's template and answer in blocks /
items.

The claims, for requests in which the two APIs' meaning leaves no room (a plain question, thinking
enabled, a conversation with system blocks, tools, an assistant turn with thinking, text and a tool
call, and its tool result): the prompt has the same tokens' count in both (count_tokens; the
usage's input tokens) and the greedy reply is the same, block for block and item for item
(thinking / reasoning, text), with the same output tokens and, for messages, stop_reason; with a
reasoning budget (thinking_budget_tokens, Anthropic's budget_tokens) the block ends at the same
token and the text after it is the same.

Where llama-server departs from the APIs (not compared): it ignores thinking {"type": "disabled"}, a
stop sequence ends with "end_turn" (here "stop_sequence"), a response cut by max_output_tokens is
"completed" (here "incomplete", as OpenAI's), and a user message of tool results then text puts the
text first (here where it stands).

Seen red with the server's planted bugs tool_result_dropped and function_output_dropped (the
conversation's token counts part).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_server import ServerProcess, post
from test_server_anthropic import CONVERSATION
from test_server_responses import INPUT
from test_server_responses import TOOLS as RESPONSES_TOOLS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.peers.llama_cpp import build_llama_cpp  # noqa: E402
from bench.server_bench import Server, free_port  # noqa: E402

pytestmark = pytest.mark.peer
N_CTX = 512
N_PREDICT = 24
MODEL = "tiny-chat"
MESSAGES = {
    "question": {"messages": [{"role": "user", "content": "Tell me a story."}]},
    "thinking": {"thinking": {"type": "enabled", "budget_tokens": 1024},
                 "messages": [{"role": "user", "content": "Tell me a story."}]},
    # the last user message holds the tool result alone (llama-server puts a text after it first)
    "conversation": {**CONVERSATION, "messages": CONVERSATION["messages"][:-1] + [
        {"role": "user", "content": CONVERSATION["messages"][-1]["content"][:1]}]}}
RESPONSES = {
    "question": {"input": "Tell me a story."},
    "conversation": {"instructions": "You are terse.", "tools": RESPONSES_TOOLS, "input": INPUT}}


@pytest.fixture(scope="module")
def llama_server(chat_gguf, tmp_path_factory):
    binary = build_llama_cpp(quiet=True, extra_targets=["llama-server"]) / "llama-server"
    port = free_port()
    server = Server("llama-server", [str(binary), "-m", str(chat_gguf), "--host", "127.0.0.1", "--port", str(port),
                                     "-c", str(N_CTX), "-np", "1", "-t", "1"],
                    port, tmp_path_factory.mktemp("peer") / "peer", "llama-server")
    try:
        server.ready(timeout=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ours(chat_gguf):
    s = ServerProcess(chat_gguf, "-np", "1", "-c", str(N_CTX))
    yield s.url
    assert s.stop() == 0, "".join(s.log)


def _ask(url: str, path: str, body: dict) -> dict:
    status, answer = post(f"{url}{path}", json.dumps({"model": MODEL, "temperature": 0, **body}).encode())
    assert status == 200, answer
    return answer


@pytest.mark.parametrize("name", list(MESSAGES))
def test_messages_as_llama_server(name, llama_server, ours):
    body = {"max_tokens": N_PREDICT, **MESSAGES[name]}
    counts = [_ask(url, "/v1/messages/count_tokens", body)["input_tokens"] for url in (llama_server, ours)]
    assert counts[0] == counts[1]
    theirs, mine = (_ask(url, "/v1/messages", body) for url in (llama_server, ours))
    text = {"thinking": "thinking", "text": "text"}
    assert [(b["type"], b[text[b["type"]]]) for b in mine["content"]] == \
        [(b["type"], b[text[b["type"]]]) for b in theirs["content"]]
    assert mine["stop_reason"] == theirs["stop_reason"]
    assert mine["usage"]["output_tokens"] == theirs["usage"]["output_tokens"]
    assert sum(mine["usage"].get(k, 0) for k in ("input_tokens", "cache_read_input_tokens")) == counts[0]
    if name == "thinking":
        assert mine["content"][0]["type"] == "thinking"  # the reasoning path ran


@pytest.mark.parametrize("name", list(RESPONSES))
def test_responses_as_llama_server(name, llama_server, ours):
    body = {"max_output_tokens": N_PREDICT, **RESPONSES[name]}
    theirs, mine = (_ask(url, "/v1/responses", body) for url in (llama_server, ours))

    def items(response: dict) -> list:
        return [(item["type"], [part["text"] for part in item.get("content", [])]) for item in response["output"]]

    assert items(mine) == items(theirs) and items(mine)
    for key in ("input_tokens", "output_tokens"):
        assert mine["usage"][key] == theirs["usage"][key]
    assert mine["status"] == ("incomplete" if mine["usage"]["output_tokens"] == N_PREDICT else "completed")


@pytest.mark.parametrize("budget,message", [(3, ""), (8, ""), (4, " Enough, time to answer.")])
def test_reasoning_budget_as_llama_server(budget, message, llama_server, ours):
    """A reasoning budget (deltaspec.reasoning_budget) on /v1/chat/completions (llama-server's
    thinking_budget_tokens) and /v1/messages (Anthropic's thinking.budget_tokens, which llama-server
    maps to it), with and without llama-server's reasoning_budget_message: the same reasoning, cut at
    the same token, and the same text after it."""
    question = [{"role": "user", "content": "Tell me a story."}]
    chat = {"messages": question, "max_tokens": N_PREDICT, "thinking_budget_tokens": budget,
            **({"reasoning_budget_message": message} if message else {})}
    theirs, mine = (_ask(url, "/v1/chat/completions", chat)["choices"][0]["message"] for url in (llama_server, ours))
    # (llama-server keeps the reasoning's last newline, the one forced before </think>; deltaspec strips it)
    assert mine.get("reasoning_content") == theirs.get("reasoning_content").strip()
    assert mine["content"] == theirs["content"] and mine["content"]  # the block ended: text after it
    messages = {"messages": question, "max_tokens": N_PREDICT, "thinking": {"type": "enabled", "budget_tokens": budget}}
    theirs, mine = (_ask(url, "/v1/messages", messages)["content"] for url in (llama_server, ours))
    assert [b["type"] for b in mine] == ["thinking", "text"]
    assert mine[0]["thinking"] == theirs[0]["thinking"].strip() and mine[1]["text"] == theirs[1]["text"]
