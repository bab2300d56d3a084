"""llama-cpp-python's calls on CUDA against the CPU, on the tiny-vocabulary model: embeddings (the
hidden-state output of the graph), logprobs, ignore_eos / logit_bias, save_state / load_state
(KV rows and recurrent state copied off and back onto the device).

Run on the GPU machine with: python -m pytest -q -m gpu tests/test_gpu_llama_compat.py
"""

from __future__ import annotations

import numpy as np
import pytest

from deltaspec import Model, _core
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _core.has_device("cuda"), reason="no CUDA device in this "
                                                   "build of deltaspec (CPU-only build or no GPU)")]
PROMPT = "the cat sat on the mat"
TOL = 1e-2  # TF32 matmuls on CUDA (tests/test_gpu.py)


@pytest.fixture(scope="module")
def pair():
    path = tiny_vocab_model_path()
    kw = dict(n_ctx=256, type_k="f32", type_v="f32", progress=False)
    with Model(path, n_gpu_layers=0, **kw) as cpu, Model(path, n_gpu_layers=-1, **kw) as gpu:
        assert gpu.device == "cuda"
        yield cpu, gpu


def test_embeddings_match_cpu(pair):
    cpu, gpu = pair
    a, b = np.array(cpu.embed(PROMPT, pooling="none")), np.array(gpu.embed(PROMPT, pooling="none"))
    assert a.shape == b.shape and np.abs(a - b).max() <= TOL * max(1.0, np.abs(a).max())


def test_logprobs_and_bias_match_cpu(pair):
    cpu, gpu = pair
    eos = cpu.tokenize("<|im_end|>", special=True)[0]
    kw = dict(max_tokens=16, temperature=0, logprobs=4, ignore_eos=True, logit_bias={eos: 50.0})
    a, b = cpu.generate(PROMPT, **kw), gpu.generate(PROMPT, **kw)
    assert not any(gpu.tokenizer.is_eog(t) for t in b.tokens) and len(b.tokens) == 16
    n = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), len(a.tokens))
    assert n > 0
    assert np.abs(np.array(a.logprobs[:n]) - np.array(b.logprobs[:n])).max() <= TOL


def test_state_round_trip_on_the_device(pair):
    _, gpu = pair
    first = gpu.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    state = gpu.save_state()
    history = gpu.tokenize(PROMPT) + first.tokens + gpu.tokenize(" and")
    gpu.generate("something else", max_tokens=4, temperature=0)
    gpu.load_state(state)
    resumed = gpu.generate(history, max_tokens=8, temperature=0, ignore_eos=True)
    assert resumed.stats.cached_tokens == state.n_tokens
    gpu.reset()
    fresh = gpu.generate(history, max_tokens=8, temperature=0, ignore_eos=True)
    assert resumed.tokens == fresh.tokens
