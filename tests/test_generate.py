"""model.generate: greedy parity with transformers, seeded sampling, streaming, stop strings,
cancellation and parameter validation."""

import _thread
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from deltaspec import Model  # noqa: E402
from deltaspec.convert import convert_hf_to_gguf  # noqa: E402
from deltaspec.generation import _held_back  # noqa: E402
from deltaspec.testing.tiny_models import TINY_CONFIGS, tiny_model_dir  # noqa: E402

N_GREEDY = 64


@pytest.fixture(scope="module")
def gguf_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    paths = {}
    for name in sorted(TINY_CONFIGS):
        paths[name] = root / f"{name}.gguf"
        convert_hf_to_gguf(tiny_model_dir(name), paths[name], outtype="f32")
    return paths


@pytest.fixture(scope="module")
def model(gguf_paths):
    with Model(gguf_paths["attn2_d32_untied"], n_ctx=512) as m:
        yield m


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_greedy_equals_transformers_generate(gguf_paths, name):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir(name), dtype=torch.float32).eval()
    with Model(gguf_paths[name], n_ctx=512, type_k="f32", type_v="f32") as m:
        prompt = m.tokenize("Once upon a time, in a land far away,")
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=N_GREEDY, do_sample=False,
                              eos_token_id=sorted(m.tokenizer.eog_ids), pad_token_id=0)[0, len(prompt):].tolist()
        ours = m.generate(prompt, max_tokens=N_GREEDY, temperature=0).tokens
    assert len(ref) == N_GREEDY or m.tokenizer.is_eog(ref[-1])
    assert ours == ref


def test_result_fields(model):
    r = model.generate("Hello there", max_tokens=12, temperature=0)
    assert r.finish_reason in ("length", "stop")
    assert len(r.tokens) <= 12
    assert r.stats.prompt_tokens == len(model.tokenize("Hello there"))
    assert r.stats.generated_tokens == len(r.tokens)
    assert r.stats.prefill_seconds > 0 and r.stats.decode_seconds >= 0
    if r.finish_reason == "length":
        assert len(r.tokens) == 12
        assert r.text == model.detokenize(r.tokens)


def test_seeded_sampling_is_reproducible(model):
    a = model.generate("The weather", max_tokens=24, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    b = model.generate("The weather", max_tokens=24, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    c = model.generate("The weather", max_tokens=24, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=12)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_stream_concatenates_to_text(model):
    full = model.generate("Tell me", max_tokens=40, temperature=0)
    stream = model.generate("Tell me", max_tokens=40, temperature=0, stream=True)
    pieces = list(stream)
    assert "".join(pieces) == full.text
    assert stream.result.tokens == full.tokens
    if "\ufffd" not in full.text:  # valid UTF-8 overall: no piece may split a character
        assert all("\ufffd" not in p for p in pieces)


def _stop_across_tokens(model, text_tokens):
    """A 3-character string of the greedy text that starts in one token and ends in the next."""
    pieces = [model.detokenize([t]) for t in text_tokens]
    pos = 0
    for a, b in zip(pieces, pieces[1:]):
        pos += len(a)
        if len(a) >= 2 and len(b) >= 1 and "\ufffd" not in a + b:
            return "".join(pieces)[pos - 2:pos + 1]
    pytest.skip("no token boundary suitable for a split stop string")


def test_stop_string_split_across_tokens(model):
    full = model.generate("A story:", max_tokens=48, temperature=0)
    stop = _stop_across_tokens(model, full.tokens)
    expected = full.text[:full.text.index(stop)]
    r = model.generate("A story:", max_tokens=48, temperature=0, stop=[stop, "never-appears-xyz"])
    assert r.finish_reason == "stop"
    assert r.text == expected
    stream = model.generate("A story:", max_tokens=48, temperature=0, stop=stop, stream=True)
    pieces = list(stream)
    assert "".join(pieces) == expected
    assert stream.result.finish_reason == "stop"


def test_held_back_never_leaks_stop_prefix_or_partial_utf8():
    assert _held_back(b"hello wor", [b"world"]) == 3
    assert _held_back(b"hello", [b"world"]) == 0
    assert _held_back("abc\u4e2d".encode()[:-1], []) == 2  # two of the three bytes of one character
    assert _held_back("abc\u4e2d".encode(), []) == 0
    assert _held_back(b"ab\xf0\x9f", [b"xyz"]) == 2        # half an emoji


def test_breaking_a_stream_cancels_and_model_stays_usable(model):
    stream = model.generate("Count:", max_tokens=400, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    again = model.generate("Count:", max_tokens=8, temperature=0)
    assert again.tokens == model.generate("Count:", max_tokens=8, temperature=0).tokens


def test_keyboard_interrupt_leaves_model_usable(model):
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        model.generate("Long:", max_tokens=400, temperature=0)  # minutes on this model
    timer.cancel()
    r = model.generate("Long:", max_tokens=4, temperature=0)
    assert len(r.tokens) == 4


def test_context_full_stops_with_length(gguf_paths):
    with Model(gguf_paths["gdn_hk2_hv4_tied"], n_ctx=256) as m:
        prompt = list(np.random.default_rng(0).integers(0, 240000, size=250))
        r = m.generate(prompt, max_tokens=None, temperature=0, top_k=1)
        assert r.finish_reason in ("length", "stop")
        if r.finish_reason == "length":
            assert len(prompt) + len(r.tokens) == m.n_ctx + 1  # the last token is sampled, never evaluated


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"max_tokens": -1}, ValueError, "max_tokens"),
    ({"max_tokens": 0}, ValueError, "max_tokens"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"temperature": -0.1}, ValueError, "temperature"),
    ({"top_k": -3}, ValueError, "top_k"),
    ({"min_p": 2}, ValueError, "min_p"),
    ({"repeat_penalty": 0}, ValueError, "repeat_penalty"),
    ({"seed": -1}, ValueError, "seed"),
    ({"stop": [""]}, ValueError, "stop"),
    ({"temprature": 0.5}, TypeError, "temprature"),
])
def test_bad_generate_arguments(model, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        model.generate("hi", **kwargs)


def test_bad_prompts(model):
    with pytest.raises(ValueError, match="empty"):
        model.generate("")
    with pytest.raises(ValueError, match="empty"):
        model.generate([])
    with pytest.raises(ValueError, match=r"600 tokens .* 512"):
        model.generate([1] * 600)
