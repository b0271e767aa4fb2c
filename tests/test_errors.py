"""Bad input gets a specific error that names the file, tensor, key or argument."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kimi_explore import CheckpointError, ConfigError, KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.backend import gpu_available
from kimi_explore.errors import BackendError
from kimi_explore.weights.safetensors_io import SafetensorsFile, write_safetensors
from kimi_explore.weights.tiny_model import make_text_config, write_checkpoint


def load(path, **kw):
    return from_pretrained(path, device="cpu", **kw)


def edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg["text_config"])
    (path / "config.json").write_text(json.dumps(cfg))


def shard_of(path, name):
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def rewrite_tensor(path, name, new):
    shard = path / shard_of(path, name)
    f = SafetensorsFile(shard)
    tensors = {k: np.array(f.array(k)) for k in f.keys()}
    f.close()
    if new is None:
        del tensors[name]
    else:
        tensors[name] = new
    write_safetensors(shard, tensors)


def test_missing_config_keys_are_all_listed(ckpt):
    def drop(tc):
        del tc["hidden_size"], tc["attn_res_block_size"], tc["linear_attn_config"]["head_dim"]
    edit_config(ckpt, drop)
    with pytest.raises(ConfigError) as e:
        load(ckpt)
    msg = str(e.value)
    assert "config.json" in msg
    for key in ("hidden_size", "attn_res_block_size", "linear_attn_config.head_dim"):
        assert key in msg


def test_unsupported_config_is_refused(ckpt):
    edit_config(ckpt, lambda tc: tc.update(hidden_act="silu", num_expert_group=4))
    with pytest.raises(ConfigError, match=r"hidden_act='silu'.*num_expert_group=4"):
        load(ckpt)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json: no such file"):
        load(tmp_path)


def test_tensor_missing_from_the_weight_map(ckpt):
    name = "language_model.model.layers.5.self_attn.dt_bias"
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"not in the weight map: language_model\.model\.layers\.5\.self_attn\.dt_bias"):
        load(ckpt)


def test_tensor_missing_from_its_shard(ckpt):
    name = "language_model.model.layers.2.mlp_res_norm.weight"
    rewrite_tensor(ckpt, name, None)
    with pytest.raises(CheckpointError, match=f"places tensor '{name}' in this shard, but it is not there"):
        load(ckpt)


def test_misshapen_tensor_names_expected_and_found(ckpt):
    import ml_dtypes

    name = "language_model.model.layers.3.self_attn.kv_b_proj.weight"
    rewrite_tensor(ckpt, name, np.zeros((64, 32), ml_dtypes.bfloat16))
    with pytest.raises(CheckpointError) as e:
        load(ckpt)
    msg = str(e.value)
    assert name in msg and "expected shape [256, 32]" in msg and "found BF16[64, 32]" in msg


def test_wrong_dtype_for_mxfp4(ckpt):
    name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    rewrite_tensor(ckpt, name, np.zeros((64, 1), np.float32))
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight_scale': expected U8\[64, 1\].*found F32\[64, 1\]"):
        load(ckpt)


def test_a_log_with_a_non_zero_tail_is_refused(ckpt):
    name = "language_model.model.layers.0.self_attn.A_log"
    rewrite_tensor(ckpt, name, np.arange(32, dtype=np.float32))
    with pytest.raises(CheckpointError, match="A_log.*non-zero entries past num_heads=4"):
        load(ckpt)



@pytest.mark.parametrize("bad", [np.inf, np.nan, -np.inf, 1000.0])
def test_a_log_giving_no_finite_positive_decay_rate_is_refused(ckpt, bad):
    """A = exp(A_log) inf (A_log inf or 1000) loaded and ran another model; NaN gave NaN logits; -inf gives A = 0. The GGUF
    loader refused the same damage (its ssm_a), the safetensors loader did not."""
    name = "language_model.model.layers.0.self_attn.A_log"
    f = SafetensorsFile(ckpt / shard_of(ckpt, name))
    a_log = np.array(f.array(name))
    f.close()
    a_log[1] = bad
    rewrite_tensor(ckpt, name, a_log)
    finite = f"{name}' must give a finite decay rate exp\\(A_log\\) > 0 per head; found A_log "
    with pytest.raises(CheckpointError, match=finite if bad == 1000.0 else f"{name}' holds 1 non-finite value"):
        load(ckpt)


# mutation: the A_log padding check fired only when ALL padding entries were non-zero (np.all instead of np.any)
@pytest.mark.parametrize("where", ["first", "last"], ids=["first-padding-entry", "last-padding-entry"])
def test_mutation_a_log_padding_any_nonzero_entry_is_refused(ckpt, where):
    """The released A_log: H per-head values, zeros up to head_dim. ONE non-zero padding entry is already a
    layout the loader cannot read safely (which entries are the heads?): refused, naming tensor and num_heads."""
    name = "language_model.model.layers.1.self_attn.A_log"
    f = SafetensorsFile(ckpt / shard_of(ckpt, name))
    a_log = np.array(f.array(name))
    f.close()
    H = json.loads((ckpt / "config.json").read_text())["text_config"]["linear_attn_config"]["num_heads"]
    assert a_log.shape == (32,) and H == 4 and not np.any(a_log[H:])  # as released: the padding is all zeros
    a_log[H if where == "first" else -1] = 0.25
    rewrite_tensor(ckpt, name, a_log)
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.A_log.*non-zero entries past num_heads=4"):
        load(ckpt)


def test_truncated_shard(ckpt):
    shard = ckpt / shard_of(ckpt, "language_model.model.layers.13.self_attn.q_proj.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=f"{shard.name}: truncated: tensor '.*' ends at byte"):
        load(ckpt)


def test_corrupt_header(ckpt):
    shard = ckpt / shard_of(ckpt, "language_model.model.layers.1.input_layernorm.weight")
    data = bytearray(shard.read_bytes())
    data[10:20] = b"\xff" * 10
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name}: corrupt safetensors header"):
        load(ckpt)


def test_garbage_file(ckpt):
    shard = ckpt / shard_of(ckpt, "language_model.model.layers.1.input_layernorm.weight")
    shard.write_bytes(b"\x00" * 4)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load(ckpt)


def test_shard_in_the_index_but_absent(ckpt):
    shard = shard_of(ckpt, "language_model.model.layers.9.self_attn.q_proj.weight")
    (ckpt / shard).unlink()
    with pytest.raises(CheckpointError) as e:
        load(ckpt)
    msg = str(e.value)
    assert f"{shard} (needed by layers [8, 9, 10, 11])" in msg
    # a subset that does not need the shard loads fine
    load(ckpt, layers=range(0, 4))


def test_no_weights_at_all(tmp_path):
    write_checkpoint(tmp_path, make_text_config(num_hidden_layers=2, linear_attn_config={
        **make_text_config()["linear_attn_config"], "kda_layers": [1], "full_attn_layers": [2]}), shards=1, index=False)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        load(tmp_path)


def test_bad_layers_argument(ckpt):
    with pytest.raises(ValueError, match=r"layers: \[16\] outside 0..15"):
        load(ckpt, layers=[0, 16])
    with pytest.raises(ValueError, match="strictly increasing"):
        load(ckpt, layers=[3, 1])


@pytest.mark.parametrize("token", [256, -1])
def test_token_outside_the_vocabulary(tiny_weights, token):
    state = KimiDecodeState.new(tiny_weights)
    with pytest.raises(ValueError, match=rf"token_id={token} is outside the vocabulary: expected 0 <= token_id < 256"):
        kimi_forward_token(tiny_weights, state, token)
    assert state.position == 0


def test_token_of_the_wrong_type(tiny_weights):
    with pytest.raises(TypeError, match="token_id must be an integer"):
        kimi_forward_token(tiny_weights, KimiDecodeState.new(tiny_weights), 3.0)


def test_state_from_another_model(tiny_weights, ref_weights):
    with pytest.raises(ValueError, match="state has 14 layer states but the weights have 16"):
        kimi_forward_token(tiny_weights, KimiDecodeState.new(ref_weights), 1)


def test_weights_without_embedding_or_head_say_so(ckpt):
    """A pipeline stage's share (embedding=False / head=False) run as a whole model: a ValueError naming what is
    missing (the embedding's was "TypeError: 'NoneType' object is not subscriptable")."""
    from kimi_explore import kimi_forward_sequence

    w = from_pretrained(ckpt, device="cpu", embedding=False)
    with pytest.raises(ValueError, match="loaded with embedding=False: they have no token embedding"):
        kimi_forward_token(w, KimiDecodeState.new(w), 5)
    with pytest.raises(ValueError, match="loaded with embedding=False"):
        kimi_forward_sequence(w, KimiDecodeState.new(w), [5, 6])
    w = from_pretrained(ckpt, device="cpu", head=False)
    with pytest.raises(ValueError, match="loaded with head=False: they have no output head"):
        kimi_forward_token(w, KimiDecodeState.new(w), 5)


def test_unknown_device_and_dtype(ckpt):
    with pytest.raises(BackendError, match="device='tpu' is not one of 'auto', 'cpu', 'gpu'"):
        from_pretrained(ckpt, device="tpu")
    with pytest.raises(BackendError, match="dtype='float16' is not one of 'float32', 'float64'"):
        from_pretrained(ckpt, dtype="float16")


@pytest.mark.skipif(gpu_available(), reason="a GPU is usable here")
def test_gpu_requested_without_one(ckpt):
    with pytest.raises(BackendError, match="device='gpu' was requested but no GPU can be used"):
        from_pretrained(ckpt, device="gpu")
