"""Interactive figures of a Trace as plotly.js specs: pure functions returning (data, layout).

The Explorer shows them in `PlotView`s (`plotly_view.py`); tests read the dicts directly. Every
view has a fixed height, whatever the number of tokens or layers; tokens run along x in a window of
`WINDOW` tokens that follows the selected token (pan to scroll); layers run along x (per-token views)
with the MLA layers named on the axis at K3 depth; the selected token or layer is outlined in red.
Hover texts say what a cell is (layer, site, source, head, expert, score, ...), with exact values.

Heatmap axes draw no grid lines (`showgrid: False`): they lie under the cells, seen only through a
gap, and drawing them was a good part of plotly's redraw of a small map at each Step.

Block-residual and KDA views are here; MoE routing and predictions are in `specs_moe.py`.
"""

from __future__ import annotations

import numpy as np

from ..common import MISSING, layer_labels, nice_stride, trace_labels, why_no_mix
from .plotly_view import typed

__all__ = ["WINDOW", "block_layer", "block_token", "empty", "kda_layer", "kda_token", "layer_labels", "token_window",
           "trace_labels"]

WINDOW = 40  # tokens shown at once along x (cells keep their width as the prompt grows)
SELECT = "#d62728"
FONT = {"size": 11}
SITE_NAMES = ("before attention (attn_res.attn)", "before the FFN (attn_res.ffn)")
GAP_NOTE = "<br>no weight: that block is not sealed yet here"
# plotly.js has no "Magma" (an unknown name silently falls back to a red scale, under the red selection
# outline): light yellow (empty state) to dark blue (a full one), no red in it
NORM_SCALE = [[0.0, "#ffffd9"], [0.25, "#c7e9b4"], [0.5, "#41b6c4"], [0.75, "#225ea8"], [1.0, "#081d58"]]
GAP_CELLS = 100  # heatmaps up to this many cells are drawn with gaps between the cells
GAP_COLOR = MISSING  # the plot background, seen through NaN cells: the grey of the static figures too


MIN_TICK_GAP = 3  # columns between two tick labels at K3 depth (rotated labels 2 apart overlap)
SOURCE_ROW_PX = 10  # pixels per source row of a block-residual panel: every source is named, in a 9 px font
PANEL = 0.47  # each of the two stacked block-residual panels, of the plot's height (K3's 9 sources fit in 300 px)


def layer_ticks(labels: list[str], selected: str | None = None) -> list[str]:
    """Which layer labels a crowded axis names: the selected layer first, then the MLA layers (K3's
    landmarks), or every `nice_stride`-th layer on an axis without MLA (the KDA views), then both ends;
    a label closer than MIN_TICK_GAP columns to one already kept is dropped."""
    pos = {s: j for j, s in enumerate(labels)}
    mla = [j for j, s in enumerate(labels) if s.endswith("MLA")]
    wanted = mla or list(range(0, len(labels), nice_stride(len(labels), 24)))
    kept: list[int] = []
    for j in ([pos[selected]] if selected in pos else []) + wanted + [0, len(labels) - 1]:
        if all(abs(j - k) >= MIN_TICK_GAP for k in kept):
            kept.append(j)
    return [labels[j] for j in sorted(kept)]


def source_axis(sources: list[str], **kw) -> dict:
    """The source axis of a block-residual panel: every source named (plotly would drop every other label of
    a crowded axis, and K3's 9 sources are all worth reading), top to bottom."""
    return heat_axis(autorange="reversed", fixedrange=True, tickmode="array", tickvals=list(sources),
                     ticktext=list(sources), **{"tickfont": {"size": 9}, **kw})


def panels_height(n_sources: int, margins: int) -> int:
    """The height (px) two stacked block-residual panels (PANEL of the plot each) need to name `n_sources` rows."""
    return int(np.ceil(n_sources * SOURCE_ROW_PX / PANEL)) + margins


def heat_axis(**kw) -> dict:
    """A categorical axis of a heatmap: ticks at 10 px, no grid lines (module docstring), then `kw`."""
    return {"type": "category", "tickfont": {"size": 10}, "showgrid": False, **kw}


def layer_axis(labels: list[str], title: str = "layer", selected: str | None = None) -> dict:
    """A categorical layer axis; past 32 layers only `layer_ticks` are named (the selected one always)."""
    axis = heat_axis(title={"text": title}, fixedrange=True)
    if len(labels) > 32:
        ticks = layer_ticks(labels, selected)
        axis.update(tickmode="array", tickvals=ticks, ticktext=ticks, tickangle=-60)
    return axis


def token_window(n_tokens: int, t: int, window: int = WINDOW) -> list[float]:
    """x range (category units) of `window` tokens that shows token t; fixed width from the first token."""
    if n_tokens <= window:
        return [-0.5, window - 0.5]
    end = min(n_tokens - 1, max(window - 1, t + window // 4))
    return [end - window + 0.5, end + 0.5]


def token_axis(trace, t: int, tokenizer=None) -> dict:
    return heat_axis(title={"text": "token (the token slider moves this window)"}, range=token_window(len(trace), t),
                     tickangle=-60)  # no automargin: it costs plotly a second layout pass


def outline(col: float, xref: str = "x", yref: str = "y domain") -> dict:
    """A red frame around column `col` (category index) over the whole height of an axis."""
    return {"type": "rect", "xref": xref, "yref": yref, "x0": col - 0.5, "x1": col + 0.5, "y0": 0, "y1": 1,
            "line": {"color": SELECT, "width": 2}, "fillcolor": "rgba(0,0,0,0)", "layer": "above"}


def empty(message: str, height_title: str = "") -> tuple[list, dict]:
    """A figure with only a message (a layer this view has nothing for)."""
    return [], {"title": {"text": height_title, "font": FONT}, "xaxis": {"visible": False}, "yaxis": {"visible": False},
                "annotations": [{"text": message, "showarrow": False, "xref": "paper", "yref": "paper", "x": 0.5,
                                 "y": 0.5, "font": {"size": 13, "color": "#555"}}]}


def heat(z, x, y, *, colorscale, zmin, zmax, hover, xaxis="x", yaxis="y", showscale=True, colorbar=None,
          customdata=None, gaps: bool = False) -> dict:
    """A heatmap trace; NaN cells are gaps (the grey plot background), hoverable and clickable if `gaps`."""
    # thin white gaps between cells make small maps easier to read, but plotly then draws every cell
    # as its own SVG path; past GAP_CELLS it draws one image instead (a Step stays fast)
    gap = 0.5 if len(x) * len(y) <= GAP_CELLS else 0
    trace = {"type": "heatmap", "z": typed(z), "x": list(x), "y": list(y), "colorscale": colorscale, "zmin": float(zmin),
             "zmax": float(zmax), "hovertemplate": hover + "<extra></extra>", "xaxis": xaxis, "yaxis": yaxis,
             "showscale": showscale, "hoverongaps": gaps, "xgap": gap, "ygap": gap}
    if colorbar:
        trace["colorbar"] = colorbar
    if customdata is not None:
        trace["customdata"] = customdata
    return trace


def _gap_notes(w: np.ndarray, trace, layers: list[int], site: int) -> list[list[str]]:
    """Per cell of w [S, layer]: '' or why there is no weight (the hover text of a gap): a block not sealed
    yet there, or a layer whose mix is not in the trace (`why_no_mix`)."""
    empty = ~np.isfinite(w).any(axis=0)
    notes = [f"<br>{why_no_mix(trace, i, site)}" if e else GAP_NOTE for i, e in zip(layers, empty, strict=True)]
    return [[notes[c] if not np.isfinite(v) else "" for c, v in enumerate(row)] for row in w]


def _block_lines(w: np.ndarray, xref: str, yref: str) -> list[dict]:
    """Dashed lines before each column of `w` [S, X] where more sources exist than in the previous one."""
    present = np.isfinite(w).sum(axis=0)
    return [{"type": "line", "xref": xref, "yref": yref, "x0": c - 0.5, "x1": c - 0.5, "y0": 0, "y1": 1,
             "line": {"color": "white", "width": 1.5, "dash": "dash"}}
            for c in np.flatnonzero(np.diff(present) > 0) + 1]


def block_token(trace, t: int, layer: int | None = None, tokenizer=None) -> tuple[list, dict]:
    """Token t: softmax weight of every source at both sites of every layer (x = layer), and the final mix.

    Grey: that block is not sealed yet at that layer. Dashed: a new block appears (per site: the one
    before attention sees a block one layer later than the one before the FFN of a boundary layer).
    """
    w = trace.attn_res_weights()[t]  # [L, site, S]
    final = np.asarray(trace.final_attn_res_weights()[t], dtype=float)  # [S]
    sources, layers = list(trace.source_labels()), layer_labels(trace)
    ids = [int(i) for i in trace.layer_ids]
    sel = layers[ids.index(layer)] if layer in ids else None
    data, shapes = [], []
    for site, (xa, ya) in enumerate((("x", "y"), ("x2", "y2"))):
        data.append(heat(w[:, site, :].T, layers, sources, colorscale="Viridis", zmin=0, zmax=1,
                          hover="layer %{x}, " + SITE_NAMES[site] + "<br>source: %{y}<br>weight: %{z:.4f}%{customdata}",
                          customdata=_gap_notes(w[:, site, :].T, trace, ids, site), gaps=True, xaxis=xa, yaxis=ya,
                          showscale=site == 0,
                          colorbar={"title": {"text": "softmax weight"}, "len": 0.9, "x": 1.0}))
        shapes += _block_lines(w[:, site, :].T, xa, ya + " domain")
        if layer is not None and layer in trace.layer_ids:
            shapes.append(outline(list(trace.layer_ids).index(layer), xa, ya + " domain"))
    data.append(heat(final[:, None], ["output"], sources, colorscale="Viridis", zmin=0, zmax=1, xaxis="x3", yaxis="y3",
                      hover="final output mix (final.attn_res)<br>source: %{y}<br>weight: %{z:.4f}", showscale=False))
    label = trace_labels(trace, tokenizer)[t]
    axis_y = source_axis(sources)
    layout = {"title": {"text": f"Block attention residuals of token {label}  (click a layer to select it)", "font": FONT},
              "xaxis": {**layer_axis(layers, "", sel), "domain": [0, 0.9], "anchor": "y", "showticklabels": False},
              "yaxis": {**axis_y, "domain": [1 - PANEL, 1], "title": {"text": "before attn", "font": {"size": 10}}},
              "xaxis2": {**layer_axis(layers, "layer", sel), "domain": [0, 0.9], "anchor": "y2"},
              "yaxis2": {**axis_y, "domain": [0, PANEL], "title": {"text": "before FFN", "font": {"size": 10}}},
              "xaxis3": heat_axis(domain=[0.92, 0.96], anchor="y3", fixedrange=True),
              "yaxis3": {**axis_y, "domain": [0, PANEL], "anchor": "x3", "showticklabels": False},
              "shapes": shapes, "plot_bgcolor": GAP_COLOR, "margin": {"l": 80, "r": 20, "t": 30, "b": 70},
              "min_height": panels_height(len(sources), 100)}
    return data, layout


def block_layer(trace, layer: int, t: int, tokenizer=None) -> tuple[list, dict]:
    """Layer `layer`: softmax weight of every source at both sites, token by token (x = token)."""
    j = list(trace.layer_ids).index(layer)
    w = trace.attn_res_weights()[:, j]  # [T, site, S]
    sources, toks = list(trace.source_labels()), trace_labels(trace, tokenizer)
    data, notes, shapes = [], [], []
    for site, (xa, ya) in enumerate((("x", "y"), ("x2", "y2"))):
        data.append(heat(w[:, site, :].T, toks, sources, colorscale="Viridis", zmin=0, zmax=1, xaxis=xa, yaxis=ya,
                          hover="token %{x}, layer " + f"{layer}, {SITE_NAMES[site]}"
                          + "<br>source: %{y}<br>weight: %{z:.4f}%{customdata}",
                          customdata=_gap_notes(w[:, site, :].T, trace, [layer] * len(toks), site),
                          gaps=True, showscale=False))  # the colour bar of the per-token map above: same scale
        shapes.append(outline(t, xa, ya + " domain"))
        if not np.isfinite(w[:, site]).any():
            notes.append({"text": why_no_mix(trace, layer, site), "showarrow": False,
                          "xref": xa + " domain", "yref": ya + " domain", "x": 0.5, "y": 0.5, "font": {"color": "#555"}})
    axis_y = source_axis(sources)
    axis_x = token_axis(trace, t, tokenizer)
    layout = {"title": {"text": f"Block attention residuals at layer {layer}, token by token  (click a token; "
                        "softmax weight on the colour scale above)", "font": FONT},
              "xaxis": {**axis_x, "anchor": "y", "showticklabels": False, "title": None, "matches": "x2"},
              "yaxis": {**axis_y, "domain": [1 - PANEL, 1], "title": {"text": "before attn", "font": {"size": 10}}},
              "xaxis2": {**axis_x, "anchor": "y2"},
              "yaxis2": {**axis_y, "domain": [0, PANEL], "title": {"text": "before FFN", "font": {"size": 10}}},
              "shapes": shapes, "annotations": notes, "dragmode": "pan", "plot_bgcolor": GAP_COLOR,
              "margin": {"l": 80, "r": 20, "t": 30, "b": 80}, "min_height": panels_height(len(sources), 110)}
    return data, layout


def kda_vmax(trace) -> float:
    """One colour scale for every KDA view of a tab: the largest state norm recorded so far."""
    norms, _ = trace.kda_state_norms()
    finite = np.asarray(norms, dtype=float)
    return float(np.nanmax(finite)) if finite.size and np.isfinite(finite).any() else 1.0


def kda_token(trace, t: int, layer: int | None = None, tokenizer=None, vmax=None) -> tuple[list, dict]:
    """Token t: ‖S‖ of every head of every KDA layer after that token (x = KDA layer, y = head)."""
    norms, ids = trace.kda_state_norms()
    ids = [int(i) for i in ids]
    d = np.asarray(norms[t], dtype=float)  # [kda_layer, H]
    labels = layer_labels(trace, ids)
    vmax = kda_vmax(trace) if vmax is None else vmax
    data = [heat(d.T, labels, [str(h) for h in range(d.shape[1])], colorscale=NORM_SCALE, zmin=0, zmax=vmax,
                  hover="layer %{x}, head %{y}<br>‖S‖ = %{z:.4f}", colorbar={"title": {"text": "‖S‖"}})]
    shapes = [outline(ids.index(layer))] if layer in ids else []
    label = trace_labels(trace, tokenizer)[t]
    left_out = [int(i) for i in trace.kda_layers if int(i) not in ids]
    note = f"; not recorded: KDA layers {left_out}" if left_out else ""
    layout = {"title": {"text": f"KDA recurrent-state norm per head after token {label}  (click a layer){note}",
                        "font": FONT},
              "xaxis": layer_axis(labels, "KDA layer", labels[ids.index(layer)] if layer in ids else None),
              "yaxis": heat_axis(title={"text": "head"}, fixedrange=True),
              "shapes": shapes, "margin": {"l": 50, "r": 20, "t": 30, "b": 70}}
    return data, layout


def kda_layer(trace, layer: int, t: int, tokenizer=None, vmax=None) -> tuple[list, dict]:
    """KDA layer `layer`: ‖S‖ of every head, token by token (x = token, y = head)."""
    norms, ids = trace.kda_state_norms()
    ids = [int(i) for i in ids]
    if layer not in trace.kda_layers:  # the model's kinds: a KDA layer the recorder left out is not an MLA layer
        return empty(f"layer {layer} is an MLA layer: it keeps a K/V cache, not a recurrent state. "
                     "Pick a KDA layer to see its heads.")
    if layer not in ids:
        return empty(f"KDA layer {layer}: layers.{layer}.kda.state was not recorded (the session's Recorder "
                     "names_filter left it out)")
    d = np.asarray(norms[:, ids.index(layer)], dtype=float)  # [T, H]
    vmax = kda_vmax(trace) if vmax is None else vmax
    toks = trace_labels(trace, tokenizer)
    data = [heat(d.T, toks, [str(h) for h in range(d.shape[1])], colorscale=NORM_SCALE, zmin=0, zmax=vmax,
                  hover="token %{x}, layer " + str(layer) + ", head %{y}<br>‖S‖ = %{z:.4f}", showscale=False)]
    layout = {"title": {"text": f"KDA layer {layer}: state norm per head, token by token  (same colour scale)",
                        "font": FONT},
              "xaxis": token_axis(trace, t, tokenizer),
              "yaxis": heat_axis(title={"text": "head"}, fixedrange=True),
              "shapes": [outline(t)], "dragmode": "pan", "margin": {"l": 50, "r": 20, "t": 30, "b": 80}}
    return data, layout
