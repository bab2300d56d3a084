"""Log-probabilities in the shapes llama-cpp-python returns them: a completion's
`{"tokens", "text_offset", "token_logprobs", "top_logprobs"}` and a chat message's
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}` (OpenAI's).

The numbers come from the engine: log_softmax of the model's raw logits at each generated token
(before penalties, temperature or bias), as llama-cpp-python computes them from its scores."""

from __future__ import annotations

from typing import Any

import numpy as np


def _piece(tokenizer, token: int) -> str:
    return tokenizer.token_to_piece(token, special=False).decode("utf-8", errors="replace")


def generated_logprobs(tokenizer, result) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(token, logprob, top [(token, logprob)]) of the tokens whose text the result returned: no
    final end-of-generation token, nothing past a stop string (a token that the stop string's cut
    splits is one of them)."""
    out, text_len = [], 0
    limit = len(result.text.encode("utf-8"))
    for token, lp, top in zip(result.tokens, result.logprobs, result.top_logprobs):
        if tokenizer.is_eog(token) or text_len >= limit:  # the text ended before this token
            break
        out.append((token, lp, top))
        text_len += len(tokenizer.token_to_piece(token, special=False))
    return out


class StreamedLogprobs:
    """Which generated tokens' entries a stream hands out with its text: a token's once all its
    bytes have been shown (one without bytes: once text after it has), and at the end the rest of
    the answer's (generated_logprobs), so that the stream's entries join to the non-streamed
    answer's, each with the piece that completes its text."""

    def __init__(self):
        self._waiting: list = []  # (entry, first byte, end byte) of tokens whose text is not all out
        self._n_out = 0

    def add(self, entry, start: int, end: int) -> None:
        self._waiting.append((entry, start, end))

    def release(self, shown: int, count: bool = True) -> list:
        """The entries of the waiting tokens whose text the first `shown` bytes hold. `count`
        False leaves them out of what rest() knows was handed out (a planted bug of the server)."""
        out = []
        while self._waiting and self._waiting[0][2] <= shown and self._waiting[0][1] < shown:
            out.append(self._waiting.pop(0)[0])
        self._n_out += len(out) if count else 0
        return out

    def rest(self, tokenizer, result) -> list:
        """The finished answer's entries not handed out yet."""
        self._waiting = []
        return generated_logprobs(tokenizer, result)[self._n_out:]


SCORED_ROWS = 128  # prompt rows evaluated at a time when scoring, as the scheduler does (csrc/scheduler.cpp)


def prompt_logprobs(model, ids: list[int], k: int) -> list[tuple[int, float | None, list[tuple[int, float]] | None]]:
    """Each prompt token's logprob given the tokens before it (None for the first, which has no
    context), from an evaluation of the prompt (the model's sequence then holds it) SCORED_ROWS
    rows at a time: the logits held at once are those of SCORED_ROWS rows, not of the whole
    prompt (a 248K vocabulary: 1 MB a row)."""
    out: list[tuple[int, float | None, list[tuple[int, float]] | None]] = [(ids[0], None, None)]
    model.reset()
    for start in range(0, len(ids), SCORED_ROWS):
        logits = model.eval(ids[start:start + SCORED_ROWS], logits="all").astype(np.float64)
        lse = np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)) + logits.max(axis=1)
        logp = logits - lse[:, None]
        for r, row in enumerate(logp):
            i = start + r + 1  # the prompt token this row predicts
            if i < len(ids):
                out.append((ids[i], float(row[ids[i]]), [(int(t), float(row[t])) for t in _top(row, k)]))
    return out


def _top(row: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries' ids, largest first, ties by the lower id (the engine's order): a
    partition, then a sort of those k only (a 248K row sorted whole per token would dominate)."""
    k = min(k, len(row))
    if k == 0:
        return np.empty(0, dtype=np.int64)
    cut = row[np.argpartition(-row, k - 1)[k - 1]]  # the k-th largest value
    ids = np.nonzero(row >= cut)[0]  # ties at the cut included, then ordered and cut to k
    return ids[np.lexsort((ids, -row[ids]))][:k]


def completion_logprobs(tokenizer, entries, text_offset: int) -> dict[str, Any]:
    """A completion choice's `logprobs`; `text_offset` is where the first entry's text starts."""
    tokens, offsets, token_lps, tops = [], [], [], []
    at = text_offset
    for token, lp, top in entries:
        s = _piece(tokenizer, token)
        tokens.append(s)
        offsets.append(at)
        at += len(s)
        token_lps.append(lp)
        if top is None:
            tops.append(None)
        else:
            d = {_piece(tokenizer, t): v for t, v in top}
            d[s] = lp  # the chosen token is always listed, as llama-cpp-python does
            tops.append(d)
    return {"tokens": tokens, "text_offset": offsets, "token_logprobs": token_lps, "top_logprobs": tops}


def chat_logprobs(tokenizer, entries) -> dict[str, Any]:
    """A chat choice's `logprobs` (OpenAI's content list)."""
    def item(t: int, v: float) -> dict[str, Any]:
        s = _piece(tokenizer, t)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]} for t, lp, top in entries],
            "refusal": None}
