"""TokenText: the decoded text, token by token, each coloured by a measure and clickable (an anywidget).

    text = TokenText()
    text.set_tokens(labels, colors, titles)    # one entry per token: shown text, CSS colour, hover title
    text.observe(fn, names="selected")         # a click on token t sets `selected = t`

The strip has a fixed height and scrolls inside itself (never the page) to keep the selected token
in view. Generated tokens are underlined (dotted): `generated_runs`, [[a, b), ...] (a history can hold
generated tokens, then text fed from elsewhere, then generated ones again); `generated_from` is the
first generated token (-1: none).
"""

from __future__ import annotations

import anywidget
import numpy as np
import traitlets

__all__ = ["TokenText", "measure_colors"]

ESM = """
export default {
  render({ model, el }) {
    el.classList.add("kimi-text");
    const box = document.createElement("div");
    box.style.cssText = "height:58px;overflow-y:auto;border:1px solid #ddd;border-radius:4px;padding:3px 4px;" +
      "font:13px/1.9 ui-monospace,SFMono-Regular,Menlo,monospace;white-space:pre-wrap;word-break:break-all;background:#fff";
    el.appendChild(box);
    const style = (t, colors, sel, gen) => "cursor:pointer;border-radius:2px;padding:1px 0;background:" +
      (colors[t] || "transparent") + (t === sel ? ";outline:2px solid #d62728;outline-offset:0" : "") +
      (gen[t] ? ";text-decoration:underline dotted" : "");
    const flags = (runs, n) => {  // [[a, b), ...] -> one 0/1 per token
      const g = new Uint8Array(n);
      for (const [a, b] of runs || []) g.fill(1, Math.max(0, a), Math.min(b, n));
      return g;
    };
    // One draw per frame, however many traits a Step changed; a history that only grew keeps its spans
    // and gets the new ones appended. A kept span is written only where its title, colour, selection or
    // underline changed: rewriting every span's style each Step made the page restyle the whole strip.
    let queued = false, drawn = { titles: [], colors: [], sel: -1, gen: new Uint8Array(0) };
    const draw = () => {
      queued = false;
      const labels = model.get("labels"), colors = model.get("colors"), titles = model.get("titles");
      const sel = model.get("selected"), gen = flags(model.get("generated_runs"), labels.length);
      const spans = box.children;
      let keep = 0;
      while (keep < spans.length && keep < labels.length && spans[keep].textContent === labels[keep]) keep++;
      while (spans.length > keep) box.removeChild(box.lastChild);
      const was = drawn;
      for (let t = 0; t < labels.length; t++) {
        let s = spans[t];
        const fresh = t >= keep;
        if (fresh) {
          s = document.createElement("span");
          s.textContent = labels[t];
          s.dataset.t = String(t);
          box.appendChild(s);
        }
        if (fresh || titles[t] !== was.titles[t]) s.title = titles[t] || "";
        if (fresh || colors[t] !== was.colors[t] || (t === sel) !== (t === was.sel) || gen[t] !== (was.gen[t] || 0)) {
          s.className = "kimi-token" + (t === sel ? " kimi-selected" : "");
          s.style.cssText = style(t, colors, sel, gen);
        }
      }
      drawn = { titles, colors, sel, gen };
      const cur = box.querySelector(".kimi-selected");
      if (cur) {  // scroll the strip only (scrollIntoView would move the page too)
        const top = cur.offsetTop - box.offsetTop;
        if (top < box.scrollTop || top + cur.offsetHeight > box.scrollTop + box.clientHeight)
          box.scrollTop = Math.max(0, top - box.clientHeight / 2);
      }
    };
    const schedule = () => { if (!queued) { queued = true; requestAnimationFrame(draw); } };
    box.addEventListener("click", (ev) => {
      const t = ev.target && ev.target.dataset ? ev.target.dataset.t : undefined;
      if (t === undefined) return;
      model.set("selected", Number(t));
      model.save_changes();
    });
    model.on("change:labels change:colors change:titles change:selected change:generated_runs", schedule);
    draw();
  },
};
"""


class TokenText(anywidget.AnyWidget):
    """Clickable, coloured tokens (see module docstring)."""

    _esm = ESM
    # untyped lists: set_tokens builds them from str; per-element validation would cost O(T) per Step
    labels = traitlets.List().tag(sync=True)
    colors = traitlets.List().tag(sync=True)
    titles = traitlets.List().tag(sync=True)
    selected = traitlets.Int(-1).tag(sync=True)
    generated_runs = traitlets.List().tag(sync=True)  # [[a, b), ...] generated tokens, underlined
    generated_from = traitlets.Int(-1).tag(sync=True)  # first generated token (-1: none)

    def set_tokens(self, labels: list[str], colors: list[str], titles: list[str], generated_from: int = -1,
                   generated_runs: list | None = None) -> None:
        """generated_runs: [[a, b), ...] of generated tokens; or generated_from: every token from it on."""
        if not len(labels) == len(colors) == len(titles):
            raise ValueError(f"TokenText: {len(labels)} labels, {len(colors)} colours, {len(titles)} titles")
        if generated_runs is None:
            generated_runs = [[int(generated_from), len(labels)]] if 0 <= generated_from < len(labels) else []
        runs = [[int(a), int(b)] for a, b in generated_runs if a < b]
        with self.hold_sync():
            self.labels, self.colors, self.titles = [str(x) for x in labels], [str(x) for x in colors], \
                [str(x) for x in titles]
            self.generated_runs = runs
            self.generated_from = runs[0][0] if runs else -1


def measure_colors(values: np.ndarray) -> tuple[list[str], float, float]:
    """Light-to-dark blue backgrounds for values (NaN: none), scaled to their finite range."""
    v = np.asarray(values, dtype=float)
    ok = np.isfinite(v)
    lo, hi = (float(v[ok].min()), float(v[ok].max())) if ok.any() else (0.0, 1.0)
    x = np.clip(np.nan_to_num((v - lo) / ((hi - lo) or 1.0)), 0, 1)
    level = np.where(ok, np.floor(x * (len(_PALETTE) - 2) + 0.5).astype(np.int64), len(_PALETTE) - 1)
    return _PALETTE[level].tolist(), lo, hi


# from #f4f8ff to #6fa8ff in 256 steps (dark enough to see, light enough for black text); last: no value
_PALETTE = np.array([f"rgb({int(244 - 133 * s)},{int(248 - 80 * s)},255)" for s in np.linspace(0, 1, 256)]
                    + ["transparent"], dtype=object)
