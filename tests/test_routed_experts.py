"""vLLM / SGLang routed-expert ids: read, compared with kimi_explore's routing, fed to routing statistics.

The ids here are llama.cpp's own top-k selections (`ffn_moe_topk-<il>`, tests/data/engines) laid out as
the servers return them, [tokens, n_moe_layers, top_k]. On set e llama.cpp's routing agrees with
Moonshot's reference on 98 of the 208 (token, layer) sets (../shared/reference/engines/e/llamacpp/
agreement.json, "topk_rows_equal"); kimi_explore is exact against that reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.engines.routed_experts import compare_routing, read_routed_experts, routed_experts_stats, routing_hooks

ENGINES = Path(__file__).parent / "data" / "engines"


def _load(name):
    weights = ke.from_pretrained(ENGINES / name / "tiny_k3", device="cpu")
    with np.load(ENGINES / name / "llamacpp" / "llamacpp_f32experts_decode.npz") as z:
        ids = np.stack([z[f"ffn_moe_topk-{i}"] for i in range(1, 14)], axis=1)  # [T, 13, 2], as vLLM returns them
        tokens = z["tokens"].tolist()
    session = ke.Session(weights)
    session.feed(tokens, progress=False)
    return weights, session, ids, tokens


@pytest.fixture(scope="module")
def set_d():
    return _load("d")


def test_set_d_routing_agrees(set_d):
    weights, session, ids, _ = set_d
    rc = compare_routing(session, ids)
    assert rc.agreement == 1.0 and rc.first_mismatch is None
    assert rc.moe_layers == list(range(1, 14)) and rc.overlap.shape == (16, 13)


def test_set_e_routing_agrees_on_98_of_208_sets():
    _, session, ids, _ = _load("e")
    rc = compare_routing(session, ids)
    assert int(rc.same.sum()) == 98 and rc.same.size == 208
    t, layer = rc.first_mismatch
    assert not rc.same[t, rc.moe_layers.index(layer)] and rc.same[:t].all()


def test_tokens_the_server_ran_are_checked(set_d):
    weights, session, ids, tokens = set_d
    # an empty session is fed the engine's tokens: the same verdict as the fed one
    rc = compare_routing(ke.Session(weights), read_routed_experts(ids, weights, tokens=tokens))
    assert rc.agreement == 1.0 and rc.same.shape == (16, 13)
    assert compare_routing(session, ids, tokens=np.array(tokens)).agreement == 1.0
    # a session fed other tokens of the same length: refused, not compared
    other = ke.Session(weights)
    other.feed(tokens[:5] + [(tokens[5] + 1) % 256] + tokens[6:], progress=False)
    with pytest.raises(ValueError, match="first difference at position 5"):
        compare_routing(other, ids, tokens=tokens)
    with pytest.raises(ValueError, match="expected the 16 integer token ids"):
        read_routed_experts(ids, weights, tokens=tokens[:15])
    with pytest.raises(ValueError, match=r"vocabulary is 0..255"):
        read_routed_experts(ids, weights, tokens=[256] * 16)
    with pytest.raises(ValueError, match="differs from the routing's own tokens"):
        compare_routing(session, read_routed_experts(ids, weights, tokens=tokens), tokens=tokens[::-1])


def test_layouts_accepted(set_d):
    weights, _, ids, _ = set_d
    base = read_routed_experts(ids, weights)
    assert base["topk_ids"].shape == (16, 13, 2) and base["moe_layers"] == list(range(1, 14)) and base["num_experts"] == 8
    flat = read_routed_experts(ids.reshape(16, 26), weights)
    every_layer = np.concatenate([np.zeros((16, 1, 2), ids.dtype), ids], axis=1)  # a row for the dense layer 0 too
    for other in (flat, read_routed_experts(every_layer, weights)):
        np.testing.assert_array_equal(other["topk_ids"], base["topk_ids"])
    hooks = routing_hooks(base)
    np.testing.assert_array_equal(hooks["layers.5.moe.router.topk_ids"], ids[:, 4])


def test_routing_hooks_feed_compare(set_d):
    weights, session, ids, _ = set_d
    cmp = ke.compare(session, routing_hooks(read_routed_experts(ids, weights)), local=False)
    assert cmp.first is None and len(cmp.table()) == 13


def test_stats_match_routing_stats_on_the_same_tokens(set_d):
    weights, _, ids, tokens = set_d
    theirs = routed_experts_stats(weights, ids, tokens)
    ours = ke.routing_stats(weights, [tokens], progress=False)
    np.testing.assert_array_equal(theirs.counts, ours.counts)
    np.testing.assert_array_equal(theirs.coactivation, ours.coactivation)
    assert theirs.tokens == ours.tokens == 16
    assert np.isnan(theirs.mean_weight[theirs.counts > 0]).all()  # the servers return no combine weights


@pytest.mark.parametrize(("bad", "match"), [
    (np.zeros((16, 12, 2), np.int64), r"12 layers; this model has 13 MoE layers"),
    (np.zeros((16, 13, 3), np.int64), r"expected \[tokens, 13 MoE layers, top_k=2\]"),
    (np.full((16, 13, 2), 8), r"ids in \[8, 8\]; this model has experts 0..7"),
    (np.zeros((16, 13, 2), np.float32), "integer expert ids"),
])
def test_bad_ids_refused(set_d, bad, match):
    weights = set_d[0]
    with pytest.raises((ValueError, TypeError), match=match):
        read_routed_experts(bad, weights)
