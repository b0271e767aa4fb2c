"""Third review of the Explorer and the figures: each test is a problem a probe found, on the trained tiny
model (or a K3-sized synthetic trace), driven through the real widget callbacks.

An ablation that compared against a token decoded under an earlier intervention (mixing in undoing it),
bias stars and "pushed out" experts on a row an ablation shortened, a diff panel that wrapped any token
index, errors in button callbacks lost in ipywidgets' log, fed text drawn as generated, bare TraitErrors,
and figures unreadable at K3 depth (93 layers: the lens strip's cell texts, the block panels' sources,
the run diff of every token, the ablation note's "fed as a chunk").
"""

from __future__ import annotations

import html
import re
from types import SimpleNamespace

import numpy as np
import pytest
from synthetic_trace import k3_sized

import kimi_explore as ke
from kimi_explore.inspection import interventions as iv
from kimi_explore.views.common import bias_vectors, layer_labels, softmax
from kimi_explore.views.explorer import specs, specs_analysis
from kimi_explore.views.explorer.ablation import rerun
from kimi_explore.views.explorer.plotly_view import PlotView
from kimi_explore.views.explorer.widgets import Explorer
from kimi_explore.views.figures.analysis_plots import diff_overview
from kimi_explore.views.figures.plots_summary import topk_table_html

MOE = [1, 2, 3, 4, 5, 6, 7]  # the trained tiny model's MoE layers


@pytest.fixture(scope="module")
def tok(trained_weights):
    return ke.load_tokenizer(trained_weights)


def plain(markup: str) -> str:
    return html.unescape(re.sub("<[^>]+>", "", markup))


def kl(p: np.ndarray, q: np.ndarray) -> float:
    return float(np.sum(p * (np.log(p) - np.log(q))))


def is_red(html: str) -> bool:
    return "color:#b00" in html


def ablate_head_3(ex, token: int, scope: str = "this token") -> str:
    """Click Ablate & compare for KDA head 3 at layer 2, at `token` and `scope`; the note's markup."""
    ex.select(token=token, layer=2)
    ex.ablation.what.value = "KDA heads"
    ex.ablation.experts.value = "3"
    ex.ablation.scope.value = scope
    ex.ablation.button.click()
    return ex.ablation.note.value


# ---------------------------------------------------------------- 1. ablating a token decoded under hooks


def stepped(weights, tok, text: bytes):
    s = ke.Session(weights, tokenizer=tok)
    for x in text:
        s.step(x)
    return s


@pytest.mark.parametrize("scope, token", [("this token", 8), ("from this token on", 7), ("all tokens", 9)],
                         ids=["this-token", "from-it-on", "all-tokens"])
def test_ablation_refuses_a_range_holding_a_token_decoded_under_hooks(trained_weights, tok, scope, token):
    """Token 8 was decoded inside another cell's `with s.intervene(...)`: the fork would re-decode it without that
    intervention, and 'KL(as run ‖ ablated)' mixed undoing it in (0.28 shown for an ablation worth 0.04). Every
    scope whose range holds token 8 is refused in red, naming it; nothing is drawn."""
    s = stepped(trained_weights, tok, b"The cat ")
    with s.intervene(iv.ablate_experts(MOE, "all")):
        s.step(ord("s"))
    s.step(ord("a"))
    assert s.decoded_with_hooks(8) and not s.decoded_with_hooks(9)
    ex = Explorer(s, tab="Predictions")
    note = ablate_head_3(ex, token, scope)
    assert is_red(note) and "token 8 was decoded under hooks" in plain(note)
    assert ex.ablation.view.spec == {} and ex.ablation.diff_view.spec == {}


@pytest.mark.parametrize("fed", [False, True], ids=["stepped", "fed"])
def test_ablation_goes_on_for_tokens_decoded_under_the_hooks_the_session_holds(trained_weights, tok, fed):
    """A Session built with hooks decodes every token under them (`decoded_with_hooks` True), and a fork repeats them
    (it copies session.hooks): its ablations go on, with the KL of a separate session decoding the same tokens under
    the same hooks plus the ablation (every ablation was refused)."""
    held = iv.mask_sources(5, "both", "latest_block")
    s = ke.Session(trained_weights, tokenizer=tok, hooks=held)
    if fed:
        s.feed(b"The cat s")
    else:
        for x in b"The cat s":
            s.step(x)
    assert all(s.decoded_with_hooks(u) for u in range(len(s)))
    ex = Explorer(s, tab="Predictions")
    markup = ablate_head_3(ex, 7)
    note = plain(markup)
    assert not is_red(markup), note
    as_run, ablated = (ke.Session(trained_weights, hooks=iv.mask_sources(5, "both", "latest_block")) for _ in "ab")
    for x in b"The cat ":  # token 7 is the space
        as_run.step(x)
    for x in b"The cat":
        ablated.step(x)
    with ablated.intervene(iv.zero_kda_head([2], [3], 7)):
        ablated.step(ord(" "))
    want = kl(softmax(as_run.logits_at(7)), softmax(ablated.logits_at(7)))
    assert f"KL at token 7 {want:.4g}" in note

def test_ablation_after_a_token_decoded_under_hooks_compares_with_the_run_as_it_was(trained_weights, tok):
    """Token 9, stepped after the intervened token 8, is ablated from the exact state after token 8 (intervened):
    the KL shown is that of a separate session decoding the same tokens under the same hooks."""
    s = stepped(trained_weights, tok, b"The cat ")
    with s.intervene(iv.ablate_experts(MOE, "all")):
        s.step(ord("s"))
    s.step(ord("a"))
    ex = Explorer(s, tab="Predictions")
    ablate_head_3(ex, 9)
    other = stepped(trained_weights, tok, b"The cat ")
    with other.intervene(iv.ablate_experts(MOE, "all")):
        other.step(ord("s"))
    with other.intervene(iv.zero_kda_head([2], [3], 9)):
        other.step(ord("a"))
    want = kl(softmax(s.logits_at(9)), softmax(other.logits_at(9)))
    assert f"KL at token 9 {want:.4g}" in plain(ex.ablation.note.value)


def test_every_ablation_checks_again_that_the_sessions_hooks_repeat_the_range(trained_weights, tok):
    """A hook whose behaviour changes in another cell (a closure's variable) keeps its function object: an ablation
    kept per (range, hooks) reused 'repeats' and showed KL 0.1098 mixing the change in (the ablation alone: 0.017).
    Every click re-decodes the range under the session's hooks and refuses it."""
    alpha = {"a": 0.0}

    def steer(v, *, hook):
        return v * (1 + alpha["a"])

    s = ke.Session(trained_weights, tokenizer=tok)
    s.hooks.add("embed", steer)
    for x in b"The cat s":
        s.step(x)
    ex = Explorer(s, tab="Predictions")
    assert "cannot" not in ablate_head_3(ex, 7)
    alpha["a"] = 3.0
    assert "token 7 was decoded under hooks the session does not hold now" in plain(ablate_head_3(ex, 7))

# ---------------------------------------------------------------- 2. bias stars on a row an ablation shortened


def unbiased_rank(scores: np.ndarray, e: int) -> int:
    return 1 + sum(1 for x in scores if x > scores[e])


@pytest.mark.parametrize("drop", ["best", "all"])
def test_topk_table_after_an_expert_ablation(trained_weights, tok, drop):
    """After the ablation of token 6's rank-1 expert at layer 1 (or of all its experts), the survivor is starred only
    if its unbiased rank among all experts exceeds k (it did not: ranks 1 and 2 as run), and 'pushed out' lists only
    experts the bias kept out of the router's own choice (as run: none), never the ablated one."""
    s = ke.Session(trained_weights, tokenizer=tok)
    s.feed(list(b"hello w"))
    r = s.trace().routing()
    j = list(r["moe_layers"]).index(1)
    as_run = [int(e) for e in r["topk_ids"][6, j]]
    k = len(as_run)
    sc = np.asarray(r["scores"][6, j], dtype=np.float64)
    best = min(as_run, key=lambda e: unbiased_rank(sc, e))
    fork = rerun(s, iv.ablate_experts(1, "all" if drop == "all" else [best], 6), start=6)
    fr = fork.trace().routing()
    f_scores = np.asarray(fr["scores"][6, j], dtype=np.float64)
    survivors = [int(e) for e in fr["topk_ids"][6, j] if e >= 0]
    assert survivors == ([] if drop == "all" else [e for e in as_run if e != best])
    unbiased_top = sorted(range(len(f_scores)), key=lambda e: (-f_scores[e], e))[:k]
    pushed_out = [e for e in unbiased_top if e not in as_run]  # by the bias, out of the router's own choice
    want_cells = [f"{e}*" if unbiased_rank(f_scores, e) > k else str(e) for e in survivors]
    table = topk_table_html(fork.trace(), 6, bias_vectors(trained_weights))
    row = re.search(r"<tr><th>1</th>(.*?)</tr>", table).group(1)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    assert [re.search(r"<b>(.*?)</b>", c).group(1) for c in cells[:k] if c] == want_cells
    assert plain(cells[-1]) == (", ".join(f"{e} ({f_scores[e]:.3f})" for e in pushed_out) or "none")
    # the Explorer's MoE tab, on a history decoded under the same ablation
    s.back()
    with s.intervene(iv.ablate_experts(1, "all" if drop == "all" else [best])):
        s.step(ord("w"))
    ex = Explorer(s, tab="MoE routing")
    ex.select(token=6, layer=1)
    d = ex.views["moe_topk"].spec["data"][0]
    i = [y.split()[0] for y in d["y"]].index("1")
    assert [c for c in d["text"][i] if c] == want_cells
    hover = " ".join(d["customdata"][i])
    assert ("chosen only through the bias" in hover) == any("*" in c for c in want_cells)
    assert ("bias pushed out" in hover) == bool(pushed_out and survivors)


# ---------------------------------------------------------------- 3. diff_overview's token


def test_diff_overview_token_is_a_row_checked_like_plots(trained_weights):
    """`token` is a row of the diff (as `token` is a row of the trace in `plots`, `token_index`), negative from the
    end; out of range it raises IndexError (it wrapped: token=100 drew row 0, -11 the last) naming the rows and
    their history positions."""
    text = list(b"The cat sat on the mat")
    s = ke.Session(trained_weights)
    s.feed(text)
    f = ke.Session(trained_weights)
    with f.intervene(iv.ablate_experts(3, "all", 10)):
        f.feed(text)
    d = ke.diff(s.trace().window(12, 22), f.trace().window(12, 22))  # rows 0..9 = positions 12..21
    for token, position in ((3, 15), (-1, 21), (0, 12)):
        titles = [ax.get_title() for ax in diff_overview(d, token=token).axes if "FFN-site" in ax.get_title()]
        assert titles == [f"Δ FFN-site block weights at token {position} #{text[position]}"]
    for token in (10, 100, -11):
        with pytest.raises(IndexError, match=rf"token={token} is outside the diff: it holds 10 tokens .*"
                                             r"history positions 12\.\.21"):
            diff_overview(d, token=token)


# ---------------------------------------------------------------- 4. errors inside button callbacks


def test_errors_in_button_callbacks_are_shown_and_the_explorer_stays_usable(trained_weights, tok):
    """A user's hook raises: Step, Play, Ablate & compare and Compute say so in a red status line (type and message),
    instead of ipywidgets swallowing it into its log; then, the hook removed, Step works again."""
    s = ke.Session(trained_weights, tokenizer=tok)
    failing = [False]

    def boom(value, hook):
        if failing[0]:
            raise RuntimeError("user hook failed")

    handle = s.hooks.add("layers.2.kda.state", boom)
    s.feed("abcdef")  # decoded under the hook, before it fails
    ex = Explorer(s, prompt="abcdef")
    failing[0] = True
    for button in (ex.step_button, ex.play_button):
        button.click()
        assert is_red(ex.status.value) and "failed: RuntimeError: user hook failed" in plain(ex.status.value)
        assert plain(ex.status.value).startswith(button.description + " failed")
        assert len(s) == 6 and isinstance(ex.last_error, RuntimeError)
    ex.tabs.selected_index = 3
    ex.select(token=4, layer=2)
    ex.ablation.what.value = "KDA heads"
    ex.ablation.experts.value = "0"
    ex.ablation.button.click()
    assert plain(ex.status.value).startswith("Ablate & compare failed: RuntimeError: user hook failed")
    assert is_red(ex.ablation.note.value) and "RuntimeError: user hook failed" in ex.ablation.note.value
    ex.tabs.selected_index = 4
    ex.tab_views.compute_button.click()
    assert plain(ex.status.value).startswith("Compute failed: RuntimeError: user hook failed")
    assert ex.busy.value == ""
    s.hooks.remove(handle)
    ex.step_button.click()
    assert len(s) == 7 and not is_red(ex.status.value) and "7 tokens decoded" in ex.status.value


# ---------------------------------------------------------------- 5. generated-token marks


def test_only_tokens_the_explorer_generated_are_marked(trained_weights, tok):
    """The Explorer marks the tokens it generated (Play past the prompt, a greedy Step), not text fed from
    another cell, nor its own tokens fed again."""
    s = ke.Session(trained_weights, tokenizer=tok)
    ex = Explorer(s, prompt="ab", play_tokens=4)
    ex.play_button.click()  # 'ab' fed
    ex.play_button.click()  # 4 generated: tokens 2..5
    ref = ke.Session(trained_weights, tokenizer=tok)
    ref.feed(list(b"ab"))
    assert s.tokens[2:] == ref.generate(4)  # they are the greedy continuation
    assert ex.text.generated_runs == [[2, 6]]
    s.feed(list(b"cdef"))  # another cell: tokens 6..9 fed
    ex.select(token=0)  # any click catches up
    assert (ex.text.generated_runs, ex.text.generated_from) == ([[2, 6]], 2)
    ex.step_button.click()  # greedy: token 10
    assert ex.text.generated_runs == [[2, 6], [10, 11]]
    assert "dotted = generated" in ex.legend.value
    again = s.tokens[2:6]
    s.truncate(2)
    s.feed(again)  # the same ids, fed this time
    ex.select(token=0)
    assert (ex.text.generated_runs, ex.text.generated_from) == ([], -1)
    assert "dotted" not in ex.legend.value


# ---------------------------------------------------------------- 6. clear errors


@pytest.mark.parametrize("kw, match", [
    ({"measure": "nope"}, r"measure='nope' is not one of \('surprisal'"),
    ({"tab": 7}, r"tab=7: pick 0\.\.4 or a name, one of \('Block residuals'"),
    ({"play_tokens": 0}, "play_tokens .* must be an int >= 1, got 0"),
    ({"play_tokens": -3}, "play_tokens .* must be an int >= 1, got -3"),
], ids=["measure", "tab", "play_tokens-0", "play_tokens-negative"])
def test_explorer_arguments_are_refused_with_the_valid_values(trained_weights, tok, kw, match):
    """A bare TraitError ('Invalid selection: value not found') named nothing; play_tokens=-3 was taken (Play then
    generated nothing, silently)."""
    with pytest.raises(ValueError, match=match):
        Explorer(ke.Session(trained_weights, tokenizer=tok), **kw)


def test_play_tokens_set_later_is_checked_too(trained_weights, tok):
    ex = Explorer(ke.Session(trained_weights, tokenizer=tok), prompt="ab")
    with pytest.raises(ValueError, match="play_tokens .* must be an int >= 1, got 0"):
        ex.play_tokens = 0
    assert ex.play_tokens == 8


def test_select_refuses_a_layer_not_loaded_naming_the_layers(trained_weights, tok):
    ex = Explorer(ke.Session(trained_weights, tokenizer=tok), prompt="abc")
    ex.play_button.click()
    with pytest.raises(ValueError, match=r"layer=99 is not loaded; the layers are \[0, 1, 2, 3, 4, 5, 6, 7\]"):
        ex.select(layer=99)


def test_select_counts_a_negative_token_from_the_end_and_refuses_one_outside(trained_weights, tok):
    """select(token=-1) silently selected token 0 (the slider clamps); 99 silently the last one."""
    ex = Explorer(ke.Session(trained_weights, tokenizer=tok), prompt="abc")
    with pytest.raises(IndexError, match="nothing is decoded yet"):
        ex.select(token=-1)
    ex.play_button.click()
    ex.select(token=0)
    ex.select(token=-1)
    assert ex.token.value == 2 and ex.text.selected == 2  # the last token
    ex.select(token=-3)
    assert ex.token.value == 0
    for bad in (3, -4):
        with pytest.raises(IndexError, match=rf"token={bad} is outside the history: it holds 3 tokens \(0\.\.2"):
            ex.select(token=bad)


def test_snapshot_of_nothing_says_snapshot_once(trained_weights, tok):
    ex = Explorer(ke.Session(trained_weights, tokenizer=tok), prompt="abc")
    ex.snapshot_button.click()
    assert is_red(ex.status.value) and plain(ex.status.value) == "snapshot: nothing is decoded yet: Step first"


# ---------------------------------------------------------------- 7. readable at K3 depth


def test_lens_strip_writes_a_readable_subset_of_cells_at_k3_depth():
    """93 cells of ~10 px each carried a top-1 text: they ran into each other. Past 32 layers, only the cells of the
    layers the axis names are written (at least MIN_TICK_GAP apart), in at most 4 characters; every hover has it."""
    tr = k3_sized(n_tokens=2)
    labels = layer_labels(tr)
    L = len(labels)
    rng = np.random.default_rng(0)
    top = rng.integers(0, 5000, size=(1, L, 3))
    lens = SimpleNamespace(top_ids=top, top_probs=rng.random((1, L, 3)), final_ids=np.array([top[0, -1, 0]]),
                           positions=np.array([1]), tokens=np.array([65]), layers=list(tr.layer_ids))
    data, layout = specs_analysis.lens_strip(lens, labels, None, 47)
    text = data[0]["text"][0]
    written = [j for j, x in enumerate(text) if x]
    assert [labels[j] for j in written] == list(layout["xaxis"]["tickvals"])  # under the named layers
    assert labels[47] in [labels[j] for j in written]
    assert min(np.diff(written)) >= specs.MIN_TICK_GAP and max(len(text[j]) for j in written) <= 4
    for j in range(L):
        assert f"#{top[0, j, 0]} p=" in data[0]["customdata"][0][j]


@pytest.mark.parametrize("view", ["block_token", "block_layer"])
def test_block_panels_name_every_source_at_k3_depth(view):
    """plotly dropped every other source label of K3's 9 (embedding, block 1..7, current) in a 300 px view: the
    source axis names each one, with SOURCE_ROW_PX a row (the view grows to that where it must)."""
    tr = k3_sized(n_tokens=6)
    sources = list(tr.source_labels())
    data, layout = specs.block_token(tr, 2, 47) if view == "block_token" else specs.block_layer(tr, 47, 2)
    for axis in ("yaxis", "yaxis2"):
        assert layout[axis]["tickvals"] == sources and layout[axis]["ticktext"] == sources
    v = PlotView(height=300)
    v.show(data, layout)
    shown = v.spec["layout"]
    plot_px = shown["height"] - shown["margin"]["t"] - shown["margin"]["b"]
    assert v.height == shown["height"] and plot_px * specs.PANEL / len(sources) >= specs.SOURCE_ROW_PX - 0.5


def fed_then_stepped(weights, tok) -> tuple[Explorer, int]:
    """An Explorer whose prompt (longer than WINDOW) was fed as one chunk by Play, then 3 tokens stepped."""
    prompt = "The cat sat on the mat, and then the dog sat on the cat. The end of it all."
    ex = Explorer(ke.Session(weights, tokenizer=tok), prompt=prompt, tab="Predictions")
    ex.play_button.click()  # fed as one chunk
    for _ in range(3):
        ex.step_button.click()  # stepped
    fed = len(tok.encode(prompt))
    assert len(ex.session) == fed + 3 and fed > specs.WINDOW
    ex.ablation.what.value = "KDA heads"
    ex.ablation.experts.value = "0"
    return ex, fed


def test_run_diff_of_every_token_is_windowed(trained_weights, tok):
    """'all tokens' drew every column of a long history squeezed into the width; it shows WINDOW of them around the
    selected token (pan to scroll), as every view over tokens."""
    ex, fed = fed_then_stepped(trained_weights, tok)
    n = len(ex.session)
    ex.select(token=n - 8, layer=2)
    ex.ablation.scope.value = "all tokens"
    ex.ablation.button.click()
    layout = ex.ablation.diff_view.spec["layout"]
    lo, hi = layout["xaxis"]["range"]
    assert hi - lo == specs.WINDOW and lo < n - 8 < hi
    assert layout["xaxis2"]["range"] == layout["xaxis3"]["range"] == [lo, hi]
    assert len(ex.ablation.diff_view.spec["data"][0]["x"]) == n  # every token is there to pan to
    ex.ablation.scope.value = "this token"  # one column: drawn at full width, as before
    ex.ablation.button.click()
    assert "range" not in ex.ablation.diff_view.spec["layout"]["xaxis"]


def test_ablation_note_names_the_tokens_fed_as_a_chunk(trained_weights, tok):
    """The note said the whole range 'was fed as a chunk' though its last tokens were stepped: it names the chunk,
    and says the stepped tokens after it read its rounding. A range of stepped tokens only has no such note."""
    ex, fed = fed_then_stepped(trained_weights, tok)
    ex.select(token=fed - 5, layer=2)
    ex.ablation.scope.value = "from this token on"
    ex.ablation.button.click()
    note = plain(ex.ablation.note.value)
    assert f"'as run' is tokens {fed - 5}-{fed + 2} re-decoded one by one" in note
    assert f"the session fed tokens {fed - 5}-{fed - 1} as a chunk" in note and "tokens stepped after it" in note
    ex.select(token=fed + 1)  # stepped tokens only: compared with the session itself
    ex.ablation.button.click()
    assert "chunk" not in plain(ex.ablation.note.value) and not is_red(ex.ablation.note.value)


def test_ablation_refuses_tokens_decoded_before_the_sessions_hooks_were_added(trained_weights, tok):
    """Tokens stepped without hooks, then hooks attached for good: the fork re-decodes them under those hooks, so the
    KL shown mixed the hooks' own effect into the ablation's (0.11 shown; 0.031 with both sides under the hooks, 0.055
    with neither). Refused, naming the tokens; after the hooks it goes on."""
    s = stepped(trained_weights, tok, b"The cat ")
    s.hooks.extend(iv.mask_sources(5, "both", "latest_block"))
    s.step(ord("s"))
    ex = Explorer(s, tab="Predictions")
    markup = ablate_head_3(ex, 7)
    assert is_red(markup) and "token 7 was decoded before the hooks the session holds now" in plain(markup)
    assert ex.ablation.view.spec == {}
    markup = ablate_head_3(ex, 8)
    assert not is_red(markup) and "KL at token 8" in plain(markup)
