"""Throughput of `ke.routing_stats` on the embedded tiny model, recording on (target: >= 20,000 tokens/s).

    python bench/routing_stats.py [--tokens 8192] [--text-len 1024] [--rounds 3] [--threads 1] [--workers 2]
                                  [--json PATH]

Configurations, each over the same corpus (texts of `text-len` bytes, `tokens` in all, each decoded
from a fresh state):

    decoder only     a Session without a recorder: the floor (`Session.feed`: the sequence path, in chunks)
    routing_stats    ke.routing_stats: each text on the sequence path with the router sites recorded
                     (no Session: no logits or state copies kept), plus the counting
    workers=N        ke.routing_stats(..., workers=N): N texts at once in forked processes, one core each
                     (the pool's start and end included); its result is checked equal to routing_stats'

Reports the median over rounds of tokens/s by wall clock and by CPU time (this thread's, plus the
workers' for workers=N: per core; time the process spends descheduled by other jobs on a shared
machine does not count), and the overhead of routing_stats over the decoder. BLAS runs on
`--threads` threads (set before NumPy loads): at the tiny model's sizes one thread is fastest, more
only contend. The target is judged on one core (CPU time) and on the whole machine (workers=N, wall).
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

from argtypes import at_least  # (bench/: the script's directory, on sys.path)

TARGET = 20_000.0  # tokens/s, the bar for the embedded model on the sequence path
ROOT = Path(__file__).resolve().parent.parent
CORPUS = ("The quick brown fox jumps over the lazy dog. In 1969, 3 astronauts flew 384,400 km to the Moon.\n"
          "def f(x):\n    return x * 2  # twice\nHello, world! Prices: 10 apples cost $4.50; 12 pears, $6.\n")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=at_least(1), default=8192)
    p.add_argument("--text-len", type=at_least(1), default=1024)
    p.add_argument("--rounds", type=at_least(1), default=3)
    p.add_argument("--threads", type=at_least(0), default=1, help="BLAS threads (0: leave the environment as it is)")
    p.add_argument("--workers", type=at_least(1), default=os.cpu_count() or 1, help="processes of the workers row (1: no row)")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "routing_stats.json"))
    return p.parse_args()


def timed(fn) -> tuple[float, float]:
    """(wall s, CPU s of this thread and of the child processes that ended meanwhile) of fn()."""
    t0, c0 = time.perf_counter(), time.thread_time() + _children()
    fn()
    return time.perf_counter() - t0, time.thread_time() + _children() - c0


def _children() -> float:
    t = os.times()
    return t.children_user + t.children_system


def main() -> int:
    args = parse()
    if args.threads:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    import machine  # (bench/: this script's directory)
    import numpy as np

    import kimi_explore as ke  # after the thread settings: BLAS reads them when NumPy loads

    weights = ke.from_pretrained(ke.tiny_checkpoint(), device="cpu")
    ran_on = machine.describe()
    print(machine.line(ran_on))
    text = (CORPUS * (args.text_len // len(CORPUS) + 1))[: args.text_len]
    texts = [text] * max(1, args.tokens // args.text_len)
    n = sum(len(t) for t in texts)

    def decoder_only():
        for t in texts:
            ke.Session(weights, recorder=False, checkpoint_every=0).feed(list(t.encode()))

    def stats():
        ke.routing_stats(weights, texts, progress=False)

    runs = {"decoder only": decoder_only, "routing_stats": stats}
    if args.workers > 1:
        name = f"workers={args.workers}"
        runs[name] = lambda: ke.routing_stats(weights, texts, progress=False, workers=args.workers)
        one, many = (ke.routing_stats(weights, texts, progress=False, workers=n) for n in (1, args.workers))
        same = all(np.array_equal(getattr(one, f), getattr(many, f)) for f in ("counts", "weight_sum", "coactivation"))
        print(f"{name}: the result equals one process's bit for bit: {same}")
    ke.routing_stats(weights, texts[:1], progress=False)  # warm up (imports, first allocations)
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():  # interleaved: machine noise hits both alike
            times[name].append(timed(fn))
    rows = []
    for name, ts in times.items():
        wall, cpu = statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)
        rows.append({"config": name, "tokens": n, "wall_s": wall, "tokens_per_s": n / wall, "cpu_tokens_per_s": n / cpu})
    base, ours = rows[:2]
    overhead = base["cpu_tokens_per_s"] / ours["cpu_tokens_per_s"] - 1.0
    print(f"routing_stats on the embedded tiny model: {n} tokens in {len(texts)} texts, {args.rounds} rounds, "
          f"BLAS threads {os.environ.get('OPENBLAS_NUM_THREADS', 'default')}")
    print(f"{'config':16s} {'tokens/s (wall)':>16s} {'tokens/s (cpu)':>15s}")
    for r in rows:
        print(f"{r['config']:16s} {r['tokens_per_s']:16.0f} {r['cpu_tokens_per_s']:15.0f}")
    verdict = lambda x: "meets" if x >= TARGET else "MISSES"  # noqa: E731
    print(f"routing_stats over the decoder alone: {overhead:+.1%}; on one core it {verdict(ours['cpu_tokens_per_s'])} "
          f"the {TARGET:,.0f} tokens/s target (CPU time; load average {os.getloadavg()[0]:.2f})")
    machine = max(r["tokens_per_s"] for r in rows[1:])
    print(f"on this machine ({os.cpu_count()} CPUs, wall clock, best of routing_stats' rows) it {verdict(machine)} it: "
          f"{machine:,.0f} tokens/s")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "overhead": overhead, "target_tokens_per_s": TARGET,
                               "meets_target_one_core": ours["cpu_tokens_per_s"] >= TARGET,
                               "meets_target_machine": machine >= TARGET, "load_average": os.getloadavg(),
                               "threads": args.threads, "workers": args.workers,
                               "machine": platform.machine(), "python": sys.version.split()[0],
                               "cpus": os.cpu_count(), **ran_on}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
