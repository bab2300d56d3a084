"""llama-cpp-python's names on deltaspec.Model / deltaspec.Llama: constructor arguments, __call__ and
echo, logprobs, tokenize(add_bos), seeds, ignore_eos / logit_bias, save_state / load_state.

Most run on the tiny-vocabulary model (it loads in milliseconds); every claim is checked against an
independent computation (log_softmax of the full logits, a fresh prefill, the sampler's own
greedy choice under a bias). Each test's docstring says how it was seen to fail."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from deltaspec import Llama, Model, _core
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path

THREADS = 1
PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def path():
    return tiny_vocab_model_path()


@pytest.fixture(scope="module")
def llm(path):
    with Llama(model_path=path, n_ctx=256, n_threads=THREADS, n_gpu_layers=0, verbose=False) as m:
        yield m


def _id(model, text: str) -> int:
    (token,) = Model.tokenize(model, text, special=True)
    return token


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    m = rows.max(axis=-1, keepdims=True)
    return rows - (m + np.log(np.exp(rows - m).sum(axis=-1, keepdims=True)))


# --- constructor ----------------------------------------------------------------------------------

def test_constructor_names(path, capfd):
    """model_path / n_gpu_layers / n_batch / seed / verbose / flash_attn. Seen red with
    llama_args.resolve ignoring n_gpu_layers (-1 loaded on the CPU of this CUDA-less build instead
    of raising) and with verbose not passed on as progress (no load lines)."""
    with Model(model_path=path, n_gpu_layers=0, n_batch=8, n_ctx=256, n_threads=THREADS, seed=7,
               verbose=True, flash_attn=True) as m:
        assert m.device == "cpu" and m._default_seed == 7
    err = capfd.readouterr().err.splitlines()
    # stderr is not a terminal under pytest: plain lines, the first before anything else happened
    assert err[0].startswith("deltaspec: loading ") and any(line.startswith("deltaspec: loaded ") for line in err), err
    if _core.has_device("cuda"):
        with Model(model_path=path, n_gpu_layers=-1, n_ctx=256) as m:
            assert m.device == "cuda"
    else:
        with pytest.raises(ValueError, match=r"n_gpu_layers=-1 asks for the GPU, but this build .* no CUDA"):
            Model(model_path=path, n_gpu_layers=-1)
    for kwargs, match in [(dict(flash_attn=False), "flash_attn=False is not available"),
                          (dict(n_gpu_layers=0, device="cuda"), "n_gpu_layers=0 means device 'cpu'"),
                          (dict(n_gpu_layers=-2), "n_gpu_layers must be 0"), (dict(n_batch=0), "n_batch"),
                          (dict(seed=-5), "seed must be -1")]:
        with pytest.raises(ValueError, match=match):
            Model(model_path=path, **kwargs)
    with pytest.raises(ValueError, match="disagree"):
        Model(path, model_path=str(path) + ".other")
    with pytest.raises(TypeError, match="needs the GGUF path"):
        Model()


def _stderr_when_the_file_is_read(monkeypatch, capture) -> list[str]:
    """What stderr held (per `capture`, capfd or capsys) each time Model reads a GGUF: filled in as
    the model loads."""
    from deltaspec import model as model_module

    seen = []
    real = model_module.read_gguf

    def read_gguf(p):
        seen.append(capture.readouterr().err)
        return real(p)

    monkeypatch.setattr(model_module, "read_gguf", read_gguf)
    return seen


def test_progress_shows_before_the_file_is_read(path, capfd, monkeypatch):
    """progress=True off a terminal: the first plain line is out before the GGUF is even read (a big
    file takes seconds to validate), the last says it loaded. Seen red with _load_progress called
    after read_gguf (nothing on stderr yet when the file was read)."""
    seen = _stderr_when_the_file_is_read(monkeypatch, capfd)
    with Model(path, n_ctx=256, n_threads=THREADS, progress=True):
        pass
    assert seen and seen[0].startswith("deltaspec: loading "), seen
    assert "deltaspec: loaded " in capfd.readouterr().err


@pytest.mark.parametrize("tty", [True, False])
def test_progress_bar_on_a_terminal_only(path, capsys, monkeypatch, tty):
    """progress=None (the default): on a terminal a tqdm bar, drawn before the GGUF is read and
    redrawn in place (carriage returns, no plain lines); off a terminal nothing at all. Seen red
    with start_load_progress choosing plain lines on a terminal too."""
    from deltaspec import load_progress

    monkeypatch.setattr(load_progress, "stderr_is_tty", lambda: tty)
    seen = _stderr_when_the_file_is_read(monkeypatch, capsys)
    with Model(path, n_ctx=256, n_threads=THREADS):
        pass
    err = seen[0] + capsys.readouterr().err
    if tty:
        assert f"loading {Path(path).name}" in seen[0], seen  # the bar is up before the file is read
        assert "\r" in err and "deltaspec: loading" not in err, err
    else:
        assert err == "", err


def test_seeds(path):
    """Model(seed=S) is the default seed of every generate (repeatable); seed -1 (constructor or
    call) is random. Seen red with generate ignoring _default_seed (two calls differed)."""
    kw = dict(max_tokens=24, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    with Model(path, n_ctx=256, n_threads=THREADS, seed=11) as m:
        a, b = m.generate(PROMPT, **kw).tokens, m.generate(PROMPT, **kw).tokens
        assert a == b == m.generate(PROMPT, seed=11, **kw).tokens
        assert m.generate(PROMPT, seed=-1, **kw).tokens != m.generate(PROMPT, seed=-1, **kw).tokens
    with Model(path, n_ctx=256, n_threads=THREADS, seed=-1) as m:
        assert m.generate(PROMPT, **kw).tokens != m.generate(PROMPT, **kw).tokens


def test_llama_accessors(path, llm):
    """llama-cpp-python's accessors on Llama: n_ctx() / n_vocab() called (and still ints, as Model's),
    n_embd(), token_bos() / token_eos() (-1 for none, as LLAMA_TOKEN_NULL), model_path, and set_seed()
    as the default seed of later calls. Seen red with set_seed storing nothing (two seeded runs
    differed) and with n_ctx() not callable."""
    assert llm.n_ctx() == llm.n_ctx == 256 and llm.n_ctx + 0 == 256 and type(llm.n_ctx()) is int
    assert llm.n_vocab() == llm.n_vocab == Model.n_vocab.fget(llm)
    assert llm.n_embd() == llm.hparams.n_embd and llm.model_path == str(path)
    tok = llm.tokenizer
    assert llm.token_eos() == (-1 if tok.eos_id is None else tok.eos_id)
    assert llm.token_bos() == (-1 if tok.bos_id is None else tok.bos_id)
    kw = dict(max_tokens=24, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    llm.set_seed(7)
    a = llm.generate(PROMPT, **kw).tokens
    llm.set_seed(7)
    assert llm.generate(PROMPT, **kw).tokens == a == llm.generate(PROMPT, seed=7, **kw).tokens
    llm.set_seed(-1)
    assert llm.generate(PROMPT, **kw).tokens != llm.generate(PROMPT, **kw).tokens
    with pytest.raises(ValueError, match="seed must be"):
        llm.set_seed(-2)


# LangChain's LlamaCpp passes these to Llama() (its field defaults, rope_freq_base aside: its 10000.0
# would override Qwen3.5's 1e7, which llama.cpp would apply and deltaspec refuses, below)
LANGCHAIN_LOAD = dict(lora_base=None, lora_path=None, n_parts=-1, seed=-1, f16_kv=True, logits_all=False,
                      vocab_only=False, use_mlock=False, n_threads=THREADS, n_batch=8, use_mmap=True,
                      last_n_tokens_size=64, rope_freq_scale=1.0, rope_freq_base=0.0)


def test_llama_cpp_python_load_options(path):
    """Llama() takes llama-cpp-python's options where they change nothing here (a wrapper's full set
    loads and generates what Model does), ggml_type ids for type_k / type_v (the cache allocated is
    that type), and chat_format as the chat template. Seen red with llama_only_options taking
    nothing out (TypeError) and with the type ids mapped one off (q4_1 allocated)."""
    with Llama(model_path=path, n_ctx=256, verbose=False, **LANGCHAIN_LOAD) as m, \
            Model(path, n_ctx=256, n_threads=THREADS) as ref:
        kw = dict(max_tokens=8, temperature=0.8, seed=4)
        assert m.generate(PROMPT, **kw).tokens == ref.generate(PROMPT, **kw).tokens
    with Llama(model_path=path, n_ctx=256, n_threads=THREADS, verbose=False, type_k=8, type_v=2) as m:
        layer = m.kv_cache_info()["attention_layers"][0]
        assert (layer["type_k"], layer["type_v"]) == ("q8_0", "q4_0")


def test_llama_chat_format(chat_gguf):
    from deltaspec.chat_template_names import CHATML_TEMPLATE

    messages = [{"role": "user", "content": "Hello there"}]
    with Llama(model_path=chat_gguf, n_ctx=512, n_threads=THREADS, verbose=False, chat_format="chatml") as m:
        chatml = m.apply_chat_template(messages)
        assert chatml == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
        assert chatml != Model.apply_chat_template(m, messages)  # the GGUF's (Qwen3.5's) differs
        out = m.create_chat_completion(messages, max_tokens=4, temperature=0)
        want = m.generate(chatml, max_tokens=4, temperature=0).text
        assert out["choices"][0]["message"]["content"] == want
        assert m.apply_chat_template(messages, chat_template=CHATML_TEMPLATE + "x") == chatml + "x"  # a call's wins


@pytest.mark.parametrize("bad, match", [
    (dict(rope_freq_base=10000.0), r"rope_freq_base=10000\.0 is not supported here; accepted: 0"),
    (dict(use_mlock=True), "use_mlock=True"),
    (dict(lora_path="adapter.gguf"), "no LoRA adapters"),
    (dict(main_gpu=1), "device='cuda:N'"),
    (dict(split_mode=2), "split_mode=2"),
    (dict(last_n_tokens_size=True), "last_n_tokens_size=True"),
    (dict(type_k=12), "type_k=12 is not the ggml_type"),
    (dict(chat_format="llama-2"), "chat_format='llama-2' is not a format"),
])
def test_llama_cpp_python_load_options_refused(path, bad, match):
    with pytest.raises(ValueError, match=match):
        Llama(model_path=path, n_ctx=256, verbose=False, **bad)


def test_llama_grammar(llm, tmp_path):
    """llama-cpp-python's LlamaGrammar.from_string / from_file / from_json_schema (with its verbose
    argument) make deltaspec Grammars that constrain create_completion as Grammar's do. Seen red
    with verbose dropped from from_string's signature (TypeError)."""
    from deltaspec import Grammar, LlamaGrammar

    gbnf = 'root ::= ("yes" | "no") "."'
    g = LlamaGrammar.from_string(gbnf, verbose=False)
    assert isinstance(g, Grammar) and g.spec == Grammar.from_string(gbnf).spec
    kw = dict(max_tokens=8, temperature=0.9, seed=1)
    text = llm.create_completion(PROMPT, grammar=g, **kw)["choices"][0]["text"]
    assert text in ("yes.", "no.") and text == llm.create_completion(PROMPT, grammar=gbnf, **kw)["choices"][0]["text"]
    (tmp_path / "g.gbnf").write_text(gbnf)
    assert LlamaGrammar.from_file(tmp_path / "g.gbnf", verbose=True).spec == g.spec
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False).spec == Grammar.from_json_schema(schema).spec


# --- tokens -----------------------------------------------------------------------------------------

def test_tokenize_add_bos_and_bytes(llm):
    """Llama.tokenize(bytes, add_bos, special) / detokenize -> bytes, as llama-cpp-python's. Seen red
    with add_bos ignored (no BOS when the vocabulary asks for one)."""
    ids = llm.tokenize(b"the cat", add_bos=True)
    assert ids == llm.tokenize("the cat", add_bos=False) == Model.tokenize(llm, "the cat")  # no BOS asked for
    assert llm.detokenize(ids) == b"the cat"
    assert llm.tokenize(b"<|im_end|>", special=True) == [_id(llm, "<|im_end|>")]
    tok = llm.tokenizer
    saved = tok.add_bos, tok.bos_id
    try:
        tok.add_bos, tok.bos_id = True, _id(llm, "<|endoftext|>")
        assert llm.tokenize(b"the cat") == [tok.bos_id, *ids]
        assert llm.tokenize(b"the cat", add_bos=False) == ids
    finally:
        tok.add_bos, tok.bos_id = saved


# --- completions, echo, logprobs --------------------------------------------------------------------

def test_call_and_echo(llm):
    """llm(prompt, ...) is create_completion; echo puts the prompt first. Seen red with echo
    dropped (the text lacked the prompt)."""
    out = llm(PROMPT, max_tokens=6, temperature=0, echo=True)
    text = llm.generate(PROMPT, max_tokens=6, temperature=0).text
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == PROMPT + text
    chunks = list(llm(PROMPT, max_tokens=6, temperature=0, echo=True, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + text


# what llama-cpp-python's create_completion / create_chat_completion default to, which wrappers pass
NEUTRAL = dict(typical_p=1.0, tfs_z=1.0, mirostat_mode=0, mirostat_tau=5.0, mirostat_eta=0.1,
               logits_processor=None, stopping_criteria=None)


@pytest.mark.parametrize("stream", [False, True])
def test_llama_cpp_python_defaults_and_model_name(llm, stream):
    """llama-cpp-python's typical_p / tfs_z / mirostat / callbacks at their defaults (samplers deltaspec
    lacks, at the values that leave sampling unchanged) give the same text as without them, sampled;
    `model=` names the result as llama-cpp-python's does. Seen red with _llama_cpp_options taking
    nothing out (TypeError: unexpected keyword argument) and with the name not passed on."""
    def text(out):
        return "".join(c["choices"][0]["text"] for c in out) if stream else out["choices"][0]["text"]

    sampled = dict(max_tokens=8, temperature=0.9, seed=5, stream=stream)
    want = text(llm.create_completion(PROMPT, **sampled))
    got = llm.create_completion(PROMPT, model="my-model", **NEUTRAL, **sampled)
    chunks = list(got) if stream else [got]
    assert text(chunks if stream else got) == want
    assert {c["model"] for c in chunks} == {"my-model"}
    assert llm(PROMPT, max_tokens=2, temperature=0)["model"] == llm.path  # the path when not named


def test_llama_cpp_python_chat_defaults_and_model_name(chat_gguf):
    messages = [{"role": "user", "content": "Hello there"}]
    with Model(chat_gguf, n_ctx=512, n_threads=THREADS, progress=False) as m:
        opts = dict(max_tokens=6, temperature=0, enable_thinking=False)
        want = m.create_chat_completion(messages, **opts)
        got = m.create_chat_completion(messages, model="chat-name", **NEUTRAL, **opts)
        assert got["choices"] == want["choices"] and got["model"] == "chat-name" and want["model"] == m.path
        chunks = list(m.create_chat_completion(messages, model="chat-name", stream=True, **NEUTRAL, **opts))
        assert {c["model"] for c in chunks} == {"chat-name"}


@pytest.mark.parametrize("bad, error, match", [
    (dict(typical_p=0.9), ValueError, r"typical_p=0\.9 is not supported"),
    (dict(tfs_z=0.5), ValueError, r"tfs_z=0\.5 is not supported"),
    (dict(mirostat_mode=2), ValueError, r"mirostat_mode=2 is not supported"),
    (dict(mirostat_tau=float("nan")), ValueError, "mirostat_tau must be a finite number"),
    (dict(logits_processor=[print]), ValueError, "logits_processor is not supported"),
    (dict(stopping_criteria=[print]), ValueError, "stopping_criteria is not supported"),
    (dict(model=3), TypeError, "model .* must be a str"),
])
def test_llama_cpp_python_options_deltaspec_lacks_are_refused(llm, bad, error, match):
    for call in (lambda: llm.create_completion(PROMPT, max_tokens=2, **bad),
                 lambda: llm.create_chat_completion([{"role": "user", "content": "x"}], max_tokens=2, **bad)):
        with pytest.raises(error, match=match):
            call()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_equal_log_softmax_of_the_logits(llm, temperature):
    """Each generated token's logprob and the top-k list equal log_softmax of the model's logits at
    that position (computed here from Model.logits of prompt + output in one pass). Seen red with
    record_logprobs leaving out the normaliser (logprob = logit - max) and with top ids sorted
    ascending."""
    k = 5
    r = llm.generate(PROMPT, max_tokens=12, temperature=temperature, seed=3, logprobs=k, ignore_eos=True)
    prompt = llm.tokenize(PROMPT, special=True)
    ref = _log_softmax(llm.logits(prompt + r.tokens[:-1])[len(prompt) - 1:])
    assert len(r.logprobs) == len(r.tokens) == len(ref) == 12
    for i, token in enumerate(r.tokens):
        assert r.logprobs[i] == pytest.approx(ref[i, token], abs=1e-4)
        top = r.top_logprobs[i]
        assert [t for t, _ in top] == np.argsort(-ref[i], kind="stable")[:k].tolist()
        assert [v for _, v in top] == pytest.approx(np.sort(ref[i])[::-1][:k], abs=1e-4)
    if temperature == 0:
        assert all(top[0][0] == t for top, t in zip(r.top_logprobs, r.tokens))  # greedy = the best token


@pytest.mark.parametrize("n_batch, n_ubatch, engine_gets", [(8, None, 8), (8, 4, 4), (None, 16, 16)])
def test_n_batch_caps_the_engines_ubatch(path, monkeypatch, n_batch, n_ubatch, engine_gets):
    """Model(n_batch=N) caps the physical batch the engine is built with, as llama.cpp caps n_ubatch
    by n_batch (read at the engine's constructor). Seen red with llama_args.resolve returning
    n_ubatch unchanged (the engine got 512)."""
    import deltaspec.model as model_module

    seen = []
    real = model_module._core.Engine

    def engine(*args, **kwargs):
        seen.append(kwargs["n_ubatch"])
        return real(*args, **kwargs)

    monkeypatch.setattr(model_module._core, "Engine", engine)
    kw = {k: v for k, v in (("n_batch", n_batch), ("n_ubatch", n_ubatch)) if v is not None}
    with Model(path, n_ctx=256, n_threads=THREADS, progress=False, **kw) as m:
        assert m.generate(PROMPT, max_tokens=2, temperature=0).tokens
    assert seen == [engine_gets]


def test_chat_logprobs(chat_gguf):
    """create_chat_completion(logprobs=True, top_logprobs=3): OpenAI's content list, one entry per
    generated token whose pieces concatenate to the message, each logprob equal to generate()'s for
    the same rendered prompt, the chosen token first in its greedy top list; logprobs=True alone gives
    empty top lists. Seen red with chat_logprobs taking each entry's top list from the next token."""
    messages = [{"role": "user", "content": "Hello there"}]
    with Model(chat_gguf, n_ctx=512, n_threads=THREADS, progress=False) as m:
        out = m.create_chat_completion(messages, logprobs=True, top_logprobs=3, temperature=0, max_tokens=8,
                                       enable_thinking=False)
        choice = out["choices"][0]
        content = choice["logprobs"]["content"]
        r = m.generate(m.apply_chat_template(messages, enable_thinking=False), max_tokens=8, temperature=0, logprobs=3)
        assert len(content) == len(r.tokens) > 0
        assert "".join(c["token"] for c in content) == choice["message"]["content"]
        for c, logprob, top in zip(content, r.logprobs, r.top_logprobs):
            assert c["logprob"] == pytest.approx(logprob, abs=1e-6)
            assert len(c["top_logprobs"]) == 3 and c["top_logprobs"][0]["token"] == c["token"]
            assert [t["logprob"] for t in c["top_logprobs"]] == pytest.approx([v for _, v in top], abs=1e-6)
            assert c["bytes"] == list(c["token"].encode("utf-8"))
        bare = m.create_chat_completion(messages, logprobs=True, temperature=0, max_tokens=4, enable_thinking=False)
        assert all(c["top_logprobs"] == [] for c in bare["choices"][0]["logprobs"]["content"])


def test_completion_logprobs_shape(llm):
    """llama-cpp-python's completion `logprobs`: tokens concatenate to the text, offsets count from
    the prompt's end (or 0 with echo, the first prompt token then null), the chosen token is in its
    top dict. Seen red with text_offset starting at 0 without echo."""
    out = llm.create_completion(PROMPT, max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and lp["text_offset"][0] == len(PROMPT)
    assert all(t in d and len(d) <= 4 for t, d in zip(lp["tokens"], lp["top_logprobs"]))
    echoed = llm.create_completion(PROMPT, max_tokens=8, temperature=0, logprobs=3, echo=True, ignore_eos=True)
    elp = echoed["choices"][0]["logprobs"]
    n_prompt = len(llm.tokenize(PROMPT))
    assert elp["token_logprobs"][0] is None and elp["top_logprobs"][0] is None
    assert "".join(elp["tokens"]) == echoed["choices"][0]["text"] == PROMPT + choice["text"]
    assert elp["token_logprobs"][n_prompt:] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    ref = _log_softmax(llm.logits(llm.tokenize(PROMPT)))
    ids = llm.tokenize(PROMPT)
    assert elp["token_logprobs"][1:n_prompt] == pytest.approx([ref[i - 1, ids[i]] for i in range(1, n_prompt)],
                                                              abs=1e-4)


def _joined_completion_logprobs(chunks) -> dict:
    joined = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
    for c in chunks:
        for key in joined:
            joined[key] += (c["choices"][0]["logprobs"] or {}).get(key, [])
    return joined


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_logprobs_equal_the_answers(llm, echo):
    """create_completion(stream=True, logprobs=k): the chunks' logprobs, joined, are the non-streamed
    answer's (tokens, offsets, values, top dicts; with echo the prompt's first), and they come spread
    over the stream, each chunk with those of the tokens its text completes (its tokens' text is a
    prefix of the text streamed so far), also where text is held back (the stop string below, which
    never completes, holds back the answer's first ASCII pair until the next byte is known). Seen red
    with TextStream handing every entry out at the end (the chunk-by-chunk assertion)."""
    kw = dict(max_tokens=24, temperature=0, logprobs=3, ignore_eos=True, echo=echo)
    plain = llm.create_completion(PROMPT, **kw)["choices"][0]["text"]
    at = next(i for i in range(len(PROMPT) if echo else 0, len(plain) - 1) if plain[i:i + 2].isascii()
              and plain[i:i + 2].isprintable())
    kw["stop"] = [plain[at:at + 2] + "\x01"]
    want = llm.create_completion(PROMPT, **kw)["choices"][0]
    assert want["text"] == plain
    chunks = list(llm.create_completion(PROMPT, stream=True, **kw))
    assert "".join(c["choices"][0]["text"] for c in chunks) == want["text"]
    assert _joined_completion_logprobs(chunks) == want["logprobs"]
    text = tokens = ""
    spread = 0
    for c in chunks:
        text += c["choices"][0]["text"]
        tokens += "".join((c["choices"][0]["logprobs"] or {}).get("tokens", []))
        assert text.startswith(tokens), "a chunk's logprobs ran ahead of its text"
        spread += bool((c["choices"][0]["logprobs"] or {}).get("tokens"))
    assert spread > 3
    assert chunks[-1]["choices"][0]["finish_reason"] == want["finish_reason"]


def test_streamed_chat_logprobs_equal_the_answers(chat_gguf):
    """create_chat_completion(stream=True, logprobs=True, top_logprobs=3): the chunks' content lists,
    joined, are the non-streamed answer's; with speculation (prompt lookup) too."""
    messages = [{"role": "user", "content": "Hello there"}]
    with Model(chat_gguf, n_ctx=512, n_threads=THREADS, progress=False) as m:
        for spec in ({}, {"spec_type": "ngram-simple", "draft_n_min": 1}):
            kw = dict(logprobs=True, top_logprobs=3, temperature=0, max_tokens=16, enable_thinking=False, **spec)
            want = m.create_chat_completion(messages, **kw)["choices"][0]["logprobs"]["content"]
            joined = []
            for c in m.create_chat_completion(messages, stream=True, **kw):
                joined += (c["choices"][0].get("logprobs") or {}).get("content", [])
            assert joined == want and len(want) > 0, spec


# --- ignore_eos and logit_bias ------------------------------------------------------------------------

def test_ignore_eos_and_logit_bias(llm):
    """A +50 bias on <|im_end|> makes greedy decoding stop at once; ignore_eos (-inf on every EOG
    token) overrides it and the text runs to max_tokens, never containing an EOG token, in generate,
    generate_batch and speculative decoding. A -inf bias on the greedy token yields the runner-up.
    Seen red with the bias loop in Sampler::distribution removed (nothing changed) and with
    argmax_only() not looking at logit_bias (the device argmax ignored the ban)."""
    eos = _id(llm, "<|im_end|>")
    stop = llm.generate(PROMPT, max_tokens=10, temperature=0, logit_bias={eos: 50.0})
    assert stop.tokens == [eos] and stop.finish_reason == "stop"
    kw = dict(max_tokens=10, temperature=0, logit_bias={str(eos): 50.0}, ignore_eos=True)  # JSON-style key
    go = llm.generate(PROMPT, **kw)
    assert go.finish_reason == "length" and len(go.tokens) == 10
    assert not any(llm.tokenizer.is_eog(t) for t in go.tokens)
    assert llm.generate_batch([PROMPT], **kw)[0].tokens == go.tokens
    assert llm.generate(PROMPT, spec_type="ngram-simple", **kw).tokens == go.tokens
    plain = llm.generate(PROMPT, max_tokens=1, temperature=0).tokens[0]
    prompt = llm.tokenize(PROMPT)
    second = int(np.argsort(-llm.logits(prompt)[-1], kind="stable")[1])
    assert llm.generate(PROMPT, max_tokens=1, temperature=0, logit_bias={plain: -math.inf}).tokens == [second]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(PROMPT, logit_bias={10**6: 1.0})
    with pytest.raises(ValueError, match=r"logit_bias\[0\]"):
        llm.generate(PROMPT, logit_bias={1: math.inf})


def test_cli_ignore_eos_reaches_generate(path, monkeypatch, capsys):
    """`deltaspec run --ignore-eos` (refused before) runs and hands ignore_eos=True to generate; without
    the flag it is not passed. Seen red with _sampling_kwargs leaving the flag out."""
    from deltaspec.cli import main

    seen = []
    real = Model.generate

    def generate(self, prompt, **kwargs):
        seen.append(kwargs.get("ignore_eos", False))
        return real(self, prompt, **kwargs)

    monkeypatch.setattr(Model, "generate", generate)
    base = ["run", "-m", str(path), "-p", "the cat", "-n", "6", "--temp", "0", "-t", "1", "-c", "256"]
    assert main(base + ["--ignore-eos"]) == 0 and main(base) == 0
    assert seen == [True, False]
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(line.startswith("the cat") for line in out)


# --- save_state / load_state --------------------------------------------------------------------------

def test_load_state_resumes_without_rereading(path, llm):
    """A chat turn resumed from save_state() in another Model instance: the next turn's tokens equal a
    from-scratch generate on the same history, and only the new tokens were prefilled
    (stats.cached_tokens, from the engine's prefill counter). Seen red with load_sequence not
    writing the recurrent tensors (the continuation differed) and with the scheduler evaluating the
    whole prompt on top of the loaded state (the prefill counter showed it re-read)."""
    first = llm.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    state = llm.save_state()
    suffix = llm.tokenize(" and then")
    history = llm.tokenize(PROMPT) + first.tokens + suffix
    assert state.tokens == tuple(llm.tokenize(PROMPT) + first.tokens[:-1]) and state.nbytes > 0
    llm.generate("something else entirely", max_tokens=4, temperature=0)  # the live state moves on
    with Model(path, n_ctx=256, n_threads=THREADS) as other:
        other.load_state(state)
        resumed = other.generate(history, max_tokens=8, temperature=0, ignore_eos=True)
    assert resumed.stats.cached_tokens == state.n_tokens == len(history) - len(suffix) - 1
    llm.reset()
    fresh = llm.generate(history, max_tokens=8, temperature=0, ignore_eos=True)
    assert fresh.stats.cached_tokens == 0
    assert resumed.tokens == fresh.tokens
    # the same model continues its own last generation too (a chat's next turn)
    nxt = history + fresh.tokens + llm.tokenize(" yes")
    again = llm.generate(nxt, max_tokens=4, temperature=0, ignore_eos=True)
    assert again.stats.cached_tokens == len(history) + len(fresh.tokens) - 1
    llm.reset()
    assert llm.generate(nxt, max_tokens=4, temperature=0, ignore_eos=True).tokens == again.tokens


def test_load_state_refuses_a_foreign_state(path, llm):
    """A state from other KV cache types, or with a tensor cut short, is refused naming what is
    wrong, and leaves the sequence as it was. Seen red with the size check in load_sequence removed
    (the short tensor was copied)."""
    import dataclasses

    llm.generate(PROMPT, max_tokens=4, temperature=0)
    state = llm.save_state()
    with Model(path, n_ctx=256, n_threads=THREADS, type_k="q8_0") as other:
        with pytest.raises(ValueError, match="another model or KV cache types"):
            other.load_state(state)
    name = next(n for n in state.tensors if n.startswith("ssm."))
    cut = dataclasses.replace(state, tensors={**state.tensors, name: state.tensors[name][:-4]})
    before = llm.n_past
    with pytest.raises(ValueError, match=f"saved tensor '{name}' has"):
        llm.load_state(cut)
    assert llm.n_past == before
    with pytest.raises(TypeError, match="LlamaState"):
        llm.load_state({"tokens": []})
