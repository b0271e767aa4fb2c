"""The token form of the K3 decoder: `kimi_forward_token`, one token through every layer.

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

import contextlib
import numbers
from collections.abc import Mapping, Set
from dataclasses import dataclass
from operator import attrgetter

from .block_residual import SourceBuffer
from .config import KimiDecoderConfig
from .kda import kda_step
from .latent_moe import latent_moe
from .mla import mla_step
from .ops import dense_mlp, rms_norm
from .sites import site_table

__all__ = ["OutputHead", "check_state", "decoder_layer", "dtype_name", "embed_token", "finish_token", "hooks_type_error",
           "in_use", "kimi_forward_token", "mark_broken", "output_hidden", "refuse_broken", "refuse_shared", "run_layers",
           "token_index", "token_indices"]


@dataclass(frozen=True)
class OutputHead:
    """What turns a token's block stack into logits: the output mix's score vector [d], the final
    RMSNorm's weight [d] and eps, lm_head [vocab, d] (on the model's array backend)."""

    attn_res_score: object
    norm: object
    lm_head: object
    eps: float


def token_index(token_id, vocab_size: int) -> int:
    if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
        raise TypeError(f"token_id must be an integer, got {token_id!r} ({type(token_id).__name__})")
    t = int(token_id)
    if not 0 <= t < vocab_size:
        raise ValueError(f"token_id={t} is outside the vocabulary: expected 0 <= token_id < {vocab_size}")
    return t


def token_indices(token_ids, vocab_size: int) -> list[int]:
    """`token_index` of every id (a list, a tuple or an integer array), as a list of ints: one pass over
    plain ints, each element's own check (and error) otherwise. Bytes are token ids only where the vocabulary
    is bytes (256 ids, the embedded model's): elsewhere b"def" would pass as the ids 100, 101, 102 of
    another tokenizer, a wrong text that runs."""
    if isinstance(token_ids, (bytes, bytearray)) and vocab_size != 256:
        raise ValueError(f"got {type(token_ids).__name__} {bytes(token_ids)!r:.40}, but the model's vocabulary "
                         f"({vocab_size}) is not bytes: pass token ids (a text: its tokenizer's encode(text))")
    if isinstance(token_ids, (Set, Mapping)):  # no order of their own: the text would come out reordered
        raise TypeError(f"token_ids is a {type(token_ids).__name__}, which has no order (decoding it would take its ids "
                        "reordered); give a list or an array")
    if getattr(token_ids, "ndim", 1) != 1:  # (a 0-d array's tolist() is one int; a 2-D one's, lists)
        raise TypeError(f"token_ids: expected a 1-D sequence of token ids, got an array of shape {token_ids.shape}"
                        + (" (one id: [id], or kimi_forward_token)" if token_ids.ndim == 0 else ""))
    ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
    if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < vocab_size)):
        return ids
    for i, t in enumerate(ids):  # the first bad one, and where it is
        try:
            token_index(t, vocab_size)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e}, at token_ids[{i}]") from None
    return [int(t) for t in ids]


def kimi_forward_token(weights, state, token_id, hooks=None):
    """Run one token through every loaded layer; advance `state` in place; return logits [vocab].

    `hooks`: None, or an object with `fire(name, value) -> value` (see `kimi_explore.inspection.hooks.Hooks`);
    the names are listed by `hook_names(weights)`. The three parts (`embed_token`, `run_layers`,
    `finish_token`) are what a pipeline stage runs a share of (`kimi_explore.distributed`): the same
    operations in the same order, so a staged decode is bit-identical to this one.
    If a hook raises (or the call is interrupted) after the layers began to advance, `state` is marked
    part-advanced (`KimiDecodeState.broken`) and every later forward pass refuses it. Whatever stops it,
    a recorder among the hooks drops what it had recorded of the token (`discard_records`).
    """
    check_state(weights, state)  # before "embed" fires: a recorder would otherwise have started a token
    if hooks is not None:  # the token's id and position (the state's), as on the sequence path, unless the driver announced them
        if not hasattr(hooks, "fire"):
            raise hooks_type_error(hooks)
        default = getattr(hooks, "default_token", None)
        if default is not None:
            default(token_index(token_id, weights.config.vocab_size), state.position)
    mark = records_mark(hooks)
    try:
        with in_use(weights):
            stack = embed_token(weights, token_id, hooks)
            try:
                run_layers(weights, state, stack, hooks)
                logits = finish_token(weights.head(), stack, hooks)
            except BaseException as e:
                mark_broken(state, e)
                raise
    except BaseException:
        discard_records(hooks, mark)
        raise
    state.position += 1
    return logits


def embed_token(weights, token_id, hooks=None, rows: int | None = None) -> SourceBuffer:
    """The stack a token starts with: no sealed block, the running sum its embedding.

    rows: the stack's capacity (default `weights.max_sources`; a pipeline stage holding only some
    layers passes the whole model's).
    """
    cfg = weights.config
    tid = token_index(token_id, cfg.vocab_size)
    stack = SourceBuffer(weights.xp, rows or weights.max_sources, cfg.hidden_size, weights.dtype, cfg.rms_norm_eps)
    h = weights.embedding()[tid]  # a view of the table: a hook that edits its value in place gets a copy
    stack.set_current(h if hooks is None else hooks.fire("embed", h.copy()))
    return stack


def run_layers(weights, state, stack: SourceBuffer, hooks=None) -> None:
    """Every loaded layer on one token, from the stack as the previous layer (or the embedding) left it. `state`
    is the caller's to check (`kimi_forward_token` does; a pipeline stage makes its own states)."""
    for layer, layer_state in zip(weights.layers, state.layers, strict=True):
        decoder_layer(layer, layer_state, stack, weights.config, hooks)


def check_state(weights, state) -> None:
    """Refuse a state that is not this model's: the arguments swapped or of the wrong type, another layer
    count, a layer of another kind, or other widths or dtype (a float64 model's state would otherwise run on
    silently in float64 under float32 weights; another model's, fail deep inside a kernel). Widths and
    dtype are checked on the first layer of each kind (a model's layers of one kind share them): ~2 us."""
    if not hasattr(weights, "layers") or not hasattr(weights, "config"):
        hint = " (the arguments are (weights, state, ...): swapped?)" if hasattr(weights, "position") else ""
        raise TypeError(f"weights: expected the model from ke.from_pretrained(...), got {type(weights).__name__}{hint}")
    if not hasattr(state, "layers") or not hasattr(state, "position"):
        raise TypeError(f"state: expected a KimiDecodeState (KimiDecodeState.new(weights)), got {type(state).__name__}")
    refuse_broken(state)
    refuse_shared(state)
    if len(state.layers) != len(weights.layers):
        raise ValueError(
            f"state has {len(state.layers)} layer states but the weights have {len(weights.layers)} layers; "
            "make the state with KimiDecodeState.new(weights)"
        )
    kinds = list(map(_KIND, state.layers))
    if kinds != list(map(_KIND, weights.layers)):
        i = next(i for i, (k, lw) in enumerate(zip(kinds, weights.layers, strict=True)) if k != lw.attention.kind)
        raise ValueError(f"state.layers[{i}] is a {kinds[i]} state but these weights' layer {weights.layers[i].index} "
                         f"is {weights.layers[i].attention.kind}; make the state with KimiDecodeState.new(weights)")
    for kind in ("kda", "mla"):
        i = kinds.index(kind) if kind in kinds else None
        if i is None:
            continue
        w, a = weights.layers[i].attention, state.layers[i].attention
        if kind == "kda":
            name, want, found = "recurrent", (w.num_heads, w.head_dim, w.head_dim), a.recurrent
            shape = found.shape
        else:
            name, want, found = "keys", (w.num_heads, w.qk_nope_head_dim + w.qk_rope_head_dim), a.keys
            shape = (found.shape[0], found.shape[2])
        if shape != want or found.dtype != weights.dtype:
            raise ValueError(
                f"state.layers[{i}] is not a state of these weights: expected {kind} {name} "
                f"{' x '.join(map(str, want))}{' (heads x dim, any length)' if kind == 'mla' else ''} "
                f"in {dtype_name(weights.dtype)}, found {' x '.join(map(str, shape))} in {dtype_name(found.dtype)}; "
                "make the state with KimiDecodeState.new(weights)")
    # the same kinds and widths, other layers (a subset's state under another subset): checked last, so that the
    # messages above name what differs first
    made_for = getattr(state, "layer_ids", None)
    if made_for is not None:
        here = [int(layer.index) for layer in weights.layers]
        if list(made_for) != here:
            raise ValueError(f"state was made for layers {list(made_for)}, these weights hold layers {here}; make the "
                             "state with KimiDecodeState.new(weights)")


def hooks_type_error(hooks) -> TypeError:
    return TypeError(f"hooks: expected None or a ke.Hooks (hooks = ke.Hooks(); hooks.add(name, fn)), "
                     f"got {type(hooks).__name__}")


_KIND = attrgetter("attention.kind")


def dtype_name(dtype) -> str:
    """'float32' for np.float32, np.dtype('float32') or a CuPy dtype."""
    return getattr(dtype, "name", None) or getattr(dtype, "__name__", str(dtype))


def finish_token(head: OutputHead, stack: SourceBuffer, hooks=None):
    """The output mix over the stack, the final norm and lm_head: logits [vocab]."""
    logits = head.lm_head @ output_hidden(head, stack, hooks)
    return logits if hooks is None else hooks.fire("logits", logits)


def refuse_broken(state) -> None:
    """Raise if `state` (a `KimiDecodeState` or a pipeline's) was marked part-advanced (`mark_broken`)."""
    if getattr(state, "broken", None):
        raise ValueError(f"this decode state is part-advanced and cannot be decoded on: {state.broken}. Go on from a "
                         "copy taken before that call (state.copy()), or from a new state (weights.new_state()); a "
                         "Session does this itself")


def refuse_shared(state) -> None:
    """Raise if `state` (a `KimiDecodeState` or a pipeline's) is a checkpoint, whose MLA caches it shares."""
    if getattr(state, "shared", False):
        raise ValueError("state is a checkpoint (state.checkpoint(), or a session's kept state): it shares its MLA caches "
                         "with other states, and decoding on it would write into them; decode on checkpoint.copy()")


def mark_broken(state, error: BaseException, n_tokens: int = 1) -> None:
    """Mark `state` unusable (`KimiDecodeState.broken`): `error` stopped a forward pass of `n_tokens` tokens
    that had begun to advance its layers."""
    if not state.broken:
        p = state.position
        where = f"position {p}" if n_tokens == 1 else f"positions {p}-{p + n_tokens - 1}"
        state.broken = (f"{type(error).__name__}({error}) stopped the forward pass of {where} after it had begun to "
                        "advance the layers")


def in_use(weights):
    """Hold `weights` for this thread's forward pass (`Workspace.in_use`: another thread's raises); weights
    built without a workspace hold nothing."""
    workspace = getattr(weights, "workspace", None)
    return contextlib.nullcontext() if workspace is None else workspace.in_use()


def records_mark(hooks):
    """Where the records of the hooks' recorders end now (None: nothing records), for `discard_records`."""
    mark = None if hooks is None else getattr(hooks, "records_mark", None)
    return None if mark is None else mark()


def discard_records(hooks, mark) -> None:
    """After a forward pass failed: the hooks' recorders drop what they recorded since `mark` (a partial token or
    chunk would leave their records out of step with their tokens, and the caller goes on from a state copied
    before the call, which the records must match)."""
    if mark is not None:
        hooks.discard_since(mark)


_FINAL_SITE = {"final.block_residual": "final.block_residual"}  # one table for every token (`site_table`)


def output_hidden(head: OutputHead, stack: SourceBuffer, hooks=None):
    """The output mix over the stack and the final norm: the hidden vector lm_head reads [d].

    `final.block_residual` ([n, d], the sealed blocks) fires first, on a copy: what the hooks leave
    (returned, or edited in place) are the blocks the output mix reads, their 1/rms taken again.
    (A logit lens runs this on the stack after every layer.)"""
    if hooks is None:
        return rms_norm(stack.mix(stack.weights(head.attn_res_score)), head.norm, head.eps)
    if "final.block_residual" in site_table(hooks, _FINAL_SITE):  # else the blocks and their 1/rms stand as they are
        stack.replace_blocks(hooks.fire("final.block_residual", stack.blocks.copy()))
    p = hooks.fire("final.attn_res.weights", stack.weights(head.attn_res_score))
    return hooks.fire("final.hidden", rms_norm(stack.mix(p), head.norm, head.eps))


def decoder_layer(layer, state, stack: SourceBuffer, cfg: KimiDecoderConfig,
                  hooks=None) -> None:
    """One layer on one token. The running sum h is `stack.current`, replaced by this layer's output;
    a block boundary pushes h onto the stack; `state` (this layer's attention state) advances.

    mix(p) is the stack's mix of [blocks..., h] by the softmax weights p (`SourceBuffer`). `at` holds
    the sites something listens to (`site_table`): each passes its value through the hooks there.
    """
    at, eps = site_table(hooks, layer.names), cfg.rms_norm_eps
    h = x = stack.current
    if stack.n:
        p = stack.weights(layer.attn_res_score)
        if "attn_res.attn.weights" in at:
            p = at["attn_res.attn.weights"](p)
        x = stack.mix(p)
    if layer.is_block_boundary:
        stack.seal()  # pushes the RAW input h, already the stack's current row
    x = rms_norm(x, layer.input_layernorm, eps)
    if "attn.in" in at:
        x = at["attn.in"](x)
    a = _attention(x, layer, state, hooks)
    if "attn.out" in at:
        a = at["attn.out"](a)
    stack.set_current(a if layer.is_block_boundary else h + a)  # a block boundary restarts the running sum

    p = stack.weights(layer.mlp_res_score)
    if "attn_res.ffn.weights" in at:
        p = at["attn_res.ffn.weights"](p)
    y = rms_norm(stack.mix(p), layer.post_attention_layernorm, eps)
    if "ffn.in" in at:
        y = at["ffn.in"](y)
    f = _ffn(y, layer, cfg, hooks)
    if "ffn.out" in at:
        f = at["ffn.out"](f)
    h = stack.current + f
    if "prefix_sum" in at:
        h = at["prefix_sum"](h)
    stack.set_current(h)


def _attention(x, layer, state, hooks):
    step = kda_step if layer.attention.kind == "kda" else mla_step
    return step(x, layer.attention, state.attention, hooks, layer.names)


def _ffn(y, layer, cfg: KimiDecoderConfig, hooks):
    if layer.ffn.kind == "moe":
        return latent_moe(y, layer.ffn, hooks, layer.names)
    return dense_mlp(y, layer.ffn, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)


