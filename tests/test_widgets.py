"""Explorer behaviour in plain pytest (no browser): Step grows the session and updates every view of the
open tab in place, selection is shared by every view, Back restores exactly, a new prompt starts over,
the ablation forks, leaves the main session untouched, matches an independent intervened decode, and
never shows a result that no longer matches what is selected."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore import Session, interventions
from kimi_explore.tokenizer import ByteTokenizer
from kimi_explore.views.explorer.widgets import BUSY, TABS, Explorer, parse_experts, parse_ids, rerun, rerun_token

PROMPT = "Hi K3!"
TAB_OF = {"block_token": 0, "block_layer": 0, "kda_token": 1, "kda_layer": 1, "moe_topk": 2, "moe_layers": 2,
          "moe_sorted": 2, "moe_top": 2, "expert_search": 2, "moe_full": 2, "predictions": 3, "lens": 4,
          "attribution": 4}


@pytest.fixture
def explorer(tiny_weights):
    return Explorer(Session(tiny_weights, tokenizer=ByteTokenizer()), prompt=PROMPT)


def shown(ex: Explorer) -> dict[str, dict]:
    """name -> layout.meta of every view that has content."""
    return {name: v.meta for name, v in ex.views.items() if v.spec}


def click(view, **point) -> None:
    """What the browser sends when a point of a plot is clicked."""
    view._on_msg(view, {"event": "click", "curve": 0, "index": None, **point}, [])


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
    with pytest.raises(ValueError, match=r"^experts: 'x' is not an integer.*'chosen' or 'all'"):
        parse_experts("3, x", [])
    with pytest.raises(ValueError, match=r"experts \[16\] do not exist: expert ids run 0..15"):
        parse_experts("3, 16", [], n_experts=16)


def test_step_updates_every_view_of_the_open_tab_in_place(explorer):
    ex, s = explorer, explorer.session
    assert len(s) == 0 and "Step feeds 'H'" in ex.status.value and not shown(ex)
    ex.step_button.click()
    ex.step_button.click()
    assert s.tokens == list(b"Hi")
    assert set(shown(ex)) == {"block_token", "block_layer"}  # only the open tab is drawn
    views = dict(ex.views)
    revs = {n: ex.views[n].rev for n in ("block_token", "block_layer")}
    ex.step_button.click()
    assert ex.views == views  # the same widgets: their data changed, not the figures
    assert all(ex.views[n].rev > revs[n] for n in revs)
    assert all(m == {"token": 2, "layer": ex.layer.value, "tokens": 3} for m in shown(ex).values())
    for tab in range(len(TABS)):
        ex.tabs.selected_index = tab  # opening a tab brings its views up to date
    assert {n for n, m in shown(ex).items() if m["tokens"] == 3} == set(TAB_OF) - {"moe_full", "expert_search"}
    assert (ex.token.max, ex.token.value) == (2, 2) and "<code>2 ' '</code>" in ex.token_label.value
    assert ex.text.labels == ["H", "i", " "] and ex.text.selected == 2


def test_busy_indicator_while_a_step_runs(explorer, monkeypatch):
    ex, s = explorer, explorer.session
    seen = []
    real = s.step
    monkeypatch.setattr(s, "step", lambda tid: seen.append(ex.busy.value) or real(tid))
    ex.step_button.click()
    assert seen == [BUSY] and ex.busy.value == ""


def test_default_layer_has_something_in_every_view(explorer):
    ex = explorer
    assert ex.layer.value in ex.kda_layers and ex.layer.value in ex.moe_layers
    assert ex.layer.value == max(set(ex.kda_layers) & set(ex.moe_layers))


def test_a_click_selects_a_token_or_a_layer_in_every_view(explorer):
    ex = explorer
    for _ in range(4):
        ex.step()
    kda = ex.kda_layers[0]
    click(ex.views["block_layer"], x="1 'i'", y="current")
    assert ex.token.value == 1 and ex.text.selected == 1
    click(ex.views["block_token"], x=f"{kda} KDA", y="current")
    assert ex.layer.value == kda
    assert all(m["token"] == 1 and m["layer"] == kda for m in shown(ex).values())
    ex.tabs.selected_index = 2
    moe = ex.moe_layers[-1]
    click(ex.views["moe_topk"], x="1", y=f"{moe} MLA")
    assert ex.layer.value == moe and all(m["layer"] == moe for n, m in shown(ex).items() if TAB_OF[n] == 2)
    ex.text.selected = 3  # a click on a token of the text
    assert ex.token.value == 3 and all(m["token"] == 3 for n, m in shown(ex).items() if TAB_OF[n] == 2)
    click(ex.views["block_token"], x="output", y="current")  # the final-mix column has no layer: nothing happens
    assert ex.layer.value == moe


def test_new_prompt_starts_over_from_the_shared_prefix(explorer):
    ex, s = explorer, explorer.session
    for _ in range(4):
        ex.step()
    ex.prompt.value = "Hi there"
    assert "new prompt: Step starts over from the 3 tokens it shares" in ex.status.value  # 'Hi '
    ex.step()
    assert s.tokens == list(b"Hi t") and "truncated to the 3 tokens" in ex.status.value
    ex.prompt.value = "The quick brown fox"
    ex.step()
    assert s.tokens == list(b"T") and ex.text.labels == ["T"]
    ex.play()
    assert s.tokens == list(b"The quick brown fox")
    ex.play()  # prompt done: generate, the continuation is kept on the next Step
    assert len(s) == 19 + ex.play_tokens and ex.text.generated_from == 19
    ex.step()
    assert len(s) == 20 + ex.play_tokens


def test_mode_toggle_converts_the_prompt(explorer):
    ex = explorer
    ex.mode.value = "ids"
    assert ex.prompt.value == ", ".join(str(b) for b in PROMPT.encode())
    assert "Step feeds 'H'" in ex.status.value
    ex.mode.value = "text"
    assert ex.prompt.value == PROMPT
    ex.mode.value = "ids"
    ex.prompt.value = "72, x"
    ex.mode.value = "text"  # cannot convert: stays on ids and says why
    assert ex.mode.value == "ids" and "'x' is not an integer" in ex.status.value


def test_status_line_never_wraps(explorer):
    ex = explorer
    ex.prompt.value = "x" * 500
    assert "white-space:nowrap" in ex.status.value and "text-overflow:ellipsis" in ex.status.value


def test_back_restores_exactly(explorer):
    ex, s = explorer, explorer.session
    for _ in range(3):
        ex.step_button.click()
    tokens, logits, state = s.tokens, s.logits, state_arrays(s)
    trace = s.trace()
    before = ex.views["block_token"].spec["data"]
    ex.step_button.click()
    fourth = s.logits[-1]
    ex.back_button.click()
    assert s.tokens == tokens
    np.testing.assert_array_equal(s.logits, logits)
    assert_same_state(state_arrays(s), state)
    assert s.trace().equals(trace)
    assert (ex.token.max, ex.token.value) == (2, 2)
    assert ex.views["block_token"].spec["data"] == before  # the views are those of the same history again
    ex.step_button.click()
    np.testing.assert_array_equal(s.logits[-1], fourth)  # re-stepping is bit-identical
    ex.reset_button.click()
    assert len(s) == 0 and ex.back_button.disabled and not shown(ex)


def test_play_feeds_the_prompt_then_generates(explorer):
    ex, s = explorer, explorer.session
    ex.tabs.selected_index = 3
    ex.play_button.click()
    assert s.tokens == list(PROMPT.encode()) and "prompt done" in ex.status.value
    ex.play_button.click()
    assert len(s) == len(PROMPT) + ex.play_tokens
    greedy = [int(np.argmax(row)) for row in s.logits[len(PROMPT) - 1:-1]]
    assert s.tokens[len(PROMPT):] == greedy


def test_ids_mode_and_bad_input(tiny_weights):
    s = Session(tiny_weights)  # no tokenizer: ids only, labels are ids
    ex = Explorer(s, prompt=[72, 105])
    assert ex.mode.options == ("ids",) and ex.prompt.value == "72, 105"
    ex.step_button.click()
    assert s.tokens == [72] and "<code>0 #72</code>" in ex.token_label.value
    ex.prompt.value = "72, x"
    assert "token ids: 'x' is not an integer" in ex.status.value
    ex.step_button.click()
    assert s.tokens == [72]  # nothing decoded from a bad prompt
    ex.prompt.value = ""
    ex.step_button.click()  # an empty prompt: continue greedily from the last logits
    assert s.tokens == [72, int(np.argmax(s.logits[0]))]


def test_ablation_forks_without_touching_the_main_session(explorer, tiny_weights):
    ex, s = explorer, explorer.session
    ex.tabs.selected_index = 3
    for _ in range(4):
        ex.step_button.click()
    tokens, logits, state, trace = s.tokens, s.logits, state_arrays(s), s.trace()
    layer = ex.moe_layers[1]
    ex.token.value, ex.layer.value, ex.ablation.experts.value = 2, layer, "chosen"
    r = trace.routing()
    chosen = [int(e) for e in r["topk_ids"][2, r["moe_layers"].index(layer)]]
    ablated = ex.ablate()
    assert s.tokens == tokens
    np.testing.assert_array_equal(s.logits, logits)
    assert_same_state(state_arrays(s), state)
    assert s.trace().equals(trace)
    assert ex.ablation.view.spec and "forked at token 2" in ex.ablation.note.value
    ref = Session(tiny_weights, recorder=False)
    for t in tokens[:2]:  # stepped, as the Explorer stepped them
        ref.step(t)
    with ref.intervene(interventions.ablate_experts(layer, chosen)):
        expected = ref.step(tokens[2])
    np.testing.assert_allclose(ablated, expected, rtol=0, atol=1e-6)
    assert np.abs(ablated - logits[2]).max() > 1e-4
    # the result goes as soon as it no longer matches what is selected
    ex.token.value = 1
    assert not ex.ablation.view.spec and ex.ablation.note.value == ""


def test_ablation_messages_and_stale_results(explorer):
    ex = explorer
    ex.step_button.click()
    ex.step_button.click()
    layer = ex.moe_layers[0]
    ex.layer.value = layer
    assert ex.ablate() is not None and ex.ablation.view.spec
    ex.ablation.experts.value = "3, x"  # an edit clears the old result; the error names the field
    assert not ex.ablation.view.spec
    assert ex.ablate() is None and "experts: 'x' is not an integer" in ex.ablation.note.value
    assert "token ids" not in ex.ablation.note.value
    ex.ablation.experts.value = "chosen"
    ex.ablate()
    dense = next(i for i in ex.session.weights.layer_ids if i not in ex.moe_layers)
    ex.layer.value = dense
    assert not ex.ablation.view.spec
    assert ex.ablate() is None and "dense FFN" in ex.ablation.note.value and not ex.ablation.view.spec
    ex.layer.value = layer
    r = ex.trace().routing()
    chosen = {int(e) for e in r["topk_ids"][1, r["moe_layers"].index(layer)]}
    other = next(e for e in range(ex.session.weights.config.num_experts) if e not in chosen)
    ex.ablation.experts.value = str(other)
    ex.ablate()
    assert "did not choose" in ex.ablation.note.value and "KL = 0" in ex.ablation.note.value
    assert ex.ablation.button.layout.width == "auto"  # the label is never cut


def test_rerun_replays_on_a_fork_with_the_intervention(tiny_weights):
    tok = ByteTokenizer()
    s = Session(tiny_weights, tokenizer=tok)
    s.feed(tok.encode("abcde"))
    tokens, logits, state = s.tokens, s.logits, state_arrays(s)
    fork = rerun(s, interventions.zero_kda_head(1, 2), start=1)
    assert s.tokens == tokens
    np.testing.assert_array_equal(s.logits, logits)
    assert_same_state(state_arrays(s), state)
    ref = Session(tiny_weights, recorder=False)
    ref.feed(tokens[:1])  # the fork replays the cut chunk [0, 1) on the sequence path
    with ref.intervene(interventions.zero_kda_head(1, 2)):
        ref.feed(tokens[1:])
    np.testing.assert_allclose(fork.logits[1:], ref.logits[1:], rtol=0, atol=1e-6)  # [0]: kept from the 5-token chunk
    np.testing.assert_array_equal(fork.logits[0], logits[0])
    assert np.abs(fork.logits[-1] - logits[-1]).max() > 1e-4
    norms = fork.trace()["layers.1.kda.state.norm"]
    assert np.all(norms[1:, 2] == 0) and norms[0, 2] > 0
    np.testing.assert_array_equal(rerun_token(s, 4, interventions.zero_kda_head(1, 2)), rerun(
        s, interventions.zero_kda_head(1, 2), start=4).logits[-1])
    with pytest.raises(IndexError, match="0 <= start < stop <= 5"):
        rerun(s, start=5)


def test_constructor_options(tiny_weights):
    with pytest.raises(ValueError, match="records nothing"):  # else Step decoded a token, then raised in the views
        Explorer(Session(tiny_weights, recorder=False))
    s = Session(tiny_weights, tokenizer=ByteTokenizer())
    s.feed([72, 105])
    ex = Explorer(s, tab="Predictions", layer=6)
    assert ex.tabs.selected_index == 3 and ex.layer.value == 6 and ex.token.value == 1
    assert ex.views["predictions"].spec and not ex.views["block_token"].spec  # only that tab drawn
    with pytest.raises(ValueError, match="tab='Nope' is not one of"):
        Explorer(s, tab="Nope")
    with pytest.raises(ValueError, match="layer=99 is not loaded"):
        Explorer(s, layer=99)


def test_text_measures_and_labels_are_escaped(tiny_weights):
    s = Session(tiny_weights, tokenizer=ByteTokenizer())
    ex = Explorer(s, prompt="<b>")
    ex.tabs.selected_index = 3
    ex.step_button.click()
    ex.step_button.click()
    assert ex.token_label.value == "<code>1 'b'</code>" and "Step feeds '&gt;'" in ex.status.value
    assert ex.text.labels == ["<", "b"]  # the strip sets textContent: no HTML is interpreted
    for measure in ("surprisal", "routing entropy", "embedding weight", "KDA state change"):
        ex.measure.value = measure
        assert len(ex.text.colors) == 2 and measure in ex.text.titles[1]
    ex.measure.value = "surprisal"
    assert ex.text.colors[0] == "transparent"  # no surprisal for the first token
    ex.mode.value, ex.prompt.value = "ids", "60, 256"
    assert "token ids [256] are outside the vocabulary (0..255)" in ex.status.value


def view_spec(ex: Explorer, name: str) -> tuple[list, dict]:
    spec = ex.views[name].spec
    return spec["data"], spec["layout"]


def decode(spec: dict) -> np.ndarray:
    """A plotly.js typed-array spec (dtype, base64 bytes, shape) back to an array."""
    import base64

    dtypes = {"f4": np.float32, "f8": np.float64, "i4": np.int32, "u1": np.uint8, "u2": np.uint16, "u4": np.uint32}
    a = np.frombuffer(base64.b64decode(spec["bdata"]), dtype=dtypes[spec["dtype"]])
    return a.reshape([int(n) for n in spec["shape"].split(",")])


# mutation: the KDA-by-layer view outlined column = layer id instead of the layer's index among the KDA layers
def test_mutation_kda_view_outlines_the_selected_layers_own_column(tiny_weights):
    """The per-token KDA view has one column per KDA layer (x = "i KDA"); selecting a layer frames its column,
    whose index counts only KDA layers (the config's 1-based `kda_layers`: MLA layers have no column)."""
    la = tiny_weights.config.linear_attn_config
    kda = sorted(i - 1 for i in la.kda_layers)
    assert kda != list(range(len(kda)))  # MLA layers in between: a column index differs from the layer id
    ex = Explorer(Session(tiny_weights, tokenizer=ByteTokenizer()), prompt=PROMPT, tab="KDA state")
    for _ in range(3):
        ex.step()
    for layer in kda:
        ex.select(token=1, layer=layer)
        (heat,), layout = view_spec(ex, "kda_token")
        col = kda.index(layer)
        assert heat["x"] == [f"{i} KDA" for i in kda] and heat["x"][col] == f"{layer} KDA"
        frames = [(s["x0"], s["x1"]) for s in layout["shapes"] if s["type"] == "rect"]
        assert frames == [(col - 0.5, col + 0.5)], f"layer {layer}: column {col}"
    mla = next(i for i in tiny_weights.layer_ids if i not in kda)
    ex.select(layer=mla)
    assert [s for s in view_spec(ex, "kda_token")[1]["shapes"] if s["type"] == "rect"] == []  # no column to frame


# mutation: the MoE top-k hover showed the unbiased score as the combine weight
def test_mutation_moe_topk_hover_shows_each_experts_combine_weight_and_score(tiny_weights):
    """Every cell of the top-k view (row = MoE layer, column = slot) says its expert's combine weight (the
    router's topk_weights, as recorded) and, separately, its unbiased score; the colour is the weight."""
    ex = Explorer(Session(tiny_weights, tokenizer=ByteTokenizer()), prompt=PROMPT, tab="MoE routing")
    for _ in range(4):
        ex.step()
    t = 2
    ex.select(token=t)
    tr = ex.session.trace()
    moe = [i for i in tiny_weights.layer_ids if tiny_weights.config.is_moe_layer(i)]
    (heat,), _ = view_spec(ex, "moe_topk")
    z = decode(heat["z"])
    differ = 0
    for j, i in enumerate(moe):
        ids = tr[f"layers.{i}.moe.router.topk_ids"][t]
        weights = tr[f"layers.{i}.moe.router.topk_weights"][t].astype(np.float64)
        scores = tr[f"layers.{i}.moe.router.scores"][t].astype(np.float64)
        np.testing.assert_allclose(z[j], weights, rtol=1e-6, err_msg=f"layer {i}")
        for c, e in enumerate(ids):
            hover = heat["customdata"][j][c]
            assert f"expert <b>{e}</b>" in hover, hover
            assert f"combine weight {weights[c]:.4f}" in hover, hover
            assert f"unbiased score {scores[e]:.4f}" in hover, hover
            differ += f"{weights[c]:.4f}" != f"{scores[e]:.4f}"
    assert differ >= len(moe)  # weight and score read differently: a swap shows



def test_empty_history_hides_the_tabs_and_the_status_says_what_to_do(tiny_weights):
    ex = Explorer(Session(tiny_weights, tokenizer=ByteTokenizer()), prompt="")
    assert ex.tabs.layout.display == "none" and "type a prompt, then Step" in ex.status.value
    ex.prompt.value = "ab"
    ex.step_button.click()
    assert ex.tabs.layout.display is None and shown(ex)
    ex.prompt.value = ""  # an empty box with a history: Step goes on greedily, and says so (not "0 tokens")
    assert "no prompt: Step continues greedily" in ex.status.value and "(0 tokens)" not in ex.status.value
    ex.reset_button.click()
    assert ex.tabs.layout.display == "none" and not shown(ex)  # no blank boxes after Reset


def test_a_byte_that_is_not_text_alone_reads_the_same_in_the_text_and_the_predictions(tiny_weights):
    tok = ByteTokenizer()
    ex = Explorer(Session(tiny_weights, tokenizer=tok), prompt="é")  # two bytes, 0xC3 0xA9
    ex.step_button.click()
    ex.step_button.click()
    assert ex.text.labels == ["<0xC3>", "<0xA9>"]
    assert [tok.token_label(i) for i in (0xC3, 0xA9)] == ex.text.labels  # the predictions' labels
    assert "\ufffd" not in "".join(ex.text.labels)


def test_lens_strip_shows_ke_logit_lens_of_the_selected_token(explorer):
    ex, s = explorer, explorer.session
    for _ in range(4):
        ex.step_button.click()
    ex.tabs.selected_index = TABS.index("Lens & attribution")
    ex.select(token=2, layer=5)
    # nothing replayed until asked: the views say what Compute will do
    assert "Press Compute for token 2" in view_spec(ex, "lens")[1]["annotations"][0]["text"]
    ex.tab_views.compute_button.click()
    (heat, ring), layout = view_spec(ex, "lens")
    lens = ke.logit_lens(s, top=3)
    np.testing.assert_allclose(decode(heat["z"])[0], lens.top_probs[2, :, 0], rtol=1e-6)
    tok = ex.tokenizer
    names = [tok.token_label(int(i)) for i in lens.top_ids[2, :, 0]]
    assert heat["text"][0] == [f"x{n[3:5]}" if n.startswith("<0x") else n.replace(" ", "␣") for n in names]
    labels = heat["x"]
    same = [labels[j] for j in range(len(labels)) if lens.top_ids[2, j, 0] == lens.final_ids[2]]
    assert ring["x"] == same and labels[-1] in same  # at the last layer the lens is the model
    assert [sh["x0"] + 0.5 for sh in layout["shapes"]] == [list(s.weights.layer_ids).index(5)]
    click(ex.views["lens"], x=labels[3])
    assert ex.layer.value == s.weights.layer_ids[3]


def test_waterfall_shows_ke_logit_attribution_and_a_click_selects_the_layer(explorer):
    ex, s = explorer, explorer.session
    for _ in range(4):
        ex.step_button.click()
    ex.tabs.selected_index = TABS.index("Lens & attribution")
    ex.tab_views.auto_analyses.value = True  # computed on every selection
    ex.select(token=1)
    (bar,), layout = view_spec(ex, "attribution")
    attr = ke.logit_attribution(s, 1, token=s.tokens[2])  # the token that was fed next
    leaves = list(attr.contributions.items())
    top = len(bar["y"]) - 2
    assert bar["y"][:top] == [k for k, _ in leaves[:top]] and bar["y"][-1] == "logit"
    np.testing.assert_allclose(bar["x"][:top], [v for _, v in leaves[:top]], rtol=1e-9)
    np.testing.assert_allclose(bar["x"][top], sum(v for _, v in leaves[top:]), rtol=1e-9, atol=1e-12)
    assert bar["x"][-1] == pytest.approx(attr.logit) and bar["measure"][-1] == "total"
    leaf = next(k for k in bar["y"] if k.startswith("layers.") and not k.startswith(f"layers.{ex.layer.value}."))
    click(ex.views["attribution"], y=leaf)
    assert ex.layer.value == int(leaf.split(".")[1])
    click(ex.views["attribution"], y=bar["y"][top])  # 'other leaves (n)': no layer, nothing happens
    assert ex.layer.value == int(leaf.split(".")[1])


@pytest.mark.parametrize("what,ids,layers,scope", [("experts", "chosen", "all", "from this token on"),
                                                   ("KDA heads", "1", "this", "all tokens")])
def test_ablation_run_diff_is_ke_diff_of_a_hand_built_run(explorer, tiny_weights, what, ids, layers, scope):
    ex, s = explorer, explorer.session
    ex.tabs.selected_index = TABS.index("Predictions")
    for _ in range(5):
        ex.step_button.click()
    t = 2
    ex.select(token=t, layer=ex.kda_layers[1] if what == "KDA heads" else ex.moe_layers[1])
    ex.ablation.what.value = what
    ex.ablation.experts.value, ex.ablation.layers.value, ex.ablation.scope.value = ids, layers, scope
    tokens = list(s.tokens)
    ablated = ex.ablate()
    assert s.tokens == tokens  # the session is untouched
    if what == "experts":
        r = s.trace().routing()
        hooks = [interventions.ablate_experts(i, [int(e) for e in r["topk_ids"][t, j] if e >= 0], list(range(t, 5)))
                 for j, i in enumerate(r["moe_layers"])]
        start = t
    else:
        hooks, start = [interventions.zero_kda_head(ex.layer.value, [1])], 0
    ref = Session(tiny_weights, recorder=True)
    for tok in tokens[:start]:
        ref.step(tok)
    with ref.intervene(*hooks):
        for tok in tokens[start:]:
            ref.step(tok)
    np.testing.assert_allclose(ablated, ref.logits[t], atol=1e-6)
    d = ke.diff(s, ref)
    data, layout = ex.ablation.diff_view.spec["data"], ex.ablation.diff_view.spec["layout"]
    np.testing.assert_allclose(decode(data[0]["z"])[0], d.kl[start:], atol=1e-6)
    np.testing.assert_allclose(decode(data[1]["z"]), d.final_attn_res[start:].T, atol=1e-6)
    assert data[0]["x"][0].startswith(f"{start} ") and d.kl[start:].max() > 1e-6
    assert f"routing changes ({len(d.routing_changes)})" in layout["title"]["text"]


def test_expert_search_field_draws_where_the_expert_fires(explorer):
    ex, s = explorer, explorer.session
    ex.tabs.selected_index = TABS.index("MoE routing")
    for _ in range(3):
        ex.step_button.click()
    assert not ex.views["expert_search"].spec and ex.views["expert_search"].layout.display == "none"
    r = s.trace().routing()
    e = int(r["topk_ids"][1, 0, 0])
    ex.tab_views.expert.value = str(e)
    (hm,), layout = view_spec(ex, "expert_search")
    assert ex.views["expert_search"].layout.display is None and f"Where expert {e} fires" in layout["title"]["text"]
    assert np.isfinite(decode(hm["z"])[0, 1])  # layer moe_layers[0], token 1: chosen there
    ex.tab_views.expert.value = "x1"
    assert "is not an expert id" in ex.tab_views.expert_note.value


def test_expert_search_past_the_window_says_how_often_the_expert_fired_in_the_whole_history(tiny_weights):
    """At 60 tokens the map shows the 40 around the selection; its title adds the whole history's count (from the
    trace's routing, independently), so a window where the expert never fired says whether to look elsewhere."""
    s = Session(tiny_weights, tokenizer=ByteTokenizer())
    s.feed(list(range(65, 125)))
    ex = Explorer(s, tab="MoE routing")
    ids = np.asarray(s.trace().routing()["topk_ids"])
    e = int(ids[0, 0, 0])
    ex.tab_views.expert.value = str(e)
    ex.select(token=59)
    title = view_spec(ex, "expert_search")[1]["title"]["text"]
    hit = ids == e
    assert f"in tokens 20-59 it fired {int(hit[20:].sum())} times" in title
    assert f"in the whole history {int(hit.sum())} times at {int(hit.any(axis=(0, 2)).sum())} layers" in title


def test_snapshot_is_one_offline_page_of_the_open_tab_as_drawn(explorer, tmp_path, monkeypatch):
    import json
    import re

    ex = explorer
    for _ in range(3):
        ex.step_button.click()
    ex.tabs.selected_index = TABS.index("Block residuals")
    ex.select(token=1, layer=5)
    ex.views["block_layer"].ranges = {"xaxis2": [0.5, 2.5]}  # as the browser reports a user's pan
    path = ex.snapshot(tmp_path / "snap.html")
    page = path.read_text(encoding="utf-8")
    from kimi_explore.views.explorer.plotly_view import plotly_js_source

    assert page.count(plotly_js_source()) == 1  # plotly.js inline, once
    # nothing else could fetch anything (plotly.js itself only holds links it never follows offline)
    assert not re.search(r"(src|href)=[\"']?https?:|<link|<script src", page.replace(plotly_js_source(), ""))
    state = json.loads(re.search(r'id="kimi-state">(.*?)</script>', page).group(1))
    assert (state["token"], state["layer"], state["tab"], state["tokens"]) == (1, 5, "Block residuals", 3)
    assert state["zoom"] == {"block_layer": {"xaxis2": [0.5, 2.5]}} and state["token_ids"] == ex.session.tokens
    names = re.findall(r'data-name="([a-z_]+)"', page)
    assert names == ["block_token", "block_layer"]  # the open tab's views, nothing else
    drawn = ex.views["block_layer"].snapshot()["layout"]
    assert drawn["xaxis2"]["range"] == [0.5, 2.5] and drawn["xaxis2"]["autorange"] is False
    assert json.dumps(drawn) in page  # the page draws the view at the user's zoom
    assert json.dumps(ex.views["block_token"].spec["data"])[:500] in page
    monkeypatch.chdir(tmp_path)
    ex.snapshot_button.click()  # the button writes to the working directory and says where
    assert "snapshot written to" in ex.status.value and list(tmp_path.glob("kimi_snapshot_t1_layer5_tab0.html"))
    # written beside, then renamed: a write that fails (a full disk) leaves the earlier page whole, and no scrap
    from pathlib import Path

    write_text = Path.write_text

    def full_disk(self, text, *args, **kwargs):  # half the page gets out, then the disk is full
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        ex.snapshot(path)
    monkeypatch.undo()
    assert path.read_text(encoding="utf-8") == page and sorted(p.name for p in tmp_path.iterdir()) == [
        "kimi_snapshot_t1_layer5_tab0.html", "snap.html"]
    with pytest.raises(FileNotFoundError, match=r"nowhere/s\.html: its directory .*nowhere does not exist"):
        ex.snapshot(tmp_path / "nowhere" / "s.html")


def test_moe_tables_send_their_expert_ids_as_cell_labels_and_a_snapshot_draws_them_with_plotly(tiny_weights, tmp_path):
    """The top-k and top-by-load tables carry their expert ids in each heatmap's `text` and ask the view to
    write them into the cells (`cell_text`), not plotly's per-cell texttemplate (the slow part of a Step);
    the offline snapshot, which has no view code, asks plotly for them instead."""
    ex = Explorer(Session(tiny_weights, tokenizer=ByteTokenizer()), prompt=PROMPT, tab="MoE routing")
    for _ in range(4):
        ex.step()
    tr = ex.session.trace()
    for name in ("moe_topk", "moe_top"):
        spec = ex.views[name].spec
        (heat,), layout = spec["data"], spec["layout"]
        assert spec["cell_text"] == {"traces": [0], "size": 10} and "cell_text" not in layout
        assert "texttemplate" not in heat and len(heat["text"]) == len(heat["y"])
        drawn = ex.views[name].snapshot()["data"][0]
        assert drawn["texttemplate"] == "%{text}" and drawn["textfont"]["size"] == 10 and drawn["text"] == heat["text"]
        assert "texttemplate" not in ex.views[name].spec["data"][0]  # the live spec is untouched
    (heat,), _ = view_spec(ex, "moe_topk")
    for row, label in enumerate(heat["y"]):  # the cells name the selected token's experts, slot by slot
        ids = tr[f"layers.{int(label.split()[0])}.moe.router.topk_ids"][3]
        assert [t.rstrip("*") for t in heat["text"][row]] == [str(int(e)) for e in ids]
    page = ex.snapshot(tmp_path / "moe.html").read_text(encoding="utf-8")
    assert page.count('"texttemplate": "%{text}"') == 2  # both tables, drawn by plotly in the offline page


def test_a_step_reads_only_windows_of_the_history(tiny_weights, monkeypatch):
    """At any history length a Step builds arrays only over windows of the trace (the selected token,
    the WINDOW tokens on screen, the new token), never over the whole history: its cost does not grow
    with the history. (Fetching the Trace itself is O(records): it grows incrementally.)"""
    from kimi_explore.inspection.trace import Trace
    from kimi_explore.views.explorer import specs

    s = Session(tiny_weights, tokenizer=ByteTokenizer())
    s.feed(list(range(65, 65 + 50)))  # 50 tokens already decoded
    ex = Explorer(s, prompt=None)
    asked = []
    for name in ("attn_res_weights", "final_attn_res_weights", "kda_state_norms", "routing", "__getitem__"):
        real = getattr(Trace, name)

        def spy(self, *args, _real=real, _name=name):
            asked.append((_name, len(self)))
            return _real(self, *args)

        monkeypatch.setattr(Trace, name, spy)
    for tab in range(len(TABS) - 1):  # the analyses tab replays the history by design (lens, attribution)
        ex.tabs.selected_index = tab
        asked.clear()
        ex.step_button.click()
        assert asked and max(n for _, n in asked) <= specs.WINDOW, (TABS[tab], asked)


def test_history_cache_equals_the_whole_history_after_step_back_and_a_new_prompt(tiny_weights):
    from kimi_explore.views import summaries

    s = Session(tiny_weights, tokenizer=ByteTokenizer())
    ex = Explorer(s, prompt="abcdefgh")
    ex.tabs.selected_index = TABS.index("MoE routing")

    def check():
        tr = s.trace()
        full = summaries.token_measures(tr, ex._surprisals())
        for name, v in full.items():
            np.testing.assert_allclose(ex.history.measures[name], v, rtol=1e-12, equal_nan=True)
        stats = summaries.load_stats(tr.routing())
        np.testing.assert_array_equal(ex.history.load_stats()["counts"], stats["counts"])
        assert ex.history.load_stats()["tokens"] == len(s)

    for _ in range(5):
        ex.step_button.click()
        check()
    ex.back_button.click()
    ex.back_button.click()
    check()
    ex.prompt.value = "abX"  # shares 2 tokens: Step truncates to them, then feeds 'X'
    ex.step_button.click()
    check()
    ex.play_button.click()
    check()


def test_ablation_of_a_block_residual_source_family(explorer, tiny_weights):
    """'block sources' masks a family at the chosen layers and mixes (renormalised over the rest), on a fork;
    the result equals a session decoded with `interventions.mask_sources` by hand."""
    ex, s = explorer, explorer.session
    for _ in range(5):
        ex.step_button.click()
    logits = s.logits
    ex.token.value, ex.layer.value = 3, 4
    ex.ablation.what.value = "block sources"
    assert ex.ablation.experts.value == "current"
    ex.ablation.experts.value, ex.ablation.layers.value = "attn: embedding", "2-5"
    ablated = ex.ablation.run()
    np.testing.assert_array_equal(s.logits, logits)  # the session is untouched
    ref = Session(tiny_weights, recorder=False)
    for t in s.tokens[:3]:  # stepped, as the Explorer stepped them
        ref.step(t)
    with ref.intervene(interventions.mask_sources([2, 3, 4, 5], "attn", "embedding", 3)):
        expected = ref.step(s.tokens[3])
    np.testing.assert_allclose(ablated, expected, rtol=0, atol=1e-6)
    assert np.abs(ablated - logits[3]).max() > 1e-4
    assert "source embedding (attn mix) at [2, 3, 4, 5]" in ex.ablation.view.spec["layout"]["title"]["text"]
    ex.ablation.experts.value = "ffn: block 0"
    assert ex.ablation.run() is not None
    for bad, message in (("nope", "source family must be one of"), ("mlp: current", "site before ':'")):
        ex.ablation.experts.value = bad
        assert ex.ablation.run() is None and message in ex.ablation.note.value


def test_a_step_draws_the_moe_tab_from_the_new_history_and_sends_the_text_first(tiny_weights, monkeypatch):
    """After a Step every MoE view counts the token just decoded (the load over the whole history, from
    an independent `load_stats` of the full trace), and the page gets the slider in one message and the
    text and status before the figures: one refresh per Step, after what it reads is up to date."""
    import base64

    import ipywidgets

    from kimi_explore.views import summaries

    s = Session(tiny_weights, tokenizer=ByteTokenizer())
    ex = Explorer(s, prompt="abcdefgh", tab="MoE routing")
    sent = []
    real = ipywidgets.Widget._send
    monkeypatch.setattr(ipywidgets.Widget, "_send",
                        lambda self, msg, buffers=None: sent.append((self, set(msg.get("state", {}))))
                        or real(self, msg, buffers))
    for n in range(1, 5):
        sent.clear()
        ex.step_button.click()
        stats = summaries.load_stats(s.trace().routing())
        spec = ex.views["moe_top"].spec
        assert f"{n} tokens" in spec["layout"]["title"]["text"]
        z = spec["data"][0]["z"]
        shown = np.frombuffer(base64.b64decode(z["bdata"]), np.float32).reshape([int(k) for k in z["shape"].split(",")])
        want = -np.sort(-stats["counts"], axis=1)[:, : shown.shape[1]].astype(np.float32)
        np.testing.assert_array_equal(np.nan_to_num(shown), want)  # 0 counts are gaps (NaN) in the view
        order = [(w, keys) for w, keys in sent]
        slider = [keys & {"max", "value"} for w, keys in order if w is ex.token and keys & {"max", "value"}]
        assert slider == ([{"max", "value"}] if n > 1 else [])  # the first Step leaves both at 0
        first_spec = min(i for i, (w, keys) in enumerate(order) if "spec" in keys)
        text_at = [i for i, (w, keys) in enumerate(order) if w is ex.text]
        assert len(text_at) == 1 and text_at[0] < first_spec  # tokens and selection: one message, before the figures
        assert [i for i, (w, _) in enumerate(order) if w is ex.status][-1] < first_spec
        views = [w for w, keys in order if "spec" in keys]
        assert len(views) == len(set(views)) == 4  # each of the tab's four views sent once


def test_a_view_left_as_it_was_is_not_resent_and_a_changed_one_is(tiny_weights, monkeypatch):
    """A refresh sends a view's figure (`spec`) only when it changed; what it shows (`shown`: the revision
    and the selection) goes every time. The predictions do not depend on the layer: a new layer sends
    only `shown`; a new token sends both, in one message."""
    import ipywidgets

    ex = Explorer(Session(tiny_weights, tokenizer=ByteTokenizer()), prompt=PROMPT, tab="Predictions")
    for _ in range(3):
        ex.step_button.click()
    view = ex.views["predictions"]
    sent = []
    real = ipywidgets.Widget._send
    monkeypatch.setattr(ipywidgets.Widget, "_send",
                        lambda self, msg, buffers=None: (sent.append(set(msg.get("state", {}))) if self is view else None)
                        or real(self, msg, buffers))
    spec, rev = view.spec, view.rev
    ex.layer.value = next(i for i in ex.session.weights.layer_ids if i != ex.layer.value)
    assert sent == [{"shown"}] and view.spec is spec and view.rev > rev
    assert view.meta == {"token": 2, "layer": ex.layer.value, "tokens": 3}
    assert view.snapshot()["layout"]["meta"] == view.meta  # the snapshot shows the selection as it is now
    sent.clear()
    ex.token.value = 1
    assert sent == [{"spec", "shown"}] and view.spec != spec and view.meta["token"] == 1
    sent.clear()
    ex.token.value = 1  # nothing changed: nothing sent
    assert sent == []


def test_a_new_prompt_fed_by_play_recomputes_the_surprisal_of_a_token_that_came_back(tiny_weights):
    """'abcdef' then Play with 'axcdef': tokens 2.. are the same ids as before, but they follow another
    token 1, so their surprisal (and its hover title) must be that of the new history: equal to a fresh
    session fed the new tokens, not what the old history gave."""
    from kimi_explore.views import summaries

    s = Session(tiny_weights, tokenizer=ByteTokenizer())
    ex = Explorer(s, prompt="abcdef")
    ex.play_button.click()
    before = ex.history.measures["surprisal"].copy()
    ex.prompt.value = "axcdef"
    ex.play_button.click()
    assert s.tokens == list(b"axcdef")
    ref = Session(tiny_weights, recorder=False)
    ref.feed(list(b"axcdef"))
    want = [np.nan] + [summaries.surprisal_bits(ref.logits_at(t - 1), s.tokens[t]) for t in range(1, 6)]
    np.testing.assert_allclose(ex.history.measures["surprisal"], want, atol=2e-3, equal_nan=True)  # chunking: rounding
    assert np.abs(before[2:] - np.asarray(want[2:])).max() > 0.1  # the old values were really different
    assert ex.text.titles[2].endswith(f"surprisal {want[2]:.4g}; click to select")


def test_kda_heads_at_the_selected_mla_layer_say_why_instead_of_raising(explorer):
    """KDA heads at 'this' layer while an MLA layer is selected: the note says so (as experts at a dense
    layer do); it used to raise out of the button's handler (no hook point 'layers.3.kda.state')."""
    ex = explorer
    for _ in range(3):
        ex.step_button.click()
    mla = next(i for i in ex.session.weights.layer_ids if i not in ex.kda_layers)
    ex.select(token=1, layer=mla)
    ex.ablation.what.value = "KDA heads"
    ex.ablation.experts.value, ex.ablation.layers.value = "0", "this"
    assert ex.ablate() is None
    assert f"layer {mla} is an MLA layer, no KDA heads" in ex.ablation.note.value and not ex.ablation.view.spec
    ex.ablation.layers.value = "all"  # every KDA layer: runs
    assert ex.ablate() is not None and ex.ablation.view.spec


def test_a_history_changed_outside_the_explorer_is_caught_up_before_anything_is_shown(tiny_weights):
    """`session.feed` / `truncate` in another cell, then a click in the Explorer: every view shows the session
    as it is now (the load over all its tokens, by an independent `load_stats` of its trace; the slider
    over its tokens; the ablation routed from its trace), not the history the Explorer last saw."""
    from kimi_explore.views import summaries

    s = Session(tiny_weights, tokenizer=ByteTokenizer())
    ex = Explorer(s, prompt="Hello there", tab="MoE routing")
    for _ in range(4):
        ex.step_button.click()
    s.feed(list(b" world"))  # outside the Explorer
    ex.select(token=2)
    assert (ex.token.max, ex.token.value, ex.text.selected, len(ex.text.labels)) == (9, 2, 2, 10)
    assert "10 tokens decoded" in ex.status.value and "changed outside the Explorer" in ex.status.value
    counts = summaries.load_stats(s.trace().routing())["counts"]
    z = decode(ex.views["moe_sorted"].spec["data"][0]["z"])
    np.testing.assert_array_equal(z, -np.sort(-counts, axis=1)[:, : z.shape[1]])
    assert "over 10 tokens" in ex.views["moe_sorted"].spec["layout"]["title"]["text"]
    s.truncate(3)
    ex.tabs.selected_index = TABS.index("Predictions")  # opening a tab catches up too
    assert ex.token.max == 2 and ex.views["predictions"].meta == {"token": 2, "layer": ex.layer.value, "tokens": 3}
    s.feed(list(b"xyz"))
    ex.select(token=4, layer=ex.moe_layers[0])
    s.truncate(5)
    s.feed(list(b"Q"))  # token 5 is another one now, behind the Explorer's back
    ex.ablation.experts.value = "chosen"
    got = ex.ablate()  # routes from the session's own trace: the experts token 4 chose there
    r = s.trace().routing()
    chosen = [int(e) for e in r["topk_ids"][4, 0] if e >= 0]
    ref = Session(tiny_weights, recorder=False)
    ref.feed(s.tokens[:4])
    with ref.intervene(interventions.ablate_experts(ex.moe_layers[0], chosen, 4)):
        want = ref.step(s.tokens[4])
    np.testing.assert_allclose(got, want, atol=1e-3)  # chunked vs stepped: rounding only
    assert np.abs(got - s.logits_at(4)).max() > 1e-2 and ex.ablation.view.spec
    assert ex.history.tokens == s.tokens


def test_an_ablation_that_changes_nothing_shows_nothing_on_a_fed_history(tiny_weights):
    """Play feeds the prompt as one chunk; the ablated fork steps (hooks make `feed` step). Comparing the two
    showed the rounding of chunk vs step as the ablation's effect (on this random model KL ~1e-8; at K3 depth
    hundreds of routing changes and KL ~1 nat over 20 tokens). An expert no token chose at that layer changes
    nothing: the compare, the KL strip, the Δ weights and the routing changes must all be exactly zero."""
    s = Session(tiny_weights, tokenizer=ByteTokenizer())
    ex = Explorer(s, prompt="Hi K3, again!", tab="Predictions")
    ex.play_button.click()
    assert list(s.runs()) == [(0, len(s))]  # one fed chunk
    r = s.trace().routing()
    j, layer = 0, ex.moe_layers[0]
    unused = [e for e in range(tiny_weights.config.num_experts) if not (r["topk_ids"][:, j] == e).any()]
    t = len(s) - 1
    ex.select(token=t, layer=layer)
    ex.ablation.experts.value, ex.ablation.layers.value, ex.ablation.scope.value = str(unused[0]), "this", "all tokens"
    ablated = ex.ablate()
    data = ex.ablation.diff_view.spec["data"]
    assert not decode(data[0]["z"]).any() and not decode(data[1]["z"]).any()  # KL strip, Δ output-mix weights
    assert "routing changes (0)" in ex.ablation.diff_view.spec["layout"]["title"]["text"]
    assert f"KL at token {t} 0;" in ex.ablation.note.value and "re-decoded one by one" in ex.ablation.note.value
    np.testing.assert_allclose(ablated, s.logits_at(t), atol=1e-2)  # the session's own logits: rounding apart
    # a stepped history is its own baseline: the real ablation matches a hand-built run (test above) and a
    # no-op one is exactly zero against the session itself
    s2 = Session(tiny_weights, tokenizer=ByteTokenizer())
    ex2 = Explorer(s2, prompt="Hi K3")
    for _ in range(5):
        ex2.step_button.click()
    ex2.select(token=4, layer=layer)
    chosen = s2.trace().routing()["topk_ids"][4, j].tolist()
    other = next(e for e in range(tiny_weights.config.num_experts) if e not in chosen)
    ex2.ablation.experts.value, ex2.ablation.scope.value = str(other), "this token"
    np.testing.assert_array_equal(ex2.ablate(), s2.logits_at(4))
    assert "re-decoded" not in ex2.ablation.note.value and "KL at token 4 0;" in ex2.ablation.note.value


def test_block_sources_at_every_layer_or_at_layer_0_run_without_its_missing_attention_mix(explorer, tiny_weights):
    """Layer 0 has no mix before attention (no `layers.0.attn_res.attn.weights` site). 'all' layers (and 'this'
    at layer 0) with both mixes used to raise out of the button; now the mask covers every site that exists,
    equal to a session decoded by hand with `mask_sources` at those sites, and 'attn:' at layer 0 alone says why."""
    ex, s = explorer, explorer.session
    for _ in range(5):
        ex.step_button.click()
    ex.select(token=3, layer=0)
    ex.ablation.what.value = "block sources"
    ex.ablation.experts.value, ex.ablation.layers.value = "current", "all"
    ablated = ex.ablate()
    layers = list(tiny_weights.layer_ids)
    assert ablated is not None and f"source current at {layers}" in ex.ablation.view.spec["layout"]["title"]["text"]
    ref = Session(tiny_weights, recorder=False)
    for t in s.tokens[:3]:
        ref.step(t)
    with ref.intervene(interventions.mask_sources(layers[1:], "attn", "current", 3),
                       interventions.mask_sources(layers, "ffn", "current", 3)):
        expected = ref.step(s.tokens[3])
    np.testing.assert_allclose(ablated, expected, rtol=0, atol=1e-6)
    ex.ablation.layers.value = "this"  # layer 0: its FFN mix only
    with ref.intervene(interventions.mask_sources(0, "ffn", "current", 3)):
        ref.truncate(3)
        expected = ref.step(s.tokens[3])
    np.testing.assert_allclose(ex.ablate(), expected, rtol=0, atol=1e-6)
    ex.ablation.experts.value = "attn: current"
    assert ex.ablate() is None and "have no attn mix" in ex.ablation.note.value


def test_a_snapshot_states_every_zoom_it_draws_and_keeps_expert_ticks_whole(explorer, tmp_path):
    """The page's state block lists the zoom of every view it draws (the ablation's too, on the Predictions tab),
    and a zoomed expert axis (the full map) keeps whole expert ids as ticks, as the live view does."""
    import json
    import re

    ex = explorer
    for _ in range(4):
        ex.step_button.click()
    ex.tabs.selected_index = TABS.index("Predictions")
    ex.ablation.experts.value = "chosen"
    ex.ablate()
    ex.ablation.view.ranges = {"xaxis": [0.0, 0.5]}  # as the browser reports a user's zoom
    page = ex.snapshot(tmp_path / "pred.html").read_text(encoding="utf-8")
    state = json.loads(re.search(r'id="kimi-state">(.*?)</script>', page).group(1))
    assert state["zoom"] == {"ablation": {"xaxis": [0.0, 0.5]}}
    assert re.findall(r'data-name="([a-z_]+)"', page) == ["predictions", "ablation", "ablation_diff"]
    ex.tabs.selected_index = TABS.index("MoE routing")
    ex.tab_views.full_map.value = True
    ex.views["moe_full"].ranges = {"xaxis": [2.2, 7.9], "yaxis": [3.5, -0.5]}
    drawn = ex.views["moe_full"].snapshot()["layout"]
    assert (drawn["xaxis"]["dtick"], drawn["xaxis"]["tick0"]) == (1, 0) and "dtick" not in drawn["yaxis"]
    ex.views["moe_full"].ranges = {"xaxis": [-0.5, 15.5]}
    assert ex.views["moe_full"].snapshot()["layout"]["xaxis"]["dtick"] == 2  # ~8 ticks: 0, 2, ..., 14
    page = ex.snapshot(tmp_path / "moe.html").read_text(encoding="utf-8")
    assert json.dumps(ex.views["moe_full"].snapshot()["layout"]) in page


def test_emptying_or_shortening_the_prompt_box_does_not_mark_prompt_tokens_generated(tiny_weights):
    """The dotted underline marks generated tokens (`generated_from`). A prompt box emptied (Step goes on greedily)
    or cut to a prefix of the history leaves the prompt tokens the history was fed as they were; only a new
    prompt moves the boundary."""
    ex = Explorer(Session(tiny_weights, tokenizer=ByteTokenizer()), prompt="abc")
    ex.play_button.click()
    ex.play_button.click()  # 'abc' fed, 8 generated
    assert ex.text.generated_from == 3
    ex.prompt.value = ""
    ex.step_button.click()
    assert (len(ex.session), ex.text.generated_from) == (12, 3)
    ex.prompt.value = "ab"
    ex.step_button.click()
    assert (len(ex.session), ex.text.generated_from) == (13, 3)
    ex.prompt.value = "abX"  # a new prompt: truncated to 'ab', then fed 'X'
    ex.step_button.click()
    assert (ex.session.tokens, ex.text.generated_from) == (list(b"abX"), -1)
    ex.step_button.click()
    assert ex.text.generated_from == 3
    s = Session(tiny_weights, tokenizer=ByteTokenizer())
    s.feed("hello")  # a history of unknown origin, no prompt: none of it is marked
    ex = Explorer(s, prompt=None)
    assert ex.text.generated_from == -1
    ex.step_button.click()  # ... but the greedy token the Explorer generated after it is
    assert (ex.text.generated_from, ex.text.generated_runs) == (5, [[5, 6]])


def test_the_ids_to_text_toggle_never_changes_what_step_feeds(tiny_weights):
    """ids -> text converts only when the text encodes back to the same ids; else (a byte that is not text
    alone: 195 then '(') the toggle stays on ids, the box keeps the ids typed, and Step feeds them. A box that
    does not parse keeps what was typed too (it became the character codes of '72, x')."""
    ex = Explorer(Session(tiny_weights, tokenizer=ByteTokenizer()), prompt=[195, 40, 97])
    ex.mode.value = "text"
    assert ex.mode.value == "ids" and ex.prompt.value == "195, 40, 97"
    assert "would be encoded as other tokens" in ex.status.value
    ex.step_button.click()
    ex.step_button.click()
    assert ex.session.tokens == [195, 40]
    ex.prompt.value = "72, x"
    ex.mode.value = "text"
    assert ex.mode.value == "ids" and ex.prompt.value == "72, x" and "'x' is not an integer" in ex.status.value
    ex.prompt.value = "72, 105"
    ex.mode.value = "text"
    assert ex.prompt.value == "Hi"


def test_an_expert_field_that_holds_no_id_shows_no_stale_map(explorer):
    """Searching '3', then typing 'x': the note says 'x' is not an id and the map of expert 3 goes (it stayed,
    and after a Step showed expert 3 in the old history under a field reading 'x'); '' hides the view."""
    ex = explorer
    ex.tabs.selected_index = TABS.index("MoE routing")
    for _ in range(3):
        ex.step_button.click()
    ex.tab_views.expert.value = "3"
    assert "Where expert 3 fires" in view_spec(ex, "expert_search")[1]["title"]["text"]
    ex.tab_views.expert.value = "x"
    ex.step_button.click()
    view = ex.views["expert_search"]
    assert "is not an expert id" in ex.tab_views.expert_note.value
    assert not view.spec and view.layout.display == "none"
    ex.tab_views.expert.value = "4"
    assert "Where expert 4 fires" in view_spec(ex, "expert_search")[1]["title"]["text"] and view.layout.display is None
    assert view.meta == {"token": 3, "layer": ex.layer.value, "tokens": 4}
    ex.tab_views.expert.value = ""
    assert view.layout.display == "none" and ex.tab_views.expert_note.value == ""


def test_a_click_on_the_selected_token_catches_up_with_the_session_too(tiny_weights):
    s = Session(tiny_weights, tokenizer=ByteTokenizer())
    ex = Explorer(s, prompt="Hello", tab="Predictions")
    for _ in range(3):
        ex.step_button.click()
    s.feed(list(b"lo"))  # outside the Explorer
    click(ex.views["block_layer"], x=f"{ex.token.value} 'l'")  # the token selected already: no change event
    assert ex.token.max == 4 and ex.history.tokens == s.tokens and "5 tokens decoded" in ex.status.value


def test_compute_on_a_history_that_does_not_replay_says_why_in_the_views(explorer):
    """A token decoded under a temporary intervention (`with session.intervene(...)` in another cell) cannot be
    replayed by the lens or the attribution: Compute shows the replay's reason in the views; it raised out of the
    button (and, with 'compute on every selection', out of every refresh)."""
    ex, s = explorer, explorer.session
    for _ in range(3):
        ex.step_button.click()
    with s.intervene(interventions.ablate_experts("all", "all")):
        s.step(72)
    ex.tabs.selected_index = TABS.index("Lens & attribution")
    ex.select(token=3)
    ex.tab_views.compute_button.click()
    title = ex.views["lens"].spec["layout"]["annotations"][0]["text"]
    assert title.startswith("No lens for token 3: replaying the session's history gives other logits at token 3")
    ex.tab_views.auto_analyses.value = True
    ex.select(token=1)  # replays fine up to token 1
    assert "Logit lens of token 1" in ex.views["lens"].spec["layout"]["title"]["text"]
