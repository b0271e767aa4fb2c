"""The compiled bf16 matvec (weight_dtype="bfloat16" on the CPU), against float64."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.weights import bf16_matvec
from kimi_explore.weights.bf16_matvec import bf16_matvec as matvec
from kimi_explore.weights.bf16_weights import Bf16Matrix, WideningScratch
from kimi_explore.weights.tiny_model import random_tiny_checkpoint


@pytest.fixture(autouse=True)
def kernel():
    if not bf16_matvec.AVAILABLE:
        if os.environ.get("KIMI_EXPLORE_REQUIRE_KERNEL") == "1":
            pytest.fail("kimi_explore.weights._bf16_matvec was not built, and KIMI_EXPLORE_REQUIRE_KERNEL=1")
        pytest.skip("the compiled bf16 kernel was not built (no C compiler at install)")


def isas():
    return bf16_matvec.isas() or ("portable",)


def matrix(rng, R, C):
    W = (rng.standard_normal((R, C)) * rng.uniform(0.1, 10, (R, 1))).astype(ml_dtypes.bfloat16)
    return W.view(np.uint16), W.astype(np.float64)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("C", [1, 7, 15, 16, 17, 63, 64, 65, 129, 1001], ids=lambda c: f"C{c}")
def test_every_kernel_against_float64(isa, C):
    """|error| <= 1e-6 sum |W||x| at odd widths (every tail: past the 64-, 32-, 16- and 8-column loops)."""
    rng = np.random.default_rng(C)
    bits, W = matrix(rng, 37, C)
    bits[0, : min(C, 4)] = [0x0000, 0x8000, 0x0001, 0x7E00][: min(C, 4)]  # +-0, a subnormal, 2^125
    W = bits.view(ml_dtypes.bfloat16).astype(np.float64)
    x = rng.standard_normal(C).astype(np.float32)
    got = matvec(bits, x, isa=isa)
    want, mag = W @ x.astype(np.float64), np.abs(W) @ np.abs(x.astype(np.float64))
    assert got.dtype == np.float32 and got.shape == (37,)
    assert np.all(np.abs(got - want) <= 1e-6 * mag + 1e-43), np.max(np.abs(got - want) / (mag + 1e-300))


@pytest.mark.parametrize("isa", isas())
def test_the_bound_at_k3s_widest_matrix(isa):
    """The float32 sums' error grows with the width: at K3 layer 0's down_proj (33,792 columns), with terms that do not
    cancel (all positive), 1.7e-6 sum |W||x| (portable C's 4 sums of C/4 terms; the README's 1e-6 held to 1,001
    columns only): every kernel within 4e-6."""
    rng = np.random.default_rng(0)
    C = 33792
    W = (np.abs(rng.standard_normal((16, C))) + 1).astype(ml_dtypes.bfloat16)
    bits, W64 = W.view(np.uint16), W.astype(np.float64)
    x = (np.abs(rng.standard_normal((3, C))) + 1).astype(np.float32)
    want = x.astype(np.float64) @ W64.T  # (all terms positive: sum |W||x| itself)
    for got in (bf16_matvec.bf16_matmat(bits, x, isa=isa), np.stack([matvec(bits, v, isa=isa) for v in x])):
        assert np.max(np.abs(got - want) / want) <= 4e-6


def test_small_integers_are_exact_in_every_kernel():
    """Every product and partial sum an integer below 2^24: no rounding, so every order gives the same bits."""
    rng = np.random.default_rng(1)
    W = rng.integers(-8, 9, (50, 333)).astype(ml_dtypes.bfloat16)
    x = rng.integers(-8, 9, 333).astype(np.float32)
    want = (W.astype(np.float64) @ x.astype(np.float64)).astype(np.float32)
    for isa in isas():
        np.testing.assert_array_equal(matvec(W.view(np.uint16), x, isa=isa), want)


def test_threads_split_rows_without_changing_a_bit():
    rng = np.random.default_rng(2)
    bits, _ = matrix(rng, 1000, 300)
    x = rng.standard_normal(300).astype(np.float32)
    one = matvec(bits, x, threads=1)
    for threads in (2, 3, 7):
        np.testing.assert_array_equal(matvec(bits, x, threads=threads), one)
    out = np.full(1000, np.nan, np.float32)
    assert matvec(bits, x, out=out) is out
    np.testing.assert_array_equal(out, one)


def test_bad_arguments_are_named():
    bits = np.zeros((4, 8), np.uint16)
    x = np.ones(8, np.float32)
    with pytest.raises(ValueError, match=r"bits: expected a C-contiguous uint16 .* got uint16 \(8, 4\) \(not C"):
        matvec(bits.T, np.ones(4, np.float32))
    with pytest.raises(ValueError, match=r"bits: .* got float32"):
        matvec(bits.astype(np.float32), x)
    with pytest.raises(ValueError, match=r"x: expected float32 \[8\], got float64 \(8,\)"):
        matvec(bits, x.astype(np.float64))
    with pytest.raises(ValueError, match=r"out: expected a C-contiguous float32 \[4\]"):
        matvec(bits, x, out=np.empty(5, np.float32))
    with pytest.raises(ValueError, match="isa: not one of isas"):
        matvec(bits, x, isa="sse9")
    with pytest.raises(ValueError, match="w: size is not R \\* C"):  # the C side checks on its own
        bf16_matvec._ext.bf16_matvec(bits, x, np.empty(4, np.float32), 4, 9, 0, 4, "")
    with pytest.raises(ValueError, match="start/stop"):
        bf16_matvec._ext.bf16_matvec(bits, x, np.empty(4, np.float32), 4, 8, 0, 5, "")


def test_bf16_matrix_takes_the_kernel_for_vectors_only():
    rng = np.random.default_rng(3)
    bits, W = matrix(rng, 70, 40)
    M = Bf16Matrix(bits, WideningScratch(np))
    x = rng.standard_normal(40).astype(np.float32)
    assert M.uses_kernel and not Bf16Matrix(bits, WideningScratch(np), kernel=False).uses_kernel
    np.testing.assert_array_equal(M @ x, matvec(bits, x))
    X = rng.standard_normal((40, 3)).astype(np.float32)
    np.testing.assert_array_equal(M @ X, W.astype(np.float32) @ X)  # a matrix operand: widened, then BLAS
    assert not Bf16Matrix(bits, WideningScratch(np), np.float64).uses_kernel  # float64 compute: widening
    with pytest.raises(ValueError, match=r"kernel=True\) needs .* float32 .* got numpy bits, float64"):
        Bf16Matrix(bits, WideningScratch(np), np.float64, kernel=True)


def test_decoder_with_the_kernel_matches_the_float32_trunk():
    """The random tiny model, bf16 trunk through the kernel vs the float32 trunk: float32 rounding, same argmax.

    The two differ only in the matvecs' summation order, which this random model amplifies more at some tokens
    than others (the float32 trunk's own distance from float64 varies ~10x across these tokens): each token's
    difference is bounded by the float32 route's own error there (2x), with a floor of 2e-5 of the scale."""
    tokens = [0, 255, 17, 17, 42, 128, 7, 200, 3, 99]

    def decode(w):
        state = KimiDecodeState.new(w)
        return np.stack([np.array(kimi_forward_token(w, state, t)) for t in tokens])

    f32 = from_pretrained(random_tiny_checkpoint(), device="cpu")
    bf16 = from_pretrained(random_tiny_checkpoint(), device="cpu", weight_dtype="bfloat16")
    assert bf16.extra["bf16_matvec"] == "kernel" and bf16.lm_head.uses_kernel
    assert bf16.memory_report()["bf16 widening scratch"] == 0  # the kernel needs none
    got, want = decode(bf16), decode(f32)
    exact = decode(from_pretrained(random_tiny_checkpoint(), device="cpu", dtype="float64"))
    own = np.abs(want - exact).max(axis=-1)  # the float32 trunk's rounding at each token
    assert (np.abs(got - want).max(axis=-1) <= np.maximum(2 * own, 2e-5 * np.abs(want).max())).all()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    with pytest.raises(ValueError, match="bf16_matvec='fast': expected one of 'auto', 'kernel', 'widen'"):
        from_pretrained(random_tiny_checkpoint(), device="cpu", weight_dtype="bfloat16", bf16_matvec="fast")
    with pytest.raises(ValueError, match="bf16_matvec='kernel' .* needs weight_dtype='bfloat16'; got weight_dtype=None"):
        from_pretrained(random_tiny_checkpoint(), device="cpu", bf16_matvec="kernel")  # float32 weights: it would do nothing


# ---------------------------------------------------------------- several input rows per pass (the sequence path)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("C", [1, 7, 16, 17, 65, 1001], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("n", [1, 3, 4, 9, 12, 30], ids=lambda n: f"n{n}")
def test_matmat_against_float64(isa, C, n):
    """Tiles of 4 rows x 4 inputs and every remainder (37 rows, 1..9 inputs), every column tail; panels (AVX2 from 5
    inputs, AVX-512 from 12)."""
    rng = np.random.default_rng(C * 10 + n)
    bits, W = matrix(rng, 37, C)
    x = rng.standard_normal((n, C)).astype(np.float32)
    x64 = x.astype(np.float64)
    for threads in (1, 2):
        got = bf16_matvec.bf16_matmat(bits, x, isa=isa, threads=threads)
        want, mag = x64 @ W.T, np.abs(x64) @ np.abs(W).T
        assert got.dtype == np.float32 and got.shape == (n, 37)
        assert np.all(np.abs(got - want) <= 1e-6 * mag + 1e-43), np.max(np.abs(got - want) / (mag + 1e-300))


def test_matmat_panels_give_the_same_floats_in_every_simd_kernel():
    """From 12 inputs both SIMD kernels take panels (AVX2: 8 rows, AVX-512: 16 rows, up to 12 inputs a call, cut
    evenly): each output one FMA after another in column order, so the same floats, bit for bit, with 37 rows (no
    whole 16-row panel at the end), column tails past a tile, and rows cut between threads."""
    simd = [isa for isa in isas() if isa != "portable"]
    if len(simd) < 2:
        pytest.skip(f"needs two SIMD kernels on this CPU (it has {simd})")
    rng = np.random.default_rng(12)
    bits, _ = matrix(rng, 37, 517)
    for n in (12, 13, 29):
        x = rng.standard_normal((n, 517)).astype(np.float32)
        for threads in (1, 3):
            got = [bf16_matvec.bf16_matmat(bits, x, isa=isa, threads=threads) for isa in simd]
            for other in got[1:]:
                np.testing.assert_array_equal(other, got[0])


def test_matmat_tiles_are_the_same_floats_one_input_at_a_time():
    """Below the panels' threshold (AVX2: 5 inputs, AVX-512: 12) the tiles take up to 4 inputs a pass (3 inputs: one
    pass): each output the same float as that input alone, in every kernel, with 37 rows (tiles and remainders) and a
    column tail."""
    rng = np.random.default_rng(13)
    bits, _ = matrix(rng, 37, 203)
    x = rng.standard_normal((11, 203)).astype(np.float32)
    for isa in isas():
        alone = np.concatenate([bf16_matvec.bf16_matmat(bits, x[i : i + 1], isa=isa, threads=1) for i in range(11)])
        for n in (2, 3, 4) if isa == "avx2" else (2, 3, 4, 7, 11):
            np.testing.assert_array_equal(bf16_matvec.bf16_matmat(bits, x[:n], isa=isa, threads=1), alone[:n])


def test_matmat_small_integers_are_exact_in_every_kernel():
    rng = np.random.default_rng(4)
    W = rng.integers(-8, 9, (50, 333)).astype(ml_dtypes.bfloat16)
    x = rng.integers(-8, 9, (6, 333)).astype(np.float32)
    want = (x.astype(np.float64) @ W.astype(np.float64).T).astype(np.float32)
    for isa in isas():
        for threads in (1, 3):
            np.testing.assert_array_equal(bf16_matvec.bf16_matmat(W.view(np.uint16), x, isa=isa, threads=threads), want)
    assert bf16_matvec.bf16_matmat(W.view(np.uint16), x[:0]).shape == (0, 50)


def test_matmat_bad_arguments_are_named():
    bits = np.zeros((4, 8), np.uint16)
    with pytest.raises(ValueError, match=r"x: expected float32 \[n, 8\], got float32 \(8,\)"):
        bf16_matvec.bf16_matmat(bits, np.ones(8, np.float32))
    with pytest.raises(ValueError, match=r"out: expected a C-contiguous float32 \[2, 4\]"):
        bf16_matvec.bf16_matmat(bits, np.ones((2, 8), np.float32), out=np.empty((4, 2), np.float32))
    with pytest.raises(ValueError, match="x: expected float32 \\[n, C\\]"):  # the C side checks on its own
        bf16_matvec._ext.bf16_matmat(bits, np.ones((2, 8), np.float32), np.empty((3, 4), np.float32), 4, 8, 3, 0, 4, "")


def test_bf16_matrix_rows_through_the_kernel_or_widened():
    """`matmul_rows` (what `ops.linear` calls): the multi-row kernel for float32 rows, else widened then BLAS."""
    rng = np.random.default_rng(5)
    bits, W = matrix(rng, 70, 40)
    x = rng.standard_normal((5, 40)).astype(np.float32)
    M = Bf16Matrix(bits, WideningScratch(np))
    np.testing.assert_array_equal(M.matmul_rows(x), bf16_matvec.bf16_matmat(bits, x))
    np.testing.assert_array_equal(Bf16Matrix(bits, WideningScratch(np), kernel=False).matmul_rows(x),
                                  x @ W.astype(np.float32).T)
    np.testing.assert_array_equal(Bf16Matrix(bits, WideningScratch(np), np.float64).matmul_rows(x.astype(np.float64)),
                                  x.astype(np.float64) @ W.T)
