"""A GGUF file's header (metadata and tensor infos) read in one pass, without the tensor data.

`gguf.GGUFReader` builds a numpy view for every element of every array it parses, which takes
seconds for a 49k-token vocabulary (tokens, scores, merges); the model spec needs only scalars
and tensor shapes. `read_gguf_header` walks the same header with `struct`, skips string arrays
(kept as offsets, decoded only when asked for) and reads numeric arrays with one
`numpy.frombuffer` each.

It is the one GGUF reader of model loading: the spec, the dequantized cache and the layers'
block forms all read through it (a `GGUFReader` costs ~3 s of each model load for SmolLM2).

Invariants: `fields[key].contents()` and `tensors[i].name / .shape / .tensor_type / .data`
equal what `gguf.GGUFReader` gives for the same file (shape: the dims in file order, as there;
data: a read-only view of the mapped file, typed for float and integer tensors, the raw bytes
of each row `[..., bytes per row]` for quantized ones). A file that is not GGUF or is cut short
raises ValueError.
"""

from __future__ import annotations

import mmap
import pathlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
"""GGUF value type -> `struct` format, for every scalar type but strings."""
ELEMENT_TYPES: dict[GGMLQuantizationType, np.dtype] = {
    kind: np.dtype(dtype)
    for kind, dtype in (
        (GGMLQuantizationType.F32, np.float32),
        (GGMLQuantizationType.F16, np.float16),
        (GGMLQuantizationType.F64, np.float64),
        (GGMLQuantizationType.I8, np.int8),
        (GGMLQuantizationType.I16, np.int16),
        (GGMLQuantizationType.I32, np.int32),
        (GGMLQuantizationType.I64, np.int64),
    )
}
"""Tensor types stored one element per value, as numpy reads them; any other type is blocks."""


class GgufMetadata(Protocol):
    """What the model-spec readers use of a GGUF file: `gguf.GGUFReader` and `GgufHeader`
    both have it (`fields[key].contents()`; each tensor's `name`, `shape`, `tensor_type`)."""

    @property
    def fields(self) -> Mapping[str, Any]: ...

    @property
    def tensors(self) -> Sequence[Any]: ...


@dataclass
class HeaderField:
    """One metadata value; string arrays stay undecoded until `contents()`."""

    buffer: Any
    value: Any = None
    string_offsets: list[tuple[int, int]] | None = None

    def contents(self) -> Any:
        if self.string_offsets is not None:
            return [
                bytes(self.buffer[at : at + n]).decode("utf-8") for at, n in self.string_offsets
            ]
        return self.value


@dataclass
class HeaderTensor:
    """A tensor's info: name, dims (file order), type, and where its bytes are."""

    buffer: Any
    name: str
    shape: np.ndarray
    tensor_type: GGMLQuantizationType
    offset: int

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes as `gguf.GGUFReader` shapes them (see the module doc)."""
        dims = tuple(reversed(self.shape.tolist()))
        dtype = ELEMENT_TYPES.get(self.tensor_type)
        if dtype is None:
            dtype, dims = np.dtype(np.uint8), quant_shape_to_byte_shape(dims, self.tensor_type)
        values = np.frombuffer(
            self.buffer, dtype=dtype, count=int(np.prod(dims)), offset=self.offset
        )
        return values.reshape(dims)


@dataclass
class GgufHeader:
    """What `read_gguf_header` read (see the module doc)."""

    fields: dict[str, HeaderField] = field(default_factory=dict)
    tensors: list[HeaderTensor] = field(default_factory=list)


class _Cursor:
    def __init__(self, buffer: Any) -> None:
        self.buffer, self.at = buffer, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string_span(self) -> tuple[int, int]:
        length = self.unpack("<Q")
        start = self.at
        self.at += length
        if self.at > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        return start, length

    def string(self) -> str:
        start, length = self.string_span()
        return bytes(self.buffer[start : start + length]).decode("utf-8")

    def value(self, kind: int) -> HeaderField:
        if kind == STRING:
            return HeaderField(self.buffer, self.string())
        if kind in SCALARS:
            return HeaderField(self.buffer, self.unpack(SCALARS[kind]))
        if kind != ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item_kind, count = self.unpack("<I"), self.unpack("<Q")
        if item_kind == STRING:
            return HeaderField(
                self.buffer, string_offsets=[self.string_span() for _ in range(count)]
            )
        if item_kind not in SCALARS:  # nested arrays: walked item by item
            return HeaderField(
                self.buffer, [self.value(item_kind).contents() for _ in range(count)]
            )
        dtype = np.dtype(SCALARS[item_kind].replace("?", "b1"))
        values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.at)
        self.at += dtype.itemsize * count
        return HeaderField(self.buffer, values.tolist())


def read_gguf_header(path: pathlib.Path) -> GgufHeader:
    """The header of the GGUF file at `path` (see the module doc); the file stays mapped while
    the header or any of its tensors' `data` is referenced."""
    with path.open("rb") as file:
        buffer = memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))
    cursor = _Cursor(buffer)
    header = GgufHeader()
    try:
        if bytes(buffer[:4]) != GGUF_MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        cursor.at = 4
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        num_tensors, num_fields = cursor.unpack("<Q"), cursor.unpack("<Q")
        counts = {"version": version, "tensor_count": num_tensors, "kv_count": num_fields}
        for key, value in counts.items():  # the pseudo-fields `GGUFReader` adds
            header.fields[f"GGUF.{key}"] = HeaderField(buffer, value)
        for _ in range(num_fields):
            key = cursor.string()
            header.fields[key] = cursor.value(cursor.unpack("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = np.array([cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))], np.uint64)
            infos.append(
                (name, dims, GGMLQuantizationType(cursor.unpack("<I")), cursor.unpack("<Q"))
            )
        alignment_field = header.fields.get("general.alignment")
        alignment = int(alignment_field.contents()) if alignment_field else DEFAULT_ALIGNMENT
        data_start = -(-cursor.at // alignment) * alignment
        for name, dims, kind, offset in infos:
            block, size = GGML_QUANT_SIZES[kind]
            end = data_start + offset + int(np.prod(dims)) * size // block
            if end > len(buffer):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            header.tensors.append(HeaderTensor(buffer, name, dims, kind, data_start + offset))
    except (struct.error, UnicodeDecodeError, KeyError) as error:
        raise ValueError(f"the GGUF header is cut short or corrupt: {error}") from error
    return header
