"""Several sequences on one engine: Model(n_seq_max=N), generate_batch, add_request / step /
cancel_request, batched decoding of rows of several slots (Engine::decode), kv_cache_info per slot.

The claim: each sequence of a batch gives exactly the tokens it gives alone with generate(),
greedy and seeded sampling alike. On the CPU with the tiny-vocabulary model (F32 weights, which
ggml-cpu multiplies row by row whatever the batch width) the batched logits are bitwise the
single-sequence ones, so the tokens must be identical, not merely close (one thread, or on 2+
threads with batch_invariant=True: past 256 tokens ggml-cpu's default splits a lone sequence's
attention over the threads, test_batched_rows_past_256_tokens_on_two_threads_need_batch_invariant).

Planted bugs (DELTASPEC_TEST_BATCH_BUG, csrc/rows.h) each test was seen to fail with:
"shared_slot" (every row of a batch starts from the first row's recurrent state), "position"
(rows after the first one position off), "no_move" (a sequence moved into a freed slot keeps
the freed slot's state), "no_reset" (a sequence admitted into a slot without emptying it).
"""

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

N_CTX = 512


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_vocab_model(tmp_path_factory.mktemp("batch") / "tiny.gguf", seed=0)


@pytest.fixture(scope="module")
def models(path):
    """The same file with 1 slot (the reference: generate() alone) and with 4 slots."""
    with Model(path, n_ctx=N_CTX, n_threads=1) as one, Model(path, n_ctx=N_CTX, n_threads=1, n_seq_max=4) as four:
        yield one, four


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(2, 40))).tolist() for _ in range(n)]


def _solo(model, prompt, options):
    return model.generate(prompt, **options)


def _assert_same(batch, solo):
    for k, (b, s) in enumerate(zip(batch, solo)):
        assert b.tokens == s.tokens, f"prompt {k}: the batch gave other tokens than generate() alone"
        assert b.finish_reason == s.finish_reason, f"prompt {k}"
        assert b.text == s.text, f"prompt {k}"


def test_batch_greedy_equals_generate_alone(models):
    """7 prompts of 2..39 tokens (one of 500) on 4 slots (3 wait for a slot), each with its own
    max_tokens (the long one runs until the context is full) or stop string: every one gives
    generate()'s tokens, text and finish reason. Seen to fail with DELTASPEC_TEST_BATCH_BUG=shared_slot,
    =no_move and =no_reset (=position, one RoPE position off, left greedy's tokens unchanged here:
    the logits test and the sampling test catch it)."""
    one, four = models
    prompts = _prompts(7)
    per_prompt = [dict(max_tokens=n) for n in (24, 5, 40, 1, 17, 33, 12)]
    prompts[2] = np.random.default_rng(0).integers(0, 256, size=N_CTX - 12).tolist()
    per_prompt[2] = dict(max_tokens=None)                   # until the context is full
    per_prompt[4] = dict(max_tokens=60, stop=["\x9a", "e"])  # a stop string (byte tokens render as bytes)
    before = dict(four._engine.decode_stats)
    batch = four.generate_batch(prompts, per_prompt=per_prompt, temperature=0)
    after = four._engine.decode_stats
    solo = [_solo(one, p, dict(temperature=0, **o)) for p, o in zip(prompts, per_prompt)]
    _assert_same(batch, solo)
    assert after["max_rows"] == 4, "no decode batch held 4 sequences"
    assert after["calls"] > before["calls"]
    assert {r.finish_reason for r in batch} == {"length", "stop"}
    assert batch[2].finish_reason == "length" and len(batch[2].tokens) == N_CTX - len(prompts[2]) + 1


def test_batch_sampling_equals_generate_alone(models):
    """Seeded sampling (each prompt its own seed, one greedy and one with a repeat penalty among
    them, so a batch mixes samplers): every sequence draws generate()'s tokens. Seen to fail with
    DELTASPEC_TEST_BATCH_BUG=shared_slot, =position, =no_move and =no_reset."""
    one, four = models
    prompts = _prompts(6, seed=8)
    common = dict(max_tokens=30, temperature=0.9, top_k=50, top_p=0.97, min_p=0.0)
    per_prompt = [dict(seed=100 + k) for k in range(6)]
    per_prompt[1] = dict(temperature=0)
    per_prompt[3] = dict(seed=7, repeat_penalty=1.3)
    batch = four.generate_batch(prompts, per_prompt=per_prompt, **common)
    solo = [_solo(one, p, {**common, **o}) for p, o in zip(prompts, per_prompt)]
    _assert_same(batch, solo)


def test_batched_logits_are_the_single_sequence_logits(models):
    """Teacher-forced: 4 slots prefilled with prompts of different lengths, then 6 batched steps
    (Engine::decode, one row per slot); each row's logits equal, bitwise, those of the same tokens
    evaluated alone. Seen to fail with DELTASPEC_TEST_BATCH_BUG=shared_slot and =position."""
    one, four = models
    prompts = _prompts(4, seed=11)
    rng = np.random.default_rng(2)
    steps = rng.integers(0, 256, size=(6, 4))
    engine = four._engine
    for slot, p in enumerate(prompts):
        engine.reset_slot(slot)
        engine.eval_in_slot(slot, p, "none")
    batched = np.stack([engine.decode_slots(row) for row in steps])  # (6, 4, n_vocab)
    for slot, p in enumerate(prompts):
        alone = one.logits(p + steps[:, slot].tolist())[len(p):]
        assert np.array_equal(batched[:, slot], alone), f"slot {slot}"
        assert engine.slot_n_past(slot) == len(p) + len(steps)


def _batched_minus_alone(model: Model, context: int) -> float:
    """max |logits| difference of one batched step of 2 slots against the same tokens stepped in
    each slot alone, after `context` tokens in each slot."""
    engine, rng = model._engine, np.random.default_rng(4)
    history = [rng.integers(0, 256, size=context).astype(np.int32) for _ in range(2)]
    step = rng.integers(0, 256, size=2).astype(np.int32)
    for slot in range(2):
        engine.reset_slot(slot)
        engine.eval_in_slot(slot, history[slot], "none")
    batched = engine.decode_slots(step)
    alone = []
    for slot in range(2):
        engine.reset_slot(slot)
        engine.eval_in_slot(slot, history[slot], "none")
        alone.append(engine.eval_in_slot(slot, step[slot:slot + 1], "last")[-1])
    return float(np.abs(batched - np.stack(alone)).max())


def test_batched_rows_past_256_tokens_on_two_threads_need_batch_invariant(path):
    """On 2+ threads ggml-cpu splits a lone sequence's one-row attention over the threads once its
    KV cache (padded to 256 rows) reaches 512 cells, which a batch of several sequences does not:
    past 256 tokens a batched row then differs from the same row alone in the last bits (measured
    5e-4 here), so greedy batch output can part from generate() at a near-tie. With
    batch_invariant=True the rows are bitwise the same. The default's difference is asserted too:
    it is the planted bug of the invariant case (the option left out), seen to fail there."""
    with Model(path, n_ctx=N_CTX, n_threads=2, n_seq_max=2, batch_invariant=True) as m:
        assert _batched_minus_alone(m, 300) == 0.0
    with Model(path, n_ctx=N_CTX, n_threads=2, n_seq_max=2) as m:
        assert _batched_minus_alone(m, 200) == 0.0  # KV cells read: 256, no split
        assert _batched_minus_alone(m, 300) > 0.0


def test_requests_stepped_and_one_cancelled(models):
    """add_request / step / cancel_request: 5 requests on 4 slots; one is cancelled after 3
    steps (finish "cancelled", its tokens a prefix of what it gives alone), which frees a slot
    for the waiting one; the others give generate()'s tokens. One-sequence calls are refused while
    requests run. Seen to fail with DELTASPEC_TEST_BATCH_BUG=no_move (the sequence moved into the
    cancelled one's slot continues from the wrong state) and =shared_slot."""
    one, four = models
    prompts = _prompts(5, seed=21)
    ids = [four.add_request(p, max_tokens=25, temperature=0) for p in prompts]
    got: dict[int, list[int]] = {i: [] for i in ids}
    results = {}
    n_steps = 0
    while four.has_unfinished_requests:
        if n_steps == 3:
            four.cancel_request(ids[1])
            with pytest.raises(RuntimeError, match="add_request"):
                four.generate(prompts[0], max_tokens=2)
        for out in four.step():
            got[out.request_id] += out.tokens
            if out.finished:
                results[out.request_id] = out.result
        n_steps += 1
    assert set(results) == set(ids)
    for k, (i, p) in enumerate(zip(ids, prompts)):
        alone = one.generate(p, max_tokens=25, temperature=0)
        assert results[i].tokens == got[i]
        if k == 1:
            assert results[i].finish_reason == "cancelled"
            assert 0 < len(got[i]) < len(alone.tokens) and got[i] == alone.tokens[:len(got[i])]
        else:
            assert got[i] == alone.tokens, f"request {k}"
            assert results[i].finish_reason == alone.finish_reason
    # the engine is free again for one-sequence calls
    assert four.generate(prompts[0], max_tokens=3, temperature=0).tokens == \
        one.generate(prompts[0], max_tokens=3, temperature=0).tokens


def test_one_slot_runs_the_prompts_in_turn(models):
    """n_seq_max=1: generate_batch queues every prompt behind the one before (batches of one).
    Seen to fail with DELTASPEC_TEST_BATCH_BUG=no_reset (a prompt admitted into the slot the one
    before it left)."""
    one, _ = models
    prompts = _prompts(3, seed=30)
    batch = one.generate_batch(prompts, max_tokens=9, temperature=0.7, seed=5)
    _assert_same(batch, [_solo(one, p, dict(max_tokens=9, temperature=0.7, seed=5)) for p in prompts])


@pytest.mark.parametrize("bad", [0, -1, 257, 1.5, True, "4", None])
def test_n_seq_max_is_validated(path, bad):
    """Seen to fail with the n_seq_max check in Model.__init__ removed (0 and -1 then met the
    engine's terser message, 257 and True were taken, 1.5, "4" and None failed with TypeError)."""
    with pytest.raises(ValueError, match=r"n_seq_max must be an integer in \[1, 256\]"):
        Model(path, n_ctx=256, n_seq_max=bad)


def test_kv_cache_info_per_slot(path, models):
    """Each of 4 slots holds what the one slot of n_seq_max=1 holds; the totals are 4 times it.
    Seen to fail with allocated_state counting slot 0 only in its totals."""
    one, four = models
    single, info = one.kv_cache_info(), four.kv_cache_info()
    assert single["n_seq_max"] == 1 and info["n_seq_max"] == 4
    assert [s["slot"] for s in info["slots"]] == [0, 1, 2, 3]
    for s in info["slots"]:
        assert s["kv_bytes"] == single["kv_bytes"] > 0
        assert s["recurrent_bytes"] == single["recurrent_bytes"] > 0
        assert s["total_bytes"] == single["total_bytes"]
    assert info["attention_layers"] == single["attention_layers"]
    assert info["recurrent_layers"] == single["recurrent_layers"]
    for key in ("k_bytes", "v_bytes", "kv_bytes", "recurrent_bytes", "total_bytes"):
        assert info[key] == 4 * single[key], key
    assert info["kv_bytes"] == sum(s["kv_bytes"] for s in info["slots"])


def test_batch_refuses_what_it_cannot_run(models):
    """A draft model with fewer slots than the target (chains or trees), the MTP head of a model
    without one (the refused request is not left queued), streaming and unknown arguments are
    refused with errors naming them (a bad prompt by its index). Seen to fail with the checks in
    Model._batch_request removed (a draft model was ignored), and without generate_batch's index."""
    one, four = models
    with pytest.raises(ValueError, match="n_seq_max = 1"):
        four.generate_batch([[1, 2, 3]], draft_model=one, tree_budget=4)
    with pytest.raises(ValueError, match="MTP layer"):
        four.add_request([1, 2, 3], spec_type="mtp")
    assert not four.has_unfinished_requests
    with pytest.raises(ValueError, match="n_seq_max = 1"):
        four.generate_batch([[1, 2, 3]], draft_model=one)
    with pytest.raises(ValueError, match="stream"):
        four.generate_batch([[1, 2, 3]], stream=True)
    with pytest.raises(TypeError, match="'n_tokens'"):
        four.generate_batch([[1, 2, 3]], n_tokens=3)
    with pytest.raises(TypeError, match="per_prompt"):
        four.generate_batch([[1, 2, 3], [4]], per_prompt=[{}])
    with pytest.raises(ValueError, match=r"^prompts\[1\]: token id 100000 .*vocabulary"):  # which prompt
        four.generate_batch([[1, 2, 3], [1, 2, 100000]])
    with pytest.raises(ValueError, match=r"^prompts\[0\]: the prompt is empty"):
        four.generate_batch(["", "a"])


@pytest.mark.parametrize("type_name", ["q4_K", "q6_K"])
def test_k_quant_products_of_a_batch_need_batch_invariant(type_name):
    """A K-quant weight product of 12 columns at once against each column alone (the probe that
    bench/invariance_probe.py --products runs on the GPU, here on the CPU backend): with the
    backend registered as Model(batch_invariant=True) registers it, bitwise at every K; without it,
    ggml-cpu's batched path differs in the last bits. The default's difference is the planted bug
    of the invariant case (the registration left out), seen to fail there."""
    from deltaspec import _core

    rng = np.random.default_rng(1)
    for k in (1024, 2048):
        w = rng.standard_normal((256, k), dtype=np.float32)
        x = rng.standard_normal((12, k), dtype=np.float32)
        ref = x @ w.T
        invariant = _core.matmul_columns("cpu", w, type_name, x, batch_invariant=True)
        default = _core.matmul_columns("cpu", w, type_name, x)
        assert np.array_equal(invariant["batch"], invariant["alone"]), k
        assert np.abs(default["batch"] - default["alone"]).max() > 0.0, k
        for got in (invariant["batch"], default["batch"]):  # a product of the quantized weights
            assert np.abs(got - ref).max() < 0.2 * np.abs(ref).max(), k


def test_matmul_columns_head_rows_is_the_part_alone():
    """matmul_columns' head (the product of W's first rows alone, which the GPU test of stacked
    products compares with the stack's rows) on the CPU: the invariant mode's head is bitwise the
    stack's first rows, for every column, and a head outside 1 .. rows - 1 is refused by name.
    Seen to fail with the head's product given all of W's rows (its shape, then its values)."""
    from deltaspec import _core

    rng = np.random.default_rng(2)
    w = rng.standard_normal((512, 1024), dtype=np.float32)
    x = rng.standard_normal((5, 1024), dtype=np.float32)
    got = _core.matmul_columns("cpu", w, "q4_K", x, batch_invariant=True, head_rows=192)
    assert got["head"].shape == (5, 192)
    assert np.array_equal(got["head"], got["batch"][:, :192])
    assert "head" not in _core.matmul_columns("cpu", w[:64], "q4_K", x)
    for bad in (-1, 512, 600):
        with pytest.raises(ValueError, match="head_rows"):
            _core.matmul_columns("cpu", w, "q4_K", x, head_rows=bad)


def test_node_differences_find_where_a_batch_parts(tmp_path):
    """node_differences (the step graphs' nodes captured as computed, bench/invariance_probe.py
    --nodes) matches a batch graph's nodes to the one-token steps' and compares their rows: with
    batch_invariant=True on this Q4_K model nothing differs (and enough nodes are compared: the path
    ran), without it the first node that differs is the first weight product, whose batched CPU
    kernel sums in another order. Seen to fail with nodes matched by op and width only (7 products
    of the invariant batch then compared with other products of the steps)."""
    from deltaspec.testing.batch_rows import batch_vs_steps, node_differences

    path = write_tiny_vocab_model(tmp_path / "q4k.gguf", quant="q4_k", n_embd=1024, n_ff=1024)
    for invariant in (True, False):
        with Model(path, n_threads=2, batch_invariant=invariant) as m:
            parts = batch_vs_steps(m, 12, 0, np.random.default_rng(0))
            nodes = node_differences(m, 12, 0, np.random.default_rng(0))
        differing = [n for n in nodes if n["max_diff"] > 0]
        assert len(nodes) >= 30
        if invariant:
            assert parts == 0.0 and differing == []
        else:
            assert parts > 0.0 and differing[0]["op"] == "MUL_MAT" and differing[0]["source"].startswith("blk.0.")
