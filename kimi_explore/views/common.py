"""Helpers both rooms of `views/` share: token labels, tick strides, index checks, host copies of the
routing and of the routers' selection bias. No matplotlib and no plotly here: `figures/` (static
matplotlib) and `explorer/` (plotly.js widgets) each import this, never each other.
"""

from __future__ import annotations

import numpy as np

from ..backend import to_numpy

MISSING = "#dddddd"  # a cell with no value (a block not sealed yet, ...): one grey in every view
MAX_TICKS = 40  # labels per axis before thinning; ~40 stays readable at 100 dpi
_NICE_STRIDES = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128, 200, 250, 500, 1000, 2000, 5000)


def trace_of(session_or_trace, tokenizer=None):
    """(trace, tokenizer) of a `Session` (its trace; its tokenizer where none is given) or of a `Trace` (as given)."""
    if hasattr(session_or_trace, "step") and callable(getattr(session_or_trace, "trace", None)):
        return session_or_trace.trace(), tokenizer if tokenizer is not None else session_or_trace.tokenizer
    return session_or_trace, tokenizer


def token_labels(ids, tokenizer=None, positions: bool = True, start: int = 0) -> list[str]:
    """Readable labels for token ids: `tokenizer.token_label(id)` when given, the id otherwise.

    positions=True prefixes the position in the sequence ("3 'a'", "3 #97"): repeated tokens stay apart;
    `start` is the history position of ids[0] (a window of the history).
    """
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if tokenizer is not None:  # quoted: a space must stay visible; -1 = an id the trace was not told
        names = [f"'{tokenizer.token_label(i)}'" if i >= 0 else "?" for i in ids]
    else:
        names = [f"#{i}" if i >= 0 else "?" for i in ids]
    return [f"{p} {n}" for p, n in enumerate(names, start)] if positions else names


def trace_labels(trace, tokenizer=None, positions: bool = True) -> list[str]:
    """`token_labels` of a trace's tokens; a window (`Trace.window`) keeps its history positions."""
    return token_labels(trace.tokens, tokenizer, positions, start=getattr(trace, "start", 0))


def layer_labels(trace, layers=None) -> list[str]:
    """'12 MLA' / '13 KDA' for each layer id (default: every layer of the trace). The kinds are the model's
    (`trace.kda_layers`, from the config the trace carries), not what was recorded: a recorder that
    left a KDA layer out does not make it an MLA layer."""
    kda = {int(i) for i in trace.kda_layers}
    return [f"{i} {'KDA' if i in kda else 'MLA'}" for i in (trace.layer_ids if layers is None else layers)]


def why_no_mix(trace, layer: int, site: int) -> str:
    """Why layer `layer` has no block-residual weight at all at `site` (0: before attention, 1: before the
    FFN). The model mixes before the FFN at every layer, and before attention once a block is sealed before
    the layer (`trace.meta["block_boundaries"]`): a mix the model has and the trace has not, the recorder
    left out."""
    bounds = trace.meta.get("block_boundaries")
    if site == 0 and (bounds is None or not any(b < layer for b in bounds)):
        return f"layer {layer} has no mix before attention: its block stack is still empty"
    name = f"layers.{layer}.attn_res.{('attn', 'ffn')[site]}.weights"
    return f"layer {layer}: {name} was not recorded (the Recorder's names_filter left it out)"


def token_texts(ids, tokenizer=None) -> list[str]:
    """Each token's text alone, unquoted (a narrow cell's label): `tokenizer.token_label(id)`, '#id' without a
    tokenizer, '?' for -1. Stripping the quotes off `token_labels` would eat a token's own quotes (' or 's)."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if tokenizer is None:
        return [f"#{i}" if i >= 0 else "?" for i in ids]
    return [tokenizer.token_label(i) if i >= 0 else "?" for i in ids]


def nice_stride(n: int, max_ticks: int = MAX_TICKS) -> int:
    """The smallest stride from 1, 2, 4, 5, 8, 10, 16, ... that leaves at most `max_ticks` labels."""
    need = -(-n // max_ticks)
    return next((s for s in _NICE_STRIDES if s >= need), need)


def token_index(trace, token: int) -> int:
    """A token row of the trace (negative counts from the end), checked. A row, not a history position: row 0
    of a window (`Trace.window(12, 22)`) is position 12, and the error names both."""
    return row_index(len(trace.tokens), token, "trace", getattr(trace, "start", 0))


def row_index(n: int, token: int, what: str = "trace", start: int = 0) -> int:
    """`token` as a row 0..n-1 of something holding n tokens (negative counts from the end), checked;
    start: the history position of row 0 (named in the error where it is not 0)."""
    if n == 0:
        raise ValueError(f"the {what} is empty: step at least one token before plotting")
    if not -n <= int(token) < n:
        at = f"; its rows are history positions {start}..{start + n - 1}: `token` is a row" if start else ""
        raise IndexError(f"token={token} is outside the {what}: it holds {n} tokens (0..{n - 1}, or -{n}..-1){at}")
    return int(token) % n


def layer_position(trace, layer: int) -> int:
    """The row of model layer `layer` (0-based id in the full model) in the trace's layer axis."""
    ids = [int(i) for i in trace.layer_ids]
    if int(layer) not in ids:
        raise ValueError(f"layer {layer} is not in this trace; its layers are {ids}")
    return ids.index(int(layer))


def routing(trace) -> dict:
    """`trace.routing()` with host arrays and `moe_layers` as a list of ints; refuses a trace without MoE."""
    r = dict(trace.routing())
    r["moe_layers"] = [int(i) for i in r["moe_layers"]]
    if not r["moe_layers"]:
        raise ValueError("this trace has no MoE layers (trace.routing()['moe_layers'] is empty)")
    for key in ("topk_ids", "topk_weights", "scores"):
        r[key] = np.asarray(r[key])
    return r


def moe_layer_labels(r: dict) -> list[str]:
    return [str(i) for i in r["moe_layers"]]


def softmax(logits) -> np.ndarray:
    """float64 softmax of a host or device [vocab] vector."""
    x = np.asarray(to_numpy(logits), dtype=np.float64).reshape(-1)
    e = np.exp(x - x.max())
    return e / e.sum()


def no_predictions(top_probs) -> bool:
    """Whether a token's recorded top-k probabilities say its logits hold NaN (all NaN): its top ids are then the
    top-k's tie order, not predictions, and the views show none."""
    return bool(np.isnan(np.asarray(top_probs, dtype=float)).all())


def bias_vectors(weights) -> dict[int, np.ndarray]:
    """{MoE layer id: selection bias [E]} on the host, read from the loaded router weights ({} for a RayPipeline:
    its routers live in its stages)."""
    out = {}
    for layer in getattr(weights, "layers", ()):
        b = getattr(layer.ffn, "e_score_correction_bias", None)
        if b is not None:
            out[int(layer.index)] = np.asarray(to_numpy(b), dtype=np.float64)
    return out
