"""The decoder against what Moonshot's own reference code computed, on both reference sets.

- `ordinary`: tests/data/reference (the tiny K3 with its usual weight scales);
- `eps_sensitive`: the same shape with weights drawn so that the MLA latent norms' and the KDA
  l2norm's eps decide the logits (see its README, and test_eps_sensitive.py).

Against the float32 reference the tolerances are the reference README's (atol 1e-3 on logits,
hidden states and layer outputs, 1e-4 on attn-res and router weights, exact ids and argmax); the
level actually reached is asserted as well, against the reference's own float32 spread. Against
the float64 naive decoder (which reads the checkpoint itself) the float64 decode agrees to 1e-9.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REFERENCE_DIR, require_kernel
from naive_decoder import Collect, NaiveDecoder, assert_matches_naive

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.model.latent_moe import LatentMoeWeights

SETS = {"ordinary": REFERENCE_DIR.parent, "eps_sensitive": REFERENCE_DIR.parent / "eps_sensitive"}
# the level reached, as a multiple of the reference's own float32 spread (its decode vs its prefill)
SPREAD_FACTOR = 3


def decode(weights, tokens, hooks=None):
    state = KimiDecodeState.new(weights)
    return np.stack([kimi_forward_token(weights, state, int(t), hooks=hooks) for t in tokens]), state


def load_set(name):
    with np.load(SETS[name] / "tiny_k3_expected.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module", params=list(SETS))
def refset(request):
    return request.param, SETS[request.param] / "tiny_k3", load_set(request.param)


@pytest.fixture(scope="module", params=["float32", "float64", "float32-fused", "float32-mapped"])
def run(request, refset):
    name, path, ref = refset
    if request.param in ("float32-fused", "float32-mapped"):  # MXFP4 experts multiplied from their packed bytes
        require_kernel()  # (mxfp4_matvec), copied into RAM at load or read in place from the mapped shards
        experts = "packed" if request.param == "float32-fused" else "mapped"
        w = from_pretrained(path, device="cpu", experts=experts, expert_cache_size=0)
        assert all(layer.ffn.experts.uses_fused for layer in w.layers if isinstance(layer.ffn, LatentMoeWeights))
    else:
        w = from_pretrained(path, device="cpu", dtype=request.param)
    hooks = Collect()
    logits, _ = decode(w, ref["tokens"], hooks)
    return ref, hooks, logits


def test_logits_every_step(run):
    ref, _, logits = run
    np.testing.assert_allclose(logits, ref["logits_decode"], atol=1e-3, rtol=0)
    assert (logits.argmax(-1) == ref["logits_decode"].argmax(-1)).all()


@pytest.mark.parametrize("ours, theirs", [("logits", "logits"), ("final.hidden", "hidden_final")])
def test_within_the_references_own_float32_spread(run, ours, theirs):
    """The level reached, not only the README's 1e-3: within SPREAD_FACTOR x the largest difference
    between the reference's own two float32 evaluations of the same model (decode and prefill).
    Measured: float32 up to 1.5x, float64 up to 1.0x (the float64 error is the reference's own rounding)."""
    ref, hooks, logits = run
    got = logits if ours == "logits" else hooks.stacked(ours)
    spread = np.abs(ref[f"{theirs}_decode"] - ref[f"{theirs}_prefill"]).max()
    assert np.abs(got - ref[f"{theirs}_decode"]).max() <= SPREAD_FACTOR * spread


def test_hidden_states_and_layer_outputs(run):
    ref, hooks, _ = run
    np.testing.assert_allclose(hooks.stacked("final.hidden"), ref["hidden_final_decode"], atol=1e-3, rtol=0)
    layer_out = np.stack([hooks.stacked(f"layers.{i}.prefix_sum") for i in range(14)])
    np.testing.assert_allclose(layer_out, ref["layer_prefix_sum_decode"], atol=1e-3, rtol=1e-4)
    blocks = hooks.stacked("final.block_residual")
    np.testing.assert_allclose(blocks, ref["block_residual_final_decode"], atol=1e-3, rtol=1e-4)
    # the output mix, rebuilt from the stack, the last layer's output and the recorded weights
    sources = np.concatenate([blocks, layer_out[-1][:, None, :]], axis=1)
    prenorm = np.einsum("ts,tsd->td", hooks.stacked("final.attn_res.weights"), sources)
    np.testing.assert_allclose(prenorm, ref["hidden_prenorm_decode"], atol=1e-3, rtol=1e-4)


def test_block_residual_softmax_weights_every_site(run):
    ref, hooks, _ = run
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


def test_router_choices(run):
    ref, hooks, _ = run
    for i in ref["moe_layers"]:
        ids = hooks.stacked(f"layers.{i}.moe.router.topk_ids")
        np.testing.assert_array_equal(ids, ref[f"router_L{i:02d}_topk_idx_decode"])
        np.testing.assert_allclose(hooks.stacked(f"layers.{i}.moe.router.topk_weights"),
                                   ref[f"router_L{i:02d}_topk_w_decode"], atol=1e-4, rtol=0)
        np.testing.assert_allclose(hooks.stacked(f"layers.{i}.moe.router.scores"),
                                   ref[f"router_L{i:02d}_scores_decode"], atol=1e-4, rtol=0)


def test_kda_states(run):
    ref, hooks, _ = run
    kda = list(ref["kda_layers"])
    assert [int(n.split(".")[1]) for n in hooks.values if n.endswith(".kda.state")] == kda
    states = [hooks.stacked(f"layers.{i}.kda.state") for i in kda]  # [T, H, K, V] each
    norms = np.stack([np.sqrt((s**2).sum(axis=(2, 3))) for s in states], axis=1)
    np.testing.assert_allclose(norms, ref["kda_state_norm_decode"], atol=1e-4, rtol=0)
    for n, i in enumerate(kda):
        # ours is S_h[k, v]; the reference stores [head, V, K]
        np.testing.assert_allclose(states[n][-1].transpose(0, 2, 1), ref["kda_state_final_decode"][n], atol=1e-4, rtol=0)
        window = hooks.stacked(f"layers.{i}.kda.conv")[-1]  # [3, P, W]
        for c, stream in enumerate("qkv"):
            np.testing.assert_allclose(window[c], ref[f"kda_conv_{stream}_final_decode"][n], atol=1e-4, rtol=1e-5)


def test_prefill_reference_agrees_with_our_decode(run):
    """The reference's own parallel prefill (fla recurrent kernel, full causal MLA) matches our step-by-step decode."""
    ref, _, logits = run
    np.testing.assert_allclose(logits, ref["logits_prefill"], atol=1e-3, rtol=0)
    np.testing.assert_allclose(logits, ref["logits_mixed"], atol=1e-3, rtol=0)


def test_float64_matches_the_naive_float64_decoder(refset):
    """float64 against float64, so 1e-9 (measured ~1e-13), on every value the naive decoder records:
    logits, layer outputs, attn-res weights, router ids and weights, KDA states and windows."""
    _, path, ref = refset
    w = from_pretrained(path, device="cpu", dtype="float64")
    hooks = Collect()
    logits, _ = decode(w, ref["tokens"], hooks)
    naive = NaiveDecoder(path)
    assert_matches_naive(logits, hooks, [naive.step(int(t)) for t in ref["tokens"]], tol=1e-9)


@pytest.mark.parametrize("n", [4, 8])
def test_layer_subset_is_the_truncated_model(ref, n):
    w = from_pretrained(REFERENCE_DIR, device="cpu", layers=range(n))
    hooks = Collect()
    logits, _ = decode(w, ref["tokens"], hooks)
    np.testing.assert_allclose(logits, ref[f"logits_decode_trunc{n}"], atol=1e-3, rtol=0)
    assert (logits.argmax(-1) == ref[f"logits_decode_trunc{n}"].argmax(-1)).all()
    np.testing.assert_allclose(hooks.stacked("final.hidden"), ref[f"hidden_final_decode_trunc{n}"], atol=1e-3, rtol=0)
    np.testing.assert_allclose(hooks.stacked("final.attn_res.weights"), ref[f"attnres_output_decode_trunc{n}"], atol=1e-4)
