"""Batch-invariant CUDA models: Model(..., device="cuda", batch_invariant=True) computes each row
bitwise as it would be computed in any other batch (ggml/cuda/deltaspec_invariant.h), so greedy
speculation (draft model and prompt lookup, chains and trees) and batches of sequences give plain
greedy's tokens exactly on quantized models, where the default kernels part at near-ties
(test_gpu_speculative.py: 11 of 20 continuations of the random 0.8B Q4_K_M).

Run on the GPU machine with: python -m pytest -q -s -m gpu tests/test_gpu_batch_invariant.py

Models: the synthetic Qwen3.5-0.8B Q4_K_M (real shapes and quant mix: its Q4_K and Q6_K matrices
on our tensor-core kernels, its Q6_K ffn_down of 3584 columns, which they do not take, column by
column through ggml's mat-vec), the same with a tq3 cache (decoded to F16 for the invariant
attention), the tiny-vocabulary model with every matrix Q4_K, and the tiny model in F32 (ggml's
F32 mat-vec, column by column). Every test checks that the invariant routes ran and that no node
of an invariant model went to ggml's batch-shaped kernels (cuda_invariant_count).

Seen to fail:
  * the same checks on the same models built with batch_invariant=False: rows differ between a
    batch and one-token steps (asserted in test_rows_equal_one_token_steps: the switch is the
    planted bug, and the check's power);
  * DELTASPEC_TEST_INVARIANT_BUG=cell_order (the attention takes cells by their index in the cache,
    not by their rank among the cells a query sees): a draft tree's rows then differ from their
    path's steps (asserted in test_tree_rows_equal_their_paths_steps), while every chain stays
    equal, which is why the kernel ranks the cells;
  * DELTASPEC_TEST_INVARIANT_BUG=row_tiles (the tensor-core kernels keep the row tiles and k-split
    their matrix's row count chooses): a stacked matrix's rows then differ from its part's product
    alone (asserted in test_stacked_rows_equal_the_part_alone); this is what parted the synthetic
    27B's batches from its steps (its ffn gate/up stack against the steps' separate products,
    bench/invariance_probe.py --nodes).
"""

from __future__ import annotations

import numpy as np
import pytest

from deltaspec import Model, _core
from deltaspec.testing.batch_rows import batch_vs_steps
from test_gpu import _cuda_available
from test_gpu_tree import PARENTS, PREFIX, TOKENS, _paths as tree_paths
from test_speculative_quantized import (Q4K_SHAPE, check_identical, cycle_prompts, greedy_divergences,
                                        random_prompts, report, triple_ffn)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="no CUDA device in this build "
                                                  "of deltaspec (CPU-only build or no GPU)")]

MMA, COLUMNS, ATTENTION, MISSES = range(4)  # cuda_invariant_count's `which`
N_CTX = 1024
# (batch rows, context before them): widths of one mat-vec group (2), ggml's tile kernels (9+),
# verify chains (17), more than one tensor-core launch (40), deep enough for several attention
# blocks of 256 cells (600)
SHAPES = ((2, 0), (9, 0), (17, 300), (40, 0), (3, 600))


def counts() -> list[int]:
    return [_core.cuda_invariant_count(w) for w in range(4)]


def ran(before: list[int]) -> list[int]:
    return [a - b for a, b in zip(counts(), before)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from deltaspec.synth import write_synthetic_gguf
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    root = tmp_path_factory.mktemp("gpu-invariant")
    out = {"synth": root / "qwen35-0.8b-q4km.gguf"}
    write_synthetic_gguf(out["synth"], "0.8b", "q4_k_m")
    out["q4k"] = write_tiny_vocab_model(root / "q4k.gguf", quant="q4_k", **Q4K_SHAPE)
    out["q4k128_repeating"] = write_tiny_vocab_model(root / "q4k128-rep.gguf", quant="q4_k", branch_scale=0.0,
                                                     ssm_state=128, **Q4K_SHAPE)
    out["f32"] = write_tiny_vocab_model(root / "f32.gguf", ssm_state=128)
    # DeltaNet states of 128 (every Qwen3.5 / 3.6 checkpoint's): our CUDA kernels verify and commit
    # speculation's rows (chains and trees: the rows ops), which keeps them bitwise the steps
    out["q4k128"] = write_tiny_vocab_model(root / "q4k128.gguf", quant="q4_k", ssm_state=128, **Q4K_SHAPE)
    out["q4k128_draft"] = write_tiny_vocab_model(root / "q4k128-draft.gguf", quant="q4_k", ssm_state=128,
                                                 weight_map=triple_ffn, **Q4K_SHAPE)
    return out


# model name -> (file, Model keyword arguments, routes its products must take)
MODELS = {
    "synth-0.8b-q4km": ("synth", {}, (MMA, COLUMNS)),
    "synth-0.8b-q4km-tq3": ("synth", {"type_k": "tq3", "type_v": "tq3"}, (MMA, COLUMNS)),
    "tiny-q4k": ("q4k", {}, (MMA,)),
    "tiny-f32": ("f32", {}, (COLUMNS,)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_rows_equal_one_token_steps(files, name, record_property):
    """Each row of a batch (2..40 rows, after 0..600 tokens) has bitwise the logits of the same
    tokens as one-token steps on an invariant model; the same model without the option differs."""
    key, kw, routes = MODELS[name]
    before = counts()
    with Model(files[key], device="cuda", n_ctx=N_CTX, batch_invariant=True, **kw) as m:
        assert m.batch_invariant
        diffs = [batch_vs_steps(m, rows, context, np.random.default_rng(rows)) for rows, context in SHAPES]
    done = ran(before)
    record_property("invariant_diffs", diffs)
    assert diffs == [0.0] * len(SHAPES), f"{name}: rows differ from steps by {diffs}"
    assert done[MISSES] == 0, f"{name}: {done[MISSES]} nodes missed the invariant routes"
    assert done[ATTENTION] > 0 and all(done[r] > 0 for r in routes), f"{name}: routes ran {done}"
    with Model(files[key], device="cuda", n_ctx=N_CTX, batch_invariant=False, **kw) as m:
        default = [batch_vs_steps(m, rows, context, np.random.default_rng(rows)) for rows, context in SHAPES]
    record_property("default_diffs", default)
    print(f"{name}: invariant {diffs}, default {default}")
    assert max(default) > 0, f"{name}: the default kernels' rows equal the steps too: the check has no power here"


# test_gpu_tree.py's DDTree-like tree after PREFIX: its paths through nodes 7 and 8 put a row at a
# cell whose index differs from its rank by 1 or 2 mod 4 (what the planted cell_order bug changes).
def path_steps(m: Model, path: list[int]) -> np.ndarray:
    m.reset()
    m.eval(PREFIX)
    return np.concatenate([m.eval([TOKENS[i]]) for i in path])


def tree_differences(m: Model) -> list[float]:
    m.reset()
    m.eval(PREFIX)
    tree = m._live().verify_tree(np.array(TOKENS, np.int32), np.array(PARENTS, np.int32))
    return [float(np.abs(tree[p] - path_steps(m, p)).max()) for p in tree_paths()]


def test_tree_rows_equal_their_paths_steps(files, monkeypatch):
    """A draft tree's rows (one verify pass, ancestors at scattered cells) have bitwise the logits
    of their path's tokens as one-token steps, and after keep_path (KV rows compacted) the next
    step's logits equal plain stepping's; the planted cell_order bug breaks the first."""
    before = counts()
    with Model(files["f32"], device="cuda", n_ctx=N_CTX, batch_invariant=True) as m:
        assert tree_differences(m) == [0.0] * len(tree_paths())
        assert m._live().tree_stats["rows_op_nodes"] > 0
        for path in ([0, 5, 6], [0, 1, 7], [0, 1, 2, 8, 9]):
            m.reset()
            m.eval(PREFIX)
            m._live().verify_tree(np.array(TOKENS, np.int32), np.array(PARENTS, np.int32))
            m._live().keep_path(np.array(path, np.int32))
            got = m.eval([99])
            want = np.concatenate([path_steps(m, path), m.eval([99])])[-1:]
            assert np.array_equal(got, want), f"after keep_path({path})"
        assert ran(before)[MISSES] == 0
    # a model of its own: ggml-cuda replays captured CUDA graphs without the host code that reads
    # the switch
    monkeypatch.setenv("DELTASPEC_TEST_INVARIANT_BUG", "cell_order")
    with Model(files["f32"], device="cuda", n_ctx=N_CTX, batch_invariant=True) as m:
        planted = tree_differences(m)
    print(f"cell_order planted: path differences {planted}")
    assert max(planted) > 0, "ranking the visible cells made no difference: the bug went unseen"


# (label, target file, Model keywords, speculation); 20 prompts x 128 tokens each
SPEC_CASES = {
    "synth-draft": ("synth", {"draft_n_max": 8, "draft_n_min": 1}),
    "synth-ngram": ("synth", {"spec_type": "ngram-simple", "draft_n_max": 8}),
    "synth-tree": ("synth", {"draft_n_max": 6, "draft_n_min": 1, "tree_budget": 12}),
    "q4k-draft": ("q4k128", {"draft_n_max": 8, "draft_n_min": 1}),
    "q4k-tree": ("q4k128", {"draft_n_max": 6, "draft_n_min": 1, "tree_budget": 16}),
    "q4k-ngram": ("q4k128_repeating", {"spec_type": "ngram-simple", "draft_n_max": 8}),
}


def synth_draft_file(files, tmp_path_factory):
    """The synthetic model with one layer's FFN input norm doubled: a draft that agrees in part."""
    import shutil

    from test_gpu_speculative import SYNTH_PERTURBED, scale_f32_tensor

    path = tmp_path_factory.getbasetemp() / "synth-draft.gguf"
    if not path.exists():
        shutil.copyfile(files["synth"], path)
        scale_f32_tensor(path, SYNTH_PERTURBED, 2.0)
    return path


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_speculative_greedy_is_plain_greedy(files, tmp_path_factory, case, record_property):
    """On an invariant model, speculative greedy gives plain greedy's tokens for every prompt, with
    drafts drafted, accepted and (draft model) rejected, and trees branched."""
    key, spec = SPEC_CASES[case]
    spec = dict(spec)
    rng = np.random.default_rng(21)
    before = counts()
    with Model(files[key], device="cuda", n_ctx=N_CTX, batch_invariant=True) as target:
        draft = None
        if "spec_type" not in spec:
            draft_path = synth_draft_file(files, tmp_path_factory) if key == "synth" else files[f"{key}_draft"]
            draft = Model(draft_path, device="cuda", n_ctx=N_CTX)
            spec["draft_model"] = draft
        if key == "synth":
            prompts = ([rng.integers(1000, 150000, size=rng.integers(4, 12)).tolist() * 4 for _ in range(20)]
                       if "spec_type" in spec else random_prompts(rng, 150000, low=1000))
        else:
            prompts = cycle_prompts(target) if "spec_type" in spec else random_prompts(rng, target.n_vocab)
        branched = target._live().rows_stats["branched_calls"]
        try:
            found, drafted, accepted = greedy_divergences(target, prompts, case, **spec)
        finally:
            if draft is not None:
                draft.close()
        record_property("divergences", report(found, case, drafted, accepted))
        assert drafted > 0 and accepted > 0, f"{case}: drafted {drafted}, accepted {accepted}: no speculation ran"
        if key.startswith("q4k") and draft is not None:
            assert accepted < drafted, f"{case}: every draft accepted: no rollback ran"
        if "tree_budget" in spec:
            assert target._live().rows_stats["branched_calls"] > branched, f"{case}: no tree branched"
    check_identical(found)
    assert ran(before)[MISSES] == 0


def test_batch_of_sequences_is_each_alone(files):
    """Four sequences decoded together (one step a batch of rows of different sequences and
    lengths) give each the tokens it gives alone, on an invariant 0.8B Q4_K_M."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1000, 150000, size=n).tolist() for n in (5, 17, 40, 9)]
    with Model(files["synth"], device="cuda", n_ctx=N_CTX, n_seq_max=4, batch_invariant=True) as m:
        alone = [m.generate(p, max_tokens=64, temperature=0).tokens for p in prompts]
        together = [r.tokens for r in m.generate_batch(prompts, max_tokens=64, temperature=0)]
    assert together == alone


# (type, K, stacked rows, head rows): a stack whose row tiles (mma_row_tiles) or k-split
# (q6k_mma_k_split) differ from its head's on an H100 / H200 (132 SMs): the 27B's ffn gate/up stack
# at K 2048 (R = 2 against 1), and a Q6_K matrix of the ffn down's K whose head alone is split
# across a cluster and whose stack is not
STACKS = (("q4_K", 2048, 2 * 17408, 17408), ("q6_K", 17408, 2 * 5120, 5120))


@pytest.mark.parametrize("case", STACKS, ids=[c[0] for c in STACKS])
def test_stacked_rows_equal_the_part_alone(case, monkeypatch):
    """A stacked matrix's rows (a batch's shared-input products: the ffn gate/up stack, DeltaNet's
    input stack) equal its part's product alone (a one-token step's separate products), bitwise,
    for a product of 12 columns and each column alone, when the backend is batch-invariant: the
    tensor-core kernels add each row's blocks in one order whatever the matrix's row count. With
    the planted DELTASPEC_TEST_INVARIANT_BUG=row_tiles (the order follows the row count again) the
    same comparison differs: the check's power, and why the order is fixed."""
    type_name, k, rows, head = case
    rng = np.random.default_rng(5)
    w = rng.standard_normal((rows, k), dtype=np.float32)
    x = rng.standard_normal((12, k), dtype=np.float32)
    before = counts()
    got = _core.matmul_columns("cuda", w, type_name, x, batch_invariant=True, head_rows=head)
    assert ran(before)[MMA] >= 14 and ran(before)[MISSES] == 0  # batch, 12 alone and the head, on our kernels
    assert np.array_equal(got["batch"], got["alone"])
    assert np.array_equal(got["head"], got["batch"][:, :head])
    monkeypatch.setenv("DELTASPEC_TEST_INVARIANT_BUG", "row_tiles")
    planted = _core.matmul_columns("cuda", w, type_name, x, batch_invariant=True, head_rows=head)
    assert not np.array_equal(planted["head"], planted["batch"][:, :head])
