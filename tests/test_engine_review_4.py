"""Fourth review of the engine tools: each test is a problem a read-only probe found.

1. A bug too small to cross rtol where it happens (a gate 1e-3 off) crossed it layers later, where the first
   divergence was "inherited" and no site was local: nothing pointed upstream. `Comparison.suspects` judges each
   site's own operation (teacher-forced) against one operation's rounding.
2. NaN in llama.cpp's masked attention slots was read as 0 (the forgiveness meant for a Trace's NaN padding).
3. llama.cpp captures: a renamed or unknown name was dropped in silence; float expert ids were truncated to
   ints before the check; errors named the hook site, never the capture's own name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_engine_review_3 import _Edit, _engine

import kimi_explore as ke
from kimi_explore.engines.tolerance import TOLERANCE_PRESETS, Tolerance

ENGINES = Path(__file__).parent / "data" / "engines"
TOKENS = [3, 17, 200, 45, 9, 9, 128, 77]
D_DECODE = ENGINES / "d" / "llamacpp" / "llamacpp_f32experts_decode.npz"


@pytest.fixture(scope="module")
def tiny():
    return ke.from_pretrained(ke.tiny_checkpoint(), device="cpu")


@pytest.fixture(scope="module")
def set_d():
    return ke.from_pretrained(ENGINES / "d" / "tiny_k3", device="cpu")


def _captures():
    with np.load(D_DECODE) as z:
        return {k: z[k].copy() for k in z.files}


# ---------------------------------------------------------------- 1. suspects


@pytest.mark.parametrize("site, token", [("layers.1.kda.beta", 0), ("layers.5.kda.decay", 2), ("layers.3.mla.q_latent", 4)])
def test_a_fault_below_rtol_is_the_earliest_suspect(tiny, site, token):
    """x (1 + 1e-3) at one site and token, carried on downstream: the site itself is within rtol (2e-3), so the
    comparison's first divergence, where there is one, is inherited; the planted site is the earliest suspect (its
    own operation on the engine's inputs is 1e-3 off, every other site's ~1e-6), and the summary says so."""
    other = _engine(tiny, TOKENS, _Edit(site, token, lambda v: v * np.float32(1 + 1e-3)))
    cmp = ke.compare(ke.Session(tiny), other, probes=False)
    assert cmp.local_sites == []
    (suspect,) = cmp.suspects
    assert (suspect.site, suspect.token, suspect.diverges) == (site, token, False)
    assert suspect.local_rel == pytest.approx(1e-3, rel=0.05)
    assert "within tolerance, its own operation 0.001 off on the other engine's inputs" in str(suspect)
    assert f"earliest suspect: token {token}, layer {suspect.layer}, {site}" in repr(cmp)
    row = next(r for r in cmp.table() if r["site"] == site)
    assert row["suspect_token"] == token and row["first_token"] is None


def test_llamacpps_own_engine_leaves_no_suspect_and_set_e_suspects_its_local_sites():
    """Set d with float32 experts: every operation within 1.4e-5 of llama.cpp's (float32 rounding; the suspects' bar
    is 1e-4). Set e (llama.cpp's eps 1e-5 at the q/k L2 and MLA latent norms): the suspects are its local sites."""
    d = ke.compare(ke.Session(ke.from_pretrained(ENGINES / "d" / "tiny_k3")), D_DECODE, names="llama.cpp", probes=False)
    assert d.first is None and d.suspects == []
    assert max(float(np.max(s.local_rel)) for s in d.sites.values()) < TOLERANCE_PRESETS["float32"].local_rtol / 5
    e = ke.compare(ke.Session(ke.from_pretrained(ENGINES / "e" / "tiny_k3")),
                   ENGINES / "e" / "llamacpp" / "llamacpp_f32experts_decode.npz", names="llama.cpp", probes=False)
    assert e.first.local and {s.site for s in e.suspects} == set(e.local_sites) and len(e.local_sites) > 10


def test_the_suspects_bar_follows_the_tolerance():
    assert [TOLERANCE_PRESETS[k].local_rtol for k in ("float32", "float16", "bfloat16", "quantised")] == \
        [1e-4, 2.5e-3, 3e-2, 5e-2]
    assert Tolerance.of(4e-3).local_rtol == pytest.approx(2e-4)
    assert Tolerance(1e-2, local_rtol=3e-3).local_rtol == 3e-3


# ---------------------------------------------------------------- 2. NaN in llama.cpp's masked slots


@pytest.mark.parametrize("where", ["every masked slot", "one masked slot"])
def test_nan_in_llamacpps_masked_attention_slots_is_a_divergence(set_d, where):
    """llama.cpp masks with zeros: a NaN there is its own (a Trace's NaN padding is what was meant to be forgiven)."""
    a = _captures()
    a["kq_soft_max-9"][3, :, 0, 4:] = np.nan if where == "every masked slot" else a["kq_soft_max-9"][3, :, 0, 4:]
    a["kq_soft_max-9"][3, 0, 0, 9] = np.nan
    cmp = ke.compare(ke.Session(set_d), a, names="llama.cpp", probes=False)
    assert (cmp.first.site, cmp.first.token, cmp.first.local) == ("layers.9.mla.probs", 3, True)


def test_a_traces_nan_padding_still_agrees(tiny):
    """A hook-named dump made from a Trace pads each attention row [nh, t + 1] with NaN: that agrees."""
    other = _engine(tiny, TOKENS)
    for name in [k for k in other if k.endswith("mla.probs")]:
        probs = other[name].copy()
        for t in range(len(TOKENS)):
            probs[t][..., t + 1 :] = np.nan
        other[name] = probs
    assert ke.compare(ke.Session(tiny), other, probes=False).first is None


# ---------------------------------------------------------------- 3. llama.cpp names and values


def test_names_llamacpps_graph_does_not_give_are_refused(set_d):
    """Every l_out-i renamed layer_out-i (l_out-5 also x100) and a stray kda_statee-4: 248 sites compared and 'no site
    beyond tolerance'. Now refused, one example per name, with the names it is close to."""
    a = _captures()
    for k in [k for k in a if k.startswith("l_out-")]:
        a["layer_out-" + k[len("l_out-"):]] = a.pop(k) * (100 if k == "l_out-5" else 1)
    a["kda_statee-4"] = a["kda_beta-4"]
    with pytest.raises(KeyError, match=r"name\(s\) that llama.cpp's K3 graph does not give, such as 'layer_out-0' \(did "
                                       r"you mean .*'l_out'.*\), 'kda_statee-4'"):
        ke.compare(ke.Session(set_d), a, names="llama.cpp")
    ke.compare(ke.Session(set_d), _captures(), names="llama.cpp", local=False)  # every name of the real captures is known


@pytest.mark.parametrize("change, says", [
    (lambda ids: ids.astype(np.float32) + 0.5, r"holds expert id 0\.5 at token 0"),
    (lambda ids: np.where(np.arange(ids.size).reshape(ids.shape) == 0, np.nan, ids.astype(np.float32)),
     r"holds expert id nan at token 0")])
def test_expert_ids_that_are_not_whole_numbers_are_refused_by_their_capture_name(set_d, change, says):
    """ffn_moe_topk-3 as float32 + 0.5 was cast to int (truncated) and agreed; a NaN read as the int64 minimum."""
    a = _captures()
    a["ffn_moe_topk-3"] = change(a["ffn_moe_topk-3"])
    with pytest.raises(ValueError, match=r"'layers.3.moe.router.topk_ids' \(llama.cpp's 'ffn_moe_topk-3'\) " + says):
        ke.compare(ke.Session(set_d), a, names="llama.cpp")


def test_shape_errors_name_the_capture(set_d):
    a = _captures()
    a["kda_beta-4"] = a["kda_beta-4"][..., 0]
    with pytest.raises(ValueError, match=r"'layers.4.kda.beta' \(llama.cpp's 'kda_beta-4'\) has per-token shape \(\)"):
        ke.compare(ke.Session(set_d), a, names="llama.cpp")
    a = _captures()
    a["kqv_mla-9"] = a["kqv_mla-9"][:, :, 0][1:].swapaxes(0, 1)  # a prefill-like record one token short
    with pytest.raises(ValueError, match=r"llama.cpp captures: 'kqv_mla-9' has shape \(6, 15, \d+\), expected decode"):
        ke.compare(ke.Session(set_d), a, names="llama.cpp")
