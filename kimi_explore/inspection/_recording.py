"""Helpers of the Recorder: batched norms, top-k predictions, device -> host in one transfer, the
per-token records waiting for their batch, and the model description a Trace carries.

Everything here works on NumPy or CuPy arrays alike (through `array_namespace`). Written for few
array calls: on a tiny model each call costs more than the arithmetic it does.
"""

from __future__ import annotations

import dataclasses
import json
from typing import NamedTuple

from .._xp import array_namespace
from .topk import top_predictions

BUFFER_BYTES = 4 << 20  # reuse one scratch buffer per shape up to this size; larger inputs go array by array


class RowSquares:
    """Squared L2 norms of many arrays' rows, with few array calls and no per-call allocation.

    `of(arrays, rows_each)`: each array viewed as [rows_each, -1] -> [len(arrays), rows_each].
    The arrays are copied into a scratch buffer kept for that shape (so no temporary is allocated
    and freed every token: a fresh ~100 KB block each time costs page faults and evicts the weights
    from the cache), and each row's dot with itself is one batched matmul over precomputed views.
    Inputs larger than BUFFER_BYTES (K3's states) are reduced array by array instead.
    """

    def __init__(self):
        self._scratch: dict = {}

    def of(self, arrays: list, rows_each: int):
        a0, n = arrays[0], len(arrays)
        xp = array_namespace(a0)
        if a0.nbytes * n > BUFFER_BYTES:
            parts = []
            for a in arrays:
                x = a.reshape(rows_each, -1)
                parts.append(xp.matmul(x[:, None, :], x[:, :, None]).reshape(1, rows_each))
            return xp.concatenate(parts)
        key = (n, a0.shape, a0.dtype, rows_each, xp.__name__)
        views = self._scratch.get(key)
        if views is None:
            buf = xp.empty((n * a0.shape[0],) + a0.shape[1:], a0.dtype)
            flat = buf.reshape(n * rows_each, -1)
            views = self._scratch[key] = (buf, flat[:, None, :], flat[:, :, None])
        buf, left, right = views
        xp.concatenate(arrays, out=buf)
        return xp.matmul(left, right).reshape(n, rows_each)


def take(stash: dict) -> tuple[list, list]:
    """(keys, values) of a stash, leaving the dict itself (whose `__setitem__` the sites hold) empty."""
    keys, values = list(stash), list(stash.values())
    stash.clear()
    return keys, values


def spread(puts: list):
    """A put for a stacked [n, ...] result: row j goes to puts[j]."""

    def put_rows(arr):
        for put, row in zip(puts, arr, strict=True):
            put(row)

    return put_rows


def to_host(arrays: list) -> list:
    """Device arrays -> host NumPy arrays, with one transfer per dtype."""
    xp = array_namespace(arrays[0])
    out = [None] * len(arrays)
    by_dtype: dict = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = xp.concatenate([arrays[i].reshape(-1) for i in idx]).get()
        offset = 0
        for i in idx:
            n = arrays[i].size
            out[i] = flat[offset : offset + n].reshape(arrays[i].shape)
            offset += n
    return out


class TokenRecords(NamedTuple):
    """One finished token's records whose array work waits for the batch (`Recorder.flush`).

    Squared norms are [n, rows] for the n keys or layer prefixes beside them (None: none recorded).
    """

    moe_keys: list  # "layers.{i}.moe.{routed,shared}_out.norm"
    moe_squares: object  # [n, 1]
    state_prefixes: list  # "layers.{i}.kda."
    state_squares: object  # [n, H]
    conv_prefixes: list
    conv_squares: object  # [n, 3H]
    logits: object  # a copy of the logits [V] (the caller may write into the ones it got), or None
    fresh: tuple  # (record keys, fresh device arrays): GPU only


def emit_batch(batch: list[TokenRecords], rows: dict, emit, top_k: int) -> None:
    """The batched records of finished tokens: squared norms -> norms and logits -> top-k, computed
    for the whole batch at once, each row then handed to `emit(rows[key].append, array)`."""
    keys = {"moe": [], "state": [], "conv": []}
    squares = {"moe": [], "state": [], "conv": []}
    logits = []
    for tok in batch:
        for kind, ks, sq in (("moe", tok.moe_keys, tok.moe_squares),
                             ("state", [p + "state.norm" for p in tok.state_prefixes], tok.state_squares),
                             ("conv", [p + "conv.norm" for p in tok.conv_prefixes], tok.conv_squares)):
            if sq is not None:
                keys[kind] += ks
                squares[kind].append(sq)
        if tok.logits is not None:
            logits.append(tok.logits)
    # squared norms -> norms, one row per record: MoE outputs [n, 1] -> scalars, KDA states [n, H],
    # KDA conv windows [n, 3H] -> [n, 3 (q, k, v), H]
    for kind, shaped in (("moe", lambda x: x.reshape(-1)), ("state", lambda x: x),
                         ("conv", lambda x: x.reshape(x.shape[0], 3, -1))):
        if keys[kind]:
            sq = squares[kind]
            xp = array_namespace(sq[0])
            norms = shaped(xp.sqrt(sq[0] if len(sq) == 1 else xp.concatenate(sq)))
            emit(spread([rows[k].append for k in keys[kind]]), norms)
    if logits:
        ids, probs = top_predictions(array_namespace(logits[0]).stack(logits), top_k)
        emit(spread([rows["logits.top_ids"].append] * len(logits)), ids)
        emit(spread([rows["logits.top_probs"].append] * len(logits)), probs)
    for tok in batch:  # fresh device arrays (GPU only)
        for k, v in zip(*tok.fresh, strict=True):
            emit(rows[k].append, v)


_CONFIG_JSON: dict[str, str] = {}  # repr(config) -> its JSON (a few configs per process)


def _config_json(cfg) -> str:
    """A config as JSON, made once per config: every Session binds a recorder, and asdict's deep copy took 0.3 ms of
    each. Keyed by repr, which tells -5 from -5.0 and 1 from True (equal, and hashed alike, as dataclass fields)."""
    key = repr(cfg)
    out = _CONFIG_JSON.get(key)
    if out is None:
        if len(_CONFIG_JSON) >= 16:
            _CONFIG_JSON.clear()
        out = _CONFIG_JSON[key] = json.dumps(dataclasses.asdict(cfg), default=str)
    return out


def model_meta(weights) -> dict:
    """What plots need to label a trace without the weights (JSON-able)."""
    cfg = weights.config
    return {
        "layer_ids": [int(i) for i in weights.layer_ids],
        "attention_kinds": [spec.attention for spec in weights.specs],
        "ffn_kinds": [spec.ffn for spec in weights.specs],
        "block_boundaries": [int(spec.index) for spec in weights.specs if spec.is_block_boundary],
        "max_sources": int(weights.max_sources),
        "num_experts": int(cfg.num_experts),
        "top_k": int(cfg.num_experts_per_token),
        "kda_heads": int(cfg.linear_attn_config.num_heads),
        "mla_heads": int(cfg.num_attention_heads),
        "vocab_size": int(cfg.vocab_size),
        "hidden_size": int(cfg.hidden_size),
        "config": json.loads(_config_json(cfg)),
        "source": str(weights.source),
    }
