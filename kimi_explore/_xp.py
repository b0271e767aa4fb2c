"""`array_namespace(a)`: numpy for host arrays, cupy for device arrays, without importing cupy.

DEVICE_TYPES: {array type: its array module} for device arrays that are not CuPy's (the tests'
strict stand-in device, registered by `backend.stand_in_device`); `backend.on_host` and
`array_namespace` treat them as CuPy arrays.
"""

from __future__ import annotations

import numpy as np

DEVICE_TYPES: dict = {}


def array_namespace(a):
    if type(a) is np.ndarray or isinstance(a, (np.ndarray, np.generic, int, float)):
        return np
    ns = DEVICE_TYPES.get(type(a))
    if ns is not None:
        return ns
    mod = type(a).__module__
    if mod.startswith("cupy"):
        import cupy

        return cupy
    return np
