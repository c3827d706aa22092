"""A GGUF file's metadata and tensor table, read in one pass over a memory map.

gguf-py's GGUFReader makes a numpy view of every metadata element: ~2-4 s of CPU for a 49k-token
vocabulary and its merges, paid by the server (its tokenizer) and again by the engine core (config and
weights) of every pod that starts, on a node whose cores are busy serving. This reads the same format
with `struct` over a memory map (~0.1 s), gives metadata values as gguf-py's `contents()` does (str,
int, float, bool, lists of them), and each tensor's bytes as a plain ndarray of the shape gguf-py's
readers give `gguf.quants.dequantize` (a view of a np.memmap made its row loop twice as slow).
Little-endian files, which is what llama.cpp writes; a big-endian one gets a clear error.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALARS = {  # value type -> struct format, size, numpy dtype (for arrays)
    0: ("<B", 1, np.uint8), 1: ("<b", 1, np.int8), 2: ("<H", 2, np.uint16), 3: ("<h", 2, np.int16),
    4: ("<I", 4, np.uint32), 5: ("<i", 4, np.int32), 6: ("<f", 4, np.float32), 7: ("<?", 1, np.bool_),
    10: ("<Q", 8, np.uint64), 11: ("<q", 8, np.int64), 12: ("<d", 8, np.float64),
}
_PLAIN = {gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
          gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
          gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
          gguf.GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as the file lists it: fastest-varying dimension first
    data: np.ndarray  # typed elements (slowest dimension first), or a quantized type's bytes by row


class GGUFFile:
    """`metadata`: key -> value; `tensors`: in the file's order. The memory map stays open while a
    tensor's `data` is referenced."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        self._offset = 0
        if bytes(self._buf[:4]) != _MAGIC:
            raise ValueError("GGUF magic invalid")
        (version,) = self._unpack("<I", 4, 4)
        if version & 0xFFFF == 0:
            raise ValueError("big-endian GGUF files are not supported")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (only {', '.join(map(str, _VERSIONS))})")
        tensor_count, kv_count = self._unpack("<QQ", 8, 16)
        self._offset = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            (value_type,) = self._next("<I", 4)
            self.metadata[key] = self._value(value_type)
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment!r}: must be a power of two")
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(*info, data_start) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor names")

    # -- parsing ---------------------------------------------------------------------------------

    def _unpack(self, fmt: str, offset: int, size: int) -> tuple:
        if offset + size > len(self._buf):
            raise ValueError(f"truncated at byte {offset}")
        return struct.unpack_from(fmt, self._buf, offset)

    def _next(self, fmt: str, size: int) -> tuple:
        values = self._unpack(fmt, self._offset, size)
        self._offset += size
        return values

    def _string(self) -> str:
        (length,) = self._next("<Q", 8)
        end = self._offset + length
        if end > len(self._buf):
            raise ValueError(f"truncated at byte {self._offset}")
        text = str(self._buf[self._offset:end], "utf-8")
        self._offset = end
        return text

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            element_type, count = self._next("<IQ", 12)
            if element_type in _SCALARS:  # one frombuffer for the whole array
                _, size, dtype = _SCALARS[element_type]
                end = self._offset + size * count
                if end > len(self._buf):
                    raise ValueError(f"truncated at byte {self._offset}")
                values = np.frombuffer(self._buf, dtype=np.dtype(dtype).newbyteorder("<"), count=count,
                                       offset=self._offset).tolist()
                self._offset = end
                return values
            return [self._value(element_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise ValueError(f"unknown metadata value type {value_type}")
        fmt, size, _ = _SCALARS[value_type]
        return self._next(fmt, size)[0]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (n_dims,) = self._next("<I", 4)
        dims = self._next(f"<{n_dims}Q", 8 * n_dims)
        raw_type, offset = self._next("<IQ", 12)
        return name, dims, raw_type, offset

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, offset: int, data_start: int) -> GGUFTensor:
        tensor_type = gguf.GGMLQuantizationType(raw_type)
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        np_dims = tuple(reversed(dims))
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        start = data_start + offset
        if tensor_type in _PLAIN:
            dtype, count = np.dtype(_PLAIN[tensor_type]), n_elements
        else:  # a quantized type: its bytes, one row of blocks per row
            dtype, count = np.dtype(np.uint8), n_elements * type_size // block_size
            np_dims = gguf.quant_shape_to_byte_shape(np_dims, tensor_type)
        if start + count * dtype.itemsize > len(self._buf):
            raise ValueError(f"tensor {name} is truncated")
        data = np.frombuffer(self._buf, dtype=dtype.newbyteorder("<"), count=count, offset=start)
        return GGUFTensor(name, tensor_type, dims, data.reshape(np_dims))
