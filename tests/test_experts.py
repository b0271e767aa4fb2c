"""MXFP4-packed experts with an LRU cache: the same values, bit for bit, as dequantising everything up front."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REFERENCE_DIR

from kimi_explore import CheckpointError, KimiDecodeState, from_pretrained, kimi_forward_sequence, kimi_forward_token
from kimi_explore.model.latent_moe import LatentMoeWeights, expert_outputs, latent_moe, naive_latent_moe
from kimi_explore.weights import load_options, mxfp4, mxfp4_matvec
from kimi_explore.weights.experts import DenseExperts, PackedExperts, dense_from_packed
from kimi_explore.weights.tiny_model import random_tiny_checkpoint, write_checkpoint
from kimi_explore.weights.workspace import Workspace

TOKENS = [0, 255, 17, 17, 42, 128, 7, 200, 3, 99, 64, 1]


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def random_bank(rng, E=6, I=32, l=64, dtype=np.float32, capacity=0, fused=False):
    def pair(rows, cols):
        packed = rng.integers(0, 256, (E, rows, cols // 2), dtype=np.uint8)
        return packed, rng.integers(100, 140, (E, rows, cols // 32), dtype=np.uint8)

    (p13, s13), (p2, s2) = pair(2 * I, l), pair(l, I)
    return PackedExperts(p13, s13, p2, s2, dtype=dtype, capacity=capacity, fused=fused)


def _naive_bits(packed, scale):
    """The float64 reference, as bits (so -0.0 and 0.0 differ); every MXFP4 value is exact in float32."""
    return bits(np.stack([mxfp4.naive_dequantize(p, s) for p, s in zip(packed, scale, strict=True)]))


@pytest.mark.parametrize("pool", [None, "workspace"], ids=["own-pool", "workspace-pool"])
@pytest.mark.parametrize("threaded", [False, True], ids=["one-thread", "threads"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_mxfp4_dequantize_is_the_naive_reference_bit_for_bit(dtype, threaded, pool, monkeypatch):
    if threaded:  # big jobs are split over the cores in whole chunks: make this small one big, in 3 chunks
        monkeypatch.setattr(mxfp4, "_THREADED_BYTES", 1)
        monkeypatch.setattr(mxfp4, "_CHUNK", 96)
    rng = np.random.default_rng(1)
    packed = np.arange(256, dtype=np.uint8).reshape(2, 4, 32)  # every byte value, both nibbles
    # E8M0 from 2^-126 (x 0.5: a float32 subnormal) to 2^124 (x 6 stays finite in float32)
    scale = rng.integers(1, 252, (2, 4, 2), dtype=np.uint8)
    scale[0, 0, 0], scale[1, 3, 1] = 1, 251
    got = mxfp4.dequantize(packed, scale, dtype=dtype, pool=Workspace(np).pool() if pool else None)
    assert got.dtype == dtype and got.shape == (2, 4, 64)
    np.testing.assert_array_equal(bits(got.astype(np.float64)), _naive_bits(packed, scale))
    out = np.empty_like(got)[:, :, :]
    assert mxfp4.dequantize(packed, scale, out=out, dtype=dtype) is out
    np.testing.assert_array_equal(bits(out), bits(got))
    strided = np.empty((2, 4, 128), dtype)[:, :, ::2]  # a non-contiguous out is filled too
    assert mxfp4.dequantize(packed, scale, out=strided, dtype=dtype) is strided
    np.testing.assert_array_equal(bits(np.ascontiguousarray(strided)), bits(got))


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_device_dequantisation_path_on_the_host(dtype, monkeypatch):
    """The GPU formulation ([256, 2] table gather, one multiply), run with NumPy standing in for CuPy."""
    rng = np.random.default_rng(11)
    packed = rng.integers(0, 256, (3, 8, 48), dtype=np.uint8)
    scale = rng.integers(100, 150, (3, 8, 3), dtype=np.uint8)
    monkeypatch.setattr(mxfp4, "on_host", lambda xp: False)
    table = mxfp4.pair_table(np, dtype)
    assert table.shape == (256, 2)
    got = mxfp4.dequantize(packed, scale, dtype=dtype, table=table)
    np.testing.assert_array_equal(bits(got.astype(np.float64)), _naive_bits(packed, scale))
    out = np.empty_like(got)
    assert mxfp4.dequantize(packed, scale, out=out, dtype=dtype, table=table) is out
    np.testing.assert_array_equal(bits(out), bits(got))


def test_device_expert_path_on_the_host(monkeypatch):
    """`outputs` as a GPU runs it (one gather, batched matmuls), with NumPy: same values as the dense bank."""
    monkeypatch.setattr(PackedExperts, "_multiply_in_place", lambda self, xp: False)
    dense = dense_from_packed(random_bank(np.random.default_rng(12)))
    bank = random_bank(np.random.default_rng(12), capacity=2)
    act = lambda h: np.tanh(h[:, :32]) * h[:, 32:]  # noqa: E731
    rng = np.random.default_rng(13)
    for ids in ([1, 4, 0], [4, 1, 5], [5, 4], [2, 3, 1, 0]):
        z = rng.standard_normal(64).astype(np.float32)
        np.testing.assert_array_equal(bits(expert_outputs(bank, ids, z, act)), bits(expert_outputs(dense, ids, z, act)))
    assert bank.stats.hits > 0


def test_gather_equals_the_dense_bank_for_every_cache_size():
    rng = np.random.default_rng(2)
    sequences = [rng.permutation(6)[:3] for _ in range(25)] + [np.array([5, 5, 1]), np.array([2]), np.arange(6)]
    dense = dense_from_packed(random_bank(np.random.default_rng(3)))
    for capacity in (0, 1, 2, 4, 6):
        bank = random_bank(np.random.default_rng(3), capacity=capacity)
        for ids in sequences:
            w13, w2 = bank.gather(ids)
            d13, d2 = dense.gather(ids)
            assert w13.shape == d13.shape and w2.shape == d2.shape and w13.flags.c_contiguous
            np.testing.assert_array_equal(bits(w13), bits(d13))
            np.testing.assert_array_equal(bits(w2), bits(d2))
            assert len(bank.cached_ids()) <= capacity


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gathered"])
def test_outputs_equal_the_dense_bank_for_every_cache_size(in_place, monkeypatch):
    """The decoder's path (`expert_outputs`), both ways a packed bank runs it, vs the dense bank's gather + batched."""
    monkeypatch.setattr(PackedExperts, "_multiply_in_place", lambda self, xp: in_place)
    rng = np.random.default_rng(7)
    sequences = [rng.permutation(6)[:4] for _ in range(20)] + [np.array([3, 3]), np.arange(6)[::-1]]
    dense = dense_from_packed(random_bank(np.random.default_rng(8)))
    act = lambda h: np.tanh(h[:, :32]) * h[:, 32:]  # noqa: E731
    for capacity in (0, 1, 3, 6):
        bank = random_bank(np.random.default_rng(8), capacity=capacity)
        for n, ids in enumerate(sequences):
            z = rng.standard_normal(64).astype(np.float32)
            got = expert_outputs(bank, ids, z, act)
            np.testing.assert_array_equal(bits(got), bits(expert_outputs(dense, ids, z, act)), err_msg=f"{capacity=} {n=}")
        assert bank.stats.hits + bank.stats.misses == sum(len(set(s.tolist())) for s in sequences)


def test_lru_hits_misses_evictions():
    bank = random_bank(np.random.default_rng(4), capacity=2)
    bank.gather([0, 1])
    assert (bank.stats.hits, bank.stats.misses, bank.stats.evictions) == (0, 2, 0)
    assert bank.cached_ids() == [0, 1]
    bank.gather([1, 2])  # 1 hits; 2 is dequantised and pushes out 0, the least recently used
    assert (bank.stats.hits, bank.stats.misses, bank.stats.evictions) == (1, 3, 1)
    assert bank.cached_ids() == [1, 2]
    bank.gather([2])
    bank.gather([0])  # now 1 is the least recently used
    assert (bank.stats.hits, bank.stats.misses, bank.stats.evictions) == (2, 4, 2)
    assert bank.cached_ids() == [2, 0]
    assert bank.cached_bytes == 2 * bank.expert_bytes == 2 * 3 * 32 * 64 * 4
    bank.set_capacity(1)
    assert bank.cached_ids() == [0] and bank.stats.evictions == 3
    bank.set_capacity(0)
    bank.gather([3, 4])
    assert bank.cached_ids() == [] and bank.cached_bytes == 0
    bank.clear()
    assert (bank.stats.hits, bank.stats.misses, bank.stats.evictions) == (0, 0, 0)
    bank.set_capacity(3)
    bank.warm([5, 1, 4, 2], chunk=2)  # only the last `capacity` fit
    assert bank.cached_ids() == [1, 4, 2] and bank.stats.misses == 0
    dense = dense_from_packed(random_bank(np.random.default_rng(4)))
    np.testing.assert_array_equal(bank.gather([4, 1])[0], dense.gather([4, 1])[0])
    assert bank.stats.hits == 2
    with pytest.raises(IndexError, match=r"expert ids \[6\] outside 0..5"):
        bank.gather([1, 6])
    with pytest.raises(ValueError, match="capacity=-1"):
        bank.set_capacity(-1)


def test_only_the_missing_experts_are_dequantised_in_one_call(monkeypatch):
    calls = []
    real = mxfp4.dequantize

    def spy(packed, scale, *args, **kwargs):
        calls.append(packed.shape[0])
        return real(packed, scale, *args, **kwargs)

    monkeypatch.setattr(mxfp4, "dequantize", spy)
    bank = random_bank(np.random.default_rng(5), capacity=4)
    bank.gather([3, 1, 4])
    assert calls == [3, 3]  # one call for all w13, one for all w2
    calls.clear()
    bank.gather([1, 5, 3, 0])
    assert calls == [2, 2]  # 5 and 0 only
    calls.clear()
    bank.gather([5, 0])
    assert calls == []
    z = np.ones(64, np.float32)
    bank.outputs([2, 5, 3], z, lambda h: h[:, :32])  # the decoder's path: 2 is the only miss
    assert calls == [1, 1]


def test_gathered_moe_matches_the_per_expert_float64_loop():
    """latent_moe over a packed bank (gather + batched matmuls) vs the naive per-expert loop."""
    w = from_pretrained(random_tiny_checkpoint(), device="cpu", experts="packed", expert_cache_size=3)
    rng = np.random.default_rng(6)
    for layer in w.layers:
        if not isinstance(layer.ffn, LatentMoeWeights):
            continue
        assert isinstance(layer.ffn.experts, PackedExperts)
        x = rng.standard_normal(w.config.hidden_size).astype(np.float32)
        want, _, _ = naive_latent_moe(x, layer.ffn)
        np.testing.assert_allclose(latent_moe(x, layer.ffn), want, rtol=2e-4, atol=2e-4)


def decode(w, tokens=TOKENS, hooks=None):
    state = KimiDecodeState.new(w)
    return np.stack([np.array(kimi_forward_token(w, state, t, hooks=hooks)) for t in tokens])


@pytest.mark.parametrize("path", [random_tiny_checkpoint(), REFERENCE_DIR], ids=["random_tiny", "reference"])
@pytest.mark.parametrize("cache", [0, 1, None], ids=["no-cache", "cache-1", "cache-default"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gathered"])
def test_packed_logits_bit_identical_to_dense(path, cache, in_place, monkeypatch):
    """The dequantising routes (the fused kernel sums in another order: test_mxfp4_matvec.py)."""
    monkeypatch.setattr(mxfp4_matvec, "AVAILABLE", False)
    monkeypatch.setattr(PackedExperts, "_multiply_in_place", lambda self, xp: in_place)
    dense = from_pretrained(path, device="cpu", experts="dense")
    packed = from_pretrained(path, device="cpu", experts="packed", expert_cache_size=cache)
    assert packed.extra["experts"] == "packed" and dense.extra["experts"] == "dense"
    tokens = TOKENS if path != REFERENCE_DIR else [t % packed.config.vocab_size for t in TOKENS]
    np.testing.assert_array_equal(bits(decode(packed, tokens)), bits(decode(dense, tokens)))
    banks = [layer.ffn.experts for layer in packed.layers if isinstance(layer.ffn, LatentMoeWeights)]
    k = packed.config.num_experts_per_token
    assert all(b.stats.hits + b.stats.misses == len(tokens) * k for b in banks)  # every pick counted once
    if cache == 0:
        assert all(b.stats.hits == 0 and not b.cached_ids() for b in banks)


@pytest.mark.parametrize("path", [random_tiny_checkpoint(), REFERENCE_DIR], ids=["random_tiny", "reference"])
@pytest.mark.parametrize("cache", [0, 3, None], ids=["no-cache", "cache-3", "cache-default"])
def test_packed_sequence_bit_identical_to_dense(path, cache, monkeypatch):
    """The sequence path too: a dense bank's chunk takes the compiled experts (`sequence_ops.experts_grouped`), and
    the dequantising route took the matmul route (3e-5 apart) until it took the same kernel (`experts_rows`)."""
    monkeypatch.setattr(mxfp4_matvec, "AVAILABLE", False)
    dense = from_pretrained(path, device="cpu", experts="dense")
    packed = from_pretrained(path, device="cpu", experts="packed", expert_cache_size=cache)
    tokens = [t % packed.config.vocab_size for t in TOKENS * 12]
    for chunk in (5, 64):
        got = kimi_forward_sequence(packed, KimiDecodeState.new(packed), tokens, chunk=chunk)
        np.testing.assert_array_equal(bits(got), bits(kimi_forward_sequence(dense, KimiDecodeState.new(dense), tokens,
                                                                             chunk=chunk)))


class RerouteTo:
    """Replaces one layer's top-k ids with fixed ones (a routing intervention)."""

    def __init__(self, name, ids):
        self.name, self.ids = name, np.array(ids)

    def fire(self, name, value):
        return self.ids if name == self.name else value


def test_packed_and_dense_agree_under_a_routing_intervention():
    kw = dict(device="cpu", layers=range(4))
    dense = from_pretrained(random_tiny_checkpoint(), experts="dense", **kw)
    packed = from_pretrained(random_tiny_checkpoint(), experts="packed", expert_cache_size=2, **kw)
    hook = RerouteTo("layers.2.moe.router.topk_ids", [9, 9, 1])
    np.testing.assert_array_equal(bits(decode(packed, hooks=hook)), bits(decode(dense, hooks=hook)))


def test_expert_modes_and_their_errors(tmp_path, monkeypatch):
    tiny = random_tiny_checkpoint()
    assert from_pretrained(tiny, device="cpu").extra["experts"] == "dense"  # auto: small enough
    monkeypatch.setattr(load_options, "AUTO_DENSE_BYTES", 0)
    w = from_pretrained(tiny, device="cpu", layers=[1, 2])
    assert w.extra["experts"] == "packed" and isinstance(w.layers[0].ffn.experts, PackedExperts)
    cfg = w.config
    assert w.extra["expert_cache_size"] == cfg.num_experts  # default: as many as fit in 512 MiB per layer
    assert load_options.resolve_cache_size(None, cfg, np.float64, np) == cfg.num_experts
    monkeypatch.setattr(load_options, "AUTO_CACHE_BYTES", 5 * 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size * 4)
    assert load_options.resolve_cache_size(None, cfg, np.float64, np) == 2  # float64 experts: twice the bytes
    # a cache that cannot hold the layer: fused on the CPU when the kernel is built, else as many as fit
    assert load_options.resolve_cache_size(None, cfg, np.float32, np) == (0 if mxfp4_matvec.AVAILABLE else 5)
    monkeypatch.setattr(mxfp4_matvec, "AVAILABLE", False)
    assert load_options.resolve_cache_size(None, cfg, np.float32, np) == 5
    with pytest.raises(ValueError, match="experts='packd'"):
        from_pretrained(tiny, device="cpu", experts="packd")
    with pytest.raises(ValueError, match="expert_cache_size=-2"):
        from_pretrained(tiny, device="cpu", experts="packed", expert_cache_size=-2)
    bf16 = write_checkpoint(tmp_path / "bf16-experts", experts="bf16", seed=3)
    with pytest.raises(CheckpointError, match="experts='packed' but layer 1's routed experts are not all MXFP4"):
        from_pretrained(bf16, device="cpu", experts="packed")
    dense = from_pretrained(bf16, device="cpu", layers=[1])  # auto falls back to dense
    assert isinstance(dense.layers[0].ffn.experts, DenseExperts)


def test_an_expert_cache_size_asks_for_packed_experts(tmp_path):
    """expert_cache_size sizes the packed experts' cache: with experts='dense' it is refused (it was ignored), and
    with 'auto' it chooses packed (auto chose dense for a small model, and the size was ignored)."""
    tiny = random_tiny_checkpoint()
    with pytest.raises(ValueError, match=r"expert_cache_size=2 sizes the cache of packed .* experts='dense' dequantises"):
        from_pretrained(tiny, device="cpu", experts="dense", expert_cache_size=2)
    w = from_pretrained(tiny, device="cpu", layers=[1], expert_cache_size=2)
    assert (w.extra["experts"], w.extra["expert_cache_size"]) == ("packed", 2)
    assert isinstance(w.layers[0].ffn.experts, PackedExperts) and w.layers[0].ffn.experts.capacity == 2
    bf16 = write_checkpoint(tmp_path / "bf16-experts", experts="bf16", seed=3)
    with pytest.raises(CheckpointError, match=r"experts='packed' \(expert_cache_size=0\) but layer 1's routed experts "
                                              r"are not all MXFP4 on disk; load with experts='dense' and no expert_cache_size"):
        from_pretrained(bf16, device="cpu", layers=[1], expert_cache_size=0)
