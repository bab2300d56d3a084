"""Grammars of Qwen3.5's tool calls over a request's tools (the XML form its chat template teaches,
deltaspec.tool_calls), enforced while decoding:

- a call the reply must make (`tool_call_grammar`): tool_choice "required" (OpenAI), a named
  function, Anthropic's {"type": "any"} / {"type": "tool", "name": ...}: after the reasoning block
  (when the prompt left one open: its text is free until </think>), at most two newlines, then one
  call, or with parallel calls one or more separated by at most two newlines, then the end;
- the calls the model chooses to make (`chosen_call_grammar`, tool_choice "auto"), as llama.cpp's
  lazy grammar: nothing is constrained until the model writes <tool_call>; from there the calls
  and the end of the reply are.

Each call names one of the allowed functions and writes its parameters each once, every required
one, in any order; a string parameter's value is free text (an `enum` of strings: one of its
values), any other is JSON that the parameter's schema constrains (llguidance, leniently: a schema
keyword it does not implement is ignored rather than refused).

llama.cpp's tool_choice "required" allows free text before the calls (and only forbids ending
without one), which a model can fill until max_tokens; here the calls come first, so a forced
request always gets its call. Anthropic's route turns {"type": "tool"} into "required" there; here
it is the named tool. llama.cpp lets an optional parameter come more than once; here it comes once.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .grammar import JSON_DEFAULTS, Grammar
from .tool_calls import OPEN

# the text around a call, as the chat template writes calls in the conversation's history
_FUNCTION_CLOSE = "</function>\n"
_PARAMETER_CLOSE = "\n</parameter>\n"


@dataclass(frozen=True)
class ForcedToolCall:
    """What the reply must call: `name` the one function (None: any of the tools), `parallel`
    whether it may make more than one call."""

    name: str | None = None
    parallel: bool = True


def _functions(tools: Sequence[Mapping[str, Any]] | None) -> list[tuple[str, Mapping[str, Any]]]:
    """(name, parameters schema) of each OpenAI-shaped tool ({"type": "function", "function": {...}})."""
    out = []
    for i, tool in enumerate(tools or ()):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name or any(c in name for c in "<>\n"):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} with a "
                             f"non-empty name without '<', '>' or newlines, got {tool!r:.120}")
        params = fn.get("parameters") or {}
        if not isinstance(params, Mapping) or not isinstance(params.get("properties", {}), Mapping):
            raise ValueError(f"tools[{i}] ({name}): 'parameters' must be a JSON schema object whose 'properties' is "
                             f"an object, got {params!r:.120}")
        out.append((name, params))
    return out


def forced_tool_call(choice: ForcedToolCall, tools: Sequence[Mapping[str, Any]] | None) -> ForcedToolCall:
    """`choice`, checked against the request's tools (a forced call needs tools; a named one, one of them)."""
    functions = [name for name, _ in _functions(tools)]
    if not functions:
        raise ValueError("a forced tool call (tool_choice \"required\" or a named function) needs tools to call")
    if choice.name is not None and choice.name not in functions:
        raise ValueError(f"tool_choice names the function {choice.name!r:.80}, which is not among the tools "
                         f"({', '.join(functions)[:200]})")
    return choice


def _lit(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def _is_text(schema: Any) -> bool:
    """Whether a parameter's value is written as raw text (a string; or a schema that says no type)."""
    if not isinstance(schema, Mapping):
        return True
    kind = schema.get("type")
    if kind is None:
        return not any(k in schema for k in ("anyOf", "oneOf", "allOf", "enum", "const", "$ref"))
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _value_rules(rule: str, schema: Any, defs: Mapping[str, Any]) -> list[str]:
    """Rules for one parameter's value and the line that closes it, named `rule`."""
    if _is_text(schema):
        enum = schema.get("enum") if isinstance(schema, Mapping) else None
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return [f"{rule}: " + " | ".join(_lit(v + _PARAMETER_CLOSE) for v in enum)]
        # the shortest text that ends with the closing line: a value never holds it
        return [f"{rule}[lazy]: /(?s:.*)\\n<\\/parameter>\\n/"]
    own = schema.get("x-guidance")
    sub = {**defs, **schema, "x-guidance": {**JSON_DEFAULTS, "lenient": True, **(own if isinstance(own, Mapping) else {})}}
    return [f"{rule}: {rule}_json {_lit(_PARAMETER_CLOSE)}", f"{rule}_json: %json {json.dumps(sub)}"]


# parameters a call may write in any order are tracked as bits of a parametric rule (llguidance's
# 64-bit rule parameter); a function with more is held to its schema's order instead
_MAX_ANY_ORDER = 64


def _function_rules(rule: str, name: str, params: Mapping[str, Any]) -> list[str]:
    """Rules for a call of one function, named `rule`: its parameters each once, the required ones
    all, in any order (as llama.cpp's grammar takes them: the model does not always keep the
    schema's order)."""
    props = params.get("properties") or {}
    required = [p for p in params.get("required") or [] if p in props]
    ordered = required + [p for p in props if p not in required]
    defs = {k: params[k] for k in ("$defs", "definitions") if isinstance(params.get(k), Mapping)}
    rules = []
    for j, p in enumerate(ordered):
        if not isinstance(p, str) or any(c in p for c in "<>\n"):
            raise ValueError(f"function {name}: parameter name {p!r:.80} has '<', '>' or a newline, which its call's "
                             "form cannot carry")
        value = f"{rule}_v{j}"
        rules.append(f"{rule}_p{j}: {_lit(f'<parameter={p}>' + chr(10))} {value}")
        rules += _value_rules(value, props[p], defs)
    head, tail = _lit(f"<function={name}>\n"), _lit(_FUNCTION_CLOSE)
    if len(ordered) > _MAX_ANY_ORDER:  # the required in order, then each optional one or none
        body = [f"{rule}_p{j}" + ("?" if j >= len(required) else "") for j in range(len(ordered))]
        return [f"{rule}: " + " ".join([head, *body, tail])] + rules
    # args::bits: bit j set once parameter j is written; the required ones hold bits 0 .. r-1
    done = f"is_ones([0:{len(required)}])" if required else "true"
    args = [f'{rule}_args::_ : "" %if {done}'] + [f"    | {rule}_p{j} {rule}_args::set_bit({j}) %if bit_clear({j})"
                                                 for j in range(len(ordered))]
    return [f"{rule}: {head} {rule}_args::0x0 {tail}", "\n".join(args)] + rules


def _call_rules(tools: Sequence[Mapping[str, Any]], choice: ForcedToolCall) -> list[str]:
    """`calls`: one call, or with parallel calls one or more (at most two newlines between them),
    each of a function `choice` allows."""
    lines = ["GAP: /\\n{0,2}/", "calls: call (GAP call)*" if choice.parallel else "calls: call"]
    names = []
    for i, (name, params) in enumerate(_functions(tools)):
        if choice.name is None or name == choice.name:
            names.append(f"fn{i}")
            lines += _function_rules(f"fn{i}", name, params)
    return lines + ["call: <tool_call> \"\\n\" (" + " | ".join(names) + ") </tool_call>"]


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], choice: ForcedToolCall, thinking_open: bool) -> Grammar:
    """The grammar of a reply that makes the call(s) `choice` asks for (see the module docstring);
    `thinking_open`: the prompt ends inside a <think> block, whose text comes first."""
    forced_tool_call(choice, tools)
    lines = ["%llguidance {}",
             "start: " + ("REASONING </think> " if thinking_open else "") + "GAP calls",
             "REASONING: /(?s:.*)/"] + _call_rules(tools, choice)
    # a reasoning budget may close the block: the grammar lets the reasoning be any text
    return _compiled("\n".join(lines) + "\n", thinking_open, None)


def chosen_call_grammar(tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> Grammar:
    """The grammar of the calls a reply makes when the model chooses to (tool_choice "auto"), as
    llama.cpp's lazy grammar: it starts at the model's first <tool_call> (until then every token is
    allowed: deltaspec.lazy_grammar) and holds the call(s), and the end of the reply after them, to
    the tools' form and schemas."""
    if not _functions(tools):
        raise ValueError("a tool-call grammar needs tools")
    lines = ["%llguidance {}", "start: calls"] + _call_rules(tools, ForcedToolCall(None, parallel))
    # free until the call: a reasoning budget applies as without it
    return _compiled("\n".join(lines) + "\n", True, OPEN)


@functools.lru_cache(maxsize=64)
def _compiled(lark: str, free_reasoning: bool, after_token: str | None) -> Grammar:
    """The Grammar of a Lark text, compiled once: an agent sends the same tools with every request,
    and compiling a few dozen of them takes llguidance tens of milliseconds."""
    return Grammar(Grammar.from_lark(lark).spec, "tool-call grammar", free_reasoning, after_token)


def openai_tool_choice(choice: Any, parallel: Any = True) -> str | ForcedToolCall:
    """OpenAI chat's `tool_choice` ("auto", "none", "required" or {"type": "function", "function":
    {"name": ...}}; None is "auto") and `parallel_tool_calls`: "auto", "none" or the call forced."""
    if not isinstance(parallel, bool):
        raise ValueError(f"parallel_tool_calls must be true or false, got {parallel!r:.40}")
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    if choice == "required":
        return ForcedToolCall(None, parallel)
    fn = choice.get("function") if isinstance(choice, Mapping) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool_choice must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}}, got {choice!r:.80}")
    return ForcedToolCall(name, parallel)
