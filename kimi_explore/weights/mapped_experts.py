"""Routed experts left in the shard files, read in place (`from_pretrained(..., experts="mapped")`).

At K3 size the routed experts are ~97% of the checkpoint (16.8 GB of a layer's 17.4 GB). Mapped,
none of their bytes is copied at load: each expert's `w1/w3/w2 .weight_packed/.weight_scale`
stays a read-only view of its shard's memory map (`safetensors_io`, the offsets from the header),
and the OS page cache decides what stays in memory. A token touches only its 16 selected experts
per layer (280 MB packed at K3 size); the first touch reads them from disk, later ones from the
page cache, and under memory pressure the kernel drops clean file pages instead of swapping.

On disk the six tensors of an expert lie at arbitrary offsets, so a matrix is a list of row blocks
(`ExpertViews`: w13 = the w1 block then the w3 block, w2 one block) instead of one [E, R, C/2]
array. `MappedExperts` is a `PackedExperts` over such views, with the same three routes:

- fused (host, float32, no cache, kernel built): `mxfp4_matvec.parts_matvec` multiplies each
  selected expert's blocks where they lie: the same bytes through the same row kernel as the
  packed bank, so bit for bit the same outputs as `experts="packed"` (tested);
- dequantising (host with a cache, or float64): the selected experts' bytes are copied out of the
  map ([m, R, C/2], as the packed bank's gather copies them) and dequantised by the same call;
- GPU: the same copy goes to the device (selected experts only, per use; LRU hits copy nothing).

The sequence path's `outputs_grouped` takes the same routes, the fused one through
`mxfp4_matvec.grouped_parts_matmat` (each distinct expert's blocks read once per chunk).

Traps: a mapped shard must not change or shrink while the model is alive (a truncated file is
refused at load, `checkpoint.check_checkpoint`; one cut afterwards faults on the first read of a missing page, SIGBUS).
Do not overwrite a checkpoint's files in place while a model maps them: the maps read the new bytes, so
the live model's experts change silently. Write a new file and rename it into place (`tiny_model`'s
writers do): the model keeps the old file's pages until it goes.
`memory_report` counts these bytes apart (`MemoryReport.mapped`): they are file-backed, shared
with the page cache, and show in the process's RSS only while their pages are resident.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import to_numpy
from . import mxfp4_matvec
from .experts import PackedExperts

__all__ = ["ExpertViews", "MappedExperts"]


class ExpertViews:
    """One half (packed or scale bytes) of one matrix (w13 or w2) of every expert of a layer.

    blocks[e] = (block_0, ..., block_{P-1}): read-only uint8 views [rows_p, n], C-contiguous
    shape = (E, R, n) like a packed bank's array (R = sum of rows_p)
    xp: where `views[ids]` delivers the selected experts (numpy, or cupy: copied to the device)
    """

    def __init__(self, blocks, xp=np):
        self.blocks, self.xp = [tuple(b) for b in blocks], xp
        first = self.blocks[0]
        self.rows = tuple(int(b.shape[0]) for b in first)
        width = int(first[0].shape[1])
        for e, expert in enumerate(self.blocks):
            shapes = [tuple(b.shape) for b in expert]
            if shapes != [(r, width) for r in self.rows] or any(b.dtype != np.uint8 or not b.flags.c_contiguous for b in expert):
                raise ValueError(f"ExpertViews: expert {e} has blocks {shapes}, expected C-contiguous uint8 "
                                 f"{[(r, width) for r in self.rows]} like expert 0")
        self.shape = (len(self.blocks), sum(self.rows), width)

    @property
    def mapped_bytes(self) -> int:
        return sum(int(b.nbytes) for expert in self.blocks for b in expert)

    def selected(self, ids) -> list[tuple]:
        """The blocks of experts `ids`, in order (checked against 0..E-1)."""
        order = [int(e) for e in to_numpy(ids).reshape(-1)]
        bad = [e for e in order if not 0 <= e < self.shape[0]]
        if bad:
            raise IndexError(f"expert ids {bad} outside 0..{self.shape[0] - 1} (this layer has {self.shape[0]} routed experts)")
        return [self.blocks[e] for e in order]

    def __getitem__(self, ids):
        """The selected experts' bytes copied out of the map into one [m, R, n] array on `xp`."""
        picked = self.selected(ids)
        out = np.empty((len(picked),) + self.shape[1:], np.uint8)
        for j, expert in enumerate(picked):
            np.concatenate(expert, out=out[j])
        return out if self.xp is np else self.xp.asarray(out)


@dataclass
class MappedExperts(PackedExperts):
    """`PackedExperts` whose four banks are `ExpertViews` of the mapped shards (nothing resident).

    w13_packed / w13_scale: ExpertViews, blocks (w1, w3): [I, l/2] / [I, l/32] each
    w2_packed / w2_scale:   ExpertViews, one block: [l, I/2] / [l, I/32]
    """

    @property
    def xp(self):
        return self.w13_packed.xp

    @property
    def packed_bytes(self) -> int:
        """Resident packed bytes: none (see `mapped_bytes`)."""
        return 0

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the experts' MXFP4 tensors left in the shard files."""
        return sum(v.mapped_bytes for v in (self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale))

    def can_fuse(self) -> bool:
        return self.capacity == 0 and mxfp4_matvec.runs(self.xp, self.dtype)

    def _selection(self, ids):
        """The ids stay on the host, where the maps are (on a GPU a device copy would come straight back)."""
        return np.asarray(ids, dtype=np.int64)

    @property
    def route(self) -> str:
        return super().route + ", experts mapped from the shard files"

    def _fused_grouped(self, groups, zs, act):
        pool, ids = self._workspace.pool(), groups.experts
        p13, s13 = self.w13_packed.selected(ids), self.w13_scale.selected(ids)
        h = mxfp4_matvec.grouped_parts_matmat(p13, s13, self.w13_packed.rows, groups.bounds, zs, pool=pool)
        p2, s2 = self.w2_packed.selected(ids), self.w2_scale.selected(ids)
        return mxfp4_matvec.grouped_parts_matmat(p2, s2, self.w2_packed.rows, groups.bounds, act(h), pool=pool)

    def _fused(self, ids, z, act):
        pool = self._workspace.pool()
        p13, s13 = self.w13_packed.selected(ids), self.w13_scale.selected(ids)
        h = mxfp4_matvec.parts_matvec(p13, s13, self.w13_packed.rows, z, pool=pool)  # [k, 2I]
        p2, s2 = self.w2_packed.selected(ids), self.w2_scale.selected(ids)
        return mxfp4_matvec.parts_matvec(p2, s2, self.w2_packed.rows, act(h), pool=pool)
