"""A safetensors checkpoint directory, and the load plan checked against it before anything is read.

Layout (Hugging Face, `moonshotai/Kimi-K3`): `config.json`, `model.safetensors.index.json` whose
`weight_map` names the shard of every tensor (or one `model.safetensors`), names prefixed
`language_model.` (the unprefixed `model.` form is accepted too). BF16 matrices, F32 small vectors,
routed experts as MXFP4 `weight_packed`/`weight_scale` pairs (dense `weight` accepted too).

    ckpt = CheckpointDir(path)                              # index, prefix, shards (opened lazily)
    plan = plan_tensors(cfg, layer_ids, ckpt)               # {name: DiskTensor}, from checkpoint_table
    check_checkpoint(ckpt, plan)                            # every tensor there, right dtype and shape

Loading is planned before anything is allocated: every tensor the requested layers need is looked
up in the index, its shard opened (headers checked against the file size) and its dtype and shape
checked against the config; any problem raises `CheckpointError`, listing what is missing. The Hub
plan (`hub.py`) uses the same plan to choose the shards it downloads. Reading the tensors is
`safetensors_source.py`'s; building the weight records from them is `records.py`'s.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from pathlib import Path, PurePath

import numpy as np

from ..errors import CheckpointError, DuplicateKeyError, listed, unique_keys
from ..model.config import KimiDecoderConfig
from . import checkpoint_table as table
from . import mxfp4
from .checkpoint_table import DiskTensor
from .mapped_file import closed_on_error
from .safetensors_io import SafetensorsFile

# the float dtypes a released BF16 / F32 tensor loads from, narrowest first: its own, or a wider copy that holds
# its values exactly (a narrower one rounded them: refused). Not F16: its 5 exponent bits cannot hold BF16's
# range (no exact copy), and no K3 checkpoint stores it, so an F16 header is a damaged dtype field or a lossy
# conversion (its bytes read as F16 run another model)
FLOAT_DTYPES = ("BF16", "F32", "F64")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointDir:
    """A checkpoint directory: its weight map, name prefix and lazily opened shards."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._files: dict[str, SafetensorsFile] = {}
        with closed_on_error(self):  # (the single file opened for its names: refused, not left open)
            self._read_index()

    def _read_index(self) -> None:
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a checkpoint directory (expected config.json + safetensors)")
        index = self.path / INDEX_FILE
        if index.exists():
            try:
                raw = json.loads(index.read_text(), object_pairs_hook=unique_keys)
                self.weight_map = raw["weight_map"]
                if not isinstance(self.weight_map, dict):
                    raise TypeError(f"'weight_map' is a {type(self.weight_map).__name__}, not an object")
            except DuplicateKeyError as e:  # json.loads would keep the last shard named, silently
                raise CheckpointError(f"{index}: '{e.args[0]}' is given twice in one object (a tensor placed in two "
                                      "shards, or a key repeated): which one is meant cannot be told; keep one") from None
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index (need a 'weight_map' object): {e}") from None
            bad = [(k, v) for k, v in self.weight_map.items() if not _inside(v)]
            if bad:
                raise CheckpointError(f"{index}: weight_map must name shard files inside {self.path} (relative paths, no "
                                      f"'..'), found {listed((f'{k!r}: {v!r}' for k, v in bad), 4)}")
        elif (self.path / SINGLE_FILE).exists():
            single = self.open(SINGLE_FILE)
            self.weight_map = {k: SINGLE_FILE for k in single.keys()}
        else:
            raise CheckpointError(f"{self.path}: neither {INDEX_FILE} nor {SINGLE_FILE} is there")
        if "language_model.model.embed_tokens.weight" in self.weight_map:
            self.prefix = "language_model."
        elif "model.embed_tokens.weight" in self.weight_map:
            self.prefix = ""
        else:
            raise CheckpointError(
                f"{self.path}: the weight map has neither 'language_model.model.embed_tokens.weight' (released K3 "
                "layout) nor 'model.embed_tokens.weight'; is this a Kimi K3 checkpoint?"
            )

    def full(self, name: str) -> str:
        return self.prefix + name

    def has(self, name: str) -> bool:
        return self.full(name) in self.weight_map

    def shard_of(self, name: str) -> str:
        return self.weight_map[self.full(name)]

    def open(self, shard: str) -> SafetensorsFile:
        if shard not in self._files:
            self._files[shard] = SafetensorsFile(self.path / shard)
        return self._files[shard]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _inside(shard) -> bool:
    """Whether a weight_map value names a file inside the checkpoint directory (not the directory itself: ".")."""
    return (isinstance(shard, str) and bool(PurePath(shard).parts) and not PurePath(shard).is_absolute()
            and ".." not in PurePath(shard).parts)


def plan_tensors(cfg: KimiDecoderConfig, layer_ids: list[int], ckpt: CheckpointDir, embedding: bool = True,
                 head: bool = True) -> dict[str, DiskTensor]:
    """{unprefixed name: what it must be on disk} for the global tensors (see `table.plan`) and layers `layer_ids`.

    A routed expert is planned as its MXFP4 pair unless only its dense `weight` is on disk.
    """
    out: dict[str, DiskTensor] = {}
    for t in table.plan(cfg, layer_ids, embedding, head):
        packed = t.dtype == table.MXFP4 and (ckpt.has(table.mxfp4_names(t.name)[0]) or not ckpt.has(t.name))
        out.update((d.name, d) for d in table.on_disk(t, packed))
    return out


def _layer_of(name: str):
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


GLOBAL = -1  # stands for "the global tensors" (embedding, final norm and mix, lm_head) in shard listings


def shards_needed(ckpt: CheckpointDir, plan: dict[str, tuple]) -> dict[str, list[int]]:
    """{shard file: sorted layer ids whose tensors it holds (GLOBAL = -1 for the global ones)}, in shard order.

    Raises if the weight map lacks any planned tensor (listing them).
    """
    missing = [n for n in plan if not ckpt.has(n)]
    if missing:
        raise CheckpointError(f"{ckpt.path}: {len(missing)} tensor(s) the config requires are not in the weight map: "
                              f"{listed(ckpt.full(n) for n in missing)}")
    by_shard: dict[str, set] = {}
    for n in plan:
        layer = _layer_of(n)
        by_shard.setdefault(ckpt.shard_of(n), set()).add(GLOBAL if layer is None else layer)
    return {s: sorted(by_shard[s]) for s in sorted(by_shard)}


def missing_shards_message(missing: dict[str, list[int]]) -> str:
    """'a.safetensors (needed by layers [0, 1] and global tensors); ...' for {shard: layer ids}."""
    lines = []
    for s, ids in sorted(missing.items()):
        layers = [i for i in ids if i != GLOBAL]
        what = f"layers {layers}" if layers else "global tensors"
        extra = " and global tensors" if layers and GLOBAL in ids else ""
        lines.append(f"{s} (needed by {what}{extra})")
    return "; ".join(lines)


def check_checkpoint(ckpt: CheckpointDir, plan: dict[str, DiskTensor]) -> None:
    """Every planned tensor exists, in a shard that exists, with the right dtype and shape; the F32 ones finite."""
    needed = shards_needed(ckpt, plan)
    absent = {s: ids for s, ids in needed.items() if not (ckpt.path / s).exists()}
    if absent:
        raise CheckpointError(f"{ckpt.path}: shard file(s) named in the index are missing: " + missing_shards_message(absent))
    folders = {s: ids for s, ids in needed.items() if not (ckpt.path / s).is_file()}
    if folders:
        raise CheckpointError(f"{ckpt.path / INDEX_FILE}: the weight map names directories, not shard files: "
                              + missing_shards_message(folders))
    for n, want in plan.items():
        f = ckpt.open(ckpt.shard_of(n))
        full = ckpt.full(n)
        if full not in f:
            raise CheckpointError(f"{f.path}: the index places tensor '{full}' in this shard, but it is not there")
        dtype, shape = f.info(full)
        check_tensor(f.path, full, dtype, shape, want)
        if want.dtype == "F32":  # the small F32 vectors (a few KB a layer, read now): NaN in the router bias runs
            check_finite(f.path, full, f.array(full))
    for s in needed:  # a tensor the index leaves out would go unseen by `check_no_unexpected`
        f = ckpt.open(s)
        unlisted = [k for k in f.keys() if _language_model(ckpt, k) and ckpt.weight_map.get(k) != s]
        if unlisted:
            raise CheckpointError(f"{f.path}: holds {len(unlisted)} language-model tensor(s) that {INDEX_FILE} does not "
                                  f"place in this shard, so the index and the shards disagree (a tensor the index leaves "
                                  f"out would be ignored, another model run): {listed(unlisted, 4)}")


def check_finite(path, full: str, values: np.ndarray) -> None:
    """Refuse a tensor with a NaN or an infinity: in a small F32 vector (the router bias, dt_bias) it would run another
    model whose logits stay finite (a NaN bias ranks its expert first; an infinite dt_bias fixes a decay)."""
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise CheckpointError(f"{path}: tensor '{full}' holds {bad.size} non-finite value(s) (NaN or inf; the first at "
                              f"flat index {bad[0]}: {values.reshape(-1)[bad[0]]}): a damaged tensor would run another "
                              "model; re-download or re-convert it")


def _language_model(ckpt: CheckpointDir, full: str) -> bool:
    """Whether a weight-map name belongs to the language model (not the vision tower or projector), under
    either prefix: beside the checkpoint's own names, an unprefixed `model.*` or `lm_head.*` name under the
    `language_model.` prefix, or a `language_model.model.*` one in an unprefixed checkpoint, is a stray copy
    that no loader should have to choose between."""
    return full.startswith(("model.", "lm_head.", "language_model.model.", "language_model.lm_head."))


def _mtp_layer(cfg: KimiDecoderConfig, name: str) -> bool:
    """Whether an unprefixed name is a multi-token-prediction layer's (layers N .. N + num_nextn_predict_layers - 1
    after the N decoder layers): a draft head for speculative decoding that the next-token forward never reads."""
    layer = _layer_of(name)
    return layer is not None and cfg.num_hidden_layers <= layer < cfg.num_hidden_layers + cfg.num_nextn_predict_layers


# the tensors of its own that make a layer an MTP block (DeepSeek-V3's layout, the one K3's config key comes
# from; K3's release ships none): beside a decoder block, `enorm` / `hnorm` normalise the next token's embedding
# and the hidden state, `eh_proj` [d, 2d] projects their concatenation (a `shared_head` may follow)
MTP_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight")


def check_mtp_layers(ckpt: CheckpointDir, cfg: KimiDecoderConfig) -> None:
    """Every layer the weight map holds among the MTP layers config.json declares (num_hidden_layers ..
    + num_nextn_predict_layers - 1) is an MTP block: it has `MTP_TENSORS`. A decoder layer there (a config
    whose num_hidden_layers is too small, and that declares MTP layers) would otherwise be left unread, and
    a shorter model would run."""
    n, k = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    held: dict[int, list[str]] = {}
    for full in ckpt.weight_map:
        if full.startswith(ckpt.prefix) and (i := _layer_of(full[len(ckpt.prefix):])) is not None and n <= i < n + k:
            held.setdefault(i, []).append(full[len(ckpt.prefix) + len(table.LAYER_PREFIX.format(i=i)):])
    for i, names in sorted(held.items()):
        lacking = [t for t in MTP_TENSORS if t not in names]
        if lacking:
            at = ckpt.full(table.LAYER_PREFIX.format(i=i))
            found = listed(sorted(names, key=lambda t: (".experts." in t, t.count("."), t)), 6)  # the layer's norms first
            raise CheckpointError(
                f"{ckpt.path}: layer {i} is one of the num_nextn_predict_layers={k} MTP layers config.json declares "
                f"after its num_hidden_layers={n} decoder layers, but it is not an MTP block: it has no "
                f"{', '.join(at + t for t in lacking)} (an MTP layer's own tensors); under '{at}' it holds {found}. "
                "A decoder layer there would be left unread: is num_hidden_layers too small?")


def check_no_unexpected(ckpt: CheckpointDir, cfg: KimiDecoderConfig) -> None:
    """Every language-model tensor in the weight map is one the config's model reads (in some layer), in one form.

    A tensor the config does not account for means config.json describes another model than the
    checkpoint holds (tie_word_embeddings true beside an `lm_head.weight`, num_hidden_layers too small,
    latent_moe_use_norm or mla_use_output_gate false beside their tensors): loading would ignore it
    and run a wrong model, so refuse. So is a routed expert stored both dense and as an MXFP4 pair
    (which one runs would depend on `experts=`). The whole model's plan is used, whatever `layers=` asks;
    the MTP layers that num_nextn_predict_layers declares are accounted for and left unread, once they are
    seen to be MTP blocks (`check_mtp_layers`).
    """
    check_mtp_layers(ckpt, cfg)
    allowed, both = set(), []
    for t in table.plan(cfg):
        allowed.add(t.name)
        if t.dtype == table.MXFP4:
            allowed.update(table.mxfp4_names(t.name))
            if ckpt.has(t.name) and any(ckpt.has(n) for n in table.mxfp4_names(t.name)):
                both.append(ckpt.full(t.name))
    if both:
        raise CheckpointError(f"{ckpt.path}: {len(both)} routed expert weight(s) are in the weight map both dense and as "
                              f"an MXFP4 pair (weight_packed, weight_scale), two versions of one tensor; keep one: "
                              f"{listed(both, 6)}")
    def accounted(full: str) -> bool:  # under the prefix, and read by the model (or an MTP layer it declares)
        name = full[len(ckpt.prefix):]
        return full.startswith(ckpt.prefix) and (name in allowed or _mtp_layer(cfg, name))

    extra = [n for n in ckpt.weight_map if _language_model(ckpt, n) and not accounted(n)]
    if not extra:
        return
    hints = []
    outside = [n for n in extra if not n.startswith(ckpt.prefix) or (not ckpt.prefix and n.startswith("language_model."))]
    if outside:
        hints.append(f"{outside[0]!r} is a language-model name outside the checkpoint's "
                     + (f"{ckpt.prefix!r} prefix" if ckpt.prefix else "unprefixed names"))
    if cfg.tie_word_embeddings and ckpt.full("lm_head.weight") in extra:
        hints.append("tie_word_embeddings is true, but the checkpoint has its own lm_head.weight")
    if not cfg.latent_moe_use_norm and any(n.endswith(table.MOE.row("latent_norm").name) for n in extra):
        hints.append("latent_moe_use_norm is false, but the checkpoint has routed_expert_norm weights")
    layers = sorted({i for n in extra if (i := _layer_of(n[len(ckpt.prefix):])) is not None and i >= cfg.num_hidden_layers})
    if layers:
        hints.append(f"num_hidden_layers={cfg.num_hidden_layers} (and num_nextn_predict_layers="
                     f"{cfg.num_nextn_predict_layers} MTP layers after them), but the checkpoint has layers {layers}")
    hint = "; ".join(hints) or ("check tie_word_embeddings, num_hidden_layers, mla_use_output_gate, "
                                "latent_moe_use_norm and the layer lists")
    raise CheckpointError(
        f"{ckpt.path}: {len(extra)} tensor(s) in the weight map are not part of the model config.json describes, "
        f"so config.json and the weights disagree ({hint}): {listed(extra)}"
    )


def check_tensor(path, full: str, dtype: str, shape: tuple, want: DiskTensor) -> None:
    """Raise CheckpointError unless a tensor of `dtype` and `shape` is what the table plans (`want`).

    Floats load from their released dtype or a wider one (`FLOAT_DTYPES`: exact copies; a narrower one, and F16,
    are refused); the halves of an MXFP4 pair must be U8.
    """
    def bad(expected: str):
        raise CheckpointError(f"{path}: tensor '{full}': expected {expected}, found {dtype}{list(shape)}")

    if want.mxfp4_of is not None:
        rows, cols = want.mxfp4_of
        if cols % mxfp4.GROUP:
            bad(f"an MXFP4 pair, but the logical width {cols} is not a multiple of {mxfp4.GROUP}")
        if dtype != "U8" or tuple(shape) != want.shape:
            bad(f"U8{list(want.shape)} (MXFP4 of a [{rows}, {cols}] weight)")
        return
    shapes = [want.shape] + ([want.also] if want.also is not None and want.also != want.shape else [])
    expected = " or ".join(str(list(s)) for s in shapes)
    if dtype == "F16":
        raise CheckpointError(f"{path}: tensor '{full}': expected {want.dtype} (or an exact F32/F64 copy), found "
                              f"F16{list(shape)}: F16 cannot hold BF16 values exactly and no K3 checkpoint stores it, "
                              "so the header's dtype is damaged or the conversion was lossy; re-download the shard, "
                              "or convert again keeping BF16")
    if dtype not in FLOAT_DTYPES:
        bad(f"a float tensor ({want.dtype}, or an exact F32/F64 copy) of shape {expected}")
    if FLOAT_DTYPES.index(dtype) < FLOAT_DTYPES.index(want.dtype):
        raise CheckpointError(f"{path}: tensor '{full}': expected {want.dtype} (or an exact F64 copy), found "
                              f"{dtype}{list(shape)}: narrower than the release's {want.dtype}, so its values were "
                              f"rounded (a lossy export, such as model.to(torch.bfloat16)) and would run another model; "
                              f"convert again keeping this tensor in {want.dtype}")
    if tuple(shape) not in shapes:
        bad(f"shape {expected}")


def resolve_layers(layers, num_hidden_layers: int) -> list[int]:
    """`layers=` (None = all) as a checked list of 0-based layer ids, strictly increasing."""
    if layers is None:
        return list(range(num_hidden_layers))
    # a string is iterable ("12" would be layers 1 and 2), so is a dict (its keys), int() truncates 1.5 and takes
    # True: refuse them
    try:
        entries = None if isinstance(layers, (str, bytes, Mapping)) else list(layers)
    except TypeError:
        entries = None
    if entries is None or not all(isinstance(i, numbers.Integral) and not isinstance(i, (bool, np.bool_))
                                  for i in entries):
        raise ValueError(f"layers={layers!r:.200}: expected None or an iterable of 0-based integer layer indices")
    ids = [int(i) for i in entries]
    if not ids:
        raise ValueError("layers=[] selects no layer; pass None for all layers")
    bad = [i for i in ids if not 0 <= i < num_hidden_layers]
    if bad:
        raise ValueError(f"layers: [{listed(bad)}] outside 0..{num_hidden_layers - 1} (the config has {num_hidden_layers} "
                         "layers)")
    if sorted(set(ids)) != ids:
        raise ValueError(f"layers=[{listed(ids)}]: expected strictly increasing layer indices")
    return ids


def experts_packed_on_disk(ckpt: CheckpointDir, cfg: KimiDecoderConfig, i: int) -> bool:
    """Whether every routed expert of layer i is an MXFP4 pair (`weight_packed`/`weight_scale`) in the weight map."""
    M = table.MOE
    return all(ckpt.has(table.mxfp4_names(M.name(k, i, e))[0]) for e in range(cfg.num_experts) for k in M.expert_keys)
