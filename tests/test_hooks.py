"""Hook points: the pinned name list, the fn(value, *, hook) contract, matching, checking and removal."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore import KimiDecodeState, hook_names, kimi_forward_token
from kimi_explore.inspection.hooks import HookChain, HookPoint, Hooks

TOKENS = [17, 203, 5, 88]


def decode(w, tokens, hooks=None):
    state = KimiDecodeState.new(w)
    return np.stack([np.array(kimi_forward_token(w, state, t, hooks=hooks)) for t in tokens])


class Seen:
    """Records (name, HookPoint fields) of every call; changes nothing."""

    def __init__(self):
        self.calls = []

    def __call__(self, value, *, hook):
        self.calls.append((hook.name, hook.layer, hook.kind, hook.position))


# ---------------------------------------------------------------- the name list


def test_hook_names_pinned_for_the_reference_model(ref_weights):
    names = hook_names(ref_weights)
    # 14 layers (9 KDA, 5 MLA; layer 0 dense, 13 MoE): per layer attn.in, attn.out, attn_res.ffn.weights,
    # ffn.in, ffn.out, prefix_sum (6 x 14) + attn_res.attn.weights (13, none at layer 0) + 10 KDA sites
    # (x 9) + 4 MLA sites (x 5) + 6 MoE sites (x 13); plus embed and 4 final sites.
    assert len(names) == 6 * 14 + 13 + 10 * 9 + 4 * 5 + 6 * 13 + 5 == 290
    assert len(set(names)) == len(names)
    assert names[:6] == ["embed", "layers.0.attn.in", "layers.0.kda.conv", "layers.0.kda.conv_out", "layers.0.kda.q",
                         "layers.0.kda.k"]
    assert names[names.index("layers.2.attn.in"):names.index("layers.2.attn.out")] == [
        "layers.2.attn.in", "layers.2.mla.q_latent", "layers.2.mla.kv_latent", "layers.2.mla.probs", "layers.2.mla.o"]
    assert names[-4:] == ["final.block_residual", "final.attn_res.weights", "final.hidden", "logits"]
    for present in ["layers.1.attn_res.attn.weights", "layers.2.mla.probs", "layers.13.moe.router.topk_ids",
                    "layers.0.kda.state", "layers.11.kda.conv", "layers.0.prefix_sum"]:
        assert present in names
    for absent in ["layers.0.attn_res.attn.weights", "layers.2.kda.q", "layers.0.moe.router.scores", "layers.14.attn.in"]:
        assert absent not in names


def test_fired_names_are_exactly_hook_names_in_order(ref_weights):
    fired = []
    hooks = Hooks().add("*", lambda v, *, hook: fired.append(hook.name)).hooks
    decode(ref_weights, TOKENS[:2], hooks)
    names = hook_names(ref_weights)
    assert fired == names + names


# ---------------------------------------------------------------- the contract


@pytest.mark.parametrize("how", ["glob", "filter", "every-name"])
def test_catch_all_hook_returning_none_is_bit_identical(ref_weights, how):
    base = decode(ref_weights, TOKENS)
    hooks = Hooks()
    if how == "glob":
        hooks.add("*", lambda v, *, hook: None)
    elif how == "filter":
        hooks.add(names_filter=lambda n: True, fn=lambda v, *, hook: None)
    else:
        for n in hook_names(ref_weights):
            hooks.add(n, lambda v, *, hook: None)
    got = decode(ref_weights, TOKENS, hooks)
    assert np.array_equal(got, base)


def _changed(value, num_experts: int):
    """A different value of the same shape and kind: other expert ids, or a non-uniform rescaling (a
    uniform one could cancel in a norm downstream, e.g. the latent MoE's RMSNorm)."""
    if value.dtype.kind in "iu":
        return (value + 1) % num_experts
    pattern = 1.0 + 0.5 * np.cos(np.arange(value.size)).reshape(value.shape)
    return (value * pattern).astype(value.dtype)


def test_every_site_honours_a_returned_value(ref_weights):
    """The hook contract, site by site: a hook that returns a changed value at any name of hook_names
    changes what comes after (here: the logits of the token or the next ones); none is dropped."""
    tokens = TOKENS[:3]
    base = decode(ref_weights, tokens)
    E = ref_weights.config.num_experts
    dropped = []
    for name in hook_names(ref_weights):
        hooks = Hooks().bind(ref_weights)
        hooks.add(name, lambda v, *, hook: _changed(v, E) if hook.position == 1 else None)
        got = decode(ref_weights, tokens, hooks)
        np.testing.assert_array_equal(got[0], base[0], err_msg=name)  # token 0 untouched
        if not np.abs(got[1:] - base[1:]).max() > 1e-5:
            dropped.append(name)
    assert dropped == []


def test_returned_array_replaces_the_value_downstream(ref_weights):
    x = np.linspace(-1, 1, ref_weights.config.hidden_size).astype(np.float32)
    hooks = Hooks()
    hooks.add("final.hidden", lambda v, *, hook: x)
    logits = decode(ref_weights, TOKENS[:1], hooks)[0]
    np.testing.assert_array_equal(logits, ref_weights.lm_head @ x)  # lm_head applied to OUR hidden


def test_hooks_on_one_site_chain_in_order(ref_weights):
    order = []

    def plus(k):
        def fn(v, *, hook):
            order.append(k)
            return v + k

        return fn

    hooks = Hooks()
    hooks.add("logits", plus(1))
    hooks.add("logits", plus(10))
    base = decode(ref_weights, TOKENS[:1])[0]
    got = decode(ref_weights, TOKENS[:1], hooks)[0]
    assert order == [1, 10]
    np.testing.assert_array_equal(got, (base + 1) + 10)


def test_hook_point_fields_and_positions(ref_weights):
    seen = Seen()
    hooks = Hooks()
    hooks.add("layers.*.moe.router.topk_ids", seen)
    hooks.add("final.hidden", seen)
    decode(ref_weights, TOKENS[:3], hooks)
    per_token = 13 + 1
    assert len(seen.calls) == 3 * per_token
    assert seen.calls[0] == ("layers.1.moe.router.topk_ids", 1, "moe.router.topk_ids", 0)
    assert seen.calls[per_token - 1] == ("final.hidden", None, "final.hidden", 0)
    assert [c[3] for c in seen.calls[::per_token]] == [0, 1, 2]
    assert [c[1] for c in seen.calls[:13]] == list(range(1, 14))
    hooks.begin_token(99, position=40)  # a driver (Session) may set the position explicitly
    decode(ref_weights, TOKENS[:1], hooks)
    assert seen.calls[-1][3] == 40 and hooks.token_id == 99
    p = HookPoint("layers.12.attn_res.ffn.weights")
    assert (p.layer, p.kind, p.position) == (12, "attn_res.ffn.weights", None)


def test_add_after_firing_takes_effect_and_remove_works(ref_weights):
    hooks, seen = Hooks(), Seen()
    decode(ref_weights, TOKENS[:1], hooks)  # resolution cached with nothing attached
    h = hooks.add("logits", seen)
    decode(ref_weights, TOKENS[:1], hooks)
    assert len(seen.calls) == 1
    h.remove()
    decode(ref_weights, TOKENS[:1], hooks)
    assert len(seen.calls) == 1
    hooks.add("logits", seen)
    assert hooks.remove(seen) == 1 and len(hooks) == 0
    hooks.add("layers.*.attn.in", seen)
    assert hooks.remove("layers.*.attn.in") == 1
    hooks.add("logits", seen)
    hooks.clear()
    assert len(hooks) == 0


def test_context_managers_remove_their_hooks(ref_weights):
    hooks, seen = Hooks(), Seen()
    hooks.add("embed", seen)
    with hooks.hooked("logits", seen):
        decode(ref_weights, TOKENS[:1], hooks)
    assert [c[0] for c in seen.calls] == ["embed", "logits"]
    with hooks:
        hooks.add("final.hidden", seen)
        hooks.add("final.hidden", seen)
        assert len(hooks) == 3
    assert len(hooks) == 1
    with Hooks() as fresh:
        fresh.add("logits", seen)
        assert len(fresh) == 1
    assert len(fresh) == 0


def test_hook_chain_feeds_each_set_the_previous_value(ref_weights):
    a, b = Hooks(), Hooks()
    a.add("logits", lambda v, *, hook: v * 2)
    got = []
    b.add("logits", lambda v, *, hook: got.append(v.copy()))
    base = decode(ref_weights, TOKENS[:1])[0]
    out = decode(ref_weights, TOKENS[:1], HookChain(a, b))[0]
    np.testing.assert_array_equal(out, base * 2)
    np.testing.assert_array_equal(got[0], base * 2)


def test_merging_hook_sets(ref_weights):
    a, b = Hooks(), Hooks()
    a.add("logits", lambda v, *, hook: v + 1)
    b.add("logits", lambda v, *, hook: v * 3)
    base = decode(ref_weights, TOKENS[:1])[0]
    np.testing.assert_array_equal(decode(ref_weights, TOKENS[:1], a + b)[0], (base + 1) * 3)
    c = Hooks()
    c.extend(b)
    c.extend(a)
    np.testing.assert_array_equal(decode(ref_weights, TOKENS[:1], c)[0], base * 3 + 1)


# ---------------------------------------------------------------- names are checked


@pytest.mark.parametrize("bad", ["layers.3.kda.stat", "logit", "layers.*.kda.stat", "layers.x.attn.in", "final.*.norm"])
def test_typos_raise_at_add_even_unbound(bad):
    with pytest.raises(ValueError, match="hook"):
        Hooks().add(bad, lambda v, *, hook: None)


def test_typo_message_suggests_the_site():
    with pytest.raises(ValueError, match=r"layers\.3\.kda\.state"):
        Hooks().add("layers.3.kda.stat", lambda v, *, hook: None)


def test_bound_hooks_reject_names_this_model_does_not_fire(ref_weights):
    hooks = Hooks().bind(ref_weights)
    with pytest.raises(ValueError, match="layer 2 has the sites"):  # layer 2 is MLA
        hooks.add("layers.2.kda.q", lambda v, *, hook: None)
    with pytest.raises(ValueError, match="not loaded"):
        hooks.add("layers.20.attn.in", lambda v, *, hook: None)
    with pytest.raises(ValueError, match="matches none"):
        hooks.add("layers.0.moe.*", lambda v, *, hook: None)  # layer 0 is dense
    with pytest.raises(ValueError, match="accepts none"):
        hooks.add(names_filter=lambda n: n.endswith(".nothing"), fn=lambda v, *, hook: None)
    hooks.add("layers.2.mla.probs", lambda v, *, hook: None)  # fine
    # binding checks hooks added before
    early = Hooks()
    early.add("layers.2.kda.state", lambda v, *, hook: None)
    with pytest.raises(ValueError, match="layers.2.kda.state"):
        early.bind(ref_weights)


def test_unbound_hook_on_a_missing_site_warns_after_the_first_token(ref_weights):
    hooks = Hooks()
    hooks.add("layers.2.kda.q", lambda v, *, hook: None)  # valid grammar, but layer 2 is MLA here
    with pytest.warns(UserWarning, match="never fired"):
        decode(ref_weights, TOKENS[:1], hooks)


def test_bad_hook_returns_are_reported(ref_weights):
    hooks = Hooks()
    hooks.add("layers.3.attn.out", lambda v, *, hook: v[:5])
    with pytest.raises(ValueError, match=r"layers\.3\.attn\.out.*shape \(5,\).*\(64,\)"):
        decode(ref_weights, TOKENS[:1], hooks)
    hooks = Hooks()
    hooks.add("final.hidden", lambda v, *, hook: list(v))
    with pytest.raises(TypeError, match="final.hidden"):
        decode(ref_weights, TOKENS[:1], hooks)
    with pytest.raises(TypeError, match="callable"):
        Hooks().add("logits", "not a function")


@pytest.mark.parametrize("chunks", [False, True])
@pytest.mark.parametrize("site, dtype", [("logits", np.float64), ("logits", np.int64), ("layers.1.attn.in", np.complex64)])
def test_a_replacement_of_another_dtype_is_refused(ref_weights, site, dtype, chunks):
    """float64 logits made the session's own file unloadable; int logits ran; complex lost its imaginary part in chunks
    and failed deep in NumPy when stepping: each is refused at once, naming the hook and the site."""
    hooks = Hooks()
    hooks.add(site, lambda v, *, hook: v.astype(dtype), chunks=chunks)
    with pytest.raises(TypeError, match=f"{re.escape(site)}' returned dtype {np.dtype(dtype)}; this site's value is float32"):
        ke.kimi_forward_sequence(ref_weights, ref_weights.new_state(), TOKENS[:3], hooks)
    if not chunks:
        with pytest.raises(TypeError, match=f"{re.escape(site)}' returned dtype {np.dtype(dtype)}"):
            decode(ref_weights, TOKENS[:1], hooks)


class DeviceArray:
    """Stands in for a CuPy array (the check goes by the type's module): what a hook on a host model must not return."""

    __module__ = "cupy._core.core"

    def __init__(self, a):
        self.shape = a.shape


def test_a_replacement_on_the_wrong_device_is_reported(ref_weights):
    hooks = Hooks()
    hooks.add("layers.2.attn.out", lambda v, *, hook: DeviceArray(v))
    with pytest.raises(TypeError, match=r"layers\.2\.attn\.out.*returned a CuPy \(GPU\) array, but this site's value is a host"):
        decode(ref_weights, TOKENS[:1], hooks)


def test_sites_bound_per_layer_fire_exactly_the_listened_names(ref_weights):
    """The token form fires a site only where something listens (`model.sites.site_table`): a plain object with
    `fire` (and an unrelated `sites` attribute, as a timing helper may have) sees every name of
    `hook_names` in firing order; a bound Hooks runs its hook at exactly its two names; a HookChain of both
    gives the plain object every name again."""

    class Plain:
        sites = {"embed": "start"}  # not the binding protocol: must be ignored

        def __init__(self):
            self.seen = []

        def fire(self, name, value):
            self.seen.append(name)
            return value

    names = hook_names(ref_weights)
    plain = Plain()
    kimi_forward_token(ref_weights, KimiDecodeState.new(ref_weights), 5, hooks=plain)
    assert plain.seen == names
    hooks, hit = Hooks().bind(ref_weights), []
    hooks.add("layers.4.kda.q", lambda v, hook: hit.append(hook.name))
    hooks.add("layers.2.mla.probs", lambda v, hook: hit.append(hook.name))
    kimi_forward_token(ref_weights, KimiDecodeState.new(ref_weights), 5, hooks=hooks)
    assert hit == ["layers.2.mla.probs", "layers.4.kda.q"]
    plain, hit[:] = Plain(), []
    kimi_forward_token(ref_weights, KimiDecodeState.new(ref_weights), 5, hooks=HookChain(hooks, plain))
    assert plain.seen == names and hit == ["layers.2.mla.probs", "layers.4.kda.q"]
