"""The two small eps constants, seen through the eps-sensitive reference set (tests/data/reference/eps_sensitive).

On the ordinary reference set a wrong eps moves the logits by ~5e-5, below any tolerance. This set
(the same tiny K3 shape; Moonshot's float32 reference outputs, see its README) has MLA `q_a_proj` /
`kv_a_proj_with_mqa` weights of std 4e-4 and KDA `q_proj` / `k_proj` of std 1e-4, so that:

- the MLA latent norms (`q_a_layernorm`, `kv_a_layernorm`: KimiRMSNorm's default eps 1e-6, NOT
  rms_norm_eps 1e-5) see a mean square of the order of their eps: 1e-5 there moves the logits by 1.7;
- the KDA l2norm of q and k (`x / sqrt(sum(x^2) + 1e-6)`) sees a sum of squares near 1e-6: 1e-5
  there moves the logits by 4.5.

The whole parity suite runs on this set too (test_reference_parity.py, the ids with `eps_sensitive`); the
two tests here name the constant a failure points to. The first MLA layer is layer 2, so every value
before it depends on the KDA eps and not on the MLA one.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REFERENCE_DIR
from naive_decoder import Collect, NaiveDecoder

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.model import kda, mla

EPS_SET = REFERENCE_DIR.parent / "eps_sensitive"


@pytest.fixture(scope="module")
def ref():
    with np.load(EPS_SET / "tiny_k3_expected.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module", params=["float32", "float64"])
def run(request, ref):
    w = from_pretrained(EPS_SET / "tiny_k3", device="cpu", dtype=request.param)
    state, hooks = KimiDecodeState.new(w), Collect()
    logits = np.stack([kimi_forward_token(w, state, int(t), hooks=hooks) for t in ref["tokens"]])
    return hooks, logits


def first_mla_layer(ref):
    return min(set(range(14)) - set(ref["kda_layers"].tolist()))


def test_eps_sensitive_kda_l2norm_eps(run, ref):
    """KDA alone: the layers before the first MLA layer (outputs, states, attn-res weights).
    A wrong l2norm eps of q/k (1e-5 for 1e-6) fails here."""
    hooks, _ = run
    first = first_mla_layer(ref)
    for n, i in enumerate(ref["kda_layers"][ref["kda_layers"] < first]):
        norms = np.sqrt((hooks.stacked(f"layers.{i}.kda.state") ** 2).sum(axis=(2, 3)))
        np.testing.assert_allclose(norms, ref["kda_state_norm_decode"][:, n], atol=1e-4, rtol=0)
    for i in range(first):
        np.testing.assert_allclose(hooks.stacked(f"layers.{i}.prefix_sum"), ref["layer_prefix_sum_decode"][i],
                                   atol=1e-3, rtol=1e-4)
        np.testing.assert_allclose(hooks.stacked(f"layers.{i}.attn_res.ffn.weights"),
                                   ref[f"attnres_L{i:02d}_mlp_decode"], atol=1e-4, rtol=0)


def test_eps_sensitive_mla_latent_norm_eps(run, ref):
    """From the first MLA layer on: every layer output, the logits and their argmax. With the KDA
    test passing, a failure here is an MLA layer: a wrong q_a/kv_a layernorm eps (1e-5 for 1e-6) fails here."""
    hooks, logits = run
    for i in range(first_mla_layer(ref), 14):
        np.testing.assert_allclose(hooks.stacked(f"layers.{i}.prefix_sum"), ref["layer_prefix_sum_decode"][i],
                                   atol=1e-3, rtol=1e-4, err_msg=f"layer {i}")
    np.testing.assert_allclose(logits, ref["logits_decode"], atol=1e-3, rtol=0)
    assert (logits.argmax(-1) == ref["logits_decode"].argmax(-1)).all()


@pytest.mark.parametrize("module, constant", [(mla, "LATENT_NORM_EPS"), (kda, "L2NORM_EPS")],
                         ids=["mla_latent_norm_eps", "kda_l2norm_eps"])
def test_eps_sensitive_set_sees_eps_times_ten(ref, monkeypatch, module, constant):
    """The set does what it is for: the naive float64 decoder with that eps x10 misses the
    reference logits by far more than the 1e-3 tolerance (the README: 1.7 and 4.5)."""
    monkeypatch.setattr(module, constant, 10 * getattr(module, constant))
    naive = NaiveDecoder(EPS_SET / "tiny_k3")
    logits = np.stack([naive.step(int(t))[0] for t in ref["tokens"]])
    assert np.abs(logits - ref["logits_decode"]).max() > 0.5
