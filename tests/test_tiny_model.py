"""The two tiny models: the random fixture in tests/data is exactly what its generator writes, and the
trained default ships inside the package (never a random stand-in)."""

from __future__ import annotations

import pytest

from kimi_explore import CheckpointError
from kimi_explore.weights import tiny_model
from kimi_explore.weights.tiny_model import (
    RANDOM_TINY_SEED,
    RANDOM_TINY_SHARDS,
    random_tiny_checkpoint,
    tiny_checkpoint,
    write_checkpoint,
)


def test_random_tiny_model_is_reproducible(tmp_path):
    out = write_checkpoint(tmp_path / "tiny", seed=RANDOM_TINY_SEED, shards=RANDOM_TINY_SHARDS)
    shipped = random_tiny_checkpoint()
    assert shipped.parent.name == "data" and shipped.parent.parent.name == "tests"
    names = sorted(p.name for p in shipped.iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    for name in names:
        assert (shipped / name).read_bytes() == (out / name).read_bytes(), name


def test_the_trained_default_is_package_data():
    path = tiny_checkpoint()
    assert path.parent.name == "data" and path.parent.parent.name == "kimi_explore"
    assert (path / "model_card.json").is_file() and path != random_tiny_checkpoint()


def test_a_missing_model_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_model, "TRAINED_TINY_DIR", tmp_path / "gone")
    with pytest.raises(CheckpointError, match=r"gone: the trained tiny model is not there.*reinstall"):
        tiny_checkpoint()
    monkeypatch.setattr(tiny_model, "RANDOM_TINY_DIR", tmp_path / "gone")
    with pytest.raises(CheckpointError, match=r"gone: the random tiny model is a fixture of the source checkout"):
        random_tiny_checkpoint()
    assert not (tmp_path / "gone").exists()  # nothing written in its place
