"""MXFP4 (compressed-tensors `mxfp4-pack-quantized`) dequantisation of the routed experts.

For a logical weight W [rows, cols] (nn.Linear [out, in]):

    byte  = weight_packed[r, c // 2]                 uint8 [rows, cols/2]
    code  = byte & 0xF if c is even else byte >> 4   LOW nibble = EVEN column
    value = (-1)^(code >> 3) * [0, .5, 1, 1.5, 2, 3, 4, 6][code & 7]     E2M1
    W[r, c] = value * 2^(weight_scale[r, c // 32] - 127)                 E8M0 scale per 32 columns

Every result is exactly representable in bf16 and float32. Scale byte 255 (NaN in the OCP MX spec) is
2^128, which the release computes in bf16 (`2.0 ** scale_exp`): inf, so its group's zeros are NaN and
the rest inf. Every route here takes the factor as a float32 (then widens it), so float64 runs agree.
"""

from __future__ import annotations

import numpy as np

from .._xp import array_namespace
from ..backend import HOST_THREADS, on_host
from .workspace import run_parts

GROUP = 32
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


# byte -> (value of the low nibble, value of the high nibble): the LOW nibble is the EVEN column
PAIRS = np.stack([E2M1[np.arange(256) & 0x0F], E2M1[np.arange(256) >> 4]], axis=1)  # [256, 2]
_CHUNK = 1 << 16  # bytes per step on the host: index and output stay in cache
_THREADED_BYTES = 1 << 23  # host: bigger jobs are split over the pool's threads (take and multiply release the GIL)


def pair_table(xp, dtype):
    """The byte -> two-values table on `xp`: [256, 2]; on the host, for float32, one uint64 per byte
    (one 8-byte gather per byte; a GPU gathers the [256, 2] rows without reinterpreting dtypes)."""
    table = PAIRS.astype(dtype)
    if on_host(xp) and np.dtype(dtype) == np.float32:
        table = table.view(np.uint64).reshape(256)
    return xp.asarray(table)


def dequantize(packed, scale, out=None, dtype=np.float32, pool=None, table=None):
    """packed: uint8 [..., rows, cols/2]; scale: uint8 [..., rows, cols/32] -> dtype [..., rows, cols].

    The one dequantiser (`naive_dequantize` is its float64 reference, tested bit for bit): a table
    gather turns each byte into its two values, then each group of 32 is multiplied by its power
    of two 2^(scale - 127) (exact: every result is the IEEE product). NumPy or CuPy, from the
    arrays' namespace. On the host the bytes go 64 KiB at a time (index and output stay in
    cache), split over `pool`'s threads when big (None: a pool just for the call); a GPU does all
    at once. `out`: a result buffer; `table`: `pair_table(xp, dtype)`, to skip building it.
    """
    xp = array_namespace(packed)
    if packed.shape[-1] % (GROUP // 2) or scale.shape != packed.shape[:-1] + (packed.shape[-1] // (GROUP // 2),):
        raise ValueError(f"packed {packed.shape} / scale {scale.shape}: expected [..., cols/2] / [..., cols/32] "
                         f"(whole groups of {GROUP})")
    want = packed.shape[:-1] + (2 * packed.shape[-1],)
    if out is not None and (out.shape != want or out.dtype != np.dtype(dtype)):
        raise ValueError(f"out: expected {np.dtype(dtype).name} {want}, got {out.dtype} {out.shape}")
    if out is not None and not out.flags.c_contiguous:  # the work below writes through flat views
        out[...] = dequantize(packed, scale, None, dtype, pool, table)
        return out
    table = pair_table(xp, dtype) if table is None else table
    src = xp.ascontiguousarray(packed).reshape(-1)
    fac = xp.ldexp(xp.ones(scale.size, dtype=np.float32),  # float32: byte 255 is inf in float64 too (module docstring)
                   xp.ascontiguousarray(scale).reshape(-1).astype(xp.int32) - 127).astype(dtype, copy=False)
    if not on_host(xp):  # one gather of value pairs, one multiply
        vals = table[src.astype(xp.int32)]  # [n, 2]
        groups = vals.reshape(-1, GROUP)
        groups *= fac[:, None]
        if out is None:
            return vals.reshape(want)
        out[...] = vals.reshape(want)
        return out
    out = np.empty(want, dtype) if out is None else out
    flat = out.reshape(-1)
    dst = flat.view(np.uint64) if table.ndim == 1 else flat.reshape(-1, 2)

    def run(lo: int, hi: int) -> None:
        idx = np.empty(min(_CHUNK, hi - lo), np.intp)
        for a in range(lo, hi, _CHUNK):
            n = min(_CHUNK, hi - a)
            np.copyto(idx[:n], src[a : a + n], casting="unsafe")
            np.take(table, idx[:n], axis=0, out=dst[a : a + n], mode="wrap")  # bounds are known: 0..255
            groups = flat[2 * a : 2 * (a + n)].reshape(-1, GROUP)
            groups *= fac[a // 16 : (a + n) // 16, None]

    workers = 1 if src.size < _THREADED_BYTES else HOST_THREADS
    step = max(1, -(-src.size // (workers * _CHUNK))) * _CHUNK  # whole chunks per worker (chunks are whole groups)
    run_parts(pool, run, [(a, min(src.size, a + step)) for a in range(0, max(src.size, 1), step)])
    return out


def naive_dequantize(packed, scale) -> np.ndarray:
    """Float64 reference, one element at a time, straight from the rule above."""
    packed, scale = np.asarray(packed), np.asarray(scale)
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    W = np.empty((rows, cols))
    for r in range(rows):
        for c in range(cols):
            byte = int(packed[r, c // 2])
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            value = (-1.0 if code & 8 else 1.0) * mags[code & 7]
            e = int(scale[r, c // GROUP]) - 127
            W[r, c] = value * (2.0**e if e < 128 else np.inf)  # 2^128: beyond float32, as in the release
    return W


def quantize(W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round a float [rows, cols] matrix to MXFP4 (for making test checkpoints, not for accuracy).

    The scale of each 32-group is the power of two that maps the group's max |w| to <= 6.
    """
    W = np.asarray(W, dtype=np.float64)
    rows, cols = W.shape
    g = W.reshape(rows, cols // GROUP, GROUP)
    amax = np.maximum(np.abs(g).max(axis=-1), 1e-30)
    e = np.ceil(np.log2(amax / 6.0)).astype(np.int64)
    scale = np.clip(e + 127, 1, 254).astype(np.uint8)
    x = g / np.exp2(scale.astype(np.float64) - 127)[..., None]
    mags = np.abs(E2M1[:8]).astype(np.float64)
    idx = np.abs(np.abs(x)[..., None] - mags).argmin(axis=-1)
    codes = (idx | np.where(x < 0, 8, 0)).astype(np.uint8).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, scale
