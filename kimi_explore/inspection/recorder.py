"""A Recorder: a hook set that keeps, per token, cheap derived values of every site (or full tensors).

    rec = Recorder()                                     # or Recorder(names_filter="layers.1?.*", full=["layers.3.kda.state"])
    kimi_forward_token(weights, state, token_id, hooks=rec)
    trace = rec.trace()                                  # kimi_explore.Trace
    trace["layers.3.attn_res.ffn.weights"]               # [tokens, n_sources]

Recorded by default, per token (keys are the site name, or the site name + ".norm" for a derived norm):

  site                                   key                                   per-token shape
  layers.{i}.attn_res.{attn,ffn}.weights same                                  [n+1]  softmax over [stored blocks..., current]
  final.attn_res.weights                 same                                  [n+1]
  layers.{i}.kda.state                   layers.{i}.kda.state.norm             [H]    Frobenius norm of each head's S_h [K, V]
  layers.{i}.kda.conv                    layers.{i}.kda.conv.norm              [3, H] norm of each head's conv window, per
                                                                                      stream (q, k, v): its K channels x W taps
  layers.{i}.moe.router.scores           same                                  [E]    unbiased sigmoid scores
  layers.{i}.moe.router.topk_ids         same                                  [k]    int, by score descending
  layers.{i}.moe.router.topk_weights     same                                  [k]
  layers.{i}.moe.{routed,shared}_out     layers.{i}.moe.{routed,shared}_out.norm []   L2 norm
  logits                                 logits.top_ids, logits.top_probs      [top_k] next-token predictions, softmax probs

`names_filter` (None = all of the above; a name, glob, list of them, or a callable name -> bool) picks
the sites whose default values are kept; `full` (names or globs) adds full copies of those sites'
values under their own name, whatever `names_filter` says. Values are recorded after any hook of
this set added before them has changed them, i.e. what flows downstream.

Cost (budget: 15% over no hooks on the tiny model; `bench/hooks.py`): between the decoder's array
calls every extra call, array or Python, is expensive (the caches are cold), so a recorded site runs
a single C-level call (`list.append` or a dict `__setitem__`) and no Python frame of its own:
- the small arrays the decoder creates fresh at a site and never writes again (attn-res and router
  vectors) are kept as they are, not copied;
- the KDA states and windows (live buffers, unchanged until that layer's next token) and the MoE
  output vectors are referenced at their sites; when the token ends, each kind's squared norms are
  taken for all layers at once (one copy into a reused scratch buffer, one batched matmul);
- a copy of the logits waits for a batch of tokens whose top-k and square roots are then computed
  together (on a GPU the batch's records then move to the host in one transfer per dtype). Reading
  the records (`trace()`, `state_dict()`, `truncate()`) completes the pending batch first.
Full records (`full=`) are copies. A hook that changes a recorded array IN PLACE after the recorder
saw it changes the record too: return a new array instead (the contract's way anyway).

On the sequence path a site records a whole chunk [T, ...] at once (`chunk_records`). Such a record
is kept as that one array, a "block" [T, ...]: a key's records are its blocks' rows, then its per-token
list (the tokens stepped since the last chunk). When a chunk begins, that list becomes blocks too
(`_seal_rows`: one stacked array where its rows share shape and dtype), so a step after a feed appends
after the chunk's block with no split, and `trace()`, `state_dict()`, a fork, a snapshot or a file handle
a few arrays per key however long the history. Blocks are split into rows only where per-token rows are
asked for (`per_token`, `take_records`); mla.probs rows are then cut to the token's own positions,
[nh, position + 1], as stepping records them. A pipeline's stages hand their records over as blocks
(`take_blocks`, `add_blocks`).
"""

from __future__ import annotations

import fnmatch
import functools
import json
import weakref

import numpy as np

from .._interrupts import uninterrupted
from .._warnings import warn_at_caller
from ..backend import on_host
from ._hook_grammar import site_kind
from ._recording import RowSquares, TokenRecords, emit_batch, model_meta, take, to_host
from .chunk_records import ChunkRecording
from .hook_sites import MOE_OUTPUT_SITES, ROUTE_SITES, SEQUENTIAL_SITES
from .hooks import Hooks, check_pattern, is_glob
from .stacked_rows import StackedRows, row_blocks
from .targets import index_list, int_in
from .topk import top_predictions
from .trace import Trace, window_slice

__all__ = ["DEFAULT_SITES", "Recorder", "Trace", "per_token", "top_predictions"]

FLUSH_TOKENS = 32  # tokens whose batched records (top-k, square roots, device transfers) are done together
FLUSH_BYTES = 8 << 20  # ... or fewer, when their logits copies reach this size (K3: a 163840 vocabulary)

# a Recorder or Hooks -> weakref to the live Session it serves (set by Session; one session each)
SERVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# site kind -> how it is recorded by default. "fresh": the decoder makes a new small array there every
# token and never writes it again, so the record is that array itself (no copy; style rule 8).
DEFAULT_SITES = {
    "attn_res.attn.weights": "fresh",
    "attn_res.ffn.weights": "fresh",
    "final.attn_res.weights": "fresh",
    "kda.conv": "kda",  # normed with the layer's state, whose shape gives H
    "kda.state": "kda",
    "moe.router.scores": "fresh",
    "moe.router.topk_ids": "fresh",
    "moe.router.topk_weights": "fresh",
    "moe.routed_out": "norm",
    "moe.shared_out": "norm",
    "logits": "top",
}


def _predicate(spec, what: str):
    """None | name | glob | list of them | callable -> (name -> bool, patterns to check)."""
    if spec is None:
        return None, []
    if callable(spec):
        return spec, []
    if not isinstance(spec, str) and not hasattr(spec, "__iter__"):
        raise TypeError(f"{what}: expected a hook name, a glob, a list of them or a callable name -> bool, got {spec!r}")
    patterns = [spec] if isinstance(spec, str) else list(spec)
    for p in patterns:
        check_pattern(p, None, what)
    exact = {p for p in patterns if not is_glob(p)}
    globs = [p for p in patterns if is_glob(p)]
    return (lambda n: n in exact or any(fnmatch.fnmatchcase(n, g) for g in globs)), patterns


def _trim_positions(rows: list, width: int) -> bool:
    """Cut mla.probs rows to `width` cache positions (in place; True if any was wider). A fed chunk records each
    token's row over the chunk's whole cache, [nh, L0 + T], NaN past the token (`chunk_records`); when a
    truncate cuts the chunk, the positions past the kept tokens are gone, and a Trace must not show them (a
    straight decode's row is [nh, position + 1]). Widths never decrease along a history, so only the last
    rows can be too wide."""
    t = len(rows)
    while t and rows[t - 1].shape[-1] > width:
        t -= 1
        rows[t] = rows[t][..., :width]
    return t < len(rows)


def _block_rows(key: str, block):
    """A block's per-token rows (iterating it gives them), as stepping records them: a fed chunk's mla.probs
    [T, nh, L0 + T] (NaN past each token, `chunk_records`) cut to each token's own positions, row t [nh, L0 + t + 1]
    (views)."""
    if not key.endswith(".mla.probs") or len(block) < 2:
        return block
    T, width = len(block), block.shape[-1]
    return [row[..., : width - T + 1 + t] for t, row in enumerate(block)]


def _as_blocks(key: str, rows: list) -> list:
    """A key's stepped rows -> blocks (`row_blocks`); mla.probs rows stay one-row views, since a block of several is a
    fed chunk's form there, its rows cut by position (`_block_rows`)."""
    return [np.asarray(r)[None] for r in rows] if key.endswith(".mla.probs") else row_blocks(rows)


def per_token(blocks: dict) -> dict:
    """{key: [blocks [m, ...]]} (`Recorder.state_dict()["blocks"]`, `take_blocks`) -> {key: per-token rows}, each
    row as stepping records it."""
    return {k: [r for b in bs for r in _block_rows(k, b)] for k, bs in blocks.items()}


class Recorder:
    """Records what `kimi_forward_token` computes, token by token (see module docstring).

    Pass it as `hooks=`: it holds a `Hooks` (`self.hooks`) that it observes (`site_functions`), and
    hooks added to it (`add`, `extend`, `hooked`, ...) run before its recording, so it records what
    flows downstream.
    """

    def __init__(self, names_filter=None, full=(), top_k: int = 10):
        self.hooks = Hooks(observer=self)
        self.fire = self.hooks.fire  # the decoder calls rec.fire: straight into the Hooks
        self.listening_sites = self.hooks.listening_sites  # ... and its sites (`model.sites.site_table`): the Hooks' own
        if isinstance(top_k, bool) or not (isinstance(top_k, (int, np.integer)) and top_k >= 1):  # (True would be 1)
            raise ValueError(f"Recorder: top_k must be a positive int, got {top_k!r}")
        self.top_k = int(top_k)
        self.names_filter, self._filter_patterns = _predicate(names_filter, "Recorder names_filter")
        self.full, self._full_patterns = _predicate(full if full else None, "Recorder full")
        # key -> records [m, ...] (chunks' and sealed rows'), in order; then _rows[key]: host arrays of the tokens
        # stepped since (lists are never rebound: the site functions append to them)
        self._blocks: dict[str, list] = {}
        self._rows: dict[str, list] = {}
        self._stacked: dict[str, StackedRows] = {}  # key -> its rows stacked so far (trace() copies in only new rows)
        self.tokens: list[int] = []  # -1 where the token id was not announced
        self.positions: list[int] = []
        # the current token's values, by record key or layer prefix (dicts keep the firing order)
        self._norm_stash: dict[str, object] = {}  # "...moe.routed_out.norm" -> MoE output vector
        self._state_stash: dict[str, object] = {}  # "layers.{i}.kda." -> live recurrent state [H, K, V]
        self._conv_stash: dict[str, object] = {}  # "layers.{i}.kda." -> live conv window [3, P, W]
        self._fresh_stash: dict[str, object] = {}  # record key -> fresh device array (GPU only)
        self._state_norm_prefixes: set[str] = set()  # layers whose state norm is recorded
        self._batch: list[TokenRecords] = []  # finished tokens whose batched records are not computed yet
        self._batch_bytes = 0
        self._record_top = False  # set when the logits site's top-k is recorded
        self._squares = RowSquares()  # per-token squared norms without per-token allocations
        self._pending: list = []  # (put, device array) waiting for the next transfer (GPU only)
        self._on_device = False
        self.meta: dict = {}
        self._chunks = ChunkRecording(self)  # how whole chunks of the sequence path are recorded
        self._observed: set[str] = set()  # sites observed (not fired) on the sequence path while unbound

    # ------------------------------------------------------------------ the Hooks it holds
    def add(self, name_or_glob=None, fn=None, *, names_filter=None, chunks: bool = False):
        """`Hooks.add`: a hook that runs before the recording at its sites."""
        return self.hooks.add(name_or_glob, fn, names_filter=names_filter, chunks=chunks)

    def extend(self, other: Hooks) -> list:
        return self.hooks.extend(other)

    def remove(self, what) -> int:
        return self.hooks.remove(what)

    def hooked(self, name_or_glob=None, fn=None, *, names_filter=None, chunks: bool = False):
        return self.hooks.hooked(name_or_glob, fn, names_filter=names_filter, chunks=chunks)

    def begin_token(self, token_id=None, position=None) -> None:
        self.hooks.begin_token(token_id, position)

    def default_token(self, token_id, position) -> None:
        self.hooks.default_token(token_id, position)

    def start_token(self, token_id=None, position=None) -> None:
        """Start a token where "embed" does not fire (a pipeline stage after the first)."""
        self.hooks.start_token(token_id, position)
        self._start_token(None)

    def end_token(self) -> None:
        """End a token where "logits" does not fire (a pipeline stage before the last)."""
        self._end_token(None)

    @staticmethod
    def _every_site(names: dict) -> None:
        """`listening_sites` while a chunk runs token by token: None, i.e. every site through `fire` (which then records
        rows of the chunk)."""
        return None

    def __len__(self) -> int:
        """The number of hooks added to this recorder (its own recording is not a hook)."""
        return len(self.hooks)

    @property
    def position(self) -> int | None:
        return self.hooks.position

    # ------------------------------------------------------------------ binding and names
    def bind(self, weights_or_names, names=None) -> Recorder:
        """Check names against a model and keep what a Trace needs to label its axes without the weights.

        names: check against these instead (a pipeline stage: the whole pipeline's hook names)."""
        self.hooks.bind(weights_or_names if names is None else names)
        self._check_selection(self.hooks.names)
        if hasattr(weights_or_names, "specs"):
            self.meta = model_meta(weights_or_names)
            self._on_device = not on_host(weights_or_names.xp)
            self.hooks.refresh()
            self._chunks.clear()  # (built from the meta: the heads of the KDA layers)
        return self

    def _check_selection(self, names) -> None:
        """Raise ValueError where a names_filter or full= pattern names none of `names`, or the filter selects only
        sites without a default record (`bind` refuses; an unbound recorder warns, `check_fired`)."""
        for p in self._filter_patterns + self._full_patterns:
            check_pattern(p, names, "Recorder pattern")
        self._refuse_filters_recording_nothing(names)

    def _refuse_filters_recording_nothing(self, names) -> None:
        """A names_filter (names, globs or a callable) that selects sites but only ones without a default record, in a
        recorder whose `full=` selects none, is refused: it would record nothing, without a word. (One that selects no
        site at all, `[]` or `lambda n: False`, says so itself: a session file keeps a callable's choice as a list.)"""
        if self.names_filter is None:
            return
        picked = [n for n in names if self.names_filter(n)]
        if self.full is not None and any(self.full(n) for n in names):
            return  # (it records those: a filter of no default site beside full= is a way to say "only these")
        if picked and not any(site_kind(n) in DEFAULT_SITES for n in picked):
            given = self._filter_patterns or self.names_filter
            given = given[0] if isinstance(given, list) and len(given) == 1 else given
            raise ValueError(f"Recorder names_filter {given!r} selects only sites a Recorder keeps nothing of by default "
                             f"({picked[:3]}{'...' if len(picked) > 3 else ''}: it records {sorted(DEFAULT_SITES)}); "
                             f"to record their values pass full={given!r} (the whole value per token)")

    def check_fired(self, fired) -> None:
        """Unbound (no `bind`, which a Session does): after the first whole token, by the names that fired there
        (`fired`, and the ones observed on the sequence path), warn of what `bind` refuses: a names_filter or full=
        pattern matching none of them, or a filter of sites without a default record. Else it records nothing there,
        without a word."""
        names = sorted(set(fired) | self._observed)
        problems = []
        try:
            self._check_selection(names)
        except ValueError as e:
            problems.append(str(e))
        for what, predicate, patterns in (("names_filter", self.names_filter, self._filter_patterns),
                                          ("full", self.full, self._full_patterns)):
            if predicate is not None and not patterns and not any(predicate(n) for n in names):  # a callable's
                problems.append(f"Recorder {what} {predicate!r} accepts none of the {len(names)} sites that fired")
        if problems:
            warn_at_caller("; ".join(problems) + " (during the first whole token: this recorder is not bound to the model; "
                           "rec.bind(weights) makes this an error before anything runs)")

    def _wants(self, name: str, kind: str) -> bool:
        return kind in DEFAULT_SITES and (self.names_filter is None or self.names_filter(name))

    def _row(self, key: str) -> list:
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = []
        return row

    def site_functions(self, name: str) -> list:
        """What the Hooks runs at `name` after its hooks (the observer protocol): functions called as
        fn(value), most of them C-level (`list.append`, a dict `__setitem__` partial), so a recorded
        site runs no Python frame of its own."""
        fns = []
        if name == "embed":
            fns.append(self._start_token)
        kind = site_kind(name)
        wanted = self._wants(name, kind)
        if wanted or (kind == "kda.state" and self._wants(name[:-5] + "conv", "kda.conv")):
            fn = self._recording_fn(name, kind)
            if fn is not None:
                fns.append(fn)
        if self.full is not None and self.full(name) and not (wanted and DEFAULT_SITES[kind] == "fresh"):  # recorded once
            put, emit = self._row(name).append, self._emit
            fns.append(lambda value: emit(put, value.copy()))
        if name == "logits":
            fns.append(self._end_token)
        return fns

    # ------------------------------------------------------------------ whole chunks (the sequence path)
    def begin_chunk(self, token_ids, positions) -> None:
        """The next sites fire whole chunks of these tokens (`chunk_records`); records stay per token."""
        self.flush()  # the token form's pending records come first
        self._seal_rows()  # ... and the chunk's blocks after them
        self.hooks.begin_chunk(token_ids, positions)
        self.tokens.extend(-1 if t is None else int(t) for t in token_ids)
        self.positions.extend(int(p) for p in positions)
        self.fire, self.listening_sites = self._fire_in_chunk, self._every_site

    def token_in_chunk(self, t: int) -> None:
        self.hooks.token_in_chunk(t)

    def end_chunk(self) -> None:
        self.hooks.end_chunk()
        self.fire, self.listening_sites = self.hooks.fire, self.hooks.listening_sites
        if self._batch_bytes >= FLUSH_BYTES:
            self.flush()

    def needs_tokens(self, names) -> bool:
        """A hook added to this recorder needs single tokens there, or a full record of a recurrent site is
        asked for (its chunked form never builds the per-token states)."""
        return self.hooks.needs_tokens(names) or (self.full is not None and any(
            self.full(n) for n in names if n.endswith(SEQUENTIAL_SITES)))

    def takes_tokens(self, names) -> bool:
        """A hook added to this recorder takes single tokens at one of `names` (`Hooks.takes_tokens`; its own
        recording is chunk-aware)."""
        return self.hooks.takes_tokens(names)

    def fire_chunk(self, name: str, value):
        value = self.hooks.fire_chunk(name, value)
        self._chunks.record(name, value)
        return value

    def listens_chunk(self, name: str) -> bool:
        """Whether `fire_chunk(name, ...)` calls a hook or records something."""
        return self.hooks.listens_chunk(name) or bool(self._chunks.functions(name))

    def observe_chunk(self, name: str, value) -> None:
        if self.hooks.names is None:
            self._observed.add(name)  # (a site the sequence path summarises without firing: `check_fired`)
        self._chunks.observe(name, value)

    def _fire_in_chunk(self, name: str, value):
        """`fire` while a chunk runs (a layer run token by token): the hooks, then the value recorded as one row."""
        value = self.hooks.fire_hooks(name, value)
        self._chunks.record(name, value[None])
        return value

    # what chunk_records reads
    on_device = property(lambda self: self._on_device)

    def recorded_kind(self, name: str, kind: str) -> str | None:
        """How the site's default record is made ("fresh", "norm", "top", "kda.state", "kda.conv"), or None."""
        if not self._wants(name, kind):
            return None
        how = DEFAULT_SITES[kind]
        return kind if how == "kda" else how

    def chunk_put(self, key: str):
        """put(array [T, ...]): T records of `key` at once, kept whole as one block."""
        self._row(key)
        return self._blocks.setdefault(key, []).append

    def _seal_rows(self) -> None:
        """Each key's stepped rows -> blocks after its blocks (`_as_blocks`), so that what comes next can be a block.
        Split into rows instead, a long feed's blocks took more memory than the whole decode state (+52 MiB at the
        first step after 8,192 tokens) and a fork ten times the time (`bench/long_history.py`)."""
        with uninterrupted():  # (a Ctrl-C between the extend and the clear kept the rows twice)
            for k, rows in self._rows.items():
                if rows:
                    self._blocks.setdefault(k, []).extend(_as_blocks(k, rows))
                    rows.clear()

    def _cut_records(self, n: int) -> None:
        """Each key's records cut after the first n tokens': the blocks before token n kept whole, the one it falls in
        cut (a view; an mla.probs block's positions also cut to its kept tokens': a Trace must not show the cut ones),
        the later ones and the stepped rows after token n dropped."""
        for k, rows in self._rows.items():
            blocks, have, kept = self._blocks.get(k, []), 0, []
            for b in blocks:
                if have >= n:
                    break
                part = b[: n - have]
                if len(part) < len(b) and k.endswith(".mla.probs"):
                    part = part[..., : b.shape[-1] - len(b) + len(part)]
                kept.append(part)
                have += len(part)
            blocks[:] = kept
            del rows[max(n - have, 0):]

    def emit(self, put, arr) -> None:
        self._emit(put, arr)

    def emit_top(self, put_ids, put_probs, logits) -> None:
        ids, probs = top_predictions(logits, self.top_k)
        self._emit(put_ids, ids)
        self._emit(put_probs, probs)

    # ------------------------------------------------------------------ recording functions
    # Each site does as little as possible: keep the fresh array, or a reference used when the token
    # ends (the live buffers referenced are not written again before then). At the end of the token
    # ("logits") the norms are computed for all layers at once and device records move to the host.
    def _emit(self, put, arr) -> None:
        """put(host array) now, or once this token's device records have been moved to the host."""
        if isinstance(arr, np.ndarray):
            put(arr)
        elif isinstance(arr, np.generic):
            put(np.asarray(arr))
        else:
            self._pending.append((put, arr))
            self._batch_bytes += arr.nbytes  # device memory held until the next transfer

    def _recording_fn(self, name: str, kind: str):
        how = DEFAULT_SITES[kind]
        if how == "fresh":
            row = self._row(name)
            return functools.partial(self._fresh_stash.__setitem__, name) if self._on_device else row.append
        if how == "norm":  # routed_out / shared_out: fresh arrays, referenced until the batch is computed
            self._row(name + ".norm")
            return functools.partial(self._norm_stash.__setitem__, name + ".norm")
        if how == "top":  # done by _end_token, which runs at the same site
            self._row("logits.top_ids"), self._row("logits.top_probs")
            self._record_top = True
            return None
        # "kda": the live conv window and recurrent state stay unchanged until this layer's next token
        prefix = name[: name.rindex("kda.") + 4]
        if kind == "kda.conv":
            self._row(prefix + "conv.norm")
            return functools.partial(self._conv_stash.__setitem__, prefix)
        if self._wants(prefix + "state", "kda.state"):
            self._row(prefix + "state.norm")
            self._state_norm_prefixes.add(prefix)
        return functools.partial(self._state_stash.__setitem__, prefix)  # also gives the conv norms their H

    def _start_token(self, value):
        """At "embed", after the Hooks has counted the token."""
        token_id = self.hooks.token_id
        self.tokens.append(-1 if token_id is None else token_id)
        self.positions.append(self.hooks.position)
        if value is not None and on_host(value) == self._on_device:  # first token of an unbound recorder on a GPU
            self._on_device = not self._on_device
            self.hooks.refresh()  # rebuild the site functions for device arrays

    def acts_at(self, name: str) -> bool:
        """A recorder never changes a value (`HookChain`: no earlier set need keep a copy for it)."""
        return False

    def keep_value(self, name: str) -> None:
        """A hook set after this one in a HookChain is about to run at `name`, whose value is referenced here until
        the token ends (kda.state and kda.conv live buffers, the MoE outputs, for their norms): keep a copy of what
        was recorded, which that set may edit in place or replace."""
        if name.endswith(MOE_OUTPUT_SITES):
            if name + ".norm" in self._norm_stash:
                self._norm_stash[name + ".norm"] = self._norm_stash[name + ".norm"].copy()
            return
        prefix = name[: name.rindex("kda.") + 4] if "kda." in name else None
        stash = self._state_stash if name.endswith("kda.state") else self._conv_stash if name.endswith("kda.conv") else None
        if stash is not None and prefix in stash:
            stash[prefix] = stash[prefix].copy()

    def _end_token(self, value):
        """Last function at "logits": squared norms of this token's stashed vectors and live buffers, logits copy."""
        state = conv = moe = None
        prefixes = cprefixes = norm_keys = ()
        if self._state_stash:
            prefixes, states = take(self._state_stash)
            H = states[0].shape[0]
            if len(self._state_norm_prefixes) != len(prefixes):  # only some layers' state norms wanted
                keep = [j for j, p in enumerate(prefixes) if p in self._state_norm_prefixes]
                prefixes, states = [prefixes[j] for j in keep], [states[j] for j in keep]
            if prefixes:
                state = self._squares.of(states, H)  # [n, H]
            if self._conv_stash:
                cprefixes, windows = take(self._conv_stash)  # [3, P, W] each, channel h*K + j
                conv = self._squares.of(windows, windows[0].shape[0] * H)  # [n, 3H]
        if self._norm_stash:
            norm_keys, vecs = take(self._norm_stash)
            moe = self._squares.of(vecs, 1)  # [n, 1]
        fresh = take(self._fresh_stash) if self._fresh_stash else ((), ())
        logits = value.copy() if self._record_top and value is not None else None  # the caller may write into its logits
        self._batch.append(TokenRecords(norm_keys, moe, prefixes, state, cprefixes, conv, logits, fresh))
        self._batch_bytes += 0 if value is None else value.nbytes
        if len(self._batch) >= FLUSH_TOKENS or self._batch_bytes >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Compute the queued tokens' batched records and move device records to the host."""
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        rows, emit = self._rows, self._emit
        if batch:
            emit_batch(batch, rows, emit, self.top_k)
        if self._pending:
            pending = self._pending[:]
            self._pending.clear()
            for put, host in zip([p for p, _ in pending], to_host([a for _, a in pending]), strict=True):
                put(host)
        self._batch_bytes = 0

    # ------------------------------------------------------------------ results and bookkeeping
    @property
    def n_tokens(self) -> int:
        return len(self.positions)

    def trace(self, tokens=None, window=None) -> Trace:
        """Everything recorded so far as a Trace (read-only views; later steps do not change it).

        Costs O(records), not O(tokens x records): each record's rows are kept stacked as they arrive
        (`stacked_rows`), and the Trace shows the stack as it is now. window: a `slice` of token indices
        (or a (start, stop) pair), the same as `trace().window(start, stop)`."""
        self.flush()
        n = self.n_tokens
        stacked, blocks = self._stacked, self._blocks
        records = {}
        for k, v in self._rows.items():
            b = blocks.get(k) or ()
            m = len(v) + sum(map(len, b)) if b else len(v)
            if m:
                st = stacked.get(k)
                if st is None:
                    st = stacked[k] = StackedRows()
                records[k] = st.sync(b, v, min(n, m), k)
        toks = self.tokens[:n] if tokens is None else list(tokens)
        if tokens is not None and toks:
            toks = index_list(toks, "Recorder.trace: tokens")  # (int() would take 1.5 for 1 and True for 1)
        if len(toks) != n:
            raise ValueError(f"Recorder.trace: got {len(toks)} tokens for {n} recorded steps")
        out = Trace(records, toks, self.positions[:n], self.meta)
        return out if window is None else out.window(window_slice(window, "Recorder.trace"))

    def truncate(self, n: int) -> None:
        """Keep the records of the first n tokens (in place). A Session's recorder is cut by the session
        (`session.truncate`, `back`): cut here, its rows would no longer line up with the session's tokens."""
        self._refuse_if_serving("truncate")
        self.cut_for_session(int_in(n, 0, self.n_tokens, "Recorder.truncate: n (how many tokens' records to keep)"))

    def _refuse_if_serving(self, what: str) -> None:
        owner = SERVED.get(self)
        if owner is not None and owner() is not None:
            raise ValueError(f"Recorder.{what}: this Recorder serves a Session, whose records line up with its tokens, one "
                             "row per token: cut them with the session (session.truncate(n), session.back(k)), or record "
                             "afresh with a new Session(weights, recorder=Recorder(...)) fed the tokens you want")

    def cut_for_session(self, n: int) -> None:
        """`truncate` for the Session that owns this recorder, or the recorder's own bookkeeping."""
        self.flush()
        self._cut_records(n)
        kept = self.positions[:n]  # a kept token's attention covers cache positions up to its own
        width = max(kept) + 1 if kept and None not in kept else None
        for k, row in self._rows.items():
            if width is not None and k.endswith(".mla.probs"):
                st = self._stacked.get(k)  # a stack made from a fed chunk is as wide as the chunk, whatever rows it kept
                if _trim_positions(row, width) or (st is not None and st.shape and st.shape[-1] > width):
                    self._stacked.pop(k, None)  # narrower now: stack afresh
        for st in self._stacked.values():
            st.truncate(n)
        del self.tokens[n:]
        del self.positions[n:]
        self._drop_token_buffers()
        self.hooks.position = self.positions[-1] if self.positions else None

    def records_mark(self) -> int:
        """The tokens recorded so far (`discard_since` goes back to here)."""
        return len(self.positions)

    def discard_since(self, mark: int) -> None:
        """Drop the records after the first `mark` tokens, a token or chunk in progress included (a forward pass
        that failed: `model.kimi_token.discard_records`)."""
        self.cut_for_session(mark)

    def _drop_token_buffers(self) -> None:
        """Forget a token in progress (after an error in the middle of one) and any unflushed batch."""
        for buf in (self._pending, self._norm_stash, self._state_stash, self._conv_stash, self._fresh_stash, self._batch):
            buf.clear()
        self._batch_bytes = 0

    def take_blocks(self) -> dict:
        """{key: [arrays [m, ...]]}: the records so far in order, m tokens each (a fed chunk's as its one block, a
        stepped token's as [1, ...]), removed from this recorder: what a pipeline stage hands the driver after each
        token or chunk (whose Recorder takes them with `add_blocks`), a chunk never split into rows."""
        self.flush()
        out = {}
        for k, rows in self._rows.items():
            blocks = self._blocks.get(k, [])
            if rows or blocks:
                out[k] = blocks[:] + [np.asarray(r)[None] for r in rows]
            rows.clear()
            blocks.clear()
        self._stacked.clear()
        self.tokens.clear()
        self.positions.clear()
        return out

    def take_records(self) -> dict:
        """{key: per-token arrays}: `take_blocks` split into rows."""
        return per_token(self.take_blocks())

    def add_blocks(self, token_ids, positions, blocks: dict) -> None:
        """Append tokens' records made elsewhere ({key: [arrays [m, ...]]} from each pipeline stage's `take_blocks`),
        kept as blocks after the records so far."""
        self.flush()
        self._seal_rows()
        self.tokens.extend(-1 if t is None else int(t) for t in token_ids)
        self.positions.extend(int(p) for p in positions)
        for k, b in blocks.items():
            self._row(k)
            self._blocks.setdefault(k, []).extend(b)

    def add_tokens(self, token_ids, positions, records: dict) -> None:
        """`add_blocks` of per-token arrays ({key: [one array per token]}, as `take_records` gives them)."""
        self.add_blocks(token_ids, positions, {k: [r[None] for r in rows] for k, rows in records.items()})

    def route_sites(self, names) -> list[str]:
        """Of `names`, the sites this recorder keeps in full where that changes how a fed chunk is computed
        (`ROUTE_SITES`): what a replay that must round as the feed did keeps in full too."""
        return [] if self.full is None else [n for n in names if n.endswith(ROUTE_SITES) and self.full(n)]

    def settings(self) -> dict:
        """Constructor arguments that record as this recorder does (a pipeline stage's copy)."""
        return {"names_filter": self._filter_patterns or self.names_filter, "full": self._full_patterns or self.full or (),
                "top_k": self.top_k}

    def differences(self, settings: dict, names=None) -> list[str]:
        """How records made under `settings` (`settings()`'s keys) would not line up with this recorder's: its
        top_k, and the sites each filter selects of `names` (default: the bound model's; a glob and a callable
        that select the same sites agree). [] when they line up."""
        names, mine = (self.hooks.names or []) if names is None else names, self.settings()

        def selected(key: str, spec) -> list[str]:  # names_filter None: every site ([]: none)
            keep = _predicate(spec, f"Recorder {key}")[0]
            return list(names) if keep is None else [n for n in names if keep(n)]

        out = [] if settings["top_k"] == self.top_k else [f"top_k={settings['top_k']!r} (this recorder: {self.top_k})"]
        out += [f"{key}={settings[key]!r} (this recorder: {mine[key]!r})" for key in ("names_filter", "full")
                if selected(key, settings[key]) != selected(key, mine[key])]
        return out

    def clear_records(self) -> None:
        self._refuse_if_serving("clear_records")
        self.cut_for_session(0)

    def state_dict(self, copy_arrays: bool = False) -> dict:
        """The records and the settings that made them: "blocks" {key: [host arrays [m, ...]]}, each key's records
        in order, m tokens each (`per_token` splits them into the rows stepping makes). Arrays are shared unless
        copy_arrays. A few arrays per key however long the history: the stepped rows are sealed into blocks first."""
        self.flush()
        self._seal_rows()
        cp = (lambda a: a.copy()) if copy_arrays else (lambda a: a)
        return {"blocks": {k: [cp(b) for b in self._blocks.get(k, ())] for k in self._rows},
                "tokens": list(self.tokens), "positions": list(self.positions), "settings": self.settings()}

    def load_state_dict(self, d: dict) -> None:
        """Replace the records by `d` (from `state_dict`); list objects are kept, their contents replaced. Records
        made under other settings (`differences`) are refused: their rows would not line up with this
        recorder's next ones."""
        differ = self.differences(d["settings"]) if "settings" in d else []
        if differ:
            raise ValueError("these records were made by a Recorder with other settings: " + "; ".join(differ) +
                             ". Record with the same settings (Recorder(**settings)), or start without records")
        if "blocks" not in d:
            raise ValueError(f"Recorder.load_state_dict: expected a Recorder.state_dict() (keys 'blocks', 'tokens', "
                             f"'positions', 'settings'), got keys {sorted(d)}")
        for k in self._rows:
            self._rows[k][:] = []
        for blocks in self._blocks.values():
            blocks.clear()
        self._stacked.clear()  # other rows: stack them afresh
        for k, v in d["blocks"].items():
            self._row(k)
            self._blocks.setdefault(k, [])[:] = list(v)
        self.tokens[:] = d["tokens"]
        self.positions[:] = d["positions"]
        self._drop_token_buffers()
        self.hooks.position = self.positions[-1] if self.positions else None

    def copy(self, deep: bool = True, records: bool = True) -> Recorder:
        """A Recorder with the same settings, hooks and records (copied arrays when deep; none without records)."""
        out = type(self)(top_k=self.top_k)
        out.names_filter, out._filter_patterns = self.names_filter, list(self._filter_patterns)
        out.full, out._full_patterns = self.full, list(self._full_patterns)
        out.hooks = self.hooks.copy(observer=out)
        out.fire, out.listening_sites, out._on_device = out.hooks.fire, out.hooks.listening_sites, self._on_device
        out.meta = json.loads(json.dumps(self.meta))
        if records:
            out.load_state_dict(self.state_dict(copy_arrays=deep))
        return out
