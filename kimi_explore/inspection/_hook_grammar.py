"""The grammar of hook names, and the checks that turn a typo into an error instead of silence.

Every name `kimi_forward_token` can fire is "embed", "final.*", "logits", or "layers.{i}.{suffix}"
for a fixed set of suffixes: those of `LayerSpec.site_kinds` for every layer kind (the decoder's own
site table, `model.config`), so a site the decoder adds is known here without an edit.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import re

from ..model.config import ATTENTION_SITES, FFN_SITES, FINAL_SITES, FIRST_SITES, LayerSpec

__all__ = ["GLOBAL_NAMES", "LAYER_NAME", "LAYER_SUFFIXES", "check_pattern", "hook_grammar", "is_glob", "site_kind"]

LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
_GLOB_CHARS = re.compile(r"[*?\[]")


@functools.lru_cache(maxsize=4096)
def site_kind(name: str) -> str:
    """A site's kind: its name without the "layers.{i}." prefix (a global site: the name). Cached: every Recorder
    asks again for the same few hundred names."""
    m = LAYER_NAME.match(name)
    return m.group(2) if m else name


def _grammar() -> tuple[frozenset, frozenset]:
    """(global names, per-layer suffixes): every name any layer kind can fire."""
    suffixes = {s for att in ATTENTION_SITES for ffn in FFN_SITES for s in LayerSpec(0, att, ffn, True).site_kinds(True)}
    return frozenset(FIRST_SITES + FINAL_SITES), frozenset(suffixes)


GLOBAL_NAMES, LAYER_SUFFIXES = _grammar()


@functools.lru_cache(maxsize=8)
def hook_grammar(max_layer: int = 127) -> tuple[str, ...]:
    """Every syntactically valid hook name for layers 0..max_layer (a superset of any model's list)."""
    return tuple(sorted(GLOBAL_NAMES)) + tuple(f"layers.{i}.{s}" for i in range(max_layer + 1) for s in sorted(LAYER_SUFFIXES))


def is_glob(pattern: str) -> bool:
    return bool(_GLOB_CHARS.search(pattern))


def check_pattern(pattern: str, known_names=None, what: str = "hook") -> None:
    """Raise ValueError unless `pattern` (exact name or glob) names at least one hook point.

    known_names: a model's `hook_names(weights)`, or None to check against the grammar of any model.
    """
    if not isinstance(pattern, str):
        raise TypeError(f"{what} name must be a string (exact hook name or glob), got {pattern!r}")
    if fix := _leading_zeros(LAYER_NAME.match(pattern)):  # 'layers.01.kda.q' is no name the decoder fires
        raise ValueError(f"{what} name {pattern!r}: {fix}")
    if known_names is not None:
        if is_glob(pattern):
            if not any(fnmatch.fnmatchcase(n, pattern) for n in known_names):
                raise ValueError(f"{what} glob {pattern!r} matches none of this model's {len(known_names)} hook names "
                                 f"(see kimi_explore.hook_names(weights)); {_suggest(pattern, known_names)}")
        elif pattern not in known_names:
            raise ValueError(f"{pattern!r} is not a hook point of this model; {_why_not(pattern, list(known_names))}")
        return
    if is_glob(pattern):
        if not _names_some_hook(pattern):
            raise ValueError(f"{what} glob {pattern!r} matches no possible hook name; {_suggest(pattern, hook_grammar(3))}")
    elif not _is_valid_name(pattern):
        raise ValueError(f"{pattern!r} is not a hook name; {_suggest(pattern, hook_grammar(max(3, _max_layer_in(pattern))))}")


@functools.lru_cache(maxsize=1024)
def _names_some_hook(glob: str) -> bool:
    """Whether `glob` matches a syntactically valid hook name (remembered: each new Recorder checks its filter,
    and routing_stats makes one a text)."""
    return bool(fnmatch.filter(hook_grammar(_max_layer_in(glob)), glob))


def _is_valid_name(name: str) -> bool:
    m = LAYER_NAME.match(name)
    return m.group(2) in LAYER_SUFFIXES if m else name in GLOBAL_NAMES


def _max_layer_in(pattern: str) -> int:
    nums = [int(x) for x in re.findall(r"\d+", pattern)]
    return max([127] + nums)


def _suggest(pattern: str, names) -> str:
    m = LAYER_NAME.match(pattern)
    if m and not is_glob(m.group(1)):  # a typo in the site: suggest sites of the same layer (the model's, where known)
        prefix = f"layers.{m.group(1)}."
        here = [n[len(prefix):] for n in names if n.startswith(prefix)]
        close = difflib.get_close_matches(m.group(2), here or sorted(LAYER_SUFFIXES), n=3, cutoff=0.6)
        if here and not close:
            return f"layer {m.group(1)} has the sites {here}"
        close = [prefix + c for c in close]
    else:
        close = difflib.get_close_matches(pattern, list(names), n=3, cutoff=0.6)
    return f"did you mean {close}?" if close else "list the valid names with kimi_explore.hook_names(weights)"


def _leading_zeros(m) -> str:
    """What to write instead of a layer name match `m` whose number has leading zeros ("" where it has none)."""
    if m and m.group(1) != str(int(m.group(1))):
        return f"write the layer number without leading zeros: 'layers.{int(m.group(1))}.{m.group(2)}'"
    return ""


def _why_not(name: str, known_order: list[str]) -> str:
    m = LAYER_NAME.match(name)
    if m and m.group(2) in LAYER_SUFFIXES:
        layer = int(m.group(1))
        if fix := _leading_zeros(m):
            return fix
        prefix = f"layers.{layer}."
        here = [n[len(prefix):] for n in known_order if n.startswith(prefix)]
        if not here:
            held = sorted({int(n.split(".")[1]) for n in known_order if n.startswith("layers.")})
            span = f": they hold layers {held[0]}..{held[-1]}" if held and not held[0] <= layer <= held[-1] else ""
            return (f"layer {layer} is not loaded in these weights{span}"
                    + ("; does the other side count layers from 1?" if span and layer == held[-1] + 1 else ""))
        return f"layer {layer} has the sites {here}"
    return _suggest(name, known_order)
