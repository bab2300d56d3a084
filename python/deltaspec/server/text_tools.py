"""llama-server's text endpoints, answered from the tokenizer and chat template alone (the engine
is not involved, so they answer while every slot is busy):

- POST /tokenize {"content", "add_special" (false), "parse_special" (true), "with_pieces" (false)}
  -> {"tokens": [id, ...]}, or [{"id", "piece"}, ...] with with_pieces (a piece that is not whole
  UTF-8 is its list of bytes, as llama-server gives it);
- POST /detokenize {"tokens": [id, ...]} -> {"content": text} (control tokens as their text);
- POST /apply-template {"messages", "tools", "chat_template_kwargs"} -> {"prompt": text}, the prompt
  /v1/chat/completions would evaluate for those messages.
Fields of the wrong type and token ids outside the vocabulary are 400s naming the field.
"""

from __future__ import annotations

from typing import Any

from .errors import bad_request
from .planted import planted
from .schemas import Served, _get, _type, chat_prompt


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_type(body)}", None, "invalid_body")
    return body


def tokenize(body: Any, served: Served) -> dict:
    body = _object(body)
    content = body.get("content")
    if not isinstance(content, str):
        raise bad_request(f"'content' must be a string (the text to tokenize), got {_type(content)}", "content",
                          "invalid_type" if content is not None else "missing")
    add_special = _get(body, "add_special", (bool,), "true or false", False)
    parse_special = _get(body, "parse_special", (bool,), "true or false", True)
    with_pieces = _get(body, "with_pieces", (bool,), "true or false", False)
    tokenizer = served.tokenizer
    ids = tokenizer.encode(content, special=parse_special and not planted("tokenize_plain"))
    if add_special and tokenizer.add_bos and tokenizer.bos_id is not None:
        ids = [tokenizer.bos_id] + ids
    if not with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": _piece(tokenizer.token_to_piece(t))} for t in ids]}


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def detokenize(body: Any, served: Served) -> dict:
    body = _object(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise bad_request(f"'tokens' must be an array of token ids, got {_type(tokens)}", "tokens",
                          "invalid_type" if tokens is not None else "missing")
    bad = [t for t in tokens if not 0 <= t < served.n_vocab]
    if bad:
        raise bad_request(f"'tokens' holds token id {bad[0]}, outside the vocabulary [0, {served.n_vocab})", "tokens",
                          "invalid_value")
    return {"content": served.tokenizer.decode(tokens)}


def apply_template(body: Any, served: Served) -> dict:
    return {"prompt": chat_prompt(_object(body), served)}
