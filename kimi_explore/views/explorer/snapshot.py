"""One offline HTML file of what the Explorer shows now: the open tab's views as drawn (with the
user's zoom), the selected token, layer and tab, and the decoded text.

    path = explorer.snapshot("step_12.html")     # or the Snapshot button (written to the working directory)

The page inlines plotly.js from the installed wheel and every figure's spec (typed arrays as
base64): it has no external link and opens from a file or an e-mail attachment. Its state is also
in a `<script type="application/json" id="kimi-state">` block, for a script to read back.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from ...inspection.npz_io import write_atomically
from .plotly_view import plotly_js_source

__all__ = ["snapshot_html", "write_snapshot"]

CSS = """body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } .state { color: #555; } .view { border: 1px solid #eee; margin: 1em 0; }
pre { white-space: pre-wrap; background: #f6f6f6; padding: .5em; }"""


def _in_script(value) -> str:
    """JSON for inside a <script> element: '<', '>' and '&' as \\u escapes (the same JSON and JavaScript values), so a
    decoded text holding '</script>' cannot close the element and leave the rest as page text."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def snapshot_html(state: dict, views: dict[str, dict]) -> str:
    """The page: `state` (token, layer, tab, ...) and `views` {name: {"data", "layout"}} in order."""
    blocks, calls = [], []
    for i, (name, spec) in enumerate(views.items()):
        blocks.append(f'<div class="view" id="v{i}" data-name="{html.escape(name)}" '
                      f'style="height:{int(spec["layout"].get("height", 320))}px"></div>')
        calls.append(f"Plotly.newPlot('v{i}', {_in_script(spec['data'])}, {_in_script(spec['layout'])}, "
                     "{displayModeBar: false, responsive: true});")
    title = f"Kimi K3 Explorer: token {state['token']} {state['token_label']}, layer {state['layer']}, {state['tab']}"
    return "\n".join([
        "<!DOCTYPE html>", "<html><head><meta charset='utf-8'>", f"<title>{html.escape(title)}</title>",
        f"<style>{CSS}</style>",
        f"<script>{plotly_js_source()}</script>", "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='state'>{state['tokens']} tokens decoded; layer {state['layer']} ({html.escape(state['layer_kind'])})</p>",
        f"<pre>{html.escape(state['text'])}</pre>",
        *blocks,
        f'<script type="application/json" id="kimi-state">{_in_script(state)}</script>',
        "<script>" + "\n".join(calls) + "</script>",
        "</body></html>"])


def write_snapshot(explorer, path=None) -> Path:
    """Write the open tab of `explorer` as it is now to `path` (default: a name from the state, in the
    working directory); returns the path."""
    ex = explorer
    ex.sync()  # a history changed outside the Explorer: the page shows the session as it is
    n = len(ex.session)
    if not n:
        raise ValueError("snapshot: nothing is decoded yet: Step first")
    tab = ex.tabs.selected_index
    ex.refresh(tab)  # the open tab's views are up to date (they are; this is cheap when they are)
    t = min(ex.token.value, n - 1)
    shown = ex.tab_views.tab_views(tab)  # the ablation's two views too, on the Predictions tab
    views = {name: v.snapshot() for name, v in shown.items()}
    views = {k: v for k, v in views.items() if v is not None}
    label = ex.labels()[t]
    state = {"tokens": n, "token": t, "token_label": label, "layer": ex.layer.value,
             "layer_kind": dict((v, k) for k, v in ex.layer.options)[ex.layer.value].split(None, 1)[1],
             "tab": ex.tab_views.titles[tab], "zoom": {k: dict(shown[k].ranges) for k in views if shown[k].ranges},
             "text": "".join(ex.text.labels), "token_ids": [int(i) for i in ex.session.tokens]}
    path = Path(path) if path is not None else Path(f"kimi_snapshot_t{t}_layer{state['layer']}_tab{tab}.html")
    page = snapshot_html(state, views)
    return write_atomically(path, lambda tmp: tmp.write_text(page, encoding="utf-8"))  # never half a page
