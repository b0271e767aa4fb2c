"""RayPipeline: a session over 2-4 Ray stage actors equals a single-process session bit for bit.

Every test compares against the same checkpoint decoded in this process (`KimiDecoderWeights` +
`Session`), token by token: logits, every recorded array, generated tokens, saved states. Ray is a
real local Ray started here (num_cpus=2, no dashboard), shut down at the end of the module.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import numpy as np
import pytest
from stage_loss import kill_stage

import kimi_explore as ke
from kimi_explore.inspection.interventions import ablate_experts, scale_kda_head
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

ray = pytest.importorskip("ray")

TOKENS = [17, 203, 5, 88, 88, 141, 250, 3, 64, 199, 7, 7, 31, 120]


pytestmark = pytest.mark.usefixtures("local_ray")


@pytest.fixture(scope="module")
def path():
    return random_tiny_checkpoint()  # 16 layers (KDA and MLA, a dense layer 0, MoE), one shard per 4 layers


@pytest.fixture(scope="module")
def weights(path):
    return ke.from_pretrained(path)


@pytest.fixture(scope="module")
def pipe3(path):
    with ke.RayPipeline(path, stages=3) as pipe:
        yield pipe


def intervention():
    """Value-changing hooks on layers held by different stages (3 stages: 0-5, 6-10, 11-15)."""
    return ablate_experts(4, "all") + scale_kda_head(9, 0, 0.5) + ablate_experts(13, [0, 1])


def assert_same_session(a: ke.Session, b: ke.Session) -> None:
    assert a.tokens == b.tokens
    assert np.array_equal(a.logits, b.logits), "logits differ"
    if a.recorder is not None:
        ta, tb = a.trace(), b.trace()
        assert sorted(ta.keys()) == sorted(tb.keys())
        for k in ta.keys():
            nan = ta[k].dtype.kind == "f"  # a record whose shape changes (an ablated routing) is NaN-padded
            assert ta[k].dtype == tb[k].dtype and np.array_equal(ta[k], tb[k], equal_nan=nan), k
        assert ta.equals(tb)


@pytest.mark.parametrize("stages", [2, 4, [range(0, 3), range(3, 12), range(12, 16)]])
def test_pipeline_decodes_as_one_process(path, weights, stages):
    one = ke.Session(weights)
    with ke.RayPipeline(path, stages=stages) as pipe:
        staged = ke.Session(pipe)
        assert np.array_equal(staged.feed(TOKENS), one.feed(TOKENS))
        assert staged.generate(6) == one.generate(6)
        assert_same_session(staged, one)


def test_interventions_run_on_the_stage_that_owns_their_site(pipe3, weights):
    one, staged = ke.Session(weights), ke.Session(pipe3)
    plain = ke.Session(weights)
    plain = np.concatenate([plain.feed(TOKENS[:4]), plain.feed(TOKENS[4:9])])  # the same chunks as below
    for s in (one, staged):
        s.feed(TOKENS[:4])
        with s.intervene(intervention()):
            s.feed(TOKENS[4:9])
        s.feed(TOKENS[9:])
    assert_same_session(staged, one)
    assert not np.array_equal(staged.logits[4:9], plain[4:9])  # the hooks did change the decode
    assert np.array_equal(staged.logits[:4], plain[:4])

    # persistent hooks, a recorder with its own hook and full records, a names_filter hook
    def double_probs(value, *, hook):
        return value * 2.0 if hook.position % 2 else None

    runs = []
    for w in (weights, pipe3):
        rec = ke.Recorder(full=["layers.14.ffn.out", "layers.2.kda.state"])
        rec.add("layers.7.moe.router.topk_weights", lambda v, *, hook: v[::-1].copy())
        s = ke.Session(w, recorder=rec, hooks=scale_kda_head(12, 1, 0.0))
        s.hooks.add(double_probs, names_filter=lambda n: n.endswith("mla.probs") and n.startswith("layers.11."))
        s.feed(TOKENS)
        runs.append(s)
    assert_same_session(runs[1], runs[0])


def test_history_truncate_fork_snapshot_and_files(pipe3, weights, tmp_path):
    one, staged = ke.Session(weights, checkpoint_every=4), ke.Session(pipe3, checkpoint_every=4)
    for s in (one, staged):
        s.feed(TOKENS[:10])
        s.truncate(6)
        s.step(99)
        s.back(2)
        snap = s.snapshot()
        s.feed([5, 6, 7])
        fork = s.fork()
        fork.feed([1, 2])
        s.restore(snap)
        s.feed([42])
        s.fork_ = fork
    assert_same_session(staged, one)
    assert_same_session(staged.fork_, one.fork_)
    assert staged.state.ids != staged.fork_.state.ids  # a fork holds its own states on the stages

    # a file saved from the pipeline continues in one process, and the other way round
    f1, f2 = staged.save_state(tmp_path / "staged.npz"), one.save_state(tmp_path / "one.npz")
    in_one, in_pipe = ke.Session.load_state(f1, weights), ke.Session.load_state(f2, pipe3)
    for s in (in_one, in_pipe, one):
        s.feed([3, 4])
    assert_same_session(in_pipe, one)
    assert_same_session(in_one, one)


def test_a_hook_error_in_a_stage_leaves_the_session_as_before(pipe3, weights):
    staged, one = ke.Session(pipe3), ke.Session(weights)
    staged.feed(TOKENS[:5])
    one.feed(TOKENS[:5])
    one.step(TOKENS[5])

    def bad(value, *, hook):
        raise ArithmeticError("boom in layer 13")

    with pytest.raises(ArithmeticError, match="boom in layer 13"), staged.hooked("layers.13.ffn.in", bad):
        staged.step(TOKENS[5])
    assert len(staged) == 5
    staged.step(TOKENS[5])
    assert_same_session(staged, one)


def test_stages_load_only_their_layers_and_shards(path, tmp_path):
    """Stage 1 of 4 (layers 4-7) needs model-00003 alone: loading it from a copy without the other
    shards (nor the one with the embedding and head) works; the pipeline's stages hold what they own."""
    part = tmp_path / "only_layers_4_7"
    part.mkdir()
    for f in ("config.json", "model.safetensors.index.json", "model-00003-of-00005.safetensors"):
        shutil.copy(path / f, part / f)
    w = ke.from_pretrained(part, layers=range(4, 8), embedding=False, head=False)
    assert w.embed_tokens is None and w.lm_head is None and w.layer_ids == [4, 5, 6, 7]
    with pytest.raises(ke.CheckpointError, match="model-00001-of-00005"):
        ke.from_pretrained(part, layers=range(4, 8))  # the head's shard is not there

    with ke.RayPipeline(path, stages=4) as pipe:
        reports = pipe.memory_reports()
    parts = reports  # MemoryReport: {component: bytes}
    assert parts[0]["embed_tokens"] > 0 and parts[0]["lm_head"] == 0
    assert all(p["embed_tokens"] == 0 and p["lm_head"] == 0 for p in parts[1:3])
    assert parts[3]["lm_head"] > 0 and parts[3]["embed_tokens"] == 0


def test_kill_a_stage_mid_feed_then_recover(path, weights):
    """ray.kill a stage while `feed` runs in another thread: the error names the stage and its layers,
    the history decoded so far is kept, and after `recover()` the session continues exactly."""
    tokens = (TOKENS * 20)[:200]
    with ke.RayPipeline(path, stages=3) as pipe:
        s = ke.Session(pipe, checkpoint_every=8)
        errors = []
        feeder = threading.Thread(target=lambda: _catch(errors, lambda: s.feed(tokens, chunk=4)))
        feeder.start()
        while len(s) < 12:
            time.sleep(0.001)
        ray.kill(pipe.stages[1].actor)
        feeder.join()
        assert len(errors) == 1 and isinstance(errors[0], ke.StageLostError), errors
        assert "stage 1 (layers 6-10)" in str(errors[0]) and "recover()" in str(errors[0])
        done = len(s)
        assert 12 <= done < len(tokens)
        with pytest.raises(ke.StageLostError, match="stage 1"):
            s.step(tokens[done])
        assert s.recover() == [1]
        s.feed(tokens[done:])
        expected = ke.Session(weights)  # the same forward passes in one process
        expected.feed(tokens[:done], chunk=4)
        expected.feed(tokens[done:])
        assert_same_session(s, expected)


def test_a_stage_crashing_inside_a_token_is_recovered(path, weights):
    """The stage's process exits in the middle of its layers (a hook calls os._exit)."""
    expected = ke.Session(weights)
    for t in TOKENS[:7]:  # the session steps while the intervention is on; after recover() it feeds
        expected.step(t)
    expected.feed(TOKENS[7:])

    def crash(value, *, hook):
        if hook.position == 7:
            os._exit(1)

    with ke.RayPipeline(path, stages=2) as pipe:
        s = ke.Session(pipe)
        with pytest.raises(ke.StageLostError, match=r"stage 1 \(layers 8-15\).*token 3 at position 7"):
            with s.intervene(_hook("layers.12.attn.out", crash)):
                s.feed(TOKENS)
        assert len(s) == 7
        assert s.recover() == [1]
        s.feed(TOKENS[7:])
        assert_same_session(s, expected)


def test_bad_arguments_are_named(path):
    with pytest.raises(ValueError, match="stages=0"):
        ke.RayPipeline(path, stages=0)
    with pytest.raises(ValueError, match="strictly increasing"):
        ke.RayPipeline(path, stages=[range(0, 4), range(3, 8)])
    with pytest.raises(ValueError, match="device"):
        ke.RayPipeline(path, device="tpu")
    with pytest.raises(TypeError, match="RayPipeline"):
        ke.Session(ke.from_pretrained(path, layers=[0])).recover()


def test_a_stage_that_cannot_load_is_named(path, tmp_path):
    broken = tmp_path / "no_layers_8_11"
    shutil.copytree(path, broken)
    (broken / "model-00004-of-00005.safetensors").unlink()
    with pytest.raises(ke.CheckpointError, match=r"stage 1 \(layers 8-15\) .* could not load: .*model-00004-of-00005"):
        ke.RayPipeline(broken, stages=2)


def _hook(name, fn):
    h = ke.Hooks()
    h.add(name, fn)
    return h


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        errors.append(e)


def test_analyses_on_a_pipeline_session(pipe3, weights):
    texts = ["def f(x):\n    return x", "The quick brown fox"]
    a, b = ke.routing_stats(pipe3, texts, progress=False), ke.routing_stats(weights, texts, progress=False)
    assert np.array_equal(a.counts, b.counts) and np.array_equal(a.weight_sum, b.weight_sum)
    assert np.array_equal(a.coactivation, b.coactivation) and np.array_equal(a.class_top1, b.class_top1)
    with pytest.raises(ValueError, match="a RayPipeline decodes in its own stages; use workers=1"):
        ke.routing_stats(pipe3, texts, progress=False, workers=2)

    runs = []
    for w in (pipe3, weights):
        s = ke.Session(w)
        s.feed(TOKENS)
        fork = s.fork()
        fork.truncate(5)
        with fork.intervene(ablate_experts(9, "all")):
            fork.feed(TOKENS[5:])
        runs.append((s, ke.diff(s, fork)))
    (_, d_pipe), (_, d_one) = runs
    for f in ("attn_res", "final_attn_res", "kda_state", "jaccard", "kl", "top1_a", "top1_b"):
        x, y = getattr(d_pipe, f), getattr(d_one, f)
        assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), f
    assert d_pipe.routing_changes == d_one.routing_changes and d_pipe.flips.any()
    (s_pipe, _), (s_one, _) = runs
    for targets in (None, "next"):
        lp, lo = ke.logit_lens(s_pipe, top=4, targets=targets), ke.logit_lens(s_one, top=4, targets=targets)
        for f in ("top_ids", "top_probs", "final_ids", "target_logprobs"):
            x, y = getattr(lp, f), getattr(lo, f)
            assert (x is None and y is None) or np.array_equal(x, y, equal_nan=True), f
    lenses = []
    for w in (pipe3, weights):  # the lens replays with the session's hooks, which run in the stages
        s = ke.Session(w, hooks=ablate_experts(9, "all"))
        s.feed(TOKENS[:6])
        lenses.append(ke.logit_lens(s).top_probs)
    assert np.array_equal(*lenses)
    with pytest.raises(TypeError, match="RayPipeline.*load_state"):
        ke.logit_attribution(s_pipe, -1)


def test_ray_is_imported_only_when_a_pipeline_is_made(path):
    import subprocess
    import sys

    code = ("import sys, kimi_explore as ke; s = ke.Session(ke.from_pretrained(sys.argv[1])); "
            "s.feed([1, 2]); s.fork(); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_recover_stops_at_a_token_decoded_under_a_temporary_intervention(path, weights):
    """Such a token cannot be replayed: recover() keeps the history before it, says so, and the
    session then continues exactly from there."""
    with ke.RayPipeline(path, stages=2) as pipe:
        s = ke.Session(pipe)
        s.feed(TOKENS[:3])
        with s.intervene(ablate_experts(12, "all")):
            s.feed(TOKENS[3:5])
        s.feed(TOKENS[5:8])
        kill_stage(pipe, 1)
        with pytest.raises(RuntimeError, match="replaying token 3 .* first 3 tokens"):
            s.recover()
        assert len(s) == 3
        s.feed(TOKENS[3:8])
        expected = ke.Session(weights)
        expected.feed(TOKENS[:3])
        expected.feed(TOKENS[3:8])
        assert_same_session(s, expected)


# mutation: a restarted stage was not re-configured, so its hooks and recorder were missing after `recover()`
def test_mutation_a_restarted_stage_gets_the_sessions_hooks_and_recorder_again(path, weights):
    """The driver must not take a restarted stage for one that still holds the hooks it was given. Two ways
    the replay alone does not give them back: a session whose replay configures the stages exactly as before
    (no recorder: the same hook set), and one whose history is empty when it recovers (nothing replayed)."""
    with ke.RayPipeline(path, stages=2) as pipe:  # stage 1: layers 8-15, where the hooks below act
        # no recorder, persistent value-changing hooks on stage 1's layers: the replay must run them there
        s = ke.Session(pipe, recorder=False, hooks=intervention())
        expected = ke.Session(weights, recorder=False, hooks=intervention())
        plain = ke.Session(weights, recorder=False)
        s.feed(TOKENS[:6])
        kill_stage(pipe, 1)
        assert s.recover() == [1]
        s.feed(TOKENS[6:])
        expected.feed(TOKENS)
        assert_same_session(s, expected)
        assert not np.array_equal(plain.feed(TOKENS), expected.logits)  # the hooks do change these logits

        # a recorder with a hook of its own, and full records; the stage is lost while the history is empty
        def session(w):
            rec = ke.Recorder(full=["layers.12.ffn.out"])
            rec.add("layers.11.moe.router.topk_weights", lambda v, *, hook: v[::-1].copy())  # by value to the stage
            return ke.Session(w, recorder=rec, hooks=scale_kda_head(9, 1, 0.0))

        s, expected = session(pipe), session(weights)
        s.feed(TOKENS[:3])
        s.truncate(0)
        kill_stage(pipe, 1)
        assert s.recover() == [1]
        s.feed(TOKENS)
        expected.feed(TOKENS)
        assert_same_session(s, expected)
        assert s.trace()["layers.12.ffn.out"].shape == (len(TOKENS), weights.config.hidden_size)


def test_integer_source_columns_count_model_wide_on_every_stage(pipe3, weights):
    """A stage holds some layers only, but an integer source column is the model's (`Trace.source_labels()`):
    each stage's hooks are told the whole pipeline's columns, so a mask of block 2, of the last block and of the
    current sum acts where stepping in one process acts (before, a stage's hooks could not place such a column)."""
    from kimi_explore.inspection.source_masks import mask_sources

    S = weights.max_sources
    runs = []
    for w in (weights, pipe3):
        s = ke.Session(w)
        s.feed(TOKENS[:3])
        with s.intervene(mask_sources("all", "both", [2, S - 2], positions=range(3, 9))):
            s.feed(TOKENS[3:9])
        with s.intervene(mask_sources(range(6, 16), "ffn", [-1], positions=[9, 10])):
            s.feed(TOKENS[9:])
        runs.append(s)
    assert_same_session(runs[1], runs[0])
    plain = ke.Session(weights)
    plain.feed(TOKENS)
    assert not np.array_equal(runs[0].logits[3:9], plain.logits[3:9])  # the masks did act


def test_compare_over_a_pipeline_is_refused_naming_the_in_process_route(pipe3, weights):
    """compare's replays record what kimi_explore computes before patching the other engine's values in, in this
    process; a pipeline's hooks run in its stages, so nothing came back and compare crashed in its shape check."""
    s = ke.Session(weights)
    s.feed(TOKENS[:4])
    theirs = {"logits": s.logits, "tokens": np.array(TOKENS[:4])}
    assert ke.compare(ke.Session(weights), theirs).first is None  # in process: compared
    with pytest.raises(TypeError, match=r"compare: a RayPipeline runs hooks in its stages.*ke\.from_pretrained\(path\)"):
        ke.compare(ke.Session(pipe3), theirs)
