"""Every notebook runs headlessly in a real kernel (nbclient), without errors, and the executed
notebook holds its figures: PNG outputs, and for the Explorer, plot specs in the saved widget state."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def test_the_notebooks_exist_and_are_stored_without_outputs():
    assert {"01_", "02_", "03_", "04_", "05_", "06_", "07_", "08_"} <= {p.name[:3] for p in NOTEBOOKS}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(not c.outputs and c.execution_count is None for c in code), f"{path.name} has outputs"
        assert "widgets" not in nb.metadata, f"{path.name} has saved widget state"
        cells = json.loads(path.read_text())["cells"]  # (nbformat 4.5: every cell an id; missing ones only warn today)
        ids = [c.get("id") for c in cells]
        assert None not in ids and len(set(ids)) == len(ids), f"{path.name}: a cell without an id, or a repeated one"


def png_outputs(nb) -> list[bytes]:
    return [base64.b64decode(o["data"]["image/png"]) for c in nb.cells if c.cell_type == "code"
            for o in c.outputs if "image/png" in o.get("data", {})]


def widget_plots(nb) -> dict[str, dict]:
    """model id -> plotly spec of every Explorer view (an anywidget `PlotView`) in the saved widget state."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    return {mid: model["state"]["spec"] for mid, model in state.items()
            if model["model_name"] == "AnyModel" and model["state"].get("spec", {}).get("data")}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_and_shows_figures(path, tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(tmp_path)}},
                   store_widget_state=True).execute()
    nbformat.write(nb, tmp_path / path.name)  # kept for a look when a test fails
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0]['ename']}: {errors[0]['evalue']}"
    pngs, explorer = png_outputs(nb), any("ke.Explorer(" in c.source for c in nb.cells)
    assert (pngs or explorer) and all(p.startswith(PNG_MAGIC) for p in pngs), f"{path.name}: no figure outputs"
    if explorer:  # its figures are the Explorer's plotly views (01 shows nothing else)
        plots = widget_plots(nb)
        assert plots, f"{path.name}: Explorer drew nothing"
        view_mime = "application/vnd.jupyter.widget-view+json"
        views = [o for c in nb.cells for o in c.get("outputs", []) if view_mime in o.get("data", {})]
        assert views, f"{path.name}: the Explorer was not displayed"
    if path.name.startswith("08_"):  # the verdict is printed from the numbers, for both effect measures
        text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        assert text.count("the Spearman correlation of softmax mass with the") == 2, f"{path.name}: no verdict"
        assert "families by mean mass:" in text
    if path.name.startswith("01_"):
        # the tour draws every tab: 9 views (the full expert map, the expert search and the ablation stay
        # empty until asked for)
        assert len(widget_plots(nb)) == 9
    json.dumps(nb)  # the executed notebook is plain JSON (no stray objects in outputs)
