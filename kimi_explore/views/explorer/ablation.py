"""The Explorer's ablation: fork the session, re-decode without some experts, KDA heads or block-residual
sources, compare.

`rerun(session, *hooks, start, stop)` is the general tool: a fork truncated to its first `start`
tokens that decodes tokens[start:stop] again with the hooks attached; the session itself is never
touched. The control shows both next-token distributions and their KL, and says why when the
answer is trivially "nothing changed" (experts the token did not choose). Its result is cleared as
soon as it no longer matches what is selected (another token, layer, entry or history).

A token in the range decoded under hooks (`Session.decoded_with_hooks`) is re-decoded under the hooks the
session holds now (`session.hooks`, which the fork copies): where that gives its stored logits (bit for
bit where it was stepped; to float32 rounding where it was fed in a chunk) those hooks are the ones it was
decoded under, and the ablation goes on. Otherwise (a `with s.intervene(...)` in another cell, hooks
removed or added since) it is refused: the fork would re-decode it under other hooks, and the comparison
would mix undoing them into the ablation (tokens before the range are fine: the fork starts from the
exact state after them). A token decoded without hooks while the session holds hooks now (they were added
since) is refused too, before any re-decode: the fork would decode it under them.
"""

from __future__ import annotations

import html

import ipywidgets as widgets

from ...analysis._replay import replay_mismatch  # the analyses' replay check: one rule for both
from ...backend import to_numpy
from ...cli import parse_ids
from ...inspection import interventions
from ...inspection.source_masks import check_family, source_columns
from ...model.kimi_decoder import hook_names
from . import specs_analysis, specs_moe
from .history import window_routing
from .plotly_view import PlotView

__all__ = ["SCOPES", "Ablation", "baseline", "parse_experts", "parse_ids", "parse_layers", "parse_sources", "rerun",
           "rerun_token"]


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


def rerun(session, *hook_sets, start: int = 0, stop: int | None = None, stepped: bool = False):
    """A fork of `session` that decodes tokens[start:stop] again with `hook_sets` attached.

    The fork is truncated exactly to its first `start` tokens (see `Session.truncate`), so its
    trace and logits answer "what would the model have done from there under this intervention";
    `session` itself is never touched. Returns the fork (a Session with tokens[:stop]).
    The tokens are stepped one by one when hooks are attached (`Session.feed` does so for hooks that
    may change values) or `stepped` is set; else fed as one chunk.
    """
    n = len(session)
    stop = n if stop is None else stop
    if not 0 <= start < stop <= n:
        raise IndexError(f"rerun: need 0 <= start < stop <= {n} (the session's history), got start={start}, stop={stop}")
    fork = session.fork()
    fork.truncate(start)
    with fork.intervene(*hook_sets):
        if stepped:
            for tok in session.tokens[start:stop]:
                fork.step(tok)
        else:
            fork.feed(session.tokens[start:stop])
    return fork


def baseline(session, start: int, stop: int):
    """What an intervened `rerun(session, hooks, start=start, stop=stop)` is compared with: the session
    itself when it stepped tokens[start:stop] as the fork does, else those tokens re-decoded token by
    token without hooks. A fed chunk and stepped tokens differ by the rounding of the two routes, and a
    deep model amplifies it (at K3 depth it flips near-tied experts and top-1s: hundreds of routing
    changes and KL ~1 nat over 20 tokens that no intervention caused)."""
    if all(b is None for _, b in session.runs(start, stop)):
        return session
    return rerun(session, start=start, stop=stop, stepped=True)


def rerun_token(session, t: int, *hook_sets):
    """Logits [vocab] of token t decoded again, with `hook_sets` attached, on a fork (see `rerun`)."""
    return rerun(session, *hook_sets, start=t, stop=t + 1).logits[-1]


SCOPES = ("this token", "from this token on", "all tokens")
WHAT = ("experts", "KDA heads", "block sources")
PLACEHOLDERS = {"experts": "chosen | all | 3,7", "KDA heads": "head ids: 0 | 1,3",
                "block sources": "[attn: | ffn:] embedding | older_blocks | latest_block | current | blocks | block 2"}


def parse_sources(text: str) -> tuple[str, object]:
    """The sources field: '[attn:|ffn:] family' -> (site, family) for `interventions.mask_sources`; the site
    defaults to both mixes of a layer; a family is a name of `source_masks` or 'block j' (sealed block j)."""
    text = text.strip().lower()
    site = "both"
    if ":" in text:
        site, _, text = (part.strip() for part in text.partition(":"))
        if site not in ("attn", "ffn"):
            raise ValueError(f"sources: the site before ':' must be 'attn' or 'ffn', got {site!r}")
    if text.startswith("block ") and text[6:].strip().isdigit():
        return site, ("block", int(text[6:]))
    check_family(text)
    return site, text


def parse_layers(text: str, selected: int, candidates: list[int]) -> list[int]:
    """The layers field: 'this' (the selected layer), 'all' (every candidate), ids '3, 7' or a range '4-9'."""
    text = text.strip().lower()
    if text in ("", "this"):
        return [selected]
    if text == "all":
        return list(candidates)
    if "-" in text and "," not in text:
        a, _, b = text.partition("-")
        try:
            lo, hi = int(a), int(b)
        except ValueError:
            raise ValueError(f"layers: {text!r} is not a range like '4-9'; or type 'this' or 'all'") from None
        layers = [i for i in candidates if lo <= i <= hi]
    else:
        try:
            layers = parse_ids(text, "layers")
        except ValueError as e:
            raise ValueError(f"{e}; or type 'this' or 'all'") from None
    bad = [i for i in layers if i not in candidates]
    if bad or not layers:
        raise ValueError(f"layers {bad or text!r}: pick among {candidates}")
    return layers


class Ablation:
    """The control under the Predictions tab: what to ablate (experts, or KDA heads), at which layers and
    positions; the two next-token distributions of the selected token; and the run diff of the fork."""

    def __init__(self, ex):
        self.ex = ex
        self.what = widgets.Dropdown(options=WHAT, value="experts", layout=widgets.Layout(width="130px"))
        self.experts = widgets.Text(value="chosen", description="ids", placeholder=PLACEHOLDERS["experts"],
                                    layout=widgets.Layout(width="170px"), style={"description_width": "24px"})
        self.layers = widgets.Text(value="this", description="layers", placeholder="this | all | 3,7 | 4-9",
                                   layout=widgets.Layout(width="170px"), style={"description_width": "44px"})
        self.scope = widgets.Dropdown(options=SCOPES, value=SCOPES[0], layout=widgets.Layout(width="150px"))
        self.button = widgets.Button(description="Ablate & compare", icon="scissors", layout=widgets.Layout(width="auto"),
                                     tooltip="fork the session and re-decode without these experts / heads")
        self.note = widgets.HTML(layout=widgets.Layout(min_height="22px"))
        self.view = PlotView(height=300, name="ablation", layout=widgets.Layout(width="100%"))
        self.diff_view = PlotView(height=300, name="ablation_diff", layout=widgets.Layout(width="100%"))
        # an error is shown in the note and the status line (`Explorer._busy`), not lost in ipywidgets' log
        self.button.on_click(lambda _: ex._busy(self.run, "Ablate & compare", lambda m: self._say(m, error=True)))
        for w in (self.experts, self.layers, self.scope, self.what):
            w.observe(lambda _: self.clear(), names="value")
        self.what.observe(self._what_changed, names="value")
        self.widget = widgets.VBox([
            widgets.HTML("<b>Ablation</b> on a fork (the session is never touched): experts ('chosen' = those the "
                         "selected token was routed to, 'all', or ids), KDA heads (ids) or a block-residual source "
                         "family (masked, the softmax renormalised over the rest; 'attn:' or 'ffn:' picks one mix), "
                         "at the selected layer or several, at this token, from it on, or at every token."),
            widgets.HBox([self.what, self.experts, self.layers]), widgets.HBox([self.scope, self.button]),
            self.note, self.view], layout=widgets.Layout(width="58%"))

    def _what_changed(self, change) -> None:
        self.experts.value = {"experts": "chosen", "KDA heads": "0", "block sources": "current"}[change["new"]]
        self.experts.placeholder = PLACEHOLDERS[change["new"]]

    def clear(self) -> None:
        """Drop the shown result: it belongs to another token, layer, entry or history."""
        self.view.clear()
        self.diff_view.clear()
        self.note.value = ""

    def _say(self, message: str, error: bool = False) -> None:
        self.view.clear()
        self.diff_view.clear()
        style = "color:#b00" if error else "color:#555"
        self.note.value = f"<span style='{style}'>{html.escape(message, quote=False)}</span>"

    def _hooks(self, t: int, layer: int):
        """(hook sets, what they do in words, experts chosen at the selected layer or None, a note for the status:
        '' or '; ...')."""
        ex, cfg = self.ex, self.ex.session.weights.config
        if self.what.value == "block sources":
            layers = parse_layers(self.layers.value, layer, list(ex.session.weights.layer_ids))
            site, family = parse_sources(self.experts.value)
            # layer 0 has no mix before attention (its attention reads the embedding alone): that site is
            # left out, as `source_ablation` leaves it out, instead of a hook the session refuses
            known = set(hook_names(ex.session.weights))
            sites = ("attn", "ffn") if site == "both" else (site,)
            at = {x: [i for i in layers if f"layers.{i}.attn_res.{x}.weights" in known] for x in sites}
            if self.layers.value.strip().lower() == "all":  # as mask_sources("all"): a mix of the current sum alone
                one = ex.trace(window=slice(t, t + 1))  # (a subset's layers before its first push) mixes nothing
                at = {x: [i for i in ls if one[f"layers.{i}.attn_res.{x}.weights"].shape[-1] > 1] for x, ls in at.items()}
            if not any(at.values()):
                raise ValueError(f"layers {layers} have no {site} mix (layer 0's attention reads the embedding "
                                 "alone): pick 'ffn:' or a later layer")
            where = "" if site == "both" else f" ({site} mix)"
            name = f"block {family[1]}" if isinstance(family, tuple) else family
            note = self._sources_absent(t, family, name, at)
            hooks = [interventions.mask_sources(at[x], x, family, self._positions(t)) for x in sites if at[x]]
            return hooks, f"source {name}{where} at {layers}", None, note
        if self.what.value == "KDA heads":
            if not ex.kda_layers:
                raise ValueError("no KDA layer is loaded")
            if layer not in ex.kda_layers and self.layers.value.strip().lower() in ("", "this"):
                raise ValueError(f"layer {layer} is an MLA layer, no KDA heads: pick a KDA layer")
            layers = parse_layers(self.layers.value, layer, ex.kda_layers)
            heads = parse_ids(self.experts.value, "heads")
            H = cfg.linear_attn_config.num_heads
            bad = [h for h in heads if not 0 <= h < H]
            if bad:
                raise ValueError(f"heads {bad} do not exist: KDA heads run 0..{H - 1}")
            return [interventions.zero_kda_head(layers, heads, self._positions(t))], f"KDA heads {heads} at {layers}", None, ""
        if layer not in ex.moe_layers and self.layers.value.strip().lower() in ("", "this"):
            raise ValueError(f"layer {layer} has a dense FFN, no experts: pick an MoE layer")
        layers = parse_layers(self.layers.value, layer, ex.moe_layers)
        r = window_routing(ex, t, t + 1)  # token t alone
        chosen_at = {i: [int(e) for e in r["topk_ids"][0, r["moe_layers"].index(i)] if e >= 0] for i in layers}
        if self.experts.value.strip().lower() in ("chosen", "topk", "top-k", ""):  # each layer's own choice at t
            hooks = [interventions.ablate_experts(i, chosen_at[i], self._positions(t)) for i in layers]
            what = f"the experts token {t} chose" + (f" at {layers}" if len(layers) > 1 else "")
            return hooks, what, chosen_at.get(layer), ""
        experts = parse_experts(self.experts.value, [], cfg.num_experts)
        name = "routed experts" if experts == "all" else f"experts {experts}"
        return [interventions.ablate_experts(layers, experts, self._positions(t))], f"{name} at {layers}", experts, ""

    def _sources_absent(self, t: int, family, name: str, at: dict) -> str:
        """'' or a note naming the chosen mixes that do not read the source family (a block not sealed yet
        there). Raises when no chosen mix reads it (the ablation would change nothing: KL 0, unexplained), or
        when a mask would leave a mix no source. at: {site: the chosen layers whose mix at that site exists}."""
        one = self.ex.trace(window=slice(t, t + 1))
        labels = one.source_labels()
        if isinstance(family, tuple) and family[1] >= len(labels) - 1:
            raise ValueError(f"{name} does not exist: the sources are {labels}")
        absent, full = [], []
        for i, x in sorted((i, x) for x, layers in at.items() for i in layers):  # in layer order, attn before ffn
            n = one[f"layers.{i}.attn_res.{x}.weights"].shape[-1]  # a weight per source the mix reads
            cols = source_columns(family, n)
            if not cols:
                absent.append(f"layer {i} {x}")
            if len(cols) == n:
                full.append(f"layer {i} {x}")
        if full:
            raise ValueError(f"masking {name} would leave no source at {', '.join(full)}: pick another family or layer")
        if absent and len(absent) == sum(len(layers) for layers in at.values()):
            raise ValueError(f"{name} is not read by the chosen mixes ({', '.join(absent)}: not sealed yet there), so "
                             "masking it would change nothing: pick a later layer")
        return f"; {name} is not read at {', '.join(absent)} (not sealed yet there): nothing masked there" if absent else ""

    def _positions(self, t: int):
        return {SCOPES[0]: t, SCOPES[1]: list(range(t, len(self.ex.session))), SCOPES[2]: None}[self.scope.value]

    def run(self):
        ex = self.ex
        ex.sync()  # a history changed outside the Explorer: its views, and the token chosen below, are redone first
        s, n = ex.session, len(ex.session)
        if not n:
            return self._say("step at least one token first")
        t, layer = min(ex.token.value, n - 1), ex.layer.value
        try:
            hooks, what, listed, why = self._hooks(t, layer)
        except ValueError as e:
            return self._say(str(e), error=True)
        start = 0 if self.scope.value == SCOPES[2] else t
        stop = t + 1 if self.scope.value == SCOPES[0] else n
        if len(s.hooks):  # decoded before the session's hooks were added: the fork re-decodes them under those hooks
            added = [u for u in range(start, stop) if not s.decoded_with_hooks(u)]
            if added:
                return self._say(f"cannot ablate: {_tokens_named(added)} {'was' if len(added) == 1 else 'were'} decoded "
                                 "before the hooks the session holds now were added: the fork would re-decode "
                                 f"{'it' if len(added) == 1 else 'them'} under session.hooks, and 'as run' against "
                                 "'ablated' would mix those hooks' effect into the ablation. Pick a token and scope that "
                                 "cover no such token, or decode the history again under the hooks (e.g. a fresh "
                                 "Session(weights, hooks=...) fed session.tokens)", error=True)
        base = baseline(s, start, stop)  # decoded as the fork will be: the differences are the ablation's alone
        unrepeated = _unrepeated(s, base, start, stop)
        if unrepeated:  # the fork would re-decode them under other hooks: 'as run' vs 'ablated' would mix in undoing them
            one = len(unrepeated) == 1
            return self._say(f"cannot ablate: {_tokens_named(unrepeated)} {'was' if one else 'were'} decoded under hooks "
                             "the session does not hold now (an intervention in another cell, or hooks removed or added "
                             f"since): the fork would re-decode {'it' if one else 'them'} under session.hooks, and 'as "
                             "run' against 'ablated' would mix undoing them into the ablation. Pick a token and scope "
                             "that cover no such token, or ablate on a fork you decode under the same hooks yourself",
                             error=True)
        fork = rerun(s, *hooks, start=start, stop=stop)  # stepped: the hooks change values
        ablated = fork.logits[t]
        label = ex.labels()[t]
        data, layout, kl = specs_moe.compare(base.logits_at(t), ablated, ex.tokenizer, names=("as run", "ablated"),
                                             title=f"Next token after {label}: without {what}")
        self.view.show(data, layout, ex.tab_views.rev)
        from ...analysis.diff import diff

        self.diff_view.show(*specs_analysis.run_diff(diff(base, fork), start, ex.tokenizer, t), ex.tab_views.rev)
        if self.what.value == "experts" and listed is not None and listed != "all" and self.scope.value == SCOPES[0]:
            r = window_routing(ex, t, t + 1)
            chosen = [int(e) for e in r["topk_ids"][0, r["moe_layers"].index(layer)] if e >= 0] \
                if layer in ex.moe_layers else []
            missed = [e for e in listed if e not in chosen]
            if missed and len(missed) == len(listed) and self.layers.value.strip().lower() in ("", "this"):
                why = (f"; token {t} did not choose {missed} at layer {layer} (it chose {chosen}), so removing them "
                       "changes nothing: KL = 0")
            elif missed and self.layers.value.strip().lower() in ("", "this"):
                why = (f"; {missed} were not chosen by this token at layer {layer}: only "
                       f"{sorted(set(listed) - set(missed))} matter")
        if base is not s:
            fed = ", ".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in s.runs(start, stop) if b is not None)
            why += (f"; 'as run' is tokens {start}-{stop - 1} re-decoded one by one as the fork was (the session fed "
                    f"tokens {fed} as a chunk, which rounds differently"
                    + (", and the tokens stepped after it read that rounding" if _stepped_after_chunk(s, start, stop)
                       else "") + ")")
        self.note.value = html.escape(f"forked at token {start}; the main session still has {n} tokens; "
                                      f"KL at token {t} {kl:.4g}{why}", quote=False)
        return ablated


def _unrepeated(session, base, start: int, stop: int) -> list[int]:
    """The tokens in start..stop-1 decoded under hooks (`Session.decoded_with_hooks`) that the session's hooks now do
    not repeat: re-decoded token by token under them (`base`, or a fresh re-decode where `base` is the session) they
    give other logits than the session stored (bit for bit where the session stepped the token, as the re-decode does;
    within `REPLAY_RTOL` of the logits' scale where it fed it in a chunk, which rounds differently)."""
    hooked = [u for u in range(start, stop) if session.decoded_with_hooks(u)]
    if not hooked:
        return []
    replay = rerun(session, start=start, stop=stop, stepped=True) if base is session else base
    fed = {u for a, b in session.runs(start, stop) if b is not None for u in range(a, b)}
    return [u for u in hooked if replay_mismatch(to_numpy(replay.logits_at(u)), to_numpy(session.logits_at(u)),
                                                 exact=u not in fed) is not None]


def _tokens_named(tokens: list[int], most: int = 8) -> str:
    """'token 8', 'tokens 3-5, 9', ... (runs of consecutive positions; at most `most` runs named)."""
    runs: list[list[int]] = []
    for u in tokens:
        if runs and u == runs[-1][1] + 1:
            runs[-1][1] = u
        else:
            runs.append([u, u])
    names = [f"{a}-{b}" if b > a else str(a) for a, b in runs]
    more = f" and {len(names) - most} more runs" if len(names) > most else ""
    return ("token " if len(tokens) == 1 else "tokens ") + ", ".join(names[:most]) + more


def _stepped_after_chunk(session, start: int, stop: int) -> bool:
    """Whether a token of [start, stop) was stepped after a fed chunk of that range."""
    seen_chunk = False
    for _, b in session.runs(start, stop):
        if b is not None:
            seen_chunk = True
        elif seen_chunk:
            return True
    return False
