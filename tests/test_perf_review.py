"""Review of tonight's speed-ups (MLA query blocks, the AVX2 KDA columns, a vpshufb MXFP4 row kernel, chunks of 512
and the session's chunk replayer): each test's expected values come from an independent reference (a float64
dequantised matvec, the float64 recurrence, stepping), and the ones marked 'failed before its fix' did. (The vpshufb
row kernel was then dropped: its bit-exact form gained ~3%; the row kernel decodes with e2m1_avx2 again.)"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_kernel

from kimi_explore.weights import mxfp4, mxfp4_matvec


def _float64_rows(packed, scale, x):
    """Row r of the one expert: the float64 dequantised weights times float64 x (inf/NaN as float64 gives them)."""
    W = mxfp4.naive_dequantize(packed[0], scale[0])
    with np.errstate(all="ignore"):
        return (W * x.astype(np.float64)).sum(axis=1)


def _dense_rows(packed, scale, x):
    """Row r of the one expert as the dense route holds it: `mxfp4.dequantize`'s float32 weights (from scale byte 253
    on some overflow to inf, and 0 x 2^128 is NaN at 255) times x, in float64."""
    with np.errstate(all="ignore"):
        W = mxfp4.dequantize(packed[0], scale[0]).astype(np.float64)
        return (W * x.astype(np.float64)).sum(axis=1)


def _mxfp4_kernels():
    return mxfp4_matvec.isas() if mxfp4_matvec.AVAILABLE else ("portable",)


@pytest.mark.parametrize("isa", _mxfp4_kernels())
def test_mxfp4_group_sums_above_half_the_float_range(isa):
    """A group whose products sum to 1e38..3e38 (finite in float32) at scales 126..128: the float64 value, not inf.
    Failed with tonight's first vpshufb row kernel (avx2), which summed twice the weights and halved the scale, so any
    group sum above 1.7e38 overflowed to inf, whatever the scale (x = 2e38 times a weight of 1 gave inf at scale 126)."""
    require_kernel()
    C = 64
    packed = np.zeros((1, 6, C // 2), np.uint8)
    packed[0, :, 0] = 0x02  # column 0: 1.0
    packed[0, 3:, 1] = 0x03  # column 2: 1.5 (rows 3..5)
    scale = np.array([126, 127, 127, 126, 127, 126], np.uint8).reshape(1, 6, 1).repeat(2, axis=2)
    x = np.zeros(C, np.float32)
    x[0], x[2] = 2e38, 6e37  # rows 0..2: 2e38 * 1 * 2^(s-127); rows 3..5: + 9e37, below FLT_MAX
    x[35] = 1.0  # the second group: 0 there
    want = _float64_rows(packed, scale, x)
    assert np.all(np.abs(want) < np.finfo(np.float32).max)
    got = mxfp4_matvec.expert_matvec(packed, scale, [0], x, isa=isa, threads=1)[0]
    assert np.all(np.isfinite(got)), got
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("isa", _mxfp4_kernels())
def test_mxfp4_every_code_scale_and_special_input(isa):
    """Every byte value (all 16 codes at both nibbles) at scales 0, 1, 127, 128 (an expert each), times x holding -0,
    subnormals, inf or NaN: the float64 dequantised matvec's value to float32 rounding where it is finite, its inf
    (with its sign) or NaN otherwise. At scales 254 and 255 the weights are the dense route's (`mxfp4.dequantize`:
    4 x 2^127 and up overflow float32 to inf; 2^128 is inf, and 0 x inf NaN), as the sequence path's grouped kernels
    hold them (tests/test_numerics_review.py): the row kernels once applied the power of two to each group's partial
    sum instead, finite (17268.9 here) where the dense route gives NaN."""
    require_kernel()
    C = 512  # 256 bytes per row: every byte value once
    rng = np.random.default_rng(7)
    scales = [0, 1, 127, 128, 254, 255]
    packed = np.stack([rng.permutation(256).astype(np.uint8) for _ in scales])[:, None]  # [E, 1, 256]
    scale = np.array(scales, np.uint8)[:, None, None].repeat(C // 32, axis=2)  # [E, 1, 16]
    x_scale = np.float32([1, 1, 1, 1, 2.0**-120, 1])
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    for special in (None, -0.0, tiny, 37 * tiny, np.inf, -np.inf, np.nan):
        x = rng.standard_normal((len(scales), C)).astype(np.float32) * x_scale[:, None]
        x[-1] = rng.integers(-3, 4, C)  # scale 255: integer x, exact group sums in any order
        if special is not None:
            x[:-1, rng.choice(C, 9, replace=False)] = special
        got = mxfp4_matvec.expert_matvec(packed, scale, np.arange(len(scales)), x, isa=isa, threads=1)[:, 0]
        for e in range(len(scales)):
            rows = _dense_rows if scales[e] >= 253 else _float64_rows
            want = rows(packed[e : e + 1], scale[e : e + 1], x[e])[0]
            W = mxfp4.naive_dequantize(packed[e, 0:1], scale[e, 0:1])
            with np.errstate(invalid="ignore"):
                err_scale = (np.abs(W) @ np.abs(x[e].astype(np.float64)))[0]
            if np.isfinite(want):
                assert abs(got[e] - want) <= 1e-6 * err_scale + 1e-43, (special, scales[e], got[e], want)
            else:
                assert np.array_equal(got[e], np.float32(want), equal_nan=True), (special, scales[e], got[e], want)


# ---------------------------------------------------------------- MLA query blocks on the sequence path

CUTS = [129, 300, 84]  # a chunk of one block and a row, one of 2 blocks and 44 rows, then a short one: 513 tokens


@pytest.fixture(scope="module")
def trained64():
    from kimi_explore import from_pretrained
    from kimi_explore.weights.tiny_model import tiny_checkpoint

    return from_pretrained(tiny_checkpoint(), device="cpu", dtype="float64")


@pytest.fixture(scope="module")
def stepped(trained64):
    """The float64 token form over 513 tokens: logits and a Recorder keeping every MLA layer's probabilities."""
    from kimi_explore import KimiDecodeState, Recorder, kimi_forward_token

    w = trained64
    tokens = [int(t) for t in np.random.default_rng(11).integers(0, w.config.vocab_size, sum(CUTS))]
    rec, state, logits = Recorder(full=["layers.*.mla.probs"]).bind(w), KimiDecodeState.new(w), []
    for t, tok in enumerate(tokens):
        rec.begin_token(tok, t)
        logits.append(np.array(kimi_forward_token(w, state, tok, hooks=rec)))
    return tokens, np.stack(logits), rec.trace()


def _fed(w, tokens, hooks_for):
    """Logits of the chunks CUTS through kimi_forward_sequence, chunk k with the hooks hooks_for(k)."""
    from kimi_explore import KimiDecodeState
    from kimi_explore.model.kimi_sequence import kimi_forward_sequence

    state, out, a = KimiDecodeState.new(w), [], 0
    for k, n in enumerate(CUTS):
        out.append(np.asarray(kimi_forward_sequence(w, state, tokens[a : a + n], hooks=hooks_for(k), chunk=n)))
        a += n
    return np.concatenate(out)


def test_mla_blocks_of_long_chunks_equal_stepping(trained64, stepped):
    """Chunks above QUERY_BLOCK (129, 300 after a cache of 129, 84 after 429), float64: the logits, bare and under a
    Recorder keeping the probabilities (the whole [T, heads, L0 + T] fired: every token's row is stepping's,
    zeros after it), to 1e-9."""
    tokens, want, trace = stepped
    np.testing.assert_allclose(_fed(trained64, tokens, lambda k: None), want, atol=1e-9, rtol=0)
    from kimi_explore import Recorder

    rec = Recorder(full=["layers.*.mla.probs"]).bind(trained64)
    np.testing.assert_allclose(_fed(trained64, tokens, lambda k: rec), want, atol=1e-9, rtol=0)
    got = rec.trace()
    names = [n for n in trace.names() if n.endswith("mla.probs")]
    assert names and names == [n for n in got.names() if n.endswith("mla.probs")]
    for n in names:
        a, b = got[n], trace[n]  # [T, heads, widest row]; stepping pads with NaN, the chunks' rows hold zeros there
        assert a.shape == b.shape
        seen = ~np.isnan(b)
        np.testing.assert_allclose(a[seen], b[seen], atol=1e-9, rtol=0)
        assert np.all(np.nan_to_num(a[~seen], nan=0.0) == 0.0)


def test_mla_a_hook_added_after_a_chunk_and_a_chain_with_a_plain_hooks_object(trained64, stepped):
    """A chunk-aware hook added after the first chunk gets the next chunks' whole probabilities (every MLA layer,
    [T, heads, L0 + T], rows equal to stepping's); a HookChain holding an object without listens_chunk fires them
    to it too (it cannot say it does not listen): both run to stepping's logits."""
    from kimi_explore import Hooks, Recorder
    from kimi_explore.inspection.hook_sites import HookChain

    tokens, want, trace = stepped
    hooks, got = Hooks().bind(trained64), []

    def hooks_for(k):
        if k == 1:
            hooks.add("layers.*.mla.probs", lambda v, hook: got.append((hook.name, v.copy())), chunks=True)
        return hooks

    np.testing.assert_allclose(_fed(trained64, tokens, hooks_for), want, atol=1e-9, rtol=0)
    mla = [n for n in trace.names() if n.endswith("mla.probs")]
    assert [n for n, _ in got] == mla + mla
    for (n, v), (a, b) in zip(got, [(129, 429)] * len(mla) + [(429, 513)] * len(mla), strict=True):
        assert v.shape == (b - a, trace[n].shape[1], b)
        np.testing.assert_allclose(v, np.nan_to_num(trace[n][a:b, :, :b], nan=0.0), atol=1e-9, rtol=0)

    class Plain:  # the chunk protocol without listens_chunk: records what it is fired at
        def __init__(self):
            self.fired = []

        def begin_chunk(self, token_ids, positions):
            pass

        def end_chunk(self):
            pass

        def token_in_chunk(self, t):
            pass

        def needs_tokens(self, names):
            return False

        def observe_chunk(self, name, value):
            pass

        def fire_chunk(self, name, value):
            self.fired.append(name)
            return value

    plain = Plain()
    chain = HookChain(plain, Recorder(names_filter="layers.1.*").bind(trained64))
    np.testing.assert_allclose(_fed(trained64, tokens, lambda k: chain), want, atol=1e-9, rtol=0)
    assert [n for n in plain.fired if n.endswith("mla.probs")] == mla * len(CUTS)


# ---------------------------------------------------------------- the AVX2 column-blocked KDA recurrence


@pytest.mark.parametrize("V", [8, 16, 24, 40])
@pytest.mark.parametrize("K", [1, 7])
@pytest.mark.parametrize("T", [0, 1, 5])
def test_kda_columns_any_head_split_and_norms_against_float64(V, K, T):
    """Every kernel (AVX2 takes the column-blocked one here: V a multiple of 8, one block of 8, 16 or 16 + 8), odd K,
    T = 0 / 1 / 5, gates at the bound: the heads cut into calls [0, 1) [1, 3) [3, 4) (threads) and one call, with and
    without norms, give the same bits; outputs, state and norms are the float64 recurrence's to float32 rounding."""
    from test_kda_chunk import operands, rel

    from kimi_explore.model import kda_recurrence
    from kimi_explore.model.kda_chunk import naive_recurrent_delta_rule

    if not kda_recurrence.AVAILABLE:
        pytest.skip("the compiled KDA recurrence was not built")
    H = 4
    q, k, v, g, beta, S0 = operands(V * K + T, max(T, 1), H=H, K=K, V=V, gates=(-5.0, 0.0))
    q, k, v, g, beta = (a[:T] for a in (q, k, v, g, beta))
    want_o, want_S, want_n = naive_recurrent_delta_rule(q, k, v, np.exp(g), beta, S0)
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    q, k, v, beta, alpha = f32(q), f32(k), f32(v), f32(beta), np.exp(f32(g))
    for isa in kda_recurrence.isas():
        runs = []
        for cuts, norms_on in (([0, H], True), ([0, 1, 3, H], True), ([0, 2, 2, H], False)):
            S, o = S0.astype(np.float32), np.full((T, H, V), np.nan, np.float32)
            n = np.full((T, H), np.nan, np.float32) if norms_on else None
            for h0, h1 in zip(cuts[:-1], cuts[1:], strict=True):
                kda_recurrence._ext.delta_rule(q, k, v, alpha, beta, S, o, n, T, H, K, V, h0, h1, isa)
            runs.append((o, S, n))
        (o, S, n) = runs[0]
        assert rel(S, want_S) < 2e-6
        if T:
            assert rel(o, want_o) < 2e-6 and rel(n, want_n) < 2e-6
        for o2, S2, n2 in runs[1:]:
            assert np.array_equal(o2, o) and np.array_equal(S2, S) and (n2 is None or np.array_equal(n2, n))


# ---------------------------------------------------------------- analyses' replay of a session keeping MLA probabilities


def test_replay_of_chunks_fed_with_full_mla_probabilities_is_bit_for_bit(trained_weights):
    """A session whose Recorder keeps an MLA layer's probabilities in full fed its 300 tokens as one chunk (the default
    chunk, 512): the probabilities were fired whole, so that layer scored the chunk in one block, not QUERY_BLOCK at
    a time. The analyses' replay promises the stored logits bit for bit: it must take the same route. Failed before
    its fix: 228 of 300 replayed logits differed in the last bits (the capture Recorder did not keep the
    probabilities, so the replay scored by blocks), and a lens read values the history never had."""
    import kimi_explore as ke
    from kimi_explore.analysis._replay import replay

    tokens = [int(t) for t in np.random.default_rng(3).integers(0, trained_weights.config.vocab_size, 300)]
    s = ke.Session(trained_weights, recorder=ke.Recorder(full=["layers.3.mla.probs"]))
    s.feed(tokens)
    s.step(tokens[0])
    s.feed(tokens[:140], chunk=139)  # a chunk of one block and a row after a cache of 301
    for t, _, logits in replay(s, ["layers.5.prefix_sum"]):
        assert np.array_equal(logits, s.logits_at(t)), t
    lens = ke.logit_lens(s, top=3, positions=[5, 299, 300, 440])
    for r, t in enumerate(lens.positions):
        assert np.array_equal(lens.top_ids[r], ke.lens_at(s, int(t), top=3).top_ids)


# ---------------------------------------------------------------- a pipeline's stages at chunks above QUERY_BLOCK


def test_pipeline_chunks_above_query_block_equal_one_process():
    """Two Ray stages (local, num_cpus=2, no dashboard) on chunks of 300 and 130: bare, and sessions whose Recorder
    keeps every MLA layer's probabilities (the stages build their own Recorder: it must listen as the driver's
    does, or the stages score by blocks), then a truncate inside the first chunk and a feed on: bit for bit one
    process (logits, records, state)."""
    ray = pytest.importorskip("ray")
    import gc

    import kimi_explore as ke
    from kimi_explore.model.kimi_sequence import kimi_forward_sequence
    from kimi_explore.weights.tiny_model import random_tiny_checkpoint

    path = random_tiny_checkpoint()
    w = ke.from_pretrained(path)
    tokens = [int(t) for t in np.random.default_rng(4).integers(0, w.config.vocab_size, 430)]
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with ke.RayPipeline(path, stages=2) as pipe:
            state, want_state = pipe.new_state(), ke.KimiDecodeState.new(w)
            got = pipe.forward_sequence(state, tokens, chunk=300)
            assert np.array_equal(got, np.asarray(kimi_forward_sequence(w, want_state, tokens, chunk=300)))
            full = ["layers.*.mla.probs"]
            a, b = ke.Session(pipe, recorder=ke.Recorder(full=full)), ke.Session(w, recorder=ke.Recorder(full=full))
            assert np.array_equal(a.feed(tokens, chunk=300), b.feed(tokens, chunk=300))
            ta, tb = a.trace(), b.trace()
            assert ta.names() == tb.names() and any(n.endswith("mla.probs") for n in ta.names())
            for n in ta.names():
                assert np.array_equal(ta[n], tb[n], equal_nan=True), n
            a.truncate(200)
            b.truncate(200)
            assert np.array_equal(a.feed(tokens[:50]), b.feed(tokens[:50]))
            for la, lb in zip(pipe.host_state(a.state).layers, b.state.layers, strict=True):
                x, y = la.attention, lb.attention
                if x.kind == "mla":
                    assert np.array_equal(np.asarray(x.values[:, : x.length]), np.asarray(y.values[:, : y.length]))
                else:
                    assert np.array_equal(np.asarray(x.recurrent), np.asarray(y.recurrent))
    finally:
        gc.collect()
        if started:
            ray.shutdown()
