"""The shipped trained tiny K3 (kimi_explore/data/tiny_k3_pydoc): it loads, it is K3, the package reproduces the
trainer's logits, and its model card's figures hold. No torch: the trainer's logits are stored."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from kimi_explore import KimiDecoderConfig, KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.analysis import learned
from kimi_explore.weights.tiny_model import describe_checkpoint, tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "kimi_explore" / "data" / "tiny_k3_pydoc"
PARITY_NPZ = Path(__file__).parent / "data" / "trained_tiny_logits.npz"


@pytest.fixture(scope="module")
def trained():
    return from_pretrained(SHIPPED, device="cpu")


@pytest.fixture(scope="module")
def card():
    return json.loads((SHIPPED / "model_card.json").read_text())


def test_the_embedded_default_is_the_trained_model():
    assert Path(tiny_checkpoint()) == SHIPPED
    line = describe_checkpoint(SHIPPED)
    assert "trained" in line and "pydoc_data.topics" in line and "bits/byte" in line


def test_it_is_k3_at_tiny_scale():
    cfg = KimiDecoderConfig.from_file(SHIPPED / "config.json")
    n = cfg.num_hidden_layers
    assert 128 <= cfg.hidden_size <= 256 and 8 <= n <= 16
    kinds = [cfg.is_kda_layer(i) for i in range(n)]
    assert kinds == [(i + 1) % 4 != 0 and i != n - 1 for i in range(n)]  # 3:1, the last layer MLA
    assert not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(i) for i in range(1, n))
    assert cfg.num_experts >= 16 and cfg.num_experts_per_token >= 2 and cfg.num_shared_experts >= 1
    assert cfg.routed_scaling_factor != 1.0 and cfg.latent_moe_use_norm
    assert sum(cfg.is_block_boundary(i) for i in range(n)) >= 3
    assert cfg.vocab_size == 256 and cfg.hidden_act == "situ" and cfg.mla_use_nope and cfg.mla_use_output_gate
    raw = json.loads((SHIPPED / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3" and raw["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"


def test_released_layout_and_size():
    index = json.loads((SHIPPED / "model.safetensors.index.json").read_text())
    names = index["weight_map"]
    assert all(n.startswith("language_model.") for n in names)
    assert any(n.endswith("experts.0.w1.weight_packed") for n in names)
    assert not any(n.endswith("experts.0.w1.weight") for n in names)
    total = sum((SHIPPED / f).stat().st_size for f in set(names.values()))
    assert total <= 20e6


def test_the_training_corpus_ships_with_the_model(card):
    """Every CPython release has its own pydoc_data.topics (3.10's differ in half the validation split's first 256
    bytes), so the text the model was trained on ships beside it; its card names the text by hash."""
    data = learned.pydoc_corpus()
    assert (len(data), hashlib.sha256(data).hexdigest()) == (466_117, card["corpus_sha256"])
    assert learned.CORPUS.parent == SHIPPED and card["corpus_file"] == learned.CORPUS.name
    if ".".join(map(str, sys.version_info[:3])) == card["corpus_python"]:  # where it came from
        from pydoc_data.topics import topics

        assert "".join(topics[k] for k in sorted(topics)).encode("utf-8") == data


def test_package_reproduces_the_trainers_logits(trained):
    """training/parity.py stored the trainer's prefill logits (torch, the exported weights in float32)."""
    with np.load(PARITY_NPZ) as z:
        ids, expected = z["ids"], z["logits"]
    assert ids.shape == (256,) and expected.shape == (256, 256)
    state = KimiDecodeState.new(trained)
    got = np.stack([np.asarray(kimi_forward_token(trained, state, int(t))) for t in ids])
    assert np.abs(got - expected).max() <= 1e-3
    # the bytes are the start of the validation split
    _, val = learned.split_corpus(learned.pydoc_corpus())
    np.testing.assert_array_equal(ids, val[:256])


def test_model_card_figures_recomputed_on_a_short_slice(trained, card):
    train, val = learned.split_corpus(learned.pydoc_corpus())
    assert len(val) == card["val_bytes"] if "val_bytes" in card else True
    n, window = card["slice_windows"], card["window"]
    val_bpb = learned.bits_per_byte(trained, val, window, max_windows=n)
    train_bpb = learned.bits_per_byte(trained, train[-len(val):], window, max_windows=n)
    assert val_bpb == pytest.approx(card["val_slice_bits_per_byte"], abs=1e-3)
    assert train_bpb == pytest.approx(card["train_slice_bits_per_byte"], abs=1e-3)
    assert card["val_bits_per_byte"] <= 1.6
    readme = (SHIPPED / "README.md").read_text()
    assert f"{card['val_bits_per_byte']:.3f}" in readme and "PSF" in readme


def test_routing_is_balanced_on_the_validation_split(trained, card):
    from kimi_explore.analysis.routing_stats import routing_stats

    for row in card["balance_val"]:
        assert row["dead"] == 0, row
        assert row["max_over_mean"] <= 3.0, row
    loads = np.array(card["expert_loads_val"])
    assert (loads > 0).all() and (loads.max(axis=1) / loads.mean(axis=1) <= 3.0).all()
    # the card's counts are reproducible: recount the short slice
    _, val = learned.split_corpus(learned.pydoc_corpus())
    texts = [row[:-1].tolist() for row in learned.windows(val, card["window"])][: card["slice_windows"]]
    stats = routing_stats(trained, texts, progress=False)
    np.testing.assert_array_equal(stats.counts, np.array(card["expert_loads_val_slice"]))


def test_it_continues_with_english_words(trained):
    """`kimi-explore --generate 60 --prompt "The"`: greedy bytes after "The" are mostly real words."""
    state = KimiDecodeState.new(trained)
    ids = list(b"The")
    for t in ids[:-1]:
        kimi_forward_token(trained, state, t)
    out = []
    t = ids[-1]
    for _ in range(60):
        t = int(np.argmax(np.asarray(kimi_forward_token(trained, state, t))))
        out.append(t)
    text = bytes(out).decode("utf-8", "replace")
    words = [w.strip(".,;:()'\"`").lower() for w in text.split()]
    corpus = set(learned.pydoc_corpus().decode().lower().split())
    known = [w for w in words if w and w in corpus]
    assert len(known) >= 5 and len(known) >= 0.6 * len([w for w in words if w]), text
