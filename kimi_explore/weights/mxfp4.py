"""MXFP4 (compressed-tensors `mxfp4-pack-quantized`) dequantisation of the routed experts.

For a logical weight W [rows, cols] (nn.Linear [out, in]):

    byte  = weight_packed[r, c // 2]                 uint8 [rows, cols/2]
    code  = byte & 0xF if c is even else byte >> 4   LOW nibble = EVEN column
    value = (-1)^(code >> 3) * [0, .5, 1, 1.5, 2, 3, 4, 6][code & 7]     E2M1
    W[r, c] = value * 2^(weight_scale[r, c // 32] - 127)                 E8M0 scale per 32 columns

Every result is exactly representable in bf16 and float32.
"""

from __future__ import annotations

import numpy as np

GROUP = 32
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize(packed, scale, out=None, dtype=np.float32):
    """packed: uint8 [..., rows, cols/2]; scale: uint8 [..., rows, cols/32] -> [..., rows, cols].

    Works on NumPy or CuPy arrays alike; writes into `out` when given.
    """
    from .._xp import array_namespace

    xp = array_namespace(packed)
    lut = xp.asarray(E2M1, dtype=dtype)
    lead, half = packed.shape[:-1], packed.shape[-1]
    codes = xp.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(lead + (2 * half,))
    vals = lut[codes]
    exp = scale.astype(xp.int32) - 127
    factors = xp.ldexp(xp.ones(exp.shape, dtype=dtype), exp)  # exact powers of two
    vals = vals.reshape(lead + (scale.shape[-1], GROUP)) * factors[..., None]
    vals = vals.reshape(lead + (2 * half,))
    if out is None:
        return vals
    out[...] = vals
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
            W[r, c] = value * 2.0 ** (int(scale[r, c // GROUP]) - 127)
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
