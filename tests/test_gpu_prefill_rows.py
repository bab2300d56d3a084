"""Prompt chunks of several sequences in one pass on CUDA (Engine::prefill_rows: the rows ops'
CUDA kernels writing each slot's last row back, FA over one stream per slot; runs only where a CUDA
build and a GPU exist), against the one-sequence path on the same device and against the CPU.

Run on the GPU machine with: python -m pytest -q -m gpu tests/test_gpu_prefill_rows.py

A pass of N chunks runs other kernels than one sequence's prefill (the rows recurrence instead of
ggml's, GEMMs of another width), so logits agree to a tolerance and greedy tokens may part only at
near-ties (as in test_gpu.py). In a copy of this file run with device="cpu" for the "cuda" model (no
GPU where they were written), the logits test was seen to fail with DELTASPEC_TEST_PREFILL_BUG=position
and =shared_state (csrc/rows.h), the generate_batch test with =shared_state (its passes hold slots of
equal lengths, where =position changes nothing) and with the passes switched off
(_engine.set_prefill_rows(False): no pass over several slots).
"""

import numpy as np
import pytest

from deltaspec import Model
from test_gpu import _cuda_available, assert_parts_only_at_near_tie

TOL = 1e-2  # of the largest |logit|: TF32 products on CUDA (test_gpu.py)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="no CUDA device in this build "
                                                   "of deltaspec (CPU-only build or no GPU)")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    path = write_tiny_vocab_model(tmp_path_factory.mktemp("gpu-prefill-rows") / "tiny.gguf", seed=0)
    kw = dict(n_ctx=512, n_seq_max=4)
    with Model(path, device="cuda", **kw) as gpu, Model(path, device="cpu", n_threads=4, **kw) as cpu:
        yield gpu, cpu


def _prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n).tolist() for n in lengths]


def _rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_cuda_prefilled_slots_match_single_and_cpu(models, record_property):
    """4 slots holding 0, 5, 17 and 30 tokens take a 24-token chunk each in one pass, then 4 batched
    decode steps: the chunk's last-row logits and the decode rows' logits equal the same tokens
    evaluated alone on CUDA, and the CPU's pass, to TOL."""
    gpu, cpu = models
    heads = _prompts([0, 5, 17, 30], seed=13)
    chunks = _prompts([24] * 4, seed=14)
    steps = np.random.default_rng(15).integers(0, 256, size=(4, 4))
    got = {}
    for name, m in (("cuda", gpu), ("cpu", cpu)):
        for slot, h in enumerate(heads):
            m._engine.reset_slot(slot)
            if h:
                m._engine.eval_in_slot(slot, h, "none")
        last = m._engine.prefill_slots(chunks)
        got[name] = (last, np.stack([m._engine.decode_slots(row) for row in steps]))
    worst = 0.0
    for slot, (h, c) in enumerate(zip(heads, chunks)):
        alone = gpu.logits(h + c + steps[:, slot].tolist())
        n = len(h) + len(c)
        for name in ("cuda", "cpu"):
            last, decoded = got[name]
            ref = alone if name == "cuda" else cpu.logits(h + c + steps[:, slot].tolist())
            worst = max(worst, _rel_err(last[slot], ref[n - 1]), _rel_err(decoded[:, slot], ref[n:]))
        worst = max(worst, _rel_err(got["cuda"][1][:, slot], got["cpu"][1][:, slot]))
    record_property("worst_rel_err", worst)
    print(f"worst relative error {worst:.2e}")
    assert worst < TOL
    assert gpu._engine.prefill_stats["multi_slot_passes"] >= 1


def test_cuda_batch_prefilled_together_greedy_equals_generate_alone(models):
    """6 prompts of 6..32 tokens on 4 slots, generate_batch (the first four prefilled together: a
    pass of 20 rows each, then passes over the three, two longer ones) against generate() alone, on
    CUDA: the same tokens except at near-ties."""
    gpu, _ = models
    prompts = _prompts([20, 24, 28, 32, 12, 6], seed=5)
    before = gpu._engine.prefill_stats["multi_slot_passes"]
    batch = gpu.generate_batch(prompts, max_tokens=32, temperature=0)
    assert gpu._engine.prefill_stats["multi_slot_passes"] > before
    for k, (p, b) in enumerate(zip(prompts, batch)):
        alone = gpu.generate(p, max_tokens=32, temperature=0).tokens
        assert_parts_only_at_near_tie(gpu, p, alone, b.tokens, f"prompt {k}: alone and prefilled together")
