"""Fourth review: each test is a problem a probe (or the previous closing note) found, driven through the public API.

Which tokens `generate` chose (kept by the Session and its files, marked by the Explorer), mask_sources("all")
on a layer subset, errors in the Explorer's selection callbacks, the CLI on bad prompts, NaN logits and random
weights, config values outside K3's ranges, tokenizer files, and the session's stop tokens and foreign files.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.inspection.session import Session
from kimi_explore.views.explorer.widgets import Explorer


def test_generate_marks_its_tokens_and_step_and_feed_do_not(tiny_weights):
    s = Session(tiny_weights)
    s.feed([1, 2, 3])
    chosen = s.generate(3)
    s.step(7)
    assert s.generated == [False] * 3 + [True] * 3 + [False]
    assert s.tokens[3:6] == chosen
    s.truncate(5)  # inside the generated run: its first two stay marked
    assert s.generated == [False] * 3 + [True] * 2
    s.feed([9, 9])
    assert s.generated == [False] * 3 + [True] * 2 + [False] * 2
    snap = s.snapshot()
    s.back(4)
    assert s.generated == [False] * 3
    s.restore(snap)
    assert s.generated == [False] * 3 + [True] * 2 + [False] * 2
    assert s.fork().generated == s.generated
    s.generated.append(True)  # a copy: the session's own list does not change
    assert len(s.generated) == len(s)


def test_a_failed_generate_step_leaves_no_mark(tiny_weights):
    s = Session(tiny_weights)
    s.feed([1, 2])
    s.hooks.add("layers.3.ffn.out", lambda v, hook: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        s.generate(2)
    assert (len(s), s.generated) == (2, [False, False])


def test_session_files_keep_the_marks_and_read_files_from_before_them(tiny_weights, tmp_path):
    s = Session(tiny_weights)
    s.feed([4, 5])
    s.generate(2)
    s.step(6)
    path = s.save_state(tmp_path / "s.npz")
    assert Session.load_state(path, tiny_weights).generated == [False, False, True, True, False]
    z = dict(np.load(path))
    header = json.loads(str(z["header"]))
    del header["generated"]  # a file saved before the marks were kept: nothing generated
    z["header"] = np.array(json.dumps(header))
    np.savez(tmp_path / "old.npz", **z)
    assert Session.load_state(tmp_path / "old.npz", tiny_weights).generated == [False] * 5
    header["generated"] = [True, False]  # two marks for five tokens
    z["header"] = np.array(json.dumps(header))
    np.savez(tmp_path / "bad.npz", **z)
    with pytest.raises(ValueError, match=r"bad.npz: 'generated' is \[True, False\], expected 5 booleans, one per token"):
        Session.load_state(tmp_path / "bad.npz", tiny_weights)


def test_the_explorer_marks_tokens_generated_in_another_cell(tiny_weights):
    s = Session(tiny_weights, tokenizer=ke.ByteTokenizer())
    ex = Explorer(s, prompt=None)
    s.feed("ab")
    s.generate(3)  # another cell
    ex.select(token=0)  # any click catches up
    assert ex.text.generated_runs == [[2, 5]]
    assert "dotted = generated" in ex.legend.value
    ex.step_button.click()  # no prompt: greedy, generated too
    assert ex.text.generated_runs == [[2, 6]] and s.generated[-1]



def test_mask_sources_all_skips_a_subsets_mixes_of_the_current_sum_alone():
    """On layers 4..7 (first push at layer 6), layers 4-5 mix the current sum alone: layer="all" masks every mix that
    mixes, as source_ablation does (it raised at layer 4); a layer named there is still refused."""
    from kimi_explore.inspection import interventions as iv

    w = ke.from_pretrained(ke.tiny_checkpoint(), layers=range(4, 8))
    ids = list(b"def f(x):")
    got, want, plain = Session(w), Session(w), Session(w)
    with got.intervene(iv.mask_sources("all", "both", "current")):
        got.feed(ids)
    with want.intervene(iv.mask_sources(6, "ffn", "current") + iv.mask_sources(7, "both", "current")):
        want.feed(ids)
    plain.feed(ids)
    np.testing.assert_array_equal(got.logits, want.logits)
    assert not np.allclose(got.logits, plain.logits)
    with pytest.raises(ValueError, match=r"layers.4.attn_res.ffn.weights: masking 'current' leaves none of the 1 sources"):
        with got.intervene(iv.mask_sources(4, "ffn", "current")):
            got.step(5)


def test_an_error_in_a_selection_callback_is_shown_not_lost(tiny_weights, monkeypatch):
    """With "compute on every selection" on, moving the token slider runs the analyses; an error there went to
    ipywidgets' log (raised out of the trait change), the status line unchanged. It is shown in red, kept in
    `last_error`, and the Explorer stays usable."""
    s = Session(tiny_weights, tokenizer=ke.ByteTokenizer())
    s.feed("abcdef")
    ex = Explorer(s, tab="Lens & attribution")
    tabs = ex.tab_views

    def broken(t, compute):
        raise RuntimeError("the lens is down")

    monkeypatch.setattr(tabs, "_analyses", broken)
    tabs.auto_analyses.value = True
    assert "Computing the analyses failed: RuntimeError: the lens is down" in ex.status.value
    ex.token.value = 2  # no exception out of the trait change
    assert "Selecting a token failed: RuntimeError: the lens is down" in ex.status.value
    assert "color:#b00" in ex.status.value and isinstance(ex.last_error, RuntimeError)
    monkeypatch.undo()
    ex.token.value = 3
    assert "failed" not in ex.status.value and ex.busy.value == ""


def test_the_cli_header_says_random_weights_for_make_tiny_and_copies_of_the_fixture(tmp_path, capsys):
    """The header said so only for the fixture at its own path: a copy, or `make-tiny`'s output, printed no note.
    Random checkpoints carry a model card saying so (`write_checkpoint`), which a copy keeps."""
    import shutil

    from kimi_explore.cli import RANDOM_NOTE, main
    from kimi_explore.weights.tiny_model import random_tiny_checkpoint

    shutil.copytree(random_tiny_checkpoint(), tmp_path / "copy")
    assert main(["make-tiny", "--out", str(tmp_path / "mt"), "--layers", "4", "--experts", "4", "--top-k", "2"]) == 0
    for ckpt in ("copy", "mt"):
        capsys.readouterr()
        assert main(["--checkpoint", str(tmp_path / ckpt), "--ids", "1,2"]) == 0
        assert RANDOM_NOTE in capsys.readouterr().out.splitlines()[0], ckpt
    assert main(["--ids", "1,2"]) == 0  # the trained default says what it is
    assert RANDOM_NOTE not in capsys.readouterr().out
