"""Loading, third review: each of these used to load and run another model (or fail late, or allocate for
nothing) without a word: a BF16 tensor relabelled F16, a real decoder layer taken for a declared MTP layer,
topk_group other than 1, a key given twice in config.json or the index, an expert cache larger than the
layer's experts, bf16_matvec="kernel" where the kernel cannot run, and Ray's teardown noise after a lost
pipeline stage."""

from __future__ import annotations

import json
import logging
import struct

import numpy as np
import pytest

from kimi_explore import CheckpointError, ConfigError, KimiDecodeState, from_pretrained, kimi_forward_sequence
from kimi_explore.model.config import KimiDecoderConfig
from kimi_explore.weights import load as load_module
from kimi_explore.weights.memory import memory_report
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

P = "language_model."


def load(path, **kw):
    return from_pretrained(path, device="cpu", progress=False, **kw)


def decode(w, tokens=(3, 1, 4, 1, 5)):
    return kimi_forward_sequence(w, KimiDecodeState.new(w), list(tokens))


def shard_of(path, name):
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def set_header_dtype(path, name, code):
    """Rewrite the dtype field of tensor `name` in its shard's header (offsets, shape and bytes kept)."""
    shard = shard_of(path, name)
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header[name]["dtype"] = code
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg["text_config"])
    (path / "config.json").write_text(json.dumps(cfg))


# ---- 1. F16 is not an exact copy of BF16

def test_a_bf16_tensor_whose_header_says_f16_is_refused_naming_it(ckpt):
    """The bytes of a BF16 tensor read as F16 ran another model (logits off by 2.3 on the trained tiny model):
    F16 holds neither BF16's range nor its values exactly, and K3 checkpoints never store it."""
    name = f"{P}model.layers.0.self_attn.q_proj.weight"
    set_header_dtype(ckpt, name, "F16")
    with pytest.raises(CheckpointError) as e:
        load(ckpt, layers=[0])
    msg = str(e.value)
    assert str(shard_of(ckpt, name)) in msg and f"tensor '{name}'" in msg
    assert "expected BF16 (or an exact F32/F64 copy), found F16[" in msg


def test_an_exact_f32_copy_of_a_bf16_tensor_still_loads(ckpt):
    """What the loader accepts besides BF16: a wider copy holding the same values (an F32 export)."""
    from kimi_explore.weights.safetensors_io import SafetensorsFile, write_safetensors

    before = decode(load(ckpt, layers=[0]))
    name = f"{P}model.layers.0.self_attn.q_proj.weight"
    shard = shard_of(ckpt, name)
    f = SafetensorsFile(shard)
    tensors = {k: np.array(f.array(k)) for k in f.keys()}
    f.close()
    tensors[name] = tensors[name].astype(np.float32)
    write_safetensors(shard, tensors)
    np.testing.assert_array_equal(decode(load(ckpt, layers=[0])), before)


# ---- 2. a declared MTP layer must look like one

def test_a_decoder_layer_declared_as_an_mtp_layer_is_refused(ckpt):
    """num_hidden_layers one short plus num_nextn_predict_layers=1 took the checkpoint's last decoder layer for
    an MTP draft head and ran one layer fewer (logits 2.46 off); it has no enorm / hnorm / eh_proj."""
    cfg = json.loads((ckpt / "config.json").read_text())["text_config"]
    n = cfg["num_hidden_layers"]

    def one_short(tc):
        tc.update(num_hidden_layers=n - 1, num_nextn_predict_layers=1)
        la = tc["linear_attn_config"]
        la["kda_layers"] = [i for i in la["kda_layers"] if i != n]
        la["full_attn_layers"] = [i for i in la["full_attn_layers"] if i != n]

    edit_config(ckpt, one_short)
    with pytest.raises(CheckpointError) as e:
        load(ckpt, layers=[0])
    msg = str(e.value)
    assert f"layer {n - 1} is one of the num_nextn_predict_layers=1 MTP layers" in msg
    assert f"it has no {P}model.layers.{n - 1}.enorm.weight, {P}model.layers.{n - 1}.hnorm.weight, " \
           f"{P}model.layers.{n - 1}.eh_proj.weight" in msg
    assert "input_layernorm.weight" in msg and "num_hidden_layers too small" in msg


# ---- 4. config: topk_group, duplicate keys

@pytest.mark.parametrize("value", [0, 2])
def test_topk_group_other_than_one_is_refused(value):
    """With the one expert group K3 has, topk_group 0 (no group) or 2 (more than there are) loaded and ran as 1."""
    raw = json.loads((random_tiny_checkpoint() / "config.json").read_text())
    raw["text_config"]["topk_group"] = value
    with pytest.raises(ConfigError, match=rf"unsupported configuration: topk_group={value} \(with num_expert_group=1"):
        KimiDecoderConfig.from_dict(raw)


def test_a_key_given_twice_in_config_json_is_refused_naming_it(tmp_path):
    """json.loads kept the last of the two values silently (routed_scaling_factor 1.5 then 3.0 ran with 3.0)."""
    text = (random_tiny_checkpoint() / "config.json").read_text()
    key = '"routed_scaling_factor": '
    at = text.index(key)
    text = text[:at] + key + "3.0, " + text[at:]
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        KimiDecoderConfig.from_file(tmp_path / "config.json")
    msg = str(e.value)
    assert str(tmp_path / "config.json") in msg and "key 'routed_scaling_factor' is given twice" in msg
    assert "values 3.0 and" in msg


def test_a_tensor_named_twice_in_the_index_is_refused(ckpt):
    """A weight_map naming one tensor twice (two shards) took the last silently."""
    index = ckpt / "model.safetensors.index.json"
    text = index.read_text()
    name = f"{P}model.layers.0.input_layernorm.weight"
    at = text.index(f'"{name}"')
    text = text[:at] + f'"{name}": "model-00005-of-00005.safetensors", ' + text[at:]
    index.write_text(text)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors\.index\.json: '{name}' is given twice"):
        load(ckpt, layers=[0])


# ---- 5. the expert cache holds at most the layer's experts

def test_an_expert_cache_larger_than_the_layer_is_capped_at_its_experts():
    """expert_cache_size=10**6 loaded, then the first token asked for a 30.5 GiB slab; a size above the
    expert count allocated slots no expert could fill, and memory_report counted them."""
    path = random_tiny_checkpoint()
    w = load(path, experts="packed", expert_cache_size=10**6)
    E = w.config.num_experts
    banks = [layer.ffn.experts for layer in w.layers if layer.ffn.kind == "moe"]
    assert w.extra["expert_cache_size"] == E and all(b.capacity == E for b in banks)
    w = load(path, experts="packed", expert_cache_size=E + 4)
    banks = [layer.ffn.experts for layer in w.layers if layer.ffn.kind == "moe"]
    assert all(b.capacity == E for b in banks)
    decode(w, (3,))  # every MoE layer misses once: its slab is allocated
    assert memory_report(w)["routed experts, dequantised (LRU caches)"] == len(banks) * E * banks[0].expert_bytes
    banks[0].set_capacity(E + 10)
    assert banks[0].capacity == E


# ---- 6. bf16_matvec="kernel" refused with the other option checks

def test_bf16_kernel_where_it_cannot_run_is_refused_before_the_checkpoint_is_opened(monkeypatch):
    """It was refused inside the build, after the embedding had been read (and, from the Hub, shards fetched)."""
    def opened(*a, **k):
        raise AssertionError("the checkpoint was opened before the options were checked")

    monkeypatch.setattr(load_module, "open_source", opened)
    with pytest.raises(ValueError, match=r"bf16_matvec='kernel' requires the compiled bf16 kernel.*dtype='float64'"):
        load(random_tiny_checkpoint(), dtype="float64", weight_dtype="bfloat16", bf16_matvec="kernel")


# ---- 7. Ray's teardown noise after a lost stage

def test_ray_teardown_of_a_lost_stage_is_not_logged_while_a_pipeline_graph_lives():
    """Ray's compiled-graph monitor thread tears the graph down the moment a stage dies and logged its steps and
    two ActorDiedError tracebacks per dead stage, which StageLostError then reported once more; other records of
    that logger, and everything when no pipeline graph lives, still pass."""
    ray_exceptions = pytest.importorskip("ray.exceptions")
    from kimi_explore.distributed import pipeline

    log = logging.getLogger(pipeline.RAY_GRAPH_LOGGER)
    f = pipeline.LOST_STAGE_TEARDOWN

    def record(level, exc=None):
        info = (type(exc), exc, None) if exc is not None else None
        return log.makeRecord(log.name, level, __file__, 1, "Error cancelling worker task", (), info)

    class Graph:  # stands for a compiled graph (weak-referenced)
        pass

    died, info, other = record(logging.ERROR, ray_exceptions.ActorDiedError()), record(logging.INFO), \
        record(logging.ERROR, ValueError("not a lost actor"))
    assert all(f.filter(r) for r in (died, info, other))  # no pipeline graph alive: everything passes
    g = Graph()
    f.graphs.add(g)
    try:
        assert not f.filter(died) and not f.filter(info) and f.filter(other)
    finally:
        f.graphs.discard(g)
    assert f.filter(died)
