"""A hand-built stand-in for `kimi_explore.Trace`, of any size (up to K3's 93 layers and 896 experts).

It implements exactly the part of the Trace contract the plots read, from random numbers with the
right structure: softmax weights that are NaN where a block is not sealed yet, sigmoid router scores
with the top-k taken from them, positive state norms. Plot tests use it to check that every view
scales to K3 without loading a model.
"""

from __future__ import annotations

import numpy as np


class SyntheticTrace:
    def __init__(self, n_tokens=6, n_layers=16, block_size=4, mla_every=4, n_heads=4, n_experts=16, top_k=4,
                 vocab=256, top_n=10, seed=0):
        rng = np.random.default_rng(seed)
        self.layer_ids = list(range(n_layers))
        self.tokens = [int(t) for t in rng.integers(32, 127, n_tokens)]
        self.kda_ids = [i for i in self.layer_ids if i % mla_every != mla_every - 1 and i != n_layers - 1]
        self.moe_ids = [i for i in self.layer_ids if i >= 1]
        self.kda_layers = list(self.kda_ids)  # the model's layer kinds, as a Trace reads them from its meta
        self.meta = {"block_boundaries": [i for i in self.layer_ids if i % block_size == 0]}
        n_pushes = len([i for i in self.layer_ids if i % block_size == 0])
        S = n_pushes + 1
        self._labels = ["embedding", *[f"block {b}" for b in range(1, n_pushes)], "current"]
        w = np.full((n_tokens, n_layers, 2, S), np.nan)
        self._site_records = {}
        pushed = 0
        for j, i in enumerate(self.layer_ids):
            # attn site sees the stack before this layer's push (absent while empty), ffn site after it
            for site, n_stack in ((0, pushed), (1, pushed + (i % block_size == 0))):
                if n_stack == 0:
                    continue
                logits = rng.normal(size=(n_tokens, n_stack + 1)) * 2
                p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
                w[:, j, site, :n_stack] = p[:, :-1]
                w[:, j, site, -1] = p[:, -1]
                self._site_records[f"layers.{i}.attn_res.{('attn', 'ffn')[site]}.weights"] = p  # the mix's own columns
            pushed += i % block_size == 0
        self._attn_res = w
        f = np.exp(rng.normal(size=(n_tokens, S)))
        self._final = f / f.sum(axis=1, keepdims=True)
        self._kda = np.abs(rng.normal(size=(n_tokens, len(self.kda_ids), n_heads))).cumsum(axis=0)
        scores = 1 / (1 + np.exp(-rng.normal(size=(n_tokens, len(self.moe_ids), n_experts))))
        ids = np.argsort(-scores, axis=2)[..., :top_k]
        tw = np.take_along_axis(scores, ids, axis=2)
        self._routing = {"topk_ids": ids, "topk_weights": tw / tw.sum(axis=2, keepdims=True), "scores": scores,
                         "moe_layers": list(self.moe_ids)}
        self._values = {}
        for i in self.moe_ids:
            self._values[f"layers.{i}.moe.routed_out.norm"] = np.abs(rng.normal(3, 1, n_tokens))
            self._values[f"layers.{i}.moe.shared_out.norm"] = np.abs(rng.normal(2, 1, n_tokens))
        logits = rng.normal(size=(n_tokens, vocab)) * 2
        probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        top = np.argsort(-probs, axis=1)[:, :top_n]
        self._values["logits.top_ids"] = top
        self._values["logits.top_probs"] = np.take_along_axis(probs, top, axis=1)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, name):
        return self._values[name] if name in self._values else self._site_records[name]

    def __contains__(self, name):
        return name in self._values or name in self._site_records

    def attn_res_weights(self):
        return self._attn_res

    def source_labels(self):
        return list(self._labels)

    def final_attn_res_weights(self):
        return self._final

    def kda_state_norms(self):
        return self._kda, list(self.kda_ids)

    def routing(self):
        return dict(self._routing)


def k3_sized(n_tokens=12, seed=0) -> SyntheticTrace:
    """K3's shape: 93 layers, block size 12, 96 KDA heads, 896 experts top-16, vocab 163840."""
    return SyntheticTrace(n_tokens=n_tokens, n_layers=93, block_size=12, n_heads=96, n_experts=896, top_k=16,
                          vocab=163840, seed=seed)
