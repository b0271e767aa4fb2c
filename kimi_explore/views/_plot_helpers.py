"""Small helpers shared by `plots`: labels, thinned ticks, heatmaps, index checks.

Kept apart so `plots.py` reads as a list of views. Everything here is pure and Agg-safe.
"""

from __future__ import annotations

import matplotlib
import numpy as np

from ..backend import to_numpy

MAX_TICKS = 40  # labels per axis before thinning; ~40 stays readable at 100 dpi
ANNOTATE_MAX = 160  # write cell values only into heatmaps this small
_NICE_STRIDES = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128, 200, 250, 500, 1000, 2000, 5000)


def token_labels(ids, tokenizer=None, positions: bool = True) -> list[str]:
    """Readable labels for token ids: `tokenizer.token_label(id)` when given, the id otherwise.

    positions=True prefixes the position in the sequence ("3 'a'", "3 #97"): repeated tokens stay apart.
    """
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if tokenizer is not None:  # quoted: a space must stay visible; -1 = an id the trace was not told
        names = [f"'{tokenizer.token_label(i)}'" if i >= 0 else "?" for i in ids]
    else:
        names = [f"#{i}" if i >= 0 else "?" for i in ids]
    return [f"{p} {n}" for p, n in enumerate(names)] if positions else names


def nice_stride(n: int, max_ticks: int = MAX_TICKS) -> int:
    """The smallest stride from 1, 2, 4, 5, 8, 10, 16, ... that leaves at most `max_ticks` labels."""
    need = -(-n // max_ticks)
    return next((s for s in _NICE_STRIDES if s >= need), need)


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


def heatmap(ax, data, *, rows, cols, cmap: str, vmin=None, vmax=None, annotate: bool = True):
    """imshow of [rows, cols] data with NaN shown light grey, thinned ticks and small-map annotations."""
    data = np.asarray(data, dtype=float)
    if data.shape != (len(rows), len(cols)):
        raise ValueError(f"heatmap data has shape {data.shape} but {len(rows)} row and {len(cols)} column labels")
    cm = matplotlib.colormaps[cmap].with_extremes(bad="#dddddd")
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
                ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if dark else "black",
                        in_layout=False)
    return im


def token_index(trace, token: int) -> int:
    """A token position in the trace (negative counts from the end), checked."""
    n = len(trace.tokens)
    if n == 0:
        raise ValueError("the trace is empty: step at least one token before plotting")
    if not -n <= int(token) < n:
        raise IndexError(f"token={token} is outside the trace: it holds {n} tokens (0..{n - 1}, or -{n}..-1)")
    return int(token) % n


def layer_position(trace, layer: int) -> int:
    """The row of model layer `layer` (0-based id in the full model) in the trace's layer axis."""
    ids = [int(i) for i in trace.layer_ids]
    if int(layer) not in ids:
        raise ValueError(f"layer {layer} is not in this trace; its layers are {ids}")
    return ids.index(int(layer))


def routing(trace) -> dict:
    """`trace.routing()` with host arrays and `moe_layers` as a list of ints; refuses a trace without MoE."""
    r = dict(trace.routing())
    r["moe_layers"] = [int(i) for i in r["moe_layers"]]
    if not r["moe_layers"]:
        raise ValueError("this trace has no MoE layers (trace.routing()['moe_layers'] is empty)")
    for key in ("topk_ids", "topk_weights", "scores"):
        r[key] = np.asarray(r[key])
    return r


def moe_layer_labels(r: dict) -> list[str]:
    return [str(i) for i in r["moe_layers"]]


def softmax(logits) -> np.ndarray:
    """float64 softmax of a host or device [vocab] vector."""
    x = np.asarray(to_numpy(logits), dtype=np.float64).reshape(-1)
    e = np.exp(x - x.max())
    return e / e.sum()
