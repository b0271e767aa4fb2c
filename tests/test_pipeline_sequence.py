"""RayPipeline.forward_sequence: a pipeline of 2 and 3 stages running the sequence path equals one process.

Bit for bit (the stages run the decoder's own `embed_chunk` / `run_layers_chunk` / `finish_sequence` on
the chunk's block stack, with the driver's BLAS thread count): the logits, the decode state it leaves
(every KDA conv window and recurrent matrix, every MLA cache), every recorded value, over several
chunks with a ragged last one, then stepping and feeding on from there. A real local Ray
(num_cpus=2, no dashboard), as in test_pipeline.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.model.kimi_sequence import kimi_forward_sequence
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

ray = pytest.importorskip("ray")

TEXT = list(b"def f(x):\n    return x * 2  # a pipeline, chunk by chunk\n")  # 55 tokens


pytestmark = pytest.mark.usefixtures("local_ray")


@pytest.fixture(scope="module")
def path():
    return random_tiny_checkpoint()  # 16 layers: KDA and MLA, a dense layer 0, MoE


@pytest.fixture(scope="module")
def weights(path):
    return ke.from_pretrained(path)


def assert_same_state(a: ke.KimiDecodeState, b: ke.KimiDecodeState) -> None:
    assert a.position == b.position
    for la, lb in zip(a.layers, b.layers, strict=True):
        x, y = la.attention, lb.attention
        assert x.kind == y.kind
        if x.kind == "kda":
            pairs = [(x.conv, y.conv), (x.recurrent, y.recurrent)]
        else:
            assert x.length == y.length
            pairs = [(x.keys[:, : x.length], y.keys[:, : y.length]), (x.values[:, : x.length], y.values[:, : y.length])]
        for u, v in pairs:
            assert np.array_equal(np.asarray(u), np.asarray(v))


def assert_same_trace(ta, tb) -> None:
    assert sorted(ta.keys()) == sorted(tb.keys())
    for k in ta.keys():
        assert ta[k].dtype == tb[k].dtype and np.array_equal(ta[k], tb[k], equal_nan=ta[k].dtype.kind == "f"), k


@pytest.mark.parametrize("stages", [2, 3])
def test_forward_sequence_equals_one_process(path, weights, stages):
    with ke.RayPipeline(path, stages=stages) as pipe:
        # the bare call: 3 chunks of 16 and one of 7
        state, want_state = pipe.new_state(), ke.KimiDecodeState.new(weights)
        got = pipe.forward_sequence(state, TEXT, chunk=16)
        want = np.asarray(kimi_forward_sequence(weights, want_state, TEXT, chunk=16))
        assert got.shape == (len(TEXT), weights.config.vocab_size)
        assert np.array_equal(got, want)
        assert_same_state(pipe.host_state(state), want_state)

        # through sessions with the default recorder: feed in chunks, step, feed again
        staged, one = ke.Session(pipe), ke.Session(weights)
        assert np.array_equal(staged.feed(TEXT[:40], chunk=16), one.feed(TEXT[:40], chunk=16))
        for t in TEXT[40:44]:
            assert np.array_equal(staged.step(t), one.step(t))
        assert np.array_equal(staged.feed(TEXT[44:], chunk=5), one.feed(TEXT[44:], chunk=5))
        assert staged.tokens == one.tokens and np.array_equal(staged.logits, one.logits)
        assert_same_trace(staged.trace(), one.trace())
        assert_same_state(pipe.host_state(staged.state), one.state)


def test_a_token_form_hook_steps_the_pipelines_chunk(path):
    """A hook added without chunks=True made only its own layer run token by token inside each stage (layer by layer
    over the chunk): now the pipeline steps such a chunk token by token, so it equals stepping, as one process does."""
    def hooks():
        h = ke.Hooks()
        h.add("layers.5.attn.out", lambda v, *, hook: v * (1.0 + 0.01 * hook.position))
        return h
    with ke.RayPipeline(path, stages=2) as pipe:
        fed, stepped = pipe.new_state(), pipe.new_state()
        got = pipe.forward_sequence(fed, TEXT[:12], hooks=hooks(), chunk=5)
        h = hooks()
        want = np.stack([pipe.forward_token(stepped, t, hooks=h) for t in TEXT[:12]])
        assert np.array_equal(got, want)
        assert_same_state(pipe.host_state(fed), pipe.host_state(stepped))
