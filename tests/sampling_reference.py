"""An independent numpy implementation of llama.cpp's sampler chain, for the statistical sampling
tests: penalties -> top-k -> top-p -> min-p -> temperature, and the chi-square test they use."""

import numpy as np
from scipy.stats import chisquare


def penalize(logits: np.ndarray, history: list[int], repeat_penalty: float = 1.0, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, penalty_last_n: int = 64) -> np.ndarray:
    """llama.cpp's penalties (llama_sampler_penalties_apply) on a copy of `logits`: every token seen
    c > 0 times among the last penalty_last_n tokens of `history` (prompt + generated; -1: all of
    them, 0: none) has its logit divided by repeat_penalty when positive, multiplied when not, then
    lowered by c * frequency_penalty + presence_penalty."""
    window = history if penalty_last_n < 0 else history[-penalty_last_n:] if penalty_last_n > 0 else []
    out = np.array(logits, dtype=np.float64)
    ids, counts = np.unique(np.array(window, dtype=np.int64), return_counts=True)
    seen = out[ids]
    seen = np.where(seen <= 0, seen * repeat_penalty, seen / repeat_penalty)
    out[ids] = seen - (counts * frequency_penalty + presence_penalty)
    return out


def expected_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The next-token distribution over the whole vocabulary (zero outside the truncated set)."""
    logits = logits.astype(np.float64)
    order = np.argsort(-logits, kind="stable")
    keep = order[:top_k] if top_k > 0 else order
    p = np.exp(logits[keep] - logits[keep].max())
    p /= p.sum()
    if top_p < 1.0:
        n = int(np.searchsorted(np.cumsum(p), top_p) + 1)
        keep = keep[:n]
        p = p[:n] / p[:n].sum()
    if min_p > 0.0:
        keep = keep[p >= min_p * p[0]]
    q = np.exp((logits[keep] - logits[keep].max()) / temperature)
    out = np.zeros_like(logits)
    out[keep] = q / q.sum()
    return out


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of counts under probs (normalized here), pooling bins expected below 5 into one."""
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue
