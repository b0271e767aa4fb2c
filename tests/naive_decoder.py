"""A float64 decoder built only from the naive_* reference functions, for comparison with the fast path.

It follows the HF flow literally: a Python list as the block stack, one source at a time, a Python
loop over experts, full causal attention recomputed over every past MLA input.
"""

from __future__ import annotations

import numpy as np

from kimi_explore.backend import to_numpy
from kimi_explore.model.kda import KdaState, KdaWeights, naive_kda_step
from kimi_explore.model.latent_moe import LatentMoeWeights, naive_latent_moe
from kimi_explore.model.mla import naive_mla_prefill
from kimi_explore.model.ops import naive_situ_and_mul


def _f64(a):
    return np.asarray(to_numpy(a), dtype=np.float64)


def _rms(x, g, eps):
    return x / np.sqrt(np.mean(x * x) + eps) * _f64(g)


def _mix(prefix, stack, score, eps):
    sources = stack + [prefix]
    s = np.array([float(v @ _f64(score)) / np.sqrt(np.mean(v * v) + eps) for v in sources])
    p = np.exp(s - s.max())
    p /= p.sum()
    return sum(pi * v for pi, v in zip(p, sources, strict=True)), p


class NaiveDecoder:
    def __init__(self, weights):
        self.w = weights
        self.kda_state = {}
        self.mla_inputs = {}
        for layer in weights.layers:
            if isinstance(layer.attention, KdaWeights):
                self.kda_state[layer.index] = KdaState.zeros(layer.attention, np, np.float64)
            else:
                self.mla_inputs[layer.index] = []

    def step(self, token: int):
        w, cfg = self.w, self.w.config
        eps = cfg.rms_norm_eps
        record = {"attn": {}, "ffn": {}, "ids": {}}
        h = _f64(w.embed_tokens[token])
        stack = []
        for layer in w.layers:
            i = layer.index
            prefix = h
            a_in = h
            if stack:
                a_in, record["attn"][i] = _mix(prefix, stack, layer.attn_res_score, eps)
            if cfg.is_block_boundary(i):
                stack.append(prefix)
                prefix = None
            x = _rms(a_in, layer.input_layernorm, eps)
            if i in self.kda_state:
                a, self.kda_state[i] = naive_kda_step(x, layer.attention, self.kda_state[i])
            else:
                self.mla_inputs[i].append(x)
                a = naive_mla_prefill(np.array(self.mla_inputs[i]), layer.attention)[-1]
            prefix = a if prefix is None else prefix + a
            f_in, record["ffn"][i] = _mix(prefix, stack, layer.mlp_res_score, eps)
            y = _rms(f_in, layer.post_attention_layernorm, eps)
            if isinstance(layer.ffn, LatentMoeWeights):
                f, record["ids"][i], _ = naive_latent_moe(y, layer.ffn)
            else:
                gu = _f64(layer.ffn.gate_up_proj) @ y
                f = _f64(layer.ffn.down_proj) @ naive_situ_and_mul(gu, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
            h = prefix + f
        out, record["final"] = _mix(h, stack, w.output_attn_res_score, eps)
        return _f64(w.lm_head) @ _rms(out, w.norm, eps), record
