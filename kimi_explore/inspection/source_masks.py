"""Mask block-residual sources: drop a family of sources from a block-residual softmax and renormalise.

At each block-residual site the decoder mixes the sources [b_0, ..., b_{n-1}, current] with softmax
weights p (model/block_residual.py; b_0 is the embedding: layer 0 pushes its raw input first). A
mask over a set M of source columns replaces p by

    p'_j = p_j [j not in M] / sum_{k not in M} p_k                the softmax renormalised over the rest

which is what the softmax would give if the masked scores were -inf. It acts through the
`layers.{i}.attn_res.{attn,ffn}.weights` hook sites (the value returned there is what the mix
uses), at the positions asked for, on the token form and on whole chunks of the sequence path alike.

Source columns, the one rule for every intervention that names a source (`mask_sources`' [j, ...] and
("block", j), `override_attn_res`'s ("one_hot", j)): they are the MODEL-WIDE columns of
`Trace.source_labels()` / `Trace.attn_res_weights()`, the same at every layer. With S = the model's
`max_sources` (every block it stores, plus the current sum): column j < S - 1 is block j (0: the
embedding), column S - 1 is the current running sum; negative j counts from the end (-1: current).
A site mixes only the n blocks sealed before it, so model-wide column j is its own column j for j < n,
the current sum is its column n, and a block sealed after the site is not there. (A weight vector
given to `override_attn_res` is the site's own: one weight per source it mixes.) The model's S comes
from the Hooks the intervention runs in once bound to the weights (a Session's are; `hooks.bind(weights)`);
unbound, a column the site cannot settle by itself (one past its sealed blocks, other than -1) is an error.

Source families, resolved at each site from its number of sources m = n + 1 (`source_columns`):

    "embedding"      column 0 (the embedding, b_0)
    "current"        the current running sum (the site's column n)
    "latest_block"   the newest sealed block, n - 1 (when n >= 2: b_0 is the embedding)
    "older_blocks"   columns 1 .. n - 2: sealed blocks before the newest, the embedding excluded
    "blocks"         columns 1 .. n - 1: every sealed block but the embedding
    ("block", j)     the source labelled "block j" (j = 0: the embedding)
    [j, ...]         these model-wide columns

A family or column absent at a site (no older blocks yet at an early layer, a block sealed later)
leaves that site unchanged; a column or block the model does not have at all, or a mask that would
leave no source, is an error. A layer with nothing sealed before its attention (layer 0; on a layer subset, its
layers up to its first pushing layer) has no attention-site mix: site="both" masks its FFN-site mix alone, and
site="attn" there is refused (not a hook point of the model), as is a layer the model lacks. There, too, the FFN-site
mix holds the current sum alone: masking it would leave nothing, an error for a layer named, and skipped by
layer="all" (it mixes nothing). On a layer subset that starts after layer 0, column 0 is the input of its first
pushing layer (the embedding plus every earlier layer's output; `Trace.source_labels()` calls it "input of layer
k"), and "embedding" and ("block", 0) name that column.
"""

from __future__ import annotations

import numpy as np

from .._xp import array_namespace
from .hooks import Hooks
from .targets import at_positions, layer_sites, named

__all__ = ["SOURCE_FAMILIES", "mask_sources", "model_sources", "site_columns", "source_columns"]

# a partition of every site's sources: what `ke.source_ablation` masks one at a time
SOURCE_FAMILIES = ("embedding", "older_blocks", "latest_block", "current")
_NAMED = ("embedding", "current", "latest_block", "older_blocks", "blocks")


def _is_block(family) -> bool:
    """Whether a family is ('block', j); any other tuple is columns, as a list is."""
    return isinstance(family, tuple) and len(family) == 2 and isinstance(family[0], str) and family[0] == "block"


def check_family(family):
    """Raise a clear error for anything `source_columns` cannot resolve."""
    if isinstance(family, str):
        if family not in _NAMED:
            raise ValueError(f"source family must be one of {list(_NAMED)}, ('block', j) or a list of columns; got {family!r}")
    elif _is_block(family):
        if not isinstance(family[1], (int, np.integer)) or isinstance(family[1], bool) or family[1] < 0:
            raise ValueError(f"('block', j): j must be an int >= 0 (a block of Trace.source_labels()), got {family[1]!r}")
    else:
        cols = list(family) if hasattr(family, "__iter__") else None  # (a list, tuple, set, range or array)
        if not cols or not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in cols):
            raise ValueError(f"source family must be a name, ('block', j) or a non-empty list of int columns; got {family!r}"
                             + (f" (one column: [{family}])" if isinstance(family, (int, np.integer)) else ""))
    return family


def site_columns(columns, n_sources: int, max_sources: int | None, where: str = "source columns") -> list[int]:
    """Model-wide source columns (module docstring) -> the columns (0 .. n_sources - 1) of a site mixing `n_sources`
    = n + 1 sources, those it has (a block sealed after the site has none). max_sources None: the model's count is
    unknown (unbound hooks): only a sealed block (j < n) and -1 (current) resolve, any other column raises."""
    n = n_sources - 1
    out = set()
    for j in map(int, columns):
        if max_sources is None:
            if j != -1 and not 0 <= j < n:
                raise ValueError(f"{where}: source column {j} is past the {n} block(s) sealed at this site, so it is a "
                                 "later block or the current sum depending on the model's number of sources, which these "
                                 "hooks do not know: bind them to the model (hooks.bind(weights); a Session's are), or "
                                 "name the source ('current', ('block', j))")
            out.add(n if j == -1 else j)
            continue
        if not -max_sources <= j < max_sources:
            raise ValueError(f"{where}: source column {j} does not exist: the model has {max_sources} source columns "
                             f"(Trace.source_labels(): blocks 0..{max_sources - 2}, the current sum {max_sources - 1}; "
                             "negative counts from the end)")
        j %= max_sources
        if j == max_sources - 1:
            out.add(n)
        elif j < n:
            out.add(j)
    return sorted(out)


def source_columns(family, n_sources: int, max_sources: int | None = None, where: str = "source_columns") -> list[int]:
    """The columns (0 .. n_sources - 1) a family covers at a site mixing `n_sources` = n + 1 sources.

    max_sources: the model's number of source columns (`Trace.max_sources`), which integer columns count in
    (module docstring); None: unknown, see `site_columns`. Named families need neither."""
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
    if _is_block(family):
        j = int(family[1])
        if max_sources is not None and j >= max_sources - 1:
            raise ValueError(f"{where}: ('block', {j}) does not exist: the model stores blocks 0..{max_sources - 2} "
                             "(Trace.source_labels())")
        return [j] if j < n else []
    return site_columns(family, n_sources, max_sources, where)


def model_sources(hook, n_sources: int) -> int | None:
    """The model's number of source columns at this hook: known to Hooks bound to the weights; the output mix
    ("final.attn_res.weights") reads every source. None where unknown."""
    if hook.max_sources is not None:
        return hook.max_sources
    return n_sources if hook.layer is None else None


def masked_weights(p, cols: list[int]):
    """p [..., m] with `cols` zeroed and each row renormalised over the rest (dtype kept)."""
    xp = array_namespace(p)
    keep = np.ones(p.shape[-1], bool)
    keep[cols] = False
    q = p * xp.asarray(keep.astype(np.float32), dtype=p.dtype)
    return q / q.sum(axis=-1, keepdims=True)


def mask_sources(layer, site="both", sources="current", positions=None) -> Hooks:
    """Mask the source family `sources` at the block-residual site(s) of `layer` (see module docstring).

    layer: an int, a list / range of layers, "all" (every mix that mixes: a mix of the current sum alone is
    skipped), or "final" (the output mix before the final norm).
    site: "attn" (the mix before attention), "ffn" (before the FFN) or "both". positions: as for every
    intervention (None: every token; an int, a collection, a range, or a slice).
    """
    check_family(sources)
    every = isinstance(layer, str) and layer == "all"
    if layer == "final":
        names = ["final.attn_res.weights"]
    else:
        if site not in ("attn", "ffn", "both"):
            raise ValueError(f"mask_sources: site must be 'attn', 'ffn' or 'both', got {site!r}")
        # "both": the glob layers.{i}.attn_res.*.weights, which a layer with nothing sealed before its attention
        # matches at its FFN-site mix only (module docstring)
        kind = "attn_res.*.weights" if site == "both" else f"attn_res.{site}.weights"
        names = layer_sites(layer, kind)

    def mask(p, rows, hook):
        m = p.shape[-1]
        cols = source_columns(sources, m, model_sources(hook, m), f"mask_sources({sources!r}) at {hook.name}")
        if not cols:
            return None
        if len(cols) == m:
            if every and m == 1:  # the current sum alone (a subset's layers before its first push): nothing is mixed
                return None
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
