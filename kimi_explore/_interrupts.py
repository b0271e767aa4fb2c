"""Sections a Ctrl-C cannot split: `with uninterrupted():` holds a SIGINT (Jupyter's interrupt, Ctrl-C at a
terminal) that arrives inside the section and delivers it at the section's end, to the handler that was there.

For the few lines that commit a finished step to a session's lists, records and checkpoints: interrupted between
them, they disagreed (a state one token ahead of the session's tokens, a chunk's records twice), and every later
call gave wrong numbers without an error. Only the main thread receives signals: elsewhere, and where the handler
was not set from Python, it holds nothing.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["uninterrupted"]


class uninterrupted:  # noqa: N801 (used as `with uninterrupted():`, as contextlib's are)
    __slots__ = ("_before", "_held")

    def __enter__(self) -> uninterrupted:
        self._before, self._held = None, None
        if threading.current_thread() is threading.main_thread():
            before = signal.getsignal(signal.SIGINT)
            if before is not None:  # (None: a handler set outside Python, which we could not put back)
                signal.signal(signal.SIGINT, self._hold)
                self._before = before
        return self

    def _hold(self, signum, frame) -> None:
        self._held = frame if self._held is None else self._held

    def __exit__(self, *exc) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        signal.signal(signal.SIGINT, before)
        if self._held is not None:  # delivered now, as the handler would have had it
            if callable(before):
                before(signal.SIGINT, self._held)
            elif before == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)
