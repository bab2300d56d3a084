"""Grammar masks applied on CUDA (ggml/cuda/deltaspec_top.cu's masked rows; runs only where a CUDA
build and a GPU exist): the rows a grammar masks reduced on the device give the tokens of the same
rows masked on the host, on the tiny vocabulary (JSON schemas; plain decoding, and speculation's
chain and tree verifies) and on one of Qwen3.5's size (248320: the kernel's radix passes and
per-warp spans over a real row's length, most of it forbidden).

Run on the GPU machine with: python -m pytest -q -m gpu tests/test_gpu_device_masks.py

Both paths compute the same logits (the same graph up to the reduction), so the tokens must be
identical. The claims' CPU side and its planted bugs are in tests/test_device_masks.py.
"""

import re

import pytest

from deltaspec import Grammar, Model
from deltaspec.testing.json_schemas import BOUNDED_SCHEMAS
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path, write_tiny_vocab_model
from test_device_masks import DIGITS, TOP_K_SAMPLING, _both_paths
from test_gpu import _cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="no CUDA device in this build "
                                                   "of deltaspec (CPU-only build or no GPU)")]

SAMPLINGS = [dict(temperature=0.0), dict(TOP_K_SAMPLING, seed=3)]


@pytest.fixture(scope="module")
def big_vocab_model(tmp_path_factory):
    path = write_tiny_vocab_model(tmp_path_factory.mktemp("gpu-masks") / "tiny.gguf", n_vocab=248320, seed=0)
    with Model(path, device="cuda", n_ctx=256, n_seq_max=4, progress=False) as m:
        yield m


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "top-k"])
def test_cuda_device_masks_equal_host_masks(sampling):
    """Every bounded JSON schema, one sequence and a batch of 3 on 3 slots: the same tokens both ways,
    each output complete, and every masked row of the device run masked on the device."""
    with Model(tiny_vocab_model_path(), device="cuda", n_ctx=512, n_seq_max=3, progress=False) as m:
        for name, schema in BOUNDED_SCHEMAS.items():
            g = Grammar.from_json_schema(schema)
            device, host, n_device = _both_paths(m, lambda: m.generate("the cat sat", max_tokens=400, grammar=g,
                                                                       **sampling))
            assert device.tokens == host.tokens, (name, device.text, host.text)
            assert device.finish_reason == "stop" and n_device == device.stats.grammar_masked_rows > 0
            prompts = ["Hello", "{", "a b c"]
            device, host, n_device = _both_paths(m, lambda: m.generate_batch(prompts, max_tokens=400, grammar=g,
                                                                             **sampling))
            for a, b in zip(device, host):
                assert a.tokens == b.tokens, (name, a.text, b.text)
                assert a.finish_reason == "stop"
            assert n_device == sum(r.stats.grammar_masked_rows for r in device)
        assert m._engine.decode_stats["max_rows"] == 3


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "top-k"])
def test_cuda_device_masks_on_a_full_vocabulary(big_vocab_model, sampling):
    """248320 logits a row, ten of them allowed (digits): one sequence and a batch of 4, the same
    tokens both ways, the text the regex's."""
    m, g = big_vocab_model, Grammar.from_regex(DIGITS)
    device, host, n_device = _both_paths(m, lambda: m.generate("Hello", max_tokens=40, grammar=g, **sampling))
    assert device.tokens == host.tokens and re.fullmatch(DIGITS, device.text)
    assert n_device == len(device.tokens)
    prompts = ["Hello", "x", "12", "the cat"]
    device, host, n_device = _both_paths(m, lambda: m.generate_batch(prompts, max_tokens=40, grammar=g, **sampling))
    for a, b in zip(device, host):
        assert a.tokens == b.tokens and re.fullmatch(DIGITS, a.text), (a.text, b.text)
    assert n_device == sum(len(r.tokens) for r in device)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "top-k"])
def test_cuda_speculative_device_masks_equal_host_masks(sampling):
    """A draft model (the target loaded again) drafting chains and trees (tree_budget 6) under a
    JSON schema, one sequence and a batch of 3: the verify rows' masks applied on the device give
    the host path's tokens, drafts were accepted, and every masked row was masked on the device."""
    g = Grammar.from_json_schema(BOUNDED_SCHEMAS["record"])
    kw = dict(device="cuda", n_ctx=512, n_seq_max=3, progress=False)
    with Model(tiny_vocab_model_path(), **kw) as m, Model(tiny_vocab_model_path(), **kw) as draft:
        for tree in ({}, dict(tree_budget=6)):
            spec = dict(grammar=g, max_tokens=400, draft_model=draft, draft_n_max=6, **tree, **sampling)
            device, host, n_device = _both_paths(m, lambda: m.generate("the cat sat", **spec))
            assert device.tokens == host.tokens, (tree, device.text, host.text)
            assert device.stats.n_accepted > 0 and n_device == device.stats.grammar_masked_rows > 0
            device, host, n_device = _both_paths(m, lambda: m.generate_batch(["Hello", "{", "a b c"], **spec))
            for a, b in zip(device, host):
                assert a.tokens == b.tokens and a.finish_reason == "stop", (tree, a.text, b.text)
            assert n_device == sum(r.stats.grammar_masked_rows for r in device) > 0
