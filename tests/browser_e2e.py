"""End to end in a real browser: JupyterLab on 127.0.0.1 + headless Chromium driven by Playwright.

    python tests/browser_e2e.py [ARTIFACTS_DIR]      # standalone; pytest runs it from test_browser.py

Copies the notebooks to a temporary root, serves them with JupyterLab (random free port, empty token,
isolated Jupyter config/data/runtime dirs, no news or update checks), opens 01_tour.ipynb, runs all
cells, clicks the Explorer's Step button twice and checks that the block-residual view changed each
time. Screenshots (whole page and the view itself) go to ARTIFACTS_DIR (default artifacts/browser/).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
NOTEBOOK = "01_tour.ipynb"
KERNEL_READY = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.connectionStatus === 'connected' && k.status === 'idle';
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(root: Path, home: Path) -> tuple[subprocess.Popen, str, Path]:
    """JupyterLab serving `root`, with every Jupyter/IPython directory under `home`."""
    port = free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), IPYTHONDIR=str(home / "ipython"), JUPYTER_PLATFORM_DIRS="1")
    # No announcement/news toast over the notebook, and nothing that would reach for the network.
    labconfig = home / "config" / "labconfig"
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


ALL_RUN = """() => {
  // textContent, not innerText: JupyterLab skips laying out cells off screen, whose innerText is ''
  const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent);
  return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p));
}"""
VIEW = ".widget-tab .widget-image"  # the Explorer's Block residuals tab, first figure (per-token view)


def drive(page, url: str, shot, seen: dict) -> None:
    """Open the tour, run all cells, press Step twice; record the view after each stage."""
    page.goto(f"{url}/lab/tree/{NOTEBOOK}", wait_until="domcontentloaded")
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    page.wait_for_function(KERNEL_READY, timeout=90_000)  # connected and idle
    shot("opened")
    # Run > Run All Cells, through the command the menu item runs. Not awaited: `evaluate` has no
    # timeout, and the command's promise need not settle when the cells are done.
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    page.wait_for_function(ALL_RUN, timeout=120_000)
    page.wait_for_function(KERNEL_READY, timeout=120_000)
    step = page.locator(".widget-button", has_text="Step").first
    view = page.locator(VIEW).first
    status = page.locator(".widget-html", has_text="tokens decoded").first
    page.wait_for_function(f"() => {{ const i = document.querySelector('{VIEW}'); return i && i.naturalWidth > 0 }}")
    step.scroll_into_view_if_needed()
    seen["status"].append(status.inner_text())
    seen["view_sha256"].append(hashlib.sha256(view.screenshot()).hexdigest())
    shot("after_run_all")
    shot("block_residual_view_0", view)
    n0 = int(seen["status"][0].split()[0])
    for k in (1, 2):
        before = view.get_attribute("src")
        step.click()
        page.wait_for_function(f"""(old) => {{ const i = document.querySelector('{VIEW}');
                                    return i && i.src !== old && i.complete && i.naturalWidth > 0 }}""", arg=before)
        page.wait_for_function("(n) => [...document.querySelectorAll('.widget-html')]"
                               ".some(e => e.innerText.startsWith(n + ' tokens decoded'))", arg=str(n0 + k))
        seen["status"].append(status.inner_text())
        seen["view_sha256"].append(hashlib.sha256(view.screenshot()).hexdigest())
        shot(f"after_step_{k}")
        shot(f"block_residual_view_{k}", view)
    # the other tabs, as a user would open them (drawn on demand in the kernel)
    explorer = page.locator(".widget-tab").first
    for title in ("KDA state", "MoE routing", "Predictions"):
        page.locator(".widget-tab .lm-TabBar-tab", has_text=title).first.click()
        img = page.locator(".widget-tab .widget-image:visible").first  # the other tabs' images are hidden now
        img.wait_for(state="visible")
        page.wait_for_function(KERNEL_READY)  # idle again: every picture of this tab has been sent
        page.wait_for_function("() => [...document.querySelectorAll('.widget-tab .widget-image')]"
                               ".filter(i => i.offsetParent !== null).every(i => i.complete && i.naturalWidth > 0)")
        shot(f"tab_{title.split()[0].lower()}", explorer)


def run(artifacts: Path) -> dict:
    """Serve, drive, stop; returns what it saw (hashes of the view, status lines, screenshot paths)."""
    from playwright.sync_api import sync_playwright

    artifacts.mkdir(parents=True, exist_ok=True)
    for old in artifacts.glob("*.png"):
        old.unlink()
    seen: dict = {"screenshots": [], "view_sha256": [], "status": [], "page_errors": []}
    with tempfile.TemporaryDirectory(prefix="kimi-browser-") as tmp:
        tmp = Path(tmp)
        root = tmp / "notebooks"
        shutil.copytree(ROOT / "notebooks", root)
        proc, url, log = start_lab(root, tmp / "home")
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1500, "height": 1100})
                page.set_default_timeout(60_000)
                page.on("pageerror", lambda e: seen["page_errors"].append(str(e)))

                def shot(name: str, locator=None) -> None:
                    path = artifacts / f"{len(seen['screenshots']):02d}_{name}.png"
                    (locator or page).screenshot(path=str(path))
                    seen["screenshots"].append(str(path))

                try:
                    drive(page, url, shot, seen)
                except Exception:  # noqa: BLE001 - keep a picture of the failure, then re-raise it
                    page.screenshot(path=str(artifacts / "failure.png"))
                    raise
                finally:
                    browser.close()
        finally:
            stop(proc)
            seen["lab_log_tail"] = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    return seen


if __name__ == "__main__":
    out = run(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "artifacts" / "browser")
    print(json.dumps({k: v for k, v in out.items() if k != "lab_log_tail"}, indent=1))
