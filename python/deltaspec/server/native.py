"""llama-server's own generation endpoints, in its request and answer shapes: POST /completion
(`prompt`: text, special tokens parsed, or token ids) and POST /infill (what editor plugins such as
llama.vim and llama.vscode call: a fill-in-the-middle prompt built as llama-server builds it,
deltaspec.fim, from `input_prefix`, `input_suffix`, `input_extra` ([{"text", "filename"}]) and
`prompt`). Both generate like a completion (`n_predict`, -1 by default: until the context is full;
the sampler fields, `repeat_last_n`, `seed`, `stop`, `ignore_eos`, `logit_bias` as
{"token id": bias}, `stream`; fields it has and we do not, such as `cache_prompt` or
`t_max_predict_ms`, are ignored) and answer in llama-server's shape: {"content", "stop": true, "stop_type"
("eos", "word", "limit", "none"), "stopping_word", "tokens_predicted", "tokens_evaluated",
"tokens_cached", "truncated", "model", "timings"}; streamed, a {"content", "stop": false} event
per piece and that object (with empty content) last, no [DONE]. A model without FIM tokens
answers 501, as llama-server does; bad fields are 400s naming them.
"""

from __future__ import annotations

from typing import Any, Iterator

from ..fim import FimError, infill_ids
from ..generation import GenerationResult
from .errors import APIError, bad_request
from .planted import planted
from .schemas import (GenerationRequest, Served, _check_body, _get, _grammar, _logit_bias, _prompt_ids, _sampling,
                      _stop, _type)


def _native_body(body: Any, served: Served) -> dict:
    # llama-server's own endpoints take no model name (one model a server): any `model` is ignored
    return _check_body({**body, "model": served.name} if isinstance(body, dict) else body, served)


def parse_completion_native(body: Any, served: Served) -> GenerationRequest:
    body = _native_body(body, served)
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt", "missing")
    ids = _prompt_ids(body["prompt"], served)
    if len(ids) >= served.n_ctx:
        raise bad_request(f"the prompt has {len(ids)} tokens but the context holds {served.n_ctx} tokens per "
                          "request; shorten it", "prompt", "context_length_exceeded")
    return _generation(body, served, ids)


def parse_infill(body: Any, served: Served) -> GenerationRequest:
    body = _native_body(body, served)
    texts = {}
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise bad_request(f"'{name}' is required", name, "missing")
        texts[name] = _get(body, name, (str,), "a string", "")
    if planted("infill_suffix_dropped"):
        texts["input_suffix"] = ""
    prompt = _get(body, "prompt", (str,), "a string", "")
    extra = _get(body, "input_extra", (list,), "an array of {\"filename\": string, \"text\": string}", [])
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str) or \
                not isinstance(chunk.get("filename", ""), str):
            raise bad_request(f"'input_extra' entries must be {{\"text\": string, \"filename\": string}}, got "
                              f"{_type(chunk)} {str(chunk)[:40]!r}", "input_extra", "invalid_type")
    try:
        ids = infill_ids(served.tokenizer, texts["input_prefix"], texts["input_suffix"], served.n_ctx, prompt, extra)
    except FimError as e:
        raise APIError(501, f"infill is not supported by this model: {e}", code="not_supported") from None
    if len(ids) >= served.n_ctx:  # (a long `prompt`: the prefix and suffix are cut to fit)
        raise bad_request(f"the infill prompt has {len(ids)} tokens but the context holds {served.n_ctx} tokens per "
                          "request; shorten 'prompt'", "prompt", "context_length_exceeded")
    return _generation(body, served, ids)


def _generation(body: dict, served: Served, ids: list[int]) -> GenerationRequest:
    """The request for prompt `ids` from llama-server's generation fields."""
    room = served.n_ctx - len(ids) + 1
    n_predict = _get(body, "n_predict", (int,), "an integer (-1: until the context is full)", -1)
    if n_predict == 0 or n_predict < -1:
        raise bad_request(f"'n_predict' must be -1 or a positive integer, got {n_predict}", "n_predict", "invalid_value")
    sampling, seed = _sampling(body, chat=False)
    last_n = _get(body, "repeat_last_n", (int,), "an integer")
    if last_n is not None:  # llama-server's name for penalty_last_n
        sampling["penalty_last_n"] = last_n
    stream = _get(body, "stream", (bool,), "true or false", False)
    ignore_eos = _get(body, "ignore_eos", (bool,), "true or false", False)
    grammar = _grammar(body)
    options = {**sampling, "seed": seed, "stop": _stop(body), **_logit_bias(body, served),
               **({"ignore_eos": True} if ignore_eos else {}), **({"grammar": grammar} if grammar is not None else {})}
    return GenerationRequest(ids, room if n_predict == -1 else min(n_predict, room), options, stream,
                             include_usage=False, chat=False)


def stop_type(result: GenerationResult, tokenizer, stops: list[str]) -> tuple[str, str]:
    """llama-server's stop_type and stopping_word of a finished request."""
    if result.finish_reason == "length":
        return "limit", ""
    if result.finish_reason == "cancelled":
        return "none", ""
    if result.tokens and tokenizer.is_eog(result.tokens[-1]):
        return "eos", ""
    rest = tokenizer.decode(result.tokens, special=False)[len(result.text):]
    return "word", next((s for s in stops if rest.startswith(s)), "")


def native_body(result: GenerationResult, model: str, tokenizer, stops: list[str]) -> dict:
    s = result.stats
    kind, word = stop_type(result, tokenizer, stops)
    prompt_n = s.prompt_tokens - s.cached_tokens
    predicted_ms = 1e3 * s.decode_seconds
    return {"index": 0, "content": result.text, "tokens": [], "id_slot": -1, "stop": True, "model": model,
            "tokens_predicted": s.generated_tokens, "tokens_evaluated": s.prompt_tokens, "truncated": False,
            "stop_type": kind, "stopping_word": word, "tokens_cached": s.cached_tokens,
            "timings": {"cache_n": s.cached_tokens, "prompt_n": prompt_n, "prompt_ms": 1e3 * s.prefill_seconds,
                        "prompt_per_second": s.prefill_tokens_per_second,
                        "predicted_n": s.generated_tokens, "predicted_ms": predicted_ms,
                        "predicted_per_second": s.tokens_per_second}}


class NativeChunks:
    """A streamed /completion's or /infill's events, as the stream builders of
    deltaspec.openai_stream make theirs."""

    def __init__(self, model: str, tokenizer, stops: list[str], n_prompt: int):
        self.model, self._tokenizer, self._stops, self._n_prompt = model, tokenizer, stops, n_prompt
        self._n = 0

    def start(self) -> Iterator[dict]:
        return iter(())

    def delta(self, text: str, entries: list | None = None) -> Iterator[dict]:
        if text:
            self._n += 1
            yield {"index": 0, "content": text, "tokens": [], "stop": False, "id_slot": -1,
                   "tokens_predicted": self._n, "tokens_evaluated": self._n_prompt}

    def finish(self, result: GenerationResult, include_usage: bool) -> Iterator[dict]:
        yield {**native_body(result, self.model, self._tokenizer, self._stops), "content": ""}
