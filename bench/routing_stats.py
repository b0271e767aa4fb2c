"""Throughput of `ke.routing_stats` on the embedded tiny model, recording on (target: >= 20,000 tokens/s).

    python bench/routing_stats.py [--tokens 4096] [--text-len 1024] [--rounds 3] [--threads 1] [--json PATH]

Configurations, each over the same corpus (texts of `text-len` bytes, `tokens` in all, each decoded
from a fresh state):

    decoder only     a Session without a recorder: the floor (`Session.feed`: the sequence path, in chunks)
    routing_stats    ke.routing_stats: each text on the sequence path with the router sites recorded
                     (no Session: no logits or state copies kept), plus the counting

Reports the median over rounds of tokens/s by wall clock and by this thread's CPU time (time the
process spends descheduled by other jobs on a shared machine does not count), and the overhead
of routing_stats over the decoder. BLAS runs on `--threads` threads (set before NumPy loads): at
the tiny model's sizes one thread is fastest, more only contend.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

TARGET = 20_000.0  # tokens/s (CPU time), the bar for the embedded model on the sequence path
ROOT = Path(__file__).resolve().parent.parent
CORPUS = ("The quick brown fox jumps over the lazy dog. In 1969, 3 astronauts flew 384,400 km to the Moon.\n"
          "def f(x):\n    return x * 2  # twice\nHello, world! Prices: 10 apples cost $4.50; 12 pears, $6.\n")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--text-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="BLAS threads (0: leave the environment as it is)")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "routing_stats.json"))
    return p.parse_args()


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def main() -> int:
    args = parse()
    if args.threads:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    import kimi_explore as ke  # after the thread settings: BLAS reads them when NumPy loads

    weights = ke.from_pretrained(ke.tiny_checkpoint(), device="cpu")
    text = (CORPUS * (args.text_len // len(CORPUS) + 1))[: args.text_len]
    texts = [text] * max(1, args.tokens // args.text_len)
    n = sum(len(t) for t in texts)

    def decoder_only():
        for t in texts:
            ke.Session(weights, recorder=False, checkpoint_every=0).feed(list(t.encode()))

    def stats():
        ke.routing_stats(weights, texts, progress=False)

    runs = {"decoder only": decoder_only, "routing_stats": stats}
    ke.routing_stats(weights, texts[:1], progress=False)  # warm up (imports, first allocations)
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():  # interleaved: machine noise hits both alike
            times[name].append(timed(fn))
    rows = []
    for name, ts in times.items():
        wall, cpu = statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)
        rows.append({"config": name, "tokens": n, "wall_s": wall, "tokens_per_s": n / wall, "cpu_tokens_per_s": n / cpu})
    base, ours = rows
    overhead = base["cpu_tokens_per_s"] / ours["cpu_tokens_per_s"] - 1.0
    print(f"routing_stats on the embedded tiny model: {n} tokens in {len(texts)} texts, {args.rounds} rounds, "
          f"BLAS threads {os.environ.get('OPENBLAS_NUM_THREADS', 'default')}")
    print(f"{'config':16s} {'tokens/s (wall)':>16s} {'tokens/s (cpu)':>15s}")
    for r in rows:
        print(f"{r['config']:16s} {r['tokens_per_s']:16.0f} {r['cpu_tokens_per_s']:15.0f}")
    verdict = "meets" if ours["cpu_tokens_per_s"] >= TARGET else "MISSES"
    print(f"routing_stats over the decoder alone: {overhead:+.1%}; {verdict} the {TARGET:,.0f} tokens/s target (CPU time; "
          f"load average {os.getloadavg()[0]:.2f})")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "overhead": overhead, "target_tokens_per_s": TARGET,
                               "meets_target": ours["cpu_tokens_per_s"] >= TARGET, "load_average": os.getloadavg(),
                               "threads": args.threads,
                               "machine": platform.machine(), "python": sys.version.split()[0],
                               "cpus": os.cpu_count()}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
