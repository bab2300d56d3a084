"""OpenAI stream chunks of one completion or chat completion, delta by delta (llama-cpp-python's
shapes, deltaspec.openai_format), with each delta's log-probabilities when the request asked for
them (deltaspec.logprobs' shapes): the server's streams and create_completion /
create_chat_completion(stream=True) make them alike."""

from __future__ import annotations

from typing import Iterator

from . import logprobs as lp
from . import openai_format as oai
from .chat import ReasoningSplitter
from .generation import GenerationResult
from .tool_calls import ToolCallStream


class CompletionChunks:
    """The chunks of one streamed text completion, delta by delta; with `tokenizer` (the request
    asked for logprobs) each chunk carries its tokens' log-probabilities, text offsets counted
    from `text_offset` (where the first entry's text starts)."""

    def __init__(self, model: str, tokenizer=None, text_offset: int = 0):
        self.model, self.id, self.created = model, oai.completion_id(), oai.now()
        self._tokenizer = tokenizer
        self._offset = text_offset  # where the next entry's text starts

    def start(self) -> Iterator[dict]:
        return iter(())

    def delta(self, text: str, entries: list | None = None) -> Iterator[dict]:
        if text or entries:
            chunk = oai.completion_chunk(text, None, self.model, self.id, self.created)
            if self._tokenizer is not None and entries is not None:
                logprobs = lp.completion_logprobs(self._tokenizer, entries, self._offset)
                if logprobs["tokens"]:
                    self._offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                chunk["choices"][0]["logprobs"] = logprobs
            yield chunk

    def finish(self, result: GenerationResult, include_usage: bool) -> Iterator[dict]:
        yield oai.completion_chunk("", result.finish_reason, self.model, self.id, self.created)
        if include_usage:
            yield self.usage_chunk(usage_with_cache(result))

    def usage_chunk(self, usage: dict) -> dict:
        """The chunk after the last choice's that carries the usage (stream_options.include_usage)."""
        return {**oai.completion_chunk("", None, self.model, self.id, self.created), "choices": [], "usage": usage}


class ChatChunks:
    """The chunks of one streamed chat completion: the role, `reasoning_content` / `content` deltas
    (a <think> block split off as llama-server streams it), then finish_reason. With `tokenizer`
    (the request asked for logprobs) the last chunk made from a delta carries its tokens'
    log-probabilities (the splitter may hold text back: they wait for the next chunk, at the latest
    an empty delta before finish_reason)."""

    def __init__(self, model: str, thinking_open: bool, tokenizer=None, tools=None):
        self.model, self.id, self.created = model, oai.chat_completion_id(), oai.now()
        self._splitter = ReasoningSplitter(thinking_open)
        self._tokenizer = tokenizer
        self._pending: list = []  # entries not sent yet
        # a request with tools: the content's tool calls as `tool_calls` deltas (deltaspec.tool_calls)
        self._calls = ToolCallStream(tools) if tools else None

    def start(self) -> Iterator[dict]:
        yield oai.chat_chunk_role(self.model, self.id, self.created)

    def delta(self, text: str, entries: list | None = None) -> Iterator[dict]:
        self._pending += entries or []
        if text:
            yield from self._with_logprobs(list(self._deltas(*self._splitter.push(text))))

    def finish(self, result: GenerationResult, include_usage: bool) -> Iterator[dict]:
        chunks = list(self._deltas(*self._splitter.finish()))
        if self._calls is not None:  # a call that never closed is text
            rest = self._calls.finish()
            if rest:
                chunks.append(oai.chat_chunk_delta(self.model, self.id, self.created, content=rest))
        if not chunks and self._pending and self._tokenizer is not None:
            chunks = [oai.chat_chunk_delta(self.model, self.id, self.created)]
        yield from self._with_logprobs(chunks)
        reason = result.finish_reason
        if self._calls is not None and self._calls.n_calls and reason == "stop":
            reason = "tool_calls"
        yield oai.chat_chunk_finish(reason, self.model, self.id, self.created)
        if include_usage:
            yield self.usage_chunk(usage_with_cache(result))

    def usage_chunk(self, usage: dict) -> dict:
        """The chunk after the last choice's that carries the usage (stream_options.include_usage)."""
        return {**oai.chat_chunk_delta(self.model, self.id, self.created), "choices": [], "usage": usage}

    def _with_logprobs(self, chunks: list[dict]) -> Iterator[dict]:
        if chunks and self._tokenizer is not None and self._pending:
            chunks[-1]["choices"][0]["logprobs"] = lp.chat_logprobs(self._tokenizer, self._pending)
            self._pending = []
        yield from chunks

    def _deltas(self, reasoning: str, content: str) -> Iterator[dict]:
        if reasoning:
            yield oai.chat_chunk_delta(self.model, self.id, self.created, reasoning_content=reasoning)
        calls = []
        if self._calls is not None and content:
            first = self._calls.n_calls
            content, calls = self._calls.push(content)
        if content:
            yield oai.chat_chunk_delta(self.model, self.id, self.created, content=content)
        if calls:
            yield oai.chat_chunk_tool_calls(self.model, self.id, self.created, calls, first)


def usage_with_cache(result: GenerationResult) -> dict:
    """OpenAI's usage, with prompt_tokens_details.cached_tokens: the prompt tokens a kept history
    held, which were not prefilled (a chat's earlier turns: csrc/slot_history.h)."""
    s = result.stats
    return {**oai.usage(s.prompt_tokens, s.generated_tokens),
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}
