"""A reasoning budget: at most N tokens inside a <think> block, then its end forced.

llama.cpp's `--reasoning-budget N` / `reasoning_budget_tokens` behaviour, as the engine's
TokenConstraint (csrc/token_constraint.h), so that every decode loop applies it the way it applies
a grammar (plain and speculative decoding, chains and trees, one sequence or a batch): while the
budget lasts every token is allowed; once N tokens of the block have been written (the prompt's
own tokens after an opening <think> count, as llama.cpp counts its generation prompt's), the
block's end (`message`, if any, then a newline and </think>, as Qwen's template closes a block and
llama.cpp forces it) is the only way on, token by token, and is what a speculating request
drafts; after it, or after the model ends the block itself (</think>, or a <tool_call> opened in
it), everything is allowed again, until a new <think> opens another budget. A token that leaves a UTF-8 character
unfinished when the budget runs out is followed by free tokens until one finishes it, so the
reasoning text never ends in half a character. N = 0 closes the block at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _core
from .chat import THINK_CLOSE, THINK_OPEN
from .tool_calls import OPEN as TOOL_CALL_OPEN
from .tokenizer import Tokenizer

IDLE, COUNTING, WAITING_UTF8, FORCING, DONE = "idle", "counting", "waiting_utf8", "forcing", "done"


def validate_reasoning_budget(budget) -> int | None:
    """generate()'s `reasoning_budget`: None or -1 (llama.cpp's spelling) for no budget, else the
    tokens a <think> block may hold."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < -1:
        raise ValueError(f"reasoning_budget must be None, -1 (no budget) or an integer >= 0 (tokens a <think> "
                         f"block may hold), got {budget!r}")
    return None if budget == -1 else budget


def _open_tail(data: bytes) -> bytes:
    """The bytes of an unfinished UTF-8 character at the end of `data` (b"" when it ends whole)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return b""
        if byte >= 0xC0:  # a lead byte: how many bytes its character takes
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data[-back:] if back < need else b""
    return b""  # continuation bytes with no lead: nothing to wait for


@dataclass
class _State:
    phase: str
    remaining: int
    forced_at: int = 0
    tail: bytes = b""  # the block's text's unfinished last character, if any


class ReasoningBudget(_core.TokenConstraint):
    """One generation's reasoning budget (see the module docstring); `prompt` the request's ids."""

    def __init__(self, tokenizer: Tokenizer, budget: int, prompt, message: str = ""):
        super().__init__()
        opening = tokenizer.encode(THINK_OPEN, special=True)
        closing = tokenizer.encode(THINK_CLOSE, special=True)
        if len(opening) != 1 or len(closing) != 1:
            raise ValueError(f"reasoning_budget needs a model whose vocabulary has {THINK_OPEN} and {THINK_CLOSE} as "
                             f"tokens (this one encodes them as {opening} and {closing})")
        self._open_id = opening[0]
        # what ends a block: </think>, or a tool call the model opens in it
        call = tokenizer.encode(TOOL_CALL_OPEN, special=True)
        self._ends = {closing[0]} | ({call[0]} if len(call) == 1 else set())
        self.budget = budget
        self.forced = (tokenizer.encode(message, special=False) if message else []) + tokenizer.encode(
            "\n" + THINK_CLOSE, special=True)
        self._tokenizer = tokenizer
        self._state = self._after_prompt(list(prompt))
        self.n_forced = 0  # tokens of the block's end forced (committed while forcing)

    def _after_prompt(self, prompt: list[int]) -> _State:
        """The state after the prompt: counting down from the budget, less the tokens after an
        opening tag the prompt leaves open (a chat's generation prompt: <think> and a newline)."""
        # the last tag of the prompt, found from its end (a long prompt is not walked whole)
        last = next((i for i in range(len(prompt) - 1, -1, -1)
                     if prompt[i] == self._open_id or prompt[i] in self._ends), -1)
        state = _State(IDLE, self.budget)
        if last >= 0 and prompt[last] == self._open_id:
            opened = last
            state = self._step(state, self._open_id)
            for t in prompt[opened + 1:]:
                if state.phase == FORCING:  # the prompt's tokens are not the block's end: force all of it
                    break
                state = self._step(state, t)
        return state

    def _step(self, s: _State, token: int) -> _State:
        """The state after `token` (a new state; `s` is kept as it was)."""
        if s.phase in (IDLE, DONE):
            if token != self._open_id:
                return s
            return _State(FORCING if self.budget == 0 else COUNTING, self.budget)
        if s.phase == FORCING:
            at = s.forced_at + 1
            return _State(DONE, 0) if at >= len(self.forced) else _State(FORCING, 0, at)
        if token in self._ends:  # the model ended the block itself
            return _State(DONE, 0)
        remaining = s.remaining - 1 if s.phase == COUNTING else 0
        # a character is at most 4 bytes, so at most the last 4 tokens before the budget runs out can
        # leave one unfinished: the bytes are read only from there on
        tail = (_open_tail(s.tail + self._tokenizer.token_to_piece(token, special=False)) if remaining <= 3
                else b"")
        if remaining > 0:
            return _State(COUNTING, remaining, tail=tail)
        return _State(WAITING_UTF8, 0, tail=tail) if tail else _State(FORCING, 0)

    def _allowed(self, s: _State, token: int) -> bool:
        return s.phase != FORCING or token == self.forced[s.forced_at]

    # --- TokenConstraint -------------------------------------------------------------------------
    def fill_masks(self, masks: np.ndarray, drafts: list[int]) -> None:
        s = self._state
        for i in range(masks.shape[0]):
            if s.phase == FORCING:
                masks[i] = 0
                t = self.forced[s.forced_at]
                masks[i, t // 32] = np.uint32(1 << (t % 32))
            else:
                masks[i] = np.uint32(0xFFFFFFFF)
            if i < len(drafts):
                if not self._allowed(s, drafts[i]):
                    break  # rows after a forbidden draft are unspecified
                s = self._step(s, drafts[i])

    def commit(self, token: int) -> None:
        if not self._allowed(self._state, token):
            raise ValueError(f"token {token} committed where the reasoning budget forces "
                             f"{self.forced[self._state.forced_at]}")
        if self._state.phase == FORCING:
            self.n_forced += 1
        self._state = self._step(self._state, token)

    def check_draft(self, tokens: list[int]) -> int:
        s = self._state
        for i, t in enumerate(tokens):
            if not self._allowed(s, t):
                return i
            s = self._step(s, t)
        return len(tokens)

    def forced_tokens(self) -> list[int]:
        return self.forced[self._state.forced_at:] if self._state.phase == FORCING else []

    def allows_every_token(self, along=()) -> bool:
        """Whether every row after the committed tokens and a prefix of any path through `along`
        (drafts, or a tree's nodes) is free: until the budget runs out rows take the device's
        argmax / top rows. Judged on `along` as a set, so that a tree's paths are covered: no tag
        among them (which could open or end a block) and more budget left than tokens."""
        s = self._state
        if s.phase == FORCING:
            return False
        if not along:
            return True  # waiting for a character's last byte allows every token too
        if s.phase == WAITING_UTF8 or self._open_id in along or not self._ends.isdisjoint(along):
            return False
        return s.phase != COUNTING or s.remaining > len(along)

    @property
    def phase(self) -> str:
        return self._state.phase
