"""Mapped experts (experts="mapped") against resident packed ones, on a K3-width KDA + MoE layer.

    python bench/mapped_experts.py [--device cpu|gpu] [--tokens 4] [--experts 32] [--keep]
                                   [--ckpt bench/results/k3_l1_ckpt] [--json bench/results/mapped_experts.json]

The checkpoint is `bench/k3_shapes.py`'s (K3 widths, 32 experts per layer instead of 896, vocab
8192), layer 1 only; it is deleted afterwards unless --keep. Each mode is loaded in a fresh process:

- "packed": the experts' MXFP4 bytes copied into RAM at load (experts="packed");
- "mapped": left in the shard files as read-only memory maps (experts="mapped").

No expert cache: on the CPU both run the fused kernel; on a GPU both dequantise the selected
experts on the device every token, mapped ones after copying their bytes there. Reported: peak RSS after load (VmHWM) against
memory_report's resident total and the experts' bytes; ms/token warm (every page in the page cache:
best of the timed tokens after a warm-up token); for mapped, ms/token cold: before each token the
process's pages are dropped (madvise DONTNEED) and the shard files dropped from the page cache
(posix_fadvise DONTNEED), so the token's 16 experts per layer come from disk (bytes read from
storage per token, from /proc/self/io, show it: the median over the timed tokens). Each token's routing is
pinned to 16 experts not used by the previous token (a topk_ids hook), so warm tokens read pages already cached and cold
ones read new experts too.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from argtypes import at_least  # (bench/: the script's directory, on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from k3_shapes import TOP_K, _Marks, _status, ensure_checkpoint, measure_bandwidth  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAYER = 1  # KDA + MoE


def _read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def drop_from_memory(bank, files) -> None:
    """Unmap the bank's resident pages, then drop the shard files from the page cache."""
    maps = {id(m): m for v in (bank.w13_packed, bank.w13_scale, bank.w2_packed, bank.w2_scale)
            for expert in v.blocks for b in expert if (m := getattr(b.base, "_mmap", None)) is not None}
    for m in maps.values():
        m.madvise(mmap.MADV_DONTNEED)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child(args) -> dict:
    from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token

    base = _status("VmRSS")
    t0 = time.perf_counter()
    w = from_pretrained(args.ckpt, layers=[LAYER], device=args.device, experts=args.mode,
                                           expert_cache_size=0)
    load_s = time.perf_counter() - t0
    peak, rss = _status("VmHWM"), _status("VmRSS")
    report = w.memory_report()
    bank = w.layers[0].ffn.experts
    assert bank.uses_fused or args.device == "gpu", bank.route
    experts_bytes = bank.packed_bytes + getattr(bank, "mapped_bytes", 0)
    bandwidth = measure_bandwidth(args.device)
    marks, state = _Marks(w.xp, LAYER), KimiDecodeState.new(w)
    E = bank.num_experts
    shards = sorted({str(Path(args.ckpt) / s) for s in json.loads((Path(args.ckpt) / "model.safetensors.index.json")
                                                                    .read_text())["weight_map"].values()})

    def token(t, cold=False):
        marks.pin = np.arange(t * TOP_K, (t + 1) * TOP_K) % E  # 16 experts the previous token did not use
        if cold:
            drop_from_memory(bank, shards)
        r0, t0 = _read_bytes(), time.perf_counter()
        kimi_forward_token(w, state, (t * 7919) % w.config.vocab_size, hooks=marks)
        return (time.perf_counter() - t0) * 1e3, (marks.t["end"] - marks.t["attn"]) * 1e3, _read_bytes() - r0

    for t in range(E // TOP_K):  # warm-up: every expert touched once (in the page cache for mapped)
        token(t)
    warm = [token(t) for t in range(args.tokens)]
    cold = [token(t, cold=True) for t in range(args.tokens)] if args.mode == "mapped" else []
    return {"mode": args.mode, "load_s": load_s, "rss_before_load": base, "peak_rss_load": peak, "rss_after_load": rss,
            "resident_bytes": report.total, "mapped_bytes": report.mapped_total, "experts_bytes": experts_bytes,
            "bandwidth": bandwidth, "warm": warm, "cold": cold, "rss_after_decode": _status("VmRSS"), "route": bank.route}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--tokens", type=at_least(1), default=4)
    p.add_argument("--experts", type=at_least(1), default=32)
    p.add_argument("--vocab", type=at_least(1), default=8192)
    p.add_argument("--ckpt", default=str(ROOT / "bench" / "results" / "k3_l1_ckpt"))
    p.add_argument("--keep", action="store_true", help="keep the checkpoint (deleted afterwards by default)")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "mapped_experts.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    ensure_checkpoint(Path(args.ckpt), [LAYER], args.experts, args.vocab)
    runs = []
    try:
        for mode in ("packed", "mapped"):
            cmd = [sys.executable, __file__, "--child", "--mode", mode, "--device", args.device, "--tokens", str(args.tokens),
                   "--ckpt", args.ckpt]
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            if r.returncode:
                print(r.stderr, file=sys.stderr)
                raise SystemExit(f"child for experts={mode!r} failed")
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    finally:
        if not args.keep:
            shutil.rmtree(args.ckpt, ignore_errors=True)
    bw = max(run["bandwidth"]["bandwidth_GBps"] for run in runs)
    print(f"K3-width KDA + MoE layer on {args.device} ({args.experts} experts on disk, top-{TOP_K}, {runs[0]['route']}); "
          f"memory bandwidth {bw:.1f} GB/s (best in-process measurement)")
    print(f"{'experts':<8} {'load s':>6} {'peak RSS MB':>11} {'resident MB':>11} {'experts MB':>10} {'mapped MB':>9} "
          f"{'phase':<5} {'ms/tok':>7} {'FFN ms':>7} {'disk MB/tok (median)':>20}")
    packed_ms = min(ms for ms, _, _ in runs[0]["warm"])
    for run in runs:
        for phase in ("warm", "cold"):
            if not run[phase]:
                continue
            ms, ffn, read = min(run[phase])  # the best token's times (the table); every token in the JSON
            run[f"{phase}_ms"], run[f"{phase}_ffn_ms"], run[f"{phase}_disk_bytes"] = ms, ffn, read
            run[f"{phase}_disk_bytes_median"] = float(np.median([r for _, _, r in run[phase]]))  # the table's column
            grown = (run["peak_rss_load"] - run["rss_before_load"]) / 1e6
            print(f"{run['mode']:<8} {run['load_s']:>6.1f} {grown:>11.0f} {run['resident_bytes'] / 1e6:>11.0f} "
                  f"{run['experts_bytes'] / 1e6:>10.0f} {run['mapped_bytes'] / 1e6:>9.0f} {phase:<5} {ms:>7.1f} {ffn:>7.1f} "
                  f"{run[f'{phase}_disk_bytes_median'] / 1e6:>20.0f}")
    print(f"\nwarm mapped / resident packed: {runs[1]['warm_ms'] / packed_ms:.2f}x per token "
          f"(FFN {runs[1]['warm_ffn_ms'] / runs[0]['warm_ffn_ms']:.2f}x); cold mapped / packed: "
          f"{runs[1]['cold_ms'] / packed_ms:.2f}x")
    out = {"device": args.device, "layer": LAYER, "experts_on_disk": args.experts, "top_k": TOP_K, "bandwidth_GBps": bw,
           "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
