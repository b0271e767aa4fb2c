"""vLLM's and SGLang's routed experts (`--enable-return-routed-experts`) against kimi_explore's routing.

Both servers can return, per request, the top-k expert ids each token was routed to: an integer
array [tokens, n_moe_layers, top_k] (MoE layers in model order; a dense first layer has no row).
A server that lists every decoder layer ([tokens, num_hidden_layers, top_k]) is accepted too: the
dense layers' rows are dropped. A flat [tokens, n_moe_layers * top_k] is reshaped.

    routing = read_routed_experts(ids, weights, tokens=prompt_and_output_ids)   # trace.routing()'s layout
    rc = compare_routing(session, routing)          # RoutingComparison: per token and layer, which sets agree
                                                    # (an empty session is fed the tokens; others must match them)
    stats = routed_experts_stats(weights, routing, tokens)   # a RoutingStats, as ke.routing_stats gives
    hooks = routing_hooks(routing)                  # {"layers.i.moe.router.topk_ids": [T, k]} for ke.compare

The servers return ids only: the combine weights are unknown (`topk_weights` NaN, so a RoutingStats
built from them has NaN mean weights; counts, co-activation and mutual information are exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["RoutingComparison", "compare_routing", "read_routed_experts", "routed_experts_stats", "routing_hooks"]


def _moe_layers(weights) -> list[int]:
    cfg = weights.config
    return [i for i in getattr(weights, "layer_ids", range(cfg.num_hidden_layers)) if cfg.is_moe_layer(i)]


def read_routed_experts(ids, weights, tokens=None) -> dict:
    """The servers' routed-expert ids -> {"moe_layers", "topk_ids" [T, M, k] int64, "topk_weights" NaN, "num_experts"},
    with "tokens" (the T token ids the server ran: prompt then output) where given, so that `compare_routing` can
    check them: the ids alone cannot tell a session fed other tokens of the same length."""
    a = np.asarray(ids)
    cfg = weights.config
    moe, k, E = _moe_layers(weights), int(cfg.num_experts_per_token), int(cfg.num_experts)
    if a.dtype.kind not in "iu":
        raise TypeError(f"routed experts: expected integer expert ids, got dtype {a.dtype}")
    if a.ndim == 2 and a.shape[1] == len(moe) * k:
        a = a.reshape(a.shape[0], len(moe), k)
    if a.ndim != 3 or a.shape[2] != k:
        raise ValueError(f"routed experts: shape {a.shape}; expected [tokens, {len(moe)} MoE layers, top_k={k}] "
                         f"(or [tokens, {len(moe) * k}])")
    if a.shape[1] == cfg.num_hidden_layers and a.shape[1] != len(moe):
        a = a[:, moe]  # every decoder layer listed: keep the MoE ones
    if a.shape[1] != len(moe):
        raise ValueError(f"routed experts: {a.shape[1]} layers; this model has {len(moe)} MoE layers {moe} "
                         f"(of {cfg.num_hidden_layers} decoder layers)")
    if a.size and (a.min() < 0 or a.max() >= E):
        raise ValueError(f"routed experts: ids in [{a.min()}, {a.max()}]; this model has experts 0..{E - 1}")
    out = {"moe_layers": moe, "topk_ids": a.astype(np.int64), "topk_weights": np.full(a.shape, np.nan), "num_experts": E}
    if tokens is not None:
        out["tokens"] = _token_list(tokens, a.shape[0], cfg.vocab_size)
    return out


def _token_list(tokens, rows: int, vocab_size: int) -> list[int]:
    t = np.asarray(tokens)
    if t.ndim != 1 or t.dtype.kind not in "iu" or len(t) != rows:
        raise ValueError(f"routed experts: tokens {t.dtype} {t.shape}; expected the {rows} integer token ids the server "
                         "ran, one per row of routed experts (prompt then output)")
    if t.size and (t.min() < 0 or t.max() >= vocab_size):
        raise ValueError(f"routed experts: token ids in [{t.min()}, {t.max()}]; this model's vocabulary is 0..{vocab_size - 1}")
    return t.astype(np.int64).tolist()


def routing_hooks(routing: dict) -> dict:
    """{"layers.i.moe.router.topk_ids": [T, k]}: the routing as hook-named arrays (for `ke.compare`)."""
    return {f"layers.{i}.moe.router.topk_ids": routing["topk_ids"][:, j] for j, i in enumerate(routing["moe_layers"])}


@dataclass
class RoutingComparison:
    """kimi_explore's top-k sets against another engine's, per token and MoE layer.

    overlap [T, M]: |ours & theirs| / k; same [T, M]: the sets are equal; moe_layers: the layer ids.
    """

    moe_layers: list
    overlap: np.ndarray
    same: np.ndarray

    @property
    def agreement(self) -> float:
        """Fraction of (token, layer) whose top-k sets are equal."""
        return float(self.same.mean()) if self.same.size else 1.0

    @property
    def per_layer(self) -> np.ndarray:
        """[M] fraction of tokens whose sets agree, per MoE layer."""
        return self.same.mean(axis=0)

    @property
    def first_mismatch(self) -> tuple[int, int] | None:
        """(token, layer) of the earliest set that differs (token first, then layer), or None."""
        bad = np.argwhere(~self.same)
        return None if not bad.size else (int(bad[0, 0]), int(self.moe_layers[bad[0, 1]]))

    def to_pandas(self):
        import pandas as pd

        return pd.DataFrame({"layer": self.moe_layers, "agreement": self.per_layer,
                             "mean_overlap": self.overlap.mean(axis=0)})

    def __repr__(self) -> str:
        return (f"RoutingComparison({self.same.shape[0]} tokens x {len(self.moe_layers)} MoE layers: {self.agreement:.1%} of the "
                f"top-k sets agree; first mismatch {self.first_mismatch})")


def compare_routing(session, other, tokens=None) -> RoutingComparison:
    """`session` (its recorded routing, `session.trace().routing()`) against `other`: a routing dict from
    `read_routed_experts`, or the servers' raw ids (read with the session's weights).

    tokens: the token ids the server ran (or the routing dict's "tokens"). Where known, an empty session is
    fed them, and a session that ran other tokens is refused, naming the first position that differs.
    """
    theirs = other if isinstance(other, dict) else read_routed_experts(other, session.weights, tokens)
    own = theirs.get("tokens")
    if tokens is None:
        tokens = own
    else:
        tokens = _token_list(tokens, theirs["topk_ids"].shape[0], session.weights.config.vocab_size)
        if own is not None and list(own) != tokens:
            raise ValueError("compare_routing: tokens= differs from the routing's own tokens")
    if tokens is not None:
        ran = [int(t) for t in session.tokens]
        if not ran:
            session.feed(tokens, progress=False)
        elif ran != tokens:
            n = min(len(ran), len(tokens))
            first = next((i for i in range(n) if ran[i] != tokens[i]), n)
            raise ValueError(f"compare_routing: the session ran other tokens than the engine: {len(ran)} ids against "
                             f"its {len(tokens)}, first difference at position {first}")
    if not session.tokens:
        raise ValueError("compare_routing: the session has no tokens and none are known: pass tokens= (the ids the "
                         "engine ran; an empty session is fed them)")
    ours = session.trace().routing()
    if "topk_ids" not in ours:
        raise ValueError("compare_routing: the session's recorder kept no routing (layers.*.moe.router.topk_ids)")
    a, b = ours["topk_ids"], theirs["topk_ids"]
    if list(ours["moe_layers"]) != list(theirs["moe_layers"]) or a.shape != b.shape:
        raise ValueError(f"compare_routing: the session has {a.shape} ids on MoE layers {ours['moe_layers']}, the other "
                         f"engine {b.shape} on {theirs['moe_layers']}: feed the session the tokens the engine ran")
    k = a.shape[2]
    overlap = np.zeros(a.shape[:2])
    for t in range(a.shape[0]):
        for j in range(a.shape[1]):
            overlap[t, j] = len(set(a[t, j].tolist()) & set(b[t, j].tolist())) / k
    return RoutingComparison(list(ours["moe_layers"]), overlap, overlap == 1.0)


def routed_experts_stats(weights, routing, tokens, classes=None):
    """A `RoutingStats` (what `ke.routing_stats` computes by decoding) from another engine's routed experts.

    routing: `read_routed_experts(...)` or the raw ids; tokens: the T token ids (their classes);
    classes: token id -> label (default `byte_class` for a byte vocabulary).
    """
    from ..analysis.routing_stats import RoutingStats, byte_class, model_fingerprint

    routing = routing if isinstance(routing, dict) else read_routed_experts(routing, weights)
    tokens = [int(t) for t in tokens]
    if len(tokens) != routing["topk_ids"].shape[0]:
        raise ValueError(f"routed_experts_stats: {len(tokens)} tokens for {routing['topk_ids'].shape[0]} rows of routed experts")
    if classes is None:
        if int(weights.config.vocab_size) != 256:
            raise ValueError("routed_experts_stats: the default token classing is for byte models; pass classes=fn(token_id)")
        classes = byte_class
    stats = RoutingStats.empty(weights, model_fingerprint(weights))
    stats.add(routing, [classes(t) for t in tokens])
    return stats
