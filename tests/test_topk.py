"""The top-k helper (inspection/topk.py): both routes against a full stable sort."""

import numpy as np
import pytest

from kimi_explore.inspection.topk import top_ids, top_predictions
from kimi_explore.model import sequence_ops


@pytest.mark.parametrize("V", [300, 20000], ids=["sorted", "partitioned"])
def test_top_ids_is_the_full_stable_sort(V):
    rng = np.random.default_rng(0)
    logp = rng.standard_normal((3, V))
    logp[1, 5:8] = logp[1].max() + 1.0  # ties inside the top k: lower id first
    logp[2, [250, 40, 9]] = logp[2].max() + 1.0  # the 7th place tied with the 8th and 9th: the lower ids are in
    logp[2, 100:105] = logp[2].max() + 1.0
    np.testing.assert_array_equal(top_ids(logp, 7), np.argsort(-logp, axis=-1, kind="stable")[:, :7])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_of_a_chunk_are_the_full_stable_sort_row_by_row(dtype):
    """The rows route ([T, V], V <= 8192: each row's k-th value by a partition of the values) on rows with
    ties at and inside the k-th place, repeated values everywhere, -inf, and NaN (sorted last, as the sort does)."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 40, (64, 256)).astype(dtype)  # many exact ties, some straddling the k-th place
    x[:16] = rng.standard_normal((16, 256))  # no ties
    x[20, :200] = -np.inf
    x[21, [3, 90, 200]] = np.nan  # fewer NaN than k
    x[22, :250] = np.nan  # fewer real values than k
    x[23] = 0.0
    x[23, ::3] = -0.0
    for k in (1, 7, 10, 63):
        want = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        got = top_ids(x, k)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want, err_msg=f"k={k}")
        np.testing.assert_array_equal(top_ids(x[:16], k), want[:16])  # every row exact: the fast route alone


@pytest.fixture(params=sequence_ops.isas() or ("portable",))
def isa(request, monkeypatch):
    if not sequence_ops.AVAILABLE:
        pytest.skip("the compiled sequence ops were not built")
    monkeypatch.setattr(sequence_ops, "ISA", request.param)
    return request.param


@pytest.mark.parametrize("V", [256, 3000, 163840, 9, 5])
def test_compiled_predictions_are_the_full_stable_sort_and_numpys_probabilities(isa, V):
    """`top_predictions` on host float32 rows (`sequence_ops.top_rows`, k <= 16: the k best by a bound from each
    lane's max, then in index order): ids as NumPy's stable sort of -x (ties by the lower id, also straddling the k-th place of a
    large vocabulary; -0.0 == 0.0; -inf; NaN last, by id), probabilities as the NumPy route's formula to rounding
    (NaN rows alike)."""
    rng = np.random.default_rng(V)
    x = rng.standard_normal((14, V)).astype(np.float32) * 3
    x[1, : min(20, V)] = 9.0  # a tie over the whole top
    x[2, V // 2] = np.nan
    x[3] = -np.inf
    x[4, ::2] = np.nan  # (V = 5: fewer numbers than k)
    x[5] = np.round(x[5])  # ties everywhere
    x[6, V - 1] = np.inf
    x[7] = np.nan
    x[8] = np.where(x[8] > 0, -1.0, x[8])
    x[8, [1, V - 2]] = [0.0, -0.0]
    x[9, [0, V - 1]] = 50.0
    x[10] = 1.0
    x[11, :-1] = -np.inf  # one number
    x[12] = rng.integers(0, 3, V)  # ties straddling the k-th place
    assert V <= 16 or sequence_ops.top_rows(x, 17) is None  # above TOP_ROWS_MAX_K: the NumPy route
    for k in [k for k in (1, 7, 10, 16) if k < V] + ([V] if V <= 16 else []):  # k = V: the whole row
        ids, probs = top_predictions(x, k)
        assert ids.dtype == np.int64 and probs.dtype == np.float32 and ids.shape == probs.shape == (14, k)
        np.testing.assert_array_equal(ids, np.argsort(-x, axis=-1, kind="stable")[:, :k], err_msg=f"k={k}")
        with np.errstate(invalid="ignore"):
            e = np.exp(x.astype(np.float64) - np.take_along_axis(x, ids[:, :1], axis=-1))
            want = np.take_along_axis(e, ids, axis=-1) / e.sum(axis=-1, keepdims=True)
        assert (np.isnan(probs) == np.isnan(want)).all()
        finite = ~np.isnan(want)
        assert np.abs(probs[finite] - want[finite]).max() <= 1e-6
