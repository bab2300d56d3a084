"""Sampling parameters: validation with clear errors, and conversion to the engine's struct."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from . import _core


@dataclass(frozen=True)
class SamplingOptions:
    """llama.cpp's sampler chain: penalties -> top_k -> top_p -> min_p -> temperature -> draw.

    temperature 0 is greedy. top_k 0, top_p 1, min_p 0 and repeat_penalty 1 turn a stage off.
    seed None (or -1, llama.cpp's spelling) draws a fresh random seed; the same seed and input give
    the same output. logit_bias, (token id, value) pairs, is added to the logits after the
    penalties; -inf bans a token (ignore_eos bans the end-of-generation tokens so)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            if v < lo or v > hi or (lo_open and v == lo):
                raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")

        def integer(name: str, lo: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")

        number("temperature", 0.0, 1e4)
        integer("top_k", 0)
        number("top_p", 0.0, 1.0, lo_open=True)
        number("min_p", 0.0, 1.0)
        number("repeat_penalty", 0.0, 1e4, lo_open=True)
        number("presence_penalty", -1e4, 1e4)
        number("frequency_penalty", -1e4, 1e4)
        integer("penalty_last_n", -1)
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -1 <= self.seed < 2**64:
                raise ValueError(f"seed must be None, -1 (random) or an integer in [0, 2**64), got {self.seed!r}")
        for i, pair in enumerate(self.logit_bias):
            ok = isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int) and not isinstance(pair[0], bool)
            if not ok or isinstance(pair[1], bool) or not isinstance(pair[1], (int, float)) or math.isnan(pair[1]) \
                    or pair[1] == math.inf or pair[0] < 0:
                raise ValueError(f"logit_bias[{i}] must be (token id >= 0, finite number or -inf), got {pair!r}")

    def native(self) -> _core.SamplingParams:
        p = _core.SamplingParams()
        for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty", "penalty_last_n"):
            setattr(p, name, getattr(self, name))
        random = self.seed is None or self.seed == -1
        p.seed = int.from_bytes(os.urandom(8), "little") if random else self.seed
        p.logit_bias = [(t, float(b)) for t, b in self.logit_bias]
        return p
