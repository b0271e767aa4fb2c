"""Run diffs on a session and its fork under an expert ablation, checked against the traces by hand.

Causality gives differences that must be exactly zero (tokens before the fork; at the first
ablated token, every site before the ablated layer); Jaccard, changed ids, KL and flips are
recomputed from the two traces' arrays and logits with plain loops.
"""

from __future__ import annotations

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.inspection import interventions

PREFIX, REST = list(b"Hello "), list(b"world, hello diff!")
LAYER = 3  # the ablated MoE layer (both models)


@pytest.fixture(scope="module", params=["reference", "random_tiny"])
def runs(request, ref_weights, tiny_weights):
    w = ref_weights if request.param == "reference" else tiny_weights
    a = ke.Session(w)
    a.feed(PREFIX)
    b = a.fork()
    for t in REST:  # stepped, as b's intervened feed is: the same route, so causality gives exact zeros
        a.step(t)
    j = a.trace().routing()["moe_layers"].index(LAYER)
    expert = int(a.trace().routing()["topk_ids"][len(PREFIX), j, 0])  # selected at the first token after the fork
    with b.intervene(interventions.ablate_experts(LAYER, [expert])):
        b.feed(REST)
    return w, a, b, expert


def test_nothing_differs_before_the_fork_nor_upstream_of_the_ablation(runs):
    w, a, b, _ = runs
    d = ke.diff(a, b)
    P = len(PREFIX)
    assert len(d) == P + len(REST) and d.kl_exact
    for x in (d.attn_res[:P], d.final_attn_res[:P], d.kda_state[:P], d.kl[:P]):
        assert np.all(np.nan_to_num(x) == 0)
    assert np.all(d.jaccard[:P] == 1)
    li = w.layer_ids.index(LAYER)
    assert np.all(np.nan_to_num(d.attn_res[P, :li]) == 0) and np.all(np.nan_to_num(d.attn_res[P, li, 0]) == 0)
    upstream = [k for k, i in enumerate(d.kda_layers) if i < LAYER]
    assert np.all(d.kda_state[P, upstream] == 0)
    assert np.nanmax(np.abs(d.attn_res[P, li + 1 :])) > 0  # and the ablation did change something downstream


def test_routing_changes_jaccard_kl_and_flips_by_hand(runs):
    _, a, b, expert = runs
    d = ke.diff(a, b)
    ra, rb = a.trace().routing(), b.trace().routing()
    changes = []
    for t in range(len(d)):
        for j, layer in enumerate(ra["moe_layers"]):
            A = {int(e) for e in ra["topk_ids"][t, j] if e >= 0}
            B = {int(e) for e in rb["topk_ids"][t, j] if e >= 0}
            assert d.jaccard[t, j] == pytest.approx(len(A & B) / len(A | B))
            if A != B:
                changes.append((t, layer, sorted(A - B), sorted(B - A)))
    assert d.routing_changes == changes
    assert (len(PREFIX), LAYER, [expert], []) in changes  # the ablated expert is gone at its layer
    for t in range(len(d)):
        pa = np.exp(a.logits[t] - a.logits[t].max()).astype(np.float64)
        pb = np.exp(b.logits[t] - b.logits[t].max()).astype(np.float64)
        pa, pb = pa / pa.sum(), pb / pb.sum()
        assert d.kl[t] == pytest.approx(float(np.sum(pa * np.log(pa / pb))), abs=1e-6)
    np.testing.assert_array_equal(d.flips, np.argmax(a.logits, -1) != np.argmax(b.logits, -1))
    np.testing.assert_allclose(d.final_attn_res, b.trace().final_attn_res_weights() - a.trace().final_attn_res_weights())
    s = d.summary()
    assert s["routing_changes"] == len(changes) and s["top1_flips"] == int(d.flips.sum())


def test_from_traces_the_kl_is_a_lower_bound(runs):
    _, a, b, _ = runs
    exact, coarse = ke.diff(a, b), ke.diff(a.trace(), b.trace())
    assert not coarse.kl_exact and np.all(coarse.kl <= exact.kl + 1e-9)
    assert coarse.kl.max() > 0
    np.testing.assert_array_equal(coarse.flips, exact.flips)


def test_two_prompts_of_different_lengths_and_mismatched_runs(ref_weights, tiny_weights):
    a, b = ke.Session(ref_weights), ke.Session(ref_weights)
    a.feed(list(b"ab"), chunk=2), b.feed(list(b"ab"), chunk=2)  # the shared prefix in the same forward pass
    a.feed(list(b"c")), b.feed(list(b"xyz"))
    d = ke.diff(a, b)
    assert len(d) == 3 and list(d.tokens_b) == list(b"abx")
    assert np.all(np.nan_to_num(d.attn_res[:2]) == 0) and np.nanmax(np.abs(d.attn_res[2])) > 0
    other = ke.Session(tiny_weights)
    other.feed(list(b"abc"))
    with pytest.raises(ValueError, match="different layers"):
        ke.diff(a, other)
    with pytest.raises(TypeError, match="expected a Session or a Trace"):
        ke.diff(a, np.zeros(3))


def test_traces_without_the_records_diff_compares_are_named(ref_weights):
    """A names_filter that left out the final mix failed with a bare KeyError that suggested other sites."""
    a, b = (ke.Session(ref_weights, recorder=ke.Recorder(names_filter="layers.*")) for _ in range(2))
    a.feed([1, 2, 3], progress=False)
    b.feed([1, 2, 4], progress=False)
    with pytest.raises(ValueError, match=r"diff: run a's trace lacks 'final.attn_res.weights', which diff compares"):
        ke.diff(a, b)
