"""Reading a GGUF file (versions 2 and 3, little-endian) without the gguf package's reader: its
metadata, and each tensor as a read-only view of the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file, as the gguf package's reader presents it: `shape` in GGUF's
    order (fastest dimension first), `data` a read-only view of the file (float and integer
    types as such, reversed shape; block formats as uint8 rows of their bytes)."""

    name: str
    tensor_type: int  # the GGML type id
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file's metadata (scalars and strings; arrays as their length) and tensors."""

    metadata: Mapping[str, object]
    tensors: list[GgufTensor]


# GGUF metadata value types (the spec's gguf_metadata_value_type): id -> struct format.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip


_STRING = 8


_ARRAY = 9


# GGML types whose data the reader presents in their own numpy dtype.
_PLAIN_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
                27: np.int64, 28: np.float64}  # fmt: skip


def open_gguf(path: Path) -> GgufFile:
    """Read a GGUF file's header (versions 2 and 3, little-endian): the metadata, without
    materialising its arrays (a 150k-token vocabulary's strings are skipped by their lengths,
    where the gguf package's reader spends half a minute making a numpy view of each), and
    every tensor's type, shape and place, its data a view of a read-only memory map."""
    import struct

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    buf = raw.data  # a memoryview of the mapped bytes
    pos = 0

    def take(fmt: str) -> tuple:
        nonlocal pos
        values = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal pos
        (length,) = take("Q")
        text = bytes(buf[pos : pos + length]).decode("utf-8", errors="replace")
        pos += length
        return text

    def value(kind: int) -> object:
        nonlocal pos
        if kind in _SCALARS:
            return take(_SCALARS[kind])[0]
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item, count = take("IQ")
            if item in _SCALARS:
                pos += count * struct.calcsize("<" + _SCALARS[item])
            else:
                for _ in range(count):
                    value(item)
            return count
        raise ValueError(f"{path}: unknown GGUF metadata type {kind} at byte {pos}.")

    magic, version = take("4sI")
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {magic!r}).")
    if version not in (2, 3):
        if int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
            raise ValueError(f"{path} is a big-endian GGUF file: only little-endian is read.")
        raise ValueError(f"{path}: GGUF version {version} is not read (2 and 3 are).")
    num_tensors, num_fields = take("QQ")
    metadata: dict[str, object] = {}
    for _ in range(num_fields):
        key = string()
        (kind,) = take("I")
        metadata[key] = value(kind)
    infos = []
    for _ in range(num_tensors):
        name = string()
        (num_dims,) = take("I")
        dims = take("Q" * num_dims)
        kind, offset = take("IQ")
        infos.append((name, tuple(int(d) for d in dims), int(kind), int(offset)))
    alignment = int(metadata.get("general.alignment", 32))  # type: ignore[call-overload]
    start = -(-pos // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        num_elements = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        begin = start + offset
        reversed_dims = tuple(reversed(dims))
        if kind in _PLAIN_TYPES:
            dtype = np.dtype(_PLAIN_TYPES[kind]).newbyteorder("<")
            data = raw[begin : begin + num_elements * dtype.itemsize].view(dtype)
            data = data.reshape(reversed_dims)
        else:
            data = raw[begin : begin + num_elements // block * size]
            data = data.reshape(*reversed_dims[:-1], reversed_dims[-1] // block * size)
        tensors.append(GgufTensor(name, kind, dims, data))
    return GgufFile(metadata, tensors)
