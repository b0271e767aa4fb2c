"""Trace: what a Recorder collected, as host arrays with named axes.

    trace[name]                      that record stacked over tokens: [T, ...]
    trace.tokens, trace.positions    [T] ints (token -1 where the id was not announced)
    trace.window(a, b)               tokens a..b-1 as a Trace of views (O(records), whatever T); its
                                     `start` is a (the history index of its row 0)
    trace.layer_ids                  the model layers, in order
    trace.attn_res_weights()         [token, layer, site (0 attn, 1 ffn), source]
    trace.final_attn_res_weights()   [token, source]
    trace.source_labels()            ["embedding", "block 1", ..., "current"]
    trace.kda_state_norms()          ([token, kda_layer, head], kda_layer_ids)
    trace.kda_conv_norms()           ([token, kda_layer, stream (q, k, v), head], kda_layer_ids)
    trace.routing()                  topk_ids / topk_weights [token, moe_layer, k], scores [token, moe_layer, E]
                                     (those recorded)
    trace.top_predictions()          (ids [T, top_k], probs [T, top_k])

Source columns are fixed for the whole model: the stored blocks in push order in columns 0..m-1
(NaN while a block is not sealed yet at that layer), the current running sum ALWAYS in the last
column, so a column means the same thing at every layer. Records whose per-token shape varies
(an MLA probs row grows with the position; an ablation shortens the top-k) are padded at the end:
NaN for floats, -1 for ints.

`save(path)` / `Trace.load(path)` round-trip exactly through one .npz; `meta` (layer kinds,
expert counts, the config) travels with it so plots can label axes without the weights.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import numpy as np

from ..model.block_residual import source_labels
from .npz_io import NpzReader, npz_to_read, with_npz_suffix, write_npz
from .targets import int_slice

__all__ = ["Trace"]

FORMAT = "kimi_explore.inspection.trace/1"
SITES = ("attn", "ffn")


def window_slice(window, who: str) -> slice:
    """The `window=` argument of a `trace()`: a slice of token indices or a (start, stop) pair. A bare number is
    refused: "from token 5 on" and "the last 5 tokens" are both natural readings of window=5."""
    if isinstance(window, slice):
        return int_slice(window, f"{who}: window")
    if isinstance(window, tuple) and len(window) == 2:
        return int_slice(slice(*window), f"{who}: window")
    hint = f": slice({window}, None) for tokens {window} on, slice(-{window}, None) for the last {window}" \
        if isinstance(window, (int, np.integer)) and not isinstance(window, bool) and window > 0 else ""
    raise TypeError(f"{who}: window={window!r}: expected a slice of token indices or a (start, stop) pair{hint}")


def stack_rows(rows: list, name: str = "") -> np.ndarray:
    """Stack per-token arrays, padding varying shapes at the end (NaN / -1 / False)."""
    if not rows:
        return np.zeros((0,))
    shapes = {r.shape for r in rows}
    if len(shapes) == 1:
        return np.array(rows)  # np.stack's result, a third of its time on a chunk's 1,024 row views
    if len({len(s) for s in shapes}) != 1:
        raise ValueError(f"record {name!r}: per-token values have different numbers of axes: {sorted(shapes)}")
    full = tuple(max(s[d] for s in shapes) for d in range(len(rows[0].shape)))
    dtype = np.result_type(*rows)
    fill = np.nan if dtype.kind in "fc" else (False if dtype.kind == "b" else -1)
    out = np.full((len(rows),) + full, fill, dtype=dtype)
    for t, r in enumerate(rows):
        out[(t,) + tuple(slice(0, n) for n in r.shape)] = r
    return out



class Trace:
    """Recorded values over T tokens. Build with `Recorder.trace()` or `Trace.load(path)`."""

    def __init__(self, records: dict, tokens, positions=None, meta: dict | None = None, start: int = 0):
        self.start = int(start)  # history index of row 0 (a window's first token; not part of equals/save)
        self._records = {k: np.asarray(v) for k, v in records.items()}
        self.tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T = len(self.tokens)
        self.positions = np.arange(T, dtype=np.int64) if positions is None else np.asarray(positions, dtype=np.int64)
        self.meta = dict(meta or {})
        for k, v in self._records.items():
            if v.shape[:1] != (T,):
                raise ValueError(f"Trace: record {k!r} has {v.shape[:1]} rows, expected {T} (one per token)")

    @classmethod
    def from_rows(cls, rows: dict, tokens, positions, meta) -> Trace:
        return cls({k: stack_rows(v, k) for k, v in rows.items()}, tokens, positions, meta)

    # ------------------------------------------------------------------ mapping access
    def __getitem__(self, name: str) -> np.ndarray:
        if not isinstance(name, str):  # (an int or a slice: the rows of tokens, which window() gives)
            raise TypeError(f"Trace[...] takes a record's name (trace.names() lists them), got {name!r}; the rows of "
                            "tokens a..b-1 are trace.window(a, b), token t's value of a record trace[name][t]")
        try:
            return self._records[name]
        except KeyError:
            if not len(self) and not self._records:  # (a zero-row window keeps its records, rows none)
                raise KeyError(f"{name!r}: this trace has no tokens yet (nothing decoded, or the history truncated to 0), "
                               "so it holds no records; decode a token first") from None
            close = difflib.get_close_matches(name, list(self._records), n=3, cutoff=0.6)
            hint = f"did you mean {close}? " if close else ""
            raise KeyError(f"{name!r} was not recorded in this trace. {hint}Full tensors are kept only for names passed "
                           f"as Recorder(full=[...]); trace.names() lists the {len(self._records)} recorded names") from None

    def __contains__(self, name) -> bool:
        return name in self._records

    def names(self) -> list[str]:
        return list(self._records)

    keys = names

    def items(self):
        return self._records.items()

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        """One line, however many layers (K3: 93) and records."""
        ids = self.layer_ids
        if ids and ids == list(range(ids[0], ids[-1] + 1)):
            layers = f"layers {ids[0]}-{ids[-1]}"
        else:
            layers = f"layers {ids}" if len(ids) <= 8 else f"{len(ids)} layers in {ids[0]}..{ids[-1]}"
        nbytes = sum(a.nbytes for a in self._records.values())
        return f"Trace({len(self)} tokens, {len(self._records)} records, {layers}, {nbytes / 2**20:.2f} MiB)"

    def equals(self, other: Trace) -> bool:
        """Exactly the same records (NaN == NaN), tokens, positions and meta. The records' order does not count: a
        recorder lists them in the order it first met them, which a history since truncated or restored keeps."""
        if sorted(self.names()) != sorted(other.names()) or self.meta != other.meta:
            return False
        if not (np.array_equal(self.tokens, other.tokens) and np.array_equal(self.positions, other.positions)):
            return False
        return all(a.dtype == other[k].dtype and np.array_equal(a, other[k], equal_nan=a.dtype.kind in "fc")
                   for k, a in self._records.items())

    def window(self, start, stop=None) -> Trace:
        """Tokens start..stop-1 as a Trace whose records are views of these (no copy: O(records)).

        `window(a, b)`, `window(slice(a, b))` or `window((a, b))`; Python slice rules (negative counts
        from the end, None = open, out of range clipped), step 1. The result's `start` is this trace's
        `start` + a, so `window.start + i` is row i's index in the whole history."""
        if isinstance(start, slice):
            if stop is not None:
                raise TypeError("Trace.window: give a slice alone, or start and stop")
            sl = start
        elif isinstance(start, tuple) and stop is None and len(start) == 2:
            sl = slice(*start)
        else:
            sl = slice(start, stop)
        a, b, step = int_slice(sl, "Trace.window").indices(len(self))
        if step != 1:
            raise ValueError(f"Trace.window: a window is contiguous (step 1), got step {sl.step}")
        b = max(a, b)
        return Trace({k: v[a:b] for k, v in self._records.items()}, self.tokens[a:b], self.positions[a:b], self.meta,
                     start=self.start + a)

    # ------------------------------------------------------------------ model structure
    def _layers_with(self, suffix) -> list[int]:
        """Layers with a record ending in `suffix` (a str, or a tuple of them)."""
        out = []
        for name in self._records:
            if name.startswith("layers.") and name.endswith(suffix):
                i = int(name.split(".")[1])
                if i not in out:
                    out.append(i)
        return sorted(out)

    @property
    def layer_ids(self) -> list[int]:
        if "layer_ids" in self.meta:
            return list(self.meta["layer_ids"])
        return sorted({int(n.split(".")[1]) for n in self._records if n.startswith("layers.")})

    def _kind_layers(self, key: str, kind: str, fallback: str) -> list[int]:
        if key in self.meta:
            return [i for i, k in zip(self.meta["layer_ids"], self.meta[key], strict=True) if k == kind]
        return self._layers_with(fallback)

    @property
    def kda_layers(self) -> list[int]:
        return self._kind_layers("attention_kinds", "kda", (".kda.state.norm", ".kda.conv.norm"))

    @property
    def mla_layers(self) -> list[int]:
        return self._kind_layers("attention_kinds", "mla", ".mla.probs")

    @property
    def moe_layers(self) -> list[int]:
        return self._kind_layers("ffn_kinds", "moe", ".moe.router.topk_ids")

    @property
    def max_sources(self) -> int:
        """Source columns: every block the model stores, plus the current running sum."""
        if "max_sources" in self.meta:
            return int(self.meta["max_sources"])
        lens = [v.shape[1] for k, v in self._records.items() if k.endswith("attn_res.weights") or k.endswith(".attn.weights")
                or k.endswith(".ffn.weights")]
        if not lens:
            raise KeyError("this trace has no block-residual weights (record 'layers.*.attn_res.*.weights')")
        return max(lens)

    def source_labels(self) -> list[str]:
        """Labels of the source axis: ["embedding", "block 1", ..., "block m-1", "current"]."""
        bounds = self.meta.get("block_boundaries")
        if bounds is None:  # a trace made without the model's description: as if layer 0 pushed first
            bounds = list(range(self.max_sources - 1))
        return source_labels(bounds)

    # ------------------------------------------------------------------ named-axis views
    def _place(self, w: np.ndarray, out: np.ndarray) -> None:
        """Write weights [T, n+1] (stack then current) into out [T, S]: blocks first, current last."""
        n = w.shape[1] - 1
        out[:, :n] = w[:, :n]
        out[:, -1] = w[:, n]

    def attn_res_weights(self) -> np.ndarray:
        """[token, layer, site (0 = before attention, 1 = before the FFN), source]; NaN where absent."""
        layers, S = self.layer_ids, self.max_sources
        out = np.full((len(self), len(layers), 2, S), np.nan)
        for li, i in enumerate(layers):
            for s, site in enumerate(SITES):
                key = f"layers.{i}.attn_res.{site}.weights"
                if key in self._records:
                    self._place(self._records[key], out[:, li, s])
        return out

    def final_attn_res_weights(self) -> np.ndarray:
        """[token, source]: the output mix before the final norm, same columns as attn_res_weights()."""
        out = np.full((len(self), self.max_sources), np.nan)
        if not len(self) and not self._records:  # no tokens yet: no rows (as attn_res_weights())
            return out
        self._place(self["final.attn_res.weights"], out)
        return out

    def _per_layer(self, layers, suffix: str):
        ids = [i for i in layers if f"layers.{i}.{suffix}" in self._records]
        if not ids:
            return np.zeros((len(self), 0, 0)), []
        return np.stack([self._records[f"layers.{i}.{suffix}"] for i in ids], axis=1), ids

    def kda_state_norms(self):
        """([token, kda_layer, head] Frobenius norms of each head's recurrent state, kda_layer_ids)."""
        return self._per_layer(self.kda_layers, "kda.state.norm")

    def kda_conv_norms(self):
        """([token, kda_layer, stream (q, k, v), head] conv-window norms, kda_layer_ids)."""
        return self._per_layer(self.kda_layers, "kda.conv.norm")

    def routing(self) -> dict:
        """MoE routing in vLLM's routed-experts layout [token, layer, top_k] (padded -1 / NaN if k varied): each of
        topk_ids, topk_weights and scores that was recorded, over the MoE layers where any of them was (all padding
        at a layer where that one was not)."""
        keys = (("topk_ids", -1), ("topk_weights", np.nan), ("scores", np.nan))
        layers = sorted(set().union(*(self._layers_with(f".moe.router.{key}") for key, _ in keys)))
        out = {"moe_layers": layers}
        for key, fill in keys:
            rows = [self._records.get(f"layers.{i}.moe.router.{key}") for i in layers]
            got = [r for r in rows if r is not None]
            if not got:
                continue
            width = max(r.shape[1] for r in got)
            dtype = np.int64 if key == "topk_ids" else np.result_type(*got)
            arr = np.full((len(self), len(layers), width), fill, dtype=dtype)
            for j, r in enumerate(rows):
                if r is not None:
                    arr[:, j, : r.shape[1]] = r
            out[key] = arr
        if "num_experts" in self.meta:
            out["num_experts"] = int(self.meta["num_experts"])
        return out

    def top_predictions(self):
        """(ids [T, top_k], probs [T, top_k]) of the next-token distribution after each token."""
        return self["logits.top_ids"], self["logits.top_probs"]

    # ------------------------------------------------------------------ files and frames
    def save(self, path) -> Path:
        """Write one .npz (the suffix is added if missing); `Trace.load` reads it back exactly."""
        path = with_npz_suffix(path, "Trace.save")
        arrays = {f"record/{k}": v for k, v in self._records.items()}
        held = [k for k, v in self._records.items() if np.asanyarray(v).dtype.hasobject]
        if held:  # (a file holds numbers: NumPy would pickle them, which no load reads back)
            raise TypeError(f"Trace.save: {path}: records {held[:5]} hold Python objects (dtype object); a trace file "
                            "holds numeric arrays: convert them, e.g. np.asarray(values, np.float32)")
        header = {"format": FORMAT, "names": list(self._records), "meta": self.meta}
        try:
            header = json.dumps(header)
        except TypeError as e:
            raise TypeError(f"Trace.save: {path}: the trace's meta is not JSON ({e}; meta keys {sorted(self.meta)}): "
                            "give it str, int, float, bool, None, lists and dicts (an array: .tolist())") from None
        return write_npz(path, {"header": np.array(header), "tokens": self.tokens,
                                "positions": self.positions, **arrays})

    @classmethod
    def load(cls, path) -> Trace:
        """A trace `save` wrote (PATH.npz where `path` names no file and has no .npz suffix, as `save` named it)."""
        path = npz_to_read(path)
        with NpzReader(path, "trace") as z:
            header = z.header(FORMAT, required=("names", "meta"))
            names, meta = header["names"], header["meta"]
            if not (isinstance(names, list) and all(isinstance(k, str) for k in names) and len(set(names)) == len(names)
                    and isinstance(meta, dict)):
                raise ValueError(f"{path}: the trace's header holds names {names!r:.80} and meta of type "
                                 f"{type(meta).__name__}; expected a list of distinct record names and a dict (the "
                                 "file is damaged)")
            records = {k: z[f"record/{k}"] for k in header["names"]}
            tokens, positions = z["tokens"], z["positions"]
        if tokens.ndim != 1 or positions.shape != tokens.shape or tokens.dtype.kind != "i" or positions.dtype.kind != "i":
            raise ValueError(f"{path}: tokens {tokens.dtype}{list(tokens.shape)} and positions "
                             f"{positions.dtype}{list(positions.shape)}: expected two integer arrays [T] (the file is damaged)")
        try:
            return cls(records, tokens, positions, header["meta"])
        except ValueError as e:
            raise ValueError(f"{path}: {e} (the file is damaged)") from None

    def to_pandas(self, names=None):
        """Long format, one row per recorded number: t, position, token, name, layer, index, value (`names`: a record's
        name or a list of them; default all).

        `index` is the element's index tuple inside the per-token value; padding (NaN / -1 from
        varying shapes) is left out. Needs pandas.
        """
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("Trace.to_pandas needs pandas: pip install pandas") from e
        frames = []
        if isinstance(names, str):  # one record (a string is not iterated as its letters)
            names = [names]
        for name in self.names() if names is None else list(names):
            v = self[name]
            flat = v.reshape(len(self), -1) if len(self) else v.reshape(0, int(np.prod(v.shape[1:])))  # (-1: none in 0 rows)
            if v.dtype.kind in "fc":
                keep = ~np.isnan(flat)
            else:
                keep = np.ones(flat.shape, bool) if v.dtype.kind == "b" else flat != -1
            t, j = np.nonzero(keep)
            idx = list(zip(*np.unravel_index(j, v.shape[1:]), strict=True)) if v.ndim > 1 else [()] * len(t)
            parts = name.split(".")
            layer = int(parts[1]) if parts[0] == "layers" else None
            frames.append(pd.DataFrame({"t": t, "position": self.positions[t], "token": self.tokens[t], "name": name,
                                        "layer": pd.array([layer] * len(t), dtype="Int64"), "index": idx,
                                        "value": flat[t, j]}))
        cols = ["t", "position", "token", "name", "layer", "index", "value"]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)
