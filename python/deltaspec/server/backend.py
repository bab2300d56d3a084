"""The server's only use of the engine's request API: start a request, cancel it, step.

Two backends, chosen by `make_backend`:
- `BatchBackend`: Model.add_request / step / cancel_request. Every step admits the requests given
  slots and decodes one token for every running one in one batch (continuous batching); with a
  drafter (--spec-type ngram-simple; -md: a draft model loaded with --parallel slots; --spec-type
  draft-dflash: a DFlash drafter with a context slot per request; draft-mtp: the model's MTP layer,
  a head per request) each request drafts and every step verifies all running requests' drafts in
  one target pass (speculation batched across requests).
- `SpeculativeBackend`: one request at a time through Model.generate(stream=True, draft_model /
  spec_type), the engine's one-sequence speculative loop, at --parallel 1 with a drafter.

Backends run on the engine loop's thread only, except `interrupt`, which any thread may call.
Each turns the engine's tokens into `Progress` reports: a text delta, and the result at the end.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from .. import logprobs as lp
from ..embeddings import hidden_states_of_ids
from ..generation import GenerationResult, GenerationStats
from .planted import planted
from .text import TextAssembler


@dataclass
class Progress:
    """What happened to one request: text to show, and its result once finished."""
    job: object
    text: str
    n_tokens: int                            # tokens committed since the last report
    result: GenerationResult | None = None   # set when the request finished
    # a request with logprobs: the (token, logprob, top list) entries of the tokens whose text `text`
    # completes (server.text); the last report has the rest. None: none asked for, or none known yet
    logprobs: list | None = None
    # a request with prompt_logprobs, in its first report: the prompt's entries (first token's None)
    prompt_logprobs: list | None = None


Report = Callable[[Progress], None]


class BatchBackend:
    def __init__(self, model, speculation: dict | None = None):
        self.model = model
        self.slots = model.n_seq_max
        # add_request's speculation keywords (spec_type, draft_model, draft_n_max, draft_n_min, tree_budget), or none
        self.speculation = {} if speculation is None else dict(speculation)
        self._running: dict[int, tuple[object, TextAssembler]] = {}  # engine request id -> (job, text)

    @property
    def n_running(self) -> int:
        return len(self._running)

    def start(self, job) -> None:
        r = job.request
        if r.hidden_states:  # an embedding: the prompt's hidden states, nothing generated, no drafter
            job.engine_id = self.model.add_request(r.prompt, hidden_states=True)
        else:
            job.engine_id = self.model.add_request(r.prompt, max_tokens=r.max_tokens, **r.options,
                                                   **({} if planted("spec_ignored") else self.speculation),
                                                   **({"prompt_logprobs": True} if r.prompt_logprobs else {}))
        self._running[job.engine_id] = (job, TextAssembler(self.model.tokenizer, r.options.get("stop", [])))

    def cancel(self, job) -> None:
        self.model.cancel_request(job.engine_id)  # it finishes ("cancelled") at the next step

    def interrupt(self, job) -> None:
        """Cancels reach a batch between steps (engine loop's thread): nothing to do here."""

    def step(self, report: Report) -> None:
        outs = self.model.step()
        for out in outs:
            entry = self._running.get(outs[0].request_id if planted("cross_talk") else out.request_id)
            if entry is None:  # abandoned after a failed step: its cancel has reached the engine
                continue
            job, text = entry
            if out.finished:  # its last token may complete a stop string: the final text says where to cut
                del self._running[out.request_id]
                delta, entries = text.finish(out.result.text), text.finish_logprobs(out.result)
            else:
                delta = text.push(out.tokens, out.logprobs)
                entries = None if out.logprobs is None else text.take_logprobs()
            report(Progress(job, delta, len(out.tokens), out.result if out.finished else None, entries,
                            out.prompt_logprobs))

    def abandon(self) -> list[object]:
        """After a failed step: cancel what ran (best effort) and forget it; the jobs it held."""
        jobs = [job for job, _ in self._running.values()]
        for request_id in list(self._running):
            try:
                self.model.cancel_request(request_id)
            except Exception:  # the engine is failing already; the jobs are failed by the caller
                pass
        self._running.clear()
        return jobs


class SpeculativeBackend:
    """One request at a time through the speculative decode loop (its own worker thread, which
    the pieces of a TextStream come from)."""

    slots = 1

    def __init__(self, model, speculation: dict):
        self.model = model
        self.speculation = speculation   # generate() keyword arguments: draft_model, spec_type, draft_n_*
        self._job = None
        self._lock = threading.Lock()    # _job as seen by interrupt() from another thread

    @property
    def n_running(self) -> int:
        return 0 if self._job is None else 1

    def start(self, job) -> None:
        with self._lock:
            self._job = job

    def cancel(self, job) -> None:
        self.interrupt(job)

    def interrupt(self, job) -> None:
        """Stop the running generation now (from any thread): it ends with finish_reason "cancelled"."""
        with self._lock:
            if self._job is job:
                self.model.cancel()

    def step(self, report: Report) -> None:
        """Runs the request to its end, reporting each piece as the engine's loop makes it."""
        job = self._job
        r = job.request
        try:
            # generate()'s loop drafts with the server's drafter only (MTP, DFlash, ...): a prediction
            # is a hint for the scheduler's lookup, and dropping it changes no token
            options = {k: v for k, v in r.options.items() if k != "prediction"}
            # the prompt's entries (echo with logprobs): one evaluation of it before the loop starts,
            # handed out with the first report and the result
            prompt_entries = lp.prompt_logprobs(self.model, r.prompt, options["logprobs"]) if r.prompt_logprobs else None
            if r.max_tokens == 0:  # the prompt scored, or its hidden states read, alone: nothing to generate
                stats = GenerationStats(prompt_tokens=len(r.prompt), generated_tokens=0, prefill_seconds=0.0,
                                        decode_seconds=0.0)
                none = [] if r.prompt_logprobs else None  # no tokens: empty lists where logprobs were asked
                result = GenerationResult([], "", "length", stats, none, none, prompt_entries)
                if r.hidden_states:
                    result.hidden_states = hidden_states_of_ids(self.model, r.prompt)
                report(Progress(job, "", 0, result, none, prompt_entries))
                with self._lock:
                    self._job = None
                return
            scored = prompt_entries
            stream = self.model.generate(r.prompt, stream=True, max_tokens=r.max_tokens, **options,
                                         **({} if planted("spec_ignored") else self.speculation))
            wants_logprobs = r.options.get("logprobs") is not None
            shown = []
            for piece in stream:
                shown.append(piece)
                report(Progress(job, piece, 0, None, stream.take_logprobs() if wants_logprobs else None, scored))
                scored = None
                if job.cancel_requested:  # a cancel that came before the loop started, or between pieces
                    stream.close()  # result: the tokens so far, "cancelled"
                    break
            result = stream.result
            rest = result.text[len("".join(shown)):] if result.text.startswith("".join(shown)) else ""
            result.prompt_logprobs = prompt_entries
            # the entries not handed out with a piece (TextStream.take_logprobs: after the last piece, the rest)
            report(Progress(job, rest, result.stats.generated_tokens, result,
                            stream.take_logprobs() if wants_logprobs else None, scored))
        except BaseException:
            # the job stays ours until abandon() hands it to the engine loop, which answers it with
            # the error; forgetting it here would leave its client waiting and the loop never idle
            raise
        with self._lock:
            self._job = None

    def abandon(self) -> list[object]:
        with self._lock:
            job, self._job = self._job, None
        return [] if job is None else [job]


def make_backend(model, parallel: int, speculation: dict | None):
    """The backend for `model` (loaded with n_seq_max=parallel) and the speculation options asked for
    (generate()'s draft_model / spec_type / draft_n_max / draft_n_min / tree_budget, or None)."""
    if parallel != 1 and speculation is not None:
        return BatchBackend(model, speculation)
    return BatchBackend(model) if speculation is None else SpeculativeBackend(model, speculation)
