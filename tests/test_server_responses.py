"""OpenAI's Responses API (/v1/responses) on a server started here on loopback (as
tests/test_server.py does), driven with the official `openai` client's `responses` (whose stream
helper checks every event against the items it has seen); the tiny real-vocabulary model carries
Qwen3.5's template.

The claims:
- the prompt of a request is the template's rendering of the equivalent chat (instructions as the
  system message, input messages, a reasoning item as the next assistant message's reasoning,
  function_call items as that message's tool calls, function_call_output items as tool messages,
  function tools as the template's tools), character for character;
- the events give the output items in the order the model wrote them (reasoning, message, each
  function call, the text after), whichever pieces the text arrives in, with consecutive sequence
  numbers, each item added, filled and done once;
- a greedy response is /v1/chat/completions' reply to the same chat (its reasoning item the
  reasoning, its message the content), status completed or, at max_output_tokens, incomplete; the
  stream's last event carries the response not streamed, and the client's stream helper assembles
  the same output;
- a reply's <tool_call> is a function_call item with the arguments typed by the schema;
  text.format json_schema constrains the reply as a chat's response_format;
- refusals (stored responses, non-function tools, images, a forced call of an unknown function, unknown model, a
  request beyond the context) are 4xx with OpenAI's error body.

Seen red with the server's planted bugs (DELTASPEC_TEST_SERVER_BUG, also read in this process by the
prompt test): function_output_dropped and incomplete_as_completed; and, patched for a run, with
ToolCallStream.push_pieces giving the calls after all the text.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

openai = pytest.importorskip("openai")  # CI installs it with the test extra: never skipped there

from deltaspec.generation import GenerationResult, GenerationStats
from deltaspec.server import openai_responses as responses_api
from deltaspec.server.schemas import GenerationRequest
from test_server import API_KEY, ServerProcess, post
from test_tool_calls import CALL, block
from test_tool_calls import TOOLS as CHAT_TOOLS

N_CTX = 512
MODEL = "tiny-chat"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather of a city for some days",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]
ARGUMENTS = json.dumps({"city": "Paris", "days": 2})
INPUT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "reasoning", "id": "rs_1", "summary": [],
     "content": [{"type": "reasoning_text", "text": "The tool knows."}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ARGUMENTS},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    {"role": "user", "content": [{"type": "input_text", "text": "And in Rome?"}]}]
# the same chat as OpenAI chat messages, written out here from the Responses API's meaning
CHAT_MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "The tool knows.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    {"role": "user", "content": [{"type": "text", "text": "And in Rome?"}]}]
CHAT_FORM_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                     "parameters": t["parameters"]}} for t in TOOLS]


@pytest.fixture(scope="module")
def server(chat_gguf):
    s = ServerProcess(chat_gguf, "-np", "1", "-c", str(N_CTX), "--api-key", API_KEY)
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_prompt_is_the_templates_chat(chat_served):
    for effort, thinking in ((None, None), ("high", True), ("none", False)):
        body = {"model": MODEL, "instructions": "You are terse.", "input": INPUT, "tools": TOOLS,
                **({"reasoning": {"effort": effort}} if effort else {})}
        req = responses_api.parse_responses(body, chat_served)
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        want = chat_served.template.render(CHAT_MESSAGES, add_generation_prompt=True, tools=CHAT_FORM_TOOLS, **kwargs)
        assert req.prompt == chat_served.tokenize(want) and req.tools == CHAT_FORM_TOOLS
        assert "Sunny, 21 C" in want and "The tool knows." not in want  # (the template drops old reasoning)
    # a string input is one user message; tool_choice none shows the tools and parses no call
    req = responses_api.parse_responses({"model": MODEL, "input": "Hi", "tools": TOOLS, "tool_choice": "none"},
                                        chat_served)
    assert req.prompt == chat_served.tokenize(chat_served.template.render([{"role": "user", "content": "Hi"}],
                                                                add_generation_prompt=True, tools=CHAT_FORM_TOOLS))
    assert req.tools is None


def _strip_ids(output: list) -> list:
    """Output items without their ids (each response makes new ones) and unset fields (the stream
    helper's parsed items carry `parsed: None`)."""
    return [{k: v for k, v in (item if isinstance(item, dict) else item.model_dump(exclude_none=True)).items()
             if k not in ("id", "call_id")} for item in output]


def test_events_do_not_depend_on_how_the_text_comes(chat_served):
    reply = ("I should look it up.\n</think>\n\nChecking both.\n\n" + block("get_weather", city="Rome", days="3")
             + "\n" + block("now") + "\nDone.")
    req = GenerationRequest([1, 2, 3], 100, {}, stream=True, include_usage=False, chat=True, thinking_open=True,
                            tools=CHAT_TOOLS)
    eog = min(chat_served.tokenizer.eog_ids)
    result = GenerationResult([5, 6, eog], reply, "stop", GenerationStats(3, 3, 0.0, 0.0, cached_tokens=1))
    want = [{"type": "reasoning", "summary": [],
             "content": [{"type": "reasoning_text", "text": "I should look it up."}],
             "status": "completed"},
            {"type": "message", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "Checking both.\n\n", "annotations": [], "logprobs": []}]},
            {"type": "function_call", "name": "get_weather", "arguments": json.dumps({"city": "Rome", "days": 3}),
             "status": "completed"},
            {"type": "function_call", "name": "now", "arguments": "{}", "status": "completed"},
            {"type": "message", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "\nDone.", "annotations": [], "logprobs": []}]}]
    whole = responses_api.response_body(result, MODEL, req, chat_served.tokenizer)
    assert _strip_ids(whole["output"]) == want and whole["status"] == "completed"
    rng = random.Random(0)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(reply)), rng.randint(1, 20)))
        events = responses_api.ResponseEvents(MODEL, req, chat_served.tokenizer)
        got = list(events.start())
        for a, b in zip([0] + cuts, cuts + [len(reply)]):
            got += events.delta(reply[a:b])
        got += events.finish(result)
        assert [e["sequence_number"] for e in got] == list(range(len(got)))
        assert got[0]["type"] == "response.created" and got[-1]["type"] == "response.completed"
        assert _strip_ids(got[-1]["response"]["output"]) == want
        added = [e["output_index"] for e in got if e["type"] == "response.output_item.added"]
        done = [e["output_index"] for e in got if e["type"] == "response.output_item.done"]
        assert added == done == list(range(len(want)))
        open_item = None  # every event of an item comes between its added and its done
        for e in got:
            if e["type"] == "response.output_item.added":
                assert open_item is None
                open_item = e["output_index"]
            elif e["type"] == "response.output_item.done":
                assert e["output_index"] == open_item
                open_item = None
            elif "output_index" in e:
                assert e["output_index"] == open_item, e


def test_reply_is_the_chat_completions_reply(client):
    question = [{"role": "user", "content": "Tell me a story about a cat."}]
    kinds = set()
    for effort in ("high", "none"):
        for max_tokens in (6, 48):
            ask = dict(model=MODEL, input="Tell me a story about a cat.", max_output_tokens=max_tokens, temperature=0,
                       reasoning={"effort": effort})
            response = client.responses.create(**ask)
            chat = client.chat.completions.create(
                model=MODEL, max_tokens=max_tokens, temperature=0, messages=question,
                extra_body={"chat_template_kwargs": {"enable_thinking": effort != "none"}})
            choice = chat.choices[0]
            reasoning = [c.text for item in response.output if item.type == "reasoning" for c in item.content]
            assert ("".join(reasoning) or None) == getattr(choice.message, "reasoning_content", None)
            assert (response.output_text or None) == (choice.message.content or None)
            assert response.status == {"stop": "completed", "length": "incomplete"}[choice.finish_reason]
            if response.status == "incomplete":
                assert response.incomplete_details.reason == "max_output_tokens"
            assert response.usage.output_tokens == chat.usage.completion_tokens
            assert response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens
            events = list(client.responses.create(stream=True, **ask))
            assert events[-1].response.model_dump(exclude={"id", "created_at", "usage"}) | {"output": None} \
                == response.model_dump(exclude={"id", "created_at", "usage"}) | {"output": None}
            assert _strip_ids(events[-1].response.output) == _strip_ids(response.output)
            if response.status == "completed":
                with client.responses.stream(**ask) as stream:
                    assert _strip_ids(stream.get_final_response().output) == _strip_ids(response.output)
            kinds.add((response.status, tuple(item.type for item in response.output)))
    assert any(items and items[0] == "reasoning" for _, items in kinds)  # the reasoning path ran
    assert any("message" in items for _, items in kinds) and any(s == "incomplete" for s, _ in kinds)


def test_function_call_and_structured_output(client):
    grammar = "root ::= " + json.dumps("Let me check.\n" + CALL)  # CALL: get_weather(city=Paris, days=2)
    ask = dict(model=MODEL, input="Weather in Paris for two days?", tools=TOOLS, max_output_tokens=64, temperature=0,
               extra_body={"grammar": grammar})
    response = client.responses.create(**ask)
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == "Let me check.\n"
    call = response.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    with client.responses.stream(**ask) as stream:
        assert _strip_ids(stream.get_final_response().output) == _strip_ids(response.output)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    structured = client.responses.create(model=MODEL, input="Which city, for how many days?", temperature=0,
                                         max_output_tokens=120,
                                         text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(structured.output_text), schema)
    chat = client.chat.completions.create(model=MODEL, max_tokens=120, temperature=0,
                                          messages=[{"role": "user", "content": "Which city, for how many days?"}],
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "answer", "schema": schema}})
    assert structured.output_text == chat.choices[0].message.content


def test_errors(server, client):
    ok = {"model": MODEL, "input": "hi", "max_output_tokens": 8}
    cases = [
        ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
        ({"input": None}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400,
         "input"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "x"}}, 400, "tool_choice"),
        ({"reasoning": {"effort": "extreme"}}, 400, "reasoning"),
        ({"text": {"format": {"type": "yaml"}}}, 400, "text"),
        ({"model": "gpt-5"}, 404, "model"),
        ({"max_output_tokens": 100_000}, 400, "max_output_tokens"),
        ({"input": "word " * 600}, 400, "prompt"),
    ]
    for change, status, param in cases:
        body = {k: v for k, v in {**ok, **change}.items() if v is not None}
        code, answer = post(f"{server.url}/v1/responses", json.dumps(body).encode(),
                            {"Authorization": f"Bearer {API_KEY}"})
        assert code == status and answer["error"]["param"] == param, (change, answer)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**{**ok, "previous_response_id": "resp_1"})
    assert client.responses.create(**ok).status in ("completed", "incomplete")  # still serving
