"""Kernel-side cost of an Explorer Step at growing history: one `session.step` plus the trace refresh.

    python bench/step_latency.py [--steps 11] [--histories 20 100 300] [--k3-dir DIR] [--json bench/results/step_latency.json]

Models: the embedded trained tiny model, and a K3-depth model (93 layers, 896 experts, top-16:
`kimi-explore make-tiny`, written to a temporary folder unless --k3-dir names one already made).
For each history H a session is fed H - 1 tokens (sequence path), then `steps` tokens are stepped
one by one (the sessions in turn, so machine noise hits every history alike), each timed as:

    step     session.step(token)                                        (the decode itself)
    trace    session.trace()                                            (the whole history's Trace)
    window   session.trace(window=slice(-32, None)) and the arrays a view draws from it:
             attn_res_weights(), routing(), top_predictions()

    lens_at  lens_at(session, last token): the logit-lens strip of the new token (not in the total:
             its cost is bounded by `checkpoint_every`, not by the history)

The total is step + trace + window (what the Explorer's kernel side does per Step). Reported: the
median over the steps (process CPU time, ms; the wall clock beside it), and total(H) / total(20). Target (issue 20): the 300-token
total within 1.3x of the 20-token one. Run alone: the machine's load is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from argtypes import at_least  # (bench/: the script's directory, on sys.path)

from kimi_explore import from_pretrained
from kimi_explore.analysis.logit_lens import lens_at
from kimi_explore.inspection.session import Session
from kimi_explore.weights.k3_depth import write_k3_depth
from kimi_explore.weights.tiny_model import tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 32
# CPU time of the process (all its threads): time spent descheduled by other jobs on a shared machine
# does not count, BLAS threads do. The wall clock is reported beside it.
CLOCK = time.process_time


def one_step(s: Session, token: int) -> dict:
    c0, t0 = CLOCK(), time.perf_counter()
    s.step(token)
    c1 = CLOCK()
    s.trace()
    c2 = CLOCK()
    w = s.trace(window=slice(-WINDOW, None))
    w.attn_res_weights(), w.routing(), w.top_predictions()
    c3, t3 = CLOCK(), time.perf_counter()
    lens_at(s, len(s) - 1)
    c4 = CLOCK()
    return {"step": (c1 - c0) * 1e3, "trace": (c2 - c1) * 1e3, "window": (c3 - c2) * 1e3, "total": (c3 - c0) * 1e3,
            "wall": (t3 - t0) * 1e3, "lens_at": (c4 - c3) * 1e3}


def measure(weights, histories, steps: int, seed: int = 0) -> dict:
    """One session per history, stepped in turn (round robin), so machine noise hits every history alike."""
    rng = np.random.default_rng(seed)
    V = weights.config.vocab_size
    ids = [int(x) for x in rng.integers(0, V, max(histories) + steps + 1)]
    sessions = {}
    for H in sorted(histories):
        s = sessions[H] = Session(weights)
        s.feed(ids[: H - 1])
        s.trace()  # stack what the feed recorded: not part of a Step
    rows = {H: [] for H in sessions}
    for _ in range(steps):
        for H, s in sessions.items():
            rows[H].append(one_step(s, ids[len(s)]))
    out = {}
    for H, rs in rows.items():
        out[H] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        out[H]["n_records"] = len(sessions[H].trace().names())
    base = out[min(histories)]["total"]
    for H in out:
        out[H]["ratio_vs_first"] = out[H]["total"] / base
    return out


def table(results: dict) -> str:
    lines = [f"{'model':<10} {'history':>7} {'step ms':>8} {'trace ms':>9} {'window ms':>10} {'total ms':>9} "
             f"{'wall ms':>8} {'x vs first':>10} {'lens_at ms':>10}"]
    for model, rows in results.items():
        for H, r in rows.items():
            lines.append(f"{model:<10} {H:>7} {r['step']:>8.2f} {r['trace']:>9.2f} {r['window']:>10.2f} {r['total']:>9.2f} "
                         f"{r['wall']:>8.2f} {r['ratio_vs_first']:>10.2f} {r['lens_at']:>10.2f}")
    lines.append("(CPU ms, median over the steps; 'x vs first': total / total at the shortest history)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=at_least(1), default=11)
    p.add_argument("--histories", type=at_least(1), nargs="+", default=[20, 100, 300])
    p.add_argument("--k3-dir", default=None, help="a K3-depth checkpoint already made (kimi-explore make-tiny)")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "step_latency.json"))
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    results = {"embedded": measure(from_pretrained(tiny_checkpoint(), device="cpu"), args.histories, args.steps)}
    with tempfile.TemporaryDirectory() as tmp:
        k3 = args.k3_dir or write_k3_depth(Path(tmp) / "k3d")
        results["k3_depth"] = measure(from_pretrained(k3, device="cpu"), args.histories, args.steps)
    print(table(results))
    load_after = os.getloadavg()[0]
    cpu = platform.processor() or platform.machine()
    print(f"load average {load:.2f} before, {load_after:.2f} after; {os.cpu_count()} cores; {cpu}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"results": {m: {str(h): r for h, r in rows.items()} for m, rows in results.items()},
                                "steps": args.steps, "window": WINDOW, "load_before": load, "load_after": load_after,
                                "cpus": os.cpu_count()}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
