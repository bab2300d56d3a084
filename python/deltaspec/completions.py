"""llama-cpp-python style `create_completion` / `create_chat_completion` over Model.generate."""

from __future__ import annotations

import inspect
import math
from typing import Any, Iterator, Mapping, Sequence

from . import fim
from . import logprobs as lp
from . import openai_format as oai
from .chat import chat_template_from_metadata, prompt_opens_reasoning, split_reasoning
from .generation import validate_flag
from .grammar import response_format_grammar
from .openai_stream import ChatChunks, CompletionChunks
from .tool_call_grammar import (ForcedToolCall, chosen_call_grammar, forced_tool_call, openai_tool_choice,
                                tool_call_grammar)
from .tool_calls import parse_tool_calls


# llama-cpp-python's sampling options that deltaspec does not implement, taken at the values that
# leave sampling unchanged (what wrappers pass when nobody set them) and refused at any other
_NEUTRAL_OPTIONS = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat_mode": 0}
_MIROSTAT_ONLY = ("mirostat_tau", "mirostat_eta")  # no effect while mirostat_mode is 0
_CALLBACKS = ("logits_processor", "stopping_criteria")  # host callbacks per token: None only


def _llama_cpp_options(caller: str, kwargs: dict[str, Any]) -> str | None:
    """Takes llama-cpp-python's options above out of kwargs (checked), and `model`, the name the
    result carries (llama-cpp-python's; the file's path when None), which it returns."""
    name = kwargs.pop("model", None)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{caller}(): model (the name the result carries) must be a str or None, got {name!r:.80}")
    for key, neutral in _NEUTRAL_OPTIONS.items():
        if key in kwargs:
            value = kwargs.pop(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != neutral:
                raise ValueError(f"{caller}(): {key}={value!r} is not supported: deltaspec has no such sampler "
                                 f"(only {key}={neutral!r}, which leaves sampling unchanged, is accepted); use "
                                 "temperature, top_k, top_p, min_p and the penalties")
    for key in _MIROSTAT_ONLY:
        if key in kwargs:
            value = kwargs.pop(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{caller}(): {key} must be a finite number, got {value!r:.80}")
    for key in _CALLBACKS:
        if kwargs.pop(key, None) is not None:
            raise ValueError(f"{caller}(): {key} is not supported (rows are sampled on the device, with no host "
                             "callback per token); use logit_bias, grammar, stop or max_tokens")
    return name


def _check_kwargs(model, caller: str, kwargs: Mapping[str, Any]) -> None:
    """Options are passed on to Model.generate; name the function the user called, not generate(),
    when one is unknown (e.g. llama-cpp-python's `echo` or `logprobs`, which deltaspec lacks)."""
    known = inspect.signature(model.generate).parameters
    for name in kwargs:
        if name not in known:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")


def create_completion(model, prompt: str | Sequence[int], /, *, stream: bool = False, echo: bool = False,
                      logprobs: int | None = None, suffix: str | None = None, **kwargs: Any):
    """An OpenAI `text_completion` dict, or an iterator of chunk dicts when stream=True.

    echo=True puts the prompt's text before the completion's; logprobs=k gives each token's
    log-probability and the k most probable tokens' (llama-cpp-python's shape; with echo, the
    prompt's tokens too, the first one's null); streamed, each chunk has those of its text.
    suffix (a str, "" included, as llama-cpp-python takes it) fills in the middle: the model is
    given FIM_PRE prompt FIM_SUF suffix FIM_MID (deltaspec.fim.wrap, as the server's `suffix`) and
    writes what goes between; FimError for a model without fill-in-the-middle tokens."""
    name = _llama_cpp_options("create_completion", kwargs) or model.path
    _check_kwargs(model, "create_completion", kwargs)
    validate_flag("echo", echo)
    prompt_text = prompt if isinstance(prompt, str) else model.detokenize(prompt)
    if suffix is not None:
        if not isinstance(suffix, str):
            raise TypeError(f"suffix must be a str or None, got {type(suffix).__name__} {suffix!r:.80}")
        if echo:  # (the server refuses the pair too)
            raise ValueError("echo with suffix is not supported: the prompt evaluated is not the text given")
        prompt = fim.wrap(model.tokenizer, model._prompt_ids(prompt), model.tokenizer.encode(suffix))
    if not validate_flag("stream", stream):
        r = model.generate(prompt, logprobs=logprobs, **kwargs)
        out = oai.completion(prompt_text + r.text if echo else r.text, r.finish_reason, name,
                             r.stats.prompt_tokens, r.stats.generated_tokens)
        if logprobs is not None:
            entries = lp.generated_logprobs(model.tokenizer, r)
            if echo:
                ids = model._prompt_ids(prompt)
                entries = lp.prompt_logprobs(model, ids, logprobs) + entries
            out["choices"][0]["logprobs"] = lp.completion_logprobs(model.tokenizer, entries,
                                                                   0 if echo else len(prompt_text))
        return out
    # a stream checks its arguments here, not at its first chunk
    pieces = model.generate(prompt, stream=True, logprobs=logprobs, **kwargs)
    chunks = CompletionChunks(name, model.tokenizer if logprobs is not None else None, 0 if echo else len(prompt_text))
    echoed = None
    if echo:
        echoed = (prompt_text, lp.prompt_logprobs(model, model._prompt_ids(prompt), logprobs) if logprobs is not None
                  else None)
    return _stream_chunks(pieces, chunks, echoed)


def _stream_chunks(pieces, chunks, first: tuple[str, list | None] | None = None) -> Iterator[dict]:
    """The chunks of a streamed generation (deltaspec.openai_stream): its opening, the `first` text
    (echo: the prompt, with its entries), a chunk per text piece with the log-probabilities of the
    tokens it completes, the rest of them, then finish_reason."""
    yield from chunks.start()
    if first is not None:
        yield from chunks.delta(*first)
    try:
        for text in pieces:
            yield from chunks.delta(text, pieces.take_logprobs())
    finally:
        pieces.close()  # a consumer that stops early cancels the generation
    yield from chunks.delta("", pieces.take_logprobs())
    yield from chunks.finish(pieces.result, include_usage=False)


def apply_chat_template(model, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                        tools=None, chat_template: str | None = None, **template_kwargs: Any) -> str:
    """The prompt text the model sees for `messages` (GGUF template unless chat_template is given)."""
    if chat_template is not None:
        from .chat import ChatTemplate

        template = ChatTemplate(chat_template)
    else:
        template = chat_template_from_metadata(model.metadata)
    return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs)


def create_chat_completion(model, messages: Sequence[Mapping[str, Any]], /, *, stream: bool = False, tools=None,
                           tool_choice: str | Mapping[str, Any] | None = None, parallel_tool_calls: bool = True,
                           chat_template: str | None = None,
                           enable_thinking: bool | None = None, temperature: float = 0.2, max_tokens: int | None = None,
                           logprobs: bool | None = None, top_logprobs: int | None = None,
                           response_format: Mapping[str, Any] | None = None, **kwargs: Any):
    """An OpenAI `chat.completion` dict (reasoning in `reasoning_content`), or chunk dicts when streaming
    (reasoning in `reasoning_content` deltas, as llama-server streams it).
    Defaults follow llama-cpp-python's chat path: temperature 0.2, max_tokens None (until n_ctx).
    logprobs=True (with top_logprobs=k alternatives per token) fills the choice's `logprobs` as
    OpenAI's `{"content": [...]}` (streamed: each chunk's tokens', in the last chunk of its delta).

    Structured output: `response_format` {"type": "json_object"} (optionally with "schema"), or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, or `grammar` (GBNF /
    Lark / deltaspec.Grammar) constrains the whole reply while decoding; the reply is then the
    message content, and thinking is off unless asked for (it cannot be, with a constraint).

    Tools: `tools` go to the chat template; the reply's tool calls (Qwen3.5's <tool_call> blocks,
    deltaspec.tool_calls) come back as the message's `tool_calls`, finish_reason "tool_calls"
    (streamed: `tool_calls` deltas, each call whole); from the model's first <tool_call> the calls
    are held to the tools' form and schemas (deltaspec.tool_call_grammar, llama-server's lazy
    grammar; not beside response_format or grammar). tool_choice "auto" (default: the model decides),
    "none" (no parsing), "required" (one or more calls, or exactly one with parallel_tool_calls=False)
    or {"type": "function", "function": {"name": ...}} (calls of that function): a forced call is
    a grammar on the reply (deltaspec.tool_call_grammar: the reasoning block, if open, then the
    calls alone; with a reasoning_budget it still closes the block), so it cannot be combined with
    response_format or grammar."""
    name = _llama_cpp_options("create_chat_completion", kwargs) or model.path
    _check_kwargs(model, "create_chat_completion", kwargs)
    choice = openai_tool_choice(tool_choice, parallel_tool_calls)
    parsed_tools = tools if tools and choice != "none" else None
    forced = choice if isinstance(choice, ForcedToolCall) else None
    if forced is not None:
        forced_tool_call(forced, tools)
        if response_format is not None or kwargs.get("grammar") is not None:
            raise ValueError("a forced tool call (tool_choice) is a grammar on the reply: it cannot be combined with "
                             "response_format or grammar")
    validate_flag("stream", stream)
    if logprobs is not None and not isinstance(logprobs, bool):
        raise TypeError(f"logprobs must be True, False or None, got {logprobs!r}")
    if top_logprobs is not None and not logprobs:
        raise ValueError("top_logprobs needs logprobs=True")
    n_logprobs = (top_logprobs or 0) if logprobs else None
    constrained = _constrain(kwargs, response_format)
    if constrained:
        if enable_thinking:
            raise ValueError("enable_thinking=True cannot be combined with response_format / grammar: the grammar "
                             "constrains the whole reply, reasoning included")
        enable_thinking = False
    template_kwargs = {} if enable_thinking is None else {"enable_thinking": validate_flag("enable_thinking",
                                                                                           enable_thinking)}
    prompt = apply_chat_template(model, messages, tools=tools, chat_template=chat_template, **template_kwargs)
    # a template that opens reasoning anyway: the constrained reply is still the content
    thinking_open = prompt_opens_reasoning(prompt) and not constrained
    if forced is not None:
        kwargs["grammar"] = tool_call_grammar(tools, forced, thinking_open)
    elif parsed_tools and kwargs.get("grammar") is None and not kwargs.get("ignore_eos"):
        # the calls the model chooses to make, held to the tools from its first <tool_call>
        kwargs["grammar"] = chosen_call_grammar(parsed_tools, parallel_tool_calls)
    if stream:
        pieces = model.generate(prompt, stream=True, temperature=temperature, max_tokens=max_tokens,
                                logprobs=n_logprobs, **kwargs)
        return _stream_chunks(pieces, ChatChunks(name, thinking_open, model.tokenizer if n_logprobs is not None else None,
                                                 parsed_tools))
    r = model.generate(prompt, temperature=temperature, max_tokens=max_tokens, logprobs=n_logprobs, **kwargs)
    reasoning, content = split_reasoning(r.text, thinking_open=thinking_open)
    calls = None
    if parsed_tools and content is not None:
        content, calls = parse_tool_calls(content, parsed_tools)
    out = oai.chat_completion(content, r.finish_reason, name, r.stats.prompt_tokens, r.stats.generated_tokens,
                              reasoning_content=reasoning, tool_calls=calls)
    if n_logprobs is not None:
        out["choices"][0]["logprobs"] = lp.chat_logprobs(model.tokenizer, lp.generated_logprobs(model.tokenizer, r))
    return out


def _constrain(kwargs: dict[str, Any], response_format: Mapping[str, Any] | None) -> bool:
    """Turns response_format into generate()'s `grammar` in kwargs; whether the reply is constrained."""
    grammar = response_format_grammar(response_format)
    if grammar is not None:
        if kwargs.get("grammar") is not None:
            raise ValueError("pass either response_format or grammar, not both")
        kwargs["grammar"] = grammar
    return kwargs.get("grammar") is not None
