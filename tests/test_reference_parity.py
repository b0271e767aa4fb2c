"""The decoder against what Moonshot's own reference code computed on the tiny reference checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REFERENCE_DIR, require_kernel

from kimi_explore import KimiDecoderWeights, KimiDecodeState, kimi_forward_token
from kimi_explore.model.kda import KdaWeights
from kimi_explore.model.latent_moe import LatentMoeWeights


class Collect:
    """A minimal hook object: keeps a copy of every value it sees, changes nothing."""

    def __init__(self):
        self.values: dict[str, list] = {}

    def fire(self, name, value):
        self.values.setdefault(name, []).append(np.array(value, copy=True))
        return value

    def stacked(self, name):
        return np.stack(self.values[name])


def decode(weights, tokens, hooks=None):
    state = KimiDecodeState.new(weights)
    return np.stack([kimi_forward_token(weights, state, int(t), hooks=hooks) for t in tokens]), state


@pytest.fixture(scope="module", params=["float32", "float64", "float32-fused"])
def run(request, ref):
    if request.param == "float32-fused":  # MXFP4 experts multiplied from their packed bytes (mxfp4_matvec)
        require_kernel()
        w = KimiDecoderWeights.from_pretrained(REFERENCE_DIR, device="cpu", experts="packed", expert_cache_size=0)
        assert all(layer.ffn.experts.uses_fused for layer in w.layers if isinstance(layer.ffn, LatentMoeWeights))
    else:
        w = KimiDecoderWeights.from_pretrained(REFERENCE_DIR, device="cpu", dtype=request.param)
    hooks = Collect()
    logits, state = decode(w, ref["tokens"], hooks)
    return w, hooks, logits, state


def test_logits_every_step(run, ref):
    _, _, logits, _ = run
    np.testing.assert_allclose(logits, ref["logits_decode"], atol=1e-3, rtol=0)
    assert (logits.argmax(-1) == ref["logits_decode"].argmax(-1)).all()


def test_hidden_states_and_layer_outputs(run, ref):
    w, hooks, _, _ = run
    np.testing.assert_allclose(hooks.stacked("final.hidden"), ref["hidden_final_decode"], atol=1e-3, rtol=0)
    layer_out = np.stack([hooks.stacked(f"layers.{i}.prefix_sum") for i in range(14)])
    np.testing.assert_allclose(layer_out, ref["layer_prefix_sum_decode"], atol=1e-3, rtol=1e-4)
    blocks = hooks.stacked("final.block_residual")
    np.testing.assert_allclose(blocks, ref["block_residual_final_decode"], atol=1e-3, rtol=1e-4)
    # the output mix, rebuilt from the stack, the last layer's output and the recorded weights
    sources = np.concatenate([blocks, layer_out[-1][:, None, :]], axis=1)
    prenorm = np.einsum("ts,tsd->td", hooks.stacked("final.attn_res.weights"), sources)
    np.testing.assert_allclose(prenorm, ref["hidden_prenorm_decode"], atol=1e-3, rtol=1e-4)


def test_block_residual_softmax_weights_every_site(run, ref):
    _, hooks, _, _ = run
    checked = 0
    for i in range(14):
        for site, ours in (("attn", "attn"), ("mlp", "ffn")):
            key = f"attnres_L{i:02d}_{site}_decode"
            if key not in ref:
                assert f"layers.{i}.attn_res.{ours}.weights" not in hooks.values
                continue
            np.testing.assert_allclose(hooks.stacked(f"layers.{i}.attn_res.{ours}.weights"), ref[key], atol=1e-4, rtol=0)
            checked += 1
    np.testing.assert_allclose(hooks.stacked("final.attn_res.weights"), ref["attnres_output_decode"], atol=1e-4, rtol=0)
    assert checked == 27  # 14 ffn sites + 13 attention sites (none at layer 0)


def test_router_choices(run, ref):
    _, hooks, _, _ = run
    for i in ref["moe_layers"]:
        ids = hooks.stacked(f"layers.{i}.moe.router.topk_ids")
        np.testing.assert_array_equal(ids, ref[f"router_L{i:02d}_topk_idx_decode"])
        np.testing.assert_allclose(hooks.stacked(f"layers.{i}.moe.router.topk_weights"),
                                   ref[f"router_L{i:02d}_topk_w_decode"], atol=1e-4, rtol=0)
        np.testing.assert_allclose(hooks.stacked(f"layers.{i}.moe.router.scores"),
                                   ref[f"router_L{i:02d}_scores_decode"], atol=1e-4, rtol=0)


def test_kda_states(run, ref):
    w, hooks, _, state = run
    kda = [j for j, layer in enumerate(w.layers) if isinstance(layer.attention, KdaWeights)]
    assert [w.layers[j].index for j in kda] == list(ref["kda_layers"])
    states = [hooks.stacked(f"layers.{w.layers[j].index}.kda.state") for j in kda]  # [T, H, K, V] each
    norms = np.stack([np.sqrt((s**2).sum(axis=(2, 3))) for s in states], axis=1)
    np.testing.assert_allclose(norms, ref["kda_state_norm_decode"], atol=1e-4, rtol=0)
    for n, j in enumerate(kda):
        s = state.layers[j].attention
        # ours is S_h[k, v]; the reference stores [head, V, K]
        np.testing.assert_allclose(s.recurrent.transpose(0, 2, 1), ref["kda_state_final_decode"][n], atol=1e-4, rtol=0)
        for c, stream in enumerate("qkv"):
            np.testing.assert_allclose(s.conv[c], ref[f"kda_conv_{stream}_final_decode"][n], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("n", [4, 8])
def test_layer_subset_is_the_truncated_model(ref, n):
    w = KimiDecoderWeights.from_pretrained(REFERENCE_DIR, device="cpu", layers=range(n))
    hooks = Collect()
    logits, _ = decode(w, ref["tokens"], hooks)
    np.testing.assert_allclose(logits, ref[f"logits_decode_trunc{n}"], atol=1e-3, rtol=0)
    assert (logits.argmax(-1) == ref[f"logits_decode_trunc{n}"].argmax(-1)).all()
    np.testing.assert_allclose(hooks.stacked("final.hidden"), ref[f"hidden_final_decode_trunc{n}"], atol=1e-3, rtol=0)
    np.testing.assert_allclose(hooks.stacked("final.attn_res.weights"), ref[f"attnres_output_decode_trunc{n}"], atol=1e-4)


def test_prefill_reference_agrees_with_our_decode(run, ref):
    """The reference's own parallel prefill (fla recurrent kernel, full causal MLA) matches our step-by-step decode."""
    _, _, logits, _ = run
    np.testing.assert_allclose(logits, ref["logits_prefill"], atol=1e-3, rtol=0)
    np.testing.assert_allclose(logits, ref["logits_mixed"], atol=1e-3, rtol=0)
