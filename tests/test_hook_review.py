"""Adversarial review of the hook contract on both paths (stepping, `kimi_forward_sequence` in chunks).

Every expected value comes from stepping token by token with a plain hook written here (no intervention
machinery), or from the recorded source run itself: never from the code under test checked against itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from kimi_explore import KimiDecodeState, kimi_forward_sequence, kimi_forward_token
from kimi_explore.inspection.hooks import HookChain, Hooks
from kimi_explore.inspection.interventions import ablate_experts, force_routing, override_attn_res, patch, scale_kda_head
from kimi_explore.inspection.recorder import Recorder

TOKENS = [17, 203, 5, 88, 88, 141, 250, 3, 9, 44]
PREFIX = [31, 62]


def stepped(w, tokens, hooks=None, prefix=(), announce=True):
    """Logits [T, vocab] stepping token by token after an unhooked prefix; announce: tell the hooks each token's
    position (`begin_token`, as Session does)."""
    state = KimiDecodeState.new(w)
    for t in prefix:
        kimi_forward_token(w, state, t)
    out = []
    for t in tokens:
        if hooks is not None and announce:
            hooks.begin_token(t, state.position)
        out.append(np.array(kimi_forward_token(w, state, t, hooks=hooks)))
    return np.stack(out)


def fed(w, tokens, hooks=None, prefix=(), chunk=None):
    state = KimiDecodeState.new(w)
    if prefix:
        kimi_forward_sequence(w, state, list(prefix))
    return np.array(kimi_forward_sequence(w, state, tokens, hooks=hooks, chunk=chunk))


def mla_layer(w) -> int:
    return next(i for i, lw in enumerate(w.layers) if lw.attention.kind == "mla")


# ---------------------------------------------------------------- patch of mla.probs on chunks
@pytest.mark.parametrize("chunk", [3, 5, 64], ids=lambda c: f"chunk{c}")
def test_patching_attention_probabilities_on_chunks_matches_stepping(ref_weights, chunk):
    """`patch("layers.i.mla.probs", trace)` on the sequence path put the trace's NaN padding (the positions a
    token does not see yet) into the chunk's masked columns, and p @ values then made every later logit NaN.
    Expected: stepping with a plain hook that puts the source's row [nh, p + 1] at positions 4 and 6."""
    w = ref_weights
    name = f"layers.{mla_layer(w)}.mla.probs"
    source_ids = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    rec = Recorder(full=[name]).bind(w)
    stepped(w, source_ids, rec)
    trace = rec.trace()
    rows = {p: trace[name][p][:, : p + 1] for p in (4, 6)}  # the token form's row: p + 1 positions seen
    assert all(np.isfinite(r).all() for r in rows.values())

    plain = Hooks()
    plain.add(name, lambda v, *, hook: rows[hook.position].copy() if hook.position in rows else None)
    want = stepped(w, TOKENS, plain, PREFIX)
    got = fed(w, TOKENS, patch(name, trace, positions=[4, 6]), PREFIX, chunk)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4)
    assert not np.allclose(want, stepped(w, TOKENS, None, PREFIX), atol=1e-3)  # the patch does change the run


# ---------------------------------------------------------------- positions come from the decode state
def test_hook_positions_are_the_state_positions_on_both_paths(ref_weights):
    """Unannounced (no `begin_token`), the token form counted the `embed` sites a Hooks had seen, while the
    sequence path (and a pipeline stage) took positions from the decode state. One Hooks reused for a second
    prompt then saw positions 10.. there, and after an unhooked prefix it saw 0 at the state's position 2:
    `positions=` acted at the wrong tokens, or never. Expected: what each path's state says, 0.. per prompt (and
    the token ids kimi_forward_token was given, which a trace recorded as -1 while fed chunks had them)."""
    w = ref_weights
    seen = []
    hooks = Hooks()
    hooks.add("logits", lambda v, *, hook: seen.append(hook.position))
    stepped(w, TOKENS[:3], hooks, announce=False)
    stepped(w, TOKENS[:3], hooks, announce=False)  # a second prompt, a fresh state
    stepped(w, TOKENS[:3], hooks, prefix=PREFIX, announce=False)
    assert seen == [0, 1, 2, 0, 1, 2, 2, 3, 4]
    ids, seen[:] = [], []
    hooks.add("embed", lambda v, *, hook: ids.append(hook.token_id))
    chain = HookChain(hooks, Recorder().bind(w))
    stepped(w, TOKENS[:2], chain, prefix=PREFIX, announce=False)  # the token ids too: the trace had -1 (fed: the ids)
    trace = chain.hook_sets[1].trace()
    assert seen == [2, 3] and trace.positions.tolist() == [2, 3]
    assert ids == TOKENS[:2] and trace.tokens.tolist() == TOKENS[:2]

    # an intervention at absolute position 3, reused: stepping agrees with feeding, prompt after prompt
    ablate = ablate_experts(3, "all", positions=[3])
    plain = Hooks()  # the expectation: a plain hook told the position by the driver
    plain.add("layers.3.moe.router.topk_ids", lambda ids, *, hook: ids[:0] if hook.position == 3 else None)
    for prefix in ((), (), PREFIX):
        want = stepped(w, TOKENS[:6], plain, prefix)
        np.testing.assert_allclose(stepped(w, TOKENS[:6], ablate, prefix, announce=False), want, rtol=0, atol=1e-6)
        np.testing.assert_allclose(fed(w, TOKENS[:6], ablate, prefix), want, rtol=0, atol=2e-4)
    assert not np.allclose(want, stepped(w, TOKENS[:6], None, PREFIX), atol=1e-3)


# ---------------------------------------------------------------- routing ids a hook returns, token form
@pytest.fixture(scope="module")
def w64():
    from conftest import REFERENCE_DIR

    from kimi_explore import from_pretrained

    return from_pretrained(REFERENCE_DIR, device="cpu", dtype="float64")


@pytest.mark.parametrize("bad", [[-1, 2], [2, 8], [-3, 1]], ids=["minus1", "past_E", "negative"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_hook_routing_ids_outside_the_experts_are_refused_naming_the_site(ref_weights, w64, bad, dtype):
    """A hook at a token's topk_ids returning -1 (the chunk form's "drop") or another id outside 0..E-1: in
    float64 a negative id silently indexed from the end (-1 ran expert E-1: the logits equal those of [7, 2]);
    in float32 the compiled routing step raised "routing_weights: scores float32 [E], ids int64 [k] in 0..E-1"
    naming neither the hook site nor the ids. Expected: a ValueError naming the site and the bad ids."""
    w = ref_weights if dtype == "float32" else w64
    hooks = Hooks()
    hooks.add("layers.3.moe.router.topk_ids", lambda ids, *, hook: np.array(bad))
    with pytest.raises(ValueError, match=r"layers\.3\.moe\.router\.topk_ids: a hook returned expert ids .*0\.\.7"):
        stepped(w, TOKENS[:1], hooks)


def test_hook_routing_weights_of_another_length_are_refused_naming_the_site(ref_weights):
    hooks = Hooks()
    hooks.add("layers.5.moe.router.topk_weights", lambda wts, *, hook: np.ones(3, wts.dtype))
    with pytest.raises(ValueError, match=r"layers\.5\.moe\.router\.topk_weights: a hook returned 3 weights for the 2"):
        stepped(ref_weights, TOKENS[:1], hooks)


# ---------------------------------------------------------------- interventions hand out new arrays
def test_forced_weights_do_not_compound_across_tokens_under_an_in_place_hook(w64):
    """force_routing(weights=) returned the same array at every token (float64 model: no cast to copy it), so a
    later hook editing the weights in place (the contract allows it) edited them for every later token too:
    0.125, 0.0625, 0.03125... Expected: each token starts from the given weights, so the halving hook sees them
    halved once at every token."""
    hooks = force_routing(5, [2, 6], weights=[0.25, 0.75])
    seen = []

    def halve(v, *, hook):
        v *= 0.5
        seen.append(v.tolist())

    hooks.add("layers.5.moe.router.topk_weights", halve)
    stepped(w64, TOKENS[:3], hooks)
    assert seen == [[0.125, 0.375]] * 3


def test_override_attn_res_keeps_no_reference_to_the_callers_array(w64):
    """override_attn_res(layer, site, weights_array) kept the caller's float64 array and returned it as the site's
    value: a recorder kept that array as the record, so the caller reusing it afterwards rewrote the trace (and the
    intervention). Expected: the trace holds the weights given at the time."""
    mine = np.array([0.2, 0.3, 0.5])
    rec = Recorder().bind(w64)
    stepped(w64, TOKENS[:2], HookChain(override_attn_res(5, "ffn", mine), rec))
    mine[:] = [1.0, 0.0, 0.0]
    np.testing.assert_array_equal(rec.trace()["layers.5.attn_res.ffn.weights"], [[0.2, 0.3, 0.5]] * 2)


@pytest.mark.parametrize("positions", [-1, [2, -1], range(-2, 1)], ids=["int", "list", "range"])
def test_negative_positions_are_refused_not_silently_ignored(positions):
    """positions=-1 (read as "the last token") matched no token position and the intervention silently never
    acted, while slice(-1, None) was refused: every form now says positions are absolute."""
    with pytest.raises(ValueError, match=r"positions: token positions are absolute \(>= 0\)"):
        ablate_experts(3, "all", positions=positions)


def test_patch_takes_a_slice_of_positions_as_every_intervention_does(ref_weights):
    """The interventions' docstring lets positions= be a slice for all of them; patch raised "'slice' object is
    not iterable". Expected: the source's positions in the slice, as a plain hook that puts them in place."""
    w, name = ref_weights, "layers.3.attn.out"
    rec = Recorder(full=[name]).bind(w)
    stepped(w, [5, 6, 7, 8, 9, 10], rec)
    source = rec.trace()[name]
    plain = Hooks()
    plain.add(name, lambda v, *, hook: source[hook.position].copy() if 2 <= hook.position < 5 else None)
    want = stepped(w, TOKENS[:6], plain)
    np.testing.assert_allclose(stepped(w, TOKENS[:6], patch(name, rec.trace(), positions=slice(2, 5))), want,
                               rtol=0, atol=1e-6)
    np.testing.assert_allclose(fed(w, TOKENS[:6], patch(name, rec.trace(), positions=slice(2, 5))), want,
                               rtol=0, atol=2e-4)
    with pytest.raises(ValueError, match=r"no value at positions slice\(8, None, None\)"):
        patch(name, rec.trace(), positions=slice(8, None))


def test_override_attn_res_refuses_several_layers():
    """override_attn_res takes one layer; a list silently overrode only its first layer."""
    with pytest.raises(ValueError, match=r"override_attn_res: layer must be one layer"):
        override_attn_res([3, 5], "ffn", "uniform")


# ---------------------------------------------------------------- an unbound recorder on the sequence path
@pytest.mark.parametrize("names_filter", [None, "layers.1.kda.conv"], ids=["default", "conv_only"])
def test_unbound_recorder_feeding_a_layer_run_token_by_token(ref_weights, names_filter):
    """A Recorder never bound to the weights (fine when stepping: the heads come from the state) raised
    KeyError 'kda_heads' on the sequence path as soon as a KDA layer ran token by token there (a per-token hook
    in it, here one added to the recorder). Expected: the records stepping makes with the same recorder set-up."""
    w = ref_weights

    def recorder():
        rec = Recorder(names_filter=names_filter)
        rec.add("layers.1.attn.in", lambda v, *, hook: None)
        return rec

    step_rec, feed_rec = recorder(), recorder()
    stepped(w, TOKENS[:5], step_rec)
    fed(w, TOKENS[:5], feed_rec, chunk=3)
    want, got = step_rec.trace(), feed_rec.trace()
    assert sorted(got.names()) == sorted(want.names()) and "layers.1.kda.conv.norm" in got.names()
    for k in want.names():
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_chunk_aware_hooks_through_recorder_add_and_hooked(ref_weights):
    """`Recorder.add` is documented as `Hooks.add` but had no chunks= (TypeError), nor had `hooked`: a hook added
    there could only be a per-token one, which makes its layer run token by token on the sequence path."""
    w, calls = ref_weights, []
    rec = Recorder().bind(w)
    rec.add("layers.3.attn.out", lambda v, *, hook: calls.append((v.shape[0], hook.positions.tolist())), chunks=True)
    fed(w, TOKENS[:5], rec, chunk=3)
    assert calls == [(3, [0, 1, 2]), (2, [3, 4])]
    hooks, calls[:] = Hooks(), []
    with hooks.hooked("layers.3.attn.out", lambda v, *, hook: calls.append(v.shape[0]), chunks=True):
        fed(w, TOKENS[:5], hooks, chunk=5)
    assert calls == [5] and len(hooks) == 0


# ---------------------------------------------------------------- every site kind on the sequence path
def _one_site_per_kind(w) -> list[str]:
    from kimi_explore import hook_names

    seen, out = set(), []
    for n in hook_names(w):
        kind = n.split(".", 2)[2] if n.startswith("layers.") else n
        if kind not in seen and not n.startswith("layers.0."):
            seen.add(kind)
            out.append(n)
    return out


def _scaled(v, *, hook):
    if hook.kind == "moe.router.topk_ids":  # another expert for each selection (still distinct); a chunk's -1 kept
        return np.where(v >= 0, (v + 1) % 8, v)
    return v * 0.9


def _scaled_in_place(v, *, hook):
    if hook.kind == "moe.router.topk_ids":
        v[...] = np.where(v >= 0, (v + 1) % 8, v)
    else:
        v *= 0.9


@pytest.mark.parametrize("fn", [_scaled, _scaled_in_place], ids=["returned", "in_place"])
def test_every_site_kind_changes_a_fed_chunk_as_it_changes_stepping(w64, fn):
    """The contract's rule on the sequence path: at one site of every kind (the first layer that has it), a
    returned value or an in-place edit, by a per-token hook or a chunk-aware one, changes the fed logits as the
    same hook changes stepping (float64: to 1e-9), across chunk boundaries and after a prefix."""
    w = w64
    assert w.config.num_experts == 8  # (the routing hooks above)
    base = stepped(w, TOKENS[:6], None, PREFIX)
    for name in _one_site_per_kind(w):
        hooks = Hooks()
        hooks.add(name, fn)
        want = stepped(w, TOKENS[:6], hooks, PREFIX)
        assert np.abs(want - base).max() > 1e-13, name  # the change reaches the logits
        for chunks in (False, True):
            hooks = Hooks()
            hooks.add(name, fn, chunks=chunks)
            np.testing.assert_allclose(fed(w, TOKENS[:6], hooks, PREFIX, chunk=4), want, rtol=0, atol=1e-9,
                                       err_msg=f"{name} chunks={chunks}")


@pytest.mark.parametrize("positions", ["all", 2.0, [1, 2.5], [True]], ids=["str", "float", "float_in_list", "bool"])
def test_positions_of_another_type_are_refused_naming_the_argument(positions):
    """positions="all" failed with "invalid literal for int() with base 10: 'a'", 2.0 with "'float' object is not
    iterable", [1, 2.5] acted at position 2: none named the argument."""
    with pytest.raises(TypeError, match=r"positions: expected None, a token position \(int\)"):
        ablate_experts(3, "all", positions=positions)


# ---------------------------------------------------------------- Trace accessors, against raw values
@pytest.mark.parametrize("path", ["stepped", "fed"])
def test_trace_accessors_index_layers_heads_streams_and_sources_as_the_raw_values(ref_weights, path):
    """Trace's named-axis views against values captured by a plain per-token hook (float64 norms by hand):
    kda_state_norms [token, kda layer, head], kda_conv_norms [token, kda layer, stream, head] (head h = channels
    h K .. h K + K - 1 of each stream, all taps), routing [token, moe layer, k], attn_res_weights [token, layer,
    site, source] (blocks in push order, the running sum last) and final_attn_res_weights."""
    w = ref_weights
    raw = {}
    plain = Hooks()
    plain.add(names_filter=lambda n: n.endswith(("kda.state", "kda.conv", "topk_ids", "attn_res.attn.weights",
                                                 "attn_res.ffn.weights")) or n == "final.attn_res.weights",
              fn=lambda v, *, hook: raw.setdefault(hook.name, []).append(np.array(v, dtype=np.float64)))
    stepped(w, TOKENS[:5], plain)
    rec = Recorder().bind(w)
    stepped(w, TOKENS[:5], rec) if path == "stepped" else fed(w, TOKENS[:5], rec, chunk=3)
    trace = rec.trace()
    H, K = w.config.linear_attn_config.num_heads, w.config.linear_attn_config.head_dim
    tol = {"rtol": 1e-5, "atol": 1e-7} if path == "stepped" else {"rtol": 1e-4, "atol": 1e-5}  # fed: float32 rounding

    norms, kda_ids = trace.kda_state_norms()
    conv, conv_ids = trace.kda_conv_norms()
    assert kda_ids == conv_ids == [i for i, lw in enumerate(w.layers) if lw.attention.kind == "kda"]
    for j, i in enumerate(kda_ids):
        S = np.stack(raw[f"layers.{i}.kda.state"])  # [T, H, K, V]
        np.testing.assert_allclose(norms[:, j], np.sqrt((S ** 2).sum(axis=(2, 3))), **tol)
        win = np.stack(raw[f"layers.{i}.kda.conv"])  # [T, 3, P, W]
        by_head = (win ** 2).reshape(len(win), 3, H, K, -1).sum(axis=(3, 4))
        np.testing.assert_allclose(conv[:, j], np.sqrt(by_head), **tol)

    routing = trace.routing()
    assert routing["moe_layers"] == [i for i, lw in enumerate(w.layers) if lw.ffn.kind == "moe"]
    for j, i in enumerate(routing["moe_layers"]):
        np.testing.assert_array_equal(routing["topk_ids"][:, j], np.stack(raw[f"layers.{i}.moe.router.topk_ids"]))

    mixes, S_ = trace.attn_res_weights(), trace.max_sources
    assert trace.layer_ids == list(range(len(w.layers))) and trace.source_labels()[-1] == "current"
    for li in trace.layer_ids:
        for s, site in enumerate(("attn", "ffn")):
            name = f"layers.{li}.attn_res.{site}.weights"
            if name not in raw:
                assert np.isnan(mixes[:, li, s]).all()
                continue
            p = np.stack(raw[name])  # [T, n + 1]
            n = p.shape[1] - 1
            np.testing.assert_allclose(mixes[:, li, s, :n], p[:, :n], **tol)
            np.testing.assert_allclose(mixes[:, li, s, S_ - 1], p[:, n], **tol)
            assert np.isnan(mixes[:, li, s, n : S_ - 1]).all()
    final = np.stack(raw["final.attn_res.weights"])
    np.testing.assert_allclose(trace.final_attn_res_weights()[:, -1], final[:, -1], **tol)


@pytest.mark.parametrize("chunk", [3, 8], ids=lambda c: f"chunk{c}")
def test_patching_routing_ids_and_weights_from_a_padded_trace_on_chunks(ref_weights, chunk):
    """Run A drops one expert of layer 6 at position 3 (a plain hook), so its trace pads that token's ids with -1
    and its weights with NaN. Patching ids and weights from that trace routes another run as A; stepping did,
    but on a chunk the weights' NaN padding went in whole (beside a -1 id, whose expert output is 0: NaN * 0),
    and every logit after it was NaN. Expected: A's logits."""
    w, p = ref_weights, 3
    ids, wts = "layers.6.moe.router.topk_ids", "layers.6.moe.router.topk_weights"
    clean = Recorder().bind(w)
    stepped(w, TOKENS[:8], clean)
    drop = int(clean.trace()[ids][p, 0])
    plain = Hooks()
    plain.add(ids, lambda v, *, hook: v[v != drop] if hook.position == p else None)
    rec = Recorder().bind(w)
    want = stepped(w, TOKENS[:8], HookChain(plain, rec))
    trace = rec.trace()
    assert trace[ids][p, -1] == -1 and np.isnan(trace[wts][p, -1])
    got = fed(w, TOKENS[:8], patch(ids, trace) + patch(wts, trace), chunk=chunk)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4)
    np.testing.assert_allclose(stepped(w, TOKENS[:8], patch(ids, trace) + patch(wts, trace)), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("kwargs", "what"), [({"names_filter": 3}, "Recorder names_filter"), ({"full": 7}, "Recorder full"),
                                              ({"full": [3]}, "Recorder full")])
def test_recorder_name_arguments_of_another_type_are_named(kwargs, what):
    """Recorder(names_filter=3) failed with "'int' object is not iterable", naming no argument."""
    with pytest.raises(TypeError, match=what):
        Recorder(**kwargs)


def test_a_layer_of_another_type_is_refused_naming_the_argument():
    """layer=3.0 failed with "'float' object is not iterable"."""
    with pytest.raises(ValueError, match=r"layer must be a non-negative int"):
        ablate_experts(3.0, [1])


def test_patch_refuses_a_trace_of_several_texts(ref_weights):
    """A recorder kept over two texts holds positions 0.. twice (each text's from its state): patch silently took the
    second text's rows. It now says so, and a window of one text patches as that text."""
    w, name = ref_weights, "layers.3.attn.out"
    rec = Recorder(full=[name]).bind(w)
    stepped(w, [5, 6, 7], rec)
    stepped(w, [8, 9, 10], rec)
    trace = rec.trace()
    with pytest.raises(ValueError, match=r"positions \[0, 1, 2\] more than once"):
        patch(name, trace)
    first = trace.window(0, 3)
    plain = Hooks()
    plain.add(name, lambda v, *, hook: first[name][hook.position].copy() if hook.position == 1 else None)
    np.testing.assert_array_equal(stepped(w, TOKENS[:3], patch(name, first, positions=1)), stepped(w, TOKENS[:3], plain))


# ---------------------------------------------------------------- a recorder before an intervention in a chain
@pytest.mark.parametrize("path", ["stepped", "fed"])
def test_a_recorder_before_an_intervention_records_the_recurrent_values_it_saw(ref_weights, path):
    """HookChain(recorder, scale_kda_head(1, 0, 0)): the recorder sees layer 1's state before the scaling. Stepping,
    it kept a reference to the live state, which the decoder then overwrote with the scaled value: head 0's
    recorded norm was 0 at every token (while its own full copy, and a fed run, showed the state it saw).
    Expected: norms of what a plain hook placed at the same point in the chain captured; the conv norms likewise
    under a hook that replaces the conv window."""
    w = ref_weights
    K = w.config.linear_attn_config.head_dim
    seen = {}
    plain = Hooks()
    plain.add(names_filter=lambda n: n in ("layers.1.kda.state", "layers.1.kda.conv"),
              fn=lambda v, *, hook: seen.setdefault(hook.name, []).append(np.array(v, dtype=np.float64)))
    change = scale_kda_head(1, 0, 0.0)
    change.add("layers.1.kda.conv", lambda v, *, hook: v * 2.0)
    stepped(w, TOKENS[:4], HookChain(plain, change))
    rec = Recorder().bind(w)
    run = stepped if path == "stepped" else fed
    run(w, TOKENS[:4], HookChain(rec, change))
    trace = rec.trace()
    S = np.stack(seen["layers.1.kda.state"])
    np.testing.assert_allclose(trace["layers.1.kda.state.norm"], np.sqrt((S ** 2).sum(axis=(2, 3))), rtol=1e-4, atol=1e-6)
    assert (trace["layers.1.kda.state.norm"][:, 0] > 0.1).all()
    win = np.stack(seen["layers.1.kda.conv"])
    H = S.shape[1]
    want = np.sqrt((win ** 2).reshape(len(win), 3, H, K, -1).sum(axis=(3, 4)))
    np.testing.assert_allclose(trace["layers.1.kda.conv.norm"], want, rtol=1e-4, atol=1e-6)


# bug: a chunk-aware hook at mla.probs that wrote probability onto a token's future positions (uniform attention
# over the whole row, say) made the chunk attend to tokens not decoded yet, and ran on without a word
def test_a_chunk_aware_probs_hook_cannot_attend_to_the_future(ref_weights):
    from kimi_explore import KimiDecodeState, kimi_forward_sequence, kimi_forward_token
    from kimi_explore.inspection.hooks import Hooks

    w, tokens = ref_weights, [17, 203, 5, 88, 41, 9]

    def everywhere(p, *, hook):
        p[:] = 1.0 / p.shape[-1]  # the whole row, future included

    def visible(p, *, hook):  # uniform over what each token sees: its row as the token form has it
        L0 = p.shape[-1] - p.shape[0]
        for t in range(p.shape[0]):
            p[t, :, : L0 + t + 1] = 1.0 / (L0 + t + 1)

    def visible_token(p, *, hook):
        p[:] = 1.0 / p.shape[-1]

    bad = Hooks()
    bad.add("layers.2.mla.probs", everywhere, chunks=True)
    state = KimiDecodeState.new(w)
    kimi_forward_sequence(w, state, tokens[:2])
    with pytest.raises(ValueError, match=r"layers\.2\.mla\.probs: a hook left nonzero .* after token 0 of the chunk \(position 2\)"):  # noqa: E501
        kimi_forward_sequence(w, state, tokens[2:], bad)
    good, stepped = Hooks(), Hooks()
    good.add("layers.2.mla.probs", visible, chunks=True)
    stepped.add("layers.2.mla.probs", visible_token)
    state, ref_state = KimiDecodeState.new(w), KimiDecodeState.new(w)
    fed = np.asarray(kimi_forward_sequence(w, state, tokens, good, chunk=4))
    step = np.stack([np.asarray(kimi_forward_token(w, ref_state, t, stepped)) for t in tokens])
    np.testing.assert_allclose(fed, step, rtol=0, atol=1e-4)
    plain = KimiDecodeState.new(w)
    assert np.abs(step - np.stack([np.asarray(kimi_forward_token(w, plain, t)) for t in tokens])).max() > 1e-2  # it acts
