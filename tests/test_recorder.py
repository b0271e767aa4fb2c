"""The Recorder against Moonshot's recorded arrays, and the Trace's named-axis views, files and frames."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REFERENCE_DIR

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.backend import gpu_available, to_numpy
from kimi_explore.inspection.recorder import Recorder
from kimi_explore.inspection.trace import Trace


def run(w, tokens, rec):
    state = KimiDecodeState.new(w)
    out = []
    for t in tokens:
        rec.begin_token(t)
        out.append(to_numpy(kimi_forward_token(w, state, int(t), hooks=rec)).copy())
    return np.stack(out)


@pytest.fixture(scope="module")
def recorded(ref_weights, ref):
    """The default recorder plus full copies of what the derived values are computed from."""
    rec = Recorder(full=["layers.*.kda.conv", "layers.*.kda.state", "layers.*.moe.*_out", "layers.2.mla.probs",
                         "final.block_residual"]).bind(ref_weights)
    logits = run(ref_weights, ref["tokens"], rec)
    return rec.trace(), logits


# ---------------------------------------------------------------- what it must show #1


def test_block_residual_weights_match_the_reference_every_site_every_step(recorded, ref):
    trace, _ = recorded
    checked = 0
    for i in range(14):
        for site, ours in (("attn", "attn"), ("mlp", "ffn")):
            key = f"attnres_L{i:02d}_{site}_decode"
            name = f"layers.{i}.attn_res.{ours}.weights"
            if key not in ref:
                assert name not in trace
                continue
            np.testing.assert_allclose(trace[name], ref[key], atol=1e-4, rtol=0)
            checked += 1
    np.testing.assert_allclose(trace["final.attn_res.weights"], ref["attnres_output_decode"], atol=1e-4, rtol=0)
    assert checked == 27


def test_routing_matches_the_reference_every_step(recorded, ref):
    trace, _ = recorded
    for i in ref["moe_layers"]:
        np.testing.assert_array_equal(trace[f"layers.{i}.moe.router.topk_ids"], ref[f"router_L{i:02d}_topk_idx_decode"])
        np.testing.assert_allclose(trace[f"layers.{i}.moe.router.topk_weights"], ref[f"router_L{i:02d}_topk_w_decode"], atol=1e-4)
        np.testing.assert_allclose(trace[f"layers.{i}.moe.router.scores"], ref[f"router_L{i:02d}_scores_decode"], atol=1e-4)
    r = trace.routing()
    assert r["moe_layers"] == list(ref["moe_layers"]) and r["num_experts"] == 8
    want = np.stack([ref[f"router_L{i:02d}_topk_idx_decode"] for i in ref["moe_layers"]], axis=1)
    np.testing.assert_array_equal(r["topk_ids"], want)  # [token, layer, k]
    assert r["topk_weights"].shape == (16, 13, 2) and r["scores"].shape == (16, 13, 8)


def test_kda_state_norms_match_the_reference_every_step(recorded, ref):
    trace, _ = recorded
    norms, ids = trace.kda_state_norms()
    assert ids == list(ref["kda_layers"])
    assert norms.shape == ref["kda_state_norm_decode"].shape == (16, 9, 4)
    np.testing.assert_allclose(norms, ref["kda_state_norm_decode"], atol=1e-4, rtol=0)


# ---------------------------------------------------------------- derived values vs the full tensors


def test_derived_norms_equal_norms_of_the_full_records(recorded):
    trace, _ = recorded
    for i in trace.kda_layers:
        S = trace[f"layers.{i}.kda.state"].astype(np.float64)  # [T, H, K, V]
        np.testing.assert_allclose(trace[f"layers.{i}.kda.state.norm"], np.sqrt((S**2).sum(axis=(2, 3))), rtol=1e-5)
        win = trace[f"layers.{i}.kda.conv"].astype(np.float64)  # [T, 3, P, W]
        T, _, P, W = win.shape
        per_head = win.reshape(T, 3, 4, P // 4, W)  # channel h*K + j
        np.testing.assert_allclose(trace[f"layers.{i}.kda.conv.norm"], np.sqrt((per_head**2).sum(axis=(3, 4))), rtol=1e-5)
    for i in trace.moe_layers:
        for part in ("routed", "shared"):
            full = trace[f"layers.{i}.moe.{part}_out"].astype(np.float64)
            np.testing.assert_allclose(trace[f"layers.{i}.moe.{part}_out.norm"], np.linalg.norm(full, axis=1), rtol=1e-5)
    n, ids = trace.kda_conv_norms()
    assert n.shape == (16, 9, 3, 4) and ids == trace.kda_layers


def test_top_predictions_are_the_softmax_of_the_logits(recorded):
    trace, logits = recorded
    ids, probs = trace.top_predictions()
    assert ids.shape == probs.shape == (16, 10)
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    want = np.argsort(-p, axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_allclose(probs, np.take_along_axis(p, want, axis=1), rtol=1e-5)


def test_tokens_positions_and_records_are_copies(ref_weights, ref):
    rec = Recorder(full=["layers.0.kda.state", "final.block_residual"])
    run(ref_weights, ref["tokens"][:3], rec)
    early = rec.trace()
    run(ref_weights, ref["tokens"][3:6], rec)  # a new state: its positions start at 0 again (as fed), the records go on
    later = rec.trace()
    assert len(early) == 3 and len(later) == 6
    for name in early.names():
        np.testing.assert_array_equal(later[name][:3], early[name])
    assert not np.array_equal(later["layers.0.kda.state"][1], later["layers.0.kda.state"][2])
    np.testing.assert_array_equal(later.tokens, ref["tokens"][:6])
    np.testing.assert_array_equal(later.positions, [0, 1, 2, 0, 1, 2])


def test_recorder_copies_logits(ref_weights, ref):
    """The caller owns the logits it gets back and may write into them: what the recorder keeps
    (the top-k of the default record, a full record) must be what the step returned, not a view."""
    rec = Recorder(full=["logits"]).bind(ref_weights)
    state = KimiDecodeState.new(ref_weights)
    returned = []
    for t in ref["tokens"][:3]:
        logits = kimi_forward_token(ref_weights, state, int(t), hooks=rec)
        returned.append(np.array(logits, copy=True))
        logits *= -1.0  # in place: the lowest logits become the highest
    trace = rec.trace()
    z = np.stack(returned).astype(np.float64)
    want = np.argsort(-z, axis=1, kind="stable")[:, : rec.top_k]
    np.testing.assert_array_equal(trace["logits.top_ids"], want)
    np.testing.assert_array_equal(trace["logits"], np.stack(returned))


# ---------------------------------------------------------------- selection


def test_names_filter_and_full_select_records(ref_weights, ref):
    rec = Recorder(names_filter="layers.1?.*", full=["layers.3.attn.in"], top_k=3).bind(ref_weights)
    run(ref_weights, ref["tokens"][:2], rec)
    trace = rec.trace()
    layers = {int(n.split(".")[1]) for n in trace.names() if n.startswith("layers.")}
    assert layers == {3, 10, 11, 12, 13}
    assert "logits.top_ids" not in trace and "final.attn_res.weights" not in trace
    assert trace["layers.3.attn.in"].shape == (2, 64)
    assert set(n for n in trace.names() if n.startswith("layers.11.")) == {
        "layers.11.attn_res.attn.weights", "layers.11.attn_res.ffn.weights", "layers.11.kda.state.norm",
        "layers.11.kda.conv.norm", "layers.11.moe.router.scores", "layers.11.moe.router.topk_ids",
        "layers.11.moe.router.topk_weights", "layers.11.moe.routed_out.norm", "layers.11.moe.shared_out.norm"}
    only_conv = Recorder(names_filter=["layers.0.kda.conv", "logits"], top_k=3)
    run(ref_weights, ref["tokens"][:2], only_conv)
    assert only_conv.trace().names() == ["layers.0.kda.conv.norm", "logits.top_ids", "logits.top_probs"]
    assert only_conv.trace()["logits.top_ids"].shape == (2, 3)
    with pytest.raises(ValueError, match="is not a hook name"):
        Recorder(full=["layers.3.attn.inn"])
    with pytest.raises(ValueError, match="layer 2 has the sites"):
        Recorder(full=["layers.2.kda.state"]).bind(ref_weights)


# ---------------------------------------------------------------- named axes


def test_attn_res_weights_layout(recorded, ref):
    trace, _ = recorded
    w = trace.attn_res_weights()
    assert w.shape == (16, 14, 2, 6)
    assert trace.source_labels() == ["embedding", "block 1", "block 2", "block 3", "block 4", "current"]
    for i in range(14):
        for s, site in enumerate(("attn", "mlp")):
            key = f"attnres_L{i:02d}_{site}_decode"
            if key not in ref:
                assert np.isnan(w[:, i, s]).all()
                continue
            raw = ref[key]  # [T, n+1]: stored blocks then current
            n = raw.shape[1] - 1
            np.testing.assert_allclose(w[:, i, s, :n], raw[:, :n], atol=1e-4)
            np.testing.assert_allclose(w[:, i, s, -1], raw[:, -1], atol=1e-4)  # current is always last
            assert np.isnan(w[:, i, s, n:-1]).all()
            np.testing.assert_allclose(np.nansum(w[:, i, s], axis=1), 1.0, atol=1e-6)
    # blocks seal at layers 0, 3, 6, 9, 12: before the FFN of layer i there are i // 3 + 1 stored blocks
    assert [int((~np.isnan(w[0, i, 1, :-1])).sum()) for i in range(14)] == [i // 3 + 1 for i in range(14)]
    f = trace.final_attn_res_weights()
    np.testing.assert_allclose(f, ref["attnres_output_decode"], atol=1e-4)


def test_ragged_records_are_padded(ref_weights, ref):
    from kimi_explore.inspection.interventions import ablate_experts

    rec = Recorder(full=["layers.2.mla.probs"])
    rec.extend(ablate_experts(5, [int(ref["router_L05_topk_idx_decode"][1][0])], positions=1))
    run(ref_weights, ref["tokens"][:3], rec)
    trace = rec.trace()
    probs = trace["layers.2.mla.probs"]  # [T, heads, positions so far], NaN-padded
    assert probs.shape == (3, 6, 3)
    assert np.isnan(probs[0, :, 1:]).all() and not np.isnan(probs[2]).any()
    np.testing.assert_allclose(np.nansum(probs, axis=2), 1.0, atol=1e-6)
    ids = trace["layers.5.moe.router.topk_ids"]
    assert ids.shape == (3, 2) and ids[1, 1] == -1 and (ids[[0, 2]] >= 0).all()
    assert np.isnan(trace["layers.5.moe.router.topk_weights"][1, 1])


def test_layer_subset_trace(ref):
    w = from_pretrained(REFERENCE_DIR, device="cpu", layers=range(4))
    rec = Recorder().bind(w)
    run(w, ref["tokens"][:4], rec)
    trace = rec.trace()
    assert trace.layer_ids == [0, 1, 2, 3]
    assert trace.source_labels() == ["embedding", "block 1", "current"]
    assert trace.kda_layers == [0, 1, 3] and trace.mla_layers == [2] and trace.moe_layers == [1, 2, 3]
    np.testing.assert_allclose(trace.final_attn_res_weights(), ref["attnres_output_decode_trunc4"][:4], atol=1e-4)


# ---------------------------------------------------------------- files and frames


def test_save_load_round_trip_is_exact(recorded, tmp_path):
    trace, _ = recorded
    path = trace.save(tmp_path / "trace")
    assert path.suffix == ".npz"
    back = Trace.load(path)
    assert back.equals(trace) and back.names() == trace.names()
    assert back.meta["num_experts"] == 8 and back.meta["attention_kinds"][2] == "mla"
    for name in trace.names():
        assert back[name].dtype == trace[name].dtype
        np.testing.assert_array_equal(back[name], trace[name])
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not a kimi_explore trace"):
        Trace.load(tmp_path / "other.npz")


def test_unbound_trace_infers_structure(ref_weights, ref):
    rec = Recorder()
    run(ref_weights, ref["tokens"][:2], rec)
    trace = rec.trace()
    assert trace.meta == {}
    assert trace.layer_ids == list(range(14)) and trace.kda_layers == list(ref["kda_layers"])
    assert trace.max_sources == 6 and trace.attn_res_weights().shape == (2, 14, 2, 6)


def test_missing_record_error_says_how_to_record_it(recorded):
    trace, _ = recorded
    with pytest.raises(KeyError, match=r"Recorder\(full=\[\.\.\.\]\)"):
        trace["layers.3.attn.out"]


def test_to_pandas_long_format(recorded):
    pd = pytest.importorskip("pandas")
    trace, _ = recorded
    names = ["layers.4.moe.router.topk_ids", "final.attn_res.weights", "layers.2.mla.probs"]
    df = trace.to_pandas(names)
    assert isinstance(df, pd.DataFrame)
    assert list(df.columns) == ["t", "position", "token", "name", "layer", "index", "value"]
    ids = df[df.name == "layers.4.moe.router.topk_ids"]
    assert len(ids) == 16 * 2 and (ids.layer == 4).all()
    row = ids[(ids.t == 5) & (ids["index"] == (1,))]
    assert row.value.item() == trace["layers.4.moe.router.topk_ids"][5, 1]
    assert row.token.item() == trace.tokens[5]
    # NaN padding of the growing MLA probs is left out: head x positions so far
    assert (df.name == "layers.2.mla.probs").sum() == 6 * sum(range(1, 17))
    assert df[df.name == "final.attn_res.weights"].layer.isna().all()


# ---------------------------------------------------------------- the batched array helpers


def test_row_squares_small_and_large_paths(monkeypatch):
    from kimi_explore.inspection import _recording

    rng = np.random.default_rng(0)
    states = [rng.standard_normal((4, 8, 8)).astype(np.float32) for _ in range(5)]
    want = np.stack([(s.astype(np.float64) ** 2).sum(axis=(1, 2)) for s in states])
    rs = _recording.RowSquares()
    for _ in range(2):  # the second call reuses the scratch buffer
        np.testing.assert_allclose(rs.of(states, 4), want, rtol=1e-5)
    states[0][0, 0, 0] += 1  # the scratch buffer holds no stale copy
    want[0, 0] = (states[0][0].astype(np.float64) ** 2).sum()
    np.testing.assert_allclose(rs.of(states, 4), want, rtol=1e-5)
    monkeypatch.setattr(_recording, "BUFFER_BYTES", 100)  # K3-sized inputs: array by array
    np.testing.assert_allclose(_recording.RowSquares().of(states, 4), want, rtol=1e-5)
    windows = [rng.standard_normal((3, 32, 4)).astype(np.float32) for _ in range(3)]  # 4 heads of 8 channels
    got = _recording.RowSquares().of(windows, 12).reshape(3, 3, 4)
    ref = np.stack([(w.reshape(3, 4, 8 * 4).astype(np.float64) ** 2).sum(axis=2) for w in windows])
    np.testing.assert_allclose(got, ref, rtol=1e-5)


@pytest.mark.parametrize("V", [256, 20000], ids=["full-sort", "partition"])
def test_top_predictions_both_paths(V):
    from kimi_explore.inspection.topk import top_predictions

    rng = np.random.default_rng(V)
    logits = rng.standard_normal((3, V)).astype(np.float32)
    logits[1, [5, 9]] = logits[1].max() + 1  # a tie: the lower id comes first
    ids, probs = top_predictions(logits, 7)
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    want = np.argsort(-p, axis=1, kind="stable")[:, :7]
    np.testing.assert_array_equal(ids, want)
    assert list(ids[1, :2]) == [5, 9]
    np.testing.assert_allclose(probs, np.take_along_axis(p, want, axis=1), rtol=1e-5)
    one_ids, one_probs = top_predictions(logits[0], 7)
    np.testing.assert_array_equal(one_ids, ids[0])


@pytest.mark.parametrize("every", [1, 3, 5])
def test_batch_boundaries_do_not_change_records(ref_weights, ref, recorded, monkeypatch, every):
    from kimi_explore.inspection import recorder

    monkeypatch.setattr(recorder, "FLUSH_TOKENS", every)
    rec = Recorder(full=["layers.*.kda.conv", "layers.*.kda.state", "layers.*.moe.*_out", "layers.2.mla.probs",
                         "final.block_residual"]).bind(ref_weights)
    run(ref_weights, ref["tokens"], rec)
    assert rec.trace().equals(recorded[0])


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no usable CUDA GPU (CuPy absent or no device)")
def test_recorder_on_the_gpu_matches_the_host(ref, recorded):
    """Device records (moved to the host in batches) equal the host recorder's, and the reference."""
    wg = from_pretrained(REFERENCE_DIR, device="gpu")
    rec = Recorder(full=["layers.*.kda.conv", "layers.*.kda.state", "layers.*.moe.*_out", "layers.2.mla.probs",
                         "final.block_residual"]).bind(wg)
    run(wg, ref["tokens"], rec)
    gpu, cpu = rec.trace(), recorded[0]
    assert gpu.names() == cpu.names() and np.array_equal(gpu.tokens, cpu.tokens)
    for name in cpu.names():
        assert isinstance(gpu[name], np.ndarray) and gpu[name].shape == cpu[name].shape, name
        if cpu[name].dtype.kind in "iu":
            np.testing.assert_array_equal(gpu[name], cpu[name], err_msg=name)
        else:  # float32 rounding of another sum order (the host's C kernels), relative to the record's scale
            scale = max(1.0, float(np.nanmax(np.abs(cpu[name])))) if cpu[name].size else 1.0
            np.testing.assert_allclose(gpu[name], cpu[name], atol=1e-4 * scale, rtol=1e-4, equal_nan=True, err_msg=name)
    norms, _ = gpu.kda_state_norms()
    np.testing.assert_allclose(norms, ref["kda_state_norm_decode"], atol=1e-4, rtol=0)
    unbound = Recorder()  # learns it is on a device from the first value it sees
    run(wg, ref["tokens"][:3], unbound)
    np.testing.assert_allclose(unbound.trace()["final.attn_res.weights"], cpu["final.attn_res.weights"][:3], atol=1e-5)


def test_a_traces_config_is_its_own_model_config(ref_weights):
    """The meta's config (made once per config: `_recording.model_meta`) is each model's own, also for two configs
    equal as dataclasses but not as JSON (a lower bound of -5 and of -5.0), and for a config with a list field."""
    import copy
    import dataclasses
    import json

    from kimi_explore.inspection._recording import model_meta

    cfg = ref_weights.config
    la = cfg.linear_attn_config
    configs = [cfg, dataclasses.replace(cfg, linear_attn_config=dataclasses.replace(la, gate_lower_bound=-5)),
               dataclasses.replace(cfg, linear_attn_config=dataclasses.replace(la, kda_layers=list(la.kda_layers)))]
    assert configs[0] == configs[1]
    for c in configs + configs:
        weights = copy.copy(ref_weights)
        object.__setattr__(weights, "config", c)
        got = model_meta(weights)["config"]
        assert got == json.loads(json.dumps(dataclasses.asdict(c), default=str))
        assert type(got["linear_attn_config"]["gate_lower_bound"]) is type(c.linear_attn_config.gate_lower_bound)
