"""Adversarial review of every file the package writes and reads (besides a checkpoint's basic loading):
session states, traces, routing-stats checkpoints, engine dumps, GGUF files, tokenizer files, reports.

The rule each test pins: a damaged or foreign file is refused with an error naming the file (and the
entry, key or tensor), what was expected and what was found; nothing is left half-loaded; a write is
atomic where a partial file could later be read; round trips are exact. Every damage here loaded
silently, or failed with an error naming nothing, before its fix; a few tests pin refusals that already
held (files swapped between the two tiny models, float32 / float64, a layer subset) and the good copies
each damage starts from.
"""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest
from conftest import DATA, REFERENCE_DIR, undigested

import kimi_explore as ke
from kimi_explore import CheckpointError, ConfigError
from kimi_explore.analysis.routing_stats import byte_class
from kimi_explore.engines.dump import read_dump, write_dump
from kimi_explore.inspection.recorder import Recorder
from kimi_explore.inspection.session import Session
from kimi_explore.inspection.trace import Trace
from kimi_explore.tokenizer import TokenizerError
from kimi_explore.weights.gguf_io import GgufFile, write_gguf

TOKENS = [17, 203, 5, 88, 88, 141, 250, 3, 64, 199]


def rewrite(src, dst, change):
    """Copy the kimi_explore .npz `src` to `dst`, with `change(arrays, header)` applied to its entries and header."""
    arrays = undigested(src)
    header = json.loads(str(arrays.pop("header")))
    change(arrays, header)
    np.savez(dst, header=np.array(json.dumps(header)), **arrays)
    return dst


# ---------------------------------------------------------------- session states


@pytest.fixture(scope="module")
def saved_session(ref_weights, tmp_path_factory):
    """A session over the reference model with a fed chunk, stepped tokens, an MLA probs record and checkpoints."""
    s = Session(ref_weights, recorder=Recorder(full=["layers.2.mla.probs"]), checkpoint_every=3)
    s.feed(TOKENS[:5])
    s.step(TOKENS[5])
    s.step(TOKENS[6])
    return s, s.save_state(tmp_path_factory.mktemp("session") / "good.npz")


def _mla(header) -> int:
    return next(j for j, lay in enumerate(header["layout"]["state"]["layers"]) if lay["type"] == "MlaState")


def _kda(header) -> int:
    return next(j for j, lay in enumerate(header["layout"]["state"]["layers"]) if lay["type"] == "KdaState")


def _set(key, value):
    return lambda a, h: a.__setitem__(key, value(a[key]))


def _first_record(a, h, change):
    k = h["recorder"]["keys"][0]
    a[f"rec/{k}/flat"] = change(a[f"rec/{k}/flat"])


def _record(a, key, change):
    a[f"rec/{key}/flat"] = change(a[f"rec/{key}/flat"])


def _first_record_one_row_short(a, h):
    """The first record without its last token's row, its values and shapes still adding up."""
    k = h["recorder"]["keys"][0]
    shapes = a[f"rec/{k}/shapes"]
    a[f"rec/{k}/shapes"], a[f"rec/{k}/flat"] = shapes[:-1], a[f"rec/{k}/flat"][: -int(np.prod(shapes[-1]))]


SESSION_DAMAGE = {  # damage -> (change, what the error must say)
    "logits-short": (_set("logits", lambda x: x[:5]), r"logits float32\[5, 256\], expected float32\[7, 256\]"),
    "logits-narrow": (_set("logits", lambda x: x[:, :200]), r"logits float32\[7, 200\], expected float32\[7, 256\]"),
    "logits-float64": (_set("logits", lambda x: x.astype(np.float64)), r"logits float64\[7, 256\], expected float32"),
    "one-token-more": (lambda a, h: h["tokens"].append(4), r"'modified' is .*expected 8 booleans"),
    "token-outside-vocabulary": (lambda a, h: h["tokens"].__setitem__(2, 300), r"'tokens' is .*token ids in 0..255"),
    "modified-short": (lambda a, h: h.__setitem__("modified", h["modified"][:3]), r"'modified' is .*expected 7"),
    "chunk_of-short": (lambda a, h: h.__setitem__("chunk_of", h["chunk_of"][:3]), r"'chunk_of' is .*expected 7 ints"),
    "state-position": (lambda a, h: h["layout"]["state"].__setitem__("position", 5), r"layout 'state' .*position 7"),
    "checkpoint-past-the-end": (lambda a, h: h["layout"].__setitem__("ckpt9", h["layout"]["state"]),
                                r"layout entry 'ckpt9' .*t <= 7"),
    "mla-length": (lambda a, h: h["layout"]["state"]["layers"][_mla(h)]["scalars"].__setitem__("length", 6),
                   r"saved state layer \d+ caches 6 positions, its state is at position 7"),
    "unknown-scalar": (lambda a, h: h["layout"]["state"]["layers"][_kda(h)]["scalars"].__setitem__("length", 7),
                       r"saved state layer 0 \(KdaState\) scalars \{'length': 7\}"),
    "kda-state-transposed": (lambda a, h: a.__setitem__("state/0/conv", np.ascontiguousarray(a["state/0/conv"].swapaxes(1, 2))),
                             r"saved state layer 0 conv: float32\[3, 4, 128\], these weights need float32\[3, 128, 4\]"),
    "kda-state-float64": (lambda a, h: a.__setitem__("state/0/recurrent", a["state/0/recurrent"].astype(np.float64)),
                          r"saved state layer 0 recurrent: float64\[.*these weights need float32"),
    "mla-head-dim": (lambda a, h: a.__setitem__(f"state/{_mla(h)}/keys", a[f"state/{_mla(h)}/keys"][..., :-1]),
                     r"saved state layer \d+ keys: float32\[.*these weights need float32\[\d+, positions, "),
    "record-one-value-short": (lambda a, h: _first_record(a, h, lambda x: x[:-1]), r"row shapes hold \d+ values, the flat"),
    "record-tokens-short": (lambda a, h: h["recorder"].__setitem__("tokens", h["recorder"]["tokens"][:2]),
                            r"the records hold tokens \[\d+, \d+\] and positions \[0, 1, .*expected the file's 7 tokens"),
    "record-tokens-other": (lambda a, h: h["recorder"].__setitem__("tokens", [7] * len(h["recorder"]["tokens"])),
                            r"the records hold tokens \[7, 7, .*expected the file's 7 tokens \[(?!7,)"),
    "record-positions-str": (lambda a, h: h["recorder"].__setitem__("positions", [str(p) for p in h["recorder"]["positions"]]),
                             r"and positions \['0', '1'.* and 7 int positions"),
    "record-row-short": (_first_record_one_row_short,
                         r"shapes int64\[6, \d\].*expected \[7 rows \(one per token\) or none"),
    "record-top-k": (lambda a, h: h["recorder"].__setitem__("top_k", 3), r"'logits.top_ids' has rows of \[\d+\] predictions, "
                     r"the header's top_k 3"),
    "record-values-float64": (lambda a, h: _record(a, "logits.top_probs", lambda x: x.astype(np.float64)),
                              r"'logits.top_probs' holds float64 values, expected float32"),
    "record-ids-float": (lambda a, h: _record(a, "layers.1.moe.router.topk_ids", lambda x: x.astype(np.float32)),
                         r"'layers.1.moe.router.topk_ids' holds float32, expected ints in \[0, 8\)"),
    "record-ids-past-the-experts": (lambda a, h: _record(a, "layers.1.moe.router.topk_ids", lambda x: x + 16),
                                    r"'layers.1.moe.router.topk_ids' holds int64 in \[1\d, \d\d\], expected ints in \[0, 8\)"),
    "record-ids-past-the-vocabulary": (lambda a, h: _record(a, "logits.top_ids", lambda x: -x - 1),
                                       r"'logits.top_ids' holds int64 in \[-\d+, -\d+\], expected ints in \[0, 256\)"),
    "recorder-not-a-dict": (lambda a, h: h.__setitem__("recorder", [1, 2]), r"the header's 'recorder' is a list"),
    "recorder-key-missing": (lambda a, h: h["recorder"].pop("top_k"), r"the header's 'recorder' lacks 'top_k'"),
    "state-entry-missing": (lambda a, h: a.pop("state/0/conv"), r"no entry 'state/0/conv'"),
    "record-entry-missing": (lambda a, h: a.pop(f"rec/{h['recorder']['keys'][1]}/shapes"), r"no entry 'rec/.*/shapes'"),
    "header-key-missing": (lambda a, h: h.pop("layout"), r"header lacks \['layout'\]"),
    "fingerprint-not-a-dict": (lambda a, h: h.__setitem__("fingerprint", "b43bcc547bf8789b"),
                               r"the header's fingerprint is 'b43bcc547bf8789b', expected"),
    "cut-tail-of-no-chunk": (lambda a, h: h.__setitem__("cut_tails", {"3": [5]}),
                             r"'cut_tails' is \{'3': \[5\]\}, expected \{first token of a fed chunk \[0\]"),
    "route-of-a-stepped-token": (lambda a, h: h.__setitem__("routes", {"5": ["layers.2.mla.probs"]}),
                                 r"'routes' is .*expected \{first token of a fed chunk \[0\]: \[site names\]\}"),
}


@pytest.mark.parametrize("damage", list(SESSION_DAMAGE))
def test_a_damaged_session_file_is_refused_naming_the_file_and_what_differs(ref_weights, saved_session, tmp_path, damage):
    """Each damage loaded silently (a history whose logits, tokens, states or records disagree: a wrong session
    that runs) or failed in NumPy or in a dict lookup, naming neither the file nor the entry."""
    change, says = SESSION_DAMAGE[damage]
    bad = rewrite(saved_session[1], tmp_path / "bad.npz", change)
    rec = Recorder()
    with pytest.raises(ValueError, match=re.escape(str(bad)) + ".*" + says):
        Session.load_state(bad, ref_weights, recorder=rec)
    assert rec.n_tokens == 0  # a failed load changes nothing it was given


class _CountingPuts:
    """Weights that count the states placed on them (a pipeline ships each to its stages)."""

    def __init__(self, weights):
        self._w, self.puts = weights, 0

    def __getattr__(self, name):
        return getattr(self._w, name)

    def put_state(self, state):
        self.puts += 1
        return self._w.put_state(state)


def test_a_session_file_failing_its_last_check_places_no_state_on_the_weights(ref_weights, saved_session, tmp_path):
    """The live state was placed on the weights (for a pipeline: shipped to its stages) before a checkpoint further
    in the file was found damaged: a load that fails now places nothing."""
    from kimi_explore.inspection.session_io import load_session

    with np.load(saved_session[1]) as z:
        last = max(int(k.split("/")[0][4:]) for k in z.files if k.startswith("ckpt"))
    bad = rewrite(saved_session[1], tmp_path / "bad.npz",
                  _set(f"ckpt{last}/0/recurrent", lambda x: x.astype(np.float64)))
    counting = _CountingPuts(ref_weights)
    with pytest.raises(ValueError, match=rf"saved ckpt{last} layer 0 recurrent: float64"):
        load_session(bad, counting)
    assert counting.puts == 0
    load_session(saved_session[1], counting)
    assert counting.puts == 1 + len([k for k in json.loads(str(np.load(saved_session[1])["header"]))["layout"]
                                     if k != "state"])


def test_the_undamaged_file_loads_and_decodes_on_bit_for_bit(ref_weights, saved_session):
    s, path = saved_session
    t = Session.load_state(path, ref_weights)
    assert t.tokens == s.tokens and t.logits.view(np.uint32).tobytes() == s.logits.view(np.uint32).tobytes()
    assert t.trace().equals(s.trace())
    a, b = s.fork(), t
    assert np.array_equal(a.step(TOKENS[7]).view(np.uint32), b.step(TOKENS[7]).view(np.uint32))
    a.truncate(4)
    b.truncate(4)
    assert np.array_equal(a.feed(TOKENS[:3]).view(np.uint32), b.feed(TOKENS[:3]).view(np.uint32))


@pytest.mark.parametrize("how", ["callable", "selects-nothing"])
def test_a_session_recording_with_a_callable_filter_loads_recording_the_same_sites(ref_weights, tmp_path, how):
    """A callable names_filter / full cannot go into the header: the file said "the default", so the loaded
    session recorded every default site while its saved records held the filter's few, and its trace failed
    after the next step ("record ... has (1,) rows, expected 4"). The file now holds the site names the callable
    selected."""
    flt = (lambda n: n.startswith("layers.0.")) if how == "callable" else (lambda n: False)
    s = Session(ref_weights, recorder=Recorder(names_filter=flt, full=lambda n: n == "layers.2.mla.probs"))
    s.feed(TOKENS[:3])
    t = Session.load_state(s.save_state(tmp_path / "s.npz"), ref_weights)
    s.step(TOKENS[3])
    t.step(TOKENS[3])
    assert t.trace().equals(s.trace()) and t.trace().names() == s.trace().names()
    assert "layers.2.mla.probs" in t.trace()  # `full` records whatever names_filter says


@pytest.mark.parametrize("damage", ["truncated", "cut-at-the-end", "flipped-byte", "empty", "not-an-npz"])
def test_a_truncated_or_corrupt_session_file_names_the_file(ref_weights, saved_session, tmp_path, damage):
    """These raised zipfile.BadZipFile / EOFError / pickle complaints that named no file (a zip member's CRC
    finds a flipped byte: the error now names the entry too)."""
    data = saved_session[1].read_bytes()
    bad = tmp_path / "bad.npz"
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "cut-at-the-end":
        bad.write_bytes(data[:-7])
    elif damage == "flipped-byte":
        with np.load(saved_session[1]) as z:
            assert "logits" in z.files
        raw = bytearray(data)
        at = data.index(b"logits.npy") + 200  # inside the logits entry's bytes
        raw[at] ^= 0x40
        bad.write_bytes(bytes(raw))
    elif damage == "empty":
        bad.write_bytes(b"")
    else:
        bad.write_text("tokens,logits\n1,2\n")
    says = r"entry 'logits' is damaged" if damage == "flipped-byte" else r"not a complete \.npz archive"
    with pytest.raises(ValueError, match=re.escape(str(bad)) + ".*" + says):
        Session.load_state(bad, ref_weights)


def test_a_session_file_of_the_other_tiny_model_or_dtype_is_refused(ref_weights, tiny_weights, tmp_path):
    """Swapping files between the two tiny models (same architecture family, other config and weights) and
    between float32 and float64 of the same model."""
    s = Session(tiny_weights)
    s.feed(TOKENS[:3])
    path = s.save_state(tmp_path / "tiny.npz")
    with pytest.raises(ValueError, match="different model than these weights.*config"):
        Session.load_state(path, ref_weights)
    with pytest.raises(ValueError, match="different model than these weights.*config"):
        Session.load_state(Session(ref_weights).save_state(tmp_path / "ref.npz"), tiny_weights)
    ref64 = ke.from_pretrained(REFERENCE_DIR, device="cpu", dtype="float64")
    with pytest.raises(ValueError, match=r"different model than these weights \(dtype: file 'float32', weights 'float64'"):
        Session.load_state(tmp_path / "ref.npz", ref64)


def test_an_interrupted_save_leaves_the_previous_file_whole(ref_weights, saved_session, tmp_path, monkeypatch):
    """save_state wrote straight into the target: a save that failed halfway (disk full, an interrupt) destroyed
    the good file it was replacing. Now it writes beside it and renames."""
    s, good = saved_session
    target = tmp_path / "s.npz"
    target.write_bytes(good.read_bytes())

    def fails_halfway(file, *args, **kw):
        fh = open(file, "wb") if isinstance(file, (str, bytes)) or hasattr(file, "__fspath__") else file
        fh.write(b"PK\x03\x04 half a zip")
        fh.flush()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", fails_halfway)  # (session files are stored, not deflated)
    monkeypatch.setattr(np, "savez_compressed", fails_halfway)
    with pytest.raises(OSError, match="No space left"):
        s.save_state(target)
    monkeypatch.undo()
    assert target.read_bytes() == good.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.npz"]  # no temporary file left behind


# ---------------------------------------------------------------- traces


@pytest.fixture(scope="module")
def saved_trace(ref_weights, tmp_path_factory):
    s = Session(ref_weights, recorder=Recorder(full=["layers.2.mla.probs"]))
    s.feed(TOKENS[:4])
    trace = s.trace()
    return trace, trace.save(tmp_path_factory.mktemp("trace") / "t.npz")


TRACE_DAMAGE = {
    "positions-short": (_set("positions", lambda x: x[:-1]), r"tokens int64\[4\] and positions int64\[3\]"),
    "positions-float": (_set("positions", lambda x: x.astype(np.float64)), r"positions float64\[4\]: expected two integer"),
    "record-rows-short": (lambda a, h: a.__setitem__("record/layers.2.mla.probs", a["record/layers.2.mla.probs"][:3]),
                          r"record 'layers.2.mla.probs' has \(3,\) rows, expected 4"),
    "record-missing": (lambda a, h: a.pop("record/layers.2.mla.probs"), r"no entry 'record/layers.2.mla.probs'"),
    "header-without-meta": (lambda a, h: h.pop("meta"), r"header lacks \['meta'\]"),
    "meta-not-a-dict": (lambda a, h: h.__setitem__("meta", ["layer_ids"]), r"meta of type list; expected"),
}


@pytest.mark.parametrize("damage", list(TRACE_DAMAGE))
def test_a_damaged_trace_file_is_refused_naming_the_file(saved_trace, tmp_path, damage):
    """Positions of another length loaded silently (a trace whose rows sit at the wrong positions: `patch` from it
    patches the wrong tokens); the other damages failed naming no file."""
    change, says = TRACE_DAMAGE[damage]
    bad = rewrite(saved_trace[1], tmp_path / "bad.npz", change)
    with pytest.raises(ValueError, match=re.escape(str(bad)) + ".*" + says):
        Trace.load(bad)


def test_a_trace_round_trips_exactly_and_a_truncated_one_names_the_file(saved_trace, tmp_path):
    trace, path = saved_trace
    back = Trace.load(path)
    assert back.equals(trace) and back.meta == trace.meta and back.positions.tolist() == trace.positions.tolist()
    bad = tmp_path / "cut.npz"
    bad.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=re.escape(str(bad)) + r": not a complete \.npz archive"):
        Trace.load(bad)


# ---------------------------------------------------------------- routing-stats checkpoints

TEXTS = ["The cat, 12 cats.\n", "Hello world!", "a b c\n\n9", "Zz-top 0"]


def test_resuming_with_another_classing_is_refused(ref_weights, tmp_path):
    """The checkpoint kept its class names and counts but not how tokens were classed: a resume with another
    `classes=` added its counts to the first classing's classes (class_top1 and the mutual information of two
    classings mixed), silently."""
    path = tmp_path / "stats.npz"
    ke.routing_stats(ref_weights, TEXTS[:2], progress=False, checkpoint=path)
    vowels = lambda i: "vowel" if chr(i) in "aeiou" else byte_class(i)  # noqa: E731
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": the checkpoint counted token id \d+ in class "
                                         r"'letter', this call's classes= puts it in 'vowel'"):
        ke.routing_stats(ref_weights, TEXTS, progress=False, checkpoint=path, classes=vowels)
    done = ke.RoutingStats.load(path)
    assert len(done.texts) == 2  # nothing was counted
    resumed = ke.routing_stats(ref_weights, TEXTS, progress=False, checkpoint=path)  # the same classing resumes
    full = ke.routing_stats(ref_weights, TEXTS, progress=False)
    np.testing.assert_array_equal(resumed.class_top1, full.class_top1)
    assert resumed.classed == full.classed == {i: full.class_names.index(byte_class(i))
                                               for i in {b for t in TEXTS for b in t.encode()}}


@pytest.mark.parametrize("other", ["float64", "layers-0-5", "random-tiny"])
def test_a_routing_stats_checkpoint_of_another_dtype_layer_subset_or_model_is_refused(ref_weights, tiny_weights,
                                                                                      tmp_path, other):
    path = tmp_path / "stats.npz"
    ke.routing_stats(ref_weights, TEXTS[:2], progress=False, checkpoint=path)
    w = {"float64": lambda: ke.from_pretrained(REFERENCE_DIR, device="cpu", dtype="float64"),
         "layers-0-5": lambda: ke.from_pretrained(REFERENCE_DIR, device="cpu", layers=range(6)),
         "random-tiny": lambda: tiny_weights}[other]()
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": this routing-stats checkpoint was made with another "
                                         "model"):
        ke.routing_stats(w, TEXTS, progress=False, checkpoint=path)


def _stats_change(key, value):
    return lambda a, h: a.__setitem__(key, value(a[key]))


STATS_DAMAGE = {
    "counts-of-fewer-experts": (_stats_change("counts", lambda x: x[:, :-1]), r"counts is int64\[\d+, \d+\], expected int64"),
    "counts-float": (_stats_change("counts", lambda x: x.astype(np.float64)), r"counts is float64"),
    "class_top1-of-other-classes": (lambda a, h: h["class_names"].append("extra"), r"class_top1 is int64\[\d+, 5, \d+\], "
                                    r"expected int64\[\d+, 6, \d+\]"),
    "texts-not-digests": (lambda a, h: h.__setitem__("texts", [1, 2]), r"texts \[1, 2\]: expected .* sha1 digests"),
    "header-key-missing": (lambda a, h: h.pop("top_k"), r"header lacks \['top_k'\]"),
    "a-class-name-twice": (lambda a, h: h["class_names"].__setitem__(1, h["class_names"][0]),
                           r"expected layer ids, experts > 0, 0 < top_k <= experts and distinct class names"),
    "weight_sum-missing": (lambda a, h: a.pop("weight_sum"), r"no entry 'weight_sum'"),
}


@pytest.mark.parametrize("damage", list(STATS_DAMAGE))
def test_a_damaged_routing_stats_checkpoint_is_refused(ref_weights, tmp_path, damage):
    """These loaded (a resume then added to arrays of the wrong shape or type, or failed in NumPy) or raised a
    KeyError naming no file."""
    good = tmp_path / "good.npz"
    ke.routing_stats(ref_weights, TEXTS, progress=False, checkpoint=good)
    change, says = STATS_DAMAGE[damage]
    bad = rewrite(good, tmp_path / "bad.npz", change)
    with pytest.raises(ValueError, match=re.escape(str(bad)) + ".*" + says):
        ke.RoutingStats.load(bad)
    bad.write_bytes(good.read_bytes()[:-40])
    with pytest.raises(ValueError, match=re.escape(str(bad)) + r": not a complete \.npz archive"):
        ke.RoutingStats.load(bad)


# ---------------------------------------------------------------- GGUF files

GGUF = DATA / "engines" / "d" / "llamacpp" / "model-mxfp4.gguf"


def gguf_copy(path, *, meta=None, types=None, change=None):
    """Set d's MXFP4 GGUF rewritten by `write_gguf`, with metadata values set and `change(tensors)` applied to the
    [(name, ne, type, raw bytes)] list."""
    f = GgufFile(GGUF)
    m, t = {**f.metadata, **(meta or {})}, {**f.types, **(types or {})}
    tensors = [(n, x.ne, x.type, f.raw(n).tobytes()) for n, x in f.tensors.items()]
    write_gguf(path, m, t, change(tensors) if change else tensors)
    return path


def test_the_rewritten_gguf_loads_to_the_same_bits(tmp_path):
    """The helper's copy is a good file: each refusal below is the damage's."""
    a = ke.from_pretrained(gguf_copy(tmp_path / "copy.gguf"), device="cpu")
    b = ke.from_pretrained(GGUF, device="cpu")
    sa, sb = ke.KimiDecodeState.new(a), ke.KimiDecodeState.new(b)
    for t in TOKENS[:3]:
        assert np.array_equal(ke.kimi_forward_token(a, sa, t).view(np.uint32), ke.kimi_forward_token(b, sb, t).view(np.uint32))


def test_a_gguf_naming_a_tensor_twice_is_refused(tmp_path):
    """The later tensor of a name replaced the earlier one silently (here layer 0's norm read from layer 1's bytes:
    a wrong model that runs); llama.cpp refuses such a file."""
    def twice(ts):
        layer1 = next(t for t in ts if t[0] == "blk.1.attn_norm.weight")
        return ts + [("blk.0.attn_norm.weight", layer1[1], layer1[2], layer1[3])]

    path = gguf_copy(tmp_path / "twice.gguf", change=twice)
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + r": corrupt GGUF header: tensor "
                                              r"'blk.0.attn_norm.weight' appears twice"):
        ke.from_pretrained(path, device="cpu")


class _TwiceKey(dict):
    """Metadata whose `items()` gives one key twice (a GGUF writer's bug, or a damaged header)."""

    def __init__(self, base, key, value):
        super().__init__(base)
        self.extra = (key, value)

    def items(self):
        return [*super().items(), self.extra]

    def __len__(self):
        return super().__len__() + 1


def test_a_gguf_giving_a_metadata_key_twice_is_refused(tmp_path):
    """The later value won silently: here a second expert_used_count (top-3 of 8 instead of top-2), a model
    that runs; llama.cpp refuses such a file."""
    f = GgufFile(GGUF)
    path = tmp_path / "key.gguf"
    tensors = [(n, x.ne, x.type, f.raw(n).tobytes()) for n, x in f.tensors.items()]
    write_gguf(path, _TwiceKey(f.metadata, "kimi-k3.expert_used_count", 3), f.types, tensors)
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + r": corrupt GGUF header: metadata key "
                                              r"'kimi-k3.expert_used_count' appears twice"):
        ke.from_pretrained(path, device="cpu")


def test_a_gguf_tensor_offset_pointing_into_another_tensor_is_refused(tmp_path):
    """A damaged offset field that lands on another tensor of the same size made this tensor read the other's
    bytes (layer 1's norm = layer 0's here): loaded silently. Offsets must follow one another, as llama.cpp
    requires."""
    path = gguf_copy(tmp_path / "offset.gguf")
    f = GgufFile(path)
    a, b = f.tensors["blk.0.attn_norm.weight"], f.tensors["blk.1.attn_norm.weight"]
    assert a.ne == b.ne and a.type == b.type
    raw = bytearray(path.read_bytes())
    name = b"blk.1.attn_norm.weight"
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4 + 8 * len(b.ne) + 4  # its offset field
    assert struct.unpack_from("<Q", raw, at)[0] == b.begin - f.data_start
    struct.pack_into("<Q", raw, at, a.begin - f.data_start)
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + r": corrupt GGUF header: tensor "
                                              r"'blk.1.attn_norm.weight' starts at data offset \d+, expected \d+"):
        ke.from_pretrained(path, device="cpu")


@pytest.mark.parametrize("value,vtype", [(14.0, 6), ("14", 8)], ids=["float", "string"])
def test_a_gguf_block_count_of_another_type_is_named(tmp_path, value, vtype):
    """A float block_count failed in range() ("'float' object cannot be interpreted as an integer"), a string one
    with a head_count_kv error that said 14 layers were wanted and 14 found."""
    path = gguf_copy(tmp_path / "n.gguf", meta={"kimi-k3.block_count": value}, types={"kimi-k3.block_count": vtype})
    with pytest.raises(ConfigError, match=re.escape(str(path)) + r": kimi-k3.block_count is "
                                          + re.escape(repr(value)) + r" \(\w+\), expected a positive integer"):
        ke.from_pretrained(path, device="cpu")


# ---------------------------------------------------------------- engine dumps and safetensors headers


def _dump(tmp_path, tokens="72,105,33"):
    T = len(tokens.split(","))
    arrays = {"logits": np.arange(T * 4, dtype=np.float32).reshape(T, 4), "embed": np.ones((T, 2), np.float64)}
    return write_dump(tmp_path / "d.safetensors", arrays, tokens=[int(t) for t in tokens.split(",")], engine="mine")


def _set_header(path, change):
    """Rewrite a safetensors file's JSON header text with `change(text) -> text` (the data section kept)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = change(raw[8 : 8 + n].decode()).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    return path


@pytest.mark.parametrize("tokens", ["72,,105,33", "72,105,-33"], ids=["an-empty-piece", "a-negative-id"])
def test_a_dump_whose_token_ids_are_not_ids_is_refused(tmp_path, tokens):
    """'72,,105,33' read as [72, 105, 33] (the empty piece dropped: an id left out, as parse_ids once did) and a
    negative id was taken as it is."""
    path = _dump(tmp_path)
    meta = '"tokens":"72,105,33"'
    _set_header(path, lambda text: text.replace(meta, f'"tokens":"{tokens}"'))
    with pytest.raises(ValueError, match=re.escape(f"engine dump {path}: metadata 'tokens' must be comma-separated ids "
                                                   f">= 0, found {tokens!r}")):
        read_dump(path)
    _set_header(path, lambda text: text.replace(f'"tokens":"{tokens}"', '"tokens":"72,105,33,"'))
    assert read_dump(path).tokens == [72, 105, 33]  # a trailing comma is fine


def test_a_dump_with_overlapping_tensor_data_names_the_file(tmp_path):
    """The safetensors library's own complaint ("invalid offset for tensor `embed`") named no file."""
    path = _dump(tmp_path)
    _set_header(path, lambda text: re.sub(r'("logits":\{[^}]*"data_offsets":)\[\d+,\d+\]', r"\1[0,48]", text))
    with pytest.raises(ValueError, match=re.escape(str(path)) + r".*(overlap|invalid offset)"):
        read_dump(path)


def test_an_interrupted_write_dump_leaves_the_previous_dump_whole(tmp_path, monkeypatch):
    import safetensors.numpy

    path = _dump(tmp_path)
    good = path.read_bytes()

    def fails_halfway(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(good[:40])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", fails_halfway)
    with pytest.raises(OSError, match="No space left"):
        write_dump(path, {"logits": np.zeros((3, 4), np.float32)}, tokens=[1, 2, 3])
    monkeypatch.undo()
    assert path.read_bytes() == good and read_dump(path).tokens == [72, 105, 33]
    assert [p.name for p in tmp_path.iterdir()] == ["d.safetensors"]


@pytest.mark.parametrize("damage", ["overlapping-offsets", "a-name-twice", "bytes-appended"])
def test_a_checkpoint_shard_whose_header_is_damaged_is_refused(ckpt, damage):
    """The shard reader took each tensor's data_offsets as they came: a tensor pointing at another's bytes (of the
    same size) loaded as that one, silently. A name given twice kept its last entry (json.loads): here the index
    then missed the renamed tensor ("not there"), but a single model.safetensors had nothing to notice it. Bytes
    after the last tensor were ignored. The safetensors format (and its library) requires the tensors to tile the
    data section exactly; now this reader does too."""
    from kimi_explore.weights.safetensors_io import SafetensorsFile

    shard = sorted(ckpt.glob("model-*.safetensors"))[1]
    f = SafetensorsFile(shard)
    same = {}
    for name in sorted(f.keys()):
        same.setdefault(f.info(name), []).append(name)
    a, b = next(names for names in same.values() if len(names) >= 2)[:2]
    a0, a1 = f.byte_range(a)
    start = a0 - f.byte_range(min(f.keys(), key=lambda n: f.byte_range(n)[0]))[0]  # a's offset in the data section
    f.close()
    if damage == "overlapping-offsets":
        _set_header(shard, lambda t: re.sub(rf'("{re.escape(b)}":\{{[^}}]*"data_offsets":)\[\d+,\d+\]',
                                            rf"\g<1>[{start},{start + a1 - a0}]", t))
        says = r"corrupt safetensors header: tensor '.*' starts at byte \d+ of the data section, expected \d+"
    elif damage == "a-name-twice":
        _set_header(shard, lambda t: t.replace(f'"{b}":', f'"{a}":', 1))
        says = rf"corrupt safetensors header: '{re.escape(a)}' appears twice"
    else:
        shard.write_bytes(shard.read_bytes() + b"\0" * 8)
        says = r"the tensors end at byte \d+ of the data section, but it holds \d+ bytes"
    with pytest.raises(CheckpointError, match=re.escape(str(shard)) + ": " + says):
        ke.from_pretrained(ckpt, device="cpu")


def test_truncated_captures_for_compare_name_the_file(ref_weights, tmp_path):
    """ke.compare(weights, "captures.npz"): a truncated archive raised zipfile.BadZipFile naming no file."""
    good = tmp_path / "captures.npz"
    np.savez(good, tokens=np.array(TOKENS[:3]), logits=np.zeros((3, 256), np.float32))
    bad = tmp_path / "cut.npz"
    bad.write_bytes(good.read_bytes()[:-30])
    with pytest.raises(ValueError, match=re.escape(str(bad)) + r": not a complete \.npz archive"):
        ke.compare(Session(ref_weights, recorder=False), bad)


# ---------------------------------------------------------------- tokenizers


class _Latin1Tokenizer(ke.ByteTokenizer):
    """Another tokenizer of 256 ids (bytes read as Latin-1): the same vocabulary size, other text."""

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("latin-1")

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        return list(text.encode("latin-1"))

    @property
    def fingerprint(self) -> str:
        return "latin1/256"


def test_a_session_file_refuses_another_tokenizer_than_it_was_saved_with(ref_weights, tmp_path):
    """The file kept token ids but not which tokenizer made them: loaded with another one of the same size, the
    ids read as other text and text fed on became other ids, silently."""
    s = Session(ref_weights, tokenizer=ke.ByteTokenizer())
    s.feed("café")
    path = s.save_state(tmp_path / "s.npz")
    with pytest.raises(ValueError, match=re.escape(str(path)) + r" was saved with another tokenizer \(file 'bytes/256', "
                                         r"given 'latin1/256'\)"):
        Session.load_state(path, ref_weights, tokenizer=_Latin1Tokenizer())
    assert Session.load_state(path, ref_weights, tokenizer=ke.ByteTokenizer()).text == "café"
    assert Session.load_state(path, ref_weights).tokens == s.tokens  # no tokenizer: the ids alone
    bare = Session(ref_weights, recorder=False)
    bare.feed(TOKENS[:2])
    assert Session.load_state(bare.save_state(tmp_path / "bare.npz"), ref_weights, tokenizer=_Latin1Tokenizer()).tokens == \
        TOKENS[:2]  # saved without one: any tokenizer of the model's size


def test_the_k3_tokenizer_fingerprint_tells_other_special_tokens_apart(tmp_path):
    """Kimi K2's files share K3's BPE file but name the special slots otherwise: the fingerprint must differ."""
    import shutil

    pytest.importorskip("tiktoken")
    synth = DATA / "tokenizer" / "synthetic_k3"
    other = tmp_path / "other"
    shutil.copytree(synth, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    entry = next(e for e in cfg["added_tokens_decoder"].values() if e["content"] == "<|open|>")
    entry["content"] = "<|im_user|>"
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    a, b, again = (ke.KimiTokenizer.from_pretrained(p) for p in (synth, other, synth))
    assert a.vocab_size == b.vocab_size and a.vocab_sha256 == b.vocab_sha256
    assert a.fingerprint != b.fingerprint and a.fingerprint == again.fingerprint


# ---------------------------------------------------------------- reports


def test_a_report_written_again_leaves_no_figure_of_the_earlier_one(tmp_path):
    """Writing a report into the directory of an earlier one (the CLI's --out, reused) left the earlier report's
    PNGs of other layers beside the new page: files that pass for this prompt's figures. Other files stay."""
    from synthetic_trace import SyntheticTrace

    from kimi_explore.views.figures.report import write_report

    (tmp_path / "notes.png").write_bytes(b"mine")
    first = write_report(SyntheticTrace(n_tokens=3, n_layers=12), tmp_path, layers=[1, 3], dpi=20)
    assert (tmp_path / "block_residuals_layer1.png").is_file()
    again = write_report(SyntheticTrace(n_tokens=4, n_layers=12), tmp_path, layers=[5], dpi=20)
    assert first == again
    shown = set(re.findall(r'<figure id="([^"]+)">', again.read_text(encoding="utf-8")))
    pngs = {p.stem for p in tmp_path.glob("*.png")}
    assert "block_residuals_layer5" in shown and pngs == shown | {"notes"}
    assert (tmp_path / "notes.png").read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".png")) == ["index.html"]


# ---------------------------------------------------------------- other files read


def test_random_twin_reads_a_bare_config_and_names_a_source_without_one(tmp_path):
    """random_twin read config.json's "text_config" only: a checkpoint with a bare kimi_linear config (which
    from_pretrained loads) raised KeyError('text_config'); a GGUF's weights, a path inside the file."""
    import shutil

    from kimi_explore.analysis.learned import random_twin

    shell = json.loads((ke.tiny_checkpoint() / "config.json").read_text())
    bare = tmp_path / "bare"
    shutil.copytree(ke.tiny_checkpoint(), bare)
    (bare / "config.json").write_text(json.dumps(shell["text_config"]))
    w = ke.from_pretrained(bare, device="cpu")
    twin = ke.from_pretrained(random_twin(w, tmp_path / "twin"), device="cpu")
    assert twin.config == w.config and not np.array_equal(twin.embed_tokens, w.embed_tokens)
    with pytest.raises(ValueError, match=r"random_twin: the weights come from .*model-mxfp4.gguf, which has no config.json"):
        random_twin(ke.from_pretrained(GGUF, device="cpu"), tmp_path / "twin2")


@pytest.mark.parametrize("content,says", [(b"[256]", r"expected a JSON object \(a model config\), found list"),
                                          (b"\xff\xfe{}", r"not valid JSON \('utf-8' codec")],
                         ids=["a-list", "not-utf8"])
def test_load_tokenizer_names_a_config_json_that_is_not_a_config(tmp_path, content, says):
    """A config.json holding a JSON list raised AttributeError ('list' object has no attribute 'get'), one that is
    not UTF-8 a UnicodeDecodeError: neither named the file."""
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(TokenizerError, match=re.escape(str(tmp_path / "config.json")) + ": " + says):
        ke.load_tokenizer(tmp_path)


def test_a_damaged_model_card_is_named(tmp_path):
    """The CLI's header line read model_card.json with plain key lookups: a card missing a key stopped the CLI
    with "KeyError: 'corpus'", a damaged one with a JSONDecodeError, naming no file."""
    import shutil

    from kimi_explore.weights.tiny_model import describe_checkpoint

    ckpt = tmp_path / "m"
    shutil.copytree(ke.tiny_checkpoint(), ckpt)
    assert describe_checkpoint(ckpt).startswith("tiny_k3_pydoc: a tiny K3 trained on Python's pydoc_data.topics")
    card = json.loads((ckpt / "model_card.json").read_text())
    del card["corpus"]
    (ckpt / "model_card.json").write_text(json.dumps(card))
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "model_card.json")) + r": a model card needs .*"
                                              r"found \{'corpus': None\}"):
        describe_checkpoint(ckpt)
    (ckpt / "model_card.json").write_text('{"name": "tiny", ')
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "model_card.json")) + ": not valid JSON"):
        describe_checkpoint(ckpt)


def test_a_gguf_alignment_that_is_not_an_integer_is_refused(tmp_path):
    """general.alignment is a u32; stored as a float it was cut to an int (32.5 -> 32) and the file loaded."""
    path = gguf_copy(tmp_path / "align.gguf", meta={"general.alignment": 32.5}, types={"general.alignment": 6})
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + r": general.alignment = 32.5 is not a power of two"):
        ke.from_pretrained(path, device="cpu")


# ---------------------------------------------------------------- checkpoints written by the package


def _same_weights(a, b) -> bool:
    from kimi_explore.inspection.session_io import weights_fingerprint

    return weights_fingerprint(a) == weights_fingerprint(b) and np.array_equal(a.embed_tokens, b.embed_tokens)


def test_an_interrupted_checkpoint_write_leaves_the_earlier_checkpoint_whole(tmp_path, monkeypatch):
    """save_checkpoint wrote config.json, then each shard in place: killed after the first shard of a rewrite
    (a re-export from the trainer, make-tiny again with another seed), the directory held new and old shards of
    the same shapes, a mixed model that loaded silently."""
    from kimi_explore.weights import tiny_model

    out = tmp_path / "ckpt"
    tiny_model.write_checkpoint(out, seed=1, shards=3)
    first = ke.from_pretrained(out, device="cpu")
    real, calls = tiny_model.write_safetensors, []

    def dies_on_the_second_shard(path, tensors, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(path, tensors, metadata)

    monkeypatch.setattr(tiny_model, "write_safetensors", dies_on_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        tiny_model.write_checkpoint(out, seed=2, shards=3)
    monkeypatch.undo()
    assert _same_weights(ke.from_pretrained(out, device="cpu"), first)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no temporary file left
    tiny_model.write_checkpoint(out, seed=2, shards=3)  # uninterrupted: the new one, whole
    assert _same_weights(ke.from_pretrained(out, device="cpu"), ke.from_pretrained(
        tiny_model.write_checkpoint(tmp_path / "fresh", seed=2, shards=3), device="cpu"))


def test_a_checkpoint_without_an_index_is_not_written_over_another_ones_index(tmp_path):
    """index=False wrote config.json and model.safetensors next to the earlier checkpoint's index, which the loader
    reads first: the directory loaded as the earlier weights under the new config."""
    from kimi_explore.weights import tiny_model

    out = tmp_path / "ckpt"
    tiny_model.write_checkpoint(out, seed=1, shards=2)
    with pytest.raises(FileExistsError, match=re.escape(str(out / "model.safetensors.index.json")) + ": another "
                                              r"checkpoint's index is there"):
        tiny_model.write_checkpoint(out, seed=2, shards=1, index=False)


def test_a_gguf_weight_of_an_integer_type_is_refused_by_name_before_loading(tmp_path):
    """A norm stored as I32 (the F32 bytes relabelled: a damaged type field) passed the check and failed in the
    middle of the load with the gguf package's "Dequantization for I32 is not yet implemented" (or, without it, a
    hint to install it), naming no tensor."""
    path = gguf_copy(tmp_path / "i32.gguf", change=lambda ts: [
        (n, ne, "I32" if n == "blk.0.attn_norm.weight" else t, raw) for n, ne, t, raw in ts])
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + r": tensor 'blk.0.attn_norm.weight' "
                                              r"\(model.layers.0.input_layernorm.weight\) is I32, an integer type"):
        ke.from_pretrained(path, device="cpu")


def test_a_save_into_a_missing_directory_names_the_target(ref_weights, tmp_path):
    """(The atomic writes go through a temporary file: its name must not be what the error shows.)"""
    s = Session(ref_weights, recorder=False)
    s.step(5)
    missing = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing / "s.npz")) + ": its directory .* does not exist"):
        s.save_state(missing / "s.npz")
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing / "d.safetensors")) + ": its directory"):
        write_dump(missing / "d.safetensors", {"logits": np.zeros((1, 2), np.float32)}, tokens=[5])


def test_captures_whose_token_ids_are_not_integers_are_refused(ref_weights, tmp_path):
    """Captures saved with float token ids (np.savez of a float list) had each id cut by int(): 17.9 ran as 17."""
    path = tmp_path / "captures.npz"
    np.savez(path, tokens=np.array([17.9, 203.0, 5.0]), logits=np.zeros((3, 256), np.float32))
    with pytest.raises(ValueError, match=r"compare: the other engine's 'tokens' are float64 \[17.9, 203.0, 5.0\]"):
        ke.compare(Session(ref_weights, recorder=False), path)


def test_a_checkpoint_directory_named_like_a_gguf_loads_as_a_directory(tmp_path):
    """`is_gguf` went by the suffix alone: a checkpoint directory called `tiny.gguf` was opened as one GGUF file
    (IsADirectoryError)."""
    import shutil

    d = tmp_path / "tiny.gguf"
    shutil.copytree(REFERENCE_DIR, d)
    w = ke.from_pretrained(d, device="cpu")
    assert w.config.num_hidden_layers == 14


def test_a_routing_stats_checkpoint_with_labels_1_and_one_as_text_loads(ref_weights, tmp_path):
    """Labels may be ints and strings: 1 and "1" are two classes (the damage check must not call them one)."""
    path = tmp_path / "stats.npz"
    classes = lambda i: 1 if chr(i).isalpha() else "1"  # noqa: E731
    done = ke.routing_stats(ref_weights, TEXTS, progress=False, checkpoint=path, classes=classes)
    back = ke.RoutingStats.load(path)
    assert back.class_names == done.class_names == [1, "1"] and np.array_equal(back.class_top1, done.class_top1)
