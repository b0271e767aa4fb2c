"""What the Explorer keeps per history so that a Step costs the same at 20 tokens or 300.

Each view asks for a window of the session's Trace (`Explorer.trace(window=...)`: views of the
records, no copy), never for the whole history. Two things do depend on every token, and are
grown by the new tokens only:

  measures   {measure: [T]} of the text strip (`summaries.token_measures` of the new tokens; a
             token's measures never change once it is decoded)
  counts     [M, E] how often each expert was chosen at each MoE layer (`load_stats`' counts)

When the history shrinks or changes (Back, Reset, a new prompt, Play after Back) the part that is
no longer a prefix is dropped and recomputed from the window that replaced it.
"""

from __future__ import annotations

import numpy as np

from .. import summaries
from ..common import routing

__all__ = ["HistoryCache", "token_window"]


def token_window(n_tokens: int, t: int, width: int) -> tuple[int, int]:
    """[a, b): `width` consecutive tokens of a history of n_tokens that show token t, with t about a
    quarter from the right end (room to see what follows once the selection moves back)."""
    if n_tokens <= width:
        return 0, n_tokens
    b = min(n_tokens, max(width, t + width // 4 + 1))
    return b - width, b


class HistoryCache:
    """Per-token measures and expert counts of the Explorer's session, grown token by token."""

    def __init__(self):
        self.tokens: list[int] = []
        self.measures: dict[str, np.ndarray] = {m: np.zeros(0) for m in summaries.MEASURES}
        self.counts: np.ndarray | None = None  # [M, E]
        self.moe_layers: list[int] = []

    def shared_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens `tokens` shares with the history the cache holds now."""
        n = 0
        while n < min(len(tokens), len(self.tokens)) and tokens[n] == self.tokens[n]:
            n += 1
        return n

    def update(self, ex, surprisal: np.ndarray) -> None:
        """Bring the cache to the history of `ex` (an Explorer: its session and its `trace(window=)`);
        surprisal: [T] bits (NaN for the first token)."""
        tokens = list(ex.session.tokens)
        keep = self.shared_prefix(tokens)
        if keep < len(self.tokens):  # the history shrank or changed: drop what no longer holds
            self.measures = {m: v[:keep] for m, v in self.measures.items()}
            self.counts = None if keep == 0 else self._counts_of(ex, 0, keep)
        self.tokens = tokens[:keep]
        if len(tokens) > keep:
            self._grow(ex, keep, len(tokens))
            self.tokens = tokens
        self.measures["surprisal"] = np.asarray(surprisal, dtype=np.float64)[: len(tokens)]

    def _counts_of(self, ex, a: int, b: int, win=None) -> np.ndarray | None:
        """Expert counts of tokens [a, b); `win` may be a trace window that ends at b and holds them."""
        win = ex.trace(window=slice(a, b)) if win is None else win.window(a - win.start, None)
        raw = win.routing()
        if not len(raw.get("moe_layers", [])) or "topk_ids" not in raw:
            return None
        ids = np.asarray(raw["topk_ids"], dtype=np.int64)  # [b - a, M, k]; -1 pads an ablated top-k
        self.moe_layers = [int(i) for i in raw["moe_layers"]]
        E = ex.session.weights.config.num_experts
        counts = np.zeros((ids.shape[1], E), np.int64)
        for j in range(ids.shape[1]):
            chosen = ids[:, j].ravel()
            counts[j] = np.bincount(chosen[chosen >= 0], minlength=E)
        return counts

    def _grow(self, ex, a: int, b: int) -> None:
        # one token before the new ones: the KDA state change of token a needs token a - 1's norms
        lo = max(0, a - 1)
        win = ex.trace(window=slice(lo, b))
        m = summaries.token_measures(win)
        for name, v in m.items():
            if name != "surprisal":
                self.measures[name] = np.concatenate([self.measures[name][:a], np.asarray(v)[a - lo:]])
        new = self._counts_of(ex, a, b, win)
        if new is not None:
            self.counts = new if self.counts is None else self.counts + new

    def load_stats(self) -> dict | None:
        """`summaries.load_stats` over the whole history, from the grown counts (None: no MoE layer)."""
        if self.counts is None:
            return None
        return summaries.stats_from_counts(self.counts, len(self.tokens))


def window_routing(ex, a: int, b: int) -> dict:
    """Host routing arrays (`common.routing`) of tokens [a, b) only; {} when no MoE layer is recorded."""
    win = ex.trace(window=slice(a, b))
    return routing(win) if len(win.routing().get("moe_layers", [])) else {}
