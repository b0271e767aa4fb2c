"""Figures of `kimi_explore.analysis.source_ablation`: block-residual softmax mass against causal effect (notebook 08).

    mass_vs_effect(res, effect="kl")    left: every (layer, site, family) cell at (mass, effect), coloured by
                                        family, marked by site, labelled with its layer; right: per layer
                                        and site, the mass and the effect of each family side by side as
                                        percentiles among all cells, and their gap (mass - effect)

Pure functions `SourceAblation -> Figure` (object-oriented matplotlib, no pyplot), like `plots`.
"""

from __future__ import annotations

import numpy as np

from .mpl import InlineFigure, heatmap

__all__ = ["FAMILY_COLOURS", "gap_grid", "mass_vs_effect"]

FAMILY_COLOURS = {"embedding": "#4c72b0", "older_blocks": "#8172b2", "latest_block": "#55a868", "current": "#c44e52",
                  "blocks": "#937860"}
SITE_MARKERS = {"attn": "o", "ffn": "s"}
EFFECTS = {"kl": "KL to the clean run (nats)", "delta_loss": "Δ next-token loss (nats)"}


def gap_grid(res, effect: str = "kl"):
    """(gap [family, column], family names, column labels "layer site"): percentile(mass) - percentile(effect)
    of each cell among all cells, NaN where the family is absent at that site."""
    cols = []
    for r in res.rows:
        key = (r["layer"], r["site"])
        if key not in cols:
            cols.append(key)
    fams = [f for f in res.families if any(r["family"] == f for r in res.rows)]
    pm, pe = res.percentiles("mass"), res.percentiles(effect)
    grid = np.full((len(fams), len(cols)), np.nan)
    for r, a, b in zip(res.rows, pm, pe, strict=True):
        grid[fams.index(r["family"]), cols.index((r["layer"], r["site"]))] = a - b
    return grid, fams, [f"{layer} {site}" for layer, site in cols]


def mass_vs_effect(res, effect: str = "kl"):
    """Scatter of mass against effect, and the per-layer rank gap between them (module docstring)."""
    if effect not in EFFECTS:
        raise ValueError(f"mass_vs_effect: effect must be one of {list(EFFECTS)}, got {effect!r}")
    fig = InlineFigure(figsize=(13, 5.4), layout="constrained")
    ax, right = fig.subplots(1, 2, width_ratios=[1, 1.5])
    y_all = res.column(effect)
    log = effect == "kl" and np.all(y_all > 0)
    for fam in res.families:
        for site, marker in SITE_MARKERS.items():
            pts = [r for r in res.rows if r["family"] == fam and r["site"] == site]
            if not pts:
                continue
            x, y = [r["mass"] for r in pts], [r[effect] for r in pts]
            ax.scatter(x, y, marker=marker, s=42, color=FAMILY_COLOURS.get(fam, "#333333"), edgecolor="white",
                       linewidth=0.6, label=f"{fam} ({site})")
            for r in pts:
                ax.annotate(str(r["layer"]), (r["mass"], r[effect]), xytext=(3, 3), textcoords="offset points",
                            fontsize=7, color="#444444")
    if log:
        ax.set_yscale("log")
    ax.set(xlabel="mean softmax mass of the family at that site", ylabel=EFFECTS[effect],
           title=f"mass vs effect: Spearman ρ = {res.spearman(effect):.2f} over {len(res)} cells")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.14), title_fontsize=7,
              title="family (site: circle before attention, square before the FFN); the numbers are layers")
    grid, fams, cols = gap_grid(res, effect)
    im = heatmap(right, grid, rows=fams, cols=cols, cmap="RdBu_r", vmin=-1, vmax=1, annotate=False)
    for (r, c), v in np.ndenumerate(grid):
        if np.isfinite(v):  # a diverging scale: dark cells at both ends
            right.text(c, r, f"{v:+.2f}", ha="center", va="center", fontsize=7,
                       color="white" if abs(v) > 0.55 else "black", in_layout=False)
    right.set(title=f"rank gap: percentile of mass − percentile of {effect} (red: mass overstates)",
              xlabel="layer, site (attn: before attention, ffn: before the FFN)", ylabel="masked family")
    for label in right.get_xticklabels():
        label.set_rotation(60)
        label.set_ha("right")
    fig.colorbar(im, ax=right, shrink=0.8, label="rank gap")
    return fig
