"""Block Attention Residuals: mix the residual stream with saved block checkpoints by a learned softmax.

Sources V = [b_0, ..., b_{n-1}, prefix_sum]: the block stack in push order, the current running sum
LAST. With the score vector w = norm.weight * proj.weight[0] (the GGUF `*_res_score` tensor):

    score_i = (V_i / sqrt(mean(V_i^2) + eps)) . w        keys are RMS-normalised (no gain) ...
    p = softmax(score)
    out = sum_i p_i V_i                                   ... but the values mixed are the RAW sources

The stack is per token and runs over depth: it starts empty at every forward call. A layer with
`i % attn_res_block_size == 0` pushes its RAW input (not the mixed one), after its attention-site
mix, and its own running sum restarts from its attention output.
"""

from __future__ import annotations

import math
import operator

import numpy as np

from .._xp import array_namespace
from ..backend import on_host, to_numpy
from . import token_ops


def source_labels(block_boundaries: list[int]) -> list[str]:
    """Names of the sources the output mix reads, in stack order: the first block ("embedding", or the
    input of the first pushing layer of a layer subset), "block 1", ..., and the running sum "current"."""
    if not block_boundaries:
        return ["current"]
    first = "embedding" if block_boundaries[0] == 0 else f"input of layer {block_boundaries[0]}"
    return [first] + [f"block {j}" for j in range(1, len(block_boundaries))] + ["current"]


def source_of_layers(specs) -> list[int]:
    """The push rule as indices into the final stack: [source of the embedding] + [source layer i's outputs
    land in, for each layer]. A pushing layer seals the running sum before its attention, so its own
    outputs start the next source."""
    out, n = [0], 0
    for spec in specs:
        n += spec.is_block_boundary
        out.append(n)
    return out


def apply_attn_res_prescored(prefix_sum, block_residual, score_weight, eps: float):
    """The GGUF form, with the fused score vector `norm_weight * proj_weight`.

    prefix_sum: [d]; block_residual: [n, d] (n may be 0); score_weight: [d].
    Returns (blended [d], weights [n+1] over [checkpoints..., current]). Runs the decoder's own
    `SourceBuffer`, so what is tested here is what `kimi_forward_token` computes.
    """
    xp = array_namespace(prefix_sum)
    src = SourceBuffer(xp, block_residual.shape[0] + 1, prefix_sum.shape[-1], prefix_sum.dtype, eps)
    for block in block_residual:
        src.set_current(block)
        src.seal()
    src.set_current(prefix_sum)
    p = src.weights(score_weight)
    return src.mix(p), p


def apply_attn_res(prefix_sum, block_residual, norm_weight, proj_weight, eps: float):
    """The HF form: `norm_weight` [d] and `proj_weight` [1, d] fuse into one score vector."""
    return apply_attn_res_prescored(prefix_sum, block_residual, norm_weight * proj_weight.reshape(-1), eps)


def naive_apply_attn_res(prefix_sum, block_residual, norm_weight, proj_weight, eps: float):
    """Float64 reference, source by source, with the norm and projection applied separately."""
    f64 = lambda a: np.asarray(to_numpy(a), dtype=np.float64)  # noqa: E731
    sources = [f64(b) for b in block_residual] + [f64(prefix_sum)]
    g, proj = f64(norm_weight), f64(proj_weight).reshape(-1)
    scores = []
    for v in sources:
        key = g * (v / math.sqrt(float(np.mean(v * v)) + eps))  # the RMSNorm module, weight included
        scores.append(float(key @ proj))
    m = max(scores)
    e = [math.exp(s - m) for s in scores]
    p = np.array(e) / sum(e)
    return sum(pi * v for pi, v in zip(p, sources, strict=True)), p


class SourceBuffer:
    """One token's sources during the forward pass: rows 0..n-1 the sealed blocks, row n the current sum.

    Each row's 1/rms is kept beside it, so a sealed block is normalised once per token rather than at
    every later site (the keys' norms never change; only the score vector does).

    Two formulations of the same math. On the host (NumPy) the 1/rms values and the softmax over the
    n+1 <= ~10 scores are Python floats (double precision, rounded once into p): on vectors this short
    each NumPy call costs more than the arithmetic. On a GPU everything stays in device arrays
    (a float() would wait for the device). Both are tested against the naive twin.
    """

    def __init__(self, xp, rows: int, d: int, dtype, eps: float, host_scalars: bool | None = None):
        self.xp, self.eps, self.inv_d, self.dtype = xp, eps, 1.0 / d, dtype
        self.host_scalars = on_host(xp) if host_scalars is None else host_scalars
        self.rows = xp.empty((rows, d), dtype)
        self._upto = [self.rows[:m] for m in range(rows + 1)]  # rows[:m], made once for the token's many mixes
        # 1/rms of each row: doubles on the host, else device arrays of the dtype
        self.inv_rms = np.zeros(rows, np.float64) if self.host_scalars else xp.empty(rows, dtype)
        # host float32: each row and its 1/rms set, and the softmax taken, by one compiled call (`token_ops`;
        # the same double-precision arithmetic as the Python floats below, the sums of squares in double)
        self.compiled = self.host_scalars and token_ops.runs(self.rows) and rows <= token_ops.MAX_SOURCES
        self.n = 0  # sealed blocks
        self.current = None  # the running sum last given to set_current

    def set_current(self, v) -> None:
        """Make v [d] the current running sum (row n), the array itself kept as `self.current`."""
        n = self.n
        self.current = v
        if self.compiled and token_ops.runs(v):
            token_ops.set_row(self.rows, n, v, self.inv_rms, self.inv_d, self.eps)
            return
        self.rows[n] = v
        if self.host_scalars:
            self.inv_rms[n] = 1.0 / math.sqrt(float(v @ v) * self.inv_d + self.eps)
        else:
            self.inv_rms[n] = 1.0 / self.xp.sqrt((v @ v) * self.inv_d + self.eps)

    def weights(self, score_weight):
        """Softmax over [sealed blocks..., current] of (V_i / rms_i) . score_weight: [n+1] (a new array)."""
        s = self._upto[self.n + 1] @ score_weight
        if self.compiled and s.dtype == self.dtype:
            return token_ops.source_softmax(s, self.inv_rms)
        if self.host_scalars:  # the same float operations as a loop would do, through C-level map calls
            z = list(map(operator.mul, s.tolist(), self.inv_rms.tolist()))  # (map stops at m: inv_rms has spare rows)
            top = max(z)
            e = list(map(math.exp, map(top.__rsub__, z)))  # exp(z_i - top)
            return np.array(list(map(sum(e).__rtruediv__, e)), dtype=self.dtype)  # e_i / total
        s = s * self.inv_rms[: self.n + 1]
        e = self.xp.exp(s - s.max())
        return e / e.sum()

    def mix(self, p):
        """sum_i p_i V_i over the raw sources: [d]."""
        return p @ self._upto[self.n + 1]

    def seal(self) -> None:
        """Push: the current row becomes the newest block."""
        self.n += 1

    @property
    def blocks(self):
        return self.rows[: self.n]

    def replace_blocks(self, blocks) -> None:
        """Make `blocks` [n, d] the sealed blocks (a hook's replacement), their 1/rms recomputed."""
        n, current = self.n, self.current
        self.n = 0
        for b in blocks:
            self.set_current(b)
            self.seal()
        self.n = n
        self.set_current(current)

    def pack(self) -> tuple:
        """What another process needs to continue this token: (rows [n+1, d] host copy, their 1/rms [n+1], n)."""
        n = self.n
        return to_numpy(self.rows[: n + 1]).copy(), to_numpy(self.inv_rms[: n + 1]).copy(), n

    @classmethod
    def unpack(cls, packed: tuple, xp, rows: int, dtype, eps: float) -> SourceBuffer:
        """`pack`'s inverse with capacity `rows`: the stack exactly as it was, rows, 1/rms values and all."""
        values, inv, n = packed
        d = values.shape[-1]
        stack = cls(xp, rows, d, dtype, eps)
        stack.rows[: n + 1] = xp.asarray(values)
        stack.inv_rms[: n + 1] = inv if stack.host_scalars else xp.asarray(inv)
        stack.n = n
        stack.current = stack.rows[n].copy()
        return stack
