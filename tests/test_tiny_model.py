"""The embedded model in data/ is exactly what its generator script writes."""

from __future__ import annotations

from kimi_explore.weights.tiny_model import EMBEDDED_SEED, EMBEDDED_SHARDS, default_checkpoint, write_checkpoint


def test_embedded_model_is_reproducible(tmp_path):
    out = write_checkpoint(tmp_path / "tiny", seed=EMBEDDED_SEED, shards=EMBEDDED_SHARDS)
    shipped = default_checkpoint()
    names = sorted(p.name for p in shipped.iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    for name in names:
        assert (shipped / name).read_bytes() == (out / name).read_bytes(), name
