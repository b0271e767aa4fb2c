"""Array helpers of the Recorder: batched norms, top-k predictions, device -> host in one transfer.

Everything here works on NumPy or CuPy arrays alike (through `array_namespace`). Written for few
array calls: on a tiny model each call costs more than the arithmetic it does.
"""

from __future__ import annotations

import numpy as np

from ._xp import array_namespace

CHUNK_BYTES = 4 << 20  # concatenate at most this much at once: few calls on a tiny model, no huge temporary on K3


def sq_norms(arrays: list, rows_each: int):
    """Squared L2 norms of each array viewed as [rows_each, -1]: [len(arrays), rows_each].

    The arrays are stacked up to CHUNK_BYTES at a time and each row's dot with itself is one
    batched matmul (several times cheaper than (x * x).sum(-1) on short rows).
    """
    xp = array_namespace(arrays[0])
    if arrays[0].nbytes * len(arrays) <= CHUNK_BYTES:  # the usual case: one stacked copy
        return stacked_sq_norms(stack(arrays), rows_each)
    sq, chunk, size = [], [], 0
    for a in arrays + [None]:
        if chunk and (a is None or size + a.nbytes > CHUNK_BYTES):
            sq.append(stacked_sq_norms(stack(chunk), rows_each))
            chunk, size = [], 0
        if a is not None:
            chunk.append(a)
            size += a.nbytes
    return sq[0] if len(sq) == 1 else xp.concatenate(sq)


def stacked_sq_norms(x, rows_each: int):
    """x [n, ...] -> squared L2 norms of each x[i] viewed as [rows_each, -1]: [n, rows_each]."""
    n = x.shape[0]
    x = x.reshape(n * rows_each, -1)
    return array_namespace(x).matmul(x[:, None, :], x[:, :, None]).reshape(n, rows_each)


def stack(arrays: list):
    """A new [n, ...] array; np.array(list) is the fastest stack for many small arrays (and refuses ragged ones)."""
    xp = array_namespace(arrays[0])
    return np.array(arrays) if xp is np else xp.stack(arrays)


def stable_argsort(a, axis: int = -1):
    """NumPy needs kind="stable"; CuPy's argsort is always stable and takes no `kind`."""
    xp = array_namespace(a)
    return xp.argsort(a, axis=axis, kind="stable") if xp is np else xp.argsort(a, axis=axis)


def top_predictions(logits, k: int):
    """logits [..., V] -> (ids [..., k] by probability descending, ties by lower id; softmax probabilities [..., k]).

    A full stable sort for small vocabularies (fewest calls), a partition first for large ones.
    """
    xp, V = array_namespace(logits), logits.shape[-1]
    k = min(k, V)
    if V <= 8192:
        ids = stable_argsort(-logits)[..., :k]
    else:
        part = xp.sort(xp.argpartition(-logits, k - 1, axis=-1)[..., :k], axis=-1)
        ids = xp.take_along_axis(part, stable_argsort(-xp.take_along_axis(logits, part, axis=-1)), axis=-1)
    e = xp.exp(logits - xp.take_along_axis(logits, ids[..., :1], axis=-1))  # the top logit is the max
    return ids, xp.take_along_axis(e, ids, axis=-1) / e.sum(axis=-1, keepdims=True)


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
