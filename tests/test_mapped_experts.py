"""experts="mapped": the routed experts read in place from the mapped shards, bit for bit what
experts="packed" computes with the same route (fused kernel, or dequantise + LRU cache)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from conftest import REFERENCE_DIR, require_kernel
from naive_decoder import Collect

from kimi_explore import CheckpointError, KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.model.latent_moe import LatentMoeWeights, expert_outputs
from kimi_explore.weights import mxfp4_matvec
from kimi_explore.weights.mapped_experts import ExpertViews, MappedExperts
from kimi_explore.weights.memory import MAPPED, memory_report
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

TOKENS = [1, 200, 33, 33, 90, 7, 254, 12, 0, 128]
PATHS = {"random_tiny": random_tiny_checkpoint(), "reference": REFERENCE_DIR}


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({4: np.uint32, 8: np.uint64, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


def banks(w):
    return [layer.ffn.experts for layer in w.layers if isinstance(layer.ffn, LatentMoeWeights)]


def decode(w, tokens):
    hooks, state = Collect(), KimiDecodeState.new(w)
    vocab = w.config.vocab_size
    logits = np.stack([np.array(kimi_forward_token(w, state, t % vocab, hooks=hooks)) for t in tokens])
    return logits, hooks


@pytest.mark.parametrize("path", list(PATHS.values()), ids=list(PATHS))
@pytest.mark.parametrize("route", ["fused", "dequantise", "lru"])
def test_mapped_is_packed_bit_for_bit(path, route):
    """Logits and every value the hooks see (router, states, layer outputs), bit for bit."""
    if route == "fused":
        require_kernel()
    cache = 3 if route == "lru" else 0
    kw = dict(device="cpu", expert_cache_size=cache)
    packed = from_pretrained(path, experts="packed", **kw)
    mapped = from_pretrained(path, experts="mapped", **kw)
    assert mapped.extra["experts"] == "mapped" and all(isinstance(b, MappedExperts) for b in banks(mapped))
    for a, b in zip(banks(packed), banks(mapped), strict=True):
        a.fused = b.fused = route == "fused"
        assert a.uses_fused == b.uses_fused == (route == "fused") and "mapped" in b.route
    (lp, hp), (lm, hm) = decode(packed, TOKENS), decode(mapped, TOKENS)
    np.testing.assert_array_equal(bits(lm), bits(lp))
    assert hm.values.keys() == hp.values.keys()
    for name, values in hp.values.items():
        assert len(hm.values[name]) == len(values)
        for t, (a, b) in enumerate(zip(hm.values[name], values, strict=True)):
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{name} at token {t}")
    if route == "lru":
        assert [b.stats.hits for b in banks(mapped)] == [b.stats.hits for b in banks(packed)]


def test_nothing_is_copied_and_the_report_says_mapped():
    packed = from_pretrained(random_tiny_checkpoint(), device="cpu", experts="packed")
    mapped = from_pretrained(random_tiny_checkpoint(), device="cpu", experts="mapped")
    for bank in banks(mapped):
        for views in (bank.w13_packed, bank.w13_scale, bank.w2_packed, bank.w2_scale):
            for block in (b for expert in views.blocks for b in expert):
                assert not block.flags.writeable and not block.flags.owndata and isinstance(block.base, np.memmap)
    p, m = memory_report(packed), memory_report(mapped)
    want = sum(b.packed_bytes for b in banks(packed))
    assert want > 0 and m.mapped == {MAPPED: want} and p.mapped == {}
    assert m["routed experts, MXFP4 packed"] == 0 and m.total == p.total - want == sum(m.values())
    assert m.mapped_total == want and f"{want:,}" in str(m) and "not resident" in str(m)


def test_truncated_shard_is_refused_at_plan_time(tmp_path):
    ckpt = tmp_path / "tiny"
    shutil.copytree(random_tiny_checkpoint(), ckpt)
    shard = sorted(ckpt.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=f"{shard.name}: truncated: tensor '.*' ends at byte"):
        from_pretrained(ckpt, device="cpu", experts="mapped")


def test_mapped_needs_mxfp4_on_disk(tmp_path):
    from kimi_explore.weights.tiny_model import write_checkpoint

    dense = write_checkpoint(tmp_path / "bf16-experts", experts="bf16", seed=3)  # dense experts on disk
    with pytest.raises(CheckpointError, match="experts='mapped' but layer 1's routed experts are not all MXFP4"):
        from_pretrained(dense, device="cpu", experts="mapped")


def test_device_route_copies_only_the_selected_experts(monkeypatch):
    """As a GPU runs it (one gather of the selected experts, then batched matmuls), with NumPy."""
    w = from_pretrained(random_tiny_checkpoint(), device="cpu", experts="mapped", expert_cache_size=2)
    p = from_pretrained(random_tiny_checkpoint(), device="cpu", experts="packed", expert_cache_size=2)
    bank, ref = banks(w)[0], banks(p)[0]
    monkeypatch.setattr(MappedExperts, "_multiply_in_place", lambda self, xp: False)
    monkeypatch.setattr(type(ref), "_multiply_in_place", lambda self, xp: False)
    copied = []
    real = ExpertViews.__getitem__
    monkeypatch.setattr(ExpertViews, "__getitem__", lambda self, ids: copied.append(len(ids)) or real(self, ids))
    rng = np.random.default_rng(0)
    act = lambda h: np.tanh(h[:, : h.shape[1] // 2]) * h[:, h.shape[1] // 2 :]  # noqa: E731
    for ids in ([1, 4, 0], [4, 1, 5], [5, 4]):
        z = rng.standard_normal(bank.shape13[1]).astype(np.float32)
        np.testing.assert_array_equal(bits(expert_outputs(bank, ids, z, act)), bits(expert_outputs(ref, ids, z, act)))
    # each call copies its misses once per view (4 views); capacity 2 keeps [4, 0], then [1, 5]
    assert copied == [3] * 4 + [2] * 4 + [1] * 4  # misses [1, 4, 0], then [1, 5] (4 hit), then [4] (5 hit)
    with pytest.raises(IndexError, match=r"expert ids \[-1\] outside 0..15"):
        bank.w13_packed[[-1]]


def test_parts_matvec_is_expert_matvec_on_the_same_bytes():
    """Every kernel, split row blocks vs one bank: bit for bit; the C side checks every block's size."""
    require_kernel()
    rng = np.random.default_rng(0)
    E, I, C = 4, 40, 96
    packed = rng.integers(0, 256, (E, 2 * I, C // 2), dtype=np.uint8)
    scale = rng.integers(110, 140, (E, 2 * I, C // 32), dtype=np.uint8)
    ids = [3, 0, 3, 2]
    blocks = lambda a: [[a[e, :I], a[e, I:]] for e in ids]  # noqa: E731  (w1 rows, then w3 rows)
    for isa in mxfp4_matvec.isas():
        for x in (rng.standard_normal(C).astype(np.float32), rng.standard_normal((4, C)).astype(np.float32)):
            want = mxfp4_matvec.expert_matvec(packed, scale, ids, x, isa=isa)
            got = mxfp4_matvec.parts_matvec(blocks(packed), blocks(scale), (I, I), x, isa=isa, threads=3)
            np.testing.assert_array_equal(bits(got), bits(want))
    x = np.ones(C, np.float32)
    bad = blocks(scale)
    bad[1][1] = scale[0, :I - 1]
    with pytest.raises(ValueError, match=r"scale block 1 of expert 1: 117 bytes, expected 120 \(\[40, 3\] uint8\)"):
        mxfp4_matvec.parts_matvec(blocks(packed), bad, (I, I), x)
    strided = blocks(packed)
    strided[0][0] = packed[0, :2 * I : 2]
    with pytest.raises((ValueError, BufferError), match="contiguous"):
        mxfp4_matvec.parts_matvec(strided, blocks(scale), (I, I), x)
    with pytest.raises(ValueError, match="as many experts"):
        mxfp4_matvec.parts_matvec(blocks(packed), blocks(scale)[:2], (I, I), x)
    with pytest.raises(ValueError, match="rows: expected 1..8 row blocks"):
        mxfp4_matvec._ext.parts_matvec([], [], [], np.zeros((1, 2, 48), np.float32), np.zeros(4, np.float32), 48, 0, 1, "")
