"""Explorer Step latency in a real browser (JupyterLab + headless Chromium), on the embedded and a K3-depth model.

    python bench/explorer_latency.py

Runs the end-to-end browser scenario of tests/browser_e2e.py (three Steps on every tab of each model,
timed in the page from the click to every visible view redrawn), prints a table and writes
bench/results/explorer_latency.json. Needs /usr/bin/chromium, playwright and jupyterlab.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from browser_e2e import latency_table, run  # noqa: E402

if __name__ == "__main__":
    seen = run(ROOT / "artifacts" / "browser")
    print(latency_table(seen))
    out = {model: {tab: {"median_ms": statistics.median(ms), "max_ms": max(ms), "samples_ms": ms}
                   for tab, ms in seen[model]["latency_ms"].items()} for model in ("embedded", "k3_depth")}
    path = ROOT / "bench" / "results" / "explorer_latency.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
