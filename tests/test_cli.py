"""The main job: `kimi-explore` / `python -m kimi_explore`."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from kimi_explore import KimiDecodeState, kimi_forward_token
from kimi_explore.cli import main, parse_layers


def test_help_explains_itself():
    out = subprocess.run([sys.executable, "-m", "kimi_explore", "--help"], capture_output=True, text=True, check=True).stdout
    words = ("--checkpoint", "--prompt", "--ids", "--layers", "--device", "--experts", "--expert-cache-size", "embedded tiny")
    for word in words:
        assert word in out


def test_main_job_prints_the_decoder_predictions(capsys, tiny_weights):
    assert main(["--ids", "72,101,108", "--top", "3", "--generate", "2"]) == 0
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
            want = f"fused MXFP4 kernel ({mxfp4_matvec.isas()[-1]})" if mxfp4_matvec.AVAILABLE else "dequantised per token"
            assert route[0].startswith(f"  routed experts: {want}")
    assert len(set(map(tuple, first.values()))) == 1  # the same top-1 predictions every way
