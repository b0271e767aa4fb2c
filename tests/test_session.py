"""Session: stepping, generation, and exact snapshot / restore / fork / truncate / back / save / load.

The reference for every history is a fresh, straight decode of it with `kimi_forward_token` (and a
fresh Recorder, and the same intervention on the same steps): a session that went back and forth
must hold the same logits, records and decode state. A feed runs the sequence path, whose sums are
ordered differently from stepping, so these tests run in float64, where the two routes agree to
~1e-12 and any bookkeeping slip (a wrong checkpoint, a lost hook) shows as a difference of order one.
Bit-for-bit equality of a session with itself across truncates inside chunks is tests/test_sequence.py's.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
from closeness import assert_close, assert_states_close, assert_traces_close
from conftest import REFERENCE_DIR, undigested
from numpy.lib.array_utils import byte_bounds

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.backend import gpu_available, to_numpy
from kimi_explore.inspection.hooks import HookChain, Hooks
from kimi_explore.inspection.interventions import ablate_experts, scale_kda_head
from kimi_explore.inspection.recorder import Recorder, per_token
from kimi_explore.inspection.session import Session
from kimi_explore.inspection.trace import Trace

TOKENS = [17, 203, 5, 88, 88, 141, 250, 3, 64, 199]
TOL = 1e-9  # float64 rounding of the sequence path against stepping, relative to each array's scale


@pytest.fixture(scope="module")
def ref_weights():
    return from_pretrained(REFERENCE_DIR, device="cpu", dtype="float64")


def intervention():
    """What "an intervened step" means in these tests: two value-changing hooks."""
    return ablate_experts(4, "all") + scale_kda_head(1, 0, 0.5)


_steps: dict = {}  # (id(weights), history) -> (state after it, last token's logits [V], its records, meta)


def straight_step(w, history):
    """The last token of `history` decoded from a deep copy of the straight-decoded state before it (cached)."""
    key = (id(w), history)
    if key not in _steps:
        state = copy.deepcopy(straight_step(w, history[:-1])[0]) if len(history) > 1 else KimiDecodeState.new(w)
        (tok, intervened), rec = history[-1], Recorder().bind(w)
        rec.begin_token(tok, len(history) - 1)
        logits = np.array(kimi_forward_token(w, state, tok, hooks=HookChain(intervention(), rec) if intervened else rec))
        _steps[key] = (state, logits, per_token(rec.state_dict()["blocks"]), rec.meta)
    return _steps[key]


def reference(w, history):
    """history: tuple of (token, intervened) -> (logits [T, V], Trace, final state), decoded straight: token t
    from the state after tokens < t, recorded by its own Recorder (the records of a token depend on nothing else)."""
    steps = [straight_step(w, history[: t + 1]) for t in range(len(history))]
    if not steps:
        return np.zeros((0, w.config.vocab_size), w.dtype), Recorder().bind(w).trace(), KimiDecodeState.new(w)
    rows: dict = {}
    for _, _, r, _ in steps:
        for k, v in r.items():
            rows.setdefault(k, []).extend(v)
    trace = Trace.from_rows(rows, [t for t, _ in history], list(range(len(history))), steps[0][3])
    return np.stack([lg for _, lg, _, _ in steps]), trace, steps[-1][0]


def state_arrays(state):
    for ls in state.layers:
        for f in dataclasses.fields(ls.attention):
            v = getattr(ls.attention, f.name)
            if hasattr(v, "shape"):
                yield f.name, v
            else:
                yield f.name, np.asarray(v)


def assert_matches(session, history):
    logits, trace, state = reference(session.weights, tuple(history))
    assert session.tokens == [t for t, _ in history]
    assert_close(session.logits, logits, TOL)
    assert_traces_close(session.trace(), trace, TOL)
    assert session.state.position == state.position == len(history)
    assert_states_close(session.state, state, TOL)


def all_arrays(session):
    snap = session.snapshot()  # shares the history's arrays (only the current state is copied)
    out = [a for _, a in state_arrays(session.state)] + list(snap.logits)
    out += [a for c in snap.checkpoints.values() for _, a in state_arrays(c)]
    out += [a for blocks in snap.records["blocks"].values() for a in blocks]
    return [a for a in out if isinstance(a, np.ndarray) and a.size]


def assert_no_shared_memory(a: Session, b: Session):
    """No byte of any array of `a` lies in any array of `b` (a sweep over sorted byte ranges: thousands of
    records per session make the pairwise `np.shares_memory` too slow)."""
    arrays = [all_arrays(a), all_arrays(b)]  # both alive while compared: freed memory is reused
    spans = sorted((*byte_bounds(x), i) for i in (0, 1) for x in arrays[i])
    end, owner = -1, None
    for lo, hi, i in spans:
        assert not (lo < end and i != owner), "the two sessions share memory"
        if hi > end:
            end, owner = hi, i


# ---------------------------------------------------------------- stepping


@pytest.mark.parametrize("recorder", [True, None], ids=["recording", "no-recorder"])
def test_steps_equal_the_raw_decoder(ref_weights, recorder):
    s = Session(ref_weights, recorder=recorder)
    out = [s.step(t) for t in TOKENS[:4]] + list(s.feed(TOKENS[4:6]))
    state = KimiDecodeState.new(ref_weights)
    raw = np.stack([kimi_forward_token(ref_weights, state, t) for t in TOKENS[:6]])
    assert np.array_equal(np.stack(out[:4]), raw[:4])  # steps are the token path itself
    assert_close(np.stack(out), raw, TOL)
    assert_close(s.logits, raw, TOL)
    assert s.tokens == TOKENS[:6] and len(s) == 6
    out[0][:] = 0  # returned arrays are the caller's: the history keeps its own
    assert_close(s.logits, raw, TOL)
    with pytest.raises(ValueError, match="read-only"):
        s.logits[0, 0] = 1.0
    row = s.logits_at(-1)
    row[:] = 0
    assert_close(s.logits_at(-1), raw[-1], TOL)
    s.truncate(5)
    s.step(3)  # same length as before the truncate: the cached stack must not be reused
    assert s.logits.shape == raw.shape and not np.allclose(s.logits[-1], raw[-1])
    if recorder is None:
        with pytest.raises(ValueError, match="records nothing"):
            s.trace()
    else:
        assert len(s.trace()) == 6 and list(s.trace().tokens) == TOKENS[:5] + [3]


def test_generate_greedy_and_seeded_sampling(ref_weights):
    s = Session(ref_weights)
    s.feed(TOKENS[:3])
    got = s.generate(4)
    state, want, logits = KimiDecodeState.new(ref_weights), [], None
    for t in TOKENS[:3]:
        logits = kimi_forward_token(ref_weights, state, t)
    for _ in range(4):  # greedy: each token is the argmax of the previous logits
        want.append(int(np.argmax(logits)))
        logits = kimi_forward_token(ref_weights, state, want[-1])
    assert got == want and s.tokens == TOKENS[:3] + want
    a, b = Session(ref_weights), Session(ref_weights)
    a.feed(TOKENS[:3])
    b.feed(TOKENS[:3])
    sa, sb = a.generate(6, temperature=1.0, seed=7), b.generate(6, temperature=1.0, seed=7)
    assert sa == sb and np.array_equal(a.logits, b.logits)
    # the sampler: softmax(logits / T) drawn with default_rng(seed), one draw per token
    rng, c = np.random.default_rng(7), Session(ref_weights)
    c.feed(TOKENS[:3])
    for tok in sa:
        z = c.logits[-1].astype(np.float64)
        p = np.exp(z - z.max())
        assert tok == rng.choice(len(p), p=p / p.sum())
        c.step(tok)
    assert Session(ref_weights).feed(TOKENS[:3]) is not None
    with pytest.raises(ValueError, match="feed a prompt first"):
        Session(ref_weights).generate(2)



def test_a_tokenizer_of_another_vocabulary_is_refused(ref_weights):
    """Its ids would index another model's embedding (a K3 tokenizer beside a byte model, or the reverse)."""
    from kimi_explore.tokenizer import ByteTokenizer

    class Other(ByteTokenizer):
        vocab_size = 163840

    with pytest.raises(ValueError, match="the tokenizer has 163840 ids, the model's vocabulary 256"):
        Session(ref_weights, tokenizer=Other())
    assert Session(ref_weights, tokenizer=ByteTokenizer()).tokenizer.vocab_size == 256


def test_feed_text_through_a_tokenizer(ref_weights):
    from kimi_explore.tokenizer import ByteTokenizer

    s = Session(ref_weights, tokenizer=ByteTokenizer())
    s.feed("hi!")
    assert s.tokens == [104, 105, 33] and s.text == "hi!"
    with pytest.raises(TypeError, match="no tokenizer"):
        Session(ref_weights).feed("hi")


# ---------------------------------------------------------------- going back, exactly


@pytest.mark.parametrize("every", [1, 4, 16, 0])
def test_truncate_then_restep_gives_the_same_history(ref_weights, every):
    s = Session(ref_weights, checkpoint_every=every)
    s.feed(TOKENS)
    full_logits, full_trace = s.logits, s.trace()
    for t in [7, 3, 0]:
        s.truncate(t)
        assert_matches(s, [(x, False) for x in TOKENS[:t]])
        s.feed(TOKENS[t:])
        assert_close(s.logits, full_logits, TOL)
        assert_traces_close(s.trace(), full_trace, TOL)
    s.truncate(len(TOKENS))
    assert_close(s.logits, full_logits, TOL)
    with pytest.raises(ValueError, match=r"how many tokens to keep\) must be an int in 0\.\.10, got 11"):
        s.truncate(11)


def test_back_drops_the_last_tokens(ref_weights):
    s = Session(ref_weights)
    s.feed(TOKENS[:5])
    s.back()
    assert_matches(s, [(x, False) for x in TOKENS[:4]])
    s.back(3)
    assert_matches(s, [(x, False) for x in TOKENS[:1]])
    s.back(0)
    assert s.tokens == TOKENS[:1]
    for bad in (2, -1, True, 1.0):
        with pytest.raises(ValueError, match=r"Session.back: k \(how many tokens to drop\) must be an int in 0\.\.1"):
            s.back(bad)
    with pytest.raises(ValueError, match="Session.truncate"):
        s.truncate(-1)
    assert s.tokens == TOKENS[:1]


@pytest.mark.parametrize("every", [0, 4, 16])
def test_truncate_discards_future_checkpoints(ref_weights, every):
    """A truncate that kept the checkpoints of the discarded future (here the one after the intervened
    token 4) would later replay a new history from the old history's state (a bug the mutation run
    planted). Every checkpoint_every leaves that stale checkpoint nearest to 6."""
    s = Session(ref_weights, checkpoint_every=every)
    s.feed(TOKENS[:4])
    with s.intervene(intervention()):
        s.step(TOKENS[4])
    s.feed(TOKENS[5:7])
    s.truncate(2)
    assert set(s.snapshot().checkpoints) <= {1, 2}  # none past the cut (2 ends the cut chunk [0, 2))
    new = [9, 99, 199, 42, 7]
    s.feed(new)
    s.truncate(6)
    s.step(TOKENS[8])
    assert_matches(s, [(x, False) for x in TOKENS[:2] + new[:4] + [TOKENS[8]]])

def test_checkpoints_share_the_mla_caches_and_copy_the_kda_matrices(ref_weights):
    """A cache only appends, so a checkpoint holds the live cache's arrays (K3: ~3 MB a position, where copies
    would hold T^2/(2C) positions over T tokens fed C at a time). Going back to one after the live state wrote
    past it gives the first history's state exactly, zero past its length as a state never shared."""
    s = Session(ref_weights, checkpoint_every=0)
    ids = (TOKENS * 4)[:40]
    s.feed(ids, chunk=8)  # checkpoints at 8, 16, .., 40; the caches grow 16 -> 32 -> 64 positions
    states = [s.state, *s.snapshot().checkpoints.values()]
    assert len(states) == 6
    for j, layer in enumerate(s.state.layers):
        held = [st.layers[j].attention for st in states]
        if layer.attention.kind == "mla":
            assert len({id(a.keys) for a in held}) == len({id(a.values) for a in held}) == 3
        else:
            assert len({id(a.recurrent) for a in held}) == len({id(a.conv) for a in held}) == 6
    mla = next(j for j, layer in enumerate(s.state.layers) if layer.attention.kind == "mla")
    forked = s.fork().snapshot().checkpoints  # copies, sharing among themselves as the originals do
    assert len({id(c.layers[mla].attention.keys) for c in forked.values()}) == 3
    kept = s.snapshot().checkpoints[8].layers[mla].attention
    assert np.abs(kept.keys[:, 8:]).max() > 0 and not np.any(kept.copy().keys[:, 8:])  # the live state's, then zeros
    s.truncate(8)
    fresh = Session(ref_weights, checkpoint_every=0)
    fresh.feed(ids[:8], chunk=8)
    for x in (s, fresh):
        x.feed(ids[8:20][::-1], chunk=5)
    np.testing.assert_array_equal(s.logits, fresh.logits)
    for (name, a), (_, b) in zip(state_arrays(s.state), state_arrays(fresh.state), strict=True):
        assert a.shape == b.shape and np.array_equal(a, b), name


def test_snapshot_restore_is_exact_and_reusable(ref_weights):
    s = Session(ref_weights)
    s.feed(TOKENS[:5])
    snap = s.snapshot()
    s.feed(TOKENS[5:])
    s.truncate(2)
    s.feed([1, 2, 3])
    for _ in range(2):
        s.restore(snap)
        assert_matches(s, [(x, False) for x in TOKENS[:5]])
        s.step(TOKENS[5])
        assert_matches(s, [(x, False) for x in TOKENS[:6]])
    other = Session(from_pretrained(REFERENCE_DIR, device="cpu"))
    with pytest.raises(ValueError, match="other weights"):
        other.restore(snap)


def test_fork_is_independent_and_never_aliases(ref_weights):
    s = Session(ref_weights)
    s.feed(TOKENS[:4])
    f = s.fork()
    assert_no_shared_memory(s, f)
    assert_matches(f, [(x, False) for x in TOKENS[:4]])
    f.feed([9, 9])
    with s.intervene(intervention()):
        s.step(7)
    assert len(f.hooks) == 0  # the parent's interventions are not the fork's
    assert_matches(s, [(x, False) for x in TOKENS[:4]] + [(7, True)])
    assert_matches(f, [(x, False) for x in TOKENS[:4]] + [(9, False), (9, False)])
    assert_no_shared_memory(s, f)


def test_truncate_across_intervened_steps_is_exact(ref_weights):
    s = Session(ref_weights, checkpoint_every=0)  # only the checkpoints the interventions force
    hist = [(x, False) for x in TOKENS[:2]]
    s.feed(TOKENS[:2])
    with s.intervene(intervention()):
        s.feed(TOKENS[2:4])
    hist += [(x, True) for x in TOKENS[2:4]]
    s.feed(TOKENS[4:7])
    hist += [(x, False) for x in TOKENS[4:7]]
    assert_matches(s, hist)
    for t in [6, 4, 3, 1]:
        s.truncate(t)
        assert_matches(s, hist[:t])



# mutation: a token decoded with a hook added to the RECORDER was not marked as modified, so `truncate`
# replayed it without the hook
def test_mutation_a_recorder_hook_marks_its_tokens_modified(ref_weights):
    """Value-changing hooks added to the session's recorder (not to session.hooks) count as an intervention:
    truncating across the tokens they changed restores the state they left, exactly, as a straight decode
    with the same hooks on the same steps gives it."""
    s = Session(ref_weights, checkpoint_every=0)  # only the checkpoints that intervened tokens force
    s.feed(TOKENS[:2])
    with s.recorder.hooks:  # removed again at the end of the block
        s.recorder.extend(intervention())
        assert len(s.hooks) == 0 and len(s.recorder) > 0
        s.feed(TOKENS[2:4])
    s.feed(TOKENS[4:7])
    hist = [(x, False) for x in TOKENS[:2]] + [(x, True) for x in TOKENS[2:4]] + [(x, False) for x in TOKENS[4:7]]
    assert_matches(s, hist)
    for t in [6, 4, 3]:
        s.truncate(t)
        assert_matches(s, hist[:t])
    s.feed(TOKENS[3:5])  # decoded from the restored state, without hooks now
    assert_matches(s, hist[:3] + [(x, False) for x in TOKENS[3:5]])


def test_a_failing_hook_leaves_the_session_as_it_was(ref_weights):
    s = Session(ref_weights)
    s.feed(TOKENS[:3])

    def boom(v, *, hook):
        raise RuntimeError("hook failed")

    with s.hooked("layers.6.attn.out", boom), pytest.raises(RuntimeError, match="hook failed"):
        s.step(TOKENS[3])
    assert_matches(s, [(x, False) for x in TOKENS[:3]])
    s.step(TOKENS[3])
    assert_matches(s, [(x, False) for x in TOKENS[:4]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.step(999)
    assert_matches(s, [(x, False) for x in TOKENS[:4]])


# ---------------------------------------------------------------- files


def test_save_load_round_trip_continues_bit_identically(ref_weights, tmp_path):
    s = Session(ref_weights, recorder=Recorder(full=["layers.2.mla.probs"]), checkpoint_every=3)
    s.feed(TOKENS[:3])
    with s.intervene(intervention()):
        s.step(TOKENS[3])
    s.feed(TOKENS[4:6])
    path = s.save_state(tmp_path / "bug")
    assert path.name == "bug.npz"
    t = Session.load_state(path, ref_weights)
    assert t.tokens == s.tokens and np.array_equal(t.logits, s.logits) and t.trace().equals(s.trace())
    for (_, a), (_, b) in zip(state_arrays(t.state), state_arrays(s.state), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert np.array_equal(t.step(TOKENS[6]), s.step(TOKENS[6]))
    assert t.trace().equals(s.trace())
    t.truncate(2)  # the saved checkpoints make truncates across the intervened step exact
    s.truncate(2)
    assert np.array_equal(t.logits, s.logits) and t.trace().equals(s.trace())
    assert np.array_equal(t.feed(TOKENS[2:5]), s.feed(TOKENS[2:5]))


def test_a_saved_file_holds_its_history_only(ref_weights, tmp_path):
    """A checkpoint shares its MLA cache with the live state, which wrote on past the checkpoint's length (here
    tokens 8..15, then dropped by the truncate): the file of the same 8 tokens must be the same, array for array,
    as a session that never saw them, and hold none of their keys or values."""
    cut, straight = Session(ref_weights, checkpoint_every=0), Session(ref_weights, checkpoint_every=0)
    cut.feed(TOKENS[:8], chunk=8)
    cut.feed(TOKENS[2:10], chunk=8)
    cut.truncate(8)
    straight.feed(TOKENS[:8], chunk=8)
    files = [np.load(x.save_state(tmp_path / f"{i}.npz")) for i, x in enumerate((cut, straight))]
    assert sorted(files[0].files) == sorted(files[1].files) and any(k.startswith("ckpt8/") for k in files[0].files)
    for k in files[0].files:
        assert np.array_equal(files[0][k], files[1][k]), k
    loaded = [Session.load_state(tmp_path / f"{i}.npz", ref_weights) for i in (0, 1)]
    for (name, a), (_, b) in zip(state_arrays(loaded[0].snapshot().checkpoints[8]),
                                 state_arrays(cut.snapshot().checkpoints[8].copy()), strict=True):
        assert a.shape == b.shape and np.array_equal(a, b), name  # the capacity kept, zeros past the length
    assert np.array_equal(loaded[0].feed(TOKENS[3:9], chunk=4), loaded[1].feed(TOKENS[3:9], chunk=4))
    for x in loaded:
        x.truncate(10)  # inside the fed chunk: re-decoded from the loaded checkpoint at 8
    for (name, a), (_, b) in zip(state_arrays(loaded[0].state), state_arrays(loaded[1].state), strict=True):
        assert a.shape == b.shape and np.array_equal(a, b), name


@pytest.mark.parametrize("damage", ["fewer-positions", "capacity-below-positions"])
def test_a_cache_saved_inconsistently_with_its_length_or_capacity_is_refused(ref_weights, tmp_path, damage):
    """A file holds an MLA cache as its used positions, its capacity and its `length`: positions fewer than the
    length loaded silently (zeros where the keys were, a wrong model that runs), a capacity below them failed in
    NumPy ("negative dimensions are not allowed"), naming nothing."""
    import json

    s = Session(ref_weights, checkpoint_every=0)
    s.feed(TOKENS[:8], chunk=8)
    z = undigested(s.save_state(tmp_path / "good.npz"))
    header = json.loads(str(z["header"]))
    j = next(j for j, lay in enumerate(header["layout"]["ckpt8"]["layers"]) if lay["type"] == "MlaState")
    assert header["layout"]["ckpt8"]["layers"][j]["scalars"]["length"] == 8
    if damage == "fewer-positions":
        z[f"ckpt8/{j}/keys"] = z[f"ckpt8/{j}/keys"][:, :5]
    else:
        header["layout"]["ckpt8"]["layers"][j]["capacity"] = 4
    z["header"] = np.array(json.dumps(header))
    np.savez(tmp_path / "bad.npz", **z)
    with pytest.raises(ValueError, match=rf"saved ckpt8 layer {j} keys: .*length 8"):
        Session.load_state(tmp_path / "bad.npz", ref_weights)


def test_a_file_of_the_first_format_still_loads_and_the_format_says_what_changed(ref_weights, tmp_path):
    """session/1 files hold every MLA cache at its whole capacity (no "capacity" in the layout); session/2 its
    used positions; session/3 a cache shared by several states once. A /1 file (rebuilt here as the old writer
    wrote it) loads to the same history."""
    import json

    from kimi_explore.inspection.session_io import FORMAT

    s = Session(ref_weights, checkpoint_every=0)
    s.feed((TOKENS * 3)[:20], chunk=8)
    z = undigested(s.save_state(tmp_path / "v2.npz"))
    header = json.loads(str(z["header"]))
    assert header["format"] == FORMAT == "kimi_explore.inspection.session/3"
    for key, layout in header["layout"].items():  # /3 -> /1: every cache its own arrays, at its whole capacity
        for j, lay in enumerate(layout["layers"]):
            if "capacity" in lay:
                cap, src = lay.pop("capacity"), lay.pop("cache_of", key)
                for f in ("keys", "values"):
                    a = z[f"{src}/{j}/{f}"][:, : lay["scalars"]["length"]]
                    z[f"{key}/{j}/{f}"] = np.concatenate([a, np.zeros((a.shape[0], cap - a.shape[1], *a.shape[2:]), a.dtype)], 1)
    header["format"] = "kimi_explore.inspection.session/1"
    z["header"] = np.array(json.dumps(header))
    np.savez(tmp_path / "v1.npz", **z)
    old = Session.load_state(tmp_path / "v1.npz", ref_weights)
    for x in (s, old):
        x.truncate(11)
        x.feed(TOKENS[:6], chunk=4)
    np.testing.assert_array_equal(old.logits, s.logits)
    for (name, a), (_, b) in zip(state_arrays(old.state), state_arrays(s.state), strict=True):
        assert a.shape == b.shape and np.array_equal(a, b), name
    header["format"] = "kimi_explore.inspection.session/4"
    z["header"] = np.array(json.dumps(header))
    np.savez(tmp_path / "v4.npz", **z)
    with pytest.raises(ValueError, match="format 'kimi_explore.inspection.session/4', this version reads"):
        Session.load_state(tmp_path / "v4.npz", ref_weights)


def test_a_saved_state_loads_into_packed_or_dense_experts(tmp_path):
    """The fingerprint hashes dequantised expert values, so the resident form does not matter."""
    dense = from_pretrained(REFERENCE_DIR, device="cpu", experts="dense")
    packed = from_pretrained(REFERENCE_DIR, device="cpu", experts="packed")
    s = Session(dense)
    s.feed(TOKENS[:4])
    t = Session.load_state(s.save_state(tmp_path / "dense"), packed)
    assert np.array_equal(t.step(TOKENS[4]), s.step(TOKENS[4]))


def test_load_without_checkpoints_refuses_inexact_truncates(ref_weights, tmp_path):
    s = Session(ref_weights, checkpoint_every=0)
    s.feed(TOKENS[:2])
    with s.intervene(intervention()):
        s.step(TOKENS[2])
    s.feed(TOKENS[3:5])
    t = Session.load_state(s.save_state(tmp_path / "small.npz", checkpoints=False), ref_weights)
    t.truncate(2)  # before the intervened step: a plain replay from the start is exact
    s.truncate(2)
    assert np.array_equal(t.logits, s.logits)
    u = Session.load_state(tmp_path / "small.npz", ref_weights)
    with pytest.raises(RuntimeError, match=r"tokens \[2\] were decoded with value-changing hooks"):
        u.truncate(4)


def test_loading_into_another_model_fails_clearly(ref_weights, tmp_path):
    s = Session(ref_weights)
    s.feed(TOKENS[:2])
    path = s.save_state(tmp_path / "s.npz")
    cut = from_pretrained(REFERENCE_DIR, device="cpu", layers=range(4))
    with pytest.raises(ValueError, match="different model.*layer_ids"):
        Session.load_state(path, cut)
    w32 = from_pretrained(REFERENCE_DIR, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="different model.*dtype"):
        Session.load_state(path, w32)
    bumped = dataclasses.replace(ref_weights, embed_tokens=ref_weights.embed_tokens * 1.01)
    with pytest.raises(ValueError, match=r"these weights \(weights:"):
        Session.load_state(path, bumped)
    np.savez(tmp_path / "x.npz", a=np.zeros(2))
    with pytest.raises(ValueError, match="not a kimi_explore session state"):
        Session.load_state(tmp_path / "x.npz", ref_weights)


def test_state_copy_keeps_layouts(ref_weights):
    s = Session(ref_weights)
    s.feed(TOKENS[:3])
    c = s.state.copy()
    for (_, a), (_, b) in zip(state_arrays(c), state_arrays(s.state), strict=True):
        assert a.shape == b.shape and np.array_equal(a, b) and (a.size == 0 or not np.shares_memory(a, b))


# ---------------------------------------------------------------- random sequences of operations

OPS = {"step": 4, "feed": 4, "intervened step": 4, "truncate": 5, "back": 2, "fork": 1, "snapshot": 1, "restore": 2,
       "save and load": 1}  # relative frequencies


@pytest.mark.parametrize("seed", range(10))
def test_random_step_truncate_fork_sequences_stay_exact(ref_weights, tmp_path, seed):
    """40 random operations (steps, feeds, intervened steps, truncates, forks, snapshots, save/load) equal, after
    each one, a straight decode of the history; the same seeds every run, each with its own checkpoint_every."""
    rng = np.random.default_rng(seed)
    names, p = list(OPS), np.array(list(OPS.values())) / sum(OPS.values())
    every = [0, 1, 3, 16][seed % 4]
    s = Session(ref_weights, checkpoint_every=every)
    hist: list = []
    sessions, snaps, log = [(s, hist)], [], []
    _steps.clear()
    for _ in range(40):
        op = names[rng.choice(len(names), p=p)]
        if op in ("step", "feed") and len(hist) < 20:
            toks = [int(x) for x in rng.integers(0, 256, 1 if op == "step" else rng.integers(2, 7))]
            s.feed(toks)
            hist += [(x, False) for x in toks]
        elif op == "intervened step":
            tok = int(rng.integers(0, 256))
            with s.intervene(intervention()):
                s.step(tok)
            hist.append((tok, True))
        elif op == "truncate":
            keep = int(rng.integers(0, len(hist) + 1))
            s.truncate(keep)
            del hist[keep:]
        elif op == "back":
            k = int(rng.integers(0, min(len(hist), 3) + 1))
            s.back(k)
            del hist[len(hist) - k:]
        elif op == "fork":
            f = s.fork()
            assert_no_shared_memory(s, f)
            sessions.append((f, list(hist)))
            if rng.random() < 0.5:  # continue in the fork; the parent must stay as it is
                s, hist = sessions[-1]
        elif op == "snapshot":
            snaps.append((s.snapshot(), list(hist)))
        elif op == "restore" and snaps:
            snap, h = snaps[rng.integers(len(snaps))]
            if snap.weights_id == id(s.weights):
                s.restore(snap)
                hist[:] = h
        elif op == "save and load":
            s, hist = Session.load_state(s.save_state(tmp_path / f"{len(log)}.npz"), ref_weights), list(hist)
            sessions.append((s, hist))  # the saved session stays as it is
        log.append(f"{op} -> {len(hist)} tokens")
        try:
            assert_matches(s, hist)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, checkpoint_every {every}: {'; '.join(log)}") from e
    for sess, h in sessions:
        assert_matches(sess, h)


def _shared_or_copied_run(w, seed: int, tmp_path) -> list:
    """Random operations on sessions over `w` (steps, feeds of chunk sizes around the caches' doublings, greedy
    and sampled generation, intervened steps and feeds, truncates, backs, forks, snapshots with and without
    copied arrays, restores (into the same session or a new one), state_after, checkpoint_before, save and load
    with and without checkpoints); what each leaves, as host arrays: tokens, logits, records, the state and
    every checkpoint (as a checkpoint is used: copied), also of each session loaded from a saved file."""
    rng = np.random.default_rng(seed)
    every = [0, 1, 3, 16][seed % 4]
    s = Session(w, checkpoint_every=every)
    sessions, snaps, out = [s], [], []
    tmp_path.mkdir()
    ops = ["step", "feed", "feed", "generate", "intervened", "truncate", "back", "fork", "snapshot", "restore",
           "state_after", "save"]
    for k in range(36):
        op, T = ops[int(rng.integers(len(ops)))], len(s)
        try:
            if op == "step" and T < 80:
                s.step(int(rng.integers(0, 256)))
            elif op == "feed" and T < 80:
                ids = [int(x) for x in rng.integers(0, 256, int(rng.integers(1, 36)))]
                s.feed(ids, chunk=[1, 3, 7, 16, 17, None][int(rng.integers(6))], progress=False)
            elif op == "generate" and 0 < T < 80:
                s.generate(int(rng.integers(1, 4)), temperature=float(rng.integers(2)), seed=k)
            elif op == "intervened" and T < 80:
                with s.intervene(intervention()):
                    s.feed([int(x) for x in rng.integers(0, 256, int(rng.integers(1, 4)))])
            elif op == "truncate":
                s.truncate(int(rng.integers(0, T + 1)))
            elif op == "back":
                s.back(int(rng.integers(0, min(T, 3) + 1)))
            elif op == "fork":
                sessions.append(s.fork())
                s = sessions[-1] if rng.random() < 0.5 else s
            elif op == "snapshot":
                snaps.append(s.snapshot(copy_arrays=bool(rng.integers(2))))
            elif op == "restore" and snaps:
                snap = snaps[int(rng.integers(len(snaps)))]
                if rng.random() < 0.5:
                    s.restore(snap)
                else:  # into another session, which the history continues in or not
                    sessions.append(Session(w, checkpoint_every=every))
                    sessions[-1].restore(snap)
                    s = sessions[-1] if rng.random() < 0.5 else s
            elif op == "state_after":
                n = int(rng.integers(0, T + 1))
                out += [a for _, a in state_arrays(s.state_after(n))]
                out += [a for _, a in state_arrays(s.checkpoint_before(n)[1])]
            elif op == "save":
                path = s.save_state(tmp_path / f"{seed}-{k}.npz", checkpoints=bool(rng.integers(2)))
                sessions.append(Session.load_state(path, w))  # (the file's entries differ: a shared cache is saved once)
                s = sessions[-1]
        except RuntimeError as e:  # a truncate across a token decoded under a temporary intervention
            out.append(np.array(str(e)))
        for x in ([s] if k < 35 else sessions):
            out += [np.array(x.tokens), np.array(x.logits)]
            out += [np.array(v) for _, v in sorted(x.trace().items())]
            out += [np.array(to_numpy(a)) for _, a in state_arrays(x.state.copy())]
            for c, state in sorted(x.snapshot().checkpoints.items()):
                out += [np.array(c)] + [np.array(to_numpy(a)) for _, a in state_arrays(state.copy())]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_shared_mla_caches_give_what_copied_checkpoints_give(tiny_weights, tmp_path, monkeypatch, seed):
    """Checkpoints share the MLA caches with the live state (`MlaState.checkpoint`). The same random operations
    with checkpoints that copy them (as before the sharing) must leave every logit, record, state, checkpoint
    and saved file the same, bit for bit."""
    from kimi_explore.model.mla import MlaState

    shared = _shared_or_copied_run(tiny_weights, seed, tmp_path / "shared")
    monkeypatch.setattr(MlaState, "checkpoint", lambda self: MlaState(self.keys.copy(), self.values.copy(), self.length))
    copied = _shared_or_copied_run(tiny_weights, seed, tmp_path / "copied")
    assert len(shared) == len(copied) > 1000
    for i, (a, b) in enumerate(zip(shared, copied, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), i


def test_reprs_are_one_line_summaries(ref_weights):
    """The dataclass defaults printed every array (weights: ~350,000 characters, state: ~28,000)."""
    s = Session(ref_weights, checkpoint_every=2)
    for t in TOKENS[:5]:
        s.step(t)
    cfg = ref_weights.config
    n_mla = sum(not cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    state_mib = sum(a.nbytes for _, a in state_arrays(s.state) if a.ndim) / 2**20
    want = {
        repr(ref_weights): [f"{cfg.num_hidden_layers} of {cfg.num_hidden_layers} layers",
                            f"{cfg.num_hidden_layers - n_mla} KDA, {n_mla} MLA", f"hidden {cfg.hidden_size}",
                            f"vocab {cfg.vocab_size}", "cpu float64", f"{ref_weights.memory_report().total / 2**20:.1f} MiB"],
        repr(s.state): ["position 5", f"{cfg.num_hidden_layers - n_mla} KDA, {n_mla} MLA", "numpy float64",
                        f"{state_mib:.2f} MiB"],
        repr(s): ["5 tokens", "2 checkpoints", "recorder on", "0 hooks", "cpu float64"],
        repr(s.snapshot()): ["5 tokens", "2 checkpoints"],
        repr(s.trace()): ["5 tokens", f"records, layers 0-{cfg.num_hidden_layers - 1}"],
    }
    for text, parts in want.items():
        assert "\n" not in text and len(text) < 300, text
        for part in parts:
            assert part in text, (part, text)


def test_hooks_given_to_a_session_are_checked(ref_weights):
    h = Hooks()
    h.add("layers.2.kda.q", lambda v, *, hook: None)  # layer 2 is MLA
    with pytest.raises(ValueError, match="layer 2 has the sites"):
        Session(ref_weights, hooks=h)
    s = Session(ref_weights)
    with pytest.raises(ValueError, match="not a hook point"):
        s.hooks.add("layers.2.kda.q", lambda v, *, hook: None)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no usable CUDA GPU (CuPy absent or no device)")
def test_session_on_the_gpu(ref_weights, tmp_path):
    """On a device: interventions run, truncate/fork/save/load stay bit-identical, results match the host."""
    wg = from_pretrained(REFERENCE_DIR, device="gpu")
    g, c = Session(wg, checkpoint_every=3), Session(ref_weights, checkpoint_every=3)
    for s in (g, c):
        s.feed(TOKENS[:3])
        with s.intervene(intervention()):
            s.step(TOKENS[3])
        s.feed(TOKENS[4:7])
    np.testing.assert_allclose(g.logits, c.logits, atol=1e-3)
    assert (g.logits.argmax(-1) == c.logits.argmax(-1)).all()
    full, trace = g.logits, g.trace()
    f = g.fork()
    for s in (g, c):
        s.truncate(2)
        with s.intervene(intervention()):
            s.feed(TOKENS[2:4])
        s.truncate(3)
        s.step(TOKENS[3])  # rewound to before the second intervened step: token 3 decoded plainly this time
    assert np.array_equal(g.logits[:2], full[:2])  # kept from the fed chunk
    assert not np.allclose(g.logits[2], full[2], atol=1e-3) and not np.allclose(g.logits[3], full[3], atol=1e-3)
    np.testing.assert_allclose(g.logits, c.logits, atol=1e-3)  # token 2 intervened now, 3 not: as on the host
    f.truncate(4)
    f.feed(TOKENS[4:7])
    assert np.array_equal(f.logits, full) and f.trace().equals(trace)
    h = Session.load_state(f.save_state(tmp_path / "gpu.npz"), wg)
    assert np.array_equal(h.logits, full) and h.trace().equals(trace)
    assert np.array_equal(h.step(9), f.step(9))
    assert isinstance(to_numpy(h.state.layers[0].attention.recurrent), np.ndarray)


def test_truncate_inside_a_chunk_replays_it_as_a_full_recurrent_record_decoded_it():
    """A Recorder keeping a full KDA state runs that layer token by token inside a fed chunk, which rounds otherwise
    than the chunked form. `truncate` into a chunk replays its first part from the checkpoint before it, and must run
    it the same way: the session then continues bit for bit as one fed those chunks with that recorder."""
    ref_weights = from_pretrained(REFERENCE_DIR, device="cpu")  # float32: the compiled recurrence
    ids = list(range(3, 33))
    kda = next(s.index for s in ref_weights.specs if s.attention == "kda")
    rec = {"full": [f"layers.{kda}.kda.state"]}
    s, want = Session(ref_weights, recorder=Recorder(**rec)), Session(ref_weights, recorder=Recorder(**rec))
    s.feed(ids[:16], chunk=8)
    s.truncate(13)
    want.feed(ids[:8], chunk=8)
    want.feed(ids[8:13], chunk=5)
    plain = Session(ref_weights, recorder=False)
    plain.feed(ids[:8], chunk=8)
    plain.feed(ids[8:13], chunk=5)
    recurrent = [x.state.layers[kda].attention.recurrent for x in (plain, want)]
    assert not np.array_equal(*recurrent)  # the full record changes the chunk's rounding
    for x in (s, want):
        x.feed(ids[13:], chunk=8)
    assert np.array_equal(s.logits[13:], want.logits[13:])
    assert np.array_equal(s.trace()[f"layers.{kda}.kda.state"], want.trace()[f"layers.{kda}.kda.state"])


def test_a_loaded_history_shares_its_checkpoints_caches_as_the_saved_one_did(ref_weights, tmp_path):
    """Each checkpoint is saved with its own used positions; loading gives those of one capacity the arrays of
    the longest (their positions checked equal), as the session's own did: the same 3 caches, not 5."""
    s = Session(ref_weights, checkpoint_every=0)
    ids = (TOKENS * 4)[:40]
    s.feed(ids, chunk=8)  # checkpoints at 8, .., 40; the caches 16, 32 and 64 positions long
    loaded = Session.load_state(s.save_state(tmp_path / "s.npz"), ref_weights)
    mla = [j for j, layer in enumerate(s.state.layers) if layer.attention.kind == "mla"]
    kept = loaded.snapshot().checkpoints
    for j in mla:
        assert len({id(c.layers[j].attention.keys) for c in kept.values()}) == 3
        assert len({id(c.layers[j].attention.values) for c in kept.values()}) == 3
    for t, c in s.snapshot().checkpoints.items():
        for (name, a), (_, b) in zip(state_arrays(c.copy()), state_arrays(kept[t].copy()), strict=True):
            assert a.shape == b.shape and np.array_equal(a, b), (t, name)
    for x in (s, loaded):
        x.truncate(13)
        x.feed(ids[::-1][:9], chunk=4)
    np.testing.assert_array_equal(s.logits, loaded.logits)


# ---- a session's hooks and recorder are its own (found by probing, 2026-12-05)

def test_a_hook_removed_inside_an_intervene_block_does_not_leave_the_intervention_attached(ref_weights):
    """`with hooks:` kept the first n handles on exit (n counted at entry): removing an older hook inside the block
    kept one of the block's hooks after it, and every later token decoded under the ablation, silently."""
    tokens = [3, 1, 4, 1, 5]
    clean = Session(ref_weights, recorder=False)
    clean.feed(tokens, progress=False)
    s = Session(ref_weights, recorder=False)
    older = s.hooks.add("layers.2.attn.out", lambda v, *, hook: None)
    with s.intervene(ablate_experts("all", "all")):
        s.hooks.remove(older)
    assert s.hooks.handles() == []
    s.feed(tokens, progress=False)
    np.testing.assert_array_equal(s.logits, clean.logits)


def test_a_recorder_or_hooks_serving_a_session_is_refused_by_another(ref_weights):
    """Both sessions wrote one recorder's records (each trace held the other's tokens) and shared one `with
    intervene` block (b decoded under a's ablation, logits off by 6); each session needs its own."""
    rec, hooks = Recorder(), ablate_experts(3, [0])
    a = Session(ref_weights, recorder=rec, hooks=hooks)
    with pytest.raises(ValueError, match=r"Session: recorder: this Recorder already serves another Session .* "
                                         r"recorder\.copy\(\), or a new one"):
        Session(ref_weights, recorder=rec)
    with pytest.raises(ValueError, match=r"Session: hooks: this Hooks already serves another Session"):
        Session(ref_weights, hooks=hooks)
    b = Session(ref_weights, recorder=rec.copy(), hooks=hooks.copy())  # the copies are b's own
    a.feed([60, 61, 62], progress=False)
    b.feed([80, 81], progress=False)
    assert len(a.trace()) == 3 and len(b.trace()) == 2
    del a  # a recorder whose session is gone, with that session's records: still not a new session's
    with pytest.raises(ValueError, match=r"it already holds the records of 3 token\(s\)"):
        Session(ref_weights, recorder=rec)
    rec.clear_records()
    assert len(Session(ref_weights, recorder=rec, hooks=hooks)) == 0


def test_records_of_a_recorder_with_other_settings_are_refused_at_restore_and_load(ref_weights, tmp_path):
    """restore / load_state took records made with another names_filter or top_k: trace() failed a token later
    naming neither ('has (20,) rows, expected 23'), or, with only top_k different, mixed 10- and 3-wide rows."""
    a = Session(ref_weights)
    a.feed(list(range(60, 80)), chunk=7, progress=False)
    snap, path = a.snapshot(), a.save_state(tmp_path / "a.npz")
    for rec, named in ((Recorder(top_k=3), r"top_k=10 \(this recorder: 3\)"),
                       (Recorder(names_filter="layers.*.moe.router.topk_ids"), r"names_filter=None \(this recorder: ")):
        b = Session(ref_weights, recorder=rec)
        with pytest.raises(ValueError, match=rf"Session.restore: the snapshot's records were made by a Recorder with "
                                             rf"other settings than this session's: {named}"):
            b.restore(snap)
        assert len(b) == 0 and len(rec.tokens) == 0  # refused before anything changed
        with pytest.raises(ValueError, match=named):
            Session.load_state(path, ref_weights, recorder=rec.copy(records=False))
    # the same sites selected another way line up (a callable that keeps every site, for the default's None)
    c = Session(ref_weights, recorder=Recorder(names_filter=lambda n: True))
    c.restore(snap)
    assert_traces_close(c.trace(), a.trace(), tol=0)


def test_a_forks_checkpoints_copy_the_cache_positions_they_read(ref_weights):
    """The checkpoints share the live MLA caches (`MlaState.checkpoint`), which go on filling after them; a fork's copies
    (`session_io.copy_sharing`) keep the positions the longest checkpoint reads and zeros after (the copy of a cache
    doubled by the live history cost its whole capacity), and still share among themselves."""
    ids = (TOKENS * 2)[:15]
    s = Session(ref_weights, checkpoint_every=4)
    s.feed(ids[:12], chunk=4)  # checkpoints at 4, 8, 12 share the caches (capacity 16) the steps go on filling
    for t in ids[12:]:
        s.step(t)
    f = s.fork()
    kept = sorted(f._checkpoints)
    longest = f._checkpoints[kept[-1]]
    for j, ls in enumerate(longest.layers):
        att, live = ls.attention, s.state.layers[j].attention
        if getattr(att, "kind", None) != "mla":
            continue
        assert att.keys.shape == live.keys.shape and att.length < live.length
        np.testing.assert_array_equal(att.keys[:, : att.length], live.keys[:, : att.length])
        assert not att.keys[:, att.length :].any() and not att.values[:, att.length :].any()
        assert all(f._checkpoints[t].layers[j].attention.keys is att.keys for t in kept)  # shared among themselves
    g = s.fork()
    g.truncate(9)
    s.truncate(9)  # a replay from a copied checkpoint: the same bits
    np.testing.assert_array_equal(g.step(7), s.step(7))



def test_loading_builds_each_shared_cache_once(trained_weights, tmp_path):
    """A file writes a cache its checkpoints share once (`cache_of`); loading rebuilt it, zeros to its capacity, for
    every checkpoint, and shared them only after all were read: at the peak, 2.8x the distinct caches' bytes above
    what the loaded history keeps (19 checkpoints here). Now each saved cache is built once: 0.8x (the file's own
    arrays while they are read)."""
    import tracemalloc

    from kimi_explore.inspection.session_io import load_session

    s = Session(trained_weights, checkpoint_every=16)
    s.feed([int(x) for x in np.random.default_rng(0).integers(0, 256, 300)], chunk=16)
    path = s.save_state(tmp_path / "s.npz")
    tracemalloc.start()
    try:
        snap, _ = load_session(path, trained_weights)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    states = [snap.state, *snap.checkpoints.values()]
    caches = {id(a): a.nbytes for st in states for ls in st.layers if getattr(ls.attention, "kind", None) == "mla"
              for a in (ls.attention.keys, ls.attention.values)}
    assert len(snap.checkpoints) == 19 and (peak - kept) <= 1.5 * sum(caches.values())
    loaded = Session.load_state(path, trained_weights)
    loaded.truncate(40)  # a replay from a loaded checkpoint
    s.truncate(40)
    np.testing.assert_array_equal(loaded.step(9), s.step(9))
