"""The Explorer's tabs: which interactive figures each shows, and how they are refreshed.

`Tabs(explorer)` builds the views once; `refresh(tab, t, layer)` recomputes that tab's figures for
the selected token and layer and sends them (each view redraws in place, Plotly.react). A view
reads only the window of the history it shows (`explorer.trace(window=...)`: the selected token,
or the `specs.WINDOW` tokens around it), and the two numbers that depend on every token (the text's
measures, the expert counts) grow token by token (`history.HistoryCache`): a Step costs the same
at any history length. Clicks on a view select a token or a layer: the label under the pointer
starts with its id ("12 MLA", "3 'a'").
"""

from __future__ import annotations

import ipywidgets as widgets

from .. import summaries
from . import specs, specs_analysis, specs_moe
from .history import token_window, window_routing
from .plotly_view import PlotView

TABS = ("Block residuals", "KDA state", "MoE routing", "Predictions", "Lens & attribution")

# view name -> (tab, height px, width, what a click selects and from which coordinate)
VIEWS = {
    "block_token": (0, 300, "100%", ("layer", "x")),
    "block_layer": (0, 270, "100%", ("token", "x")),
    "kda_token": (1, 300, "100%", ("layer", "x")),
    "kda_layer": (1, 270, "100%", ("token", "x")),
    "moe_topk": (2, 360, "100%", ("layer", "y")),
    "moe_layers": (2, 330, "55%", ("layer", "x")),
    "moe_sorted": (2, 330, "45%", ("layer", "y")),
    "moe_top": (2, 330, "40%", ("layer", "y")),
    "expert_search": (2, 300, "100%", ("token", "x")),
    "moe_full": (2, 420, "100%", ("layer", "y")),
    "predictions": (3, 340, "42%", None),
    "lens": (4, 170, "100%", ("layer", "x")),
    "attribution": (4, 430, "100%", ("layer", "y")),
}


def first_int(label) -> int:
    """The id a category label starts with: '12 MLA' -> 12, "3 'a'" -> 3; an attribution leaf's layer:
    'layers.12.moe.experts.3' -> 12."""
    layer = specs_analysis.leaf_layer(label)
    return layer if layer is not None else int(str(label).split()[0])


class Tabs:
    """The tab widget, its figures, and the per-history numbers behind them."""

    def __init__(self, ex):
        self.ex = ex
        self.views = {name: PlotView(height=h, name=name, layout=widgets.Layout(width=w))
                      for name, (_, h, w, _) in VIEWS.items()}
        for name, (_, _, _, sel) in VIEWS.items():
            if sel is not None:
                self.views[name].on_click(lambda p, sel=sel: ex._busy(lambda: self._clicked(p, *sel), "Selecting"))
        self.full_map = widgets.Checkbox(value=False, description="full layer x expert map (zoomable)", indent=False)
        self.full_map.observe(ex.shown(self._full_map_toggled, "Showing the full map"), names="value")
        self.views["moe_full"].layout.display = "none"
        self.expert = widgets.Text(value="", description="find expert", placeholder="an id, e.g. 835",
                                   layout=widgets.Layout(width="260px"), style={"description_width": "80px"})
        self.expert.observe(ex.shown(self._expert_changed, "Finding the expert"), names="value")
        self.expert_note = widgets.HTML()
        self.views["expert_search"].layout.display = "none"
        self.compute_button = widgets.Button(description="Compute", icon="calculator", button_style="info",
                                             tooltip="the logit lens and the attribution of the selected token")
        self.compute_button.on_click(lambda _: self.ex._busy(self.compute_analyses, "Compute",
                                                             lambda m: self.views["lens"].show(*specs.empty(m))))
        self.auto_analyses = widgets.Checkbox(value=False, indent=False, layout=widgets.Layout(width="auto"),
                                              description="compute on every selection (a replay from the latest "
                                                          "checkpoint: seconds at K3 depth)")
        self.auto_analyses.observe(ex.shown(lambda: (self.drawn.pop(4, None), self.ex.refresh()), "Computing the analyses"),
                                   names="value")
        v = self.views
        self.widget = widgets.Tab(children=[
            widgets.VBox([v["block_token"], v["block_layer"]]),
            widgets.VBox([v["kda_token"], v["kda_layer"]]),
            widgets.VBox([v["moe_topk"], widgets.HBox([v["moe_layers"], v["moe_sorted"]]),
                          widgets.HBox([v["moe_top"], widgets.VBox([widgets.HBox([self.expert, self.expert_note]),
                                                                    v["expert_search"]],
                                                                   layout=widgets.Layout(width="60%"))]),
                          self.full_map, v["moe_full"]]),
            widgets.VBox([widgets.HBox([v["predictions"], ex.ablation_box]), ex.ablation.diff_view]),
            widgets.VBox([widgets.HBox([self.compute_button, self.auto_analyses]), v["lens"], v["attribution"]]),
        ], titles=TABS)
        self.drawn: dict[int, tuple] = {}  # tab -> what its views show now (history length, token, layer, ...)
        self.rev = 0  # revision counter: every refresh that sends figures takes the next one
        self.tab_rev: dict[int, int] = {}  # tab -> the revision its views were last sent with

    def _clicked(self, point: dict, what: str, coord: str) -> None:
        try:
            value = first_int(point.get(coord))
        except (TypeError, ValueError):
            value = None  # something without an id (the final-mix column)
        if what == "token" and value is not None and 0 <= value < len(self.ex.session):
            self.ex.select(token=value)
        elif what == "layer" and value in self.ex.session.weights.layer_ids:
            self.ex.select(layer=value)
        else:  # no id, or a token gone since the view was drawn (a truncate in another cell): a change made elsewhere shows
            self.ex.sync()

    def _full_map_toggled(self) -> None:
        self.views["moe_full"].layout.display = None if self.full_map.value else "none"
        self.drawn.pop(2, None)
        if self.widget.selected_index == 2:
            self.ex.refresh()

    @property
    def titles(self) -> tuple[str, ...]:
        return TABS

    def tab_views(self, tab: int) -> dict:
        """{name: PlotView} of tab `tab` that are on screen (a hidden view, e.g. the closed full map, is not)."""
        out = {name: self.views[name] for name, (i, *_) in VIEWS.items()
               if i == tab and self.views[name].layout.display != "none"}
        if tab == TABS.index("Predictions"):
            out.update(ablation=self.ex.ablation.view, ablation_diff=self.ex.ablation.diff_view)
        return out

    def searched_expert(self) -> int | None:
        """The expert id in the search field (None: empty or not a number; the note says which)."""
        text = self.expert.value.strip()
        if not text:
            self.expert_note.value = ""
            return None
        try:
            return int(text)
        except ValueError:
            self.expert_note.value = f"<span style='color:#b00'>{text!r} is not an expert id</span>"
            return None

    def _expert_changed(self) -> None:
        # a field that holds no id shows no map (the note says why): not the last expert's, nor a blank box
        ok = self.searched_expert() is not None
        self.views["expert_search"].layout.display = None if ok else "none"
        if not ok:
            self.views["expert_search"].clear()
        self.drawn.pop(2, None)
        if self.widget.selected_index == 2:
            self.ex.refresh()

    def clear(self) -> None:
        for v in self.views.values():
            v.clear()
        self.drawn.clear()
        self.tab_rev.clear()

    def refresh(self, tab: int, t: int, layer: int) -> bool:
        """Send tab `tab`'s figures for token t and `layer`; False when they already show exactly that."""
        s = self.ex.session
        n = len(s)
        key = (n, t, layer, (self.full_map.value, self.expert.value) if tab == 2 else None, self.ex.history_id)
        if self.drawn.get(tab) == key:
            return False
        self.rev += 1
        meta = {"token": t, "layer": layer, "tokens": n}
        tok, show = self.ex.tokenizer, lambda name, fig: self.views[name].show(fig[0], fig[1], self.rev, meta)
        one = self.ex.trace(window=slice(t, t + 1))  # the selected token
        a, b = token_window(n, t, specs.WINDOW)
        if tab == 0:
            show("block_token", specs.block_token(one, 0, layer, tok))
            show("block_layer", specs.block_layer(self.ex.trace(window=slice(a, b)), layer, t - a, tok))
        elif tab == 1:
            if self.ex.kda_layers:
                win = self.ex.trace(window=slice(a, b))
                vmax = specs.kda_vmax(win)  # one colour scale for both views: the window holds the token
                show("kda_token", specs.kda_token(one, 0, layer, tok, vmax))
                show("kda_layer", specs.kda_layer(win, layer, t - a, tok, vmax))
            else:
                for name in ("kda_token", "kda_layer"):
                    show(name, specs.empty("no KDA layer is loaded"))
        elif tab == 2:
            self._refresh_moe(one, t, layer, (a, b), show)
        elif tab == 3:
            show("predictions", specs_moe.predictions(self.ex.trace(window=slice(t, t + 2)), 0, tok))
        elif tab == 4:
            self._refresh_analyses(t, layer, show)
        self.drawn[tab], self.tab_rev[tab] = key, self.rev
        return True

    def _refresh_moe(self, one, t: int, layer: int, window: tuple[int, int], show) -> None:
        """one: the trace window of token t alone; window: the token range the expert search shows."""
        r = window_routing(self.ex, t, t + 1)
        stats = self.ex.history.load_stats()
        if not r or stats is None:
            for name in ("moe_topk", "moe_layers", "moe_sorted", "moe_top", "expert_search", "moe_full"):
                show(name, specs.empty("no MoE layer is loaded"))
            return
        tok, bias, k = self.ex.tokenizer, self.ex.bias, self.ex.session.weights.config.num_experts_per_token
        table = summaries.topk_table(r, 0, bias, k)
        entropy = summaries.routing_entropy(r)[0]
        counts, order = self.ex.history_memo("sorted_counts", lambda: summaries.sorted_counts(stats["counts"]))
        layers = list(r["moe_layers"])
        show("moe_topk", specs_moe.moe_topk(table, one, layer, tok, 0))
        show("moe_layers", specs_moe.moe_layers(entropy, stats, one, layers, layer, k))
        show("moe_sorted", specs_moe.moe_sorted(stats, order, counts, one, layers, layer, k))
        show("moe_top", specs_moe.moe_top_experts(counts, order, one, layers, layer, stats["tokens"]))
        e = self.searched_expert()
        if e is not None:
            self.expert_note.value = ""
            a, b = window
            win = self.ex.trace(window=slice(a, b))
            show("expert_search", specs_moe.expert_search(window_routing(self.ex, a, b), e, win, t - a, layer, tok,
                                                          stats["counts"]))
        if self.full_map.value:
            show("moe_full", specs_moe.moe_full(r, 0, one, layer, bias, tok))

    def compute_analyses(self) -> None:
        """The Compute button: the lens and the attribution of the selected token, then draw them."""
        ex = self.ex
        ex.sync()  # a history changed outside the Explorer is shown first
        n = len(ex.session)
        if not n:
            return
        self._analyses(min(ex.token.value, n - 1), compute=True, retry=True)
        self.drawn.pop(4, None)
        ex.refresh()

    def _analyses(self, t: int, compute: bool = False, retry: bool = False):
        """(lens, attribution) of token t, kept per (history, token); None until computed (each replays the
        tokens from the latest checkpoint before t: ~0.1-0.5 s at K3 depth, so they run on the Compute button).
        retry (the button): run again what failed (the reason kept: the hooks that stopped the replay may be gone)."""
        from ...analysis.attribution import logit_attribution
        from ...analysis.logit_lens import logit_lens

        ex, s = self.ex, self.ex.session
        key = f"analyses@{t}"
        if retry and any(isinstance(g, str) for g in ex._memo.get(key, ())):
            del ex._memo[key]
        if compute and key not in ex._memo:
            target = s.tokens[t + 1] if t + 1 < len(s) else None  # the token fed next (else the top-1)
            got = []
            for run in (lambda: logit_lens(s, top=3, positions=[t]), lambda: logit_attribution(s, t, token=target)):
                try:  # each on its own: the attribution refuses NaN logits that the lens shows layer by layer
                    got.append(run())
                except (ValueError, TypeError) as e:  # a history that does not replay, a pipeline: said in the view
                    got.append(str(e))
            ex._memo[key] = tuple(got)
        return ex._memo.get(key)

    def _refresh_analyses(self, t: int, layer: int, show) -> None:
        """The selected token's lens and attribution, once computed for it (see `_analyses`)."""
        got = self._analyses(t, compute=self.auto_analyses.value)
        if got is None:
            msg = (f"Press Compute for token {t}: the logit lens and the attribution replay the history from the "
                   "latest checkpoint before it")
            show("lens", specs.empty(msg))
            show("attribution", specs.empty("(the waterfall of the logit of the token fed next, or of the top-1)"))
            return
        lens, attr = got  # each, or why it cannot run here: said in its view, not raised from a click
        labels = specs.layer_labels(self.ex.trace(window=slice(t, t + 1)))
        show("lens", specs.empty(f"No lens for token {t}: {lens[:300]}") if isinstance(lens, str)
             else specs_analysis.lens_strip(lens, labels, self.ex.tokenizer, layer))
        show("attribution", specs.empty(f"No attribution for token {t}: {attr[:300]}") if isinstance(attr, str)
             else specs_analysis.waterfall(attr, self.ex.tokenizer))
