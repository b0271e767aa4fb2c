"""One pipeline stage: a share of K3's layers, their decode states, hooks and recorder, in one process.

`RayPipeline` runs each `Stage` as a Ray actor; nothing here imports Ray. Per token a stage runs
exactly what `kimi_forward_token` runs for its layers (`embed_token` first if it is the first stage,
`run_layers`, `finish_token` last if it is the last), and per chunk what `kimi_forward_sequence`
runs (`embed_chunk`, `run_layers_chunk`, `finish_sequence`), so a staged decode repeats a single
process's arithmetic on the same inputs: the stack that arrives is the one the previous layer left,
rows, 1/rms values and all (`SourceBuffer.pack` / `SequenceSources.pack`).

States live here, under integer ids the driver allocates (`PipelineState` holds one per stage):
new, copy, drop, fetch to the host, put from the host. They never travel through the driver unless
asked (`get_state`, for a session file).
"""

from __future__ import annotations

import os

import numpy as np

from ..backend import on_host, to_numpy
from ..inspection.hooks import HookChain, Hooks
from ..inspection.recorder import Recorder
from ..inspection.session_io import copy_sharing, nbytes_once, share_caches
from ..model.block_residual import SourceBuffer
from ..model.kimi_decoder import KimiDecodeState, embed_token, finish_token, run_layers
from ..model.kimi_sequence import SequenceSources, embed_chunk, finish_sequence, run_layers_chunk
from ..model.kimi_token import check_state

__all__ = ["Stage", "pack_records", "unpack_records"]


def pack_records(records: dict) -> tuple:
    """{key: [array]} -> (spec, {dtype: one flat array}): one buffer per dtype crosses the process
    boundary instead of ~50 small arrays (each costs more to (de)serialize than its bytes)."""
    spec, flat, sizes = [], {}, {}
    for key, rows in records.items():
        for a in rows:
            a = np.asarray(a)
            dt = a.dtype.str
            start = sizes.get(dt, 0)
            spec.append((key, dt, a.shape, start, start + a.size))
            sizes[dt] = start + a.size
            flat.setdefault(dt, []).append(a.reshape(-1))
    return spec, {dt: np.concatenate(parts) for dt, parts in flat.items()}


def unpack_records(packed: tuple, into: dict) -> None:
    """`pack_records`' inverse, appending each array (a view of a private copy of its buffer) to into[key]."""
    spec, flat = packed
    own = {dt: np.array(a, copy=True) for dt, a in flat.items()}  # the received buffers may be reused
    for key, dt, shape, start, stop in spec:
        row = into.get(key)
        if row is None:
            row = into[key] = []
        row.append(own[dt][start:stop].reshape(shape))


class Stage:
    """Stage `number`: layers `layer_ids` of the checkpoint at `path` (stage 0 also loads the embedding,
    the `last` one the output head), loaded by `load()`.

    rows: the whole pipeline's block-stack capacity (`max_sources` of all its layers).
    load_kwargs: `from_pretrained`'s (device, dtype, experts, weight_dtype, ...).
    """

    def __init__(self, number: int, path: str, layer_ids: list[int], last: bool, rows: int, names: list[str],
                 load_kwargs: dict):
        self.number, self.first, self.last, self.rows = number, number == 0, last, rows
        self.names = names  # the whole pipeline's hook names: hooks and recorder patterns are checked against them
        self._load = (path, layer_ids, load_kwargs)
        self.weights = None
        self.states: dict[int, KimiDecodeState] = {}
        self.hooks: Hooks | None = None  # the session's interventions on this stage's sites
        self.recorder: Recorder | None = None
        self.chain = None  # what the decoder fires: hooks, recorder, both or None

    def load(self, experts: str | None = None) -> None:
        """Load the layers (a method, not the constructor, so a bad checkpoint raises its own error); `experts`: the
        expert mode the pipeline decided for all its stages (`experts_on_disk`), else the load_kwargs' own."""
        from ..weights.load import load_weights

        path, layer_ids, kwargs = self._load
        kwargs = kwargs if experts is None else {**kwargs, "experts": experts}
        self.weights = load_weights(path, layers=layer_ids, embedding=self.first, head=self.last, **kwargs)

    def experts_on_disk(self) -> tuple[int, bool]:
        """(this stage's MoE layers, whether their routed experts are all MXFP4 on disk): what experts="auto" goes by,
        which the pipeline decides once for the whole model (`load_options.auto_experts`): decided per stage, a stage
        of few MoE layers would load dense experts where one process loads packed ones, another route."""
        from ..weights.load import hub_options, open_source

        path, layer_ids, kwargs = self._load
        source = open_source(path, layers=layer_ids, embedding=self.first, head=self.last, progress=False,
                             **hub_options(kwargs))
        try:
            moe = [i for i in layer_ids if source.config.is_moe_layer(i)]
            return len(moe), all(source.experts_quantized(i) for i in moe)
        finally:
            source.close()

    def describe(self) -> dict:
        from ..weights.memory import memory_report

        w = self.weights
        return {"layers": w.layer_ids, "device": w.device, "pid": os.getpid(), "memory": memory_report(w)}

    # ------------------------------------------------------------------ states, by id
    def new_state(self, sid: int) -> None:
        self.states[sid] = KimiDecodeState.new(self.weights)

    def copy_state(self, src: int, dst: int, checkpoint: bool = False) -> None:
        """State dst: a copy of state src (`checkpoint`: one to keep, never to decode on)."""
        self.states[dst] = self.states[src].checkpoint() if checkpoint else self.states[src].copy()

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """For each (src, dst): state dst, a copy of state src; the copies share among themselves what the
        sources share (`session_io.copy_sharing`, what `Session.snapshot(copy_arrays=True)` does in one process)."""
        copies = copy_sharing([self.states[src] for src, _ in pairs])
        for (_, dst), state in zip(pairs, copies, strict=True):
            self.states[dst] = state

    def share_caches(self, sids: list[int]) -> None:
        """States loaded from a session file (a history's checkpoints, longest first): `session_io.share_caches`."""
        share_caches([self.states[sid] for sid in sids], self.weights.xp)

    def states_nbytes(self, sids: list[int]) -> int:
        """Bytes of these states' arrays, each array once (checkpoints share MLA caches)."""
        return nbytes_once([self.states[sid] for sid in sids])

    def drop_states(self, sids: list[int]) -> None:
        for sid in sids:
            self.states.pop(sid, None)

    def get_state(self, sid: int) -> KimiDecodeState:
        """A host copy (NumPy arrays)."""
        state = self.states[sid]
        host = lambda a: np.array(to_numpy(a), copy=True)  # noqa: E731
        return KimiDecodeState([ls.converted(host) for ls in state.layers], state.position)

    def put_state(self, sid: int, state: KimiDecodeState) -> None:
        # a copy: arrays Ray hands over are read-only views of its object store, and states are written in place
        own = self.weights.xp.array
        state = KimiDecodeState([ls.converted(own) for ls in state.layers], state.position, layer_ids=state.layer_ids)
        check_state(self.weights, state)  # (its widths against this stage's weights)
        self.states[sid] = state

    def state_nbytes(self, sid: int) -> int:
        return self.states[sid].nbytes

    def head(self) -> tuple:
        """The output head as host float arrays (the last stage): (output_attn_res_score, norm, lm_head)."""
        w = self.weights
        return tuple(np.array(to_numpy(np.asarray(a) if on_host(w.xp) else a), copy=True)
                     for a in (w.output_attn_res_score, w.norm, w.lm_head))

    def weight_samples(self) -> tuple[dict, list, list]:
        return self.weights.weight_samples()

    # ------------------------------------------------------------------ hooks and recording
    def configure(self, hooks: list, recorder: tuple | None) -> None:
        """hooks: [(pattern, names_filter, fn, chunks)] on this stage's sites; recorder: None or (settings, its hooks)."""
        self.hooks = _with_hooks(self._bound(Hooks()), hooks) if hooks else None
        self.recorder = None
        if recorder is not None:
            settings, recorder_hooks = recorder
            self.recorder = Recorder(**settings).bind(self.weights, names=self.names)
            self._bound(self.recorder.hooks)
            self.recorder = _with_hooks(self.recorder, recorder_hooks)
        parts = [h for h in (self.hooks, self.recorder) if h is not None]
        self.chain = parts[0] if len(parts) == 1 else HookChain(*parts) if parts else None

    def _bound(self, hooks: Hooks) -> Hooks:
        """`hooks` checked against the whole pipeline's names, and told its source columns (`rows`: integer source
        columns count model-wide, `inspection.source_masks`), which this stage's own layers would not give."""
        hooks.bind(self.names)
        hooks.max_sources = self.rows
        return hooks

    # ------------------------------------------------------------------ one token, or one chunk
    def run(self, token: tuple, previous: tuple | None = None):
        """This stage's share of one token or one chunk. token: (every stage's state id, a token id or
        a list of them (a chunk of the sequence path), the (first) position); previous: the previous
        stage's result. Returns (the packed stack, or the logits on the last stage; the records
        (`pack_records`), or None without a recorder; the position, which the driver checks: each result
        must be this token's)."""
        w, hooks = self.weights, self.chain
        ids, token_id, position = token
        sid, packed = ids[self.number], None if previous is None else previous[0]
        if previous is not None and previous[2] != position:
            raise RuntimeError(f"pipeline stage {self.number}: got the stack of position {previous[2]} for position {position}")
        chunk = isinstance(token_id, list)
        state, eps = self.states[sid], w.config.rms_norm_eps
        try:
            if chunk:
                if hooks is not None:
                    hooks.begin_chunk(token_id, range(position, position + len(token_id)))
                try:
                    stack = embed_chunk(w, token_id, hooks, rows=self.rows) if self.first else \
                        SequenceSources.unpack(packed, w.xp, self.rows, w.dtype, eps)
                    run_layers_chunk(w, state, stack, hooks)
                    out = to_numpy(finish_sequence(w.head(), stack, hooks)).copy() if self.last else stack.pack()
                finally:
                    if hooks is not None:
                        hooks.end_chunk()
                state.position += len(token_id)
            else:
                if hooks is not None:
                    (hooks.begin_token if self.first else hooks.start_token)(token_id, position)
                stack = embed_token(w, token_id, hooks, rows=self.rows) if self.first else \
                    SourceBuffer.unpack(packed, w.xp, self.rows, w.dtype, eps)
                run_layers(w, state, stack, hooks)
                out = to_numpy(finish_token(w.head(), stack, hooks)).copy() if self.last else stack.pack()
                state.position += 1
                if self.recorder is not None and not self.last:
                    self.recorder.end_token()
            if self.recorder is None:
                return out, None, position
            return out, pack_records(self.recorder.take_blocks()), position
        except BaseException:  # (the driver marks its PipelineState broken: `RayPipeline._run`)
            if self.recorder is not None:
                self.recorder.truncate(0)  # forget the half-recorded token
            raise

    def ping(self) -> int:
        return os.getpid()


def _with_hooks(hooks, specs: list):
    """`hooks` (a Hooks or a Recorder) with the hooks [(pattern, names_filter, fn, chunks)] added."""
    target = hooks.hooks if isinstance(hooks, Recorder) else hooks  # a Recorder's own Hooks take `chunks`
    for pattern, names_filter, fn, chunks in specs:
        target.add(pattern, fn, names_filter=names_filter, chunks=chunks)
    return hooks
