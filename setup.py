"""The optional compiled MXFP4 kernel; everything else is in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and packed experts fall back to
NumPy (dequantise, then BLAS); `kimi_explore.weights.mxfp4_matvec.AVAILABLE` tells which.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kimi_explore.weights._mxfp4_matvec", ["kimi_explore/weights/_mxfp4_matvec.c"],
                             extra_compile_args=["-O3"], optional=True)])
