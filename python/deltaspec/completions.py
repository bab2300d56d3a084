"""llama-cpp-python style `create_completion` / `create_chat_completion` over Model.generate."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

from . import openai_format as oai
from .chat import chat_template_from_metadata, prompt_opens_reasoning, split_reasoning


def create_completion(model, prompt: str | Sequence[int], *, stream: bool = False, **kwargs: Any):
    """An OpenAI `text_completion` dict, or an iterator of chunk dicts when stream=True."""
    name = model.path
    if not stream:
        r = model.generate(prompt, **kwargs)
        return oai.completion(r.text, r.finish_reason, name, r.stats.prompt_tokens, r.stats.generated_tokens)
    pieces = model.generate(prompt, stream=True, **kwargs)
    return _completion_chunks(pieces, name)


def _completion_chunks(pieces, name: str) -> Iterator[oai.Completion]:
    cid, created = oai.completion_id(), oai.now()
    try:
        for text in pieces:
            yield oai.completion_chunk(text, None, name, cid, created)
    finally:
        pieces.close()  # a consumer that stops early cancels the generation
    yield oai.completion_chunk("", pieces.result.finish_reason, name, cid, created)


def apply_chat_template(model, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                        tools=None, chat_template: str | None = None, **template_kwargs: Any) -> str:
    """The prompt text the model sees for `messages` (GGUF template unless chat_template is given)."""
    if chat_template is not None:
        from .chat import ChatTemplate

        template = ChatTemplate(chat_template)
    else:
        template = chat_template_from_metadata(model.metadata)
    return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs)


def create_chat_completion(model, messages: Sequence[Mapping[str, Any]], *, stream: bool = False, tools=None,
                           chat_template: str | None = None, enable_thinking: bool | None = None,
                           temperature: float = 0.2, max_tokens: int | None = None, **kwargs: Any):
    """An OpenAI `chat.completion` dict (reasoning in `reasoning_content`), or chunk dicts when streaming.
    Defaults follow llama-cpp-python's chat path: temperature 0.2, max_tokens None (until n_ctx)."""
    template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    prompt = apply_chat_template(model, messages, tools=tools, chat_template=chat_template, **template_kwargs)
    name = model.path
    if stream:
        pieces = model.generate(prompt, stream=True, temperature=temperature, max_tokens=max_tokens, **kwargs)
        return oai.chat_chunks(_completion_chunks(pieces, name))
    r = model.generate(prompt, temperature=temperature, max_tokens=max_tokens, **kwargs)
    reasoning, content = split_reasoning(r.text, thinking_open=prompt_opens_reasoning(prompt))
    return oai.chat_completion(content, r.finish_reason, name, r.stats.prompt_tokens, r.stats.generated_tokens,
                               reasoning_content=reasoning)
