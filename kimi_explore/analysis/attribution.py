"""Direct logit attribution, exact: which blocks, layers and experts pushed one token's logit.

The logit of token c after the output mix is (p: the output mix's softmax, V_j: its raw sources)

    logit_c = lm_head[c] . (g * m / rms(m)),   m = sum_j p_j V_j,   rms(m) = sqrt(mean(m^2) + eps)

FREEZING the final RMSNorm's scale 1/rms(m) and the mix weights p at their actual values makes it
linear in the sources: with u = lm_head[c] * g / rms(m),

    logit_c = sum_j p_j (u . V_j)

Each source is a sum of leaves, by the decoder's push rule: block 0 is the embedding (layer 0
pushes its raw input), a later block (or the current running sum) is the sum of the attention and
FFN outputs of the layers since the previous push. So the leaves are

    embed                       the embedding (inside its source)
    layers.{i}.attn.out         attention output of layer i
    layers.{i}.ffn.out          dense FFN output (dense layers)
    layers.{i}.moe.experts.{e}  routed expert e's share of the MoE output (a hook that routes a token
                                through e twice, [e, e] at moe.router.topk_ids: both shares, summed)
    layers.{i}.moe.shared       the shared experts' output

and a leaf's value is p_j (u . v_leaf) for the source j it lives in.

The routed experts' split: the latent MoE's routed output is up_proj(routed_expert_norm(sum_e w_e y_e))
with an RMSNorm on the weighted sum. Freezing that norm's scale s = 1/rms(sum_e w_e y_e) at its
actual value too, the routed output is sum_e up_proj(g_l * s * w_e y_e): one exact term per selected
expert, the weights w_e as routed (after any hook). Without the latent norm the split is linear as is.

Exactness: the leaves sum to the logit and `.logit` is the decoder's logit, both to float rounding
(the leaves are dotted in float64). The values are captured by replaying the session's history
(`_replay`); a leaf vector that does not add up to what the decoder used (a hook that rewrote
`moe.routed_out`, `ffn.out` or a running sum) is an error, not a silently wrong split; so is a NaN
logit (a hook, or an overflow, put NaN into the values: every leaf is then NaN, and a NaN row has no top-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..backend import to_numpy
from ..inspection.targets import history_position
from ..model.block_residual import source_labels, source_of_layers
from ..model.latent_moe import expert_outputs
from ..model.ops import situ_and_mul
from ._replay import replay, site_names

__all__ = ["Attribution", "logit_attribution"]

CHECK_RTOL = 1e-4  # a rebuilt vector vs the one the decoder used, relative to its norm
_SITES = ("attn.out", "ffn.in", "ffn.out", "prefix_sum", "moe.router.topk_ids", "moe.router.topk_weights",
          "moe.routed_out", "moe.shared_out")


@dataclass
class Attribution:
    """One token's logit, split into leaves (see module docstring).

    t, token:       the step (its logits predict token t+1) and the attributed token id
    logit:          the decoder's logit of `token` at step t
    contributions:  {leaf: value}, ordered by |value| descending; they sum to `logit`
    source_of:      {leaf: output-mix source label ("embedding", "block 1", ..., "current")}
    source_weights: {source label: p_j}, the frozen output-mix weights
    """

    t: int
    token: int
    logit: float
    contributions: dict
    source_of: dict
    source_weights: dict

    def total(self) -> float:
        return float(sum(self.contributions.values()))

    def by_source(self) -> dict:
        """{source label: summed contribution}, in the output mix's source order."""
        out = {label: 0.0 for label in self.source_weights}
        for leaf, v in self.contributions.items():
            out[self.source_of[leaf]] += v
        return out

    def by_layer(self) -> dict:
        """{"embed": ..., "layers.{i}": attention + FFN contributions of layer i}, in layer order."""
        out = {}
        for leaf in sorted(self.contributions, key=_leaf_order):
            key = "embed" if leaf == "embed" else ".".join(leaf.split(".")[:2])
            out[key] = out.get(key, 0.0) + self.contributions[leaf]
        return out

    def to_pandas(self):
        """One row per leaf: leaf, value, source, layer (nullable int), part (embed/attn/ffn/expert/shared), expert."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("Attribution.to_pandas needs pandas: pip install pandas") from e
        rows = []
        for leaf, v in self.contributions.items():
            parts = leaf.split(".")
            layer = int(parts[1]) if parts[0] == "layers" else None
            part = {"attn": "attn", "ffn": "ffn"}.get(parts[2] if layer is not None else "", "embed")
            if parts[2:4] == ["moe", "experts"]:
                part = "expert"
            elif parts[2:4] == ["moe", "shared"]:
                part = "shared"
            expert = int(parts[4]) if part == "expert" else None
            rows.append((leaf, v, self.source_of[leaf], layer, part, expert))
        df = pd.DataFrame(rows, columns=["leaf", "value", "source", "layer", "part", "expert"])
        df["layer"] = df["layer"].astype("Int64")
        df["expert"] = df["expert"].astype("Int64")
        return df

    def __repr__(self) -> str:
        return f"Attribution(t={self.t}, token={self.token}, logit={self.logit:.4f}, {len(self.contributions)} leaves)"


def _leaf_order(leaf: str):
    parts = leaf.split(".")
    return (-1,) if leaf == "embed" else (int(parts[1]), leaf)


def _f64(a) -> np.ndarray:
    return np.asarray(to_numpy(a), dtype=np.float64)


def logit_attribution(session, t=-1, token=None):
    """Split the logit of `token` (default: each step's top-1) at step `t` of `session`'s history into leaves.

    t: a step (negative counts from the end) -> an Attribution; or a list of steps -> a list of
    Attributions in time order, one per step given (a step given twice: twice), from ONE replay of the
    history, which starts at the latest checkpoint at or before the first step (`replay(...,
    from_checkpoint=True)`): one recent step costs the same however long the history.
    """
    w = session.weights.local_weights()  # every layer's arrays (a pipeline says how to get them)
    V = w.config.vocab_size
    if token is not None and (isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < V):
        raise ValueError(f"logit_attribution: token must be an id in 0..{V - 1} (or None for the top-1), got {token!r}")
    many = np.ndim(t) > 0
    steps = list(t) if many else [t.item() if isinstance(t, np.ndarray) else t]  # (a 0-d array: the int it holds)
    if many and not steps:
        raise ValueError("logit_attribution: t is empty: give a step, or a list of steps")
    T = len(session.tokens)
    if T == 0:
        raise ValueError("logit_attribution: the session has no tokens: feed a prompt first (session.feed(ids))")
    steps = sorted(history_position(s, T, "logit_attribution: t") for s in steps)
    names = site_names(w, _SITES, ("embed", "final.attn_res.weights", "final.block_residual"))
    runs = replay(session, names, steps, from_checkpoint=True)
    done = {step: _attribute(w, step, values, logits, token) for step, values, logits in runs}
    out = [done[step] for step in steps]
    return out if many else out[0]


def _attribute(w, t: int, values: dict, logits: np.ndarray, token) -> Attribution:
    if np.isnan(logits).any() and (token is None or np.isnan(logits[token])):
        what = "it has no top-1 and no logit to split" if token is None else f"token {token}'s logit is NaN: no split exists"
        raise ValueError(f"logit_attribution: the decoder's logits at step {t} hold NaN (a hook in session.hooks, or an "
                         f"overflow, put NaN into the values), so {what}; ke.logit_lens(session) shows after which layer "
                         "the NaN appears")
    token = int(np.argmax(logits)) if token is None else int(token)
    sources = _sources(w, values)  # [(label, [(leaf, vector)])], blocks in push order, current last
    p = _f64(values["final.attn_res.weights"])
    eps = w.config.rms_norm_eps
    actual = np.concatenate([_f64(values["final.block_residual"]), _f64(values[w.layers[-1].hook_prefix + "prefix_sum"])[None]])
    for j, (label, leaves) in enumerate(sources):
        _check_close(sum(v for _, v in leaves), actual[j], f"the output mix's source {label!r}")
    mix = p @ actual
    u = _f64(w.lm_head[token]) * _f64(w.norm) / math.sqrt(float(mix @ mix) / mix.shape[0] + eps)

    contributions, source_of = {}, {}
    for (label, leaves), pj in zip(sources, p, strict=True):
        for leaf, vec in leaves:
            # (+=: a token routed twice through one expert has two leaves of that name; its share is both)
            contributions[leaf] = contributions.get(leaf, 0.0) + float(pj * (u @ vec))
            source_of[leaf] = label
    logit, total = float(logits[token]), sum(contributions.values())
    if not abs(total - logit) <= CHECK_RTOL * (1.0 + abs(logit)):
        raise ValueError(f"logit_attribution: the leaves add up to {total:.6g} but the decoder's logit is {logit:.6g}: a hook in "
                         "session.hooks changed a value after the output mix (final.hidden or logits), so no exact split exists")
    ordered = dict(sorted(contributions.items(), key=lambda kv: -abs(kv[1])))
    weights = {label: float(pj) for (label, _), pj in zip(sources, p, strict=True)}
    return Attribution(t, token, logit, ordered, source_of, weights)


def _sources(w, values: dict) -> list:
    """The output mix's sources as (label, [(leaf, float64 vector)]), by the decoder's push rule."""
    where = source_of_layers(w.specs)
    sources = [[] for _ in range(where[-1] + 1)]
    sources[where[0]].append(("embed", _f64(values["embed"])))
    for layer, j in zip(w.layers, where[1:], strict=True):
        pre = layer.hook_prefix
        sources[j].append((pre + "attn.out", _f64(values[pre + "attn.out"])))
        if pre + "moe.router.topk_ids" in values:
            sources[j] += _moe_leaves(layer, values, pre)
        else:
            sources[j].append((pre + "ffn.out", _f64(values[pre + "ffn.out"])))
    labels = source_labels([spec.index for spec in w.specs if spec.is_block_boundary])
    return list(zip(labels, sources, strict=True))


def _moe_leaves(layer, values: dict, pre: str) -> list:
    """Routed experts (frozen routed_expert_norm scale) and the shared experts of one MoE layer."""
    f = layer.ffn
    E, l = f.num_experts, f.latent_size
    ids, wts = values[pre + "moe.router.topk_ids"], values[pre + "moe.router.topk_weights"]
    z = (f.in_proj @ values[pre + "ffn.in"])[E : E + l]
    y = _f64(expert_outputs(f.experts, ids, z, lambda h: situ_and_mul(h, f.situ_beta, f.situ_linear_beta)))  # [k, l]
    parts = _f64(wts)[:, None] * y  # w_e y_e
    if f.use_latent_norm:
        agg = parts.sum(axis=0)
        parts = parts * (_f64(f.routed_expert_norm) / math.sqrt(float(agg @ agg) / l + f.eps))
    routed = parts @ _f64(f.routed_expert_up_proj).T  # [k, d]: one row per selected expert
    shared = _f64(values[pre + "moe.shared_out"])
    _check_close(routed.sum(axis=0), _f64(values[pre + "moe.routed_out"]), pre + "moe.routed_out")
    _check_close(routed.sum(axis=0) + shared, _f64(values[pre + "ffn.out"]), pre + "ffn.out")
    leaves = [(f"{pre}moe.experts.{int(e)}", row) for e, row in zip(to_numpy(ids), routed, strict=True)]
    return leaves + [(pre + "moe.shared", shared)]


def _check_close(rebuilt: np.ndarray, actual: np.ndarray, where: str) -> None:
    err, scale = float(np.linalg.norm(rebuilt - actual)), float(np.linalg.norm(actual))
    if not err <= CHECK_RTOL * max(scale, 1e-30) + 1e-30:
        raise ValueError(f"logit_attribution: the leaves of {where} add up to a vector {err:.3g} away from the one the "
                         f"decoder used (norm {scale:.3g}): a hook in session.hooks rewrote that value, so no exact split "
                         "into these leaves exists")
