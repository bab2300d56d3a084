"""Greedy speculative decoding on a Q4_K model against plain greedy decoding, on the CPU.

The tiny-vocabulary model with every matrix Q4_K (n_embd 256, n_ff 512: rows of whole 256-value
super-blocks), as tests/test_gpu_speculative.py runs it on CUDA. 20 prompts x 128 tokens, for a
draft model that agrees in part (the target with one FFN's weights tripled before quantization)
and for prompt lookup (ngram-simple) on a model whose text repeats (branch_scale 0) from prompts
of its own cycles. Every divergence from plain greedy is reported with its logit gaps.

What holds on the CPU, measured: with F32, Q8_0 or Q4_0 weights a row's logits are bitwise the
same whatever batch computes it (one-token step, prefill, verify batch), so speculative greedy is
token-identical to plain greedy (tests/test_speculative.py asserts that on F32). With K-quant
weights the pinned ggml-cpu multiplies batches of 8 or more rows in its tiled K-quant kernel
(ggml-cpu/tiled/tiled.cpp, ggml_tiled_min_batch) and fewer rows with vec_dot; the two sum in
another order (the model with only output.weight in Q4_K already differs by 2e-6), and where a
later layer re-quantizes its input to Q8_K such a difference can flip one int8 step, which moved
logits by up to 0.21 (std 2.5). So, on the CPU with a Q4_K model and the default settings:

- verify batches under 8 tokens (draft_n_max <= 6: the last token and up to 6 drafts) run the
  one-token step's kernel: speculative greedy is token-identical, asserted (`exact` cases);
- longer ones (draft_n_max 8) may part from plain greedy at a near-tie, and did: 1 divergence in
  the 2,560 tokens of the draft-model run (prompt 15, token 72: plain gap 0.043 with an rms
  step-vs-batch difference of 0.045 at that row). The assertion there is the GPU tests': every
  divergence is a near-tie at the scale of the step-vs-batch difference at its row (gap <=
  NEAR_TIE_NOISE x its rms) and that difference is rounding, not a wrong result (rms <=
  NOISE_BOUND x the logit std; a wrong row or state moves it by the std itself).

With batch_invariant=True (python/deltaspec/batch_invariance.py: ggml-cpu's reference kernels,
ggml_backend_cpu_set_use_ref) every weight type's rows are bitwise batch-invariant, including
the 64+-row batches where ggml-cpu's flash attention tiles and the long contexts where it splits
a one-row attention over the threads (`test_batch_invariant_rows_for_every_weight_type`), and
the draft-model case at draft_n_max 8 is token-identical
(`test_batch_invariant_option_makes_q4k_speculation_exact`), as is an F16 model verifying
71-row batches over 300 tokens on 2 threads.

Planted bug, seen to fail: `test_planted_divergence_is_caught` replaces one token of a speculative
result by plain decoding's second choice (what a verifier that accepted a wrong draft would
produce); the comparison finds it at that position with the gap it has, and both `check_identical`
and `check_near_ties` reject it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import deltaspec
from deltaspec import Model
from deltaspec.batch_invariance import ENV, BatchInvarianceError
from deltaspec.testing.batch_rows import batch_vs_steps
from deltaspec.testing.tiny_vocab import QUANT_TYPES, cycle_prompt, write_tiny_vocab_model

N_PROMPTS, N_TOKENS = 20, 128
NEAR_TIE_NOISE = 6.0  # a divergence's gap, in rms step-vs-batch differences at its row
NOISE_BOUND = 0.1     # that rms, in logit stds, on the CPU (measured: 0.018 at the divergence above)
Q4K_SHAPE = dict(n_embd=256, n_ff=512)  # every matrix row a whole number of Q4_K super-blocks


@dataclass
class Divergence:
    """Where speculative greedy first parts from plain greedy for one prompt, with the logit gaps:
    plain_gap = L_step[plain] - L_step[spec] in plain decoding's logits (one-token steps, >= 0),
    batch_gap = L_batch[spec] - L_batch[plain] in the logits of the same prefix computed in
    batches, the last in a verify batch (> 0 where that path prefers the speculative token; see
    step_and_batch_logits), noise = rms(L_step - L_batch) over the vocabulary, scale =
    max |L_step|, std = std(L_step)."""
    label: str
    prompt: int
    position: int
    plain_token: int
    spec_token: int
    plain_gap: float
    batch_gap: float
    noise: float
    scale: float
    std: float

    def row(self) -> str:
        return (f"{self.label:<14} {self.prompt:>6} {self.position:>8} {self.plain_token:>8} {self.spec_token:>8} "
                f"{self.plain_gap:>10.3e} {self.plain_gap / self.scale:>10.3e} {self.batch_gap:>10.3e} "
                f"{self.noise:>10.3e} {self.noise / self.std:>10.3e}")


REPORT_HEADER = (f"{'drafter':<14} {'prompt':>6} {'position':>8} {'plain':>8} {'spec':>8} {'plain_gap':>10} "
                 f"{'gap/max':>10} {'batch_gap':>10} {'rms_noise':>10} {'noise/std':>10}")


def step_and_batch_logits(model: Model, prompt: list[int], prefix: list[int],
                          width: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits predicting the token after prompt + prefix, twice: as plain greedy decoding computes
    them (the prompt in one batch, then one-token steps) and with the whole history in batches,
    the speculative path's kernels: prompt + prefix but its last `width` tokens in one batch,
    those in one verify batch (width: the longest verify batch of the run). A speculative run
    computes most of its history in verify batches, so its KV cache and recurrent state carry the
    batch kernels' rounding as well as its last row: the history matters, not the last row alone."""
    engine = model._live()
    model.reset()
    rows = model.eval(prompt)
    for t in prefix:
        rows = model.eval([t])
    step = rows[-1]
    ids = prompt + prefix
    w = min(width, len(ids) - 1)
    engine.reserve_slots(w)  # a no-op when there is room already: reset() empties the sequence
    model.reset()
    model.eval(ids[:-w])
    batch = engine.eval_verify(np.asarray(ids[-w:], dtype=np.int32))[-1]
    engine.keep(w)
    return step, batch


def greedy_divergences(target: Model, prompts: list[list[int]], label: str, n_tokens: int = N_TOKENS,
                       spec_tokens=None, **spec) -> tuple[list[Divergence], int, int]:
    """Plain and speculative greedy for each prompt; the first divergence of each (if any) with its
    gaps, and the drafted / accepted totals. `spec_tokens(k, tokens)`, for the planted-bug test
    only, replaces the speculative tokens of prompt k."""
    found, drafted, accepted = [], 0, 0
    width = max(spec.get("draft_n_max", 16), spec.get("tree_budget", 0)) + 1  # the longest verify batch
    for k, prompt in enumerate(prompts):
        plain = target.generate(prompt, max_tokens=n_tokens, temperature=0).tokens
        fast = target.generate(prompt, max_tokens=n_tokens, temperature=0, **spec)
        drafted += fast.stats.n_drafted
        accepted += fast.stats.n_accepted
        tokens = fast.tokens if spec_tokens is None else spec_tokens(k, fast.tokens)
        if tokens == plain:
            continue
        i = next((i for i, (a, b) in enumerate(zip(plain, tokens)) if a != b), None)
        assert i is not None, f"{label} prompt {k}: one token list is a prefix of the other ({len(plain)} vs " \
                              f"{len(tokens)} tokens) with the same max_tokens"
        assert i > 0, f"{label} prompt {k}: the first token, taken from the prompt's logits, differs"
        step, batch = step_and_batch_logits(target, prompt, plain[:i], width)
        assert step.argmax() == plain[i], f"{label} prompt {k}: plain decoding not reproduced at token {i}"
        p, s = plain[i], tokens[i]
        found.append(Divergence(label, k, i, p, s, float(step[p] - step[s]), float(batch[s] - batch[p]),
                                float(np.sqrt(np.mean((step - batch) ** 2))), float(np.abs(step).max()),
                                float(step.std())))
    return found, drafted, accepted


def report(divergences: list[Divergence], label: str, drafted: int, accepted: int) -> str:
    lines = [f"{label}: {len(divergences)} divergence(s); drafted {drafted}, accepted {accepted}"]
    if divergences:
        lines += [REPORT_HEADER] + [d.row() for d in divergences]
    text = "\n".join(lines)
    print(text)
    return text


def check_near_ties(divergences: list[Divergence], noise_bound: float) -> None:
    """Each divergence is a near-tie of plain decoding's logits at the scale of the difference
    between the step and batch paths at that row, and that difference is rounding-sized."""
    for d in divergences:
        where = f"{d.label} prompt {d.prompt} token {d.position}"
        assert d.noise <= noise_bound * d.std, (
            f"{where}: one-token step and verify batch differ by rms {d.noise / d.std:.3g} of the logit std "
            f"(more than rounding: > {noise_bound})")
        assert d.plain_gap <= NEAR_TIE_NOISE * d.noise, (
            f"{where}: speculative token {d.spec_token} is {d.plain_gap:.3g} below plain greedy's {d.plain_token}, "
            f"not a near-tie (rms step-vs-batch difference there {d.noise:.3g})")


def random_prompts(rng: np.random.Generator, n_vocab: int, low: int = 0) -> list[list[int]]:
    return [rng.integers(low, n_vocab, size=rng.integers(4, 24)).tolist() for _ in range(N_PROMPTS)]


def triple_ffn(name: str, x: np.ndarray) -> np.ndarray:
    """The draft's change: one FFN's output tripled (before quantization), so it agrees in part."""
    return x * 3.0 if name == "blk.1.ffn_down.weight" else x


@pytest.fixture(scope="module")
def q4k_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-q4k")
    kw = dict(n_ctx=512, n_threads=1)
    paths = {"target": write_tiny_vocab_model(root / "target.gguf", quant="q4_k", **Q4K_SHAPE),
             "perturbed": write_tiny_vocab_model(root / "perturbed.gguf", quant="q4_k", weight_map=triple_ffn,
                                                 **Q4K_SHAPE),
             "repeating": write_tiny_vocab_model(root / "repeating.gguf", quant="q4_k", branch_scale=0.0,
                                                 **Q4K_SHAPE)}
    models = {name: Model(p, **kw) for name, p in paths.items()}
    yield models
    for m in models.values():
        m.close()


def cycle_prompts(model: Model) -> list[list[int]]:
    """N_PROMPTS prompts the repeating model continues with their own cycle: the cycles greedy text
    falls into from the first N_PROMPTS / 2 starting tokens that settle, each also rotated by one
    token (a rotation of a cycle is the same cycle)."""
    prompts = []
    for start in range(model.n_vocab):
        try:
            twice = cycle_prompt(model, start)
        except ValueError:
            continue
        period = twice[:len(twice) // 2]
        prompts += [twice, (period[1:] + period[:1]) * 2]
        if len(prompts) == N_PROMPTS:
            return prompts
    raise AssertionError(f"only {len(prompts) // 2} starts settle into a short cycle")


def check_identical(divergences: list[Divergence]) -> None:
    assert not divergences, "speculative greedy parts from plain greedy: " + "; ".join(
        f"{d.label} prompt {d.prompt} token {d.position}: {d.spec_token} for {d.plain_token}" for d in divergences)


# (drafter, draft_n_max): 6 keeps every verify batch under ggml-cpu's 8-row tiled K-quant kernel
CASES = [("perturbed", 6), ("ngram", 6), ("perturbed", 8), ("ngram", 8)]


@pytest.mark.parametrize("drafter,n_max", CASES, ids=[f"{d}-{n}" for d, n in CASES])
def test_q4k_speculative_greedy(q4k_models, drafter, n_max, record_property):
    m = q4k_models
    if drafter == "ngram":
        target, spec = m["repeating"], dict(spec_type="ngram-simple", draft_n_max=n_max)
        prompts = cycle_prompts(target)
    else:
        target, spec = m["target"], dict(draft_model=m["perturbed"], draft_n_max=n_max, draft_n_min=1)
        prompts = random_prompts(np.random.default_rng(11), target.n_vocab)
    label = f"cpu-{drafter}-{n_max}"
    found, drafted, accepted = greedy_divergences(target, prompts, label, **spec)
    record_property("divergences", report(found, label, drafted, accepted))
    assert drafted > 0 and accepted > 0
    if drafter == "perturbed":
        assert accepted < drafted  # drafts rejected in part: verify batches were kept in part (rollback)
    if n_max + 1 < 8:
        check_identical(found)
    else:
        check_near_ties(found, NOISE_BOUND)


def test_planted_divergence_is_caught(q4k_models):
    """Planted bug: the speculative tokens of prompt 1 get token 7 replaced by the second choice of
    plain decoding's logits there. The comparison must find exactly that divergence, with its true
    gap, and check_identical and check_near_ties must reject it (they did: gap 1.47, step-vs-batch
    rms 1.2e-6)."""
    target = q4k_models["target"]
    prompts = random_prompts(np.random.default_rng(14), target.n_vocab)[:3]
    second = {}

    def corrupt(k, tokens):
        if k != 1:
            return tokens
        step, _ = step_and_batch_logits(target, prompts[1], tokens[:7], 1)
        second[k] = int(np.argsort(step)[-2])
        return tokens[:7] + [second[k]] + tokens[8:]

    found, drafted, accepted = greedy_divergences(target, prompts, "planted", n_tokens=16, spec_tokens=corrupt,
                                                  draft_model=q4k_models["perturbed"], draft_n_min=1)
    assert drafted > 0
    assert [(d.prompt, d.position, d.spec_token) for d in found] == [(1, 7, second[1])]
    assert "planted" in report(found, "planted", drafted, accepted)
    with pytest.raises(AssertionError, match="planted prompt 1 token 7: .* for "):
        check_identical(found)
    with pytest.raises(AssertionError, match="planted prompt 1 token 7: speculative token .* not a near-tie"):
        check_near_ties(found, NOISE_BOUND)


# --- batch_invariant=True ------------------------------------------------------------------------
K_QUANTS = {"q2_k", "q3_k", "q4_k", "q5_k", "q6_k"}  # the types ggml-cpu's tiled kernel takes
DIVERGENT_PROMPT = 15  # where the default settings part at draft_n_max 8 (module docstring)
# (name, batch rows, context before them, threads): each takes another ggml-cpu path by default
BATCH_SHAPES = [("matmul", 40, 0, 1),          # K-quant batches of 8+ rows: the tiled matmul kernel
                ("attention", 70, 0, 1),       # 64+ query rows: the tiled flash-attention kernel
                ("long_context", 2, 300, 2)]   # KV padded to 512 cells: one-row steps split over threads


def row_differences(path: Path, invariant: bool | None) -> dict[str, float]:
    """batch_vs_steps for each of BATCH_SHAPES."""
    out = {}
    for name, rows, context, threads in BATCH_SHAPES:
        with Model(path, n_ctx=512, n_threads=threads, batch_invariant=invariant) as m:
            out[name] = batch_vs_steps(m, rows, context, np.random.default_rng(3))
    return out


@pytest.fixture(scope="module")
def weight_type_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight-types")
    return {q or "f32": write_tiny_vocab_model(root / f"{q or 'f32'}.gguf", quant=q, **Q4K_SHAPE)
            for q in [None, *QUANT_TYPES]}


def test_batch_invariant_rows_for_every_weight_type(weight_type_models):
    """With batch_invariant=True every weight type's rows are bitwise the same in a batch and in
    one-token steps, for each batch shape where ggml-cpu's default takes another kernel.

    The planted bug is the option left out (ggml-cpu's default kernels): the K-quant types then
    differ in the 40-row batch (tiled matmul), and every type differs in the 70-row batch (tiled
    flash attention) and in the long-context pair (one-row attention split over 2 threads), so
    each zero asserted below is seen to fail without the option."""
    for q, path in weight_type_models.items():
        on, off = row_differences(path, True), row_differences(path, False)
        print(q, "invariant", on, "default", off)
        assert on == {name: 0.0 for name, *_ in BATCH_SHAPES}, f"{q}: rows depend on the batch: {on}"
        assert (off["matmul"] > 0) == (q in K_QUANTS), f"{q}: default matmul rows {off['matmul']}"
        assert off["attention"] > 0 and off["long_context"] > 0, f"{q}: default attention rows {off}"


def test_batch_invariant_option_makes_q4k_speculation_exact(q4k_models):
    """With batch_invariant=True the draft-model case at draft_n_max 8 (verify batches of 9 rows,
    the tiled matmul's width) is token-identical to plain greedy on all 20 prompts x 128 tokens,
    including the prompt where the default settings part.

    Planted bug, seen to fail: the same target without the option (q4k_models' target) parts
    from plain greedy on the known prompt, so check_identical raises there; asserted below."""
    with Model(q4k_models["target"].path, n_ctx=512, n_threads=1, batch_invariant=True) as target:
        assert target.batch_invariant
        prompts = random_prompts(np.random.default_rng(11), target.n_vocab)
        found, drafted, accepted = greedy_divergences(target, prompts, "invariant", draft_model=q4k_models["perturbed"],
                                                      draft_n_max=8, draft_n_min=1)
        report(found, "invariant", drafted, accepted)
        assert drafted > 0 and 0 < accepted < drafted  # verify batches kept in part
        check_identical(found)
    default = q4k_models["target"]
    assert not default.batch_invariant
    found, *_ = greedy_divergences(default, [prompts[DIVERGENT_PROMPT]], "default", draft_model=q4k_models["perturbed"],
                                   draft_n_max=8, draft_n_min=1)
    with pytest.raises(AssertionError, match="default prompt 0 token"):
        check_identical(found)


def test_batch_invariant_speculation_with_wide_verify_batches_and_long_context(tmp_path):
    """An F16 model (whose matmuls are batch-invariant anyway), 2 threads, drafts of 70 and draft
    trees of 64 nodes (verify batches of 71 and 65 rows: ggml-cpu's tiled attention) and 300
    generated tokens (the KV cache padded past 512 cells: the one-row steps' attention split over
    the threads): with batch_invariant=True speculative greedy is token-identical to plain greedy,
    and the model's 71-row batches after 300 tokens give the one-token steps' rows bitwise. Planted bug, seen to fail: the option left
    out, the tokens happened to agree on these 4 prompts, but the rows differed (by 0.003) and
    the last assertion failed."""
    target = write_tiny_vocab_model(tmp_path / "t.gguf", quant="f16", **Q4K_SHAPE)
    draft = write_tiny_vocab_model(tmp_path / "d.gguf", quant="f16", weight_map=triple_ffn, **Q4K_SHAPE)
    with Model(target, n_ctx=512, n_threads=2, batch_invariant=True) as t, Model(draft, n_ctx=512, n_threads=2) as d:
        prompts = random_prompts(np.random.default_rng(5), t.n_vocab)[:4]
        found, drafted, accepted = greedy_divergences(t, prompts, "wide", n_tokens=300, draft_model=d,
                                                      draft_n_max=70, draft_n_min=70)
        report(found, "wide", drafted, accepted)
        assert drafted >= 70 * 4 and accepted > 0
        check_identical(found)
        # a draft tree of 64 nodes: verify batches of 65 rows under per-row tree masks
        found, drafted, accepted = greedy_divergences(t, prompts[:2], "tree64", n_tokens=300, draft_model=d,
                                                      draft_n_max=8, draft_n_min=8, tree_budget=64)
        report(found, "tree64", drafted, accepted)
        assert drafted >= 64 * 2 and accepted > 0
        check_identical(found)
        assert batch_vs_steps(t, 71, 300, np.random.default_rng(3)) == 0.0  # the kernels the option chose ran


def test_batch_invariant_argument_and_environment(q4k_models, monkeypatch):
    """The argument wins; without it DELTASPEC_BATCH_INVARIANT decides (off when unset); a malformed
    value of either is refused, and so is the option (asked for or from the environment) on a GPU
    model with a cache its invariant attention does not read, before anything is loaded.
    Planted bug, seen to fail: resolve() ignoring the environment made the first assertion fail."""
    path = q4k_models["target"].path
    monkeypatch.setenv(ENV, "1")
    assert deltaspec.batch_invariant()
    with Model(path, n_ctx=64, n_threads=1) as m:
        assert m.batch_invariant and batch_vs_steps(m, 12, 0, np.random.default_rng(2)) == 0.0
    with Model(path, n_ctx=64, n_threads=1, batch_invariant=False) as m:
        assert not m.batch_invariant and batch_vs_steps(m, 12, 0, np.random.default_rng(2)) > 0
    monkeypatch.delenv(ENV)
    assert not deltaspec.batch_invariant()
    with Model(path, n_ctx=64, n_threads=1) as m:
        assert not m.batch_invariant
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(BatchInvarianceError, match=f"{ENV} must be 0 or 1, got 'yes'"):
        Model(path, n_ctx=64, n_threads=1)
    monkeypatch.delenv(ENV)
    with pytest.raises(BatchInvarianceError, match="batch_invariant must be True, False or None, got 'yes'"):
        Model(path, n_ctx=64, n_threads=1, batch_invariant="yes")
    refused = "on cuda the KV cache must be f16, bf16, f32, tq3 or tq4 on both sides"
    with pytest.raises(BatchInvarianceError, match=f"batch_invariant=True: {refused}.*type_k='q8_0'"):
        Model(path, n_ctx=64, n_threads=1, device="cuda", batch_invariant=True, type_k="q8_0", type_v="q8_0")
    with pytest.raises(BatchInvarianceError, match=f"batch_invariant=True: {refused}.*type_v='bf16'"):
        Model(path, n_ctx=64, n_threads=1, device="cuda", batch_invariant=True, type_v="bf16")
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(BatchInvarianceError, match=f"{ENV}=1: {refused}.*type_k='q4_0'"):
        Model(path, n_ctx=64, n_threads=1, device="cuda", type_k="q4_0", type_v="q4_0")
    with Model(path, n_ctx=64, n_threads=1, device="cpu", type_k="q8_0", type_v="q8_0") as m:
        assert m.batch_invariant  # any cache type on the CPU
