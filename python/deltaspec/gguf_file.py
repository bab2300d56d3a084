"""Reading a GGUF file's metadata and tensor table, with clear errors for broken files.

Everything here runs before the native engine touches the file, so a bad file becomes a Python
exception naming what is wrong instead of a crash inside ggml. The parser is our own rather than
gguf-py's GGUFReader because that one builds a numpy view per array element and takes over ten
seconds on Qwen3.5's 248k-token vocabulary; this one takes well under a second.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from .errors import CorruptFileError, ModelFileNotFoundError, NotAGGUFError, TruncatedFileError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_COUNT = 1 << 26  # more keys, tensors or array elements than this means a corrupt count
MAX_NAME = 64  # ggml's GGML_MAX_NAME: a tensor name must be shorter

# GGUF value type id -> (struct format, numpy dtype); 8 = string, 9 = array
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous dimension
    type: GGMLQuantizationType
    n_bytes: int
    offset: int       # absolute file offset of the data
    info_offset: int  # file offset of this tensor's entry in the tensor table (for tools and tests)


@dataclass
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, Any]        # every key; arrays as Python lists
    tensors: dict[str, TensorInfo]
    data_offset: int
    value_offsets: dict[str, int] = field(default_factory=dict)  # key -> file offset of its value
    # key -> GGUF value type id (0..12, e.g. 4 = uint32, 8 = string); arrays as (9, element type id)
    # (arrays of arrays are refused, as ggml's loader does). The metadata values alone
    # cannot tell uint32 from int32 or float32 from float64; comparing files key by key needs this.
    value_types: dict[str, int | tuple[int, int]] = field(default_factory=dict)

    def array(self, key: str) -> list[Any] | None:
        value = self.metadata.get(key)
        return value if isinstance(value, list) else None


class _Cursor:
    """Sequential little-endian reads that raise TruncatedFileError at the end of the file."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise TruncatedFileError(f"{self.path}: file ends inside its {what} (needs byte {self.pos + n}, "
                                     f"the file has {self.size})")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def count(self, what: str) -> int:
        n = self.scalar("<Q", what)
        if n > MAX_COUNT:
            raise CorruptFileError(f"{self.path}: {what} claims {n} entries, which is not plausible")
        return n

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptFileError(f"{self.path}: {what} is not valid UTF-8") from None

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            v = self.scalar(_SCALARS[vtype][0], what)
            return float(v) if vtype in (6, 12) else v
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.scalar("<I", what)
            if etype == _ARRAY:  # the format could nest arrays; ggml's loader refuses them
                raise CorruptFileError(f"{self.path}: {what} is an array of arrays, which ggml's loader refuses")
            if etype not in _SCALARS and etype != _STRING:
                raise CorruptFileError(f"{self.path}: {what} has unknown array element type {etype}")
            n = self.count(what)
            # each element takes at least this many bytes (a string its u64 length): a count the
            # rest of the file cannot hold fails before a list is built
            least = n * (struct.calcsize(_SCALARS[etype][0]) if etype in _SCALARS else 8)
            if least > self.size - self.pos:
                raise TruncatedFileError(f"{self.path}: file ends inside its {what} ({n} entries need at least "
                                         f"{least} bytes, {self.size - self.pos} remain)")
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
                self.need(n * dtype.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
                self.pos += n * dtype.itemsize
                return arr.tolist()
            return [self.string(what) for _ in range(n)]
        raise CorruptFileError(f"{self.path}: {what} has unknown value type {vtype}")


def _check_file(path: str) -> None:
    if not os.path.exists(path):
        raise ModelFileNotFoundError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise ModelFileNotFoundError(f"{path}: not a regular file")


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse header, metadata and tensor table; check that every tensor's data lies inside the file."""
    path = os.fspath(path)
    _check_file(path)
    size = os.path.getsize(path)
    if size < 4:
        raise TruncatedFileError(f"{path}: file is {size} bytes, too short for a GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _parse(buf, path, size)


def _parse(buf, path: str, size: int) -> GGUFFile:
    if buf[:4] != GGUF_MAGIC:
        raise NotAGGUFError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})")
    if size < 24:
        raise TruncatedFileError(f"{path}: file is {size} bytes, too short for a GGUF header (24 bytes)")
    c = _Cursor(buf, path)
    c.pos = 4
    version = c.scalar("<I", "header")
    if version not in SUPPORTED_VERSIONS:
        raise NotAGGUFError(f"{path}: GGUF version {version} is not supported (expected one of {SUPPORTED_VERSIONS})")
    n_tensors = c.count("header (tensor count)")
    n_kv = c.count("header (metadata count)")

    metadata: dict[str, Any] = {}
    value_offsets: dict[str, int] = {}
    value_types: dict[str, int | tuple[int, int]] = {}
    for i in range(n_kv):
        key = c.string(f"metadata (key #{i})")
        # ggml's loader refuses these files too; refusing them here names the key instead of failing later
        if not key:
            raise CorruptFileError(f"{path}: metadata key #{i} is empty")
        if key in metadata:
            raise CorruptFileError(f"{path}: metadata key #{i} '{key}' appears twice")
        vtype = c.scalar("<I", f"metadata (type of key #{i} '{key}')")
        value_offsets[key] = c.pos
        metadata[key] = c.value(vtype, f"metadata (value of key #{i} '{key}')")
        # an array's value starts with its u32 element type, already bounds-checked by c.value
        value_types[key] = (vtype, struct.unpack_from("<I", buf, value_offsets[key])[0]) if vtype == _ARRAY else vtype

    infos = []
    for i in range(n_tensors):
        info_offset = c.pos
        name = c.string(f"tensor table (name of tensor #{i})")
        if not name:
            raise CorruptFileError(f"{path}: tensor #{i} has an empty name")
        if len(name.encode()) >= MAX_NAME:
            raise CorruptFileError(f"{path}: tensor #{i} name '{name[:80]}' is {len(name.encode())} bytes long "
                                   f"(ggml's limit is {MAX_NAME - 1})")
        n_dims = c.scalar("<I", f"tensor table (tensor #{i} '{name}')")
        if not 1 <= n_dims <= 4:
            raise CorruptFileError(f"{path}: tensor #{i} '{name}' has {n_dims} dimensions (expected 1 to 4)")
        shape = tuple(c.scalar("<Q", f"tensor table (tensor #{i} '{name}')") for _ in range(n_dims))
        type_id = c.scalar("<I", f"tensor table (tensor #{i} '{name}')")
        offset = c.scalar("<Q", f"tensor table (tensor #{i} '{name}')")
        infos.append((name, shape, type_id, offset, info_offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and value_types["general.alignment"] != 4:
        # ggml reads the key only as uint32 and refuses the file otherwise
        raise CorruptFileError(f"{path}: general.alignment must be a uint32, got GGUF type "
                               f"{value_types['general.alignment']} ({alignment!r})")
    if alignment <= 0 or alignment & (alignment - 1):
        raise CorruptFileError(f"{path}: general.alignment {alignment!r} is not a power of two")
    data_offset = (c.pos + alignment - 1) // alignment * alignment

    tensors: dict[str, TensorInfo] = {}
    expected_offset, previous = 0, None
    for name, shape, type_id, rel_offset, info_offset in infos:
        try:
            ttype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[ttype]
        except (ValueError, KeyError):
            raise CorruptFileError(f"{path}: tensor '{name}' has unknown ggml type id {type_id}") from None
        if any(d == 0 or d > MAX_COUNT * 64 for d in shape) or shape[0] % block != 0:
            raise CorruptFileError(f"{path}: tensor '{name}' has shape {list(shape)}, invalid for type {ttype.name}")
        if name in tensors:
            raise CorruptFileError(f"{path}: tensor '{name}' appears twice")
        n_bytes = int(np.prod(shape, dtype=np.float64)) // block * type_size
        _check_placement(path, name, rel_offset, expected_offset, previous, alignment)
        offset = data_offset + rel_offset
        if offset + n_bytes > size:
            raise TruncatedFileError(
                f"{path}: tensor '{name}' needs bytes {offset}..{offset + n_bytes} but the file has {size} bytes")
        tensors[name] = TensorInfo(name, shape, ttype, n_bytes, offset, info_offset)
        expected_offset = rel_offset + (n_bytes + alignment - 1) // alignment * alignment
        previous = tensors[name]
    return GGUFFile(path, version, metadata, tensors, data_offset, value_offsets, value_types)


def _check_placement(path: str, name: str, rel_offset: int, expected: int, previous: TensorInfo | None,
                     alignment: int) -> None:
    """ggml's loader takes tensor data only packed in table order, each tensor padded to the
    alignment: any other offset (unaligned, overlapping, a gap, two tensors swapped) is refused
    there, so it is refused here with the tensors named. A wrong offset is often the symptom of a
    wrong shape or type of the tensor before it, so that one is named too."""
    if rel_offset == expected:
        return
    before = (f"'{previous.name}' before it (shape {list(previous.shape)}, {previous.type.name}) ends at {expected}"
              if previous is not None else "it is the first tensor, which starts at 0")
    raise CorruptFileError(f"{path}: tensor '{name}' has data offset {rel_offset}, expected {expected}: {before} "
                           f"(tensors are stored in table order, each padded to alignment {alignment})")
