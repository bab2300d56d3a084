"""Two TokenConstraints at once: a token is allowed where both allow it. What a forced tool call's
grammar (deltaspec.tool_call_grammar) and a reasoning budget need together: the budget forces the
end of the <think> block, whose free text the grammar allows, and the grammar shapes the calls
after it."""

from __future__ import annotations

import numpy as np

from . import _core


class BothConstraints(_core.TokenConstraint):
    """`first` and `second` (Python TokenConstraints: a GrammarConstraint and a ReasoningBudget) as
    one; what `second` forces (the budget's end of the block) comes before what `first` forces."""

    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second
        self._scratch = np.zeros((0, 0), dtype=np.uint32)

    def fill_masks(self, masks: np.ndarray, drafts: list[int]) -> None:
        self.first.fill_masks(masks, drafts)
        if self._scratch.shape != masks.shape:
            self._scratch = np.zeros(masks.shape, dtype=np.uint32)
        self.second.fill_masks(self._scratch, drafts)
        # rows after a draft that either forbids are unspecified (token_constraint.h): the AND of
        # two unspecified rows is as good as any
        np.bitwise_and(masks, self._scratch, out=masks)

    def commit(self, token: int) -> None:
        self.first.commit(token)
        self.second.commit(token)

    def check_draft(self, tokens: list[int]) -> int:
        n = self.first.check_draft(tokens)
        return self.second.check_draft(list(tokens)[:n]) if n else 0

    def allows_every_token(self, along=()) -> bool:
        return self.first.allows_every_token(along) and self.second.allows_every_token(along)

    def forced_tokens(self) -> list[int]:
        # the budget's forced end, when it forces one, else what the grammar forces (each allowed by
        # the other, or a draft cut at check_draft)
        return self.second.forced_tokens() or self.first.forced_tokens()
