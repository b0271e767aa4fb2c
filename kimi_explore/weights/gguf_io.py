"""Reading (and writing) GGUF files in NumPy: header, metadata, tensor infos, memory-mapped data.

A GGUF file (version 2 or 3, little-endian) is

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:   key (string) | value type u32 | value             string = u64 length + UTF-8 bytes
    tensors:    name (string) | n_dims u32 | ne u64[n_dims] | ggml type u32 | offset u64
    padding to `general.alignment` (default 32), then the data section; each tensor's bytes start
    at data_start + offset (offsets are multiples of the alignment)

Value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array (item type
u32, count u64, items), 10 u64, 11 i64, 12 f64. A tensor's `ne` lists its axes FASTEST FIRST
(ggml's order): the NumPy shape of its C-ordered data is `reversed(ne)`. A quantised type stores
blocks along ne[0] (`ggml_quants.TYPES`: elements and bytes per block), so a row of ne[0] values
is ne[0] / block blocks.

Everything is checked at open (every length against the file size, every tensor's byte range
against the data section), so a truncated file fails there, naming the tensor that does not fit,
and never halfway through a load. As llama.cpp's reader does, a key or tensor name given twice is
refused, and each tensor's data must start where the previous one's ends (padded to the alignment):
a damaged offset would otherwise read another tensor's bytes as this one's. The file must end where
the last tensor's data ends (padded or not): a last tensor whose type or shape was damaged to a
smaller one would otherwise read part of its bytes as garbage values. The data is
`np.memmap`ped: `raw(name)` is a zero-copy view.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from .ggml_quants import TYPE_IDS, TYPES
from .mapped_file import MappedFile

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
BOOL = 7

__all__ = ["GgufFile", "GgufTensor", "write_gguf"]


@dataclass(frozen=True)
class GgufTensor:
    """One tensor info: name, ggml axes (fastest first), type, and its absolute byte range in the file."""

    name: str
    ne: tuple[int, ...]
    type: str  # ggml type name: "F32", "BF16", "Q8_0", "MXFP4", ...
    begin: int
    end: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The NumPy shape of the values in C order: reversed(ne)."""
        return tuple(reversed(self.ne))


class _Cursor:
    """Reads little-endian values from the mapped header, refusing to run past the end of the file."""

    def __init__(self, buf: np.ndarray, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> np.ndarray:
        if n < 0 or self.pos + n > self.buf.size:
            raise CheckpointError(f"{self.path}: truncated or corrupt GGUF header: {what} needs {n} bytes at offset "
                                  f"{self.pos}, the file has {self.buf.size}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, code: str, what: str):
        dt = np.dtype(code)
        return self.take(dt.itemsize, what).view(dt)[0].item()

    def string(self, what: str) -> str:
        n = self.scalar("<u8", what)
        raw = self.take(n, what).tobytes()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: corrupt GGUF header: {what} is not UTF-8") from None

    def value(self, vtype: int, what: str):
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY:
            itype, n = self.scalar("<u4", what), self.scalar("<u8", what)
            if itype in _SCALARS:
                dt = np.dtype(_SCALARS[itype])
                items = self.take(n * dt.itemsize, what).view(dt)
                return (itype, [bool(x) for x in items] if itype == BOOL else items.tolist())
            if itype in (STRING, ARRAY):
                return (itype, [self.value(itype, what) for _ in range(n)])
            raise CheckpointError(f"{self.path}: corrupt GGUF header: {what} is an array of unknown type {itype}")
        if vtype not in _SCALARS:
            raise CheckpointError(f"{self.path}: corrupt GGUF header: {what} has unknown value type {vtype}")
        v = self.scalar(_SCALARS[vtype], what)
        return bool(v) if vtype == BOOL else v


class GgufFile(MappedFile):
    """One memory-mapped GGUF file (held open until `close`: see `MappedFile`).

    metadata: {key: value} (an array is a list)     types: {key: value type} (an array: (9, item type))
    tensors:  {name: GgufTensor}, in file order    alignment, data_start: where the data section begins
    """

    def _read_header(self) -> None:
        size = os.fstat(self.file.fileno()).st_size
        if size < 24:
            raise CheckpointError(f"{self.path}: not a GGUF file (only {size} bytes; truncated?)")
        self._map = np.memmap(self.file, dtype=np.uint8, mode="r")
        c = _Cursor(self._map, self.path)
        magic = c.take(4, "magic").tobytes()
        if magic != MAGIC:
            raise CheckpointError(f"{self.path}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
        self.version = c.scalar("<u4", "version")
        if self.version not in (2, 3):
            raise CheckpointError(f"{self.path}: GGUF version {self.version} is not supported (expected 2 or 3)")
        n_tensors, n_kv = c.scalar("<u8", "tensor count"), c.scalar("<u8", "metadata count")
        self.metadata, self.types = {}, {}
        for j in range(n_kv):
            key = c.string(f"metadata key {j}")
            if key in self.metadata:  # (llama.cpp refuses such a file too) the later value would win silently
                raise CheckpointError(f"{self.path}: corrupt GGUF header: metadata key '{key}' appears twice")
            vtype = c.scalar("<u4", f"the type of '{key}'")
            value = c.value(vtype, f"metadata '{key}'")
            if vtype == ARRAY:
                self.types[key], value = (ARRAY, value[0]), value[1]
            else:
                self.types[key] = vtype
            self.metadata[key] = value
        infos, names = [], set()
        for j in range(n_tensors):
            name = c.string(f"tensor name {j}")
            if name in names:
                raise CheckpointError(f"{self.path}: corrupt GGUF header: tensor '{name}' appears twice (one name, "
                                      "two tensors: which one the model reads would be an accident)")
            n_dims = c.scalar("<u4", f"tensor '{name}' n_dims")
            if not 1 <= n_dims <= 4:
                raise CheckpointError(f"{self.path}: corrupt GGUF header: tensor '{name}' has {n_dims} dimensions")
            ne = tuple(c.scalar("<u8", f"tensor '{name}' shape") for _ in range(n_dims))
            type_id, offset = c.scalar("<u4", f"tensor '{name}' type"), c.scalar("<u8", f"tensor '{name}' offset")
            infos.append((name, ne, type_id, offset))
            names.add(name)
        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(self.alignment) is not int or self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise CheckpointError(f"{self.path}: general.alignment = {self.alignment!r} is not a power of two (an "
                                  "integer; a float was cut to one)")
        self.data_start = -(-c.pos // self.alignment) * self.alignment
        self.tensors: dict[str, GgufTensor] = {}
        expected, prev = 0, None  # each tensor's data follows the previous one's, padded to the alignment (llama.cpp's rule)
        for name, ne, type_id, offset in infos:
            t = self.tensors[name] = self._tensor(name, ne, type_id, offset, size)
            if offset != expected:
                after = "the data section's start" if prev is None else (
                    f"where the previous tensor '{prev.name}' ({prev.type}{list(prev.ne)}) ends")
                raise CheckpointError(f"{self.path}: corrupt GGUF header: tensor '{name}' starts at data offset {offset}, "
                                      f"expected {expected} ({after}, padded to general.alignment = {self.alignment}): "
                                      "its bytes would overlap another tensor's or leave a gap; the offset, or the "
                                      "type or shape of the tensor before, is wrong")
            expected += -(-(t.end - t.begin) // self.alignment) * self.alignment
            prev = t
        self._check_end(prev, self.data_start + expected, size)

    def _check_end(self, last: GgufTensor | None, padded_end: int, size: int) -> None:
        """The file ends where the last tensor's data ends, padded to the alignment (llama.cpp and gguf-py pad it;
        unpadded is accepted too). Only the end can tell a last tensor whose header type or shape is too small
        (F32 read as F16: half its bytes, garbage values) from a sound one; appended bytes are refused as well."""
        if size <= padded_end:  # (a tensor past the end is refused as truncated in `_tensor`)
            return
        what = "the header" if last is None else f"the last tensor '{last.name}' ({last.type}{list(last.ne)})"
        raise CheckpointError(f"{self.path}: {size - padded_end} byte(s) after the data: {what} ends at byte {padded_end} "
                              f"(padded to general.alignment = {self.alignment}), the file has {size}; a type or shape "
                              "in the header is wrong (that tensor's data is larger than it says), or bytes were appended")

    def _tensor(self, name: str, ne: tuple, type_id: int, offset: int, size: int) -> GgufTensor:
        if type_id not in TYPES:
            raise CheckpointError(f"{self.path}: tensor '{name}' has ggml type id {type_id}, which this reader does not know")
        tname, block, nbytes = TYPES[type_id]
        if ne[0] % block:
            raise CheckpointError(f"{self.path}: tensor '{name}' ({tname}) has ne[0] = {ne[0]}, not a multiple of its "
                                  f"block of {block}")
        if offset % self.alignment:
            raise CheckpointError(f"{self.path}: tensor '{name}' starts at data offset {offset}, not a multiple of "
                                  f"general.alignment = {self.alignment}")
        count = int(np.prod(ne, dtype=np.int64))
        begin = self.data_start + offset
        end = begin + count // block * nbytes
        if end > size:
            raise CheckpointError(f"{self.path}: truncated: tensor '{name}' ({tname}{list(ne)}) ends at byte {end}, "
                                  f"but the file has only {size} bytes")
        return GgufTensor(name, ne, tname, begin, end)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(ggml type name, NumPy shape) of tensor `name`."""
        t = self.tensors[name]
        return t.type, t.shape

    def byte_range(self, name: str) -> tuple[int, int]:
        """[begin, end) byte offsets of the tensor's data in the file."""
        t = self.tensors[name]
        return t.begin, t.end

    def raw(self, name: str) -> np.ndarray:
        """A read-only zero-copy uint8 view of the tensor's bytes (valid after `close`)."""
        t = self.tensors[name]
        return self._map[t.begin : t.end]


# ---------------------------------------------------------------- writing (tests, splitting)


def _pack_value(vtype, value) -> bytes:
    if isinstance(vtype, tuple):  # (ARRAY, item type)
        itype = vtype[1]
        return struct.pack("<IQ", itype, len(value)) + b"".join(_pack_value(itype, v) for v in value)
    if vtype == STRING:
        raw = value.encode("utf-8")
        return struct.pack("<Q", len(raw)) + raw
    return np.array(value, dtype=_SCALARS[vtype]).tobytes()


def write_gguf(path: str | Path, metadata: dict, types: dict, tensors: list[tuple[str, tuple, str, bytes]],
               alignment: int = DEFAULT_ALIGNMENT) -> None:
    """Write a GGUF v3 file: `metadata` {key: value} with `types` {key: value type (arrays: (9, item type))}
    as `GgufFile` reads them, and `tensors` [(name, ne (fastest first), ggml type name, raw bytes)] in order."""
    out = [MAGIC, struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    for key, value in metadata.items():
        vtype = types[key]
        out += [_pack_value(STRING, key), struct.pack("<I", vtype[0] if isinstance(vtype, tuple) else vtype),
                _pack_value(vtype, value)]
    offset = 0  # each tensor's data is padded to the alignment, so the offsets are the running sums
    for name, ne, tname, raw in tensors:
        out += [_pack_value(STRING, name), struct.pack("<I", len(ne)), struct.pack(f"<{len(ne)}Q", *ne),
                struct.pack("<IQ", TYPE_IDS[tname], offset)]
        offset += -(-len(raw) // alignment) * alignment
    head = b"".join(out)
    with open(path, "wb") as f:
        f.write(head + b"\0" * (-len(head) % alignment))
        for _, _, _, raw in tensors:
            f.write(raw + b"\0" * (-len(raw) % alignment))
