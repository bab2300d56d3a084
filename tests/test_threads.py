"""One Model used from several threads: engine calls are serialized, a running generation makes
them raise, a suspended stream is taken over, and the GIL is released while the engine computes."""

import shutil
import sys
import threading
import time

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.generation import STREAM_AHEAD
from deltaspec.gguf_file import read_gguf
from deltaspec.testing.tiny_vocab import tiny_vocab, tiny_vocab_model_path

N_THREADS = 4
CALLS_PER_THREAD = 5
TOKENS = tiny_vocab()[0]
IM_START = TOKENS.index("<|im_start|>")
# How long a test holds a generation in place. Correct code needs none of it (the calls raise at once);
# it only bounds a run where a call waits for the engine instead of raising, which then fails.
HOLD_SECONDS = 30


@pytest.fixture(scope="module")
def model():
    # micro-batches of 16: every logits call below runs several graphs, each a chance to interleave
    with Model(tiny_vocab_model_path(), n_ctx=4096, n_ubatch=16, n_threads=1) as m:
        yield m


def _ids(seed: int, n: int = 90) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def test_threads_hammering_logits_match_sequential_calls(model):
    inputs = [_ids(seed) for seed in range(N_THREADS)]
    expected = [model.logits(ids) for ids in inputs]  # sequential, one thread
    # different inputs per thread: an interleaved reset/eval would show as wrong rows, not just a crash
    assert all(np.abs(expected[0] - e).max() > 1.0 for e in expected[1:])
    got: dict[int, list[np.ndarray]] = {i: [] for i in range(N_THREADS)}
    errors: list[BaseException] = []
    start = threading.Barrier(N_THREADS)

    def work(i: int) -> None:
        try:
            start.wait()
            for _ in range(CALLS_PER_THREAD):
                got[i].append(model.logits(inputs[i]))
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(N_THREADS):
        assert len(got[i]) == CALLS_PER_THREAD
        for out in got[i]:
            np.testing.assert_array_equal(out, expected[i])


def _wait_until_generating(model) -> None:
    deadline = time.monotonic() + 30
    while (active := model._active()) is None or active._done.is_set():
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.001)


def test_engine_calls_during_a_running_generate_raise(model):
    """A generate() in progress makes eval / logits / reset raise. Deterministic: the test holds the
    engine (model._busy) while the generation starts, so the request is the model's running one but
    its worker waits for the engine and cannot finish before the calls, whatever the greedy text or
    the scheduling (greedy from this prompt ends after ~46 tokens, ~10 ms: a freely running loop
    could end before the calls). The cancel goes out before the engine is released, so the loop stops
    at its first check. The calls during a loop that is really under way: the stream test below.
    Planted bug, seen to fail (DID NOT RAISE, after HOLD_SECONDS): _free_from_suspended cancelling a
    running generation as it does a suspended stream, instead of raising."""
    fresh = model.logits(_ids(0))
    results = []
    held, release = threading.Event(), threading.Event()

    def hold_engine() -> None:
        with model._busy:
            held.set()
            release.wait(HOLD_SECONDS)

    holder = threading.Thread(target=hold_engine)
    holder.start()
    assert held.wait(30)
    worker = threading.Thread(target=lambda: results.append(
        model.generate(_ids(1, 8), max_tokens=None, temperature=0)))
    worker.start()
    _wait_until_generating(model)
    try:
        for call in (lambda: model.eval([1, 2]), lambda: model.logits([1, 2]), model.reset):
            with pytest.raises(RuntimeError, match="already generating"):
                call()
        model.cancel()
    finally:
        release.set()
        holder.join()
        worker.join()
    assert results[0].finish_reason == "cancelled" and results[0].tokens == []
    # the calls changed nothing, and the model is usable again
    np.testing.assert_array_equal(model.logits(_ids(0)), fresh)


def _tensor(path, f, name):
    info = f.tensors[name]
    return info, np.fromfile(path, np.float32, int(np.prod(info.shape)), offset=info.offset).reshape(info.shape[::-1])


def _write_tensors(path, *tensors) -> None:
    with open(path, "r+b") as out:
        for info, data in tensors:
            out.seek(info.offset)
            out.write(data.astype(np.float32).tobytes())


def _write_silent_model(path):
    """A tiny-vocab model whose greedy output is <|im_start|> forever: a control token, so a stream
    of it yields no text and its reader stays inside next() (reading, never suspended)."""
    shutil.copyfile(tiny_vocab_model_path(branch_scale=0.0), path)
    f = read_gguf(path)

    (embd_info, embd), (_, norm), (head_info, head) = (_tensor(path, f, n) for n in (
        "token_embd.weight", "output_norm.weight", "output.weight"))
    embd[:] = embd[0]  # every token the same input: with branch_scale 0 the same last hidden state h
    h = embd[0] / np.sqrt(np.mean(embd[0] ** 2) + 1e-6) * norm
    head[IM_START] = 6.0 * h / np.linalg.norm(h)  # logit ~50 against the random rows' std of 2.5
    _write_tensors(path, (embd_info, embd), (head_info, head))
    return path


def _write_endless_model(path, eog_ids):
    """The tiny-vocab model with the LM head rows of its end-of-generation tokens zeroed: their logit is
    0 while some random row's is above it, so greedy text never ends on its own (checked where used)."""
    shutil.copyfile(tiny_vocab_model_path(), path)
    f = read_gguf(path)
    info, head = _tensor(path, f, "output.weight")
    head[sorted(eog_ids)] = 0.0
    _write_tensors(path, (info, head))
    return path


def test_engine_calls_while_a_stream_is_read_raise(tmp_path, monkeypatch):
    """A stream whose reader is inside next() is running: eval / logits raise. Deterministic: the
    reader is held inside next() (at its first token, in the tokenizer's is_eog, which the stream
    calls per token) until the calls are done, so it stops taking tokens and the loop stops
    STREAM_AHEAD tokens ahead of it, handing a token over: it cannot finish before the calls. (With
    the reader free the loop ran to the end of the context, so the calls raced against that.)
    Planted bug, seen to fail (DID NOT RAISE): _free_from_suspended cancelling a running generation
    as it does a suspended stream, instead of raising."""
    with Model(_write_silent_model(tmp_path / "silent.gguf"), n_ctx=1024, n_threads=1) as m:
        assert m.generate([1], max_tokens=4, temperature=0).tokens == [IM_START] * 4
        at_first_token, go_on = threading.Event(), threading.Event()
        is_eog = m.tokenizer.is_eog

        def held_is_eog(token: int) -> bool:
            at_first_token.set()
            go_on.wait(HOLD_SECONDS)
            return is_eog(token)

        monkeypatch.setattr(m.tokenizer, "is_eog", held_is_eog)
        stream = m.generate([1], max_tokens=None, temperature=0, stream=True)
        pieces = []
        reader = threading.Thread(target=lambda: pieces.extend(stream))  # inside next(): no text comes
        reader.start()
        try:
            assert at_first_token.wait(30), "the reader never got a token"
            assert not m._active()._done.is_set() and not m._active()._suspended  # running, being read
            with pytest.raises(RuntimeError, match="already generating"):
                m.eval([1])
            with pytest.raises(RuntimeError, match="already generating"):
                m.logits([1])
            m.cancel()
        finally:
            go_on.set()
            reader.join()
        result = stream.result
        assert pieces == [] and result.finish_reason == "cancelled"
        assert 0 < len(result.tokens) <= STREAM_AHEAD + 2  # the loop did wait for the reader


def test_eval_takes_the_model_from_a_suspended_stream(tmp_path, model):
    """eval cancels a stream suspended at a piece. Deterministic: the model cannot end its text (no end
    token within max_tokens, checked by a plain greedy run), and max_tokens is beyond what the loop
    may run ahead of a reader who has taken one piece, so the loop is still waiting for that reader
    when eval comes. (The plain tiny model reached an end token 50 tokens in, inside the run-ahead,
    so the loop could finish with "stop" before eval cancelled it.) Planted bug, seen to fail:
    _free_from_suspended raising for a suspended stream as for a running generation."""
    max_tokens = 4 * STREAM_AHEAD
    with Model(_write_endless_model(tmp_path / "endless.gguf", model.tokenizer.eog_ids), n_ctx=1024,
               n_threads=1) as m:
        prompt = _ids(3, 8)
        full = m.generate(prompt, max_tokens=max_tokens, temperature=0)
        assert full.finish_reason == "length" and m.detokenize(full.tokens[:1]) != ""  # first token has text
        fresh = m.logits(_ids(2))
        stream = m.generate(prompt, max_tokens=max_tokens, temperature=0, stream=True)
        next(stream)  # one token read; the stream now waits at a piece for its reader: suspended
        # as a new generate() would, eval cancels the stream instead of waiting for a reader who may never come
        np.testing.assert_array_equal(m.logits(_ids(2)), fresh)
        list(stream)  # the pieces the loop had queued before it was cancelled
        result = stream.result
        assert result.finish_reason == "cancelled" and 0 < len(result.tokens) <= STREAM_AHEAD + 2
        assert result.tokens == full.tokens[:len(result.tokens)]


def test_gil_is_released_while_the_engine_computes(model):
    """A pure-Python thread keeps counting during a long logits call. With a huge switch interval
    the main thread never hands the GIL over on its own, so the counter moves during the call only
    if the call releases the GIL. A pure-Python loop of the same length is the control: there the
    counter must stand still, which shows the measurement can tell the two apart."""
    count = [0]
    stop = threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1
            time.sleep(0.0005)  # gives the GIL back, so the main thread can take it at all

    ids = _ids(4, 4000)
    model.logits(ids)  # warm: graphs allocated
    old_interval = sys.getswitchinterval()
    thread = threading.Thread(target=counter)
    thread.start()
    try:
        sys.setswitchinterval(100.0)
        before = count[0]
        t0 = time.perf_counter()
        model.logits(ids)
        call_seconds = time.perf_counter() - t0
        during_call = count[0] - before

        before = count[0]
        end = time.perf_counter() + call_seconds
        while time.perf_counter() < end:  # holds the GIL as long as the call took
            pass
        during_python = count[0] - before
    finally:
        sys.setswitchinterval(old_interval)
        stop.set()
        thread.join()
    assert during_python <= 2, f"the control loop let the counter run ({during_python}): the test cannot tell"
    assert during_call >= 10, (f"the counter advanced {during_call} times during a {call_seconds:.3f} s "
                               "logits call: the GIL was held")
