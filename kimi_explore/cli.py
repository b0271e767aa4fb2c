"""`kimi-explore`: step a prompt through K3 one token at a time and print what it predicts.

    kimi-explore                                   the embedded tiny model, a default prompt
    kimi-explore --prompt "Hello" --top 5          text (needs the checkpoint's tokenizer)
    kimi-explore --ids 17,203,5 --checkpoint DIR   token ids on a checkpoint directory or Hub repo id
    kimi-explore report --prompt "Hello" --out DIR plots + a self-contained HTML page (views/figures/report.py)
    kimi-explore make-tiny --out DIR               a random checkpoint at K3 depth (weights/k3_depth.py)

Errors are one line, `kimi-explore: error: ...`, with exit status 2 (argparse's convention);
`--debug` shows the traceback instead of an error found once the arguments are read (loading, checking the
ids against the model, decoding; a mistake in the arguments themselves stays one line). The arguments shared
with `report` (the model, the prompt, the backend) are defined once here, in `add_model_arguments`, and checked before anything is
decoded: a token id outside the vocabulary is reported before step 0, not after it. `parse_ids`
reads every comma-separated id list (--ids here, the Explorer's prompt field and expert lists).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_PROMPT = "Kimi K3, one token at a time."
RANDOM_NOTE = "tiny K3-shaped model, random weights: its predictions mean nothing; --checkpoint loads a real one"


class CliError(ValueError):
    """A mistake in the command line that only shows once the model is loaded (printed as one line)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, with its errors on one line (no usage block): `prog: error: ...`, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the arguments)\n")


class IdsError(ValueError, argparse.ArgumentTypeError):
    """Text that is not a list of token ids: a ValueError, and argparse shows its message as it is."""


def parse_ids(text: str, what: str = "token ids") -> list[int]:
    """'17, 203,5' -> [17, 203, 5] (the CLI's --ids, the Explorer's prompt field, expert lists).

    Names the first piece that is not an integer and what the field holds (`what`). Also an
    argparse `type=`: its IdsError is an ArgumentTypeError, so the message is shown as written.
    """
    ids, pieces = [], [piece.strip() for piece in text.split(",")]
    if pieces[-1] == "":  # "" or a trailing comma
        pieces.pop()
    for piece in pieces:
        if not piece:  # "17,,5": an id left out, not a separator typed twice
            raise IdsError(f"{what}: {text.strip()!r} has an empty piece between commas (expected comma-separated "
                           "integers like 17,203,5)")
        if not re.fullmatch(r"-?[0-9]+", piece):  # "17 203" is not 17203; "--5" and "²" are not integers either
            raise IdsError(f"{what}: {piece!r} is not an integer (expected comma-separated integers like 17,203,5)")
        ids.append(int(piece))
    return ids


def parse_layers(text: str | None):
    """'0-3' or '0:4' -> range(0, 4); '1,5,9' -> [1, 5, 9]; None -> None (all layers)."""
    if text is None:
        return None

    def number(x: str) -> int:  # ASCII digits only: int() takes any script's digits ('٣' is 3)
        if not re.fullmatch(r"\s*[0-9]+\s*", x):
            raise ValueError(x)
        return int(x)

    try:
        if "-" in text:
            a, b = (number(x) for x in text.split("-"))
            out = range(a, b + 1)
        elif ":" in text:
            a, b = (number(x) for x in text.split(":"))
            out = range(a, b)
        else:
            return [number(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected '0-3', '0:4' or '1,5,9'") from None
    sep = "-" if "-" in text else ":"
    if a > b:
        raise argparse.ArgumentTypeError(f"{text!r}: the range is reversed ({a} > {b}); did you mean {b}{sep}{a}?")
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: {a}:{b} selects no layer (it stops where it starts); "
                                         f"{a}:{a + 1} is layer {a}")
    return out


def _at_least(low: int):
    """An argparse `type=` for ints >= low."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {n}")
        return n

    return parse


def _prompt_text(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("the prompt is empty: give some text, or token ids with --ids")
    # a byte that is not UTF-8 reaches Python as a lone surrogate (U+DC80..U+DCFF, `surrogateescape`): encoded, it
    # would become U+FFFD's three bytes, not the byte typed
    bad = next((i for i, ch in enumerate(text) if "\udc80" <= ch <= "\udcff"), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"byte 0x{ord(text[bad]) - 0xDC00:02X} (character {bad} of the prompt) is not "
                                         "UTF-8 text; pass token ids with --ids")
    return text


def _checkpoint_text(text: str) -> str:
    if not text.strip():  # `--checkpoint "$DIR"` with DIR unset: not the embedded model in silence
        raise argparse.ArgumentTypeError("empty: give a checkpoint directory or Hub repo id "
                                         "(leave --checkpoint out for the embedded model)")
    return text


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model, prompt and backend arguments of `kimi-explore` and `kimi-explore report`."""
    p.add_argument("--checkpoint", type=_checkpoint_text,
                   help="checkpoint directory or Hugging Face repo id (default: the embedded tiny model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", type=_prompt_text,
                     help=f"prompt text, encoded with the checkpoint's tokenizer (default: {DEFAULT_PROMPT!r})")
    src.add_argument("--ids", type=parse_ids, help="prompt as comma-separated token ids, e.g. 17,203,5")
    p.add_argument("--generate", type=_at_least(0), default=0, metavar="N",
                   help="then greedily generate N more tokens (fewer where a K3 tokenizer's stop token, <|end_of_msg|>, "
                        "comes first)")
    p.add_argument("--top", type=_at_least(1), default=5, metavar="K", help="next-token predictions shown per step (default 5)")
    p.add_argument("--layers", type=parse_layers, help="run only these 0-based layers, e.g. 0-3 (default: all)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"], help="array backend (default auto)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="compute dtype (default float32)")
    p.add_argument("--weight-dtype", choices=["bfloat16"], help="keep BF16 matrices as bf16 bits (half the memory)")
    p.add_argument("--experts", default="auto", choices=["auto", "packed", "mapped", "dense"],
                   help="routed experts: MXFP4-packed, left mapped in the shard files, or dequantised at load "
                        "(default auto: dense when small)")
    p.add_argument("--expert-cache-size", type=_at_least(0), metavar="N",
                   help="packed experts: dequantised experts kept per layer (0: none; on the CPU the fused kernel); "
                        "with --experts auto it chooses packed")
    p.add_argument("--debug", action="store_true",
                   help="on an error once the arguments are read, show the Python traceback, not one line")


def load_model(args):
    """(weights, checkpoint path, seconds to load) for the parsed model arguments."""
    from .weights.load import load_weights as from_pretrained
    from .weights.tiny_model import tiny_checkpoint

    path = tiny_checkpoint() if args.checkpoint is None else args.checkpoint
    t0 = time.perf_counter()
    weights = from_pretrained(path, layers=args.layers, device=args.device, dtype=args.dtype,
                                                 weight_dtype=args.weight_dtype, experts=args.experts,
                                                 expert_cache_size=args.expert_cache_size)
    return weights, path, time.perf_counter() - t0


def prompt_tokenizer(args, weights):
    """The checkpoint's tokenizer; None where it has none and the prompt is --ids (a --prompt then says to pass them)."""
    from .tokenizer import TokenizerError, load_tokenizer

    try:
        return load_tokenizer(weights)
    except TokenizerError as e:
        if args.ids is None:
            what = "--prompt" if args.prompt is not None else f"the default prompt ({DEFAULT_PROMPT!r}, text)"
            raise TokenizerError(f"{what} needs the checkpoint's tokenizer: {e}. Pass --ids instead") from None
        return None


def prompt_ids(args, weights, tokenizer) -> list[int]:
    """The prompt as token ids (--ids, or --prompt / the default through `tokenizer`), checked against the vocabulary."""
    if args.ids is not None:
        ids = list(args.ids)
    elif tokenizer is None:
        raise CliError(f"--prompt needs the checkpoint's tokenizer and {weights.source} has none; pass --ids instead")
    else:
        ids = tokenizer.encode(args.prompt or DEFAULT_PROMPT)
    if not ids:
        raise CliError("--ids is empty: give at least one token id" if args.ids is not None
                       else "the prompt is empty: it encodes to no tokens")
    V = weights.config.vocab_size
    bad = [i for i in ids if not 0 <= i < V]
    if bad:
        raise CliError(f"--ids: {', '.join(map(str, bad[:5]))} outside the vocabulary of {weights.source}: "
                       f"expected ids in 0..{V - 1}")
    return ids


def model_note(path) -> str:
    """What to say about the weights: random ones (the tests' fixture, `make-tiny`, copies of them: their
    model_card.json says so) mean nothing; a trained tiny model says what it is."""
    from .weights.tiny_model import describe_checkpoint, random_weights

    if random_weights(path):
        return RANDOM_NOTE
    return describe_checkpoint(path) if (Path(path) / "model_card.json").exists() else ""


def _label(tok, i: int) -> str:
    return f"'{tok.token_label(i)}'" if tok is not None else str(i)  # labels are already escaped


def run(args) -> int:
    from . import KimiDecodeState, kimi_forward_token
    from .backend import to_numpy
    from .inspection.session import refuse_unchoosable
    from .model.latent_moe import LatentMoeWeights

    weights, path, load_s = load_model(args)
    cfg = weights.config
    checkpoint_tok = prompt_tokenizer(args, weights)  # with --ids: the checkpoint's where it has one, else None
    tok = checkpoint_tok if args.ids is None else None  # --ids: the prompt, predictions and generated tokens as ids
    ids = prompt_ids(args, weights, tok)
    kinds = [cfg.layer_kind(i) for i in weights.layer_ids]
    n_kda = sum(k.startswith("kda") for k in kinds)
    n_moe = sum(k.endswith("moe") for k in kinds)
    note = model_note(path)
    print(f"kimi-explore: {weights.source}" + (f" ({note})" if note else ""))
    print(f"  {len(kinds)} of {cfg.num_hidden_layers} layers ({n_kda} KDA, {len(kinds) - n_kda} MLA; "
          f"{len(kinds) - n_moe} dense, {n_moe} MoE with {cfg.num_experts} experts top-{cfg.num_experts_per_token}), "
          f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; {weights.device}, {np.dtype(weights.dtype).name}; "
          f"loaded in {load_s:.2f} s")
    banks = [layer.ffn.experts for layer in weights.layers if isinstance(layer.ffn, LatentMoeWeights)]
    if banks:
        print(f"  routed experts: {banks[0].route}")
    print(f"\n{'step':>4}  {'input':<14} {'ms':>7}   top-{args.top} next tokens (probability)")
    state = KimiDecodeState.new(weights)
    times = []
    history = list(ids)  # the prompt, then each generated token
    stop = getattr(checkpoint_tok, "eos_id", None)  # a K3 tokenizer's stop token (<|end_of_msg|>) ends the generation,
    # as in chat and in `report` (with --ids too)
    step = 0
    while step < len(history):
        t = history[step]
        t1 = time.perf_counter()
        logits = to_numpy(kimi_forward_token(weights, state, t))
        times.append((time.perf_counter() - t1) * 1e3)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-logits, kind="stable")[: args.top]  # top[0] is argmax: Session.generate's greedy token
        preds = "  ".join(f"{_label(tok, int(i))} {p[i]:.3f}" for i in top)
        mark = "" if step < len(ids) else "+"
        print(f"{step:>4}{mark:1} {_label(tok, t):<14} {times[-1]:7.2f}   {preds}")
        step += 1
        stopped = stop is not None and len(history) > len(ids) and history[-1] == stop
        if step == len(history) and step < len(ids) + args.generate and not stopped:
            refuse_unchoosable(logits, step - 1, "kimi-explore --generate")
            history.append(int(top[0]))
    print(f"\n{len(times)} tokens, median {np.median(times):.2f} ms/token "
          f"(first {times[0]:.2f} ms){'; + marks generated tokens' if args.generate else ''}")
    if args.generate:
        print(generated_line(history, len(ids), tok))
        if len(history) < len(ids) + args.generate:
            print(f"stopped at the stop token {_label(tok, stop)} after {len(history) - len(ids)} of {args.generate}")
    return 0


def generated_line(history: list[int], n_prompt: int, tok) -> str:
    """The generated tokens as one string after the table: decoded together (a character split over
    several byte tokens comes out whole), or as an --ids list when the ids were given without text."""
    new = history[n_prompt:]
    if tok is None:
        return f"generated ids ({len(new)} after the prompt): {','.join(map(str, new))}"
    return f"generated text ({len(new)} tokens after the prompt): {tok.decode(new)!r}"


def guarded(prog: str, fn, args) -> int:
    """fn(args) with every error as one line on stderr and exit status 2 (the traceback with --debug)."""
    try:
        return fn(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as a process the pipe's signal ends
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (else Python's exit flush raises again)
        return 141
    except Exception as e:  # noqa: BLE001 - the command line's boundary: a person reads this, --debug shows the rest
        from .errors import BackendError

        if getattr(args, "debug", False):
            raise
        msg = "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or "(no message)"
        if not isinstance(e, (ValueError, OSError, BackendError)):  # not a bad input: say what it is and how to see more
            msg = f"{type(e).__name__}: {msg} (--debug shows the traceback)"
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="kimi-explore",
        description="Feed a prompt through Kimi K3 one token at a time (exact NumPy/CuPy decoder) and print, per "
        "step, the top next-token predictions and the time the step took. Without --checkpoint it runs the tiny "
        "K3 embedded in the package (trained on Python's pydoc_data.topics, byte-level vocabulary).",
        epilog="Subcommands: 'kimi-explore report --help' writes plots and an offline HTML page for a prompt; "
        "'kimi-explore make-tiny --help' writes a random K3-depth checkpoint (93 layers, 896 experts) to try the views.",
    )
    add_model_arguments(p)
    return p


def _report_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="kimi-explore report",
                       description="Run a prompt through K3 one token at a time and write every plot as a PNG "
                       "plus one self-contained HTML page (no network, no CDN).")
    add_model_arguments(p)
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument("--title", default="Kimi K3, token by token", help="page title")
    return p


def run_report(args) -> int:
    """`kimi-explore report`: decode the prompt in a recorded Session, then `views.figures.report.write_report`."""
    from .inspection.recorder import Recorder
    from .inspection.session import Session
    from .views.figures.report import write_report

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise CliError(f"--out {args.out}: exists and is not a directory; name a directory (created if missing)")
    weights, path, _ = load_model(args)
    tokenizer = prompt_tokenizer(args, weights)
    ids = prompt_ids(args, weights, tokenizer)
    session = Session(weights, recorder=Recorder(top_k=max(10, args.top)), tokenizer=tokenizer)
    session.feed(ids)
    if args.generate:
        stop = getattr(tokenizer, "eos_id", None)
        session.generate(args.generate, stop_tokens=() if stop is None else (stop,))
    note = model_note(path)
    page = write_report(session, args.out, title=args.title, source=f"{path} ({note})" if note else path, top=args.top)
    print(f"wrote {page} (open it in any browser, offline) and its figures as PNGs in {page.parent}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "report":
        return guarded("kimi-explore report", run_report, _report_parser().parse_args(argv[1:]))
    if argv and argv[0] == "make-tiny":
        from .weights.k3_depth import main as make_tiny_main

        return guarded("kimi-explore make-tiny", lambda a: make_tiny_main(a, parser_class=ArgumentParser), argv[1:])
    args = _parser().parse_args(argv)
    return guarded("kimi-explore", run, args)


if __name__ == "__main__":
    raise SystemExit(main())
