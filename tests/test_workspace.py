"""Each loaded model owns its scratch (`weights.workspace`): no buffer or pool is shared between models."""

from __future__ import annotations

import numpy as np

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.backend import on_host
from kimi_explore.weights.memory import memory_report
from kimi_explore.weights.tiny_model import random_tiny_checkpoint
from kimi_explore.weights.workspace import Workspace, run_parts


def _packed(**kw):
    return from_pretrained(random_tiny_checkpoint(), device="cpu", experts="packed", expert_cache_size=0,
                                              **kw)


def test_each_model_owns_its_workspace_and_the_report_counts_it():
    a, b = _packed(), _packed(weight_dtype="bfloat16", bf16_matvec="widen")  # widening: the scratch is reserved
    assert isinstance(a.workspace, Workspace) and a.workspace is not b.workspace
    banks = [layer.ffn.experts for layer in a.layers if layer.ffn.kind == "moe"]
    assert banks and all(bank._workspace is a.workspace for bank in banks)  # shared by the layers of ONE model
    assert a.workspace.widening is None and b.workspace.widening is not None
    for bank in banks:
        bank.fused, bank.IN_PLACE_BYTES = False, 0  # dequantise the selected experts into the workspace (K3's route)
    kimi_forward_token(a, KimiDecodeState.new(a), 7)
    cfg = a.config
    k, I, l = cfg.num_experts_per_token, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    assert a.workspace.dequantised_bytes == 3 * k * I * l * 4  # the biggest call's misses: [k, 2I, l] + [k, l, I]
    assert b.workspace.dequantised_bytes == 0  # the other model's buffers are untouched
    assert memory_report(a)["dequantise workspace"] == a.workspace.dequantised_bytes
    assert memory_report(b)["bf16 widening scratch"] == b.workspace.widening.nbytes > 0
    assert "Workspace(" in repr(a.workspace)


def test_workspace_buffers_grow_and_are_reused():
    ws = Workspace(np)
    small = ws.take("w13", (2, 3), np.float32)
    big = ws.take("w13", (4, 5), np.float32)
    again = ws.take("w13", (2, 3), np.float32)
    assert small.shape == (2, 3) and big.shape == (4, 5) and np.shares_memory(big, again)
    assert ws.dequantised_bytes == 4 * 5 * 4


def test_run_parts_runs_every_part_once_on_the_pool_or_its_own():
    ws = Workspace(np, threads=3)
    for pool in (None, ws.pool()):
        out = np.zeros(10, int)

        def add(a, b, out=out):
            out[a:b] += 1

        run_parts(pool, add, [(0, 3), (3, 7), (7, 10)])
        assert out.tolist() == [1] * 10


def test_on_host_is_the_one_device_test():
    assert on_host(np) and on_host(np.zeros(2)) and on_host(np.float32(1.0))


def _use_pool(ws, out) -> None:  # in a forked child: hand work to the pool the parent started
    out.put(ws.pool().submit(lambda: 41 + 1).result(timeout=20))


def test_a_forked_process_gets_a_pool_of_its_own():
    """A fork copies the pool object but not its threads: work handed to the copy would wait forever
    (routing_stats' workers fork from a process whose model may have run its pool)."""
    import multiprocessing

    ws = Workspace(np, threads=2)
    parent = ws.pool()
    assert parent.submit(lambda: 1).result() == 1  # its threads are running
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_use_pool, args=(ws, out))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and out.get(timeout=5) == 42
    assert ws.pool() is parent  # this process keeps its own
