"""A pipeline's states, threads and lifetime against one process (review round 6). Each test here failed before its
fix. A real local Ray (num_cpus=2, no dashboard); the expected values are one process's on the same checkpoint."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.usefixtures("local_ray")

TOKENS = [17, 203, 5, 88, 88]


@pytest.fixture(scope="module")
def path():
    return random_tiny_checkpoint()  # 16 layers: kda kda kda mla | kda kda kda mla | ...


def test_put_state_refuses_what_one_process_refuses_and_host_state_decodes_in_one(path):
    """put_state checked the layer count only: a state of other layers (same kinds), a float64 state and a
    part-advanced one were decoded on (logits 1-3 apart). host_state gave read-only arrays (one process's kernels:
    'argument 1 must be read-write bytes-like object') without the layers they are of."""
    mine, other = ke.from_pretrained(path, layers=range(4, 8)), ke.from_pretrained(path, layers=range(0, 4))
    wide = ke.from_pretrained(path, layers=range(4, 8), dtype="float64")
    of_other, of_wide, broken = ke.KimiDecodeState.new(other), ke.KimiDecodeState.new(wide), ke.KimiDecodeState.new(mine)
    ke.kimi_forward_sequence(other, of_other, TOKENS)
    ke.kimi_forward_sequence(wide, of_wide, TOKENS)
    boom = ke.Hooks()
    boom.add("layers.6.ffn.out", lambda v, *, hook: (_ for _ in ()).throw(RuntimeError("a hook fails in layer 6")))
    with pytest.raises(RuntimeError):
        ke.kimi_forward_token(mine, broken, 3, hooks=boom)
    with ke.RayPipeline(path, stages=2, layers=range(4, 8)) as pipe:
        with pytest.raises(ValueError, match=r"put_state: state was made for layers \[0, 1, 2, 3\], this pipeline holds "
                                             r"layers \[4, 5, 6, 7\]"):
            pipe.put_state(of_other)
        with pytest.raises(ValueError, match=r"put_state: state\.layers\[0\] is not a state of this pipeline's layer 4 "
                                             r"\(kda in float32\): found conv in float64"):
            pipe.put_state(of_wide)
        with pytest.raises(ValueError, match="part-advanced"):
            pipe.put_state(broken)
        ps = pipe.new_state()
        for t in TOKENS:
            pipe.forward_token(ps, t)
        host = pipe.host_state(ps)
        assert host.layer_ids == (4, 5, 6, 7)
        assert all(a.flags.writeable for a in host.arrays())
        ref = ke.KimiDecodeState.new(mine)
        for t in TOKENS:
            ke.kimi_forward_token(mine, ref, t)
        np.testing.assert_array_equal(ke.kimi_forward_token(mine, host, 9), ke.kimi_forward_token(mine, ref, 9))
        with pytest.raises(ValueError, match=r"state was made for layers \[4, 5, 6, 7\], these weights hold layers"):
            ke.kimi_forward_token(other, pipe.host_state(ps), 9)
        back = pipe.put_state(host)  # (what host_state gives, put back: decodes on as one process)
        np.testing.assert_array_equal(pipe.forward_token(back, 4), ke.kimi_forward_token(mine, ref, 4))


def test_a_second_thread_on_a_pipeline_raises_instead_of_waiting_forever(path):
    """Two threads stepping sessions over one pipeline both waited forever on the compiled graph (one process raises
    RuntimeError in the second thread), and the interpreter crashed at exit."""
    tokens = TOKENS * 8
    with ke.RayPipeline(path, stages=2) as pipe:
        sessions, errors = [ke.Session(pipe, recorder=False) for _ in range(2)], []

        def run(s):
            try:
                for t in tokens:
                    s.step(t)
            except RuntimeError as e:
                errors.append(str(e))

        threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in sessions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert sorted(len(s) for s in sessions)[1] == len(tokens)  # one thread decoded its whole text
        assert errors and all("this RayPipeline is decoding in another thread" in e for e in errors)
        sessions[0].step(1)  # usable afterwards
        sessions[1].step(1)


def _alive(pids) -> list[bool]:
    out = []
    for p in pids:
        try:
            os.kill(p, 0)
            with open(f"/proc/{p}/stat") as f:
                out.append(f.read().split()[2] != "Z")
        except (ProcessLookupError, FileNotFoundError):
            out.append(False)
    return out


def test_a_pipeline_dropped_without_close_stops_its_stages(path):
    """After a decode Ray kept the compiled graph, and so every stage process (a GPU each), until ray.shutdown()."""
    pipe = ke.RayPipeline(path, stages=2)
    pids = [ray.get(s.actor.ping.remote()) for s in pipe.stages]
    s = ke.Session(pipe)
    s.feed(TOKENS)
    s.step(4)
    del s, pipe
    gc.collect()
    deadline = time.monotonic() + 60
    while any(_alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive(pids) == [False, False]
