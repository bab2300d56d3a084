"""Model.embed / create_embedding against transformers: the engine's final hidden states (after the
output norm) equal Qwen3_5TextModel's `last_hidden_state` on a tiny random checkpoint, per token,
and the pooled forms are the stated reductions of them."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from deltaspec import Model  # noqa: E402
from deltaspec.convert import convert_hf_to_gguf  # noqa: E402
from deltaspec.testing.tiny_models import tiny_model_dir  # noqa: E402

CONFIG = "attn2_d32_untied"
TEXTS = ["def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)", "斐波那契 ✓ and more words here"]
TOL = 1e-3  # as the logits parity test: f32 weights and KV cache


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf_dir = tiny_model_dir(CONFIG)
    path = tmp_path_factory.mktemp("embed") / "m.gguf"
    convert_hf_to_gguf(hf_dir, path, outtype="f32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with Model(path, n_ctx=256, n_ubatch=8, n_threads=2, type_k="f32", type_v="f32", progress=False) as m:
        yield m, hf


def _reference(m, hf, text: str) -> np.ndarray:
    ids = m.tokenize(text, special=True)
    with torch.no_grad():
        return hf.model(input_ids=torch.tensor([ids])).last_hidden_state[0].double().numpy()


def test_per_token_states_match_transformers(pair):
    """pooling="none" gives every token's final hidden state; they equal transformers' (micro-batches
    of 8 tokens, so the text crosses several). Seen red with the engine returning the head's input
    before the output norm (step_.out->src[1]->src[0]: off by the norm's scale)."""
    m, hf = pair
    for text in TEXTS:
        got = np.array(m.embed(text, pooling="none"))
        ref = _reference(m, hf, text)
        assert got.shape == ref.shape and got.shape[1] == m.hparams.n_embd
        assert np.abs(got - ref).max() <= TOL


def test_pooled_and_normalized(pair):
    """"last" (default) is the last token's state, "mean" the average, normalize=True unit length;
    create_embedding wraps them as OpenAI's list with the token count. Seen red with "last" pooling
    taking the first row."""
    m, hf = pair
    refs = [_reference(m, hf, t) for t in TEXTS]
    last = m.embed(TEXTS)
    assert len(last) == 2 and all(np.abs(np.array(v) - r[-1]).max() <= TOL for v, r in zip(last, refs))
    mean = m.embed(TEXTS[0], pooling="mean", normalize=True)
    want = refs[0].mean(axis=0)
    assert np.abs(np.array(mean) - want / np.linalg.norm(want)).max() <= TOL
    assert np.linalg.norm(mean) == pytest.approx(1.0, abs=1e-9)
    out = m.create_embedding(TEXTS)
    assert out["object"] == "list" and [d["index"] for d in out["data"]] == [0, 1]
    assert out["data"][1]["embedding"] == pytest.approx(last[1])
    assert out["usage"]["prompt_tokens"] == sum(len(r) for r in refs)
    assert m.n_past == 0  # the sequence is left empty
    with pytest.raises(ValueError, match="pooling must be one of"):
        m.embed("x", pooling="cls")
    with pytest.raises(ValueError, match="empty text"):
        m.embed("")


def test_scheduler_hidden_states_equal_transformers(tmp_path):
    """add_request(hidden_states=True) (what /v1/embeddings runs): the prompt read in a slot while
    another request decodes beside it gives every token's final hidden state as transformers does
    (n_ubatch 8: the prompt crosses micro-batches), bitwise what embeddings.hidden_states gives
    alone; nothing generated. Bad combinations raise. Seen red with the prompt read into the other
    running slot (a temporary edit of Scheduler::feed)."""
    from deltaspec.embeddings import hidden_states

    hf_dir = tiny_model_dir(CONFIG)
    path = tmp_path / "m.gguf"
    convert_hf_to_gguf(hf_dir, path, outtype="f32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with Model(path, n_ctx=256, n_ubatch=8, n_threads=2, n_seq_max=2, type_k="f32", type_v="f32", progress=False) as m:
        alone = hidden_states(m, TEXTS[0])
        other = m.add_request("abc abc", temperature=0, max_tokens=20)
        m.step()
        rid = m.add_request(TEXTS[0], hidden_states=True)
        results = {}
        while m.has_unfinished_requests:
            results.update({o.request_id: o.result for o in m.step() if o.finished})
        got = results[rid]
        assert got.tokens == [] and got.finish_reason == "length" and len(results[other].tokens) == 20
        assert np.array_equal(got.hidden_states, alone)
        assert np.abs(got.hidden_states - _reference(m, hf, TEXTS[0])).max() < TOL
        for kwargs in ({"max_tokens": 5}, {"prompt_logprobs": True, "logprobs": 1}):
            with pytest.raises(ValueError, match="hidden_states"):
                m.add_request("abc", hidden_states=True, **kwargs)
        with pytest.raises(ValueError, match="hidden_states"):
            m.add_request("abc", hidden_states=True, spec_type="ngram-simple")
        assert not m.has_unfinished_requests
        m.set_prefill_budget(3)  # the prompt read over several steps: its rows still all there, in order
        rid = m.add_request(TEXTS[1], hidden_states=True)
        results = {}
        while m.has_unfinished_requests:
            results.update({o.request_id: o.result for o in m.step() if o.finished})
        split = results[rid].hidden_states
        assert len(m.tokenize(TEXTS[1], special=True)) > 2 * 3
        assert np.abs(split - _reference(m, hf, TEXTS[1])).max() < TOL
