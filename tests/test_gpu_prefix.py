"""Prompt-prefix reuse across requests (csrc/slot_history.h) on CUDA: kept histories are copied
between slots on the device (Engine::move_slot), and a resumed request's tokens equal a fresh
sequence's on the same device.

Run on the GPU machine with: python -m pytest -q -m gpu tests/test_gpu_prefix.py
The same check on a CPU model was seen to fail with DELTASPEC_TEST_SLOT_BUG=no_copy (A's second
turn ran on B's state); tests/test_server_prefix.py holds the CPU tests.
"""

from __future__ import annotations

import pytest

from deltaspec import Model, _core
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _core.has_device("cuda"), reason="no CUDA device in this "
                                                   "build of deltaspec (CPU-only build or no GPU)")]
N_GEN = 8


def run_alone(m: Model, prompt: list[int]):
    """One request through add_request / step, alone (the one-sequence kernels, as generate())."""
    rid = m.add_request(prompt, max_tokens=N_GEN, temperature=0, ignore_eos=True)
    done = []
    while m.has_unfinished_requests:
        done += [o.result for o in m.step() if o.finished and o.request_id == rid]
    return done[0]


def check_two_conversations(m: Model, fresh: Model) -> None:
    """A1, B1, A2, B2: B1 takes the slot A1 left (A's history is copied aside), A2 and B2 resume from
    their own first turns (copied back into the running slot); each second turn's tokens equal a
    fresh sequence's, and only the new tokens were prefilled."""
    first = {c: m.tokenize(f"conversation {c}: the cat sat") for c in "AB"}
    turn1 = {c: run_alone(m, first[c]) for c in "AB"}
    for c in "AB":
        second = first[c] + turn1[c].tokens + m.tokenize(f" then {c}")
        resumed = run_alone(m, second)
        assert resumed.stats.cached_tokens == len(first[c]) + N_GEN - 1, c
        fresh.reset()
        assert resumed.tokens == fresh.generate(second, max_tokens=N_GEN, temperature=0, ignore_eos=True).tokens, c


def test_two_conversations_resume_on_the_device():
    path = tiny_vocab_model_path()
    kw = dict(n_ctx=256, type_k="f32", type_v="f32", progress=False, n_gpu_layers=-1)
    with Model(path, n_seq_max=3, **kw) as m, Model(path, **kw) as fresh:
        assert m.device == "cuda"
        check_two_conversations(m, fresh)
