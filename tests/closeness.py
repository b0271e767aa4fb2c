"""Comparisons within rounding, for results of routes whose sums are ordered differently (the sequence path
against stepping): every float array within `tol` times its scale, integer arrays exactly."""

from __future__ import annotations

import numpy as np

from kimi_explore import KimiDecodeState


def assert_close(got, want, tol: float) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, atol=tol * max(1.0, np.abs(want).max(initial=0.0)), rtol=0)


def assert_states_close(a: KimiDecodeState, b: KimiDecodeState, tol: float) -> None:
    assert a.position == b.position
    for la, lb in zip(a.layers, b.layers, strict=True):
        x, y = la.attention, lb.attention
        if x.kind == "kda":
            pairs = [(x.conv, y.conv), (x.recurrent, y.recurrent)]
        else:
            assert x.length == y.length
            n = x.length
            pairs = [(x.keys[:, :n], y.keys[:, :n]), (x.values[:, :n], y.values[:, :n])]
        for u, v in pairs:
            np.testing.assert_allclose(u, v, atol=tol * max(1.0, np.abs(v).max(initial=0.0)), rtol=0)


def assert_traces_close(a, b, tol: float) -> None:
    assert sorted(a.keys()) == sorted(b.keys())
    assert list(a.tokens) == list(b.tokens) and list(a.positions) == list(b.positions) and a.meta == b.meta
    for k in a.keys():
        x, y = a[k], b[k]
        assert x.shape == y.shape and x.dtype == y.dtype, k
        if x.dtype.kind in "iu":
            if k == "logits.top_ids":  # near-ties in a top-10 may swap at float rounding: compare the top-1
                np.testing.assert_array_equal(x[:, 0], y[:, 0], err_msg=k)
            else:
                np.testing.assert_array_equal(x, y, err_msg=k)
        else:
            scale = max(1.0, np.nanmax(np.abs(y))) if y.size else 1.0
            np.testing.assert_allclose(x, y, atol=tol * scale, rtol=0, equal_nan=True, err_msg=k)
