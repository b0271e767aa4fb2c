"""A bf16-resident matrix times a float32 vector, straight from the bf16 bits (CPU, compiled kernel).

    y[r] = sum_c f32(W[r, c]) * x[c]        W: uint16 bf16 bits [R, C];  x, y: float32

f32(b) is exact (bf16 is the high half of a float32), so every product is the one BLAS sees on the
widened matrix; only the float32 summation order differs (|error| ~1e-7 of sum |W||x|, tested
against float64). The kernel (`_bf16_matvec.c`) reads 2 bytes per weight once: half the bytes of a
float32-resident trunk, where the widening route (`bf16_weights.Bf16Matrix`, kernel off) reads
2 + 4 + 4 (widen into a scratch, then BLAS) and is the one bit-identical to the float32 trunk.
Built at install when a C compiler is present (`setup.py`, optional); `AVAILABLE` says.

`bf16_matmat` is the sequence path's entry: n input rows at once, out [n, R] = x [n, C] W^T, each
weight widened once per tile of 4 inputs (W's bytes from memory once per call).
"""

from __future__ import annotations

import numpy as np

from ..backend import HOST_THREADS, on_host
from .kernel_isa import check_apart, first_mismatch, first_sound, small_exact_inputs
from .workspace import run_rows

try:
    from . import _bf16_matvec as _ext
except ImportError:  # no compiler at install time
    _ext = None

AVAILABLE = _ext is not None
_MIN_ROWS_PER_THREAD = 64


def runs(xp, dtype) -> bool:
    """Whether the kernel can take arrays of namespace `xp` computing in `dtype` (host, float32, built)."""
    return AVAILABLE and on_host(xp) and np.dtype(dtype) == np.float32


def isas() -> tuple[str, ...]:
    """Kernels this CPU can run, best last ('portable', 'avx2', 'avx512f'); () without the extension."""
    return _ext.isas() if AVAILABLE else ()


_DEFAULT: list = []  # the default kernel, once checked


def default_isa() -> str:
    """The kernel both entry points run when none is asked for: the best of `isas()` that gives the portable
    kernel's floats on `_self_check` (`kernel_isa`: checked once, before the first product)."""
    if not _DEFAULT:
        _DEFAULT.append(first_sound("bf16_matvec", isas(), _self_check))
    return _DEFAULT[0]


def _self_check(isa: str) -> str | None:
    """None when `isa` gives the portable kernel's floats through both entry points, else what differed. Weights
    and inputs of small integers (bf16 holds them exactly): every sum exact. 37 rows and 300 columns cross the
    vectors', tiles' and panels' edges. The input counts run every compiled shape: the tiles' passes of 1-4
    inputs, AVX2's panel calls of 1-5 (5-9 inputs: 5 + 1, ..., 5 + 4) and AVX-512's of 6-12 (12, 13, 16, 19, 21:
    7 + 6, 8 + 8, 10 + 9, 11 + 10)."""
    bits = (small_exact_inputs(37, 300, seed=1) * 2).view(np.uint32) >> 16  # -8..8 as bf16 bits
    bits = np.ascontiguousarray(bits.astype(np.uint16))
    x = small_exact_inputs(21, 300)
    calls = {"bf16_matvec": lambda i: bf16_matvec(bits, x[0], isa=i, threads=1)}
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 19, 21):
        calls[f"bf16_matmat ({n} rows)"] = lambda i, n=n: bf16_matmat(bits, x[:n], isa=i, threads=1)
    return first_mismatch(isa, calls)


def bf16_matvec(bits, x, out=None, isa: str | None = None, threads: int | None = None, pool=None):
    """bits: uint16 [R, C] (bf16 bit patterns, C-contiguous); x: float32 [C] -> float32 [R].

    isa: one of `isas()` (default: `default_isa()`, the best that passes its self-check). threads: host
    threads sharing the rows (default `backend.HOST_THREADS`; the kernel releases the GIL); pool: their
    executor (the model's `workspace.pool()`; None: a pool just for this call).
    """
    if not AVAILABLE:
        raise RuntimeError("kimi_explore.weights._bf16_matvec was not built (no C compiler at install); reinstall with one")
    if not isinstance(bits, np.ndarray) or bits.dtype != np.uint16 or bits.ndim != 2 or not bits.flags.c_contiguous:
        raise ValueError(f"bits: expected a C-contiguous uint16 NumPy array [R, C] (bf16 bits), got {_describe(bits)}")
    R, C = bits.shape
    x = np.asarray(x)
    if x.dtype != np.float32 or x.shape != (C,):
        raise ValueError(f"x: expected float32 [{C}], got {_describe(x)}")
    x = np.ascontiguousarray(x)
    out = np.empty(R, np.float32) if out is None else out
    if out.shape != (R,) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out: expected a C-contiguous float32 [{R}], got {_describe(out)}")
    check_apart(out, x)
    if R == 0 or C == 0:  # (the kernel takes R, C > 0) a model without shared experts has a [d, 0] down projection
        out[...] = 0.0
        return out
    isa = isa or default_isa()
    run = lambda a, b: _ext.bf16_matvec(bits, x, out, R, C, a, b, isa)  # noqa: E731
    run_rows(pool, run, R, threads or HOST_THREADS, _MIN_ROWS_PER_THREAD)
    return out


def bf16_matmat(bits, x, out=None, isa: str | None = None, threads: int | None = None, pool=None):
    """bits: uint16 [R, C] (bf16 bit patterns, C-contiguous); x: float32 [n, C] -> float32 [n, R] = x W^T.

    isa, threads, pool: as `bf16_matvec` (threads share the weight rows).
    """
    if not AVAILABLE:
        raise RuntimeError("kimi_explore.weights._bf16_matvec was not built (no C compiler at install); reinstall with one")
    if not isinstance(bits, np.ndarray) or bits.dtype != np.uint16 or bits.ndim != 2 or not bits.flags.c_contiguous:
        raise ValueError(f"bits: expected a C-contiguous uint16 NumPy array [R, C] (bf16 bits), got {_describe(bits)}")
    R, C = bits.shape
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != C:
        raise ValueError(f"x: expected float32 [n, {C}], got {_describe(x)}")
    x = np.ascontiguousarray(x)
    n = x.shape[0]
    out = np.empty((n, R), np.float32) if out is None else out
    if out.shape != (n, R) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out: expected a C-contiguous float32 [{n}, {R}], got {_describe(out)}")
    check_apart(out, x)
    if R == 0 or C == 0 or n == 0:  # (the kernel takes R, C > 0): x W^T of an empty sum is zeros
        out[...] = 0.0
        return out
    from .workspace import run_parts  # here: workspace -> bf16_weights -> this module at import time

    parts = max(1, min(threads or HOST_THREADS, R * max(n, 1) // (_MIN_ROWS_PER_THREAD * 16)))
    cuts = [R * p // parts // 4 * 4 for p in range(parts)] + [R]  # whole 4-row tiles per thread
    isa = isa or default_isa()
    run = lambda a, b: _ext.bf16_matmat(bits, x, out, R, C, n, a, b, isa)  # noqa: E731
    run_parts(pool, run, [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a])
    return out


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} {a.shape}{'' if a.flags.c_contiguous else ' (not C-contiguous)'}"
    return type(a).__name__
