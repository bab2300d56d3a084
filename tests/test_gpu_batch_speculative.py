"""Speculation across several sequences on CUDA (runs only where a CUDA build and a GPU exist):
generate_batch with prompt lookup (Engine::verify_rows: the rows ops and one FA stream per slot on the
device, keep_paths' replay writing several slots back) against plain greedy generate() alone.

Run on the GPU machine with: python -m pytest -q -m gpu tests/test_gpu_batch_speculative.py

A verify pass runs other kernels than a one-token step, so greedy tokens may part only at near-ties
of the (biased) logits. Seen to fail with DELTASPEC_TEST_ROWS_BUG=wrong_parent and =swap_keep
(csrc/rows.h) in a copy of this file run with device="cpu" for the "cuda" model (no GPU where it
was written). Run on DeltaNet states of 32 (keep_paths' commit by the rows ops in a graph) and of 128,
where our CUDA kernels commit every slot's path (rows_stats["kernel_commits"]).
"""

import numpy as np
import pytest

from deltaspec import Model, _core
from test_gpu import NEAR_TIE, _cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="no CUDA device in this build "
                                                   "of deltaspec (CPU-only build or no GPU)")]

BIAS = {10: 10.0, 11: 10.0, 12: 10.0}  # the text wanders between 3 tokens: prompt lookup drafts and hits


@pytest.fixture(scope="module", params=[32, 128], ids=["state32", "state128"])
def gpu(tmp_path_factory, request):
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    path = write_tiny_vocab_model(tmp_path_factory.mktemp("gpu-batchspec") / "tiny.gguf", seed=0,
                                  ssm_state=request.param)
    with Model(path, device="cuda", n_ctx=512, n_seq_max=4) as m:
        yield m


def _assert_parts_only_at_near_tie(model, prompt, a, b, label):
    if a == b:
        return
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    logits = model.logits(prompt + a[:i])[-1].astype(np.float64)
    for t, v in BIAS.items():
        logits[t] += v
    top2 = np.sort(logits)[-2:]
    gap = (top2[1] - top2[0]) / np.abs(logits).max()
    print(f"{label} diverge at token {i}, top-2 gap {gap:.2e} of max |logit|")
    assert gap < NEAR_TIE, f"{label}: diverged at token {i} where the top-2 gap is {gap:.2e}, not a near-tie"


def test_cuda_speculative_batch_greedy_equals_plain_alone(gpu):
    """6 prompts on 4 slots with prompt lookup: every sequence gives plain greedy generate()'s tokens
    alone (except at near-ties), and drafts of several sequences were verified in the same passes."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=int(rng.integers(2, 40))).tolist() for _ in range(6)]
    batch = gpu.generate_batch(prompts, max_tokens=64, temperature=0, logit_bias=BIAS, spec_type="ngram-simple")
    spec = gpu.batch_spec_stats
    assert spec["multi_draft_passes"] > 0 and spec["mixed_passes"] > 0, spec
    assert gpu._engine.rows_stats["multi_slot_calls"] > 0
    kernels = _core.cuda_kernels_available() and gpu.hparams.ssm_state_size == 128
    assert (gpu._engine.rows_stats["kernel_commits"] > 0) == kernels
    assert sum(r.stats.n_accepted for r in batch) > 0
    for k, (p, b) in enumerate(zip(prompts, batch)):
        alone = gpu.generate(p, max_tokens=64, temperature=0, logit_bias=BIAS).tokens
        _assert_parts_only_at_near_tie(gpu, p, alone, b.tokens, f"prompt {k}: plain alone and speculative batch")
