"""create_completion / create_chat_completion on a tiny real-vocabulary model with Qwen3.5's chat
template: the OpenAI-shaped results carry exactly what Model.generate makes of the same prompt,
streamed or not, with thinking on or off."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from deltaspec import Model  # noqa: E402

PROMPT = "Once upon a time, in a land far away,"
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi, who are you?"}]
N = 12


@pytest.fixture(scope="module")
def model(chat_gguf):
    with Model(chat_gguf, n_ctx=1024, n_threads=1, progress=False) as m:
        yield m


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}])
def test_completion_equals_generate(model, sampling):
    r = model.generate(PROMPT, max_tokens=N, **sampling)
    out = model.create_completion(PROMPT, max_tokens=N, **sampling)
    assert out["object"] == "text_completion" and out["model"] == model.path
    assert out["choices"] == [{"text": r.text, "index": 0, "logprobs": None, "finish_reason": "length"}]
    assert out["usage"] == _usage(len(model.tokenize(PROMPT, special=True)), N)
    assert len(r.tokens) == N


def test_completion_stream_concatenates_to_the_completion(model):
    whole = model.create_completion(PROMPT, max_tokens=N, temperature=0)
    chunks = list(model.create_completion(PROMPT, max_tokens=N, temperature=0, stream=True))
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"]
    assert len(chunks) > 2  # streamed in pieces
    assert [c["finish_reason"] for c in choices] == [None] * (len(chunks) - 1) + ["length"]
    assert len({(c["id"], c["created"]) for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_suffix_fills_in_the_middle(model, stream):
    """suffix= (llama-cpp-python's fill in the middle) generates from FIM_PRE prompt FIM_SUF suffix
    FIM_MID, the prompt the server's `suffix` builds (deltaspec.fim.wrap, checked against llama-server
    in test_server_native.py): the text equals generate() on those ids. Seen red with the suffix
    left out of the wrapped prompt (and, before it existed, as a TypeError)."""
    from deltaspec.fim import wrap

    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    ids = wrap(model.tokenizer, model.tokenize(prefix, special=True), model.tokenizer.encode(suffix))
    assert len(ids) == len(model.tokenize(prefix, special=True)) + len(model.tokenizer.encode(suffix)) + 3
    want = model.generate(ids, max_tokens=N, temperature=0)
    plain = model.generate(prefix, max_tokens=N, temperature=0)
    assert want.text != plain.text  # the suffix matters here, so leaving it out would show
    out = model.create_completion(prefix, suffix=suffix, max_tokens=N, temperature=0, stream=stream)
    text = "".join(c["choices"][0]["text"] for c in out) if stream else out["choices"][0]["text"]
    assert text == want.text
    if not stream:
        assert out["usage"] == _usage(len(ids), N)


def test_completion_suffix_errors(model, tmp_path):
    with pytest.raises(ValueError, match="echo with suffix"):
        model.create_completion(PROMPT, suffix="x", echo=True, max_tokens=2)
    with pytest.raises(TypeError, match="suffix must be a str"):
        model.create_completion(PROMPT, suffix=5, max_tokens=2)
    from deltaspec.fim import FimError
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    with Model(write_tiny_vocab_model(tmp_path / "nofim.gguf"), n_ctx=64, n_threads=1, progress=False) as m:
        with pytest.raises(FimError, match="no fill-in-the-middle"):
            m.create_completion("a", suffix="b", max_tokens=2)


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_chat_completion_equals_generate(model, enable_thinking):
    flag = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    prompt = model.apply_chat_template(MESSAGES, **flag)
    # the template got the flag: thinking off closes an empty block, otherwise (its default) it opens one
    assert prompt.endswith("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if enable_thinking is False
                                                           else "<think>\n"))
    r = model.generate(prompt, max_tokens=N, temperature=0)
    assert "</think>" not in r.text and r.text.strip()
    out = model.create_chat_completion(MESSAGES, max_tokens=N, temperature=0, **flag)
    assert out["object"] == "chat.completion" and out["choices"][0]["finish_reason"] == r.finish_reason == "length"
    if enable_thinking is False:
        assert out["choices"][0]["message"] == {"role": "assistant", "content": r.text}
    else:  # the prompt opened <think>: a reply cut off before </think> is all reasoning
        assert out["choices"][0]["message"] == {"role": "assistant", "content": "",
                                                "reasoning_content": r.text.strip()}
    assert out["usage"] == _usage(len(model.tokenize(prompt, special=True)), len(r.tokens))


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_chat_stream_concatenates_to_the_message(model, enable_thinking):
    kwargs = dict(max_tokens=N, temperature=0, enable_thinking=enable_thinking)
    choice = model.create_chat_completion(MESSAGES, **kwargs)["choices"][0]
    chunks = list(model.create_chat_completion(MESSAGES, stream=True, **kwargs))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant"} and deltas[-1] == {}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["id"].startswith("chatcmpl-")
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert reasoning == choice["message"].get("reasoning_content", "")
    assert content == choice["message"]["content"]
    assert len(deltas) > 4  # streamed in pieces
    assert bool(reasoning) == enable_thinking  # thinking on: the reply is reasoning, never content


@pytest.mark.parametrize("call, kwargs, exc, match", [
    ("create_completion", {"n_beams": 2}, TypeError,
     r"create_completion\(\) got an unexpected keyword argument 'n_beams'"),
    ("create_completion", {"mirostat_mode": 2}, ValueError,
     r"create_completion\(\): mirostat_mode=2 is not supported"),
    ("create_chat_completion", {"logprobs": 2}, TypeError, "logprobs must be True, False or None, got 2"),
    ("create_completion", {"stream": "yes"}, TypeError, "stream must be True or False, got 'yes'"),
    ("create_chat_completion", {"stream": 1}, TypeError, "stream must be True or False, got 1"),
    ("create_chat_completion", {"enable_thinking": "no"}, TypeError, "enable_thinking must be True or False"),
    ("create_completion", {"stop": 5}, TypeError, "stop must be a string, a list of strings or None"),
    ("create_chat_completion", {"max_tokens": 0}, ValueError, "max_tokens"),
])
def test_bad_arguments_name_the_call_and_parameter(model, call, kwargs, exc, match):
    first = PROMPT if call == "create_completion" else MESSAGES
    with pytest.raises(exc, match=match):
        getattr(model, call)(first, **kwargs)
