"""Routed-expert banks: dequantised up front (`DenseExperts`) or MXFP4-packed with an LRU cache.

The decoder asks a bank for the k experts the router picked, in the router's order:

    w13, w2 = experts.gather(ids)      w13: [k, 2I, l] (w1 = gate rows, then w3 = up rows)
                                       w2:  [k, l, I]  (down)

`PackedExperts` keeps the checkpoint's bytes as they are on disk (uint8, on the weights' device):

    w13_packed: [E, 2I, l/2]   w13_scale: [E, 2I, l/32]
    w2_packed:  [E, l, I/2]    w2_scale:  [E, l, I/32]

and dequantises only the selected experts that are not in its LRU cache: one gather of their
packed bytes and one dequantise call for all of them (no Python loop over experts). The cache
holds up to `capacity` dequantised experts of THIS layer (the size is per layer: a model with n
MoE layers holds at most n * capacity dequantised experts, `expert_bytes` each).

Exactness: MXFP4 value x power-of-two scale is the same IEEE product whichever way it is
computed, and the gathered [k, 2I, l] array is contiguous either way, so the decoder's batched
matmul sees the same operands as with `DenseExperts` and gives bit-identical logits (tested).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from . import mxfp4
from ._xp import array_namespace
from .backend import to_numpy
from .latent_moe import DenseExperts

__all__ = ["DenseExperts", "ExpertCacheStats", "PackedExperts", "dequantize_experts"]

# byte -> (value of the low nibble, value of the high nibble): the LOW nibble is the EVEN column
_PAIRS = np.stack([mxfp4.E2M1[np.arange(256) & 0x0F], mxfp4.E2M1[np.arange(256) >> 4]], axis=1)  # [256, 2]


def _pair_table(xp, dtype):
    """The byte -> two-values table on `xp`; for float32 as one uint64 per byte (one 8-byte gather per byte)."""
    table = _PAIRS.astype(dtype)
    if np.dtype(dtype) == np.float32:
        table = table.view(np.uint64).reshape(256)
    return xp.asarray(table)


def dequantize_experts(packed, scale, dtype=np.float32, table=None):
    """packed: uint8 [..., rows, cols/2]; scale: uint8 [..., rows, cols/32] -> dtype [..., rows, cols].

    The same values, bit for bit, as `mxfp4.dequantize` (tested), in two passes instead of six:
    one table gather that turns each byte into its two values, then one in-place multiply by the
    group's power of two. NumPy or CuPy, from the arrays' namespace.
    """
    xp = array_namespace(packed)
    table = _pair_table(xp, dtype) if table is None else table
    lead, half = packed.shape[:-1], packed.shape[-1]
    vals = table[packed]  # [..., cols/2] uint64 (float32 pairs) or [..., cols/2, 2]
    vals = vals.view(dtype).reshape(lead + (2 * half,)) if vals.dtype == np.uint64 else vals.reshape(lead + (2 * half,))
    exp = scale.astype(xp.int32) - 127
    factors = xp.ldexp(xp.ones(exp.shape, dtype=dtype), exp)  # exact powers of two, as mxfp4.dequantize makes them
    groups = vals.reshape(lead + (scale.shape[-1], mxfp4.GROUP))
    groups *= factors[..., None]
    return vals


@dataclass
class ExpertCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


@dataclass
class PackedExperts:
    """MXFP4 routed experts of one layer, dequantised on demand through an LRU cache.

    w13_packed: uint8 [E, 2I, l/2];  w13_scale: uint8 [E, 2I, l/32]
    w2_packed:  uint8 [E, l, I/2];   w2_scale:  uint8 [E, l, I/32]
    capacity:   dequantised experts kept (this layer); 0 disables the cache
    """

    w13_packed: object
    w13_scale: object
    w2_packed: object
    w2_scale: object
    dtype: object = np.float32
    capacity: int = 0
    stats: ExpertCacheStats = field(default_factory=ExpertCacheStats)
    _cache: OrderedDict = field(default_factory=OrderedDict, repr=False)  # expert id -> (w13 [2I, l], w2 [l, I])
    _table: object = field(default=None, repr=False)

    def __post_init__(self):
        if int(self.capacity) < 0:
            raise ValueError(f"capacity={self.capacity}: expected a number of experts >= 0")
        self.capacity = int(self.capacity)
        E, rows13, half13 = self.w13_packed.shape
        _, rows2, half2 = self.w2_packed.shape
        if self.w13_scale.shape != (E, rows13, 2 * half13 // mxfp4.GROUP) or self.w2_scale.shape != (E, rows2, 2 * half2 // mxfp4.GROUP):
            raise ValueError(
                f"PackedExperts: scales {self.w13_scale.shape} / {self.w2_scale.shape} do not match packed "
                f"{self.w13_packed.shape} / {self.w2_packed.shape} (one scale byte per 32 columns)"
            )
        self._table = _pair_table(array_namespace(self.w13_packed), self.dtype)

    @property
    def num_experts(self) -> int:
        return self.w13_packed.shape[0]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one dequantised expert (w1, w3 and w2)."""
        _, rows13, half13 = self.w13_packed.shape
        _, rows2, half2 = self.w2_packed.shape
        return (rows13 * 2 * half13 + rows2 * 2 * half2) * np.dtype(self.dtype).itemsize

    @property
    def packed_bytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale))

    @property
    def cached_bytes(self) -> int:
        return len(self._cache) * self.expert_bytes

    def cached_ids(self) -> list[int]:
        """Expert ids in the cache, least recently used first."""
        return list(self._cache)

    def set_capacity(self, capacity: int) -> None:
        """Resize the cache (evicting least recently used experts if it shrinks)."""
        if int(capacity) < 0:
            raise ValueError(f"capacity={capacity}: expected a number of experts >= 0")
        self.capacity = int(capacity)
        self._evict()

    def clear(self) -> None:
        """Empty the cache and reset the counters."""
        self._cache.clear()
        self.stats = ExpertCacheStats()

    def _evict(self) -> None:
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
            self.stats.evictions += 1

    def dequantize(self, ids):
        """Dequantise experts `ids` (no cache): ([m, 2I, l], [m, l, I]), one gather + one call per matrix."""
        xp = array_namespace(self.w13_packed)
        sel = xp.asarray(np.asarray(ids, dtype=np.int64))
        w13 = dequantize_experts(self.w13_packed[sel], self.w13_scale[sel], self.dtype, self._table)
        w2 = dequantize_experts(self.w2_packed[sel], self.w2_scale[sel], self.dtype, self._table)
        return w13, w2

    def gather(self, ids):
        """The selected experts' weights, in the order of `ids`: ([k, 2I, l], [k, l, I])."""
        xp = array_namespace(self.w13_packed)
        order = [int(e) for e in to_numpy(ids).reshape(-1)]  # k small ints: one device->host copy on a GPU
        E = self.num_experts
        bad = [e for e in order if not 0 <= e < E]
        if bad:
            raise IndexError(f"expert ids {bad} outside 0..{E - 1} (this layer has {E} routed experts)")
        cache = self._cache
        missing = [e for e in dict.fromkeys(order) if e not in cache]
        self.stats.hits += len(order) - sum(order.count(e) for e in missing)
        self.stats.misses += len(missing)
        for e in order:
            if e in cache:
                cache.move_to_end(e)
        if missing:
            new13, new2 = self.dequantize(missing)
            if missing == order:  # nothing cached is needed: hand the fresh arrays over as they are
                self._remember(missing, new13, new2)
                return new13, new2
            fresh = {e: (new13[j], new2[j]) for j, e in enumerate(missing)}
        else:
            fresh = {}
        parts = [fresh[e] if e in fresh else cache[e] for e in order]
        w13 = xp.stack([p[0] for p in parts])
        w2 = xp.stack([p[1] for p in parts])
        if missing:
            self._remember(missing, new13, new2)
        return w13, w2

    def _remember(self, ids: list[int], w13, w2) -> None:
        if self.capacity == 0:
            return
        # copies: a view would keep the whole [m, ...] block alive for as long as any one entry lives
        for j, e in enumerate(ids[-self.capacity :], start=max(0, len(ids) - self.capacity)):
            self._cache[e] = (w13[j].copy(), w2[j].copy())
            self._cache.move_to_end(e)
        self._evict()


def dense_from_packed(packed: PackedExperts, chunk: int = 8) -> DenseExperts:
    """Dequantise every expert up front with the reference `mxfp4.dequantize`, `chunk` experts at a time."""
    xp = array_namespace(packed.w13_packed)
    E = packed.num_experts
    w13 = xp.empty((E,) + packed.w13_packed.shape[1:-1] + (2 * packed.w13_packed.shape[-1],), packed.dtype)
    w2 = xp.empty((E,) + packed.w2_packed.shape[1:-1] + (2 * packed.w2_packed.shape[-1],), packed.dtype)
    for a in range(0, E, chunk):
        b = min(E, a + chunk)
        w13[a:b] = mxfp4.dequantize(packed.w13_packed[a:b], packed.w13_scale[a:b], dtype=packed.dtype)
        w2[a:b] = mxfp4.dequantize(packed.w2_packed[a:b], packed.w2_scale[a:b], dtype=packed.dtype)
    return DenseExperts(w13, w2)
