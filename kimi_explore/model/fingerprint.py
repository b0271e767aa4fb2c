"""Samples of every weight tensor: what a session file's fingerprint hashes, so that a history saved
with one model refuses to load into another (`inspection.session_io.weights_fingerprint`).

Layer by layer, so that a pipeline's stages, each sampling its own layers, concatenate to the same
list as one process. Experts are sampled dequantised, so packed, mapped and dense banks of the same
checkpoint agree: the first and the last expert among the layer's tensors, and, where a bank is small
(at most SMALL_BANK values dequantised: the embedded and reference models' are), every expert on its
own (`expert_samples`), so that experts swapped, zeroed or edited in a copy of the checkpoint are told
apart. A K3-sized bank (1.5 TB over the model) is not dequantised whole: there only the two ends are.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .._xp import array_namespace
from ..backend import to_numpy

GLOBAL_TENSORS = ("embed_tokens", "output_attn_res_score", "norm", "lm_head")  # in the fingerprint's order
SAMPLES = 64  # values per tensor, evenly strided
SMALL_BANK = 1 << 22  # dequantised values of an expert bank (all its experts) sampled expert by expert
BATCH = 64  # experts dequantised at once while sampling a small bank


def weight_samples(weights) -> tuple[dict, list, list]:
    """({global tensor: sample} for those loaded, [sample of each layer tensor, layer by layer], [sample of each
    expert matrix of the small banks, layer by layer]); each sample a host float array of up to SAMPLES values."""
    xp = array_namespace(weights.layers[0].input_layernorm)
    globals_ = {k: _sample(getattr(weights, k)) for k in GLOBAL_TENSORS if getattr(weights, k) is not None}
    layers = [_sample(a) for layer in weights.layers for a in _arrays_of(layer, xp)]
    return globals_, layers, [s for layer in weights.layers for s in expert_samples(layer, xp)]


def expert_samples(layer, xp) -> list[np.ndarray]:
    """Every expert's w13 and w2 sampled on its own, for a bank of at most SMALL_BANK dequantised values; else []."""
    bank = getattr(getattr(layer, "ffn", None), "experts", None)
    if bank is None:
        return []
    per_expert = sum(int(np.prod(a.shape[1:])) for a in _dequantised(bank, np.array([0]), xp))
    if bank.num_experts * per_expert > SMALL_BANK:
        return []
    out = []
    for a in range(0, bank.num_experts, BATCH):
        w13, w2 = _dequantised(bank, np.arange(a, min(a + BATCH, bank.num_experts)), xp)
        for j in range(w13.shape[0]):
            out += [_sample(w13[j]), _sample(w2[j])]
    return out


def _dequantised(bank, ids, xp):
    """Experts `ids` of a bank, dequantised, without touching a packed bank's cache or counters."""
    return bank.dequantize(ids) if hasattr(bank, "dequantize") else bank.gather(xp.asarray(ids))


def _sample(a) -> np.ndarray:
    flat = a.reshape(-1)
    return np.ascontiguousarray(to_numpy(flat[:: max(1, flat.shape[0] // SAMPLES)][:SAMPLES]))


def _arrays_of(layer, xp):
    """Every weight array of one layer, in field order (records nested in it, breadth first)."""
    stack = [layer]
    while stack:
        obj = stack.pop(0)
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if f.name == "experts":  # hash dequantised values, so packed and dense banks agree
                yield from _dequantised(v, np.array([0, v.num_experts - 1]), xp)
            elif hasattr(v, "shape") and hasattr(v, "reshape"):
                yield v
            elif dataclasses.is_dataclass(v):
                stack.append(v)
