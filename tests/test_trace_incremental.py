"""The Recorder's Trace grows incrementally (`stacked_rows`): after every kind of history change it must
equal a Trace stacked afresh from the recorder's per-token lists (`Trace.from_rows`, the former path),
and a Trace handed out earlier must never change."""

from __future__ import annotations

import numpy as np
import pytest

from kimi_explore.inspection.recorder import Recorder, per_token
from kimi_explore.inspection.session import Session
from kimi_explore.inspection.stacked_rows import StackedRows
from kimi_explore.inspection.trace import Trace, stack_rows

TOKENS = [17, 203, 5, 88, 88, 141, 250, 3, 64, 199, 7, 31, 90, 12]
RAGGED = ["layers.*.mla.probs"]  # token form [nh, t + 1]; sequence path [nh, chunk end]: rows of every width


def rebuilt(rec: Recorder) -> Trace:
    """Every record stacked anew from the recorder's lists (what trace() did before it grew incrementally)."""
    d = rec.state_dict()
    n = len(d["positions"])
    rows = {k: v[:n] for k, v in per_token(d["blocks"]).items() if v}
    return Trace.from_rows(rows, d["tokens"][:n], d["positions"][:n], rec.meta)


def frozen(trace: Trace) -> Trace:
    """A deep copy, to check later that `trace` was never written."""
    return Trace({k: v.copy() for k, v in trace.items()}, trace.tokens.copy(), trace.positions.copy(), trace.meta)


def check(s: Session) -> Trace:
    got = s.trace()
    want = rebuilt(s.recorder)
    assert got.equals(want), [k for k, v in got.items() if not (k in want and np.array_equal(v, want[k], equal_nan=True))]
    assert len(got) == len(s)
    return got


@pytest.fixture(params=[(), RAGGED], ids=["default", "ragged-mla-probs"])
def full(request):
    return list(request.param)


def test_steps_and_chunked_feeds_equal_a_rebuilt_trace(ref_weights, full):
    s = Session(ref_weights, recorder=Recorder(full=full))
    kept = []
    for t in TOKENS[:3]:
        s.step(t)
        tr = check(s)
        kept.append((tr, frozen(tr)))
    s.feed(TOKENS[3:11], chunk=3)  # chunks 3..5, 6..8, 9..10
    kept.append((check(s), frozen(s.trace())))
    s.step(TOKENS[11])
    check(s)
    for tr, copy in kept:  # earlier traces are views that later tokens never write
        assert tr.equals(copy)


def test_truncate_inside_a_chunk_back_and_restep(ref_weights, full):
    s = Session(ref_weights, recorder=Recorder(full=full))
    s.feed(TOKENS[:9], chunk=4)  # chunks 0..3, 4..7, 8
    before = s.trace()
    copy = frozen(before)
    s.truncate(6)  # inside the second chunk
    check(s)
    s.step(TOKENS[12])  # a different 7th token: written into a fresh buffer, not over `before`'s rows
    s.feed(TOKENS[10:13], chunk=2)
    check(s)
    assert before.equals(copy)
    s.back(3)
    check(s)
    s.truncate(0)
    assert len(s.trace()) == 0 and s.trace().equals(rebuilt(s.recorder))
    s.feed(TOKENS[:5], chunk=2)
    check(s)
    assert before.equals(copy)


def test_fork_restore_and_load_state(ref_weights, full, tmp_path):
    s = Session(ref_weights, recorder=Recorder(full=full))
    s.feed(TOKENS[:5], chunk=2)
    s.trace()
    snap = s.snapshot()
    other = s.fork()
    assert other.trace().equals(s.trace())
    other.step(1)
    s.step(2)
    check(other), check(s)
    assert other.trace()["logits.top_ids"][-1].tolist() != s.trace()["logits.top_ids"][-1].tolist()
    s.feed(TOKENS[5:9], chunk=3)
    check(s)
    s.restore(snap)  # back to 5 tokens, records replaced by the snapshot's
    assert len(check(s)) == 5
    s.step(3)
    check(s)
    path = s.save_state(tmp_path / "s.npz")
    loaded = Session.load_state(path, ref_weights)
    assert check(loaded).equals(s.trace())
    loaded.step(4)
    check(loaded)


def test_window_is_a_view_of_the_whole_trace(ref_weights):
    s = Session(ref_weights, recorder=Recorder(full=RAGGED))
    s.feed(TOKENS[:10], chunk=4)
    whole = rebuilt(s.recorder)
    for window, (a, b) in [(slice(2, 7), (2, 7)), (slice(-3, None), (7, 10)), ((0, 4), (0, 4)), (slice(8, 50), (8, 10))]:
        w = s.trace(window=window)
        want = Trace({k: v[a:b] for k, v in whole.items()}, whole.tokens[a:b], whole.positions[a:b], whole.meta)
        assert w.equals(want) and w.start == a and len(w) == b - a
    inner = s.trace().window(2, 8).window(1, 3)
    assert inner.start == 3 and inner.positions.tolist() == [3, 4]
    with pytest.raises(ValueError, match="step 1"):
        s.trace(window=slice(0, 10, 2))
    with pytest.raises(ValueError, match="read-only"):
        s.trace()["logits.top_probs"][0, 0] = 1.0


@pytest.mark.parametrize("case", ["uniform", "ragged", "promote", "shrink-ragged", "promote-late"])
def test_stacked_rows_equal_stack_rows(case):
    rng = np.random.default_rng(0)
    if case == "uniform":
        rows = [rng.standard_normal(3).astype(np.float32) for _ in range(40)]
    elif case == "ragged":
        rows = [np.arange(k % 7 + 1, dtype=np.int64) for k in range(40)]
    elif case == "promote":
        rows = [np.ones(2, np.float32)] * 20 + [np.ones(2, np.float64)] * 5
    elif case == "promote-late":  # the float64 rows come after row 10: a truncate to 10 goes back to float32
        rows = [np.ones(2, np.float32)] * 12 + [np.ones(2, np.float64)] + [np.ones(2, np.float32)] * 20
    else:
        rows = [np.zeros((2, k + 1)) for k in range(30)]
    st = StackedRows()
    for n in (1, 2, 17, 18, len(rows)):
        assert np.array_equal(st.sync([], rows, n), stack_rows(rows[:n]), equal_nan=True)
        assert st.sync([], rows, n).dtype == stack_rows(rows[:n]).dtype
    view = st.sync([], rows, len(rows))
    old = view.copy()
    st.truncate(10)
    assert np.array_equal(st.sync([], rows, 10), stack_rows(rows[:10]), equal_nan=True)  # the width shrinks back
    assert st.sync([], rows, 10).dtype == stack_rows(rows[:10]).dtype  # ... and the dtype
    rows = rows[:10] + [r * 0 - 5 for r in rows[10:]]
    assert np.array_equal(st.sync([], rows, len(rows)), stack_rows(rows), equal_nan=True)
    assert np.array_equal(view, old, equal_nan=True)  # the earlier view kept its rows


def test_stacked_rows_after_a_truncate_to_nothing_take_the_new_rows_shape():
    """Uniform rows of width 2 (a top-2), truncated to none, then a row of width 0 (every expert ablated):
    the stacked width is the new row's, as a straight `stack_rows` gives it (found by test_session's
    random operations: the old width came back padded with -1)."""
    st = StackedRows()
    rows = [np.array([3, 1]), np.array([0, 2])]
    st.sync([], rows, 2)
    st.truncate(0)
    rows = [np.zeros(0, np.int64)]
    got = st.sync([], rows, 1)
    assert got.shape == (1, 0) and got.dtype == stack_rows(rows).dtype


@pytest.mark.parametrize("seed", range(12))
def test_stacked_rows_under_random_appends_truncates_and_reads(seed):
    """Random histories of rows (widths 0-3, 1 or 2 axes, int/float dtypes), truncates and reads: every read
    equals stack_rows of the list as it is, and every view handed out keeps its values."""
    rng = np.random.default_rng(seed)
    two_axes = bool(seed % 2)
    dtypes = [np.int64, np.float32, np.float64] if seed % 3 else [np.int64]
    rows, st, views = [], StackedRows(), []
    for _ in range(200):
        op = rng.integers(0, 10)
        if op < 6:
            width = int(rng.integers(0, 4)) if rng.random() < 0.3 else 2
            shape = (2, width) if two_axes else (width,)
            rows.append((rng.integers(-5, 5, shape)).astype(dtypes[int(rng.integers(0, len(dtypes)))]))
        elif op < 8 and rows:
            n = int(rng.integers(0, len(rows) + 1))
            del rows[n:]
            st.truncate(n)
        else:
            n = int(rng.integers(0, len(rows) + 1)) if rng.random() < 0.3 else len(rows)
            got, want = st.sync([], rows, n), stack_rows(rows[:n])
            assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True)
            if n:
                views.append((got, got.copy()))
    for view, copy in views:
        assert np.array_equal(view, copy, equal_nan=True)


def test_a_trace_window_is_a_slice_or_a_pair_never_a_bare_number(ref_weights):
    """window=5 read as 'from token 5 on' (a user may mean the last 5): refused with both spellings named."""
    import kimi_explore as ke

    s = ke.Session(ref_weights)
    s.feed(list(b"hello world"))
    assert list(s.trace(window=(2, 5)).tokens) == list(b"llo")
    assert list(s.trace(window=slice(-3, None)).tokens) == list(b"rld")
    with pytest.raises(TypeError, match=r"Session.trace: window=5: .*slice\(5, None\) for tokens 5 on, "
                                        r"slice\(-5, None\) for the last 5"):
        s.trace(window=5)
    for bad in (0, True, [1, 2], "x"):
        with pytest.raises(TypeError, match="Recorder.trace: window="):
            s.recorder.trace(window=bad)
    assert list(s.trace().window(5).tokens) == list(b" world")  # Trace.window(start, stop) keeps its numbers
