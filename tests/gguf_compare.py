"""Comparing two GGUF files the way the converter tests need: every metadata key (type and value),
every tensor (name, order, shape, ggml type, bytes), then the whole file."""

from __future__ import annotations

from pathlib import Path

from deltaspec.gguf_file import read_gguf


def read_gguf_view(path: Path) -> tuple[dict[str, tuple], list[tuple]]:
    """key -> (GGUF value type, value) and [(name, ggml shape, type name, data bytes)], in file order.

    Arrays have the type (9, element type). The whole-file comparison in assert_same_gguf catches
    whatever this view would not (float bit patterns, the element types inside an array of arrays,
    padding).
    """
    g = read_gguf(path)
    assert g.version == 3, path
    buf = path.read_bytes()
    kv = {key: (g.value_types[key], value) for key, value in g.metadata.items()}
    tensors = [(t.name, t.shape, t.type.name, buf[t.offset:t.offset + t.n_bytes]) for t in g.tensors.values()]
    return kv, tensors


def assert_same_gguf(mine: Path, reference: Path, not_compared: dict[str, str] | None = None) -> None:
    """The same tensors, the same keys with the same types and values in the same order, and, when
    no key is left out (`not_compared`: key -> why it may differ), the very same bytes."""
    not_compared = not_compared or {}
    ref_kv, ref_t = read_gguf_view(reference)
    our_kv, our_t = read_gguf_view(mine)

    assert [t[0] for t in our_t] == [t[0] for t in ref_t], "tensor names or order differ"
    for (tname, shape, qtype, data), (_, rshape, rqtype, rdata) in zip(our_t, ref_t):
        assert (shape, qtype) == (rshape, rqtype), tname
        same = data == rdata  # a bare assert would make pytest diff megabytes
        assert same, f"{tname}: bytes differ"

    keys = (set(ref_kv) | set(our_kv)) - set(not_compared)
    assert sorted(keys - set(our_kv)) == [], "keys only llama.cpp writes"
    assert sorted(keys - set(ref_kv)) == [], "keys only deltaspec writes"
    for key in sorted(keys):
        same = our_kv[key] == ref_kv[key]
        assert same, f"{key}: ours {_short(our_kv[key])} != llama.cpp {_short(ref_kv[key])}"
    assert [k for k in our_kv if k in keys] == [k for k in ref_kv if k in keys], "same keys, other order"

    if not not_compared:  # same keys in the same order, same alignment: the very same file
        same = mine.read_bytes() == reference.read_bytes()
        assert same, "files differ outside the compared keys and tensors"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) < 300 else text[:300] + "..."
