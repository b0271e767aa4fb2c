"""A float64 twin of the analyses, token by token, from the released weights (`naive_decoder.NaiveDecoder`).

Nothing of kimi_explore's analyses, replay, recorder or decoder runs here: the block stack is a
Python list, the attention-residual mixes are `naive_apply_attn_res` (or its masked form written
out below), the MoE is split expert by expert from the raw weights, and every analysis is computed
from its docstring's formula:

    lens after layer i   lm_head @ norm(sum_j p_j V_j), V = stack so far + [h_i], p the output mix's softmax
    attribution          leaf value p_j (u . v_leaf), u = lm_head[c] * g / rms(sum_j p_j V_j)
    routed expert leaf   up_proj(g_l * s * w_e y_e), s = 1 / rms(sum_e w_e y_e) (the latent norm frozen)
    masking a family     the softmax renormalised over the other sources, at every token
"""

from __future__ import annotations

import math

import numpy as np
from naive_decoder import NaiveDecoder, rms

from kimi_explore.model.kda import naive_kda_step
from kimi_explore.model.latent_moe import naive_latent_moe
from kimi_explore.model.mla import naive_mla_prefill
from kimi_explore.model.ops import naive_situ_and_mul


def family_columns(family: str, m: int) -> list[int]:
    """The columns a source family covers among m = n + 1 sources (source_masks' docstring, written out)."""
    n = m - 1
    return {"embedding": [0] if n >= 1 else [], "current": [n], "latest_block": [n - 1] if n >= 2 else [],
            "older_blocks": list(range(1, n - 1)), "blocks": list(range(1, n))}[family]


def mix(prefix, stack, g, proj, eps, drop=()):
    """(sum_j p_j V_j, p) over V = stack + [prefix], the softmax renormalised without the columns in `drop`."""
    sources = list(stack) + [prefix]
    scores = [float((g * (v / math.sqrt(float(np.mean(v * v)) + eps))) @ proj.reshape(-1)) for v in sources]
    m = max(scores)
    e = np.array([math.exp(s - m) for s in scores])
    p = e / e.sum()
    if drop:
        keep = np.ones(len(p), bool)
        keep[list(drop)] = False
        p = np.where(keep, p, 0.0)
        p = p / p.sum()
    return sum(pj * v for pj, v in zip(p, sources, strict=True)), p


def source_label(j: int, n_sources: int) -> str:
    return "current" if j == n_sources - 1 else ("embedding" if j == 0 else f"block {j}")


class Twin(NaiveDecoder):
    """`Twin(path).run(tokens, mask=None) -> [record per token]`, float64, stepping from a fresh state each call.

    mask: (layer, site, family): that family's columns dropped from that mix at every token."""

    def reset(self):
        for layer in self.layers:
            if layer.kind == "kda":
                s = self.kda_state[layer.index]
                self.kda_state[layer.index] = type(s)(np.zeros_like(s.conv), np.zeros_like(s.recurrent))
            else:
                self.mla_inputs[layer.index] = []

    def run(self, tokens, mask=None):
        self.reset()
        return [self.token(int(x), mask) for x in tokens]

    def token(self, token: int, mask=None):
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        out_norm = self.get("model.output_attn_res_norm.weight"), self.get("model.output_attn_res_proj.weight")
        final_norm = self.get("model.norm.weight")
        r = {"embed": self.embed[token].copy(), "layers": {}, "lens": []}
        h = self.embed[token]
        stack, leaves = [], [("embed", None, self.embed[token].copy())]  # (leaf, source index set below, vector)
        where = {"embed": 0}

        def drop(i, site, m):
            return family_columns(mask[2], m) if mask is not None and mask[:2] == (i, site) else ()

        for layer in self.layers:
            i, rec = layer.index, {}
            prefix, a_in = h, h
            if stack:
                a_in, rec["attn_w"] = mix(prefix, stack, *layer.attn_res, eps, drop(i, "attn", len(stack) + 1))
            if i % cfg.attn_res_block_size == 0:
                stack.append(prefix)
                prefix = 0.0
            x = rms(a_in, layer.input_layernorm, eps)
            if layer.kind == "kda":
                a, self.kda_state[i] = naive_kda_step(x, layer.attention, self.kda_state[i])
                rec["kda_state"] = self.kda_state[i].recurrent.copy()
            else:
                self.mla_inputs[i].append(x)
                a = naive_mla_prefill(np.array(self.mla_inputs[i]), layer.attention)[-1]
            rec["attn_out"] = a
            prefix = prefix + a
            f_in, rec["ffn_w"] = mix(prefix, stack, *layer.mlp_res, eps, drop(i, "ffn", len(stack) + 1))
            y = rms(f_in, layer.post_attention_layernorm, eps)
            here = len(stack)  # the source this layer's outputs land in: the next block pushed, or "current"
            where[f"layers.{i}.attn.out"] = here
            mine = [(f"layers.{i}.attn.out", a)]
            if hasattr(layer.ffn, "experts"):
                f, rec["ids"], rec["weights"] = naive_latent_moe(y, layer.ffn)
                experts, shared = self.moe_leaves(layer.ffn, y, rec["ids"], rec["weights"])
                np.testing.assert_allclose(sum(experts.values()) + shared, f, rtol=1e-10, atol=1e-12)
                mine += [(f"layers.{i}.moe.experts.{e}", v) for e, v in experts.items()]
                mine.append((f"layers.{i}.moe.shared", shared))
            else:
                f = layer.ffn.down_proj @ naive_situ_and_mul(layer.ffn.gate_up_proj @ y, cfg.activation_situ_beta,
                                                            cfg.activation_situ_linear_beta)
                mine.append((f"layers.{i}.ffn.out", f))
            for name, v in mine:
                where[name] = here
                leaves.append((name, here, v))
            rec["ffn_out"] = f
            h = rec["prefix_sum"] = prefix + f
            r["layers"][i] = rec
            out, _ = mix(h, stack, *out_norm, eps)  # the lens after layer i: the model stopped here
            r["lens"].append(self.lm_head @ rms(out, final_norm, eps))
        out, r["final_w"] = mix(h, stack, *out_norm, eps, drop("final", "final", len(stack) + 1))
        r["mix"] = out
        r["hidden"] = rms(out, final_norm, eps)
        r["logits"] = self.lm_head @ r["hidden"]
        r["blocks"] = np.array(stack)
        r["lens"] = np.array(r["lens"])
        r["where"] = where
        r["leaves"] = [(name, where[name], v) for name, _, v in leaves]
        return r

    def moe_leaves(self, f, y, ids, weights):
        """{expert: its d-wide share of the routed output, the latent norm frozen}, shared experts' output."""
        E, l = f.num_experts, f.latent_size
        z = f.in_proj[E : E + l] @ y
        parts = {}
        for e, we in zip(ids, weights, strict=True):
            w13, w2 = f.experts.gather(np.array([e]))
            parts[int(e)] = we * (w2[0] @ naive_situ_and_mul(w13[0] @ z, f.situ_beta, f.situ_linear_beta))
        s = 1.0
        if f.use_latent_norm:
            agg = sum(parts.values())
            s = f.routed_expert_norm / math.sqrt(float(np.mean(agg * agg)) + f.eps)
        experts = {e: f.routed_expert_up_proj @ (s * v) for e, v in parts.items()}
        shared = f.shared_down_proj @ naive_situ_and_mul(f.in_proj[E + l :] @ y, f.situ_beta, f.situ_linear_beta)
        return experts, shared

    def attribution(self, r, token: int):
        """{leaf: value}, {label: p_j} of one token's record: the frozen final norm applied to each leaf."""
        eps, p = self.cfg.rms_norm_eps, r["final_w"]
        u = self.lm_head[token] * self.get("model.norm.weight") / math.sqrt(float(np.mean(r["mix"] ** 2)) + eps)
        n = len(p)
        contributions = {name: float(p[j] * (u @ v)) for name, j, v in r["leaves"]}
        source_of = {name: source_label(j, n) for name, j, _ in r["leaves"]}
        return contributions, source_of, {source_label(j, n): float(p[j]) for j in range(n)}


def log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
