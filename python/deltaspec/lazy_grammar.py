"""A grammar that starts at a token (Grammar.after_token): llama.cpp's lazy grammar, whose trigger
(for Qwen3.5's tool calls, <tool_call>) starts it. Until the model writes the trigger every token
is allowed, and says so (allows_every_token), so those rows keep the device's argmax / top rows;
from the trigger on, the grammar's matcher masks every row, the trigger its first token.

Drafts that cross the trigger are checked and masked the same way: the rows up to the trigger's
are free, the ones after it get a fresh matcher's masks (the state the trigger would start).
"""

from __future__ import annotations

import numpy as np

from . import _core
from .constraint import GrammarConstraint
from .errors import GrammarError
from .grammar import Grammar
from .tokenizer import Tokenizer


class LazyGrammarConstraint(_core.TokenConstraint):
    """One generation's lazy grammar (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, grammar: Grammar):
        super().__init__()
        trigger = tokenizer.encode(grammar.after_token, special=True)
        if len(trigger) != 1:
            raise GrammarError(f"the {grammar.source} starts at {grammar.after_token!r}, which this vocabulary "
                               f"encodes as {len(trigger)} tokens (it must be one)")
        self.trigger = trigger[0]
        self._tokenizer, self._grammar = tokenizer, grammar
        self._fresh: GrammarConstraint | None = None  # the state the trigger starts (never committed to)
        self.active: GrammarConstraint | None = None  # after the trigger: the grammar's state

    def _started(self) -> GrammarConstraint:
        if self._fresh is None:
            self._fresh = GrammarConstraint(self._tokenizer, self._grammar)
        return self._fresh

    def fill_masks(self, masks: np.ndarray, drafts: list[int]) -> None:
        if self.active is not None:
            self.active.fill_masks(masks, drafts)
            return
        at = drafts.index(self.trigger) if self.trigger in drafts else len(drafts)
        masks[:at + 1] = np.uint32(0xFFFFFFFF)  # the rows up to the trigger's own are free
        if at < len(drafts):
            # row at + 1 on: the grammar's rows after the trigger and the drafts that follow it
            self._started().fill_masks(masks[at:], list(drafts[at:]))
            masks[at] = np.uint32(0xFFFFFFFF)

    def fill_mask_after(self, mask: np.ndarray, path: list[int]) -> None:
        if self.active is not None:  # the grammar's own incremental row
            self.active.fill_mask_after(mask, path)
            return
        rows = np.zeros((len(path) + 1, mask.shape[0]), dtype=np.uint32)
        self.fill_masks(rows, list(path))
        mask[:] = rows[-1]

    def commit(self, token: int) -> None:
        if self.active is None:
            if token != self.trigger:
                return
            self.active, self._fresh = self._started(), None
        self.active.commit(token)

    def check_draft(self, tokens: list[int]) -> int:
        if self.active is not None:
            return self.active.check_draft(tokens)
        tokens = list(tokens)
        if self.trigger not in tokens:
            return len(tokens)
        at = tokens.index(self.trigger)
        return at + self._started().check_draft(tokens[at:])

    def forced_tokens(self) -> list[int]:
        return self.active.forced_tokens() if self.active is not None else []

    def allows_every_token(self, along=()) -> bool:
        # free until the trigger is committed, and along drafts that do not hold it
        return self.active is None and self.trigger not in along

    @property
    def is_accepting(self) -> bool:
        """Whether the text is complete: no trigger yet, or the grammar complete after it."""
        return self.active is None or self.active.is_accepting
