"""Request bodies of /v1/completions and /v1/chat/completions, checked field by field.

A body becomes a `GenerationRequest`: prompt token ids, max_tokens, Model.add_request keyword
arguments (sampler, seed, stop) and how to answer (stream, usage). Unknown fields are ignored, as
llama-server ignores them (clients send `user`, `metadata`, ...); known fields of the wrong type or
range, and features the engine cannot serve faithfully (best_of > 1), are refused with 400
naming the field. A completion's `suffix` fills in the middle (deltaspec.fim.wrap: FIM_PRE prompt
FIM_SUF suffix FIM_MID; 400 for a model without FIM tokens). A completion's `prompt` may be an array of prompts (texts or token id arrays, up to MAX_PROMPTS):
each is answered with `n` choices, prompt i's at indices i * n .. i * n + n - 1, as OpenAI orders
them. A completion's `echo` puts the prompt's text before each choice's; with
`logprobs` the prompt's tokens are scored too (their entries come first, the first token's null,
as OpenAI's legacy completions and llama-cpp-python answer: what evaluation harnesses read). `n` choices (1..MAX_CHOICES) run as n requests of the engine, choice i
sampling with seed + i when the request gives a seed. `logprobs` (completions: the number of top alternatives; chat: true, with
`top_logprobs` alternatives) and `logit_bias` ({token id: bias in [-100, 100]}) go to the engine. A chat `response_format` (json_object / json_schema) becomes the
request's grammar, enforced while decoding, and so does a `tool_choice` that forces a call ("required", a
named function: deltaspec.tool_call_grammar); a `prediction` (OpenAI's predicted output) the text the
request's prompt lookup drafts from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from .. import fim
from ..chat import ChatTemplate, prompt_opens_reasoning
from ..errors import ChatTemplateError
from ..generation import validate_stop
from ..sampling import SamplingOptions
from .errors import APIError, bad_request
from .planted import planted

# sampler fields: (name, python types accepted); OpenAI's names plus llama-server's extensions
_NUMBERS = ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty")
_INTEGERS = ("top_k", "penalty_last_n")
COMPLETION_MAX_TOKENS_DEFAULT = 16   # OpenAI's default for /v1/completions (chat: until the context is full)


@dataclass
class Served:
    """What a request is checked against: the model's name, its context and how to make a prompt."""
    name: str
    n_ctx: int
    tokenize: Callable[[str], list[int]]     # text with special tokens parsed
    n_vocab: int
    template: ChatTemplate | None
    aliases: tuple[str, ...] = ()            # other names accepted in `model` (the GGUF path)
    tokenizer: Any = None                    # the model's (log-probabilities name their tokens' text)
    pooling: str = "last"                    # /v1/embeddings: --pooling
    reasoning_budget: int | None = None      # chat requests' default budget of a <think> block: --reasoning-budget
    reasoning_budget_message: str = ""       # what it forces before </think>: --reasoning-budget-message


@dataclass
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    options: dict[str, Any]                  # Model.add_request keyword arguments
    stream: bool
    include_usage: bool
    chat: bool
    thinking_open: bool = False               # the chat prompt opened a <think> block
    logprobs: int | None = None               # top alternatives per token when it asked for logprobs
    n: int = 1                                # choices
    echo: str = ""                            # text put before each choice's (a completion's `echo`)
    prompt_logprobs: bool = False             # echo with logprobs: the prompt's entries too
    # a completion's array of prompts: (token ids, echo) of each, `prompt` and `echo` being the
    # first's; empty for one prompt
    prompts: list[tuple[list[int], str]] = field(default_factory=list)
    # /v1/embeddings: each prompt's final hidden states, pooled into an embedding (server.embeddings)
    hidden_states: bool = False
    encoding_format: str = "float"            # the embeddings' "float" lists or "base64" float32 bytes
    tools: list | None = None                 # a chat's tools when its reply's tool calls are parsed
    context_bound: bool = False               # max_tokens was cut to the room the context leaves
    echoed: dict = field(default_factory=dict)  # request fields the answer repeats (a Responses API response's)

    def choices(self) -> list[GenerationRequest]:
        """One request per choice, n per prompt in the prompts' order: choice i of a prompt samples
        with seed + i (mod 2**64) when a seed was given, so that the choices differ and the answer
        is reproducible (a random seed: each its own)."""
        seed = self.options.get("seed")
        out = []
        for ids, echo in self.prompts or [(self.prompt, self.echo)]:
            if planted("first_prompt_only"):
                ids, echo = self.prompt, self.echo
            one = replace(self, prompt=ids, echo=echo, prompts=[])
            if planted("choices_same_seed"):
                out += [one] * self.n
                continue
            out += [one if i == 0 else replace(one, options={
                **self.options, "seed": None if seed is None else (seed + i) % 2**64}) for i in range(self.n)]
        return out


def _type(x: Any) -> str:
    return "null" if x is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(x), type(x).__name__)


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if planted("no_validation"):
        return value
    if isinstance(value, bool) and bool not in kinds:
        raise bad_request(f"'{name}' must be {what}, got {_type(value)} {value!r}", name, "invalid_type")
    if not isinstance(value, kinds):
        raise bad_request(f"'{name}' must be {what}, got {_type(value)} {str(value)[:40]!r}", name, "invalid_type")
    return value


def _check_body(body: Any, served: Served) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_type(body)}", None, "invalid_body")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request(f"'model' must be a string naming the served model ({served.name!r}), "
                          f"got {_type(model)}", "model", "invalid_type")
    if model != served.name and model not in served.aliases:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served.name!r}",
                       param="model", code="model_not_found")
    best_of = body.get("best_of")
    if best_of is not None and not (type(best_of) is int and best_of == 1):
        raise bad_request(f"'best_of' = {best_of!r} is not supported (choices are not ranked; ask for n of them); "
                          "leave it out", "best_of", "unsupported")
    return body


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs (the engine's top rows hold 64)
MAX_CHOICES = 16       # `n`: each choice is a request of its own, in the queue and in a slot
MAX_PROMPTS = 64       # a completion's array of prompts; with n choices each, at most MAX_PROMPTS requests


def _choices(body: dict) -> int:
    n = _get(body, "n", (int,), "an integer", 1)
    if not planted("no_validation") and not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"'n' must be an integer in [1, {MAX_CHOICES}], got {n}", "n", "invalid_value")
    return n


def _top_count(body: dict, name: str) -> int | None:
    k = _get(body, name, (int,), "an integer")
    if k is not None and not planted("no_validation") and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'{name}' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k}", name, "invalid_value")
    return k


def _completion_logprobs(body: dict) -> int | None:
    """/v1/completions' `logprobs`: how many top alternatives each token lists (None: no logprobs)."""
    return _top_count(body, "logprobs")


def _chat_logprobs(body: dict) -> int | None:
    """/v1/chat/completions' `logprobs` (true or false) and `top_logprobs` (alternatives per token,
    which needs logprobs: true): the alternatives per token, or None for no logprobs."""
    wanted = _get(body, "logprobs", (bool,), "true or false", False)
    k = _top_count(body, "top_logprobs")
    if k and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    return (k or 0) if wanted else None


def _logit_bias(body: dict, served: Served) -> dict[str, Any]:
    """OpenAI's `logit_bias`, {token id (a string of digits, as JSON keys are): bias in [-100, 100]},
    as generate()'s logit_bias (added to the logits after the penalties)."""
    bias = _get(body, "logit_bias", (dict,), "an object mapping token ids to numbers", None)
    if not bias or planted("no_validation"):
        return {"logit_bias": bias} if bias else {}
    out = {}
    for key, value in bias.items():
        if not key.strip().isdigit() or not 0 <= int(key) < served.n_vocab:
            raise bad_request(f"'logit_bias' key {key!r:.40} is not a token id in [0, {served.n_vocab})",
                              "logit_bias", "invalid_value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"'logit_bias' value of token {key} must be a number in [-100, 100], got {value!r:.40}",
                              "logit_bias", "invalid_value")
        out[int(key)] = float(value)
    return {} if planted("bias_ignored") else {"logit_bias": out}


def _sampling(body: dict, chat: bool) -> tuple[dict[str, Any], int | None]:
    """generate() keyword arguments for the sampler, checked; and the seed asked for."""
    values: dict[str, Any] = {}
    for name in _NUMBERS:
        v = _get(body, name, (int, float), "a number")
        if v is not None:
            values[name] = float(v) if not planted("no_validation") else v
    for name in _INTEGERS:
        v = _get(body, name, (int,), "an integer")
        if v is not None:
            values[name] = v
    if chat and "temperature" not in values:
        values["temperature"] = 0.2  # llama-cpp-python's chat default (create_chat_completion's)
    seed = _get(body, "seed", (int,), "an integer")
    if seed is not None and seed < 0:
        seed = None  # llama-server's -1: a random seed
    if not planted("no_validation"):
        try:
            SamplingOptions(**values, seed=seed)
        except ValueError as e:  # its messages start with the parameter's name
            name = str(e).split()[0]
            raise bad_request(str(e), name, "invalid_value") from None
    return values, seed


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if planted("no_validation"):
        return stop or []
    try:
        return validate_stop(stop)
    except (TypeError, ValueError) as e:
        raise bad_request(f"'stop': {e}", "stop", "invalid_type") from None


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", (bool,), "true or false", False)
    opts = _get(body, "stream_options", (dict,), "an object", {})
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request("'stream_options.include_usage' must be true or false", "stream_options", "invalid_type")
    return stream, include_usage


def _prediction(body: dict) -> dict[str, Any]:
    """OpenAI's predicted output, {"type": "content", "content": text or [{"type": "text", "text": ...}]},
    as add_request's `prediction` (the request then drafts by lookup in it; deltaspec.prediction)."""
    prediction = _get(body, "prediction", (dict,), "an object", None)
    if prediction is None or planted("no_validation"):
        return {} if prediction is None else {"prediction": prediction.get("content")}
    if prediction.get("type") != "content":
        raise bad_request(f"'prediction.type' must be \"content\", got {prediction.get('type')!r:.40}",
                          "prediction", "invalid_value")
    content = prediction.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad_request("'prediction.content' as an array must hold text parts "
                              "({\"type\": \"text\", \"text\": ...})", "prediction", "invalid_type")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad_request(f"'prediction.content' must be a string or an array of text parts, got {_type(content)}",
                          "prediction", "invalid_type")
    return {"prediction": content} if content else {}


def _max_tokens(body: dict, names: tuple[str, ...], n_prompt: int, served: Served, default: int | None,
                scored: bool = False) -> int:
    """The completion's token budget, checked against the context; 0 only for `scored` (a completion
    with echo and logprobs: the prompt scored alone, as OpenAI's legacy completions allow)."""
    room = served.n_ctx - n_prompt + 1  # the last token is sampled from the last row, never evaluated
    if n_prompt >= served.n_ctx:
        raise bad_request(f"the prompt has {n_prompt} tokens but the context holds {served.n_ctx} tokens per "
                          "request; shorten the prompt", "messages" if "max_completion_tokens" in names else "prompt",
                          "context_length_exceeded")
    value = None
    for name in names:
        value = _get(body, name, (int,), "a positive integer")
        if value is not None:
            if not planted("no_validation") and value < (0 if scored else 1):
                raise bad_request(f"'{name}' must be a positive integer (0 only with echo and logprobs: the prompt "
                                  f"scored alone), got {value}", name, "invalid_value")
            if value > room:
                raise bad_request(f"this request asks for {n_prompt} prompt tokens + {value} completion tokens but "
                                  f"the context holds {served.n_ctx}; lower '{name}' to at most {room} or shorten "
                                  "the prompt", name, "context_length_exceeded")
            return value
    return room if default is None else min(default, room)


def _prompt_items(prompt: Any, name: str = "prompt") -> list[Any]:
    """A completion's prompts: one (a string, or an array of token ids), or an array of them."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS and not planted("no_validation"):
            raise bad_request(f"'{name}' holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request", name,
                              "invalid_value")
        return list(prompt)
    return [prompt]


def _prompt_ids(prompt: Any, served: Served, name: str = "prompt") -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # OpenAI's batch form with one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"'{name}' is empty", name, "invalid_value")
        ids = served.tokenize(prompt)
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        bad = [t for t in prompt if not 0 <= t < served.n_vocab]
        if bad:
            raise bad_request(f"'{name}' token id {bad[0]} is outside the vocabulary [0, {served.n_vocab})",
                              name, "invalid_value")
        ids = list(prompt)
    else:
        raise bad_request(f"'{name}' must be a string or a non-empty array of token ids, got {_type(prompt)}",
                          name, "invalid_type")
    if planted("prompt_tail") and len(ids) > 1:
        ids = ids[:-1]
    return ids


def _echo(wanted: bool, prompt: Any, ids: list[int], served: Served) -> str:
    """What a completion's `echo` puts before its text: the prompt as sent (token ids decoded)."""
    if not wanted or planted("echo_dropped"):
        return ""
    return prompt if isinstance(prompt, str) else served.tokenizer.decode(ids)


def parse_completion(body: Any, served: Served) -> GenerationRequest:
    body = _check_body(body, served)
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt", "missing")
    items = _prompt_items(body["prompt"])
    all_ids = [_prompt_ids(p, served) for p in items]
    ids = max(all_ids, key=len)  # max_tokens must fit beside the longest
    n = _choices(body)
    if len(items) * n > MAX_PROMPTS and not planted("no_validation"):
        raise bad_request(f"{len(items)} prompts x n = {n} choices make {len(items) * n} requests; at most "
                          f"{MAX_PROMPTS} per request", "n", "invalid_value")
    logprobs = _completion_logprobs(body)
    wants_echo = _get(body, "echo", (bool,), "true or false", False)
    suffix = _get(body, "suffix", (str,), "a string", "")
    if suffix:  # fill in the middle: FIM_PRE prompt FIM_SUF suffix FIM_MID
        if wants_echo:
            raise bad_request("'echo' with 'suffix' is not supported (the prompt evaluated is not the text sent); "
                              "leave one out", "suffix", "unsupported")
        try:
            all_ids = [fim.wrap(served.tokenizer, ids, served.tokenizer.encode(suffix)) for ids in all_ids]
        except fim.FimError as e:
            raise bad_request(f"'suffix': {e}; leave it out", "suffix", "unsupported") from None
        ids = max(all_ids, key=len)
    max_tokens = _max_tokens(body, ("max_tokens",), len(ids), served, COMPLETION_MAX_TOKENS_DEFAULT,
                             scored=wants_echo and logprobs is not None)
    sampling, seed = _sampling(body, chat=False)
    stream, include_usage = _stream(body)
    grammar = _grammar(body)
    options = {**sampling, "seed": seed, "stop": _stop(body), **_prediction(body), **_logit_bias(body, served),
               **({"grammar": grammar} if grammar is not None else {}),
               **({"logprobs": logprobs} if logprobs is not None else {})}
    prompts = [(p_ids, _echo(wants_echo, p, p_ids, served)) for p, p_ids in zip(items, all_ids)]
    return GenerationRequest(prompts[0][0], max_tokens, options, stream, include_usage, chat=False, logprobs=logprobs,
                             n=n, echo=prompts[0][1], prompt_logprobs=wants_echo and logprobs is not None,
                             prompts=prompts if len(prompts) > 1 else [])


def response_format_grammar(body: dict):
    """The grammar of a chat request's `response_format` (json_object, with llama-cpp-python's optional
    "schema", or json_schema), or None for text; a format that does not compile is a 400."""
    from ..errors import GrammarError
    from ..grammar import response_format_grammar as compile_format

    response_format = _get(body, "response_format", (dict,), "an object", None)
    try:
        return compile_format(response_format)
    except GrammarError as e:
        raise bad_request(f"'response_format': {e}", "response_format", "invalid_response_format") from None


def chat_prompt(body: dict, served: Served, constrained: bool = False) -> str:
    """The prompt text of a chat request: its messages (and tools) through the chat template. A
    constrained reply (response_format) starts with its JSON: the template opens no reasoning block."""
    if served.template is None:
        raise bad_request("the model file has no chat template; start the server with --chat-template-file, "
                          "or use /v1/completions", "messages", "no_chat_template")
    if "messages" not in body:
        raise bad_request("'messages' is required", "messages", "missing")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request(f"'tools' must be an array, got {_type(tools)}", "tools", "invalid_type")
    kwargs = dict(_get(body, "chat_template_kwargs", (dict,), "an object", {}))  # llama-server's field
    thinking = _get(body, "enable_thinking", (bool,), "true or false")
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    if constrained:
        if kwargs.get("enable_thinking") is True:
            raise bad_request("'response_format' cannot be combined with enable_thinking: true (the grammar "
                              "constrains the whole reply, which then has no reasoning block)", "response_format",
                              "unsupported")
        kwargs["enable_thinking"] = False
    try:
        return served.template.render(body["messages"], add_generation_prompt=True, tools=tools, **kwargs)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages", "invalid_messages") from None


def parse_chat(body: Any, served: Served) -> GenerationRequest:
    body = _check_body(body, served)
    for name in ("echo", "suffix"):
        if body.get(name) not in (None, False, ""):
            raise bad_request(f"'{name}' is a completion's field; a chat completion takes messages", name, "unsupported")
    grammar = response_format_grammar(body)
    if body.get("grammar") is not None:
        if grammar is not None:
            raise bad_request("'grammar' and 'response_format' both constrain the reply; send one", "grammar",
                              "invalid_value")
        grammar = _grammar(body)
    tools, forced = _tool_choice(body)
    check_forced_call(forced, body.get("tools"), grammar is not None, "'response_format' or 'grammar'")
    prompt = chat_prompt(body, served, constrained=grammar is not None)
    thinking_open = prompt_opens_reasoning(prompt)
    ids = _prompt_ids(prompt, served)
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), len(ids), served, None)
    sampling, seed = _sampling(body, chat=True)
    stream, include_usage = _stream(body)
    logprobs = _chat_logprobs(body)
    options = {**sampling, "seed": seed, "stop": _stop(body), **_prediction(body), **_logit_bias(body, served),
               **({"grammar": grammar} if grammar is not None else {}),
               **({"logprobs": logprobs} if logprobs is not None else {}),
               **reasoning_budget(body, served, grammar is not None, thinking_open)}
    options.update(tool_call_options(tools, forced, body.get("parallel_tool_calls", True), thinking_open, options))
    return GenerationRequest(ids, max_tokens, options, stream, include_usage, chat=True,
                             thinking_open=thinking_open, logprobs=logprobs, n=_choices(body),
                             tools=tools)


def reasoning_budget(body: dict, served: Served, constrained: bool, thinking_open: bool,
                     asked: int | None = None) -> dict[str, Any]:
    """add_request's reasoning_budget for a chat request: llama-server's `reasoning_budget_tokens`
    (alias `thinking_budget_tokens`; -1: none asked), or `asked` (Anthropic's budget_tokens), else
    the server's --reasoning-budget; none for a constrained reply (the grammar leaves no <think>
    block), where asking for one is a 400, nor for a prompt that opens no block (thinking off: the
    budget would only cost the request its fast path). With it, llama-server's
    `reasoning_budget_message` (else --reasoning-budget-message): the text forced before </think>."""
    names = [n for n in ("reasoning_budget_tokens", "thinking_budget_tokens") if body.get(n) is not None]
    if names:
        value = body[names[0]]
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise bad_request(f"'{names[0]}' must be -1 (no budget) or an integer >= 0, got {value!r:.40}", names[0],
                              "invalid_value")
        if value >= 0:
            asked = value
    if asked is not None and constrained:
        raise bad_request("a reasoning budget cannot be combined with a grammar or response format (it constrains "
                          "the whole reply, which then has no reasoning block)", names[0] if names else "thinking",
                          "invalid_value")
    budget = asked if asked is not None else served.reasoning_budget
    message = _get(body, "reasoning_budget_message", (str,), "a string", served.reasoning_budget_message)
    if budget is None or constrained or not thinking_open:
        return {}
    return {"reasoning_budget": budget, **({"reasoning_budget_message": message} if message else {})}


def _tool_choice(body: dict):
    """(the tools whose calls the reply is parsed for (deltaspec.tool_calls): the request's, unless
    tool_choice is "none"; the call tool_choice forces, or None): OpenAI's tool_choice "auto",
    "none", "required" or {"type": "function", "function": {"name": ...}}, with parallel_tool_calls."""
    from ..tool_call_grammar import ForcedToolCall, openai_tool_choice

    try:
        choice = openai_tool_choice(body.get("tool_choice"), body.get("parallel_tool_calls", True))
    except ValueError as e:
        raise bad_request(str(e), "parallel_tool_calls" if str(e).startswith("parallel") else "tool_choice",
                          "invalid_value") from None
    tools = body.get("tools")
    return (tools if tools and choice != "none" else None), choice if isinstance(choice, ForcedToolCall) else None


def check_forced_call(forced, tools, constrained: bool, constraints: str) -> None:
    """A call tool_choice forces (None: none), checked: tools to call, the named one among them, and
    no other grammar on the reply (`constrained`; `constraints` names the fields that would be one)."""
    if forced is None:
        return
    from ..tool_call_grammar import forced_tool_call

    if constrained:
        raise bad_request(f"a forced tool call ('tool_choice') is a grammar on the reply: it cannot be combined with "
                          f"{constraints}", "tool_choice", "invalid_value")
    try:
        forced_tool_call(forced, tools)
    except ValueError as e:
        raise bad_request(f"'tool_choice': {e}", "tool_choice", "invalid_value") from None


def tool_call_options(tools: list | None, forced, parallel: bool, thinking_open: bool, options: dict) -> dict:
    """generate()'s `grammar` for the reply's tool calls (deltaspec.tool_call_grammar): a forced
    call's (its reasoning, when the prompt opens a block (`thinking_open`), free: a reasoning budget still
    applies), or, where the reply is parsed for `tools` and `options` hold no other grammar, that of
    the calls the model chooses to make (llama-server's lazy grammar: from the first <tool_call>)."""
    from ..errors import GrammarError
    from ..tool_call_grammar import chosen_call_grammar, tool_call_grammar

    try:
        if forced is not None:
            return {"grammar": tool_call_grammar(tools, forced, thinking_open)}
        if not tools or options.get("grammar") is not None or options.get("ignore_eos"):
            return {}
        return {"grammar": chosen_call_grammar(tools, parallel)}
    except (GrammarError, ValueError) as e:  # a parameter's schema llguidance cannot read, a name the form cannot carry
        raise bad_request(f"'tools': {e}", "tools", "invalid_value") from None


def _grammar(body: dict):
    """llama-server's `grammar` field: a GBNF grammar (or llguidance Lark) the reply must match."""
    from ..errors import GrammarError
    from ..grammar import grammar_of

    text = _get(body, "grammar", (str,), "a string (a GBNF grammar)")
    try:
        return grammar_of(text) if text else None
    except GrammarError as e:
        raise bad_request(f"'grammar': {e}", "grammar", "invalid_grammar") from None
