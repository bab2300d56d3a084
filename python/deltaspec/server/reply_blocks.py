"""A reply's text as the ordered blocks of Anthropic's messages and OpenAI's Responses output: the
reasoning (the text up to </think> when the prompt opened a block, deltaspec.chat's split), text,
and each tool call (deltaspec.tool_calls), in the order the model wrote them, the same whichever
pieces the text arrives in. Blank text between blocks is no block: it is shown before more text,
dropped before a call or at the end."""

from __future__ import annotations

from typing import Iterator

from ..chat import ReasoningSplitter
from ..tool_calls import ToolCallStream


class ReplyBlocks:
    """The stream builders' delta() (deltaspec.openai_stream's interface) over ordered blocks; a
    subclass writes a block's events in _open(kind) / _append(text) / _close(kind) for the kinds
    "reasoning" and "text", and a whole call's in _call(call)."""

    def __init__(self, thinking_open: bool, tools: list | None):
        self._splitter = ReasoningSplitter(thinking_open)
        self._calls = ToolCallStream(tools) if tools else None
        self._kind: str | None = None  # the block being written
        self._blank = ""

    @property
    def n_calls(self) -> int:
        return self._calls.n_calls if self._calls is not None else 0

    def delta(self, text: str, entries: list | None = None) -> Iterator[dict]:
        yield from self._pieces(*self._splitter.push(text))

    def _rest(self) -> Iterator[dict]:
        """The blocks of the text held back until the end (a call that never closed is text)."""
        yield from self._pieces(*self._splitter.finish())
        if self._calls is not None:
            yield from self._text(self._calls.finish())
        yield from self._end_block()

    def _pieces(self, reasoning: str, content: str) -> Iterator[dict]:
        if reasoning:
            yield from self._block("reasoning")
            yield from self._append(reasoning)
        if content:
            for piece in self._calls.push_pieces(content) if self._calls is not None else [content]:
                if isinstance(piece, str):
                    yield from self._text(piece)
                else:
                    self._blank = ""
                    yield from self._end_block()
                    yield from self._call(piece)

    def _text(self, text: str) -> Iterator[dict]:
        if self._kind != "text":
            self._blank += text
            if not self._blank.strip():
                return
            text, self._blank = self._blank, ""
            yield from self._block("text")
        yield from self._append(text)

    def _block(self, kind: str) -> Iterator[dict]:
        if self._kind == kind:
            return
        yield from self._end_block()
        self._kind = kind
        yield from self._open(kind)

    def _end_block(self) -> Iterator[dict]:
        if self._kind is not None:
            kind, self._kind = self._kind, None
            yield from self._close(kind)

    def _open(self, kind: str) -> Iterator[dict]:
        raise NotImplementedError

    def _append(self, text: str) -> Iterator[dict]:
        raise NotImplementedError

    def _close(self, kind: str) -> Iterator[dict]:
        raise NotImplementedError

    def _call(self, call: dict) -> Iterator[dict]:
        raise NotImplementedError
