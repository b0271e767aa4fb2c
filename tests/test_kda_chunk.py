"""The chunked gated delta rule against its float64 recurrent twin and against the token form."""

from __future__ import annotations

import numpy as np
import pytest

from kimi_explore.model.kda import delta_rule_read, delta_rule_update
from kimi_explore.model.kda_chunk import chunked_delta_rule, naive_recurrent_delta_rule, norms_block, unit_lower_inverse


def operands(seed, T, H=3, K=8, V=6, gates=(-0.5, 0.0), start=True):
    """q (scaled), k l2-normalised; log decays uniform in `gates`; a nonzero start state unless start=False."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = rng.standard_normal((T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(K)
    v = rng.standard_normal((T, H, V))
    g = rng.uniform(*gates, (T, H, K))
    beta = rng.uniform(0.0, 1.0, (T, H))
    S = rng.standard_normal((H, K, V)) if start else np.zeros((H, K, V))
    return q, k, v, g, beta, S


def run(ops, dtype, chunk, state_norms=True):
    q, k, v, g, beta, S = ops
    S = S.astype(dtype)
    o, norms = chunked_delta_rule(*(a.astype(dtype) for a in (q, k, v, g, beta)), S, chunk=chunk, state_norms=state_norms)
    return o, S, norms


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 50, 1000], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-13), (np.float32, 2e-6)], ids=["float64", "float32"])
def test_chunked_equals_naive_recurrence(chunk, dtype, tol):
    """Outputs, the state after the last token and the per-token state norms, at every chunk size (50 = T,
    1000 > T; 7 and 50 leave a ragged last chunk; 7 is not a multiple of the sub-block)."""
    ops = operands(1, 50)
    want_o, want_S, want_n = naive_recurrent_delta_rule(ops[0], ops[1], ops[2], np.exp(ops[3]), ops[4], ops[5])
    o, S, norms = run(ops, dtype, chunk)
    assert o.dtype == S.dtype == norms.dtype == dtype and o.shape == (50, 3, 6) and norms.shape == (50, 3)
    assert rel(o, want_o) < tol and rel(S, want_S) < tol and rel(norms, want_n) < tol


def test_gates_at_the_lower_bound_over_200_tokens():
    """log decay -5 per token: a 64-token chunk spans exp(-320), far below float32's range. No NaN or inf,
    and the result is the recurrence's (the factors that underflow stand for values below 1e-38)."""
    ops = operands(2, 200, H=2, K=16, V=16, gates=(-5.0, -4.999))
    want_o, want_S, want_n = naive_recurrent_delta_rule(ops[0], ops[1], ops[2], np.exp(ops[3]), ops[4], ops[5])
    for dtype, tol in ((np.float32, 2e-6), (np.float64, 1e-13)):
        o, S, norms = run(ops, dtype, 64)
        assert np.isfinite(o).all() and np.isfinite(S).all() and np.isfinite(norms).all()
        assert rel(o, want_o) < tol and rel(S, want_S) < tol and rel(norms, want_n) < tol


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-13), (np.float32, 2e-6)], ids=["float64", "float32"])
def test_decays_past_the_bound_take_the_pairwise_route(dtype, tol):
    """Log decays of -20 per token (a sub-block spans exp(-320): out of float range even inside it) and a decay
    of exactly 0 at some tokens (a hook's; log floored): the pairwise fallbacks, still the recurrence."""
    ops = list(operands(8, 90, gates=(-20.0, -19.0)))
    ops[3][30:50] = np.log(np.random.default_rng(9).uniform(0.5, 1.0, (20, 3, 8)))  # an ordinary stretch between
    ops[3][40, 1, :4] = -1000.0  # alpha = 0
    want_o, want_S, want_n = naive_recurrent_delta_rule(ops[0], ops[1], ops[2], np.exp(ops[3]), ops[4], ops[5])
    for chunk in (7, 64):
        o, S, norms = run(ops, dtype, chunk)
        assert np.isfinite(o).all() and np.isfinite(norms).all()
        assert rel(o, want_o) < tol and rel(S, want_S) < tol and rel(norms, want_n) < tol


def test_mixed_gates_and_no_decay():
    """Gates from the bound to 0 in one chunk (differences of both sizes), and alpha = 1 exactly."""
    for gates in ((-5.0, 0.0), (0.0, 0.0)):
        ops = operands(3, 130, gates=gates)
        want_o, want_S, _ = naive_recurrent_delta_rule(ops[0], ops[1], ops[2], np.exp(ops[3]), ops[4], ops[5])
        o, S, _ = run(ops, np.float64, 64, state_norms=False)
        assert rel(o, want_o) < 1e-12 and rel(S, want_S) < 1e-12


def test_equals_the_token_form_step_by_step():
    """T calls of delta_rule_update + delta_rule_read (the decoder's token form) in float32 and float64."""
    ops = operands(4, 70, H=4, K=16, V=16, gates=(-2.0, 0.0))
    q, k, v, g, beta, S0 = ops
    for dtype, tol in ((np.float64, 1e-13), (np.float32, 2e-6)):
        S = S0.astype(dtype)
        want = []
        for t in range(70):
            delta_rule_update(S, k[t].astype(dtype), v[t].astype(dtype), np.exp(g[t]).astype(dtype), beta[t].astype(dtype))
            want.append(delta_rule_read(S, q[t].astype(dtype)))
        o, Sc, _ = run(ops, dtype, 64, state_norms=False)
        assert rel(o, np.stack(want)) < tol and rel(Sc, S) < tol


def test_chunks_in_sequence_equal_one_call():
    """Feeding 30 then 45 tokens (the state carried) equals one call over 75."""
    ops = operands(5, 75)
    o, S, _ = run(ops, np.float64, 16, state_norms=False)
    q, k, v, g, beta, S0 = ops
    S2 = S0.copy()
    a, _ = chunked_delta_rule(q[:30], k[:30], v[:30], g[:30], beta[:30], S2, chunk=16)
    b, _ = chunked_delta_rule(q[30:], k[30:], v[30:], g[30:], beta[30:], S2, chunk=16)
    assert rel(np.concatenate([a, b]), o) < 1e-13 and rel(S2, S) < 1e-13


def test_norms_bounded_memory_at_k3_width():
    """At K3 width (H = 96, K = V = 128) a few states are materialised at a time, not [T, H, K, V]."""
    assert 1 <= norms_block(96, 128, 128, np.float32) <= 8
    assert norms_block(4, 8, 8, np.float32) == 16


def test_unit_lower_inverse():
    rng = np.random.default_rng(6)
    A = np.tril(rng.uniform(-0.3, 0.3, (2, 3, 48, 48)), -1)  # |entries| like beta k_t.k_s e(t, s)
    inv = unit_lower_inverse(A, 16)
    np.testing.assert_allclose(inv @ (np.eye(48) + A), np.broadcast_to(np.eye(48), A.shape), atol=1e-12)
    np.testing.assert_allclose(inv, np.linalg.inv(np.eye(48) + A), atol=1e-12)


def test_empty_and_bad_arguments():
    ops = operands(7, 0)
    o, S, norms = run(ops, np.float32, 64)
    assert o.shape == (0, 3, 6) and norms.shape == (0, 3)
    q, k, v, g, beta, S = operands(7, 5)
    with pytest.raises(ValueError, match=r"chunk=0: expected a number of tokens >= 1"):
        chunked_delta_rule(q, k, v, g, beta, S, chunk=0)
    with pytest.raises(ValueError, match=r"beta has shape \(5,\), expected \(5, 3\)"):
        chunked_delta_rule(q, k, v, g, beta[:, 0], S)
