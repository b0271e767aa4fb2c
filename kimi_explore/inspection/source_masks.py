"""Mask block-residual sources: drop a family of sources from a block-residual softmax and renormalise.

At each block-residual site the decoder mixes the sources [b_0, ..., b_{n-1}, current] with softmax
weights p (model/block_residual.py; b_0 is the embedding: layer 0 pushes its raw input first). A
mask over a set M of source columns replaces p by

    p'_j = p_j [j not in M] / sum_{k not in M} p_k                the softmax renormalised over the rest

which is what the softmax would give if the masked scores were -inf. It acts through the
`layers.{i}.attn_res.{attn,ffn}.weights` hook sites (the value returned there is what the mix
uses), at the positions asked for, on the token form and on whole chunks of the sequence path alike.

Source families, resolved at each site from its number of sources m = n + 1 (`source_columns`):

    "embedding"      column 0 (the embedding, b_0)
    "current"        column n (the running partial sum of the current block)
    "latest_block"   column n - 1, the newest sealed block (when n >= 2: b_0 is the embedding)
    "older_blocks"   columns 1 .. n - 2: sealed blocks before the newest, the embedding excluded
    "blocks"         columns 1 .. n - 1: every sealed block but the embedding
    ("block", j)     column j, the source labelled "block j" (j = 0: the embedding)
    [j, ...]         these columns (negative counts from the end)

A family absent at a site (no older blocks yet at an early layer) leaves that site unchanged; a
mask that would leave no source at all is an error. The attention-site mix of layer 0 does not
exist (the stack is empty there), so a mask at it does nothing.
"""

from __future__ import annotations

import numpy as np

from .._xp import array_namespace
from .hooks import Hooks
from .targets import at_positions, layer_sites, named

__all__ = ["SOURCE_FAMILIES", "mask_sources", "source_columns"]

# a partition of every site's sources: what `ke.source_ablation` masks one at a time
SOURCE_FAMILIES = ("embedding", "older_blocks", "latest_block", "current")
_NAMED = ("embedding", "current", "latest_block", "older_blocks", "blocks")


def check_family(family):
    """Raise a clear error for anything `source_columns` cannot resolve."""
    if isinstance(family, str):
        if family not in _NAMED:
            raise ValueError(f"source family must be one of {list(_NAMED)}, ('block', j) or a list of columns; got {family!r}")
    elif isinstance(family, tuple) and len(family) == 2 and family[0] == "block":
        if not isinstance(family[1], (int, np.integer)) or family[1] < 0:
            raise ValueError(f"('block', j): j must be an int >= 0 (a block of Trace.source_labels()), got {family[1]!r}")
    else:
        cols = list(family)
        if not cols or not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in cols):
            raise ValueError(f"source family must be a name, ('block', j) or a non-empty list of int columns; got {family!r}")
    return family


def source_columns(family, n_sources: int) -> list[int]:
    """The columns (0 .. n_sources - 1) a family covers at a site mixing `n_sources` = n + 1 sources."""
    check_family(family)
    n = n_sources - 1  # sealed blocks; column n is the current sum
    if family == "embedding":
        return [0] if n >= 1 else []
    if family == "current":
        return [n]
    if family == "latest_block":
        return [n - 1] if n >= 2 else []
    if family == "older_blocks":
        return list(range(1, n - 1))
    if family == "blocks":
        return list(range(1, n))
    if isinstance(family, tuple):
        return [int(family[1])] if int(family[1]) < n else []
    cols = sorted({int(c) % n_sources for c in family if -n_sources <= int(c) < n_sources})
    return cols


def masked_weights(p, cols: list[int]):
    """p [..., m] with `cols` zeroed and each row renormalised over the rest (dtype kept)."""
    xp = array_namespace(p)
    keep = np.ones(p.shape[-1], bool)
    keep[cols] = False
    q = p * xp.asarray(keep.astype(np.float32), dtype=p.dtype)
    return q / q.sum(axis=-1, keepdims=True)


def mask_sources(layer, site="both", sources="current", positions=None) -> Hooks:
    """Mask the source family `sources` at the block-residual site(s) of `layer` (see module docstring).

    layer: an int, a list / range of layers, "all", or "final" (the output mix before the final norm).
    site: "attn" (the mix before attention), "ffn" (before the FFN) or "both". positions: as for every
    intervention (None: every token; an int, a collection, a range, or a slice).
    """
    check_family(sources)
    if layer == "final":
        names = ["final.attn_res.weights"]
    else:
        if site not in ("attn", "ffn", "both"):
            raise ValueError(f"mask_sources: site must be 'attn', 'ffn' or 'both', got {site!r}")
        sites = ("attn", "ffn") if site == "both" else (site,)
        names = [n for s in sites for n in layer_sites(layer, f"attn_res.{s}.weights")]

    def mask(p, rows, hook):
        m = p.shape[-1]
        cols = source_columns(sources, m)
        if not cols:
            return None
        if len(cols) == m:
            raise ValueError(f"mask_sources at {hook.name}: masking {sources!r} leaves none of the {m} sources "
                             "(stored blocks..., current) to renormalise over")
        q = masked_weights(p, cols)
        if rows is None:
            return q
        return array_namespace(p).where(rows[:, None], q, p)

    hooks = Hooks()
    for name in names:
        hooks.add(name, at_positions(named(mask, f"mask_sources({sources!r})"), positions), chunks=True)
    return hooks
