"""Figures of the analyses (`kimi_explore.analysis`): pure functions `result -> matplotlib Figure`.

    lens_grid(lens)                layer x token top-1 predictions of the logit lens, coloured by probability,
                                   with each layer's agreement with the final prediction beside it
    attribution_waterfall(attr)    the top contributors to one logit, cumulated from 0 to the logit
    diff_overview(d)               a run diff: Δ weights, Δ KDA state norms, routing Jaccard, KL and flips
    routing_stats_overview(stats)  corpus load per layer x expert (log2 of load / balanced), CV and MI per layer

Differences are drawn on symmetric diverging scales (blue < 0 < red, white at 0); panels showing
the same quantity (Δ softmax weights) share one scale so their colours compare. Same conventions
as `plots`: object-oriented matplotlib, no pyplot, `InlineFigure`s that show themselves in a notebook.
"""

from __future__ import annotations

import numpy as np
from matplotlib.patches import Rectangle

from ..common import row_index, token_labels, token_texts
from .mpl import InlineFigure, escape_mathtext, heatmap, span_inches, ticks

__all__ = ["attribution_waterfall", "diff_overview", "lens_grid", "report_figures", "routing_stats_overview"]

DIVERGING = "RdBu_r"
PROB_CMAP = "viridis"
ANNOTATE_CELLS = 640  # write the top-1 token into lens cells up to this many
NOISE = 1e-5  # |Δ| below this is float32 summation order (a chunked run against a token-by-token one), not an effect
PANEL_TICKS = 16  # token labels on one of the diff's narrow panels


def _names(ids, tokenizer, positions: bool = True) -> list[str]:
    return [escape_mathtext(s) for s in token_labels(ids, tokenizer, positions)]


def _cell_label(label: str) -> str:
    """A lens cell's text: a byte that is not text alone, `<0x80>`, as `x80` (fits the cell); a space as ␣."""
    if label.startswith("<0x") and label.endswith(">"):
        return "x" + label[3:-1]
    return label.replace(" ", "␣")


def _unchanged(ax, what: str, values) -> bool:
    """Say so instead of drawing a map of noise when no |Δ| reaches NOISE, or that nothing was recorded
    (no finite value); True if it said so."""
    a = np.asarray(values, dtype=float)
    if not (a.size and np.isfinite(a).any()):  # nothing to compare: not "no change"
        ax.axis("off")
        ax.text(0.5, 0.5, f"{what}:\nnot recorded in these runs", ha="center", va="center", fontsize=10,
                transform=ax.transAxes)
        return True
    peak = float(np.nanmax(np.abs(a)))
    if peak >= NOISE:
        return False
    ax.axis("off")
    ax.text(0.5, 0.5, f"{what}:\nno change above {NOISE:g}\n(max |Δ| = {peak:.1e}, float32 rounding)",
            ha="center", va="center", fontsize=10, transform=ax.transAxes)
    return True


def _symmetric(*arrays) -> float:
    """One half-range for a diverging scale shared by all `arrays` (NaN ignored; 1e-12 if all zero)."""
    peaks = [float(np.nanmax(np.abs(a))) for a in arrays if np.size(a) and np.isfinite(a).any()]
    return max(peaks + [1e-12])


def lens_grid(lens, tokenizer=None, max_tokens: int = 48):
    """Left: [layer, token] top-1 probability, each cell labelled with its top-1 token, outlined where
    it is the model's final top-1. Right: the agreement with the final prediction per layer (over
    all tokens). At most the last `max_tokens` tokens are drawn, and the title says which."""
    T = len(lens)
    t0 = max(0, T - max_tokens)
    probs = lens.top_probs[t0:, :, 0].T  # [L, T']
    ids = lens.top_ids[t0:, :, 0].T
    at = np.arange(T) if lens.positions is None else np.asarray(lens.positions)  # a lens of chosen positions
    cols = [f"{int(p)} {name}" for p, name in zip(at[t0:], _names(lens.tokens[t0:], tokenizer, positions=False),
                                                  strict=True)]
    rows = [str(i) for i in lens.layers]
    fig = InlineFigure(figsize=(span_inches(len(cols), 0.5, 7, 20) + 2.5, span_inches(len(rows), 0.42, 4, 14)),
                       layout="constrained")
    ax, side = fig.subplots(1, 2, width_ratios=[max(4, len(cols) / 6), 1], sharey=True)
    im = heatmap(ax, probs, rows=rows, cols=cols, cmap=PROB_CMAP, vmin=0.0, vmax=1.0, annotate=False)
    final = lens.final_ids[t0:]
    same = (ids == final[None, :]) & (final[None, :] >= 0)
    if probs.size <= ANNOTATE_CELLS:
        for (r, c), p in np.ndenumerate(probs):  # NaN logits: no prediction (their top ids are a tie order)
            label = "NaN" if np.isnan(p) else _cell_label(escape_mathtext(token_texts([ids[r, c]], tokenizer)[0]))
            ax.text(c, r, label, ha="center", va="center", fontsize=8.5, color="white" if p < 0.55 else "black",
                    in_layout=False, clip_on=True)
    for r, c in zip(*np.nonzero(same), strict=True):  # an outline, not bold: it shows at any size
        ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, ec="#ff7f0e", lw=1.6))
    ax.set(xlabel="token (its lens predicts the next one)", ylabel="layer")
    fig.colorbar(im, ax=ax, label="top-1 probability", shrink=0.8, location="left")
    agree = lens.agreement()
    side.barh(np.arange(len(rows)), agree, color="#4c72b0")
    side.set_xlim(0, 1)
    side.set_xlabel("agrees with final\ntop-1 (tokens with one)")
    side.grid(axis="x", alpha=0.3)
    shown = (f"tokens {t0}-{T - 1} of {T}" if t0 else f"all {T} tokens") if lens.positions is None or \
        np.array_equal(lens.positions, np.arange(len(lens.positions))) else f"{T - t0} chosen positions"
    ax.set_title(f"Logit lens through the block residuals: top-1 after each layer ({shown}; "
                 "orange box: equals the final top-1; xNN: a byte that is not text alone)")
    return fig


def attribution_waterfall(attr, top: int = 12, tokenizer=None):
    """Bars from 0 to the logit: the `top` largest leaves by |value|, then the rest as one bar."""
    items = list(attr.contributions.items())[:top]
    rest = list(attr.contributions.values())[top:]
    if rest:
        items.append((f"{len(rest)} other leaves", float(sum(rest))))
    labels = [k for k, _ in items] + ["logit"]
    values = np.array([v for _, v in items])
    starts = np.concatenate([[0.0], np.cumsum(values)[:-1]])
    fig = InlineFigure(figsize=(8, span_inches(len(labels), 0.36, 3.5, 9)), layout="constrained")
    ax = fig.subplots()
    y = np.arange(len(labels))
    colors = ["#b2182b" if v > 0 else "#2166ac" for v in values]
    ax.barh(y[:-1], values, left=starts, color=colors)
    ax.barh(y[-1], attr.logit, color="#444444")
    for yi, (s, v) in enumerate(zip(starts, values, strict=True)):
        ax.text(s + v, yi, f" {v:+.3f}", va="center", ha="left" if v >= 0 else "right", fontsize=7, in_layout=False)
    ax.axvline(0, color="black", lw=0.8)
    ax.margins(x=0.12)  # room for the value labels
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    name = _names([attr.token], tokenizer, positions=False)[0]
    ax.set(xlabel="contribution to the logit (frozen final norm)",
           title=f"Direct logit attribution of {name} after token {attr.t}: logit {attr.logit:.3f}\n"
                 "red pushes it up, blue down; leaves add up to the logit")
    return fig


def diff_overview(d, token=None, tokenizer=None):
    """A run diff (b - a) in five panels; `token` (default: the largest KL) picks the per-layer panel: a row of
    the diff (negative counts from the end), as `token` is a row of the trace in `plots` (`token_index`); the
    labels show history positions (row 0 of a diff of `Trace.window(12, 22)`s is position 12). IndexError
    outside the rows. A panel whose |Δ| stays below NOISE says so in words instead of drawing rounding noise."""
    T = len(d)
    if T == 0:
        raise ValueError("diff_overview: the diff covers no tokens")
    start = 0 if getattr(d, "positions", None) is None else int(d.positions[0])  # windows of traces: their positions
    t = int(np.argmax(d.kl)) if token is None else row_index(T, token, "diff", start)
    cols = [escape_mathtext(s) for s in token_labels(d.tokens_a, tokenizer, start=start)]
    fig = InlineFigure(figsize=(14, 9.5), layout="constrained")
    grid = fig.subplots(2, 3)
    w = _symmetric(d.final_attn_res, d.attn_res[t, :, 1])  # one scale for the softmax-weight panels
    ax, im = grid[0, 0], None
    if not _unchanged(ax, "Δ output-mix weights", d.final_attn_res):
        im = heatmap(ax, d.final_attn_res.T, rows=d.source_labels, cols=cols, cmap=DIVERGING, vmin=-w, vmax=w,
                     annotate=False)
        ticks(ax, "x", cols, max_ticks=PANEL_TICKS)
        ax.set_title("Δ output-mix weights (token x source)", fontsize=10)
    ax = grid[0, 1]
    if not _unchanged(ax, f"Δ FFN-site block weights at token {cols[t]}", d.attn_res[t, :, 1]):
        im = heatmap(ax, d.attn_res[t, :, 1], rows=[str(i) for i in d.layers], cols=d.source_labels, cmap=DIVERGING,
                     vmin=-w, vmax=w, annotate=False)
        ax.set_title(f"Δ FFN-site block weights at token {cols[t]}", fontsize=10)
        ax.set(xlabel="source", ylabel="layer")
    if im is not None:
        fig.colorbar(im, ax=list(grid[0, :2]), label="Δ softmax weight (b - a)", shrink=0.5, aspect=40, location="bottom")
    ax = grid[0, 2]
    kda = d.kda_state.sum(axis=2).T if d.kda_state.size else np.zeros((0, T))
    if not _unchanged(ax, "Δ KDA state norm, summed over heads", kda):
        s = _symmetric(kda)
        im = heatmap(ax, kda, rows=[str(i) for i in d.kda_layers], cols=cols, cmap=DIVERGING, vmin=-s, vmax=s,
                     annotate=False)
        ticks(ax, "x", cols, max_ticks=PANEL_TICKS)
        ax.set_title("Δ KDA state norm, summed over heads", fontsize=10)
        ax.set_ylabel("KDA layer")
        fig.colorbar(im, ax=ax, shrink=0.8, label="Δ‖S‖ (b - a)")
    ax = grid[1, 0]
    if not d.moe_layers:  # no MoE layer's routing recorded: nothing to compare (not "the same sets")
        _unchanged(ax, "routing (Jaccard of the top-k sets)", np.zeros(0))
    else:
        im = heatmap(ax, d.jaccard.T, rows=[str(i) for i in d.moe_layers], cols=cols, cmap="Greys_r", vmin=0.0,
                     vmax=1.0, annotate=False)
        ticks(ax, "x", cols, max_ticks=PANEL_TICKS)
        ax.set_title(f"routing: Jaccard of the top-k sets ({len(d.routing_changes)} changes; white = same set)",
                     fontsize=10)
        ax.set_ylabel("MoE layer")
        fig.colorbar(im, ax=ax, shrink=0.8, label="Jaccard (1 = same set)")
    ax = grid[1, 1]
    x = np.arange(T)
    ax.plot(x, d.kl, marker="o", ms=3, color="#444444")
    flips = np.flatnonzero(d.flips)
    ax.plot(flips, d.kl[flips], "o", color="#b2182b", ms=6, label="top-1 flipped")
    ticks(ax, "x", cols, max_ticks=PANEL_TICKS)
    ax.set(ylabel="KL(a ‖ b), nats" + ("" if d.kl_exact else " (lower bound)"), title="Δ predictions")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    grid[1, 2].axis("off")
    summary = d.summary()
    grid[1, 2].text(0, 1, "\n".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in summary.items()
                                    if k != "mean_jaccard"), va="top", fontsize=9, family="monospace")
    fig.suptitle("Run diff (b - a)")
    return fig


def routing_stats_overview(stats):
    """Load per MoE layer x expert as log2(count / balanced count) (red: overloaded; grey: dead); then, per
    layer, the byte-class mutual information (bits) and the load CV, each on its own axis."""
    balanced = stats.tokens * stats.top_k / stats.num_experts
    with np.errstate(divide="ignore"):
        ratio = np.where(stats.counts > 0, np.log2(stats.counts / max(balanced, 1e-300)), np.nan)
    rows = [str(i) for i in stats.moe_layers]
    fig = InlineFigure(figsize=(span_inches(stats.num_experts, 0.35, 8, 16) + 5, span_inches(len(rows), 0.3, 4, 12)),
                       layout="constrained")
    ax, side, cv = fig.subplots(1, 3, width_ratios=[4, 1, 1], sharey=True)
    s = _symmetric(ratio)
    im = heatmap(ax, ratio, rows=rows, cols=[str(e) for e in range(stats.num_experts)], cmap=DIVERGING, vmin=-s, vmax=s,
                 annotate=False)
    fig.colorbar(im, ax=ax, label="log2(load / balanced load)", shrink=0.8, location="left")
    ax.set(xlabel="expert", ylabel="MoE layer", title=f"Expert load over {stats.tokens} tokens ({len(stats.texts)} texts)")
    y = np.arange(len(rows))
    side.barh(y, stats.mutual_information(), color="#4c72b0")
    side.set(xlabel="bits", title="I(byte class; top-1)")
    side.grid(axis="x", alpha=0.3)
    cv.barh(y, stats.cv, color="#b2182b")  # its own axis: a CV is not in bits
    cv.set(xlabel="std / mean", title="load CV")
    cv.grid(axis="x", alpha=0.3)
    return fig


def report_figures(session, tokenizer=None) -> list:
    """(section, file stem, caption, figure) of the analyses for `kimi-explore report` (they replay the session). An
    analysis that cannot run on this history (NaN logits, tokens decoded under an intervention no longer attached)
    gives (section, None, why, None): the report says so where its figure would be, and keeps the rest."""
    from ...analysis.attribution import logit_attribution
    from ...analysis.logit_lens import logit_lens

    out = []
    try:
        lens = logit_lens(session, top=1)
        agree = lens.agreement()
        said = ("no token has a final top-1 (NaN logits)" if np.isnan(agree).all() else
                f"{agree[0]:.2f} after the first layer, {agree[len(agree) // 2]:.2f} mid-depth, {agree[-1]:.2f} at the last")
        out.append(("Logit lens", "logit_lens",
                    "Top-1 prediction after every layer through the block residuals (the output mix, final norm and "
                    f"lm_head applied to the stack so far); agreement with the final top-1: {said}.",
                    lens_grid(lens, tokenizer)))
    except (ValueError, TypeError) as e:  # (TypeError: an analysis a pipeline's session does not offer)
        out.append(("Logit lens", None, f"No logit lens for this history: {e}", None))
    try:
        attr = logit_attribution(session, -1)
        out.append(("Direct logit attribution", "attribution_last_token",
                    f"The last token's top-1 logit ({attr.logit:.3f}) split exactly into the embedding, attention, FFN, "
                    "routed-expert and shared-expert leaves (final norm frozen).",
                    attribution_waterfall(attr, tokenizer=tokenizer)))
    except (ValueError, TypeError) as e:
        out.append(("Direct logit attribution", None, f"No attribution for this history: {e}", None))
    return out
