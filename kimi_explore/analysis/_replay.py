"""Replay a session's history with capture hooks: the per-token values the analyses need.

The default Recorder keeps cheap derived values (softmax weights, norms, top-k), not the [d]-wide
vectors a logit lens or an attribution reads (running sums, sealed blocks, attention and FFN
outputs). Rather than record those for every token up front, an analysis re-decodes the session's
tokens from a fresh state with `session.hooks` (its persistent interventions) plus hooks that copy
the wanted sites, one token at a time, and checks that the replay reproduces the logits the
session stored. A history decoded under a temporary intervention (`with session.intervene(...)`)
does not replay to the same logits: that is reported, never analysed silently.

Replays are exact: a fresh decode state and the same hooks repeat the same arithmetic (see
`Session`), and capture hooks return None, so they change no value.
"""

from __future__ import annotations

import numpy as np

from ..backend import to_numpy
from ..inspection._decoding import is_pipeline, new_state
from ..inspection.hooks import HookChain, Hooks
from ..model.kimi_decoder import KimiDecodeState, hook_names, kimi_forward_token

REPLAY_RTOL = 1e-5  # replays are bit-exact; this only absorbs a non-deterministic device reduction


def site_names(weights, suffixes, globals_=()) -> list[str]:
    """This model's hook names ending in one of `suffixes` (layer sites), plus the global ones asked for."""
    suffixes = tuple(suffixes)
    return [n for n in hook_names(weights) if n in globals_ or (n.startswith("layers.") and n.endswith(suffixes))]


def replay(session, names, positions=None):
    """Yield (t, values, logits) for the tokens t of `session`'s history in `positions` (default: all).

    values: {site name: a copy of the value that flowed there at token t} (device arrays on a GPU);
    logits: the replayed logits [vocab] (host). Stops after the last wanted position.
    """
    tokens = session.tokens
    T = len(tokens)
    if T == 0:
        raise ValueError("the session has no tokens: feed a prompt first (session.feed(ids))")
    wanted = set(range(T)) if positions is None else {_position(p, T) for p in positions}
    weights = session.weights
    if is_pipeline(weights):
        yield from _replay_pipeline(session, names, wanted)
        return
    hooks = session.hooks.copy() if len(session.hooks) else Hooks()
    hooks.bind(weights)
    box = [{}]

    def keep(value, *, hook):
        if hook.position in wanted:
            box[0][hook.name] = value.copy()

    for name in names:
        hooks.add(name, keep)
    state = KimiDecodeState.new(weights)
    recorded = session.logits
    for t in range(max(wanted) + 1):
        box[0] = {}
        hooks.begin_token(tokens[t], t)
        logits = to_numpy(kimi_forward_token(weights, state, tokens[t], hooks=hooks))
        _check_replay(logits, recorded[t], t)
        if t in wanted:
            yield t, box[0], logits


def _replay_pipeline(session, names, wanted: set):
    """`replay` over a RayPipeline: the hooks run in the stages, so the values come back as a
    Recorder's full records (copies of what flowed at each site, after the session's hooks)."""
    from ..inspection.recorder import Recorder

    pipe, tokens, recorded = session.weights, session.tokens, session.logits
    capture = Recorder(names_filter=lambda name: False, full=list(names)).bind(pipe)
    hooks = HookChain(session.hooks, capture) if len(session.hooks) else capture
    state = new_state(pipe)
    for t in range(max(wanted) + 1):
        logits = pipe.forward_token(state, tokens[t], hooks)
        _check_replay(logits, recorded[t], t)
        values = {k: rows[0] for k, rows in capture.take_records().items()}
        if t in wanted:
            yield t, values, logits


def _position(p, T: int) -> int:
    if not isinstance(p, (int, np.integer)) or isinstance(p, bool) or not -T <= p < T:
        raise IndexError(f"token position {p!r} is outside the session's history of {T} tokens (0..{T - 1}, or -{T}..-1)")
    return int(p) % T


def _check_replay(replayed: np.ndarray, recorded: np.ndarray, t: int) -> None:
    err = float(np.max(np.abs(replayed.astype(np.float64) - recorded)))
    scale = 1.0 + float(np.max(np.abs(recorded)))
    if not err <= REPLAY_RTOL * scale:
        raise ValueError(
            f"replaying the session's history gives other logits at token {t} than the session stored (max |diff| "
            f"{err:.3g}): that token was decoded under hooks the session no longer holds (a temporary "
            "`session.intervene(...)` or hooks added to its recorder). Analyses replay with `session.hooks` only: "
            "attach the intervention to session.hooks (or decode the history again) and retry")
