"""`from_pretrained`'s options, checked and resolved against the config and the checkpoint.

    experts            "auto" | "dense" | "packed" | "mapped"   -> the mode every MoE layer is built in
    expert_cache_size  None | n >= 0                            -> dequantised experts kept per layer (<= E)
    weight_dtype       None | "bfloat16"                        -> keep BF16 matrices as bf16 bits
    bf16_matvec        "auto" | "kernel" | "widen"              -> Bf16Matrix's `kernel`

The automatic choices depend on sizes, so they are made here, once, from the config: a tiny model
dequantises its experts up front; K3 keeps them packed (or mapped) and, on the CPU, multiplies them
with the fused kernel rather than caching a few dequantised ones.
"""

from __future__ import annotations

import numpy as np

from ..errors import CheckpointError
from ..model.config import KimiDecoderConfig
from . import bf16_matvec, mxfp4_matvec
from .tensor_source import TensorSource

EXPERT_MODES = ("auto", "packed", "mapped", "dense")
BF16_MATVECS = ("auto", "kernel", "widen")
AUTO_DENSE_BYTES = 1 << 30  # experts="auto": dequantise up front when all requested experts fit in this
AUTO_CACHE_BYTES = 512 << 20  # expert_cache_size=None: the experts per layer whose dequantised copies fit in this


def expert_bytes(cfg: KimiDecoderConfig, dtype) -> int:
    """Bytes of one routed expert dequantised (w1, w3, w2) in `dtype`."""
    return 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size * np.dtype(dtype).itemsize


def check_forms(experts, expert_cache_size) -> None:
    """The options' forms, before anything is opened or fetched (a Hub load downloads shards first)."""
    if experts not in EXPERT_MODES:
        raise ValueError(f"experts={experts!r}: expected one of {', '.join(map(repr, EXPERT_MODES))}")
    size = expert_cache_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0):
        raise ValueError(f"expert_cache_size={size!r}: expected None or a number of experts per layer >= 0")
    if experts == "dense" and size is not None:
        raise ValueError(f"expert_cache_size={size!r} sizes the cache of packed or mapped experts, and experts='dense' "
                         "dequantises every expert at load: leave expert_cache_size out, or pass experts='packed'")


def auto_experts(cfg: KimiDecoderConfig, moe_layers: int, quantized: bool, dtype) -> str:
    """What experts="auto" loads for a model of `moe_layers` MoE layers whose routed experts are (`quantized`) or are
    not all MXFP4 on disk: dense when small (or not MXFP4), else packed. A pipeline decides it once for all its stages."""
    if not quantized:
        return "dense"
    return "dense" if moe_layers * cfg.num_experts * expert_bytes(cfg, dtype) <= AUTO_DENSE_BYTES else "packed"


def resolve_experts(experts: str, cfg: KimiDecoderConfig, layer_ids, source: TensorSource, dtype,
                    cache_size: int | None = None) -> str:
    """The expert mode for these layers: "auto" is dense when small (or not MXFP4 on disk), else packed; a
    given `cache_size` (the caller's expert_cache_size) asks for packed."""
    check_forms(experts, None)
    moe = [i for i in layer_ids if cfg.is_moe_layer(i)]
    quantized = all(source.experts_quantized(i) for i in moe)
    if experts == "auto" and cache_size is not None:
        experts = "packed"  # (refused below where the experts are not MXFP4 on disk)
    if experts == "auto":
        return auto_experts(cfg, len(moe), quantized, dtype)
    if experts in ("packed", "mapped") and not quantized:
        layer = next(i for i in moe if not source.experts_quantized(i))
        raise CheckpointError(
            f"{source.path}: experts={experts!r}{'' if cache_size is None else f' (expert_cache_size={cache_size})'} "
            f"but layer {layer}'s routed experts are not all MXFP4 on disk; load with experts='dense' "
            "and no expert_cache_size"
        )
    return experts


def resolve_cache_size(size, cfg: KimiDecoderConfig, dtype, xp) -> int:
    if size is None:  # bounded memory: at K3 size an expert is 132 MB dequantised (3 fit per layer)
        fit = AUTO_CACHE_BYTES // expert_bytes(cfg, dtype)
        if fit >= cfg.num_experts:
            return cfg.num_experts
        # a cache holding a few of the layer's experts mostly misses: on the host the fused kernel
        # multiplies straight from the packed bytes instead (capacity 0 selects it)
        return 0 if mxfp4_matvec.runs(xp, dtype) else fit
    check_forms("auto", size)
    return min(int(size), cfg.num_experts)  # a cache of every expert is the most a layer can use


def resolve_weight_dtype(weight_dtype, dtype) -> bool:
    """True when the big matrices stay bf16-resident."""
    if weight_dtype is None or weight_dtype == np.dtype(dtype).name:
        return False
    if weight_dtype in ("bfloat16", "bf16"):
        return True
    raise ValueError(f"weight_dtype={weight_dtype!r}: expected None (= dtype, {np.dtype(dtype).name!r}) or 'bfloat16' "
                     "(or 'bf16')")


def check_bf16_kernel(kernel: bool | None, xp, dtype, device: str) -> None:
    """bf16_matvec="kernel" (kernel=True) where the compiled kernel cannot run is refused with the other option
    checks, before the checkpoint is opened (`Bf16Matrix` would refuse it only at the first matrix built)."""
    if kernel and not bf16_matvec.runs(xp, dtype):
        raise ValueError(f"bf16_matvec='kernel' requires the compiled bf16 kernel, which runs on the CPU in float32 "
                         f"when built (built: {bf16_matvec.AVAILABLE}); got device={device!r}, "
                         f"dtype={np.dtype(dtype).name!r}: pass bf16_matvec='auto' (the kernel where it runs) or 'widen'")


def resolve_bf16_matvec(route: str) -> bool | None:
    """Bf16Matrix's `kernel`: None = the compiled kernel where it runs, True = required, False = widen."""
    if route not in BF16_MATVECS:
        raise ValueError(f"bf16_matvec={route!r}: expected one of {', '.join(map(repr, BF16_MATVECS))}")
    return {"auto": None, "kernel": True, "widen": False}[route]
