"""llama.cpp's graph names -> kimi_explore hook names, checked against Moonshot's reference outputs.

The captures (tests/data/engines/d/llamacpp, llama.cpp's own K3 with F32 experts on set d) agree with
the reference to ~1e-4; if a name were mapped onto the wrong site, layer, firing (#0/#1) or axis
order, it would not.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kimi_explore import from_pretrained, hook_names
from kimi_explore.engines.name_maps import ggml_to_numpy, llamacpp_to_hooks, parse_llamacpp_name

ENGINES = Path(__file__).parent / "data" / "engines"


@pytest.fixture(scope="module")
def set_d():
    weights = from_pretrained(ENGINES / "d" / "tiny_k3", device="cpu")
    with np.load(ENGINES / "d" / "llamacpp" / "llamacpp_f32experts_decode.npz") as z:
        arrays = {k: z[k] for k in z.files}
    with np.load(ENGINES / "d" / "tiny_k3_expected.npz") as z:
        ref = {k: z[k] for k in z.files}
    return weights, arrays, ref


@pytest.mark.parametrize(("name", "parsed"), [("l_out-3", ("l_out", 3, None)), ("norm-12#1", ("norm", 12, 1)),
                                              ("result_norm", ("result_norm", None, None)), ("kda_g1-0", ("kda_g1", 0, None)),
                                              ("res_probs", ("res_probs", None, None))])
def test_parse_names(name, parsed):
    assert parse_llamacpp_name(name) == parsed


def test_parse_refuses_other_names():
    with pytest.raises(ValueError, match="'l_out-x'"):
        parse_llamacpp_name("l_out-x")


def test_ggml_axes_reversed():
    # ne = [3, 2]: ggml's fastest axis (3 values) is numpy's last
    a = ggml_to_numpy(np.arange(6, dtype=np.float32).tobytes(), [3, 2, 1, 1])
    assert a.shape == (2, 3)
    assert a[1, 0] == 3.0 and a[0, 2] == 2.0
    with pytest.raises(ValueError, match="ne=\\[4, 2\\]"):
        ggml_to_numpy(np.zeros(6, np.float32).tobytes(), [4, 2])


def test_names_are_hook_names_of_the_right_layers(set_d):
    weights, arrays, _ = set_d
    mapped = llamacpp_to_hooks(arrays, weights.config, weights)
    names = set(hook_names(weights))
    assert set(mapped) <= names
    # every KDA / MLA site llama.cpp names is found on every layer of that kind
    for i in range(weights.config.num_hidden_layers):
        kinds = ("kda.conv_out", "kda.v", "kda.beta", "kda.decay", "kda.gate", "kda.o") if weights.config.is_kda_layer(i) \
            else ("mla.q_latent", "mla.kv_latent", "mla.probs", "mla.o")
        for k in (*kinds, "attn.in", "attn.out", "ffn.in", "ffn.out", "prefix_sum"):
            assert f"layers.{i}.{k}" in mapped, f"layers.{i}.{k}"
    assert {f"layers.{i}.kda.state" for i in (0, 1)} <= set(mapped)  # the trimmed captures keep these two


def test_mapped_values_match_the_reference(set_d):
    weights, arrays, ref = set_d
    m = llamacpp_to_hooks(arrays, weights.config, weights)
    close = lambda a, b: np.testing.assert_allclose(a, b, atol=2e-3, rtol=0)  # noqa: E731
    close(m["logits"], ref["logits_decode"])
    close(m["final.hidden"], ref["hidden_final_decode"])
    close(m["final.attn_res.weights"], ref["attnres_output_decode"])
    for i in range(weights.config.num_hidden_layers):
        close(m[f"layers.{i}.prefix_sum"], ref["layer_prefix_sum_decode"][i])
        close(m[f"layers.{i}.attn_res.ffn.weights"], ref[f"attnres_L{i:02d}_mlp_decode"])
        if i:
            close(m[f"layers.{i}.attn_res.attn.weights"], ref[f"attnres_L{i:02d}_attn_decode"])
            close(m[f"layers.{i}.moe.router.scores"], ref[f"router_L{i:02d}_scores_decode"])
            ids = m[f"layers.{i}.moe.router.topk_ids"]
            assert [set(r) for r in ids] == [set(r) for r in ref[f"router_L{i:02d}_topk_idx_decode"]]
    # the KDA state: reference [H, V, K] (HF/fla), kimi_explore [H, K, V]; after the last token, layer 0
    close(m["layers.0.kda.state"][-1].swapaxes(-1, -2), ref["kda_state_final_decode"][0])


def test_prefill_layout_of_mla_records(set_d):
    weights, arrays, _ = set_d
    decode = llamacpp_to_hooks(arrays, weights.config, weights)
    prefill = dict(arrays)
    prefill["kqv_mla-2"] = arrays["kqv_mla-2"][:, :, 0, :].swapaxes(0, 1)  # prefill records are [H, T, n]
    np.testing.assert_array_equal(llamacpp_to_hooks(prefill, weights.config, weights)["layers.2.mla.o"], decode["layers.2.mla.o"])


def test_without_weights_the_mla_latents_are_left_out(set_d):
    weights, arrays, _ = set_d
    mapped = llamacpp_to_hooks(arrays, weights.config)
    assert "layers.2.mla.q_latent" not in mapped and "layers.2.mla.probs" in mapped


def test_missing_tokens_refused(set_d):
    weights, arrays, _ = set_d
    with pytest.raises(KeyError, match="tokens"):
        llamacpp_to_hooks({k: v for k, v in arrays.items() if k != "tokens"}, weights.config)



def test_a_record_without_one_row_per_token_is_refused(set_d):
    weights, arrays, _ = set_d
    bad = {"tokens": arrays["tokens"], "attn_norm-0": arrays["attn_norm-0"][:-1]}
    with pytest.raises(ValueError, match=r"'layers.0.attn.in' \(from 'attn_norm-0'\) has shape \(15, 64\), expected one "
                                         r"row per token \(16\)"):
        llamacpp_to_hooks(bad, weights.config, weights)
