"""The interactive figures (views/figures*.py) are plotly.js specs: check what they carry against the trace,
at the embedded size and at K3's (93 layers, 96 KDA heads, 896 experts top-16), without a browser."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from synthetic_trace import SyntheticTrace, k3_sized

from kimi_explore.views import summaries
from kimi_explore.views.common import routing
from kimi_explore.views.explorer import specs, specs_moe

DTYPES = {"f4": np.float32, "f8": np.float64, "i4": np.int32, "u1": np.uint8, "u2": np.uint16, "u4": np.uint32}


def decode(spec: dict) -> np.ndarray:
    """A plotly.js typed-array spec back to an array."""
    a = np.frombuffer(base64.b64decode(spec["bdata"]), dtype=DTYPES[spec["dtype"]])
    return a.reshape([int(n) for n in spec["shape"].split(",")])


@pytest.fixture(scope="module")
def k3():
    return k3_sized(n_tokens=6)


def test_block_token_carries_the_weights_and_marks_the_selected_layer(k3):
    data, layout = specs.block_token(k3, 4, layer=37)
    w = k3.attn_res_weights()[4]
    for site in (0, 1):
        np.testing.assert_array_equal(decode(data[site]["z"]), w[:, site, :].T.astype(np.float32))
        assert data[site]["hoverongaps"]  # a grey cell still says what it is, and can be clicked
    np.testing.assert_allclose(decode(data[2]["z"])[:, 0], k3.final_attn_res_weights()[4], rtol=1e-6)
    frames = [s for s in layout["shapes"] if s["type"] == "rect"]
    assert [(f["x0"], f["x1"]) for f in frames] == [(36.5, 37.5)] * 2
    json.dumps([data, layout], allow_nan=False)  # what the widget sends is plain JSON


def test_block_lines_follow_each_sites_own_blocks():
    tr = SyntheticTrace(n_tokens=3, n_layers=16, block_size=4)
    _, layout = specs.block_token(tr, 0)
    w = tr.attn_res_weights()[0]
    for site, yref in ((0, "y domain"), (1, "y2 domain")):
        present = np.isfinite(w[:, site]).sum(axis=1)
        expected = [c - 0.5 for c in range(1, 16) if present[c] > present[c - 1]]
        lines = [s["x0"] for s in layout["shapes"] if s["type"] == "line" and s["yref"] == yref]
        assert lines == expected


def test_at_k3_depth_the_layer_axis_names_the_mla_layers(k3):
    labels = specs.layer_labels(k3)
    axis = specs.layer_axis(labels)
    mla = [f"{i} MLA" for i in k3.layer_ids if i not in k3.kda_ids]
    named = axis["tickvals"]
    assert axis["ticktext"] == named
    cols = sorted(labels.index(s) for s in named)
    assert min(b - a for a, b in zip(cols, cols[1:], strict=False)) >= specs.MIN_TICK_GAP  # no two labels overlap
    # every MLA layer is named unless it sits next to a named one (K3's 91 and 92: only 91)
    assert all(s in named or any(abs(labels.index(s) - c) < specs.MIN_TICK_GAP for c in cols) for s in mla)
    assert "91 MLA" in named and "92 MLA" not in named
    # the selected layer is always named, even a KDA layer between two MLA ones
    sel = specs.layer_axis(labels, selected="90 KDA")["tickvals"]
    assert "90 KDA" in sel and "91 MLA" not in sel
    # an axis of KDA layers only (the KDA tab) is named on a stride, not at its two ends
    kda = [s for s in labels if s.endswith("KDA")]
    named = specs.layer_axis(kda, "KDA layer")["tickvals"]
    assert len(named) >= 8 and named[0] == kda[0]
    small = specs.layer_axis(specs.layer_labels(SyntheticTrace(n_layers=16)))
    assert "tickvals" not in small  # 16 layers: every one labelled


@pytest.mark.parametrize("n_tokens,t", [(3, 0), (40, 39), (100, 10), (100, 99)])
def test_token_window_has_a_fixed_width_and_shows_the_token(n_tokens, t):
    lo, hi = specs.token_window(n_tokens, t)
    assert hi - lo == specs.WINDOW and lo < t < hi
    assert lo >= -0.5 and (hi <= n_tokens - 0.5 or n_tokens <= specs.WINDOW)


def test_kda_views_share_one_colour_scale(k3):
    vmax = specs.kda_vmax(k3)
    assert vmax == pytest.approx(np.nanmax(k3.kda_state_norms()[0]))
    (tok,), _ = specs.kda_token(k3, 2, layer=k3.kda_ids[5], vmax=vmax)
    (lay,), _ = specs.kda_layer(k3, k3.kda_ids[5], 2, vmax=vmax)
    assert tok["zmax"] == lay["zmax"] == vmax and tok["zmin"] == lay["zmin"] == 0
    np.testing.assert_allclose(decode(lay["z"]), k3.kda_state_norms()[0][:, 5].T, rtol=1e-6)
    data, layout = specs.kda_layer(k3, 3, 2)  # layer 3 is MLA in the synthetic pattern
    assert data == [] and "MLA layer" in layout["annotations"][0]["text"]


def test_moe_topk_table_hover_says_expert_score_and_bias(k3):
    r = routing(k3)
    E = r["scores"].shape[2]
    bias = {i: np.linspace(-0.1, 0.1, E) for i in r["moe_layers"]}
    table = summaries.topk_table(r, 3, bias)
    (heat,), layout = specs_moe.moe_topk(table, k3, layer=50, t=3)
    # only the ROWS MoE layers around the selected one are sent (K3 has 92): their labels are the y axis
    shown = [int(y.split()[0]) for y in heat["y"]]
    assert len(heat["text"]) == len(shown) == specs_moe.ROWS and len(heat["text"][0]) == 16
    assert shown == r["moe_layers"][r["moe_layers"].index(shown[0]):][:specs_moe.ROWS] and 50 in shown
    row = shown.index(50)
    j = r["moe_layers"].index(50)
    e = int(r["topk_ids"][3, j, 0])
    assert heat["text"][row][0] in (str(e), f"{e}*")
    hover = heat["customdata"][row][0]
    assert f"expert <b>{e}</b>" in hover and f"unbiased score {r['scores'][3, j, e]:.4f}" in hover
    assert f"selection bias {bias[50][e]:+.4f}" in hover
    np.testing.assert_allclose(decode(heat["z"])[row], r["topk_weights"][3, j].astype(np.float32))
    assert [sh["y0"] + 0.5 for sh in layout["shapes"]] == [row]  # the selected layer's row, outlined
    assert f"MoE layers {shown[0]}-{shown[-1]} of {len(r['moe_layers'])}" in layout["title"]["text"]
    # the deepest layers select the last window, which ends at the last row
    (heat,), layout = specs_moe.moe_topk(table, k3, layer=92, t=3)
    assert heat["y"][-1].startswith("92 ") and f"-92 of {len(r['moe_layers'])}" in layout["title"]["text"]


def test_moe_layer_stats_and_sorted_counts(k3):
    r = routing(k3)
    stats = summaries.load_stats(r)
    counts, order = summaries.sorted_counts(stats["counts"])
    layers = r["moe_layers"]
    data, layout = specs_moe.moe_layers(summaries.routing_entropy(r)[2], stats, k3, layers, 10, 16)
    # 6 tokens x top-16 = 96 choices < 896 experts: most are unchosen by necessity, so no "dead" row
    assert len(data) == 3 and "no dead-expert count until 56 tokens" in layout["title"]["text"]
    data, layout = specs_moe.moe_layers(summaries.routing_entropy(r)[2], dict(stats, tokens=56), k3, layers, 10, 16)
    assert len(data) == 4 and "dead" not in layout["title"]["text"]
    np.testing.assert_allclose(decode(data[3]["y"]), stats["dead"])
    (heat,), layout = specs_moe.moe_sorted(stats, order, counts, k3, layers, 10, 16)
    z = decode(heat["z"])
    widest = max(len(set(map(int, r["topk_ids"][:, j].reshape(-1)))) for j in range(len(layers)))
    assert z.shape == (len(layers), widest)  # cropped to the experts that ever ran (a column of zeros is gone)
    assert (z[:, -1] > 0).any() and f"ranks 1-{widest} of 896" in layout["title"]["text"]
    np.testing.assert_array_equal(decode(heat["customdata"]), order[:, :widest])


def test_moe_step_payload_is_bounded_whatever_the_history(k3):
    """What a Step sends for the MoE tab's four views at K3's shape (92 MoE layers, 896 experts top-16),
    as JSON, after 20, 300 and 20000 tokens: the top-k table, the per-layer lines and the top-by-load
    table do not grow with the history; the sorted counts (M x n, n = the widest row of experts that
    ran, up to E) stay under 4 bytes a cell of M x E (counts and ids as small unsigned ints, base64)."""
    r = routing(k3)
    layers, (_, M, k), E = r["moe_layers"], r["topk_ids"].shape, r["scores"].shape[2]
    table, entropy = summaries.topk_table(r, 3), summaries.routing_entropy(r)[3]
    rng = np.random.default_rng(0)
    sizes = {}
    for T in (20, 300, 20000):
        skew = rng.dirichlet(np.full(E, 0.3), size=M)  # an unbalanced router: some experts much busier
        counts = np.stack([np.bincount(rng.choice(E, size=T * k, p=skew[j]), minlength=E) for j in range(M)])
        stats = summaries.stats_from_counts(counts, T)
        srt, order = summaries.sorted_counts(counts)
        figs = {"moe_topk": specs_moe.moe_topk(table, k3, 50, t=3),
                "moe_layers": specs_moe.moe_layers(entropy, stats, k3, layers, 50, k),
                "moe_sorted": specs_moe.moe_sorted(stats, order, srt, k3, layers, 50, k),
                "moe_top": specs_moe.moe_top_experts(srt, order, k3, layers, 50, T)}
        sizes[T] = {name: len(json.dumps(fig, allow_nan=False)) for name, fig in figs.items()}
        z = decode(figs["moe_sorted"][0][0]["z"])
        np.testing.assert_array_equal(z, srt[:, : z.shape[1]])  # the small ints are the counts, exactly
    for name in ("moe_topk", "moe_layers", "moe_top"):  # (the layer lines gain the "dead" row once T x k >= E)
        assert sizes[20000][name] <= 1.05 * sizes[300][name] and sizes[300][name] <= 1.35 * sizes[20][name], sizes
    assert sizes[20000]["moe_sorted"] > sizes[300]["moe_sorted"] > sizes[20]["moe_sorted"]  # n grows to E ...
    assert sizes[20000]["moe_sorted"] <= 4 * M * E * 4 / 3 + 20_000, sizes  # ... its bytes stay bounded
    assert sum(sizes[20000].values()) <= 600_000, sizes


def test_moe_full_map_marks_every_chosen_expert(k3):
    r = routing(k3)
    data, layout = specs_moe.moe_full(r, 1, k3, layer=20)
    heat, chosen = data
    assert decode(heat["z"]).shape == (92, 896)
    ids = r["topk_ids"][1]
    np.testing.assert_array_equal(np.sort(decode(chosen["x"])), np.sort(ids[ids >= 0].ravel()))
    assert layout["dragmode"] == "zoom" and "chosen" in chosen["hovertemplate"]


def test_predictions_and_compare():
    tr = SyntheticTrace(n_tokens=3)
    (bar,), layout = specs_moe.predictions(tr, 0)
    fed = tr.tokens[1]
    ids = list(tr["logits.top_ids"][0])
    assert bar["marker"]["color"].count(specs.SELECT) == (fed in ids)
    base, other = np.array([3.0, 1.0, 0.0]), np.array([0.0, 3.0, 1.0])
    data, layout, kl = specs_moe.compare(base, other, k=3)
    p, q = np.exp(base) / np.exp(base).sum(), np.exp(other) / np.exp(other).sum()
    assert kl == pytest.approx(float(np.sum(p * np.log(p / q))))
    assert "top-1 changed" in layout["title"]["text"]


def test_expert_search_at_896_experts_marks_every_firing_with_its_weight(k3):
    r = routing(k3)
    ids, w = r["topk_ids"], r["topk_weights"]
    e = int(ids[3, 40, 5])  # an expert that fired at least once
    (hm,), layout = specs_moe.expert_search(r, e, k3, t=3, layer=50)
    z = decode(hm["z"])  # [M, T]
    expected = np.full(z.shape, np.nan)
    for t, j, c in zip(*np.nonzero(ids == e), strict=True):  # plain loops over the trace
        expected[j, t] = w[t, j, c]
    np.testing.assert_allclose(z, expected.astype(np.float32), equal_nan=True)
    hits = int((ids == e).sum())
    layers_hit = len({j for _, j, _ in zip(*np.nonzero(ids == e), strict=True)})
    assert f"in tokens 0-5 it fired {hits} times at {layers_hit} of {len(r['moe_layers'])} MoE layers" \
        in layout["title"]["text"]
    gone = dict(r, topk_ids=np.where(ids == e, -1, ids))  # the same trace with e ablated everywhere
    assert "never chosen in tokens 0-5" in specs_moe.expert_search(gone, e, k3, 3, 50)[1]["title"]["text"]
    assert "does not exist" in specs_moe.expert_search(r, 896, k3, 3, 50)[1]["annotations"][0]["text"]


def test_top_experts_by_load_name_each_layers_busiest(k3):
    r = routing(k3)
    stats = summaries.load_stats(r)
    counts, order = summaries.sorted_counts(stats["counts"])
    layers = r["moe_layers"]
    (hm,), layout = specs_moe.moe_top_experts(counts, order, k3, layers, 50, stats["tokens"])
    j = layers.index(50)
    from collections import Counter

    tally = Counter(int(x) for x in r["topk_ids"][:, j].ravel())
    row = [int(y.split()[0]) for y in hm["y"]].index(50)  # only the rows around the selected layer are sent
    top = decode(hm["z"])[row]
    assert top[0] == max(tally.values())  # rank 1 is the busiest expert of that layer
    for rank, name in enumerate(hm["text"][row]):
        if name:
            assert tally[int(name)] == top[rank]  # each named expert's count, from the raw ids
    assert "Top 8 experts by load per layer, 6 tokens; layers" in layout["title"]["text"]


def test_every_named_colour_scale_is_one_plotly_js_knows():
    """plotly.js silently draws an unknown scale name ("Magma") with its default red scale, under the
    red selection outline: every name the Explorer uses must be built into plotly.js."""
    import re
    from pathlib import Path

    from kimi_explore.views import explorer

    builtin = {"Blackbody", "Bluered", "Blues", "Cividis", "Earth", "Electric", "Greens", "Greys", "Hot", "Jet",
               "Picnic", "Portland", "Rainbow", "RdBu", "Reds", "Viridis", "YlGnBu", "YlOrRd"}
    used = set()
    for path in Path(explorer.__file__).parent.glob("*.py"):
        used |= set(re.findall(r'colorscale="(\w+)"', path.read_text()))
    assert used and used <= builtin, used - builtin
    data, _ = specs.kda_token(k3_sized(n_tokens=2), 1)
    assert data[0]["colorscale"] == specs.NORM_SCALE


def test_the_block_tab_has_one_colour_bar_and_heatmap_axes_draw_no_grid(k3):
    """The per-layer block map reads on the per-token map's colour bar (same scale), so it draws none;
    heatmap axes draw no grid lines (under the cells; plotly redrew them at every Step)."""
    tok_data, tok_layout = specs.block_token(k3, 4, layer=37)
    lay_data, lay_layout = specs.block_layer(k3, 37, 4)
    bars = [t for t in tok_data + lay_data if t["showscale"]]
    assert len(bars) == 1 and bars[0] is tok_data[0] and bars[0]["colorbar"]["title"]["text"] == "softmax weight"
    scale = (bars[0]["colorscale"], bars[0]["zmin"], bars[0]["zmax"])
    assert all((t["colorscale"], t["zmin"], t["zmax"]) == scale for t in tok_data + lay_data)
    assert "colour scale above" in lay_layout["title"]["text"]
    r = routing(k3)
    stats = summaries.load_stats(r)
    counts, order = summaries.sorted_counts(stats["counts"])
    layers = r["moe_layers"]
    vmax = specs.kda_vmax(k3)
    views = {"block_token": (tok_data, tok_layout), "block_layer": (lay_data, lay_layout),
             "kda_token": specs.kda_token(k3, 2, layer=k3.kda_ids[5], vmax=vmax),
             "kda_layer": specs.kda_layer(k3, k3.kda_ids[5], 2, vmax=vmax),
             "moe_sorted": specs_moe.moe_sorted(stats, order, counts, k3, layers, 50, 16),
             "moe_top": specs_moe.moe_top_experts(counts, order, k3, layers, 50, stats["tokens"]),
             "moe_topk": specs_moe.moe_topk(summaries.topk_table(r, 2, None), k3, 50, None, 2)}
    for name, (data, layout) in views.items():
        axes = {a for t in data if t["type"] == "heatmap" for a in (t.get("xaxis", "x"), t.get("yaxis", "y"))}
        assert axes, name
        for a in axes:
            assert layout[a[0] + "axis" + a[1:]].get("showgrid") is False, (name, a)


def test_lens_cells_keep_a_tokens_own_quotes():
    """A lens cell shows its top-1 token's text: the apostrophe token is "'" (stripping the label's quotes with
    strip("'") left it blank, and a real tokenizer's "'s" read "s"), in the Explorer's strip and the static grid."""
    from kimi_explore.analysis.logit_lens import LogitLens
    from kimi_explore.tokenizer import ByteTokenizer
    from kimi_explore.views.explorer import specs_analysis
    from kimi_explore.views.figures.analysis_plots import lens_grid

    tok = ByteTokenizer()
    top = np.array([[[39], [97], [32], [0xC3]]])  # "'", 'a', ' ', a byte that is not text alone
    lens = LogitLens([0, 1, 2, 3], np.array([97]), top, np.full((1, 4, 1), 0.5), np.array([39]), positions=np.array([0]))
    data, _ = specs_analysis.lens_strip(lens, ["0 KDA", "1 KDA", "2 KDA", "3 MLA"], tok)
    assert data[0]["text"] == [["'", "a", "␣", "xC3"]]
    fig = lens_grid(lens, tok)
    assert [t.get_text() for t in fig.axes[0].texts] == ["'", "a", "␣", "xC3"]


def _colour_at(trace: dict, z: float) -> tuple[int, int, int]:
    """The colour plotly.js paints z with in this heatmap trace: its scale (a plotly name resolved by plotly.py's
    copy of plotly.js's scales, or explicit stops), `reversescale` applied, linear between the stops."""
    from plotly.colors import PLOTLY_SCALES, hex_to_rgb, unlabel_rgb

    scale = trace["colorscale"]
    stops = PLOTLY_SCALES[scale] if isinstance(scale, str) else scale
    rgb = lambda c: hex_to_rgb(c) if c.startswith("#") else tuple(int(v) for v in unlabel_rgb(c))  # noqa: E731
    f = min(1.0, max(0.0, (z - trace["zmin"]) / ((trace["zmax"] - trace["zmin"]) or 1)))
    if trace.get("reversescale"):
        f = 1 - f
    for (p0, c0), (p1, c1) in zip(stops, stops[1:], strict=False):
        if f <= p1:
            u = (f - p0) / (p1 - p0) if p1 > p0 else 0
            return tuple(round(a + u * (b - a)) for a, b in zip(rgb(c0), rgb(c1), strict=True))
    return rgb(stops[-1][1])


def test_explorer_scales_read_the_right_way_round(k3):
    """The run diff's Δ output-mix weights: red = more weight in the fork, blue = less, white = no change (the
    project's convention; plotly's own "RdBu" with reversescale painted it the other way round, grey at 0); its
    routing strip (no colour bar): white = no MoE layer changed (plotly's "Greys" made 0 black); the full
    expert map: dark = a high score, as the top-N view beside it (plotly's "Blues" is dark at 0)."""
    from kimi_explore.views.explorer import specs_analysis

    class Diff:  # the fields `run_diff` reads (a RunDiff of 4 tokens: a fork that moved weight at tokens 1 and 3)
        tokens_a, kl, flips = np.arange(4), np.array([0.0, 0.1, 0.0, 0.2]), np.zeros(4, bool)
        final_attn_res = np.array([[0, 0, 0], [0.2, -0.2, 0], [0, 0, 0], [0.1, 0, -0.1]])
        source_labels, routing_changes = ["embedding", "block 1", "current"], [(1, 3, [5], [6])]

        def __len__(self):
            return 4

    data, _ = specs_analysis.run_diff(Diff(), 0)
    dw, changed = data[1], data[2]
    red, blue, white = _colour_at(dw, 0.2), _colour_at(dw, -0.2), _colour_at(dw, 0.0)
    assert red[0] > 150 > red[2] and blue[2] > 150 > blue[0] and min(white) >= 245
    assert min(_colour_at(changed, 0)) >= 245 and max(_colour_at(changed, 1)) < 100
    r = routing(k3)
    (full, _), _ = specs_moe.moe_full(r, 0, k3, None)
    top = specs_moe.moe_top_experts(*summaries.sorted_counts(summaries.load_stats(r)["counts"]), k3, r["moe_layers"],
                                    None, len(k3))[0][0]
    for tr in (full, top):
        lo, hi = _colour_at(tr, tr["zmin"]), _colour_at(tr, tr["zmax"])
        assert sum(hi) < sum(lo), tr["colorscale"]  # high values dark


def test_at_k3_depth_the_lens_strip_names_the_selected_layer_and_the_mla_layers(k3):
    """93 columns: the lens strip's layer axis names what every other layer axis names (the selected layer, the
    MLA landmarks, no two labels overlapping), not whatever plotly's own thinning of 93 categories keeps."""
    from kimi_explore.analysis.logit_lens import LogitLens
    from kimi_explore.views.explorer import specs_analysis

    labels = specs.layer_labels(k3)
    L = len(labels)
    lens = LogitLens(list(k3.layer_ids), np.array([5]), np.full((1, L, 1), 7), np.full((1, L, 1), 0.3), np.array([7]),
                     positions=np.array([0]))
    _, layout = specs_analysis.lens_strip(lens, labels, None, layer=50)
    assert layout["xaxis"]["tickvals"] == specs.layer_axis(labels, "", "50 KDA")["tickvals"]
    assert "50 KDA" in layout["xaxis"]["tickvals"] and "91 MLA" in layout["xaxis"]["tickvals"]
