"""`array_namespace(a)`: numpy for host arrays, cupy for device arrays, without importing cupy."""

from __future__ import annotations

import numpy as np


def array_namespace(a):
    if isinstance(a, np.ndarray) or np.isscalar(a):
        return np
    mod = type(a).__module__
    if mod.startswith("cupy"):
        import cupy

        return cupy
    return np
