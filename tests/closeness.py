"""Comparisons within rounding, for results of routes whose sums are ordered differently (the sequence path
against stepping): every float array within `tol` times its scale, integer arrays exactly."""

from __future__ import annotations

import numpy as np

from kimi_explore import KimiDecodeState


def assert_close(got, want, tol: float) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, atol=tol * max(1.0, np.abs(want).max(initial=0.0)), rtol=0)


def assert_states_close(a: KimiDecodeState, b: KimiDecodeState, tol: float, truth: KimiDecodeState | None = None,
                        factor: float = 6.0) -> None:
    """Every array of state a within `tol` times its scale of b's; with `truth` (b's route in float64), also
    allowed `factor` times b's own distance to it (a model whose weights amplify rounding layer after layer)."""
    assert a.position == b.position
    lengths = lambda s: [getattr(layer.attention, "length", None) for layer in s.layers]  # noqa: E731 (MLA caches)
    assert lengths(a) == lengths(b)
    for u, v, exact in zip(_state_arrays(a), _state_arrays(b), _state_arrays(b if truth is None else truth), strict=True):
        own = factor * np.abs(v - exact).max(initial=0.0) if truth is not None else 0.0
        np.testing.assert_allclose(u, v, atol=max(tol * max(1.0, np.abs(v).max(initial=0.0)), own), rtol=0)


def _state_arrays(state: KimiDecodeState) -> list:
    out = []
    for layer in state.layers:
        x = layer.attention
        if x.kind == "kda":
            out += [x.conv, x.recurrent]
        else:
            out += [x.keys[:, : x.length], x.values[:, : x.length]]
    return out


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
