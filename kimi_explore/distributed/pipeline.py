"""A Ray pipeline: K3's layers split over several processes, hosts or GPUs, decoding exactly as one process.

    pipe = ke.RayPipeline("moonshotai/Kimi-K3", stages=16, device="gpu", address="auto", experts="packed")
    s = ke.Session(pipe)                      # step, feed, generate, trace, interventions, truncate, fork, ...
    s.feed(ids)

Each stage is a Ray actor (`Stage`; `num_gpus=1` on GPUs) that loads only its layers (with the
embedding on the first stage and the output head on the last), reading only its own shards, from
a local directory or the Hub. It keeps its layers' decode states (KDA windows and recurrent
matrices, MLA caches) where they live. Per token the driver submits one `run` per stage, each
taking the previous stage's result by reference, so the stack (the sealed blocks and the running
sum: at most 9 x 7168 floats for K3, plus their 1/rms) goes from stage to stage inside Ray and
the driver waits once, for the logits and each stage's records.

Exactness: every stage runs the decoder's own `embed_token` / `run_layers` / `finish_token` on the
stack as the previous layer left it, so on the CPU the logits and every recorded array equal a
single-process decode of the same layers bit for bit (tested with 2-4 stages).

Hooks run in the stage that owns their site: `Session` passes its hooks here, and each stage gets
the ones that match its sites (their functions travel by cloudpickle). A hook's return value
changes the decode as in one process; its side effects happen in the stage's process (to bring
values back, record them: `Recorder(full=[...])`). Each stage records its own layers; the driver
merges them into the session's Recorder, so `session.trace()` is one Trace.

Faults: a stage that dies raises `StageLostError` naming it and its layers; the session keeps its
history, and `session.recover()` restarts the stage from its shards and replays the tokens.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import os
import weakref
from dataclasses import dataclass

import numpy as np

from .._warnings import warn_at_caller
from ..backend import resolve_dtype
from ..errors import StageLostError
from ..inspection._hook_grammar import is_glob
from ..model.config import KimiDecoderConfig
from ..model.kimi_decoder import (
    KimiDecodeState,
    LayerSequence,
    OutputHead,
    hook_names,
    mark_broken,
    refuse_broken,
    refuse_shared,
    token_index,
    token_indices,
)
from ..model.kimi_sequence import default_chunk, takes_tokens
from ..weights.checkpoint import resolve_layers
from ..weights.load import check_options, hub_options, read_config
from ..weights.load_options import auto_experts
from ..weights.workspace import OnePass, one_thread
from .stage import Stage, unpack_records

__all__ = ["PipelineState", "RayPipeline", "StageLostError", "split_layers"]


RAY_GRAPH_LOGGER = "ray.dag.compiled_dag_node"  # Ray's compiled-graph module logs its teardowns here


class _LostStageTeardown(logging.Filter):
    """Ray's compiled-graph monitor thread tears a graph down by itself the moment one of its actors dies,
    logging each step (INFO) and, for every dead actor it cannot cancel, "Error cancelling worker task" with
    two ActorDiedError tracebacks: for a lost stage, which `StageLostError` reports once, that is noise, and it
    comes from Ray's thread before `_teardown` runs (so `_teardown`'s level change cannot cover it). While a
    pipeline's graph is alive (`graphs`), this filter on `RAY_GRAPH_LOGGER` drops those records and only
    those: other warnings and errors of that logger pass, and with no pipeline graph alive everything does."""

    def __init__(self):
        super().__init__()
        self.graphs = weakref.WeakSet()  # the compiled graphs of live pipelines

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.graphs:
            return True
        if record.levelno <= logging.INFO:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        return not _actor_died(exc)


def _actor_died(exc) -> bool:
    if exc is None:
        return False
    import ray

    return isinstance(exc, ray.exceptions.RayActorError)  # ActorDiedError and the other ways an actor is lost


LOST_STAGE_TEARDOWN = _LostStageTeardown()


def split_layers(layer_ids: list[int], stages) -> list[list[int]]:
    """`stages`: a count (contiguous, as equal as can be, earlier stages one longer) or a list of layer
    ranges/lists whose concatenation is strictly increasing. Returns each stage's layer ids."""
    if isinstance(stages, numbers.Integral) and not isinstance(stages, (bool, np.bool_)):
        stages = int(stages)
        if not 1 <= stages <= len(layer_ids):
            raise ValueError(f"RayPipeline: stages={stages}: expected 1..{len(layer_ids)} (one layer per stage at most "
                             f"for {len(layer_ids)} layers)")
        q, r = divmod(len(layer_ids), stages)
        bounds = list(itertools.accumulate([q + (k < r) for k in range(stages)], initial=0))
        return [layer_ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    if isinstance(stages, (str, bytes)) or not hasattr(stages, "__iter__"):
        raise TypeError(f"RayPipeline: stages must be a stage count or a list of layer ranges, got {stages!r}")
    parts = []
    for k, part in enumerate(stages):  # int() would take "12" as layers 1 and 2, 2.5 as 2, True as 1
        if isinstance(part, (str, bytes)) or not hasattr(part, "__iter__"):
            raise TypeError(f"RayPipeline: stages[{k}] must be a range or list of layer indices, got {part!r}")
        part = list(part)  # (an iterator is read once)
        bad = [i for i in part if isinstance(i, (bool, np.bool_)) or not isinstance(i, numbers.Integral)]
        if bad:
            raise TypeError(f"RayPipeline: stages[{k}] holds {bad[0]!r} ({type(bad[0]).__name__}); layer indices are "
                            "integers")
        negative = [int(i) for i in part if i < 0]
        if negative:
            raise ValueError(f"RayPipeline: stages[{k}] holds layer {negative[0]}; layer indices are 0-based, >= 0")
        parts.append([int(i) for i in part])
    flat = [i for part in parts for i in part]
    if not parts or any(not part for part in parts):
        raise ValueError(f"RayPipeline: stages={stages!r}: every stage needs at least one layer")
    if any(b <= a for a, b in zip(flat, flat[1:], strict=False)):
        raise ValueError(f"RayPipeline: stages={stages!r}: the stages' layers, in order, must be strictly increasing")
    return parts


@dataclass
class _StageRef:
    number: int
    layer_ids: list[int]
    spec: tuple  # Stage(*spec)
    actor: object = None
    epoch: int = 0  # incarnation: bumped by every restart, whose states are new
    lost: bool = False
    names: frozenset = frozenset()  # hook sites this stage fires

    def describe(self) -> str:
        ids = self.layer_ids
        span = f"layer {ids[0]}" if len(ids) == 1 else f"layers {ids[0]}-{ids[-1]}"
        return f"stage {self.number} ({span})"


class PipelineState:
    """A pipeline's decode state: one state id per stage (the arrays stay in the stages) and the position.

    `copy()` copies inside each stage; a state that is garbage-collected is dropped from its stages.
    broken: as `KimiDecodeState.broken` (a token or chunk that raised part-way through the stages).
    shared: as `KimiDecodeState.shared` (a checkpoint, whose MLA caches others share: never decoded on).
    """

    def __init__(self, pipeline: RayPipeline, ids: list[int], epochs: list[int], position: int = 0,
                 shared: bool = False):
        self.pipeline, self.ids, self.epochs, self.position = pipeline, ids, epochs, position
        self.broken: str | None = None
        self.shared = shared
        self._finalizer = weakref.finalize(self, pipeline._drop_states, ids, epochs)

    def copy(self) -> PipelineState:
        return self.pipeline._copy_state(self)

    def checkpoint(self) -> PipelineState:
        """`KimiDecodeState.checkpoint` in each stage: to keep, never to decode on (its MLA caches are shared)."""
        return self.pipeline._copy_state(self, checkpoint=True)

    @property
    def nbytes(self) -> int:
        return self.pipeline._state_nbytes(self)

    def __repr__(self) -> str:
        broken = ", broken" if self.broken else ""
        return f"PipelineState(position {self.position}, {len(self.ids)} stages, ids {self.ids}{broken})"


class RayPipeline(LayerSequence):
    """K3 over Ray actors, one per stage (see module docstring).

    path: a checkpoint directory (on every node, at the same path) or a Hub repo id.
    stages: a stage count, or a list of layer ranges (e.g. [range(0, 47), range(47, 93)]).
    device: "cpu" | "gpu" (each stage gets one GPU); address: None starts a local Ray (or uses the one
    this process already started), else a cluster address ("auto", "ray://host:10001").
    actor_options: Ray options for each stage actor (default: {"num_gpus": 1} on GPUs, {"num_cpus": 0}
    on CPUs, so stages are not limited by CPU slots; give e.g. {"num_cpus": 8} to spread them).
    Further keyword arguments go to each stage's `from_pretrained` (layers= picks the layers to
    split; dtype, experts, weight_dtype, expert_cache_size, revision, cache_dir, token, ...).
    """

    def __init__(self, path, *, stages=2, device: str = "cpu", address: str | None = None,
                 actor_options: dict | None = None, layers=None, **load_kwargs):
        import ray

        if device not in ("cpu", "gpu"):
            raise ValueError(f"RayPipeline: device must be 'cpu' or 'gpu', got {device!r}")
        check_options("RayPipeline", load_kwargs, fixed=("device", "layers", "embedding", "head"))  # (progress: off)
        self.source, self.device = str(path), device
        self.config = _config(path, load_kwargs)
        self.dtype = resolve_dtype(load_kwargs.get("dtype", "float32"))
        self.xp = np  # what the driver holds (logits, records) is host NumPy
        ids = resolve_layers(layers, self.config.num_hidden_layers)
        parts = split_layers(ids, stages)
        flat = resolve_layers([i for p in parts for i in p], self.config.num_hidden_layers)  # checks the range
        if flat != ids:  # (stages that left a layer out would run another model)
            raise ValueError(f"RayPipeline: the stages' layers {flat} are not the layers to load, {ids}"
                             + (" (all of the model's: give layers= to load a subset)" if layers is None else ""))
        self.specs = [self.config.layer_spec(i) for i in flat]
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False)  # stages' prints (a hook's) reach this process
        options = {"num_gpus": 1} if device == "gpu" else {"num_cpus": 0}
        # BLAS's matrix products (the sequence path) round differently with another thread count: the stages
        # use this process's, which Ray would otherwise set to 1, so that chunks decode as in one process
        options["runtime_env"] = {"env_vars": blas_threads_env()}
        options = {**options, **(actor_options or {})}
        _check_resources(options, len(parts), ray.cluster_resources())
        self._actor_class = ray.remote(Stage).options(**options)
        names = hook_names(self)
        kw = {**load_kwargs, "device": device, "progress": False}
        self.stages = []
        for k, stage_ids in enumerate(parts):
            first, last = k == 0, k == len(parts) - 1
            own = {n for n in names if _site_layer(n) in stage_ids or (first and n == "embed")
                   or (last and _site_layer(n) is None and n != "embed")}
            spec = (k, str(path), stage_ids, last, self.max_sources, names, kw)
            self.stages.append(_StageRef(k, stage_ids, spec, names=frozenset(own)))
        self._ids = itertools.count(1)
        self._one_pass = OnePass("this RayPipeline is decoding in another thread: its stages serve one call at a time. "
                                 "Run the threads' calls one after the other, or start a RayPipeline per thread")
        self._configured = None  # what the stages' hooks and recorders were last set to
        self._closed = False  # `close()`d: the stages are stopped for good (not lost: `recover` does not restart them)
        self._held = {"graph": None}  # the compiled Ray graph of one token through every stage (`_graph`)
        # a pipeline dropped without close(): Ray keeps a compiled graph (and so its actors) alive until it shuts down
        self._finalizer = weakref.finalize(self, _stop, self._held, self.stages)
        self._finalizer.atexit = False  # (at exit Ray's own shutdown stops them)
        self._head = None  # the output head, copied from the last stage once (`head`)
        self._garbage: list = []  # (state ids, epochs) of collected PipelineStates, to drop on their stages
        auto = kw.get("experts", "auto") == "auto" and kw.get("expert_cache_size") is None
        # "auto" (None): decided once for all stages, at the first start; with a cache size, "auto" is packed or mapped
        self._experts = None if auto else kw.get("experts", "auto")
        self._start(self.stages)

    # ------------------------------------------------------------------ the model, as Session and Recorder see it
    def memory_reports(self) -> list:
        """Each stage's `memory_report()` (bytes resident in that stage's process or GPU)."""
        return [d["memory"] for d in self._get([s.actor.describe.remote() for s in self.stages], self.stages)]

    def weight_samples(self) -> tuple[dict, list, list]:
        """(global tensors' samples, every layer tensor's samples in layer order, the small expert banks' samples
        in layer order), as in one process (`weights_fingerprint`)."""
        globals_, layers, experts = {}, [], []
        for g, lay, ex in self._get([s.actor.weight_samples.remote() for s in self.stages], self.stages):
            globals_.update(g)
            layers += lay
            experts += ex
        return globals_, layers, experts

    def head(self) -> OutputHead:
        """The output head (output mix score, final norm, lm_head) copied from the last stage to this
        process once, as host arrays: what the logit lens reads (per token; K3's lm_head is 4.7 GB)."""
        if self._head is None:
            last = self.stages[-1]
            score, norm, lm_head = self._get([last.actor.head.remote()], [last])[0]
            self._head = OutputHead(score, norm, lm_head, self.config.rms_norm_eps)
        return self._head

    def local_weights(self):
        """An exact attribution reads every layer's weights in one process, which a pipeline does not have."""
        raise TypeError("this analysis reads every layer's weights in this process, and a RayPipeline keeps them in "
                        "its stages: save the session (session.save_state(path)), load it over in-process weights "
                        "(Session.load_state(path, ke.from_pretrained(...))) and run it there")

    def __repr__(self) -> str:
        parts = ", ".join(s.describe() + (" LOST" if s.lost else "") for s in self.stages)
        return f"RayPipeline({len(self.stages)} stages on {self.device}: {parts}; source {self.source!r})"

    # ------------------------------------------------------------------ decoding
    # State calls are waited for: the compiled graph's runs are not ordered with ordinary actor calls.
    @one_thread
    def new_state(self) -> PipelineState:
        self._check_alive()
        ids = [next(self._ids) for _ in self.stages]
        self._get([s.actor.new_state.remote(sid) for s, sid in zip(self.stages, ids, strict=True)], self.stages)
        return PipelineState(self, ids, [s.epoch for s in self.stages])

    def forward_token(self, state: PipelineState, token_id, hooks=None) -> np.ndarray:
        """One token through every stage; `state` advanced; logits [vocab] (host). `hooks`: what
        `Session` would pass `kimi_forward_token` (None, Hooks, a Recorder, or a HookChain of them)."""
        return self._run(state, token_index(token_id, self.config.vocab_size), hooks)  # checked here, not in a stage

    @one_thread
    def _run(self, state: PipelineState, what, hooks):
        """One token (an id) or one chunk (a list of ids) through the compiled graph."""
        import ray

        self._check(state)
        refuse_shared(state)
        position = state.position
        recorder = self._configure(hooks)
        doing = f"token {what} at position {position}" if isinstance(what, int) else \
            f"tokens {position}..{position + len(what) - 1}"
        try:
            try:
                refs = self._compiled().execute((tuple(state.ids), what, position))
            except (ray.exceptions.RayActorError, ray.exceptions.RayChannelError) as e:  # a stage that died while idle
                self._lost(e, self.stages, doing)
            outs = self._get(refs, self.stages, doing)
        except BaseException as e:  # e.g. KeyboardInterrupt while waiting: the graph still holds this execution, whose
            self._teardown()  # results nobody reads, and the next one would wait for them forever: a new graph
            mark_broken(state, e, 1 if isinstance(what, int) else len(what))  # some stages may have run it
            raise
        stale = [s.describe() for s, out in zip(self.stages, outs, strict=True) if out[2] != position]
        if stale:  # never seen; it would mean a channel handed over another token's values
            self._teardown()
            raise RuntimeError(f"RayPipeline: {', '.join(stale)} returned the result of another position than {position}")
        n = 1 if isinstance(what, int) else len(what)
        state.position += n
        # copies: what a compiled graph returns may be views of its channel buffers, reused by the next token
        if recorder is not None:
            records = {}
            for _, packed, _ in outs:
                unpack_records(packed, records)
            recorder.add_blocks([what] if n == 1 and isinstance(what, int) else what, range(position, position + n), records)
        return np.array(outs[-1][0], copy=True)

    def forward_sequence(self, state: PipelineState, token_ids, hooks=None, chunk: int | None = None) -> np.ndarray:
        """T tokens through every stage, `chunk` at a time (one hop per chunk and stage, carrying the
        chunk's [T, sources, d] stack); `state` advanced; logits [T, vocab] (host)."""
        V = self.config.vocab_size
        ids = token_indices(token_ids, V)
        chunk = default_chunk(self.config) if chunk is None else chunk
        if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:  # as kimi_forward_sequence
            raise ValueError(f"RayPipeline.forward_sequence: chunk must be a positive int, got {chunk!r}")
        chunk = int(chunk)
        if hooks is not None and takes_tokens(hooks, hook_names(self)):  # a hook for single tokens: stepping's order
            return np.stack([self._run(state, i, hooks) for i in ids]) if ids else np.zeros((0, V), self.dtype)
        out = [self._run(state, ids[a : a + chunk], hooks) for a in range(0, len(ids), chunk)]
        return np.concatenate(out) if out else np.zeros((0, V), self.dtype)

    @property
    def _graph(self):
        return self._held["graph"]

    @_graph.setter
    def _graph(self, graph) -> None:
        self._held["graph"] = graph

    def _compiled(self):
        """One token through every stage as a compiled Ray graph: the stages' channels stay open, so a
        hop costs a shared-memory write and read (~0.2 ms) instead of a task submission (~1.5 ms)."""
        if self._graph is None:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as token:
                outs, previous = [], None
                for s in self.stages:
                    previous = s.actor.run.bind(token) if previous is None else s.actor.run.bind(token, previous)
                    outs.append(previous)
                self._graph = MultiOutputNode(outs).experimental_compile(_submit_timeout=-1)
            LOST_STAGE_TEARDOWN.graphs.add(self._graph)
            logging.getLogger(RAY_GRAPH_LOGGER).addFilter(LOST_STAGE_TEARDOWN)  # (added once: Logger.addFilter dedups)
        return self._graph

    def _teardown(self) -> None:
        _teardown_graph(self._held)

    @one_thread
    def host_state(self, state: PipelineState) -> KimiDecodeState:
        """The whole decode state in this process (host arrays of its own, writable: one process's weights of the
        same layers decode on it), layer by layer."""
        self._check(state)
        parts = self._get([s.actor.get_state.remote(sid) for s, sid in zip(self.stages, state.ids, strict=True)],
                          self.stages)
        own = lambda a: np.array(a, copy=True)  # noqa: E731 (what Ray hands over: read-only views of its object store)
        return KimiDecodeState([ls.converted(own) for p in parts for ls in p.layers], state.position,
                               layer_ids=tuple(int(spec.index) for spec in self.specs))

    @one_thread
    def put_state(self, host: KimiDecodeState) -> PipelineState:
        """A pipeline state holding `host`'s layers (as `host_state` gives them), each on its stage. Refused as one
        process refuses it (`check_state`): another layer count, kinds, widths or dtype, other layers, part-advanced."""
        if not hasattr(host, "layers") or not hasattr(host, "position"):
            raise TypeError(f"RayPipeline.put_state: expected a KimiDecodeState (as host_state gives it), got "
                            f"{type(host).__name__}")
        refuse_broken(host)
        if len(host.layers) != len(self.specs):
            raise ValueError(f"RayPipeline.put_state: the state has {len(host.layers)} layers, the pipeline {len(self.specs)}")
        here = [int(spec.index) for spec in self.specs]
        made_for = getattr(host, "layer_ids", None)
        if made_for is not None and list(made_for) != here:
            raise ValueError(f"RayPipeline.put_state: state was made for layers {list(made_for)}, this pipeline holds "
                             f"layers {here}")
        for i, (ls, spec) in enumerate(zip(host.layers, self.specs, strict=True)):
            kind = ls.attention.kind
            wrong = [f"{k} in {a.dtype}" for k, a in ls.arrays().items() if a.dtype != np.dtype(self.dtype)]
            if kind != spec.attention or wrong:
                raise ValueError(f"RayPipeline.put_state: state.layers[{i}] is not a state of this pipeline's layer "
                                 f"{spec.index} ({spec.attention} in {np.dtype(self.dtype).name}): found "
                                 + (f"a {kind} state" if kind != spec.attention else ", ".join(wrong)))
        self._check_alive()
        ids, at, calls = [next(self._ids) for _ in self.stages], 0, []
        for s, sid in zip(self.stages, ids, strict=True):
            n = len(s.layer_ids)  # (each stage checks its layers' widths against its weights: `check_state`)
            calls.append(s.actor.put_state.remote(sid, KimiDecodeState(host.layers[at:at + n], host.position,
                                                                        layer_ids=tuple(here[at:at + n]))))
            at += n
        self._get(calls, self.stages)
        return PipelineState(self, ids, [s.epoch for s in self.stages], host.position)

    @one_thread
    def _copy_state(self, state: PipelineState, checkpoint: bool = False) -> PipelineState:
        self._check(state)
        ids = [next(self._ids) for _ in self.stages]
        self._get([s.actor.copy_state.remote(src, dst, checkpoint)
                   for s, src, dst in zip(self.stages, state.ids, ids, strict=True)], self.stages)
        return PipelineState(self, ids, list(state.epochs), state.position, shared=checkpoint)

    @one_thread
    def copy_kept(self, states: list[PipelineState]) -> list[PipelineState]:
        """Copies of these states (a session's checkpoints), made in each stage, sharing among themselves
        the arrays these share (their MLA caches), as `Session.snapshot(copy_arrays=True)` copies in one process."""
        for state in states:
            self._check(state)
        new = [[next(self._ids) for _ in self.stages] for _ in states]
        self._get([s.actor.copy_states.remote([(state.ids[k], ids[k]) for state, ids in zip(states, new, strict=True)])
                   for k, s in enumerate(self.stages)], self.stages)
        return [PipelineState(self, ids, list(state.epochs), state.position, shared=state.shared)
                for state, ids in zip(states, new, strict=True)]

    @one_thread
    def share_kept(self, states: list[PipelineState]) -> None:
        """Checkpoints loaded from a session file, longest first: their MLA caches shared in each stage where
        they hold the same positions (`session_io.share_caches`), as a session's own checkpoints share them."""
        for state in states:
            self._check(state)
        self._get([s.actor.share_caches.remote([state.ids[k] for state in states]) for k, s in enumerate(self.stages)],
                  self.stages)
        for state in states:
            state.shared = True

    @one_thread
    def states_nbytes(self, states: list[PipelineState]) -> int:
        """Bytes these states hold in the stages, each array once (a session's checkpoints share MLA caches)."""
        for state in states:
            self._check(state)
        return sum(self._get([s.actor.states_nbytes.remote([state.ids[k] for state in states])
                              for k, s in enumerate(self.stages)], self.stages))

    @one_thread
    def _state_nbytes(self, state: PipelineState) -> int:
        self._check(state)
        return sum(self._get([s.actor.state_nbytes.remote(sid) for s, sid in zip(self.stages, state.ids, strict=True)],
                             self.stages))

    def _drop_states(self, ids: list[int], epochs: list[int]) -> None:
        """A PipelineState's finalizer: note its ids, dropped from the stages at the next driver call.
        (A finalizer may run in any thread, e.g. Ray's own gc thread, in the middle of a Ray call:
        it must not call Ray itself. list.append is atomic.)"""
        self._garbage.append((ids, epochs))

    def _drop_garbage(self) -> None:
        garbage = []
        while self._garbage:  # pop, not copy-and-clear: a finalizer may append meanwhile
            garbage.append(self._garbage.pop())
        for k, s in enumerate(self.stages):
            sids = [ids[k] for ids, epochs in garbage if epochs[k] == s.epoch]
            if sids and not s.lost and s.actor is not None:
                s.actor.drop_states.remote(sids)

    # ------------------------------------------------------------------ hooks on the stages
    def _configure(self, hooks):
        """Give each stage the hooks matching its sites and a recorder like the session's, when they
        changed since the last token. Returns the session's Recorder (None when it records nothing)."""
        from ..inspection.recorder import Recorder

        sets = [] if hooks is None else list(getattr(hooks, "hook_sets", [hooks]))
        recorders = [k for k, h in enumerate(sets) if isinstance(h, Recorder)]
        if len(recorders) > 1:  # (a stage holds one: the second got nothing)
            raise ValueError(f"RayPipeline: {len(recorders)} Recorders in one HookChain; a pipeline's stages record for one")
        if recorders and any(h.handles() for h in sets[recorders[0] + 1 :]):  # (it recorded their values, 2x off)
            raise ValueError("RayPipeline: a Recorder before other hooks in a HookChain records what they change; each "
                             "stage records after its hooks: put the Recorder last (HookChain(hooks, recorder), as Session "
                             "does), or add the hooks to the recorder")
        recorder = sets[recorders[0]] if recorders else None
        plain = [h for h in sets if not isinstance(h, Recorder)]
        handles = [h for hs in plain for h in hs.handles()]
        rec_handles = recorder.hooks.handles() if recorder is not None else []
        key = (handles, recorder, rec_handles)
        last = self._configured
        if last is None or not (_same(last[0], handles) and last[1] is recorder and _same(last[2], rec_handles)):
            _warn_unmatched(handles + list(rec_handles), self.stages)
            self._configured = None  # until every stage has the new set: a failure (a hook that cannot be pickled,
            calls = []  # an interrupt) leaves the stages before it configured, so the next call configures them all
            for s in self.stages:
                mine = [_spec(h) for h in handles if any(h.matches(n) for n in s.names)]
                rec = None
                if recorder is not None:
                    rec = (recorder.settings(), [_spec(h) for h in rec_handles if any(h.matches(n) for n in s.names)])
                calls.append(s.actor.configure.remote(mine, rec))
            self._get(calls, self.stages)
            self._configured = key  # holds the handles, so their ids cannot be reused while compared
        return recorder

    # ------------------------------------------------------------------ starting, losing and restarting stages
    def _start(self, stages: list[_StageRef]) -> None:
        """Start these stages' actors and wait until each has loaded its layers; if any fails, none stays."""
        import ray

        for s in stages:
            s.actor = self._actor_class.remote(*s.spec)
        try:
            if self._experts is None:  # experts="auto", for the whole model: what one process would load
                facts = self._each(stages, lambda s: s.actor.experts_on_disk.remote())
                self._experts = auto_experts(self.config, sum(n for n, _ in facts), all(q for _, q in facts), self.dtype)
            self._each(stages, lambda s: s.actor.load.remote(self._experts))
        except BaseException:  # a stage that failed, or an interrupt while they load: none may stay, loading on
            for s in stages:
                ray.kill(s.actor)
                s.actor, s.lost = None, True
            raise
        for s in stages:
            s.lost = False

    def _each(self, stages, call) -> list:
        """ray.get of call(s) for each stage, all awaited; the first that failed raises as the loader's own error type
        (CheckpointError, ValueError, ...), naming the stage."""
        import ray

        results, failed = [], None
        for s, ref in [(s, call(s)) for s in stages]:
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayError as e:
                failed = failed or (s, e)
        if failed is None:
            return results
        stage, e = failed
        cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
        message = f"{stage.describe()} of {self.source!r} could not load: {cause}"
        try:
            error = type(cause)(message)
        except Exception:
            error = RuntimeError(message)
        raise error from e

    @one_thread
    def restart_lost_stages(self) -> list[int]:
        """Restart every stage whose process is gone (probing all of them first); returns their numbers."""
        import ray

        self._refuse_if_closed()

        for s in self.stages:
            if not s.lost:
                try:
                    ray.get(s.actor.ping.remote(), timeout=60)
                except ray.exceptions.RayActorError:
                    s.lost = True
        lost = [s for s in self.stages if s.lost]
        if lost:
            self._teardown()
        for s in lost:
            if s.actor is not None:  # None: a restart that failed to load (`_start`) killed it already
                ray.kill(s.actor)
            s.epoch += 1
        if lost:
            self._configured = None  # a new actor has no hooks or recorder yet
            self._start(lost)
        return [s.number for s in lost]

    def _get(self, refs: list, stages: list[_StageRef], doing: str = ""):
        """ray.get, with a lost actor reported as the stage it was (and marked lost)."""
        import ray

        token = doing.startswith("token")
        try:
            return ray.get(refs, timeout=-1 if token else None)
        except ray.exceptions.RayTaskError:
            if token:  # a hook raised in a stage: rebuild the graph, whose channels may still hold that token's values
                self._teardown()
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.RayChannelError) as e:
            self._lost(e, stages, doing)

    def _lost(self, e: BaseException, stages: list[_StageRef], doing: str = ""):
        """Raise `StageLostError` for Ray's error `e`, naming (and marking lost) the stages that died."""
        self._teardown()
        dead = [s for s in stages if _is_dead(s.actor)]
        for s in dead:
            s.lost = True
        what = ", ".join(s.describe() for s in dead) or "a pipeline stage"
        during = f" while {'decoding ' if doing.startswith('token') else ''}{doing}" if doing else ""
        raise StageLostError(f"{what} of {self.source!r} died{during}: {e.__class__.__name__}: "
                             f"{str(e).splitlines()[0].rstrip('.') if str(e) else ''}. The session's history is intact; "
                             "session.recover() restarts the stage from its shards and replays it") from e

    def _check_alive(self) -> None:
        if self._garbage:
            self._drop_garbage()
        self._refuse_if_closed()
        lost = [s.describe() for s in self.stages if s.lost]
        if lost:
            raise StageLostError(f"{', '.join(lost)} of {self.source!r} is lost: call session.recover() (or "
                                 "pipeline.restart_lost_stages()) first")

    def _check(self, state: PipelineState) -> None:
        if not isinstance(state, PipelineState):
            raise TypeError(f"RayPipeline: expected this pipeline's state (pipeline.new_state()), got {type(state).__name__}"
                            " (a KimiDecodeState is a model's in one process)")
        if state.pipeline is not self:
            raise ValueError("this PipelineState belongs to another pipeline")
        self._check_alive()
        stale = [s.describe() for s, e in zip(self.stages, state.epochs, strict=True) if s.epoch != e]
        if stale:
            raise StageLostError(f"this state's part on {', '.join(stale)} was lost when the stage restarted; "
                                 "session.recover() rebuilds the session's states")
        refuse_broken(state)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise StageLostError(f"this pipeline of {self.source!r} was closed: its stages are stopped; start a new "
                                 "RayPipeline")

    def close(self) -> None:
        """Stop every stage actor (the Ray runtime stays up)."""
        import ray

        self._teardown()
        for s in self.stages:
            if s.actor is not None:
                ray.kill(s.actor)
                s.actor = None
            s.lost = True
        self._closed = True

    def __enter__(self) -> RayPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _teardown_graph(held: dict) -> None:
    """Tear down the compiled graph in `held` (a pipeline's), quietly."""
    graph, held["graph"] = held["graph"], None
    if graph is not None:
        log = logging.getLogger(RAY_GRAPH_LOGGER)
        level = log.level
        log.setLevel(logging.CRITICAL)  # it logs each step, and a traceback for every dead actor it cancels
        try:
            graph.teardown()
        except Exception:  # a lost stage's channel; the graph is rebuilt anyway
            pass
        finally:
            log.setLevel(level)
        LOST_STAGE_TEARDOWN.graphs.discard(graph)


def _stop(held: dict, stages: list) -> None:
    """A collected pipeline's graph torn down and its stage actors stopped (what close() does, without a pipeline)."""
    import ray

    if not ray.is_initialized():
        return
    _teardown_graph(held)
    for s in stages:
        if s.actor is not None:
            try:
                ray.kill(s.actor)
            except Exception:  # (already gone)
                pass
            s.actor = None


def blas_threads_env() -> dict:
    """The BLAS thread count of this process as environment variables for a stage's process: what the user
    set (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS), else OpenBLAS's default, one thread per core this process may
    run on (its affinity: under `taskset -c 0` one, not the machine's count)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or str(cores or 1)
    return {"OPENBLAS_NUM_THREADS": n, "OMP_NUM_THREADS": n}


def _spec(handle) -> tuple:
    """A hook as a stage rebuilds it: (pattern, names_filter, fn, chunks). `chunks` travels too: without it a
    stage would call a chunk-aware hook token by token and run its layer token by token, unlike one process."""
    return handle.pattern, handle.names_filter, handle.fn, handle.chunks


def _check_resources(options: dict, stages: int, cluster: dict) -> None:
    """Refuse stages that the Ray cluster can never schedule: each stage's actor holds its resources
    (`actor_options`) for its lifetime, and one that does not fit waits forever, so a pipeline asking for more
    than the cluster has would hang at start instead of failing."""
    wants = {"CPU": options.get("num_cpus") or 0, "GPU": options.get("num_gpus") or 0,
             "memory": options.get("memory") or 0, **(options.get("resources") or {})}
    short = [f"{name}: {stages} x {amount} = {stages * amount:g}, the cluster has {cluster.get(name, 0):g}"
             for name, amount in wants.items() if amount and stages * amount > cluster.get(name, 0)]
    if short:
        raise ValueError(f"RayPipeline: {stages} stage(s) need more than the Ray cluster has ({'; '.join(short)}): "
                         "they could never start (device='gpu' needs a GPU per stage; lower actor_options, or fewer "
                         "stages)")

def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _site_layer(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def _warn_unmatched(handles: list, stages: list[_StageRef]) -> None:
    """An unbound hook on a name no stage has never fires: warned, as one process warns after a token (the stages'
    own hooks are bound to their names, so none would)."""
    names = [n for s in stages for n in s.names]
    missing = [h.pattern for h in handles if h.names_filter is None and not is_glob(h.pattern)
               and not any(h.matches(n) for n in names)]
    if missing:
        warn_at_caller(f"hooks on {missing} never fire on this pipeline: these names are not hook points of this model "
                       "(e.g. a KDA site on an MLA layer). Call hooks.bind(pipeline) to get an error at add time.")


def _is_dead(actor) -> bool:
    import ray

    try:
        ray.get(actor.ping.remote(), timeout=60)
        return False
    except ray.exceptions.RayActorError:
        return True


def _config(path, load_kwargs: dict) -> KimiDecoderConfig:
    """The checkpoint's config, read here (a local directory, a GGUF's header, or config.json alone from the Hub)."""
    return read_config(path, **hub_options(load_kwargs))
