"""A forward pass stopped part-way (a hook raised, or the user interrupted it) marks its state broken.

Before, the state was left with some layers advanced by the token and the others not, and the next call
decoded on from it without a word: a wrong model that runs. Now the state says so, every forward pass
refuses it, and a copy taken before the failed call decodes on exactly as if nothing had happened (the
ground truth: a new state stepping the same tokens with no hook).
"""

from __future__ import annotations

import numpy as np
import pytest

from kimi_explore import KimiDecodeState, RayPipeline, Recorder, Session, kimi_forward_sequence, kimi_forward_token
from kimi_explore.inspection.hooks import HookChain, Hooks

TOKENS = [17, 203, 5, 88, 41, 9]


Boom = ArithmeticError  # a builtin: a hook shipped to a pipeline stage must unpickle there without this module

def raiser(position: int = 0):
    """A hook that raises Boom at tokens from `position` on."""

    def fn(value, *, hook):
        if hook.position is None or hook.position >= position:
            raise Boom(f"planted at {hook.name}")

    return fn


def raising_at(site: str, position: int = 0):
    """Hooks whose `site` raises Boom at tokens from `position` on."""
    hooks = Hooks()
    hooks.add(site, raiser(position))
    return hooks


def stepped(w, tokens):
    state = KimiDecodeState.new(w)
    return np.stack([np.array(kimi_forward_token(w, state, t)) for t in tokens])


@pytest.mark.parametrize("site", ["layers.3.attn.out", "layers.1.kda.state", "logits"])
def test_a_token_stopped_part_way_leaves_a_state_that_refuses_to_decode(ref_weights, site):
    w = ref_weights
    state = KimiDecodeState.new(w)
    for t in TOKENS[:2]:
        kimi_forward_token(w, state, t)
    before = state.copy()
    with pytest.raises(Boom, match="planted"):
        kimi_forward_token(w, state, TOKENS[2], raising_at(site))
    assert state.broken and "ArithmeticError(planted at" in state.broken and "position 2" in state.broken
    assert "broken" in repr(state)
    with pytest.raises(ValueError, match="part-advanced and cannot be decoded on: ArithmeticError"):
        kimi_forward_token(w, state, TOKENS[2])
    with pytest.raises(ValueError, match="part-advanced"):
        kimi_forward_sequence(w, state, TOKENS[2:])
    with pytest.raises(ValueError, match="part-advanced"):
        kimi_forward_token(w, state.copy(), TOKENS[2])  # a copy of a broken state is broken too
    assert before.broken is None
    on = np.stack([np.array(kimi_forward_token(w, before, t)) for t in TOKENS[2:]])
    np.testing.assert_array_equal(on, stepped(w, TOKENS)[2:])


def test_a_raise_before_any_layer_leaves_the_state_usable(ref_weights):
    w = ref_weights
    state = KimiDecodeState.new(w)
    kimi_forward_token(w, state, TOKENS[0])
    with pytest.raises(Boom, match="planted"):
        kimi_forward_token(w, state, TOKENS[1], raising_at("embed"))
    assert state.broken is None and state.position == 1
    on = np.stack([np.array(kimi_forward_token(w, state, t)) for t in TOKENS[1:]])
    np.testing.assert_array_equal(on, stepped(w, TOKENS)[1:])


@pytest.mark.parametrize("site", ["layers.5.attn.out", "layers.4.moe.router.topk_ids", "logits"])
def test_a_chunk_stopped_part_way_leaves_a_state_that_refuses_to_decode(ref_weights, site):
    w = ref_weights
    state = KimiDecodeState.new(w)
    with pytest.raises(Boom, match="planted"):
        kimi_forward_sequence(w, state, TOKENS, raising_at(site, position=2), chunk=2)  # the second chunk fails
    assert state.broken and "positions 2-3" in state.broken
    with pytest.raises(ValueError, match="part-advanced"):
        kimi_forward_sequence(w, state, TOKENS[4:])
    with pytest.raises(ValueError, match="part-advanced"):
        kimi_forward_token(w, state, TOKENS[4])


@pytest.mark.parametrize("path", ["token", "sequence"])
@pytest.mark.parametrize("site", ["embed", "layers.3.attn.out", "layers.5.ffn.out", "logits"])
@pytest.mark.parametrize("chained", [False, True])
def test_a_recorder_drops_what_a_failed_forward_recorded(ref_weights, path, site, chained):
    """The raw API with a recorder: a forward pass that raises leaves the recorder as it was before the call (it kept
    the failed token's or chunk's partial records, out of step with its tokens: its trace raised, or later
    misread), so going on from a state copied before the call records exactly what an unbroken run records."""
    first, rest = TOKENS[:2], TOKENS[2:]

    def run(tokens, state, hooks):
        if path == "token":
            for t in tokens:
                kimi_forward_token(ref_weights, state, t, hooks)
        else:
            kimi_forward_sequence(ref_weights, state, tokens, hooks, chunk=3)  # two chunks: the failure is in the first

    def records(rec):
        tr = rec.trace()
        return list(tr.tokens), {k: np.array(v) for k, v in tr._records.items()}

    want = Recorder().bind(ref_weights)
    state = KimiDecodeState.new(ref_weights)
    run(first, state, want)
    run(rest, state, want)
    rec = Recorder().bind(ref_weights)
    state = KimiDecodeState.new(ref_weights)
    run(first, state, rec)
    before = state.copy()
    if chained:
        hooks = HookChain(raising_at(site), rec)
    else:
        hooks = rec
        rec.hooks.add(site, raiser())  # the recorder's own hook
    with pytest.raises(Boom):
        run(rest, state, hooks)
    assert len(rec.trace()) == len(first)
    if not chained:
        rec.hooks.remove(site)
    run(rest, before, rec)
    (got_tokens, got), (want_tokens, expected) = records(rec), records(want)
    assert got_tokens == want_tokens and got.keys() == expected.keys()
    for k in expected:
        np.testing.assert_array_equal(got[k], expected[k], err_msg=k)


def test_a_session_rolls_back_and_never_holds_a_broken_state(ref_weights):
    w = ref_weights
    s = Session(w)
    s.feed(TOKENS[:3])

    def boom(value, *, hook):
        raise Boom("planted")

    s.hooks.add("layers.3.attn.out", boom)
    with pytest.raises(Boom, match="planted"):
        s.step(TOKENS[3])
    assert s.state.broken is None and len(s) == 3
    s.hooks.clear()
    np.testing.assert_allclose(s.feed(TOKENS[3:]), stepped(w, TOKENS)[3:], rtol=0, atol=1e-4)  # fed: rounding


@pytest.mark.parametrize("chunked", [False, True])
def test_a_pipeline_state_stopped_part_way_refuses_to_decode(local_ray, tiny_weights, chunked):
    """A hook raising on the second stage: the first stage has run the token, the second part of it. The
    pipeline's state refuses to go on; a copy from before continues as one process."""
    w = tiny_weights
    with RayPipeline(w.source, stages=2) as pipe:  # 16 layers: stage 1 holds 8-15
        state = pipe.new_state()
        pipe.forward_sequence(state, TOKENS[:2])
        before = state.copy()
        with pytest.raises(Exception, match="planted at layers.12.attn.out"):
            if chunked:
                pipe.forward_sequence(state, TOKENS[2:], raising_at("layers.12.attn.out"))
            else:
                pipe.forward_token(state, TOKENS[2], raising_at("layers.12.attn.out"))
        assert state.broken and "broken" in repr(state)
        with pytest.raises(ValueError, match="part-advanced"):
            pipe.forward_token(state, TOKENS[2])
        with pytest.raises(ValueError, match="part-advanced"):
            state.copy()
        on = np.stack([pipe.forward_token(before, t) for t in TOKENS[2:]])
        one = KimiDecodeState.new(w)
        kimi_forward_sequence(w, one, TOKENS[:2])
        np.testing.assert_array_equal(on, np.stack([np.array(kimi_forward_token(w, one, t)) for t in TOKENS[2:]]))
