"""Direct logit attribution: the leaves add up to the decoder's logit, and each leaf is what it claims.

Independent references: the session's logits; values recorded by a Recorder in full (not the
replay the attribution uses) put through the frozen final norm by hand; a per-expert float64 loop
over the expert weights (`gather`, `naive_situ_and_mul`) for the routed experts' split.
"""

from __future__ import annotations

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.backend import to_numpy
from kimi_explore.inspection import interventions
from kimi_explore.model.ops import naive_situ_and_mul

TEXT = list(b"Hello, attribution 7!\n")
STEPS = [0, 5, -1]


def f64(a):
    return np.asarray(to_numpy(a), dtype=np.float64)


@pytest.fixture(scope="module", params=["reference", "random_tiny"])
def model(request, ref_weights, tiny_weights):
    w = ref_weights if request.param == "reference" else tiny_weights
    last = w.layers[-1].hook_prefix + "prefix_sum"
    rec = ke.Recorder(full=["final.block_residual", last, "layers.*.ffn.in", "layers.*.attn.out", "embed"])
    s = ke.Session(w, recorder=rec)
    s.feed(TEXT)
    return w, s


@pytest.mark.parametrize("t", STEPS)
@pytest.mark.parametrize("which", ["top1", "given"])
def test_leaves_sum_to_the_logit_and_the_logit_is_the_decoders(model, t, which):
    w, s = model
    token = None if which == "top1" else 101
    a = ke.logit_attribution(s, t, token=token)
    expected_token = int(np.argmax(s.logits[t])) if token is None else token
    assert a.token == expected_token and a.t == t % len(TEXT)
    assert abs(a.logit - float(s.logits[t, expected_token])) <= 1e-4
    assert abs(sum(a.contributions.values()) - a.logit) <= 1e-4
    assert abs(sum(a.by_source().values()) - a.logit) <= 1e-4
    assert abs(sum(a.by_layer().values()) - a.logit) <= 1e-4
    values = list(a.contributions.values())
    assert all(abs(x) >= abs(y) for x, y in zip(values, values[1:], strict=False))


def test_the_leaves_are_the_model_structure(model):
    w, s = model
    t = 6
    a = ke.logit_attribution(s, t)
    routing = s.trace().routing()
    expected = {"embed"}
    for layer in w.layers:
        pre = layer.hook_prefix
        expected.add(pre + "attn.out")
        if layer.index in routing["moe_layers"]:
            j = routing["moe_layers"].index(layer.index)
            expected |= {f"{pre}moe.experts.{e}" for e in routing["topk_ids"][t, j]} | {pre + "moe.shared"}
        else:
            expected.add(pre + "ffn.out")
    assert set(a.contributions) == expected
    df = a.to_pandas()
    assert len(df) == len(expected) and abs(df["value"].sum() - a.logit) <= 1e-4
    assert set(df["part"]) == {"embed", "attn", "ffn", "expert", "shared"}


def test_by_source_is_the_frozen_norm_applied_to_each_recorded_source(model):
    """p_j * (lm_head[c] * g / rms(m)) . V_j, from the sources the Recorder kept in full."""
    w, s = model
    tr, t = s.trace(), 9
    a = ke.logit_attribution(s, t)
    V = np.concatenate([tr["final.block_residual"][t], tr[w.layers[-1].hook_prefix + "prefix_sum"][t][None]]).astype(np.float64)
    p = tr["final.attn_res.weights"][t].astype(np.float64)
    m = p @ V
    u = f64(w.lm_head[a.token]) * f64(w.norm) / np.sqrt(np.mean(m * m) + w.config.rms_norm_eps)
    by_hand = p * (V @ u)
    np.testing.assert_allclose(list(a.by_source().values()), by_hand, atol=1e-5)
    assert list(a.source_weights) == tr.source_labels()


def test_each_routed_expert_leaf_is_its_frozen_norm_share(model):
    """A float64 loop over the selected experts: up_proj(g_l * w_e y_e / rms(sum_e w_e y_e)), dotted with u."""
    w, s = model
    tr, t = s.trace(), 4
    a = ke.logit_attribution(s, t)
    routing = tr.routing()
    m = tr["final.attn_res.weights"][t].astype(np.float64)
    V = np.concatenate([tr["final.block_residual"][t], tr[w.layers[-1].hook_prefix + "prefix_sum"][t][None]]).astype(np.float64)
    mix = m @ V
    u = f64(w.lm_head[a.token]) * f64(w.norm) / np.sqrt(np.mean(mix * mix) + w.config.rms_norm_eps)
    source = {layer.index: sum(x.is_block_boundary for x in w.layers if x.index <= layer.index) for layer in w.layers}
    for j, i in enumerate(routing["moe_layers"][:3]):
        f = w.layers[w.layer_ids.index(i)].ffn
        E, l = f.num_experts, f.latent_size
        z = f64(f.in_proj)[E : E + l] @ tr[f"layers.{i}.ffn.in"][t].astype(np.float64)
        ids, wts = routing["topk_ids"][t, j], routing["topk_weights"][t, j].astype(np.float64)
        ys = []
        for e, we in zip(ids, wts, strict=True):
            w13, w2 = (f64(x)[0] for x in f.experts.gather(np.array([e])))
            ys.append(we * (w2 @ naive_situ_and_mul(w13 @ z, f.situ_beta, f.situ_linear_beta)))
        agg = np.sum(ys, axis=0)
        scale = f64(f.routed_expert_norm) / np.sqrt(np.mean(agg * agg) + f.eps)
        for e, y in zip(ids, ys, strict=True):
            by_hand = m[source[i]] * (u @ (f64(f.routed_expert_up_proj) @ (y * scale)))
            assert abs(a.contributions[f"layers.{i}.moe.experts.{e}"] - by_hand) <= 1e-5


def test_attribution_follows_persistent_interventions_and_refuses_rewritten_sums(ref_weights):
    s = ke.Session(ref_weights, hooks=interventions.ablate_experts(2, "all"))
    s.feed(TEXT[:6])
    a = ke.logit_attribution(s, -1)
    assert not any(k.startswith("layers.2.moe.experts.") for k in a.contributions)
    assert abs(sum(a.contributions.values()) - a.logit) <= 1e-4 and abs(a.logit - s.logits[-1].max()) <= 1e-4

    def double(v, *, hook):
        return v * 2.0

    bent = ke.Session(ref_weights, hooks=ke.Hooks().bind(ref_weights))
    bent.hooks.add("layers.3.moe.routed_out", double)
    bent.feed(TEXT[:4])
    with pytest.raises(ValueError, match=r"leaves of layers\.3\.moe\.routed_out add up"):
        ke.logit_attribution(bent, -1)
    late = ke.Session(ref_weights, hooks=ke.Hooks().bind(ref_weights))
    late.hooks.add("final.hidden", double)
    late.feed(TEXT[:4])
    with pytest.raises(ValueError, match="changed a value after the output mix"):
        ke.logit_attribution(late, -1)


def test_attribution_arguments_are_checked(ref_weights):
    s = ke.Session(ref_weights)
    s.feed(TEXT[:3])
    with pytest.raises(IndexError, match="outside the session's history of 3 tokens"):
        ke.logit_attribution(s, 3)
    with pytest.raises(ValueError, match=r"token must be an id in 0\.\.255"):
        ke.logit_attribution(s, 0, token=256)


def test_a_list_of_steps_is_one_replay_with_the_same_results(model):
    w, s = model
    many = ke.logit_attribution(s, [7, 2, -1], token=32)
    assert [a.t for a in many] == [2, 7, len(TEXT) - 1]
    for a in many:
        one = ke.logit_attribution(s, a.t, token=32)
        assert a.contributions == one.contributions and a.logit == one.logit


def test_a_layer_subset_that_starts_inside_a_block(ref_weights):
    """Layers 2..6: the embedding then stays in the running sum until the first push (layer 3)."""
    from conftest import REFERENCE_DIR

    w = ke.from_pretrained(REFERENCE_DIR, device="cpu", layers=range(2, 7))
    s = ke.Session(w)
    s.feed(TEXT[:6])
    a = ke.logit_attribution(s, -1)
    assert abs(sum(a.contributions.values()) - a.logit) <= 1e-4 and abs(a.logit - s.logits[-1].max()) <= 1e-4
    assert list(a.source_weights) == s.trace().source_labels() and a.source_of["embed"] == "input of layer 3"
    lens = ke.logit_lens(s, top=1)
    np.testing.assert_array_equal(lens.top_ids[:, -1, 0], np.argmax(s.logits, axis=-1))


def test_packed_experts_give_the_same_split(tiny_weights):
    """Experts multiplied from their MXFP4 bytes (the bank's own `outputs`) split the logit as the dense bank does."""
    packed = ke.from_pretrained(tiny_weights.source, device="cpu", experts="packed")
    runs = []
    for w in (tiny_weights, packed):
        s = ke.Session(w)
        s.feed(TEXT[:8])
        runs.append(ke.logit_attribution(s, -1, token=32))
    dense, bytes_ = runs
    assert abs(sum(bytes_.contributions.values()) - bytes_.logit) <= 1e-4
    assert set(dense.contributions) == set(bytes_.contributions)
    for leaf, v in dense.contributions.items():
        assert bytes_.contributions[leaf] == pytest.approx(v, abs=1e-4)


# mutation: attribution's expert leaves labelled in id order instead of routing order (shares given to the
# wrong experts)
@pytest.mark.parametrize("order", ["as-routed", "forced-descending"])
def test_mutation_each_expert_leaf_carries_that_experts_own_share(ref_weights, order):
    """Every routed-expert leaf of every MoE layer at several steps, against a float64 loop over the recorded
    routing (ids in the order the router returned them, each with its own combine weight). Routing order is
    not id order at many of these (layer, step) pairs; `force_routing` in descending id order makes it so at
    every one. Compared relative to the layer's largest share, so that small shares count too."""
    hooks = ke.Hooks().bind(ref_weights)
    if order == "forced-descending":
        hooks = interventions.force_routing(list(range(1, 14)), [6, 2, 0])  # 3 experts, against id order
    w, last = ref_weights, ref_weights.layers[-1].hook_prefix + "prefix_sum"
    rec = ke.Recorder(full=["final.block_residual", last, "layers.*.ffn.in"])
    s = ke.Session(w, recorder=rec, hooks=hooks)
    s.feed(TEXT)
    tr = s.trace()
    unsorted = 0
    for t in (2, 4, 9, 15):
        a = ke.logit_attribution(s, t)
        p = tr["final.attn_res.weights"][t].astype(np.float64)
        V = np.concatenate([tr["final.block_residual"][t], tr[last][t][None]]).astype(np.float64)
        mix = p @ V
        u = f64(w.lm_head[a.token]) * f64(w.norm) / np.sqrt(np.mean(mix * mix) + w.config.rms_norm_eps)
        for layer in w.layers:
            i, f = layer.index, layer.ffn
            if f.kind != "moe":
                continue
            ids = [int(e) for e in tr[f"layers.{i}.moe.router.topk_ids"][t]]
            wts = tr[f"layers.{i}.moe.router.topk_weights"][t].astype(np.float64)
            unsorted += ids != sorted(ids)
            E, l = f.num_experts, f.latent_size
            z = f64(f.in_proj)[E : E + l] @ tr[f"layers.{i}.ffn.in"][t].astype(np.float64)
            ys = []
            for e, we in zip(ids, wts, strict=True):
                w13, w2 = (f64(x)[0] for x in f.experts.gather(np.array([e])))
                ys.append(we * (w2 @ naive_situ_and_mul(w13 @ z, f.situ_beta, f.situ_linear_beta)))
            agg = np.sum(ys, axis=0)
            scale = f64(f.routed_expert_norm) / np.sqrt(np.mean(agg * agg) + f.eps)
            j = sum(x.is_block_boundary for x in w.layers if x.index <= i)  # the output-mix source it lives in
            want = np.array([p[j] * (u @ (f64(f.routed_expert_up_proj) @ (y * scale))) for y in ys])
            got = np.array([a.contributions[f"layers.{i}.moe.experts.{e}"] for e in ids])
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max(), err_msg=f"step {t}, layer {i}: {ids}")
    assert unsorted >= 10  # routing order differs from id order often enough to tell the two labellings apart


def test_one_late_step_replays_from_its_checkpoint_only(ref_weights, monkeypatch):
    """A stepped history of 40 tokens, checkpoints every 8: the attribution and the lens of token 37 re-decode
    tokens 32..37 only (counted), and equal what a replay from token 0 gives, bit for bit."""
    history = (TEXT * 2)[:40]
    s = ke.Session(ref_weights, checkpoint_every=8)
    for tok in history:
        s.step(tok)
    from_zero = ke.logit_attribution(s, [0, 37])[1]  # (a replay that starts at the first wanted step, 0)
    lens_zero = ke.logit_lens(s, top=3, positions=[0, 37])
    decoded = []
    forward = type(ref_weights).forward_token

    def counted(self, state, token_id, hooks=None):
        decoded.append(token_id)
        return forward(self, state, token_id, hooks)

    monkeypatch.setattr(type(ref_weights), "forward_token", counted)
    one = ke.logit_attribution(s, 37)
    assert decoded == history[32:38]
    assert one.contributions == from_zero.contributions and one.logit == from_zero.logit
    decoded.clear()
    lens = ke.logit_lens(s, top=3, positions=[37])
    assert decoded == history[32:38]
    assert np.array_equal(lens.top_ids[0], lens_zero.top_ids[1]) and np.array_equal(lens.top_probs[0], lens_zero.top_probs[1])
