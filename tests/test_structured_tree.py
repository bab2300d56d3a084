"""Structured output with draft trees: generate(grammar=..., tree_budget=N). Before verification the
tree is pruned (a node the grammar forbids after its path goes with its subtree, except a sampled
child, which stays as a leaf for the rejection rule to reject: TokenConstraint::prune_tree), and
each verify row is masked with the grammar's state after its node's path (mask_tree_rows). The
claims: greedy output is token-identical to plain greedy constrained decoding while the trees
branch and the grammar cuts nodes; sampled output keeps the plain constrained distribution.

Planted bugs (DELTASPEC_TEST_GRAMMAR_BUG, csrc/token_constraint.h) these tests were seen to fail with,
run by the tests themselves: "tree_row_unmasked" (node 0's verify row not masked: greedy output
parts from plain decoding or a forbidden token reaches commit), "drop_rejected" (a sampled child the
grammar forbids removed instead of kept for rejection: the chi-square test rejects). "verify_unmasked"
(no tree row masked) fails the greedy test too (GrammarError); "no_cut" (nothing pruned) fails it by
its cut count only: masked rows never accept a forbidden node, so the output stays plain decoding's.
A draft model grows its trees within the grammar unless DELTASPEC_DRAFT_IN_GRAMMAR=0 (then the
pruning above does the work); both ways are tested, and "draft_unmasked" (its rows left unmasked)
turns the within-grammar path assertions red (nodes cut).
"""

import os

import numpy as np
import pytest

from deltaspec import Grammar, Model
from deltaspec.constraint import GrammarConstraint
from deltaspec.errors import GrammarError
from deltaspec.gguf_file import read_gguf
from deltaspec.testing.json_schemas import BOUNDED_SCHEMAS
from deltaspec.testing.tiny_vocab import write_tiny_vocab_model
from sampling_reference import chi_square_p
from test_structured import DIST_PARAMS, DIST_PROMPT, _ascii_allowed, _second_token_marginal

BUG = "DELTASPEC_TEST_GRAMMAR_BUG"
SCHEMAS = {name: BOUNDED_SCHEMAS[name] for name in ("record", "text")}
PROMPTS = ["Hello", "the cat sat", "{"]
MAX_TOKENS = 200


def _scaled_copy(src, dst, name, factor):
    dst.write_bytes(src.read_bytes())
    info = read_gguf(dst).tensors[name]
    with open(dst, "r+b") as f:
        f.seek(info.offset)
        w = np.frombuffer(f.read(info.n_bytes), dtype=np.float32) * factor
        f.seek(info.offset)
        f.write(w.tobytes())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target; a draft that agrees with it in part (one FFN scaled by 1.5: its top-1 chain is
    often wrong where a sibling is right); a sharper copy of the target (sampled drafts)."""
    root = tmp_path_factory.mktemp("structured_tree")
    target_path = root / "target.gguf"
    write_tiny_vocab_model(target_path, seed=0)
    _scaled_copy(target_path, root / "draft.gguf", "blk.1.ffn_down.weight", 1.5)
    scale = {"blk.1.ffn_down.weight": 2.0, "output.weight": 2.0}
    write_tiny_vocab_model(root / "sharp.gguf", seed=0, weight_map=lambda name, x: x * scale.get(name, 1.0))
    kw = dict(n_ctx=512, n_threads=1, progress=False)
    loaded = {"target": Model(target_path, **kw), "draft": Model(root / "draft.gguf", **kw),
              "sharp": Model(root / "sharp.gguf", **kw)}
    yield loaded
    for m in loaded.values():
        m.close()


@pytest.fixture(scope="module")
def grammars():
    return {name: Grammar.from_json_schema(schema) for name, schema in SCHEMAS.items()}


def _greedy_pairs(models, grammars):
    """(plain, tree) greedy constrained generations for every schema and prompt."""
    target = models["target"]
    out = []
    for name in SCHEMAS:
        for prompt in PROMPTS:
            kw = dict(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammars[name])
            plain = target.generate(prompt, **kw)
            tree = target.generate(prompt, draft_model=models["draft"], draft_n_min=1, draft_n_max=6,
                                   tree_budget=12, **kw)
            out.append((name, prompt, plain, tree))
    return out


@pytest.mark.parametrize("in_grammar", [True, False], ids=["within-grammar", "unconstrained"])
def test_greedy_tree_speculation_equals_plain(models, grammars, in_grammar, monkeypatch):
    """Greedy constrained decoding with draft trees gives plain greedy constrained decoding's tokens
    for every schema and prompt; the trees branched (verify_rows ran batches with 2+ children),
    the grammar masked the tree rows, and drafts were accepted. The draft model grows its trees
    within the grammar (each node's row masked after its path: nothing left to prune) or, with
    DELTASPEC_DRAFT_IN_GRAMMAR=0, unconstrained (the grammar prunes nodes)."""
    if not in_grammar:
        monkeypatch.setenv("DELTASPEC_DRAFT_IN_GRAMMAR", "0")
    engine = models["target"]._live()
    before = dict(engine.rows_stats)
    cut = accepted = nodes = draft_rows = 0
    for name, prompt, plain, tree in _greedy_pairs(models, grammars):
        assert tree.tokens == plain.tokens, (name, prompt, tree.text, plain.text)
        assert tree.finish_reason == plain.finish_reason == "stop"
        cut += tree.stats.grammar_cut_tokens
        accepted += tree.stats.n_accepted
        nodes += tree.stats.n_tree_nodes
        draft_rows += tree.stats.grammar_draft_rows
    after = engine.rows_stats
    print(f"cut {cut}, draft rows {draft_rows}, accepted {accepted}, nodes {nodes}")
    assert after["branched_calls"] > before["branched_calls"], "no tree branched"
    if in_grammar:
        assert cut == 0 and draft_rows > 0, "the draft model did not draft within the grammar"
    else:
        assert cut > 0 and draft_rows == 0, "the grammar cut no draft node"
    assert accepted > 0 and nodes > 0


def test_unmasked_tree_row_is_caught(models, grammars, monkeypatch):
    """The greedy comparison above under DELTASPEC_TEST_GRAMMAR_BUG=tree_row_unmasked (node 0's row
    left unmasked): some generation differs from plain decoding or commits a forbidden token."""
    monkeypatch.setenv(BUG, "tree_row_unmasked")
    caught = 0
    target = models["target"]
    for name in SCHEMAS:
        for prompt in PROMPTS:
            kw = dict(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammars[name])
            plain = target.generate(prompt, **kw)
            try:
                tree = target.generate(prompt, draft_model=models["draft"], draft_n_min=1, draft_n_max=6,
                                       tree_budget=12, **kw)
                caught += tree.tokens != plain.tokens
            except GrammarError:
                caught += 1
    assert caught > 0


def test_prune_and_mask_a_tree(models, grammars):
    """The helpers on a hand-made tree under the record schema (first token must be '{'): a forbidden
    deterministic node goes with its subtree, a forbidden sampled one stays as a leaf (its subtree
    goes); each allowed node's row is masked with the state a fresh constraint has after committing
    its path, and row 0 with the state now."""
    tok = models["target"].tokenizer
    n_vocab = models["target"].n_vocab
    g = grammars["record"]
    brace, quote, i_, x = (tok.encode(s)[0] for s in ("{", '"', "i", "x"))
    # 0: '{'  1: '{' -> '"'  2: '{' -> '"' -> 'i'  3: 'x' (forbidden)  4: 'x' -> '{'  5: '{' -> 'x' (forbidden)
    tokens, parents = [brace, quote, i_, x, brace, x], [-1, 0, 1, -1, 3, 0]
    c = GrammarConstraint(tok, g)
    assert c.prune_tree(tokens, parents, sampled=False) == ([brace, quote, i_], [-1, 0, 1])
    assert c.prune_tree(tokens, parents, sampled=True) == ([brace, quote, i_, x, x], [-1, 0, 1, -1, 0])
    assert c.n_cut_tokens == 3 + 1
    kept_t, kept_p = [brace, quote, i_, brace], [-1, 0, 1, 0]  # a branch: node 3 is node 0's second child
    rows = np.zeros((len(kept_t) + 1, n_vocab), np.float32)
    c.mask_tree_rows(kept_t, kept_p, rows)
    paths = [[], [brace], [brace, quote], [brace, quote, i_], [brace, brace]]
    for r, path in enumerate(paths):
        if r == 4:  # '{' '{' is forbidden: its row is left as it was
            assert np.isfinite(rows[r]).all()
            continue
        fresh = GrammarConstraint(tok, g)
        for t in path:
            fresh.commit(t)
        row = np.zeros(n_vocab, np.float32)
        fresh.mask_row(row)
        assert np.array_equal(np.isfinite(rows[r]), np.isfinite(row)), r


# --- the sampled distribution ---------------------------------------------------------------------

N_SEEDS = 500


def _second_token_counts(models, grammar):
    target, counts, cut, draft_rows = models["target"], np.zeros(models["target"].n_vocab), 0, 0
    before = target._live().rows_stats["branched_calls"]
    for seed in range(N_SEEDS):
        r = target.generate(DIST_PROMPT, max_tokens=4, seed=seed, grammar=grammar, draft_model=models["sharp"],
                            draft_n_min=1, draft_n_max=3, tree_budget=6, **DIST_PARAMS)
        cut += r.stats.grammar_cut_tokens
        draft_rows += r.stats.grammar_draft_rows
        if len(r.tokens) > 1:
            counts[r.tokens[1]] += 1
    return counts, cut, target._live().rows_stats["branched_calls"] - before, draft_rows


@pytest.mark.parametrize("in_grammar", [True, False], ids=["within-grammar", "unconstrained"])
def test_sampled_tree_speculation_keeps_the_constrained_distribution(models, in_grammar, monkeypatch):
    """Sampled draft trees (children drawn from a sharper copy of the target without replacement)
    under a grammar that forbids about half of what the draft proposes unconstrained: the second
    token has the exact marginal of plain constrained sampling (chi-square over 500 seeds), with
    branched trees. Unconstrained (DELTASPEC_DRAFT_IN_GRAMMAR=0) nodes are cut, and the test is seen
    red with DELTASPEC_TEST_GRAMMAR_BUG=drop_rejected (forbidden sampled children removed instead
    of rejected), run here. Within the grammar the children are drawn from masked rows (nothing
    cut) and reported with the distribution they were drawn from, which leaves no mismatch to
    plant; its planted run (draft_unmasked: rows left unmasked) shows the path assertion failing
    (nodes cut), and the chi-square's power is the unconstrained run's."""
    if not in_grammar:
        monkeypatch.setenv("DELTASPEC_DRAFT_IN_GRAMMAR", "0")
    grammar = Grammar.from_regex(r"[ -~]*")
    expected = _second_token_marginal(models["target"], _ascii_allowed(models["target"]))
    counts, cut, branched, draft_rows = _second_token_counts(models, grammar)
    assert branched > 50
    assert (cut == 0 and draft_rows > 50) if in_grammar else (cut > 50 and draft_rows == 0)
    p_right = chi_square_p(counts, expected)
    os.environ[BUG] = "draft_unmasked" if in_grammar else "drop_rejected"
    try:
        planted, planted_cut, *_ = _second_token_counts(models, grammar)
    finally:
        del os.environ[BUG]
    if in_grammar:
        print(f"p right {p_right:.3g}; planted draft_unmasked: {planted_cut} nodes cut")
        assert p_right > 1e-3 and planted_cut > 50
        return
    p_planted = chi_square_p(planted, expected)
    print(f"p right {p_right:.3g}, planted {p_planted:.3g}")
    assert p_right > 1e-3
    assert p_planted < 1e-3
