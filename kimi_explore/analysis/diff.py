"""Run diffs: what changed, site by site, between two runs (a session and its fork under an intervention, or two prompts).

Both runs are compared token position by position over their common length T = min(T_a, T_b)
(Traces must hold the same positions in those rows: windows with another start are refused),
every difference as b - a:

    attn_res        [T, L, site, S]  Δ block-residual softmax weights (site 0 attention, 1 FFN; NaN where absent)
    final_attn_res  [T, S]           Δ output-mix weights
    kda_state       [T, K, H]        Δ Frobenius norms of each KDA head's recurrent state (K KDA layers)
    jaccard         [T, M]           |A ∩ B| / |A ∪ B| of the top-k expert sets per MoE layer (1 when both empty)
    routing_changes list of (t, layer, removed ids, added ids) wherever the sets differ; t is the
                    ROW of the compared runs, not a history position: its position is positions[t]
    kl              [T]              KL(P_a || P_b) of the next-token distributions, in nats
    top1_a, top1_b  [T] the top-1 ids; -1 where a row's logits hold NaN (NaN has no order: no top-1)
    flips           [T] bool: the top-1 prediction changed (never where either run has no top-1)
    positions       [T] the history positions of the rows (0.. for sessions; a Trace window's own)

KL is exact when both runs have full logits (a `Session`, or a Trace that recorded "logits" in
full). From Traces holding only the top-k predictions it is the KL of the coarse-grained
distributions over the ids in BOTH top-k sets (the only ones whose probability both runs know)
plus one "everything else" bucket: by the data processing inequality a LOWER bound of the true
KL (`kl_exact` says which), to the rounding of the recorded float32 probabilities (run b's are taken at the
top of what they allow: where its top-k add up to 1 in float32, its rest is not taken to be 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..inspection.trace import Trace
from .logprobs import kl_divergence, log_softmax

__all__ = ["RunDiff", "diff"]

SITES = ("attn", "ffn")


@dataclass
class RunDiff:
    """Differences b - a over the common T tokens (see module docstring for the fields)."""

    tokens_a: np.ndarray
    tokens_b: np.ndarray
    layers: list
    source_labels: list
    attn_res: np.ndarray
    final_attn_res: np.ndarray
    kda_layers: list
    kda_state: np.ndarray
    moe_layers: list
    jaccard: np.ndarray
    routing_changes: list = field(default_factory=list)
    kl: np.ndarray | None = None
    kl_exact: bool = False
    top1_a: np.ndarray | None = None
    top1_b: np.ndarray | None = None
    positions: np.ndarray | None = None  # [T] the history positions of the rows (a Trace window's start on)

    @property
    def flips(self) -> np.ndarray:
        """[T] the top-1 changed: both rows have one (a NaN row's is -1, no prediction) and they differ."""
        return (self.top1_a != self.top1_b) & (self.top1_a >= 0) & (self.top1_b >= 0)

    def __len__(self) -> int:
        return len(self.tokens_a)

    def summary(self) -> dict:
        """A few numbers: largest |Δ| of each kind, mean Jaccard per MoE layer, mean KL, top-1 flips.
        A kind neither run recorded (a Recorder's names_filter left it out) is NaN, and routing_changes None
        when no MoE layer's routing was recorded: not 0, which would say that nothing changed."""
        def peak(x):
            return float(np.nanmax(np.abs(x))) if x.size and np.isfinite(x).any() else float("nan")

        jaccard = np.mean(self.jaccard, axis=0).tolist() if len(self) else [1.0] * len(self.moe_layers)
        return {"tokens": len(self), "max_abs_d_attn_res": peak(self.attn_res),
                "max_abs_d_final_attn_res": peak(self.final_attn_res), "max_abs_d_kda_state": peak(self.kda_state),
                "mean_jaccard": dict(zip(self.moe_layers, jaccard, strict=True)),
                "routing_changes": len(self.routing_changes) if self.moe_layers else None,
                "mean_kl": float(np.mean(self.kl)) if len(self) else 0.0,
                "kl_exact": self.kl_exact, "top1_flips": int(self.flips.sum())}

    def __repr__(self) -> str:
        s = self.summary()
        routing = "routing not recorded" if s["routing_changes"] is None else f"{s['routing_changes']} routing changes"
        return (f"RunDiff({s['tokens']} tokens, {routing}, mean KL {s['mean_kl']:.4g}"
                f"{'' if self.kl_exact else ' (lower bound)'}, {s['top1_flips']} top-1 flips)")


def _run(x):
    """(trace, full logits [T, V] or None) of a Session or a Trace."""
    if isinstance(x, Trace):
        return x, (np.asarray(x["logits"]) if "logits" in x else None)
    if hasattr(x, "trace") and hasattr(x, "tokens") and hasattr(x, "logits"):  # a Session, or a driver like one
        return x.trace(), np.asarray(x.logits)
    raise TypeError(f"diff: expected a Session or a Trace, got {type(x).__name__}")


def diff(a, b) -> RunDiff:
    """Compare two runs (each a `Session` or a `Trace` of the same model) site by site: b - a."""
    ta, la = _run(a)
    tb, lb = _run(b)
    for label, t in (("a", ta), ("b", tb)):
        if len(t) == 0:
            raise ValueError(f"diff: run {label} holds no tokens, so nothing was recorded to compare: decode a prompt first")
    if list(ta.layer_ids) != list(tb.layer_ids):
        raise ValueError(f"diff: the runs have different layers ({list(ta.layer_ids)} vs {list(tb.layer_ids)}); "
                         "compare runs of the same model")
    shape_keys = ("attention_kinds", "ffn_kinds", "block_boundaries", "max_sources", "kda_heads", "num_experts", "vocab_size")
    other = [f"{k} {ta.meta[k]} vs {tb.meta[k]}" for k in shape_keys if k in ta.meta and k in tb.meta
             and ta.meta[k] != tb.meta[k]]
    if other:  # else NumPy fails on the first difference of arrays of other shapes
        raise ValueError(f"diff: the runs come from different models ({'; '.join(other)}); compare runs of the same model")
    for label, t, logits in (("a", ta, la), ("b", tb, lb)):
        lacks = [k for k in ("final.attn_res.weights",) + (("logits.top_ids",) if logits is None else ()) if k not in t]
        if lacks:
            raise ValueError(f"diff: run {label}'s trace lacks {', '.join(map(repr, lacks))}, which diff compares (its "
                             "Recorder's names_filter left it out): record both runs with Recorder(), or a names_filter "
                             "that keeps 'final.*' and 'logits'")
    T = min(len(ta), len(tb))
    if not np.array_equal(ta.positions[:T], tb.positions[:T]):  # rows are compared by index: they must be one position
        first = int(np.flatnonzero(ta.positions[:T] != tb.positions[:T])[0])
        raise ValueError(f"diff: row {first} is token position {int(ta.positions[first])} in a but {int(tb.positions[first])} "
                         "in b (a Trace window, or traces of other positions): compare runs over the same positions, e.g. "
                         "whole traces, or windows with the same start")
    final = tb.final_attn_res_weights()[:T] - ta.final_attn_res_weights()[:T]
    sa, kda_a = ta.kda_state_norms()
    sb, kda_b = tb.kda_state_norms()
    if kda_a != kda_b:
        raise ValueError(f"diff: KDA state norms were recorded at layers {kda_a} in a and {kda_b} in b")
    jac, changes, moe = _routing(ta.routing(), tb.routing(), T)
    kl, exact = (_kl_full(la[:T], lb[:T]), True) if la is not None and lb is not None else (_kl_top(ta, tb, T), False)
    return RunDiff(ta.tokens[:T], tb.tokens[:T], list(ta.layer_ids), ta.source_labels(),
                   tb.attn_res_weights()[:T] - ta.attn_res_weights()[:T], final, kda_a, sb[:T] - sa[:T], moe, jac,
                   changes, kl, exact, _top1(ta, la, T), _top1(tb, lb, T), ta.positions[:T].copy())


def _top1(trace, logits, T: int) -> np.ndarray:
    """[T] each row's top-1 id, -1 where its logits hold NaN (np.argmax would call it id 0; a Trace's top-k of a
    NaN row is ids 0.. with NaN probabilities)."""
    if logits is not None:
        ids, nan = np.argmax(logits[:T], axis=-1), np.isnan(logits[:T]).any(axis=-1)
    else:
        ids = trace["logits.top_ids"][:T, 0]
        nan = np.isnan(trace["logits.top_probs"][:T, 0]) if "logits.top_probs" in trace else np.zeros(T, bool)
    return np.where(nan, -1, ids).astype(np.int64)


def _routing(ra: dict, rb: dict, T: int):
    """Jaccard [T, M] of the top-k sets, and the changes, per token and MoE layer."""
    layers = list(ra["moe_layers"])
    if layers != list(rb["moe_layers"]):
        raise ValueError(f"diff: routing was recorded at layers {layers} in a and {list(rb['moe_layers'])} in b")
    jac = np.ones((T, len(layers)))
    changes = []
    if not layers:
        return jac, changes, layers
    ids_a, ids_b = ra["topk_ids"], rb["topk_ids"]
    for t in range(T):
        for j, layer in enumerate(layers):
            A, B = set(ids_a[t, j][ids_a[t, j] >= 0].tolist()), set(ids_b[t, j][ids_b[t, j] >= 0].tolist())
            if A != B:
                jac[t, j] = len(A & B) / len(A | B)
                changes.append((t, int(layer), sorted(A - B), sorted(B - A)))
    return jac, changes, layers


def _kl_full(la: np.ndarray, lb: np.ndarray) -> np.ndarray:
    return kl_divergence(log_softmax(la), log_softmax(lb))


def _rest_slack(p: np.ndarray, n: int) -> float:
    """How far the rest of a distribution, 1 - (a sum of n recorded probabilities of p's dtype), may be below the true
    rest: each probability's rounding (a few units in the last place) and the sum's (n halves). Run b's rest is taken
    this much larger: where b's top-k sum to 1 or more as recorded, its rest is not known to be 0, and a rest of 0 (or
    1e-300) would charge run a's rest log(1e300) = 690 nats, far above the true KL. Sized by the dtype: a float64 run's
    KL is not blurred by float32's rounding."""
    return (4 + n) * float(np.finfo(p.dtype).eps)


def _kl_top(ta, tb, T: int) -> np.ndarray:
    """KL of the distributions coarse-grained to (the ids in both top-k sets, the rest): a lower bound (to the
    rounding of the recorded probabilities), with run b's probabilities taken at the top of what their recorded
    values allow (b's rest `_rest_slack` larger, a probability recorded as 0 at its dtype's smallest): each term, and
    so the sum, no larger than the exact coarse-grained KL's; clipped at 0."""
    ia, pa = ta.top_predictions()
    ib, pb = tb.top_predictions()
    slack, smallest = _rest_slack(pb, pb.shape[-1]), float(np.finfo(pb.dtype).smallest_subnormal)
    out = np.zeros(T)
    for t in range(T):
        qa, qb = dict(zip(ia[t].tolist(), pa[t].tolist(), strict=True)), dict(zip(ib[t].tolist(), pb[t].tolist(), strict=True))
        support = sorted(set(qa) & set(qb))  # known in both; an id in only one top-k goes to "the rest" for both
        xa = np.array([qa[i] for i in support] + [max(0.0, 1.0 - sum(qa[i] for i in support))])
        xb = np.array([max(qb[i], smallest) for i in support] + [max(0.0, 1.0 - sum(qb[i] for i in support)) + slack])
        keep = xa > 0
        out[t] = max(0.0, float(np.sum(xa[keep] * (np.log(xa[keep]) - np.log(xb[keep])))))
    return out
