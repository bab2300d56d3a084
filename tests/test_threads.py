"""One Model used from several threads: engine calls are serialized, a running generation makes
them raise, a suspended stream is taken over, and the GIL is released while the engine computes."""

import shutil
import sys
import threading
import time

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.gguf_file import read_gguf
from deltaspec.testing.tiny_vocab import tiny_vocab, tiny_vocab_model_path

N_THREADS = 4
CALLS_PER_THREAD = 5
TOKENS = tiny_vocab()[0]
IM_START = TOKENS.index("<|im_start|>")


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
    fresh = model.logits(_ids(0))
    results = []
    worker = threading.Thread(target=lambda: results.append(
        model.generate(_ids(1, 8), max_tokens=None, temperature=0)))  # ~4000 tokens: seconds
    worker.start()
    _wait_until_generating(model)
    for call in (lambda: model.eval([1, 2]), lambda: model.logits([1, 2]), model.reset):
        with pytest.raises(RuntimeError, match="already generating"):
            call()
    model.cancel()
    worker.join()
    assert results[0].finish_reason == "cancelled"
    # the calls changed nothing, and the model is usable again
    np.testing.assert_array_equal(model.logits(_ids(0)), fresh)


def _write_silent_model(path):
    """A tiny-vocab model whose greedy output is <|im_start|> forever: a control token, so a stream
    of it yields no text and its reader stays inside next() (reading, never suspended)."""
    shutil.copyfile(tiny_vocab_model_path(branch_scale=0.0), path)
    f = read_gguf(path)

    def tensor(name):
        info = f.tensors[name]
        return info, np.fromfile(path, np.float32, int(np.prod(info.shape)), offset=info.offset).reshape(info.shape[::-1])

    (embd_info, embd), (_, norm), (head_info, head) = (tensor(n) for n in ("token_embd.weight", "output_norm.weight",
                                                                           "output.weight"))
    embd[:] = embd[0]  # every token the same input: with branch_scale 0 the same last hidden state h
    h = embd[0] / np.sqrt(np.mean(embd[0] ** 2) + 1e-6) * norm
    head[IM_START] = 6.0 * h / np.linalg.norm(h)  # logit ~50 against the random rows' std of 2.5
    with open(path, "r+b") as out:
        for info, data in ((embd_info, embd), (head_info, head)):
            out.seek(info.offset)
            out.write(data.astype(np.float32).tobytes())
    return path


def test_engine_calls_while_a_stream_is_read_raise(tmp_path):
    with Model(_write_silent_model(tmp_path / "silent.gguf"), n_ctx=8192, n_threads=1) as m:
        assert m.generate([1], max_tokens=4, temperature=0).tokens == [IM_START] * 4
        stream = m.generate([1], max_tokens=None, temperature=0, stream=True)
        pieces = []
        reader = threading.Thread(target=lambda: pieces.extend(stream))  # blocks in next(): no text comes
        reader.start()
        _wait_until_generating(m)
        with pytest.raises(RuntimeError, match="already generating"):
            m.eval([1])
        with pytest.raises(RuntimeError, match="already generating"):
            m.logits([1])
        m.cancel()
        reader.join()
        assert pieces == [] and stream.result.finish_reason == "cancelled"


def test_eval_takes_the_model_from_a_suspended_stream(model):
    fresh = model.logits(_ids(2))
    stream = model.generate(_ids(3, 8), max_tokens=500, temperature=0, stream=True)
    next(stream)  # the stream now waits at a piece for its reader: suspended
    # as a new generate() would, eval cancels the stream instead of waiting for a reader who may never come
    np.testing.assert_array_equal(model.logits(_ids(2)), fresh)
    list(stream)  # the pieces the loop had queued before it was cancelled
    assert stream.result.finish_reason == "cancelled" and len(stream.result.tokens) < 500


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
