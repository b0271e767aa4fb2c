"""Where an intervention acts: which layers (sites) and which token positions.

    layer_sites(layer, kind)          "layers.{i}.{kind}" for layer = an int, a list / range of them,
                                      or "all" (a glob: every layer that has the site)
    at_positions(fn, positions)       wrap fn(value, rows, hook) into a chunk-aware hook acting only at
                                      `positions`: None (every token), an int, a collection / range of
                                      ints, or a slice (slice(a, None): from token a on)
    named(fn, label)                  give a hook function a readable name (what `Hooks` lists)

In the token form the wrapped fn gets the value and rows=None; on a chunk of the sequence path it gets
the chunk [T, ...] and rows, a [T] bool mask of the chunk rows to change.
"""

from __future__ import annotations

import numpy as np

from .._xp import array_namespace

__all__ = ["at_positions", "layer_ids", "layer_sites", "named", "position_filter"]


def layer_ids(layer) -> list[int]:
    """An int or a list / range of them -> [int], checked (non-negative, not bool)."""
    layers = [layer] if isinstance(layer, (int, np.integer)) else list(layer)
    for i in layers:
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or i < 0:
            raise ValueError(f"layer must be a non-negative int, a list or range of them, or 'all'; got {layer!r}")
    if not layers:
        raise ValueError(f"layer: got an empty list of layers ({layer!r})")
    return [int(i) for i in layers]


def layer_sites(layer, kind: str) -> list[str]:
    """Site names "layers.{i}.{kind}" for the layers asked for; "all" -> the glob "layers.*.{kind}"."""
    if isinstance(layer, str):
        if layer != "all":
            raise ValueError(f"layer must be a non-negative int, a list or range of them, or 'all'; got {layer!r}")
        return [f"layers.*.{kind}"]
    return [f"layers.{i}.{kind}" for i in layer_ids(layer)]


def position_filter(positions):
    """positions -> (description, predicate on one position, mask function on an int array), or None for all."""
    if positions is None:
        return None
    if isinstance(positions, slice):
        if positions.step not in (None, 1):
            raise ValueError(f"positions: a slice of token positions must have step 1, got {positions!r}")
        a = 0 if positions.start is None else int(positions.start)
        b = None if positions.stop is None else int(positions.stop)
        if a < 0 or (b is not None and b < 0):
            raise ValueError(f"positions: token positions are absolute (>= 0), got {positions!r}")
        return (f"{a}..{'' if b is None else b - 1}", lambda p: a <= p and (b is None or p < b),
                lambda ps: (ps >= a) & (ps < b) if b is not None else ps >= a)
    wanted = {int(positions)} if isinstance(positions, (int, np.integer)) else {int(p) for p in positions}
    ordered = sorted(wanted)
    if ordered and ordered[0] < 0:  # -1 is not "the last token": it would silently never act
        raise ValueError(f"positions: token positions are absolute (>= 0), got {positions!r}")
    return str(ordered), wanted.__contains__, lambda ps: np.isin(ps, ordered)


def at_positions(fn, positions):
    """Wrap fn(value, rows, hook) so it acts only at the given token positions (see module docstring)."""
    filt = position_filter(positions)

    def acting_at(value, *, hook):
        if hook.positions is None:  # one token
            return fn(value, None, hook) if filt is None or filt[1](hook.position) else None
        xp = array_namespace(value)
        ps = np.asarray(hook.positions)
        rows = np.ones(len(ps), bool) if filt is None else filt[2](ps)
        return fn(value, xp.asarray(rows), hook) if rows.any() else None

    acting_at.__qualname__ = f"{getattr(fn, '__qualname__', 'hook')}@positions{'all' if filt is None else filt[0]}"
    return acting_at


def named(fn, label: str):
    fn.__qualname__ = label
    return fn
