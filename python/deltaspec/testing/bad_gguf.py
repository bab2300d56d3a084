"""A deterministic corpus of corrupted GGUF files, made from one small valid file.

`corpus(base)` takes the bytes of a valid qwen35 GGUF (the tiny-vocabulary model of `tiny_vocab`)
and returns `BadFile`s: each has a short id saying what was damaged (e.g. "kv4/key-length=huge",
"tensor7/offset+0x20", "missing/qwen35.ssm.state_size"), a family, the words the error must
contain, and where the damage must be caught ("read": `gguf_file.read_gguf`, "info": the
hyper-parameter and tensor checks that `deltaspec info` runs too, "model": only when `Model` builds
the tokenizer). `make()` returns the damaged bytes.

Only structural fields are damaged (lengths, counts, types, names, dimensions, offsets, required
values, alignment), never weight values, so every file is broken by construction: none of them may
load. Two kinds of edits are used. Byte edits change the file in place at offsets found by this
module's own walk over the file (`layout`), independent of the parser under test. Rebuilds write the
file again from its parts (`Parts`) with one part changed, which makes damage that must keep the
rest consistent: a duplicated key, a removed tensor, another alignment, a value of the wrong type.

`run_corpus` opens every file of the corpus and reports what each raised; `python -m
deltaspec.testing.bad_gguf BASE WORKDIR` does so in a child process, one JSON line per case, so a
crash or hang names the case it happened in (see tests/test_bad_file_corpus.py).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

HEADER = 24  # magic, u32 version, u64 tensor count, u64 metadata count
# GGUF scalar value type id -> struct format
_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_SIZE = {t: struct.calcsize(f) for t, f in _FORMATS.items()}
STRING, ARRAY, UINT32, UINT64, FLOAT32 = 8, 9, 4, 10, 6
ALIGNMENT = 32  # the tiny-vocab file has no general.alignment key: GGUF's default

# Keys a qwen35 file cannot load without (qwen35.read_hparams and Tokenizer.from_metadata); the
# others have defaults, so removing them leaves a valid file.
REQUIRED_KEYS = (
    "general.architecture", "qwen35.context_length", "qwen35.embedding_length", "qwen35.block_count",
    "qwen35.attention.head_count", "qwen35.rope.dimension_sections", "qwen35.attention.layer_norm_rms_epsilon",
    "qwen35.ssm.conv_kernel", "qwen35.ssm.state_size", "qwen35.ssm.group_count", "qwen35.ssm.time_step_rank",
    "qwen35.ssm.inner_size", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
)
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges")
OPTIONAL_TENSORS = ("output.weight",)  # without it the LM head is tied to token_embd: still a valid file


# --- the file's structure ------------------------------------------------------------------------

@dataclass(frozen=True)
class KV:
    index: int
    key: str
    vtype: int
    start: int        # the key's u64 length
    type_at: int      # the u32 value type
    value_at: int
    end: int
    etype: int | None = None      # arrays: element type and count
    count: int | None = None


@dataclass(frozen=True)
class Info:
    index: int
    name: str
    start: int        # the name's u64 length
    n_dims_at: int
    dims_at: int
    type_at: int
    offset_at: int
    end: int
    shape: tuple[int, ...]
    type_id: int
    offset: int       # relative to the data section
    n_bytes: int


@dataclass(frozen=True)
class Layout:
    size: int
    kvs: tuple[KV, ...]
    infos: tuple[Info, ...]
    table_end: int
    data_start: int

    def kv(self, key: str) -> KV:
        return next(k for k in self.kvs if k.key == key)

    def info(self, name: str) -> Info:
        return next(t for t in self.infos if t.name == name)


def _u64(buf: bytes, at: int) -> int:
    return struct.unpack_from("<Q", buf, at)[0]


def _u32(buf: bytes, at: int) -> int:
    return struct.unpack_from("<I", buf, at)[0]


def _skip_value(buf: bytes, at: int, vtype: int) -> int:
    if vtype in _SCALAR_SIZE:
        return at + _SCALAR_SIZE[vtype]
    if vtype == STRING:
        return at + 8 + _u64(buf, at)
    etype, n = _u32(buf, at), _u64(buf, at + 4)
    at += 12
    if etype in _SCALAR_SIZE:
        return at + n * _SCALAR_SIZE[etype]
    for _ in range(n):
        at = _skip_value(buf, at, etype)
    return at


def _string(buf: bytes, at: int) -> tuple[str, int]:
    """The length-prefixed string at `at` (a key or a tensor name) and where the field after it starts."""
    n = _u64(buf, at)
    return buf[at + 8:at + 8 + n].decode(), at + 8 + n


def _n_bytes(shape: tuple[int, ...], type_id: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    return int(np.prod(shape)) // block * size


def layout(buf: bytes) -> Layout:
    """Where every field of a valid GGUF lies (the base file must be valid: nothing is checked)."""
    n_tensors, n_kv = _u64(buf, 8), _u64(buf, 16)
    at, kvs = HEADER, []
    for i in range(n_kv):
        start = at
        key, type_at = _string(buf, at)
        vtype = _u32(buf, type_at)
        value_at = type_at + 4
        end = _skip_value(buf, value_at, vtype)
        etype, count = (_u32(buf, value_at), _u64(buf, value_at + 4)) if vtype == ARRAY else (None, None)
        kvs.append(KV(i, key, vtype, start, type_at, value_at, end, etype, count))
        at = end
    infos = []
    for i in range(n_tensors):
        start = at
        name, n_dims_at = _string(buf, at)
        n_dims = _u32(buf, n_dims_at)
        dims_at = n_dims_at + 4
        shape = tuple(_u64(buf, dims_at + 8 * j) for j in range(n_dims))
        type_at = dims_at + 8 * n_dims
        type_id = _u32(buf, type_at)
        offset = _u64(buf, type_at + 4)
        at = type_at + 12
        infos.append(Info(i, name, start, n_dims_at, dims_at, type_at, type_at + 4, at, shape, type_id, offset,
                          _n_bytes(shape, type_id)))
    data_start = (at + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    return Layout(len(buf), tuple(kvs), tuple(infos), at, data_start)


# --- writing a file again from its parts ---------------------------------------------------------

def encode_string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def encode_kv(key: str, vtype: int, value) -> bytes:
    """One metadata entry; arrays as (element type, list)."""
    out = encode_string(key) + struct.pack("<I", vtype)
    if vtype == ARRAY:
        etype, items = value
        out += struct.pack("<IQ", etype, len(items))
        return out + b"".join(_encode_scalar(etype, v) for v in items)
    return out + _encode_scalar(vtype, value)


def _encode_scalar(vtype: int, value) -> bytes:
    return encode_string(value) if vtype == STRING else struct.pack(_FORMATS[vtype], value)


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    type_id: int
    data: bytes


@dataclass(frozen=True)
class Parts:
    """A GGUF as metadata entries (encoded bytes, in order) and tensors; `build` lays the data out
    packed in table order, as GGUF writers do and ggml requires."""
    kvs: tuple[tuple[str, bytes], ...]
    tensors: tuple[Tensor, ...]

    def build(self, alignment: int = ALIGNMENT, version: int = 3) -> bytes:
        head = b"GGUF" + struct.pack("<IQQ", version, len(self.tensors), len(self.kvs))
        meta = b"".join(raw for _, raw in self.kvs)
        table, data, offset = [], [], 0
        for t in self.tensors:
            table.append(encode_string(t.name) + struct.pack("<I", len(t.shape))
                         + struct.pack(f"<{len(t.shape)}Q", *t.shape) + struct.pack("<IQ", t.type_id, offset))
            padded = -(-len(t.data) // alignment) * alignment
            data.append(t.data + bytes(padded - len(t.data)))
            offset += padded
        out = head + meta + b"".join(table)
        return out + bytes(-len(out) % alignment) + b"".join(data)

    def without_kv(self, key: str) -> "Parts":
        return replace(self, kvs=tuple(kv for kv in self.kvs if kv[0] != key))

    def with_kv(self, key: str, vtype: int, value) -> "Parts":
        """`key` set to the value (in place when present, else appended)."""
        raw = encode_kv(key, vtype, value)
        if any(k == key for k, _ in self.kvs):
            return replace(self, kvs=tuple((k, raw if k == key else r) for k, r in self.kvs))
        return replace(self, kvs=self.kvs + ((key, raw),))

    def without_tensor(self, name: str) -> "Parts":
        return replace(self, tensors=tuple(t for t in self.tensors if t.name != name))

    def with_tensor(self, tensor: Tensor) -> "Parts":
        """`tensor` in place of the one of that name, or appended."""
        if any(t.name == tensor.name for t in self.tensors):
            return replace(self, tensors=tuple(tensor if t.name == tensor.name else t for t in self.tensors))
        return replace(self, tensors=self.tensors + (tensor,))


def parts(buf: bytes, lay: Layout) -> Parts:
    kvs = tuple((k.key, bytes(buf[k.start:k.end])) for k in lay.kvs)
    tensors = tuple(Tensor(t.name, t.shape, t.type_id,
                           bytes(buf[lay.data_start + t.offset:lay.data_start + t.offset + t.n_bytes]))
                    for t in lay.infos)
    return Parts(kvs, tensors)


# --- the corpus ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BadFile:
    id: str
    family: str
    expect: tuple[str, ...]   # every one of these must be in the error message
    stage: str                # "read", "info" or "model": the first entry point that must refuse it
    make: Callable[[], bytes] = field(repr=False, compare=False)


def _patched(buf: bytes, at: int, data: bytes, *more: tuple[int, bytes]) -> Callable[[], bytes]:
    """`buf` with `data` written at `at` (and each further (offset, data) pair)."""
    def make() -> bytes:
        out = bytearray(buf)
        for offset, raw in ((at, data), *more):
            out[offset:offset + len(raw)] = raw
        return bytes(out)
    return make


def _cut(buf: bytes, at: int) -> Callable[[], bytes]:
    return lambda: bytes(buf[:at])


def _built(p: Parts, **kwargs) -> Callable[[], bytes]:
    return lambda: p.build(**kwargs)


HUGE = 1 << 62          # a length or count far past any file
UNKNOWN_VALUE_TYPES = (13, 255, 0x10000, 0x80000000)
UNKNOWN_GGML_TYPES = (4, 5, 31, 33, 36, 38, 42, 200, 0xFFFFFFFF)  # removed ids, ids past the last, garbage


def corpus(base: bytes) -> list[BadFile]:
    """Every corrupted file made from `base` (a valid qwen35 GGUF, e.g. the tiny-vocab model), in a
    fixed order. The expectations follow from the damage: truncating inside metadata entry #i must
    name 'key #i', damaging a tensor's table entry must name the tensor, and so on."""
    lay = layout(base)
    whole = parts(base, lay)
    cases: list[BadFile] = []

    def add(id_: str, family: str, expect: tuple[str, ...] | str, stage: str, make: Callable[[], bytes]) -> None:
        cases.append(BadFile(id_, family, (expect,) if isinstance(expect, str) else tuple(expect), stage, make))

    for family_cases in (_truncations, _header_and_counts, _metadata_entries, _tensor_entries, _rebuilt,
                         _wrong_values):
        family_cases(base, lay, whole, add)

    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return cases


def _truncations(base: bytes, lay: Layout, whole: Parts, add: Callable[..., None]) -> None:
    """Cuts at every section boundary and inside a few sections."""
    last_tensor_end = max(lay.data_start + t.offset + t.n_bytes for t in lay.infos)
    for n in (0, 3, 4, 8, 16, 23):
        add(f"cut/header@{n}", "truncation", "too short", "read", _cut(base, n))
    for k in lay.kvs:
        add(f"cut/kv{k.index}.start", "truncation", f"key #{k.index}", "read", _cut(base, k.start))
        add(f"cut/kv{k.index}.value", "truncation", f"key #{k.index} '{k.key}'", "read", _cut(base, k.value_at))
    for k in (lay.kv("general.architecture"), lay.kv("tokenizer.ggml.tokens"), lay.kv("tokenizer.ggml.merges")):
        add(f"cut/kv{k.index}.inside", "truncation", f"'{k.key}'", "read", _cut(base, (k.value_at + k.end) // 2))
        add(f"cut/kv{k.index}.type", "truncation", f"'{k.key}'", "read", _cut(base, k.type_at + 2))
    for t in lay.infos:
        add(f"cut/tensor{t.index}.start", "truncation", f"tensor #{t.index}", "read", _cut(base, t.start))
    for t in lay.infos[::7]:
        add(f"cut/tensor{t.index}.dims", "truncation", f"'{t.name}'", "read", _cut(base, t.dims_at + 3))
        add(f"cut/tensor{t.index}.offset", "truncation", f"'{t.name}'", "read", _cut(base, t.offset_at))
    add("cut/table-end", "truncation", f"'{lay.infos[0].name}'", "read", _cut(base, lay.table_end))
    for t in lay.infos:
        at = lay.data_start + t.offset
        add(f"cut/data{t.index}.start", "truncation", f"'{t.name}'", "read", _cut(base, at))
    for t in lay.infos[::5]:
        add(f"cut/data{t.index}.inside", "truncation", f"'{t.name}'", "read",
            _cut(base, lay.data_start + t.offset + t.n_bytes // 2 + 1))
    add("cut/last-byte", "truncation", f"'{lay.infos[-1].name}'", "read", _cut(base, last_tensor_end - 1))


def _header_and_counts(base: bytes, lay: Layout, whole: Parts, add: Callable[..., None]) -> None:
    """Magic, version, and counts that lie about the entries the file holds."""
    for i in range(4):
        add(f"header/magic{i}", "header", "magic", "read", _patched(base, i, bytes([base[i] ^ 0x20])))
    add("header/magic-ggml", "header", "magic", "read", _patched(base, 0, b"GGML"))
    for v in (0, 1, 4, 0xFFFFFFFF, 0x03000000):
        add(f"header/version={v:#x}", "header", f"version {v}", "read", _patched(base, 4, struct.pack("<I", v)))
    for what, at in (("tensor count", 8), ("metadata count", 16)):
        for v in (HUGE, (1 << 64) - 1, (1 << 26) + 1):
            add(f"header/{what.replace(' ', '-')}={v:#x}", "lying count", what, "read",
                _patched(base, at, struct.pack("<Q", v)))

    # lying counts: one more or fewer entry than the file holds
    n_t, n_kv = len(lay.infos), len(lay.kvs)
    add("count/tensors+1", "lying count", f"tensor #{n_t}", "read", _patched(base, 8, struct.pack("<Q", n_t + 1)))
    add("count/tensors-1", "lying count", f"'{lay.infos[-1].name}' is missing", "info",
        _patched(base, 8, struct.pack("<Q", n_t - 1)))
    add("count/tensors=0", "lying count", f"'{lay.infos[0].name}' is missing", "info",
        _patched(base, 8, struct.pack("<Q", 0)))
    # one entry too few: the last metadata entry is read as the first tensor (its value type as n_dims)
    add("count/kv-1", "lying count", f"tensor #0 '{lay.kvs[-1].key}'", "read",
        _patched(base, 16, struct.pack("<Q", n_kv - 1)))
    add("count/kv=0", "lying count", f"tensor #0 '{lay.kvs[0].key}'", "read", _patched(base, 16, struct.pack("<Q", 0)))
    # one too many: the first tensor entry is read as a metadata entry; what follows is garbage
    add("count/kv+1", "lying count", "tensor #0", "read", _patched(base, 16, struct.pack("<Q", n_kv + 1)))
    for k in (k for k in lay.kvs if k.vtype == ARRAY):
        add(f"count/kv{k.index}.array=huge", "lying count", f"'{k.key}'", "read",
            _patched(base, k.value_at + 4, struct.pack("<Q", HUGE)))
        add(f"count/kv{k.index}.array=max", "lying count", f"'{k.key}'", "read",
            _patched(base, k.value_at + 4, struct.pack("<Q", 1 << 26)))


def _metadata_entries(base: bytes, lay: Layout, whole: Parts, add: Callable[..., None]) -> None:
    """Key lengths and bytes, value types, string lengths and bytes, array element types."""
    for k in lay.kvs:
        i = k.index
        add(f"kv{i}/key-length=huge", "metadata", f"key #{i}", "read", _patched(base, k.start, struct.pack("<Q", HUGE)))
        add(f"kv{i}/key-length=0", "metadata", f"key #{i} is empty", "read", _patched(base, k.start, bytes(8)))
        add(f"kv{i}/key-not-utf8", "metadata", f"key #{i}", "read", _patched(base, k.start + 8, b"\xff"))
        bad = UNKNOWN_VALUE_TYPES[i % len(UNKNOWN_VALUE_TYPES)]
        add(f"kv{i}/type={bad:#x}", "metadata", (f"key #{i} '{k.key}'", f"type {bad}"), "read",
            _patched(base, k.type_at, struct.pack("<I", bad)))
        if k.vtype == STRING and k.end > k.value_at + 8:
            add(f"kv{i}/string-length=huge", "metadata", f"'{k.key}'", "read",
                _patched(base, k.value_at, struct.pack("<Q", HUGE)))
            add(f"kv{i}/string-not-utf8", "metadata", (f"'{k.key}'", "UTF-8"), "read",
                _patched(base, k.value_at + 8, b"\xfe"))
        if k.vtype == ARRAY:
            add(f"kv{i}/element-type=13", "metadata", (f"'{k.key}'", "element type 13"), "read",
                _patched(base, k.value_at, struct.pack("<I", 13)))
            if k.etype == STRING:
                add(f"kv{i}/element0-length=huge", "metadata", f"'{k.key}'", "read",
                    _patched(base, k.value_at + 12, struct.pack("<Q", HUGE)))
    for key in REQUIRED_KEYS:
        k = lay.kv(key)
        # one letter of the key upper-cased: the key the loader looks for is gone
        renamed = key[:-1] + key[-1].upper()
        stage = "model" if key in TOKENIZER_KEYS else "info"
        add(f"kv{k.index}/renamed", "missing key", f"'{key}'", stage, _patched(base, k.start + 8, renamed.encode()))


def _tensor_entries(base: bytes, lay: Layout, whole: Parts, add: Callable[..., None]) -> None:
    """Names, n_dims, dims, types and offsets of the tensor table."""
    n_t = len(lay.infos)
    for t in lay.infos:
        j, name = t.index, t.name
        add(f"tensor{j}/name-length=huge", "tensor info", f"tensor #{j}", "read",
            _patched(base, t.start, struct.pack("<Q", HUGE)))
        add(f"tensor{j}/name-not-utf8", "tensor info", f"tensor #{j}", "read", _patched(base, t.start + 8, b"\xff"))
        n_dims = (0, 5, 0xFFFFFFFF)[j % 3]
        add(f"tensor{j}/n_dims={n_dims}", "tensor info", (f"'{name}'", f"{n_dims} dimensions"), "read",
            _patched(base, t.n_dims_at, struct.pack("<I", n_dims)))
        dim = (0, (1 << 64) - 1, 1 << 40)[j % 3]
        add(f"tensor{j}/dim0={dim:#x}", "absurd dims", (f"'{name}'", "shape"), "read",
            _patched(base, t.dims_at, struct.pack("<Q", dim)))
        bad = UNKNOWN_GGML_TYPES[j % len(UNKNOWN_GGML_TYPES)]
        add(f"tensor{j}/type={bad:#x}", "unknown type", (f"'{name}'", f"type id {bad}"), "read",
            _patched(base, t.type_at, struct.pack("<I", bad)))
        delta = (1, 4, ALIGNMENT, 1 << 40)[j % 4]
        add(f"tensor{j}/offset+{delta:#x}", "offset", (f"'{name}'", "offset"), "read",
            _patched(base, t.offset_at, struct.pack("<Q", t.offset + delta)))
    for j in range(1, n_t, 4):
        t, prev = lay.infos[j], lay.infos[j - 1]
        add(f"tensor{j}/offset=previous", "offset", (f"'{t.name}'", "offset"), "read",
            _patched(base, t.offset_at, struct.pack("<Q", prev.offset)))
        # a larger first dimension: the data of this tensor runs into the next one's, or (when the
        # padding after it absorbs the growth) the shape is not the one the graph needs
        grown = (t.shape[0] + GGML_QUANT_SIZES[GGMLQuantizationType(t.type_id)][0],) + t.shape[1:]
        runs_over = _padded(_n_bytes(grown, t.type_id)) != _padded(t.n_bytes)
        expect = (f"'{t.name}'", f"'{lay.infos[j + 1].name}'") if runs_over else (f"'{t.name}'",)
        add(f"tensor{j}/dim0+1", "absurd dims", expect, "read" if runs_over else "info",
            _patched(base, t.dims_at, struct.pack("<Q", grown[0])))
    same_size = _pairs_of_equal_size(lay)
    for a, b in same_size[:6]:
        # two tensors' offsets swapped: each would read the other's bytes
        add(f"tensor{a.index}/offset-swapped-{b.index}", "offset", (f"'{a.name}'", "offset"), "read",
            _patched(base, a.offset_at, struct.pack("<Q", b.offset), (b.offset_at, struct.pack("<Q", a.offset))))
    for t in lay.infos:
        if t.name in OPTIONAL_TENSORS:
            continue
        if t.type_id == 0 and len(t.shape) == 2 and t.shape[0] != t.shape[1]:
            # same byte size and same packing, the shape the graph needs transposed
            add(f"tensor{t.index}/dims-swapped", "tensor shape", f"'{t.name}'", "info",
                _patched(base, t.dims_at, struct.pack("<QQ", t.shape[1], t.shape[0])))
        if t.type_id == 0:
            # I32 has F32's size: the table stays consistent, the type is one no weight may have
            add(f"tensor{t.index}/type=I32", "tensor type", (f"'{t.name}'", "I32"), "info",
                _patched(base, t.type_at, struct.pack("<I", GGMLQuantizationType.I32)))
        # one letter of the name changed: the tensor the graph reads is missing
        add(f"tensor{t.index}/renamed", "missing tensor", f"'{t.name}' is missing", "info",
            _patched(base, t.start + 8 + len(t.name) - 1, t.name[-1].upper().encode()))


def _rebuilt(base: bytes, lay: Layout, whole: Parts, add: Callable[..., None]) -> None:
    """Duplicates, alignment, architecture, missing keys and tensors: files written again."""
    for key in ("general.architecture", "qwen35.block_count", "tokenizer.ggml.tokens", "tokenizer.ggml.eos_token_id"):
        raw = dict(whole.kvs)[key]
        add(f"dup/key:{key}", "duplicate", (f"'{key}'", "twice"), "read",
            _built(replace(whole, kvs=whole.kvs + ((key, raw),))))
    for t in (whole.tensors[0], whole.tensors[5], whole.tensors[-1]):
        add(f"dup/tensor:{t.name}", "duplicate", (f"'{t.name}'", "twice"), "read",
            _built(replace(whole, tensors=whole.tensors + (t,))))
    add("kv/empty-key", "metadata", "is empty", "read", _built(whole.with_kv("", UINT32, 1)))
    # an array whose elements are arrays: GGUF's type system allows it, ggml's loader does not
    nested = encode_string("general.nested") + struct.pack("<IIQIQI", ARRAY, ARRAY, 1, UINT32, 1, 7)
    add("kv/array-of-arrays", "metadata", ("'general.nested'", "array of arrays"), "read",
        _built(replace(whole, kvs=whole.kvs + (("general.nested", nested),))))
    long_name = "blk.0." + "x" * 58 + ".weight"
    add("tensor/name-too-long", "tensor info", ("name", "long"), "read",
        _built(whole.with_tensor(Tensor(long_name, (4,), 0, bytes(16)))))
    add("tensor/extra-unknown-type", "unknown type", ("'extra.weight'", "type id 42"), "read",
        _built(whole.with_tensor(Tensor("extra.weight", (32,), 42, bytes(64)))))
    for value in (0, 3, 48, 0x80000001):
        add(f"align/u32={value}", "alignment", ("general.alignment", f"{value}"), "read",
            _built(whole.with_kv("general.alignment", UINT32, value)))
    add("align/u64=32", "alignment", ("general.alignment", "uint32"), "read",
        _built(whole.with_kv("general.alignment", UINT64, 32)))
    add("align/string", "alignment", ("general.alignment", "uint32"), "read",
        _built(whole.with_kv("general.alignment", STRING, "32")))
    add("align/f32=32", "alignment", ("general.alignment", "uint32"), "read",
        _built(whole.with_kv("general.alignment", FLOAT32, 32.0)))
    # says 64 while the data is laid out for 32: the first tensor off a multiple of 64 is misplaced
    add("align/64-data-32", "alignment", (f"'{_first_misplaced(lay, 64)}'", "alignment 64"), "read",
        lambda: _realigned(whole, 64, 32))
    for arch in ("llama", "qwen3", "qwen35moe", "qwen3next", ""):
        add(f"arch/{arch or 'empty'}", "architecture", ("general.architecture", f"'{arch}'"), "info",
            _built(whole.with_kv("general.architecture", STRING, arch)))
    add("arch/uint32", "architecture", "general.architecture", "info",
        _built(whole.with_kv("general.architecture", UINT32, 35)))
    for key in REQUIRED_KEYS:
        add(f"missing/{key}", "missing key", f"'{key}'", "model" if key in TOKENIZER_KEYS else "info",
            _built(whole.without_kv(key)))
    for t in whole.tensors:
        # the global tensors and one layer of each kind
        if t.name in OPTIONAL_TENSORS or (t.name.startswith("blk.") and not t.name.startswith(("blk.0.", "blk.3."))):
            continue
        add(f"missing/{t.name}", "missing tensor", f"'{t.name}' is missing", "info",
            _built(whole.without_tensor(t.name)))


def _wrong_values(base: bytes, lay: Layout, whole: Parts, add: Callable[..., None]) -> None:
    """Known keys holding a value of the wrong GGUF type, out of range, or inconsistent with the
    tensors (the file itself parses)."""
    for key in ("qwen35.embedding_length", "qwen35.block_count", "qwen35.attention.head_count",
                "qwen35.ssm.state_size", "qwen35.context_length"):
        add(f"wrong-type/{key}:string", "wrong value type", (f"'{key}'", "integer"), "info",
            _built(whole.with_kv(key, STRING, "4")))
        add(f"wrong-type/{key}:float", "wrong value type", (f"'{key}'", "integer"), "info",
            _built(whole.with_kv(key, FLOAT32, 4.0)))
    add("wrong-type/rope.dimension_sections:uint32", "wrong value type", ("'qwen35.rope.dimension_sections'", "array"),
        "info", _built(whole.with_kv("qwen35.rope.dimension_sections", UINT32, 8)))
    add("wrong-type/rms_epsilon:string", "wrong value type", ("'qwen35.attention.layer_norm_rms_epsilon'", "number"),
        "info", _built(whole.with_kv("qwen35.attention.layer_norm_rms_epsilon", STRING, "1e-6")))
    for key, vtype, value, word in (
            ("tokenizer.ggml.tokens", UINT32, 265, "array"), ("tokenizer.ggml.merges", STRING, "a b", "array"),
            ("tokenizer.ggml.model", UINT32, 2, "string"),
            ("tokenizer.ggml.pre", ARRAY, (STRING, ["qwen35"]), "string"),
            ("tokenizer.ggml.eos_token_id", STRING, "eos", "token id"),
            ("tokenizer.ggml.tokens", ARRAY, (UINT32, list(range(265))), "tokenizer.ggml.tokens")):
        add(f"wrong-type/{key}:{vtype}", "wrong value type", (f"{key}", word), "model",
            _built(whole.with_kv(key, vtype, value)))

    # values out of range or inconsistent with the tensors (the file itself parses)
    for key, value, words in (("qwen35.embedding_length", 32, "'token_embd.weight'"),
                             ("qwen35.attention.head_count", 4, "'blk.3.attn_q.weight'"),
                             ("qwen35.attention.head_count_kv", 2, "'blk.3.attn_k.weight'"),
                             ("qwen35.ssm.conv_kernel", 3, "'blk.0.ssm_conv1d.weight'"),
                             ("qwen35.full_attention_interval", 2, ("'blk.1.attn_q.weight'", "layer pattern")),
                             ("qwen35.block_count", 5, "'blk.4.attn_norm.weight'"),
                             ("qwen35.full_attention_interval", 0, "full_attention_interval"),
                             ("qwen35.block_count", 0, "block_count"),
                             ("qwen35.ssm.inner_size", 65, "inner_size"),
                             ("qwen35.context_length", 0, "context_length"),
                             ("qwen35.attention.head_count", 0, "head_count")):
        add(f"hparam/{key}={value}", "inconsistent hparams", words, "info", _built(whole.with_kv(key, UINT32, value)))
    add("hparam/time_step_rank=4", "inconsistent hparams", "'blk.0.attn_qkv.weight'", "info",
        _built(whole.with_kv("qwen35.ssm.time_step_rank", UINT32, 4).with_kv("qwen35.ssm.inner_size", UINT32, 128)))
    add("hparam/rms_epsilon=nan", "inconsistent hparams", "epsilon", "info",
        _built(whole.with_kv("qwen35.attention.layer_norm_rms_epsilon", FLOAT32, float("nan"))))
    # the attention layer moved: layer 3 now DeltaNet, layer 0 attention
    add("hparam/recurrent_layers", "inconsistent hparams", ("'blk.0.attn_q.weight'", "layer pattern"), "info",
        _built(whole.with_kv("qwen35.attention.recurrent_layers", ARRAY, (7, [False, True, True, True]))))
    add("hparam/rope_sections", "inconsistent hparams", "dimension_sections", "info",
        _built(whole.with_kv("qwen35.rope.dimension_sections", ARRAY, (5, [8, 8, 8, 8]))))
    n_tokens = lay.kv("tokenizer.ggml.tokens").count
    add("tokenizer/eos-out-of-range", "inconsistent hparams", "tokenizer.ggml.eos_token_id", "model",
        _built(whole.with_kv("tokenizer.ggml.eos_token_id", UINT32, n_tokens)))
    add("tokenizer/types-short", "inconsistent hparams", "tokenizer.ggml.token_type", "model",
        _built(whole.with_kv("tokenizer.ggml.token_type", ARRAY, (5, [1] * (n_tokens - 1)))))
    add("tokenizer/model=llama", "inconsistent hparams", "tokenizer.ggml.model", "model",
        _built(whole.with_kv("tokenizer.ggml.model", STRING, "llama")))
    add("tokenizer/pre=unknown", "inconsistent hparams", "tokenizer.ggml.pre", "model",
        _built(whole.with_kv("tokenizer.ggml.pre", STRING, "nonesuch")))
    for name, grow in (("token_embd.weight", 1), ("blk.0.ffn_gate.weight", 1), ("blk.3.attn_q_norm.weight", 0)):
        t = next(t for t in whole.tensors if t.name == name)
        shape = (t.shape[0] + 32,) + t.shape[1:] if grow == 0 else t.shape[:1] + (t.shape[1] + 1,)
        add(f"shape/{name}", "tensor shape", f"'{name}'", "info",
            _built(whole.with_tensor(Tensor(name, shape, t.type_id, bytes(_n_bytes(shape, t.type_id))))))
    add("shape/ssm_a:f16", "tensor type", ("'blk.0.ssm_a'", "F16"), "info",
        _built(whole.with_tensor(Tensor("blk.0.ssm_a", (2,), 1, bytes(4)))))




def _padded(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def _pairs_of_equal_size(lay: Layout) -> list[tuple[Info, Info]]:
    out = []
    for a, b in zip(lay.infos, lay.infos[1:]):
        if a.n_bytes == b.n_bytes:
            out.append((a, b))
    return out


def _first_misplaced(lay: Layout, alignment: int) -> str:
    offset = 0
    for t in lay.infos:
        if t.offset != offset:
            return t.name
        offset += -(-t.n_bytes // alignment) * alignment
    raise ValueError(f"every tensor of the base file is already placed for alignment {alignment}")


def _realigned(whole: Parts, claimed: int, actual: int) -> bytes:
    """The file with general.alignment = `claimed` but its data laid out for `actual`."""
    return whole.with_kv("general.alignment", UINT32, claimed).build(alignment=actual)


# --- running the corpus --------------------------------------------------------------------------

def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mapped(path: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(path in line for line in f)


def _attempt(fn) -> list | None:
    """[class name, is DeltaspecError, is ValueError, message] of what fn raised, or None."""
    from ..errors import DeltaspecError
    try:
        result = fn()
    except Exception as e:  # every exception is reported; the test judges which are acceptable
        return [type(e).__name__, isinstance(e, DeltaspecError), isinstance(e, ValueError), str(e)]
    close = getattr(result, "close", None)
    if close is not None:
        close()
    return None


def _cli_info(path: str) -> list:
    """[exit code, stderr] of `deltaspec info PATH` run in this process (stdout discarded)."""
    import contextlib
    import io

    from ..cli import main
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(["info", path, "-c", "64"])
        except Exception as e:  # escaping main is a failure the test reports
            code = f"raised {type(e).__name__}: {e}"
    return [code, err.getvalue()]


def run_case(case: BadFile, path: str) -> dict:
    """Write the case to `path` (a new file each time, so a mapping left open shows in
    /proc/self/maps as a deleted file) and open it with read_gguf, describe (what `deltaspec info`
    prints), `deltaspec info` itself and Model."""
    from .. import Model
    from ..gguf_file import read_gguf
    from ..info import describe
    if os.path.exists(path):
        os.unlink(path)
    data = case.make()
    with open(path, "wb") as f:
        f.write(data)
    return {"id": case.id, "sha1": hashlib.sha1(data).hexdigest(),
            "read": _attempt(lambda: read_gguf(path)),
            "info": _attempt(lambda: describe(path, n_ctx=64)),
            "cli": _cli_info(path),
            "model": _attempt(lambda: Model(path, n_ctx=64, n_threads=1, progress=False))}


def run_corpus(base_path: str, workdir: str, out=sys.stdout, leak_pass: bool = True,
               family: str | None = None) -> None:
    """Every case (of `family`, or all) opened in turn, each reported as a JSON line (flushed, so a
    crash leaves the cases before it). With `leak_pass`, a second pass follows the first (which
    warms caches up) and the last line reports resident memory and open descriptors before and
    after it, and the mappings of the case file left at the end."""
    with open(base_path, "rb") as f:
        base = f.read()
    cases = [c for c in corpus(base) if family is None or c.family == family]
    path = os.path.join(workdir, "case.gguf")
    for case in cases:
        out.write(json.dumps(run_case(case, path)) + "\n")
        out.flush()
    if not leak_pass:
        return
    gc.collect()
    rss0, fds0 = _status_kib("VmRSS"), _open_fds()
    for case in cases:
        run_case(case, path)
    gc.collect()
    out.write(json.dumps({"leak": {"rss_kib_before": rss0, "rss_kib_after": _status_kib("VmRSS"),
                                   "fds_before": fds0, "fds_after": _open_fds(),
                                   "case_file_mappings": _mapped(path), "cases": len(cases)}}) + "\n")
    out.flush()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m deltaspec.testing.bad_gguf BASE.gguf WORKDIR")
    run_corpus(sys.argv[1], sys.argv[2])
