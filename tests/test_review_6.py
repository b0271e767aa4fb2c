"""Review round 6: files read and written (entries dropped behind their digests, raw zip members, a recorder refused
only after binding, the tokenizer checked last, links and threads at a save, scalars in a dump, unsaveable traces,
a checkpoint's suffix). Each test names what ran wrongly or was refused unclearly before."""

from __future__ import annotations

import os
import threading
import zipfile

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.analysis.routing_stats import RoutingStats, byte_class
from kimi_explore.inspection import session_io
from kimi_explore.inspection.npz_io import write_npz

TEXTS = ["def f(x):\n    return x\n", "for i in range(3):\n    print(i)\n", "import os\nprint(os.sep)\n"]


@pytest.fixture(scope="module")
def saved(trained_weights, tmp_path_factory):
    s = ke.Session(trained_weights)
    s.feed([1, 2, 3, 4, 5, 6, 7, 8])
    return s, s.save_state(tmp_path_factory.mktemp("saved") / "s.npz")


def _without(path, out, drop: str):
    """`path` rewritten by np.savez with entry `drop` left out, its `digests` entry kept as written."""
    with np.load(path) as z:
        np.savez(out, **{k: z[k] for k in z.files if k != drop})
    return out


# ---- an entry the digests list, dropped: read on as an older file's ----

def test_a_session_file_without_its_probe_entry_is_refused(saved, tmp_path, trained_weights):
    """Dropping `probe` (which a file from before it lacks) skipped the check that the weights are the saved ones: a
    session continued on other weights, logits 1.05 apart."""
    bad = _without(saved[1], tmp_path / "noprobe.npz", "probe")
    with pytest.raises(ValueError, match=r"noprobe\.npz: entries \['probe'\] were saved in this session state file and "
                                         r"are no longer in it"):
        ke.Session.load_state(bad, trained_weights)


def test_a_routing_checkpoint_without_its_classing_is_refused(trained_weights, tmp_path):
    """Dropping `classed` let a resume class the tokens otherwise (the intact file refuses that)."""
    good = tmp_path / "rs.npz"
    ke.routing_stats(trained_weights, TEXTS[:2], progress=False, checkpoint=good)
    bad = _without(good, tmp_path / "noclassed.npz", "classed")
    vowels = lambda i: "vowel" if chr(i) in "aeiou" else byte_class(i)  # noqa: E731
    with pytest.raises(ValueError, match=r"entries \['classed'\] were saved"):
        ke.routing_stats(trained_weights, TEXTS, progress=False, checkpoint=bad, classes=vowels)


def test_a_member_without_npy_framing_is_refused_naming_it(saved, tmp_path, trained_weights):
    """np.load gives such a member as raw bytes: the readers failed with AttributeError ('bytes' has no 'dtype')."""
    for entry in ("logits", "header"):
        out = tmp_path / f"raw_{entry}.npz"
        with np.load(saved[1]) as z, zipfile.ZipFile(out, "w") as w:
            for k in z.files:
                if k == "digests":
                    continue
                if k == entry:
                    w.writestr(k, z[k].tobytes())  # no .npy suffix or header: np.load gives bytes
                else:
                    with w.open(k + ".npy", "w") as f:
                        np.lib.format.write_array(f, z[k])
        with pytest.raises(ValueError, match=rf"raw_{entry}\.npz: entry '{entry}' is not an \.npy array \(found bytes\)"):
            ke.Session.load_state(out, trained_weights)


# ---- a load refused after the recorder was bound; the tokenizer checked last ----

def test_a_recorder_with_another_filter_is_refused_before_it_is_bound(saved, trained_weights):
    """An unbound recorder knows no sites, so every filter seemed to agree: the refusal came from restore(), naming
    neither the file nor the fix, and the recorder stayed bound to the half-built session."""
    rec = ke.Recorder(names_filter="layers.1.*")
    with pytest.raises(ValueError, match=r"Session\.load_state: .*s\.npz's records were made by a Recorder with other "
                                         r"settings.*names_filter=None.*pass recorder=True"):
        ke.Session.load_state(saved[1], trained_weights, recorder=rec)
    ke.Session(trained_weights, recorder=rec)  # free: a session takes it


def test_another_tokenizer_is_refused_before_the_state_is_built(trained_weights, tmp_path, monkeypatch):
    """The tokenizer was compared after every state was built and the probe token decoded (at K3: the state moved to
    the device and a full forward), where the README says the file is checked whole before anything is built."""
    tok = ke.load_tokenizer(trained_weights.source)
    s = ke.Session(trained_weights, tokenizer=tok)
    s.feed("x = 1\n")
    path = s.save_state(tmp_path / "tok.npz")

    class Other(type(tok)):
        fingerprint = "bytes/256-other"

    built = []
    monkeypatch.setattr(session_io, "probe_logits", lambda *a: built.append("probe"))
    with pytest.raises(ValueError, match="was saved with another tokenizer"):
        ke.Session.load_state(path, trained_weights, tokenizer=Other())
    assert built == []


# ---- writing ----

def test_a_save_to_a_symlink_writes_where_it_points(saved, tmp_path, trained_weights):
    """os.replace put a regular file in the link's place: the file it pointed to kept the old save."""
    s = saved[0].fork()
    (tmp_path / "real").mkdir()
    real, link = tmp_path / "real" / "state.npz", tmp_path / "state.npz"
    s.save_state(real)
    os.symlink(real, link)
    s.step(9)
    assert s.save_state(link) == link
    assert link.is_symlink()
    assert ke.Session.load_state(real, trained_weights).tokens == s.tokens


def test_threads_saving_to_one_path_do_not_share_a_temporary_file(tmp_path):
    """The temporary name held the pid alone: two threads of one process wrote into one file, and a save failed with
    FileNotFoundError naming the temporary file (2 of 20 trials)."""
    target, errors = tmp_path / "race.npz", []
    big = {f"a{i}": np.random.default_rng(i).random(200_000) for i in range(4)}
    small = {f"b{i}": np.arange(10.0) for i in range(4)}

    def save(arrays):
        try:
            write_npz(target, arrays, compressed=False)
        except Exception as e:  # noqa: BLE001 - what the test reports
            errors.append(e)

    for _ in range(10):
        threads = [threading.Thread(target=save, args=(a,)) for a in (big, small)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with np.load(target) as z:
            assert sorted(z.files) in (sorted([*big, "digests"]), sorted([*small, "digests"]))
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == ["race.npz"]


def test_write_dump_refuses_a_scalar_as_a_scalar(tmp_path):
    """np.ascontiguousarray made a 0-d value [1]: with one token it was written as a one-token row."""
    with pytest.raises(ValueError, match=r"write_dump: 'logits' is a scalar \(shape \(\)\)"):
        ke.write_dump(tmp_path / "d.safetensors", {"logits": np.float32(3.5)}, tokens=[7])
    with pytest.raises(FileNotFoundError, match=r"no such file \(a directory\)"):
        ke.read_dump(tmp_path)


def test_trace_save_names_what_it_cannot_write(tmp_path):
    """An object-dtype record failed in the digest ('Cannot change data-type for array of references') and an array in
    meta as 'Object of type ndarray is not JSON serializable', neither naming the record or the file."""
    t = ke.Trace({"note": np.array(["a", None], object)}, tokens=[1, 2])
    with pytest.raises(TypeError, match=r"Trace\.save: .*t\.npz: records \['note'\] hold Python objects"):
        t.save(tmp_path / "t")
    t = ke.Trace({"x": np.zeros((2, 3), np.float32)}, tokens=[1, 2], meta={"layer_ids": np.arange(3)})
    with pytest.raises(TypeError, match=r"Trace\.save: .*meta is not JSON .*meta keys \['layer_ids'\]"):
        t.save(tmp_path / "t")
    assert list(tmp_path.iterdir()) == []


def test_routing_stats_files_take_the_npz_suffix_as_sessions_and_traces_do(trained_weights, tmp_path):
    """RoutingStats.save('rs') wrote `rs`, where save_state and Trace.save write `rs.npz`; a checkpoint too."""
    r = ke.routing_stats(trained_weights, TEXTS[:1], progress=False, checkpoint=tmp_path / "ck")
    assert (tmp_path / "ck.npz").is_file() and not (tmp_path / "ck").exists()
    assert r.save(tmp_path / "rs") == tmp_path / "rs.npz"
    np.testing.assert_array_equal(RoutingStats.load(tmp_path / "rs").counts, r.counts)
    again = ke.routing_stats(trained_weights, TEXTS[:1], progress=False, checkpoint=tmp_path / "ck")  # resumed: done
    np.testing.assert_array_equal(again.counts, r.counts)
    with pytest.raises(IsADirectoryError, match=r"RoutingStats\.save: .* is a directory"):
        r.save(tmp_path)
    # a checkpoint saved before the suffix was added, under the name given: resumed and kept there
    (tmp_path / "ck.npz").rename(tmp_path / "old_ck")
    again = ke.routing_stats(trained_weights, TEXTS[:2], progress=False, checkpoint=tmp_path / "old_ck")
    assert not (tmp_path / "old_ck.npz").exists() and RoutingStats.load(tmp_path / "old_ck").tokens == again.tokens


# ---- the public API against its docstrings ----

def test_a_tuple_of_source_columns_masks_those_columns(trained_weights):
    """Any tuple was read as ('block', j): (0, 1) masked column 1 only, (0, 2, 3) nothing, (1,) raised IndexError."""
    site, ids = "layers.5.attn_res.ffn.weights", list(b"def add(a, b):\n")

    def weights(cols):
        rec = ke.Recorder(names_filter=site)
        rec.extend(ke.interventions.mask_sources(5, "ffn", cols))
        st = ke.KimiDecodeState.new(trained_weights)
        for t in ids:
            ke.kimi_forward_token(trained_weights, st, t, hooks=rec)
        return rec.trace()[site]

    np.testing.assert_array_equal(weights((0, 1)), weights([0, 1]))
    np.testing.assert_array_equal(weights({0, 1}), weights([0, 1]))  # (any collection of columns)
    np.testing.assert_array_equal(weights((1,)), weights([1]))
    assert (weights((0, 1))[:, :2] == 0).all()
    with pytest.raises(ValueError, match=r"non-empty list of int columns; got 0 \(one column: \[0\]\)"):
        ke.interventions.mask_sources(5, "ffn", 0)


def test_source_ablation_refuses_a_history_decoded_under_a_temporary_intervention(trained_weights):
    """Its clean run was checked to 1e-4 only: a token stepped under scale_kda_head(..., 1.001) (5.7e-5 off) was
    analysed as the history, where the docstring says such a history is refused, as the lens refuses it."""
    ids = list(b"def add(a, b):\n    return a + b\n")
    s = ke.Session(trained_weights)
    s.feed(ids[:10])
    with s.intervene(ke.interventions.scale_kda_head(1, 0, 1.001, positions=10)):
        s.step(ids[10])
    s.feed(ids[11:])
    with pytest.raises(ValueError, match="other logits at token 10 than the session stored"):
        ke.source_ablation(s, layers=[7], families=["current"])
    kept = ke.Session(trained_weights, hooks=ke.interventions.scale_kda_head(1, 0, 1.001, positions=10))
    kept.feed(ids[:10])
    kept.step(ids[10])
    kept.feed(ids[11:])  # decoded under the hooks it holds: analysed
    assert len(ke.source_ablation(kept, layers=[7], families=["current"])) == 2


def test_compare_predictions_refuses_a_history_and_k_0():
    """[T, vocab] logits were softmaxed as one vector of T * vocab 'ids' and plotted (ids past the vocabulary)."""
    logits = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    with pytest.raises(ValueError, match=r"base_logits must be one token's logits \[vocab\], got shape \[16, 256\]"):
        ke.plots.compare_predictions(logits, logits)
    with pytest.raises(ValueError, match="k .* must be an int >= 1, got 0"):
        ke.plots.compare_predictions(logits[0], logits[1], k=0)


def test_session_positions_are_checked(trained_weights):
    """runs(-5) gave a run (-5, 0); runs(0, 999) an IndexError; logits_at(len) a bare list IndexError, logits_at(True)
    row 1."""
    s = ke.Session(trained_weights)
    s.feed(list(b"def add(a, b):"))
    with pytest.raises(ValueError, match=r"Session\.runs: c must be an int in 0\.\.14"):
        list(s.runs(-5))
    with pytest.raises(ValueError, match=r"Session\.runs: t must be an int in 0\.\.14"):
        list(s.runs(0, 999))
    assert list(s.runs(3, 5)) == [(3, 5)]
    with pytest.raises(IndexError, match=r"logits_at: t: token position 14 is outside the session's history of 14 tokens"):
        s.logits_at(14)
    for bad in (True, 2.0):
        with pytest.raises(TypeError, match="logits_at: t: token position .* expected an int"):
            s.logits_at(bad)


def test_a_recorder_filter_that_selects_only_unrecorded_sites_is_refused(trained_weights):
    """names_filter='layers.3.attn.out' (a site, but no default record) recorded nothing without a word."""
    with pytest.raises(ValueError, match=r"names_filter 'layers\.3\.attn\.out' selects only sites a Recorder keeps "
                                         r"nothing of by default .*full='layers\.3\.attn\.out'"):
        ke.Session(trained_weights, recorder=ke.Recorder(names_filter="layers.3.attn.out"))
    s = ke.Session(trained_weights, recorder=ke.Recorder(names_filter="layers.3.attn.out", full="layers.3.attn.out"))
    s.feed(list(b"ab"))
    assert s.trace()["layers.3.attn.out"].shape == (2, trained_weights.config.hidden_size)
    ke.Session(trained_weights, recorder=ke.Recorder(names_filter="layers.3.*"))  # selects recorded sites too


def test_argument_errors_name_the_argument(trained_weights):
    s = ke.Session(trained_weights, tokenizer=ke.load_tokenizer(trained_weights))
    s.feed("def a")
    tr = s.trace()
    assert ke.plots.kda_state_curves(tr, layers=1) is not None  # one layer, as other plots take it
    assert set(tr.to_pandas(names="logits.top_ids")["name"]) == {"logits.top_ids"}  # not its letters
    with pytest.raises(TypeError, match=r"Explorer\.select: token must be an int history position, got 2\.0"):
        ke.Explorer(s).select(token=2.0)
    with pytest.raises(TypeError, match=r"memory_report: expected the weights .* got Session \(a session's are "
                                        r"session\.weights\)"):
        ke.memory_report(s)
    with pytest.raises(ValueError, match=r"layer 2 has the sites \['attn_res\.attn\.weights', 'attn\.in', 'kda\.conv'"):
        ke.Session(trained_weights, recorder=ke.Recorder(names_filter="layers.2.mla.*"))  # (not layers.2.mla.o)
    with pytest.raises(ValueError, match=r"tolerance=-1\.0: a float rtol must be > 0"):
        ke.compare(s, {"logits": s.logits}, tolerance=-1.0)
    lens = ke.logit_lens(s, positions=slice(0, 3))
    np.testing.assert_array_equal(lens.positions, [0, 1, 2])


# ---- the words around the analyses' numbers ----

def test_the_ablation_verdict_says_an_undefined_or_negative_correlation_as_such():
    """NaN and every negative rho fell through to 'mass not predicts importance', a -1 (mass ranks importance
    backwards) worded as a 0."""
    from kimi_explore.analysis.source_ablation import SourceAblation

    def rows(pairs):
        return [{"layer": i, "site": "ffn", "family": "current", "columns": [0], "n_sources": 2, "mass": m, "loss": 0.0,
                 "delta_loss": e, "kl": e} for i, (m, e) in enumerate(pairs)]

    first = lambda pairs: SourceAblation(rows(pairs), 10, 1.0).verdict().splitlines()[0]  # noqa: E731
    assert "is undefined (fewer than 3 cells" in first([(0.1, 0.4), (0.2, 0.3)])
    assert "is -1.00: the more mass a source gets, the less masking it matters" in first(
        [(0.1, 0.4), (0.2, 0.3), (0.3, 0.2), (0.4, 0.1)])
    assert "is 1.00: mass strongly predicts importance for this model" in first([(0.1, 0.1), (0.2, 0.2), (0.3, 0.3)])
    assert "mass does not predict importance" in first([(0.1, 0.2), (0.2, 0.4), (0.3, 0.1), (0.4, 0.3)])  # rho 0.0


def test_routing_load_is_undefined_before_any_token_and_look_inside_counts_its_text(trained_weights):
    """With no tokens max/mean and CV were 0.0 (CV 0 reads as perfectly balanced; max/mean is >= 1 by definition);
    look_inside's stats said '0 texts' for the one text it decoded."""
    from kimi_explore.analysis import learned

    empty = ke.routing_stats(trained_weights, [""], progress=False)
    assert np.isnan(empty.max_over_mean).all() and np.isnan(empty.cv).all()
    inside = learned.look_inside(trained_weights, "The cat sat.")
    assert len(inside.routing.texts) == 1
    counted = ke.routing_stats(trained_weights, ["The cat sat."], progress=False)
    assert inside.routing.texts == counted.texts
    np.testing.assert_array_equal(inside.routing.counts, counted.counts)


# ---- a pipeline's arguments, refused before any stage starts (no Ray needed) ----

def test_pipeline_stage_lists_read_iterators_once_and_name_a_negative_layer():
    """A part given as an iterator was read twice (refused as empty); a -1 was refused as 'not strictly increasing'."""
    from kimi_explore.distributed.pipeline import split_layers

    assert split_layers(list(range(8)), [range(0, 4), iter(range(4, 8))]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match=r"stages\[1\] holds layer -1; layer indices are 0-based"):
        split_layers(list(range(8)), [[0, 1, 2, 3], [-1, 4, 5, 6, 7]])


def test_pipeline_keyword_mistakes_are_refused_before_the_stages_start():
    """A typo (expert=) was reported by each stage after it started, as load_weights(); embedding= as 'multiple values'."""
    path = ke.tiny_checkpoint()
    with pytest.raises(TypeError, match=r"RayPipeline: unexpected keyword argument\(s\) \['expert'\]: from_pretrained "
                                        r"takes \['dtype', 'weight_dtype', 'experts'"):
        ke.RayPipeline(path, expert="mapped")
    with pytest.raises(TypeError, match=r"\['embedding'\] are set by RayPipeline itself"):
        ke.RayPipeline(path, embedding=False)
    with pytest.raises(ValueError, match="expert_cache_size=-2"):
        ke.RayPipeline(path, expert_cache_size=-2)


# ---- interventions across chunks ----

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_lens_accepts_tokens_decoded_under_held_hooks_after_a_chunk_fed_without_them(dtype):
    """The replay ran the chunk fed before the hooks were held on another route (a token-form hook, or one at
    kda.state, sends it token by token): its state rounded otherwise, and the next token, decoded under the held
    hooks and checked bit for bit, was refused as if decoded under hooks since removed (2.9e-6 off; 7e-15 in
    float64), naming the chunk's end, which no hook touched."""
    w = ke.from_pretrained(ke.tiny_checkpoint(), dtype=dtype)
    ids = list(b"def add(a, b):\n    return a + b\nprint(add(1, 2))\n")
    token_form = ke.Hooks()
    token_form.add("layers.3.attn.out", lambda v, *, hook: v * 2 if hook.position == 40 else None)
    for hooks in (token_form, ke.interventions.zero_kda_head(4, [1], positions=40)):
        s = ke.Session(w)
        s.feed(ids[:36], chunk=12, progress=False)
        with s.intervene(hooks):
            s.feed(ids[36:44], progress=False)  # stepped: held hooks take single tokens (or a layer's)
            lens = ke.logit_lens(s)
            np.testing.assert_array_equal(lens.top_ids[:, -1, 0], np.argmax(s.logits, axis=1))
            ke.logit_lens(s, positions=slice(30, 45))
        with pytest.raises(ValueError, match="other logits at token 40 than the session stored"):
            ke.logit_lens(s)  # (the hooks gone: token 40 was decoded under them)


def test_scale_kda_head_runs_only_its_layer_token_by_token(trained_weights, monkeypatch):
    """Its hooks took single tokens, so a chunk ran through every layer in the token form (stepping's speed), where
    the docs said its layer alone does."""
    from kimi_explore.model import kimi_sequence

    ran = {"chunked": 0, "by tokens": 0}
    for attr, key in (("sequence_layer", "chunked"), ("_layer_by_tokens", "by tokens")):
        real = getattr(kimi_sequence, attr)
        monkeypatch.setattr(kimi_sequence, attr,
                            lambda *a, _real=real, _key=key, **k: (ran.__setitem__(_key, ran[_key] + 1), _real(*a, **k))[1])
    ids = list(b"def f(x):\n    return x\n")
    fed = ke.kimi_forward_sequence(trained_weights, trained_weights.new_state(), ids,
                                   hooks=ke.interventions.zero_kda_head(1, 0, positions=[5]).bind(trained_weights))
    assert ran == {"chunked": 7, "by tokens": 1}
    stepped_state, hooks = trained_weights.new_state(), ke.interventions.zero_kda_head(1, 0, positions=[5]).bind(trained_weights)
    stepped = []
    for p, t in enumerate(ids):
        hooks.begin_token(t, p)
        stepped.append(ke.kimi_forward_token(trained_weights, stepped_state, t, hooks=hooks))
    np.testing.assert_allclose(fed, np.stack(stepped), atol=1e-4 * (1 + np.abs(stepped).max()))


# ---- the Recorder and Trace as a user reads them ----

def test_a_sessions_recorder_is_cut_by_the_session_only(trained_weights):
    """session.recorder.clear_records() (or .truncate(k)) left rows of positions 20..29 in a session of 20 tokens:
    a later truncate(25) kept them all (it cut by row count), truncate(10) too, a step appended position 10 after
    29, and the session's own file was then refused by load_state as damaged."""
    ids = list(b"The quick brown fox jumps over the lazy dog")
    s = ke.Session(trained_weights)
    s.feed(ids[:20], progress=False)
    rec = s.recorder
    for cut in (rec.clear_records, lambda: rec.truncate(5)):
        with pytest.raises(ValueError, match=r"this Recorder serves a Session, whose records line up with its tokens.*"
                                             r"session\.truncate\(n\)"):
            cut()
    s.truncate(10)
    assert s.trace().positions.tolist() == list(range(10))
    del s  # its session gone, a recorder may be cleared for another
    rec.clear_records()
    assert len(ke.Session(trained_weights, recorder=rec)) == 0


def test_conv_norms_name_their_layers_without_state_norms_or_meta(trained_weights):
    """An unbound recorder of kda.conv alone: kda_layers (read from '.kda.state.norm' records) was [], and
    kda_conv_norms() empty beside six conv-norm records."""
    rec = ke.Recorder(names_filter="layers.*.kda.conv")
    st = ke.KimiDecodeState.new(trained_weights)
    for t in b"hello":
        ke.kimi_forward_token(trained_weights, st, t, hooks=rec)
    tr = rec.trace()
    assert tr.kda_layers == [0, 1, 2, 4, 5, 6]
    assert tr.kda_conv_norms()[0].shape == (5, 6, 3, 4)


def test_a_trace_indexed_by_position_says_how_to_take_rows(trained_weights):
    s = ke.Session(trained_weights)
    s.feed(list(b"hello"), progress=False)
    for key in (0, slice(0, 5)):
        with pytest.raises(TypeError, match=r"Trace\[\.\.\.\] takes a record's name .*trace\.window\(a, b\)"):
            s.trace()[key]


def test_a_callable_filter_that_records_nothing_is_refused(trained_weights, tmp_path):
    """The glob 'layers.*.kda.q' was refused, its callable twin recorded nothing silently. A filter of no default site
    beside full= elsewhere records that, and one that selects no site says so itself: both stay accepted, and a
    session file of the latter (its callable kept as the empty list it chose) loads."""
    with pytest.raises(ValueError, match="selects only sites a Recorder keeps nothing of by default"):
        ke.Session(trained_weights, recorder=ke.Recorder(names_filter=lambda n: n.endswith(".kda.q")))
    s = ke.Session(trained_weights, recorder=ke.Recorder(names_filter="embed", full=["layers.3.attn.out"]))
    s.feed(list(b"ab"), progress=False)
    assert s.trace().names() == ["layers.3.attn.out"]
    s = ke.Session(trained_weights, recorder=ke.Recorder(names_filter=lambda n: False))
    s.feed([1, 2, 3], progress=False)
    assert len(ke.Session.load_state(s.save_state(tmp_path / "s.npz"), trained_weights)) == 3


# ---- generation arguments, and a download plan for a directory ----

def test_generate_arguments_are_named(trained_weights):
    """A 0-d array of stop tokens failed in NumPy ('iteration over a 0-d array'), None was refused with the hint
    '(None,)', a Fraction temperature was 'not a number', and bad seeds raised NumPy's messages naming no argument."""
    from fractions import Fraction

    s = ke.Session(trained_weights)
    s.feed([1, 2, 3], progress=False)
    with pytest.raises(TypeError, match=r"stop_tokens must be a collection of token ids, got array\(97\)"):
        s.generate(2, stop_tokens=np.array(97))
    assert len(s.fork().generate(2, stop_tokens=None)) == 2
    assert len(s.fork().generate(2, temperature=Fraction(1, 2), seed=0)) == 2
    for seed, kind in ((-1, ValueError), (1.5, TypeError)):
        with pytest.raises(kind, match=r"Session\.generate: seed must be None, an int >= 0"):
            s.generate(1, temperature=1.0, seed=seed)
    assert len(s) == 3  # (nothing decoded by a refused call)


def test_plan_download_of_a_local_directory_says_so(monkeypatch):
    """A relative directory shaped 'a/b' was taken for a Hub repo id, and refused saying it is not a local directory
    (online it would have asked the Hub for it); an absolute one was 'not a Hub repo id'."""
    from kimi_explore.weights.tiny_model import random_tiny_checkpoint

    path = random_tiny_checkpoint()
    monkeypatch.chdir(path.parent.parent)  # tests/: 'data/tiny_k3'
    for given in ("data/tiny_k3", path):
        with pytest.raises(ValueError, match=r"is a local directory: from_pretrained reads it as it is"):
            ke.plan_download(given, layers=[0])
