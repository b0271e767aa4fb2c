"""The released safetensors checkpoint as a `TensorSource`: what `records.build_weights` reads from it.

Tensors are read by `tensor_reader.TensorReader` straight into their final buffers (no second
copy, no mapped pages left resident). The format-specific reads:

    score      attn-res: norm gain [d] x projection [1, d], multiplied in float64 (exact: both are bf16)
    kda_decay  A = exp(A_log[:H]) in float64 (the builder casts it): A_log is per head, stored
               head_dim wide and zero-padded (non-zero padding is refused, not guessed)
    experts    routed experts from their compressed-tensors MXFP4 pairs (`weight_packed` [r, c/2]
               + `weight_scale` [r, c/32], `mxfp4.py`), or dense `weight`s:
               dense  every expert dequantised (or widened) into [E, 2I, l] / [E, l, I] banks
               packed the bytes copied into [E, rows, ...] uint8 banks (`experts.PackedExperts`)
               mapped views of the bytes in the shards' memory maps (`mapped_experts.MappedExperts`)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import backend
from ..errors import CheckpointError
from ..model.config import KimiDecoderConfig
from ..model.latent_moe import DenseExperts
from . import checkpoint_table as table
from . import mxfp4
from .checkpoint import CheckpointDir, check_checkpoint, check_no_unexpected, experts_packed_on_disk, plan_tensors
from .experts import PackedExperts
from .mapped_experts import ExpertViews, MappedExperts
from .tensor_reader import TensorReader
from .tensor_source import TensorSource

EXPERT_BANKS = ("w13", "w2")  # the banks' fields: w13 = rows of w1 (gate) then w3 (up); w2 (down)


class SafetensorsSource(TensorSource):
    """A checkpoint directory (`CheckpointDir`) with its config, read through one `TensorReader`."""

    def __init__(self, path: str | Path, config: KimiDecoderConfig):
        self.ckpt = CheckpointDir(path)
        self.path, self.config = self.ckpt.path, config
        self.reader = TensorReader(lambda n: (self.ckpt.open(self.ckpt.shard_of(n)), self.ckpt.full(n)))

    def check(self, layer_ids, embedding, head) -> None:
        check_checkpoint(self.ckpt, plan_tensors(self.config, layer_ids, self.ckpt, embedding, head))
        check_no_unexpected(self.ckpt, self.config)
        for i in layer_ids:  # A_log's padding (a few floats per layer): refused here, not layers into the build
            if self.config.is_kda_layer(i):
                self.kda_decay(i)

    def info(self, name: str):
        return self.reader.info(name)

    def read(self, name: str, dtype, out=None) -> np.ndarray:
        return self.reader.read(name, dtype, out=out)

    def score(self, kind, field, i) -> np.ndarray:
        norm, proj = kind.parts(self.config, field, i)
        return self.read(norm, np.float64) * self.read(proj, np.float64).reshape(-1)

    def kda_decay(self, i: int) -> np.ndarray:
        H, name = self.config.linear_attn_config.num_heads, table.KDA.name("A_log", i)
        a_log = self.read(name, np.float64)  # F32 on disk: widened exactly
        if a_log.shape[0] < H:
            raise CheckpointError(f"{self.path / self.ckpt.shard_of(name)}: tensor '{self.ckpt.full(name)}' has "
                                  f"{a_log.shape[0]} values, fewer than num_heads={H} (one per head, zero-padded to head_dim)")
        if a_log.shape[0] != H and np.any(a_log[H:] != 0):
            raise CheckpointError(
                f"{self.path / self.ckpt.shard_of(name)}: tensor '{self.ckpt.full(name)}' is stored {a_log.shape[0]} wide "
                "with non-zero entries "
                f"past num_heads={H}; K3 stores one value per head, zero-padded to head_dim. Refusing to guess its layout."
            )
        with np.errstate(over="ignore"):  # (an overflow is refused below)
            A = np.exp(a_log[:H])
        if not np.all(np.isfinite(A) & (A > 0)):  # inf: another model that runs (the GGUF loader refuses it too)
            raise CheckpointError(f"{self.path / self.ckpt.shard_of(name)}: tensor '{self.ckpt.full(name)}' must give a "
                                  f"finite decay rate exp(A_log) > 0 per head; found A_log {a_log[:H].tolist()}")
        return A

    def experts_quantized(self, i: int) -> bool:
        return experts_packed_on_disk(self.ckpt, self.config, i)

    def experts(self, i, mode, *, dtype, xp, capacity, workspace):
        if mode == "dense":
            return self._dense_experts(i, dtype, xp)
        if mode == "packed":
            return PackedExperts(**self._packed_banks(i, xp), dtype=dtype, capacity=capacity, workspace=workspace)
        return MappedExperts(**self._mapped_views(i, xp), dtype=dtype, capacity=capacity, workspace=workspace)

    def _mapped(self, name: str) -> np.ndarray:
        """A read-only uint8 view of the tensor's bytes in its shard's memory map (nothing read now);
        the view keeps the map alive after the loader closes the checkpoint."""
        return np.asarray(self.ckpt.open(self.ckpt.shard_of(name)).array(self.ckpt.full(name)))

    def _packed_banks(self, i: int, xp, chunk: int = 16) -> dict:
        """The MXFP4 bytes of every expert in [E, rows, ...] uint8 banks, `chunk` experts per upload."""
        cfg, M, E, on_host = self.config, table.MOE, self.config.num_experts, backend.on_host(xp)
        banks = {}
        for field in EXPERT_BANKS:
            keys = M.keys(field)
            rows = [M.shape(cfg, k)[0] for k in keys]
            cols = M.shape(cfg, keys[0])[1]
            for half, width in ((0, cols // 2), (1, cols // mxfp4.GROUP)):  # weight_packed, weight_scale
                bank = (np.empty if on_host else xp.empty)((E, sum(rows), width), np.uint8)
                for a in range(0, E, chunk):
                    experts = range(a, min(E, a + chunk))
                    dst = bank[a : a + len(experts)] if on_host else np.empty((len(experts), sum(rows), width), np.uint8)
                    for j, e in enumerate(experts):
                        r = 0
                        for k, n in zip(keys, rows, strict=True):
                            self.reader.read(table.mxfp4_names(M.name(k, i, e))[half], np.uint8, out=dst[j, r : r + n])
                            r += n
                    if not on_host:
                        bank[a : a + len(experts)] = xp.asarray(dst)
                banks[f"{field}_{('packed', 'scale')[half]}"] = bank
        return banks

    def _mapped_views(self, i: int, xp) -> dict:
        """Views of every expert's MXFP4 tensors in the mapped shards: nothing is read or copied."""
        M, views = table.MOE, {}
        for field in EXPERT_BANKS:
            keys = M.keys(field)
            for half, what in ((0, "packed"), (1, "scale")):
                blocks = [[self._mapped(table.mxfp4_names(M.name(k, i, e))[half]) for k in keys]
                          for e in range(self.config.num_experts)]
                views[f"{field}_{what}"] = ExpertViews(blocks, xp)
        return views

    def _dense_experts(self, i: int, dtype, xp) -> DenseExperts:
        """Every expert dequantised (MXFP4 through `mxfp4.dequantize`) or widened (dense on disk)."""
        cfg, M, E = self.config, table.MOE, self.config.num_experts
        banks = {}
        for field in EXPERT_BANKS:
            keys = M.keys(field)
            shapes = [M.shape(cfg, k) for k in keys]
            bank = banks[field] = np.empty((E, sum(r for r, _ in shapes), shapes[0][1]), dtype)
            for e in range(E):
                r = 0
                for k, (n, _) in zip(keys, shapes, strict=True):
                    name, dst = M.name(k, i, e), bank[e, r : r + n]
                    if self.ckpt.has(name):
                        self.reader.read(name, dtype, out=dst)
                    else:
                        packed, scale = (self.reader.read(x, np.uint8) for x in table.mxfp4_names(name))
                        mxfp4.dequantize(packed, scale, out=dst, dtype=dtype)
                    r += n
        return DenseExperts(xp.asarray(banks["w13"]), xp.asarray(banks["w2"]))

    def close(self) -> None:
        self.ckpt.close()
