"""kimi_explore.analysis.learned and views.learned_plots, on the random-weight tiny model (fast)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.analysis import learned
from kimi_explore.analysis.routing_stats import routing_stats
from kimi_explore.views.figures import learned_plots

TEXT = "The def statement.\n  x = 42; return x\n"


@pytest.fixture(scope="module")
def inside(tiny_weights):
    return learned.look_inside(tiny_weights, TEXT)


def test_corpus_and_split():
    data = learned.pydoc_corpus()
    train, val = learned.split_corpus(data)
    assert len(train) + len(val) == len(data) and len(val) == round(0.05 * len(data))
    assert bytes(val) == data[len(train):]
    w = learned.windows(np.arange(11), 4)
    np.testing.assert_array_equal(w, [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]])


def test_bits_per_byte_is_the_mean_next_byte_loss(tiny_weights):
    ids = list(TEXT.encode())
    expected = []
    for start in (0, 8):  # two windows of 8, each from a fresh state
        state = KimiDecodeState.new(tiny_weights)
        for t in range(start, start + 8):
            logits = np.asarray(kimi_forward_token(tiny_weights, state, ids[t]), np.float64)
            logp = logits - logits.max() - math.log(np.exp(logits - logits.max()).sum())
            expected.append(-logp[ids[t + 1]] / math.log(2))
    assert learned.bits_per_byte(tiny_weights, TEXT, window=8, max_windows=2) == pytest.approx(np.mean(expected), rel=1e-9)


def test_look_inside_agrees_with_the_single_measures(tiny_weights, inside):
    reads = learned.attn_res_reads(tiny_weights, TEXT)
    for site in ("attn", "ffn"):
        assert sorted(reads[site]) == sorted(inside.reads[site])
        for layer, w in reads[site].items():
            np.testing.assert_allclose(inside.reads[site][layer], w)
            assert w.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(inside.reads["final"], reads["final"])
    norms = learned.kda_state_norms(tiny_weights, TEXT)
    kda = [i for i in tiny_weights.layer_ids if tiny_weights.config.is_kda_layer(i)]
    assert sorted(norms) == sorted(inside.state_norms) == kda
    for layer, n in norms.items():
        assert n.shape == (len(TEXT), tiny_weights.config.linear_attn_config.num_heads)
        np.testing.assert_allclose(inside.state_norms[layer], n)
    rates = learned.kda_decay_rates(tiny_weights, TEXT)
    for layer, r in rates.items():
        np.testing.assert_allclose(inside.decay_rates()[layer]["half_life"], r["half_life"])
    stats = routing_stats(tiny_weights, [TEXT], progress=False)
    np.testing.assert_array_equal(inside.routing.counts, stats.counts)
    np.testing.assert_allclose(list(inside.mutual_information().values()), stats.mutual_information())


def test_decay_half_lives_from_the_gate(tiny_weights, inside):
    """A channel's half-life is ln(1/2) / mean ln(alpha); recompute it from the recorded decay by hand."""
    layer = min(inside.log_decay)
    g = inside.log_decay[layer]  # [T, H, K]
    T, H, K = g.shape
    h, k = H - 1, K // 2
    by_hand = math.log(0.5) / (sum(g[t, h, k] for t in range(T)) / T)
    r = inside.decay_rates()[layer]
    assert r["channel_half_life"][h, k] == pytest.approx(by_hand)
    assert r["half_life"][h] == pytest.approx(np.median(r["channel_half_life"][h]))
    assert (0 < np.exp(g)).all() and (np.exp(g) <= 1).all()  # float32 alpha may round to 1


def test_random_twin_has_the_same_shape(tiny_weights, tmp_path):
    path = learned.random_twin(tiny_weights, tmp_path / "twin", seed=3)
    a = json.loads((tmp_path / "twin" / "config.json").read_text())["text_config"]
    b = json.loads((Path(tiny_weights.source) / "config.json").read_text())["text_config"]
    drop = lambda c: {k: v for k, v in c.items() if k != "quantization_config"}  # noqa: E731
    assert drop(a) == drop(b)
    twin = from_pretrained(path, device="cpu")
    assert twin.layer_ids == tiny_weights.layer_ids


def test_figures(inside):
    for fig in (learned_plots.routing_specialisation(inside, inside), learned_plots.residual_reads(inside),
                learned_plots.state_norms(inside), learned_plots.decay_rates(inside)):
        assert fig._repr_png_().startswith(b"\x89PNG")


def test_mi_ceiling_is_the_class_entropy_of_the_text(inside):
    from collections import Counter

    from kimi_explore.analysis.routing_stats import byte_class

    n = Counter(byte_class(int(b)) for b in inside.ids)
    p = np.array(list(n.values()), dtype=float) / len(inside.ids)
    ceiling = float(-(p * np.log2(p)).sum())  # recomputed from the bytes themselves
    assert learned_plots.class_entropy(inside) == pytest.approx(ceiling, abs=1e-12)
    ax = learned_plots.routing_specialisation(inside, inside).axes[0]
    assert ax.lines[0].get_ydata()[0] == pytest.approx(ceiling) and f"= {ceiling:.2f} bits" in ax.get_legend().texts[0].get_text()
    assert "log2" not in ax.get_title()


def test_state_norm_lines_are_running_means(inside):
    layer = sorted(inside.state_norms)[0]
    norms = np.asarray(inside.state_norms[layer], dtype=np.float64)
    w = min(learned_plots.SMOOTH, len(norms))
    ax = learned_plots.state_norms(inside).axes[0]
    y = ax.lines[1].get_ydata()  # head 1
    np.testing.assert_allclose(y, [norms[i:i + w, 1].mean() for i in range(len(norms) - w + 1)], rtol=1e-12)


def test_decay_labels_contrast_with_their_cells(inside):
    ax = learned_plots.decay_rates(inside).axes[0]
    im = ax.images[0]
    for t in ax.texts:
        c, r = (round(v) for v in t.get_position())
        shade = im.norm(im.get_array()[r, c])
        assert t.get_color() == ("white" if shade < 0.6 else "black")
