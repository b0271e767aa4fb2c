"""Fourth review of the analyses: each test is a problem a read-only probe found.

1. A history with a banned token (a logits hook setting -inf) made every KL of `ke.diff` and `ke.source_ablation`
   NaN: 0 * (-inf - -inf).
2. float64 sessions: the replay check took float32's tolerance (1e-4 of the logits' scale), so a temporary
   intervention 2e-5 off the logits was analysed as the history.
3. `ke.source_ablation(session)` never checked its clean run against the session's history.
"""

from __future__ import annotations

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.analysis.learned import pydoc_corpus

TEXT = list(pydoc_corpus()[4000:4040])


@pytest.fixture(scope="module")
def w64():
    return ke.from_pretrained(ke.tiny_checkpoint(), device="cpu", dtype="float64")


def _kl(a, b):
    """KL(a || b) per row, by hand: float64 log-softmax, terms where a gives no mass left out."""
    out = []
    for x, y in zip(np.asarray(a, np.float64), np.asarray(b, np.float64), strict=True):
        la, lb = x - x.max(), y - y.max()
        la, lb = la - np.log(np.exp(la).sum()), lb - np.log(np.exp(lb).sum())
        m = np.isfinite(la)
        out.append(float(np.sum(np.exp(la[m]) * (la[m] - lb[m]))))
    return np.array(out)


def test_kl_of_runs_with_a_banned_token_is_a_number(w64):
    ban = ke.Hooks()
    ban.add("logits", lambda logits, *, hook: np.where(np.arange(logits.shape[-1]) == 0, -np.inf, logits))
    a = ke.Session(w64, hooks=ban)
    a.feed(TEXT[:20])
    same = ke.diff(a, a.fork())
    assert np.array_equal(same.kl, np.zeros(20)) and same.summary()["mean_kl"] == 0.0
    b = a.fork()
    b.back(10)
    with b.intervene(ke.interventions.ablate_experts(3, [int(a.trace()["layers.3.moe.router.topk_ids"][12, 0])])):
        b.feed(TEXT[10:20])
    d = ke.diff(a, b)
    np.testing.assert_allclose(d.kl, _kl(a.logits, b.logits), rtol=1e-9, atol=1e-15)
    assert d.kl[12] > 1e-3
    row = ke.source_ablation(a, layers=[7], families=["current"], sites=["ffn"]).rows[0]
    assert np.isfinite(row["kl"]) and row["kl"] > 0


@pytest.mark.parametrize("analysis", [ke.logit_attribution, ke.logit_lens])
def test_a_float64_history_decoded_under_a_small_temporary_intervention_is_refused(w64, analysis):
    """Analysed inside `intervene(scale_kda_head(5, 0, 0.99))` at the last token, a history decoded without it
    replays ~1e-4 off in float64: under float32's tolerance the analyses ran on a computation the history never had
    (attribution's .logit 2.4e-5 off the stored one)."""
    s = ke.Session(w64)
    s.feed(TEXT)
    run = (lambda: analysis(s, positions=[39])) if analysis is ke.logit_lens else (lambda: analysis(s, 39))
    with s.intervene(ke.interventions.scale_kda_head(5, 0, 0.99, positions=[39])):
        with pytest.raises(ValueError, match="replaying the session's history gives other logits at token 39"):
            run()
    run()  # without it: the history
    assert ke.logit_attribution(s, 39).logit == s.logits[39, int(np.argmax(s.logits[39]))]


def test_source_ablation_of_a_session_checks_its_clean_run_against_the_history(w64):
    """A session fed under ablate_experts('all', 'all') (temporarily): its clean loss was another run's (2.553 against
    the history's 2.425), where the lens and the attribution refuse the session."""
    s = ke.Session(w64)
    with s.intervene(ke.interventions.ablate_experts("all", "all")):
        s.feed(TEXT)
    with pytest.raises(ValueError, match="replaying the session's history gives other logits at token 0"):
        ke.source_ablation(s, layers=[7], families=["current"], sites=["ffn"])
    ok = ke.Session(w64)
    ok.feed(TEXT)
    r = ke.source_ablation(ok, layers=[7], families=["current"], sites=["ffn"])
    lp = ok.logits - ok.logits.max(axis=1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(axis=1, keepdims=True))
    assert r.clean_loss == pytest.approx(-lp[np.arange(len(TEXT) - 1), TEXT[1:]].mean(), rel=1e-12)
