"""Review 3 of the trace and interventions: source columns are model-wide, truncate inside a fed chunk after a
trace, layer 0 under a mask, repeated layers, empty traces, argument checks, hook-name and routing details.

Each expectation comes from a plain hook written here, or from the model's structure (the embedded tiny
model: 8 layers, blocks pushed at layers 0, 3, 6, so `Trace.source_labels()` is
['embedding', 'block 1', 'block 2', 'current'] and a site before layer i's attention mixes the blocks
pushed before i, then the current sum).
"""

from __future__ import annotations

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore import KimiDecodeState, hook_names, kimi_forward_token
from kimi_explore.inspection import interventions as I
from kimi_explore.inspection.hooks import Hooks
from kimi_explore.inspection.recorder import Recorder
from kimi_explore.inspection.session import Session
from kimi_explore.inspection.source_masks import source_columns

TOKENS = [100, 101, 102, 5, 88, 141, 250]
BOUNDARIES = (0, 3, 6)  # the tiny model's pushing layers
S = 4  # model-wide source columns: 3 blocks + current


def sealed_before(layer: int, site: str) -> int:
    """Blocks a site mixes: those pushed before layer's attention (its own push comes after its attention mix)."""
    return sum(b < layer or (site == "ffn" and b == layer) for b in BOUNDARIES)


def stepped(w, hooks) -> np.ndarray:
    """Logits of TOKENS stepped through a Session with `hooks` attached."""
    s = Session(w)
    with s.intervene(hooks):
        return np.stack([s.step(t) for t in TOKENS])


def by_hand_mask(model_cols):
    """A plain hook at every attn-res site: zero the given model-wide columns the site has, renormalise."""

    def fn(p, *, hook):
        n = p.shape[-1] - 1
        site_cols = {n if c % S == S - 1 else c % S for c in model_cols if c % S == S - 1 or c % S < n}
        if not site_cols or len(site_cols) == n + 1:
            return None
        q = p.copy()
        q[sorted(site_cols)] = 0
        return q / q.sum()

    hooks = Hooks()
    hooks.add("layers.*.attn_res.*.weights", fn)
    return hooks


def test_model_wide_layout_of_the_tiny_model(trained_weights):
    """The structure the other tests assume, read from a recorded trace."""
    s = Session(trained_weights)
    s.step(TOKENS[0])
    tr = s.trace()
    assert tr.source_labels() == ["embedding", "block 1", "block 2", "current"]
    for i in tr.layer_ids:
        for site in ("attn", "ffn"):
            name = f"layers.{i}.attn_res.{site}.weights"
            if name in tr:
                assert tr[name].shape[1] == sealed_before(i, site) + 1


# ---------------------------------------------------------------- 1: integer columns are model-wide


@pytest.mark.parametrize("cols", [[1], [3], [-1], [0, 2]], ids=["block1", "current-by-index", "minus1", "emb+block2"])
def test_mask_columns_follow_trace_source_labels(trained_weights, cols):
    """[1] is 'block 1' everywhere: a site that has not sealed it yet is left as it is (the old code masked
    that site's column 1, the current sum there); [3] is the current sum at every site."""
    got = stepped(trained_weights, I.mask_sources("all", "both", cols))
    want = stepped(trained_weights, by_hand_mask(cols))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, stepped(trained_weights, Hooks()), atol=1e-4)
    s = Session(trained_weights)  # the recorded weights: zero exactly in the masked model-wide columns
    with s.intervene(I.mask_sources("all", "both", cols)):
        s.feed(TOKENS[:3], chunk=3)
    A = s.trace().attn_res_weights()
    for li, i in enumerate(s.trace().layer_ids):
        for si, site in enumerate(("attn", "ffn")):
            n = sealed_before(i, site)
            if i == 0 and site == "attn":
                continue
            present = [c % S for c in cols if c % S < n or c % S == S - 1]
            if present and len(present) < n + 1:
                assert np.all(A[:, li, si, present] == 0), (i, site)
            kept = [c for c in list(range(n)) + [S - 1] if c not in present]
            assert np.all(A[:, li, si, kept] > 0), (i, site)


def test_one_hot_column_is_model_wide(trained_weights):
    """("one_hot", 3) at layer 4's attention mix (blocks 0, 1 sealed) is the current sum, its third source."""

    def current_only(p, *, hook):
        q = np.zeros_like(p)
        q[-1] = 1
        return q

    hand = Hooks()
    hand.add("layers.4.attn_res.attn.weights", current_only)
    got = stepped(trained_weights, I.override_attn_res(4, "attn", ("one_hot", 3)))
    np.testing.assert_allclose(got, stepped(trained_weights, hand), rtol=1e-6, atol=1e-6)


def test_one_hot_of_a_block_the_site_lacks_names_the_site_and_its_sources(trained_weights):
    s = Session(trained_weights)
    with pytest.raises(ValueError, match=r"layers\.4\.attn_res\.attn\.weights.*does not mix source column 2.*"
                                         r"blocks \[0, 1\] and the current sum \(column 3\)"):
        with s.intervene(I.override_attn_res(4, "attn", ("one_hot", 2))):
            s.step(TOKENS[0])


def test_unbound_hooks_refuse_a_column_they_cannot_place(trained_weights):
    """Without the model, column 1 at layer 0's FFN mix (embedding, current) is 'block 1' or the current sum."""
    with pytest.raises(ValueError, match=r"layers\.0\.attn_res\.ffn\.weights.*source column 1.*bind"):
        kimi_forward_token(trained_weights, KimiDecodeState.new(trained_weights), TOKENS[0],
                           hooks=I.mask_sources("all", "ffn", [1]))


@pytest.mark.parametrize(("family", "m", "cols"), [([1], 2, []), ([3], 2, [1]), ([1], 3, [1]), ([-2], 3, []),
                                                   ([-2], 4, [2]), (("block", 2), 3, [])])
def test_source_columns_with_the_model_width(family, m, cols):
    assert source_columns(family, m, S) == cols


# ---------------------------------------------------------------- 2: mla.probs width after truncate


def test_truncate_after_a_trace_drops_the_cut_cache_positions(trained_weights, tmp_path):
    """A feed, a trace, a truncate into the chunk: rows cover only the kept tokens' cache positions, as stepping
    records them ([nh, t + 1], NaN after)."""
    name = "layers.3.mla.probs"
    seen = []
    plain = Hooks()
    plain.add(name, lambda v, *, hook: seen.append(np.array(v)))
    state = KimiDecodeState.new(trained_weights)
    for t in TOKENS[:2]:
        kimi_forward_token(trained_weights, state, t, hooks=plain)
    s = Session(trained_weights, recorder=Recorder(full=[name]))
    s.feed(TOKENS[:3], chunk=8)
    s.trace()
    s.truncate(2)
    got = s.trace()[name]
    assert got.shape == (2, seen[0].shape[0], 2)
    assert np.isnan(got[0, :, 1]).all()
    np.testing.assert_allclose(got[0, :, :1], seen[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], seen[1], rtol=1e-5, atol=1e-6)
    s.save_state(tmp_path / "s.npz")
    assert s.trace().equals(Session.load_state(tmp_path / "s.npz", trained_weights).trace())


# ---------------------------------------------------------------- 3: layer 0 has no attention-site mix


def test_mask_with_layer_0_does_nothing_at_its_missing_attention_mix(trained_weights):
    def keep_embedding(p, *, hook):  # layer 0's FFN mix: [embedding, current] -> current masked
        return np.array([1, 0], dtype=p.dtype)

    hand = Hooks()
    hand.add("layers.0.attn_res.ffn.weights", keep_embedding)
    np.testing.assert_allclose(stepped(trained_weights, I.mask_sources(0)), stepped(trained_weights, hand),
                               rtol=1e-6, atol=1e-6)
    got = stepped(trained_weights, I.mask_sources(range(0, 8), "both", "current"))
    np.testing.assert_allclose(got, stepped(trained_weights, by_hand_mask([-1])), rtol=1e-6, atol=1e-6)



def test_mask_of_a_subset_layer_without_an_attention_mix_masks_its_ffn_mix(trained_weights):
    """On a subset from layer 4 (layers 4, 5 and 6 have nothing sealed before their attention: 6, the first pushing
    layer, pushes after it; no attention-site mix), mask_sources(layer, "both") masks what each layer has (its
    FFN-site mix), as a plain hook there does; site="attn" there is refused, as at layer 0 of the whole model, and so
    is a layer the model lacks."""
    from kimi_explore import from_pretrained
    from kimi_explore.weights.tiny_model import tiny_checkpoint

    w = from_pretrained(tiny_checkpoint(), device="cpu", layers=range(4, 8), dtype="float64")
    assert [n for n in hook_names(w) if n.endswith("attn_res.attn.weights")] == ["layers.7.attn_res.attn.weights"]
    for layer in (5, 6, 7):  # 5 and 6: the FFN-site mix only; 7: both mixes
        hand = Hooks()
        for name in (f"layers.{layer}.attn_res.attn.weights", f"layers.{layer}.attn_res.ffn.weights"):
            if name in hook_names(w):
                hand.add(name, _mask_first)
        np.testing.assert_allclose(stepped(w, I.mask_sources(layer, "both", "embedding")), stepped(w, hand),
                                   rtol=1e-12, atol=1e-12)
    assert not np.allclose(stepped(w, I.mask_sources(6, "both", "embedding")), stepped(w, Hooks()))  # it acts
    with pytest.raises(ValueError, match="layers.9"):
        stepped(w, I.mask_sources([6, 9], "both", "embedding"))
    with pytest.raises(ValueError, match="'layers.6.attn_res.attn.weights' is not a hook point"):
        stepped(w, I.mask_sources(6, "attn", "embedding"))
    with pytest.raises(ValueError, match="'layers.0.attn_res.attn.weights' is not a hook point"):
        stepped(trained_weights, I.mask_sources(0, "attn", "embedding"))


def _mask_first(p, *, hook):
    """Column 0 (the subset's input) masked, the rest renormalised (None where it is the only source)."""
    if p.shape[-1] < 2:
        return None
    q = p.copy()
    q[0] = 0
    return q / q.sum()


# ---------------------------------------------------------------- 4: a layer given twice


@pytest.mark.parametrize("make", [
    lambda: I.scale_kda_head([1, 1], 0, 0.5),
    lambda: I.mask_sources([2, 4, 2], "ffn", "current"),
    lambda: I.ablate_experts([3, 3], [1]),
    lambda: I.force_routing([1, 1], [0, 1]),
], ids=["scale_kda_head", "mask_sources", "ablate_experts", "force_routing"])
def test_a_layer_given_twice_is_refused(make):
    with pytest.raises(ValueError, match=r"layer: layers \[\d\] are given more than once"):
        make()


# ---------------------------------------------------------------- 5: an empty trace


@pytest.mark.parametrize("how", ["fresh", "truncated"])
def test_an_empty_trace_says_it_has_no_tokens(trained_weights, how):
    s = Session(trained_weights)
    if how == "truncated":
        s.feed(TOKENS[:3])
        s.truncate(0)
    tr = s.trace()
    for ask in (lambda: tr["layers.3.attn_res.attn.weights"], tr.top_predictions):
        with pytest.raises(KeyError, match="no tokens yet"):
            ask()
    assert tr.final_attn_res_weights().shape == (0, S)
    assert tr.attn_res_weights().shape == (0, 8, 2, S)


# ---------------------------------------------------------------- 6: argument checks


def test_zero_d_integer_arrays_count_as_ints(trained_weights):
    s = Session(trained_weights)
    s.feed(TOKENS)
    e = int(s.trace()["layers.3.moe.router.topk_ids"][5, 0])  # an expert layer 3 routes token 5 to

    def drop_at_5(ids, *, hook):
        return ids[ids != e] if hook.position == 5 else None

    hand = Hooks()
    hand.add("layers.3.moe.router.topk_ids", drop_at_5)
    want = stepped(trained_weights, hand)
    assert not np.allclose(want, stepped(trained_weights, Hooks()), atol=1e-4)
    for hooks in (I.ablate_experts(3, [e], positions=np.array(5)),
                  I.ablate_experts(np.array(3), [e], positions=[np.int64(5)])):
        np.testing.assert_allclose(stepped(trained_weights, hooks), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("positions", "match"), [([], "empty collection"), (slice(5, 3), "holds no token position"),
                                                  (range(4, 4), "empty collection")])
def test_positions_that_never_act_are_refused(positions, match):
    with pytest.raises(ValueError, match=match):
        I.ablate_experts(3, [1], positions=positions)
    with pytest.raises(ValueError, match=match):
        I.patch("layers.3.ffn.out", np.zeros((8, 4)), positions=positions)


@pytest.mark.parametrize("family", [[7], [-5], ("block", 3)], ids=["7", "-5", "block3"])
def test_a_source_the_model_does_not_have_is_refused(trained_weights, family):
    s = Session(trained_weights)
    with pytest.raises(ValueError, match=r"does not exist.*(4 source columns|blocks 0\.\.2)"):
        with s.intervene(I.mask_sources("all", "both", family)):
            s.step(TOKENS[0])


# ---------------------------------------------------------------- 7: small ones


def test_a_layer_number_with_leading_zeros_is_refused():
    with pytest.raises(ValueError, match=r"without leading zeros: 'layers\.1\.kda\.q'"):
        Hooks().add("layers.01.kda.q", lambda v, *, hook: None)


def test_routing_returns_topk_weights_recorded_without_ids(trained_weights):
    seen = {}
    plain = Hooks()
    plain.add("layers.*.moe.router.topk_weights", lambda v, *, hook: seen.setdefault(hook.layer, []).append(np.array(v)))
    state = KimiDecodeState.new(trained_weights)
    for t in TOKENS[:3]:
        kimi_forward_token(trained_weights, state, t, hooks=plain)
    s = Session(trained_weights, recorder=Recorder(names_filter="layers.*.moe.router.topk_weights"))
    for t in TOKENS[:3]:
        s.step(t)
    r = s.trace().routing()
    assert r["moe_layers"] == sorted(seen) and "topk_ids" not in r
    want = np.stack([np.stack(seen[i]) for i in sorted(seen)], axis=1)
    np.testing.assert_array_equal(r["topk_weights"], want)


def test_an_empty_window_gives_an_empty_table_and_a_saved_trace_loads_by_the_name_it_was_given(trained_weights, tmp_path):
    """to_pandas of a zero-token window failed (reshape(0, -1)); Trace.load(p) after save(p) without .npz found no file,
    where Session.load_state reads PATH.npz."""
    pytest.importorskip("pandas")
    s = Session(trained_weights)
    s.feed(list(b"hello world"))
    tr = s.trace()
    empty = tr.window(3, 3).to_pandas()
    assert len(empty) == 0 and list(empty.columns) == list(tr.to_pandas().columns)
    written = tr.save(tmp_path / "run")
    assert written.name == "run.npz"
    back = type(tr).load(tmp_path / "run")
    assert back.equals(tr)


def test_equal_histories_give_equal_traces_whatever_the_recorder_met_first(trained_weights):
    """Stepping meets kda.conv.norm before kda.state.norm, a chunk the other way round, and a recorder keeps the order
    it first met its records in through truncate and restore: a session that stepped a token before it was cut
    and fed gave a Trace that `equals` refused against a fresh one's (same records, same values)."""
    ids = [96, 160, 205, 148, 44, 173]
    s = ke.Session(trained_weights)
    s.step(249)
    s.truncate(0)
    s.feed(ids)
    fresh = ke.Session(trained_weights)
    fresh.feed(ids)
    assert s.trace().names() != fresh.trace().names()  # the order differs ...
    assert s.trace().equals(fresh.trace())  # ... and nothing else
    other = ke.Session(trained_weights)
    other.step(7)
    other.restore(fresh.snapshot())
    assert other.trace().equals(fresh.trace())
    fresh.step(3)
    assert not s.trace().equals(fresh.trace())
