"""A few short seeds of the Session differential fuzz (tests/session_fuzz.py: random operations on sessions, each
checked after every operation against a straight token-by-token decode of its history and against its own
earlier bits), and the regression tests of what the fuzz found."""

from __future__ import annotations

import numpy as np
import pytest
from session_fuzz import run

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.inspection.recorder import Recorder
from kimi_explore.inspection.session import Session
from kimi_explore.weights.tiny_model import random_tiny_checkpoint, tiny_checkpoint


@pytest.fixture(scope="module")
def random64():
    return from_pretrained(random_tiny_checkpoint(), device="cpu", dtype="float64")


@pytest.fixture(scope="module")
def trained32():
    return from_pretrained(tiny_checkpoint(), device="cpu", dtype="float32")


@pytest.mark.parametrize("seed", [11, 12])
def test_fuzz_random_float64(random64, tmp_path, seed):
    ok, f, log = run(random64, seed, 12, tmp_path, 1e-9)
    assert ok, log[-6:]
    assert max(f.maxdiff.values()) <= 1e-9


def test_fuzz_trained_float32(trained32, tmp_path):
    ok, f, log = run(trained32, 21, 12, tmp_path, 1e-4)
    assert ok, log[-6:]


# ---------------------------------------------------------------- regressions


def test_truncate_inside_a_fed_chunk_trims_the_mla_probs_records(random64):
    """A fed chunk records mla.probs rows [nh, L0 + T] (NaN past each token); cut by truncate(n), the Trace must
    be the straight decode's, [n, nh, n], not keep columns for positions the history no longer has."""
    site = "layers.3.mla.probs"
    s = Session(random64, recorder=Recorder(full=[site]))
    toks = [5, 17, 200, 3, 99, 42, 7, 250, 1, 64]
    s.feed(toks, progress=False)
    s.truncate(6)
    rec, state = Recorder(full=[site]).bind(random64), KimiDecodeState.new(random64)
    for t, tok in enumerate(toks[:6]):
        rec.begin_token(tok, t)
        kimi_forward_token(random64, state, tok, rec)
    got, want = s.trace()[site], rec.trace()[site]
    assert got.shape == want.shape == (6, 4, 6)
    np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)  # NaN where the straight decode pads
    s.step(8)  # then stepping on: one column more, as a straight decode
    assert s.trace()[site].shape == (7, 4, 7)


def test_a_failed_feed_after_loading_without_checkpoints_leaves_the_session_as_it_was(random64, tmp_path):
    """Loaded from a file saved with checkpoints=False, a history with an intervened token has no checkpoint to go
    back to; a step that raised (a hook, Ctrl-C) must still leave the session as before it, not half-advanced."""
    from kimi_explore.inspection.interventions import ablate_experts

    s = Session(random64, recorder=False)
    with s.intervene(ablate_experts(4, "all")):
        s.step(5)
    s.feed([17, 200, 3], progress=False)
    s2 = Session.load_state(s.save_state(tmp_path / "s.npz", checkpoints=False), random64, recorder=False)

    def boom(value, *, hook):
        if hook.position == 4:
            raise KeyError("boom")
    with pytest.raises(KeyError, match="boom"), s2.hooked("layers.2.attn.out", boom):
        s2.feed([9, 10, 11], progress=False)  # steps (a hook is attached): the first raises
    assert s2.tokens == [5, 17, 200, 3] and s2.state.position == 4
    np.testing.assert_array_equal(s2.step(42), s.step(42))  # the state is as if nothing had failed


@pytest.mark.parametrize("how", ["load_state", "restore"])
def test_a_chunk_fed_under_a_full_record_replays_on_its_route_in_a_session_recording_otherwise(trained32, tmp_path, how):
    """A full record of a route site (mla.probs, kda.state) changes how a fed chunk is computed; a truncate inside the
    chunk must replay it that way even in a session that records otherwise (loaded with recorder=False, or a
    snapshot restored into it): the same bits as the session that fed it, as the docstring promises."""
    toks = np.random.default_rng(0).integers(256, size=40).tolist()
    a = Session(trained32, recorder=Recorder(full=["layers.3.mla.probs", "layers.1.kda.state"]))
    a.feed(toks, progress=False)
    if how == "load_state":
        b = Session.load_state(a.save_state(tmp_path / "a.npz", checkpoints=False), trained32, recorder=False)
    else:
        b = Session(trained32, recorder=False)
        b.restore(a.snapshot())
    a.truncate(25)
    b.truncate(25)
    np.testing.assert_array_equal(b.step(7), a.step(7))
