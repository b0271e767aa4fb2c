"""The host allocator's steady state for the sequence path (glibc's malloc; elsewhere nothing is done).

A chunk of the sequence path makes and frees a few hundred host arrays of 0.1-2 MiB ([T, d] rows, the
projections' outputs). glibc serves a request above its mmap threshold with a fresh mapping and unmaps it on
free, so such an array comes back as zero-filled pages: one page fault per 4 KiB touched. The threshold
starts at 128 KiB and only moves up when a mapped block is freed: to that block's size, and the heap's trim
threshold to twice it (mallopt(3), "M_MMAP_THRESHOLD": the dynamic threshold). How fast a process runs the
sequence path then depends on which arrays it happened to free first. Measured on the embedded model (1,024-token
feeds, chunk 512, new processes): with a Recorder 1,050-1,823 page faults per feed (3-6 ms of kernel time in a
~95 ms feed), without one 6,678 (17-23 ms); after `settle()`, ~260 and 0.

`settle()` frees one mapped block just under glibc's cap on the dynamic threshold (32 MiB on 64-bit;
`DEFAULT_MMAP_THRESHOLD_MAX`), once per process, at its first chunk (`kimi_sequence.run_layers_chunk`):
blocks up to that size then come from the heap and are reused, and up to twice that stays in the heap
after frees. It is what freeing any large temporary does to a process; no mallopt setting is changed, so
glibc's own adjustment goes on as before. Arrays above the threshold (a K3 chunk's [2048, 7168] rows:
56 MiB) are mapped as before; where the environment fixes the threshold (`MALLOC_MMAP_THRESHOLD_`, or
`GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...`, and their trim, top-pad and mmap-max siblings), it does not move.
"""

from __future__ import annotations

import platform

import numpy as np

__all__ = ["SETTLE_BYTES", "settle"]

SETTLE_BYTES = (32 << 20) - (64 << 10)  # glibc raises its threshold only to a freed block of at most 32 MiB (header included)

_settled = False


def settle() -> None:
    """Raise glibc's mmap threshold to ~32 MiB (see the module docstring); once per process, a no-op after."""
    global _settled
    if _settled:
        return
    _settled = True
    if platform.libc_ver()[0] == "glibc":
        try:
            np.empty(SETTLE_BYTES, np.uint8)  # mapped (never touched: no page is faulted in), then unmapped on free
        except MemoryError:  # (a process without 32 MiB of address space to spare: it runs as before)
            pass
