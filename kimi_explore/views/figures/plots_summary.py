"""Static figures (and one HTML table) of the K3-scale MoE summaries, for the report, nbconvert and scripts.

The same numbers as the Explorer's MoE tab (`summaries.py`), drawn with matplotlib's object API:
  moe_layer_stats(trace, token)   per MoE layer: routing entropy (that token, and the mean over the
                                  prompt), max/mean load, coefficient of variation, dead experts
  moe_sorted_counts(trace)        layer x rank heatmap of each layer's expert counts, sorted
  topk_table_html(trace, token)   per MoE layer, the chosen experts of one token with their combine
                                  weights and unbiased scores; '*' marks a choice the selection bias made,
                                  '†' one a hook made (outside the router's top-k: `force_routing`)
Each takes a Trace or a Session (its trace; the table also its routers' bias, and its tokenizer).
"""

from __future__ import annotations

import html

import numpy as np
from matplotlib.ticker import MaxNLocator

from .. import summaries
from ..common import bias_vectors, routing, token_index, trace_labels, trace_of
from .mpl import InlineFigure, escape_mathtext, heatmap, span_inches, ticks

__all__ = ["moe_layer_stats", "moe_sorted_counts", "topk_table_html"]


def moe_layer_stats(trace, token: int = -1, tokenizer=None):
    """Four stacked panels over the MoE layers: entropy, max/mean load, CV, dead experts."""
    trace, tokenizer = trace_of(trace, tokenizer)
    r = routing(trace)
    t = token_index(trace, token)
    layers, k = r["moe_layers"], r["topk_ids"].shape[2]
    h = summaries.routing_entropy(r)
    stats = summaries.load_stats(r)
    fig = InlineFigure(figsize=(span_inches(len(layers), 0.12, 8, 14), 7), layout="constrained")
    axes = fig.subplots(4, 1, sharex=True)
    x = np.arange(len(layers))
    label = escape_mathtext(trace_labels(trace, tokenizer)[t])
    axes[0].plot(x, h[t], marker="o", ms=3, color="#1f77b4", label=f"token {label}")
    axes[0].plot(x, np.nanmean(h, axis=0), color="#999", lw=1.2, label="mean over the prompt")
    axes[0].axhline(np.log2(k), color="black", ls=":", lw=1, label=f"log2 k = {np.log2(k):.1f} (all equal)")
    axes[0].legend(fontsize=7, loc="lower right", ncol=3)
    # "never chosen" means something only once every expert could have been chosen: T*k >= E (as the Explorer)
    dead_ok = stats["tokens"] * k >= stats["experts"]
    rows = ((axes[0], "entropy (bits)", None), (axes[1], "max / mean", stats["max_over_mean"]),
            (axes[2], "CV", stats["cv"]), (axes[3], f"dead (of {stats['experts']})", stats["dead"] if dead_ok else None))
    if not dead_ok:
        axes[3].text(0.5, 0.5, f"no dead-expert count until {-(-stats['experts'] // k)} tokens: {stats['tokens']}x{k} "
                     f"choices < {stats['experts']} experts", transform=axes[3].transAxes, ha="center", va="center",
                     fontsize=8, color="#555")
    for ax, name, y in rows:
        if y is not None:
            ax.plot(x, y, marker="o", ms=3, color="#d62728")
        ax.set_ylabel(name, fontsize=8)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(top=1.12 * max(np.log2(k), float(np.nanmax(h, initial=0.0))))  # the log2 k line inside, not on the frame
    axes[3].yaxis.set_major_locator(MaxNLocator(integer=True))  # a count of experts
    ticks(axes[3], "x", [str(i) for i in layers])
    axes[3].set_xlabel("MoE layer")
    axes[0].set_title(f"Per MoE layer: routing entropy of the combine weights,\nand expert load over {stats['tokens']} tokens")
    return fig


def moe_sorted_counts(trace):
    """Each MoE layer's expert counts over the prompt, sorted descending (balanced: flat rows)."""
    trace, _ = trace_of(trace)
    r = routing(trace)
    stats = summaries.load_stats(r)
    counts, _ = summaries.sorted_counts(stats["counts"])
    n = max(1, int((counts > 0).sum(axis=1).max()))  # cropped to the widest row of experts that ran (as the Explorer)
    fig = InlineFigure(figsize=(11, span_inches(len(r["moe_layers"]), 0.08, 3.5, 9)), layout="constrained")
    ax = fig.subplots()
    im = heatmap(ax, counts[:, :n], rows=[str(i) for i in r["moe_layers"]], cols=[str(c + 1) for c in range(n)],
                 cmap="viridis", vmin=0, annotate=False)
    fig.colorbar(im, ax=ax, label="times chosen")
    ax.set(xlabel="expert rank in its layer (1 = busiest)", ylabel="MoE layer",
           title=f"Expert counts per layer over {stats['tokens']} tokens, sorted; ranks 1-{n} of {stats['experts']} "
                 "(no layer used more)")
    return fig


def topk_table_html(trace, token: int = -1, bias: dict | None = None, tokenizer=None) -> str:
    """An HTML table: one row per MoE layer, one cell per chosen expert ('id weight / score', '*' = by the bias,
    '†' = by a hook). bias: the routers' selection bias by layer (a Session's by default)."""
    weights = getattr(trace, "weights", None)  # a Session's: its routers' bias
    if bias is None and weights is not None:
        bias = bias_vectors(weights)
    trace, tokenizer = trace_of(trace, tokenizer)
    r = routing(trace)
    t = token_index(trace, token)
    tab = summaries.topk_table(r, t, bias, getattr(trace, "meta", {}).get("top_k"))  # the router's top-k (model_meta)
    k = tab["ids"].shape[1]
    head = "".join(f"<th>{c + 1}</th>" for c in range(k))
    rows = []
    for j, layer in enumerate(tab["moe_layers"]):
        cells = []
        for c in range(k):
            e = int(tab["ids"][j, c])
            if e < 0:
                cells.append("<td></td>")
                continue
            star = "*" if tab["by_bias"][j, c] else "\u2020" if tab["forced"][j, c] else ""
            cells.append(f"<td title='rank {tab['rank'][j, c]} by unbiased score'><b>{e}{star}</b> "
                         f"{tab['weights'][j, c]:.3f} / {tab['scores'][j, c]:.3f}</td>")
        out = ", ".join(f"{e} ({score:.3f})" for e, score in tab["displaced"][j]) or "none"  # ids: a count read as one
        rows.append(f"<tr><th>{layer}</th>{''.join(cells)}<td>{out}</td></tr>")
    label = html.escape(trace_labels(trace, tokenizer)[t])
    n_bias, n_forced = int(tab["by_bias"].sum()), int(tab["forced"].sum())
    forced = (f"; <b>\u2020</b> = chosen by a hook, outside the router's own top-k ({n_forced})" if n_forced else "")
    return (f"<p>Experts of token {label} at every MoE layer, by unbiased score: <b>id</b> combine weight / unbiased "
            f"score; <b>*</b> = " + ("chosen only through the selection bias" if all(tab["bias_known"]) else
                                     "outside the unbiased top-k: the selection bias or a hook (the bias is not known "
                                     "here)") + f" ({n_bias} of {int((tab['ids'] >= 0).sum())})"
            f"{forced}; last column: experts of the unbiased top-k that the bias pushed out (id (unbiased score)).</p>"
            f"<div class='wide'><table><tr><th>layer</th>{head}<th>pushed out</th></tr>{''.join(rows)}</table></div>")
