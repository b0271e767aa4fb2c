"""Adversarial review of the hook contract on the sequence path, second round: `kimi_forward_sequence` in chunks
against stepping `kimi_forward_token` token by token.

Every expected value comes from stepping with the same hooks (or plain hooks written here), never from the code
under test checked against itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from kimi_explore import KimiDecodeState, hook_names, kimi_forward_sequence, kimi_forward_token
from kimi_explore.inspection.hooks import HookChain, Hooks
from kimi_explore.inspection.interventions import ablate_experts, force_routing
from kimi_explore.inspection.recorder import Recorder, per_token

TOKENS = [17, 203, 5, 88, 41, 9, 120, 33]


def stepped(w, tokens, hooks=None, state=None):
    state = KimiDecodeState.new(w) if state is None else state
    return np.stack([np.array(kimi_forward_token(w, state, t, hooks=hooks)) for t in tokens])


def fed(w, tokens, hooks=None, chunk=None, state=None):
    state = KimiDecodeState.new(w) if state is None else state
    return np.array(kimi_forward_sequence(w, state, tokens, hooks=hooks, chunk=chunk))


def assert_same_rows(got: dict, want: dict, atol=0.0):
    """Per-token records alike: the same keys, each token's row of the same shape and (to atol) values."""
    assert sorted(got) == sorted(want)
    for k in want:
        assert len(got[k]) == len(want[k]), k
        for t, (a, b) in enumerate(zip(got[k], want[k], strict=True)):
            assert a.shape == b.shape, (k, t, a.shape, b.shape)
            np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=f"{k} token {t}")


# ---------------------------------------------------------------- 1. a failure between chunks
class _InterruptedChunk(Hooks):
    """Interrupted (Ctrl-C) as the chunk at position 4 begins: after the first chunk was taken whole."""

    def begin_chunk(self, token_ids, positions):
        if positions[0] == 4:
            raise KeyboardInterrupt
        super().begin_chunk(token_ids, positions)


def _failing_embed(chunks: bool):
    calls = {"n": 0}

    def flaky(v, *, hook):
        at = hook.positions[0] if chunks else hook.position
        if at == 4 and calls["n"] == 0:
            calls["n"] += 1
            raise RuntimeError("transient")

    hooks = Hooks()
    hooks.add("embed", flaky, chunks=chunks)
    return hooks, RuntimeError


@pytest.mark.parametrize("how", ["embed_chunk_aware", "embed_per_token", "interrupt_between_chunks"])
def test_a_failure_before_a_later_chunks_layers_marks_the_state_broken(ref_weights, how):
    """A hook raising at the embed site of the second chunk (or an interrupt at its begin_chunk), outside the layers:
    the state had been advanced by the first chunk but was not marked broken, while the recorder dropped the records
    of both chunks; a retry on the same state was accepted and ran from position 4 (logits off by ~8).
    Expected: the state marked part-advanced (a retry refused), the recorder back to no tokens."""
    w = ref_weights
    if how == "interrupt_between_chunks":
        hooks, error = _InterruptedChunk(), KeyboardInterrupt
    else:
        hooks, error = _failing_embed(how == "embed_chunk_aware")
    rec = Recorder().bind(w)
    state = KimiDecodeState.new(w)
    with pytest.raises(error):
        kimi_forward_sequence(w, state, TOKENS, hooks=HookChain(hooks.bind(w), rec), chunk=4)
    assert state.broken and state.position >= 4
    assert rec.n_tokens == 0 and per_token(rec.state_dict()["blocks"]).get("logits.top_ids", []) == []
    with pytest.raises(ValueError, match="part-advanced"):
        kimi_forward_sequence(w, state, TOKENS, hooks=HookChain(hooks, rec), chunk=4)


# ---------------------------------------------------------------- 2. a negative decay from a chunk-aware hook
def _decay_hooks(w, fn, chunks):
    hooks = Hooks().bind(w)
    hooks.add("layers.4.kda.decay", lambda a, *, hook: fn(a), chunks=chunks)
    return hooks


def test_a_negative_decay_from_a_chunk_aware_hook_is_refused_naming_the_site(ref_weights):
    """A chunk-aware hook at kda.decay returning -decay: the chunked form took its log (NaN) and every logit of the
    fed chunk was NaN, while stepping (which multiplies the state by the decay) stayed finite. Expected: a
    ValueError naming the site and the rule (>= 0); the same hook added per token runs the chunk as stepping does."""
    w = ref_weights
    ids = TOKENS[:6]
    with pytest.raises(ValueError, match=r"layers\.4\.kda\.decay: a hook returned \d+ negative decays .*must be >= 0"):
        fed(w, ids, _decay_hooks(w, np.negative, chunks=True), chunk=6)
    want = stepped(w, ids, _decay_hooks(w, np.negative, chunks=False))
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(fed(w, ids, _decay_hooks(w, np.negative, chunks=False), chunk=6), want)


@pytest.mark.parametrize("fn", [lambda a: a * 0.0, lambda a: a * 1.5, lambda a: a * 1e-30], ids=["zero", "above_one", "tiny"])
def test_decays_of_zero_tiny_or_above_one_still_agree_with_stepping(ref_weights, fn):
    w = ref_weights
    want = stepped(w, TOKENS[:6], _decay_hooks(w, fn, chunks=True))
    np.testing.assert_allclose(fed(w, TOKENS[:6], _decay_hooks(w, fn, chunks=True), chunk=6), want, rtol=0, atol=2e-4)


# ---------------------------------------------------------------- 3. a recorder before a routing intervention
def _ids_at(w, layer: int, position: int):
    rec = Recorder(names_filter=f"layers.{layer}.moe.router.topk_ids").bind(w)
    stepped(w, TOKENS[: position + 1], rec)
    return per_token(rec.state_dict()["blocks"])[f"layers.{layer}.moe.router.topk_ids"][position].tolist()


@pytest.mark.parametrize("what", ["ablate_all", "ablate_one", "force_more_than_k"])
@pytest.mark.parametrize("order", ["recorder_first", "recorder_last"])
def test_a_recorder_in_a_chain_with_a_routing_intervention_records_the_weights_stepping_records(ref_weights, what, order):
    """HookChain(recorder, ablate_experts(4, "all", positions=[3])): stepping records token 3's weights as an empty row
    (a Trace: [nan, nan]), a fed chunk recorded [0, 0]: the recorder dropped weights by the ids it saw, before the
    intervention's -1 entries; a partial ablation kept a 0 in place where stepping's row is shifted left; forcing
    more experts than top-k recorded misaligned rows. Expected: the fed records equal the stepped ones."""
    w = ref_weights
    if what == "ablate_all":
        make = lambda: ablate_experts(4, "all", positions=[3])  # noqa: E731
    elif what == "ablate_one":
        first = _ids_at(w, 4, 3)[0]
        make = lambda: ablate_experts(4, [first], positions=[3])  # noqa: E731
    else:
        make = lambda: force_routing(4, [0, 1, 2], positions=[1, 3])  # noqa: E731

    def run(path):
        rec = Recorder(names_filter="layers.4.moe.router.*").bind(w)
        chain = HookChain(rec, make()) if order == "recorder_first" else HookChain(make(), rec)
        (stepped(w, TOKENS[:6], chain) if path == "stepped" else fed(w, TOKENS[:6], chain, chunk=6))
        return rec

    want, got = run("stepped"), run("fed")
    assert_same_rows(per_token(got.state_dict()["blocks"]), per_token(want.state_dict()["blocks"]), atol=1e-5)
    tw, tg = want.trace(), got.trace()
    for k in ("layers.4.moe.router.topk_ids", "layers.4.moe.router.topk_weights"):
        np.testing.assert_allclose(tg[k], tw[k], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- 4. token-form hooks carrying values between sites
def _carrying_hooks(w, src="layers.1.attn.out", dst="layers.5.attn.out"):
    hooks, saved = Hooks().bind(w), {}
    hooks.add(src, lambda v, *, hook: saved.__setitem__("x", v.copy()))
    hooks.add(dst, lambda v, *, hook: v + 0.5 * saved.get("x", 0.0))  # (none yet: a value carried backwards)
    return hooks


@pytest.mark.parametrize("chunk", [3, 8], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize(("src", "dst"), [("layers.1.attn.out", "layers.5.attn.out"), ("embed", "final.hidden"),
                                          ("layers.6.ffn.out", "layers.2.ffn.in")], ids=["layers", "globals", "backwards"])
def test_token_form_hooks_carrying_a_value_between_sites_give_steppings_results(ref_weights, chunk, src, dst):
    """A per-token hook at layers.1.attn.out keeping its value and one at layers.5.attn.out adding half of it: the
    sequence path ran every token of the chunk through layer 1 before any reached layer 5, so layer 5 of each token
    read the chunk's LAST token's value (logits off by 3.5). Expected: stepping's logits and records, bit for bit
    (the chunk runs the token form); a value carried backwards (from layer 6 to the next token's layer 2) too."""
    w = ref_weights
    rec_step, rec_feed = Recorder().bind(w), Recorder().bind(w)
    want = stepped(w, TOKENS, HookChain(_carrying_hooks(w, src, dst), rec_step))
    assert not np.allclose(want, stepped(w, TOKENS), atol=1e-2)  # the hooks do change the logits
    got = fed(w, TOKENS, HookChain(_carrying_hooks(w, src, dst), rec_feed), chunk=chunk)
    np.testing.assert_array_equal(got, want)
    assert_same_rows(per_token(rec_feed.state_dict()["blocks"]), per_token(rec_step.state_dict()["blocks"]))
    assert rec_feed.positions == rec_step.positions == list(range(len(TOKENS)))


def test_chunk_aware_hooks_alone_keep_the_chunked_path(ref_weights):
    """Only chunk-aware hooks: each fires once per chunk with the chunk's positions; a chunk-aware hook at kda.state
    makes its layer alone run token by token."""
    w = ref_weights
    calls = {}

    def seen(v, *, hook):
        calls.setdefault(hook.name, []).append(None if hook.positions is None else hook.positions.tolist())

    hooks = Hooks().bind(w)
    for name in ("embed", "layers.1.kda.state", "layers.2.attn.out", "logits"):
        hooks.add(name, seen, chunks=True)
    state = KimiDecodeState.new(w)
    fed(w, TOKENS, hooks, chunk=4, state=state)
    chunks = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert calls["embed"] == calls["layers.2.attn.out"] == calls["logits"] == chunks
    assert calls["layers.1.kda.state"] == [None] * len(TOKENS)


def test_token_form_hooks_see_the_states_positions_after_a_prefix(ref_weights):
    w = ref_weights
    got = []
    hooks = Hooks().bind(w)
    hooks.add("layers.2.attn.out", lambda v, *, hook: got.append((hook.position, hook.token_id, hook.positions)))
    state = KimiDecodeState.new(w)
    fed(w, [31, 62], state=state)
    fed(w, TOKENS[:5], hooks, chunk=2, state=state)
    assert got == [(2 + i, t, None) for i, t in enumerate(TOKENS[:5])]
    assert state.position == 7 and not state.broken


# ---------------------------------------------------------------- 5. routing ids a hook returns as a strided view
@pytest.mark.parametrize("chunks", [False, True], ids=["per_token", "chunk_aware"])
@pytest.mark.parametrize("path", ["stepped", "fed"])
def test_routing_ids_returned_as_a_strided_view_are_taken(ref_weights, chunks, path):
    """A hook returning ids[::-1] at topk_ids: the compiled routing step raised a bare "ndarray is not
    C-contiguous" on both paths. Expected: the same logits as a hook returning a contiguous copy of them."""
    w = ref_weights
    run = stepped if path == "stepped" else fed

    def hooks(contiguous):
        h = Hooks().bind(w)
        flip = (lambda v: np.ascontiguousarray(v[..., ::-1])) if contiguous else (lambda v: v[..., ::-1])
        h.add("layers.4.moe.router.topk_ids", lambda v, *, hook: flip(v), chunks=chunks)
        return h

    np.testing.assert_array_equal(run(w, TOKENS[:4], hooks(False)), run(w, TOKENS[:4], hooks(True)))


# ---------------------------------------------------------------- 6. routing weights of another width on a chunk
def test_chunk_aware_routing_weights_of_another_width_are_refused_naming_the_site(ref_weights):
    """Stepping names the site; a fed chunk failed inside NumPy's matmul ("mismatch in its core dimension")."""
    w = ref_weights
    hooks = Hooks().bind(w)
    hooks.add("layers.3.moe.router.topk_weights", lambda v, *, hook: v[..., :1], chunks=True)
    with pytest.raises(ValueError, match=r"layers\.3\.moe\.router\.topk_weights: a hook returned weights \(4, 1\) for "
                                         r"the selected experts \(4, 2\)"):
        fed(w, TOKENS[:4], hooks)
    with pytest.raises(ValueError, match=r"layers\.3\.moe\.router\.topk_weights: a hook returned 1 weights for the 2"):
        stepped(w, TOKENS[:1], hooks)


# ---------------------------------------------------------------- 7. a fed chunk's attention rows, per token
def test_fed_attention_probability_rows_are_steppings_per_token(ref_weights):
    """After a feed, `state_dict()` split by `per_token` and `take_records()` gave each token's mla.probs row over the chunk's
    whole cache [nh, L0 + T] with a NaN tail; stepping records [nh, position + 1]. Expected: stepping's rows."""
    w = ref_weights
    names = [n for n in hook_names(w) if n.endswith("mla.probs")]
    assert names
    want_rec = Recorder(full=names).bind(w)
    stepped(w, TOKENS, want_rec)
    want = per_token(want_rec.state_dict()["blocks"])
    for take in ("state_dict", "take_records"):
        rec = Recorder(full=names).bind(w)
        state = KimiDecodeState.new(w)
        fed(w, TOKENS[:2], rec, state=state)  # a prefix, then chunks of 3 and a ragged one, then a stepped token
        fed(w, TOKENS[2:7], rec, chunk=3, state=state)
        stepped(w, TOKENS[7:], rec, state=state)
        got = per_token(rec.state_dict()["blocks"]) if take == "state_dict" else rec.take_records()
        assert sorted(got) == sorted(want)
        assert_same_rows({n: got[n] for n in names}, {n: want[n] for n in names}, atol=1e-5)
