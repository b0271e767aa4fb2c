"""The compiled token-by-token delta rule against the float64 recurrent twin, every kernel, odd widths."""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_kda_chunk import operands, rel

from kimi_explore.model import kda_recurrence
from kimi_explore.model.kda_chunk import chunked_delta_rule, naive_recurrent_delta_rule
from kimi_explore.model.kda_recurrence import recurrent_delta_rule


@pytest.fixture(autouse=True)
def kernel():
    if not kda_recurrence.AVAILABLE:
        if os.environ.get("KIMI_EXPLORE_REQUIRE_KERNEL") == "1":
            pytest.fail("kimi_explore.model._kda_recurrence was not built, and KIMI_EXPLORE_REQUIRE_KERNEL=1")
        pytest.skip("the compiled KDA recurrence was not built (no C compiler at install)")


def isas():
    return kda_recurrence.isas() or ("portable",)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("K,V", [(8, 6), (5, 7), (32, 33), (17, 128), (3, 8), (16, 40), (9, 48)], ids=lambda d: str(d))
@pytest.mark.parametrize("gates", [(-0.5, 0.0), (-5.0, -4.999), (-5.0, 0.0)], ids=["mild", "at-the-bound", "mixed"])
def test_against_the_naive_recurrence(isa, K, V, gates):
    """Outputs, the state after the last token and the norm after every token, float32 rounding."""
    q, k, v, g, beta, S0 = operands(K * V, 40, H=3, K=K, V=V, gates=gates)
    want_o, want_S, want_n = naive_recurrent_delta_rule(q, k, v, np.exp(g), beta, S0)
    S = S0.astype(np.float32)
    o, norms = recurrent_delta_rule(q, k, v, g, beta, S, state_norms=True, isa=isa)
    assert o.dtype == norms.dtype == np.float32 and o.shape == (40, 3, V) and norms.shape == (40, 3)
    assert rel(o, want_o) < 2e-6 and rel(S, want_S) < 2e-6 and rel(norms, want_n) < 2e-6


def test_the_column_kernels_give_the_same_floats_in_every_simd_kernel():
    """With V a multiple of 8 the SIMD kernels run column-blocked (AVX2: 8 columns a vector; AVX-512: 16, where V is a
    multiple of 16, else AVX2's): per column the same operations in the same order, so outputs, state and norms are
    the same floats, bit for bit. (AVX-512 had run the compiler's vectorisation of the generic body: 1.3-1.8x
    slower.)"""
    simd = [isa for isa in isas() if isa != "portable"]
    if len(simd) < 2:
        pytest.skip(f"needs two SIMD kernels on this CPU (it has {simd})")
    for K, V in ((32, 32), (9, 48), (16, 40), (17, 128)):
        q, k, v, g, beta, S0 = operands(K + V, 25, H=2, K=K, V=V, gates=(-5.0, 0.0))
        got = []
        for isa in simd:
            S = S0.astype(np.float32)
            o, norms = recurrent_delta_rule(q, k, v, g, beta, S, state_norms=True, isa=isa)
            got.append((o, S, norms))
        for other in got[1:]:
            for a, b in zip(other, got[0], strict=True):
                np.testing.assert_array_equal(a, b)


def test_one_token_none_and_decay_zero():
    q, k, v, g, beta, S0 = operands(3, 30, H=2, K=16, V=16)
    g[10, 1, :3] = -1000.0  # a hook's decay of 0: the rows are wiped, nothing else happens
    want_o, want_S, _ = naive_recurrent_delta_rule(q, k, v, np.exp(g), beta, S0)
    S = S0.astype(np.float32)
    o, norms = recurrent_delta_rule(q, k, v, g, beta, S)
    assert norms is None and rel(o, want_o) < 2e-6 and rel(S, want_S) < 2e-6
    S1 = S0.astype(np.float32)
    o1, _ = recurrent_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], S1)
    assert rel(o1, want_o[:1]) < 2e-6
    o0, n0 = recurrent_delta_rule(q[:0], k[:0], v[:0], g[:0], beta[:0], S1, state_norms=True)
    assert o0.shape == (0, 2, 16) and n0.shape == (0, 2)


def test_agrees_with_the_chunked_form():
    q, k, v, g, beta, S0 = operands(4, 100, H=4, K=32, V=32, gates=(-5.0, 0.0))
    Sa, Sb = S0.astype(np.float32), S0.astype(np.float32)
    a, na = recurrent_delta_rule(q, k, v, g, beta, Sa, state_norms=True)
    b, nb = chunked_delta_rule(*(x.astype(np.float32) for x in (q, k, v, g, beta)), Sb, chunk=64, state_norms=True)
    assert rel(a, b) < 2e-6 and rel(Sa, Sb) < 2e-6 and rel(na, nb) < 2e-6


def test_bad_arguments_are_named():
    q, k, v, g, beta, S0 = operands(5, 4)
    with pytest.raises(ValueError, match=r"S: expected a C-contiguous float32 NumPy array \[3, 8, 6\], got float64"):
        recurrent_delta_rule(q, k, v, g, beta, S0)
    S = S0.astype(np.float32)
    with pytest.raises(ValueError, match=r"beta has shape \(4, 2\), expected \(4, 3\)"):
        recurrent_delta_rule(q, k, v, g, beta[:, :2], S)
    with pytest.raises(ValueError, match="isa: not one of isas"):
        recurrent_delta_rule(q, k, v, g, beta, S, isa="sse9")
