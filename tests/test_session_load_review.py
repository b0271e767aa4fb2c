"""Session files that load into weights other than their own, and `load_state`'s calling mistakes (found by probing)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import undigested

import kimi_explore as ke
from kimi_explore.inspection import npz_io
from kimi_explore.weights.tiny_model import _tensors, make_text_config, save_checkpoint

IDS = [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(weights, a session over them, its file, the config and tensors they were written from)."""
    root = tmp_path_factory.mktemp("probe")
    cfg = make_text_config()
    tensors = _tensors(cfg, 0, "mxfp4")
    w = ke.from_pretrained(save_checkpoint(root / "a", cfg, tensors))
    s = ke.Session(w)
    s.feed(IDS)
    return w, s, s.save_state(root / "a.npz"), cfg, tensors


def _edited(tmp_path, cfg, tensors, edit):
    return ke.from_pretrained(save_checkpoint(tmp_path / "b", cfg, {k: edit(k, v) for k, v in tensors.items()}))


def test_weights_that_differ_where_the_fingerprint_does_not_sample_are_refused(saved, tmp_path):
    """Every expert but the first and the last negated (the fingerprint sampled those two): the file loaded and the
    next logits were off by 3.5. The probe refused it; now the fingerprint samples every expert of a small bank."""
    _, _, path, cfg, tensors = saved
    first, last = ".experts.0.", f".experts.{cfg['num_experts'] - 1}."
    other = _edited(tmp_path, cfg, tensors,
                    lambda k, v: -v if ".experts." in k and first not in k and last not in k else v)
    with pytest.raises(ValueError, match=r"a\.npz was saved from a different model .*weights: sampled values differ"):
        ke.Session.load_state(path, other)


def test_one_value_edited_off_the_sample_is_refused(saved, tmp_path):
    _, _, path, cfg, tensors = saved
    name = "model.layers.0.self_attn.o_proj.weight"

    def edit(k, v):
        if k != name:
            return v
        v = v.copy()
        v.reshape(-1)[1] += 1.0  # index 1: between the strided samples
        return v
    with pytest.raises(ValueError, match="continue the saved state otherwise"):
        ke.Session.load_state(path, _edited(tmp_path, cfg, tensors, edit))


def test_other_load_options_continue_to_rounding(saved):
    w, s, path, *_ = saved
    same = ke.Session.load_state(path, w)
    assert np.array_equal(same.step(9), s.fork().step(9))
    bf16 = ke.Session.load_state(path, ke.from_pretrained(w.source, weight_dtype="bfloat16"))
    np.testing.assert_allclose(bf16.step(9), s.fork().step(9), atol=1e-4)


def test_a_file_without_the_probe_still_loads(saved, tmp_path):
    """Files saved before the probe existed: the fingerprint alone decides."""
    w, s, path, *_ = saved
    arrays = undigested(path)
    del arrays["probe"]
    old = npz_io.write_npz(tmp_path / "old.npz", arrays)
    assert ke.Session.load_state(old, w).tokens == IDS


def test_load_state_called_on_a_session_refuses_instead_of_doing_nothing(saved):
    """`t.load_state(...)` returned a new session and left t as it was: read as loading into t, it silently did not."""
    w, _, path, *_ = saved
    t = ke.Session(w)
    t.feed([120, 121])
    with pytest.raises(TypeError, match=r"returns a new session .* s = Session\.load_state\(path, weights\)"):
        t.load_state(path, w)
    assert t.tokens == [120, 121]


def test_a_refused_load_leaves_the_recorder_free(saved):
    """The session was built (binding the recorder) before its records were refused: the recorder stayed bound."""
    w, _, path, *_ = saved
    rec = ke.Recorder(top_k=3)
    with pytest.raises(ValueError, match=r"other settings .* top_k=10 .*pass recorder=True"):
        ke.Session.load_state(path, w, recorder=rec)
    assert ke.Session(w, recorder=rec).recorder is rec


def _feed_and_back(w, cycles=12, snap_at=3):
    s = ke.Session(w, recorder=False)
    text = list(b"def add(a, b):\n    return a + b\n" * 8)
    snap = want = None
    for i in range(cycles):
        s.feed(text[len(s) : len(s) + 16], progress=False)
        s.back(8)
        s.step(text[len(s)])
        if i == snap_at:
            snap, want = s.snapshot(), s.fork().step(65)
    return s, snap, want


def test_truncate_keeps_the_caches_held_once(monkeypatch):
    """After a truncate the kept checkpoints held the old MLA caches and the rebuilt state a copy: every back() kept
    one more copy alive (200 feed/back cycles over 6,400 tokens: 2.3 GB instead of 72 MB)."""
    w = ke.from_pretrained(ke.tiny_checkpoint())
    s, snap, want = _feed_and_back(w)
    for j, ls in enumerate(s.state.layers):
        if ls.attention.kind == "mla":
            live = ls.attention.keys
            same_capacity = [c.layers[j].attention.keys for c in s._checkpoints.values()
                             if c.layers[j].attention.keys.shape == live.shape]
            assert len(same_capacity) >= 5 and all(k is live for k in same_capacity)
    monkeypatch.setattr(ke.Session, "_share_caches", lambda self: None)  # each truncate's own copies, as before
    apart, _, _ = _feed_and_back(w)
    assert np.array_equal(np.stack(apart.logits), np.stack(s.logits))
    for t in (len(s) - 3, 20, 5):  # truncates that rebuild from the shared checkpoints
        s.truncate(t)
        apart.truncate(t)
        assert np.array_equal(s.step(70), apart.step(70)) and np.array_equal(s.feed([71, 72], progress=False),
                                                                             apart.feed([71, 72], progress=False))
    s.restore(snap)  # a snapshot from before keeps its own caches
    assert np.array_equal(s.step(65), want)


def test_a_cache_shared_by_checkpoints_is_saved_once(tmp_path):
    """Each checkpoint wrote its shared MLA cache again: 600 stepped tokens made a 475 MiB file (80 MiB now), and K3's
    ~2.9 MB a position made a stepped history's file grow with the square of its length."""
    import json

    w = ke.from_pretrained(ke.tiny_checkpoint())
    s = ke.Session(w, checkpoint_every=1)
    s.feed(list(b"def add(a, b):\n    return a + b\n"), chunk=1, progress=False)  # 32 checkpoints
    path = s.save_state(tmp_path / "s.npz")
    with np.load(path) as z:
        header, cached = json.loads(str(z["header"])), [k for k in z.files if k.endswith("/keys")]
    mla = [j for j, ls in enumerate(s.state.layers) if ls.attention.kind == "mla"]
    capacities = {(j, c.layers[j].attention.keys.shape[1]) for c in s._checkpoints.values() for j in mla}
    assert len(cached) == len(capacities) + len(mla)  # one per cache the checkpoints share, and the live state's
    loaded = ke.Session.load_state(path, w)
    for t in (31, 17, 4):
        loaded.truncate(t)
        s.truncate(t)
        assert np.array_equal(loaded.step(70), s.step(70))
    layer = next(j for j, lay in enumerate(header["layout"]["ckpt3"]["layers"]) if "cache_of" in lay)
    header["layout"]["ckpt3"]["layers"][layer]["cache_of"] = "ckpt999"  # a reference to nothing
    arrays = undigested(path)
    arrays["header"] = np.array(json.dumps(header))
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=r"saved ckpt3 layer \d+ names 'ckpt999' as the holder of its cache"):
        ke.Session.load_state(tmp_path / "bad.npz", w)


def test_a_config_that_differs_is_named_by_key_and_files_from_before_load(saved, tmp_path):
    """A copy whose config differs only in rms_norm_eps was refused naming two hashes; the keys are named now. A file
    written before the expert samples and the config values were kept loads as before."""
    import json

    w, s, path, cfg, tensors = saved
    other = ke.from_pretrained(save_checkpoint(tmp_path / "eps", {**cfg, "rms_norm_eps": 2e-5}, tensors))
    with pytest.raises(ValueError, match=r"\(config: rms_norm_eps 1e-05 in the file, 2e-05 here\)"):
        ke.Session.load_state(path, other)
    z = undigested(path)
    header = json.loads(str(z["header"]))
    for key in ("values", "config_values"):
        del header["fingerprint"][key]
    z["header"] = np.array(json.dumps(header))
    np.savez(tmp_path / "old.npz", **z)
    old = ke.Session.load_state(tmp_path / "old.npz", w)
    assert np.array_equal(old.step(9), s.fork().step(9))
