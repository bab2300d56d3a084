"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on a server started here on
loopback (as tests/test_server.py does), driven with Anthropic's official Python SDK (`anthropic`),
the client coding agents are built on; the tiny real-vocabulary model carries Qwen3.5's template.

The claims:
- the prompt of a conversation is the template's rendering of the equivalent OpenAI-shaped chat
  (system blocks, text, thinking as reasoning, tool_use as tool calls, tool_result as tool
  messages where they stand, tools as functions), character for character, and count_tokens is
  its length in tokens; a last assistant message is a prefill: the chat before it, the
  generation prompt without reasoning, then its text;
- the events give the reply's blocks in the order the model wrote them (thinking, text, each call,
  the text after), whichever pieces the text arrives in, each block started and stopped once; a
  call cut off by max_tokens stays text;
- a greedy reply is /v1/chat/completions' reply to the same chat (its thinking the reasoning,
  its text the content, its stop_reason the finish_reason's), and the SDK's assembly of the
  streamed events is the message not streamed;
- a reply's <tool_call> is a tool_use block with its input typed by the tool's schema after the
  text before it, stop_reason "tool_use", streamed as input_json_delta;
- stop_sequences stop with "stop_sequence" naming the sequence met, max_tokens with "max_tokens",
  and a max_tokens past the context is cut to the room left ("model_context_window_exceeded");
- Claude Code's billing stamp in the system prompt (a value that changes on every request) is made
  constant, so a conversation's next turn can resume from its kept history;
- errors are Anthropic's bodies ({"type": "error", "error": {"type", "message"}}) with their status,
  raised by the SDK as its own exception classes; the key is read from x-api-key;
- eight concurrent streams on four slots, Anthropic's and OpenAI Responses', each get the reply
  their request gets alone.

Seen red with the server's planted bugs (DELTASPEC_TEST_SERVER_BUG, also read in this process by
the prompt test): tool_result_dropped (the conversion loses a user message's tool results),
billing_stamp_kept, context_not_cut, stop_sequence_unnamed and cross_talk (the concurrent test:
one request's text delivered to another); and, patched for a run, with
ToolCallStream.push_pieces giving the calls after all the text, and with the held tail of an
unclosed call dropped at the end.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")  # CI installs it with the test extra: never skipped there

from deltaspec.generation import GenerationResult, GenerationStats
from deltaspec.server import anthropic as messages_api
from deltaspec.server.schemas import GenerationRequest
from test_server import API_KEY, ServerProcess, files, post  # noqa: F401 (fixture)
from test_tool_calls import CALL, block
from test_tool_calls import TOOLS as OPENAI_WEATHER_TOOLS

N_CTX = 512
MODEL = "tiny-chat"
# the SDK of this day sends no sampling parameters (Anthropic's newest models take none); the server
# still reads them, as older clients send them
GREEDY = {"temperature": 0}
TOOLS = [{"name": "get_weather", "description": "The weather of a city for some days",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "days": {"type": "integer"}}}}]
CONVERSATION = {
    "system": [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in English."}],
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "The tool knows.", "signature": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny, 21 C"}]},
            {"type": "text", "text": "And in Rome?"}]}]}
# the same chat as OpenAI-shaped messages, written out here from the Messages API's meaning
OPENAI_MESSAGES = [
    {"role": "system", "content": [{"type": "text", "text": "You are terse."},
                                   {"type": "text", "text": "Answer in English."}]},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "The tool knows.",
     "tool_calls": [{"id": "toolu_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"},
    {"role": "user", "content": [{"type": "text", "text": "And in Rome?"}]}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]


@pytest.fixture(scope="module")
def server(chat_gguf):
    s = ServerProcess(chat_gguf, "-np", "1", "-c", str(N_CTX), "--api-key", API_KEY)
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


def test_prompt_is_the_templates_chat(chat_served):
    template = chat_served.template
    configs = {None: None, True: {"type": "enabled", "budget_tokens": 1024}, False: {"type": "disabled"},
               "adaptive": {"type": "adaptive"}}  # adaptive: the template's default decides
    for thinking, config in configs.items():
        body = {"model": MODEL, "max_tokens": 8, **CONVERSATION, **({"thinking": config} if config else {})}
        kwargs = {} if thinking in (None, "adaptive") else {"enable_thinking": thinking}
        want = template.render(OPENAI_MESSAGES, add_generation_prompt=True, tools=OPENAI_TOOLS, **kwargs)
        assert messages_api._prompt(body, chat_served, constrained=False) == (want, OPENAI_TOOLS, None, True)
        assert "Sunny, 21 C" in want and "get_weather" in want
        assert messages_api.count_tokens(body, chat_served) == {"input_tokens": len(chat_served.tokenize(want))}
    # a prefill: the chat before it, the generation prompt without reasoning, then its text
    prefilled = {**CONVERSATION, "messages": CONVERSATION["messages"] + [
        {"role": "assistant", "content": [{"type": "text", "text": "In Rome it is"}]}]}
    want = template.render(OPENAI_MESSAGES, add_generation_prompt=True, tools=OPENAI_TOOLS,
                           enable_thinking=False) + "In Rome it is"
    assert messages_api._prompt({"model": MODEL, **prefilled}, chat_served, constrained=False)[0] == want
    assert "<think>\n\n</think>" in want
    # tool_choice none: the tools are shown, no call is parsed
    body = {"model": MODEL, **CONVERSATION, "tool_choice": {"type": "none"}}
    assert messages_api._prompt(body, chat_served, constrained=False)[1] is None


def test_events_do_not_depend_on_how_the_text_comes(chat_served):
    """The reply's blocks in the order written (thinking, text, each call, the text after), the same
    whichever pieces the text arrives in; blank text between calls is no block."""
    import random

    reply = ("I should look it up.\n</think>\n\nChecking both.\n\n" + block("get_weather", city="Rome", days="3")
             + "\n" + block("now") + "\nDone.")
    req = GenerationRequest([1, 2, 3], 100, {"stop": []}, stream=True, include_usage=False, chat=True,
                            thinking_open=True, tools=OPENAI_WEATHER_TOOLS)
    eog = min(chat_served.tokenizer.eog_ids)
    result = GenerationResult([5, 6, eog], reply, "stop", GenerationStats(3, 3, 0.0, 0.0, cached_tokens=1))
    want = [{"type": "thinking", "thinking": "I should look it up.", "signature": ""},
            {"type": "text", "text": "Checking both.\n\n"},
            {"type": "tool_use", "name": "get_weather", "input": {"city": "Rome", "days": 3}},
            {"type": "tool_use", "name": "now", "input": {}},
            {"type": "text", "text": "\nDone."}]
    whole = messages_api.message_body(result, MODEL, req, chat_served.tokenizer)
    assert [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]] == want
    assert (whole["stop_reason"], whole["usage"]) == ("tool_use", {
        "input_tokens": 2, "output_tokens": 3, "cache_read_input_tokens": 1, "cache_creation_input_tokens": 0})
    rng = random.Random(0)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(reply)), rng.randint(1, 20)))
        events = messages_api.MessageEvents(MODEL, req, chat_served.tokenizer)
        got = list(events.start())
        for a, b in zip([0] + cuts, cuts + [len(reply)]):
            got += events.delta(reply[a:b])
        got += events.finish(result)
        message = messages_api.fold(iter(got))
        assert [{k: v for k, v in b.items() if k != "id"} for b in message["content"]] == want
        indices = [e["index"] for e in got if e["type"] == "content_block_start"]
        assert indices == list(range(len(want)))  # each block started once, in order, and stopped
        assert [e["index"] for e in got if e["type"] == "content_block_stop"] == indices
    # a call cut off by max_tokens stays text, the text it cut included
    cut_off = "Checking.\n<tool_call>\n<function=now>\n"
    result = GenerationResult([5, 6], cut_off, "length", GenerationStats(3, 2, 0.0, 0.0))
    message = messages_api.message_body(result, MODEL, GenerationRequest(
        [1, 2, 3], 2, {"stop": []}, stream=False, include_usage=False, chat=True, tools=OPENAI_WEATHER_TOOLS),
        chat_served.tokenizer)
    assert (message["content"], message["stop_reason"]) == ([{"type": "text", "text": cut_off}], "max_tokens")


def test_count_tokens_route(server, chat_served):
    body = {"model": MODEL, **CONVERSATION}
    status, got = post(f"{server.url}/v1/messages/count_tokens", json.dumps(body).encode(), {"x-api-key": API_KEY})
    assert status == 200 and got == messages_api.count_tokens(body, chat_served)


def _text(message, kind: str) -> str | None:
    field = {"thinking": "thinking", "text": "text"}[kind]
    parts = [getattr(b, field) for b in message.content if b.type == kind]
    return "".join(parts) if parts else None


def _same_reply(a, b) -> None:
    """Two messages with the same blocks, stop and token counts (ids differ; a request read from a
    kept history counts its prompt as cache reads)."""
    def blocks(message) -> list:
        return [blk.model_dump(exclude={"id"}) for blk in message.content]

    assert blocks(a) == blocks(b)
    assert (a.stop_reason, a.stop_sequence, a.usage.output_tokens) == (b.stop_reason, b.stop_sequence,
                                                                         b.usage.output_tokens)
    assert (a.usage.input_tokens + a.usage.cache_read_input_tokens
            == b.usage.input_tokens + b.usage.cache_read_input_tokens)


def test_reply_is_the_chat_completions_reply(server, client):
    openai = pytest.importorskip("openai")
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    question = [{"role": "user", "content": "Tell me a story about a cat."}]
    seen = set()
    for thinking in (True, False):
        for max_tokens in (6, 48):
            ask = dict(model=MODEL, max_tokens=max_tokens, messages=question, extra_body=GREEDY,
                       thinking={"type": "enabled", "budget_tokens": 1024} if thinking else {"type": "disabled"})
            message = client.messages.create(**ask)
            chat = oai.chat.completions.create(model=MODEL, max_tokens=max_tokens, temperature=0, messages=question,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
            choice = chat.choices[0]
            assert _text(message, "thinking") == getattr(choice.message, "reasoning_content", None)
            assert (_text(message, "text") or None) == (choice.message.content or None)
            assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice.finish_reason]
            assert message.usage.output_tokens == chat.usage.completion_tokens
            assert message.id.startswith("msg_") and message.model == MODEL and message.role == "assistant"
            with client.messages.stream(**ask) as stream:
                _same_reply(stream.get_final_message(), message)
            seen.add((thinking, message.stop_reason, tuple(b.type for b in message.content)))
    assert any(blocks and blocks[0] == "thinking" for _, _, blocks in seen)  # the thinking path ran
    assert any("text" in blocks for _, _, blocks in seen) and any(r == "max_tokens" for _, r, _ in seen)


def test_tool_use(server, client):
    grammar = "root ::= " + json.dumps("Let me check.\n" + CALL)  # CALL: get_weather(city=Paris, days=2)
    ask = dict(model=MODEL, max_tokens=64, tools=TOOLS,
               messages=[{"role": "user", "content": "Weather in Paris for two days?"}],
               extra_body={**GREEDY, "grammar": grammar})
    message = client.messages.create(**ask)
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Let me check.\n"
    call = message.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris", "days": 2}  # days typed by the schema
    assert call.id.startswith("toolu_") and message.stop_reason == "tool_use"
    with client.messages.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    _same_reply(final, message)
    assert [e.delta.partial_json for e in events if e.type == "content_block_delta"
            and e.delta.type == "input_json_delta"] == [json.dumps({"city": "Paris", "days": 2})]
    # tool_choice none: the same reply is text
    plain = client.messages.create(**{**ask, "tool_choice": {"type": "none"}})
    assert [b.type for b in plain.content] == ["text"] and plain.stop_reason == "end_turn"
    assert plain.content[0].text == "Let me check.\n" + CALL


def test_structured_output(server, client):
    """output_config.format (Anthropic's structured outputs) constrains the reply as /v1/chat/completions'
    response_format does with the same schema."""
    openai = pytest.importorskip("openai")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    question = [{"role": "user", "content": "Which city, for how many days?"}]
    ask = dict(model=MODEL, max_tokens=120, messages=question,
               extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    message = client.messages.create(**ask)
    assert [b.type for b in message.content] == ["text"] and message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    chat = oai.chat.completions.create(model=MODEL, max_tokens=120, temperature=0, messages=question,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "answer", "schema": schema}})
    assert message.content[0].text == chat.choices[0].message.content
    with client.messages.stream(**ask) as stream:
        _same_reply(stream.get_final_message(), message)


def test_stop_reasons(files):
    """On the tiny-vocabulary model that never ends by itself (tests/test_server.py), so every reply
    runs until a stop sequence, max_tokens or the context's end."""
    s = ServerProcess(files[0], "-np", "1", "-c", "256", "--chat-template-file", str(files[1]))
    try:
        client = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0, timeout=60)
        ask = dict(model="tiny", extra_body=GREEDY, messages=[{"role": "user", "content": "go"}])
        long = client.messages.create(max_tokens=40, **ask)
        assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 40
        text = long.content[0].text
        # three plain characters from its second half (the tiny vocabulary's pieces may be cut UTF-8)
        stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 3) if text[i:i + 3].isascii()
                    and text[i:i + 3].isalnum())
        cut = client.messages.create(max_tokens=40, stop_sequences=["\x00never", stop], **ask)
        assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
        assert cut.content[0].text == text[:text.index(stop)]
        # more than the context leaves room for: cut to it, the reply fills the context
        whole = client.messages.create(max_tokens=100_000, **ask)
        assert whole.stop_reason == "model_context_window_exceeded"
        assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens + whole.usage.output_tokens == 256 + 1
        with client.messages.stream(max_tokens=100_000, **ask) as stream:
            _same_reply(stream.get_final_message(), whole)
    finally:
        assert s.stop() == 0, "".join(s.log)


def test_billing_stamp_is_made_constant(chat_served):
    """Claude Code's billing line changes its cch stamp on every request; left in, no request's prompt
    would begin with the kept history of the one before (csrc/slot_history.h), and every turn would
    prefill the whole conversation again."""
    system = ("x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch={};"
              "You are a coding agent.")
    prompts = {messages_api._prompt({"model": MODEL, "system": [{"type": "text", "text": system.format(stamp)}],
                                     "messages": [{"role": "user", "content": "List the files."}]},
                                    chat_served, constrained=False)[0] for stamp in ("a5145", "0b7e2")}
    assert len(prompts) == 1
    [prompt] = prompts
    assert "cc_version=2.1.101.e51; cc_entrypoint=cli; cch=;You are a coding agent." in prompt
    other = "cch=a5145; is not a billing line"  # the same words elsewhere are left as they are
    assert other in messages_api._prompt({"model": MODEL, "system": other, "messages": [
        {"role": "user", "content": "hi"}]}, chat_served, constrained=False)[0]


def test_errors(server, client):
    ok = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    cases = [
        ({"max_tokens": None}, 400, "max_tokens"),
        ({"model": "claude-sonnet-4-5"}, 404, "does not exist"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, 400, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                      "media_type": "image/png", "data": "AA=="}}]}]},
         400, "messages[0].content[0]"),
        ({"tool_choice": {"type": "tool", "name": "x"}, "tools": TOOLS}, 400, "tool_choice"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools[0]"),
        ({"thinking": {"type": "enabled"}}, 400, "budget_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "so "}]}, 400,
         "trailing whitespace"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "so"}],
          "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "prefill"),
        ({"messages": [{"role": "user", "content": "word " * 600}]}, 400, "prompt is too long"),
        ({"stop_sequences": "END"}, 400, "stop_sequences"),
        ({"temperature": "hot"}, 400, "temperature"),
        ({"output_config": {"format": {"type": "json_schema"}}}, 400, "output_config.format"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {}}}, "grammar": "root ::= \"a\""}, 400,
         "both constrain"),
    ]
    for change, status, words in cases:
        body = {k: v for k, v in {**ok, **change}.items() if v is not None}
        code, answer = post(f"{server.url}/v1/messages", json.dumps(body).encode(), {"x-api-key": API_KEY})
        assert code == status and answer["type"] == "error", (change, answer)
        assert words in answer["error"]["message"], (change, answer)
        assert answer["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(**{**ok, "max_tokens": 0})
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**{**ok, "model": "claude-opus-4"})
    stranger = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(**ok)
    assert [m.id for m in client.models.list()] == [MODEL]  # /v1/models in Anthropic's shape too
    code, answer = post(f"{server.url}/v1/messages", b"{not json", {"x-api-key": API_KEY})
    assert code == 400 and answer["error"]["type"] == "invalid_request_error"
    assert client.messages.create(**ok).stop_reason in ("end_turn", "max_tokens")  # still serving


def test_concurrent_streams_are_each_their_own(files):
    """Eight clients at once on a server with four slots (requests join and leave the running batch),
    streaming Anthropic's and OpenAI's Responses events: each reply is what its request gets alone
    (the tiny-vocabulary F32 model, whose batch rows are bitwise its single rows on the CPU)."""
    from concurrent.futures import ThreadPoolExecutor

    openai = pytest.importorskip("openai")
    s = ServerProcess(files[0], "-np", "4", "-c", "1024", "--chat-template-file", str(files[1]))
    try:
        claude = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0, timeout=120)
        oai = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)

        def message(i: int) -> str:
            with claude.messages.stream(model="tiny", max_tokens=12 + i, extra_body=GREEDY,
                                        messages=[{"role": "user", "content": f"story {i}"}]) as stream:
                final = stream.get_final_message()
            assert final.usage.output_tokens == 12 + i
            return final.content[0].text

        def response(i: int) -> str:
            events = list(oai.responses.create(model="tiny", input=f"story {i}", max_output_tokens=12 + i,
                                               temperature=0, stream=True))
            assert events[-1].response.usage.output_tokens == 12 + i
            return events[-1].response.output_text

        for ask in (message, response):
            alone = [ask(i) for i in range(8)]
            with ThreadPoolExecutor(8) as pool:
                together = list(pool.map(ask, range(8)))
            assert together == alone and len(set(alone)) == 8, ask.__name__
    finally:
        assert s.stop() == 0, "".join(s.log)
