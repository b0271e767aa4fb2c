"""What a long history costs after a feed: a step, a trace, a snapshot, a fork, a back, a file.

    python bench/long_history.py [--histories 1024 8192] [--rounds 3] [--package DIR] [--json bench/results/long_history.json]

The embedded trained tiny model with the default Recorder. For each history H a session is fed H tokens of
Python's docs (the sequence path, default chunk), then each operation below runs in turn on it, `rounds`
times (the median is reported; each round starts from a session fed afresh):

    step        session.step(token): the first token stepped after the feed
    trace       session.trace()
    snapshot    session.snapshot()
    fork        session.fork()
    fork.trace  the fork's first trace()
    back        session.back(): the token stepped taken back
    save        session.save_state(file)
    load        Session.load_state(file, weights)
    load.trace  the loaded session's first trace()

Times are wall-clock seconds (file I/O included). Memory: in one more pass under `tracemalloc`, the bytes each
operation leaves allocated (the records and arrays it made) and its peak. `--package DIR` imports kimi_explore
from DIR instead (another checkout: the same script on older code, for a before/after in one sitting).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from argtypes import at_least  # (bench/: the script's directory, on sys.path)

ROOT = Path(__file__).resolve().parent.parent
OPS = ("step", "trace", "snapshot", "fork", "fork.trace", "back", "save", "load", "load.trace")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--histories", type=at_least(1), nargs="+", default=[1024, 8192])
    p.add_argument("--rounds", type=at_least(1), default=3)
    p.add_argument("--package", type=Path, default=None, help="import kimi_explore from this directory")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def operations(ke, weights, s, path: Path):
    """(name, fn) in order; each fn runs on what the ones before left."""
    kept = {}
    return [
        ("step", lambda: s.step(5)),
        ("trace", s.trace),
        ("snapshot", s.snapshot),
        ("fork", lambda: kept.__setitem__("fork", s.fork())),
        ("fork.trace", lambda: kept["fork"].trace()),
        ("back", s.back),
        ("save", lambda: s.save_state(path)),
        ("load", lambda: kept.__setitem__("load", ke.Session.load_state(path, weights))),
        ("load.trace", lambda: kept["load"].trace()),
    ]


def main() -> None:
    args = parse()
    if args.package is not None:
        sys.path.insert(0, str(args.package.resolve()))
    import kimi_explore as ke  # (after --package)

    sys.path.insert(0, str(ROOT / "bench"))
    from prefill import corpus_texts

    weights = ke.from_pretrained(ke.tiny_checkpoint(), device="cpu")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "session.npz"
        for H in args.histories:
            text = corpus_texts(1, H)[0]
            times = {op: [] for op in OPS}
            for _ in range(args.rounds):
                s = ke.Session(weights)
                s.feed(text, progress=False)
                for name, fn in operations(ke, weights, s, path):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            s = ke.Session(weights)
            s.feed(text, progress=False)
            memory = {}
            tracemalloc.start()
            for name, fn in operations(ke, weights, s, path):
                tracemalloc.reset_peak()
                before = tracemalloc.get_traced_memory()[0]
                fn()
                now, peak = tracemalloc.get_traced_memory()
                memory[name] = {"kept_mib": (now - before) / 2**20, "peak_mib": (peak - before) / 2**20}
            tracemalloc.stop()
            rows[H] = {op: {"seconds": statistics.median(times[op]), **memory[op]} for op in OPS}

    print(f"kimi_explore from {Path(ke.__file__).parent.parent}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'operation':12s}" + "".join(f"{f'H={H}: s':>13s}{'kept MiB':>10s}{'peak MiB':>10s}" for H in rows))
    for op in OPS:
        print(f"{op:12s}" + "".join(f"{r[op]['seconds']:13.3f}{r[op]['kept_mib']:10.1f}{r[op]['peak_mib']:10.1f}"
                                    for r in rows.values()))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "package": str(Path(ke.__file__).parent.parent), "rounds": args.rounds, "histories": rows,
            "load_average": os.getloadavg(), "cpu": platform.processor() or platform.machine(),
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))


if __name__ == "__main__":
    main()
