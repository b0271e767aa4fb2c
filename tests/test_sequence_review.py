"""Found by a review of the sequence path and the session around it. Each bug below has a test that failed
before its fix; the rest guard what a fix must keep (recover still stops at a token whose hooks are gone) or
pin what was right (a feed interrupted inside a chunk). The recover tests stand in for a RayPipeline, where
the same two histories were checked by hand: before the fix recover dropped them.

- `Session.recover()` replays the history; it compared every replayed token's logits with the stored ones
  bit for bit, so a fed chunk cut by `truncate` (its first part replayed as one shorter chunk, whose sums
  differ in the last bits) or a token decoded before a lasting hook was attached (replayed with that hook)
  read as "decoded under hooks the session no longer holds", and recover dropped the history from there.
- A hook at "embed" that edited its value in place wrote into the embedding table on the token path (the
  value was a view of the table's row): every later use of that token, in any session, read the edit.
- Two sites kept a value derived before the hooks ran, so an edit in place was half seen: at
  "final.block_residual" (both routes) the mix read the edited blocks with their old 1/rms; at "kda.decay" a
  chunk-aware hook's edit was used by the compiled float32 recurrence and ignored by the chunked rule
  (float64, GPU), which read the log decay taken before.
- A chunk's routing with dropped experts (-1 ids) was compacted only where both routing sites had default
  records: the weights recorded without the ids, or either one as a `full=` record only, kept the dropped
  entries (zero weights, -1 ids in place) where stepping records them absent.
- An unbound Hooks warns about exact names that never fired during the first token; on the sequence path it
  never checked, so a hook on a site this model does not have changed nothing without a word.
- `Session.feed` under value-changing hooks (it steps then) returned its logits flat, [n * vocab], not [n, vocab].
- `Session.feed(3)` said "'int' object is not iterable"; `chunk=np.int64(8)` was refused as not an int; a bad
  id in a long feed was named by its value only, not by where it is.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
from closeness import assert_traces_close

import kimi_explore as ke
from kimi_explore import from_pretrained, kimi_forward_token
from kimi_explore.inspection import interventions
from kimi_explore.inspection.hooks import HookChain
from kimi_explore.model.kimi_sequence import kimi_forward_sequence

TEXT = list(b"def f(x):\n    return x * 2  # reviewing the sequence path\n")


def restartable(weights):
    """The in-process weights standing in for a pipeline whose lost stages restarted empty: `recover()` then
    rebuilds the state by replaying the history, as over a RayPipeline."""
    w = copy.copy(weights)
    w.restart_lost_stages = lambda: []
    return w


def assert_same_state(a, b):
    assert a.position == b.position
    for la, lb in zip(a.layers, b.layers, strict=True):
        for x, y in zip(vars(la.attention).values(), vars(lb.attention).values(), strict=True):
            assert np.array_equal(x, y) if hasattr(x, "shape") else x == y


@pytest.mark.parametrize("history", ["cut inside a chunk", "lasting hook attached later"])
def test_recover_rebuilds_the_state_the_session_held(trained_weights, history):
    s = ke.Session(restartable(trained_weights), checkpoint_every=4)
    if history == "cut inside a chunk":
        s.feed(TEXT[:40], chunk=16)
        s.truncate(21)  # inside the chunk 16..31: the state comes from 16..20 replayed as one chunk
        s.step(TEXT[30])
    else:
        s.feed(TEXT[:6], chunk=4)
        s.step(TEXT[6])
        s.hooks.extend(interventions.ablate_experts(3, "all"))  # stays attached from token 7 on
        s.feed(TEXT[7:10])
    before = s.fork()
    assert s.recover() == []
    assert s.tokens == before.tokens
    np.testing.assert_array_equal(s.logits, before.logits)
    assert_same_state(s.state, before.state)
    assert sorted(s.snapshot().checkpoints) == sorted(before.snapshot().checkpoints)
    for c, state in before.snapshot().checkpoints.items():  # as a checkpoint is used: copied (its MLA cache is shared)
        assert_same_state(s.snapshot().checkpoints[c].copy(), state.copy())
    np.testing.assert_array_equal(s.feed(TEXT[40:45], chunk=3), before.feed(TEXT[40:45], chunk=3))


def test_recover_still_stops_at_a_token_decoded_under_a_hook_now_gone(trained_weights):
    s = ke.Session(restartable(trained_weights))
    s.feed(TEXT[:5])
    with s.intervene(interventions.ablate_experts(3, "all")):
        s.step(TEXT[5])
    s.feed(TEXT[6:9])
    with pytest.raises(RuntimeError, match="replaying token 5 .* first 5 tokens"):
        s.recover()
    assert len(s) == 5


@pytest.mark.parametrize("route", ["token", "sequence"])
def test_an_in_place_edit_at_embed_changes_the_token_not_the_table(route):
    w = from_pretrained(ke.tiny_checkpoint(), device="cpu")  # its own copy: before the fix the table changed
    table = np.array(w.embed_tokens)

    def run(fn):
        hooks = ke.Hooks().bind(w)
        hooks.add("embed", fn)
        state = ke.KimiDecodeState.new(w)
        if route == "sequence":
            return np.asarray(kimi_forward_sequence(w, state, TEXT[:6], hooks=hooks, chunk=4))
        out = []
        for t in TEXT[:6]:
            hooks.begin_token(t, state.position)
            out.append(np.array(kimi_forward_token(w, state, t, hooks=hooks)))
        return np.stack(out)

    def halve_in_place(v, *, hook):
        if hook.position in (1, 4):
            v *= 0.5

    edited = run(halve_in_place)
    np.testing.assert_array_equal(w.embed_tokens, table)
    returned = run(lambda v, *, hook: v * 0.5 if hook.position in (1, 4) else None)
    np.testing.assert_array_equal(edited, returned)  # an edit in place is the edited value, as at any site


def test_feed_names_what_it_needs(trained_weights):
    s = ke.Session(trained_weights, recorder=False)
    for bad in (3, np.int64(3), None, np.array(3)):
        with pytest.raises(TypeError, match=r"Session.feed: token_ids must be a sequence of token ids .* got"):
            s.feed(bad)
    with pytest.raises(ValueError, match=r"token_id=300 is outside the vocabulary: .*, at token_ids\[7\]"):
        s.feed(TEXT[:7] + [300] + TEXT[8:20], chunk=4)  # which of a long feed's ids, not only its value
    with pytest.raises(TypeError, match=r"token_id must be an integer, got 2.5 \(float\), at token_ids\[2\]"):
        kimi_forward_sequence(trained_weights, ke.KimiDecodeState.new(trained_weights), [1, 2, 2.5])
    assert len(s) == 0
    np.testing.assert_array_equal(s.feed(TEXT[:10], chunk=np.int64(4)), ke.Session(trained_weights).feed(TEXT[:10], chunk=4))
    state = ke.KimiDecodeState.new(trained_weights)
    assert np.asarray(kimi_forward_sequence(trained_weights, state, TEXT[:5], chunk=np.int64(2))).shape == (5, 256)


def test_an_unbound_hook_on_a_site_this_model_lacks_warns_on_the_sequence_path(trained_weights):
    """As on the token path (tests/test_hooks.py): valid names, fired whole, per token or observed, say nothing."""
    w = trained_weights
    assert "layers.3.kda.q" not in ke.hook_names(w)  # layer 3 is an MLA layer
    valid = ["embed", "layers.1.kda.state", "layers.3.mla.probs", "layers.2.moe.router.topk_ids", "logits"]

    def run(names):
        hooks = ke.Hooks()
        for n in names:
            hooks.add(n, lambda v, *, hook: None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kimi_forward_sequence(w, ke.KimiDecodeState.new(w), TEXT[:5], hooks=hooks, chunk=3)
        return [str(c.message) for c in caught]

    assert run(valid) == []
    (message,) = run(valid + ["layers.3.kda.q"])
    assert "['layers.3.kda.q'] never fired" in message


@pytest.mark.parametrize("route", ["token", "sequence"])
def test_an_unbound_recorder_whose_filter_selects_nothing_warns_at_the_callers_line(trained_weights, route):
    """Bound (a Session), such a Recorder is refused; passed straight to the decoder it recorded nothing, without a
    word. Now it warns after the first token, pointing at the line that ran the decoder; valid filters, also those
    of sites the sequence path only observes (kda.conv), say nothing."""
    w = trained_weights

    def run(**settings):
        rec = ke.Recorder(**settings)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if route == "token":
                state = ke.KimiDecodeState.new(w)
                for t in TEXT[:3]:
                    kimi_forward_token(w, state, t, hooks=rec)
            else:
                kimi_forward_sequence(w, ke.KimiDecodeState.new(w), TEXT[:5], hooks=rec, chunk=3)
        return [(str(c.message), c.filename) for c in caught], rec

    for quiet in ({}, {"names_filter": "layers.1.kda.conv"}, {"names_filter": "layers.1.kda.state"},
                  {"names_filter": "layers.1.*"}, {"full": ["layers.3.mla.probs"]}):
        caught, rec = run(**quiet)
        assert caught == [] and rec.trace().keys(), quiet
    for loud, says in (({"names_filter": "layers.99.*"}, "glob 'layers.99.*' matches none"),
                       ({"names_filter": "layers.3.kda.q"}, "'layers.3.kda.q' is not a hook point of this model"),
                       ({"full": ["layers.3.kda.q"]}, "'layers.3.kda.q' is not a hook point of this model"),
                       ({"names_filter": lambda n: n.startswith("layer.")}, "accepts none of the 170 sites that fired"),
                       ({"names_filter": "layers.1.kda.q"}, "selects only sites a Recorder keeps nothing of by default")):
        caught, _ = run(**loud)
        assert len(caught) == 1 and says in caught[0][0] and caught[0][1] == __file__, (loud, caught)
        assert "rec.bind(weights) makes this an error" in caught[0][0]


def test_feed_under_an_intervention_returns_one_row_per_token(trained_weights):
    s, stepped = ke.Session(trained_weights), ke.Session(trained_weights)
    with s.intervene(interventions.ablate_experts(3, "all")):
        got = s.feed(TEXT[:5])
    with stepped.intervene(interventions.ablate_experts(3, "all")):
        want = np.stack([stepped.step(t) for t in TEXT[:5]])
    np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def trained64():
    return from_pretrained(ke.tiny_checkpoint(), device="cpu", dtype="float64")


@pytest.mark.parametrize("site", ["final.block_residual", "layers.1.kda.decay"])
def test_an_edit_in_place_is_the_edited_value_on_every_route(trained64, site):
    """Halving the value at position 5 in place (returning None) equals returning the halved value, stepped."""
    w, tokens = trained64, TEXT[:12]

    def run(route, in_place):
        def halve(v, *, hook):
            rows = np.asarray(hook.positions) == 5 if hook.positions is not None else hook.position == 5
            if not np.any(rows):
                return None
            if in_place:
                v[rows] *= 0.5
                return None
            out = v.copy()
            out[rows] *= 0.5
            return out

        hooks = ke.Hooks().bind(w)
        hooks.add(site, halve, chunks=route == "chunks")
        state = ke.KimiDecodeState.new(w)
        if route != "token":
            return np.asarray(kimi_forward_sequence(w, state, tokens, hooks=hooks, chunk=4))
        out = []
        for t in tokens:
            hooks.begin_token(t, state.position)
            out.append(np.array(kimi_forward_token(w, state, t, hooks=hooks)))
        return np.stack(out)

    want = run("token", in_place=False)
    plain = np.asarray(kimi_forward_sequence(w, ke.KimiDecodeState.new(w), tokens))
    assert np.abs(want - plain).max() > 1e-3  # the edit changes the run
    for route in ("token", "sequence", "chunks"):
        np.testing.assert_allclose(run(route, in_place=True), want, atol=1e-9, rtol=0, err_msg=route)


def test_a_feed_interrupted_inside_a_chunk_keeps_the_chunks_before_it(trained_weights, monkeypatch):
    """Ctrl-C in the middle of a chunk's layers: the session is exactly one fed the chunks before it (the
    failing chunk leaves nothing: no state in some layers, no records, no logits), and feeds on from there."""
    import kimi_explore.model.kimi_sequence as sequence

    moe, calls = sequence.latent_moe_sequence, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 10:  # the second chunk's third MoE layer (7 per chunk)
            raise KeyboardInterrupt
        return moe(*args, **kwargs)

    recorder = {"full": ["layers.3.ffn.out", "layers.3.mla.probs"]}
    s, want = ke.Session(trained_weights, ke.Recorder(**recorder)), ke.Session(trained_weights, ke.Recorder(**recorder))
    monkeypatch.setattr(sequence, "latent_moe_sequence", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.feed(TEXT[:20], chunk=8)
    monkeypatch.undo()
    want.feed(TEXT[:8], chunk=8)
    for a, b in ((s, want), (s.fork(), want.fork())):
        assert a.tokens == b.tokens
        np.testing.assert_array_equal(a.logits, b.logits)
        assert_same_state(a.state, b.state)
        ta, tb = a.trace(), b.trace()
        assert sorted(ta.keys()) == sorted(tb.keys())
        for k in ta.keys():
            np.testing.assert_array_equal(ta[k], tb[k], err_msg=k)
    np.testing.assert_array_equal(s.feed(TEXT[8:20], chunk=8), want.feed(TEXT[8:20], chunk=8))


ROUTER = "layers.2.moe.router."


@pytest.mark.parametrize("records", [{"names_filter": [ROUTER + "topk_weights"]},
                                     {"names_filter": [ROUTER + "topk_weights"], "full": [ROUTER + "topk_ids"]},
                                     {"names_filter": [ROUTER + "topk_ids"], "full": [ROUTER + "topk_weights"]}],
                         ids=["weights-only", "weights+full-ids", "ids+full-weights"])
def test_ragged_routing_records_of_one_site_read_as_stepping(trained_weights, records):
    w, tokens = trained_weights, TEXT[:24]

    def chained():
        rec = ke.Recorder(**records).bind(w)
        return rec, HookChain(interventions.ablate_experts(2, list(range(8)), positions=range(4, 20)).bind(w), rec)

    step_rec, chain = chained()
    state = ke.KimiDecodeState.new(w)
    for t in tokens:
        chain.begin_token(t, state.position)
        kimi_forward_token(w, state, t, hooks=chain)
    seq_rec, chain = chained()
    kimi_forward_sequence(w, ke.KimiDecodeState.new(w), tokens, hooks=chain, chunk=10)
    want = step_rec.trace()
    assert (want[ROUTER + "topk_weights"].shape[1] == 2 and np.isnan(want[ROUTER + "topk_weights"][4:20]).any())
    assert_traces_close(seq_rec.trace(), want, 1e-4)



@pytest.mark.parametrize("route", ["token", "sequence"])
def test_an_unbound_recorders_warning_names_the_very_line_that_ran_the_decoder(trained_weights, route):
    """The file alone also matched a warning one frame too high (the line calling the helper that ran the decoder)."""
    import inspect

    w, rec = trained_weights, ke.Recorder(names_filter="layers.99.*")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if route == "token":
            line = inspect.currentframe().f_lineno + 1
            kimi_forward_token(w, ke.KimiDecodeState.new(w), TEXT[0], hooks=rec)
        else:
            line = inspect.currentframe().f_lineno + 1
            kimi_forward_sequence(w, ke.KimiDecodeState.new(w), TEXT[:5], hooks=rec, chunk=3)
    assert [(c.filename, c.lineno) for c in caught] == [(__file__, line)]
    assert "accepts none" not in str(caught[0].message)  # a pattern's own complaint, once


def test_an_unbound_recorder_whose_callable_filter_accepts_some_sites_says_nothing(trained_weights):
    w, rec = trained_weights, ke.Recorder(names_filter=lambda n: n.startswith("layers.1."))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kimi_forward_token(w, ke.KimiDecodeState.new(w), TEXT[0], hooks=rec)
    assert caught == [] and rec.trace().keys()
