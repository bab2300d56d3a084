"""How each generation route answers: the body of a request's finished results, the builders of its
stream (deltaspec.openai_stream's interface: start / delta / finish, one per choice), how a stream
event is written, whether a stream ends with [DONE], and the shape of an error body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..generation import GenerationResult
from ..openai_stream import ChatChunks, CompletionChunks
from .anthropic import MessageEvents, event_bytes, message_body
from .embeddings import embedding_body
from .errors import APIError
from .native import NativeChunks, native_body
from .openai_responses import ResponseEvents, response_body
from .openai_responses import event_bytes as response_event_bytes
from .responses import chat_body, completion_body, sse
from .schemas import GenerationRequest, Served

# (the request, its choices' requests, their results, the served model) -> the answer's body
Body = Callable[[GenerationRequest, list[GenerationRequest], list[GenerationResult], Served], dict]
# (the request, how many choices, the served model) -> a stream builder per choice
Builders = Callable[[GenerationRequest, int, Served], list]


@dataclass(frozen=True)
class Answer:
    body: Body
    builders: Builders | None = None            # None: the route never streams
    event: Callable[[dict], bytes] = sse        # one stream event's bytes
    done: bool = True                           # the stream ends with `data: [DONE]` (OpenAI's)
    error: Callable[[APIError], dict] = APIError.body


def _tokenizer(req: GenerationRequest, served: Served):
    """The tokenizer that names log-probabilities' tokens, when the request asked for them."""
    return served.tokenizer if req.logprobs is not None else None


COMPLETION = Answer(
    lambda req, choices, results, served: completion_body(results, served.name, _tokenizer(req, served),
                                                          [c.echo for c in choices], req.n),
    lambda req, n, served: [CompletionChunks(served.name, _tokenizer(req, served)) for _ in range(n)])

CHAT = Answer(
    lambda req, choices, results, served: chat_body(results, served.name, req.thinking_open,
                                                    _tokenizer(req, served), req.tools),
    lambda req, n, served: [ChatChunks(served.name, req.thinking_open, _tokenizer(req, served), req.tools)
                            for _ in range(n)])

# llama-server's /completion and /infill: its own shapes, streams without [DONE]
NATIVE = Answer(
    lambda req, choices, results, served: native_body(results[0], served.name, served.tokenizer,
                                                      req.options["stop"]),
    lambda req, n, served: [NativeChunks(served.name, served.tokenizer, req.options["stop"], len(req.prompt))],
    done=False)

EMBEDDINGS = Answer(
    lambda req, choices, results, served: embedding_body(results, served.name, served.pooling,
                                                         req.encoding_format))

# Anthropic's /v1/messages: typed events, no [DONE], Anthropic's error bodies
MESSAGES = Answer(
    lambda req, choices, results, served: message_body(results[0], served.name, req, served.tokenizer),
    lambda req, n, served: [MessageEvents(served.name, req, served.tokenizer)],
    event=event_bytes, done=False, error=APIError.anthropic_body)

# OpenAI's /v1/responses: typed events, no [DONE]
RESPONSES = Answer(
    lambda req, choices, results, served: response_body(results[0], served.name, req, served.tokenizer),
    lambda req, n, served: [ResponseEvents(served.name, req, served.tokenizer)],
    event=response_event_bytes, done=False)
