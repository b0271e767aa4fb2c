"""The K3 decoder: weights, decode state, and `kimi_forward_token` (one token through every layer).

Per token (spec section 6.2), starting with h = embed(token) and an EMPTY block stack:

    for each layer i:
        prefix = h
        a_in = attn_res(prefix, stack, self_attention_res) if stack else h
        if i % attn_res_block_size == 0: push prefix (the RAW input); prefix = None
        a = Attn_i(input_layernorm(a_in))                         KDA or MLA, advances its state
        prefix = a if prefix is None else prefix + a
        f_in = attn_res(prefix, stack, mlp_res)
        h = prefix + FFN_i(post_attention_layernorm(f_in))       dense MLP or latent MoE
    logits = lm_head(norm(attn_res(h, stack, output_attn_res)))

Only the attention layers carry state across tokens (KDA windows + recurrent matrix, MLA K/V
cache); the block stack runs over depth and is rebuilt for every token.

With `layers=` a subset, the stack runs those layers (keeping their own indices, so their kinds,
block boundaries and hook names are those of the full model), then the output mix, final norm and
lm_head: for layers 0..N-1 this is exactly the model cut to N layers.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Union

from .block_residual import SourceBuffer
from .config import KimiDecoderConfig
from .kda import KdaState, KdaWeights, kda_step
from .latent_moe import LatentMoeWeights, latent_moe
from .mla import MlaState, MlaWeights, mla_step
from .ops import DenseMlpWeights, dense_mlp, rms_norm

KimiLayerAttention = Union[KdaWeights, MlaWeights]
KimiLayerFfn = Union[DenseMlpWeights, LatentMoeWeights]

__all__ = [
    "DenseMlpWeights",
    "KimiDecodeState",
    "KimiDecoderConfig",
    "KimiDecoderLayerWeights",
    "KimiDecoderWeights",
    "KimiLayerAttention",
    "KimiLayerFfn",
    "KimiLayerState",
    "hook_names",
    "kimi_forward_token",
]


@dataclass
class KimiDecoderLayerWeights:
    """One decoder layer.

    input_layernorm, post_attention_layernorm: [d]
    attn_res_score: [d]  self_attention_res_norm.weight * self_attention_res_proj.weight[0]
    mlp_res_score:  [d]  mlp_res_norm.weight * mlp_res_proj.weight[0]
    """

    index: int  # 0-based layer index in the full model
    input_layernorm: object
    post_attention_layernorm: object
    attn_res_score: object
    mlp_res_score: object
    attention: KimiLayerAttention
    ffn: KimiLayerFfn
    is_block_boundary: bool

    @property
    def hook_prefix(self) -> str:
        return f"layers.{self.index}."


@dataclass
class KimiDecoderWeights:
    """The loaded model: global tensors, the chosen layers, and the array backend they live on.

    embed_tokens: [vocab, d];  output_attn_res_score: [d];  norm: [d];  lm_head: [vocab, d]
    """

    config: KimiDecoderConfig
    embed_tokens: object
    layers: list[KimiDecoderLayerWeights]
    output_attn_res_score: object
    norm: object
    lm_head: object
    xp: object
    device: str
    dtype: object
    source: str = ""
    extra: dict = field(default_factory=dict)  # how it was loaded: experts mode, cache size, weight_dtype, ...

    @classmethod
    def from_pretrained(cls, path, *, layers=None, device: str = "auto", dtype: str = "float32", **kwargs):
        """Load a K3 checkpoint in the released Hugging Face layout.

        path: a checkpoint directory, or a Hub repo id ("moonshotai/Kimi-K3"): then only config.json,
            the index, the tokenizer files and the shards of the requested layers are fetched.
        layers: None (all) or 0-based layer indices, e.g. range(0, 4).
        device: "auto" | "cpu" | "gpu";  dtype: "float32" | "float64" (compute dtype).
        Further keyword arguments (see `checkpoint.load_weights`): weight_dtype=None | "bfloat16"
        (keep BF16 matrices as bf16 bits, widened per use), experts="auto" | "packed" | "dense",
        expert_cache_size (dequantised experts kept per layer; 0 on the CPU: the fused MXFP4
        kernel; each layer's `ffn.experts.route` says how it runs), revision, cache_dir,
        local_files_only, token, progress.
        """
        from ..weights.checkpoint import load_weights

        return load_weights(path, layers=layers, device=device, dtype=dtype, **kwargs)

    def memory_report(self):
        """Resident bytes by component (see `kimi_explore.weights.memory`)."""
        from ..weights.memory import memory_report

        return memory_report(self)

    @property
    def layer_ids(self) -> list[int]:
        return [layer.index for layer in self.layers]

    @property
    def max_sources(self) -> int:
        """Rows of the per-token source buffer: every push, plus the current running sum."""
        return sum(layer.is_block_boundary for layer in self.layers) + 1


@dataclass
class KimiLayerState:
    """Decode state of one layer: its attention's state (KDA windows + recurrent matrix, or MLA cache)."""

    attention: Union[KdaState, MlaState]

    def copy(self) -> KimiLayerState:
        return KimiLayerState(self.attention.copy())


@dataclass
class KimiDecodeState:
    """Everything that carries from one token to the next."""

    layers: list[KimiLayerState]
    position: int = 0

    @classmethod
    def new(cls, weights: KimiDecoderWeights) -> KimiDecodeState:
        xp, dt = weights.xp, weights.dtype
        states = []
        for layer in weights.layers:
            att = layer.attention
            s = KdaState.zeros(att, xp, dt) if isinstance(att, KdaWeights) else MlaState.empty(att, xp, dt)
            states.append(KimiLayerState(s))
        return cls(states, 0)

    def copy(self) -> KimiDecodeState:
        """A deep copy that shares no array with this state."""
        return KimiDecodeState([s.copy() for s in self.layers], self.position)


def _token_index(token_id, vocab_size: int) -> int:
    if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
        raise TypeError(f"token_id must be an integer, got {token_id!r} ({type(token_id).__name__})")
    t = int(token_id)
    if not 0 <= t < vocab_size:
        raise ValueError(f"token_id={t} is outside the vocabulary: expected 0 <= token_id < {vocab_size}")
    return t


def kimi_forward_token(weights: KimiDecoderWeights, state: KimiDecodeState, token_id, hooks=None):
    """Run one token through every loaded layer; advance `state` in place; return logits [vocab].

    `hooks`: None, or an object with `fire(name, value) -> value` (see `kimi_explore.inspection.hooks.Hooks`);
    the names are listed by `hook_names(weights)`.
    """
    cfg = weights.config
    tid = _token_index(token_id, cfg.vocab_size)
    if len(state.layers) != len(weights.layers):
        raise ValueError(
            f"state has {len(state.layers)} layer states but the weights have {len(weights.layers)} layers; "
            "make the state with KimiDecodeState.new(weights)"
        )
    xp, eps = weights.xp, cfg.rms_norm_eps
    src = SourceBuffer(xp, weights.max_sources, cfg.hidden_size, weights.dtype, eps)  # the block stack + current

    h = weights.embed_tokens[tid]
    if hooks is not None:
        h = hooks.fire("embed", h)
    for layer, layer_state in zip(weights.layers, state.layers, strict=True):
        pre = layer.hook_prefix
        prefix = h
        src.set_current(prefix)
        if src.n > 0:
            p = src.weights(layer.attn_res_score)
            if hooks is not None:
                p = hooks.fire(pre + "attn_res.attn.weights", p)
            a_in = src.mix(p)
        else:
            a_in = prefix
        if layer.is_block_boundary:
            src.seal()  # pushes the RAW layer input, already in the current row
            prefix = None

        x = rms_norm(a_in, layer.input_layernorm, eps)
        if hooks is not None:
            x = hooks.fire(pre + "attn.in", x)
        att = layer.attention
        if isinstance(att, KdaWeights):
            a = kda_step(x, att, layer_state.attention, hooks, pre)
        else:
            a = mla_step(x, att, layer_state.attention, hooks, pre)
        if hooks is not None:
            a = hooks.fire(pre + "attn.out", a)
        prefix = a if prefix is None else prefix + a

        src.set_current(prefix)
        p = src.weights(layer.mlp_res_score)
        if hooks is not None:
            p = hooks.fire(pre + "attn_res.ffn.weights", p)
        y = rms_norm(src.mix(p), layer.post_attention_layernorm, eps)
        if hooks is not None:
            y = hooks.fire(pre + "ffn.in", y)
        ffn = layer.ffn
        if isinstance(ffn, LatentMoeWeights):
            f = latent_moe(y, ffn, hooks, pre)
        else:
            f = dense_mlp(y, ffn, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        if hooks is not None:
            f = hooks.fire(pre + "ffn.out", f)
        h = prefix + f
        if hooks is not None:
            h = hooks.fire(pre + "prefix_sum", h)

    src.set_current(h)
    p = src.weights(weights.output_attn_res_score)
    if hooks is not None:
        hooks.fire("final.block_residual", src.blocks)
        p = hooks.fire("final.attn_res.weights", p)
    hidden = rms_norm(src.mix(p), weights.norm, eps)
    if hooks is not None:
        hidden = hooks.fire("final.hidden", hidden)
    logits = weights.lm_head @ hidden
    if hooks is not None:
        logits = hooks.fire("logits", logits)
    state.position += 1
    return logits


def hook_names(weights: KimiDecoderWeights) -> list[str]:
    """Every hook point `kimi_forward_token` fires for these weights, in firing order."""
    names = ["embed"]
    stacked = 0
    for layer in weights.layers:
        pre = layer.hook_prefix
        if stacked:
            names.append(pre + "attn_res.attn.weights")
        stacked += layer.is_block_boundary
        names.append(pre + "attn.in")
        if isinstance(layer.attention, KdaWeights):
            names += [pre + f"kda.{s}" for s in ("q", "k", "v", "beta", "decay", "gate", "conv", "state")]
        else:
            names.append(pre + "mla.probs")
        names += [pre + "attn.out", pre + "attn_res.ffn.weights", pre + "ffn.in"]
        if isinstance(layer.ffn, LatentMoeWeights):
            names += [pre + f"moe.{s}" for s in ("router.scores", "router.topk_ids", "router.topk_weights")]
            names += [pre + "moe.routed_out", pre + "moe.shared_out"]
        names += [pre + "ffn.out", pre + "prefix_sum"]
    names += ["final.block_residual", "final.attn_res.weights", "final.hidden", "logits"]
    return names
