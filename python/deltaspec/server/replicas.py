"""`--replicas DEV,DEV,...`: one Model per device, each stepped by its own engine loop, behind one
front that the HTTP handlers use exactly as they use a single EngineLoop (submit, cancel, the
load counters, shutdown).

The front owns the server's one backpressure limit (--queue-size requests waiting, whichever
replica they wait on) and places every request on a replica when it arrives:
- affinity first: a replica that kept a history the prompt extends (a conversation's next turn,
  csrc/slot_history.h) resumes from that state instead of prefilling it again, so the request goes
  there unless that replica is busier than the others and has no free slot;
- else the replica with the fewest running + waiting requests, ties taken in turn (so that
  consecutive requests on an idle server spread over the replicas rather than pile on the first).

What a replica kept is not asked of the engine: the front remembers, per replica, the tokens the
state of its last finished requests holds (prompt + reply but its last token, which was sampled
and never fed), as many as the replica has slots (the engine keeps at most that many, in idle
slots), so its memory is bounded by replicas x slots x context. A remembered history the engine
has since dropped costs only the prefill the request would have had anyway.

A request that fails fails alone on its replica (engine_loop.py); a replica whose loop itself
failed takes no more requests, and the others go on serving.
"""

from __future__ import annotations

import collections
import threading
from array import array
from dataclasses import dataclass, field

from ..generation import GenerationResult
from .engine_loop import EngineLoop, Job
from .errors import APIError, QueueFull, ShuttingDown
from .metrics import ReplicaMetrics, ServerMetrics
from .planted import planted


@dataclass
class Replica:
    index: int
    device: str
    engine: EngineLoop
    slots: int
    # token histories its slots kept, newest last (array('i'): 4 bytes a token)
    histories: collections.deque = field(default_factory=collections.deque)

    @property
    def load(self) -> int:
        return self.engine.n_running + self.engine.n_waiting

    def extended_by(self, prompt: array) -> int:
        """Length of the longest remembered history `prompt` extends (0: none). A prompt equal to a
        history does not extend it: the engine needs one new token to compute logits from."""
        best = 0
        for h in self.histories:
            if best < len(h) < len(prompt) and prompt[:len(h)] == h:
                best = len(h)
        return best


class ReplicaSet:
    def __init__(self, metrics: ServerMetrics, max_waiting: int):
        self.replicas: list[Replica] = []
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._lock = threading.Lock()          # placement: the queue bound, the loads and the turn order
        self._history_lock = threading.Lock()  # histories: written by engine threads, read by submit
        self._next = 0                         # where the turn among equally loaded replicas starts
        self._accepting = True

    def add(self, device: str, backend) -> Replica:
        """Replica number len(self.replicas): `backend` (backend.make_backend, over its own Model on
        `device`) stepped by an engine loop of its own, counted in `metrics.replicas[index]`."""
        index = len(self.replicas)
        engine = EngineLoop(backend, ReplicaMetrics(self.metrics, index), self.max_waiting,
                            name=f"deltaspec-engine-{index}", on_finished=self._remember(index))
        self.replicas.append(Replica(index, device, engine, backend.slots))
        return self.replicas[-1]

    # --- the engine threads -------------------------------------------------------------------
    def _remember(self, index: int):
        """The on_finished hook of replica `index`'s engine loop: remember what its slot kept."""
        def finished(job: Job, result: GenerationResult) -> None:
            if not result.tokens:
                return
            replica = self.replicas[index]
            kept = array("i", job.request.prompt)
            kept.extend(result.tokens[:-1])
            with self._history_lock:
                replica.histories.append(kept)
                while len(replica.histories) > replica.slots:
                    replica.histories.popleft()
        return finished

    # --- any thread: what app.py uses -------------------------------------------------------------
    def start(self) -> None:
        for r in self.replicas:
            r.engine.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if not self._accepting:
                raise ShuttingDown()
            live = [r for r in self.replicas if r.engine.accepting]
            if not live:
                raise APIError(503, "every replica's engine loop has failed; restart the server", code="engine_error")
            if self.n_waiting >= self.max_waiting and not planted("unbounded_queue"):
                self.metrics.rejected("queue_full")
                raise QueueFull(self.max_waiting)
            replica, how = self._place(job, live)
            job.replica = replica.index
            replica.engine.submit(job)  # its own bound is the server's, which the line above keeps
            self.metrics.dispatched(replica.index, how)

    def _place(self, job: Job, live: list[Replica]) -> tuple[Replica, str]:
        if planted("replica_zero_only") and self.replicas[0] in live:
            return self.replicas[0], "load"
        least = min(r.load for r in live)
        if not planted("no_affinity"):
            prompt = array("i", job.request.prompt)
            with self._history_lock:
                kept = [(r.extended_by(prompt), r) for r in live]
            length, home = max(kept, key=lambda k: k[0])
            # a resume saves a prefill of `length` tokens; queueing behind a full replica's requests
            # while another has room would cost more than that
            if length and (home.load < home.slots or home.load <= least):
                return home, "affinity"
        n = len(self.replicas)
        order = sorted(live, key=lambda r: (r.load, (r.index - self._next) % n))
        self._next = (order[0].index + 1) % n
        return order[0], "load"

    def cancel(self, job: Job) -> None:
        self.replicas[0 if planted("cancel_wrong_replica") else job.replica].engine.cancel(job)

    @property
    def n_waiting(self) -> int:
        return sum(r.engine.n_waiting for r in self.replicas)

    @property
    def n_running(self) -> int:
        return sum(r.engine.n_running for r in self.replicas)

    @property
    def healthy(self) -> bool:
        """Some replica still serves (/health reports each)."""
        return any(r.engine.healthy for r in self.replicas)

    @property
    def accepting(self) -> bool:
        return self._accepting and any(r.engine.accepting for r in self.replicas)

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False
        for r in self.replicas:
            r.engine.stop_accepting()

    def shutdown(self, timeout: float | None = None) -> None:
        """Every replica's loop: refuse, cancel what is left, stop (see EngineLoop.shutdown)."""
        self.stop_accepting()
        for r in self.replicas:
            r.engine.shutdown(timeout)

    def status(self) -> list[dict]:
        """Each replica's state, for /health."""
        return [{"replica": r.index, "device": r.device,
                 "status": "ok" if r.engine.healthy else "error",
                 "slots_idle": r.slots - r.engine.n_running, "slots_processing": r.engine.n_running,
                 "requests_waiting": r.engine.n_waiting} for r in self.replicas]
