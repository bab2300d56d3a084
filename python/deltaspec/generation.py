"""Text generation on top of the engine's C++ decode loop: results, streaming, stop strings, cancel."""

from __future__ import annotations

import queue
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .logprobs import StreamedLogprobs
from .sampling import SamplingOptions

FINISH_REASONS = ("stop", "length", "cancelled")

# Control tokens (<|im_start|>, <|im_end|>, ...) are not part of generated text, as in llama.cpp's
# and llama-cpp-python's output (special=False); user-defined ones such as <think> are.
TEXT_SPECIAL = False

# How often a call waiting for a busy engine looks again for a suspended stream to take it from.
BUSY_POLL_SECONDS = 0.01

# Tokens the decode loop may run ahead of a stream's reader: enough to hide the reader's work per
# piece, few enough that a stream nobody reads stops soon instead of computing up to max_tokens.
STREAM_AHEAD = 64


@dataclass
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    # speculative decoding only (zero otherwise)
    n_steps: int = 0              # target forward passes after the prompt
    n_drafted: int = 0
    n_accepted: int = 0
    n_tree_nodes: int = 0         # nodes of the draft trees verified (tree_budget > 0)
    accepted_lengths: list[int] = field(default_factory=list)  # drafts accepted, per verified draft
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    rollback_seconds: float = 0.0
    # whole rows the sampler ordered by radix / by comparison sort (csrc/sampler.h SortCounts)
    sampler_radix_sorts: int = 0
    sampler_comparison_sorts: int = 0
    # structured output only (a grammar): logit rows masked, draft tokens cut before verification,
    # forced tokens drafted, drafter rows masked (a draft model, the MTP head or DFlash drafting
    # within the grammar) (speculation)
    grammar_masked_rows: int = 0
    grammar_cut_tokens: int = 0
    grammar_forced_tokens: int = 0
    grammar_draft_rows: int = 0
    # prompt tokens the sequence already held (a resumed chat, load_state) and were not evaluated
    cached_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per target forward pass (accepted drafts + the target's own token)."""
        return (self.n_accepted + self.n_steps) / self.n_steps if self.n_steps else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: generated tokens after the first (which comes from the prefill) per second."""
        n = self.generated_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


@dataclass
class GenerationResult:
    tokens: list[int]        # every generated token, including a final end-of-generation token
    text: str                # the generated text, cut before a stop string, without the EOG token
    finish_reason: str       # "stop" | "length" | "cancelled"
    stats: GenerationStats
    # generate(logprobs=k): per token, its log-probability under the raw logits (log_softmax, before
    # penalties and temperature) and the k most probable (token, log-probability), best first
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # add_request(prompt_logprobs=True): (token, log-probability, top k) of each prompt token given
    # the ones before it; the first token's are None (no context)
    prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] | None = None
    # add_request(hidden_states=True): (prompt tokens, n_embd) float32 final hidden states (after the
    # output norm: what embeddings pool)
    hidden_states: np.ndarray | None = None


@dataclass
class Speculation:
    """How to draft: `draft` is a Model (spec_type "draft-simple"), a DFlash Drafter ("dflash") or
    None for prompt lookup ("ngram-simple"), or the target's own MTP head when `mtp` (spec_type "mtp")."""

    draft: object | None
    n_max: int = 16
    n_min: int = 0
    ngram_max: int = 3
    tree_budget: int = 0  # > 0: draft trees of up to this many nodes; 0: chains
    mtp: bool = False
    dflash: bool = False  # draft is a deltaspec.dflash.Drafter (spec_type "dflash")
    # prompt lookup also searches these ids, before the sequence's own text: a request's predicted
    # output (deltaspec.prediction); only the scheduler (add_request / generate_batch) reads it
    reference: tuple[int, ...] = ()


@dataclass
class _Request:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingOptions
    stop: list[str] = field(default_factory=list)
    speculation: Speculation | None = None
    grammar: object | None = None  # a deltaspec.grammar.Grammar
    n_logprobs: int = -1  # -1: no log-probabilities; k >= 0: with the top k
    reasoning_budget: int | None = None  # tokens a <think> block may hold (deltaspec.reasoning_budget); None: any
    reasoning_budget_message: str = ""  # text forced before the block's end when the budget runs out


def validate_stop(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, (list, tuple)):
        raise TypeError(f"stop must be a string, a list of strings or None, got {type(stop).__name__} {stop!r}")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}] must be a string, got {type(s).__name__} {s!r}")
        if not s:
            raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
    return list(stop)


def validate_flag(name: str, value: object) -> bool:
    """`value` itself when it is a bool; anything else (a truthy "no", 1) is a mistake worth naming."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _held_back(data: bytes, stops: list[bytes]) -> int:
    """How many trailing bytes to withhold: the longest suffix that begins some stop string, then
    enough more that the emitted part never ends inside a UTF-8 character."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(data)), hold, -1):
            if data.endswith(s[:n]):
                hold = n
                break
    end = len(data) - hold
    # back off over continuation bytes to the start of an incomplete character
    i = end
    while i > 0 and end - i < 4 and (data[i - 1] & 0xC0) == 0x80:
        i -= 1
    if i > 0 and data[i - 1] >= 0xC0:
        need = 2 if data[i - 1] < 0xE0 else 3 if data[i - 1] < 0xF0 else 4
        if end - (i - 1) < need:
            end = i - 1
    return len(data) - end


def _busy_error(model) -> RuntimeError:
    return RuntimeError(f"this model is already generating (one request at a time per Model): {model.path}")


def _free_from_suspended(model) -> None:
    """Make sure no generation holds `model`: cancel a stream suspended between pieces (nobody is
    reading it) and wait for its worker; raise RuntimeError if a generation is running (a
    non-streamed generate(), or a stream whose reader is waiting for its next piece)."""
    with model._control:
        old = model._active()
        if old is None or old._done.is_set():
            return
        if not old._suspended:
            raise _busy_error(model)
    old._stop()  # outside the lock: its worker does not need it to finish


@contextmanager
def engine_of(model):
    """`model`'s engine, held by the caller for the block (model._busy): the engine is not
    thread-safe, so every call that computes or changes the sequence goes through here or through
    a Generator's worker (reading n_past / n_ctx needs neither).

    Generations come first: a running one makes this raise RuntimeError, a suspended stream is
    cancelled (as a new generate() cancels it). Another thread's direct call is waited for; the
    wait looks again for a stream to cancel every BUSY_POLL_SECONDS, since a suspended stream's
    worker keeps the engine until cancelled."""
    while True:
        _free_from_suspended(model)
        if model._busy.acquire(timeout=BUSY_POLL_SECONDS):
            break
    try:
        yield model._live()
    finally:
        model._busy.release()


class Generator:
    """Runs one request on a model's engine in a worker thread, so that the caller's thread can
    take KeyboardInterrupt (and streaming consumers can stop early) while C++ computes.

    A model runs one request at a time (`model._active`, guarded by `model._control`). A new
    request takes the model from a stream that is suspended between pieces (nobody is reading it:
    abandoned, or left for later): that stream is cancelled and ends with finish_reason
    "cancelled", as llama-cpp-python's server interrupts a running stream with a new request. The
    worker holds `model._busy` (and a draft model's) while it runs the engine, so a direct call
    (eval, logits, reset) that started first finishes before the loop starts."""

    def __init__(self, model, request: _Request):
        self._model = model
        self._req = request
        self._tokens: queue.Queue = queue.Queue()
        self._room = threading.Semaphore(STREAM_AHEAD)  # back-pressure from a slow (or absent) reader
        self._cancelled = threading.Event()
        self._suspended = False  # a stream waiting at a yield for its reader
        self._outcome: dict | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # Set by the worker when it is done. Waiting on this rather than Thread.join(): a join
        # interrupted by KeyboardInterrupt leaves CPython's thread marked finished while it runs.
        self._done = threading.Event()
        self._final_bytes = b""
        self.final: GenerationResult | None = None  # set once a stream is exhausted or closed
        # logprobs while streaming: the tokens' (token, logprob, top list) entries, and those whose
        # text is out until take_logprobs() hands them over
        self._logprobs = StreamedLogprobs()
        self._ready_entries: list = []

    def _run(self, streaming: bool) -> None:
        callback = self._hand_off if streaming else None
        req, eog, stop = self._req, sorted(self._model.tokenizer.eog_ids), [s.encode() for s in self._req.stop]
        try:
            constraint = self._model._constraint(req)
            with self._model._busy:
                engine = self._model._live()
                cached, self._model._cached_tokens = self._model._cached_tokens, None
                if req.speculation is None:
                    # a sequence that holds a proper prefix of the prompt continues from it
                    n_cached = (len(cached) if cached and len(cached) < len(req.prompt) and engine.n_past == len(cached)
                                and req.prompt[:len(cached)] == cached else 0)
                    self._outcome = engine.generate(req.prompt, req.max_tokens, req.sampling.native(), eog, stop,
                                                    callback, constraint=constraint, n_cached=n_cached,
                                                    n_logprobs=req.n_logprobs)
                    # the state now holds the prompt and every generated token but the last
                    self._model._cached_tokens = req.prompt + list(self._outcome["tokens"][:-1])
                else:
                    self._outcome = self._run_speculative(engine, eog, stop, callback, constraint)
            if constraint is not None:
                self._outcome["grammar_masked_rows"] = constraint.n_masked_rows
                self._outcome["grammar_cut_tokens"] = constraint.n_cut_tokens
                self._outcome["grammar_forced_tokens"] = constraint.n_forced_tokens
                self._outcome["grammar_draft_rows"] = constraint.n_draft_rows
        except BaseException as e:  # handed to the caller's thread
            self._error = e
        finally:
            self._done.set()  # frees the model for the next request
            self._tokens.put(None)

    def _run_speculative(self, engine, eog: list[int], stop: list[bytes], callback, constraint) -> dict:
        req, spec = self._req, self._req.speculation
        if spec.draft is None:
            return engine.generate_speculative(None, spec.ngram_max, req.prompt, req.max_tokens, req.sampling.native(),
                                               eog, stop, spec.n_max, spec.n_min, callback, spec.tree_budget,
                                               constraint=constraint, mtp=spec.mtp, n_logprobs=req.n_logprobs)
        if spec.dflash:  # a deltaspec.dflash.Drafter on this model's engine
            return engine.generate_speculative(None, spec.ngram_max, req.prompt, req.max_tokens, req.sampling.native(),
                                               eog, stop, spec.n_max, spec.n_min, callback, spec.tree_budget,
                                               constraint=constraint, dflash=spec.draft._core,
                                               n_logprobs=req.n_logprobs)
        with engine_of(spec.draft) as draft:  # the draft model's engine is ours for the whole run too
            return engine.generate_speculative(draft, spec.ngram_max, req.prompt, req.max_tokens,
                                               req.sampling.native(), eog, stop, spec.n_max, spec.n_min, callback,
                                               spec.tree_budget, constraint=constraint, n_logprobs=req.n_logprobs)

    def _hand_off(self, token: int, entry=None) -> bool:
        """The decode loop's callback when streaming: queue the token (and, with logprobs, its entry
        (logprob, top list)) for the reader, waiting while the reader is STREAM_AHEAD tokens behind.
        False (stop the loop) once cancelled."""
        self._room.acquire()
        if self._cancelled.is_set():
            return False
        self._tokens.put((token, entry))
        return True

    def _claim(self) -> None:
        """Make this request the model's running one, taking the model from a suspended stream."""
        model = self._model
        _free_from_suspended(model)
        with model._control:
            other = model._active()
            if other is not None and not other._done.is_set():  # another thread's request got in first
                raise _busy_error(model)
            self._install()

    def _install(self) -> None:
        # under model._control: a cancel meant for the previous request cannot reach this one
        self._model._live().clear_cancel()
        self._model._active = weakref.ref(self)

    def _start(self, streaming: bool) -> None:
        self._claim()
        try:
            self._thread = threading.Thread(target=self._run, args=(streaming,), daemon=True)
            self._thread.start()
        except BaseException:
            if self._thread is None or self._thread.ident is None:
                self._done.set()  # the worker, which sets it, never started: free the model
            raise

    def cancel(self) -> None:
        """Ask the running loop to stop (thread-safe); a no-op once it has finished."""
        model = self._model
        with model._control:
            if self._done.is_set() or model._active() is not self:
                return
            self._cancelled.set()
            model._live().cancel()
        self._room.release()  # wake a hand-off waiting for the reader

    def _stop(self) -> None:
        """Cancel the C++ loop and wait for the worker (which frees the model)."""
        if self._thread is not None and self._thread.ident is not None:
            self.cancel()
            self._done.wait()

    def _wait(self) -> None:
        while not self._done.wait(0.05):
            pass
        if self._error is not None:
            raise self._error

    def result(self) -> GenerationResult:
        try:
            self._start(streaming=False)
            self._wait()
        except BaseException:  # KeyboardInterrupt: stop the loop, then let the interrupt through
            self._stop()
            raise
        return self._finish()

    def stream(self) -> Iterator[str]:
        self._start(streaming=True)
        tok = self._model.tokenizer
        stops = [s.encode() for s in self._req.stop]
        data = bytearray()
        emitted = 0
        try:
            while (item := self._tokens.get()) is not None:
                token, entry = item
                self._room.release()
                if tok.is_eog(token):
                    continue
                piece = tok.token_to_piece(token, special=TEXT_SPECIAL)
                if entry is not None:
                    self._logprobs.add((token, *entry), len(data), len(data) + len(piece))
                data += piece
                end = len(data) - _held_back(data, stops)
                # the token completing a stop string reaches us before the loop reports the stop;
                # only the newest bytes can complete one (an earlier one would have ended the loop)
                cuts = [at for at in (data.find(s, max(0, len(data) - len(piece) - len(s) + 1)) for s in stops)
                        if at >= 0]
                end = min([end, *cuts])
                if end > emitted:
                    self._ready_entries += self._logprobs.release(end)
                    self._suspended = True
                    yield data[emitted:end].decode("utf-8", errors="replace")
                    self._suspended = False
                    emitted = end
        except BaseException:  # the consumer stopped iterating (or was interrupted): cancel cleanly
            self._stop()
            if self._outcome is not None:  # what was generated, finish_reason "cancelled"
                self.final = self._finish()
            raise
        self._wait()
        self.final = self._finish()
        if self.final.logprobs is not None:  # the rest of the answer's entries
            self._ready_entries += self._logprobs.rest(tok, self.final)
        rest = self._final_bytes[emitted:]
        if rest:
            yield rest.decode("utf-8", errors="replace")

    def take_logprobs(self) -> list:
        """The (token, logprob, top list) entries of the text pieces yielded since the last call."""
        out, self._ready_entries = self._ready_entries, []
        return out

    def _finish(self) -> GenerationResult:
        result, self._final_bytes = result_of(self._model.tokenizer, len(self._req.prompt), self._outcome)
        return result


def result_of(tokenizer, n_prompt: int, out: dict) -> tuple[GenerationResult, bytes]:
    """The GenerationResult of an engine's result dict, and its text's bytes."""
    tokens = list(out["tokens"])
    body = tokens[:-1] if tokens and tokenizer.is_eog(tokens[-1]) else tokens
    data = tokenizer.decode_bytes(body, special=TEXT_SPECIAL)
    if out["stop_offset"] >= 0:
        data = data[:out["stop_offset"]]
    spec = {k: out[k] for k in ("n_steps", "n_drafted", "n_accepted", "n_tree_nodes", "accepted_lengths",
                                "draft_seconds", "verify_seconds", "rollback_seconds", "sampler_radix_sorts",
                                "sampler_comparison_sorts", "grammar_masked_rows",
                                "grammar_cut_tokens", "grammar_forced_tokens", "grammar_draft_rows") if k in out}
    cached = n_prompt - out["n_prefilled"] if out.get("n_prefilled") else 0  # 0: a speculative run, no count
    stats = GenerationStats(prompt_tokens=n_prompt, generated_tokens=len(tokens),
                            prefill_seconds=out["prefill_seconds"], decode_seconds=out["decode_seconds"],
                            cached_tokens=cached, **spec)
    logprobs, top = _logprobs_of(out) if "logprobs" in out else (None, None)
    return GenerationResult(tokens, data.decode("utf-8", errors="replace"), out["finish_reason"], stats,
                            logprobs, top), data


def _logprobs_of(out: dict, prefix: str = "") -> tuple[list[float], list[list[tuple[int, float]]]]:
    """An engine dict's logprobs (one per token) and top lists ((token, logprob) pairs, k per token);
    prefix "prompt_": those of a scored prompt."""
    logprobs = list(out[prefix + "logprobs"])
    k = len(out[prefix + "top_ids"]) // max(1, len(logprobs))
    ids, lps = list(out[prefix + "top_ids"]), list(out[prefix + "top_logprobs"])
    return logprobs, [list(zip(ids[i * k:(i + 1) * k], lps[i * k:(i + 1) * k])) for i in range(len(logprobs))]


def prompt_entries(prompt: Sequence[int], out: dict) -> list[tuple[int, float | None, list[tuple[int, float]] | None]] | None:
    """A prompt's (token, logprob, top list) entries from an engine dict of a request with
    prompt_logprobs (the first token's are None: it has no context); None where the dict has none
    (the request did not ask, or finished before its prompt was evaluated)."""
    if "prompt_logprobs" not in out:
        return None
    return [(prompt[0], None, None)] + list(zip(prompt[1:], *_logprobs_of(out, "prompt_")))


def step_logprobs(event: dict) -> list[tuple[int, float, list[tuple[int, float]]]] | None:
    """(token, logprob, top list) of each token a scheduler step committed for a request that asked
    for logprobs; None for one that did not."""
    if "logprobs" not in event:
        return None
    logprobs, top = _logprobs_of(event)
    return list(zip(event["tokens"], logprobs, top))


class TextStream:
    """Iterator of generated text pieces; `result` holds the GenerationResult once exhausted.

    Closing it (or breaking out of a for loop over a stream nobody else references) cancels the
    generation cleanly; `result` then holds the tokens generated so far, with finish_reason
    "cancelled" unless the generation had already ended. A stream left unread between pieces gives
    the model up to the next generate() (it is cancelled) and stops when garbage-collected; the
    decode loop runs at most STREAM_AHEAD tokens ahead of the reader."""

    def __init__(self, generator: Generator):
        self._generator = generator
        self._pieces = generator.stream()

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        self._pieces.close()

    def take_logprobs(self) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """With generate(logprobs=k, stream=True): the (token, logprob, top list) entries of the
        tokens whose text the pieces yielded since the last call complete, in order (after the last
        piece, the rest of the answer's). Joined, they are the result's
        (deltaspec.logprobs.generated_logprobs: no end-of-generation token, nothing past a stop)."""
        return self._generator.take_logprobs()

    @property
    def result(self) -> GenerationResult | None:
        return self._generator.final
