"""What kimi_explore computes at each site from the nearest sites upstream, and variants to probe.

`OPERATIONS[kind]` names the operation that produces a site's value from its inputs (the values of
the sites before it, which a teacher-forced replay takes from the other engine): when a site is
local, this is what disagrees.

`PROBES` are variants of one operation that engines are known to get differently; each is tried
by replaying with the variant patched in through the hooks (`patching.replay(probe=...)`):

- "KDA q/k L2 norm": q, k = x / sqrt(sum(x^2) + eps), eps 1e-6 in fla's kernel (kimi_explore's
  `kda.L2NORM_EPS`); llama.cpp passes `rms_norm_eps`. It shapes `kda.state` (through k) and
  `kda.o` (through q and k), and is `kda.q` / `kda.k` themselves where a dump has them. The probe
  recomputes `kda.q` / `kda.k` from `kda.conv_out` with another eps.
- "MLA latent RMSNorm": q_a_layernorm / kv_a_layernorm with eps 1e-6 (the class default,
  `mla.LATENT_NORM_EPS`); llama.cpp uses `rms_norm_eps`. The probe recomputes `mla.q_latent` /
  `mla.kv_latent` from `attn.in` with another eps.
"""

from __future__ import annotations

import math

import numpy as np

from ..model.kda import L2NORM_EPS
from ..model.mla import LATENT_NORM_EPS
from ..model.ops import rms_norm

__all__ = ["EPS_CANDIDATES", "INPUTS", "OPERATIONS", "PROBES", "EpsProbe", "KdaQkNormProbe", "MlaLatentNormProbe", "input_graph",
           "operation_of"]

OPERATIONS = {
    "embed": "embedding lookup",
    "attn_res.attn.weights": "AttnRes softmax over the block sources (attention site)",
    "attn.in": "AttnRes mix + input RMSNorm",
    "kda.conv": "KDA q/k/v projections into the short-conv window",
    "kda.conv_out": "KDA q/k/v projections + short conv + SiLU",
    "kda.q": "KDA q L2 norm",
    "kda.k": "KDA k L2 norm",
    "kda.v": "KDA v projection + short conv + SiLU",
    "kda.beta": "KDA beta = sigmoid(b_proj x)",
    "kda.decay": "KDA decay gate exp(lower_bound sigmoid(A (f_b f_a x + dt_bias)))",
    "kda.gate": "KDA output gate sigmoid(g_proj x)",
    "kda.state": "KDA q/k L2 norm + gated delta rule",
    "kda.o": "KDA q/k L2 norm + state read-out S^T q",
    "mla.q_latent": "MLA q_a projection + latent RMSNorm",
    "mla.kv_latent": "MLA kv_a projection + latent RMSNorm",
    "mla.probs": "MLA q/k up-projections + scores + softmax",
    "mla.o": "MLA value up-projection + probability mix",
    "attn.out": "attention output: norm, gate and o_proj",
    "attn_res.ffn.weights": "AttnRes softmax over the block sources (MLP site)",
    "ffn.in": "AttnRes mix + post-attention RMSNorm",
    "moe.router.scores": "router sigmoid(gate x)",
    "moe.router.topk_ids": "top-k selection on the biased scores",
    "moe.router.topk_weights": "routing weights (renormalised, scaled)",
    "moe.experts_out": "routed experts (latent SiTU MLPs), weighted sum",
    "moe.routed_out": "latent RMSNorm + routed up-projection",
    "moe.shared_out": "shared experts",
    "ffn.out": "FFN output (dense MLP, or routed + shared experts)",
    "prefix_sum": "residual sum",
    "final.block_residual": "sealed blocks",
    "final.attn_res.weights": "AttnRes softmax over the block sources (output)",
    "final.hidden": "output AttnRes mix + final RMSNorm",
    "logits": "lm_head",
}

# The sites each site's operation reads, by kind within its layer (kimi_token.decoder_layer and the layer modules;
# where an attention or FFN kind reads differently, by kind). STREAM is the running sum before the layer (the previous
# layer's prefix_sum, or the embedding at layer 0); BLOCKS the sealed blocks of the stack (the embedding and the
# running sums pushed at block boundaries), which every AttnRes mix reads. A boundary layer pushes STREAM first, and its
# prefix_sum restarts: attention out + FFN out.
STREAM, BLOCKS = "<stream>", "<blocks>"
INPUTS = {
    "attn_res.attn.weights": (BLOCKS, STREAM),
    "attn.in": ("attn_res.attn.weights", BLOCKS, STREAM),
    "kda.conv": ("attn.in",),
    "kda.conv_out": ("kda.conv",),
    "kda.q": ("kda.conv_out",),
    "kda.k": ("kda.conv_out",),
    "kda.v": ("kda.conv_out",),
    "kda.beta": ("attn.in",),
    "kda.decay": ("attn.in",),
    "kda.gate": ("attn.in",),
    "kda.state": ("kda.k", "kda.v", "kda.beta", "kda.decay"),
    "kda.o": ("kda.state", "kda.q"),
    "mla.q_latent": ("attn.in",),
    "mla.kv_latent": ("attn.in",),
    "mla.probs": ("mla.q_latent", "mla.kv_latent", "attn.in"),  # (k_pe: attn.in's kv_a projection, not normed)
    "mla.o": ("mla.probs", "mla.kv_latent"),
    # (by the layer's kind, told by a site only that kind has; MLA's output gate reads attn.in)
    "attn.out": {"mla.o": ("mla.o", "attn.in"), "kda.o": ("kda.o", "kda.gate")},
    "attn_res.ffn.weights": ("attn.out", BLOCKS, STREAM),
    "ffn.in": ("attn_res.ffn.weights", "attn.out", BLOCKS, STREAM),
    "moe.router.scores": ("ffn.in",),
    "moe.router.topk_ids": ("moe.router.scores",),
    "moe.router.topk_weights": ("moe.router.scores", "moe.router.topk_ids"),
    "moe.experts_out": ("ffn.in", "moe.router.topk_ids", "moe.router.topk_weights"),
    "moe.routed_out": ("moe.experts_out",),
    "moe.shared_out": ("ffn.in",),
    "ffn.out": {"moe.routed_out": ("moe.routed_out", "moe.shared_out"), "ffn.in": ("ffn.in",)},
    "prefix_sum": ("attn.out", "ffn.out", STREAM),  # (STREAM: not at a block boundary)
    "final.block_residual": (BLOCKS,),
    "final.attn_res.weights": (BLOCKS, STREAM),
    "final.hidden": ("final.attn_res.weights", BLOCKS, STREAM),
    "logits": ("final.hidden",),
}


def input_graph(names: list[str], config) -> dict[str, list[str]]:
    """{site: the sites among `names` (a model's hook names, in firing order) that its operation reads} (`INPUTS`),
    for a model of `config` (its block boundaries)."""
    names_set, graph = set(names), {}
    stream, blocks, layer_now, before, after = "embed", [], None, [], []  # the running sum and sealed blocks so far
    for site in names:
        parts = site.split(".", 2)
        layer, kind = (int(parts[1]), parts[2]) if parts[0] == "layers" else (None, site)
        prefix = "" if layer is None else f"layers.{layer}."
        if layer is not None and layer != layer_now:  # a new layer: its stack before and after its push
            layer_now, before = layer, blocks
            after = [*blocks, stream] if config.is_block_boundary(layer) else blocks
        sealed = blocks if layer is None else before if kind in ("attn_res.attn.weights", "attn.in") else after
        reads = INPUTS.get(kind, ())
        if isinstance(reads, dict):  # the first variant whose marking site the layer has
            reads = next((v for marker, v in reads.items() if prefix + marker in names_set), ())
        out = []
        for k in reads:
            if k == BLOCKS:
                out += sealed
            elif k == STREAM:
                if not (kind == "prefix_sum" and config.is_block_boundary(layer)):
                    out.append(stream)
            else:
                out.append(prefix + k)
        graph[site] = [n for n in dict.fromkeys(out) if n in names_set]
        if kind == "prefix_sum":
            stream, blocks = site, after
    return graph


# eps values engines use for these norms: the reference's 1e-6, rms_norm_eps-like 1e-5, and others seen
EPS_CANDIDATES = (1e-5, 1e-6, 1e-8, 1e-12, 0.0)


def operation_of(kind: str) -> str:
    return OPERATIONS.get(kind, kind)


class EpsProbe:
    """A variant of one norm with another eps, patched in through the hooks (see `patching.replay`):
    `capture` keeps the norm's input as it flows (the other engine's, when patched), `replace` returns
    the norm's output recomputed with `eps` at the sites that hold it."""

    name = ""

    def __init__(self, weights, eps: float):
        self.eps = float(eps)
        self._layers = {lw.index: lw for lw in weights.layers}
        self._inputs: dict = {}  # (layer, token) -> the captured input of the norm, until its last output is replaced

    @staticmethod
    def _split(site: str):
        parts = site.split(".", 2)
        return (int(parts[1]), parts[2]) if parts[0] == "layers" else (None, site)


class KdaQkNormProbe(EpsProbe):
    """q, k = x / sqrt(sum(x^2) + eps) (q also times K^-1/2), from `kda.conv_out` [3, H, K] into `kda.q` / `kda.k`."""

    name = "KDA q/k L2 norm"

    def capture(self, site: str, value, t: int) -> None:
        i, kind = self._split(site)
        if kind == "kda.conv_out":
            self._inputs[i, t] = value[:2]

    def replace(self, site: str, value, t: int):
        i, kind = self._split(site)
        if kind not in ("kda.q", "kda.k"):
            return value
        row = 0 if kind == "kda.q" else 1
        x = self._inputs[i, t][row] if row == 0 else self._inputs.pop((i, t))[row]  # (q fires before k)
        scale = 1.0 / math.sqrt(self._layers[i].attention.head_dim) if row == 0 else 1.0
        sq = (x * x).sum(axis=-1, keepdims=True)
        return (x * (scale / (sq + self.eps) ** 0.5)).astype(value.dtype)


class MlaLatentNormProbe(EpsProbe):
    """rms_norm(q_a_proj(x), eps) and rms_norm(kv_a(x), eps), from `attn.in` into `mla.q_latent` / `mla.kv_latent`."""

    name = "MLA latent RMSNorm"

    def capture(self, site: str, value, t: int) -> None:
        i, kind = self._split(site)
        if kind == "attn.in" and self._layers[i].attention.kind == "mla":
            self._inputs[i, t] = value

    def replace(self, site: str, value, t: int):
        i, kind = self._split(site)
        if kind not in ("mla.q_latent", "mla.kv_latent"):
            return value
        w = self._layers[i].attention
        y = w.in_proj @ (self._inputs[i, t] if kind == "mla.q_latent" else self._inputs.pop((i, t)))  # (q fires first)
        if kind == "mla.q_latent":
            return rms_norm(y[: w.q_lora_rank], w.q_a_layernorm, self.eps)
        return rms_norm(y[w.q_lora_rank : w.q_lora_rank + w.kv_lora_rank], w.kv_a_layernorm, self.eps)


# probe name -> (its class, the site kinds it can explain, kimi_explore's own eps for it)
PROBES = {
    KdaQkNormProbe.name: (KdaQkNormProbe, ("kda.q", "kda.k", "kda.state", "kda.o"), L2NORM_EPS),
    MlaLatentNormProbe.name: (MlaLatentNormProbe, ("mla.q_latent", "mla.kv_latent"), LATENT_NORM_EPS),
}


def probe_sites(probe: str, sites) -> list[str]:
    """The sites among `sites` (full names) that `probe` can explain."""
    kinds = PROBES[probe][1]
    return [s for s in sites if any(s.endswith("." + k) for k in kinds)]


def candidates(own: float, config) -> list[float]:
    """The eps values to try for a norm whose own eps is `own`: rms_norm_eps first, then the others."""
    out = []
    for e in (float(config.rms_norm_eps), *EPS_CANDIDATES):
        if not np.isclose(e, own, rtol=1e-9, atol=0) and e not in out:
            out.append(e)
    return out
