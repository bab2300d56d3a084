"""A Grammar enforced during decoding: `GrammarConstraint`, the engine's TokenConstraint
(csrc/token_constraint.h) implemented with llguidance's matcher.

Why llguidance: it is the constrained-decoding engine llama.cpp itself builds in (LLAMA_LLGUIDANCE),
its wheel is abi3 with no Python dependencies (installs on 3.10+ anywhere CI runs), it takes GBNF,
Lark, JSON schema and regex, computes a token mask in tens of microseconds on a 250k vocabulary
(lexer-level token trie, no per-token scan in Python), and its matcher has what speculation needs:
`validate_tokens` (how much of a draft the grammar allows, without committing) and masks for every
position of a draft in one call. xgrammar needs torch and its own tokenizer info; outlines-core
compiles regular languages only (no GBNF / recursion).

The C++ decode loop calls fill_masks / commit / check_draft through pybind11, taking the GIL for
each call (a few per token; the mask itself is computed with the GIL released).
"""

from __future__ import annotations

import threading

import numpy as np

from . import _core
from .errors import GrammarError
from .grammar import Grammar, _llguidance
from .tokenizer import TOKEN_CONTROL, TOKEN_USER_DEFINED, Tokenizer

# llguidance's mark for a special token's text (its tokenizer wrappers prefix control tokens so that
# their text, e.g. "<|im_end|>", is never produced by a grammar's literal "<|im_end|>")
SPECIAL_PREFIX = b"\xff"

_executor = None
_executor_lock = threading.Lock()


def _mask_executor():
    """llguidance's executor for the masks of a draft's positions (one thread: one matcher)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = _llguidance().LLExecutor(num_threads=1)
        return _executor


class _VocabularyView:
    """What llguidance's TokenizerWrapper reads: every token's bytes, the end tokens, and encode."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        special = []
        tokens = []
        for i in range(tokenizer.n_vocab):
            piece = tokenizer.token_to_piece(i, special=True)
            kind = tokenizer.token_type(i)
            # as llama.cpp's llguidance glue: control tokens, and user-defined ones shaped like
            # them (<think>), are special
            if kind == TOKEN_CONTROL or (kind == TOKEN_USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">")):
                piece = SPECIAL_PREFIX + piece
                special.append(i)
            tokens.append(piece)
        self.tokens = tokens
        self.special_token_ids = special
        self._special = frozenset(special)
        self.eos_token_id = min(tokenizer.eog_ids)
        self.bos_token_id = tokenizer.bos_id

    def __call__(self, text):
        """Token ids of text the grammar forces. The tokenizer matches user-defined tokens in any
        text (<tool_call>, <think>), but llguidance sees those as special, never as the text of a
        grammar's literal: such a token is given as its text's first character and the rest."""
        if not isinstance(text, str):  # TokenizerWrapper probes with bytes, then passes str
            raise TypeError("encode takes str")
        ids = self._tokenizer.encode(text)
        if self._special.isdisjoint(ids):
            return ids
        out = []
        for t in ids:
            if t in self._special:
                piece = self._tokenizer.token_to_piece(t, special=True).decode("utf-8")
                out += self._tokenizer.encode(piece[:1]) + self._tokenizer.encode(piece[1:])
            else:
                out.append(t)
        return out


def ll_tokenizer(tokenizer: Tokenizer):
    """llguidance's tokenizer for `tokenizer`, built once per Tokenizer (~1 s for 250k tokens).
    Every end-of-generation token is an end token of the grammar: a grammar that is complete
    allows all of them, so the loop's stop rule (generate.h, eog_ids) ends the text."""
    cached = getattr(tokenizer, "_ll_tokenizer", None)
    if cached is not None:
        return cached
    if not tokenizer.eog_ids:
        raise GrammarError("the model's vocabulary has no end-of-generation token, which a grammar needs to end "
                           "the text")
    llg = _llguidance()
    view = _VocabularyView(tokenizer)
    built = llg.LLTokenizer(llg.TokenizerWrapper(view), n_vocab=tokenizer.n_vocab,
                            eos_token=sorted(tokenizer.eog_ids))
    tokenizer._ll_tokenizer = built
    return built


class GrammarConstraint(_core.TokenConstraint):
    """One generation's grammar state. A token the grammar forbids reaching commit() is an engine
    bug (the loops only sample masked rows), reported as GrammarError rather than ignored."""

    def __init__(self, tokenizer: Tokenizer, grammar: Grammar):
        super().__init__()
        llg = _llguidance()
        self._matcher = llg.LLMatcher(ll_tokenizer(tokenizer), grammar.spec, log_level=0)
        self._tokenizer = tokenizer
        self._grammar = grammar
        # a copy of the matcher following what a draft model drafts (fill_mask_after), and the
        # tokens it has consumed; dropped at every commit
        self._drafting = None
        self._drafted: list[int] = []
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"{self._grammar.source}: {self._matcher.get_error()}")

    def fill_masks(self, masks: np.ndarray, drafts: list[int]) -> None:
        one = masks.shape[1] * masks.itemsize
        if not drafts:
            self._matcher.unsafe_compute_mask_ptr(masks.ctypes.data, one)
        else:
            _mask_executor().unsafe_compute_mask_ptr_with_draft_token([(self._matcher, 0, list(drafts))],
                                                                      masks.ctypes.data, one, masks.shape[0])
        self._check()

    def fill_mask_after(self, mask: np.ndarray, path: list[int]) -> None:
        """One row of fill_masks: the tokens allowed after the committed ones and `path`, the tokens
        a draft model drafted so far. A copy of the matcher follows the paths asked for, rolled back
        to the longest prefix the new path shares with the last one, so that drafting a chain costs
        one token's step per row and a tree's next branch a rollback. After a path that ends the
        text (the matcher stopped), nothing is allowed."""
        if self._drafting is None:
            self._drafting, self._drafted = self._matcher.deep_copy(), []
        m, done = self._drafting, self._drafted
        common = 0
        while common < min(len(done), len(path)) and done[common] == path[common]:
            common += 1
        if len(done) > common:
            m.rollback(len(done) - common)
            del done[common:]
        for token in path[common:]:
            if not m.consume_token(token):
                self._drafting = None
                text = self._tokenizer.token_to_piece(token, special=True)
                raise GrammarError(f"drafted token {token} ({text!r}) is not allowed by the {self._grammar.source} "
                                   f"there: {m.get_error()}")
            done.append(token)
        if m.is_stopped():
            mask[:] = 0
            return
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if m.is_error():
            raise GrammarError(f"{self._grammar.source}: {m.get_error()}")

    def commit(self, token: int) -> None:
        self._drafting = None  # drafted paths start from the committed tokens
        if not self._matcher.consume_token(token):
            text = self._tokenizer.token_to_piece(token, special=True)
            raise GrammarError(f"token {token} ({text!r}) is not allowed by the {self._grammar.source} here: "
                               f"{self._matcher.get_error()}")

    def check_draft(self, tokens: list[int]) -> int:
        return self._matcher.validate_tokens(list(tokens))

    def forced_tokens(self) -> list[int]:
        # llguidance's fast-forward tokens: the canonical tokenization of the bytes the grammar
        # forces, short of a last token that the text after it could still merge into
        return self._matcher.compute_ff_tokens()

    @property
    def is_accepting(self) -> bool:
        """Whether the text committed so far is complete under the grammar."""
        return self._matcher.is_accepting()
