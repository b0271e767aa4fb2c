"""A newcomer's review: the README's snippets run as written, and the first mistakes a user makes on the
CLI and the top-level API get a clear error naming the argument, expected vs found (not an
AttributeError deep inside, a file written where it must not be, or a silently different result)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from test_cli import run_main

import kimi_explore as ke
from kimi_explore.weights.tiny_model import tiny_checkpoint

ROOT = Path(__file__).parents[1]


def readme_block(containing: str) -> str:
    """The README's ```python block holding `containing` (exactly one)."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S) if containing in b]
    assert len(blocks) == 1, f"{len(blocks)} README python blocks hold {containing!r}"
    return blocks[0]


@pytest.fixture(scope="module")
def trained():
    return ke.from_pretrained(tiny_checkpoint())


# --- the README, as written ---------------------------------------------------------------------------

def test_readme_compare_snippet_runs_from_the_repository_root(monkeypatch):
    """It named `llamacpp_f32experts_decode.npz` beside the checkpoint; the file is in `e/llamacpp/`."""
    monkeypatch.chdir(ROOT)
    ns = {"ke": ke}
    exec(readme_block('names="llama.cpp")'), ns)
    first = str(ns["cmp"].first)
    # what the README's comment says cmp.first prints
    for words in ("token 0, layer 0, layers.0.kda.state", "local", "KDA q/k L2 norm", "eps 1e-05"):
        assert words in first


def test_readme_decoder_and_session_walkthrough_runs(monkeypatch, tmp_path):
    """The decoder, hooks/session and whole-text blocks in order, with the README's stated shapes."""
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(readme_block("logits = ke.kimi_forward_token(weights, state, 72)   # one token"), ns)
    assert ns["logits"].shape == (256,) and ns["state"].position == 1
    exec(readme_block("hooks = ke.Hooks()"), ns)
    session = ns["session"]
    assert len(session.tokens) == 4  # "Kimi K3": 7 tokens, back() then truncate(3), then one step
    trace = session.trace()
    assert trace.routing()["topk_ids"].shape == (4, 7, 2)  # [token, moe_layer, top_k]
    assert trace.attn_res_weights().shape[:3] == (4, 8, 2)  # [token, layer, site, source]
    ns["ids"], ns["text"] = [72, 101, 108, 108, 111], "more text"
    exec(readme_block("ke.kimi_forward_sequence(weights, state, ids"), ns)
    assert ns["logits"].shape == (256,)


# --- the CLI ------------------------------------------------------------------------------------------

def test_an_empty_checkpoint_argument_is_refused_not_the_embedded_model(capsys):
    """`--checkpoint "$DIR"` with DIR unset ran the embedded model without a word."""
    code, out, err = run_main(["--ids", "65", "--checkpoint", ""], capsys)
    assert code == 2 and out == ""
    assert err.startswith("kimi-explore: error: argument --checkpoint: empty") and err.count("\n") == 1


def test_make_tiny_refuses_zero_shards(tmp_path, capsys):
    """--shards 0 wrote `model-00001-of-00000.safetensors` and said it had worked."""
    code, _, err = run_main(["make-tiny", "--layers", "4", "--experts", "4", "--top-k", "2", "--shards", "0",
                             "--out", str(tmp_path / "k")], capsys)
    assert code == 2 and "--shards must be >= 1, got 0" in err and err.count("\n") == 1
    assert not (tmp_path / "k").exists()


def test_make_tiny_never_overwrites_a_checkpoint(tmp_path, capsys):
    """--out pointing at a checkpoint overwrote its config.json and shards (the embedded model's too)."""
    out = tmp_path / "k"
    assert run_main(["make-tiny", "--layers", "4", "--experts", "4", "--top-k", "2", "--out", str(out)], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = run_main(["make-tiny", "--layers", "6", "--experts", "8", "--top-k", "2", "--out", str(out)], capsys)
    assert code == 2 and "already holds a checkpoint" in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("command", ["make-tiny", "report"])
def test_an_out_that_is_a_file_is_one_line(command, tmp_path, capsys):
    """make-tiny showed a FileExistsError traceback; report an errno message that did not name --out."""
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    extra = ["--layers", "4", "--experts", "4", "--top-k", "2"] if command == "make-tiny" else ["--ids", "65"]
    code, out, err = run_main([command, "--out", str(f), *extra], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"kimi-explore {command}: error: --out {f}: exists and is not a directory")
    assert f.read_text() == "keep me"


# --- the top-level API --------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [None, 123, ""], ids=["None", "int", "empty"])
def test_from_pretrained_names_a_bad_path(path):
    """None and 123 raised pathlib's 'expected str, bytes or os.PathLike object'; '' looked for ./config.json."""
    with pytest.raises(TypeError, match=r"from_pretrained: path=.*expected a checkpoint directory, a \.gguf file or "
                                        r"a Hub repo id"):
        ke.from_pretrained(path)


@pytest.mark.parametrize("bad", ["path", "None"])
def test_a_state_needs_loaded_weights(bad):
    """KimiDecodeState.new(path) raised AttributeError: 'PosixPath' object has no attribute 'layers'."""
    arg = tiny_checkpoint() if bad == "path" else None
    with pytest.raises(TypeError, match="KimiDecodeState.new: weights: expected the model from ke.from_pretrained"):
        ke.KimiDecodeState.new(arg)


def test_swapped_weights_and_state_are_named(trained):
    state = ke.KimiDecodeState.new(trained)
    with pytest.raises(TypeError, match=r"weights: expected the model .* got KimiDecodeState .*swapped"):
        ke.kimi_forward_token(state, trained, 72)
    with pytest.raises(TypeError, match="state: expected a KimiDecodeState"):
        ke.kimi_forward_sequence(trained, trained, [72])


@pytest.mark.parametrize("hooks", [{"layers.0.attn.in": print}, [("layers.0.attn.in", print)]], ids=["dict", "list"])
def test_hooks_of_the_wrong_type_are_named(trained, hooks):
    """A dict or a TransformerLens-style list of (name, fn) raised AttributeError: no attribute 'fire'."""
    for forward, arg in ((ke.kimi_forward_token, 72), (ke.kimi_forward_sequence, [72, 101])):
        with pytest.raises(TypeError, match=r"hooks: expected None or a ke.Hooks .* got " + type(hooks).__name__):
            forward(trained, ke.KimiDecodeState.new(trained), arg, hooks=hooks)


def test_hook_names_of_a_config_is_named(trained):
    with pytest.raises(TypeError, match="hook_names: expected the model .* got KimiDecoderConfig"):
        ke.hook_names(trained.config)


def test_a_float64_models_state_is_refused_not_run_in_float64(trained):
    """It ran: the state stayed float64 under float32 weights, the logits off by ~4e-6, without a word."""
    w64 = ke.from_pretrained(tiny_checkpoint(), dtype="float64")
    state = ke.KimiDecodeState.new(w64)
    for forward, arg in ((ke.kimi_forward_token, 72), (ke.kimi_forward_sequence, [72, 101])):
        with pytest.raises(ValueError, match=r"state.layers\[0\] is not a state of these weights: expected kda "
                                             r"recurrent 4 x 32 x 32 in float32, found 4 x 32 x 32 in float64"):
            forward(trained, state, arg)
    assert state.position == 0 and not np.any(state.layers[0].attention.recurrent)


def test_another_models_state_is_refused_before_a_kernel_fails(trained, tmp_path, capsys):
    """Same layer count and kinds, other widths: it failed inside kda.shift_in ('window float32 [C, W] ...')."""
    out = tmp_path / "k8"
    assert run_main(["make-tiny", "--layers", "8", "--experts", "4", "--top-k", "2", "--out", str(out)], capsys)[0] == 0
    other = ke.from_pretrained(out)
    with pytest.raises(ValueError, match=r"state.layers\[0\] is not a state of these weights: expected kda recurrent "
                                         r"4 x 32 x 32 in float32, found 16 x 16 x 16 in float32"):
        ke.kimi_forward_token(trained, ke.KimiDecodeState.new(other), 72)
    kda_only = ke.from_pretrained(tiny_checkpoint(), layers=[0, 1, 2, 4])
    first4 = ke.from_pretrained(tiny_checkpoint(), layers=range(4))  # layer 3 is MLA
    with pytest.raises(ValueError, match=r"state.layers\[3\] is a kda state but these weights' layer 3 is mla"):
        ke.kimi_forward_token(first4, ke.KimiDecodeState.new(kda_only), 72)
    assert ke.kimi_forward_token(kda_only, ke.KimiDecodeState.new(kda_only), 72).shape == (256,)


def test_the_verdict_says_when_it_lists_only_some_disagreements():
    """Notebook 08 printed '(5 with a percentile gap >= 0.5): ' and then four cells."""
    from kimi_explore.analysis.source_ablation import SourceAblation

    # mass rises with the row while KL falls: every cell's ranks are reversed
    rows = [{"layer": i, "site": "ffn", "family": "current", "mass": 0.1 * i, "kl": 1.0 - 0.1 * i, "delta_loss": 0.0}
            for i in range(12)]
    verdict = SourceAblation(rows, n_tokens=10, clean_loss=1.0).verdict("kl")
    line = next(line for line in verdict.splitlines() if line.startswith("Cells where"))
    n_gap = sum(abs(i - (11 - i)) / 11 >= 0.5 for i in range(12))
    assert n_gap > 4 and f"(the 4 furthest apart of {n_gap} with a percentile gap >= 0.5)" in line
    assert line.count("(mass ") == 4


def test_a_session_needs_loaded_weights():
    """Session(path) raised AttributeError: 'PosixPath' object has no attribute 'config'."""
    with pytest.raises(TypeError, match=r"Session: weights: expected the model .* got PosixPath \(a path: load it"):
        ke.Session(tiny_checkpoint())


@pytest.mark.parametrize("experts", [[99], [3, 16], [-1]], ids=["99", "16", "minus1"])
def test_ablating_an_expert_that_does_not_exist_is_refused(trained, experts):
    """ablate_experts(5, [99]) on a 16-expert model ablated nothing and said nothing (force_routing refuses it)."""
    session = ke.Session(trained)
    session.feed([72, 101, 108])
    with pytest.raises(ValueError, match=r"ablate_experts.*expert ids \[(99|16|-1)\] (are outside 0\.\.15|must be >= 0)"):
        with session.intervene(ke.interventions.ablate_experts(5, experts)):
            session.step(108)
    assert len(session) == 3


def test_ablating_experts_that_exist_still_changes_the_routing(trained):
    session = ke.Session(trained)
    session.feed([72, 101, 108])
    chosen = session.trace().routing()["topk_ids"][-1, 4].tolist()  # MoE layer 5 is the 5th MoE layer
    fork = session.fork()
    with fork.intervene(ke.interventions.ablate_experts(5, chosen)):
        fork.step(108)
    session.step(108)
    ids = fork.trace().routing()["topk_ids"][-1, 4]
    assert not set(ids.tolist()) & set(chosen) and not np.array_equal(fork.logits[-1], session.logits[-1])


def test_diff_of_two_models_is_refused_before_numpy_broadcasts(trained, tmp_path, capsys):
    """It raised 'operands could not be broadcast together with shapes (4,2) (4,4)' from inside diff."""
    out = tmp_path / "k8"
    assert run_main(["make-tiny", "--layers", "8", "--experts", "4", "--top-k", "2", "--out", str(out)], capsys)[0] == 0
    a, b = ke.Session(trained), ke.Session(ke.from_pretrained(out))
    a.feed([72, 101, 108])
    b.feed([72, 101, 108])
    with pytest.raises(ValueError, match=r"diff: the runs come from different models \(.*max_sources 4 vs 2.*\)"):
        ke.diff(a, b)
    c = ke.Session(trained)
    c.feed([1, 2, 3])
    assert len(ke.diff(a, c).kl) == 3  # two prompts of one model: still compared


def test_read_dump_of_a_file_that_is_not_safetensors_names_it(tmp_path):
    """It raised safetensors' 'Error while deserializing header: header too large', naming no file."""
    f = tmp_path / "captures.npz"
    np.savez(f, logits=np.zeros((2, 256), np.float32))
    with pytest.raises(ValueError, match=r"engine dump: .*captures\.npz: corrupt or truncated safetensors header"):
        ke.read_dump(f)


def test_a_sealed_block_reaches_the_ffn_site_at_a_blocks_first_layer_and_attention_one_later(trained):
    """Notebook 02 said the FFN site sees a new block at "a block's last layer"; it is the next block's first
    (boundaries 3 and 6 here: layer 7 is the second layer of the last block, as the notebook also says)."""
    session = ke.Session(trained)
    session.feed([72, 101, 108, 108, 111])
    trace = session.trace()
    w = trace.attn_res_weights()  # [token, layer, site, source]: NaN where a block is not sealed yet
    boundaries = trace.meta["block_boundaries"]
    assert boundaries == [0, 3, 6]
    for j, first in enumerate(boundaries[1:], start=1):  # source j = block j, sealed from the layers before `first`
        seen = {site: min(layer for layer in trace.layer_ids if np.isfinite(w[0, layer, s, j]))
                for s, site in enumerate(("attn", "ffn"))}
        assert seen == {"ffn": first, "attn": first + 1}
    nb = (ROOT / "notebooks" / "02_block_residuals.ipynb").read_text()
    assert "the site before the FFN sees it at that first layer and the site before attention one layer later" in nb


def test_a_prompt_without_a_tokenizer_says_to_pass_ids(tmp_path, capsys):
    """`kimi-explore --prompt` on a checkpoint with no tokenizer gave the tokenizer's error without the way out
    (`kimi-explore report` said "Pass --ids instead"); --ids on it decodes."""
    from kimi_explore.weights.tiny_model import make_text_config, write_checkpoint

    path = write_checkpoint(tmp_path / "v1000", make_text_config(vocab_size=1000), experts="bf16")
    code, out, err = run_main(["--checkpoint", str(path), "--prompt", "hi"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--prompt needs the checkpoint's tokenizer" in err and err.rstrip().endswith("Pass --ids instead")
    code, out, _ = run_main(["--checkpoint", str(path), "--ids", "1,999", "--generate", "1"], capsys)
    assert code == 0 and "generated ids (1 after the prompt)" in out


def test_tab_completion_offers_the_lazy_names():
    """dir(ke) left out every lazily imported name, so `ke.from_<TAB>` in Jupyter offered nothing."""
    names = dir(ke)
    assert {"from_pretrained", "Session", "Explorer", "tiny_checkpoint", "kimi_forward_token"} <= set(names)
    assert set(ke.__all__) <= set(names)
    ipython = pytest.importorskip("IPython.testing.globalipapp")
    ip = ipython.get_ipython()
    use_jedi, ip.Completer.use_jedi = ip.Completer.use_jedi, False  # IPython's own completer: it reads dir()
    try:
        ip.run_cell("import kimi_explore as ke")
        with warnings.catch_warnings():  # `complete` is pending deprecation; `completions` goes through jedi only
            warnings.simplefilter("ignore", PendingDeprecationWarning)
            matches = ip.complete("ke.from_")[1]  # "ke.from_pretrained" (IPython 8.12), ".from_pretrained" (8.39)
    finally:
        ip.Completer.use_jedi = use_jedi
    assert [m.rsplit(".", 1)[-1] for m in matches] == ["from_pretrained"], matches


def test_jedi_completion_offers_the_lazy_names():
    """Jupyter completes through jedi by default; it found hook_names but not from_pretrained."""
    jedi = pytest.importorskip("jedi")
    assert [c.name for c in jedi.Interpreter("ke.from_", [{"ke": ke}]).complete()] == ["from_pretrained"]


@pytest.mark.parametrize("hooks", [{"layers.0.attn.in": print}, [("layers.0.attn.in", print)], print, None],
                         ids=["dict", "list", "function", "None"])
def test_hook_sets_of_the_wrong_type_are_named_by_the_session(trained, hooks):
    """session.intervene(fn), Session(hooks=[(name, fn)]) and Hooks() + dict raised AttributeError ('handles', 'bind')."""
    session = ke.Session(trained)
    session.feed([72, 101])
    with pytest.raises(TypeError, match=r"Session.intervene: expected a ke.Hooks .* got " + type(hooks).__name__):
        with session.intervene(hooks):
            session.step(108)
    assert len(session) == 2 and len(session.hooks) == 0
    if hooks is not None:
        with pytest.raises(TypeError, match=r"Session: hooks: expected a ke.Hooks .* got " + type(hooks).__name__):
            ke.Session(trained, hooks=hooks)
        with pytest.raises(TypeError, match=r"expected a ke.Hooks"):
            ke.Hooks() + hooks


def test_a_tokenizer_path_is_named_by_the_session(trained):
    """Session(weights, tokenizer=path) failed at the first feed: 'PosixPath' has no attribute 'encode'
    (a str: 'unknown encoding')."""
    for path in (tiny_checkpoint(), str(tiny_checkpoint())):
        with pytest.raises(TypeError, match=r"Session: tokenizer: expected a tokenizer .* \(a path: load it with "
                                            r"ke.load_tokenizer\(path\)\)"):
            ke.Session(trained, tokenizer=path)


def test_saving_to_a_directory_is_refused_not_written_beside_it(trained, tmp_path):
    """save_state(DIR) and trace.save(DIR) wrote DIR.npz next to the directory."""
    session = ke.Session(trained)
    session.feed([72, 101])
    with pytest.raises(IsADirectoryError, match=r"save_state: .* is a directory; give a file path"):
        session.save_state(tmp_path)
    with pytest.raises(IsADirectoryError, match=r"Trace.save: .* is a directory; give a file path"):
        session.trace().save(tmp_path)
    assert not tmp_path.with_name(tmp_path.name + ".npz").exists()
    assert session.save_state(tmp_path / "s").name == "s.npz"


def test_a_hook_without_the_hook_keyword_is_refused_at_add(trained):
    """hooks.add(name, lambda v: ...) was accepted, then failed at the first site inside a decode:
    "<lambda>() got an unexpected keyword argument 'hook'"."""
    hooks = ke.Hooks()
    with pytest.raises(TypeError, match=r"Hooks.add: fn '.*<lambda>'\(v\) cannot be called as fn\(value, hook=\.\.\.\)"):
        hooks.add("layers.0.attn.in", lambda v: None)
    assert len(hooks) == 0
    seen = []
    hooks.add("layers.0.attn.in", lambda v, hook: seen.append(hook.name))  # TransformerLens's positional form
    hooks.add("layers.0.attn.in", lambda *args, **kwargs: None)
    ke.kimi_forward_token(trained, ke.KimiDecodeState.new(trained), 72, hooks=hooks)
    assert seen == ["layers.0.attn.in"]
