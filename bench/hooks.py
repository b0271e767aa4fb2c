"""What hooks and recording cost per token on the tiny models.

    python bench/hooks.py [--rounds 40] [--block 24] [--device cpu] [--json bench/results/hooks.json]

Configurations, each decoding the same `block` tokens from a fresh state in every round, the
configurations interleaved round by round so machine noise hits them alike:

    none          hooks=None
    empty Hooks   a Hooks() with nothing attached (the dispatch cost of every site)
    recorder      the default Recorder (attn-res weights, KDA norms, routing, top-10 predictions)
    full          Recorder(full="*"): a host copy of every value at every site

Reports the median ms/token of each and its overhead over `none`. The default recorder's budget
is 15%.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from kimi_explore import KimiDecoderWeights, KimiDecodeState, kimi_forward_token
from kimi_explore.hooks import Hooks
from kimi_explore.recorder import Recorder
from kimi_explore.tiny_model import default_checkpoint

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "tests" / "data" / "reference" / "tiny_k3"
BUDGET = 0.15


def configurations():
    return {
        "none": lambda: None,
        "empty Hooks": Hooks,
        "recorder": Recorder,
        "full": lambda: Recorder(full="*"),
    }


def run_block(weights, hooks, tokens) -> list[float]:
    """ms of each step of `tokens` decoded from a fresh state."""
    state = KimiDecodeState.new(weights)
    out = []
    for t in tokens:
        t0 = time.perf_counter()
        kimi_forward_token(weights, state, t, hooks=hooks)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def bench(weights, rounds: int, block: int) -> dict:
    V = weights.config.vocab_size
    tokens = [(17 + 31 * i) % V for i in range(block)]
    configs = configurations()
    hook_objs = {}
    for name, make in configs.items():  # warm-up, and bind (name checks) outside the timing
        h = make()
        if h is not None:
            h.bind(weights)
        hook_objs[name] = h
        run_block(weights, h, tokens[:4])
    times = {name: [] for name in configs}
    for r in range(rounds):
        order = list(configs) if r % 2 == 0 else list(configs)[::-1]
        for name in order:
            h = hook_objs[name]
            if isinstance(h, Recorder):
                h.clear_records()
            times[name] += run_block(weights, h, tokens)
    base = statistics.median(times["none"])
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"ms_per_token": med, "tokens_per_s": 1e3 / med, "overhead": med / base - 1.0, "steps": len(ts)}
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--block", type=int, default=24)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "hooks.json"))
    args = ap.parse_args(argv)

    results = {"machine": platform.platform(), "processor": platform.processor(), "device": args.device,
               "rounds": args.rounds, "block": args.block, "budget": BUDGET, "models": {}}
    ok = True
    for label, path in (("embedded tiny (data/tiny_k3)", default_checkpoint()), ("reference tiny_k3", REFERENCE)):
        weights = KimiDecoderWeights.from_pretrained(path, device=args.device)
        rows = bench(weights, args.rounds, args.block)
        results["models"][label] = {"layers": len(weights.layers), "hidden": weights.config.hidden_size, "rows": rows}
        print(f"\n{label}: {len(weights.layers)} layers, hidden {weights.config.hidden_size}, device {weights.device}")
        print(f"{'configuration':<14} {'ms/token':>9} {'tok/s':>8} {'overhead':>9}")
        for name, row in rows.items():
            print(f"{name:<14} {row['ms_per_token']:9.3f} {row['tokens_per_s']:8.1f} {row['overhead'] * 100:8.1f}%")
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
