"""OpenAI-shaped result dicts, key for key as llama-cpp-python returns them.

Users switch between llama-cpp-python, llama-server and deltaspec with code that indexes
`out["choices"][0]["text"]`, so the shapes (ids `cmpl-<uuid>` / `chatcmpl-<uuid>`, `logprobs: None`,
the empty final stream delta) follow llama-cpp-python's `llama.py` and `llama_chat_format.py`.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, NotRequired, Optional, TypedDict

# "cancelled" is deltaspec's own: a generation stopped by Model.cancel() or a closed stream
FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(TypedDict):
    text: str
    index: int
    logprobs: Optional[dict]
    finish_reason: Optional[FinishReason]


class Completion(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: NotRequired[Usage]  # absent on stream chunks


class ChatMessage(TypedDict):
    role: Literal["assistant"]
    content: Optional[str]
    reasoning_content: NotRequired[str]  # llama-server's field; only present when non-empty


class ChatChoice(TypedDict):
    index: int
    message: ChatMessage
    logprobs: Optional[dict]
    finish_reason: Optional[FinishReason]


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(TypedDict, total=False):
    role: Literal["assistant"]
    content: str
    reasoning_content: str


class ChatChunkChoice(TypedDict):
    index: int
    delta: ChatDelta
    logprobs: Optional[dict]
    finish_reason: Optional[FinishReason]


class ChatCompletionChunk(TypedDict):
    id: str
    model: str
    created: int
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4()}"


def chat_completion_id() -> str:
    # llama-cpp-python derives chat ids as "chat" + the completion id.
    return f"chatcmpl-{uuid.uuid4()}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(text: str, finish_reason: FinishReason, model: str, prompt_tokens: int,
               completion_tokens: int, *, id: str | None = None, created: int | None = None) -> Completion:
    return {"id": id or completion_id(), "object": "text_completion",
            "created": now() if created is None else created, "model": model,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(text_delta: str, finish_reason: FinishReason | None, model: str, id: str,
                     created: int) -> Completion:
    """One stream chunk; every chunk of a stream shares `id` and `created`. The last one carries
    `finish_reason` (llama-cpp-python sends it with empty text)."""
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"text": text_delta, "index": 0, "logprobs": None, "finish_reason": finish_reason}]}


def chat_completion(content: str | None, finish_reason: FinishReason, model: str, prompt_tokens: int,
                    completion_tokens: int, reasoning_content: str | None = None, *,
                    id: str | None = None, created: int | None = None,
                    tool_calls: list | None = None) -> ChatCompletion:
    message: ChatMessage = {"role": "assistant", "content": content}
    if reasoning_content:
        message["reasoning_content"] = reasoning_content
    if tool_calls:  # (deltaspec.tool_calls) the reply called tools: OpenAI's finish_reason says so
        message["tool_calls"] = tool_calls
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    return {"id": id or chat_completion_id(), "object": "chat.completion",
            "created": now() if created is None else created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


def _chat_chunk(delta: ChatDelta, finish_reason: FinishReason | None, model: str, id: str,
                created: int) -> ChatCompletionChunk:
    return {"id": id, "model": model, "created": created, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk_role(model: str, id: str, created: int) -> ChatCompletionChunk:
    """The first chunk of a chat stream: `delta={"role": "assistant"}`."""
    return _chat_chunk({"role": "assistant"}, None, model, id, created)


def chat_chunk_delta(model: str, id: str, created: int, content: str | None = None,
                     reasoning_content: str | None = None) -> ChatCompletionChunk:
    """A text chunk; reasoning text goes in `reasoning_content` as llama-server streams it."""
    delta: ChatDelta = {}
    if content is not None:
        delta["content"] = content
    if reasoning_content is not None:
        delta["reasoning_content"] = reasoning_content
    return _chat_chunk(delta, None, model, id, created)


def chat_chunk_tool_calls(model: str, id: str, created: int, calls: list, first_index: int) -> ChatCompletionChunk:
    """A chunk with whole tool calls (deltaspec.tool_calls), numbered from first_index in the reply."""
    delta: ChatDelta = {"tool_calls": [{"index": first_index + i, **call} for i, call in enumerate(calls)]}
    return _chat_chunk(delta, None, model, id, created)


def chat_chunk_finish(finish_reason: FinishReason, model: str, id: str, created: int) -> ChatCompletionChunk:
    """The last chunk: an empty delta carrying `finish_reason`."""
    return _chat_chunk({}, finish_reason, model, id, created)
