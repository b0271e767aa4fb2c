"""The trainer's K3 (training/model.py): its fast paths against their naive twins, its config. Skips without torch."""

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kimi_explore.weights.tiny_model import tiny_checkpoint  # noqa: E402
from training.model import KimiK3, chunk_kda, mxfp4_round, naive_recurrent_kda, text_config  # noqa: E402


def _operands(B, H, T, K, V, seed, strong_decay=False):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64, generator=g)
    q = torch.nn.functional.normalize(torch.randn(B, H, T, K, **f64), dim=-1) * K**-0.5
    k = torch.nn.functional.normalize(torch.randn(B, H, T, K, **f64), dim=-1)
    v = torch.randn(B, H, T, V, **f64)
    lo = 5.0 if strong_decay else 1.0
    g_log = -lo * torch.rand(B, H, T, K, **f64)
    beta = torch.rand(B, H, T, **f64)
    return q, k, v, g_log, beta


@pytest.mark.parametrize("T,chunk,strong", [(37, 8, False), (64, 16, False), (50, 16, True), (5, 16, False)],
                         ids=["ragged-c8", "exact-c16", "decay-at-lower-bound", "shorter-than-chunk"])
def test_chunk_kda_matches_naive_recurrence(T, chunk, strong):
    q, k, v, g, beta = _operands(2, 3, T, 8, 6, seed=T, strong_decay=strong)
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta)
    o, S = chunk_kda(q, k, v, g, beta, chunk=chunk)
    assert torch.isfinite(o).all()
    assert (o - o_ref).abs().max() < 1e-10
    assert (S - S_ref).abs().max() < 1e-10


def test_chunk_kda_gradients_match_naive():
    ops = [a.clone().requires_grad_() for a in _operands(1, 2, 20, 4, 4, seed=1)]
    naive_recurrent_kda(*ops)[0].square().sum().backward()
    ref = [a.grad.clone() for a in ops]
    for a in ops:
        a.grad = None
    chunk_kda(*ops, chunk=8)[0].square().sum().backward()
    for a, r in zip(ops, ref, strict=True):
        assert (a.grad - r).abs().max() < 1e-9


def small_config() -> dict:
    return text_config(hidden_size=64, num_hidden_layers=4, intermediate_size=96, linear_attn_config={"num_heads": 2},
                       num_experts=16, moe_intermediate_size=32, routed_expert_hidden_size=32, attn_res_block_size=2)


def test_the_default_config_is_the_shipped_models():
    """`python -m training.train_tiny` with its defaults rebuilds the shipped model's config (no quantisation
    block: the writer adds it)."""
    shipped = json.loads((tiny_checkpoint() / "config.json").read_text())["text_config"]
    shipped.pop("quantization_config")
    assert text_config() == shipped


def test_layer_kinds_follow_the_config():
    """KDA, MLA, dense and MoE layers as the config's lists say (K3's pattern: the last layer MLA)."""
    model = KimiK3(small_config())
    assert [type(layer.self_attn).__name__ for layer in model.model.layers] == ["KDA", "KDA", "KDA", "MLA"]
    assert [hasattr(layer, "block_sparse_moe") for layer in model.model.layers] == [False, True, True, True]
    assert model.model.layers[0].self_attn.H == 2


def test_model_chunked_equals_naive_prefill():
    torch.manual_seed(0)
    model = KimiK3(small_config()).double().eval()
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        a, b = model(ids), model(ids, naive=True)
    assert (a - b).abs().max() < 1e-9


def test_fake_mxfp4_is_the_package_rounding():
    from kimi_explore.weights import mxfp4

    w = np.random.default_rng(0).standard_normal((24, 64)).astype(np.float32) * 0.3
    packed, scale = mxfp4.quantize(w)
    ref = mxfp4.dequantize(packed, scale)
    np.testing.assert_array_equal(mxfp4_round(torch.from_numpy(w)).numpy(), ref)


def test_runtime_package_never_imports_torch_or_training():
    code = "import sys, kimi_explore as ke; ke.from_pretrained; ke.tiny_checkpoint; " \
           "assert 'torch' not in sys.modules and 'training' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    subprocess.run([sys.executable, "-c", code], check=True)
