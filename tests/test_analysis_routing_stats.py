"""Corpus routing statistics against plain loops over each text's trace, and resuming from checkpoints.

The reference decodes each text in its own default-recorder Session and counts from
`trace.routing()` token by token with dicts; MI is the textbook sum over the joint table.
"""

from __future__ import annotations

import math
import string
from collections import Counter

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.analysis.routing_stats import byte_class

TEXTS = ["The cat, 12 cats.\n", "Hello world!", "a b c\n\n9", "Zz-top 0"]


def by_hand(w, texts):
    counts, weights, pairs, joint = Counter(), Counter(), Counter(), Counter()
    n = 0
    for text in texts:
        s = ke.Session(w)
        ids = list(text.encode())
        s.feed(ids)
        r = s.trace().routing()
        for t, tok in enumerate(ids):
            n += 1
            for j, layer in enumerate(r["moe_layers"]):
                sel = [int(e) for e in r["topk_ids"][t, j]]
                for e, we in zip(sel, r["topk_weights"][t, j], strict=True):
                    counts[layer, e] += 1
                    weights[layer, e] += float(we)
                for e in sel:
                    for f in sel:
                        pairs[layer, e, f] += 1
                joint[layer, byte_class(tok), sel[0]] += 1
    return counts, weights, pairs, joint, n


@pytest.fixture(scope="module", params=["reference", "random_tiny"])
def model(request, ref_weights, tiny_weights):
    w = ref_weights if request.param == "reference" else tiny_weights
    return w, ke.routing_stats(w, TEXTS, progress=False), by_hand(w, TEXTS)


def test_counts_weights_and_coactivation_match_the_traces(model):
    w, st, (counts, weights, pairs, _, n) = model
    E = w.config.num_experts
    assert st.tokens == n == sum(len(x) for x in TEXTS) and st.num_experts == E
    for j, layer in enumerate(st.moe_layers):
        for e in range(E):
            assert st.counts[j, e] == counts[layer, e]
            assert st.weight_sum[j, e] == pytest.approx(weights[layer, e], rel=1e-6)
            if counts[layer, e]:
                assert st.mean_weight[j, e] == pytest.approx(weights[layer, e] / counts[layer, e], rel=1e-6)
            else:
                assert np.isnan(st.mean_weight[j, e]) and e in st.dead_experts[layer]
            for f in range(E):
                assert st.coactivation[j, e, f] == pairs[layer, e, f]
    assert np.all(st.counts.sum(axis=1) == n * w.config.num_experts_per_token)


def test_load_statistics_and_mutual_information_by_hand(model):
    w, st, (counts, _, _, joint, n) = model
    E = w.config.num_experts
    for j, layer in enumerate(st.moe_layers):
        load = [counts[layer, e] for e in range(E)]
        mean = sum(load) / E
        assert st.max_over_mean[j] == pytest.approx(max(load) / mean)
        assert st.cv[j] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in load) / E) / mean)
        cells = {(c, e): k for (lay, c, e), k in joint.items() if lay == layer}
        pc, pe = Counter(), Counter()
        for (c, e), k in cells.items():
            pc[c] += k / n
            pe[e] += k / n
        mi = sum(k / n * math.log2((k / n) / (pc[c] * pe[e])) for (c, e), k in cells.items())
        assert st.mutual_information()[j] == pytest.approx(mi, abs=1e-12)
        assert st.table()[j]["mi_bits"] == pytest.approx(mi, abs=1e-12)


def test_byte_classes():
    assert {byte_class(b) for b in string.ascii_letters.encode()} == {"letter"}
    assert {byte_class(b) for b in string.digits.encode()} == {"digit"}
    assert {byte_class(b) for b in string.punctuation.encode()} == {"punctuation"}
    assert [byte_class(b) for b in b" \t\n\r"] == ["space", "space", "newline", "newline"]
    assert byte_class(0xE4) == "other" and byte_class(7) == "other"


def test_a_saved_partial_result_resumes_to_the_full_result(ref_weights, tmp_path):
    full = ke.routing_stats(ref_weights, TEXTS, progress=False)
    path = tmp_path / "stats.npz"
    calls = []

    def failing_on_text_3(tok):
        calls.append(tok)
        if tok == ord("Z"):
            raise KeyboardInterrupt  # an interrupted long run
        return byte_class(tok)

    with pytest.raises(KeyboardInterrupt):
        ke.routing_stats(ref_weights, TEXTS, progress=False, checkpoint=path, checkpoint_every=1, classes=failing_on_text_3)
    partial = ke.RoutingStats.load(path)
    assert len(partial.texts) == 3 and partial.tokens == sum(len(x) for x in TEXTS[:3])
    calls.clear()
    resumed = ke.routing_stats(ref_weights, TEXTS, progress=False, checkpoint=path, classes=byte_class)
    for name in ("counts", "weight_sum", "coactivation"):
        np.testing.assert_array_equal(getattr(resumed, name), getattr(full, name))
    assert resumed.class_names == full.class_names and resumed.tokens == full.tokens
    np.testing.assert_array_equal(resumed.class_top1, full.class_top1)
    again = ke.routing_stats(ref_weights, TEXTS, progress=False, checkpoint=path, classes=failing_on_text_3)
    assert calls == [] and again.tokens == full.tokens  # everything was done: nothing is decoded again


def test_a_checkpoint_refuses_other_texts_or_another_model(ref_weights, tiny_weights, tmp_path):
    path = tmp_path / "stats.npz"
    ke.routing_stats(ref_weights, TEXTS[:2], progress=False, checkpoint=path)
    with pytest.raises(ValueError, match="text 1 of this call differs"):
        ke.routing_stats(ref_weights, [TEXTS[0], "other"], progress=False, checkpoint=path)
    with pytest.raises(ValueError, match="made with another model"):
        ke.routing_stats(tiny_weights, TEXTS, progress=False, checkpoint=path)
    np.savez(tmp_path / "junk.npz", x=np.zeros(1))
    with pytest.raises(ValueError, match="not a routing-stats checkpoint"):
        ke.RoutingStats.load(tmp_path / "junk.npz")


def test_progress_bar_and_inputs(ref_weights, capsys):
    st = ke.routing_stats(ref_weights, "abc", progress=True)
    assert st.tokens == 3 and "routing_stats" in capsys.readouterr().err
    ids = ke.routing_stats(ref_weights, [list(b"abc")], progress=False)
    np.testing.assert_array_equal(ids.counts, st.counts)
