"""Adversarial review of the hook contract on both paths (stepping, `kimi_forward_sequence` in chunks).

Every expected value comes from stepping token by token with a plain hook written here (no intervention
machinery), or from the recorded source run itself: never from the code under test checked against itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from kimi_explore import KimiDecodeState, kimi_forward_sequence, kimi_forward_token
from kimi_explore.inspection.hooks import Hooks
from kimi_explore.inspection.interventions import patch
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
