"""OpenAI response bodies and stream chunks for a finished or running request (the dict shapes are
deltaspec.openai_format's, which follow llama-cpp-python's)."""

from __future__ import annotations

import json
from typing import Iterator

from .. import openai_format as oai
from ..chat import ReasoningSplitter, split_reasoning
from ..generation import GenerationResult


def sse(data: dict | str) -> bytes:
    """One server-sent event (`data: ...` and a blank line), as OpenAI streams."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


DONE = sse("[DONE]")


def completion_body(result: GenerationResult, model: str) -> dict:
    s = result.stats
    return {**oai.completion(result.text, result.finish_reason, model, s.prompt_tokens, s.generated_tokens),
            "usage": _usage(result)}


def chat_body(result: GenerationResult, model: str, thinking_open: bool) -> dict:
    s = result.stats
    reasoning, content = split_reasoning(result.text, thinking_open=thinking_open)
    return {**oai.chat_completion(content, result.finish_reason, model, s.prompt_tokens, s.generated_tokens,
                                  reasoning_content=reasoning), "usage": _usage(result)}


class CompletionChunks:
    """The chunks of one streamed text completion, delta by delta."""

    def __init__(self, model: str):
        self.model, self.id, self.created = model, oai.completion_id(), oai.now()

    def start(self) -> Iterator[dict]:
        return iter(())

    def delta(self, text: str) -> Iterator[dict]:
        if text:
            yield oai.completion_chunk(text, None, self.model, self.id, self.created)

    def finish(self, result: GenerationResult, include_usage: bool) -> Iterator[dict]:
        yield oai.completion_chunk("", result.finish_reason, self.model, self.id, self.created)
        if include_usage:
            yield {**oai.completion_chunk("", None, self.model, self.id, self.created), "choices": [],
                   "usage": _usage(result)}


class ChatChunks:
    """The chunks of one streamed chat completion: the role, `reasoning_content` / `content` deltas
    (a <think> block split off as llama-server streams it), then finish_reason."""

    def __init__(self, model: str, thinking_open: bool):
        self.model, self.id, self.created = model, oai.chat_completion_id(), oai.now()
        self._splitter = ReasoningSplitter(thinking_open)

    def start(self) -> Iterator[dict]:
        yield oai.chat_chunk_role(self.model, self.id, self.created)

    def delta(self, text: str) -> Iterator[dict]:
        if text:
            yield from self._deltas(*self._splitter.push(text))

    def finish(self, result: GenerationResult, include_usage: bool) -> Iterator[dict]:
        yield from self._deltas(*self._splitter.finish())
        yield oai.chat_chunk_finish(result.finish_reason, self.model, self.id, self.created)
        if include_usage:
            yield {**oai.chat_chunk_finish(result.finish_reason, self.model, self.id, self.created), "choices": [],
                   "usage": _usage(result)}

    def _deltas(self, reasoning: str, content: str) -> Iterator[dict]:
        if reasoning:
            yield oai.chat_chunk_delta(self.model, self.id, self.created, reasoning_content=reasoning)
        if content:
            yield oai.chat_chunk_delta(self.model, self.id, self.created, content=content)


def _usage(result: GenerationResult) -> dict:
    """OpenAI's usage, with prompt_tokens_details.cached_tokens: the prompt tokens a kept history
    held, which were not prefilled (a chat's earlier turns: csrc/slot_history.h)."""
    s = result.stats
    return {**oai.usage(s.prompt_tokens, s.generated_tokens),
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}
