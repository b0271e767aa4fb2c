"""`ke.source_ablation` by hand on the reference checkpoint: each row's mass, loss and KL recomputed from
runs stepped token by token with `override_attn_res` given the masked-and-renormalised weights, and
float64 loops over the logits."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore import KimiDecodeState, kimi_forward_token
from kimi_explore.analysis.source_ablation import spearman
from kimi_explore.inspection.hooks import HookChain, Hooks
from kimi_explore.inspection.interventions import ablate_experts, override_attn_res, source_columns
from kimi_explore.inspection.recorder import Recorder

TOKENS = [17, 203, 5, 88, 88, 141, 250, 3, 64, 199, 7, 31]


def stepped(w, tokens, *hook_sets):
    """(logits [T, V] float64, recorder) stepping token by token with these hooks and a default Recorder."""
    rec = Recorder()
    hooks = HookChain(*hook_sets, rec)
    state = KimiDecodeState.new(w)
    out = []
    for t, tok in enumerate(tokens):
        hooks.begin_token(tok, t)
        out.append(np.array(kimi_forward_token(w, state, tok, hooks=hooks), dtype=np.float64))
    return np.stack(out), rec


def log_softmax(row):
    m = max(row)
    z = math.log(sum(math.exp(v - m) for v in row)) + m
    return [v - z for v in row]


def loss_by_hand(logits, tokens):
    return sum(-log_softmax(logits[t])[tokens[t + 1]] for t in range(len(tokens) - 1)) / (len(tokens) - 1)


def kl_by_hand(clean, other):
    total = 0.0
    for a, b in zip(clean, other, strict=True):
        la, lb = log_softmax(a), log_softmax(b)
        total += sum(math.exp(x) * (x - y) for x, y in zip(la, lb, strict=True))
    return total / len(clean)


def close(got, want, what):
    assert got == pytest.approx(want, rel=2e-3, abs=2e-5), what


@pytest.mark.parametrize(("layer", "site"), [(7, "ffn"), (10, "attn")])
def test_rows_equal_masking_by_hand(ref_weights, layer, site):
    res = ke.source_ablation(ref_weights, TOKENS, layers=[layer], sites=[site], chunk=5)
    clean, rec = stepped(ref_weights, TOKENS)
    close(res.clean_loss, loss_by_hand(clean, TOKENS), "clean loss")
    p = rec.trace()[f"layers.{layer}.attn_res.{site}.weights"]
    m = p.shape[1]
    want_families = [f for f in ke.interventions.SOURCE_FAMILIES if source_columns(f, m)]
    assert [r["family"] for r in res.rows] == want_families and len(res) == len(want_families)
    for row in res.rows:
        cols = source_columns(row["family"], m)
        assert row["columns"] == cols and row["n_sources"] == m and (row["layer"], row["site"]) == (layer, site)
        hand = Hooks()
        for t in range(len(TOKENS)):  # the masked weights, zeroed and renormalised by hand, one position at a time
            q = p[t].astype(np.float32).copy()
            q[cols] = 0
            hand.extend(override_attn_res(layer, site, q / q.sum(), positions=t))
        masked, _ = stepped(ref_weights, TOKENS, hand)
        close(row["mass"], float(np.mean([sum(float(p[t, j]) for j in cols) for t in range(len(TOKENS))])), "mass")
        close(row["loss"], loss_by_hand(masked, TOKENS), f"loss {row['family']}")
        close(row["delta_loss"], loss_by_hand(masked, TOKENS) - loss_by_hand(clean, TOKENS), f"delta {row['family']}")
        close(row["kl"], kl_by_hand(clean, masked), f"kl {row['family']}")
        assert row["kl"] > 1e-6  # every family present matters a little at least on this random model


def test_sites_without_a_mix_and_families_absent_are_left_out(ref_weights):
    res = ke.source_ablation(ref_weights, TOKENS[:6], layers=[0, 1], chunk=6)
    # layer 0 mixes nothing before attention (empty stack); layers 0-1 hold the embedding and the current sum only
    assert [(r["layer"], r["site"], r["family"]) for r in res.rows] == [
        (0, "ffn", "embedding"), (0, "ffn", "current"), (1, "attn", "embedding"), (1, "attn", "current"),
        (1, "ffn", "embedding"), (1, "ffn", "current")]
    for site in ("attn", "ffn"):  # two sources: the masses of the two families sum to 1
        assert sum(r["mass"] for r in res.rows if (r["layer"], r["site"]) == (1, site)) == pytest.approx(1, abs=1e-6)
    df = res.to_pandas()
    assert list(df["kl"]) == [r["kl"] for r in res.rows]


def test_a_session_brings_its_tokens_and_hooks(ref_weights):
    s = ke.Session(ref_weights, hooks=ablate_experts(2, "all"))
    s.feed(TOKENS[:8])
    res = ke.source_ablation(s, layers=[4], sites=["ffn"], chunk=8)
    assert res.n_tokens == 8
    close(res.clean_loss, loss_by_hand(s.logits.astype(np.float64), TOKENS[:8]), "clean loss under the session's hooks")
    plain = ke.source_ablation(ref_weights, TOKENS[:8], layers=[4], sites=["ffn"], chunk=8)
    assert abs(plain.clean_loss - res.clean_loss) > 1e-4


def test_spearman_and_the_verdict_follow_the_numbers(ref_weights):
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)  # 1 - 6 * 2 / (4 * 15)
    assert spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(22.5))  # average ranks of a tie
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    res = ke.source_ablation(ref_weights, TOKENS, layers=[6, 7, 8], chunk=6)
    rho = res.spearman("kl")
    mass, kl = res.column("mass"), res.column("kl")
    rm, rk = np.argsort(np.argsort(mass)), np.argsort(np.argsort(kl))  # no ties among these floats
    assert rho == pytest.approx(np.corrcoef(rm, rk)[0, 1])
    text = res.verdict()
    assert f"is {rho:.2f}" in text and f"{len(res)} (layer, site, family) cells" in text
    for r in res.disagreements():
        assert abs(r["mass_pct"] - r["effect_pct"]) >= 0.5
    fam = res.by_family()
    assert sum(v["n"] for v in fam.values()) == len(res)


def test_bad_arguments_are_named(ref_weights):
    with pytest.raises(ValueError, match="give the token ids"):
        ke.source_ablation(ref_weights)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ke.source_ablation(ref_weights, [1, 10**6])
    with pytest.raises(ValueError, match="layers \\[99\\] are not in this model"):
        ke.source_ablation(ref_weights, TOKENS, layers=[99])
    with pytest.raises(ValueError, match="source family must be one of"):
        ke.source_ablation(ref_weights, TOKENS, families=["residual"])
    with pytest.raises(TypeError, match="families must be a list of source families, got the string 'current'"):
        ke.source_ablation(ref_weights, TOKENS, families="current")


def test_the_figure_shows_each_cell_where_its_numbers_say(ref_weights):
    from kimi_explore.views.figures.source_ablation_plots import gap_grid, mass_vs_effect

    res = ke.source_ablation(ref_weights, TOKENS, layers=[5, 6, 7], chunk=6)
    fig = mass_vs_effect(res)
    scatter = fig.axes[0]
    shown = {(c.get_label()): c.get_offsets().data.tolist() for c in scatter.collections}
    for fam in {r["family"] for r in res.rows}:
        for site in ("attn", "ffn"):
            want = [[r["mass"], r["kl"]] for r in res.rows if r["family"] == fam and r["site"] == site]
            if want:
                np.testing.assert_allclose(shown[f"{fam} ({site})"], want, rtol=1e-12)
            else:
                assert f"{fam} ({site})" not in shown
    grid, fams, cols = gap_grid(res)
    n = len(res) - 1
    for r in res.rows:  # percentile by hand: the number of cells below, over n
        pm = sum(x["mass"] < r["mass"] for x in res.rows) / n
        pk = sum(x["kl"] < r["kl"] for x in res.rows) / n
        assert grid[fams.index(r["family"]), cols.index(f"{r['layer']} {r['site']}")] == pytest.approx(pm - pk)
    assert np.isnan(grid).sum() == len(fams) * len(cols) - len(res)
    texts = {t.get_text() for t in fig.axes[1].texts}
    assert {f"{v:+.2f}" for v in grid[np.isfinite(grid)]} == texts


def test_reusing_the_clean_prefix_gives_the_full_runs_numbers_exactly(ref_weights):
    """A run masked at layer L restarts from the clean stack before L: the same floats as decoding every layer."""
    ids = TOKENS * 2
    fast = ke.source_ablation(ref_weights, ids, layers=[0, 5, 12], chunk=7)  # 4 chunks, the last one short
    full = ke.source_ablation(ref_weights, ids, layers=[0, 5, 12], chunk=7, reuse_prefix=False)
    assert fast.clean_loss == full.clean_loss and fast.rows == full.rows and len(fast) > 6


def test_the_clean_stacks_are_held_for_one_layer_at_a_time_and_layers_may_come_in_any_order(tiny_weights, monkeypatch):
    """K3 at 1,024 tokens: every layer's stacks would be ~14.5 GB. Count the packed stacks alive at each pack: at
    most two layers' worth (one being replaced) of the 4 chunks, where keeping them all would reach 8 layers'."""
    import weakref

    from kimi_explore.model.kimi_sequence import SequenceSources

    alive, most, pack = [], [0], SequenceSources.pack

    def counted(self):
        out = pack(self)
        alive.append(weakref.ref(out[0]))
        most[0] = max(most[0], sum(r() is not None for r in alive))
        return out

    monkeypatch.setattr(SequenceSources, "pack", counted)
    ids, kw = (TOKENS * 4)[:40], dict(chunk=10, families=["embedding", "current"])
    shuffled = ke.source_ablation(tiny_weights, ids, layers=[7, 1, 4, 2], **kw)
    assert 0 < most[0] <= 2 * 4
    monkeypatch.setattr(SequenceSources, "pack", pack)
    full = ke.source_ablation(tiny_weights, ids, layers=[7, 1, 4, 2], reuse_prefix=False, **kw)
    assert list(dict.fromkeys(r["layer"] for r in shuffled.rows)) == [7, 1, 4, 2]  # rows in the order asked
    assert shuffled.rows == full.rows and len(shuffled) >= 8


@pytest.mark.parametrize("chunk", [1, 23], ids=["chunk-1", "chunk-T"])
def test_held_stacks_with_repeated_layers_and_a_layer_subset(chunk):
    """A layer asked twice (the held stacks stay at it) and weights of layers 4..7 only (stack positions are not
    layer ids): the same rows, in the order asked, as decoding every layer."""
    from kimi_explore.weights.tiny_model import random_tiny_checkpoint

    w = ke.from_pretrained(random_tiny_checkpoint(), device="cpu", layers=range(4, 8))
    ids, kw = (TOKENS * 2)[:23], dict(layers=[7, 4, 7, 5], chunk=chunk, families=["embedding", "current"])
    fast, full = ke.source_ablation(w, ids, **kw), ke.source_ablation(w, ids, reuse_prefix=False, **kw)
    assert [r["layer"] for r in fast.rows][:1] == [7] and [r["layer"] for r in fast.rows].count(7) >= 2
    assert fast.clean_loss == full.clean_loss and fast.rows == full.rows and len(fast) >= 8
