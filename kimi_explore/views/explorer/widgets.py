"""`Explorer(session)`: step K3 through a prompt in a notebook and look at each token, layer by layer.

    session = Session(weights, tokenizer=load_tokenizer(weights))
    Explorer(session, prompt="Kimi K3, one token at a time.")      # the last expression of a cell

Controls (ipywidgets 8; the figures are plotly.js views, see `plotly_view.py`):
  prompt      text (encoded with the session's tokenizer) or comma-separated ids; the toggle converts
              the box between the two. Step feeds the prompt one token at a time, then continues
              greedily. A prompt the history does not start with starts over: the session is
              truncated to the tokens both share (exact), and the status line says so
  Step        decode one token (busy indicator while it runs); Back drops the last token (exact);
              Play feeds the rest of the prompt, or generates `play_tokens` more; Reset empties it
  text        the decoded tokens, coloured by a per-token measure (`summaries.MEASURES`); click one.
              Dotted: the generated tokens (`session.generated`: Play past the prompt, a greedy Step,
              or `session.generate` in another cell)
  token       slider over the history; layer: the layer of the per-layer views (default: the
              deepest KDA + MoE layer, where every view has something to show)
  tabs        Block residuals | KDA state | MoE routing | Predictions (+ ablation of experts or KDA
              heads at one or several layers, this token / from it on / all tokens, with the fork's
              run diff) | Lens & attribution (the selected token's logit lens and logit attribution)

The views read the session's records: its Recorder must keep the sites of `READS` (the default
Recorder() does; a names_filter that leaves one out is refused here, naming what it lacks).

Every view marks the selected token and layer, and a click on a token or a layer in any view
selects it everywhere. Only the open tab is updated (in place); the others when they are opened.
The model runs only on Step, Play and the ablation (which forks: the main session is never touched).
An error in a button's action or a selection's callback is shown in red on the status line ('Step failed:
RuntimeError: ...'; `explorer.last_error` keeps it), not lost in ipywidgets' log; the Explorer stays usable.
Called from code (`explorer.step()`, `select(...)`, `sync()`, `ablate()`, `snapshot()`, `refresh()`), the same
actions raise.
"""

from __future__ import annotations

import functools
import html

import ipywidgets as widgets
import numpy as np

from ...inspection.trace import window_slice
from ...model.kimi_decoder import hook_names
from .. import summaries
from ..common import bias_vectors, token_labels
from .ablation import Ablation, parse_experts, parse_ids, rerun, rerun_token
from .history import HistoryCache
from .plotly_view import PlotlyJS
from .snapshot import write_snapshot
from .tabs import TABS, Tabs
from .token_text import TokenText, measure_colors

__all__ = ["Explorer", "TABS", "parse_experts", "parse_ids", "rerun", "rerun_token"]

STATUS_CSS = "white-space:nowrap;overflow:hidden;text-overflow:ellipsis;display:block;width:100%"
BUSY = "<span class='kimi-busy' style='color:#b35900;font-weight:600'>&#9203; running&hellip;</span>"
# the records the views read (the specs, the text's measures, the ablation's run diff), at every layer with the site
READS = ("attn_res.attn.weights", "attn_res.ffn.weights", "final.attn_res.weights", "kda.state", "moe.router.scores",
         "moe.router.topk_ids", "moe.router.topk_weights", "logits")


def _from_code(method):
    """A public action: called from code, the errors of the callbacks it fires raise out of it (a click shows them on
    the status line instead: `Explorer._busy`)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        acting, self._acting = self._acting, True
        try:
            return method(self, *args, **kwargs)
        finally:
            self._acting = acting
    return run


def left_out(session) -> list[str]:
    """The records of `READS` the session's recorder leaves out (its names_filter), by site: 'logits',
    'kda.state at layers [4, 5, 6]', ...; [] when it keeps them all."""
    keep = session.recorder.names_filter
    if keep is None:
        return []
    have: dict[str, list] = {}  # site kind -> the layers with that site (None: a site outside the layers)
    left: dict[str, list] = {}  # ... of them, those the filter leaves out
    for name in hook_names(session.weights):
        kind = next((k for k in READS if name == k or name.endswith("." + k)), None)
        if kind is None:
            continue
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        have.setdefault(kind, []).append(layer)
        if not keep(name):
            left.setdefault(kind, []).append(layer)
    return [kind if ids == [None] else f"{kind} at " + ("every layer that has it" if ids == have[kind] else f"layers {ids}")
            for kind, ids in left.items()]


class Explorer(widgets.VBox):
    """A step-through view of a `Session` (see module docstring)."""

    def __init__(self, session, prompt=None, tokenizer=None, tab: int | str = 0, layer: int | None = None,
                 play_tokens: int = 8, measure: str = "surprisal"):
        if getattr(session, "recorder", None) is None:
            raise ValueError("Explorer: this session records nothing, and every view reads its records: create it with "
                             "Session(weights, recorder=True) (the default)")
        missing = left_out(session)
        if missing:  # refused here, not a view that raises or shows half a model on some later click
            raise ValueError(f"Explorer: every view reads the session's records, and its Recorder's names_filter "
                             f"({session.recorder.settings()['names_filter']!r}) leaves out {'; '.join(missing)}: "
                             "create the session with Recorder() (the default), or a names_filter that keeps these "
                             "(full=[...] adds full tensors to either)")
        weights, cfg = session.weights, session.weights.config
        # the arguments are checked before any widget is made (a refused Explorer leaves none registered)
        if measure not in summaries.MEASURES:
            raise ValueError(f"Explorer: measure={measure!r} is not one of {summaries.MEASURES}")
        if isinstance(tab, str):
            if tab not in TABS:
                raise ValueError(f"Explorer: tab={tab!r} is not one of {TABS}")
            tab = TABS.index(tab)
        if isinstance(tab, bool) or not isinstance(tab, (int, np.integer)) or not 0 <= tab < len(TABS):
            raise ValueError(f"Explorer: tab={tab!r}: pick 0..{len(TABS) - 1} or a name, one of {TABS}")
        if layer is not None and layer not in weights.layer_ids:
            raise ValueError(f"Explorer: layer={layer} is not loaded; the layers are {weights.layer_ids}")
        self.session = session
        self.tokenizer = tokenizer if tokenizer is not None else getattr(session, "tokenizer", None)
        self.play_tokens = play_tokens
        self.last_error = None  # the exception behind the last "... failed" status line (its traceback), or None
        self.kda_layers = [i for i in weights.layer_ids if cfg.is_kda_layer(i)]
        self.moe_layers = [i for i in weights.layer_ids if cfg.is_moe_layer(i)]
        self.bias = bias_vectors(weights)
        self.history_id, self._memo, self._surprisal, self._trace = 0, {}, {}, None
        self._version = None  # the session's `history_version` that everything kept below describes
        self.history = HistoryCache()  # per-token measures and expert counts, grown by each Step
        self._labels: dict[str, list] = {}  # (token id, label) per position, grown by each Step
        self._prompt_memo: tuple = (None, [])  # ((mode, text), ids): the prompt is parsed once per edit
        self._note = ""  # what the last action did to the history, for the status line
        self._acting = False  # True while `_busy` runs an action
        self._status_writes = 0  # how many times the status line was written
        self._quiet = False  # True while `_history_changed` moves the token slider
        self._keep_box = False  # True while the text/ids toggle is put back (no conversion of the box)

        modes = ["text", "ids"] if self.tokenizer is not None else ["ids"]
        self.mode = widgets.ToggleButtons(options=modes, value=modes[0], style={"button_width": "46px"},
                                          tooltips=["the prompt is text", "the prompt is comma-separated token ids"][:len(modes)])
        if prompt is not None and not isinstance(prompt, str):
            prompt, self.mode.value = ", ".join(str(int(i)) for i in prompt), "ids"
        self.prompt = widgets.Text(value=prompt or "", placeholder="text, or ids like 17,203,5", description="prompt",
                                   layout=widgets.Layout(flex="1 1 auto", width="auto"))
        button = lambda d, icon, tip, **kw: widgets.Button(description=d, icon=icon, tooltip=tip,
                                                           layout=widgets.Layout(width="84px"), **kw)
        self.step_button = button("Step", "step-forward", "decode one token", button_style="primary")
        self.back_button = button("Back", "step-backward", "drop the last token")
        self.play_button = button("Play", "play", "feed the rest of the prompt, then generate")
        self.reset_button = button("Reset", "undo", "empty the session")
        self.snapshot_button = button("Snapshot", "camera", "the open tab as drawn (token, layer, zoom), one offline HTML file")
        self.busy = widgets.HTML(layout=widgets.Layout(width="110px"))
        self.status = widgets.HTML(layout=widgets.Layout(width="100%", height="22px", overflow="hidden"))
        self.text = TokenText(layout=widgets.Layout(flex="1 1 420px", width="auto", min_width="320px"))
        self.measure = widgets.Dropdown(options=summaries.MEASURES, value=measure, description="colour",
                                        layout=widgets.Layout(width="230px"))
        # two lines reserved: the legend growing a line when generation starts must not move the page
        self.legend = widgets.HTML(layout=widgets.Layout(width="230px", height="38px", overflow="hidden"))
        self.token = widgets.IntSlider(min=0, max=0, value=0, description="token", continuous_update=False, readout=False,
                                       layout=widgets.Layout(width="45%"))
        self.token_label = widgets.HTML(layout=widgets.Layout(width="180px", overflow="hidden"))
        kinds = {i: ("KDA" if i in self.kda_layers else "MLA") + (" + MoE" if i in self.moe_layers else " + dense")
                 for i in weights.layer_ids}
        both = [i for i in self.kda_layers if i in self.moe_layers]
        self.layer = widgets.Dropdown(options=[(f"{i}  {kinds[i]}", i) for i in weights.layer_ids],
                                      value=(both or self.moe_layers or weights.layer_ids)[-1], description="layer",
                                      layout=widgets.Layout(width="240px"))
        self.done = widgets.HTML(layout=widgets.Layout(display="none"))  # last refresh's revision (for browser tests)
        self.ablation = Ablation(self)
        self.ablation_box = self.ablation.widget
        self.tab_views = Tabs(self)
        self.tabs, self.views = self.tab_views.widget, self.tab_views.views

        self.step_button.on_click(lambda _: self._busy(self.step, "Step"))
        self.back_button.on_click(lambda _: self._busy(self.back, "Back"))
        self.play_button.on_click(lambda _: self._busy(self.play, "Play"))
        self.reset_button.on_click(lambda _: self._busy(self.reset, "Reset"))
        self.snapshot_button.on_click(lambda _: self._busy(self._snapshot_clicked, "Snapshot"))
        self.token.observe(self.shown(self._selection_changed, "Selecting a token"), names="value")
        self.layer.observe(self.shown(self._selection_changed, "Selecting a layer"), names="value")
        self.text.observe(lambda ch: self._busy(lambda: self._text_clicked(ch["new"]), "Selecting a token"), names="selected")
        self.tabs.observe(self.shown(self.refresh, "Opening the tab"), names="selected_index")
        self.measure.observe(self.shown(self._measure_changed, "Changing the measure"), names="value")
        self.prompt.observe(self.shown(self._prompt_changed, "Reading the prompt"), names="value")
        self.mode.observe(lambda ch: self._busy(lambda: self._convert_prompt(ch), "Converting the prompt"), names="value")

        super().__init__([
            PlotlyJS.shared(),
            # rows wrap instead of clipping when the notebook is narrow (JupyterLab's side panel open)
            widgets.HBox([self.prompt, self.mode, self.step_button, self.back_button, self.play_button,
                          self.reset_button, self.snapshot_button, self.busy],
                         layout=widgets.Layout(width="100%", flex_flow="row wrap")),
            self.status,
            widgets.HBox([self.text, widgets.VBox([self.measure, self.legend], layout=widgets.Layout(width="240px"))],
                         layout=widgets.Layout(width="100%", flex_flow="row wrap")),
            widgets.HBox([self.token, self.token_label, self.layer]),
            self.tabs, self.done,
        ], layout=widgets.Layout(width="100%"))
        with self.tabs.hold_trait_notifications(), self.layer.hold_trait_notifications():
            self.tabs.selected_index = tab
            if layer is not None:
                self.layer.value = layer
        self._history_changed()

    # ------------------------------------------------------------------ the prompt
    def close(self) -> None:
        """Close the Explorer and every widget it made (the layouts and styles too): closing only the outer box left
        the rest registered with ipywidgets, their callbacks holding the Explorer and its session alive."""
        for w in _widgets_within(self):
            if w is not self:
                w.close()
        super().close()

    def prompt_ids(self) -> list[int]:
        """The prompt box as token ids (raises ValueError naming what is wrong); parsed once per text."""
        key = (self.mode.value, self.prompt.value)
        if self._prompt_memo[0] != key:
            self._prompt_memo = (key, self._parse_prompt())
        return list(self._prompt_memo[1])

    def _parse_prompt(self) -> list[int]:
        if self.mode.value == "text":
            return list(self.tokenizer.encode(self.prompt.value))
        ids, vocab = parse_ids(self.prompt.value, "token ids"), self.session.weights.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
        return ids

    def _prompt_changed(self) -> None:
        self.sync()  # a history changed in another cell: the status line below speaks of the views shown
        self._update_status()

    def _convert_prompt(self, change) -> None:
        """The text/ids toggle converts what is in the box (text -> its ids, ids -> their text)."""
        if self._keep_box:
            return  # the toggle is being put back: the box keeps what the user typed
        self.sync()
        if change["old"] == "text" and change["new"] == "ids":
            self.prompt.value = ", ".join(str(i) for i in self.tokenizer.encode(self.prompt.value))
        elif change["old"] == "ids" and change["new"] == "text":
            try:
                ids = parse_ids(self.prompt.value, "token ids")
            except ValueError as e:
                return self._stay_ids(f"{e}; fix the ids before switching to text")
            text = self.tokenizer.decode(ids)
            back = list(self.tokenizer.encode(text))
            if back != ids:  # the text would feed other tokens: a byte that is not text alone, another split
                at = next((i for i, (a, b) in enumerate(zip(ids, back, strict=False)) if a != b), min(len(ids), len(back)))
                return self._stay_ids(f"the ids stay ids: as text they would be encoded as other tokens (from token "
                                      f"{at} on: {back[at:at + 3]} instead of {ids[at:at + 3]})")
            self.prompt.value = text
        self._update_status()

    def _stay_ids(self, message: str) -> None:
        """Put the toggle back on ids, the box unchanged, and say why."""
        self._keep_box = True
        try:
            self.mode.value = "ids"
        finally:
            self._keep_box = False
        self._error(message)

    def _shared_prefix(self, ids: list[int]) -> int:
        """How many tokens of the history continue this prompt (all of them when the prompt is done)."""
        hist = self.session.tokens
        n = 0
        while n < min(len(hist), len(ids)) and hist[n] == ids[n]:
            n += 1
        return len(hist) if n == len(ids) else n

    def _prompt(self) -> list[int] | None:
        """The prompt's ids for a Step or Play (the session started over if the prompt changed), or None
        after showing why there are none."""
        self._note = ""
        try:
            ids = self.prompt_ids()
        except ValueError as e:
            self._error(str(e))
            return None
        self._start_over_if_new_prompt(ids)
        return ids

    def _start_over_if_new_prompt(self, ids: list[int]) -> None:
        keep, n = self._shared_prefix(ids), len(self.session)
        if keep < n:
            self.session.truncate(keep)
            self._note = f"new prompt: the history was truncated to the {keep} tokens it shares with it"


    # ------------------------------------------------------------------ actions
    @property
    def play_tokens(self) -> int:
        """How many tokens Play generates once the prompt is in (an int >= 1)."""
        return self._play_tokens

    @play_tokens.setter
    def play_tokens(self, n) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"Explorer: play_tokens (tokens Play generates once the prompt is in) must be an int >= 1, "
                             f"got {n!r}")
        self._play_tokens = int(n)

    def _busy(self, action, what: str, tell=None) -> None:
        """Run a button's action with the busy indicator on (clicks meanwhile wait in the kernel's queue).

        An exception is shown, not lost: ipywidgets would swallow it into its log, the status line still saying
        what the button was about to do. The status line turns red with '<what> failed: <type>: <message>' (`tell`,
        if given, is told too), `last_error` keeps the exception (its traceback), and the Explorer stays usable:
        what the session decoded before the error is shown (a failed token leaves the session as it was).
        Inside another action (a callback its changes fire), the action runs as it is: the outer one reports. The
        next action that succeeds without a message of its own puts the status line back from red."""
        if self._acting:
            return action()
        self._acting, self.busy.value = True, BUSY
        writes = self._status_writes
        try:
            action()
            if self._status_writes == writes and "color:#b00" in self.status.value:  # an earlier action's red line
                self._update_status()
        except Exception as e:  # the UI's edge: the error goes to the user instead of ipywidgets' log
            self._failed(what, e, tell)
        finally:
            self._acting, self.busy.value = False, ""

    def shown(self, action, what: str):
        """A widget callback running `action()` under `_busy`: its errors shown in the status line, not in
        ipywidgets' log (an analysis computed on every selection, a view that fails to draw)."""
        return lambda *_: self._busy(action, what)

    def _failed(self, what: str, error: Exception, tell=None) -> None:
        self.last_error = error
        message = f"{what} failed: {type(error).__name__}: {error}"
        try:
            self.sync()  # the history may have changed before the error (the chunks Play fed before it)
        except Exception as again:  # showing the history failed too: say both, raise neither
            message += f" (showing the history then failed too: {type(again).__name__}: {again})"
        if tell is not None:
            tell(message)
        self._error(message + " (explorer.last_error holds the traceback)")

    @_from_code
    def step(self) -> None:
        """Decode one token (the next prompt token, or greedy) and show it."""
        self.sync()  # what is kept per token holds for the history the Explorer saw last: a change from outside first
        ids = self._prompt()
        if ids is None:
            return None
        n = len(self.session)
        if n < len(ids):
            self.session.step(ids[n])
        elif n:
            self.session.generate(1)  # greedy (a NaN in the logits is refused, not read as token 0)
        else:
            return self._error("type a prompt first: there is nothing to decode yet")
        self._history_changed()

    @_from_code
    def play(self) -> None:
        """Feed the rest of the prompt; if it is all in already, generate `play_tokens` greedily."""
        self.sync()
        ids = self._prompt()
        if ids is None:
            return None
        n = len(self.session)
        if n < len(ids):
            self.session.feed(ids[n:])
        elif n:
            self.session.generate(self.play_tokens)
        else:
            return self._error("type a prompt first: there is nothing to decode yet")
        self._history_changed()

    @_from_code
    def back(self) -> None:
        """Drop the session's last token (exact)."""
        self.sync()
        self._note = ""
        if len(self.session):
            self.session.back()
        self._history_changed()

    @_from_code
    def reset(self) -> None:
        self.sync()
        self._note = ""
        self.session.truncate(0)
        self._history_changed()

    @_from_code
    def ablate(self):
        """Fork, re-decode the selected token without the chosen experts, plot both distributions.
        Returns the fork's logits for that token (None when the input is invalid)."""
        return self.ablation.run()

    @_from_code
    def snapshot(self, path=None):
        """Write the open tab as drawn (selection, zoom) to one offline HTML file; returns its path."""
        return write_snapshot(self, path)

    def _snapshot_clicked(self) -> None:
        try:
            path = self.snapshot()
        except (ValueError, OSError) as e:  # write_snapshot's own messages start with "snapshot:"
            return self._error(str(e) if str(e).startswith("snapshot") else f"snapshot: {e}")
        self._update_status()
        self._set_status(self.status.value.split("'>", 1)[1].rsplit("</span>", 1)[0]
                         + f" &middot; snapshot written to <code>{html.escape(str(path.resolve()))}</code>")

    @_from_code
    def select(self, token: int | None = None, layer: int | None = None) -> None:
        """Select a token and/or a layer in every view (what a click on one does). token: a history position,
        negative counting from the end (-1: the last token); IndexError outside the history. layer: a loaded
        layer id; ValueError naming them otherwise."""
        self.sync()  # a click on what is selected already still shows a history changed outside the Explorer
        n = len(self.session)
        if token is not None:
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
                raise TypeError(f"Explorer.select: token must be an int history position, got {token!r} "
                                f"({type(token).__name__})")
            if n == 0:
                raise IndexError(f"Explorer.select: token={token}, but nothing is decoded yet: Step first")
            if not -n <= token < n:
                raise IndexError(f"Explorer.select: token={token!r} is outside the history: it holds {n} tokens "
                                 f"(0..{n - 1}, or -{n}..-1)")
            token = int(token) % n
        ids = list(self.session.weights.layer_ids)
        if layer is not None and (isinstance(layer, bool) or layer not in ids):
            raise ValueError(f"Explorer.select: layer={layer!r} is not loaded; the layers are {ids}")
        with self.token.hold_trait_notifications(), self.layer.hold_trait_notifications():
            if token is not None:
                self.token.value = token
            if layer is not None:
                self.layer.value = int(layer)

    def _text_clicked(self, t: int) -> None:
        """A click on token t of the text (a strip drawn before a change outside may name a token gone since)."""
        if 0 <= t < len(self.session):
            self.select(token=t)
        else:
            self.sync()

    # ------------------------------------------------------------------ state shared by the views
    def trace(self, window=None):
        """The session's Trace (fetched once per history: O(records), whatever its length), or a window
        of it (views of its records). The views read windows: a Step costs the same at any length."""
        if self._trace is None:
            self._trace = self.session.trace()
        return self._trace if window is None else self._trace.window(window_slice(window, "Explorer.trace"))

    def history_memo(self, name: str, make):
        """A value computed once per history (dropped when the history changes)."""
        if name not in self._memo:
            self._memo[name] = make()
        return self._memo[name]

    def _history_changed(self, rewritten: bool = False) -> None:
        """Show the session's history as it is now. The Explorer's own actions only drop tokens from the end
        and decode new ones, so what is kept per token holds on the prefix the history still shares with the
        one it was computed for; `rewritten`: the history changed outside the Explorer, where a token can
        keep its id and change its values (`session.restore`, or `back` then the same token under an
        intervention), so nothing per token is kept."""
        n = len(self.session)
        self.history_id += 1
        self._version = self.session.history_version
        self._memo.clear()
        self._trace = None
        if rewritten:
            self.history, self._surprisal, self._labels = HistoryCache(), {}, {}
        # token t's surprisal reads the logits after tokens[:t]: it holds only inside the prefix the history
        # shares with the one it was computed for (a new prompt fed by Play can bring a token back at t
        # after another one at t - 1)
        keep = self.history.shared_prefix(self.session.tokens)
        self._surprisal = {t: v for t, v in self._surprisal.items() if t < keep}
        for key, have in self._labels.items():  # every measure's titles, not only the one shown (a token decoded
            if key.startswith("titles:"):      # again after Back, its id the same, can have other values)
                del have[keep:]
        # the per-history numbers first: the views drawn below read them (the expert counts, the measures)
        self.history.update(self, self._surprisals())
        self._quiet = True  # moving the slider must not refresh the views before the text and status are sent
        try:
            with self.token.hold_sync(), self.token.hold_trait_notifications():  # max and value: one message
                self.token.max = max(n - 1, 0)
                self.token.value = max(n - 1, 0)
        finally:
            self._quiet = False
        self.token.disabled = self.back_button.disabled = n == 0
        self.ablation.clear()
        self._update_status()
        self._show_text()
        self.refresh()  # one refresh per history change, after everything it reads is up to date

    def generated_runs(self) -> list[list[int]]:
        """[[a, b), ...]: the runs of generated tokens (`session.generated`)."""
        runs: list[list[int]] = []
        for u, generated in enumerate(self.session.generated):
            if generated and runs and runs[-1][1] == u:
                runs[-1][1] = u + 1
            elif generated:
                runs.append([u, u + 1])
        return runs

    @_from_code
    def sync(self) -> bool:
        """Catch up with a history changed outside the Explorer (`session.feed`, `generate`, `truncate` in
        another cell): every view, the slider and the per-history numbers are redone for the session as it
        is now, the selected token kept where it still exists. True when there was something to catch up.
        Any change counts, also one that kept the token ids (`Session.history_version`: one int compared)."""
        if self.session.history_version == self._version:
            return False
        t = self.token.value
        self._note = "the session was changed outside the Explorer: shown as it is now"
        self._history_changed(rewritten=True)  # selects the last token
        if t < len(self.session) and t != self.token.value:
            self.token.value = t  # back to the token that was selected (a refresh of its own)
        return True

    def _selection_changed(self) -> None:
        if self._quiet:
            return  # inside `_history_changed`, which shows the selection itself
        if self.sync():
            return  # the selection is shown by the catch-up
        self.ablation.clear()
        self._show_token_label()
        self.text.selected = min(self.token.value, len(self.session) - 1)
        self.refresh()

    @_from_code
    def refresh(self, tab: int | None = None) -> None:
        """Update the open tab's views (or `tab`'s) for the selected token and layer."""
        self.sync()
        n = len(self.session)
        # nothing decoded: no tabs at all (empty views would leave blank boxes), the status says what to do
        self.tabs.layout.display = "none" if n == 0 else None
        if n == 0:
            self.tab_views.clear()
        else:
            tab = self.tabs.selected_index if tab is None else tab
            self.tab_views.refresh(tab, min(self.token.value, n - 1), self.layer.value)
        rev = self.tab_views.tab_rev.get(self.tabs.selected_index, 0)  # what the open tab's views must show
        self.done.value = f"<span class='kimi-done' data-rev='{rev}' data-tokens='{n}'></span>"

    @_from_code
    def refresh_all(self) -> None:
        """Draw every tab now (for exports, where hidden tabs are never opened)."""
        for tab in range(len(TABS)):
            self.refresh(tab)

    # ------------------------------------------------------------------ text, labels, status
    def labels(self, positions: bool = True) -> list[str]:
        """Every token's label ("3 'a'"; positions=False: "'a'"), kept per token: a Step adds one."""
        return self._per_token("labels" if positions else "names",
                               lambda ids, start: token_labels(ids, self.tokenizer, positions=positions, start=start))

    def _per_token(self, key: str, make) -> list:
        """make(ids, start) for the tokens not seen yet; earlier tokens keep what they got (a prefix of the
        history never changes its labels)."""
        have = self._labels.setdefault(key, [])
        toks = self.session.tokens
        keep = 0
        while keep < min(len(have), len(toks)) and have[keep][0] == toks[keep]:
            keep += 1
        del have[keep:]
        have.extend(zip(toks[keep:], make(toks[keep:], keep), strict=True))
        return [value for _, value in have]

    def _surprisals(self) -> np.ndarray:
        toks, out = self.session.tokens, np.full(len(self.session), np.nan)
        for t in range(1, len(toks)):
            if t not in self._surprisal:
                self._surprisal[t] = (toks[t], summaries.surprisal_bits(self.session.logits_at(t - 1), toks[t]))
            out[t] = self._surprisal[t][1]
        return out

    def _measure_changed(self) -> None:
        if not self.sync():  # the catch-up with a history changed outside shows the text, in the new measure
            self._show_text()

    def _show_text(self) -> None:
        n = len(self.session)
        if not n:
            self.text.set_tokens([], [], [])
            self.legend.value = ""
            return
        measures = self.history.measures
        name = self.measure.value
        values = measures[name]
        shown = self._per_token("pieces", lambda ids, _: [self._piece(t) for t in ids])
        colors, lo, hi = measure_colors(values)
        names = self.labels(positions=False)
        # a decoded token's measures never change: its title is made once per measure
        titles = self._per_token(f"titles:{name}", lambda ids, a: [
            f"token {t} {names[t]}: {name} " + (f"{values[t]:.4g}" if np.isfinite(values[t]) else "n/a")
            + "; click to select" for t in range(a, a + len(ids))])
        runs = self.generated_runs()
        with self.text.hold_sync():  # the tokens and the selection: one message
            self.text.set_tokens(shown, colors, titles, generated_runs=runs)
            self.text.selected = min(self.token.value, n - 1)
        scale = f"light {lo:.3g} &rarr; dark {hi:.3g}" if np.isfinite(values).any() else "no value yet"
        first = self.trace(window=slice(-1, None)).source_labels()[0] if name == "embedding weight" else "embedding"
        if first != "embedding":  # a layer subset: source 0 is the input of its first pushing layer, if it has one
            name += " (none here: these layers seal no block)" if first == "current" else f" (source 0 here: {first})"
        self.legend.value = (f"<small>{html.escape(name)}: {scale}"
                             + ("; dotted = generated" if runs else "") + "</small>")

    def _piece(self, t: int) -> str:
        """Token t's text in the text box; a byte that is not text alone (part of a UTF-8 character)
        shows as the predictions show it, `<0xD7>`, not as a replacement character."""
        if self.tokenizer is None:
            return f"#{t} "
        s = self.tokenizer.decode([t])
        return self.tokenizer.token_label(t) if "\ufffd" in s else s

    def _show_token_label(self) -> None:
        n = len(self.session)
        t = min(self.token.value, n - 1)
        label = token_labels([self.session.tokens[t]], self.tokenizer, start=t)[0] if n else ""
        self.token_label.value = f"<code>{html.escape(label, quote=False)}</code>" if n else ""

    def _update_status(self) -> None:
        n = len(self.session)
        self._show_token_label()
        try:
            ids = self.prompt_ids()
        except ValueError as e:
            return self._error(str(e))
        keep = self._shared_prefix(ids)
        if not ids:
            what = "no prompt: Step continues greedily from the history" if n else "type a prompt, then Step"
        elif keep < n:
            what = f"new prompt: Step starts over from the {keep} tokens it shares with the history"
        elif n < len(ids):
            nxt = token_labels([ids[n]], self.tokenizer, positions=False)[0]
            what = f"prompt {n}/{len(ids)} tokens in; Step feeds {nxt}"
        else:
            what = f"prompt done ({len(ids)} tokens); Step continues greedily" if n else "type a prompt, then Step"
        note = self._note
        self._set_status(f"{n} token{'' if n == 1 else 's'} decoded &middot; {html.escape(what, quote=False)}"
                         + (f" &middot; <i>{html.escape(note, quote=False)}</i>" if note else ""))

    def _set_status(self, inner: str) -> None:
        self._status_writes += 1  # (`_busy` tells an action that wrote nothing from one that wrote the same line again)
        self.status.value = f"<span class='kimi-status' style='{STATUS_CSS}'>{inner}</span>"

    def _error(self, message: str) -> None:
        self._set_status(f"<span style='color:#b00'>{html.escape(message, quote=False)}</span>")


def _widgets_within(root) -> list:
    """Every widget reachable from `root`: through widget traits (children, layout, style...) and through the
    attributes of this package's own helper objects (the ablation panel, the tabs and their views); not the kernel's
    shared PlotlyJS."""
    seen, out, stack = set(), [], [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, PlotlyJS):  # the kernel's one (`PlotlyJS.shared()`), in every Explorer: not this one's
            continue
        if isinstance(obj, widgets.Widget):
            out.append(obj)
            stack += [getattr(obj, k, None) for k in obj.keys]
            if obj is not root and not type(obj).__module__.startswith("kimi_explore"):
                continue
            stack += list(vars(obj).values())
        elif isinstance(obj, (list, tuple)):
            stack += list(obj)
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif type(obj).__module__.startswith("kimi_explore.views") and hasattr(obj, "__dict__"):
            stack += list(vars(obj).values())
    return out
