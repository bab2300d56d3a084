"""Tool-call grammars (deltaspec.tool_call_grammar): a forced call (tool_choice "required" / a named
function in OpenAI chat and Responses, Anthropic's {"type": "any"} / {"type": "tool"}) makes the
reply a call; with tool_choice "auto" the calls the model chooses to make are held to the tools
from its first <tool_call> (llama-server's lazy grammar; deltaspec.lazy_grammar).

The claims: the grammar accepts exactly the calls the model's own chat template writes (an
assistant message's tool_calls rendered by Qwen3.5's template from the pinned llama.cpp tree: the
reference for the form), parameters in any order, with the reasoning block before them when the
prompt opened one, and refuses a call of another function than the named one, a missing required
parameter, a value outside its schema, text before a forced call, a second call where parallel
calls are off; end to end on the tiny real-vocabulary model (random weights, which left alone never
write a call: checked), every seed's forced reply is a call whose arguments validate against the
tool's schema (jsonschema), with finish_reason "tool_calls"; a reasoning budget still closes the
block before the call; the lazy grammar leaves the rows before <tool_call> free (all ones, not
masked, so they keep the device's argmax / top rows) and masks the ones after it as the grammar
does, also across drafts (chains, trees, prompt lookup: plain greedy's tokens); a model pushed to
open a call (a logit bias) then writes a valid one, where alone it writes none that parses; the
three server routes answer with the call, and refuse a forced call without tools, of an unknown
function, or beside a response format.

Seen red: with tool_call_grammar ignoring the named function (every tool allowed), the named test
failed (a call of get_weather); with `parallel` ignored, the single-call test failed (two calls
accepted); with BothConstraints leaving the budget's mask out (the grammar alone), the budget test
failed (the reasoning ran to max_tokens, no call); with BothConstraints giving the budget no drafts
(its verify rows masked with the state before them), the speculation test failed; with the server
routes dropping the forced grammar, the server test failed (no call: text). The lazy grammar:
with allows_every_token always True, and with the trigger never starting the grammar, the chosen
call test failed (no valid call); with the rows after a drafted trigger shifted by one, the unit
and speculation tests failed; with the drafts ignored (a drafted trigger's rows left free), the
speculation test failed; with the chat route attaching no lazy grammar, the server test failed.
"""

from __future__ import annotations

import json

import pytest

import numpy as np

from deltaspec.tool_call_grammar import ForcedToolCall, chosen_call_grammar, openai_tool_choice, tool_call_grammar

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"type": "string", "enum": ["C", "F"]}}, "required": ["city", "days"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Adds", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "Weather in Paris for two days?"}]


@pytest.fixture(scope="module")
def model(chat_gguf):
    from deltaspec import Model

    with Model(chat_gguf, n_ctx=1024, n_threads=2) as m:
        yield m


def _rendered_calls(model, calls: list[dict]) -> str:
    """The text the chat template writes for an assistant message making `calls` (after its
    generation prompt with thinking off): what a forced reply must be able to be."""
    from deltaspec.completions import apply_chat_template

    head = apply_chat_template(model, MESSAGES, tools=TOOLS, enable_thinking=False)
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    whole = apply_chat_template(model, MESSAGES + [message], tools=TOOLS, add_generation_prompt=False,
                                enable_thinking=False)
    # the history's assistant turn: its empty reasoning block, then the calls, then <|im_end|>
    turn = whole[whole.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
    assert turn.endswith("<|im_end|>\n") and head.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    return turn[:-len("<|im_end|>\n")].split("</think>", 1)[1].lstrip("\n")


def _allows(model, grammar, text: str) -> bool:
    """Whether the grammar allows `text` (tokenized as the model writes it) as a whole reply."""
    from deltaspec.constraint import GrammarConstraint

    c = GrammarConstraint(model.tokenizer, grammar)
    ids = model.tokenize(text, special=True)
    if c.check_draft(ids) != len(ids):
        return False
    for t in ids:
        c.commit(t)
    return c.is_accepting


def test_the_grammar_is_the_templates_call_form(model):
    one = _rendered_calls(model, [("get_weather", {"city": "Paris", "days": 2})])
    two = _rendered_calls(model, [("get_weather", {"city": "Rome", "days": 3, "unit": "F"}), ("add", {"a": 1, "b": 2})])
    assert one.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>")
    required = tool_call_grammar(TOOLS, ForcedToolCall(), thinking_open=False)
    assert _allows(model, required, one) and _allows(model, required, two)
    single = tool_call_grammar(TOOLS, ForcedToolCall(parallel=False), thinking_open=False)
    assert _allows(model, single, one) and not _allows(model, single, two)
    named = tool_call_grammar(TOOLS, ForcedToolCall("add"), thinking_open=False)
    assert _allows(model, named, _rendered_calls(model, [("add", {"a": 4, "b": 50})]))
    assert not _allows(model, named, one)
    for wrong in ([("get_weather", {"city": "Paris"})],                 # a required parameter missing
                  [("get_weather", {"city": "Oslo", "days": 2})],       # outside the enum
                  [("get_weather", {"city": "Paris", "days": 20})],     # above the maximum
                  [("get_weather", {"city": "Paris", "days": "two"})]):  # not an integer
        assert not _allows(model, required, _rendered_calls(model, wrong)), wrong
    assert not _allows(model, required, "Sure.\n" + one)  # text before the call
    assert not _allows(model, required, "")               # no call at all
    # past 64 parameters (the parametric rule's bits) the schema's order: required, then optional
    wide = [{"type": "function", "function": {"name": "wide", "parameters": {"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(70)}, "required": ["p5"]}}}]
    wide_grammar = tool_call_grammar(wide, ForcedToolCall(), thinking_open=False)
    block = lambda *ps: ("<tool_call>\n<function=wide>\n" + "".join(f"<parameter={p}>\n1\n</parameter>\n" for p in ps)
                         + "</function>\n</tool_call>")
    assert _allows(model, wide_grammar, block("p5", "p0", "p69")) and not _allows(model, wide_grammar, block("p0", "p5"))
    assert not _allows(model, wide_grammar, block("p0"))
    thinking = tool_call_grammar(TOOLS, ForcedToolCall(), thinking_open=True)
    assert thinking.free_reasoning and _allows(model, thinking, "Let me see: Paris.\n</think>\n\n" + one)
    assert not _allows(model, thinking, one)  # the open block is closed first


def _check_calls(calls: list[dict], names=("get_weather", "add")) -> None:
    assert calls
    for call in calls:
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_every_sampled_reply_is_a_valid_call(model):
    n_calls = 0
    for seed in range(12):
        free = model.create_chat_completion(MESSAGES, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=48,
                                            enable_thinking=False)
        assert not free["choices"][0]["message"].get("tool_calls")  # left alone the random model never calls
        # one call: the reply ends after it
        out = model.create_chat_completion(MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                           temperature=1.0, seed=seed, max_tokens=200, enable_thinking=False)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None and len(choice["message"]["tool_calls"]) == 1
        _check_calls(choice["message"]["tool_calls"])
        # parallel calls: the (random) model decides when to stop calling, so max_tokens may cut a last one
        out = model.create_chat_completion(MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                                           max_tokens=200, enable_thinking=False)
        choice = out["choices"][0]
        assert choice["finish_reason"] in ("tool_calls", "length"), choice
        _check_calls(choice["message"]["tool_calls"])
        n_calls += len(choice["message"]["tool_calls"])
    assert n_calls > 12  # more than one call in some replies


def test_a_named_function_and_a_single_call(model):
    for seed in range(6):
        out = model.create_chat_completion(MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {
            "name": "add"}}, parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200,
            enable_thinking=False)
        calls = out["choices"][0]["message"]["tool_calls"]
        assert len(calls) == 1
        _check_calls(calls, names=("add",))
    ask = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200,
               enable_thinking=False)
    whole = model.create_chat_completion(MESSAGES, **ask)["choices"][0]["message"]["tool_calls"]
    streamed = list(model.create_chat_completion(MESSAGES, stream=True, **ask))
    assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"
    calls = [tc for c in streamed for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"] for c in calls] == [c["function"] for c in whole]
    _check_calls(calls)


def test_a_reasoning_budget_closes_the_block_before_the_call(model):
    ask = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200)
    out = model.create_chat_completion(MESSAGES, reasoning_budget=6, **ask)
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] and out["choices"][0]["finish_reason"] == "tool_calls"
    assert len(model.tokenize(message["reasoning_content"], special=True)) <= 6 + 2
    _check_calls(message["tool_calls"])
    # without the budget the random model's reasoning fills max_tokens: the budget is what ended it
    free = model.create_chat_completion(MESSAGES, **ask)
    assert free["choices"][0]["finish_reason"] == "length" and not free["choices"][0]["message"].get("tool_calls")


def test_speculation_and_batches_give_the_same_call(model, chat_gguf, monkeypatch):
    """The grammar and the budget together (BothConstraints) under a draft model's chains and trees,
    prompt lookup (which drafts the forced text) and a batch: plain greedy's tokens."""
    from deltaspec import Model, Grammar
    from deltaspec.completions import apply_chat_template
    from deltaspec.lazy_grammar import LazyGrammarConstraint

    prompt = apply_chat_template(model, MESSAGES, tools=TOOLS)
    grammar = tool_call_grammar(TOOLS, ForcedToolCall(parallel=False), thinking_open=True)
    ask = dict(max_tokens=160, temperature=0, grammar=grammar, reasoning_budget=5)
    want = model.generate(prompt, **ask)
    assert want.finish_reason == "stop" and "</tool_call>" in want.text
    with Model(chat_gguf, n_ctx=1024, n_threads=1) as draft:
        for spec in (dict(draft_model=draft, draft_n_max=6), dict(draft_model=draft, draft_n_max=6, tree_budget=10),
                     dict(spec_type="ngram-simple", draft_n_max=8)):
            r = model.generate(prompt, **ask, **spec)
            assert r.tokens == want.tokens, spec
            assert r.stats.n_drafted > 0, spec
        # the lazy grammar: drafts cross the trigger (free rows, then the call's)
        no_think = apply_chat_template(model, MESSAGES, tools=TOOLS, enable_thinking=False)
        lazy = dict(max_tokens=160, temperature=0, grammar=chosen_call_grammar(TOOLS, parallel=False),
                    logit_bias={_trigger(model): 12})
        want_lazy = model.generate(no_think, **lazy)
        assert want_lazy.finish_reason == "stop" and want_lazy.tokens.index(_trigger(model)) > 0
        for spec in (dict(draft_model=draft, draft_n_max=6), dict(draft_model=draft, draft_n_max=6, tree_budget=10),
                     dict(spec_type="ngram-simple", draft_n_max=8)):
            r = model.generate(no_think, **lazy, **spec)
            assert r.tokens == want_lazy.tokens, spec
            assert r.stats.n_drafted > 0, spec
            # the scheduler's verify (generate_batch, the server): the same rounds and rows
            [b] = model.generate_batch([no_think], **lazy, **spec)
            assert b.tokens == want_lazy.tokens and b.stats.accepted_lengths == r.stats.accepted_lengths, spec
            assert b.stats.grammar_masked_rows == r.stats.grammar_masked_rows, spec
            # rows along drafts without the trigger were left free: with every row masked (the
            # constraint never saying so), the same tokens and rounds, more rows masked
            with monkeypatch.context() as patch:
                patch.setattr(LazyGrammarConstraint, "allows_every_token", lambda self, along=(): False)
                masked_all = model.generate(no_think, **lazy, **spec)
            assert masked_all.tokens == r.tokens and masked_all.stats.accepted_lengths == r.stats.accepted_lengths
            assert r.stats.grammar_masked_rows < masked_all.stats.grammar_masked_rows, spec
    plain = model.generate(prompt, max_tokens=160, temperature=0, grammar=Grammar.json_object())
    batch = model.generate_batch([prompt, prompt], per_prompt=[ask, {"grammar": Grammar.json_object()}],
                                 max_tokens=160, temperature=0)
    assert batch[0].tokens == want.tokens and batch[1].tokens == plain.tokens


# --- the calls the model chooses to make (tool_choice "auto": the lazy grammar) ------------------

def _trigger(model) -> int:
    [tool_call] = model.tokenize("<tool_call>", special=True)
    return tool_call


def test_the_lazy_grammar_is_free_until_the_call(model):
    """LazyGrammarConstraint against the grammar it wraps: rows up to the trigger's are all ones
    (and say so), the rows after it are a fresh matcher's, drafts are cut where the grammar cuts them."""
    from deltaspec.constraint import GrammarConstraint
    from deltaspec.lazy_grammar import LazyGrammarConstraint
    from deltaspec.tool_call_grammar import chosen_call_grammar

    grammar = chosen_call_grammar(TOOLS, parallel=False)
    call = _rendered_calls(model, [("add", {"a": 4, "b": 50})])
    text = model.tokenize("Let me add them.\n", special=True)
    ids = model.tokenize(call, special=True)
    assert ids[0] == _trigger(model)
    lazy, plain = LazyGrammarConstraint(model.tokenizer, grammar), GrammarConstraint(model.tokenizer, grammar)
    words = (model.n_vocab + 31) // 32
    drafts = text + ids
    masks = np.zeros((len(drafts) + 1, words), dtype=np.uint32)
    lazy.fill_masks(masks, drafts)
    want = np.zeros((len(ids) + 1, words), dtype=np.uint32)
    plain.fill_masks(want, ids)
    assert (masks[:len(text) + 1] == 0xFFFFFFFF).all()  # the text's rows and the trigger's own
    assert (masks[len(text) + 1:] == want[1:]).all()
    assert lazy.check_draft(drafts) == len(drafts)
    wrong = model.tokenize(call.replace("<function=add>", "<function=sub>"), special=True)
    cut = next(i for i, (a, b) in enumerate(zip(ids, wrong)) if a != b)
    assert lazy.check_draft(text + wrong) == len(text) + cut
    for t in text:
        assert lazy.allows_every_token()
        lazy.commit(t)
    for t in ids:
        lazy.commit(t)
        assert not lazy.allows_every_token()
    assert lazy.is_accepting


def test_a_chosen_call_is_held_to_the_tools(model):
    """A bias on <tool_call> makes the random model open a call after some text; from there the lazy
    grammar holds it: every reply has its text as content and a valid call, and only the rows
    after <tool_call> were masked. The same text without the grammar (generate() on the prompt)
    has no call that parses."""
    from deltaspec.completions import apply_chat_template
    from deltaspec.tool_calls import parse_tool_calls

    prompt = apply_chat_template(model, MESSAGES, tools=TOOLS, enable_thinking=False)
    for bias, seed in ((10, 0), (10, 2), (12, 1), (15, 3)):
        ask = dict(tools=TOOLS, parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200,
                   enable_thinking=False, logit_bias={_trigger(model): bias})
        out = model.create_chat_completion(MESSAGES, **ask)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"], (bias, choice)
        _check_calls(choice["message"]["tool_calls"])
        alone = model.generate(prompt, max_tokens=200, temperature=1.0, seed=seed, logit_bias={_trigger(model): bias})
        assert "<tool_call>" in alone.text and parse_tool_calls(alone.text, TOOLS)[1] == [], bias
    r = model.generate(prompt, max_tokens=200, temperature=0, logit_bias={_trigger(model): 12},
                       grammar=chosen_call_grammar(TOOLS, parallel=False))
    n_text = r.tokens.index(_trigger(model))
    assert n_text > 0 and r.stats.grammar_masked_rows == len(r.tokens) - n_text - 1  # the rows after it alone


def test_bad_choices(model):
    for choice, words in (({"type": "function", "function": {"name": "nope"}}, "not among the tools"),
                          ({"type": "function"}, "tool_choice must be"), ("always", "tool_choice must be")):
        with pytest.raises(ValueError, match=words):
            model.create_chat_completion(MESSAGES, tools=TOOLS, tool_choice=choice)
    with pytest.raises(ValueError, match="needs tools"):
        model.create_chat_completion(MESSAGES, tool_choice="required")
    with pytest.raises(ValueError, match="response_format"):
        model.create_chat_completion(MESSAGES, tools=TOOLS, tool_choice="required",
                                     response_format={"type": "json_object"})
    with pytest.raises(ValueError, match="parallel_tool_calls"):
        openai_tool_choice("required", parallel="yes")
    bad_name = [{"type": "function", "function": {"name": "a<b", "parameters": {}}}]
    with pytest.raises(ValueError, match="tools\\[0\\]"):
        tool_call_grammar(bad_name, ForcedToolCall(), thinking_open=False)


def test_server_routes_make_the_call(chat_gguf, model):
    pytest.importorskip("starlette")
    from test_server import ServerProcess, post

    s = ServerProcess(chat_gguf, "-np", "2", "-c", "1024")
    try:
        def ask(route: str, body: dict) -> tuple[int, dict]:
            return post(f"{s.url}{route}", json.dumps({"model": "tiny-chat", **body}).encode())

        status, chat = ask("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                                                    "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0,
                                                    "chat_template_kwargs": {"enable_thinking": False}})
        assert status == 200 and chat["choices"][0]["finish_reason"] == "tool_calls", chat
        _check_calls(chat["choices"][0]["message"]["tool_calls"])
        # tool_choice auto: the model opens the call (a bias on <tool_call>), the lazy grammar holds it
        status, chat = ask("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "parallel_tool_calls": False,
                                                    "max_tokens": 200, "temperature": 0,
                                                    "logit_bias": {str(_trigger(model)): 12},
                                                    "chat_template_kwargs": {"enable_thinking": False}})
        assert status == 200 and chat["choices"][0]["finish_reason"] == "tool_calls", chat
        assert chat["choices"][0]["message"]["content"]
        _check_calls(chat["choices"][0]["message"]["tool_calls"])

        anthropic_tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
        status, msg = ask("/v1/messages", {"messages": MESSAGES, "tools": anthropic_tools, "max_tokens": 200,
                                           "temperature": 0, "thinking": {"type": "disabled"},
                                           "tool_choice": {"type": "tool", "name": "add",
                                                           "disable_parallel_tool_use": True}})
        assert status == 200 and msg["stop_reason"] == "tool_use", msg
        [use] = [b for b in msg["content"] if b["type"] == "tool_use"]
        assert use["name"] == "add"
        jsonschema.validate(use["input"], ADD)

        responses_tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                           for t in TOOLS]
        status, resp = ask("/v1/responses", {"input": "Weather in Paris?", "tools": responses_tools,
                                             "tool_choice": "required", "parallel_tool_calls": False,
                                             "max_output_tokens": 200, "temperature": 0,
                                             "reasoning": {"effort": "none"}})
        assert status == 200 and resp["status"] == "completed", resp
        calls = [{"function": {"name": i["name"], "arguments": i["arguments"]}} for i in resp["output"]
                 if i["type"] == "function_call"]
        _check_calls(calls)

        for route, body, param in (
                ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
                ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": {
                    "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                                          "response_format": {"type": "json_object"}}, "tool_choice"),
                ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                                          "parallel_tool_calls": "no"}, "parallel_tool_calls"),
                ("/v1/messages", {"messages": MESSAGES, "max_tokens": 8, "tools": anthropic_tools,
                                  "tool_choice": {"type": "tool"}}, "tool_choice"),
                ("/v1/responses", {"input": "hi", "tools": responses_tools,
                                   "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice")):
            status, answer = ask(route, body)
            assert status == 400 and answer["error"].get("param", "tool_choice") == param, (body, answer)
            assert param in json.dumps(answer), (body, answer)
    finally:
        assert s.stop() == 0, "".join(s.log)
