"""Every error kimi_explore raises on purpose, in one place (each module imports its own from here).

All of them say, in their message, which file, tensor, key or argument is wrong, what was expected
and what was found.
"""

from __future__ import annotations

__all__ = ["BackendError", "CheckpointError", "ConfigError", "DuplicateKeyError", "StageLostError", "listed",
           "unique_keys"]


class ConfigError(ValueError):
    """config.json is missing keys or describes a model this decoder does not implement."""


class CheckpointError(ValueError):
    """A checkpoint file, index entry or tensor is missing, malformed, or not what the config implies."""


class BackendError(RuntimeError):
    """The requested device or dtype cannot be used."""


class StageLostError(RuntimeError):
    """A pipeline stage's process is gone (killed, crashed, its node lost). `session.recover()` rebuilds it."""


class DuplicateKeyError(Exception):
    """A JSON object names a key twice (args: the key, then its two values where short); `unique_keys` raises it and
    each reader turns it into its own error, naming its file."""


def unique_keys(pairs):
    """A JSON object's pairs as a dict (json.loads' object_pairs_hook), refusing a key given twice: json.loads keeps
    the last silently, so which value a file means cannot be told."""
    out = {}
    for k, v in pairs:
        if k in out:
            short = all(not isinstance(x, (dict, list)) and len(repr(x)) <= 40 for x in (out[k], v))
            raise DuplicateKeyError(k, f" (values {out[k]!r} and {v!r})" if short else "")
        out[k] = v
    return out


def listed(items, at_most: int = 12) -> str:
    """'a, b, c (and 9 more)': the first `at_most` of `items` for an error message, and how many were left out."""
    items = [str(x) for x in items]
    more = f" (and {len(items) - at_most} more)" if len(items) > at_most else ""
    return ", ".join(items[:at_most]) + more
