"""The engine against HF transformers' Qwen3_5ForCausalLM on tiny random checkpoints.

Each checkpoint is converted by our converter to an f32 GGUF; logits are compared at every
position for one-shot prefill and for prefill + token-by-token decode, with micro-batches small
enough that the prompt crosses several of their boundaries.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from deltaspec import Model  # noqa: E402
from deltaspec.convert import convert_hf_to_gguf  # noqa: E402
from deltaspec.testing.tiny_models import TINY_CONFIGS, tiny_model_dir  # noqa: E402

N_UBATCH = 16           # prompts below are several micro-batches long
PROMPT_LEN = 83         # not a multiple of N_UBATCH
SPLIT = 37              # prefill this many, then decode the rest one token at a time
TOL = 1e-3              # max |logit difference| (f32 weights, f32 KV cache)


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def case(request, tmp_path_factory):
    hf_dir = tiny_model_dir(request.param)
    gguf_path = tmp_path_factory.mktemp(request.param) / "model-f32.gguf"
    convert_hf_to_gguf(hf_dir, gguf_path, outtype="f32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model = Model(gguf_path, n_ctx=256, n_ubatch=N_UBATCH, type_k="f32", type_v="f32")
    rng = np.random.default_rng(7)
    text_ids = model.tokenize("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 斐波那契 ✓\n")
    random_ids = rng.integers(0, 248000, size=PROMPT_LEN - len(text_ids)).tolist()
    ids = text_ids + random_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().numpy()
    yield model, ids, ref
    model.close()


def _compare(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.shape == ref.shape
    diff = np.abs(got - ref).max()
    assert diff <= TOL, f"max |logit diff| {diff:.3g} > {TOL}"
    bad = np.flatnonzero(got.argmax(-1) != ref.argmax(-1))
    assert len(bad) == 0, f"argmax differs at positions {bad.tolist()}"


def test_logits_not_flat(case):
    _, _, ref = case
    assert ref.std(axis=-1).min() > 0.5
    assert len(set(ref.argmax(-1).tolist())) > 10


def test_prefill_matches_transformers(case):
    model, ids, ref = case
    _compare(model.logits(ids), ref)


def test_prefill_then_decode_matches_transformers(case):
    model, ids, ref = case
    model.reset()
    rows = [model.eval(ids[:SPLIT], logits="all")]
    rows += [model.eval([t], logits="all") for t in ids[SPLIT:]]
    assert model.n_past == len(ids)
    _compare(np.concatenate(rows), ref)


def test_last_logits_equal_last_row(case):
    model, ids, ref = case
    model.reset()
    last = model.eval(ids, logits="last")
    assert last.shape == (1, model.n_vocab)
    _compare(last, ref[-1:])
