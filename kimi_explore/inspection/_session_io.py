"""Session files: one .npz that lets another user continue a decode exactly (`Session.save_state`).

Layout: a JSON `header` (format, the weights' fingerprint, tokens, which steps ran with
value-changing hooks, the array layout of every saved decode state, the recorder's settings),
the decode state arrays `state/{layer}/{field}` (and the kept checkpoints `ckpt{t}/...`, every
array with its full shape so replays run on the same layouts), `logits` [T, V], and each record
as `rec/{key}/flat` + `rec/{key}/shapes` (records may change shape from token to token).

The fingerprint (config hash, layer ids, dtype, a hash of a strided sample of every weight
tensor) makes loading into a different model fail with what differs instead of diverging.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from .._xp import array_namespace
from ..backend import to_numpy
from ..model.kimi_decoder import KimiDecodeState, KimiLayerState
from ._decoding import host_state, model_state, new_state
from .recorder import Recorder
from .session import SessionSnapshot
from .trace import read_npz_header

__all__ = ["SavedSettings", "load_session", "save_session", "weights_fingerprint"]

FORMAT = "kimi_explore.inspection.session/1"


@dataclasses.dataclass
class SavedSettings:
    """What a session file says about how to continue, besides the history itself."""

    checkpoint_every: int
    recorder: dict | None  # Recorder(**recorder) records as the saved session did; None: it recorded nothing


def save_session(path, weights, snap: SessionSnapshot, checkpoint_every: int, recorder: Recorder | None,
                 checkpoints: bool = True) -> Path:
    """Write `snap` (a `Session.snapshot()`) and the settings to continue it as one .npz."""
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    arrays, layout = {}, {}
    states = [("state", snap.state)] + ([(f"ckpt{t}", s) for t, s in snap.checkpoints.items()] if checkpoints else [])
    for key, state in states:
        layout[key] = _put_state(arrays, key, host_state(weights, state))
    rec = None
    if snap.records is not None:
        rec = {**_recorder_settings(recorder), "tokens": snap.records["tokens"], "positions": snap.records["positions"],
               "keys": []}
        for k, rows in snap.records["rows"].items():
            if rows:
                rec["keys"].append(k)
                arrays[f"rec/{k}/flat"] = np.concatenate([np.asarray(r).reshape(-1) for r in rows])
                arrays[f"rec/{k}/shapes"] = np.array([np.shape(r) for r in rows], dtype=np.int64).reshape(len(rows), -1)
    header = {"format": FORMAT, "fingerprint": weights_fingerprint(weights), "tokens": snap.tokens,
              "modified": snap.modified, "layout": layout, "checkpoint_every": checkpoint_every, "recorder": rec}
    V = weights.config.vocab_size
    arrays["logits"] = np.stack(snap.logits) if snap.logits else np.zeros((0, V), dtype=weights.dtype)
    np.savez_compressed(path, header=np.array(json.dumps(header)), **arrays)
    return path


def load_session(path, weights) -> tuple[SessionSnapshot, SavedSettings]:
    """The history in a `save_session` file, checked to belong to `weights`, and the settings to continue it."""
    with np.load(path, allow_pickle=False) as z:
        header = read_npz_header(z, path, FORMAT, "session state")
        _check_fingerprint(path, header["fingerprint"], weights_fingerprint(weights))
        saved, records = header["recorder"], None
        if saved is not None:
            rows = {}
            for k in saved["keys"]:
                flat, shapes = z[f"rec/{k}/flat"], z[f"rec/{k}/shapes"]
                sizes = np.prod(shapes, axis=1).astype(int) if shapes.shape[1] else np.ones(len(shapes), int)
                parts = np.split(flat, np.cumsum(sizes)[:-1])
                rows[k] = [p.reshape(tuple(sh)) for p, sh in zip(parts, shapes, strict=True)]
            records = {"rows": rows, "tokens": saved["tokens"], "positions": saved["positions"]}
        snap = SessionSnapshot(
            weights_id=id(weights), state=_get_state(z, "state", header["layout"]["state"], weights),
            tokens=[int(t) for t in header["tokens"]], logits=list(z["logits"]),
            modified=[bool(m) for m in header["modified"]],
            checkpoints={int(k[4:]): _get_state(z, k, lay, weights) for k, lay in header["layout"].items() if k != "state"},
            records=records)
    settings = None if saved is None else {"top_k": saved["top_k"], "names_filter": saved["filter"], "full": saved["full"] or ()}
    return snap, SavedSettings(header["checkpoint_every"], settings)


def _recorder_settings(rec: Recorder) -> dict:
    """What the recorder records, as the header keeps it (a callable filter cannot be saved: the default then)."""
    return {"top_k": rec.top_k, "filter": _patterns(rec, "_filter_patterns", "names_filter"),
            "full": _patterns(rec, "_full_patterns", "full")}


def _patterns(rec: Recorder, attr: str, what: str):
    pats = getattr(rec, attr)
    if getattr(rec, what) is not None and not pats:
        return None  # a callable filter cannot be saved; the loaded session records with the default
    return pats or None


def _put_state(arrays: dict, key: str, state: KimiDecodeState) -> dict:
    layers = []
    for j, ls in enumerate(state.layers):
        att = ls.attention
        scalars = {}
        for f in dataclasses.fields(att):
            v = getattr(att, f.name)
            if hasattr(v, "shape"):
                arrays[f"{key}/{j}/{f.name}"] = to_numpy(v)
            else:
                scalars[f.name] = v
        layers.append({"type": type(att).__name__, "scalars": scalars})
    return {"position": state.position, "layers": layers}


def _get_state(z, key: str, layout: dict, weights):
    fresh = host_state(weights, new_state(weights))
    if len(layout["layers"]) != len(fresh.layers):
        raise ValueError(f"saved state has {len(layout['layers'])} layers, these weights {len(fresh.layers)}")
    layers = []
    for j, (lay, ls) in enumerate(zip(layout["layers"], fresh.layers, strict=True)):
        att = ls.attention
        if type(att).__name__ != lay["type"]:
            raise ValueError(f"saved layer {j} state is {lay['type']}, these weights need {type(att).__name__}")
        kw = dict(lay["scalars"])
        for f in dataclasses.fields(att):
            v = getattr(att, f.name)
            if hasattr(v, "shape"):
                a = z[f"{key}/{j}/{f.name}"]
                if a.dtype != v.dtype or a.shape[0] != v.shape[0]:
                    raise ValueError(f"saved {key} layer {j} {f.name}: {a.dtype}{a.shape}, these weights need {v.dtype}{v.shape}")
                kw[f.name] = weights.xp.asarray(a)
        layers.append(KimiLayerState(dataclasses.replace(att, **kw)))
    return model_state(weights, KimiDecodeState(layers, int(layout["position"])))


GLOBAL_TENSORS = ("embed_tokens", "output_attn_res_score", "norm", "lm_head")  # in the fingerprint's order


def weights_fingerprint(weights) -> dict:
    """Config, layer ids, dtype and a hash of a sample of every weight tensor (cheap even for K3).

    A pipeline (`weights.weight_samples()` gathered from its stages) fingerprints as the same
    checkpoint loaded in one process, so a session file moves between the two."""
    cfg = json.dumps(dataclasses.asdict(weights.config), sort_keys=True, default=str)
    global_samples, layer_samples = weights.weight_samples() if hasattr(weights, "stages") else weight_samples(weights)
    h = hashlib.sha256()
    for sample in [global_samples[k] for k in GLOBAL_TENSORS] + layer_samples:
        h.update(sample)
    return {"config": hashlib.sha256(cfg.encode()).hexdigest()[:16], "layer_ids": [int(i) for i in weights.layer_ids],
            "dtype": np.dtype(weights.dtype).name, "weights": h.hexdigest()[:16]}


def weight_samples(weights) -> tuple[dict, list]:
    """({global tensor: sample bytes} for those loaded, [sample bytes of each layer tensor, layer by layer])."""
    xp = array_namespace(weights.layers[0].input_layernorm)
    globals_ = {k: _sample(getattr(weights, k)) for k in GLOBAL_TENSORS if getattr(weights, k) is not None}
    return globals_, [_sample(a) for layer in weights.layers for a in _arrays_of(layer, xp)]


def _sample(a) -> bytes:
    flat = a.reshape(-1)
    return np.ascontiguousarray(to_numpy(flat[:: max(1, flat.shape[0] // 64)][:64])).tobytes()


def _arrays_of(layer, xp):
    """Every weight array of one layer (a layer at a time, so a pipeline's stages concatenate)."""
    stack = [layer]
    while stack:
        obj = stack.pop(0)
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if f.name == "experts":  # hash dequantised values, so packed and dense banks agree
                yield from v.gather(xp.asarray([0, v.num_experts - 1]))
            elif hasattr(v, "shape") and hasattr(v, "reshape"):
                yield v
            elif dataclasses.is_dataclass(v):
                stack.append(v)


def _check_fingerprint(path, saved: dict, here: dict) -> None:
    diff = [k for k in ("config", "layer_ids", "dtype", "weights") if saved.get(k) != here.get(k)]
    if diff:
        parts = "; ".join(f"{k}: file {saved.get(k)!r}, weights {here.get(k)!r}" for k in diff)
        raise ValueError(f"{path} was saved from a different model than these weights ({parts}). "
                         "Load it with the same checkpoint, layers= and dtype= it was saved with.")
