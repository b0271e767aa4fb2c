"""Fourth review: each test is a problem a probe (or the previous closing note) found, driven through the public API.

Which tokens `generate` chose (kept by the Session and its files, marked by the Explorer), mask_sources("all")
on a layer subset, errors in the Explorer's selection callbacks, the CLI on bad prompts, NaN logits and random
weights, config values outside K3's ranges, tokenizer files, and the session's stop tokens and foreign files.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import undigested

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
    z = undigested(path)
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
    with pytest.raises(RuntimeError, match="the lens is down"):  # called from code, an action raises
        ex.select(token=4)
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


def edited_copy(tmp_path, edit) -> Path:
    """A copy of the embedded model whose tensors' bytes edit({name: bytes}) rewrites in place (same sizes)."""
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(ke.tiny_checkpoint(), out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for shard in sorted({out / f for f in index["weight_map"].values()}):
        raw = bytearray(shard.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        spans = {k: (8 + n + m["data_offsets"][0], 8 + n + m["data_offsets"][1])
                 for k, m in json.loads(raw[8 : 8 + n]).items() if k != "__metadata__"}
        data = {k: bytes(raw[a:b]) for k, (a, b) in spans.items()}
        edit(data)
        for k, (a, b) in spans.items():
            assert len(data[k]) == b - a, k
            raw[a:b] = data[k]
        shard.write_bytes(bytes(raw))
    return out


def nan_checkpoint(tmp_path):
    """A copy of the embedded model whose final norm is NaN (bf16 0x7FC0): every logit NaN."""
    def edit(data):
        name = "language_model.model.norm.weight"
        if name in data:
            data[name] = b"\xc0\x7f" * (len(data[name]) // 2)
    return edited_copy(tmp_path, edit)


def test_the_cli_refuses_to_generate_from_nan_logits(tmp_path, capsys):
    """--generate took argsort's first id of all-NaN logits (0) as the greedy token, printed 'generated ids: 0,0' and
    exited 0; `Session.generate` (and `kimi-explore report`) refuse the same logits. Now the CLI does too, exit 2."""
    from kimi_explore.cli import main

    ckpt = nan_checkpoint(tmp_path)
    assert main(["--checkpoint", str(ckpt), "--ids", "72,105"]) == 0  # showing NaN predictions is fine
    capsys.readouterr()
    assert main(["--checkpoint", str(ckpt), "--ids", "72,105", "--generate", "2"]) == 2
    out = capsys.readouterr()
    assert "kimi-explore --generate: the logits after token 1 hold NaN (256 of 256, the first at id 0): no token to " \
           "choose" in out.err and "generated" not in out.out


def test_the_cli_refuses_prompt_bytes_that_are_not_utf8_and_foreign_digits_in_layers(capsys):
    """--prompt $'a\\xffb' fed 'a', U+FFFD's three bytes, 'b' (Python's surrogate escape of the byte, encoded); and
    --layers '٣' (an Arabic-Indic 3) loaded layer 3, where --ids refuses such digits."""
    from kimi_explore.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--prompt", "a" + b"\xff".decode("utf-8", "surrogateescape") + "b"])
    assert e.value.code == 2
    assert "byte 0xFF (character 1 of the prompt) is not UTF-8 text; pass token ids with --ids" in capsys.readouterr().err
    for layers in ("\u0663", "0-\u0663", "1,\u0663"):
        with pytest.raises(SystemExit) as e:
            main(["--layers", layers, "--ids", "1"])
        assert e.value.code == 2 and "expected '0-3', '0:4' or '1,5,9'" in capsys.readouterr().err


def test_the_cli_stops_quietly_when_its_reader_leaves():
    """`kimi-explore --generate 200 | head -3` ended with 'kimi-explore: error: [Errno 32] Broken pipe' (exit 2)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-c", "import sys; from kimi_explore.cli import main; sys.exit(main(sys.argv[1:]))",
           "--ids", "1,2", "--generate", "200"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()  # the reader leaves after one line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err


def test_loading_refuses_dtype_none_and_a_config_json_that_is_not_utf8(tmp_path):
    """dtype=None loaded float64 in silence (np.dtype(None)); a config.json with a Latin-1 byte raised a bare
    UnicodeDecodeError naming no file (the index named its file)."""
    import shutil

    from kimi_explore.errors import BackendError, ConfigError

    with pytest.raises(BackendError, match=r"dtype=None is not one of 'float32', 'float64'"):
        ke.from_pretrained(ke.tiny_checkpoint(), dtype=None)
    with pytest.raises(BackendError, match=r"dtype=<class 'object'> is not one of"):
        ke.from_pretrained(ke.tiny_checkpoint(), dtype=object)
    ckpt = tmp_path / "latin1"
    shutil.copytree(ke.tiny_checkpoint(), ckpt)
    cfg = (ckpt / "config.json").read_bytes()
    (ckpt / "config.json").write_bytes(cfg.replace(b'"kimi_k3"', b'"kimi_k3\xe9"', 1))
    with pytest.raises(ConfigError, match=re.escape(str(ckpt / "config.json")) + r": not UTF-8 text \(byte 0xE9 at offset"):
        ke.from_pretrained(ckpt)



TOKENIZER = Path(__file__).parent / "data" / "tokenizer" / "synthetic_k3"


def tokenizer_copy(tmp_path, config=None, tokenizer_text=None) -> Path:
    """A copy of the synthetic K3 tokenizer, config.json edited by config(dict) and tokenizer_config.json's text by
    tokenizer_text(str)."""
    import shutil

    out = tmp_path / "tok"
    shutil.copytree(TOKENIZER, out)
    if config is not None:
        c = json.loads((out / "config.json").read_text())
        config(c)
        (out / "config.json").write_text(json.dumps(c))
    if tokenizer_text is not None:
        f = out / "tokenizer_config.json"
        f.write_text(tokenizer_text(f.read_text()))
    return out


def test_tokenizer_files_with_a_key_twice_or_eos_ids_that_disagree_are_refused(tmp_path):
    """A second '425' entry renamed <|open|> in silence (the last one wins); an eos_token_id given as a string, or at
    the top and in text_config with other values, fell back to <|end_of_msg|> (424) while the model's config read
    text_config's 431."""
    from kimi_explore.tokenizer import KimiTokenizer, TokenizerError

    pytest.importorskip("tiktoken")
    assert KimiTokenizer.from_pretrained(TOKENIZER).eos_id == 424
    twice = tokenizer_copy(tmp_path / "a", tokenizer_text=lambda t: t.replace(
        '"added_tokens_decoder": {', '"added_tokens_decoder": {"425": {"content": "<|im_user|>"}, ', 1))
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: key '425' is given twice in one object"):
        KimiTokenizer.from_pretrained(twice)
    as_text = tokenizer_copy(tmp_path / "b", config=lambda c: c.update(eos_token_id="425"))
    with pytest.raises(TokenizerError, match=r"config.json: eos_token_id is '425', expected a token id \(an int\) or null"):
        KimiTokenizer.from_pretrained(as_text)
    differ = tokenizer_copy(tmp_path / "c", config=lambda c: c.update(text_config={**c.get("text_config", {}),
                                                                                      "eos_token_id": 431}))
    with pytest.raises(TokenizerError, match=r"config.json: eos_token_id 424 and text_config.eos_token_id 431 differ"):
        KimiTokenizer.from_pretrained(differ)
    inner = tokenizer_copy(tmp_path / "d", config=lambda c: c.update(eos_token_id=None, text_config={
        **c.get("text_config", {}), "eos_token_id": 431}))
    assert KimiTokenizer.from_pretrained(inner).eos_id == 431  # null at the top: text_config's, as the model reads


def test_a_session_file_refuses_a_copy_with_two_experts_swapped(tmp_path):
    """The embedded model with layer 3's experts 1 and 2 swapped: the fingerprint sampled only each bank's first and
    last expert, and the probe token routes elsewhere, so the file loaded and its continuation was off by 1.14 in
    the logits. Every expert of a small bank is sampled now."""
    w = ke.from_pretrained(ke.tiny_checkpoint())
    s = Session(w)
    s.feed(b"def foo(x):\n    return x + 1\n")
    path = s.save_state(tmp_path / "s.npz")

    def swap(data):
        head = "language_model.model.layers.3.block_sparse_moe.experts."
        for k in [k for k in data if k.startswith(head + "1.")]:
            other = k.replace(head + "1.", head + "2.")
            data[k], data[other] = data[other], data[k]
    swapped = ke.from_pretrained(edited_copy(tmp_path, swap))
    a, b = Session(w), Session(swapped)
    a.feed(b"def foo(x):\n    return x + 1\n")
    b.feed(b"def foo(x):\n    return x + 1\n")
    assert np.abs(a.logits - b.logits).max() > 0.5  # a different model
    with pytest.raises(ValueError, match=r"s\.npz was saved from a different model .*weights: sampled values differ"):
        Session.load_state(path, swapped)


def test_generate_stop_tokens_of_any_iterable_and_sampling_at_any_temperature(trained_weights):
    """stop_tokens=map(...) or a generator never stopped (`in` used the iterator up at the first token), and ids
    that can never be generated were accepted; temperature=1e-310 and a hook's +inf logit sampled NaN probabilities."""
    s = Session(trained_weights)
    s.feed(b"def f(x):\n    return")
    want = s.fork().generate(30, stop_tokens=[ord("\n")])
    assert want[-1] == ord("\n") and len(want) < 30
    for stops in (map(ord, "\n"), iter([10]), (t for t in [10]), np.array([10])):
        assert s.fork().generate(30, stop_tokens=stops) == want
    for bad in ([b"\n"], [1000], [-1], [True]):
        with pytest.raises(ValueError, match=r"stop_tokens holds .*, not a token id in 0\.\.255"):
            s.fork().generate(3, stop_tokens=bad)
    assert s.fork().generate(5, temperature=1e-310, seed=0) == s.fork().generate(5)  # a tiny temperature: greedy
    hot = s.fork()
    hot.hooks.add("logits", lambda v, hook: np.where(np.arange(v.shape[-1]) == 7, np.inf, v))
    assert hot.generate(3, temperature=1.0, seed=0)[1:] == [7, 7]  # (the first reads the logits from before the hook)


def test_feed_refuses_unordered_ids_and_load_state_its_calling_mistakes(tiny_weights, tmp_path):
    """feed(set(...)) and feed(dict) decoded their ids reordered; load_state(path, 'a/path') read the file first and
    raised AttributeError; load_state('x') after save_state('x') (which wrote x.npz) said 'no such file'."""
    s = Session(tiny_weights)
    for ids in (set(b"zab"), {122: 0, 97: 1}, frozenset([1, 2])):
        with pytest.raises(TypeError, match=r"token_ids is a \w+, which has no order"):
            s.feed(ids)
        with pytest.raises(TypeError, match=r"token_ids is a \w+, which has no order"):  # (the public function too)
            ke.kimi_forward_sequence(tiny_weights, tiny_weights.new_state(), ids)
    assert len(s) == 0
    s.feed([1, 2, 3])
    written = s.save_state(tmp_path / "x")
    assert written.name == "x.npz" and Session.load_state(tmp_path / "x", tiny_weights).tokens == [1, 2, 3]
    with pytest.raises(TypeError, match=r"load_state: weights: .*got str \(a path: load it with ke.from_pretrained"):
        Session.load_state(written, str(ke.tiny_checkpoint()))


def test_the_explorers_all_layers_mask_skips_mixes_of_the_current_sum_alone():
    """On layers 4..7 the panel's 'all' refused 'current' ("would leave no source at layer 4 ffn, layer 5 ffn") where
    mask_sources("all", ...) now skips those mixes. The KL shown is that of a session stepped with that mask."""
    w = ke.from_pretrained(ke.tiny_checkpoint(), layers=range(4, 8))
    s = Session(w, tokenizer=ke.ByteTokenizer())
    for x in b"def f(x):":
        s.step(x)
    ex = Explorer(s, tab="Predictions")
    ex.select(token=8, layer=7)
    ex.ablation.what.value = "block sources"
    ex.ablation.experts.value = "current"
    ex.ablation.layers.value = "all"
    ex.ablation.button.click()
    note = ex.ablation.note.value
    assert "color:#b00" not in note and "no source" not in note, note
    masked = Session(w)
    for x in b"def f(x)":
        masked.step(x)
    from kimi_explore.inspection import interventions as iv

    with masked.intervene(iv.mask_sources("all", "both", "current")):
        masked.step(ord(":"))
    p, q = (np.exp(v - v.max()) / np.exp(v - v.max()).sum() for v in (s.logits_at(8), masked.logits_at(8)))
    assert f"KL at token 8 {float(np.sum(p * np.log(p / q))):.4g}" in note


def test_a_refusal_repeated_keeps_its_red_line(tiny_weights):
    """Step twice on an empty prompt: the second click wrote the same red line again, which read as 'the action wrote
    nothing', and the status went back to normal. A red line goes only when a later action succeeds silently."""
    ex = Explorer(Session(tiny_weights, tokenizer=ke.ByteTokenizer()), prompt="")
    for _ in range(2):
        ex.step_button.click()
        assert "color:#b00" in ex.status.value and "type a prompt first" in ex.status.value
    ex.prompt.value = "ab"  # a silent success (reading the prompt) puts the line back
    assert "color:#b00" not in ex.status.value


def test_sampling_with_masked_logits_at_an_infinite_temperature_and_all_ids_masked(trained_weights):
    """-inf logits at temperature=inf gave -inf/inf = NaN probabilities; logits all -inf generated id 0 greedily (and
    a NaN error from numpy when sampling). Masked ids get no probability at any temperature; all masked is refused."""
    s = Session(trained_weights)
    s.feed(b"def f(x):")
    s.hooks.add("logits", lambda v, hook: np.where(np.arange(v.shape[-1]) < 100, -np.inf, v))
    s.step(ord(" "))
    got = s.fork().generate(3, temperature=float("inf"), seed=0)
    assert all(t >= 100 for t in got)
    s.hooks.clear()
    s.hooks.add("logits", lambda v, hook: np.full_like(v, -np.inf))
    s.step(ord("r"))
    for temperature in (0.0, 1.0):
        with pytest.raises(FloatingPointError, match=r"Session.generate: the logits after token 10 are all -inf"):
            s.fork().generate(1, temperature=temperature)


def test_session_files_compare_config_values_and_read_minus_zero_as_zero(tmp_path):
    """A copy whose config said 4 for 4.0 (bit-identical logits) was refused with an empty reason ('config: '); a
    nested key that differs was named as two whole dicts; a file saved over the MXFP4 safetensors of engines set d
    was refused by its f32-experts GGUF (bit-identical logits: MXFP4 dequantises to -0.0 where the GGUF holds 0.0)."""
    import shutil

    data = Path(__file__).parent / "data" / "engines" / "d"
    w = ke.from_pretrained(ke.tiny_checkpoint())
    s = Session(w)
    s.feed(b"def f(x):")
    path = s.save_state(tmp_path / "s.npz")

    def copy_with(name, edit):
        out = tmp_path / name
        shutil.copytree(ke.tiny_checkpoint(), out)
        c = json.loads((out / "config.json").read_text())
        edit(c["text_config"])
        (out / "config.json").write_text(json.dumps(c))
        return ke.from_pretrained(out)

    as_int = copy_with("int", lambda tc: tc.update(activation_situ_beta=4))
    assert np.array_equal(Session.load_state(path, as_int).step(5), s.fork().step(5))
    lower = copy_with("lb", lambda tc: tc["linear_attn_config"].update(gate_lower_bound=-4.0))
    with pytest.raises(ValueError, match=r"\(config: linear_attn_config.gate_lower_bound -5.0 in the file, -4.0 here\)"):
        Session.load_state(path, lower)
    mx = ke.from_pretrained(data / "tiny_k3")
    gguf = ke.from_pretrained(data / "llamacpp" / "model-f32experts.gguf")
    a = Session(mx)
    a.feed([1, 2, 3])
    moved = Session.load_state(a.save_state(tmp_path / "d.npz"), gguf)
    assert np.array_equal(moved.step(4), a.fork().step(4))


def test_routing_stats_resume_compares_fingerprints_as_session_files_do(tmp_path):
    """Resuming compared the fingerprints as JSON text: a checkpoint from before this version's fingerprint was refused
    for the same model, and the f32-experts GGUF of the MXFP4 one (bit-identical) too, naming two equal prefixes."""
    from kimi_explore.inspection.session_io import weights_fingerprint

    data = Path(__file__).parent / "data" / "engines" / "d" / "llamacpp"
    texts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    mx = ke.from_pretrained(data / "model-mxfp4.gguf")
    f32 = ke.from_pretrained(data / "model-f32experts.gguf")
    whole = ke.routing_stats(mx, texts, progress=False)
    ke.routing_stats(mx, texts[:2], checkpoint=tmp_path / "a.npz", progress=False)
    resumed = ke.routing_stats(f32, texts, checkpoint=tmp_path / "a.npz", progress=False)
    assert np.array_equal(resumed.counts, whole.counts)
    ke.routing_stats(mx, texts[:2], checkpoint=tmp_path / "old.npz", progress=False)
    z = undigested(tmp_path / "old.npz")
    old = {k: v for k, v in weights_fingerprint(mx).items() if k in ("config", "layer_ids", "dtype", "weights")}
    header = json.loads(str(z["header"]))
    assert json.loads(header["model"])["values"]  # the fingerprint as an older version wrote it: its four hashes alone
    header["model"] = json.dumps(old, sort_keys=True)
    z["header"] = np.array(json.dumps(header))
    np.savez(tmp_path / "old.npz", **z)
    again = ke.routing_stats(mx, texts, checkpoint=tmp_path / "old.npz", progress=False)
    assert np.array_equal(again.counts, whole.counts)
    other = ke.from_pretrained(ke.tiny_checkpoint())
    with pytest.raises(ValueError, match=r"a.npz: this routing-stats checkpoint was made with another model \(config: "):
        ke.routing_stats(other, texts, checkpoint=tmp_path / "a.npz", progress=False)


def test_a_session_file_with_an_experts_hash_is_checked_by_it(tmp_path):
    """A file from before `values` that holds an `experts` hash (every expert of a small bank) was checked without it:
    a copy with one expert's scales edited, which the probe token does not route to, loaded (0.34 off afterwards)."""
    w = ke.from_pretrained(ke.tiny_checkpoint())
    s = Session(w)
    s.feed([1, 2, 3, 4, 5])
    path = s.save_state(tmp_path / "s.npz")
    z = undigested(path)
    header = json.loads(str(z["header"]))
    del header["fingerprint"]["values"]  # as the version between wrote it: config, config_values, weights, experts
    z["header"] = np.array(json.dumps(header))
    np.savez(tmp_path / "between.npz", **z)
    assert Session.load_state(tmp_path / "between.npz", w).tokens == [1, 2, 3, 4, 5]

    def edit(data):
        name = "language_model.model.layers.3.block_sparse_moe.experts.1.w2.weight_scale"
        if name in data:
            data[name] = bytes((b + 2) % 256 for b in data[name])
    with pytest.raises(ValueError, match=r"between.npz was saved from a different model .*weights: sampled values"):
        Session.load_state(tmp_path / "between.npz", ke.from_pretrained(edited_copy(tmp_path, edit)))


def test_the_explorers_other_public_actions_raise_from_code_and_huge_temperatures(tiny_weights, monkeypatch):
    """sync(), ablate(), snapshot() and refresh() called from code showed a callback's error in red (snapshot also
    raised it: reported twice); generate(temperature=10**400) raised a bare OverflowError."""
    s = Session(tiny_weights, tokenizer=ke.ByteTokenizer())
    s.feed("abcdef")
    ex = Explorer(s)
    ex.select(token=3)
    real = ex.tab_views.refresh

    def broken(tab, t, layer):
        if t != len(s) - 1:
            raise RuntimeError("the view is down")
        return real(tab, t, layer)

    monkeypatch.setattr(ex.tab_views, "refresh", broken)
    for action in (ex.sync, ex.ablate, lambda: ex.snapshot(), ex.refresh):
        s.step(7)  # changed outside: each action catches up, re-selects token 3, and its view fails
        with pytest.raises(RuntimeError, match="the view is down"):
            action()
        assert "failed" not in ex.status.value
    monkeypatch.undo()
    assert s.fork().generate(2, temperature=10**400, seed=0)  # as hot as inf: a draw, not an OverflowError


# ---------------------------------------------------------------- the report, the figures and the measures


def nan_from(position: int, site: str = "layers.5.attn.out"):
    """Hooks that make `site` NaN at one position (everything after it reads NaN)."""
    hooks = ke.Hooks()

    def poison(v, *, hook):
        return np.full_like(v, np.nan) if hook.position == position else v
    hooks.add(site, poison)
    return hooks


def test_a_report_of_a_history_with_nan_keeps_its_figures_and_says_why_the_analyses_are_missing(trained_weights,
                                                                                                 tmp_path):
    """NaN from token 10 on: write_report raised out of the attribution and left no page; the predictions table and
    figure named ids 0..9 (the top-k of NaN logits) as predictions; the per-token measures averaged the NaN layers
    away ('routing entropy' 0.956 at a token whose logits are NaN)."""
    from kimi_explore.views import summaries
    from kimi_explore.views.figures.report import write_report

    s = Session(trained_weights, tokenizer=ke.load_tokenizer(trained_weights), hooks=nan_from(10))
    s.feed(b"def f(x):\n    return x")
    page = write_report(s, tmp_path / "r").read_text()
    assert "No attribution for this history:" in page and "logits" in page
    assert "block_residuals_last_token.png" in page and (tmp_path / "r" / "kda_state_curves.png").is_file()
    assert "none: the logits hold NaN" in page
    m = summaries.token_measures(s.trace())
    for name in ("routing entropy", "embedding weight", "KDA state change"):
        assert np.isfinite(m[name][:10]).all() and np.isnan(m[name][11:]).all(), name


def test_the_kda_scale_of_the_report_ignores_an_infinite_norm(trained_weights, tmp_path, monkeypatch):
    """One inf state norm made the report's one KDA colour ceiling inf: every KDA heatmap drew blank."""
    from kimi_explore.views.figures import plots, report

    hooks = ke.Hooks()
    hooks.add("layers.6.kda.state", lambda v, *, hook: np.where(np.arange(v.size).reshape(v.shape) == 0, np.inf, v)
              if hook.position == 8 else v)
    s = Session(trained_weights, hooks=hooks)
    s.feed(b"def f(x):")
    norms, _ = s.trace().kda_state_norms()
    seen = []
    real = plots.kda_state_heatmap
    monkeypatch.setattr(plots, "kda_state_heatmap", lambda *a, vmax=None, **k: seen.append(vmax) or real(*a, vmax=vmax, **k))
    report.write_report(s, tmp_path / "r")
    assert np.isinf(norms).any() and seen and all(v == np.max(norms[np.isfinite(norms)]) for v in seen)


def test_measures_of_a_window_and_of_a_layer_subset(trained_weights):
    """A window's first row had its KDA state change taken from S = 0 (3.22 for 0.548); on a layer subset the
    'embedding weight' is source 0's, the input of the first pushing layer, which the Explorer's legend names."""
    from kimi_explore.views import summaries

    s = Session(trained_weights)
    s.feed(b"def f(x):\n    return x")
    whole = summaries.token_measures(s.trace())["KDA state change"]
    part = summaries.token_measures(s.trace(window=slice(10, None)))["KDA state change"]
    assert np.isnan(part[0]) and np.allclose(part[1:], whole[11:])
    sub = Session(ke.from_pretrained(ke.tiny_checkpoint(), layers=range(4, 8)), tokenizer=ke.ByteTokenizer())
    sub.feed("def f(x):")
    ex = Explorer(sub)
    ex.measure.value = "embedding weight"
    assert "embedding weight (source 0 here: input of layer 6)" in ex.legend.value


def test_forced_routing_is_not_credited_to_the_bias(trained_weights):
    """force_routing(5, [13, 2]) (the two lowest scores) was shown as '13*, 2*' ('chosen only through the selection
    bias') with 'pushed out: 0, 12': now '†' (a hook's choice), and the bias pushes nothing out there."""
    from kimi_explore.inspection import interventions as iv
    from kimi_explore.views import summaries
    from kimi_explore.views.common import bias_vectors, routing
    from kimi_explore.views.figures.plots_summary import topk_table_html

    s = Session(trained_weights, hooks=iv.force_routing(5, [13, 2]))
    s.feed(b"def f(x):")
    tab = summaries.topk_table(routing(s.trace()), -1, bias_vectors(trained_weights))
    j = tab["moe_layers"].index(5)
    assert tab["forced"][j].all() and not tab["by_bias"][j].any() and tab["displaced"][j] == []
    assert not tab["forced"][[i for i in range(len(tab["moe_layers"])) if i != j]].any()
    page = topk_table_html(s)  # a Session: its trace and its routers' bias
    assert "<b>13\u2020</b>" in page and "chosen by a hook, outside the router's own top-k (2)" in page


def test_the_report_sets_generated_tokens_apart_and_names_missing_records(trained_weights, tmp_path):
    """`report --generate 3` folded the generated tokens into the prompt's lines; a Recorder that leaves out the
    router scores raised a bare KeyError: 'scores'."""
    from kimi_explore.views.figures.report import write_report

    tok = ke.load_tokenizer(trained_weights)
    s = Session(trained_weights, tokenizer=tok)
    s.feed("ab")
    new = s.generate(3)
    s.step(ord("Z"))
    s.feed("xy")  # generated tokens between fed ones: only they are marked
    page = write_report(s, tmp_path / "r").read_text()
    mark = "<u style='text-decoration-style:dotted' title='generated'>"
    from kimi_explore.views.common import token_labels

    def shown(ids):
        return html.escape(" ".join(token_labels(ids, tok, positions=False)))
    assert f"<p>Text: <code>{html.escape(tok.decode(s.tokens))}</code></p>" in page  # decoded whole
    assert (f"<p>Tokens (dotted: generated by <code>Session.generate</code>): <code>{shown(list(b'ab'))} {mark}{shown(new)}"
            f"</u> {shown(list(b'Zxy'))}</code></p>") in page
    part = Session(trained_weights, recorder=ke.Recorder(names_filter=lambda n: "router.scores" not in n))
    part.feed(b"def f(x):")
    with pytest.raises(ValueError, match=r"write_report: the report draws every record .*: the trace has no 'scores' records"):
        write_report(part, tmp_path / "p")


# ---------------------------------------------------------------- decode states, loading options


def test_a_checkpoint_state_is_refused_and_a_state_of_other_layers_too(tmp_path):
    """Decoding on state.checkpoint() wrote its K/V into the MLA cache it shares with the live state (whose next
    logits moved by 0.77); a state made for layers [0, 1] decoded under weights of layers [1, 2]."""
    w = ke.from_pretrained(ke.tiny_checkpoint())
    s = w.new_state()
    for t in b"hello":
        ke.kimi_forward_token(w, s, t)
    c = s.checkpoint()
    with pytest.raises(ValueError, match=r"state is a checkpoint .*decode on checkpoint.copy\(\)"):
        ke.kimi_forward_token(w, c, 200)
    with pytest.raises(ValueError, match=r"state is a checkpoint"):
        ke.kimi_forward_sequence(w, c, [1, 2])
    ref = s.copy()
    ke.kimi_forward_token(w, c.copy(), 200)  # a copy of it decodes, leaving the live state alone
    assert np.array_equal(ke.kimi_forward_token(w, s, 32), ke.kimi_forward_token(w, ref, 32))
    a = ke.from_pretrained(ke.tiny_checkpoint(), layers=[0, 1])
    b = ke.from_pretrained(ke.tiny_checkpoint(), layers=[1, 2])
    sa = a.new_state()
    ke.kimi_forward_token(a, sa, 3)
    with pytest.raises(ValueError, match=r"state was made for layers \[0, 1\], these weights hold layers \[1, 2\]"):
        ke.kimi_forward_token(b, sa, 8)
    # copies of a session's checkpoints (a snapshot's, a loaded file's) share caches too; forks and files keep layers
    s = Session(a, checkpoint_every=2)
    s.feed([1, 2, 3])
    for t in (4, 5, 6):
        s.step(t)
    loaded = Session.load_state(s.save_state(tmp_path / "s.npz"), a)
    for kept in (s.snapshot(copy_arrays=True).checkpoints, loaded.snapshot().checkpoints):
        for state in kept.values():
            with pytest.raises(ValueError, match=r"state is a checkpoint"):
                ke.kimi_forward_token(a, state, 9)
    for other in (s.fork(), loaded):
        with pytest.raises(ValueError, match=r"state was made for layers \[0, 1\]"):
            ke.kimi_forward_token(b, other.state_after(5), 8)


def test_long_layer_lists_are_named_briefly_and_make_tiny_names_its_seed(capsys, tmp_path):
    """layers=range(0, 3_000_000) built a 26-million-character error; make-tiny --seed -1 passed NumPy's message on."""
    from kimi_explore.cli import main

    with pytest.raises(ValueError) as e:
        ke.from_pretrained(ke.tiny_checkpoint(), layers=range(0, 100_000))
    assert len(str(e.value)) < 200 and "[8, 9, 10" in str(e.value) and "(and 99980 more)]" in str(e.value)
    with pytest.raises(SystemExit) as e:
        main(["make-tiny", "--out", str(tmp_path / "x"), "--seed", "-1"])
    assert e.value.code == 2 and "--seed: expected an integer >= 0, got -1" in capsys.readouterr().err


def test_a_tied_heads_widening_scratch_is_reserved_at_load(tmp_path):
    """With tied embeddings the head is the embedding table, built as read-by-rows: its widening scratch was not
    reserved at load, and memory_report() grew from 0.28 MB to 4.2 MB of scratch after the first token."""
    from kimi_explore.weights.tiny_model import make_text_config, write_checkpoint

    attn = dict(num_heads=4, head_dim=32, short_conv_kernel_size=4, use_full_rank_gate=True, gate_lower_bound=-5.0,
                kda_layers=[1, 2], full_attn_layers=[3])
    path = write_checkpoint(tmp_path / "t", make_text_config(num_hidden_layers=3, tie_word_embeddings=True,
                                                            vocab_size=8192, linear_attn_config=attn))
    w = ke.from_pretrained(path, weight_dtype="bfloat16", bf16_matvec="widen")
    before = ke.memory_report(w)["bf16 widening scratch"]
    ke.kimi_forward_token(w, w.new_state(), 5)
    assert before == ke.memory_report(w)["bf16 widening scratch"] == 4 * 8192 * w.config.hidden_size


def test_the_routers_own_choice_is_recomputed_exactly_and_with_its_own_top_k(trained_weights, tmp_path):
    """The table judged forced/by_bias against the trace's width (a hook routing one token to 3 experts widened
    every token to 3) and against float64 sums with a 1e-5 tolerance (a real hook choice 4.8e-7 below the k-th
    biased score read as the router's). It now asks `select_experts` in the recorded dtype, with the router's k."""
    from kimi_explore.inspection import interventions as iv
    from kimi_explore.model.latent_moe import select_experts
    from kimi_explore.views import summaries
    from kimi_explore.views.common import bias_vectors, routing

    bias = bias_vectors(trained_weights)
    s = Session(trained_weights, hooks=iv.force_routing(3, [0, 1, 2], positions=[0]))
    s.feed(b"def f(x):")
    r = routing(s.trace())
    assert r["topk_ids"].shape[2] == 3  # widened for every token
    for t in range(1, len(s)):
        tab = summaries.topk_table(r, t, bias, top_k=2)
        for j, layer in enumerate(tab["moe_layers"]):
            raw = np.asarray(r["scores"][t, j])
            mine = set(select_experts(raw, bias[layer].astype(raw.dtype), 2).tolist())
            chosen = [int(e) for e in tab["ids"][j] if e >= 0]
            assert set(chosen) == mine and not tab["forced"][j].any()
            unbiased = sorted(range(raw.size), key=lambda e: (-float(raw[e]), e))[:2]
            assert [e for e, _ in tab["displaced"][j]] == [e for e in unbiased if e not in mine]
            assert [bool(b) for b in tab["by_bias"][j][: len(chosen)]] == [e not in unbiased for e in chosen]
    # a hook that swaps the router's last choice for its next-ranked expert, however close their biased scores
    plain = Session(trained_weights)
    plain.feed(b"def f(x):")
    t, j = 4, 2
    r = routing(plain.trace())
    layer = r["moe_layers"][j]
    raw = np.asarray(r["scores"][t, j])
    biased = raw + bias[layer].astype(raw.dtype)  # as the router sums them
    order = sorted(range(raw.size), key=lambda e: (-float(biased[e]), e))  # every expert, by biased score
    chosen_by_hook = order[:1] + order[2:3]
    swapped = Session(trained_weights, hooks=iv.force_routing(layer, chosen_by_hook, positions=[t]))
    swapped.feed(b"def f(x):")
    tab = summaries.topk_table(routing(swapped.trace()), t, bias, top_k=2)
    assert tab["forced"][j].tolist() == [e == order[2] for e in tab["ids"][j]]
    assert not tab["forced"][:j].any() and not tab["by_bias"][j][list(tab["ids"][j]).index(order[2])]


def test_the_lens_of_nan_logits_shows_no_prediction_and_pipeline_bias_is_empty(trained_weights):
    """The lens grid labelled NaN rows with their tie-order id 0, and counted them in the agreement; bias_vectors
    of a RayPipeline raised AttributeError (the Explorer and the summary table over a pipeline session)."""
    from kimi_explore.views.common import bias_vectors
    from kimi_explore.views.figures.analysis_plots import lens_grid

    s = Session(trained_weights, hooks=nan_from(2, "layers.6.ffn.out"))
    s.feed(b"abcd")
    lens = ke.logit_lens(s, top=1)
    assert (lens.final_ids[2:] == -1).all() and (lens.final_ids[:2] >= 0).all()
    want = (lens.top_ids[:2, :, 0] == lens.final_ids[:2, None]).mean(axis=0)
    np.testing.assert_array_equal(lens.agreement(), want)  # over the two tokens that have a prediction
    texts = [t.get_text() for t in lens_grid(lens).axes[0].texts]
    assert texts.count("NaN") == int(np.isnan(lens.top_probs[:, :, 0]).sum()) == 3  # token 2 at 6-7, token 3 at 7
    assert bias_vectors(type("Pipe", (), {"config": trained_weights.config})()) == {}


def test_the_views_without_the_bias_and_with_nan_logits(trained_weights):
    """From a bare Trace (no bias known) a hook's forced experts were starred 'chosen only through the selection
    bias', and judged against the trace's width; the Explorer's Predictions tab listed NaN logits' tie order; a
    failed attribution hid the lens that runs; a padded slot hovered 'no expert (ablated)'."""
    from kimi_explore.inspection import interventions as iv
    from kimi_explore.views.explorer import specs_moe
    from kimi_explore.views.figures.plots_summary import topk_table_html

    s = Session(trained_weights, tokenizer=ke.load_tokenizer(trained_weights))
    with s.intervene(iv.force_routing("all", [14, 15])):
        s.feed(b"def f(x):")
    page = topk_table_html(s.trace(), -1)
    assert "outside the unbiased top-k: the selection bias or a hook (the bias is not known here)" in page
    ex = Explorer(s, tab="MoE routing")
    ex.bias = {}  # as over a RayPipeline, whose routers live in its stages
    ex.select(token=3)
    assert "* = outside the unbiased top-k (bias or hook)" in ex.views["moe_topk"].spec["layout"]["title"]["text"]
    wide = Session(trained_weights, hooks=iv.force_routing(3, [0, 1, 2], positions=[0]))
    wide.feed(b"def f(x):")
    from kimi_explore.views.common import bias_vectors

    assert topk_table_html(wide.trace(), -1, bias_vectors(trained_weights)) == topk_table_html(wide, -1)  # k = 2
    ex = Explorer(wide, tab="MoE routing")
    ex.select(token=5, layer=3)
    hover = ex.views["moe_topk"].spec["data"][0]["customdata"]
    assert any("padding: another token was routed to more experts" in h for row in hover for h in row)
    bad = Session(trained_weights, tokenizer=ke.ByteTokenizer(), hooks=nan_from(6, "layers.4.ffn.out"))
    bad.feed(b"def f(x):")
    data, layout = specs_moe.predictions(bad.trace(), 8)
    assert data == [] and "the logits hold NaN" in layout["annotations"][0]["text"]
    ex = Explorer(bad, tab="Lens & attribution")
    ex.select(token=8)
    ex.tab_views.compute_analyses()
    assert ex.views["lens"].spec["data"] and "No attribution for token 8" in str(ex.views["attribution"].spec)
