"""Session: step through K3 token by token, with a history you can truncate, fork, save and reload exactly.

    s = Session(weights)                      # records with a default Recorder
    s.feed([17, 203, 5]); s.step(88)          # logits of each token, host NumPy (feed: whole chunks at once)
    s.generate(8)                             # greedy (temperature=0) or seeded sampling
    s.tokens, s.logits, s.trace()             # history: [T] ids, [T, V] logits, the Recorder's Trace
    s.generated                               # [T] bools: the tokens `generate` chose
    s.history_version                         # a new number after every change of the history
    s.trace(window=slice(-32, None))          # only the last 32 tokens (as cheap at any history length)
    s.back()                                  # drop the last token (s.back(3): the last 3)
    s.truncate(2); s.step(5)                  # keep the first 2 tokens, then a different third
    snap = s.snapshot(); ...; s.restore(snap)
    other = s.fork()                          # an independent copy (shares only the weights)
    with s.intervene(interventions.ablate_experts(3, "all")): s.step(7)
    s.save_state("bug.npz"); Session.load_state("bug.npz", weights)
    Session(ke.RayPipeline(path, stages=4))   # the same over pipeline stages; s.recover() after a lost stage

Going back has two spellings that cannot be confused: `truncate(n_tokens)` keeps the first
n_tokens (like `file.truncate(size)`), `back(k)` drops the last k.

Two routes: `step` decodes one token (`forward_token`); `feed` decodes whole chunks of `chunk`
tokens (`forward_sequence`, the sequence path: ~10x faster on the embedded model, equal to stepping to
float rounding), with a progress bar on long feeds. While hooks that may change values are attached (`session.hooks`,
or hooks added to the recorder), `feed` steps token by token, so that every such token keeps a
checkpoint and the history stays exact anywhere.

Exactness: every restore is bit-identical. The session keeps the decode state ("checkpoints",
`KimiDecodeState.checkpoint`: see Memory below) after every `checkpoint_every`-th stepped token,
at the end of every fed chunk, and after every token decoded while value-changing hooks were
attached; `truncate(n)` drops the
checkpoints after n, copies the nearest one at or before n and re-decodes the tokens after it
without hooks, each the way it was decoded: stepped tokens one by one, a fed chunk as one chunk
(a cut inside a chunk re-decodes the chunk's first part as one chunk, and keeps a checkpoint there).
Those tokens were decoded without value-changing hooks, so the replay repeats the same arithmetic on
the same inputs. State copies keep every array's shape (an
MLA cache keeps its capacity), so the replayed arithmetic runs on the same layouts too. Memory: a
checkpoint holds a copy of the KDA matrices and shares the MLA caches with the state it was taken
from (`KimiDecodeState.checkpoint`: a cache only appends), so the caches are held about once over
a history, not once per checkpoint (a fork's checkpoints share theirs likewise); lower
`checkpoint_every` for faster truncates, raise it to save memory. So `session.state` is the
session's own: to edit a state in place, take a copy (`state_after(n)`); an edit of its MLA caches
would reach the checkpoints.

The whole history is one explicit record, `SessionSnapshot`: `snapshot()` returns it, `restore()`
takes it, `fork()` builds a new Session and restores a copy into it, and a session file
(`session_io`) holds one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import weakref
from pathlib import Path

import numpy as np

from .._interrupts import uninterrupted
from ..backend import to_numpy
from ..errors import StageLostError
from ..model.kimi_decoder import KimiDecodeState, KimiLayerState, hook_names, token_indices
from ..model.kimi_sequence import default_chunk
from ..weights.workspace import OnePass, one_thread
from .hooks import HookChain, Hooks, hooks_expected
from .recorder import SERVED, Recorder
from .session_io import SessionSnapshot, copy_sharing, load_session, nbytes_once, save_session
from .targets import history_position, int_in
from .trace import window_slice


def _refuse_if_served(obj, what: str) -> None:
    """Refuse a Recorder or Hooks (the `what` argument) that serves another live Session: two sessions would write
    one recorder's records (each trace holding the other's tokens, one's `back` cutting the other's) or share one
    `with intervene` block (one session decoding under the other's interventions)."""
    owner = SERVED.get(obj) if obj is not None else None
    if owner is not None and owner() is not None:
        raise ValueError(f"Session: {what}: this {type(obj).__name__} already serves another Session (its records and "
                         f"interventions would be both sessions'); pass each Session its own: {what}.copy(), or a new one")

__all__ = ["Session", "SessionSnapshot"]


class _constructor(classmethod):
    """A classmethod that builds a new object: called on an instance (`s.load_state(...)`, which reads like
    loading into `s`) it raises instead of returning a session that the caller would drop."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return super().__get__(obj, owner)
        name = self.__func__.__name__

        def refuse(*args, **kwargs):
            raise TypeError(f"{type(obj).__name__}.{name} returns a new session and leaves this one as it is: "
                            f"s = {type(obj).__name__}.{name}(path, weights)")
        return refuse


class Session:
    """One decode stream over `weights`, with its history (see module docstring)."""

    def __init__(self, weights, recorder=True, tokenizer=None, hooks: Hooks | None = None, checkpoint_every: int = 16):
        _refuse_not_weights(weights, "Session")
        self.weights = weights
        self._one_pass = OnePass("this Session is decoding in another thread: its state and records serve one call at a "
                                 "time (a second thread's step swapped the state under the first's). Call it from one "
                                 "thread, or give each thread its own (session.fork())")
        V = weights.config.vocab_size
        if tokenizer is not None and getattr(tokenizer, "vocab_size", V) != V:  # its ids would be another model's
            raise ValueError(f"Session: the tokenizer has {tokenizer.vocab_size} ids, the model's vocabulary "
                             f"{V} (vocab_size in its config): they belong to different models")
        self.tokenizer = tokenizer
        if recorder is True:
            recorder = Recorder()
        elif recorder is False:
            recorder = None
        if recorder is not None and not isinstance(recorder, Recorder):
            raise TypeError(f"Session: recorder must be True, False/None or a Recorder, got {type(recorder).__name__}")
        if recorder is not None and recorder.tokens:
            raise ValueError(f"Session: recorder: it already holds the records of {len(recorder.tokens)} token(s), and a "
                             "new Session starts empty (its trace would not line up with its tokens): pass a new "
                             "Recorder, or call recorder.clear_records() first")
        if hooks is not None and not isinstance(hooks, Hooks):
            raise TypeError(f"Session: hooks: {hooks_expected(hooks)}")
        _refuse_if_served(recorder, "recorder")  # both checked before either is bound
        _refuse_if_served(hooks, "hooks")
        self.recorder = recorder.bind(weights) if recorder is not None else None
        not_one = tokenizer is not None and not callable(getattr(tokenizer, "decode", None))
        if not_one or isinstance(tokenizer, (str, Path, type)):  # (a class has a decode too: not one)
            raise TypeError("Session: tokenizer: expected a tokenizer (ke.load_tokenizer(weights)), got "
                            + (f"the class {tokenizer.__name__} (an instance: {tokenizer.__name__}())"
                               if isinstance(tokenizer, type) else type(tokenizer).__name__)
                            + (" (a path: load it with ke.load_tokenizer(path))" if isinstance(tokenizer, (str, Path)) else ""))
        self.hooks = (hooks if hooks is not None else Hooks()).bind(weights)
        if isinstance(checkpoint_every, bool) or not (isinstance(checkpoint_every, (int, np.integer)) and checkpoint_every >= 0):
            raise ValueError(f"Session: checkpoint_every must be an int >= 0 (0: only where needed), got {checkpoint_every!r}")
        for obj in (self.recorder, self.hooks):
            if obj is not None:
                SERVED[obj] = weakref.ref(self)
        self.checkpoint_every = int(checkpoint_every)
        self.state = weights.new_state()
        self._tokens: list[int] = []
        self._logits: list[np.ndarray] = []  # host copies, never written after they are stored
        self._stacked = None  # `logits` as one read-only array, until the history changes
        self._modified: list[bool] = []  # per token: decoded with hooks that may change values
        self._generated: list[bool] = []  # per token: chosen by `generate` from the logits before it
        self._chunk_of: list[int] = []  # per token: first token of the fed chunk it was decoded in; -1: stepped
        # t -> state after t tokens (`checkpoint()`): its first t cache positions never change (the live state only
        # writes on past them into the MLA caches it shares); only ever copied
        self._checkpoints: dict[int, KimiDecodeState] = {}
        # first token of a fed chunk `truncate` cut -> the tokens it cut off: a replay of the history (the analyses)
        # re-decodes the chunk as it was fed, to the stored values bit for bit (the kept part alone rounds otherwise)
        self._cut_tails: dict[int, list[int]] = {}
        # first token of a fed chunk -> the sites recorded in full that changed how it was computed
        # (`Recorder.route_sites`; none: absent): its replays record them too, whatever records now
        self._routes: dict[int, tuple] = {}
        self._to_rebuild: set[int] = set()  # checkpoints a failed `recover()` dropped: the next one rebuilds them
        self._version = 0  # `history_version`: bumped by every change of the history

    # ------------------------------------------------------------------ history
    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def generated(self) -> list[bool]:
        """Per token: whether `generate` chose it (from the logits before it), rather than `step` or `feed`
        being given it. Kept through truncate, fork, snapshot/restore and session files."""
        return list(self._generated)

    @property
    def history_version(self) -> int:
        """A number that changes with every change of the history (a token decoded or dropped, a snapshot
        restored): while it stays the same, so do the tokens, logits and records. A view caching what it drew
        compares this, not the tokens, which a rewritten history can keep (`restore` of another run of them, or
        `back` then the same token under an intervention)."""
        return self._version

    @property
    def logits(self) -> np.ndarray:
        """[T, vocab] host array, read-only; built once per change of the history (`logits_at(t)`: one row)."""
        if self._stacked is None or self._stacked.shape[0] != len(self._logits):
            V = self.weights.config.vocab_size
            self._stacked = np.stack(self._logits) if self._logits else np.zeros((0, V), dtype=self.weights.dtype)
            self._stacked.flags.writeable = False
        return self._stacked

    def logits_at(self, t: int) -> np.ndarray:
        """A copy of token t's logits [vocab] (negative t counts from the end)."""
        return self._logits[history_position(t, len(self._logits), "Session.logits_at: t")].copy()

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def text(self) -> str:
        if self.tokenizer is None:
            raise ValueError("Session.text needs a tokenizer: Session(weights, tokenizer=...)")
        return self.tokenizer.decode(self._tokens)

    def trace(self, window=None):
        """The recorder's Trace of the whole history, or of `window` (a slice of token indices, or (start, stop)).

        Costs O(records) at any history length: the records grow incrementally as tokens are decoded,
        and a window is a view of them (`Trace.window`), so a view refreshing after each Step asks
        only for the tokens it shows."""
        if self.recorder is None:
            raise ValueError("this session records nothing: create it with Session(weights, recorder=True)")
        return self.recorder.trace(window=None if window is None else window_slice(window, "Session.trace"))

    def __repr__(self) -> str:
        state = self._state_nbytes() + sum(a.nbytes for a in self._logits)
        return (f"Session({len(self)} tokens, {len(self._checkpoints)} checkpoints, {state / 2**20:.1f} MiB of state "
                f"and logits; recorder {'on' if self.recorder is not None else 'off'}, {len(self.hooks)} hooks; "
                f"{self.weights.device} {np.dtype(self.weights.dtype).name})")

    def _state_nbytes(self) -> int:
        """Bytes of the state and the checkpoints, each array once (checkpoints share MLA caches); a
        pipeline's counted in its stages."""
        if not isinstance(self.state, KimiDecodeState):
            return self.weights.states_nbytes([self.state, *self._checkpoints.values()])
        return nbytes_once([self.state, *self._checkpoints.values()])

    # ------------------------------------------------------------------ decoding
    def _may_modify(self) -> bool:
        return len(self.hooks) > 0 or (self.recorder is not None and len(self.recorder) > 0)

    @one_thread
    def step(self, token_id) -> np.ndarray:
        """Decode one token; returns its logits [vocab] (a host copy)."""
        return self._step(token_id, generated=False)

    def _step(self, token_id, generated: bool) -> np.ndarray:
        t = len(self._tokens)
        parts = [h for h in (self.hooks if len(self.hooks) else None, self.recorder) if h is not None]
        hooks = parts[0] if len(parts) == 1 else (HookChain(*parts) if parts else None)
        if hooks is not None:
            hooks.begin_token(token_id if isinstance(token_id, (int, np.integer)) else None, t)
        modified = self._may_modify()
        try:
            logits = self.weights.forward_token(self.state, token_id, hooks)
            host = np.array(to_numpy(logits), copy=True)
            keep = modified or (self.checkpoint_every and (t + 1) % self.checkpoint_every == 0)
            checkpoint = self.state.checkpoint() if keep else None  # (failing, as the pass: a pipeline's stage lost)
            with uninterrupted():  # (a Ctrl-C between these lines left the lists, state and records disagreeing)
                self._tokens.append(int(token_id))
                self._logits.append(host)
                self._stacked = None
                self._version += 1
                self._modified.append(modified)
                self._generated.append(generated)
                self._chunk_of.append(-1)
                if checkpoint is not None:
                    self._checkpoints[t + 1] = checkpoint
            # (a Ctrl-C held meanwhile comes at the section's end: the token is then in the history, and kept)
        except StageLostError:
            if self.recorder is not None:  # the history stays as it was before this token; `recover()` rebuilds the state
                self.recorder.cut_for_session(t)
            raise
        except BaseException:
            if len(self._tokens) == t:  # not committed: the state is half-advanced; put it back as it was
                self._recover(t)
            raise
        return host.copy()

    @one_thread
    def feed(self, token_ids, chunk: int | None = None, progress: bool | None = None) -> np.ndarray:
        """Decode several tokens (ids, or a string when the session has a tokenizer); returns their logits [n, vocab].

        chunk: tokens per forward pass of the sequence path (default `kimi_sequence.default_chunk`: 512 for the
        embedded model, 2048 for K3; a
        checkpoint is kept at each chunk's end). progress: a progress bar (tqdm; default: for feeds of
        more than 4 chunks). Steps token by token while value-changing hooks are attached.
        A chunk (or stepped token) that raises leaves no trace: the history is as after the ones before it.
        """
        if isinstance(token_ids, str):
            if self.tokenizer is None:
                raise TypeError("Session.feed got a string but the session has no tokenizer; pass token ids")
            token_ids = self.tokenizer.encode(token_ids)
        elif not hasattr(token_ids, "__iter__") or getattr(token_ids, "ndim", 1) == 0:
            raise TypeError(f"Session.feed: token_ids must be a sequence of token ids (or text, with a tokenizer), got "
                            f"{token_ids!r} ({type(token_ids).__name__}); session.step(id) decodes one token")
        ids = token_indices(token_ids, self.weights.config.vocab_size)  # all checked before any decodes
        chunk = default_chunk(self.weights.config) if chunk is None else chunk
        if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
            raise ValueError(f"Session.feed: chunk must be a positive int (tokens per forward pass), got {chunk!r}")
        chunk = int(chunk)
        stepping = self._may_modify()
        bar = _progress(len(ids)) if (progress is None and len(ids) > 4 * chunk) or progress else None
        out = []
        try:
            for a in range(0, len(ids), 1 if stepping else chunk):
                out.append(self.step(ids[a])[None] if stepping else self._feed_chunk(ids[a : a + chunk]))
                if bar is not None:
                    bar.update(len(out[-1]))
        finally:
            if bar is not None:
                bar.close()
        return np.concatenate(out) if out else np.zeros((0, self.weights.config.vocab_size), self.weights.dtype)

    def _feed_chunk(self, ids: list[int]) -> np.ndarray:
        t = len(self._tokens)
        if self.recorder is not None:
            self.recorder.flush()
        try:
            host = np.array(to_numpy(self.weights.forward_sequence(self.state, ids, self.recorder, chunk=len(ids))), copy=True)
            checkpoint = self.state.checkpoint()
            with uninterrupted():  # (as `_step`'s)
                self._tokens += ids
                self._logits += list(host)  # row views of one array the session never writes
                self._stacked = None
                self._version += 1
                self._modified += [False] * len(ids)
                self._generated += [False] * len(ids)
                self._chunk_of += [t] * len(ids)
                if route := self._route():
                    self._routes[t] = route
                self._checkpoints[t + len(ids)] = checkpoint
        except StageLostError:
            if self.recorder is not None:
                self.recorder.cut_for_session(t)
            raise
        except BaseException:
            if len(self._tokens) == t:  # (as `_step`'s)
                self._recover(t)
            raise
        return host

    @one_thread
    def generate(self, n: int, temperature: float = 0.0, seed=None, stop_tokens=()) -> list[int]:
        """Decode n more tokens, each chosen from the previous logits: argmax at temperature 0, else sampled
        from softmax(logits / temperature) with `np.random.default_rng(seed)`. Stops early after a stop token."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"Session.generate: n (how many tokens to decode) must be an int >= 0, got {n!r}")
        if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, numbers.Real) or \
                not temperature >= 0:  # NaN too; a Fraction is a number, a Decimal or a string is not a float's
            raise ValueError(f"Session.generate: temperature must be a number >= 0, got {temperature!r}")
        try:
            temperature = float(temperature)
        except OverflowError:  # an int past float's range (10**400): as hot as inf
            temperature = math.inf
        if stop_tokens is None:  # (no stop token)
            stop_tokens = ()
        if isinstance(stop_tokens, (str, bytes)) or not hasattr(stop_tokens, "__iter__") or \
                (isinstance(stop_tokens, np.ndarray) and stop_tokens.ndim == 0):
            raise TypeError(f"Session.generate: stop_tokens must be a collection of token ids, got {stop_tokens!r}; "
                            f"one stop token t: stop_tokens=({stop_tokens!r},)")
        stop_tokens = list(stop_tokens)  # (an iterator, once: `in` would use it up at the first token)
        V = self.weights.config.vocab_size
        bad = [t for t in stop_tokens if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < V]
        if bad:  # never generated: the stop would never come
            raise ValueError(f"Session.generate: stop_tokens holds {bad[0]!r}, not a token id in 0..{V - 1}")
        stops = {int(t) for t in stop_tokens}
        if not self._logits:
            raise ValueError("Session.generate: feed a prompt first (session.feed(ids)); there are no logits to continue from")
        try:
            if isinstance(seed, (bool, np.bool_)):  # (default_rng takes True for seed 1)
                raise TypeError("a bool is not a seed")
            rng = np.random.default_rng(seed)
        except (TypeError, ValueError) as e:
            raise type(e)(f"Session.generate: seed must be None, an int >= 0, a SeedSequence or a Generator, got "
                          f"{seed!r} ({e})") from None
        out = []
        for _ in range(n):
            logits = self._logits[-1]
            refuse_unchoosable(logits, len(self._logits) - 1, "Session.generate")
            if temperature == 0:
                tid = int(np.argmax(logits))
            else:
                tid = int(rng.choice(logits.shape[0], p=sampling_probabilities(logits, temperature)))
            self._step(tid, generated=True)
            out.append(tid)
            if tid in stops:
                break
        return out

    # ------------------------------------------------------------------ interventions
    @contextlib.contextmanager
    def intervene(self, *hook_sets: Hooks):
        """Attach these hook sets (e.g. from `kimi_explore.inspection.interventions`) for the `with` block."""
        bad = [h for h in hook_sets if not isinstance(h, Hooks)]
        if bad:  # before the `with`: nothing attached
            raise TypeError(f"Session.intervene: {hooks_expected(bad[0])}")
        with self.hooks:
            for h in hook_sets:
                self.hooks.extend(h)
            yield self

    def hooked(self, name_or_glob=None, fn=None, *, names_filter=None):
        """`with session.hooked(name, fn):` one hook for the block."""
        return self.hooks.hooked(name_or_glob, fn, names_filter=names_filter)

    # ------------------------------------------------------------------ going back
    def state_after(self, n_tokens: int) -> KimiDecodeState:
        """A copy of the exact decode state after the first `n_tokens` tokens (the session is unchanged):
        the nearest kept checkpoint, then the tokens after it re-decoded as they were (at most
        `checkpoint_every` stepped tokens or one fed chunk), so its cost does not grow with the history."""
        T = len(self._tokens)
        n_tokens = int_in(n_tokens, 0, T, "Session.state_after: n_tokens")
        return self.state.copy() if n_tokens == T else self._state_after(n_tokens)

    def checkpoint_before(self, t: int) -> tuple[int, KimiDecodeState]:
        """(c, a copy of the decode state after the first c tokens) for the latest kept checkpoint c <= t
        (c = 0: a fresh state). Re-decoding tokens c..t from it reaches token t in at most
        `checkpoint_every` stepped tokens or one fed chunk, however long the history."""
        T = len(self._tokens)
        t = int_in(t, 0, T, "Session.checkpoint_before: t")
        c = max([k for k in self._checkpoints if k <= t], default=0)
        return c, (self._checkpoints[c].copy() if c else self.weights.new_state())

    def _state_after(self, t: int) -> KimiDecodeState:
        """The exact decode state after the first t tokens of the history."""
        c, state = self.checkpoint_before(t)
        changed = [s for s in range(c, t) if self._modified[s]]
        lost = [k for k in self._to_rebuild if c < k <= t]
        if changed and lost:
            raise StageLostError(f"cannot rebuild the state after {t} tokens: the checkpoint after token {max(lost) - 1} "
                                 "was lost with a pipeline stage and a recover() did not finish: call session.recover()")
        if changed:
            raise RuntimeError(f"cannot rebuild the state after {t} tokens exactly: tokens {changed} were decoded with "
                               f"value-changing hooks and no checkpoint after them is kept (nearest: {c})")
        for a, b in self.runs(c, t):
            if b is None:
                self.weights.forward_token(state, self._tokens[a])
            else:
                self.weights.forward_sequence(state, self._tokens[a:b], self._chunk_replayer(a), chunk=b - a)
        return state

    def _route(self) -> tuple:
        """The sites the session's recorder keeps in full where that changes how a fed chunk is computed."""
        return () if self.recorder is None else tuple(self.recorder.route_sites(hook_names(self.weights)))

    def _chunk_replayer(self, t: int):
        """The hooks a replay of the fed chunk holding token t runs with: a recorder keeping in full what the
        session's recorder kept in full when it fed the chunk, where that changes how a chunk is computed
        (`Recorder.route_sites`), so the replay rounds as the feed did (in a session recording otherwise too:
        loaded with recorder=False, or restored from another's snapshot); else None. Fed chunks had no other
        hooks (value-changing hooks make `feed` step)."""
        full = self._routes.get(self._chunk_of[t])
        return Recorder(names_filter=lambda name: False, full=list(full)).bind(self.weights) if full else None

    def runs(self, c: int = 0, t: int | None = None):
        """Tokens c..t-1 (default: the whole history) as the forward passes that decoded them: (s, None) for
        a stepped token, (a, b) for the part of a fed chunk. Replaying these exactly reproduces the history."""
        T = len(self._tokens)
        t = T if t is None else t
        c = int_in(c, 0, T, "Session.runs: c", f" (0 <= c <= t <= the {T} tokens)")
        t = int_in(t, c, T, "Session.runs: t", f" (0 <= c <= t <= the {T} tokens)")
        s = c
        while s < t:
            start = self._chunk_of[s]
            if start < 0:
                yield s, None
                s += 1
                continue
            b = s
            while b < t and self._chunk_of[b] == start:
                b += 1
            yield s, b
            s = b

    def _recover(self, t: int) -> None:
        self.state = self._state_after(t)
        if self.recorder is not None:
            self.recorder.cut_for_session(t)

    @one_thread
    def truncate(self, n_tokens: int) -> None:
        """Keep the first `n_tokens` tokens (0 <= n_tokens <= len) and drop the rest: state, logits, records
        and checkpoints as they were after token n_tokens - 1. `truncate(0)` empties the session."""
        T = len(self._tokens)
        n = int_in(n_tokens, 0, T, "Session.truncate: n_tokens (how many tokens to keep)", "; session.back(k) drops the last k")
        tail = self._tail_cut_by(n)
        state = self._state_after(n)  # (a replay: interrupted, nothing has changed yet)
        with uninterrupted():  # the cut, whole (a Ctrl-C inside left the recorder's records uncut, or half cut)
            self.state = state
            self._drop_after(n)
            self._share_caches()
            self._cut_tails.update(tail)
            if n and self._chunk_of[n - 1] >= 0 and n not in self._checkpoints:  # cut inside a fed chunk
                self._checkpoints[n] = self.state.checkpoint()

    def _share_caches(self) -> None:
        """After a truncate, the kept checkpoints take the new state's MLA caches where they have its capacity:
        the state was rebuilt as a copy (a checkpoint's, then an exact replay), so it holds their positions bit for
        bit, and it only appends past them. Else every truncate would keep one more copy of the caches alive
        (200 back()s over 6,400 tokens: 2.3 GB). New checkpoint records: a snapshot keeps the ones it holds."""
        if not isinstance(self.state, KimiDecodeState):  # (a pipeline's states live in its stages)
            return
        live = [ls.attention for ls in self.state.layers]
        for t, kept in self._checkpoints.items():
            layers = [ls if ls.attention.kind != "mla" or ls.attention.keys is own.keys
                      or ls.attention.keys.shape != own.keys.shape
                      else KimiLayerState(dataclasses.replace(own, length=ls.attention.length))
                      for ls, own in zip(kept.layers, live, strict=True)]
            if any(a is not b for a, b in zip(layers, kept.layers, strict=True)):
                self._checkpoints[t] = dataclasses.replace(kept, layers=layers)

    def _tail_cut_by(self, n: int) -> dict:
        """{first token of the fed chunk truncating to n cuts: every token of it after n-1, as fed}, or {}."""
        T = len(self._tokens)
        if not 0 < n < T or self._chunk_of[n] < 0 or self._chunk_of[n] != self._chunk_of[n - 1]:
            return {}
        a, e = self._chunk_of[n], n
        while e < T and self._chunk_of[e] == a:
            e += 1
        return {a: self._tokens[n:e] + self._cut_tails.get(a, [])}

    def cut_tail(self, start: int) -> list[int]:
        """The tokens `truncate` cut off the fed chunk that starts at token `start` ([] if none): that chunk was
        decoded as tokens[start:end] + these, and a replay that re-decodes it so reproduces its values exactly."""
        if isinstance(start, (bool, np.bool_)) or not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(f"Session.cut_tail: start must be an int >= 0 (a fed chunk's first token), got {start!r}")
        return list(self._cut_tails.get(int(start), []))

    def decoded_with_hooks(self, t: int) -> bool:
        """Whether token t was decoded while hooks that may change values were attached (`session.hooks`, or hooks
        added to the recorder): a replay of it must then give its logits bit for bit (`recover()`, the analyses)."""
        return self._modified[history_position(t, len(self._tokens), "Session.decoded_with_hooks: t")]

    def chunk_route(self, t: int) -> tuple:
        """The sites kept in full (`Recorder.route_sites`) when the fed chunk holding token t was fed (() for a
        stepped token): a replay of that chunk keeps them in full too, so it rounds as the feed did."""
        chunk = self._chunk_of[history_position(t, len(self._tokens), "Session.chunk_route: t")]
        return tuple(self._routes.get(chunk, ())) if chunk >= 0 else ()

    def _drop_after(self, n: int) -> None:
        """Forget tokens n.. (the state is already the one after n tokens)."""
        if n < len(self._tokens):
            self._version += 1
        del self._tokens[n:], self._logits[n:], self._modified[n:], self._generated[n:], self._chunk_of[n:]
        self._stacked = None
        # a checkpoint after n belongs to the discarded future: kept, it would seed a later replay of a new history
        self._checkpoints = {k: v for k, v in self._checkpoints.items() if k <= n}
        self._cut_tails = {a: tail for a, tail in self._cut_tails.items() if a < n}
        self._routes = {a: route for a, route in self._routes.items() if a < n}
        self._to_rebuild = {k for k in self._to_rebuild if k <= n}
        if self.recorder is not None:
            self.recorder.cut_for_session(n)

    def back(self, k: int = 1) -> None:
        """Drop the last `k` tokens (0 <= k <= len): `truncate(len(self) - k)`."""
        T = len(self._tokens)
        self.truncate(T - int_in(k, 0, T, "Session.back: k (how many tokens to drop)"))

    @one_thread
    def recover(self) -> list[int]:
        """After a pipeline stage was lost (`StageLostError`): restart it from its shards and rebuild the
        decode state and the kept checkpoints by replaying the token history through the pipeline, each
        token the way it was decoded: those decoded with value-changing hooks with the session's hooks
        (`session.hooks` and the recorder's), whose logits must then equal the stored ones bit for bit;
        the others as `truncate` replays them (`_state_after`). The session continues exactly as if
        nothing had happened; records are the driver's and are kept. Returns the restarted stages' numbers."""
        restarted = self.weights.restart_lost_stages()
        sets = [h for h in (self.hooks, self.recorder.hooks.copy() if self.recorder is not None else None) if h]
        hooks = HookChain(*sets) if sets else None
        keep = set(self._checkpoints) | self._to_rebuild
        self._checkpoints.clear()  # their handles on a restarted stage are gone (dropped now, not held through the replay)
        self._to_rebuild = keep  # ... but kept in mind: a replay that fails (a hook raising, another stage lost)
        state, checkpoints, bad = self._replay(hooks, len(self._tokens), keep)  # leaves them to the next recover()
        if bad is not None:
            state, checkpoints, _ = self._replay(hooks, bad, keep)
        self.state, self._checkpoints, self._to_rebuild = state, checkpoints, set()
        if bad is not None:
            self._drop_after(bad)
            raise RuntimeError(f"Session.recover: replaying token {bad} gives other logits than the session stored: it "
                               "was decoded under hooks the session no longer holds (a temporary intervention), so the "
                               f"history from it on cannot be rebuilt; the session now holds its first {bad} tokens")
        return restarted

    def _replay(self, hooks, n: int, keep: set):
        """Decode the first n tokens from a fresh state, each the way it was decoded: (state, {t in keep:
        state copy}, first token decoded with value-changing hooks whose logits differ from the stored
        ones, or None).

        Fed chunks run with `_chunk_replayer`, as they were fed. Only the tokens decoded with
        value-changing hooks (each stepped) get `hooks` and are compared: hooks attached after a token was
        decoded must not act on it, and the first part of a fed chunk cut by `truncate` is replayed as
        one chunk, as `truncate` built the state from it, whose logits differ in the last bits from the
        stored ones (decoded within the longer chunk)."""
        state, checkpoints = self.weights.new_state(), {}
        for a, b in self.runs(0, n):
            if b is None:
                hooked = hooks if self._modified[a] else None
                if hooked is not None:
                    hooked.begin_token(self._tokens[a], a)
                got = to_numpy(self.weights.forward_token(state, self._tokens[a], hooked))
                if self._modified[a] and not np.array_equal(got, self._logits[a]):
                    return state, checkpoints, a
                b = a + 1
            else:
                self.weights.forward_sequence(state, self._tokens[a:b], self._chunk_replayer(a), chunk=b - a)
            if b in keep:
                checkpoints[b] = state.checkpoint()
        return state, checkpoints, None

    def snapshot(self, copy_arrays: bool = False) -> SessionSnapshot:
        """The whole history as a `SessionSnapshot` (the state is copied; logits, checkpoints and records are
        shared unless copy_arrays: safe, since the session never writes them, nor a checkpoint's used cache
        positions)."""
        records = self.recorder.state_dict(copy_arrays=copy_arrays) if self.recorder is not None else None
        if copy_arrays:
            logits, kept = [a.copy() for a in self._logits], self._checkpoints
            if isinstance(self.state, KimiDecodeState):  # copies sharing their MLA caches as these do
                checkpoints = dict(zip(kept, copy_sharing(list(kept.values())), strict=True))
            else:  # a pipeline's, copied in its stages, sharing as these do
                checkpoints = dict(zip(kept, self.weights.copy_kept(list(kept.values())), strict=True))
        else:
            logits, checkpoints = list(self._logits), dict(self._checkpoints)
        return SessionSnapshot(id(self.weights), self.state.copy(), list(self._tokens), logits,
                               list(self._modified), checkpoints, records, list(self._chunk_of),
                               {a: list(tail) for a, tail in self._cut_tails.items()}, dict(self._routes),
                               list(self._generated))

    @one_thread
    def restore(self, snap: SessionSnapshot) -> None:
        """Go back (or forward) to `snap` exactly; the snapshot stays usable.

        Over a RayPipeline whose stage restarted since the snapshot (its states there are gone), the
        snapshot's history is replayed as `recover()` replays one (restarting a lost stage first; as there,
        tokens decoded under an intervention no longer attached cannot be replayed: the history stops before them)."""
        if not isinstance(snap, SessionSnapshot):
            raise TypeError(f"Session.restore: expected a SessionSnapshot (session.snapshot()), got {type(snap).__name__}")
        if snap.weights_id != id(self.weights):
            raise ValueError("Session.restore: this snapshot was taken from a session over other weights")
        _refuse_other_records(self.recorder, snap, "Session.restore: the snapshot",
                              ("create the session with recorder=False",
                               "create the session with a Recorder of the snapshot's settings"))
        try:
            state = snap.state.copy()
        except StageLostError:  # a pipeline's: a stage was lost or restarted since the snapshot
            state = None
        with uninterrupted():  # the whole history at once (a Ctrl-C inside left the records another history's)
            self._take(snap, state)
        if state is None:
            self.recover()
        T, last = len(self._tokens), max(self._checkpoints, default=0)
        if any(self._modified[last:T]):  # a file saved without checkpoints: keep one of this exact state, which a
            self._checkpoints[T] = self.state.checkpoint()  # failed step goes back to (nothing could rebuild it)

    def _take(self, snap: SessionSnapshot, state) -> None:
        """`restore`'s assignments: the snapshot's history (`state`: a copy of its state, or None to rebuild)."""
        self.state = state if state is not None else snap.state
        self._version += 1
        self._tokens, self._logits, self._modified = list(snap.tokens), list(snap.logits), list(snap.modified)
        self._chunk_of = list(snap.chunk_of) if snap.chunk_of is not None else [-1] * len(snap.tokens)
        self._generated = list(snap.generated) if snap.generated is not None else [False] * len(snap.tokens)
        self._stacked = None
        self._checkpoints, self._to_rebuild = dict(snap.checkpoints), set()
        self._cut_tails = {int(a): list(tail) for a, tail in (snap.cut_tails or {}).items()}
        if snap.routes is not None:
            self._routes = {int(a): tuple(route) for a, route in snap.routes.items()}
        else:  # a file from before routes were kept: its chunks fed as this session's recorder feeds
            route = self._route()
            self._routes = {a: route for a in set(self._chunk_of) if a >= 0} if route else {}
        if self.recorder is not None:
            self.recorder.load_state_dict(snap.records)

    def fork(self) -> Session:
        """An independent session with the same weights, history, hooks and records (all arrays copied).
        Hooks a `with session.intervene(...)` block holds are the fork's own from then on: the block's end
        removes them from this session only."""
        recorder = self.recorder.copy(records=False) if self.recorder is not None else False  # restore() copies them
        other = Session(self.weights, recorder=recorder, tokenizer=self.tokenizer, hooks=self.hooks.copy(),
                        checkpoint_every=self.checkpoint_every)
        other.restore(self.snapshot(copy_arrays=True))
        return other

    # ------------------------------------------------------------------ files
    def save_state(self, path, checkpoints: bool = True) -> Path:
        """One .npz with the decode state, tokens, logits, records and the weights' fingerprint.

        checkpoints=False leaves the kept state copies out (smaller file; a loaded session can then
        truncate exactly only over tokens decoded without value-changing hooks).
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"Session.save_state: path must be a file path (str or Path), got {type(path).__name__} {path!r}")
        if not isinstance(checkpoints, (bool, np.bool_)):  # ("no" would be true)
            raise TypeError(f"Session.save_state: checkpoints must be True or False, got {checkpoints!r}")
        return save_session(path, self.weights, self.snapshot(), self.checkpoint_every, self.recorder, checkpoints,
                            self.tokenizer)

    @_constructor
    def load_state(cls, path, weights, recorder=True, tokenizer=None, hooks: Hooks | None = None) -> Session:
        """A new session over `weights` continuing from a `save_state` file: `s = Session.load_state(path, weights)`
        (errors if the model differs, or if `tokenizer` is not the one it was saved with). The continuation is bit
        for bit the saved session's with the weights loaded as they were (the same `from_pretrained` options and
        device); other options (say weight_dtype="bfloat16") continue it to rounding.

        recorder=True records as the saved session did (off if it recorded nothing); False: no recorder."""
        _refuse_not_weights(weights, "Session.load_state")  # before the file is read
        snap, saved = load_session(path, weights, tokenizer)
        if recorder is True:
            try:
                recorder = Recorder(**saved.recorder) if saved.recorder is not None else False
            except (TypeError, ValueError) as e:  # (a file from before digests, edited)
                raise ValueError(f"{path}: the header's 'recorder' settings are not a Recorder's ({e}): the file is "
                                 "damaged") from None
        if isinstance(recorder, Recorder):  # refused before a session binds it (a failed load leaves it free)
            _refuse_other_records(recorder, snap, f"Session.load_state: {path}",
                                  ("pass recorder=False", "pass recorder=True (the file's settings)"), hook_names(weights))
        s = cls(weights, recorder=recorder, tokenizer=tokenizer, hooks=hooks, checkpoint_every=saved.checkpoint_every)
        try:
            s.restore(snap)
        except BaseException:  # (a Ctrl-C, a lost stage): what the caller gave is free again, without records
            s._release()  # (the session lives on in the traceback, which Jupyter keeps)
            raise
        return s

    def _release(self) -> None:
        """Unbind this session's Recorder and Hooks (each serves one live Session) and drop the recorder's records: a
        session that failed to load, whose caller passes them to another."""
        for obj in (self.recorder, self.hooks):
            if obj is not None and (owner := SERVED.get(obj)) is not None and owner() is self:
                del SERVED[obj]
        if self.recorder is not None:
            self.recorder.cut_for_session(0)


def _refuse_not_weights(weights, what: str) -> None:
    if not hasattr(weights, "config"):
        raise TypeError(f"{what}: weights: expected the model from ke.from_pretrained(...) or a ke.RayPipeline, got "
                        f"{type(weights).__name__}" + (" (a path: load it with ke.from_pretrained(path) first)"
                                                       if isinstance(weights, (str, Path)) else ""))


def sampling_probabilities(logits, temperature: float) -> np.ndarray:
    """softmax(logits / temperature) in float64, for any temperature > 0: shifted by the max before dividing (a tiny
    temperature made inf - inf = NaN), +inf logits share all the probability, -inf ones get none (also at an infinite
    temperature, where the finite ones share it evenly). The logits hold a finite or +inf value (`refuse_unchoosable`)."""
    z = logits.astype(np.float64)
    top = z.max()
    if top == np.inf:
        p = (z == np.inf).astype(np.float64)
    else:
        p = np.zeros_like(z)
        live = z > -np.inf
        with np.errstate(over="ignore", under="ignore"):
            p[live] = np.exp((z[live] - top) / temperature)  # 1 at the max, the rest in [0, 1]
    return p / p.sum()


def refuse_unchoosable(logits, t: int, what: str) -> None:
    """Before choosing a token from the logits after token t: argmax (or a sample) of NaN logits, or of logits all
    -inf, would return id 0 or the first NaN's, a token chosen from nothing."""
    nan = np.isnan(logits)
    if nan.any():
        raise FloatingPointError(
            f"{what}: the logits after token {t} hold NaN ({int(nan.sum())} of {logits.size}, the first at id "
            f"{int(np.flatnonzero(nan)[0])}): no token to choose; find where it entered with a Recorder (the first "
            "non-finite record) before generating")
    if not (logits > -np.inf).any():
        raise FloatingPointError(f"{what}: the logits after token {t} are all -inf: no token to choose")


def _refuse_other_records(recorder, snap: SessionSnapshot, what: str, fix: tuple[str, str], names=None) -> None:
    """Refuse to continue `snap`'s records with `recorder` (None: nothing to check) when their rows would not line
    up; `fix`: what to do (no records saved, other settings); `names`: the model's sites (default: the recorder's
    bound model's; an unbound recorder has none, and every filter would seem to agree)."""
    if recorder is None:
        return
    if snap.records is None:
        raise ValueError(f"{what} holds no records (its session recorded nothing) but there is a recorder; {fix[0]}")
    differ = recorder.differences(snap.records["settings"], names)
    if differ:
        raise ValueError(f"{what}'s records were made by a Recorder with other settings than this session's: "
                         + "; ".join(differ) + f" (its rows would not line up with the next tokens'); {fix[1]}")


def _progress(total: int):
    from tqdm.auto import tqdm  # a dependency of huggingface-hub

    return tqdm(total=total, unit="tok", desc="feed")
