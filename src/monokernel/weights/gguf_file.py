"""A GGUF file's metadata and tensor table, parsed once with ``struct`` over a memory map.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array, which
for a 49k-token vocabulary and its merges takes seconds (4.7 s for the default model on a
2-core machine, more than the rest of its load). The loader needs the scalars, the tensor
table and the tensor bytes; reading the format directly gives all three in a tenth of a
second, and the same parse yields the digest that keys the tokenizer cache.

The format (v2 and v3, little-endian): magic, version, tensor count, key/value count, the
key/values, the tensor infos (name, dims, type, offset), padding to ``general.alignment``,
then the tensor data.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np

from monokernel.errors import WeightLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types: id -> (struct code, numpy dtype); STRING (8) and ARRAY (9) are special.
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, tuple[str, np.dtype]] = {
    0: ("B", np.dtype("<u1")),
    1: ("b", np.dtype("<i1")),
    2: ("H", np.dtype("<u2")),
    3: ("h", np.dtype("<i2")),
    4: ("I", np.dtype("<u4")),
    5: ("i", np.dtype("<i4")),
    6: ("f", np.dtype("<f4")),
    7: ("?", np.dtype("bool")),
    10: ("Q", np.dtype("<u8")),
    11: ("q", np.dtype("<i8")),
    12: ("d", np.dtype("<f8")),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    tensor_type: int  # a GGMLQuantizationType value
    dims: tuple[int, ...]  # GGUF (ggml) order: fastest-varying first
    offset: int  # absolute, in bytes from the start of the file

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (numpy/torch) shape: ``dims`` reversed."""
        return tuple(reversed(self.dims))


class StringArray(Sequence[str]):
    """A GGUF string array, decoded on first use (GGUFFile._strings)."""

    def __init__(self, buf: mmap.mmap, start: int, count: int) -> None:
        self._buf, self._start, self._count = buf, start, count
        self._items: list[str] | None = None

    def _decoded(self) -> list[str]:
        if self._items is None:
            items, pos, buf = [], self._start, self._buf
            for _ in range(self._count):
                n = _U64.unpack_from(buf, pos)[0]
                items.append(buf[pos + 8 : pos + 8 + n].decode("utf-8"))
                pos += 8 + n
            self._items = items
        return self._items

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        return self._decoded()[i]

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None  # type: ignore[assignment]


class GGUFFile:
    """Metadata (``metadata``: key -> python value; numeric arrays as numpy arrays, string
    arrays as StringArray sequences) and tensors (``tensors``, in file order) of one GGUF
    file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
            raise WeightLoadError(f"{self.path}: not a readable GGUF file ({e})") from e
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, ValueError) as e:
            raise WeightLoadError(f"{self.path}: not a readable GGUF file ({e})") from e

    # -- parsing -------------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._map
        if buf[:4] != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = _U32.unpack_from(buf, 4)[0]
        if version not in SUPPORTED_VERSIONS:
            # A byte-swapped (big-endian) file reads as a huge version number.
            raise ValueError(f"GGUF version {version} is not supported (v2, v3 little-endian)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            if key in self.metadata:
                raise ValueError(f"duplicate metadata key {key!r}")
            self.metadata[key] = self._value(self._u32())
        infos: list[tuple[str, int, tuple[int, ...], int]] = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._u32()
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
            self._pos += 8 * n_dims
            tensor_type = self._u32()
            offset = _U64.unpack_from(buf, self._pos)[0]
            self._pos += 8
            infos.append((name, tensor_type, tuple(int(d) for d in dims), offset))
        self.header_bytes = self._pos
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        data_start = -(-self._pos // alignment) * alignment
        names: set[str] = set()
        self.tensors: list[TensorInfo] = []
        for name, tensor_type, dims, offset in infos:
            if name in names:
                raise ValueError(f"duplicate tensor {name!r}")
            names.add(name)
            self.tensors.append(TensorInfo(name, tensor_type, dims, data_start + offset))

    def _strings(self, count: int) -> StringArray:
        """A string array, stepped over: decoded when first read (a tokenizer's 50-150k
        tokens and merges are most of a header, and only a tokenizer that is not cached
        yet reads them)."""
        start, buf = self._pos, self._map
        pos = start
        for _ in range(count):
            pos += 8 + _U64.unpack_from(buf, pos)[0]
        if pos > len(buf):
            raise ValueError("a string array runs past the end of the file")
        self._pos = pos
        return StringArray(buf, start, count)

    def _u32(self) -> int:
        value = _U32.unpack_from(self._map, self._pos)[0]
        self._pos += 4
        return value

    def _string(self) -> str:
        n = _U64.unpack_from(self._map, self._pos)[0]
        start = self._pos + 8
        self._pos = start + n
        if self._pos > len(self._map):
            raise ValueError("a string runs past the end of the file")
        return self._map[start : self._pos].decode("utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALARS:
            code, dtype = _SCALARS[vtype]
            value = struct.unpack_from("<" + code, self._map, self._pos)[0]
            self._pos += dtype.itemsize
            return value
        if vtype == _ARRAY:
            item_type = self._u32()
            count = _U64.unpack_from(self._map, self._pos)[0]
            self._pos += 8
            if item_type in _SCALARS:
                # One buffer view for the whole array: this is where GGUFReader spends its time.
                dtype = _SCALARS[item_type][1]
                arr = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).copy()
                self._pos += dtype.itemsize * count
                return arr
            if item_type == _STRING:
                return self._strings(count)
            return [self._value(item_type) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    # -- access --------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def header_digest(self) -> str:
        """sha256 of everything before the tensor data: metadata (tokenizer included) and
        the tensor table. What is derived from the header is keyed by this: a copy of the
        file anywhere hits the same entry, a file rewritten with other metadata does not."""
        return hashlib.sha256(self._map[: self.header_bytes]).hexdigest()

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's stored bytes as ``gguf.quants.dequantize`` takes them: float arrays
        in row-major shape for F32/F16, else uint8 rows of whole blocks (read-only views of
        the file)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        qtype = GGMLQuantizationType(info.tensor_type)
        n_elems = int(np.prod(info.dims)) if info.dims else 1
        shape = info.shape
        if qtype == GGMLQuantizationType.F32:
            dtype, count = np.dtype("<f4"), n_elems
        elif qtype == GGMLQuantizationType.F16:
            dtype, count = np.dtype("<f2"), n_elems
        else:
            block, type_size = GGML_QUANT_SIZES[qtype]
            dtype, count = np.dtype("u1"), n_elems * type_size // block
            shape = quant_shape_to_byte_shape(shape, qtype)
        if info.offset + count * dtype.itemsize > len(self._map):
            raise WeightLoadError(f"{self.path}: tensor {info.name} runs past the end of the file")
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=info.offset).reshape(shape)


def read_gguf(path: Path) -> GGUFFile:
    """The parsed file, shared by config, weights, eos ids and the tokenizer cache key:
    they are read one after another, and an unchanged file is parsed once."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    st = path.stat()
    return _cached(str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _cached(path: str, inode: int, size: int, mtime_ns: int) -> GGUFFile:
    del inode, size, mtime_ns  # cache key only
    return GGUFFile(Path(path))
