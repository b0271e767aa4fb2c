"""Text <-> token ids: a byte tokenizer for the tiny models and the released K3 tokenizer.

    tok = load_tokenizer(checkpoint_dir)   # KimiTokenizer if tiktoken.model is there, else ByteTokenizer
    ids = tok.encode("Hello")              # list[int]
    tok.decode(ids), tok.token_label(ids[0]), tok.vocab_size, tok.eos_id

ByteTokenizer: vocabulary 256, id = byte value of the UTF-8 encoding; no special tokens.

KimiTokenizer reproduces the release's `TikTokenTokenizer` (HF `moonshotai/Kimi-K3` at 9f62e4e9,
`tokenization_kimi.py`) with plain tiktoken, an optional extra:
- `tiktoken.model`: one `<base64 bytes> <rank>` line per BPE token, ranks 0..n-1 = ids (n = 163,584).
  We parse it ourselves: tiktoken's `load_tiktoken_bpe` caches by the *path string* and would
  return a stale copy after the file at that path changed.
- ids n..n+255 are all special: named from `tokenizer_config.json: added_tokens_decoder`, the gaps
  `<|reserved_token_{id}|>` (absolute id in the name).
- PAT_STR below is data copied verbatim; it needs class intersection (`&&`), so Python's `re`
  cannot run it (the `regex` package can, with `regex.V1`).
- Traps: tiktoken's default `encode` raises on any special spelling, `[BOS]` included, so we always
  pass one of the release's two modes. The stop token is `<|end_of_msg|>` (config.json
  `eos_token_id` = 163586), NOT tokenizer_config's `eos_token` `[EOS]` (163585). No `[BOS]` is ever
  prepended. Long inputs are cut before BPE (`split_for_encoding`), which changes ids.

The release's chat prompt is rendered in `chat_template.py`; `KimiTokenizer.encode_chat` encodes
it segment by segment, as the release does.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import operator
import re
from pathlib import Path

from .chat_template import chat_segments, render_chat
from .errors import DuplicateKeyError, unique_keys

__all__ = [
    "PAT_STR",
    "ByteTokenizer",
    "KimiTokenizer",
    "TokenizerError",
    "load_tokenizer",
    "split_for_encoding",
]

PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

NUM_SPECIAL = 256                 # ids n..n+255, n = number of BPE ranks
MAX_ENCODE_CHARS = 400_000        # release: TIKTOKEN_MAX_ENCODE_CHARS
MAX_RUN_CHARS = 25_000            # release: MAX_NO_WHITESPACES_CHARS (same-class run cap)
STOP_TOKEN = "<|end_of_msg|>"
RELEASE_VOCAB_SHA256 = "b6c497a7469b33ced9c38afb1ad6e47f03f5e5dc05f15930799210ec050c5103"
RELEASE_NUM_RANKS = 163_584       # the released tiktoken.model's rank count
VOCAB_FILE, TOKENIZER_CONFIG = "tiktoken.model", "tokenizer_config.json"


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed, or an id/name is not in the vocabulary."""


_BYTE_LABEL = re.compile(r"<0x[0-9A-F]{2}>")  # what a broken byte's label reads
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}  # a backslash doubled: the text \n is not a newline


def _label_bytes(raw: bytes) -> str:
    """Readable label: printable text as itself, \\n/\\t/\\r, a backslash as \\\\, other controls as \\xNN, broken
    UTF-8 as <0xNN> (text that reads <0xNN> itself has its `<` as \\x3c: the two never share a label)."""
    out = []
    text = raw.decode("utf-8", errors="surrogateescape")   # undecodable bytes -> U+DC80..U+DCFF
    for i, ch in enumerate(text):
        c = ord(ch)
        if ch == "<" and _BYTE_LABEL.match(text, i):
            out.append("\\x3c")
        elif 0xDC80 <= c <= 0xDCFF:
            out.append(f"<0x{c - 0xDC00:02X}>")
        elif ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif not ch.isprintable() and ch != " ":
            out.append(f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" if c < 0x10000 else f"\\U{c:08x}")
        else:
            out.append(ch)
    return "".join(out)


def _as_ids(ids, vocab_size: int) -> list[int]:
    """Plain ints from any int sequence (lists, NumPy arrays), each checked against the vocabulary.
    Floats, bools and strings are refused: int(1.7) == 1 would silently name another token."""
    if isinstance(ids, (str, bytes, bytearray)) or not hasattr(ids, "__iter__") or getattr(ids, "ndim", 1) == 0:
        # (a bare id, or a 0-d array: list(5) says nothing of ids)
        raise TokenizerError(f"ids: expected a sequence of token ids (one id: [id]), found {type(ids).__name__} {ids!r:.40}")
    ids = list(ids)

    def not_int(i) -> bool:
        if isinstance(i, bool):
            return True
        try:
            operator.index(i)
        except TypeError:
            return True
        return False

    wrong = [i for i in ids if not_int(i)]
    if wrong:
        raise TokenizerError(f"ids: expected integers, found {wrong[:5]!r} "
                             f"({', '.join(sorted({type(i).__name__ for i in wrong}))})")
    out = [operator.index(i) for i in ids]
    bad = [i for i in out if not 0 <= i < vocab_size]
    if bad:
        raise TokenizerError(f"ids: expected values in 0..{vocab_size - 1}, found {bad[:5]}")
    return out


def _check_text(text) -> None:
    """`encode` takes text: bytes (already encoded) or None would otherwise fail deep inside with another error."""
    if not isinstance(text, str):
        hint = " (bytes: decode them first, e.g. data.decode('utf-8'))" if isinstance(text, (bytes, bytearray)) else ""
        raise TypeError(f"encode: expected a str, found {type(text).__name__}{hint}")


class ByteTokenizer:
    """The tiny models' tokenizer: id = byte value of the UTF-8 encoding (vocabulary 256, no specials)."""

    vocab_size = 256
    bos_id = None
    eos_id = None

    @property
    def special_tokens(self) -> dict[str, int]:
        return {}

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """`allow_special` is accepted for symmetry with KimiTokenizer; there are no special tokens. A lone
        surrogate (not text UTF-8 can hold) becomes U+FFFD, as KimiTokenizer's tiktoken makes it."""
        _check_text(text)
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError:  # a pair written as two surrogates joins; a lone one is replaced
            return list(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8"))

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids) -> bytes:
        return bytes(_as_ids(ids, 256))

    def token_label(self, token_id: int) -> str:
        """`a`, ` `, `\\n`, `\\x07`, `<0xE4>` (a byte that is not ASCII is never text on its own)."""
        return _label_bytes(bytes(_as_ids([token_id], 256)))

    def special_id(self, name: str) -> int:
        raise TokenizerError(f"special token {name!r}: the byte tokenizer has no special tokens")

    @property
    def fingerprint(self) -> str:
        """Which tokenizer this is, as a session file records it (`Session.load_state` compares)."""
        return "bytes/256"

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


def split_for_encoding(text: str, window: int = MAX_ENCODE_CHARS, max_run: int = MAX_RUN_CHARS) -> list[str]:
    """The release's pre-BPE cut: `window`-char windows, then a new piece inside a window whenever a
    run of same-class characters (`str.isspace()` vs not) would exceed `max_run`. BPE never merges
    across a cut, so this is part of the wire format. `re`'s `\\s` is `str.isspace()` on str patterns,
    so runs are found with a regex instead of a Python loop over every character."""
    pieces = []
    for w in range(0, len(text), window):
        win, start = text[w:w + window], 0
        for run in re.finditer(r"\s+|\S+", win):
            for cut in range(run.start() + max_run, run.end(), max_run):
                pieces.append(win[start:cut])
                start = cut
        pieces.append(win[start:])
    return pieces


def _import_tiktoken():
    try:
        import tiktoken
    except ImportError as e:
        raise ImportError(
            "KimiTokenizer needs tiktoken, an optional extra: pip install 'kimi-explore[tokenizer]' "
            f"(or pip install tiktoken). Import failed: {e}"
        ) from e
    return tiktoken


def read_tiktoken_model(path: str | Path) -> dict[bytes, int]:
    """Parse a `tiktoken.model` file: `<base64> <rank>` per line; ranks must be exactly 0..n-1."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    last = (0, None)  # (line, rank) of the last token read
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            try:
                token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
                if len(fields) != 2:
                    raise ValueError
            except (ValueError, IndexError, binascii.Error):
                cut = "" if line.endswith(b"\n") else " (the last line, with no newline: is the file truncated?)"
                raise TokenizerError(f"{path}:{lineno}: expected '<base64 bytes> <rank>', found {line[:80]!r}{cut}") from None
            if token in ranks:
                raise TokenizerError(f"{path}:{lineno}: token {token!r} repeated (first with rank {ranks[token]})")
            ranks[token] = rank
            last = (lineno, rank)
    values = sorted(ranks.values())
    if values != list(range(len(ranks))):
        n = len(ranks)
        missing = sorted(set(range(n)) - set(values))
        repeated = sorted({a for a, b in zip(values, values[1:], strict=False) if a == b})
        found = ", ".join(f"{what} {v[:5]}{' ...' if len(v) > 5 else ''}"
                          for what, v in (("missing", missing), ("repeated", repeated)) if v)
        raise TokenizerError(f"{path}: ranks must be exactly 0..{n - 1} (they are the token ids); found {found}; its last "
                             f"line ({last[0]}) has rank {last[1]}: is the file truncated or damaged?")
    # byte-level BPE starts from single bytes: one without a rank cannot be encoded (tiktoken panics on it)
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    longer = sorted((r, t) for t, r in ranks.items() if r < 256 and len(t) != 1)
    if missing or longer:
        found = (f"{'byte' if len(missing) == 1 else 'bytes'} {', '.join(f'0x{b:02X}' for b in missing[:5])}"
                 f"{' ...' if len(missing) > 5 else ''} {'has' if len(missing) == 1 else 'have'} no rank"
                 if missing else f"rank {longer[0][0]} is {longer[0][1]!r}")
        raise TokenizerError(f"{path}: the first 256 ranks must be the 256 single bytes (the BPE starts from them); {found}: "
                             "the file is damaged or not a byte-level BPE vocabulary")
    return ranks


def _special_tokens(n: int, config_path: Path) -> dict[str, int]:
    """All 256 specials n..n+255, named from `added_tokens_decoder`, `<|reserved_token_{id}|>` otherwise."""
    if not config_path.is_file():
        raise TokenizerError(f"{config_path}: no such file; the special-token names are read from it")
    raw = _json_object(config_path, "a tokenizer config")
    try:
        decoder = raw["added_tokens_decoder"]
        named = {int(i): e["content"] for i, e in decoder.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise TokenizerError(f"{config_path}: expected 'added_tokens_decoder': {{id: {{'content': name}}}} ({e!r})") from None
    bad = [(i, name) for i, name in named.items() if not isinstance(name, str) or not name]
    if bad:  # an empty name matches everywhere (encode never returned); a number failed inside tiktoken
        raise TokenizerError(f"{config_path}: added_tokens_decoder[{bad[0][0]}].content is {bad[0][1]!r}, expected a "
                             "non-empty string (the special token's spelling)")
    outside = sorted(i for i in named if not n <= i < n + NUM_SPECIAL)
    if outside and n < min(named):  # all above the ranks' specials: the vocabulary file is short
        last = f" (its last rank is {n - 1})" if n else ""
        raise TokenizerError(f"{config_path}: special ids {outside[:5]} are outside {n}..{n + NUM_SPECIAL - 1}: the "
                             f"specials are the {NUM_SPECIAL} ids after the ranks, so ids up to {max(named)} need at least "
                             f"{max(named) - NUM_SPECIAL + 1} ranks, and {config_path.parent / VOCAB_FILE} has {n}{last}; "
                             f"is {VOCAB_FILE} truncated, or are the two files not from the same tokenizer?")
    if outside:
        raise TokenizerError(f"{config_path}: special ids {outside[:5]} are outside {n}..{n + NUM_SPECIAL - 1} "
                             f"(the vocabulary file has {n} ranks); the two files do not belong together")
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + NUM_SPECIAL)}
    if len(specials) != NUM_SPECIAL:
        raise TokenizerError(f"{config_path}: special-token names are not unique")
    return specials


def _json_object(path: Path, what: str = "a model config") -> dict:
    """A JSON file holding one object (config.json, tokenizer_config.json), or a TokenizerError naming the file."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for a file that is not text
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    except DuplicateKeyError as e:  # json.loads keeps the last silently: a special token renamed, an eos id replaced
        raise TokenizerError(f"{path}: key '{e.args[0]}' is given twice in one object{e.args[1]}; which one the file "
                             "means cannot be told: keep one") from None
    if not isinstance(raw, dict):
        raise TokenizerError(f"{path}: expected a JSON object ({what}), found {type(raw).__name__}")
    return raw


def _int_field(path: Path, key: str):
    """config.json's integer `key` (at the top or in its text_config, which the model's config reads), else None
    (absent or null). A value that is not an int, or two that differ, is an error: the tokenizer would stop
    generation at another id than the model's config names."""
    if not path.is_file():
        return None
    raw = _json_object(path)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    found = {where: obj[key] for where, obj in (("", raw), ("text_config.", text)) if obj.get(key) is not None}
    for where, value in found.items():
        if type(value) is not int:
            raise TokenizerError(f"{path}: {where}{key} is {value!r}, expected a token id (an int) or null")
    if len(set(found.values())) > 1:
        raise TokenizerError(f"{path}: {key} {found['']} and text_config.{key} {found['text_config.']} differ; the "
                             "model's config reads text_config's: keep one value")
    return next(iter(found.values()), None)


class KimiTokenizer:
    """The released K3 tokenizer on plain tiktoken (ids identical to the release's `TikTokenTokenizer`)."""

    def __init__(self, mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int], *,
                 bos_id: int | None, eos_id: int | None, vocab_sha256: str = "", name: str = "kimi_k3"):
        tiktoken = _import_tiktoken()
        self._enc = tiktoken.Encoding(name, pat_str=PAT_STR, mergeable_ranks=mergeable_ranks,
                                      special_tokens=special_tokens)
        self.special_tokens = dict(special_tokens)                      # name -> id
        self._special_names = {i: s for s, i in special_tokens.items()}  # id -> name
        self.num_base_tokens = len(mergeable_ranks)
        self.vocab_size = self._enc.n_vocab
        self.bos_id, self.eos_id = bos_id, eos_id
        self.vocab_sha256 = vocab_sha256

    @classmethod
    def from_pretrained(cls, path: str | Path) -> KimiTokenizer:
        """Build from a checkpoint directory holding `tiktoken.model` + `tokenizer_config.json`.

        eos_id is the generation stop id: config.json `eos_token_id` if present, else `<|end_of_msg|>`.
        bos_id: config.json `bos_token_id`, else `[BOS]`; nothing prepends it (the release does not)."""
        path = Path(path)
        vocab = path / VOCAB_FILE
        if not vocab.is_file():
            raise TokenizerError(f"{path}: no {VOCAB_FILE} (the BPE ranks of the released tokenizer)")
        ranks = read_tiktoken_model(vocab)
        sha256 = hashlib.sha256(vocab.read_bytes()).hexdigest()
        if len(ranks) == RELEASE_NUM_RANKS and sha256 != RELEASE_VOCAB_SHA256:  # the release's size, not its bytes
            raise TokenizerError(f"{vocab}: {len(ranks):,} ranks, the released file's count, but sha256 {sha256}; the "
                                 f"released file's is {RELEASE_VOCAB_SHA256}. A damaged or edited copy gives other ids: "
                                 "download it again")
        specials = _special_tokens(len(ranks), path / TOKENIZER_CONFIG)
        eos = _int_field(path / "config.json", "eos_token_id")
        bos = _int_field(path / "config.json", "bos_token_id")
        for key, value in (("eos_token_id", eos), ("bos_token_id", bos)):   # K3: 163586, 163584, both specials
            if value is not None and value not in specials.values():
                raise TokenizerError(f"{path / 'config.json'}: {key} {value} is not a special token of {VOCAB_FILE} + "
                                     f"{TOKENIZER_CONFIG} (ids {len(ranks)}..{len(ranks) + NUM_SPECIAL - 1}); "
                                     "config.json and the tokenizer files do not belong together")
        return cls(ranks, specials,
                   bos_id=bos if bos is not None else specials.get("[BOS]"),
                   eos_id=eos if eos is not None else specials.get(STOP_TOKEN),
                   vocab_sha256=sha256)

    @property
    def fingerprint(self) -> str:
        """Which tokenizer this is, as a session file records it: a hash of the BPE file, the special tokens' names
        and ids, and the bos / eos ids (`Session.load_state` compares; Kimi K2's files share K3's BPE file but
        not its special names)."""
        ident = json.dumps([self.vocab_sha256, sorted(self.special_tokens.items()), self.bos_id, self.eos_id])
        return f"kimi/{self.vocab_size}/{hashlib.sha256(ident.encode()).hexdigest()[:16]}"

    @property
    def is_release_vocab(self) -> bool:
        """True when tiktoken.model is byte-identical to the released file (K2 and K3 share it)."""
        return self.vocab_sha256 == RELEASE_VOCAB_SHA256

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Ids of `text`, cut as the release cuts long inputs.

        allow_special=True: every special spelling (`<|open|>`, `[BOS]`, `<|reserved_token_163600|>`...)
        becomes its id (trusted / structural text). False: they are plain BPE (untrusted text)."""
        _check_text(text)
        kw = {"allowed_special": "all"} if allow_special else {"disallowed_special": ()}
        if len(text) <= MAX_RUN_CHARS:          # no cut possible: skip the scan
            return self._enc.encode(text, **kw)
        return [i for piece in split_for_encoding(text) for i in self._enc.encode(piece, **kw)]

    def decode(self, ids) -> str:
        """Text of `ids`; special ids decode to their names, broken UTF-8 to U+FFFD."""
        return self._enc.decode(_as_ids(ids, self.vocab_size))

    def decode_bytes(self, ids) -> bytes:
        """Exact bytes (a character split across tokens survives)."""
        return self._enc.decode_bytes(_as_ids(ids, self.vocab_size))

    def token_label(self, token_id: int) -> str:
        """A short readable label: a special's name, else the token's text with controls escaped."""
        (i,) = _as_ids([token_id], self.vocab_size)
        if i in self._special_names:
            return self._special_names[i]
        return _label_bytes(self._enc.decode_single_token_bytes(i))

    def special_id(self, name: str) -> int:
        """Id of a special token by name, e.g. `special_id("<|open|>")` -> 163587."""
        try:
            return self.special_tokens[name]
        except KeyError:
            named = [s for s in self.special_tokens if not s.startswith("<|reserved_token_")]
            raise TokenizerError(f"special token {name!r}: not in this vocabulary; named ones: {named}") from None

    def is_special(self, token_id: int) -> bool:
        (i,) = _as_ids([token_id], self.vocab_size)  # not int(): int(422.9) == 422 would answer for another id
        return i in self._special_names

    def render_chat(self, messages, **kw) -> str:
        return render_chat(messages, **kw)

    def encode_chat(self, messages, **kw) -> list[int]:
        """Ids of the chat prompt, encoded segment by segment like the release (segmenting changes ids).

        The structural segments (`<|open|>`, `<|sep|>`, `<|close|>`, `<|end_of_msg|>`) must be special
        tokens of this vocabulary: with other files (Kimi K2 names the same slots `<|im_user|>`...) they
        would silently become plain BPE, a prompt the model never saw."""
        ids = []
        for text, special in chat_segments(messages, **kw):
            if special and text not in self.special_tokens:
                named = [s for s in self.special_tokens if not s.startswith("<|reserved_token_")]
                raise TokenizerError(f"chat marker {text!r} is not a special token of this tokenizer (its "
                                     f"{TOKENIZER_CONFIG} names {named[:6]}...): these are not the Kimi K3 "
                                     "tokenizer files")
            ids += self.encode(text, allow_special=special)
        return ids

    def __repr__(self) -> str:
        return f"KimiTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, release_vocab={self.is_release_vocab})"


# ---- choosing a tokenizer for a checkpoint ----

def _vocab_size(raw: dict) -> int | None:
    text = raw.get("text_config") or raw
    return text.get("vocab_size") if isinstance(text, dict) else None


def load_tokenizer(path_or_config):
    """The tokenizer of a checkpoint: KimiTokenizer if the directory has `tiktoken.model`, else
    ByteTokenizer when the model's vocab_size is 256, else a TokenizerError naming what is missing.

    Accepts a checkpoint directory (or its config.json), a Hub repo id ('org/name': its config and tokenizer
    files are fetched, or taken from the cache, as `from_pretrained` takes them), a KimiDecoderConfig, a raw
    config dict, or loaded weights or a RayPipeline (their source directory or repo id is used)."""
    from .weights.hub import fetch_tokenizer, is_repo_id

    obj = path_or_config
    if hasattr(obj, "config") and hasattr(obj, "source"):       # KimiDecoderWeights, RayPipeline
        src = obj.source
        obj = src if src and (Path(src).is_dir() or is_repo_id(str(src))) else obj.config
    if isinstance(obj, str) and is_repo_id(obj) and not Path(obj).exists():
        obj = fetch_tokenizer(obj)
    if isinstance(obj, (str, Path)):
        path = Path(obj)
        if path.is_file() and path.name == "config.json":
            path = path.parent
        if not path.is_dir():
            raise TokenizerError(f"{path}: not a checkpoint directory (expected {VOCAB_FILE} or a config.json)")
        cfg_path = path / "config.json"
        vocab = _vocab_size(_json_object(cfg_path)) if cfg_path.is_file() else None
        if (path / VOCAB_FILE).is_file():
            tok = KimiTokenizer.from_pretrained(path)
            if vocab is not None and tok.vocab_size != vocab:   # K3: both 163,840 (k3-tokenizer.md 1)
                raise TokenizerError(f"{path}: the tokenizer has {tok.vocab_size} ids but config.json vocab_size is "
                                     f"{vocab}; {VOCAB_FILE} does not belong to this model")
            return tok
        source = f"{path}: no {VOCAB_FILE}, and " + ("its config.json" if cfg_path.is_file() else "no config.json, so vocab_size")
    elif isinstance(obj, dict):
        vocab, source = _vocab_size(obj), "config dict"
    elif hasattr(obj, "vocab_size"):                            # KimiDecoderConfig
        vocab, source = obj.vocab_size, "config"
    else:
        raise TypeError(f"path_or_config: expected a checkpoint directory, a config or weights, found {type(obj).__name__}")
    if vocab == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    found = "is missing" if source.endswith("vocab_size") else "has no vocab_size" if vocab is None else \
        f"vocab_size is {vocab!r}" + ("" if type(vocab) is int else f" (a {type(vocab).__name__}, not an int)")
    raise TokenizerError(f"{source} {found}: a byte tokenizer needs vocab_size 256, any other model needs its "
                         f"{VOCAB_FILE} + {TOKENIZER_CONFIG} (pass the checkpoint directory that holds them)")
