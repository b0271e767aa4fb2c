"""The checkpoint table against the real names, and the writer's checks against it."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kimi_explore.model.config import KimiDecoderConfig
from kimi_explore.weights import checkpoint_table as table
from kimi_explore.weights.safetensors_io import SafetensorsFile
from kimi_explore.weights.tiny_model import _tensors, make_text_config, random_tiny_checkpoint, save_checkpoint, tiny_checkpoint

REFERENCE = Path(__file__).parent / "data" / "reference"
TORCH_TO_SAFETENSORS = {"bfloat16": "BF16", "float32": "F32", "uint8": "U8"}


def _planned(cfg: KimiDecoderConfig, prefix: str = "language_model.") -> dict[str, tuple]:
    return {prefix + d.name: (d.dtype, list(d.shape)) for t in table.plan(cfg) for d in table.on_disk(t)}


def _on_disk(path: Path) -> dict[str, tuple]:
    """{name: (dtype, shape)} from the checkpoint's own safetensors headers."""
    shards = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    out = {}
    for shard in shards:
        f = SafetensorsFile(path / shard)
        out.update({n: (f.info(n)[0], list(f.info(n)[1])) for n in f.keys()})
        f.close()
    return out


def test_table_plans_exactly_the_released_names_dtypes_and_shapes_of_the_reference():
    """tiny_k3_tensors.txt lists what Moonshot's tooling wrote: the plan must be it, name for name."""
    listed = {}
    for line in (REFERENCE / "tiny_k3_tensors.txt").read_text().splitlines():
        name, dtype, shape = line.split("\t")
        listed[name] = (TORCH_TO_SAFETENSORS[dtype], json.loads(shape))
    planned = _planned(KimiDecoderConfig.from_file(REFERENCE / "tiny_k3" / "config.json"))
    assert sorted(set(listed) - set(planned)) == [], "released tensors the table does not know"
    assert sorted(set(planned) - set(listed)) == [], "tensors the table plans that were not released"
    assert {n: planned[n] for n in listed if planned[n] != listed[n]} == {}
    assert _on_disk(REFERENCE / "tiny_k3") == listed  # and the list is what the reference file holds


@pytest.mark.parametrize("which", ["random_tiny", "trained_tiny"])
def test_tiny_models_have_exactly_the_planned_tensors(which):
    path = random_tiny_checkpoint() if which == "random_tiny" else tiny_checkpoint()
    cfg = KimiDecoderConfig.from_file(path / "config.json")
    assert _on_disk(path) == _planned(cfg)


def test_every_fused_field_names_rows_of_its_table():
    kinds = (table.LAYER, table.KDA, table.MLA, table.DENSE_MLP, table.MOE, table.GLOBAL)
    for kind in kinds:
        keys = [r.key for r in kind.rows]
        assert len(set(keys)) == len(keys), f"{kind.title}: duplicate keys"
        for field, parts in kind.fused.items():
            assert set(parts) <= set(keys), f"{kind.title}.{field}: {parts}"
    names = [r.name for kind in kinds for r in kind.rows]
    shared = {"self_attn.g_proj.weight", "self_attn.o_proj.weight"}  # KDA and MLA both release these
    assert {n for n in names if names.count(n) > 1} == shared


# ---- save_checkpoint checks what it is given against the table

SMALL = make_text_config(num_hidden_layers=2, linear_attn_config={
    **make_text_config()["linear_attn_config"], "kda_layers": [1], "full_attn_layers": [2]})


@pytest.fixture()
def tensors():
    return _tensors(SMALL, seed=0, experts="mxfp4")


def test_save_checkpoint_refuses_a_missing_tensor(tmp_path, tensors):
    del tensors["model.layers.0.self_attn.dt_bias"]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.dt_bias': missing \(F32 \[128\]\)"):
        save_checkpoint(tmp_path, SMALL, tensors)
    assert not (tmp_path / "config.json").exists()  # nothing half-written


def test_save_checkpoint_refuses_an_unknown_tensor(tmp_path, tensors):
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(128)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_norm\.weight': not a tensor of this config"):
        save_checkpoint(tmp_path, SMALL, tensors)


def test_save_checkpoint_refuses_a_misshapen_tensor(tmp_path, tensors):
    tensors["model.layers.1.self_attn.kv_b_proj.weight"] = np.zeros((32, 256))  # transposed
    tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"] = np.zeros((32, 64))
    with pytest.raises(ValueError, match="2 problem") as e:
        save_checkpoint(tmp_path, SMALL, tensors)
    msg = str(e.value)
    assert "'model.layers.1.self_attn.kv_b_proj.weight': expected a float array of shape [256, 32], got float64 [32, 256]" in msg
    assert "experts.3.w2.weight': expected a float array of shape [64, 32], got float64 [32, 64]" in msg


def test_save_checkpoint_casts_to_the_table_dtypes_and_packs_experts(tmp_path, tensors):
    bf16_expert = "model.layers.1.block_sparse_moe.experts.0.w1.weight"
    tensors[bf16_expert] = tensors[bf16_expert].astype(ml_dtypes.bfloat16)  # BF16 experts stay dense
    got = _on_disk(save_checkpoint(tmp_path, SMALL, tensors))
    assert got.pop("language_model." + bf16_expert) == ("BF16", [32, 64])
    want = _planned(KimiDecoderConfig.from_dict(SMALL))
    del want["language_model." + bf16_expert + "_packed"], want["language_model." + bf16_expert + "_scale"]
    assert got == want
