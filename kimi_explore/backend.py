"""The array backend: NumPy on the CPU, CuPy on a GPU, chosen once and bound to the weights.

All decoder math goes through the `xp` namespace the weights carry, so the same code runs on
both. `device="auto"` takes CuPy only when it imports AND `cupy.is_available()` says a device is
usable (an installed CuPy on a machine without a driver imports fine, then fails on the first
allocation).
"""

from __future__ import annotations

import os
import types

import numpy as np

from .errors import BackendError

DEVICES = ("auto", "cpu", "gpu")
DTYPES = {"float32": np.float32, "float64": np.float64}


def _cupy_status():
    """(cupy module or None, reason it is unusable or None)."""
    try:
        import cupy
    except ImportError as e:
        return None, f"CuPy is not installed ({e}); install the 'cuda12' or 'cuda13' extra"
    try:
        if not cupy.is_available():
            return None, "CuPy is installed but reports no usable CUDA device (cupy.is_available() is False)"
    except Exception as e:  # noqa: BLE001 - CUDA runtime errors have no common base we can name
        return None, f"CuPy is installed but querying the CUDA device failed: {e}"
    return cupy, None


def resolve_device(device: str):
    """Return (xp, device_name) for 'auto' | 'cpu' | 'gpu'."""
    if device not in DEVICES:
        raise BackendError(f"device={device!r} is not one of {', '.join(repr(d) for d in DEVICES)}")
    if device == "cpu":
        return np, "cpu"
    cupy, why = _cupy_status()
    if cupy is not None:
        return cupy, "gpu"
    if device == "gpu":
        raise BackendError(f"device='gpu' was requested but no GPU can be used: {why}")
    return np, "cpu"


def resolve_dtype(dtype) -> type:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise BackendError(f"dtype={dtype!r} is not one of {', '.join(repr(d) for d in DTYPES)}")
    return DTYPES[name]


def to_numpy(a) -> np.ndarray:
    """A host NumPy array (a copy when `a` lives on a GPU)."""
    if isinstance(a, np.ndarray):
        return a
    get = getattr(a, "get", None)
    return get() if get is not None else np.asarray(a)


def on_host(x) -> bool:
    """Whether `x` (an array namespace, or an array) is on the host: THE device test of the package.

    True for NumPy and NumPy arrays (and anything not CuPy), False for CuPy and its arrays.
    """
    if isinstance(x, types.ModuleType):
        return x is np
    return not type(x).__module__.startswith("cupy")  # (without importing CuPy)


def gpu_available() -> bool:
    return _cupy_status()[0] is not None


HOST_THREADS = max(1, min(4, os.cpu_count() or 1))  # host work split over threads (the kernels release the GIL)
