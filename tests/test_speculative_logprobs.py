"""Log-probabilities with speculative decoding: generate(logprobs=k) with a drafter, and
generate_batch / add_request with logprobs. The claim: each committed token's logprob and its top-k
list are log_softmax of the target's raw logits at that position, which is what plain decoding
reports, whichever verify row predicted it (the pending token's row, an accepted chain token's, an
accepted tree node's; the correction or the bonus token included), for chains and trees, greedy and
sampled, from top rows and from whole rows, with a grammar (the raw logits, before its mask), and
for each sequence of a batch as for that sequence alone.

Reference: Model.logits over prompt + output in one plain pass, log_softmax in numpy (float64).

Seen red with DELTASPEC_TEST_WRONG_LOGPROB_ROW=next_row (csrc/logprobs.h: each accepted draft
token's values read from its own verify row, the next token's distribution): every test that
drafts fails, run by test_the_planted_row_bug_is_caught below. Seen red too with the grammar's
unmasked copy left out of the scheduler's verify (the masked rows' log_softmax reported):
test_grammar_logprobs_are_those_of_the_raw_logits.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from deltaspec import Grammar, Model
from deltaspec.testing.tiny_vocab import write_tiny_vocab_model
from test_llama_compat import _log_softmax
from test_speculative_tree import _ngram_prompts  # the repeating model's cycle, with a decoy: lookup branches
from test_structured_tree import _scaled_copy

K = 3            # top logprobs per token
WHOLE_K = 70     # more than Engine::top_k() (64): whole rows cross over
N_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target (4 slots); a draft that agrees with it in part (one FFN scaled by 3); a model whose
    next token depends mostly on the current one (residual branches scaled by 0.15), whose text
    falls into a cycle that prompt lookup drafts."""
    root = tmp_path_factory.mktemp("spec_logprobs")
    write_tiny_vocab_model(root / "target.gguf", seed=0)
    _scaled_copy(root / "target.gguf", root / "draft.gguf", "blk.1.ffn_down.weight", 3.0)
    write_tiny_vocab_model(root / "repeating.gguf", seed=0, branch_scale=0.15)
    kw = dict(n_ctx=512, n_threads=1, n_seq_max=4)
    with (Model(root / "target.gguf", **kw) as target, Model(root / "draft.gguf", **kw) as draft,
          Model(root / "repeating.gguf", **kw) as repeating):
        yield {"target": target, "draft": draft, "repeating": repeating, "root": root}


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(3, 16))).tolist() for _ in range(n)]


def _reference(model, prompt, tokens) -> np.ndarray:
    """log_softmax of the target's logits at each generated position (one plain pass)."""
    return _log_softmax(model.logits(list(prompt) + list(tokens[:-1]))[len(prompt) - 1:])


def _assert_logprobs_of_target(model, prompt, r, k, what):
    ref = _reference(model, prompt, r.tokens)
    assert len(r.logprobs) == len(r.top_logprobs) == len(r.tokens), what
    for i, token in enumerate(r.tokens):
        assert r.logprobs[i] == pytest.approx(ref[i, token], abs=1e-4), f"{what}: token {i}"
        top = r.top_logprobs[i]
        assert [t for t, _ in top] == np.argsort(-ref[i], kind="stable")[:k].tolist(), f"{what}: token {i} top ids"
        assert [v for _, v in top] == pytest.approx(np.sort(ref[i])[::-1][:k], abs=1e-4), f"{what}: token {i} top"


DRAFTERS = {  # the model that generates, and the speculation
    "draft chain": ("target", lambda m: dict(draft_model=m["draft"])),
    "draft tree": ("target", lambda m: dict(draft_model=m["draft"], tree_budget=6)),
    "ngram chain": ("repeating", lambda m: dict(spec_type="ngram-simple")),
    "ngram tree": ("repeating", lambda m: dict(spec_type="ngram-simple", tree_budget=6)),
}


# sampled prompt lookup is left out: the repeating model's distributions are too flat for sampled
# tokens to follow its cycle (nothing would be accepted). Which row predicted which token does not
# depend on the drafter, and the draft model's sampled chains and trees cover the sampled accept rule.
CASES = [(d, t, r) for d in DRAFTERS for t in (0.0, 0.9) for r in ("top", "whole")
         if not (d.startswith("ngram") and t > 0)]


@pytest.mark.parametrize("drafter, temperature, rows", CASES)
def test_speculative_logprobs_are_the_targets(models, drafter, temperature, rows):
    """Every committed token's logprob and top list equal log_softmax of the target's logits at its
    position; greedy, they are bitwise those of plain decoding. Drafts every step (draft_n_min=1)
    and asserts that drafts were accepted (and, from the draft model, rejected: correction, accepted
    and bonus rows all reported), that the trees branched, and which row path (top rows or whole
    rows) ran."""
    name, spec_of = DRAFTERS[drafter]
    target = models[name]
    engine = target._engine
    k = K if rows == "top" else WHOLE_K
    spec = spec_of(models)
    drafted = accepted = 0
    top_before, branched_before = engine.decode_stats["top_rows"], engine.rows_stats["branched_calls"]
    for n, prompt in enumerate(_ngram_prompts(target) if name == "repeating" else _prompts(3)):
        r = target.generate(prompt, max_tokens=N_TOKENS, temperature=temperature, seed=11 + n, logprobs=k,
                            draft_n_max=6, draft_n_min=1, **spec)  # no ignore_eos: its bias rules out top rows
        _assert_logprobs_of_target(target, prompt, r, k, f"{drafter}, prompt {n}")
        drafted += r.stats.n_drafted
        accepted += r.stats.n_accepted
        if temperature == 0.0:
            plain = target.generate(prompt, max_tokens=N_TOKENS, temperature=0.0, logprobs=k)
            assert r.tokens == plain.tokens
            assert r.logprobs == plain.logprobs and r.top_logprobs == plain.top_logprobs
    assert 0 < accepted < drafted, (drafted, accepted)
    took_top = engine.decode_stats["top_rows"] > top_before
    assert took_top == (rows == "top")
    if drafter.endswith("tree"):
        assert engine.rows_stats["branched_calls"] > branched_before


@pytest.mark.parametrize("tree_budget", [0, 6])
def test_grammar_logprobs_are_those_of_the_raw_logits(models, tree_budget):
    """With a grammar the verify rows are masked before the accept rule; the logprobs are still
    those of the raw logits (as plain decoding's): greedy output and logprobs bitwise plain
    decoding's, and equal to the unmasked reference. The grammar masked rows and the mask changed
    the values (the masked rows' log_softmax differs from the raw one), so the test tells them apart."""
    target, draft = models["target"], models["draft"]
    grammar = Grammar.from_regex(r"[ -~]{4,40}")
    masked_differs = False
    for n, prompt in enumerate(_prompts(3, seed=8)):
        kw = dict(max_tokens=N_TOKENS, temperature=0.0, logprobs=WHOLE_K, grammar=grammar)
        r = target.generate(prompt, draft_model=draft, draft_n_max=6, draft_n_min=1, tree_budget=tree_budget, **kw)
        plain = target.generate(prompt, **kw)
        assert r.tokens == plain.tokens and r.logprobs == plain.logprobs and r.top_logprobs == plain.top_logprobs
        assert r.stats.n_drafted > 0 and r.stats.grammar_masked_rows > 0
        _assert_logprobs_of_target(target, prompt, r, WHOLE_K, f"grammar, prompt {n}")
        ref = _reference(target, prompt, r.tokens)
        masked_differs = masked_differs or any(abs(lp - ref[i].max()) > 1e-3 for i, lp in enumerate(r.logprobs))
    assert masked_differs, "every token was the raw argmax: the mask never mattered"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batch_logprobs_equal_alone(models, temperature):
    """generate_batch(logprobs=k) with a draft model: each sequence's tokens and logprobs are those
    of generate() alone with the same drafter (bitwise), and the sequences drafted."""
    target, draft = models["target"], models["draft"]
    prompts = _prompts(4, seed=9)
    kw = dict(max_tokens=N_TOKENS, temperature=temperature, logprobs=K, draft_model=draft, draft_n_max=6,
              draft_n_min=1, ignore_eos=True)
    seeds = [{"seed": 20 + n} for n in range(len(prompts))]
    batch = target.generate_batch(prompts, per_prompt=seeds, **kw)
    for n, (prompt, b) in enumerate(zip(prompts, batch)):
        alone = target.generate(prompt, **seeds[n], **kw)
        assert b.tokens == alone.tokens, f"prompt {n}"
        assert b.logprobs == alone.logprobs and b.top_logprobs == alone.top_logprobs, f"prompt {n}"
        assert b.stats.n_drafted > 0
        _assert_logprobs_of_target(target, prompt, b, K, f"batch prompt {n}")
    assert target.batch_spec_stats["multi_draft_passes"] > 0


def test_add_request_reports_logprobs_per_step(models):
    """add_request(logprobs=k): the RequestOutput of each step carries (token, logprob, top) for the
    tokens it committed (several per step when drafts are accepted); joined, they are the result's;
    a request without logprobs gets none."""
    target = models["repeating"]
    prompts = _ngram_prompts(target)
    ids = [target.add_request(p, max_tokens=N_TOKENS, temperature=0.0, logprobs=K, spec_type="ngram-simple",
                              draft_n_min=1, ignore_eos=True) for p in prompts]
    other = target.add_request(prompts[0], max_tokens=8, temperature=0.0)
    steps: dict[int, list] = {i: [] for i in ids}
    results = {}
    multi = False
    while target.has_unfinished_requests:
        for out in target.step():
            if out.request_id == other:
                assert out.logprobs is None
                continue
            assert out.logprobs is not None and [t for t, _, _ in out.logprobs] == out.tokens
            multi = multi or len(out.tokens) > 1
            steps[out.request_id] += out.logprobs
            if out.finished:
                results[out.request_id] = out.result
    assert multi, "no step committed more than one token: nothing accepted"
    for i, prompt in zip(ids, prompts):
        r = results[i]
        assert [t for t, _, _ in steps[i]] == r.tokens
        assert [lp for _, lp, _ in steps[i]] == r.logprobs
        assert [top for _, _, top in steps[i]] == r.top_logprobs
        _assert_logprobs_of_target(target, prompt, r, K, f"request {i}")


def test_the_planted_row_bug_is_caught(models):
    """This file's tests fail with DELTASPEC_TEST_WRONG_LOGPROB_ROW=next_row (read at every round, so
    a fresh process sees it): a draft-model chain's logprobs then part from the reference."""
    script = textwrap.dedent(f"""
        import numpy as np, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from deltaspec import Model
        from test_speculative_logprobs import _prompts, _reference
        kw = dict(n_ctx=512, n_threads=1)
        with Model({str(models["root"] / "target.gguf")!r}, **kw) as t, Model({str(models["root"] / "draft.gguf")!r}, **kw) as d:
            worst = 0.0
            for prompt in _prompts(3):
                r = t.generate(prompt, max_tokens={N_TOKENS}, temperature=0.0, logprobs=1, draft_model=d,
                               draft_n_max=6, draft_n_min=1, ignore_eos=True)
                assert r.stats.n_accepted > 0
                ref = _reference(t, prompt, r.tokens)
                worst = max(worst, max(abs(lp - ref[i, tok]) for i, (tok, lp) in enumerate(zip(r.tokens, r.logprobs))))
            print(worst)
    """)
    env = {**os.environ, "DELTASPEC_TEST_WRONG_LOGPROB_ROW": "next_row"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) > 1e-2, "the planted bug left the logprobs right: the tests cannot see it"
