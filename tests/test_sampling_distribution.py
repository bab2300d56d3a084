"""Sampling draws from the distribution llama.cpp's chain defines (chi-square, tiny-vocab model),
and the repetition / presence / frequency penalties act as llama.cpp defines them.

For a fixed prompt the first generated token is drawn thousands of times with different seeds;
its empirical distribution is compared with probabilities computed here, in numpy, from the
model's logits by an independent implementation of the chain: top-k -> top-p -> min-p ->
temperature. The last case shows the test has power: a chain with the wrong order is rejected.
Penalties: greedy text with each penalty equals a numpy loop applying llama.cpp's formula to the
model's logits, on a model whose greedy text repeats (so every case changes the text).
"""

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path
from sampling_reference import chi_square_p, expected_probs, penalize

N_SAMPLES = 3000
PROMPT = [72, 101, 108]  # bytes of "Hel"


@pytest.fixture(scope="module")
def model():
    with Model(tiny_vocab_model_path(), n_ctx=256, n_threads=1) as m:
        yield m


def draw(model: Model, **params) -> np.ndarray:
    counts = np.zeros(model.n_vocab)
    for seed in range(N_SAMPLES):
        token = model.generate(PROMPT, max_tokens=1, seed=seed, **params).tokens[0]
        counts[token] += 1
    return counts


CASES = {
    "plain": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "hot": dict(temperature=1.7, top_k=0, top_p=1.0, min_p=0.0),
    "cold_top_k": dict(temperature=0.7, top_k=8, top_p=1.0, min_p=0.0),
    "top_p": dict(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0),
    "min_p": dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.08),
    "chain": dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05),
}


@pytest.mark.parametrize("name", CASES)
def test_first_token_distribution(model, name):
    params = CASES[name]
    logits = model.logits(PROMPT)[-1]
    probs = expected_probs(logits, **params)
    assert (probs > 0).sum() >= 4, "the case must leave several candidates"
    counts = draw(model, **params)
    assert counts[probs == 0].sum() == 0, "a token outside the truncated set was drawn"
    assert chi_square_p(counts, probs) > 1e-3


def test_test_has_power(model):
    """Temperature before top-p (the other common order) gives a different distribution, and the
    same statistic rejects it."""
    params = CASES["top_p"] | {"temperature": 1.8}
    logits = model.logits(PROMPT)[-1]
    counts = draw(model, **params)
    right = expected_probs(logits, **params)
    wrong = expected_probs(logits / params["temperature"], 1.0, params["top_k"], params["top_p"], params["min_p"])
    assert chi_square_p(counts, right) > 1e-3
    assert chi_square_p(counts, np.where(wrong > 0, wrong, 1e-12)) < 1e-6


def test_greedy_is_argmax(model):
    logits = model.logits(PROMPT)[-1]
    assert model.generate(PROMPT, max_tokens=1, temperature=0).tokens[0] == int(np.argmax(logits))


def penalized_greedy(model: Model, prompt: list[int], n: int, repeat_penalty: float, presence_penalty: float,
                     frequency_penalty: float, penalty_last_n: int) -> list[int]:
    """Greedy decoding with llama.cpp's penalties (sampling_reference.penalize) applied here, in
    numpy, to the model's logits."""
    history, out = list(prompt), []
    logits = model.logits(prompt)[-1]
    for _ in range(n):
        adjusted = penalize(logits, history, repeat_penalty, presence_penalty, frequency_penalty, penalty_last_n)
        token = int(np.argmax(adjusted))
        out.append(token)
        history.append(token)
        if model.tokenizer.is_eog(token):
            break
        logits = model.eval([token])[-1]
    return out


@pytest.fixture(scope="module")
def repeating():
    """branch_scale=0: the next token depends on the current one only, so greedy text soon repeats
    itself and every penalty below changes it within the first ten tokens."""
    with Model(tiny_vocab_model_path(branch_scale=0.0), n_ctx=256, n_threads=1) as m:
        yield m


@pytest.mark.parametrize("repeat_penalty,presence_penalty,frequency_penalty,penalty_last_n", [
    (1.5, 0.0, 0.0, 64),
    (0.7, 0.0, 0.0, 64),     # below 1: rewards repeats
    (1.0, 0.8, 0.0, 64),
    (1.0, 0.0, 0.6, 64),
    (1.3, 0.5, 0.4, 3),      # a short window: only the last 3 tokens count
    (2.0, 0.0, 0.0, -1),     # the whole history
])
def test_penalties_match_numpy(repeating, repeat_penalty, presence_penalty, frequency_penalty, penalty_last_n):
    model = repeating
    prompt = [72, 101, 108, 108, 111, 32, 72, 101]  # "Hello He": repeated tokens from the start
    params = dict(repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                  frequency_penalty=frequency_penalty, penalty_last_n=penalty_last_n)
    ours = model.generate(prompt, max_tokens=24, temperature=0, **params).tokens
    assert ours == penalized_greedy(model, prompt, 24, **params)
    # the penalties changed the text: the comparison above had something to check
    assert ours != model.generate(prompt, max_tokens=24, temperature=0).tokens


def test_penalty_window_zero_turns_penalties_off(repeating):
    model = repeating
    prompt = [72, 101, 108, 108, 111, 32, 72, 101]
    plain = model.generate(prompt, max_tokens=24, temperature=0).tokens
    assert model.generate(prompt, max_tokens=24, temperature=0, repeat_penalty=1.5, presence_penalty=1.0,
                          penalty_last_n=0).tokens == plain
