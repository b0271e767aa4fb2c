"""`Explorer(session)`: step K3 through a prompt in a notebook and look at each token, layer by layer.

    session = Session(weights, tokenizer=load_tokenizer(weights))
    Explorer(session, prompt="Kimi K3, one token at a time.")      # the last expression of a cell

Controls (ipywidgets 8):
  prompt      text (encoded with the session's tokenizer) or comma-separated ids; Step feeds it one
              token at a time, then continues greedily (argmax of the last logits)
  Step        decode one token: the only place the model runs (plus Play and the ablation)
  Back        rewind the session by one token (exact: `Session.rewind`)
  Play        feed the rest of the prompt (or, once it is all in, generate `play_tokens` more)
  Reset       rewind to the empty session
  token       slider over the history: which token the per-token views show
  layer       which layer the per-layer views show (token x source, token x head, token x expert)
  tabs        Block residuals | KDA state | MoE routing | Predictions (+ expert ablation)

Figures are inline PNGs in `widgets.Image` (they work in JupyterLab, classic Notebook, VS Code and
static exports with widget state; no ipympl needed). Only the visible tab is drawn, and every drawn
PNG is cached under what it depends on (view, token, layer, history length), so moving the slider
back over tokens already seen costs nothing and the model never runs on a slider move. Back/Reset
drop the cache (the history behind those keys changed).

The ablation control forks the session (`Session.fork()`), rewinds the fork to just before the
selected token, decodes that token again with `interventions.ablate_experts(layer, experts)`, and
plots both next-token distributions. The main session is never touched.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np

from ..inspection import interventions
from . import plots

__all__ = ["Explorer", "parse_experts", "parse_ids", "rerun", "rerun_token"]

TABS = ("Block residuals", "KDA state", "MoE routing", "Predictions")


def parse_ids(text: str) -> list[int]:
    """'17, 203,5' -> [17, 203, 5]; names the first piece that is not an integer."""
    ids = []
    for piece in text.replace(" ", "").split(","):
        if not piece:
            continue
        if not piece.lstrip("-").isdigit():
            raise ValueError(f"token ids: {piece!r} is not an integer (expected comma-separated ids like 17,203,5)")
        ids.append(int(piece))
    return ids


def parse_experts(text: str, chosen) -> str | list[int]:
    """The ablation field: 'all', 'chosen' (this token's top-k at that layer) or ids like '3, 7'."""
    text = text.strip().lower()
    if text == "all":
        return "all"
    if text in ("chosen", "topk", "top-k", ""):
        return [int(e) for e in chosen if e >= 0]
    return parse_ids(text)


def rerun(session, *hook_sets, start: int = 0, stop: int | None = None):
    """A fork of `session` that decodes tokens[start:stop] again with `hook_sets` attached.

    The fork is rewound exactly to the state before token `start` (see `Session.rewind`), so its
    trace and logits answer "what would the model have done from there under this intervention";
    `session` itself is never touched. Returns the fork (a Session with tokens[:stop]).
    """
    n = len(session)
    stop = n if stop is None else stop
    if not 0 <= start < stop <= n:
        raise IndexError(f"rerun: need 0 <= start < stop <= {n} (the session's history), got start={start}, stop={stop}")
    fork = session.fork()
    fork.rewind(start)
    with fork.intervene(*hook_sets):
        fork.feed(session.tokens[start:stop])
    return fork


def rerun_token(session, t: int, *hook_sets):
    """Logits [vocab] of token t decoded again, with `hook_sets` attached, on a fork (see `rerun`)."""
    return rerun(session, *hook_sets, start=t, stop=t + 1).logits[-1]


TAB_VIEWS = (("block_residual_token", "block_residual_layer"), ("kda_overview", "kda_layer"), ("moe_token", "moe_layer"),
             ("predictions", "ablation"))


def _image() -> widgets.Image:
    # Natural size, shrunk to fit (a VBox would otherwise stretch every image to its full width);
    # hidden until it has a picture, so an empty view never shows a broken-image icon.
    return widgets.Image(format="png", layout=widgets.Layout(width="auto", max_width="100%", height="auto",
                                                             align_self="flex-start", display="none"))


class Explorer(widgets.VBox):
    """A step-through view of a `Session` (see module docstring)."""

    def __init__(self, session, prompt=None, tokenizer=None, tab: int | str = 0, layer: int | None = None,
                 play_tokens: int = 8, dpi: int = 80):
        """prompt: text or ids for Step/Play; tab: the tab to open (index or title); layer: the layer
        of the per-layer views (default: the first MoE layer); dpi: resolution of the pictures."""
        self.session = session
        self.tokenizer = tokenizer if tokenizer is not None else getattr(session, "tokenizer", None)
        self.play_tokens, self.dpi = int(play_tokens), int(dpi)
        self._cache: dict = {}
        self._trace, self._trace_len = None, -1
        self.renders = 0  # PNGs drawn so far (tests use it to see that cached views are reused)
        weights = session.weights
        cfg = weights.config
        kinds = {i: ("KDA" if cfg.is_kda_layer(i) else "MLA") + (" + MoE" if cfg.is_moe_layer(i) else " + dense")
                 for i in weights.layer_ids}
        self.kda_layers = [i for i in weights.layer_ids if cfg.is_kda_layer(i)]
        self.moe_layers = [i for i in weights.layer_ids if cfg.is_moe_layer(i)]

        has_tok = self.tokenizer is not None
        modes = ["text", "ids"] if has_tok else ["ids"]
        tips = {"text": "encode the prompt with the tokenizer", "ids": "the prompt is comma-separated token ids"}
        self.mode = widgets.ToggleButtons(options=modes, value=modes[0], tooltips=[tips[m] for m in modes],
                                          style={"button_width": "48px"})
        if prompt is not None and not isinstance(prompt, str):
            prompt, self.mode.value = ", ".join(str(int(i)) for i in prompt), "ids"
        self.prompt = widgets.Text(value=prompt or "", placeholder="text, or ids like 17,203,5", description="prompt",
                                   layout=widgets.Layout(width="60%"))
        self.step_button = widgets.Button(description="Step", icon="step-forward", button_style="primary",
                                          tooltip="decode one token")
        self.back_button = widgets.Button(description="Back", icon="step-backward", tooltip="rewind one token")
        self.play_button = widgets.Button(description="Play", icon="play",
                                          tooltip="feed the rest of the prompt, then generate")
        self.reset_button = widgets.Button(description="Reset", icon="undo", tooltip="rewind to an empty session")
        self.status = widgets.HTML()
        self.token = widgets.IntSlider(min=0, max=0, value=0, description="token", continuous_update=False, readout=False,
                                       layout=widgets.Layout(width="50%"))  # token_label reads it out, with the text
        self.token_label = widgets.HTML()
        self.layer = widgets.Dropdown(options=[(f"{i}  {kinds[i]}", i) for i in weights.layer_ids],
                                      value=self.moe_layers[0] if self.moe_layers else weights.layer_ids[0],
                                      description="layer")
        self.views = {name: _image() for name in
                      ("block_residual_token", "block_residual_layer", "kda_overview", "kda_layer",
                       "moe_token", "moe_layer", "predictions", "ablation")}
        self.notes = {name: widgets.HTML() for name in ("kda_layer", "moe_layer", "ablation")}
        self.experts = widgets.Text(value="chosen", description="experts", placeholder="chosen | all | 3,7",
                                    layout=widgets.Layout(width="260px"))
        self.ablate_button = widgets.Button(description="Ablate & compare", icon="scissors",
                                            tooltip="fork the session and re-decode this token without these experts")
        v = self.views
        self.tabs = widgets.Tab(children=[
            widgets.VBox([v["block_residual_token"], v["block_residual_layer"]]),
            widgets.VBox([v["kda_overview"], self.notes["kda_layer"], v["kda_layer"]]),
            widgets.VBox([v["moe_token"], self.notes["moe_layer"], v["moe_layer"]]),
            widgets.VBox([v["predictions"],
                          widgets.HTML("<b>Expert ablation</b> at the selected layer and token: 'chosen' drops the "
                                       "experts this token was routed to, 'all' every routed expert, or list ids."),
                          widgets.HBox([self.experts, self.ablate_button]), self.notes["ablation"], v["ablation"]]),
        ], titles=TABS)

        self.step_button.on_click(lambda _: self.step())
        self.back_button.on_click(lambda _: self.back())
        self.play_button.on_click(lambda _: self.play())
        self.reset_button.on_click(lambda _: self.reset())
        self.ablate_button.on_click(lambda _: self.ablate())
        self.token.observe(lambda _: self._on_token(), names="value")
        self.layer.observe(lambda _: self.refresh(), names="value")
        self.tabs.observe(lambda _: self.refresh(), names="selected_index")
        self.prompt.observe(lambda _: self._update_status(), names="value")
        self.mode.observe(lambda _: self._update_status(), names="value")

        super().__init__([
            widgets.HBox([self.prompt, self.mode]),
            widgets.HBox([self.step_button, self.back_button, self.play_button, self.reset_button, self.status]),
            widgets.HBox([self.token, self.token_label, self.layer]),
            self.tabs,
        ])
        if isinstance(tab, str):
            if tab not in TABS:
                raise ValueError(f"Explorer: tab={tab!r} is not one of {TABS}")
            tab = TABS.index(tab)
        if layer is not None and layer not in weights.layer_ids:
            raise ValueError(f"Explorer: layer={layer} is not loaded; the layers are {weights.layer_ids}")
        with self.tabs.hold_trait_notifications(), self.layer.hold_trait_notifications():
            self.tabs.selected_index = tab  # observers fire once, at the end, for this tab only
            if layer is not None:
                self.layer.value = layer
        self._sync(show_last=True)

    # ------------------------------------------------------------------ the prompt
    def prompt_ids(self) -> list[int]:
        """The prompt box as token ids (raises ValueError naming what is wrong)."""
        if self.mode.value == "text":
            return list(self.tokenizer.encode(self.prompt.value))
        ids, vocab = parse_ids(self.prompt.value), self.session.weights.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
        return ids

    def _next_token(self) -> int | None:
        """The next prompt token, else the greedy continuation; None if there is nothing to continue from."""
        ids, n = self.prompt_ids(), len(self.session)
        if n < len(ids):
            return ids[n]
        return int(np.argmax(self.session.logits[-1])) if n else None

    # ------------------------------------------------------------------ actions
    def step(self) -> None:
        """Decode one token (the next prompt token, or greedy) and show it."""
        try:
            tid = self._next_token()
        except ValueError as e:
            return self._error(str(e))
        if tid is None:
            return self._error("type a prompt first: there is nothing to decode yet")
        self.session.step(tid)
        self._sync(show_last=True)

    def play(self) -> None:
        """Feed the rest of the prompt; if it is all in already, generate `play_tokens` greedily."""
        try:
            ids = self.prompt_ids()
        except ValueError as e:
            return self._error(str(e))
        n = len(self.session)
        if n < len(ids):
            self.session.feed(ids[n:])
        elif n:
            self.session.generate(self.play_tokens)
        else:
            return self._error("type a prompt first: there is nothing to decode yet")
        self._sync(show_last=True)

    def back(self) -> None:
        """Rewind the session by one token (exact)."""
        if len(self.session):
            self.session.rewind(len(self.session) - 1)
            self._cache.clear()
        self._sync(show_last=True)

    def reset(self) -> None:
        self.session.rewind(0)
        self._cache.clear()
        self._sync(show_last=True)

    def ablate(self):
        """Fork, re-decode the selected token without the chosen experts, plot both distributions.

        Returns the fork's logits for that token (None when the control's input is invalid)."""
        t, layer, n = self.token.value, self.layer.value, len(self.session)
        note = self.notes["ablation"]
        if not n:
            note.value = "<i>step at least one token first</i>"
            return None
        if layer not in self.moe_layers:
            note.value = f"<i>layer {layer} has a dense FFN, no experts: pick an MoE layer</i>"
            return None
        r = self.trace().routing()
        try:
            experts = parse_experts(self.experts.value, r["topk_ids"][t, r["moe_layers"].index(layer)])
        except ValueError as e:
            note.value = f"<span style='color:#b00'>{html.escape(str(e), quote=False)}</span>"
            return None
        ablated = rerun_token(self.session, t, interventions.ablate_experts(layer, experts, positions=t))
        name = f"without experts {experts} at layer {layer}" if experts != "all" else f"without routed experts at layer {layer}"
        title = f"Next token after {plots.escape_mathtext(self._label(t))}: ablation at layer {layer}"
        fig = plots.compare_predictions(self.session.logits[t], ablated, tokenizer=self.tokenizer, names=("as run", name),
                                        title=title)
        self.views["ablation"].value = plots.figure_png(fig, dpi=self.dpi)
        self.views["ablation"].layout.display = None
        self.renders += 1
        note.value = f"forked at token {t}; the main session still has {len(self.session)} tokens"
        return ablated

    # ------------------------------------------------------------------ views
    def trace(self):
        """The session's Trace, rebuilt only when the history changed."""
        if self._trace is None or self._trace_len != len(self.session) or len(self._trace) != len(self.session):
            self._trace, self._trace_len = self.session.trace(), len(self.session)
        return self._trace

    def _label(self, t: int) -> str:
        return plots.token_labels(self.session.tokens, self.tokenizer)[t]

    def _png(self, key: tuple, make) -> bytes:
        if key not in self._cache:
            self._cache[key] = plots.figure_png(make(), dpi=self.dpi)
            self.renders += 1
        return self._cache[key]

    def _show(self, name: str, key: tuple, make, note: str = "") -> None:
        img = self.views[name]
        if name in self.notes:
            self.notes[name].value = note
        if note:
            img.value, img.layout.display = b"", "none"
            return
        img.value = self._png((name, *key), make)
        img.layout.display = None

    def refresh(self, tab: int | None = None) -> None:
        """Draw the views of the visible tab (or of `tab`) for the selected token and layer.

        Refreshing the visible tab hides the other tabs' pictures: they show another token or an older
        history now, and are drawn again (from the cache when possible) when their tab is opened.
        """
        n = len(self.session)
        if tab is None:
            for other, names in enumerate(TAB_VIEWS):
                if other != self.tabs.selected_index:
                    for name in names:
                        if name != "ablation":
                            self.views[name].layout.display = "none"
        if n == 0:
            for name in self.views:
                self.views[name].layout.display = "none"
            return
        tr, t, layer, tok = self.trace(), min(self.token.value, n - 1), self.layer.value, self.tokenizer
        tab = self.tabs.selected_index if tab is None else tab
        if tab == 0:
            self._show("block_residual_token", (t,), lambda: plots.block_residual_token(tr, t, tok))
            self._show("block_residual_layer", (layer, n), lambda: plots.block_residual_layer(tr, layer, tok))
        elif tab == 1:
            self._show("kda_overview", (t,), lambda: plots.kda_state_overview(tr, t, tok))
            note = "" if layer in self.kda_layers else (f"<i>layer {layer} is an MLA layer: it keeps a K/V cache, "
                                                        "not a recurrent state. Pick a KDA layer to see its heads.</i>")
            self._show("kda_layer", (layer, n), lambda: plots.kda_state_heatmap(tr, layer, tok), note)
        elif tab == 2:
            self._show("moe_token", (t,), lambda: plots.moe_routing_token(tr, t, tok))
            note = "" if layer in self.moe_layers else f"<i>layer {layer} has a dense FFN (no router). Pick an MoE layer.</i>"
            self._show("moe_layer", (layer, n), lambda: plots.moe_routing_layer(tr, layer, tok), note)
        elif tab == 3:
            self._show("predictions", (t, t + 1 < n), lambda: plots.predictions(tr, t, tok))

    def _on_token(self) -> None:
        self._show_token_label()
        self.refresh()

    def refresh_all(self) -> None:
        """Draw every tab now (for static exports, where hidden tabs are never selected)."""
        for tab in range(len(TABS)):
            self.refresh(tab)

    def _sync(self, show_last: bool = False) -> None:
        """Bring slider, labels and status in line with the session, then redraw the visible tab."""
        n = len(self.session)
        with self.token.hold_trait_notifications():
            self.token.max = max(n - 1, 0)
            if show_last:
                self.token.value = max(n - 1, 0)
        self.token.disabled = n == 0
        self.back_button.disabled = n == 0
        if show_last and self.views["ablation"].value:
            self.views["ablation"].value, self.notes["ablation"].value = b"", ""
            self.views["ablation"].layout.display = "none"
        self._update_status()
        self.refresh()

    def _update_status(self) -> None:
        n = len(self.session)
        self._show_token_label()
        try:
            ids = self.prompt_ids()
        except ValueError as e:
            return self._error(str(e))
        if n < len(ids):
            nxt = plots.token_labels([ids[n]], self.tokenizer, positions=False)[0]
            what = f"prompt {n}/{len(ids)} tokens in; Step feeds {html.escape(nxt, quote=False)}"
        else:
            what = f"prompt done ({len(ids)} tokens); Step continues greedily" if n else "type a prompt, then Step"
        self.status.value = f"{n} tokens decoded &middot; {what}"

    def _show_token_label(self) -> None:
        n = len(self.session)
        label = self._label(min(self.token.value, n - 1)) if n else ""
        self.token_label.value = f"<code>{html.escape(label, quote=False)}</code>" if n else ""

    def _error(self, message: str) -> None:
        self.status.value = f"<span style='color:#b00'>{html.escape(message, quote=False)}</span>"
