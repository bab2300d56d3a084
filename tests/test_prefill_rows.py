"""Prompt chunks of several sequences in one pass (Engine::prefill_rows, the scheduler's feed_together):
requests admitted in the same step are prefilled together, each slot a chain of rows starting from its
own committed state, instead of one prompt after another.

The claim: each sequence still gives exactly the tokens it gives alone with generate() (greedy and
seeded sampling), its recurrent state (conv window and DeltaNet state, written back by its last row)
and KV rows being those a prefill of its own would leave; and the passes really held prompt rows of
several sequences (the engine's prefill_stats).

Planted bugs (DELTASPEC_TEST_PREFILL_BUG, csrc/rows.h): "shared_state" (every slot after the first of a
pass starts from the first slot's committed recurrent state) made every test fail; "position" (every
slot after the first of a pass given positions from the first slot's start) made the budget test and
the logits test fail (the generate_batch test's passes hold slots of equal starts, where it changes
nothing). Also seen to fail: both scheduler tests' assertions on prefill_stats with the scheduler's
passes switched off (Model._engine.set_prefill_rows(False) in the fixture: the tokens stay right, no
pass held two slots).
"""

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

N_CTX = 256


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The same file with 1 slot (the reference: generate() alone) and with 4 slots."""
    path = write_tiny_vocab_model(tmp_path_factory.mktemp("prefill_rows") / "tiny.gguf", seed=0)
    with Model(path, n_ctx=N_CTX, n_threads=1) as one, Model(path, n_ctx=N_CTX, n_threads=1, n_seq_max=4) as four:
        yield one, four


def _prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n).tolist() for n in lengths]


def _solo(one, prompts, options):
    return [one.generate(p, **o) for p, o in zip(prompts, options)]


def test_batch_prefilled_together_gives_each_prompts_tokens(models):
    """Six prompts of 3..70 tokens on 4 slots, greedy and seeded sampling (each its own seed, one with
    a repeat penalty) in one batch: the first four are admitted together and prefilled in passes of
    several slots (rounds of the shortest remaining chunk, then the longest alone), the last two when
    slots free up; every sequence gives generate()'s tokens and text."""
    one, four = models
    prompts = _prompts([23, 70, 9, 41, 3, 30], seed=5)
    common = dict(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, min_p=0.0)
    per_prompt = [dict(seed=10 + k) for k in range(6)]
    per_prompt[0] = dict(temperature=0)
    per_prompt[2] = dict(seed=4, repeat_penalty=1.3)
    before = dict(four._engine.prefill_stats)
    batch = four.generate_batch(prompts, per_prompt=per_prompt, **common)
    after = four._engine.prefill_stats
    solo = _solo(one, prompts, [{**common, **o} for o in per_prompt])
    for k, (b, s) in enumerate(zip(batch, solo)):
        assert b.tokens == s.tokens, f"prompt {k}: prefilled with others, it gave other tokens than alone"
        assert b.text == s.text
    assert after["multi_slot_passes"] > before["multi_slot_passes"], "no pass held prompt rows of 2+ sequences"
    assert after["max_slots"] >= 4, "the four prompts admitted together were not prefilled in one pass"

    greedy = four.generate_batch(prompts, max_tokens=10, temperature=0)
    assert [g.tokens for g in greedy] == [s.tokens for s in _solo(one, prompts, [dict(max_tokens=10, temperature=0)] * 6)]


def test_split_prompt_and_new_requests_share_passes_under_a_budget(models):
    """add_request / step with a prefill budget of 24: step 1 prefills A (10 tokens) and 14 of B's 30
    together; step 2 B's other 16 with C (7) and one token of D in one pass (B then further than C
    and D: different start positions and states in one pass); the first tokens come in the steps the
    budget gives them (the schedule of one prompt at a time), and each request's seeded tokens are
    generate()'s."""
    one, four = models
    prompts = _prompts([10, 30, 7, 12, 5], seed=9)
    options = [dict(max_tokens=8, temperature=0.8, top_k=30, seed=40 + k) for k in range(5)]
    options[1] = dict(max_tokens=8, temperature=0)
    want = _solo(one, prompts, options)
    before = dict(four._engine.prefill_stats)
    four.set_prefill_budget(24)
    try:
        ids = [four.add_request(p, **o) for p, o in zip(prompts, options)]
        steps, got = [], {}
        while four.has_unfinished_requests:
            outs = four.step()
            steps.append({o.request_id: len(o.tokens) for o in outs})
            got.update({o.request_id: o.result.tokens for o in outs if o.finished})
    finally:
        four.set_prefill_budget(0)
    a, b, c, d, e = ids
    assert steps[0] == {a: 2}  # B split after 14 tokens
    assert steps[1][b] == 2 and steps[1][c] == 2 and d not in steps[1]  # D split after 1 token
    assert [got[i] for i in ids] == [w.tokens for w in want]
    after = four._engine.prefill_stats
    assert after["multi_slot_passes"] - before["multi_slot_passes"] >= 2, "passes over several slots"
    assert after["max_slots"] >= 3


def test_prefilled_states_give_the_single_sequence_logits(models):
    """Teacher-forced, through Engine::prefill_rows directly: 4 slots holding prompts of different
    lengths (0, 5, 17, 30 tokens) take a 9-token chunk each in one pass, then 5 batched decode steps;
    the chunk's last-row logits and every decode row's logits equal, bitwise, those of the same tokens
    evaluated alone (so each slot's conv window, DeltaNet state and KV rows came out of the pass as a
    prefill of its own leaves them)."""
    one, four = models
    engine = four._engine
    heads = _prompts([0, 5, 17, 30], seed=13)
    chunks = _prompts([9, 9, 9, 9], seed=14)
    steps = np.random.default_rng(15).integers(0, 256, size=(5, 4))
    for slot, h in enumerate(heads):
        engine.reset_slot(slot)
        if h:
            engine.eval_in_slot(slot, h, "none")
    before = dict(engine.prefill_stats)
    last = engine.prefill_slots(chunks)
    decoded = np.stack([engine.decode_slots(row) for row in steps])  # (5, 4, n_vocab)
    assert engine.prefill_stats["multi_slot_passes"] == before["multi_slot_passes"] + 1
    for slot, (h, c) in enumerate(zip(heads, chunks)):
        alone = one.logits(h + c + steps[:, slot].tolist())
        n = len(h) + len(c)
        assert np.array_equal(last[slot], alone[n - 1]), f"slot {slot}: the chunk's last row"
        assert np.array_equal(decoded[:, slot], alone[n:]), f"slot {slot}: the decode steps after the pass"
        assert engine.slot_n_past(slot) == n + len(steps)
    with pytest.raises(ValueError, match="same number of rows"):
        engine.prefill_slots([[1, 2], [3]])
