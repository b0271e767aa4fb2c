"""kimi_explore: look inside Moonshot AI's Kimi K3 one token at a time.

    weights = from_pretrained(path, layers=None, device="auto", dtype="float32")
    state = KimiDecodeState.new(weights)
    logits = kimi_forward_token(weights, state, token_id, hooks=None)
    logits = kimi_forward_sequence(weights, state, token_ids, hooks=None)   # [T, vocab], state advanced by T

Everything beyond the decoder (hooks, recorder, session, plots, widgets, tokenizer, hub) is
imported lazily on first use, so `import kimi_explore` stays light.
"""

from __future__ import annotations

import importlib
import sys

from .errors import BackendError, CheckpointError, ConfigError, StageLostError
from .model import block_residual, kimi_decoder
from .model.config import KimiDecoderConfig
from .model.kimi_decoder import KimiDecoderWeights, KimiDecodeState, hook_names, kimi_forward_token
from .model.kimi_sequence import kimi_forward_sequence

# The seed module names stay importable: `kimi_explore.kimi_decoder` is `kimi_explore.model.kimi_decoder`.
sys.modules[__name__ + ".kimi_decoder"] = kimi_decoder
sys.modules[__name__ + ".block_residual"] = block_residual

_LAZY = {  # name -> (module, attribute or None for the module itself)
    "Hooks": ("inspection.hooks", "Hooks"),
    "HookPoint": ("inspection.hooks", "HookPoint"),
    "Recorder": ("inspection.recorder", "Recorder"),
    "Trace": ("inspection.recorder", "Trace"),
    "Session": ("inspection.session", "Session"),
    "interventions": ("inspection.interventions", None),
    "plots": ("views.figures.plots", None),
    "widgets": ("views.explorer.widgets", None),
    "Explorer": ("views.explorer.widgets", "Explorer"),
    "ByteTokenizer": ("tokenizer", "ByteTokenizer"),
    "KimiTokenizer": ("tokenizer", "KimiTokenizer"),
    "load_tokenizer": ("tokenizer", "load_tokenizer"),
    "tiny_checkpoint": ("weights.tiny_model", "tiny_checkpoint"),
    "memory_report": ("weights.memory", "memory_report"),
    "hub": ("weights.hub", None),
    "plan_download": ("weights.hub", "plan_download"),
    "logit_lens": ("analysis.logit_lens", "logit_lens"),
    "LogitLens": ("analysis.logit_lens", "LogitLens"),
    "lens_at": ("analysis.logit_lens", "lens_at"),
    "logit_attribution": ("analysis.attribution", "logit_attribution"),
    "Attribution": ("analysis.attribution", "Attribution"),
    "diff": ("analysis.diff", "diff"),
    "RunDiff": ("analysis.diff", "RunDiff"),
    "routing_stats": ("analysis.routing_stats", "routing_stats"),
    "RoutingStats": ("analysis.routing_stats", "RoutingStats"),
    "source_ablation": ("analysis.source_ablation", "source_ablation"),
    "SourceAblation": ("analysis.source_ablation", "SourceAblation"),
    "RayPipeline": ("distributed.pipeline", "RayPipeline"),
    "from_pretrained": ("weights.load", "load_weights"),
    "compare": ("engines.compare", "compare"),
    "Comparison": ("engines.comparison", "Comparison"),
    "write_dump": ("engines.dump", "write_dump"),
    "read_dump": ("engines.dump", "read_dump"),
}

__all__ = [
    "BackendError",
    "CheckpointError",
    "ConfigError",
    "KimiDecodeState",
    "KimiDecoderConfig",
    "KimiDecoderWeights",
    "StageLostError",
    "hook_names",
    "kimi_forward_sequence",
    "kimi_forward_token",
    *_LAZY,
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kimi_explore' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(f".{module_name}", __name__)
    return module if attr is None else getattr(module, attr)


def __dir__() -> list[str]:
    """The lazy names too: tab completion (`ke.from_<TAB>`) lists what dir() lists."""
    return sorted(set(globals()) | set(_LAZY))
