"""HTTP routes (Starlette): OpenAI's /v1/completions, /v1/chat/completions, /v1/embeddings and /v1/models, plus
/health and /metrics, llama-server's /completion and /infill (server.native), /tokenize,
/detokenize and /apply-template (server.text_tools), /props (server.props), OpenAI's /v1/responses
(server.openai_responses), and Anthropic's /v1/messages and /v1/messages/count_tokens
(server.anthropic). Handlers validate, submit a Job to the engine loop and
relay its progress, answering in their route's shape (server.answers); every error is a JSON body
with a 4xx/5xx status (never Starlette's plain-text pages)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from . import anthropic, answers, openai_responses, text_tools
from .answers import Answer
from .backend import Progress
from .embeddings import parse_embeddings
from .native import parse_completion_native, parse_infill
from .engine_loop import EngineLoop, Failure, Job
from .errors import APIError
from .metrics import ServerMetrics
from .planted import planted
from .props import props_body
from .replicas import ReplicaSet
from .responses import DONE, usage_of
from .schemas import GenerationRequest, Served, parse_chat, parse_completion

log = logging.getLogger("deltaspec.server")


@dataclass
class ServerState:
    served: Served
    engine: EngineLoop | ReplicaSet            # a ReplicaSet (--replicas) offers the same calls
    metrics: ServerMetrics
    api_key: str | None
    created: int
    info: dict                     # extra /v1/models fields: n_ctx, parallel, speculation


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _next_event(job: Job, disconnected: asyncio.Task) -> Progress | Failure:
    """The job's next event, or ClientGone when the client leaves first."""
    get = asyncio.ensure_future(job.events.get())
    done, _ = await asyncio.wait({get, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    raise ClientGone()


def _error(e: APIError, shape: Callable[[APIError], dict] = APIError.body) -> JSONResponse:
    return JSONResponse(shape(e), status_code=e.status)


def _check_key(request: Request, api_key: str | None) -> None:
    """The key as OpenAI's clients send it (Authorization: Bearer KEY) or Anthropic's (x-api-key: KEY)."""
    if api_key is None:
        return
    bearer = request.headers.get("authorization", "").encode()
    header = request.headers.get("x-api-key", "").encode()
    if not (hmac.compare_digest(bearer, f"Bearer {api_key}".encode()) | hmac.compare_digest(header, api_key.encode())):
        raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                       code="invalid_api_key")


async def _body(request: Request) -> object:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


class EventStream(StreamingResponse):
    """Server-sent events from an async iterator of bytes. Unlike StreamingResponse under ASGI
    spec 2.4, a client that disconnects is seen at once (a receive() watcher, not only a failing
    send), and `on_close` runs whatever ended the stream."""

    def __init__(self, chunks, on_close: Callable[[], None]):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.chunks, self.on_close = chunks, on_close

    async def __call__(self, scope, receive, send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pumping = asyncio.ensure_future(pump())
        watching = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pumping, watching):
                t.cancel()
            for t in (pumping, watching):  # a failed send (client gone) ends the stream like a disconnect
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await self.chunks.aclose()
            self.on_close()


def create_app(state: ServerState) -> Starlette:
    engine, served = state.engine, state.served

    def cancel(job: Job) -> None:
        if not planted("no_cancel_on_disconnect"):
            engine.cancel(job)

    def cancel_all(jobs: list[Job]) -> None:
        for job in jobs:
            cancel(job)

    def submit(req: GenerationRequest) -> list[Job]:
        """A job per choice, all queued or none (a full queue refuses the request as a whole)."""
        loop, jobs = asyncio.get_running_loop(), []
        try:
            for choice in req.choices():
                jobs.append(Job(choice, loop))
                engine.submit(jobs[-1])
        except APIError:
            cancel_all(jobs[:-1])
            raise
        return jobs

    async def generate(request: Request, parse: Callable[[object, Served], GenerationRequest], answer: Answer):
        try:
            _check_key(request, state.api_key)
            body = await _body(request)
            req = await run_in_threadpool(parse, body, served)  # tokenizing a long prompt off the event loop
            jobs = submit(req)
        except APIError as e:
            return _error(e, answer.error)
        disconnected = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            firsts = [await _next_event(job, disconnected) for job in jobs]
        except ClientGone:  # nobody reads an answer: free the queue places or slots
            cancel_all(jobs)
            return Response(status_code=499)
        except asyncio.CancelledError:  # the server is going down
            disconnected.cancel()
            cancel_all(jobs)
            raise
        failed = next((e for e in firsts if isinstance(e, Failure)), None)
        if failed is not None:
            disconnected.cancel()
            cancel_all(jobs)
            return _error(failed.error, answer.error)
        if req.stream:
            disconnected.cancel()  # the stream watches for itself
            builders = answer.builders(req, len(jobs), served)
            for b in builders[1:]:  # one id for the answer's chunks, whichever choice they carry
                b.id, b.created = builders[0].id, builders[0].created
            return EventStream(_stream(jobs, firsts, builders, req.include_usage, req.n, answer),
                               lambda: cancel_all(jobs))
        results = []
        try:
            for job, event in zip(jobs, firsts):
                while isinstance(event, Progress) and event.result is None:
                    event = await _next_event(job, disconnected)
                if isinstance(event, Failure):
                    cancel_all(jobs)
                    return _error(event.error, answer.error)
                results.append(event.result)
        except ClientGone:
            cancel_all(jobs)
            return Response(status_code=499)
        except asyncio.CancelledError:
            cancel_all(jobs)
            raise
        finally:
            disconnected.cancel()
        return JSONResponse(answer.body(req, [job.request for job in jobs], results, served))

    async def _stream(jobs: list[Job], firsts: list[Progress], builders: list, include_usage: bool, n: int,
                      answer: Answer):
        """The choices' chunks as their text comes (each chunk names its choice's index; a job's
        echo, its prompt, first), the usage of all (n choices per prompt) after the last choice
        finished, then [DONE] where the route's streams end with it (OpenAI's)."""
        merged: asyncio.Queue = asyncio.Queue()

        async def relay(i: int, job: Job, event: Progress | Failure) -> None:
            while True:
                await merged.put((i, event))
                if isinstance(event, Failure) or event.result is not None:
                    return
                event = await job.events.get()

        def indexed(i: int, chunks):
            for chunk in chunks:
                for choice in chunk.get("choices", ()):  # (llama-server's and Anthropic's events have none)
                    choice["index"] = i
                yield answer.event(chunk)

        relays = [asyncio.ensure_future(relay(i, job, first)) for i, (job, first) in enumerate(zip(jobs, firsts))]
        try:
            for i, (b, job, first) in enumerate(zip(builders, jobs, firsts)):  # echo with logprobs: the prompt's entries
                entries = None if planted("echo_logprobs_dropped") else first.prompt_logprobs
                for chunk in indexed(i, itertools.chain(b.start(), b.delta(job.request.echo, entries))):
                    yield chunk
            results: list = [None] * len(jobs)
            while any(r is None for r in results):
                i, event = await merged.get()
                if isinstance(event, Failure):  # the stream has started: the error goes in the stream
                    yield answer.event(answer.error(event.error))
                    return
                for chunk in indexed(i, builders[i].delta(event.text, event.logprobs)):
                    yield chunk
                if event.result is not None:
                    results[i] = event.result
                    for chunk in indexed(i, builders[i].finish(event.result, include_usage=False)):
                        yield chunk
            if include_usage:
                yield answer.event(builders[0].usage_chunk(usage_of(results, n)))
            if answer.done:
                yield DONE
        finally:
            for r in relays:
                r.cancel()

    def generation_route(parse: Callable[[object, Served], GenerationRequest], answer: Answer):
        async def route(request: Request):
            return await generate(request, parse, answer)
        return route

    async def models(request: Request):
        try:
            _check_key(request, state.api_key)
        except APIError as e:
            return _error(e)
        # OpenAI's fields and Anthropic's (type, display_name, created_at, has_more, first/last_id): both
        # clients list the one model
        created_at = datetime.fromtimestamp(state.created, timezone.utc).isoformat().replace("+00:00", "Z")
        return JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": state.created, "owned_by": "deltaspec",
             "type": "model", "display_name": served.name, "created_at": created_at, "meta": state.info}],
            "has_more": False, "first_id": served.name, "last_id": served.name})

    async def props(request: Request):
        try:
            _check_key(request, state.api_key)
        except APIError as e:
            return _error(e)
        return JSONResponse(props_body(served, state.metrics.slots))

    async def health(request: Request):
        if not engine.healthy:
            return JSONResponse({"status": "error", "message": "the engine loop has failed"}, status_code=503)
        if not engine.accepting:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        body = {"status": "ok", "slots_idle": state.metrics.slots - engine.n_running,
                "slots_processing": engine.n_running, "requests_waiting": engine.n_waiting}
        if isinstance(engine, ReplicaSet):
            body["replicas"] = engine.status()
            if any(r["status"] != "ok" for r in body["replicas"]):  # serving, on fewer replicas
                body["status"] = "degraded"
        return JSONResponse(body)

    def text_tool(answer: Callable[[object, Served], dict], error: Callable[[APIError], dict] = APIError.body):
        """A route that reads text and never generates (server.text_tools, Anthropic's count_tokens):
        the body checked and answered off the event loop."""
        async def route(request: Request):
            try:
                _check_key(request, state.api_key)
                body = await _body(request)
                return JSONResponse(await run_in_threadpool(answer, body, served))
            except APIError as e:
                return _error(e, error)
        return route

    async def metrics(request: Request):
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
                   else str(exc.detail))
        return _error(APIError(exc.status_code, message, code=code))

    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))

    routes = [Route("/v1/completions", generation_route(parse_completion, answers.COMPLETION), methods=["POST"]),
              Route("/v1/chat/completions", generation_route(parse_chat, answers.CHAT), methods=["POST"]),
              Route("/v1/embeddings", generation_route(parse_embeddings, answers.EMBEDDINGS), methods=["POST"]),
              Route("/v1/responses", generation_route(openai_responses.parse_responses, answers.RESPONSES),
                    methods=["POST"]),
              Route("/v1/messages", generation_route(anthropic.parse_messages, answers.MESSAGES), methods=["POST"]),
              Route("/v1/messages/count_tokens", text_tool(anthropic.count_tokens, APIError.anthropic_body),
                    methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/props", props, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route("/infill", generation_route(parse_infill, answers.NATIVE), methods=["POST"]),
              Route("/completion", generation_route(parse_completion_native, answers.NATIVE), methods=["POST"]),
              Route("/tokenize", text_tool(text_tools.tokenize), methods=["POST"]),
              Route("/detokenize", text_tool(text_tools.detokenize), methods=["POST"]),
              Route("/apply-template", text_tool(text_tools.apply_template), methods=["POST"])]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown(timeout=30)

    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: server_error})



class Server(uvicorn.Server):
    """uvicorn's server, telling the engine loop to refuse new work as soon as a signal comes (uvicorn
    then waits for open requests, up to its graceful timeout), and printing the bound address (the
    port, when --port 0) once it listens."""

    def __init__(self, config: uvicorn.Config, engine: EngineLoop | ReplicaSet):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        self.engine.stop_accepting()
        super().handle_exit(sig, frame)
        # A shutdown on SIGTERM / SIGINT is this command's normal end (exit 0); uvicorn would raise the
        # signal again once it has shut down, ending the process by the signal instead.
        getattr(self, "_captured_signals", []).clear()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                print(f"deltaspec serve: listening on http://{host}:{port}", file=sys.stderr, flush=True)
