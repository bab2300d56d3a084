"""Model.set_prefill_budget: a step prefills at most that many prompt tokens, so requests that arrive
together are admitted a few per step, and a long prompt is split over steps, while the ones already
running decode in every step (what keeps a server's streams flowing, and its first tokens coming,
when many or long prompts arrive); each request's tokens stay those of generate() alone."""

from __future__ import annotations

import pytest

from deltaspec import Model
from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

N_GEN = 6


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_vocab_model(tmp_path_factory.mktemp("budget") / "tiny.gguf", seed=0)


def test_budget_admits_a_few_prompts_per_step_and_keeps_the_tokens(model_path):
    """Four 10-token prompts under a budget of 20: the first step prefills two (two first tokens),
    the next one prefills the other two while the first two decode; greedy tokens equal generate()'s
    for each prompt. Seen to fail with set_prefill_budget patched to do nothing (all four were
    admitted in the first step)."""
    with Model(model_path, n_ctx=256, n_threads=1, n_seq_max=4) as m:
        prompts = [[(7 * i + 3 * j) % 256 for j in range(10)] for i in range(4)]
        want = []
        for p in prompts:
            m.reset()
            want.append(m.generate(p, max_tokens=N_GEN, temperature=0, ignore_eos=True).tokens)
        m.set_prefill_budget(20)
        ids = [m.add_request(p, max_tokens=N_GEN, temperature=0, ignore_eos=True) for p in prompts]
        steps, got = [], {}
        while m.has_unfinished_requests:
            outs = m.step()
            steps.append({o.request_id: len(o.tokens) for o in outs})
            got.update({o.request_id: o.result.tokens for o in outs if o.finished})
        # step 1: two prompts prefilled, each with its first token and then a decode step's token
        assert steps[0] == {ids[0]: 2, ids[1]: 2}
        assert steps[1] == {i: 2 if i in ids[2:] else 1 for i in ids}
        assert [got[i] for i in ids] == want
        with pytest.raises(ValueError, match="prefill budget"):
            m.set_prefill_budget(-1)


def test_a_long_prompt_is_split_while_another_request_decodes(model_path):
    """An 8-token prompt and a 40-token one under a budget of 16: step 1 prefills the short one (its
    first token, then a decode step's) and 8 tokens of the long one; steps 2 and 3 feed the long one
    16 tokens each while the short one decodes a token per step; in step 3 the long one's prompt is
    complete: its first token, then a decode step's. A third request waits until then. Greedy tokens
    equal generate()'s. Seen to fail with the budget check taken out of feed() (the long prompt was
    prefilled whole in step 1)."""
    with Model(model_path, n_ctx=256, n_threads=1, n_seq_max=3) as m:
        prompts = [[(5 * j + 1) % 256 for j in range(8)], [(3 * j + 2) % 256 for j in range(40)], [9, 8, 7]]
        want = []
        for p in prompts:
            m.reset()
            want.append(m.generate(p, max_tokens=N_GEN, temperature=0, ignore_eos=True).tokens)
        m.set_prefill_budget(16)
        short, long, third = [m.add_request(p, max_tokens=N_GEN, temperature=0, ignore_eos=True) for p in prompts]
        steps, got = [], {}
        while m.has_unfinished_requests:
            outs = m.step()
            steps.append({o.request_id: len(o.tokens) for o in outs})
            got.update({o.request_id: o.result for o in outs if o.finished})
        assert steps[:4] == [{short: 2}, {short: 1}, {short: 1, long: 2}, {short: 1, long: 1, third: 2}]
        assert [got[i].tokens for i in (short, long, third)] == want
        assert got[long].stats.cached_tokens == 0  # all 40 prompt tokens counted as prefilled


def test_a_split_prompt_stays_on_top_when_a_lower_slot_frees(model_path):
    """Three slots, budget 16: A (stops after 2 tokens) and B run in slots 0 and 1 while C's 60-token
    prompt is split in slot 2. A's end frees slot 0: B moves down into it and C (still split) down
    into slot 1, on top, so the decode batch stays the consecutive slots of B alone; B's and C's
    tokens equal generate()'s. Seen to fail with the split prompt moved into the freed slot like
    any other sequence (C was decoded before its prompt was complete)."""
    with Model(model_path, n_ctx=256, n_threads=1, n_seq_max=3) as m:
        prompts = [[1, 2, 3, 4], [40, 41, 42, 43], [(11 * j + 5) % 256 for j in range(60)]]
        lengths = [2, N_GEN, N_GEN]
        want = []
        for p, n in zip(prompts, lengths):
            m.reset()
            want.append(m.generate(p, max_tokens=n, temperature=0, ignore_eos=True).tokens)
        m.set_prefill_budget(16)
        ids = [m.add_request(p, max_tokens=n, temperature=0, ignore_eos=True) for p, n in zip(prompts, lengths)]
        steps, got = [], {}
        while m.has_unfinished_requests:
            outs = m.step()
            steps.append({o.request_id: len(o.tokens) for o in outs})
            got.update({o.request_id: o.result.tokens for o in outs if o.finished})
        assert steps[0] == {ids[0]: 2, ids[1]: 2}  # A done; C fed 8 of 60
        assert ids[2] not in steps[1] and ids[2] not in steps[3] and steps[4][ids[2]] == 2  # complete in step 5
        assert [got[i] for i in ids] == want
