"""The analyses inside the Explorer, as plotly.js specs (see `specs.py` for the conventions).

    lens_strip(lens, labels, tokenizer, layer)   the selected token's logit lens (`ke.logit_lens`, one
                                                 position): after each layer, its top-1 next token in
                                                 the cell, coloured by its probability
    waterfall(attr, tokenizer, top)              `ke.logit_attribution` of one token: the largest leaves
                                                 (embedding, attention / FFN outputs, experts) from 0 up
                                                 to the logit; a click on a layer's leaf selects the layer
    run_diff(d, t0, tokenizer)                   `ke.diff(original, fork)` from the token where the fork
                                                 starts: per-token KL strip, Δ output-mix weights, and
                                                 the number of MoE layers whose top-k set changed

Each returns (data, layout); the hover of every cell or bar gives the exact number it shows.
"""

from __future__ import annotations

import re

import numpy as np

from ..common import token_labels, token_texts
from .specs import FONT, WINDOW, heat, layer_axis, layer_ticks, outline, token_window

__all__ = ["leaf_layer", "lens_strip", "run_diff", "waterfall"]

_LAYER = re.compile(r"^layers\.(\d+)\.")
# explicit scales: plotly.js's own "RdBu" runs blue (low) -> grey -> red (high) and its "Greys" black (low) ->
# white (high), so a name alone read the sign or the count backwards
DIVERGING = [[0.0, "#2166ac"], [0.25, "#67a9cf"], [0.5, "#ffffff"], [0.75, "#ef8a62"], [1.0, "#b2182b"]]  # blue < 0 < red
COUNT_SCALE = [[0.0, "#ffffff"], [1.0, "#252525"]]  # white = none, dark = many


def leaf_layer(leaf: str) -> int | None:
    """The layer an attribution leaf belongs to ('layers.12.moe.experts.3' -> 12), None for the embedding."""
    m = _LAYER.match(str(leaf))
    return int(m.group(1)) if m else None


def _short(label: str) -> str:
    """A token label for a narrow cell: `<0x80>` (a byte that is not text alone) as `x80`, a space as ␣."""
    if label.startswith("<0x") and label.endswith(">"):
        return "x" + label[3:-1]
    return label.replace(" ", "␣")  # a space must be seen


CELL_CHARS = 4  # characters of a top-1 written in a lens cell at K3 depth (3 cells of ~10 px: 4 at 10 px)


def _fit(text: str, n: int = CELL_CHARS) -> str:
    """`text` cut to n characters, the last one an ellipsis when it was longer."""
    return text if len(text) <= n else text[: n - 1] + "…"


def lens_strip(lens, labels: list[str], tokenizer=None, layer: int | None = None) -> tuple[list, dict]:
    """Row 0 of `lens` (one position): x = layer, colour = top-1 probability, text = top-1 token.
    A cell whose top-1 already equals the model's final top-1 is marked with a ring. Past 32 layers (K3's
    93: ~10 px a cell) the top-1 is written only in the cells of the layers the axis names (`layer_ticks`:
    at least MIN_TICK_GAP cells apart), cut to CELL_CHARS characters; the hover of every cell has it all."""
    ids, probs = np.asarray(lens.top_ids[0]), np.asarray(lens.top_probs[0], dtype=float)  # [L, k]
    L, k = ids.shape
    final = int(lens.final_ids[0])
    ids_sel = [int(i) for i in lens.layers]
    selected = labels[ids_sel.index(layer)] if layer in ids_sel else None
    names = [token_labels(ids[j], tokenizer, positions=False) for j in range(L)]
    written = set(labels) if L <= 32 else set(layer_ticks(labels, selected))
    cell = (lambda x: x) if L <= 32 else _fit
    text = [[cell(_short(token_texts(ids[j, :1], tokenizer)[0])) if labels[j] in written else "" for j in range(L)]]
    hover = [["<br>".join(f"{n} p={p:.4f}" for n, p in zip(names[j], probs[j], strict=True)) for j in range(L)]]
    hm = heat(probs[None, :, 0], labels, ["top-1"], colorscale="Viridis", zmin=0, zmax=1,
              hover="after layer %{x}<br>%{customdata}", customdata=hover, colorbar={"title": {"text": "p"}, "len": 1.2})
    hm.update(text=text, texttemplate="%{text}", textfont={"size": 10})
    same = [labels[j] for j in range(L) if ids[j, 0] == final]
    ring = {"type": "scatter", "mode": "markers", "x": same, "y": ["top-1"] * len(same), "hoverinfo": "skip",
            "marker": {"symbol": "circle-open", "size": 26, "color": "#ff7f0e", "line": {"width": 2}}}
    t = int(lens.positions[0])
    fed = token_labels([int(lens.tokens[0])], tokenizer, positions=False)[0]
    fin = token_labels([final], tokenizer, positions=False)[0]
    shapes = [outline(ids_sel.index(layer))] if layer in ids_sel else []
    thinned = "" if L <= 32 else "; written at the named layers, hover any cell"
    layout = {"title": {"text": f"Logit lens of token {t} {fed}: top-1 next token after each layer "
                        f"(ring: already the model's own top-1, {fin}{thinned})", "font": FONT},
              # past 32 layers (K3) the selected layer and the MLA landmarks are named, as on every layer axis
              "xaxis": {"tickangle": -60, **layer_axis(labels, "", selected), "title": None},
              "yaxis": {"type": "category", "fixedrange": True, "showticklabels": False},
              "showlegend": False, "shapes": shapes, "margin": {"l": 20, "r": 20, "t": 30, "b": 60}}
    return [hm, ring], layout


def waterfall(attr, tokenizer=None, top: int = 14) -> tuple[list, dict]:
    """`attr` (an Attribution) as a horizontal waterfall: the `top` largest leaves by |value|, the
    rest as one bar, then the logit as the total. customdata: each bar's layer (-1: none)."""
    items = list(attr.contributions.items())[:top]
    rest = list(attr.contributions.values())[top:]
    if rest:
        items.append((f"other leaves ({len(rest)})", float(sum(rest))))  # no leading number: not a layer
    labels = [name for name, _ in items] + ["logit"]
    values = [float(v) for _, v in items] + [float(attr.logit)]
    layers = [leaf_layer(name) if leaf_layer(name) is not None else -1 for name, _ in items] + [-1]
    source = [attr.source_of.get(name, "") for name, _ in items] + [""]
    bar = {"type": "waterfall", "orientation": "h", "y": labels, "x": values,
           "measure": ["relative"] * len(items) + ["total"], "customdata": [[ly, s] for ly, s in zip(layers, source,
                                                                                                   strict=True)],
           "increasing": {"marker": {"color": "#b2182b"}}, "decreasing": {"marker": {"color": "#2166ac"}},
           "totals": {"marker": {"color": "#444444"}}, "connector": {"line": {"color": "#bbbbbb", "width": 1}},
           "texttemplate": "%{x:+.3f}", "textposition": "outside", "cliponaxis": False, "textfont": {"size": 9},
           "hovertemplate": "%{y}<br>contribution %{x:+.4f}<br>through the output mix's %{customdata[1]}"
                            "<extra></extra>"}
    name = token_labels([attr.token], tokenizer, positions=False)[0]
    layout = {"title": {"text": f"Direct logit attribution of {name} after token {attr.t}: logit {attr.logit:.3f} "
                        "(red up, blue down; click a leaf to select its layer)", "font": FONT},
              "xaxis": {"title": {"text": "contribution to the logit (frozen final norm)"}, "fixedrange": True,
                        "zeroline": True},
              "yaxis": {"type": "category", "autorange": "reversed", "fixedrange": True, "tickfont": {"size": 9}},
              "showlegend": False, "margin": {"l": 170, "r": 40, "t": 30, "b": 40}}
    return [bar], layout


def run_diff(d, t0: int, tokenizer=None, t: int | None = None) -> tuple[list, dict]:
    """`d` = ke.diff(original, fork) from token t0 on: three strips over the tokens (x), top to bottom:
    KL(original ‖ fork) of the next-token distributions, the Δ output-mix weight of every source
    (fork - original, diverging, white = no change), and how many MoE layers chose another top-k set."""
    T = len(d)
    cols = token_labels(d.tokens_a, tokenizer)[t0:T]
    kl = np.asarray(d.kl[t0:T], dtype=float)
    dw = np.asarray(d.final_attn_res[t0:T], dtype=float).T  # [S, T']
    changed = np.zeros(T - t0, np.int32)
    for tok, *_ in d.routing_changes:
        if tok >= t0:
            changed[tok - t0] += 1
    half = float(np.nanmax(np.abs(dw))) if dw.size and np.isfinite(dw).any() else 0.0
    half = max(half, 1e-9)
    data = [
        heat(kl[None], cols, ["KL"], colorscale="Cividis", zmin=0, zmax=max(float(kl.max(initial=0)), 1e-9),
             hover="token %{x}<br>KL(original ‖ fork) = %{z:.4g} nats", colorbar={"title": {"text": "KL"}, "len": 0.3,
                                                                                  "y": 0.87, "nticks": 3}),
        heat(dw, cols, list(d.source_labels), colorscale=DIVERGING, zmin=-half, zmax=half, xaxis="x2", yaxis="y2",
             hover="token %{x}, source %{y}<br>Δ output-mix weight %{z:+.4g}",
             colorbar={"title": {"text": "Δ weight"}, "len": 0.4, "y": 0.45, "nticks": 4}),
        heat(changed[None].astype(np.float32), cols, ["routing"], colorscale=COUNT_SCALE, zmin=0,
             zmax=max(1, int(changed.max(initial=0))), xaxis="x3", yaxis="y3",
             hover="token %{x}<br>%{z} MoE layers chose another top-k set", showscale=False),
    ]
    flips = [c for c, f in zip(cols, d.flips[t0:T], strict=True) if f]
    data.append({"type": "scatter", "mode": "markers", "x": flips, "y": ["KL"] * len(flips), "hoverinfo": "skip",
                 "marker": {"symbol": "x", "size": 9, "color": "#111"}})
    # past WINDOW tokens, a window of them that shows the selected one, as every view over tokens (pan to
    # scroll): an ablation of every token of a long history would squeeze hundreds of columns into the width
    windowed = T - t0 > WINDOW
    ax = {"type": "category", "tickfont": {"size": 9}, "tickangle": -60, "matches": "x"}
    if windowed:
        ax["range"] = token_window(T - t0, (T - 1 if t is None or not t0 <= t < T else t) - t0)
    pan = f"; {WINDOW} of {T - t0} tokens, pan to scroll" if windowed else ""
    layout = {"title": {"text": f"What the fork changed from token {t0} on: KL strip (x: the top-1 flipped), "
                        f"Δ output-mix weights, routing changes ({len(d.routing_changes)}){pan}", "font": FONT},
              "xaxis": {**ax, "anchor": "y", "showticklabels": False, "matches": None},
              "yaxis": {"domain": [0.8, 0.95], "fixedrange": True},
              "xaxis2": {**ax, "anchor": "y2", "showticklabels": False},
              "yaxis2": {"domain": [0.22, 0.74], "fixedrange": True, "autorange": "reversed", "tickfont": {"size": 9}},
              "xaxis3": {**ax, "anchor": "y3"},
              "yaxis3": {"domain": [0.05, 0.16], "fixedrange": True},
              "showlegend": False, "dragmode": "pan", "margin": {"l": 80, "r": 20, "t": 30, "b": 70},
              "shapes": [] if t is None or not t0 <= t < T else
              [outline(t - t0, "x", "y domain"), outline(t - t0, "x2", "y2 domain"), outline(t - t0, "x3", "y3 domain")]}
    return data, layout
