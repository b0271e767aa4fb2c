"""A pipeline session against the same session in one process: errors, recovery and arguments.

Each test here failed before its fix. A real local Ray (num_cpus=2, no dashboard), as in
test_pipeline.py; the expected values are the same operations on the same checkpoint in this process.
"""

from __future__ import annotations

import gc
import os
import shutil
import time

import numpy as np
import pytest
from stage_loss import kill_stage

import kimi_explore as ke
from kimi_explore.inspection.interventions import ablate_experts
from kimi_explore.model.kimi_sequence import kimi_forward_sequence
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

ray = pytest.importorskip("ray")

TOKENS = [17, 203, 5, 88, 88, 141, 250, 3, 64, 199, 7, 7, 31, 120]


pytestmark = pytest.mark.usefixtures("local_ray")


@pytest.fixture(scope="module")
def path():
    return random_tiny_checkpoint()  # 16 layers; 2 stages: 0-7 and 8-15


@pytest.fixture(scope="module")
def weights(path):
    return ke.from_pretrained(path)


def assert_same_session(a: ke.Session, b: ke.Session) -> None:
    assert a.tokens == b.tokens
    assert np.array_equal(a.logits, b.logits), "logits differ"
    assert sorted(a._checkpoints) == sorted(b._checkpoints)
    if a.recorder is None:
        return
    ta, tb = a.trace(), b.trace()
    assert sorted(ta.keys()) == sorted(tb.keys())
    for k in ta.keys():
        assert np.array_equal(ta[k], tb[k], equal_nan=ta[k].dtype.kind == "f"), k


# bug: recover() dropped the session's checkpoints before its replay, so a replay that raised (a hook, another
# stage lost) lost them for good: the next recover() rebuilt none, and a truncate into tokens decoded under
# value-changing hooks said "cannot rebuild the state exactly" where one process goes back exactly
def test_a_recover_that_fails_leaves_the_checkpoints_to_the_next(path, weights, tmp_path):
    flag = tmp_path / "raise"

    def flaky(value, *, hook):  # raises in the stage's process while the file exists
        if os.path.exists(flag):
            raise ArithmeticError("flaky hook")

    def session(w):
        hooks = ablate_experts(12, "all")
        hooks.add("layers.10.attn.out", flaky)
        return ke.Session(w, hooks=hooks, checkpoint_every=0)  # a checkpoint after each hooked token only

    with ke.RayPipeline(path, stages=2) as pipe:
        s, one = session(pipe), session(weights)
        for x in (s, one):
            x.feed(TOKENS[:8])
        flag.touch()
        kill_stage(pipe, 1)
        with pytest.raises(ArithmeticError, match="flaky hook"):
            s.recover()
        with pytest.raises(ke.StageLostError, match="recover"):  # not "decoded with value-changing hooks"
            s.truncate(5)
        assert len(s) == 8
        flag.unlink()
        assert s.recover() == []  # the stage restarted the first time; this replay completes
        for x in (s, one):
            x.truncate(5)
            x.feed(TOKENS[5:])
        assert_same_session(s, one)
        del s
        gc.collect()


# bug: a restart that could not load left the stage's actor None, and every later recover() called
# ray.kill(None): "ray.kill() only supported for actors", so the pipeline could never be recovered
def test_recover_again_after_a_restart_that_could_not_load(path, weights, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(path, copy)
    shard = copy / "model-00004-of-00005.safetensors"  # layers 8-11: stage 1's
    with ke.RayPipeline(copy, stages=2) as pipe:
        s, one = ke.Session(pipe), ke.Session(weights)
        for x in (s, one):
            x.feed(TOKENS[:6])
        kill_stage(pipe, 1)
        shard.rename(shard.with_suffix(".hidden"))
        with pytest.raises(ke.CheckpointError, match=r"stage 1 \(layers 8-15\).*model-00004-of-00005"):
            s.recover()
        with pytest.raises(ke.StageLostError, match="stage 1"):
            s.step(TOKENS[6])
        shard.with_suffix(".hidden").rename(shard)
        assert s.recover() == [1]
        for x in (s, one):
            x.feed(TOKENS[6:])
        assert_same_session(s, one)
        del s
        gc.collect()


# bug: RayPipeline.forward_sequence refused a NumPy integer chunk that kimi_forward_sequence takes
def test_forward_sequence_takes_a_numpy_chunk_as_one_process_does(path, weights):
    with ke.RayPipeline(path, stages=2) as pipe:
        state, want_state = pipe.new_state(), ke.KimiDecodeState.new(weights)
        got = pipe.forward_sequence(state, TOKENS, chunk=np.int64(5))
        want = np.asarray(kimi_forward_sequence(weights, want_state, TOKENS, chunk=np.int64(5)))
        assert np.array_equal(got, want)
        with pytest.raises(ValueError, match=r"forward_sequence: chunk must be a positive int, got .*0"):
            pipe.forward_sequence(state, TOKENS, chunk=np.int64(0))
        del state
        gc.collect()


# bug: generate(3, stop_tokens=5) decoded a token, then raised "argument of type 'int' is not iterable";
# generate(-1) returned [] and a NaN temperature raised numpy's "Probabilities contain NaN"
@pytest.mark.parametrize("kwargs, error, match", [
    ({"n": 3, "stop_tokens": 5}, TypeError, "stop_tokens must be a collection"),
    ({"n": -1}, ValueError, "n .* must be an int >= 0, got -1"),
    ({"n": 2.5}, ValueError, "n .* must be an int >= 0, got 2.5"),
    ({"n": 3, "temperature": float("nan")}, ValueError, "temperature must be a number >= 0, got nan"),
    ({"n": 3, "temperature": "1"}, ValueError, "temperature must be a number >= 0, got '1'"),
])
def test_generate_checks_its_arguments_before_decoding(weights, kwargs, error, match):
    s = ke.Session(weights)
    s.feed(TOKENS[:4])
    logits = s.logits.copy()
    with pytest.raises(error, match=match):
        s.generate(**kwargs)
    assert s.tokens == TOKENS[:4] and np.array_equal(s.logits, logits) and len(s.trace()["logits.top_ids"]) == 4


# bug: a fork (snapshot(copy_arrays=True)) of a pipeline session copied each checkpoint whole in the stages, so
# its checkpoints no longer shared their MLA caches (T^2 / 2C cached positions over T tokens fed C at a time,
# where one process's fork holds them about once); and a pipeline session counted its bytes as if each
# checkpoint held a whole state
def test_a_forks_checkpoints_share_their_caches_in_the_stages_as_in_one_process(path, weights):
    with ke.RayPipeline(path, stages=2) as pipe:
        s, one = ke.Session(pipe, recorder=False), ke.Session(weights, recorder=False)
        for x in (s, one):
            for a in range(0, 40, 8):  # 5 fed chunks: a checkpoint at each chunk's end
                x.feed((TOKENS * 3)[a:a + 8])
        forks = s.fork(), one.fork()
        assert s._state_nbytes() == one._state_nbytes()
        assert forks[0]._state_nbytes() == forks[1]._state_nbytes()
        for x in (s, one, *forks):
            x.truncate(20)  # from the checkpoint at 16 (a copy of the shared cache), 4 tokens of a chunk replayed
            x.feed(TOKENS)
        assert_same_session(forks[0], forks[1])
        assert_same_session(s, one)
        del s, forks
        gc.collect()


# bug: a session file loaded over a pipeline held every checkpoint's MLA caches separately in the stages (one
# process shares them again as it loads: `session_io.share_caches`)
def test_a_loaded_sessions_checkpoints_share_their_caches_in_the_stages(path, weights, tmp_path):
    with ke.RayPipeline(path, stages=2) as pipe:
        s, one = ke.Session(pipe, recorder=False), ke.Session(weights, recorder=False)
        for x in (s, one):
            for a in range(0, 40, 8):
                x.feed((TOKENS * 3)[a:a + 8])
        f = s.save_state(tmp_path / "s.npz")
        loaded = ke.Session.load_state(f, pipe), ke.Session.load_state(f, weights)
        assert loaded[0]._state_nbytes() == loaded[1]._state_nbytes()
        for x in (one, *loaded):
            x.truncate(20)
            x.feed(TOKENS)
        assert_same_session(loaded[0], one)
        assert_same_session(loaded[1], one)
        del s, loaded
        gc.collect()


# bug: a snapshot taken before a stage restarted could never be restored: restore() raised StageLostError
# ("session.recover() rebuilds the session's states"), and after recover() it raised the same again
def test_a_snapshot_from_before_a_stage_restart_is_restored_exactly(path, weights):
    with ke.RayPipeline(path, stages=2) as pipe:
        s, one = ke.Session(pipe, checkpoint_every=4), ke.Session(weights, checkpoint_every=4)
        snaps = []
        for x in (s, one):
            x.feed(TOKENS[:9], chunk=4)
            for t in TOKENS[9:11]:
                x.step(t)
            snaps.append(x.snapshot())
            x.truncate(3)
            x.feed(TOKENS[5:12])
        kill_stage(pipe, 1)
        with pytest.raises(ke.StageLostError):
            s.step(5)
        assert s.recover() == [1]
        for x, snap in zip((s, one), snaps, strict=True):
            x.restore(snap)
        assert_same_session(s, one)
        for x in (s, one):
            x.truncate(6)  # inside a fed chunk
            x.feed(TOKENS)
        assert_same_session(s, one)
        del s, snaps
        gc.collect()


def test_restore_names_what_it_got(weights):
    s = ke.Session(weights)
    s.feed(TOKENS[:3])
    with pytest.raises(TypeError, match="restore: expected a SessionSnapshot .*got NoneType"):
        s.restore(None)  # was AttributeError: 'NoneType' object has no attribute 'weights_id'
    assert s.tokens == TOKENS[:3]


# bug: a KeyboardInterrupt (a notebook's interrupt) while the driver waited for a token's results left the
# compiled graph half read, and the session's next token waited on its channels forever
def test_an_interrupt_while_waiting_for_the_stages_leaves_the_pipeline_usable(path, weights, tmp_path):
    import _thread
    import threading

    flag = tmp_path / "slow"

    def slow(value, *, hook):  # the last stage holds its token while the file exists
        if os.path.exists(flag):
            time.sleep(2.0)

    with ke.RayPipeline(path, stages=3) as pipe:
        s, one = ke.Session(pipe), ke.Session(weights)
        for x in (s, one):
            x.feed(TOKENS[:6])
        flag.touch()
        timer = threading.Timer(0.5, _thread.interrupt_main)  # lands while the driver reads the last stage's result
        timer.start()
        with pytest.raises(KeyboardInterrupt), s.hooked("layers.14.ffn.out", slow):
            s.step(TOKENS[6])
            time.sleep(5)  # (not reached when the interrupt lands inside the step)
        timer.join()
        flag.unlink()
        assert len(s) == 6
        done = []
        worker = threading.Thread(target=_feed_into, args=(done, s, TOKENS[6:]), daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert done, "the session's next tokens never came back from the stages"
        one.feed(TOKENS[6:])
        assert_same_session(s, one)
        del s, worker
        gc.collect()


def _feed_into(out: list, session, tokens) -> None:
    out.append(session.feed(tokens))


def test_a_hook_set_that_failed_to_reach_every_stage_is_not_left_on_any(path, weights):
    """A hook that cannot be pickled failed on the second stage after the first had taken the new set; the
    pipeline still thought the old set was on every stage, so once the `with intervene` block ended the first
    stage kept doubling a layer's output at every later token (logits off by ~1), silently."""
    import threading

    lock = threading.Lock()
    doubled = ke.Hooks()
    doubled.add("layers.1.ffn.out", lambda v, *, hook: v * 2)  # stage 0
    doubled.add("layers.12.ffn.out", lambda v, *, hook: lock and None)  # stage 1: a lock cannot be pickled
    with ke.RayPipeline(path, stages=2) as pipe:
        s, ref = ke.Session(pipe), ke.Session(weights)
        s.feed(TOKENS[:8], progress=False)
        ref.feed(TOKENS[:8], progress=False)
        with pytest.raises(TypeError), s.intervene(doubled):
            s.step(TOKENS[8])
        assert len(s) == 8
        for t in TOKENS[8:]:
            np.testing.assert_array_equal(s.step(t), ref.step(t))


def test_stages_the_cluster_can_never_schedule_are_refused_not_waited_for(path):
    """device='gpu' on a cluster without GPUs, num_cpus=2 per stage on 2 CPUs, or a resource no node has: the
    actors waited forever."""
    with pytest.raises(ValueError, match=r"RayPipeline: 2 stage\(s\) need more than the Ray cluster has \(CPU: 2 x 2 "
                                         r"= 4, the cluster has 2\)"):
        ke.RayPipeline(path, stages=2, actor_options={"num_cpus": 2})
    with pytest.raises(ValueError, match=r"\(no_node_has_this: 2 x 1 = 2, the cluster has 0\)"):
        ke.RayPipeline(path, stages=2, actor_options={"resources": {"no_node_has_this": 1}})


def test_a_closed_pipeline_says_so_and_other_arguments_are_named(path, weights):
    """After close() a step said the stages were lost and recover() restarted them; a KimiDecodeState failed with an
    AttributeError; stages=np.int64(2) was refused as not a stage count."""
    from kimi_explore.distributed.pipeline import split_layers

    assert split_layers(list(range(4)), np.int64(2)) == [[0, 1], [2, 3]]
    pipe = ke.RayPipeline(path, stages=2)
    with pytest.raises(TypeError, match=r"expected this pipeline's state \(pipeline.new_state\(\)\), got KimiDecodeState"):
        pipe.forward_token(weights.new_state(), 5)
    s = ke.Session(pipe)
    s.step(5)
    pipe.close()
    for call in (lambda: s.step(6), s.recover):
        with pytest.raises(ke.StageLostError, match="was closed: its stages are stopped; start a new RayPipeline"):
            call()


def test_stages_get_the_blas_threads_this_process_may_run_on(monkeypatch):
    """The stages were given the machine's core count while this process, pinned to fewer cores (taskset),
    ran OpenBLAS on as many threads as it may use: another summation order in their matrix products."""
    from kimi_explore.distributed.pipeline import blas_threads_env

    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert blas_threads_env() == {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


# bug (fourth review): a pipeline decoded on a checkpoint's state, writing into the MLA caches it shares with the live
# state (the next token 1.1 off); so did a session snapshot's copied checkpoints
def test_a_pipeline_refuses_to_decode_on_a_checkpoint(path, weights, tmp_path):
    with ke.RayPipeline(path, stages=2) as pipe:
        st = pipe.new_state()
        pipe.forward_sequence(st, TOKENS[:4])
        ck = st.checkpoint()
        with pytest.raises(ValueError, match=r"state is a checkpoint"):
            pipe.forward_token(ck, 9)
        pipe.forward_token(ck.copy(), 9)  # a copy decodes
        s = ke.Session(pipe, recorder=False, checkpoint_every=2)
        s.feed(TOKENS[:6])
        for state in s.snapshot(copy_arrays=True).checkpoints.values():
            with pytest.raises(ValueError, match=r"state is a checkpoint"):
                pipe.forward_token(state, 9)
        loaded = ke.Session.load_state(s.save_state(tmp_path / "p.npz"), pipe, recorder=False)
        for state in loaded.snapshot().checkpoints.values():
            with pytest.raises(ValueError, match=r"state is a checkpoint"):
                pipe.forward_token(state, 9)
        for x in (loaded, s):  # the session's own use of its checkpoints: copies
            x.truncate(3)
            x.feed(TOKENS[3:6])
        np.testing.assert_array_equal(loaded.logits, s.logits)


# bug: experts="auto" was decided by each stage from its own MoE layers, so a stage of few layers loaded a dense bank
# where one process loads packed experts (the K3-depth writer's 93 layers x 1,024 experts: packed in one process,
# dense in each of 2 stages); stage lists were read with int(), so stages="12" ran layers 1 and 2, 2.5 ran layer 2,
# and stages that left a layer out ran another model; an interrupt while the stages loaded left them loading on
def test_auto_experts_are_decided_once_for_the_whole_pipeline(path, weights, monkeypatch):
    from kimi_explore.distributed import pipeline

    seen = []

    def decide(cfg, moe_layers, quantized, dtype):
        seen.append((moe_layers, quantized))
        return "packed"  # (the tiny model is small: each stage alone would load dense experts)

    monkeypatch.setattr(pipeline, "auto_experts", decide)
    cfg = weights.config
    with ke.RayPipeline(path, stages=2) as pipe:
        assert seen == [(sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)), True)]
        for report in pipe.memory_reports():
            assert report["routed experts, MXFP4 packed"] > 0 and report["routed experts, dequantised (dense bank)"] == 0
        s = ke.Session(pipe)
        s.feed(TOKENS)
        one = ke.Session(ke.from_pretrained(path, experts="packed"))
        one.feed(TOKENS)
        assert_same_session(s, one)


@pytest.mark.parametrize("stages, error, match", [
    ("12", TypeError, r"stages must be a stage count or a list of layer ranges, got '12'"),
    (["01", "2"], TypeError, r"stages\[0\] must be a range or list of layer indices, got '01'"),
    ([[0, 1, 2.5], [3.9, 4]], TypeError, r"stages\[0\] holds 2.5 \(float\)"),
    ([range(0, 8), [" "]], TypeError, r"stages\[1\] holds ' ' \(str\)"),
    ([range(0, 8), [True]], TypeError, r"stages\[1\] holds True \(bool\)"),
    ([range(0, 7), range(8, 16)], ValueError, r"the stages' layers \[0, .*, 6, 8, .*\] are not the layers to load, "
                                              r"\[0, .*\] \(all of the model's: give layers= to load a subset\)"),
])
def test_stage_lists_are_read_as_layer_indices_and_cover_the_model(path, stages, error, match):
    with pytest.raises(error, match=match):
        ke.RayPipeline(path, stages=stages)


def test_an_interrupt_while_the_stages_load_stops_them(path, monkeypatch):
    killed, real_kill, real_get = [], ray.kill, ray.get

    def interrupted_get(ref, *args, **kwargs):
        real_get(ref, *args, **kwargs)
        raise KeyboardInterrupt  # as Ctrl-C in a notebook while the stages load

    monkeypatch.setattr(ray, "kill", lambda actor, **kw: (killed.append(actor), real_kill(actor, **kw)))
    monkeypatch.setattr(ray, "get", interrupted_get)
    with pytest.raises(KeyboardInterrupt):
        ke.RayPipeline(path, stages=2)
    assert len(killed) == 2


def test_a_cache_size_alone_loads_packed_experts_as_one_process(path):
    """expert_cache_size without experts=: one process reads it as packed experts; the pipeline decided 'auto' itself,
    chose dense, and every stage refused the cache size."""
    one = ke.from_pretrained(path, expert_cache_size=4)
    ids = list(b"hello there")
    with ke.RayPipeline(path, stages=2, expert_cache_size=4) as pipe:
        got = pipe.forward_sequence(pipe.new_state(), ids, chunk=4)
    assert np.array_equal(got, one.forward_sequence(one.new_state(), ids, chunk=4))


def test_a_stage_that_died_while_idle_is_a_lost_stage_on_the_next_decode(path, weights):
    """The next forward_token / forward_sequence raised Ray's RayChannelError (from the compiled graph's execute, outside
    the conversion of lost actors), the stage not marked lost."""
    with ke.RayPipeline(path, stages=2) as pipe:
        state = pipe.new_state()
        pipe.forward_token(state, 1)
        kill_stage(pipe, 1)
        with pytest.raises(ke.StageLostError, match=r"stage 1 .* died while decoding token 2 at position 1"):
            pipe.forward_token(state, 2)
        assert [s.lost for s in pipe.stages] == [False, True]
        assert pipe.restart_lost_stages() == [1]
        s = ke.Session(pipe, recorder=False)
        s.feed(list(b"kill me"), chunk=3)
        kill_stage(pipe, 0)
        with pytest.raises(ke.StageLostError):
            pipe.forward_sequence(pipe.new_state(), list(b"abc"))


def test_recorders_a_pipeline_cannot_place_as_one_process_does_are_refused(path, weights):
    """A Recorder before value-changing hooks recorded their values (2x off: each stage records after its hooks); a
    second Recorder got nothing; an unbound hook on a site the model lacks never fired, without the warning one process
    gives."""
    from kimi_explore.inspection.hooks import HookChain

    double = ke.Hooks()
    double.add("layers.5.attn.out", lambda v, *, hook: v * 2)
    with ke.RayPipeline(path, stages=2) as pipe:
        with pytest.raises(ValueError, match=r"a Recorder before other hooks .* put the Recorder last"):
            pipe.forward_token(pipe.new_state(), 1, hooks=HookChain(ke.Recorder(), double))
        with pytest.raises(ValueError, match=r"2 Recorders in one HookChain"):
            pipe.forward_token(pipe.new_state(), 1, hooks=HookChain(ke.Recorder(), ke.Recorder()))
        rec = ke.Recorder()
        state, one = pipe.new_state(), weights.new_state()
        got = pipe.forward_token(state, 1, hooks=HookChain(double, rec))  # the Recorder last: one process's records
        ref_rec = ke.Recorder()
        assert np.array_equal(got, weights.forward_token(one, 1, hooks=HookChain(double, ref_rec)))
        assert rec.trace().equals(ref_rec.trace())
        stray = ke.Hooks()
        stray.add("layers.3.kda.q", lambda v, *, hook: v)  # layer 3 is MLA
        with pytest.warns(UserWarning, match=r"never fire on this pipeline"):
            pipe.forward_token(state, 2, hooks=stray)
