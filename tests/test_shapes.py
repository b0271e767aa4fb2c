"""The decoder assumes nothing the released config does not: odd shapes against the naive float64 decoder."""

from __future__ import annotations

import numpy as np
import pytest
from naive_decoder import Collect, NaiveDecoder, assert_matches_naive

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.weights.safetensors_io import SafetensorsFile, write_safetensors
from kimi_explore.weights.tiny_model import make_text_config, write_checkpoint

VARIANTS = {
    # v_head_dim != qk_nope_head_dim, P != hidden, two dense layers, 6 experts top-3, scaling != 1, block size 5
    "odd-widths": dict(
        config=dict(hidden_size=64, num_hidden_layers=7, num_attention_heads=3, q_lora_rank=32, kv_lora_rank=32,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, intermediate_size=80,
                    first_k_dense_replace=2, num_experts=6, num_experts_per_token=3, routed_scaling_factor=2.5,
                    attn_res_block_size=5, routed_expert_hidden_size=32, moe_intermediate_size=64,
                    linear_attn_config=dict(num_heads=3, head_dim=32, short_conv_kernel_size=3, use_full_rank_gate=True,
                                            gate_lower_bound=-3.0, kda_layers=[1, 3, 4, 5], full_attn_layers=[2, 6, 7])),
        write=dict(shards=3, experts="mxfp4"),
    ),
    # no latent norm, no renormalisation, ungated MLA, MoE every other layer, bf16 experts, unprefixed single file
    "switches-off": dict(
        config=dict(hidden_size=32, num_hidden_layers=6, latent_moe_use_norm=False, moe_renormalize=False,
                    mla_use_output_gate=False, moe_layer_freq=2, routed_scaling_factor=0.7, attn_res_block_size=2,
                    num_experts=5, num_experts_per_token=2, tie_word_embeddings=True,
                    linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, use_full_rank_gate=True,
                                            gate_lower_bound=-5.0, kda_layers=[2, 3, 5], full_attn_layers=[1, 4, 6])),
        write=dict(shards=1, index=False, experts="bf16", prefix=""),
    ),
    # every layer a block boundary, top-k == all experts
    "block-size-1": dict(
        config=dict(hidden_size=32, num_hidden_layers=4, attn_res_block_size=1, num_experts=4, num_experts_per_token=4,
                    linear_attn_config=dict(num_heads=2, head_dim=32, short_conv_kernel_size=2, use_full_rank_gate=True,
                                            gate_lower_bound=-5.0, kda_layers=[1, 2, 3], full_attn_layers=[4])),
        write=dict(shards=2, experts="mxfp4"),
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    v = VARIANTS[request.param]
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), make_text_config(**v["config"]), seed=11, **v["write"])
    return path


def test_fast_path_matches_naive_float64_decoder(variant):
    """float64 vs the float64 naive decoder (which reads the files itself): every value to 1e-9; float32 to 1e-3."""
    w64 = from_pretrained(variant, device="cpu", dtype="float64")
    w32 = from_pretrained(variant, device="cpu", dtype="float32")
    naive = NaiveDecoder(variant)  # reads the files itself: a loader mistake is not shared
    s64, s32 = KimiDecodeState.new(w64), KimiDecodeState.new(w32)
    tokens = [5, 200, 17, 17, 99, 3, 250]
    hooks = Collect()
    got64 = np.stack([kimi_forward_token(w64, s64, t, hooks=hooks) for t in tokens])
    got32 = np.stack([kimi_forward_token(w32, s32, t) for t in tokens])
    steps = [naive.step(t) for t in tokens]
    assert_matches_naive(got64, hooks, steps, tol=1e-9)
    np.testing.assert_allclose(got32, np.stack([lg for lg, _ in steps]), rtol=0, atol=1e-3)


def test_loader_builds_the_naive_decoders_operands(variant):
    """Per module, at the operands the kernels take: every field the naive twins read, as the fast
    loader built it (float64) == as the naive decoder built it from the raw files, exactly. Names
    the layer and field of a loader mistake (rows of a fused projection swapped, A_log sliced wrong)."""
    fast = from_pretrained(variant, device="cpu", dtype="float64")
    naive = NaiveDecoder(variant)
    for mine, theirs in zip(naive.layers, fast.layers, strict=True):
        for part in ("attention", "ffn"):
            for field, want in vars(getattr(mine, part)).items():
                got = getattr(getattr(theirs, part), field)
                where = f"layer {mine.index} {part}.{field}"
                if field == "experts":
                    np.testing.assert_array_equal(got.w13, want.w13, err_msg=where + ".w13")
                    np.testing.assert_array_equal(got.w2, want.w2, err_msg=where + ".w2")
                elif isinstance(want, np.ndarray):
                    np.testing.assert_array_equal(got, want, err_msg=where)
                else:
                    assert got == want, where


def test_layer_subset_equals_a_model_with_only_those_layers(variant, tmp_path):
    """layers=range(n) on the full checkpoint == a checkpoint whose config has n layers."""
    import json

    full = from_pretrained(variant, device="cpu", dtype="float64")
    n = full.config.num_hidden_layers - 1
    cut = from_pretrained(variant, device="cpu", dtype="float64", layers=range(n))
    # the same files with the config cut to n layers
    cfg = json.loads((variant / "config.json").read_text())
    tc = cfg["text_config"]
    tc["num_hidden_layers"] = n
    la = tc["linear_attn_config"]
    la["kda_layers"] = [x for x in la["kda_layers"] if x <= n]
    la["full_attn_layers"] = [x for x in la["full_attn_layers"] if x <= n]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # and shards and an index without layer n's tensors (a config cut alone is refused: its weights would be
    # ignored; so is an index cut alone: the shards' own headers still hold them)
    cut_map = {}
    for f in variant.glob("*.safetensors"):
        shard = SafetensorsFile(f)
        kept = {k: np.array(shard.array(k)) for k in shard.keys() if f".layers.{n}." not in k}
        shard.close()
        write_safetensors(tmp_path / f.name, kept)
        cut_map.update(dict.fromkeys(kept, f.name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": cut_map}))
    small = from_pretrained(tmp_path, device="cpu", dtype="float64")
    sa, sb = KimiDecodeState.new(cut), KimiDecodeState.new(small)
    for t in [1, 2, 3, 4]:
        np.testing.assert_array_equal(kimi_forward_token(cut, sa, t), kimi_forward_token(small, sb, t))
