"""Replay a session's history with capture hooks: the per-token values the analyses need.

The default Recorder keeps cheap derived values (softmax weights, norms, top-k), not the [d]-wide
vectors a logit lens or an attribution reads (running sums, sealed blocks, attention and FFN
outputs). Rather than record those for every token up front, an analysis re-decodes the session's
tokens from a fresh state with `session.hooks` (its persistent interventions) plus a Recorder that
copies the wanted sites, in the same forward passes that decoded the history: fed chunks as chunks
on the sequence path, each with the sites kept in full that changed how it was computed when it was
fed (`Session.chunk_route`, whatever the session records now), stepped tokens stepped. A chunk
`truncate` cut (Back after a feed) is re-decoded whole, with the tokens cut off it
(`Session.cut_tail`), as it was fed; the history then goes on from the state truncate left at the
cut (its checkpoint there; without one, e.g. in a session file saved without checkpoints, the kept
part re-decoded alone from a copy of the state before the chunk, as truncate decoded it). So the
replay repeats the history's arithmetic, and its logits are the stored ones bit for bit; they are
checked against them: to REPLAY_RTOL (which admits a BLAS that now splits its work otherwise; REPLAY_RTOL_FLOAT64 in
float64), and
bit for bit for the tokens decoded under value-changing hooks (`Session.decoded_with_hooks`, as
`Session.recover` checks them; NaN matches NaN in the same places). A history decoded under a
temporary intervention (`with session.intervene(...)`) does not replay to the same logits, however
small its effect: that is reported, never analysed silently; so is one decoded before hooks were
added to `session.hooks` (above REPLAY_RTOL: a token decoded without hooks is held to the tolerance
only). Capturing changes no value.
"""

from __future__ import annotations

import numpy as np

from ..backend import to_numpy
from ..inspection.hooks import HookChain
from ..inspection.recorder import Recorder
from ..inspection.targets import history_position
from ..model.kimi_decoder import hook_names

REPLAY_RTOL = 1e-4  # the sequence path agrees with stepping to float32 rounding (~1e-6 of the logits' scale)
# ... and to float64 rounding in float64 (~1e-12; a temporary intervention 2e-5 off the logits passed 1e-4 there)
REPLAY_RTOL_FLOAT64 = 1e-9


def site_names(model, suffixes, globals_=()) -> list[str]:
    """This model's hook names ending in one of `suffixes` (layer sites), plus the global ones asked for."""
    suffixes = tuple(suffixes)
    return [n for n in hook_names(model) if n in globals_ or (n.startswith("layers.") and n.endswith(suffixes))]


def replay(session, names, positions=None, from_checkpoint: bool = False):
    """Yield (t, values, logits) for the tokens t of `session`'s history in `positions` (default: all).

    The history is re-decoded from a fresh state the way it was decoded (`session.runs()`: fed chunks
    as the same chunks on the sequence path, stepped tokens stepped), so the values for a token do not
    depend on which other positions were asked for, with `session.hooks` and a Recorder keeping full
    copies of `names`. values: {site name: the value that flowed there at token t}, on the model's
    backend (over a pipeline they come back from the stages); logits: the replayed logits [vocab]
    (host), checked against the stored ones. Stops after the run holding the last wanted position.

    from_checkpoint: start from the latest checkpoint the session kept at or before the first wanted
    position (`Session.checkpoint_before`) instead of token 0, so the cost does not grow with the
    history: at most `checkpoint_every` stepped tokens, or one fed chunk, before it are re-decoded
    (and checked; the tokens before the checkpoint are not). Re-decoding those tokens any other way
    (stepped tokens as one chunk) is not exact: at K3's depth the sequence path's float32 rounding
    flips near-tied expert choices, and the replay shows values the history never had.
    """
    tokens = session.tokens
    T = len(tokens)
    if T == 0:
        raise ValueError("the session has no tokens: feed a prompt first (session.feed(ids))")
    wanted = set(range(T)) if positions is None else {history_position(p, T, "replay: positions") for p in positions}
    model = session.weights
    current = () if session.recorder is None else tuple(session.recorder.route_sites(hook_names(model)))
    chains: dict[tuple, tuple] = {}  # route -> (hooks, capture): a fed chunk replays on the route it was fed on

    def hooks_for(route: tuple):
        if route not in chains:
            capture = Recorder(names_filter=lambda name: False, full=list(names) + list(route)).bind(model)
            chains[route] = (HookChain(session.hooks.copy(), capture) if len(session.hooks) else capture, capture)
        return chains[route]

    c, state = session.checkpoint_before(min(wanted)) if from_checkpoint else (0, model.new_state())
    last = max(wanted)
    for a, b in session.runs(c):
        route = () if b is None else _chunk_route(session, a, current)
        hooks, capture = hooks_for(route)
        tail = [] if b is None else _cut_tail(session, a)
        if b is None:
            hooks.begin_token(tokens[a], a)
            logits, b = to_numpy(model.forward_token(state, tokens[a], hooks))[None], a + 1
        elif tail:
            # a chunk `truncate` cut: re-decoded whole, as it was fed (its kept part alone rounds otherwise, and at
            # K3's depth that flips near-tied experts and moves logits by up to ~1) ...
            resume = None
            if b <= last:  # ... and the history goes on from the state truncate left at the cut: its checkpoint
                at, resume = session.checkpoint_before(b)
                if at != b:  # (none kept, e.g. a file saved without checkpoints): the kept part alone, as truncate
                    resume = state.copy()  # decoded it, on the chunk's route
                    model.forward_sequence(resume, tokens[a:b], _route_recorder(model, route), chunk=b - a)
            logits = to_numpy(model.forward_sequence(state, tokens[a:b] + tail, hooks, chunk=b - a + len(tail)))
            state = resume if resume is not None else state
        else:
            logits = to_numpy(model.forward_sequence(state, tokens[a:b], hooks, chunk=b - a))
            if b <= last and any(hooked(session, t) for t in range(b, last + 1)):
                # ... and the tokens after it, checked bit for bit, go on from the history's own state after it (its
                # checkpoint): hooks held now that were not when it was fed (a token-form hook, one at kda.state)
                # run it on another route, whose state rounds otherwise
                at, kept = session.checkpoint_before(b)
                state = kept if at == b else state
        records = capture.take_records()
        for t in range(a, b):
            check_replay(logits[t - a], session.logits_at(t), t, hooked(session, t))
            if t in wanted:
                yield t, {k: model.xp.asarray(rows[t - a]) for k, rows in records.items()}, logits[t - a]
        if b > last:
            return


def _chunk_route(session, t: int, current: tuple) -> tuple:
    """`Session.chunk_route` (a driver without it: the route of the recorder it has now)"""
    return tuple(session.chunk_route(t)) if hasattr(session, "chunk_route") else current


def _route_recorder(model, route: tuple):
    """The hooks a fed chunk's state is rebuilt with (`Session._chunk_replayer`): its route kept in full, or None."""
    return Recorder(names_filter=lambda name: False, full=list(route)).bind(model) if route else None


def _cut_tail(session, start: int) -> list[int]:
    """`Session.cut_tail` (a driver without it: [])"""
    return session.cut_tail(start) if hasattr(session, "cut_tail") else []


def hooked(session, t: int) -> bool:
    """`Session.decoded_with_hooks` (a driver without it: False)"""
    return bool(session.decoded_with_hooks(t)) if hasattr(session, "decoded_with_hooks") else False


def replay_mismatch(replayed, recorded, exact: bool = False) -> str | None:
    """None where replayed logits are the stored ones: to REPLAY_RTOL of their scale (REPLAY_RTOL_FLOAT64 for float64
    logits), or bit for bit (`exact`).
    NaN matches NaN in the same places (a hook, or an overflow, put it into the history; NaN != NaN would refuse
    every replay of such a history); a NaN where the stored logits hold a number, or the other way, does not.
    Else what differs, for a message ('max |diff| ...')."""
    rtol = REPLAY_RTOL_FLOAT64 if np.asarray(recorded).dtype == np.float64 else REPLAY_RTOL
    r, s = np.asarray(replayed, np.float64), np.asarray(recorded, np.float64)
    same = (r == s) | (np.isnan(r) & np.isnan(s))  # (equal infinities too: inf - inf is NaN)
    with np.errstate(invalid="ignore"):
        err = float(np.max(np.where(same, 0.0, np.abs(r - s))))  # NaN where only one of them is NaN
    finite = np.abs(s[np.isfinite(s)])
    scale = 1.0 + (float(np.max(finite)) if finite.size else 0.0)
    if same.all() if exact else err <= rtol * scale:
        return None
    nan = int(np.sum(np.isnan(r) != np.isnan(s)))
    return f"max |diff| {err:.3g}{f'; NaN in one but not the other at {nan} of {r.size} entries' if nan else ''}"


def check_replay(replayed: np.ndarray, recorded: np.ndarray, t: int, exact: bool = False) -> None:
    """The replayed logits against the stored ones (`replay_mismatch`): to REPLAY_RTOL, or bit for bit for a token
    decoded under value-changing hooks (as `Session.recover` checks it), whose replay under other hooks (a temporary
    intervention since removed) can differ by less than any tolerance and must not be analysed as its history."""
    mismatch = replay_mismatch(replayed, recorded, exact)
    if mismatch is not None:
        raise ValueError(
            f"replaying the session's history gives other logits at token {t} than the session stored ({mismatch}): "
            "analyses replay under the hooks `session.hooks` holds now, and that token was decoded under others: either "
            "decoded under hooks the session no longer holds (a temporary `session.intervene(...)`, hooks added to "
            "its recorder, hooks removed since), or before hooks were added to or changed in session.hooks (they "
            "would be analysed as if the history had had them); or the weights changed since it was decoded. Restore "
            "the hooks it was decoded with, or decode the history again under session.hooks (e.g. a fresh "
            "Session(weights, hooks=...) fed session.tokens), and retry")
