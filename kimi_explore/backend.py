"""The array backend: NumPy on the CPU, CuPy on a GPU, chosen once and bound to the weights.

All decoder math goes through the `xp` namespace the weights carry, so the same code runs on
both. `device="auto"` takes CuPy only when it imports AND `cupy.is_available()` says a device is
usable (an installed CuPy on a machine without a driver imports fine, then fails on the first
allocation).
"""

from __future__ import annotations

import contextlib
import os
import types

import numpy as np

from . import _xp
from .errors import BackendError

DEVICES = ("auto", "cpu", "gpu")
DTYPES = {"float32": np.float32, "float64": np.float64}


_STAND_IN: list = []  # the active stand-in device module (stand_in_device), innermost last


@contextlib.contextmanager
def stand_in_device(xp):
    """Within the block, device "gpu" (and "auto") resolves to `xp`, a CuPy-shaped array module whose
    arrays (`xp.ndarray`) count as device arrays for `on_host` and `array_namespace`.

    For tests on machines without a GPU (tests/strict_device.py: host storage, CuPy's strictness at the
    host border, transfers counted). It is not a GPU run: `bench/gpu_check.sh` is, where a GPU is at hand.
    """
    kind = xp.ndarray
    had = _xp.DEVICE_TYPES.get(kind)
    _xp.DEVICE_TYPES[kind] = xp
    _STAND_IN.append(xp)
    try:
        yield xp
    finally:
        _STAND_IN.pop()
        if had is None:
            del _xp.DEVICE_TYPES[kind]
        else:
            _xp.DEVICE_TYPES[kind] = had


def _cupy_status():
    """(cupy module or None, reason it is unusable or None)."""
    if _STAND_IN:
        return _STAND_IN[-1], None
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
    try:  # (np.dtype(None) is float64: None is refused, not read as a double-precision model)
        name = dtype if isinstance(dtype, str) else None if dtype is None else np.dtype(dtype).name
    except TypeError:
        name = None
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

    True for NumPy and NumPy arrays (and anything not CuPy), False for CuPy and its arrays (and a
    stand-in device's, `stand_in_device`).
    """
    if isinstance(x, types.ModuleType):
        return x is np
    t = type(x)
    return not t.__module__.startswith("cupy") and t not in _xp.DEVICE_TYPES  # (without importing CuPy)


def gpu_available() -> bool:
    return _cupy_status()[0] is not None


_BLAS_THREAD_SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads")


def set_blas_threads(n: int) -> bool:
    """Run the host BLAS on n threads in this process from now on: what OPENBLAS_NUM_THREADS does before
    NumPy loads, after it (for OpenBLAS, which NumPy's wheels bundle, found among this process's mapped
    libraries on Linux). Whether it could (False: another BLAS, or no /proc)."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "openblas" in line.lower() and " /" in line})
    except OSError:
        return False
    done = False
    for path in paths:
        lib = ctypes.CDLL(path)
        setter = next((getattr(lib, s) for s in _BLAS_THREAD_SETTERS if hasattr(lib, s)), None)
        if setter is not None:
            setter(int(n))
            done = True
    return done


HOST_THREADS = max(1, min(4, os.cpu_count() or 1))  # host work split over threads (the kernels release the GIL)
