"""`lens_at(session, t)`: one token's logit lens at a cost independent of the history, equal to
`logit_lens(session)` at that token (both replay the history exactly), and refusing a history that
no longer replays."""

from __future__ import annotations

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.inspection.interventions import ablate_experts

TOKENS = [17, 203, 5, 88, 88, 141, 250, 3, 64, 199, 7, 31, 90, 12, 45, 66, 2, 9, 140, 77]


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "session-hooks"])
def test_lens_at_equals_the_full_lens(ref_weights, hooked):
    s = ke.Session(ref_weights, hooks=ablate_experts(5, "all") if hooked else None, checkpoint_every=4)
    s.feed(TOKENS[:13], chunk=6)
    for tok in TOKENS[13:]:
        s.step(tok)
    full = ke.logit_lens(s, top=3)
    after = s.fork()
    for t in (0, 3, 5, 6, 12, 13, 16, len(TOKENS) - 1, -2):
        strip = ke.lens_at(s, t, top=3)
        i = t % len(TOKENS)
        assert strip.t == i and strip.token == TOKENS[i] and strip.layers == list(ref_weights.layer_ids)
        np.testing.assert_array_equal(strip.top_ids[:, 0], full.top_ids[i, :, 0])
        np.testing.assert_array_equal(strip.top_ids, full.top_ids[i])
        np.testing.assert_array_equal(strip.top_probs, full.top_probs[i])  # the same replayed values
    # the session is untouched: its next step is the fork's, bit for bit
    assert np.array_equal(s.step(5), after.step(5))


def test_state_after_and_errors(ref_weights):
    s = ke.Session(ref_weights)
    s.feed(TOKENS[:6], chunk=4)
    st = s.state_after(3)
    other = ke.Session(ref_weights)
    other.feed(TOKENS[:3], chunk=4)
    assert np.array_equal(ref_weights.forward_token(st, 9), ref_weights.forward_token(other.state.copy(), 9))
    with pytest.raises(ValueError, match="0..6"):
        s.state_after(7)
    assert [s.checkpoint_before(t)[0] for t in range(7)] == [0, 0, 0, 0, 4, 4, 6]  # chunk ends: 4 and 6
    c, st = s.checkpoint_before(5)
    assert np.array_equal(ref_weights.forward_token(st, 9), ref_weights.forward_token(s.state_after(4), 9))
    with pytest.raises(IndexError, match="outside the session's history of 6 tokens"):
        ke.lens_at(s, 6)


def test_lens_at_refuses_a_history_that_no_longer_replays(ref_weights):
    s = ke.Session(ref_weights, checkpoint_every=4)
    s.feed(TOKENS[:6], chunk=6)
    for tok in TOKENS[6:9]:
        s.step(tok)
    with s.intervene(ablate_experts(5, "all")):  # token 9 decoded under a hook the session no longer holds
        s.step(TOKENS[9])
    for tok in TOKENS[10:12]:
        s.step(tok)
    ke.lens_at(s, 8)  # before the intervention: replays as stored
    ke.lens_at(s, 11)  # after it: from the checkpoint kept after token 9, replays as stored
    with pytest.raises(ValueError, match="other logits at token 9 than the session stored"):
        ke.lens_at(s, 9)


def test_lens_at_refuses_weights_changed_under_the_session():
    from conftest import REFERENCE_DIR

    w = ke.from_pretrained(REFERENCE_DIR, device="cpu")  # a private copy: its weights are changed below
    s = ke.Session(w, checkpoint_every=4)
    s.feed(TOKENS[:6], chunk=6)
    for tok in TOKENS[6:10]:
        s.step(tok)
    w.norm *= 1.5  # the final norm: every replayed logit changes, the stored ones do not
    with pytest.raises(ValueError, match="other logits at token 8 than the session stored"):
        ke.lens_at(s, 9)  # from the checkpoint after 8 tokens (every 4th stepped one): tokens 8 and 9 replayed


def test_a_chunk_cut_by_truncate_replays_as_it_was_fed(tiny_weights, tmp_path):
    """Back / truncate inside a fed chunk: the analyses re-decode the whole chunk as it was fed (the tokens cut
    off it are kept for that), so the lens and the attribution of its tokens are those of the history as
    decoded, bit for bit (a session that fed the whole chunk). Replaying the kept part alone rounds otherwise:
    on this random model ~1e-7 in the lens; at K3 depth (93 layers, 896 experts) the replay check then refused
    every token of the chunk (logits off by 0.005 at token 11 of 119), so the Explorer's Compute raised after Back.
    Tokens decoded after the cut replay from the state truncate left, as the session decoded them."""
    ids = [(7 * i) % 251 + 1 for i in range(40)]
    whole = ke.Session(tiny_weights)
    whole.feed(ids)
    s = ke.Session(tiny_weights)
    s.feed(ids)
    s.truncate(33)
    s.back(2)  # cut twice: the tail is ids[31:40]
    assert s.cut_tail(0) == ids[31:] and list(s.runs()) == [(0, 31)]
    for tok in (5, 9):
        s.step(tok)
    want = ke.logit_lens(whole, top=3, positions=[3, 17, 30])
    for sess in (s, s.fork(), ke.Session.load_state(s.save_state(tmp_path / "cut.npz"), tiny_weights)):
        got = ke.logit_lens(sess, top=3, positions=[3, 17, 30])
        np.testing.assert_array_equal(got.top_ids, want.top_ids)
        np.testing.assert_array_equal(got.top_probs, want.top_probs)
        a, b = ke.logit_attribution(sess, 30, token=ids[31]), ke.logit_attribution(whole, 30, token=ids[31])
        assert a.contributions == b.contributions
        after = ke.logit_lens(sess, top=3, positions=[32])  # stepped after the cut: replays from truncate's state
        np.testing.assert_array_equal(after.top_probs[0], ke.lens_at(s, 32, top=3).top_probs)
    s.truncate(20)
    assert s.cut_tail(0) == ids[20:] and s.cut_tail(31) == []
    s.truncate(0)
    assert s.cut_tail(0) == []
