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
