"""Chat templates, reasoning split and OpenAI dict shapes; pure Python, no native engine.

Rendering is checked against the Qwen3.5 template from the pinned llama.cpp tree, rendered a second
time here with a plain jinja2 Environment and helpers written independently in this file, so a
dropped kwarg or a helper that behaves unlike transformers' makes the outputs differ.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime

import jinja2
import jinja2.ext
import pytest

from deltaspec import openai_format as oa
from deltaspec.chat import (ChatTemplate, ReasoningSplitter, chat_template_from_metadata, prompt_opens_reasoning,
                            split_reasoning)
from deltaspec.errors import ChatTemplateError, DeltaspecError

from upstream import llama_cpp_tree


@pytest.fixture(scope="module")
def qwen_template() -> str:
    return (llama_cpp_tree() / "models" / "templates" / "Qwen3.5-4B.jinja").read_text()


class _Rejected(Exception):
    pass


def reference_render(template: str, **variables) -> str:
    """The template rendered the way transformers sets Jinja up, with our own minimal helpers."""
    def raise_exception(msg):
        raise _Rejected(msg)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(**variables)


# Non-ASCII and <'& in schemas and arguments: Jinja's stock tojson would escape them.
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city <e.g. 'Zürich' & co>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array"}},
                   "required": ["city"]}}}]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Zürich and Paris?"}]},
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need the tool.",
     "tool_calls": [
         {"id": "c1", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2],
                                                            "opts": {"unit": "°C"}}}},
         {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
     ]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 3}'},
    {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 9}'},
    {"role": "assistant", "content": "<think>\nCompare.\n</think>\n\nZürich 3°C, Paris 9°C."},
]  # ends after the last user query, so Qwen3.5 keeps the reasoning of the turns after it


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("enable_thinking", [True, False, None], ids=["think", "no-think", "default"])
def test_qwen_render_matches_reference(qwen_template, enable_thinking, tools, add_generation_prompt):
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ours = ChatTemplate(qwen_template).render(CONVERSATION, add_generation_prompt=add_generation_prompt,
                                              tools=tools, **kwargs)
    expected = reference_render(qwen_template, messages=CONVERSATION, tools=tools,
                                add_generation_prompt=add_generation_prompt, **kwargs)
    assert ours == expected
    # The variants really differ, so the equality above covers each kwarg.
    assert ours.endswith("<think>\n\n</think>\n\n" if add_generation_prompt and enable_thinking is False
                         else "<think>\n" if add_generation_prompt else "<|im_end|>\n")
    assert ("<tools>" in ours) == (tools is not None)
    assert '<parameter=opts>\n{"unit": "°C"}\n</parameter>' in ours
    assert "<think>\nNeed the tool.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>" in ours
    assert "<think>\nCompare.\n</think>\n\nZürich 3°C" in ours
    assert "<|im_start|>assistant\nHello.<|im_end|>" in ours  # reasoning before the last query is dropped


def test_string_arguments_are_parsed_like_llama_server(qwen_template):
    as_strings = json.loads(json.dumps(CONVERSATION))
    for call in as_strings[4]["tool_calls"]:
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
    t = ChatTemplate(qwen_template)
    assert t.render(as_strings) == t.render(CONVERSATION)
    assert isinstance(as_strings[4]["tool_calls"][0]["function"]["arguments"], str)  # caller's data untouched


def test_helpers_and_special_tokens_match_transformers():
    src = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
           "{% generation %}{{ m.content }}{% endgeneration %}|{% endfor %}"
           "{{ messages[0] | tojson(indent=2) }}{{ extra }}{{ strftime_now('%Y') }}{{ eos_token }}")
    msgs = [{"role": "user", "content": "é<"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "never"}]
    out = ChatTemplate(src, bos_token="<s>", eos_token="</s>").render(msgs, extra="X")
    assert out == ("<s>é<|b|" + json.dumps(msgs[0], ensure_ascii=False, indent=2) + "X"
                   + str(datetime.now().year) + "</s>")
    # trim_blocks/lstrip_blocks: indented block tags leave no whitespace behind (Qwen3.5 uses `{%-`
    # throughout, so only a template like this one notices)
    indented = "  {% for m in messages %}\n  {% if m.role == 'user' %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}\n"
    assert ChatTemplate(indented).render(msgs) == reference_render(indented, messages=msgs) == "é<\nnever\n"
    # template kwargs may override the special tokens, as in transformers
    assert ChatTemplate("{{ bos_token }}", bos_token="<s>").render(msgs, bos_token="") == ""


def test_template_is_sandboxed():
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])


def test_metadata_template_and_tokens(qwen_template):
    meta = {"tokenizer.chat_template": "{{ bos_token }}|{{ eos_token }}",
            "tokenizer.ggml.tokens": ["a", "<|endoftext|>", "<|im_end|>"],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    assert chat_template_from_metadata(meta).render([{"role": "user", "content": ""}]) \
        == "<|endoftext|>|<|im_end|>"
    with pytest.raises(ChatTemplateError, match=r"no tokenizer\.chat_template; pass chat_template="):
        chat_template_from_metadata({"general.architecture": "qwen35"})
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% if %}")


def test_missing_template_error_is_catchable_broadly():
    with pytest.raises(DeltaspecError):
        chat_template_from_metadata({})
    with pytest.raises(ValueError):
        chat_template_from_metadata({})


@pytest.mark.parametrize("messages, message", [
    ([{"role": "system", "content": "only a system prompt"}], "No user query found in messages."),
    ([{"role": "user", "content": "q"}, {"role": "system", "content": "late"}],
     "System message must be at the beginning."),
    ([], "No messages provided."),
    ([{"role": "narrator", "content": "x"}, {"role": "user", "content": "q"}], "Unexpected message role."),
    ([{"role": "system", "content": [{"type": "image_url", "image_url": "u"}]}, {"role": "user", "content": "q"}],
     "System message cannot contain images."),
])
def test_raise_exception_becomes_chat_template_error(qwen_template, messages, message):
    with pytest.raises(ChatTemplateError, match=re.escape(message)):
        ChatTemplate(qwen_template).render(messages)
    with pytest.raises(_Rejected, match=re.escape(message)):  # the reference agrees it is rejected
        reference_render(qwen_template, messages=messages, add_generation_prompt=True, tools=None)


@pytest.mark.parametrize("messages, where", [
    ("hello", "messages must be a list"),
    (["hello"], r"messages\[0\]: expected a dict"),
    ([{"content": "x"}], r"messages\[0\]\.role: expected a non-empty string"),
    ([{"role": 3, "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user"}], r"messages\[0\]\.content: missing"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}],
     r"messages\[1\]\.content: expected a string, None or a list of content parts, got int"),
    ([{"role": "user", "content": ["x"]}], r"messages\[0\]\.content\[0\]: expected a content part dict"),
    ([{"role": "user", "content": [{"text": "x"}]}], r"messages\[0\]\.content\[0\]\.type"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\]\.content\[0\]\.text"),
    ([{"role": "assistant", "content": "", "tool_calls": {"name": "f"}}],
     r"messages\[0\]\.tool_calls: expected a list"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     r"messages\[0\]\.tool_calls\[0\]\.function\.name"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
     r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: expected a dict or a JSON string"),
    ([{"role": "assistant", "content": "", "reasoning_content": 1}], r"messages\[0\]\.reasoning_content"),
])
def test_bad_messages_name_index_and_field(messages, where):
    with pytest.raises(ChatTemplateError, match=where):
        ChatTemplate("{{ messages }}").render(messages)


def test_bad_tools_and_type_errors_inside_template():
    t = ChatTemplate("{{ tools | length }}")
    with pytest.raises(ChatTemplateError, match="tools must be a list"):
        t.render([{"role": "user", "content": "x"}], tools={"type": "function"})
    with pytest.raises(ChatTemplateError, match=r"tools\[0\]"):
        t.render([{"role": "user", "content": "x"}], tools=["f"])
    with pytest.raises(ChatTemplateError, match="rendering the chat template failed"):
        ChatTemplate("{{ messages[0].content | items | list }}").render([{"role": "user", "content": "x"}])


def test_assistant_tool_call_without_content_is_allowed(qwen_template):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "content": "r"}]
    out = ChatTemplate(qwen_template).render(msgs)
    assert "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>" in out


@pytest.mark.parametrize("text, thinking_open, expected", [
    ("<think>\nplan\n</think>\n\nanswer", False, ("plan", "answer")),
    ("  <think>plan</think>answer\n", False, ("plan", "answer\n")),
    ("plan\n</think>\n\nanswer", False, (None, "plan\n</think>\n\nanswer")),  # not opened: content, as llama.cpp
    ("plan\n</think>\n\nanswer", True, ("plan", "answer")),
    ("still thinking", True, ("still thinking", "")),           # cut off while reasoning
    ("<think>\nstill thinking", False, ("still thinking", "")),
    ("<think>\n\n</think>\n\nanswer", False, (None, "answer")),  # empty reasoning
    ("plain answer", False, (None, "plain answer")),
    ("a <think>x</think> b", False, (None, "a <think>x</think> b")),  # not leading: content
    ("", True, (None, "")),
])
def test_split_reasoning(text, thinking_open, expected):
    assert split_reasoning(text, thinking_open) == expected


STREAMED = ["<think>\nplan\n</think>\n\nanswer", "  <think>plan</think>answer\n", "plan \n</think>\n\n answer",
            "still thinking \n", "<think>\n\n</think>\n\nanswer", "plain answer", "a <think>x</think> b", "",
            "  <thi", "<think> a </thin", "x</think", " \n", "<think>a</think></think>b"]


@pytest.mark.parametrize("thinking_open", [False, True])
@pytest.mark.parametrize("text", STREAMED)
def test_reasoning_splitter_streams_the_split(text, thinking_open):
    """Any cut of the text into pieces (every one- and two-cut split, and one piece per character)
    streams deltas that concatenate to split_reasoning of the whole, and no delta is held back
    longer than a tag or blanks need."""
    whole = split_reasoning(text, thinking_open)
    n = len(text)
    cuts = [(i,) for i in range(n + 1)] + [(i, j) for i in range(n + 1) for j in range(i, n + 1)]
    for pieces in [[text[a:b] for a, b in zip((0, *c), (*c, n))] for c in cuts] + [list(text)]:
        splitter = ReasoningSplitter(thinking_open)
        parts = [splitter.push(p) for p in pieces] + [splitter.finish()]
        reasoning, content = "".join(r for r, _ in parts), "".join(c for _, c in parts)
        assert ((reasoning or None), content) == whole, pieces


def test_reasoning_splitter_sends_early():
    s = ReasoningSplitter(thinking_open=True)
    assert s.push("  plan") == ("plan", "")
    assert s.push(" more \n</th") == (" more", "")       # blanks and a possible tag wait
    assert s.push("ink>\n\n") == ("", "")
    assert s.push("ans") == ("", "ans")
    assert s.push("wer</think>") == ("", "wer</think>")  # after the block everything is content
    assert s.finish() == ("", "")
    s = ReasoningSplitter(thinking_open=False)
    assert s.push(" <th") == ("", "")                      # may still become "<think>"
    assert s.push("e end") == ("", " <the end")


def test_prompt_opens_reasoning(qwen_template):
    t = ChatTemplate(qwen_template)
    msgs = [{"role": "user", "content": "q"}]
    assert prompt_opens_reasoning(t.render(msgs))
    assert prompt_opens_reasoning(t.render(msgs, enable_thinking=True))
    assert not prompt_opens_reasoning(t.render(msgs, enable_thinking=False))
    assert not prompt_opens_reasoning(t.render(msgs, add_generation_prompt=False))


def _is_uuid_id(value: str, prefix: str) -> bool:
    assert value.startswith(prefix)
    return str(uuid.UUID(value[len(prefix):])) == value[len(prefix):]


def test_completion_shape():
    c = oa.completion("hi", "length", "m.gguf", prompt_tokens=3, completion_tokens=2)
    assert _is_uuid_id(c["id"], "cmpl-") and isinstance(c["created"], int)
    assert c == {"id": c["id"], "object": "text_completion", "created": c["created"], "model": "m.gguf",
                 "choices": [{"text": "hi", "index": 0, "logprobs": None, "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    assert oa.completion_chunk("x", None, "m", "cmpl-1", 7) == {
        "id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
        "choices": [{"text": "x", "index": 0, "logprobs": None, "finish_reason": None}]}


def test_chat_completion_shape():
    c = oa.chat_completion("ok", "stop", "m", 4, 1)
    assert _is_uuid_id(c["id"], "chatcmpl-")
    assert c == {"id": c["id"], "object": "chat.completion", "created": c["created"], "model": "m",
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                              "logprobs": None, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
    r = oa.chat_completion("ok", "stop", "m", 4, 1, reasoning_content="why", id="chatcmpl-x", created=1)
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "ok", "reasoning_content": "why"}
    assert (r["id"], r["created"]) == ("chatcmpl-x", 1)


def test_chat_chunks_follow_llama_cpp_python():
    chunks = [oa.chat_chunk_role("m", "chatcmpl-1", 5), oa.chat_chunk_delta("m", "chatcmpl-1", 5, content="Hel"),
              oa.chat_chunk_delta("m", "chatcmpl-1", 5, reasoning_content="r"),
              oa.chat_chunk_finish("stop", "m", "chatcmpl-1", 5)]
    base = {"id": "chatcmpl-1", "model": "m", "created": 5, "object": "chat.completion.chunk"}
    deltas = [({"role": "assistant"}, None), ({"content": "Hel"}, None), ({"reasoning_content": "r"}, None),
              ({}, "stop")]
    assert chunks == [{**base, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": f}]}
                      for d, f in deltas]
