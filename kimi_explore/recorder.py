"""A Recorder: a hook set that keeps, per token, cheap derived values of every site (or full tensors).

    rec = Recorder()                                     # or Recorder(names_filter="layers.1?.*", full=["layers.3.kda.state"])
    kimi_forward_token(weights, state, token_id, hooks=rec)
    trace = rec.trace()                                  # kimi_explore.Trace
    trace["layers.3.attn_res.ffn.weights"]               # [tokens, n_sources]

Recorded by default, per token (keys are the site name, or the site name + ".norm" for a derived norm):

  site                                   key                                   per-token shape
  layers.{i}.attn_res.{attn,ffn}.weights same                                  [n+1]  softmax over [stored blocks..., current]
  final.attn_res.weights                 same                                  [n+1]
  layers.{i}.kda.state                   layers.{i}.kda.state.norm             [H]    Frobenius norm of each head's S_h [K, V]
  layers.{i}.kda.conv                    layers.{i}.kda.conv.norm              [3, H] norm of each head's conv window, per
                                                                                      stream (q, k, v): its K channels x W taps
  layers.{i}.moe.router.scores           same                                  [E]    unbiased sigmoid scores
  layers.{i}.moe.router.topk_ids         same                                  [k]    int, by score descending
  layers.{i}.moe.router.topk_weights     same                                  [k]
  layers.{i}.moe.{routed,shared}_out     layers.{i}.moe.{routed,shared}_out.norm []   L2 norm
  logits                                 logits.top_ids, logits.top_probs      [top_k] next-token predictions, softmax probs

`names_filter` (None = all of the above; a name, glob, list of them, or a callable name -> bool) picks
the sites whose default values are kept; `full` (names or globs) adds full copies of those sites'
values under their own name, whatever `names_filter` says. Values are recorded after any hook of
this set added before them has changed them, i.e. what flows downstream.

Cost: values are small, so every record is one or two array calls. On the host each value is a
NumPy copy taken at the site (the decoder reuses some buffers); on a GPU the records of a token are
kept on the device and moved to the host in one transfer per dtype when the token ends.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from ._xp import array_namespace as _xp
from .hooks import Hooks, check_pattern, is_glob
from .kda import KdaWeights
from .latent_moe import LatentMoeWeights
from .trace import Trace

__all__ = ["DEFAULT_SITES", "Recorder", "Trace"]

# site kind -> how it is recorded by default
DEFAULT_SITES = {
    "attn_res.attn.weights": "copy",
    "attn_res.ffn.weights": "copy",
    "final.attn_res.weights": "copy",
    "kda.conv": "kda",  # computed at the kda.state site, where H is known (the window is unchanged in between)
    "kda.state": "kda",
    "moe.router.scores": "copy",
    "moe.router.topk_ids": "copy",
    "moe.router.topk_weights": "copy",
    "moe.routed_out": "norm",
    "moe.shared_out": "norm",
    "logits": "top",
}


def _predicate(spec, what: str):
    """None | name | glob | list of them | callable -> (name -> bool, patterns to check)."""
    import fnmatch

    if spec is None:
        return None, []
    if callable(spec):
        return spec, []
    patterns = [spec] if isinstance(spec, str) else list(spec)
    for p in patterns:
        check_pattern(p, None, what)
    exact = {p for p in patterns if not is_glob(p)}
    globs = [p for p in patterns if is_glob(p)]
    return (lambda n: n in exact or any(fnmatch.fnmatchcase(n, g) for g in globs)), patterns


class Recorder(Hooks):
    """Records what `kimi_forward_token` computes, token by token (see module docstring).

    Usable wherever a Hooks is: user hooks added to it run before its own recording.
    """

    def __init__(self, names_filter=None, full=(), top_k: int = 10):
        super().__init__()
        if not (isinstance(top_k, int) and top_k >= 1):
            raise ValueError(f"Recorder: top_k must be a positive int, got {top_k!r}")
        self.top_k = top_k
        self.names_filter, self._filter_patterns = _predicate(names_filter, "Recorder names_filter")
        self.full, self._full_patterns = _predicate(full if full else None, "Recorder full")
        self._rows: dict[str, list] = {}  # key -> per-token host arrays (lists are never rebound)
        self.tokens: list[int] = []  # -1 where the token id was not announced
        self.positions: list[int] = []
        self._pending: list = []  # (put, device array) of the current token, GPU only
        self._windows: dict[str, object] = {}  # kda.conv window seen this token, by layer prefix
        self._norm_stash: list = []  # (row, vector) of this token, normed together at its end
        self._kda_stash: list = []  # (state row, conv row, S, window) of this token
        self._on_device = False
        self.meta: dict = {}

    # ------------------------------------------------------------------ binding and names
    def bind(self, weights_or_names) -> Recorder:
        """Check names against a model and keep what a Trace needs to label its axes without the weights."""
        super().bind(weights_or_names)
        for p in self._filter_patterns + self._full_patterns:
            check_pattern(p, self._known_order, "Recorder pattern")
        if hasattr(weights_or_names, "layers"):
            self.meta = model_meta(weights_or_names)
            self._on_device = weights_or_names.xp is not np
            self._cache.clear()
        return self

    def _wants(self, name: str, kind: str) -> bool:
        return kind in DEFAULT_SITES and (self.names_filter is None or self.names_filter(name))

    def _row(self, key: str) -> list:
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = []
        return row

    def _functions(self, name: str) -> list:
        fns = super()._functions(name)
        point = self._point(name)
        kind = point.kind
        if name == "embed":
            fns.insert(1, (self._on_token, point))
        if self._wants(name, kind) or (kind == "kda.state" and self._wants(name[:-5] + "conv", "kda.conv")):
            fns.append((self._recording_fn(name, kind), point))
        if self.full is not None and self.full(name):
            row = self._row(name)
            fns.append((lambda value, *, hook: self._emit(row.append, value.copy()), point))
        if name == "logits":
            fns.append((self._end_token, point))
        return fns

    # ------------------------------------------------------------------ recording functions
    # Each site does as little as possible: a copy, or a reference kept until the token ends (the
    # values referenced are not written again before then). At the end of the token ("logits") the
    # norms are computed for all layers at once and device records move to the host together.
    def _emit(self, put, arr) -> None:
        """put(host array) now, or once this token's device records have been moved to the host."""
        if isinstance(arr, np.ndarray):
            put(arr)
        elif isinstance(arr, np.generic):
            put(np.asarray(arr))
        else:
            self._pending.append((put, arr))

    def _recording_fn(self, name: str, kind: str):
        how = DEFAULT_SITES[kind]
        if how == "copy":
            row = self._row(name)
            if self._on_device:
                pend = self._pending.append
                return lambda value, *, hook: pend((row.append, value.copy()))
            put = row.append
            return lambda value, *, hook: put(value.copy())
        if how == "norm":  # routed_out / shared_out: fresh arrays, referenced until the token ends
            row, stash = self._row(name + ".norm"), self._norm_stash.append
            return lambda value, *, hook: stash((row, value))
        if how == "top":
            ids_row, probs_row, k, emit = self._row("logits.top_ids"), self._row("logits.top_probs"), self.top_k, self._emit

            def record_top(value, *, hook):
                ids, probs = top_predictions(value, k)
                emit(ids_row.append, ids)
                emit(probs_row.append, probs)

            return record_top
        # "kda": the live conv window and recurrent state stay unchanged until this layer's next token
        prefix = name[: name.rindex("kda.") + 4]
        if kind == "kda.conv":
            windows = self._windows
            return lambda value, *, hook: windows.__setitem__(prefix, value)
        state_row = self._row(prefix + "state.norm") if self._wants(prefix + "state", "kda.state") else None
        conv_row = self._row(prefix + "conv.norm") if self._wants(prefix + "conv", "kda.conv") else None
        windows, stash = self._windows, self._kda_stash.append
        return lambda value, *, hook: stash((state_row, conv_row, value, windows.pop(prefix, None)))

    def _on_token(self, value, *, hook):
        self.tokens.append(-1 if self.token_id is None else self.token_id)
        self.positions.append(self.position)
        on_device = not isinstance(value, np.ndarray)
        if on_device != self._on_device:  # first token of an unbound recorder on a GPU: rebuild the fast paths
            self._on_device = on_device
            self._cache.clear()

    def _end_token(self, value, *, hook):
        """Last function at "logits": batched norms, then device records to the host (one transfer per dtype).

        The stash lists are emptied in place: the site functions hold their bound `append`.
        """
        emit = self._emit
        if self._norm_stash:
            stash = _take(self._norm_stash)
            x = _xp(stash[0][1]).concatenate([v for _, v in stash])  # [n*d]; concatenate is faster than stack
            emit(_spread([r.append for r, _ in stash]), _row_norms(x, len(stash)))
        if self._kda_stash:
            stash = _take(self._kda_stash)
            xp, H = _xp(stash[0][2]), stash[0][2].shape[0]
            states = [e for e in stash if e[0] is not None]
            if states:
                S = xp.concatenate([e[2] for e in states])  # [n*H, K, V]
                emit(_spread([e[0].append for e in states]), _row_norms(S, len(states), H))
            convs = [e for e in stash if e[1] is not None]
            if convs:
                W = xp.concatenate([e[3] for e in convs])  # [n*3, P, W], channel h*K + j
                emit(_spread([e[1].append for e in convs]), _row_norms(W, len(convs), stash[0][3].shape[0], H))
        if self._pending:
            pending = _take(self._pending)
            for put, host in zip([p for p, _ in pending], _to_host([a for _, a in pending]), strict=True):
                put(host)

    # ------------------------------------------------------------------ results and bookkeeping
    @property
    def n_tokens(self) -> int:
        return len(self.positions)

    def trace(self, tokens=None) -> Trace:
        """Everything recorded so far as a Trace (stacked host copies; later steps do not change it)."""
        n = self.n_tokens
        rows = {k: v[:n] for k, v in self._rows.items() if v}
        toks = list(self.tokens[:n]) if tokens is None else [int(t) for t in tokens]
        if len(toks) != n:
            raise ValueError(f"Recorder.trace: got {len(toks)} tokens for {n} recorded steps")
        return Trace.from_rows(rows, toks, list(self.positions[:n]), self.meta)

    def truncate(self, n: int) -> None:
        """Keep the records of the first n tokens (in place)."""
        for row in self._rows.values():
            del row[n:]
        del self.tokens[n:]
        del self.positions[n:]
        self._drop_token_buffers()
        self.position = self.positions[-1] if self.positions else None

    def _drop_token_buffers(self) -> None:
        self._pending.clear()
        self._windows.clear()
        self._norm_stash.clear()
        self._kda_stash.clear()

    def clear_records(self) -> None:
        self.truncate(0)

    def state_dict(self, copy_arrays: bool = False) -> dict:
        """The records (lists of per-token host arrays). Arrays are shared unless copy_arrays."""
        cp = (lambda a: a.copy()) if copy_arrays else (lambda a: a)
        return {"rows": {k: [cp(a) for a in v] for k, v in self._rows.items()},
                "tokens": list(self.tokens), "positions": list(self.positions)}

    def load_state_dict(self, d: dict) -> None:
        """Replace the records by `d` (from `state_dict`); list objects are kept, their contents replaced."""
        for k in self._rows:
            self._rows[k][:] = []
        for k, v in d["rows"].items():
            self._row(k)[:] = list(v)
        self.tokens[:] = d["tokens"]
        self.positions[:] = d["positions"]
        self._drop_token_buffers()
        self.position = self.positions[-1] if self.positions else None

    def copy(self, deep: bool = True) -> Recorder:
        """A Recorder with the same settings, hooks and records (copied arrays when deep)."""
        out = super().copy()
        out.top_k, out.names_filter, out.full = self.top_k, self.names_filter, self.full
        out._filter_patterns, out._full_patterns = list(self._filter_patterns), list(self._full_patterns)
        out._rows, out.tokens, out.positions, out._pending, out._windows = {}, [], [], [], {}
        out._norm_stash, out._kda_stash, out._on_device = [], [], self._on_device
        out.meta = json.loads(json.dumps(self.meta))
        out.load_state_dict(self.state_dict(copy_arrays=deep))
        return out


def top_predictions(logits, k: int):
    """(ids [k] by probability descending, ties by id; softmax probabilities [k]) of one logits vector."""
    xp = _xp(logits)
    k = min(k, logits.shape[0])
    ids = xp.sort(xp.argpartition(-logits, k - 1)[:k]) if k < logits.shape[0] else xp.arange(k)
    ids = ids[xp.argsort(-logits[ids], kind="stable")]
    e = xp.exp(logits - logits.max())
    return ids, e[ids] / e.sum()


def model_meta(weights) -> dict:
    """What plots need to label a trace without the weights (JSON-able)."""
    cfg = weights.config
    return {
        "layer_ids": [int(i) for i in weights.layer_ids],
        "attention_kinds": ["kda" if isinstance(layer.attention, KdaWeights) else "mla" for layer in weights.layers],
        "ffn_kinds": ["moe" if isinstance(layer.ffn, LatentMoeWeights) else "dense" for layer in weights.layers],
        "block_boundaries": [int(layer.index) for layer in weights.layers if layer.is_block_boundary],
        "max_sources": int(weights.max_sources),
        "num_experts": int(cfg.num_experts),
        "top_k": int(cfg.num_experts_per_token),
        "kda_heads": int(cfg.linear_attn_config.num_heads),
        "mla_heads": int(cfg.num_attention_heads),
        "vocab_size": int(cfg.vocab_size),
        "hidden_size": int(cfg.hidden_size),
        "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
        "source": str(weights.source),
    }


def _row_norms(x, *shape):
    """L2 norms of x viewed as [prod(shape), -1], returned as `shape`.

    One einsum: on small rows it is several times cheaper than (x * x).sum(axis=-1).
    """
    xp, rows = _xp(x), int(np.prod(shape))
    x = x.reshape(rows, -1)
    return xp.sqrt(xp.einsum("ij,ij->i", x, x)).reshape(shape)


def _take(items: list) -> list:
    """The items, leaving the list itself (whose `append` the site functions hold) empty."""
    out = items[:]
    items.clear()
    return out


def _spread(puts: list):
    """A put for a stacked [n, ...] result: row j of it goes to puts[j]."""

    def put_rows(arr):
        for put, row in zip(puts, arr, strict=True):
            put(row)

    return put_rows


def _to_host(arrays: list) -> list:
    """Device arrays -> host NumPy arrays with one transfer per dtype."""
    xp = _xp(arrays[0])
    out = [None] * len(arrays)
    by_dtype: dict = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = xp.concatenate([arrays[i].reshape(-1) for i in idx]).get()
        offset = 0
        for i in idx:
            n = arrays[i].size
            out[i] = flat[offset : offset + n].reshape(arrays[i].shape)
            offset += n
    return out
