"""What the tests of drafting for several sequences at once (test_batch_dflash.py,
test_batch_mtp.py) share: their prompts, the drafting record compared with generate() alone, and a
request run to its end through add_request / step."""

from __future__ import annotations

import numpy as np


def random_prompts(n: int, seed: int, max_len: int) -> list[list[int]]:
    """n prompts of 2 .. max_len - 1 random ids below 256."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(2, max_len))).tolist() for _ in range(n)]


def drafting(r):
    """What a result says its speculation did: tokens drafted, accepted, per round, tree nodes."""
    return r.stats.n_drafted, r.stats.n_accepted, r.stats.accepted_lengths, r.stats.n_tree_nodes


def assert_each_as_alone(batch, alone, what: str) -> None:
    """Each result of the batch has the tokens and the drafting of its run alone."""
    for k, (b, a) in enumerate(zip(batch, alone)):
        assert b.tokens == a.tokens, f"prompt {k}, {what}: other tokens than alone"
        assert drafting(b) == drafting(a), f"prompt {k}, {what}: other drafts than alone"


def run_request(model, prompt, **options):
    """add_request(prompt, **options), stepped until every request of the model is done; its result."""
    rid = model.add_request(prompt, **options)
    done = {}
    while model.has_unfinished_requests:
        for out in model.step():
            if out.finished:
                done[out.request_id] = out.result
    return done[rid]
