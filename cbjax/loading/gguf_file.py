"""A GGUF file's metadata and tensor table, parsed with `struct` over one memory map.

The `gguf` package's `GGUFReader` builds a numpy view per metadata item: SmolLM2's 98,000
vocabulary and merge strings take it seconds, on every start, before a weight is read. Here a
string is one `struct.unpack_from` and one slice (docs/experiments.md has both figures).
Tensors come out as `GGUFReader` gives them (same dtypes and shapes, views of the map), with
the `gguf` package's own quantization types, so its dequantizers apply unchanged.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format (8 = string, 9 = array: read by hand).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_ARRAY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_PLAIN_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (outermost first), as the data's logical shape
    data: np.ndarray  # a view of the file's map: elements, or a quantized tensor's bytes per row


class GGUFFile:
    """`fields`: every metadata key -> its value (int, float, bool, str, or a list of them);
    `tensors`: in the file's order."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file
                raise ValueError(f"{path}: not a GGUF file ({e})") from e
        try:
            self.fields, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, KeyError, OverflowError) as e:
            raise ValueError(f"{path}: not a readable GGUF file (metadata cut short or damaged: "
                             f"{type(e).__name__}: {e})") from e

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def _parse(self):
        import gguf

        known = {t.value for t in gguf.GGMLQuantizationType}
        buf = self._map
        if buf[:4] != _MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version, num_tensors, num_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3; a big-endian "
                             "file reads as a huge version)")
        pos = 24
        fields = {}
        for _ in range(num_fields):
            key, pos = _string(buf, pos)
            (kind,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            fields[key], pos = _value(buf, pos, kind)
        infos = []
        for _ in range(num_tensors):
            name, pos = _string(buf, pos)
            (num_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{num_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * num_dims)
            pos += 4 + 8 * num_dims + 12
            if kind not in known:
                raise ValueError(f"{self.path}: tensor {name!r} has unknown GGML type {kind}")
            infos.append((name, dims, gguf.GGMLQuantizationType(kind), offset))
        alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-pos // alignment) * alignment
        whole = np.frombuffer(buf, np.uint8)
        tensors, seen = [], set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"{self.path}: tensor {name!r} twice")
            seen.add(name)
            shape = tuple(reversed(dims))
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            count = int(np.prod(shape, dtype=np.int64))
            size = count * type_size // block
            if start + offset + size > len(buf):
                raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (cut short?)")
            raw = whole[start + offset:start + offset + size]
            plain = _PLAIN_DTYPES.get(kind.name)
            if plain is not None:
                data = raw.view(plain).reshape(shape)
            else:
                data = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, kind))
            tensors.append(GGUFTensor(name, kind, shape, data))
        return fields, tensors


def _string(buf, pos: int) -> tuple[str, int]:
    (size,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + size
    if end > len(buf):
        raise IndexError(f"a string of {size} bytes at offset {pos} runs past the end")
    return str(buf[pos + 8:end], "utf-8"), end


def _value(buf, pos: int, kind: int):
    if kind == 8:
        return _string(buf, pos)
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if kind != 9:
        raise KeyError(f"GGUF value type {kind}")
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item == 8:
        out = []
        for _ in range(count):
            s, pos = _string(buf, pos)
            out.append(s)
        return out, pos
    if item == 9:
        out = []
        for _ in range(count):  # each item an array value of its own: item type, count, items
            v, pos = _value(buf, pos, 9)
            out.append(v)
        return out, pos
    dtype = np.dtype(_ARRAY_DTYPES[item]).newbyteorder("<")
    end = pos + dtype.itemsize * count
    if end > len(buf):
        raise IndexError(f"an array of {count} items at offset {pos} runs past the end")
    return np.frombuffer(buf, dtype, count, pos).tolist(), end
