"""One end-to-end test in a real browser (see browser_e2e.py): JupyterLab + headless Chromium + Playwright,
on the embedded model and on a K3-depth synthetic model (93 layers, 896 experts top-16).

What a user does, checked from what the page shows: the views render offline (plotly.js from the
installed wheel, no request leaves 127.0.0.1); each Step decodes one token and redraws every view of
the open tab (the latency is printed, never asserted); hovering an MoE cell shows the expert id and
its score; a click on a token or a layer moves the selection of every visible view; a new prompt
starts the history over. Screenshots land in artifacts/browser/ (gitignored): look at them.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
from browser_e2e import CHROMIUM, HISTORY, ROOT, TABS, latency_table, run

pytestmark = pytest.mark.browser


def _missing() -> str | None:
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} not found (Debian package 'chromium'; .ci/run installs it)"
    for module in ("playwright", "jupyterlab"):
        if importlib.util.find_spec(module) is None:
            return f"Python package {module!r} is not installed (pip install -e .[dev])"
    return None


@pytest.fixture(scope="module")
def seen():
    return run(ROOT / "artifacts" / "browser")


def tokens_decoded(status: str) -> int:
    return int(status.split()[0])


@pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
@pytest.mark.parametrize("model", ["embedded", "k3_depth"])
def test_explorer_in_jupyterlab(seen, model, capsys):
    out = seen[model]
    assert not seen["page_errors"], seen["page_errors"]
    assert not seen["requests_elsewhere"], f"the page reached beyond 127.0.0.1: {seen['requests_elsewhere'][:5]}"
    # four Steps in the notebook, then three per tab, one token each
    assert tokens_decoded(out["status_start"]) == HISTORY + 4, out["status_start"]  # the timed Steps start at 300
    assert tokens_decoded(out["status_after_steps"]) == HISTORY + 4 + 3 * len(TABS), out["status_after_steps"]
    # the new views drew: the lens of the selected token, the expert search, the ablation's run diff
    last = HISTORY + 4 + 3 * len(TABS) - 1
    expected = f"Logit lens of token {last} " if model == "embedded" else f"Press Compute for token {last}"
    assert out["lens_title"].startswith(expected), out["lens_title"]
    assert out["expert_search_title"].startswith("Where expert 3 fires"), out["expert_search_title"]
    assert "forked at token" in out["ablation_note"], out["ablation_note"]
    assert set(out["latency_ms"]) == set(TABS)
    # the top-k table's expert ids, written in its cells by the view, read as plotly's texttemplate writes them
    # (text, colour, position of each), white on the dark cells and grey on the light ones
    cells = out["topk_cells"]
    assert cells["ours"] == cells["plotly"] > 0 and cells["same"] and 0 < cells["white"] < cells["ours"], cells
    # hover: the expert id and its score, in the top-k table and in the full map
    assert re.search(r"expert \d+", out["topk_tooltip"]) and "unbiased score 0." in out["topk_tooltip"], out["topk_tooltip"]
    assert re.search(r"expert \d+", out["full_map_tooltip"]) and "score" in out["full_map_tooltip"], out["full_map_tooltip"]
    # a click on token 2 in the text: every visible view shows token 2, so do the label and the slider
    assert out["after_token_click"] and all(m["token"] == 2 for m in out["after_token_click"].values())
    assert out["token_label"].startswith("2 "), out["token_label"]
    # a click on a layer column: every visible view shows that layer, as does the layer menu
    layers = {m["layer"] for m in out["after_layer_click"].values()}
    menu = out["layer_dropdown"].split()[0]  # the option text: '9  KDA + MoE'
    assert len(layers) == 1 and str(layers.pop()) == menu, (out["after_layer_click"], out["layer_dropdown"])
    # a new layer on the Predictions tab: the view shows it (meta, revision) without a redraw; a Step: one redraw
    u = out["unchanged_view"]
    assert u["after_layer"]["meta"]["layer"] != u["before"]["layer"] and u["after_layer"]["redraws"] == 0, u
    assert u["after_layer"]["meta"]["token"] == u["before"]["token"], u
    assert u["after_step"]["redraws"] >= 1 and u["after_step"]["meta"]["tokens"] == u["before"]["tokens"] + 1, u
    assert u["after_step"]["rendered"] > u["after_layer"]["rendered"] > 0, u
    # a new prompt starts over: one token of it, not the old history plus one
    assert "new prompt" in out["status_new_prompt"], out["status_new_prompt"]
    assert tokens_decoded(out["status_after_new_prompt"]) == 1, out["status_after_new_prompt"]
    assert out["text_after_new_prompt"] == "Q", out["text_after_new_prompt"]
    for path in seen["screenshots"]:
        assert Path(path).stat().st_size > 10_000, f"{path} looks empty"
    with capsys.disabled():
        print("\n" + latency_table({model: out}))
