"""Issue 18's speed bars carried to this machine: the code the issue measured, run beside today's in one run.

    python bench/issue_baseline.py [--baseline b837dd5] [--rounds 3] [--threads 1] [--no-mlx]
                                   [--json bench/results/issue_baseline.json]

Issue 18 set absolute bars measured on the machine it was written on: "ke.routing_stats runs 1,272
tokens/s on this machine, and the decoder alone 1,400"; Session.feed >= 30,000 tokens/s and
routing_stats >= 20,000; mlx-lm's prefill "about 750-800 tokens/s here". An absolute rate on a shared
VM says little (the brief: a ratio in one run is a fact), so this script runs the issue-time code
itself (`--baseline`: the commit before the sequence path, `git archive`d into a temporary directory
and its extensions built there) in a worker process, interleaved round by round with today's code
in this one, on the workloads the issue named:

    baseline decoder alone     the issue-time `bench/routing_stats.py` "decoder only" row: a Session without a
                               recorder fed its texts (256 bytes of its corpus each, 2,048 tokens), token by token
    baseline routing_stats     the same script's routing_stats row, same texts
    Session.feed, recorder     today's feed with the default Recorder, 1,024-token texts of Python's docs (as
                               bench/prefill.py)
    routing_stats, one core    today's ke.routing_stats on the baseline's own texts (workers=1)
    mlx-lm kimi_k3             (unless --no-mlx) its prefill of the 1,024-token texts, as bench/prefill.py

Each baseline row gives a machine factor (its rate here over the rate the issue quoted), and each bar
is carried here as bar x factor; equivalently today's route must reach bar / quoted baseline times the
baseline measured in the same round (feed: 30,000 / 1,400 = 21.4x the baseline decoder; routing_stats:
20,000 / 1,272 = 15.7x the baseline routing_stats). "x baseline" is that paired ratio: it carries the machine
factor, and is no speedup of like for like (feed runs other texts, with a recorder). A route meets its bar
when every round's ratio reaches it, misses when none does, and is "within noise" otherwise (the median said).
mlx-lm's factor (against the 775 midpoint of the issue's range) is a cross-check made with other code.
Rates are by CPU time of each process (BLAS on `--threads` threads), so descheduled time does not count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from argtypes import at_least  # (bench/: the script's directory, on sys.path)

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "b837dd5"  # the last commit before the sequence path (8baeebc): the code issue 18 measured
QUOTED = {"decoder": 1_400.0, "routing_stats": 1_272.0, "mlx": 775.0}  # tokens/s on the machine
BARS = {"feed": 30_000.0, "routing_stats": 20_000.0}  # tokens/s, the bars
OLD_CORPUS = ("The quick brown fox jumps over the lazy dog. In 1969, 3 astronauts flew 384,400 km to the Moon.\n"
              "def f(x):\n    return x * 2  # twice\nHello, world! Prices: 10 apples cost $4.50; 12 pears, $6.\n")
OLD_TEXTS = [(OLD_CORPUS * 2)[:256]] * 8  # the issue-time bench/routing_stats.py defaults: 2,048 tokens

# The worker: the issue-time package (first on its path), its bench's two routes timed on request, one JSON line each.
WORKER = r"""
import json, sys, time
import kimi_explore as ke
texts = json.loads(sys.argv[1])
load = getattr(ke, "from_pretrained", None) or ke.KimiDecoderWeights.from_pretrained  # (before the consolidation)
weights = load(ke.tiny_checkpoint(), device="cpu")
def decoder():
    for t in texts:
        ke.Session(weights, recorder=False, checkpoint_every=0).feed(list(t.encode()))
def stats():
    ke.routing_stats(weights, texts, progress=False)
routes = {"decoder": decoder, "routing_stats": stats}
stats()  # warm up
print(json.dumps({"file": ke.__file__}), flush=True)
for line in sys.stdin:
    fn = routes[line.strip()]
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}), flush=True)
"""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default=BASELINE, help="the commit whose code the issue measured")
    p.add_argument("--rounds", type=at_least(1), default=3)
    p.add_argument("--threads", type=at_least(0), default=1, help="BLAS threads (0: leave the environment as it is)")
    p.add_argument("--no-mlx", action="store_true", help="skip mlx-lm (pip install 'mlx[cpu]' mlx-lm)")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "issue_baseline.json"))
    return p.parse_args()


def baseline_tree(commit: str, into: Path) -> Path:
    """The baseline commit's files under `into`, its compiled kernels built in place (the same compiler as today's)."""
    try:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit], check=True, capture_output=True)
    except subprocess.CalledProcessError as e:
        sys.exit(f"--baseline {commit}: git archive failed in {ROOT}: {e.stderr.decode().strip()} (a clone with its history "
                 "is needed)")
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar.stdout, check=True)
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=into, capture_output=True, text=True)
    if built.returncode:
        sys.exit(f"--baseline {commit}: building its extensions failed:\n{built.stderr[-2000:]}")
    return into


class Baseline:
    """The issue-time code in a worker process: `time(route)` -> (wall s, CPU s) of one run of its route."""

    def __init__(self, tree: Path, texts: list[str]):
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(texts)], cwd=tree, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        loaded = Path(self._reply()["file"]).resolve()
        if tree.resolve() not in loaded.parents:
            self.close()
            sys.exit(f"the baseline worker imported {loaded}, not the baseline tree {tree}: an installed kimi_explore "
                     "shadows PYTHONPATH")

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"the baseline worker ended (exit status {self.proc.wait()})")
        return json.loads(line)

    def time(self, route: str) -> tuple[float, float]:
        self.proc.stdin.write(route + "\n")
        self.proc.stdin.flush()
        r = self._reply()
        return r["wall"], r["cpu"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> int:
    args = parse()
    if args.threads:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    import machine  # (bench/: this script's directory)
    from prefill import corpus_texts, mlx_route, timed

    sys.path.insert(0, str(ROOT))  # today's code is this checkout's, whatever is installed
    import kimi_explore as ke  # after the thread settings: BLAS reads them when NumPy loads

    if ROOT not in Path(ke.__file__).resolve().parents:
        sys.exit(f"today's side imported {ke.__file__}, not {ROOT}'s kimi_explore")

    path = ke.tiny_checkpoint()
    weights = ke.from_pretrained(path, device="cpu")
    feed_texts = corpus_texts(3, 1024)
    old_tokens = sum(len(t) for t in OLD_TEXTS)
    ran_on = machine.describe()
    print(machine.line(ran_on))
    with tempfile.TemporaryDirectory(prefix="kimi_baseline_") as tmp:
        print(f"building the baseline {args.baseline} in {tmp} ...", flush=True)
        base = Baseline(baseline_tree(args.baseline, Path(tmp)), OLD_TEXTS)

        def feed():
            for ids in feed_texts:
                ke.Session(weights).feed(ids, progress=False)

        def stats():
            ke.routing_stats(weights, OLD_TEXTS, progress=False)

        feed(), stats()  # warm up
        rates = {k: [] for k in ("baseline decoder", "baseline routing_stats", "Session.feed, recorder",
                                 "routing_stats, one core")}
        try:
            for _ in range(args.rounds):  # interleaved: each of today's routes beside its own baseline
                rates["baseline decoder"].append(old_tokens / base.time("decoder")[1])
                rates["Session.feed, recorder"].append(3 * 1024 / timed(feed)[1])
                rates["baseline routing_stats"].append(old_tokens / base.time("routing_stats")[1])
                rates["routing_stats, one core"].append(old_tokens / timed(stats)[1])
        finally:
            base.close()
    mlx = None if args.no_mlx else mlx_route(Path(path), feed_texts, ke, weights)

    pairs = {"Session.feed, recorder": ("baseline decoder", "decoder", "feed"),
             "routing_stats, one core": ("baseline routing_stats", "routing_stats", "routing_stats")}
    print(f"\nissue 18's bars carried here ({args.rounds} rounds, BLAS threads {os.environ.get('OPENBLAS_NUM_THREADS')}, "
          f"load {os.getloadavg()[0]:.2f}; tokens/s by CPU time, median over rounds)")
    print(f"{'baseline (issue-time code)':28s} {'quoted':>8s} {'here':>8s} {'factor':>7s}")
    factors = {}
    for name, quoted in (("baseline decoder", QUOTED["decoder"]), ("baseline routing_stats", QUOTED["routing_stats"])):
        here = statistics.median(rates[name])
        factors[name] = here / quoted
        print(f"{name:28s} {quoted:8,.0f} {here:8,.0f} {factors[name]:7.3f}")
    if mlx is not None and "skipped" not in mlx:
        factors["mlx-lm"] = mlx["tokens_per_s_wall"] / QUOTED["mlx"]
        print(f"{'mlx-lm kimi_k3 (wall)':28s} {QUOTED['mlx']:8,.0f} {mlx['tokens_per_s_wall']:8,.0f} {factors['mlx-lm']:7.3f}"
              "  (cross-check: other code)")
    print(f"\n{'route':28s} {'tok/s':>8s} {'bar':>7s} {'carried':>8s} {'x baseline':>11s} {'range':>12s} {'needed':>7s}  "
          "verdict (rounds at or above needed)")
    results = {}
    for name, (base_name, quoted_key, bar_key) in pairs.items():
        paired = [ours / theirs for ours, theirs in zip(rates[name], rates[base_name], strict=True)]
        ratio, needed = statistics.median(paired), BARS[bar_key] / QUOTED[quoted_key]
        tps = statistics.median(rates[name])
        above = sum(r >= needed for r in paired)
        verdict = "meets" if above == len(paired) else "MISSES" if not above else \
            f"within noise: the median {'meets' if ratio >= needed else 'misses'}"
        results[name] = {"tokens_per_s_cpu": tps, "bar_tokens_per_s": BARS[bar_key],
                         "carried_bar_tokens_per_s": BARS[bar_key] * factors[base_name], "x_baseline_paired": paired,
                         "x_baseline_median": ratio, "x_baseline_needed": needed, "rounds_at_or_above": above,
                         "verdict": verdict}
        print(f"{name:28s} {tps:8,.0f} {BARS[bar_key]:7,.0f} {BARS[bar_key] * factors[base_name]:8,.0f} {ratio:10.1f}x "
              f"{min(paired):5.1f}-{max(paired):5.1f}x {needed:6.1f}x  {verdict} ({above}/{len(paired)})")
    if "mlx-lm" in factors and abs(factors["mlx-lm"] / factors["baseline decoder"] - 1) > 0.2:
        print(f"(mlx-lm's factor {factors['mlx-lm']:.3f} is not the baseline decoder's {factors['baseline decoder']:.3f}: "
              f"carried by it, the feed bar here would be {BARS['feed'] * factors['mlx-lm']:,.0f} tokens/s. The baseline "
              "is the issue's own code on its own workload, so its factor is the one judged)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"baseline": args.baseline, "quoted": QUOTED, "bars": BARS, "rates": rates,
                               "factors": factors, "results": results, "mlx": mlx, "rounds": args.rounds,
                               "threads": args.threads, "load_average": os.getloadavg(), "cpus": os.cpu_count(),
                               "when": time.strftime("%Y-%m-%d %H:%M:%S"), **ran_on}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
