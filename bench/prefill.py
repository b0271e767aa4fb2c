"""Prefill speed on the embedded model: whole texts through the sequence path, against the token path and mlx-lm.

    python bench/prefill.py [--texts 3] [--len 1024] [--rounds 2] [--chunks 16,64,128,256,512] [--step-tokens N]
                            [--threads 1] [--no-mlx] [--json bench/results/prefill.json]

Texts: `--texts` windows of `--len` bytes of Python's `pydoc_data.topics` (`learned.pydoc_corpus()`: what the embedded model was
trained on; its tokenizer is bytes, so `--len` tokens each), each fed from a fresh state.

Rows (tokens/s by this process's CPU time and by wall clock, and its page faults per run; the median over every
timing). The routes are interleaved: per text and round (`--rounds`), feed and kimi_forward_sequence run just
before and just after the two token routes, and "x step" is the median over texts and rounds of each route's CPU
time per token against the Session.step between them (this shared VM's speed drifts by up to 2x within a minute,
so rows timed apart can differ by that much; mlx-lm's row is against the median step):

    Session.feed, recorder     the product's prefill: `Session(weights).feed(ids)` with the default
                               Recorder and the default chunk (`kimi_sequence.default_chunk`: 512 here)
    kimi_forward_sequence      the sequence path without hooks
    Session.step, recorder     the token path: the same session stepped token by token
    kimi_forward_token         the token path without hooks
    mlx-lm kimi_k3             `mlx_lm`'s model of the same checkpoint directory, one call over the
                               whole text with a fresh prompt cache (its CPU backend, its own threads;
                               it computes in the checkpoint's bfloat16, so its logits differ from
                               ours by rounding: the max |delta| and the argmax agreement are printed)

then the chunk sweep (`Session.feed(ids, chunk=c)`, what `DEFAULT_CHUNK` was chosen from), the KDA
delta rule alone (the compiled recurrence against the chunked WY form, at the embedded model's
width and at K3's, what `kda.kda_sequence(rule="auto")` was chosen from), and a floor: the matmul
FLOPs of a token of the embedded model (every trunk matrix, the top-k experts, MLA's scores and mix
over the mean cache length) over a float32 matmul's rate measured in the same run, beside the
transcendental functions (exp, tanh) per token at their measured rate (NumPy's float32 exp, and the
compiled exp of `sequence_ops` that the sequence path uses where it is built).

BLAS runs on `--threads` threads (set before NumPy loads; 0 leaves the environment): on a shared
2-core machine two BLAS threads that meet a busy core spin, and a prefill slows 30x. CPU time is
this process's (all its threads: mlx-lm's included), so descheduled time does not count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

from argtypes import at_least, int_list  # (bench/: the script's directory, on sys.path)

ROOT = Path(__file__).resolve().parent.parent
TARGET_TPS, TARGET_RATIO = 30_000.0, 20.0  # the bars for Session.feed on the embedded model


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=at_least(1), default=3)
    p.add_argument("--len", type=at_least(1), default=1024, help="tokens per text")
    p.add_argument("--chunks", type=int_list(1), default=[16, 64, 128, 256, 512])
    p.add_argument("--step-tokens", type=at_least(0), default=0,
                   help="tokens of each text the token path steps through (0: all --len of them, as the sequence path "
                        "feeds: a shorter prefix steps over a shorter cache, ~5%% faster per token at 256 of 1024)")
    p.add_argument("--rounds", type=at_least(1), default=2, help="rounds over the texts (each gives one paired ratio per text)")
    p.add_argument("--threads", type=at_least(0), default=1, help="BLAS threads (0: leave the environment as it is)")
    p.add_argument("--no-mlx", action="store_true", help="skip mlx-lm (pip install 'mlx[cpu]' mlx-lm)")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "prefill.json"))
    return p.parse_args()


def timed(fn) -> tuple[float, float, int]:
    """(wall s, CPU s of this process, its page faults) of fn()."""
    faults, wall, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def rate(n: int, times: list[tuple[float, float, int]]) -> dict:
    wall, cpu = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
    return {"tokens": n, "wall_s": wall, "cpu_s": cpu, "tokens_per_s_wall": n / wall, "tokens_per_s_cpu": n / cpu,
            "page_faults": statistics.median(t[2] for t in times)}


def corpus_texts(count: int, length: int) -> list[list[int]]:
    from kimi_explore.analysis.learned import pydoc_corpus

    data = pydoc_corpus()
    stride = len(data) // (count + 1)
    return [list(data[i * stride : i * stride + length]) for i in range(count)]


def routes(ke, weights, texts, step_tokens: int, rounds: int) -> dict:
    from kimi_explore.model.kimi_sequence import kimi_forward_sequence

    def feed(ids):
        return lambda: ke.Session(weights).feed(ids, progress=False)

    def seq(ids):
        return lambda: kimi_forward_sequence(weights, ke.KimiDecodeState.new(weights), ids)

    def step(ids):
        def run():
            s = ke.Session(weights)
            for t in ids:
                s.step(t)
        return run

    def token(ids):
        def run():
            st = ke.KimiDecodeState.new(weights)
            for t in ids:
                ke.kimi_forward_token(weights, st, t)
        return run

    # Interleaved: per text and round, each sequence route runs just before and just after the token routes, and its
    # ratio to stepping is taken against the step between them (the VM's speed drifts by up to 2x within a minute: a
    # ratio of rows timed minutes apart measures the drift). Rates: the median over every timing of the route.
    makers = {"Session.feed, recorder": (feed, None), "kimi_forward_sequence": (seq, None),
              "Session.step, recorder": (step, step_tokens), "kimi_forward_token": (token, step_tokens)}
    for make, _ in makers.values():
        make(texts[0][:64])()  # warm up
    times = {name: [] for name in makers}
    paired = {name: [] for name in makers}
    sequence = ("Session.feed, recorder", "kimi_forward_sequence")
    for _ in range(rounds):
        for ids in texts:
            got = {}
            for name in (*sequence, "Session.step, recorder", "kimi_forward_token", *sequence):
                make, part = makers[name]
                got.setdefault(name, []).append(timed(make(ids[:part])))
            n_seq, n_step = len(ids), len(ids[:step_tokens])
            step_cpu = got["Session.step, recorder"][0][1] / n_step  # CPU s per token
            for name, ts in got.items():
                times[name] += ts
                per_token = statistics.mean(t[1] for t in ts) / (n_step if name not in sequence else n_seq)
                paired[name].append(step_cpu / per_token)
    out = {}
    for name, (_, part) in makers.items():
        out[name] = rate(len(texts[0][:part]), times[name])
        out[name]["x_step_paired_cpu"] = statistics.median(paired[name])
        out[name]["x_step_pairs"] = paired[name]
    return out


def mlx_route(path: Path, texts, ke, weights) -> dict:
    try:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load_model
    except ImportError as e:
        return {"skipped": f"mlx-lm is not installed ({e}); pip install 'mlx[cpu]' mlx-lm"}
    import numpy as np

    from kimi_explore.model.kimi_sequence import kimi_forward_sequence

    model, _ = load_model(path)

    def run(ids, keep=None):
        def go():
            out = model(mx.array([ids]), cache=make_prompt_cache(model))
            mx.eval(out)
            if keep is not None:
                keep.append(np.array(out[0].astype(mx.float32)))
        return go

    run(texts[0][:64])()  # warm up
    r = rate(len(texts[0]), [timed(run(ids)) for ids in texts])
    theirs = []
    run(texts[0], theirs)()
    ours = np.asarray(kimi_forward_sequence(weights, ke.KimiDecodeState.new(weights), texts[0]))
    r.update(max_abs_logit_delta=float(np.abs(ours - theirs[0]).max()),
             argmax_agreement=float((ours.argmax(-1) == theirs[0].argmax(-1)).mean()),
             mlx=mx.__version__, device=str(mx.default_device()))
    return r


def chunk_sweep(ke, weights, texts, chunks) -> dict:
    out = {}
    for c in chunks:
        ke.Session(weights).feed(texts[0][: 2 * c], chunk=c, progress=False)
        out[c] = rate(len(texts[0]), [timed(lambda ids=ids: ke.Session(weights).feed(ids, chunk=c, progress=False))
                                      for ids in texts])
    return out


def kda_rules(T: int = 1024) -> list[dict]:
    """ms per token of the delta rule alone: recurrent (compiled) against chunked, at two widths."""
    import numpy as np

    from kimi_explore.model import kda_recurrence
    from kimi_explore.model.kda_chunk import chunked_delta_rule

    rows = []
    rng = np.random.default_rng(0)
    for label, H, K, n in (("embedded (4 heads x 32)", 4, 32, T), ("K3 (96 heads x 128)", 96, 128, 256)):
        qk = rng.standard_normal((2, n, H, K)).astype(np.float32)
        qk /= np.linalg.norm(qk, axis=-1, keepdims=True)
        v = rng.standard_normal((n, H, K)).astype(np.float32)
        g = (-5.0 * rng.random((n, H, K))).astype(np.float32)
        beta = rng.random((n, H)).astype(np.float32)
        variants = {"chunked 64": lambda S: chunked_delta_rule(qk[0], qk[1], v, g, beta, S, 64, True),
                    "chunked 256": lambda S: chunked_delta_rule(qk[0], qk[1], v, g, beta, S, 256, True)}
        if kda_recurrence.AVAILABLE:
            variants["recurrent (C)"] = lambda S: kda_recurrence.recurrent_delta_rule(qk[0], qk[1], v, g, beta, S, True)
        for name, fn in variants.items():
            fn(np.zeros((H, K, K), np.float32))
            ts = [timed(lambda: fn(np.zeros((H, K, K), np.float32))) for _ in range(3)]
            rows.append({"width": label, "tokens": n, "rule": name, "ms_per_token_cpu": min(t[1] for t in ts) / n * 1e3})
    return rows


def floor_counts(weights, T: int) -> tuple[int, int]:
    """(multiply-adds, exp/tanh) per token of the model, the mean over a T-token text from a fresh state:
    every trunk matrix (lm_head, not the embedding lookup), the top-k experts, MLA's scores and mix over
    the mean cache length; KDA's delta rule is not counted (not a matmul: 3 H K V multiply-adds per layer)."""
    import numpy as np

    cfg = weights.config
    size = lambda a: int(np.prod(a.shape))  # noqa: E731
    macs = size(weights.head().lm_head)
    trans = 0
    for layer in weights.layers:
        att, ffn = layer.attention, layer.ffn
        if att.kind == "kda":
            macs += size(att.in_proj) + size(att.f_b_proj) + size(att.o_proj)
            # SiLU on q, k, v (3 P); the output gate's sigmoid (P); the decay's sigmoid (P) and alpha = exp(g) (P); beta (H)
            trans += 6 * att.num_heads * att.head_dim + att.num_heads
        else:
            macs += size(att.in_proj) + size(att.q_b_proj) + size(att.kv_b_proj) + size(att.o_proj)
            mean_len = (T + 1) // 2
            macs += att.num_heads * (att.qk_nope_head_dim + att.qk_rope_head_dim + att.v_head_dim) * mean_len
            trans += att.num_heads * mean_len + att.num_heads * att.v_head_dim  # softmax; output gate
        if ffn.kind == "moe":
            w13, w2 = ffn.experts.gather(np.array([0]))
            macs += size(ffn.in_proj) + ffn.top_k * (size(w13[0]) + size(w2[0])) + size(ffn.routed_expert_up_proj) \
                + size(ffn.shared_down_proj)
            trans += ffn.num_experts + ffn.top_k * 3 * w2.shape[-1] + 3 * ffn.shared_down_proj.shape[-1]
        else:
            macs += size(ffn.gate_up_proj) + size(ffn.down_proj)
            trans += 3 * ffn.down_proj.shape[-1]
    trans += cfg.vocab_size  # the recorder's top-k softmax
    return macs, trans


def floor(weights, T: int) -> dict:
    """`floor_counts` (matmul FLOPs and the transcendental count per token), each against its rate measured here."""
    import numpy as np

    macs, trans = floor_counts(weights, T)
    a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    t = min(timed(lambda: a @ a)[1] for _ in range(5))
    gflops = 2 * 512**3 / t / 1e9
    x = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)
    t_exp = min(timed(lambda: [np.exp(x) for _ in range(20)])[1] for _ in range(3)) / (20 * x.size)
    s_mm, s_tr = 2 * macs / (gflops * 1e9), trans * t_exp
    out = {"macs_per_token": macs, "sgemm_gflops": gflops, "transcendentals_per_token": trans, "exp_ns": t_exp * 1e9,
           "floor_tokens_per_s": 1.0 / (s_mm + s_tr), "matmul_only_tokens_per_s": 1.0 / s_mm}
    from kimi_explore.model import sequence_ops

    if sequence_ops.AVAILABLE:  # the compiled exp the sequence path uses (sequence_ops), at the same size
        y = np.empty_like(x)
        t_fast = min(timed(lambda: [(np.copyto(y, x), sequence_ops.exp_(y)) for _ in range(20)])[1] for _ in range(3))
        t_copy = min(timed(lambda: [np.copyto(y, x) for _ in range(20)])[1] for _ in range(3))
        t_fast = max(t_fast - t_copy, 0.0) / (20 * x.size)
        out.update(compiled_exp_ns=t_fast * 1e9, floor_compiled_exp_tokens_per_s=1.0 / (s_mm + trans * t_fast))
    return out


def main() -> int:
    args = parse()
    if args.threads:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    import machine  # (bench/: this script's directory)

    import kimi_explore as ke  # after the thread settings: BLAS reads them when NumPy loads
    from kimi_explore.model.kimi_sequence import default_chunk

    path = ke.tiny_checkpoint()
    weights = ke.from_pretrained(path, device="cpu")
    texts = corpus_texts(args.texts, args.len)
    load = os.getloadavg()
    print(f"prefill on the embedded model: {len(texts)} texts of {args.len} tokens, BLAS threads "
          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'default')}, {os.cpu_count()} CPUs, load {load[0]:.2f}")
    ran_on = machine.describe()
    print(machine.line(ran_on))

    rows = routes(ke, weights, texts, args.step_tokens or args.len, args.rounds)
    if not args.no_mlx:
        rows["mlx-lm kimi_k3 (bf16)"] = mlx_route(Path(path), texts, ke, weights)
    token_cpu = rows["Session.step, recorder"]["tokens_per_s_cpu"]
    print(f"\n{'route':28s} {'tokens':>6s} {'tok/s (cpu)':>12s} {'tok/s (wall)':>13s} {'x step (cpu)':>13s} {'page faults':>12s}")
    for name, r in rows.items():
        if "skipped" in r:
            print(f"{name:28s} skipped: {r['skipped']}")
            continue
        r["x_token_path_cpu"] = r.get("x_step_paired_cpu", r["tokens_per_s_cpu"] / token_cpu)
        print(f"{name:28s} {r['tokens']:6d} {r['tokens_per_s_cpu']:12.0f} {r['tokens_per_s_wall']:13.0f} "
              f"{r['x_token_path_cpu']:13.1f} {r['page_faults']:12.0f}")
    m = rows.get("mlx-lm kimi_k3 (bf16)", {})
    if "argmax_agreement" in m:
        print(f"(mlx-lm against kimi_forward_sequence on text 0: max |logit delta| {m['max_abs_logit_delta']:.3f}, "
              f"argmax agreement {m['argmax_agreement']:.1%}; mlx {m['mlx']} on {m['device']})")

    chunks = args.chunks
    sweep = chunk_sweep(ke, weights, texts, chunks)
    print(f"\nSession.feed (recorder) by chunk size (the default here: {default_chunk(weights.config)}):")
    print(f"{'chunk':>6s} {'tok/s (cpu)':>12s} {'tok/s (wall)':>13s}")
    for c, r in sweep.items():
        print(f"{c:6d} {r['tokens_per_s_cpu']:12.0f} {r['tokens_per_s_wall']:13.0f}")

    rules = kda_rules()
    print("\nKDA delta rule alone (state norms after every token included), ms/token (cpu, best of 3):")
    for r in rules:
        print(f"  {r['width']:26s} {r['rule']:14s} {r['ms_per_token_cpu']:8.4f}")

    fl = floor(weights, args.len)
    print(f"\nfloor: {fl['macs_per_token'] / 1e6:.2f} M multiply-adds per token at {fl['sgemm_gflops']:.0f} GFLOP/s (512^3 "
          f"sgemm, measured) -> {fl['matmul_only_tokens_per_s']:.0f} tokens/s; with ~{fl['transcendentals_per_token']:,} "
          f"exp/tanh per token at {fl['exp_ns']:.2f} ns -> {fl['floor_tokens_per_s']:.0f} tokens/s")
    if "compiled_exp_ns" in fl:
        print(f"       with the sequence path's compiled exp (sequence_ops) at {fl['compiled_exp_ns']:.2f} ns -> "
              f"{fl['floor_compiled_exp_tokens_per_s']:.0f} tokens/s")

    feed = rows["Session.feed, recorder"]
    ok_tps, ok_ratio = feed["tokens_per_s_cpu"] >= TARGET_TPS, feed["x_token_path_cpu"] >= TARGET_RATIO
    print(f"\nSession.feed: {feed['tokens_per_s_cpu']:.0f} tokens/s (cpu) {'meets' if ok_tps else 'MISSES'} the "
          f"{TARGET_TPS:,.0f} target; {feed['x_token_path_cpu']:.1f}x the token path "
          f"{'meets' if ok_ratio else 'MISSES'} the {TARGET_RATIO:.0f}x target")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"routes": rows, "chunk_sweep": {str(k): v for k, v in sweep.items()}, "kda_rules": rules,
                               "floor": fl, "default_chunk": default_chunk(weights.config), "meets_tokens_per_s": ok_tps,
                               "meets_ratio": ok_ratio, "threads": args.threads, "load_average": load,
                               "machine": platform.machine(), "python": sys.version.split()[0],
                               "cpus": os.cpu_count(), **ran_on}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
