"""Checkpoint -> `KimiDecoderWeights`: the one place that owns the released tensor names.

Layout (Hugging Face, `moonshotai/Kimi-K3`): `config.json`, `model.safetensors.index.json` whose
`weight_map` names the shard of every tensor (or one `model.safetensors`), names prefixed
`language_model.` (the unprefixed `model.` form is accepted too). BF16 matrices, F32 small vectors,
routed experts as MXFP4 `weight_packed`/`weight_scale` pairs (dense `weight` accepted too).

Loading is planned before anything is allocated: every tensor the requested layers need is looked
up in the index, its shard opened (headers checked against the file size) and its dtype and shape
checked against the config. Only then are tensors read, each straight into its final (fused)
buffer (`tensor_reader`: no second copy, no mapped pages left resident). Any problem raises
`CheckpointError` and nothing is returned half-loaded.

Resident forms (options of `load_weights`): matrices in the compute dtype or as bf16 bits
(`bf16_weights.Bf16Matrix`); routed experts dequantised up front (`experts.DenseExperts`), kept
MXFP4-packed with an LRU cache of dequantised experts (`experts.PackedExperts`), or left in the
shard files as read-only memory maps (`mapped_experts.MappedExperts`: nothing of them copied).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .. import backend
from ..backend import resolve_device, resolve_dtype
from ..errors import CheckpointError
from ..model.config import KimiDecoderConfig
from ..model.kda import KdaWeights
from ..model.kimi_decoder import KimiDecoderLayerWeights, KimiDecoderWeights
from ..model.latent_moe import LatentMoeWeights
from ..model.mla import MlaWeights
from ..model.ops import DenseMlpWeights
from . import checkpoint_table as table
from . import mxfp4, mxfp4_matvec
from .bf16_matvec import runs as bf16_kernel_runs
from .bf16_weights import Bf16Matrix, WideningScratch
from .checkpoint_table import DiskTensor
from .experts import DenseExperts, PackedExperts
from .mapped_experts import ExpertViews, MappedExperts
from .safetensors_io import SafetensorsFile
from .tensor_reader import TensorReader
from .workspace import Workspace

FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointDir:
    """A checkpoint directory: its weight map, name prefix and lazily opened shards."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._files: dict[str, SafetensorsFile] = {}
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a checkpoint directory (expected config.json + safetensors)")
        index = self.path / INDEX_FILE
        if index.exists():
            try:
                raw = json.loads(index.read_text())
                self.weight_map = dict(raw["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index (need a 'weight_map' object): {e}") from None
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


# ---------------------------------------------------------------- the plan: names and shapes (checkpoint_table)


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
        shown = ", ".join(ckpt.full(n) for n in missing[:12])
        more = f" (and {len(missing) - 12} more)" if len(missing) > 12 else ""
        raise CheckpointError(
            f"{ckpt.path}: {len(missing)} tensor(s) the config requires are not in the weight map: {shown}{more}"
        )
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


def _check(ckpt: CheckpointDir, plan: dict[str, DiskTensor]) -> None:
    """Every planned tensor exists, in a shard that exists, with the right dtype and shape."""
    needed = shards_needed(ckpt, plan)
    absent = {s: ids for s, ids in needed.items() if not (ckpt.path / s).exists()}
    if absent:
        raise CheckpointError(f"{ckpt.path}: shard file(s) named in the index are missing: " + missing_shards_message(absent))
    for n, want in plan.items():
        f = ckpt.open(ckpt.shard_of(n))
        full = ckpt.full(n)
        if full not in f:
            raise CheckpointError(f"{f.path}: the index places tensor '{full}' in this shard, but it is not there")
        dtype, shape = f.info(full)
        check_tensor(f.path, full, dtype, shape, want)


def check_tensor(path, full: str, dtype: str, shape: tuple, want: DiskTensor) -> None:
    """Raise CheckpointError unless a tensor of `dtype` and `shape` is what the table plans (`want`).

    Floats load from any float dtype (BF16/F16/F32/F64); the halves of an MXFP4 pair must be U8.
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
    if dtype not in FLOAT_DTYPES:
        bad(f"a float tensor (released as {want.dtype}) of shape {expected}")
    if tuple(shape) not in shapes:
        bad(f"shape {expected}")


# ---------------------------------------------------------------- building the records


class _Builder:
    """Reads planned tensors into device buffers in the compute dtype (or bf16 bits, `weight_dtype`)."""

    def __init__(self, ckpt: CheckpointDir, cfg: KimiDecoderConfig, xp, dtype, bf16_matrices: bool, bf16_kernel=None):
        self.ckpt, self.cfg, self.xp, self.dtype, self.bf16_kernel = ckpt, cfg, xp, dtype, bf16_kernel
        self.reader = TensorReader(lambda n: (ckpt.open(ckpt.shard_of(n)), ckpt.full(n)))
        self.workspace = Workspace(xp, widening=WideningScratch(xp) if bf16_matrices else None)
        self.scratch = self.workspace.widening

    def mapped(self, name: str) -> np.ndarray:
        """A read-only uint8 view of the tensor's bytes in its shard's memory map (nothing read now);
        the view keeps the map alive after the loader closes the checkpoint."""
        return np.asarray(self.ckpt.open(self.ckpt.shard_of(name)).array(self.ckpt.full(name)))

    def host(self, name: str, dtype=None) -> np.ndarray:
        return self.reader.read(name, self.dtype if dtype is None else dtype)

    def dev(self, a):
        return self.xp.asarray(a)

    def one(self, name: str, shape=None):
        a = self.host(name)
        return self.dev(a.reshape(shape) if shape is not None else a)

    def matrix(self, names: list[str], by_rows: bool = False):
        """A 2-D weight, row-concatenating `names` (fusion of projections that read the same input).

        With weight_dtype="bfloat16" and every part BF16 on disk, kept as bf16 bits (`Bf16Matrix`);
        otherwise in the compute dtype. Each part is read straight into its rows of the final buffer.
        by_rows: the matrix is only ever read by rows (the embedding), so it needs no widening scratch.
        """
        infos = [self.reader.info(n) for n in names]
        bits = self.scratch is not None and all(code == "BF16" for code, _ in infos)
        out = np.empty((sum(shape[0] for _, shape in infos), infos[0][1][1]), np.uint16 if bits else self.dtype)
        r = 0
        for n, (_, shape) in zip(names, infos, strict=True):
            self.reader.read(n, out.dtype, out=out[r : r + shape[0]])
            r += shape[0]
        dev = self.dev(out)
        if not bits:
            return dev
        m = Bf16Matrix(dev, self.scratch, self.dtype, kernel=self.bf16_kernel, pool=self.workspace.pool)
        if not by_rows and not m.uses_kernel:  # the widening route needs the scratch; reserve it now
            self.scratch.reserve(dev.size)
        return m


class _At:
    """The builder's reads for one table at one layer, by row key or fused record field."""

    def __init__(self, b: _Builder, kind: table.Kind, i: int | None = None):
        self.b, self.kind, self.i = b, kind, i

    def name(self, key: str, e: int | None = None) -> str:
        return self.kind.name(key, self.i, e)

    def host(self, key: str, dtype=None) -> np.ndarray:
        return self.b.host(self.name(key), dtype)

    def one(self, key: str, shape=None):
        return self.b.one(self.name(key), shape)

    def matrix(self, field: str, by_rows: bool = False):
        return self.b.matrix(self.kind.parts(self.b.cfg, field, self.i), by_rows)

    def score(self, field: str):
        """An attn-res score vector: the RMSNorm gain times its [1, d] projection (float64, then cast)."""
        norm, proj = self.kind.parts(self.b.cfg, field, self.i)
        g = self.b.host(norm, np.float64)
        p = self.b.host(proj, np.float64).reshape(-1)
        return self.b.dev((g * p).astype(self.b.dtype))


def _kda(b: _Builder, cfg: KimiDecoderConfig, i: int) -> KdaWeights:
    la, t = cfg.linear_attn_config, _At(b, table.KDA, i)
    H, K = la.num_heads, la.head_dim
    a_log = t.host("A_log")
    if a_log.shape[0] != H and np.any(a_log[H:] != 0):
        raise CheckpointError(
            f"{b.ckpt.path}: tensor '{b.ckpt.full(t.name('A_log'))}' is stored {a_log.shape[0]} wide with non-zero "
            f"entries past num_heads={H}; K3 stores one value per head, zero-padded to head_dim. Refusing to guess its layout."
        )
    conv = np.stack([b.host(n)[:, 0, :] for n in table.KDA.parts(cfg, "conv", i)])  # [3, P, W]: q, k, v
    return KdaWeights(
        in_proj=t.matrix("in_proj"), f_b_proj=t.matrix("f_b_proj"), conv=b.dev(conv),
        A=b.dev(np.exp(a_log[:H].astype(np.float64)).astype(b.dtype).reshape(H, 1)),
        dt_bias=t.one("dt_bias", (H, K)), o_norm=t.one("o_norm"), o_proj=t.matrix("o_proj"),
        num_heads=H, head_dim=K, lower_bound=float(la.gate_lower_bound), eps=cfg.rms_norm_eps,
    )


def _mla(b: _Builder, cfg: KimiDecoderConfig, i: int) -> MlaWeights:
    t = _At(b, table.MLA, i)
    return MlaWeights(
        in_proj=t.matrix("in_proj"), q_a_layernorm=t.one("q_a_layernorm"), q_b_proj=t.matrix("q_b_proj"),
        kv_a_layernorm=t.one("kv_a_layernorm"), kv_b_proj=t.matrix("kv_b_proj"),
        o_proj=t.matrix("o_proj"), num_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, use_output_gate=cfg.mla_use_output_gate,
    )


EXPERT_BANKS = ("w13", "w2")  # the banks' fields: w13 = rows of w1 (gate) then w3 (up); w2 (down)


def _experts_packed_on_disk(ckpt: CheckpointDir, cfg: KimiDecoderConfig, i: int) -> bool:
    M = table.MOE
    return all(ckpt.has(table.mxfp4_names(M.name(k, i, e))[0]) for e in range(cfg.num_experts) for k in M.expert_keys)


def _packed_experts(b: _Builder, cfg: KimiDecoderConfig, i: int, capacity: int, chunk: int = 16) -> PackedExperts:
    """Read the MXFP4 bytes of every expert into [E, rows, ...] uint8 banks, `chunk` experts per upload."""
    t, E, on_host = _At(b, table.MOE, i), cfg.num_experts, backend.on_host(b.xp)
    banks = {}
    for field in EXPERT_BANKS:
        keys = table.MOE.keys(field)
        rows = [table.MOE.shape(cfg, k)[0] for k in keys]
        cols = table.MOE.shape(cfg, keys[0])[1]
        for half, width in ((0, cols // 2), (1, cols // mxfp4.GROUP)):  # weight_packed, weight_scale
            bank = (np.empty if on_host else b.xp.empty)((E, sum(rows), width), np.uint8)
            for a in range(0, E, chunk):
                experts = range(a, min(E, a + chunk))
                dst = bank[a : a + len(experts)] if on_host else np.empty((len(experts), sum(rows), width), np.uint8)
                for j, e in enumerate(experts):
                    r = 0
                    for k, n in zip(keys, rows, strict=True):
                        b.reader.read(table.mxfp4_names(t.name(k, e))[half], np.uint8, out=dst[j, r : r + n])
                        r += n
                if not on_host:
                    bank[a : a + len(experts)] = b.xp.asarray(dst)
            banks[f"{field}_{('packed', 'scale')[half]}"] = bank
    return PackedExperts(**banks, dtype=b.dtype, capacity=capacity, workspace=b.workspace)


def _mapped_experts(b: _Builder, cfg: KimiDecoderConfig, i: int, capacity: int) -> MappedExperts:
    """Views of every expert's MXFP4 tensors in the mapped shards: nothing is read or copied."""
    t = _At(b, table.MOE, i)
    views = {}
    for field in EXPERT_BANKS:
        keys = table.MOE.keys(field)
        for half, what in ((0, "packed"), (1, "scale")):
            blocks = [[b.mapped(table.mxfp4_names(t.name(k, e))[half]) for k in keys] for e in range(cfg.num_experts)]
            views[f"{field}_{what}"] = ExpertViews(blocks, b.xp)
    return MappedExperts(**views, dtype=b.dtype, capacity=capacity, workspace=b.workspace)


def _dense_experts(b: _Builder, cfg: KimiDecoderConfig, i: int) -> DenseExperts:
    """Every expert dequantised (MXFP4 through `mxfp4.dequantize`) or widened (dense on disk)."""
    t, E = _At(b, table.MOE, i), cfg.num_experts
    banks = {}
    for field in EXPERT_BANKS:
        keys = table.MOE.keys(field)
        shapes = [table.MOE.shape(cfg, k) for k in keys]
        bank = banks[field] = np.empty((E, sum(r for r, _ in shapes), shapes[0][1]), b.dtype)
        for e in range(E):
            r = 0
            for k, (n, _) in zip(keys, shapes, strict=True):
                name, dst = t.name(k, e), bank[e, r : r + n]
                if b.ckpt.has(name):
                    b.reader.read(name, b.dtype, out=dst)
                else:
                    packed, scale = (b.reader.read(x, np.uint8) for x in table.mxfp4_names(name))
                    mxfp4.dequantize(packed, scale, out=dst, dtype=b.dtype)
                r += n
    return DenseExperts(b.dev(banks["w13"]), b.dev(banks["w2"]))


def _moe(b: _Builder, cfg: KimiDecoderConfig, i: int, experts: str, cache_size: int) -> LatentMoeWeights:
    t = _At(b, table.MOE, i)
    if experts in ("packed", "mapped"):
        if not _experts_packed_on_disk(b.ckpt, cfg, i):
            raise CheckpointError(
                f"{b.ckpt.path}: experts={experts!r} but layer {i}'s routed experts are not all MXFP4 "
                "(weight_packed/weight_scale) on disk; load with experts='dense'"
            )
        bank = (_packed_experts if experts == "packed" else _mapped_experts)(b, cfg, i, cache_size)
    else:
        bank = _dense_experts(b, cfg, i)
    return LatentMoeWeights(
        in_proj=t.matrix("in_proj"), e_score_correction_bias=t.one("bias"), experts=bank,
        routed_expert_norm=t.one("latent_norm"), routed_expert_up_proj=t.matrix("latent_up"),
        shared_down_proj=t.matrix("shared_down"), num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_token, latent_size=cfg.routed_expert_hidden_size, renormalize=bool(cfg.moe_renormalize),
        routed_scaling_factor=float(cfg.routed_scaling_factor), use_latent_norm=bool(cfg.latent_moe_use_norm),
        eps=cfg.rms_norm_eps, situ_beta=float(cfg.activation_situ_beta),
        situ_linear_beta=None if cfg.activation_situ_linear_beta is None else float(cfg.activation_situ_linear_beta),
    )


def _layer(b: _Builder, cfg: KimiDecoderConfig, i: int, experts: str, cache_size: int) -> KimiDecoderLayerWeights:
    _, attn, ffn = table.layer_kinds(cfg, i)
    t = _At(b, table.LAYER, i)
    if ffn is table.MOE:
        mlp = _moe(b, cfg, i, experts, cache_size)
    else:
        d = _At(b, table.DENSE_MLP, i)
        mlp = DenseMlpWeights(d.matrix("gate_up"), d.matrix("down_proj"))
    return KimiDecoderLayerWeights(
        index=i, input_layernorm=t.one("input_layernorm"), post_attention_layernorm=t.one("post_attention_layernorm"),
        attn_res_score=t.score("attn_res_score"), mlp_res_score=t.score("mlp_res_score"),
        attention=(_kda if attn is table.KDA else _mla)(b, cfg, i), ffn=mlp, is_block_boundary=cfg.is_block_boundary(i),
    )


# ---------------------------------------------------------------- options

EXPERT_MODES = ("auto", "packed", "mapped", "dense")
BF16_MATVECS = ("auto", "kernel", "widen")
AUTO_DENSE_BYTES = 1 << 30  # experts="auto": dequantise up front when all requested experts fit in this
AUTO_CACHE_BYTES = 512 << 20  # expert_cache_size=None: the experts per layer whose dequantised copies fit in this


def _expert_bytes(cfg: KimiDecoderConfig, dtype) -> int:
    return 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size * np.dtype(dtype).itemsize


def _resolve_experts(experts: str, cfg: KimiDecoderConfig, layer_ids, ckpt: CheckpointDir, dtype) -> str:
    if experts not in EXPERT_MODES:
        raise ValueError(f"experts={experts!r}: expected one of {', '.join(map(repr, EXPERT_MODES))}")
    if experts != "auto":
        return experts
    moe = [i for i in layer_ids if cfg.is_moe_layer(i)]
    if not all(_experts_packed_on_disk(ckpt, cfg, i) for i in moe):
        return "dense"
    return "dense" if len(moe) * cfg.num_experts * _expert_bytes(cfg, dtype) <= AUTO_DENSE_BYTES else "packed"


def _resolve_cache_size(size, cfg: KimiDecoderConfig, dtype, xp) -> int:
    if size is None:  # bounded memory: at K3 size an expert is 132 MB dequantised (3 fit per layer)
        fit = AUTO_CACHE_BYTES // _expert_bytes(cfg, dtype)
        if fit >= cfg.num_experts:
            return cfg.num_experts
        # a cache holding a few of the layer's experts mostly misses: on the host the fused kernel
        # multiplies straight from the packed bytes instead (capacity 0 selects it)
        return 0 if mxfp4_matvec.runs(xp, dtype) else fit
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
        raise ValueError(f"expert_cache_size={size!r}: expected None or a number of experts per layer >= 0")
    return int(size)


def _resolve_weight_dtype(weight_dtype, dtype) -> bool:
    """True when the big matrices stay bf16-resident."""
    if weight_dtype is None or weight_dtype == np.dtype(dtype).name:
        return False
    if weight_dtype in ("bfloat16", "bf16"):
        return True
    raise ValueError(f"weight_dtype={weight_dtype!r}: expected None (= dtype, {np.dtype(dtype).name!r}) or 'bfloat16'")


def _resolve_bf16_matvec(route: str) -> bool | None:
    """Bf16Matrix's `kernel`: None = the compiled kernel where it runs, True = required, False = widen."""
    if route not in BF16_MATVECS:
        raise ValueError(f"bf16_matvec={route!r}: expected one of {', '.join(map(repr, BF16_MATVECS))}")
    return {"auto": None, "kernel": True, "widen": False}[route]


def resolve_layers(layers, num_hidden_layers: int) -> list[int]:
    if layers is None:
        return list(range(num_hidden_layers))
    try:
        ids = [int(i) for i in layers]
    except (TypeError, ValueError):
        raise ValueError(f"layers={layers!r}: expected None or an iterable of 0-based layer indices") from None
    if not ids:
        raise ValueError("layers=[] selects no layer; pass None for all layers")
    bad = [i for i in ids if not 0 <= i < num_hidden_layers]
    if bad:
        raise ValueError(f"layers: {bad} outside 0..{num_hidden_layers - 1} (the config has {num_hidden_layers} layers)")
    if sorted(set(ids)) != ids:
        raise ValueError(f"layers={ids}: expected strictly increasing layer indices")
    return ids


def load_weights(path, *, layers=None, device: str = "auto", dtype: str = "float32", weight_dtype: str | None = None,
                 experts: str = "auto", expert_cache_size: int | None = None, bf16_matvec: str = "auto",
                 embedding: bool = True, head: bool = True, revision: str | None = None,
                 cache_dir=None, local_files_only: bool | None = None, token=None, progress: bool = True) -> KimiDecoderWeights:
    """Load a K3 checkpoint (all layers, or the 0-based `layers` chosen) onto `device`.

    path: a checkpoint directory, or a Hub repo id ('org/name'): then only config, index, tokenizer
        files and the shards of the requested layers are fetched (`kimi_explore.weights.hub`; `revision`,
        `cache_dir`, `local_files_only`, `token` go to huggingface_hub; HF_HUB_OFFLINE=1 works).
    dtype: compute dtype of activations and widened weights ("float32" | "float64").
    weight_dtype: None keeps every matrix in `dtype`; "bfloat16" keeps the matrices stored as BF16 on
        disk as bf16 bits (half the memory), multiplied as `bf16_matvec` says.
    bf16_matvec: with weight_dtype="bfloat16": "auto" (default) = the compiled bf16 kernel where it
        runs (CPU, float32, built; float32 sums in another order than BLAS, ~1e-7), else widening;
        "widen" = widen each matrix per use, then BLAS (logits bit-identical to the float32 trunk,
        slower on the CPU); "kernel" = require the kernel.
    experts: "dense" dequantises every routed expert at load; "packed" keeps the MXFP4 bytes and
        dequantises the selected ones per token (same logits bit for bit) or, with no cache on the
        CPU, multiplies them fused (see expert_cache_size); "mapped" is "packed" with the bytes left
        in the shard files as read-only memory maps, nothing copied at load, paged in by the OS on
        first use (bit-identical to "packed" with the same cache size; on a GPU the selected
        experts are copied to the device per use); "auto" (default) is dense when all requested
        experts dequantised fit in 1 GiB (the tiny models), else packed (K3).
    expert_cache_size: with packed experts, dequantised experts kept PER LAYER in an LRU cache;
        0 = no cache: on the CPU in float32 the selected experts are then multiplied straight from
        their packed bytes by the compiled kernel (`mxfp4_matvec`, when built; the same weights,
        float32 sums in another order), else dequantised per token. None = all of a layer's
        experts if they fit in 512 MiB (the tiny models); otherwise 0 on the CPU with the kernel
        (K3: reading 280 MB packed beats reading 2.1 GB dequantised), else as many as fit (3 of K3's).
    embedding=False / head=False: leave out the token embedding (`embed_tokens` is None) / the output
        mix, final norm and lm_head (None): a pipeline stage after the first / before the last, which
        then reads neither those tensors nor a shard that holds only them.
    """
    from .hub import resolve_checkpoint

    xp, dev = resolve_device(device)
    dt = resolve_dtype(dtype)
    bf16 = _resolve_weight_dtype(weight_dtype, dt)
    bf16_kernel = _resolve_bf16_matvec(bf16_matvec)
    path = resolve_checkpoint(path, layers=layers, revision=revision, cache_dir=cache_dir,
                              local_files_only=local_files_only, token=token, progress=progress,
                              embedding=embedding, head=head)
    cfg = KimiDecoderConfig.from_file(path / "config.json")
    layer_ids = resolve_layers(layers, cfg.num_hidden_layers)
    ckpt = CheckpointDir(path)
    b = None
    try:
        _check(ckpt, plan_tensors(cfg, layer_ids, ckpt, embedding, head))
        mode = _resolve_experts(experts, cfg, layer_ids, ckpt, dt)
        cache_size = _resolve_cache_size(expert_cache_size, cfg, dt, xp)
        b = _Builder(ckpt, cfg, xp, dt, bf16, bf16_kernel)
        g = _At(b, table.GLOBAL)
        tied = cfg.tie_word_embeddings
        embed = g.matrix("embed_tokens", by_rows=True) if embedding or (head and tied) else None
        return KimiDecoderWeights(
            config=cfg, embed_tokens=embed, layers=[_layer(b, cfg, i, mode, cache_size) for i in layer_ids],
            output_attn_res_score=g.score("output_attn_res_score") if head else None,
            norm=g.one("norm") if head else None,
            lm_head=None if not head else embed if tied else g.matrix("lm_head"),
            xp=xp, device=dev, dtype=dt, source=str(path), workspace=b.workspace,
            extra={"experts": mode, "expert_cache_size": cache_size if mode in ("packed", "mapped") else None,
                   "weight_dtype": "bfloat16" if bf16 else np.dtype(dt).name,
                   "bf16_matvec": (("kernel" if bf16_kernel is not False and bf16_kernel_runs(xp, dt) else "widen")
                                   if bf16 else None)},
        )
    finally:
        if b is not None:
            b.reader.close()
        ckpt.close()
