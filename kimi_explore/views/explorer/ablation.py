"""The Explorer's expert ablation: fork the session, re-decode the selected token without some experts.

`rerun(session, *hooks, start, stop)` is the general tool: a fork truncated to its first `start`
tokens that decodes tokens[start:stop] again with the hooks attached; the session itself is never
touched. The control shows both next-token distributions and their KL, and says why when the
answer is trivially "nothing changed" (experts the token did not choose). Its result is cleared as
soon as it no longer matches what is selected (another token, layer, entry or history).
"""

from __future__ import annotations

import html

import ipywidgets as widgets

from ...cli import parse_ids
from ...inspection import interventions
from . import specs_moe
from .plotly_view import PlotView

__all__ = ["Ablation", "parse_experts", "parse_ids", "rerun", "rerun_token"]


def parse_experts(text: str, chosen, n_experts: int | None = None) -> str | list[int]:
    """The ablation field: 'all', 'chosen' (this token's top-k at that layer) or expert ids like '3, 7'."""
    text = text.strip().lower()
    if text == "all":
        return "all"
    if text in ("chosen", "topk", "top-k", ""):
        return [int(e) for e in chosen if e >= 0]
    try:
        ids = parse_ids(text, "experts")
    except ValueError as e:
        raise ValueError(f"{e}; or type 'chosen' or 'all'") from None
    if n_experts is not None:
        bad = [e for e in ids if not 0 <= e < n_experts]
        if bad:
            raise ValueError(f"experts {bad[:5]} do not exist: expert ids run 0..{n_experts - 1}")
    return ids


def rerun(session, *hook_sets, start: int = 0, stop: int | None = None):
    """A fork of `session` that decodes tokens[start:stop] again with `hook_sets` attached.

    The fork is truncated exactly to its first `start` tokens (see `Session.truncate`), so its
    trace and logits answer "what would the model have done from there under this intervention";
    `session` itself is never touched. Returns the fork (a Session with tokens[:stop]).
    """
    n = len(session)
    stop = n if stop is None else stop
    if not 0 <= start < stop <= n:
        raise IndexError(f"rerun: need 0 <= start < stop <= {n} (the session's history), got start={start}, stop={stop}")
    fork = session.fork()
    fork.truncate(start)
    with fork.intervene(*hook_sets):
        fork.feed(session.tokens[start:stop])
    return fork


def rerun_token(session, t: int, *hook_sets):
    """Logits [vocab] of token t decoded again, with `hook_sets` attached, on a fork (see `rerun`)."""
    return rerun(session, *hook_sets, start=t, stop=t + 1).logits[-1]


class Ablation:
    """The control under the Predictions tab (entry, button, note, the two distributions)."""

    def __init__(self, ex):
        self.ex = ex
        self.experts = widgets.Text(value="chosen", description="experts", placeholder="chosen | all | 3,7",
                                    layout=widgets.Layout(width="250px"))
        self.button = widgets.Button(description="Ablate & compare", icon="scissors", layout=widgets.Layout(width="auto"),
                                     tooltip="fork the session and re-decode this token without these experts")
        self.note = widgets.HTML(layout=widgets.Layout(min_height="22px"))
        self.view = PlotView(height=300, name="ablation", layout=widgets.Layout(width="100%"))
        self.button.on_click(lambda _: self.run())
        self.experts.observe(lambda _: self.clear(), names="value")
        self.widget = widgets.VBox([
            widgets.HTML("<b>Expert ablation</b> at the selected layer and token: 'chosen' drops the experts this "
                         "token was routed to, 'all' every routed expert, or list expert ids."),
            widgets.HBox([self.experts, self.button]), self.note, self.view], layout=widgets.Layout(width="58%"))

    def clear(self) -> None:
        """Drop the shown result: it belongs to another token, layer, entry or history."""
        self.view.clear()
        self.note.value = ""

    def _say(self, message: str, error: bool = False) -> None:
        self.view.clear()
        style = "color:#b00" if error else "color:#555"
        self.note.value = f"<span style='{style}'>{html.escape(message, quote=False)}</span>"

    def run(self):
        ex = self.ex
        s, n = ex.session, len(ex.session)
        t, layer = min(ex.token.value, n - 1), ex.layer.value
        if not n:
            return self._say("step at least one token first")
        if layer not in ex.moe_layers:
            return self._say(f"layer {layer} has a dense FFN, no experts: pick an MoE layer", error=True)
        r = ex.trace().routing()
        chosen = [int(e) for e in r["topk_ids"][t, r["moe_layers"].index(layer)] if e >= 0]
        try:
            experts = parse_experts(self.experts.value, chosen, s.weights.config.num_experts)
        except ValueError as e:
            return self._say(str(e), error=True)
        ablated = rerun_token(s, t, interventions.ablate_experts(layer, experts, positions=t))
        label = ex.labels()[t]
        name = f"without experts {experts}" if experts != "all" else "without routed experts"
        data, layout, kl = specs_moe.compare(s.logits_at(t), ablated, ex.tokenizer, names=("as run", name),
                                               title=f"Next token after {label}: ablation at layer {layer}")
        self.view.show(data, layout, ex.tab_views.rev)
        missed = [] if experts == "all" else [e for e in experts if e not in chosen]
        why = ""
        if missed and len(missed) == len(experts):
            why = (f"; token {t} did not choose {missed} at layer {layer} (it chose {chosen}), so removing them "
                   "changes nothing: KL = 0")
        elif missed:
            why = f"; {missed} were not chosen by this token at layer {layer}: only {sorted(set(experts) - set(missed))} matter"
        self.note.value = html.escape(f"forked at token {t}; the main session still has {n} tokens; KL {kl:.4g}{why}",
                                      quote=False)
        return ablated

