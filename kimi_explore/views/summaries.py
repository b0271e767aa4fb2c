"""Numbers that stay readable at K3 scale (93 layers, 896 experts top-16), for the Explorer and the report.

Pure NumPy on host arrays from a Trace; shapes: T tokens, M MoE layers, k top-k, E experts.

MoE routing (r = `common.routing(trace)`):
  topk_table(r, t, bias)   per MoE layer, the k chosen experts of token t: ids, combine weights,
                           unbiased scores σ(logit), bias, unbiased rank (1 = highest score), and
                           `by_bias`: chosen only because of the selection bias (unbiased rank > k,
                           k the router's top-k, also where an ablation dropped slots: id -1);
                           `forced` (with the bias known): outside the router's own choice, the top-k
                           of score + bias as the router sums and ranks them (`latent_moe.select_experts`,
                           in the recorded scores' dtype): a hook's choice (`force_routing`), not `by_bias`;
                           k: the router's top-k (`top_k`; default the trace's width, which a hook that
                           routes a token to more experts widens for every token); `bias_known` per
                           layer: without it `by_bias` means only "outside the unbiased top-k" (the bias,
                           or a hook)
                           `displaced`: the unbiased top-k experts the bias pushed out of the router's
                           choice (an expert an ablation removed from it, or a hook replaced, is not one)
  routing_entropy(r)       [T, M] entropy (bits) of the combine weights: 0 = one expert carries the
                           token, log2 k = all k equal (4 bits at K3)
  load_stats(r)            over the tokens so far, per layer: counts [M, E], max/mean, coefficient
                           of variation std/mean, dead experts (never chosen). A balanced router has
                           max/mean near 1 and CV near 0; with T tokens at most T*k experts can be alive
  sorted_counts(counts)    each layer's counts sorted descending, with the expert ids in that order

Per-token measures (`token_measures`), one number per token, for colouring the text:
  surprisal         -log2 p(token t | tokens < t) from the previous step's logits (NaN at t = 0)
  routing entropy   routing_entropy averaged over MoE layers (a layer whose every slot an ablation
                    dropped has none and is left out)
  embedding weight  the block-residual softmax weight on source 0, averaged over layers and both sites
                    (each mix that holds it): the embedding; on a layer subset, the input of its first
                    pushing layer (`Trace.source_labels()[0]`)
  KDA state change  mean over KDA layers and heads of | ‖S‖ after t - ‖S‖ before t | (S starts at 0; row 0
                    of a window that starts later has no state before it in the trace: NaN)
A NaN or inf value the model computed (a hook's, an overflow) makes that token's measure NaN, as its logits
are: the measures never average it away.
"""

from __future__ import annotations

import numpy as np

from ..model.latent_moe import select_experts

__all__ = ["MEASURES", "load_stats", "routing_entropy", "sorted_counts", "stats_from_counts", "surprisal_bits",
           "token_measures", "topk_table"]

MEASURES = ("surprisal", "routing entropy", "embedding weight", "KDA state change")


def topk_table(r: dict, t: int, bias: dict | None = None, top_k: int | None = None) -> dict:
    """Token t's choice at every MoE layer (see module docstring); arrays [M, width], padding id -1."""
    ids = np.asarray(r["topk_ids"][t], dtype=np.int64)  # [M, width]
    raw = np.asarray(r["scores"][t])  # [M, E] as recorded: the router's own numbers
    scores = raw.astype(np.float64)
    M, width = ids.shape
    k = width if top_k is None else int(top_k)
    valid = ids >= 0
    safe = np.where(valid, ids, 0)
    chosen_scores = np.where(valid, np.take_along_axis(scores, safe, axis=1), np.nan)
    # rank = 1 + how many experts score strictly higher (a NaN score is never higher, and ranks first):
    # from each row's scores sorted ascending, NaN last
    ascending, numbers = np.sort(scores, axis=1), (~np.isnan(scores)).sum(axis=1)
    higher = np.zeros((M, width), np.int64)
    for j in range(M):
        higher[j] = numbers[j] - np.searchsorted(ascending[j], chosen_scores[j], side="right")
    rank = np.where(valid, np.where(np.isnan(chosen_scores), 0, higher) + 1, -1)
    b = np.full((M, width), np.nan)
    if bias:
        for j, layer in enumerate(r["moe_layers"]):
            if layer in bias:
                b[j] = np.where(valid[j], np.asarray(bias[layer], dtype=np.float64)[safe[j]], np.nan)
    displaced, forced = [], np.zeros((M, width), dtype=bool)
    for j, layer in enumerate(r["moe_layers"]):
        # the router chose k experts; an ablation then dropped some of them (slots -1), or a hook chose others.
        # Compared with the unbiased top-k is the router's own choice (an expert the ablation removed or the hook
        # replaced was not pushed out by the bias)
        if bias is not None and layer in bias:  # the router's own choice, summed and ranked as it does
            router = set(select_experts(raw[j], np.asarray(bias[layer]).astype(raw.dtype), k).tolist())
            forced[j] = valid[j] & ~np.isin(ids[j], list(router))
        else:  # the survivors, and for the slots an ablation dropped the experts ranked next (no bias: by score)
            chosen = ids[j][valid[j]].tolist()
            router = set(chosen)
            if len(chosen) < k:
                rest = np.setdiff1d(np.arange(scores.shape[1]), chosen)
                key = np.where(np.isnan(scores[j, rest]), np.inf, -scores[j, rest])  # by score, NaN last, then id
                router |= set(rest[np.lexsort((rest, key))][: k - len(chosen)].tolist())
        displaced.append([(e, float(scores[j, e])) for e in _top(scores[j], ascending[j], numbers[j], k)
                          if e not in router])
    # rank > k: outside the unbiased top-k of all k slots (not of the slots an ablation left: the survivors'
    # ranks among all experts are what they were)
    return {"ids": ids, "weights": np.asarray(r["topk_weights"][t], dtype=np.float64), "scores": chosen_scores,
            "bias": b, "rank": rank, "by_bias": valid & (rank > k) & ~forced, "forced": forced,
            "displaced": displaced, "moe_layers": list(r["moe_layers"]), "k": k,
            "bias_known": [bias is not None and layer in bias for layer in r["moe_layers"]]}


def _top(scores: np.ndarray, ascending: np.ndarray, numbers: int, n: int) -> list[int]:
    """The n experts of one layer with the highest unbiased scores, by score then id (a stable sort of
    -scores, NaN last), from the row sorted ascending: only the experts at or above the n-th largest
    score are sorted (a full stable argsort of K3's 92 x 896 scores costs ~6 ms a Step)."""
    if n == 0:
        return []
    if n > numbers:  # fewer numbers than slots: NaN scores take the rest, in id order
        return np.argsort(-scores, kind="stable")[:n].tolist()
    threshold = ascending[numbers - n]
    above = np.flatnonzero(scores > threshold)  # fewer than n
    cand = np.concatenate([above, np.flatnonzero(scores == threshold)[: n - len(above)]])
    return cand[np.lexsort((cand, -scores[cand]))].tolist()


def routing_entropy(r: dict) -> np.ndarray:
    """[T, M] entropy in bits of each token's combine weights at each MoE layer (padding ignored)."""
    w = np.asarray(r["topk_weights"], dtype=np.float64)
    w = np.where(np.asarray(r["topk_ids"]) >= 0, np.nan_to_num(w, nan=0.0), 0.0)
    total = w.sum(axis=2, keepdims=True)
    p = np.divide(w, total, out=np.zeros_like(w), where=total > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=2)
    return np.where(total[..., 0] > 0, h, np.nan)


def load_stats(r: dict, upto: int | None = None) -> dict:
    """Expert load over tokens [0, upto) per MoE layer: counts [M, E], max_over_mean, cv, dead [M]."""
    ids = np.asarray(r["topk_ids"][:upto], dtype=np.int64)  # [T, M, k]
    T, M, _ = ids.shape
    E = int(r["scores"].shape[2])
    counts = np.zeros((M, E), dtype=np.int64)
    for j in range(M):
        chosen = ids[:, j].ravel()
        counts[j] = np.bincount(chosen[chosen >= 0], minlength=E)
    return stats_from_counts(counts, T)


def stats_from_counts(counts: np.ndarray, tokens: int) -> dict:
    """`load_stats` from counts [M, E] already tallied over `tokens` tokens (the Explorer grows them)."""
    counts = np.asarray(counts, dtype=np.int64)
    M, E = counts.shape
    mean = counts.mean(axis=1)
    ok = mean > 0
    max_over_mean = np.divide(counts.max(axis=1), mean, out=np.full(M, np.nan), where=ok)
    cv = np.divide(counts.std(axis=1), mean, out=np.full(M, np.nan), where=ok)
    return {"counts": counts, "max_over_mean": max_over_mean, "cv": cv, "dead": (counts == 0).sum(axis=1),
            "tokens": int(tokens), "experts": E}


def sorted_counts(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(counts sorted descending per row [M, E], expert ids in that order [M, E]); ties by id."""
    order = np.argsort(-counts, axis=1, kind="stable")
    return np.take_along_axis(counts, order, axis=1), order


def surprisal_bits(prev_logits, token: int) -> float:
    """-log2 softmax(prev_logits)[token], in float64."""
    x = np.asarray(prev_logits, dtype=np.float64).reshape(-1)
    m = x.max()
    return float((m + np.log(np.exp(x - m).sum()) - x[int(token)]) / np.log(2.0))


def token_measures(trace, surprisal=None) -> dict[str, np.ndarray]:
    """{measure: [T]} for `MEASURES`; surprisal: [T] precomputed (the trace alone has only the top-k)."""
    T = len(trace)
    out = {"surprisal": np.full(T, np.nan) if surprisal is None else np.asarray(surprisal, dtype=np.float64)}
    r = dict(trace.routing())
    has_moe = len(r.get("moe_layers", [])) and "topk_weights" in r
    with np.errstate(invalid="ignore"):
        if has_moe:
            h = routing_entropy(r)  # [T, M]: NaN where every slot was dropped (left out) or a weight is not finite
            kept = np.asarray(r["topk_ids"]) >= 0
            computed = np.where(kept, ~np.isfinite(np.asarray(r["topk_weights"], dtype=np.float64)), False).any(axis=2)
            out["routing entropy"] = np.where(computed.any(axis=1), np.nan, _nanmean(h, axis=1))
        else:
            out["routing entropy"] = np.full(T, np.nan)
        # source 0 at each mix that holds it (the mixes a layer subset has before its first push hold the current
        # sum alone); a NaN there is the model's, not a missing source
        w = trace.attn_res_weights()  # [T, L, site, S]
        held = [(li, s) for li, i in enumerate(trace.layer_ids) for s, site in enumerate(("attn", "ffn"))
                if f"layers.{i}.attn_res.{site}.weights" in trace
                and np.shape(trace[f"layers.{i}.attn_res.{site}.weights"])[-1] > 1]
        out["embedding weight"] = np.stack([w[:, li, s, 0] for li, s in held], axis=1).mean(axis=1) if held and T \
            else np.full(T, np.nan)
        norms, kda_ids = trace.kda_state_norms()
        if len(kda_ids):
            n = np.asarray(norms, dtype=np.float64)  # [T, kda_layer, H]
            first = np.zeros_like(n[:1]) if getattr(trace, "start", 0) == 0 else np.full_like(n[:1], np.nan)
            prev = np.concatenate([first, n[:-1]])
            out["KDA state change"] = np.abs(n - prev).reshape(T, -1).mean(axis=1)
        else:
            out["KDA state change"] = np.full(T, np.nan)
    return out


def _nanmean(a: np.ndarray, axis: int) -> np.ndarray:
    """nanmean without the all-NaN warning: NaN where a row has no value."""
    ok = np.isfinite(a)
    n = ok.sum(axis=axis)
    s = np.where(ok, a, 0.0).sum(axis=axis)
    return np.divide(s, n, out=np.full(s.shape, np.nan), where=n > 0)
