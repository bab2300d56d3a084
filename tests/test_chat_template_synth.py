"""The Qwen3.5 chat template deltaspec writes into the models it makes (`deltaspec synth`: see
test_synth; the quick-start `make_tiny`), checked character for character against the Qwen3.5-4B template of the
pinned llama.cpp tree; those models chat (create_chat_completion, `deltaspec run -i`); make_tiny
writes the same bytes every time."""

from __future__ import annotations

import copy

import pytest

from deltaspec.chat import ChatTemplate
from deltaspec.errors import ChatTemplateError
from deltaspec.qwen35_template import QWEN35_CHAT_TEMPLATE

from test_chat import CONVERSATION, TOOLS, _Rejected
from upstream import llama_cpp_tree

TOOL_LOOP = [  # a multi-step tool turn: the last real query is the first message
    {"role": "user", "content": "Plan my day."},
    {"role": "assistant", "content": "", "reasoning_content": "Check the calendar.",
     "tool_calls": [{"function": {"name": "calendar", "arguments": {"day": "today", "n": 3, "flags": [True]}}}]},
    {"role": "tool", "content": "9:00 standup"},
    {"role": "assistant", "content": "<think>\nOne meeting.\n</think>\n\nYou have a standup at 9."},
    {"role": "user", "content": "<tool_response>\nlate result\n</tool_response>"},
]
VISION = [
    {"role": "system", "content": [{"type": "text", "text": "  Describe.  "}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"},
                                 {"type": "image_url", "image_url": {"url": "x"}}]},
]
NO_SYSTEM_TOOLS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def reference():
    """The published template compiled once, as test_chat.reference_render sets Jinja up."""
    import json

    import jinja2
    import jinja2.ext

    def raise_exception(msg):
        raise _Rejected(msg)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string((llama_cpp_tree() / "models" / "templates" / "Qwen3.5-4B.jinja").read_text())


@pytest.fixture(scope="module")
def ours():
    return ChatTemplate(QWEN35_CHAT_TEMPLATE)


@pytest.mark.parametrize("messages", [CONVERSATION, TOOL_LOOP, VISION, NO_SYSTEM_TOOLS],
                         ids=["conversation", "tool-loop", "vision", "no-system"])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True, "add_vision_id": True}],
                         ids=["default", "no-think", "think-vision-ids"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_the_published_template(reference, ours, messages, tools, kwargs, add_generation_prompt):
    """Seen red with each of: the tool-call separator "\\n\\n" written unconditionally, the
    last-query scan not skipping <tool_response> turns, and the empty think block of
    enable_thinking=False left out."""
    got = ours.render(copy.deepcopy(messages), tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
    expected = reference.render(messages=copy.deepcopy(messages), tools=tools,
                                add_generation_prompt=add_generation_prompt, **kwargs)
    assert got == expected


@pytest.mark.parametrize("messages, message", [
    ([], "No messages provided"),
    ([{"role": "assistant", "content": "x"}], "No user query found"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}], "System message must be at the beginning"),
    ([{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}], "Unexpected message role"),
    ([{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "x"}], "cannot contain images"),
])
def test_rejects_what_the_published_template_rejects(ours, messages, message):
    """Seen red with the role check's else branch removed (the robot turn rendered as nothing)."""
    with pytest.raises(ChatTemplateError, match=message):
        ours.render(messages)


def test_make_tiny_is_deterministic_and_has_the_template(tmp_path, monkeypatch):
    """Two make_tiny runs write identical bytes (general.name is fixed, not the temp folder's name)
    and the file carries the template (so create_chat_completion and `deltaspec run -i` render what
    test_completions and test_cli run on the published template, which this one equals). The random
    checkpoint itself (seeded) comes from the test cache, built by the same make_tiny_model with the
    same arguments, so that the test pays for conversions only. Seen red with make_tiny converting
    from the TemporaryDirectory itself (the files differed in general.name)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import shutil

    from deltaspec.chat import chat_template_from_metadata
    from deltaspec.gguf_file import read_gguf
    from deltaspec.testing import make_tiny
    from deltaspec.testing.tiny_models import default_cache_dir, tiny_model_dir

    def cached_make_tiny_model(name, folder, seed=0, chat_template=None):
        # a cache folder of its own: tiny_model_dir evicts other builds of the same name from its folder
        cached = tiny_model_dir(name, seed=seed, chat_template=chat_template,
                                cache_dir=default_cache_dir() / "qwen35-template")
        shutil.copytree(cached, folder, dirs_exist_ok=True)
        return folder

    monkeypatch.setattr(make_tiny, "make_tiny_model", cached_make_tiny_model)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert make_tiny.main([str(a)]) == 0 and make_tiny.main([str(b)]) == 0
    assert a.read_bytes() == b.read_bytes()
    meta = read_gguf(a).metadata
    assert meta["general.name"] == "Tiny Qwen35 Attn2_D32_Untied"
    assert meta["tokenizer.chat_template"] == QWEN35_CHAT_TEMPLATE
    assert chat_template_from_metadata(meta).render([{"role": "user", "content": "hello"}]) == \
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n"
