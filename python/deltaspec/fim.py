"""Fill-in-the-middle prompts, as llama-server's /infill builds them (tools/server/server-common.cpp,
format_prompt_infill, in the pinned llama.cpp tree), so that an editor plugin written for it gets
the same prompt here:

    [extra context] FIM_PRE prefix [prompt] FIM_SUF suffix FIM_MID

The prefix keeps its last 3/4 of the batch (FIM_BATCH, or the context if smaller), the suffix its
first quarter less the prompt and two tokens; the extra context (files the editor sends: with the
model's FIM_REP and FIM_SEP tokens as the repo-level pattern "FIM_REP myproject\\n FIM_SEP name\\n
text ... FIM_SEP filename\\n", otherwise each text after a "--- snippet ---" line) fills what the
context leaves, its end kept. Unlike llama-server, the extra context is cut so that the whole
prompt leaves room for at least one generated token.
"""

from __future__ import annotations

from typing import Sequence

FIM_BATCH = 2048  # llama-server's default logical batch (-b), which its infill budget is cut from
_SNIPPET = "\n\n--- snippet ---\n\n"


class FimError(ValueError):
    """The model has no fill-in-the-middle tokens, or an argument is malformed."""


def wrap(tokenizer, prefix: Sequence[int], suffix: Sequence[int]) -> list[int]:
    """[BOS where the model adds one] FIM_PRE prefix FIM_SUF suffix FIM_MID, nothing cut (a
    completion's `suffix`). Raises FimError naming the missing FIM token."""
    fim = tokenizer.fim_ids
    missing = [name for role, name in (("pre", "prefix"), ("suf", "suffix"), ("mid", "middle")) if role not in fim]
    if missing:
        raise FimError(f"this model has no fill-in-the-middle {', '.join(missing)} token")
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    return bos + [fim["pre"]] + list(prefix) + [fim["suf"]] + list(suffix) + [fim["mid"]]


def infill_ids(tokenizer, prefix: str | Sequence[int], suffix: str | Sequence[int], n_ctx: int, prompt: str = "",
               extra: Sequence[dict] = ()) -> list[int]:
    """The token ids of an infill prompt. prefix / suffix: text (tokenized without special tokens,
    as llama-server does) or token ids; prompt: text put after the prefix (special tokens parsed);
    extra: [{"text": str, "filename": str (optional, default "tmp")}]. Raises FimError naming the
    missing FIM token."""
    fim = tokenizer.fim_ids
    wrap(tokenizer, [], [])  # raises without the FIM tokens

    def ids(x: str | Sequence[int], special: bool = False) -> list[int]:
        return tokenizer.encode(x, special=special) if isinstance(x, str) else list(x)

    extra_ids: list[int] = []
    if "rep" in fim:
        extra_ids += [fim["rep"]] + ids("myproject\n")
    for chunk in extra:
        if "sep" in fim:
            extra_ids += [fim["sep"]] + ids(chunk.get("filename", "tmp") + "\n")
        else:
            extra_ids += ids(_SNIPPET)
        extra_ids += ids(chunk["text"])
    if "sep" in fim:
        extra_ids += [fim["sep"]] + ids("filename\n")

    batch = min(FIM_BATCH, n_ctx)
    pre, suf, mid = ids(prefix), ids(suffix), ids(prompt, special=True)
    pre = pre[len(pre) - min(len(pre), 3 * (batch // 4)):]
    suf = suf[:min(len(suf), max(0, batch // 4 - (2 + len(mid))))]
    body = wrap(tokenizer, pre + mid, suf)
    # llama-server: n_ctx - n_batch - 2 * n_predict with its default n_predict of -1; then what keeps
    # one token of room
    n_extra = min(len(extra_ids), max(0, n_ctx - batch + 2), max(0, n_ctx - 1 - len(body)))
    return extra_ids[len(extra_ids) - n_extra:] + body
