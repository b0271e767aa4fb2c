"""`kimi-explore`: step a prompt through K3 one token at a time and print what it predicts.

    kimi-explore                                   the embedded tiny model, a default prompt
    kimi-explore --prompt "Hello" --top 5          text (needs the checkpoint's tokenizer)
    kimi-explore --ids 17,203,5 --checkpoint DIR   token ids on a checkpoint directory or Hub repo id
    kimi-explore report --prompt "Hello" --out DIR plots + a self-contained HTML page
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

DEFAULT_PROMPT = "Kimi K3, one token at a time."


def parse_layers(text: str | None):
    """'0-3' or '0:4' -> range(0, 4); '1,5,9' -> [1, 5, 9]; None -> None (all layers)."""
    if text is None:
        return None
    try:
        if "-" in text:
            a, b = text.split("-")
            return range(int(a), int(b) + 1)
        if ":" in text:
            a, b = text.split(":")
            return range(int(a), int(b))
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers {text!r}: expected '0-3', '0:4' or '1,5,9'") from None


def parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids {text!r}: expected comma-separated integers like 17,203,5") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kimi-explore",
        description="Feed a prompt through Kimi K3 one token at a time (exact NumPy/CuPy decoder) and print, per "
        "step, the top next-token predictions and the time the step took. Without --checkpoint it runs the tiny "
        "K3-shaped model embedded in the package (random weights, byte-level vocabulary).",
        epilog="Subcommand: 'kimi-explore report --help' writes plots and an offline HTML page for a prompt.",
    )
    p.add_argument("--checkpoint", help="checkpoint directory or Hugging Face repo id (default: the embedded tiny model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help=f"prompt text, encoded with the checkpoint's tokenizer (default: {DEFAULT_PROMPT!r})")
    src.add_argument("--ids", type=parse_ids, help="prompt as comma-separated token ids, e.g. 17,203,5")
    p.add_argument("--generate", type=int, default=0, metavar="N", help="then greedily generate N more tokens")
    p.add_argument("--top", type=int, default=5, metavar="K", help="how many next-token predictions to show (default 5)")
    p.add_argument("--layers", type=parse_layers, help="run only these 0-based layers, e.g. 0-3 (default: all)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"], help="array backend (default auto)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="compute dtype (default float32)")
    p.add_argument("--weight-dtype", choices=["bfloat16"], help="keep BF16 matrices as bf16 bits (half the memory)")
    p.add_argument("--experts", default="auto", choices=["auto", "packed", "dense"],
                   help="routed experts: MXFP4-packed or dequantised at load (default auto: dense when small)")
    p.add_argument("--expert-cache-size", type=int, metavar="N",
                   help="packed experts: dequantised experts kept per layer (0: none; on the CPU the fused kernel)")
    return p


def _tokenizer(path):
    from .tokenizer import load_tokenizer

    return load_tokenizer(path)


def _label(tok, i: int) -> str:
    return f"'{tok.token_label(i)}'" if tok is not None else str(i)  # labels are already escaped


def run(args) -> int:
    from . import KimiDecoderWeights, KimiDecodeState, kimi_forward_token
    from .backend import to_numpy
    from .weights.tiny_model import default_checkpoint

    path = args.checkpoint or default_checkpoint()
    t0 = time.perf_counter()
    weights = KimiDecoderWeights.from_pretrained(path, layers=args.layers, device=args.device, dtype=args.dtype,
                                                 weight_dtype=args.weight_dtype, experts=args.experts,
                                                 expert_cache_size=args.expert_cache_size)
    load_s = time.perf_counter() - t0
    cfg = weights.config
    tok = _tokenizer(weights.source) if args.ids is None else None
    ids = args.ids if args.ids is not None else tok.encode(args.prompt or DEFAULT_PROMPT)
    if not ids:
        print("kimi-explore: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    kinds = [cfg.layer_kind(i) for i in weights.layer_ids]
    n_kda = sum(k.startswith("kda") for k in kinds)
    n_moe = sum(k.endswith("moe") for k in kinds)
    print(f"kimi-explore: {weights.source}")
    print(f"  {len(kinds)} of {cfg.num_hidden_layers} layers ({n_kda} KDA, {len(kinds) - n_kda} MLA; "
          f"{len(kinds) - n_moe} dense, {n_moe} MoE with {cfg.num_experts} experts top-{cfg.num_experts_per_token}), "
          f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; {weights.device}, {np.dtype(weights.dtype).name}; "
          f"loaded in {load_s:.2f} s")
    banks = [layer.ffn.experts for layer in weights.layers if layer.ffn.kind == "moe"]
    if banks:
        print(f"  routed experts: {banks[0].route}")
    print(f"\n{'step':>4}  {'input':<14} {'ms':>7}   top-{args.top} next tokens (probability)")
    state = KimiDecodeState.new(weights)
    times = []
    feed = list(ids)
    step = 0
    while feed:
        t = feed.pop(0)
        t1 = time.perf_counter()
        logits = to_numpy(kimi_forward_token(weights, state, t))
        times.append((time.perf_counter() - t1) * 1e3)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[: args.top]
        preds = "  ".join(f"{_label(tok, int(i))} {p[i]:.3f}" for i in top)
        mark = "" if step < len(ids) else "+"
        print(f"{step:>4}{mark:1} {_label(tok, t):<14} {times[-1]:7.2f}   {preds}")
        step += 1
        if not feed and step < len(ids) + args.generate:
            feed.append(int(top[0]))
    print(f"\n{len(times)} tokens, median {np.median(times):.2f} ms/token "
          f"(first {times[0]:.2f} ms){'; + marks generated tokens' if args.generate else ''}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "report":
        from .views.report import main as report_main

        return report_main(argv[1:])
    args = _parser().parse_args(argv)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
