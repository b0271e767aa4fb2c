"""Resident forms of the weights: bf16 bits widened per use (exact), the streaming reader, memory_report."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from conftest import REFERENCE_DIR

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.model.latent_moe import LatentMoeWeights
from kimi_explore.weights import tensor_reader
from kimi_explore.weights.bf16_weights import Bf16Matrix, WideningScratch, widen_bits
from kimi_explore.weights.experts import PackedExperts
from kimi_explore.weights.memory import layer_bytes, memory_report
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

TOKENS = [1, 200, 33, 33, 90, 7, 254, 12]


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def decode(w, tokens=TOKENS):
    state = KimiDecodeState.new(w)
    return np.stack([np.array(kimi_forward_token(w, state, t)) for t in tokens])


def test_bf16_matrix_behaves_like_its_float32_matrix():
    """The widening route (kernel=False): bit for bit the float32 matrix (the kernel: test_bf16_matvec)."""
    rng = np.random.default_rng(0)
    W = rng.standard_normal((777, 300)).astype(ml_dtypes.bfloat16)
    W32 = W.astype(np.float32)
    scratch = WideningScratch(np)
    M = Bf16Matrix(W.view(np.uint16), scratch, kernel=False)
    small = Bf16Matrix(W[:5, :7].copy().view(np.uint16), scratch, kernel=False)
    x = rng.standard_normal(300).astype(np.float32)
    assert M.shape == (777, 300) and M.nbytes == 777 * 300 * 2
    np.testing.assert_array_equal(bits(M @ x), bits(W32 @ x))
    small @ x[:7]  # a smaller matrix in the same scratch leaves no stale low halves behind
    np.testing.assert_array_equal(bits(M @ x), bits(W32 @ x))
    np.testing.assert_array_equal(bits(M[42]), bits(W32[42]))
    np.testing.assert_array_equal(bits(M[[3, 1]]), bits(W32[[3, 1]]))
    np.testing.assert_array_equal(np.asarray(M), W32)
    np.testing.assert_array_equal(np.asarray(M, dtype=np.float64), W32.astype(np.float64))
    assert scratch.nbytes == 777 * 300 * 4
    M64 = Bf16Matrix(W.view(np.uint16), scratch, np.float64)
    np.testing.assert_array_equal(M64 @ x.astype(np.float64), W32.astype(np.float64) @ x.astype(np.float64))
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -3.5, 65504.0], ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bits(widen_bits(special.view(np.uint16))), bits(special.astype(np.float32)))
    with pytest.raises(TypeError, match=r"expected uint16 \[rows, cols\]"):
        Bf16Matrix(W32, scratch)


@pytest.mark.parametrize("path", [random_tiny_checkpoint(), REFERENCE_DIR], ids=["random_tiny", "reference"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bf16_resident_logits_bit_identical(path, dtype):
    f = from_pretrained(path, device="cpu", dtype=dtype)
    b = from_pretrained(path, device="cpu", dtype=dtype, weight_dtype="bfloat16", bf16_matvec="widen")
    assert isinstance(b.lm_head, Bf16Matrix) and isinstance(b.layers[0].attention.in_proj, Bf16Matrix)
    assert b.extra["weight_dtype"] == "bfloat16" and f.extra["weight_dtype"] == dtype and b.extra["bf16_matvec"] == "widen"
    tokens = [t % f.config.vocab_size for t in TOKENS]
    np.testing.assert_array_equal(bits(decode(b, tokens)), bits(decode(f, tokens)))


def test_weight_dtype_errors():
    with pytest.raises(ValueError, match=r"weight_dtype='float16': expected None \(= dtype, 'float32'\) or 'bfloat16'"):
        from_pretrained(random_tiny_checkpoint(), device="cpu", weight_dtype="float16")


def test_streaming_reader_through_a_tiny_bounce_buffer(monkeypatch):
    """Widening in many small chunks (1000 bytes) gives the same weights as in one."""
    ref = from_pretrained(random_tiny_checkpoint(), device="cpu", layers=[0, 3])
    monkeypatch.setattr(tensor_reader, "BOUNCE_BYTES", 1000)
    w = from_pretrained(random_tiny_checkpoint(), device="cpu", layers=[0, 3])
    np.testing.assert_array_equal(w.embed_tokens, ref.embed_tokens)
    np.testing.assert_array_equal(w.layers[0].attention.in_proj, ref.layers[0].attention.in_proj)
    np.testing.assert_array_equal(bits(decode(w)), bits(decode(ref)))


def expected_bytes(cfg, layer_ids, itemsize: int) -> dict:
    """Resident bytes per component, from the config alone (float matrices at `itemsize`)."""
    d, V, la = cfg.hidden_size, cfg.vocab_size, cfg.linear_attn_config
    H, K, W, P = la.num_heads, la.head_dim, la.short_conv_kernel_size, la.num_heads * la.head_dim
    nh, dq, dv, ql, kl = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
    E, l, I, Ish = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    kda = ((4 * P + H + K) * d + P * K + d * P) * itemsize + (3 * P * W + H + P + K) * 4  # conv/A/dt_bias/o_norm in f32
    mla = (ql + kl + cfg.qk_rope_head_dim + nh * dv) * d + nh * dq * ql + nh * (cfg.qk_nope_head_dim + dv) * kl + d * nh * dv
    mla *= itemsize
    mla += (ql + kl) * 4
    moe_trunk = ((E + l + 2 * Ish) * d + d * l + d * Ish) * itemsize + (E + l) * 4
    out = {"embed_tokens": V * d * itemsize, "lm_head": V * d * itemsize, "attention (KDA)": 0, "attention (MLA)": 0,
           "dense MLP": 0, "MoE router + latent projections + shared experts": 0, "layer norms + attn-res scores": 0,
           "routed experts, MXFP4 packed": 0}
    for i in layer_ids:
        out["layer norms + attn-res scores"] += 4 * d * 4
        out["attention (KDA)" if cfg.is_kda_layer(i) else "attention (MLA)"] += kda if cfg.is_kda_layer(i) else mla
        if cfg.is_moe_layer(i):
            out["MoE router + latent projections + shared experts"] += moe_trunk
            out["routed experts, MXFP4 packed"] += E * (2 * I * (l // 2 + l // 32) + l * (I // 2 + I // 32))
        else:
            out["dense MLP"] += 3 * cfg.intermediate_size * d * itemsize
    return out


@pytest.mark.parametrize("weight_dtype,itemsize", [(None, 4), ("bfloat16", 2)], ids=["float32", "bf16"])
def test_memory_report_counts_what_is_resident(weight_dtype, itemsize):
    w = from_pretrained(random_tiny_checkpoint(), device="cpu", experts="packed", expert_cache_size=3,
                                           weight_dtype=weight_dtype, bf16_matvec="widen" if weight_dtype else "auto")
    report = memory_report(w)
    for key, value in expected_bytes(w.config, w.layer_ids, itemsize).items():
        assert report[key] == value, key
    assert report["final norm + output mix"] == 2 * w.config.hidden_size * 4
    assert report["routed experts, dequantised (dense bank)"] == 0
    assert report["routed experts, dequantised (LRU caches)"] == 0  # nothing decoded yet
    assert report.total == sum(report.values())
    matrices = [w.lm_head] + [getattr(part, f.name) for layer in w.layers for part in (layer.attention, layer.ffn)
                              for f in dataclasses.fields(part)]
    matrices = [m for m in matrices if isinstance(m, Bf16Matrix)]
    assert len(matrices) == (1 + 3 * 11 + 4 * 5 + 2 + 3 * 15 if weight_dtype else 0)  # lm_head, KDA, MLA, dense, MoE
    largest = max((m.bits.size for m in matrices), default=0)  # the embedding is read by rows: not in the scratch
    assert report["bf16 widening scratch"] == 4 * largest
    decode(w, TOKENS[:3])
    banks = [layer.ffn.experts for layer in w.layers if isinstance(layer.ffn, LatentMoeWeights)]
    assert all(isinstance(b, PackedExperts) and len(b.cached_ids()) == 3 for b in banks)  # top-4 > 3: full
    after = memory_report(w)
    assert after["routed experts, dequantised (LRU caches)"] == len(banks) * 3 * banks[0].expert_bytes
    table = str(after)
    assert "routed experts, MXFP4 packed" in table and f"{after.total:,}" in table and "total (cpu)" in table


@pytest.mark.parametrize("weight_dtype,itemsize", [(None, 4), ("bfloat16", 2)], ids=["float32", "bf16"])
def test_layer_bytes_splits_each_layer_into_the_halves_a_token_reads(weight_dtype, itemsize):
    """bench/k3_shapes.py's bytes per token: each half's norm and attn-res score (float32 [d] each) and its
    attention or FFN trunk, from the config alone; the routed experts are not in either half."""
    w = from_pretrained(random_tiny_checkpoint(), device="cpu", experts="packed", weight_dtype=weight_dtype,
                        bf16_matvec="widen" if weight_dtype else "auto")
    vectors = 2 * w.config.hidden_size * 4
    for layer in w.layers:
        e = expected_bytes(w.config, [layer.index], itemsize)
        assert layer_bytes(layer) == {
            "attention": vectors + e["attention (KDA)"] + e["attention (MLA)"],
            "ffn trunk": vectors + e["dense MLP"] + e["MoE router + latent projections + shared experts"]}, layer.index


def test_memory_report_dense_experts():
    w = from_pretrained(random_tiny_checkpoint(), device="cpu", experts="dense")
    cfg = w.config
    n_moe = sum(cfg.is_moe_layer(i) for i in w.layer_ids)
    report = memory_report(w)
    assert report["routed experts, dequantised (dense bank)"] == n_moe * cfg.num_experts * 3 * cfg.moe_intermediate_size \
        * cfg.routed_expert_hidden_size * 4
    assert report["routed experts, MXFP4 packed"] == 0 and report["bf16 widening scratch"] == 0


def test_session_fingerprint_sees_the_same_weights_whatever_their_resident_form():
    """bf16 bits widen to the float32 values, and a packed bank's cache state is not part of the weights."""
    from kimi_explore.inspection.session_io import weights_fingerprint

    path = random_tiny_checkpoint()
    f32 = from_pretrained(path, device="cpu", experts="packed", expert_cache_size=2)
    bf16 = from_pretrained(path, device="cpu", experts="packed", weight_dtype="bfloat16")
    before = weights_fingerprint(f32)
    assert weights_fingerprint(bf16) == before
    decode(f32, TOKENS[:3])  # fills the expert caches
    assert weights_fingerprint(f32) == before


def test_float64_bf16_weights_reserve_no_float32_scratch():
    """In float64 a bf16 matrix widens afresh (never into the float32 scratch), yet the scratch was reserved and
    counted: at K3 an lm_head-sized 4.7 GB the report called resident and nothing ever used."""
    w = from_pretrained(random_tiny_checkpoint(), device="cpu", dtype="float64", weight_dtype="bfloat16", layers=[1, 2])
    decode(w, TOKENS[:3])
    assert memory_report(w)["bf16 widening scratch"] == 0
