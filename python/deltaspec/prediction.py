"""Predicted outputs: text the caller expects the output to repeat, drafted by prompt lookup.

An editor that asks for a file with a few lines changed knows most of the answer already. Given
as `prediction` (add_request / generate_batch, or the server's OpenAI `prediction` field), that
text becomes the reference the request's prompt lookup searches before its own text: where the
output goes on as the prediction does, lookup drafts the prediction's next tokens and one target
pass verifies them. Drafts never change the output (greedy: the same tokens; sampling: the same
distribution), so a wrong prediction costs verify rows, never quality.

A request with a prediction drafts by lookup whatever drafter it was given otherwise (a draft
model's, the MTP head's or a DFlash drafter's guesses are worth less than text the caller knows),
with its draft_n_max / draft_n_min; an n-gram request keeps its tree_budget. So spec_type "mtp" or
"dflash", which concurrent sequences do not run yet, is accepted beside a prediction (an empty
prediction is none: the request then speculates as it says, or is refused). Only the scheduler reads the reference: generate() has no
`prediction`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from .generation import Speculation


def prediction_ids(model, prediction: str | Sequence[int], where: str) -> list[int]:
    """The prediction as token ids: text is tokenized as output text is (special tokens parsed, as
    a prompt's are); ids must lie in the vocabulary. An empty prediction is no prediction."""
    if isinstance(prediction, str):
        return model.tokenize(prediction, special=True) if prediction else []
    if isinstance(prediction, (bytes, bytearray)) or not isinstance(prediction, (Sequence, np.ndarray)):
        raise TypeError(f"{where}(): prediction must be a str or a sequence of token ids, got "
                        f"{type(prediction).__name__} {prediction!r:.80}")
    ids = []
    for i, t in enumerate(prediction):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"{where}(): prediction[{i}] must be a token id (int), got {type(t).__name__} {t!r:.40}")
        if not 0 <= int(t) < model.n_vocab:
            raise ValueError(f"{where}(): prediction[{i}] = {int(t)} is outside the vocabulary [0, {model.n_vocab})")
        ids.append(int(t))
    return ids


def predicted_speculation(model, ids: Sequence[int], speculation: Speculation | None, n_max: int,
                          n_min: int) -> Speculation | None:
    """The request's speculation given its prediction's ids (prediction_ids, not empty): prompt
    lookup that also searches them."""
    if speculation is None or speculation.draft is not None or speculation.mtp:  # lookup instead
        speculation = model._speculation("ngram-simple", None, n_max, n_min)
    return dataclasses.replace(speculation, reference=tuple(ids))
