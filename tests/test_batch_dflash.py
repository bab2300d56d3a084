"""DFlash drafting for several sequences at once: generate_batch / add_request with spec_type
"dflash" (chains, or DDTree trees with tree_budget). Each sequence drafts with one block pass per
round in its own slot of the drafter (its context: the target's tapped features of that sequence's
committed positions, tapped per slot by the target's batched steps: decode, prefill_rows, and
verify_rows' kept paths), and every step verifies all running sequences' drafts in one target pass.

The claim: each sequence gives exactly what generate() gives alone with the same drafter (tokens,
drafts, acceptance; greedy and seeded sampling), and greedy, plain decoding's tokens; its drafter
context follows it when the scheduler moves it to another slot and when a later request resumes
its kept history. CPU, one thread, F32 tiny-vocabulary target: the rows are bitwise those of the
one-sequence steps.

A random drafter rarely agrees with a random target, so the target is pushed towards the three
tokens this drafter proposes most (logit_bias +10; ignore_eos): drafts are then accepted in part
and rejected in part, in several sequences of the same pass. Tests need torch to build the drafter
(deltaspec.testing.tiny_dflash). Each docstring names the planted bug it was seen to fail with.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("dflash")

from deltaspec import Drafter, Model  # noqa: E402
from deltaspec.testing import tiny_dflash as TD  # noqa: E402
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path  # noqa: E402
from batch_drafting import assert_each_as_alone, drafting, random_prompts, run_request  # noqa: E402
from test_server import ServerProcess, ask_concurrently, expected, files, reference  # noqa: E402,F401 (fixtures)

N_CTX = 512
BIAS = {82: 10.0, 225: 10.0, 19: 10.0}  # the tokens the seed-3 drafter (TD.write_sharp_tiny_dflash) proposes most
SPEC = dict(spec_type="dflash", logit_bias=BIAS, ignore_eos=True, draft_n_min=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target with 1 slot (generate() alone) and with 4, each with the same drafter file."""
    path = tiny_vocab_model_path()
    with Model(path, n_ctx=N_CTX, n_threads=1) as one, Model(path, n_ctx=N_CTX, n_threads=1, n_seq_max=4) as four:
        file = TD.write_sharp_tiny_dflash(one, tmp_path_factory.mktemp("batchdflash") / "d.gguf")
        yield one, Drafter(file, target=one), four, Drafter(file, target=four)


@pytest.mark.parametrize("tree_budget", [0, 8], ids=["chains", "ddtree8"])
def test_batch_dflash_equals_alone(models, tree_budget):
    """7 prompts on 4 slots, each its own max_tokens (sequences finish at different steps, the
    scheduler moves the survivors down into the freed slots, waiting ones are admitted), greedy and
    seeded sampling: every sequence gives the tokens, drafts and acceptance of generate() alone with
    the same drafter, greedy also plain decoding's tokens; DFlash drafts of 2+ sequences went
    through the same verify passes, some accepted and some rejected, their blocks through the same
    block passes (DFlashModel::blocks). Seen to fail with every block of a pass attending to the
    first block's slot (graph_dflash.cpp), with
    DELTASPEC_TEST_ROWS_BUG=taps_slot_swap (two slots' kept paths tapped at each other's rows:
    DDTree's drafts and the sampled tokens differ) and, erroring, with the drafter's context not
    moved with its sequence in Scheduler::release_finished (a block after an anchor its context
    does not end before: "DFlash inject: rows ... do not continue the cache")."""
    one, d_one, four, d_four = models
    prompts = random_prompts(7, seed=3, max_len=30)
    per_prompt = [dict(max_tokens=n) for n in (40, 12, 55, 25, 33, 48, 20)]
    for temperature in (0.0, 0.8):
        options = dict(SPEC, tree_budget=tree_budget, temperature=temperature, seed=5)
        batch = four.generate_batch(prompts, per_prompt=per_prompt, draft_model=d_four, **options)
        spec = four.batch_spec_stats
        assert spec["multi_draft_passes"] > 0 and spec["max_drafting"] >= 2 and spec["mixed_passes"] > 0, spec
        assert d_four.block_stats["max_blocks"] >= 3, "no block pass held several sequences' blocks"
        assert sum(r.stats.n_accepted > 0 for r in batch) >= 3
        alone = [one.generate(p, draft_model=d_one, **options, **o) for p, o in zip(prompts, per_prompt)]
        assert_each_as_alone(batch, alone, f"temperature {temperature}")
        if tree_budget:
            assert all(r.stats.n_tree_nodes > 0 for r in batch)
        if temperature == 0.0:
            plain = [one.generate(p, logit_bias=BIAS, ignore_eos=True, temperature=0, **o)
                     for p, o in zip(prompts, per_prompt)]
            assert [r.tokens for r in batch] == [r.tokens for r in plain]


@pytest.mark.parametrize("tree_budget", [0, 8], ids=["chains", "ddtree8"])
def test_batch_dflash_with_a_grammar_equals_alone(models, tree_budget):
    """A grammar per request (printable text with "xyz" twice, which it forces; the target pushed
    towards the drafter's favourite token 82, "R"),
    DFlash chains or DDTree trees, 4 prompts on 4 slots: each sequence drafts what the grammar forces,
    its blocks' drafts cut or pruned by it, as generate() alone (a constrained tree's depth is not
    free: the forced tokens come first), and gives its tokens, drafts and grammar counts; greedy,
    plain constrained decoding's tokens. Seen to fail with DELTASPEC_TEST_ROWS_BUG=taps_slot_swap
    (two slots' kept paths tapped at each other's rows: their drafters read the other's features)."""
    from deltaspec import Grammar

    one, d_one, four, d_four = models
    prompts = random_prompts(4, seed=7, max_len=20)
    grammar = Grammar.from_regex(r"R[ -~]{2}xyz[ -~]{2}xyz[ -~]{0,24}")
    options = dict(spec_type="dflash", draft_n_min=1, tree_budget=tree_budget, temperature=0.0, max_tokens=40,
                   logit_bias={82: 6.0})
    per_prompt = [dict(grammar=grammar) for _ in prompts]
    batch = four.generate_batch(prompts, per_prompt=per_prompt, draft_model=d_four, **options)
    assert four.batch_spec_stats["multi_draft_passes"] > 0
    assert sum(r.stats.grammar_forced_tokens for r in batch) > 0
    assert sum(r.stats.n_accepted for r in batch) > sum(r.stats.grammar_forced_tokens for r in batch), \
        "no drafted token but the forced ones was accepted"
    for k, (prompt, r) in enumerate(zip(prompts, batch)):
        alone = one.generate(prompt, draft_model=d_one, grammar=grammar, **options)
        assert r.tokens == alone.tokens, f"prompt {k}: other tokens than alone"
        assert drafting(r) == drafting(alone), f"prompt {k}: other drafts than alone"
        assert (r.stats.grammar_cut_tokens, r.stats.grammar_forced_tokens) == \
            (alone.stats.grammar_cut_tokens, alone.stats.grammar_forced_tokens), f"prompt {k}"
        plain = one.generate(prompt, grammar=grammar, temperature=0.0, max_tokens=40, logit_bias={82: 6.0})
        assert r.tokens == plain.tokens, f"prompt {k}: other tokens than plain decoding"


def test_dflash_requests_resume_their_kept_context(models):
    """add_request with DFlash trees: a request that extends a finished DFlash request's prompt and
    output resumes its kept slot (cached tokens) with the drafter context kept with it, and drafts
    what generate() alone drafts on the whole prompt; a request extending a finished request that
    did not draft with DFlash (its slot's features were not kept) reads its whole prompt again.
    Answers are generate()'s. Seen to fail with the drafter's context not moved with a kept history
    (SlotHistories' on_move: other drafts than alone) and, erroring, with the whole-prompt rule off
    (admit's dflash_context_covers taken as true)."""
    one, d_one, four, d_four = models
    first, other = random_prompts(2, seed=11, max_len=30)
    options = dict(SPEC, tree_budget=8, temperature=0, max_tokens=30)
    a = run_request(four, first, draft_model=d_four, **options)
    b = run_request(four, other, logit_bias=BIAS, ignore_eos=True, temperature=0, max_tokens=30)  # no drafter
    a2 = run_request(four, first + a.tokens + [7, 8], draft_model=d_four, **options)
    b2 = run_request(four, other + b.tokens + [9], draft_model=d_four, **options)
    assert a2.stats.cached_tokens == len(first) + len(a.tokens) - 1, "the DFlash history was not resumed"
    assert b2.stats.cached_tokens == 0, "resumed a slot whose drafter context was never kept"
    for got, prompt in ((a, first), (a2, first + a.tokens + [7, 8]), (b2, other + b.tokens + [9])):
        solo = one.generate(prompt, draft_model=d_one, **options)
        assert got.tokens == solo.tokens
        assert got.stats.n_drafted > 0 and drafting(got) == drafting(solo)


def test_server_batches_dflash_requests(files, reference, tmp_path):
    """deltaspec serve --spec-type draft-dflash -md DRAFTER --spec-tree-budget 8 at --parallel 2: the
    batch backend serves 4 concurrent greedy requests (2 wait for a slot), each drafting DDTree trees
    in its drafter slot; every answer equals generate()'s and /metrics counts drafted tokens. Seen to
    fail with the server's planted spec_ignored (the drafter dropped: nothing drafted) and, before the
    batch scheduler drafted with DFlash, at start-up (--spec-type draft-dflash was served one
    request at a time only)."""
    drafter = TD.write_sharp_tiny_dflash(reference, tmp_path / "d.gguf")
    s = ServerProcess(files[0], "-np", "2", "-c", "512", "--spec-type", "draft-dflash", "-md", str(drafter),
                      "--spec-tree-budget", "8")
    try:
        client = s.client()
        prompts = [f"{w} {w} {w}" for w in ("abc", "xyz", "the", "one two")]
        answers = ask_concurrently(client, prompts, [24 + 4 * k for k in range(len(prompts))])
        for k, (text, finish, _) in enumerate(answers):
            assert text == expected(reference, prompts[k], 24 + 4 * k), f"request {k}"
            assert finish == "length"
        m = s.metrics()
        assert m["deltaspec_speculative"] == 1 and m["deltaspec_draft_tokens_total"] > 0, m
    finally:
        assert s.stop() == 0
