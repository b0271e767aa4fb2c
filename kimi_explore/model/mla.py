"""Gated NoPE Multi-head Latent Attention (MLA): one decode token through one MLA layer.

Shapes: nh heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, dq = dn + dr.

    q      = q_b_proj(rmsnorm_1e-6(q_a_proj(x)))                         [nh, dq]
    c, kpe = kv_a_proj_with_mqa(x) split [kv_lora | dr]
    kv     = kv_b_proj(rmsnorm_1e-6(c))                                  [nh, dn + dv]
    k_h    = [kv_h[:dn] | kpe]  (kpe shared by all heads, NOT normalised) [nh, dq];  v_h = kv_h[dn:]
    append (k, v) to the cache, then p_h = softmax_s(q_h . k_h(s) / sqrt(dq)) over every cached s
    out    = o_proj( flatten(sum_s p_h(s) v_h(s)) * sigmoid(g_proj(x)) )

Traps: no rotary embedding anywhere, but the dr "rope" dims are still scored and cached; the
softmax scale is 1/sqrt(dn + dr), not 1/sqrt(dn); the q_a/kv_a norms use eps 1e-6 (the class
default), not rms_norm_eps. The cache holds decompressed per-head K/V, as HF does.

`mla_sequence` runs T tokens at once: the projections for all rows, the T positions appended in one
go (`MlaState.append_many`, the same doubling, so the same capacity as T appends), then causal
attention of the T queries over the L0 cached positions plus the chunk: query t sees positions
0..L0+t, the later ones masked to -inf (probability exactly 0). Unless a hook wants the whole
chunk's probabilities, the probabilities are never stored: on the CPU in float32 one compiled kernel
scores, normalises and mixes 16-32 queries at a time in cache (`sequence_ops.causal_attention`: 2x
the matmul route at the embedded model's widths, 1.2-1.7x at K3's); elsewhere the queries go
QUERY_BLOCK at a time, each block scored against the positions its last query sees. Either way the
masked products above the diagonal are mostly never computed (a chunk of T scores ~L0 T + T^2 / 2
pairs instead of L0 T + T^2), and every row's softmax takes the token form's steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .._xp import array_namespace
from ..backend import to_numpy
from . import sequence_ops, token_ops
from .ops import linear, rms_norm, sigmoid, softmax
from .sites import site_table

LATENT_NORM_EPS = 1e-6
QUERY_BLOCK = 128  # query rows per block of `mla_sequence`'s scores (where no hook reads the whole probabilities)


@dataclass
class MlaWeights:
    """One MLA layer.

    in_proj:        [q_lora + kv_lora + dr (+ nh*dv), d]  rows q_a_proj | kv_a_proj_with_mqa | g_proj (if gated)
    q_a_layernorm:  [q_lora]
    q_b_proj:       [nh*dq, q_lora]
    kv_a_layernorm: [kv_lora]
    kv_b_proj:      [nh*(dn+dv), kv_lora]
    o_proj:         [d, nh*dv]
    """

    kind: ClassVar[str] = "mla"
    in_proj: object
    q_a_layernorm: object
    q_b_proj: object
    kv_a_layernorm: object
    kv_b_proj: object
    o_proj: object
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    use_output_gate: bool

    def __post_init__(self):
        # the step's scalars as 0-d arrays of the compute dtype (derived, never loaded): the same rounding as
        # the Python floats, NumPy's cheaper operand
        c = lambda v: array_namespace(self.q_a_layernorm).asarray(v, dtype=self.q_a_layernorm.dtype)  # noqa: E731
        self.score_scale_f = 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)  # (the compiled softmax's)
        self.one, self.score_scale = c(1.0), c(self.score_scale_f)


def cache_array(a, n: int, capacity: int):
    """A cache array [heads, capacity, dim] holding `a`'s first n positions, zeros after: allocated zeroed (on the
    host, pages the OS maps when first written), then the n positions copied in, so the unwritten tail of a doubled
    cache costs address space, not memory (a copy, or a concatenation with zeros, wrote it all)."""
    out = array_namespace(a).zeros((a.shape[0], capacity, *a.shape[2:]), a.dtype)
    out[:, :n] = a[:, :n]
    return out


@dataclass
class MlaState:
    """K/V cache of one MLA layer, grown by doubling.

    keys:   [nh, capacity, dq];  values: [nh, capacity, dv];  length: cached positions
    """

    kind: ClassVar[str] = "mla"
    keys: object
    values: object
    length: int = 0

    @classmethod
    def empty(cls, w: MlaWeights, xp, dtype, capacity: int = 16) -> MlaState:
        dq = w.qk_nope_head_dim + w.qk_rope_head_dim
        return cls(xp.zeros((w.num_heads, capacity, dq), dtype), xp.zeros((w.num_heads, capacity, w.v_head_dim), dtype))

    def append(self, k_nope, k_pe, v) -> None:
        """k_nope: [nh, dn]; k_pe: [dr], shared by every head; v: [nh, dv]. Keys are stored [k_nope | k_pe]."""
        t = self.length
        if t == self.keys.shape[1]:
            self._grow(t + 1)
        dn = k_nope.shape[-1]
        self.keys[:, t, :dn] = k_nope
        self.keys[:, t, dn:] = k_pe  # broadcast over heads
        self.values[:, t] = v
        self.length = t + 1

    def append_many(self, k_nope, k_pe, v) -> None:
        """k_nope: [T, nh, dn]; k_pe: [T, dr], shared by every head; v: [T, nh, dv]: T positions at once, the
        capacity doubled (as often as T `append` calls would) until they fit."""
        t, T = self.length, k_nope.shape[0]
        if t + T > self.keys.shape[1]:
            self._grow(t + T)
        dn = k_nope.shape[-1]
        self.keys[:, t : t + T, :dn] = k_nope.swapaxes(0, 1)
        self.keys[:, t : t + T, dn:] = k_pe[None]  # broadcast over heads
        self.values[:, t : t + T] = v.swapaxes(0, 1)
        self.length = t + T

    def _grow(self, need: int) -> None:
        """Keys and values moved into arrays of the capacity doubled (from at least 1) until `need` positions fit, the new
        ones zero: allocated zeroed, then the old positions copied in (a concatenation with zeros copied the zeros too)."""
        capacity = max(self.keys.shape[1], 1)
        while capacity < need:
            capacity *= 2
        old = self.keys.shape[1]
        self.keys, self.values = cache_array(self.keys, old, capacity), cache_array(self.values, old, capacity)

    def copy(self) -> MlaState:
        """An exact copy: the whole capacity, not just the used positions. A compacted cache would give
        the score and mix matmuls other strides, which may round differently: replays must be exact.
        Positions from `length` on are zero in the copy, as in a cache that was never shared (`checkpoint`): allocated
        zeroed (on the host, pages the OS maps when first written), only the used positions copied in, so a cache
        doubled by one step past a long feed costs its length, not its capacity."""
        n, capacity = self.length, self.keys.shape[1]
        return MlaState(cache_array(self.keys, n, capacity), cache_array(self.values, n, capacity), n)

    def checkpoint(self) -> MlaState:
        """What a kept checkpoint holds: these arrays, not a copy of them. A cache only ever appends (into
        these arrays, or into grown new ones), so its first `length` positions never change, and they are all
        a checkpoint reads: it is never decoded on, only `copy()`-ed. So a session's checkpoints of one
        history share its cache, where copies would hold T^2/(2 C) positions over T tokens fed C at a time
        (K3: ~3 MB per position)."""
        return MlaState(self.keys, self.values, self.length)


def mla_step(x, w: MlaWeights, state: MlaState, hooks=None, names=None):
    """x: [d] (input_layernorm output) -> [d]; appends this token to `state`.

    hooks/names: the hooks at each listened-to site (`site_table(hooks, names)`) of `ATTENTION_SITES["mla"]`; a returned value
    is used downstream: the normalised latents (`mla.q_latent` [q_lora], `mla.kv_latent` [kv_lora]), the
    attention probabilities over the cache (`mla.probs` [nh, T]), the heads' output before the gate
    (`mla.o` [nh, dv]).
    """
    xp = array_namespace(x)
    nh, dn, dr, dv = w.num_heads, w.qk_nope_head_dim, w.qk_rope_head_dim, w.v_head_dim
    ql, kl = w.q_lora_rank, w.kv_lora_rank
    at = site_table(hooks, names)
    y = w.in_proj @ x
    q_lat = rms_norm(y[:ql], w.q_a_layernorm, LATENT_NORM_EPS)
    kv_lat = rms_norm(y[ql : ql + kl], w.kv_a_layernorm, LATENT_NORM_EPS)
    if "mla.q_latent" in at:
        q_lat = at["mla.q_latent"](q_lat)
    if "mla.kv_latent" in at:
        kv_lat = at["mla.kv_latent"](kv_lat)
    q = (w.q_b_proj @ q_lat).reshape(nh, dn + dr)
    kv = (w.kv_b_proj @ kv_lat).reshape(nh, dn + dv)
    gate = sigmoid(y[ql + kl + dr :], w.one) if w.use_output_gate else None
    state.append(kv[:, :dn], y[ql + kl : ql + kl + dr], kv[:, dn:])  # k_pe is NOT normalised
    T = state.length
    scores = xp.matmul(state.keys[:, :T], q[:, :, None])[:, :, 0]  # [nh, T]
    if token_ops.runs(scores):  # the line below in one compiled call
        p = token_ops.softmax_rows_(scores, w.score_scale_f)
    else:
        p = softmax(scores * w.score_scale)  # 1/sqrt(dn + dr)
    if "mla.probs" in at:
        p = at["mla.probs"](p)
    o = xp.matmul(p[:, None, :], state.values[:, :T])[:, 0]  # [nh, dv]
    if "mla.o" in at:
        o = at["mla.o"](o)
    o = o.reshape(-1)
    if gate is not None:
        o = o * gate
    return w.o_proj @ o


def mla_sequence(x, w: MlaWeights, state: MlaState, *, fire=None, names=None, fire_probs: bool = True):
    """x: [T, d] (input_layernorm outputs) -> [T, d]; appends the T tokens to `state`.

    fire(name, value) -> value, when given, sees whole-chunk arrays at the token form's sites, in its
    order, named names[kind] (None: the kinds): mla.q_latent [T, q_lora], mla.kv_latent [T, kv_lora],
    mla.probs [T, nh, L0 + T] (token t's row is the token form's [nh, L0 + t + 1] followed by zeros, the
    masked positions; fired only with fire_probs: False when nothing listens there, which lets the
    scores go QUERY_BLOCK queries at a time), mla.o [T, nh, dv]. A returned array is used downstream as
    it is.
    """
    xp = array_namespace(x)
    site = (lambda kind: kind) if names is None else names.__getitem__  # noqa: E731
    nh, dn, dr, dv = w.num_heads, w.qk_nope_head_dim, w.qk_rope_head_dim, w.v_head_dim
    ql, kl, T = w.q_lora_rank, w.kv_lora_rank, x.shape[0]
    y = linear(x, w.in_proj)
    q_lat = rms_norm(y[:, :ql], w.q_a_layernorm, LATENT_NORM_EPS)
    kv_lat = rms_norm(y[:, ql : ql + kl], w.kv_a_layernorm, LATENT_NORM_EPS)
    if fire is not None:
        q_lat, kv_lat = fire(site("mla.q_latent"), q_lat), fire(site("mla.kv_latent"), kv_lat)
    q = linear(q_lat, w.q_b_proj).reshape(T, nh, dn + dr)
    kv = linear(kv_lat, w.kv_b_proj).reshape(T, nh, dn + dv)
    gate = sequence_ops.sigmoid_cols(y, ql + kl + dr, y.shape[1]) if w.use_output_gate else None
    L0 = state.length
    state.append_many(kv[:, :, :dn], y[:, ql + kl : ql + kl + dr], kv[:, :, dn:])  # k_pe is NOT normalised
    scale = 1.0 / math.sqrt(dn + dr)
    qh = q.swapaxes(0, 1)  # [nh, T, dq]
    probs = fire is not None and fire_probs
    o = None if probs else sequence_ops.causal_attention(q, state.keys, state.values, L0, scale)  # fused: [T, nh, dv]
    if probs:
        p = _causal_probs(qh, state, L0, scale)  # [nh, T, L0 + T]
        p = fire(site("mla.probs"), p.swapaxes(0, 1)).swapaxes(0, 1)
        _check_causal(p, L0, site("mla.probs"))
        o = _causal_mix(p, state.values, L0, _later_finite(state, L0, T)).swapaxes(0, 1)  # [T, nh, dv]
    elif o is None:
        finite = _later_finite(state, L0, T)
        o = xp.empty((nh, T, dv), dtype=q.dtype)
        for a in range(0, T, QUERY_BLOCK):  # queries a..b-1 see positions up to L0 + b - 1
            b = min(T, a + QUERY_BLOCK)
            _causal_mix(_causal_probs(qh[:, a:b], state, L0 + a, scale), state.values, L0 + a, finite, out=o[:, a:b])
        o = o.swapaxes(0, 1)
    if fire is not None:
        o = fire(site("mla.o"), o)
    o = o.reshape(T, nh * dv)
    if gate is not None:
        o = o * gate
    return linear(o, w.o_proj)


def _check_causal(p, L0: int, name: str) -> None:
    """Refuse probabilities p [nh, T, L0 + T] that a hook left nonzero at a position after its token (token t
    sees 0 .. L0 + t): the chunk would attend to tokens the token form has not seen yet. One check per
    chunk, on the heads' max and min (one transfer on a GPU); it runs only where a hook listens."""
    xp = array_namespace(p)
    T, L = p.shape[1], p.shape[2]
    if T < 2:  # a single token sees the whole cache
        return
    future = xp.arange(L)[None, :] > (L0 + xp.arange(T))[:, None]  # [T, L]
    bad = future & ((p.max(axis=0) != 0) | (p.min(axis=0) != 0))  # NaN counts too
    if bool(to_numpy(bad.any())):
        t = int(to_numpy(xp.argmax(bad.any(axis=1))))
        raise ValueError(f"{name}: a hook left nonzero probabilities (or NaN) at positions after token {t} of the "
                         f"chunk (position {L0 + t}): token t of a chunk sees cache positions 0 .. L0 + t, the rest of "
                         "its row must stay 0 (masked), or the chunk attends to tokens not decoded yet")


def _later_finite(state: MlaState, L0: int, T: int) -> bool:
    """Whether the values of a chunk's positions after its first (L0 + 1 .. L0 + T - 1) are all finite: else a NaN
    or inf value of a later token would reach an earlier query through its masked 0 (0 * inf = NaN), `_causal_mix`."""
    return T < 2 or bool(to_numpy(array_namespace(state.values).isfinite(state.values[:, L0 + 1 : L0 + T]).all()))


def _causal_mix(p, values, L0: int, finite: bool, out=None):
    """o [nh, n, dv] = p [nh, n, L0 + n] @ values[:, :L0 + n] for queries at positions L0 .. L0 + n - 1.

    A masked probability is exactly 0, but 0 times a NaN or inf value is NaN: one later token's non-finite
    value would poison every earlier query of the chunk, which the token form never sees. Where the chunk's
    values are not all finite (`finite` False), each query mixes only the positions it sees (the token form's
    product), so a NaN reaches the logits from its own token on, as when stepping."""
    xp = array_namespace(p)
    n = p.shape[1]
    if finite or n < 2:
        return xp.matmul(p, values[:, : L0 + n], out=out)
    out = xp.empty(p.shape[:2] + (values.shape[-1],), p.dtype) if out is None else out
    for t in range(n):
        out[:, t] = xp.matmul(p[:, t, None, : L0 + t + 1], values[:, : L0 + t + 1])[:, 0]
    return out


def _causal_probs(qh, state: MlaState, L0: int, scale: float):
    """Queries qh [nh, n, dq] at positions L0 .. L0 + n - 1 over the cache's first L0 + n positions: the
    probabilities [nh, n, L0 + n] (query t sees positions 0 .. L0 + t)."""
    scores = array_namespace(qh).matmul(qh, state.keys[:, : L0 + qh.shape[1]].swapaxes(1, 2))
    if sequence_ops.runs(scores):
        return sequence_ops.causal_softmax_(scores, L0, scale)  # the same steps compiled, one pass per row
    scores *= scale
    return causal_softmax_(scores, L0)


def causal_softmax_(scores, L0: int):
    """In place on scores [nh, T, L0 + T]: query t sees positions 0 .. L0 + t; returns the softmax probabilities.

    The token form's `softmax` over each query's visible positions, the same operations in the same order
    (a masked position is -inf, so exp gives 0 and the visible sums are unchanged), without temporaries
    the size of the scores; a few heads at a time, so that each block's passes stay in cache."""
    xp = array_namespace(scores)
    nh, T, L = scores.shape
    future = _future(xp, T)  # [T, T]: the chunk's later tokens
    step = max(1, (1 << 18) // max(1, T * L))  # heads per block: ~1 MB of float32 scores
    for a in range(0, nh, step):
        s = scores[a : a + step]
        xp.copyto(s[:, :, L0:], -math.inf, where=future)
        s -= s.max(axis=-1, keepdims=True)
        xp.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        # a row whose max is NaN (or -inf: nothing visible but -inf) gave its masked positions exp(-inf - NaN) = NaN:
        # they stay exactly 0, as the compiled kernel leaves them (the hooks' `_check_causal` refuses anything else)
        xp.copyto(s[:, :, L0:], 0.0, where=future)
    return scores


_FUTURE: dict = {}  # (namespace, its device, T) -> [T, T] bool, True above the diagonal (once per chunk size)


def _future(xp, T: int):
    device = xp.cuda.Device().id if hasattr(xp, "cuda") else None  # (CuPy: a mask made on GPU 0 is not GPU 1's)
    key = (xp, device, T)
    m = _FUTURE.get(key)
    if m is None:
        if len(_FUTURE) > 16:
            _FUTURE.clear()
        m = _FUTURE[key] = xp.triu(xp.ones((T, T), dtype=bool), 1)
    return m


def naive_mla_prefill(xs, w: MlaWeights):
    """Float64 reference: full causal attention over a whole sequence xs [T, d] -> [T, d].

    Projects each token on its own, then attends head by head with an explicit causal mask.
    """
    f64 = lambda a: np.asarray(to_numpy(a), dtype=np.float64)  # noqa: E731
    xs = f64(xs)
    nh, dn, dr, dv = w.num_heads, w.qk_nope_head_dim, w.qk_rope_head_dim, w.v_head_dim
    ql, kl = w.q_lora_rank, w.kv_lora_rank
    Win = f64(w.in_proj)

    def norm(a, g):
        return a / math.sqrt(float(np.mean(a * a)) + LATENT_NORM_EPS) * f64(g)

    T = xs.shape[0]
    Q, Kc, Vc, G = np.zeros((T, nh, dn + dr)), np.zeros((T, nh, dn + dr)), np.zeros((T, nh, dv)), []
    for t in range(T):
        y = Win @ xs[t]
        q = f64(w.q_b_proj) @ norm(y[:ql], w.q_a_layernorm)
        kv = f64(w.kv_b_proj) @ norm(y[ql : ql + kl], w.kv_a_layernorm)
        kpe = y[ql + kl : ql + kl + dr]
        for h in range(nh):
            Q[t, h] = q[h * (dn + dr) : (h + 1) * (dn + dr)]
            Kc[t, h] = np.concatenate([kv[h * (dn + dv) : h * (dn + dv) + dn], kpe])
            Vc[t, h] = kv[h * (dn + dv) + dn : (h + 1) * (dn + dv)]
        G.append(1.0 / (1.0 + np.exp(-y[ql + kl + dr :])) if w.use_output_gate else np.ones(nh * dv))
    out = np.zeros((T, f64(w.o_proj).shape[0]))
    for t in range(T):
        heads = []
        for h in range(nh):
            s = np.array([Q[t, h] @ Kc[s, h] for s in range(t + 1)]) / math.sqrt(dn + dr)
            p = np.exp(s - s.max())
            p /= p.sum()
            heads.append(sum(p[s] * Vc[s, h] for s in range(t + 1)))
        out[t] = f64(w.o_proj) @ (np.concatenate(heads) * G[t])
    return out
