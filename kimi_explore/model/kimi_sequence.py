"""Whole texts at once: `kimi_forward_sequence(weights, state, token_ids)`, T tokens through every layer.

The sequence (prefill) form of `kimi_forward_token`: the same layers on a chunk of T tokens at a
time, layer by layer, each component in its batched form (one projection for all rows, KDA's delta
rule in chunked form, MLA's causal attention over the cache plus the chunk, the MoE with tokens
grouped by expert, the block residuals vectorised over T). It advances `state` exactly as T calls of
`kimi_forward_token` would (KDA conv windows and recurrent matrices, MLA caches), so prefill, step
and prefill again mix freely.

Exactness: the chunked sums are ordered differently from the token form, so float32 results agree
with stepping to rounding (logits to ~1e-5, routing ids identical), float64 to ~1e-12; the result
does not depend on the chunk size beyond that rounding.

Hooks on the sequence path (what a hook written for the token form gets is unchanged):
- A chunk whose hooks hold a hook added without `chunks=True` at any site it fires (a layer's, or embed,
  final.*, logits) runs token after token, each token through every layer and the output head as
  `kimi_forward_token` runs it (`_forward_tokens`): every hook is called as stepping calls it, in
  stepping's order (a value a hook keeps at one site of a token and uses at a later one sees what it
  sees stepping), so the logits and records are stepping's, bit for bit. A chunk-aware hook there gets
  single tokens too, as in the token form (`hook.positions` None, `hook.position` the token's).
- Otherwise (chunk-aware hooks only: the Recorder's recording, the built-in interventions) a hook is
  called once per chunk and site with the T tokens' values stacked, [T, ...], and `hook.positions` [T];
  sites fire layer by layer, every token of the chunk at layer i before layer i + 1.
- `kda.conv` and `kda.state` are not built per token in the chunked form (K3: 6 MB of state per token
  and layer): a chunk-aware hook there makes its layer run token by token (`decoder_layer`, exactly as
  stepping), where that layer's hooks get single tokens; the Recorder gets their per-token norms
  (`observe_chunk`).
- A pipeline (`RayPipeline.forward_sequence`) asks the same question (`takes_tokens`) and steps such a chunk
  token by token through its stages; otherwise each stage runs its share of the chunk with `embed_chunk`,
  `run_layers_chunk` and `finish_sequence`.
"""

from __future__ import annotations

import numpy as np

from ..backend import to_numpy
from . import allocator, sequence_ops, token_ops
from .block_residual import SourceBuffer
from .config import FINAL_SITES
from .kda import kda_sequence
from .kimi_token import (
    OutputHead,
    check_state,
    decoder_layer,
    discard_records,
    embed_token,
    finish_token,
    hooks_type_error,
    in_use,
    mark_broken,
    records_mark,
    run_layers,
    token_indices,
)
from .latent_moe_sequence import latent_moe_sequence
from .mla import mla_sequence
from .ops import dense_mlp_sequence, linear, rms_norm

__all__ = ["DEFAULT_CHUNK", "ROWS_PER_EXPERT", "SequenceSources", "default_chunk", "embed_chunk", "finish_sequence",
           "forward_chunk", "kimi_forward_sequence", "run_layers_chunk", "sequence_layer", "takes_tokens"]

# Tokens per chunk, chosen by measurement (CPU time, 1 BLAS thread, this project's shared 2-core VM, 2026-12-04
# night, load ~1, after MLA's scores went by query blocks):
# - the embedded model, Session.feed with the default recorder on 1,024-token texts (bench/prefill.py; medians
#   of 6 interleaved runs): chunk 256: 8,372 tokens/s, 384: 8,657, 512: 8,893; 1024: 7,039 (of 4; its
#   activations outgrow the caches). Python's fixed cost per layer and chunk is spread over the chunk.
# - K3 width, one layer with fused MXFP4 experts (bench/k3_shapes.py --chunk 1,16,64,256,512): KDA+MoE
#   203 / 62.4 / 38.0 / 35.7 / 35.0 ms/token, MLA+MoE 160 / 51.8 / 31.0 / 29.3 / 29.0: flat from 64 on,
#   where the matmuls are compute-bound.
# Larger chunks cost elsewhere: a truncate or back inside a chunk replays from the checkpoint at its start (up
# to C - 1 tokens), and the chunk's temporaries grow with C (K3: [C, 49376] floats for KDA's fused input
# projection). A GPU, with more compute per byte, may favour larger chunks (not measured: `chunk=` overrides).
DEFAULT_CHUNK = 512

# That K3-width benchmark has 32 experts a layer, so every chunk above gives each expert many rows. What an
# expert's matmul costs per row depends on its rows (few rows: decode-bound tiles), and a load-balanced
# router gives each of E experts C k / E of a chunk's C tokens: at K3's density (896 experts, top-16) a chunk
# of 512 gives each ~9. Measured (2026-12-05, load ~1; bench/k3_shapes.py --experts 224 --balanced --chunk
# 128,512,2048: routing pinned to an even spread over 224 experts, so chunk c gives each expert c 16 / 224
# rows, as K3's chunk 4c does), fused MXFP4 experts, ms/token and the ratio to the roofline (whose sgemm rate was
# then taken at 256 rows, below the peak: ~0.85x on a Xeon; the ratios against the peak are higher, the ms the same):
#   rows per expert       9.1 (K3's 512)    36.6 (K3's 2048)    146 (K3's 8192)
#   MoE half              33.3-33.7, 2.0x   25.1, 1.51x         21.2, 1.27x
#   KDA + MoE layer       45.9, 1.70x       37.8, 1.40x         33.8, 1.25x
#   MLA + MoE layer       39.8, 1.78x       32.2, 1.42x         31.5, 1.29x
# (the layers' attention halves ran at chunk c itself; KDA's is flat from 128 on: 12.2-12.7 ms).
# So a model's default chunk is DEFAULT_CHUNK, doubled until each expert gets ROWS_PER_EXPERT rows
# (`default_chunk`): the embedded model 512, K3 2048 (1.21-1.24x faster per layer than 512 at its density).
ROWS_PER_EXPERT = 32


def default_chunk(config) -> int:
    """Tokens per chunk by default for this model (`KimiDecoderConfig`): DEFAULT_CHUNK, doubled until a
    chunk gives each routed expert ROWS_PER_EXPERT rows at a balanced router's spread (C k / E)."""
    c, E, k = DEFAULT_CHUNK, config.num_experts, config.num_experts_per_token
    while E and k and c * k < ROWS_PER_EXPERT * E:
        c *= 2
    return c


class SequenceSources:
    """`SourceBuffer` for T tokens at once: rows [T, S, d] (token t's sealed blocks, then its running
    sum), their 1/rms [T, S]. The 1/rms values and the softmax are taken in float64, as the token
    form's Python floats are, then rounded once to the activation dtype. On the host in float32 both are
    the token form's compiled steps (`token_ops.set_row`, `source_softmax`), a chunk's rows in one call, and the
    scores and the mix are compiled passes over the stacks (`sequence_ops.source_scores`, `source_mix`: float32
    sums, the token form's to rounding)."""

    def __init__(self, xp, T: int, rows: int, d: int, dtype, eps: float):
        self.xp, self.eps, self.inv_d, self.dtype = xp, eps, 1.0 / d, dtype
        self.rows = xp.empty((T, rows, d), dtype)
        self.inv_rms = xp.empty((T, rows), np.float64)
        self.n = 0
        self.current = None
        self.compiled = token_ops.runs(self.rows) and rows <= token_ops.MAX_SOURCES

    def set_current(self, v) -> None:
        """v [T, d] is the running sum (column n)."""
        self.current = v
        self._set(self.n, v)

    def set_sum(self, a, b) -> None:
        """`set_current(a + b)`, the sum made in the compiled call that copies it in, 4 tokens at a time (host float32)."""
        if self.compiled and token_ops.host_float32(a, b) and a.shape == b.shape:
            self.current = token_ops.set_row_sum(self.rows, self.n, a, b, self.inv_rms, self.inv_d, self.eps)
        else:
            self.set_current(a + b)

    def _set(self, j: int, v) -> None:
        """Column j of every token's stack: v [T, d] and its 1/rms."""
        if self.compiled:
            v = token_ops.in_c_order(v)  # (a hook's replacement blocks come as slices)
            if token_ops.host_float32(v):
                token_ops.set_row(self.rows, j, v, self.inv_rms, self.inv_d, self.eps)
                return
        self.rows[:, j] = v
        self.inv_rms[:, j] = self._inv_rms(v)

    def _inv_rms(self, v):
        xp = self.xp
        sq = xp.matmul(v[:, None, :], v[:, :, None])[:, 0, 0]  # each row's v . v, as the token form's dot
        return 1.0 / xp.sqrt(sq.astype(np.float64) * self.inv_d + self.eps)

    def weights(self, score_weight):
        """[T, n+1]: each token's softmax over [sealed blocks..., current] of (V_i / rms_i) . score_weight."""
        m, xp = self.n + 1, self.xp
        s = sequence_ops.source_scores(self.rows, m, score_weight)
        if self.compiled and token_ops.host_float32(s):
            return token_ops.source_softmax(s, self.inv_rms)
        s = s.astype(np.float64) * self.inv_rms[:, :m]
        e = xp.exp(s - s.max(axis=1, keepdims=True))
        return (e / e.sum(axis=1, keepdims=True)).astype(self.dtype)

    def mix(self, p):
        """[T, d]: each token's sum_i p_i V_i over its raw sources."""
        return sequence_ops.source_mix(self.rows, p)

    def seal(self) -> None:
        self.n += 1

    @property
    def blocks(self):
        """[T, n, d] (a view)."""
        return self.rows[:, : self.n]

    def replace_blocks(self, blocks) -> None:
        """Make `blocks` [T, n, d] every token's sealed blocks (a hook's replacement)."""
        for j in range(self.n):
            self._set(j, blocks[:, j])

    def token(self, t: int) -> SourceBuffer:
        """Token t's stack as the token form holds it (what `decoder_layer` runs on)."""
        d = self.rows.shape[-1]
        buf = SourceBuffer(self.xp, self.rows.shape[1], d, self.dtype, self.eps)
        for j in range(self.n):
            buf.set_current(self.rows[t, j])
            buf.seal()
        buf.set_current(self.rows[t, self.n].copy())
        return buf

    def pack(self) -> tuple:
        """What another process needs to continue the chunk: (rows [T, n+1, d] host copy, their 1/rms, n)."""
        m = self.n + 1
        return to_numpy(self.rows[:, :m]).copy(), to_numpy(self.inv_rms[:, :m]).copy(), self.n

    @classmethod
    def unpack(cls, packed: tuple, xp, rows: int, dtype, eps: float) -> SequenceSources:
        """`pack`'s inverse with capacity `rows`."""
        values, inv, n = packed
        stack = cls(xp, values.shape[0], rows, values.shape[-1], dtype, eps)
        stack.rows[:, : n + 1] = xp.asarray(values)
        stack.inv_rms[:, : n + 1] = xp.asarray(inv)
        stack.n = n
        stack.current = stack.rows[:, n].copy()
        return stack

    def put_token(self, t: int, buf: SourceBuffer) -> None:
        """Token t's stack back from `buf` after a layer ran on it (it may have sealed one more block)."""
        m = buf.n + 1
        self.rows[t, :m] = buf.rows[:m]
        self.inv_rms[t, :m] = self.xp.asarray(buf.inv_rms[:m], dtype=np.float64)
        self.n = buf.n
        self.current = self.rows[:, self.n]


def kimi_forward_sequence(weights, state, token_ids, hooks=None,
                          chunk: int | None = None):
    """Run T tokens through every loaded layer, `chunk` tokens at a time; advance `state` in place as T
    calls of `kimi_forward_token` would; return logits [T, vocab] (row t: after token t).

    hooks: as for `kimi_forward_token`, with the chunk protocol (`begin_chunk`, `fire_chunk`,
    `needs_tokens`, `token_in_chunk`, `observe_chunk`, `end_chunk`, and optionally `listens_chunk`;
    see `inspection.hooks.Hooks`). If a hook raises (or the run is interrupted) after the state began to
    advance, `state` is left part-advanced (the chunks before taken whole, the failing one by some layers, or
    by none where it failed before them: at `begin_chunk` or `embed`) and marked so
    (`KimiDecodeState.broken`), as `kimi_forward_token` leaves it: forward passes refuse it; go on from a
    copy taken before (`Session` does). A recorder among the hooks then drops what it recorded in this call,
    the finished chunks' too: its records match that copy.
    """
    check_state(weights, state)
    if hooks is not None and not hasattr(hooks, "fire_chunk"):
        raise hooks_type_error(hooks)
    V = weights.config.vocab_size
    ids = token_indices(_checked_sequence(token_ids), V)
    chunk = default_chunk(weights.config) if chunk is None else chunk
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"kimi_forward_sequence: chunk must be a positive int (tokens per chunk), got {chunk!r}")
    chunk, xp = int(chunk), weights.xp
    if not ids:
        return xp.zeros((0, V), weights.dtype)
    mark, start = records_mark(hooks), state.position
    try:
        with in_use(weights):
            out = [forward_chunk(weights, state, ids[a : a + chunk], hooks) for a in range(0, len(ids), chunk)]
    except BaseException as e:  # (a chunk that failed inside its layers marked it already)
        if state.position != start:  # chunks before were taken: the records of none are kept, so neither is the state
            mark_broken(state, e, start + len(ids) - state.position)
        discard_records(hooks, mark)
        raise
    return out[0] if len(out) == 1 else xp.concatenate(out)


def _checked_sequence(token_ids):
    if isinstance(token_ids, str) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"token_ids must be a sequence of token ids, got {type(token_ids).__name__}")
    return token_ids


def forward_chunk(weights, state, ids: list[int], hooks=None):
    """One chunk of already-checked token ids: logits [T, vocab]; `state` advanced. The three parts
    (`embed_chunk`, `run_layers_chunk`, `finish_sequence`) are what a pipeline stage runs a share of; a chunk
    with a hook that takes single tokens runs in the token form instead (`_forward_tokens`)."""
    if hooks is not None and takes_tokens(hooks, _site_names(weights)):
        return _forward_tokens(weights, state, ids, hooks)
    p = state.position
    if hooks is not None:
        hooks.begin_chunk(ids, range(p, p + len(ids)))
    try:
        stack = embed_chunk(weights, ids, hooks)
        try:
            run_layers_chunk(weights, state, stack, hooks)
            logits = finish_sequence(weights.head(), stack, hooks)
        except BaseException as e:
            mark_broken(state, e, len(ids))
            if isinstance(e, Exception) and len(ids) > 1:  # (a message may name "token t of the chunk")
                e.add_note(f"(raised in a chunk of {len(ids)} tokens at positions {p}..{p + len(ids) - 1}: its token t "
                           f"is position {p} + t)")
            raise
    finally:
        if hooks is not None:
            hooks.end_chunk()
    state.position += len(ids)
    return logits


def _forward_tokens(weights, state, ids: list[int], hooks):
    """The chunk token after token, each as `kimi_forward_token` runs it (`embed_token`, `run_layers`, `finish_token`;
    the hooks told each token's id and position, `begin_token`): every site of a token fires before the next
    token's, as stepping fires them. `state` is left as `forward_chunk` leaves it: advanced by the whole chunk, or,
    where a failure came after the first token's layers began, marked broken for the chunk's positions."""
    head, out, begun = weights.head(), [], False
    announce, p = getattr(hooks, "begin_token", None), state.position
    try:
        for i, t in enumerate(ids):
            if announce is not None:
                announce(t, p + i)
            stack = embed_token(weights, t, hooks)
            begun = True
            run_layers(weights, state, stack, hooks)
            out.append(finish_token(head, stack, hooks))
    except BaseException as e:
        if begun:
            mark_broken(state, e, len(ids))
        raise
    state.position += len(ids)
    return weights.xp.stack(out)


def _site_names(weights) -> list[str]:
    """The names the loaded layers and the output head may fire: each layer's bound names (a superset of
    `hook_names`, which also drops the sites a layer never fires, at 12x the cost: this runs per chunk)."""
    return [n for layer in weights.layers for n in layer.names.values()] + ["embed", *FINAL_SITES]


def takes_tokens(hooks, names) -> bool:
    """Whether a hook among `hooks` takes single tokens (added without chunks=True) at one of `names`
    (`Hooks.takes_tokens`; a HookChain: any of its sets). A hooks object that cannot say: False (the chunk then runs
    as its `needs_tokens` says, layer by layer)."""
    sets = getattr(hooks, "hook_sets", None)
    if sets is not None:
        return any(takes_tokens(h, names) for h in sets)
    own = getattr(hooks, "takes_tokens", None)
    return own is not None and own(names)


def embed_chunk(weights, ids: list[int], hooks=None, rows: int | None = None) -> SequenceSources:
    """The chunk's stack to start with: no sealed block, the running sums its embeddings [T, d]."""
    cfg, xp = weights.config, weights.xp
    stack = SequenceSources(xp, len(ids), rows or weights.max_sources, cfg.hidden_size, weights.dtype, cfg.rms_norm_eps)
    h = weights.embedding()[xp.asarray(ids)]
    stack.set_current(h if hooks is None else hooks.fire_chunk("embed", h))
    return stack


def run_layers_chunk(weights, state, stack: SequenceSources, hooks=None) -> None:
    """Every loaded layer on a chunk, from the stack as the previous layer (or the embedding) left it. `state` is
    the caller's to check (`kimi_forward_sequence` does; a pipeline stage makes its own states)."""
    allocator.settle()  # (once per process: the chunk's host arrays reused, not faulted in afresh)
    for layer, layer_state in zip(weights.layers, state.layers, strict=True):
        if hooks is not None and hooks.needs_tokens(layer.names.values()):
            _layer_by_tokens(layer, layer_state, stack, weights.config, hooks)
        else:
            sequence_layer(layer, layer_state, stack, weights.config, hooks)


def _layer_by_tokens(layer, layer_state, stack: SequenceSources, cfg, hooks) -> None:
    """The token form of one layer, token after token (a per-token hook listens there)."""
    n = stack.n  # every token enters with the blocks the previous layer left (a block boundary seals one more)
    for t in range(stack.rows.shape[0]):
        stack.n = n
        hooks.token_in_chunk(t)
        buf = stack.token(t)
        decoder_layer(layer, layer_state, buf, cfg, hooks)
        stack.put_token(t, buf)


def sequence_layer(layer, state, stack: SequenceSources, cfg, hooks=None) -> None:
    """`decoder_layer` for a chunk: the same steps on [T, d] rows (see `kimi_decoder.decoder_layer`)."""
    fire, names, eps = _unhooked if hooks is None else hooks.fire_chunk, layer.names, cfg.rms_norm_eps
    h = stack.current
    x = stack.mix(fire(names["attn_res.attn.weights"], stack.weights(layer.attn_res_score))) if stack.n else h
    if layer.is_block_boundary:
        stack.seal()
    x = fire(names["attn.in"], rms_norm(x, layer.input_layernorm, eps))
    a = fire(names["attn.out"], _attention(x, layer, state, hooks))
    if layer.is_block_boundary:
        stack.set_current(a)
    else:
        stack.set_sum(h, a)

    y = stack.mix(fire(names["attn_res.ffn.weights"], stack.weights(layer.mlp_res_score)))
    y = fire(names["ffn.in"], rms_norm(y, layer.post_attention_layernorm, eps))
    f = fire(names["ffn.out"], _ffn(y, layer, cfg, hooks))
    if hooks is not None and _listens(hooks, names["prefix_sum"]):
        stack.set_current(fire(names["prefix_sum"], stack.current + f))
    else:  # (nothing sees the sum: it goes into the stack in the call that makes it)
        stack.set_sum(stack.current, f)


def finish_sequence(head: OutputHead, stack: SequenceSources, hooks=None):
    """`finish_token` for a chunk: logits [T, vocab]."""
    fire = _unhooked if hooks is None else hooks.fire_chunk
    if hooks is not None and _listens(hooks, "final.block_residual"):  # on a copy: what the hooks leave, returned or
        stack.replace_blocks(hooks.fire_chunk("final.block_residual", stack.blocks.copy()))  # edited in place, is read
    p = fire("final.attn_res.weights", stack.weights(head.attn_res_score))
    hidden = fire("final.hidden", rms_norm(stack.mix(p), head.norm, head.eps))
    return fire("logits", linear(hidden, head.lm_head))


def _unhooked(name: str, value):
    return value


def _attention(x, layer, state, hooks):
    names, att = layer.names, layer.attention
    fire = None if hooks is None else hooks.fire_chunk
    if att.kind == "mla":
        return mla_sequence(x, att, state.attention, fire=fire, names=names,
                            fire_probs=fire is not None and _listens(hooks, names["mla.probs"]))
    recorded = hooks is not None and (_listens(hooks, names["kda.state"]) or _listens(hooks, names["kda.conv"]))
    out, norms = kda_sequence(x, att, state.attention, fire=fire, names=names, state_norms=recorded,
                              fire_decay=fire is not None and _listens(hooks, names["kda.decay"]))
    if norms is not None:  # the recurrent sites reach a recorder as their per-token norms
        hooks.observe_chunk(names["kda.conv"], norms["kda.conv"])
        hooks.observe_chunk(names["kda.state"], norms["kda.state"])
    return out


def _listens(hooks, name: str) -> bool:
    """Whether firing `name` on a chunk can see or change anything (True for a hooks object that cannot say)."""
    own = getattr(hooks, "listens_chunk", None)
    return True if own is None else own(name)


def _ffn(y, layer, cfg, hooks):
    if layer.ffn.kind == "moe":
        if hooks is None:
            return latent_moe_sequence(y, layer.ffn, names=layer.names)
        return latent_moe_sequence(y, layer.ffn, fire=hooks.fire_chunk, names=layer.names, observe=hooks.observe_chunk)
    return dense_mlp_sequence(y, layer.ffn, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
