"""Top rows on CUDA (ggml/cuda/deltaspec_top.cu; runs only where a CUDA build and a GPU exist): the
kernel's candidates and log-sum-exp against the whole rows on the same device, on a vocabulary of
Qwen3.5's size (248320: the radix passes and the per-warp spans of a real row).

Run on the GPU machine with: python -m pytest -q -m gpu tests/test_gpu_top_rows.py

Both paths compute the same logits (the same graph up to the reduction), so the tokens must be
identical; the logprobs differ by the float log-sum-exp (the host's is double). The CPU side of the
same claim, and its planted bugs, are in tests/test_top_rows.py.
"""

import numpy as np
import pytest

from deltaspec import Model
from engine_switch import on_then_off
from test_gpu import _cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="no CUDA device in this build "
                                                   "of deltaspec (CPU-only build or no GPU)")]

K = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    path = write_tiny_vocab_model(tmp_path_factory.mktemp("gpu-top") / "tiny.gguf", n_vocab=248320, seed=0)
    with Model(path, device="cuda", n_ctx=256, n_seq_max=4) as m:
        yield m


def _both(model, run):
    return on_then_off(model, "top_rows_enabled", "top_rows", run, check_off=False)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.5, top_k=K, top_p=1.0, min_p=0.0)])
def test_cuda_top_rows_equal_whole_rows(model, sampling):
    """generate(logprobs=64): the same tokens, the same 64 top ids in order, logprobs within 1e-4."""
    prompt = list(range(5, 25))

    def run():
        return model.generate(prompt, max_tokens=32, seed=3, logprobs=K, **sampling)

    reduced, whole, n_top = _both(model, run)
    assert n_top == len(reduced.tokens)
    assert reduced.tokens == whole.tokens
    assert np.allclose(reduced.logprobs, whole.logprobs, rtol=0, atol=1e-4)
    for a, b in zip(reduced.top_logprobs, whole.top_logprobs):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert np.allclose([v for _, v in a], [v for _, v in b], rtol=0, atol=1e-4)


def test_cuda_batch_sampling_equals_whole_rows(model):
    """4 sequences sampled in batches of 4 rows (top_k 64, flat): the same tokens either way."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, size=12).tolist() for _ in range(4)]
    per_prompt = [dict(seed=20 + i) for i in range(4)]

    def run():
        return model.generate_batch(prompts, per_prompt=per_prompt, max_tokens=24, temperature=1.5, top_k=K,
                                    top_p=1.0, min_p=0.0)

    reduced, whole, n_top = _both(model, run)
    assert n_top >= 4 * 20
    assert [r.tokens for r in reduced] == [r.tokens for r in whole]
