"""Review round 8: what the eighth round of review found (each test fails on the code before it)."""

from __future__ import annotations

import numpy as np
import pytest

import kimi_explore as ke


def test_routing_stats_takes_bytes_as_ids_where_the_vocabulary_is_bytes(trained_weights):
    """Session.feed took b"def f(x):" as the byte ids of the embedded model's vocabulary; routing_stats refused it
    (one rule for both: `token_indices`, which refuses bytes only for a vocabulary that is not bytes)."""
    text = b"def f(x):\n    return x"
    a = ke.routing_stats(trained_weights, [text], progress=False)
    b = ke.routing_stats(trained_weights, [list(text)], progress=False)
    assert a.texts == b.texts
    np.testing.assert_array_equal(a.counts, b.counts)
    with pytest.raises(TypeError, match="text 0 is int"):
        ke.routing_stats(trained_weights, [7], progress=False)
