"""A chunk's records stay whole in the Recorder (one [T, ...] block per key, `Recorder.chunk_put`) until
per-token rows are read. Whatever the history (feeds, steps, truncates, copies, a pipeline's hand-over),
every read must give what splitting each chunk into rows at once gives (the former route: a recorder
whose rows are read after every operation here), bit for bit and in history order, and the records must
stay those of stepping the same tokens, to the sequence path's tolerance (`test_sequence`)."""

from __future__ import annotations

import numpy as np
import pytest
from closeness import assert_traces_close

import kimi_explore as ke
from kimi_explore import KimiDecodeState, kimi_forward_token
from kimi_explore.backend import stand_in_device
from kimi_explore.inspection import interventions
from kimi_explore.inspection.hooks import HookChain
from kimi_explore.inspection.recorder import _as_blocks, per_token
from kimi_explore.inspection.stacked_rows import StackedRows
from kimi_explore.inspection.trace import Trace, stack_rows
from kimi_explore.model.kimi_sequence import kimi_forward_sequence

TOKENS = list(b"def f(x):\n    return x * 2  # the records of whole chunks\n")[:40]
SETTINGS = {  # Recorder arguments
    "default": {},
    # layer 2's defaults and logits only; full copies of a default site (recorded once), of a filtered-out
    # fresh site, of a filtered-out norm site, and of a site recorded nowhere by default
    "filter+full": {"names_filter": ["layers.2.*", "logits"],
                    "full": ["layers.2.moe.router.topk_ids", "layers.5.attn_res.ffn.weights", "layers.3.moe.routed_out",
                             "layers.4.kda.o"]},
    "top3": {"top_k": 3},
}
RAGGED = {"full": ["layers.*.mla.probs"]}  # rows of every width: chunk ends on the sequence path, t + 1 stepping


def split(rec) -> Trace:
    """Every record stacked anew from the recorder's records split into per-token rows."""
    d = rec.state_dict()
    return Trace.from_rows({k: v for k, v in per_token(d["blocks"]).items() if v}, d["tokens"], d["positions"], rec.meta)


def run(w, script, settings, read_every_time: bool):
    """script: ("feed", ids, chunk) / ("step", ids) / ("truncate", n) / ("trace",); a session after them."""
    s = ke.Session(w, recorder=ke.Recorder(**settings))
    for op, *args in script:
        if op == "feed":
            s.feed(args[0], chunk=args[1])
        elif op == "step":
            for t in args[0]:
                s.step(t)
        elif op == "truncate":
            s.truncate(args[0])
        else:
            s.trace()
        if read_every_time:
            s.recorder.state_dict()
    return s


SCRIPTS = {
    "feed": [("feed", TOKENS, 7)],
    "feed-step-feed": [("feed", TOKENS[:12], 5), ("step", TOKENS[12:15]), ("feed", TOKENS[15:], 4)],
    "traces-between": [("feed", TOKENS[:9], 4), ("trace",), ("step", TOKENS[9:11]), ("trace",), ("feed", TOKENS[11:], 40)],
    "truncate-in-chunk": [("feed", TOKENS[:20], 8), ("truncate", 11), ("step", TOKENS[11:13]), ("feed", TOKENS[13:], 6)],
    "one-token-chunks": [("step", TOKENS[:2]), ("feed", TOKENS[2:9], 1), ("step", TOKENS[9:11])],
}


@pytest.mark.parametrize("settings", list(SETTINGS))
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_a_history_of_feeds_and_steps_reads_as_split_rows_and_as_stepping(trained_weights, script, settings):
    w = trained_weights
    s = run(w, SCRIPTS[script], SETTINGS[settings], read_every_time=False)
    want = run(w, SCRIPTS[script], SETTINGS[settings], read_every_time=True)
    got = s.trace()  # blocks copied into the stacked records without being split
    assert got.equals(want.trace()) and len(got) == len(s)
    assert got.equals(split(s.recorder))  # now split: the per-token rows, in history order
    assert s.trace().equals(got)
    stepped = ke.Session(w, recorder=ke.Recorder(**SETTINGS[settings]))
    for t in s.tokens:
        stepped.step(t)
    assert_traces_close(got, stepped.trace(), 1e-4)


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_ragged_full_records_read_as_split_rows(trained_weights, script):
    s = run(trained_weights, SCRIPTS[script], RAGGED, read_every_time=False)
    want = run(trained_weights, SCRIPTS[script], RAGGED, read_every_time=True)
    assert s.trace().equals(want.trace()) and s.trace().equals(split(s.recorder))


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_ragged_full_records_read_as_stepping(trained_weights, script):
    """A fed chunk's mla.probs rows [nh, chunk end] read as the token form's [nh, t + 1]: the positions after each
    token are the Trace's NaN padding, as stepping's, not the chunk's masked 0."""
    s = run(trained_weights, SCRIPTS[script], RAGGED, read_every_time=False)
    stepped = ke.Session(trained_weights, recorder=ke.Recorder(**RAGGED))
    for t in s.tokens:
        stepped.step(t)
    assert_traces_close(s.trace(), stepped.trace(), 1e-4)


def test_state_dict_after_a_feed_then_a_truncate_inside_a_chunk(trained_weights):
    w = trained_weights
    s, whole = ke.Session(w), ke.Session(w)
    s.feed(TOKENS[:20], chunk=8)
    whole.feed(TOKENS[:20], chunk=8)
    s.truncate(11)  # inside the second chunk
    stepped = ke.Session(w)
    for t in TOKENS[:11]:
        stepped.step(t)
    d, full, steps = s.recorder.state_dict(), whole.recorder.state_dict(), stepped.recorder.state_dict()
    assert d["tokens"] == full["tokens"][:11] and d["positions"] == list(range(11))
    rows, full_rows, step_rows = per_token(d["blocks"]), per_token(full["blocks"]), per_token(steps["blocks"])
    assert list(rows) == list(full_rows) and sorted(rows) == sorted(step_rows)
    for k, v in rows.items():
        assert len(v) == 11, k
        for a, b, c in zip(v, full_rows[k][:11], step_rows[k], strict=True):
            assert a.shape == c.shape and a.dtype == c.dtype, k  # per-token, as stepping
            assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b), k
    assert rows["logits.top_ids"][3].shape == (10,) and rows["layers.1.moe.routed_out.norm"][3].shape == ()
    whole.truncate(11)
    assert s.step(9).tolist() == whole.step(9).tolist()
    assert s.trace().equals(whole.trace())


def test_copy_fork_save_and_load_of_unsplit_records(trained_weights, tmp_path):
    w = trained_weights
    s = ke.Session(w, recorder=ke.Recorder(**SETTINGS["filter+full"]))
    s.feed(TOKENS[:17], chunk=6)
    want = run(w, [("feed", TOKENS[:17], 6)], SETTINGS["filter+full"], read_every_time=True).trace()
    copy = s.recorder.copy()
    forked = s.fork()
    loaded = ke.Session.load_state(s.save_state(tmp_path / "s.npz"), w)
    for other in (copy.trace(), forked.trace(), loaded.trace(), s.trace()):
        assert other.equals(want)


def test_take_records_and_add_tokens_keep_the_order(trained_weights):
    """A pipeline stage hands over per-token rows (`take_records`); a recorder taking them (`add_tokens`)
    after its own fed chunks keeps its rows first."""
    w = trained_weights
    stage = ke.Recorder().bind(w)
    kimi_forward_sequence(w, KimiDecodeState.new(w), TOKENS[:13], stage, chunk=5)
    records = stage.take_records()
    assert len(stage.trace()) == 0 and all(len(v) == 13 for v in records.values())
    assert all(r.shape == records["logits.top_ids"][0].shape for r in records["logits.top_ids"])
    driver, ref = ke.Recorder().bind(w), ke.Recorder().bind(w)
    for rec in (driver, ref):
        kimi_forward_sequence(w, KimiDecodeState.new(w), TOKENS[20:27], rec, chunk=3)
        if rec is ref:
            rec.state_dict()
        rec.add_tokens(TOKENS[:13], range(7, 20), records)
    got = driver.trace()
    assert got.equals(ref.trace()) and len(got) == 20
    np.testing.assert_array_equal(got["logits.top_ids"][7:], np.stack(records["logits.top_ids"]))


def test_take_blocks_and_add_blocks_keep_chunks_whole_and_in_order(trained_weights):
    """What a pipeline stage hands over (`take_blocks`): a fed chunk as its one block, a stepped token as a one-row
    block, in order; a recorder taking them (`add_blocks`) after its own records, then stepping on, records what
    one recorder that saw it all records (trace and per-token state_dict)."""
    w = trained_weights
    stage, ref, driver = ke.Recorder().bind(w), ke.Recorder().bind(w), ke.Recorder().bind(w)
    state, ref_state = KimiDecodeState.new(w), KimiDecodeState.new(w)
    kimi_forward_sequence(w, ref_state, TOKENS[:10], ref, chunk=6)
    ref.begin_token(TOKENS[10], 10)
    kimi_forward_token(w, ref_state, TOKENS[10], hooks=ref)
    kimi_forward_sequence(w, state, TOKENS[:10], stage, chunk=6)  # a stage hands over after each chunk and token
    blocks = stage.take_blocks()
    assert len(stage.trace()) == 0 and stage.take_blocks() == {}
    assert [len(b) for b in blocks["logits.top_ids"]] == [6, 4]  # the two chunks whole
    driver.add_blocks(TOKENS[:10], range(10), blocks)
    stage.begin_token(TOKENS[10], 10)
    kimi_forward_token(w, state, TOKENS[10], hooks=stage)
    blocks = stage.take_blocks()
    assert [len(b) for b in blocks["logits.top_ids"]] == [1]
    driver.add_blocks(TOKENS[10:11], [10], blocks)
    for rec in (driver, ref):  # both step on from the same state
        rec.begin_token(TOKENS[11], 11)
        kimi_forward_token(w, ref_state.copy(), TOKENS[11], hooks=rec)
    got = driver.trace()
    assert got.equals(ref.trace()) and len(got) == 12
    d, r = driver.state_dict(), ref.state_dict()
    d_rows, r_rows = per_token(d["blocks"]), per_token(r["blocks"])
    assert d["tokens"] == r["tokens"] and d["positions"] == r["positions"] and d_rows.keys() == r_rows.keys()
    for k in r_rows:
        assert len(d_rows[k]) == 12
        for a, b in zip(d_rows[k], r_rows[k], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=k)


def test_ragged_routing_and_token_by_token_layers_inside_chunks(trained_weights):
    """Experts dropped at layer 5 at some tokens (routing ids recorded without their -1 entries: one-row
    blocks) and a per-token hook at layer 2 (that layer's sites record one row at a time inside each
    chunk), through chunks, stepped tokens, and chunks again."""
    w, tokens = trained_weights, TOKENS[:30]

    def chained():
        rec = ke.Recorder().bind(w)
        rec.add("layers.2.attn.out", lambda v, hook: None)
        return rec, HookChain(interventions.ablate_experts(5, [3, 7], positions=range(4, 20)).bind(w), rec)

    def step(state, chain, ids, start):
        for p, t in enumerate(ids, start=start):
            chain.begin_token(t, p)
            ke.kimi_forward_token(w, state, t, hooks=chain)

    step_rec, chain = chained()
    step(KimiDecodeState.new(w), chain, tokens, 0)
    seq_rec, chain = chained()
    state = KimiDecodeState.new(w)
    kimi_forward_sequence(w, state, tokens[:9], chain, chunk=4)
    step(state, chain, tokens[9:12], 9)
    kimi_forward_sequence(w, state, tokens[12:], chain, chunk=7)
    got = seq_rec.trace()
    assert (got["layers.5.moe.router.topk_ids"][4:20] == -1).any() and len(got) == 30
    assert got.equals(split(seq_rec))
    assert_traces_close(got, step_rec.trace(), 1e-4)


@pytest.mark.parametrize("seed", range(12))
def test_stacked_rows_with_blocks_under_random_histories(seed):
    """StackedRows.sync(blocks, rows, n) against stack_rows of the rows the blocks and rows hold, under random rows,
    blocks (widths 0-3, 1 or 2 axes, int/float dtypes), seals (rows made blocks, as the Recorder's `_as_blocks`),
    cuts, truncates and reads; views keep their values."""
    rng = np.random.default_rng(seed)
    two_axes = bool(seed % 2)
    dtypes = [np.int64, np.float32, np.float64] if seed % 3 else [np.float32]
    rows, blocks, st, views = [], [], StackedRows(), []

    def shape():
        width = int(rng.integers(0, 4)) if rng.random() < 0.3 else 2
        return (2, width) if two_axes else (width,)

    def dtype():
        return dtypes[int(rng.integers(0, len(dtypes)))]

    def seal():
        blocks.extend(_as_blocks("r", rows))
        rows.clear()

    for _ in range(200):
        op = rng.integers(0, 12)
        if op < 3:  # a stepped token
            rows.append(rng.integers(-5, 5, shape()).astype(dtype()))
        elif op < 6:  # a chunk: the rows before it are sealed first
            seal()
            m = int(rng.integers(1, 9))
            blocks.append(rng.integers(-5, 5, (m, *shape())).astype(dtype()))
        elif op < 7:
            seal()
        elif op < 9 and (rows or blocks):  # a cut, as the Recorder's `_cut_records`
            total = len(rows) + sum(len(b) for b in blocks)
            n, have, kept = int(rng.integers(0, total + 1)), 0, []
            for b in blocks:
                if have >= n:
                    break
                kept.append(b[: n - have])
                have += len(kept[-1])
            blocks[:] = kept
            del rows[max(n - have, 0):]
            st.truncate(n)
        else:
            total = len(rows) + sum(len(b) for b in blocks)
            n = int(rng.integers(0, total + 1)) if rng.random() < 0.3 else total
            every = [r for b in blocks for r in b] + rows
            got, want = st.sync(blocks, rows, n), stack_rows(every[:n])
            assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True)
            if n:
                views.append((got, got.copy()))
    for view, copy in views:
        assert np.array_equal(view, copy, equal_nan=True)


def test_feed_then_steps_on_a_device(trained_weights):
    """On a device (the strict stand-in of test_gpu_standin) a chunk's records reach the host later
    (`Recorder.flush`); a token stepped after the chunk still records after them."""
    from strict_device import StrictDevice

    script = [("feed", TOKENS[:10], 4), ("step", TOKENS[10:13]), ("feed", TOKENS[13:20], 3), ("step", TOKENS[20:22])]
    host = run(trained_weights, script, {}, read_every_time=True).trace()
    with stand_in_device(StrictDevice()):
        w = ke.from_pretrained(ke.tiny_checkpoint(), device="gpu")
        got = run(w, script, {}, read_every_time=False).trace()
    assert_traces_close(got, host, 1e-5)


def test_long_histories_stay_blocks_through_steps_forks_and_files(trained_weights, tmp_path):
    """A fed chunk's records stay one array per key through a step after it, a state_dict, a fork and a file: the
    stepped rows are sealed into one block before the next chunk or a state_dict (each was split into per-token rows:
    +52 MiB after 8,192 tokens, and a fork ten times the time). The records read as stepping's all along."""
    w = trained_weights
    s = ke.Session(w)
    s.feed(TOKENS[:24], chunk=8)
    for t in TOKENS[24:27]:
        s.step(t)
    assert all(len(s.recorder._blocks[k]) == 3 and len(rows) == 3 for k, rows in s.recorder._rows.items() if rows)
    s.feed(TOKENS[27:35], chunk=8)  # the three stepped rows become one block before this chunk's
    d = s.recorder.state_dict()
    assert {len(b) for b in d["blocks"].values()} == {5}
    assert [len(b) for b in d["blocks"]["logits.top_ids"]] == [8, 8, 8, 3, 8]
    forked = s.fork()
    loaded = ke.Session.load_state(s.save_state(tmp_path / "s.npz"), w)
    blocks = loaded.recorder.state_dict()["blocks"]
    assert all(len(b) == 1 for k, b in blocks.items() if not k.endswith("mla.probs"))  # one [35, ...] block each
    for other in (forked, loaded):
        assert {len(b) for b in other.recorder.state_dict()["blocks"].values()} <= {1, 5}
        assert other.trace().equals(s.trace())
    stepped = ke.Session(w)
    for t in TOKENS[:35]:
        stepped.step(t)
    assert_traces_close(s.trace(), stepped.trace(), 1e-4)
    assert per_token(d["blocks"]).keys() == per_token(stepped.recorder.state_dict()["blocks"]).keys()
