"""kimi_explore: look inside Moonshot AI's Kimi K3 one token at a time.

    weights = KimiDecoderWeights.from_pretrained(path, layers=None, device="auto", dtype="float32")
    state = KimiDecodeState.new(weights)
    logits = kimi_forward_token(weights, state, token_id, hooks=None)

Everything beyond the decoder (hooks, recorder, session, plots, widgets, tokenizer, hub) is
imported lazily on first use, so `import kimi_explore` stays light.
"""

from __future__ import annotations

import importlib

from .config import ConfigError, KimiDecoderConfig
from .kimi_decoder import KimiDecoderWeights, KimiDecodeState, hook_names, kimi_forward_token
from .safetensors_io import CheckpointError

_LAZY = {
    "Hooks": "hooks",
    "HookPoint": "hooks",
    "Recorder": "recorder",
    "Trace": "recorder",
    "Session": "session",
    "interventions": None,
    "plots": None,
    "widgets": None,
    "Explorer": "widgets",
    "ByteTokenizer": "tokenizer",
    "KimiTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "tiny_checkpoint": "tiny_model",
    "memory_report": "memory",
    "hub": None,
    "plan_download": "hub",
}

__all__ = [
    "CheckpointError",
    "ConfigError",
    "KimiDecodeState",
    "KimiDecoderConfig",
    "KimiDecoderWeights",
    "hook_names",
    "kimi_forward_token",
    *_LAZY,
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kimi_explore' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    return module if _LAZY[name] is None else getattr(module, name)
