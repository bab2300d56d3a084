"""Model.set_prefill_budget: a step prefills at most that many prompt tokens, so requests that arrive
together are admitted a few per step while the ones already running decode in between (what keeps
a server's streams flowing, and its first tokens coming, when many prompts arrive at once); each
request's tokens stay those of generate() alone."""

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
