"""Samples of every weight tensor: what a session file's fingerprint hashes, so that a history saved
with one model refuses to load into another (`inspection.session_io.weights_fingerprint`).

Layer by layer, so that a pipeline's stages, each sampling its own layers, concatenate to the same
list as one process. Experts are sampled dequantised (the first and the last expert), so packed,
mapped and dense banks of the same checkpoint agree.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .._xp import array_namespace
from ..backend import to_numpy

GLOBAL_TENSORS = ("embed_tokens", "output_attn_res_score", "norm", "lm_head")  # in the fingerprint's order
SAMPLES = 64  # values per tensor, evenly strided


def weight_samples(weights) -> tuple[dict, list]:
    """({global tensor: sample bytes} for those loaded, [sample bytes of each layer tensor, layer by layer])."""
    xp = array_namespace(weights.layers[0].input_layernorm)
    globals_ = {k: _sample(getattr(weights, k)) for k in GLOBAL_TENSORS if getattr(weights, k) is not None}
    return globals_, [_sample(a) for layer in weights.layers for a in _arrays_of(layer, xp)]


def _sample(a) -> bytes:
    flat = a.reshape(-1)
    return np.ascontiguousarray(to_numpy(flat[:: max(1, flat.shape[0] // SAMPLES)][:SAMPLES])).tobytes()


def _arrays_of(layer, xp):
    """Every weight array of one layer, in field order (records nested in it, breadth first)."""
    stack = [layer]
    while stack:
        obj = stack.pop(0)
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if f.name == "experts":  # hash dequantised values, so packed and dense banks agree (a packed bank's
                ends = np.array([0, v.num_experts - 1])  # dequantize leaves its cache and counters as they are)
                yield from (v.dequantize(ends) if hasattr(v, "dequantize") else v.gather(xp.asarray(ends)))
            elif hasattr(v, "shape") and hasattr(v, "reshape"):
                yield v
            elif dataclasses.is_dataclass(v):
                stack.append(v)
