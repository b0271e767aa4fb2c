"""What hooks and recording cost per token on the tiny models.

    python bench/hooks.py [--rounds 40] [--block 32] [--device cpu] [--json bench/results/hooks.json]

Configurations, each decoding the same `block` tokens from a fresh state in every round, interleaved
token by token (each steps the same token in turn) so machine noise hits them alike:

    none          hooks=None
    empty Hooks   a Hooks() with nothing attached (the dispatch cost of every site)
    recorder      the default Recorder (attn-res weights, KDA norms, routing, top-10 predictions)
    full          Recorder(full="*"): a host copy of every value at every site

Reports the median ms/token of each, its overhead over `none` (median over rounds of the ratio of
round times, the recorder's batched work included; the default recorder's budget is 15%), and the
Python-level calls per token (functions and C calls: the work added, free of timing noise).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from argtypes import at_least  # (bench/: the script's directory, on sys.path)

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.inspection.hooks import Hooks
from kimi_explore.inspection.recorder import Recorder
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "tests" / "data" / "reference" / "tiny_k3"
BUDGET = 0.15
# CPU time of this thread: time the process spends descheduled (other jobs on a shared CI machine)
# does not count. The decoder's BLAS calls are single-threaded at these sizes.
CLOCK = time.thread_time


def configurations():
    return {
        "none": lambda: None,
        "empty Hooks": Hooks,
        "recorder": Recorder,
        "full": lambda: Recorder(full="*"),
    }


def calls_per_token(weights, hooks, tokens) -> float:
    """Python-level calls (Python functions + C functions/methods) per token: a noise-free measure of work."""
    state = KimiDecodeState.new(weights)
    kimi_forward_token(weights, state, tokens[0], hooks=hooks)  # resolve and cache hook names first
    n = 0

    def count(frame, event, arg):
        nonlocal n
        n += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        for t in tokens:
            kimi_forward_token(weights, state, t, hooks=hooks)
        if isinstance(hooks, Recorder):
            hooks.flush()
    finally:
        sys.setprofile(None)
    return n / len(tokens)


def bench(weights, rounds: int, block: int) -> dict:
    """Every configuration steps the same token in turn (rotating who goes first), each on its own state.

    Interleaving token by token makes machine noise hit the configurations alike. A round is `block`
    tokens from a fresh state; a recorder's time includes completing its batched records (`flush`).
    ms/token: the median over all steps; overhead: the median over rounds of (round time / the round
    time of `none`), which counts every recorder cost, the occasional batched work included.
    """
    V = weights.config.vocab_size
    tokens = [(17 + 31 * i) % V for i in range(block)]
    names = list(configurations())
    hooks = {}
    for name, make in configurations().items():
        h = make()
        hooks[name] = h.bind(weights) if h is not None else None  # name checks outside the timing
    steps = {name: [] for name in names}
    rounds_total = {name: [] for name in names}
    for r in range(rounds + 1):  # round 0 warms up
        states = {name: KimiDecodeState.new(weights) for name in names}
        total = dict.fromkeys(names, 0.0)
        for h in hooks.values():
            if isinstance(h, Recorder):
                h.clear_records()
        for i, t in enumerate(tokens):
            k = (r + i) % len(names)
            for name in names[k:] + names[:k]:
                t0 = CLOCK()
                kimi_forward_token(weights, states[name], t, hooks=hooks[name])
                dt = CLOCK() - t0
                total[name] += dt
                if r:
                    steps[name].append(dt * 1e3)
        for name, h in hooks.items():
            if isinstance(h, Recorder):
                t0 = CLOCK()
                h.flush()
                total[name] += CLOCK() - t0
        if r:
            for name in names:
                rounds_total[name].append(total[name])
    rows = {}
    for name in names:
        med = statistics.median(steps[name])
        ratio = statistics.median(a / b for a, b in zip(rounds_total[name], rounds_total["none"], strict=True))
        rows[name] = {"ms_per_token": med, "tokens_per_s": 1e3 / med, "overhead": ratio - 1.0, "steps": len(steps[name])}
    for name, make in configurations().items():
        h = make()
        rows[name]["calls_per_token"] = calls_per_token(weights, h.bind(weights) if h is not None else None, tokens)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=at_least(1), default=40)
    ap.add_argument("--block", type=at_least(1), default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "hooks.json"))
    args = ap.parse_args(argv)

    results = {"machine": platform.platform(), "processor": platform.processor(), "device": args.device,
               "rounds": args.rounds, "block": args.block, "budget": BUDGET, "models": {}}
    ok = True
    for label, path in (("random tiny (tests/data/tiny_k3)", random_tiny_checkpoint()), ("reference tiny_k3", REFERENCE)):
        weights = from_pretrained(path, device=args.device)
        rows = bench(weights, args.rounds, args.block)
        results["models"][label] = {"layers": len(weights.layers), "hidden": weights.config.hidden_size, "rows": rows}
        print(f"\n{label}: {len(weights.layers)} layers, hidden {weights.config.hidden_size}, device {weights.device}")
        print(f"{'configuration':<14} {'ms/token':>9} {'tok/s':>8} {'overhead':>9} {'calls/token':>12}")
        for name, row in rows.items():
            print(f"{name:<14} {row['ms_per_token']:9.3f} {row['tokens_per_s']:8.1f} {row['overhead'] * 100:8.1f}%"
                  f" {row['calls_per_token']:12.0f}")
        over = rows["recorder"]["overhead"]
        ok &= over <= BUDGET
        print(f"default recorder overhead {over * 100:.1f}% (budget {BUDGET * 100:.0f}%): {'OK' if over <= BUDGET else 'OVER'}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
