"""argparse types the benchmarks share: a count is refused at parse time (one line, exit status 2) rather than
running into a division by zero, an empty median or a slice from the end.

    from argtypes import at_least, int_list   # bench/ is the script's directory, so on sys.path

`at_least` is the CLI's `_at_least` again on purpose: importing `kimi_explore.cli` loads NumPy, and prefill.py and
routing_stats.py set the BLAS thread count (--threads) after parsing, before NumPy may load.
"""

from __future__ import annotations

import argparse


def at_least(low: int):
    """An int >= low."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {n}")
        return n

    parse.__name__ = f"int >= {low}"  # (what argparse names in its message)
    return parse


def int_list(low: int = 1):
    """A comma list of ints >= low ("1,16,64"), at least one."""
    one = at_least(low)

    def parse(text: str) -> list[int]:
        parts = text.split(",")
        if not text.strip() or any(not p.strip() for p in parts):
            raise argparse.ArgumentTypeError(f"expected a comma list of integers >= {low} (e.g. 1,16,64), got {text!r}")
        return [one(p.strip()) for p in parts]

    parse.__name__ = f"comma list of ints >= {low}"
    return parse
