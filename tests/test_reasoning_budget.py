"""A reasoning budget (deltaspec.reasoning_budget; llama.cpp's --reasoning-budget and
reasoning_budget_tokens), on the tiny real-vocabulary model with Qwen3.5's template (<think> and
</think> are tokens of its vocabulary).

The claims:
- with a budget of N, a greedy reply to a prompt that opened a <think> block holds N tokens in the
  block, the prompt's own after <think> counted (llama.cpp's count), then "\n</think>" (what
  llama.cpp forces for Qwen3.5), after a given message; what follows is plain greedy's
  continuation of that text (only the end was forced); 0 and 1 close the block at once; no budget
  leaves the reply as it was;
- with speculation (a draft model, chains and trees, and prompt lookup) and through generate_batch
  the reply is the one without speculation (prompt lookup drafts the forced end);
- a token that leaves a UTF-8 character open when the budget runs out is followed by free tokens
  until one completes it; a second <think> opens a fresh budget;
- bad budgets, a budget with a grammar, and a model without <think> tokens raise ValueError;
  `deltaspec run --reasoning-budget` applies it and refuses a negative one by name;
- the server applies a chat request's reasoning_budget_tokens (alias thinking_budget_tokens),
  Anthropic's thinking.budget_tokens and --reasoning-budget as the default, and refuses a budget
  with a response format.
tests/test_server_peer.py checks the same budgets against llama-server's.

Seen red with the budget's countdown patched to skip the prompt's tokens (the block one token
longer), with forced_tokens() patched to return nothing (no forced end drafted), and with the
UTF-8 wait patched out (forcing at once). The scheduler's verify with free rows: seen red with
allows_every_token ignoring the drafts (rows past the budget's end left unmasked: other tokens)
and answering False for any drafts (every verified row masked).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deltaspec import Model
from deltaspec.chat import chat_template_from_metadata
from deltaspec.reasoning_budget import FORCING, WAITING_UTF8, ReasoningBudget, _open_tail

N_CTX = 512
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model(chat_gguf):
    with Model(chat_gguf, n_ctx=N_CTX, n_threads=1) as m:
        yield m


@pytest.fixture(scope="module")
def prompt(model):
    text = chat_template_from_metadata(model.metadata).render([{"role": "user", "content": "Tell me a story."}],
                                                              add_generation_prompt=True)
    assert text.endswith("<think>\n")
    return model.tokenize(text, special=True)


def _close_id(model) -> int:
    [close] = model.tokenize("</think>", special=True)
    return close


def test_the_block_ends_after_its_budget(model, prompt):
    end = model.tokenize("\n</think>", special=True)  # the end forced: a newline, then </think>
    free = model.generate(prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert _close_id(model) not in free.tokens  # the model would think past every budget below
    for budget in (0, 1, 2, 5, 12):
        r = model.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, reasoning_budget=budget)
        n = max(budget - 1, 0)  # the prompt's "\n" after <think> is the block's first token
        assert r.tokens[:n] == free.tokens[:n] and r.tokens[n:n + 2] == end, budget  # nothing before the end changed
        rest = model.generate(prompt + r.tokens[:n + 2], max_tokens=MAX_TOKENS - n - 2, temperature=0)
        assert r.tokens[n + 2:] == rest.tokens  # nor after it
        # only the forced end's rows were masked: the free ones took the device's argmax
        assert r.stats.grammar_masked_rows == 2, budget
    assert model.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, reasoning_budget=-1).tokens == free.tokens
    # a message before the end (llama.cpp's --reasoning-budget-message)
    r = model.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, reasoning_budget=3,
                       reasoning_budget_message=" Enough, time to answer.")
    forced = model.tokenize(" Enough, time to answer.", special=False) + end
    assert r.tokens[:2] == free.tokens[:2] and r.tokens[2:2 + len(forced)] == forced


def test_speculation_and_batches_give_the_same_reply(model, prompt, chat_gguf):
    close = _close_id(model)
    want = model.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, reasoning_budget=6)
    assert want.tokens.index(close) == 6  # five free tokens (the prompt's "\n" the sixth), "\n", </think>
    with Model(chat_gguf, n_ctx=N_CTX, n_threads=1) as draft:
        for spec in (dict(draft_model=draft, draft_n_max=8), dict(draft_model=draft, draft_n_max=8, tree_budget=12),
                     dict(spec_type="ngram-simple", draft_n_max=8)):
            r = model.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, reasoning_budget=6, **spec)
            assert r.tokens == want.tokens, spec
            assert r.stats.n_drafted > 0, spec
            if "spec_type" in spec:  # prompt lookup has nothing to draft there: the budget's end is the draft
                assert r.stats.grammar_forced_tokens >= 1
        # the scheduler's verify (generate_batch, the server) and generate()'s speculative loop: rows
        # the budget leaves free along the drafts take the device's argmax; with a budget far from
        # the drafts (20) only the forced end's rows are masked (its two tokens, drafted while the
        # failing draft model pauses, and the row after them in the same pass), fewer than the rows
        # verified
        for spec in (dict(draft_model=draft, draft_n_max=8), dict(draft_model=draft, draft_n_max=8, tree_budget=12),
                     dict(spec_type="ngram-simple", draft_n_max=8)):
            for budget in (6, 20):
                one = model.generate(prompt, max_tokens=40, temperature=0, reasoning_budget=budget)
                [r] = model.generate_batch([prompt], max_tokens=40, temperature=0, reasoning_budget=budget, **spec)
                alone = model.generate(prompt, max_tokens=40, temperature=0, reasoning_budget=budget, **spec)
                assert r.tokens == one.tokens == alone.tokens, (spec, budget)
                assert alone.stats.grammar_masked_rows == r.stats.grammar_masked_rows, (spec, budget)
                verified = r.stats.n_drafted + len(r.stats.accepted_lengths)
                assert r.stats.n_drafted > 0, (spec, budget)
                if budget == 20 and "draft_model" in spec:
                    assert r.stats.grammar_forced_tokens == 2, (spec, r.stats)
                    assert r.stats.grammar_masked_rows == 3 < verified, (spec, r.stats)
    batch = model.generate_batch([prompt, prompt], per_prompt=[{"reasoning_budget": 6}, {"reasoning_budget": 3}],
                                 max_tokens=MAX_TOKENS, temperature=0)
    assert batch[0].tokens == want.tokens
    assert batch[1].tokens == model.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, reasoning_budget=3).tokens


def test_free_rows_take_top_rows_and_sample_as_whole_rows(model, prompt):
    """Until the budget runs out every token is allowed (ReasoningBudget.allows_every_token), so a
    sampled row takes the device's top candidates instead of crossing over whole to be masked:
    seeded sampling gives the whole-row path's tokens, alone and in a batch, and took top rows.
    Seen red with allows_every_token answering True while forcing (the forced end not masked: the
    sampled reply lost its </think>), and answering False throughout (no top rows taken, every row
    masked)."""
    engine = model._engine
    ask = dict(max_tokens=MAX_TOKENS, temperature=1.0, top_k=40, reasoning_budget=8)
    end = model.tokenize("\n</think>", special=True)
    for seed in range(4):
        before = engine.decode_stats["top_rows"]
        try:
            reduced = model.generate(prompt, seed=seed, **ask)
            batch = model.generate_batch([prompt, prompt], per_prompt=[{"seed": seed}, {"seed": seed + 1}], **ask)
            n_top = engine.decode_stats["top_rows"] - before
            engine.top_rows_enabled = False
            whole = model.generate(prompt, seed=seed, **ask)
        finally:
            engine.top_rows_enabled = True
        assert reduced.tokens == whole.tokens == batch[0].tokens, seed
        assert reduced.tokens[7:9] == end and batch[1].tokens[7:9] == end, seed
        assert n_top >= 3 * 6, seed  # the free rows of the three runs, each
        assert reduced.stats.grammar_masked_rows == 2


def test_the_budget_waits_for_a_whole_character(model):
    tok = model.tokenizer
    think = model.tokenize("<think>", special=True)
    # a byte-level token that opens a character without finishing it, and a continuation byte
    lead = next(t for t in range(tok.n_vocab) if tok.token_to_piece(t, special=False) == b"\xe4")
    cont = next(t for t in range(tok.n_vocab) if tok.token_to_piece(t, special=False) == b"\xbd")
    word = model.tokenize("hello", special=False)[0]
    assert _open_tail(b"a\xe4") == b"\xe4" and _open_tail(b"\xe4\xbd") == b"\xe4\xbd"
    assert _open_tail(b"\xe4\xbd\xa0") == _open_tail(b"ok") == _open_tail(b"\xf0\x9f\x98\x80") == b""
    budget = ReasoningBudget(tok, 1, think)
    budget.commit(lead)  # the budget is spent on half a character
    assert budget.phase == WAITING_UTF8 and budget.forced_tokens() == []
    budget.commit(cont)
    assert budget.phase == WAITING_UTF8  # still open: 2 of its 3 bytes
    budget.commit(cont)
    end = model.tokenize("\n</think>", special=True)
    assert budget.phase == FORCING and budget.forced_tokens() == end
    assert budget.check_draft([word]) == 0 and budget.check_draft(end + [word]) == 3
    budget.commit(end[0])
    assert budget.forced_tokens() == end[1:]
    budget.commit(end[1])
    assert budget.phase == "done" and budget.n_forced == 2
    budget.commit(think[0])  # a new block, a new budget
    assert budget.phase == "counting"


def test_bad_budgets(model, prompt, tmp_path):
    for bad in (-2, 1.5, True, "8"):
        with pytest.raises(ValueError, match="reasoning_budget"):
            model.generate(prompt, max_tokens=4, reasoning_budget=bad)
    with pytest.raises(ValueError, match="grammar"):
        model.generate(prompt, max_tokens=4, reasoning_budget=4, grammar='root ::= "a"')
    with pytest.raises(ValueError, match="reasoning_budget"):
        model.generate_batch([prompt], max_tokens=4, reasoning_budget=-5)


def test_tiny_vocabulary_model_without_think_tokens_is_refused(tmp_path):
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    path = write_tiny_vocab_model(tmp_path / "tiny.gguf", seed=0)
    with Model(path, n_ctx=256, n_threads=1) as m:
        if len(m.tokenize("</think>", special=True)) == 1:
            pytest.fail("the tiny vocabulary has </think> as a token: this case needs another model")
        with pytest.raises(ValueError, match="</think>"):
            m.generate("hi", max_tokens=4, reasoning_budget=4)


def test_run_flag(chat_gguf, model, prompt):
    def run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "deltaspec", "run", "-m", str(chat_gguf), "-t", "1", "-c", "512",
                               "--temp", "0", "-n", str(MAX_TOKENS), "--no-display-prompt", "-f", str(prompt_file),
                               *flags], capture_output=True, text=True, timeout=300)

    prompt_file = chat_gguf.parent / "budget_prompt.txt"
    prompt_file.write_text(model.detokenize(prompt, special=True) + "\n")  # (-f drops one final newline)
    out = run("--reasoning-budget", "5")
    assert out.returncode == 0, out.stderr
    want = model.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, reasoning_budget=5)
    assert "</think>" in model.detokenize(want.tokens, special=True)
    assert out.stdout.rstrip("\n") == want.text.rstrip("\n")
    bad = run("--reasoning-budget", "-3")
    assert bad.returncode == 2 and "--reasoning-budget" in bad.stderr
    lonely = run("--reasoning-budget-message", "Enough.")
    assert lonely.returncode == 2 and "--reasoning-budget-message: needs --reasoning-budget" in lonely.stderr


def test_server_applies_budgets(chat_gguf, model, prompt):
    openai = pytest.importorskip("openai")
    from test_server import ServerProcess, post

    question = [{"role": "user", "content": "Tell me a story."}]

    def reasoning_tokens(text: str) -> int:
        return len(model.tokenize(text, special=False))

    s = ServerProcess(chat_gguf, "-np", "1", "-c", str(N_CTX), "--reasoning-budget", "9")
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for extra, budget, message in (({}, 9, ""), ({"reasoning_budget_tokens": 4}, 4, ""),
                                       ({"thinking_budget_tokens": 6}, 6, ""), ({"reasoning_budget_tokens": -1}, 9, ""),
                                       ({"reasoning_budget_tokens": 4, "reasoning_budget_message": " Done."}, 4,
                                        " Done.")):
            chat = client.chat.completions.create(model="tiny-chat", messages=question, max_tokens=MAX_TOKENS,
                                                  temperature=0, extra_body=extra)
            want = model.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, reasoning_budget=budget,
                                  reasoning_budget_message=message)
            assert chat.choices[0].message.content == want.text.split("</think>", 1)[1].strip(), extra
            assert chat.choices[0].message.reasoning_content == want.text.split("</think>", 1)[0].strip()
        status, message = post(f"{s.url}/v1/messages", json.dumps({
            "model": "tiny-chat", "max_tokens": MAX_TOKENS, "temperature": 0, "messages": question,
            "thinking": {"type": "enabled", "budget_tokens": 7}}).encode())
        want = model.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, reasoning_budget=7)
        assert status == 200 and message["content"][0]["thinking"] == want.text.split("</think>", 1)[0].strip()
        status, answer = post(f"{s.url}/v1/chat/completions", json.dumps({
            "model": "tiny-chat", "messages": question, "reasoning_budget_tokens": 4,
            "response_format": {"type": "json_object"}}).encode())
        assert status == 400 and answer["error"]["param"] == "reasoning_budget_tokens"
        status, answer = post(f"{s.url}/v1/chat/completions", json.dumps({
            "model": "tiny-chat", "messages": question, "reasoning_budget_tokens": "many"}).encode())
        assert status == 400 and answer["error"]["param"] == "reasoning_budget_tokens"
    finally:
        assert s.stop() == 0, "".join(s.log)
