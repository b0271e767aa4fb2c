"""bf16-resident weight matrices (`weight_dtype="bfloat16"`): the compiled kernel, or widened per use.

A `Bf16Matrix` keeps a [rows, cols] matrix as its bf16 bit patterns (uint16, on the weights'
device) and behaves, for the decoder, like the float32 matrix it stands for:

    x W^T        `W.matmul_rows(x)`, x [n, C] rows (the sequence path, `ops.linear`): `bf16_matmat` on the
                 kernel route, else the widened matrix through BLAS
    W @ x        kernel route (host, float32, x a vector, `bf16_matvec` built; the default there):
                 the compiled matvec reads the bits once (float32 sums in another order than BLAS);
                 widening route (otherwise, or kernel=False): widen all of W into a shared scratch
                 buffer, then the same `scratch @ x` call as the float32 matrix (bit-identical)
    W[rows]      widen only those rows (embedding lookups)
    np.asarray(W) the widened matrix on the host (for the float64 reference code)

Widening bf16 -> float32 is exact: the bf16 bits are the top half of the float32 bits. We write
them into the high uint16 of each float32 of a zero-initialised scratch buffer (little-endian),
so one strided copy per use and the low halves stay zero forever.

Why the WHOLE matrix and one matmul, rather than row blocks: BLAS gemv results depend on the
row count (the kernel groups rows and threads differently), so a row-blocked product differs
from the float32-resident one in the last bits. Widening the whole matrix into a contiguous
buffer of the same shape makes the matmul call identical, hence the logits bit-identical. The
price is one scratch buffer the size of the largest bf16 matrix (shared by all of them) and the
widening pass itself, which on a CPU costs more than the float32 matmul it feeds; on a GPU the
widening runs at memory bandwidth. Hence the kernel route on the CPU (`bf16_matvec`): it reads
the 2-byte bits once and needs no scratch, at the price of another float32 summation order.
"""

from __future__ import annotations

import sys

import numpy as np

from .._xp import array_namespace
from ..backend import to_numpy
from . import bf16_matvec

__all__ = ["Bf16Array", "Bf16Matrix", "WideningScratch", "widen_bits"]

if sys.byteorder != "little":  # pragma: no cover - every CUDA host and x86/ARM Linux is little-endian
    raise ImportError("kimi_explore.weights.bf16_weights assumes a little-endian host (float32 high half at the odd uint16)")


def widen_bits(bits, dtype=np.float32):
    """bf16 bit patterns (uint16, any shape) -> float32 (or float64) values, exactly."""
    xp = array_namespace(bits)
    f32 = (bits.astype(xp.uint32) << 16).view(xp.float32)
    return f32 if np.dtype(dtype) == np.float32 else f32.astype(dtype)


class WideningScratch:
    """One zero-initialised float32 buffer shared by every `Bf16Matrix` of a model, grown on demand."""

    def __init__(self, xp):
        self.xp = xp
        self._buf = xp.zeros(0, xp.float32)

    @property
    def nbytes(self) -> int:
        return int(self._buf.nbytes)

    def reserve(self, n: int) -> None:
        """Make room for n elements now (so the memory is there, and reported, from load time on)."""
        if self._buf.size < n:
            self._buf = None  # free the old buffer before allocating the larger one
            self._buf = self.xp.zeros(n, self.xp.float32)

    def widen(self, bits):
        """A float32 view of `bits` widened, shaped like `bits` and contiguous; valid until the next call."""
        n = bits.size
        self.reserve(n)
        out = self._buf[:n]
        out.view(self.xp.uint16)[1::2] = bits.reshape(-1)
        return out.reshape(bits.shape)


class Bf16Array:
    """bf16 bits standing for an array of `dtype` values: indexing and `np.asarray` widen what they return.

    bits: uint16 [...] (numpy or cupy)
    """

    def __init__(self, bits, dtype=np.float32):
        if bits.dtype != np.uint16:
            raise TypeError(f"{type(self).__name__}: expected uint16 bf16 bits, got {bits.dtype} {tuple(bits.shape)}")
        self.bits = bits
        self.dtype = np.dtype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)

    @property
    def ndim(self) -> int:
        return self.bits.ndim

    @property
    def nbytes(self) -> int:
        """Resident bytes (the bf16 bits)."""
        return int(self.bits.nbytes)

    def reshape(self, *shape) -> Bf16Array:
        """A view with another shape (still bits: e.g. `w.reshape(-1)[::n]` widens only what it picks)."""
        return Bf16Array(self.bits.reshape(*shape), self.dtype)

    def __getitem__(self, idx):
        return widen_bits(self.bits[idx], self.dtype)

    def __array__(self, dtype=None, copy=None):
        a = to_numpy(widen_bits(self.bits, self.dtype))
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, widened to {self.dtype.name})"


class Bf16Matrix(Bf16Array):
    """A 2-D weight held as bf16 bits; `@`, row indexing and `np.asarray` give `dtype` values.

    bits:    uint16 [rows, cols] (numpy or cupy)
    kernel:  None (default) = the compiled matvec whenever it can run (host, float32, built) and x
             is a vector; False = always widen (bit-identical to the float32 matrix); True requires it
    pool:    a callable giving the executor the kernel's rows run on (the model's `workspace.pool`)
    """

    def __init__(self, bits, scratch: WideningScratch, dtype=np.float32, kernel: bool | None = None, pool=None):
        if bits.dtype != np.uint16 or bits.ndim != 2:
            raise TypeError(f"Bf16Matrix: expected uint16 [rows, cols] bf16 bits, got {bits.dtype} {tuple(bits.shape)}")
        super().__init__(bits, dtype)
        self.scratch = scratch
        self.kernel, self._pool = kernel, pool
        if kernel and not self.can_use_kernel():
            raise ValueError(f"Bf16Matrix(kernel=True) needs host C-contiguous bits, float32 and the compiled kernel (built: "
                             f"{bf16_matvec.AVAILABLE}); got {type(bits).__module__} bits, {self.dtype.name}")

    def can_use_kernel(self) -> bool:
        return bf16_matvec.runs(array_namespace(self.bits), self.dtype) and self.bits.flags.c_contiguous

    @property
    def uses_kernel(self) -> bool:
        """Whether `W @ vector` runs the compiled kernel (else the widening route)."""
        return self.kernel is not False and self.can_use_kernel()

    @property
    def uses_scratch(self) -> bool:
        """Whether its products widen into the shared scratch (the widening route in float32; float64 widens afresh)."""
        return self.dtype == np.float32 and not self.uses_kernel

    def widened(self):
        """The full matrix in `dtype` (float32: a view of the shared scratch, valid until its next use)."""
        if self.dtype == np.float32:
            return self.scratch.widen(self.bits)
        return widen_bits(self.bits, self.dtype)

    def matmul_rows(self, x):
        """x [..., C] -> [..., R] = x W^T: the kernel's multi-row entry on the kernel route (float32 rows),
        else the widened matrix through one BLAS call."""
        if x.ndim == 2 and x.dtype == np.float32 and self.uses_kernel:
            return bf16_matvec.bf16_matmat(self.bits, x, pool=None if self._pool is None else self._pool())
        return x @ self.widened().T

    def __matmul__(self, x):
        if getattr(x, "ndim", 0) == 1 and x.dtype == np.float32 and self.uses_kernel:
            return bf16_matvec.bf16_matvec(self.bits, x, pool=None if self._pool is None else self._pool())
        return self.widened() @ x
