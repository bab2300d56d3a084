"""Drafting with the model's own MTP head for several sequences at once: generate_batch /
add_request with spec_type "mtp" (chains, or trees with tree_budget). Each sequence has a head and
KV cache of its own, which reads the target's final hidden states of that sequence's committed
positions, tapped per slot by the target's batched steps (decode, prefill_rows, verify_rows' kept
paths); every step verifies all running sequences' drafts in one target pass.

The claim: each sequence gives exactly what generate() gives alone with the MTP head (tokens,
drafts, acceptance; greedy and seeded sampling), and greedy, plain decoding's tokens. CPU, one
thread, F32 tiny-vocabulary target with an MTP layer whose drafts lean on the hidden state they
are paired with (mtp_hidden_scale 0.5, as tests/test_mtp.py's replay test), so a sequence that
reads another's hidden states drafts otherwise. Each docstring names the planted bug it was seen
to fail with.
"""

from __future__ import annotations

import pytest

from deltaspec import Model
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path
from batch_drafting import assert_each_as_alone, drafting, random_prompts, run_request
from test_server import ServerProcess, ask_concurrently

N_CTX = 256


def _path():
    return tiny_vocab_model_path(branch_scale=0.0, mtp=True, mtp_hidden_scale=0.5, mtp_branch_scale=1.0)


@pytest.fixture(scope="module")
def models():
    """The same MTP model with 1 slot (generate() alone) and with 4."""
    path = _path()
    with Model(path, n_ctx=N_CTX, n_threads=1) as one, Model(path, n_ctx=N_CTX, n_threads=1, n_seq_max=4) as four:
        yield one, four


@pytest.mark.parametrize("tree_budget", [0, 6], ids=["chains", "trees6"])
def test_batch_mtp_equals_alone(models, tree_budget):
    """7 prompts on 4 slots, each its own max_tokens (sequences finish at different steps and the
    survivors move down into the freed slots), greedy and seeded sampling: every sequence gives the
    tokens, drafts and acceptance of generate() alone with the MTP head, greedy also plain
    decoding's tokens; MTP drafts of 2+ sequences went through the same passes, some accepted and
    some rejected, and (chains) their head steps through the same head graphs. Seen to fail with
    every head of a graph attending to the first head's cache (MtpHead::eval_groups), with DELTASPEC_TEST_ROWS_BUG=taps_slot_swap (two slots' kept paths
    tapped at each other's rows: other drafts) and, erroring, with the drafter's slot not updated
    when the scheduler moves its sequence (release_finished: "the target's hidden state at
    position ... was not tapped")."""
    one, four = models
    prompts = random_prompts(7, seed=5, max_len=20)
    per_prompt = [dict(max_tokens=n) for n in (40, 12, 55, 25, 33, 48, 20)]
    for temperature in (0.0, 0.8):
        options = dict(spec_type="mtp", draft_n_max=3, draft_n_min=1, tree_budget=tree_budget,
                       temperature=temperature, seed=7)
        batch = four.generate_batch(prompts, per_prompt=per_prompt, **options)
        spec = four.batch_spec_stats
        assert spec["multi_draft_passes"] > 0 and spec["max_drafting"] >= 2 and spec["mixed_passes"] > 0, spec
        if not tree_budget:  # chains: the heads' steps of several sequences in one graph (MtpHead::eval_groups)
            assert four._engine.mtp_group_stats["max_heads"] >= 3
        assert sum(r.stats.n_accepted > 0 for r in batch) >= 3
        alone = [one.generate(p, **options, **o) for p, o in zip(prompts, per_prompt)]
        assert_each_as_alone(batch, alone, f"temperature {temperature}")
        if tree_budget:
            assert all(r.stats.n_tree_nodes > 0 for r in batch)
        if temperature == 0.0:
            plain = [one.generate(p, temperature=0, **o) for p, o in zip(prompts, per_prompt)]
            assert [r.tokens for r in batch] == [r.tokens for r in plain]


def test_mtp_requests_read_their_whole_prompt(models):
    """add_request with the MTP head: a request that extends a finished request's prompt and output
    does not resume its kept slot (the head is the request's own and starts empty: cached_tokens 0)
    and drafts what generate() alone drafts on the whole prompt; a model without an MTP layer
    refuses spec_type "mtp" with a ValueError naming the layer, and the refused request is not left
    queued. Seen to fail, erroring, with MTP sequences allowed to resume (admit)."""
    one, four = models
    first = random_prompts(1, seed=9, max_len=20)[0]
    options = dict(spec_type="mtp", draft_n_max=3, draft_n_min=1, temperature=0, max_tokens=30)
    a = run_request(four, first, **options)
    longer = first + a.tokens + [7]
    a2 = run_request(four, longer, **options)
    assert a2.stats.cached_tokens == 0
    solo = one.generate(longer, **options)
    assert a2.tokens == solo.tokens and a2.stats.n_drafted > 0 and drafting(a2) == drafting(solo)

    with Model(tiny_vocab_model_path(), n_ctx=N_CTX, n_threads=1, n_seq_max=2) as plain:
        with pytest.raises(ValueError, match="MTP layer"):
            plain.add_request(first, **options)
        assert not plain.has_unfinished_requests


def test_server_batches_mtp_requests(models):
    """deltaspec serve --spec-type draft-mtp at --parallel 2: 4 concurrent greedy requests (2 wait
    for a slot), each drafting with its own head; every answer equals generate()'s and /metrics
    counts drafted and accepted tokens. Seen to fail with the server's planted spec_ignored (the
    drafter dropped: nothing drafted)."""
    one, _ = models
    s = ServerProcess(_path(), "-a", "tiny", "-np", "2", "-c", str(N_CTX), "--spec-type", "draft-mtp",
                      "--spec-draft-n-max", "3")
    try:
        client = s.client()
        prompts = ["abc abc", "xyz", "the one", "two two two"]
        answers = ask_concurrently(client, prompts, [20 + 4 * k for k in range(len(prompts))])
        for k, (text, finish, _) in enumerate(answers):
            assert text == one.generate(prompts[k], temperature=0, max_tokens=20 + 4 * k).text, f"request {k}"
        m = s.metrics()
        assert m["deltaspec_speculative"] == 1 and m["deltaspec_draft_tokens_total"] > 0, m
        assert m["deltaspec_acceptance_rate"] > 0, m
    finally:
        assert s.stop() == 0
