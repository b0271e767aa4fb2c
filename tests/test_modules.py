"""Each fast path against its naive float64 twin, and the decode-equals-prefill checks the math allows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kimi_explore.model.block_residual import SourceBuffer, apply_attn_res, apply_attn_res_prescored, naive_apply_attn_res
from kimi_explore.model.config import FFN_SITES
from kimi_explore.model.kda import KdaState, delta_rule_read, delta_rule_update, kda_step, naive_kda_step
from kimi_explore.model.latent_moe import latent_moe, naive_latent_moe
from kimi_explore.model.mla import MlaState, mla_step, naive_mla_prefill
from kimi_explore.model.ops import naive_situ_and_mul, rms_norm, situ_and_mul
from kimi_explore.weights import mxfp4

rng = np.random.default_rng(7)


def as64(weights_record):
    """A float64 copy of a weight record (every array field widened)."""
    import dataclasses

    kw = {}
    for f in dataclasses.fields(weights_record):
        v = getattr(weights_record, f.name)
        if isinstance(v, np.ndarray):
            v = v.astype(np.float64) if v.dtype.kind == "f" else v
        elif dataclasses.is_dataclass(v):
            v = as64(v)
        kw[f.name] = v
    return type(weights_record)(**kw)


def layers_of(weights, kind, attr="attention"):
    return [getattr(layer, attr) for layer in weights.layers if getattr(layer, attr).kind == kind]


# ---------------------------------------------------------------- activations and norms


@pytest.mark.parametrize("linear_beta", [25.0, None], ids=["capped-up", "uncapped-up"])
def test_situ_matches_naive(linear_beta):
    gu = rng.standard_normal((3, 40)) * 8  # well past beta = 4 and into the up cap
    want = naive_situ_and_mul(gu, 4.0, linear_beta)
    np.testing.assert_allclose(situ_and_mul(gu, 4.0, linear_beta), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_situ_with_inv_caps_is_bit_identical(dtype):
    """One tanh over [gate | up] scaled by the precomputed 1/caps is the two-tanh formula, bit for bit."""
    from kimi_explore.model.ops import situ_inv_caps

    gu = (rng.standard_normal((3, 64)) * 12).astype(dtype)  # past both caps (4 and 25)
    inv = situ_inv_caps(np, 32, 4.0, 25.0, dtype)
    np.testing.assert_array_equal(situ_and_mul(gu, 4.0, 25.0, inv), situ_and_mul(gu, 4.0, 25.0))
    np.testing.assert_allclose(situ_and_mul(gu, 4.0, 25.0, inv), naive_situ_and_mul(gu, 4.0, 25.0),
                               rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5 if dtype == np.float32 else 1e-12)


def test_situ_sigmoid_reads_the_uncapped_gate():
    g = np.array([10.0, 1.0])  # gate 10: tanh-capped at ~4, sigmoid(10) not sigmoid(4)
    out = situ_and_mul(g, 4.0, None)
    assert out[0] == pytest.approx(4 * math.tanh(2.5) / (1 + math.exp(-10)) * 1.0)


def test_rms_norm_matches_float64():
    x, g = rng.standard_normal((2, 64)), rng.standard_normal(64)
    want = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * g
    np.testing.assert_allclose(rms_norm(x, g, 1e-5), want, rtol=1e-12)
    np.testing.assert_allclose(rms_norm(x[0].astype(np.float32), g.astype(np.float32), 1e-5), want[0], rtol=1e-5)


# ---------------------------------------------------------------- block residuals


@pytest.mark.parametrize("n_blocks", [0, 1, 5])
def test_attn_res_matches_naive(n_blocks):
    d = 48
    stack, prefix = rng.standard_normal((n_blocks, d)) * 3, rng.standard_normal(d)
    g, proj = rng.standard_normal(d), rng.standard_normal((1, d))
    out, p = apply_attn_res(prefix, stack, g, proj, 1e-5)
    out2, p2 = naive_apply_attn_res(prefix, stack, g, proj, 1e-5)
    np.testing.assert_allclose(p, p2, rtol=1e-12)
    np.testing.assert_allclose(out, out2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(apply_attn_res_prescored(prefix, stack, g * proj[0], 1e-5)[0], out, rtol=1e-15)
    assert p.shape == (n_blocks + 1,) and p.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("host_scalars", [True, False], ids=["host-scalars", "device-scalars"])
def test_source_buffer_both_ways_matches_naive(host_scalars):
    """The decoder's SourceBuffer with 1/rms as Python floats (NumPy) or kept in arrays (what a GPU runs)."""
    d = 40
    stack, prefix = rng.standard_normal((3, d)) * 2, rng.standard_normal(d)
    g, proj = rng.standard_normal(d), rng.standard_normal((1, d))
    src = SourceBuffer(np, 4, d, np.float64, 1e-5, host_scalars=host_scalars)
    for block in stack:
        src.set_current(block)
        src.seal()
    src.set_current(prefix)
    p = src.weights(g * proj[0])
    out, want_p = naive_apply_attn_res(prefix, stack, g, proj, 1e-5)
    np.testing.assert_allclose(p, want_p, rtol=1e-12)
    np.testing.assert_allclose(src.mix(p), out, rtol=1e-12, atol=1e-12)


def test_attn_res_mixes_raw_values_not_normalised_keys():
    """Scaling a source by c leaves its key (score) unchanged but scales its contribution by c."""
    d = 16
    stack, prefix = rng.standard_normal((2, d)), rng.standard_normal(d)
    score = rng.standard_normal(d)
    out, p = apply_attn_res_prescored(prefix, stack, score, 0.0)
    stack2 = stack.copy()
    stack2[0] *= 10
    out2, p2 = apply_attn_res_prescored(prefix, stack2, score, 0.0)
    np.testing.assert_allclose(p, p2, rtol=1e-12)
    np.testing.assert_allclose(out2 - out, 9 * p[0] * stack[0], rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- KDA


def test_kda_step_matches_naive_over_tokens(ref_weights):
    w = as64(layers_of(ref_weights, "kda")[1])
    state = KdaState.zeros(w, np, np.float64)
    naive_state = KdaState.zeros(w, np, np.float64)
    d = w.in_proj.shape[1]
    for _ in range(6):
        x = rng.standard_normal(d)
        out = kda_step(x, w, state)
        want, naive_state = naive_kda_step(x, w, naive_state)
        np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(state.recurrent, naive_state.recurrent, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(state.conv, naive_state.conv, rtol=0, atol=0)


def test_delta_rule_recurrence_equals_parallel_closed_form():
    """Token-by-token recurrence == the closed form S_T = sum_s (A_T..A_{s+1}) beta_s k_s v_s^T,
    A_t = (I - beta_t k_t k_t^T) Diag(alpha_t) (tech report eq. 1), evaluated for all t at once."""
    H, K, V, T = 3, 8, 6, 9
    k = rng.standard_normal((T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q, v = rng.standard_normal((T, H, K)), rng.standard_normal((T, H, V))
    alpha, beta = rng.uniform(0.3, 1.0, (T, H, K)), rng.uniform(0.1, 0.9, (T, H))
    S = np.zeros((H, K, V))
    rec = []
    for t in range(T):
        delta_rule_update(S, k[t], v[t], alpha[t], beta[t])
        rec.append(delta_rule_read(S, q[t]))
    rec = np.stack(rec)
    for h in range(H):
        A = [(np.eye(K) - beta[t, h] * np.outer(k[t, h], k[t, h])) @ np.diag(alpha[t, h]) for t in range(T)]
        B = [beta[t, h] * np.outer(k[t, h], v[t, h]) for t in range(T)]
        for t in range(T):
            St = np.zeros((K, V))
            for s in range(t + 1):
                P = np.eye(K)
                for r in range(s + 1, t + 1):
                    P = A[r] @ P
                St += P @ B[s]
            np.testing.assert_allclose(rec[t, h], St.T @ q[t, h], rtol=1e-10, atol=1e-12)


def test_delta_rule_chunked_form_equals_recurrence():
    """A chunked form (chunk size C): carry the state across chunks, inside a chunk apply the
    cumulative transitions as matrices; equals the plain recurrence."""
    H, K, V, T, C = 2, 4, 5, 10, 4
    k = rng.standard_normal((T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((T, H, V))
    alpha, beta = rng.uniform(0.5, 1.0, (T, H, K)), rng.uniform(0.1, 0.9, (T, H))
    S = np.zeros((H, K, V))
    for t in range(T):
        delta_rule_update(S, k[t], v[t], alpha[t], beta[t])
    for h in range(H):
        S_c = np.zeros((K, V))
        for c0 in range(0, T, C):
            P, U = np.eye(K), np.zeros((K, V))  # S_end = P S_start + U
            for t in range(c0, min(c0 + C, T)):
                A = (np.eye(K) - beta[t, h] * np.outer(k[t, h], k[t, h])) @ np.diag(alpha[t, h])
                P, U = A @ P, A @ U + beta[t, h] * np.outer(k[t, h], v[t, h])
            S_c = P @ S_c + U
        np.testing.assert_allclose(S[h], S_c, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- MLA


@pytest.mark.parametrize("which", [0, -1])
def test_mla_cache_decode_equals_full_causal_attention(ref_weights, which):
    w = as64(layers_of(ref_weights, "mla")[which])
    d, T = w.in_proj.shape[1], 20  # past the initial cache capacity (16): exercises growth
    xs = rng.standard_normal((T, d))
    state = MlaState.empty(w, np, np.float64)
    out = np.stack([mla_step(x, w, state) for x in xs])
    np.testing.assert_allclose(out, naive_mla_prefill(xs, w), rtol=1e-10, atol=1e-12)
    assert state.length == T


# ---------------------------------------------------------------- latent MoE


def test_latent_moe_matches_naive(ref_weights):
    for w in layers_of(ref_weights, "moe", "ffn")[:4]:
        w = as64(w)
        seen = []

        class Grab:
            def fire(self, name, value, seen=seen):
                seen.append((name, np.array(value)))
                return value

        for _ in range(4):
            x = rng.standard_normal(w.in_proj.shape[1]) * 2
            seen.clear()
            out = latent_moe(x, w, Grab(), {k: k for k in FFN_SITES["moe"]})
            want, ids, weights = naive_latent_moe(x, w)
            got = dict(seen)
            np.testing.assert_array_equal(got["moe.router.topk_ids"], ids)
            np.testing.assert_allclose(got["moe.router.topk_weights"], weights, rtol=1e-12)
            assert weights.sum() == pytest.approx(w.routed_scaling_factor)
            np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-10)


def test_router_bias_is_for_selection_only():
    from kimi_explore.model.latent_moe import routing_weights, select_experts

    scores = np.array([0.9, 0.8, 0.1, 0.2])
    bias = np.array([0.0, -1.0, 0.0, 0.5])  # drops expert 1, promotes expert 3
    ids = select_experts(scores, bias, 2)
    assert sorted(ids.tolist()) == [0, 3]
    np.testing.assert_allclose(routing_weights(scores, ids, True, 2.0), np.array([0.9, 0.2]) / 1.1 * 2.0)


@pytest.mark.parametrize("small", [True, False], ids=["python-router", "array-router"])
@pytest.mark.parametrize("E,k", [(16, 4), (8, 8), (200, 8)], ids=["E16k4", "all-experts", "E200k8"])
def test_routing_both_ways_matches_naive(monkeypatch, small, E, k):
    """Routing as Python floats (few experts, on the host) and as arrays (many experts, or a GPU)."""
    from kimi_explore.model import latent_moe as moe

    monkeypatch.setattr(moe, "SMALL_ROUTER", 10**6 if small else 0)
    for _ in range(5):
        scores = rng.random(E).astype(np.float32)
        bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
        biased = (scores + bias).tolist()  # the selection compares these float32 sums
        want = sorted(sorted(range(E), key=lambda e: -biased[e])[:k], key=lambda e: -float(scores[e]))
        ids = moe.select_experts(scores, bias, k)
        assert ids.tolist() == want
        w = moe.routing_weights(scores, ids, True, 2.5)
        assert w.dtype == np.float32
        s = scores[want].astype(np.float64)
        np.testing.assert_allclose(w, s / (s.sum() + moe.RENORM_EPS) * 2.5, rtol=1e-6)
    tied = np.full(E, 0.5, np.float32)  # the Python router breaks ties by lower id, as the naive twin does
    if small:
        assert moe.select_experts(tied, np.zeros(E, np.float32), k).tolist() == list(range(k))


# ---------------------------------------------------------------- MXFP4


def test_mxfp4_matches_naive_on_every_code():
    packed = rng.integers(0, 256, (8, 48), dtype=np.uint8)
    packed[0, :8] = np.arange(0, 256, 32)  # codes 0..15 in both nibbles
    packed[1, :16] = np.arange(16) * 17
    scale = rng.integers(110, 135, (8, 3), dtype=np.uint8)
    np.testing.assert_array_equal(mxfp4.dequantize(packed, scale, dtype=np.float64), mxfp4.naive_dequantize(packed, scale))


def test_mxfp4_low_nibble_is_the_even_column():
    packed = np.zeros((1, 16), np.uint8)
    packed[0, 0] = 0x2 | (0xB << 4)  # column 0: +1.0 (code 2); column 1: -1.5 (code 11)
    scale = np.full((1, 1), 128, np.uint8)  # 2^1
    W = mxfp4.dequantize(packed, scale)
    assert W[0, 0] == 2.0 and W[0, 1] == -3.0 and not W[0, 2:].any()


def test_mxfp4_quantize_round_trips_representable_values():
    W = mxfp4.dequantize(rng.integers(0, 256, (4, 32), dtype=np.uint8), rng.integers(120, 130, (4, 2), dtype=np.uint8))
    packed, scale = mxfp4.quantize(W)
    np.testing.assert_array_equal(mxfp4.dequantize(packed, scale), W)


# ---------------------------------------------------------------- decode state


def _state_fields(state):
    """(layer, field, value) of every field of every layer's attention state, arrays and lengths alike."""
    import dataclasses

    return [(i, f.name, getattr(ls.attention, f.name)) for i, ls in enumerate(state.layers)
            for f in dataclasses.fields(ls.attention)]


def test_state_copy_is_exact_and_shares_nothing(ref_weights):
    """`KimiDecodeState.copy()` keeps every field (MLA length and cache capacity included), shares no
    array, and decoding on from the copy gives the original's logits bit for bit."""
    from kimi_explore.model.kimi_decoder import KimiDecodeState, kimi_forward_token

    state = KimiDecodeState.new(ref_weights)
    for t in (3, 17, 200, 5, 42):  # 5 tokens: the MLA caches hold 5 of their 16 rows
        kimi_forward_token(ref_weights, state, t)
    copy = state.copy()
    assert copy.position == state.position == 5
    assert {ls.attention.kind for ls in copy.layers} == {"kda", "mla"}
    for (i, name, a), (_, _, b) in zip(_state_fields(copy), _state_fields(state), strict=True):
        if hasattr(b, "shape"):
            assert a.shape == b.shape and a.dtype == b.dtype, (i, name)
            assert np.array_equal(a, b) and not np.shares_memory(a, b), (i, name)
        else:
            assert a == b, (i, name)  # e.g. an MLA cache's length

    frozen = [np.array(v, copy=True) for _, _, v in _state_fields(copy)]
    ahead = [kimi_forward_token(ref_weights, state, t) for t in (9, 77, 1)]
    # stepping the original left the copy as it was ...
    assert all(np.array_equal(np.asarray(v), f) for (_, _, v), f in zip(_state_fields(copy), frozen, strict=True))
    # ... and the copy decodes on exactly as the original did
    for t, want in zip((9, 77, 1), ahead, strict=True):
        assert np.array_equal(kimi_forward_token(ref_weights, copy, t), want)
