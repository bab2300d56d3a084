"""Token streams for training and the held-out prompts, from the corpus and the trained BPE."""

from __future__ import annotations

import numpy as np
import torch

from shapes import EOS_TEXT


def encode_stream(tk, texts: list[str]) -> np.ndarray:
    """All texts tokenized (in parallel, by the Rust tokenizer), each followed by the EOS id."""
    eos = tk.token_to_id(EOS_TEXT)
    out = []
    for enc in tk.encode_batch(texts, add_special_tokens=False):
        out.append(np.asarray(enc.ids, dtype=np.int32))
        out.append(np.asarray([eos], dtype=np.int32))
    return np.concatenate(out) if out else np.zeros(0, np.int32)


class Windows:
    """Random training windows of `seq_len` tokens from one stream kept on the device."""

    def __init__(self, stream: np.ndarray, seq_len: int, device, seed: int):
        if len(stream) < seq_len + 1:
            raise ValueError(f"token stream of {len(stream)} tokens is shorter than one window ({seq_len})")
        self.tokens = torch.from_numpy(stream.astype(np.int64)).to(device)
        self.seq_len = seq_len
        self.gen = torch.Generator(device="cpu").manual_seed(seed)

    def batch(self, n: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (n,), generator=self.gen)
        idx = starts.to(self.tokens.device)[:, None] + torch.arange(self.seq_len, device=self.tokens.device)
        return self.tokens[idx]


def heldout_prompts(tk, texts: list[str], n: int, prompt_len: int, min_tail: int, seed: int) -> list[list[int]]:
    """`n` prompts of exactly `prompt_len` tokens, each from a different held-out file that has at
    least `min_tail` more tokens after it (so a reader can compare with what the file says), cut at
    a line start picked at random."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(texts))
    prompts = []
    for i in order:
        text = texts[i]
        starts = [0] + [j + 1 for j, c in enumerate(text) if c == "\n"]
        start = starts[int(rng.integers(0, max(1, len(starts) // 2)))]
        ids = tk.encode(text[start:], add_special_tokens=False).ids
        if len(ids) >= prompt_len + min_tail:
            prompts.append(ids[:prompt_len])
            if len(prompts) == n:
                return prompts
    raise ValueError(f"only {len(prompts)} held-out files have {prompt_len + min_tail} tokens; {n} prompts asked for")
