"""How a Recorder records a whole chunk of the sequence path: the same per-token records as stepping.

On the sequence path (`kimi_forward_sequence`) each site fires once per chunk with the values of its
T tokens stacked on a leading axis. `ChunkRecording` turns each into T records, exactly the keys,
shapes and (to float rounding) values the token form records:

    kind (recorder.DEFAULT_SITES)   chunk value            records added
    fresh                           [T, ...]               its T rows (the fresh chunk array itself)
    norm (moe.*_out)                [T, d]                 T norms
    top (logits)                    [T, V]                 T top-k ids and probabilities
    kda.state / kda.conv            their norms [T, H] / [T, 3, H], given by the decoder
                                    (`observe_chunk`): the full per-token states are never built
    full= records                   [T, ...]               T copies (mla.probs [T, nh, L0 + T]: the masked
                                                           positions after each token NaN, the padding its
                                                           token-form row [nh, L0 + t + 1] gets in a Trace;
                                                           per-token rows are cut to that width)

Routing ids with -1 (an expert dropped by a chunk-aware intervention at some tokens, e.g.
`ablate_experts`) are recorded without the -1 entries, and the same tokens' weights without
theirs: what stepping records, where a dropped expert is simply absent. That holds for default and
`full=` records alike, and for the weights when the ids are not recorded (they are read all the same).
The weights are dropped by the ids the layer routes by, which the decoder tells after every hook
(`observe_chunk`): a hook set after the recorder in a HookChain may have changed the ids it recorded.
A layer that runs token by token inside a chunk (a per-token hook there) records through
`record(name, value[None])`, one row at a time, in order.

Each chunk's records of a key go to the Recorder whole (`Recorder.chunk_put`: one [T, ...] block,
split into per-token rows only where those are read); a ragged chunk goes as T one-row blocks.
"""

from __future__ import annotations

from .._xp import array_namespace
from ..backend import to_numpy
from ._hook_grammar import site_kind

__all__ = ["ChunkRecording"]

IDS, WEIGHTS = "moe.router.topk_ids", "moe.router.topk_weights"


class ChunkRecording:
    """The chunk-recording functions of one Recorder, by site name (built once per name)."""

    def __init__(self, recorder):
        self.rec = recorder
        self._fns: dict[str, tuple] = {}
        self._dropped: dict[str, object] = {}  # "layers.{i}." -> [T, k] mask of ids kept, while -1 entries are present
        self._conv_waiting: dict[str, tuple] = {}  # "layers.{i}.kda." -> (put, a token's conv window): unbound, until its state

    def record(self, name: str, value) -> None:
        """Record a chunk `value` [T, ...] that flowed at `name`."""
        for fn in self.functions(name):
            fn(value)

    def clear(self) -> None:
        self._fns.clear()

    def functions(self, name: str) -> tuple:
        """The functions recording a chunk value at `name` (none where nothing is recorded)."""
        fns = self._fns.get(name)
        if fns is None:
            fns = self._fns[name] = tuple(self._build(name))
        return fns

    def _build(self, name: str):
        rec = self.rec
        kind = site_kind(name)
        how = rec.recorded_kind(name, kind)
        if kind in (IDS, WEIGHTS):  # ragged: a default or a full= record alike drops a chunk's -1 entries
            yield from self._routing(name[: -len(kind)], kind, self._recorded(name, kind))
            return
        if how == "fresh":
            put = rec.chunk_put(name)
            yield lambda v: rec.emit(put, v)
        elif how == "norm":
            put = rec.chunk_put(name + ".norm")
            yield lambda v: rec.emit(put, _norms(v.reshape(v.shape[0], 1, -1))[:, 0])
        elif how == "top":
            ids, probs = rec.chunk_put("logits.top_ids"), rec.chunk_put("logits.top_probs")
            yield lambda v: rec.emit_top(ids, probs, v)
        elif how in ("kda.state", "kda.conv"):  # full values (a layer run token by token): their norms
            put = rec.chunk_put(name + ".norm")
            if kind == "kda.state":
                yield lambda s: rec.emit(put, _norms(s.reshape(s.shape[0], s.shape[1], -1)))
            elif "kda_heads" in rec.meta:
                yield lambda w: rec.emit(put, _conv_norms(w, rec.meta["kda_heads"]))
            else:  # an unbound recorder: the layer's state, which fires next in the same token, gives the heads
                yield lambda w: self._conv_waiting.__setitem__(name[: -len("conv")], (put, w.copy()))
        if kind == "kda.state" and "kda_heads" not in rec.meta:
            yield lambda s: self._conv_for_state(name[: -len("state")], s.shape[1])
        if rec.full is not None and rec.full(name) and how != "fresh":  # a fresh default record is already the value
            full = rec.chunk_put(name)  # (its own name: the lambdas above read `put` when called)
            if kind == "mla.probs":
                yield lambda p: rec.emit(full, _future_nan(p))
            else:
                yield lambda v: rec.emit(full, v.copy())

    def _conv_for_state(self, prefix: str, heads: int) -> None:
        waiting = self._conv_waiting.pop(prefix, None)
        if waiting is not None:
            self.rec.emit(waiting[0], _conv_norms(waiting[1], heads))

    def observe(self, name: str, value) -> None:
        """The decoder's per-token norms of a site it does not fire whole (kda.state [T, H], kda.conv [T, 3, H]), or
        the ids a MoE layer routes by after every hook (moe.router.topk_ids [T, k']): the weights that fire next are
        theirs, so their -1 entries say which weights to drop (a hook set after this recorder may have changed the
        ids it saw)."""
        kind = site_kind(name)
        if kind == name:  # (a global site: not one the decoder summarises)
            return
        if kind == IDS:
            prefix = name[: -len(IDS)]
            if self._recorded(prefix + WEIGHTS, WEIGHTS):
                self._drop_by(prefix, value)
        elif self.rec.recorded_kind(name, kind) is not None:
            self.rec.emit(self.rec.chunk_put(name + ".norm"), value)

    def _recorded(self, name: str, kind: str) -> bool:
        return self.rec.recorded_kind(name, kind) is not None or (self.rec.full is not None and self.rec.full(name))

    def _routing(self, prefix: str, kind: str, recorded: bool):
        """A layer's routing records; the ids (they fire first) also say which weights to drop, so they are
        read when only the weights are recorded."""
        if kind == IDS and (recorded or self._recorded(prefix + WEIGHTS, WEIGHTS)):
            put = self.rec.chunk_put(prefix + IDS) if recorded else None
            yield lambda ids: self._ids(prefix, put, ids)
        elif kind == WEIGHTS and recorded:
            put = self.rec.chunk_put(prefix + WEIGHTS)
            yield lambda w: self._weights(prefix, put, w)

    def _ids(self, prefix: str, put, ids) -> None:
        keep = self._drop_by(prefix, ids)
        if put is None:
            return
        if keep is None:  # the common case: the chunk's block whole
            self.rec.emit(put, ids)
        else:
            self._emit_rows(put, ids, keep)

    def _drop_by(self, prefix: str, ids):
        """The layer's weights are dropped where `ids` [T, k] has -1: the mask kept (None: nothing dropped). On a GPU
        the verdict is one flag to the host (one sync; twice per MoE layer and chunk: the ids the recorder saw, the ids
        the layer routed by); only a chunk that dropped experts (an ablation) is then emitted row by row."""
        keep = ids >= 0
        if bool(to_numpy(keep.all())):
            self._dropped.pop(prefix, None)
            return None
        self._dropped[prefix] = keep
        return keep

    def _weights(self, prefix: str, put, w) -> None:
        keep = self._dropped.pop(prefix, None)
        if keep is None:
            self.rec.emit(put, w)
        else:
            self._emit_rows(put, w, keep)

    def _emit_rows(self, put, a, keep) -> None:
        """Row t of a [T, k] without its dropped entries, one record each (a ragged chunk: one-row blocks)."""
        for row, k in zip(a, keep, strict=True):
            self.rec.emit(put, row[k][None])


def _future_nan(p):
    """A copy of a chunk's attention probabilities [T, nh, L0 + T] with token t's masked positions (after L0 + t)
    NaN: stacked, the rows read as the token form's [nh, L0 + t + 1] padded by a Trace, where 0 would read as
    probabilities the token gave (a patch from the record would refuse them: `interventions._unpad`)."""
    xp = array_namespace(p)
    out = p.copy()
    T = p.shape[0]
    t = xp.arange(T)
    xp.copyto(out[:, :, p.shape[2] - T :], xp.nan, where=(t[None, :] > t[:, None])[:, None, :])
    return out


def _conv_norms(w, heads: int):
    """Conv windows [T, 3, P, W] -> each head's window norm per stream [T, 3, H] (channel h K + j of each stream)."""
    return _norms(w.reshape(w.shape[0], 3 * heads, -1)).reshape(w.shape[0], 3, heads)


def _norms(x):
    """[T, rows, n] -> L2 norm of each row [T, rows] (one batched matmul)."""
    xp = array_namespace(x)
    return xp.sqrt(xp.matmul(x[:, :, None, :], x[:, :, :, None])[:, :, 0, 0])
