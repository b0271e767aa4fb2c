"""`kimi-explore make-tiny`: a random checkpoint with K3's layer pattern at any depth, in the released layout."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kimi_explore import KimiDecoderConfig, Session, from_pretrained
from kimi_explore.cli import main
from kimi_explore.weights.k3_depth import K3_TEXT_CONFIG, k3_depth_config, k3_layer_lists, k3_text_config


def test_k3_depth_config_has_k3s_layer_pattern():
    cfg = k3_depth_config()
    la = cfg["linear_attn_config"]
    # K3's lists (1-based): MLA every 4th layer and the last one, KDA the rest
    assert la["full_attn_layers"] == [*range(4, 93, 4), 93] and len(la["kda_layers"]) == 69
    assert sorted(la["full_attn_layers"] + la["kda_layers"]) == list(range(1, 94))
    assert (cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_token"], cfg["attn_res_block_size"]) == \
        (93, 896, 16, 12)
    assert la["head_dim"] >= la["num_heads"]  # A_log is stored head_dim wide


def test_k3_text_config_is_k3():
    """The one copy of K3's config: 0-based MLA layers 3, 7, ..., 91 and 92 (the released config.json's
    1-based lists), layer 0 dense, block boundaries every 12 layers, and K3's widths."""
    cfg = KimiDecoderConfig.from_dict(K3_TEXT_CONFIG)
    assert [i for i in range(93) if not cfg.is_kda_layer(i)] == [*range(3, 92, 4), 92]
    assert [i for i in range(93) if not cfg.is_moe_layer(i)] == [0]
    assert [i for i in range(93) if cfg.is_block_boundary(i)] == list(range(0, 85, 12))
    assert (cfg.hidden_size, cfg.kda_proj_width, cfg.num_experts, cfg.num_experts_per_token, cfg.vocab_size) == \
        (7168, 12288, 896, 16, 163840)
    small = k3_text_config(num_experts=32)
    assert small["num_experts"] == 32 and K3_TEXT_CONFIG["num_experts"] == 896  # a copy, the constant untouched
    small["linear_attn_config"]["kda_layers"].clear()
    assert len(K3_TEXT_CONFIG["linear_attn_config"]["kda_layers"]) == 69
    assert k3_layer_lists(8) == {"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7]}
    assert k3_layer_lists(6) == {"full_attn_layers": [4, 6], "kda_layers": [1, 2, 3, 5]}


def test_make_tiny_writes_a_model_that_decodes(tmp_path, capsys):
    out = tmp_path / "k3d"
    assert main(["make-tiny", "--layers", "14", "--experts", "40", "--top-k", "5", "--out", str(out), "--shards", "3"]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["text_config"]["num_experts"] == 40
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert any(".experts.39.w2.weight" in n for n in index["weight_map"])
    w = from_pretrained(out)
    assert [w.config.is_kda_layer(i) for i in range(14)] == [(i + 1) % 4 != 0 and i != 13 for i in range(14)]
    s = Session(w)
    s.feed([1, 2, 3])
    r = s.trace().routing()
    assert r["topk_ids"].shape == (3, 13, 5) and np.isfinite(s.logits).all()


def test_make_tiny_refuses_bad_sizes(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["make-tiny", "--top-k", "50", "--experts", "40", "--out", str(tmp_path / "x")])
    assert "--top-k must be in 1..--experts (40), got 50" in capsys.readouterr().err


def test_shards_are_numbered_among_those_written(tmp_path):
    """6 layers over 8 shards writes 7 files (one shard has no layer); they were named '-of-00008', with a number
    skipped, as if a file were missing."""
    import json

    from kimi_explore.weights.k3_depth import write_k3_depth

    path = write_k3_depth(tmp_path / "k3", layers=6, experts=8, top_k=2)
    files = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert files == [f"model-{j:05d}-of-{len(files):05d}.safetensors" for j in range(1, len(files) + 1)]
    assert sorted(p.name for p in path.glob("*.safetensors")) == files
