"""Latent MoE over T tokens at once: the router for every row, the selections grouped by expert.

The equations are `latent_moe`'s (router, routing weights, latent down projection, routed experts,
ONE RMSNorm of each row's aggregate, up projection, shared experts), each over [T, .] rows.

Selection (`select_experts_rows`) gives every row exactly the ids `select_experts` gives it, ties
included: on the host in float32 by the token form's compiled step itself, all rows in one call;
elsewhere by argpartition / argsort, which promise no order among ties, so rows with a tie that decides
the set (k-th and (k+1)-th biased scores equal) or the order (two chosen unbiased scores equal) are
handed to `select_experts` itself; every other row has one right answer. Routing weights follow the token form's
routes too (its compiled step over all rows, or Python doubles on the host for few experts, float32 arrays
otherwise): bit for bit.

Experts: `expert_outputs_grouped` groups the T*k selections by expert (`latent_moe.group_selections`)
so that a bank reads each selected expert's weights once per chunk (`outputs_grouped` of
DenseExperts, PackedExperts, MappedExperts). Matmuls over rows and the per-row aggregation sum in
another order than the token form: float32 results agree to rounding, float64 to ~1e-15.
"""

from __future__ import annotations

import functools

import numpy as np

from .._xp import array_namespace
from ..backend import on_host, to_numpy
from . import latent_moe as moe
from . import sequence_ops, token_ops
from .latent_moe import RENORM_EPS, LatentMoeWeights, select_experts
from .ops import linear, rms_norm, sigmoid


def select_experts_rows(scores, bias, top_k: int):
    """scores: [T, E] -> ids [T, k]: row t is `select_experts(scores[t], bias, top_k)`, ties included.

    A partition finds each row's k largest biased scores and an argsort of those k orders them by
    unbiased score. Where the result is unique (the k-th and (k+1)-th biased scores differ and the k
    chosen unbiased scores are distinct: every row but a rare exact tie) it is what any correct top-k
    gives, the token form's included; a row with a tie is handed to `select_experts` itself (its own
    tie order). Cheaper than a stable sort of every row (the embedded model: 5x). Host float32 rows take the
    token form's compiled step itself, all rows in one call."""
    if token_ops.runs(scores, bias) and scores.ndim == 2 and top_k <= scores.shape[1]:
        return token_ops.select_experts(scores, bias, top_k)
    xp = array_namespace(scores)
    choice = moe.rank_keys(scores + bias)  # summed in the scores' dtype, as the token form does; NaN ranks as +inf
    T, E = scores.shape
    rows = xp.arange(T)[:, None]  # fancy indexing along rows: take_along_axis's result, without its Python cost
    if top_k < E:
        part = xp.argpartition(-choice, top_k, axis=1)  # [:, :k] the k largest (any order), [:, k] the next
        top = part[:, :top_k]
        kth = choice[rows, top].min(axis=1)
        tied = kth == choice[rows[:, 0], part[:, top_k]]
    else:
        top = xp.broadcast_to(xp.arange(E), (T, E))
        tied = xp.zeros(T, dtype=bool)
    chosen = moe.rank_keys(scores[rows, top])
    by_score = xp.argsort(-chosen, axis=1)  # unbiased descending
    ids, s = top[rows, by_score], chosen[rows, by_score]
    tied |= (s[:, 1:] == s[:, :-1]).any(axis=1)
    for t in np.flatnonzero(np.asarray(tied.get() if hasattr(tied, "get") else tied)).tolist():
        ids[t] = select_experts(scores[t], bias, top_k)  # its own tie order
    return ids


def router_scores(logits):
    """sigmoid(logits [T, E]) rounded as the token form rounds each token's ([E]: `ops.sigmoid`, on the host in
    float32 the compiled step, in double and rounded once). NumPy's float32 formula is up to ~3 ulp off and
    differs from it on about a third of the scores (every logit in 16.0 .. 16.6: 0.9999999 against
    0.99999994): the selection would see other numbers than stepping and resolve near-ties differently."""
    if token_ops.AVAILABLE and type(logits) is np.ndarray and logits.dtype == np.float32:
        return token_ops.sigmoid(np.ascontiguousarray(logits))
    return sigmoid(logits)


def routing_weights_rows(scores, ids, renormalize: bool, scaling: float):
    """[T, k]: row t is `routing_weights(scores[t], ids[t], ...)`, bit for bit (the same route per row).

    An id of -1 (a selection dropped for that token by a chunk-aware hook) gets weight 0 and the row's
    others renormalise over the rest, as the token form without it (to rounding on the array route).
    """
    xp = array_namespace(scores)
    ids = xp.asarray(ids)
    kept = ids >= 0
    if token_ops.runs(scores) and ids.ndim == 2 and ids.dtype.kind in "iu" and kept.all():  # (host scores: ids is NumPy's)
        # the token form's compiled step (its double route: `weights_in_double` holds), all rows in one call
        return token_ops.routing_weights(scores, np.ascontiguousarray(ids, np.int64), renormalize, scaling, RENORM_EPS)
    w = xp.where(kept, scores[xp.arange(ids.shape[0])[:, None], xp.where(kept, ids, 0)], 0.0).astype(scores.dtype)
    if moe.weights_in_double(scores):
        # the token form's double route: doubles summed left to right, each weight rounded once at the end
        w64 = w.astype(np.float64)
        c = scaling
        if renormalize:
            total = np.zeros(w64.shape[0])
            for j in range(w64.shape[1]):
                total = total + w64[:, j]
            c = (scaling / (total + RENORM_EPS))[:, None]
        return (w64 * c).astype(scores.dtype)
    if renormalize:
        w = w / (w.sum(axis=1, keepdims=True) + RENORM_EPS)
    return w * scaling


def expert_outputs_grouped(experts, ids, z, act):
    """y[t, j] = w2_e act(w13_e z[t]) for e = ids[t, j]: [T, k, l] (z: the latents [T, l]).

    A bank's own `outputs_grouped` reads each selected expert once; any other bank with `gather` is
    asked for one expert at a time (the same grouping).
    """
    own = getattr(experts, "outputs_grouped", None)
    if own is not None:
        return own(ids, z, act)
    xp = array_namespace(z)
    groups = moe.group_selections(ids)
    zs = z[xp.asarray(groups.rows)]
    parts = []
    for e, a, b in groups:
        w13, w2 = experts.gather(np.array([e]))
        parts.append(act(zs[a:b] @ w13[0].T) @ w2[0].T)
    y = xp.concatenate(parts) if parts else xp.zeros((0, z.shape[1]), z.dtype)
    return groups.scatter(y)


# A chunk's routing rows are ragged when a hook gives some tokens other experts: a weight slot no weight was given
# for (an intervention's row shorter than the chunk's, `inspection.interventions`) holds this, never a weight.
NO_WEIGHT = -np.inf


def _paired_weights(weights, ids, name: str):
    """Each token's weights one per selected expert, as the token form requires of a hook: a row with `NO_WEIGHT`
    where an expert is selected, or a non-zero weight where none is (id -1), was given as many weights as another
    row's experts. Every slot of no expert then weighs 0, a NaN there too (a Trace's padding of ragged rows: the token
    form has no such slot, and NaN times the slot's zero output would make the token's output NaN)."""
    w, i = to_numpy(weights), to_numpy(ids)
    missing = w == NO_WEIGHT
    bad = (missing & (i >= 0)) | ((i < 0) & ~missing & (w != 0) & ~np.isnan(w))
    if bad.any():
        t = int(np.argmax(bad.any(axis=1)))
        experts = [int(e) for e in i[t] if e >= 0]
        given = [float(v) for v, e in zip(w[t], i[t], strict=True) if v != NO_WEIGHT and (e >= 0 or v != 0)]
        raise ValueError(f"{name}: token {t} of the chunk has {len(given)} weights {given} for the {len(experts)} selected "
                         f"experts {experts}: give one weight per expert (stepping raises the same). A chunk's weight of "
                         f"-inf marks a slot no weight was given for (an intervention's shorter row), so a hook's own -inf "
                         f"weight is refused here too (stepping would carry it into NaN logits)")
    empty = missing | (i < 0)
    if not empty.any():
        return weights
    return array_namespace(weights).asarray(np.where(empty, 0.0, w).astype(w.dtype))


def _check_ids(ids, E: int, name: str) -> None:
    """The ids a hook returned: -1 (that selection dropped) or an expert 0..E-1, never silently another expert."""
    ids = to_numpy(ids)
    bad = ids[(ids < -1) | (ids >= E)] if ids.dtype.kind in "iu" else ids
    if ids.ndim != 2 or bad.size:
        raise ValueError(f"{name}: a hook returned expert ids {ids.dtype} {ids.shape} with "
                         f"{sorted(set(bad.reshape(-1).tolist()))[:5]}: expected integers [T, k], each -1 (drop that "
                         f"selection) or an expert 0..{E - 1}")


def _situ_rows(w: LatentMoeWeights):
    """The layer's SiTU-GLU on rows: compiled in one pass where it runs (`sequence_ops`), else `w.situ`. A partial, so
    that a bank's compiled experts (`sequence_ops.experts_grouped`) read which activation it is, and its constants."""
    return functools.partial(sequence_ops.situ_and_mul_rows, beta=w.situ_beta, linear_beta=w.situ_linear_beta,
                             fallback=w.situ)


def latent_moe_sequence(x, w: LatentMoeWeights, *, fire=None, names=None, observe=None):
    """x: [T, d] (post_attention_layernorm outputs) -> [T, d].

    fire(name, value) -> value, when given, sees whole-chunk arrays at the token form's sites, in its
    order, named names[kind] (None: the kinds): moe.router.scores [T, E], moe.router.topk_ids [T, k]
    (another [T, k'] may be returned, and -1 entries drop that selection of that token: its weight is
    0 and the others renormalise, as the token form without it), moe.router.topk_weights [T, k] (one per
    id: a hook's weights of another shape raise, and so do rows that leave a selected expert without a weight,
    `NO_WEIGHT`, or weight an id -1), moe.experts_out [T, l] (the weighted sum before the latent
    norm), moe.routed_out, moe.shared_out [T, d].
    observe(name, value), when given, is told the ids the layer routes by (at moe.router.topk_ids, after every hook
    there, before the weights fire): a hook set that saw the ids before a later one changed them (a Recorder
    dropping the weights of -1 ids) learns them (`Hooks.observe_chunk`).
    """
    xp = array_namespace(x)
    site = (lambda kind: kind) if names is None else names.__getitem__  # noqa: E731
    E, l = w.num_experts, w.latent_size
    y = linear(x, w.in_proj)  # [T, E + l + 2 Ish]
    scores = router_scores(y[:, :E])
    if fire is not None:
        scores = fire(site("moe.router.scores"), scores)
    ids = select_experts_rows(scores, w.e_score_correction_bias, w.top_k)
    if fire is not None:
        hooked = fire(site("moe.router.topk_ids"), ids)
        if on_host(hooked) or hooked is not ids:  # on a GPU, ids a hook returned anew (one transfer; unchanged: none)
            _check_ids(hooked, E, site("moe.router.topk_ids"))
        ids = hooked
        if observe is not None:
            observe(site("moe.router.topk_ids"), ids)
    weights = routing_weights_rows(scores, ids, w.renormalize, w.routed_scaling_factor)
    if fire is not None:
        computed, weights = weights, fire(site("moe.router.topk_weights"), weights)
        if weights.shape != ids.shape:  # (the token form's check: else a matmul's shape error, naming no site)
            raise ValueError(f"{site('moe.router.topk_weights')}: a hook returned weights {tuple(weights.shape)} for the "
                             f"selected experts {tuple(ids.shape)} [T, k]: give one weight per expert")
        if weights is not computed:  # weights a hook returned anew (on a GPU: one transfer; unchanged: none)
            weights = _paired_weights(weights, ids, site("moe.router.topk_weights"))

    act = _situ_rows(w)
    routed_y = expert_outputs_grouped(w.experts, ids, y[:, E : E + l], act)  # [T, k, l], zeros where ids = -1
    u = xp.matmul(weights[:, None, :], routed_y)[:, 0]  # [T, l]
    if fire is not None:
        u = fire(site("moe.experts_out"), u)
    if w.use_latent_norm:
        u = rms_norm(u, w.routed_expert_norm, w.eps)
    routed = linear(u, w.routed_expert_up_proj)
    shared = linear(act(y[:, E + l :]), w.shared_down_proj)
    if fire is not None:
        routed = fire(site("moe.routed_out"), routed)
        shared = fire(site("moe.shared_out"), shared)
    return routed + shared
