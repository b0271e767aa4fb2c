"""One end-to-end test in a real browser (see browser_e2e.py): JupyterLab + headless Chromium + Playwright.

Opens notebooks/01_tour.ipynb, runs all cells, clicks Step twice and checks the block-residual view
changed each time. Screenshots land in artifacts/browser/ (gitignored): look at them.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from browser_e2e import CHROMIUM, ROOT, run

pytestmark = pytest.mark.browser


def _missing() -> str | None:
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} not found (Debian package 'chromium'; .ci/run installs it)"
    for module in ("playwright", "jupyterlab"):
        if importlib.util.find_spec(module) is None:
            return f"Python package {module!r} is not installed (pip install -e .[dev])"
    return None


@pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
def test_tour_notebook_in_jupyterlab_step_twice_changes_the_block_residual_view():
    artifacts = ROOT / "artifacts" / "browser"
    seen = run(artifacts)
    status = seen["status"]
    assert len(status) == 3
    n0 = int(status[0].split()[0])
    assert n0 == 4, f"the tour steps four tokens before the user does: {status[0]!r}"
    assert [int(s.split()[0]) for s in status] == [4, 5, 6], status  # each click decoded one token
    views = seen["view_sha256"]
    assert len(set(views)) == 3, "the block-residual view did not change after each Step"
    assert not seen["page_errors"], seen["page_errors"]
    for path in seen["screenshots"]:
        assert Path(path).stat().st_size > 10_000, f"{path} looks empty"
