"""Tool calls in a Qwen3.5 reply, as OpenAI's `tool_calls`: the model writes each call in the XML
form its chat template shows it (deltaspec.qwen35_template, Qwen3-Coder's format, which llama.cpp
also parses for these models):

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

A value is text; it becomes a JSON argument by the request's tool schema: a parameter declared
"string" keeps its text, any other is read as JSON (a value that is not JSON stays text). The reply's
text outside the calls is the message's content (None when blank). A block that does not close, or
does not have this form, stays content: nothing is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Mapping, Sequence

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*<function=([^>\n]+)>\n?(.*?)</function>\s*</tool_call>", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """Function name -> its parameters' JSON schema properties."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else {}
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") or {}
            out[fn["name"]] = params.get("properties", {}) if isinstance(params, Mapping) else {}
    return out


def _value(text: str, schema: Any) -> Any:
    if isinstance(schema, Mapping) and schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call(name: str, body: str, schemas: Mapping[str, Mapping[str, Any]]) -> dict | None:
    """The OpenAI tool call of one block's function body, or None when the body has text outside
    its parameters (not this form)."""
    props = schemas.get(name.strip(), {})
    args, at = {}, 0
    for m in _PARAM.finditer(body):
        if body[at:m.start()].strip():
            return None
        args[m.group(1).strip()] = _value(m.group(2), props.get(m.group(1).strip()))
        at = m.end()
    if body[at:].strip():
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name.strip(), "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply: the text outside well-formed call blocks (None if blank
    around calls; a reply without calls is returned as it is) and the calls in order."""
    schemas = _schemas(tools)
    calls, kept, at = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1), m.group(2), schemas)
        if call is None:
            continue
        kept.append(text[at:m.start()])
        calls.append(call)
        at = m.end()
    if not calls:
        return text, []
    kept.append(text[at:])
    content = "".join(kept)  # as a stream shows it (ToolCallStream), whitespace around the calls kept
    return (content if content.strip() else None), calls


class ToolCallStream:
    """A streamed reply's content, split as parse_tool_calls splits the whole: push() each content
    delta and get the text to show now and the calls completed; text that may open a call is held
    until it does or cannot. finish() gives the rest (a call that never closed, as text)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None):
        self._schemas = _schemas(tools)
        self._held = ""
        self.n_calls = 0

    def push(self, text: str) -> tuple[str, list[dict]]:
        pieces = self.push_pieces(text)
        return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, dict)]

    def push_pieces(self, text: str) -> list[str | dict]:
        """push() with the text to show and the calls in the order they stand in the reply (text
        pieces are strings, calls dicts): what a reply of ordered blocks (Anthropic's) needs."""
        self._held += text
        pieces: list[str | dict] = []
        while True:
            start = self._held.find(OPEN)
            if start < 0:
                # keep a tail that could still become "<tool_call>"
                keep = next((k for k in range(min(len(OPEN) - 1, len(self._held)), 0, -1)
                             if OPEN.startswith(self._held[-k:])), 0)
                pieces.append(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            end = self._held.find(CLOSE, start)
            if end < 0:
                pieces.append(self._held[:start])
                self._held = self._held[start:]
                break
            m = _BLOCK.fullmatch(self._held[start:end + len(CLOSE)])
            call = _call(m.group(1), m.group(2), self._schemas) if m else None
            if call is None:  # not a call: its text is content
                pieces.append(self._held[:end + len(CLOSE)])
            else:
                pieces += [self._held[:start], call]
                self.n_calls += 1
            self._held = self._held[end + len(CLOSE):]
        return [p for p in pieces if p]

    def finish(self) -> str:
        rest, self._held = self._held, ""
        return rest
