"""Second review of the views: each test is a problem a tester found, on the trained tiny model.

Views that silently kept showing another run (a history rewritten with the same token ids; the colour
measure changed after the session changed elsewhere), layers labelled with the wrong kind when a
recorder left them out, an Explorer that crashed on a recorder that leaves out what it reads, static
figures of a Trace window labelled from position 0, and a block-source ablation that changed nothing
without saying why.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.views import summaries
from kimi_explore.views.explorer import specs
from kimi_explore.views.explorer.token_text import measure_colors
from kimi_explore.views.explorer.widgets import TABS, Explorer
from kimi_explore.views.figures import plots, plots_summary, report


@pytest.fixture(scope="module")
def tok(trained_weights):
    return ke.load_tokenizer(trained_weights)


def decode(spec: dict) -> np.ndarray:
    """A plotly.js typed-array spec (dtype, base64 bytes, shape) back to an array."""
    dtypes = {"f4": np.float32, "f8": np.float64, "i4": np.int32, "u1": np.uint8, "u2": np.uint16, "u4": np.uint32}
    a = np.frombuffer(base64.b64decode(spec["bdata"]), dtype=dtypes[spec["dtype"]])
    return a.reshape([int(n) for n in spec["shape"].split(",")])


def shown_topk(ex: Explorer) -> list[list[str]]:
    """The expert ids the MoE tab's top-k table shows for the selected token (without the bias stars)."""
    return [[c.rstrip("*") for c in row] for row in ex.views["moe_topk"].spec["data"][0]["text"]]


def topk_of(session, t: int) -> list[list[str]]:
    return [[str(e) if e >= 0 else "" for e in row] for row in session.trace().routing()["topk_ids"][t]]


# ---------------------------------------------------------------- 1. a history rewritten with the same ids


def test_history_version_changes_with_every_change_of_the_history(trained_weights, tok):
    s = ke.Session(trained_weights, tokenizer=tok)
    s.feed("x = 1")
    snap = s.snapshot()
    seen = [s.history_version]
    for change in (lambda: s.feed("y"), lambda: s.step(5), s.back, lambda: s.truncate(3), lambda: s.restore(snap),
                   lambda: s.generate(1)):
        change()
        seen.append(s.history_version)
    assert len(set(seen)) == len(seen)  # a new number for each change
    before = s.history_version
    s.truncate(len(s))  # keeps every token: no change
    s.snapshot()
    s.trace()
    assert s.history_version == before


def ablated_last_token(weights, tok):
    """(session, snapshot of its clean run of "x = 1", last token id): the session's last token re-stepped with
    every routed expert ablated, so its history keeps the snapshot's token ids with other values."""
    s = ke.Session(weights, tokenizer=tok)
    s.feed("x = 1")
    snap = s.snapshot()
    last = s.tokens[-1]
    s.back()
    with s.intervene(ke.interventions.ablate_experts("all", "all")):
        s.step(last)
    return s, snap, last


def test_a_restored_run_of_the_same_tokens_is_shown_not_the_run_before(trained_weights, tok):
    """`session.restore(snapshot)` of another run of the same token ids (and the README's intervention example,
    `back` then the same token under `intervene`): every tab showed the run the Explorer saw first."""
    s, snap, last = ablated_last_token(trained_weights, tok)
    ex = Explorer(s, tab="MoE routing")
    t = len(s) - 1
    assert shown_topk(ex) == topk_of(s, t) and not any(any(row) for row in shown_topk(ex))  # the ablated run
    ablated_measures = {name: v.copy() for name, v in ex.history.measures.items()}
    s.restore(snap)  # the clean run: the same token ids
    ex.select(token=t)
    assert shown_topk(ex) == topk_of(s, t) and all(all(row) for row in shown_topk(ex))
    assert "changed outside the Explorer" in ex.status.value
    measures = summaries.token_measures(s.trace(), ex._surprisals())
    for name, v in measures.items():
        np.testing.assert_allclose(ex.history.measures[name], v, rtol=1e-12, equal_nan=True)
    assert not np.allclose(ablated_measures["routing entropy"][t], measures["routing entropy"][t])
    # back, then the same token under an intervention, in another cell: shown as it is now too
    s.back()
    with s.intervene(ke.interventions.ablate_experts("all", "all")):
        s.step(last)
    ex.tabs.selected_index = TABS.index("Predictions")
    ex.tabs.selected_index = TABS.index("MoE routing")
    assert shown_topk(ex) == topk_of(s, t) and not any(any(row) for row in shown_topk(ex))


def test_a_step_after_a_rewrite_outside_keeps_nothing_of_the_run_before(trained_weights, tok):
    """A Step (an Explorer action) right after a rewrite outside: the per-token numbers are those of the session."""
    s, snap, last = ablated_last_token(trained_weights, tok)
    ex = Explorer(s, tab="MoE routing")
    s.restore(snap)
    ex.step_button.click()  # greedy: one more token
    assert len(s) == 6
    measures = summaries.token_measures(s.trace(), ex._surprisals())
    for name, v in measures.items():
        np.testing.assert_allclose(ex.history.measures[name], v, rtol=1e-12, equal_nan=True)
    np.testing.assert_array_equal(ex.history.load_stats()["counts"], summaries.load_stats(s.trace().routing())["counts"])


# ---------------------------------------------------------------- 2. the colour measure after an outside change


@pytest.mark.parametrize("outside", ["same length", "longer", "shorter"])
def test_changing_the_colour_measure_shows_the_session_as_it_is_now(trained_weights, tok, outside):
    """The measure dropdown did not catch up with the session: the old history's values on the new tokens (same
    length: wrong colours and titles silently; longer: IndexError; shorter: ValueError from TokenText)."""
    s = ke.Session(trained_weights, tokenizer=tok)
    ex = Explorer(s, prompt="print(x)")
    ex.play_button.click()
    s.truncate(2)
    s.feed({"same length": "ZZZZQQ", "longer": "ZZZZQQRRR", "shorter": "Z"}[outside])
    ex.measure.value = "routing entropy"
    want = summaries.token_measures(s.trace())["routing entropy"]
    assert len(ex.text.titles) == len(s)
    assert [t.split("routing entropy ")[1].split(";")[0] for t in ex.text.titles] == [f"{v:.4g}" for v in want]
    assert list(ex.text.colors) == list(measure_colors(want)[0])
    assert "changed outside the Explorer" in ex.status.value


# ---------------------------------------------------------------- 3. layer kinds from the model, not the records


@pytest.fixture(scope="module")
def first_layers_only(trained_weights, tok):
    """A trace whose recorder kept layers 0-3 only (the KDA layers 4, 5, 6 and the MLA layer 7 left out)."""
    s = ke.Session(trained_weights, tokenizer=tok, recorder=ke.Recorder(names_filter=["final.*", "logits", "layers.[0-3].*"]))
    s.feed("abc")
    return s.trace()


def test_layer_labels_are_the_models_kinds_whatever_was_recorded(trained_weights, first_layers_only):
    tr = first_layers_only
    kinds = [f"{i} {'KDA' if trained_weights.config.is_kda_layer(i) else 'MLA'}" for i in trained_weights.layer_ids]
    assert kinds == ["0 KDA", "1 KDA", "2 KDA", "3 MLA", "4 KDA", "5 KDA", "6 KDA", "7 MLA"]
    assert specs.layer_labels(tr) == kinds
    assert specs.block_token(tr, 0, 5)[1]["xaxis2"]["type"] == "category"
    assert specs.block_token(tr, 0, 5)[0][0]["x"] == kinds
    fig = plots.block_residual_token(tr, 0)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == kinds


def test_a_layer_that_was_not_recorded_says_so(first_layers_only):
    tr = first_layers_only
    message = lambda spec: spec[1]["annotations"][0]["text"]
    assert "is an MLA layer" in message(specs.kda_layer(tr, 3, 0))  # an MLA layer is one
    for layer in (4, 5, 6):  # KDA layers the recorder left out
        text = message(specs.kda_layer(tr, layer, 0))
        assert "MLA" not in text and f"layers.{layer}.kda.state was not recorded" in text
    assert "not recorded: KDA layers [4, 5, 6]" in specs.kda_token(tr, 0, 5)[1]["title"]["text"]
    left_out = [f"layer 6: layers.6.attn_res.{site}.weights was not recorded (the Recorder's names_filter left it out)"
                for site in ("attn", "ffn")]
    assert [n["text"] for n in specs.block_layer(tr, 6, 0)[1]["annotations"]] == left_out
    still_empty = "layer 0 has no mix before attention: its block stack is still empty"  # the model has none there
    assert [n["text"] for n in specs.block_layer(tr, 0, 0)[1]["annotations"]] == [still_empty]
    hover = specs.block_token(tr, 0, 5)[0][0]["customdata"]  # [source, layer] before attention
    assert hover[0][0] == f"<br>{still_empty}" and hover[0][6] == f"<br>{left_out[0]}"
    assert hover[0][2] == ""  # a recorded weight
    # the static figures say the same
    texts = [ax.texts[0].get_text() for ax in plots.block_residual_layer(tr, 6).axes]
    assert texts == [m.replace(": ", ":\n", 1) for m in left_out]
    assert plots.block_residual_layer(tr, 0).axes[0].texts[0].get_text() == still_empty.replace(": ", ":\n", 1)
    with pytest.raises(ValueError, match=r"KDA layer 5: layers.5.kda.state was not recorded .*recorded KDA layers: \[0, 1, 2\]"):
        plots.kda_state_heatmap(tr, 5)
    with pytest.raises(ValueError, match=r"layer 3 is not a KDA layer \(an MLA layer has no recurrent state\); KDA layers: "
                                         r"\[0, 1, 2, 4, 5, 6\]"):
        plots.kda_state_heatmap(tr, 3)


# ---------------------------------------------------------------- 4. a recorder that leaves out what the views read


@pytest.mark.parametrize("names_filter,left_out", [
    ("layers.*.moe.*", "final.attn_res.weights"),
    (["layers.*", "final.*"], "logits"),
    (["layers.*", "logits"], "final.attn_res.weights"),
    (["final.*", "logits", "layers.[0-3].*"], "kda.state at layers [4, 5, 6]"),
])
@pytest.mark.parametrize("fed", [True, False], ids=["fed", "empty"])
def test_the_explorer_refuses_a_recorder_that_leaves_out_what_it_reads(trained_weights, tok, names_filter, left_out, fed):
    """It raised KeyError from a view (at construction, or at the first Step of an empty session); now it refuses
    up front, naming what it needs, as it refuses a session that records nothing."""
    s = ke.Session(trained_weights, tokenizer=tok, recorder=ke.Recorder(names_filter=names_filter))
    if fed:
        s.feed("abc")
    with pytest.raises(ValueError, match="Explorer: every view reads the session's records") as e:
        Explorer(s, prompt="abc")
    assert left_out in str(e.value) and "Recorder()" in str(e.value)


def test_a_recorder_that_keeps_what_the_views_read_is_explored(trained_weights, tok):
    """A names_filter leaving out only sites no view reads (KDA conv windows, MoE output norms) is fine."""
    rec = ke.Recorder(names_filter=["layers.*.attn_res.*", "layers.*.kda.state", "layers.*.moe.router.*", "final.*",
                                    "logits"])
    s = ke.Session(trained_weights, tokenizer=tok, recorder=rec)
    ex = Explorer(s, prompt="abc")
    ex.play_button.click()
    for tab in range(len(TABS)):
        ex.tabs.selected_index = tab
    assert len(s) == 3 and ex.views["predictions"].spec["data"]


# ---------------------------------------------------------------- 5. static figures of a Trace window


def test_static_figures_of_a_window_name_its_history_positions(trained_weights, tok):
    s = ke.Session(trained_weights, tokenizer=tok)
    s.feed("abcdefghijklmnop")
    win = s.trace(window=slice(10, 15))
    want = [f"{p} '{c}'" for p, c in zip(range(10, 15), "klmno", strict=True)]
    assert "of token 10 'k'" in plots.block_residual_token(win, 0, tok)._suptitle.get_text()
    assert "after 10 'k'" in plots.predictions(win, 0, tok).axes[0].get_title()
    assert [t.get_text() for t in plots.block_residual_layer(win, 3, tok).axes[1].get_xticklabels()] == want
    assert [t.get_text() for t in plots.kda_state_heatmap(win, 2, tok).axes[0].get_yticklabels()] == want
    assert [t.get_text() for t in plots.moe_routing_layer(win, 2, tok).axes[0].get_yticklabels()] == want
    assert "token 10 'k'" in plots.kda_state_overview(win, 0, tok).axes[0].get_title()
    assert "token 10 'k'" in plots.moe_routing_token(win, 0, tok).axes[0].get_title()
    stats = plots_summary.moe_layer_stats(win, 0, tok)
    assert stats.axes[0].get_legend().get_texts()[0].get_text() == "token 10 'k'"
    assert "Experts of token 10 &#x27;k&#x27;" in plots_summary.topk_table_html(win, 0, tokenizer=tok)
    assert "<td>10 &#x27;k&#x27;</td>" in report._prediction_table(win, tok)


# ---------------------------------------------------------------- 6. a block-source ablation that changes nothing


def test_a_block_source_ablation_that_cannot_change_anything_says_why(trained_weights, tok):
    """'block 9' (the model stores blocks 1-2) and 'block 1' at layer 0 (sealed by layer 3) ran and showed KL 0
    with no word; now they are refused, and a range that reaches the block only at some mixes names the rest."""
    s = ke.Session(trained_weights, tokenizer=tok)
    ex = Explorer(s, prompt="x = foo(1)", tab="Predictions")
    ex.play_button.click()
    ex.select(token=5, layer=6)
    a = ex.ablation
    a.what.value, a.scope.value = "block sources", "this token"
    a.experts.value, a.layers.value = "block 9", "this"
    assert ex.ablate() is None and not a.view.spec
    assert "block 9 does not exist: the sources are ['embedding', 'block 1', 'block 2', 'current']" in a.note.value
    a.experts.value, a.layers.value = "block 1", "0"
    assert ex.ablate() is None and not a.view.spec
    assert "block 1 is not read by the chosen mixes (layer 0 ffn: not sealed yet there)" in a.note.value
    a.layers.value = "0-4"  # block 1 is read from layer 3's FFN mix on
    assert ex.ablate() is not None and a.view.spec
    assert ("block 1 is not read at layer 0 ffn, layer 1 attn, layer 1 ffn, layer 2 attn, layer 2 ffn, layer 3 attn "
            "(not sealed yet there): nothing masked there") in a.note.value
    a.layers.value = "this"  # layer 6 reads block 1 at both mixes: nothing to say
    assert ex.ablate() is not None and "not read" not in a.note.value


def test_the_reports_pushed_out_column_names_the_experts(trained_weights, tok):
    """The column held how many experts the bias pushed out, under a heading that reads as expert ids: a row
    "... | 1" named expert 1 (chosen), where expert 12 was the one pushed out."""
    from kimi_explore.views.common import bias_vectors
    from kimi_explore.views.figures.plots_summary import routing

    s = ke.Session(trained_weights, tokenizer=tok)
    s.feed("def f(x):\n    return x + 1\n")
    r, bias = routing(s.trace()), bias_vectors(trained_weights)
    html = plots_summary.topk_table_html(s.trace(), 0, bias, tok)
    rows = html.split("<tr>")[2:]
    assert len(rows) == len(r["moe_layers"])
    for j, row in enumerate(rows):
        ids, scores = r["topk_ids"][0, j], r["scores"][0, j]
        unbiased = set(np.argsort(-scores, kind="stable")[: len(ids)].tolist())  # the top-k without the bias
        out = sorted(unbiased - set(ids.tolist()))
        last = row.rsplit("<td>", 1)[1].split("</td>")[0]
        assert last == (", ".join(f"{e} ({scores[e]:.3f})" for e in out) or "none"), (j, last)
    assert any(row.rsplit("<td>", 1)[1] != "none</td></tr>" for row in rows)  # something was pushed out here


def test_closing_an_explorer_frees_it_and_its_session():
    """close() closed only the outer box: 154 widgets stayed registered with ipywidgets, their callbacks holding the
    Explorer and its session alive (a re-run notebook cell kept one more session each time)."""
    import gc
    import weakref

    from ipywidgets.widgets.widget import _instances

    from kimi_explore.views.explorer.plotly_view import PlotlyJS
    from kimi_explore.views.explorer.widgets import _widgets_within

    w = ke.from_pretrained(ke.tiny_checkpoint())
    PlotlyJS.shared()  # the kernel's one, which every Explorer shows and none closes
    before = set(_instances)
    s = ke.Session(w, tokenizer=ke.ByteTokenizer())
    s.feed("def f(x):", progress=False)
    ex = ke.Explorer(s)
    ex.step()
    assert len(set(_instances) - before) > 100
    session = weakref.ref(s)
    other = ke.Explorer(ke.Session(w, tokenizer=ke.ByteTokenizer()))
    ex.close()
    theirs = {id(x) for x in _widgets_within(other)}
    assert all(id(x) in theirs for k, x in _instances.items() if k not in before)  # only the other's stay open
    other.step()  # and it still works
    other.close()
    assert set(_instances) - before == set()
    del s, ex
    gc.collect()
    assert session() is None
