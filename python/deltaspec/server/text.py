"""Committed tokens -> text deltas for one request, as a stream may show them: never a split UTF-8
character, never the beginning of a stop string (it may yet complete and be cut), never an
end-of-generation token; the deltas concatenate to the request's final text.

With log-probabilities (a request that asked for them), each delta comes with the entries
(token, logprob, top list) of the tokens whose text it completes: a token's entry goes out once all
its bytes have been shown (a token without bytes, once something after it has), and the rest with
the final delta, so the entries of a stream are those of the non-streamed answer
(deltaspec.logprobs.generated_logprobs), in order, each with the delta that shows its text."""

from __future__ import annotations

from ..generation import TEXT_SPECIAL, _held_back
from ..logprobs import StreamedLogprobs
from .planted import planted


class TextAssembler:
    def __init__(self, tokenizer, stop: list[str]):
        self._tokenizer = tokenizer
        self._stops = [s.encode() for s in stop]
        self._data = bytearray()
        self._emitted = 0          # bytes of _data already handed out
        self._text = []            # the text handed out
        self._logprobs = StreamedLogprobs()

    def push(self, tokens: list[int], logprobs: list | None = None) -> str:
        """The text that the committed `tokens` of a request still running make safe to show (often
        "", sometimes several tokens' worth). While it runs no stop string has completed (the engine
        finishes a request at the token that completes one), so holding back a possible beginning
        suffices; the step that finishes it goes to `finish`. `logprobs`: the tokens' entries
        (RequestOutput.logprobs), handed out by take_logprobs()."""
        for k, t in enumerate(tokens):
            if self._tokenizer.is_eog(t):  # no text, and never in an answer's log-probabilities
                continue
            start = len(self._data)
            self._data += self._tokenizer.token_to_piece(t, special=TEXT_SPECIAL)
            if logprobs is not None:
                self._logprobs.add(logprobs[k], start, len(self._data))
        end = len(self._data) - (0 if planted("no_holdback") else _held_back(self._data, self._stops))
        if end <= self._emitted:
            return ""
        piece = self._data[self._emitted:end].decode("utf-8", errors="replace")
        self._emitted = end
        self._text.append(piece)
        return piece

    def take_logprobs(self) -> list:
        """The entries of the tokens whose text push() has handed out since the last call."""
        # the planted bug: finish_logprobs sends them again
        return self._logprobs.release(self._emitted, count=not planted("logprobs_twice"))

    def finish(self, final_text: str) -> str:
        """The rest of the request's final text (the engine's, cut before a stop string)."""
        shown = "".join(self._text)
        if planted("drop_finish"):
            return ""
        # what was shown is always a prefix of the final text: held-back bytes were either a stop
        # string's beginning (cut or not, the final text decides) or an incomplete character
        return final_text[len(shown):] if final_text.startswith(shown) else ""

    def finish_logprobs(self, result) -> list | None:
        """The entries of the finished request not handed out yet (None: it has no logprobs)."""
        if result.logprobs is None:
            return None
        return self._logprobs.rest(self._tokenizer, result)
