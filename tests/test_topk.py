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
