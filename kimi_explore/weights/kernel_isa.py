"""Which SIMD kernel a compiled matvec (`mxfp4_matvec`, `bf16_matvec`) runs when none is asked for.

Each C kernel comes as portable C, AVX2+FMA and AVX-512F (`_kernel_isa.h`). The tests run every one
the CPU has, but not every CPU runs the tests: most of this package's development machines hid AVX-512
(its kernels first ran, and passed, on a Xeon on 2026-12-05), and a compiler or CPU no test has seen
may still miscompile or misrun one. Before its first product, each
module multiplies small problems through every entry point with its kernels, best first: weights
and inputs of small integers and power-of-two scales, so that every sum is exact in float32 and a
sound kernel gives the portable kernel's floats bit for bit. A kernel that does not is skipped with
a RuntimeWarning naming it and what differed, and the next best one is used: a wrong number is
worse than a slower one. (`check_apart`: what every kernel that writes while it reads needs of `out`.)
"""

from __future__ import annotations

import warnings

import numpy as np

__all__ = ["check_apart", "first_mismatch", "first_sound", "mismatch", "small_exact_inputs"]


def check_apart(out, x) -> None:
    """The kernels write `out` while they still read `x`: an `out` over x's memory gives garbage (1e3-1e10 off)."""
    if np.may_share_memory(out, x):
        raise ValueError("out: shares memory with x (the kernel reads x while it writes out); pass another array")


def first_sound(module: str, isas, differs) -> str:
    """The best of `isas` ('portable' first, best last) for which `differs(isa)` is None (else a description of
    what differed from 'portable'), warning about each kernel skipped; 'portable' when none is sound."""
    for isa in reversed(tuple(isas)[1:]):
        what = differs(isa)
        if what is None:
            return isa
        warnings.warn(f"{module}: the {isa} kernel disagrees with the portable C kernel on its self-check ({what}); "
                      f"it is not used", RuntimeWarning, stacklevel=3)
    return "portable"


def small_exact_inputs(n: int, C: int, seed: int = 0) -> np.ndarray:
    """float32 [n, C] of integers in -4..4: with small-integer weights every product and sum is exact."""
    return np.random.default_rng(seed).integers(-4, 5, (n, C)).astype(np.float32)


def first_mismatch(isa: str, calls: dict) -> str | None:
    """None when every call {name: fn(isa) -> array} gives with `isa` the floats it gives with 'portable', else what
    differed first (for `first_sound`)."""
    for name, call in calls.items():
        what = mismatch(name, call(isa), call("portable"))
        if what is not None:
            return what
    return None


def mismatch(name: str, got, want) -> str | None:
    """None when `got` and `want` are the same floats, else what differs (for `first_sound`)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        return None
    if got.shape != want.shape:
        return f"{name}: shape {got.shape}, expected {want.shape}"
    bad = np.flatnonzero(got.view(np.uint32).reshape(-1) != want.view(np.uint32).reshape(-1))
    return (f"{name}: {bad.size} of {got.size} outputs differ, e.g. {float(got.reshape(-1)[bad[0]]):.9g} against "
            f"{float(want.reshape(-1)[bad[0]]):.9g}")
