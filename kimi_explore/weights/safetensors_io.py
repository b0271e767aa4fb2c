"""Memory-mapped safetensors reading, with errors that name the file and the tensor.

A safetensors file is an 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`, then the tensor bytes.
We map the file and hand out zero-copy views, so loading widens each tensor straight into its
final buffer and never holds a second copy of the weights. The header is checked against the file
size up front: a truncated download fails at open, not halfway through a load.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import CheckpointError, DuplicateKeyError, unique_keys
from .mapped_file import MappedFile

DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile(MappedFile):
    """One memory-mapped `.safetensors` file (held open until `close`: see `MappedFile`)."""

    def _read_header(self) -> None:
        f = self.file
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"{self.path}: not a safetensors file (only {size} bytes; truncated?)")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, _MAX_HEADER):
            raise CheckpointError(
                f"{self.path}: corrupt or truncated safetensors header: header length field says {n} bytes, "
                f"file has {size - 8} after it"
            )
        raw = f.read(n)
        try:
            header = json.loads(raw, object_pairs_hook=unique_keys)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not valid JSON: {e})") from None
        except DuplicateKeyError as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header: '{e.args[0]}' appears twice") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (expected a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self._entries = {}
        data_start = 8 + n
        data_len = size - data_start
        for name, e in header.items():
            dtype, shape, (begin, end) = self._entry(name, e)
            if dtype not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor '{name}' has unsupported dtype {dtype}")
            expected = DTYPES[dtype].itemsize * int(np.prod(shape, dtype=np.int64))
            if end - begin != expected or begin < 0:
                raise CheckpointError(
                    f"{self.path}: tensor '{name}' header says {dtype}{list(shape)} ({expected} bytes) "
                    f"but its data_offsets span {end - begin} bytes"
                )
            if end > data_len:
                raise CheckpointError(
                    f"{self.path}: truncated: tensor '{name}' ends at byte {end} of the data section, "
                    f"but the file holds only {data_len} bytes of tensor data"
                )
            self._entries[name] = (dtype, shape, data_start + begin, data_start + end)
        at = data_start  # the tensors tile the data section, as the format requires: no overlap, no gap
        for name, (_, _, b, e) in sorted(self._entries.items(), key=lambda item: item[1][2:]):
            if b != at:
                raise CheckpointError(f"{self.path}: corrupt safetensors header: tensor '{name}' starts at byte {b - data_start} "
                                      f"of the data section, expected {at - data_start} (where the tensor before it "
                                      "ends): its bytes would overlap another tensor's, or leave a gap")
            at = e
        if at != size:
            raise CheckpointError(f"{self.path}: the tensors end at byte {at - data_start} of the data section, but it "
                                  f"holds {data_len} bytes (a damaged header, or bytes appended to the file)")
        self._map = np.memmap(f, dtype=np.uint8, mode="r") if size > data_start else np.zeros(0, np.uint8)

    def _entry(self, name: str, e) -> tuple:
        """A header entry's (dtype, shape, (begin, end)), refusing anything but a dtype string, a list of
        non-negative integer dims and two integer offsets (int() would read 64.7 as 64, "64" as dims 6, 4)."""
        def whole(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        ok = isinstance(e, dict) and {"dtype", "shape", "data_offsets"} <= e.keys()
        ok = ok and isinstance(e["dtype"], str) and isinstance(e["shape"], list) and all(map(whole, e["shape"]))
        ok = ok and isinstance(e["data_offsets"], list) and len(e["data_offsets"]) == 2 and all(map(whole, e["data_offsets"]))
        if not ok:
            raise CheckpointError(f"{self.path}: corrupt header entry for tensor '{name}': {e!r} (expected "
                                  "{'dtype': str, 'shape': [non-negative ints], 'data_offsets': [begin, end] ints})")
        return e["dtype"], tuple(e["shape"]), tuple(e["data_offsets"])

    def keys(self):
        return self._entries.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        dtype, shape, _, _ = self._entries[name]
        return dtype, shape

    def byte_range(self, name: str) -> tuple[int, int]:
        """[begin, end) byte offsets of the tensor's data in the file."""
        _, _, b, e = self._entries[name]
        return b, e

    def nbytes(self, name: str) -> int:
        _, _, b, e = self._entries[name]
        return e - b

    def array(self, name: str) -> np.ndarray:
        """A read-only zero-copy view of the tensor (bf16 as ml_dtypes.bfloat16)."""
        dtype, shape, b, e = self._entries[name]
        return self._map[b:e].view(DTYPES[dtype]).reshape(shape)


def write_safetensors(path: str | Path, tensors: dict, metadata: dict | None = None) -> None:
    """Write {name: array} (bf16 as ml_dtypes.bfloat16) as a safetensors file, tensors in name order.

    Writes `path` in place: over a shard a model maps (experts="mapped"), write to a new name and
    `os.replace` it into place (as `tiny_model.save_checkpoint` does), or the live model reads the new bytes."""
    codes = {v: k for k, v in DTYPES.items()}
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in codes:
            raise TypeError(f"tensor '{name}': dtype {a.dtype} cannot be stored in safetensors here")
        raw = a.tobytes()
        header[name] = {"dtype": codes[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = metadata or {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data section 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)
