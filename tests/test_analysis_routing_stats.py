"""Corpus routing statistics against plain loops over each text's trace, and resuming from checkpoints.

The reference decodes each text in its own default-recorder Session and counts from
`trace.routing()` token by token with dicts; MI is the textbook sum over the joint table.
"""

from __future__ import annotations

import json
import math
import os
import string
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from strict_device import StrictDevice

import kimi_explore as ke
from kimi_explore.analysis import routing_stats as routing_stats_module
from kimi_explore.analysis.routing_stats import byte_class
from kimi_explore.backend import stand_in_device

TEXTS = ["The cat, 12 cats.\n", "Hello world!", "a b c\n\n9", "Zz-top 0"]


def by_hand(w, texts):
    counts, weights, pairs, joint = Counter(), Counter(), Counter(), Counter()
    n = 0
    for text in texts:
        s = ke.Session(w)
        ids = list(text.encode())
        s.feed(ids)
        r = s.trace().routing()
        for t, tok in enumerate(ids):
            n += 1
            for j, layer in enumerate(r["moe_layers"]):
                sel = [int(e) for e in r["topk_ids"][t, j]]
                for e, we in zip(sel, r["topk_weights"][t, j], strict=True):
                    counts[layer, e] += 1
                    weights[layer, e] += float(we)
                for e in sel:
                    for f in sel:
                        pairs[layer, e, f] += 1
                joint[layer, byte_class(tok), sel[0]] += 1
    return counts, weights, pairs, joint, n


@pytest.fixture(scope="module", params=[("reference", 1), ("random_tiny", 1), ("reference", 2)],
                ids=["reference", "random_tiny", "reference-workers2"])
def model(request, ref_weights, tiny_weights):
    name, workers = request.param
    w = ref_weights if name == "reference" else tiny_weights
    return w, ke.routing_stats(w, TEXTS, progress=False, workers=workers), by_hand(w, TEXTS), workers


# Forked workers run one BLAS thread, this process the machine's default: OpenBLAS's one- and many-thread sgemm round
# float32 differently (this model's routing weights up to ~1e-6 apart between 1 and 2 threads, 2026-12-07), so weight
# sums made across them agree to ~1e-6 relative, not bit for bit; one thread on both sides is bit for bit
# (`test_workers_give_one_process_result_bit_for_bit`).
ACROSS_BLAS_THREADS = 1e-5


def test_counts_weights_and_coactivation_match_the_traces(model):
    w, st, (counts, weights, pairs, _, n), workers = model
    rel = 1e-6 if workers == 1 else ACROSS_BLAS_THREADS
    E = w.config.num_experts
    assert st.tokens == n == sum(len(x) for x in TEXTS) and st.num_experts == E
    for j, layer in enumerate(st.moe_layers):
        for e in range(E):
            assert st.counts[j, e] == counts[layer, e]
            assert st.weight_sum[j, e] == pytest.approx(weights[layer, e], rel=rel)
            if counts[layer, e]:
                assert st.mean_weight[j, e] == pytest.approx(weights[layer, e] / counts[layer, e], rel=rel)
            else:
                assert np.isnan(st.mean_weight[j, e]) and e in st.dead_experts[layer]
            for f in range(E):
                assert st.coactivation[j, e, f] == pairs[layer, e, f]
    assert np.all(st.counts.sum(axis=1) == n * w.config.num_experts_per_token)


def test_load_statistics_and_mutual_information_by_hand(model):
    w, st, (counts, _, _, joint, n), _ = model
    E = w.config.num_experts
    for j, layer in enumerate(st.moe_layers):
        load = [counts[layer, e] for e in range(E)]
        mean = sum(load) / E
        assert st.max_over_mean[j] == pytest.approx(max(load) / mean)
        assert st.cv[j] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in load) / E) / mean)
        cells = {(c, e): k for (lay, c, e), k in joint.items() if lay == layer}
        pc, pe = Counter(), Counter()
        for (c, e), k in cells.items():
            pc[c] += k / n
            pe[e] += k / n
        mi = sum(k / n * math.log2((k / n) / (pc[c] * pe[e])) for (c, e), k in cells.items())
        assert st.mutual_information()[j] == pytest.approx(mi, abs=1e-12)
        assert st.table()[j]["mi_bits"] == pytest.approx(mi, abs=1e-12)


def test_byte_classes():
    assert {byte_class(b) for b in string.ascii_letters.encode()} == {"letter"}
    assert {byte_class(b) for b in string.digits.encode()} == {"digit"}
    assert {byte_class(b) for b in string.punctuation.encode()} == {"punctuation"}
    assert [byte_class(b) for b in b" \t\n\r"] == ["space", "space", "newline", "newline"]
    assert byte_class(0xE4) == "other" and byte_class(7) == "other"


@pytest.mark.parametrize("workers", [1, 2])
def test_a_saved_partial_result_resumes_to_the_full_result(ref_weights, tmp_path, workers, monkeypatch):
    full = ke.routing_stats(ref_weights, TEXTS, progress=False)
    path = tmp_path / "stats.npz"
    calls = []

    def failing_on_text_3(tok):
        calls.append(tok)
        if tok == ord("Z"):
            raise KeyboardInterrupt  # an interrupted long run
        return byte_class(tok)

    with pytest.raises(KeyboardInterrupt):
        ke.routing_stats(ref_weights, TEXTS, progress=False, checkpoint=path, checkpoint_every=1, classes=failing_on_text_3,
                         workers=workers)
    partial = ke.RoutingStats.load(path)
    assert len(partial.texts) == 3 and partial.tokens == sum(len(x) for x in TEXTS[:3])
    calls.clear()
    resumed = ke.routing_stats(ref_weights, TEXTS, progress=False, checkpoint=path, classes=byte_class, workers=workers)
    for name in ("counts", "coactivation"):
        np.testing.assert_array_equal(getattr(resumed, name), getattr(full, name))
    np.testing.assert_allclose(resumed.weight_sum, full.weight_sum, rtol=1e-6 if workers == 1 else ACROSS_BLAS_THREADS)
    assert resumed.class_names == full.class_names and resumed.tokens == full.tokens
    np.testing.assert_array_equal(resumed.class_top1, full.class_top1)
    def no_decoding(*args):
        raise AssertionError("a text the checkpoint holds was decoded again")

    monkeypatch.setattr(routing_stats_module, "_routing", no_decoding)
    again = ke.routing_stats(ref_weights, TEXTS, progress=False, checkpoint=path, classes=byte_class)
    assert again.tokens == full.tokens and again.class_names == full.class_names  # everything was done
    with pytest.raises(ValueError, match="the checkpoint counted token id .* this call's classes= puts it in 'all'"):
        ke.routing_stats(ref_weights, TEXTS, progress=False, checkpoint=path, classes=lambda i: "all")  # not its result


def test_bad_arguments_are_named(ref_weights):
    with pytest.raises(TypeError, match="classes must be a function token id -> class label .* got dict"):
        ke.routing_stats(ref_weights, TEXTS, progress=False, classes={97: "a"})
    for bad in ("x", -1, 0, 2.5, True):
        with pytest.raises(ValueError, match="checkpoint_every must be a positive int"):
            ke.routing_stats(ref_weights, TEXTS, progress=False, checkpoint_every=bad)


def test_a_checkpoint_refuses_other_texts_or_another_model(ref_weights, tiny_weights, tmp_path):
    path = tmp_path / "stats.npz"
    ke.routing_stats(ref_weights, TEXTS[:2], progress=False, checkpoint=path)
    with pytest.raises(ValueError, match="text 1 of this call differs"):
        ke.routing_stats(ref_weights, [TEXTS[0], "other"], progress=False, checkpoint=path)
    with pytest.raises(ValueError, match="made with another model"):
        ke.routing_stats(tiny_weights, TEXTS, progress=False, checkpoint=path)
    np.savez(tmp_path / "junk.npz", x=np.zeros(1))
    with pytest.raises(ValueError, match="not a routing-stats checkpoint"):
        ke.RoutingStats.load(tmp_path / "junk.npz")


def test_progress_bar_and_inputs(ref_weights, capsys):
    st = ke.routing_stats(ref_weights, "abc", progress=True)
    assert st.tokens == 3 and "routing_stats" in capsys.readouterr().err
    ids = ke.routing_stats(ref_weights, [list(b"abc")], progress=False)
    np.testing.assert_array_equal(ids.counts, st.counts)


WORKERS_SCRIPT = """
import json, sys
import numpy as np
import kimi_explore as ke
w = ke.from_pretrained(ke.tiny_checkpoint(), device="cpu")
texts = json.loads(sys.argv[1])
one, two = (ke.routing_stats(w, texts, progress=False, workers=n) for n in (1, 2))
for name in ("counts", "weight_sum", "coactivation", "class_top1"):
    assert np.array_equal(getattr(one, name), getattr(two, name)), name
assert (one.tokens, one.texts, one.class_names) == (two.tokens, two.texts, two.class_names)
print("same", one.tokens)
"""


def test_workers_give_one_process_result_bit_for_bit():
    """Forked workers (one BLAS thread each) against this process with one BLAS thread (set before NumPy loads: a
    process of its own): every count and every weight sum identical, an empty text and a one-token text included."""
    texts = [TEXTS[0] * 40, "", "x", TEXTS[1] * 70, TEXTS[2] * 30, TEXTS[3]]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", WORKERS_SCRIPT, json.dumps(texts)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["same", str(sum(len(t) for t in texts))]


def _dies(ids):  # a worker's decode that ends its process (module level: a worker finds it by name)
    os._exit(3)


def _raises(ids):
    raise ArithmeticError(f"no routing for a text of {len(ids)} tokens")


def test_a_failing_worker_names_the_text_and_stops_the_run(ref_weights, monkeypatch):
    from kimi_explore.analysis import routing_stats as module

    monkeypatch.setattr(module, "_worker_routing", _raises)
    with pytest.raises(ArithmeticError, match="no routing for a text of 18 tokens") as raised:
        ke.routing_stats(ref_weights, TEXTS, progress=False, workers=2)
    assert _where(raised.value) == "routing_stats: while decoding text 0 of the call"
    monkeypatch.setattr(module, "_worker_routing", _dies)
    with pytest.raises(RuntimeError, match="worker process ended abruptly while decoding text 0"):
        ke.routing_stats(ref_weights, TEXTS, progress=False, workers=2)


def test_a_dying_worker_after_a_resume_names_the_text_of_the_call(ref_weights, monkeypatch, tmp_path):
    from kimi_explore.analysis import routing_stats as module

    path = tmp_path / "stats.npz"
    ke.routing_stats(ref_weights, TEXTS[:2], progress=False, checkpoint=path)
    monkeypatch.setattr(module, "_worker_routing", _dies)
    with pytest.raises(RuntimeError, match="while decoding text 2 "):
        ke.routing_stats(ref_weights, TEXTS, progress=False, checkpoint=path, workers=2)
    assert len(ke.RoutingStats.load(path).texts) == 2  # the checkpoint still holds what was counted


def test_a_failed_call_leaves_no_thread_of_its_pool(ref_weights, monkeypatch):
    """A failed call stops its workers and joins its pool before it raises: a pool left shutting down in threads
    holds its lock (Python 3.12+) while the next call forks, and that call's workers deadlock when they collect it."""
    import threading

    from kimi_explore.analysis import routing_stats as module

    before = threading.active_count()
    monkeypatch.setattr(module, "_worker_routing", _raises)
    with pytest.raises(ArithmeticError):
        ke.routing_stats(ref_weights, TEXTS, progress=False, workers=2)
    assert threading.active_count() == before


def _where(e: BaseException) -> str:
    """The text an error names: its note (Python 3.11+), else the end of its message (3.10: no notes)."""
    if sys.version_info >= (3, 11):
        assert "while decoding" not in str(e)  # (notes go under the traceback, the message stays the worker's)
        return e.__notes__[-1]
    return str(e).rsplit(" (", 1)[-1].rstrip(")")


class _NoNotes(ArithmeticError):
    add_note = None  # as on Python 3.10, where exceptions have no notes


def test_an_error_without_notes_names_the_text_in_its_message():
    from kimi_explore.analysis.routing_stats import _note_text

    e = _NoNotes("planted", 7)
    _note_text(e, 3)
    assert e.args == ("planted (routing_stats: while decoding text 3 of the call)", 7)
    e = _NoNotes(5)  # no message to extend: left as it is
    _note_text(e, 3)
    assert e.args == (5,)


def test_an_error_decoding_a_text_says_which_text(ref_weights, monkeypatch):
    from kimi_explore.analysis import routing_stats as module

    def failing_on_the_third(weights, ids, recorder):
        if ids == list(TEXTS[2].encode()):
            raise ArithmeticError("planted")
        return routing(weights, ids, recorder)

    routing = module._routing
    monkeypatch.setattr(module, "_routing", failing_on_the_third)
    with pytest.raises(ArithmeticError, match="planted") as raised:
        ke.routing_stats(ref_weights, TEXTS, progress=False)
    assert _where(raised.value) == "routing_stats: while decoding text 2 of the call"


def test_the_reused_recorder_starts_every_text_empty(ref_weights):
    """One recorder serves a whole call (or worker): nothing of an earlier text reaches the next one's routing, not
    even of a text that failed after its first chunk had been recorded."""
    from kimi_explore.analysis import routing_stats as module

    first, second = list(TEXTS[0].encode()), list(TEXTS[1].encode())
    fresh = module._routing(ref_weights, second, module._router_recorder(ref_weights))
    recorder = module._router_recorder(ref_weights)
    module._routing(ref_weights, first, recorder)
    chunk = module.default_chunk(ref_weights.config)
    with pytest.raises(ValueError, match="256"):  # the second chunk's last id is outside the vocabulary
        module._routing(ref_weights, (first * chunk)[: chunk + 3] + [256], recorder)
    assert recorder.n_tokens == 0
    again = module._routing(ref_weights, second, recorder)
    assert sorted(again) == sorted(fresh) and set(again) >= {"topk_ids", "topk_weights"}
    for key in ("topk_ids", "topk_weights"):
        assert again[key].shape[0] == len(second)
        np.testing.assert_array_equal(again[key], fresh[key])


def test_the_workers_fork_before_the_progress_bar_starts_its_thread(ref_weights, monkeypatch):
    """A process forked while another thread holds a lock can deadlock in the child (Python 3.12+ warns of every
    fork of a multi-threaded process): the workers start before the progress bar, whose monitor thread (tqdm's)
    would otherwise run at each fork."""
    import threading

    from tqdm.auto import tqdm

    for cls in tqdm.__mro__:  # a monitor an earlier bar left running: stopped, so that a new one would show
        monitor = cls.__dict__.get("monitor")
        if monitor is not None:
            monitor.exit()
            monkeypatch.setattr(cls, "monitor", None)
    before, seen, fork = threading.active_count(), [], os.fork

    def counting_fork():
        seen.append(threading.active_count())
        return fork()

    monkeypatch.setattr(os, "fork", counting_fork)
    got = ke.routing_stats(ref_weights, TEXTS, progress=True, workers=2)
    assert len(seen) == 2 and set(seen) == {before}
    np.testing.assert_array_equal(got.counts, ke.routing_stats(ref_weights, TEXTS, progress=False).counts)


def test_workers_are_checked(ref_weights):
    for bad in (0, -1, 1.5, "2", True, None):
        with pytest.raises(ValueError, match="workers must be a whole number >= 1"):
            ke.routing_stats(ref_weights, TEXTS, progress=False, workers=bad)
    with stand_in_device(StrictDevice()):
        on_device = ke.from_pretrained(ke.tiny_checkpoint(), device="gpu")
    with pytest.raises(ValueError, match="needs host weights.*on the gpu.*use workers=1"):
        ke.routing_stats(on_device, TEXTS, progress=False, workers=2)
    one = ke.routing_stats(ref_weights, [TEXTS[0]], progress=False, workers=4)  # one text: decoded here
    np.testing.assert_array_equal(one.counts, ke.routing_stats(ref_weights, [TEXTS[0]], progress=False).counts)
