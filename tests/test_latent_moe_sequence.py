"""latent_moe_sequence: the router for every row (the token form's ids, ties included), the selections
grouped by expert in every kind of bank, against the token form and the float64 per-row twin."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from conftest import require_kernel
from test_modules import as64, layers_of

from kimi_explore import from_pretrained
from kimi_explore.model import latent_moe as moe
from kimi_explore.model import token_ops
from kimi_explore.model.config import FFN_SITES
from kimi_explore.model.latent_moe import LatentMoeWeights, expert_outputs, group_selections, latent_moe, naive_latent_moe
from kimi_explore.model.latent_moe_sequence import (
    _situ_rows,
    expert_outputs_grouped,
    latent_moe_sequence,
    routing_weights_rows,
    select_experts_rows,
)
from kimi_explore.weights.tiny_model import tiny_checkpoint

TOL = {np.float32: 1e-5, np.float64: 1e-12}
NAMES = {kind: kind for kind in FFN_SITES["moe"]}


def close(a, b, dtype):
    assert float(np.max(np.abs(np.asarray(a, np.float64) - b))) <= TOL[dtype] * float(np.max(np.abs(b)))


class Grab:
    """Token-form hooks: each site's values per token, optionally changed."""

    def __init__(self, change=None):
        self.seen, self.change = {}, change or {}

    def fire(self, name, value):
        if name in self.change:
            value = self.change[name](value)
        self.seen.setdefault(name, []).append(np.array(value))
        return value


# ---------------------------------------------------------------- the router, row by row


def tied_scores(rng, T, E, dtype=np.float32):
    """Scores with deliberate ties: coarse grids, whole rows equal, equal biased sums at the top-k boundary."""
    s = rng.random((T, E)).astype(dtype)
    s[: T // 3] = np.round(s[: T // 3] * 8) / 8
    s[T // 3 : T // 2] = 0.5
    return s


@pytest.fixture(params=["compiled", "uncompiled"])
def route(request, monkeypatch):
    """Both forms with the compiled steps (`token_ops`: all rows in one call), and as an install without them
    (rows: a partition, with tied rows handed to the token form's own rule)."""
    if request.param == "uncompiled":
        monkeypatch.setattr(token_ops, "runs", lambda *arrays: False)
    elif not token_ops.AVAILABLE:
        if os.environ.get("KIMI_EXPLORE_REQUIRE_KERNEL") == "1":
            pytest.fail("kimi_explore.model._token_ops was not built, and KIMI_EXPLORE_REQUIRE_KERNEL=1")
        pytest.skip("the compiled token steps were not built (no C compiler at install)")
    return request.param


@pytest.mark.parametrize("small", [True, False], ids=["python-router", "array-router"])
@pytest.mark.parametrize("E,k", [(16, 4), (8, 8), (200, 8), (896, 16)], ids=["E16k4", "all-experts", "E200k8", "E896k16"])
def test_rows_pick_the_token_forms_ids_ties_included(monkeypatch, route, small, E, k):
    monkeypatch.setattr(moe, "SMALL_ROUTER", 10**6 if small else 0)
    rng = np.random.default_rng(E + k)
    scores = tied_scores(rng, 120, E)
    bias = (np.round(rng.standard_normal(E) * 4) / 40).astype(np.float32)  # a grid too: biased sums tie
    bias[::3] = 0.0
    ids = select_experts_rows(scores, bias, k)
    want = np.stack([moe.select_experts(scores[t], bias, k) for t in range(120)])
    assert ids.shape == (120, min(k, E))
    np.testing.assert_array_equal(ids, want)
    if small:  # the host route's documented rule: ties by lower id (biased), then the biased order (unbiased)
        assert select_experts_rows(np.full((2, E), 0.5, np.float32), np.zeros(E, np.float32), k).tolist() == [list(range(k))] * 2


@pytest.mark.parametrize("small", [True, False], ids=["python-router", "array-router"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalised", "raw"])
def test_routing_weights_rows_bit_for_bit(monkeypatch, route, small, renormalize):
    monkeypatch.setattr(moe, "SMALL_ROUTER", 10**6 if small else 0)
    rng = np.random.default_rng(1)
    for dtype in (np.float32, np.float64):
        scores = tied_scores(rng, 50, 16, dtype)
        ids = select_experts_rows(scores, np.zeros(16, dtype), 4)
        got = routing_weights_rows(scores, ids, renormalize, 2.5)
        want = np.stack([moe.routing_weights(scores[t], ids[t], renormalize, 2.5) for t in range(50)])
        assert got.dtype == want.dtype == dtype
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- the layer


@pytest.mark.parametrize("model", ["ref_weights", "trained_weights"], ids=["reference", "trained"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_sequence_equals_the_token_form_and_the_naive_twin(request, model, dtype):
    for w in layers_of(request.getfixturevalue(model), "moe", "ffn")[::4]:
        w = as64(w) if dtype == np.float64 else w
        xs = (np.random.default_rng(2).standard_normal((33, w.in_proj.shape[1])) * 2).astype(dtype)
        token = Grab()
        want = np.stack([latent_moe(x, w, token, NAMES) for x in xs])
        seen = {}
        got = latent_moe_sequence(xs, w, fire=lambda name, value, seen=seen: seen.setdefault(name, value))
        assert list(seen) == list(FFN_SITES["moe"])
        assert seen["moe.router.scores"].shape == (33, w.num_experts) and seen["moe.routed_out"].shape == xs.shape
        np.testing.assert_array_equal(seen["moe.router.topk_ids"], np.stack(token.seen["moe.router.topk_ids"]))
        assert seen["moe.experts_out"].shape == (33, w.latent_size)
        for name in ("moe.router.scores", "moe.router.topk_weights", "moe.experts_out", "moe.routed_out", "moe.shared_out"):
            close(seen[name], np.stack(token.seen[name]), dtype)
        close(got, want, dtype)
        if dtype == np.float64:
            naive = [naive_latent_moe(x, w) for x in xs]
            close(got, np.stack([n[0] for n in naive]), dtype)
            np.testing.assert_array_equal(seen["moe.router.topk_ids"], np.stack([n[1] for n in naive]))


def test_hooks_may_change_k_and_replace_outputs(ref_weights):
    """topk_ids returned with another k (the last choice dropped; then none at all), routed_out replaced."""
    w = as64(layers_of(ref_weights, "moe", "ffn")[1])
    xs = np.random.default_rng(3).standard_normal((9, w.in_proj.shape[1]))
    for drop in (1, w.top_k):
        change = {"moe.router.topk_ids": lambda ids, d=drop: ids[..., : ids.shape[-1] - d],
                  "moe.routed_out": lambda r: 0.5 * r}
        want = np.stack([latent_moe(x, w, Grab(change), NAMES) for x in xs])
        got = latent_moe_sequence(xs, w, fire=lambda name, value, c=change: c.get(name, lambda a: a)(value))
        close(got, want, np.float64)


@pytest.mark.parametrize("small", [True, False], ids=["python-router", "array-router"])
def test_dropped_selections(monkeypatch, ref_weights, small):
    """A chunk-aware hook may mark selections -1 at some tokens (e.g. an expert ablated at some positions): those
    tokens route as the token form does with those experts removed (weights renormalised over the rest)."""
    monkeypatch.setattr(moe, "SMALL_ROUTER", 10**6 if small else 0)
    w = layers_of(ref_weights, "moe", "ffn")[2]
    xs = np.random.default_rng(8).standard_normal((10, w.in_proj.shape[1])).astype(np.float32)
    drop = {1: [0], 4: [1], 6: [0, 1]}  # token -> columns dropped (token 6: every expert)
    n = iter(range(10))

    def token_ids(ids):
        t = next(n)
        return np.delete(ids, drop.get(t, []))

    def chunk_ids(ids):
        ids = ids.copy()
        for t, cols in drop.items():
            ids[t, cols] = -1
        return ids

    token = Grab({"moe.router.topk_ids": token_ids})
    want = np.stack([latent_moe(x, w, token, NAMES) for x in xs])
    seen = {}

    def fire(name, value):
        value = chunk_ids(value) if name == "moe.router.topk_ids" else value
        seen[name] = value
        return value

    got = latent_moe_sequence(xs, w, fire=fire)
    close(got, want, np.float32)
    weights = seen["moe.router.topk_weights"]
    for t in range(10):
        kept = seen["moe.router.topk_ids"][t] >= 0
        assert not weights[t][~kept].any()
        np.testing.assert_allclose(weights[t][kept], token.seen["moe.router.topk_weights"][t], rtol=1e-6)


# ---------------------------------------------------------------- the banks, grouped by expert


def test_group_selections():
    ids = np.array([[3, 1], [1, 0], [3, 3]])
    g = group_selections(ids)
    assert g.experts == [0, 1, 3] and g.bounds == [0, 1, 3, 6]
    assert g.order.tolist() == [3, 1, 2, 0, 4, 5] and g.rows.tolist() == [1, 0, 1, 0, 2, 2]
    y = np.arange(6.0)[:, None] * np.ones((1, 2))
    np.testing.assert_array_equal(g.scatter(y)[..., 0], np.array([[3, 1], [2, 0], [4, 5]]))
    g = group_selections(np.array([[3, -1], [-1, 0]]))  # dropped selections: not grouped, rows of zeros
    assert g.experts == [0, 3] and g.order.tolist() == [3, 0] and g.rows.tolist() == [1, 0]
    np.testing.assert_array_equal(g.scatter(np.array([[5.0], [7.0]]))[..., 0], np.array([[7, 0], [0, 5]]))
    with pytest.raises(ValueError, match=r"expert ids: expected \[T, k\], got shape \(4,\)"):
        group_selections(np.arange(4))


BANKS = {"dense": dict(experts="dense"), "packed-fused": dict(experts="packed", expert_cache_size=0),
         "mapped-fused": dict(experts="mapped", expert_cache_size=0),
         "packed-cache": dict(experts="packed", expert_cache_size=3), "mapped-cache": dict(experts="mapped", expert_cache_size=5)}


@pytest.fixture(scope="module")
def banks():
    return {name: from_pretrained(tiny_checkpoint(), device="cpu", **kw) for name, kw in BANKS.items()}


def moe_layer(weights, i=2):
    return [layer.ffn for layer in weights.layers if isinstance(layer.ffn, LatentMoeWeights)][i]


def selections(rng, T, E, k):
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    ids[3] = ids[4]  # the same choice twice
    ids[5, 1] = ids[5, 0]  # a hook may pick one expert twice in a row
    return ids


@pytest.mark.parametrize("name", list(BANKS))
def test_every_bank_grouped_equals_per_token(banks, name):
    if "fused" in name:
        require_kernel()
    w = moe_layer(banks[name])
    bank = w.experts
    if name != "dense":
        assert bank.uses_fused == ("fused" in name)
    rng = np.random.default_rng(4)
    ids = selections(rng, 37, w.num_experts, w.top_k)
    z = rng.standard_normal((37, w.latent_size)).astype(np.float32)
    ids[6, 0] = -1  # dropped by a chunk-aware hook: a row of zeros
    want = np.zeros((37, w.top_k, w.latent_size))
    for t in range(37):
        kept = ids[t] >= 0
        want[t, kept] = expert_outputs(bank, ids[t][kept], z[t], w.situ)
    # the layer's own activation too (`_situ_rows`): a dense bank's compiled experts (`sequence_ops.experts_grouped`)
    for act in (w.situ, _situ_rows(w)):
        got = expert_outputs_grouped(bank, ids, z, act)
        assert got.shape == (37, w.top_k, w.latent_size) and got.dtype == np.float32
        close(got, want, np.float32)
        assert not got[6, 0].any()


def test_mapped_and_packed_fused_grouped_are_bit_identical(banks):
    require_kernel()
    a, b = moe_layer(banks["packed-fused"]), moe_layer(banks["mapped-fused"])
    rng = np.random.default_rng(5)
    ids = selections(rng, 20, a.num_experts, a.top_k)
    z = rng.standard_normal((20, a.latent_size)).astype(np.float32)
    np.testing.assert_array_equal(expert_outputs_grouped(a.experts, ids, z, a.situ),
                                  expert_outputs_grouped(b.experts, ids, z, b.situ))


def test_cache_counts_each_distinct_expert_once_and_keeps_the_latest(banks, monkeypatch):
    """Dequantised in batches (GROUPED_BYTES forced down to 2 experts): each distinct expert of the chunk is one
    hit or one miss; hits are multiplied before any store can evict them; the cache ends with the latest."""
    w = moe_layer(banks["packed-cache"], 0)
    bank = w.experts
    monkeypatch.setattr(type(bank), "GROUPED_BYTES", 2 * bank.expert_bytes)
    bank.clear()
    bank.warm([1, 2, 3])
    rng = np.random.default_rng(6)
    ids = np.array([[3, 0], [5, 3], [7, 1], [0, 9]]) % w.num_experts
    z = rng.standard_normal((4, w.latent_size)).astype(np.float32)
    want = np.stack([expert_outputs(moe_layer(banks["dense"], 0).experts, ids[t], z[t], w.situ) for t in range(4)])
    got = expert_outputs_grouped(bank, ids, z, w.situ)
    close(got, want, np.float32)
    distinct = sorted(set(ids.reshape(-1).tolist()))
    assert (bank.stats.hits, bank.stats.misses) == (2, len(distinct) - 2)  # 1 and 3 were cached
    assert bank.cached_ids() == [e for e in distinct if e not in (1, 3)][-3:]


def test_a_bank_with_only_gather(ref_weights):
    """Any object with `gather` (the token form's minimum) is grouped one expert at a time."""
    w = as64(layers_of(ref_weights, "moe", "ffn")[0])

    @dataclasses.dataclass
    class GatherOnly:
        inner: object

        def gather(self, ids):
            return self.inner.gather(ids)

    rng = np.random.default_rng(7)
    ids = selections(rng, 11, w.num_experts, w.top_k)
    z = rng.standard_normal((11, w.latent_size))
    want = np.stack([expert_outputs(w.experts, ids[t], z[t], w.situ) for t in range(11)])
    close(expert_outputs_grouped(GatherOnly(w.experts), ids, z, w.situ), want, np.float64)
    close(expert_outputs_grouped(w.experts, ids, z, w.situ), want, np.float64)


def test_a_dense_bank_takes_the_compiled_experts_on_chunks(monkeypatch, trained_weights):
    """Found by review: the layer's latents are a column slice of its input projection, which the compiled experts
    refused as not C-contiguous, so chunks of 2 or more tokens never took them (only single tokens did)."""
    from kimi_explore.model import sequence_ops

    if not sequence_ops.AVAILABLE:
        pytest.skip("the compiled sequence ops were not built")
    ran = []
    real = sequence_ops.experts_grouped
    monkeypatch.setattr(sequence_ops, "experts_grouped", lambda *a: ran.append(real(*a) is not None) or real(*a))
    w = layers_of(trained_weights, "moe", "ffn")[0]
    latent_moe_sequence(np.random.default_rng(0).standard_normal((33, w.in_proj.shape[1])).astype(np.float32), w)
    assert ran == [True]
