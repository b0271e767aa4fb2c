"""Where an intervention acts: which layers (sites) and which token positions; a position in a history.

    layer_sites(layer, kind)          "layers.{i}.{kind}" for layer = an int, a list / range of distinct
                                      ones, or "all" (a glob: every layer that has the site)
    at_positions(fn, positions)       wrap fn(value, rows, hook) into a chunk-aware hook acting only at
                                      `positions`: None (every token), an int, a non-empty collection /
                                      range of ints, or a non-empty slice (slice(a, None): from token a on)
    named(fn, label)                  give a hook function a readable name (what `Hooks` lists)
    history_position(p, T, who)       a token position of a session's history (negative from the end) as 0..T-1,
                                      checked: what every analysis taking a position `t` reads it with
    int_in(v, lo, hi, what)           a count checked to be an int in lo..hi (a session's n_tokens, k, ...)
    int_slice(sl, what)               a slice of positions checked to hold ints (True and 1.5 are not)

In the token form the wrapped fn gets the value and rows=None; on a chunk of the sequence path it gets
the chunk [T, ...] and rows, a [T] bool mask of the chunk rows to change. A 0-d integer array counts as
an int. An empty list of positions or layers, or a layer given twice (a `scale_kda_head` would scale
it twice), is refused: it would act nowhere, or not as written, without a word.
"""

from __future__ import annotations

import numpy as np

from .._xp import array_namespace

__all__ = [
    "at_positions", "history_position", "index_list", "int_in", "int_slice", "layer_ids", "layer_sites", "named", "number",
    "position_filter", "position_list",
]


def _scalar(x):
    """A 0-d array (np.array(5)) as the Python scalar it holds; anything else as it is."""
    return x.item() if getattr(x, "ndim", None) == 0 and hasattr(x, "item") else x


def _int_items(x) -> list | None:
    """An int (or a 0-d int array) or a collection / array of them -> the ints as given; None if anything is not an
    int (a bool, a float, a string, a non-collection)."""
    x = _scalar(x)
    items = [x] if isinstance(x, (int, np.integer)) else \
        None if isinstance(x, (str, bytes, float)) or not hasattr(x, "__iter__") else [_scalar(i) for i in x]
    if items is None or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in items):
        return None
    return items


def layer_ids(layer) -> list[int]:
    """An int or a list / range of distinct ones -> [int], checked (non-negative, not bool)."""
    layer = _scalar(layer)
    layers = [layer] if isinstance(layer, (int, np.integer)) else list(layer) if hasattr(layer, "__iter__") else [layer]
    for i in layers:
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or i < 0:
            raise ValueError(f"layer must be a non-negative int, a list or range of them, or 'all'; got {layer!r}")
    if not layers:
        raise ValueError(f"layer: got an empty list of layers ({layer!r})")
    twice = sorted({int(i) for i in layers if layers.count(i) > 1})
    if twice:  # each would get its own hook: scale_kda_head would scale such a layer twice
        raise ValueError(f"layer: layers {twice} are given more than once in {layer!r}; give each layer once")
    return [int(i) for i in layers]


def index_list(ids, what: str) -> list[int]:
    """Expert or head ids: an int (or a 0-d int array) or a non-empty collection / array of them -> [int] in the
    order given, checked to be ints (not bool: True would be id 1; not float: 3.7 would be id 3). `what` names
    the argument in the error ("ablate_experts: experts")."""
    items = _int_items(ids)
    if items is None:
        raise TypeError(f"{what}: expected an int id or a collection of int ids, got {ids!r}")
    if not items:  # it would act nowhere
        raise ValueError(f"{what}: got an empty collection of ids ({ids!r}), which would act nowhere")
    return [int(i) for i in items]


def number(x, what: str) -> float:
    """A real number (a Python or NumPy int or float, or a 0-d array of one) as a float; not a bool or a string."""
    x = _scalar(x)
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what}: expected a number, got {x!r}")
    return float(x)


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
        positions = int_slice(positions, "positions")
        if positions.step not in (None, 1):
            raise ValueError(f"positions: a slice of token positions must have step 1, got {positions!r}")
        a = 0 if positions.start is None else positions.start
        b = positions.stop
        if a < 0 or (b is not None and b < 0):
            raise ValueError(f"positions: token positions are absolute (>= 0), got {positions!r}")
        if b is not None and b <= a:  # it would never act
            raise ValueError(f"positions: {positions!r} holds no token position (stop <= start); slice({a}, None) is "
                             f"every token from {a} on")
        return (f"{a}..{'' if b is None else b - 1}", lambda p: a <= p and (b is None or p < b),
                lambda ps: (ps >= a) & (ps < b) if b is not None else ps >= a)
    ordered = position_list(positions)
    wanted = set(ordered)
    return str(ordered), wanted.__contains__, lambda ps: np.isin(ps, ordered)


def position_list(positions) -> list[int]:
    """A token position (int, or a 0-d int array) or a non-empty collection / range of them -> sorted distinct
    ints, checked (>= 0)."""
    items = _int_items(positions)
    if items is None:
        raise TypeError(f"positions: expected None, a token position (int), a collection or range of them, or a slice; "
                        f"got {positions!r}")
    if not items:  # it would never act
        raise ValueError(f"positions: got an empty collection of token positions ({positions!r}); None acts at every token")
    ordered = sorted({int(p) for p in items})
    if ordered[0] < 0:  # -1 is not "the last token": it would silently never act
        raise ValueError(f"positions: token positions are absolute (>= 0), got {positions!r}")
    return ordered


def int_in(v, lo: int, hi: int, what: str, more: str = "") -> int:
    """v as an int, checked: an int (not a bool; a 0-d int array counts) in lo..hi; else ValueError, `what` first
    and `more` last."""
    v = _scalar(v)
    if isinstance(v, (bool, np.bool_)) or not (isinstance(v, (int, np.integer)) and lo <= v <= hi):
        raise ValueError(f"{what} must be an int in {lo}..{hi}, got {v!r}{more}")
    return int(v)


def int_slice(sl: slice, what: str) -> slice:
    """`sl` with ints (or None) for its start, stop and step, checked: Python's own slicing takes True for 1, and
    of 1.5 says only 'slice indices must be integers', naming no argument."""
    parts = []
    for v in (sl.start, sl.stop, sl.step):
        v = _scalar(v)
        if v is not None and (isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))):
            raise TypeError(f"{what}: {sl!r}: a slice of token positions takes ints (or None), got {v!r} "
                            f"({type(v).__name__})")
        parts.append(None if v is None else int(v))
    return slice(*parts)


def history_position(p, T: int, who: str) -> int:
    """Token position p of a history of T tokens (negative counts from the end) as its index 0..T-1; `who` leads
    the message of a p that is not an int (a bool is not) or lies outside the history."""
    span = f"0..{T - 1}, or -{T}..-1" if T else "none yet: feed a prompt first"
    p = _scalar(p)
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer)):
        raise TypeError(f"{who}: token position {p!r} ({type(p).__name__}): expected an int ({span})")
    if not -T <= p < T:
        raise IndexError(f"{who}: token position {p} is outside the session's history of {T} tokens ({span})")
    return int(p) % T


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
