"""Train the embedded tiny K3 on Python's own documentation and export it in the released layout.

    python -m training.train_tiny --out kimi_explore/data/tiny_k3_pydoc

Corpus: `learned.pydoc_corpus()`, the values of CPython 3.11.7's `pydoc_data.topics.topics` joined in sorted key
order, UTF-8 bytes (PSF licence), shipped with the model (each CPython release has its own topics). The last 5% is
the validation split and is never trained on.

Schedule: AdamW, warmup, constant LR, then a final cosine decay over `--decay-steps`; random windows of the training
split drawn from a seeded generator; every `--eval-every` steps the model is evaluated on the whole
validation split *as it will be exported* (BF16 matrices, MXFP4 experts) and the best such model
is kept. The decay phase trains the experts through fake MXFP4 quantisation (straight-through).
After every step each router's selection bias moves against its expert's load
(auxiliary-loss-free balancing, DeepSeek-V3).

Reproducibility: everything is seeded. With `--steps N` the run is fixed, so a rerun with the same
seed, torch version and thread count gives the same model. `--time-budget M` instead starts the
final decay when M minutes are nearly spent (the machine's speed picks N); the log records N, and
`--steps N` replays exactly that schedule. Thread nondeterminism: torch's CPU kernels
split reductions by thread count, so a different `--threads` (or another CPU's BLAS kernel) changes
the last bits of the gradients and, through training, the weights. The shipped model used one
thread (on a shared 2-core machine one thread is much faster than two fighting other jobs).

Writes into --out: the checkpoint (config.json, shards, index), train_log.json, loss_curve.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kimi_explore.analysis import learned

from .export import round_to_released, save
from .model import KimiK3, text_config

LN2 = math.log(2.0)


# one definition of the corpus, the split and the windows: the package's (the card and the tests use it)
corpus_bytes, split, windows = learned.pydoc_corpus, learned.split_corpus, learned.windows


@torch.no_grad()
def bits_per_byte(model: KimiK3, a: np.ndarray, T: int, batch: int = 32) -> float:
    """Mean next-byte cross-entropy in bits over windows of T bytes, each decoded from a fresh state."""
    model.eval()
    w = torch.from_numpy(windows(a, T).astype(np.int64))
    total, count = 0.0, 0
    for i in range(0, len(w), batch):
        b = w[i : i + batch]
        logits = model(b[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1), reduction="sum").item()
        count += b[:, 1:].numel()
    return total / count / LN2


@torch.no_grad()
def expert_loads(model: KimiK3, a: np.ndarray, T: int) -> list[list[int]]:
    """Tokens routed to each expert, per MoE layer, over the windows of `a`."""
    model.eval()
    w = torch.from_numpy(windows(a, T).astype(np.int64))
    loads = [torch.zeros(m.E, dtype=torch.int64) for m in model.moe_layers()]
    for i in range(0, len(w), 32):
        model(w[i : i + 32, :-1])
        for j, m in enumerate(model.moe_layers()):
            loads[j] += m.last_load
    return [x.tolist() for x in loads]


def exported_copy(model: KimiK3) -> KimiK3:
    m = copy.deepcopy(model)
    m.set_fake_quant(False)
    round_to_released(m)
    return m


def lr_at(step: int, decay_start: int | None, decay_steps: int, lr: float, warmup: int) -> float:
    """Warmup, constant, then a cosine decay to 10% over the last `decay_steps` (from `decay_start`)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if decay_start is None or step < decay_start:
        return lr
    t = min(1.0, (step - decay_start) / max(1, decay_steps))
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def plot_log(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = log["evals"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([e["step"] for e in log["train"]], [e["train_bpb_running"] for e in log["train"]], lw=0.8, alpha=0.6,
            label="train (running, with dropout)")
    ax.plot([e["step"] for e in ev], [e["train_bpb"] for e in ev], "o-", ms=3, label="train slice (exported weights)")
    ax.plot([e["step"] for e in ev], [e["val_bpb"] for e in ev], "o-", ms=3, label="validation (exported weights)")
    if log.get("decay_start") is not None:
        ax.axvline(log["decay_start"], color="gray", ls=":", label="LR decay + fake MXFP4 from here")
    best = log.get("best")
    if best:
        ax.axhline(best["val_bpb"], color="C2", ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_ylim(0, max(5.0, 0))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("tiny K3 on pydoc_data.topics")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--steps", type=int, default=None, help="total steps (reproducible); else --time-budget decides")
    p.add_argument("--time-budget", type=float, default=None,
                   help="minutes: start the final decay when the budget is nearly spent (the log records the step count "
                        "to pass as --steps for an exact rerun)")
    p.add_argument("--max-steps", type=int, default=20000)
    p.add_argument("--decay-steps", type=int, default=300, help="final LR decay (and fake-quant) phase")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--bias-rate", type=float, default=2e-3, help="router bias step per update (aux-loss-free)")
    p.add_argument("--no-qat", action="store_true", help="no fake MXFP4 in the decay phase")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--shards", type=int, default=3)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    train, val = split(corpus_bytes())
    train_slice = train[-len(val) // 4 :]  # a fixed train slice (a quarter of the validation length)
    tc = text_config(num_hidden_layers=args.layers, hidden_size=args.hidden)
    model = KimiK3(tc, dropout=args.dropout)
    decay, no_decay = [], []
    for n, prm in model.named_parameters():
        (decay if prm.ndim >= 2 and "res_proj" not in n and "embed" not in n else no_decay).append(prm)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    n_params = sum(prm.numel() for prm in model.parameters())
    if (args.steps is None) == (args.time_budget is None):
        p.error("give exactly one of --steps and --time-budget")
    decay_start = None if args.steps is None else max(0, args.steps - args.decay_steps)
    total = args.steps if args.steps is not None else args.max_steps
    log = {"args": vars(args), "text_config": tc, "params": n_params, "train_bytes": int(len(train)),
           "val_bytes": int(len(val)), "torch": torch.__version__, "threads": args.threads, "decay_start": decay_start,
           "train": [],
           "evals": [], "best": None}

    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience
        tqdm = None
    bar = tqdm(range(total), desc="train", dynamic_ncols=True) if tqdm else range(total)
    t0 = time.time()
    running, best_state = None, None
    print(f"tiny K3: {n_params:,} parameters, {len(train):,} train / {len(val):,} validation bytes")
    T, B = args.seq, args.batch
    for step in bar:
        spent = time.time() - t0
        if decay_start is None and spent > args.time_budget * 60 - args.decay_steps * spent / max(step, 1):
            decay_start = step  # the budget is nearly spent: decay from here (a rerun passes --steps)
            log["decay_start"] = step
        if decay_start is not None and step == decay_start and not args.no_qat:
            model.set_fake_quant(True)
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, decay_start, args.decay_steps, args.lr, args.warmup)
        starts = rng.integers(0, len(train) - T - 1, size=B)
        batch = torch.from_numpy(np.stack([train[s : s + T + 1] for s in starts]).astype(np.int64))
        model.train()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.update_router_bias(args.bias_rate)
        bpb = loss.item() / LN2
        running = bpb if running is None else 0.98 * running + 0.02 * bpb
        elapsed = time.time() - t0
        if tqdm:
            bar.set_postfix(loss=f"{bpb:.3f}", run=f"{running:.3f}", Bps=f"{(step + 1) * B * T / elapsed:.0f}")
        if step % 10 == 0:
            log["train"].append({"step": step, "train_bpb": bpb, "train_bpb_running": running, "seconds": elapsed})
        last = step == total - 1 or (decay_start is not None and step == decay_start + args.decay_steps - 1)
        if (step + 1) % args.eval_every == 0 or last:
            q = exported_copy(model)
            ev = {"step": step + 1, "seconds": time.time() - t0, "val_bpb": bits_per_byte(q, val, T),
                  "train_bpb": bits_per_byte(q, train_slice, T), "fake_quant": bool(model.moe_layers()[0].fake_quant)}
            log["evals"].append(ev)
            if log["best"] is None or ev["val_bpb"] < log["best"]["val_bpb"]:
                log["best"] = dict(ev)
                best_state = copy.deepcopy(q.state_dict())
            msg = f"step {ev['step']}: val {ev['val_bpb']:.4f} train {ev['train_bpb']:.4f} bits/byte ({ev['seconds']:.0f} s)"
            (bar.write if tqdm else print)(msg)
            (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
        if last:
            break
    log["steps"] = step + 1
    log["train_seconds"] = time.time() - t0
    # the quantisation loss: the final float model against its exported rounding
    log["final"] = {"val_bpb_float": bits_per_byte(model, val, T), "val_bpb_exported": log["evals"][-1]["val_bpb"],
                    "fake_quant": bool(model.moe_layers()[0].fake_quant)}

    best = KimiK3(tc)
    best.load_state_dict(best_state)
    best.eval()
    log["best"]["expert_loads_val"] = expert_loads(best, val, T)
    save(best, out, shards=args.shards)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    plot_log(log, out / "loss_curve.png")
    print(f"best: step {log['best']['step']} val {log['best']['val_bpb']:.4f} bits/byte; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
