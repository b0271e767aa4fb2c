"""Hook points: see and change the values flowing through `kimi_forward_token`, by name.

    hooks = Hooks()
    hooks.add("layers.*.moe.router.topk_ids", fn)         # exact name or fnmatch glob
    hooks.add(names_filter=lambda n: n.endswith(".weights"), fn=fn)
    with hooks.hooked("layers.3.kda.state", fn): ...      # removed again on exit
    logits = kimi_forward_token(weights, state, token_id, hooks=hooks)

A hook is `fn(value, *, hook) -> value | None` (TransformerLens's contract): `hook` is a `HookPoint`
(`.name`, `.layer`, `.kind`, `.position`); returning an array replaces the value downstream, None
keeps it.

The rule, for every site of `hook_names(weights)` (tests/test_hooks.py walks them all): a returned
value is what the rest of the forward pass reads, never dropped. Where the value is state, the state
keeps it (`kda.conv`: the window, which the short conv then reads; `kda.state`: the recurrent
matrix, which the read-out then reads); `final.block_residual` replaces the sealed blocks the output
mix reads; new `moe.router.topk_ids` (experts 0..E-1; in a whole chunk [T, k] a -1 drops that selection)
are re-weighted from the scores. A replacement must have the value's shape (only the routing sites may
change k, the weights keeping one per id), live where the value lives (host or GPU), and be an array:
anything else raises at once, naming the hook and the site. A hook may instead edit
the value in place and return None: the edited value is what the rest reads, on both paths (`embed`
hands hooks a copy of the embedding row, so an edit never reaches the table). Only while its site fires:
an array a hook keeps and edits when a later site fires (the decay at `kda.gate`, a running sum at
`final.block_residual`) may or may not reach the rest, and differently on the token and sequence paths
(the sequence path has read it already); return or edit a value at its own site, and keep copies.

Several hooks on one site run in the order they were added, each seeing the value the previous one
returned. The decoder calls `fire(name, value)` at every site of `hook_names(weights)`;
with `hooks=None` each site costs one `is None` check, and a site nobody listens to costs one dict
lookup here (the name -> functions resolution is cached and rebuilt only when hooks change).

Names are checked, because a typo would otherwise record or change nothing without a word:
`add` always checks a name or glob against the grammar of hook names (every suffix the decoder can
fire, at any layer); once bound to a model (`hooks.bind(weights)`, done by `Session`), it checks
against that model's exact list, so `layers.2.kda.q` on an MLA layer 2 is an error too. An unbound
Hooks also checks its exact names after the first full token and warns about any that never fired.

Token positions: `hook.position` is the 0-based index of the token being decoded: the decode state's
position (`kimi_forward_token` tells it and the token's id, `default_token`; the sequence path takes each
chunk's from the state too), unless the driver announced others with `begin_token(token_id, position)`
(Session does). Only where neither says (a forward assembled from `embed_token` ...) it counts the
`embed` sites this Hooks has seen.

Observers: `Hooks(observer=obj)` also runs, at each site and after every hook there, the functions
`obj.site_functions(name)` lists; each is called as `fn(value)` and cannot change the value. A
Recorder records this way, through a Hooks it holds; the functions may be C-level (`list.append`),
so a recorded site adds no Python frame. That is the token form's route: `fire_chunk` does not ask
the observer (a Recorder records whole chunks through its own `fire_chunk`, `chunk_records`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import numpy as np

from .._warnings import warn_at_caller
from .._xp import array_namespace
from ..model.kimi_decoder import hook_names
from ._hook_grammar import check_pattern, hook_grammar, is_glob
from .hook_sites import SEQUENTIAL_SITES, HookChain, HookHandle, HookPoint, check_replacement

__all__ = ["HookChain", "HookHandle", "HookPoint", "Hooks", "check_pattern", "hook_grammar", "hooks_expected", "is_glob"]


def _check_hook_signature(fn) -> None:
    """A hook is called fn(value, hook=HookPoint): refuse at add time one that cannot take that (e.g. `lambda v: ...`),
    rather than at the first site it fires, deep inside a decode."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an extension type: no signature to read
        return
    try:
        sig.bind(None, hook=None)
    except TypeError:
        raise TypeError(f"Hooks.add: fn {getattr(fn, '__qualname__', fn)!r}{sig} cannot be called as fn(value, hook=...): "
                        "a hook takes the value and a keyword `hook` (TransformerLens's contract), e.g. "
                        "`def fn(value, *, hook): ...`") from None


def hooks_expected(found) -> TypeError:
    """The error for a hook set that is not a `Hooks` (a dict or a list of (name, fn) pairs, TransformerLens-style)."""
    return TypeError(f"expected a ke.Hooks (from ke.interventions, or hooks = ke.Hooks(); hooks.add(name, fn) with "
                     f"fn(value, *, hook)), got {type(found).__name__}")


class Hooks:
    """An ordered set of hook functions attached to names, globs or name filters.

    Pass it as `kimi_forward_token(..., hooks=hooks)`. `len(hooks)` is the number of attached hooks.
    `observer`: see the module docstring.
    """

    def __init__(self, observer=None):
        self.observer = observer
        self._handles: list[HookHandle] = []
        self._cache: dict[str, tuple] = {}  # name -> ((fn, HookPoint), ...); () for un-hooked names
        self._points: dict[str, HookPoint] = {}
        self._known: frozenset | None = None  # the bound model's names ...
        self._known_order: list[str] = []  # ... in firing order
        self.max_sources: int | None = None  # the bound weights' block-residual source columns (`HookPoint.max_sources`)
        self._marks: list[list] = []  # the handles attached at each `with hooks:` entry
        self._seen: set[str] = set()  # names fired while unbound (for the first-token check)
        self._checked_after_first_token = False
        self._warned: set[str] = set()
        self.position: int | None = None
        self.token_id: int | None = None
        self._next: tuple | None = None  # (token_id, position) announced by begin_token
        self.positions = None  # the current chunk's positions [T] on the sequence path, else None
        self._chunk_tokens = None  # ... and its token ids
        self._chunk_cache: dict[str, tuple] = {}  # name -> ((fn, HookPoint, chunks), ...)
        self._sites: dict[int, tuple] = {}  # id(a layer's names) -> (names, its `sites` table)

    # ------------------------------------------------------------------ attaching
    def add(self, name_or_glob=None, fn=None, *, names_filter=None, chunks: bool = False) -> HookHandle:
        """Attach `fn` to an exact name, an fnmatch glob, or every name `names_filter(name)` accepts.

        chunks=True: fn also takes whole chunks on the sequence path (`kimi_forward_sequence`): it is
        then called once per chunk with the site's values of every token stacked on a leading axis
        [T, ...] and `hook.positions` [T] (and `hook.position` None); in the token form, and in a layer
        or chunk that runs token by token, it is called as any hook. Without it, the sequence path
        calls fn token by token, exactly as stepping would (a chunk with such a hook runs token after token
        through every layer, in the token form). See the module docstring of `kimi_sequence`.
        Raises ValueError when the name or glob can never fire (see module docstring).
        """
        if callable(name_or_glob) and fn is None and names_filter is not None:
            name_or_glob, fn = None, name_or_glob  # add(fn, names_filter=...) reads naturally too
        if fn is None or not callable(fn):
            raise TypeError(f"Hooks.add: fn must be callable as fn(value, *, hook), got {fn!r}")
        _check_hook_signature(fn)
        if (name_or_glob is None) == (names_filter is None):
            raise TypeError("Hooks.add: give exactly one of a name/glob (first argument) or names_filter=callable, "
                            f"got name_or_glob={name_or_glob!r}, names_filter={names_filter!r}")
        if names_filter is not None and not callable(names_filter):
            raise TypeError(f"Hooks.add: names_filter must be a callable name -> bool, got {names_filter!r}")
        if name_or_glob is not None and not isinstance(name_or_glob, str):
            raise TypeError(f"Hooks.add: the name must be a string (exact hook name or glob), got {name_or_glob!r}")
        handle = HookHandle(self, name_or_glob, names_filter, fn, bool(chunks))
        self._validate(handle)
        self._handles.append(handle)
        self._changed()
        return handle

    def extend(self, other: Hooks) -> list[HookHandle]:
        """Attach every hook of `other` (in its order) to this set; returns the new handles."""
        if not isinstance(other, Hooks):
            raise hooks_expected(other)
        return [self.add(h.pattern, h.fn, names_filter=h.names_filter, chunks=h.chunks) for h in other.handles()]

    def __add__(self, other: Hooks) -> Hooks:
        """A new Hooks holding this set's hooks, then `other`'s (e.g. two interventions at once)."""
        out = Hooks()
        out._known, out._known_order, out.max_sources = self._known, self._known_order, self.max_sources
        out.extend(self)
        out.extend(other)
        return out

    def remove(self, what) -> int:
        """Detach by handle, by function, or by the exact pattern string it was added with. Returns how many."""
        before = len(self._handles)
        if isinstance(what, HookHandle):
            self._handles = [h for h in self._handles if h is not what]
        elif isinstance(what, str):
            self._handles = [h for h in self._handles if h.pattern != what]
        elif callable(what):
            self._handles = [h for h in self._handles if h.fn is not what]
        else:
            raise TypeError(f"Hooks.remove: expected a HookHandle, a function or a pattern string, got {what!r}")
        removed = before - len(self._handles)
        if removed:
            self._changed()
        return removed

    def clear(self) -> None:
        """Detach every hook."""
        self._handles.clear()
        self._changed()

    @contextlib.contextmanager
    def hooked(self, name_or_glob=None, fn=None, *, names_filter=None, chunks: bool = False):
        """`with hooks.hooked("layers.*.kda.state", fn):` attaches fn for the block only (`add`'s arguments)."""
        handle = self.add(name_or_glob, fn, names_filter=names_filter, chunks=chunks)
        try:
            yield handle
        finally:
            self.remove(handle)

    def __enter__(self) -> Hooks:
        """`with hooks:` detaches on exit every hook added inside the block (all of them for a fresh Hooks);
        one attached before it and removed inside stays removed."""
        self._marks.append(list(self._handles))
        return self

    def __exit__(self, *exc) -> None:
        entered = self._marks.pop()  # held through the block: no handle added in it can share an id with these
        before = {id(h) for h in entered}
        kept = [h for h in self._handles if id(h) in before]
        if len(kept) != len(self._handles):
            self._handles = kept
            self._changed()

    def __len__(self) -> int:
        return len(self._handles)

    def handles(self) -> list[HookHandle]:
        """The attached hooks, in order (a new list; each handle has `.pattern`, `.names_filter`, `.fn`)."""
        return list(self._handles)

    def copy(self, observer=None) -> Hooks:
        """A new Hooks with the same functions attached (the functions themselves are shared), bound
        to the same names, at the same position; `observer` for the copy (an observer is not copied)."""
        out = Hooks(observer)
        out._known, out._known_order, out.max_sources = self._known, self._known_order, self.max_sources
        for h in self._handles:
            out._handles.append(HookHandle(out, h.pattern, h.names_filter, h.fn, h.chunks))
        out.position, out.token_id = self.position, self.token_id
        return out

    # ------------------------------------------------------------------ checking names
    def bind(self, weights_or_names) -> Hooks:
        """Check every hook against a model's names (`hook_names(weights)` or a list); later `add`s too. Bound to
        the weights, the hooks also learn the model's source columns (`HookPoint.max_sources`)."""
        listed = isinstance(weights_or_names, (list, tuple, set, frozenset))
        names = weights_or_names if listed else hook_names(weights_or_names)
        self.max_sources = None if listed else getattr(weights_or_names, "max_sources", None)
        self._known = frozenset(names)
        self._known_order = list(names)
        for h in self._handles:
            self._validate(h)
        return self

    @property
    def names(self) -> list[str] | None:
        """The bound model's hook names in firing order (None while unbound)."""
        return self._known_order if self._known is not None else None

    def _validate(self, handle: HookHandle) -> None:
        if handle.names_filter is not None:
            known = self._known
            if known is not None and not any(handle.names_filter(n) for n in known):
                raise ValueError(f"names_filter {handle.names_filter!r} accepts none of this model's {len(known)} hook names "
                                 "(see kimi_explore.hook_names(weights)); it would never fire")
            return
        check_pattern(handle.pattern, self._known_order if self._known is not None else None)

    def _check_first_token(self) -> None:
        """Unbound hooks: after the first full token, warn about exact names that never fired."""
        self._checked_after_first_token = True
        missing = [h.pattern for h in self._handles if h.names_filter is None and not is_glob(h.pattern)
                   and h.pattern not in self._seen and h.pattern not in self._warned]
        if missing:
            self._warned.update(missing)
            warn_at_caller(f"hooks on {missing} never fired during a whole token: these names are not hook points of this "
                           "model (e.g. a KDA site on an MLA layer). Call hooks.bind(weights) to get an error at add time.")
        check = getattr(self.observer, "check_fired", None)  # a Recorder's own names_filter and full=
        if check is not None:
            check(self._seen)

    # ------------------------------------------------------------------ firing
    def begin_token(self, token_id=None, position=None) -> None:
        """Announce the next token (its id and 0-based position) before `kimi_forward_token` runs."""
        self._next = (None if token_id is None else int(token_id), None if position is None else int(position))

    def default_token(self, token_id, position) -> None:
        """The next token's id and position by its decode state (`kimi_forward_token`), where `begin_token` did not
        announce them."""
        announced_id, announced = self._next if self._next is not None else (None, None)
        self._next = (token_id if announced_id is None else announced_id, position if announced is None else announced)

    def start_token(self, token_id=None, position=None) -> None:
        """Start a token where "embed" does not fire (a pipeline stage after the first): `begin_token`
        and the embed site's bookkeeping at once."""
        self.begin_token(token_id, position)
        self._on_embed(None)

    def _on_embed(self, value):
        token_id, position = self._next if self._next is not None else (None, None)
        self._next = None
        self.position = position if position is not None else (0 if self.position is None else self.position + 1)
        self.token_id = token_id

    def fire(self, name: str, value):
        """Called by the decoder at every site: run the hooks attached to `name`, return the value to use."""
        fns = self._cache.get(name)
        if not fns:
            return value if fns is not None else self._fire_uncached(name, value)
        for fn, point in fns:
            if point is None:  # internal bookkeeping: fn(value), never changes the value
                fn(value)
                continue
            out = fn(value, hook=point)
            if out is not None:
                if out is not value:
                    check_replacement(point, value, out, fn)
                value = out
        return value

    def listening_sites(self, names: dict) -> dict:
        """{kind: fn(value) -> value} for the sites of one layer (`names`: kind -> full name) that have
        functions attached, each fn this Hooks' `fire` at that name (`model.sites.site_table`). Cached
        per `names` until the hooks change."""
        hit = self._sites.get(id(names))
        if hit is not None and hit[0] is names:
            return hit[1]
        if len(self._sites) > 1024:  # callers passing a fresh dict per call: keep the cache bounded
            self._sites.clear()
        known = self._known
        if known is None:  # unbound: every site, each resolved by `fire` when it first fires (as the check
            # after the first token counts them; a layer's names include sites the model never fires)
            table = {kind: functools.partial(self.fire, name) for kind, name in names.items()}
        else:
            table = {kind: functools.partial(self.fire, name) for kind, name in names.items()
                     if name in known and (self._cache.get(name) or self._resolve(name))}
        self._sites[id(names)] = (names, table)
        return table

    def _fire_uncached(self, name: str, value):
        self._resolve(name)
        return self.fire(name, value)

    # ------------------------------------------------------------------ whole chunks (the sequence path)
    def begin_chunk(self, token_ids, positions) -> None:
        """The next `fire_chunk`s carry these tokens (ids [T], positions [T])."""
        self._chunk_tokens, self.positions = list(token_ids), np.asarray(positions, dtype=np.int64)
        self.position = self.token_id = None
        self._next = None

    def token_in_chunk(self, t: int) -> None:
        """Token t of the chunk is the one being decoded (a layer run token by token, a per-token hook)."""
        self.position, self.token_id = int(self.positions[t]), self._chunk_tokens[t]

    def end_chunk(self) -> None:
        """Back to the token form; the position counter continues after the chunk's last token."""
        if self.positions is not None and len(self.positions):
            self.token_in_chunk(len(self.positions) - 1)
        self.positions = self._chunk_tokens = None

    def needs_tokens(self, names) -> bool:
        """Whether a layer firing these names must run token by token: a hook there takes single tokens
        only, or is chunk-aware at a site whose chunked form cannot honour a changed value (the
        recurrent state and conv window, `SEQUENTIAL_SITES`)."""
        return any(h.matches(n) and (not h.chunks or n.endswith(SEQUENTIAL_SITES)) for h in self._handles for n in names)

    def takes_tokens(self, names) -> bool:
        """Whether a hook here takes single tokens (added without chunks=True) at one of `names`: a chunk of
        `kimi_forward_sequence` then runs token after token through every layer, as stepping (`kimi_sequence`)."""
        single = [h for h in self._handles if not h.chunks]
        return bool(single) and any(h.matches(n) for h in single for n in names)

    def acts_at(self, name: str) -> bool:
        """Whether a hook of this set runs at `name` (the observer's bookkeeping aside: it changes no value)."""
        return any(h.matches(name) for h in self._handles)

    def listens_chunk(self, name: str) -> bool:
        """Whether `fire_chunk(name, ...)` calls anything (a hook matches `name`)."""
        return bool(self._chunk_functions(name))

    def fire_hooks(self, name: str, value):
        """`fire` without the internal functions (the token counter, the observer's): the hooks alone,
        each called with this one token's value."""
        for fn, point, _ in self._chunk_functions(name):
            out = fn(value, hook=point)
            if out is not None and out is not value:
                check_replacement(point, value, out, fn)
                value = out
        return value

    def _chunk_functions(self, name: str) -> tuple:
        fns = self._chunk_cache.get(name)
        if fns is None:
            matched = [h for h in self._handles if h.matches(name)]
            # (a recorder's sites: mostly no hook of its own)
            fns = self._chunk_cache[name] = tuple((h.fn, self._point(name), h.chunks) for h in matched) if matched else ()
            if self._known is None and not self._checked_after_first_token:  # the names check, as `_resolve`'s
                self._seen.add(name)
                if name == "logits":
                    self._check_first_token()
        return fns

    def fire_chunk(self, name: str, value):
        """`fire` for a whole chunk: value [T, ...]. Chunk-aware hooks get the chunk; the others are
        called token by token (the sequence path only lets that happen at the global sites, whose
        values have the same shape at every token) and their values stacked again."""
        self.position = self.token_id = None  # a whole chunk (after a layer run token by token: no token of it)
        for fn, point, chunks in self._chunk_functions(name):
            if chunks:
                out = fn(value, hook=point)
                if out is not None and out is not value:
                    check_replacement(point, value, out, fn, chunk=True)
                    value = out
                continue
            rows, changed = [], False
            for t in range(value.shape[0]):
                self.token_in_chunk(t)
                out = fn(value[t], hook=point)
                if out is not None and out is not value[t]:
                    check_replacement(point, value[t], out, fn)
                    changed = True
                rows.append(value[t] if out is None else out)
            self.position = self.token_id = None
            if changed:
                value = array_namespace(value).stack(rows)
        return value

    def _point(self, name: str) -> HookPoint:
        p = self._points.get(name)
        if p is None:
            p = self._points[name] = HookPoint(name, self)
        return p

    def _functions(self, name: str) -> list:
        """The functions to run at `name`, in order: (fn, HookPoint) for hooks; (fn, None) for the
        internal ones, called as fn(value) (the token counter, then the observer's)."""
        fns = [(h.fn, self._point(name)) for h in self._handles if h.matches(name)]
        if name == "embed":
            fns.insert(0, (self._on_embed, None))
        if self.observer is not None:
            fns += [(fn, None) for fn in self.observer.site_functions(name)]
        return fns

    def _resolve(self, name: str) -> tuple:
        fns = self._cache[name] = tuple(self._functions(name))
        if self._known is None and not self._checked_after_first_token:
            self._seen.add(name)
            if name == "logits":
                self._check_first_token()
        return fns

    def refresh(self) -> None:
        """Resolve every name's functions again at its next `fire` (after the observer's choices changed)."""
        self._cache.clear()
        self._sites.clear()

    def _changed(self) -> None:
        self._cache.clear()
        self._sites.clear()
        self._chunk_cache.clear()
        self._checked_after_first_token = False  # re-check new exact names at the next "logits"

    def observe_chunk(self, name: str, value) -> None:
        """A chunk's summary of a site that is not fired whole on the sequence path (a Recorder records it), or at
        `moe.router.topk_ids` the ids the layer routes by after every hook (a Recorder drops weights by them)."""

    def __repr__(self) -> str:
        body = ", ".join(h.describe() for h in self._handles)
        return f"{type(self).__name__}([{body}])"


