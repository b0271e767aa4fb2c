"""Latent Mixture of Experts with a sigmoid router and shared experts: one token.

Shapes: d = hidden, E experts, k = top-k, l = routed_expert_hidden_size (latent), I = moe_intermediate.

    s     = sigmoid(x @ gate^T)                      [E]  fp32, unbiased scores
    ids   = topk(s + e_score_correction_bias, k)          bias used for SELECTION only
    w     = s[ids] / (sum s[ids] + 1e-20) * routed_scaling_factor   (renormalise when moe_renormalize and k > 1)
    z     = routed_expert_down_proj(x)               [l]  the latent
    y_e   = w2_e(SiTU([w1_e z | w3_e z]))            [l]  experts live in the latent space
    u     = routed_expert_norm(sum_e w_e y_e)        [l]  ONE RMSNorm on the aggregate (if latent_moe_use_norm)
    out   = routed_expert_up_proj(u) + shared(x)     [d]  shared experts read the full-width x, unweighted

Because routed_expert_norm is an RMSNorm of the weighted sum, a factor common to all k weights
(routed_scaling_factor, the renormalisation) cancels up to eps: check those on the recorded
weights, not on the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .._xp import array_namespace
from ..backend import on_host, to_numpy
from . import sequence_ops, token_ops
from .ops import naive_situ_and_mul, rms_norm, sigmoid, situ_and_mul, situ_inv_caps
from .sites import site_table

RENORM_EPS = 1e-20


@dataclass
class DenseExperts:
    """Routed experts held dequantised.

    w13: [E, 2I, l]  w1 (gate) rows, then w3 (up) rows
    w2:  [E, l, I]   down
    """

    w13: object
    w2: object

    route = "dequantised at load"

    def outputs_grouped(self, ids, z, act):
        """y[t, j] = w2_e act(w13_e z[t]) for e = ids[t, j]: [T, k, l] (z [T, l]), the selections grouped by
        expert so that each selected expert's weights are read once (`group_selections`)."""
        xp = array_namespace(z)
        groups = group_selections(ids)
        y = sequence_ops.experts_grouped(groups, z, self.w13, self.w2, act)  # compiled: host float32 SiTU-GLU experts
        if y is not None:
            return groups.scatter(y)
        dtype = xp.result_type(z.dtype, self.w13.dtype)
        zs = z[xp.asarray(groups.rows)]  # [n, l], sorted by expert
        h = xp.empty((groups.n, self.w13.shape[1]), dtype)
        for e, a, b in groups:  # written in place: no temporary per expert
            xp.matmul(zs[a:b], self.w13[e].T, out=h[a:b])
        h = act(h)
        y = xp.empty((groups.n, self.w2.shape[1]), dtype)
        for e, a, b in groups:
            xp.matmul(h[a:b], self.w2[e].T, out=y[a:b])
        return groups.scatter(y)

    def gather(self, ids):
        """The selected experts' weights: ([k, 2I, l], [k, l, I]), one gather each."""
        return self.w13[ids], self.w2[ids]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


@dataclass
class ExpertGroups:
    """The selections of a chunk (ids [T, k]) grouped by expert, for banks that read each expert once. An id
    of -1 is a dropped selection (a chunk-aware hook's): not grouped, its output row is 0.

    order:   [n] flat selection indices (t*k + j) sorted by expert, tokens ascending within an expert
    rows:    [n] the token of each sorted selection (order // k)
    experts: the distinct selected experts, ascending; bounds: their segments of `order` (len m + 1)
    """

    order: np.ndarray
    rows: np.ndarray
    experts: list
    bounds: list
    shape: tuple  # (T, k)

    @property
    def n(self) -> int:
        return len(self.order)

    def __iter__(self):
        """(expert, a, b): expert's selections are the sorted ones a..b-1."""
        return iter(zip(self.experts, self.bounds[:-1], self.bounds[1:], strict=True))

    def scatter(self, y):
        """Per-selection rows in sorted order [n, ...] -> [T, k, ...] in the selections' order."""
        xp = array_namespace(y)
        T, k = self.shape
        out = (xp.empty if self.n == T * k else xp.zeros)((T * k,) + tuple(y.shape[1:]), y.dtype)
        out[xp.asarray(self.order)] = y
        return out.reshape(self.shape + tuple(y.shape[1:]))


def group_selections(ids) -> ExpertGroups:
    """Group the selections ids [T, k] by expert (on the host: T*k small ints)."""
    ids = np.asarray(to_numpy(ids))
    if ids.ndim != 2:
        raise ValueError(f"expert ids: expected [T, k], got shape {ids.shape}")
    grouped = sequence_ops.group_ids(ids.reshape(-1))  # compiled: a counting sort (2-3x the argsort below at T k = 1024)
    if grouped is not None:
        order, experts, bounds = grouped
        return ExpertGroups(order, order // max(ids.shape[1], 1), experts, bounds, tuple(ids.shape))
    flat = ids.reshape(-1).astype(np.int16 if ids.size and -1 <= ids.min() and ids.max() < 2**15 else np.int64)
    order = np.argsort(flat, kind="stable")  # int16: NumPy's stable sort is then a radix sort, ~2.5x faster
    order = order[np.count_nonzero(flat < 0) :]  # dropped selections (-1) sort first: left out
    sorted_ids = flat[order]
    cuts = np.flatnonzero(np.diff(sorted_ids)) + 1
    bounds = [0, *cuts.tolist(), len(order)] if len(order) else [0]
    experts = sorted_ids[bounds[:-1]].tolist() if len(order) else []
    return ExpertGroups(order, order // max(ids.shape[1], 1), experts, bounds, tuple(ids.shape))


@dataclass
class LatentMoeWeights:
    """One MoE layer.

    in_proj:               [E + l + 2*Ish, d]  rows gate.weight (router) | routed_expert_down_proj |
                                               shared gate_proj | shared up_proj
    e_score_correction_bias: [E]
    experts:               DenseExperts, experts.PackedExperts, or any object with the same `gather`
    routed_expert_norm:    [l]
    routed_expert_up_proj: [d, l]
    shared_down_proj:      [d, Ish]   Ish = num_shared_experts * moe_intermediate_size (one fused MLP)
    """

    kind: ClassVar[str] = "moe"
    in_proj: object
    e_score_correction_bias: object
    experts: object
    routed_expert_norm: object
    routed_expert_up_proj: object
    shared_down_proj: object
    num_experts: int
    top_k: int
    latent_size: int
    renormalize: bool
    routed_scaling_factor: float
    use_latent_norm: bool
    eps: float
    situ_beta: float
    situ_linear_beta: float | None

    def __post_init__(self):
        self._inv_caps: dict = {}  # (shape or width, dtype) -> (situ_inv_caps, its constants) (derived, never loaded)
        self.one = array_namespace(self.routed_expert_norm).asarray(1.0, dtype=self.routed_expert_norm.dtype)  # 0-d

    def situ(self, gate_up):
        """SiTU-GLU with this layer's caps, the routed experts' [k, 2I] or the shared experts' [2 Ish]."""
        lb = self.situ_linear_beta
        if token_ops.runs(gate_up):  # the compiled step (no caps needed)
            return token_ops.situ(gate_up, self.situ_beta, lb)
        if lb is None:
            return situ_and_mul(gate_up, self.situ_beta, None)
        # small inputs (the token form's): the caps at the input's full shape, no broadcast (cheaper)
        key = (gate_up.shape if gate_up.size <= 4096 else gate_up.shape[-1:], gate_up.dtype)
        hit = self._inv_caps.get(key)
        if hit is None:
            xp, dt = array_namespace(gate_up), gate_up.dtype
            inv = situ_inv_caps(xp, gate_up.shape[-1] // 2, self.situ_beta, lb, dt)
            inv = xp.ascontiguousarray(xp.broadcast_to(inv, key[0]))
            hit = self._inv_caps[key] = (inv, (xp.asarray(1.0, dtype=dt), xp.asarray(self.situ_beta * lb, dtype=dt)))
        return situ_and_mul(gate_up, self.situ_beta, lb, *hit)


# Below this many experts, routing on the host runs as Python floats: sorting a dozen numbers costs
# less than the NumPy calls (argpartition, argsort, fancy indexing, ...) that would do it.
SMALL_ROUTER = 64


def select_experts(scores, bias, top_k: int):
    """Top-k of the biased scores; ids ordered by unbiased score (descending), ties by lower id.

    The biased scores are summed in the scores' dtype either way, so the selection sees the same
    numbers as an array implementation (a double-precision sum could break a float32 near-tie the
    other way). A NaN ranks as +inf, above every number (torch.topk ranks NaN first too): a NaN score
    is selected and its NaN weight reaches the output rather than being passed over. Every route
    (compiled, Python floats, arrays) gives the same ids, ties and NaN included.
    """
    if token_ops.runs(scores, bias) and top_k <= scores.shape[0]:
        return token_ops.select_experts(scores, bias, top_k)
    choice = scores + bias
    E = choice.shape[0]
    if E <= SMALL_ROUTER and (type(scores) is np.ndarray or on_host(scores)):
        key = [math.inf if c != c else c for c in choice.tolist()]
        top = sorted(range(E), key=key.__getitem__, reverse=True)[:top_k]  # sorted is stable
        s = [math.inf if c != c else c for c in scores.tolist()]
        return np.array(sorted(top, key=s.__getitem__, reverse=True), dtype=np.intp)
    ids = stable_argsort(-rank_keys(choice))[:top_k]  # (argpartition and NumPy's default argsort order ties arbitrarily)
    return ids[stable_argsort(-rank_keys(scores[ids]))]


def rank_keys(a):
    """a with NaN as +inf: the order `select_experts` ranks by."""
    xp = array_namespace(a)
    return xp.where(xp.isnan(a), math.inf, a)


def stable_argsort(a, axis: int = -1):
    """argsort keeping equal keys in index order (CuPy's argsort is stable and takes no `kind`)."""
    xp = array_namespace(a)
    return xp.argsort(a, axis=axis, kind="stable") if on_host(xp) else xp.argsort(a, axis=axis)


def routing_weights(scores, ids, renormalize: bool, scaling: float):
    """scores[ids], renormalised to sum 1 (+ RENORM_EPS) when asked, times `scaling`: [k].

    In double precision, each weight rounded once, where `weights_in_double(scores)` (host float32 scores:
    the compiled step when it takes them, else Python floats; any host dtype for a small router); else in
    the scores' dtype."""
    if not weights_in_double(scores):
        w = scores[ids]
        if renormalize:
            w = w / (w.sum() + RENORM_EPS)
        return w * scaling
    if token_ops.runs(scores) and type(ids) is np.ndarray and ids.ndim == 1 and ids.dtype.kind in "iu":
        # (a hook's ids may be a strided view, ids[::-1]: the compiled step reads them C-ordered)
        return token_ops.routing_weights(scores, np.ascontiguousarray(ids, dtype=np.int64), renormalize, scaling, RENORM_EPS)
    s = scores.tolist()
    w = [s[i] for i in ids.tolist()]
    total = 0.0
    for v in w:  # left to right, as the compiled step and the rows route (`sum` compensates from Python 3.12 on)
        total += v
    c = scaling / (total + RENORM_EPS) if renormalize else scaling
    return np.array([v * c for v in w], dtype=scores.dtype)


def weights_in_double(scores) -> bool:
    """Whether `routing_weights` computes these scores' ([E] or rows [T, E]) weights in double precision."""
    if not (type(scores) is np.ndarray or on_host(scores)):
        return False
    return scores.shape[-1] <= SMALL_ROUTER or (token_ops.AVAILABLE and scores.dtype == np.float32)


def expert_outputs(experts, ids, z, act):
    """y_e = w2_e(act(w13_e z)) for the selected experts: [k, l] (z: the latent [l]; act: [k, 2I] -> [k, I]).

    One gather and two batched matmuls; a bank with its own `outputs` (packed experts) computes
    the same thing its way, bit for bit.
    """
    own = getattr(experts, "outputs", None)
    if own is not None:
        return own(ids, z, act)
    xp = array_namespace(z)
    w13, w2 = experts.gather(ids)
    a = act(xp.matmul(w13, z))  # [k, I]
    return xp.matmul(w2, a[:, :, None])[:, :, 0]


def hooked_ids(ids, E: int, name: str, replaced: bool = True):
    """The ids a hook returned at a token's `moe.router.topk_ids`, checked: integers [k'], each an expert 0..E-1
    (a -1 would index the last expert; to drop a selection, return the ids without it). On a GPU only ids a hook
    `replaced` (returned anew) are checked, at one transfer of k ids: the recorder's unchanged ids cost nothing
    (and a GPU's fancy indexing wraps an id out of range around to another expert instead of raising)."""
    if on_host(ids) or replaced:
        a = to_numpy(ids)
        bad = a[(a < 0) | (a >= E)] if a.dtype.kind in "iu" else a
        if a.ndim != 1 or bad.size:
            raise ValueError(f"{name}: a hook returned expert ids {a.dtype} {a.shape} with "
                             f"{sorted(set(bad.reshape(-1).tolist()))[:5]}: expected integers [k], each an expert 0..{E - 1} "
                             "(to drop a selection, return the ids without it; -1 drops one only in a whole chunk [T, k])")
    return ids


def latent_moe(x, w: LatentMoeWeights, hooks=None, names=None):
    """x: [d] (post_attention_layernorm output) -> [d].

    hooks/names: the hooks at each listened-to site (`site_table(hooks, names)`) of `FFN_SITES["moe"]`; a returned value is
    used downstream (new `topk_ids` are re-weighted from the scores; `experts_out` [l] is the weighted
    sum of the experts' outputs before the latent norm).
    """
    E, l = w.num_experts, w.latent_size
    at = site_table(hooks, names)
    y = w.in_proj @ x
    scores = sigmoid(y[:E], w.one)
    if "moe.router.scores" in at:
        scores = at["moe.router.scores"](scores)
    ids = select_experts(scores, w.e_score_correction_bias, w.top_k)
    if "moe.router.topk_ids" in at:
        hooked = at["moe.router.topk_ids"](ids)
        ids = hooked_ids(hooked, E, names["moe.router.topk_ids"] if names else "moe.router.topk_ids", hooked is not ids)
    weights = routing_weights(scores, ids, w.renormalize, w.routed_scaling_factor)
    if "moe.router.topk_weights" in at:
        weights = at["moe.router.topk_weights"](weights)
        if weights.shape != ids.shape:
            raise ValueError(f"{'moe.router.topk_weights' if names is None else names['moe.router.topk_weights']}: a hook "
                             f"returned {weights.shape[0] if weights.ndim == 1 else weights.shape} weights for the "
                             f"{ids.shape[0]} selected experts {to_numpy(ids).tolist()}: give one weight per expert")

    u = weights @ expert_outputs(w.experts, ids, y[E : E + l], w.situ)
    if "moe.experts_out" in at:
        u = at["moe.experts_out"](u)
    if w.use_latent_norm:
        u = rms_norm(u, w.routed_expert_norm, w.eps)
    routed = w.routed_expert_up_proj @ u
    shared = w.shared_down_proj @ w.situ(y[E + l :])
    if "moe.routed_out" in at:
        routed = at["moe.routed_out"](routed)
    if "moe.shared_out" in at:
        shared = at["moe.shared_out"](shared)
    return routed + shared


def naive_latent_moe(x, w: LatentMoeWeights):
    """Float64 reference with a Python loop over experts. Returns (out [d], ids, weights)."""
    f64 = lambda a: np.asarray(to_numpy(a), dtype=np.float64)  # noqa: E731
    x = f64(x)
    E, l = w.num_experts, w.latent_size
    Win = f64(w.in_proj)
    gate_w, down_w, shared_w = Win[:E], Win[E : E + l], Win[E + l :]
    scores = 1.0 / (1.0 + np.exp(-(gate_w @ x)))
    biased = scores + f64(w.e_score_correction_bias)
    ids = sorted(range(E), key=lambda e: -biased[e])[: w.top_k]
    ids = sorted(ids, key=lambda e: -scores[e])
    weights = np.array([scores[e] for e in ids])
    if w.renormalize:
        weights = weights / (weights.sum() + RENORM_EPS)
    weights = weights * w.routed_scaling_factor
    z = down_w @ x
    u = np.zeros(l)
    for e, we in zip(ids, weights, strict=True):
        w13, w2 = (f64(a) for a in w.experts.gather(np.array([e])))
        u += we * (w2[0] @ naive_situ_and_mul(w13[0] @ z, w.situ_beta, w.situ_linear_beta))
    if w.use_latent_norm:
        u = u / np.sqrt(np.mean(u * u) + w.eps) * f64(w.routed_expert_norm)
    routed = f64(w.routed_expert_up_proj) @ u
    shared = f64(w.shared_down_proj) @ naive_situ_and_mul(shared_w @ x, w.situ_beta, w.situ_linear_beta)
    return routed + shared, np.array(ids), weights
