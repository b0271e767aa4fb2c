"""ggml tensor types: their block sizes, and decoding them to float (F32, F16, BF16, Q8_0, MXFP4 here).

Every ggml type stores blocks along a row (ne[0]): `TYPES[id] = (name, elements per block, bytes
per block)`. Read here, in NumPy, exactly:

    F32, F64, F16        IEEE values (F16 -> float32 is exact)
    BF16                 the high half of a float32 (exact)
    Q8_0                 34-byte blocks of 32: d (F16) | q[32] (int8);          x = f32(d) * q
    MXFP4                17-byte blocks of 32: e (E8M0) | qs[16], byte j holding the code of value j
                         in its LOW nibble and of value j + 16 in its HIGH nibble;
                         x = E2M1(code) * 2^(e - 127)   (ggml writes it as kvalues x 2^(e - 128),
                         with kvalues = 2 x E2M1: the same numbers)

MXFP4's codes and scale bytes are those of compressed-tensors (`mxfp4.py`); only the nibble order
and the block interleaving differ (CT: byte j of a group holds values 2j (low) and 2j + 1 (high),
scales in a separate [r, c/32] array). So `dequantize_mxfp4` gives bit for bit the values
`mxfp4.dequantize` gives for the same weights (every value is an exact IEEE product), and
`mxfp4_blocks_from_packed` / `packed_from_mxfp4_blocks` convert losslessly.

Other types (Q4_K, Q6_K, IQ*, ...) go through the optional `gguf` package's NumPy dequantisers
(`pip install "kimi-explore[gguf]"`); without it they are refused with that hint.
"""

from __future__ import annotations

import numpy as np

from .._xp import array_namespace
from . import mxfp4

# id: (name, elements per block, bytes per block), as ggml.h / gguf's GGML_QUANT_SIZES (test_gguf compares)
TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
TYPE_IDS = {name: i for i, (name, _, _) in TYPES.items()}
SIZES = {name: (block, nbytes) for name, block, nbytes in TYPES.values()}
EXACT = {"F32": np.float32, "F64": np.float64, "F16": np.float16}  # IEEE types read as they are
FLOATS = ("F32", "F64", "F16", "BF16")  # read exactly (no quantisation)
MXFP4_BLOCK = 17  # bytes per 32 values: 1 E8M0 scale byte + 16 bytes of codes

__all__ = ["MXFP4_BLOCK", "SIZES", "TYPES", "TYPE_IDS", "dequantize", "dequantize_mxfp4", "mxfp4_blocks_from_packed",
           "naive_dequantize_mxfp4", "packed_from_mxfp4_blocks"]


def dequantize(raw: np.ndarray, type_name: str, shape: tuple, dtype=np.float32, out: np.ndarray | None = None):
    """The values of a tensor from its bytes: raw uint8 [n bytes], ggml type, NumPy shape (C order) -> dtype."""
    out = np.empty(shape, dtype) if out is None else out
    rows = raw.reshape(-1, _row_bytes(type_name, shape[-1]))
    if type_name in EXACT:
        out[...] = rows.view(EXACT[type_name]).reshape(shape)
    elif type_name == "BF16":
        out[...] = (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    elif type_name == "Q8_0":
        b = rows.reshape(-1, 34)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
        out[...] = (d * b[:, 2:].view(np.int8).astype(np.float32)).reshape(shape)
    elif type_name == "MXFP4":
        dequantize_mxfp4(rows.reshape(shape[:-1] + (shape[-1] // 32, MXFP4_BLOCK)), out=out, dtype=dtype)
    else:
        out[...] = _via_gguf(rows, type_name).reshape(shape)
    return out


def _row_bytes(type_name: str, n: int) -> int:
    block, nbytes = SIZES[type_name]
    return n // block * nbytes


def _via_gguf(rows: np.ndarray, type_name: str) -> np.ndarray:
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize
    except ImportError:
        raise ImportError(f"ggml type {type_name} is read through the optional `gguf` package's dequantisers; "
                          "install it: pip install 'kimi-explore[gguf]' (F32, F16, BF16, Q8_0 and MXFP4 need nothing)") from None
    return gguf_dequantize(np.ascontiguousarray(rows), GGMLQuantizationType[type_name])


def dequantize_mxfp4(blocks, out=None, dtype=np.float32, table=None):
    """ggml MXFP4 blocks uint8 [..., G, 17] -> dtype [..., 32 G] (NumPy or CuPy, from the array).

    One table lookup of every code and one multiply by its block's power of two: the same IEEE
    products as `mxfp4.dequantize` (`naive_dequantize_mxfp4` is the float64 reference).
    table: the 16 E2M1 values in `dtype` where the blocks are (made here when None; a caller that
    dequantises every token keeps one, so that a GPU gets no host -> device copy per call).
    """
    xp = array_namespace(blocks)
    if blocks.shape[-1] != MXFP4_BLOCK:
        raise ValueError(f"blocks {blocks.shape}: expected [..., groups, {MXFP4_BLOCK}] ggml MXFP4 blocks")
    want = blocks.shape[:-2] + (blocks.shape[-2] * 32,)
    if out is not None and (out.shape != want or out.dtype != np.dtype(dtype)):
        raise ValueError(f"out: expected {np.dtype(dtype).name} {want}, got {out.dtype} {out.shape}")
    qs = blocks[..., 1:]
    codes = xp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(xp.intp)  # [..., G, 32]: values j, then j + 16
    vals = (xp.asarray(mxfp4.E2M1.astype(dtype)) if table is None else table)[codes]
    fac = xp.ldexp(xp.ones(blocks.shape[:-1], dtype=np.float32), blocks[..., 0].astype(xp.int32) - 127)  # float32:
    vals *= fac.astype(dtype, copy=False)[..., None]  # byte 255 is inf in float64 too, as in `mxfp4.dequantize`
    if out is None:
        return vals.reshape(want)
    out[...] = vals.reshape(want)
    return out


def naive_dequantize_mxfp4(blocks) -> np.ndarray:
    """Float64 reference for ONE row of blocks [G, 17] -> [32 G], one value at a time from the rule above."""
    blocks = np.asarray(blocks)
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    row = np.empty(32 * blocks.shape[0])
    for g, blk in enumerate(blocks):
        for j in range(32):
            byte = int(blk[1 + j % 16])
            code = byte & 0xF if j < 16 else byte >> 4
            row[32 * g + j] = (-1.0 if code & 8 else 1.0) * mags[code & 7] * 2.0 ** (int(blk[0]) - 127)
    return row


def mxfp4_blocks_from_packed(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """compressed-tensors MXFP4 (packed [..., c/2], scale [..., c/32]) -> ggml blocks [..., c/32, 17], losslessly."""
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1, 32))  # [..., G, 32]
    out = np.empty(codes.shape[:-1] + (MXFP4_BLOCK,), np.uint8)
    out[..., 0] = scale
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out


def packed_from_mxfp4_blocks(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml blocks [..., G, 17] -> compressed-tensors (packed [..., 16 G], scale [..., G]), losslessly."""
    qs = blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(blocks.shape[:-2] + (-1,))  # [..., 32 G]
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), np.ascontiguousarray(blocks[..., 0])
