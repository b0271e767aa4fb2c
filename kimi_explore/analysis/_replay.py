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
from ..inspection.hooks import HookChain
from ..inspection.recorder import Recorder
from ..model.kimi_decoder import hook_names

REPLAY_RTOL = 1e-5  # replays are bit-exact; this only absorbs a non-deterministic device reduction


def site_names(model, suffixes, globals_=()) -> list[str]:
    """This model's hook names ending in one of `suffixes` (layer sites), plus the global ones asked for."""
    suffixes = tuple(suffixes)
    return [n for n in hook_names(model) if n in globals_ or (n.startswith("layers.") and n.endswith(suffixes))]


def replay(session, names, positions=None):
    """Yield (t, values, logits) for the tokens t of `session`'s history in `positions` (default: all).

    values: {site name: a copy of the value that flowed there at token t}, on the model's backend
    (captured as a Recorder's full records, so over a pipeline they come back from the stages);
    logits: the replayed logits [vocab] (host). Stops after the last wanted position.
    """
    tokens = session.tokens
    T = len(tokens)
    if T == 0:
        raise ValueError("the session has no tokens: feed a prompt first (session.feed(ids))")
    wanted = set(range(T)) if positions is None else {_position(p, T) for p in positions}
    model, recorded = session.weights, session.logits
    capture = Recorder(names_filter=lambda name: False, full=list(names)).bind(model)
    hooks = HookChain(session.hooks.copy(), capture) if len(session.hooks) else capture
    state = model.new_state()
    for t in range(max(wanted) + 1):
        hooks.begin_token(tokens[t], t)
        logits = to_numpy(model.forward_token(state, tokens[t], hooks))
        _check_replay(logits, recorded[t], t)
        records = capture.take_records()
        if t in wanted:
            yield t, {k: model.xp.asarray(rows[0]) for k, rows in records.items()}, logits


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
