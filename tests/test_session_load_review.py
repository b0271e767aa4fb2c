"""Session files that load into weights other than their own, and `load_state`'s calling mistakes (found by probing)."""

from __future__ import annotations

import numpy as np
import pytest

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
    """Every expert but the first and the last negated (the fingerprint samples those two): the file loaded and the
    next logits were off by 3.5."""
    _, _, path, cfg, tensors = saved
    first, last = ".experts.0.", f".experts.{cfg['num_experts'] - 1}."
    other = _edited(tmp_path, cfg, tensors,
                    lambda k, v: -v if ".experts." in k and first not in k and last not in k else v)
    with pytest.raises(ValueError, match=r"a\.npz: these weights continue the saved state otherwise .* off by"):
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
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files if k != "probe"}
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
