"""kimi_explore: look inside Moonshot AI's Kimi K3 one token at a time."""

from .config import ConfigError, KimiDecoderConfig
from .kimi_decoder import (
    KimiDecodeState,
    KimiDecoderWeights,
    hook_names,
    kimi_forward_token,
)
from .safetensors_io import CheckpointError

__all__ = [
    "CheckpointError",
    "ConfigError",
    "KimiDecodeState",
    "KimiDecoderConfig",
    "KimiDecoderWeights",
    "hook_names",
    "kimi_forward_token",
]
