"""Routed experts in ggml's MXFP4 block layout, as llama.cpp's GGUF stores them: `GgmlExperts`.

A `kimi-k3` GGUF stacks each MoE layer's experts into three tensors, read here in place:

    ffn_gate_exps  [E, I, l/32, 17]   w1 (gate)      ffn_up_exps  [E, I, l/32, 17]   w3 (up)
    ffn_down_exps  [E, l, I/32, 17]   w2 (down)      (17-byte blocks: `ggml_quants`)

`GgmlExperts` is a `PackedExperts` over these banks, with the same cache and the same three routes:

- fused (host, float32, no cache, kernel built): `mxfp4_matvec.ggml_expert_matvec` multiplies
  each bank where it lies (w13 = the gate rows, then the up rows: rows are independent, so two
  calls give what one call over [w1; w3] gives), and on the sequence path
  `mxfp4_matvec.grouped_ggml_matmat` each selected expert once for all its rows of a chunk. Bit for
  bit the outputs of the fused route on the compressed-tensors bytes of the same weights (tested on
  the engine sets);
- dequantising (cache, float64, GPU): the selected experts' blocks are copied out
  ([m, rows, G, 17], to the device on a GPU) and dequantised by `ggml_quants.dequantize_mxfp4`:
  the same values as `mxfp4.dequantize`, so the same matmuls as `PackedExperts`.

`mapped=True`: the banks are views of the GGUF's memory map (nothing copied at load, paged in by
the OS; `memory_report` counts them apart, as `MappedExperts`); else copies in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._xp import array_namespace
from ..backend import to_numpy
from . import ggml_quants, mxfp4, mxfp4_matvec
from .experts import PackedExperts

__all__ = ["GgmlExperts"]


@dataclass
class GgmlExperts(PackedExperts):
    """MXFP4 experts of one layer in ggml blocks.

    w13_packed: (gate, up) banks, uint8 [E, I, l/32, 17] each: the row blocks of w13, in order
    w2_packed:  (down,),          uint8 [E, l, I/32, 17]
    w13_scale, w2_scale: None (every block carries its own E8M0 scale byte)
    mapped: the banks are views of the GGUF's memory map
    device: the array namespace the selected experts go to (None: the banks' own)
    """

    mapped: bool = False
    device: object = None

    def _check_shapes(self) -> None:
        banks = list(self.w13_packed) + list(self.w2_packed)
        E = banks[0].shape[0]
        for b in banks:
            if b.dtype != np.uint8 or b.ndim != 4 or b.shape[0] != E or b.shape[-1] != ggml_quants.MXFP4_BLOCK:
                raise ValueError(f"GgmlExperts: banks {[tuple(x.shape) for x in banks]}: expected uint8 "
                                 f"[E, rows, groups, {ggml_quants.MXFP4_BLOCK}] with one E")
        if len({b.shape[2] for b in self.w13_packed}) != 1:
            raise ValueError(f"GgmlExperts: gate/up banks {[tuple(b.shape) for b in self.w13_packed]} differ in width")

    @property
    def xp(self):
        return self.device if self.device is not None else array_namespace(self.w13_packed[0])

    @property
    def num_experts(self) -> int:
        return self.w13_packed[0].shape[0]

    @property
    def shape13(self) -> tuple[int, int]:
        return sum(b.shape[1] for b in self.w13_packed), 32 * self.w13_packed[0].shape[2]

    @property
    def shape2(self) -> tuple[int, int]:
        return self.w2_packed[0].shape[1], 32 * self.w2_packed[0].shape[2]

    @property
    def packed_bytes(self) -> int:
        """Resident MXFP4 bytes (none when mapped: see `mapped_bytes`)."""
        return 0 if self.mapped else self._bank_bytes()

    @property
    def mapped_bytes(self) -> int:
        return self._bank_bytes() if self.mapped else 0

    def _bank_bytes(self) -> int:
        return sum(int(b.nbytes) for b in list(self.w13_packed) + list(self.w2_packed))

    def _selected(self, bank, ids):
        """The blocks of experts `ids`, [m, rows, G, 17], on `xp` (copied out of a map / to the device)."""
        xp = self.xp
        if isinstance(bank, np.ndarray):
            return xp.asarray(bank[np.asarray(ids, dtype=np.int64)])
        return bank[xp.asarray(np.asarray(ids, dtype=np.int64))]

    def dequantize(self, ids, workspace: bool = False):
        xp, ws, m = self.xp, self._workspace, len(ids)
        out13 = ws.take("w13", (m,) + self.shape13, self.dtype) if workspace else xp.empty((m,) + self.shape13, self.dtype)
        out2 = ws.take("w2", (m,) + self.shape2, self.dtype) if workspace else xp.empty((m,) + self.shape2, self.dtype)
        table = self.__dict__.get("_e2m1")
        if table is None:  # the E2M1 values where the experts are dequantised, made once
            table = self._e2m1 = xp.asarray(mxfp4.E2M1.astype(self.dtype))
        r = 0
        for bank in self.w13_packed:
            n = bank.shape[1]
            ggml_quants.dequantize_mxfp4(self._selected(bank, ids), out=out13[:, r : r + n], dtype=self.dtype, table=table)
            r += n
        ggml_quants.dequantize_mxfp4(self._selected(self.w2_packed[0], ids), out=out2, dtype=self.dtype, table=table)
        return out13, out2

    def can_fuse(self) -> bool:
        banks = list(self.w13_packed) + list(self.w2_packed)
        return (self.capacity == 0 and mxfp4_matvec.runs(self.xp, self.dtype)
                and all(isinstance(b, np.ndarray) and b.flags.c_contiguous for b in banks))

    @property
    def route(self) -> str:
        return super().route + (", ggml blocks mapped from the GGUF" if self.mapped else ", ggml blocks")

    def _fused_grouped(self, groups, zs, act):
        """The sequence path's fused route: each selected expert's blocks read once for all its rows of the chunk
        (`grouped_ggml_matmat`, one call per bank): the floats `PackedExperts` gives on the compressed-tensors bytes
        of the same weights. (It went row by row, each selection reading its expert again: at K3's density a chunk
        of 1,000 tokens read each expert ~18 times.)"""
        pool = self._workspace.pool()
        h = np.concatenate([mxfp4_matvec.grouped_ggml_matmat(b, groups.experts, groups.bounds, zs, pool=pool)
                            for b in self.w13_packed], axis=1)
        return mxfp4_matvec.grouped_ggml_matmat(self.w2_packed[0], groups.experts, groups.bounds, act(h), pool=pool)

    def _fused(self, ids, z, act):
        pool = self._workspace.pool()
        ids = np.asarray(to_numpy(ids), dtype=np.int64)
        h = np.concatenate([mxfp4_matvec.ggml_expert_matvec(b, ids, z, pool=pool) for b in self.w13_packed], axis=1)
        return mxfp4_matvec.ggml_expert_matvec(self.w2_packed[0], ids, act(h), pool=pool)
