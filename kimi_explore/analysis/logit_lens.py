"""A logit lens through K3's block attention residuals: what the model would predict if it stopped after layer i.

K3 has no single residual stream: after layer i a token's state is the block stack (the sealed
blocks b_0..b_{n_i - 1}: the RAW inputs of the block-boundary layers <= i) plus the current running
sum h_i (the `layers.{i}.prefix_sum` value). The model reads its output from them with the output
mix; the lens applies the same formula after every layer:

    V      = [b_0, ..., b_{n_i - 1}, h_i]                        sources after layer i (raw)
    p      = softmax_j((V_j / rms(V_j)) . w_out)                 w_out = output_attn_res_score: keys normalised
    logits = lm_head @ norm(sum_j p_j V_j)                        ... values raw; then the final RMSNorm

At the last layer this is exactly what `kimi_forward_token` computes (V is then the final stack and
h), so the last row of `lens_logits` is the model's logits up to float rounding of the batched lm_head product.
Blocks are pushed by the decoder's rule: a layer with `is_block_boundary` pushes its raw input
(the previous layer's h, or the embedding for layer 0) before its attention.

The values come from replaying the session's history with capture hooks at `embed` and every
`layers.{i}.prefix_sum` (see `_replay`), so values changed by `session.hooks` are what the lens
reads. Hooks on the final sites (`final.attn_res.weights`, ...) do not change the lens: it applies
the model's own output formula.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._xp import array_namespace
from ..backend import to_numpy
from ..inspection.targets import history_position, int_slice
from ..inspection.topk import top_ids
from ..model.block_residual import SourceBuffer
from ..model.kimi_decoder import OutputHead, output_hidden
from ._replay import replay
from .logprobs import log_softmax

__all__ = ["LensStrip", "LogitLens", "lens_at", "lens_logits", "logit_lens"]


@dataclass
class LogitLens:
    """Lens predictions over T tokens and L layers (the session's token t predicts token t+1).

    layers:      [L] model layer ids
    tokens:      [T] the fed token ids
    top_ids:     [T, L, top] by probability, descending
    top_probs:   [T, L, top] softmax probabilities
    final_ids:   [T] the model's own top-1 (argmax of the session's logits; -1 where they hold NaN: no top-1)
    target_ids:  [T] or None: the chosen tokens whose log-probs were asked for (-1: none)
    target_logprobs: [T, L] or None: log p_layer(target) (NaN where target_ids is -1)
    positions:   [T] the history positions of the rows (all of them unless `positions=` was given)
    """

    layers: list
    tokens: np.ndarray
    top_ids: np.ndarray
    top_probs: np.ndarray
    final_ids: np.ndarray
    target_ids: np.ndarray | None = None
    target_logprobs: np.ndarray | None = None
    positions: np.ndarray | None = None

    def agreement(self) -> np.ndarray:
        """[L]: fraction of tokens whose lens top-1 at each layer equals the model's final top-1, over the tokens that
        have one (NaN logits have none: `final_ids` -1); NaN where none has."""
        has = self.final_ids >= 0
        if not has.any():
            return np.full(self.top_ids.shape[1], np.nan)
        return (self.top_ids[has, :, 0] == self.final_ids[has, None]).mean(axis=0)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"LogitLens({len(self)} tokens x {len(self.layers)} layers, top {self.top_ids.shape[-1]})"


def lens_logits(model, head: OutputHead, values: dict):
    """One token's lens logits [L, vocab] (on the head's backend) from its `embed` and `layers.{i}.prefix_sum`
    values: the decoder's own stack (`SourceBuffer`, its push rule) and output mix (`output_hidden`)
    after every layer of `model`, then one lm_head product for all layers."""
    h = values["embed"]
    xp = array_namespace(h)
    stack = SourceBuffer(xp, model.max_sources, h.shape[-1], h.dtype, head.eps)
    stack.set_current(h)
    rows = []
    for spec in model.specs:
        if spec.is_block_boundary:
            stack.seal()  # pushes the raw input of this layer, as the decoder does
        stack.set_current(values[spec.hook_prefix + "prefix_sum"])
        rows.append(output_hidden(head, stack))
    return (head.lm_head @ xp.stack(rows).T).T


def logit_lens(session, top: int = 5, targets=None, positions=None) -> LogitLens:
    """The lens for every token of `session`'s history (or only at `positions`) and every loaded layer.

    top: predictions kept per (token, layer). targets: None; "next" (the token fed after each one;
    -1 for the last); or token ids [T] (-1 skips a token): their log-prob at every layer is returned.
    positions: history positions (negative counts from the end; or a slice of them); the lens then has one row per
    position, in increasing order, and the replay runs from the latest checkpoint at or before the
    first one to the last one (`replay(..., from_checkpoint=True)`: the Explorer asks for one token, at
    a cost that does not grow with the history).
    """
    top = _top(top, "logit_lens")
    w = session.weights
    tokens = np.asarray(session.tokens, dtype=np.int64)
    T, V = len(tokens), w.config.vocab_size
    target_ids = _targets(targets, tokens, V)
    rows = np.arange(T) if positions is None else _rows(positions, T)
    at = {int(t): r for r, t in enumerate(rows)}
    names = ["embed"] + [spec.hook_prefix + "prefix_sum" for spec in w.specs]
    k = min(top, V)
    lens_ids = np.empty((len(rows), len(w.specs), k), np.int64)
    top_probs = np.empty((len(rows), len(w.specs), k))
    target_lp = None if target_ids is None else np.full((len(rows), len(w.specs)), np.nan)
    head = w.head()  # a pipeline copies its head from its last stage
    for t, values, _ in replay(session, names, None if positions is None else rows.tolist(), from_checkpoint=True):
        r = at[t]
        logp = log_softmax(to_numpy(lens_logits(w, head, values)))  # [L, V]
        ids = top_ids(logp, k)
        lens_ids[r] = ids
        top_probs[r] = np.exp(np.take_along_axis(logp, ids, axis=-1))
        if target_ids is not None and target_ids[t] >= 0:
            target_lp[r] = logp[:, target_ids[t]]
    logits = np.asarray(session.logits)[rows]
    final_ids = np.where(np.isnan(logits).any(axis=-1), -1, np.argmax(logits, axis=-1)).astype(np.int64)
    return LogitLens(list(w.layer_ids), tokens[rows], lens_ids, top_probs, final_ids,
                     None if target_ids is None else target_ids[rows], target_lp, rows)


def _top(top, who: str) -> int:
    """`top` checked: an int >= 1 (a NumPy one too; a bool is not a count)."""
    if isinstance(top, (bool, np.bool_)) or not isinstance(top, (int, np.integer)) or top < 1:
        raise ValueError(f"{who}: top must be a positive int (predictions kept per layer), got {top!r}")
    return int(top)


def _rows(positions, T: int) -> np.ndarray:
    """The history rows asked for, in increasing order, each once."""
    if isinstance(positions, slice):  # (as the interventions take them)
        positions = range(T)[int_slice(positions, "logit_lens: positions")]
    one = isinstance(positions, (str, bytes)) or not hasattr(positions, "__iter__") or getattr(positions, "ndim", 1) == 0
    ps = [positions] if one else list(positions)  # (a set or a generator too: the rows come out sorted)
    if not ps:
        raise ValueError("logit_lens: positions is empty: give at least one token position (or None for every token)")
    return np.unique([history_position(p, T, "logit_lens: positions") for p in ps])


@dataclass
class LensStrip:
    """The lens of one token t: what the model would predict after each layer (a strip for a view).

    t, token: the position and its id; layers: [L] model layer ids
    top_ids, top_probs: [L, top] by probability, descending (column 0: the top-1 strip)
    """

    t: int
    token: int
    layers: list
    top_ids: np.ndarray
    top_probs: np.ndarray


def lens_at(session, t: int, top: int = 1) -> LensStrip:
    """The lens of token t alone, at a cost that does not grow with the history: the tokens from the
    latest kept checkpoint c <= t (`Session.checkpoint_before`) to t's forward pass are re-decoded the
    way they were decoded (`replay(..., from_checkpoint=True)`: stepped tokens stepped, a fed chunk as
    that chunk), with `session.hooks` and capture hooks at `embed` and every `layers.{i}.prefix_sum`,
    and the lens applied to token t's values: at most `checkpoint_every` stepped tokens, or one fed
    chunk. The replayed logits are checked against the stored ones, as in every replaying analysis: a
    history that no longer replays (decoded under a temporary intervention, or the weights changed
    since) raises, naming the token. Equal to `logit_lens(session)` at t (both replay exactly)."""
    T = len(session)
    t = history_position(t, T, "lens_at: t")
    top = _top(top, "lens_at")
    w = session.weights
    names = ["embed"] + [spec.hook_prefix + "prefix_sum" for spec in w.specs]
    ((_, values, _),) = replay(session, names, [t], from_checkpoint=True)
    logp = log_softmax(to_numpy(lens_logits(w, w.head(), values)))
    ids = top_ids(logp, min(top, logp.shape[-1]))
    return LensStrip(t, int(session.tokens[t]), list(w.layer_ids), ids, np.exp(np.take_along_axis(logp, ids, axis=-1)))


def _targets(targets, tokens: np.ndarray, V: int):
    if targets is None:
        return None
    if isinstance(targets, str):
        if targets != "next":
            raise ValueError(f"logit_lens: targets must be None, 'next' or token ids [T], got {targets!r}")
        return np.append(tokens[1:], -1)
    ids = np.asarray(to_numpy(targets))
    if ids.shape != tokens.shape or ids.dtype.kind not in "iu":  # (not reshaped: [2, 3] is not 6 tokens' targets)
        raise ValueError(f"logit_lens: targets must be {tokens.shape[0]} integer token ids (one per token, -1 to skip), "
                         f"got shape {ids.shape} dtype {ids.dtype}")
    bad = ids[(ids < -1) | (ids >= V)]
    if bad.size:
        raise ValueError(f"logit_lens: target ids {bad[:5].tolist()} are outside the vocabulary 0..{V - 1} (-1 skips)")
    return ids.astype(np.int64)
