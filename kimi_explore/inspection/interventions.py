"""Interventions: ready-made hooks that change what K3 computes, built on the `Hooks` contract.

Each function returns a `Hooks` you can pass as `hooks=`, merge (`hooks.extend(...)`, `a + b`), or
apply for a while with `session.intervene(...)`. `positions=` (an int, a collection or range of 0-based
token positions, or a slice: `slice(a, b)`, `slice(a, None)` from a on) restricts any of them to those
tokens; by default they act at every token. `layer=` takes an int, a list or range of distinct layers,
or "all" (every layer that has the site), except `override_attn_res`, which takes one layer (`targets.py`).

    ablate_experts(layer, experts)        drop experts from the selected set; the decoder renormalises the
                                          weights over the rest (all of them -> the routed output is 0)
    force_routing(layer, expert_ids, weights=None)
                                          use these experts (weights recomputed from their scores, or given)
    override_attn_res(layer, site, weights)
                                          replace a block-residual softmax: "uniform", ("one_hot", j), or a
                                          vector over [stored blocks..., current]; layer="final" for the output mix
    mask_sources(layer, site, sources)    mask a block-residual source family ("embedding", "current",
                                          "latest_block", "older_blocks", "blocks", ("block", j), or columns)
                                          and renormalise the softmax over the rest (source_masks.py)
    scale_kda_head(layer, head, factor)   scale a KDA head's recurrent state after each update (0 zeroes it);
                                          the scaled state is what the next token starts from
    patch(name, source, positions=None)   clean/corrupt patching: put a value recorded in another run
                                          (a Trace, a Recorder, an array [T, ...] or {position: value}) in place

A source column j (`mask_sources`' columns and ("block", j), `override_attn_res`'s ("one_hot", j)) is a
model-wide column of `Trace.source_labels()` at every layer; how it lands at a site that has not sealed
every block yet is stated once, in `source_masks.py`.

On the sequence path each takes whole chunks (`Hooks.add(..., chunks=True)`): the chunk's rows at the
wanted positions are changed at once; except `scale_kda_head`, which changes the recurrent state, which
the chunked form never builds per token: its layer runs token by token there (the chunk's other layers
stay chunked), its results equal to stepping's to rounding. Routing ids of a chunk are [T, k] with -1 where a
token has fewer experts (the MoE gives -1 no weight); a Recorder records each token's ids without them, as stepping
does.
"""

from __future__ import annotations

import numpy as np

from .._xp import array_namespace
from ..backend import to_numpy
from ..model.latent_moe_sequence import NO_WEIGHT
from .hooks import Hooks
from .source_masks import SOURCE_FAMILIES, mask_sources, model_sources, site_columns, source_columns
from .targets import at_positions, index_list, layer_ids, layer_sites, named, number, position_filter, position_list

__all__ = ["SOURCE_FAMILIES", "ablate_experts", "force_routing", "mask_sources", "override_attn_res", "patch",
           "scale_kda_head", "source_columns", "zero_kda_head"]


def ablate_experts(layer, experts, positions=None) -> Hooks:
    """Drop `experts` ("all", or ids) from the routed selection at `layer`; weights renormalise over the rest."""
    drop_all = isinstance(experts, str)
    if drop_all and experts != "all":
        raise ValueError(f"ablate_experts: experts must be 'all' or a list of expert ids, got {experts!r}")
    drop = [] if drop_all else index_list(experts, "ablate_experts: experts")
    if any(e < 0 for e in drop):  # -1 marks a dropped slot: it would match nothing and ablate nothing
        raise ValueError(f"ablate_experts: expert ids {[e for e in drop if e < 0]} must be >= 0")
    seen = {}  # layer -> number of experts (from the router's scores): an id past it would ablate nothing

    def note_experts(scores, *, hook):
        seen[hook.layer] = scores.shape[-1]

    def ablate(ids, rows, hook):
        E = seen.get(hook.layer)
        bad = [e for e in drop if E is not None and e >= E]
        if bad:
            raise ValueError(f"ablate_experts at {hook.name}: expert ids {bad} are outside 0..{E - 1}")
        xp = array_namespace(ids)
        dropped = xp.ones(ids.shape, bool) if drop_all else xp.isin(ids, xp.asarray(drop, dtype=ids.dtype))
        if rows is None:
            return ids[~dropped]
        return xp.where(dropped & rows[:, None], -1, ids)

    hooks = Hooks()
    for name in layer_sites(layer, "moe.router."):
        if drop:
            hooks.add(name + "scores", note_experts, chunks=True)
        hooks.add(name + "topk_ids", at_positions(named(ablate, f"ablate_experts({experts!r})"), positions), chunks=True)
    return hooks


def force_routing(layer, expert_ids, weights=None, positions=None) -> Hooks:
    """Route through `expert_ids` at `layer`. Without `weights` the decoder recomputes them from these
    experts' scores (renormalised, scaled) as it does for its own choice; with them, they are used as given."""
    ids_req = index_list(expert_ids, "force_routing: expert_ids")
    if len(set(ids_req)) != len(ids_req):
        raise ValueError(f"force_routing: expert_ids has duplicates: {ids_req}")
    if min(ids_req) < 0:  # (refused now, not when a feed reaches the layer, halfway through its tokens)
        raise ValueError(f"force_routing: expert_ids are >= 0, got {ids_req}")
    if weights is not None:
        given = np.atleast_1d(to_numpy(weights))  # a GPU array is fine too
        if given.dtype.kind not in "iuf" or given.ndim != 1 or not np.isfinite(given).all():
            raise ValueError(f"force_routing: weights must be finite real numbers, one per expert, got {weights!r}")
        weights = given.astype(float)  # (a copy)
    if weights is not None and len(weights) != len(ids_req):
        raise ValueError(f"force_routing: {len(weights)} weights for {len(ids_req)} experts")
    seen = {}

    def note_experts(scores, *, hook):
        seen[hook.layer] = scores.shape[-1]

    def forced_ids(ids, rows, hook):
        E = seen.get(hook.layer)
        bad = [e for e in ids_req if not 0 <= e < (E if E is not None else 1 << 62)]
        if bad:
            raise ValueError(f"force_routing at {hook.name}: expert ids {bad} are outside 0..{E - 1}")
        return _put_rows(ids, ids_req, rows, -1)

    def forced_weights(w, rows, hook):
        return _put_rows(w, weights, rows, NO_WEIGHT)

    hooks = Hooks()
    for name in layer_sites(layer, "moe.router."):
        hooks.add(name + "scores", note_experts, chunks=True)
        hooks.add(name + "topk_ids", at_positions(named(forced_ids, f"force_routing({ids_req})"), positions), chunks=True)
        if weights is not None:
            fn = at_positions(named(forced_weights, "force_routing.weights"), positions)
            hooks.add(name + "topk_weights", fn, chunks=True)
    return hooks


def _put_rows(value, given, rows, fill):
    """`given` [k'] as the value (one token, rows None), or in the masked rows of a chunk [T, k]: the
    chunk widened to max(k, k') with `fill` where a row has fewer entries."""
    xp = array_namespace(value)
    if rows is None:  # a new array every token: a later hook may edit it in place, a recorder keeps it
        return xp.array(given, dtype=value.dtype, copy=True)
    given = xp.asarray(given, dtype=value.dtype)
    T, k, k2 = value.shape[0], value.shape[1], given.shape[0]
    out = xp.full((T, max(k, k2)), fill, dtype=value.dtype)
    out[:, :k] = value
    out[rows] = fill
    out[rows, :k2] = given
    return out


def override_attn_res(layer, site=None, weights="uniform", positions=None) -> Hooks:
    """Replace the block-residual softmax at (layer, site) with `weights`.

    layer: int, or "final" for the output mix (then site is ignored). site: "attn" (before attention)
    or "ffn" (before the FFN). weights: "uniform"; ("one_hot", j) with j a model-wide source column
    (`source_masks.py`; "current" or -1 is the running sum), an error at a site that does not mix that
    source; or an array over the site's own sources [stored blocks..., current].
    """
    if layer == "final":
        name = "final.attn_res.weights"
    elif isinstance(layer, str):
        raise ValueError(f"override_attn_res: layer must be one layer (an int) or 'final', got {layer!r}")
    else:
        if site not in ("attn", "ffn"):
            raise ValueError(f"override_attn_res: site must be 'attn' or 'ffn', got {site!r}")
        ids = layer_ids(layer)
        if len(ids) != 1:  # (the first of several was taken silently)
            raise ValueError(f"override_attn_res: layer must be one layer (or 'final'), got {layer!r}; add one "
                             "override per layer (hooks + hooks)")
        name = f"layers.{ids[0]}.attn_res.{site}.weights"
    if isinstance(weights, str):
        if weights != "uniform":
            raise ValueError(f"override_attn_res: weights must be 'uniform', ('one_hot', j) or an array, got {weights!r}")
        mode = "uniform"
    elif isinstance(weights, tuple) and len(weights) == 2 and weights[0] == "one_hot":
        j = weights[1]
        if not (j == "current" or isinstance(j, (int, np.integer)) and not isinstance(j, bool)):
            raise ValueError(f"override_attn_res: ('one_hot', j) needs j a source column (int) or 'current', got {j!r}")
        mode, j = "one_hot", (-1 if j == "current" else int(j))
    else:
        try:
            if isinstance(weights, tuple) and weights and isinstance(weights[0], str):
                raise ValueError("a tagged tuple other than ('one_hot', j)")
            mode, given = "given", np.array(to_numpy(weights), dtype=float, copy=True)  # not the caller's array
        except (TypeError, ValueError):
            raise ValueError(f"override_attn_res: weights must be 'uniform', ('one_hot', j) or an array of numbers, "
                             f"got {weights!r}") from None
        if given.ndim != 1:
            raise ValueError(f"override_attn_res: a weight vector must be 1-D, got shape {given.shape}")

    def override(p, rows, hook):
        xp, n = array_namespace(p), p.shape[-1]
        if mode == "uniform":
            new = xp.full(n, 1.0 / n, dtype=p.dtype)
        elif mode == "one_hot":
            S, where = model_sources(hook, n), f"override_attn_res(('one_hot', {weights[1]!r})) at {hook.name}"
            col = site_columns([j], n, S, where)
            if not col:
                raise ValueError(f"{where}: this site does not mix source column {j} (block {j % S}, sealed after it); it "
                                 f"mixes {n} sources: blocks {list(range(n - 1))} and the current sum (column {S - 1})")
            new = xp.zeros(n, dtype=p.dtype)
            new[col[0]] = 1.0
        else:
            if given.shape[0] != n:
                raise ValueError(f"override_attn_res at {hook.name}: got {given.shape[0]} weights, this site mixes {n} "
                                 "sources (stored blocks..., current)")
            new = xp.array(given, dtype=p.dtype, copy=True)  # a new array every token (edited in place, recorded)
        if rows is None:
            return new
        out = p.copy()
        out[rows] = new
        return out

    hooks = Hooks()
    hooks.add(name, at_positions(named(override, f"override_attn_res({weights!r})"), positions), chunks=True)
    return hooks


def scale_kda_head(layer, head, factor: float, positions=None) -> Hooks:
    """Multiply KDA head(s) `head`'s recurrent state by `factor` after each token's update (0 zeroes it).

    The decoder reads the head's output from, and carries to the next token, the scaled state. A head given
    twice is scaled once; a layer given twice is refused (`targets.layer_ids`). On the sequence path its
    layers run token by token, the chunk's other layers chunked (results equal to stepping's to rounding).
    """
    heads = index_list(head, "scale_kda_head: head")
    if min(heads) < 0:  # ids count from 0, as every intervention's (expert ids, layers, positions refuse -1 too)
        raise ValueError(f"scale_kda_head: head ids are >= 0, got {heads}")
    factor = number(factor, "scale_kda_head: factor")

    def scale(S, rows, hook):
        if max(heads) >= S.shape[0]:
            raise ValueError(f"scale_kda_head at {hook.name}: heads {heads} do not exist, the layer has {S.shape[0]} heads")
        out = S.copy()
        out[heads] *= factor
        return out

    hooks = Hooks()
    for name in layer_sites(layer, "kda.state"):
        hooks.add(name, at_positions(named(scale, f"scale_kda_head({heads}, {factor})"), positions), chunks=True)
    return hooks


def zero_kda_head(layer, head, positions=None) -> Hooks:
    """`scale_kda_head(layer, head, 0.0)`."""
    return scale_kda_head(layer, head, 0.0, positions)


def patch(name: str, source, positions=None) -> Hooks:
    """Replace the value at site `name` by the one another run recorded there, token position by position.

    source: a Trace or Recorder that recorded `name` in full (Recorder(full=[name])), an array
    [T, ...] (row p is used at position p) or a dict {position: value}. positions: where to patch
    (default: every position the source has). Padding a Trace added to ragged records is stripped.
    """
    from .recorder import Recorder
    from .trace import Trace

    if isinstance(source, Recorder):
        source = source.trace()
    if isinstance(source, Trace):
        rows = source[name]
        table = {int(p): rows[t] for t, p in enumerate(source.positions)}
        if len(table) != len(source.positions):  # a recorder kept over several texts (each from position 0)
            again = sorted({int(p) for p in source.positions if np.count_nonzero(source.positions == p) > 1})
            raise ValueError(f"patch({name!r}): the source trace has positions {again[:10]} more than once (several "
                             "texts in one recorder); patch from one text's rows: trace.window(start, stop)")
    elif isinstance(source, dict):  # its keys checked as positions= is (ints >= 0: -1 is no "last token" here)
        try:
            position_list(list(source))
        except (TypeError, ValueError) as e:
            raise type(e)(f"patch({name!r}): the source dict's keys must be token positions: {e}") from None
        table = {int(p): to_numpy(v) for p, v in source.items()}
    else:
        rows = to_numpy(source)
        table = {p: rows[p] for p in range(rows.shape[0])}
    if isinstance(positions, slice):  # every position of the source in the slice (checked as for any intervention)
        acts = position_filter(positions)[1]
        inside = [p for p in sorted(table) if acts(p)]
        if not inside:
            raise ValueError(f"patch({name!r}): the source has no value at positions {positions} (it has "
                             f"{sorted(table)[:10]}...)")
        positions = inside
    if positions is not None:
        wanted = position_list(positions)
        missing = [p for p in wanted if p not in table]
        if missing:
            raise ValueError(f"patch({name!r}): the source has no value at positions {missing} (it has {sorted(table)[:10]}...)")
        table = {p: table[p] for p in wanted}

    ids_site = name.endswith("moe.router.topk_ids")
    # routing rows are ragged: a row is cut to its own entries and a chunk's row filled after them (ids -1: no
    # expert; weights NO_WEIGHT, which the MoE checks against the ids), never with the trace's padding (a NaN weight
    # made the whole chunk NaN)
    routing, fill = ids_site or name.endswith("moe.router.topk_weights"), -1 if ids_site else NO_WEIGHT
    probs_site = name.endswith("mla.probs")  # a chunk's rows [nh, L0 + T]: the token form's [nh, L0 + t + 1], then masked

    def patch_value(value, *, hook):
        xp = array_namespace(value)
        if hook.positions is None:
            row = table.get(hook.position)
            return None if row is None else xp.array(_unpad(row, value.shape, hook.name), dtype=value.dtype, copy=True)
        todo = [(t, table[int(p)]) for t, p in enumerate(hook.positions) if int(p) in table]
        if not todo:
            return None
        if probs_site:  # token t of the chunk sees L0 + t + 1 positions; the rest of its row is masked (0, never NaN)
            T, L = value.shape[0], value.shape[-1]
            out = value.copy()
            for t, row in todo:
                n = L - (T - 1 - t)
                out[t] = 0
                out[t, ..., :n] = xp.asarray(_unpad(row, value.shape[1:-1] + (n,), hook.name), dtype=value.dtype)
            return out
        rows = [(t, _unpad(row, value.shape[1:], hook.name)) for t, row in todo]
        width = max([value.shape[-1]] + [r.shape[-1] for _, r in rows]) if routing else value.shape[-1]
        out = xp.full((value.shape[0], width), fill, dtype=value.dtype) if routing else value.copy()
        if routing:
            out[:, : value.shape[1]] = value
        for t, row in rows:
            if routing:
                out[t] = fill
                out[t, : row.shape[0]] = xp.asarray(row, dtype=value.dtype)
            else:
                out[t] = xp.asarray(row, dtype=value.dtype)
        return out

    hooks = Hooks()
    hooks.add(name, named(patch_value, f"patch({name!r}, positions={sorted(table)})"), chunks=True)
    return hooks


def _unpad(row: np.ndarray, shape: tuple, name: str) -> np.ndarray:
    """Cut a padded trace row back to the site's shape; only padding (NaN / -1) may be cut."""
    row = np.asarray(row)
    if name.endswith("moe.router.topk_ids"):
        return row[row != -1]
    if name.endswith("moe.router.topk_weights"):  # NaN: the padding of a shorter top-k
        return row[~np.isnan(row)]
    if row.shape == shape:
        return row
    if row.ndim == len(shape) and all(r >= s for r, s in zip(row.shape, shape, strict=True)):
        cut = row[tuple(slice(0, s) for s in shape)]
        rest = row.copy()
        rest[tuple(slice(0, s) for s in shape)] = np.nan if row.dtype.kind in "fc" else -1
        if np.all(np.isnan(rest)) if row.dtype.kind in "fc" else np.all(rest == -1):
            return cut
    raise ValueError(f"patch at {name}: the source value has shape {row.shape}, this site needs {tuple(shape)}")
