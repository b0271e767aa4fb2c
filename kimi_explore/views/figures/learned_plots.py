"""Figures of `kimi_explore.analysis.learned`: what training put inside a tiny K3 (notebook 05).

    routing_specialisation(trained, random)   I(byte class; top-1 expert) per MoE layer, trained vs random weights
    residual_reads(inside)                    mean attention-residual weight per layer and source, both sites + final
    state_norms(inside)                       ||S_h|| over the text, one panel per KDA layer, one line per head
    decay_rates(inside)                       per-head half-life and the per-channel decay spectrum

Pure functions `Inside -> Figure` (object-oriented matplotlib, no pyplot), like `plots`.
"""

from __future__ import annotations

import math

import numpy as np

from .mpl import InlineFigure, heatmap

__all__ = ["SMOOTH", "class_entropy", "decay_rates", "residual_reads", "routing_specialisation", "smoothed", "state_norms"]

SMOOTH = 64  # bytes in the running mean of the state-norm panels


def class_entropy(inside) -> float:
    """H(byte class) of the decoded text in bits: the ceiling of I(class; top-1 expert)."""
    counts = np.asarray(inside.routing.class_top1, dtype=np.float64)[0].sum(axis=1)  # [C], one layer sees every byte
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def smoothed(x: np.ndarray, window: int = SMOOTH) -> np.ndarray:
    """Running mean over `window` positions along axis 0 ([T, ...] -> [T - window + 1, ...])."""
    c = np.cumsum(np.asarray(x, dtype=np.float64), axis=0)
    c = np.concatenate([np.zeros((1,) + c.shape[1:]), c])
    return (c[window:] - c[:-window]) / window


def routing_specialisation(trained, random, labels=("trained", "random weights")):
    """Bars: the mutual information between the input byte's class and the top-1 expert, per MoE layer."""
    a, b = trained.mutual_information(), random.mutual_information()
    layers = sorted(a)
    fig = InlineFigure(figsize=(7, 3.6), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(layers))
    ax.bar(x - 0.2, [a[m] for m in layers], 0.4, label=labels[0], color="#4c72b0")
    ax.bar(x + 0.2, [b[m] for m in layers], 0.4, label=labels[1], color="#bbbbbb")
    ax.set_xticks(x, [str(m) for m in layers])
    ceiling = class_entropy(trained)
    ax.axhline(ceiling, color="black", lw=1, ls="--", label=f"ceiling H(class) = {ceiling:.2f} bits")
    ax.set(xlabel="MoE layer", ylabel="bits", ylim=(0, ceiling * 1.25),
           title=f"I(byte class; top-1 expert) over {len(trained.ids)} bytes, "
                 f"{len(trained.routing.class_names)} classes")
    ax.legend(loc="upper right", fontsize=8, ncol=3)
    ax.grid(axis="y", alpha=0.3)
    return fig


def residual_reads(inside):
    """Heatmaps layer x source (embedding, blocks, current) of the mean softmax weight at each site."""
    from ...analysis.learned import source_labels

    n = max(len(v) for site in ("attn", "ffn") for v in inside.reads[site].values())
    n = max(n, len(inside.reads["final"]))
    cols = source_labels(n)
    fig = InlineFigure(figsize=(12, 4.2), layout="constrained")
    axes = fig.subplots(1, 3, width_ratios=[1, 1, 0.35])
    for ax, site, title in zip(axes[:2], ("attn", "ffn"), ("before attention", "before the FFN"), strict=True):
        layers = sorted(inside.reads[site])
        m = np.full((len(layers), n), np.nan)
        for r, layer in enumerate(layers):
            v = inside.reads[site][layer]
            m[r, : len(v) - 1], m[r, -1] = v[:-1], v[-1]  # sealed blocks left, the current sum last
        heatmap(ax, m, rows=[str(layer) for layer in layers], cols=cols, cmap="viridis", vmin=0, vmax=1, annotate=True)
        ax.set(title=f"mean weight {title}", xlabel="source", ylabel="layer")
    f = np.asarray(inside.reads["final"])[None]
    heatmap(axes[2], f, rows=["final"], cols=cols[: f.shape[1] - 1] + ["current"], cmap="viridis", vmin=0, vmax=1, annotate=True)
    axes[2].set(title="output mix")
    return fig


def state_norms(inside, window: int = SMOOTH):
    """One panel per KDA layer: each head's ||S_h||_F against the position in the text, as a running
    mean over `window` bytes (the raw norm jumps at every write; the faint band is its min..max over
    the heads, raw)."""
    layers = sorted(inside.state_norms)
    cols = min(3, len(layers))
    rows = math.ceil(len(layers) / cols)
    fig = InlineFigure(figsize=(4.2 * cols, 2.8 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, sharex=True, squeeze=False)).ravel()
    for ax, layer in zip(axes, layers, strict=False):
        norms = np.asarray(inside.state_norms[layer], dtype=np.float64)
        window = max(1, min(window, len(norms)))
        ax.fill_between(np.arange(len(norms)), norms.min(axis=1), norms.max(axis=1), color="#999999", alpha=0.15, lw=0)
        sm, x = smoothed(norms, window), np.arange(window - 1, len(norms))
        for h in range(norms.shape[1]):
            ax.plot(x, sm[:, h], lw=1.4, label=f"head {h}")
        ax.set(title=f"KDA layer {layer}", xlabel="position (bytes)", ylabel=f"||S_h||, mean of {window}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    for ax in axes[len(layers) :]:
        ax.set_visible(False)
    return fig


def decay_rates(inside):
    """Left: each head's median key-channel half-life (bytes, log scale) per KDA layer. Right: the decay alpha of every
    key channel, sorted within each head (the spectrum of memory lengths a head mixes)."""
    rates = inside.decay_rates()
    layers = sorted(rates)
    half = np.array([rates[m]["half_life"] for m in layers])  # [L, H]
    fig = InlineFigure(figsize=(12, 3.8), layout="constrained")
    ax, spec = fig.subplots(1, 2, width_ratios=[1, 1.6])
    im = heatmap(ax, np.log10(half), rows=[str(m) for m in layers], cols=[f"head {h}" for h in range(half.shape[1])],
                 cmap="magma", annotate=False)
    lo, hi = im.norm.vmin, im.norm.vmax
    for (r, c), v in np.ndenumerate(half):  # white on the dark end of magma, black on the light end
        dark = (np.log10(v) - lo) / ((hi - lo) or 1.0) < 0.6
        ax.text(c, r, f"{v:.1f}", ha="center", va="center", fontsize=8, color="white" if dark else "black")
    fig.colorbar(im, ax=ax, label="log10 half-life (bytes)")
    ax.set(title="median channel half-life of each head", xlabel="", ylabel="KDA layer")
    H = half.shape[1]
    for i, m in enumerate(layers):
        ch = np.sort(rates[m]["mean_alpha_channels"], axis=1)  # [H, K]
        K = ch.shape[1]
        for h in range(H):
            x = i * (H * K + K) + h * K + np.arange(K)
            spec.plot(x, ch[h], lw=1.0, color=f"C{h}", label=f"head {h}" if i == 0 else None)
    spec.set_xticks([i * (H * ch.shape[1] + ch.shape[1]) + H * ch.shape[1] / 2 for i in range(len(layers))],
                    [f"layer {m}" for m in layers])
    spec.set(ylabel="mean decay alpha", title="per-channel decay, sorted within each head", ylim=(0, 1.02))
    spec.legend(fontsize=7, ncol=H)
    spec.grid(alpha=0.3)
    return fig
