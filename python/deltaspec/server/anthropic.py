"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, as llama-server serves
them, for clients built on Anthropic's SDK (coding agents pointed at a local server through
ANTHROPIC_BASE_URL).

A request becomes the chat the model's template renders (server.schemas.chat_prompt): `system` (a
string or text blocks) the system message; a user message's text blocks its content and its
`tool_result` blocks tool messages, in the order they stand; an assistant message's text, its
`thinking` blocks its reasoning and its `tool_use` blocks its tool calls; `tools` ({name,
description, input_schema}) the template's tools. A last assistant message is a prefill: the reply
continues its text (the prompt is the chat before it, the generation prompt without a reasoning
block, then that text). `thinking` {"type": "enabled"} / {"type": "disabled"} switches the
template's reasoning on or off (absent: the template's default); its budget_tokens is enforced as a
reasoning budget (deltaspec.reasoning_budget: the <think> block's end forced once it holds that
many tokens). `max_tokens` is required; more than the context leaves room for is cut to that room, and
a reply that then fills the context stops with "model_context_window_exceeded".

The reply is content blocks in the order the model wrote them: a thinking block (the text up to
</think> when the prompt opened one), text blocks, and each <tool_call> as a tool_use block
(deltaspec.tool_calls); blank text around calls is no block. A stream sends Anthropic's events
(message_start, content_block_start / _delta / _stop, message_delta, message_stop); a reply that
is not streamed is the same events folded into one message (`fold`), so both agree. stop_reason:
end_turn (an end token), stop_sequence (with the sequence met), max_tokens,
model_context_window_exceeded, tool_use (a call was made), or deltaspec's own "cancelled". Usage:
input_tokens are the prompt tokens prefilled, cache_read_input_tokens those a kept history held.

Refused with a 400 naming the block or field: image and document blocks (the model reads text),
Anthropic's server tools (a `type` other than "custom"), a prefill with thinking enabled or ending in
blanks (as Anthropic refuses them). tool_choice {"type": "any"} / {"type": "tool", "name": ...} force
the call by grammar (deltaspec.tool_call_grammar; disable_parallel_tool_use: one call), also with
thinking enabled (the reasoning comes first; Anthropic refuses that pair, llama-server treats both
types as "required").
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Iterator

from ..chat import prompt_opens_reasoning
from ..generation import GenerationResult, validate_stop
from ..tool_call_grammar import ForcedToolCall
from .errors import APIError, bad_request
from .native import stop_type
from .planted import planted
from .reply_blocks import ReplyBlocks
from .schemas import (GenerationRequest, Served, _check_body, _get, _grammar, _prompt_ids, _sampling, _type,
                      chat_prompt, check_forced_call, reasoning_budget, tool_call_options)

ANTHROPIC_TEMPERATURE_DEFAULT = 1.0

# Claude Code starts its system prompt with a billing line whose cch=XXXXX stamp changes on every
# request: left in, no two requests share a prompt prefix and nothing of a kept history is reused
_BILLING_STAMP = re.compile(r"^(x-anthropic-billing-header:[^\n]*?\bcch=)[0-9A-Za-z]*;")


def _invalid(message: str, param: str) -> APIError:
    return bad_request(message, param, "invalid_value")


def _text_of(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"'{where}.text' must be a string, got {_type(text)}", "messages", "invalid_type")
    return text


def _blocks(content: Any, where: str, param: str = "messages") -> list[dict]:
    """A message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"'{where}' must be a string or an array of content blocks, got {_type(content)}",
                          param, "invalid_type")
    return content


def _unsupported_block(kind: Any, where: str) -> APIError:
    if kind in ("image", "document", "search_result"):
        return bad_request(f"'{where}' is a{'n' if kind == 'image' else ''} {kind} block; this server's model reads "
                           "text only", "messages", "unsupported")
    return _invalid(f"'{where}.type' {str(kind)[:40]!r} is not a content block this message can hold", "messages")


def _system(system: Any) -> list[dict]:
    """The system message's text parts (a string is one), the billing stamp made constant."""
    parts = _blocks(system, "system", "system")
    out = []
    for j, block in enumerate(parts):
        if block.get("type") != "text":
            raise _invalid(f"'system[{j}].type' must be \"text\", got {str(block.get('type'))[:40]!r}", "system")
        text = block.get("text")
        if not isinstance(text, str):
            raise bad_request(f"'system[{j}].text' must be a string, got {_type(text)}", "system", "invalid_type")
        kept = planted("billing_stamp_kept")
        out.append({"type": "text", "text": text if kept else _BILLING_STAMP.sub(r"\1;", text)})
    return out


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(_blocks(content, f"{where}.content")):
        if part.get("type") != "text":
            raise _unsupported_block(part.get("type"), f"{where}.content[{j}]")
        texts.append(_text_of(part, f"{where}.content[{j}]"))
    return "".join(texts)


def _user(blocks: list[dict], where: str) -> list[dict]:
    """A user message's blocks as the template's messages: text parts, and a tool message per tool
    result, in their order."""
    out: list[dict] = []
    text: list[dict] = []
    for j, block in enumerate(blocks):
        w, kind = f"{where}.content[{j}]", block.get("type")
        if kind == "text":
            text.append({"type": "text", "text": _text_of(block, w)})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"'{w}.tool_use_id' must be a string", "messages", "invalid_type")
            if text:
                out.append({"role": "user", "content": text})
                text = []
            if planted("tool_result_dropped"):
                continue
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": _tool_result_text(block, w)})
        else:
            raise _unsupported_block(kind, w)
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _assistant(blocks: list[dict], where: str) -> dict:
    """An assistant message's blocks as one template message: text, reasoning, tool calls."""
    text, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        w, kind = f"{where}.content[{j}]", block.get("type")
        if kind == "text":
            text.append(_text_of(block, w))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise bad_request(f"'{w}.thinking' must be a string", "messages", "invalid_type")
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # opaque to anyone but its writer
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(arguments, dict):
                raise bad_request(f"'{w}' must have a non-empty string 'name' and an object 'input'", "messages",
                                  "invalid_type")
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": name, "arguments": arguments}})
        else:
            raise _unsupported_block(kind, w)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _chat_messages(body: dict) -> tuple[list[dict], str | None]:
    """The template's messages, and the prefill (a last assistant message's text) or None."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise bad_request(f"'messages' must be a non-empty array of messages, got {_type(messages)}", "messages",
                          "invalid_type" if not isinstance(messages, list) else "invalid_value")
    out = [] if body.get("system") is None else [{"role": "system", "content": _system(body["system"])}]
    for i, m in enumerate(messages):
        where, role = f"messages[{i}]", m.get("role")
        if role not in ("user", "assistant"):
            raise _invalid(f"'{where}.role' must be \"user\" or \"assistant\", got {str(role)[:40]!r}", "messages")
        blocks = _blocks(m.get("content"), f"{where}.content")
        out += _user(blocks, where) if role == "user" else [_assistant(blocks, where)]
    if messages[-1]["role"] != "assistant":
        return out, None
    last = out.pop()
    if "tool_calls" in last or "reasoning_content" in last:
        raise _invalid("the last message is an assistant's with tool_use or thinking blocks; a last assistant "
                       "message is a prefill and holds text only", "messages")
    if last["content"] != last["content"].rstrip():
        raise _invalid("final assistant content cannot end with trailing whitespace", "messages")
    return out, last["content"]


def _tools(body: dict) -> list[dict] | None:
    """`tools` in the template's (OpenAI's) form."""
    tools = _get(body, "tools", (list,), "an array of tools")
    if not tools:
        return None
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad_request(f"'tools[{j}]' must be an object, got {_type(tool)}", "tools", "invalid_type")
        if tool.get("type", "custom") != "custom":
            raise bad_request(f"'tools[{j}]' is Anthropic's server tool {str(tool['type'])[:40]!r}, which this "
                              "server does not run; describe the tool with name, description and input_schema",
                              "tools", "unsupported")
        name, schema, description = tool.get("name"), tool.get("input_schema"), tool.get("description", "")
        if not isinstance(name, str) or not name or not isinstance(schema, dict) or not isinstance(description, str):
            raise bad_request(f"'tools[{j}]' must have a non-empty string 'name', an object 'input_schema' and "
                              "an optional string 'description'", "tools", "invalid_type")
        out.append({"type": "function", "function": {"name": name, "description": description,
                                                     "parameters": schema}})
    return out


def _tool_choice(body: dict) -> tuple[str, ForcedToolCall | None, bool]:
    """tool_choice's type, the call it forces: {"type": "any"} one of the tools, {"type": "tool",
    "name": ...} that one (deltaspec.tool_call_grammar); and whether calls may be parallel
    (disable_parallel_tool_use: one call at most)."""
    choice = _get(body, "tool_choice", (dict,), "an object", {"type": "auto"})
    kind = choice.get("type")
    if kind not in ("auto", "none", "any", "tool"):
        raise _invalid(f"'tool_choice.type' must be \"auto\", \"any\", \"tool\" or \"none\", got {str(kind)[:40]!r}",
                       "tool_choice")
    single = choice.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise _invalid(f"'tool_choice.disable_parallel_tool_use' must be true or false, got {single!r:.40}", "tool_choice")
    name = choice.get("name")
    if kind == "tool" and (not isinstance(name, str) or not name):
        raise _invalid("'tool_choice' {\"type\": \"tool\"} needs the tool's 'name'", "tool_choice")
    forced = ForcedToolCall(name if kind == "tool" else None, not single) if kind in ("any", "tool") else None
    return kind, forced, not single


def _thinking(body: dict) -> bool | None:
    """`thinking` as the template's enable_thinking: True ("enabled", its budget_tokens enforced as a
    reasoning budget), False ("disabled"), or None (absent, "adaptive", "between_tools": the
    template's default, which decides for the model)."""
    thinking = _get(body, "thinking", (dict,), "an object")
    kind = None if thinking is None else thinking.get("type")
    if kind in (None, "adaptive", "between_tools"):
        return None
    if kind == "disabled":
        return False
    if kind != "enabled":
        raise _invalid(f"'thinking.type' must be \"enabled\", \"disabled\", \"adaptive\" or \"between_tools\", "
                       f"got {str(kind)[:40]!r}", "thinking")
    budget = thinking.get("budget_tokens")
    if type(budget) is not int or budget < 1:
        raise _invalid(f"'thinking.budget_tokens' must be a positive integer, got {budget!r:.40}", "thinking")
    return True


def _constraint(body: dict):
    """The grammar the reply must match: `output_config.format` (a JSON schema: structured outputs),
    or llama-server's `grammar` field; None for free text."""
    from ..errors import GrammarError
    from ..grammar import response_format_grammar as json_format_grammar

    config = _get(body, "output_config", (dict,), "an object", {})
    form = config.get("format")
    if form is None:
        return _grammar(body)
    if body.get("grammar") is not None:
        raise _invalid("'grammar' and 'output_config.format' both constrain the reply; send one", "grammar")
    if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
        raise _invalid("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       "output_config")
    try:
        return json_format_grammar({"type": "json_schema", "json_schema": {"schema": form["schema"]}})
    except GrammarError as e:
        raise _invalid(f"'output_config.format': {e}", "output_config") from None


def _prompt(body: dict, served: Served,
            constrained: bool) -> tuple[str, list[dict] | None, ForcedToolCall | None, bool]:
    """The prompt text, the tools whose calls the reply is parsed for, the call tool_choice forces,
    and whether calls may be parallel."""
    messages, prefill = _chat_messages(body)
    tools = _tools(body)
    choice, forced, parallel = _tool_choice(body)
    check_forced_call(forced, tools, constrained, "'output_config.format' or 'grammar'")
    thinking = _thinking(body)
    if constrained and thinking:
        raise _invalid("a grammar or output_config.format cannot be combined with thinking enabled (it "
                       "constrains the whole reply, which then has no reasoning block)", "thinking")
    if prefill is not None:
        if thinking:
            raise _invalid("thinking cannot be enabled with a prefill (a last assistant message): the reply "
                           "continues its text, outside any reasoning block", "thinking")
        thinking = False
    kwargs = dict(_get(body, "chat_template_kwargs", (dict,), "an object", {}))  # llama-server's field
    chat = {"messages": messages, "tools": tools, "chat_template_kwargs": kwargs,
            **({"enable_thinking": thinking} if thinking is not None else {})}
    prompt = chat_prompt(chat, served, constrained=constrained) + (prefill or "")
    return prompt, tools if choice != "none" else None, forced, parallel


def _max_tokens(body: dict, n_prompt: int, served: Served) -> tuple[int, bool]:
    """max_tokens, cut to the room the context leaves (and whether it was cut)."""
    if n_prompt >= served.n_ctx:
        # Anthropic's own words: clients (coding agents) read them to shorten the conversation
        raise bad_request(f"prompt is too long: {n_prompt} tokens > {served.n_ctx - 1} maximum", "messages",
                          "context_length_exceeded")
    value = _get(body, "max_tokens", (int,), "a positive integer")
    if value is None:
        raise bad_request("'max_tokens' is required", "max_tokens", "missing")
    if value < 1:
        raise _invalid(f"'max_tokens' must be a positive integer, got {value}", "max_tokens")
    room = served.n_ctx - n_prompt + 1  # the last token is sampled from the last row, never evaluated
    if planted("context_not_cut"):
        return value, False
    return min(value, room), value > room


def _stop_sequences(body: dict) -> list[str]:
    try:
        return validate_stop(_get(body, "stop_sequences", (list,), "an array of strings"))
    except (TypeError, ValueError) as e:
        raise bad_request(f"'stop_sequences': {e}", "stop_sequences", "invalid_type") from None


def parse_messages(body: Any, served: Served) -> GenerationRequest:
    body = _check_body(body, served)
    grammar = _constraint(body)
    prompt, tools, forced, parallel = _prompt(body, served, constrained=grammar is not None)
    thinking_open = prompt_opens_reasoning(prompt)
    ids = _prompt_ids(prompt, served, "messages")
    max_tokens, context_bound = _max_tokens(body, len(ids), served)
    temperature = body.get("temperature")
    sampling, seed = _sampling({**body, "temperature": ANTHROPIC_TEMPERATURE_DEFAULT if temperature is None
                                else temperature}, chat=False)
    stream = _get(body, "stream", (bool,), "true or false", False)
    thinking = body.get("thinking") or {}
    budget = thinking.get("budget_tokens") if thinking.get("type") == "enabled" else None
    options = {**sampling, "seed": seed, "stop": _stop_sequences(body),
               **({"grammar": grammar} if grammar is not None else {}),
               **reasoning_budget(body, served, grammar is not None, thinking_open, budget)}
    options.update(tool_call_options(tools, forced, parallel, thinking_open, options))
    return GenerationRequest(ids, max_tokens, options, stream, include_usage=False, chat=True,
                             thinking_open=thinking_open, tools=tools, context_bound=context_bound)


def count_tokens(body: Any, served: Served) -> dict:
    """/v1/messages/count_tokens: the prompt's tokens, as a request with this body would have."""
    body = _check_body(body, served)
    prompt = _prompt(body, served, constrained=_constraint(body) is not None)[0]
    return {"input_tokens": len(_prompt_ids(prompt, served, "messages"))}


# --- the answer ----------------------------------------------------------------------------------

def event_bytes(event: dict) -> bytes:
    """One server-sent event as Anthropic streams them: its type on the `event:` line."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def _usage(result: GenerationResult) -> dict:
    s = result.stats
    return {"input_tokens": s.prompt_tokens - s.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": s.cached_tokens, "output_tokens": s.generated_tokens}


class MessageEvents(ReplyBlocks):
    """The events of one reply, delta by delta (the stream builders' interface of
    deltaspec.openai_stream): message_start, each block's start, deltas and stop in the order the
    reply writes them (server.reply_blocks), then message_delta (stop_reason, usage) and message_stop."""

    def __init__(self, model: str, req: GenerationRequest, tokenizer):
        super().__init__(req.thinking_open, req.tools)
        self.model, self.id = model, f"msg_{uuid.uuid4().hex[:24]}"
        self._n_prompt, self._tokenizer = len(req.prompt), tokenizer
        self._stops, self._context_bound = req.options.get("stop", []), req.context_bound
        self._index = -1

    def start(self) -> Iterator[dict]:
        yield {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self._n_prompt, "output_tokens": 0}}}

    def finish(self, result: GenerationResult, include_usage: bool = False) -> Iterator[dict]:
        yield from self._rest()
        reason, word = self._stop_reason(result)
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": word},
               "usage": _usage(result)}
        yield {"type": "message_stop"}

    def _stop_reason(self, result: GenerationResult) -> tuple[str, str | None]:
        kind, word = stop_type(result, self._tokenizer, self._stops)
        if kind == "eos":
            return ("tool_use" if self.n_calls else "end_turn"), None
        if kind == "word":
            return "stop_sequence", None if planted("stop_sequence_unnamed") else word
        if kind == "limit":
            return ("model_context_window_exceeded" if self._context_bound else "max_tokens"), None
        return "cancelled", None

    def _start(self, block: dict) -> dict:
        self._index += 1
        return {"type": "content_block_start", "index": self._index, "content_block": block}

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _open(self, kind: str) -> Iterator[dict]:
        yield self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning"
                          else {"type": "text", "text": ""})

    def _append(self, text: str) -> Iterator[dict]:
        yield self._delta({"type": "thinking_delta", "thinking": text} if self._kind == "reasoning"
                          else {"type": "text_delta", "text": text})

    def _close(self, kind: str) -> Iterator[dict]:
        if kind == "reasoning":  # Anthropic's clients expect the block's signature before its end
            yield self._delta({"type": "signature_delta", "signature": ""})
        yield {"type": "content_block_stop", "index": self._index}

    def _call(self, call: dict) -> Iterator[dict]:
        fn = call["function"]
        yield self._start({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": fn["name"],
                           "input": {}})
        yield self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
        yield {"type": "content_block_stop", "index": self._index}


def fold(events: Iterator[dict]) -> dict:
    """The message a reply's events make (what a client that reads the stream assembles)."""
    message: dict = {}
    partial_json: dict[int, str] = {}
    for event in events:
        kind = event["type"]
        if kind == "message_start":
            message = {**event["message"], "content": []}
        elif kind == "content_block_start":
            message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            if delta["type"] == "input_json_delta":
                partial_json[event["index"]] = partial_json.get(event["index"], "") + delta["partial_json"]
            else:
                field = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}[
                    delta["type"]]
                block[field] += delta[field]
        elif kind == "content_block_stop" and event["index"] in partial_json:
            message["content"][event["index"]]["input"] = json.loads(partial_json.pop(event["index"]))
        elif kind == "message_delta":
            message.update(event["delta"])
            message["usage"] = {**message["usage"], **event["usage"]}
    return message


def message_body(result: GenerationResult, model: str, req: GenerationRequest, tokenizer) -> dict:
    """The reply not streamed: its events folded into one message."""
    events = MessageEvents(model, req, tokenizer)
    return fold(event for part in (events.start(), events.delta(result.text), events.finish(result))
                for event in part)
