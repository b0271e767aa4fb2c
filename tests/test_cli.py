"""The main job: `kimi-explore` / `python -m kimi_explore`."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REFERENCE_DIR

from kimi_explore import CheckpointError, KimiDecodeState, kimi_forward_token
from kimi_explore.cli import RANDOM_NOTE, CliError, main, parse_layers
from kimi_explore.weights.tiny_model import random_tiny_checkpoint


def test_help_explains_itself():
    out = subprocess.run([sys.executable, "-m", "kimi_explore", "--help"], capture_output=True, text=True, check=True).stdout
    words = ("--checkpoint", "--prompt", "--ids", "--layers", "--device", "--experts", "--expert-cache-size", "--debug",
             "embedded tiny")
    for word in words:
        assert word in out


def test_main_job_prints_the_decoder_predictions(capsys, tiny_weights):
    assert main(["--ids", "72,101,108", "--top", "3", "--generate", "2", "--checkpoint", str(random_tiny_checkpoint())]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit() and line.startswith("   ")]
    assert len(rows) == 5
    # the first prediction printed is the decoder's argmax for the first token
    state = KimiDecodeState.new(tiny_weights)
    logits = kimi_forward_token(tiny_weights, state, 72)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    assert rows[0][3] == str(int(np.argmax(p))) and float(rows[0][4]) == round(float(p.max()), 3)
    assert "ms/token" in out


def test_layer_argument_forms():
    assert list(parse_layers("0-3")) == [0, 1, 2, 3]
    assert list(parse_layers("2:4")) == [2, 3]
    assert parse_layers("1,5") == [1, 5]


def test_expert_options_reach_the_loader(capsys):
    """Packed experts print how they are multiplied, and predict what the dense ones predict."""
    from kimi_explore.weights import mxfp4_matvec

    first = {}  # top-1 prediction per step, per option set
    for argv in ([], ["--experts", "packed", "--expert-cache-size", "2"], ["--experts", "packed", "--expert-cache-size", "0"]):
        assert main(["--ids", "72,101", "--top", "1", *argv]) == 0
        out = capsys.readouterr().out
        route = [line for line in out.splitlines() if "routed experts:" in line]
        steps = [line for line in out.splitlines() if line.startswith("   ") and line[:4].strip().isdigit()]
        first[tuple(argv)] = [line.split()[3] for line in steps]
        if not argv:
            assert route == ["  routed experts: dequantised at load"]
        elif argv[-1] == "2":
            assert route == ["  routed experts: dequantised per token, LRU cache of 2 per layer"]
        else:
            want = f"fused MXFP4 kernel ({mxfp4_matvec.default_isa()})" if mxfp4_matvec.AVAILABLE else "dequantised per token"
            assert route[0].startswith(f"  routed experts: {want}")
    assert len(set(map(tuple, first.values()))) == 1  # the same top-1 predictions every way


def run_main(argv, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `main(argv)`, whether it returns or argparse exits."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


BAD_ARGS = {
    "reversed-range": (["--layers", "5-2"], "argument --layers: '5-2': the range is reversed (5 > 2); did you mean 2-5?"),
    "empty-range": (["--layers", "3:3"], "3:3 selects no layer"),
    "bad-layers": (["--layers", "a-b"], "expected '0-3', '0:4' or '1,5,9'"),
    "id-outside-vocab": (["--ids", "72,300"], "--ids: 300 outside the vocabulary of"),
    "negative-id": (["--ids=-1,5"], "--ids: -1 outside the vocabulary"),
    "not-an-id": (["--ids", "7,x"], "'x' is not an integer"),
    "empty-ids": (["--ids", ""], "--ids is empty"),
    "empty-prompt": (["--prompt", ""], "argument --prompt: the prompt is empty"),
    "negative-generate": (["--generate", "-1"], "argument --generate: expected an integer >= 0, got -1"),
    "zero-top": (["--top", "0"], "argument --top: expected an integer >= 1, got 0"),
    "unknown-flag": (["--bogus"], "unrecognized arguments: --bogus"),
}


@pytest.mark.parametrize("argv, expected", list(BAD_ARGS.values()), ids=list(BAD_ARGS))
def test_bad_arguments_are_one_line_and_exit_2_before_decoding(argv, expected, capsys):
    code, out, err = run_main(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("kimi-explore: error: "), err
    assert expected in err
    assert "step" not in out  # nothing was decoded (the 72 of '72,300' included)


def test_a_missing_checkpoint_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    argv = ["--checkpoint", str(tmp_path / "nowhere" / "deeper"), "--ids", "1"]
    code, _, err = run_main(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "not a checkpoint directory" in err
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        main([*argv, "--debug"])
    with pytest.raises(CliError, match="300 outside the vocabulary"):
        main(["--ids", "72,300", "--debug"])


def test_the_installed_command_prints_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kimi_explore", "--layers", "5-2"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == ["kimi-explore: error: argument --layers: '5-2': the range is reversed (5 > 2); "
                                     "did you mean 2-5? (--help lists the arguments)"]


def test_the_header_says_when_the_weights_are_random(capsys):
    assert main(["--ids", "72", "--checkpoint", str(random_tiny_checkpoint())]) == 0
    assert RANDOM_NOTE in capsys.readouterr().out.splitlines()[0]
    assert main(["--ids", "72", "--checkpoint", str(REFERENCE_DIR)]) == 0
    assert RANDOM_NOTE not in capsys.readouterr().out  # Moonshot's reference checkpoint is not the random default


def test_the_header_says_what_the_default_model_is(capsys):
    """The default is the trained tiny K3: the header names it, its corpus and its bits/byte."""
    assert main(["--ids", "72"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "trained on Python's pydoc_data.topics" in first and "bits/byte" in first and RANDOM_NOTE not in first


def test_layer_ranges_that_select_nothing():
    for text in ("5-2", "4:2", "3:3"):
        with pytest.raises(argparse.ArgumentTypeError, match="reversed|selects no layer"):
            parse_layers(text)
    assert list(parse_layers("3-3")) == [3]


def _greedy(weights, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt`, decoded here with the decoder alone."""
    state = KimiDecodeState.new(weights)
    for t in prompt[:-1]:
        kimi_forward_token(weights, state, t)
    out, t = [], prompt[-1]
    for _ in range(n):
        t = int(np.argmax(np.asarray(kimi_forward_token(weights, state, t))))
        out.append(t)
    return out


def test_generate_prints_the_generated_text_as_one_string(capsys):
    from kimi_explore import from_pretrained
    from kimi_explore.weights.tiny_model import tiny_checkpoint

    assert main(["--prompt", "The ", "--generate", "12", "--top", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = bytes(_greedy(from_pretrained(tiny_checkpoint(), device="cpu"), list(b"The "), 12)).decode("utf-8", "replace")
    assert lines[-1] == f"generated text (12 tokens after the prompt): {expected!r}"
    assert "ms/token" in lines[-2]  # after the table and its summary
    # given as ids (no text), the generated ids come back as an --ids list
    assert main(["--ids", "84,104", "--generate", "3", "--checkpoint", str(REFERENCE_DIR)]) == 0
    ids = _greedy(from_pretrained(REFERENCE_DIR, device="cpu"), [84, 104], 3)
    assert capsys.readouterr().out.splitlines()[-1] == f"generated ids (3 after the prompt): {','.join(map(str, ids))}"
    assert main(["--ids", "84"]) == 0
    assert "generated" not in capsys.readouterr().out  # nothing generated, nothing printed


def test_generate_stops_after_the_tokenizers_stop_token(tmp_path, capsys, monkeypatch):
    """--generate ran past K3's stop token (<|end_of_msg|>, which ends an assistant turn), and `report --generate` too.
    Here the stop id is set to the first greedy token that is new after the first (a random model seldom picks a
    special): the CLI must stop right after generating it, and the report's session must be asked to."""
    import shutil

    from kimi_explore import cli, from_pretrained, load_tokenizer
    from kimi_explore.inspection.session import Session
    from kimi_explore.views.figures import report
    from kimi_explore.weights.tiny_model import make_text_config, write_checkpoint

    ck = write_checkpoint(tmp_path / "ck", make_text_config(vocab_size=678))
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(Path(__file__).parent / "data" / "tokenizer" / "synthetic_k3" / f, ck / f)
    tok = load_tokenizer(ck)
    greedy = _greedy(from_pretrained(ck, device="cpu"), tok.encode("hello"), 8)
    i = next(i for i in range(1, 8) if greedy[i] not in greedy[:i])
    real = cli.prompt_tokenizer

    def stopping(args, weights):
        t = real(args, weights)
        t.eos_id = greedy[i]
        return t

    monkeypatch.setattr(cli, "prompt_tokenizer", stopping)
    assert main(["--checkpoint", str(ck), "--prompt", "hello", "--generate", "8", "--top", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == f"generated text ({i + 1} tokens after the prompt): {tok.decode(greedy[: i + 1])!r}"
    assert lines[-1] == f"stopped at the stop token '{tok.token_label(greedy[i])}' after {i + 1} of 8"
    ids = ",".join(map(str, tok.encode("hello")))  # --ids stops there too (it ran on; `report --ids` stopped)
    assert main(["--checkpoint", str(ck), "--ids", ids, "--generate", "8", "--top", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        f"generated ids ({i + 1} after the prompt): {','.join(map(str, greedy[: i + 1]))}",
        f"stopped at the stop token {greedy[i]} after {i + 1} of 8"]

    asked = []
    monkeypatch.setattr(Session, "generate", lambda self, n, **kw: asked.append((n, kw)) or [])
    monkeypatch.setattr(report, "write_report", lambda *a, **kw: tmp_path / "r" / "index.html")  # (its figures: elsewhere)
    assert main(["report", "--checkpoint", str(ck), "--prompt", "hello", "--generate", "8", "--out", str(tmp_path / "r")]) == 0
    assert asked == [(8, {"stop_tokens": (greedy[i],)})]
