"""Ablations beyond one token at one layer: source-family masks, experts and KDA heads over several layers,
all positions or a range, each against a computation by hand on the reference checkpoint.

A source mask is checked against `override_attn_res` given, position by position, the weights a
clean run recorded with the masked columns zeroed and renormalised by hand; over several layers the
by-hand weights of a later layer are read from a run already overridden at the earlier ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from kimi_explore import KimiDecodeState, kimi_forward_token
from kimi_explore.inspection.hooks import HookChain, Hooks
from kimi_explore.inspection.interventions import (
    ablate_experts,
    mask_sources,
    override_attn_res,
    source_columns,
    zero_kda_head,
)
from kimi_explore.inspection.recorder import Recorder
from kimi_explore.model.kimi_decoder import hook_names
from kimi_explore.model.kimi_sequence import kimi_forward_sequence

TOKENS = [17, 203, 5, 88, 88, 141, 250, 3, 64, 199]


def decode(w, tokens, *hook_sets):
    hooks = HookChain(*hook_sets) if hook_sets else None
    state = KimiDecodeState.new(w)
    out = []
    for t, tok in enumerate(tokens):
        if hooks is not None:
            hooks.begin_token(tok, t)
        out.append(np.array(kimi_forward_token(w, state, tok, hooks=hooks)))
    return np.stack(out)


def decode_sequence(w, tokens, hooks, chunk):
    return np.asarray(kimi_forward_sequence(w, KimiDecodeState.new(w), tokens, hooks, chunk=chunk))


def close(seq, tok):
    """The sequence path sums in another order than stepping: equal to float32 rounding (`_replay.REPLAY_RTOL`)."""
    np.testing.assert_allclose(seq, tok, atol=1e-4 * (1 + np.abs(tok).max()), rtol=0)


def by_hand(p, cols):
    """Zero the masked columns of one weight vector and divide by what is left (float32, as recorded)."""
    q = np.array(p, dtype=np.float32, copy=True)
    q[cols] = 0
    return q / q.sum()


def overrides(layer, site, p_rows, cols, positions):
    """override_attn_res at every position with that position's by-hand weights."""
    hooks = Hooks()
    for t in positions:
        hooks.extend(override_attn_res(layer, site, by_hand(p_rows[t], cols), positions=t))
    return hooks


def recorded(w, tokens, name, *hook_sets):
    rec = Recorder(names_filter=name)
    decode(w, tokens, *hook_sets, rec)
    return rec.trace()[name]


@pytest.mark.parametrize(("m", "family", "cols"), [
    (4, "embedding", [0]), (4, "current", [3]), (4, "latest_block", [2]), (4, "older_blocks", [1]),
    (4, "blocks", [1, 2]), (4, ("block", 1), [1]), (4, ("block", 0), [0]), (4, [-1, 0], [0, 3]),
    (2, "latest_block", []), (2, "older_blocks", []), (3, "older_blocks", []), (6, "older_blocks", [1, 2, 3]),
    (3, ("block", 2), []),
])
def test_source_columns_of_each_family(m, family, cols):
    assert source_columns(family, m) == cols


@pytest.mark.parametrize("family", ["embedding", "older_blocks", "latest_block", "current", "blocks", ("block", 1)])
def test_mask_at_one_site_equals_override_by_hand(ref_weights, family):
    layer, site = 7, "ffn"  # sources there: embedding, block 1, block 2, current
    name = f"layers.{layer}.attn_res.{site}.weights"
    p = recorded(ref_weights, TOKENS, name)
    assert p.shape == (len(TOKENS), 4)
    cols = source_columns(family, 4)
    want = decode(ref_weights, TOKENS, overrides(layer, site, p, cols, range(len(TOKENS))))
    got = decode(ref_weights, TOKENS, mask_sources(layer, site, family))
    assert np.array_equal(got, want)
    assert not np.allclose(got, decode(ref_weights, TOKENS), atol=1e-4)  # the mask changed the logits
    # the masked weights are what flowed: the recorder after the mask sees them
    masked = recorded(ref_weights, TOKENS, name, mask_sources(layer, site, family))
    assert np.all(masked[:, cols] == 0) and np.allclose(masked.sum(axis=1), 1, atol=1e-6)
    # the sequence path, in chunks, gives the same logits to float rounding, and equals its own by-hand run
    seq = decode_sequence(ref_weights, TOKENS, mask_sources(layer, site, family), chunk=4)
    close(seq, got)
    seq_hand = decode_sequence(ref_weights, TOKENS, overrides(layer, site, p, cols, range(len(TOKENS))), chunk=4)
    close(seq, seq_hand)


def test_mask_over_several_layers_and_a_range_of_positions(ref_weights):
    """current masked before the FFN of layers 4 and 10, from token 3 on: by hand, layer after layer."""
    span = range(3, len(TOKENS))
    cols4, cols10 = source_columns("current", 3), source_columns("current", 5)  # 4: emb, b1, cur; 10: emb, b1..b3, cur
    p4 = recorded(ref_weights, TOKENS, "layers.4.attn_res.ffn.weights")
    first = overrides(4, "ffn", p4, cols4, span)
    p10 = recorded(ref_weights, TOKENS, "layers.10.attn_res.ffn.weights", first)  # after the layer-4 mask
    assert p10.shape[1] == 5
    want = decode(ref_weights, TOKENS, first, overrides(10, "ffn", p10, cols10, span))
    for positions in (slice(3, None), range(3, len(TOKENS)), list(span)):
        got = decode(ref_weights, TOKENS, mask_sources([4, 10], "ffn", "current", positions=positions))
        assert np.array_equal(got, want)
    clean = decode(ref_weights, TOKENS)
    assert np.array_equal(want[:3], clean[:3]) and not np.allclose(want[3:], clean[3:], atol=1e-4)
    # on the sequence path a chunk straddles the range's start (rows 0-2 of the first chunk kept as they are)
    close(decode_sequence(ref_weights, TOKENS, mask_sources([4, 10], "ffn", "current", positions=slice(3, None)), 4), want)


def test_mask_at_every_layer_and_both_sites(ref_weights):
    """The embedding masked everywhere: by hand through every site, in decode order, on the sequence path."""
    names = [n for n in hook_names(ref_weights) if n.startswith("layers.") and ".attn_res." in n]
    hand = Hooks()
    for name in names:  # in firing order: each site's weights read from the run overridden before it
        _, i, _, site, _ = name.split(".")
        p = recorded(ref_weights, TOKENS[:5], name, hand)
        cols = source_columns("embedding", p.shape[1])
        if cols:
            hand = hand + overrides(int(i), site, p, cols, range(5))
    want = decode(ref_weights, TOKENS[:5], hand)
    got = decode(ref_weights, TOKENS[:5], mask_sources("all", "both", "embedding"))
    np.testing.assert_array_equal(got, want)
    seq = decode_sequence(ref_weights, TOKENS[:5], mask_sources("all", "both", "embedding"), chunk=5)
    close(seq, got)


def test_experts_ablated_over_all_layers_and_a_range(ref_weights):
    drop, span = 3, range(2, 6)

    def by_hand_drop(ids, *, hook):
        return ids[ids != drop] if hook.position in span else None

    hand = Hooks()
    moe = [n for n in hook_names(ref_weights) if n.endswith("moe.router.topk_ids")]
    assert len(moe) > 1
    for name in moe:
        hand.add(name, by_hand_drop)
    want = decode(ref_weights, TOKENS, hand)
    got = decode(ref_weights, TOKENS, ablate_experts("all", [drop], positions=slice(2, 6)))
    assert np.array_equal(got, want) and not np.array_equal(got, decode(ref_weights, TOKENS))
    seq = decode_sequence(ref_weights, TOKENS, ablate_experts("all", [drop], positions=span), chunk=3)
    close(seq, got)


def test_kda_head_zeroed_over_several_layers_from_a_position_on(ref_weights):
    layers = [i for i, s in enumerate(ref_weights.specs) if s.attention == "kda"][:3]

    def by_hand_zero(S, *, hook):
        if hook.position < 4:
            return None
        out = S.copy()
        out[1] = 0
        return out

    hand = Hooks()
    for i in layers:
        hand.add(f"layers.{i}.kda.state", by_hand_zero)
    want = decode(ref_weights, TOKENS, hand)
    got = decode(ref_weights, TOKENS, zero_kda_head(layers, 1, positions=slice(4, None)))
    assert np.array_equal(got, want) and np.array_equal(got[:4], decode(ref_weights, TOKENS[:4]))
    assert not np.allclose(got[4:], decode(ref_weights, TOKENS)[4:], atol=1e-4)


def test_mask_errors_name_what_is_wrong(ref_weights):
    with pytest.raises(ValueError, match="source family must be one of"):
        mask_sources(3, "ffn", "embeddings")
    with pytest.raises(ValueError, match="site must be"):
        mask_sources(3, "mlp", "current")
    with pytest.raises(ValueError, match="step 1"):
        mask_sources(3, "ffn", "current", positions=slice(0, 9, 2))
    with pytest.raises(ValueError, match="'all'"):
        ablate_experts("every", [1])
    with pytest.raises(ValueError, match="leaves none of the 2 sources"):
        decode(ref_weights, TOKENS[:2], mask_sources(1, "ffn", [0, -1]))


def test_mask_at_the_output_mix(ref_weights):
    p = recorded(ref_weights, TOKENS, "final.attn_res.weights")
    cols = source_columns("latest_block", p.shape[1])
    assert cols == [p.shape[1] - 2]
    hand = Hooks()
    for t in range(len(TOKENS)):
        hand.extend(override_attn_res("final", weights=by_hand(p[t], cols), positions=t))
    got = decode(ref_weights, TOKENS, mask_sources("final", sources="latest_block"))
    assert np.array_equal(got, decode(ref_weights, TOKENS, hand))
    close(decode_sequence(ref_weights, TOKENS, mask_sources("final", sources="latest_block"), chunk=6), got)
