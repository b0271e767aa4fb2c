"""Configurations a K3 variant may have that ran wrongly or not at all (found by fuzzing the config space)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.weights.tiny_model import make_text_config, write_checkpoint

ATTN = dict(num_heads=4, head_dim=32, short_conv_kernel_size=4, use_full_rank_gate=True, gate_lower_bound=-5.0,
            kda_layers=[1], full_attn_layers=[2])


def _routing(path, token=65):
    w = ke.from_pretrained(path, dtype="float64")
    seen, hooks = {}, ke.Hooks()
    for name in ("layers.1.moe.router.scores", "layers.1.moe.router.topk_ids", "layers.1.moe.router.topk_weights"):
        hooks.add(name, lambda v, name=name, **_: seen.setdefault(name, np.array(v)))
    return w.forward_token(w.new_state(), token, hooks=hooks), seen


def test_top_1_is_not_renormalised(tmp_path):
    """The release renormalises only when top_k > 1 ("if self.top_k > 1 and self.moe_renormalize"): with one expert the
    weight was s / (s + 1e-20) = 1 instead of the score s, logits off by 1.2 (no latent norm to cancel the factor);
    the naive twin shared the mistake."""
    cfg = make_text_config(num_hidden_layers=2, num_experts=8, num_experts_per_token=1, moe_renormalize=True,
                           latent_moe_use_norm=False, routed_scaling_factor=2.5, linear_attn_config=ATTN)
    on = write_checkpoint(tmp_path / "on", cfg, seed=0)
    off = tmp_path / "off"
    shutil.copytree(on, off)
    meta = json.loads((off / "config.json").read_text())
    meta["text_config"]["moe_renormalize"] = False
    (off / "config.json").write_text(json.dumps(meta))
    logits_on, seen = _routing(on)
    logits_off, _ = _routing(off)
    (e,) = seen["layers.1.moe.router.topk_ids"]
    assert seen["layers.1.moe.router.topk_weights"][0] == pytest.approx(2.5 * seen["layers.1.moe.router.scores"][e])
    np.testing.assert_array_equal(logits_on, logits_off)  # one model, whatever the flag says


def test_no_shared_experts_with_bf16_weights(tmp_path):
    """num_shared_experts=0 leaves a [d, 0] shared down projection: the bf16 kernel refused it ("R and C must be > 0")
    on the first token, where the float32 weights gave the (zero) shared output."""
    path = write_checkpoint(tmp_path / "m", make_text_config(num_hidden_layers=2, num_shared_experts=0,
                                                              linear_attn_config=ATTN), seed=0)
    ids = [1, 2, 3, 4]
    widen = ke.from_pretrained(path, weight_dtype="bfloat16", bf16_matvec="widen")
    want = np.stack([widen.forward_token(s, t) for s in [widen.new_state()] for t in ids])
    kernel = ke.from_pretrained(path, weight_dtype="bfloat16")
    got = np.stack([kernel.forward_token(s, t) for s in [kernel.new_state()] for t in ids])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(kernel.forward_sequence(kernel.new_state(), ids), want, rtol=0, atol=1e-4)


def test_the_writer_takes_more_kda_heads_than_their_width_and_names_mxfp4_widths(tmp_path):
    """H > K: A_log's padding init broadcast [H] into [K] and failed; an MXFP4 expert width off the 32-grid failed in a
    reshape naming nothing; a tied config's shell said tie_word_embeddings false."""
    attn = {**ATTN, "num_heads": 6, "head_dim": 4}
    w = ke.from_pretrained(write_checkpoint(tmp_path / "h", make_text_config(num_hidden_layers=2, linear_attn_config=attn)))
    assert np.isfinite(w.forward_sequence(w.new_state(), [1, 2, 3])).all()
    with pytest.raises(ValueError, match=r"experts\.0\..*\[.*48\]: MXFP4 experts need rows that are a multiple of 32"):
        write_checkpoint(tmp_path / "x", make_text_config(num_hidden_layers=2, routed_expert_hidden_size=48,
                                                          linear_attn_config=ATTN))
    tied = write_checkpoint(tmp_path / "t", make_text_config(num_hidden_layers=2, tie_word_embeddings=True,
                                                             linear_attn_config=ATTN))
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"] is True


def test_routing_stats_on_a_model_without_moe_layers_says_so(tmp_path):
    """It failed in the Recorder's pattern check ("glob 'layers.*.moe.router.topk_*' matches none")."""
    path = write_checkpoint(tmp_path / "d", make_text_config(num_hidden_layers=2, first_k_dense_replace=2,
                                                              linear_attn_config=ATTN))
    with pytest.raises(ValueError, match=r"none of the loaded layers \[0, 1\] is a MoE layer"):
        ke.routing_stats(ke.from_pretrained(path), ["abc"], progress=False)
    layer0 = ke.from_pretrained(ke.tiny_checkpoint(), layers=[0])  # the embedded model's layer 0 is dense
    with pytest.raises(ValueError, match=r"none of the loaded layers \[0\] is a MoE layer"):
        ke.routing_stats(layer0, ["abc"], progress=False)
