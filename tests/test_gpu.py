"""The decoder on device="gpu" (CuPy): Moonshot's reference outputs, and the same resident-form equalities as on the CPU.

Skipped unless CuPy imports AND reports a usable CUDA device (`backend.gpu_available()`).
Run on a GPU machine with `bench/gpu_check.sh` (or `pytest -m gpu tests/test_gpu.py`). Without a GPU,
tests/test_gpu_standin.py runs these bodies on a strict stand-in device (host memory, CuPy's strictness,
transfers counted): the device code path and its host/device discipline, not a GPU run.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REFERENCE_DIR

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.backend import gpu_available, to_numpy
from kimi_explore.model.latent_moe import LatentMoeWeights
from kimi_explore.weights.bf16_weights import Bf16Matrix
from kimi_explore.weights.experts import PackedExperts
from kimi_explore.weights.memory import memory_report
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no usable CUDA GPU (CuPy absent or no device)")]


class Collect:
    """Keeps a host copy of every value (what a recorder would move off the device)."""

    def __init__(self):
        self.values: dict[str, list] = {}

    def fire(self, name, value):
        self.values.setdefault(name, []).append(to_numpy(value).copy())
        return value

    def stacked(self, name):
        return np.stack(self.values[name])


def decode(w, tokens, hooks=None):
    state = KimiDecodeState.new(w)
    return np.stack([to_numpy(kimi_forward_token(w, state, int(t), hooks=hooks)) for t in tokens])


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32 if a.dtype == np.float32 else np.uint64)


@pytest.fixture(scope="module", params=["float32", "float64"])
def gpu_run(request, ref):
    w = from_pretrained(REFERENCE_DIR, device="gpu", dtype=request.param)
    assert w.device == "gpu" and w.xp is not np
    hooks = Collect()
    return w, hooks, decode(w, ref["tokens"], hooks)


def test_reference_logits_on_gpu(gpu_run, ref):
    _, _, logits = gpu_run
    np.testing.assert_allclose(logits, ref["logits_decode"], atol=1e-3, rtol=0)
    assert (logits.argmax(-1) == ref["logits_decode"].argmax(-1)).all()


def test_reference_internals_on_gpu(gpu_run, ref):
    _, hooks, _ = gpu_run
    np.testing.assert_allclose(hooks.stacked("final.hidden"), ref["hidden_final_decode"], atol=1e-3, rtol=0)
    for i in ref["moe_layers"]:
        np.testing.assert_array_equal(hooks.stacked(f"layers.{i}.moe.router.topk_ids"), ref[f"router_L{i:02d}_topk_idx_decode"])
    np.testing.assert_allclose(hooks.stacked("final.attn_res.weights"), ref["attnres_output_decode"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("n", [4, 8])
def test_layer_subset_on_gpu(ref, n):
    w = from_pretrained(REFERENCE_DIR, device="gpu", layers=range(n))
    np.testing.assert_allclose(decode(w, ref["tokens"]), ref[f"logits_decode_trunc{n}"], atol=1e-3, rtol=0)


def test_gpu_matches_cpu():
    cpu = decode(from_pretrained(random_tiny_checkpoint(), device="cpu"), range(0, 256, 23))
    gpu = decode(from_pretrained(random_tiny_checkpoint(), device="gpu"), range(0, 256, 23))
    np.testing.assert_allclose(gpu, cpu, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("path", [random_tiny_checkpoint(), REFERENCE_DIR], ids=["random_tiny", "reference"])
def test_packed_and_bf16_bit_identical_on_gpu(path):
    """On one device the resident forms give the same logits bit for bit (same kernels on the same operands)."""
    tokens = [t % 256 for t in (0, 255, 17, 17, 42, 128, 7)]
    dense = from_pretrained(path, device="gpu", experts="dense")
    base = decode(dense, tokens)
    for kw in (dict(experts="packed", expert_cache_size=0), dict(experts="packed", expert_cache_size=2),
               dict(weight_dtype="bfloat16"), dict(weight_dtype="bfloat16", experts="packed")):
        w = from_pretrained(path, device="gpu", **kw)
        if "experts" in kw:
            banks = [layer.ffn.experts for layer in w.layers if isinstance(layer.ffn, LatentMoeWeights)]
            assert banks and all(isinstance(b, PackedExperts) for b in banks)
        if "weight_dtype" in kw:
            assert isinstance(w.lm_head, Bf16Matrix)
        np.testing.assert_array_equal(bits(decode(w, tokens)), bits(base), err_msg=str(kw))
        report = memory_report(w)
        assert report.device == "gpu" and report.total > 0
