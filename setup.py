"""The optional compiled kernels (MXFP4 experts, bf16 matrices); everything else is in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and packed experts fall back to
NumPy (dequantise, then BLAS), bf16 matrices to widening then BLAS;
`kimi_explore.weights.mxfp4_matvec.AVAILABLE` and `bf16_matvec.AVAILABLE` tell which.
"""

from setuptools import Extension, setup

KERNELS = ("_mxfp4_matvec", "_bf16_matvec")  # each includes _kernel_isa.h (run-time SIMD choice)
setup(ext_modules=[Extension(f"kimi_explore.weights.{name}", [f"kimi_explore/weights/{name}.c"],
                             depends=["kimi_explore/weights/_kernel_isa.h"], extra_compile_args=["-O3"], optional=True)
                   for name in KERNELS])
