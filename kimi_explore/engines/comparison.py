"""`Comparison`: what `ke.compare` found, site by site and token by token.

    cmp.first        the earliest divergence (token first, then firing order), a `Divergence`, or None
    cmp.divergences  every (site, first diverging token) beyond tolerance, in that order
    cmp.local_sites  the sites whose own operation disagrees (on the other engine's inputs)
    cmp.suspects     every site whose own operation is off by more than one operation's rounding
                     (`Tolerance.local_rtol`), at its first such token, in that order, whether or not the
                     site itself is beyond tolerance: where `first` is inherited, the earliest suspect is
                     where to look (a 1e-3 bug crosses rtol only layers later)
    cmp.table()      one dict per compared site (firing order): max |delta|, worst relative error, the
                     first diverging token, local or inherited, the operation, what a probe found
    cmp.to_pandas()  the same as a DataFrame (pandas: the `[notebook]` extra)
    cmp.heatmap()    the layer x site view (`views.figures.engine_plots.divergence_heatmap`); value="local_rel"
                     shows the teacher-forced errors

A site is *local* at token t when it diverges there and kimi_explore's operation, run on the other
engine's inputs (everything upstream patched in through the hooks, `patching.replay`), still disagrees
with the other engine at t beyond tolerance; otherwise its divergence is *inherited* from upstream. A
site that agrees at t is not local there, whatever the replay gives: its values need no explanation,
and the replay only disagrees because an input the other engine dumped is not the one it used (a
state written transposed made the agreeing `kda.o` read it as "the operation differs").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .operations import operation_of
from .tolerance import IDS_SITE, Tolerance, beyond

__all__ = ["AXES", "Comparison", "Divergence", "SiteComparison", "location"]


@dataclass(frozen=True)
class Divergence:
    """One diverging site at one token.

    token: 0-based position; layer: 0-based layer, None for a global site ("embed", "final.*",
    "logits"); site: the kimi_explore hook name; local: the operation itself disagrees (True) or
    the site inherits differences from upstream (False), None when not tested; operation: what
    kimi_explore computes there (every operation since the last site the dump has, where the sites
    between are missing; a probe's name when a probe explains it); max_abs, rel: the error
    at that token; local_rel: the error of kimi_explore's operation on the other engine's inputs;
    explanation: what a probe found ("other engine matches eps 1e-05"), or "". diverges: False for a
    suspect within tolerance (`Comparison.suspects`). where: the entry whose error against its scale is rel ("head 2,
    channel 17"; a per-head site's scale is its head's, so not always where max_abs is); over of size: how many
    entries are beyond rtol (top-k ids: how many ids differ, of k); local_where: the worst entry of kimi_explore's
    operation on the other engine's inputs (where local_rel is); suspect: local_rel is beyond `Tolerance.local_rtol`.
    """

    token: int
    layer: int | None
    site: str
    local: bool | None
    operation: str
    max_abs: float
    rel: float
    local_rel: float | None = None
    explanation: str = ""
    diverges: bool = True
    where: str = ""
    over: int | None = None
    size: int | None = None
    local_where: str = ""
    suspect: bool = False

    @property
    def verdict(self) -> str:
        """"local", "inherited" or "local/inherited not tested"."""
        return {True: "local", False: "inherited", None: "local/inherited not tested"}[self.local]

    def __str__(self) -> str:
        where = f"layer {self.layer}" if self.layer is not None else "global"
        how = self.verdict if self.diverges else "within tolerance"
        if self.local_rel is not None and (self.local or not self.diverges or self.suspect):
            how += f", its own operation {self.local_rel:.3g} off on the other engine's inputs"
            how += f" at {self.local_where}" if self.local_where and self.local_where != self.where else ""
        detail = f"rel {self.rel:.3g}" + (f" at {self.where}" if self.where else "")
        if self.diverges and self.over is not None and self.size:
            detail += f"; {self.over} of {self.size} {'ids differ' if self.site.endswith(IDS_SITE) else 'entries beyond rtol'}"
        text = (f"token {self.token}, {where}, {self.site}: max|delta| {self.max_abs:.3g} ({detail}), {how}; "
                f"operation: {self.operation}")
        return text + (f"; {self.explanation}" if self.explanation else "")


@dataclass
class SiteComparison:
    """One site over the compared tokens, one row each: row i is position `start` + i (`Comparison.start`: the other
    engine's first captured token). Arrays per row: max_abs, rel; local_rel (None when not tested; the rows before
    local_from, whose operation reads state of tokens the other engine did not capture, are not tested: no verdict or
    suspect there, whatever the number). Methods take positions, as `Divergence.token` gives them."""

    site: str
    layer: int | None
    kind: str
    max_abs: np.ndarray
    rel: np.ndarray
    local_rel: np.ndarray | None = None
    operation: str = ""
    explanation: str = ""
    shape: tuple = ()  # one token's value, as AXES names it (kda.conv: [3, H, K, W], the window's channels by head)
    worst: np.ndarray | None = None  # per row: flat index of the worst entry (`tolerance.SiteErrors`), -1: none
    over: np.ndarray | None = None  # per row: entries beyond rtol (top-k ids: ids that differ)
    local_worst: np.ndarray | None = None  # per row: the worst entry of kimi_explore's operation on the other engine's inputs
    experts: list | None = None  # top-k weights compared by expert: per row the experts of the entries, ascending
    local_experts: list | None = None  # the same in the teacher-forced replay (the other engine's ids)
    local_from: int = 0  # the first row whose teacher-forced test holds
    start: int = 0  # the position of row 0

    def row(self, position: int) -> int:
        """The row of `position` (refused outside the compared positions)."""
        i = int(position) - self.start
        if not 0 <= i < len(self.rel):
            raise IndexError(f"{self.site}: position {position} was not compared (positions {self.start}.."
                             f"{self.start + len(self.rel) - 1})")
        return i

    def where(self, position: int, local: bool = False) -> str:
        """The worst entry at `position` (of the teacher-forced replay: local=True, "" where not tested), named by the
        site's axes ("head 2, channel 17", "the weight of expert 5"), or "" (none differs; not recorded)."""
        i = self.row(position)
        worst, experts = (self.local_worst, self.local_experts) if local else (self.worst, self.experts)
        if worst is None or worst[i] < 0 or not self.shape or (local and i < self.local_from):
            return ""
        return location(self.kind, self.shape, int(worst[i]), None if experts is None else experts[i])

    def size(self, position: int) -> int | None:
        """How many entries the comparison at `position` has (top-k ids: k; top-k weights by expert: the experts either
        side selected; attention probabilities: the heads x the positions up to this one), None where unknown."""
        i = self.row(position)
        if self.experts is not None:
            return len(self.experts[i])
        if not self.shape:
            return None
        if self.kind.endswith(IDS_SITE):
            return self.shape[0]
        return int(np.prod(self.shape[:-1])) * (int(position) + 1) if self.kind == "mla.probs" else int(np.prod(self.shape))

    def beyond(self, rtol: float) -> np.ndarray:
        """Per row: the other engine's value is beyond tolerance (NaN counts as beyond; top-k ids at one id)."""
        return beyond(self.kind, self.rel, rtol)

    def _tested(self) -> np.ndarray:
        return np.arange(len(self.rel)) >= self.local_from

    def local_beyond(self, rtol: float) -> np.ndarray | None:
        """Per row: the site diverges, and kimi_explore's operation on the other engine's inputs is beyond
        tolerance too (None: not tested)."""
        if self.local_rel is None:
            return None
        return beyond(self.kind, self.local_rel, rtol) & self.beyond(rtol) & self._tested()

    def suspect(self, local_rtol: float) -> np.ndarray | None:
        """Per row: kimi_explore's operation on the other engine's inputs is beyond `local_rtol` (None: not tested)."""
        return None if self.local_rel is None else beyond(self.kind, self.local_rel, local_rtol) & self._tested()

    def tested_local_rel(self) -> np.ndarray | None:
        """local_rel of the rows tested (None: no replay)."""
        return None if self.local_rel is None else self.local_rel[self.local_from :]

    def is_local(self, rtol: float) -> bool | None:
        """The site's operation disagrees at some token where the site diverges (None: not tested)."""
        local = self.local_beyond(rtol)
        return None if local is None or self.local_from >= len(local) else bool(np.any(local))

    def local_at(self, position: int, rtol: float) -> bool | None:
        local, i = self.local_beyond(rtol), self.row(position)
        return None if local is None or i < self.local_from else bool(local[i])


@dataclass
class Comparison:
    """See the module docstring. `sites`: {name: SiteComparison} in firing order, their arrays [T - start]; `tokens`:
    the T ids; `prefill`: the first tokens replayed as one prefill (the sequence path), the rest stepped; `start`: the
    position of the other engine's first captured token (every token a Divergence or the table names is a position)."""

    sites: dict
    tolerance: Tolerance
    tokens: list
    engine: str = ""
    config: object = field(default=None, repr=False)
    prefill: int = 0
    start: int = 0

    @property
    def rtol(self) -> float:
        """The rtol of every site kind without a tolerance of its own (`rtol_of`)."""
        return self.tolerance.rtol

    def rtol_of(self, s: SiteComparison) -> float:
        """The rtol judging site `s` (its kind's, `Tolerance.for_kind`)."""
        return self.tolerance.for_kind(s.kind).rtol

    def _divergence(self, s: SiteComparison, t: int) -> Divergence:
        rtol = self.rtol_of(s)
        p, tested = self.start + t, s.local_rel is not None and t >= s.local_from
        suspect = tested and bool(s.suspect(self.tolerance.for_kind(s.kind).local_rtol)[t])
        return Divergence(p, s.layer, s.site, s.local_at(p, rtol), s.operation or operation_of(s.kind),
                          float(s.max_abs[t]), float(s.rel[t]), float(s.local_rel[t]) if tested else None,
                          s.explanation, bool(s.beyond(rtol)[t]), s.where(p), None if s.over is None else int(s.over[t]),
                          s.size(p), s.where(p, local=True), suspect)

    def _in_order(self, flags) -> list[Divergence]:
        """Each site at its first flagged token (`flags(site)`: [T] bool or None), ordered by (token, firing order)."""
        found = [(t, order, s) for order, s in enumerate(self.sites.values()) if (t := _first(flags(s))) is not None]
        return [self._divergence(s, t) for t, _, s in sorted(found, key=lambda x: x[:2])]

    @property
    def divergences(self) -> list[Divergence]:
        """Each diverging site at its first diverging token, ordered by (token, firing order)."""
        return self._in_order(lambda s: s.beyond(self.rtol_of(s)))

    @property
    def suspects(self) -> list[Divergence]:
        """Each site whose own operation, on the other engine's inputs, is beyond `tolerance.local_rtol` at some token
        (the site itself within tolerance or not), at its first such token, ordered by (token, firing order); empty
        where the teacher-forced replay did not run (compare(local=False))."""
        return self._in_order(lambda s: s.suspect(self.tolerance.for_kind(s.kind).local_rtol))

    @property
    def first(self) -> Divergence | None:
        d = self.divergences
        return d[0] if d else None

    @property
    def local_sites(self) -> list[str]:
        """Sites that diverge, with kimi_explore's operation on the other engine's inputs disagreeing, at some token."""
        return [s.site for s in self.sites.values() if s.is_local(self.rtol_of(s))]

    def table(self) -> list[dict]:
        rows = []
        for s in self.sites.values():
            tol = self.tolerance.for_kind(s.kind)
            bad = np.flatnonzero(s.beyond(tol.rtol))
            nan = np.flatnonzero(np.isnan(s.rel))  # a NaN is the worst error there is: never hidden by nan-max
            worst = int(nan[0]) if nan.size else int(np.argmax(s.rel))
            local = s.is_local(tol.rtol)
            rows.append({"site": s.site, "layer": s.layer, "kind": s.kind, "max_abs": float(np.max(s.max_abs)),
                         "rel": float(s.rel[worst]), "worst_token": self.start + worst,
                         "first_token": self.start + int(bad[0]) if bad.size else None, "diverges": bool(bad.size),
                         "local": local,
                         "local_rel": float(np.max(r)) if (r := s.tested_local_rel()) is not None and r.size else None,
                         "where": s.where(self.start + worst), "over": None if s.over is None else int(s.over[worst]),
                         "suspect_token": None if (u := _first(s.suspect(tol.local_rtol))) is None else self.start + u,
                         "rtol": tol.rtol,
                         "operation": s.operation or operation_of(s.kind), "explanation": s.explanation})
        return rows

    def to_pandas(self):
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("Comparison.to_pandas needs pandas: pip install 'kimi-explore[notebook]'") from None
        return pd.DataFrame(self.table())

    def heatmap(self, ax=None, value: str = "rel"):
        from ..views.figures.engine_plots import divergence_heatmap

        return divergence_heatmap(self, ax=ax, value=value)

    def __repr__(self) -> str:
        first, suspects = self.first, self.suspects
        what = "no site beyond tolerance" if first is None else f"first divergence: {first}"
        if suspects and (first is None or not first.local):
            what += f"; earliest suspect: {suspects[0]}"
        elif first is not None and first.local is False and not self.local_sites:
            what += ("; no site's own operation is off on the other engine's inputs (no local site, no suspect): what "
                     "diverges is drift inherited through the model")
        route = f" (the first {self.prefill} as one prefill)" if self.prefill else ""
        route += f", compared from position {self.start}" if self.start else ""
        return (f"Comparison({self.engine or 'other engine'}, {len(self.tokens)} tokens{route}, {len(self.sites)} sites, "
                f"tolerance {self.tolerance}; {what})")


# What each axis of a site's per-token value indexes (README "What each site holds"), by site kind.
AXES = {
    **dict.fromkeys(("embed", "attn.in", "attn.out", "ffn.in", "ffn.out", "prefix_sum", "mla.q_latent", "mla.kv_latent",
                     "moe.experts_out", "moe.routed_out", "moe.shared_out", "final.hidden"), ("channel",)),
    **dict.fromkeys(("attn_res.attn.weights", "attn_res.ffn.weights", "final.attn_res.weights"), ("source",)),
    "kda.conv": ("stream", "head", "channel", "tap"),  # (compare splits the window's channels by head)
    "kda.conv_out": ("stream", "head", "channel"),
    **dict.fromkeys(("kda.q", "kda.k", "kda.v", "kda.decay", "kda.gate", "kda.o", "mla.o"), ("head", "channel")),
    "kda.beta": ("head",),
    "kda.state": ("head", "k", "v"),
    "mla.probs": ("head", "position"),
    "moe.router.scores": ("expert",),
    "final.block_residual": ("block", "channel"),
    "logits": ("token id",),
}


def location(kind: str, shape: tuple, flat: int, experts=None) -> str:
    """Entry `flat` of a per-token value of `shape` at a site of `kind`, named by its axes: "head 2, channel 17",
    "k stream, head 0, channel 3"; a top-k weight by its expert where `experts` (the experts of the compared entries)
    is given, else by its rank (compared largest first); "index (1, 2)" for a kind without named axes."""
    if kind == "moe.router.topk_weights":
        return f"the weight of expert {int(experts[flat])}" if experts is not None else \
            f"the weight ranked {flat + 1} (largest first)"
    index = tuple(int(i) for i in np.unravel_index(flat, shape))
    axes = AXES.get(kind)
    if axes is None or len(axes) != len(index):
        return f"index {index}"
    return ", ".join(f"{'qkv'[i]} stream" if a == "stream" and i < 3 else f"{a} {i}" for a, i in zip(axes, index, strict=True))


def _first(flags) -> int | None:
    """The first token flagged in `flags` ([T] bool; None: not tested), or None."""
    hit = np.flatnonzero(flags) if flags is not None else ()
    return int(hit[0]) if len(hit) else None
