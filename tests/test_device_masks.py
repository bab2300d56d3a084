"""Grammar masks applied on the device. In plain decoding, a row that a grammar masks and whose
request asks for no logprobs takes its argmax or top candidates from the row masked on the device
(Engine's `allowed`: ggml/deltaspec_top.h's masked top node, a forbidden token at -inf) instead of
crossing to the host whole to be masked there (TokenConstraint::mask_row). The claim: the same
tokens as the host path (Runner.device_masks_enabled off) for the same seeds: greedy and seeded
top-k sampling, rows allowing fewer tokens than the top k holds, one sequence and a batch,
prompt ends (prefill) and decode steps; and that the device path ran (decode_stats' masked_rows,
the rows whose mask the device applied) while the host path never took it.

Speculation: verify rows go the same way (each row's mask the grammar's state after the drafts
before it: TokenConstraint::fill_verify_allowed for a chain, fill_tree_allowed for a draft tree),
in generate() and in the shared verify pass of generate_batch.

Planted bug (DELTASPEC_TEST_GRAMMAR_BUG=device_unmasked: the device gets a mask allowing every
token, as if the mask never reached it): test_planted_device_bug_is_caught runs it and sees
forbidden tokens committed (GrammarError) or other tokens; the equality tests below were seen red
with it too (GrammarError in each). DELTASPEC_TEST_GRAMMAR_BUG=verify_unmasked (a chain's verify
rows left unmasked, on either path) was seen to fail both speculative tests, "tree_row_unmasked"
(one row of a draft tree's verify unmasked) their tree runs. A top node ignoring its mask on the CPU (src[1] dropped in
ggml/cpu/deltaspec_top_cpu.cpp) was seen to fail every test here but the logprobs one (which
keeps whole rows) and the planted bug's own (which plants its bug anyway).
"""

import re

import pytest

from deltaspec import Grammar, Model
from deltaspec.errors import GrammarError
from deltaspec.testing.json_schemas import BOUNDED_SCHEMAS
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path
from engine_switch import on_then_off

BUG = "DELTASPEC_TEST_GRAMMAR_BUG"
K = 64  # Engine::top_k(): the top candidates a row holds
TOP_K_SAMPLING = dict(temperature=1.5, top_k=K, top_p=1.0, min_p=0.0)  # every one of the 64 can be drawn
DIGITS = r"[0-9]{24}"  # ten tokens allowed at each row: fewer than the top k, the rest -inf


@pytest.fixture(scope="module")
def model():
    with Model(tiny_vocab_model_path(), n_ctx=512, n_threads=1, n_seq_max=4, progress=False) as m:
        yield m


def _both_paths(model, run):
    """run() with device masks, then with host masks; and how many rows the device masked."""
    return on_then_off(model, "device_masks_enabled", "masked_rows", run)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(TOP_K_SAMPLING, seed=3)], ids=["greedy", "top-k"])
@pytest.mark.parametrize("grammar", ["json", "digits"])
def test_one_sequence_equals_host_masks(model, sampling, grammar):
    """generate() under a JSON schema and under a regex allowing ten tokens a row: the device-masked
    rows give the host-masked rows' tokens, every row after the prompt's end masked on the device
    (the prompt's last row included)."""
    g = Grammar.from_json_schema(BOUNDED_SCHEMAS["record"]) if grammar == "json" else Grammar.from_regex(DIGITS)

    def run():
        return model.generate("the cat sat", max_tokens=300, grammar=g, **sampling)

    device, host, n_device = _both_paths(model, run)
    assert device.tokens == host.tokens, (device.text, host.text)
    assert device.finish_reason == host.finish_reason == "stop"
    if grammar == "digits":
        assert re.fullmatch(DIGITS, device.text)
    # every row that chose a token was masked, on the device (the last one, an end token, too)
    assert n_device == device.stats.grammar_masked_rows == len(device.tokens)
    assert host.stats.grammar_masked_rows == len(host.tokens)


def test_batch_equals_host_masks(model):
    """generate_batch over 6 prompts on 4 slots: grammars of both kinds, greedy and seeded top-k, and
    one request free of any grammar. Each result equals the host path's, batches of 4 rows ran, and
    every row the grammars masked was masked on the device. Then the same batch with one more
    grammar request asking for logprobs (its rows cross whole while it runs, the others' masked on
    the host with them): still the host path's tokens."""
    grammars = [Grammar.from_json_schema(BOUNDED_SCHEMAS[name]) for name in list(BOUNDED_SCHEMAS)[:2]]
    digits = Grammar.from_regex(DIGITS)
    prompts = ["Hello", "the cat sat", "{", "a", "0123", "xyz"]
    per_prompt = [dict(grammar=grammars[0], temperature=0.0), dict(grammar=digits, seed=1, **TOP_K_SAMPLING),
                  dict(seed=2, **TOP_K_SAMPLING), dict(grammar=grammars[1], seed=3, **TOP_K_SAMPLING),
                  dict(grammar=digits, temperature=0.0), dict(grammar=grammars[0], seed=4, **TOP_K_SAMPLING)]

    def run():
        return model.generate_batch(prompts, per_prompt=per_prompt, max_tokens=300)

    device, host, n_device = _both_paths(model, run)
    for i, (a, b) in enumerate(zip(device, host)):
        assert a.tokens == b.tokens, (i, a.text, b.text)
        assert a.finish_reason == "stop" or "grammar" not in per_prompt[i], (i, a.text)
    assert model._engine.decode_stats["max_rows"] == 4
    masked = sum(r.stats.grammar_masked_rows for r in device)
    assert n_device == masked > 100, (n_device, masked)

    with_logprobs = per_prompt + [dict(grammar=grammars[1], temperature=0.0, logprobs=2)]
    device, host, _ = _both_paths(model, lambda: model.generate_batch(prompts + ["["], per_prompt=with_logprobs,
                                                                      max_tokens=300))
    for i, (a, b) in enumerate(zip(device, host)):
        assert a.tokens == b.tokens, (i, a.text, b.text)
    assert device[-1].logprobs == host[-1].logprobs and device[-1].finish_reason == "stop"


@pytest.fixture(scope="module")
def self_draft():
    with Model(tiny_vocab_model_path(), n_ctx=512, n_threads=1, progress=False) as m:
        yield m


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(TOP_K_SAMPLING, seed=7)], ids=["greedy", "top-k"])
@pytest.mark.parametrize("drafter", ["self", "ngram", "self-tree"])
def test_speculative_equal_host_masks(model, self_draft, sampling, drafter):
    """generate() with a draft model (a second load of the target: its drafts are accepted), n-gram
    lookup, or a draft model's trees (tree_budget 6) under a JSON schema: each verify sends its rows'
    masks (the grammar's state after each row's path) to the device; the tokens, drafts and
    acceptances are the host path's, and every verify row the grammar masked was masked on the
    device."""
    g = Grammar.from_json_schema(BOUNDED_SCHEMAS["record"])
    spec = dict(spec_type="ngram-simple") if drafter == "ngram" else dict(draft_model=self_draft)
    if drafter == "self-tree":
        spec["tree_budget"] = 6

    def run():
        return model.generate("the cat sat", max_tokens=300, grammar=g, draft_n_max=6, **spec, **sampling)

    device, host, n_device = _both_paths(model, run)
    assert device.tokens == host.tokens, (device.text, host.text)
    assert (device.stats.n_drafted, device.stats.n_accepted) == (host.stats.n_drafted, host.stats.n_accepted)
    assert device.stats.n_drafted > 0 and device.finish_reason == "stop"
    if drafter != "ngram":
        assert device.stats.n_accepted > 0
    if drafter == "self-tree":
        assert device.stats.n_tree_nodes > 0
    assert n_device == device.stats.grammar_masked_rows == host.stats.grammar_masked_rows > 0


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(TOP_K_SAMPLING, seed=11)], ids=["greedy", "top-k"])
def test_batch_speculative_equals_host_masks(sampling):
    """generate_batch with a draft model, 4 requests on 3 slots (two JSON schemas, the digits regex,
    one free), chains and trees (tree_budget 6): the shared verify pass sends each sequence's masks
    with its rows; every result equals the host path's, drafts were accepted, and every row the
    grammars masked was masked on the device."""
    grammars = [Grammar.from_json_schema(BOUNDED_SCHEMAS[name]) for name in list(BOUNDED_SCHEMAS)[:2]]
    per_prompt = [dict(grammar=grammars[0]), dict(grammar=Grammar.from_regex(DIGITS)), dict(), dict(grammar=grammars[1])]
    prompts = ["Hello", "0123", "the cat", "{"]
    kw = dict(n_ctx=512, n_threads=1, n_seq_max=3, progress=False)
    with Model(tiny_vocab_model_path(), **kw) as m, Model(tiny_vocab_model_path(), **kw) as draft:
        for tree in ({}, dict(tree_budget=6)):
            def run():
                return m.generate_batch(prompts, per_prompt=per_prompt, max_tokens=200, draft_model=draft,
                                        draft_n_max=6, **tree, **sampling)

            device, host, n_device = _both_paths(m, run)
            for i, (a, b) in enumerate(zip(device, host)):
                assert a.tokens == b.tokens, (tree, i, a.text, b.text)
            assert sum(r.stats.n_accepted for r in device) > 0
            assert n_device == sum(r.stats.grammar_masked_rows for r in device) > 50


def test_logprobs_keep_whole_rows(model):
    """A masked request that asks for logprobs is masked on the host (its logprobs are the raw
    row's, which the device's reduction to the allowed tokens loses): no row masked on the device,
    and logprobs and tokens as with device masks off."""
    g = Grammar.from_regex(DIGITS)

    def run():
        return model.generate("Hello", max_tokens=40, grammar=g, temperature=0.0, logprobs=3)

    device, host, n_device = _both_paths(model, run)
    assert n_device == 0
    assert device.tokens == host.tokens and device.logprobs == host.logprobs
    assert device.stats.grammar_masked_rows == len(device.tokens)


def test_planted_device_bug_is_caught(model, monkeypatch):
    """With the device's masks allowing every token (DELTASPEC_TEST_GRAMMAR_BUG=device_unmasked),
    greedy and sampled generation under a grammar commit a token the grammar forbids (GrammarError)
    or write other tokens than the host path: the tests above would see it."""
    g = Grammar.from_regex(DIGITS)
    monkeypatch.setenv(BUG, "device_unmasked")
    caught = 0
    for sampling in (dict(temperature=0.0), dict(TOP_K_SAMPLING, seed=5)):
        try:
            device, host, _ = _both_paths(model, lambda: model.generate("Hello", max_tokens=40, grammar=g, **sampling))
            caught += device.tokens != host.tokens
        except GrammarError:
            caught += 1
    assert caught == 2
