"""The gated delta rule token by token, compiled (CPU, float32): the KDA sequence path's recurrent route.

    recurrent_delta_rule(q, k, v, log_alpha, beta, S, state_norms=False) -> (o [T, H, V], norms [T, H] or None)

The contract of `kda_chunk.chunked_delta_rule` (S [H, K, V] updated in place; norms = ||S_h||_F after
every token), computed as the token form computes it: per head and token, decay, read, write, read
out (`_kda_recurrence.c`). Each head's state stays in cache through the T tokens, so the state
crosses memory once per call and the per-token norms cost one more sum. Only the float32 summation
order differs from the token form. The chunked form (matmuls) is the route for other backends and
dtypes (`kda.kda_sequence` picks, and says why; `bench/prefill.py` measures both).

Built at install when a C compiler is present (`setup.py`, optional); `AVAILABLE` says.
"""

from __future__ import annotations

import numpy as np

from ..backend import on_host
from .token_ops import host_float32

try:
    from . import _kda_recurrence as _ext
except ImportError:  # no compiler at install time
    _ext = None

AVAILABLE = _ext is not None


def runs(xp, dtype) -> bool:
    """Whether the kernel can take arrays of namespace `xp` computing in `dtype` (host, float32, built)."""
    return AVAILABLE and on_host(xp) and np.dtype(dtype) == np.float32


def elementwise_ops(*arrays):
    """The compiled elementwise steps of the token form (`shift_in`, `scale_rows`, `write_delta`, `l2_scale`, `gated_norm`:
    exactly NumPy's rounding, one call each instead of several array operations and broadcasts over short
    axes), when every array is a C-contiguous float32 host array and the kernel is built; else None."""
    return _ext if _ext is not None and host_float32(*arrays) else None


def isas() -> tuple[str, ...]:
    """Kernels this CPU can run, best last ('portable', 'avx2', 'avx512f'); () without the extension."""
    return _ext.isas() if AVAILABLE else ()


def recurrent_delta_rule(q, k, v, log_alpha, beta, S, state_norms: bool = False, isa: str | None = None, alpha=None):
    """q, k: [T, H, K]; v: [T, H, V]; log_alpha: [T, H, K] (<= 0); beta: [T, H]; S: float32 [H, K, V] (C-contiguous),
    updated in place. Returns (o [T, H, V], norms [T, H] or None). isa: one of `isas()` (default: the best).
    alpha: exp(log_alpha) when the caller has it already (float32 [T, H, K]; not recomputed)."""
    if not AVAILABLE:
        raise RuntimeError("kimi_explore.model._kda_recurrence was not built (no C compiler at install); reinstall with one")
    T, H, K = k.shape
    V = v.shape[-1]
    if not isinstance(S, np.ndarray) or S.dtype != np.float32 or S.shape != (H, K, V) or not S.flags.c_contiguous:
        raise ValueError(f"S: expected a C-contiguous float32 NumPy array [{H}, {K}, {V}], got {getattr(S, 'dtype', type(S))} "
                         f"{getattr(S, 'shape', '')}")
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    q, k, v, beta = f32(q), f32(k), f32(v), f32(beta)
    alpha = np.exp(f32(log_alpha)) if alpha is None else f32(alpha)
    for name, a, want in (("q", q, (T, H, K)), ("v", v, (T, H, V)), ("log_alpha", alpha, (T, H, K)), ("beta", beta, (T, H))):
        if a.shape != want:
            raise ValueError(f"recurrent_delta_rule: {name} has shape {a.shape}, expected {want} (from k {k.shape})")
    o = np.empty((T, H, V), np.float32)
    norms = np.empty((T, H), np.float32) if state_norms else None
    _ext.delta_rule(q, k, v, alpha, beta, S, o, norms, T, H, K, V, 0, H, isa or "")
    return o, norms
