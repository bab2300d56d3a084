"""model.generate: greedy parity with transformers, seeded sampling, streaming (UTF-8, control
tokens), stop strings, cancellation and parameter validation."""

import _thread
import shutil
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from deltaspec import Model  # noqa: E402
from deltaspec.convert import convert_hf_to_gguf  # noqa: E402
from deltaspec.generation import _held_back  # noqa: E402
from deltaspec.gguf_file import read_gguf  # noqa: E402
from deltaspec.testing.tiny_models import TINY_CONFIGS, tiny_model_dir  # noqa: E402
from deltaspec.testing.tiny_vocab import tiny_vocab, tiny_vocab_model_path  # noqa: E402

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
    assert r.finish_reason == "length"
    assert len(r.tokens) == 12
    assert r.text == model.detokenize(r.tokens)
    assert r.stats.prompt_tokens == len(model.tokenize("Hello there"))
    assert r.stats.generated_tokens == len(r.tokens)
    assert r.stats.prefill_seconds > 0 and r.stats.decode_seconds >= 0


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
    assert stream.result.finish_reason == full.finish_reason == "length"


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


def _greedy_prefix(model, prompt, tokens):
    """Whether `tokens` are the first greedy tokens after `prompt` (a cancel keeps what was made)."""
    return tokens == model.generate(prompt, max_tokens=len(tokens), temperature=0).tokens if tokens else True


def test_closing_a_stream_cancels_it_with_the_tokens_so_far(model):
    stream = model.generate("Count:", max_tokens=400, temperature=0, stream=True)
    pieces = [next(stream) for _ in range(3)]
    stream.close()
    r = stream.result
    assert r.finish_reason == "cancelled"
    # the loop runs at most STREAM_AHEAD (64) tokens ahead of the reader: far from max_tokens
    assert 3 <= len(r.tokens) < 100
    assert r.text.startswith("".join(pieces)) and r.text == model.detokenize(r.tokens)
    assert _greedy_prefix(model, "Count:", r.tokens)


def test_abandoned_stream_gives_the_model_to_the_next_generate(model):
    expected = model.generate("Count:", max_tokens=8, temperature=0)
    stream = model.generate("Count:", max_tokens=400, temperature=0, stream=True)
    pieces = []
    for piece in stream:
        pieces.append(piece)
        if len(pieces) == 3:
            break  # no close(), and `stream` stays referenced: nothing finalizes it
    again = model.generate("Count:", max_tokens=8, temperature=0)
    assert (again.tokens, again.text) == (expected.tokens, expected.text)
    # the abandoned stream was cancelled; reading on gives the rest of what it had made
    pieces += list(stream)
    assert stream.result.finish_reason == "cancelled" and len(stream.result.tokens) < 100
    assert "".join(pieces) == stream.result.text
    assert _greedy_prefix(model, "Count:", stream.result.tokens)


def test_dropped_stream_is_cancelled_at_once(model):
    stream = model.generate("Count:", max_tokens=400, temperature=0, stream=True)
    next(stream)
    generator = stream._generator
    del stream  # garbage: closing it cancels the loop and waits for it
    assert generator._done.is_set() and generator.final.finish_reason == "cancelled"


@pytest.mark.parametrize("where", ["stream loop", "other thread"])
def test_model_cancel_ends_a_stream(model, where):
    stream = model.generate("Count:", max_tokens=400, temperature=0, stream=True)
    pieces = []
    for piece in stream:
        pieces.append(piece)
        if len(pieces) == 3:
            if where == "stream loop":
                model.cancel()
            else:
                t = threading.Thread(target=model.cancel)
                t.start()
                t.join()
    r = stream.result
    assert r.finish_reason == "cancelled" and len(r.tokens) < 100
    assert "".join(pieces) == r.text
    assert _greedy_prefix(model, "Count:", r.tokens)
    model.cancel()  # nothing runs: a no-op that must not cancel the next request
    assert model.generate("Count:", max_tokens=4, temperature=0).finish_reason == "length"


def test_running_generate_is_not_taken_over_and_cancel_stops_it(model):
    results = []
    worker = threading.Thread(target=lambda: results.append(model.generate("Long:", max_tokens=None, temperature=0)))
    worker.start()  # ~500 tokens until the context is full: about 2 s on 2 cores
    while (active := model._active()) is None or active._done.is_set():
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match="already generating"):
        model.generate("Other", max_tokens=2, temperature=0)
    model.cancel()  # from this thread, while the worker's generate() runs
    worker.join()
    r = results[0]
    assert r.finish_reason == "cancelled" and len(r.tokens) < model.n_ctx - 10
    assert r.text == model.detokenize(r.tokens)
    assert _greedy_prefix(model, "Long:", r.tokens)


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
        assert r.finish_reason == "length"
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
    ({"seed": -2}, ValueError, "seed"),  # -1 is random, as in llama-cpp-python
    ({"stop": [""]}, ValueError, "stop"),
    ({"stop": 5}, TypeError, r"stop must be a string, a list of strings or None, got int 5"),
    ({"stop": [b"x"]}, TypeError, r"stop\[0\] must be a string, got bytes"),
    ({"stream": "yes"}, TypeError, "stream must be True or False, got 'yes'"),
    ({"stream": 1}, TypeError, "stream must be True or False"),
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


# --- text: multi-byte characters across tokens, control tokens ----------------------------------

TOKENS = tiny_vocab()[0]
IM_START, IM_END = TOKENS.index("<|im_start|>"), TOKENS.index("<|im_end|>")
TEXT = "é中😀ж"  # 2, 3, 4 and 2 UTF-8 bytes: each spans several single-byte tokens
# Greedy continuation of CHAIN[0] in the chain model: TEXT's bytes with a control token inside,
# then the end-of-generation token. Token ids of the byte-level vocabulary are the byte values.
CHAIN = [ord("A"), *"é中".encode(), IM_START, *"😀ж".encode(), IM_END]


def write_chain_model(path, chain: list[int]):
    """A tiny-vocab model whose greedy continuation of [chain[0]] is chain[1:].

    With branch_scale=0 every layer computes but adds nothing, so the last hidden state after token
    t is t's embedding, RMS-normed and scaled by output_norm: h_t. Setting LM-head row u to
    6 * h_t / |h_t| gives u a logit of 6|h_t| (~50) after t, far above the random rows' (std 2.5).
    Each token may appear once, so that no row or step has two rules."""
    assert len(set(chain)) == len(chain)
    shutil.copyfile(tiny_vocab_model_path(branch_scale=0.0), path)
    f = read_gguf(path)

    def tensor(name):
        info = f.tensors[name]
        assert info.type.name == "F32"
        return np.fromfile(path, np.float32, int(np.prod(info.shape)), offset=info.offset).reshape(info.shape[::-1])

    embd, norm, head = tensor("token_embd.weight"), tensor("output_norm.weight"), tensor("output.weight")
    h = embd / np.sqrt(np.mean(embd ** 2, axis=1, keepdims=True) + 1e-6) * norm
    for t, u in zip(chain, chain[1:]):
        head[u] = 6.0 * h[t] / np.linalg.norm(h[t])
    with open(path, "r+b") as out:
        out.seek(f.tensors["output.weight"].offset)
        out.write(head.astype(np.float32).tobytes())
    return path


@pytest.fixture(scope="module")
def chain_model(tmp_path_factory):
    with Model(write_chain_model(tmp_path_factory.mktemp("chain") / "chain.gguf", CHAIN), n_ctx=256,
               n_threads=1) as m:
        yield m


def test_stream_pieces_are_whole_characters(chain_model):
    r = chain_model.generate(CHAIN[:1], max_tokens=32, temperature=0)
    assert r.tokens == CHAIN[1:] and r.finish_reason == "stop"
    assert r.text == TEXT
    stream = chain_model.generate(CHAIN[:1], max_tokens=32, temperature=0, stream=True)
    # one piece per character, each sent when its last byte arrives; the control token adds none
    assert list(stream) == ["é", "中", "😀", "ж"]
    assert stream.result.text == TEXT


def test_control_tokens_are_not_in_the_text(chain_model):
    r = chain_model.generate(CHAIN[:1], max_tokens=32, temperature=0)
    assert IM_START in r.tokens and "<|im_start|>" not in r.text
    assert chain_model.detokenize(r.tokens) == TEXT
    assert chain_model.detokenize(r.tokens, special=True) == "é中<|im_start|>😀ж<|im_end|>"
    # the engine looks for stop strings in the same text: "中😀" spans the control token
    r = chain_model.generate(CHAIN[:1], max_tokens=32, temperature=0, stop="中😀")
    assert (r.text, r.finish_reason) == ("é", "stop")
    assert r.tokens == CHAIN[1:CHAIN.index(IM_START) + 5]  # up to the emoji's last byte
    stream = chain_model.generate(CHAIN[:1], max_tokens=32, temperature=0, stop="中😀", stream=True)
    assert list(stream) == ["é"]
