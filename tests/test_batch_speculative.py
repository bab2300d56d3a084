"""Speculation for several sequences at once: generate_batch / add_request with spec_type
"ngram-simple" (chains and trees) or a draft model (chains and trees). Every scheduler step drafts per sequence (prompt lookup), verifies all running
sequences' rows in ONE target pass (Engine::verify_rows: each slot's chain [pending token, drafts...]
as rows of its slot) and commits each slot's accepted prefix (Engine::keep_paths).

The claim: each sequence of a speculative batch gives exactly the tokens it gives alone, with
generate() and the same speculation (greedy and seeded sampling: the same drafts, accept rule and
random draws) and, greedy, with plain decoding. On the CPU with the tiny-vocabulary model (F32
weights) the rows ops equal the chain recurrence bitwise, so the tokens must be identical.

To make prompt lookup draft and be accepted often on a random model, the sequences are pushed
towards three tokens (logit_bias +10 on 10, 11, 12; ignore_eos): they then wander between them, so
drafts are accepted in part and rejected in part, in many sequences in the same pass (asserted with
Model.batch_spec_stats and the engine's rows_stats).

Planted bugs (DELTASPEC_TEST_ROWS_BUG, csrc/rows.h) each test was seen to fail with (its docstring
says which): "wrong_parent" (the verify graph runs the second slot's last row from its grandparent),
"swap_keep" (the scheduler commits to each slot the accepted length of the next drafting slot),
"no_compaction" (a kept tree path's KV rows stay where the verify wrote them) and "draft_slot_swap"
(the batched draft model drafts each sequence in another sequence's draft slot).
"""

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

N_CTX = 256
BIAS = {10: 10.0, 11: 10.0, 12: 10.0}
SPEC = dict(spec_type="ngram-simple", logit_bias=BIAS, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The same file with 1 slot (the reference: generate() alone) and with 4 slots."""
    path = write_tiny_vocab_model(tmp_path_factory.mktemp("batchspec") / "tiny.gguf", seed=0)
    with Model(path, n_ctx=N_CTX, n_threads=1) as one, Model(path, n_ctx=N_CTX, n_threads=1, n_seq_max=4) as four:
        yield one, four


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(2, 40))).tolist() for _ in range(n)]


def _assert_same(batch, solo, what):
    for k, (b, s) in enumerate(zip(batch, solo)):
        assert b.tokens == s.tokens, f"prompt {k}: the batch gave other tokens than {what}"
        assert b.finish_reason == s.finish_reason, f"prompt {k}"


def _assert_drafting_ran(model, batch):
    """Drafts of several sequences were verified in the same passes, some accepted, some rejected."""
    spec = model.batch_spec_stats
    assert spec["multi_draft_passes"] > 0 and spec["max_drafting"] >= 2, spec
    assert spec["mixed_passes"] > 0, f"no pass both accepted and rejected drafts of 2+ sequences: {spec}"
    rows = model._engine.rows_stats
    assert rows["multi_slot_calls"] > 0 and rows["max_slots"] >= 2, rows
    both = [r for r in batch if r.stats.n_accepted > 0 and r.stats.n_drafted > r.stats.n_accepted]
    assert len(both) >= 2, [(r.stats.n_drafted, r.stats.n_accepted) for r in batch]


def test_speculative_batch_greedy_equals_alone(models):
    """7 prompts on 4 slots (3 wait, admitted as others finish while the rest speculate), each its own
    max_tokens; one runs until the context is full (drafts cut by the room left), one has a repeat
    penalty (greedy on the host's logits, so the pass returns logits, not argmax ids), one does not
    speculate (its pending token rides in the drafting sequences' pass). Each gives the tokens of
    generate() alone with the same speculation and of plain greedy generate(). Seen to fail with
    DELTASPEC_TEST_ROWS_BUG=wrong_parent and =swap_keep."""
    one, four = models
    prompts = _prompts(7)
    per_prompt = [dict(max_tokens=n) for n in (60, 9, 80, 1, 45, 70, 30)]
    prompts[2] = _prompts(1, seed=9)[0] * 6
    per_prompt[2] = dict(max_tokens=None)                      # until the context is full
    per_prompt[4] = dict(max_tokens=45, repeat_penalty=1.1)    # greedy with a penalty
    per_prompt[6] = dict(max_tokens=30, spec_type=None)        # no speculation
    batch = four.generate_batch(prompts, per_prompt=per_prompt, temperature=0, **SPEC)
    _assert_drafting_ran(four, batch)
    alone = [one.generate(p, temperature=0, **{**SPEC, **o}) for p, o in zip(prompts, per_prompt)]
    _assert_same(batch, alone, "generate() alone with speculation")
    plain = [one.generate(p, temperature=0, logit_bias=BIAS, ignore_eos=True, **{**o, "spec_type": None})
             for p, o in zip(prompts, per_prompt)]
    _assert_same(batch, plain, "plain greedy generate()")
    assert batch[2].finish_reason == "length" and len(batch[2].tokens) == N_CTX - len(prompts[2]) + 1
    assert batch[6].stats.n_drafted == 0 and batch[0].stats.n_drafted > 0
    for b, a in zip(batch, alone):
        assert (b.stats.n_drafted, b.stats.n_accepted, b.stats.accepted_lengths) == \
               (a.stats.n_drafted, a.stats.n_accepted, a.stats.accepted_lengths), "another drafting schedule"


def test_speculative_batch_sampling_equals_alone(models):
    """Seeded sampling, each prompt its own seed (one greedy among them, one with draft_n_min 2): every
    sequence draws the tokens of generate() alone with the same seed and speculation (same drafts,
    same accept / reject draws, same residual draws). Seen to fail with DELTASPEC_TEST_ROWS_BUG=wrong_parent
    and =swap_keep."""
    one, four = models
    prompts = _prompts(6, seed=5)
    per_prompt = [dict(seed=100 + k, max_tokens=50 + 7 * k) for k in range(6)]
    per_prompt[1]["temperature"] = 0
    per_prompt[3]["draft_n_min"] = 2
    batch = four.generate_batch(prompts, per_prompt=per_prompt, temperature=0.8, **SPEC)
    _assert_drafting_ran(four, batch)
    alone = [one.generate(p, **{**SPEC, "temperature": 0.8, **o}) for p, o in zip(prompts, per_prompt)]
    _assert_same(batch, alone, "generate() alone with the same seed and speculation")


def test_speculative_batch_trees_equal_alone(models):
    """N-gram draft trees (tree_budget 8: the history went on differently after the same words, so
    trees branch) of several sequences verified in one pass, each slot's rows a tree, each walked as
    a sequence alone walks it (greedy: the argmax; sampled: rejection) and its path kept with its
    KV rows compacted: every sequence gives generate()'s tokens alone with the same trees, and greedy
    plain decoding's. Seen to fail with DELTASPEC_TEST_ROWS_BUG=wrong_parent and =no_compaction
    (the kept path's KV rows left where the verify wrote them)."""
    one, four = models
    prompts = _prompts(5, seed=13)
    for temperature in (0.0, 0.8):
        options = dict(SPEC, tree_budget=8, temperature=temperature, seed=21, max_tokens=50)
        rows_before = dict(four._engine.rows_stats)
        batch = four.generate_batch(prompts, **options)
        rows = {k: v - rows_before[k] for k, v in four._engine.rows_stats.items() if k not in ("max_slots",)}
        assert rows["branched_calls"] > 0 and rows["kv_rows_moved"] > 0, rows
        assert four.batch_spec_stats["mixed_passes"] > 0
        assert sum(r.stats.n_tree_nodes > 0 for r in batch) >= 2
        alone = [one.generate(p, **options) for p in prompts]
        _assert_same(batch, alone, f"generate() alone with the same trees (temperature {temperature})")
        for b, a in zip(batch, alone):
            assert (b.stats.n_tree_nodes, b.stats.n_accepted) == (a.stats.n_tree_nodes, a.stats.n_accepted)
        if temperature == 0.0:
            plain = [one.generate(p, **{**options, "spec_type": None, "tree_budget": 0}) for p in prompts]
            _assert_same(batch, plain, "plain greedy generate()")


def test_speculative_batch_draft_model_equals_alone(models, tmp_path):
    """A draft model (another random model: drafts partly accepted; draft_n_min 1 so drafting never
    pauses) drafting for every sequence in its own slots, its chains grown in passes over all drafting
    sequences (csrc/batch_draft.cpp): greedy and seeded sampling give the tokens, drafts and acceptance
    of generate() alone with the same draft model (the same catch-up, draws and cost), and greedy
    plain decoding's tokens; requests join as others finish (7 on 4 slots). Seen to fail with
    DELTASPEC_TEST_ROWS_BUG=draft_slot_swap (each sequence drafts in another's draft slot) and
    =swap_keep (=wrong_parent left it green: no second slot verified 3+ rows on the target here)."""
    one, four = models
    path = write_tiny_vocab_model(tmp_path / "draft.gguf", seed=1)
    with Model(path, n_ctx=N_CTX, n_threads=1) as d_one, Model(path, n_ctx=N_CTX, n_threads=1, n_seq_max=4) as d_four:
        prompts = _prompts(7, seed=17)
        for temperature in (0.0, 0.8):
            options = dict(logit_bias=BIAS, ignore_eos=True, temperature=temperature, seed=5, draft_n_min=1)
            per_prompt = [dict(max_tokens=30 + 6 * k) for k in range(7)]
            batch = four.generate_batch(prompts, per_prompt=per_prompt, draft_model=d_four, **options)
            _assert_drafting_ran(four, batch)
            assert d_four._engine.rows_stats["multi_slot_calls"] > 0  # the draft's passes held several slots
            alone = [one.generate(p, draft_model=d_one, **options, **o) for p, o in zip(prompts, per_prompt)]
            _assert_same(batch, alone, f"generate() alone with the draft model (temperature {temperature})")
            for b, a in zip(batch, alone):
                assert (b.stats.n_drafted, b.stats.n_accepted, b.stats.accepted_lengths) == \
                       (a.stats.n_drafted, a.stats.n_accepted, a.stats.accepted_lengths), "other drafts than alone"
            if temperature == 0.0:
                plain = [one.generate(p, logit_bias=BIAS, ignore_eos=True, temperature=0, **o)
                         for p, o in zip(prompts, per_prompt)]
                _assert_same(batch, plain, "plain greedy generate()")


def test_speculative_batch_draft_model_trees_equal_alone(models, tmp_path):
    """Draft-model trees (tree_budget 6, best-first from the draft's distributions, each node's path
    evaluated from its draft slot's committed state) for 5 sequences on 4 slots, greedy and seeded
    sampling: each gives the tokens, trees and acceptance of generate() alone with the same draft
    model, greedy also plain decoding's tokens. Seen to fail with DELTASPEC_TEST_ROWS_BUG=
    draft_slot_swap (each sequence's catch-up and tree in another's draft slot) and with the
    greedy trees ranked by the sampler instead of the ranking distribution (one-hot: no branches)."""
    one, four = models
    path = write_tiny_vocab_model(tmp_path / "draft.gguf", seed=1)
    with Model(path, n_ctx=N_CTX, n_threads=1) as d_one, Model(path, n_ctx=N_CTX, n_threads=1, n_seq_max=4) as d_four:
        prompts = _prompts(5, seed=23)
        for temperature in (0.0, 0.8):
            options = dict(logit_bias=BIAS, ignore_eos=True, temperature=temperature, seed=9, draft_n_min=1,
                           draft_n_max=4, tree_budget=6)
            per_prompt = [dict(max_tokens=25 + 5 * k) for k in range(5)]
            batch = four.generate_batch(prompts, per_prompt=per_prompt, draft_model=d_four, **options)
            _assert_drafting_ran(four, batch)
            assert four._engine.rows_stats["branched_calls"] > 0
            alone = [one.generate(p, draft_model=d_one, **options, **o) for p, o in zip(prompts, per_prompt)]
            _assert_same(batch, alone, f"generate() alone with draft-model trees (temperature {temperature})")
            for b, a in zip(batch, alone):
                assert b.stats.n_tree_nodes > 0
                assert (b.stats.n_drafted, b.stats.n_accepted, b.stats.accepted_lengths, b.stats.n_tree_nodes) == \
                       (a.stats.n_drafted, a.stats.n_accepted, a.stats.accepted_lengths, a.stats.n_tree_nodes)
            if temperature == 0.0:
                plain = [one.generate(p, logit_bias=BIAS, ignore_eos=True, temperature=0, **o)
                         for p, o in zip(prompts, per_prompt)]
                _assert_same(batch, plain, "plain greedy generate()")


def test_speculative_requests_join_and_leave(models):
    """add_request / step / cancel_request with speculation: requests join while others speculate,
    one is cancelled mid-run (its tokens are a prefix of its run alone), the others give the tokens of
    generate() alone. Seen to fail with DELTASPEC_TEST_ROWS_BUG=wrong_parent and =swap_keep."""
    one, four = models
    prompts = _prompts(6, seed=11)
    options = [dict(temperature=0, max_tokens=40), dict(temperature=0.8, seed=7, max_tokens=55),
               dict(temperature=0, max_tokens=25), dict(temperature=0.8, seed=8, max_tokens=35),
               dict(temperature=0, max_tokens=50), dict(temperature=0.8, seed=9, max_tokens=30)]
    ids = [four.add_request(prompts[k], **SPEC, **options[k]) for k in range(3)]
    results, tokens, n_steps = {}, {}, 0
    while four.has_unfinished_requests:
        for out in four.step():
            tokens.setdefault(out.request_id, []).extend(out.tokens)
            if out.finished:
                results[out.request_id] = out.result
        n_steps += 1
        if n_steps == 4:  # two join while three speculate (one waits for a slot)
            ids += [four.add_request(prompts[k], **SPEC, **options[k]) for k in (3, 4)]
        if n_steps == 6:
            four.cancel_request(ids[1])
        if n_steps == 8:
            ids.append(four.add_request(prompts[5], **SPEC, **options[5]))
    assert four.batch_spec_stats["multi_draft_passes"] > 0
    for k, request_id in enumerate(ids):
        res = results[request_id]
        assert res.tokens == tokens[request_id]
        solo = one.generate(prompts[k], **SPEC, **options[k])
        if k == 1:
            assert res.finish_reason == "cancelled" and res.tokens == solo.tokens[:len(res.tokens)]
            assert len(res.tokens) < len(solo.tokens)
        else:
            assert res.tokens == solo.tokens, f"request {k}"
            assert res.finish_reason == solo.finish_reason
