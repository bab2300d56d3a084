"""/v1/embeddings (OpenAI's, as llama-server serves it): each input's final hidden states (after the
output norm) read by the engine beside the running requests (Model.add_request(hidden_states=True):
a slot's prefill, nothing generated), pooled by the server's --pooling ("last", the default: the
last token's state, which has read the whole input; or "mean") and divided by their Euclidean
norm, as llama-server's /v1/embeddings and OpenAI's embeddings are; the same numbers as
Model.embed(normalize=True, pooling=...).

`input`: a string, an array of token ids, or an array of those (at most MAX_PROMPTS), each within
the context; `encoding_format` "float" (lists of numbers) or "base64" (little-endian float32
bytes); `dimensions` is refused (the model's width is the only one). Bad fields are 400s naming
them.
"""

from __future__ import annotations

import base64
from typing import Any

from .. import embeddings
from ..generation import GenerationResult
from .errors import bad_request
from .planted import planted
from .schemas import GenerationRequest, Served, _check_body, _get, _prompt_ids, _prompt_items

ENCODINGS = ("float", "base64")


def parse_embeddings(body: Any, served: Served) -> GenerationRequest:
    body = _check_body(body, served)
    if "input" not in body:
        raise bad_request("'input' is required", "input", "missing")
    items = _prompt_items(body["input"], "input")
    all_ids = [_prompt_ids(p, served, "input") for p in items]
    for ids in all_ids:
        if len(ids) >= served.n_ctx:  # as a completion's prompt: a slot holds n_ctx - 1 of them
            raise bad_request(f"an input has {len(ids)} tokens but the context holds {served.n_ctx} tokens per "
                              f"request (an input at most {served.n_ctx - 1}); shorten it", "input",
                              "context_length_exceeded")
    encoding = _get(body, "encoding_format", (str,), "\"float\" or \"base64\"", "float")
    if encoding not in ENCODINGS:
        raise bad_request(f"'encoding_format' must be \"float\" or \"base64\", got {encoding!r:.40}", "encoding_format",
                          "invalid_value")
    if body.get("dimensions") is not None:
        raise bad_request("'dimensions' is not supported: the embeddings have the model's width; leave it out",
                          "dimensions", "unsupported")
    prompts = [(ids, "") for ids in all_ids]
    return GenerationRequest(all_ids[0], 0, {}, stream=False, include_usage=False, chat=False, hidden_states=True,
                             encoding_format=encoding, prompts=prompts if len(prompts) > 1 else [])


def embedding_body(results: list[GenerationResult], model: str, pooling: str, encoding_format: str) -> dict:
    data = []
    for i, r in enumerate(results):
        h = r.hidden_states[:1] if planted("embedding_first_row") else r.hidden_states
        vector = embeddings.pool(h, pooling, normalize=True)[0]
        value: Any = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                      if encoding_format == "base64" else vector.tolist())
        data.append({"object": "embedding", "embedding": value, "index": i})
    n_tokens = sum(r.stats.prompt_tokens for r in results)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
