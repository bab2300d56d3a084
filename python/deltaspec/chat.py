"""Chat templates: render a GGUF's `tokenizer.chat_template` the way Hugging Face transformers does,
and split a `<think>…</think>` block off generated text.

Templates are Jinja written for transformers, so the environment mirrors transformers' own
(`ImmutableSandboxedEnvironment`, trim_blocks/lstrip_blocks, loop controls, a pass-through
`{% generation %}` tag, its `tojson`, `raise_exception` and `strftime_now`); llama-cpp-python's
`Jinja2ChatFormatter` does the same. A template is untrusted input from a model file, hence the
sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ChatTemplateError

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` renders its body unchanged. transformers uses the tag
    to mark assistant tokens for training masks; for inference only the text matters."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the `generation` name token
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> NoReturn:
    # Templates call this to reject a conversation; the message is theirs ("No user query found").
    raise ChatTemplateError(f"the chat template rejected the messages: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers replaces Jinja's tojson, which HTML-escapes <>&' and forces ASCII; templates
    # are written against transformers' output, so tool schemas must serialise exactly like this.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, template: str, *, bos_token: str = "", eos_token: str = "") -> None:
        if not isinstance(template, str) or not template.strip():
            raise ChatTemplateError(f"chat template must be a non-empty string, got {template!r:.60}")
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """The prompt text for `messages` (OpenAI-style dicts).

        `template_kwargs` reach the template as variables (Qwen3.5: `enable_thinking=False`); as in
        transformers they may override `bos_token`/`eos_token`.
        """
        msgs = normalize_messages(messages)
        if tools is not None:
            tools = _check_tools(tools)
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **template_kwargs}
        try:
            return self._template.render(messages=msgs, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            # Undefined attributes, filters applied to the wrong type, sandbox refusals: all mean the
            # messages do not have the shape this template expects.
            raise ChatTemplateError(f"rendering the chat template failed: {type(e).__name__}: {e}") from e


def chat_template_from_metadata(metadata: Mapping[str, Any]) -> ChatTemplate:
    """The GGUF's own template, with its BOS/EOS token texts (as llama-cpp-python passes them)."""
    template = metadata.get(CHAT_TEMPLATE_KEY)
    if template is None:
        raise ChatTemplateError(f"the GGUF has no {CHAT_TEMPLATE_KEY}; pass chat_template=...")
    if not isinstance(template, str):
        raise ChatTemplateError(f"{CHAT_TEMPLATE_KEY} must be a string, got {type(template).__name__}")
    tokens = metadata.get("tokenizer.ggml.tokens")

    def token_text(key: str) -> str:
        tid = metadata.get(key)
        if isinstance(tokens, list) and isinstance(tid, int) and 0 <= tid < len(tokens):
            return str(tokens[tid])
        return ""

    return ChatTemplate(template, bos_token=token_text("tokenizer.ggml.bos_token_id"),
                        eos_token=token_text("tokenizer.ggml.eos_token_id"))


# --- message validation ---------------------------------------------------------------------------

def _type(x: Any) -> str:
    return "None" if x is None else type(x).__name__


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style messages and return copies ready for a template.

    Tool-call `arguments` given as JSON strings (as the OpenAI API returns them) are parsed into
    objects: HF templates iterate them as mappings (Qwen3.5: `arguments|items`), and llama-server
    converts them the same way. The caller's dicts are never modified.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of dicts, got {_type(messages)}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"{where}: expected a dict with 'role' and 'content', got {_type(m)}")
        m = dict(m)
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"{where}.role: expected a non-empty string, got {role!r}")
        if "tool_calls" in m and m["tool_calls"] is not None:
            m["tool_calls"] = _normalize_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if "content" not in m:
            # OpenAI lets an assistant message that calls tools omit its content.
            if not (role == "assistant" and m.get("tool_calls")):
                raise ChatTemplateError(f"{where}.content: missing (role {role!r})")
        else:
            _check_content(m["content"], f"{where}.content")
        for key in ("reasoning_content", "name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ChatTemplateError(f"{where}.{key}: expected a string, got {_type(m[key])}")
        out.append(m)
    return out


def _check_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ChatTemplateError(f"{where}: expected a string, None or a list of content parts, "
                                f"got {_type(content)}")
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"{where}[{j}]: expected a content part dict, got {_type(part)}")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise ChatTemplateError(f"{where}[{j}].type: expected a string such as 'text', got {kind!r}")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{where}[{j}].text: expected a string, got {_type(part.get('text'))}")


def _normalize_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{where}: expected a list of tool calls, got {_type(calls)}")
    out = []
    for j, call in enumerate(calls):
        w = f"{where}[{j}]"
        if not isinstance(call, Mapping):
            raise ChatTemplateError(f"{w}: expected a dict, got {_type(call)}")
        call = dict(call)
        # OpenAI nests name/arguments under "function"; some callers put them at the top level.
        if "function" in call:
            if not isinstance(call["function"], Mapping):
                raise ChatTemplateError(f"{w}.function: expected a dict, got {_type(call['function'])}")
            call["function"] = fn = dict(call["function"])
            w += ".function"
        else:
            fn = call
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatTemplateError(f"{w}.name: expected a non-empty string, got {fn.get('name')!r}")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ChatTemplateError(f"{w}.arguments: not valid JSON ({e.msg} at char {e.pos})") from e
            if not isinstance(fn["arguments"], dict):
                raise ChatTemplateError(f"{w}.arguments: expected a JSON object, got {args!r:.60}")
        elif args is not None and not isinstance(args, Mapping):
            raise ChatTemplateError(f"{w}.arguments: expected a dict or a JSON string, got {_type(args)}")
        out.append(call)
    return out


def _check_tools(tools: Any) -> list[Any]:
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ChatTemplateError(f"tools must be a list of dicts, got {_type(tools)}")
    for j, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ChatTemplateError(f"tools[{j}]: expected a dict (OpenAI tool schema), got {_type(tool)}")
    return list(tools)


# --- reasoning -------------------------------------------------------------------------------------

def prompt_opens_reasoning(prompt: str) -> bool:
    """True when `prompt` ends inside an unclosed `<think>` block (Qwen3.5's generation prompt with
    thinking on), so generated text starts as reasoning; pass the result to `split_reasoning`."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def split_reasoning(text: str, thinking_open: bool = False) -> tuple[str | None, str]:
    """Split generated text into (reasoning_content, content), like llama-server's
    `--reasoning-format deepseek`.

    The reasoning is a leading `<think>…</think>` block, or, when the prompt already opened the
    block (`thinking_open`), the text up to `</think>`. An unclosed block (generation stopped
    while thinking) is all reasoning. Reasoning is stripped and None when empty; whitespace after
    `</think>` is dropped from the content. A stream splits the same way with ReasoningSplitter.
    """
    splitter = ReasoningSplitter(thinking_open)
    (reasoning, content), (reasoning_end, content_end) = splitter.push(text), splitter.finish()
    return (reasoning + reasoning_end) or None, content + content_end


class ReasoningSplitter:
    """`split_reasoning` for text that arrives in pieces: push() each piece, then finish(); each
    returns (reasoning, content) text to send now. The pieces concatenate to exactly the split of
    the whole text, so streamed and non-streamed chat completions agree. Text is held back only
    while it may still be part of a tag or whitespace that the split strips."""

    def __init__(self, thinking_open: bool = False) -> None:
        self._thinking_open = thinking_open
        self._state = "start"  # start -> reasoning -> after_close -> content, or start -> content
        self._held = ""        # received, not yet sent
        self._reasoning_sent = False

    def push(self, text: str) -> tuple[str, str]:
        self._held += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._state == "start":
            lead = self._held.lstrip()
            if lead.startswith(THINK_OPEN):
                self._held, self._state = lead[len(THINK_OPEN):], "reasoning"
            elif not final and THINK_OPEN.startswith(lead):  # blank so far, or "<think>" arriving
                return "", ""
            else:
                self._state = "reasoning" if self._thinking_open else "content"
        if self._state == "reasoning":
            close = self._held.find(THINK_CLOSE)
            if close >= 0:
                reasoning = self._reasoning(self._held[:close], last=True)
                self._held, self._state = self._held[close + len(THINK_CLOSE):], "after_close"
            else:
                # keep back a possible start of "</think>" and trailing blanks (stripped if it comes)
                if final:
                    ready = self._held
                else:
                    ready = self._held[:len(self._held) - _tag_start(self._held, THINK_CLOSE)].rstrip()
                reasoning = self._reasoning(ready, last=final)
                self._held = self._held[len(ready):]
        if self._state == "after_close":
            self._held = self._held.lstrip()
            if self._held:
                self._state = "content"
        if self._state == "content":
            content, self._held = self._held, ""
        return reasoning, content

    def _reasoning(self, text: str, last: bool) -> str:
        """The next reasoning text with the block's leading (and, when `last`, trailing) blanks off."""
        if not self._reasoning_sent:
            text = text.lstrip()
        if last:
            text = text.rstrip()
        self._reasoning_sent = self._reasoning_sent or bool(text)
        return text


def _tag_start(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (the tag may be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
