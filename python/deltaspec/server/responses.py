"""OpenAI response bodies and stream chunks for a finished or running request (the dict shapes are
deltaspec.openai_format's, which follow llama-cpp-python's). A request that asked for
log-probabilities gets them in the choice's `logprobs` (deltaspec.logprobs' shapes): the answer's
tokens (generated_logprobs), or in a stream each chunk's tokens (server.text says which)."""

from __future__ import annotations

import json

from .. import logprobs as lp
from .. import openai_format as oai
from ..chat import split_reasoning
from ..generation import GenerationResult
from ..openai_stream import usage_with_cache


def sse(data: dict | str) -> bytes:
    """One server-sent event (`data: ...` and a blank line), as OpenAI streams."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


DONE = sse("[DONE]")


def completion_body(result: GenerationResult, model: str, tokenizer=None) -> dict:
    """The answer; with `tokenizer` (the request asked for logprobs) its log-probabilities too."""
    s = result.stats
    body = {**oai.completion(result.text, result.finish_reason, model, s.prompt_tokens, s.generated_tokens),
            "usage": usage_with_cache(result)}
    if tokenizer is not None:
        body["choices"][0]["logprobs"] = lp.completion_logprobs(tokenizer, lp.generated_logprobs(tokenizer, result), 0)
    return body


def chat_body(result: GenerationResult, model: str, thinking_open: bool, tokenizer=None) -> dict:
    """The answer; with `tokenizer` (the request asked for logprobs) its log-probabilities too (of
    every generated token, reasoning included, as create_chat_completion's)."""
    s = result.stats
    reasoning, content = split_reasoning(result.text, thinking_open=thinking_open)
    body = {**oai.chat_completion(content, result.finish_reason, model, s.prompt_tokens, s.generated_tokens,
                                  reasoning_content=reasoning), "usage": usage_with_cache(result)}
    if tokenizer is not None:
        body["choices"][0]["logprobs"] = lp.chat_logprobs(tokenizer, lp.generated_logprobs(tokenizer, result))
    return body
