"""Adversarial review of the hook contract on both paths (stepping, `kimi_forward_sequence` in chunks).

Every expected value comes from stepping token by token with a plain hook written here (no intervention
machinery), or from the recorded source run itself: never from the code under test checked against itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from kimi_explore import KimiDecodeState, kimi_forward_sequence, kimi_forward_token
from kimi_explore.inspection.hooks import HookChain, Hooks
from kimi_explore.inspection.interventions import ablate_experts, force_routing, override_attn_res, patch
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
