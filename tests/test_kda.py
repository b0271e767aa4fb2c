"""kda_sequence (T tokens at once) against T calls of kda_step, on real layers of both tiny models."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_modules import as64, layers_of

from kimi_explore.model import kda_recurrence, token_ops
from kimi_explore.model.config import ATTENTION_SITES
from kimi_explore.model.kda import KdaState, kda_sequence, kda_step

TOL = {np.float32: 1e-5, np.float64: 1e-12}  # of the largest |value|: float32 rounding / float64
NAMES = {kind: kind for kind in ATTENTION_SITES["kda"]}  # the token form's site names, unprefixed


def rules(dtype):
    """The delta rule's routes for this dtype: the compiled recurrence takes float32 only (when built)."""
    return ["chunked"] + (["recurrent"] if dtype == np.float32 and kda_recurrence.AVAILABLE else [])


class Sites:
    """Token-form hooks: record each site's value per token (a copy), optionally change it."""

    def __init__(self, change=None):
        self.seen, self.change = {}, change or {}

    def fire(self, name, value):
        kind = name.split("kda.")[-1]
        if kind in self.change:
            value = self.change[kind](value)
        self.seen.setdefault(kind, []).append(np.array(value))
        return value


def stepped(xs, w, state, hooks=None):
    return np.stack([kda_step(x, w, state, hooks, NAMES) for x in xs])


def close(a, b, dtype):
    scale = max(float(np.max(np.abs(b))), 1e-30)
    assert float(np.max(np.abs(np.asarray(a, np.float64) - b))) <= TOL[dtype] * scale


def layer(weights, which, dtype):
    w = layers_of(weights, "kda")[which]
    return as64(w) if dtype == np.float64 else w


def inputs(w, T, seed=0, scale=1.0):
    d = w.in_proj.shape[1]
    return (np.random.default_rng(seed).standard_normal((T, d)) * scale).astype(w.in_proj.dtype)


@pytest.mark.parametrize("model", ["ref_weights", "trained_weights"], ids=["reference", "trained"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("chunk", [1, 7, 64, 80], ids=lambda c: f"chunk{c}")
def test_sequence_equals_stepping(request, model, dtype, chunk):
    """Outputs, the state left behind (recurrent matrix and conv window) and five tokens decoded on from it."""
    w = layer(request.getfixturevalue(model), 1, dtype)
    xs = inputs(w, 85, seed=chunk)
    ref_state = KdaState.zeros(w, np, dtype)
    want = stepped(xs[:80], w, ref_state)
    after = stepped(xs[80:], w, ref_state.copy())
    for rule in rules(dtype):
        state = KdaState.zeros(w, np, dtype)
        out, norms = kda_sequence(xs[:80], w, state, chunk=chunk, rule=rule)
        assert out.dtype == dtype and out.shape == want.shape and norms is None
        close(out, want, dtype)
        close(state.recurrent, ref_state.recurrent, dtype)
        close(state.conv, ref_state.conv, dtype)
        assert state.conv.flags.c_contiguous
        close(stepped(xs[80:], w, state), after, dtype)


@pytest.mark.parametrize("model", ["ref_weights", "trained_weights"], ids=["reference", "trained"])
def test_prefill_step_prefill(request, model):
    """Mixed use: 20 tokens at once, 3 steps, 30 at once (chunk 7), from a state that is not empty."""
    w = layer(request.getfixturevalue(model), -1, np.float64)
    xs = inputs(w, 53, seed=1)
    ref_state, state = KdaState.zeros(w, np, np.float64), KdaState.zeros(w, np, np.float64)
    want = stepped(xs, w, ref_state)
    got = [kda_sequence(xs[:20], w, state)[0], stepped(xs[20:23], w, state), kda_sequence(xs[23:], w, state, chunk=7)[0]]
    close(np.concatenate(got), want, np.float64)
    close(state.recurrent, ref_state.recurrent, np.float64)
    close(state.conv, ref_state.conv, np.float64)  # projections of rows (gemm) vs vectors (gemv): rounding


def test_gates_at_the_lower_bound(ref_weights):
    """A large and dt_bias push sigmoid to 1: every decay is exp(-5), a 64-token chunk spans exp(-320).
    Over 200 tokens: finite, and equal to stepping (float32 and float64)."""
    for dtype in (np.float32, np.float64):
        w = layer(ref_weights, 0, dtype)
        w = dataclasses.replace(w, A=np.full_like(w.A, 1e4), dt_bias=np.full_like(w.dt_bias, 10.0))
        xs = inputs(w, 200, seed=2)
        decays = Sites()
        want = stepped(xs, w, KdaState.zeros(w, np, dtype), decays)
        np.testing.assert_allclose(np.array(decays.seen["decay"]), np.exp(-5.0), rtol=1e-6)
        for rule in rules(dtype):
            state = KdaState.zeros(w, np, dtype)
            out, norms = kda_sequence(xs, w, state, chunk=64, state_norms=True, rule=rule)
            assert np.isfinite(out).all() and np.isfinite(state.recurrent).all()
            assert all(np.isfinite(n).all() for n in norms.values())
            close(out, want, dtype)


@pytest.mark.parametrize("model", ["ref_weights", "trained_weights"], ids=["reference", "trained"])
def test_state_norms_at_every_token(request, model):
    """norms["kda.state"][t, h] = ||S_h||_F after token t and norms["kda.conv"][t, s, h] the norm of head h's
    [K, W] block of stream s's window, as the token form's kda.state / kda.conv sites show them, inside chunks too."""
    w = layer(request.getfixturevalue(model), 2, np.float32)
    xs = inputs(w, 45, seed=3)
    sites = Sites()
    stepped(xs, w, KdaState.zeros(w, np, np.float32), sites)
    H = w.num_heads
    want_state = np.linalg.norm(np.array(sites.seen["state"], np.float64), axis=(2, 3))  # [T, H]
    windows = np.array(sites.seen["conv"], np.float64)  # [T, 3, P, W]
    want_conv = np.linalg.norm(windows.reshape(45, 3, H, -1), axis=-1)
    for chunk, rule in ((1, "chunked"), (7, "chunked"), (64, "chunked")) + tuple((0, r) for r in rules(np.float32)[1:]):
        state = KdaState.zeros(w, np, np.float32)
        _, norms = kda_sequence(xs, w, state, chunk=max(chunk, 1), state_norms=True, rule=rule)
        assert sorted(norms) == ["kda.conv", "kda.state"]
        np.testing.assert_allclose(norms["kda.state"], want_state, rtol=1e-5)
        np.testing.assert_allclose(norms["kda.conv"], want_conv, rtol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(state.conv.reshape(3, H, -1), axis=-1), want_conv[-1], rtol=1e-5)


def test_fire_sites_order_shapes_and_values(ref_weights):
    """The token form's sites in its order (the recurrent kda.conv and kda.state left out), as whole-chunk
    arrays holding the per-token values, under the layer's bound names."""
    w = layer(ref_weights, 0, np.float64)
    xs = inputs(w, 12, seed=4)
    H, K = w.num_heads, w.head_dim
    token = Sites()
    stepped(xs, w, KdaState.zeros(w, np, np.float64), token)
    seen = {}
    names = {kind: "layers.9." + kind for kind in ATTENTION_SITES["kda"]}
    kda_sequence(xs, w, KdaState.zeros(w, np, np.float64), chunk=5, names=names,
                 fire=lambda name, value: seen.setdefault(name, value))
    kinds = ["conv_out", "q", "k", "v", "beta", "decay", "gate", "o"]
    assert list(seen) == ["layers.9.kda." + n for n in kinds]
    assert [k for k in ATTENTION_SITES["kda"] if k not in ("kda.conv", "kda.state")] == ["kda." + n for n in kinds]
    shapes = {"conv_out": (12, 3, H, K), "q": (12, H, K), "k": (12, H, K), "v": (12, H, K), "beta": (12, H),
              "decay": (12, H, K), "gate": (12, H, K), "o": (12, H, K)}
    for n in kinds:
        value = seen["layers.9.kda." + n]
        assert value.shape == shapes[n], n
        np.testing.assert_allclose(value, np.array(token.seen[n]), rtol=1e-12, atol=1e-14, err_msg=n)


def test_returned_values_replace_the_values(ref_weights):
    """Each site's returned array is used downstream, as in the token form (per-token changes there)."""
    w = layer(ref_weights, 1, np.float64)
    xs = inputs(w, 30, seed=5)
    change = {"conv_out": lambda c: 1.5 * c, "v": lambda v: 2.0 * v, "beta": lambda b: 0.5 * b, "decay": lambda a: a * a,
              "gate": lambda g: np.ones_like(g), "q": lambda q: q[..., ::-1].copy(), "o": lambda o: o + 0.1}
    ref_state = KdaState.zeros(w, np, np.float64)
    want = stepped(xs, w, ref_state, Sites(change))
    state = KdaState.zeros(w, np, np.float64)
    out, _ = kda_sequence(xs, w, state, chunk=7, fire=lambda name, value: change.get(name[4:], lambda a: a)(value))
    close(out, want, np.float64)
    close(state.recurrent, ref_state.recurrent, np.float64)
    if "recurrent" in rules(np.float32):  # the compiled route honours them too
        w32, xs32 = layer(ref_weights, 1, np.float32), xs.astype(np.float32)
        ref32 = KdaState.zeros(w32, np, np.float32)
        want32 = stepped(xs32, w32, ref32, Sites(change))
        state32 = KdaState.zeros(w32, np, np.float32)
        out32, _ = kda_sequence(xs32, w32, state32, rule="recurrent",
                                fire=lambda name, value: change.get(name[4:], lambda a: a)(value))
        close(out32, want32, np.float32)
        close(state32.recurrent, ref32.recurrent, np.float32)


def test_rule_is_checked(ref_weights):
    w = layer(ref_weights, 0, np.float32)
    with pytest.raises(ValueError, match=r"rule='fast', expected one of \('auto', 'recurrent', 'chunked'\)"):
        kda_sequence(inputs(w, 2), w, KdaState.zeros(w, np, np.float32), rule="fast")


def test_a_decay_of_zero_wipes_the_memory(ref_weights):
    """alpha = 0 returned for a token (log would be -inf): the state is reset there, no NaN."""
    w = layer(ref_weights, 1, np.float64)
    xs = inputs(w, 20, seed=6)

    def zero_at(alpha, rows):
        alpha = alpha.copy()
        alpha[rows] = 0.0
        return alpha

    calls = []

    def token_change(a):
        calls.append(None)
        return a * 0.0 if len(calls) == 9 else a

    ref_state = KdaState.zeros(w, np, np.float64)
    want = stepped(xs, w, ref_state, Sites({"decay": token_change}))
    state = KdaState.zeros(w, np, np.float64)
    out, _ = kda_sequence(xs, w, state, chunk=16,
                          fire=lambda name, value: zero_at(value, 8) if name == "kda.decay" else value)
    assert np.isfinite(out).all()
    close(out, want, np.float64)
    close(state.recurrent, ref_state.recurrent, np.float64)


@pytest.mark.skipif(not kda_recurrence.AVAILABLE, reason="the compiled KDA kernels were not built")
def test_compiled_elementwise_delta_steps_round_as_numpy():
    """delta_rule_update's compiled decay and rank-1 write (float32) give NumPy's broadcasts bit for bit: each
    product and each sum rounded on its own (a fused multiply-add would differ in the last bit), over 200 random
    states and magnitudes from 1e-3 to 1e3."""
    from kimi_explore.model.kda import delta_rule_update

    rng = np.random.default_rng(17)
    H, K, V = 4, 32, 24
    for _ in range(200):
        scale = 10.0 ** rng.uniform(-3, 3)
        S = (rng.standard_normal((H, K, V)) * scale).astype(np.float32)
        k = rng.standard_normal((H, K)).astype(np.float32)
        v = (rng.standard_normal((H, V)) * scale).astype(np.float32)
        alpha, beta = rng.uniform(0, 1, (H, K)).astype(np.float32), rng.uniform(0, 1, H).astype(np.float32)
        want = S.copy()
        want *= alpha[:, :, None]  # the broadcasts the compiled steps replace
        u = np.matmul(k[:, None, :], want)[:, 0]
        want += k[:, :, None] * (beta[:, None] * (v - u))[:, None, :]
        assert kda_recurrence.elementwise_ops(S, alpha, k) is not None
        delta_rule_update(S, k, v, alpha, beta)
        np.testing.assert_array_equal(S, want)


@pytest.mark.skipif(not kda_recurrence.AVAILABLE, reason="the compiled KDA kernels were not built")
def test_kda_step_compiled_steps_equal_numpy_bit_for_bit(ref_weights, monkeypatch):
    """kda_step with the exact compiled steps (window shift, l2 scale, decay, rank-1 write, gated norm) against the
    same step with NumPy alone (the kernel hidden), every KDA layer of the reference model, 24 tokens: outputs and
    states equal bit for bit. (token_ops' gates, whose exp is not NumPy's, are hidden on both sides; with them the
    step agrees to rounding: test_kda_step_token_ops_agree_with_numpy.)"""
    monkeypatch.setattr(token_ops, "_ext", None)
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((24, ref_weights.config.hidden_size)).astype(np.float32)
    for w in [layer.attention for layer in ref_weights.layers if layer.attention.kind == "kda"]:
        got_state, want_state = KdaState.zeros(w, np, np.float32), KdaState.zeros(w, np, np.float32)
        got = np.stack([kda_step(x, w, got_state) for x in xs])
        with monkeypatch.context() as m:
            m.setattr(kda_recurrence, "_ext", None)
            assert kda_recurrence.elementwise_ops(got_state.recurrent) is None
            want = np.stack([kda_step(x, w, want_state) for x in xs])
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got_state.recurrent, want_state.recurrent)


@pytest.mark.skipif(not token_ops.AVAILABLE, reason="the compiled token steps were not built")
def test_kda_step_token_ops_agree_with_numpy(ref_weights, monkeypatch):
    """kda_step with every compiled step (token_ops.kda_gates included) against NumPy alone, every KDA layer of the
    reference model, 24 tokens: outputs and states agree to float32 rounding."""
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((24, ref_weights.config.hidden_size)).astype(np.float32)
    for w in [layer.attention for layer in ref_weights.layers if layer.attention.kind == "kda"]:
        got_state, want_state = KdaState.zeros(w, np, np.float32), KdaState.zeros(w, np, np.float32)
        assert token_ops.runs(got_state.conv, w.conv)
        got = np.stack([kda_step(x, w, got_state) for x in xs])
        with monkeypatch.context() as m:
            m.setattr(kda_recurrence, "_ext", None)
            m.setattr(token_ops, "_ext", None)
            want = np.stack([kda_step(x, w, want_state) for x in xs])
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)
        np.testing.assert_allclose(got_state.recurrent, want_state.recurrent, rtol=0,
                                   atol=2e-5 * np.abs(want_state.recurrent).max())
        assert not np.array_equal(got, want)  # the compiled gates ran (in double: not NumPy's float32 rounding)


def test_a_bad_rule_is_refused_before_the_window_advances(trained_weights):
    """kda_sequence advances the conv window before its hooks and the recurrence: an unknown rule must be refused
    first, leaving the state as it was."""
    w = layer(trained_weights, 0, np.float32)
    state = KdaState.zeros(w, np, np.float32)
    kda_sequence(inputs(w, 3), w, state)
    before = state.copy()
    with pytest.raises(ValueError, match="rule"):
        kda_sequence(inputs(w, 5, seed=1), w, state, rule="bogus")
    assert np.array_equal(state.conv, before.conv) and np.array_equal(state.recurrent, before.recurrent)
