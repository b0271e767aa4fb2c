"""The token form's small steps in one compiled call each (host float32): `_token_ops.c`.

    rms_norm(x, weight, eps)                       ops.rms_norm of a vector or of rows [T, n]
    situ(gate_up, beta, linear_beta)               ops.situ_and_mul of [..., 2n]
    set_row(rows, n, v, inv_rms, inv_d, eps)       a block-residual source and its 1/rms (SourceBuffer; a chunk's
                                                   tokens at once: SequenceSources)
    set_row_sum(rows, n, a, b, inv_rms, inv_d, eps)   set_row of a + b, the sum made in the same call (SequenceSources)
    source_softmax(s, inv_rms)                     the block-residual mix's softmax (SourceBuffer.weights; rows:
                                                   SequenceSources.weights)
    sigmoid(x); select_experts(scores, bias, k); routing_weights(scores, ids, renormalize, scaling, eps)
                                                   the latent MoE's router (latent_moe)
    softmax_rows_(s, scale)                        MLA's attention probabilities over the cache (mla.mla_step)
    kda_gates(window, conv, y, decay_raw, dt_bias, A, lower_bound, H)
                                                   KDA's conv + SiLU, gate, beta and decay (kda.kda_step)

Why: on the tiny models a decode step is some hundreds of NumPy calls on vectors of 8 to 384 floats,
and each call costs more than its arithmetic (`bench/decode.py`). Each step is evaluated in double from
its float32 inputs (libm's exp and tanh) and rounded once, so each output is the float32 nearest its
exact value (`tests/test_token_ops.py`: <= 0.501 ulp): as close as NumPy's float32 formulation of the
step or closer, to which it agrees to rounding, not bit for bit. The route is the same for a token
with and without hooks (they fire between the steps), so replays stay exact.

The callers take this route where `runs(...)` holds (C-contiguous float32 NumPy arrays, the extension
built); float64, CuPy, the strict stand-in and an install without a compiler take the NumPy formulas.
"""

from __future__ import annotations

import numpy as np

try:
    from . import _token_ops as _ext
except ImportError:  # no compiler at install time
    _ext = None

AVAILABLE = _ext is not None
MAX_SOURCES = 64  # source_softmax's bound on the sources of one mix
_F32 = np.dtype(np.float32)

__all__ = ["AVAILABLE", "host_float32", "in_c_order", "isas", "kda_gates", "rms_norm", "routing_weights", "runs",
           "select_experts", "set_row", "set_row_sum", "sigmoid", "situ", "softmax_rows_", "source_softmax"]


def isas() -> tuple[str, ...]:
    """Kernels this CPU can run for `rms_norm` (the one step built per ISA; the same values on each), best last."""
    return _ext.isas() if AVAILABLE else ()


def host_float32(*arrays) -> bool:
    """Whether every array is a C-contiguous float32 NumPy array (what the compiled token steps read)."""
    for a in arrays:
        if type(a) is not np.ndarray or a.dtype != _F32 or not a.flags.c_contiguous:
            return False
    return True


def runs(*arrays) -> bool:
    """Whether the compiled steps take these arrays: `host_float32`, and the extension built."""
    return _ext is not None and host_float32(*arrays)


def in_c_order(x):
    """x, or a C-ordered copy of a strided host float32 array (a column slice: MLA's latents, a stack's block);
    anything else as it is."""
    if type(x) is np.ndarray and not x.flags.c_contiguous and x.dtype == _F32:
        return np.ascontiguousarray(x)
    return x


def rms_norm(x, weight, eps: float):
    """x * weight / sqrt(mean(x^2) + eps) of a vector [n] or of each row of [T, n], in double, rounded once."""
    if weight.shape != x.shape[-1:] or x.ndim > 2:
        raise ValueError(f"rms_norm: x [n] or [T, n] and weight [n] expected, got {x.shape} and {weight.shape}")
    out = np.empty(x.shape, _F32)
    _ext.rms_norm(x, weight, eps, out)
    return out


def situ(gate_up, beta: float, linear_beta: float | None):
    """SiTU-GLU of [..., 2n] -> [..., n] (`ops.situ_and_mul`'s formula)."""
    n = gate_up.shape[-1] // 2
    out = np.empty(gate_up.shape[:-1] + (n,), _F32)
    c = beta if linear_beta is None else beta * linear_beta
    _ext.situ(gate_up, out, out.size // n if n else 0, n, 1.0 / beta, 1.0 / (linear_beta or 1.0), c,
              linear_beta is not None)
    return out


def set_row(rows, n: int, v, inv_rms, inv_d: float, eps: float) -> None:
    """rows[n] = v; inv_rms[n] (float64) = 1 / sqrt(sum(v^2) inv_d + eps), the sum in double. Or for T tokens at
    once (rows [T, R, d], v [T, d], inv_rms [T, R]): each token's row n and its 1/rms, the same steps."""
    tokens = v.shape[0] if v.ndim == 2 else 1
    if tokens:
        _ext.set_row(rows, n, v, inv_rms, inv_d, eps, tokens)


def set_row_sum(rows, n: int, a, b, inv_rms, inv_d: float, eps: float):
    """`set_row` of a + b (T tokens, a and b C-contiguous float32 [T, d]: NumPy's float32 sum), the sum made in the
    same call; returns it."""
    if not (host_float32(a, b) and a.shape == b.shape and a.ndim == 2):  # (the kernel reads the buffers by their sizes)
        raise ValueError(f"set_row_sum: a and b float32 [T, d] expected, got {a.dtype} {list(a.shape)} and "
                         f"{b.dtype} {list(b.shape)}")
    out = np.empty(a.shape, _F32)
    if a.shape[0]:
        _ext.set_row(rows, n, a, inv_rms, inv_d, eps, a.shape[0], b, out)
    return out


def source_softmax(s, inv_rms):
    """softmax(s * inv_rms[:m]) over the m = len(s) sources, in double, rounded once: float32 [m]. Or for T tokens
    at once (s [T, m], inv_rms [T, S >= m]): float32 [T, m], each row the same steps."""
    out = np.empty(s.shape, _F32)
    if s.ndim == 1 or s.shape[0]:
        _ext.source_softmax(s, inv_rms, out, s.shape[0] if s.ndim == 2 else 1)
    return out


def sigmoid(x):
    """1 / (1 + exp(-x)): [n]."""
    out = np.empty(x.shape, _F32)
    _ext.sigmoid(x, out)
    return out


def softmax_rows_(s, scale: float):
    """In place on s [..., L] (writable): each row's softmax(s * scale); returns s."""
    if s.size:
        _ext.softmax_rows(s, s.size // s.shape[-1], scale)
    return s


def select_experts(scores, bias, top_k: int):
    """The top-k of scores + bias (ties to the lower id, NaN ranked as +inf), ordered by unbiased score: int64 [k]
    (`latent_moe.select_experts`); scores [T, E], a chunk's rows: [T, k], row t the ids of scores[t]."""
    if bias.shape != scores.shape[-1:]:  # (the kernel reads the buffers by their sizes)
        raise ValueError(f"select_experts: bias {list(bias.shape)}, expected [{scores.shape[-1]}] (scores {list(scores.shape)})")
    ids = np.empty(scores.shape[:-1] + (top_k,), np.int64)
    if ids.size:
        _ext.select_experts(scores, bias, ids)
    return ids


def routing_weights(scores, ids, renormalize: bool, scaling: float, eps: float):
    """scores[ids] (renormalised to sum 1 + eps when asked) times `scaling`, in double: float32 [k]; ids int64 [k]
    (scores [T, E] and ids [T, k]: row t the weights of scores[t], ids[t])."""
    if ids.shape[:-1] != scores.shape[:-1]:
        raise ValueError(f"routing_weights: ids {list(ids.shape)} for scores {list(scores.shape)}: expected a row of ids per row "
                         "of scores")
    out = np.empty(ids.shape, _F32)
    if out.size:
        _ext.routing_weights(scores, ids, ids.shape[-1], renormalize, scaling, eps, out)
    return out


def kda_gates(window, conv, y, decay_raw, dt_bias, A, lower_bound: float, H: int):
    """One token's [5P + H]: q, k, v (conv + SiLU, [3P]) | gate [P] | beta [H] | alpha [P] (`_token_ops.c`)."""
    out = np.empty(5 * decay_raw.shape[-1] + H, _F32)
    _ext.kda_gates(window, conv, y, decay_raw, dt_bias, A, lower_bound, H, out)
    return out
