"""Review round 8: what the eighth round of review found (each test fails on the code before it)."""

from __future__ import annotations

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.inspection.interventions import override_attn_res


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


def _coarse_kl(la, lb, ids_a, ids_b) -> np.ndarray:
    """The KL of the distributions coarse-grained to (ids in both top-k sets, the rest), from the full logits in
    float64: what `diff` bounds from below with only the recorded top-k."""
    out = []
    for t in range(len(la)):
        pa, pb = (np.exp(x - x.max()) / np.exp(x - x.max()).sum() for x in (la[t], lb[t]))
        both = sorted(set(ids_a[t].tolist()) & set(ids_b[t].tolist()))
        xa, xb = (np.append(p[both], 1.0 - p[both].sum()) for p in (pa, pb))
        out.append(float(np.sum(xa * np.log(xa / xb))))
    return np.array(out)


@pytest.mark.parametrize("dtype, within", [("float64", 1e-12), ("float32", 1e-5)])
def test_diff_of_traces_is_as_exact_as_the_runs_dtype(dtype, within):
    """Traces alone (top-k recorded): the KL's slack for the recorded probabilities' rounding was float32's (1e-6) in a
    float64 run too, 2e-6 off the exact coarse-grained KL (8% of a small one). It is now sized by their dtype: a
    float64 run's KL is exact to 1e-12, and in either dtype it stays a lower bound."""
    from kimi_explore.weights.tiny_model import tiny_checkpoint

    w = ke.from_pretrained(tiny_checkpoint(), device="cpu", dtype=dtype)
    a = ke.Session(w)
    a.feed(b"def f(x):\n    return x + 1\n# the end")
    b = a.fork()
    b.truncate(10)
    with b.intervene(override_attn_res("final", weights="uniform")):
        b.feed(list(a.tokens[10:]))
    d = ke.diff(a.trace(), b.trace())
    assert not d.kl_exact
    ids_a, ids_b = a.trace().top_predictions()[0], b.trace().top_predictions()[0]
    exact = _coarse_kl(np.asarray(a.logits, np.float64), np.asarray(b.logits, np.float64), ids_a, ids_b)
    assert exact[:10].max() < 1e-12 and exact[10:].min() > 1e-6  # (the override moved every later token)
    assert np.all(d.kl <= exact + 1e-12)
    np.testing.assert_allclose(d.kl, exact, rtol=0, atol=within)
