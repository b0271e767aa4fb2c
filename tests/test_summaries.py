"""The K3-scale summaries (views/summaries.py) against plain-Python recomputations of their definitions."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from synthetic_trace import SyntheticTrace

from kimi_explore.views import summaries


def biased_routing(n_tokens=5, n_layers=3, E=12, k=3, seed=0):
    """Routing as the router makes it: top-k of score + bias, ids ordered by unbiased score; plus the bias."""
    rng = np.random.default_rng(seed)
    scores = 1 / (1 + np.exp(-rng.normal(size=(n_tokens, n_layers, E))))
    bias = {10 + j: rng.normal(0, 0.3, E) for j in range(n_layers)}
    ids = np.zeros((n_tokens, n_layers, k), dtype=np.int64)
    for t in range(n_tokens):
        for j in range(n_layers):
            chosen = sorted(range(E), key=lambda e: -(scores[t, j, e] + bias[10 + j][e]))[:k]
            ids[t, j] = sorted(chosen, key=lambda e: -scores[t, j, e])
    w = np.take_along_axis(scores, ids, axis=2)
    r = {"topk_ids": ids, "topk_weights": w / w.sum(axis=2, keepdims=True), "scores": scores,
         "moe_layers": [10 + j for j in range(n_layers)]}
    return r, bias


def test_topk_table_ranks_bias_and_displaced_experts():
    r, bias = biased_routing()
    E, k = r["scores"].shape[2], r["topk_ids"].shape[2]
    seen_bias_choice = False
    for t in range(r["scores"].shape[0]):
        table = summaries.topk_table(r, t, bias)
        for j, layer in enumerate(r["moe_layers"]):
            s = r["scores"][t, j]
            unbiased_top = set(sorted(range(E), key=lambda e: -s[e])[:k])
            chosen = [int(e) for e in r["topk_ids"][t, j]]
            for c, e in enumerate(chosen):
                assert table["ids"][j, c] == e
                assert table["scores"][j, c] == pytest.approx(s[e])
                assert table["bias"][j, c] == pytest.approx(bias[layer][e])
                assert table["rank"][j, c] == 1 + sum(1 for x in range(E) if s[x] > s[e])
                assert table["by_bias"][j, c] == (e not in unbiased_top)
                seen_bias_choice |= e not in unbiased_top
            assert sorted(e for e, _ in table["displaced"][j]) == sorted(unbiased_top - set(chosen))
    assert seen_bias_choice, "the fixture should contain choices the bias changed"


def test_topk_table_handles_an_ablated_shorter_top_k():
    """An ablation drops slots (-1) from the router's choice: the survivors keep their bias stars (rank > k, k
    the router's top-k, not the slots left) and the experts the bias pushed out of that choice stay the same;
    an ablated expert is not one of them."""
    r, bias = biased_routing()
    full = [summaries.topk_table(r, t, bias) for t in range(len(r["topk_ids"]))]
    r["topk_ids"] = r["topk_ids"].copy()
    r["topk_ids"][:, :, 0] = -1  # the trace pads a shortened top-k with -1: the top expert ablated everywhere
    for t, before in enumerate(full):
        table = summaries.topk_table(r, t, bias)
        assert (table["rank"][:, 0] == -1).all() and not table["by_bias"][:, 0].any()
        assert np.isnan(table["scores"][:, 0]).all()
        assert (table["by_bias"][:, 1:] == before["by_bias"][:, 1:]).all()
        assert table["displaced"] == before["displaced"]


@pytest.mark.parametrize("seed", range(6))
def test_topk_table_with_tied_and_missing_scores(seed):
    """Ranks and displaced experts by their definitions, in plain Python, where scores tie (rounded),
    some are NaN (never higher than another; the unbiased order puts them last, by id) and some slots
    are ablated (-1): the fast path sorts only around each layer's n-th score."""
    rng = np.random.default_rng(seed)
    T, M, E, k = 2, 5, 30, 6
    scores = rng.random((T, M, E)).round(1)  # many ties
    scores[rng.random(scores.shape) < (0.1 if seed % 2 else 0.9)] = np.nan
    ids = np.array([[rng.choice(E, k, replace=False) for _ in range(M)] for _ in range(T)])
    ids[rng.random(ids.shape) < 0.2] = -1
    r = {"topk_ids": ids, "scores": scores, "topk_weights": rng.random((T, M, k)), "moe_layers": list(range(M))}
    for t in range(T):
        table = summaries.topk_table(r, t)
        for j in range(M):
            s = scores[t, j]
            chosen = [int(e) for e in ids[t, j] if e >= 0]
            order = sorted(range(E), key=lambda e: (math.isnan(s[e]), 0.0 if math.isnan(s[e]) else -s[e], e))
            # without a bias the router chose by unbiased score: the ablated slots held the best experts not chosen
            ablated = [e for e in order if e not in chosen][: k - len(chosen)]
            want = [e for e in order[:k] if e not in chosen and e not in ablated]
            assert [e for e, _ in table["displaced"][j]] == want
            for c, e in enumerate(ids[t, j]):
                higher = sum(1 for x in range(E) if s[x] > s[e]) if e >= 0 else None  # NaN compares False
                assert table["rank"][j, c] == (-1 if e < 0 else 1 + higher)


def test_routing_entropy_is_the_entropy_of_the_combine_weights():
    r, _ = biased_routing()
    h = summaries.routing_entropy(r)
    for (t, j), v in np.ndenumerate(h):
        w = r["topk_weights"][t, j]
        p = w / w.sum()
        assert v == pytest.approx(-sum(x * math.log2(x) for x in p))
    assert h.max() <= math.log2(r["topk_ids"].shape[2]) + 1e-12


def test_load_stats_count_every_choice():
    r, _ = biased_routing(n_tokens=7)
    stats = summaries.load_stats(r)
    E = r["scores"].shape[2]
    for j in range(len(r["moe_layers"])):
        c = Counter(int(e) for e in r["topk_ids"][:, j].ravel())
        counts = [c.get(e, 0) for e in range(E)]
        mean = sum(counts) / E
        assert list(stats["counts"][j]) == counts
        assert stats["max_over_mean"][j] == pytest.approx(max(counts) / mean)
        assert stats["cv"][j] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in counts) / E) / mean)
        assert stats["dead"][j] == counts.count(0)
    upto = summaries.load_stats(r, upto=2)
    assert upto["tokens"] == 2 and upto["counts"].sum() == 2 * len(r["moe_layers"]) * r["topk_ids"].shape[2]
    ordered, ids = summaries.sorted_counts(stats["counts"])
    assert np.all(np.diff(ordered, axis=1) <= 0)
    np.testing.assert_array_equal(np.take_along_axis(stats["counts"], ids, axis=1), ordered)


def test_surprisal_bits():
    logits = np.array([2.0, 0.5, -1.0, 3.0])
    p = np.exp(logits) / np.exp(logits).sum()
    assert summaries.surprisal_bits(logits, 1) == pytest.approx(-math.log2(p[1]))


def test_token_measures_on_a_synthetic_trace():
    tr = SyntheticTrace(n_tokens=5, n_layers=8, block_size=4)
    m = summaries.token_measures(tr, surprisal=[np.nan, 1, 2, 3, 4])
    assert set(m) == set(summaries.MEASURES) and all(len(v) == 5 for v in m.values())
    w = tr.attn_res_weights()
    for t in range(5):
        emb = [w[t, j, s, 0] for j in range(8) for s in range(2) if np.isfinite(w[t, j, s, 0])]
        assert m["embedding weight"][t] == pytest.approx(sum(emb) / len(emb))
        norms, _ = tr.kda_state_norms()
        prev = norms[t - 1] if t else np.zeros_like(norms[0])
        assert m["KDA state change"][t] == pytest.approx(np.abs(norms[t] - prev).mean())
    h = summaries.routing_entropy(tr.routing())
    np.testing.assert_allclose(m["routing entropy"], h.mean(axis=1))
    assert np.isnan(m["surprisal"][0]) and m["surprisal"][4] == 4
