"""A reviewer's pass over the sequence path outside the core forward: the pipeline running chunks,
the analyses, and the arguments they take.

Expected values come from one process running the same chunks (a pipeline's results must equal it
bit for bit) or from the token path (`Session.step`). The Ray tests start a local Ray (num_cpus=2,
no dashboard) and shut it down at the end of the module.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.inspection.hooks import HookChain, Hooks
from kimi_explore.inspection.interventions import ablate_experts, force_routing
from kimi_explore.model.kimi_sequence import kimi_forward_sequence
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

TEXT = list(b"def f(x):\n    return x * 2  # a pipeline, chunk by chunk\n")  # 55 tokens


# ---------------------------------------------------------------- a pipeline running chunks under hooks


@pytest.fixture(scope="module")
def pipe3():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with ke.RayPipeline(random_tiny_checkpoint(), stages=3) as pipe:  # layers 0-5, 6-10, 11-15
            yield pipe
    finally:
        gc.collect()
        ray.shutdown()


@pytest.fixture(scope="module")
def one():
    return ke.from_pretrained(random_tiny_checkpoint())


def chunk_hooks() -> Hooks:
    """Chunk-aware hooks on the three stages: built-in interventions and a user hook that reads whole chunks."""

    def centre_over_chunk(value, *, hook):  # local: Ray ships it by value, not by this test module's name
        """Each token's attention output minus the chunk's mean: it needs the whole chunk."""
        return value - value.mean(axis=0) if hook.positions is not None else None

    hooks = ablate_experts(4, [0, 1, 2]) + force_routing(13, [5])
    hooks.add("layers.8.attn.out", centre_over_chunk, chunks=True)
    return hooks


def test_chunk_aware_hooks_get_whole_chunks_in_the_stages(pipe3, one):
    """The stages must keep a hook's `chunks=True`: without it they call it token by token (the user hook
    above then centres nothing) and run the hooked layers token by token, unlike one process."""
    got = pipe3.forward_sequence(pipe3.new_state(), TEXT, hooks=chunk_hooks(), chunk=16)
    want = np.asarray(kimi_forward_sequence(one, ke.KimiDecodeState.new(one), TEXT, hooks=chunk_hooks().bind(one),
                                            chunk=16))
    plain = np.asarray(kimi_forward_sequence(one, ke.KimiDecodeState.new(one), TEXT, chunk=16))
    assert np.abs(want - plain).max() > 1e-2  # the hooks change the run
    assert np.array_equal(got, want)


def test_source_ablation_over_a_pipeline_equals_one_process(pipe3, one):
    """Its masks are chunk-aware hooks that run in the stages: the same floats as one process."""
    kw = dict(layers=[3, 7, 12], chunk=7)
    got = ke.source_ablation(pipe3, TEXT[:30], **kw)
    want = ke.source_ablation(one, TEXT[:30], reuse_prefix=False, **kw)
    assert got.clean_loss == want.clean_loss and len(got) > 6
    assert got.rows == want.rows


def test_recover_replays_chunks_as_a_recorder_with_full_recurrent_records_decoded_them(pipe3, one):
    """A Recorder keeping a full KDA state makes that layer run token by token inside a fed chunk (its chunked
    form never builds per-token states), which rounds differently. `recover()` replays the history and asks
    for the stored logits bit for bit: it must replay the chunks the same way, or it drops the history."""
    rec = dict(full=["layers.2.kda.state"])
    s, want = ke.Session(pipe3, recorder=ke.Recorder(**rec)), ke.Session(one, recorder=ke.Recorder(**rec))
    for x in (s, want):
        x.feed(TEXT[:20], chunk=8)
        x.step(TEXT[20])
        x.feed(TEXT[21:30], chunk=8)
    plain = ke.Session(one, recorder=False)
    plain.feed(TEXT[:20], chunk=8)
    assert not np.array_equal(plain.logits, want.logits[:20])  # the full record does change the chunks' rounding
    assert s.recover() == [] and len(s) == 30
    for x in (s, want):
        x.feed(TEXT[30:], chunk=8)
    assert s.tokens == want.tokens and np.array_equal(s.logits, want.logits)
    assert np.array_equal(s.trace()["layers.2.kda.state"], want.trace()["layers.2.kda.state"])


# ---------------------------------------------------------------- resident forms on the sequence path against the token form

RESIDENT = {"bf16-kernel": dict(weight_dtype="bfloat16"), "packed-fused": dict(experts="packed", expert_cache_size=0),
            "mapped-cache": dict(experts="mapped", expert_cache_size=3),
            "bf16-mapped-fused": dict(weight_dtype="bfloat16", experts="mapped", expert_cache_size=0),
            "bf16-packed-float64": dict(weight_dtype="bfloat16", experts="packed", dtype="float64")}


@pytest.mark.parametrize("name", list(RESIDENT))
def test_resident_weights_chunk_form_equals_token_form(name):
    """bf16 trunks and packed or mapped experts (fused kernel, or dequantised through a small LRU cache), the
    same weights both ways: plain, with one pair of experts forced on every token of a layer (a group of
    all 45 rows: the kernels' panel route) and with half the experts of the last MoE layer ablated (experts
    no token selects). Logits to float32 rounding (float64: 1e-9), routing ids identical."""
    from conftest import require_kernel

    from kimi_explore.weights.tiny_model import tiny_checkpoint

    if "fused" in name:
        require_kernel()
    w = ke.from_pretrained(tiny_checkpoint(), device="cpu", **RESIDENT[name])
    moe = [i for i in w.layer_ids if w.config.is_moe_layer(i)]
    E = w.config.num_experts
    tol = 1e-9 if w.dtype == np.float64 else 1e-4
    forced, ablated = moe.index(moe[1]), moe.index(moe[-1])
    runs = {"plain": (Hooks, None),
            "forced": (lambda: force_routing(moe[1], [3, 5]), lambda ids: (ids[:, forced] == [3, 5]).all()),
            "ablated": (lambda: ablate_experts(moe[-1], list(range(0, E, 2))), lambda ids: (ids[:, ablated] % 2 != 0).all())}
    for what, (make, check) in runs.items():
        stepped, fed = (ke.Recorder(names_filter="layers.*.moe.router.topk_ids") for _ in range(2))
        hooks = HookChain(make().bind(w), stepped.bind(w))
        state, want = w.new_state(), []
        for t, tok in enumerate(TEXT[:45]):
            hooks.begin_token(tok, t)
            want.append(np.asarray(w.forward_token(state, tok, hooks)))
        got = np.asarray(w.forward_sequence(w.new_state(), TEXT[:45], HookChain(make().bind(w), fed.bind(w)), chunk=16))
        np.testing.assert_allclose(got, np.stack(want), atol=tol, rtol=0, err_msg=what)
        a, b = stepped.trace().routing()["topk_ids"], fed.trace().routing()["topk_ids"]
        np.testing.assert_array_equal(b, a, err_msg=what)
        assert check is None or check(b), what  # the hook did act (the ablated ids are -1 padded: odd or -1)


# ---------------------------------------------------------------- analyses on the sequence path against stepping


def test_routing_stats_over_texts_of_several_chunks_equal_stepping_and_keep_no_states(trained_weights, monkeypatch):
    """Texts of 300 (two chunks: 256 + 44), 1 and 37 tokens, each from a fresh state: the counts are those of
    each text stepped token by token in its own session. No decode state is copied on the way (a Session's
    feed kept one per chunk, and every logit: at K3 width gigabytes per document)."""
    from kimi_explore.analysis.learned import pydoc_corpus

    w = trained_weights
    corpus = pydoc_corpus().decode("utf-8")  # the model's own text, the same on every Python
    texts = [corpus[1000:1300], "x", corpus[9000:9037]]
    copies = []
    copy = ke.KimiDecodeState.copy
    monkeypatch.setattr(ke.KimiDecodeState, "copy", lambda self: copies.append(1) or copy(self))
    got = ke.routing_stats(w, texts, progress=False)
    assert copies == []
    monkeypatch.undo()

    M, E = len(got.moe_layers), w.config.num_experts
    counts, pairs, weights = np.zeros((M, E), np.int64), np.zeros((M, E, E), np.int64), np.zeros((M, E))
    top1 = {}
    for text in texts:
        s = ke.Session(w, recorder=ke.Recorder(names_filter="layers.*.moe.router.*"))
        for t in text.encode():
            s.step(t)
        r = s.trace().routing()
        assert r["moe_layers"] == got.moe_layers
        for t, tok in enumerate(text.encode()):
            for j in range(M):
                ids = r["topk_ids"][t, j].tolist()
                for e, we in zip(ids, r["topk_weights"][t, j].tolist(), strict=True):
                    counts[j, e] += 1
                    weights[j, e] += we
                    for f in ids:
                        pairs[j, e, f] += 1
                key = (j, ke.analysis.routing_stats.byte_class(tok), ids[0])
                top1[key] = top1.get(key, 0) + 1
    assert got.tokens == 338 and len(got.texts) == 3
    np.testing.assert_array_equal(got.counts, counts)
    np.testing.assert_array_equal(got.coactivation, pairs)
    np.testing.assert_allclose(got.weight_sum, weights, rtol=1e-5)
    assert {(j, got.class_names[c], e): int(n) for (j, c, e), n in np.ndenumerate(got.class_top1) if n} == top1


def test_replay_reproduces_chunks_decoded_with_full_recurrent_records_bit_for_bit(tiny_weights):
    """The analyses replay fed chunks and promise the stored logits bit for bit (a cut chunk aside). A session
    Recorder keeping a full KDA state ran that layer token by token inside each chunk: the replay must too,
    or every value an analysis reads (lens, attribution) is off by the other rounding."""
    from kimi_explore.analysis._replay import replay

    s = ke.Session(tiny_weights, recorder=ke.Recorder(full=["layers.2.kda.state"]))
    s.feed(TEXT[:20], chunk=8)
    s.step(TEXT[20])
    s.feed(TEXT[21:30], chunk=6)
    for t, _, logits in replay(s, ["layers.5.prefix_sum"]):
        assert np.array_equal(logits, s.logits_at(t)), t
    lens = ke.logit_lens(s, top=3, positions=[4, 17, 29])
    for r, t in enumerate(lens.positions):
        assert np.array_equal(lens.top_ids[r], ke.lens_at(s, int(t), top=3).top_ids)


def test_lens_attribution_and_diff_of_a_session_fed_in_chunks_equal_stepping(trained_weights):
    """45 tokens fed as chunks of 16, 16 and 8 (the last one short), one token stepped, then a chunk of 4:
    the lens, the attribution and the recorded sites at tokens of the second and the last chunks are those
    of the same tokens stepped one by one, to float32 rounding (top ids identical)."""
    w = trained_weights
    fed, stepped = ke.Session(w), ke.Session(w)
    fed.feed(TEXT[:40], chunk=16)
    fed.step(TEXT[40])
    fed.feed(TEXT[41:45], chunk=4)
    for t in TEXT[:45]:
        stepped.step(t)
    at = [0, 17, 31, 35, 39, 40, 44]
    la, lb = (ke.logit_lens(x, top=3, targets="next", positions=at) for x in (fed, stepped))
    np.testing.assert_array_equal(la.top_ids, lb.top_ids)
    np.testing.assert_allclose(la.top_probs, lb.top_probs, atol=1e-5)
    np.testing.assert_allclose(la.target_logprobs, lb.target_logprobs, atol=1e-4)
    for a, b in zip(ke.logit_attribution(fed, at), ke.logit_attribution(stepped, at), strict=True):
        assert a.t == b.t and a.token == b.token and a.contributions.keys() == b.contributions.keys()
        assert abs(a.logit - b.logit) <= 1e-4
        assert max(abs(a.contributions[k] - b.contributions[k]) for k in a.contributions) <= 1e-4
    d = ke.diff(stepped, fed)
    assert len(d) == 45 and d.routing_changes == [] and not d.flips.any()
    assert np.nanmax(np.abs(d.attn_res)) <= 1e-5 and np.max(np.abs(d.final_attn_res)) <= 1e-5
    assert np.max(np.abs(d.kda_state)) <= 1e-4 * np.max(stepped.trace().kda_state_norms()[0])
    assert np.max(d.kl) <= 1e-9


# ---------------------------------------------------------------- bad arguments: named, expected vs found


@pytest.fixture(scope="module")
def fed(trained_weights):
    s = ke.Session(trained_weights)
    s.feed(TEXT[:11], chunk=4)
    return s


def test_routing_stats_refuses_what_is_not_a_corpus(trained_weights):
    """A flat id list, bytes or an empty corpus used to fail deep inside (or count nothing); float ids were cut to ints."""
    w = trained_weights
    with pytest.raises(TypeError, match=r"text 0 is int 97; expected a string or a list of token ids .*\[ids\]"):
        ke.routing_stats(w, [97, 98, 99], progress=False)
    with pytest.raises(TypeError, match="texts must be a string or a list of texts .*got bytes"):
        ke.routing_stats(w, b"abc", progress=False)
    with pytest.raises(ValueError, match="texts is empty"):
        ke.routing_stats(w, [], progress=False)
    with pytest.raises(TypeError, match=r"text 1: token_id must be an integer, got 97.5 \(float\)"):
        ke.routing_stats(w, ["ab", [97.5, 98]], progress=False)
    with pytest.raises(ValueError, match=r"text 0: token_id=256 is outside the vocabulary"):
        ke.routing_stats(w, [[1, 256]], progress=False)


def test_lens_and_attribution_positions_must_be_ints(fed):
    """A float or bool position used to be cut to an int (the lens of another token); an empty list failed in min()."""
    with pytest.raises(TypeError, match=r"logit_lens: positions: token position 2.7 \(float\): expected an int"):
        ke.logit_lens(fed, positions=[2.7])
    with pytest.raises(TypeError, match=r"token position True \(bool\)"):
        ke.logit_lens(fed, positions=True)
    with pytest.raises(ValueError, match="logit_lens: positions is empty"):
        ke.logit_lens(fed, positions=[])
    with pytest.raises(TypeError, match=r"token position 2.5 \(float\): expected an int \(0..10"):
        ke.logit_attribution(fed, 2.5)
    with pytest.raises(ValueError, match="logit_attribution: t is empty"):
        ke.logit_attribution(fed, [])
    assert ke.logit_lens(fed, positions=np.array([9, -1, 4])).positions.tolist() == [4, 9, 10]


def test_source_ablation_and_diff_arguments(trained_weights, fed):
    w = trained_weights
    for chunk in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match=f"source_ablation: chunk must be a positive int .*got {chunk!r}"):
            ke.source_ablation(w, TEXT[:6], chunk=chunk)
    for what in ("families", "sites", "layers"):
        with pytest.raises(ValueError, match=f"source_ablation: {what} is empty: nothing to mask"):
            ke.source_ablation(w, TEXT[:6], **{what: []})
    with pytest.raises(TypeError, match=r"sites must be a list .*got the string 'attn' \(one site: \['attn'\]\)"):
        ke.source_ablation(w, TEXT[:6], sites="attn")
    with pytest.raises(TypeError, match=r"source_ablation: token_ids: token_id must be an integer, got 98.5"):
        ke.source_ablation(w, [97, 98.5, 99])
    with pytest.raises(ValueError, match="diff: run a holds no tokens"):
        ke.diff(ke.Session(w), fed)


@pytest.mark.parametrize("bad", [16, -2], ids=["id_E", "id_minus_2"])
def test_a_chunk_hook_returning_expert_ids_out_of_range_is_named(trained_weights, bad):
    """-1 drops a selection on the sequence path; -2 was taken as a drop too (the token form refuses it), and E
    failed inside NumPy's indexing without saying which site or what was expected."""
    w = trained_weights
    hooks = Hooks()
    hooks.add("layers.3.moe.router.topk_ids", lambda ids, *, hook: np.full_like(ids, bad), chunks=True)
    with pytest.raises(ValueError, match=rf"layers.3.moe.router.topk_ids: a hook returned expert ids int64 \(5, 2\) "
                                         rf"with \[{bad}\]: expected .* -1 \(drop that selection\) or an expert 0..15"):
        w.forward_sequence(w.new_state(), TEXT[:5], hooks.bind(w))
