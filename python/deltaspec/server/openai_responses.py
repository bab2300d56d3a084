"""OpenAI's Responses API: POST /v1/responses, as llama-server serves it, for clients and agents
built on `client.responses` (stateless: the whole conversation comes with each request).

A request becomes the chat the model's template renders (server.schemas.chat_prompt):
`instructions` the system message; `input` a string (one user message) or items: messages
(role user / system / developer with input_text parts or a string, assistant with output_text
parts), `function_call` items (an assistant's tool calls, merged into the assistant message before
them), `function_call_output` items (tool messages) and `reasoning` items (the next assistant
message's reasoning), in their order; `tools` (function tools: name, description, parameters) the
template's tools. `text.format` json_schema / json_object is enforced while decoding, as a chat's
response_format; `reasoning.effort` "none" or "minimal" turns the template's reasoning off, any other
effort on (absent: the template's default); `max_output_tokens` is checked against the context as a
chat's max_tokens; temperature defaults to 1, as OpenAI's.

The reply is output items in the order the model wrote them: a reasoning item (reasoning_text
content: the text up to </think> when the prompt opened one), message items (output_text) and a
function_call item per <tool_call> (deltaspec.tool_calls); blank text around calls is no item. A
stream sends OpenAI's events (response.created, response.in_progress, output_item.added /
content_part.added / *.delta / *.done / output_item.done per item, then response.completed, or
response.incomplete when max_output_tokens ended it), each with its sequence_number; a response
that is not streamed is the one the last event carries, so both agree. status: completed,
incomplete (incomplete_details.reason "max_output_tokens") or cancelled. Nothing is stored
(`store` is answered false): previous_response_id is refused, as are non-function tools, input
images and files (400s naming the field). tool_choice "required" / {"type": "function", "name": ...}
force the call by grammar (deltaspec.tool_call_grammar; parallel_tool_calls false: one call).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator

from ..chat import THINK_CLOSE, prompt_opens_reasoning
from ..generation import GenerationResult
from ..tool_call_grammar import ForcedToolCall
from .errors import bad_request
from .planted import planted
from .reply_blocks import ReplyBlocks
from .schemas import (GenerationRequest, Served, _check_body, _get, _grammar, _max_tokens, _prompt_ids, _sampling,
                      _type, chat_prompt, check_forced_call, reasoning_budget, tool_call_options)

TEMPERATURE_DEFAULT = 1.0  # OpenAI's, for the Responses API


def _invalid(message: str, param: str) -> Exception:
    return bad_request(message, param, "invalid_value")


def _parts_text(parts: Any, where: str, kinds: tuple[str, ...]) -> list[dict]:
    """A message's content as the template's text parts (a string is one)."""
    if isinstance(parts, str):
        return [{"type": "text", "text": parts}]
    if not isinstance(parts, list):
        raise bad_request(f"'{where}' must be a string or an array of content parts, got {_type(parts)}", "input",
                          "invalid_type")
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"'{where}[{j}]' is an {kind} part; this server's model reads text only", "input",
                              "unsupported")
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise _invalid(f"'{where}[{j}]' must be a part of type {' or '.join(kinds)} with a string 'text'",
                           "input")
        out.append({"type": "text", "text": part["text"]})
    return out


def _assistant(out: list[dict]) -> dict:
    """The assistant message that calls and reasoning join: the last message if it is an assistant's
    with no tool results after it, else a new one."""
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": ""})
    return out[-1]


def _messages(body: dict) -> list[dict]:
    """The template's messages of `instructions` and `input`."""
    out: list[dict] = []
    instructions = _get(body, "instructions", (str,), "a string")
    if instructions:
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request(f"'input' must be a string or a non-empty array of items, got {_type(items)}", "input",
                          "invalid_type")
    reasoning: list[str] = []  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{where}' must be an object, got {_type(item)}", "input", "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role in ("user", "system", "developer"):
                out.append({"role": "system" if role == "developer" else role,
                            "content": _parts_text(item.get("content"), f"{where}.content", ("input_text",))})
            elif role == "assistant":
                parts = _parts_text(item.get("content"), f"{where}.content", ("output_text", "input_text"))
                message = {"role": "assistant", "content": "".join(p["text"] for p in parts)}
                if reasoning:
                    message["reasoning_content"], reasoning = "".join(reasoning), []
                out.append(message)
            else:
                raise _invalid(f"'{where}.role' must be user, system, developer or assistant, got {str(role)[:40]!r}",
                               "input")
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(call_id, str):
                raise bad_request(f"'{where}' (function_call) must have string 'name', 'arguments' and 'call_id'",
                                  "input", "invalid_type")
            message = _assistant(out)
            if reasoning:
                message["reasoning_content"], reasoning = message.get("reasoning_content", "") + "".join(reasoning), []
            message.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(call_id, str):
                raise bad_request(f"'{where}.call_id' must be a string", "input", "invalid_type")
            text = "".join(p["text"] for p in _parts_text(output, f"{where}.output", ("input_text", "output_text")))
            if planted("function_output_dropped"):
                continue
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            for part in (item.get("content") or []) + (item.get("summary") or []):
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    reasoning.append(part["text"])
        else:
            raise bad_request(f"'{where}.type' {str(kind)[:40]!r} is not an input item this server reads (message, "
                              "function_call, function_call_output, reasoning)", "input", "unsupported")
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = _get(body, "tools", (list,), "an array of tools")
    if not tools:
        return None
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else _type(tool)
            raise bad_request(f"'tools[{j}]' is a {str(kind)[:40]!r} tool; this server runs function tools only",
                              "tools", "unsupported")
        name, parameters = tool.get("name"), tool.get("parameters") or {}
        if not isinstance(name, str) or not name or not isinstance(parameters, dict):
            raise bad_request(f"'tools[{j}]' must have a non-empty string 'name' and an object 'parameters'", "tools",
                              "invalid_type")
        out.append({"type": "function", "function": {"name": name, "description": tool.get("description") or "",
                                                     "parameters": parameters}})
    return out


def _tool_choice(body: dict) -> tuple[str | dict, ForcedToolCall | None]:
    """tool_choice (echoed), and the call it forces: "required" one of the tools, {"type":
    "function", "name": ...} that one (deltaspec.tool_call_grammar); parallel_tool_calls false: one call."""
    choice = body.get("tool_choice", "auto")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _invalid(f"'parallel_tool_calls' must be true or false, got {parallel!r:.40}", "parallel_tool_calls")
    if choice in ("auto", "none"):
        return choice, None
    if choice == "required":
        return choice, ForcedToolCall(None, parallel)
    name = choice.get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(name, str) or not name:
        raise _invalid(f"'tool_choice' must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                       f"\"name\": ...}}, got {str(choice)[:60]!r}", "tool_choice")
    return choice, ForcedToolCall(name, parallel)


def _thinking(body: dict) -> bool | None:
    reasoning = _get(body, "reasoning", (dict,), "an object", {})
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise _invalid(f"'reasoning.effort' must be none, minimal, low, medium, high or xhigh, got {effort!r:.40}",
                       "reasoning")
    return effort not in ("none", "minimal")


def _format_grammar(body: dict):
    """text.format as a grammar (json_schema, json_object), or None for text."""
    from ..errors import GrammarError
    from ..grammar import response_format_grammar

    text = _get(body, "text", (dict,), "an object", {})
    form = text.get("format")
    if form is None or (isinstance(form, dict) and form.get("type") == "text"):
        return None
    if not isinstance(form, dict) or form.get("type") not in ("json_schema", "json_object"):
        raise _invalid("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"schema\": {...}}", "text")
    chat_form = {"type": "json_object"} if form["type"] == "json_object" else {
        "type": "json_schema", "json_schema": {"schema": form.get("schema")}}
    try:
        return response_format_grammar(chat_form)
    except GrammarError as e:
        raise _invalid(f"'text.format': {e}", "text") from None


def parse_responses(body: Any, served: Served) -> GenerationRequest:
    body = _check_body(body, served)
    if body.get("previous_response_id") is not None:
        raise bad_request("'previous_response_id' is not supported: this server stores no responses; send the "
                          "whole conversation as 'input'", "previous_response_id", "unsupported")
    if "input" not in body:
        raise bad_request("'input' is required", "input", "missing")
    grammar = _format_grammar(body)
    if body.get("grammar") is not None:  # llama-server's field, as on every generation route here
        if grammar is not None:
            raise _invalid("'grammar' and 'text.format' both constrain the reply; send one", "grammar")
        grammar = _grammar(body)
    tools, (choice, forced), thinking = _tools(body), _tool_choice(body), _thinking(body)
    check_forced_call(forced, tools, grammar is not None, "'text.format' or 'grammar'")
    if grammar is not None and thinking:
        raise _invalid("'text.format' cannot be combined with reasoning (it constrains the whole reply, which "
                       "then has no reasoning)", "reasoning")
    chat = {"messages": _messages(body), "tools": tools,
            **({"enable_thinking": thinking} if thinking is not None else {})}
    prompt = chat_prompt(chat, served, constrained=grammar is not None)
    thinking_open = prompt_opens_reasoning(prompt)
    ids = _prompt_ids(prompt, served, "input")
    max_tokens = _max_tokens(body, ("max_output_tokens",), len(ids), served, None)
    temperature = body.get("temperature")
    sampling, seed = _sampling({**body, "temperature": TEMPERATURE_DEFAULT if temperature is None else temperature},
                               chat=False)
    stream = _get(body, "stream", (bool,), "true or false", False)
    options = {**sampling, "seed": seed, **({"grammar": grammar} if grammar is not None else {}),
               **reasoning_budget(body, served, grammar is not None, thinking_open)}
    parsed = tools if choice != "none" else None
    options.update(tool_call_options(parsed, forced, body.get("parallel_tool_calls", True), thinking_open, options))
    # what the response repeats of the request
    echoed = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
              "temperature": sampling.get("temperature"), "top_p": sampling.get("top_p", 1.0),
              "tools": body.get("tools") or [], "tool_choice": choice,
              "parallel_tool_calls": forced.parallel if forced is not None else body.get("parallel_tool_calls", True),
              "text": body.get("text") or {"format": {"type": "text"}},
              "reasoning": {"effort": _get(body, "reasoning", (dict,), "an object", {}).get("effort"), "summary": None},
              "metadata": body.get("metadata") or {}}
    return GenerationRequest(ids, max_tokens, options, stream, include_usage=False, chat=True,
                             thinking_open=thinking_open, tools=parsed,
                             echoed=echoed)


# --- the answer ----------------------------------------------------------------------------------

def event_bytes(event: dict) -> bytes:
    """One server-sent event as OpenAI's Responses streams send them: its type on the `event:` line."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def _reasoning_tokens(result: GenerationResult, tokenizer, thinking_open: bool) -> int:
    """Generated tokens up to and including the one that completes </think> (all of them when the
    block never closed): the shortest prefix whose text holds the tag, found by bisection."""
    if not thinking_open:
        return 0
    tokens = result.tokens
    if THINK_CLOSE not in tokenizer.decode(tokens, special=True):
        return len(tokens)
    lo, hi = 1, len(tokens)  # the prefix of hi tokens holds the tag
    while lo < hi:
        mid = (lo + hi) // 2
        if THINK_CLOSE in tokenizer.decode(tokens[:mid], special=True):
            hi = mid
        else:
            lo = mid + 1
    return hi


class ResponseEvents(ReplyBlocks):
    """The events of one response, delta by delta (the stream builders' interface of
    deltaspec.openai_stream): response.created and .in_progress, each output item's events in the
    order the reply writes them (server.reply_blocks), then response.completed (or .incomplete),
    whose response is the whole answer."""

    def __init__(self, model: str, req: GenerationRequest, tokenizer):
        super().__init__(req.thinking_open, req.tools)
        self._tokenizer, self._thinking_open = tokenizer, req.thinking_open
        self._response = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
                          "status": "in_progress", "error": None, "incomplete_details": None, "model": model,
                          "output": [], "previous_response_id": None, "store": False, "truncation": "disabled",
                          "usage": None, "user": None, **req.echoed}
        self._sequence = 0

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _snapshot(self) -> dict:
        return json.loads(json.dumps(self._response))  # what the event says stays as it was then

    def start(self) -> Iterator[dict]:
        yield self._event("response.created", response=self._snapshot())
        yield self._event("response.in_progress", response=self._snapshot())

    def finish(self, result: GenerationResult, include_usage: bool = False) -> Iterator[dict]:
        yield from self._rest()
        s = result.stats
        status = {"length": "incomplete", "cancelled": "cancelled"}.get(result.finish_reason, "completed")
        if planted("incomplete_as_completed"):
            status = "completed"
        self._response.update(
            status=status, incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            usage={"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.cached_tokens},
                   "output_tokens": s.generated_tokens,
                   "output_tokens_details": {"reasoning_tokens": _reasoning_tokens(result, self._tokenizer,
                                                                                   self._thinking_open)},
                   "total_tokens": s.prompt_tokens + s.generated_tokens})
        yield self._event(f"response.{status}", response=self._snapshot())

    def _item(self) -> tuple[dict, dict]:
        """The item being written and where its events point."""
        item = self._response["output"][-1]
        return item, {"item_id": item["id"], "output_index": len(self._response["output"]) - 1, "content_index": 0}

    def _add(self, item: dict) -> dict:
        self._response["output"].append(item)
        return self._event("response.output_item.added", output_index=len(self._response["output"]) - 1,
                           item=json.loads(json.dumps(item)))

    def _open(self, kind: str) -> Iterator[dict]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield self._add(item)
        item["content"].append(part)
        yield self._event("response.content_part.added", **self._item()[1], part=dict(part))

    def _append(self, text: str) -> Iterator[dict]:
        item, where = self._item()
        item["content"][0]["text"] += text
        if item["type"] == "reasoning":
            yield self._event("response.reasoning_text.delta", **where, delta=text)
        else:
            yield self._event("response.output_text.delta", **where, delta=text, logprobs=[])

    def _close(self, kind: str) -> Iterator[dict]:
        item, where = self._item()
        part = item["content"][0]
        if kind == "reasoning":
            yield self._event("response.reasoning_text.done", **where, text=part["text"])
        else:
            yield self._event("response.output_text.done", **where, text=part["text"], logprobs=[])
        yield self._event("response.content_part.done", **where, part=dict(part))
        item["status"] = "completed"
        yield self._event("response.output_item.done", output_index=where["output_index"],
                          item=json.loads(json.dumps(item)))

    def _call(self, call: dict) -> Iterator[dict]:
        fn = call["function"]
        yield self._add({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                         "name": fn["name"], "arguments": "", "status": "in_progress"})
        item, where = self._item()
        del where["content_index"]
        yield self._event("response.function_call_arguments.delta", **where, delta=fn["arguments"])
        item.update(arguments=fn["arguments"], status="completed")
        yield self._event("response.function_call_arguments.done", **where, name=fn["name"],
                          arguments=fn["arguments"])
        yield self._event("response.output_item.done", output_index=where["output_index"], item=dict(item))


def response_body(result: GenerationResult, model: str, req: GenerationRequest, tokenizer) -> dict:
    """The response not streamed: what the stream's last event carries."""
    events = ResponseEvents(model, req, tokenizer)
    *_, last = (event for part in (events.start(), events.delta(result.text), events.finish(result))
                for event in part)
    return last["response"]
