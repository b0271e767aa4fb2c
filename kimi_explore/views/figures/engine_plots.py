"""The view of `ke.compare`: where another engine parts from the model, layer by layer and site by site.

    divergence_heatmap(cmp)    rows = layers (and one row for the global sites), columns = site kinds in
                               firing order; colour = log10(worst relative error over tokens / rtol, the
                               column's kind's where the tolerance gives it one):
                               red cells are beyond tolerance, blue ones within, grey = not compared.
                               "L" marks a local site (its operation disagrees on the other engine's
                               inputs); the black frame is the first divergence.
    report_figures(cmp)        [(section, stem, caption, figure)] for `write_report(..., comparison=cmp)`

Same conventions as `plots`: object-oriented matplotlib, no pyplot, `InlineFigure`s.
"""

from __future__ import annotations

import numpy as np
from matplotlib.patches import Rectangle

from ...engines.tolerance import IDS_SITE
from .mpl import InlineFigure, heatmap, span_inches

__all__ = ["divergence_heatmap", "divergence_grid", "report_figures"]

GLOBAL_ROW = "global"
DECADES = 3.0  # the colour scale spans rtol * 10^-3 .. rtol * 10^3


def divergence_grid(cmp, value: str = "rel"):
    """(rows [labels], cols [site kinds], M [rows, cols] worst `value` over tokens, local [rows, cols] bool).
    M is inf for a NaN and for top-k ids that differ at some token (beyond tolerance whatever the rtol).

    value: "rel" (the other engine against kimi_explore) or "local_rel" (kimi_explore's operation on the
    other engine's inputs against the other engine). Per-layer sites fill the layer rows; "embed",
    "final.*" and "logits" fill the last row, "global".
    """
    sites = list(cmp.sites.values())
    layers = sorted({s.layer for s in sites if s.layer is not None})
    has_global = any(s.layer is None for s in sites)
    rows = [str(i) for i in layers] + ([GLOBAL_ROW] if has_global else [])
    cols = []
    for s in sites:
        if s.layer is not None and s.kind not in cols:
            cols.append(s.kind)
    cols += [s.kind for s in sites if s.layer is None]
    M = np.full((len(rows), len(cols)), np.nan)
    local = np.zeros(M.shape, bool)
    for s in sites:
        r = rows.index(GLOBAL_ROW if s.layer is None else str(s.layer))
        c = cols.index(s.kind)
        rtol = cmp.rtol_of(s)
        v, over = (s.rel, s.beyond(rtol)) if value == "rel" else (s.tested_local_rel(), s.local_beyond(rtol))
        # a NaN, or a top-k set with one id off (beyond whatever the rtol), is the worst colour; no row tested: grey
        if v is not None and v.size:
            M[r, c] = np.inf if np.isnan(v).any() or (over.any() and s.kind == IDS_SITE) else float(np.max(v))
        local[r, c] = bool(s.is_local(rtol))
    return rows, cols, M, local


def divergence_heatmap(cmp, ax=None, value: str = "rel"):
    """The layer x site view of a `Comparison` (see the module docstring). Returns the Figure."""
    rows, cols, M, local = divergence_grid(cmp, value)
    rtol = np.array([cmp.tolerance.for_kind(c).rtol for c in cols])  # each column's kind's
    with np.errstate(divide="ignore"):
        shown = np.clip(np.log10(np.where(np.isfinite(M), M / rtol, 10.0 ** DECADES)), -DECADES, DECADES)
    shown[np.isnan(M)] = np.nan
    if ax is None:
        fig = InlineFigure(figsize=(span_inches(len(cols), 0.34, 8, 18), span_inches(len(rows), 0.3, 4, 14)),
                           layout="constrained")
        ax = fig.subplots()
    else:
        fig = ax.figure
    im = heatmap(ax, shown, rows=rows, cols=cols, cmap="RdBu_r", vmin=-DECADES, vmax=DECADES, annotate=False)
    ax.tick_params(axis="x", labelrotation=70, labelsize=7)
    ax.set_ylabel("layer")
    for r, c in zip(*np.nonzero(local), strict=True):
        ax.text(c, r, "L", ha="center", va="center", fontsize=7, fontweight="bold", color="black", in_layout=False)
    first = cmp.first
    if first is not None:
        r = rows.index(GLOBAL_ROW if first.layer is None else str(first.layer))
        c = cols.index(first.site.split(".", 2)[2] if first.layer is not None else first.site)
        ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2.2))
    bar = fig.colorbar(im, ax=ax, shrink=0.8)
    per = f"rtol {cmp.rtol:g}" if not cmp.tolerance.kinds else "its kind's rtol"
    bar.set_label(f"log10({'local ' if value == 'local_rel' else ''}relative error / {per})")
    what = "no site beyond tolerance" if first is None else (
        f"first divergence: token {first.token}, {first.site}, {first.verdict}")
    ax.set_title(f"{cmp.engine or 'other engine'} vs kimi_explore ({cmp.tolerance}): {what}", fontsize=9)
    return fig


def report_figures(cmp) -> list:
    """[(section, stem, caption, figure)]: the comparison's heatmaps for the offline report."""
    section = f"Comparison with {cmp.engine or 'another engine'}"
    first = cmp.first
    caption = ("Worst relative error over tokens at each site, in units of the tolerance (red: beyond). "
               "L: a local site. Frame: the first divergence" + (f" ({first})." if first is not None else "; there is none."))
    figs = [(section, "engine_divergence", caption, divergence_heatmap(cmp))]
    if any(s.local_rel is not None for s in cmp.sites.values()):
        figs.append((section, "engine_local", "kimi_explore's operation at each site run on the other engine's inputs "
                     "(teacher-forced): what remains is the operation's own disagreement.",
                     divergence_heatmap(cmp, value="local_rel")))
    return figs
