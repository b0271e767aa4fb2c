"""What building the weight records needs from a checkpoint format: the `TensorSource` interface.

`records.build_weights` reads every tensor through a source and never sees a file format. Two
sources exist: a safetensors checkpoint directory (`safetensors_source.SafetensorsSource`, the
released layout) and a llama.cpp GGUF file (`gguf_source.GgufSource`, `kimi-k3`). A source speaks
the RELEASED names and layout of `checkpoint_table` (unprefixed, e.g.
`model.layers.3.self_attn.q_proj.weight`, shape as in the table); translating its own names, axis
order and fusions is its business. What a format stores differently from the release goes
through four record-level reads instead of raw tensors:

    score(kind, field, i)   the attn-res score vector [d], float64: norm gain x [1, d] projection
                            (safetensors multiplies them; GGUF stores the product)
    kda_decay(i)            A = exp(A_log) per KDA head [H], float64 (GGUF stores -exp(A_log))
    experts(i, mode, ...)   layer i's routed-expert bank (the MXFP4 byte layouts differ)
    experts_quantized(i)    whether those experts are MXFP4 on disk (experts="packed"/"mapped" need it)

The contract: `check` is called once before anything is read and raises `CheckpointError` naming
the file, the tensor, what was expected and what was found, also for a tensor in the file that the
config's model does not account for (it would be ignored: another model would run); after it, every
read of a planned tensor succeeds. `close` releases file handles; arrays handed out (memory-mapped expert views)
stay valid after it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from ..model.config import KimiDecoderConfig
from .checkpoint_table import Kind

__all__ = ["TensorSource"]


class TensorSource(ABC):
    """A checkpoint opened for loading: its config, its tensors by released name, its expert banks."""

    path: Path  # what error messages and `weights.source` name
    config: KimiDecoderConfig

    @abstractmethod
    def check(self, layer_ids: list[int], embedding: bool, head: bool) -> None:
        """Every tensor the global part (as `embedding`/`head` ask) and layers `layer_ids` need is there,
        with a usable dtype and the shape the config implies; else `CheckpointError`."""

    @abstractmethod
    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(on-disk dtype code, released shape) of a released tensor. Codes: 'BF16', 'F16', 'F32', 'F64'
        (read exactly), or a quantised type's name (read dequantised)."""

    @abstractmethod
    def read(self, name: str, dtype, out: np.ndarray | None = None) -> np.ndarray:
        """The released tensor as `dtype` (np.uint16: the bf16 bits of a 'BF16' tensor), into `out`
        (C-contiguous, its size) or a new array of the released shape."""

    @abstractmethod
    def score(self, kind: Kind, field: str, i: int | None) -> np.ndarray:
        """The attn-res score vector of record field `field` of `kind` (layer i; None: global), float64 [d]."""

    @abstractmethod
    def kda_decay(self, i: int) -> np.ndarray:
        """A = exp(A_log) of KDA layer i, one per head, float64 [H] (the builder casts it to the compute dtype)."""

    @abstractmethod
    def experts_quantized(self, i: int) -> bool:
        """Whether layer i's routed experts are all MXFP4 on disk."""

    @abstractmethod
    def experts(self, i: int, mode: str, *, dtype, xp, capacity: int, workspace):
        """Layer i's routed-expert bank: mode 'dense' (dequantised/widened up front), 'packed' (MXFP4
        bytes copied in) or 'mapped' (MXFP4 bytes left in the file, memory-mapped)."""

    @abstractmethod
    def close(self) -> None:
        """Release open files (arrays already handed out stay valid)."""
