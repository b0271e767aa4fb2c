"""Interactive figures in a notebook: plotly.js driven by small anywidgets, updated in place.

    view = PlotView(height=320)
    view.show(data, layout)             # browser: Plotly.react on the same div (a diff, not a new plot)
    view.on_click(fn)                   # fn({"curve": 0, "x": .., "y": .., "index": ..}) on a click

Why not plotly's own `FigureWidget`: in plotly >= 6 it is an anywidget too, but every instance ships
the whole 5 MB bundle as its module source, and every 2-D array goes through plotly.py's validators
and out as a JSON list of lists (~25 ms of Python for one 92 x 896 map, before the wire). Here one
hidden `PlotlyJS` widget per kernel carries `plotly.min.js` from the installed `plotly` wheel (no
CDN, no network: it is injected as a script once per page), each view is a ~60-line module, and
arrays travel as plotly.js typed-array specs (`typed`: dtype + base64 bytes + shape; NaN stays a gap).

Each rendered view tags its element `kimi-plot` and sets `data-rendered` to the `rev` of the refresh
it last showed: a browser test waits on that to measure how long an update takes to reach the screen.
A refresh that leaves a figure as it was (e.g. a view that does not depend on the selected token)
re-sends only that revision and the `meta` (`shown`): no redraw.

Cell labels of a heatmap (`layout["cell_text"] = {"traces": [i, ...], "size": px}`): trace i's
`text` [rows][cols] is written at its cells' centres, white on a dark cell and #444 on a light one,
as plotly's `texttemplate="%{text}"` writes it (same position, font and contrast rule), but as one
SVG group set at once. plotly formats, templates and contrasts every cell one by one on every redraw:
~25 ms for the 24 x 16 MoE top-k table, most of that view's Step. The offline snapshot (`snapshot()`)
turns them back into plotly's own `texttemplate`.
"""

from __future__ import annotations

import base64
from pathlib import Path

import anywidget
import numpy as np
import traitlets

__all__ = ["PlotView", "PlotlyJS", "plotly_js_source", "typed"]

_READY = """
function plotlyReady() {  // one promise per page, resolved when the PlotlyJS widget injected the library
  if (!globalThis.__kimiPlotly) {
    let resolve;
    const promise = new Promise((r) => (resolve = r));
    globalThis.__kimiPlotly = { promise, resolve };
  }
  return globalThis.__kimiPlotly;
}
"""

LOADER_ESM = _READY + """
export default {
  render({ model }) {
    const ready = plotlyReady();
    if (!globalThis.Plotly) {  // a classic script: plotly.min.js is a UMD bundle that sets window.Plotly
      const s = document.createElement("script");
      s.textContent = model.get("source");
      document.head.appendChild(s);
    }
    ready.resolve(globalThis.Plotly);
  },
};
"""

VIEW_ESM = _READY + r"""
// no modebar: it sat over the titles; drag zooms or pans (per view), a double click resets
const CONFIG = { responsive: true, displaylogo: false, scrollZoom: false, displayModeBar: false };

function niceInt(span) {  // a whole tick step leaving ~8 ticks over `span`: 1, 2, 5, 10, 20, 50, ...
  const raw = Math.max(1, span / 8), p = 10 ** Math.floor(Math.log10(raw)), m = raw / p;
  return Math.max(1, (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p);
}

// heatmap cell labels (see the module docstring): one SVG group per trace inside its subplot's
// plot layer (clipped to the plot area, under shapes and hover labels), redrawn after each plot
const SVG_NS = "http://www.w3.org/2000/svg";
function rgbOf(c) {
  const m = /rgba?\(([^)]*)\)/.exec(c);
  if (m) return m[1].split(",").slice(0, 3).map(Number);
  let h = String(c).replace("#", "");
  if (h.length === 3) h = h.split("").map((x) => x + x).join("");
  return [0, 2, 4].map((i) => parseInt(h.slice(i, i + 2), 16));
}
// plotly's contrast (Color.contrast): white text where white contrasts more with the cell than the
// default line colour #444 does (WCAG contrast of relative luminances), else #444
const linear = (v) => ((v /= 255) <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4);
const luminance = ([r, g, b]) => 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b);
const wcag = (a, b) => (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
const GREY = luminance([68, 68, 68]);
const contrast = (rgb) => { const l = luminance(rgb); return wcag(l, 1) > wcag(l, GREY) ? "#ffffff" : "#444444"; };
function colourScale(tr) {  // z -> [r, g, b] on the trace's colour scale
  const stops = tr.colorscale.map(([p, c]) => [p, rgbOf(c)]), lo = tr.zmin, span = tr.zmax - tr.zmin || 1;
  return (z) => {
    let f = Math.min(1, Math.max(0, (z - lo) / span || 0));
    if (tr.reversescale) f = 1 - f;
    let i = 1;
    while (i < stops.length - 1 && stops[i][0] < f) i++;
    const [p0, c0] = stops[i - 1], [p1, c1] = stops[i], u = p1 > p0 ? (f - p0) / (p1 - p0) : 0;
    return [0, 1, 2].map((k) => Math.round(c0[k] + u * (c1[k] - c0[k])));
  };
}
const escapeText = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
function drawCells(div, cells) {
  for (const g of div.querySelectorAll("g.kimi-cells")) g.remove();
  const L = div._fullLayout;
  if (!cells || !L || !div.calcdata) return;
  for (const i of cells.traces || []) {
    const tr = div._fullData[i], cd = div.calcdata[i] && div.calcdata[i][0], text = div.data[i] && div.data[i].text;
    const plotinfo = tr && L._plots && L._plots[tr.xaxis + tr.yaxis];
    if (!cd || !text || !plotinfo || !plotinfo.plot) continue;
    const xa = L["xaxis" + tr.xaxis.slice(1)], ya = L["yaxis" + tr.yaxis.slice(1)], size = cells.size || 10;
    const bg = contrast(rgbOf(L.plot_bgcolor)), colourAt = colourScale(tr), parts = [];
    const centre = (c, k, axis) => axis.c2p(c.centre ? c.centre[k] : (c.edges[k] + c.edges[k + 1]) / 2);
    const xs = { centre: cd.xCenter, edges: cd.x }, ys = { centre: cd.yCenter, edges: cd.y };
    for (let j = 0; j < text.length; j++) {
      const py = Math.round(centre(ys, j, ya));
      if (!(py >= 0 && py <= ya._length) || !text[j]) continue;
      for (let k = 0; k < text[j].length; k++) {
        const t = text[j][k], px = Math.round(centre(xs, k, xa));
        if (t === "" || t == null || !(px >= 0 && px <= xa._length)) continue;
        const z = cd.z[j] && cd.z[j][k], fill = z === undefined || Number.isNaN(z) ? bg : contrast(colourAt(z));
        parts.push(`<text x="${px}" y="${py + 0.35 * size}" fill="${fill}">${escapeText(t)}</text>`);
      }
    }
    const g = document.createElementNS(SVG_NS, "g");
    g.setAttribute("class", "kimi-cells");
    g.setAttribute("text-anchor", "middle");
    g.setAttribute("pointer-events", "none");
    g.setAttribute("style", `font-family:${L.font.family};font-size:${size}px`);
    g.innerHTML = parts.join("");
    plotinfo.plot.node().appendChild(g);  // last in the plot layer: above the heatmap's image
  }
}

export default {
  async render({ model, el }) {
    el.classList.add("kimi-plot");
    const div = document.createElement("div");
    div.style.width = "100%";
    div.style.height = model.get("height") + "px";  // fixed: the page never grows with the data
    el.appendChild(div);
    const Plotly = await plotlyReady().promise;
    let queue = Promise.resolve(), listening = false;
    el.dataset.name = model.get("name");
    // Draw only into an attached, visible div: plotly sized against a detached one (anywidget renders
    // before the view is attached; hidden tabs have no width) never answers hovers. A spec that
    // arrives meanwhile waits until the ResizeObserver sees the div get a size.
    let pending = false;
    // axes of integer ids (experts): after a zoom or a redraw, ticks on whole numbers only
    const wholeTicks = (ev) => {
      const axes = (model.get("spec") || {}).int_axes || [], upd = {};
      for (const a of axes) {
        if (ev && !Object.keys(ev).some((key) => key.startsWith(a + ".range") || key === a + ".autorange")) continue;
        const r = div.layout[a] && div.layout[a].range;
        if (r) { upd[a + ".dtick"] = niceInt(Math.abs(r[1] - r[0])); upd[a + ".tick0"] = 0; }
      }
      return Object.keys(upd).length ? Plotly.relayout(div, upd) : null;
    };
    // the div's width as the ResizeObserver last saw it (0: hidden or detached): reading offsetWidth
    // here would force a layout of the whole page before every draw
    let width = 0;
    const visible = () => div.isConnected && width > 0;
    // `spec` is the figure, re-sent only when it changed; `shown` ({rev, meta}) comes with every refresh.
    // A refresh that leaves the figure as it is costs no redraw: only its meta and revision are updated.
    let drawnSpec = null;  // the figure last queued for drawing
    const shown = () => model.get("shown") || {};
    const draw = () => {
      if (!visible()) { pending = true; return; }
      pending = false;
      const spec = model.get("spec");
      if (!spec || !spec.data) {  // cleared: nothing drawn, nothing to wait for
        drawnSpec = null;
        queue = queue.then(() => { Plotly.purge(div); listening = false; delete el.dataset.rendered; });
        return;
      }
      if (spec === drawnSpec) {
        queue = queue.then(() => {
          const { rev, meta } = shown();
          if (div.layout) div.layout.meta = meta;
          if (div._fullLayout) div._fullLayout.meta = meta;
          el.dataset.rendered = String(rev ?? 0);
        });
        return;
      }
      drawnSpec = spec;
      queue = queue.then(() => Plotly.react(div, spec.data, { ...spec.layout, meta: shown().meta }, CONFIG))
        .then(() => wholeTicks(null)).then(() => {
        drawCells(div, spec.cell_text);
        el.dataset.rendered = String(shown().rev ?? 0);
        if (listening) return;
        listening = true;  // div.on exists once plotly drew into the div
        div.on("plotly_relayout", (ev) => {
          queue = queue.then(() => wholeTicks(ev)).then(() => drawCells(div, (model.get("spec") || {}).cell_text));
          if (!Object.keys(ev).some((key) => /axis\d*\.(range|autorange)/.test(key))) return;
          const ranges = {};  // the user's zoom / pan, for Python (an exported snapshot keeps it)
          for (const key of Object.keys(div.layout)) {
            const ax = div.layout[key];
            if (/^[xy]axis\d*$/.test(key) && ax && ax.range && !ax.fixedrange) ranges[key] = ax.range.slice();
          }
          model.set("ranges", ranges);
          model.save_changes();
        });
        div.on("plotly_click", (ev) => {
          const p = ev.points && ev.points[0];
          if (!p) return;
          const index = Array.isArray(p.pointIndex) ? p.pointIndex : (p.pointNumber ?? null);
          model.send({ event: "click", curve: p.curveNumber, x: p.x ?? null, y: p.y ?? null, index });
        });
      });
    };
    const resize = new ResizeObserver((entries) => {
      width = entries[entries.length - 1].contentRect.width;
      if (!visible()) return;
      // resizes queue behind draws: a relayout interleaved with a react leaves plotly deaf to hovers
      if (pending) draw();
      else if (el.dataset.rendered) {
        queue = queue.then(() => Plotly.Plots.resize(div)).then(() => drawCells(div, (model.get("spec") || {}).cell_text));
      }
    });
    resize.observe(div);
    model.on("change:spec change:shown", draw);  // both in one message: the second call finds the figure drawn
    model.on("change:height", () => { div.style.height = model.get("height") + "px"; });
    draw();
    return () => { resize.disconnect(); model.off("change:spec change:shown", draw); Plotly.purge(div); };
  },
};
"""


def nice_int(span: float) -> int:
    """`niceInt` of the view's script: a whole tick step leaving ~8 ticks over `span` (1, 2, 5, 10, 20, ...)."""
    raw = max(1.0, span / 8)
    p = 10 ** int(np.floor(np.log10(raw)))
    m = raw / p
    return int(max(1, (1 if m <= 1 else 2 if m <= 2 else 5 if m <= 5 else 10) * p))


def plotly_js_source() -> str:
    """plotly.js as shipped inside the installed `plotly` wheel (read once)."""
    global _SOURCE
    if _SOURCE is None:
        import plotly

        path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: the Explorer needs plotly.js from the plotly wheel "
                                    "(pip install 'plotly>=6')")
        _SOURCE = path.read_text(encoding="utf-8")
    return _SOURCE


_SOURCE: str | None = None


class PlotlyJS(anywidget.AnyWidget):
    """Hidden: carries plotly.js to the page once; `PlotlyJS.shared()` is the kernel's one instance."""

    _esm = LOADER_ESM
    source = traitlets.Unicode("").tag(sync=True)
    _shared: PlotlyJS | None = None

    @classmethod
    def shared(cls) -> PlotlyJS:
        if cls._shared is None:
            import ipywidgets

            cls._shared = cls(source=plotly_js_source(), layout=ipywidgets.Layout(display="none"))
        return cls._shared


class PlotView(anywidget.AnyWidget):
    """One plotly.js figure of fixed height; `show(data, layout)` redraws it in place."""

    _esm = VIEW_ESM
    spec = traitlets.Dict().tag(sync=True)  # the figure: data, layout, int_axes, cell_text (sent when it changed)
    shown = traitlets.Dict().tag(sync=True)  # {"rev", "meta"}: the refresh the figure belongs to and what it shows
    height = traitlets.Int(300).tag(sync=True)
    name = traitlets.Unicode("").tag(sync=True)  # `data-name` of the element (tests find views by it)
    ranges = traitlets.Dict().tag(sync=True)  # {axis: [lo, hi]} as the user zoomed or panned it (set by the browser)

    def __init__(self, height: int = 300, name: str = "", **kwargs):
        super().__init__(height=int(height), name=name, **kwargs)
        self._click_handlers: list = []
        self.on_msg(self._on_msg)

    def show(self, data: list, layout: dict, rev: int = 0, meta: dict | None = None) -> None:
        """New content. Only a changed figure is sent and redrawn (`layout.uirevision` keeps the user's
        zoom); a refresh that leaves it as it is sends only `shown` (rev, meta), and the browser updates
        the drawn figure's `layout.meta` and its revision without redrawing it.
        meta: what the view shows (e.g. the selected token and layer), readable in the browser as
        the plot's `layout.meta`."""
        # min_height: what the figure needs to stay readable (e.g. a label per row); the view grows to it, once
        # per model (it depends on the model's shape, not on the history): the page does not jump at each Step
        layout = dict(layout)
        self.height = max(self.height, int(layout.pop("min_height", 0)))
        layout = {"height": self.height, "margin": {"l": 60, "r": 20, "t": 36, "b": 40}, **layout}
        int_axes = layout.pop("int_axes", [])  # axes of whole ids: the browser keeps their ticks whole when zoomed
        cell_text = layout.pop("cell_text", None)  # heatmap cell labels the view writes itself (module docstring)
        spec = {"data": data, "layout": layout, "int_axes": list(int_axes), **({"cell_text": cell_text} if cell_text else {})}
        changed = spec != self.spec
        with self.hold_sync():  # one message: the figure (when it changed) and what it shows
            if changed and "uirevision" not in layout:
                self.ranges = {}  # the browser redraws this view at the spec's own ranges: a zoom is gone
            if changed:
                self.spec = spec
            self.shown = {"rev": int(rev), "meta": meta}

    def clear(self) -> None:
        with self.hold_sync():
            self.spec, self.shown = {}, {}

    @property
    def meta(self) -> dict | None:
        """What the view says it shows (its `layout.meta` in the browser); None when empty."""
        return self.shown.get("meta") if self.spec else None

    @property
    def rev(self) -> int | None:
        """The revision of the refresh the view belongs to; None when empty."""
        return self.shown.get("rev") if self.spec else None

    def snapshot(self) -> dict | None:
        """The spec as shown now: its layout with the user's zoom (`ranges`) applied; None when empty."""
        if not self.spec:
            return None
        layout = dict(self.spec["layout"])
        if self.meta is not None:
            layout["meta"] = self.meta
        for axis, rng in self.ranges.items():
            layout[axis] = {**layout.get(axis, {}), "range": list(rng), "autorange": False}
            if axis in self.spec.get("int_axes", ()):  # whole ids only, as the view ticks them when zoomed
                layout[axis].update(dtick=nice_int(abs(rng[1] - rng[0])), tick0=0)
        data = list(self.spec["data"])
        cells = self.spec.get("cell_text")
        for i in cells["traces"] if cells else ():  # a page without this view's code: plotly writes the labels
            data[i] = {**data[i], "texttemplate": "%{text}", "textfont": {**data[i].get("textfont", {}), "size": cells["size"]}}
        return {"data": data, "layout": layout}

    def on_click(self, fn) -> None:
        """fn(point) on a click; point = {"curve", "x", "y", "index"} (index: [row, col] on heatmaps)."""
        self._click_handlers.append(fn)

    def _on_msg(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("event") == "click":
            for fn in self._click_handlers:
                fn(content)


_DTYPES = {np.dtype(np.float32): "f4", np.dtype(np.float64): "f8", np.dtype(np.int32): "i4", np.dtype(np.int16): "i2",
           np.dtype(np.uint8): "u1", np.dtype(np.int8): "i1", np.dtype(np.uint16): "u2", np.dtype(np.uint32): "u4"}


def typed(a, dtype=np.float32) -> dict:
    """A host array as plotly.js's typed-array spec {dtype, bdata, shape} (1-3 axes; NaN kept)."""
    a = np.ascontiguousarray(np.asarray(a, dtype=dtype))
    if not 1 <= a.ndim <= 3:
        raise ValueError(f"typed: plotly.js reads 1-3 axes, got shape {a.shape}")
    return {"dtype": _DTYPES[a.dtype], "bdata": base64.b64encode(a.tobytes()).decode("ascii"),
            "shape": ",".join(str(n) for n in a.shape)}
