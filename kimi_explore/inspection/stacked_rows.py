"""One record's per-token rows kept stacked as they arrive, so a Trace costs the same at any history length.

The Recorder appends each token's small host arrays to a plain list (one C-level call at the site).
`Recorder.trace()` used to `np.stack` every list each time it was asked: O(tokens x records), 270 ms
at 300 tokens on a 93-layer model. `StackedRows` keeps the rows already seen in one array grown by
doubling and copies in only the rows that arrived since the last call, so a trace after a Step
costs O(records):

    st = StackedRows()
    st.sync([], rows, n)          # -> read-only view [n, ...] of the first n rows, equal to stack_rows(rows[:n])
    st.sync([b1, b2], rows, n)    # the rows are [*b1, *b2] + rows: blocks [m, ...] (a fed chunk's, stepped rows
                                  # sealed) are copied a block at a time
    st.truncate(n)                # the records lost their rows after n (Recorder.truncate)

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

__all__ = ["StackedRows", "row_blocks"]


def row_blocks(rows: list) -> list:
    """Per-token rows -> blocks [m, ...] holding them in order: one stacked array where they share shape and dtype,
    else one-row views."""
    if len(rows) > 1 and len({(np.shape(r), np.asarray(r).dtype) for r in rows}) == 1:
        return [np.array(rows)]
    return [np.asarray(r)[None] for r in rows]


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

    def sync(self, blocks, rows: list, n: int, name: str = "") -> np.ndarray:
        """Read-only [n, ...] view of stack_rows(all[:n]), after copying in rows self.n .. n-1, where `all` is the
        rows of each of `blocks` (arrays [m, ...]: m rows each) followed by `rows`."""
        if n == 0:
            return stack_rows([], name)
        if n < self.n:
            self.truncate(n)  # the records shrank behind our back
        if n > self.n:
            new, at = [], 0  # at: index of the block's first row
            for b in blocks:
                if at >= n:
                    break
                lo, hi = max(self.n, at), min(n, at + len(b))
                if lo < hi:
                    new.append(b[lo - at : hi - at])
                at += len(b)
            lo, hi = max(self.n, at), min(n, at + len(rows))
            new += row_blocks(rows[lo - at : hi - at] if lo < hi else [])  # (`_append` pads rows of other shapes)
            if new:
                if self.buf is None:
                    self._start(new[0], n)
                if not self._append(new):
                    self._rebuild(_first_rows(blocks, rows, n), n, name)
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

    def _start(self, block, n: int) -> None:
        self.shape, self.ragged, self.mixed = block.shape[1:], False, False
        self.buf = self._alloc(max(16, 2 * n), self.shape, block.dtype)
        self.n, self.shared = 0, False

    @staticmethod
    def _alloc(capacity: int, room: tuple, dtype) -> np.ndarray:
        return np.full((capacity,) + tuple(room), _fill(np.dtype(dtype)), dtype=dtype)

    def _append(self, new: list) -> bool:
        """Copy `new` blocks of rows ([m, ...] each) in after row n; False when the record must be rebuilt
        (dtype or axes change)."""
        buf = self.buf
        nd = buf.ndim
        shape = list(self.shape)
        for b in new:
            if b.ndim != nd or np.result_type(buf.dtype, b.dtype) != buf.dtype:
                return False
            if b.dtype != buf.dtype:
                self.mixed = True
            if b.shape[1:] != self.shape:
                self.ragged = True
                shape = [max(x, y) for x, y in zip(shape, b.shape[1:], strict=True)]
        end = self.n + sum(len(b) for b in new)
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
        buf, t = self.buf, self.n
        for b in new:
            buf[(slice(t, t + len(b)),) + tuple(slice(0, s) for s in b.shape[1:])] = b
            t += len(b)
        self.n, self.shape = end, tuple(shape)
        return True


def _first_rows(blocks, rows: list, n: int) -> list:
    """The first n rows of the blocks' rows followed by `rows`, as one list (a rebuild: rare)."""
    out = []
    for b in blocks:
        if len(out) >= n:
            break
        out.extend(b)
    return (out + rows[: max(n - len(out), 0)])[:n]
