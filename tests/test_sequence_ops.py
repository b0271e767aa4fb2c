"""The sequence path's compiled element-wise kernels against float64 references (math's exp/tanh), every kernel.

Each result is within a few float32 ulp of the exact value, over the whole range the model feeds them
(including the edges: -inf gives exactly 0, underflow, overflow), and the NumPy route (float64, or
the extension absent) computes the same formulas.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest

from kimi_explore.model import mla, ops, sequence_ops


@pytest.fixture(autouse=True)
def kernel():
    if not sequence_ops.AVAILABLE:
        if os.environ.get("KIMI_EXPLORE_REQUIRE_KERNEL") == "1":
            pytest.fail("kimi_explore.model._sequence_ops was not built, and KIMI_EXPLORE_REQUIRE_KERNEL=1")
        pytest.skip("the compiled sequence ops were not built (no C compiler at install)")


@pytest.fixture(params=sequence_ops.isas() or ("portable",))
def isa(request, monkeypatch):
    monkeypatch.setattr(sequence_ops, "ISA", request.param)
    return request.param


def ulps(got, want):
    """|got - want| in float32 ulps of want (want float64; values below 1e-25 compared absolutely, in ulps of 1e-25)."""
    want32 = np.abs(want).astype(np.float32)
    unit = np.spacing(np.maximum(want32, np.float32(1e-25))).astype(np.float64)
    return np.abs(got.astype(np.float64) - want) / unit


def sample(n=20000, spread=30.0, seed=0):
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.standard_normal(n) * spread, rng.uniform(-1, 1, n), rng.uniform(-100, 100, n // 10),
                        [0.0, -0.0, 0.625, -0.625, 1e-8, -1e-8, 86.9, -86.9, 87.5, -87.5, 88.5, -88.5]])
    return x.astype(np.float32)


def test_exp_sigmoid_silu_within_2_ulp(isa):
    x = sample()
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):
        e = np.exp(x64)
        sig = 1.0 / (1.0 + np.exp(-x64))
    keep = (x64 > -87.0) & (x64 < 88.0)  # the documented range; outside it exp is 0 or inf
    got = sequence_ops.exp_(x.copy())
    assert ulps(got[keep], e[keep]).max() <= 2.0
    assert (got[x64 < -87.0] == 0).all() and np.isposinf(got[x64 > 88.0]).all()
    assert ulps(sequence_ops.sigmoid_(x.copy()), sig).max() <= 3.0
    silu = sequence_ops.silu_(x.copy())
    assert ulps(silu, x64 * sig).max() <= 3.0
    assert sequence_ops.exp_(np.array([-np.inf, np.nan], np.float32))[0] == 0.0
    assert np.isnan(sequence_ops.exp_(np.array([-np.inf, np.nan], np.float32))[1])


@pytest.mark.parametrize("a,b", [(3, 40), (0, 53), (53, 53), (10, 11)])
def test_sigmoid_cols_is_sigmoid_of_the_columns(isa, monkeypatch, a, b):
    """A gate's columns of a projection's rows: sigmoid_'s values bit for bit (each row copied then mapped), a new
    C-contiguous array; the NumPy route within float32 rounding."""
    y = sample(n=1000)[: 37 * 53].reshape(37, 53)
    got = sequence_ops.sigmoid_cols(y, a, b)
    assert got.shape == (37, b - a) and got.flags.c_contiguous
    assert np.array_equal(got, sequence_ops.sigmoid_(y[:, a:b].copy()))
    with monkeypatch.context() as m:
        m.setattr(sequence_ops, "AVAILABLE", False)
        numpy_route = sequence_ops.sigmoid_cols(y, a, b)
    assert numpy_route.flags.c_contiguous and np.abs(numpy_route - got).max(initial=0.0) <= 2e-7


@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_and_mul_rows_against_the_float64_formula(isa, linear_beta):
    rng = np.random.default_rng(1)
    gu = (rng.standard_normal((37, 2 * 24)) * np.array([0.01, 1, 8, 60])[rng.integers(0, 4, (37, 1))]).astype(np.float32)
    got = sequence_ops.situ_and_mul_rows(gu[:, :], 4.0, linear_beta, fallback=None)
    want = ops.naive_situ_and_mul(gu, 4.0, linear_beta)
    assert got.dtype == np.float32 and got.shape == (37, 24)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 4e-7 * scale
    assert (ulps(got, want)[np.abs(want) > 1e-3 * scale] <= 8).all()
    # a column slice (not contiguous) and a batch axis
    wide = np.concatenate([gu, gu], axis=1)[:, 48:]
    assert np.array_equal(sequence_ops.situ_and_mul_rows(wide, 4.0, linear_beta, None), got)
    assert np.array_equal(sequence_ops.situ_and_mul_rows(gu.reshape(1, 37, 48), 4.0, linear_beta, None)[0], got)


def test_situ_and_mul_rows_takes_the_fallback_off_float32():
    gu = np.random.default_rng(2).standard_normal((5, 8))
    want = ops.situ_and_mul(gu, 4.0, 25.0)
    assert sequence_ops.situ_and_mul_rows(gu, 4.0, 25.0, lambda a: ops.situ_and_mul(a, 4.0, 25.0)) is not None
    assert np.array_equal(sequence_ops.situ_and_mul_rows(gu, 4.0, 25.0, lambda a: ops.situ_and_mul(a, 4.0, 25.0)), want)


@pytest.mark.parametrize("L0,T", [(0, 1), (0, 9), (5, 3), (40, 17), (0, 70)])
def test_causal_softmax_against_float64(isa, L0, T):
    """Row t of each head: softmax of the scaled scores over positions 0..L0+t, exactly 0 after them."""
    rng = np.random.default_rng(3)
    s = (rng.standard_normal((3, T, L0 + T)) * 6).astype(np.float32)
    scale = 1.0 / math.sqrt(48)
    got = sequence_ops.causal_softmax_(s.copy(), L0, scale)
    want = np.zeros(s.shape)
    for h in range(3):
        for t in range(T):
            x = s[h, t, : L0 + t + 1].astype(np.float64) * scale
            e = np.exp(x - x.max())
            want[h, t, : L0 + t + 1] = e / e.sum()
    assert (got[want == 0] == 0).all()
    assert np.abs(got - want).max() <= 2e-7 and np.abs(got.sum(-1) - 1).max() <= 2e-6
    numpy_route = s.copy()
    numpy_route *= scale
    assert np.abs(mla.causal_softmax_(numpy_route, L0) - got).max() <= 2e-7


def test_causal_softmax_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="C-contiguous float32"):
        sequence_ops.causal_softmax_(np.zeros((1, 2, 2)), 0, 1.0)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        sequence_ops.causal_softmax_(np.zeros((1, 2, 4), np.float32)[:, :, :2], 0, 1.0)


def test_unknown_isa(monkeypatch):
    monkeypatch.setattr(sequence_ops, "ISA", "sse9")
    with pytest.raises(ValueError, match="isa"):
        sequence_ops.exp_(np.zeros(3, np.float32))


@pytest.mark.parametrize("T,W,C,K", [(1, 4, 12, 4), (2, 4, 12, 2), (37, 4, 384, 32), (5, 1, 3, 1), (0, 4, 12, 4), (6, 3, 6, 0)])
def test_kda_conv_against_float64(isa, monkeypatch, T, W, C, K):
    """Row t: SiLU of the W-tap conv over the stored rows then the chunk's, rows t+1 .. t+W (the window after token t),
    read from the input projection's first C columns; the window left holding the last W rows (a chunk shorter than
    the window keeps some stored ones); each group of K channels' norm over each token's window. The NumPy route
    agrees, and advances the window alike."""
    rng = np.random.default_rng(4)
    y = (rng.standard_normal((T, C + 5)) * 2).astype(np.float32)  # the conv reads the first C columns
    window = (rng.standard_normal((3, C // 3, W)) * 2).astype(np.float32)
    taps = rng.standard_normal((W, C)).astype(np.float32)
    ext = np.concatenate((window.reshape(C, W).T, y[:, :C])).astype(np.float64)  # [W + T, C]
    pre = np.stack([sum(ext[t + 1 + j] * taps[j] for j in range(W)) for t in range(T)]) if T else np.zeros((0, C))
    want = pre / (1.0 + np.exp(-pre))
    window_norm = lambda t, g: np.sqrt((ext[t + 1 : t + 1 + W, g * K : (g + 1) * K] ** 2).sum())  # noqa: E731
    norms = [[window_norm(t, g) for g in range(C // K)] for t in range(T)] if K else None
    for route in ("compiled", "numpy"):
        w = window.copy()
        with monkeypatch.context() as m:
            if route == "numpy":
                m.setattr(sequence_ops, "AVAILABLE", False)
            got, got_norms = sequence_ops.kda_conv(y, w, taps, K)
        assert got.shape == (T, C) and got.dtype == np.float32
        assert np.abs(got - want).max(initial=0.0) <= 4e-6 * max(1.0, np.abs(pre).max(initial=0.0)), route
        assert np.array_equal(w, ext[T:].T.reshape(window.shape).astype(np.float32)), route
        if K:
            assert got_norms.shape == (T, C // K) and np.allclose(got_norms, np.reshape(norms, (T, C // K)), rtol=2e-6), route
        else:
            assert got_norms is None


def _numpy_route(monkeypatch, fn, *args):
    """fn(*args) with the kernels off: the NumPy route (float32 arrays, the same formulas)."""
    with monkeypatch.context() as m:
        m.setattr(sequence_ops, "AVAILABLE", False)
        return fn(*args)


@pytest.mark.parametrize("T,H,K", [(1, 4, 32), (37, 3, 24), (5, 2, 7), (0, 4, 32)])
def test_kda_decay_against_the_passes_it_replaces_and_float64(isa, monkeypatch, T, H, K):
    """g = lower_bound sigmoid(A (raw + dt_bias)) in place and alpha = exp(g): g bit for bit the passes it replaces
    (the compiled sigmoid between NumPy's add and multiplies), alpha within 1 ulp of their compiled exp; within
    float32 rounding of the NumPy route and of the float64 formula; the gate's bound (-5 per token) reached where
    sigmoid saturates."""
    rng = np.random.default_rng(5)
    raw = (rng.standard_normal((T, H, K)) * 20).astype(np.float32)
    dt = rng.standard_normal((H, K)).astype(np.float32)
    A = np.ascontiguousarray(np.broadcast_to(rng.uniform(0.5, 16, (H, 1)), (H, K))).astype(np.float32)
    g, alpha = sequence_ops.kda_decay_(raw.copy(), dt, A, -5.0)
    assert g.shape == alpha.shape == (T, H, K) and g.dtype == alpha.dtype == np.float32
    steps = raw + dt  # the five passes the kernel replaces, with the compiled sigmoid and exp
    steps *= A
    sequence_ops.sigmoid_(steps)
    steps *= -5.0
    assert np.array_equal(g, steps)
    # exp's vectorised body and its tail may contract its polynomial differently (FMA): 1 ulp
    assert (ulps(alpha, sequence_ops.exp_(steps.copy()).astype(np.float64)) <= 1).all()
    with np.errstate(over="ignore"):
        g_np, alpha_np = _numpy_route(monkeypatch, sequence_ops.kda_decay_, raw.copy(), dt, A, -5.0)
    assert np.abs(g - g_np).max(initial=0.0) <= 2e-6 and np.abs(alpha - alpha_np).max(initial=0.0) <= 2e-6
    z = (raw.astype(np.float64) + dt) * A
    with np.errstate(over="ignore"):
        want = -5.0 / (1.0 + np.exp(-z))
    assert np.abs(g - want).max(initial=0.0) <= 4e-6
    assert (ulps(alpha, np.exp(want)) <= 64).all()  # exp of g's own rounding (|g| <= 5: ~30 ulp of alpha) plus exp's
    if T > 1:
        assert g.min() == np.float32(-5.0)  # saturated sigmoid: the bound itself


@pytest.mark.parametrize("T,H,K", [(1, 4, 32), (37, 3, 24), (5, 2, 7), (3, 2, 128), (0, 4, 32)])
def test_l2_scale_qk_against_float64_and_the_numpy_route(isa, monkeypatch, T, H, K):
    """q's and k's rows of qkv [T, 3, H, K] over their L2 norm, q's scale folded in (v is not touched)."""
    rng = np.random.default_rng(6)
    qkv = (rng.standard_normal((T, 3, H, K)) * np.array([1e-3, 1, 30])[rng.integers(0, 3, (T, 3, H, 1))]).astype(np.float32)
    scale = np.repeat(np.array([1 / math.sqrt(K), 1.0], np.float32), H)
    got = sequence_ops.l2_scale_qk(qkv, scale, 1e-6)
    x = qkv[:, :2].astype(np.float64)
    want = (x * scale.reshape(2, H, 1) / np.sqrt((x * x).sum(-1, keepdims=True) + np.float32(1e-6))).swapaxes(0, 1)
    assert got.shape == (2, T, H, K) and got.dtype == np.float32 and got[0].flags.c_contiguous
    assert np.abs(got - want).max(initial=0.0) <= 3e-7
    numpy_route = _numpy_route(monkeypatch, sequence_ops.l2_scale_qk, qkv, scale, 1e-6)
    assert np.abs(got - numpy_route).max(initial=0.0) <= 3e-7


@pytest.mark.parametrize("T,H,V", [(1, 4, 32), (37, 3, 24), (5, 2, 7), (3, 2, 128), (0, 4, 32)])
def test_gated_norm_against_float64_and_the_numpy_route(isa, monkeypatch, T, H, V):
    """o * (gain * gate) / sqrt(sum(o^2) + eps) per (token, head) row."""
    rng = np.random.default_rng(7)
    o = (rng.standard_normal((T, H, V)) * np.array([1e-4, 1, 50])[rng.integers(0, 3, (T, H, 1))]).astype(np.float32)
    gate = rng.uniform(0, 1, (T, H, V)).astype(np.float32)
    gain = rng.uniform(0.5, 2, V).astype(np.float32) * np.float32(math.sqrt(V))
    eps = V * 1e-5
    got = sequence_ops.gated_norm(o, gate, gain, eps)
    o64 = o.astype(np.float64)
    want = o64 * (gain * gate.astype(np.float64)) / np.sqrt((o64 * o64).sum(-1, keepdims=True) + np.float32(eps))
    assert got.shape == o.shape and got.dtype == np.float32
    assert np.abs(got - want).max(initial=0.0) <= 4e-7 * math.sqrt(V) * 2
    numpy_route = _numpy_route(monkeypatch, sequence_ops.gated_norm, o, gate, gain, eps)
    assert np.abs(got - numpy_route).max(initial=0.0) <= 4e-7 * math.sqrt(V) * 2


def test_kda_steps_take_the_numpy_route_off_float32():
    """float64 (or a slice that is not contiguous) goes the NumPy way, in its own dtype."""
    rng = np.random.default_rng(8)
    qkv = rng.standard_normal((4, 3, 2, 8))
    scale = np.repeat(np.array([1 / math.sqrt(8), 1.0]), 2)
    got = sequence_ops.l2_scale_qk(qkv, scale, 1e-6)
    assert got.dtype == np.float64
    want = qkv[:, :2] * scale.reshape(2, 2, 1) / np.sqrt((qkv[:, :2] ** 2).sum(-1, keepdims=True) + 1e-6)
    assert np.allclose(got, want.swapaxes(0, 1), rtol=1e-14, atol=0)
    o = rng.standard_normal((4, 2, 8))
    gate = np.asfortranarray(rng.uniform(0, 1, (4, 2, 8)))
    got = sequence_ops.gated_norm(o, gate, np.ones(8), 8e-5)
    assert got.dtype == np.float64
    assert np.allclose(got, o * gate / np.sqrt((o * o).sum(-1, keepdims=True) + 8e-5), rtol=1e-14, atol=0)


@pytest.mark.parametrize("T,S,m,d", [(1, 4, 1, 128), (37, 8, 5, 40), (5, 3, 3, 7), (0, 4, 2, 16), (3, 64, 64, 33)])
def test_source_scores_and_mix_against_float64(isa, T, S, m, d):
    """A chunk's block-residual stacks rows [T, S, d], the first m sources of each: scores rows[t, :m] @ w and mix
    p[t] @ rows[t, :m], within float32 rounding of the exact sums; the NumPy route (float64) is exact to 1e-15."""
    rng = np.random.default_rng(9)
    rows = (rng.standard_normal((T, S, d)) * rng.uniform(0.01, 30, (T, S, 1))).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    p = rng.dirichlet(np.ones(m), T).astype(np.float32) if T else np.zeros((0, m), np.float32)
    r64 = rows[:, :m].astype(np.float64)
    scores = sequence_ops.source_scores(rows, m, w)
    assert scores.shape == (T, m) and scores.dtype == np.float32
    bound = d * 2.0**-24 * (np.abs(r64) @ np.abs(w.astype(np.float64)))  # a float32 dot's rounding, any order
    assert (np.abs(scores - r64 @ w.astype(np.float64)) <= bound + 1e-30).all()
    mix = sequence_ops.source_mix(rows, p)
    want = np.einsum("tm,tmd->td", p.astype(np.float64), r64)
    assert mix.shape == (T, d) and mix.dtype == np.float32
    assert (np.abs(mix - want) <= m * 2.0**-23 * np.einsum("tm,tmd->td", p.astype(np.float64), np.abs(r64)) + 1e-30).all()
    assert np.allclose(sequence_ops.source_scores(rows.astype(np.float64), m, w.astype(np.float64)),
                       r64 @ w.astype(np.float64), rtol=1e-14, atol=1e-12)
    assert np.allclose(sequence_ops.source_mix(rows.astype(np.float64), p.astype(np.float64)), want, rtol=1e-14, atol=1e-12)


def _attention_float64(q, keys, values, L0: int, scale: float):
    """The token form's attention, query by query, in float64: query t over positions 0 .. L0 + t only."""
    T, nh, _ = q.shape
    q64, k64, v64 = (a.astype(np.float64) for a in (q, keys, values))
    out = np.empty((T, nh, values.shape[2]))
    with np.errstate(invalid="ignore"):  # the planted inf: NaN rows, as the token form's
        for t in range(T):
            for h in range(nh):
                x = k64[h, : L0 + t + 1] @ q64[t, h] * scale
                e = np.exp(x - x.max())
                out[t, h] = e @ v64[h, : L0 + t + 1] / e.sum()
    return out


@pytest.mark.parametrize("T,L0,nh,dq,dv", [(1, 0, 4, 48, 32), (1, 9, 2, 48, 32), (5, 3, 4, 48, 32), (33, 0, 3, 19, 13),
                                           (70, 100, 4, 48, 32), (40, 7, 2, 48, 35), (64, 64, 1, 8, 8)])
def test_causal_attention_against_float64(isa, T, L0, nh, dq, dv):
    """MLA's fused attention of a chunk (T queries after L0 cached positions, query blocks of 16 or 32 lanes, dims
    not multiples of the lanes or of 8 value columns): each query's softmax over the positions it sees, mixed; within
    float32 rounding of the float64 token form. The cache's capacity beyond L0 + T is never read (NaN there)."""
    rng = np.random.default_rng(T + L0)
    cap = L0 + T + 5
    q = (rng.standard_normal((T, nh, dq)) * 0.6).astype(np.float32)
    keys = (rng.standard_normal((nh, cap, dq)) * 0.6).astype(np.float32)
    values = rng.standard_normal((nh, cap, dv)).astype(np.float32)
    keys[:, L0 + T :] = values[:, L0 + T :] = np.nan
    scale = 1.0 / math.sqrt(dq)
    got = sequence_ops.causal_attention(q, keys, values, L0, scale)
    assert got.shape == (T, nh, dv) and got.dtype == np.float32
    assert np.abs(got - _attention_float64(q, keys, values, L0, scale)).max() <= 3e-6


def test_causal_attention_keeps_a_later_non_finite_value_out_of_earlier_queries(isa):
    """A NaN value at chunk position 20 (head 0) and an inf key at 30 (head 1): the queries before each are untouched
    (a masked lane's product is selected away, not multiplied by 0), the later ones non-finite where the token form's
    are, query by query (the inf key's score is +inf or -inf by the query's sign: NaN rows, or that position's
    probability 0)."""
    rng = np.random.default_rng(2)
    T, L0, nh, dq, dv = 40, 5, 2, 48, 32
    q = rng.standard_normal((T, nh, dq)).astype(np.float32)
    keys = rng.standard_normal((nh, L0 + T, dq)).astype(np.float32)
    values = rng.standard_normal((nh, L0 + T, dv)).astype(np.float32)
    values[0, L0 + 20, 3] = np.nan
    keys[1, L0 + 30, 0] = np.inf
    got = sequence_ops.causal_attention(q, keys, values, L0, 0.2)
    want = _attention_float64(q, keys, values, L0, 0.2)
    assert (np.isnan(got) == np.isnan(want)).all()
    assert np.isfinite(got[:20, 0]).all() and np.isnan(got[20:, 0, 3]).all() and np.isfinite(got[:30, 1]).all()
    finite = np.isfinite(want)
    assert np.abs(got[finite] - want[finite]).max() <= 3e-6


def test_causal_attention_takes_the_numpy_route_or_refuses():
    """Off float32 (or non-contiguous) the wrapper returns None (the caller's route); the binding refuses a cache too
    short for the chunk or buffers of the wrong size, naming what it expected."""
    q, keys, values = np.zeros((3, 2, 4), np.float32), np.zeros((2, 8, 4), np.float32), np.zeros((2, 8, 5), np.float32)
    assert sequence_ops.causal_attention(q.astype(np.float64), keys, values, 0, 1.0) is None
    assert sequence_ops.causal_attention(q, keys[:, ::2], values, 0, 1.0) is None
    from kimi_explore.model import _sequence_ops as ext

    out = np.empty((3, 2, 5), np.float32)
    with pytest.raises(ValueError, match=r"L0 \+ T <= cap"):
        ext.causal_attention(q, keys, values, out, 3, 2, 4, 5, 8, 6, 1.0, "")
    with pytest.raises(ValueError, match=r"out \[T, nh, dv\]"):
        ext.causal_attention(q, keys, values, out[:2], 3, 2, 4, 5, 8, 0, 1.0, "")


def _situ_partial(beta, linear_beta):
    return functools.partial(sequence_ops.situ_and_mul_rows, beta=beta, linear_beta=linear_beta, fallback=None)


@pytest.mark.parametrize("linear_beta", [25.0, None])
@pytest.mark.parametrize("E,l,I,T,k", [(16, 64, 64, 300, 2), (5, 7, 5, 70, 3), (3, 33, 9, 1, 2), (4, 8, 4, 0, 2)])
def test_experts_grouped_against_float64(isa, linear_beta, E, l, I, T, k):
    """A chunk's routed experts, dense float32, grouped by expert (groups of 1 to ~100 selections: blocks of 16/32
    lanes and their tails; dims not multiples of the 4-column passes; a dropped selection, -1): each selection's
    w2_e SiTU-GLU(w13_e z[t]) within float32 rounding of the float64 formula; the rows follow the groups' order."""
    from kimi_explore.model.latent_moe import group_selections

    rng = np.random.default_rng(E + l + T)
    z = rng.standard_normal((T, l)).astype(np.float32)
    w13 = (rng.standard_normal((E, 2 * I, l)) / math.sqrt(l) * 3).astype(np.float32)
    w2 = (rng.standard_normal((E, l, I)) / math.sqrt(I)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]) if T else np.zeros((0, k), np.int64)
    if T > 1:
        ids[1, 0] = -1
    groups = group_selections(ids)
    got = sequence_ops.experts_grouped(groups, z, w13, w2, _situ_partial(4.0, linear_beta))
    assert got.shape == (groups.n, l) and got.dtype == np.float32
    flat = ids.reshape(-1)
    for i, (sel, t) in enumerate(zip(groups.order, groups.rows, strict=True)):
        e = flat[sel]
        h = w13[e].astype(np.float64) @ z[t].astype(np.float64)
        want = w2[e].astype(np.float64) @ ops.naive_situ_and_mul(h, 4.0, linear_beta)
        assert np.abs(got[i] - want).max() <= 2e-6 * max(1.0, np.abs(want).max()), (i, e, t)


def test_experts_grouped_takes_the_matmul_route_or_refuses():
    """Another activation, float64 or a strided bank: None (the caller's matmuls); the binding refuses an index out
    of range rather than read outside the buffers."""
    from kimi_explore.model import _sequence_ops as ext
    from kimi_explore.model.latent_moe import group_selections

    z, w13, w2 = np.ones((2, 4), np.float32), np.ones((3, 6, 4), np.float32), np.ones((3, 4, 3), np.float32)
    groups = group_selections(np.array([[0, 2], [1, 2]]))
    act = _situ_partial(4.0, None)
    assert sequence_ops.experts_grouped(groups, z, w13, w2, lambda h: h) is None
    assert sequence_ops.experts_grouped(groups, z.astype(np.float64), w13, w2, act) is None
    assert sequence_ops.experts_grouped(groups, z, w13[:, ::2], w2, act) is None
    assert sequence_ops.experts_grouped(groups, z, w13, w2, act).shape == (4, 4)
    y = np.empty((4, 4), np.float32)
    rows, bounds, experts = np.array([0, 1, 0, 1]), np.array([0, 1, 2, 4]), np.array([0, 1, 2])
    for bad in (dict(rows=np.array([0, 1, 0, 2])), dict(experts=np.array([0, 1, 3])), dict(bounds=np.array([0, 1, 2, 3]))):
        args = {"rows": rows, "bounds": bounds, "experts": experts} | bad
        with pytest.raises(ValueError, match="rows int64 \\[n\\] in 0..T-1"):
            ext.experts(z, args["rows"], args["bounds"], args["experts"], w13, w2, y, 2, 4, 3, 3, 0.25, 1.0, 4.0, False, "")


def test_causal_attention_normalises_before_the_mix():
    """Found by review: the kernel divided by the softmax sum after mixing, so sum_j e_j v_j overflowed where the token
    form's normalised mix stays finite (values 3e37 over 12 positions; 2e35 over 3,000): inf for 3e37."""
    T, nh, dq, dv = 4, 1, 8, 3
    for L0, v in ((8, 3e37), (2996, 2e35)):
        q = np.zeros((T, nh, dq), np.float32)  # every score 0: uniform probabilities
        keys = np.ones((nh, L0 + T, dq), np.float32)
        values = np.full((nh, L0 + T, dv), v, np.float32)
        got = sequence_ops.causal_attention(q, keys, values, L0, 0.1)
        assert np.isfinite(got).all() and np.abs(got / v - 1).max() <= 1e-3, (L0, got.max())


def test_experts_grouped_falls_back_on_what_it_cannot_take():
    """Found by review: a w2 laid out [E, I, l] (same size) ran on wrong values, a partial without its constants raised
    KeyError; both now take the caller's route (None), which names what is wrong. A column slice of z (the layer's
    latents) runs, as a copy."""
    from kimi_explore.model.latent_moe import group_selections

    rng = np.random.default_rng(0)
    E, l, I = 3, 6, 4
    z = rng.standard_normal((5, l + 2)).astype(np.float32)[:, 1 : l + 1]
    w13, w2 = rng.standard_normal((E, 2 * I, l)).astype(np.float32), rng.standard_normal((E, l, I)).astype(np.float32)
    groups = group_selections(np.array([[0, 1], [2, 1], [0, 2], [1, 0], [2, 0]]))
    act = _situ_partial(4.0, None)
    assert sequence_ops.experts_grouped(groups, z, w13, np.ascontiguousarray(w2.swapaxes(1, 2)), act) is None
    assert sequence_ops.experts_grouped(groups, z, w13, w2, functools.partial(sequence_ops.situ_and_mul_rows)) is None
    got = sequence_ops.experts_grouped(groups, z, w13, w2, act)
    want = sequence_ops.experts_grouped(groups, np.ascontiguousarray(z), w13, w2, act)
    assert got is not None and np.array_equal(got, want)


@pytest.mark.parametrize("T,k,E", [(512, 2, 16), (1, 2, 16), (9, 3, 5), (300, 16, 896)])
def test_group_ids_is_the_stable_sort_by_expert(monkeypatch, T, k, E):
    """A chunk's selections grouped by expert in one counting sort: the NumPy route's stable argsort (the selections
    ascending within an expert), the dropped (-1) left out, each selected expert once with its segment; the groups a
    bank reads (`latent_moe.group_selections`) are the same either way."""
    from kimi_explore.model.latent_moe import group_selections

    rng = np.random.default_rng(T)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    ids[rng.random(ids.shape) < 0.1] = -1  # dropped selections (an ablation)
    flat = ids.reshape(-1)
    order, experts, bounds = sequence_ops.group_ids(flat)
    want = np.argsort(flat, kind="stable")[np.count_nonzero(flat < 0) :]
    assert np.array_equal(order, want) and experts == sorted(set(flat[flat >= 0].tolist()))
    assert bounds == [0, *np.cumsum([np.count_nonzero(flat == e) for e in experts]).tolist()]
    got = group_selections(ids)
    monkeypatch.setattr(sequence_ops, "AVAILABLE", False)
    numpy_route = group_selections(ids)
    assert (got.experts, got.bounds) == (numpy_route.experts, numpy_route.bounds)
    assert np.array_equal(got.order, numpy_route.order) and np.array_equal(got.rows, numpy_route.rows)


def test_group_ids_leaves_what_it_cannot_take_to_the_argsort():
    assert sequence_ops.group_ids(np.array([-1, -1])) is None  # every selection dropped
    assert sequence_ops.group_ids(np.array([0, -2, 1])) is None  # not an id
    assert sequence_ops.group_ids(np.zeros(0, np.int64)) is None
    assert sequence_ops.group_ids(np.array([0.0, 1.0])) is None  # not integers


@pytest.mark.parametrize("T", [1, 2, 3, 4, 9, 64])
def test_kda_conv_w4_is_the_general_loop_bit_for_bit(isa, T):
    """The W == 4 register path against the general loop, bit for bit: the same conv as W = 5 with a zero oldest tap
    (its product an exact zero, so each later tap is the general loop's multiply-add, fused where the ISA fuses, in
    the same order)."""
    rng = np.random.default_rng(T)
    C = 3 * 40
    y = (rng.standard_normal((T, C + 3)) * 2).astype(np.float32)
    window4 = (rng.standard_normal((3, C // 3, 4)) * 2).astype(np.float32)
    taps4 = rng.standard_normal((4, C)).astype(np.float32)
    window5 = np.concatenate((np.ones((3, C // 3, 1), np.float32), window4), axis=-1)  # one older row, weighed by 0
    taps5 = np.concatenate((np.zeros((1, C), np.float32), taps4))
    got4, _ = sequence_ops.kda_conv(y, window4.copy(), taps4)
    got5, _ = sequence_ops.kda_conv(y, window5.copy(), taps5)
    assert np.array_equal(got4, got5)
