"""The GPU route (device="gpu", the CuPy code path) on a strict stand-in device, in CI without a GPU.

`strict_device.StrictDevice` keeps arrays on the host but refuses, as CuPy does, every implicit
conversion to NumPy and every mix of host and device arrays, and counts host <-> device transfers.
The package's device checks (`backend.on_host`, `_xp.array_namespace`) see its arrays as device
arrays inside `backend.stand_in_device`, so `from_pretrained(..., device="gpu")` takes the CuPy
route: the decoder (token and sequence forms), the recorder, the session, mapped experts, the
analyses and the Explorer's data path run here as they would on a GPU, and are compared with the
host route on the same checkpoints.

This is not a GPU run: it checks the host/device discipline and the device code path's numbers,
not CUDA kernels. `bench/gpu_check.sh` (tests/test_gpu.py) is the real check where a GPU is at hand.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from strict_device import HostDeviceMixError, ImplicitTransferError, StrictDevice

from kimi_explore import KimiDecodeState, Recorder, Session, from_pretrained, interventions, kimi_forward_token
from kimi_explore._xp import array_namespace
from kimi_explore.analysis.attribution import logit_attribution
from kimi_explore.analysis.diff import diff
from kimi_explore.analysis.logit_lens import logit_lens
from kimi_explore.analysis.routing_stats import routing_stats
from kimi_explore.backend import gpu_available, on_host, resolve_device, stand_in_device, to_numpy
from kimi_explore.inspection import _recording, chunk_records
from kimi_explore.inspection import recorder as recorder_module
from kimi_explore.inspection.hooks import Hooks
from kimi_explore.inspection.recorder import FLUSH_TOKENS
from kimi_explore.model.kimi_sequence import kimi_forward_sequence
from kimi_explore.weights.mapped_experts import MappedExperts
from kimi_explore.weights.tiny_model import random_tiny_checkpoint, tiny_checkpoint

XP = StrictDevice()
MODELS = {"trained": tiny_checkpoint(), "random": random_tiny_checkpoint()}
TOKENS = [72, 105, 32, 75, 51, 33, 10, 100, 101, 102, 0, 255]  # 12 tokens: chunks of 5 end inside a block
RUNS = [("trained", "float32"), ("trained", "float64"), ("random", "float32"), ("random", "float64")]
RUN_IDS = [f"{m}-{d}" for m, d in RUNS]


@pytest.fixture(scope="module", autouse=True)
def device():
    """device="gpu" is the stand-in for the whole module."""
    with stand_in_device(XP):
        yield XP


@pytest.fixture(scope="module")
def load():
    cache = {}

    def get(model: str, dtype: str = "float32", where: str = "gpu", **kw):
        key = (model, dtype, where, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = from_pretrained(MODELS[model], device=where, dtype=dtype, **kw)
        return cache[key]

    return get


def token_logits(w, tokens=TOKENS, hooks=None):
    state = KimiDecodeState.new(w)
    return np.stack([to_numpy(kimi_forward_token(w, state, t, hooks=hooks)) for t in tokens])


def sequence_logits(w, tokens=TOKENS, hooks=None, chunk=5):
    return to_numpy(kimi_forward_sequence(w, KimiDecodeState.new(w), tokens, hooks, chunk=chunk))


def assert_close(dev, host, model: str, dtype: str):
    """The device route against the host route. The host's float32 kernels (fused MXFP4, bf16 matvec, the
    C recurrence) sum in another order than the device route's BLAS matmuls: float32 rounding apart,
    more on the random model (flat logits, large activations) than on the trained one."""
    assert dev.shape == host.shape and dev.dtype == host.dtype
    if dtype == "float64":
        assert np.abs(dev - host).max() <= 1e-12 * max(1.0, np.abs(host).max())
    elif model == "trained":
        np.testing.assert_allclose(dev, host, atol=5e-5, rtol=0)
    else:
        np.testing.assert_allclose(dev, host, atol=6e-4, rtol=1e-4)


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32 if a.dtype == np.float32 else np.uint64)


def moe_layers(w) -> list:
    return [layer for layer in w.layers if hasattr(layer.ffn, "experts")]


def assert_same_records(dev, host, exact_ids: bool = True, atol: float = 1e-9):
    assert sorted(dev.keys()) == sorted(host.keys())
    assert dev.tokens.tolist() == host.tokens.tolist()
    for k in host.keys():
        a, b = dev[k], host[k]
        assert isinstance(a, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype, k
        if a.dtype.kind in "iu" and exact_ids:
            np.testing.assert_array_equal(a, b, err_msg=k)
        elif a.dtype.kind == "f":
            np.testing.assert_allclose(a, b, atol=atol, rtol=0, err_msg=k)


# ---------------------------------------------------------------- the stand-in itself

REFUSED = {
    "np.asarray": (lambda d, h: np.asarray(d), ImplicitTransferError),
    "np.array": (lambda d, h: np.array(d), ImplicitTransferError),
    "np.ascontiguousarray": (lambda d, h: np.ascontiguousarray(d), ImplicitTransferError),
    "float": (lambda d, h: float(d[0]), ImplicitTransferError),
    "int": (lambda d, h: int(d[0]), ImplicitTransferError),
    "bool": (lambda d, h: bool(d[0] > 0), ImplicitTransferError),
    "tolist": (lambda d, h: d.tolist(), ImplicitTransferError),
    "f-string": (lambda d, h: f"{d[0]:.3f}", ImplicitTransferError),
    "pickle": (lambda d, h: pickle.dumps(d), ImplicitTransferError),
    "host[device]": (lambda d, h: h[XP.asarray(np.array([0, 1]))], ImplicitTransferError),
    "range(device)": (lambda d, h: range(XP.asarray(np.array(3))), ImplicitTransferError),
    "device+host": (lambda d, h: d + h, HostDeviceMixError),
    "host*device": (lambda d, h: h * d, HostDeviceMixError),
    "host@device": (lambda d, h: h @ d, HostDeviceMixError),
    "xp.concatenate": (lambda d, h: XP.concatenate([d, h]), HostDeviceMixError),
    "np.concatenate": (lambda d, h: np.concatenate([d, h]), HostDeviceMixError),
    "xp.exp(host)": (lambda d, h: XP.exp(h), HostDeviceMixError),
    "out=host": (lambda d, h: XP.multiply(d, 2.0, out=h), HostDeviceMixError),
    "device[:]=host": (lambda d, h: d.__setitem__(slice(None), h), HostDeviceMixError),
    "host[:]=device": (lambda d, h: h.__setitem__(slice(None), d), ImplicitTransferError),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_stand_in_refuses_implicit_conversion_and_mixing(case):
    fn, error = REFUSED[case]
    d, h = XP.asarray(np.arange(4, dtype=np.float32)), np.ones(4, np.float32)
    with pytest.raises(error, match="strict device"):
        fn(d, h)


def test_stand_in_allows_what_cupy_allows_and_counts_transfers():
    d = XP.asarray(np.arange(4, dtype=np.float32))
    with XP.counting() as n:
        e = np.exp(d) * np.float32(2.0) + 1.0  # NumPy ufuncs and scalars dispatch to the device
        s = XP.concatenate([d, e]).sum()  # a reduction: a 0-d device array, not a host scalar
        picked = d[np.array([3, 1])]  # a host index: copied to the device (as CuPy does), counted
        host = XP.asnumpy(picked)
        v = s.item()
        masked = d[d > 1]  # a boolean device mask: CuPy syncs to size the result, counted
    assert type(e) is type(s) is type(picked) is XP.ndarray and s.shape == ()
    assert isinstance(host, np.ndarray) and host.tolist() == [3.0, 1.0] and masked.shape == (2,)
    assert v == pytest.approx(float(np.arange(4).sum() + (2 * np.exp(np.arange(4)) + 1).sum()), rel=1e-6)
    assert n == {"h2d": 0, "d2h": 2, "h2d_implicit": 1, "sync": 1, "h2d_bytes": 16, "d2h_bytes": 8 + 4}


def test_device_checks_see_the_stand_in(load):
    d = XP.asarray(np.zeros(3))
    assert not on_host(XP) and not on_host(d) and on_host(np) and on_host(np.zeros(3))
    assert array_namespace(d) is XP and array_namespace(np.zeros(3)) is np
    assert resolve_device("gpu") == (XP, "gpu") and resolve_device("auto") == (XP, "gpu")
    assert resolve_device("cpu") == (np, "cpu") and gpu_available()
    inner = StrictDevice()
    with stand_in_device(inner):  # nesting gives the inner one and restores the outer one
        assert resolve_device("gpu") == (inner, "gpu")
    assert resolve_device("gpu") == (XP, "gpu") and array_namespace(d) is XP
    w = load("trained")
    assert w.device == "gpu" and w.xp is XP and w.memory_report().device == "gpu"
    assert type(w.lm_head) is XP.ndarray or type(getattr(w.lm_head, "bits", None)) is XP.ndarray


# ---------------------------------------------------------------- the decoder


@pytest.mark.parametrize("model,dtype", RUNS, ids=RUN_IDS)
def test_token_decode_matches_the_host(load, model, dtype):
    assert_close(token_logits(load(model, dtype)), token_logits(load(model, dtype, "cpu")), model, dtype)


@pytest.mark.parametrize("model,dtype", RUNS, ids=RUN_IDS)
def test_sequence_decode_matches_the_host(load, model, dtype):
    w = load(model, dtype)
    dev = sequence_logits(w)
    assert_close(dev, sequence_logits(load(model, dtype, "cpu")), model, dtype)
    assert_close(dev, token_logits(w), model, dtype)  # the two forms on the device, to rounding


@pytest.mark.parametrize("form", ["token", "sequence"])
def test_resident_forms_give_the_same_bits_on_the_device(load, form):
    """As tests/test_gpu.py asks of a GPU: packed (any cache), mapped and bf16 weights are the dense float32
    model bit for bit on one device (the same device ops on the same operands)."""
    run = token_logits if form == "token" else sequence_logits
    base = run(load("random", experts="dense"))
    for kw in (dict(experts="packed", expert_cache_size=0), dict(experts="packed", expert_cache_size=2),
               dict(experts="mapped", expert_cache_size=0), dict(experts="mapped", expert_cache_size=3),
               dict(weight_dtype="bfloat16"), dict(weight_dtype="bfloat16", experts="packed")):
        np.testing.assert_array_equal(bits(run(load("random", **kw))), bits(base), err_msg=str(kw))


def test_token_decode_moves_nothing_after_the_first_token(load):
    """Dense experts: every value of a token stays on the device; only the caller's logits come back."""
    w = load("trained")
    state = KimiDecodeState.new(w)
    kimi_forward_token(w, state, TOKENS[0])  # the first token builds constants on the device
    for t in TOKENS[1:]:
        with XP.counting() as n:
            logits = kimi_forward_token(w, state, t)
        assert type(logits) is XP.ndarray
        assert n["h2d"] == n["d2h"] == n["h2d_implicit"] == 0, (t, n)


def test_packed_experts_move_only_their_ids(load):
    """Packed experts with a cache: the k ids of each MoE layer come to the host for the cache lookup."""
    w = load("trained", experts="packed")
    n_moe = len(moe_layers(w))
    state = KimiDecodeState.new(w)
    for t in TOKENS[:4]:  # warm every expert the later tokens ask for
        kimi_forward_token(w, state, t)
    with XP.counting() as n:
        kimi_forward_token(w, state, TOKENS[4])
    assert n["d2h"] == n_moe and n["d2h_bytes"] == n_moe * w.config.num_experts_per_token * 8
    assert n["h2d"] <= n_moe and n["h2d_implicit"] == 0


def test_mapped_experts_are_copied_to_the_device_per_use(load):
    """experts="mapped", no cache: per token and MoE layer, 1 transfer of the ids to the host and 4 copies
    (w13/w2 packed bytes and scales) of exactly the k selected experts to the device."""
    w = load("random", experts="mapped", expert_cache_size=0)
    banks = [layer.ffn.experts for layer in moe_layers(w)]
    assert banks and all(isinstance(b, MappedExperts) and b.packed_bytes == 0 for b in banks)
    k, E = w.config.num_experts_per_token, w.config.num_experts
    per_expert = [b.mapped_bytes // E for b in banks]
    state = KimiDecodeState.new(w)
    kimi_forward_token(w, state, TOKENS[0])
    for t in TOKENS[1:6]:
        with XP.counting() as n:
            kimi_forward_token(w, state, t)
        assert n["d2h"] == len(banks) and n["h2d"] == 4 * len(banks) and n["h2d_implicit"] == 0, n
        assert n["h2d_bytes"] == k * sum(per_expert)
    np.testing.assert_array_equal(bits(token_logits(w)), bits(token_logits(load("random", experts="packed",
                                                                                 expert_cache_size=0))))


def test_sequence_chunk_transfers(load):
    """A chunk on the device moves only small index vectors: its token ids to the device; per MoE layer
    the [T] near-tie flags and the [T, k] ids to the host (grouping by expert) and the grouping's two
    index arrays back; per attention layer one flag of whether the chunk's values are finite (MLA) or the
    [T] flags of its non-finite tokens (KDA's chunked rule): a NaN token must not reach the earlier tokens
    of its chunk. With the recorder, also per KDA layer the [n] flags of which state-norm sub-blocks
    decay within float range, per MoE layer two flags of whether the chunk dropped experts (the ids the
    recorder saw, the ids the layer routed by: else their records are kept whole; emitted row by row,
    each row's boolean mask was a sync per token and layer), and the previous chunk's records in one
    transfer per dtype."""
    w = load("trained")
    cfg = w.config
    n_moe, n_kda = len(moe_layers(w)), sum(cfg.is_kda_layer(i) for i in w.layer_ids)
    n_attn = len(w.layer_ids)
    state = KimiDecodeState.new(w)
    kimi_forward_sequence(w, state, TOKENS[:5], chunk=5)
    with XP.counting() as n:
        kimi_forward_sequence(w, state, TOKENS[5:10], chunk=5)
    assert n["h2d_implicit"] == 0 and n["d2h"] == 2 * n_moe + n_attn and n["h2d"] == 2 * n_moe + 1, n
    assert n["sync"] == n_kda, n  # the chunked rule's sub-blocks out of float range, sized by the data (flatnonzero)
    assert n["h2d_bytes"] + n["d2h_bytes"] < 2 * (n_moe + n_kda) * cfg.hidden_size  # index vectors only
    rec = Recorder().bind(w)
    state = KimiDecodeState.new(w)
    kimi_forward_sequence(w, state, TOKENS[:5], rec, chunk=5)
    with XP.counting() as n:
        kimi_forward_sequence(w, state, TOKENS[5:10], rec, chunk=5)
    assert n["h2d_implicit"] == 0 and n["h2d"] == 2 * n_moe + 1, n
    assert 4 * n_moe + n_kda + n_attn + 1 <= n["d2h"] <= 4 * n_moe + n_kda + n_attn + 3, n
    # and the recorder's top-k on a small vocabulary (its ties: flatnonzero); the routing records were emitted row
    # by row, a mask gather each: 2 T n_moe more syncs
    assert n_kda <= n["sync"] <= n_kda + 2, n


GGUF = Path(__file__).parent / "data" / "engines" / "d" / "llamacpp" / "model-mxfp4.gguf"


@pytest.mark.parametrize("experts", ["packed", "mapped"])
def test_gguf_mxfp4_experts_on_the_device(experts):
    """llama.cpp's block layout on the device route against the host's (there the fused kernel, when built):
    both forms; mapped, the selected experts' blocks alone are copied per use (gate, up, down: 3 copies
    per MoE layer and token, the E2M1 table kept on the device), the ids come to the host once."""
    host = from_pretrained(GGUF, device="cpu", experts=experts, expert_cache_size=0)
    w = from_pretrained(GGUF, device="gpu", experts=experts, expert_cache_size=0)
    for run in (token_logits, sequence_logits):
        assert_close(run(w), run(host), "random", "float32")
    if experts == "mapped":
        banks = [layer.ffn.experts for layer in moe_layers(w)]
        k, E = w.config.num_experts_per_token, w.config.num_experts
        state = KimiDecodeState.new(w)
        kimi_forward_token(w, state, TOKENS[0])
        with XP.counting() as n:
            kimi_forward_token(w, state, TOKENS[1])
        assert n["d2h"] == len(banks) and n["h2d"] == 3 * len(banks) and n["h2d_implicit"] == 0, n
        assert n["h2d_bytes"] == k * sum(b.mapped_bytes // E for b in banks)


def test_a_hook_returning_a_host_array_at_a_device_site_is_refused(load):
    w = load("trained")
    hooks = Hooks().bind(w)
    hooks.add("layers.1.ffn.out", lambda v, hook: np.zeros(v.shape, v.dtype))
    with pytest.raises(TypeError, match=r"returned a host array, but this site's value is a CuPy \(GPU\) array"):
        kimi_forward_token(w, KimiDecodeState.new(w), 5, hooks=hooks)
    hooks = Hooks().bind(w)
    hooks.add("layers.1.ffn.out", lambda v, hook: XP.zeros(v.shape, v.dtype))  # where the value lives: accepted
    kimi_forward_token(w, KimiDecodeState.new(w), 5, hooks=hooks)


# ---------------------------------------------------------------- the recorder

FULL = ["layers.*.kda.state", "layers.1.moe.router.topk_ids", "final.hidden", "layers.3.mla.probs"]


def record(w, form: str, recorder: Recorder):
    recorder.bind(w)
    state = KimiDecodeState.new(w)
    if form == "token":
        for t in TOKENS:
            kimi_forward_token(w, state, t, hooks=recorder)
    else:
        kimi_forward_sequence(w, state, TOKENS, recorder, chunk=5)
    return recorder.trace()


@pytest.mark.parametrize("form", ["token", "sequence"])
def test_recorder_matches_the_host(load, form):
    for full in (None, FULL):
        dev = record(load("trained", "float64"), form, Recorder(full=full))
        host = record(load("trained", "float64", "cpu"), form, Recorder(full=full))
        assert_same_records(dev, host)
        assert len(dev.keys()) > 40
        if full is not None:
            assert dev["layers.0.kda.state"].shape[0] == dev["layers.1.moe.router.topk_ids"].shape[0] == len(TOKENS)


@pytest.mark.parametrize("where", ["cpu", "gpu"])
@pytest.mark.parametrize("form", ["token", "sequence"])
def test_a_full_record_of_a_default_site_is_recorded_once(load, form, where):
    """Found on the stand-in: full=[a site recorded by default] appended every token twice (the trace then
    showed token t's ids at row 2t), and in a chunk a full `kda.state` record took the norms' rows."""
    w = load("trained", "float64", where)
    plain = record(w, form, Recorder())
    both = record(w, form, Recorder(full=["layers.1.moe.router.topk_ids", "layers.0.kda.state"]))
    np.testing.assert_array_equal(both["layers.1.moe.router.topk_ids"], plain["layers.1.moe.router.topk_ids"])
    S = both["layers.0.kda.state"]
    assert S.shape[:2] == (len(TOKENS), w.config.linear_attn_config.num_heads) and S.ndim == 4
    np.testing.assert_allclose(np.sqrt((S**2).sum(axis=(2, 3))), plain["layers.0.kda.state.norm"], rtol=1e-12, atol=1e-12)


def test_recorder_transfers_once_per_batch(load):
    """The default recorder keeps its records on the device and moves them in one transfer per dtype per
    batch of FLUSH_TOKENS tokens."""
    w = load("trained")
    rec = Recorder().bind(w)
    state = KimiDecodeState.new(w)
    moved = []
    for t in range(FLUSH_TOKENS + 4):
        with XP.counting() as n:
            kimi_forward_token(w, state, t, hooks=rec)
        moved.append((n["h2d"], n["d2h"], n["h2d_implicit"]))
    assert moved[0][1:] == (0, 0) and all(m == (0, 0, 0) for m in moved[1 : FLUSH_TOKENS - 1] + moved[FLUSH_TOKENS:])
    assert moved[FLUSH_TOKENS - 1][0] == 0 and 1 <= moved[FLUSH_TOKENS - 1][1] <= 3
    assert len(rec.trace()) == FLUSH_TOKENS + 4


def _to_host_implicitly(arrays):
    return [np.asarray(a) for a in arrays]  # planted: a host conversion without .get()


def _squares_on_a_host_scratch(self, arrays, rows_each):
    xp = array_namespace(arrays[0])
    buf = np.empty((len(arrays) * arrays[0].shape[0],) + arrays[0].shape[1:], arrays[0].dtype)  # planted: np, not xp
    xp.concatenate(arrays, out=buf)
    flat = buf.reshape(len(arrays) * rows_each, -1)
    return xp.matmul(flat[:, None, :], flat[:, :, None]).reshape(len(arrays), rows_each)


def _chunk_norms_into_a_host_array(x):
    out = np.empty(x.shape[:2], x.dtype)  # planted: the result allocated on the host
    out[...] = array_namespace(x).sqrt(array_namespace(x).matmul(x[:, :, None, :], x[:, :, :, None])[:, :, 0, 0])
    return out


PLANTS = {  # name -> (what to patch, the planted function, the recorder paths it is on)
    "to_host via np.asarray": (lambda mp: mp.setattr(recorder_module, "to_host", _to_host_implicitly), ("token", "sequence")),
    "token norms on a host scratch": (lambda mp: mp.setattr(_recording.RowSquares, "of", _squares_on_a_host_scratch),
                                      ("token",)),
    "chunk norms into a host array": (lambda mp: mp.setattr(chunk_records, "_norms", _chunk_norms_into_a_host_array),
                                      ("sequence",)),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_host_device_mix_planted_in_the_recorder_fails_here(load, monkeypatch, plant):
    """The same planted bug passes on the host route and fails on the stand-in: CI catches it, not a GPU user."""
    patch, forms = PLANTS[plant]
    patch(monkeypatch)
    for form in forms:
        host = record(load("trained", "float64", "cpu"), form, Recorder())
        assert len(host) == len(TOKENS) and "layers.0.kda.state.norm" in host
        with pytest.raises((ImplicitTransferError, HostDeviceMixError), match="strict device"):
            test_recorder_matches_the_host(load, form)


@pytest.mark.parametrize("where", ["cpu", "gpu"])
def test_a_block_boundary_layer_runs_token_by_token_inside_a_chunk(load, where):
    """Found on the stand-in: a per-token hook at a block-boundary layer made the chunk's stack seal one
    block per token (IndexError past the stack's rows)."""
    w = load("trained", "float64", where)
    boundaries = [spec.index for spec in w.specs if spec.is_block_boundary]
    assert len(boundaries) >= 2
    seen = []
    hooks = Hooks().bind(w)
    for i in boundaries:
        hooks.add(f"layers.{i}.attn.out", lambda v, hook: seen.append(hook.name))
    dev = sequence_logits(w, hooks=hooks)
    assert len(seen) == len(TOKENS) * len(boundaries)
    assert np.abs(dev - token_logits(w)).max() <= 1e-12 * np.abs(dev).max()


def test_an_unbound_recorder_records_device_values(load):
    """A Recorder used without `bind` learns at the first token that the values live on the device."""
    traces = {}
    for where in ("gpu", "cpu"):
        w, rec = load("trained", "float64", where), Recorder()
        state = KimiDecodeState.new(w)
        for t in TOKENS[:4]:
            rec.begin_token(t)
            kimi_forward_token(w, state, t, hooks=rec)
        traces[where] = rec.trace()
    assert_same_records(traces["gpu"], traces["cpu"])


# ---------------------------------------------------------------- the session


def session_run(w, tmp_path=None):
    s = Session(w)
    s.feed(TOKENS[:8], chunk=3)
    for t in TOKENS[8:]:
        s.step(t)
    return s


def test_session_matches_the_host(load):
    dev, host = session_run(load("trained", "float64")), session_run(load("trained", "float64", "cpu"))
    assert_close(dev.logits, host.logits, "trained", "float64")
    assert_same_records(dev.trace(), host.trace())
    dev32, host32 = session_run(load("trained")), session_run(load("trained", where="cpu"))
    assert_close(dev32.logits, host32.logits, "trained", "float32")


def test_session_truncate_fork_and_restep_are_exact_on_the_device(load):
    w = load("trained")
    s = session_run(w)
    logits, trace = s.logits.copy(), s.trace()
    fork = s.fork()
    s.truncate(4)  # inside the first fed chunk
    s.feed(TOKENS[4:8], chunk=4)
    for t in TOKENS[8:]:
        s.step(t)
    np.testing.assert_array_equal(bits(s.logits[:4]), bits(logits[:4]))
    assert_close(s.logits, logits, "trained", "float32")  # 4..7 were fed in other chunks
    fork.step(5)
    assert len(fork) == len(TOKENS) + 1 and len(s) == len(TOKENS)
    np.testing.assert_array_equal(bits(fork.logits[: len(TOKENS)]), bits(logits))
    before = s.logits.copy()
    s.back(2)
    for t in TOKENS[-2:]:
        s.step(t)
    np.testing.assert_array_equal(bits(s.logits), bits(before))
    assert s.trace().tokens.tolist() == trace.tokens.tolist()


def test_session_save_load_round_trip(load, tmp_path):
    w = load("trained")
    s = session_run(w)
    path = s.save_state(tmp_path / "s.npz")
    for t in (7, 8, 9):
        s.step(t)
    back = Session.load_state(path, w)
    for t in (7, 8, 9):
        back.step(t)
    np.testing.assert_array_equal(bits(back.logits), bits(s.logits))
    back.truncate(3)  # an exact truncate from a loaded checkpoint
    np.testing.assert_array_equal(bits(back.logits), bits(s.logits[:3]))
    on_host_w = load("trained", where="cpu")
    host = Session.load_state(path, on_host_w)  # a state saved from the device continues on the host
    for t in (7, 8, 9):
        host.step(t)
    assert_close(host.logits, s.logits, "trained", "float32")


@pytest.mark.parametrize("make", ["ablate_experts", "zero_kda_head", "force_routing", "force_routing_weights",
                                  "override_attn_res_array"])
def test_interventions_match_the_host(load, make):
    hooks = {"ablate_experts": lambda: interventions.ablate_experts(1, [0, 3, 5]),
             "zero_kda_head": lambda: interventions.zero_kda_head(0, 1),
             "force_routing": lambda: interventions.force_routing(2, [1, 4]),
             "force_routing_weights": lambda: interventions.force_routing(2, [1, 4], weights=[0.7, 0.3]),
             "override_attn_res_array": lambda: interventions.override_attn_res(2, "ffn", np.array([0.4, 0.6]))}[make]
    out = {}
    for where in ("gpu", "cpu"):
        s = Session(load("trained", "float64", where))
        s.feed(TOKENS[:3])
        with s.intervene(hooks()):
            s.feed(TOKENS[3:8], chunk=2)
        s.step(TOKENS[8])
        out[where] = s
    assert_close(out["gpu"].logits, out["cpu"].logits, "trained", "float64")
    assert_same_records(out["gpu"].trace(), out["cpu"].trace())
    plain = Session(load("trained", "float64", "cpu"), recorder=False)
    plain.feed(TOKENS[:9])
    assert np.abs(out["gpu"].logits[4:] - plain.logits[4:]).max() > 1e-6  # the intervention did change the run


def test_pipeline_stages_on_the_device(load):
    """Two pipeline stages in this process (no Ray) on the device: a chunk, then tokens, then a state moved
    out to the host and back in; the stack crosses between them as host arrays, as over Ray."""
    from kimi_explore import hook_names
    from kimi_explore.distributed.stage import Stage

    w = load("trained", "float64", "cpu")
    path, names, half = str(MODELS["trained"]), hook_names(w), len(w.layer_ids) // 2
    out = {}
    for where in ("gpu", "cpu"):
        stages = [Stage(0, path, w.layer_ids[:half], False, w.max_sources, names, {"device": where, "dtype": "float64"}),
                  Stage(1, path, w.layer_ids[half:], True, w.max_sources, names, {"device": where, "dtype": "float64"})]
        for st in stages:
            st.load()
            st.new_state(1)
            st.configure([], (Recorder().settings(), []))

        def run(sid, token, position, stages=stages):
            first = stages[0].run(((sid, sid), token, position))
            assert all(isinstance(a, (np.ndarray, list)) for a in first[0][:2])  # the stack travels as host values
            return stages[1].run(((sid, sid), token, position), first)[0]

        logits = [run(1, TOKENS[:5], 0)] + [run(1, t, p)[None] for p, t in enumerate(TOKENS[5:8], start=5)]
        for st in stages:
            st.put_state(2, st.get_state(1))  # out to the host and back in
        logits += [run(2, t, p)[None] for p, t in enumerate(TOKENS[8:], start=8)]
        out[where] = np.concatenate(logits), stages[1].head()
    assert_close(out["gpu"][0], out["cpu"][0], "trained", "float64")
    assert_close(out["gpu"][0], token_logits(load("trained", "float64")), "trained", "float64")
    for a, b in zip(out["gpu"][1], out["cpu"][1], strict=True):
        assert isinstance(a, np.ndarray) and np.array_equal(a, b)


# ---------------------------------------------------------------- the analyses


@pytest.fixture(scope="module")
def sessions(load):
    return {where: session_run(load("trained", "float64", where)) for where in ("gpu", "cpu")}


def test_logit_lens_matches_the_host(sessions):
    dev, host = (logit_lens(sessions[w], top=5, targets="next") for w in ("gpu", "cpu"))
    np.testing.assert_array_equal(dev.top_ids, host.top_ids)
    np.testing.assert_allclose(dev.top_probs, host.top_probs, atol=1e-12, rtol=0)
    np.testing.assert_allclose(dev.target_logprobs, host.target_logprobs, atol=1e-10, rtol=0)
    assert dev.layers == host.layers and np.isfinite(dev.target_logprobs[:-1]).all()


def test_logit_attribution_matches_the_host(sessions):
    dev, host = (logit_attribution(sessions[w], t=[3, -1]) for w in ("gpu", "cpu"))
    for a, b in zip(dev, host, strict=True):
        assert sorted(a.contributions) == sorted(b.contributions) and a.token == b.token and a.t == b.t
        np.testing.assert_allclose([a.contributions[k] for k in b.contributions], list(b.contributions.values()),
                                   atol=1e-9, rtol=0)
        assert abs(a.logit - b.logit) < 1e-10 and abs(a.total() - a.logit) < 1e-6
        assert a.source_of == b.source_of


def test_diff_matches_the_host(load, sessions):
    out = {}
    for where in ("gpu", "cpu"):
        other = Session(load("trained", "float64", where))
        with other.intervene(interventions.ablate_experts(1, "all")):
            other.feed(TOKENS[:6])
        other.feed(TOKENS[6:])
        out[where] = diff(sessions[where], other)
    a, b = out["gpu"], out["cpu"]
    np.testing.assert_allclose(a.kl, b.kl, atol=1e-10, rtol=0)
    np.testing.assert_allclose(a.attn_res, b.attn_res, atol=1e-10, rtol=0)
    np.testing.assert_array_equal(a.jaccard, b.jaccard)
    assert a.kl.max() > 1e-4


def test_routing_stats_match_the_host(load):
    texts = ["def f(x):\n    return x + 1\n", "The quick brown fox."]
    dev, host = (routing_stats(load("trained", "float64", w), texts, progress=False) for w in ("gpu", "cpu"))
    np.testing.assert_array_equal(dev.counts, host.counts)
    assert dev.tokens == host.tokens == sum(len(t.encode()) for t in texts)


def test_engine_comparison_on_the_device():
    """`ke.compare` (replays with another engine's values patched in through hooks) on the device route finds
    what it finds on the host: llama.cpp's set e diverges first at layer 0's KDA state, a local eps difference."""
    import kimi_explore as ke

    engines = Path(__file__).parent / "data" / "engines" / "e"
    found = {}
    for where in ("gpu", "cpu"):
        c = ke.compare(ke.Session(from_pretrained(engines / "tiny_k3", device=where)),
                       engines / "llamacpp" / "llamacpp_f32experts_decode.npz", names="llama.cpp")
        first = c.first
        found[where] = (first.token, first.layer, first.site, first.local, first.operation, sorted(c.local_sites))
    assert found["gpu"] == found["cpu"]
    assert found["gpu"][:5] == (0, 0, "layers.0.kda.state", True, "KDA q/k L2 norm")


def assert_nested_close(a, b, atol: float, where: str = "") -> None:
    """Dicts, lists, arrays and numbers compared leaf by leaf."""
    if isinstance(b, dict):
        assert isinstance(a, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for k in b:
            assert_nested_close(a[k], b[k], atol, f"{where}/{k}")
    elif isinstance(b, (list, tuple)) and not (b and isinstance(b[0], (int, float, np.number))):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_nested_close(x, y, atol, f"{where}[{i}]")
    elif isinstance(b, str):
        assert a == b, where
    else:
        x, y = np.asarray(a), np.asarray(b)
        assert isinstance(a, (np.ndarray, list, tuple, int, float, np.number)) and x.shape == y.shape, where
        if y.dtype.kind in "fc":
            np.testing.assert_allclose(x, y, atol=atol, rtol=0, equal_nan=True, err_msg=where)
        else:
            np.testing.assert_array_equal(x, y, err_msg=where)


def test_what_the_model_learned_analyses_on_the_device(load):
    """analysis.learned (notebook 05): bits per byte, block-residual reads, KDA state norms and decay rates."""
    from kimi_explore.analysis import learned

    text = "def f(x):\n    return x + 1\n"
    out = {}
    for where in ("gpu", "cpu"):
        w = load("trained", "float64", where)
        out[where] = (learned.bits_per_byte(w, text, window=8, max_windows=2), learned.attn_res_reads(w, text),
                      learned.kda_state_norms(w, text), learned.kda_decay_rates(w, text))
    assert abs(out["gpu"][0] - out["cpu"][0]) < 1e-10 and 0.5 < out["cpu"][0] < 8
    for a, b in zip(out["gpu"][1:], out["cpu"][1:], strict=True):
        assert_nested_close(a, b, atol=1e-9)


# ---------------------------------------------------------------- the Explorer's data path


def test_explorer_data_path_on_the_device(load):
    pytest.importorskip("ipywidgets")
    from kimi_explore.tokenizer import ByteTokenizer
    from kimi_explore.views.explorer.tabs import TABS
    from kimi_explore.views.explorer.widgets import Explorer

    shown = {}
    for where in ("gpu", "cpu"):
        ex = Explorer(Session(load("trained", "float64", where), tokenizer=ByteTokenizer()), prompt="Hi K3!")
        ex.play_button.click()  # the prompt, fed through the sequence path
        ex.step_button.click()  # one generated token
        specs = {}
        for tab in range(len(TABS)):
            ex.tabs.selected_index = tab
            specs.update({name: v.spec for name, v in ex.views.items() if v.spec})
        ex.layer.value = ex.moe_layers[-1]
        ex.ablation.experts.value = "chosen"
        shown[where] = (ex.session.tokens, ex.session.trace(), specs, ex.ablate())
    (tok_d, tr_d, specs_d, abl_d), (tok_h, tr_h, specs_h, abl_h) = shown["gpu"], shown["cpu"]
    assert tok_d == tok_h and len(tok_d) == 7
    assert_same_records(tr_d, tr_h)
    assert sorted(specs_d) == sorted(specs_h) and len(specs_d) >= 6
    assert abl_d is not None and np.abs(abl_d - abl_h).max() <= 1e-10


# ---------------------------------------------------------------- the command line


def test_cli_on_the_device(capsys):
    from kimi_explore.cli import main

    out = {}
    for where in ("gpu", "cpu"):
        assert main(["--device", where, "--dtype", "float64", "--ids", "72,105,32", "--generate", "3"]) == 0
        text = capsys.readouterr().out
        out[where] = [line for line in text.splitlines() if line.startswith("generated")]  # "generated ids ...: 111,..."
    assert out["gpu"] == out["cpu"] and out["gpu"]


# ---------------------------------------------------------------- the project's GPU tests, run on the stand-in
# tests/test_gpu.py and the GPU tests of test_session.py / test_recorder.py skip without CUDA; here their
# bodies run on the stand-in (imported as modules, so that pytest does not collect them twice).


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_reference_parity_tests_on_the_stand_in(ref, dtype):
    import test_gpu as gpu_tests
    from conftest import REFERENCE_DIR

    w = from_pretrained(REFERENCE_DIR, device="gpu", dtype=dtype)
    assert w.xp is XP
    hooks = gpu_tests.Collect()
    run = (w, hooks, gpu_tests.decode(w, ref["tokens"], hooks))
    gpu_tests.test_reference_logits_on_gpu(run, ref)
    gpu_tests.test_reference_internals_on_gpu(run, ref)
    if dtype == "float32":
        for n in (4, 8):
            gpu_tests.test_layer_subset_on_gpu(ref, n)
        gpu_tests.test_gpu_matches_cpu()
        for path in (random_tiny_checkpoint(), REFERENCE_DIR):
            gpu_tests.test_packed_and_bf16_bit_identical_on_gpu(path)


def test_session_and_recorder_gpu_tests_on_the_stand_in(ref, tmp_path):
    import test_recorder as recorder_tests
    import test_session as session_tests
    from conftest import REFERENCE_DIR

    session_tests.test_session_on_the_gpu(from_pretrained(REFERENCE_DIR, device="cpu", dtype="float64"), tmp_path)
    host = from_pretrained(REFERENCE_DIR, device="cpu")
    rec = Recorder(full=["layers.*.kda.conv", "layers.*.kda.state", "layers.*.moe.*_out", "layers.2.mla.probs",
                         "final.block_residual"]).bind(host)
    logits = recorder_tests.run(host, ref["tokens"], rec)
    recorder_tests.test_recorder_on_the_gpu_matches_the_host(ref, (rec.trace(), logits))


@pytest.mark.parametrize("make", ["ablate_experts", "force_routing"])
def test_chunk_aware_routing_hooks_on_the_sequence_path_match_the_host(load, make):
    """A chunk-aware hook at moe.router.topk_ids (whole chunks of device ids, -1 where dropped) on the sequence path:
    the same run as on the host, without an implicit transfer."""
    hook = {"ablate_experts": lambda: interventions.ablate_experts(1, [0, 3, 5]),
            "force_routing": lambda: interventions.force_routing(2, [1, 4])}[make]
    got, want = (sequence_logits(load("trained", "float64", where), hooks=hook()) for where in ("gpu", "cpu"))
    assert_close(got, want, "trained", "float64")
    assert np.abs(want - sequence_logits(load("trained", "float64", "cpu"))).max() > 1e-6  # the hook did change the run


@pytest.mark.parametrize("path", ["token", "sequence"])
def test_a_hook_returning_expert_ids_out_of_range_is_refused_on_the_device(load, path):
    """A GPU's fancy indexing wraps an id out of range around to another expert (CuPy does not raise as NumPy does):
    ids a hook returns anew are checked on the device as on the host (they went unchecked there)."""
    w = load("trained")
    E = w.config.num_experts
    hooks = Hooks().bind(w)
    if path == "token":
        hooks.add("layers.1.moe.router.topk_ids", lambda ids, hook: XP.full(ids.shape, E, ids.dtype))
        run = lambda: kimi_forward_token(w, KimiDecodeState.new(w), 5, hooks=hooks)  # noqa: E731
    else:
        hooks.add("layers.1.moe.router.topk_ids", lambda ids, hook: XP.full(ids.shape, E, ids.dtype), chunks=True)
        run = lambda: kimi_forward_sequence(w, KimiDecodeState.new(w), TOKENS, hooks=hooks)  # noqa: E731
    with pytest.raises(ValueError, match=rf"layers.1.moe.router.topk_ids: a hook returned expert ids .*\[{E}\].* 0..{E - 1}"):
        run()


def test_a_chunk_hook_changing_kda_decay_runs_on_the_device(load):
    """A chunk-aware hook at kda.decay, returning new decays or editing them in place, runs as on the host (its
    change was detected by `bool()` of a device array: a refused implicit transfer); a negative decay is refused
    with the same ValueError (it was an ImplicitTransferError)."""
    def scaled(v, *, hook):
        return v * 0.9

    def in_place(v, *, hook):
        v *= 0.9

    def negative(v, *, hook):
        return -v

    for fn in (scaled, in_place):
        runs = []
        for where in ("gpu", "cpu"):
            w = load("trained", "float64", where)
            h = Hooks().bind(w)
            h.add("layers.1.kda.decay", fn, chunks=True)
            runs.append(sequence_logits(w, hooks=h))
        assert_close(runs[0], runs[1], "trained", "float64")
        assert not np.allclose(runs[1], sequence_logits(load("trained", "float64", "cpu")))  # the hook acts
    for where in ("gpu", "cpu"):
        w = load("trained", "float64", where)
        h = Hooks().bind(w)
        h.add("layers.1.kda.decay", negative, chunks=True)
        with pytest.raises(ValueError, match="negative decays"):
            sequence_logits(w, hooks=h)
