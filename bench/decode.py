"""Decode speed and load memory on the tiny models.

    python bench/decode.py [--steps 300] [--json bench/results/decode.json]

Prints ms/token (median of many single-token steps after warm-up) per checkpoint and dtype, without
hooks and with the default Recorder (its batched work included: the mean over the steps), a
per-layer-kind breakdown (each sublayer timed on its own), the number of NumPy calls
(NumPy functions and methods called by name) one token makes, and the peak resident memory while
loading against the size of what is kept (measured in a fresh subprocess per load).

Times are the CPU time of this thread (time.thread_time): on a shared machine the time the process
spends descheduled does not count (the decoder's BLAS calls are single-threaded at these sizes). The
ratio to mlx-lm compares like clocks: wall to wall (the wall clock of the same steps is kept too) and
CPU to CPU (mlx-lm's process CPU time counts all its threads: 1.0-1.4x its wall time here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from argtypes import at_least  # (bench/: the script's directory, on sys.path)

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.inspection.recorder import Recorder
from kimi_explore.model.block_residual import SourceBuffer
from kimi_explore.model.kda import KdaState, kda_step
from kimi_explore.model.latent_moe import latent_moe
from kimi_explore.model.mla import MlaState, mla_step
from kimi_explore.model.ops import dense_mlp, rms_norm
from kimi_explore.weights.tiny_model import make_text_config, random_tiny_checkpoint, write_checkpoint

REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "data" / "reference" / "tiny_k3"


CLOCK = time.thread_time


def time_decode(weights, steps: int, hooks=None, wall: list | None = None) -> list[float]:
    """ms (CLOCK) of each of `steps` tokens (a fresh state every 64 tokens: the MLA caches stay short);
    `wall`, when given, gets each token's wall-clock ms."""
    state = KimiDecodeState.new(weights)
    for t in range(10):
        kimi_forward_token(weights, state, t, hooks=hooks)
    out = []
    for t in range(steps):
        if t % 64 == 0:
            state = KimiDecodeState.new(weights)
        t0, w0 = CLOCK(), time.perf_counter()
        kimi_forward_token(weights, state, (t * 7) % weights.config.vocab_size, hooks=hooks)
        t1, w1 = CLOCK(), time.perf_counter()
        out.append((t1 - t0) * 1e3)
        if wall is not None:
            wall.append((w1 - w0) * 1e3)
    return out


def _is_numpy(fn) -> bool:
    owner = getattr(fn, "__self__", None)
    return isinstance(fn, np.ufunc) or isinstance(owner, (np.ndarray, np.ufunc)) or \
        (getattr(fn, "__module__", None) or "").startswith("numpy")


def count_c_calls(weights) -> int:
    """NumPy functions and methods one token calls by name (operators such as `a * b` are not seen by
    the profiler; Python-level work such as math.exp on floats is not counted)."""
    state = KimiDecodeState.new(weights)
    kimi_forward_token(weights, state, 1)
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        if event == "c_call" and _is_numpy(arg):
            n += 1

    sys.setprofile(prof)
    kimi_forward_token(weights, state, 2)
    sys.setprofile(None)
    return n


def mlx_decode(path: Path, steps: int) -> dict:
    """mlx-lm's `kimi_k3` decoding the same checkpoint token by token with its KV/state cache, in this run:
    median ms/token of the process's CPU time (mlx computes on its own threads), a fresh cache every 64
    tokens as `time_decode` does. The peer that makes the ratio a fact on a shared machine."""
    try:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load_model
    except ImportError as e:
        return {"skipped": f"mlx-lm is not installed ({e}); pip install 'mlx[cpu]' mlx-lm"}
    model, _ = load_model(path)
    config = json.loads((path / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]  # (the released layout nests the text model's keys)
    cache = make_prompt_cache(model)
    for t in range(10):
        mx.eval(model(mx.array([[t]]), cache=cache))
    cpu, wall = [], []
    for t in range(steps):
        if t % 64 == 0:
            cache = make_prompt_cache(model)
        c0, w0 = time.process_time(), time.perf_counter()
        mx.eval(model(mx.array([[(t * 7) % vocab]]), cache=cache))
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - w0) * 1e3)
    return {"median_ms": statistics.median(cpu), "median_wall_ms": statistics.median(wall), "mlx": mx.__version__,
            "device": str(mx.default_device())}


def _median_us(fn, reps: int = 200) -> float:
    for _ in range(10):
        fn()
    ts = []
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        ts.append(CLOCK() - t0)
    return statistics.median(ts) * 1e6


def breakdown(weights) -> dict[str, float]:
    """Median µs of each sublayer kind, summed over the layers of that kind (one token)."""
    cfg, xp, dt = weights.config, weights.xp, weights.dtype
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal(cfg.hidden_size).astype(dt))
    total = {"kda attention": 0.0, "mla attention": 0.0, "dense mlp": 0.0, "latent moe": 0.0, "attn-res mixes": 0.0,
             "rms norms": 0.0}
    n_src = 1
    for layer in weights.layers:
        att = layer.attention
        if att.kind == "kda":
            st = KdaState.zeros(att, xp, dt)
            total["kda attention"] += _median_us(lambda: kda_step(x, att, st))
        else:
            st = MlaState.empty(att, xp, dt)
            for _ in range(32):
                mla_step(x, att, st)  # a 32-token cache, then time the next steps (cache grows)
            total["mla attention"] += _median_us(lambda: mla_step(x, att, st), reps=50)
        ffn = layer.ffn
        if ffn.kind == "moe":
            total["latent moe"] += _median_us(lambda: latent_moe(x, ffn))
        else:
            total["dense mlp"] += _median_us(
                lambda: dense_mlp(x, ffn, cfg.activation_situ_beta, cfg.activation_situ_linear_beta))
        n_src += layer.is_block_boundary
        src = SourceBuffer(xp, n_src, cfg.hidden_size, dt, 1e-5)
        for _ in range(n_src - 1):  # the blocks sealed by this layer
            src.set_current(xp.asarray(rng.standard_normal(cfg.hidden_size).astype(dt)))
            src.seal()
        total["attn-res mixes"] += 2 * _median_us(lambda: (src.set_current(x), src.mix(src.weights(layer.attn_res_score))))
        total["rms norms"] += 2 * _median_us(lambda: rms_norm(x, layer.input_layernorm, 1e-5))
    return {k: v / 1e3 for k, v in total.items() if v}


_LOAD_PROBE = """
import json, resource, sys
from kimi_explore import from_pretrained
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'):
            return int(line.split()[1]) * 1024
before = hwm()
w = from_pretrained(sys.argv[1], device='cpu', dtype=sys.argv[2])
import numpy as np
def arrays(o, seen):
    if id(o) in seen: return 0
    seen.add(id(o))
    if isinstance(o, np.ndarray): return o.nbytes
    if hasattr(o, '__dict__'): return sum(arrays(v, seen) for v in vars(o).values())
    if isinstance(o, (list, tuple)): return sum(arrays(v, seen) for v in o)
    return 0
print(json.dumps({'hwm_before': before, 'hwm_after': hwm(), 'kept': arrays(w, set())}))
"""


def load_memory(path: Path, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _LOAD_PROBE, str(path), dtype], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    files = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    r.update(checkpoint_bytes=files, peak_increase=r["hwm_after"] - r["hwm_before"])
    r["peak_over_kept"] = r["peak_increase"] / r["kept"]
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=at_least(1), default=300)
    p.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "decode.json"))
    args = p.parse_args()

    results = {"decode": [], "breakdown": {}, "memory": []}
    models = {"random tiny (tests/data/tiny_k3)": random_tiny_checkpoint(), "reference tiny": REFERENCE}
    print(f"{'checkpoint':<30} {'dtype':<8} {'median ms/tok':>13} {'p10':>6} {'p90':>6} {'recorder ms/tok':>15} "
          f"{'NumPy calls/tok':>15}")
    for name, path in models.items():
        for dtype in ("float32", "float64"):
            w = from_pretrained(path, device="cpu", dtype=dtype)
            wall, rec_wall = [], []
            ts = time_decode(w, args.steps, wall=wall)
            rec = Recorder().bind(w)
            rec_ms = float(np.mean(time_decode(w, args.steps, rec, rec_wall)))  # the mean: the batched flushes included
            calls = count_c_calls(w)
            q = np.percentile(ts, [10, 50, 90])
            results["decode"].append({"checkpoint": name, "dtype": dtype, "median_ms": q[1], "p10_ms": q[0], "p90_ms": q[2],
                                      "recorder_mean_ms": rec_ms, "c_calls_per_token": calls, "layers": len(w.layers),
                                      "median_wall_ms": float(np.median(wall)),
                                      "recorder_mean_wall_ms": float(np.mean(rec_wall))})
            print(f"{name:<30} {dtype:<8} {q[1]:13.3f} {q[0]:6.2f} {q[2]:6.2f} {rec_ms:15.3f} {calls:15d}")

    peer = mlx_decode(REFERENCE, args.steps)
    results["mlx_lm_reference_tiny"] = peer
    if "skipped" in peer:
        print(f"\nmlx-lm: {peer['skipped']}")
    else:
        ours = next(r for r in results["decode"] if r["checkpoint"] == "reference tiny" and r["dtype"] == "float32")
        print(f"\nmlx-lm kimi_k3, reference tiny, same run: {peer['median_ms']:.3f} ms/token of process CPU time, "
              f"{peer['median_wall_ms']:.3f} wall (mlx {peer['mlx']} on {peer['device']}); kimi_explore with the recorder "
              f"takes {ours['recorder_mean_wall_ms'] / peer['median_wall_ms']:.3f}x mlx-lm's wall time, without hooks "
              f"{ours['median_wall_ms'] / peer['median_wall_ms']:.3f}x (by CPU time: "
              f"{ours['recorder_mean_ms'] / peer['median_ms']:.3f}x and {ours['median_ms'] / peer['median_ms']:.3f}x)")

    w = from_pretrained(REFERENCE, device="cpu")
    parts = breakdown(w)
    results["breakdown"] = parts
    print("\nper-layer-kind breakdown, reference tiny, float32 (each sublayer timed alone, summed over its layers):")
    for k, v in parts.items():
        print(f"  {k:<16} {v:7.3f} ms/token")
    print(f"  {'sum':<16} {sum(parts.values()):7.3f} ms/token (plus embedding, lm_head, Python glue)")

    print(f"\n{'load (fresh process)':<34} {'dtype':<8} {'ckpt MB':>8} {'kept MB':>8} {'peak +MB':>9} {'peak/kept':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        medium = write_checkpoint(Path(tmp) / "medium", make_text_config(
            hidden_size=1024, num_hidden_layers=4, intermediate_size=4096, num_experts=32, num_experts_per_token=4,
            routed_expert_hidden_size=512, moe_intermediate_size=512, q_lora_rank=256, kv_lora_rank=128,
            linear_attn_config={**make_text_config()["linear_attn_config"], "num_heads": 8, "head_dim": 128,
                                "kda_layers": [1, 2, 3], "full_attn_layers": [4]}), shards=2)
        for name, path in {**models, "medium synthetic (hidden 1024)": medium}.items():
            for dtype in ("float32",):
                r = load_memory(path, dtype)
                r.update(checkpoint=name, dtype=dtype)
                results["memory"].append(r)
                print(f"{name:<34} {dtype:<8} {r['checkpoint_bytes'] / 1e6:8.1f} {r['kept'] / 1e6:8.1f} "
                      f"{r['peak_increase'] / 1e6:9.1f} {r['peak_over_kept']:9.2f}")
    print("(kept = bytes of the loaded float32 arrays; bf16 on disk widens 2x, MXFP4 experts widen 8x)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
