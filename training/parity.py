"""Trainer vs package on an exported checkpoint: the trainer's prefill logits and `kimi_explore`'s
byte-by-byte decode must agree (max |diff| <= 1e-3). Writes the bytes and the trainer's logits as a
small .npz, so CI checks the package against the trainer without torch.

    python -m training.parity --checkpoint kimi_explore/data/tiny_k3_pydoc --npz tests/data/trained_tiny_logits.npz
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from .export import load_exported
from .train_tiny import corpus_bytes, split


def parity_bytes(n: int = 256) -> np.ndarray:
    """The first n bytes of the validation split."""
    return split(corpus_bytes())[1][:n].copy()


def trainer_logits(checkpoint, ids: np.ndarray) -> np.ndarray:
    model = load_exported(checkpoint)
    with torch.no_grad():
        return model(torch.from_numpy(ids.astype(np.int64))[None])[0].numpy()


def package_logits(checkpoint, ids: np.ndarray) -> np.ndarray:
    import kimi_explore as ke

    w = ke.from_pretrained(str(checkpoint))
    state = ke.KimiDecodeState.new(w)
    return np.stack([np.asarray(ke.kimi_forward_token(w, state, int(t))) for t in ids])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--npz", default=None)
    p.add_argument("--n", type=int, default=256)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    ids = parity_bytes(args.n)
    a = trainer_logits(args.checkpoint, ids)
    b = package_logits(args.checkpoint, ids)
    diff = float(np.abs(a - b).max())
    print(f"max |trainer - kimi_explore| over {len(ids)} bytes: {diff:.3g} (logit scale {np.abs(a).max():.3g})")
    if args.npz:
        Path(args.npz).parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(args.npz, ids=ids.astype(np.uint8), logits=a.astype(np.float32))
        print(f"wrote {args.npz}")
    return 0 if diff <= 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
