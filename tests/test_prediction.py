"""Predicted outputs (deltaspec.prediction): add_request / generate_batch(prediction=...) draft by
prompt lookup in the predicted text, and the output stays plain greedy's.

Tiny-vocabulary model on the CPU (F32 weights: the rows ops equal the chain recurrence bitwise, so
speculative greedy must give plain greedy's tokens exactly). Seen to fail with the prediction
dropped before the engine (deltaspec.model.predicted_speculation patched to return the request's
speculation unchanged: 8 of the 9 tests red, nothing drafted and no input checked) and with the
reference dropped in Model._native_spec (`[]` in place of `list(spec.reference)`: the right-prediction
and add_request tests red, nothing drafted from the prediction).
"""

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

N_CTX = 256
GREEDY = dict(max_tokens=64, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_vocab_model(tmp_path_factory.mktemp("prediction") / "tiny.gguf", seed=0)
    with Model(path, n_ctx=N_CTX, n_threads=1, n_seq_max=3) as m:
        yield m


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, 256, size=12).tolist() for _ in range(n)]


def test_a_right_prediction_is_drafted_and_accepted(model):
    """The plain output as the prediction: every sequence drafts from it and accepts nearly all of it
    (tokens per target pass well above prompt lookup in the own text alone), same tokens as plain."""
    prompts = _prompts(3)
    plain = model.generate_batch(prompts, **GREEDY)
    assert all(r.stats.n_drafted == 0 for r in plain)
    lookup = model.generate_batch(prompts, spec_type="ngram-simple", **GREEDY)
    predicted = model.generate_batch(prompts, per_prompt=[{"prediction": r.tokens} for r in plain], **GREEDY)
    for k, (p, own, pred) in enumerate(zip(plain, lookup, predicted)):
        assert pred.tokens == p.tokens, f"prompt {k}: a prediction changed the greedy output"
        assert pred.stats.n_drafted > 0 and pred.stats.n_accepted >= 0.8 * len(p.tokens), (k, pred.stats)
        assert pred.stats.mean_acceptance_length > 2 * max(1.0, own.stats.mean_acceptance_length), (k, pred.stats)


def test_a_wrong_prediction_costs_drafts_not_tokens(model):
    """Every 4th predicted token wrong, with spec_type "ngram-simple" too (lookup then searches the
    prediction before the own text): drafts are accepted in part and rejected in part, and the tokens
    are plain greedy's."""
    prompts = _prompts(2)
    plain = model.generate_batch(prompts, **GREEDY)
    wrong = [[(t + 1) % model.n_vocab if i % 4 == 3 else t for i, t in enumerate(r.tokens)] for r in plain]
    got = model.generate_batch(prompts, per_prompt=[{"prediction": w} for w in wrong], spec_type="ngram-simple",
                               draft_n_max=8, **GREEDY)
    for k, (p, g) in enumerate(zip(plain, got)):
        assert g.tokens == p.tokens, f"prompt {k}"
        assert 0 < g.stats.n_accepted < g.stats.n_drafted, (k, g.stats)


def test_add_request_and_text_predictions(model):
    """add_request takes a prediction (a prefix of the output here), and a text prediction is
    tokenized: both draft, both keep plain greedy's tokens; an empty prediction is none."""
    prompt = _prompts(1)[0]
    plain = model.generate_batch([prompt], **GREEDY)[0]
    rid = model.add_request(prompt, prediction=plain.tokens[:24], **GREEDY)
    tokens, result = [], None
    while model.has_unfinished_requests:
        for out in model.step():
            assert out.request_id == rid
            tokens += out.tokens
            result = out.result if out.finished else result
    assert tokens == plain.tokens and result.stats.n_accepted > 0, result.stats
    text = model.generate_batch([prompt], prediction=plain.text, **GREEDY)[0]
    assert text.tokens == plain.tokens and text.stats.n_drafted > 0, text.stats
    empty = model.generate_batch([prompt], prediction="", **GREEDY)[0]
    assert empty.tokens == plain.tokens and empty.stats.n_drafted == 0


@pytest.mark.parametrize("bad, error, match", [
    (["a"], TypeError, r"prediction\[0\] must be a token id"),
    ([1, 99999], ValueError, r"prediction\[1\] = 99999 is outside the vocabulary"),
    ([True], TypeError, r"prediction\[0\] must be a token id"),
    (3.5, TypeError, "prediction must be a str or a sequence of token ids"),
    (b"abc", TypeError, "prediction must be a str or a sequence of token ids"),
])
def test_bad_predictions_are_refused(model, bad, error, match):
    with pytest.raises(error, match=match):
        model.generate_batch(_prompts(1), prediction=bad, max_tokens=4)
    with pytest.raises(error, match=match):
        model.add_request(_prompts(1)[0], prediction=bad, max_tokens=4)
    assert not model.has_unfinished_requests


def test_generate_has_no_prediction(model):
    """The one-sequence loop does not read a reference: generate() refuses the keyword rather than
    ignoring it."""
    with pytest.raises(TypeError, match="prediction"):
        model.generate(_prompts(1)[0], prediction=[1, 2, 3], max_tokens=4)


def test_a_prediction_replaces_a_drafter(tmp_path):
    """Draft-model trees beside a prediction: the requests draft by lookup in the prediction instead
    (as a draft model's would), nearly all of it accepted (a random draft model accepts a few), plain
    greedy's tokens; an empty prediction is none, and the draft model drafts. Red before the
    prediction replaced the drafter (BatchSpeculationError, or the draft model's drafts)."""
    path = write_tiny_vocab_model(tmp_path / "t.gguf", seed=0)
    draft_path = write_tiny_vocab_model(tmp_path / "d.gguf", seed=1)
    with Model(path, n_ctx=N_CTX, n_threads=1, n_seq_max=2) as m, \
            Model(draft_path, n_ctx=N_CTX, n_threads=1, n_seq_max=2) as d:
        prompts = _prompts(2)
        trees = dict(draft_model=d, tree_budget=8)
        plain = m.generate_batch(prompts, **GREEDY)
        got = m.generate_batch(prompts, per_prompt=[{"prediction": r.tokens} for r in plain], draft_n_max=8,
                               **trees, **GREEDY)
        for k, (p, g) in enumerate(zip(plain, got)):
            assert g.tokens == p.tokens, f"prompt {k}: a prediction changed the greedy output"
            assert g.stats.n_drafted > 0 and g.stats.n_accepted >= 0.8 * len(p.tokens), (k, g.stats)
            assert g.stats.n_tree_nodes == 0, "the draft model's trees were verified"
        for prediction in ({}, {"prediction": ""}):
            unpredicted = m.generate_batch(prompts, draft_n_max=8, draft_n_min=1, **trees, **prediction, **GREEDY)
            assert all(r.stats.n_tree_nodes > 0 for r in unpredicted)
            assert [r.tokens for r in unpredicted] == [r.tokens for r in plain]
