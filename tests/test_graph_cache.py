"""The engine keeps a step graph per batch shape (csrc/step_graphs.cpp): speculation alternates
plain steps with verify batches of other row counts every round, and those rounds must run kept
graphs instead of rebuilding and re-allocating one at every change of shape.

The claims: (a) the tokens are exactly plain greedy decoding's (a kept graph is the right graph:
its shape, its slot); (b) after warm-up the alternating rounds build (almost) no graph: reuses
and switches between kept graphs happen, builds stay bounded, where keeping one graph (the
engine before the cache, DELTASPEC_GRAPH_CACHE=1) rebuilds at every switch; the cache's limits
hold. All on the tiny-vocabulary model on the CPU (F32 weights, seconds).

Planted bugs (DELTASPEC_TEST_GRAPH_BUG, csrc/step_graphs.cpp; each test's docstring says which
it was seen to fail with): "never_reuse" (every step builds its graph: the counts go red) and
"slot_key" (a one-sequence graph is reused for another slot of the same shape: it reads and
writes the first slot's state, the tokens go red).
"""

import os
from contextlib import contextmanager

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

N_CTX = 256
SPEC = dict(spec_type="ngram-simple", draft_n_max=8)


@contextmanager
def _env(**values):
    """The cache's limits are read when an engine is made."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_vocab_model(tmp_path_factory.mktemp("graphcache") / "tiny.gguf", seed=0)


@pytest.fixture(scope="module")
def model(path):
    with _env(DELTASPEC_GRAPH_CACHE=8, DELTASPEC_GRAPH_CACHE_MIB=1024):  # whatever the caller's environment
        m = Model(path, n_ctx=N_CTX, n_threads=1, n_seq_max=4)
    yield m
    m.close()


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    """Repetitive prompts of one length (prompt lookup drafts from them; the random model accepts
    some drafts and rejects others, so verify lengths vary and plain steps come between)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(32, 127, size=8).tolist() * 4 for _ in range(n)]


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ("builds", "reuses", "switches", "evictions")}


def test_one_sequence_alternating_shapes_reuse_graphs(model):
    """generate() with prompt lookup: plain one-row steps between verify batches of 2..9 rows.
    Every prompt gives plain greedy's tokens; after the first prompt (the warm-up) the rounds run
    kept graphs: switches between them in most rounds, at most 2 builds for 7 more prompts (a
    verify length not seen before), where one kept graph rebuilds ~80 times. Seen to fail with
    DELTASPEC_TEST_GRAPH_BUG=never_reuse."""
    prompts = _prompts(8)
    model.generate(prompts[0], max_tokens=64, temperature=0, **SPEC)  # warm-up: the shapes' graphs
    before = dict(model._engine.graph_stats)
    drafted = steps = 0
    for p in prompts[1:]:
        fast = model.generate(p, max_tokens=64, temperature=0, **SPEC)
        plain = model.generate(p, max_tokens=64, temperature=0)
        assert fast.tokens == plain.tokens and fast.finish_reason == plain.finish_reason
        drafted += fast.stats.n_drafted
        steps += fast.stats.n_steps
    d = _delta(model._engine.graph_stats, before)
    assert drafted > 0 and steps > drafted // 8  # verify batches and plain steps both ran
    assert d["switches"] > 50, d                # the rounds alternated between kept graphs
    assert d["builds"] <= 2, d
    assert d["reuses"] > 10 * max(1, d["builds"]), d
    assert model._engine.graph_stats["kept"] <= 8


def test_batch_alternating_shapes_reuse_graphs(model, path):
    """generate_batch with prompt lookup on 4 slots: plain passes of N rows (decode) between verify
    passes of N x Tq rows (verify_rows), N falling as sequences end. Each sequence gives the tokens
    of plain greedy generate() alone; the same batch run again switches between kept graphs and
    builds at most a few graphs (shapes the first run ran once, which left probation), where one
    kept graph rebuilds ~30 times. Seen to fail with DELTASPEC_TEST_GRAPH_BUG=never_reuse."""
    prompts = _prompts(4, seed=7)
    with Model(path, n_ctx=N_CTX, n_threads=1) as one:
        plain = [one.generate(p, max_tokens=48, temperature=0).tokens for p in prompts]
    for run in range(2):
        before = dict(model._engine.graph_stats)
        decode_before = model._engine.decode_stats["calls"]
        rows_before = model._engine.rows_stats["calls"]
        batch = model.generate_batch(prompts, max_tokens=48, temperature=0, **SPEC)
        for k, (b, p) in enumerate(zip(batch, plain)):
            assert b.tokens == p, f"prompt {k} (run {run}): the batch gave other tokens than plain greedy alone"
        assert model._engine.decode_stats["calls"] > decode_before   # plain passes of several slots
        assert model._engine.rows_stats["calls"] > rows_before       # and verify passes
        d = _delta(model._engine.graph_stats, before)
    assert d["switches"] > 10, d
    assert d["builds"] <= 4 + 2, d
    assert d["reuses"] > 5 * max(1, d["builds"]), d


def test_slots_of_one_shape_run_their_own_graphs(model, path):
    """One-sequence steps of one shape in 4 slots in turn (a prompt chunk each, then a token each,
    round-robin: what a scheduler feeding each prompt alone does): a graph names its slot's state,
    so each slot runs a graph of its own, and each slot's logits are a one-slot engine's on that
    slot's tokens alone. The 4 slots' one-row graphs come back after more others than probation
    holds: the cache remembers the evicted keys, so from the third round on every step runs a kept
    graph. Seen to fail with DELTASPEC_TEST_GRAPH_BUG=slot_key (slot 1..3's steps ran slot 0's
    graph, on slot 0's state: the logits) and =never_reuse (the counts)."""
    engine = model._engine
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 256, size=13).tolist() for _ in range(4)]
    for s in range(4):
        engine.reset_slot(s)
    got = [[engine.eval_in_slot(s, seqs[s][:8])] for s in range(4)]
    for t in range(8, 13):
        if t == 10:
            before = dict(engine.graph_stats)
        for s in range(4):
            got[s].append(engine.eval_in_slot(s, seqs[s][t:t + 1]))
    d = _delta(engine.graph_stats, before)
    with Model(path, n_ctx=N_CTX, n_threads=1) as one:
        for s in range(4):
            one._engine.reset()
            want = [one._engine.eval(seqs[s][:8])] + [one._engine.eval(seqs[s][t:t + 1]) for t in range(8, 13)]
            for step, (g, w) in enumerate(zip(got[s], want)):
                np.testing.assert_array_equal(g, w, err_msg=f"slot {s}, step {step}")
    assert d["builds"] == 0 and d["switches"] == 3 * 4, d  # rounds 3-5: each step another slot's kept graph


def test_limits_and_one_graph_as_before(path):
    """The same speculative generations with the cache's limits at 1 graph (the engine before the
    cache: only the last graph kept), 3 graphs, and 8 graphs but no bytes for graphs besides the
    last (DELTASPEC_GRAPH_CACHE_MIB=0): the same tokens every way; the limits hold (graphs kept,
    evictions); one graph rebuilds at every switch, many times what the default cache builds.
    Seen to fail with DELTASPEC_TEST_GRAPH_BUG=never_reuse (the default builds as often as one graph)."""
    prompts = _prompts(4, seed=11)
    runs = {}
    for name, env in (("default", dict(DELTASPEC_GRAPH_CACHE=8, DELTASPEC_GRAPH_CACHE_MIB=1024)),
                      ("one", dict(DELTASPEC_GRAPH_CACHE=1, DELTASPEC_GRAPH_CACHE_MIB=1024)),
                      ("three", dict(DELTASPEC_GRAPH_CACHE=3, DELTASPEC_GRAPH_CACHE_MIB=1024)),
                      ("no_bytes", dict(DELTASPEC_GRAPH_CACHE=8, DELTASPEC_GRAPH_CACHE_MIB=0))):
        with _env(**env):
            m = Model(path, n_ctx=N_CTX, n_threads=1)
        with m:
            tokens, kept = [], []
            for p in prompts:
                tokens.append(m.generate(p, max_tokens=48, temperature=0, **SPEC).tokens)
                kept.append(m._engine.graph_stats["kept"])
            runs[name] = (tokens, max(kept), dict(m._engine.graph_stats))
    tokens, _, default = runs["default"]
    for name in ("one", "three", "no_bytes"):
        assert runs[name][0] == tokens, f"{name}: other tokens than the default cache's"
    assert default["max_graphs"] == 8 and default["max_kept_bytes"] == 1024 << 20
    assert runs["no_bytes"][2]["max_kept_bytes"] == 0
    assert runs["one"][1] == 1 and runs["no_bytes"][1] == 1 and runs["three"][1] <= 3
    for name in ("one", "three", "no_bytes"):
        assert runs[name][2]["evictions"] > 0, name
    assert runs["one"][2]["switches"] == 0
    assert runs["one"][2]["builds"] >= 5 * default["builds"], (runs["one"][2], default)
    assert runs["no_bytes"][2]["builds"] == runs["one"][2]["builds"]
    assert runs["three"][2]["builds"] < runs["one"][2]["builds"]


def test_bad_limit_is_refused(path):
    """A cache of no graphs cannot run a step: refused with the variable's name."""
    with _env(DELTASPEC_GRAPH_CACHE=0):
        with pytest.raises(ValueError, match="DELTASPEC_GRAPH_CACHE"):
            Model(path, n_ctx=N_CTX, n_threads=1)
