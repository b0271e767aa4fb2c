"""Each intervention against an independent computation of what it must do.

The references never go through the intervention's own mechanism: a float64 decoder built from the
naive_* functions, a hand-written latent MoE and delta rule over recorded inputs, RMSNorms of
recorded sources, or a copy of the weights with a head's output columns zeroed.
"""

from __future__ import annotations

import dataclasses
import re

import naive_decoder
import numpy as np
import pytest
from conftest import REFERENCE_DIR
from naive_decoder import NaiveDecoder

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.backend import to_numpy
from kimi_explore.inspection.hooks import HookChain, Hooks
from kimi_explore.inspection.interventions import (
    ablate_experts,
    force_routing,
    override_attn_res,
    patch,
    scale_kda_head,
    zero_kda_head,
)
from kimi_explore.inspection.recorder import Recorder
from kimi_explore.model.ops import naive_situ_and_mul

TOKENS = [17, 203, 5, 88, 88, 141, 250, 3]


@pytest.fixture(scope="module")
def w64():
    return from_pretrained(REFERENCE_DIR, device="cpu", dtype="float64")


def f64(a):
    return np.asarray(to_numpy(a), dtype=np.float64)


def decode(w, tokens, *hook_sets):
    hooks = HookChain(*hook_sets) if hook_sets else None
    state = KimiDecodeState.new(w)
    return np.stack([np.array(kimi_forward_token(w, state, t, hooks=hooks)) for t in tokens])


def rms(x, g, eps):
    x = f64(x)
    return x / np.sqrt(np.mean(x * x) + eps) * f64(g)


def moe_by_hand(y, ffn, ids, weights):
    """The latent MoE with the given experts and combine weights, float64, one expert at a time."""
    y = f64(y)
    E, l = ffn.num_experts, ffn.latent_size
    Win = f64(ffn.in_proj)
    z = Win[E : E + l] @ y
    u = np.zeros(l)
    for e, we in zip(ids, weights, strict=True):
        w13, w2 = (f64(a)[0] for a in ffn.experts.gather(np.array([e])))
        u += we * (w2 @ naive_situ_and_mul(w13 @ z, ffn.situ_beta, ffn.situ_linear_beta))
    if ffn.use_latent_norm:
        u = u / np.sqrt(np.mean(u * u) + ffn.eps) * f64(ffn.routed_expert_norm)
    shared = f64(ffn.shared_down_proj) @ naive_situ_and_mul(Win[E + l :] @ y, ffn.situ_beta, ffn.situ_linear_beta)
    return f64(ffn.routed_expert_up_proj) @ u + shared


# ---------------------------------------------------------------- MoE routing


@pytest.mark.parametrize("layer", [1, 6, 13])
def test_ablating_every_routed_expert_zeroes_the_routed_output(w64, ref_weights, monkeypatch, layer):
    # 1. the float64 naive decoder with that layer's routed output removed (shared experts only)
    naive = NaiveDecoder(REFERENCE_DIR)
    target = naive.layers[layer].ffn
    real = naive_decoder.naive_latent_moe

    def shared_only(x, ffn):
        if ffn is not target:
            return real(x, ffn)
        E, l = ffn.num_experts, ffn.latent_size
        sh = f64(ffn.shared_down_proj) @ naive_situ_and_mul(f64(ffn.in_proj)[E + l :] @ f64(x), ffn.situ_beta,
                                                            ffn.situ_linear_beta)
        return sh, np.zeros(0, int), np.zeros(0)

    monkeypatch.setattr(naive_decoder, "naive_latent_moe", shared_only)
    want = np.stack([naive.step(t)[0] for t in TOKENS])
    got = decode(w64, TOKENS, ablate_experts(layer, "all"))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    assert np.abs(got - decode(w64, TOKENS)).max() > 1e-3  # the ablation matters
    # 2. float32: a hook that zeroes the routed output instead gives the very same bits
    zero = Hooks()
    zero.add(f"layers.{layer}.moe.routed_out", lambda v, *, hook: v * 0)
    np.testing.assert_array_equal(decode(ref_weights, TOKENS, ablate_experts(layer, "all")), decode(ref_weights, TOKENS, zero))
    # listing every expert id is the same as "all"
    np.testing.assert_array_equal(decode(ref_weights, TOKENS, ablate_experts(layer, range(8))), decode(ref_weights, TOKENS, zero))


@pytest.mark.parametrize("route", ["fused", "dequantise", "cached"])
def test_ablating_every_expert_of_a_packed_bank(ref_weights, route):
    """An empty selection through packed experts, every way they run: the same bits as dense experts."""
    packed = from_pretrained(REFERENCE_DIR, device="cpu", experts="packed",
                                                expert_cache_size=2 if route == "cached" else 0)
    if route == "dequantise":
        for layer in packed.layers[1:]:  # layer 0 is dense
            layer.ffn.experts.fused = False
    hooks = lambda: ablate_experts(range(1, 14), "all")  # noqa: E731  (no routed expert runs at all)
    np.testing.assert_array_equal(decode(packed, TOKENS[:5], hooks()), decode(ref_weights, TOKENS[:5], hooks()))


def test_ablating_some_experts_renormalises_over_the_rest(w64, ref):
    layer = 5
    top1 = ref[f"router_L{layer:02d}_topk_idx_decode"][:, 0]  # each token's first choice
    rec = Recorder(full=[f"layers.{layer}.ffn.in", f"layers.{layer}.ffn.out"]).bind(w64)
    for t, e in enumerate(top1):  # drop that token's own top choice, at that token only
        rec.extend(ablate_experts(layer, [int(e)], positions=t))
    decode(w64, TOKENS, rec)
    tr = rec.trace()
    ids, weights, scores = (tr[f"layers.{layer}.moe.router.{k}"] for k in ("topk_ids", "topk_weights", "scores"))
    np.testing.assert_array_equal(ids[:, 0], ref[f"router_L{layer:02d}_topk_idx_decode"][: len(TOKENS), 1])
    assert ids.shape == (len(TOKENS), 1)  # one expert left at every token
    ffn = w64.layers[layer].ffn
    for t in range(len(TOKENS)):
        kept = ids[t, :1]
        want_w = scores[t, kept] / scores[t, kept].sum() * ffn.routed_scaling_factor
        np.testing.assert_allclose(weights[t, :1], want_w, rtol=1e-12)
        out = moe_by_hand(tr[f"layers.{layer}.ffn.in"][t], ffn, kept, want_w)
        np.testing.assert_allclose(tr[f"layers.{layer}.ffn.out"][t], out, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("given", [None, [0.2, 0.3, 0.5]], ids=["weights-from-scores", "weights-given"])
def test_force_routing(w64, given):
    layer, forced = 6, [7, 0, 3]
    rec = Recorder(full=[f"layers.{layer}.ffn.in", f"layers.{layer}.ffn.out"]).bind(w64)
    rec.extend(force_routing(layer, forced, weights=given))
    decode(w64, TOKENS[:5], rec)
    tr = rec.trace()
    ffn = w64.layers[layer].ffn
    np.testing.assert_array_equal(tr[f"layers.{layer}.moe.router.topk_ids"], np.tile(forced, (5, 1)))
    for t in range(5):
        s = tr[f"layers.{layer}.moe.router.scores"][t, forced]
        want_w = np.asarray(given) if given else s / s.sum() * ffn.routed_scaling_factor
        np.testing.assert_allclose(tr[f"layers.{layer}.moe.router.topk_weights"][t], want_w, rtol=1e-12)
        out = moe_by_hand(tr[f"layers.{layer}.ffn.in"][t], ffn, forced, want_w)
        np.testing.assert_allclose(tr[f"layers.{layer}.ffn.out"][t], out, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- block attention residuals


def test_one_hot_override_selects_exactly_that_source(ref_weights):
    w, layer = ref_weights, 7  # blocks sealed at layers 0, 3, 6: three stored blocks at layer 7
    eps = w.config.rms_norm_eps
    full = ["final.block_residual", "layers.6.prefix_sum", "layers.7.attn.in", "layers.7.attn.out", "layers.7.ffn.in",
            "final.hidden"]
    for j in [0, 1, 2, "current", 5, -4]:  # model-wide columns (Trace.source_labels()): 6 of them, 5 = current
        rec = Recorder(full=full).bind(w)
        rec.extend(override_attn_res(layer, "attn", ("one_hot", j)))
        decode(w, TOKENS[:4], rec)
        tr = rec.trace()
        sources = np.concatenate([tr["final.block_residual"][:, :3], tr["layers.6.prefix_sum"][:, None]], axis=1)
        col = {"current": 3, 5: 3, -4: 2}.get(j, j)  # this site's column
        want_w = np.zeros(4)
        want_w[col] = 1
        np.testing.assert_array_equal(tr[f"layers.{layer}.attn_res.attn.weights"], np.tile(want_w, (4, 1)))
        for t in range(4):
            want = rms(sources[t, col], w.layers[layer].input_layernorm, eps)
            np.testing.assert_allclose(tr["layers.7.attn.in"][t], want, rtol=2e-5, atol=1e-6)
    # before the FFN the current source is this layer's running sum: previous output + its attention
    rec = Recorder(full=full).bind(w)
    rec.extend(override_attn_res(layer, "ffn", ("one_hot", "current")))
    decode(w, TOKENS[:4], rec)
    tr = rec.trace()
    current = tr["layers.6.prefix_sum"] + tr["layers.7.attn.out"]
    for t in range(4):
        np.testing.assert_allclose(tr["layers.7.ffn.in"][t], rms(current[t], w.layers[layer].post_attention_layernorm, eps),
                                   rtol=2e-5, atol=1e-6)
    # the output mix, block 2
    rec = Recorder(full=full).bind(w)
    rec.extend(override_attn_res("final", weights=("one_hot", 2)))
    decode(w, TOKENS[:4], rec)
    tr = rec.trace()
    for t in range(4):
        want = rms(tr["final.block_residual"][t, 2], w.norm, eps)
        np.testing.assert_allclose(tr["final.hidden"][t], want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("weights", ["uniform", [0.1, 0.2, 0.3, 0.4]], ids=["uniform", "given"])
def test_override_mixes_sources_with_the_given_weights(ref_weights, weights):
    w, layer = ref_weights, 8
    rec = Recorder(full=["final.block_residual", "layers.7.prefix_sum", "layers.8.attn.in"]).bind(w)
    rec.extend(override_attn_res(layer, "attn", weights))
    decode(w, TOKENS[:3], rec)
    tr = rec.trace()
    p = np.full(4, 0.25) if weights == "uniform" else np.asarray(weights)
    np.testing.assert_allclose(tr["layers.8.attn_res.attn.weights"], np.tile(p, (3, 1)), rtol=1e-6)
    for t in range(3):
        sources = np.concatenate([tr["final.block_residual"][t, :3], tr["layers.7.prefix_sum"][t][None]]).astype(np.float64)
        want = rms(p @ sources, w.layers[layer].input_layernorm, w.config.rms_norm_eps)
        np.testing.assert_allclose(tr["layers.8.attn.in"][t], want, rtol=1e-4, atol=1e-5)


def test_override_errors_name_the_site(ref_weights):
    with pytest.raises(ValueError, match=r"layers\.4\.attn_res\.attn\.weights.*got 4 weights.*mixes 3 sources"):
        decode(ref_weights, TOKENS[:1], override_attn_res(4, "attn", [0.25] * 4))
    with pytest.raises(ValueError, match=r"layers\.4\.attn_res\.attn\.weights.*does not mix source column 3.*mixes 3"):
        decode(ref_weights, TOKENS[:1], Hooks().bind(ref_weights) + override_attn_res(4, "attn", ("one_hot", 3)))
    with pytest.raises(ValueError, match="site must be"):
        override_attn_res(4, "mlp", "uniform")


# ---------------------------------------------------------------- KDA heads


def test_zeroing_a_kda_head_equals_removing_its_output_columns(ref_weights):
    w, layer, head = ref_weights, 4, 1
    K = w.layers[layer].attention.head_dim
    o_proj = np.array(w.layers[layer].attention.o_proj, copy=True)
    o_proj[:, head * K : (head + 1) * K] = 0
    layers = list(w.layers)
    layers[layer] = dataclasses.replace(layers[layer], attention=dataclasses.replace(layers[layer].attention, o_proj=o_proj))
    cut = dataclasses.replace(w, layers=layers)
    rec = Recorder().bind(w)
    rec.extend(zero_kda_head(layer, head))
    got = decode(w, TOKENS, rec)
    np.testing.assert_allclose(got, decode(cut, TOKENS), rtol=0, atol=1e-6)
    assert np.abs(got - decode(w, TOKENS)).max() > 1e-3
    norms = rec.trace()[f"layers.{layer}.kda.state.norm"]
    assert (norms[:, head] == 0).all() and (norms[:, [0, 2, 3]] > 0).all()


def test_scaling_a_kda_head_follows_the_delta_rule_from_the_scaled_state(w64):
    layer, head, c = 3, 2, 0.5
    rec = Recorder(full=[f"layers.{layer}.kda.{s}" for s in ("k", "v", "beta", "decay", "state")]).bind(w64)
    rec.extend(scale_kda_head(layer, head, c))
    decode(w64, TOKENS, rec)
    tr = rec.trace()
    k, v, beta, alpha = (tr[f"layers.{layer}.kda.{s}"] for s in ("k", "v", "beta", "decay"))
    H, K = k.shape[1:]
    S = np.zeros((H, K, v.shape[2]))
    for t in range(len(TOKENS)):
        for h in range(H):  # decay, read, write; then the intervention
            S[h] = alpha[t, h][:, None] * S[h]
            u = S[h].T @ k[t, h]
            S[h] += np.outer(k[t, h], beta[t, h] * (v[t, h] - u))
        S[head] *= c
        np.testing.assert_allclose(tr[f"layers.{layer}.kda.state"][t], S, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- patching


def test_patching_the_embedding_of_the_differing_token_reproduces_run_a(ref_weights):
    a_tokens, b_tokens = TOKENS, TOKENS[:3] + [42] + TOKENS[4:]
    rec_a = Recorder(full=["embed"]).bind(ref_weights)
    logits_a = decode(ref_weights, a_tokens, rec_a)
    logits_b = decode(ref_weights, b_tokens)
    assert not np.allclose(logits_a[3:], logits_b[3:])
    # the token enters only through its embedding: patch it and every later value is run A's, bit for bit
    for source in (rec_a.trace(), rec_a, rec_a.trace()["embed"], {3: rec_a.trace()["embed"][3]}):
        patched = decode(ref_weights, b_tokens, patch("embed", source, positions=[3]))
        np.testing.assert_array_equal(patched, logits_a)


def test_patching_one_position_changes_only_what_depends_on_it(ref_weights):
    a_tokens, b_tokens = TOKENS, TOKENS[::-1]
    rec_a = Recorder(full=["final.hidden"]).bind(ref_weights)
    logits_a = decode(ref_weights, a_tokens, rec_a)
    logits_b = decode(ref_weights, b_tokens)
    # final.hidden feeds only lm_head: position 5 becomes A's, every other position stays B's
    patched = decode(ref_weights, b_tokens, patch("final.hidden", rec_a.trace(), positions=5))
    np.testing.assert_array_equal(patched[5], logits_a[5])
    keep = [t for t in range(len(TOKENS)) if t != 5]
    np.testing.assert_array_equal(patched[keep], logits_b[keep])
    with pytest.raises(ValueError, match=r"no value at positions \[9\]"):
        patch("final.hidden", rec_a.trace(), positions=[9])
    with pytest.raises(KeyError, match="was not recorded"):
        patch("layers.3.attn.out", rec_a.trace())



def test_patching_attention_probabilities_from_a_fed_run(ref_weights):
    """The source run fed (the sequence path) records mla.probs as chunks [T, nh, T]; patching another run's probs
    from it at position 5 was refused ("the source value has shape (nh, 8), this site needs (nh, 6)": the masked
    positions read as 0, not as the padding a patch strips). Patched, B's probabilities there are A's."""
    from kimi_explore import Session

    layer = next(i for i, lw in enumerate(ref_weights.layers) if lw.attention.kind == "mla")
    name = f"layers.{layer}.mla.probs"
    a = Session(ref_weights, recorder=Recorder(full=[name]))
    a.feed(TOKENS, progress=False)
    source = a.trace()
    assert np.isnan(source[name][5][:, 6:]).all() and not np.isnan(source[name][5][:, :6]).any()
    for fed in (False, True):
        b = Session(ref_weights, recorder=Recorder(full=[name]))
        with b.intervene(patch(name, source, positions=[5])):
            b.feed(TOKENS[::-1], progress=False) if fed else [b.step(t) for t in TOKENS[::-1]]
        np.testing.assert_array_equal(b.trace()[name][5], source[name][5])


# mutation: patch("...topk_ids", trace) from a padded trace kept the -1 padding (-1 routes to the last expert)
def test_mutation_patching_routing_from_a_padded_trace_drops_the_padding(ref_weights):
    """Run A ablates one chosen expert of layer 6 at position 3, so its recorded top-k there is one id short
    and the Trace pads it with -1. Patching run B's routing at layer 6 from that trace routes B exactly as A
    was routed: the ids at position 3 are the clean ones without the ablated expert, and the logits are A's."""
    name, p = "layers.6.moe.router.topk_ids", 3
    rec_clean = Recorder().bind(ref_weights)
    logits_clean = decode(ref_weights, TOKENS, rec_clean)
    clean_ids = rec_clean.trace()[name]  # [T, k], no padding: every position chose k experts
    dropped = int(clean_ids[p, 0])
    rec_a = Recorder().bind(ref_weights)
    logits_a = decode(ref_weights, TOKENS, ablate_experts(6, [dropped], positions=[p]), rec_a)
    padded = rec_a.trace()[name]
    assert padded[p].tolist() == [int(e) for e in clean_ids[p] if e != dropped] + [-1]  # the trace's padding
    assert not np.array_equal(logits_a[p], logits_clean[p])

    rec_b = Recorder().bind(ref_weights)
    patched = decode(ref_weights, TOKENS, patch(name, rec_a.trace()), rec_b)
    got = rec_b.trace()[name]
    assert got[p].tolist() == [int(e) for e in clean_ids[p] if e != dropped] + [-1]  # k - 1 experts, padded by the trace
    np.testing.assert_array_equal(np.delete(got, p, axis=0), np.delete(clean_ids, p, axis=0))
    # one combine weight at position 3 (NaN-padded), the one A used: no weight went to a padding "expert"
    w_name = "layers.6.moe.router.topk_weights"
    np.testing.assert_array_equal(rec_b.trace()[w_name][p], rec_a.trace()[w_name][p])
    assert np.isnan(rec_a.trace()[w_name][p, -1]) and np.isfinite(rec_a.trace()[w_name][p, :-1]).all()
    np.testing.assert_array_equal(patched, logits_a)


def test_interventions_restricted_to_positions(ref_weights):
    base = decode(ref_weights, TOKENS[:5])
    got = decode(ref_weights, TOKENS[:5], ablate_experts(2, "all", positions=[2]))
    np.testing.assert_array_equal(got[:2], base[:2])
    assert not np.allclose(got[2], base[2])


def test_intervention_argument_errors(ref_weights):
    with pytest.raises(ValueError, match=r"expert ids \[9\] are outside 0\.\.7"):
        decode(ref_weights, TOKENS[:1], force_routing(3, [1, 9]))
    with pytest.raises(ValueError, match="duplicates"):
        force_routing(3, [1, 1])
    with pytest.raises(ValueError, match="heads"):
        decode(ref_weights, TOKENS[:1], scale_kda_head(0, 7, 0.5))
    with pytest.raises(ValueError, match="'all' or a list"):
        ablate_experts(3, "none")
    with pytest.raises(ValueError, match="layer must be"):
        ablate_experts(-1, [0])


@pytest.fixture(scope="module")
def trained64():
    from kimi_explore import tiny_checkpoint

    return from_pretrained(tiny_checkpoint(), device="cpu", dtype="float64")


def _two_ways(w, ids, make, chunk):
    """(stepping's logits or its error, the sequence path's logits or its error) under the hooks make() gives."""
    from kimi_explore import kimi_forward_sequence

    out = []
    for run in (lambda st, h: np.stack([to_numpy(kimi_forward_token(w, st, t, hooks=h)) for t in ids]),
                lambda st, h: to_numpy(kimi_forward_sequence(w, st, ids, hooks=h, chunk=chunk))):
        try:
            out.append(run(KimiDecodeState.new(w), make().bind(w)))
        except ValueError as e:
            out.append(e)
    return out


@pytest.mark.parametrize("chunk", [1, 5])
@pytest.mark.parametrize("make, says", [
    (lambda: force_routing(7, [5], [0.229]) + force_routing(7, [4, 12, 15, 2]),
     r"1 weights .*for the 4 selected experts \[4, 12, 15, 2\]"),
    (lambda: force_routing(7, [5, 6], [0.5, 0.5]) + ablate_experts(7, [5]), r"2 weights .*for the 1 selected experts \[6\]")])
def test_routing_weights_that_do_not_pair_with_the_experts_raise_on_both_paths(trained64, make, says, chunk):
    """Stepping refused both; the chunk form padded the given weights with 0 (experts 12, 15, 2 weighted 0) or kept
    the weight of an expert another hook dropped, and decoded (logits 1.1-1.3 from the unhooked run)."""
    stepped, fed = _two_ways(trained64, [100, 101, 32, 115, 116], make, chunk)
    assert isinstance(stepped, ValueError) and isinstance(fed, ValueError)
    assert re.search(r"layers\.7\.moe\.router\.topk_weights: .*" + says + r": give one weight per expert", str(fed))


def test_a_patch_of_weights_for_fewer_experts_raises_on_both_paths_and_forcing_fewer_with_weights_runs(trained64):
    trained = trained64
    """Weights recorded with one expert per token (an ablation) patched into a run with two: the chunk form padded
    them with 0. Forcing one expert with its weight at some tokens of a chunk (the rows ragged) is fine: stepping's."""
    site = "layers.2.moe.router.topk_weights"
    ids = [100, 101, 32, 115, 116]
    rec = Recorder(names_filter=lambda n: False, full=[site])
    state = KimiDecodeState.new(trained)
    for t in ids:
        kimi_forward_token(trained, state, t, hooks=HookChain((ablate_experts(2, "all") + force_routing(2, [3])).bind(trained),
                                                              rec.bind(trained)))
    stepped, fed = _two_ways(trained, ids, lambda: patch(site, rec.trace()), 5)
    assert isinstance(stepped, ValueError) and isinstance(fed, ValueError)
    assert re.search(r"token 0 of the chunk has 1 weights \[[\d.e-]+\] for the 2 selected experts", str(fed))
    stepped, fed = _two_ways(trained, ids, lambda: force_routing(2, [3], [0.7], positions=[1, 3]), 5)
    np.testing.assert_allclose(fed, stepped, rtol=0, atol=1e-12)


def test_an_error_inside_a_chunk_says_where_the_chunk_sits(trained64):
    """A message naming "token t of the chunk" (weights that do not pair with the experts, a hook's own error) was
    relative to a chunk the user never sees; the error now carries a note with the chunk's positions."""
    from kimi_explore import kimi_forward_sequence

    state = KimiDecodeState.new(trained64)
    kimi_forward_sequence(trained64, state, [100, 101, 32, 115, 116], chunk=5)  # positions 0..4, no hooks
    bad = (force_routing(7, [5], [0.229], positions=[7]) + force_routing(7, [4, 12, 15, 2], positions=[7])).bind(trained64)
    with pytest.raises(ValueError, match=r"token 2 of the chunk has 1 weights") as e:
        kimi_forward_sequence(trained64, state, [100, 101, 32, 115, 116], hooks=bad, chunk=5)
    assert e.value.__notes__ == ["(raised in a chunk of 5 tokens at positions 5..9: its token t is position 5 + t)"]
