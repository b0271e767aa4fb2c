"""The engine dump format: what another K3 engine computed, in a file any language can write.

One safetensors file (https://github.com/huggingface/safetensors: an 8-byte header length, a JSON
header, raw little-endian arrays; writers exist for Python, Rust, C, C++, Go, JS):

- keys: `kimi_explore` hook names (`ke.hook_names(weights)`: "embed", "layers.3.kda.state",
  "layers.5.moe.router.topk_ids", "final.hidden", "logits", ...). Any subset; the more sites, the
  closer `ke.compare` can place a divergence.
- arrays: `[T, ...]`, one row per token, in the site's per-token shape as the hook sees it
  (`layers.i.kda.state` [T, H, K, V], `layers.i.moe.router.topk_ids` [T, k], ...). `mla.probs`, whose
  width grows with the position, is stored `[T, nh, T]`, row t holding positions 0..t and zeros after
  (NaN there, a Trace's padding, reads as those zeros). An engine that captured only its last tokens
  (the decode after a prompt it did not capture) writes `[T - start, ...]`, row i for position start + i
  (`mla.probs` [T - start, nh, T]), and says `start`.
  float32, float16, bfloat16 or float64 (read back as float32/float64); integer ids int32/int64 (the
  safetensors types `weights.safetensors_io.DTYPES` reads: also int8, int16, uint8, bool; no float8, no
  uint16..64, which `write_dump` refuses rather than write a file `read_dump` cannot open).
- metadata (`__metadata__`, strings): `format` = "kimi_explore.dump/1", `tokens` = the T token ids,
  comma-separated, ASCII digits only ("1_0" and full-width digits are refused, not read as 10),
  `engine` = a free-form name ("llama.cpp 0c1e57098", "my-rust-engine 0.3"),
  `dtype` = the engine's activation dtype, one of `TOLERANCE_PRESETS` ("float32", "bfloat16",
  "float16", "quantised"): `ke.compare` picks its tolerance from it; optional `prefill` = how many of the
  first tokens the engine ran as one prefill (all T for a prefill; "0": a decode, token by token; absent: not
  said, a decode unless the arrays are llama.cpp captures that show a prefill): `ke.compare` replays those on
  the sequence path; optional `start` = the position of the first captured token (absent: 0; `tokens` still
  lists every id from position 0: `ke.compare` runs the uncaptured ones to build the state the captured ones
  read).

From NumPy (see the README for the whole example):

    from safetensors.numpy import save_file
    save_file({"layers.0.attn.in": x0, "logits": logits}, "dump.safetensors",
              metadata={"format": "kimi_explore.dump/1", "tokens": "72,105,33", "engine": "mine", "dtype": "float32"})
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..inspection.npz_io import write_atomically
from ..inspection.targets import int_in
from .tolerance import TOLERANCE_PRESETS

__all__ = ["DUMP_FORMAT", "Dump", "read_dump", "token_ids", "write_dump"]

DUMP_FORMAT = "kimi_explore.dump/1"
_TOKEN = re.compile(r"-?[0-9]+", re.ASCII)  # what a token id in metadata 'tokens' may be (int() also takes "1_0", "１")


@dataclass
class Dump:
    """A read dump: `arrays` {hook name: [T - start, ...]}, `tokens` [T] ids, `engine`, `dtype`, `prefill` (the first
    tokens run as one prefill; 0: a decode; None: the dump does not say, and `compare` takes a decode unless llama.cpp
    captures under their own names show a prefill), `start` (the position of the arrays' first row)."""

    arrays: dict
    tokens: list
    engine: str = ""
    dtype: str = "float32"
    path: str | None = field(default=None, repr=False)
    prefill: int | None = None
    start: int = 0

    def __repr__(self) -> str:
        return (f"Dump(engine={self.engine!r}, dtype={self.dtype!r}, tokens={len(self.tokens)}, sites={len(self.arrays)}"
                + (f", prefill={self.prefill}" if self.prefill is not None else "")
                + (f", start={self.start})" if self.start else ")"))


def write_dump(path, arrays, *, tokens, engine: str = "", dtype: str = "float32", prefill: int | None = None,
               start: int = 0) -> Path:
    """Write {hook name: [T - start, ...] array} with the T token ids, the engine's name, its activation dtype, how many
    of the first tokens it ran as one prefill (0: a decode; None: not said, no metadata 'prefill') and the position of
    the arrays' first row (`start`: the tokens before it ran uncaptured; written where > 0)."""
    from safetensors.numpy import save_file

    tokens = token_ids(tokens, "write_dump: tokens")
    if prefill is not None:
        prefill = int_in(prefill, 0, len(tokens), "write_dump: prefill", " (the first tokens the engine ran as one prefill)")
    _check_dtype(dtype, "write_dump(dtype=...)")
    start = int_in(start, 0, max(len(tokens) - 1, 0), "write_dump: start", " (the position of the first captured token)")
    T = len(tokens) - start
    out = {}
    for name, a in arrays.items():
        a = np.asarray(_to_host(a))
        if a.ndim == 0:  # (before np.ascontiguousarray, which makes a 0-d value [1])
            raise ValueError(f"write_dump: {name!r} is a scalar (shape ()); expected [T, ...] with T = {T} (one row per "
                             f"{'captured ' if start else ''}token)")
        a = np.ascontiguousarray(a)
        if not a.dtype.isnative:  # a big-endian '>f4' is float32 to write
            a = a.astype(a.dtype.newbyteorder("="))
        if a.shape[0] != T:
            fits = 0 < a.shape[0] < len(tokens)  # rows of the last a.shape[0] tokens
            raise ValueError(f"write_dump: {name!r} has shape {a.shape}; expected [T, ...] with T = {T} (one row per token"
                             + (f" from position start = {start} of the {len(tokens)} ids" if start else "") + ")"
                             + (f"; rows of the last {a.shape[0]} tokens only: start={len(tokens) - a.shape[0]}"
                                if fits and len(tokens) - a.shape[0] != start else ""))
        if a.dtype not in _readable():  # complex, text, float8, uint16..64: nothing read_dump opens
            raise ValueError(f"write_dump: {name!r} is {a.dtype.name}; expected a float array (float32, float16, bfloat16, "
                             "float64) or integer ids (int32, int64; also int8, int16, uint8, bool), the types read_dump "
                             "reads back: convert it first, e.g. "
                             + ("a.astype(np.int64)" if a.dtype.kind in "ui" else "a.astype(np.float32)"))
        out[str(name)] = a
    metadata = {"format": DUMP_FORMAT, "tokens": ",".join(map(str, tokens)), "engine": str(engine), "dtype": dtype}
    if prefill is not None:
        metadata["prefill"] = str(prefill)
    if start:
        metadata["start"] = str(start)
    return write_atomically(path, lambda tmp: save_file(out, str(tmp), metadata=metadata))  # never half a dump


def read_dump(path, start: int | None = None) -> Dump:
    """Read a dump written by `write_dump` (or by any engine following the format above). start: the position of the
    arrays' first row where the metadata does not say (a file written without 'start'); one that says another is
    refused."""
    import ml_dtypes  # noqa: F401  (lets safetensors hand bfloat16 arrays to NumPy)
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"engine dump {path}: no such file" + (" (a directory)" if path.is_dir() else ""))
    from ..errors import CheckpointError
    from ..weights.safetensors_io import SafetensorsFile

    try:  # the header checked first: safetensors' own error names no file ("header too large" for an .npz)
        SafetensorsFile(path).close()
    except CheckpointError as e:
        raise ValueError(f"engine dump: {e} (a dump is one safetensors file: ke.write_dump writes one; a .npz of "
                         "captures is read by ke.compare directly)") from None
    try:
        return _read(path, safe_open, start)
    except SafetensorError as e:  # what our header check leaves to the library (overlapping data, ...): name the file
        raise ValueError(f"engine dump {path}: not a valid safetensors file ({e})") from None


def _read(path: Path, safe_open, given: int | None) -> Dump:
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
        missing = [k for k in ("format", "tokens") if k not in meta]
        if missing:
            raise ValueError(f"engine dump {path}: metadata lacks {missing} (found keys {sorted(meta)}); "
                             f"a dump carries format={DUMP_FORMAT!r}, tokens='1,2,3', engine, dtype")
        if meta["format"] != DUMP_FORMAT:
            raise ValueError(f"engine dump {path}: format {meta['format']!r}, expected {DUMP_FORMAT!r}")
        pieces = [t.strip(" \t\r\n") for t in meta["tokens"].split(",")]  # "3, 17, 200" (a join(", ")), a newline
        if pieces and not pieces[-1]:  # "1,2,3," (a trailing comma) and "" (no tokens)
            pieces.pop()
        # ASCII digits only: int() reads "1_0" as 10 and full-width digits as digits. Refused too: an empty piece
        # ("1,,2": an id left out) and a negative id
        if not all(_TOKEN.fullmatch(t) and not t.startswith("-") for t in pieces):
            raise ValueError(f"engine dump {path}: metadata 'tokens' must be comma-separated ids >= 0, "
                             f"found {meta['tokens'][:80]!r} (each id in ASCII digits, spaces around it allowed)")
        tokens = [int(t) for t in pieces]
        dtype = meta.get("dtype", "float32")
        _check_dtype(dtype, f"engine dump {path}: metadata 'dtype'")
        prefill = meta.get("prefill")
        if prefill is not None and not (_TOKEN.fullmatch(p := prefill.strip(" \t\r\n")) and not p.startswith("-")
                                        and int(p) <= len(tokens)):
            raise ValueError(f"engine dump {path}: metadata 'prefill' must be a number of tokens 0..{len(tokens)} (the "
                             f"first tokens the engine ran as one prefill), found {meta['prefill'][:40]!r}")
        last = max(len(tokens) - 1, 0)
        if given is not None:
            given = int_in(given, 0, last, f"engine dump {path}: start", " (the position of the first captured token)")
        start = meta.get("start", "0" if given is None else str(given))
        if not (_TOKEN.fullmatch(q := start.strip(" \t\r\n")) and not q.startswith("-") and int(q) <= last):
            raise ValueError(f"engine dump {path}: metadata 'start' must be a position 0..{last} (where the captured "
                             f"tokens begin), found {meta['start'][:40]!r}")
        start = int(q)
        if given is not None and given != start:
            raise ValueError(f"engine dump {path}: start={given} given, but its metadata 'start' says {start}")
        arrays = {}
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            a = f.get_tensor(name)
            if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
                a = a.astype(np.float64 if a.dtype == np.float64 else np.float32)
            if a.ndim == 0 or a.shape[0] != len(tokens) - start:
                hint = (f"; rows of the last {a.shape[0]} tokens only: metadata 'start' = '{len(tokens) - a.shape[0]}' (or "
                        f"compare(..., start={len(tokens) - a.shape[0]}))" if a.ndim and 0 < a.shape[0] < len(tokens)
                        and "start" not in meta and given is None else "")
                raise ValueError(f"engine dump {path}: {name!r} has shape {a.shape}; expected [T, ...] with T = "
                                 f"{len(tokens) - start} (the number of ids in metadata 'tokens'"
                                 + (f" from position start = {start})" if start else ")") + hint)
            arrays[name] = a
    return Dump(arrays, tokens, meta.get("engine", ""), dtype, str(path), None if prefill is None else int(prefill), start)


def token_ids(tokens, what: str) -> list[int]:
    """The token ids in `tokens` (a 1-D array-like) as ints; refused unless integers >= 0: int(1.7) == 1 and
    True == 1 would name another token, and a negative id is written but not read back; refused unless 1-D:
    [[1, 2], [3, 4]] flattened would be 4 tokens of one text."""
    if np.ndim(tokens) != 1:
        raise ValueError(f"{what} have shape {np.shape(tokens)}; expected a 1-D sequence of T token ids")
    ids = np.asarray(tokens)
    if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0):
        shown = f"{ids[:5].tolist()}{' ...' if ids.size > 5 else ''}"
        raise ValueError(f"{what} are {ids.dtype} {shown}; expected token ids (integers >= 0)")
    return [int(t) for t in ids]


def _check_dtype(dtype, what: str) -> None:
    if dtype not in TOLERANCE_PRESETS:
        raise ValueError(f"{what}: {dtype!r} is not an activation dtype this format knows; "
                         f"expected one of {sorted(TOLERANCE_PRESETS)}")


def _readable() -> tuple:
    """The array dtypes `read_dump` reads back: those of `weights.safetensors_io` (the header check it runs first)."""
    from ..weights.safetensors_io import DTYPES

    return tuple(DTYPES.values())


def _to_host(a):
    get = getattr(a, "get", None)
    return np.asarray(a if get is None or isinstance(a, np.ndarray) else get())
