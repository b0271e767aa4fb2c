"""End to end in a real browser: JupyterLab on 127.0.0.1 + headless Chromium driven by Playwright.

    python tests/browser_e2e.py [ARTIFACTS_DIR]      # standalone (prints what it saw); pytest runs it too

One JupyterLab (random free port, empty token, isolated Jupyter dirs, no news or update checks)
serves two generated notebooks that open the Explorer: on the embedded model and on a K3-depth
synthetic model (93 layers, 896 experts top-16, written first with `write_k3_depth`). On each:
run all cells; Step on every tab, timing click -> every visible view of the tab redrawn (in the
page, `performance.now()`); hover an MoE top-k cell and the full expert map and read the tooltips;
click a token in the text and a layer in a map, and read every visible view's selection back from
its plotly layout (`layout.meta`); type a new prompt and Step. Screenshots (1400 x 900) go to
ARTIFACTS_DIR (default artifacts/browser/); nothing is fetched from outside 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1400, "height": 900}
PROMPT = "Kimi K3, one token at a time."
# the history the Steps are timed at (issue 20: 300 tokens): fed before the Explorer opens
HISTORY_TEXT = ("The Explorer steps Kimi K3 one token at a time; every view shows the selected token and "
                "layer, and a Step must cost the same at any history length. ") * 4
HISTORY = 296  # + 4 Steps in the notebook = 300 tokens when the timed Steps start
TABS = ("Block residuals", "KDA state", "MoE routing", "Predictions")  # timed; the analyses tab replays by design
KERNEL_IDLE = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.connectionStatus === 'connected' && k.status === 'idle';
}"""
# every visible view drew the Explorer's last refresh, and no step is running
SETTLED = """() => {
  const done = document.querySelector('.kimi-done');
  if (!done || document.querySelector('.kimi-busy')) return false;
  const rev = Number(done.dataset.rev);
  const plots = [...document.querySelectorAll('.kimi-plot')].filter(e => e.offsetParent !== null && e.dataset.rendered);
  return plots.length > 0 && plots.every(p => Number(p.dataset.rendered) >= rev);
}"""
# click Step, resolve with the ms until every visible view drew the new history (polled every frame)
TIMED_STEP = """async () => {
  const done = () => document.querySelector('.kimi-done');
  const n = Number(done().dataset.tokens), before = Number(done().dataset.rev);
  const step = [...document.querySelectorAll('.widget-button')].find(b => b.textContent.trim() === 'Step');
  const t0 = performance.now();
  step.click();
  return await new Promise((resolve, reject) => {
    const check = () => {
      const d = done(), rev = Number(d.dataset.rev);
      const plots = [...document.querySelectorAll('.kimi-plot')].filter(e => e.offsetParent !== null && e.dataset.rendered);
      if (rev > before && Number(d.dataset.tokens) !== n && !document.querySelector('.kimi-busy')
          && plots.length && plots.every(p => Number(p.dataset.rendered) >= rev)) return resolve(performance.now() - t0);
      if (performance.now() - t0 > 60000) return reject(new Error('Step did not finish within 60 s'));
      requestAnimationFrame(check);
    };
    requestAnimationFrame(check);
  });
}"""
# the expert ids the top-k table's view wrote into its cells (plotly_view: cell labels), against what plotly's
# own texttemplate writes for the same figure in a scratch div: text, colour and position of every label
TOPK_CELLS = """async () => {
  const el = document.querySelector(".kimi-plot[data-name='moe_topk']"), gd = el.querySelector('.js-plotly-plot');
  const key = (t) => [t.textContent, getComputedStyle(t).fill, Math.round(+t.getAttribute('x')),
                      Math.round(+t.getAttribute('y'))].join('|');
  const ours = [...el.querySelectorAll('g.kimi-cells text')].map(key);
  const scratch = document.createElement('div');
  scratch.style.cssText = `position:absolute;left:-5000px;width:${gd.offsetWidth}px;height:${gd.offsetHeight}px`;
  document.body.appendChild(scratch);
  const data = gd.data.map((t, i) => (i === 0 ? { ...t, texttemplate: '%{text}', textfont: { size: 10 } } : t));
  await Plotly.newPlot(scratch, data, gd.layout, { displayModeBar: false });
  const plotly = [...scratch.querySelectorAll('g.heatmap-label text')].map(key);
  Plotly.purge(scratch); scratch.remove();
  return { ours: ours.length, plotly: plotly.length, same: ours.join() === plotly.join(),
           white: ours.filter(k => k.split('|')[1] === 'rgb(255, 255, 255)').length };
}"""
# what each visible view says it shows: {name: layout.meta}
VISIBLE_META = """() => Object.fromEntries([...document.querySelectorAll('.kimi-plot')]
  .filter(e => e.offsetParent !== null && e.dataset.rendered)
  .map(e => [e.dataset.name, (e.querySelector('.js-plotly-plot') || {}).layout?.meta || null]))"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(root: Path, home: Path) -> tuple[subprocess.Popen, str, Path]:
    """JupyterLab serving `root`, with every Jupyter/IPython directory under `home`."""
    port = free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), IPYTHONDIR=str(home / "ipython"), JUPYTER_PLATFORM_DIRS="1")
    labconfig = home / "config" / "labconfig"  # no announcement toast over the notebook, nothing reaching out
    labconfig.mkdir(parents=True)
    (labconfig / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    log = home / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", "--IdentityProvider.token=", "--ServerApp.password=",
           f"--ServerApp.root_dir={root}", "--LabApp.news_url=", "--LabApp.expose_app_in_browser=True",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.extension_manager=readonly"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # CI containers run as root; the server only listens on 127.0.0.1
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {proc.returncode}; log:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                if r.status == 200:
                    return proc, url, log
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"JupyterLab did not answer on {url} within 90 s; log:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def write_notebook(path: Path, checkpoint: str) -> None:
    """A notebook that feeds HISTORY tokens, then opens the Explorer on `checkpoint` ('' = the embedded
    model) and Steps four times: the timed Steps run at a 300-token history."""
    load = f"ke.from_pretrained({checkpoint!r})" if checkpoint else \
        "ke.from_pretrained(ke.tiny_checkpoint())"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"import kimi_explore as ke\nweights = {load}\n"
                                          "session = ke.Session(weights, tokenizer=ke.load_tokenizer(weights.source))\n"
                                          f"history = session.tokenizer.encode({HISTORY_TEXT!r})[:{HISTORY}]\n"
                                          f"assert len(history) == {HISTORY}\n"
                                          "session.feed(history)"),
                nbformat.v4.new_code_cell(f"explorer = ke.Explorer(session, prompt=session.tokenizer.decode(history) + "
                                          f"{PROMPT!r})\n"
                                          "for _ in range(4):\n    explorer.step()\nexplorer")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def hover_text(page, view: str, fx: float = 0.5, fy: float = 0.5, subplot: str = "xy") -> str:
    """Move the mouse over a point of a view's plot area and return its tooltip's text."""
    drag = page.locator(f".kimi-plot[data-name='{view}'] .nsewdrag[data-subplot='{subplot}']").first
    box = drag.bounding_box()
    page.mouse.move(box["x"] + 1, box["y"] + 1)
    page.mouse.move(box["x"] + fx * box["width"], box["y"] + fy * box["height"], steps=4)
    tip = page.locator(f".kimi-plot[data-name='{view}'] .hoverlayer .hovertext").first
    tip.wait_for(state="attached", timeout=10_000)
    return tip.text_content()


PREDICTIONS = ".kimi-plot[data-name='predictions']"
COUNT_REDRAWS = f"""() => {{ const gd = document.querySelector("{PREDICTIONS} .js-plotly-plot");
  window.__redraws = 0; gd.on('plotly_afterplot', () => window.__redraws++); return gd.layout.meta; }}"""
SHOWN = f"""() => ({{ meta: document.querySelector("{PREDICTIONS} .js-plotly-plot").layout.meta,
  rendered: Number(document.querySelector("{PREDICTIONS}").dataset.rendered), redraws: window.__redraws }})"""


def unchanged_then_changed(page) -> dict:
    """On the Predictions tab: pick another layer (the predictions do not depend on it), then Step; what
    the view says it shows and how often plotly redrew it after each."""
    before = page.evaluate(COUNT_REDRAWS)
    menu = page.locator(".widget-dropdown", has_text="layer").locator("select").first
    other = next(o for o in menu.locator("option").all_text_contents() if int(o.split()[0]) != before["layer"])
    menu.select_option(label=other)
    page.wait_for_function(f"() => document.querySelector(\"{PREDICTIONS} .js-plotly-plot\").layout.meta.layer"
                           f" === {int(other.split()[0])}", timeout=30_000)
    page.wait_for_function(SETTLED, timeout=30_000)
    after_layer = page.evaluate(SHOWN)
    page.evaluate(TIMED_STEP)
    return {"before": before, "after_layer": after_layer, "after_step": page.evaluate(SHOWN)}


def open_tab(page, title: str) -> None:
    page.locator(".widget-tab .lm-TabBar-tab", has_text=title).first.click()
    page.wait_for_function(SETTLED, timeout=60_000)


def drive(page, url: str, name: str, shot, seen: dict) -> None:
    """The whole scenario on one notebook; records into seen[name]."""
    out = seen.setdefault(name, {"latency_ms": {}})
    # a workspace of its own, reset: only this notebook is open (no tab restored from the last one)
    page.goto(f"{url}/lab/workspaces/{name}/tree/{name}.ipynb?reset", wait_until="domcontentloaded")
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    page.wait_for_function("(path) => window.jupyterapp?.shell.currentWidget?.context?.path === path",
                           arg=f"{name}.ipynb", timeout=90_000)
    page.wait_for_function(KERNEL_IDLE, timeout=90_000)
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    page.wait_for_selector(".kimi-done", state="attached", timeout=180_000)
    page.wait_for_function(KERNEL_IDLE, timeout=180_000)
    page.wait_for_function(SETTLED, timeout=60_000)
    page.locator(".widget-button", has_text="Step").first.scroll_into_view_if_needed()
    # the Explorer's top at the top of the viewport: what a user sees after scrolling to it
    page.evaluate("() => document.querySelector('.kimi-text').closest('.widget-vbox').scrollIntoView()")
    out["status_start"] = page.locator(".kimi-status").first.text_content()
    shot(f"{name}_block_residuals")
    for title in TABS:
        open_tab(page, title)
        times = [page.evaluate(TIMED_STEP) for _ in range(3)]
        out["latency_ms"][title] = times
        shot(f"{name}_{title.split()[0].lower()}")
    out["status_after_steps"] = page.locator(".kimi-status").first.text_content()

    # the new views: the selected token's lens and attribution, an expert search, an ablation's run diff
    open_tab(page, "Lens & attribution")
    if name == "embedded":  # at K3 depth the replay takes a minute on a CI machine: its message is checked
        page.locator(".widget-button", has_text="Compute").first.click()
        page.wait_for_function("() => (document.querySelector(\".kimi-plot[data-name='lens'] .gtitle\") || {})"
                               ".textContent?.startsWith('Logit lens')", timeout=120_000)
        page.wait_for_function(SETTLED, timeout=60_000)
    out["lens_title"] = page.locator(".kimi-plot[data-name='lens'] .gtitle, .kimi-plot[data-name='lens'] .annotation-text") \
        .first.text_content()
    shot(f"{name}_lens_attribution")
    open_tab(page, "MoE routing")
    page.locator(".widget-text", has_text="find expert").locator("input").fill("3")
    page.wait_for_function("() => { const e = document.querySelector(\".kimi-plot[data-name='expert_search']\");"
                           " return e && e.offsetParent !== null && e.dataset.rendered; }", timeout=60_000)
    page.wait_for_function(SETTLED, timeout=60_000)
    page.locator(".kimi-plot[data-name='expert_search']").scroll_into_view_if_needed()
    out["expert_search_title"] = page.locator(".kimi-plot[data-name='expert_search'] .gtitle").first.text_content()
    shot(f"{name}_expert_search")
    page.evaluate("() => document.querySelector('.kimi-text').closest('.widget-vbox').scrollIntoView()")
    open_tab(page, "Predictions")
    page.locator(".widget-dropdown select").filter(has=page.locator("option", has_text="from this token on")).first \
        .select_option("from this token on")
    page.locator(".widget-button", has_text="Ablate & compare").first.click()
    page.wait_for_function("() => { const e = document.querySelector(\".kimi-plot[data-name='ablation_diff']\");"
                           " return e && e.dataset.rendered; }", timeout=120_000)
    page.locator(".kimi-plot[data-name='ablation_diff']").scroll_into_view_if_needed()
    out["ablation_note"] = page.locator(".kimi-plot[data-name='ablation']").locator("xpath=..").first.text_content()
    shot(f"{name}_ablation_diff")
    page.evaluate("() => document.querySelector('.kimi-text').closest('.widget-vbox').scrollIntoView()")

    open_tab(page, "MoE routing")
    out["topk_cells"] = page.evaluate(TOPK_CELLS)
    out["topk_tooltip"] = hover_text(page, "moe_topk", 0.3, 0.3)
    shot(f"{name}_moe_topk_hover")
    page.locator(".widget-checkbox", has_text="full layer x expert map").locator("input").check()
    page.wait_for_function(SETTLED, timeout=60_000)
    page.locator(".kimi-plot[data-name='moe_full']").scroll_into_view_if_needed()
    out["full_map_tooltip"] = hover_text(page, "moe_full", 0.4, 0.4)
    shot(f"{name}_moe_full_map_hover")
    page.evaluate("() => document.querySelector('.kimi-text').closest('.widget-vbox').scrollIntoView()")

    # a click on a token in the text selects it in every view
    open_tab(page, "Block residuals")
    page.locator(".kimi-text .kimi-token[data-t='2']").click()
    page.wait_for_function("() => document.querySelector('.kimi-token.kimi-selected')?.dataset.t === '2'")
    page.wait_for_function(f"() => Object.values(({VISIBLE_META})()).every(m => m && m.token === 2)", timeout=30_000)
    page.wait_for_function(SETTLED, timeout=30_000)
    out["after_token_click"] = page.evaluate(VISIBLE_META)
    out["token_label"] = page.locator(".widget-html code").first.text_content()
    shot(f"{name}_token_clicked")
    # a click on a layer column of the per-token map selects that layer in every view
    before = out["after_token_click"]["block_token"]["layer"]
    drag = page.locator(".kimi-plot[data-name='block_token'] .nsewdrag[data-subplot='x2y2']").first.bounding_box()
    page.mouse.move(drag["x"] + drag["width"] * 0.1, drag["y"] + drag["height"] * 0.9, steps=4)  # 'current' row
    page.mouse.down()
    page.mouse.up()
    page.wait_for_function(f"() => {{ const m = Object.values(({VISIBLE_META})()); "
                           f"return m.length && m.every(x => x && x.layer !== {before} && x.layer === m[0].layer); }}",
                           timeout=30_000)
    page.wait_for_function(SETTLED, timeout=30_000)
    out["after_layer_click"] = page.evaluate(VISIBLE_META)
    out["layer_dropdown"] = page.locator(".widget-dropdown", has_text="layer").locator("select").first.input_value()
    shot(f"{name}_layer_clicked")

    # a new layer leaves the predictions as they were: the view takes the new selection (meta) and the
    # revision without a redraw; a Step changes them: one redraw
    open_tab(page, "Predictions")
    out["unchanged_view"] = unchanged_then_changed(page)

    # a new prompt resets the history
    box = page.locator(".widget-text input").first
    box.fill("Quick brown fox")  # shares no token with the history: Step starts over
    page.wait_for_function("() => document.querySelector('.kimi-status')?.textContent.includes('new prompt')")
    out["status_new_prompt"] = page.locator(".kimi-status").first.text_content()
    page.evaluate(TIMED_STEP)
    out["status_after_new_prompt"] = page.locator(".kimi-status").first.text_content()
    out["text_after_new_prompt"] = page.locator(".kimi-text").first.text_content()
    shot(f"{name}_new_prompt")


def run(artifacts: Path) -> dict:
    """Write the K3-depth model, serve, drive both notebooks, stop; returns what it saw."""
    from playwright.sync_api import sync_playwright

    from kimi_explore.weights.k3_depth import write_k3_depth

    artifacts.mkdir(parents=True, exist_ok=True)
    for old in artifacts.glob("*.png"):
        old.unlink()
    seen: dict = {"screenshots": [], "page_errors": [], "requests_elsewhere": []}
    with tempfile.TemporaryDirectory(prefix="kimi-browser-") as tmp:
        tmp = Path(tmp)
        root = tmp / "notebooks"
        root.mkdir()
        k3 = tmp / "k3_depth_model"
        writer = threading.Thread(target=write_k3_depth, args=(k3,))  # while JupyterLab starts
        writer.start()
        write_notebook(root / "embedded.ipynb", "")
        write_notebook(root / "k3_depth.ipynb", str(k3))
        proc, url, log = start_lab(root, tmp / "home")
        writer.join()
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport=VIEWPORT)
                page.set_default_timeout(60_000)
                page.on("pageerror", lambda e: seen["page_errors"].append(str(e)))
                page.on("request", lambda r: None if r.url.startswith(("http://127.0.0.1", "data:", "blob:", "ws://127.0.0.1"))
                        else seen["requests_elsewhere"].append(r.url))

                def shot(name: str) -> None:
                    path = artifacts / f"{len(seen['screenshots']):02d}_{name}.png"
                    page.screenshot(path=str(path))
                    seen["screenshots"].append(str(path))

                try:
                    for name in ("embedded", "k3_depth"):
                        drive(page, url, name, shot, seen)
                except Exception:  # noqa: BLE001 - keep a picture of the failure, then re-raise it
                    page.screenshot(path=str(artifacts / "failure.png"))
                    raise
                finally:
                    browser.close()
        finally:
            stop(proc)
            seen["lab_log_tail"] = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    return seen


def latency_table(seen: dict) -> str:
    rows = ["model      tab               Step -> views redrawn, ms (median / max of 3)"]
    for model in ("embedded", "k3_depth"):
        for tab, ms in seen.get(model, {}).get("latency_ms", {}).items():
            rows.append(f"{model:<10} {tab:<17} {statistics.median(ms):7.0f} / {max(ms):.0f}")
    return "\n".join(rows)


if __name__ == "__main__":
    out = run(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "artifacts" / "browser")
    print(json.dumps({k: v for k, v in out.items() if k != "lab_log_tail"}, indent=1))
    print(latency_table(out))
