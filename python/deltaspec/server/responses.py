"""OpenAI response bodies and stream chunks for a finished or running request (the dict shapes are
deltaspec.openai_format's, which follow llama-cpp-python's). A request that asked for
log-probabilities gets them in the choice's `logprobs` (deltaspec.logprobs' shapes): the answer's
tokens (generated_logprobs), or in a stream each chunk's tokens (server.text says which). A request
for n choices is answered with n choices, their usage together."""

from __future__ import annotations

import json

from .. import logprobs as lp
from .. import openai_format as oai
from ..chat import split_reasoning
from ..generation import GenerationResult
from ..openai_stream import usage_with_cache
from ..tool_calls import parse_tool_calls
from .planted import planted


def sse(data: dict | str) -> bytes:
    """One server-sent event (`data: ...` and a blank line), as OpenAI streams."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


DONE = sse("[DONE]")


def usage_of(results: list[GenerationResult], n: int = 1) -> dict:
    """The usage of a request's choices, n per prompt in order: each prompt once (its choices read
    the same one), the completion tokens of all; one choice's is usage_with_cache's."""
    usage = usage_with_cache(results[0])
    if len(results) > 1:
        firsts = results[::n]
        prompt = sum(r.stats.prompt_tokens for r in firsts)
        completion = sum(r.stats.generated_tokens for r in results)
        usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        usage["prompt_tokens_details"] = {"cached_tokens": sum(r.stats.cached_tokens for r in firsts)}
    return usage


def _with_choices(bodies: list[dict], results: list[GenerationResult], n: int) -> dict:
    """The first body with every body's choice, indexed in order, and the usage of all."""
    body = bodies[0]
    body["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    body["usage"] = usage_of(results, n)
    return body


def completion_body(results: list[GenerationResult], model: str, tokenizer=None, echoes: list[str] | None = None,
                    n: int = 1) -> dict:
    """The answer, a choice per result (n per prompt), each after its `echoes` entry; with
    `tokenizer` (the request asked for logprobs) their log-probabilities too, after the prompt's
    (result.prompt_logprobs) when echoed."""
    bodies = []
    for result, echo in zip(results, echoes or [""] * len(results)):
        s = result.stats
        body = oai.completion(echo + result.text, result.finish_reason, model, s.prompt_tokens, s.generated_tokens)
        if tokenizer is not None:
            entries = lp.generated_logprobs(tokenizer, result)
            if echo and result.prompt_logprobs is not None and not planted("echo_logprobs_dropped"):
                entries = result.prompt_logprobs + entries
            body["choices"][0]["logprobs"] = lp.completion_logprobs(tokenizer, entries, 0)
        bodies.append(body)
    return _with_choices(bodies, results, n)


def chat_body(results: list[GenerationResult], model: str, thinking_open: bool, tokenizer=None,
              tools: list | None = None) -> dict:
    """The answer, a choice per result; with `tokenizer` (the request asked for logprobs) their
    log-probabilities too (of every generated token, reasoning included, as
    create_chat_completion's); with `tools`, the content's tool calls as `tool_calls`."""
    bodies = []
    for result in results:
        s = result.stats
        reasoning, content = split_reasoning(result.text, thinking_open=thinking_open)
        calls = None
        if tools and content is not None:
            content, calls = parse_tool_calls(content, tools)
        body = oai.chat_completion(content, result.finish_reason, model, s.prompt_tokens, s.generated_tokens,
                                   reasoning_content=reasoning, tool_calls=calls)
        if tokenizer is not None:
            body["choices"][0]["logprobs"] = lp.chat_logprobs(tokenizer, lp.generated_logprobs(tokenizer, result))
        bodies.append(body)
    return _with_choices(bodies, results, 1)
