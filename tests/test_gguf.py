"""llama.cpp GGUF (`kimi-k3`) loading, on the two engine sets written by llama.cpp's own converter.

tests/data/engines/{d,e}: the tiny K3 in the released layout (`tiny_k3/`), Moonshot's reference
outputs, and `llamacpp/model-mxfp4.gguf` (routed experts MXFP4 in ggml's block layout, the rest
F32) and `llamacpp/model-f32experts.gguf` (experts dequantised to F32 by gguf-py). The GGUF and the
safetensors checkpoint hold the same numbers in another layout, so every hooked value must be the
same bits; that is the test, route by route.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import DATA, require_kernel
from naive_decoder import Collect

import kimi_explore as ke
from kimi_explore import CheckpointError, ConfigError, KimiDecodeState, kimi_forward_token
from kimi_explore.model.config import KimiDecoderConfig
from kimi_explore.weights import ggml_quants, mxfp4, mxfp4_matvec
from kimi_explore.weights.gguf_io import GgufFile, write_gguf
from kimi_explore.weights.load import read_config
from kimi_explore.weights.memory import MAPPED, memory_report

ENGINES = DATA / "engines"
SETS = ("d", "e")


def mxfp4_gguf(s: str) -> Path:
    return ENGINES / s / "llamacpp" / "model-mxfp4.gguf"


def f32_gguf(s: str) -> Path:
    return ENGINES / s / "llamacpp" / "model-f32experts.gguf"


def tokens(s: str) -> list[int]:
    return json.loads((ENGINES / s / "tiny_k3_meta.json").read_text())["tokens"]


def decode(weights, toks, hooks=None) -> np.ndarray:
    state = KimiDecodeState.new(weights)
    return np.stack([kimi_forward_token(weights, state, int(t), hooks=hooks) for t in toks])


def bits(a) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8)


def assert_same_run(a, b, s: str) -> None:
    """Logits and every hooked value of weights `a` and `b` over the set's 16 tokens: the same bits."""
    ha, hb = Collect(), Collect()
    la, lb = decode(a, tokens(s), ha), decode(b, tokens(s), hb)
    np.testing.assert_array_equal(bits(la), bits(lb))
    assert list(ha.values) == list(hb.values) == [n for n in ke.hook_names(a)]  # every site fired, same order
    for name in ha.values:
        for t, (x, y) in enumerate(zip(ha.values[name], hb.values[name], strict=True)):
            assert x.dtype == y.dtype and x.shape == y.shape, (name, t)
            assert np.array_equal(bits(x), bits(y)), f"{name} differs at token {t}"


# ---------------------------------------------------------------- the format pieces


def test_ggml_type_sizes_are_the_gguf_packages():
    gguf = pytest.importorskip("gguf")
    for t in gguf.GGMLQuantizationType:
        assert ggml_quants.TYPES[t.value] == (t.name,) + tuple(gguf.GGML_QUANT_SIZES[t]), t.name


def test_mxfp4_blocks_are_the_compressed_tensors_values_bit_for_bit():
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (3, 5, 48), dtype=np.uint8)
    scale = rng.integers(100, 150, (3, 5, 3), dtype=np.uint8)
    blocks = ggml_quants.mxfp4_blocks_from_packed(packed, scale)
    assert blocks.shape == (3, 5, 3, 17)
    p2, s2 = ggml_quants.packed_from_mxfp4_blocks(blocks)
    np.testing.assert_array_equal(p2, packed)
    np.testing.assert_array_equal(s2, scale)
    for dtype in (np.float32, np.float64):
        ours = ggml_quants.dequantize_mxfp4(blocks, dtype=dtype)
        np.testing.assert_array_equal(bits(ours), bits(mxfp4.dequantize(packed, scale, dtype=dtype)))
    for e, r in ((0, 0), (2, 4)):  # the float64 reference reads the blocks itself, value by value
        np.testing.assert_array_equal(ggml_quants.dequantize_mxfp4(blocks[e, r], dtype=np.float64),
                                      ggml_quants.naive_dequantize_mxfp4(blocks[e, r]))


def test_the_block_layout_is_what_the_converter_wrote():
    """ggml block = E8M0 byte + 16 bytes, code j low / code j + 16 high: the released bytes, rearranged."""
    from kimi_explore.weights.safetensors_io import SafetensorsFile

    f, st = GgufFile(mxfp4_gguf("d")), SafetensorsFile(ENGINES / "d" / "tiny_k3" / "model.safetensors")
    ne = f.tensors["blk.2.ffn_down_exps.weight"].ne  # [I, l, E]
    blocks = f.raw("blk.2.ffn_down_exps.weight").reshape(ne[2], ne[1], ne[0] // 32, 17)
    name = "language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight"
    packed, scale = ggml_quants.packed_from_mxfp4_blocks(blocks[5])
    np.testing.assert_array_equal(packed, st.array(name + "_packed"))
    np.testing.assert_array_equal(scale, st.array(name + "_scale"))


def test_ggml_kernel_is_the_packed_kernel_bit_for_bit():
    """The fused kernel on ggml blocks gives the floats it gives on compressed-tensors bytes, on every ISA."""
    require_kernel()
    rng = np.random.default_rng(5)
    packed = rng.integers(0, 256, (6, 40, 80), dtype=np.uint8)
    scale = rng.integers(110, 135, (6, 40, 5), dtype=np.uint8)
    blocks = ggml_quants.mxfp4_blocks_from_packed(packed, scale)
    for x in (rng.standard_normal(160).astype(np.float32), rng.standard_normal((3, 160)).astype(np.float32)):
        for isa in mxfp4_matvec.isas():
            want = mxfp4_matvec.expert_matvec(packed, scale, [5, 0, 5], x, isa=isa)
            got = mxfp4_matvec.ggml_expert_matvec(blocks, [5, 0, 5], x, isa=isa)
            np.testing.assert_array_equal(bits(got), bits(want))
    deq = mxfp4.dequantize(packed, scale).astype(np.float64)
    np.testing.assert_allclose(mxfp4_matvec.ggml_expert_matvec(blocks, [1], x[1]), deq[[1]] @ x[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"\[E, R, C/32, 17\]"):
        mxfp4_matvec.ggml_expert_matvec(blocks[..., :16], [0], x[0])
    with pytest.raises(IndexError, match="expert id 6"):
        mxfp4_matvec.ggml_expert_matvec(blocks, [6], x[0])


def test_f16_bf16_q8_0_read_exactly(tmp_path):
    """F16, BF16 and Q8_0 against float64 transcriptions of their definitions, through a written GGUF."""
    rng = np.random.default_rng(9)
    f16 = rng.standard_normal((3, 64)).astype(np.float16)
    bf16 = (rng.standard_normal((3, 64)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    d = rng.uniform(0.01, 0.1, (3, 2)).astype(np.float16)  # 2 blocks per row
    q = rng.integers(-127, 128, (3, 2, 32), dtype=np.int8)
    q8 = np.concatenate([d[..., None].view(np.uint8).reshape(3, 2, 2), q.view(np.uint8)], axis=-1)  # [3, 2, 34]
    path = tmp_path / "types.gguf"
    write_gguf(path, {"general.architecture": "test"}, {"general.architecture": 8},
               [("a", (64, 3), "F16", f16.tobytes()), ("b", (64, 3), "BF16", bf16.tobytes()),
                ("c", (64, 3), "Q8_0", q8.tobytes())])
    f = GgufFile(path)
    assert f.info("c") == ("Q8_0", (3, 64)) and f.metadata == {"general.architecture": "test"}
    read = lambda n: ggml_quants.dequantize(f.raw(n), f.info(n)[0], f.info(n)[1], np.float64)  # noqa: E731
    np.testing.assert_array_equal(read("a"), f16.astype(np.float64))
    np.testing.assert_array_equal(read("b"), bf16.view(ml_dtypes.bfloat16).astype(np.float64))
    want = np.float32(d.astype(np.float32))[..., None] * q.astype(np.float32)  # ggml: f32(d) * q in float32
    np.testing.assert_array_equal(read("c"), want.reshape(3, 64).astype(np.float64))
    gguf = pytest.importorskip("gguf")
    np.testing.assert_array_equal(read("c"), gguf.quants.dequantize(f.raw("c").reshape(3, 68), gguf.GGMLQuantizationType.Q8_0))


def test_other_types_go_through_the_gguf_package_or_say_so(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (2, 18), dtype=np.uint8)  # Q4_0: 2 blocks of 32
    raw[:, :2] = np.frombuffer(np.float16([0.05, 0.02]).tobytes(), np.uint8).reshape(2, 2)
    try:
        import gguf
    except ImportError:
        gguf = None
    if gguf is not None:
        got = ggml_quants.dequantize(raw.reshape(-1), "Q4_0", (2, 32))
        np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0))
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # as if not installed
    with pytest.raises(ImportError, match=r"Q4_0 .*kimi-explore\[gguf\]"):
        ggml_quants.dequantize(raw.reshape(-1), "Q4_0", (2, 32))


# ---------------------------------------------------------------- the config


@pytest.mark.parametrize("s", SETS)
def test_metadata_gives_the_config_json_config(s):
    from kimi_explore.weights.gguf_config import config_from_gguf

    f = GgufFile(mxfp4_gguf(s))
    cfg = config_from_gguf(f.metadata, f.types, {n: f.info(n) for n in f.tensors}, str(f.path))
    assert cfg == KimiDecoderConfig.from_file(ENGINES / s / "tiny_k3" / "config.json")
    assert cfg.rms_norm_eps == 1e-5 and f.metadata["kimi-k3.attention.layer_norm_rms_epsilon"] != 1e-5  # stored as F32
    assert read_config(mxfp4_gguf(s)) == cfg  # what a pipeline reads before it starts its stages


# ---------------------------------------------------------------- the same numbers as the released checkpoint


ROUTES = {  # name: (experts, expert_cache_size)
    "fused": ("packed", 0),  # the compiled kernel on the packed bytes
    "dequantising": ("packed", 8),  # every expert dequantised into the cache
    "mapped-fused": ("mapped", 0),  # the kernel reading the mapped file in place
    "mapped-dequantising": ("mapped", 2),
}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("s", SETS)
def test_mxfp4_gguf_is_the_checkpoint_bit_for_bit(s, route):
    """Logits and every hooked value: the GGUF and the safetensors checkpoint, same expert route."""
    experts, cache = ROUTES[route]
    if cache == 0:
        require_kernel()
    g = ke.from_pretrained(mxfp4_gguf(s), device="cpu", experts=experts, expert_cache_size=cache)
    w = ke.from_pretrained(ENGINES / s / "tiny_k3", device="cpu", experts=experts, expert_cache_size=cache)
    bank = g.layers[1].ffn.experts
    assert bank.uses_fused == (cache == 0) and ("ggml blocks" in bank.route) and bank.mapped == (experts == "mapped")
    assert w.layers[1].ffn.experts.uses_fused == (cache == 0)
    assert_same_run(g, w, s)


@pytest.mark.parametrize("s", SETS)
def test_a_prefill_from_the_gguf_reads_each_expert_once_and_is_the_checkpoints(s, monkeypatch):
    """The sequence path on ggml blocks groups a chunk's selections by expert (`grouped_ggml_matmat`: each expert's
    blocks read once per chunk, as the compressed-tensors banks are; it went row by row): logits and state the
    same bits as the safetensors checkpoint's prefill, with groups large enough for the panels (>= 12 rows of an
    expert in a chunk of 96) and small ones (chunk 7)."""
    require_kernel()
    g = ke.from_pretrained(mxfp4_gguf(s), device="cpu", experts="packed", expert_cache_size=0)
    w = ke.from_pretrained(ENGINES / s / "tiny_k3", device="cpu", experts="packed", expert_cache_size=0)
    V = g.config.vocab_size
    ids = np.random.default_rng(7).integers(0, V, 96).tolist()
    calls = []
    real = mxfp4_matvec.grouped_ggml_matmat

    def counted(blocks, experts, bounds, *args, **kwargs):
        calls.append(int(np.max(np.diff(bounds))))
        return real(blocks, experts, bounds, *args, **kwargs)

    monkeypatch.setattr(mxfp4_matvec, "grouped_ggml_matmat", counted)
    for chunk in (96, 7):
        sg, sw = ke.KimiDecodeState.new(g), ke.KimiDecodeState.new(w)
        lg = ke.kimi_forward_sequence(g, sg, ids, chunk=chunk)
        lw = ke.kimi_forward_sequence(w, sw, ids, chunk=chunk)
        np.testing.assert_array_equal(bits(lg), bits(lw))
        for a, b in zip(sg.layers, sw.layers, strict=True):
            for x, y in zip(vars(a.attention).values(), vars(b.attention).values(), strict=True):
                if isinstance(x, np.ndarray):
                    np.testing.assert_array_equal(bits(x), bits(y))
    assert calls and max(calls) >= 12  # the panels ran


@pytest.mark.parametrize("s", SETS)
def test_kda_decay_recovered_as_the_checkpoint_computes_it(s):
    """A = f32(exp(f64(A_log))): recovered from ssm_a = -exp(A_log) bit for bit on every head, where
    -ssm_a itself (llama.cpp's value) is 1 ulp off on one head of set e."""
    g = ke.from_pretrained(mxfp4_gguf(s), device="cpu")
    w = ke.from_pretrained(ENGINES / s / "tiny_k3", device="cpu")
    f = GgufFile(mxfp4_gguf(s))
    off = 0
    for lg, lw in zip(g.layers, w.layers, strict=True):
        if lg.attention.kind == "kda":
            np.testing.assert_array_equal(bits(lg.attention.A), bits(lw.attention.A))
            stored = -f.raw(f"blk.{lg.index}.ssm_a").view(np.float32)
            off += int((stored != lw.attention.A.reshape(-1)).sum())
    assert off == (1 if s == "e" else 0)


@pytest.mark.parametrize("s", SETS)
def test_float64_gguf_is_the_checkpoint_but_for_a_recovered_a_log(s):
    """In float64 A keeps every bit of the recovered A_log: exact on set d; on set e one head's A_log is
    1 float32 ulp off (the GGUF stores only -exp(A_log) in float32), which moves the logits by ~2e-8."""
    g = decode(ke.from_pretrained(mxfp4_gguf(s), device="cpu", dtype="float64"), tokens(s))
    w = decode(ke.from_pretrained(ENGINES / s / "tiny_k3", device="cpu", dtype="float64"), tokens(s))
    if s == "d":
        np.testing.assert_array_equal(g, w)
    else:
        assert 0 < np.abs(g - w).max() < 1e-7


@pytest.mark.parametrize("s", SETS)
def test_f32_experts_gguf_is_the_dense_checkpoint(s):
    """gguf-py's F32 experts are the dequantised MXFP4 values, except that it writes code 8 (-0) as +0;
    the runs are still the same bits (measured: every logit and hooked value)."""
    f = GgufFile(f32_gguf(s))
    g = ke.from_pretrained(f32_gguf(s), device="cpu")
    w = ke.from_pretrained(ENGINES / s / "tiny_k3", device="cpu", experts="dense")
    assert g.extra["experts"] == "dense" and not f.info("blk.1.ffn_gate_exps.weight")[0] == "MXFP4"
    ours = np.asarray(w.layers[1].ffn.experts.w2)
    theirs = f.raw("blk.1.ffn_down_exps.weight").view(np.float32).reshape(ours.shape)
    np.testing.assert_array_equal(theirs, ours)  # equal as numbers
    differ = bits(theirs).view(np.uint32) != bits(ours).view(np.uint32)
    assert differ.any() and np.all(ours[differ] == 0) and np.all(np.signbit(ours[differ]))
    assert not np.signbit(theirs[differ]).any()
    assert_same_run(g, w, s)
    with pytest.raises(CheckpointError, match="not all MXFP4 on disk"):
        ke.from_pretrained(f32_gguf(s), device="cpu", experts="packed")


@pytest.mark.parametrize("s", SETS)
def test_reference_logits_are_met(s):
    """Moonshot's reference outputs, within the tolerances of test_reference_parity (the same bits, too)."""
    with np.load(ENGINES / s / "tiny_k3_expected.npz") as z:
        ref = {k: z[k] for k in ("tokens", "logits_decode")}
    logits = decode(ke.from_pretrained(mxfp4_gguf(s), device="cpu"), ref["tokens"])
    np.testing.assert_allclose(logits, ref["logits_decode"], atol=1e-3, rtol=0)
    assert (logits.argmax(-1) == ref["logits_decode"].argmax(-1)).all()


def test_bf16_gguf_keeps_bf16_bits(tmp_path):
    """A GGUF whose trunk matrices are BF16 (exact: they were bf16 in the release) loads with
    weight_dtype="bfloat16" as bf16 bits, and runs what the safetensors checkpoint runs."""
    src = GgufFile(mxfp4_gguf("d"))
    tensors = []
    for name, t in src.tensors.items():
        raw = src.raw(name)
        if t.type == "F32" and len(t.ne) == 2 and "ssm_conv" not in name:
            raw = (raw.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # bf16-exact values: truncation is exact
            tensors.append((name, t.ne, "BF16", raw.tobytes()))
        else:
            tensors.append((name, t.ne, t.type, raw.tobytes()))
    path = tmp_path / "bf16.gguf"
    write_gguf(path, src.metadata, src.types, tensors)
    kw = dict(device="cpu", weight_dtype="bfloat16", bf16_matvec="widen", experts="packed", expert_cache_size=8)
    g = ke.from_pretrained(path, **kw)
    assert g.layers[0].attention.in_proj.bits.dtype == np.uint16
    assert_same_run(g, ke.from_pretrained(ENGINES / "d" / "tiny_k3", **kw), "d")


# ---------------------------------------------------------------- the toolset on a GGUF model


def test_session_and_memory_report_on_a_mapped_gguf():
    g = ke.from_pretrained(mxfp4_gguf("d"), device="cpu", experts="mapped")
    w = ke.from_pretrained(ENGINES / "d" / "tiny_k3", device="cpu", experts="mapped")
    assert ke.hook_names(g) == ke.hook_names(w)
    sg, sw = ke.Session(g), ke.Session(w)
    toks = tokens("d")[:6]
    for s in (sg, sw):  # the same operations on both: the same bits
        s.feed(toks)
        s.truncate(3)
        s.feed(toks[3:])
    np.testing.assert_array_equal(bits(sg.logits), bits(sw.logits))
    tg, tw = sg.trace(), sw.trace()
    assert tg.names() == tw.names() and "layers.2.moe.router.topk_ids" in tg
    assert all(np.array_equal(bits(tg[n]), bits(tw[n])) for n in tg.names())
    assert {**tg.meta, "source": None} == {**tw.meta, "source": None} and tg.meta["source"] == str(mxfp4_gguf("d"))
    report = memory_report(g)
    assert report["routed experts, MXFP4 packed"] == 0 and report.mapped[MAPPED] == 13 * 3 * 8 * 32 * 17
    assert g.memory_report().total == report.total
    assert str(mxfp4_gguf("d")) == g.source


# ---------------------------------------------------------------- split files


def _split(src: Path, out: Path, n: int) -> list[Path]:
    """llama.cpp's gguf-split layout: <prefix>-0000k-of-0000n.gguf, metadata in the first, split.* keys in all."""
    f = GgufFile(src)
    names = list(f.tensors)
    cuts = [len(names) * k // n for k in range(n + 1)]
    paths = []
    for k in range(n):
        meta = dict(f.metadata) if k == 0 else {}
        types = dict(f.types) if k == 0 else {}
        meta.update({"split.no": k, "split.count": n, "split.tensors.count": len(names)})
        types.update({"split.no": 2, "split.count": 2, "split.tensors.count": 5})
        part = [(m, f.tensors[m].ne, f.tensors[m].type, f.raw(m).tobytes()) for m in names[cuts[k] : cuts[k + 1]]]
        paths.append(out / f"model-{k + 1:05d}-of-{n:05d}.gguf")
        write_gguf(paths[-1], meta, types, part)
    return paths


def test_split_gguf_loads_as_one(tmp_path):
    paths = _split(mxfp4_gguf("d"), tmp_path, 3)
    whole = ke.from_pretrained(mxfp4_gguf("d"), device="cpu", experts="packed", expert_cache_size=8)
    for p in (paths[0], paths[2]):  # any split names the set
        assert_same_run(ke.from_pretrained(p, device="cpu", experts="packed", expert_cache_size=8), whole, "d")
    paths[1].unlink()
    with pytest.raises(CheckpointError, match="missing: model-00002-of-00003.gguf"):
        ke.from_pretrained(paths[0], device="cpu")


# ---------------------------------------------------------------- refusals


def _rewrite(tmp_path, *, drop_keys=(), meta=None, drop=(), reshape=None) -> Path:
    """A copy of set d's MXFP4 GGUF with metadata keys changed/dropped, tensors dropped or re-shaped."""
    f = GgufFile(mxfp4_gguf("d"))
    m = {k: v for k, v in f.metadata.items() if k not in drop_keys}
    m.update(meta or {})
    tensors = []
    for name, t in f.tensors.items():
        if name in drop:
            continue
        ne, raw = t.ne, f.raw(name).tobytes()
        if reshape and name in reshape:
            ne = reshape[name]
            if int(np.prod(ne)) != int(np.prod(t.ne)):  # (F32 values cut; unit axes keep every byte)
                raw = raw[: int(np.prod(ne)) * 4]
        tensors.append((name, ne, t.type, raw))
    path = tmp_path / "bad.gguf"
    write_gguf(path, m, f.types, tensors)
    return path


def test_truncated_gguf_names_the_tensor(tmp_path):
    path = tmp_path / "cut.gguf"
    data = mxfp4_gguf("d").read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"cut.gguf: truncated: tensor '.*' .* ends at byte \d+, but the file has only"):
        ke.from_pretrained(path, device="cpu")
    path.write_bytes(data[:5000])  # inside the metadata
    with pytest.raises(CheckpointError, match="cut.gguf: truncated or corrupt GGUF header"):
        ke.from_pretrained(path, device="cpu")
    path.write_bytes(b"GGML" + data[4:])
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        ke.from_pretrained(path, device="cpu")


def test_another_architecture_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="general.architecture is 'deepseek2'; .*'kimi-k3'"):
        ke.from_pretrained(_rewrite(tmp_path, meta={"general.architecture": "deepseek2"}), device="cpu")


def test_missing_metadata_keys_are_all_listed(tmp_path):
    path = _rewrite(tmp_path, drop_keys=("kimi-k3.kda.head_dim", "kimi-k3.attn_res.block_size"))
    with pytest.raises(ConfigError, match="missing GGUF metadata key.*kimi-k3.attn_res.block_size, kimi-k3.kda.head_dim"):
        ke.from_pretrained(path, device="cpu")


def test_missing_tensor_is_named(tmp_path):
    path = _rewrite(tmp_path, drop=("blk.6.attn_k_b.weight", "blk.3.ssm_f_b.weight"))
    with pytest.raises(CheckpointError, match=r"2 tensor\(s\) .* not in the GGUF: blk.3.ssm_f_b.weight, blk.6.attn_k_b.weight"):
        ke.from_pretrained(path, device="cpu")
    ke.from_pretrained(path, device="cpu", layers=[0, 1, 2])  # layers that do not need them load


def test_wrong_shape_is_named(tmp_path):
    path = _rewrite(tmp_path, reshape={"blk.4.attn_q.weight": (64, 96)})
    with pytest.raises(CheckpointError, match=r"blk.4.attn_q.weight' \(model.layers.4.self_attn.q_proj.weight\): "
                                              r"expected shape \[192, 64\], found F32\[96, 64\]"):
        ke.from_pretrained(path, device="cpu")


@pytest.mark.parametrize("experts", ["packed", "dense", "mapped"])
def test_unit_axes_move_no_byte_and_load_the_same_model(tmp_path, experts):
    """`check` compares shapes without their size-1 axes; an expert bank or attn_k_b stored with one more (ne [32, 32,
    1, 8]) is the same bytes and must load as the same model (its readers took the stored 4-D shape: bare NumPy
    errors)."""
    f = GgufFile(mxfp4_gguf("d"))
    ne = {n: f.tensors[n].ne for n in ("blk.5.ffn_up_exps.weight", "blk.5.ffn_down_exps.weight", "blk.2.attn_k_b.weight")}
    path = _rewrite(tmp_path, reshape={n: (*e[:2], 1, *e[2:]) for n, e in ne.items()})
    assert GgufFile(path).tensors["blk.5.ffn_up_exps.weight"].ne[2] == 1
    assert_same_run(ke.from_pretrained(path, device="cpu", experts=experts),
                    ke.from_pretrained(mxfp4_gguf("d"), device="cpu", experts=experts), "d")


def test_revision_is_refused_for_a_file():
    with pytest.raises(ValueError, match="revision='main' applies to Hub repo ids"):
        ke.from_pretrained(mxfp4_gguf("d"), revision="main")
