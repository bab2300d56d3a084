"""Speculative decoding: lossless greedy, reproducible sampling, rollback equals plain decoding,
stats. (That sampling is lossless is tested against exact marginals in
test_speculative_sampling.py.)

All on tiny-vocabulary models (fast): the target, a second load of the same file (self-draft),
an unrelated random model, and the target with one layer's weights perturbed.
"""

import shutil

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.gguf_file import read_gguf
from deltaspec.testing.tiny_vocab import cycle_prompt, write_tiny_vocab_model

N_PROMPTS, N_TOKENS = 50, 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    write_tiny_vocab_model(root / "target.gguf", seed=0)
    write_tiny_vocab_model(root / "random.gguf", seed=1)
    shutil.copyfile(root / "target.gguf", root / "perturbed.gguf")
    info = read_gguf(root / "perturbed.gguf").tensors["blk.1.ffn_down.weight"]
    with open(root / "perturbed.gguf", "r+b") as f:  # an agreeing-in-part draft: one FFN rescaled
        f.seek(info.offset)
        w = np.frombuffer(f.read(info.n_bytes), dtype=np.float32) * 3.0
        f.seek(info.offset)
        f.write(w.tobytes())
    kw = dict(n_ctx=512, n_threads=1)
    loaded = {name: Model(root / f"{name}.gguf", **kw) for name in ("target", "random", "perturbed")}
    loaded["self"] = Model(root / "target.gguf", **kw)
    yield loaded
    for m in loaded.values():
        m.close()


def _prompts(repetitive: bool = False) -> list[list[int]]:
    rng = np.random.default_rng(5)
    out = []
    for _ in range(N_PROMPTS):
        if repetitive:
            unit = rng.integers(32, 127, size=rng.integers(4, 12)).tolist()
            out.append(unit * 4)
        else:
            out.append(rng.integers(0, 256, size=rng.integers(2, 24)).tolist())
    return out


@pytest.mark.parametrize("drafter", ["self", "random", "perturbed", "ngram"])
def test_greedy_is_lossless(models, drafter):
    target = models["target"]
    spec = dict(spec_type="ngram-simple") if drafter == "ngram" else dict(draft_model=models[drafter])
    drafted = accepted = 0
    for prompt in _prompts(repetitive=drafter == "ngram"):
        plain = target.generate(prompt, max_tokens=N_TOKENS, temperature=0)
        fast = target.generate(prompt, max_tokens=N_TOKENS, temperature=0, draft_n_max=8, **spec)
        assert fast.tokens == plain.tokens
        assert fast.finish_reason == plain.finish_reason
        drafted += fast.stats.n_drafted
        accepted += fast.stats.n_accepted
    assert drafted > 0
    rate = accepted / drafted
    print(f"{drafter}: acceptance {rate:.3f}")
    if drafter == "self":
        assert accepted == drafted  # the target drafting for itself: everything is accepted
    if drafter == "random":
        assert rate < 0.3
    if drafter == "perturbed":
        assert 0.05 < rate < 1.0
    if drafter == "ngram":
        # random weights do not copy their prompt, so prompt lookup is right only sometimes
        # (measured 0.16); what matters here is that its drafts are verified losslessly
        assert rate > 0.05


def test_greedy_with_penalties_is_lossless(models):
    # penalties reshape the logits, so greedy verification goes through the host-side sampler
    # instead of the device argmax; both paths must give plain greedy's tokens
    target = models["target"]
    params = dict(temperature=0, repeat_penalty=1.3, frequency_penalty=0.2, max_tokens=48)
    for prompt in _prompts()[:10]:
        plain = target.generate(prompt, **params)
        for draft in (models["self"], models["perturbed"]):
            fast = target.generate(prompt, draft_model=draft, draft_n_max=6, draft_n_min=1, **params)
            assert fast.tokens == plain.tokens


def test_longest_verify_batch(models):
    # a 256-token verify: keep() replays 100 tokens of every DeltaNet layer's recurrence from the
    # graph's outputs (a graph sized too small once aborted inside ggml's scheduler)
    target = models["target"]
    batch = np.random.default_rng(3).integers(0, 256, size=256).astype(np.int32)
    want = target.logits([5, 6] + batch.tolist())[2:]
    engine = target._live()
    engine.reserve_slots(256)
    target.reset()
    target.eval([5, 6])
    got = engine.eval_verify(batch)
    assert np.abs(got - want).max() <= 1e-4
    engine.keep(100)
    assert target.n_past == 102
    # the kept state is the one after token 100 (f16 KV rows: batch splits round a little apart;
    # one token off would move the logits by their whole spread)
    assert np.abs(target.eval([7]) - target.logits([5, 6] + batch[:100].tolist() + [7])[-1]).max() <= 5e-3


def test_seeded_speculative_sampling_is_reproducible(models):
    target = models["target"]
    for draft in (dict(draft_model=models["perturbed"]), dict(spec_type="ngram-simple")):
        runs = [target.generate([72, 101, 108], max_tokens=48, temperature=0.9, seed=11, draft_n_max=6, **draft)
                for _ in range(2)]
        assert runs[0].tokens == runs[1].tokens
        assert runs[0].stats.n_drafted == runs[1].stats.n_drafted > 0


def test_stats_self_draft(models):
    target = models["target"]
    r = target.generate([10, 20, 30], max_tokens=40, temperature=0, draft_model=models["self"], draft_n_max=6)
    s = r.stats
    assert s.n_accepted == s.n_drafted > 0 and s.acceptance_rate == 1.0
    assert s.mean_acceptance_length > 3.0
    assert s.n_steps < len(r.tokens)
    assert s.verify_seconds > 0 and s.draft_seconds > 0


def test_ngram_acceptance_on_repeating_text(tmp_path):
    # with its residual branches zeroed, the model's next token depends on the current one only:
    # its text repeats, and a prompt that is its own cycle twice is continued by the same cycle
    path = write_tiny_vocab_model(tmp_path / "repeating.gguf", seed=0, branch_scale=0.0)
    with Model(path, n_ctx=256, n_threads=1) as model:
        for start in (32, 64):
            prompt = cycle_prompt(model, start)
            plain = model.generate(prompt, max_tokens=48, temperature=0)
            fast = model.generate(prompt, max_tokens=48, temperature=0, spec_type="ngram-simple", draft_n_max=8)
            assert fast.tokens == plain.tokens
            s = fast.stats
            print(f"cycle {len(prompt) // 2}: acceptance {s.acceptance_rate:.3f}, "
                  f"mean length {s.mean_acceptance_length:.2f}")
            assert s.acceptance_rate > 0.9
            assert s.mean_acceptance_length > 3.0  # tokens per target pass (at most 9 here)


def _state(model):
    return model._live().state_arrays()


def test_rollback_equals_plain_decoding(tmp_path):
    path = tmp_path / "t.gguf"
    write_tiny_vocab_model(path, seed=0)
    kw = dict(n_ctx=256, n_threads=1, type_k="f32", type_v="f32")
    with Model(path, **kw) as spec, Model(path, **kw) as plain:
        spec._live().reserve_slots(8)
        prefix = [5, 77, 120, 33, 9]
        batch = [40, 41, 42, 43, 44, 45]
        for n_keep in (1, 3, 6):
            spec.reset()
            spec.eval(prefix)
            engine = spec._live()
            engine.eval_verify(np.array(batch, dtype=np.int32))
            engine.keep(n_keep)
            plain.reset()
            plain.eval(prefix + batch[:n_keep])
            assert spec.n_past == plain.n_past == len(prefix) + n_keep
            got, want = _state(spec), _state(plain)
            n_rows = spec.n_past
            for key in want:
                a = np.frombuffer(got[key], dtype=np.float32)
                b = np.frombuffer(want[key], dtype=np.float32)
                if key[0] in "kv":  # KV rows past n_past are dead (masked, overwritten later)
                    a = a.reshape(spec.n_ctx, -1)[:n_rows]
                    b = b.reshape(plain.n_ctx, -1)[:n_rows]
                assert np.abs(a - b).max() <= 1e-5, f"{key} after keeping {n_keep}"
            # and the next step computes the same logits
            assert np.abs(spec.eval([99]) - plain.eval([99])).max() <= 1e-4


def test_verify_without_keep_keeps_every_token(tmp_path):
    # a verify batch followed by anything but keep() (the next step, a state read) leaves the
    # sequence with all of its tokens
    path = write_tiny_vocab_model(tmp_path / "t.gguf", seed=0)
    kw = dict(n_ctx=256, n_threads=1, type_k="f32", type_v="f32")
    prefix, batch = [5, 77, 120, 33, 9], [40, 41, 42, 43]
    with Model(path, **kw) as spec, Model(path, **kw) as plain:
        spec._live().reserve_slots(8)
        plain.eval(prefix + batch)
        for then in ("state", "step"):
            spec.reset()
            spec.eval(prefix)
            spec._live().eval_verify(np.array(batch, dtype=np.int32))
            assert spec.n_past == len(prefix) + len(batch)
            if then == "state":
                got, want = _state(spec), _state(plain)
                for key in (k for k in want if k.startswith("ssm")):
                    a, b = (np.frombuffer(d[key], dtype=np.float32) for d in (got, want))
                    assert np.abs(a - b).max() <= 1e-5, key
            assert np.abs(spec.eval([99]) - plain.logits(prefix + batch + [99])[-1]).max() <= 1e-4, then
            with pytest.raises(RuntimeError, match="keep"):
                spec._live().keep(1)  # the batch is settled: nothing to roll back


def test_bad_speculation_arguments(models, tmp_path):
    target = models["target"]
    with pytest.raises(ValueError, match="spec_type"):
        target.generate([1, 2], spec_type="medusa")
    with pytest.raises(ValueError, match="draft_model"):
        target.generate([1, 2], spec_type="draft-simple")
    with pytest.raises(ValueError, match="separate"):
        target.generate([1, 2], draft_model=target)
    with pytest.raises(ValueError, match="draft_n_max"):
        target.generate([1, 2], spec_type="ngram-simple", draft_n_max=0)
    with pytest.raises(ValueError, match="draft_n_min"):
        target.generate([1, 2], spec_type="ngram-simple", draft_n_max=2, draft_n_min=3)
    other = tmp_path / "other.gguf"
    write_tiny_vocab_model(other, n_vocab=300, seed=0)
    with Model(other, n_ctx=256, n_threads=1) as m:
        with pytest.raises(ValueError, match="different vocabulary"):
            target.generate([1, 2], draft_model=m)


def test_rollback_with_the_27b_layer_count(tmp_path):
    # 64 layers, 48 of them DeltaNet, as the 27B: keep() builds one graph (window copies and
    # recurrence replays) for all of them (its descriptor pool, sized for fewer tensors, once
    # aborted at this count)
    path = write_tiny_vocab_model(tmp_path / "deep.gguf", seed=2, n_layer=64)
    kw = dict(n_ctx=256, n_threads=2, type_k="f32", type_v="f32")
    with Model(path, **kw) as spec, Model(path, **kw) as plain:
        spec._live().reserve_slots(8)
        spec.eval([5, 77, 120])
        spec._live().eval_verify(np.array([40, 41, 42, 43, 44], dtype=np.int32))
        spec._live().keep(2)
        assert np.abs(spec.eval([99]) - plain.logits([5, 77, 120, 40, 41, 99])[-1]).max() <= 1e-4


def test_keep_without_deltanet_layers(tmp_path):
    # every layer full attention: keep() has no recurrence to replay and only moves n_past
    path = write_tiny_vocab_model(tmp_path / "attention.gguf", seed=3, full_attention_interval=1)
    kw = dict(n_ctx=128, n_threads=1, type_k="f32", type_v="f32")
    with Model(path, **kw) as spec, Model(path, **kw) as plain:
        spec._live().reserve_slots(4)
        spec.eval([5, 77])
        spec._live().eval_verify(np.array([40, 41, 42], dtype=np.int32))
        spec._live().keep(2)
        assert spec.n_past == 4
        assert np.abs(spec.eval([99]) - plain.logits([5, 77, 40, 41, 99])[-1]).max() <= 1e-4
