"""The .npz files kimi_explore writes (session states, traces, routing-stats checkpoints): written
atomically, read with errors that name the file and the entry.

Each file is a zip of .npy entries plus a JSON `header` entry whose `format` says what it is. Writing
goes to a temporary file beside the target, then `os.replace`: an interrupted save leaves the old
file (or none), never a partial one under the final name. Reading: a zip member carries a CRC-32,
checked as it is read, so a flipped or truncated byte fails the entry that holds it; every such
failure (and a missing entry, and a file that is no zip at all) is one ValueError naming the file
and the entry. The CRC is the zip's own, so an entry edited and written back (np.savez of the loaded
entries, one changed) passes it: every file also holds `digests`, a hash of each entry's dtype, shape and
bytes made when it was written, and an entry read that does not match its hash (or that it does not list), or an
entry it lists that the file no longer holds, is refused as changed after saving. Files written before digests
(and other programs' .npz) are read without.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
import zipfile
import zlib
from pathlib import Path

import numpy as np

__all__ = ["NpzReader", "npz_to_read", "read_npz_header", "with_npz_suffix", "write_atomically", "write_npz"]

# what NumPy / zipfile raise on a damaged or truncated archive or entry
_DAMAGE = (zipfile.BadZipFile, zlib.error, EOFError, ValueError)
DIGESTS = "digests"  # the entry holding {entry: digest(its array)} as JSON
_WRITES = itertools.count()  # numbers each write's temporary file (threads of a process may save to one path at once)


def digest(a) -> str:
    """A hash of an array's dtype, shape and bytes: what a file's `digests` hold for each of its entries."""
    a = np.asanyarray(a)
    h = hashlib.blake2b(f"{a.dtype.str}{a.shape}".encode(), digest_size=16)
    h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    return h.hexdigest()


def with_npz_suffix(path, what: str = "save") -> Path:
    """The name a state, trace or checkpoint file is saved under: `path`, `.npz` added if it has another suffix or
    none. A directory is refused (`what` names the caller): else the file would be `DIR.npz` beside it."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what}: {path} is a directory; give a file path, e.g. {path / 'out.npz'}")
    return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")


def npz_to_read(path) -> Path:
    """The file a load of `path` reads: `path`, or PATH.npz where `path` names no file (the name a save gave it)."""
    path = Path(path)
    if not path.exists() and path.suffix != ".npz" and with_npz_suffix(path).is_file():
        return with_npz_suffix(path)
    return path


def write_npz(path, arrays: dict, compressed: bool = True) -> Path:
    """Write {name: array} to `path` exactly as named (no suffix added), atomically, with their `digests`."""
    arrays = {k: np.asanyarray(v) for k, v in arrays.items() if k != DIGESTS}  # (a read file's: made again)
    arrays[DIGESTS] = np.array(json.dumps({k: digest(v) for k, v in arrays.items()}))

    def write(tmp):
        with open(tmp, "wb") as f:
            (np.savez_compressed if compressed else np.savez)(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
    return write_atomically(path, write)


def write_atomically(path, write) -> Path:
    """`write(tmp)` fills a temporary file beside `path`, then it is renamed to `path`: an interrupted write leaves
    the old file (or none), and a reader never sees part of one under the final name. What a user saves goes
    this way: npz files (states, traces, checkpoints), dumps, reports and their figures, snapshots."""
    given = Path(path)
    path = Path(os.path.realpath(given)) if given.is_symlink() else given  # (a link stays: written where it points)
    if not path.parent.is_dir():  # (else the error would name the temporary file)
        up = next((p for p in path.parents if p.exists()), None)
        if up is not None and not up.is_dir():  # (a file where a directory of the path should be)
            raise NotADirectoryError(f"{path}: {up} is a file, not a directory")
        raise FileNotFoundError(f"{path}: its directory {path.parent} does not exist")
    if path.is_dir():  # (else the error would name the temporary file, which os.replace cannot put over it)
        raise IsADirectoryError(f"{path} is a directory; give a file path, e.g. {path / 'out'}{path.suffix}")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_WRITES)}.tmp")  # (one per write)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return given


class NpzReader:
    """An open .npz (`with NpzReader(path, "session state") as z: z["logits"]`): entries read with errors
    that name the file and the entry."""

    def __init__(self, path, what: str):
        self.path, self.what = Path(path), what
        if not self.path.is_file():
            raise FileNotFoundError(f"{what} {self.path}: no such file" + (" (a directory)" if self.path.is_dir() else ""))
        try:
            z = np.load(self.path, allow_pickle=False)
        except _DAMAGE as e:
            raise ValueError(f"{self.path}: not a complete .npz archive, which a {what} file is (truncated or "
                             f"damaged? {type(e).__name__}: {e})") from None
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise ValueError(f"{self.path}: a single .npy array, not a {what} file (an .npz archive)")
        self._z = z
        self.files = [f for f in z.files if f != DIGESTS]
        self._kept: dict = {}  # entries read through `kept` (read once however often they are asked for)
        self._digests = None  # {entry: digest} (None: a file without them)
        if DIGESTS in z.files:
            try:
                raw = self._read(DIGESTS)
                self._digests = json.loads(str(raw)) if raw.dtype.kind == "U" and raw.ndim == 0 else None
            except ValueError:  # (the entry damaged, or not JSON)
                pass
            if not isinstance(self._digests, dict):
                z.close()
                raise ValueError(f"{self.path}: entry {DIGESTS!r} is not a JSON object of the entries' digests: the file "
                                 "is damaged")
            missing = [k for k in self._digests if k not in self.files]
            if missing:  # (else a reader that takes a missing entry for an older file's would read on without it)
                z.close()
                raise ValueError(f"{self.path}: entries {missing} were saved in this {what} file and are no longer in "
                                 f"it (it holds {self.files[:8]}{'...' if len(self.files) > 8 else ''}): the file was "
                                 "changed after it was saved")

    def __enter__(self) -> NpzReader:
        return self

    def __exit__(self, *exc) -> None:
        self._kept.clear()
        self._z.close()

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self.files:
            raise ValueError(f"{self.path}: no entry {key!r}, which this {self.what} file needs (damaged, or not "
                             f"written by kimi_explore; it holds {len(self.files)} entries)")
        a = self._read(key)
        if self._digests is not None and self._digests.get(key) != digest(a):
            raise ValueError(f"{self.path}: entry {key!r} is not what was saved ("
                             + ("the file's digests do not list it" if key not in self._digests else
                                "its bytes differ from the digest saved with it")
                             + f"): the {self.what} file was changed after it was saved")
        return a

    def _read(self, key: str) -> np.ndarray:
        try:
            a = self._z[key]
        except _DAMAGE as e:
            raise ValueError(f"{self.path}: entry {key!r} is damaged or truncated ({type(e).__name__}: {e})") from None
        if not isinstance(a, np.ndarray):  # (np.load gives a member without .npy framing as its raw bytes)
            raise ValueError(f"{self.path}: entry {key!r} is not an .npy array (found {type(a).__name__}): the file is "
                             f"damaged or not a {self.what} file")
        return a

    def kept(self, key: str) -> np.ndarray:
        """`self[key]`, read (and decompressed) once while the reader is open: an entry many others refer to."""
        if key not in self._kept:
            self._kept[key] = self[key]
        return self._kept[key]

    def header(self, fmt, required=()) -> dict:
        """The JSON header, checked to be a `what` in format `fmt` (or one of a tuple) with every `required` key."""
        return read_npz_header(self, self.path, fmt, self.what, required)


def read_npz_header(z, path, fmt, what: str, required=()) -> dict:
    """The JSON header of a kimi_explore .npz file, checked to be a `what` in format `fmt` (or one of a tuple)
    holding every key in `required` (all missing ones listed)."""
    if "header" not in z.files:
        raise ValueError(f"{path}: not a kimi_explore {what} (no 'header' entry; found {list(z.files)[:5]}...)")
    raw = z["header"]
    try:
        header = json.loads(str(raw)) if raw.dtype.kind == "U" and raw.ndim == 0 else None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: the {what}'s header is not valid JSON ({e}): the file is damaged") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the {what}'s header is not a JSON object (found {raw.dtype}{list(raw.shape)} "
                         f"{str(raw)[:40]!r}): not a kimi_explore {what}")
    reads = (fmt,) if isinstance(fmt, str) else tuple(fmt)
    if header.get("format") not in reads:
        raise ValueError(f"{path}: {what} format {header.get('format')!r}, this version reads "
                         f"{' or '.join(map(repr, reads))}")
    missing = [k for k in required if k not in header]
    if missing:
        raise ValueError(f"{path}: the {what}'s header lacks {missing} (found {sorted(header)}): the file is damaged")
    return header
