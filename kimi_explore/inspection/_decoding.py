"""What a Session decodes with: weights in this process, or a `RayPipeline` whose stages hold them.

The two are used the same way; these four functions are the only place that tells them apart.
A pipeline's decode state is a `PipelineState` (one handle per stage; the arrays stay in the
stages), and its hooks run in the stage that owns their site (`kimi_explore.distributed`).
"""

from __future__ import annotations

from ..model.kimi_decoder import KimiDecodeState, kimi_forward_token

__all__ = ["forward", "host_state", "is_pipeline", "model_state", "new_state"]


def is_pipeline(model) -> bool:
    return getattr(model, "is_pipeline", False)


def new_state(model):
    """An empty decode state for `model`."""
    return model.new_state() if is_pipeline(model) else KimiDecodeState.new(model)


def forward(model, state, token_id, hooks=None):
    """`kimi_forward_token`: one token through every layer, `state` advanced in place; logits [vocab]."""
    if is_pipeline(model):
        return model.forward_token(state, token_id, hooks)
    return kimi_forward_token(model, state, token_id, hooks=hooks)


def host_state(model, state) -> KimiDecodeState:
    """The state's arrays as one `KimiDecodeState` in this process (a pipeline gathers its stages')."""
    return model.fetch_state(state) if is_pipeline(model) else state


def model_state(model, state: KimiDecodeState):
    """A state for `model` from `host_state`'s form (a pipeline hands each stage its layers)."""
    return model.put_state(state) if is_pipeline(model) else state
