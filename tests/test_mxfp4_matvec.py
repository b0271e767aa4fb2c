"""The compiled kernel that multiplies MXFP4 experts from their packed bytes, against float64."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_kernel

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.model.latent_moe import LatentMoeWeights, expert_outputs
from kimi_explore.weights import mxfp4, mxfp4_matvec
from kimi_explore.weights.experts import PackedExperts, dense_from_packed
from kimi_explore.weights.mxfp4_matvec import expert_matvec
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("kernel")


@pytest.fixture
def kernel():
    require_kernel()


def isas():
    return mxfp4_matvec.isas() or ("portable",)  # the list itself needs the kernel; the fixture skips first


def bank(rng, E=5, R=40, C=96, lo=100, hi=150):
    packed = rng.integers(0, 256, (E, R, C // 2), dtype=np.uint8)
    return packed, rng.integers(lo, hi, (E, R, C // 32), dtype=np.uint8)


def float64_matvec(packed, scale, ids, x):
    """The definition: dequantise (float64, element by element) then multiply in float64."""
    x = np.broadcast_to(x, (len(ids), x.shape[-1])).astype(np.float64)
    W = [mxfp4.naive_dequantize(packed[e], scale[e]) for e in ids]
    exact = np.stack([w @ xi for w, xi in zip(W, x, strict=True)])
    return exact, np.stack([np.abs(w) @ np.abs(xi) for w, xi in zip(W, x, strict=True)])  # and the error scale


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("C", [32, 64, 96, 3 * 32 * 7], ids=["one-group", "two-groups", "three-groups", "21-groups"])
def test_every_kernel_against_float64(isa, C):
    """Odd and even group counts (the AVX-512 kernel takes groups in pairs), one x or one per expert."""
    rng = np.random.default_rng(C)
    packed, scale = bank(rng, C=C)
    packed[0].reshape(-1)[:256] = np.arange(256)  # every byte value
    scale[0, 0, 0], scale[1, 0, -1] = 1, 200  # 2^-126 (the smallest normal factor) and 2^73 (one group dominates)
    ids = np.array([3, 0, 3, 1, 4])  # repeats and any order
    for x in (rng.standard_normal(C).astype(np.float32), rng.standard_normal((5, C)).astype(np.float32)):
        got = expert_matvec(packed, scale, ids, x, isa=isa)
        want, mag = float64_matvec(packed, scale, ids, x)
        assert got.dtype == np.float32 and got.shape == (5, 40)
        assert np.all(np.abs(got - want) <= 1e-6 * mag + 1e-43), np.max(np.abs(got - want) / (mag + 1e-300))


def test_a_power_of_two_scale_is_exact():
    """With every scale 127 (factor 1) and x of small integers, every sum is exact in float32: all kernels agree bit for bit."""
    rng = np.random.default_rng(1)
    packed, scale = bank(rng, C=256)
    x = rng.integers(-8, 9, 256).astype(np.float32)
    want = float64_matvec(packed, np.full_like(scale, 127), np.arange(5), x)[0]
    for isa in isas():
        got = expert_matvec(packed, np.full_like(scale, 127), np.arange(5), x, isa=isa)
        np.testing.assert_array_equal(got, want.astype(np.float32))
        # the scale multiplies the group sum: 2^k times the factor-1 result, exactly
        np.testing.assert_array_equal(expert_matvec(packed, np.full_like(scale, 130), np.arange(5), x, isa=isa), got * 8)


def test_threads_split_rows_without_changing_a_bit():
    rng = np.random.default_rng(2)
    packed, scale = bank(rng, R=700, C=128)
    x = rng.standard_normal(128).astype(np.float32)
    ids = [4, 2, 2, 0]
    one = expert_matvec(packed, scale, ids, x, threads=1)
    for threads in (2, 3, 4):
        np.testing.assert_array_equal(expert_matvec(packed, scale, ids, x, threads=threads), one)
    out = np.full((4, 700), np.nan, np.float32)
    assert expert_matvec(packed, scale, ids, x, out=out) is out
    np.testing.assert_array_equal(out, one)


def test_bad_arguments_are_named():
    rng = np.random.default_rng(3)
    packed, scale = bank(rng)
    x = np.ones(96, np.float32)
    with pytest.raises(ValueError, match=r"packed: expected a C-contiguous uint8 NumPy array .* got uint8 \(5, 40, 48\) \(not C"):
        expert_matvec(np.asfortranarray(packed), scale, [0], x)
    with pytest.raises(ValueError, match=r"scale: .* got int16"):
        expert_matvec(packed, scale.astype(np.int16), [0], x)
    with pytest.raises(ValueError, match=r"packed \(5, 40, 48\) / scale \(5, 40, 2\)"):
        expert_matvec(packed, np.ascontiguousarray(scale[:, :, :2]), [0], x)
    with pytest.raises(ValueError, match=r"x: expected float32 \[96\] or \[2, 96\], got float64 \(96,\)"):
        expert_matvec(packed, scale, [0, 1], x.astype(np.float64))
    with pytest.raises(ValueError, match=r"x: expected float32 \[96\] or \[2, 96\], got float32 \(3, 96\)"):
        expert_matvec(packed, scale, [0, 1], np.ones((3, 96), np.float32))
    with pytest.raises(ValueError, match=r"out: expected a C-contiguous float32 \[1, 40\]"):
        expert_matvec(packed, scale, [0], x, out=np.empty((40, 1), np.float32))
    with pytest.raises(IndexError, match=r"expert id 5 outside 0..4"):
        expert_matvec(packed, scale, [1, 5], x)
    with pytest.raises(ValueError, match="isa: not one of isas"):
        expert_matvec(packed, scale, [1], x, isa="sse9")


def test_without_the_kernel(monkeypatch):
    monkeypatch.setattr(mxfp4_matvec, "AVAILABLE", False)
    with pytest.raises(RuntimeError, match="was not built"):
        expert_matvec(*bank(np.random.default_rng(0)), [0], np.ones(96, np.float32))
    assert not packed_bank(0).uses_fused  # the dequantising route instead


def packed_bank(seed, capacity=0, fused=None, dtype=np.float32):
    rng = np.random.default_rng(seed)
    (p13, s13), (p2, s2) = bank(rng, E=6, R=64, C=64), bank(rng, E=6, R=64, C=32)
    return PackedExperts(p13, s13, p2, s2, dtype=dtype, capacity=capacity, fused=fused)


def test_packed_experts_take_the_fused_route_when_they_can():
    act = lambda h: np.tanh(h[:, :32]) * h[:, 32:]  # noqa: E731
    dense = dense_from_packed(packed_bank(4))
    fused = packed_bank(4)
    assert fused.uses_fused and not packed_bank(4, capacity=2).uses_fused and not packed_bank(4, fused=False).uses_fused
    assert not packed_bank(4, dtype=np.float64).uses_fused
    rng = np.random.default_rng(5)
    for ids in ([1, 4, 0], [5, 5], np.arange(6)):
        z = rng.standard_normal(64).astype(np.float32)
        got, want = expert_outputs(fused, ids, z, act), expert_outputs(dense, ids, z, act)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert (fused.stats.hits, fused.stats.misses, fused.cached_ids()) == (0, 0, [])  # no cache on this route
    with pytest.raises(ValueError, match=r"fused=True\) needs .* capacity=0 .* got numpy arrays, float32, capacity=2"):
        packed_bank(4, capacity=2, fused=True)


def decode(w, tokens):
    state = KimiDecodeState.new(w)
    return np.stack([np.array(kimi_forward_token(w, state, t)) for t in tokens])


def test_fused_decoder_matches_dense_experts():
    """The random tiny model, packed with no cache (fused) vs dense: same argmax, logits to float32 rounding."""
    tokens = [0, 255, 17, 17, 42, 128, 7, 200, 3, 99]
    dense = from_pretrained(random_tiny_checkpoint(), device="cpu", experts="dense")
    fused = from_pretrained(random_tiny_checkpoint(), device="cpu", experts="packed", expert_cache_size=0)
    banks = [layer.ffn.experts for layer in fused.layers if isinstance(layer.ffn, LatentMoeWeights)]
    assert banks and all(b.uses_fused for b in banks)
    got, want = decode(fused, tokens), decode(dense, tokens)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


# ---------------------------------------------------------------- several input rows per weight pass


def float64_grouped(packed, scale, experts, bounds, x):
    """The definition, group by group: dequantise (float64) then multiply in float64; and the error scale."""
    want, mag = np.zeros((len(x), packed.shape[1])), np.zeros((len(x), packed.shape[1]))
    for j, e in enumerate(experts):
        W = mxfp4.naive_dequantize(packed[e], scale[e])
        xs = x[bounds[j] : bounds[j + 1]].astype(np.float64)
        want[bounds[j] : bounds[j + 1]], mag[bounds[j] : bounds[j + 1]] = xs @ W.T, np.abs(xs) @ np.abs(W).T
    return want, mag


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("C", [32, 96, 3 * 32 * 7], ids=["one-group", "three-groups", "21-groups"])
@pytest.mark.parametrize("R", [1, 6, 43], ids=lambda r: f"R{r}")
def test_grouped_matmat_against_float64(isa, C, R):
    """Groups of 0, 1, 3, 4, 5 and 9 input rows (tiles of 4 rows x 4 inputs and every remainder), any expert order,
    an expert twice, extreme scales; 1 to 3 threads cut the (group, row) range by work."""
    rng = np.random.default_rng(C + R)
    packed, scale = bank(rng, E=6, R=R, C=C)
    packed[0].reshape(-1)[: min(256, packed[0].size)] = np.arange(min(256, packed[0].size))
    scale[0, 0, 0], scale[1, 0, -1] = 1, 200
    experts, sizes = [3, 0, 5, 1, 3, 2], [5, 1, 9, 0, 4, 3]
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    x = rng.standard_normal((bounds[-1], C)).astype(np.float32)
    want, mag = float64_grouped(packed, scale, experts, bounds, x)
    for threads in (1, 2, 3):
        got = mxfp4_matvec.grouped_matmat(packed, scale, experts, bounds, x, isa=isa, threads=threads)
        assert got.dtype == np.float32 and got.shape == (bounds[-1], R)
        assert np.all(np.abs(got - want) <= 1e-6 * mag + 1e-43), np.max(np.abs(got - want) / (mag + 1e-300))


def test_grouped_matmat_is_exact_on_small_integers_in_every_kernel():
    """Scale 127 (factor 1), integer inputs: every partial sum exact, so all kernels and thread counts agree bit for bit."""
    rng = np.random.default_rng(8)
    packed, scale = bank(rng, E=3, R=50, C=256)
    scale[:] = 127
    bounds = np.array([0, 7, 7, 18])
    x = rng.integers(-8, 9, (18, 256)).astype(np.float32)
    want = float64_grouped(packed, scale, [2, 0, 1], bounds, x)[0].astype(np.float32)
    for isa in isas():
        for threads in (1, 2):
            np.testing.assert_array_equal(mxfp4_matvec.grouped_matmat(packed, scale, [2, 0, 1], bounds, x, isa=isa,
                                                                      threads=threads), want)
        scaled = mxfp4_matvec.grouped_matmat(packed, np.full_like(scale, 130), [2, 0, 1], bounds, x, isa=isa)
        np.testing.assert_array_equal(scaled, want * 8)


@pytest.mark.parametrize("C", [96, 2 * 16 * 48], ids=["one-column-block", "three-column-blocks"])
def test_grouped_matmat_many_inputs_against_float64(C):
    """A group of >= 12 inputs takes the panel route (AVX2 and AVX-512: weights decoded once per tile, outer products),
    fewer the 4-input tiles: both within the float64 bound; the panel route the same floats whatever the thread count (a cut
    inside a group) and whichever group an input is in. Groups of 7 to 300 inputs (remainders of 5), 37 rows (panels
    of 8, tiles of 64 rows and remainders), columns over 256 per tile, the same expert twice."""
    rng = np.random.default_rng(C)
    packed, scale = bank(rng, E=4, R=37, C=C)
    packed[1, :, :8] = 0x77  # +6 and +6: large partial sums of one sign
    scale[1, 3, 0] = 200
    sizes, experts = [8, 300, 7, 13, 129], [2, 0, 1, 3, 1]
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    x = rng.standard_normal((bounds[-1], C)).astype(np.float32)
    want, mag = float64_grouped(packed, scale, experts, bounds, x)
    for isa in isas():
        got = mxfp4_matvec.grouped_matmat(packed, scale, experts, bounds, x, isa=isa, threads=1)
        assert np.all(np.abs(got - want) <= 1e-6 * mag + 1e-43), np.max(np.abs(got - want) / (mag + 1e-300))
        np.testing.assert_array_equal(mxfp4_matvec.grouped_matmat(packed, scale, experts, bounds, x, isa=isa, threads=2), got)
        # group 1 (300 inputs) again, as groups of 150 and 150: the same floats
        halves = mxfp4_matvec.grouped_matmat(packed, scale, [0, 0], [0, 150, 300], x[8:308], isa=isa, threads=1)
        np.testing.assert_array_equal(halves, got[8:308])


def test_the_panel_route_gives_the_same_floats_in_every_simd_kernel():
    """Groups of 12 or more inputs: AVX2 decodes a tile into panels of 8 rows, AVX-512 into panels of 16 and takes up
    to 12 inputs a call (cut evenly: 13 = 7 + 6); each output is still one FMA after another in column order, so
    both give the same floats, bit for bit, with rows that fill no whole panel (70 = 4 x 16 + 6), columns over
    one tile, and row ranges cut by threads inside a panel."""
    simd = [isa for isa in isas() if isa != "portable"]
    if len(simd) < 2:
        pytest.skip(f"needs two SIMD kernels on this CPU (it has {simd})")
    rng = np.random.default_rng(16)
    packed, scale = bank(rng, E=3, R=70, C=2 * 16 * 40)
    sizes, experts = [12, 13, 40, 25, 100], [2, 0, 1, 2, 0]
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    x = rng.standard_normal((bounds[-1], packed.shape[2] * 2)).astype(np.float32)
    for threads in (1, 3):
        got = [mxfp4_matvec.grouped_matmat(packed, scale, experts, bounds, x, isa=isa, threads=threads) for isa in simd]
        for other in got[1:]:
            np.testing.assert_array_equal(other, got[0])


def test_grouped_matmat_small_groups_are_the_same_floats_one_input_at_a_time():
    """Groups of 1 to 11 inputs take the tiles (AVX2 and AVX-512: as few passes of up to 5 as that allows, as even as
    possible, 11 = 4 + 4 + 3): each output the same float as that input alone in its own group, in every kernel."""
    rng = np.random.default_rng(11)
    packed, scale = bank(rng, E=3, R=21, C=3 * 32 * 7)
    sizes, experts = [3, 2, 4, 1, 5, 6, 7, 9, 11], [1, 0, 2, 1, 0, 2, 1, 0, 2]
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    x = rng.standard_normal((bounds[-1], packed.shape[2] * 2)).astype(np.float32)
    alone = np.repeat(experts, sizes)
    for isa in isas():
        got = mxfp4_matvec.grouped_matmat(packed, scale, experts, bounds, x, isa=isa, threads=1)
        np.testing.assert_array_equal(got, mxfp4_matvec.grouped_matmat(packed, scale, alone, np.arange(len(alone) + 1), x,
                                                                       isa=isa, threads=1))


def test_grouped_parts_matmat_is_the_bank_kernel_on_blocks():
    """The same bytes given as row blocks (w1 | w3, as mapped experts hold them): bit for bit the bank's result."""
    rng = np.random.default_rng(9)
    packed, scale = bank(rng, E=4, R=40, C=96)
    experts, bounds = [2, 0, 3], np.array([0, 6, 7, 12])
    x = rng.standard_normal((12, 96)).astype(np.float32)
    blocks = lambda a: [(np.ascontiguousarray(a[e, :24]), np.ascontiguousarray(a[e, 24:])) for e in experts]  # noqa: E731
    for isa in isas():
        want = mxfp4_matvec.grouped_matmat(packed, scale, experts, bounds, x, isa=isa)
        got = mxfp4_matvec.grouped_parts_matmat(blocks(packed), blocks(scale), (24, 16), bounds, x, isa=isa, threads=2)
        np.testing.assert_array_equal(got, want)


def test_grouped_ggml_matmat_is_the_bank_kernel_on_the_same_weights():
    """llama.cpp's 17-byte blocks read in place, each row put in compressed-tensors order as the kernel reaches it
    (a tile's rows whole, a panel's one column tile at a time): bit for bit `grouped_matmat` on the packed bytes of
    the same weights, in every kernel, through the tiles (1-11 inputs) and the panels (12+), threads cutting rows."""
    from kimi_explore.weights.ggml_quants import mxfp4_blocks_from_packed

    rng = np.random.default_rng(17)
    packed, scale = bank(rng, E=3, R=70, C=2 * 16 * 40)
    blocks = mxfp4_blocks_from_packed(packed, scale)
    for sizes in ([3, 12, 40], [1, 5, 100], [13, 7, 25]):
        experts, bounds = [2, 0, 1], np.concatenate(([0], np.cumsum(sizes)))
        x = rng.standard_normal((bounds[-1], packed.shape[2] * 2)).astype(np.float32)
        for isa in isas():
            for threads in (1, 3):
                np.testing.assert_array_equal(
                    mxfp4_matvec.grouped_ggml_matmat(blocks, experts, bounds, x, isa=isa, threads=threads),
                    mxfp4_matvec.grouped_matmat(packed, scale, experts, bounds, x, isa=isa, threads=threads))
    with pytest.raises(ValueError, match=r"blocks: expected a C-contiguous uint8 NumPy array \[E, R, C/32, 17\]"):
        mxfp4_matvec.grouped_ggml_matmat(packed, [0], [0, 1], x[:1])
    with pytest.raises(IndexError, match="expert id 3 outside 0..2"):
        mxfp4_matvec.grouped_ggml_matmat(blocks, [3], [0, 1], x[:1])


def test_grouped_bad_arguments_are_named():
    rng = np.random.default_rng(10)
    packed, scale = bank(rng)
    x = np.ones((3, 96), np.float32)
    with pytest.raises(ValueError, match=r"bounds: expected \[0, \.\.\., n\] non-decreasing, one more than the 2 groups"):
        mxfp4_matvec.grouped_matmat(packed, scale, [0, 1], [0, 3], x)
    with pytest.raises(ValueError, match=r"bounds: expected .* got \[0, 2, 1\]"):
        mxfp4_matvec.grouped_matmat(packed, scale, [0, 1], [0, 2, 1], x)
    with pytest.raises(ValueError, match=r"x: expected float32 \[4, 96\] \(n = bounds\[-1\]\), got float32 \(3, 96\)"):
        mxfp4_matvec.grouped_matmat(packed, scale, [0, 1], [0, 2, 4], x)
    with pytest.raises(IndexError, match=r"expert id 7 outside 0..4"):
        mxfp4_matvec.grouped_matmat(packed, scale, [0, 7], [0, 2, 3], x)
    with pytest.raises(ValueError, match=r"packed block 1 of group 0: 32 bytes, expected 48"):
        mxfp4_matvec.grouped_parts_matmat([(packed[0, :20], packed[0, 20:21, :32].copy())], [(scale[0, :20], scale[0, 20:21])],
                                          (20, 1), [0, 3], x)
