"""Reading a GGUF file's metadata and tensor table, with clear errors for broken files.

Everything here runs before the native engine touches the file, so a bad file becomes a Python
exception naming what is wrong instead of a crash inside ggml.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from .errors import CorruptFileError, ModelFileNotFoundError, NotAGGUFError, TruncatedFileError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
SMALL_ARRAY = 64  # arrays up to this length are kept in `metadata`; longer ones (vocab) only on demand


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous dimension
    type: GGMLQuantizationType
    n_bytes: int
    offset: int  # absolute file offset of the data


@dataclass
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _reader: GGUFReader

    def array(self, key: str) -> list[Any] | None:
        """A metadata array of any length (e.g. the vocabulary), or None if absent."""
        field = self._reader.fields.get(key)
        if field is None:
            return None
        if not field.types or field.types[0] != GGUFValueType.ARRAY:
            raise CorruptFileError(f"{self.path}: metadata key '{key}' is not an array")
        return _field_value(field)


def _field_value(field) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def _check_header(path: str) -> int:
    if not os.path.exists(path):
        raise ModelFileNotFoundError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise ModelFileNotFoundError(f"{path}: not a regular file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 4 or head[:4] != GGUF_MAGIC:
        if len(head) < 4 and GGUF_MAGIC.startswith(head):
            raise TruncatedFileError(f"{path}: file is {size} bytes, too short for a GGUF header")
        raise NotAGGUFError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected {GGUF_MAGIC!r})")
    if len(head) < 24:
        raise TruncatedFileError(f"{path}: file is {size} bytes, too short for a GGUF header (24 bytes)")
    (version,) = struct.unpack_from("<I", head, 4)
    if version not in SUPPORTED_VERSIONS:
        raise NotAGGUFError(f"{path}: GGUF version {version} is not supported (expected one of {SUPPORTED_VERSIONS})")
    return version


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse header, metadata and tensor table; check that every tensor's data lies inside the file."""
    path = os.fspath(path)
    version = _check_header(path)
    size = os.path.getsize(path)
    try:
        reader = GGUFReader(path)
    except (IndexError, EOFError) as e:
        raise TruncatedFileError(f"{path}: file ends inside its metadata or tensor table ({e})") from None
    except (ValueError, OverflowError, KeyError, TypeError, struct.error, UnicodeDecodeError, MemoryError) as e:
        # numpy reports a read past the end of the mapping as a ValueError about the buffer size
        if "buffer is too small" in str(e) or "offset must be non-negative" in str(e):
            raise TruncatedFileError(f"{path}: file ends inside its metadata or tensor table ({e})") from None
        raise CorruptFileError(f"{path}: metadata or tensor table cannot be parsed ({e})") from None

    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > SMALL_ARRAY:
            continue
        try:
            metadata[key] = _field_value(field)
        except (UnicodeDecodeError, ValueError) as e:
            raise CorruptFileError(f"{path}: metadata key '{key}' cannot be decoded ({e})") from None

    tensors: dict[str, TensorInfo] = {}
    for t in reader.tensors:
        try:
            ttype = GGMLQuantizationType(int(t.tensor_type))
        except ValueError:
            raise CorruptFileError(f"{path}: tensor '{t.name}' has unknown ggml type id {int(t.tensor_type)}") from None
        shape = tuple(int(d) for d in t.shape)
        block, type_size = GGML_QUANT_SIZES[ttype]
        if any(d < 0 for d in shape) or shape[0] % block != 0:
            raise CorruptFileError(f"{path}: tensor '{t.name}' has shape {list(shape)}, invalid for type {ttype.name}")
        n_bytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
        offset = int(t.data_offset)
        if offset + n_bytes > size:
            raise TruncatedFileError(
                f"{path}: tensor '{t.name}' needs bytes {offset}..{offset + n_bytes} but the file has {size} bytes")
        tensors[t.name] = TensorInfo(t.name, shape, ttype, n_bytes, offset)
    return GGUFFile(path, version, metadata, tensors, reader)
