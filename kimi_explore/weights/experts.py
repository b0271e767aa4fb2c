"""Routed-expert banks: dequantised up front (`DenseExperts`) or MXFP4-packed with an LRU cache.

The decoder asks a bank for the k experts the router picked, in the router's order:

    w13, w2 = experts.gather(ids)      w13: [k, 2I, l] (w1 = gate rows, then w3 = up rows)
                                       w2:  [k, l, I]  (down)

`PackedExperts` keeps the checkpoint's bytes as they are on disk (uint8, on the weights' device):

    w13_packed: [E, 2I, l/2]   w13_scale: [E, 2I, l/32]
    w2_packed:  [E, l, I/2]    w2_scale:  [E, l, I/32]

and dequantises only the selected experts that are not in its LRU cache: one gather of their
packed bytes and one dequantise call for all of them (no Python loop over experts). The cache
holds up to `capacity` dequantised experts of THIS layer (the size is per layer, capped at the layer's
expert count E: a model with n MoE layers holds at most n * min(capacity, E) dequantised experts,
`expert_bytes` each, in one slab).
The decoder calls `outputs(ids, z, act)` (see `latent_moe.expert_outputs`), which takes one of
three routes:

- fused (host, float32, no cache, the compiled kernel built): `mxfp4_matvec.expert_matvec`
  multiplies straight from the packed bytes; nothing is dequantised into memory. Each weight is
  its exact dequantised value; only the float32 summation order differs from BLAS (~1e-7, tested).
- host, big experts: each selected expert is dequantised (or found in the cache) and multiplied
  where it lies instead of being copied into a [k, 2I, l] stack (2 GB per token at K3 size).
- GPU, and small experts where the calls dominate: one gather and batched matmuls.

The sequence path calls `outputs_grouped(ids [T, k], z [T, l], act)` -> [T, k, l]: the selections of
a chunk grouped by expert (`latent_moe.group_selections`), each distinct expert read once: fused, two
`mxfp4_matvec.grouped_matmat` calls (each weight decoded once per tile of 4-5 input rows); otherwise
each expert found in the cache or dequantised (`GROUPED_BYTES` of them at a time, then stored in the
cache), multiplied with all its rows. Stats count each distinct expert of the chunk once.

Exactness of the two dequantising routes: MXFP4 value x power-of-two scale is the same IEEE
product whichever way it is computed, and every matmul sees the same operands with the same
strides as `DenseExperts`' batched one (a [1, 2I, l] view goes through the same per-item BLAS
call as row j of a stack), so the logits are bit-identical to dense experts (tested, both ways,
on the embedded and the reference model).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import InitVar, dataclass, field

import numpy as np

from .._xp import array_namespace
from ..backend import on_host, to_numpy
from ..model import sequence_ops
from ..model.latent_moe import DenseExperts, group_selections
from . import mxfp4, mxfp4_matvec
from .workspace import Workspace

__all__ = ["DenseExperts", "ExpertCacheStats", "PackedExperts"]

@dataclass
class ExpertCacheStats:
    """Per call, each distinct selected expert is a hit (found in the cache) or a miss (dequantised)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0


@dataclass
class PackedExperts:
    """MXFP4 routed experts of one layer, dequantised on demand through an LRU cache.

    w13_packed: uint8 [E, 2I, l/2];  w13_scale: uint8 [E, 2I, l/32]
    w2_packed:  uint8 [E, l, I/2];   w2_scale:  uint8 [E, l, I/32]
    capacity:   dequantised experts kept (this layer); 0 disables the cache; capped at the layer's
                expert count (a larger one would allocate slots no expert can fill)
    fused:      multiply straight from the packed bytes (`mxfp4_matvec`); None (default) = whenever
                it can: host arrays, float32, capacity 0 and the kernel built. False keeps the
                dequantising route (bit-identical to dense experts); True requires the kernel.

    The cache is a slab of `capacity` slots ([capacity, 2I, l] and [capacity, l, I], allocated at
    the first miss), so hits are read in place. The fused route keeps no cache and counts no stats.
    """

    w13_packed: object
    w13_scale: object
    w2_packed: object
    w2_scale: object
    dtype: object = np.float32
    capacity: int = 0
    fused: bool | None = None
    stats: ExpertCacheStats = field(default_factory=ExpertCacheStats)
    workspace: InitVar[Workspace | None] = None  # the model's (`weights.workspace`); None: one of its own

    def __post_init__(self, workspace):
        # cache state is not a dataclass field: code that walks the weights' fields (fingerprints,
        # memory counts) must see the same arrays whatever the cache holds
        self._slots: OrderedDict = OrderedDict()  # expert id -> slot, least recently used first
        self._slab13 = self._slab2 = None  # [capacity, 2I, l], [capacity, l, I] once the first miss is stored
        xp = self.xp
        self._workspace = Workspace(xp) if workspace is None else workspace
        self.dtype = np.dtype(self.dtype)
        self._check_shapes()
        self.capacity = min(_check_capacity(self.capacity), self.num_experts)  # more slots than experts stay empty
        self._table = mxfp4.pair_table(xp, self.dtype)
        if self.fused and not self.can_fuse():
            raise ValueError(
                "PackedExperts(fused=True) needs host (NumPy) C-contiguous arrays, float32, capacity=0 and the compiled "
                f"kernel (built: {mxfp4_matvec.AVAILABLE}); got {type(self.w13_packed).__module__} arrays, "
                f"{self.dtype.name}, capacity={self.capacity}"
            )

    def _check_shapes(self) -> None:
        """The banks agree with each other (a subclass with another byte layout checks its own)."""
        E, rows13, half13 = self.w13_packed.shape
        _, rows2, half2 = self.w2_packed.shape
        want13, want2 = (E, rows13, 2 * half13 // mxfp4.GROUP), (E, rows2, 2 * half2 // mxfp4.GROUP)
        if self.w13_scale.shape != want13 or self.w2_scale.shape != want2:
            raise ValueError(
                f"PackedExperts: scales {self.w13_scale.shape} / {self.w2_scale.shape} do not match packed "
                f"{self.w13_packed.shape} / {self.w2_packed.shape} (one scale byte per 32 columns)"
            )

    # ---- shapes and sizes
    @property
    def xp(self):
        """The array namespace of the bank (numpy or cupy): where dequantised experts live."""
        return array_namespace(self.w13_packed)

    @property
    def num_experts(self) -> int:
        return self.w13_packed.shape[0]

    @property
    def shape13(self) -> tuple[int, int]:
        return self.w13_packed.shape[1], 2 * self.w13_packed.shape[2]

    @property
    def shape2(self) -> tuple[int, int]:
        return self.w2_packed.shape[1], 2 * self.w2_packed.shape[2]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one dequantised expert (w1, w3 and w2)."""
        (a, b), (c, d) = self.shape13, self.shape2
        return (a * b + c * d) * np.dtype(self.dtype).itemsize

    @property
    def packed_bytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale))

    @property
    def cached_bytes(self) -> int:
        """Bytes of the cache slab (allocated at the first miss, `capacity` experts)."""
        return 0 if self._slab13 is None else int(self._slab13.nbytes + self._slab2.nbytes)

    # ---- the cache
    def cached_ids(self) -> list[int]:
        """Expert ids in the cache, least recently used first."""
        return list(self._slots)

    def set_capacity(self, capacity: int) -> None:
        """Resize the cache, keeping the most recently used experts that still fit (at most the layer's
        `num_experts` slots: a larger capacity keeps every expert)."""
        capacity = min(_check_capacity(capacity), self.num_experts)
        keep = list(self._slots.items())[max(0, len(self._slots) - capacity) :] if capacity else []
        self.stats.evictions += len(self._slots) - len(keep)
        old13, old2 = self._slab13, self._slab2
        self._slab13 = self._slab2 = None
        self._slots = OrderedDict()
        self.capacity = capacity
        if keep:
            ids = [e for e, _ in keep]
            self._store(ids, old13[[s for _, s in keep]], old2[[s for _, s in keep]])

    def warm(self, ids, chunk: int = 16) -> None:
        """Dequantise experts `ids` into the cache now (`chunk` at a time), e.g. before timing or a sweep."""
        ids = [int(e) for e in to_numpy(ids).reshape(-1)][-self.capacity :] if self.capacity else []
        for e in ids:  # those cached already become the most recent: storing the others must not evict them
            if e in self._slots:
                self._slots.move_to_end(e)
        for a in range(0, len(ids), chunk):
            part = [e for e in ids[a : a + chunk] if e not in self._slots]
            if part:
                self._store(part, *self.dequantize(part, workspace=True))

    def clear(self) -> None:
        """Empty the cache (keeping its memory) and reset the counters."""
        self._slots.clear()
        self.stats = ExpertCacheStats()

    def _store(self, ids: list[int], w13, w2) -> None:
        """Put experts `ids` (rows of w13/w2) in the cache, evicting the least recently used."""
        if self.capacity == 0:
            return
        xp = self.xp
        if self._slab13 is None:
            self._slab13 = xp.empty((self.capacity,) + self.shape13, self.dtype)
            self._slab2 = xp.empty((self.capacity,) + self.shape2, self.dtype)
        start = max(0, len(ids) - self.capacity)
        for j in range(start, len(ids)):
            e = ids[j]
            if e in self._slots:
                slot = self._slots[e]
            elif len(self._slots) < self.capacity:
                slot = len(self._slots)
            else:
                _, slot = self._slots.popitem(last=False)
                self.stats.evictions += 1
            self._slab13[slot] = w13[j]
            self._slab2[slot] = w2[j]
            self._slots[e] = slot
            self._slots.move_to_end(e)

    def _lookup(self, ids):
        """(expert ids in order, ids to dequantise) with counters and recency updated."""
        order = [int(e) for e in to_numpy(ids).reshape(-1)]  # k small ints: one device->host copy on a GPU
        E = self.num_experts
        bad = [e for e in order if not 0 <= e < E]
        if bad:
            raise IndexError(f"expert ids {bad} outside 0..{E - 1} (this layer has {E} routed experts)")
        missing = [e for e in dict.fromkeys(order) if e not in self._slots]
        self.stats.misses += len(missing)  # counted per distinct expert of the call
        self.stats.hits += len(set(order)) - len(missing)
        for e in order:
            if e in self._slots:
                self._slots.move_to_end(e)
        return order, missing

    # ---- dequantising
    def dequantize(self, ids, workspace: bool = False):
        """Experts `ids` dequantised (no cache): ([m, 2I, l], [m, l, I]); one gather + one call per matrix.

        workspace=True writes into the model's workspace (shared by its layers), valid until the next such call.
        """
        xp, ws = self.xp, self._workspace
        sel = self._selection(ids)
        m = len(ids)
        out13 = ws.take("w13", (m,) + self.shape13, self.dtype) if workspace else None
        out2 = ws.take("w2", (m,) + self.shape2, self.dtype) if workspace else None
        pool = ws.pool() if on_host(xp) else None
        w13 = mxfp4.dequantize(self.w13_packed[sel], self.w13_scale[sel], out13, self.dtype, pool, self._table)
        w2 = mxfp4.dequantize(self.w2_packed[sel], self.w2_scale[sel], out2, self.dtype, pool, self._table)
        return w13, w2

    def _selection(self, ids):
        """Host ids -> the index the banks take: on the banks' device (a mapped bank: on the host)."""
        return self.xp.asarray(np.asarray(ids, dtype=np.int64))

    def gather(self, ids):
        """The selected experts' weights, in the order of `ids`: ([k, 2I, l], [k, l, I]), fresh arrays."""
        xp = self.xp
        order, missing = self._lookup(ids)
        if not order:
            return xp.empty((0,) + self.shape13, self.dtype), xp.empty((0,) + self.shape2, self.dtype)
        new13, new2 = self.dequantize(missing) if missing else (None, None)
        if missing == order:  # nothing cached is needed: hand the fresh arrays over as they are
            self._store(missing, new13, new2)
            return new13, new2
        pos = {e: j for j, e in enumerate(missing)}
        w13 = xp.stack([new13[pos[e]] if e in pos else self._slab13[self._slots[e]] for e in order])
        w2 = xp.stack([new2[pos[e]] if e in pos else self._slab2[self._slots[e]] for e in order])
        if missing:
            self._store(missing, new13, new2)
        return w13, w2

    def can_fuse(self) -> bool:
        """Whether the fused kernel can run this bank (see `fused`)."""
        arrays = (self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale)
        return (self.capacity == 0 and mxfp4_matvec.runs(self.xp, self.dtype)
                and all(a.flags.c_contiguous for a in arrays))

    @property
    def uses_fused(self) -> bool:
        return self.fused is not False and self.can_fuse()

    @property
    def route(self) -> str:
        """How the selected experts are multiplied, in words."""
        if self.uses_fused:
            return f"fused MXFP4 kernel ({mxfp4_matvec.default_isa()}), no cache"  # the one that runs (self-checked)
        return "dequantised per token" + (f", LRU cache of {self.capacity} per layer" if self.capacity else ", no cache")

    IN_PLACE_BYTES = 1 << 20  # host: experts this large are multiplied where they lie rather than copied

    def _multiply_in_place(self, xp) -> bool:
        """Per-expert matmuls where the experts lie (host, big experts: a copy costs more than k calls),
        or one gather + batched matmuls (GPU, and small experts where the calls dominate)."""
        return on_host(xp) and self.expert_bytes >= self.IN_PLACE_BYTES

    def outputs(self, ids, z, act):
        """y_e = w2_e act(w13_e z) for the selected experts, [k, l]: what `latent_moe` needs.

        Fused (see `uses_fused`): two kernel calls on the packed bytes. Otherwise, on the host,
        experts of at least `IN_PLACE_BYTES` are multiplied where they lie (cache slot or fresh
        block) through the same per-expert BLAS call a batched matmul makes (bit-identical, no
        [k, 2I, l] copy: at K3 size 2 GB per token); otherwise (GPU; tiny experts) one gather then
        batched matmuls (one launch each instead of k).
        """
        if len(ids) == 0:  # every expert ablated: no routed output (as a dense bank's empty matmuls give)
            return self.xp.zeros((0, self.shape2[0]), self.dtype)
        if self.uses_fused:
            return self._fused(ids, z, act)
        xp = self.xp
        if not self._multiply_in_place(xp):
            w13, w2 = self.gather(ids)
            a = act(xp.matmul(w13, z))
            return xp.matmul(w2, a[:, :, None])[:, :, 0]
        order, missing = self._lookup(ids)
        new13, new2 = self.dequantize(missing, workspace=True) if missing else (None, None)
        pos = {e: j for j, e in enumerate(missing)}
        pick = [(new13, new2, pos[e]) if e in pos else (self._slab13, self._slab2, self._slots[e]) for e in order]
        # [1, ...] views go through matmul's batched loop exactly as row j of a [k, ...] stack would
        h = xp.concatenate([xp.matmul(b13[j : j + 1], z) for b13, _, j in pick])  # [k, 2I]
        a = act(h)  # [k, I]
        y = xp.concatenate([xp.matmul(b2[j : j + 1], a[n : n + 1, :, None])[:, :, 0] for n, (_, b2, j) in enumerate(pick)])
        if missing:
            self._store(missing, new13, new2)
        return y

    GROUPED_BYTES = 1 << 30  # dequantising route of `outputs_grouped`: experts dequantised at once (bytes)

    def outputs_grouped(self, ids, z, act):
        """y[t, j] = w2_e act(w13_e z[t]) for e = ids[t, j]: [T, k, l] (z [T, l]), each distinct expert read once."""
        groups = group_selections(ids)
        if groups.n == 0:  # every expert ablated
            return self.xp.zeros(groups.shape + (self.shape2[0],), self.dtype)
        zs = z[self.xp.asarray(groups.rows)]  # [n, l]: rows sorted by expert
        y = self._fused_grouped(groups, zs, act) if self.uses_fused else self._dequantised_grouped(groups, zs, act)
        return groups.scatter(y)

    def _dequantised_grouped(self, groups, zs, act):
        """Hits multiplied from their cache slots first (storing new experts may evict them), then the missing
        experts dequantised `GROUPED_BYTES` at a time, multiplied, and stored. On the host in float32 the products are
        the dense bank's compiled experts (`sequence_ops.experts_rows`, each bank's experts in one call): the same bits
        as `experts="dense"`; elsewhere the matmul route, as the dense bank's."""
        xp = self.xp
        order, missing = self._lookup(groups.experts)
        where = {e: (a, b) for e, a, b in groups}
        y = xp.empty((groups.n, self.shape2[0]), self.dtype)

        def run(w13, w2, picks):
            """picks: (index in the banks w13 [m, 2I, l], w2 [m, l, I], expert)."""
            segments = [where[e] for _, e in picks]
            rows = np.concatenate([np.arange(a, b) for a, b in segments])
            bounds = np.cumsum([0] + [b - a for a, b in segments])
            out = sequence_ops.experts_rows(zs, rows, bounds, [j for j, _ in picks], w13, w2, act)
            if out is not None:
                y[rows] = out
                return
            for (j, _), (a, b) in zip(picks, segments, strict=True):
                y[a:b] = act(zs[a:b] @ w13[j].T) @ w2[j].T

        lost = set(missing)
        hits = [(self._slots[e], e) for e in order if e not in lost]
        if hits:
            run(self._slab13, self._slab2, hits)
        step = max(1, self.GROUPED_BYTES // self.expert_bytes)
        for i in range(0, len(missing), step):
            part = missing[i : i + step]
            w13, w2 = self.dequantize(part, workspace=True)
            run(w13, w2, list(enumerate(part)))
            self._store(part, w13, w2)
        return y

    def _fused_grouped(self, groups, zs, act):
        pool = self._workspace.pool()
        h = mxfp4_matvec.grouped_matmat(self.w13_packed, self.w13_scale, groups.experts, groups.bounds, zs, pool=pool)
        return mxfp4_matvec.grouped_matmat(self.w2_packed, self.w2_scale, groups.experts, groups.bounds, act(h), pool=pool)

    def _fused(self, ids, z, act):
        """The fused route: two kernel calls on the packed bytes, w13 then w2."""
        pool = self._workspace.pool()
        h = mxfp4_matvec.expert_matvec(self.w13_packed, self.w13_scale, ids, z, pool=pool)  # [k, 2I]
        return mxfp4_matvec.expert_matvec(self.w2_packed, self.w2_scale, ids, act(h), pool=pool)


def _check_capacity(capacity) -> int:
    if isinstance(capacity, bool) or int(capacity) != capacity or capacity < 0:
        raise ValueError(f"capacity={capacity!r}: expected a number of experts >= 0")
    return int(capacity)


def dense_from_packed(packed: PackedExperts, chunk: int = 8) -> DenseExperts:
    """Dequantise every expert up front with `mxfp4.dequantize`, `chunk` experts at a time."""
    xp = array_namespace(packed.w13_packed)
    E = packed.num_experts
    w13 = xp.empty((E,) + packed.w13_packed.shape[1:-1] + (2 * packed.w13_packed.shape[-1],), packed.dtype)
    w2 = xp.empty((E,) + packed.w2_packed.shape[1:-1] + (2 * packed.w2_packed.shape[-1],), packed.dtype)
    for a in range(0, E, chunk):
        b = min(E, a + chunk)
        w13[a:b] = mxfp4.dequantize(packed.w13_packed[a:b], packed.w13_scale[a:b], dtype=packed.dtype)
        w2[a:b] = mxfp4.dequantize(packed.w2_packed[a:b], packed.w2_scale[a:b], dtype=packed.dtype)
    return DenseExperts(w13, w2)
