"""How the experts are stored and multiplied: one model from two threads, scale byte 255, the cache (found by probing)."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.model.fingerprint import weight_samples
from kimi_explore.weights import mxfp4
from kimi_explore.weights.experts import PackedExperts

IDS = [5, 17, 42, 99]


def test_a_second_threads_forward_pass_on_the_same_weights_refuses():
    """The scratch, the dequantised experts and the expert cache are the weights': two threads' passes at once
    gave wrong logits (off by up to 21) with no error."""
    w = ke.from_pretrained(ke.tiny_checkpoint(), experts="packed", expert_cache_size=2)
    want = w.forward_sequence(w.new_state(), IDS)
    holding, done = threading.Event(), threading.Event()

    def hold():
        with w.workspace.in_use():  # what a forward pass holds while it runs
            holding.set()
            done.wait(30)
    t = threading.Thread(target=hold)
    t.start()
    try:
        holding.wait(30)
        state = w.new_state()
        with pytest.raises(RuntimeError, match="running a forward pass in another thread"):
            w.forward_token(state, 5)
        with pytest.raises(RuntimeError, match="running a forward pass in another thread"):
            w.forward_sequence(w.new_state(), IDS)
        assert state.position == 0 and not state.broken  # refused before anything ran
    finally:
        done.set()
        t.join()
    results = []  # one after the other from two threads: fine
    for _ in range(2):
        worker = threading.Thread(target=lambda: results.append(w.forward_sequence(w.new_state(), IDS)))
        worker.start()
        worker.join()
    for r in results:
        np.testing.assert_array_equal(r, want)


def test_scale_byte_255_is_inf_in_every_dtype():
    """2^128 (the release computes it in bf16: inf) was finite in float64, so float64 runs gave numbers where float32
    and the release give inf/NaN."""
    packed = np.array([[0x10] + [0x11] * 15], np.uint8)  # codes 0, 1 (0.5), 1, ...
    scale = np.array([[255]], np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for got in (mxfp4.dequantize(packed, scale), mxfp4.dequantize(packed, scale, dtype=np.float64),
                    mxfp4.naive_dequantize(packed, scale)):
            assert np.isnan(got[0, 0]) and got[0, 1] == np.inf


def _bank(capacity):
    rng = np.random.default_rng(0)
    q = [[mxfp4.quantize(rng.standard_normal(shape)) for _ in range(6)] for shape in ((64, 32), (32, 32))]
    (p13, s13), (p2, s2) = ([np.stack([a for a, _ in m]), np.stack([b for _, b in m])] for m in q)
    return PackedExperts(p13, s13, p2, s2, capacity=capacity)


def test_warm_keeps_the_experts_it_is_asked_for():
    """Experts already cached were skipped without becoming recent, so storing the others evicted them."""
    bank = _bank(3)
    for e in (0, 1, 2):
        bank.gather([e])
    bank.warm([0, 3])
    assert sorted(bank.cached_ids()) == [0, 2, 3]


def test_a_fingerprint_leaves_the_expert_cache_alone():
    """Session files and routing_stats fingerprint the weights: it replaced the cached experts and counted misses."""
    w = ke.from_pretrained(ke.tiny_checkpoint(), experts="packed", expert_cache_size=2)
    w.forward_token(w.new_state(), 5)
    bank = w.layers[1].ffn.experts
    before, stats = list(bank.cached_ids()), (bank.stats.hits, bank.stats.misses, bank.stats.evictions)
    weight_samples(w)
    assert list(bank.cached_ids()) == before and (bank.stats.hits, bank.stats.misses, bank.stats.evictions) == stats
