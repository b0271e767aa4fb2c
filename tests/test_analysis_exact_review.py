"""An adversarial review of the analyses: each against a float64 twin that reads the weights itself.

The twin (`analysis_twin.Twin`, on `naive_decoder.NaiveDecoder`) steps the tokens one by one with a
Python list as the block stack and computes every analysis from its docstring's formula; it shares
no code with the replay, the recorder, the lens, the attribution, the diff, the masks or the routing
counts. Histories are built the hard way (chunks, steps, truncate and back inside a chunk, forks,
sessions saved without checkpoints and loaded with another recorder), on both tiny models, float64
(to ~1e-10) and float32 (to float32 rounding). The tests named after a bug failed before its fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from analysis_twin import Twin, family_columns, log_softmax
from conftest import REFERENCE_DIR

import kimi_explore as ke
from kimi_explore.analysis._replay import replay
from kimi_explore.analysis.routing_stats import byte_class
from kimi_explore.inspection.source_masks import SOURCE_FAMILIES
from kimi_explore.model.kimi_token import token_indices
from kimi_explore.weights.tiny_model import make_text_config, random_tiny_checkpoint, write_checkpoint

TEXT = list(b"Twins: 42 tokens, one by one!\n")
PATHS = {"reference": REFERENCE_DIR, "random_tiny": None}
TOL = {"float64": 1e-10, "float32": 5e-4}  # on log-probs, leaves, weights (float32: its rounding, amplified by depth)


def _path(name):
    return REFERENCE_DIR if name == "reference" else random_tiny_checkpoint()


@pytest.fixture(scope="module")
def twins():
    return {name: Twin(_path(name)) for name in PATHS}


@pytest.fixture(scope="module")
def weights():
    cache = {}

    def get(name, dtype):
        if (name, dtype) not in cache:
            cache[name, dtype] = ke.from_pretrained(_path(name), device="cpu", dtype=dtype)
        return cache[name, dtype]

    return get


@pytest.fixture(scope="module")
def twin_runs(twins):
    return {name: twins[name].run(TEXT) for name in PATHS}


def mixed_history(w, text, tmp_path=None, how="mixed"):
    """A session whose tokens are `text`, decoded every way there is: fed chunks, steps, truncate and back
    inside a chunk, then a fork of it or its file saved without checkpoints and loaded without a recorder
    ("route": recorded with a names_filter and kda.state in full, which runs the KDA layers of fed chunks token
    by token, then saved without checkpoints and loaded without a recorder)."""
    recorder = ke.Recorder(names_filter="layers.1?.*", full=["layers.*.kda.state"]) if how == "route" else True
    s = ke.Session(w, recorder=recorder, checkpoint_every=3)
    s.feed(text[:9], chunk=4)  # chunks 0..3, 4..7, 8
    for tok in text[9:12]:
        s.step(tok)
    s.truncate(6)  # inside the chunk 4..7
    for tok in text[6:8]:
        s.step(tok)
    s.feed(text[8:14], chunk=3)  # 8..10, 11..13
    s.back(2)  # inside the chunk 11..13
    for tok in text[12:16]:
        s.step(tok)
    s.feed(text[16:], chunk=5)
    assert s.tokens == list(text)
    if how == "fork":
        return s.fork()
    if how in ("loaded", "route"):
        return ke.Session.load_state(s.save_state(tmp_path / "mixed.npz", checkpoints=False), w, recorder=False)
    return s


# ---------------------------------------------------------------------------------------------- the lens


@pytest.mark.parametrize("how", ["mixed", "loaded", "route"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(PATHS))
def test_lens_equals_the_twin(name, dtype, how, weights, twin_runs, tmp_path):
    s = mixed_history(weights(name, dtype), TEXT, tmp_path, how)
    lens = ke.logit_lens(s, top=4, targets="next")
    want = np.array([log_softmax(r["lens"]) for r in twin_runs[name]])  # [T, L, V]
    tol = TOL[dtype]
    got_lp = np.take_along_axis(want, lens.top_ids, axis=-1)  # the twin's log-probs of the ids the lens chose ...
    best = -np.sort(-want, axis=-1)[..., :4]  # ... are its top 4 (ids may swap only at a tie)
    np.testing.assert_allclose(got_lp, best, atol=tol, rtol=0)
    np.testing.assert_allclose(np.log(lens.top_probs), got_lp, atol=tol, rtol=0)
    nxt = np.array([want[t, :, TEXT[t + 1]] for t in range(len(TEXT) - 1)])
    np.testing.assert_allclose(lens.target_logprobs[:-1], nxt, atol=tol, rtol=0)
    assert np.isnan(lens.target_logprobs[-1]).all() and lens.target_ids[-1] == -1
    final = np.array([np.argmax(r["logits"]) for r in twin_runs[name]])
    np.testing.assert_array_equal(lens.final_ids, final)
    np.testing.assert_array_equal(lens.agreement(), (lens.top_ids[:, :, 0] == final[:, None]).mean(axis=0))
    for t in (0, 5, 6, 11, 12, len(TEXT) - 1):  # lens_at: the same rows, at chunk edges and cuts
        strip = ke.lens_at(s, t, top=4)
        np.testing.assert_array_equal(strip.top_ids, lens.top_ids[t])
        np.testing.assert_array_equal(strip.top_probs, lens.top_probs[t])


def test_lens_of_one_token_sessions_equals_the_twin(weights, twins):
    for name in PATHS:
        want = log_softmax(twins[name].run(TEXT[:1])[0]["lens"])
        for how in ("step", "feed"):
            s = ke.Session(weights(name, "float64"))
            s.step(TEXT[0]) if how == "step" else s.feed(TEXT[:1])
            lens = ke.logit_lens(s, top=2, targets="next")
            np.testing.assert_allclose(np.log(lens.top_probs[0]), -np.sort(-want, axis=-1)[:, :2], atol=1e-10, rtol=0)
            assert lens.target_ids.tolist() == [-1] and np.isnan(lens.target_logprobs).all()
            np.testing.assert_array_equal(ke.lens_at(s, -1, top=2).top_ids, lens.top_ids[0])
            a = ke.logit_attribution(s, 0)
            c, _, _ = twins[name].attribution(twins[name].run(TEXT[:1])[0], a.token)
            assert max(abs(c[k] - a.contributions[k]) for k in c) <= 1e-10


# ---------------------------------------------------------------------------------------------- attribution


@pytest.mark.parametrize("how", ["mixed", "loaded", "fork", "route"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(PATHS))
def test_attribution_equals_the_twin(name, dtype, how, weights, twins, twin_runs, tmp_path):
    s = mixed_history(weights(name, dtype), TEXT, tmp_path, how)
    steps = [0, 5, 6, 7, 11, 12, -1]
    many = ke.logit_attribution(s, steps)
    for a, t in zip(many, sorted(t % len(TEXT) for t in steps), strict=True):
        r = twin_runs[name][t]
        contributions, source_of, source_weights = twins[name].attribution(r, a.token)
        scale = 1.0 + abs(a.logit)
        assert a.t == t and a.token == int(np.argmax(s.logits[t]))
        assert set(a.contributions) == set(contributions) and a.source_of == source_of
        assert list(a.source_weights) == list(source_weights)
        assert max(abs(a.source_weights[k] - v) for k, v in source_weights.items()) <= TOL[dtype]
        assert max(abs(a.contributions[k] - v) for k, v in contributions.items()) <= TOL[dtype] * scale
        assert abs(a.logit - r["logits"][a.token]) <= TOL[dtype] * scale
        assert abs(sum(contributions.values()) - r["logits"][a.token]) <= 1e-10 * scale  # the twin's split is exact
        assert abs(a.total() - a.logit) <= (1e-10 if dtype == "float64" else 1e-4) * scale
        by_source = {label: sum(v for k, v in contributions.items() if source_of[k] == label) for label in source_weights}
        assert max(abs(a.by_source()[k] - v) for k, v in by_source.items()) <= TOL[dtype] * scale


# ---------------------------------------------------------------------------------------------- replays (bugs)


@pytest.mark.parametrize("how", ["mixed", "fork", "loaded", "route"])
@pytest.mark.parametrize("name", list(PATHS))
def test_the_replay_of_every_history_gives_its_logits_bit_for_bit(name, how, weights, tmp_path):
    """What the analyses read is what the history computed: the replayed logits are the stored ones exactly, from
    token 0 and from the checkpoint before a position (at a cut, after it, at the end)."""
    s = mixed_history(weights(name, "float32"), TEXT, tmp_path, how)
    for positions in (None, [6], [12], [20], [len(TEXT) - 1]):
        for from_checkpoint in (False, True):
            seen = []
            for t, _, logits in replay(s, ["embed"], positions, from_checkpoint=from_checkpoint):
                np.testing.assert_array_equal(logits, s.logits[t], err_msg=f"token {t}")
                seen.append(t)
            assert seen == (list(range(len(TEXT))) if positions is None else positions)


def test_bug_a_chunk_is_replayed_on_the_route_it_was_fed_on(ref_weights, tmp_path):
    """A session that fed its chunks with a recorder keeping `kda.state` in full (the KDA layers then run token by
    token inside the chunk), saved and loaded with recorder=False: the replay ran the chunks on the loaded session's
    route (none), and the analyses showed values the history never had (~1e-6, below the replay check). (The other
    way round, a plain session loaded with a recorder keeping them in full, is refused: its records would not line
    up with that recorder's next ones.)"""
    s = ke.Session(ref_weights, recorder=ke.Recorder(full=["layers.*.kda.state"]))
    s.feed(TEXT, chunk=11)
    loaded = ke.Session.load_state(s.save_state(tmp_path / "route.npz"), ref_weights, recorder=False)
    for t, _, logits in replay(loaded, ["embed"]):
        np.testing.assert_array_equal(logits, s.logits[t])
    a, b = ke.logit_attribution(s, [3, 20]), ke.logit_attribution(loaded, [3, 20])
    assert [x.contributions for x in a] == [x.contributions for x in b]
    np.testing.assert_array_equal(ke.logit_lens(loaded, top=3).top_probs, ke.logit_lens(s, top=3).top_probs)
    plain = ke.Session(ref_weights)
    plain.feed(TEXT, chunk=11)
    with pytest.raises(ValueError, match=r"other settings than this session's: full=\(\) \(this recorder: "):
        ke.Session.load_state(plain.save_state(tmp_path / "plain.npz"), ref_weights,
                              recorder=ke.Recorder(full=["layers.*.kda.state"]))


def test_bug_a_cut_chunk_replays_exactly_without_its_checkpoint(tiny_weights, tmp_path):
    """truncate inside a fed chunk keeps a checkpoint at the cut; a file saved without checkpoints has none, and the
    replay then re-decoded the kept part alone for the values: logits up to 1.5e-4 off the stored ones (passing
    the replay check), a lens and an attribution of numbers the history never had."""
    s = ke.Session(tiny_weights)
    s.feed(TEXT[:10], chunk=8)
    s.truncate(5)
    for tok in TEXT[5:9]:
        s.step(tok)
    loaded = ke.Session.load_state(s.save_state(tmp_path / "cut.npz", checkpoints=False), tiny_weights)
    for t, _, logits in replay(loaded, ["embed"]):
        np.testing.assert_array_equal(logits, s.logits[t])
    np.testing.assert_array_equal(ke.logit_lens(loaded, top=3).top_probs, ke.logit_lens(s, top=3).top_probs)
    assert ke.logit_attribution(loaded, 4).contributions == ke.logit_attribution(s, 4).contributions
    assert ke.logit_attribution(loaded, 7).contributions == ke.logit_attribution(s, 7).contributions


# ---------------------------------------------------------------------------------------------- run diff


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(PATHS))
def test_diff_equals_the_twin(name, dtype, weights, twins, tmp_path):
    other = list(b"Twins? 17 tokens.")
    ra, rb = twins[name].run(TEXT), twins[name].run(other)
    a = mixed_history(weights(name, dtype), TEXT, tmp_path, "fork")
    b = ke.Session(weights(name, dtype))
    b.feed(other[:7], chunk=3)
    for tok in other[7:]:
        b.step(tok)
    d = ke.diff(a, b)
    T, tol = len(other), TOL[dtype]
    assert len(d) == T and d.kl_exact
    S = d.final_attn_res.shape[1]

    def placed(p):  # blocks first, current last: Trace's source axis
        out = np.full(S, np.nan)
        out[: len(p) - 1], out[-1] = p[:-1], p[-1]
        return out

    final = np.array([placed(rb[t]["final_w"]) - placed(ra[t]["final_w"]) for t in range(T)])
    np.testing.assert_allclose(d.final_attn_res, final, atol=tol, rtol=0)
    sites = np.full((T, len(d.layers), 2, S), np.nan)
    for t in range(T):
        for li, i in enumerate(d.layers):
            for k, key in enumerate(("attn_w", "ffn_w")):
                if key in ra[t]["layers"][i]:
                    sites[t, li, k] = placed(rb[t]["layers"][i][key]) - placed(ra[t]["layers"][i][key])
    np.testing.assert_allclose(d.attn_res, sites, atol=tol, rtol=0)  # NaN where the twin has no mix either
    norms = [[np.linalg.norm(r[t]["layers"][i]["kda_state"], axis=(1, 2)) for i in d.kda_layers] for r in (ra, rb)
             for t in range(T)]
    np.testing.assert_allclose(d.kda_state, np.array(norms[T:]) - np.array(norms[:T]), atol=tol, rtol=tol)
    changes = []
    for t in range(T):
        for j, i in enumerate(d.moe_layers):
            A, B = set(ra[t]["layers"][i]["ids"].tolist()), set(rb[t]["layers"][i]["ids"].tolist())
            assert d.jaccard[t, j] == len(A & B) / len(A | B)
            if A != B:
                changes.append((t, i, sorted(A - B), sorted(B - A)))
    assert d.routing_changes == changes
    kl = [np.sum(np.exp(log_softmax(ra[t]["logits"])) * (log_softmax(ra[t]["logits"]) - log_softmax(rb[t]["logits"])))
          for t in range(T)]
    np.testing.assert_allclose(d.kl, kl, atol=tol, rtol=0)
    np.testing.assert_array_equal(d.top1_b, [np.argmax(r["logits"]) for r in rb])


def test_bug_diff_of_what_was_not_recorded_says_so_not_zero(ref_weights):
    """Sessions recording only the output mix: the summary said max |Δ| 0.0 of the block weights and KDA norms and
    0 routing changes, and the figure 'no change above 1e-5', of values nobody recorded."""
    from kimi_explore.views.figures.analysis_plots import diff_overview

    a, b = (ke.Session(ref_weights, recorder=ke.Recorder(names_filter=["final.*", "logits"])) for _ in range(2))
    a.feed(TEXT[:12])
    b.feed(TEXT[:5] + list(b"XYZ!?.,"))
    d = ke.diff(a, b)
    s = d.summary()
    assert np.isnan(s["max_abs_d_attn_res"]) and np.isnan(s["max_abs_d_kda_state"])
    assert s["routing_changes"] is None and "routing not recorded" in repr(d)
    assert s["max_abs_d_final_attn_res"] > 0.01
    texts = [t.get_text() for ax in diff_overview(d).axes for t in ax.texts]
    assert not any("no change above" in t for t in texts)
    for what in ("Δ FFN-site block weights", "Δ KDA state norm", "routing (Jaccard"):
        assert any(t.startswith(what) and t.endswith("not recorded in these runs") for t in texts), what


def test_bug_diff_of_trace_windows_at_other_positions_is_refused(ref_weights):
    """diff compares rows by index: windows of histories of other lengths (the last 8 tokens of each) compared
    token 14 of one with token 4 of the other, silently."""
    a, b = ke.Session(ref_weights), ke.Session(ref_weights)
    a.feed(TEXT[:22])
    b.feed(TEXT[:12])
    with pytest.raises(ValueError, match=r"diff: row 0 is token position 14 in a but 4 in b"):
        ke.diff(a.trace(window=slice(-8, None)), b.trace(window=slice(-8, None)))
    same = ke.diff(a.trace(window=slice(4, 12)), b.trace(window=slice(4, 12)))
    assert len(same) == 8 and np.all(same.kl < 1e-9) and not same.routing_changes  # (other chunks: rounding)
    assert same.positions.tolist() == list(range(4, 12))


def test_bug_the_diff_figure_labels_a_window_with_its_positions(ref_weights):
    """A diff of windows starting at token 4 was labelled from 0."""
    from kimi_explore.views.figures.analysis_plots import diff_overview

    a, b = ke.Session(ref_weights), ke.Session(ref_weights)
    a.feed(TEXT[:12])
    b.feed(TEXT[:8] + list(b"QRST"))
    fig = diff_overview(ke.diff(a.trace(window=(4, 12)), b.trace(window=(4, 12))))
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels[0] == f"4 #{TEXT[4]}" and labels[-1].startswith("11 ")


# ---------------------------------------------------------------------------------------------- source ablation


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(PATHS))
def test_source_ablation_equals_the_twin(name, dtype, weights, twins):
    """Every row (mass, loss, Δloss, KL) against the twin decoding with that family's columns dropped from that
    mix at every token. float64 to 1e-11: the clean run's log-probs were kept in float32 (KL off by ~1e-8,
    and a mask that changes nothing gave a negative KL)."""
    tw, text = twins[name], TEXT[:9]
    w = weights(name, dtype)
    layers = [w.layer_ids[k] for k in (0, 4, -1)]
    res = ke.source_ablation(w, text, layers=layers, chunk=4)
    clean = tw.run(text)
    clp = np.array([log_softmax(r["logits"]) for r in clean])
    T = len(text)
    nll = lambda lp: -np.mean([lp[t, text[t + 1]] for t in range(T - 1)])  # noqa: E731
    tol = 1e-11 if dtype == "float64" else TOL[dtype]
    assert abs(res.clean_loss - nll(clp)) <= tol
    seen = set()
    for row in res.rows:
        i, site, fam = row["layer"], row["site"], row["family"]
        key = "attn_w" if site == "attn" else "ffn_w"
        assert key in clean[0]["layers"][i] and family_columns(fam, len(clean[0]["layers"][i][key]))
        assert row["columns"] == family_columns(fam, len(clean[0]["layers"][i][key]))
        mass = np.mean([r["layers"][i][key][row["columns"]].sum() for r in clean])
        mlp = np.array([log_softmax(r["logits"]) for r in tw.run(text, mask=(i, site, fam))])
        kl = np.mean(np.sum(np.exp(clp) * (clp - mlp), axis=-1))
        assert abs(row["mass"] - mass) <= tol and abs(row["loss"] - nll(mlp)) <= tol
        assert abs(row["delta_loss"] - (nll(mlp) - nll(clp))) <= tol and abs(row["kl"] - kl) <= tol
        seen.add((i, site, fam))
    want = {(i, site, f) for i in layers for site in ("attn", "ffn") for f in SOURCE_FAMILIES
            if (key := "attn_w" if site == "attn" else "ffn_w") in clean[0]["layers"][i]
            and 0 < len(family_columns(f, len(clean[0]["layers"][i][key]))) < len(clean[0]["layers"][i][key])}
    assert seen == want


def test_bug_kl_of_a_mask_that_changes_nothing_is_zero():
    from kimi_explore.analysis.source_ablation import _scores

    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        logits = (4 * rng.standard_normal((6, 256))).astype(dtype)
        _, _, clean = _scores(logits, list(range(7)), 0, None)
        _, kl, _ = _scores(logits.copy(), list(range(7)), 0, clean)
        np.testing.assert_array_equal(kl, 0.0)


# ---------------------------------------------------------------------------------------------- routing stats

TEXTS = ["Hello, world!", "", "x", "123 abc\n\t", [1, 2, 200], "", "zz top 9"]


def twin_routing(tw, texts, classes):
    moe = [layer.index for layer in tw.layers if hasattr(layer.ffn, "experts")]
    E = tw.cfg.num_experts
    counts, wsum = np.zeros((len(moe), E), np.int64), np.zeros((len(moe), E))
    co, joint = np.zeros((len(moe), E, E), np.int64), {}
    for x in texts:
        ids = list(x.encode()) if isinstance(x, str) else list(x)
        for tok, r in zip(ids, tw.run(ids) if ids else [], strict=True):
            for j, i in enumerate(moe):
                sel, wts = r["layers"][i]["ids"], r["layers"][i]["weights"]
                for e, we in zip(sel, wts, strict=True):
                    counts[j, e] += 1
                    wsum[j, e] += we
                    co[j, e, sel] += 1
                key = (j, classes(tok), int(sel[0]))  # top-1: the highest score (naive_latent_moe sorts by it)
                joint[key] = joint.get(key, 0) + 1
    return moe, counts, wsum, co, joint


def mutual_information_by_hand(joint, j):
    cells = {(c, e): n for (jj, c, e), n in joint.items() if jj == j}
    N = sum(cells.values())
    pc, px = {}, {}
    for (c, e), n in cells.items():
        pc[c] = pc.get(c, 0.0) + n / N
        px[e] = px.get(e, 0.0) + n / N
    return sum(n / N * np.log2(n / N / (pc[c] * px[e])) for (c, e), n in cells.items())


def check_stats(st, want, tol):
    moe, counts, wsum, co, joint = want
    assert st.moe_layers == moe and st.tokens == int(counts[0].sum() // st.top_k)
    np.testing.assert_array_equal(st.counts, counts)
    np.testing.assert_array_equal(st.coactivation, co)
    np.testing.assert_allclose(st.weight_sum, wsum, atol=tol, rtol=0)
    got = {(j, c, e): int(st.class_top1[j, k, e]) for j in range(len(moe)) for k, c in enumerate(st.class_names)
           for e in range(st.num_experts) if st.class_top1[j, k, e]}
    assert got == joint
    np.testing.assert_allclose(st.mutual_information(), [mutual_information_by_hand(joint, j) for j in range(len(moe))],
                               atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_routing_stats_equals_the_twin_with_workers_and_a_resume(dtype, weights, twins, tmp_path):
    w = weights("reference", dtype)
    want = twin_routing(twins["reference"], TEXTS, byte_class)
    tol = 1e-12 if dtype == "float64" else 1e-4
    one = ke.routing_stats(w, TEXTS, progress=False)
    check_stats(one, want, tol)
    two = ke.routing_stats(w, TEXTS, progress=False, workers=2)
    check_stats(two, want, tol)
    np.testing.assert_allclose(two.weight_sum, one.weight_sum, atol=tol, rtol=0)  # (BLAS threads may round otherwise)
    path = tmp_path / "stats.npz"
    part = ke.routing_stats(w, TEXTS[:3], progress=False, workers=2, checkpoint=path, checkpoint_every=1)
    assert part.texts == json.loads(str(np.load(path)["header"]))["texts"] and len(part.texts) == 3
    resumed = ke.routing_stats(w, TEXTS, progress=False, workers=3, checkpoint=path)
    check_stats(resumed, want, tol)
    np.testing.assert_allclose(resumed.weight_sum, one.weight_sum, atol=tol, rtol=0)
    assert len(resumed.texts) == len(TEXTS)


# ---------------------------------------------------------------------------------------------- another vocabulary


@pytest.fixture(scope="module")
def vocab300(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("v300"), make_text_config(vocab_size=300),
                            seed=5)
    return path, ke.from_pretrained(path, device="cpu", dtype="float64"), Twin(path)


def test_a_vocabulary_of_300_ids(vocab300):
    """Ids past 255 (no byte meaning): the lens, the attribution and routing_stats (with its own classes)."""
    _, w, tw = vocab300
    ids = [299, 3, 256, 17, 298, 1, 280, 255]
    s = ke.Session(w)
    s.feed(ids[:5], chunk=2)
    for tok in ids[5:]:
        s.step(tok)
    runs = tw.run(ids)
    lens = ke.logit_lens(s, top=3, targets=np.array(ids[1:] + [-1]))
    want = np.array([log_softmax(r["lens"]) for r in runs])
    np.testing.assert_allclose(np.log(lens.top_probs), -np.sort(-want, axis=-1)[..., :3], atol=1e-10, rtol=0)
    np.testing.assert_allclose(lens.target_logprobs[:-1], [want[t, :, ids[t + 1]] for t in range(len(ids) - 1)],
                               atol=1e-10, rtol=0)
    a = ke.logit_attribution(s, 2, token=299)
    c, _, _ = tw.attribution(runs[2], 299)
    assert max(abs(a.contributions[k] - v) for k, v in c.items()) <= 1e-10
    classes = lambda i: "high" if i >= 256 else "low"  # noqa: E731
    texts = [ids, [], ids[::-1]]
    check_stats(ke.routing_stats(w, texts, classes=classes, progress=False, workers=2), twin_routing(tw, texts, classes),
                1e-12)
    with pytest.raises(ValueError, match=r"vocabulary \(300\) is not bytes"):
        ke.routing_stats(w, ["text"], classes=classes, progress=False)
    with pytest.raises(ValueError, match=r"default token classing is for byte models"):
        ke.routing_stats(w, [ids], progress=False)


# ---------------------------------------------------------------------------------------------- arguments (bugs)


def test_bug_attribution_of_a_step_given_twice_gives_two(ref_weights):
    """[3, 3] gave ONE Attribution: zip(steps, results) then paired the results with the wrong steps."""
    s = ke.Session(ref_weights)
    s.feed(TEXT[:8])
    got = ke.logit_attribution(s, [5, 3, -5, 1])
    assert [a.t for a in got] == [1, 3, 3, 5]
    assert got[1].contributions == got[2].contributions == ke.logit_attribution(s, 3).contributions


def test_bug_position_errors_name_the_function_and_argument(ref_weights):
    s = ke.Session(ref_weights)
    s.feed(TEXT[:8])
    with pytest.raises(IndexError, match=r"logit_attribution: t: token position 8 is outside .* 8 tokens"):
        ke.logit_attribution(s, 8)
    with pytest.raises(TypeError, match=r"logit_attribution: t: token position None \(NoneType\)"):
        ke.logit_attribution(s, None)
    with pytest.raises(TypeError, match=r"lens_at: t: token position 1.0 \(float\)"):
        ke.lens_at(s, 1.0)
    with pytest.raises(TypeError, match=r"lens_at: t: token position True \(bool\)"):
        ke.lens_at(s, True)
    with pytest.raises(ValueError, match=r"logit_lens: top must be a positive int .*got True"):
        ke.logit_lens(s, top=True)  # (a bool is an int: it reached top_ids, which raised 'an integer is required')
    with pytest.raises(ValueError, match=r"lens_at: top must be a positive int .*got 0"):
        ke.lens_at(s, 1, top=0)
    np.testing.assert_array_equal(ke.logit_lens(s, top=np.int64(2)).top_ids, ke.logit_lens(s, top=2).top_ids)
    np.testing.assert_array_equal(ke.lens_at(s, 3, top=np.int64(2)).top_ids, ke.lens_at(s, 3, top=2).top_ids)


def test_bug_the_lens_grid_labels_chosen_positions_with_their_positions(ref_weights):
    """A lens of positions [2, 9] was labelled 0 and 1 (the row numbers), as if it showed tokens 0 and 1."""
    from kimi_explore.views.figures.analysis_plots import lens_grid

    s = ke.Session(ref_weights)
    s.feed(TEXT[:12])
    fig = lens_grid(ke.logit_lens(s, top=1, positions=[9, 2]))
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == [f"2 #{TEXT[2]}", f"9 #{TEXT[9]}"]
    assert "2 chosen positions" in fig.axes[0].get_title()
    whole = [t.get_text() for t in lens_grid(ke.logit_lens(s, top=1)).axes[0].get_xticklabels()]
    assert whole == [f"{t} #{tok}" for t, tok in enumerate(TEXT[:12])]


def test_bug_routing_stats_class_labels_survive_a_resume(ref_weights, tmp_path):
    """A label a checkpoint cannot keep as it is: a NumPy int failed the save after the decoding ('not JSON
    serializable'); a tuple came back as a list, another class than the next call's tuple, so a resumed run split
    every class in two (and its MI changed)."""
    texts = ["ab cd", "ef", "g h i"]
    by_parity = lambda i: np.int64(i % 2)  # noqa: E731
    ke.routing_stats(ref_weights, texts[:2], classes=by_parity, progress=False, checkpoint=tmp_path / "c.npz")
    resumed = ke.routing_stats(ref_weights, texts, classes=by_parity, progress=False, checkpoint=tmp_path / "c.npz")
    whole = ke.routing_stats(ref_weights, texts, classes=by_parity, progress=False)
    assert resumed.class_names == whole.class_names == [1, 0]
    np.testing.assert_array_equal(resumed.class_top1, whole.class_top1)
    with pytest.raises(TypeError, match=r"routing_stats: classes\(97\) returned \('odd', 1\) \(tuple\)"):
        ke.routing_stats(ref_weights, texts, classes=lambda i: ("odd", i % 2), progress=False)


def test_bug_source_ablation_refuses_a_string_for_a_non_byte_model(vocab300):
    """A string was encoded as UTF-8 bytes whatever the vocabulary: ids of another model, analysed silently."""
    _, w, _ = vocab300
    with pytest.raises(ValueError, match=r"source_ablation: got a string, but the model's vocabulary \(300\) is not bytes"):
        ke.source_ablation(w, "hello", layers=[3])
    with pytest.raises(ValueError, match=r"source_ablation: token_ids: got bytes .*, but the model's vocabulary \(300\) "
                                         r"is not bytes"):
        ke.source_ablation(w, b"hello", layers=[3])
    s = ke.Session(w)
    s.feed([299, 3, 256])
    with pytest.raises(ValueError, match="got a string"):
        ke.source_ablation(s, "hello", layers=[3])


def test_bug_bytes_are_token_ids_only_for_a_byte_vocabulary(vocab300, trained_weights):
    """Session.feed (and a pipeline's forward_sequence) took b"hello" as the ids 104, 101, ... whatever the
    vocabulary: another tokenizer's ids, decoded silently. Every entry point now shares one rule (`token_indices`)."""
    _, w, _ = vocab300
    s = ke.Session(w)
    for feed in (s.feed, lambda ids: ke.kimi_forward_sequence(w, s.state, ids)):
        for raw in (b"hello", bytearray(b"hello")):
            with pytest.raises(ValueError, match=r"got (bytes|bytearray) b'hello', but the model's vocabulary \(300\) "
                                                 r"is not bytes: pass token ids"):
                feed(raw)
    assert len(s) == 0 and s.state.position == 0 and s.state.broken is None
    assert token_indices(memoryview(np.array([299, 3])), 300) == [299, 3]  # a buffer of integer ids stays ids
    byte_model = ke.Session(trained_weights, recorder=False)  # where the vocabulary is bytes, they are its ids
    np.testing.assert_array_equal(byte_model.feed(b"def f"), ke.Session(trained_weights, recorder=False).feed(list(b"def f")))
    np.testing.assert_array_equal(
        ke.kimi_forward_sequence(trained_weights, ke.KimiDecodeState.new(trained_weights), bytearray(b"def f")),
        ke.kimi_forward_sequence(trained_weights, ke.KimiDecodeState.new(trained_weights), list(b"def f")))


@pytest.mark.parametrize("mask", [(3, "ffn", "latest_block"), (6, "attn", "embedding"), (13, "ffn", "current")])
def test_lens_and_attribution_under_a_persistent_mask_equal_the_twin(mask, weights, twins):
    """A session whose persistent hooks mask a source family: the analyses replay with them, and see what the
    twin decoding with that family dropped from that mix sees."""
    from kimi_explore.inspection.source_masks import mask_sources

    runs = twins["reference"].run(TEXT[:10], mask=mask)
    s = ke.Session(weights("reference", "float64"), hooks=mask_sources(mask[0], mask[1], mask[2]))
    s.feed(TEXT[:6])
    for tok in TEXT[6:10]:
        s.step(tok)
    np.testing.assert_allclose(s.logits, [r["logits"] for r in runs], atol=1e-10, rtol=0)
    lens = ke.logit_lens(s, top=3)
    want = np.array([log_softmax(r["lens"]) for r in runs])
    np.testing.assert_allclose(np.log(lens.top_probs), -np.sort(-want, axis=-1)[..., :3], atol=1e-10, rtol=0)
    for a in ke.logit_attribution(s, [0, 4, 9]):
        c, source_of, p = twins["reference"].attribution(runs[a.t], a.token)
        assert a.source_of == source_of and max(abs(a.source_weights[k] - v) for k, v in p.items()) <= 1e-12
        assert max(abs(a.contributions[k] - v) for k, v in c.items()) <= 1e-10


def test_bug_routing_stats_refuses_another_models_tokenizer(ref_weights):
    """A tokenizer of 678 ids on a 256-id model: its ids below 256 were counted as this model's tokens (the others
    failed deep in the decoder, naming neither routing_stats nor the tokenizer); Session refuses it, so does this."""
    tok = ke.load_tokenizer(Path(__file__).parent / "data" / "tokenizer" / "synthetic_k3")
    with pytest.raises(ValueError, match=r"routing_stats: the tokenizer has 678 ids, the model's vocabulary 256"):
        ke.routing_stats(ref_weights, ["hello world"], tokenizer=tok, classes=str, progress=False)


def test_bug_a_temporary_intervention_of_small_effect_is_not_analysed_as_history(ref_weights):
    """A token decoded under a temporary hook that moved its logits by 3.5e-5 (below the replay check's tolerance)
    was analysed as if decoded without it: the attribution's 'decoder's logit' was not the one the session stored.
    Tokens decoded under value-changing hooks now replay bit for bit or are refused, as Session.recover does."""
    s = ke.Session(ref_weights)
    s.feed(TEXT[:11])
    tiny = ke.Hooks()
    tiny.add("layers.5.attn.out", lambda v, *, hook: v * (1 + 3e-5))
    with s.intervene(tiny):
        s.step(TEXT[11])
    s.step(TEXT[12])
    ke.logit_attribution(s, 10)  # before it: replays as stored
    for analysis in (lambda: ke.logit_attribution(s, 11), lambda: ke.lens_at(s, 11), lambda: ke.logit_lens(s)):
        with pytest.raises(ValueError, match="other logits at token 11 than the session stored"):
            analysis()
    kept = ke.Session(ref_weights, hooks=tiny)  # the same hook, persistent: replayed with it, bit for bit
    kept.feed(TEXT[:13])
    a = ke.logit_attribution(kept, 11)
    assert a.logit == float(kept.logits[11, a.token])
