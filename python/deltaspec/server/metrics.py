"""Counters and gauges of the server, rendered as Prometheus text for /metrics.

Updated from the engine thread and read by the HTTP thread, under one lock. Names follow
Prometheus conventions (`_total` counters, base units), prefixed `deltaspec_`.

With --replicas, every series above counts the whole server, and each replica's own series are
`deltaspec_replica_*{replica="I",device="D"}`: families of their own rather than a label on the
totals, so that sum() over a family never counts a request twice.
"""

from __future__ import annotations

import collections
import os
import threading
import time

RATE_WINDOW_SECONDS = 10.0   # tokens/s is the rate over this trailing window
FINISH_REASONS = ("stop", "length", "cancelled", "error")


def _rss_bytes() -> int:
    """Resident memory of this process (Linux /proc; 0 where it does not exist)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class ReplicaCounts:
    """One replica's share of the server's work (its engine loop's requests and steps)."""

    def __init__(self, device: str, slots: int):
        self.device = device
        self.slots = slots
        self.waiting = 0
        self.running = 0
        self.finish_counts = dict.fromkeys(FINISH_REASONS, 0)
        self.dispatched: dict[str, int] = dict.fromkeys(("affinity", "load"), 0)
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generated_tokens = 0
        self.steps = 0
        self.step_seconds = 0.0


class ServerMetrics:
    def __init__(self, slots: int, max_waiting: int, speculative: bool,
                 replicas: list[tuple[str, int]] | None = None):
        """`replicas`: (device, slots) of each replica, with --replicas; `slots` is then their sum."""
        self._lock = threading.Lock()
        self.replicas = [ReplicaCounts(d, n) for d, n in replicas or ()]
        self.slots = slots
        self.max_waiting = max_waiting
        self.speculative = speculative
        self.waiting = 0
        self.running = 0
        self.finish_counts = dict.fromkeys(FINISH_REASONS, 0)
        self.rejected_counts: dict[str, int] = collections.Counter()
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generated_tokens = 0
        self.n_drafted = 0
        self.n_accepted = 0
        self.n_spec_steps = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step

    # --- the engine thread --------------------------------------------------------------------
    def set_load(self, waiting: int, running: int, replica: int | None = None) -> None:
        with self._lock:
            if replica is None:
                self.waiting, self.running = waiting, running
                return
            r = self.replicas[replica]
            r.waiting, r.running = waiting, running
            self.waiting = sum(r.waiting for r in self.replicas)
            self.running = sum(r.running for r in self.replicas)

    def tokens(self, n: int) -> None:
        if n:
            with self._lock:
                now = time.monotonic()
                self._recent.append((now, n))
                self._trim(now)

    def step(self, seconds: float, replica: int | None = None) -> None:
        with self._lock:
            self.steps += 1
            self.step_seconds += seconds
            if replica is not None:
                self.replicas[replica].steps += 1
                self.replicas[replica].step_seconds += seconds

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1

    def finished(self, reason: str, prompt_tokens: int, generated_tokens: int, stats,
                 replica: int | None = None) -> None:
        reason = reason if reason in self.finish_counts else "error"
        with self._lock:
            self.finish_counts[reason] += 1
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += generated_tokens
            if replica is not None:
                r = self.replicas[replica]
                r.finish_counts[reason] += 1
                r.prompt_tokens += prompt_tokens
                r.generated_tokens += generated_tokens
                r.cached_prompt_tokens += 0 if stats is None else stats.cached_tokens
            if stats is not None:
                self.cached_prompt_tokens += stats.cached_tokens
                self.n_drafted += stats.n_drafted
                self.n_accepted += stats.n_accepted
                self.n_spec_steps += stats.n_steps

    def rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected_counts[reason] += 1

    def dispatched(self, replica: int, how: str) -> None:
        """The replica set sent a request to `replica`, for its kept history ("affinity") or its load."""
        with self._lock:
            self.replicas[replica].dispatched[how] += 1

    # --- readers ------------------------------------------------------------------------------
    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_SECONDS:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        with self._lock:
            now = time.monotonic()
            self._trim(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW_SECONDS

    def render(self) -> str:
        rate = self.tokens_per_second()
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
                lines.append(f"# HELP deltaspec_{name} {help}")
                lines.append(f"# TYPE deltaspec_{name} {kind}")
                for labels, value in samples:
                    lines.append(f"deltaspec_{name}{labels} {value:g}" if isinstance(value, float)
                                 else f"deltaspec_{name}{labels} {value}")

            metric("requests_waiting", "gauge", "Requests queued for a free slot.", [("", self.waiting)])
            metric("requests_running", "gauge", "Requests holding a sequence slot.", [("", self.running)])
            metric("slots", "gauge", "Sequence slots (--parallel).", [("", self.slots)])
            metric("queue_limit", "gauge", "Most requests that may wait (--queue-size).", [("", self.max_waiting)])
            metric("requests_finished_total", "counter", "Requests finished, by finish reason.",
                   [(f'{{reason="{r}"}}', n) for r, n in self.finish_counts.items()])
            metric("requests_cancelled_total", "counter", "Requests cancelled (client gone, or shutdown).",
                   [("", self.finish_counts["cancelled"])])
            metric("requests_rejected_total", "counter", "Requests refused before they were queued, by reason.",
                   [(f'{{reason="{r}"}}', n) for r, n in sorted(self.rejected_counts.items())] or [("", 0)])
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", self.prompt_tokens)])
            metric("prompt_tokens_cached_total", "counter", "Prompt tokens of finished requests that a kept "
                   "history held (not prefilled).", [("", self.cached_prompt_tokens)])
            metric("generated_tokens_total", "counter", "Tokens generated by finished requests.",
                   [("", self.generated_tokens)])
            metric("tokens_per_second", "gauge", f"Tokens generated per second over the last "
                   f"{RATE_WINDOW_SECONDS:g} s, all requests together.", [("", float(rate))])
            metric("engine_steps_total", "counter", "Engine steps run.", [("", self.steps)])
            metric("engine_step_seconds_total", "counter", "Time spent in engine steps.",
                   [("", float(self.step_seconds))])
            metric("time_to_first_token_seconds", "summary", "From submission to the first text of a request.",
                   [("_sum", float(self.ttft_sum)), ("_count", self.ttft_count)])
            metric("speculative", "gauge", "1 when requests decode speculatively (a drafter is loaded).",
                   [("", int(self.speculative))])
            metric("draft_tokens_total", "counter", "Draft tokens proposed.", [("", self.n_drafted)])
            metric("draft_tokens_accepted_total", "counter", "Draft tokens the target accepted.",
                   [("", self.n_accepted)])
            metric("acceptance_rate", "gauge", "Accepted / drafted draft tokens since start (0 without drafts).",
                   [("", float(self.n_accepted / self.n_drafted if self.n_drafted else 0.0))])
            metric("mean_acceptance_length", "gauge", "Tokens committed per target pass in speculative requests.",
                   [("", float((self.n_accepted + self.n_spec_steps) / self.n_spec_steps
                                if self.n_spec_steps else 0.0))])
            if self.replicas:
                self._render_replicas(metric)
            lines.append("# HELP process_resident_memory_bytes Resident memory size in bytes.")
            lines.append("# TYPE process_resident_memory_bytes gauge")
            lines.append(f"process_resident_memory_bytes {_rss_bytes()}")
            return "\n".join(lines) + "\n"

    def _render_replicas(self, metric) -> None:
        """Each replica's series (holds the lock)."""
        def per(values) -> list[tuple[str, float]]:
            """`values(r)`: (extra labels, value) pairs of replica r."""
            return [(f'{{replica="{i}",device="{r.device}"{extra}}}', v)
                    for i, r in enumerate(self.replicas) for extra, v in values(r)]

        def one(get):
            return per(lambda r: [("", get(r))])

        metric("replicas", "gauge", "Engine replicas (--replicas), each a Model on its device.",
               [("", len(self.replicas))])
        metric("replica_requests_waiting", "gauge", "Requests queued on the replica for a free slot.",
               one(lambda r: r.waiting))
        metric("replica_requests_running", "gauge", "Requests holding one of the replica's slots.",
               one(lambda r: r.running))
        metric("replica_slots", "gauge", "The replica's sequence slots (--parallel).", one(lambda r: r.slots))
        metric("replica_requests_dispatched_total", "counter", "Requests sent to the replica, by why: it kept a "
               "history the prompt extends (affinity), or it was the least loaded (load).",
               per(lambda r: [(f',by="{k}"', n) for k, n in r.dispatched.items()]))
        metric("replica_requests_finished_total", "counter", "The replica's finished requests, by finish reason.",
               per(lambda r: [(f',reason="{k}"', n) for k, n in r.finish_counts.items()]))
        metric("replica_prompt_tokens_total", "counter", "Prompt tokens of the replica's finished requests.",
               one(lambda r: r.prompt_tokens))
        metric("replica_prompt_tokens_cached_total", "counter", "Prompt tokens of the replica's finished requests "
               "that a kept history held.", one(lambda r: r.cached_prompt_tokens))
        metric("replica_generated_tokens_total", "counter", "Tokens the replica generated for finished requests.",
               one(lambda r: r.generated_tokens))
        metric("replica_engine_steps_total", "counter", "The replica's engine steps.", one(lambda r: r.steps))
        metric("replica_engine_step_seconds_total", "counter", "Time in the replica's engine steps.",
               one(lambda r: float(r.step_seconds)))


class ReplicaMetrics:
    """One replica's engine loop's handle on the server's metrics: what it reports counts in the
    server's totals and in the replica's own series."""

    def __init__(self, metrics: ServerMetrics, replica: int):
        self.server, self.replica = metrics, replica

    def set_load(self, waiting: int, running: int) -> None:
        self.server.set_load(waiting, running, replica=self.replica)

    def tokens(self, n: int) -> None:
        self.server.tokens(n)

    def step(self, seconds: float) -> None:
        self.server.step(seconds, replica=self.replica)

    def first_token(self, seconds: float) -> None:
        self.server.first_token(seconds)

    def finished(self, reason: str, prompt_tokens: int, generated_tokens: int, stats) -> None:
        self.server.finished(reason, prompt_tokens, generated_tokens, stats, replica=self.replica)

    def rejected(self, reason: str) -> None:
        self.server.rejected(reason)
