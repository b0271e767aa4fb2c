"""Review round 7: each of these used to run another model without a word, or answer for another value.

Loading: a shard replaced on disk between the loader's check and its reads (read at the old header's offsets),
F32 tensors exported as BF16, a NaN in the router bias, an index that leaves out a tensor its shard holds.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore import CheckpointError, KimiDecodeState, from_pretrained, kimi_forward_sequence
from kimi_explore.weights import safetensors_source
from kimi_explore.weights.safetensors_io import SafetensorsFile, write_safetensors

P = "language_model."
INDEX = "model.safetensors.index.json"


def load(path, **kw):
    return from_pretrained(path, device="cpu", progress=False, **kw)


def decode(w, tokens=(3, 1, 4, 1, 5)):
    return kimi_forward_sequence(w, KimiDecodeState.new(w), list(tokens))


def weight_map(path) -> dict:
    return json.loads((path / INDEX).read_text())["weight_map"]


def rewrite_shard(path, shard, edit, metadata=None):
    """Rewrite one shard of the checkpoint at `path` through edit({name: array}) (in place)."""
    f = SafetensorsFile(path / shard)
    tensors = {k: np.array(f.array(k)) for k in f.keys()}
    f.close()
    edit(tensors)
    (path / shard).unlink()  # (the fixture's files may be read-only copies)
    write_safetensors(path / shard, tensors, metadata=metadata)


# ---- loading

def test_a_shard_replaced_after_the_check_is_read_from_the_file_that_was_checked(ckpt, monkeypatch):
    """The reader opened each shard again by path when it first read from it, and read the new file at the old
    header's offsets: a re-download's os.replace between the check and the reads gave NaN logits without an error.
    Every read now goes through the file the header was read from."""
    want = decode(load(ckpt))
    shard = weight_map(ckpt)[f"{P}lm_head.weight"]  # a shard the check reads nothing of through the reader
    f = SafetensorsFile(ckpt / shard)
    tensors = {k: np.array(f.array(k)) for k in f.keys()}
    f.close()
    write_safetensors(ckpt / "replacement", tensors, metadata={"note": "x" * 40})  # same values, a longer header
    check = safetensors_source.SafetensorsSource.check

    def check_then_replace(self, *a, **k):
        check(self, *a, **k)
        os.replace(ckpt / "replacement", ckpt / shard)  # a writer, between the check and the reads

    monkeypatch.setattr(safetensors_source.SafetensorsSource, "check", check_then_replace)
    got = decode(load(ckpt))
    assert not (ckpt / "replacement").exists()  # (it was replaced mid-load)
    np.testing.assert_array_equal(got, want)


def test_f32_tensors_exported_as_bf16_are_refused(ckpt):
    """F32 router biases, dt_bias, conv taps and o_norm stored as BF16 (a model.to(torch.bfloat16) export) loaded
    and ran another model (logits 0.55 off on the reference set); a wider copy still loads, exactly."""
    import ml_dtypes

    name = f"{P}model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
    shard = weight_map(ckpt)[name]
    rewrite_shard(ckpt, shard, lambda t: t.__setitem__(name, t[name].astype(ml_dtypes.bfloat16)))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}': expected F32 \(or an exact F64 copy\), found BF16"):
        load(ckpt)


def test_f32_widened_to_f64_still_loads_exactly(ckpt):
    want = decode(load(ckpt))
    name = f"{P}model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
    rewrite_shard(ckpt, weight_map(ckpt)[name], lambda t: t.__setitem__(name, t[name].astype(np.float64)))
    np.testing.assert_array_equal(decode(load(ckpt)), want)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_router_bias_is_refused(ckpt, bad):
    """A NaN in the router bias ranks its expert first and the logits stay finite (3.35 off): refused at the check."""
    name = f"{P}model.layers.2.block_sparse_moe.gate.e_score_correction_bias"

    def poison(t):
        t[name] = t[name].copy()
        t[name][3] = bad

    rewrite_shard(ckpt, weight_map(ckpt)[name], poison)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' holds 1 non-finite value\(s\) .*flat index 3"):
        load(ckpt)


def test_an_index_that_leaves_out_a_tensor_its_shard_holds_is_refused(ckpt):
    """With mla_use_output_gate false and the gate's entries gone from the index (the shard still holding them), the
    loader ran the model without them (logits 3.0 off): the shards' own headers are read against the index."""
    index = json.loads((ckpt / INDEX).read_text())
    kda = {k.rsplit(".self_attn.", 1)[0] for k in index["weight_map"] if k.endswith("self_attn.A_log")}
    gates = [k for k in index["weight_map"] if k.endswith("self_attn.g_proj.weight") and k.rsplit(".self_attn.", 1)[0]
             not in kda]  # MLA's output gate
    assert gates
    for k in gates:
        del index["weight_map"][k]
    (ckpt / INDEX).write_text(json.dumps(index))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["mla_use_output_gate"] = False
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"language-model tensor\(s\) that model.safetensors.index.json does not "
                                              r"place in this shard"):
        load(ckpt)


def test_a_weight_map_that_is_not_an_object_is_named(ckpt):
    (ckpt / INDEX).write_text(json.dumps({"weight_map": []}))
    with pytest.raises(CheckpointError, match=r"not a valid safetensors index .*'weight_map' is a list, not an object"):
        load(ckpt)
