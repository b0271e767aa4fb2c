"""A weights file held open while it is mapped, and closing what a refused open opened.

`MappedFile` is what a safetensors file and a GGUF file share: the file the header was read from stays
open (unbuffered) until `close`, and the map and every read of its tensors go through it, not through
the path, which a writer may have replaced since (a re-download's `os.replace`: the new file's bytes
read at the old header's offsets). A header that is refused closes the file before the error leaves.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from ..errors import CheckpointError


@contextmanager
def closed_on_error(*opened):
    """Close each of `opened` (anything with `close()`, or a list of them, read when the block raises: a list
    filled inside the block) when the block raises, then re-raise.

    A constructor that opens files and then checks them keeps nothing open when a check refuses them
    (or a Ctrl-C arrives): `with closed_on_error(self): self._read()`."""
    try:
        yield
    except BaseException:
        for f in opened:
            for g in f if isinstance(f, list) else [f]:
                g.close()
        raise


class MappedFile:
    """One weights file: `path`, `file` (open until `close`) and `_map`, set by the subclass's `_read_header`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.file = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: no such file") from None
        with closed_on_error(self.file):
            self._read_header()

    def _read_header(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Drop this file's map; it is unmapped when the last view of it goes (views handed out stay valid).

        Not `mmap.close()`: NumPy holds no buffer export on the map, so closing it under a live view
        (experts="mapped" keeps them for the model's lifetime) unmaps the pages and the view segfaults.
        """
        self._map = None
        self.file.close()
