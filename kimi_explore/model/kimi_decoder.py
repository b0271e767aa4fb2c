"""The K3 decoder: weights, decode state, and `kimi_forward_token` (one token through every layer).

Per token, starting with h = embed(token) and an EMPTY block stack (HF's `_forward_attn_residual`):

    for each layer i (`decoder_layer`):
        x = attn_res(h, stack, self_attention_res) if stack else h
        a = Attn_i(input_layernorm(x))                            KDA or MLA, advances its state
        if i % attn_res_block_size == 0: push h (the RAW input); h = a    the running sum restarts
        else:                                                    h = h + a
        h = h + FFN_i(post_attention_layernorm(attn_res(h, stack, mlp_res)))   dense MLP or latent MoE
    logits = lm_head(norm(attn_res(h, stack, output_attn_res)))

(The push happens after the attention-site mix and before the attention, which does not read
the stack, so the order between the push and the attention does not matter.)

Only the attention layers carry state across tokens (KDA windows + recurrent matrix, MLA K/V
cache); the block stack runs over depth and is rebuilt for every token.

With `layers=` a subset, the stack runs those layers (keeping their own indices, so their kinds,
block boundaries and hook names are those of the full model), then the output mix, final norm and
lm_head: for layers 0..N-1 this is exactly the model cut to N layers.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields
from typing import Union

from .block_residual import SourceBuffer
from .config import KimiDecoderConfig, LayerSpec, site_names
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
    "OutputHead",
    "decoder_layer",
    "embed_token",
    "finish_token",
    "output_hidden",
    "hook_names",
    "kimi_forward_token",
    "run_layers",
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

    def __post_init__(self):
        self.spec = LayerSpec(self.index, self.attention.kind, self.ffn.kind, self.is_block_boundary)
        # every site's full name, bound once (the hot path never builds a name): site kind -> "layers.{i}.kind"
        self.names = {kind: self.spec.hook_prefix + kind for kind in self.spec.site_kinds(True)}

    @property
    def hook_prefix(self) -> str:
        return self.spec.hook_prefix

    @property
    def kind(self) -> str:
        """'kda+dense', 'kda+moe', 'mla+moe', ... (as `KimiDecoderConfig.layer_kind`)."""
        return self.spec.kind


class LayerSequence:
    """What a model's layer outlines (`specs`, one `LayerSpec` per loaded layer) say, wherever their
    arrays are (here, or in a pipeline's stages)."""

    specs: list

    @property
    def layer_ids(self) -> list[int]:
        return [spec.index for spec in self.specs]

    @property
    def max_sources(self) -> int:
        """Rows of the per-token source buffer: every push, plus the current running sum."""
        return sum(spec.is_block_boundary for spec in self.specs) + 1


@dataclass(frozen=True)
class OutputHead:
    """What turns a token's block stack into logits: the output mix's score vector [d], the final
    RMSNorm's weight [d] and eps, lm_head [vocab, d] (on the model's array backend)."""

    attn_res_score: object
    norm: object
    lm_head: object
    eps: float


@dataclass
class KimiDecoderWeights(LayerSequence):
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
    workspace: object = None  # weights.workspace.Workspace: this model's scratch (bf16 widening, dequantised experts, threads)

    @property
    def specs(self) -> list[LayerSpec]:
        return [layer.spec for layer in self.layers]

    # ---- the model interface: a `RayPipeline` answers the same calls, so callers never ask which they hold ----
    def new_state(self) -> KimiDecodeState:
        """An empty decode state."""
        return KimiDecodeState.new(self)

    def forward_token(self, state: KimiDecodeState, token_id, hooks=None):
        """`kimi_forward_token`: logits [vocab] on this model's backend; `state` advanced in place."""
        return kimi_forward_token(self, state, token_id, hooks)

    def head(self) -> OutputHead:
        """The output head (what a logit lens reads after every layer)."""
        if self.lm_head is None:
            raise ValueError("these weights were loaded with head=False: they have no output head")
        return OutputHead(self.output_attn_res_score, self.norm, self.lm_head, self.config.rms_norm_eps)

    def local_weights(self) -> KimiDecoderWeights:
        """Every layer's arrays in this process (what an exact attribution reads): these weights."""
        return self

    def host_state(self, state: KimiDecodeState) -> KimiDecodeState:
        """The state in this process (its arrays on the weights' backend), e.g. to save it."""
        return state

    def put_state(self, state: KimiDecodeState) -> KimiDecodeState:
        """A decode state for these weights from `host_state`'s form (the arrays already on the backend)."""
        return state

    def restart_lost_stages(self) -> list[int]:
        """A RayPipeline restarts its lost stages here; weights in this process have none to lose."""
        raise TypeError("Session.recover() is for sessions over a RayPipeline, whose stages can be lost; these "
                        "weights live in this process")

    def weight_samples(self) -> tuple[dict, list]:
        """Samples of every weight tensor for a session file's fingerprint (`model.fingerprint`)."""
        from .fingerprint import weight_samples

        return weight_samples(self)

    def memory_report(self):
        """Resident bytes by component (`kimi_explore.weights.memory`, reached through the workspace the
        loader gave these weights: the model records import nothing from `weights/`)."""
        if self.workspace is None:
            raise ValueError("memory_report: these weights have no workspace (they were not built by from_pretrained)")
        return self.workspace.memory_report(self)

    def __repr__(self) -> str:
        """One line: the dataclass default prints every array (~350,000 characters for the tiny model)."""
        cfg, kinds = self.config, [spec.kind for spec in self.specs]
        n_kda, n_moe = sum(k.startswith("kda") for k in kinds), sum(k.endswith("moe") for k in kinds)
        return (f"KimiDecoderWeights({len(kinds)} of {cfg.num_hidden_layers} layers ({n_kda} KDA, {len(kinds) - n_kda} MLA; "
                f"{n_moe} MoE, {cfg.num_experts} experts top-{cfg.num_experts_per_token}), hidden {cfg.hidden_size}, "
                f"vocab {cfg.vocab_size}, {self.device} {_dtype_name(self.dtype)}, "
                f"{self.memory_report().total / 2**20:.1f} MiB, source {str(self.source)!r})")


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
        new = {"kda": KdaState.zeros, "mla": MlaState.empty}
        return cls([KimiLayerState(new[layer.attention.kind](layer.attention, weights.xp, weights.dtype))
                    for layer in weights.layers], 0)

    def copy(self) -> KimiDecodeState:
        """An exact deep copy: it shares no array with this state and keeps every array's shape (an MLA
        cache keeps its capacity), so decoding on from the copy repeats the same arithmetic on the same
        layouts, bit for bit (what Session's checkpoints, truncates and forks rely on)."""
        return KimiDecodeState([s.copy() for s in self.layers], self.position)

    def _arrays(self) -> list:
        """Every array the state holds, layer by layer."""
        return [a for ls in self.layers for f in fields(ls.attention) if hasattr(a := getattr(ls.attention, f.name), "nbytes")]

    @property
    def nbytes(self) -> int:
        """Bytes of every array (an MLA cache counts its whole capacity)."""
        return sum(int(a.nbytes) for a in self._arrays())

    def __repr__(self) -> str:
        """One line: the dataclass default prints every array."""
        n_mla = sum(ls.attention.kind == "mla" for ls in self.layers)
        first = self._arrays()[:1]
        where = f"{type(first[0]).__module__.split('.')[0]} {_dtype_name(first[0].dtype)}, " if first else ""
        return (f"KimiDecodeState(position {self.position}, {len(self.layers)} layers ({len(self.layers) - n_mla} KDA, "
                f"{n_mla} MLA), {where}{self.nbytes / 2**20:.2f} MiB)")


def _dtype_name(dtype) -> str:
    return getattr(dtype, "name", None) or getattr(dtype, "__name__", str(dtype))


def token_index(token_id, vocab_size: int) -> int:
    if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
        raise TypeError(f"token_id must be an integer, got {token_id!r} ({type(token_id).__name__})")
    t = int(token_id)
    if not 0 <= t < vocab_size:
        raise ValueError(f"token_id={t} is outside the vocabulary: expected 0 <= token_id < {vocab_size}")
    return t


def kimi_forward_token(weights: KimiDecoderWeights, state: KimiDecodeState, token_id, hooks=None):
    """Run one token through every loaded layer; advance `state` in place; return logits [vocab].

    `hooks`: None, or an object with `fire(name, value) -> value` (see `kimi_explore.inspection.hooks.Hooks`);
    the names are listed by `hook_names(weights)`. The three parts (`embed_token`, `run_layers`,
    `finish_token`) are what a pipeline stage runs a share of (`kimi_explore.distributed`): the same
    operations in the same order, so a staged decode is bit-identical to this one.
    """
    _check_state(weights, state)  # before "embed" fires: a recorder would otherwise have started a token
    stack = embed_token(weights, token_id, hooks)
    run_layers(weights, state, stack, hooks)
    logits = finish_token(weights.head(), stack, hooks)
    state.position += 1
    return logits


def embed_token(weights: KimiDecoderWeights, token_id, hooks=None, rows: int | None = None) -> SourceBuffer:
    """The stack a token starts with: no sealed block, the running sum its embedding.

    rows: the stack's capacity (default `weights.max_sources`; a pipeline stage holding only some
    layers passes the whole model's).
    """
    cfg = weights.config
    tid = token_index(token_id, cfg.vocab_size)
    stack = SourceBuffer(weights.xp, rows or weights.max_sources, cfg.hidden_size, weights.dtype, cfg.rms_norm_eps)
    h = weights.embed_tokens[tid]
    stack.set_current(h if hooks is None else hooks.fire("embed", h))
    return stack


def run_layers(weights: KimiDecoderWeights, state: KimiDecodeState, stack: SourceBuffer, hooks=None) -> None:
    """Every loaded layer on one token, from the stack as the previous layer (or the embedding) left it."""
    _check_state(weights, state)
    for layer, layer_state in zip(weights.layers, state.layers, strict=True):
        decoder_layer(layer, layer_state, stack, weights.config, hooks)


def _check_state(weights: KimiDecoderWeights, state: KimiDecodeState) -> None:
    if len(state.layers) != len(weights.layers):
        raise ValueError(
            f"state has {len(state.layers)} layer states but the weights have {len(weights.layers)} layers; "
            "make the state with KimiDecodeState.new(weights)"
        )


def finish_token(head: OutputHead, stack: SourceBuffer, hooks=None):
    """The output mix over the stack, the final norm and lm_head: logits [vocab]."""
    logits = head.lm_head @ output_hidden(head, stack, hooks)
    return logits if hooks is None else hooks.fire("logits", logits)


def output_hidden(head: OutputHead, stack: SourceBuffer, hooks=None):
    """The output mix over the stack and the final norm: the hidden vector lm_head reads [d].

    `final.block_residual` ([n, d], the sealed blocks) fires first: a returned array replaces the
    blocks the output mix reads. (A logit lens runs this on the stack after every layer.)"""
    fire = _unhooked if hooks is None else hooks.fire
    if hooks is not None:
        blocks = stack.blocks
        new = hooks.fire("final.block_residual", blocks)
        if new is not blocks:
            stack.replace_blocks(new)
    p = fire("final.attn_res.weights", stack.weights(head.attn_res_score))
    return fire("final.hidden", rms_norm(stack.mix(p), head.norm, head.eps))


def decoder_layer(layer: KimiDecoderLayerWeights, state: KimiLayerState, stack: SourceBuffer, cfg: KimiDecoderConfig,
                  hooks=None) -> None:
    """One layer on one token. The running sum h is `stack.current`, replaced by this layer's output;
    a block boundary pushes h onto the stack; `state` (this layer's attention state) advances.

    mix(score) is the stack's softmax mix of [blocks..., h] (`SourceBuffer`); `fire` passes each value
    through the hooks at its site (the identity without hooks).
    """
    fire, names, eps = _unhooked if hooks is None else hooks.fire, layer.names, cfg.rms_norm_eps
    h = stack.current
    x = stack.mix(fire(names["attn_res.attn.weights"], stack.weights(layer.attn_res_score))) if stack.n else h
    if layer.is_block_boundary:
        stack.seal()  # pushes the RAW input h, already the stack's current row
    x = fire(names["attn.in"], rms_norm(x, layer.input_layernorm, eps))
    a = fire(names["attn.out"], _attention(x, layer, state, hooks))
    stack.set_current(a if layer.is_block_boundary else h + a)  # a block boundary restarts the running sum

    y = stack.mix(fire(names["attn_res.ffn.weights"], stack.weights(layer.mlp_res_score)))
    y = fire(names["ffn.in"], rms_norm(y, layer.post_attention_layernorm, eps))
    f = fire(names["ffn.out"], _ffn(y, layer, cfg, hooks))
    stack.set_current(fire(names["prefix_sum"], stack.current + f))


def _unhooked(name: str, value):
    return value


def _attention(x, layer: KimiDecoderLayerWeights, state: KimiLayerState, hooks):
    step = kda_step if layer.attention.kind == "kda" else mla_step
    return step(x, layer.attention, state.attention, hooks, layer.names)


def _ffn(y, layer: KimiDecoderLayerWeights, cfg: KimiDecoderConfig, hooks):
    if layer.ffn.kind == "moe":
        return latent_moe(y, layer.ffn, hooks, layer.names)
    return dense_mlp(y, layer.ffn, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)


def hook_names(model) -> list[str]:
    """Every hook point `kimi_forward_token` fires for this model (weights or a pipeline), in firing order."""
    return site_names(model.specs)
