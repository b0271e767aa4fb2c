"""The top-k helper (inspection/topk.py): both routes against a full stable sort."""

import numpy as np
import pytest

from kimi_explore.inspection.topk import top_ids


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
