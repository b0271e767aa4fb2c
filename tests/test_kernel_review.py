"""The compiled kernels against references written here from the formats' definitions (not from the package):
MXFP4 decoded from the compressed-tensors rule (low nibble = even column, E2M1 table, E8M0 scale) and llama.cpp's
17-byte blocks built from it (byte j: code j low, code j + 16 high); bf16 widened by its bits; the delta rule token
by token in float64. Odd shapes (rows and inputs that fill no whole tile or panel, column tails), every kernel the
CPU has, rows cut between threads, inputs and outputs at addresses no float is aligned to."""

from __future__ import annotations

import numpy as np
import pytest

from kimi_explore.model import kda_recurrence
from kimi_explore.weights import bf16_matvec, mxfp4_matvec

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def decode(packed, scale):
    """float64 [..., R, 2H] from packed [..., R, H] and scale [..., R, H/16]."""
    W = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],))
    W[..., 0::2], W[..., 1::2] = E2M1[packed & 15], E2M1[packed >> 4]
    return W * np.repeat(np.ldexp(1.0, scale.astype(np.int64) - 127), 32, axis=-1)


def ggml_blocks(packed, scale):
    """[..., R, G, 17]: per 32 values the scale byte, then byte j = code j | code j + 16 << 4."""
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = packed & 15, packed >> 4
    codes = codes.reshape(scale.shape + (32,))
    blocks = np.empty(scale.shape + (17,), np.uint8)
    blocks[..., 0] = scale
    blocks[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return blocks


def misaligned(a):
    """A C-contiguous copy of `a` one byte past an aligned address (unaligned for its dtype, bytes aside)."""
    buf = np.zeros(a.nbytes + 65, np.uint8)
    at = (-buf.ctypes.data) % 64 + 1
    out = np.frombuffer(buf.data, a.dtype, a.size, at).reshape(a.shape)
    out[...] = a
    assert out.flags.c_contiguous and (a.itemsize == 1 or a.size == 0 or not out.flags.aligned)
    return out


def within_float32(got, exact, scale, n):
    return np.all(np.abs(got - exact) <= (n + 2) * 2.0**-24 * scale * 1.01 + 1e-30)


@pytest.mark.parametrize("R", [1, 3, 13, 17, 70])
def test_grouped_mxfp4_banks_and_ggml_blocks_against_the_format(R):
    if not mxfp4_matvec.AVAILABLE:
        pytest.skip("the MXFP4 kernel is not built")
    rng = np.random.default_rng(R)
    E, C = 3, 288  # 2 column tiles of the panels, the second partial
    packed = rng.integers(0, 256, (E, R, C // 2), dtype=np.uint8)
    scale = rng.integers(118, 136, (E, R, C // 32), dtype=np.uint8)
    blocks = ggml_blocks(packed, scale)
    sizes = [0, 1, 2, 3, 5, 7, 11, 12, 13, 25]
    experts = rng.integers(0, E, len(sizes))
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    x = rng.standard_normal((bounds[-1], C)).astype(np.float32)
    W = decode(packed, scale)
    exact, err = np.zeros((len(x), R)), np.zeros((len(x), R))
    for j, e in enumerate(experts):
        a, b = bounds[j], bounds[j + 1]
        exact[a:b], err[a:b] = x[a:b] @ W[e].T, np.abs(x[a:b]) @ np.abs(W[e]).T
    for isa in mxfp4_matvec.isas():
        got = mxfp4_matvec.grouped_matmat(packed, scale, experts, bounds, x, isa=isa, threads=1)
        assert within_float32(got, exact, err, C), isa
        out = misaligned(np.zeros_like(got))
        for threads in (1, 2):
            mxfp4_matvec.grouped_ggml_matmat(misaligned(blocks), experts, bounds, misaligned(x), out=out, isa=isa,
                                             threads=threads)
            np.testing.assert_array_equal(out, got)


@pytest.mark.parametrize("R,C", [(1, 3), (13, 17), (37, 300)])
def test_bf16_matmat_against_the_widened_bits(R, C):
    if not bf16_matvec.AVAILABLE:
        pytest.skip("the bf16 kernel is not built")
    rng = np.random.default_rng(C)
    bits = (rng.standard_normal((R, C)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    W = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    for n in (0, 1, 3, 5, 11, 12, 13, 29):
        x = rng.standard_normal((n, C)).astype(np.float32)
        for isa in bf16_matvec.isas():
            got = bf16_matvec.bf16_matmat(bits, x, isa=isa, threads=1)
            assert within_float32(got, x @ W.T, np.abs(x) @ np.abs(W).T, C), (isa, n)
            out = misaligned(np.zeros_like(got))
            bf16_matvec.bf16_matmat(misaligned(bits), misaligned(x), out=out, isa=isa, threads=2)
            np.testing.assert_array_equal(out, got)


@pytest.mark.parametrize("K,V", [(1, 1), (3, 16), (8, 24), (5, 48), (33, 17)])
def test_delta_rule_against_float64_steps(K, V):
    if not kda_recurrence.AVAILABLE:
        pytest.skip("the KDA kernel is not built")
    rng = np.random.default_rng(K * V)
    T, H = 7, 2
    q, k = (rng.standard_normal((T, H, K)) / np.sqrt(K) for _ in range(2))
    v, log_a, beta = rng.standard_normal((T, H, V)), -rng.random((T, H, K)), rng.random((T, H))
    S0 = rng.standard_normal((H, K, V))
    S, o, norms = S0.copy(), np.zeros((T, H, V)), np.zeros((T, H))
    for t in range(T):  # decay, read, write, read out (the module's equations)
        for h in range(H):
            S[h] *= np.exp(log_a[t, h])[:, None]
            w = beta[t, h] * (v[t, h] - k[t, h] @ S[h])
            S[h] += np.outer(k[t, h], w)
            o[t, h], norms[t, h] = q[t, h] @ S[h], np.linalg.norm(S[h])
    f32 = lambda a: a.astype(np.float32)  # noqa: E731
    for isa in kda_recurrence.isas():
        state = misaligned(f32(S0))
        got, got_norms = kda_recurrence.recurrent_delta_rule(*map(misaligned, map(f32, (q, k, v, log_a, beta))), state,
                                                             state_norms=True, isa=isa)
        for a, b in ((got, o), (state, S), (got_norms, norms)):
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * max(1.0, np.abs(S).max()), err_msg=isa)


def test_an_out_over_the_input_is_refused():
    """The bf16 kernels and the grouped MXFP4 panels write `out` while they still read x: out=x (a square matrix) gave
    values 1e3-1e10 off, silently (NumPy's matmul handles the overlap)."""
    rng = np.random.default_rng(0)
    R = C = 64
    bits = (rng.standard_normal((R, C)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    packed = rng.integers(0, 256, (2, R, C // 2), dtype=np.uint8)
    scale = rng.integers(120, 128, (2, R, C // 32), dtype=np.uint8)
    x = rng.standard_normal((20, C)).astype(np.float32)
    calls = [lambda y: bf16_matvec.bf16_matvec(bits, y[0], out=y[0]), lambda y: bf16_matvec.bf16_matmat(bits, y, out=y),
             lambda y: mxfp4_matvec.grouped_matmat(packed, scale, [1, 0], [0, 3, 20], y, out=y),
             lambda y: mxfp4_matvec.grouped_ggml_matmat(ggml_blocks(packed, scale), [1, 0], [0, 3, 20], y, out=y)]
    for call in calls:
        y = x.copy()
        with pytest.raises(ValueError, match="out: shares memory with x"):
            call(y)
        assert np.array_equal(y, x)
    got = mxfp4_matvec.grouped_matmat(packed, scale, [1, 0], [0, 3, 20], x)  # a separate out: the format's product
    W = decode(packed, scale)
    np.testing.assert_allclose(got, np.concatenate([x[:3] @ W[1].T, x[3:] @ W[0].T]), rtol=1e-5, atol=1e-4)


def test_router_and_softmax_steps_refuse_operands_that_do_not_fit():
    """The compiled steps read their buffers by size: a bias [4] for 8 experts picked expert 1 twice ([1, 1]), ids for 2
    of 4 tokens gave rows of other tokens' scores, and L0 + T short of the keys let query 0 attend to later ones."""
    from kimi_explore.model import latent_moe, sequence_ops, token_ops

    if not (token_ops.AVAILABLE and sequence_ops.AVAILABLE):
        pytest.skip("the compiled steps were not built")
    s = np.array([0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.4, 0.6], np.float32)
    with pytest.raises(ValueError, match=r"select_experts: bias \[4\], expected \[8\]"):
        latent_moe.select_experts(s, np.zeros(4, np.float32), 2)
    assert latent_moe.select_experts(s, np.zeros(8, np.float32), 2).tolist() == [1, 3]
    scores = np.arange(16, dtype=np.float32).reshape(4, 4) / 16
    with pytest.raises(ValueError, match=r"routing_weights: ids \[2, 2\] for scores \[4, 4\]"):
        token_ops.routing_weights(scores, np.array([[0, 1], [0, 1]], np.int64), False, 1.0, 1e-20)
    with pytest.raises(ValueError, match=r"scores \[1, 4, 4\] with L0 2: expected L0 \+ T = 6 keys"):
        sequence_ops.causal_softmax_(np.ones((1, 4, 4), np.float32), 2, 1.0)
    p = sequence_ops.causal_softmax_(np.ones((1, 4, 6), np.float32), 2, 1.0)
    assert np.allclose(p[0, 0], [1 / 3, 1 / 3, 1 / 3, 0, 0, 0])
