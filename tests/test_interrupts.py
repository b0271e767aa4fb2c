"""A Ctrl-C (KeyboardInterrupt) landing in the lines that commit a finished step, chunk, cut or restore, and a
second thread's call on a session: each used to leave the session's lists, state and records disagreeing, and
later calls gave wrong numbers without an error. Each SIGINT here is sent at a chosen line by a trace function (at
random moments it lands there too rarely to test)."""

from __future__ import annotations

import linecache
import os
import signal
import sys
import threading

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore._interrupts import uninterrupted


@pytest.fixture(scope="module")
def w():
    return ke.from_pretrained(ke.tiny_checkpoint(), device="cpu", progress=False)


class interrupt_at:  # noqa: N801
    """Within the block, a SIGINT (Ctrl-C) at the k-th execution of the line of function `func` (in kimi_explore)
    that starts with `text`; `hit` says whether it was sent."""

    def __init__(self, func: str, text: str, k: int = 1):
        self.func, self.text, self.k, self.hit = func, text, k, False

    def _local(self, frame, event, arg):
        if event == "line" and frame.f_code.co_name == self.func:
            if linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip().startswith(self.text):
                self.k -= 1
                if self.k == 0:
                    self.hit = True
                    os.kill(os.getpid(), signal.SIGINT)  # (Python runs its handler at the next instruction)
        return self._local

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_name == self.func and "kimi_explore" in frame.f_code.co_filename else None

    def __enter__(self):
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        return False


def interrupted(fn, *where) -> interrupt_at:
    at = interrupt_at(*where)
    try:
        with at:
            fn()
    except KeyboardInterrupt:
        pass
    return at


def same_as(s, ref):
    """s continues as `ref`, the same calls made without the interrupt: the same history, records and next step."""
    assert s.tokens == ref.tokens and s.state.position == len(ref)
    assert len(s.trace()) == len(ref)
    np.testing.assert_array_equal(s.step(9), ref.step(9))
    np.testing.assert_array_equal(s.logits, ref.logits)
    assert s.trace().equals(ref.trace())


def fed(w, *feeds, chunk=7):
    s = ke.Session(w)
    for ids in feeds:
        s.feed(ids, chunk=chunk, progress=False)
    return s


def test_a_sigint_inside_an_uninterrupted_section_comes_at_its_end():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with uninterrupted():
            os.kill(os.getpid(), signal.SIGINT)
            done.append(1)
    assert done == [1] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_between_a_steps_pass_and_its_bookkeeping_leaves_the_history_whole(w):
    """The state (and records) were one token ahead of the session's tokens: every later step was wrong (3.7 off)."""
    s = ke.Session(w)
    s.feed([1, 2, 3, 4], progress=False)
    at = interrupted(lambda: s.step(5), "_step", "self._tokens.append")
    assert at.hit
    ref = fed(w, [1, 2, 3, 4])
    ref.step(5)
    same_as(s, ref)  # the step had finished: it is kept, then the interrupt comes


def test_ctrl_c_between_a_chunks_pass_and_its_bookkeeping_leaves_the_history_whole(w):
    """12 tokens, 8 logit rows, the state at 12: a later truncate raised IndexError, fork and save_state took it."""
    s = ke.Session(w)
    s.feed(list(range(8)), chunk=7, progress=False)
    at = interrupted(lambda: s.feed(list(range(10, 18)), chunk=4, progress=False), "_feed_chunk", "self._logits +=")
    assert at.hit
    ref = fed(w, list(range(8)))
    ref.feed(list(range(10, 14)), chunk=4, progress=False)
    same_as(s, ref)


def test_ctrl_c_while_stepped_records_are_sealed_keeps_them_once(w):
    """A fork (or the next feed) seals the stepped tokens' records into blocks; interrupted before their rows were
    cleared, the session would keep them twice, and its trace show another token's top ids."""
    s = ke.Session(w)
    s.feed(list(range(20)), chunk=7, progress=False)
    for t in range(20, 23):
        s.step(t)
    at = interrupted(s.fork, "_seal_rows", "rows.clear()")
    assert at.hit
    ref = fed(w, list(range(20)))
    for t in range(20, 23):
        ref.step(t)
    same_as(s, ref)


@pytest.mark.parametrize("fn, line, k", [("cut_for_session", "self._cut_records(n)", 1), ("_cut_records", "del rows[", 5)])
def test_ctrl_c_inside_a_cut_leaves_it_whole_or_undone(w, fn, line, k):
    """The session's lists were cut before the recorder: 21 tokens against 41 trace rows, a file load refused."""
    s = fed(w, list(range(40)), chunk=8)
    at = interrupted(lambda: s.back(20), fn, line, k)
    assert at.hit
    ref = fed(w, list(range(40)), chunk=8)
    ref.back(20)
    same_as(s, ref)


def test_ctrl_c_inside_a_restore_leaves_it_whole(w):
    s = ke.Session(w)
    s.feed(list(range(30)), chunk=7, progress=False)
    snap = s.snapshot()
    s.back(10)
    at = interrupted(lambda: s.restore(snap), "load_state_dict", "", 3)
    assert at.hit
    same_as(s, fed(w, list(range(30))))


def test_a_second_threads_step_is_refused_before_it_touches_the_session(w):
    """The weights refused the second pass, but the session then 'recovered' its state under the first thread: 5
    tokens, the state at position 4, and a wrong next step."""
    s = ke.Session(w, recorder=False)
    s.feed([1, 2, 3, 4], progress=False)
    inside, go = threading.Event(), threading.Event()

    def slow(v, *, hook):
        if threading.current_thread().name == "A" and not inside.is_set():
            inside.set()
            go.wait(30)

    s.hooks.add("layers.7.attn.in", slow)
    a = threading.Thread(target=lambda: s.step(5), name="A")
    a.start()
    try:
        assert inside.wait(30)
        for call in (lambda: s.step(6), lambda: s.feed([6, 7], progress=False), lambda: s.back(1)):
            with pytest.raises(RuntimeError, match="this Session is decoding in another thread"):
                call()
    finally:
        go.set()
        a.join()
    ref = ke.Session(w, recorder=False)
    ref.feed([1, 2, 3, 4], progress=False)
    ref.step(5)
    assert s.tokens == [1, 2, 3, 4, 5] and s.state.position == 5
    np.testing.assert_array_equal(s.step(7), ref.step(7))


@pytest.mark.parametrize("how", ["step", "feed"])
def test_a_checkpoint_that_fails_leaves_the_history_before_the_call(w, monkeypatch, how):
    """An error taking the checkpoint at a token's or chunk's end (out of memory; a pipeline's lost stage) rolled the
    state and records back but kept the new tokens: the next step 6.8 off. It is now part of the pass that failed."""
    s = ke.Session(w, checkpoint_every=4)
    s.feed([1, 2, 3], progress=False)

    def fail(self):
        raise MemoryError("no room")

    monkeypatch.setattr(ke.KimiDecodeState, "checkpoint", fail)
    with pytest.raises(MemoryError):
        s.step(4) if how == "step" else s.feed([4, 5, 6], progress=False)
    monkeypatch.undo()
    same_as(s, fed(w, [1, 2, 3]))


def test_ctrl_c_inside_load_state_leaves_the_recorder_and_hooks_free(w, tmp_path):
    """load_state(..., recorder=rec, hooks=h) interrupted after the session was built kept both bound to it while the
    traceback lived (Jupyter keeps the last one): the retry was refused ("already serves another Session")."""
    path = fed(w, list(range(30))).save_state(tmp_path / "s.npz")
    rec, hooks = ke.Recorder(), ke.Hooks()
    at = interrupted(lambda: ke.Session.load_state(path, w, recorder=rec, hooks=hooks), "_take", "if self.recorder")
    assert at.hit
    assert rec.n_tokens == 0
    s = ke.Session.load_state(path, w, recorder=rec, hooks=hooks)
    same_as(s, fed(w, list(range(30))))
