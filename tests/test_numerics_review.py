"""The decoder's numerics at the edges: NaN and inf entering, routing ties and near-ties, KDA decays at the
gate's lower bound, activations scaled by 1e4 / 1e-4, MXFP4 scale codes at the top of the range.

Each bug test failed before its fix (named in its docstring); the rest check the sequence path against
stepping, the float64 twin or Moonshot's eps-sensitive reference set at inputs the other tests do not reach.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
from conftest import REFERENCE_DIR
from naive_decoder import NaiveDecoder
from test_modules import layers_of

import kimi_explore as ke
from kimi_explore.model import latent_moe as moe
from kimi_explore.model import mla, sequence_ops
from kimi_explore.model.kda_chunk import chunked_delta_rule, naive_recurrent_delta_rule
from kimi_explore.model.kimi_sequence import kimi_forward_sequence
from kimi_explore.model.latent_moe_sequence import latent_moe_sequence, select_experts_rows
from kimi_explore.weights import mxfp4, mxfp4_matvec
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

TOKENS = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def fresh(dtype):
    """The random tiny model, loaded for one test (the tests below change its arrays in place)."""
    return ke.from_pretrained(random_tiny_checkpoint(), device="cpu", dtype=dtype)


def step_all(w, tokens):
    state = ke.KimiDecodeState.new(w)
    return np.stack([np.asarray(ke.kimi_forward_token(w, state, int(t)), np.float64) for t in tokens])


def prefill(w, tokens, chunk, hooks=None):
    state = ke.KimiDecodeState.new(w)
    return np.asarray(kimi_forward_sequence(w, state, tokens, chunk=chunk, hooks=hooks), np.float64)


def rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# ---------------------------------------------------------------- a NaN in a later token of a chunk


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("float64", 1e-9)])
def test_a_nan_token_leaves_the_earlier_logits_of_its_chunk_alone(dtype, tol):
    """Fixed: MLA mixed each query over the whole block's values (masked probability 0 times a later token's NaN
    is NaN) and the chunked KDA rule multiplied by the zeros above its triangles: one NaN token (here a NaN
    embedding row) made every logit of its chunk NaN, the tokens before it included; stepping keeps them."""
    w = fresh(dtype)
    bad = 4
    w.embedding()[TOKENS[bad]] = np.nan
    want = step_all(w, TOKENS)
    assert np.isfinite(want[:bad]).all() and not np.isfinite(want[bad:]).any(axis=1).any()
    hooks = ke.Hooks()  # a chunk-aware hook that reads the whole probabilities and returns them as they are
    hooks.add("layers.3.mla.probs", lambda p, *, hook: p, chunks=True)
    for chunk in (2, 3, len(TOKENS)):
        for h in (None, hooks.bind(w)):
            got = prefill(w, TOKENS, chunk, h)
            assert rel(got[:bad], want[:bad]) <= tol, (chunk, h)
            assert not np.isfinite(got[bad:]).any(axis=1).any()


@pytest.mark.parametrize("at", [11, 17], ids=["mid", "last"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_mla_sequence_queries_never_see_a_later_nan_value(monkeypatch, dtype, at):
    """Fixed (`mla._causal_mix`): the same at the layer, with query blocks of 4 over a 13-token chunk after 5 cached
    positions; and the NumPy softmax (float64) left NaN at the masked positions of a row whose max is NaN, which
    `_check_causal` then blamed on a hook that had returned the probabilities unchanged."""
    monkeypatch.setattr(mla, "QUERY_BLOCK", 4)
    w = layers_of(fresh(np.dtype(dtype).name), "mla")[0]
    xs = np.random.default_rng(0).standard_normal((18, w.in_proj.shape[1])).astype(dtype)
    xs[at] = np.nan  # chunk token 6 (or the chunk's last, 12): its values (and its own query) NaN
    state = mla.MlaState.empty(w, np, np.dtype(dtype))
    want = np.stack([mla.mla_step(x, w, state) for x in xs])
    for fire in (None, lambda name, value: value):
        state = mla.MlaState.empty(w, np, np.dtype(dtype))
        head = mla.mla_sequence(xs[:5], w, state)
        got = mla.mla_sequence(xs[5:], w, state, fire=fire)
        np.testing.assert_allclose(np.concatenate([head, got])[:at], want[:at], rtol=1e-4 if dtype == np.float32 else 1e-12,
                                   atol=1e-6 if dtype == np.float32 else 1e-14)
        assert np.isnan(got[at - 5 :]).all()
    s = np.array([[[1.0, np.nan, 2.0, 3.0]] * 4], dtype)
    p = mla.causal_softmax_(s, 0)
    assert p[0, 0].tolist() == [1.0, 0.0, 0.0, 0.0] and np.isnan(p[0, 1, :2]).all() and (p[0, 1, 2:] == 0).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the planted inf, as NumPy reports it
@pytest.mark.parametrize("at", [9, 19], ids=["mid", "last"])
@pytest.mark.parametrize("where", ["k", "v", "beta", "log_alpha", "log_alpha+inf"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_chunked_delta_rule_keeps_a_later_nan_out_of_earlier_tokens(where, dtype, at):
    """Fixed (`kda_chunk.first_non_finite`): a NaN (or +inf log decay) at token 9 made every output and state norm of
    its chunk NaN. A decay of exactly 0 (log -inf) is no such input: it must stay exact. At the last token too (the
    split there is its own case)."""
    rng = np.random.default_rng(1)
    T, H, K, V = 20, 2, 8, 4
    q, k = rng.standard_normal((T, H, K)), rng.standard_normal((T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, beta, la = rng.standard_normal((T, H, V)), rng.random((T, H)), -rng.random((T, H, K)) * 5
    la[3, :, ::2] = -np.inf  # decay 0 on half the channels
    arrays = {"k": k, "v": v, "beta": beta, "log_alpha": la}
    name = where.split("+")[0]
    arrays[name][at] = np.inf if where.endswith("+inf") else np.nan
    S0 = rng.standard_normal((H, K, V))
    o_ref, _, n_ref = naive_recurrent_delta_rule(q, k, v, np.exp(la), beta, S0)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for chunk in (1, 2, 7, 16, 64):
        S = S0.astype(dtype)
        o, n = chunked_delta_rule(*(a.astype(dtype) for a in (q, k, v, la, beta)), S, chunk=chunk, state_norms=True)
        assert rel(o[:at].astype(np.float64), o_ref[:at]) <= tol and rel(n[:at].astype(np.float64), n_ref[:at]) <= tol, chunk
        assert not np.isfinite(o[at:]).any() and not np.isfinite(n[at:]).any() and not np.isfinite(S).any()


# ---------------------------------------------------------------- routing: near-ties, ties, NaN


def test_sequence_router_scores_are_rounded_as_the_token_forms():
    """Fixed (`latent_moe_sequence.router_scores`): the sequence path took the router's sigmoid in NumPy float32
    (up to ~3 ulp off; a third of the scores differ from the token form's compiled double sigmoid, every logit
    in 16.0 .. 16.6 among them): logits 16.0 and 16.25 give 0.9999999 and 0.99999994 when stepping, a tie when
    prefilling, and prefill picked the other expert. Logits made exact here (a one-hot input), so only the
    sigmoid differs."""
    w = layers_of(fresh("float32"), "moe", "ffn")[0]
    E = w.num_experts
    in_proj = np.zeros_like(w.in_proj)
    in_proj[E:] = w.in_proj[E:]
    in_proj[:E, 0] = -4.0
    in_proj[0, 0], in_proj[1, 0] = 16.0, 16.25
    w = dataclasses.replace(w, in_proj=in_proj, e_score_correction_bias=np.zeros(E, np.float32), top_k=1)
    x = np.zeros((3, in_proj.shape[1]), np.float32)
    x[:, 0] = 1.0
    seen = {}
    moe_sites = {kind: kind for kind in ("moe.router.scores", "moe.router.topk_ids")}

    class Grab:
        def fire(self, name, value):
            seen.setdefault(name, []).append(np.array(value))
            return value

    moe.latent_moe(x[0], w, Grab(), moe_sites)
    rows = {}
    latent_moe_sequence(x, w, fire=lambda name, value: rows.setdefault(name, value))
    assert seen["moe.router.topk_ids"][0].tolist() == [1]
    np.testing.assert_array_equal(rows["moe.router.scores"][0], seen["moe.router.scores"][0])
    assert rows["moe.router.topk_ids"].tolist() == [[1]] * 3


def grid_scores(rng, E, nan_at=()):
    s = np.round(rng.random(E) * 6) / 8  # coarse: many ties, exact in float32
    s[list(nan_at)] = np.nan
    return s


@pytest.mark.parametrize("E,k", [(16, 4), (100, 8), (200, 16)])
def test_every_router_route_gives_the_same_ids_ties_and_nan_included(monkeypatch, E, k):
    """Fixed: the NumPy route for more than 64 experts (float64, CuPy) ordered ties by argpartition / an unstable
    argsort (192 of 200 tied rows differed from the compiled route's lower-id rule); a NaN score was passed over
    by the array route and by the compiled one after k experts, and before that stopped the compiled insertion
    (experts 0, 1, 2 kept, not the top). Now NaN ranks as +inf everywhere (torch.topk ranks NaN first): it is
    selected, and its NaN weight reaches the output."""
    rng = np.random.default_rng(E)
    bias = np.round(rng.standard_normal(E) * 2) / 8
    for nan_at in ((), (1,), (E - 3,), (0, E // 2)):
        rows = np.stack([grid_scores(rng, E, nan_at) for _ in range(12)])
        rows[0] = 0.5
        rows[0, list(nan_at)] = np.nan
        want = [moe.select_experts(r.astype(np.float32), bias.astype(np.float32), k) for r in rows]  # compiled
        for small in (True, False):
            monkeypatch.setattr(moe, "SMALL_ROUTER", 10**6 if small else 0)
            for dt in (np.float32, np.float64):
                r, b = rows.astype(dt), bias.astype(dt)
                got = select_experts_rows(r, b, k)
                for t in range(len(rows)):
                    np.testing.assert_array_equal(moe.select_experts(r[t], b, k), want[t], err_msg=f"{small} {dt} {t}")
                    np.testing.assert_array_equal(got[t], want[t])
        for t, ids in enumerate(want):
            assert set(nan_at) <= set(ids.tolist())  # selected
            choice = np.where(np.isnan(rows[t] + bias), np.inf, rows[t] + bias)
            expected = sorted(range(E), key=lambda e, c=choice: -c[e])[:k]  # Python's sort is stable: ties by id
            assert sorted(ids.tolist()) == sorted(expected)
    s = np.full(E, 0.25, np.float32)
    assert moe.select_experts(s.astype(np.float64), np.zeros(E), k).tolist() == list(range(k))


def test_a_nan_router_score_reaches_the_moe_output():
    """Fixed with the above: one expert's router row NaN (a corrupt checkpoint row) gave finite outputs from the
    other experts, silently; now that expert is selected and every output of the layer is NaN, both paths."""
    for dtype in ("float32", "float64"):
        w = layers_of(fresh(dtype), "moe", "ffn")[1]
        w.in_proj[7] = np.nan
        xs = np.random.default_rng(2).standard_normal((5, w.in_proj.shape[1])).astype(dtype)
        assert np.isnan(moe.latent_moe(xs[0], w)).all()
        assert np.isnan(latent_moe_sequence(xs, w)).all()


# ---------------------------------------------------------------- MXFP4 scale codes 253..255


@pytest.mark.skipif(not mxfp4_matvec.AVAILABLE, reason="the compiled MXFP4 kernel was not built")
@pytest.mark.parametrize("code", [253, 254, 255])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf where both routes overflow
def test_mxfp4_row_kernels_decode_overflowing_scales_as_dequantize_does(code):
    """Fixed (`_mxfp4_matvec.c`, EDGE_SCALE): the token path's row kernels applied 2^(s - 127) to each group's partial
    sum, so at scale bytes 253..255 (decoded weights 4 x 2^126 and up overflow to inf; 255 is 2^128 = inf and a
    zero code decodes to 0 x inf = NaN) they returned finite outputs (e.g. 7e35, 1e9) where the dense route
    (mxfp4.dequantize then a matmul) and the sequence path's grouped kernels give inf or NaN."""
    rng = np.random.default_rng(code)
    E, R, C = 3, 24, 96
    packed = rng.integers(0, 256, (E, R, C // 2), dtype=np.uint8)
    packed[:, :6, :16] &= 0x33  # codes 0..3 only: some rows finite at 253 and 254
    packed[:, 6:9, :16] = 0  # all zero codes: 0 x inf at 255
    packed[:, 6:9, 3] = 0x70
    scale = rng.integers(120, 130, (E, R, C // 32), dtype=np.uint8)
    scale[:, :12, 0] = code
    scale[:, 16:, 2] = code
    x = (rng.standard_normal((13, C)) * 1e-3).astype(np.float32)
    picks = [2, 0, 1] + [2] * 10  # one input each for three experts, then 10 more for expert 2 (13: the AVX2 panels)
    with np.errstate(all="ignore"):
        W = mxfp4.dequantize(packed, scale)
        dense = np.stack([W[e] @ x[i] for i, e in enumerate(picks)])
        size = np.stack([np.abs(W[e]).astype(np.float64) @ np.abs(x[i]) for i, e in enumerate(picks)])  # sum |W x|
    for isa in mxfp4_matvec.isas():
        token = mxfp4_matvec.expert_matvec(packed, scale, picks[:3], x[:3], isa=isa, threads=1)
        grouped = mxfp4_matvec.grouped_matmat(packed, scale, [2, 0, 1], [0, 1, 2, 3], x[:3], isa=isa, threads=1)
        panels = mxfp4_matvec.grouped_matmat(packed, scale, [2], [0, 13], x[[0] + list(range(3, 13)) + [0, 0]],
                                             isa=isa, threads=1)
        for got, rows in ((token, [0, 1, 2]), (grouped, [0, 1, 2]), (panels, [0] + list(range(3, 13)) + [0, 0])):
            want, size_ = dense[rows], size[rows]
            for test in (np.isnan, np.isposinf, np.isneginf):
                np.testing.assert_array_equal(test(got), test(want), err_msg=f"{isa} {test.__name__}")
            fin = np.isfinite(want)
            assert fin.any() and (~fin).any()
            assert (np.abs(got - want)[fin] <= 1e-6 * size_[fin]).all()


# ---------------------------------------------------------------- real checks at the edges (no bug found)


@pytest.mark.parametrize("case", ["lower-bound", "bound-and-1e-3", "decay-0"])
def test_chunked_rule_at_the_gates_lower_bound_matches_the_float64_twin(case):
    """Every decay at -5 per token (a 64-token chunk spans e^-320, a 512-token one e^-2560: far below float32's
    and float64's range as one factor), mixed with near-1 decays per channel, or with decays of exactly 0.
    Measured: float64 3e-16 .. 2e-12, float32 1e-7 .. 7e-6 (relative to the largest output, state, norm)."""
    rng = np.random.default_rng(3)
    T, H, K, V = 300, 2, 8, 8
    q, k = rng.standard_normal((T, H, K)) / 8, rng.standard_normal((T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, beta = rng.standard_normal((T, H, V)) * 3, rng.random((T, H))
    la = {"lower-bound": np.full((T, H, K), -5.0),
          "bound-and-1e-3": np.where(rng.random((T, H, K)) < 0.5, -5.0, -1e-3),
          "decay-0": np.where(rng.random((T, H, K)) < 0.1, -np.inf, -0.01)}[case]
    S0 = rng.standard_normal((H, K, V))
    o_ref, S_ref, n_ref = naive_recurrent_delta_rule(q, k, v, np.exp(la), beta, S0)
    for dtype, tol in ((np.float64, 1e-11), (np.float32, 2e-5)):
        for chunk in (1, 2, 7, 64, 512, T):
            S = S0.astype(dtype)
            o, n = chunked_delta_rule(*(a.astype(dtype) for a in (q, k, v, la, beta)), S, chunk=chunk, state_norms=True)
            errs = rel(o.astype(np.float64), o_ref), rel(S.astype(np.float64), S_ref), rel(n.astype(np.float64), n_ref)
            assert max(errs) <= tol, (dtype, chunk, errs)


@pytest.fixture(scope="module")
def naive_twin():
    """The float64 twin of the random tiny model (tests/naive_decoder.py: reads the checkpoint itself)."""
    return NaiveDecoder(random_tiny_checkpoint())


@pytest.mark.parametrize("edge", ["embeddings-x1e4", "embeddings-x1e-4", "decays-at-the-bound"])
def test_float64_prefill_equals_stepping_and_the_twin_at_the_edges(edge, naive_twin):
    """Hidden states scaled by 1e4 / 1e-4 (the embedding table: every norm sees it, the residual stream carries
    it; at 1e-4 the first norms' mean squares sit below their eps), or every KDA decay at the gate's lower bound
    (dt_bias + 100: sigmoid 1, g = -5). float64 stepping against the float64 twin (the same change made to its
    operands) over 6 tokens: measured 2e-15 .. 1e-12. float64 prefill at chunks 1, 2, 7 and T (= 16; 64 and 512
    are T here) against float64 stepping: measured 6e-16 .. 7e-13 relative. float32 prefill at chunks 1, 2, 7 and T
    against float64 stepping is within 6x float32 stepping's own distance to it: at these edges float32 rounding is
    amplified, and where it lands moves with every summation order (measured over chunks 1 .. 16, 2026-12-05: decays
    at the bound 0.2x .. 3.6x before that day's compiled KDA and block-residual steps, 0.96x .. 3.6x after; 1e-4
    0.23x .. 2.7x, both ~1e-3; 1e4 0.9x .. 3.2x, both ~1e-6)."""
    tokens = np.random.default_rng(4).integers(0, 256, 16).tolist()
    twin = copy.deepcopy(naive_twin)
    if edge.startswith("embeddings"):
        twin.embed = twin.embed * (1e4 if edge.endswith("1e4") else 1e-4)
        assert not twin.cfg.tie_word_embeddings
    else:
        for layer in twin.layers:
            if layer.kind == "kda":
                layer.attention.dt_bias = layer.attention.dt_bias + 100.0
    naive = np.stack([twin.step(t)[0] for t in tokens[:6]])
    want, step32 = None, None
    for dtype in ("float64", "float32"):
        w = fresh(dtype)
        if edge.startswith("embeddings"):
            w.embedding()[...] *= 1e4 if edge.endswith("1e4") else 1e-4
        else:
            for kda_w in layers_of(w, "kda"):
                kda_w.dt_bias[...] += 100.0
        if dtype == "float64":
            want = step_all(w, tokens)
            assert rel(want[:6], naive) <= 1e-9
            for chunk in (1, 2, 7, len(tokens)):
                assert rel(prefill(w, tokens, chunk), want) <= 1e-9, chunk
        else:
            step32 = rel(step_all(w, tokens), want)
            for chunk in (1, 2, 7, len(tokens)):
                assert rel(prefill(w, tokens, chunk), want) <= 6 * step32 + 1e-6, (chunk, step32)


def test_long_mla_context_across_query_blocks_float64():
    """500 positions, chunks of 200 (each crossing query blocks of 128 and the cache's doublings) and one of 500,
    against the token form: float64 to 1e-12 (measured 4e-15 at 3,000 positions)."""
    w = layers_of(fresh("float64"), "mla")[0]
    xs = np.random.default_rng(5).standard_normal((500, w.in_proj.shape[1])) * 3
    state = mla.MlaState.empty(w, np, np.dtype(np.float64))
    want = np.stack([mla.mla_step(x, w, state) for x in xs])
    for chunk in (200, 500):
        state = mla.MlaState.empty(w, np, np.dtype(np.float64))
        got = np.concatenate([mla.mla_sequence(xs[a : a + chunk], w, state) for a in range(0, len(xs), chunk)])
        assert rel(got, want) <= 1e-12, chunk


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_eps_sensitive_reference_at_every_chunk_size(dtype):
    """Moonshot's eps-sensitive set (a wrong MLA latent eps moves its logits by 1.7, a wrong KDA l2 eps by 4.5):
    the sequence path at chunks 1, 2, 7 and 16 (the whole text), to 1e-4 of the reference prefill (measured:
    float64 4.5e-5, float32 3e-5 .. 5e-5)."""
    eps_set = REFERENCE_DIR.parent / "eps_sensitive"
    with np.load(eps_set / "tiny_k3_expected.npz") as z:
        tokens, want = z["tokens"], z["logits_prefill"]
    w = ke.from_pretrained(eps_set / "tiny_k3", device="cpu", dtype=dtype)
    for chunk in (1, 2, 7, len(tokens)):
        np.testing.assert_allclose(prefill(w, tokens, chunk), want, atol=1e-4, rtol=0)


@pytest.mark.skipif(not sequence_ops.AVAILABLE, reason="the compiled sequence ops were not built")
def test_compiled_elementwise_kernels_against_numpy_on_adversarial_inputs(monkeypatch):
    """NaN, +-inf, +-0, denormals, huge values, the exp clamps (-87 / 88) and the tanh switch (0.625), every ISA:
    the same NaN and inf pattern and sign as the NumPy formulas, within 4 ulp where both are finite, except exp's
    documented clamps (0 below -87, inf above 88: the exact values there are below 1.7e-38 / within 1% of FLT_MAX)."""
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-39, -1e-38, 3e38, -3e38, 0.625, -0.625,
                  np.nextafter(np.float32(0.625), np.float32(0)), np.nextafter(np.float32(0.625), np.float32(1)),
                  -86.99, -87.5, -104.0, 87.99, 88.5, 44.0, 44.5, 176.0, -176.0, 1e4, -1e4, 16.25, -16.25], np.float32)
    with np.errstate(all="ignore"):
        one = np.float32(1)
        want = {"exp": np.exp(x), "sigmoid": one / (one + np.exp(-x)), "silu": x / (one + np.exp(-x))}
        g, u = np.repeat(x, x.size), np.tile(x, x.size)
        t = np.tanh(g * np.float32(0.25)) / (one + np.exp(-g))
        situ = t * np.tanh(u * np.float32(1 / 25)) * np.float32(100)
    clamp = (x < -87) | (x > 88)
    for isa in sequence_ops.isas():
        monkeypatch.setattr(sequence_ops, "ISA", isa)
        got = {"exp": sequence_ops.exp_(x.copy()), "sigmoid": sequence_ops.sigmoid_(x.copy()),
               "silu": sequence_ops.silu_(x.copy()),
               "situ": sequence_ops.situ_and_mul_rows(np.concatenate([g, u])[None], 4.0, 25.0, None)[0]}
        for name, a in got.items():
            b = situ if name == "situ" else want[name]
            keep = ~clamp if name == "exp" else np.ones(a.shape, bool)
            a, b = a[keep], b[keep]
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{isa} {name}")
            np.testing.assert_array_equal(np.isinf(a) * np.sign(a), np.isinf(b) * np.sign(b), err_msg=f"{isa} {name}")
            fin = np.isfinite(a) & np.isfinite(b) & (np.abs(b) > 1e-37)
            ulp = np.abs(a[fin].astype(np.float64) - b[fin]) / np.spacing(np.abs(b[fin]))
            assert ulp.max() <= 4, (isa, name, float(ulp.max()))
            if name != "situ":  # (a product of underflowed factors: its zero's sign is the order's)
                np.testing.assert_array_equal(np.signbit(a[b == 0]), np.signbit(b[b == 0]), err_msg=f"{isa} {name}")
        e = got["exp"]
        assert (e[(x < -87)] == 0).all() and np.isposinf(e[x > 88]).all()
    assert math.isnan(float(sequence_ops.exp_(np.array([np.nan], np.float32))[0]))


def test_generate_refuses_nan_logits_rather_than_choosing_a_token():
    """Fixed (`Session.generate`): greedy decoding took np.argmax of NaN logits, the id of the first NaN (0 here), and
    went on decoding from it as if chosen; sampling failed with NumPy's "probabilities contain NaN"."""
    w = fresh("float32")
    w.embedding()[9] = np.nan
    session = ke.Session(w)
    session.feed([5, 9])
    for temperature in (0.0, 1.0):
        with pytest.raises(FloatingPointError, match="logits after token 1 hold NaN"):
            session.generate(2, temperature=temperature, seed=0)
    assert session.tokens == [5, 9]


@pytest.mark.parametrize("chunk", [8, 16, 40])
def test_float64_state_norms_stay_finite_through_a_decay_below_e_minus_355(chunk):
    """A legal chunk-aware hook sets one token's decay at layer 1 to 1e-200 (float64): the recorder's `kda.state.norm`
    on the sequence path was NaN for the whole sub-block, earlier tokens included, where stepping gives finite norms
    (the Gram route's float64 terms hold 1 / decay squared, which overflowed below e^-355)."""
    w = ke.from_pretrained(ke.tiny_checkpoint(), device="cpu", dtype="float64")
    ids = list(b"The decay of a token can be tiny: 1e-200 here")

    def tiny_decay(alpha, *, hook):
        a = alpha.copy()
        if hook.positions is None:
            a[...] = 1e-200 if hook.position == 3 else a
        elif 3 in list(hook.positions):
            a[list(hook.positions).index(3)] = 1e-200
        return a

    def norms(sequence):
        rec = ke.Recorder(names_filter="layers.1.kda.state")
        rec.add("layers.1.kda.decay", tiny_decay, chunks=True)
        state = ke.KimiDecodeState.new(w)
        if sequence:
            kimi_forward_sequence(w, state, ids, hooks=rec, chunk=chunk)
        else:
            for t in ids:
                ke.kimi_forward_token(w, state, t, hooks=rec)
        return np.asarray(rec.trace()["layers.1.kda.state.norm"])

    stepped, fed = norms(False), norms(True)
    assert np.isfinite(stepped).all() and np.isfinite(fed).all()
    np.testing.assert_allclose(fed, stepped, rtol=1e-12, atol=1e-12)
