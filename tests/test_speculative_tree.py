"""Tree speculation end to end: generate(..., tree_budget=N) drafts trees (csrc/draft_tree.h), verifies
each in one target pass (Engine::verify_rows, the scheduler's verify of one sequence), walks it
(csrc/tree_walk.h) and keeps the accepted path (Engine::keep_paths). The claim: greedy output is exactly plain greedy's, with the draft model
and with prompt lookup, while the trees really branch and paths off the top-1 chain are accepted
(their KV rows then move).

Planted bugs (DELTASPEC_TEST_TREE_BUG, csrc/rows.h) seen to turn these tests red (the
output parts from plain greedy): sibling_visible, row_position, no_compaction and parent_state each
make test_tree_speculation_greedy_is_lossless[draft] fail; parent_state [ngram], whose nearly
context-free model (below) does not notice the attention bugs (no_compaction among them: the KV rows
moved are counted whether or not they move); no_compaction and parent_state
test_tree_speculation_with_penalties_is_lossless.
"""

import shutil

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.gguf_file import read_gguf
from deltaspec.testing.tiny_vocab import cycle_prompt, write_tiny_vocab_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target and a draft that agrees with it in part (one FFN scaled by 1.5): its top-1 chain
    is often wrong where a sibling is right, which is what trees are for."""
    root = tmp_path_factory.mktemp("spec_tree")
    write_tiny_vocab_model(root / "target.gguf", seed=0)
    shutil.copyfile(root / "target.gguf", root / "draft.gguf")
    info = read_gguf(root / "draft.gguf").tensors["blk.1.ffn_down.weight"]
    with open(root / "draft.gguf", "r+b") as f:
        f.seek(info.offset)
        w = np.frombuffer(f.read(info.n_bytes), dtype=np.float32) * 1.5
        f.seek(info.offset)
        f.write(w.tobytes())
    kw = dict(n_ctx=512, n_threads=1)
    with Model(root / "target.gguf", **kw) as target, Model(root / "draft.gguf", **kw) as draft:
        yield target, draft


@pytest.fixture(scope="module")
def repeating(tmp_path_factory):
    """A model whose next token depends mostly on the current one (its residual branches scaled by
    0.15): its greedy text falls into a cycle, which prompt lookup can draft, yet the recurrent
    state still matters (a wrong commit changes its output)."""
    path = write_tiny_vocab_model(tmp_path_factory.mktemp("spec_tree_rep") / "rep.gguf", seed=0, branch_scale=0.15)
    with Model(path, n_ctx=256, n_threads=1) as model:
        yield model


def _prompts(n):
    rng = np.random.default_rng(5)
    return [rng.integers(0, 256, size=int(rng.integers(2, 24))).tolist() for _ in range(n)]


def _ngram_prompts(model):
    """The model's cycle twice, then its first three tokens followed by a decoy, then those three
    again: prompt lookup's most recent match drafts the decoy first, older matches the cycle (a
    branch), which the target accepts."""
    out = []
    for start in (44, 56):
        cycle = cycle_prompt(model, start)
        cycle = cycle[:len(cycle) // 2]
        out.append(cycle * 2 + cycle[:3] + [7, 8, 9] + cycle[:3])
    return out


@pytest.mark.parametrize("drafter", ["draft", "ngram"])
def test_tree_speculation_greedy_is_lossless(models, repeating, drafter):
    """Greedy tree speculation gives plain greedy's tokens; the trees branched, the rows ops ran, and
    paths off the top-1 chain were accepted (KV rows moved)."""
    target, draft = models
    if drafter == "draft":
        model, prompts, spec = target, _prompts(6), dict(draft_model=draft, draft_n_min=1)
    else:
        model, prompts, spec = repeating, _ngram_prompts(repeating), dict(spec_type="ngram-simple")
    engine = model._live()
    before = dict(engine.rows_stats)
    n_nodes = n_rounds = 0
    for prompt in prompts:
        plain = model.generate(prompt, max_tokens=40, temperature=0)
        fast = model.generate(prompt, max_tokens=40, temperature=0, draft_n_max=6, tree_budget=12, **spec)
        assert fast.tokens == plain.tokens
        assert fast.finish_reason == plain.finish_reason
        s = fast.stats
        n_nodes += s.n_tree_nodes
        n_rounds += len(s.accepted_lengths)
        assert sum(s.accepted_lengths) == s.n_accepted
    after = engine.rows_stats
    # every round verified its tree (or chain) in one pass
    assert 0 < after["calls"] - before["calls"] <= n_rounds
    assert after["branched_calls"] > before["branched_calls"]
    assert after["kv_rows_moved"] > before["kv_rows_moved"]  # an accepted path left the top-1 chain
    assert n_nodes > 6 * n_rounds // 2  # more nodes than the chains would have held


def test_tree_speculation_with_penalties_is_lossless(models):
    """With a repeat penalty the walk reads every row's logits on the host (not the device argmax)
    and applies the penalty along each path: still plain greedy's tokens."""
    target, draft = models
    n_nodes = 0
    for prompt in _prompts(4):
        kw = dict(max_tokens=32, temperature=0, repeat_penalty=1.3)
        plain = target.generate(prompt, **kw)
        fast = target.generate(prompt, draft_model=draft, draft_n_max=6, draft_n_min=1, tree_budget=10, **kw)
        assert fast.tokens == plain.tokens
        n_nodes += fast.stats.n_tree_nodes
    assert n_nodes > 0


def test_tree_budget_arguments(models):
    target, draft = models
    with pytest.raises(ValueError, match="tree_budget must be an integer in"):
        target.generate([1, 2], max_tokens=4, draft_model=draft, tree_budget=-1)
    with pytest.raises(ValueError, match="pass draft_model or spec_type too"):
        target.generate([1, 2], max_tokens=4, tree_budget=8)
    with pytest.raises(ValueError, match="pass draft_model or spec_type too"):
        target.generate_batch([[1, 2]], max_tokens=4, tree_budget=8)
