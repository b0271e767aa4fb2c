"""Explorer behaviour in plain pytest (no browser): Step grows the session and updates every view,
Back restores exactly, slider moves never run the model, the ablation forks and leaves the main
session untouched and matches an independent intervened decode."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kimi_explore import Session, interventions
from kimi_explore.tokenizer import ByteTokenizer
from kimi_explore.views.widgets import TABS, Explorer, parse_experts, parse_ids, rerun, rerun_token

PROMPT = "Hi K3!"


@pytest.fixture
def explorer(tiny_weights):
    return Explorer(Session(tiny_weights, tokenizer=ByteTokenizer()), prompt=PROMPT, dpi=40)


def tab_images(ex: Explorer) -> dict[str, bytes]:
    """Select each tab in turn (as a user would) and collect every view's PNG bytes."""
    out = {}
    for tab in range(len(TABS)):
        ex.tabs.selected_index = tab
        for name, img in ex.views.items():
            if img.value and name != "ablation":
                out[name] = bytes(img.value)
    return out


def state_arrays(session) -> list[np.ndarray]:
    out = []
    for ls in session.state.layers:
        for f in dataclasses.fields(ls.attention):
            v = getattr(ls.attention, f.name)
            out.append(np.array(v, copy=True) if hasattr(v, "shape") else np.array(v))
    return out


def assert_same_state(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_parsers():
    assert parse_ids(" 17, 203,5,") == [17, 203, 5]
    with pytest.raises(ValueError, match="'x' is not an integer"):
        parse_ids("1,x")
    assert parse_experts("all", [1, 2]) == "all"
    assert parse_experts("chosen", np.array([4, 1, -1])) == [4, 1]
    assert parse_experts("3, 7", []) == [3, 7]


def test_step_grows_the_session_and_updates_every_view(explorer):
    ex, s = explorer, explorer.session
    assert len(s) == 0 and "Step feeds 'H'" in ex.status.value
    ex.step_button.click()
    ex.step_button.click()
    assert s.tokens == list(b"Hi")
    before = tab_images(ex)
    assert set(before) == {"block_residual_token", "block_residual_layer", "kda_overview", "kda_layer", "moe_token",
                           "moe_layer", "predictions"}
    ex.tabs.selected_index = 0
    ex.step_button.click()
    assert s.tokens == list(b"Hi ") and len(s.logits) == 3
    assert (ex.token.max, ex.token.value) == (2, 2)
    assert "<code>2 ' '</code>" in ex.token_label.value
    after = tab_images(ex)
    changed = {k for k in before if after[k] != before[k]}
    assert changed == set(before), f"views not updated by Step: {set(before) - changed}"


def test_only_the_visible_tab_is_drawn_and_slider_moves_reuse_the_cache(explorer, monkeypatch):
    ex, s = explorer, explorer.session
    for _ in range(2):
        ex.step_button.click()
    drawn = ex.renders
    ex.tabs.selected_index = 2  # MoE tab: two new figures, nothing else
    assert ex.renders == drawn + 2
    shown = bytes(ex.views["moe_token"].value)

    def no_model(*a, **k):
        raise AssertionError("a slider move ran the model")

    monkeypatch.setattr(s, "step", no_model)
    ex.token.value = 0  # new token for this tab: one figure (the per-layer view is unchanged)
    assert ex.renders == drawn + 3
    assert bytes(ex.views["moe_token"].value) != shown
    ex.token.value = 1  # back to a token already drawn: from the cache
    assert ex.renders == drawn + 3
    assert bytes(ex.views["moe_token"].value) == shown


def test_layer_selector_and_notes_for_layers_without_a_view(explorer):
    ex = explorer
    ex.step_button.click()
    ex.tabs.selected_index = 1
    ex.layer.value = 3  # an MLA layer: no recurrent state to show
    assert "MLA layer" in ex.notes["kda_layer"].value and ex.views["kda_layer"].layout.display == "none"
    ex.layer.value = 1
    assert ex.notes["kda_layer"].value == "" and ex.views["kda_layer"].value
    ex.tabs.selected_index = 2
    ex.layer.value = 0  # layer 0 is dense
    assert "dense FFN" in ex.notes["moe_layer"].value


def test_back_restores_exactly(explorer):
    ex, s = explorer, explorer.session
    for _ in range(3):
        ex.step_button.click()
    assert ex.renders == 6  # two figures per Step (the visible tab), nothing else
    ex.tabs.selected_index = 3  # from here on only the (one-figure) Predictions tab is drawn
    tokens, logits, state = s.tokens, s.logits, state_arrays(s)
    trace = s.trace()
    images = {"predictions": bytes(ex.views["predictions"].value)}  # the visible tab
    ex.step_button.click()
    fourth = s.logits[-1]
    assert len(s) == 4
    ex.back_button.click()
    assert s.tokens == tokens
    np.testing.assert_array_equal(s.logits, logits)
    assert_same_state(state_arrays(s), state)
    assert s.trace().equals(trace)
    assert (ex.token.max, ex.token.value) == (2, 2)
    # the views are those of the same history again (redrawn after the cache was dropped: same pixels)
    assert {k: bytes(ex.views[k].value) for k in images} == images
    ex.step_button.click()
    np.testing.assert_array_equal(s.logits[-1], fourth)  # re-stepping is bit-identical
    ex.reset_button.click()
    assert len(s) == 0 and ex.back_button.disabled


def test_play_feeds_the_prompt_then_generates(explorer):
    ex, s = explorer, explorer.session
    ex.tabs.selected_index = 3  # the cheapest tab to draw: views are not under test here
    ex.play_button.click()
    assert s.tokens == list(PROMPT.encode())
    assert "prompt done" in ex.status.value
    ex.play_button.click()
    assert len(s) == len(PROMPT) + ex.play_tokens
    greedy = [int(np.argmax(row)) for row in s.logits[len(PROMPT) - 1:-1]]
    assert s.tokens[len(PROMPT):] == greedy


def test_ids_mode_and_bad_input(tiny_weights):
    s = Session(tiny_weights)  # no tokenizer: ids only, labels are ids
    ex = Explorer(s, prompt=[72, 105], dpi=40)
    assert ex.mode.options == ("ids",) and ex.prompt.value == "72, 105"
    ex.step_button.click()
    assert s.tokens == [72] and "<code>0 #72</code>" in ex.token_label.value
    ex.prompt.value = "72, x"
    assert "'x' is not an integer" in ex.status.value
    ex.step_button.click()
    assert s.tokens == [72]  # nothing decoded from a bad prompt
    ex.prompt.value = ""
    ex.step_button.click()  # prompt exhausted: continue greedily from the last logits
    assert s.tokens == [72, int(np.argmax(s.logits[0]))]


def test_ablation_forks_without_touching_the_main_session(explorer, tiny_weights):
    ex, s = explorer, explorer.session
    ex.tabs.selected_index = 3  # the Predictions tab, where the ablation control lives
    for _ in range(4):
        ex.step_button.click()
    tokens, logits, state, trace = s.tokens, s.logits, state_arrays(s), s.trace()
    ex.token.value, ex.layer.value, ex.experts.value = 2, 5, "chosen"
    chosen = [int(e) for e in trace.routing()["topk_ids"][2, trace.routing()["moe_layers"].index(5)]]
    ablated = ex.ablate()
    # the main session is exactly as it was
    assert s.tokens == tokens
    np.testing.assert_array_equal(s.logits, logits)
    assert_same_state(state_arrays(s), state)
    assert s.trace().equals(trace)
    assert ex.views["ablation"].value and "forked at token 2" in ex.notes["ablation"].value
    # an independent run: a fresh session fed tokens 0..1, then token 2 without the chosen experts
    ref = Session(tiny_weights, recorder=False)
    ref.feed(tokens[:2])
    with ref.intervene(interventions.ablate_experts(5, chosen)):
        expected = ref.step(tokens[2])
    np.testing.assert_allclose(ablated, expected, rtol=0, atol=1e-6)
    assert np.abs(ablated - logits[2]).max() > 1e-4  # dropping every chosen expert changes the prediction


def test_ablation_control_errors(explorer):
    ex = explorer
    ex.step_button.click()
    ex.layer.value = 0
    assert ex.ablate() is None and "dense FFN" in ex.notes["ablation"].value
    ex.layer.value, ex.experts.value = 5, "3, x"
    assert ex.ablate() is None and "'x' is not an integer" in ex.notes["ablation"].value


def test_rerun_replays_on_a_fork_with_the_intervention(tiny_weights):
    tok = ByteTokenizer()
    s = Session(tiny_weights, tokenizer=tok)
    s.feed(tok.encode("abcde"))
    tokens, logits, state = s.tokens, s.logits, state_arrays(s)
    fork = rerun(s, interventions.zero_kda_head(1, 2), start=1)
    assert s.tokens == tokens  # untouched
    np.testing.assert_array_equal(s.logits, logits)
    assert_same_state(state_arrays(s), state)
    ref = Session(tiny_weights, recorder=False)
    ref.step(tokens[0])
    with ref.intervene(interventions.zero_kda_head(1, 2)):
        ref.feed(tokens[1:])
    np.testing.assert_allclose(fork.logits, ref.logits, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(fork.logits[0], logits[0])  # before `start` nothing changes
    assert np.abs(fork.logits[-1] - logits[-1]).max() > 1e-4
    norms = fork.trace()["layers.1.kda.state.norm"]
    assert np.all(norms[1:, 2] == 0) and norms[0, 2] > 0  # the head is silenced from `start` on
    np.testing.assert_array_equal(rerun_token(s, 4, interventions.zero_kda_head(1, 2)), rerun(
        s, interventions.zero_kda_head(1, 2), start=4).logits[-1])
    with pytest.raises(IndexError, match="0 <= start < stop <= 5"):
        rerun(s, start=5)


def test_views_of_hidden_tabs_are_hidden_until_redrawn(explorer):
    """After a Step, a hidden tab's picture belongs to an older token: it must not show until redrawn."""
    ex = explorer
    assert all(img.layout.display == "none" for img in ex.views.values())  # nothing to show yet
    ex.step_button.click()
    ex.refresh_all()
    assert all(ex.views[n].layout.display is None for n in ex.views if n != "ablation")
    assert ex.views["ablation"].layout.display == "none"  # no broken-image icon before an ablation ran
    ex.step_button.click()  # the Block residuals tab is visible
    assert ex.views["block_residual_token"].layout.display is None
    assert ex.views["kda_overview"].layout.display == "none" and ex.views["moe_token"].layout.display == "none"
    ex.tabs.selected_index = 1
    assert ex.views["kda_overview"].layout.display is None
    assert ex.token_label.value == "<code>1 'i'</code>"


def test_constructor_options(tiny_weights):
    s = Session(tiny_weights, tokenizer=ByteTokenizer())
    s.feed([72, 105])
    ex = Explorer(s, tab="Predictions", layer=6, dpi=40)
    assert ex.tabs.selected_index == 3 and ex.layer.value == 6 and ex.token.value == 1  # shows the last token
    assert ex.views["predictions"].value and not ex.views["block_residual_token"].value  # only that tab drawn
    with pytest.raises(ValueError, match="tab='Nope' is not one of"):
        Explorer(s, tab="Nope")
    with pytest.raises(ValueError, match="layer=99 is not loaded"):
        Explorer(s, layer=99)


def test_labels_are_escaped_and_ids_checked(tiny_weights):
    s = Session(tiny_weights, tokenizer=ByteTokenizer())
    ex = Explorer(s, prompt="<b>", dpi=40)
    ex.tabs.selected_index = 3
    ex.step_button.click()
    assert ex.token_label.value == "<code>0 '&lt;'</code>" and "Step feeds 'b'" in ex.status.value
    ex.mode.value, ex.prompt.value = "ids", "60, 256"
    assert "token ids [256] are outside the vocabulary (0..255)" in ex.status.value
