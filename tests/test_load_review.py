"""A config.json that disagrees with the weights, or holds values of the wrong JSON type, is refused
before anything is read: each of these damaged copies used to load and run another model (logits off
by up to 66 on the trained tiny model) or fail with an error that named nothing."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from kimi_explore import CheckpointError, ConfigError, KimiDecodeState, from_pretrained, kimi_forward_sequence
from kimi_explore.weights.safetensors_io import SafetensorsFile, write_safetensors
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

P = "language_model."


def load(path, **kw):
    return from_pretrained(path, device="cpu", layers=[0], progress=False, **kw)


def edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg["text_config"])
    (path / "config.json").write_text(json.dumps(cfg))


def add_tensor(path, name, value):
    """Put `name` into the first shard and the index, as a conversion that kept an extra tensor would."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    f = SafetensorsFile(path / shard)
    tensors = {k: np.array(f.array(k)) for k in f.keys()}
    f.close()
    tensors[name] = value
    write_safetensors(path / shard, tensors)
    index["weight_map"][name] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("key, value, expected", [
    ("tie_word_embeddings", "false", "true or false"),  # a truthy string: the lm_head was silently dropped
    ("num_experts_per_token", "8", "an integer"),
    ("rms_norm_eps", "1e-05", "a number"),
    ("attn_res_block_size", 4.0, "an integer"),
    ("linear_attn_config.num_heads", "4", "an integer"),
    ("linear_attn_config.kda_layers", ["1", "2"], "a list of integers"),
])
def test_config_values_of_the_wrong_json_type_are_refused_by_key(ckpt, key, value, expected):
    def put(tc):
        *outer, last = key.split(".")
        (tc[outer[0]] if outer else tc)[last] = value
    edit_config(ckpt, put)
    with pytest.raises(ConfigError, match=r"config\.json: wrong value type") as e:
        load(ckpt)
    assert f"{key}={value!r} (expected {expected})" in str(e.value)


@pytest.mark.parametrize("key, value, message", [
    ("moe_layer_freq", 0, "moe_layer_freq=0 (expected > 0)"),  # was ZeroDivisionError
    ("rms_norm_eps", -1e-5, "rms_norm_eps=-1e-05 (expected a finite number > 0)"),  # was NaN logits
    ("first_k_dense_replace", -1, "first_k_dense_replace=-1 (expected >= 0)"),
    # JSON's Infinity and NaN parse as floats: all-zero logits, NaN logits, or a ZeroDivisionError at the first token
    ("rms_norm_eps", float("inf"), "rms_norm_eps=inf (expected a finite number > 0)"),
    ("activation_situ_beta", 0, "activation_situ_beta=0 (expected a finite number > 0)"),
    ("activation_situ_linear_beta", float("nan"), "activation_situ_linear_beta=nan (expected a finite number > 0)"),
    ("routed_scaling_factor", float("nan"), "routed_scaling_factor=nan (expected a finite number > 0)"),
    # a factor <= 0 zeroes or flips the routed sum; a gate floor >= 0 stops the decay or makes the state grow (NaN
    # logits from token ~20 at +5)
    ("routed_scaling_factor", 0, "routed_scaling_factor=0 (expected a finite number > 0)"),
    ("routed_scaling_factor", -2.5, "routed_scaling_factor=-2.5 (expected a finite number > 0)"),
    ("linear_attn_config", -math.inf, "gate_lower_bound=-inf (expected a finite number < 0"),
    ("linear_attn_config", 0.0, "gate_lower_bound=0.0 (expected a finite number < 0"),
    ("linear_attn_config", 5.0, "gate_lower_bound=5.0 (expected a finite number < 0"),
])
def test_config_values_out_of_range_are_refused(ckpt, key, value, message):
    if key == "linear_attn_config":
        edit_config(ckpt, lambda tc: tc[key].update(gate_lower_bound=value))
    else:
        edit_config(ckpt, lambda tc: tc.update({key: value}))
    with pytest.raises(ConfigError, match="unsupported configuration") as e:
        load(ckpt)
    assert message in str(e.value)


@pytest.mark.parametrize("edit", ["drop_full", "overlap", "fewer_layers"])
def test_layer_lists_that_do_not_split_the_layers_are_refused(ckpt, edit):
    def fn(tc):
        la = tc["linear_attn_config"]
        if edit == "drop_full":
            la["full_attn_layers"] = la["full_attn_layers"][:-1]
        elif edit == "overlap":
            la["full_attn_layers"] = sorted(la["full_attn_layers"] + la["kda_layers"][:1])
        else:  # num_hidden_layers one short: the last layer's tensors were ignored and a shorter model ran
            tc["num_hidden_layers"] -= 1
    edit_config(ckpt, fn)
    with pytest.raises(ConfigError, match=r"kda_layers .* and full_attn_layers .* do not split layers 1\.\.\d+"):
        load(ckpt)


def test_tied_embeddings_beside_an_lm_head_are_refused(ckpt):
    """tie_word_embeddings flipped to true: the checkpoint's lm_head was ignored and the embedding used."""
    edit_config(ckpt, lambda tc: tc.update(tie_word_embeddings=True))
    with pytest.raises(CheckpointError, match="tie_word_embeddings is true, but the checkpoint has its own "
                                              r"lm_head.weight\): language_model\.lm_head\.weight"):
        load(ckpt)


def test_output_gate_off_beside_gate_weights_is_refused(ckpt):
    """mla_use_output_gate flipped to false: the MLA layers' g_proj were ignored."""
    edit_config(ckpt, lambda tc: tc.update(mla_use_output_gate=False))
    with pytest.raises(CheckpointError, match=r"not part of the model config\.json describes.*self_attn\.g_proj\.weight"):
        load(ckpt)


def test_latent_norm_off_beside_norm_weights_is_refused(ckpt):
    edit_config(ckpt, lambda tc: tc.update(latent_moe_use_norm=False))
    with pytest.raises(CheckpointError, match="latent_moe_use_norm is false, but the checkpoint has routed_expert_norm"):
        load(ckpt)


def test_an_unknown_language_model_tensor_is_named(ckpt):
    add_tensor(ckpt, P + "model.layers.0.self_attn.q_norm.weight", np.ones(4, np.float32))
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) in the weight map .*model\.layers\.0\.self_attn\.q_norm"):
        load(ckpt)


def test_vision_tensors_beside_the_language_model_still_load(ckpt):
    """The released multimodal shell's other towers are not the language model's business."""
    add_tensor(ckpt, "vision_tower.patch_embed.weight", np.ones((2, 3), np.float32))
    add_tensor(ckpt, "mm_projector.linear_1.weight", np.ones((2, 3), np.float32))
    w = load(ckpt)
    assert [layer.index for layer in w.layers] == [0]


# ---- GGUF: the metadata and the tensors present decide the model; a tensor neither accounts for is refused

GGUF = random_tiny_checkpoint().parent / "engines" / "d" / "llamacpp" / "model-mxfp4.gguf"
K = "kimi-k3."


def rewrite_gguf(tmp_path, meta=None, drop=(), add=()):
    from kimi_explore.weights.gguf_io import GgufFile, write_gguf

    f = GgufFile(GGUF)
    m = {**f.metadata, **(meta or {})}
    tensors = [(n, t.ne, t.type, f.raw(n).tobytes()) for n, t in f.tensors.items() if n not in drop] + list(add)
    path = tmp_path / "bad.gguf"
    write_gguf(path, m, f.types, tensors)
    return path


def test_gguf_block_count_one_short_is_refused(tmp_path):
    """block_count - 1 (head_count_kv trimmed to match): the last block's tensors were ignored, a 13-layer model ran."""
    from kimi_explore.weights.gguf_io import GgufFile

    meta = GgufFile(GGUF).metadata
    n = meta[K + "block_count"]
    path = rewrite_gguf(tmp_path, meta={K + "block_count": n - 1,
                                        K + "attention.head_count_kv": meta[K + "attention.head_count_kv"][:-1]})
    with pytest.raises(CheckpointError, match=rf"bad\.gguf: \d+ tensor\(s\) in the GGUF are not part of the model its "
                                              rf"metadata describes \(block_count={n - 1},.*blk\.{n - 1}\."):
        from_pretrained(path, device="cpu", layers=[0])


def test_gguf_attn_gate_in_some_mla_layers_only_is_refused(tmp_path):
    """mla_use_output_gate is read from the tensors: with one MLA layer's attn_gate gone it was false, and
    the other layers' gates were silently dropped. Then it was refused naming the OTHER gates as "not part of
    the model"; the missing one is named (tests/test_engine_review_3.py)."""
    from kimi_explore.weights.gguf_io import GgufFile

    gates = [n for n in GgufFile(GGUF).tensors if n.endswith(".attn_gate.weight")]
    assert len(gates) > 1
    with pytest.raises(ConfigError, match=rf"1 MLA output gate tensor\(s\) missing: {re.escape(gates[0])};"):
        from_pretrained(rewrite_gguf(tmp_path, drop=gates[:1]), device="cpu", layers=[0])


def test_gguf_unknown_tensor_is_named(tmp_path):
    path = rewrite_gguf(tmp_path, add=[("blk.0.extra.weight", (4,), "F32", np.zeros(4, np.float32).tobytes())])
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) in the GGUF .*: blk\.0\.extra\.weight"):
        from_pretrained(path, device="cpu")


@pytest.mark.parametrize("layers", ["12", [1.5, 3], [True], {1: 0}])
def test_layers_that_are_not_integer_indices_are_refused(layers):
    """layers="12" loaded layers 1 and 2, [1.5, 3] loaded [1, 3], [True] loaded [1]: another model, no error."""
    with pytest.raises(ValueError, match=r"layers=.*: expected None or an iterable of 0-based integer layer indices"):
        from_pretrained(random_tiny_checkpoint(), device="cpu", layers=layers)


def test_layers_as_numpy_integers_and_ranges_still_load():
    for layers in (np.array([0, 2]), range(0, 3, 2), (np.int64(0), 2)):
        w = from_pretrained(random_tiny_checkpoint(), device="cpu", layers=layers)
        assert [layer.index for layer in w.layers] == [0, 2]


def test_a_log_padding_is_refused_before_anything_is_built(ckpt, monkeypatch):
    """A non-zero A_log padding in the LAST KDA layer was found only while building it, after every earlier
    layer had been read (at K3 size, minutes of reading); `check` refuses it now, naming the shard file."""
    import kimi_explore.weights.load as load_module

    la = json.loads((ckpt / "config.json").read_text())["text_config"]["linear_attn_config"]
    name = f"{P}model.layers.{la['kda_layers'][-1] - 1}.self_attn.A_log"
    shard = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]
    f = SafetensorsFile(ckpt / shard)
    tensors = {k: np.array(f.array(k)) for k in f.keys()}
    f.close()
    tensors[name][-1] = 0.5
    write_safetensors(ckpt / shard, tensors)

    def build_weights(*a, **k):
        raise AssertionError("build_weights reached: the damaged A_log was not caught by the check")
    monkeypatch.setattr(load_module, "build_weights", build_weights)
    with pytest.raises(CheckpointError, match=rf"{shard}: tensor '{name}' is stored \d+ wide with non-zero entries"):
        from_pretrained(ckpt, device="cpu")


def test_nulls_the_decoder_understands_still_load(ckpt):
    """The type check must not refuse what the config allows: null situ linear cap, null expert groups."""
    edit_config(ckpt, lambda tc: tc.update(activation_situ_linear_beta=None, num_expert_group=None, topk_group=None))
    w = load(ckpt)
    assert w.config.activation_situ_linear_beta is None and w.config.num_expert_group == 1


def test_a_null_situ_beta_is_hfs_one(ckpt, tmp_path):
    """HF's SituAndMul takes beta1 = 1.0 where activation_situ_beta is null (architecture doc 2.2): it was refused as
    a wrong value type. The null model runs as beta 1.0 does, bit for bit, and not as the file's beta (4) does."""
    import shutil

    ids = [3, 17, 250, 9]

    def logits(path):
        w = from_pretrained(path, device="cpu", progress=False)
        return kimi_forward_sequence(w, KimiDecodeState.new(w), ids)

    one = tmp_path / "one"
    shutil.copytree(ckpt, one)
    base = logits(ckpt)
    edit_config(one, lambda tc: tc.update(activation_situ_beta=1.0))
    edit_config(ckpt, lambda tc: tc.update(activation_situ_beta=None))
    assert from_pretrained(ckpt, device="cpu", layers=[0], progress=False).config.activation_situ_beta == 1.0
    null = logits(ckpt)
    assert np.array_equal(null, logits(one)) and np.abs(null - base).max() > 1e-4


def test_a_config_without_block_residuals_says_what_it_is(ckpt):
    edit_config(ckpt, lambda tc: tc.pop("attn_res_block_size"))
    with pytest.raises(ConfigError, match=r"missing required key\(s\): attn_res_block_size \(without it the model has "
                                          r"plain pre-norm residuals"):
        load(ckpt)


def test_another_familys_key_beside_ours_must_agree(ckpt):
    """num_experts_per_tok (DeepSeek/K2 naming) edited to 4 beside num_experts_per_token: the edit was ignored."""
    edit_config(ckpt, lambda tc: tc.update(num_experts_per_tok=tc["num_experts_per_token"] + 1))
    with pytest.raises(ConfigError, match=r"contradicting keys: num_experts_per_tok=\d+ but num_experts_per_token=\d+"):
        load(ckpt)


def test_another_familys_key_alone_is_named_in_the_missing_list(ckpt):
    def fn(tc):
        tc["n_routed_experts"] = tc.pop("num_experts")
    edit_config(ckpt, fn)
    with pytest.raises(ConfigError, match=r"missing required key\(s\): num_experts \(the file has 'n_routed_experts'"):
        load(ckpt)


@pytest.mark.parametrize("kw, message", [
    (dict(experts="Dense"), r"experts='Dense': expected one of"),
    (dict(expert_cache_size=-1), r"expert_cache_size=-1: expected None or a number"),
    (dict(expert_cache_size=2.0), r"expert_cache_size=2\.0: expected None or a number"),
])
def test_option_forms_are_refused_before_the_checkpoint_is_opened(monkeypatch, kw, message):
    """These were checked only after the checkpoint was opened and checked: for a Hub repo id, after its
    shards were downloaded."""
    import kimi_explore.weights.load as load_module

    def open_source(*a, **k):
        raise AssertionError("the checkpoint was opened (a Hub repo fetched) before the options were checked")
    monkeypatch.setattr(load_module, "open_source", open_source)
    with pytest.raises(ValueError, match=message):
        from_pretrained("org/name", device="cpu", **kw)


def test_gguf_metadata_of_the_wrong_type_names_the_gguf_key(tmp_path):
    """expert_used_count written as a float: the error named only config.json's key for it."""
    from kimi_explore.weights.gguf_io import GgufFile, write_gguf

    f = GgufFile(GGUF)
    types = {**f.types, K + "expert_used_count": 6}  # F32
    path = tmp_path / "bad.gguf"
    write_gguf(path, f.metadata, types, [(n, t.ne, t.type, f.raw(n).tobytes()) for n, t in f.tensors.items()])
    with pytest.raises(ConfigError, match=r"bad\.gguf: wrong value type: num_experts_per_token=2\.0 \(expected an "
                                          r"integer\) \(in the GGUF: num_experts_per_token is kimi-k3\.expert_used_count\)"):
        from_pretrained(path, device="cpu")


# ---- one checkpoint, one model: what a file holds beside the planned tensors (found by probing, 2026-12-05)

def test_a_routed_expert_stored_both_dense_and_packed_is_refused(ckpt):
    """The MXFP4 pair was planned and checked, the dense copy allowed unchecked: experts="dense" (and "auto" at
    this size) ran the dense copy, "packed" and "mapped" the pair, two models from one checkpoint, no error."""
    from kimi_explore.weights import mxfp4

    name = P + "model.layers.1.block_sparse_moe.experts.0.w1.weight"
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    f = SafetensorsFile(ckpt / index[name + "_packed"])
    dense = mxfp4.dequantize(np.array(f.array(name + "_packed")), np.array(f.array(name + "_scale")))
    f.close()
    add_tensor(ckpt, name, (dense * 2).astype(np.float32))  # the right shape: nothing else would tell
    for experts in ("auto", "dense", "packed", "mapped"):
        with pytest.raises(CheckpointError, match=r"1 routed expert weight\(s\) are in the weight map both dense and as "
                                                  rf"an MXFP4 pair .*: {name}$"):
            from_pretrained(ckpt, device="cpu", layers=[1], experts=experts)


@pytest.mark.parametrize("shard", ["../elsewhere/model.safetensors", None, 3, "/tmp/model.safetensors"])
def test_an_index_entry_outside_the_checkpoint_is_refused(ckpt, shard):
    """'../other/x.safetensors' read that tensor from another directory (logits off by 6.9); null or a number
    failed in sorted() with a TypeError naming neither the index nor the tensor."""
    path = ckpt / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"][P + "model.norm.weight"] = shard
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{path}: weight_map must name shard files inside {ckpt} .*found "
                                              rf"'{P}model\.norm\.weight': {re.escape(repr(shard))}"):
        load(ckpt)


def test_a_language_model_tensor_outside_the_prefix_is_refused(ckpt):
    """An unprefixed lm_head.weight beside the language_model.-prefixed ones counted as another tower's and was
    ignored (with tied embeddings, the real head)."""
    add_tensor(ckpt, "lm_head.weight", np.ones((256, 128), np.float32))
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' is a language-model name outside the checkpoint's "
                                              r"'language_model\.' prefix\): lm_head\.weight"):
        load(ckpt)


def test_mtp_layers_that_the_config_declares_load_unread(ckpt):
    """num_nextn_predict_layers=1 accounts for a layer after the last (a draft for speculative decoding, never
    read by the next-token forward): it loads, with the same logits; undeclared it is refused, naming the key."""
    before = decode(load(ckpt))
    n = json.loads((ckpt / "config.json").read_text())["text_config"]["num_hidden_layers"]
    for name, shape in (("enorm", (128,)), ("hnorm", (128,)), ("eh_proj", (128, 256))):  # an MTP block's own tensors
        add_tensor(ckpt, f"{P}model.layers.{n}.{name}.weight", np.ones(shape, np.float32))
    with pytest.raises(CheckpointError, match=rf"num_hidden_layers={n} \(and num_nextn_predict_layers=0 MTP layers "
                                              rf"after them\), but the checkpoint has layers \[{n}\]"):
        load(ckpt)
    edit_config(ckpt, lambda tc: tc.update(num_nextn_predict_layers=1))
    np.testing.assert_array_equal(decode(load(ckpt)), before)


def decode(w, tokens=(3, 1, 4, 1, 5)):
    from kimi_explore import KimiDecodeState, kimi_forward_sequence

    return kimi_forward_sequence(w, KimiDecodeState.new(w), list(tokens))


def test_a_tied_head_loaded_without_the_embedding_refuses_token_ids(tmp_path):
    """embedding=False kept the table as embed_tokens when the head is tied, so a later pipeline stage handed
    token ids by mistake embedded them and ran on; it refuses them as an untied stage does."""
    from kimi_explore import KimiDecodeState, kimi_forward_sequence
    from kimi_explore.weights.tiny_model import make_text_config, write_checkpoint

    path = write_checkpoint(tmp_path / "tied", make_text_config(tie_word_embeddings=True))
    full, stage = from_pretrained(path, device="cpu"), from_pretrained(path, device="cpu", embedding=False)
    assert stage.embed_tokens is None
    np.testing.assert_array_equal(stage.head().lm_head, full.embed_tokens)  # the head still reads the table
    with pytest.raises(ValueError, match="these weights were loaded with embedding=False"):
        kimi_forward_sequence(stage, KimiDecodeState.new(stage), [1, 2])


@pytest.mark.parametrize("entry, shown", [
    ({"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}, "0.0"),  # was a bare TypeError
    ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, "'2'"),  # "64" was read as the dims 6, 4
    ({"dtype": "F32", "shape": [2.7], "data_offsets": [0, 8]}, "2.7"),  # int() read 2.7 as 2
    ({"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}, "True"),
])
def test_a_header_entry_int_would_read_loosely_is_refused(tmp_path, entry, shown):
    import struct

    text = json.dumps({"w": entry}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + np.zeros(2, np.float32).tobytes())
    with pytest.raises(CheckpointError, match=rf"{path}: corrupt header entry for tensor 'w': .*{re.escape(shown)}"):
        SafetensorsFile(path)


def test_text_config_that_is_not_an_object_is_refused(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"] = [cfg["text_config"]]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config\.json: 'text_config' is \[.*\]; expected an object"):
        load(ckpt)


def test_a_log_narrower_than_the_heads_is_refused_by_the_check():
    """A_log stored head_dim wide where head_dim < num_heads passed the check, then the build failed reshaping
    it, naming no tensor (here: the check's own read, with a config of more heads than A_log has values)."""
    import dataclasses

    from kimi_explore.model.config import KimiDecoderConfig
    from kimi_explore.weights.safetensors_source import SafetensorsSource

    cfg = KimiDecoderConfig.from_file(random_tiny_checkpoint() / "config.json")
    wide = dataclasses.replace(cfg, linear_attn_config=dataclasses.replace(cfg.linear_attn_config, num_heads=64))
    source = SafetensorsSource(random_tiny_checkpoint(), wide)
    with pytest.raises(CheckpointError, match=r"tensor 'language_model\.model\.layers\.0\.self_attn\.A_log' has 32 "
                                              r"values, fewer than num_heads=64"):
        source.kda_decay(0)
