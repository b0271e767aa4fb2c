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

import os
from dataclasses import dataclass, field, fields, replace
from typing import Union

from .config import KimiDecoderConfig, LayerSpec, site_names
from .kda import KdaState, KdaWeights
from .kimi_sequence import kimi_forward_sequence
from .kimi_token import (
    OutputHead,
    decoder_layer,
    dtype_name,
    embed_token,
    finish_token,
    kimi_forward_token,
    mark_broken,
    output_hidden,
    refuse_broken,
    refuse_shared,
    run_layers,
    token_index,
    token_indices,
)
from .latent_moe import LatentMoeWeights
from .mla import MlaState, MlaWeights
from .ops import DenseMlpWeights

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
    "hook_names",
    "kimi_forward_sequence",
    "kimi_forward_token",
    "mark_broken",
    "output_hidden",
    "refuse_broken",
    "refuse_shared",
    "run_layers",
    "token_index",
    "token_indices",
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

    def forward_sequence(self, state: KimiDecodeState, token_ids, hooks=None, chunk: int | None = None):
        """`kimi_forward_sequence`: logits [T, vocab] on this model's backend; `state` advanced as by T tokens."""
        return kimi_forward_sequence(self, state, token_ids, hooks, chunk)

    def embedding(self):
        """The token embedding table [vocab, d]."""
        if self.embed_tokens is None:
            raise ValueError("these weights were loaded with embedding=False: they have no token embedding (a pipeline "
                             "stage after the first starts from the stack it is handed)")
        return self.embed_tokens

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

    def weight_samples(self) -> tuple[dict, list, list]:
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
                f"vocab {cfg.vocab_size}, {self.device} {dtype_name(self.dtype)}, "
                f"{self.memory_report().total / 2**20:.1f} MiB, source {str(self.source)!r})")


@dataclass
class KimiLayerState:
    """Decode state of one layer: its attention's state (KDA windows + recurrent matrix, or MLA cache)."""

    attention: Union[KdaState, MlaState]

    def copy(self) -> KimiLayerState:
        return KimiLayerState(self.attention.copy())

    def checkpoint(self) -> KimiLayerState:
        return KimiLayerState(self.attention.checkpoint())

    def arrays(self) -> dict:
        """The attention state's arrays by field name (KDA: conv, recurrent; MLA: keys, values)."""
        att = self.attention
        return {f.name: a for f in fields(att) if hasattr(a := getattr(att, f.name), "shape")}

    def converted(self, convert) -> KimiLayerState:
        """This layer's state with every array passed through `convert` (the other fields as they are)."""
        return KimiLayerState(replace(self.attention, **{k: convert(a) for k, a in self.arrays().items()}))


@dataclass
class KimiDecodeState:
    """Everything that carries from one token to the next.

    broken: None, or why the state is unusable: an exception (a hook's, a KeyboardInterrupt) stopped a
    forward pass after it had begun to advance the layers, so some layers have seen a token the others
    have not. Forward passes refuse such a state (`check_state`) instead of decoding on from it.
    shared: a `checkpoint()`: it shares its MLA caches with the state it was taken from, so decoding on it
    would write into that state's caches; forward passes refuse it (decode on `checkpoint.copy()`).
    layer_ids: the layers of the weights it was made for (`new`; None: not known, e.g. read from a file):
    forward passes refuse it under weights of other layers (a subset's state under another subset).
    """

    layers: list[KimiLayerState]
    position: int = 0
    broken: str | None = None
    shared: bool = False
    layer_ids: tuple | None = None

    @classmethod
    def new(cls, weights: KimiDecoderWeights) -> KimiDecodeState:
        """A zero state (position 0) for `weights`: KDA windows and matrices of zeros, empty MLA caches."""
        if not all(hasattr(weights, a) for a in ("layers", "xp", "dtype")):
            raise TypeError(f"KimiDecodeState.new: weights: expected the model from ke.from_pretrained(...), "
                            f"got {type(weights).__name__}" + (" (a path: load it with ke.from_pretrained(path) first)"
                                                               if isinstance(weights, (str, os.PathLike)) else ""))
        new = {"kda": KdaState.zeros, "mla": MlaState.empty}
        return cls([KimiLayerState(new[layer.attention.kind](layer.attention, weights.xp, weights.dtype))
                    for layer in weights.layers], 0, layer_ids=tuple(int(layer.index) for layer in weights.layers))

    def copy(self) -> KimiDecodeState:
        """An exact deep copy: it shares no array with this state and keeps every array's shape (an MLA
        cache keeps its capacity), so decoding on from the copy repeats the same arithmetic on the same
        layouts, bit for bit (what Session's checkpoints, truncates and forks rely on)."""
        return KimiDecodeState([s.copy() for s in self.layers], self.position, self.broken, layer_ids=self.layer_ids)

    def checkpoint(self) -> KimiDecodeState:
        """A copy to keep, never to decode on: only `copy()` it (a Session's checkpoints). The KDA arrays are
        copied; each MLA cache is shared with this state (`MlaState.checkpoint`), which only appends to it."""
        return KimiDecodeState([s.checkpoint() for s in self.layers], self.position, self.broken, shared=True,
                               layer_ids=self.layer_ids)

    def arrays(self) -> list:
        """Every array the state holds, layer by layer."""
        return [a for ls in self.layers for a in ls.arrays().values()]

    @property
    def nbytes(self) -> int:
        """Bytes of every array (an MLA cache counts its whole capacity)."""
        return sum(int(a.nbytes) for a in self.arrays())

    def __repr__(self) -> str:
        """One line: the dataclass default prints every array."""
        n_mla = sum(ls.attention.kind == "mla" for ls in self.layers)
        first = self.arrays()[:1]
        where = f"{type(first[0]).__module__.split('.')[0]} {dtype_name(first[0].dtype)}, " if first else ""
        return (f"KimiDecodeState(position {self.position}, {len(self.layers)} layers ({len(self.layers) - n_mla} KDA, "
                f"{n_mla} MLA), {where}{self.nbytes / 2**20:.2f} MiB{', broken' if self.broken else ''})")


def hook_names(model) -> list[str]:
    """Every hook point `kimi_forward_token` fires for this model (weights or a pipeline), in firing order."""
    if not hasattr(model, "specs"):
        raise TypeError(f"hook_names: expected the model from ke.from_pretrained(...) or a ke.RayPipeline, "
                        f"got {type(model).__name__}")
    return site_names(model.specs)
