"""Interactive MoE-routing and prediction figures (plotly.js specs; see `specs.py` for the conventions).

At K3's 92 MoE layers x 896 experts a score map is unreadable, so the tab leads with summaries
(`summaries.py`): the top-k table (expert ids in the cells; a `*` marks an expert chosen only through
the selection bias), per-layer routing entropy and load statistics, and each layer's expert counts
sorted. The full layer x expert score map is there for whoever zooms into it.
"""

from __future__ import annotations

import numpy as np

from ..common import no_predictions, softmax, token_labels
from . import specs
from .plotly_view import typed
from .specs import FONT, SELECT, heat, layer_labels, outline, trace_labels

__all__ = ["compare", "expert_search", "moe_full", "moe_layers", "moe_sorted", "moe_top_experts", "moe_topk",
           "predictions", "ROWS", "TOP_N"]

ROWS = 24  # MoE layers shown at once in the tall views (pan to scroll)
TOP_N = 8  # experts named per layer in the top-by-load view
# the tables' expert ids (each heatmap's `text`), written into the cells by the view itself: plotly's
# own texttemplate costs ~25 ms a redraw for the 24 x 16 top-k table (`plotly_view`: cell labels)
CELL_TEXT = {"traces": [0], "size": 10}
COLORWAY = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")  # plotly's first colours: the per-layer rows, in order


def _row_window(n: int, j: int | None, rows: int = ROWS) -> list[float] | None:
    """y range (category units, top row first) of `rows` rows around row j; None when all fit."""
    if n <= rows:
        return None
    j = 0 if j is None else j
    lo = min(max(0, j - rows // 2), n - rows)
    return [lo + rows - 0.5, lo - 0.5]


def _uint(a: np.ndarray):
    """The smallest unsigned dtype holding the non-negative ints of `a` (what a typed array sends)."""
    top = int(a.max()) if a.size else 0
    return np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.uint32


def _row_outline(j: int) -> dict:
    return {"type": "rect", "xref": "x domain", "yref": "y", "x0": 0, "x1": 1, "y0": j - 0.5, "y1": j + 0.5,
            "line": {"color": SELECT, "width": 2}, "fillcolor": "rgba(0,0,0,0)", "layer": "above"}


def _y_layers(labels: list[str], j: int | None) -> dict:
    axis = specs.heat_axis(title={"text": "MoE layer"})
    window = _row_window(len(labels), j)
    if window is None:
        axis["autorange"] = "reversed"
        axis["fixedrange"] = True
    else:
        axis["range"] = window
    return axis


def moe_topk(table: dict, trace, layer: int | None, tokenizer=None, t: int = 0) -> tuple[list, dict]:
    """Token t at every MoE layer: its k experts by unbiased score (cell text = expert id, colour = weight)."""
    ids, w, layers = table["ids"], table["weights"], table["moe_layers"]
    M, k = ids.shape
    labels = layer_labels(trace, layers)
    j_sel = layers.index(layer) if layer in layers else None
    window = _row_window(M, j_sel)
    rows_shown = range(M) if window is None else range(round(window[1] + 0.5), round(window[0] + 0.5))
    text, hover = [], []
    for j in rows_shown:  # only the rows on screen are sent: plotly lays out every cell's text, seen or not
        out = table["displaced"][j]
        gone = ", ".join(f"{e} ({s:.4f})" for e, s in out[:4]) + (f" and {len(out) - 4} more" if len(out) > 4 else "")
        row_t, row_h = [], []
        for c in range(k):
            e = int(ids[j, c])
            if e < 0:
                row_t.append("")
                row_h.append(f"layer {labels[j]}, slot {c + 1}: no expert ("
                             + ("ablated)" if c < table["k"] else "padding: another token was routed to more experts)"))
                continue
            star, forced = bool(table["by_bias"][j, c]), bool(table["forced"][j, c])
            bias = table["bias"][j, c]
            row_t.append(f"{e}*" if star else f"{e}\u2020" if forced else str(e))
            row_h.append(
                f"layer {labels[j]}, expert <b>{e}</b> (chosen, slot {c + 1})<br>combine weight {w[j, c]:.4f}<br>"
                f"unbiased score {table['scores'][j, c]:.4f} (rank {table['rank'][j, c]} of all experts)"
                + (f"<br>selection bias {bias:+.4f}" if np.isfinite(bias) else "")
                + (("<br><b>chosen only through the bias</b>" if table["bias_known"][j] else
                     "<br><b>outside the unbiased top-k</b> (the bias or a hook: the bias is not known here)")
                    if star else "")
                + ("<br><b>chosen by a hook</b>, outside the router's own top-k" if forced else "")
                + (f"<br>bias pushed out: {gone}" if gone else ""))
        text.append(row_t)
        hover.append(row_h)
    shown = np.where(ids >= 0, w, np.nan)[list(rows_shown)]
    lo, hi = (float(np.nanmin(shown)), float(np.nanmax(shown))) if np.isfinite(shown).any() else (0.0, 1.0)
    # the weights' own range: at top-16 they sit near 1/16, and a scale from 0 would paint them all alike
    # green, not red: the selected row's red outline must stand out from the scale (the view writes the
    # expert ids in white or grey, whichever contrasts with the cell, as plotly would)
    hm = heat(shown, [str(c + 1) for c in range(k)], [labels[j] for j in rows_shown], colorscale="Greens", zmin=lo,
              zmax=max(hi, lo + 1e-9),
              hover="%{customdata}", customdata=hover, colorbar={"title": {"text": "combine weight"}})
    hm.update(text=text, reversescale=True,  # plotly's Greens: dark = low
              xgap=0, ygap=0)  # gaps would make plotly draw cell by cell
    n_bias, n_forced = int(table["by_bias"].sum()), int(table["forced"].sum())
    label = trace_labels(trace, tokenizer)[t]
    rows = "" if window is None else (f"; MoE layers {labels[rows_shown[0]].split()[0]}-{labels[rows_shown[-1]].split()[0]}"
                                      f" of {M} (the layer menu moves this window)")
    forced = f"; \u2020 = chosen by a hook ({n_forced})" if n_forced else ""
    star = "chosen only through the bias" if all(table["bias_known"]) else "outside the unbiased top-k (bias or hook)"
    layout = {"title": {"text": f"Experts of token {label}; * = {star} ({n_bias}){forced}{rows}",
                        "font": FONT},
              "xaxis": specs.heat_axis(title={"text": "slot"}, fixedrange=True),
              "yaxis": _y_layers([labels[j] for j in rows_shown], None),
              "shapes": [_row_outline(j_sel - rows_shown[0])] if j_sel in rows_shown else [],
              "cell_text": CELL_TEXT, "margin": {"l": 70, "r": 10, "t": 30, "b": 40}}
    return [hm], layout


def moe_layers(entropy: np.ndarray, stats: dict, trace, layers: list[int], layer: int | None, k: int) -> tuple[list, dict]:
    """Per MoE layer: routing entropy of the selected token; over the tokens so far: max/mean, CV, dead experts."""
    labels = layer_labels(trace, layers)
    rows = [("entropy", entropy, f"routing entropy %{{y:.3f}} bits (max log2 {k} = {np.log2(k):.2f})"),
            ("max/mean", stats["max_over_mean"], "max/mean load %{y:.2f} (1 = balanced)"),
            ("CV", stats["cv"], "load coefficient of variation %{y:.3f}")]
    # "never chosen" counts mean something only once every expert could have been chosen: T*k >= E
    dead_ok = stats["tokens"] * k >= stats["experts"]
    if dead_ok:
        rows.append(("dead", stats["dead"], f"%{{y}} of {stats['experts']} experts never chosen"))
    dead_note = "" if dead_ok else (f"<br><sub>no dead-expert count until {-(-stats['experts'] // k)} tokens: "
                                    f"{stats['tokens']}x{k} choices < {stats['experts']} experts</sub>")
    data, layout = [], {"margin": {"l": 70, "r": 10, "t": 44 if dead_note else 30, "b": 70}, "showlegend": False,
                        "title": {"text": f"Per MoE layer: this token's routing entropy (bits); load over "
                                  f"{stats['tokens']} tokens{dead_note}", "font": FONT}}
    gap = 0.04
    h = (1 - gap * (len(rows) - 1)) / len(rows)
    alone = []  # points a line cannot show (no finite neighbour), drawn as markers after the lines
    # one x axis for every row (the layers; labelled under the last row): plotly draws one axis, not one per row
    bottom = "y" + (str(len(rows)) if len(rows) > 1 else "")
    layout["xaxis"] = {"type": "category", "anchor": bottom, "fixedrange": True, "tickfont": {"size": 9},
                       "range": [-0.5, len(labels) - 0.5]}  # a whole slot per layer, the end ones too
    if len(labels) > 32:
        ticks = specs.layer_ticks(labels, labels[layers.index(layer)] if layer in layers else None)
        layout["xaxis"].update(tickmode="array", tickvals=ticks, ticktext=ticks, tickangle=-60)
    for r, (name, y, hover) in enumerate(rows):
        ax = "" if r == 0 else str(r + 1)
        y = np.asarray(y, float)
        # lines, no markers: plotly draws each marker as its own SVG path (4 x 92 of them at K3, ~10 ms of
        # every Step); the line has a vertex at every layer and the hover reads each one as before
        trace = {"type": "scatter", "mode": "lines", "x": labels, "y": typed(y), "xaxis": "x", "yaxis": "y" + ax,
                 "line": {"width": 1.5, "color": COLORWAY[r]}, "hovertemplate": "layer %{x}<br>" + hover + "<extra></extra>"}
        data.append(trace)
        ok = np.isfinite(y)
        lone = np.flatnonzero(ok & ~np.r_[False, ok[:-1]] & ~np.r_[ok[1:], False])
        if lone.size:
            alone.append({**trace, "mode": "markers", "x": [labels[i] for i in lone], "y": typed(y[lone]),
                          "marker": {"size": 4, "color": COLORWAY[r]}})
        top = 1 - r * (h + gap)
        layout["yaxis" + ax] = {"domain": [top - h, top], "title": {"text": name, "font": {"size": 9}}, "fixedrange": True,
                                "tickfont": {"size": 9}, "anchor": "x", "rangemode": "tozero"}
        if ok.any():  # headroom above the highest value (markers gave it; a bare line would sit on the top edge)
            layout["yaxis" + ax]["range"] = [0, 1.1 * float(np.nanmax(y)) or 1.0]
    layout["shapes"] = [outline(layers.index(layer), "x", "paper")] if layer in layers else []
    return data + alone, layout


def moe_sorted(stats: dict, order: np.ndarray, counts: np.ndarray, trace, layers: list[int], layer: int | None,
               k: int) -> tuple[list, dict]:
    """Each MoE layer's expert counts over the tokens so far, sorted descending (a balanced router: flat rows)."""
    labels = layer_labels(trace, layers)
    # cropped to the widest row of experts that ran: past it every layer's count is 0
    n = max(1, int((counts > 0).sum(axis=1).max()) if counts.size else 1)
    j_sel = layers.index(layer) if layer in layers else None
    hm = heat(counts[:, :n], list(range(1, n + 1)), labels, colorscale="Viridis", zmin=0,
                 zmax=max(1, int(counts.max()) if counts.size else 1), customdata=typed(order[:, :n], _uint(order)),
                 hover="layer %{y}<br>rank %{x}: expert %{customdata}<br>chosen %{z} times",
                 colorbar={"title": {"text": "count"}})
    # the largest payload of a Step (M x n counts and ids, n up to E): counts and ids as the smallest
    # unsigned ints that hold them (1-2 bytes, not 4), so at most 4 x M x E bytes whatever the history
    hm.update(z=typed(counts[:, :n], _uint(counts)), xgap=0, ygap=0)  # no gaps: one image, not cell by cell
    layout = {"title": {"text": f"Expert counts over {stats['tokens']} tokens, sorted; ranks 1-{n} of {counts.shape[1]}"
                                " (no layer used more)",
                        "font": FONT},
              "xaxis": {"title": {"text": "expert rank in its layer"}, "tickfont": {"size": 10}, "showgrid": False},
              "yaxis": _y_layers(labels, j_sel), "shapes": [_row_outline(j_sel)] if j_sel is not None else [],
              "dragmode": "zoom", "margin": {"l": 70, "r": 10, "t": 30, "b": 40}}
    return [hm], layout


def moe_top_experts(counts: np.ndarray, order: np.ndarray, trace, layers: list[int], layer: int | None,
                    tokens: int, n: int = TOP_N) -> tuple[list, dict]:
    """Each MoE layer's `n` busiest experts over the tokens so far: the cell names the expert, the colour
    is how often it was chosen (counts/order: `summaries.sorted_counts`, [M, E] descending)."""
    labels = layer_labels(trace, layers)
    n = min(n, counts.shape[1])
    top_c, top_e = counts[:, :n].astype(np.float32), order[:, :n]
    j_sel = layers.index(layer) if layer in layers else None
    window = _row_window(len(labels), j_sel)
    rows = range(len(labels)) if window is None else range(round(window[1] + 0.5), round(window[0] + 0.5))
    # only the rows on screen are sent: plotly lays out every cell's text, seen or not
    peak = max(1.0, float(top_c.max(initial=0)))  # one scale for every window: the busiest expert of any layer
    top_c, top_e = top_c[list(rows)], top_e[list(rows)]
    text = [[str(int(e)) if c > 0 else "" for e, c in zip(re, rc, strict=True)] for re, rc in zip(top_e, top_c, strict=True)]
    hm = heat(np.where(top_c > 0, top_c, np.nan), [str(r + 1) for r in range(n)], [labels[j] for j in rows],
              colorscale="Blues",
              zmin=0, zmax=peak, customdata=typed(top_e, np.int32),
              hover="layer %{y}, rank %{x}: expert %{customdata}<br>chosen %{z} times", colorbar={"title": {"text": "count"}})
    hm.update(text=text, reversescale=True, xgap=0, ygap=0)
    shown = "" if window is None else f"; layers {labels[round(window[1] + 0.5)].split()[0]}-" \
        f"{labels[round(window[0] - 0.5)].split()[0]} of {len(labels)}"
    layout = {"title": {"text": f"Top {n} experts by load per layer, {tokens} tokens{shown}", "font": FONT},
              "xaxis": specs.heat_axis(title={"text": "rank"}, fixedrange=True),
              "yaxis": _y_layers([labels[j] for j in rows], None),
              "shapes": [_row_outline(j_sel - rows[0])] if j_sel in rows else [],
              "cell_text": CELL_TEXT, "margin": {"l": 70, "r": 10, "t": 30, "b": 40}}
    return [hm], layout


def expert_search(r: dict, expert: int, trace, t: int, layer: int | None, tokenizer=None,
                  counts: np.ndarray | None = None) -> tuple[list, dict]:
    """Where expert `expert` fired: MoE layer x token, the colour its combine weight where it was chosen
    (empty elsewhere). Tokens run along x in the window that follows the selected token; `counts` [M, E]
    (the whole history's, `load_stats`) adds how often it fired in all of it, so a window without it says
    whether to look elsewhere."""
    layers = list(r["moe_layers"])
    labels = layer_labels(trace, layers)
    ids, w = np.asarray(r["topk_ids"]), np.asarray(r["topk_weights"], dtype=np.float32)  # [T, M, k]
    hit = ids == int(expert)
    weight = np.where(hit.any(axis=2), np.where(hit, w, 0).sum(axis=2), np.nan).T  # [M, T]
    n_hits, where = int(hit.sum()), sorted({layers[j] for j in np.nonzero(hit.any(axis=(0, 2)))[0]})
    toks = trace_labels(trace, tokenizer)
    E = r["scores"].shape[2]
    if not 0 <= int(expert) < E:
        return specs.empty(f"expert {expert} does not exist: expert ids run 0..{E - 1}")
    hm = heat(weight, toks, labels, colorscale="Viridis", zmin=0, zmax=max(1e-9, float(np.nanmax(weight)) if n_hits else 1),
              hover="token %{x}, layer %{y}<br>expert " + str(int(expert)) + " chosen, combine weight %{z:.4f}",
              colorbar={"title": {"text": "weight"}})
    hm.update(xgap=0, ygap=0)
    j_sel = layers.index(layer) if layer in layers else None
    start = getattr(trace, "start", 0)  # a window of the history: say which tokens
    span = f"tokens {start}-{start + len(toks) - 1}"
    found = (f"in {span} it fired {n_hits} times at {len(where)} of {len(layers)} MoE layers" if n_hits else
             f"never chosen in {span}")
    if counts is not None:
        col = np.asarray(counts)[:, int(expert)]
        found += f"; in the whole history {int(col.sum())} times at {int((col > 0).sum())} layers"
    layout = {"title": {"text": f"Where expert {int(expert)} fires: {found}", "font": FONT},
              "xaxis": specs.token_axis(trace, t, tokenizer), "yaxis": {**_y_layers(labels, j_sel)},
              "shapes": [outline(t)] + ([_row_outline(j_sel)] if j_sel is not None else []),
              "plot_bgcolor": "#ffffff", "dragmode": "pan", "margin": {"l": 70, "r": 10, "t": 30, "b": 80}}
    return [hm], layout


def moe_full(r: dict, t: int, trace, layer: int | None, bias: dict | None = None, tokenizer=None) -> tuple[list, dict]:
    """Token t: every expert's unbiased score at every MoE layer; chosen experts boxed. Zoom with the mouse."""
    layers = list(r["moe_layers"])
    labels = layer_labels(trace, layers)
    scores = np.asarray(r["scores"][t], dtype=np.float32)  # [M, E]
    M, E = scores.shape
    hover = "layer %{y}, expert %{x}<br>unbiased score %{z:.4f}"
    custom = None
    if bias:
        b = np.stack([np.asarray(bias.get(i, np.full(E, np.nan)), dtype=np.float32) for i in layers])
        custom, hover = typed(b), hover + "<br>selection bias %{customdata:+.4f}"
    hm = heat(scores, list(range(E)), labels, colorscale="Blues", zmin=0, zmax=1, hover=hover + "<br>not chosen",
                 customdata=custom, colorbar={"title": {"text": "score σ(logit)"}})
    hm.update(xgap=0, ygap=0,  # one image, not 82k cells
              reversescale=True)  # plotly's Blues: dark = low; dark = a high score, as in the top-N view beside it
    ids, w = np.asarray(r["topk_ids"][t]), np.asarray(r["topk_weights"][t], dtype=float)
    jj, cc = np.nonzero(ids >= 0)
    chosen = {"type": "scatter", "mode": "markers", "x": typed(ids[jj, cc], np.int32), "y": [labels[j] for j in jj],
              "marker": {"symbol": "square-open", "color": SELECT, "size": 7, "line": {"width": 1.5}},
              "customdata": typed(np.stack([w[jj, cc], scores[jj, ids[jj, cc]]], axis=1)),
              "hovertemplate": "layer %{y}, expert %{x}: <b>chosen</b><br>combine weight %{customdata[0]:.4f}<br>"
                               "unbiased score %{customdata[1]:.4f}<extra></extra>"}
    j_sel = layers.index(layer) if layer in layers else None
    label = trace_labels(trace, tokenizer)[t]
    layout = {"title": {"text": f"All {E} experts x {M} MoE layers for token {label}: drag a box to zoom, double-click "
                        "to reset", "font": FONT},
              "xaxis": {"title": {"text": "expert id"}, "range": [-0.5, E - 0.5], "tickfont": {"size": 10}},
              "int_axes": ["xaxis"],  # zoomed in, the browser keeps ticks on whole expert ids
              "yaxis": {**_y_layers(labels, j_sel), "range": [M - 0.5, -0.5]},
              "shapes": [_row_outline(j_sel)] if j_sel is not None else [], "dragmode": "zoom", "uirevision": "full",
              "showlegend": False, "margin": {"l": 70, "r": 10, "t": 30, "b": 40}}
    return [hm, chosen], layout


def predictions(trace, t: int, tokenizer=None) -> tuple[list, dict]:
    """Top next-token probabilities after token t; the token actually fed next in red."""
    ids = np.asarray(trace["logits.top_ids"][t]).astype(int)
    probs = np.asarray(trace["logits.top_probs"][t], dtype=float)
    if no_predictions(probs):
        return specs.empty(f"No predictions after {trace_labels(trace, tokenizer)[t]}: the logits hold NaN")
    keep = ids >= 0
    ids, probs = ids[keep], probs[keep]
    fed = int(trace.tokens[t + 1]) if t + 1 < len(trace.tokens) else None
    names = [f"{s} ({i})" for s, i in zip(token_labels(ids, tokenizer, positions=False), ids, strict=True)]
    bar = {"type": "bar", "orientation": "h", "x": typed(probs), "y": names,
           "marker": {"color": [SELECT if i == fed else "#4c72b0" for i in ids]},
           "hovertemplate": "next token %{y}<br>p = %{x:.4f}<extra></extra>", "texttemplate": "%{x:.3f}",
           "textposition": "outside", "cliponaxis": False}
    note = "" if fed is None else (" (red: fed next)" if fed in ids else " (the token fed next is not in this top-k)")
    label = trace_labels(trace, tokenizer)[t]
    layout = {"title": {"text": f"Next-token predictions after {label}{note}", "font": FONT},
              "xaxis": {"title": {"text": "probability"}, "range": [0, min(1.0, float(probs.max(initial=0)) * 1.25) or 1],
                        "fixedrange": True},
              "yaxis": {"type": "category", "autorange": "reversed", "fixedrange": True, "tickfont": {"size": 10}},
              "margin": {"l": 110, "r": 30, "t": 30, "b": 40}}
    return [bar], layout


def compare(base_logits, other_logits, tokenizer=None, names=("as run", "ablated"), title: str = "",
            k: int = 10) -> tuple[list, dict, float]:
    """Two next-token distributions side by side over the k tokens most likely under either; returns
    (data, layout, KL)."""
    p, q = softmax(base_logits), softmax(other_logits)
    top = list(dict.fromkeys([*np.argsort(-p)[:k], *np.argsort(-q)[:k]]))
    top.sort(key=lambda i: -max(p[i], q[i]))
    top = top[:k]  # at most k rows: every one keeps its label at the view's height
    labels = [f"{s} ({i})" for s, i in zip(token_labels(top, tokenizer, positions=False), top, strict=True)]
    kl = float(np.sum(p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300)))))
    data = [{"type": "bar", "orientation": "h", "name": name, "x": typed(dist[top]), "y": labels,
             "marker": {"color": color}, "hovertemplate": name + ": %{y}<br>p = %{x:.4f}<extra></extra>"}
            for name, dist, color in ((names[0], p, "#4c72b0"), (names[1], q, SELECT))]
    flipped = int(np.argmax(p)) != int(np.argmax(q))
    layout = {"title": {"text": (title + "<br>" if title else "") + f"KL({names[0]} ‖ {names[1]}) = {kl:.4f}"
                        + ("; top-1 changed" if flipped else "; same top-1"), "font": FONT},
              "barmode": "group", "xaxis": {"title": {"text": "probability"}, "fixedrange": True},
              "yaxis": {"type": "category", "autorange": "reversed", "fixedrange": True, "tickfont": {"size": 10}},
              # inside, bottom right: the rows are sorted, so the smallest bars leave that corner free
              "legend": {"x": 0.99, "xanchor": "right", "y": 0.01, "yanchor": "bottom", "bgcolor": "rgba(255,255,255,0.85)"},
              "margin": {"l": 110, "r": 20, "t": 50, "b": 40}}
    return data, layout, kl
