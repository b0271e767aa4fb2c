"""Top-k of scores with a deterministic order: descending, ties by the lower id (the Recorder's
predictions, the logit lens). Works on NumPy or CuPy arrays alike."""

from __future__ import annotations

import numpy as np

from .._xp import array_namespace
from ..backend import on_host
from ..model import sequence_ops

__all__ = ["stable_argsort", "top_ids", "top_predictions"]


def stable_argsort(a, axis: int = -1):
    """NumPy needs kind="stable"; CuPy's argsort is always stable and takes no `kind`."""
    xp = array_namespace(a)
    return xp.argsort(a, axis=axis, kind="stable") if on_host(xp) else xp.argsort(a, axis=axis)


def top_ids(scores, k: int):
    """scores [..., V] -> the k largest ids [..., k], descending, ties by lower id.

    A full stable sort for small vocabularies (fewest calls; rows of them: a partition of the values
    first, the same ids, ties included); a partition first for large ones (K3's 163840: a full sort would
    cost more than everything else), a row whose k-th place is tied with an id left out sorted whole, so
    the ids are the same on every route (the host's compiled `top_rows` included) and on a GPU."""
    xp, V = array_namespace(scores), scores.shape[-1]
    k = min(k, V)
    if V <= 8192 and (scores.ndim != 2 or V <= 4 * k):
        return stable_argsort(-scores)[..., :k]
    if V <= 8192:  # rows (a chunk's logits): each row's k-th largest value by a partition of the values (a
        # fifth of the time of partitioning the ids); where exactly k scores reach it, those ids (ascending)
        # are the top k, put in order by a stable sort of k values. A row where more (a tie at the k-th
        # place) or fewer (NaN) reach it is sorted whole.
        kth = xp.partition(scores, V - k, axis=-1)[:, V - k, None]
        above = scores >= kth
        exact = above.sum(axis=-1) == k
        rows = xp.flatnonzero(~exact)
        keep = xp.flatnonzero(exact) if rows.size else slice(None)
        top = (xp.flatnonzero(above[keep]) % V).reshape(-1, k)  # the columns (a 2-D nonzero is ~3x slower)
        ids = xp.take_along_axis(top, stable_argsort(-xp.take_along_axis(scores[keep], top, axis=-1)), axis=-1)
        if rows.size:
            whole = xp.empty((scores.shape[0], k), dtype=ids.dtype)
            whole[keep], whole[rows] = ids, stable_argsort(-scores[rows])[:, :k]
            ids = whole
        return ids
    rows = scores.reshape(-1, V)
    part = xp.argpartition(-rows, k - 1, axis=-1)[:, :k]
    kth = xp.take_along_axis(rows, part, axis=-1).min(axis=-1, keepdims=True)
    part = xp.sort(part, axis=-1)  # ids ascending: the stable sort below breaks ties by the lower id
    ids = xp.take_along_axis(part, stable_argsort(-xp.take_along_axis(rows, part, axis=-1)), axis=-1)
    tied = xp.flatnonzero((rows >= kth).sum(axis=-1) != k)  # a tie across the k-th place (or a NaN): the
    if tied.size:  # partition chose among the tied ids by its own order (NumPy's and CuPy's differ): sorted whole
        ids[tied] = stable_argsort(-rows[tied])[:, :k]
    return ids.reshape(scores.shape[:-1] + (k,))


def top_predictions(logits, k: int):
    """logits [..., V] -> (top_ids, their softmax probabilities [..., k]). Host float32 rows take one compiled pass
    (`sequence_ops.top_rows`: the same order, also where ties straddle the k-th place of a large vocabulary; the
    probabilities to float32 rounding)."""
    rows = sequence_ops.top_rows(logits, min(k, logits.shape[-1])) if logits.ndim == 2 else None
    if rows is not None:
        return rows
    xp = array_namespace(logits)
    ids = top_ids(logits, k)
    with np.errstate(invalid="ignore"):  # logits all -inf (a hook masked every id): NaN probabilities, as softmax's
        e = xp.exp(logits - xp.take_along_axis(logits, ids[..., :1], axis=-1))  # the top logit is the max
    return ids, xp.take_along_axis(e, ids, axis=-1) / e.sum(axis=-1, keepdims=True)
