"""Malformed bodies for Anthropic's Messages API and OpenAI's Responses API (server.anthropic,
server.openai_responses), converted without a server: every top-level field and every nested block /
item set to each value of a list of wrong shapes must end in an APIError (a 4xx with a message),
never another exception (which the server would answer with a 500).

Seen red with the text check of a message's text block removed (a missing text reached the
template), and with the Responses converter's check that a message's content is a string or an
array removed (a number was iterated).
"""

from __future__ import annotations

import pytest

from deltaspec.server import anthropic, openai_responses
from deltaspec.server.errors import APIError

JUNK = [None, 1, -1, 1.5, True, "x", "", [], [1], {}, {"type": 1}, {"type": "text"}, {"type": "text", "text": 5},
        [{"type": "tool_use"}], [{"type": "tool_result"}], [{"type": "tool_result", "tool_use_id": "a", "content": 5}],
        [{"type": "tool_result", "tool_use_id": "a", "content": [1]}], [None], [{"role": "user"}],
        [{"role": "user", "content": None}], [{"role": "assistant", "content": [{"type": "tool_use", "name": "x",
                                                                                 "input": 5}]}]]
MESSAGES = {"model": "tiny-chat", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "tiny-chat", "input": "hi", "max_output_tokens": 8}
MESSAGES_FIELDS = ["max_tokens", "messages", "system", "tools", "tool_choice", "thinking", "stop_sequences",
                   "temperature", "top_p", "top_k", "output_config", "stream", "grammar", "reasoning_budget_tokens",
                   "reasoning_budget_message", "chat_template_kwargs"]
RESPONSES_FIELDS = ["input", "instructions", "tools", "tool_choice", "reasoning", "text", "max_output_tokens",
                    "temperature", "stream", "previous_response_id", "grammar", "reasoning_budget_tokens",
                    "parallel_tool_calls"]


def _bodies():
    for field in MESSAGES_FIELDS:
        for junk in JUNK:
            yield anthropic.parse_messages, {**MESSAGES, field: junk}
            yield anthropic.count_tokens, {**MESSAGES, field: junk}
    for field in RESPONSES_FIELDS:
        for junk in JUNK:
            yield openai_responses.parse_responses, {**RESPONSES, field: junk}
    for junk in JUNK:
        yield anthropic.parse_messages, {**MESSAGES, "messages": [{"role": "user", "content": [junk]}]}
        yield anthropic.parse_messages, {**MESSAGES, "messages": [{"role": "assistant", "content": [junk]},
                                                                  {"role": "user", "content": "x"}]}
        yield anthropic.parse_messages, {**MESSAGES, "tools": [junk]}
        yield anthropic.parse_messages, {**MESSAGES, "system": [junk]}
        yield openai_responses.parse_responses, {**RESPONSES, "input": [junk]}
        yield openai_responses.parse_responses, {**RESPONSES, "input": [
            {"type": "function_call_output", "call_id": "a", "output": junk}]}
        yield openai_responses.parse_responses, {**RESPONSES, "input": [
            {"type": "message", "role": "user", "content": junk}]}
        yield openai_responses.parse_responses, {**RESPONSES, "tools": [junk]}
        # a forced call's choice beside tools (the forced call's grammar is built from them)
        yield anthropic.parse_messages, {**MESSAGES, "tools": [{"name": "f", "input_schema": {}}], "tool_choice": junk}
        yield openai_responses.parse_responses, {**RESPONSES, "tools": [{"type": "function", "name": "f"}],
                                                 "tool_choice": junk}
        yield anthropic.parse_messages, {**MESSAGES, "tool_choice": {"type": "any"}, "tools": [
            {"name": "f", "input_schema": {"type": "object", "properties": {"x": junk}}}]}


def test_every_malformed_body_is_an_api_error(chat_served):
    n_refused = n_taken = 0
    for parse, body in _bodies():
        try:
            parse(body, chat_served)
            n_taken += 1
        except APIError as e:
            assert e.status == 400 and e.message, body
            n_refused += 1
        except Exception as e:  # noqa: BLE001 - what the test is for
            pytest.fail(f"{parse.__module__}.{parse.__name__}({body!r:.200}) raised {type(e).__name__}: {e}")
    assert n_refused > 500 and n_taken > 0  # most are refused; values a field may take pass
