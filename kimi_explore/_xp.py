"""`array_namespace(a)`: numpy for host arrays, cupy for device arrays, without importing cupy."""

from __future__ import annotations

import numpy as np


def array_namespace(a):
    if type(a) is np.ndarray or isinstance(a, (np.ndarray, np.generic, int, float)):
        return np
    mod = type(a).__module__
    if mod.startswith("cupy"):
        import cupy

        return cupy
    return np
