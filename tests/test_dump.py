"""The engine dump format: write, read back exactly, refuse what is not one."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from kimi_explore.engines.dump import DUMP_FORMAT, read_dump, write_dump


def test_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"layers.0.attn.in": rng.standard_normal((3, 8)).astype(np.float32),
              "layers.1.moe.router.topk_ids": np.array([[1, 4], [0, 2], [7, 3]], np.int32)}
    path = write_dump(tmp_path / "d.safetensors", arrays, tokens=[5, 9, 2], engine="mine 0.1", dtype="bfloat16")
    d = read_dump(path)
    assert d.tokens == [5, 9, 2] and d.engine == "mine 0.1" and d.dtype == "bfloat16"
    np.testing.assert_array_equal(d.arrays["layers.0.attn.in"], arrays["layers.0.attn.in"])
    np.testing.assert_array_equal(d.arrays["layers.1.moe.router.topk_ids"], arrays["layers.1.moe.router.topk_ids"])


def test_the_documented_few_lines_are_a_dump(tmp_path):
    # what another engine writes by hand (README), with a bf16 array: read back as float32 with the same values
    x = np.array([[1.5, -2.25], [0.125, 3.0]], dtype=ml_dtypes.bfloat16)
    save_file({"logits": x}, str(tmp_path / "x.safetensors"),
              metadata={"format": DUMP_FORMAT, "tokens": "72,105", "engine": "hand", "dtype": "bfloat16"})
    d = read_dump(tmp_path / "x.safetensors")
    assert d.arrays["logits"].dtype == np.float32
    np.testing.assert_array_equal(d.arrays["logits"], [[1.5, -2.25], [0.125, 3.0]])


def test_the_header_is_plain_safetensors(tmp_path):
    path = write_dump(tmp_path / "d.safetensors", {"logits": np.zeros((2, 4), np.float32)}, tokens=[1, 2], engine="e")
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert header["logits"]["shape"] == [2, 4] and header["logits"]["dtype"] == "F32"
    assert header["__metadata__"] == {"format": DUMP_FORMAT, "tokens": "1,2", "engine": "e", "dtype": "float32"}


def test_wrong_leading_axis_refused(tmp_path):
    with pytest.raises(ValueError, match=r"'logits' has shape \(3, 4\); expected \[T, ...\] with T = 2"):
        write_dump(tmp_path / "d.safetensors", {"logits": np.zeros((3, 4), np.float32)}, tokens=[1, 2])
    save_file({"logits": np.zeros((3, 4), np.float32)}, str(tmp_path / "bad.safetensors"),
              metadata={"format": DUMP_FORMAT, "tokens": "1,2"})
    with pytest.raises(ValueError, match="'logits' has shape"):
        read_dump(tmp_path / "bad.safetensors")


def test_missing_metadata_refused(tmp_path):
    save_file({"logits": np.zeros((2, 4), np.float32)}, str(tmp_path / "bare.safetensors"))
    with pytest.raises(ValueError, match=r"bare.safetensors: metadata lacks \['format', 'tokens'\]"):
        read_dump(tmp_path / "bare.safetensors")
    save_file({"logits": np.zeros((2, 4), np.float32)}, str(tmp_path / "fmt.safetensors"),
              metadata={"format": "x/1", "tokens": "1,2"})
    with pytest.raises(ValueError, match="format 'x/1'"):
        read_dump(tmp_path / "fmt.safetensors")


def test_unknown_dtype_refused(tmp_path):
    with pytest.raises(ValueError, match="'int4' is not an activation dtype"):
        write_dump(tmp_path / "d.safetensors", {}, tokens=[1], dtype="int4")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        read_dump(tmp_path / "nope.safetensors")
