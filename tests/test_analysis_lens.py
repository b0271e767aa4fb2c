"""The block-residual logit lens against the model itself.

Independent references: the session's own logits (the lens at the last layer), and the model CUT
after layer i (`from_pretrained(..., layers=range(i + 1))` runs layers 0..i, then the output mix,
final norm and lm_head: by definition what the lens at layer i must predict).
"""

from __future__ import annotations

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.analysis._replay import replay
from kimi_explore.analysis.logit_lens import lens_logits
from kimi_explore.analysis.logprobs import log_softmax
from kimi_explore.inspection import interventions

TEXT = list(b"The cat sat. 42 cats!\n")


@pytest.fixture(scope="module", params=["reference", "random_tiny"])
def model(request, ref_weights, tiny_weights):
    w = ref_weights if request.param == "reference" else tiny_weights
    s = ke.Session(w)
    s.feed(TEXT)
    return w, w.source, s  # the cut models are loaded from the same checkpoint


def test_the_lens_at_the_last_layer_is_the_models_logits(model):
    w, _, s = model
    names = ["embed"] + [layer.hook_prefix + "prefix_sum" for layer in w.layers]
    for t, values, _ in replay(s, names):
        lens = lens_logits(w, w.head(), values)
        assert lens.shape == (len(w.layers), w.config.vocab_size)
        assert np.max(np.abs(lens[-1] - s.logits[t])) <= 1e-5


def test_public_lens_last_layer_matches_predictions_and_logprobs(model):
    w, _, s = model
    lens = ke.logit_lens(s, top=4, targets="next")
    T, L = len(TEXT), len(w.layers)
    assert lens.top_ids.shape == (T, L, 4) and lens.top_probs.shape == (T, L, 4) and lens.layers == w.layer_ids
    ids, probs = s.trace().top_predictions()
    np.testing.assert_array_equal(lens.top_ids[:, -1], ids[:, :4])
    np.testing.assert_allclose(lens.top_probs[:, -1], probs[:, :4], atol=1e-5)
    logp = log_softmax(s.logits)
    np.testing.assert_allclose(lens.target_logprobs[:-1, -1], logp[np.arange(T - 1), TEXT[1:]], atol=1e-5)
    assert np.isnan(lens.target_logprobs[-1]).all() and lens.target_ids[-1] == -1
    assert lens.agreement()[-1] == 1.0
    assert np.all(np.diff(lens.top_probs, axis=-1) <= 1e-12)  # sorted, descending


@pytest.mark.parametrize("cut", ["first", "boundary", "middle"])
def test_the_lens_at_layer_i_is_the_model_cut_after_layer_i(model, cut):
    w, path, s = model
    i = {"first": 0, "boundary": w.config.attn_res_block_size, "middle": len(w.layers) // 2 + 1}[cut]
    short = ke.from_pretrained(path, device="cpu", layers=range(i + 1))
    cut_session = ke.Session(short, recorder=False)
    cut_logits = cut_session.feed(TEXT)
    lens = ke.logit_lens(s, top=3, targets=np.array(TEXT[1:] + [0]))
    logp = log_softmax(cut_logits)
    np.testing.assert_allclose(lens.target_logprobs[:, i], logp[np.arange(len(TEXT)), TEXT[1:] + [0]], atol=1e-4)
    np.testing.assert_array_equal(lens.top_ids[:, i, 0], np.argmax(cut_logits, axis=-1))


def test_the_lens_replays_persistent_hooks_and_refuses_a_temporary_intervention(ref_weights):
    s = ke.Session(ref_weights, hooks=interventions.ablate_experts(2, "all"))
    s.feed(TEXT[:8])
    lens = ke.logit_lens(s, top=1)
    np.testing.assert_array_equal(lens.top_ids[:, -1, 0], np.argmax(s.logits, axis=-1))
    plain = ke.Session(ref_weights)
    plain.feed(TEXT[:4])
    with plain.intervene(interventions.ablate_experts(2, "all")):
        plain.feed(TEXT[4:8])
    with pytest.raises(ValueError, match="decoded under hooks the session no longer holds"):
        ke.logit_lens(plain)


def test_lens_arguments_are_checked(ref_weights):
    s = ke.Session(ref_weights)
    with pytest.raises(ValueError, match="no tokens"):
        ke.logit_lens(s)
    s.feed(TEXT[:3])
    with pytest.raises(ValueError, match="top must be a positive int"):
        ke.logit_lens(s, top=0)
    with pytest.raises(ValueError, match="targets must be 3 integer token ids"):
        ke.logit_lens(s, targets=[1, 2])
    with pytest.raises(ValueError, match=r"outside the vocabulary 0\.\.255"):
        ke.logit_lens(s, targets=[1, 2, 999])


def test_the_lens_at_chosen_positions_is_those_rows_of_the_full_lens(model):
    w, _, s = model
    full = ke.logit_lens(s, top=3, targets="next")
    T = len(TEXT)
    some = ke.logit_lens(s, top=3, targets="next", positions=[-1, 2, 2])  # any order, repeats, negative
    assert some.positions.tolist() == [2, T - 1] and some.tokens.tolist() == [TEXT[2], TEXT[-1]]
    np.testing.assert_array_equal(some.top_ids, full.top_ids[[2, T - 1]])
    np.testing.assert_array_equal(some.top_probs, full.top_probs[[2, T - 1]])
    np.testing.assert_array_equal(some.final_ids, full.final_ids[[2, T - 1]])
    np.testing.assert_array_equal(some.target_logprobs, full.target_logprobs[[2, T - 1]])
    assert full.positions.tolist() == list(range(T))
    with pytest.raises(IndexError, match=f"token position {T} is outside the session.s history of {T} tokens"):
        ke.logit_lens(s, positions=[T])
