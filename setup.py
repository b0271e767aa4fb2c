"""The optional compiled kernels (MXFP4 experts, bf16 matrices, the KDA recurrence, the sequence path's
element-wise ops); everything else is in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and packed experts fall back to
NumPy (dequantise, then BLAS), bf16 matrices to widening then BLAS, the KDA sequence path to its
chunked form, the sequence path's exp/sigmoid/SiTU/softmax and the token path's small steps to NumPy;
`kimi_explore.weights.mxfp4_matvec.AVAILABLE`, `bf16_matvec.AVAILABLE`, `kimi_explore.model.kda_recurrence.AVAILABLE`
`kimi_explore.model.sequence_ops.AVAILABLE` and `kimi_explore.model.token_ops.AVAILABLE` tell which.
"""

from setuptools import Extension, setup

# (every kernel includes _kernel_isa.h; the two weights kernels _panels_avx2.h and _panels_avx512.h)
HEADERS = ["kimi_explore/weights/_kernel_isa.h", "kimi_explore/weights/_panels_avx2.h", "kimi_explore/weights/_panels_avx512.h"]
KERNELS = ("weights._mxfp4_matvec", "weights._bf16_matvec", "model._kda_recurrence", "model._sequence_ops", "model._token_ops")
setup(ext_modules=[Extension(f"kimi_explore.{name}", [f"kimi_explore/{name.replace('.', '/')}.c"],
                             depends=HEADERS, extra_compile_args=["-O3"], optional=True)
                   for name in KERNELS])
