"""Figures of what K3 did, token by token: pure functions `trace -> matplotlib.figure.Figure`.

Every function reads a `kimi_explore.Trace` (what a `Recorder` collected; or a `Session`: its trace,
and its tokenizer where the call gives none) and returns a NEW
`Figure` built with matplotlib's object-oriented API: no pyplot, no global state, safe under Agg, in
threads and in a kernel without a display. `figure_png(fig)` turns one into PNG bytes for widgets
and reports. The figures are `InlineFigure`s, a Figure with a `_repr_png_`, so a cell that ends with
one shows the picture without `%matplotlib inline`.

What each view reads (shapes as the Trace returns them; T tokens, L layers, S sources, E experts):
  block residuals  trace.attn_res_weights()         [T, L, site, S]  site 0 = before attention,
                                                    1 = before the FFN; S = [embedding, block 1..m,
                                                    current], NaN where a block is not sealed yet
                   trace.final_attn_res_weights()   [T, S]           the output mix before the final norm
  KDA state        trace.kda_state_norms()          ([T, kda_layer, head], kda_layer_ids)
  MoE routing      trace.routing()                  topk_ids / topk_weights [T, moe_layer, k],
                                                    scores [T, moe_layer, E], moe_layers
                   trace["layers.{i}.moe.routed_out.norm"], "...shared_out.norm"  [T]
  predictions      trace["logits.top_ids"], trace["logits.top_probs"]             [T, k]

Token t's views describe the forward pass of the t-th fed token; its predictions are for token t+1.

Scale: K3 has 93 layers, 96 KDA heads and 896 experts. No axis labels every row blindly: `_ticks`
keeps at most `MAX_TICKS` labels on a "nice" stride, cell values are written only into small
heatmaps, and figure sizes grow with the data but stay bounded.
"""

from __future__ import annotations

import functools
import inspect

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..common import (
    MAX_TICKS,
    layer_labels,
    layer_position,
    moe_layer_labels,
    no_predictions,
    routing,
    softmax,
    token_index,
    token_labels,
    trace_labels,
    trace_of,
    why_no_mix,
)
from .mpl import InlineFigure, escape_mathtext, figure_png, heatmap, span_inches, ticks

__all__ = [
    "block_residual_layer",
    "block_residual_token",
    "compare_predictions",
    "escape_mathtext",
    "expert_load",
    "InlineFigure",
    "figure_png",
    "kda_state_curves",
    "kda_state_difference",
    "kda_state_heatmap",
    "kda_state_overview",
    "moe_output_norms",
    "moe_routing_layer",
    "moe_routing_token",
    "predictions",
    "token_labels",
]

def _labels(ids, tokenizer=None, positions: bool = True) -> list[str]:
    """`token_labels`, safe to draw."""
    return [escape_mathtext(s) for s in token_labels(ids, tokenizer, positions)]


def _trace_labels(trace, tokenizer=None) -> list[str]:
    """`trace_labels` (a window's tokens keep their history positions), safe to draw."""
    return [escape_mathtext(s) for s in trace_labels(trace, tokenizer)]


def _takes_session(fn):
    """fn(trace, ...) that takes a Session too: its trace, and its tokenizer where the call gives none."""
    params = list(inspect.signature(fn).parameters)
    at = params.index("tokenizer") if "tokenizer" in params else None  # its place among fn's parameters

    @functools.wraps(fn)
    def taking_a_session(trace, *args, **kwargs):
        positional = at is not None and len(args) >= at  # the tokenizer among args (args follow `trace`)
        trace, tokenizer = trace_of(trace, args[at - 1] if positional else kwargs.get("tokenizer"))
        if positional:
            args = (*args[: at - 1], tokenizer, *args[at:])
        elif at is not None:
            kwargs["tokenizer"] = tokenizer
        return fn(trace, *args, **kwargs)

    return taking_a_session


SITE_TITLES = ("before attention  (attn_res.attn)", "before the FFN  (attn_res.ffn)")
WEIGHT_CMAP = "viridis"
NORM_CMAP = "magma"
SCORE_CMAP = "Blues"
TOPK_COLOR = "#d62728"


# ---------------------------------------------------------------- block attention residuals


def _mark_blocks(ax, valid: np.ndarray) -> None:
    """Dashed line above every layer row where a new block appears (valid: [L] sources present at this
    site: the site before attention sees a sealed block one layer later than the one before the FFN)."""
    for r in np.flatnonzero(np.diff(valid) > 0) + 1:
        ax.axhline(r - 0.5, color="white", lw=1.2, ls="--")


def _label_mla_rows(ax, rows: list[str]) -> None:
    """At K3 depth the thinned stride would label only KDA layers: label the MLA rows instead."""
    if len(rows) > MAX_TICKS:
        pos = [j for j, s in enumerate(rows) if s.endswith("MLA")] or list(range(0, len(rows), 8))
        ax.set_yticks(pos, [rows[j] for j in pos], fontsize=7)


@_takes_session
def block_residual_token(trace, token: int = -1, tokenizer=None) -> Figure:
    """For one token: layer x source softmax weights at both sites, plus the final output mix.

    Left two panels: [L, S] heatmaps (grey = that block does not exist yet at that layer; dashed
    lines mark where a new block was sealed). Right: the final mix over all sources as bars.
    """
    t = token_index(trace, token)
    w = trace.attn_res_weights()[t]  # [L, 2, S]
    final = np.asarray(trace.final_attn_res_weights()[t], dtype=float)  # [S]
    sources, rows = list(trace.source_labels()), layer_labels(trace)
    n_layers = len(rows)
    fig = InlineFigure(figsize=(13, span_inches(n_layers, 0.3, 4.5, 13)), layout="constrained")
    axes = fig.subplots(1, 3, width_ratios=[1, 1, 0.75])
    for site, ax in enumerate(axes[:2]):
        im = heatmap(ax, w[:, site, :], rows=rows, cols=sources, cmap=WEIGHT_CMAP, vmin=0.0, vmax=1.0)
        _mark_blocks(ax, np.isfinite(w[:, site, :]).sum(axis=1))
        _label_mla_rows(ax, rows)
        ax.set_title(SITE_TITLES[site], fontsize=10)
        ax.set_xlabel("source")
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[:2], label="softmax weight", shrink=0.8)
    ax = axes[2]
    y = np.arange(len(sources))
    ax.barh(y, np.nan_to_num(final), color=matplotlib.colormaps[WEIGHT_CMAP](0.55))
    for yi, v in zip(y, final, strict=True):
        if np.isfinite(v):
            ax.text(min(v, 1.0) + 0.01, yi, f"{v:.2f}", va="center", fontsize=8, in_layout=False)
    ax.set_yticks(y, sources)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15)
    ax.set_xlabel("softmax weight")
    ax.set_title("final output mix  (final.attn_res)", fontsize=10)
    fig.suptitle(f"Block attention residuals of token {_trace_labels(trace, tokenizer)[t]}")
    return fig


@_takes_session
def block_residual_layer(trace, layer: int, tokenizer=None) -> Figure:
    """For one layer: source x token softmax weights over the prompt (tokens along x, as in the
    Explorer), before attention above, before the FFN below. The sources stay labelled at the left
    however long the prompt; cell values are written while the cells are wide enough to hold them."""
    j = layer_position(trace, layer)
    w = trace.attn_res_weights()[:, j]  # [T, 2, S]
    cols, sources = _trace_labels(trace, tokenizer), list(trace.source_labels())
    panel = min(4.0, max(1.2, 0.6 + 0.28 * len(sources)))  # inches per site: a row per source
    fig = InlineFigure(figsize=(span_inches(len(cols), 0.32, 6, 15), 1.4 + 2 * panel), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    im = None
    for site, ax in enumerate(axes):
        if not np.isfinite(w[:, site]).any():
            ax.axis("off")
            ax.text(0.5, 0.5, why_no_mix(trace, layer, site).replace(": ", ":\n", 1), ha="center", va="center",
                    fontsize=10)
            continue
        im = heatmap(ax, w[:, site].T, rows=sources, cols=cols, cmap=WEIGHT_CMAP, vmin=0.0, vmax=1.0,
                     annotate=len(cols) <= 24)
        ax.set_title(SITE_TITLES[site], fontsize=10)
        ax.set_ylabel("source")
        if site == 0:
            ax.tick_params(labelbottom=False)  # the token labels once, under the lower panel
    if im is not None:
        fig.colorbar(im, ax=axes, label="softmax weight", shrink=0.8)
    axes[-1].set_xlabel("token")
    fig.suptitle(f"Block attention residuals at layer {layer}, over the prompt")
    return fig


# ---------------------------------------------------------------- KDA recurrent state


def _kda(trace):
    norms, ids = trace.kda_state_norms()
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("this trace has no KDA layers (trace.kda_state_norms() returned none)")
    return np.asarray(norms, dtype=float), ids


def _kda_position(trace, ids: list[int], layer: int) -> int:
    """Layer `layer`'s column among the recorded KDA layers `ids`."""
    if layer in ids:
        return ids.index(layer)
    if layer in trace.kda_layers:  # the model's kinds: a KDA layer the recorder left out is still one
        raise ValueError(f"KDA layer {layer}: layers.{layer}.kda.state was not recorded (the Recorder's names_filter "
                         f"left it out); recorded KDA layers: {ids}")
    raise ValueError(f"layer {layer} is not a KDA layer (an MLA layer has no recurrent state); KDA layers: "
                     f"{[int(i) for i in trace.kda_layers]}")


@_takes_session
def kda_state_heatmap(trace, layer: int, tokenizer=None, vmax=None) -> Figure:
    """For one KDA layer: token x head Frobenius norm of each head's recurrent state S [K, V].
    vmax: the top of the colour scale (pass one value to several KDA figures to compare them)."""
    norms, ids = _kda(trace)
    data = norms[:, _kda_position(trace, ids, layer)]  # [T, H]
    rows = _trace_labels(trace, tokenizer)
    fig = InlineFigure(figsize=(span_inches(data.shape[1], 0.35, 6, 13), span_inches(len(rows), 0.3, 3.5, 12)),
                 layout="constrained")
    ax = fig.subplots()
    im = heatmap(ax, data, rows=rows, cols=[str(h) for h in range(data.shape[1])], cmap=NORM_CMAP, vmin=0.0, vmax=vmax)
    fig.colorbar(im, ax=ax, label="‖S‖ (Frobenius)")
    ax.set(xlabel="head", ylabel="token", title=f"KDA recurrent-state norm per head, layer {layer}")
    return fig


def kda_state_difference(trace_a, trace_b, layer: int, tokenizer=None, names=("as run", "intervened")) -> Figure:
    """For one KDA layer: token x head ‖S‖ of run b minus run a, on a symmetric diverging scale
    (white: no change). The two traces must hold the same tokens (a fork and its original)."""
    (trace_a, tokenizer), (trace_b, _) = trace_of(trace_a, tokenizer), trace_of(trace_b)
    (na, ia), (nb, ib) = _kda(trace_a), _kda(trace_b)
    if list(trace_a.tokens) != list(trace_b.tokens) or ia != ib:
        raise ValueError("kda_state_difference: the two traces must hold the same tokens and KDA layers "
                         f"(got {len(trace_a.tokens)} and {len(trace_b.tokens)} tokens, KDA layers {ia} and {ib})")
    j = _kda_position(trace_a, ia, layer)
    data = nb[:, j] - na[:, j]  # [T, H]
    half = float(np.nanmax(np.abs(data))) if np.isfinite(data).any() else 0.0
    rows = _trace_labels(trace_a, tokenizer)
    fig = InlineFigure(figsize=(span_inches(data.shape[1], 0.35, 6, 13), span_inches(len(rows), 0.3, 3.5, 12)),
                       layout="constrained")
    ax = fig.subplots()
    im = heatmap(ax, data, rows=rows, cols=[str(h) for h in range(data.shape[1])], cmap="RdBu_r",
                 vmin=-(half or 1.0), vmax=half or 1.0, annotate=False)
    fig.colorbar(im, ax=ax, label=f"Δ‖S‖ ({names[1]} - {names[0]})")
    ax.set(xlabel="head", ylabel="token", title=f"KDA layer {layer}: change of each head's state norm")
    return fig


@_takes_session
def kda_state_overview(trace, token: int = -1, tokenizer=None, vmax=None) -> Figure:
    """For one token: KDA layer x head state norms, after that token's update (vmax: as kda_state_heatmap)."""
    norms, ids = _kda(trace)
    t = token_index(trace, token)
    data = norms[t]  # [kda_layer, H]
    fig = InlineFigure(figsize=(span_inches(data.shape[1], 0.35, 6, 13), span_inches(len(ids), 0.3, 3.5, 12)),
                 layout="constrained")
    ax = fig.subplots()
    im = heatmap(ax, data, rows=[str(i) for i in ids], cols=[str(h) for h in range(data.shape[1])],
                 cmap=NORM_CMAP, vmin=0.0, vmax=vmax)
    fig.colorbar(im, ax=ax, label="‖S‖ (Frobenius)")
    label = _trace_labels(trace, tokenizer)[t]
    ax.set(xlabel="head", ylabel="KDA layer", title=f"KDA recurrent-state norms after token {label}")
    return fig


@_takes_session
def kda_state_curves(trace, layers=None, tokenizer=None, max_layers: int = 4) -> Figure:
    """State norm over tokens for chosen KDA layers: mean over heads, band = min..max head.

    layers: KDA layer ids; default all of them, or `max_layers` evenly spaced ones when there are more.
    """
    norms, ids = _kda(trace)
    title = "KDA recurrent-state norm over the prompt"
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):  # one layer
        layers = [layers]
    if layers is None:
        pick = np.unique(np.linspace(0, len(ids) - 1, min(len(ids), max_layers)).round().astype(int))
        layers = [ids[p] for p in pick]
        if len(layers) < len(ids):
            title += f" ({len(layers)} of the {len(ids)} KDA layers, evenly spaced)"
    fig = InlineFigure(figsize=(10, 4.5), layout="constrained")
    ax = fig.subplots()
    x = np.arange(norms.shape[0])
    colors = matplotlib.colormaps["viridis"](np.linspace(0, 0.9, len(layers)))
    for layer, c in zip(layers, colors, strict=True):
        d = norms[:, _kda_position(trace, ids, int(layer))]  # [T, H]
        ax.plot(x, d.mean(axis=1), color=c, lw=1.8, marker="o" if len(x) <= 40 else None, ms=3, label=f"layer {layer}")
        ax.fill_between(x, d.min(axis=1), d.max(axis=1), color=c, alpha=0.15 if len(layers) <= 3 else 0.06, lw=0)
    ticks(ax, "x", _trace_labels(trace, tokenizer), rotate=True)
    ax.set(xlabel="token", ylabel="‖S‖, mean over heads (band: min..max)", title=title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2 if len(layers) > 4 else 1, loc="best")
    return fig


# ---------------------------------------------------------------- MoE routing


def _mark_topk(ax, ids: np.ndarray, weights: np.ndarray, n_experts: int, annotate: bool) -> str:
    """Mark the chosen experts (ids/weights: [rows, k], -1 = padding); return the legend text for the title.

    Few experts: a box on each chosen cell with its combine weight written in. Hundreds (K3's 896):
    boxes would be sub-pixel, so a filled dot per chosen cell.
    """
    rows = np.repeat(np.arange(ids.shape[0]), ids.shape[1])
    keep = ids.ravel() >= 0  # an ablation can shorten the top-k; the trace pads it with -1
    rows, ids, weights = rows[keep], ids.ravel()[keep], weights.ravel()[keep]
    if n_experts > 64:
        ax.scatter(ids, rows, s=max(9.0, 9000 / n_experts), marker="o", color=TOPK_COLOR, linewidths=0)
        return "red dots: the chosen top-k"
    for r, e in zip(rows, ids, strict=True):
        ax.add_patch(Rectangle((e - 0.5, r - 0.5), 1, 1, fill=False, edgecolor=TOPK_COLOR, lw=1.6))
    if not annotate:
        return "red boxes: the chosen top-k"
    for r, e, v in zip(rows, ids, weights, strict=True):
        ax.text(e, r, f"{v:.2f}", ha="center", va="center", fontsize=7, color="black",
                bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.7}, in_layout=False)
    return "red boxes: the chosen top-k, with their combine weights"


def _score_panel(fig, ax, scores, ids, weights, rows, n_experts) -> str:
    cols = [str(e) for e in range(n_experts)]
    im = heatmap(ax, scores, rows=rows, cols=cols, cmap=SCORE_CMAP, vmin=0.0, vmax=1.0, annotate=False)
    fig.colorbar(im, ax=ax, label="router score σ(logit)  (unbiased)")
    return _mark_topk(ax, ids, weights, n_experts, annotate=scores.size <= 600)


@_takes_session
def moe_routing_token(trace, token: int = -1, tokenizer=None) -> Figure:
    """For one token: MoE layer x expert router scores, chosen top-k outlined (numbers = combine weights)."""
    r = routing(trace)
    t = token_index(trace, token)
    n_experts = r["scores"].shape[2]
    fig = InlineFigure(figsize=(span_inches(n_experts, 0.45, 7, 14), span_inches(len(r["moe_layers"]), 0.32, 3.5, 12)),
                 layout="constrained")
    ax = fig.subplots()
    key = _score_panel(fig, ax, r["scores"][t], r["topk_ids"][t], r["topk_weights"][t], moe_layer_labels(r), n_experts)
    label = _trace_labels(trace, tokenizer)[t]
    ax.set(xlabel="expert", ylabel="MoE layer", title=f"MoE routing of token {label}\n{key}")
    return fig


@_takes_session
def moe_routing_layer(trace, layer: int, tokenizer=None) -> Figure:
    """For one MoE layer: token x expert router scores over the prompt, chosen top-k outlined."""
    r = routing(trace)
    if layer not in r["moe_layers"]:
        raise ValueError(f"layer {layer} is not a recorded MoE layer; MoE layers: {r['moe_layers']}")
    j = r["moe_layers"].index(layer)
    n_experts = r["scores"].shape[2]
    rows = _trace_labels(trace, tokenizer)
    fig = InlineFigure(figsize=(span_inches(n_experts, 0.45, 7, 14), span_inches(len(rows), 0.32, 3.5, 12)),
                 layout="constrained")
    ax = fig.subplots()
    key = _score_panel(fig, ax, r["scores"][:, j], r["topk_ids"][:, j], r["topk_weights"][:, j], rows, n_experts)
    ax.set(xlabel="expert", ylabel="token", title=f"MoE routing at layer {layer}, over the prompt\n{key}")
    return fig


@_takes_session
def expert_load(trace, layer=None) -> Figure:
    """How often each expert was chosen over the prompt: bars for one MoE layer, or a MoE layer x expert
    map of counts (each layer has its own experts: expert 3 of layer 1 and of layer 2 share only a
    number, so counts are never summed over layers).

    The dashed line (bars) is the count a perfectly balanced router would give: tokens * k / E.
    """
    r = routing(trace)
    ids = r["topk_ids"]  # [T, M, k]
    n_tokens, n_layers, k = ids.shape
    n_experts = r["scores"].shape[2]
    balanced = n_tokens * k / n_experts
    if layer is None:
        counts = np.stack([np.bincount(row[row >= 0].astype(np.int64), minlength=n_experts)  # -1 pads an ablated top-k
                           for row in ids.transpose(1, 0, 2).reshape(n_layers, -1)])
        fig = InlineFigure(figsize=(span_inches(n_experts, 0.45, 7, 14), span_inches(n_layers, 0.4, 3, 12)),
                           layout="constrained")
        ax = fig.subplots()
        im = heatmap(ax, counts, rows=moe_layer_labels(r), cols=[str(e) for e in range(n_experts)], cmap="viridis",
                     vmin=0, annotate=counts.size <= 160, fmt=".0f")
        fig.colorbar(im, ax=ax, label="times chosen")
        ax.set(xlabel="expert", ylabel="MoE layer",
               title=f"Expert load over {n_tokens} tokens, per MoE layer (balanced: {balanced:.2f} each)")
        return fig
    if layer not in r["moe_layers"]:
        raise ValueError(f"layer {layer} is not a recorded MoE layer; MoE layers: {r['moe_layers']}")
    chosen = ids[:, r["moe_layers"].index(layer)].ravel().astype(np.int64)
    counts = np.bincount(chosen[chosen >= 0], minlength=n_experts)  # -1 pads a shortened (ablated) top-k
    fig = InlineFigure(figsize=(span_inches(n_experts, 0.4, 7, 14), 4), layout="constrained")
    ax = fig.subplots()
    ax.bar(np.arange(n_experts), counts, width=0.85 if n_experts <= 128 else 1.0, color="#4c72b0")
    ax.axhline(balanced, color="black", ls="--", lw=1, label="uniform load")
    ticks(ax, "x", [str(e) for e in range(n_experts)])
    ax.set_xlim(-0.6, n_experts - 0.4)
    ax.set(xlabel="expert", ylabel="times chosen", title=f"Expert load over {n_tokens} tokens, layer {layer}")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


@_takes_session
def moe_output_norms(trace, token=None, tokenizer=None) -> Figure:
    """‖routed output‖ and ‖shared output‖ per MoE layer: at one token, or mean over tokens (band min..max)."""
    layers = routing(trace)["moe_layers"]
    fig = InlineFigure(figsize=(span_inches(len(layers), 0.3, 8, 14), 4.2), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(layers))
    for part, color in (("routed", "#d62728"), ("shared", "#1f77b4")):
        d = np.stack([np.asarray(trace[f"layers.{i}.moe.{part}_out.norm"], dtype=float) for i in layers], axis=1)
        if token is not None:
            ax.plot(x, d[token_index(trace, token)], color=color, marker="o", ms=4, label=f"{part} experts")
        else:
            ax.plot(x, d.mean(axis=0), color=color, marker="o", ms=4, label=f"{part} experts (mean)")
            ax.fill_between(x, d.min(axis=0), d.max(axis=0), color=color, alpha=0.15, lw=0)
    ticks(ax, "x", [str(i) for i in layers])
    when = "over the prompt" if token is None else f"for token {_trace_labels(trace, tokenizer)[token_index(trace, token)]}"
    ax.set(xlabel="MoE layer", ylabel="output L2 norm", title=f"Routed vs shared expert output magnitude {when}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------- next-token predictions


@_takes_session
def predictions(trace, token: int = -1, tokenizer=None) -> Figure:
    """Top-k next-token probabilities after one token; the token actually fed next is highlighted."""
    t = token_index(trace, token)
    ids = np.asarray(trace["logits.top_ids"][t]).astype(int)
    probs = np.asarray(trace["logits.top_probs"][t], dtype=float)
    if no_predictions(probs):
        fig = InlineFigure(figsize=(7, 2), layout="constrained")
        ax = fig.subplots()
        ax.axis("off")
        ax.text(0.5, 0.5, f"No predictions after {_trace_labels(trace, tokenizer)[t]}: the logits hold NaN",
                ha="center", va="center", fontsize=10)
        return fig
    fed_next = int(trace.tokens[t + 1]) if t + 1 < len(trace.tokens) else None
    names = [_labels([i], tokenizer, positions=False)[0] for i in ids]
    fig = InlineFigure(figsize=(7, span_inches(len(ids), 0.38, 3, 8)), layout="constrained")
    ax = fig.subplots()
    colors = [TOPK_COLOR if i == fed_next else "#4c72b0" for i in ids]
    ax.barh(np.arange(len(ids)), probs, color=colors)
    xmax = min(1.0, float(probs.max()) * 1.3) or 1.0
    for y, p in enumerate(probs):
        ax.text(p + 0.01 * xmax, y, f"{p:.3f}", va="center", fontsize=8, in_layout=False)
    ax.set_yticks(np.arange(len(ids)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, xmax)
    if fed_next is None:
        note = ""
    elif fed_next in ids:
        note = "\n(red: the token fed next)"
    else:
        note = f"\n(the token fed next, {_labels([fed_next], tokenizer, positions=False)[0]}, is not in the top {len(ids)})"
    label = _trace_labels(trace, tokenizer)[t]
    ax.set(xlabel="probability", title=f"Next-token predictions after {label}{note}")
    return fig


def compare_predictions(base_logits, other_logits, tokenizer=None, k: int = 10,
                        names=("baseline", "intervention"), title: str = "") -> Figure:
    """Next-token distributions of two runs side by side (the union of both top-k), with their KL.

    base_logits, other_logits: [vocab] host arrays (e.g. a session's logits and its ablated fork's).
    k: the top ids of each shown (>= 1).
    """
    for what, a in (("base_logits", base_logits), ("other_logits", other_logits)):
        if np.ndim(a) != 1:  # (a [T, vocab] history would be one softmax over T * vocab "ids")
            raise ValueError(f"compare_predictions: {what} must be one token's logits [vocab], got shape "
                             f"{list(np.shape(a))}" + (" (a history: pick a token's row, e.g. logits[-1])"
                                                       if np.ndim(a) == 2 else ""))
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"compare_predictions: k (top ids shown from each) must be an int >= 1, got {k!r}")
    p, q = softmax(base_logits), softmax(other_logits)
    if p.shape != q.shape:
        raise ValueError(f"the two logit vectors differ in shape: {p.shape} vs {q.shape}")
    top = list(dict.fromkeys([*np.argsort(-p)[:k], *np.argsort(-q)[:k]]))
    top.sort(key=lambda i: -max(p[i], q[i]))
    y = np.arange(len(top))
    fig = InlineFigure(figsize=(8, span_inches(len(top), 0.36, 3.5, 9)), layout="constrained")
    ax = fig.subplots()
    ax.barh(y - 0.2, p[top], height=0.4, color="#4c72b0", label=names[0])
    ax.barh(y + 0.2, q[top], height=0.4, color=TOPK_COLOR, label=names[1])
    ax.set_yticks(y, [_labels([i], tokenizer, positions=False)[0] for i in top])
    ax.invert_yaxis()
    kl = float(np.sum(p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300)))))
    flipped = int(np.argmax(p)) != int(np.argmax(q))
    summary = f"KL({names[0]} ‖ {names[1]}) = {kl:.4f}" + ("; top-1 changed" if flipped else "; same top-1")
    ax.set(xlabel="probability", title=(title + "\n" if title else "") + summary)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlim(0, max(p[top].max(), q[top].max()) * 1.15 + 1e-9)
    return fig

