"""What a hook sees and returns at one site: `HookPoint` (the site and token), `HookHandle` (one attached
hook), `check_replacement` (the rule a returned value must meet), and `HookChain` (several hook sets
fired one after another). `Hooks` (hooks.py) attaches and fires them.
"""

from __future__ import annotations

import fnmatch
import functools

from ..backend import on_host
from ..model.sites import site_table
from ._hook_grammar import LAYER_NAME, is_glob

__all__ = ["MOE_OUTPUT_SITES", "RESHAPE_OK", "ROUTE_SITES", "SEQUENTIAL_SITES", "HookChain", "HookHandle", "HookPoint",
           "check_replacement"]

# Sites whose replacement may legitimately change shape (routing with fewer / other experts).
RESHAPE_OK = ("moe.router.topk_ids", "moe.router.topk_weights")
# Sites whose chunked form cannot honour a changed value (the recurrence reads them token by token):
# a hook there makes its layer run token by token on the sequence path.
SEQUENTIAL_SITES = ("kda.conv", "kda.state")
# the sites whose value a Recorder keeps by reference until the token ends (their norms are taken then)
MOE_OUTPUT_SITES = ("moe.routed_out", "moe.shared_out")
KEPT_SITES = (*SEQUENTIAL_SITES, *MOE_OUTPUT_SITES)
# Sites whose full record changes how a fed chunk is computed (so a replay must keep them too): the recurrent ones run
# their layer token by token; MLA's probabilities are then fired whole (the scores in one block, not by query blocks).
ROUTE_SITES = (*SEQUENTIAL_SITES, "mla.probs")


class HookPoint:
    """What a hook function learns about the site it runs at.

    name:  the full site name, e.g. "layers.3.kda.state"
    layer: the 0-based model layer (int), or None for "embed", "final.*", "logits"
    kind:  the name without its "layers.{i}." prefix, e.g. "kda.state" (for globals: the name)
    position: the 0-based index of the token being decoded (see module docstring); None while a
              chunk-aware hook gets a whole chunk
    token_id: that token's id when the driver told (`Hooks.begin_token`), else None
    positions: on the sequence path, the positions [T] (int array) of the chunk a chunk-aware hook
              gets; None in the token form, and for one token of a chunk (a layer run token by token)
    max_sources: the model's block-residual source columns (`Trace.source_labels()`: the stored blocks,
              then the current sum) when the Hooks was bound to the weights (`Hooks.bind`), else None
    """

    __slots__ = ("name", "layer", "kind", "_owner")

    def __init__(self, name: str, owner=None):
        self.name = name
        m = LAYER_NAME.match(name)
        self.layer = int(m.group(1)) if m else None
        self.kind = m.group(2) if m else name
        self._owner = owner

    @property
    def position(self) -> int | None:
        return None if self._owner is None else self._owner.position

    @property
    def token_id(self) -> int | None:
        return None if self._owner is None else self._owner.token_id

    @property
    def positions(self):
        o = self._owner  # a layer run token by token inside a chunk: one token (its position set), no positions
        return None if o is None or o.position is not None else o.positions

    @property
    def max_sources(self) -> int | None:
        return None if self._owner is None else getattr(self._owner, "max_sources", None)

    def __repr__(self) -> str:
        return f"HookPoint({self.name!r}, layer={self.layer}, kind={self.kind!r})"


class HookHandle:
    """Returned by `Hooks.add`; `handle.remove()` detaches exactly that hook."""

    __slots__ = ("hooks", "pattern", "names_filter", "fn", "chunks")

    def __init__(self, hooks, pattern: str | None, names_filter, fn, chunks: bool = False):
        self.hooks, self.pattern, self.names_filter, self.fn, self.chunks = hooks, pattern, names_filter, fn, chunks

    def matches(self, name: str) -> bool:
        if self.names_filter is not None:
            return bool(self.names_filter(name))
        if is_glob(self.pattern):
            return fnmatch.fnmatchcase(name, self.pattern)
        return name == self.pattern

    def remove(self) -> None:
        self.hooks.remove(self)

    def describe(self) -> str:
        what = f"names_filter={self.names_filter!r}" if self.names_filter is not None else repr(self.pattern)
        return f"{what} -> {getattr(self.fn, '__qualname__', self.fn)!r}"

    def __repr__(self) -> str:
        return f"HookHandle({self.describe()})"


def _acts_at(hook_set, name: str) -> bool:
    """Whether a hook set may change the value at `name` (a set that cannot say: it may)."""
    acts = getattr(hook_set, "acts_at", None)
    return acts is None or acts(name)


class HookChain:
    """Several hook sets fired one after another at each site (e.g. interventions, then a Recorder).

    Each set sees the value the previous one returned; `begin_token` is forwarded to all.
    """

    def __init__(self, *hook_sets):
        self.hook_sets = [h for h in hook_sets if h is not None]
        # whether a set before set i may keep a reference to a value (a Recorder, until the token ends)
        self._keeper_before = [any(hasattr(h, "keep_value") for h in self.hook_sets[:i]) for i in range(len(self.hook_sets))]

    def fire(self, name: str, value):
        for i, h in enumerate(self.hook_sets):
            if self._keeper_before[i] and name.endswith(KEPT_SITES) and _acts_at(h, name):
                self.keep_value(name, self.hook_sets[:i])  # h may edit it in place, or replace it (the decoder
            value = h.fire(name, value)                    # then copies a kda value into the live buffer)
        return value

    def keep_value(self, name: str, sets=None) -> None:
        """A later set is about to run at `name` (`KEPT_SITES`): each set before it that kept a reference there (a
        Recorder's norms, taken when the token ends) keeps a copy of what it saw, which the later set may edit in
        place or replace (the decoder copies a replaced kda.conv / kda.state into the live buffer)."""
        for h in self.hook_sets if sets is None else sets:
            keep = getattr(h, "keep_value", None)
            if keep is not None:
                keep(name)

    def listening_sites(self, names: dict) -> dict:
        """`model.sites.site_table` for the chain: the sites any of its sets listens to, each fired through
        the whole chain (every set skips what it does not listen to)."""
        tables = [site_table(h, names) for h in self.hook_sets]
        return {kind: functools.partial(self.fire, name) for kind, name in names.items() if any(kind in t for t in tables)}

    def begin_token(self, token_id=None, position=None) -> None:
        for h in self.hook_sets:
            h.begin_token(token_id, position)

    def default_token(self, token_id, position) -> None:
        for h in self.hook_sets:
            default = getattr(h, "default_token", None)
            if default is not None:
                default(token_id, position)

    def start_token(self, token_id=None, position=None) -> None:
        for h in self.hook_sets:
            h.start_token(token_id, position)

    def bind(self, weights) -> HookChain:
        for h in self.hook_sets:
            h.bind(weights)
        return self

    def records_mark(self) -> tuple:
        return tuple(getattr(h, "records_mark", lambda: None)() for h in self.hook_sets)

    def discard_since(self, marks: tuple) -> None:
        for h, mark in zip(self.hook_sets, marks, strict=True):
            if mark is not None:
                h.discard_since(mark)

    def begin_chunk(self, token_ids, positions) -> None:
        for h in self.hook_sets:
            h.begin_chunk(token_ids, positions)

    def token_in_chunk(self, t: int) -> None:
        for h in self.hook_sets:
            h.token_in_chunk(t)

    def end_chunk(self) -> None:
        for h in self.hook_sets:
            h.end_chunk()

    def needs_tokens(self, names) -> bool:
        return any(h.needs_tokens(names) for h in self.hook_sets)

    def fire_chunk(self, name: str, value):
        for h in self.hook_sets:
            value = h.fire_chunk(name, value)
        return value

    def listens_chunk(self, name: str) -> bool:
        return any(getattr(h, "listens_chunk", lambda n: True)(name) for h in self.hook_sets)

    def observe_chunk(self, name: str, value) -> None:
        for h in self.hook_sets:
            h.observe_chunk(name, value)


def _on_gpu(a) -> bool:
    return not on_host(a)


def check_replacement(point: HookPoint, old, new, fn, chunk: bool = False) -> None:
    shape = getattr(new, "shape", None)
    if shape is None:
        raise TypeError(f"hook {getattr(fn, '__qualname__', fn)!r} at {point.name!r} returned {type(new).__name__}; "
                        "return an array (or None to keep the value)")
    if _on_gpu(new) != _on_gpu(old):
        where = {True: "a CuPy (GPU) array", False: "a host array"}
        raise TypeError(f"hook {getattr(fn, '__qualname__', fn)!r} at {point.name!r} returned {where[_on_gpu(new)]}, but "
                        f"this site's value is {where[_on_gpu(old)]}: return it where the value lives "
                        "(cupy.asarray(...) on a GPU, cupy.asnumpy(...) on the host)")
    if chunk and (len(shape) != len(old.shape) or shape[0] != old.shape[0]):
        raise ValueError(f"hook {getattr(fn, '__qualname__', fn)!r} at {point.name!r} returned shape {tuple(shape)} for a "
                         f"chunk of {old.shape[0]} tokens; it needs the chunk's leading axis and shape {tuple(old.shape)}")
    if point.kind not in RESHAPE_OK and shape != old.shape:
        raise ValueError(f"hook {getattr(fn, '__qualname__', fn)!r} at {point.name!r} returned shape {tuple(shape)}; "
                         f"this site needs shape {tuple(old.shape)}")
    if getattr(new, "dtype", None) != old.dtype:  # float64 logits broke the session's own file, complex lost its imaginary part
        raise TypeError(f"hook {getattr(fn, '__qualname__', fn)!r} at {point.name!r} returned dtype "
                        f"{getattr(new, 'dtype', type(new).__name__)}; this site's value is {old.dtype}: return "
                        f"value.astype({str(old.dtype)!r}) (a NumPy float64 scalar times a float32 array gives float64)")
