"""Top rows: a sequence whose sampler starts with a top-k of at most 64 (or is greedy), with no
penalty, logit bias or grammar and at most 64 top logprobs, takes its next token and logprobs from
its logits row reduced on the device (ggml/deltaspec_top.h: the 64 largest logits with their ids,
in order, and the row's log-sum-exp) instead of the whole row. The claim: the same tokens as the
whole-row path for the same seed, and the same logprobs (to float rounding of the log-sum-exp).
Each test runs both paths (Engine::enable_top_rows off is the whole-row path) and asserts from the
engine's counter that the reduced one ran.

Planted bugs (DELTASPEC_TEST_TOP_BUG, read once per process, in the op's CPU side) the tests were
seen to fail with: "k_minus_1" (the last candidate is not the row's 64th) fails
test_generate_logprobs_equal_the_whole_rows (its 64 top logprobs), the sampled batch test and both
speculative tests (top_k 64 over a flat tiny model draws the 64th); "no_lse" (the row's max written
as its log-sum-exp) fails the logprobs test.
"""

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path
from engine_switch import on_then_off

K = 64  # Engine::top_k() on a vocabulary of more than 64 tokens


@pytest.fixture(scope="module")
def model():
    with Model(tiny_vocab_model_path(), n_ctx=256, n_threads=1, n_seq_max=4) as m:
        yield m


def _both_paths(model, run):
    """run() with top rows, then with whole rows; and how many top rows the first run took."""
    return on_then_off(model, "top_rows_enabled", "top_rows", run)


def _prompts(n, seed=5):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(3, 30))).tolist() for _ in range(n)]


def test_batch_sampling_equals_the_whole_rows(model):
    """6 prompts on 4 slots, seeded sampling with top_k = 64 (a flat chain after it: temperature
    1.5, no top-p / min-p, so all 64 candidates can be drawn) and one greedy sequence: the tokens
    of the reduced path are the whole-row path's, and batches of 4 rows went through top rows."""
    prompts = _prompts(6)
    per_prompt = [dict(seed=10 + i) for i in range(6)]
    per_prompt[2] = dict(temperature=0)
    common = dict(max_tokens=40, temperature=1.5, top_k=K, top_p=1.0, min_p=0.0, ignore_eos=False)

    def run():
        return model.generate_batch(prompts, per_prompt=per_prompt, **common)

    reduced, whole, n_top = _both_paths(model, run)
    for i, (a, b) in enumerate(zip(reduced, whole)):
        assert a.tokens == b.tokens, f"prompt {i}: top rows drew other tokens than whole rows"
    assert n_top >= 4 * 30, "the batch did not run on top rows"
    assert model._engine.decode_stats["max_rows"] == 4


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.2, top_k=K, top_p=0.9, min_p=0.02)])
def test_generate_logprobs_equal_the_whole_rows(model, sampling):
    """generate(logprobs=64): each token's logprob and its 64 best (ids in order, values) from top
    rows equal the whole row's log_softmax (computed on the host in double) within float rounding
    of the log-sum-exp, and the tokens are the same."""
    prompt = _prompts(1, seed=9)[0]

    def run():
        return model.generate(prompt, max_tokens=24, seed=4, logprobs=K, **sampling)

    reduced, whole, n_top = _both_paths(model, run)
    assert n_top == len(reduced.tokens), "not every token came from a top row"
    assert reduced.tokens == whole.tokens
    assert np.allclose(reduced.logprobs, whole.logprobs, rtol=0, atol=2e-5)
    for i, (a, b) in enumerate(zip(reduced.top_logprobs, whole.top_logprobs)):
        assert [t for t, _ in a] == [t for t, _ in b], f"token {i}: other top ids"
        assert np.allclose([v for _, v in a], [v for _, v in b], rtol=0, atol=2e-5), f"token {i}"


@pytest.mark.parametrize("unfit", [dict(top_k=K + 1), dict(top_k=0), dict(repeat_penalty=1.2),
                                   dict(logit_bias={7: 2.0}), dict(logprobs=K + 1)])
def test_rows_stay_whole_where_the_candidates_do_not_decide(model, unfit):
    """A top-k above 64 or none, a penalty, a logit bias or more than 64 top logprobs need the whole
    row: no top row is taken (the condition top_rows_serve states)."""
    before = model._engine.decode_stats["top_rows"]
    options = dict(max_tokens=4, temperature=0.8, top_k=40, seed=1)
    options.update(unfit)
    model.generate(_prompts(1)[0], **options)
    assert model._engine.decode_stats["top_rows"] == before


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A draft that agrees with the target in part (another seed's weights would agree nowhere)."""
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    scale = {"blk.1.ffn_down.weight": 1.5}
    path = write_tiny_vocab_model(tmp_path_factory.mktemp("top_rows") / "draft.gguf", seed=0,
                                  weight_map=lambda name, x: x * scale.get(name, 1.0))
    with Model(path, n_ctx=256, n_threads=1, n_seq_max=4) as m:  # slots: drafting for a batch too
        yield m


@pytest.mark.parametrize("tree_budget", [0, 8])
def test_speculative_sampling_equals_the_whole_rows(model, draft, tree_budget):
    """Sampled speculation with a draft model, chains and trees: the prompt's row, the plain steps
    and every verify batch's rows come as top rows, and the tokens are the whole-row path's for the
    same seed (the accept rule and the tree walk read the same distributions); trees branched."""
    prompt = _prompts(1, seed=21)[0]
    engine = model._engine

    def run():
        return model.generate(prompt, max_tokens=40, seed=6, temperature=1.5, top_k=K, top_p=1.0, min_p=0.0,
                              draft_model=draft, draft_n_min=1, draft_n_max=4, tree_budget=tree_budget)

    branched = engine.rows_stats["branched_calls"]
    reduced, whole, n_top = _both_paths(model, run)
    assert reduced.tokens == whole.tokens
    assert reduced.stats.n_accepted > 0
    assert n_top > len(reduced.tokens), "the verify batches did not return top rows"
    if tree_budget:
        assert engine.rows_stats["branched_calls"] > branched


@pytest.mark.parametrize("tree_budget", [0, 8])
def test_batch_speculation_takes_top_rows(model, draft, tree_budget):
    """generate_batch, sampled with a draft model (chains and trees) and logprobs: every shared
    verify pass returns top rows (Engine::verify_rows with top_all), and each sequence's tokens,
    drafts and logprobs are those of the whole-row path (logprobs to float rounding of the
    log-sum-exp) and its tokens and drafts those of generate() alone. Seen red with the scheduler's
    top-row distributions read from the pass's first slot (top_of(r) for top_of(r0 + r): a token
    missing from its row's candidates) and with DELTASPEC_TEST_TOP_BUG=k_minus_1."""
    prompts = _prompts(4, seed=23)
    per_prompt = [dict(seed=k) for k in range(len(prompts))]
    kw = dict(max_tokens=30, temperature=1.5, top_k=K, top_p=1.0, min_p=0.0, draft_model=draft, draft_n_min=1,
              draft_n_max=4, tree_budget=tree_budget, logprobs=3)

    def run():
        return model.generate_batch(prompts, per_prompt=per_prompt, **kw)

    reduced, whole, n_top = _both_paths(model, run)
    assert model.batch_spec_stats["multi_draft_passes"] > 0
    assert sum(r.stats.n_accepted for r in reduced) > 0
    assert n_top > sum(r.stats.n_drafted for r in reduced), "the verify passes did not return top rows"
    for k, (r, w) in enumerate(zip(reduced, whole)):
        assert r.tokens == w.tokens and r.stats.accepted_lengths == w.stats.accepted_lengths, f"prompt {k}"
        assert r.logprobs == pytest.approx(w.logprobs, abs=1e-5), f"prompt {k}"
        alone = model.generate(prompts[k], **per_prompt[k], **kw)
        assert r.tokens == alone.tokens and r.stats.accepted_lengths == alone.stats.accepted_lengths, f"prompt {k}"
