"""Kimi Delta Attention (KDA): one decode token through one KDA layer.

Shapes: d = hidden, H = heads, K = V = head_dim, P = H*K, W = short-conv width.

    q_lin, k_lin, v_lin = q_proj(x), k_proj(x), v_proj(x)            each [P]
    window <- shift left, append [q_lin; k_lin; v_lin]                  [3, P, W], oldest first
    q, k, v = silu(sum_w conv[c, w] * window[c, w])                     Linear -> conv -> SiLU
    g  = lower_bound * sigmoid(exp(A_log[h]) * (f_b(f_a(x)) + dt_bias)) [H, K], log-space decay
    beta = sigmoid(b_proj(x))                                           [H], one per head
    q, k = l2norm(q), l2norm(k) with x / sqrt(sum(x^2) + 1e-6); q *= K^-0.5
    S_h = Diag(exp(g_h)) S_h; S_h += k (beta (v - S_h^T k))^T;  o_h = S_h^T q   (S_h is [K, V])
    out = o_proj( rmsnorm_K(o) * o_norm * sigmoid(g_proj(x)) )          gate not normalised

Traps: A_log is per HEAD (stored head_dim wide on disk, use the first H entries); the decay acts
on key rows BEFORE the read; the output reads the UPDATED state; the l2norm eps sits inside the
sqrt of the SUM (not the mean); the o_norm eps is rms_norm_eps.

`kda_sequence` runs T tokens at once ([T, d] rows): the same equations, the projections as one
matmul over all rows, the conv over the stored window followed by the T new rows, the delta rule
compiled token by token (`kda_recurrence`, host float32) or in chunked form (`kda_chunk`). Sums run
in another order than T `kda_step` calls: float32 results agree to rounding, float64 ones to ~1e-12.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .._xp import array_namespace
from ..backend import to_numpy
from . import kda_recurrence, sequence_ops, token_ops
from .kda_chunk import LOG_DECAY_FLOOR, chunked_delta_rule
from .ops import linear
from .sites import site_table

L2NORM_EPS = 1e-6
_STEP_VALUES = frozenset(("kda.q", "kda.k", "kda.v", "kda.beta", "kda.decay", "kda.gate"))  # sites a hook may replace


@dataclass
class KdaWeights:
    """One KDA layer. Projections that read x are fused into one matmul at load
    (the same math; BLAS may round the last bit differently than six separate matmuls).

    in_proj: [4P + H + K, d]  rows q_proj | k_proj | v_proj | g_proj | b_proj | f_a_proj
    f_b_proj: [P, K]
    conv:     [3, P, W]       q_conv1d | k_conv1d | v_conv1d ([P, 1, W] on disk); w = W-1 is the current token
    A:        [H, 1]          exp(A_log[:H]), per head
    dt_bias:  [H, K]
    o_norm:   [K]
    o_proj:   [d, P]
    """

    kind: ClassVar[str] = "kda"
    in_proj: object
    f_b_proj: object
    conv: object
    A: object
    dt_bias: object
    o_norm: object
    o_proj: object
    num_heads: int
    head_dim: int
    lower_bound: float
    eps: float  # o_norm eps (rms_norm_eps)

    def __post_init__(self):
        # constants folded for the decode step (derived, never loaded)
        xp = array_namespace(self.A)
        self.qk_scale = xp.asarray([1.0 / math.sqrt(self.head_dim), 1.0], dtype=self.A.dtype).reshape(2, 1, 1)
        self.o_norm_scaled = self.o_norm * math.sqrt(self.head_dim)
        self.taps_ones = xp.ones(self.conv.shape[-1], self.conv.dtype)  # [W]: the conv's sum over taps as a matvec
        self.A_wide = xp.ascontiguousarray(xp.broadcast_to(self.A, (self.num_heads, self.head_dim)))  # [H, K]
        # the step's scalars as 0-d arrays of the compute dtype: the same rounding as a Python scalar, but
        # NumPy's cheapest operand (a Python float costs a conversion per operation)
        c = lambda v: xp.asarray(v, dtype=self.A.dtype)  # noqa: E731
        self.one, self.lower_bound_c = c(1.0), c(self.lower_bound)
        self.l2_eps, self.o_eps = c(L2NORM_EPS), c(self.head_dim * self.eps)
        # for the compiled steps (kda_recurrence.elementwise_ops): q's and k's scale per (stream, head) row [2H],
        # the epsilons as the Python floats of their compute-dtype values
        self.qk_scale_rows = xp.repeat(self.qk_scale.reshape(2), self.num_heads)
        t = np.dtype(self.A.dtype).type  # (on the host: the arrays may live on a GPU)
        self.l2_eps_f, self.o_eps_f = float(t(L2NORM_EPS)), float(t(self.head_dim * self.eps))
        self.compiled_gates = token_ops.runs(self.conv, self.dt_bias, self.A_wide)  # token_ops.kda_gates takes them


@dataclass
class KdaState:
    """Decode state of one KDA layer.

    conv:      [3, P, W]  last W pre-conv q/k/v projection values, oldest first (zeros at start)
    recurrent: [H, K, V]  S_h[k, v]; the HF/fla layout is the transpose, [H, V, K]
    """

    kind: ClassVar[str] = "kda"
    conv: object
    recurrent: object

    @classmethod
    def zeros(cls, w: KdaWeights, xp, dtype) -> KdaState:
        H, K = w.num_heads, w.head_dim
        return cls(xp.zeros(w.conv.shape, dtype), xp.zeros((H, K, K), dtype))

    def __post_init__(self):
        # kda_step shifts the window through a flat view (one contiguous copy), which needs C order
        if not self.conv.flags.c_contiguous:
            self.conv = array_namespace(self.conv).ascontiguousarray(self.conv)

    def copy(self) -> KdaState:
        return KdaState(self.conv.copy(), self.recurrent.copy())

    def checkpoint(self) -> KdaState:
        """What a kept checkpoint holds: a copy (every token rewrites these arrays in place)."""
        return self.copy()


def delta_rule_update(S, k, v, alpha, beta, exact=None) -> None:
    """The gated delta rule for every head at once, updating S [H, K, V] in place.

    k: [H, K] (l2-normalised); v: [H, V]; alpha: [H, K] decay in (0, 1]; beta: [H].
    Decay first, then read with the decayed state, then write.
    exact: the compiled elementwise steps (`kda_recurrence.elementwise_ops`, bit for bit the NumPy lines) when
    the caller has checked the arrays, False for NumPy alone; None: checked here.
    """
    xp = array_namespace(S)
    if exact is None:
        exact = kda_recurrence.elementwise_ops(S, alpha, k, v, beta)
    if exact:
        exact.scale_rows(S, alpha)
    else:
        S *= alpha[:, :, None]
    u = xp.matmul(k[:, None, :], S)[:, 0]  # S^T k  [H, V]
    if exact:
        exact.write_delta(S, k, v, u, beta)
    else:
        S += k[:, :, None] * (beta[:, None] * (v - u))[:, None, :]


def delta_rule_read(S, q):
    """o_h = S_h^T q_h: [H, V]."""
    return array_namespace(S).matmul(q[:, None, :], S)[:, 0]


def kda_step(x, w: KdaWeights, state: KdaState, hooks=None, names=None):
    """x: [d] (input_layernorm output) -> [d]; advances `state` in place.

    hooks/names: the hooks at each listened-to site (`site_table(hooks, names)`) of `ATTENTION_SITES["kda"]`, in that order;
    a returned value is used downstream: the window (`kda.conv`, kept in the state), the conv outputs
    before the L2 norm (`kda.conv_out` [3, H, K]), q, k, v, beta, decay, gate, the updated state
    (`kda.state`, kept), the read-out o = S^T q before the gated norm (`kda.o` [H, V]).

    Written for few array operations (on a tiny model their count and kind, not FLOPs, are the
    cost): one fused projection, the window shifted as one flat contiguous copy, the conv's and the
    norms' sums over short axes as matmuls (a NumPy reduction over a short last axis is slow), one
    sigmoid for the conv outputs, the output gate, beta and the decay together, the q scale folded
    into the l2norm, the o_norm gain folded with the gate.
    """
    xp = array_namespace(x)
    at = site_table(hooks, names)
    H, K = w.num_heads, w.head_dim
    P = H * K
    y = w.in_proj @ x
    window = state.conv
    # the compiled elementwise steps (bit for bit the NumPy lines beside them) when the state, the projection
    # and the folded weights are float32 host arrays; the arrays the step makes from them then are too, and
    # are checked again only where a hook may have replaced them
    exact = kda_recurrence.elementwise_ops(window, state.recurrent, y, w.qk_scale_rows, w.o_norm_scaled)
    if exact is not None:  # the three lines below in one compiled call (copies only)
        exact.shift_in(window, y, window.shape[-1])
    else:
        flat = window.reshape(-1)  # a view: KdaState keeps the window C-contiguous
        # shift every channel left by one tap: flat[i] <- flat[i + 1]; the taps that cross into the next
        # channel land in the last tap, overwritten next. (.copy(): CuPy does not guard overlapping ranges)
        flat[:-1] = flat[1:] if type(flat) is np.ndarray else flat[1:].copy()
        window[:, :, -1] = y[: 3 * P].reshape(3, P)
    if "kda.conv" in at:
        new = at["kda.conv"](window)
        if new is not window:
            window[...] = new
    decay_raw = w.f_b_proj @ y[4 * P + H :]  # [P]
    if exact and w.compiled_gates and token_ops.runs(decay_raw):  # the lines below in one compiled call
        sig = token_ops.kda_gates(window, w.conv, y, decay_raw, w.dt_bias, w.A_wide, w.lower_bound, H)
        qkv = sig[: 3 * P].reshape(3, H, K)
        alpha = sig[4 * P + H :].reshape(H, K)
    else:
        pre = (window * w.conv) @ w.taps_ones  # [3, P]
        decay_in = (decay_raw.reshape(H, K) + w.dt_bias) * w.A_wide  # A (f + dt_bias)  [H, K]
        # one sigmoid for all four: the conv outputs (SiLU(c) = c sigmoid(c)), the output gate, beta, the decay
        z = xp.concatenate((pre.reshape(-1), y[3 * P : 4 * P + H], decay_in.reshape(-1)))
        sig = w.one / (w.one + xp.exp(-z))
        exact = exact and kda_recurrence.elementwise_ops(sig)  # (float32 unless a weight promoted it)
        qkv = (pre.reshape(-1) * sig[: 3 * P]).reshape(3, H, K)
        alpha = xp.exp(w.lower_bound_c * sig[4 * P + H :].reshape(H, K))  # exp(lower_bound * sigmoid(A (f + dt_bias)))
    gate, beta = sig[3 * P : 4 * P].reshape(H, K), sig[4 * P : 4 * P + H]
    if "kda.conv_out" in at:
        qkv = at["kda.conv_out"](qkv)
        exact = exact and kda_recurrence.elementwise_ops(qkv)

    qk = qkv[:2]
    sq = xp.matmul(qk[:, :, None, :], qk[:, :, :, None])[..., 0]  # [2, H, 1] sum of squares per head
    if exact:  # the line below, compiled (bit for bit)
        out = xp.empty(qk.shape, qk.dtype)
        exact.l2_scale(qk, sq, w.qk_scale_rows, w.l2_eps_f, out)
        qk = out
    else:
        qk = qk * (w.qk_scale / xp.sqrt(sq + w.l2_eps))
    q, k, v = qk[0], qk[1], qkv[2]
    if at:  # (the rarely hooked intermediate values: one test for all six when nothing listens)
        if "kda.q" in at:
            q = at["kda.q"](q)
        if "kda.k" in at:
            k = at["kda.k"](k)
        if "kda.v" in at:
            v = at["kda.v"](v)
        if "kda.beta" in at:
            beta = at["kda.beta"](beta)
        if "kda.decay" in at:
            alpha = at["kda.decay"](alpha)
        if "kda.gate" in at:
            gate = at["kda.gate"](gate)
        if exact and not at.keys().isdisjoint(_STEP_VALUES):
            exact = kda_recurrence.elementwise_ops(q, k, v, beta, alpha, gate)

    S = state.recurrent
    delta_rule_update(S, k, v, alpha, beta, exact or False)
    if "kda.state" in at:
        new = at["kda.state"](S)
        if new is not S:
            S[...] = new
    o = delta_rule_read(S, q)
    if "kda.o" in at:
        o = at["kda.o"](o)
        exact = exact and kda_recurrence.elementwise_ops(o)
    # gated RMSNorm per head: o / sqrt(mean(o^2) + eps) * o_norm * gate == o * (sqrt(K) o_norm gate) / sqrt(sum(o^2) + K eps)
    sq = xp.matmul(o[:, None, :], o[:, :, None])[:, 0]  # [H, 1]
    if exact:  # the line below, compiled (bit for bit)
        out = xp.empty(o.shape, o.dtype)
        exact.gated_norm(o, sq, w.o_norm_scaled, gate, w.o_eps_f, out)
        o = out
    else:
        o = o * (w.o_norm_scaled * gate) / xp.sqrt(sq + w.o_eps)  # o_eps = K eps
    return w.o_proj @ o.reshape(P)


RULES = ("auto", "recurrent", "chunked")


def kda_sequence(x, w: KdaWeights, state: KdaState, *, chunk: int = 64, fire=None, names=None, state_norms: bool = False,
                 rule: str = "auto", fire_decay: bool = True):
    """x: [T, d] (input_layernorm outputs) -> (out [T, d], norms or None); advances `state` in place as T
    `kda_step` calls would. The conv window advances first, the recurrent state in the delta rule: a hook that raises
    between (or after) leaves the state part-advanced, which `kimi_forward_sequence` marks broken.

    rule: how the delta rule runs over the T tokens: "recurrent" (`kda_recurrence`, compiled, token by
    token: host float32 only), "chunked" (`kda_chunk`, matmuls over chunks of `chunk` tokens: any backend
    and dtype), "auto" (recurrent where it runs, else chunked). Why recurrent on the CPU, measured
    (`bench/prefill.py`, the rule alone with the per-token state norms a recorder keeps, CPU ms/token):
    the embedded model's width (4 heads x 32) 0.0008 recurrent against 0.011 chunked (chunk 64) and
    0.020 (256); K3's (96 x 128) 0.23-0.25 against 1.02-1.04 and 1.59. The chunked form trades the recurrence's
    O(K V) per token for O(C (K + V)) of matmuls per token plus the per-token norms, and NumPy's
    batched small matmuls do not win that back; the recurrence keeps each head's state in cache for
    all T tokens. Both are far below the layer's projections (K3 width: ~9 ms/token at chunk 256).

    fire(name, value) -> value, when given, sees whole-chunk arrays at the token form's sites, in its
    order, named names[kind] (a layer's bound `names`; None: the kinds themselves): kda.conv_out
    [T, 3, H, K], kda.q, kda.k, kda.v [T, H, K], kda.beta [T, H], kda.decay [T, H, K] (alpha = exp(g); a
    changed value, returned or edited in place, is used through its log, floored at LOG_DECAY_FLOOR, so it
    must be >= 0: a negative one raises ValueError, naming the site (the token form takes it); fired
    only with fire_decay: False when nothing listens there, which spares the copy that detects an edit), kda.gate [T, H, K],
    kda.o [T, H, V]; a returned array is used downstream. The recurrent sites kda.conv and kda.state
    (`SEQUENTIAL_SITES`: a changed value must reach the next token) are not fired; with
    state_norms=True, norms = {"kda.state": ||S_h||_F after every token [T, H], "kda.conv": each head's
    window norm after every token [T, 3, H]}, what a recorder keeps of them.
    """
    if rule not in RULES:  # (before anything is advanced)
        raise ValueError(f"kda_sequence: rule={rule!r}, expected one of {RULES}")
    xp = array_namespace(x)
    site = (lambda kind: kind) if names is None else names.__getitem__  # noqa: E731
    H, K = w.num_heads, w.head_dim
    P, W, T = H * K, w.conv.shape[-1], x.shape[0]
    y = linear(x, w.in_proj)  # [T, 4P + H + K]
    taps = xp.ascontiguousarray(w.conv.transpose(2, 0, 1).reshape(W, 3 * P))  # [W, 3P]: each tap's weights, contiguous
    # the conv over the stored rows then the chunk's (the window advanced), and each head's window norms where recorded
    qkv, conv_norms = sequence_ops.kda_conv(y, state.conv, taps, K if state_norms else 0)
    qkv = qkv.reshape(T, 3, H, K)
    # the sigmoids of the output gate and beta, each contiguous (the gated norm and the recurrence read them so)
    gate = sequence_ops.sigmoid_cols(y, 3 * P, 4 * P).reshape(T, H, K)
    beta = sequence_ops.sigmoid_cols(y, 4 * P, 4 * P + H)
    decay_in = linear(y[:, 4 * P + H :], w.f_b_proj).reshape(T, H, K)
    # log alpha = lower_bound * sigmoid(A (f + dt_bias)) and alpha, the same way with and without hooks (replays are exact)
    g, alpha = sequence_ops.kda_decay_(decay_in, w.dt_bias, w.A_wide, w.lower_bound)
    if fire is not None:
        qkv = fire(site("kda.conv_out"), qkv)
    qk = sequence_ops.l2_scale_qk(qkv, w.qk_scale_rows, L2NORM_EPS)
    q, k, v = qk[0], qk[1], qkv[:, 2]
    if fire is not None:
        q, k, v = fire(site("kda.q"), q), fire(site("kda.k"), k), fire(site("kda.v"), v)
        beta = fire(site("kda.beta"), beta)
        if fire_decay:
            given = alpha.copy()
            hooked = fire(site("kda.decay"), alpha)
            # returned, or edited in place (one flag to the host on a GPU, only where a hook listens at kda.decay)
            if hooked is not alpha or not bool(to_numpy(xp.array_equal(alpha, given))):
                negative = hooked < 0  # (NaN is not: it stays NaN here as in the token form)
                if bool(to_numpy(negative.any())):  # the log would be NaN where the token form decays by a sign flip
                    bad = to_numpy(hooked)[to_numpy(negative)]  # (the error's numbers, on the host)
                    raise ValueError(f"{site('kda.decay')}: a hook returned {bad.size} negative decays (down to "
                                     f"{float(bad.min()):.4g}): on the sequence path a decay must be >= 0, "
                                     "as the chunked form carries log(decay); step these tokens, or add the hook without "
                                     "chunks=True (the chunk then runs the token form, which takes any decay)")
                with np.errstate(divide="ignore"):
                    g = xp.maximum(xp.log(hooked), LOG_DECAY_FLOOR)
                alpha = None
        gate = fire(site("kda.gate"), gate)
    recurrent = rule == "recurrent" or (rule == "auto" and kda_recurrence.runs(xp, state.recurrent.dtype)
                                        and state.recurrent.flags.c_contiguous)
    if recurrent:
        o, state_norms = kda_recurrence.recurrent_delta_rule(q, k, v, g, beta, state.recurrent, state_norms, alpha=alpha)
    else:
        o, state_norms = chunked_delta_rule(q, k, v, g, beta, state.recurrent, chunk, state_norms)
    norms = None
    if state_norms is not None:
        norms = {"kda.state": state_norms, "kda.conv": conv_norms.reshape(T, 3, H)}
    if fire is not None:
        o = fire(site("kda.o"), o)
    o = sequence_ops.gated_norm(o, gate, w.o_norm_scaled, K * w.eps)  # o / sqrt(mean(o^2) + eps) * o_norm * gate
    return linear(o.reshape(T, P), w.o_proj), norms


def naive_kda_step(x, w: KdaWeights, state: KdaState):
    """Float64 reference, one head and one channel at a time. Returns (out [d], new KdaState)."""
    f64 = lambda a: np.asarray(to_numpy(a), dtype=np.float64)  # noqa: E731
    x = f64(x)
    H, K = w.num_heads, w.head_dim
    P = H * K
    Win = f64(w.in_proj)
    qw, kw, vw, gw = (Win[i * P : (i + 1) * P] for i in range(4))
    bw, faw = Win[4 * P : 4 * P + H], Win[4 * P + H :]
    conv_w, conv = f64(w.conv), f64(state.conv).copy()
    S = f64(state.recurrent).copy()
    new_vals = [qw @ x, kw @ x, vw @ x]
    streams = []
    for s in range(3):
        conv[s] = np.concatenate([conv[s][:, 1:], new_vals[s][:, None]], axis=1)
        pre = np.array([sum(conv_w[s, c, j] * conv[s, c, j] for j in range(conv.shape[2])) for c in range(P)])
        streams.append(pre / (1.0 + np.exp(-pre)))
    fa = faw @ x
    graw = f64(w.f_b_proj) @ fa
    A, dt = f64(w.A).reshape(H), f64(w.dt_bias).reshape(P)
    out_heads = []
    for h in range(H):
        sl = slice(h * K, (h + 1) * K)
        q, k, v = streams[0][sl], streams[1][sl], streams[2][sl]
        q = q / math.sqrt(float(q @ q) + L2NORM_EPS) / math.sqrt(K)
        k = k / math.sqrt(float(k @ k) + L2NORM_EPS)
        beta = 1.0 / (1.0 + math.exp(-float(bw[h] @ x)))
        for j in range(K):
            z = A[h] * (graw[h * K + j] + dt[h * K + j])
            S[h, j, :] *= math.exp(w.lower_bound / (1.0 + math.exp(-z)))
        u = S[h].T @ k
        S[h] += np.outer(k, beta * (v - u))
        o = S[h].T @ q
        o = o / math.sqrt(float(np.mean(o * o)) + w.eps) * f64(w.o_norm)
        g = gw[sl] @ x
        out_heads.append(o / (1.0 + np.exp(-g)))
    out = f64(w.o_proj) @ np.concatenate(out_heads)
    return out, KdaState(conv, S)
