"""Norms and activations shared by every component, plus the dense (layer-0 / shared-expert) MLP.

Every function takes the array namespace from its input, so it runs on NumPy or CuPy. Scalars are
Python floats: a NumPy float64 scalar would silently promote a float32 vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .._xp import array_namespace
from ..backend import on_host
from . import token_ops
from .sequence_ops import situ_and_mul_rows


def linear(x, weight):
    """Rows through a weight: x [..., C], weight [R, C] -> [..., R] (`x @ weight^T`), the sequence form of
    `weight @ x`. A weight object with its own `matmul_rows` (bf16 bits: `Bf16Matrix`) multiplies its way."""
    own = getattr(weight, "matmul_rows", None)
    return own(x) if own is not None else x @ weight.T


def sigmoid(x, one=1.0):
    """1 / (1 + exp(-x)). one: 1 as a 0-d array of x's dtype, if the caller keeps one (a cheaper operand
    than the Python float, the same result). A host float32 vector takes the compiled step (`token_ops.sigmoid`)."""
    if x.ndim == 1 and token_ops.runs(x):
        return token_ops.sigmoid(x)
    xp = array_namespace(x)
    return one / (one + xp.exp(-x))


def rms_norm(x, weight, eps: float):
    """KimiRMSNorm: `weight * (x / sqrt(mean(x^2) + eps))` over the last axis.

    HF normalises in fp32, casts back to the activation dtype, then multiplies by the weight; in a
    float32/float64 decoder the cast is the identity.
    """
    n = x.shape[-1]
    if x.ndim <= 2:  # host float32, a vector or rows: the token form's compiled call (it checks the weight's width)
        rows = token_ops.in_c_order(x)  # (MLA's latents are column slices)
        if token_ops.runs(rows, weight):
            return token_ops.rms_norm(rows, weight, eps)
    if x.ndim == 1 and (type(x) is np.ndarray or on_host(array_namespace(x))):  # one scalar, on the host
        return x * (weight * (1.0 / math.sqrt(float(x @ x) / n + eps)))
    xp = array_namespace(x)
    # rows, or a GPU (where float() would wait for the device): everything stays in arrays
    return x * (weight / xp.sqrt((x * x).sum(axis=-1, keepdims=True) * (1.0 / n) + eps))


def situ_and_mul(gate_up, beta: float, linear_beta: float | None, inv_caps=None, consts=None):
    """SiTU-GLU on the concatenation [gate | up] (last axis): `b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2)`.

    Trap: the sigmoid reads the UNCAPPED gate. `linear_beta=None` leaves `up` uncapped.
    |output| <= beta * linear_beta.
    inv_caps: optional [2n] = [1/beta]*n + [1/linear_beta]*n in gate_up's dtype (`situ_inv_caps`):
    both tanh in one call, bit for bit the same result (also broadcast to gate_up's shape: cheaper).
    consts: optional (1, beta * linear_beta) as 0-d arrays of gate_up's dtype, with inv_caps (the same result).
    A host float32 gate_up takes the compiled step (`token_ops.situ`: the same formula in double, rounded once).
    """
    if token_ops.runs(gate_up):
        return token_ops.situ(gate_up, beta, linear_beta)
    xp = array_namespace(gate_up)
    n = gate_up.shape[-1] // 2
    g, u = gate_up[..., :n], gate_up[..., n:]
    if inv_caps is not None and linear_beta is not None:
        one, cap = (1.0, beta * linear_beta) if consts is None else consts
        t = xp.tanh(gate_up * inv_caps)
        den = xp.negative(g)  # 1 + exp(-g), in place: one new array (g may be a strided view)
        xp.exp(den, out=den)
        den += one
        out = xp.divide(t[..., :n], den, out=den)
        out *= t[..., n:]
        out *= cap
        return out
    a = xp.tanh(g * (1.0 / beta)) / (1.0 + xp.exp(-g))  # tanh-capped gate times sigmoid(uncapped gate)
    if linear_beta is None:
        return a * u * beta
    return a * xp.tanh(u * (1.0 / linear_beta)) * (beta * linear_beta)


def situ_inv_caps(xp, n: int, beta: float, linear_beta: float, dtype):
    """[2n]: 1/beta for the gate half, 1/linear_beta for the up half (each rounded to dtype once, as
    a Python scalar times an array is)."""
    return xp.asarray([1.0 / beta] * n + [1.0 / linear_beta] * n, dtype=dtype)


def naive_situ_and_mul(gate_up, beta: float, linear_beta: float | None):
    """Float64 reference: the SiTU formula element by element, written as in the tech report (eq. 12)."""

    gu = np.asarray(gate_up, dtype=np.float64)
    n = gu.shape[-1] // 2
    out = np.empty(gu.shape[:-1] + (n,))
    for idx in np.ndindex(out.shape):
        g, u = gu[idx[:-1] + (idx[-1],)], gu[idx[:-1] + (idx[-1] + n,)]
        a = beta * math.tanh(g / beta) * (1.0 / (1.0 + math.exp(-g)))
        out[idx] = a * (u if linear_beta is None else linear_beta * math.tanh(u / linear_beta))
    return out


def softmax(x, axis: int = -1):
    e = array_namespace(x).exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@dataclass
class DenseMlpWeights:
    """`down(SiTU([gate(x) | up(x)]))`: the layer-0 MLP and the fused shared experts.

    gate_up_proj: [2 I, d]  gate_proj rows, then up_proj rows (fused at load: both read x)
    down_proj:    [d, I]
    """

    kind: ClassVar[str] = "dense"
    gate_up_proj: object
    down_proj: object


def dense_mlp(x, w: DenseMlpWeights, beta: float, linear_beta: float | None):
    """x: [d] -> [d]."""
    return w.down_proj @ situ_and_mul(w.gate_up_proj @ x, beta, linear_beta)


def dense_mlp_sequence(x, w: DenseMlpWeights, beta: float, linear_beta: float | None):
    """x: [T, d] -> [T, d], every row as `dense_mlp` (each weight read once for all rows)."""
    act = lambda gu: situ_and_mul(gu, beta, linear_beta)  # noqa: E731
    return linear(situ_and_mul_rows(linear(x, w.gate_up_proj), beta, linear_beta, act), w.down_proj)
