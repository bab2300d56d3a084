"""The thread that owns the Model: it admits submitted requests into free slots, steps the engine
and hands each request's progress to the asyncio handler waiting for it.

HTTP handlers never touch the engine (which is not thread-safe); they `submit` a Job and read its
`events` queue, and `cancel` it when their client goes away. Waiting jobs live here, in a bounded
queue (QueueFull beyond it), so that a waiting request costs nothing in the engine and a cancel
of it is immediate; a job enters the engine only when a slot is free.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..generation import GenerationResult
from .backend import Progress
from .errors import APIError, QueueFull, ShuttingDown
from .metrics import ServerMetrics
from .planted import planted
from .schemas import GenerationRequest

log = logging.getLogger("deltaspec.server")


@dataclass
class Failure:
    """The job failed in the engine: the handler answers `error` (or ends its stream with it)."""
    error: APIError


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop          # the handler's loop, which `events` belongs to
    events: asyncio.Queue = field(default_factory=asyncio.Queue)   # Progress ..., then a final one or Failure
    id: int = field(default_factory=itertools.count().__next__)
    engine_id: int = -1
    replica: int = 0                         # which replica's engine loop holds it (--replicas; else 0)
    cancel_requested: bool = False
    cancel_sent: bool = False
    submitted: float = field(default_factory=time.monotonic)
    first_text_at: float | None = None       # when the first text reached the handler (time to first token)

    def deliver(self, event: Progress | Failure) -> None:
        """From the engine thread: queue `event` for the handler (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the handler's loop has closed (server going down): nobody to tell
            pass


class EngineLoop:
    def __init__(self, backend, metrics: ServerMetrics, max_waiting: int, name: str = "deltaspec-engine",
                 on_finished: Callable[[Job, GenerationResult], None] | None = None):
        """`metrics` may be a ServerMetrics or one replica's view of it (metrics.ReplicaMetrics);
        `on_finished` hears every request that finished in the engine (engine thread; the replica
        set remembers what the slot kept)."""
        self.backend = backend
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._on_finished = on_finished
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: dict[int, Job] = {}     # Job.id -> job, for jobs handed to the backend
        self._cancelled: list[Job] = []        # running jobs whose cancel is yet to reach the engine
        self._cond = threading.Condition()
        self._accepting = True
        self._stopping = False                 # finish what runs, then exit
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.healthy = True
        self._leaked: list[Job] = []           # planted bug "leak_jobs" only

    # --- any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if not self._accepting:
                if not self.healthy:
                    raise APIError(503, "the engine loop has failed; restart the server", code="engine_error")
                raise ShuttingDown()
            if len(self._waiting) >= self.max_waiting and not planted("unbounded_queue"):
                self.metrics.rejected("queue_full")
                raise QueueFull(self.max_waiting)
            self._waiting.append(job)
            self.metrics.set_load(len(self._waiting), len(self._running))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: free the job's slot (or queue place). A finished job is left alone."""
        with self._cond:
            self._cancel_locked(job)
            self._cond.notify()

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def n_running(self) -> int:
        return len(self._running)

    def stop_accepting(self) -> None:
        """The server is going down: new jobs get ShuttingDown (503); submitted ones go on."""
        with self._cond:
            self._accepting = False
            if planted("cancel_on_shutdown"):
                self._cancel_all()

    def shutdown(self, timeout: float | None = None) -> None:
        """Refuse new jobs, cancel what is left (the HTTP server has already waited for its
        requests to finish, up to its graceful timeout), and stop the thread."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            self._cancel_all()
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _cancel_all(self) -> None:
        for job in [*self._waiting, *self._running.values()]:
            self._cancel_locked(job)
        self._cond.notify()

    def _cancel_locked(self, job: Job) -> None:
        """Marks the job cancelled (once); a running one is interrupted. Holds self._cond."""
        if job.cancel_requested:
            return
        job.cancel_requested = True
        if job.id in self._running:
            self._cancelled.append(job)
            self.backend.interrupt(job)

    @property
    def accepting(self) -> bool:
        return self._accepting

    # --- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug of the loop itself: answer everyone, refuse new work
            log.exception("the engine loop failed")
            with self._cond:
                self.healthy = self._accepting = False
                jobs = [*self._waiting, *self._running.values()]
                self._waiting.clear()
                self._running.clear()
            for job in jobs:
                job.deliver(Failure(APIError(500, f"the engine loop failed: {type(e).__name__}: {e}",
                                             code="engine_error")))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._stopping):
                    self._cond.wait()
                if self._stopping and not self._running:
                    dropped, self._waiting = list(self._waiting), collections.deque()
                    self._drop(dropped)
                    return
                dropped = [j for j in self._waiting if j.cancel_requested]
                for j in dropped:
                    self._waiting.remove(j)
                admitted = []
                while self._waiting and len(self._running) + len(admitted) < self.backend.slots:
                    admitted.append(self._waiting.popleft())
                for job in admitted:
                    self._running[job.id] = job
                cancels, self._cancelled = self._cancelled, []
                self.metrics.set_load(len(self._waiting), len(self._running))
            self._drop(dropped)
            for job in admitted:
                self._start(job)
            for job in cancels:
                if job.id in self._running and not job.cancel_sent:
                    job.cancel_sent = True
                    self.backend.cancel(job)
            if self._running:
                self._step()

    def _drop(self, jobs: list[Job]) -> None:
        """Jobs cancelled while they waited: they never reached the engine."""
        for job in jobs:
            self.metrics.finished("cancelled", 0, 0, None)
            job.deliver(Failure(ShuttingDown() if self._stopping else
                                APIError(499, "the request was cancelled before it started", code="cancelled")))

    def _start(self, job: Job) -> None:
        try:
            self.backend.start(job)
        except Exception as e:  # this request's own problem: the others go on
            log.exception("request %d could not start", job.id)
            with self._cond:
                del self._running[job.id]
            self.metrics.finished("error", 0, 0, None)
            job.deliver(Failure(APIError(400 if isinstance(e, (ValueError, TypeError)) else 500,
                                         f"the engine refused the request: {type(e).__name__}: {e}",
                                         code="engine_refused")))

    def _step(self) -> None:
        t0 = time.monotonic()
        try:
            self.backend.step(self._report)
        except Exception as e:
            # The engine failed in a step shared by every running request: fail those, keep serving.
            log.exception("engine step failed")
            jobs = self.backend.abandon()
            with self._cond:
                for job in jobs:
                    self._running.pop(job.id, None)
            for job in jobs:
                self.metrics.finished("error", 0, 0, None)
                job.deliver(Failure(APIError(500, f"the engine failed: {type(e).__name__}: {e}", code="engine_error")))
        self.metrics.step(time.monotonic() - t0)

    def _report(self, p: Progress) -> None:
        self.metrics.tokens(p.n_tokens)
        if p.job.first_text_at is None and (p.text or p.result is not None):
            p.job.first_text_at = time.monotonic()
            self.metrics.first_token(p.job.first_text_at - p.job.submitted)
        if p.result is not None:
            with self._cond:
                self._running.pop(p.job.id, None)
                self.metrics.set_load(len(self._waiting), len(self._running))
            s = p.result.stats
            self.metrics.finished(p.result.finish_reason, s.prompt_tokens, s.generated_tokens, s)
            if self._on_finished is not None:
                self._on_finished(p.job, p.result)
            if planted("leak_jobs"):
                self._leaked.append(p.job)
        p.job.deliver(p)
