"""The analysis figures draw (PNG), show what their results hold, and share their diverging scales."""

from __future__ import annotations

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.views.figures import analysis_plots
from kimi_explore.views.figures.mpl import figure_png

PNG = b"\x89PNG\r\n\x1a\n"
TEXT = "Hi there, $5.\n"


@pytest.fixture(scope="module")
def runs(ref_weights):
    tok = ke.ByteTokenizer()
    a = ke.Session(ref_weights, tokenizer=tok)
    a.feed(TEXT)
    b = ke.Session(ref_weights, tokenizer=tok, hooks=ke.interventions.ablate_experts([2, 5], "all"))
    b.feed(TEXT)
    return tok, a, b


def test_lens_grid_shows_probabilities_and_agreement(runs):
    tok, a, _ = runs
    lens = ke.logit_lens(a, top=2)
    fig = analysis_plots.lens_grid(lens, tok)
    ax, side = fig.axes[0], fig.axes[1]
    np.testing.assert_allclose(ax.images[0].get_array(), lens.top_probs[:, :, 0].T)
    np.testing.assert_allclose([p.get_width() for p in side.patches], lens.agreement())
    assert figure_png(fig).startswith(PNG)


def test_waterfall_ends_at_the_logit(runs):
    tok, a, _ = runs
    attr = ke.logit_attribution(a, 3)
    fig = analysis_plots.attribution_waterfall(attr, top=5, tokenizer=tok)
    bars = fig.axes[0].patches
    assert len(bars) == 7  # 5 leaves, the rest, the logit
    end = bars[5].get_x() + bars[5].get_width()
    assert end == pytest.approx(attr.logit, abs=1e-4) and bars[6].get_width() == pytest.approx(attr.logit)
    assert figure_png(fig).startswith(PNG)


def test_diff_views_share_a_symmetric_diverging_scale(runs):
    tok, a, b = runs
    d = ke.diff(a, b)
    fig = analysis_plots.diff_overview(d, tokenizer=tok)
    first, second = fig.axes[0].images[0], fig.axes[1].images[0]
    assert first.get_clim() == second.get_clim() and first.get_clim()[0] == -first.get_clim()[1] > -np.inf
    peak = max(np.nanmax(np.abs(d.final_attn_res)), np.nanmax(np.abs(d.attn_res[int(np.argmax(d.kl)), :, 1])))
    assert first.get_clim()[1] == pytest.approx(peak)
    # every colour bar says what it measures (the KDA and Jaccard bars had none)
    bars = [ax.get_xlabel() or ax.get_ylabel() for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert bars == ["Δ softmax weight (b - a)", "Δ‖S‖ (b - a)", "Jaccard (1 = same set)"]
    assert figure_png(fig).startswith(PNG)


def test_routing_stats_overview(ref_weights):
    st = ke.routing_stats(ref_weights, ["abc def", "12 34\n"], progress=False)
    fig = analysis_plots.routing_stats_overview(st)
    img = fig.axes[0].images[0].get_array()
    balanced = st.tokens * st.top_k / st.num_experts
    expected = np.where(st.counts > 0, np.log2(np.maximum(st.counts, 1) / balanced), np.nan)
    np.testing.assert_allclose(np.ma.filled(img, np.nan), expected)
    assert figure_png(fig).startswith(PNG)


def test_the_report_of_a_session_has_the_lens_and_the_waterfall(runs, tmp_path):
    from kimi_explore.views.figures.report import write_report

    _, a, _ = runs
    page = write_report(a, tmp_path).read_text(encoding="utf-8")
    for stem in ("logit_lens", "attribution_last_token"):
        assert f'alt="{stem}"' in page and (tmp_path / f"{stem}.png").read_bytes().startswith(PNG)


def test_lens_grid_outlines_final_top1_and_says_which_tokens_it_shows(runs):
    tok, a, _ = runs
    lens = ke.logit_lens(a, top=2)
    fig = analysis_plots.lens_grid(lens, tok, max_tokens=5)
    ax = fig.axes[0]
    T = len(lens)
    assert f"tokens {T - 5}-{T - 1} of {T}" in ax.get_title()
    same = lens.top_ids[T - 5:, :, 0].T == lens.final_ids[T - 5:][None, :]
    boxes = {(round(p.get_x() + 0.5), round(p.get_y() + 0.5)) for p in ax.patches}
    assert boxes == {(c, r) for r, c in zip(*np.nonzero(same), strict=True)}  # one box per agreeing cell, no other
    assert all(t.get_fontsize() >= 8 for t in ax.texts)


def test_diff_panels_below_rounding_say_so_instead_of_drawing_noise(runs):
    tok, a, _ = runs
    d = ke.diff(a, a.fork())  # the same run twice: nothing changes anywhere
    fig = analysis_plots.diff_overview(d, tokenizer=tok)
    said = [t.get_text() for ax in fig.axes for t in ax.texts if "no change above" in t.get_text()]
    assert len(said) == 3 and not fig.axes[0].images  # output mix, FFN-site weights, KDA: words, no map


def test_routing_stats_cv_has_its_own_axis(ref_weights):
    st = ke.routing_stats(ref_weights, ["abc def", "12 34\n"], progress=False)
    fig = analysis_plots.routing_stats_overview(st)
    mi_ax, cv_ax = fig.axes[1], fig.axes[2]
    np.testing.assert_allclose([p.get_width() for p in mi_ax.patches], st.mutual_information())
    np.testing.assert_allclose([p.get_width() for p in cv_ax.patches], st.cv)
    assert mi_ax.get_legend() is None and cv_ax.get_xlabel() == "std / mean"
