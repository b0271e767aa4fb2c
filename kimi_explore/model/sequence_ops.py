"""Element-wise steps of the sequence path in one compiled pass each (host float32), NumPy otherwise.

    exp_(a), sigmoid_(a), silu_(a)          in place on a fresh array a
    sigmoid_cols(y, a, b)                   sigmoid of columns a..b of rows, a new array
    kda_conv(y, window, taps, group)        KDA's short conv and SiLU over a chunk, its window advanced
    situ_and_mul_rows(gate_up, beta, lb, fallback)   ops.situ_and_mul on rows [..., 2n] -> [..., n]
    causal_softmax_(scores, L0, scale)      in place on [nh, T, L0 + T]: scale, mask, softmax (as mla.causal_softmax_)
    causal_attention(q, keys, values, L0, scale)     MLA's attention of a chunk, fused (None: not here)
    experts_grouped(groups, z, w13, w2, act)         dense routed experts of a chunk, fused (None: not here)
    experts_rows(z, rows, bounds, experts, w13, w2, act)   the same, the selections as arrays (a packed bank's)
    top_rows(logits, k)                              each row's top k and their probabilities (None: not here)
    group_ids(ids)                                   a chunk's selections grouped by expert (None: not here)
    kda_decay_(raw, dt_bias, A, lower_bound)         KDA's log decay in place and its exp
    l2_scale_qk(qkv, scale_rows, eps)                KDA's q and k L2-normalised, q's scale folded in
    gated_norm(o, gate, gain, eps)                   KDA's gated RMSNorm of the read-out
    source_scores(rows, m, w), source_mix(rows, p)   the block residuals' scores and mix over a chunk's stacks

Why: on the embedded model a chunk's element-wise work, not its matmuls, is most of a layer's time, and
NumPy's float32 exp and tanh cost ~1.4 ns per element here (AVX2), a softmax or a SiTU-GLU five to eight
passes with their temporaries. `_sequence_ops.c` takes one pass with a polynomial exp and tanh (Cephes;
~1-2 ulp): float32 results agree with the NumPy route to rounding, not bit for bit, which the sequence
path promises anyway (its sums run in another order than stepping). (The token path's small steps are
compiled too, in double: `token_ops`.)

MLA's attention (`causal_attention`: scores, softmax and mix) and the dense routed experts (`experts_grouped`:
gather, up projection, SiTU-GLU, down projection) are one kernel each, with 16-32 queries or selections in vector
lanes so that every step is vertical and the intermediates stay in a cache-sized scratch (`_sequence_ops.c`); the
recorder's top-k of a chunk's logits (`top_rows`) is one pass per row.

Used where the kernel runs (`runs`: a host float32 NumPy array and the extension built, `AVAILABLE`);
float64, CuPy and an install without a compiler take the NumPy route, the same formulas. Measured here
(AVX2, CPU ns per element, NumPy in brackets): exp 0.45 (1.4), a causal softmax row 1.3 (2.6), SiTU-GLU
3.8 per output (6.6).
"""

from __future__ import annotations

import numpy as np

from .._xp import array_namespace

try:
    from . import _sequence_ops as _ext
except ImportError:  # no compiler at install time
    _ext = None

AVAILABLE = _ext is not None
ISA = ""  # '' = the best this CPU has; tests set one of isas() to run each kernel


def isas() -> tuple[str, ...]:
    """Kernels this CPU can run, best last ('portable', 'avx2', 'avx512f'); () without the extension."""
    return _ext.isas() if AVAILABLE else ()


def runs(a) -> bool:
    """Whether the compiled kernels take `a`: a C-contiguous float32 NumPy array (and the extension is built)."""
    return AVAILABLE and isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous


def exp_(a):
    """exp(a) in place; returns a."""
    if runs(a) and a.flags.writeable:
        _ext.map(a, 0, ISA)
        return a
    return array_namespace(a).exp(a, out=a)


def sigmoid_(a):
    """1 / (1 + exp(-a)) in place; returns a."""
    if runs(a) and a.flags.writeable:
        _ext.map(a, 1, ISA)
        return a
    xp = array_namespace(a)
    xp.negative(a, out=a)
    xp.exp(a, out=a)
    a += 1.0
    return xp.divide(1.0, a, out=a)


def sigmoid_cols(y, a: int, b: int):
    """sigmoid(y[:, a:b]) as a new C-contiguous array [T, b - a] (y: [T, n] rows, e.g. a projection's output whose
    columns a..b are a gate): compiled, each row copied and mapped while in cache (`sigmoid_`'s values); else NumPy."""
    if runs(y) and y.ndim == 2 and 0 <= a <= b <= y.shape[1]:
        out = np.empty((y.shape[0], b - a), np.float32)
        _ext.map_cols(y, out, a, y.shape[0], b - a, 1, ISA)
        return out
    return sigmoid_(y[:, a:b].copy())


def silu_(a):
    """a / (1 + exp(-a)) in place; returns a."""
    if runs(a) and a.flags.writeable:
        _ext.map(a, 2, ISA)
        return a
    xp = array_namespace(a)
    den = xp.exp(-a)
    den += 1.0
    return xp.divide(a, den, out=a)


def situ_and_mul_rows(gate_up, beta: float, linear_beta: float | None, fallback):
    """`ops.situ_and_mul(gate_up, beta, linear_beta)` on rows [..., 2n] -> [..., n]; `fallback(gate_up)` (the
    NumPy route) where the kernel does not run."""
    if not (AVAILABLE and isinstance(gate_up, np.ndarray) and gate_up.dtype == np.float32):
        return fallback(gate_up)
    gu = np.ascontiguousarray(gate_up)
    n = gu.shape[-1] // 2
    out = np.empty(gu.shape[:-1] + (n,), np.float32)
    c = beta if linear_beta is None else beta * linear_beta
    _ext.situ(gu, out, out.size // n if n else 0, n, 1.0 / beta, 1.0 / (linear_beta or 1.0), c, linear_beta is not None, ISA)
    return out


def kda_conv(y, window, taps, group: int = 0):
    """KDA's short conv and SiLU over a chunk, and its window advanced: y [T, >= C] (the input projection's rows, their
    first C columns the conv's input), window [..., W] of C channels (the state's stored rows, oldest first, last axis
    time; in place: it ends holding the last W of those rows then the chunk's), taps [W, C] -> (out [T, C], norms):
    row t of out = silu(sum_j ext[t + 1 + j] * taps[j]) over ext = the W stored rows then y's T (the window after token
    t). With group K > 0, norms [T, C / K]: each group of K channels' norm over token t's window (what a recorder keeps
    of kda.conv; None otherwise). Compiled in one pass that reads y and the window where they are; else NumPy (ext
    concatenated), the same sums in the same order, agreeing to float32 rounding (the kernel's multiply-adds fused
    where the ISA fuses them, its SiLU's exp a polynomial, the norms' sums in lanes)."""
    T, W = y.shape[0], window.shape[-1]
    C = taps.shape[1]
    if runs(y) and runs(window) and runs(taps) and y.ndim == 2 and window.size == C * W:
        head = np.ascontiguousarray(window.reshape(C, W).T)  # the old rows, read while the window is overwritten
        out = np.empty((T, C), np.float32)
        norms = np.empty((T, C // group) if group else (0,), np.float32)
        _ext.kda_conv(head, y, taps, out, window, norms, T, W, C, y.shape[1], group, ISA)
        return out, norms if group else None
    xp = array_namespace(y)
    ext = xp.concatenate((window.reshape(C, W).T, y[:, :C]))  # [W + T, C]
    pre = ext[1 : 1 + T] * taps[0]  # token t's window is ext[t + 1 : t + 1 + W]
    tap = xp.empty_like(pre)
    for j in range(1, W):
        pre += xp.multiply(ext[1 + j : 1 + j + T], taps[j], out=tap)
    norms = None
    if group:
        e = ext.reshape(W + T, C // group, group)
        sq = xp.einsum("...k,...k->...", e, e)  # [W + T, C / K]: each stored row's squares, per group
        win = sq[1 : 1 + T].copy()
        for j in range(1, W):
            win += sq[1 + j : 1 + j + T]
        norms = xp.sqrt(win)
    window[...] = ext[T:].T.reshape(window.shape)
    return silu_(pre), norms


def causal_softmax_(scores, L0: int, scale: float):
    """In place on scores [nh, T, L0 + T] (q . k, unscaled; `runs(scores)` must hold): query t's row times
    `scale`, its positions after L0 + t masked (probability exactly 0), the softmax over the rest (the
    token form's operations, `mla.causal_softmax_`); returns the probabilities."""
    if not (runs(scores) and scores.flags.writeable):
        raise ValueError("sequence_ops.causal_softmax_: expected a writable C-contiguous float32 NumPy array "
                         f"(runs()), got {type(scores).__name__} {getattr(scores, 'dtype', '')}")
    nh, T, L = scores.shape
    if L != L0 + T:
        raise ValueError(f"sequence_ops.causal_softmax_: scores [{nh}, {T}, {L}] with L0 {L0}: expected L0 + T = {L0 + T} keys")
    if scores.size:
        _ext.causal_softmax(scores, nh * T, L, T, L0, scale, ISA)
    return scores


def causal_attention(q, keys, values, L0: int, scale: float):
    """MLA's attention of a chunk's queries q [T, nh, dq] (positions L0 .. L0 + T - 1) over a cache keys [nh, cap, dq],
    values [nh, cap, dv] that holds them: [T, nh, dv], row t = softmax(scale q[t] . keys[:, :L0 + t + 1]) @ values[:,
    :L0 + t + 1] per head, the probabilities never stored (`mla.mla_sequence` where no hook reads them); None where
    the kernel does not run (the caller's NumPy route). The token form's softmax steps (each probability times
    1 / sum, not divided: rounding apart)."""
    if not (runs(q) and runs(keys) and runs(values)):
        return None
    T, nh, dq = q.shape
    out = np.empty((T, nh, values.shape[2]), np.float32)
    if T:
        _ext.causal_attention(q, keys, values, out, T, nh, dq, values.shape[2], keys.shape[1], L0, scale, ISA)
    return out


def experts_grouped(groups, z, w13, w2, act):
    """Dense routed experts over a chunk's selections grouped by expert (`latent_moe.ExpertGroups`): y [n, l], row i =
    w2_e act(w13_e z[groups.rows[i]]) for selection i's expert e (w13 [E, 2I, l], w2 [E, l, I], z [T, l]), in one
    compiled pass per 16-32 selections (gather, up projection, SiTU-GLU, down projection); None where it does not run:
    `act` not this module's SiTU-GLU on rows (a `functools.partial` of `situ_and_mul_rows` naming its constants), an
    operand not a host float32 array (the banks C-contiguous), or shapes that do not fit. Float32 rounding apart from
    the matmul route."""
    return experts_rows(z, groups.rows, groups.bounds, groups.experts, w13, w2, act)


def experts_rows(z, rows, bounds, experts, w13, w2, act):
    """`experts_grouped` of selections given as arrays: segment i (rows[bounds[i]:bounds[i + 1]], the rows of z it
    reads) goes through expert experts[i] of the banks w13 [E, 2I, l], w2 [E, l, I]; y [bounds[-1], l], or None.
    Each selection's lane is computed alone, so a selection's row does not depend on the others given with it (a
    packed bank's cache slots and dequantised experts give a dense bank's bits)."""
    situ = getattr(act, "keywords", None) if getattr(act, "func", None) is situ_and_mul_rows else None
    if not situ or {"beta", "linear_beta"} - situ.keys() or not (runs(w13) and runs(w2)) or w13.ndim != 3:
        return None
    E, I2, l = w13.shape
    if w2.shape != (E, l, I2 // 2) or I2 % 2 or not (isinstance(z, np.ndarray) and z.dtype == np.float32 and
                                                    z.ndim == 2 and z.shape[1] == l):
        return None  # (the matmul route names what is wrong)
    z = np.ascontiguousarray(z)  # the layer's latents are a column slice of its input projection
    beta, lb = situ["beta"], situ["linear_beta"]
    y = np.empty((int(bounds[-1]), l), np.float32)
    _ext.experts(z, np.ascontiguousarray(rows, np.int64), np.asarray(bounds, np.int64), np.asarray(experts, np.int64),
                 w13, w2, y, z.shape[0], l, I2 // 2, E, 1.0 / beta, 1.0 / (lb or 1.0), beta if lb is None else beta * lb,
                 lb is not None, ISA)
    return y


def group_ids(ids):
    """A chunk's selections grouped by expert, ids int [n] (each -1, dropped, or an expert >= 0) -> (order int64 [kept]:
    the selections sorted by expert, ascending within one, the dropped left out; experts: the selected experts
    ascending, a list; bounds: their segments of order, a list of m + 1) in one compiled counting sort; None where it
    does not run (the caller's argsort)."""
    if not (AVAILABLE and isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype.kind in "iu" and ids.size):
        return None
    E = int(ids.max()) + 1
    if not 1 <= E <= 1 << 20:  # (ids all dropped, or a bank too large for a count per expert)
        return None
    order, experts, bounds = np.empty(ids.size, np.int64), np.empty(E, np.int64), np.empty(E + 1, np.int64)
    m = _ext.group(np.ascontiguousarray(ids, np.int64), order, experts, bounds)
    if m < 0:  # an id below -1 (the caller's argsort drops it as it drops -1)
        return None
    return order[: bounds[m]], experts[:m].tolist(), bounds[: m + 1].tolist()


TOP_ROWS_MAX_K = 16  # `top_rows` above: the NumPy route (the kernel's kept list would shift ~V k / 2 times a row)


def top_rows(logits, k: int):
    """Each row's k largest ids and their softmax probabilities: logits [R, V] -> (ids int64 [R, k], probs float32
    [R, k]) in one compiled pass per row (`topk.top_predictions`' order: descending, ties by the lower id, NaN last;
    its probabilities, the exps summed in lanes of double: float32 rounding apart); None where the kernel does not
    run, or for k > TOP_ROWS_MAX_K."""
    if not (runs(logits) and logits.ndim == 2 and 1 <= k <= min(TOP_ROWS_MAX_K, logits.shape[1])):
        return None
    R, V = logits.shape
    ids, probs = np.empty((R, k), np.int64), np.empty((R, k), np.float32)
    _ext.top_rows(logits, ids, probs, R, V, k, ISA)
    return ids, probs


def kda_decay_(raw, dt_bias, A, lower_bound: float):
    """KDA's decay over a chunk: raw [T, H, K] (f_b_proj's output), in place, becomes g = lower_bound sigmoid(A
    (raw + dt_bias)), the log decay; returns (g, alpha = exp(g)). dt_bias, A: [H, K]. Compiled: the NumPy
    route's five passes in one, the same operations (g bit for bit; alpha to 1 ulp: exp's polynomial may be
    contracted differently)."""
    if runs(raw) and raw.flags.writeable and runs(dt_bias) and runs(A) and dt_bias.shape == A.shape == raw.shape[1:]:
        alpha = np.empty_like(raw)
        _ext.kda_decay(raw, alpha, dt_bias, A, lower_bound, raw.shape[0], A.size, ISA)
        return raw, alpha
    raw += dt_bias
    raw *= A
    g = sigmoid_(raw)
    g *= lower_bound
    return g, exp_(g.copy())


def l2_scale_qk(qkv, scale_rows, eps: float):
    """KDA's q and k, L2-normalised per head with q's scale folded in: qkv [T, 3, H, K] (the conv outputs) ->
    [2, T, H, K] (q, then k: each contiguous where compiled, as the recurrence reads them), row (s, t, h) =
    qkv[t, s, h] scale_rows[s H + h] / sqrt(sum of squares + eps)."""
    T, _, H, K = qkv.shape
    if runs(qkv) and runs(scale_rows) and scale_rows.shape == (2 * H,):
        out = np.empty((2, T, H, K), np.float32)
        _ext.l2_scale_qk(qkv, scale_rows, eps, out, T, H, K, ISA)
        return out
    qk = qkv[:, :2]
    r = _root_sum_squares(qk, eps)
    return (qk * array_namespace(qkv).divide(scale_rows.reshape(2, H, 1), r, out=r)).swapaxes(0, 1)


def gated_norm(o, gate, gain, eps: float):
    """KDA's gated RMSNorm of the read-out: o, gate [T, H, V] -> o * (gain * gate) / sqrt(sum over V of o^2 + eps)
    (gain [V]: o_norm sqrt(V); eps: V rms_norm_eps)."""
    if runs(o) and runs(gate) and runs(gain) and gate.shape == o.shape and gain.shape == o.shape[-1:]:
        out = np.empty_like(o)
        _ext.gated_norm(o, gate, gain, eps, out, o.size // max(gain.size, 1), gain.size, ISA)
        return out
    r = _root_sum_squares(o, eps)
    o = o * (gain * gate)
    o /= r
    return o


def _root_sum_squares(x, eps: float):
    """sqrt(sum over the last axis of x^2 + eps), the axis kept: the NumPy route's denominator of `l2_scale_qk` and
    `gated_norm` (an einsum, then in place)."""
    xp = array_namespace(x)
    r = xp.einsum("...k,...k->...", x, x)[..., None]
    r += eps
    return xp.sqrt(r, out=r)


def source_scores(rows, m: int, w):
    """Each token's scores of its first m sources: rows [T, S, d] (a chunk's stacks), w [d] -> [T, m], row t =
    rows[t, :m] @ w (float32 dots in lanes: the token form's sgemv to rounding)."""
    if runs(rows) and runs(w) and w.shape == rows.shape[-1:] and 1 <= m <= rows.shape[1]:
        T, S, d = rows.shape
        out = np.empty((T, m), np.float32)
        _ext.sources(rows, w, out, T, S, m, d, 0, ISA)
        return out
    return array_namespace(rows).matmul(rows[:, :m], w)


def source_mix(rows, p):
    """Each token's mix of its first m = p.shape[1] sources: rows [T, S, d], p [T, m] -> [T, d], row t =
    p[t] @ rows[t, :m] (float32, sources in order: the token form's product to rounding)."""
    T, m = p.shape
    if runs(rows) and runs(p) and rows.shape[0] == T and 1 <= m <= rows.shape[1]:
        d = rows.shape[-1]
        out = np.empty((T, d), np.float32)
        _ext.sources(rows, p, out, T, rows.shape[1], m, d, 1, ISA)
        return out
    return array_namespace(rows).matmul(p[:, None, :], rows[:, :m])[:, 0]


__all__ = ["AVAILABLE", "causal_attention", "causal_softmax_", "exp_", "experts_grouped", "experts_rows", "gated_norm",
           "group_ids", "isas", "kda_conv", "kda_decay_", "l2_scale_qk", "runs", "sigmoid_", "sigmoid_cols", "silu_",
           "situ_and_mul_rows", "source_mix", "source_scores", "top_rows"]
