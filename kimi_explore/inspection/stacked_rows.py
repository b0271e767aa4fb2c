"""One record's per-token rows kept stacked as they arrive, so a Trace costs the same at any history length.

The Recorder appends each token's small host arrays to a plain list (one C-level call at the site).
`Recorder.trace()` used to `np.stack` every list each time it was asked: O(tokens x records), 270 ms
at 300 tokens on a 93-layer model. `StackedRows` keeps the rows already seen in one array grown by
doubling and copies in only the rows that arrived since the last call, so a trace after a Step
costs O(records):

    st = StackedRows()
    st.sync(rows, n)      # -> read-only view [n, ...] of the first n rows, equal to stack_rows(rows[:n])
    st.truncate(n)        # the list lost its rows after n (Recorder.truncate)

Equal to `trace.stack_rows` exactly, padding included: rows of varying shape ("ragged": an MLA probs
row grows with the position, a top-k shortened by an ablation) are padded at the end with NaN / -1 /
False. The buffer is allocated filled with that value, its trailing axes with room to grow, and each
row is written once into its own slot, so the region a row does not cover stays padding.

Views handed out are never written again: rows are only added after the ones a view covers, and
after a truncate the next added row goes into a fresh buffer (copy on write), because an older Trace
may still show the dropped rows. A row whose dtype would change the stacked dtype, a shape with another
number of axes, or a truncate of a ragged or mixed-dtype record (whose padded width or dtype may
shrink back) rebuilds the record from its list with `stack_rows`: rare, and exact.
"""

from __future__ import annotations

import numpy as np

from .trace import stack_rows

__all__ = ["StackedRows"]


def _fill(dtype) -> object:
    return np.nan if dtype.kind in "fc" else (False if dtype.kind == "b" else -1)


class StackedRows:
    """The first `n` rows of a record's list, stacked in a buffer with room to grow (see module docstring)."""

    __slots__ = ("buf", "n", "shape", "ragged", "mixed", "shared")

    def __init__(self):
        self.buf = None  # [capacity, *room] filled with the padding value where no row was written
        self.n = 0  # rows of the list already in buf
        self.shape: tuple = ()  # the stacked trailing shape: the largest row shape so far, per axis
        self.ragged = False  # rows have had different shapes
        self.mixed = False  # rows have had different dtypes (the stacked dtype is their result type)
        self.shared = False  # rows past n may still be seen by an older view: write into a copy

    def truncate(self, n: int) -> None:
        if n < self.n:
            self.n = n
            self.shared = True
            if self.ragged or self.mixed or n == 0:  # width and dtype come from the rows kept (none: unknown): recompute
                self.buf = None
                self.n = 0

    def sync(self, rows: list, n: int, name: str = "") -> np.ndarray:
        """Read-only [n, ...] view of stack_rows(rows[:n]), after copying in rows self.n .. n-1."""
        if n == 0:
            return stack_rows([], name)
        if n < self.n:
            self.truncate(n)  # the list shrank behind our back
        if self.buf is None:
            self._rebuild(rows, n, name)
        elif n > self.n:
            new = rows[self.n : n]
            if not self._append(new):
                self._rebuild(rows, n, name)
        view = self.buf[(slice(0, self.n),) + tuple(slice(0, s) for s in self.shape)]
        view.flags.writeable = False
        return view

    def _rebuild(self, rows: list, n: int, name: str) -> None:
        full = stack_rows(rows[:n], name)
        self.shape = full.shape[1:]
        self.ragged = len({r.shape for r in rows[:n]}) > 1
        self.mixed = len({r.dtype for r in rows[:n]}) > 1
        self.buf = self._alloc(max(16, 2 * n), full.shape[1:], full.dtype)
        self.buf[(slice(0, n),) + tuple(slice(0, s) for s in self.shape)] = full
        self.n, self.shared = n, False

    @staticmethod
    def _alloc(capacity: int, room: tuple, dtype) -> np.ndarray:
        return np.full((capacity,) + tuple(room), _fill(np.dtype(dtype)), dtype=dtype)

    def _append(self, new: list) -> bool:
        """Copy `new` rows in after row n; False when the record must be rebuilt (dtype or axes change)."""
        buf = self.buf
        nd = buf.ndim - 1
        shape = list(self.shape)
        for r in new:
            if r.ndim != nd or np.result_type(buf.dtype, r.dtype) != buf.dtype:
                return False
            if r.dtype != buf.dtype:
                self.mixed = True
            if r.shape != self.shape:
                self.ragged = True
                shape = [max(a, b) for a, b in zip(shape, r.shape, strict=True)]
        end = self.n + len(new)
        room = buf.shape[1:]
        grow = any(s > c for s, c in zip(shape, room, strict=True))
        if end > buf.shape[0] or grow or self.shared:
            cap = max(buf.shape[0], 16)
            while cap < end:
                cap *= 2
            room = tuple(c if s <= c else max(s, 2 * c) for s, c in zip(shape, room, strict=True))
            fresh = self._alloc(cap, room, buf.dtype)
            keep = (slice(0, self.n),) + tuple(slice(0, s) for s in self.shape)
            fresh[keep] = buf[keep]
            self.buf, self.shared = fresh, False
        buf = self.buf
        for t, r in enumerate(new, start=self.n):
            buf[(t,) + tuple(slice(0, s) for s in r.shape)] = r
        self.n, self.shape = end, tuple(shape)
        return True
