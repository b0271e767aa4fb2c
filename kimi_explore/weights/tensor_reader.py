"""Reading checkpoint tensors straight into their final buffers, without a memory map of the data.

Mapping a shard and copying out of it leaves every touched page in the process's resident set
until the map closes, so loading a layer subset peaks at (what is kept) + (what was read). Here
each tensor is read with `readinto` into the buffer that keeps it (same dtype: uint8 MXFP4 bytes,
bf16 bits, float32), or through a bounded bounce buffer when it must be widened (bf16 -> float32
by putting the bits in the high half, exact; other casts through NumPy). Peak resident memory is
then what is kept plus one bounce buffer (`BOUNCE_BYTES`); the file bytes go through the page
cache only (measured in `bench/k3_shapes.py`).

The shard headers are parsed and checked by `safetensors_io.SafetensorsFile` (the loader's
`checkpoint.check_checkpoint`) or `gguf_io.GgufFile`; we take each tensor's byte range from it and read
through its open `file`, the file that header was read from.
"""

from __future__ import annotations

import numpy as np

from ..errors import CheckpointError
from .safetensors_io import DTYPES

BOUNCE_BYTES = 64 * 1024 * 1024


class TensorReader:
    """Reads tensors of one checkpoint by name; `open_shard(name) -> (file, full name)` resolves shards (the file: a
    `SafetensorsFile` or `GgufFile`)."""

    def __init__(self, open_shard):
        self._open_shard = open_shard

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype code, shape)."""
        f, full = self._open_shard(name)
        return f.info(full)

    def _read_bytes(self, name: str, out: np.ndarray, skip: int = 0) -> None:
        """Fill the C-contiguous `out` with the tensor's bytes starting `skip` bytes into it."""
        f, full = self._open_shard(name)
        begin, end = f.byte_range(full)
        begin += skip
        view = memoryview(out.reshape(-1).view(np.uint8))
        if begin + len(view) > end:
            raise CheckpointError(
                f"{f.path}: tensor '{full}': asked for {len(view)} bytes at offset {skip}, it has {end - begin + skip}"
            )
        fh = f.file  # the file its header was read from (the path may name another by now)
        fh.seek(begin)
        done = 0
        while done < len(view):
            n = fh.readinto(view[done:])
            if not n:
                raise CheckpointError(f"{f.path}: file ended while reading tensor '{full}' (truncated?)")
            done += n

    def read(self, name: str, dtype, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor as `dtype` (use np.uint16 for bf16 bits) into `out` (C-contiguous, same size) or a new array."""
        code, shape = self.info(name)
        disk = DTYPES[code]
        dtype = np.dtype(dtype)
        out = np.empty(shape, dtype) if out is None else out
        if out.size != int(np.prod(shape, dtype=np.int64)) or not out.flags.c_contiguous:
            raise ValueError(
                f"tensor '{name}' {code}{list(shape)}: output buffer {out.shape} is the wrong size or not contiguous"
            )
        if disk == dtype or (code == "BF16" and dtype == np.uint16):
            self._read_bytes(name, out)
            return out
        flat = out.reshape(-1)
        per = max(1, BOUNCE_BYTES // disk.itemsize)
        bounce = np.empty(min(per, flat.size), disk)
        for a in range(0, flat.size, per):
            chunk = bounce[: min(per, flat.size - a)]
            self._read_bytes(name, chunk, skip=a * disk.itemsize)
            if code == "BF16" and dtype == np.float32:  # exact widening: bf16 bits are the float32 high half
                pairs = flat[a : a + chunk.size].view(np.uint16).reshape(-1, 2)
                pairs[:, 0] = 0
                pairs[:, 1] = chunk.view(np.uint16)
            else:
                flat[a : a + chunk.size] = chunk
        return out
