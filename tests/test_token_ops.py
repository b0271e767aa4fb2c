"""The token form's compiled small steps (model/_token_ops.c) against float64 references, each step (evaluated in
double and rounded once, each output is the float32 nearest its exact value: <= 0.5 ulp, plus a hair), and in
the decoder: the NumPy formulation of the same steps (the extension hidden) agrees to float32 rounding.

References are written here from the formulas (math's exp and tanh, Python sorting), not from the kernels.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from kimi_explore import KimiDecodeState, kimi_forward_token
from kimi_explore.model import latent_moe, token_ops
from kimi_explore.model.block_residual import SourceBuffer, naive_apply_attn_res


@pytest.fixture(autouse=True)
def kernel():
    if not token_ops.AVAILABLE:
        if os.environ.get("KIMI_EXPLORE_REQUIRE_KERNEL") == "1":
            pytest.fail("kimi_explore.model._token_ops was not built, and KIMI_EXPLORE_REQUIRE_KERNEL=1")
        pytest.skip("the compiled token steps were not built (no C compiler at install)")


def ulps(got, want):
    """|got - want| in float32 ulps of want (float64), values below 1e-25 in ulps of 1e-25."""
    unit = np.spacing(np.maximum(np.abs(want).astype(np.float32), np.float32(1e-25))).astype(np.float64)
    return np.abs(np.asarray(got, np.float64) - want) / unit


RNG = np.random.default_rng(5)


def test_rms_norm_within_an_ulp_or_two():
    for n, spread in ((64, 1.0), (128, 1e-3), (7168, 30.0)):
        x = (RNG.standard_normal(n) * spread).astype(np.float32)
        w = RNG.uniform(0.5, 2.0, n).astype(np.float32)
        x64 = x.astype(np.float64)
        r = 1.0 / math.sqrt(float(x64 @ x64) / n + 1e-5)
        assert ulps(token_ops.rms_norm(x, w, 1e-5), x64 * w.astype(np.float64) * r).max() <= 0.501


@pytest.mark.parametrize("rows,n", [(1, 128), (3, 7), (4, 33), (9, 128), (513, 64)])
def test_rms_norm_gives_the_same_values_on_every_isa(rows, n):
    """The RMSNorm's AVX-512 and AVX2 builds (a chunk's rows, 4 at a time) give portable C's values, bit for bit,
    and each row its own one-row call's."""
    x = (RNG.standard_normal((rows, n)) * RNG.uniform(1e-3, 100, (rows, 1))).astype(np.float32)
    w = RNG.standard_normal(n).astype(np.float32)
    want = np.empty_like(x)
    token_ops._ext.rms_norm(x, w, 1e-5, want, "portable")
    for isa in token_ops.isas():
        got = np.empty_like(x)
        token_ops._ext.rms_norm(x, w, 1e-5, got, isa)
        assert np.array_equal(got, want), isa
        one = np.empty_like(x)
        for r in range(rows):
            token_ops._ext.rms_norm(x[r].copy(), w, 1e-5, one[r], isa)
        assert np.array_equal(one, want), isa
    x64 = x.astype(np.float64)
    assert ulps(want, x64 * w / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5)).max() <= 0.501
    with pytest.raises(ValueError, match="isa"):
        token_ops._ext.rms_norm(x, w, 1e-5, want, "sse9")


def test_rms_norm_of_rows_is_the_vector_step_on_each_row():
    """The sequence path's RMSNorm: rows [T, n] in one call, each row bit for bit the token form's vector step,
    a column slice (MLA's latents) through a C-ordered copy; a weight of another width is refused, not read as
    more rows."""
    from kimi_explore.model.ops import rms_norm

    y = (RNG.standard_normal((9, 80)) * RNG.uniform(0.01, 50, (9, 1))).astype(np.float32)
    w = RNG.uniform(0.5, 2.0, 48).astype(np.float32)
    rows = y[:, 16:64]  # strided: every row 48 floats of an 80-wide row
    got = rms_norm(rows, w, 1e-6)
    assert got.shape == (9, 48) and got.dtype == np.float32
    assert np.array_equal(got, np.stack([token_ops.rms_norm(r.copy(), w, 1e-6) for r in rows]))
    assert rms_norm(np.zeros((0, 48), np.float32), w, 1e-6).shape == (0, 48)
    with pytest.raises(ValueError, match=r"weight \[n\] expected, got \(2, 96\) and \(48,\)"):
        token_ops.rms_norm(np.zeros((2, 96), np.float32), w, 1e-6)


def _sum_squares_in_lanes(x) -> float:
    """sum(x^2) in double in the kernels' order: 4 lanes (lane j: elements j, j + 4, ...), the tail in lane 0, then
    (lane 0 + lane 1) + (lane 2 + lane 3); each square of a float exact in double."""
    lanes, n4 = [0.0] * 4, len(x) - len(x) % 4
    for i in range(n4):
        lanes[i % 4] += float(x[i]) * float(x[i])
    for i in range(n4, len(x)):
        lanes[0] += float(x[i]) * float(x[i])
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])


@pytest.mark.parametrize("T,d", [(1, 128), (3, 13), (9, 33), (6, 1), (33, 7), (40, 100)])
def test_set_row_takes_its_steps_in_double(T, d):
    """The block stack's rows (set_row, and set_row_sum's a + b), on every ISA: each token's row stored and its 1/rms =
    1 / sqrt(sum(v^2) inv_d + eps) bit for bit from Python floats (the product and the add each rounded: an FMA
    target's fused one differs, for an inv_d that is not a power of two), 4 tokens at a time or one."""
    v = (RNG.standard_normal((T, d)) * RNG.uniform(1e-3, 100, (T, 1))).astype(np.float32)
    b = RNG.standard_normal((T, d)).astype(np.float32)
    for isa in token_ops.isas():
        for summed in (None, b):
            rows, inv = np.zeros((T, 3, d), np.float32), np.zeros((T, 3))
            want_rows = v if summed is None else v + summed  # (NumPy's float32 sum)
            out = None if summed is None else np.empty_like(v)
            token_ops._ext.set_row(rows, 1, v, inv, 1.0 / d, 1e-5, T, summed, out, isa)
            assert out is None or np.array_equal(out, want_rows)
            assert np.array_equal(rows[:, 1], want_rows) and not rows[:, [0, 2]].any()
            want = [1.0 / math.sqrt(_sum_squares_in_lanes(r) * (1.0 / d) + 1e-5) for r in want_rows]
            assert inv[:, 1].tolist() == want, isa
    with pytest.raises(ValueError, match="isa"):
        token_ops._ext.set_row(rows, 1, v, inv, 1.0 / d, 1e-5, T, None, None, "sse9")


def test_a_chunks_stack_takes_the_token_forms_steps_per_token():
    """SequenceSources (a chunk's block-residual stacks) on the compiled route: each token's 1/rms values and mix
    weights bit for bit those of a SourceBuffer fed that token's rows (the token form), also after a hook's
    replacement blocks (strided slices) and with more sources than the compiled softmax takes."""
    from kimi_explore.model.kimi_sequence import SequenceSources

    T, d, eps = 6, 40, 1e-5
    vs = [(RNG.standard_normal((T, d)) * RNG.uniform(0.01, 20, (T, 1))).astype(np.float32) for _ in range(4)]
    score = RNG.standard_normal(d).astype(np.float32)
    seq = SequenceSources(np, T, 8, d, np.float32, eps)
    assert seq.compiled
    for v in vs[:3]:
        seq.set_current(v)
        seq.seal()
    seq.set_current(vs[3])
    seq.replace_blocks(np.stack(vs[:3], axis=1)[:, ::-1])  # every token's blocks, in the other order
    p = seq.weights(score)
    for t in range(T):
        tok = SourceBuffer(np, 8, d, np.float32, eps)
        for v in (vs[2], vs[1], vs[0], vs[3]):
            tok.set_current(v[t])
            if v is not vs[3]:
                tok.seal()
        assert np.array_equal(seq.inv_rms[t, :4], tok.inv_rms[:4])
        # the scores' float32 dots (the token form's sgemv, the chunk's compiled lanes) round differently: each is
        # within d 2^-24 sum_j |v_j w_j| of the exact dot, and the softmax turns a change dz of its inputs z = s / rms
        # into a relative change of at most 2 max |dz| of each weight
        rows = np.stack([vs[2][t], vs[1][t], vs[0][t], vs[3][t]]).astype(np.float64)
        dz = 2 * d * 2.0**-24 * (np.abs(rows) @ np.abs(score.astype(np.float64))) * seq.inv_rms[t, :4]
        np.testing.assert_allclose(p[t], tok.weights(score), rtol=2 * dz.max() + 2**-23, atol=0)
    empty = SequenceSources(np, 0, 8, d, np.float32, eps)  # a chunk of no tokens
    empty.set_current(np.zeros((0, d), np.float32))
    assert empty.weights(score).shape == (0, 1)
    wide = SequenceSources(np, T, token_ops.MAX_SOURCES + 1, d, np.float32, eps)
    assert not wide.compiled  # its softmax takes the NumPy formulation
    wide.set_current(vs[0])
    np.testing.assert_allclose(wide.weights(score), 1.0)


@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_within_a_few_ulp_and_empty_rows(linear_beta):
    gu = (RNG.standard_normal((5, 2 * 96)) * 8).astype(np.float32)
    g, u = gu[:, :96].astype(np.float64), gu[:, 96:].astype(np.float64)
    a = 4.0 * np.tanh(g / 4.0) / (1.0 + np.exp(-g))
    want = a * (u if linear_beta is None else linear_beta * np.tanh(u / linear_beta))
    got = token_ops.situ(gu, 4.0, linear_beta)
    assert got.shape == (5, 96)
    assert ulps(got, want).max() <= 0.501
    assert token_ops.situ(np.zeros((0, 8), np.float32), 4.0, linear_beta).shape == (0, 4)  # every expert ablated


def test_block_residual_stack_matches_the_naive_twin():
    """A SourceBuffer on the compiled route: the mix's weights and output against the float64 twin."""
    d, eps = 96, 1e-5
    blocks = (RNG.standard_normal((5, d)) * RNG.uniform(0.1, 10, (5, 1))).astype(np.float32)
    current = RNG.standard_normal(d).astype(np.float32)
    norm, proj = RNG.uniform(0.5, 2, d).astype(np.float32), RNG.standard_normal((1, d)).astype(np.float32)
    stack = SourceBuffer(np, 8, d, np.float32, eps)
    assert stack.compiled and stack.inv_rms.dtype == np.float64
    for b in blocks:
        stack.set_current(b)
        stack.seal()
    stack.set_current(current)
    p = stack.weights(norm * proj[0])
    want_mix, want_p = naive_apply_attn_res(current, blocks, norm, proj, eps)
    assert p.dtype == np.float32 and abs(float(p.astype(np.float64).sum()) - 1.0) < 1e-6
    np.testing.assert_allclose(p, want_p, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(stack.mix(p), want_mix, rtol=0, atol=1e-5 * np.abs(want_mix).max())
    packed = stack.pack()  # a pipeline hop keeps the 1/rms values exactly
    again = SourceBuffer.unpack(packed, np, 8, np.float32, eps)
    assert np.array_equal(again.weights(norm * proj[0]), p)


def python_select(scores, bias, k):
    """The rule written out: top-k of the float32 sums (ties to the lower id), ordered by unbiased score (stable)."""
    choice = (scores + bias).tolist()
    top = sorted(range(len(choice)), key=lambda e: (-choice[e], e))[:k]
    return sorted(top, key=lambda e: -float(scores[e]))


@pytest.mark.parametrize("E,k", [(8, 2), (16, 16), (200, 8), (896, 16)])
def test_select_experts_follows_the_rule_ties_included(E, k):
    for trial in range(30):
        grid = RNG.integers(0, 6, E) / 8  # few distinct values: ties in both orders
        scores = (grid if trial % 2 else RNG.uniform(0, 1, E)).astype(np.float32)
        bias = (RNG.integers(-2, 3, E) / 16).astype(np.float32)
        got = token_ops.select_experts(scores, bias, k)
        assert got.dtype == np.int64 and got.tolist() == python_select(scores, bias, k)


def test_routing_weights_in_double():
    scores = RNG.uniform(0, 1, 200).astype(np.float32)
    ids = np.array([17, 3, 150, 9], np.int64)
    w = scores[ids].astype(np.float64)
    for renormalize, want in ((True, w / (w.sum() + 1e-20) * 2.5), (False, w * 2.5)):
        got = token_ops.routing_weights(scores, ids, renormalize, 2.5, 1e-20)
        assert np.array_equal(got, want.astype(np.float32))  # rounded once from double
    with pytest.raises(ValueError, match="ids int64 \\[R, k\\] in 0..E-1"):
        token_ops.routing_weights(scores, np.array([200], np.int64), True, 1.0, 1e-20)


@pytest.mark.parametrize("E,k", [(16, 2), (896, 16)])
def test_select_and_weights_take_a_chunks_rows_each_as_one_token(E, k):
    """Rows [T, E] in one call: row t is exactly the one-token call on scores[t] (ids, ties, NaN and weights)."""
    grid = RNG.integers(0, 6, (40, E)) / 8
    scores = np.where(RNG.random((40, 1)) < 0.5, grid, RNG.uniform(0, 1, (40, E))).astype(np.float32)
    scores[3, 5] = np.nan
    bias = (RNG.integers(-2, 3, E) / 16).astype(np.float32)
    ids = token_ops.select_experts(scores, bias, k)
    assert ids.shape == (40, k) and ids.dtype == np.int64
    for t in range(40):
        assert ids[t].tolist() == token_ops.select_experts(scores[t].copy(), bias, k).tolist()
        if t != 3:
            assert ids[t].tolist() == python_select(scores[t], bias, k)
    w = token_ops.routing_weights(scores, ids, True, 2.5, 1e-20)
    assert w.shape == (40, k)
    for t in range(40):
        assert np.array_equal(w[t], token_ops.routing_weights(scores[t].copy(), ids[t].copy(), True, 2.5, 1e-20),
                              equal_nan=True)
    assert token_ops.select_experts(scores[:0], bias, k).shape == (0, k)
    assert token_ops.routing_weights(scores[:0], ids[:0], True, 2.5, 1e-20).shape == (0, k)


def test_kda_gates_against_the_formulas():
    P, H, W = 96, 6, 4
    win = RNG.standard_normal((3 * P, W)).astype(np.float32)
    conv = RNG.standard_normal((3 * P, W)).astype(np.float32)
    y = (RNG.standard_normal(4 * P + H + 16) * 3).astype(np.float32)
    raw, dt = RNG.standard_normal(P).astype(np.float32), RNG.standard_normal(P).astype(np.float32)
    A = RNG.uniform(0.5, 16, P).astype(np.float32)
    out = token_ops.kda_gates(win, conv, y, raw, dt, A, -5.0, H).astype(np.float64)
    f = lambda a: a.astype(np.float64)  # noqa: E731
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))  # noqa: E731
    pre = (f(win) * f(conv)).sum(axis=1)
    g = (f(raw) + f(dt)) * f(A)
    want = np.concatenate([pre * sig(pre), sig(f(y[3 * P : 4 * P + H])), np.exp(-5.0 * sig(g))])
    assert ulps(out, want).max() <= 0.501
    with pytest.raises(ValueError, match="kda_gates"):
        token_ops.kda_gates(win, conv, y, raw, dt, A[:-1], -5.0, H)


def test_a_decode_agrees_with_the_numpy_formulation(ref_weights, monkeypatch):
    """Every compiled token step on against the extension hidden (NumPy's formulas), 40 tokens of the reference
    model: logits agree to float32 rounding, the routing is the same, and the two routes do differ (it ran)."""
    ids = [int(t) for t in RNG.integers(0, ref_weights.config.vocab_size, 40)]

    def decode():
        state = KimiDecodeState.new(ref_weights)
        return np.stack([kimi_forward_token(ref_weights, state, t) for t in ids])

    got = decode()
    with monkeypatch.context() as m:
        m.setattr(token_ops, "_ext", None)
        want = decode()
    assert not np.array_equal(got, want)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_the_router_takes_the_compiled_route_only_for_what_it_can_read():
    scores = np.linspace(0.1, 0.9, 16, dtype=np.float32)
    bias = np.zeros(16, np.float32)
    ids = latent_moe.select_experts(scores, bias, 4)
    assert ids.dtype == np.int64 and ids.tolist() == [15, 14, 13, 12]
    # a hook's int32 ids (converted for the compiled step) and float64 scores (Python's doubles): the same weights
    w32 = latent_moe.routing_weights(scores, ids.astype(np.int32), True, 1.5)
    assert np.array_equal(w32, latent_moe.routing_weights(scores, ids, True, 1.5))
    w64 = latent_moe.routing_weights(scores.astype(np.float64), ids, True, 1.5)
    assert w64.dtype == np.float64 and np.allclose(w64, w32, rtol=1e-7)
