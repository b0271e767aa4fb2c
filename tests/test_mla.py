"""mla_sequence (T queries at once over the cache plus the chunk) against stepping and the float64 twin."""

from __future__ import annotations

import numpy as np
import pytest
from test_modules import as64, layers_of

from kimi_explore.model import mla, sequence_ops
from kimi_explore.model.config import ATTENTION_SITES
from kimi_explore.model.mla import MlaState, mla_sequence, mla_step, naive_mla_prefill

TOL = {np.float32: 1e-5, np.float64: 1e-12}


def close(a, b, dtype):
    assert float(np.max(np.abs(np.asarray(a, np.float64) - b))) <= TOL[dtype] * float(np.max(np.abs(b)))


def layer(weights, which, dtype):
    w = layers_of(weights, "mla")[which]
    return as64(w) if dtype == np.float64 else w


def inputs(w, T, seed=0):
    return np.random.default_rng(seed).standard_normal((T, w.in_proj.shape[1])).astype(w.in_proj.dtype)


@pytest.mark.parametrize("model", ["ref_weights", "trained_weights"], ids=["reference", "trained"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("cuts", [[40], [1, 1, 1, 37], [7, 7, 7, 7, 7, 5], [17, 3, 20]], ids=["T", "1s-then-rest", "7s", "mixed"])
@pytest.mark.parametrize("block", [None, 3, mla.QUERY_BLOCK], ids=["fused", "blocks-of-3", "one-block"])
def test_chunks_equal_stepping_and_the_naive_prefill(request, monkeypatch, model, dtype, cuts, block):
    """Any cut of 40 tokens into chunks, the attention fused (float32 on the CPU: `sequence_ops.causal_attention`)
    or the scores one query block or several (the fused kernel off): the outputs, the cache (same capacity as 40
    appends: 16 -> 32 -> 64), and the float64 full causal attention computed token by token, head by head."""
    if block is not None:
        monkeypatch.setattr(mla, "QUERY_BLOCK", block)
        monkeypatch.setattr(sequence_ops, "causal_attention", lambda *args: None)
    w = layer(request.getfixturevalue(model), 0, dtype)
    xs = inputs(w, 45, seed=len(cuts))
    ref_state = MlaState.empty(w, np, dtype)
    want = np.stack([mla_step(x, w, ref_state) for x in xs[:40]])
    state, got, a = MlaState.empty(w, np, dtype), [], 0
    for c in cuts:
        got.append(mla_sequence(xs[a : a + c], w, state))
        a += c
    got = np.concatenate(got)
    close(got, want, dtype)
    close(got, naive_mla_prefill(xs[:40], w), dtype)
    assert state.length == ref_state.length == 40
    assert state.keys.shape == ref_state.keys.shape == (w.num_heads, 64, w.qk_nope_head_dim + w.qk_rope_head_dim)
    close(state.keys, ref_state.keys, dtype)
    close(state.values, ref_state.values, dtype)
    # decoding on from the state the chunks left
    close(np.stack([mla_step(x, w, state) for x in xs[40:]]), np.stack([mla_step(x, w, ref_state) for x in xs[40:]]), dtype)


def test_step_then_prefill_then_step(ref_weights):
    w = layer(ref_weights, -1, np.float64)
    xs = inputs(w, 30, seed=9)
    want = naive_mla_prefill(xs, w)
    state = MlaState.empty(w, np, np.float64, capacity=1)
    got = [np.stack([mla_step(x, w, state) for x in xs[:5]]), mla_sequence(xs[5:25], w, state),
           np.stack([mla_step(x, w, state) for x in xs[25:]])]
    close(np.concatenate(got), want, np.float64)
    assert state.keys.shape[1] == 32  # 1 -> ... -> 8 by steps, then 32 at once, as 30 appends give


def test_append_many_grows_as_appends_do(ref_weights):
    w = layer(ref_weights, 0, np.float32)
    nh, dn, dr, dv = w.num_heads, w.qk_nope_head_dim, w.qk_rope_head_dim, w.v_head_dim
    rng = np.random.default_rng(3)
    for cap, T in ((16, 16), (16, 17), (3, 50), (0, 2)):
        a, b = MlaState.empty(w, np, np.float32, capacity=cap), MlaState.empty(w, np, np.float32, capacity=cap)
        kn, kp, v = rng.standard_normal((T, nh, dn)), rng.standard_normal((T, dr)), rng.standard_normal((T, nh, dv))
        a.append_many(kn, kp, v)
        for t in range(T):
            b.append(kn[t], kp[t], v[t])
        assert a.length == b.length == T and a.keys.shape == b.keys.shape
        np.testing.assert_array_equal(a.keys, b.keys)
        np.testing.assert_array_equal(a.values, b.values)
        assert not a.keys[:, T:].any() and not a.values[:, T:].any()  # the grown positions are zero


def test_a_copy_of_a_shared_cache_holds_its_own_positions_only(ref_weights):
    """A checkpoint shares its cache with the history that goes on appending (`MlaState.checkpoint`); its copy has the
    whole capacity and layout (replays must round as the original did), the checkpoint's positions, zeros after them
    (the history's later positions are not its own), and owns its arrays."""
    w = layer(ref_weights, 0, np.float32)
    nh, dn, dr, dv = w.num_heads, w.qk_nope_head_dim, w.qk_rope_head_dim, w.v_head_dim
    rng = np.random.default_rng(5)
    live = MlaState.empty(w, np, np.float32, capacity=4)
    live.append_many(rng.standard_normal((9, nh, dn)), rng.standard_normal((9, dr)), rng.standard_normal((9, nh, dv)))
    kept = live.checkpoint()
    kept.length = 6  # (as a checkpoint taken at 6 reads the cache the history went on filling)
    got = kept.copy()
    assert got.length == 6 and got.keys.shape == live.keys.shape == (nh, 16, dn + dr)
    assert got.keys.strides == live.keys.strides and got.values.strides == live.values.strides
    np.testing.assert_array_equal(got.keys[:, :6], live.keys[:, :6])
    np.testing.assert_array_equal(got.values[:, :6], live.values[:, :6])
    assert not got.keys[:, 6:].any() and not got.values[:, 6:].any() and live.keys[:, 6:9].all()
    assert not np.shares_memory(got.keys, live.keys) and not np.shares_memory(got.values, live.values)

def test_sites_order_shapes_and_values(ref_weights):
    """mla.q_latent, mla.kv_latent, mla.probs [T, nh, L0 + T] (token t's row is the token form's [nh, L0 + t + 1],
    then zeros), mla.o [T, nh, dv], under the layer's bound names, after 4 tokens already cached."""
    w = layer(ref_weights, 0, np.float64)
    xs = inputs(w, 14, seed=4)
    token = {}

    class Grab:
        def fire(self, name, value):
            token.setdefault(name, []).append(np.array(value))
            return value

    names = {kind: "layers.3." + kind for kind in ATTENTION_SITES["mla"]}
    ref_state = MlaState.empty(w, np, np.float64)
    for x in xs[:4]:
        mla_step(x, w, ref_state)
    for x in xs[4:]:
        mla_step(x, w, ref_state, Grab(), names)
    state = MlaState.empty(w, np, np.float64)
    mla_sequence(xs[:4], w, state)
    seen = {}
    mla_sequence(xs[4:], w, state, fire=lambda name, value: seen.setdefault(name, value), names=names)
    assert list(seen) == [names[k] for k in ATTENTION_SITES["mla"]]
    p = seen["layers.3.mla.probs"]
    assert p.shape == (10, w.num_heads, 14) and seen["layers.3.mla.o"].shape == (10, w.num_heads, w.v_head_dim)
    for t in range(10):
        np.testing.assert_allclose(p[t, :, : 5 + t], token["layers.3.mla.probs"][t], rtol=1e-12, atol=1e-15)
        assert not p[t, :, 5 + t :].any()
    for kind in ("mla.q_latent", "mla.kv_latent", "mla.o"):
        close(seen[names[kind]], np.stack(token[names[kind]]), np.float64)


def test_returned_values_replace_the_values(ref_weights):
    """Latents scaled, attention made uniform over the visible positions, the heads' output shifted: the same
    changes per token in the token form give the same outputs."""
    w = layer(ref_weights, 0, np.float64)
    xs = inputs(w, 14, seed=5)

    def uniform(p):  # the chunk's causal mask: probabilities are positive exactly where visible
        vis = (p > 0).astype(p.dtype)
        return vis / vis.sum(axis=-1, keepdims=True)

    change = {"mla.q_latent": lambda a: 2.0 * a, "mla.kv_latent": lambda a: a[..., ::-1].copy(), "mla.probs": uniform,
              "mla.o": lambda o: o + 0.25}

    class Change:
        def fire(self, name, value):
            return change[name](value)

    s1, s2 = MlaState.empty(w, np, np.float64), MlaState.empty(w, np, np.float64)
    want = np.stack([mla_step(x, w, s1, Change(), {k: k for k in ATTENTION_SITES["mla"]}) for x in xs])
    close(mla_sequence(xs, w, s2, fire=lambda name, value: change[name](value)), want, np.float64)
