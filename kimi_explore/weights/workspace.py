"""The scratch of one loaded model in one plain record (llama2.c's `RunState`): `weights.workspace`.

Owned by the weights and shared by their layers, never by two models: loading a second model
(another size, another device) cannot resize or free the first one's buffers. Like the decode
state, one model is not meant to run from two threads at once: every call reuses these buffers (and a
packed bank's expert cache). `in_use()` enforces it: the forward passes hold it, so a second thread's
forward pass on the same weights raises instead of corrupting the first one's numbers.

    widening:     float32 [largest bf16-resident matrix]   `Bf16Matrix @ x` widens into it
                  (weight_dtype="bfloat16"; None otherwise)
    dequantised:  {"w13": [m, 2I, l], "w2": [m, l, I]}      the experts one call dequantises
                  (packed banks), grown to the largest m seen, valid until the next call
    threads:      host threads for dequantising and the MXFP4 kernel (`pool()`, started at first use)

Fresh multi-GB arrays would cost the kernel's page zeroing on every token; these are paid once.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..backend import HOST_THREADS
from .memory import memory_report

__all__ = ["OnePass", "Workspace", "one_thread", "run_parts", "run_rows"]


class OnePass:
    """A context manager holding a re-entrant lock without waiting: held by another thread, it raises `busy`."""

    __slots__ = ("busy", "lock")

    def __init__(self, busy: str = "these weights are running a forward pass in another thread: a model's scratch and "
                 "expert cache serve one pass at a time. Run the threads' passes one after the other, or load a copy of "
                 "the model per thread (ke.from_pretrained again)"):
        self.lock, self.busy = threading.RLock(), busy

    def __enter__(self) -> None:
        if not self.lock.acquire(blocking=False):
            raise RuntimeError(self.busy)

    def __exit__(self, *exc) -> None:
        self.lock.release()


def one_thread(method):
    """`method` run holding its object's `_one_pass` (a `OnePass`) for this thread: another thread's call meanwhile
    raises, before anything is touched (a pipeline's compiled graph, a session's state and records serve one call at
    a time)."""
    @functools.wraps(method)
    def held(self, *args, **kwargs):
        with self._one_pass:
            return method(self, *args, **kwargs)
    return held


@dataclass(repr=False)
class Workspace:
    xp: object  # the weights' array namespace
    widening: object = None  # bf16_weights.WideningScratch: float32 [largest bf16 matrix]; None without bf16 matrices
    dequantised: dict = field(default_factory=dict)  # name -> flat buffer, viewed as [m, rows, cols]
    threads: int = HOST_THREADS
    _pool: ThreadPoolExecutor | None = None
    _pool_pid: int = 0  # the process that started _pool: a forked child starts its own (the threads stay behind)
    _busy: OnePass = field(default_factory=OnePass)  # held by the thread in a forward pass

    def in_use(self) -> OnePass:
        """`with workspace.in_use():` holds these weights for one forward pass of this thread (re-entrant); another
        thread's raises. (One prebuilt guard: entered on every token, so no generator per call.)"""
        return self._busy

    def take(self, name: str, shape: tuple, dtype):
        """A [shape] view of buffer `name` (grown when too small); its contents live until the next take."""
        n = int(np.prod(shape))
        buf = self.dequantised.get(name)
        if buf is None or buf.size < n or buf.dtype != np.dtype(dtype):
            self.dequantised[name] = None  # free the old buffer before allocating the larger one
            self.dequantised[name] = buf = self.xp.empty(n, dtype)
        return buf[:n].reshape(shape)

    def pool(self) -> ThreadPoolExecutor:
        """The host thread pool of this model (its threads end when the workspace is dropped). A process forked
        from the one that started it gets a pool of its own: a fork copies the pool but not its threads, and
        work handed to the copy would wait forever."""
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="kimi-host")
            self._pool_pid = os.getpid()
        return self._pool

    @property
    def dequantised_bytes(self) -> int:
        return sum(int(b.nbytes) for b in self.dequantised.values() if b is not None)

    @property
    def widening_bytes(self) -> int:
        return 0 if self.widening is None else self.widening.nbytes

    def memory_report(self, weights):
        """Resident bytes of `weights` (the model that owns this workspace) by component (`memory.py`).

        Here, so that the model record (`KimiDecoderWeights.memory_report`) reaches it through the
        object the loader gave it, without importing from `weights/`."""
        return memory_report(weights)

    def __repr__(self) -> str:
        return (f"Workspace(widening {self.widening_bytes:,} B, dequantised {self.dequantised_bytes:,} B, "
                f"{self.threads} host threads)")


def run_parts(pool: Executor | None, fn, bounds: list[tuple[int, int]]) -> None:
    """fn(a, b) for every [a, b) in `bounds`, on `pool` (None: a pool just for this call); waits for all.

    The callers' kernels release the GIL, so the parts run in parallel.
    """
    if len(bounds) == 1:
        fn(*bounds[0])
        return
    if pool is None:
        with ThreadPoolExecutor(max_workers=len(bounds)) as own:
            run_parts(own, fn, bounds)
        return
    for f in [pool.submit(fn, a, b) for a, b in bounds]:
        f.result()


def run_rows(pool: Executor | None, fn, rows: int, threads: int, min_rows: int) -> None:
    """fn(a, b) over [0, rows) cut into at most `threads` equal parts of at least `min_rows` rows (`run_parts`)."""
    n = max(1, min(threads, rows // min_rows))
    cuts = [rows * i // n for i in range(n + 1)]
    run_parts(pool, fn, list(zip(cuts[:-1], cuts[1:], strict=True)))
