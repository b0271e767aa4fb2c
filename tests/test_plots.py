"""plots: every view draws the trace's numbers (checked against the arrays), labels its axes readably,
renders to PNG without pyplot, and stays legible at K3's size (93 layers, 96 heads, 896 experts)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from synthetic_trace import SyntheticTrace, k3_sized

from kimi_explore import plots
from kimi_explore.tokenizer import ByteTokenizer
from kimi_explore.views.common import MAX_TICKS, nice_stride

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny():
    return SyntheticTrace(n_tokens=7, seed=1)


@pytest.fixture(scope="module")
def k3():
    return k3_sized(n_tokens=30, seed=2)


def all_views(tr, layer: int, kda_layer: int, tok=None):
    """name -> figure for every view (one layer per per-layer view)."""
    return {
        "block_residual_token": plots.block_residual_token(tr, 2, tok),
        "block_residual_layer": plots.block_residual_layer(tr, layer, tok),
        "kda_state_heatmap": plots.kda_state_heatmap(tr, kda_layer, tok),
        "kda_state_overview": plots.kda_state_overview(tr, -1, tok),
        "kda_state_curves": plots.kda_state_curves(tr, tokenizer=tok),
        "moe_routing_token": plots.moe_routing_token(tr, 1, tok),
        "moe_routing_layer": plots.moe_routing_layer(tr, layer, tok),
        "expert_load": plots.expert_load(tr),
        "expert_load_layer": plots.expert_load(tr, layer),
        "moe_output_norms": plots.moe_output_norms(tr),
        "moe_output_norms_token": plots.moe_output_norms(tr, 0, tok),
        "predictions": plots.predictions(tr, 0, tok),
    }


def visible_ticks(ax, axis: str) -> list[str]:
    labels = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    return [t.get_text() for t in labels if t.get_text()]


@pytest.mark.parametrize("size", ["tiny", "k3"])
def test_every_view_renders_and_keeps_ticks_readable(size, tiny, k3):
    tr, layer, kda_layer, tok = (tiny, 5, 1, ByteTokenizer()) if size == "tiny" else (k3, 50, 49, None)
    for name, fig in all_views(tr, layer, kda_layer, tok).items():
        assert isinstance(fig, Figure), name
        for ax in fig.axes:
            for axis in "xy":
                n = len(visible_ticks(ax, axis))
                assert n <= MAX_TICKS + 1, f"{name}: {n} {axis} tick labels"
        # every figure renders at tiny size; at K3 size a few (the rest share the same helpers)
        if size == "tiny" or name in ("block_residual_token", "moe_routing_token", "kda_state_overview"):
            assert plots.figure_png(fig, dpi=40).startswith(PNG_MAGIC)


def test_at_k3_depth_the_mla_layers_are_labelled(k3):
    fig = plots.block_residual_token(k3, 0)
    mla = [f"{i} MLA" for i in k3.layer_ids if i not in k3.kda_ids]
    for ax in fig.axes[:2]:
        assert visible_ticks(ax, "y") == mla


def test_kda_views_take_one_colour_scale(k3):
    a = plots.kda_state_overview(k3, 0, vmax=50.0).axes[0].images[0]
    b = plots.kda_state_heatmap(k3, k3.kda_ids[3], vmax=50.0).axes[0].images[0]
    assert a.norm.vmax == b.norm.vmax == 50.0


def test_moe_summaries_at_k3_size(k3):
    from kimi_explore.views import summaries
    from kimi_explore.views.common import routing
    from kimi_explore.views.figures import plots_summary

    r = routing(k3)
    stats = summaries.load_stats(r)
    fig = plots_summary.moe_layer_stats(k3, 4)
    # 30 tokens x top-16 = 480 choices < 896 experts: most are unchosen by necessity, so no dead count is drawn
    assert not fig.axes[3].lines and "no dead-expert count until 56 tokens" in fig.axes[3].texts[0].get_text()
    np.testing.assert_allclose(fig.axes[0].lines[0].get_ydata(), summaries.routing_entropy(r)[4])
    long = k3_sized(n_tokens=60, seed=3)
    np.testing.assert_allclose(plots_summary.moe_layer_stats(long, 4).axes[3].lines[0].get_ydata(),
                               summaries.load_stats(routing(long))["dead"])
    img = plots_summary.moe_sorted_counts(k3).axes[0].images[0].get_array()
    widest = int((stats["counts"] > 0).sum(axis=1).max())  # cropped to the experts that ran, not to T*k
    assert widest < 30 * 16 and (np.asarray(img)[:, -1] > 0).any()
    np.testing.assert_array_equal(img, summaries.sorted_counts(stats["counts"])[0][:, :widest])
    table = plots_summary.topk_table_html(k3, 4)
    assert table.count("<tr>") == 1 + len(r["moe_layers"]) and f"<b>{int(r['topk_ids'][4, 0, 0])}" in table
    for f in (fig, plots_summary.moe_sorted_counts(k3)):
        assert plots.figure_png(f, dpi=30).startswith(PNG_MAGIC)


def test_nice_stride_thins_k3_axes():
    assert nice_stride(16) == 1
    assert nice_stride(93) == 4  # K3 layers: 24 labels
    assert nice_stride(896) == 25  # K3 experts: 36 labels
    assert all(-(-n // nice_stride(n)) <= MAX_TICKS for n in range(1, 5000, 7))


def test_block_residual_token_shows_the_trace_weights(tiny):
    t = 3
    fig = plots.block_residual_token(tiny, t)
    attn_ax, ffn_ax, final_ax = fig.axes[:3]
    w = tiny.attn_res_weights()[t]
    for site, ax in enumerate((attn_ax, ffn_ax)):
        shown = ax.images[0].get_array()
        np.testing.assert_array_equal(np.ma.getmaskarray(shown), np.isnan(w[:, site]))
        np.testing.assert_allclose(shown.filled(np.nan), w[:, site], equal_nan=True)
        assert visible_ticks(ax, "x") == tiny.source_labels()
    bars = [p.get_width() for p in final_ax.patches]
    np.testing.assert_allclose(bars, tiny.final_attn_res_weights()[t])
    # layer rows say which layers are KDA and which MLA
    rows = visible_ticks(attn_ax, "y")
    assert rows[0] == "0 KDA" and rows[3] == "3 MLA"
    # a dashed line marks every layer where a new block appears (layers 0, 4, 8, 12 -> rows 4, 8, 12)
    lines = sorted(round(line.get_ydata()[0] + 0.5) for line in ffn_ax.lines)
    assert lines == [4, 8, 12]
    # ... at each site where that site's sources grow: before attention, a boundary layer's block shows one layer later
    for site, ax in enumerate((attn_ax, ffn_ax)):
        present = np.isfinite(w[:, site]).sum(axis=1)
        expected = [r for r in range(1, len(present)) if present[r] > present[r - 1]]
        assert sorted(round(line.get_ydata()[0] + 0.5) for line in ax.lines) == expected
    assert len(fig.axes) == 4  # three panels + one colour bar


def test_block_residual_layer_columns_are_tokens(tiny):
    tok = ByteTokenizer()
    fig = plots.block_residual_layer(tiny, 6, tok)
    ax = fig.axes[1]  # before the FFN, below
    np.testing.assert_allclose(ax.images[0].get_array().filled(np.nan), tiny.attn_res_weights()[:, 6, 1].T,
                               equal_nan=True)
    assert visible_ticks(ax, "x") == [f"{p} '{tok.token_label(i)}'" for p, i in enumerate(tiny.tokens)]
    assert visible_ticks(ax, "y") == list(tiny.source_labels())
    assert fig.get_figheight() < 6  # a few source rows: the figure stays short however long the prompt
    # layer 0 has no attention-site mix: that panel says so instead of drawing an empty map
    fig0 = plots.block_residual_layer(tiny, 0)
    assert "block stack is still empty" in fig0.axes[0].texts[0].get_text()


def test_kda_views_show_the_norms(tiny):
    norms, ids = tiny.kda_state_norms()
    j = ids.index(5)
    fig = plots.kda_state_heatmap(tiny, 5)
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), norms[:, j])
    fig = plots.kda_state_overview(tiny, 4)
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), norms[4])
    assert visible_ticks(fig.axes[0], "y") == [str(i) for i in ids]
    fig = plots.kda_state_curves(tiny, layers=[0, 5])
    means = [line.get_ydata() for line in fig.axes[0].lines]
    np.testing.assert_allclose(means[1], norms[:, j].mean(axis=1))
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["layer 0", "layer 5"]


def test_moe_routing_marks_exactly_the_topk(tiny, k3):
    r = tiny.routing()
    fig = plots.moe_routing_token(tiny, 2)
    ax = fig.axes[0]
    np.testing.assert_allclose(ax.images[0].get_array(), r["scores"][2])
    boxes = {(round(p.get_x() + 0.5), round(p.get_y() + 0.5)) for p in ax.patches if isinstance(p, Rectangle)}
    expected = {(int(e), row) for row, ids in enumerate(r["topk_ids"][2]) for e in ids}
    assert boxes == expected
    written = sorted(float(t.get_text()) for t in ax.texts)
    assert written == sorted(round(float(v), 2) for v in r["topk_weights"][2].ravel())
    # K3 size: one dot per chosen expert instead of boxes
    rk = k3.routing()
    ax = plots.moe_routing_layer(k3, 40, None).axes[0]
    dots = ax.collections[0].get_offsets()
    j = rk["moe_layers"].index(40)
    expected = sorted((int(e), t) for t, ids in enumerate(rk["topk_ids"][:, j]) for e in ids)
    assert sorted((int(x), int(y)) for x, y in np.asarray(dots)) == expected


def test_padded_topk_is_not_drawn(tiny):
    """An ablation shortens the top-k; the Trace pads with -1, which must not become an expert."""
    tr = SyntheticTrace(n_tokens=3, seed=4)
    r = tr._routing
    r["topk_ids"][1, 0, 2:] = -1
    r["topk_weights"][1, 0, 2:] = np.nan
    ax = plots.moe_routing_token(tr, 1).axes[0]
    assert sum(isinstance(p, Rectangle) for p in ax.patches) == r["topk_ids"][1].size - 2
    assert plots.expert_load(tr).axes[0].images[0].get_array().sum() == (r["topk_ids"] >= 0).sum()


def test_expert_load_counts_choices(tiny):
    r = tiny.routing()
    E = r["scores"].shape[2]
    img = plots.expert_load(tiny).axes[0].images[0].get_array()  # [MoE layer, expert]: never summed over layers
    for j in range(len(r["moe_layers"])):
        counts = Counter(int(e) for e in r["topk_ids"][:, j].ravel())
        assert img[j].tolist() == [counts.get(e, 0) for e in range(E)]
    j = r["moe_layers"].index(3)
    counts3 = Counter(int(e) for e in r["topk_ids"][:, j].ravel())
    ax = plots.expert_load(tiny, 3).axes[0]
    assert [p.get_height() for p in ax.patches] == [counts3.get(e, 0) for e in range(r["scores"].shape[2])]
    uniform = ax.lines[0].get_ydata()[0]
    assert uniform == pytest.approx(len(tiny) * r["topk_ids"].shape[2] / r["scores"].shape[2])


def test_moe_output_norms(tiny):
    ax = plots.moe_output_norms(tiny, 3).axes[0]
    routed, shared = (line.get_ydata() for line in ax.lines)
    np.testing.assert_allclose(routed, [tiny[f"layers.{i}.moe.routed_out.norm"][3] for i in tiny.moe_ids])
    np.testing.assert_allclose(shared, [tiny[f"layers.{i}.moe.shared_out.norm"][3] for i in tiny.moe_ids])


def test_predictions_bars_and_next_token_highlight():
    tr = SyntheticTrace(n_tokens=4, seed=3)
    top = tr["logits.top_ids"]
    tr.tokens[2] = int(top[1, 3])  # the token fed after step 1 is its 4th prediction
    tok = ByteTokenizer()
    ax = plots.predictions(tr, 1, tok).axes[0]
    np.testing.assert_allclose([p.get_width() for p in ax.patches], tr["logits.top_probs"][1])
    colors = [p.get_facecolor() for p in ax.patches]
    assert colors[3] != colors[0] and colors.count(colors[3]) == 1
    assert visible_ticks(ax, "y")[0] == f"'{tok.token_label(int(top[1, 0]))}'"
    assert "fed next" in ax.get_title()
    assert "fed next" not in plots.predictions(tr, -1, tok).axes[0].get_title()  # nothing after the last token


def test_compare_predictions_reports_kl():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=256), rng.normal(size=256)
    p, q = np.exp(a) / np.exp(a).sum(), np.exp(b) / np.exp(b).sum()
    kl = float(np.sum(p * np.log(p / q)))
    ax = plots.compare_predictions(a, b, k=5).axes[0]
    assert f"{kl:.4f}" in ax.get_title()
    assert len(ax.patches) == 2 * len(set(np.argsort(-p)[:5]) | set(np.argsort(-q)[:5]))
    assert "same top-1" in plots.compare_predictions(a, a + 1.0).axes[0].get_title()  # a shift changes nothing


def test_errors_name_what_is_wrong(tiny):
    with pytest.raises(ValueError, match=r"layer 3 is not a KDA layer \(an MLA layer has no recurrent state\)"):
        plots.kda_state_heatmap(tiny, 3)
    with pytest.raises(ValueError, match="layer 0 is not a recorded MoE layer"):
        plots.moe_routing_layer(tiny, 0)
    with pytest.raises(IndexError, match="token=7 is outside the trace: it holds 7 tokens"):
        plots.block_residual_token(tiny, 7)
    with pytest.raises(ValueError, match="layer 99 is not in this trace"):
        plots.block_residual_layer(tiny, 99)


def test_real_trace_from_the_tiny_model(tiny_weights):
    """The views read a Recorder's Trace as it really comes out of the decoder."""
    from kimi_explore import Session

    tok = ByteTokenizer()
    s = Session(tiny_weights, tokenizer=tok)
    s.feed(tok.encode("K3 ok"))
    tr = s.trace()
    fig = plots.block_residual_token(tr, -1, tok)
    np.testing.assert_allclose(fig.axes[1].images[0].get_array().filled(np.nan), tr.attn_res_weights()[-1, :, 1],
                               equal_nan=True)
    # every ffn-site row sums to one over the sources that exist
    assert np.allclose(np.nansum(tr.attn_res_weights()[-1, :, 1], axis=1), 1, atol=1e-5)
    for fig in all_views(tr, 5, 5, tok).values():
        assert plots.figure_png(fig, dpi=40).startswith(PNG_MAGIC)


def test_plots_never_touch_pyplot():
    """Agg-safe, no global figure registry: importing and drawing leaves pyplot unimported."""
    code = ("import sys; sys.path.insert(0, 'tests'); from synthetic_trace import SyntheticTrace; "
            "from kimi_explore import plots; tr = SyntheticTrace(); "
            "plots.figure_png(plots.block_residual_token(tr)); plots.figure_png(plots.moe_routing_token(tr)); "
            "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))


def test_dollar_signs_in_tokens_are_not_mathtext():
    tr = SyntheticTrace(n_tokens=3, seed=5)
    tr.tokens[:] = [36, 36, 36]  # '$' three times: '$...$' pairs would be parsed as mathtext
    tok = ByteTokenizer()
    for fig in (plots.block_residual_layer(tr, 5, tok), plots.predictions(tr, 0, tok), plots.kda_state_curves(tr, tokenizer=tok)):
        texts = [fig.get_suptitle()] + [t for ax in fig.axes for t in
                                        (ax.get_title(), *visible_ticks(ax, "x"), *visible_ticks(ax, "y"))]
        assert any("$" in t for t in texts)
        assert all("$" not in t.replace(r"\$", "") for t in texts), [t for t in texts if "$" in t]
    assert plots.token_labels([36], tok) == ["0 '$'"]  # the public labels (HTML, widgets) stay plain


def test_kda_state_difference_is_b_minus_a_on_a_symmetric_scale(tiny):
    import copy

    other = copy.deepcopy(tiny)
    norms, ids = tiny.kda_state_norms()
    j = ids.index(5)
    bumped = np.array(norms, copy=True)
    bumped[:, j, 1] += 0.25
    bumped[2, j, 0] -= 0.5
    other.kda_state_norms = lambda: (bumped, ids)
    fig = plots.kda_state_difference(tiny, other, 5)
    im = fig.axes[0].images[0]
    expected = np.zeros_like(norms[:, j])
    expected[:, 1], expected[2, 0] = 0.25, -0.5
    np.testing.assert_allclose(im.get_array(), expected, atol=1e-6)
    assert im.get_clim() == pytest.approx((-0.5, 0.5))
    with pytest.raises(ValueError, match="same tokens"):
        other.tokens = list(other.tokens)[:-1]
        plots.kda_state_difference(tiny, other, 5)


def test_every_view_takes_a_session_its_trace_and_its_tokenizer(ref_weights):
    """A Session stands for its trace, and its tokenizer labels the tokens where the call gives none (each view
    raised AttributeError on a Session); a tokenizer given positionally or by name still wins."""
    import kimi_explore as ke

    session = ke.Session(ref_weights, tokenizer=ByteTokenizer())
    session.feed(list(b"Hi, K3!\n"))
    png = lambda views: {k: plots.figure_png(f) for k, f in views.items()}  # noqa: E731
    as_session, as_trace = png(all_views(session, 2, 1)), png(all_views(session.trace(), 2, 1, ByteTokenizer()))
    assert as_session == as_trace
    plain = png(all_views(session.trace(), 2, 1))  # ids, not characters: the session's tokenizer made the difference
    assert as_session["moe_routing_layer"] != plain["moe_routing_layer"]
    labels = visible_ticks(plots.kda_state_heatmap(session, 1).axes[0], "y")
    assert labels[:2] == ["0 'H'", "1 'i'"]

    class Upper(ByteTokenizer):
        def token_label(self, i):
            return super().token_label(i).upper()

    assert visible_ticks(plots.kda_state_heatmap(session, 1, Upper()).axes[0], "y")[1] == "1 'I'"
    assert visible_ticks(plots.kda_state_heatmap(session, 1, tokenizer=Upper()).axes[0], "y")[1] == "1 'I'"
    fork = session.fork()
    diff = plots.kda_state_difference(session, fork, 1)
    assert visible_ticks(diff.axes[0], "y")[:2] == labels[:2]


def test_count_maps_write_counts_as_integers():
    """expert_load's map wrote every count as '6.00' (the heatmap's weight format)."""
    texts = [t.get_text() for t in plots.expert_load(SyntheticTrace(n_tokens=7, n_layers=4, seed=1)).axes[0].texts]
    assert texts and all(t.isdigit() for t in texts)


def test_kda_curves_say_when_they_show_only_some_layers(tiny):
    """The curves drew 4 evenly spaced KDA layers of more without saying so (the report's caption spoke of all)."""
    n = len(tiny.kda_layers)
    assert n > 4
    title = plots.kda_state_curves(tiny).axes[0].get_title()
    assert f"4 of the {n} KDA layers" in title
    assert "of the" not in plots.kda_state_curves(tiny, max_layers=n).axes[0].get_title()


def test_moe_layer_stats_keeps_the_log2_k_line_inside_the_panel(tiny):
    """With every entropy at or below log2 k the y-axis ended at log2 k: its reference line lay on the frame."""
    from kimi_explore.views.figures.plots_summary import moe_layer_stats

    ax = moe_layer_stats(tiny).axes[0]
    k = tiny.routing()["topk_ids"].shape[2]
    assert ax.get_ylim()[1] > np.log2(k) * 1.05
