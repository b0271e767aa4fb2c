"""A session's history as one record (`SessionSnapshot`), and session files: one .npz that lets another
user continue a decode exactly (`Session.save_state`).

Layout: a JSON `header` (format, the weights' fingerprint, tokens, which steps ran with
value-changing hooks, how each was decoded (fed chunks, the parts truncate cut off them, the sites whose full
record changed a chunk's route), the array layout of every saved decode state, the recorder's settings),
the decode state arrays `state/{layer}/{field}` (and the kept checkpoints `ckpt{t}/...`, every
array with its full shape so replays run on the same layouts; an MLA cache as its used positions and
its capacity, the rest zeros on loading; a cache that checkpoints share, once, as its longest holder's
positions, the others naming that holder, `cache_of`), `logits` [T, V], the `probe` logits, and each record
as `rec/{key}/flat` + `rec/{key}/shapes` (records may change shape from token to token). Entries are stored, not
deflated: a decode state's floats deflate by ~15%, at ~6x the time of the whole save (8,192 tokens of the embedded
model: 72 MiB in 3.6 s against 84 MiB in 0.6 s; at K3's width a state of gigabytes would take minutes).

The fingerprint (config hash and values, layer ids, dtype, a hash of a strided sample of every weight
tensor, and of every expert of a small bank: `model.fingerprint`) makes loading into a different model fail
with what differs instead of diverging. A sample misses an edit elsewhere (one value; an expert of a
K3-sized bank, where only the ends are sampled), so the file also holds `probe`: the logits
of PROBE_TOKEN decoded from the saved state by the weights that saved it; loading decodes it again
and refuses weights that continue the state otherwise (beyond PROBE_RTOL: other options or another
device round differently, another model does not agree).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from ..backend import to_numpy
from ..model.fingerprint import GLOBAL_TENSORS
from ..model.kimi_decoder import KimiDecodeState, KimiLayerState, hook_names
from ..model.mla import cache_array
from .npz_io import NpzReader, npz_to_read, with_npz_suffix, write_npz
from .recorder import Recorder, per_token

__all__ = ["SavedSettings", "SessionSnapshot", "check_tokenizer", "copy_sharing", "load_session", "nbytes_once", "save_session",
           "share_caches", "weights_fingerprint"]

PROBE_TOKEN = 0  # decoded (without hooks, on a copy) from the saved state, at saving and at loading
PROBE_RTOL = 1e-3  # of the probe logits' scale: the bound on "the same model" (Moonshot's reference is met to 1e-4)
FORMAT = "kimi_explore.inspection.session/3"  # /3: a cache shared by several states saved once (`cache_of`)
READS = (FORMAT, "kimi_explore.inspection.session/2",  # /2: every MLA cache as its used positions and its capacity
         "kimi_explore.inspection.session/1")  # /1: every cache at its whole capacity


@dataclasses.dataclass
class SessionSnapshot:
    """A session's whole history: what `snapshot()` returns, `restore()` takes and a session file holds.

    weights_id:  id() of the weights the history was decoded with (restore checks it)
    state:       the decode state after all `tokens` (a private copy)
    tokens:      [T] token ids
    logits:      T host arrays [vocab]; never written after they are stored
    modified:    [T] bools: token t was decoded with hooks that may change values
    chunk_of:    [T] the first token of the fed chunk token t was decoded in (-1: stepped); replays
                 re-decode each chunk as one (None: every token stepped)
    checkpoints: {t: decode state after the first t tokens} (`KimiDecodeState.checkpoint`); only ever copied
    records:     the recorder's `state_dict()`, or None when the session records nothing
    cut_tails:   {first token of a fed chunk `truncate` cut: the tokens cut off it} (replays re-decode it whole)
    routes:      {first token of a fed chunk: the sites recorded in full that changed how it was computed} (replays
                 record them too; None: not known, a file from before they were kept)
    generated:   [T] bools: token t was chosen by `generate` (None: none was, a file from before they were kept)
    """

    weights_id: int
    state: KimiDecodeState
    tokens: list
    logits: list
    modified: list
    checkpoints: dict
    records: dict | None
    chunk_of: list | None = None
    cut_tails: dict | None = None
    routes: dict | None = None
    generated: list | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        records = "on" if self.records is not None else "off"
        return f"SessionSnapshot({len(self)} tokens, {len(self.checkpoints)} checkpoints, records {records})"


@dataclasses.dataclass
class SavedSettings:
    """What a session file says about how to continue, besides the history itself."""

    checkpoint_every: int
    recorder: dict | None  # Recorder(**recorder) records as the saved session did; None: it recorded nothing
    tokenizer: str | None = None  # the saved session's tokenizer's `fingerprint`; None: none, or one without it


def save_session(path, weights, snap: SessionSnapshot, checkpoint_every: int, recorder: Recorder | None,
                 checkpoints: bool = True, tokenizer=None) -> Path:
    """Write `snap` (a `Session.snapshot()`) and the settings to continue it as one .npz."""
    path = with_npz_suffix(path, "save_state")
    arrays, layout = {}, {}
    states = [("state", snap.state)] + ([(f"ckpt{t}", s) for t, s in snap.checkpoints.items()] if checkpoints else [])
    owners = _cache_owners(states)
    for key, state in states:
        layout[key] = _put_state(arrays, key, weights.host_state(state), owners.get(key, {}))
    rec = None
    if snap.records is not None:
        rec = {**_recorder_settings(recorder, weights), "tokens": snap.records["tokens"], "positions": snap.records["positions"],
               "keys": []}
        for k, blocks in snap.records["blocks"].items():
            if blocks:
                rec["keys"].append(k)
                arrays[f"rec/{k}/flat"], arrays[f"rec/{k}/shapes"] = _flat_records(k, blocks)
    header = {"format": FORMAT, "fingerprint": weights_fingerprint(weights), "tokens": snap.tokens,
              "modified": snap.modified, "chunk_of": snap.chunk_of, "layout": layout,
              **({"generated": snap.generated} if snap.generated is not None else {}),
              "cut_tails": {str(a): [int(t) for t in tail] for a, tail in (snap.cut_tails or {}).items()},
              **({"routes": {str(a): list(r) for a, r in snap.routes.items()}} if snap.routes is not None else {}),
              "checkpoint_every": checkpoint_every, "recorder": rec,
              "tokenizer": getattr(tokenizer, "fingerprint", None)}
    V = weights.config.vocab_size
    arrays["logits"] = np.stack(snap.logits) if snap.logits else np.zeros((0, V), dtype=weights.dtype)
    arrays["probe"] = probe_logits(weights, snap.state)
    return write_npz(path, {"header": np.array(json.dumps(header)), **arrays}, compressed=False)


def load_session(path, weights, tokenizer=None) -> tuple[SessionSnapshot, SavedSettings]:
    """The history in a `save_session` file, checked to belong to `weights`, and the settings to continue it.

    Everything is read and checked before anything is built: the fingerprint, the tokenizer's (`check_tokenizer`:
    `tokenizer`, where given, is the one it was saved with), then that the parts agree
    with each other and with `weights` (T tokens in the vocabulary, [T, vocab] logits of the weights'
    dtype, states at the right positions with every array's shape and dtype, records that split into
    their rows). A file that fails any check is refused with what it holds against what was expected. A path
    without `.npz` that names no file reads PATH.npz, the name `save_session` gave it."""
    path = npz_to_read(path)
    with NpzReader(path, "session state") as z:
        header = z.header(READS, required=HEADER_KEYS)
        _check_fingerprint(path, header["fingerprint"], weights_fingerprint(weights))
        check_tokenizer(path, header.get("tokenizer"), tokenizer)
        T = _check_history(path, header, weights)
        logits = z["logits"]
        want = (T, weights.config.vocab_size)
        if logits.shape != want or logits.dtype != np.dtype(weights.dtype):
            raise ValueError(f"{path}: logits {logits.dtype}{list(logits.shape)}, expected {np.dtype(weights.dtype)}"
                             f"{list(want)} (one row per token of the file's {T}, the model's vocabulary): the file is "
                             "damaged")
        saved, records, settings = header["recorder"], None, None
        if saved is not None:  # the settings as Recorder() takes them, beside the records they made
            records = _get_records(z, path, saved, header["tokens"], weights)
            settings = {"top_k": saved["top_k"], "names_filter": saved["filter"], "full": saved["full"] or ()}
            records["settings"] = settings
        caches: dict = {}  # a cache saved once, its arrays as every state naming it reads them (`_read_state`)
        host = {key: _read_state(z, key, lay, weights, caches) for key, lay in header["layout"].items()}  # all checked first
        probe = z["probe"] if "probe" in z else None  # (files saved before it existed: the fingerprint alone)
        if probe is not None and (probe.shape != want[1:] or probe.dtype != np.dtype(weights.dtype)):
            raise ValueError(f"{path}: probe {probe.dtype}{list(probe.shape)}, expected {np.dtype(weights.dtype)}"
                             f"[{want[1]}] (the logits of one token decoded from the saved state): the file is damaged")
    snap = SessionSnapshot(
        weights_id=id(weights), state=_on_weights(weights, host.pop("state")),
        tokens=[int(t) for t in header["tokens"]], logits=list(logits),
        modified=[bool(m) for m in header["modified"]],
        checkpoints=_put_checkpoints(weights, {int(k[4:]): s for k, s in host.items()}),
        records=records, chunk_of=header.get("chunk_of"),
        cut_tails={int(a): [int(t) for t in tail] for a, tail in header.get("cut_tails", {}).items()},
        routes={int(a): tuple(r) for a, r in header["routes"].items()} if "routes" in header else None,
        generated=header.get("generated"))
    if probe is not None:
        _check_probe(path, probe, probe_logits(weights, snap.state))
    return snap, SavedSettings(header["checkpoint_every"], settings, header.get("tokenizer"))


def check_tokenizer(path, saved: str | None, tokenizer) -> None:
    """A tokenizer given to continue a saved session is the one it was saved with (when both are known)."""
    here = getattr(tokenizer, "fingerprint", None)
    if saved is not None and here is not None and here != saved:
        raise ValueError(f"{path} was saved with another tokenizer (file {saved!r}, given {here!r}): its token ids "
                         "would read as other text, and text fed to it would become other ids. Load it with the "
                         "tokenizer it was saved with, or with tokenizer=None")


HEADER_KEYS = ("fingerprint", "tokens", "modified", "layout", "checkpoint_every", "recorder")


def _check_history(path, header: dict, weights) -> int:
    """The header's history is one of T tokens throughout (returns T): ids in the vocabulary, `modified`,
    `generated` and `chunk_of` per token, the state at position T and each kept checkpoint `ckpt{t}` at position t <= T."""
    def bad(what, found, expected):
        return ValueError(f"{path}: {what} is {found!r:.120}, expected {expected} (the file is damaged)")

    tokens, V = header["tokens"], weights.config.vocab_size
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < V for t in tokens):
        raise bad("'tokens'", tokens, f"a list of token ids in 0..{V - 1}")
    T = len(tokens)
    modified, chunk_of = header["modified"], header.get("chunk_of")
    if not isinstance(modified, list) or len(modified) != T or not all(type(m) is bool for m in modified):
        raise bad("'modified'", modified, f"{T} booleans, one per token")
    generated = header.get("generated", [False] * T)
    if not isinstance(generated, list) or len(generated) != T or not all(type(g) is bool for g in generated):
        raise bad("'generated'", generated, f"{T} booleans, one per token")
    if chunk_of is not None and (not isinstance(chunk_of, list) or len(chunk_of) != T or
                                 not all(type(c) is int and (c == -1 or 0 <= c <= t) for t, c in enumerate(chunk_of))):
        raise bad("'chunk_of'", chunk_of, f"{T} ints, one per token: -1 (stepped) or the first token of its chunk")
    starts = {c for c in chunk_of or () if c >= 0}  # first tokens of fed chunks
    tails, routes = header.get("cut_tails", {}), header.get("routes", {})
    if not isinstance(tails, dict) or not all(k.isdigit() and int(k) in starts and isinstance(v, list) and
                                              all(type(t) is int and 0 <= t < V for t in v) for k, v in tails.items()):
        raise bad("'cut_tails'", tails, f"{{first token of a fed chunk {sorted(starts)}: [token ids cut off it]}}")
    if not isinstance(routes, dict) or not all(k.isdigit() and int(k) in starts and isinstance(v, list) and
                                               all(isinstance(n, str) for n in v) for k, v in routes.items()):
        raise bad("'routes'", routes, f"{{first token of a fed chunk {sorted(starts)}: [site names]}}")
    every = header["checkpoint_every"]
    if type(every) is not int or every < 0:
        raise bad("'checkpoint_every'", every, "an int >= 0")
    layout = header["layout"]
    if not isinstance(layout, dict) or "state" not in layout:
        raise bad("'layout'", layout, "{'state': ..., 'ckpt{t}': ...}")
    for key, lay in layout.items():
        at = T if key == "state" else int(key[4:]) if key[:4] == "ckpt" and key[4:].isdigit() else None
        if at is None or at > T:
            raise bad(f"layout entry {key!r}", key, f"'state' or 'ckpt{{t}}' with t <= {T} (the tokens)")
        if not isinstance(lay, dict) or lay.get("position") != at or not isinstance(lay.get("layers"), list):
            raise bad(f"layout {key!r}", lay, f"a state at position {at} (its tokens) with a list of layers")
    return T


def _flat_records(key: str, blocks: list):
    """A record's blocks -> (its per-token rows' values end to end, their shapes [rows, ndim]), the rows as
    stepping records them (`recorder.per_token`: a fed chunk's mla.probs rows cut to their positions)."""
    if key.endswith(".mla.probs"):  # (rows of every width)
        rows = per_token({key: blocks})[key]
        return (np.concatenate([r.reshape(-1) for r in rows]),
                np.array([r.shape for r in rows], dtype=np.int64).reshape(len(rows), -1))
    shapes = [np.broadcast_to(np.array(b.shape[1:], dtype=np.int64), (len(b), b.ndim - 1)) for b in blocks]
    return np.concatenate([np.asarray(b).reshape(-1) for b in blocks]), np.concatenate(shapes)


def _get_records(z, path, saved, tokens: list, weights) -> dict:
    """The recorder's records (`Recorder.state_dict()`'s "blocks"): each key's `flat` values split by its `shapes`
    ([rows, ndim] ints), checked to add up, one row per token of the file's history (or none yet), one block where
    every row has the same shape; the records' tokens are the history's. Values are in the weights' activation
    dtype, ids (`*_ids`) ints within the vocabulary or the experts, as the Recorder makes them."""
    vocab = weights.config.vocab_size
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: the header's 'recorder' is a {type(saved).__name__}, expected a dict of the recorder's "
                         "settings and records: the file is damaged")
    for k in ("keys", "tokens", "positions", "top_k", "filter", "full"):
        if k not in saved:
            raise ValueError(f"{path}: the header's 'recorder' lacks {k!r} (found {sorted(saved)}): the file is damaged")
    T = len(tokens)
    if [int(t) for t in tokens] != saved["tokens"] or len(saved["positions"]) != T or not all(
            type(p) is int for p in saved["positions"]):
        raise ValueError(f"{path}: the records hold tokens {saved['tokens']!r:.80} and positions {saved['positions']!r:.80}, "
                         f"expected the file's {T} tokens {tokens!r:.80} and {T} int positions: the file is damaged")
    top_k = saved["top_k"]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{path}: the header's recorder top_k is {top_k!r}, expected a positive int: the file is damaged")
    blocks = {}
    for k in saved["keys"]:
        flat, shapes = z[f"rec/{k}/flat"], z[f"rec/{k}/shapes"]
        if (shapes.ndim != 2 or shapes.dtype.kind != "i" or len(shapes) not in (0, T) or (shapes < 0).any()
                or flat.ndim != 1):
            raise ValueError(f"{path}: record {k!r}: shapes {shapes.dtype}{list(shapes.shape)}, values "
                             f"{flat.dtype}{list(flat.shape)}; expected [{T} rows (one per token) or none, ndim] "
                             "non-negative ints and one flat array (the file is damaged)")
        if k in ("logits.top_ids", "logits.top_probs") and len(shapes) and (shapes != [min(top_k, vocab)]).any():
            raise ValueError(f"{path}: record {k!r} has rows of {sorted(set(shapes[:, -1].tolist()))} predictions, the "
                             f"header's top_k {top_k} ({min(top_k, vocab)} of the vocabulary): the file is damaged")
        _check_record_values(path, k, flat, weights)
        sizes = np.prod(shapes, axis=1).astype(int) if shapes.shape[1] else np.ones(len(shapes), int)
        if int(sizes.sum()) != flat.size:
            raise ValueError(f"{path}: record {k!r}: its {len(shapes)} row shapes hold {int(sizes.sum())} values, the "
                             f"flat array {flat.size} (the file is damaged)")
        if len(shapes) and not k.endswith(".mla.probs") and (shapes == shapes[0]).all():
            blocks[k] = [flat.reshape((len(shapes), *shapes[0].tolist()))]
        else:
            parts = np.split(flat, np.cumsum(sizes)[:-1])
            blocks[k] = [p.reshape((1, *sh)) for p, sh in zip(parts, shapes.tolist(), strict=True)]
    return {"blocks": blocks, "tokens": saved["tokens"], "positions": saved["positions"]}


def _check_record_values(path, key: str, flat, weights) -> None:
    """A record's values as the Recorder makes them for `weights`: ids (`*_ids`) ints below the vocabulary (logits) or
    the experts (routing), every other value in the activation dtype."""
    if key.endswith("_ids"):
        bound = weights.config.vocab_size if key.startswith("logits.") else weights.config.num_experts
        if flat.dtype.kind not in "iu" or (flat.size and (flat.min() < 0 or flat.max() >= bound)):
            found = f"{flat.dtype} in [{flat.min()}, {flat.max()}]" if flat.size and flat.dtype.kind in "iu" else str(flat.dtype)
            raise ValueError(f"{path}: record {key!r} holds {found}, expected ints in [0, {bound}): the file is damaged")
    elif flat.dtype != np.dtype(weights.dtype):
        raise ValueError(f"{path}: record {key!r} holds {flat.dtype} values, expected {np.dtype(weights.dtype)} (these "
                         "weights' activations): the file is damaged")


def _recorder_settings(rec: Recorder, weights) -> dict:
    """What the recorder records, as the header keeps it. A callable filter cannot be saved: the site names of
    `weights` it selects are (so the loaded session records the same sites; the default would record others,
    and its records would no longer line up with the saved ones)."""
    settings, names = rec.settings(), None

    def portable(v):
        nonlocal names
        if callable(v):
            names = hook_names(weights) if names is None else names
            return [n for n in names if v(n)]
        return list(v) if v else None

    return {"top_k": settings["top_k"], "filter": portable(settings["names_filter"]), "full": portable(settings["full"])}


def _put_state(arrays: dict, key: str, state: KimiDecodeState, cache_of: dict) -> dict:
    """A cache (a state with a `length`: MLA) is saved as its first `length` positions (axis 1) and its capacity:
    a checkpoint shares its arrays with the live state, which writes on past the checkpoint's length. A cache whose
    arrays another saved state holds with more positions (`cache_of`: {layer: that state's key}) is saved as a
    reference to it, so a history's shared caches are written once, not once per checkpoint."""
    layers = []
    for j, ls in enumerate(state.layers):
        att = ls.attention
        scalars, used, capacity = {}, getattr(att, "length", None), None
        for f in dataclasses.fields(att):
            v = getattr(att, f.name)
            if hasattr(v, "shape"):
                if used is not None:
                    capacity, v = int(v.shape[1]), v[:, :used]
                if j not in cache_of:
                    arrays[f"{key}/{j}/{f.name}"] = to_numpy(v)
            else:
                scalars[f.name] = v
        layers.append({"type": type(att).__name__, "scalars": scalars, **({"capacity": capacity} if capacity else {}),
                       **({"cache_of": cache_of[j]} if j in cache_of else {})})
    return {"position": state.position, "layers": layers}


def _cache_owners(states: list) -> dict:
    """{key: {layer: the key of the state holding this MLA cache's arrays with the most positions}} for the
    caches that several of `states` [(key, state)] share (a history's checkpoints share theirs with the live state
    and with each other, `KimiDecodeState.checkpoint`); a pipeline's states, held in its stages, share nothing here."""
    def caches():
        for key, state in states:
            for j, ls in enumerate(getattr(state, "layers", ())):
                if getattr(ls.attention, "length", None) is not None:
                    yield key, j, (id(ls.attention.keys), id(ls.attention.values)), ls.attention.length
    longest: dict = {}  # the arrays' ids -> (positions, key) of their longest holder (the first among equals)
    for key, _, arrays, n in caches():
        if arrays not in longest or n > longest[arrays][0]:
            longest[arrays] = (n, key)
    out: dict = {}
    for key, j, arrays, _ in caches():
        if longest[arrays][1] != key:
            out.setdefault(key, {})[j] = longest[arrays][1]
    return out


def _put_checkpoints(weights, host: dict) -> dict:
    """{t: checkpoint} from {t: host state}, sharing their MLA caches as a session's own checkpoints do
    (`share_caches`; a pipeline's in its stages)."""
    kept = {t: _on_weights(weights, host[t]) for t in sorted(host, reverse=True)}
    longest_first = list(kept.values())
    if all(isinstance(state, KimiDecodeState) for state in longest_first):
        share_caches(longest_first, weights.xp)
        for state in longest_first:  # checkpoints: never decoded on (their caches are shared)
            state.shared = True
    else:
        weights.share_kept(longest_first)
    return dict(sorted(kept.items()))


def share_caches(states: list[KimiDecodeState], xp) -> None:
    """Checkpoints of one history as loaded, longest first: a checkpoint whose MLA cache has the capacity of a
    longer one's and its first `length` positions (checked equal, bit for bit) takes that one's arrays, so the
    history holds its caches about once, as the session's own checkpoints did (`KimiDecodeState.checkpoint`)."""
    holders: dict = {}  # (layer, capacity) -> the longest MLA cache loaded with that capacity
    for state in states:
        for j, ls in enumerate(state.layers):
            att = ls.attention
            if att.kind != "mla":
                continue
            held, n = holders.setdefault((j, att.keys.shape[1]), att), att.length
            if held is not att and _same_bits(held.keys[:, :n], att.keys[:, :n], xp) and \
                    _same_bits(held.values[:, :n], att.values[:, :n], xp):
                ls.attention = dataclasses.replace(held, length=n)  # the same arrays


def copy_sharing(states: list[KimiDecodeState]) -> list[KimiDecodeState]:
    """Copies of states (a history's checkpoints, `KimiDecodeState.checkpoint`) sharing among themselves what these
    share (its MLA caches): each distinct array copied once, its values as they are, except an MLA cache's positions
    past the longest of these states that holds it (the live history's, which no checkpoint reads): zero, as in
    `MlaState.copy`, so a cache doubled past a long feed costs what the checkpoints read, not its capacity."""
    reads: dict = {}  # id of an MLA cache array -> the most positions a state here reads of it
    for s in states:
        for ls in s.layers:
            if getattr(ls.attention, "kind", None) == "mla":
                for a in (ls.attention.keys, ls.attention.values):
                    reads[id(a)] = max(reads.get(id(a), 0), ls.attention.length)
    memo: dict = {}  # id of an original array (alive in `states` throughout) -> its copy

    def copied(a):
        if id(a) not in memo:
            n = reads.get(id(a))
            memo[id(a)] = a.copy() if n is None else cache_array(a, n, a.shape[1])
        return memo[id(a)]

    # copies of checkpoints are checkpoints: they share their caches among themselves
    return [dataclasses.replace(s, layers=[ls.converted(copied) for ls in s.layers]) for s in states]


def nbytes_once(states: list[KimiDecodeState]) -> int:
    """Bytes of these states' arrays, each array once (checkpoints share MLA caches)."""
    arrays = {id(a): a for s in states for a in s.arrays()}
    return sum(int(a.nbytes) for a in arrays.values())


def _same_bits(a, b, xp) -> bool:
    """Bit for bit (array_equal calls -0.0 and 0.0 equal and NaN unequal)."""
    return a.shape == b.shape and bool(xp.array_equal(a.view(np.uint8), b.view(np.uint8)))


def _on_weights(weights, host: KimiDecodeState):
    """A state read by `_read_state` on the weights' backend (a pipeline's: in its stages)."""
    return weights.put_state(KimiDecodeState([ls.converted(weights.xp.asarray) for ls in host.layers], host.position,
                                             layer_ids=host.layer_ids))


def _read_state(z, key: str, layout: dict, weights, caches: dict) -> KimiDecodeState:
    """Saved state `key` as host arrays, checked against the layout of a fresh state of `weights`. An MLA cache that
    several saved states share (`cache_of`) becomes one pair of arrays of its capacity, its holder's positions in them,
    which each of those states reads up to its own length (`caches`: (holder, layer, field, capacity) -> the array),
    as a session's checkpoints share the live cache (`MlaState.checkpoint`). Built once per state, a history's
    checkpoints held a cache each while loading (307 MiB at the peak for an 84 MiB file of 8,192 tokens)."""
    path, fresh = z.path, weights.host_state(weights.new_state())
    if len(layout["layers"]) != len(fresh.layers):
        raise ValueError(f"{path}: saved {key} has {len(layout['layers'])} layers, these weights {len(fresh.layers)}")
    layers = []
    for j, (lay, ls) in enumerate(zip(layout["layers"], fresh.layers, strict=True)):
        att = ls.attention
        if not isinstance(lay, dict) or type(att).__name__ != lay.get("type"):
            raise ValueError(f"{path}: saved {key} layer {j} state is {lay.get('type') if isinstance(lay, dict) else lay!r}, "
                             f"these weights need {type(att).__name__}")
        kw = dict(lay.get("scalars", {}))
        want = {f.name for f in dataclasses.fields(att) if not hasattr(getattr(att, f.name), "shape")}
        if set(kw) != want or not all(type(v) is int for v in kw.values()):
            raise ValueError(f"{path}: saved {key} layer {j} ({lay['type']}) scalars {kw}, expected ints for exactly "
                             f"{sorted(want)} (the file is damaged)")
        if "length" in kw and kw["length"] != layout["position"]:  # an MLA cache holds every position decoded
            raise ValueError(f"{path}: saved {key} layer {j} caches {kw['length']} positions, its state is at position "
                             f"{layout['position']} (the file is damaged)")
        for f in dataclasses.fields(att):
            v = getattr(att, f.name)
            if hasattr(v, "shape"):
                a = _cache_from(z, lay, key, j, f.name, kw) if "cache_of" in lay else z[f"{key}/{j}/{f.name}"]
                cache = "length" in kw  # [heads, positions (any capacity), dim]
                same = (a.shape[:1] + a.shape[2:] == v.shape[:1] + v.shape[2:] and a.ndim == v.ndim) if cache else \
                    a.shape == v.shape
                if a.dtype != v.dtype or not same:
                    need = f"{v.dtype}[{v.shape[0]}, positions, {', '.join(map(str, v.shape[2:]))}]" if cache else \
                        f"{v.dtype}{list(v.shape)}"
                    raise ValueError(f"{path}: saved {key} layer {j} {f.name}: {a.dtype}{list(a.shape)}, these weights "
                                     f"need {need}")
                if "capacity" in lay:  # a cache saved as its used positions: zeros up to its capacity, as it was
                    length = kw.get("length")
                    if not (a.ndim >= 2 and a.shape[1] == length <= lay["capacity"]):
                        raise ValueError(f"{path}: saved {key} layer {j} {f.name}: {a.shape[1] if a.ndim >= 2 else '?'} "
                                         f"cached positions, capacity {lay['capacity']}, length {length}: a cache is saved "
                                         "as its first `length` positions, within its capacity (the file is damaged)")
                    a = _capacity(z, key, lay, j, f.name, a, caches)
                elif cache and a.shape[1] < kw["length"]:
                    raise ValueError(f"{path}: saved {key} layer {j} {f.name}: capacity {a.shape[1]} below its length "
                                     f"{kw['length']} (the file is damaged)")
                kw[f.name] = a
        layers.append(KimiLayerState(dataclasses.replace(att, **kw)))
    return KimiDecodeState(layers, int(layout["position"]), layer_ids=getattr(fresh, "layer_ids", None))


def _capacity(z, key: str, lay: dict, j: int, name: str, used, caches: dict):
    """A cache saved as its used positions (`used`, checked) as the array of its capacity: zeros after its holder's
    positions (its own, or those of the state it names, `cache_of`), one array per holder and capacity."""
    src = lay.get("cache_of", key)
    held = z.kept(f"{src}/{j}/{name}") if src != key else used
    if held.shape[1] > lay["capacity"]:  # (a damaged holder: this state's own positions, unshared)
        src, held = key, used
    at = (src, j, name, lay["capacity"])
    if at not in caches:
        caches[at] = cache_array(held, held.shape[1], lay["capacity"])
    return caches[at]


def _cache_from(z, lay: dict, key: str, j: int, name: str, kw: dict):
    """A cache saved as a reference (`cache_of`): the first `length` positions of the state it names."""
    src, length = lay["cache_of"], kw.get("length")
    if not isinstance(src, str) or src == key or f"{src}/{j}/{name}" not in z or type(length) is not int:
        raise ValueError(f"{z.path}: saved {key} layer {j} names {src!r} as the holder of its cache, which the file does "
                         "not hold (the file is damaged)")
    a = z.kept(f"{src}/{j}/{name}")  # (one holder serves every checkpoint of its capacity)
    if a.ndim < 2 or a.shape[1] < length:
        raise ValueError(f"{z.path}: saved {key} layer {j} {name}: its holder {src} has {a.shape[1] if a.ndim >= 2 else '?'} "
                         f"positions, fewer than its length {length} (the file is damaged)")
    return a[:, :length]


def weights_fingerprint(weights) -> dict:
    """What a session file checks its weights by (`model.fingerprint`; cheap even for K3): the config's values, layer
    ids, dtype, and `values`, a hash of a strided sample of every weight tensor and of every expert of the small banks,
    with -0.0 read as 0.0 (an MXFP4 expert dequantises to -0.0 where an f32 GGUF of it holds 0.0: the same model).
    `config`, `weights` and `experts` are the hashes files from before `values` are checked by (raw bytes; each bank's
    ends, and its every expert where small).

    A pipeline's samples (gathered from its stages) equal those of the same checkpoint loaded in one
    process, so a session file moves between the two."""
    cfg = dataclasses.asdict(weights.config)
    del cfg["num_nextn_predict_layers"]  # MTP layers are never read: files saved before the field existed still load
    cfg = json.dumps(cfg, sort_keys=True, default=str)
    global_samples, layer_samples, expert_samples = weights.weight_samples()
    samples = [global_samples[k] for k in GLOBAL_TENSORS if k in global_samples] + layer_samples
    legacy, experts, values = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    for sample in samples:
        legacy.update(sample.tobytes())
    for sample in expert_samples:
        experts.update(sample.tobytes())
    for sample in samples + expert_samples:
        values.update((sample + 0.0).tobytes())  # -0.0 + 0.0 is 0.0
    return {"config": hashlib.sha256(cfg.encode()).hexdigest()[:16], "config_values": json.loads(cfg),
            "layer_ids": [int(i) for i in weights.layer_ids], "dtype": np.dtype(weights.dtype).name,
            "weights": legacy.hexdigest()[:16], "experts": experts.hexdigest()[:16], "values": values.hexdigest()[:16]}


def probe_logits(weights, state) -> np.ndarray:
    """Host logits of PROBE_TOKEN decoded from a copy of `state` without hooks: what `weights` make of the state."""
    return np.array(to_numpy(weights.forward_token(state.copy(), PROBE_TOKEN)), copy=True)


def _check_probe(path, saved: np.ndarray, here: np.ndarray) -> None:
    finite = np.isfinite(saved)  # (a model whose logits overflow: the same entries must, the rest agree)
    err = float(np.max(np.abs(here[finite].astype(np.float64) - saved[finite]), initial=0.0)) \
        if np.array_equal(finite, np.isfinite(here)) else float("inf")
    scale = max(1.0, float(np.max(np.abs(saved[finite]), initial=0.0)))
    if not err <= PROBE_RTOL * scale:
        raise ValueError(f"{path}: these weights continue the saved state otherwise than the weights that saved it: "
                         f"decoding token {PROBE_TOKEN} from it gives logits off by {err:.3g} (allowed: "
                         f"{PROBE_RTOL:g} x {scale:.3g}). The fingerprint's samples agree, so the weights differ "
                         "elsewhere (an edited tensor or expert, another checkpoint of the same shapes), or the file's "
                         "saved state was edited (a file without digests); load the file with the weights it was saved "
                         "with")


def _flat(d: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}: a nested config's keys as the messages name them."""
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _differs(key: str, saved: dict, here: dict) -> str:
    """How the fingerprints' `key` differs, in words: the config's keys by name where the file holds its values."""
    if key in ("values", "experts"):
        return f"weights: sampled values differ (file {saved[key]!r}, here {here[key]!r})"
    if key == "config_values":
        old, new = _flat(saved[key]), _flat(here[key])
        names = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return "config: " + ", ".join(f"{k} {old.get(k)!r} in the file, {new.get(k)!r} here" for k in names[:6]) + \
            (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return f"{key}: file {saved.get(key)!r}, weights {here.get(key)!r}"


def fingerprint_differences(saved: dict, here: dict) -> list[str]:
    """How a stored `weights_fingerprint` differs from these weights', in words ([]: the same model). A fingerprint
    from before `values` and `config_values` is checked by the hashes it holds; else by values, so that a config's 4
    and 4.0 (the same model) agree, as do an MXFP4 bank and its f32 copy."""
    if "values" in saved and isinstance(saved.get("config_values"), dict):
        keys = ("config_values", "layer_ids", "dtype", "values")
    else:
        keys = ("config", "layer_ids", "dtype", "weights") + (("experts",) if "experts" in saved else ())
    return [_differs(k, saved, here) for k in keys if saved.get(k) != here.get(k)]


def _check_fingerprint(path, saved: dict, here: dict) -> None:
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: the header's fingerprint is {saved!r:.80}, expected {{config, layer_ids, dtype, "
                         "weights}} (the file is damaged)")
    diff = fingerprint_differences(saved, here)
    if diff:
        parts = "; ".join(diff)
        raise ValueError(f"{path} was saved from a different model than these weights ({parts}). "
                         "Load it with the same checkpoint, layers= and dtype= it was saved with.")
