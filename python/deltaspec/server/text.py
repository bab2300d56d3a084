"""Committed tokens -> text deltas for one request, as a stream may show them: never a split UTF-8
character, never the beginning of a stop string (it may yet complete and be cut), never an
end-of-generation token; the deltas concatenate to the request's final text."""

from __future__ import annotations

from ..generation import TEXT_SPECIAL, _held_back
from .planted import planted


class TextAssembler:
    def __init__(self, tokenizer, stop: list[str]):
        self._tokenizer = tokenizer
        self._stops = [s.encode() for s in stop]
        self._data = bytearray()
        self._emitted = 0          # bytes of _data already handed out
        self._text = []            # the text handed out

    def push(self, tokens: list[int]) -> str:
        """The text that the committed `tokens` of a request still running make safe to show (often
        "", sometimes several tokens' worth). While it runs no stop string has completed (the engine
        finishes a request at the token that completes one), so holding back a possible beginning
        suffices; the step that finishes it goes to `finish`."""
        for t in tokens:
            if not self._tokenizer.is_eog(t):
                self._data += self._tokenizer.token_to_piece(t, special=TEXT_SPECIAL)
        end = len(self._data) - (0 if planted("no_holdback") else _held_back(self._data, self._stops))
        if end <= self._emitted:
            return ""
        piece = self._data[self._emitted:end].decode("utf-8", errors="replace")
        self._emitted = end
        self._text.append(piece)
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of the request's final text (the engine's, cut before a stop string)."""
        shown = "".join(self._text)
        if planted("drop_finish"):
            return ""
        # what was shown is always a prefix of the final text: held-back bytes were either a stop
        # string's beginning (cut or not, the final text decides) or an incomplete character
        return final_text[len(shown):] if final_text.startswith(shown) else ""
