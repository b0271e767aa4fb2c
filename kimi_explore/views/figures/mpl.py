"""The matplotlib plumbing every static figure uses: thinned ticks, heatmaps with NaN in light grey,
bounded figure sizes, `$` escaped out of mathtext, and `InlineFigure` (a Figure that shows itself as a
PNG in a notebook without pyplot). Pure and Agg-safe.
"""

from __future__ import annotations

import io

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from ..common import MAX_TICKS, MISSING, nice_stride

ANNOTATE_MAX = 160  # write cell values only into heatmaps this small


def escape_mathtext(text: str) -> str:
    """Text for a matplotlib label: a `$` pair would otherwise be typeset as math."""
    return text.replace("$", r"\$")


def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    """Render `fig` to PNG bytes (Agg, no display needed)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


class InlineFigure(Figure):
    """A plain Figure that also shows itself as a PNG when it is a notebook cell's result.

    A bare `Figure` (no pyplot) otherwise displays as its text repr unless `%matplotlib inline` ran.
    """

    def _repr_png_(self) -> bytes:
        return figure_png(self)


def ticks(ax, axis: str, labels, rotate: bool = False, max_ticks: int = MAX_TICKS) -> None:
    """Label a categorical axis, keeping every `nice_stride`-th label so K3's 93 layers or 896 experts
    stay legible."""
    labels = list(labels)
    pos = list(range(0, len(labels), nice_stride(len(labels), max_ticks)))
    shown = [labels[i] for i in pos]
    if axis == "x":
        long = rotate or max((len(s) for s in shown), default=0) > 3
        ax.set_xticks(pos, shown, rotation=60 if long else 0, ha="right" if long else "center",
                      rotation_mode="anchor", fontsize=8)
    else:
        ax.set_yticks(pos, shown, fontsize=8)


def span_inches(n: int, per_item: float, lo: float, hi: float) -> float:
    """A figure side that grows with the number of rows/columns but stays within [lo, hi] inches."""
    return float(min(hi, max(lo, 1.6 + per_item * n)))


def heatmap(ax, data, *, rows, cols, cmap: str, vmin=None, vmax=None, annotate: bool = True, fmt: str = ".2f"):
    """imshow of [rows, cols] data with NaN shown light grey, thinned ticks and small-map annotations (`fmt`:
    their format, ".0f" for counts)."""
    data = np.asarray(data, dtype=float)
    if data.shape != (len(rows), len(cols)):
        raise ValueError(f"heatmap data has shape {data.shape} but {len(rows)} row and {len(cols)} column labels")
    cm = matplotlib.colormaps[cmap].with_extremes(bad=MISSING)
    im = ax.imshow(np.ma.masked_invalid(data), aspect="auto", interpolation="nearest", cmap=cm, vmin=vmin, vmax=vmax)
    ticks(ax, "y", rows)
    ticks(ax, "x", cols)
    if annotate and data.size <= ANNOTATE_MAX:
        lo, hi = im.norm.vmin, im.norm.vmax
        for (r, c), v in np.ndenumerate(data):
            if np.isfinite(v):
                dark = (v - lo) / ((hi - lo) or 1.0) < 0.55 if cmap in ("viridis", "magma") else v > (lo + hi) / 2
                # in_layout=False: cell labels sit inside the axes, and measuring each one for the
                # constrained layout would double the rendering time
                ax.text(c, r, format(v, fmt), ha="center", va="center", fontsize=7, color="white" if dark else "black",
                        in_layout=False)
    return im
