"""Session: step through K3 token by token, with a history you can rewind, fork, save and reload exactly.

    s = Session(weights)                      # records with a default Recorder
    s.feed([17, 203, 5]); s.step(88)          # logits of each step, host NumPy
    s.generate(8)                             # greedy (temperature=0) or seeded sampling
    s.tokens, s.logits, s.trace()             # history: [T] ids, [T, V] logits, the Recorder's Trace
    snap = s.snapshot(); ...; s.restore(snap)
    s.rewind(2); s.step(5)                    # back to the first 2 tokens, then a different third
    other = s.fork()                          # an independent copy (shares only the weights)
    with s.intervene(interventions.ablate_experts(3, "all")): s.step(7)
    s.save_state("bug.npz"); Session.load_state("bug.npz", weights)

Exactness: every restore is bit-identical. The session keeps copies of the decode state
("checkpoints") after every `checkpoint_every`-th token and after every token decoded while hooks
that may change values (`session.hooks`, or hooks added to the recorder) were attached; `rewind(t)`
copies the nearest checkpoint at or before t and re-decodes the tokens after it without hooks.
Those tokens were decoded without value-changing hooks, so the replay repeats the same arithmetic
on the same inputs. State copies keep every array's shape (an MLA cache keeps its capacity), so
the replayed arithmetic runs on the same layouts too. Memory: one checkpoint is one decode state
(KDA matrices + MLA caches); lower `checkpoint_every` for faster rewinds, raise it to save memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import numpy as np

from ..backend import to_numpy
from ..model.kimi_decoder import KimiDecodeState, KimiLayerState, kimi_forward_token
from .hooks import HookChain, Hooks
from .recorder import Recorder

__all__ = ["Session", "SessionSnapshot", "copy_state"]


def copy_state(state: KimiDecodeState) -> KimiDecodeState:
    """A deep copy that keeps every array's shape (unlike a compacting copy), so replays are exact."""
    return KimiDecodeState([KimiLayerState(_copy_arrays(ls.attention)) for ls in state.layers], state.position)


def _copy_arrays(record):
    arrays = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    return dataclasses.replace(record, **{k: v.copy() for k, v in arrays.items() if hasattr(v, "shape")})


@dataclasses.dataclass
class SessionSnapshot:
    """What `Session.snapshot()` returns: a private copy of the decode state plus the history lengths' contents."""

    weights_id: int
    state: KimiDecodeState
    tokens: list
    logits: list
    modified: list
    checkpoints: dict
    records: dict | None

    def __len__(self) -> int:
        return len(self.tokens)


class Session:
    """One decode stream over `weights`, with its history (see module docstring)."""

    def __init__(self, weights, recorder=True, tokenizer=None, hooks: Hooks | None = None, checkpoint_every: int = 16):
        self.weights = weights
        self.tokenizer = tokenizer
        if recorder is True:
            recorder = Recorder()
        elif recorder is False:
            recorder = None
        if recorder is not None and not isinstance(recorder, Recorder):
            raise TypeError(f"Session: recorder must be True, False/None or a Recorder, got {type(recorder).__name__}")
        self.recorder = recorder.bind(weights) if recorder is not None else None
        self.hooks = (hooks if hooks is not None else Hooks()).bind(weights)
        if not (isinstance(checkpoint_every, int) and checkpoint_every >= 0):
            raise ValueError(f"Session: checkpoint_every must be an int >= 0 (0: only where needed), got {checkpoint_every!r}")
        self.checkpoint_every = checkpoint_every
        self.state = KimiDecodeState.new(weights)
        self._tokens: list[int] = []
        self._logits: list[np.ndarray] = []  # host copies, never written after they are stored
        self._stacked = None  # `logits` as one read-only array, until the history changes
        self._modified: list[bool] = []  # per token: decoded with hooks that may change values
        self._checkpoints: dict[int, KimiDecodeState] = {}  # t -> state after t tokens; never written either

    # ------------------------------------------------------------------ history
    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

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
        return self._logits[t].copy()

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def text(self) -> str:
        if self.tokenizer is None:
            raise ValueError("Session.text needs a tokenizer: Session(weights, tokenizer=...)")
        return self.tokenizer.decode(self._tokens)

    def trace(self):
        if self.recorder is None:
            raise ValueError("this session records nothing: create it with Session(weights, recorder=True)")
        return self.recorder.trace()

    def __repr__(self) -> str:
        return f"Session({len(self)} tokens, recorder={'on' if self.recorder is not None else 'off'}, hooks={len(self.hooks)})"

    # ------------------------------------------------------------------ decoding
    def _may_modify(self) -> bool:
        return len(self.hooks) > 0 or (self.recorder is not None and len(self.recorder) > 0)

    def step(self, token_id) -> np.ndarray:
        """Decode one token; returns its logits [vocab] (a host copy)."""
        t = len(self._tokens)
        parts = [h for h in (self.hooks if len(self.hooks) else None, self.recorder) if h is not None]
        hooks = parts[0] if len(parts) == 1 else (HookChain(*parts) if parts else None)
        if hooks is not None:
            hooks.begin_token(token_id if isinstance(token_id, (int, np.integer)) else None, t)
        modified = self._may_modify()
        try:
            logits = kimi_forward_token(self.weights, self.state, token_id, hooks=hooks)
            host = np.array(to_numpy(logits), copy=True)
        except BaseException:
            self._recover(t)  # a failed step leaves the state half-advanced: put it back as it was
            raise
        self._tokens.append(int(token_id))
        self._logits.append(host)
        self._stacked = None
        self._modified.append(modified)
        if modified or (self.checkpoint_every and (t + 1) % self.checkpoint_every == 0):
            self._checkpoints[t + 1] = copy_state(self.state)
        return host.copy()

    def feed(self, token_ids) -> np.ndarray:
        """Decode several tokens (ids, or a string when the session has a tokenizer); returns their logits [n, vocab]."""
        if isinstance(token_ids, str):
            if self.tokenizer is None:
                raise TypeError("Session.feed got a string but the session has no tokenizer; pass token ids")
            token_ids = self.tokenizer.encode(token_ids)
        out = [self.step(t) for t in token_ids]
        return np.stack(out) if out else np.zeros((0, self.weights.config.vocab_size), self.weights.dtype)

    def generate(self, n: int, temperature: float = 0.0, seed=None, stop_tokens=()) -> list[int]:
        """Decode n more tokens, each chosen from the previous logits: argmax at temperature 0, else sampled
        from softmax(logits / temperature) with `np.random.default_rng(seed)`. Stops early after a stop token."""
        if not self._logits:
            raise ValueError("Session.generate: feed a prompt first (session.feed(ids)); there are no logits to continue from")
        if temperature < 0:
            raise ValueError(f"Session.generate: temperature must be >= 0, got {temperature}")
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            logits = self._logits[-1]
            if temperature == 0:
                tid = int(np.argmax(logits))
            else:
                z = logits.astype(np.float64) / temperature
                p = np.exp(z - z.max())
                tid = int(rng.choice(p.shape[0], p=p / p.sum()))
            self.step(tid)
            out.append(tid)
            if tid in stop_tokens:
                break
        return out

    # ------------------------------------------------------------------ interventions
    @contextlib.contextmanager
    def intervene(self, *hook_sets: Hooks):
        """Attach these hook sets (e.g. from `kimi_explore.inspection.interventions`) for the `with` block."""
        with self.hooks:
            for h in hook_sets:
                self.hooks.extend(h)
            yield self

    def hooked(self, name_or_glob=None, fn=None, *, names_filter=None):
        """`with session.hooked(name, fn):` one hook for the block."""
        return self.hooks.hooked(name_or_glob, fn, names_filter=names_filter)

    # ------------------------------------------------------------------ going back
    def _state_after(self, t: int) -> KimiDecodeState:
        """The exact decode state after the first t tokens of the history."""
        c = max([k for k in self._checkpoints if k <= t], default=0)
        state = copy_state(self._checkpoints[c]) if c else KimiDecodeState.new(self.weights)
        changed = [s for s in range(c, t) if self._modified[s]]
        if changed:
            raise RuntimeError(f"cannot rebuild the state after {t} tokens exactly: tokens {changed} were decoded with "
                               f"value-changing hooks and no checkpoint after them is kept (nearest: {c})")
        for s in range(c, t):
            kimi_forward_token(self.weights, state, self._tokens[s])
        return state

    def _recover(self, t: int) -> None:
        self.state = self._state_after(t)
        if self.recorder is not None:
            self.recorder.truncate(t)

    def rewind(self, t: int) -> None:
        """Keep the first t tokens (0 <= t <= len): state, logits and records as they were then."""
        if not (isinstance(t, (int, np.integer)) and 0 <= t <= len(self._tokens)):
            raise ValueError(f"Session.rewind: t must be an int in 0..{len(self._tokens)}, got {t!r}")
        t = int(t)
        self.state = self._state_after(t)
        del self._tokens[t:], self._logits[t:], self._modified[t:]
        self._stacked = None
        self._checkpoints = {k: v for k, v in self._checkpoints.items() if k <= t}
        if self.recorder is not None:
            self.recorder.truncate(t)

    def snapshot(self) -> SessionSnapshot:
        """A restorable copy of where the session is now (cheap: the state is copied, history arrays shared)."""
        return SessionSnapshot(id(self.weights), copy_state(self.state), list(self._tokens), list(self._logits),
                               list(self._modified), dict(self._checkpoints),
                               self.recorder.state_dict() if self.recorder is not None else None)

    def restore(self, snap: SessionSnapshot) -> None:
        """Go back (or forward) to `snap` exactly; the snapshot stays usable."""
        if snap.weights_id != id(self.weights):
            raise ValueError("Session.restore: this snapshot was taken from a session over other weights")
        self.state = copy_state(snap.state)
        self._tokens, self._logits, self._modified = list(snap.tokens), list(snap.logits), list(snap.modified)
        self._stacked = None
        self._checkpoints = dict(snap.checkpoints)
        if self.recorder is not None:
            if snap.records is None:
                raise ValueError("Session.restore: the snapshot was taken without a recorder, this session has one")
            self.recorder.load_state_dict(snap.records)

    def fork(self) -> Session:
        """An independent session with the same weights, history, hooks and records (all arrays copied)."""
        other = Session.__new__(Session)
        other.weights, other.tokenizer, other.checkpoint_every = self.weights, self.tokenizer, self.checkpoint_every
        other.recorder = self.recorder.copy(deep=True) if self.recorder is not None else None
        other.hooks = self.hooks.copy()
        other.state = copy_state(self.state)
        other._tokens, other._modified = list(self._tokens), list(self._modified)
        other._logits, other._stacked = [a.copy() for a in self._logits], None
        other._checkpoints = {k: copy_state(v) for k, v in self._checkpoints.items()}
        return other

    # ------------------------------------------------------------------ files
    def save_state(self, path, checkpoints: bool = True) -> Path:
        """One .npz with the decode state, tokens, logits, records and the weights' fingerprint.

        checkpoints=False leaves the kept state copies out (smaller file; a loaded session can then
        rewind exactly only over tokens decoded without value-changing hooks).
        """
        from ._session_io import save_session

        return save_session(self, path, checkpoints)

    @classmethod
    def load_state(cls, path, weights, recorder=True, tokenizer=None, hooks: Hooks | None = None) -> Session:
        """A session over `weights` continuing exactly from a `save_state` file (errors if the model differs)."""
        from ._session_io import load_session

        return load_session(cls, path, weights, recorder, tokenizer, hooks)
