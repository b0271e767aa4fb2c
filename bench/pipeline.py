"""RayPipeline on localhost, the bytes it moves at K3 width, and a paper plan for the full K3.

    python bench/pipeline.py [--tokens 200] [--stages 1,2,4] [--checkpoint DIR] [--context 8192]
                             [--json bench/results/pipeline.json]

1. Measured (a local Ray, num_cpus=2, no dashboard; the embedded tiny model unless --checkpoint):
   ms/token of a Session over the weights in this process, and over RayPipelines of 1, 2, 4 stages,
   without and with the default Recorder (median of --tokens single steps after a warm-up, wall
   clock: the stages are other processes). Per-hop overhead = (pipeline - one process) / stages.
2. Bytes moved per token at K3 width, from K3's config: what each hop carries (the block stack:
   sealed blocks and the running sum, their 1/rms, as `Stage.run` packs them; the size of the
   pickled payload is measured on K3-width arrays), the default Recorder's records per layer kind,
   and the logits the last stage returns.
3. A plan for the full K3 (1.56 TB), sized from the checkpoint table (the released tensors'
   shapes and dtypes): 16 x H200 on 2 hosts (every weight resident on a GPU, bf16 trunk, packed
   MXFP4 experts), and 8 x H200 with the routed experts mapped in host RAM. Layers per stage,
   bytes per device (with the decode state of a --context-token history: the KDA matrices, and the MLA
   layers' caches of decompressed per-head keys and values in float32, ~2.95 MB a position over K3's
   24 MLA layers), and the bandwidth floor per token. ON PAPER: no cluster was at hand, and the
   CuPy path of this package has not run on a GPU yet (bench/gpu_check.sh is ready for that).
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from argtypes import at_least, int_list  # (bench/: the script's directory, on sys.path)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

H200_BYTES = 141e9  # HBM3e per GPU
H200_BW = 4.8e12  # HBM bytes/s
PCIE_BW = 50e9  # host -> one H200, PCIe Gen5 x16, sustained
NET_LATENCY_S = 20e-6  # one hop between hosts (RDMA-class network), plus bytes / 25 GB/s


def measure(path, stage_counts, tokens: int) -> list[dict]:
    import ray

    import kimi_explore as ke

    ids = list(np.random.default_rng(0).integers(0, 256, tokens + 8))
    weights = ke.from_pretrained(path)
    rows = []

    def per_token(model, recorder: bool) -> float:
        s = ke.Session(model, recorder=recorder, checkpoint_every=0)
        s.feed(ids[:8])  # warm-up (the pipeline compiles its graph at the first token)
        times = []
        for t in ids[8:]:
            t0 = time.perf_counter()
            s.step(t)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        base = {rec: per_token(weights, rec) for rec in (False, True)}
        rows.append({"model": "one process", "stages": 0, "ms_off": base[False], "ms_rec": base[True]})
        for n in stage_counts:
            with ke.RayPipeline(path, stages=n) as pipe:
                ms = {rec: per_token(pipe, rec) for rec in (False, True)}
            rows.append({"model": f"RayPipeline, {n} stage{'s' * (n > 1)}", "stages": n, "ms_off": ms[False],
                         "ms_rec": ms[True], "hop_off": (ms[False] - base[False]) / n,
                         "hop_rec": (ms[True] - base[True]) / n})
    finally:
        ray.shutdown()
    return rows


def k3_config():
    """K3's text config (896 experts, vocabulary 163,840), as `k3_shapes` writes it."""
    from k3_shapes import k3_text_config

    from kimi_explore.model.config import KimiDecoderConfig

    return KimiDecoderConfig.from_dict(k3_text_config(896, 163840))


def k3_bytes_per_token() -> dict:
    """Bytes one K3 token moves: per hop (after layer i), the records per layer kind, the logits."""
    from kimi_explore.model.block_residual import SourceBuffer

    cfg = k3_config()
    d, H, E, k = cfg.hidden_size, cfg.linear_attn_config.num_heads, cfg.num_experts, cfg.num_experts_per_token
    hop = {}
    for n in range(0, 9):  # sealed blocks when the hop happens: 0..8 for K3's 93 layers in blocks of 12
        stack = SourceBuffer(np, 9, d, np.float32, cfg.rms_norm_eps)
        for _ in range(n):
            stack.set_current(np.ones(d, np.float32))
            stack.seal()
        stack.set_current(np.ones(d, np.float32))
        hop[n] = len(pickle.dumps(stack.pack(), protocol=5))
    f = 4  # float32 records
    records = {  # the default Recorder, per token (see kimi_explore.inspection.recorder)
        "attn-res weights, per layer (2 sites x up to 9 sources)": 2 * 9 * f,
        "KDA layer: state norms [H] + conv norms [3, H]": 4 * H * f,
        "MoE layer: scores [E], top-k ids + weights, 2 output norms": E * f + k * 8 + k * f + 2 * f,
    }
    n_kda = sum(cfg.is_kda_layer(i) for i in range(93))
    n_moe = sum(cfg.is_moe_layer(i) for i in range(93))
    per_token = 93 * records["attn-res weights, per layer (2 sites x up to 9 sources)"] + n_kda * records[
        "KDA layer: state norms [H] + conv norms [3, H]"] + n_moe * records[
        "MoE layer: scores [E], top-k ids + weights, 2 output norms"]
    return {"hop_bytes_by_sealed_blocks": hop, "record_bytes": records, "records_per_token": per_token,
            "logits_bytes": cfg.vocab_size * f, "n_kda": n_kda, "n_moe": n_moe}


def k3_layer_bytes() -> tuple[list[dict], int, int]:
    """Per layer: resident trunk bytes (bf16 matrices, f32 vectors as on disk) and routed expert bytes
    (MXFP4: a nibble per weight + a scale byte per 32); the global tensors; one token's expert reads."""
    from kimi_explore.weights import checkpoint_table as table

    cfg = k3_config()
    layers = [{"trunk": 0, "experts": 0, "kind": cfg.layer_kind(i)} for i in range(93)]
    glob = 0
    for t in table.plan(cfg):
        n = math.prod(t.shape)
        b = n // 2 + n // 32 if t.dtype == table.MXFP4 else n * (2 if t.dtype == table.BF16 else 4)
        if t.layer is None:
            glob += b
        else:
            layers[t.layer]["experts" if t.expert is not None else "trunk"] += b
    one_expert = layers[1]["experts"] // cfg.num_experts
    return layers, glob, one_expert * cfg.num_experts_per_token


def largest_bf16_matrix(cfg, layer_ids) -> int:
    """Elements of the largest bf16 matrix the loader keeps for these layers: projections fused as `records`
    fuses them (a fused record field whose parts are all BF16 matrices), what its float32 widening scratch holds."""
    from kimi_explore.weights import checkpoint_table as table

    best = 0
    for i in layer_ids:
        for kind in table.layer_kinds(cfg, i):
            present = {r.key for r in kind.present(cfg)}
            in_fused = {k for keys in kind.fused.values() for k in keys}
            for keys in [*kind.fused.values(), *((k,) for k in present - in_fused)]:
                rows = [kind.row(k) for k in keys if k in present]
                shapes = [kind.shape(cfg, r.key) for r in rows]
                matrices = all(r.dtype == table.BF16 and "{e}" not in r.name and len(s) == 2
                               for r, s in zip(rows, shapes, strict=True))
                if rows and matrices:
                    best = max(best, sum(s[0] for s in shapes) * shapes[0][1])
    return best


def split_by_bytes(sizes: list[int], parts: int) -> list[range]:
    """Contiguous stages with as equal byte totals as a greedy cut gives."""
    total, out, start, acc = sum(sizes), [], 0, 0
    for i, s in enumerate(sizes):
        acc += s
        if acc >= total * (len(out) + 1) / parts and len(out) < parts - 1:
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, len(sizes)))
    return out


def mla_cache_bytes_per_position(cfg) -> int:
    """One MLA layer's cache per position: keys [heads, nope + rope] and values [heads, v] in float32."""
    return 4 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)


def plan(state_per_layer: float, context: int) -> list[dict]:
    layers, glob, expert_reads = k3_layer_bytes()
    cfg, hop_bytes = k3_config(), max(k3_bytes_per_token()["hop_bytes_by_sealed_blocks"].values())
    cache = mla_cache_bytes_per_position(cfg) * context  # per MLA layer
    embed = lm_head = glob // 2
    plans = []
    # A: 16 x H200 on 2 hosts, everything resident on the GPUs
    sizes = [lay["trunk"] + lay["experts"] for lay in layers]
    for name, stages, experts_on_gpu in (("16 x H200, 2 hosts, all weights on the GPUs", 16, True),
                                         ("8 x H200, 1 host, routed experts mapped in host RAM", 8, False)):
        cut = split_by_bytes(sizes if experts_on_gpu else [lay["trunk"] for lay in layers], stages)
        rows = []
        for k, r in enumerate(cut):
            trunk = sum(layers[i]["trunk"] for i in r) + (embed if k == 0 else 0) + (lm_head if k == stages - 1 else 0)
            experts = sum(layers[i]["experts"] for i in r)
            n_moe = sum(layers[i]["kind"].endswith("moe") for i in r)
            # widening scratch of the largest bf16 matrix, as float32 (lm_head on the last stage; else the
            # largest fused projection: the dense MLP's gate_up on the first, KDA's in_proj elsewhere)
            scratch = max(2 * lm_head if k == stages - 1 else 0, 4 * largest_bf16_matrix(cfg, r))
            caches = cache * sum(layers[i]["kind"].startswith("mla") for i in r)
            device = trunk + (experts if experts_on_gpu else 0) + state_per_layer * len(r) + caches + scratch
            # bytes read per token from HBM (or copied over PCIe): the whole trunk but the embedding (one row)
            read = trunk - (embed if k == 0 else 0) + n_moe * expert_reads
            t_hbm = read / H200_BW
            t_pcie = 0.0 if experts_on_gpu else n_moe * expert_reads / PCIE_BW
            rows.append({"stage": k, "layers": f"{r.start}-{r.stop - 1}", "n_layers": len(r), "device_bytes": device,
                         "mla_cache_bytes": caches,
                         "host_mapped_bytes": 0 if experts_on_gpu else experts, "read_bytes": read,
                         "floor_ms": (t_hbm + t_pcie) * 1e3, "fits": device < H200_BYTES * 0.95})
        hops = (stages - 1) * NET_LATENCY_S * 1e3 + (stages - 1) * hop_bytes / 25e9 * 1e3
        plans.append({"plan": name, "stages": rows, "floor_ms_per_token": sum(r["floor_ms"] for r in rows) + hops,
                      "hop_ms": hops})
    return plans


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=at_least(1), default=200)
    ap.add_argument("--stages", type=int_list(1), default=[1, 2, 4])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--context", type=at_least(1), default=8192, help="history length the plans' MLA caches hold")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "pipeline.json"))
    args = ap.parse_args()
    import kimi_explore as ke

    path = Path(args.checkpoint) if args.checkpoint else ke.tiny_checkpoint()
    rows = measure(path, args.stages, args.tokens)
    print(f"1. localhost, {path.name}, median of {args.tokens} steps (wall clock, ms/token)")
    print(f"{'model':<24} {'no recorder':>12} {'recorder':>10} {'hop, no rec':>12} {'hop, rec':>10}")
    for r in rows:
        hops = f"{r['hop_off']:12.3f} {r['hop_rec']:10.3f}" if r["stages"] else f"{'':>12} {'':>10}"
        print(f"{r['model']:<24} {r['ms_off']:12.3f} {r['ms_rec']:10.3f} {hops}")
    print("(hop = (pipeline - one process) / stages: per stage per token; target <= 1 ms)")

    b = k3_bytes_per_token()
    print("\n2. bytes per token at K3 width")
    for n, v in b["hop_bytes_by_sealed_blocks"].items():
        print(f"  hop with {n} sealed blocks: {v:,} bytes (pickled [{n + 1}, 7168] float32 + 1/rms)")
    for k, v in b["record_bytes"].items():
        print(f"  records, {k}: {v:,} bytes")
    print(f"  records, whole model ({b['n_kda']} KDA, {b['n_moe']} MoE layers): {b['records_per_token']:,} bytes/token")
    print(f"  logits from the last stage: {b['logits_bytes']:,} bytes/token")

    state_per_layer = 0.475e9 / 93  # ~0.47 GB of KDA state (0.43) and conv windows (0.04) for the whole model (README)
    plans = plan(state_per_layer, args.context)
    per_position = mla_cache_bytes_per_position(k3_config()) * sum(k3_config().layer_kind(i).startswith("mla")
                                                                     for i in range(93))
    print("\n3. full K3 plans (ON PAPER: sized from the checkpoint table, floors from H200 HBM 4.8 TB/s, PCIe 50 GB/s;")
    print(f"   GPU GB holds the state of a {args.context:,}-token history: MLA caches {per_position / 1e6:.2f} MB a "
          f"position, {per_position * args.context / 1e9:.1f} GB in all)")
    for p in plans:
        print(f"\n  {p['plan']}: floor {p['floor_ms_per_token']:.1f} ms/token (hops {p['hop_ms']:.2f} ms)")
        print(f"  {'stage':>5} {'layers':>7} {'n':>3} {'GPU GB':>7} {'cache GB':>8} {'host GB':>8} {'read GB/tok':>11} "
              f"{'floor ms':>9} fits")
        for r in p["stages"]:
            print(f"  {r['stage']:>5} {r['layers']:>7} {r['n_layers']:>3} {r['device_bytes'] / 1e9:7.1f} "
                  f"{r['mla_cache_bytes'] / 1e9:8.2f} "
                  f"{r['host_mapped_bytes'] / 1e9:8.1f} {r['read_bytes'] / 1e9:11.2f} {r['floor_ms']:9.2f} {r['fits']}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"localhost": rows, "k3_bytes": b, "plans": plans, "context": args.context,
                              "checkpoint": str(path)}, indent=2,
                              default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
