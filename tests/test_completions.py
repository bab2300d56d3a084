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
    ("create_completion", {"mirostat_mode": 2}, TypeError,
     r"create_completion\(\) got an unexpected keyword argument 'mirostat_mode'"),
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
