"""Decode speed and load memory at the REAL K3 shapes (synthetic weights), per layer kind.

    python bench/k3_shapes.py [--device cpu|gpu] [--weight-dtype float32[,bfloat16]] [--tokens 4]
                              [--layers 0,1,3] [--chunk 1,16,64,256] [--no-decode]
                              [--experts 32] [--balanced]
                              [--ckpt bench/results/k3_shapes_ckpt] [--json bench/results/k3_shapes.json]

Writes once (streaming, shard by shard) a checkpoint in the released layout with K3's widths:
hidden 7168, KDA 96 x 128 (P = 12288), MLA 96 heads (q_lora 1536, kv_lora 512, 128/64/128),
dense layer-0 MLP 33792, latent 3584, moe_intermediate 3072, 2 shared experts, top-16, MXFP4
experts; but 32 experts per layer instead of 896 (the per-token work is the same top-16) and a
vocabulary of 8192 instead of 163840 (to save disk). Only the timed layers are on disk (default 0
KDA + dense, 1 KDA + MoE, 3 MLA + MoE); the config keeps K3's 93-layer pattern.

Each layer is then loaded ALONE in a fresh subprocess (peak resident memory while loading, from
/proc/self/status VmHWM, against memory_report's total) and decoded one token at a time with a
timing hook object (synchronising the GPU at each mark). Reported per layer kind and phase:
ms/token (best of the timed tokens; medians in the JSON) for the attention and FFN halves, bytes
of weights read per token, achieved GB/s, and the ratio to the floor = bytes / (this machine's
memory bandwidth, measured in the same run: before, in each layer's process, and after; best kept).

MoE phases: "fused" (CPU, compiled kernel built) = no expert cache, the 16 selected experts
multiplied straight from their MXFP4 bytes by `mxfp4_matvec` (bytes read = their packed bytes);
"cold" = no expert cache, the 16 selected experts dequantised from MXFP4 every token, then BLAS
(bytes read = their packed bytes); "warm" = the 16 experts already dequantised in the LRU cache
(routing pinned to one token's 16 experts by a topk_ids hook, so every token hits; bytes read =
their float32 bytes). Attention and trunk matrices are read whole every token at their resident
dtype (float32, or bf16 bits with --weight-dtype bfloat16).

--chunk 1,16,64,256 adds the sequence (prefill) path: per chunk size c, the layer's halves run on c
rows at once (`kda_sequence` / `mla_sequence`, then `latent_moe_sequence` with the experts as in the
"fused" phase, or `dense_mlp_sequence`), one warm-up chunk then the best of a few (--tokens, at most
max(3, 256 / c): one timed chunk of 256 ranged 1.41x-2.01x its roofline over four runs on a shared VM), from
rows of unit RMS. ms/token = chunk time / c, by this process's CPU time on the CPU
(a shared machine's descheduled time does not count; run it with OPENBLAS_NUM_THREADS=1 there), by
wall time on a GPU. Each half is judged against a roofline measured in the same run:
max(bytes read / bandwidth, FLOPs / sgemm rate), the bandwidth as above and the sgemm peak: float32
[m, 7168] x [7168, 4096] matmuls at m = 256 and 2048 (BLAS is slower at 256 rows; best of 5 each, in
each layer's process and in the driver's, best kept). Bytes read per chunk: every attention and trunk
matrix once, plus each DISTINCT expert the chunk selected (packed bytes on the fused route); FLOPs: 2 per
weight element per row, the k selected experts per row, plus MLA's scores and mix over the cache (the
warm-up chunk and the timed chunks before the fastest one, then the chunk). "x decode" is the bytes a
decoded token reads over the bytes per token of the chunk.

Expert density: what an expert's matmul costs per row depends on how many of a chunk's rows it gets,
c k / E with a trained (load-balanced) router. With the default 32 experts every chunk above 8 gives
each many; `--experts 224 --balanced` (the routing pinned to an even spread; the synthetic router is
skewed) gives each c 16 / 224 rows, as K3's 896 experts get from a chunk of 4c (what
`kimi_sequence.default_chunk` is chosen from).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import machine  # (bench/: this script's directory)
import ml_dtypes
import numpy as np
from argtypes import at_least, int_list  # (bench/: the script's directory, on sys.path)

from kimi_explore.backend import on_host
from kimi_explore.weights import checkpoint_table as table
from kimi_explore.weights import k3_depth
from kimi_explore.weights.memory import layer_bytes, memory_report
from kimi_explore.weights.tiny_model import QUANTIZATION_CONFIG

ROOT = Path(__file__).resolve().parent.parent
BF16 = ml_dtypes.bfloat16
TOP_K = 16


# ---------------------------------------------------------------- the synthetic checkpoint


def k3_text_config(num_experts: int = 32, vocab: int = 8192) -> dict:
    """K3's text_config (the package's one copy) with fewer experts and a smaller vocabulary (too small
    for K3's special-token ids, so they are left out)."""
    return k3_depth.k3_text_config(num_experts=num_experts, vocab_size=vocab, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None)


class _Pools:
    """Random bytes to tile tensors from: generating 4 G fresh normals would dominate the write."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.normal = self.rng.standard_normal(1 << 24).astype(np.float32)
        self.bytes = self.rng.integers(0, 256, 1 << 26, dtype=np.uint8)
        self._bf16: dict[float, np.ndarray] = {}

    def bf16(self, std: float) -> np.ndarray:
        if std not in self._bf16:
            self._bf16[std] = (self.normal * std).astype(BF16).view(np.uint16)
        return self._bf16[std]

    def fill(self, pool: np.ndarray, n: int) -> np.ndarray:
        """n values tiled from `pool` starting at a random offset."""
        out = np.empty(n, pool.dtype)
        a = int(self.rng.integers(0, pool.size))
        done = 0
        while done < n:
            m = min(n - done, pool.size - a)
            out[done : done + m] = pool[a : a + m]
            done, a = done + m, 0
        return out


def _make(t, d, pools: _Pools, heads: int):
    """make(n) -> n flat values of on-disk tensor `d` (of planned tensor `t`), from the table's `init`."""
    if d.mxfp4_of is not None:
        if d.name.endswith("_packed"):
            return lambda n: pools.fill(pools.bytes, n)
        # E8M0 120 = 2^-7: uniform E2M1 codes (rms ~2.9) give rms ~0.02 ~ 1/sqrt(3584), like real K3 scales
        return lambda n: pools.rng.integers(119, 122, n, dtype=np.uint8)
    kind, *args = t.row.init
    bf16 = d.dtype == "BF16"
    cast = (lambda v: v.astype(BF16).view(np.uint16)) if bf16 else (lambda v: v.astype(np.float32))
    if kind in ("normal", "std"):  # tiled from a pool: generating 4 G fresh normals would dominate the write
        std = args[0] / float(np.sqrt(d.shape[-1])) if kind == "normal" else args[0]
        return (lambda n: pools.fill(pools.bf16(std), n)) if bf16 else (lambda n: std * pools.fill(pools.normal, n))
    if kind == "gain":
        return lambda n: cast(1.0 + 0.1 * pools.rng.standard_normal(n))
    if kind == "uniform":
        return lambda n: cast(pools.rng.uniform(args[0], args[1], n))
    if kind == "per_head":  # per head, zero-padded
        return lambda n: cast(np.r_[pools.rng.uniform(args[0], args[1], heads), np.zeros(n - heads)])
    if kind == "spread":
        return lambda n: cast(pools.rng.permutation(np.linspace(-args[0], args[0], n)))
    raise ValueError(f"unknown init {t.row.init!r} for {t.name}")


def _specs(cfg: dict, layer: int | None, pools: _Pools) -> list[tuple]:
    """(name, safetensors dtype, shape, make(n) -> flat array) for every tensor of `layer` (None: the
    global ones), from the checkpoint table."""
    from kimi_explore.model.config import KimiDecoderConfig

    c = KimiDecoderConfig.from_dict(cfg)
    heads = c.linear_attn_config.num_heads
    planned = [t for t in table.plan(c, [] if layer is None else [layer]) if t.layer == layer]
    return [(table.RELEASE_PREFIX + d.name, d.dtype, d.shape, _make(t, d, pools, heads))
            for t in planned for d in table.on_disk(t)]


_ITEMSIZE = {"BF16": 2, "F32": 4, "U8": 1}
_CHUNK = 1 << 24  # elements per write


def write_streaming(path: Path, specs: list[tuple]) -> int:
    """A safetensors file written tensor by tensor, chunk by chunk (never the whole shard in memory)."""
    header, offset = {}, 0
    for name, dtype, shape, _ in specs:
        n = int(np.prod(shape)) * _ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, shape, make in specs:
            total = int(np.prod(shape))
            for a in range(0, total, _CHUNK):
                f.write(np.ascontiguousarray(make(min(_CHUNK, total - a))).tobytes())
    return 8 + len(text) + offset


def ensure_checkpoint(ckpt: Path, layers: list[int], num_experts: int, vocab: int) -> Path:
    """Write the synthetic checkpoint unless a complete one with the same settings is there."""
    cfg = k3_text_config(num_experts, vocab)
    stamp = {"layers": layers, "num_experts": num_experts, "vocab": vocab, "version": 2}
    done = ckpt / "complete.json"
    if done.exists() and json.loads(done.read_text()) == stamp:
        return ckpt
    ckpt.mkdir(parents=True, exist_ok=True)
    pools = _Pools()
    groups = [("global", _specs(cfg, None, pools))] + [(f"layer {i}", _specs(cfg, i, pools)) for i in layers]
    weight_map, total, t0 = {}, 0, time.perf_counter()
    for k, (what, specs) in enumerate(groups):
        name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        total += write_streaming(ckpt / name, specs)
        weight_map.update({s[0]: name for s in specs})
        print(f"  wrote {name} ({what}), {total / 1e9:.1f} GB so far, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "dtype": "bfloat16",
              "text_config": {**cfg, "quantization_config": QUANTIZATION_CONFIG}, "vision_config": None}
    (ckpt / "config.json").write_text(json.dumps(config, indent=1))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    done.write_text(json.dumps(stamp))
    return ckpt


# ---------------------------------------------------------------- measuring


def _sync(xp):
    if not on_host(xp):
        xp.cuda.get_current_stream().synchronize()


def measure_bandwidth(device: str) -> dict:
    """GB/s of a 1 GiB copy (read + write counted) and of a 1 GiB float32 gemv (read; 7168 columns, as
    K3's projections), best of 10."""
    from kimi_explore.backend import resolve_device

    xp, _ = resolve_device(device)
    n = (1 << 30) // 4 // 7168 * 7168
    a = xp.ones(n, xp.float32)
    b = xp.empty_like(a)
    M = a.reshape(-1, 7168)
    x = xp.ones(M.shape[1], xp.float32)

    def best(fn):
        fn()
        _sync(xp)
        t = []
        for _ in range(10):
            t0 = time.perf_counter()
            fn()
            _sync(xp)
            t.append(time.perf_counter() - t0)
        return min(t)

    copy = 2 * a.nbytes / best(lambda: xp.copyto(b, a)) / 1e9
    gemv = a.nbytes / best(lambda: M @ x) / 1e9
    return {"copy_GBps": copy, "gemv_read_GBps": gemv, "bandwidth_GBps": max(copy, gemv)}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


class _Marks:
    """A hooks object that timestamps the layer's sites, can pin the routing, and runs a recorder."""

    def __init__(self, xp, i: int, recorder=None):
        self.xp, self.i, self.t, self.pin, self.recorder = xp, i, {}, None, recorder
        self.sites = {"embed": "start", f"layers.{i}.attn.out": "attn", f"layers.{i}.prefix_sum": "end"}

    def fire(self, name, value):
        if self.pin is not None and name == f"layers.{self.i}.moe.router.topk_ids":
            value = self.pin
        if self.recorder is not None:
            value = self.recorder.fire(name, value)
        if name in self.sites:
            _sync(self.xp)
            self.t[self.sites[name]] = time.perf_counter()
        return value


def child(args) -> dict:
    """Load one layer, decode, report (runs in its own process)."""
    from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token

    base = _status("VmRSS")
    t0 = time.perf_counter()
    w = from_pretrained(args.ckpt, layers=[args.layer], device=args.device, weight_dtype=args.weight_dtype,
                                           experts="packed", expert_cache_size=0)
    load_s = time.perf_counter() - t0
    peak, rss = _status("VmHWM"), _status("VmRSS")
    report = memory_report(w)
    layer, xp, cfg = w.layers[0], w.xp, w.config
    bandwidth = measure_bandwidth(args.device)  # here too: the same conditions as the timing below
    parts = layer_bytes(layer)  # what one token reads of the layer's resident weights, by half
    attn_bytes, trunk = parts["attention"], parts["ffn trunk"]
    moe = layer.ffn.kind == "moe"
    bank = layer.ffn.experts if moe else None
    recorder = None
    if args.recorder:
        from kimi_explore import Recorder

        recorder = Recorder().bind(w)
    marks = _Marks(xp, args.layer, recorder)
    state = KimiDecodeState.new(w)

    def run(n):
        rows = []
        for t in range(n + 1):  # the first token warms up
            kimi_forward_token(w, state, (t * 7919) % cfg.vocab_size, hooks=marks)
            if t:
                rows.append((marks.t["attn"] - marks.t["start"], marks.t["end"] - marks.t["attn"]))
        rows = np.array(rows) * 1e3
        return rows.min(axis=0), np.median(rows, axis=0)  # best (the table) and median (JSON) of the tokens

    sequence = sequence_phase(w, args, attn_bytes, trunk) if args.chunk else []
    phases = {}
    if args.no_decode:
        pass
    elif moe:
        per_packed = bank.packed_bytes / bank.num_experts
        if bank.uses_fused:  # CPU with the compiled kernel: straight from the packed bytes
            (attn_ms, ffn_ms), med = run(args.tokens)
            phases["fused"] = (attn_ms, ffn_ms, trunk + TOP_K * per_packed, med)
        bank.fused = False  # dequantise the selected experts every token
        (attn_ms, ffn_ms), med = run(args.tokens)
        phases["cold"] = (attn_ms, ffn_ms, trunk + TOP_K * per_packed, med)
        w.workspace.dequantised.clear()  # the warm phase dequantises nothing
        ids = xp.asarray(np.arange(TOP_K))
        bank.set_capacity(TOP_K)
        bank.warm(ids)
        marks.pin = ids
        hits, misses = bank.stats.hits, bank.stats.misses
        (attn_ms, ffn_ms), med = run(args.tokens)
        assert bank.stats.misses == misses and bank.stats.hits - hits == TOP_K * (args.tokens + 1), bank.stats
        phases["warm"] = (attn_ms, ffn_ms, trunk + TOP_K * bank.expert_bytes, med)
    else:
        (attn_ms, ffn_ms), med = run(args.tokens)
        phases["dense"] = (attn_ms, ffn_ms, trunk, med)
    return {
        "layer": args.layer, "kind": cfg.layer_kind(args.layer), "device": args.device, "weight_dtype": args.weight_dtype,
        "recorder": bool(args.recorder), "recorded_tokens": recorder.n_tokens if recorder is not None else 0,
        "bandwidth": bandwidth, "load_s": load_s, "rss_before_load": base, "peak_rss_load": peak, "rss_after_load": rss,
        "kept_bytes": report.total, "memory_report": dict(report),
        "phases": {k: {"attn_ms": float(a), "ffn_ms": float(f), "attn_bytes": attn_bytes, "ffn_bytes": int(fb),
                       "median_attn_ms": float(m[0]), "median_ffn_ms": float(m[1])}
                   for k, (a, f, fb, m) in phases.items()},
        "sequence": sequence, "sgemm_GFLOPs": measure_sgemm(args.device) if args.chunk else None,
        "decode_bytes": {"attn": attn_bytes, "ffn": int(trunk + (TOP_K * bank.packed_bytes / bank.num_experts if moe else 0))},
    }


def sequence_clock(device: str):
    """The sequence phase's clock: this process's CPU time on the CPU (on a shared machine the time it
    spends descheduled does not count; its threads' times add up, so a kernel on 2 threads is charged
    what one core would spend), wall time on a GPU."""
    return time.process_time if device == "cpu" else time.perf_counter


SGEMM_ROWS = (256, 2048)


def measure_sgemm(device: str) -> float:
    """GFLOP/s of float32 [m, 7168] x [7168, 4096] matmuls (a chunk through a K3 projection), best of 5 at each
    m in SGEMM_ROWS, the best kept, by `sequence_clock`. m = 256 alone is not the peak: BLAS gets faster with
    more rows (one thread on a Xeon with AVX-512: m = 256 ran at ~0.85x of m = 1024-4096, interleaved), and a
    roofline from a rate below the peak flatters every ratio, most at chunks above 256."""
    from kimi_explore.backend import resolve_device

    xp, _ = resolve_device(device)
    clock = sequence_clock(device)
    b = xp.ones((7168, 4096), xp.float32)
    rates = []
    for m in SGEMM_ROWS:
        a = xp.ones((m, 7168), xp.float32)
        a @ b
        _sync(xp)
        best = float("inf")
        for _ in range(5):
            t0 = clock()
            a @ b
            _sync(xp)
            best = min(best, clock() - t0)
        rates.append(2 * m * 7168 * 4096 / best / 1e9)
    return max(rates)


def sequence_phase(w, args, attn_bytes: int, trunk: int) -> list[dict]:
    """The layer's halves on chunks of c rows (the sequence path's layer functions), per c in --chunk."""
    from kimi_explore import KimiDecodeState
    from kimi_explore.model.kda import kda_sequence
    from kimi_explore.model.latent_moe_sequence import latent_moe_sequence
    from kimi_explore.model.mla import mla_sequence
    from kimi_explore.model.ops import dense_mlp_sequence

    layer, xp, cfg = w.layers[0], w.xp, w.config
    att, ffn = layer.attention, layer.ffn
    moe = ffn.kind == "moe"
    clock = sequence_clock(args.device)
    item = 2 if args.weight_dtype == "bfloat16" else 4
    rng = np.random.default_rng(0)
    out = []
    for c in [int(x) for x in args.chunk.split(",")]:
        x = xp.asarray(rng.standard_normal((c, cfg.hidden_size)).astype(np.float32))
        state = KimiDecodeState.new(w).layers[0].attention
        picked = []

        def keep(name, value):
            if name == "moe.router.topk_ids":
                if args.balanced:  # token t takes experts t, t + E/k, ..: each expert c k / E of the chunk's rows
                    E = ffn.experts.num_experts
                    t = np.arange(value.shape[0])[:, None]
                    value = xp.asarray(((np.arange(ffn.top_k) * (E // ffn.top_k))[None] + t) % E).astype(value.dtype)
                picked.append(value)
            return value

        def attention():
            if att.kind == "kda":
                return kda_sequence(x, att, state)[0]
            return mla_sequence(x, att, state)

        def feed_forward():
            if moe:
                return latent_moe_sequence(x, ffn, fire=keep)
            return dense_mlp_sequence(x, ffn, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

        def best(fn, reps):
            """(the best time, which timed run it was)"""
            fn()  # warm-up (and the MLA cache's first chunk)
            _sync(xp)
            ts = []
            for _ in range(reps):
                t0 = clock()
                fn()
                _sync(xp)
                ts.append(clock() - t0)
            return min(ts), ts.index(min(ts))

        reps = max(1, min(args.tokens, max(3, 256 // c)))  # best of 3 at least: a VM's speed drifts run to run
        attn_s, i = best(attention, reps)
        # the MLA cache before the timed chunk that was fastest (the warm-up's chunk and i timed ones): the
        # cache grows by c each run, and the FLOPs must be those of the run whose time is kept
        cache = (i + 1) * c if att.kind == "mla" else 0
        ffn_s, _ = best(feed_forward, reps)
        attn_flops = 2 * attn_bytes / item * c
        if att.kind == "mla":  # scores and mix: query t of the chunk sees cache + t + 1 positions
            attn_flops += 2 * att.num_heads * (att.qk_nope_head_dim + att.qk_rope_head_dim + att.v_head_dim) * \
                (c * cache + c * (c + 1) / 2)
        ffn_bytes, ffn_flops = trunk, 2 * trunk / item * c
        distinct = 0
        if moe:
            bank = ffn.experts
            distinct = len(np.unique(np.asarray(picked[-1].get() if hasattr(picked[-1], "get") else picked[-1])))
            ffn_bytes += distinct * bank.packed_bytes / bank.num_experts
            ffn_flops += 2 * ffn.top_k * c * bank.expert_bytes / 4  # the dequantised experts' float32 elements
        out.append({"chunk": c, "attn_ms_per_token": attn_s / c * 1e3, "ffn_ms_per_token": ffn_s / c * 1e3,
                    "attn_bytes_per_chunk": attn_bytes, "ffn_bytes_per_chunk": int(ffn_bytes), "distinct_experts": distinct,
                    "attn_flops_per_chunk": attn_flops, "ffn_flops_per_chunk": ffn_flops, "mla_cache": cache})
    return out


def sequence_table(runs: list[dict], B: float, gflops: float) -> list[dict]:
    """Print and return the sequence path's rows: ms/token against the roofline max(bytes / B, FLOPs / sgemm)."""
    print(f"\nsequence path (prefill), ms/token against the roofline max(bytes / {B / 1e9:.1f} GB/s, FLOPs / "
          f"{gflops:.0f} GFLOP/s sgemm):")
    head = (f"{'layer kind':<10} {'weights':<8} {'chunk':>5} {'part':<5} {'ms/tok':>8} {'MB/tok':>8} {'x decode':>8} "
            f"{'GFLOP/tok':>9} {'roof ms':>8} {'x roof':>6} {'experts':>7}")
    print(head)
    print("-" * len(head))
    rows = []
    for run in runs:
        for r in run["sequence"]:
            c = r["chunk"]
            parts = {"attn": (r["attn_ms_per_token"], r["attn_bytes_per_chunk"], r["attn_flops_per_chunk"],
                              run["decode_bytes"]["attn"]),
                     "ffn": (r["ffn_ms_per_token"], r["ffn_bytes_per_chunk"], r["ffn_flops_per_chunk"],
                             run["decode_bytes"]["ffn"])}
            parts["layer"] = tuple(parts["attn"][i] + parts["ffn"][i] for i in range(4))
            for part, (ms, nbytes, flops, dec) in parts.items():
                roof = max(nbytes / B, flops / (gflops * 1e9)) / c * 1e3
                row = {"layer": run["layer"], "kind": run["kind"], "weight_dtype": run["weight_dtype"], "phase": "sequence",
                       "chunk": c, "part": part, "ms_per_token": ms, "bytes_per_token": nbytes / c,
                       "decode_bytes_per_token": dec, "bytes_vs_decode": dec / (nbytes / c), "flops_per_token": flops / c,
                       "roofline_ms": roof, "ratio_to_roofline": ms / roof, "distinct_experts": r["distinct_experts"]}
                rows.append(row)
                print(f"{run['kind']:<10} {run['weight_dtype'][:8]:<8} {c:>5} {part:<5} {ms:>8.2f} {nbytes / c / 1e6:>8.1f} "
                      f"{row['bytes_vs_decode']:>8.1f} {flops / c / 1e9:>9.2f} {roof:>8.2f} {row['ratio_to_roofline']:>6.2f} "
                      f"{r['distinct_experts']:>7}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--weight-dtype", default="float32", help="comma list of float32 / bfloat16")
    p.add_argument("--recorder", action="store_true", help="decode with a kimi_explore.Recorder (default sites) attached")
    p.add_argument("--tokens", type=at_least(1), default=4, help="timed tokens per phase (after one warm-up token)")
    p.add_argument("--layers", default="0,1,3", help="layers to time (each alone; only these are written, 0..92)")
    p.add_argument("--experts", type=at_least(16), default=32, help="experts per layer on disk (>= top-16)")
    p.add_argument("--balanced", action="store_true",
                   help="sequence path: route each chunk evenly over the experts (a trained router's balance)")
    p.add_argument("--vocab", type=at_least(1), default=8192)
    p.add_argument("--ckpt", default=str(ROOT / "bench" / "results" / "k3_shapes_ckpt"))
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "k3_shapes.json"))
    p.add_argument("--chunk", default="", help="comma list of chunk sizes for the sequence path (e.g. 1,16,64,256)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode phases (with --chunk: the sequence path only)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layer", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.balanced and not args.chunk:
        p.error("--balanced pins the sequence path's routing: give --chunk too")
    try:  # (checked here, before a checkpoint of gigabytes is written; the children take them as text)
        layers = int_list(0)(args.layers)
        if args.chunk:
            int_list(1)(args.chunk)
    except argparse.ArgumentTypeError as e:
        p.error(f"--layers / --chunk: {e}")
    if max(layers) > 92:
        p.error(f"--layers: K3 has layers 0..92, got {max(layers)}")
    if args.child:
        print(json.dumps(child(args)))
        return 0

    t0 = time.perf_counter()
    ensure_checkpoint(Path(args.ckpt), sorted({int(x) for x in args.layers.split(",")}), args.experts, args.vocab)
    write_s = time.perf_counter() - t0
    before = measure_bandwidth(args.device)
    runs = []
    for wd in args.weight_dtype.split(","):
        for layer in [int(x) for x in args.layers.split(",")]:
            cmd = [sys.executable, __file__, "--child", "--layer", str(layer), "--device", args.device,
                   "--weight-dtype", wd, "--tokens", str(args.tokens), "--ckpt", args.ckpt]
            cmd += ["--recorder"] if args.recorder else []
            cmd += ["--chunk", args.chunk] if args.chunk else []
            cmd += ["--no-decode"] if args.no_decode else []
            cmd += ["--balanced"] if args.balanced else []
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            if r.returncode:
                print(r.stderr, file=sys.stderr)
                raise SystemExit(f"child for layer {layer} ({wd}) failed")
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    # measured before, during (in each layer's process) and after the runs, best kept: other work on a
    # shared machine only lowers it, and a floor from a low measurement would flatter the ratios
    after = measure_bandwidth(args.device)
    bw = {k: max([before[k], after[k]] + [run["bandwidth"][k] for run in runs]) for k in before}
    print(machine.line(machine.describe()))
    print(f"{args.device}: memory bandwidth {bw['bandwidth_GBps']:.1f} GB/s (1 GiB copy {bw['copy_GBps']:.1f} GB/s "
          f"read+write, 1 GiB float32 gemv {bw['gemv_read_GBps']:.1f} GB/s read; best of 10, in {len(runs) + 2} "
          "measurements before, during and after the layers)")
    B = bw["bandwidth_GBps"] * 1e9
    head = (f"{'layer kind':<10} {'weights':<8} {'phase':<5} {'part':<5} {'ms/tok':>8} {'MB/tok':>8} {'GB/s':>6} "
            f"{'floor ms':>8} {'x floor':>7}")
    print(head)
    print("-" * len(head))
    rows = []
    for run in runs:
        for phase, ph in run["phases"].items():
            parts = {"attn": (ph["attn_ms"], ph["attn_bytes"]), "ffn": (ph["ffn_ms"], ph["ffn_bytes"]),
                     "layer": (ph["attn_ms"] + ph["ffn_ms"], ph["attn_bytes"] + ph["ffn_bytes"])}
            for part, (ms, nbytes) in parts.items():
                floor = nbytes / B * 1e3
                row = {"layer": run["layer"], "kind": run["kind"], "weight_dtype": run["weight_dtype"], "phase": phase,
                       "part": part, "ms_per_token": ms, "bytes_per_token": nbytes, "GBps": nbytes / ms / 1e6,
                       "floor_ms": floor, "ratio_to_floor": ms / floor}
                rows.append(row)
                print(f"{run['kind']:<10} {run['weight_dtype'][:8]:<8} {phase:<5} {part:<5} {ms:>8.1f} {nbytes / 1e6:>8.0f} "
                      f"{row['GBps']:>6.1f} {floor:>8.1f} {row['ratio_to_floor']:>7.2f}")
    if args.chunk:
        rows += sequence_table(runs, B, max([measure_sgemm(args.device)] + [run["sgemm_GFLOPs"] for run in runs]))
    print()
    # the bf16 widening scratch is reserved (calloc) at load but only touched by the first matmul
    print(f"{'layer kind':<10} {'weights':<8} {'load s':>7} {'kept MB':>8} {'(scratch)':>9} {'peak RSS MB':>11} "
          f"{'(peak-base)/(kept-scratch)':>26}")
    for run in runs:
        grown = run["peak_rss_load"] - run["rss_before_load"]
        scratch = run["memory_report"].get("bf16 widening scratch", 0)
        run["peak_over_kept"] = grown / (run["kept_bytes"] - scratch)
        print(f"{run['kind']:<10} {run['weight_dtype'][:8]:<8} {run['load_s']:>7.1f} {run['kept_bytes'] / 1e6:>8.0f} "
              f"{scratch / 1e6:>9.0f} {run['peak_rss_load'] / 1e6:>11.0f} {run['peak_over_kept']:>26.2f}")
    out = {"device": args.device, **machine.describe(), "bandwidth": bw, "checkpoint": args.ckpt, "checkpoint_write_s": write_s,
           "experts_on_disk": args.experts, "balanced_routing": args.balanced, "vocab": args.vocab, "top_k": TOP_K,
           "rows": rows, "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
