"""A third review of the analyses: NaN histories, a token routed twice through one expert, the arguments of
`source_ablation` and `routing_stats`, and what the refusals and docstrings say. Each test failed before its fix
(checked against the analyses as they were, in a scratch copy of the package)."""

from __future__ import annotations

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore import interventions as iv
from kimi_explore.analysis import diff as diff_module

TEXT = list(b"abcdefgh")
NAN_AT = 3  # the position whose embedding gets a NaN


def nan_hooks() -> ke.Hooks:
    """A persistent hook that puts one NaN into the embedding of position NAN_AT (it spreads to every later token)."""
    def nan_at(v, *, hook):
        if hook.position == NAN_AT:
            v = v.copy()
            v[0] = np.nan
            return v
        return None

    h = ke.Hooks()
    h.add("embed", nan_at)
    return h


@pytest.fixture(scope="module")
def clean(trained_weights):
    """The same tokens without the hook, stepped as the hooked session decodes them (so bit for bit before NAN_AT)."""
    s = ke.Session(trained_weights)
    for token in TEXT:
        s.step(token)
    return s


@pytest.fixture(scope="module")
def poisoned(trained_weights):
    s = ke.Session(trained_weights, hooks=nan_hooks())
    s.feed(TEXT)
    return s


def test_the_nan_history_is_what_the_tests_assume(clean, poisoned):
    nan = np.isnan(np.asarray(poisoned.logits)).any(axis=-1)
    assert nan.tolist() == [t >= NAN_AT for t in range(len(TEXT))]
    # causal: the tokens before the NaN are the clean run's, bit for bit
    assert np.array_equal(np.asarray(poisoned.logits)[:NAN_AT], np.asarray(clean.logits)[:NAN_AT])


# ------------------------------------------------------------------ 1. diff: a NaN row has no top-1
@pytest.mark.parametrize("as_trace", [False, True], ids=["sessions", "traces"])
def test_diff_gives_a_nan_row_no_top1_and_counts_no_flip_there(clean, poisoned, as_trace):
    a, b = (clean.trace(), poisoned.trace()) if as_trace else (clean, poisoned)
    d = ke.diff(a, b)
    logits_a, logits_b = np.asarray(clean.logits), np.asarray(poisoned.logits)
    nan = np.isnan(logits_b).any(axis=-1)
    assert d.top1_b[nan].tolist() == [-1] * int(nan.sum())
    assert d.top1_b[~nan].tolist() == np.argmax(logits_b[~nan], axis=-1).tolist()
    assert d.top1_a.tolist() == np.argmax(logits_a, axis=-1).tolist()
    assert not d.flips.any() and d.summary()["top1_flips"] == 0  # the rows before the NaN are the same run
    back = ke.diff(b, a)
    assert back.top1_a[nan].tolist() == [-1] * int(nan.sum()) and not back.flips.any()


def test_logit_lens_final_ids_of_a_nan_row_is_minus_one(clean, poisoned):
    lens = ke.logit_lens(poisoned)
    logits = np.asarray(poisoned.logits)
    nan = np.isnan(logits).any(axis=-1)
    assert lens.final_ids[nan].tolist() == [-1] * int(nan.sum())
    assert lens.final_ids[~nan].tolist() == np.argmax(logits[~nan], axis=-1).tolist()


# ------------------------------------------------------------------ 2. a history holding NaN replays
def test_analyses_replay_a_history_holding_nan(clean, poisoned):
    lens, ref = ke.logit_lens(poisoned), ke.logit_lens(clean)
    assert np.array_equal(lens.top_ids[:NAN_AT], ref.top_ids[:NAN_AT])
    assert np.array_equal(lens.top_probs[:NAN_AT], ref.top_probs[:NAN_AT])
    assert np.isnan(lens.top_probs[-1]).any()  # the NaN reached the last token's lens
    strip = ke.lens_at(poisoned, 4)
    assert strip.t == 4 and np.isnan(strip.top_probs).any()
    assert np.array_equal(ke.lens_at(poisoned, 2).top_ids, ke.lens_at(clean, 2).top_ids)
    # one replay over steps before and after the NaN: the clean step is split as the clean run's
    before = ke.logit_attribution(poisoned, 2)
    assert before.contributions == ke.logit_attribution(clean, 2).contributions
    # a NaN logit has no top-1 and no split: said so, not blamed on hooks
    with pytest.raises(ValueError, match="logits at step 5 hold NaN") as e:
        ke.logit_attribution(poisoned, 5)
    assert "replaying" not in str(e.value)
    with pytest.raises(ValueError, match="token 7's logit is NaN"):
        ke.logit_attribution(poisoned, 5, token=7)


def test_a_nan_where_the_history_had_a_number_or_the_other_way_is_still_refused(trained_weights):
    removed = ke.Session(trained_weights, hooks=nan_hooks())
    removed.feed(TEXT)
    removed.hooks.clear()  # the replay now gives numbers where the history holds NaN
    with pytest.raises(ValueError, match=f"other logits at token {NAN_AT} .*NaN in one but not the other"):
        ke.logit_lens(removed)
    added = ke.Session(trained_weights)
    added.feed(TEXT)
    added.hooks.extend(nan_hooks())  # the replay now gives NaN where the history holds numbers
    with pytest.raises(ValueError, match=f"other logits at token {NAN_AT} .*NaN in one but not the other"):
        ke.lens_at(added, 5)


# ------------------------------------------------------------------ 3. one token routed twice through one expert
@pytest.fixture(scope="module")
def weights64():
    return ke.from_pretrained(ke.tiny_checkpoint(), device="cpu", dtype="float64")


def test_attribution_sums_the_shares_of_an_expert_routed_twice(weights64):
    text, t, site = list(b"abc = 12\n"), 4, "layers.3.moe.router.topk_ids"
    twice = ke.Hooks()
    twice.add(site, lambda v, *, hook: np.array([v[0], v[0]], dtype=v.dtype))
    dup = ke.Session(weights64, hooks=twice)
    dup.feed(text)
    routing = dup.trace().routing()
    j = list(routing["moe_layers"]).index(3)
    ids, wts = routing["topk_ids"][:, j], routing["topk_weights"][:, j]  # [T, 2]: (e, e), (w0, w1)
    assert (ids[:, 0] == ids[:, 1]).all()
    # the same routed output, as ONE selection of e with weight w0 + w1: e's leaf there is the sum of both shares
    once = ke.Hooks()
    once.add(site, lambda v, *, hook: np.array([v[0]], dtype=v.dtype))
    once.add("layers.3.moe.router.topk_weights",
             lambda v, *, hook: np.array([wts[hook.position].sum()], dtype=v.dtype))
    merged = ke.Session(weights64, hooks=once)
    merged.feed(text)
    got = ke.logit_attribution(dup, t)
    want = ke.logit_attribution(merged, t, token=got.token)
    leaf = f"layers.3.moe.experts.{int(ids[t, 0])}"
    assert leaf in got.contributions and set(got.contributions) == set(want.contributions)
    for name, value in want.contributions.items():
        assert got.contributions[name] == pytest.approx(value, rel=1e-9, abs=1e-9), name
    assert got.total() == pytest.approx(got.logit, rel=1e-9, abs=1e-9)


# ------------------------------------------------------------------ 4. source_ablation(layers=...)
@pytest.mark.parametrize("bad", [[3.7], ["3"], [True], [np.float64(3)], "3", 3.0, True],
                         ids=["float", "string-in-list", "bool", "numpy-float", "string", "bare-float", "bare-bool"])
def test_source_ablation_refuses_layers_that_are_not_ints(trained_weights, bad):
    with pytest.raises(TypeError, match="source_ablation: layers must be"):
        ke.source_ablation(trained_weights, "abcd", layers=bad)


def test_source_ablation_takes_one_layer_as_an_int(trained_weights):
    want = ke.source_ablation(trained_weights, "abcd", layers=[3])
    for one in (3, np.int64(3)):
        got = ke.source_ablation(trained_weights, "abcd", layers=one)
        assert got.rows == want.rows and got.meta["layers"] == [3] and type(got.meta["layers"][0]) is int
    assert {r["layer"] for r in want.rows} == {3}


# ------------------------------------------------------------------ 5. routing_stats(classes=...) labels
def test_routing_stats_refuses_a_nan_label(trained_weights):
    with pytest.raises(ValueError, match=r"classes\(97\) returned nan, a label not equal to itself"):
        ke.routing_stats(trained_weights, "abc", classes=lambda i: float("nan"), progress=False)


def test_routing_stats_keeps_labels_of_other_types_apart(trained_weights):
    label = {97: True, 98: 1, 99: 1.0}  # 'a', 'b', 'c': equal in Python, three classes (as a checkpoint keeps them)
    stats = ke.routing_stats(trained_weights, "abcab", classes=label.get, progress=False)
    assert [(type(c), c) for c in stats.class_names] == [(bool, True), (int, 1), (float, 1.0)]
    # each class holds its own tokens' top-1 choices: 'a' and 'b' twice, 'c' once, at every MoE layer
    assert stats.class_top1.sum(axis=2).tolist() == [[2, 2, 1]] * len(stats.moe_layers)


def test_routing_stats_resume_refuses_a_label_of_another_type(trained_weights, tmp_path):
    path = tmp_path / "stats.npz"
    ke.routing_stats(trained_weights, ["ab"], classes=lambda i: True, progress=False, checkpoint=path)
    with pytest.raises(ValueError, match="the checkpoint counted token id 97 in class True, this call's classes= puts it in 1"):
        ke.routing_stats(trained_weights, ["ab", "cd"], classes=lambda i: 1, progress=False, checkpoint=path)


# ------------------------------------------------------------------ 6. a hook attached after the history was decoded
def test_the_refusal_of_a_late_hook_says_hooks_were_added_since(trained_weights):
    s = ke.Session(trained_weights)
    s.feed(list(b"import numpy as np\n"))
    s.hooks.extend(iv.scale_kda_head(4, 0, 0.9))
    with pytest.raises(ValueError, match="replaying the session's history gives other logits") as e:
        ke.logit_lens(s)
    msg = str(e.value)  # (the old one said only "decoded under hooks the session no longer holds": the opposite)
    assert "or before hooks were added to or changed in session.hooks" in msg and "no longer holds" in msg


# ------------------------------------------------------------------ 7. RunDiff.routing_changes' t is a row
def test_routing_changes_t_is_a_row_and_the_doc_says_so(trained_weights):
    ids = list(b"class B(A):\n    def __init__(self):\n        super().__init__()\n")
    a, b = ke.Session(trained_weights), ke.Session(trained_weights, hooks=iv.ablate_experts(4, [0, 1, 2, 3]))
    a.feed(ids)
    b.feed(ids)
    window = ke.diff(a.trace(window=(10, 30)), b.trace(window=(10, 30)))
    whole = [c for c in ke.diff(a, b).routing_changes if 10 <= c[0] < 30]
    assert whole and [(int(window.positions[t]), *rest) for t, *rest in window.routing_changes] == whole
    assert "positions[t]" in diff_module.__doc__


# ------------------------------------------------------------------ 8. source_ablation on a layer subset
def test_source_ablation_names_column_0_of_a_subset_as_the_trace_does(trained_weights):
    sub = ke.from_pretrained(ke.tiny_checkpoint(), device="cpu", layers=range(4, 8))
    s = ke.Session(sub)
    s.feed(list(b"abcdef"))
    first = s.trace().source_labels()[0]
    boundary = next(i for i in sub.layer_ids if sub.config.layer_spec(i).is_block_boundary)
    assert first == f"input of layer {boundary}"  # (not the embedding: it holds the outputs of layers 4.. too)
    res = ke.source_ablation(s)
    at0 = [r for r in res.rows if r["columns"] == [0]]
    assert at0 and {r["family"] for r in at0} == {first}
    assert "embedding" not in res.families and first in res.families and first in res.table()
    assert res.by_family()[first]["n"] == len(at0)
    whole = ke.source_ablation(trained_weights, "abcdef", layers=[6])  # the whole model: column 0 is the embedding
    assert {r["family"] for r in whole.rows if r["columns"] == [0]} == {"embedding"}


@pytest.mark.parametrize("reuse_prefix", [True, False])
def test_source_ablation_takes_model_wide_integer_columns(weights64, reuse_prefix):
    """An integer family counts model-wide, as mask_sources' (`Trace.source_labels()`): the last column is the
    current sum at every site (the rows of the named family "current"), column 2 is block 2 where it is sealed
    (the rows of ("block", 2)); a block the model does not store is refused, as mask_sources refuses it."""
    ids, S = list(b"def f(x): return x"), weights64.max_sources
    run = lambda fams: ke.source_ablation(weights64, ids, families=fams, layers=[1, 4, 7],  # noqa: E731
                                          reuse_prefix=reuse_prefix).rows
    for integer, named in (([S - 1], "current"), ([-1], "current"), ([2], ("block", 2))):
        got, want = run([integer]), run([named])
        assert [(r["layer"], r["site"], r["columns"]) for r in got] == [(r["layer"], r["site"], r["columns"]) for r in want]
        assert [r["kl"] for r in got] == [r["kl"] for r in want] and got
    with pytest.raises(ValueError, match=r"\('block', 3\) does not exist"):
        run([("block", S - 1)])


def test_routing_stats_takes_enum_labels_as_their_values_and_resumes(trained_weights, tmp_path):
    """A StrEnum or IntEnum label is its value (what the JSON checkpoint keeps): a resumed run finds the classes it
    counted in (it was refused: 'other' in the checkpoint against <Kind.OTHER: 'other'>); True stays apart from 1."""
    import enum

    class Kind(str, enum.Enum):
        VOWEL = "vowel"
        OTHER = "other"

    class Level(enum.IntEnum):
        ONE = 1

    kind = lambda i: Kind.VOWEL if chr(i) in "aeiou" else Kind.OTHER  # noqa: E731
    texts = ["the cat sat", "on a mat"]
    path = tmp_path / "stats.json"
    first = ke.routing_stats(trained_weights, texts[:1], classes=kind, checkpoint=path)
    assert first.class_names == ["other", "vowel"] and all(type(c) is str for c in first.class_names)
    resumed = ke.routing_stats(trained_weights, texts, classes=kind, checkpoint=path)
    whole = ke.routing_stats(trained_weights, texts, classes=lambda i: "vowel" if chr(i) in "aeiou" else "other")
    assert resumed.class_names == whole.class_names and np.array_equal(resumed.class_top1, whole.class_top1)
    mixed = ke.routing_stats(trained_weights, texts[:1], classes=lambda i: Level.ONE if i % 2 else True)
    assert sorted(map(repr, mixed.class_names)) == ["1", "True"] and all(type(c) in (int, bool) for c in mixed.class_names)
