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
