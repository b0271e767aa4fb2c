"""`kimi-explore report`: PNGs plus one self-contained HTML page that needs no network."""

from __future__ import annotations

import base64
import re
import subprocess
import sys

import numpy as np
import pytest
from synthetic_trace import SyntheticTrace

from kimi_explore import KimiDecodeState, cli, kimi_forward_token
from kimi_explore.cli import RANDOM_NOTE
from kimi_explore.views.figures.report import write_report
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def main(argv: list[str]) -> int:
    """`kimi-explore report ARGV...` (the command-line entry is the CLI's)."""
    return cli.main(["report", *argv])


def check_self_contained(page: str, out_dir) -> list[str]:
    """Every image is an inline PNG identical to its file; nothing is fetched from anywhere."""
    assert not re.search(r"<(script|link|iframe|object|embed)\b", page, re.I), "the page must not load anything"
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I), "external reference"
    assert "http://" not in page and "https://" not in page
    assert "url(" not in page  # no CSS fetches
    srcs = re.findall(r'<img alt="([^"]+)" src="([^"]+)"', page)
    assert srcs and len(srcs) == page.count("<img")
    for stem, src in srcs:
        assert src.startswith("data:image/png;base64,"), stem
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert data.startswith(PNG_MAGIC)
        assert data == (out_dir / f"{stem}.png").read_bytes(), f"{stem}: inline image differs from the PNG file"
    return [stem for stem, _ in srcs]


def test_report_command_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["--prompt", "K3 ok!", "--out", str(out)]) == 0
    assert "index.html" in capsys.readouterr().out
    page = (out / "index.html").read_text(encoding="utf-8")
    stems = check_self_contained(page, out)
    for must in ("block_residuals_last_token", "kda_state_curves", "kda_state_last_token", "moe_routing_last_token",
                 "moe_layer_stats", "moe_sorted_counts", "moe_output_norms", "predictions_last_token"):
        assert must in stems
    # a table of contents that links every figure, and the per-layer views on layers with every view
    nav = page.split("<nav>", 1)[1].split("</nav>", 1)[0]
    assert all(f"href='#{s}'" in nav for s in stems) and all(f'id="{s}"' in page for s in stems)
    assert "Experts of token" in page and "pushed out" in page  # the top-k table of the last token
    assert any(s.startswith("block_residuals_layer") for s in stems)
    assert sorted(p.stem for p in out.glob("*.png")) == sorted(stems)
    assert "K3 ok!" in page  # the decoded prompt, via the byte tokenizer
    predictions = page.split("Predictions at every step</h2>", 1)[1]
    assert predictions.count("<tr>") == 1 + len("K3 ok!")  # one prediction row per token


def test_report_with_ids_and_a_layer_subset(tmp_path):
    out = tmp_path / "r"
    assert main(["--ids", "75,51", "--layers", "0-4", "--out", str(out)]) == 0
    page = (out / "index.html").read_text(encoding="utf-8")
    stems = check_self_contained(page, out)
    assert "layers [0, 1, 2, 3, 4]" in page
    assert "block_residuals_layer4" in stems and "block_residuals_layer5" not in stems


def test_report_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--prompt", "a", "--ids", "1"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--prompt", "a"])
    assert "the following arguments are required: --out" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--prompt", "", "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "the prompt is empty" in capsys.readouterr().err
    assert main(["--ids", "1,300", "--out", str(tmp_path / "y")]) == 2  # checked before decoding or writing
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kimi-explore report: error: --ids: 300 outside the vocabulary")
    assert not (tmp_path / "y").exists()


def test_report_takes_the_model_options_and_top(tmp_path, monkeypatch, tiny_weights):
    """--experts and --weight-dtype reach the loader; --top sets how many predictions each table row shows."""
    import kimi_explore as ke
    from kimi_explore.weights import load as load_module

    seen, load = [], ke.from_pretrained
    monkeypatch.setattr(load_module, "load_weights", lambda path, **kw: seen.append(kw) or load(path, **kw))
    out = tmp_path / "r"
    assert main(["--ids", "72,101", "--experts", "packed", "--weight-dtype", "bfloat16", "--top", "12", "--out", str(out),
                 "--checkpoint", str(random_tiny_checkpoint())]) == 0  # the random model: the `tiny_weights` fixture
    assert seen[0]["experts"] == "packed" and seen[0]["weight_dtype"] == "bfloat16"
    page = (out / "index.html").read_text(encoding="utf-8")
    rows = re.findall(r"<tr><td>.*?</td><td>(.*?)</td></tr>", page)
    assert len(rows) == 2 and all(r.count(" 0.") + r.count(" 1.0") == 12 for r in rows)
    state = KimiDecodeState.new(tiny_weights)  # the first row's best probability is the decoder's
    z = np.asarray(kimi_forward_token(tiny_weights, state, 72), dtype=np.float64)
    p = np.exp(z - z.max())
    assert f" {p.max() / p.sum():.3f}" in rows[0].split(",")[0]
    assert "top-12 next-token predictions" in page and RANDOM_NOTE in page


def test_write_report_from_a_bare_trace(tmp_path):
    """The page builder takes a Trace (here a hand-built one) as well as a Session; layers= picks the views."""
    tr = SyntheticTrace(n_tokens=4, n_layers=12)
    page = write_report(tr, tmp_path, layers=[1, 3], dpi=30)
    stems = check_self_contained(page.read_text(encoding="utf-8"), tmp_path)
    assert {"block_residuals_layer1", "block_residuals_layer3", "moe_routing_layer1", "kda_state_layer1"} <= set(stems)
    assert "kda_state_layer3" not in stems  # layer 3 is MLA: no recurrent state


def test_default_layers_end_at_the_deepest_kda_moe_layer():
    from kimi_explore.views.figures.report import default_layers

    tr = SyntheticTrace(n_tokens=2, n_layers=16)
    both = [i for i in tr.kda_ids if i in tr.moe_ids]
    picked = default_layers(tr)
    assert picked[-1] == both[-1] and len(picked) == 3 and 0 not in picked and set(picked) <= set(both)


def test_cli_dispatches_report(tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "kimi_explore", "report", "--ids", "1,2", "--layers", "0-1", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (out / "index.html").is_file()
