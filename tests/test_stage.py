"""A pipeline stage in this process (no Ray): two `Stage`s chained by hand decode as one process does,
and a stage refuses a stack that belongs to another token position (a stale channel)."""

from __future__ import annotations

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.distributed.stage import Stage
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

TOKENS = [17, 203, 5]


def two_stages(weights):
    """Stages 0 (layers 0-7, with the embedding) and 1 (layers 8-15, with the head) of the embedded model,
    each holding one decode state under id 1."""
    path, names = str(random_tiny_checkpoint()), ke.hook_names(weights)
    stages = [Stage(0, path, list(range(0, 8)), False, weights.max_sources, names, {"device": "cpu"}),
              Stage(1, path, list(range(8, 16)), True, weights.max_sources, names, {"device": "cpu"})]
    for s in stages:
        s.load()
        s.new_state(1)
    return stages


# mutation: a stage accepted a stack from an earlier position (a stale channel) and decoded it as this token
def test_mutation_a_stage_refuses_a_stack_from_an_earlier_position(tiny_weights):
    first, last = two_stages(tiny_weights)
    state = ke.KimiDecodeState.new(tiny_weights)
    want = [np.array(ke.kimi_forward_token(tiny_weights, state, t)) for t in TOKENS[:2]]

    stack0 = first.run(((1, 1), TOKENS[0], 0))
    np.testing.assert_array_equal(last.run(((1, 1), TOKENS[0], 0), stack0)[0], want[0])
    stack1 = first.run(((1, 1), TOKENS[1], 1))
    assert stack1[2] == 1 and stack0[2] == 0
    with pytest.raises(RuntimeError, match=r"stage 1.*stack of position 0 for position 1"):
        last.run(((1, 1), TOKENS[1], 1), stack0)  # position 0's stack again, for token 1
    assert last.get_state(1).position == 1  # refused before anything ran
    logits, records, position = last.run(((1, 1), TOKENS[1], 1), stack1)
    assert position == 1 and records is None
    np.testing.assert_array_equal(logits, want[1])  # the refused stack left the state as it was
