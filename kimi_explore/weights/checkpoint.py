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
(`bf16_weights.Bf16Matrix`); routed experts dequantised up front (`experts.DenseExperts`) or kept
MXFP4-packed with an LRU cache of dequantised experts (`experts.PackedExperts`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..backend import resolve_device, resolve_dtype
from ..model.config import KimiDecoderConfig
from ..model.kda import KdaWeights
from ..model.kimi_decoder import KimiDecoderLayerWeights, KimiDecoderWeights
from ..model.latent_moe import LatentMoeWeights
from ..model.mla import MlaWeights
from ..model.ops import DenseMlpWeights
from . import mxfp4, mxfp4_matvec
from .bf16_weights import Bf16Matrix, WideningScratch
from .experts import DenseExperts, PackedExperts
from .safetensors_io import CheckpointError, SafetensorsFile
from .tensor_reader import TensorReader

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


# ---------------------------------------------------------------- the plan: names and shapes


def _layer_tensors(cfg: KimiDecoderConfig, i: int, ckpt: CheckpointDir) -> dict[str, tuple]:
    """{name (without prefix): expected shape} for layer i. A_log's shape is checked on its own."""
    d, L = cfg.hidden_size, f"model.layers.{i}."
    t = {L + n: (d,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                "self_attention_res_norm.weight", "mlp_res_norm.weight")}
    t[L + "self_attention_res_proj.weight"] = (1, d)
    t[L + "mlp_res_proj.weight"] = (1, d)
    A = L + "self_attn."
    if cfg.is_kda_layer(i):
        la = cfg.linear_attn_config
        H, K, W, P = la.num_heads, la.head_dim, la.short_conv_kernel_size, cfg.kda_proj_width
        for s in "qkv":
            t[A + f"{s}_proj.weight"] = (P, d)
            t[A + f"{s}_conv1d.weight"] = (P, 1, W)
        t.update({A + "f_a_proj.weight": (K, d), A + "f_b_proj.weight": (P, K), A + "b_proj.weight": (H, d),
                  A + "g_proj.weight": (P, d), A + "o_norm.weight": (K,), A + "o_proj.weight": (d, P),
                  A + "dt_bias": (P,), A + "A_log": None})
    else:
        nh, dq, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
        ql, kl = cfg.q_lora_rank, cfg.kv_lora_rank
        t.update({A + "q_a_proj.weight": (ql, d), A + "q_a_layernorm.weight": (ql,), A + "q_b_proj.weight": (nh * dq, ql),
                  A + "kv_a_proj_with_mqa.weight": (kl + cfg.qk_rope_head_dim, d), A + "kv_a_layernorm.weight": (kl,),
                  A + "kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + dv), kl), A + "o_proj.weight": (d, nh * dv)})
        if cfg.mla_use_output_gate:
            t[A + "g_proj.weight"] = (nh * dv, d)
    if cfg.is_moe_layer(i):
        M, E, l, I = L + "block_sparse_moe.", cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
        Ish = cfg.shared_intermediate_size
        t.update({M + "gate.weight": (E, d), M + "gate.e_score_correction_bias": (E,),
                  M + "routed_expert_down_proj.weight": (l, d), M + "routed_expert_norm.weight": (l,),
                  M + "routed_expert_up_proj.weight": (d, l), M + "shared_experts.gate_proj.weight": (Ish, d),
                  M + "shared_experts.up_proj.weight": (Ish, d), M + "shared_experts.down_proj.weight": (d, Ish)})
        for e in range(E):
            for wn, shape in (("w1", (I, l)), ("w3", (I, l)), ("w2", (l, I))):
                base = M + f"experts.{e}.{wn}."
                if ckpt.has(base + "weight_packed") or not ckpt.has(base + "weight"):
                    t[base + "weight_packed"] = ("mxfp4", shape)
                    t[base + "weight_scale"] = ("mxfp4-scale", shape)
                else:
                    t[base + "weight"] = shape
    else:
        I = cfg.intermediate_size
        t.update({L + "mlp.gate_proj.weight": (I, d), L + "mlp.up_proj.weight": (I, d), L + "mlp.down_proj.weight": (d, I)})
    return t


def _global_tensors(cfg: KimiDecoderConfig) -> dict[str, tuple]:
    d, V = cfg.hidden_size, cfg.vocab_size
    t = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,),
         "model.output_attn_res_norm.weight": (d,), "model.output_attn_res_proj.weight": (1, d)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = (V, d)
    return t


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


def _check(ckpt: CheckpointDir, plan: dict[str, tuple], cfg: KimiDecoderConfig) -> None:
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
        _check_one(f.path, full, dtype, shape, want, cfg)


def _check_one(path, full: str, dtype: str, shape: tuple, want, cfg: KimiDecoderConfig) -> None:
    def bad(expected: str):
        raise CheckpointError(f"{path}: tensor '{full}': expected {expected}, found {dtype}{list(shape)}")

    if want is None:  # A_log: per head, stored head_dim wide on disk
        la = cfg.linear_attn_config
        if dtype not in FLOAT_DTYPES or len(shape) != 1 or shape[0] not in (la.num_heads, la.head_dim):
            bad(f"a float vector of {la.num_heads} (num_heads) or {la.head_dim} (head_dim, zero-padded) entries")
        return
    if want[0] in ("mxfp4", "mxfp4-scale"):
        rows, cols = want[1]
        per = 2 if want[0] == "mxfp4" else mxfp4.GROUP
        if cols % mxfp4.GROUP:
            bad(f"an MXFP4 pair, but the logical width {cols} is not a multiple of {mxfp4.GROUP}")
        if dtype != "U8" or tuple(shape) != (rows, cols // per):
            bad(f"U8{[rows, cols // per]} (MXFP4 of a [{rows}, {cols}] weight)")
        return
    if dtype not in FLOAT_DTYPES:
        bad(f"a float tensor (BF16/F16/F32) of shape {list(want)}")
    if tuple(shape) != tuple(want):
        bad(f"shape {list(want)}")


# ---------------------------------------------------------------- building the records


class _Builder:
    """Reads planned tensors into device buffers in the compute dtype (or bf16 bits, `weight_dtype`)."""

    def __init__(self, ckpt: CheckpointDir, xp, dtype, bf16_matrices: bool):
        self.ckpt, self.xp, self.dtype = ckpt, xp, dtype
        self.reader = TensorReader(lambda n: (ckpt.open(ckpt.shard_of(n)), ckpt.full(n)))
        self.scratch = WideningScratch(xp) if bf16_matrices else None

    def host(self, name: str, dtype=None) -> np.ndarray:
        return self.reader.read(name, self.dtype if dtype is None else dtype)

    def dev(self, a):
        return self.xp.asarray(a)

    def one(self, name: str, shape=None):
        a = self.host(name)
        return self.dev(a.reshape(shape) if shape is not None else a)

    def matrix(self, names: list[str]):
        """A 2-D weight, row-concatenating `names` (fusion of projections that read the same input).

        With weight_dtype="bfloat16" and every part BF16 on disk, kept as bf16 bits (`Bf16Matrix`);
        otherwise in the compute dtype. Each part is read straight into its rows of the final buffer.
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
        if names != ["model.embed_tokens.weight"]:  # the embedding is only ever read by rows
            self.scratch.reserve(dev.size)
        return Bf16Matrix(dev, self.scratch, self.dtype)


def _kda(b: _Builder, cfg: KimiDecoderConfig, i: int) -> KdaWeights:
    la, A = cfg.linear_attn_config, f"model.layers.{i}.self_attn."
    H, K = la.num_heads, la.head_dim
    a_log = b.host(A + "A_log")
    if a_log.shape[0] != H and np.any(a_log[H:] != 0):
        raise CheckpointError(
            f"{b.ckpt.path}: tensor '{b.ckpt.full(A + 'A_log')}' is stored {a_log.shape[0]} wide with non-zero entries "
            f"past num_heads={H}; K3 stores one value per head, zero-padded to head_dim. Refusing to guess its layout."
        )
    conv = np.stack([b.host(A + f"{s}_conv1d.weight")[:, 0, :] for s in "qkv"])
    names = [A + f"{s}_proj.weight" for s in ("q", "k", "v", "g", "b", "f_a")]
    return KdaWeights(
        in_proj=b.matrix(names), f_b_proj=b.matrix([A + "f_b_proj.weight"]), conv=b.dev(conv),
        A=b.dev(np.exp(a_log[:H].astype(np.float64)).astype(b.dtype).reshape(H, 1)),
        dt_bias=b.one(A + "dt_bias", (H, K)), o_norm=b.one(A + "o_norm.weight"), o_proj=b.matrix([A + "o_proj.weight"]),
        num_heads=H, head_dim=K, lower_bound=float(la.gate_lower_bound), eps=cfg.rms_norm_eps,
    )


def _mla(b: _Builder, cfg: KimiDecoderConfig, i: int) -> MlaWeights:
    A = f"model.layers.{i}.self_attn."
    names = [A + "q_a_proj.weight", A + "kv_a_proj_with_mqa.weight"] + ([A + "g_proj.weight"] if cfg.mla_use_output_gate else [])
    return MlaWeights(
        in_proj=b.matrix(names), q_a_layernorm=b.one(A + "q_a_layernorm.weight"), q_b_proj=b.matrix([A + "q_b_proj.weight"]),
        kv_a_layernorm=b.one(A + "kv_a_layernorm.weight"), kv_b_proj=b.matrix([A + "kv_b_proj.weight"]),
        o_proj=b.matrix([A + "o_proj.weight"]), num_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, use_output_gate=cfg.mla_use_output_gate,
    )


def _experts_packed_on_disk(ckpt: CheckpointDir, cfg: KimiDecoderConfig, i: int) -> bool:
    M = f"model.layers.{i}.block_sparse_moe.experts."
    return all(ckpt.has(M + f"{e}.{wn}.weight_packed") for e in range(cfg.num_experts) for wn in ("w1", "w3", "w2"))


def _packed_experts(b: _Builder, cfg: KimiDecoderConfig, i: int, capacity: int, chunk: int = 16) -> PackedExperts:
    """Read the MXFP4 bytes of every expert into [E, ...] uint8 banks (w1 and w3 rows stacked), `chunk` experts per upload."""
    M = f"model.layers.{i}.block_sparse_moe.experts."
    E, l, I = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    shapes = {"w13_packed": (2 * I, l // 2), "w13_scale": (2 * I, l // mxfp4.GROUP),
              "w2_packed": (l, I // 2), "w2_scale": (l, I // mxfp4.GROUP)}
    on_host = b.xp is np
    banks = {k: (np.empty if on_host else b.xp.empty)((E,) + s, np.uint8) for k, s in shapes.items()}
    for a in range(0, E, chunk):
        experts = range(a, min(E, a + chunk))
        for key, shape in shapes.items():
            dst = banks[key][a : a + len(experts)] if on_host else np.empty((len(experts),) + shape, np.uint8)
            part = "weight_packed" if key.endswith("packed") else "weight_scale"
            for j, e in enumerate(experts):
                if key.startswith("w13"):
                    b.reader.read(M + f"{e}.w1.{part}", np.uint8, out=dst[j, :I])
                    b.reader.read(M + f"{e}.w3.{part}", np.uint8, out=dst[j, I:])
                else:
                    b.reader.read(M + f"{e}.w2.{part}", np.uint8, out=dst[j])
            if not on_host:
                banks[key][a : a + len(experts)] = b.xp.asarray(dst)
    return PackedExperts(**banks, dtype=b.dtype, capacity=capacity)


def _dense_experts(b: _Builder, cfg: KimiDecoderConfig, i: int) -> DenseExperts:
    """Every expert dequantised (MXFP4 through the reference `mxfp4.dequantize`) or widened (dense on disk)."""
    M = f"model.layers.{i}.block_sparse_moe.experts."
    E, l, I = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    w13 = np.empty((E, 2 * I, l), b.dtype)
    w2 = np.empty((E, l, I), b.dtype)
    for e in range(E):
        for wn, dst in (("w1", w13[e, :I]), ("w3", w13[e, I:]), ("w2", w2[e])):
            base = M + f"{e}.{wn}."
            if b.ckpt.has(base + "weight"):
                b.reader.read(base + "weight", b.dtype, out=dst)
            else:
                mxfp4.dequantize(b.reader.read(base + "weight_packed", np.uint8), b.reader.read(base + "weight_scale", np.uint8),
                                 out=dst, dtype=b.dtype)
    return DenseExperts(b.dev(w13), b.dev(w2))


def _moe(b: _Builder, cfg: KimiDecoderConfig, i: int, experts: str, cache_size: int) -> LatentMoeWeights:
    M = f"model.layers.{i}.block_sparse_moe."
    E, l = cfg.num_experts, cfg.routed_expert_hidden_size
    if experts == "packed":
        if not _experts_packed_on_disk(b.ckpt, cfg, i):
            raise CheckpointError(
                f"{b.ckpt.path}: experts='packed' but layer {i}'s routed experts are not all MXFP4 "
                "(weight_packed/weight_scale) on disk; load with experts='dense'"
            )
        bank = _packed_experts(b, cfg, i, cache_size)
    else:
        bank = _dense_experts(b, cfg, i)
    names = [M + "gate.weight", M + "routed_expert_down_proj.weight",
             M + "shared_experts.gate_proj.weight", M + "shared_experts.up_proj.weight"]
    return LatentMoeWeights(
        in_proj=b.matrix(names), e_score_correction_bias=b.one(M + "gate.e_score_correction_bias"),
        experts=bank, routed_expert_norm=b.one(M + "routed_expert_norm.weight"),
        routed_expert_up_proj=b.matrix([M + "routed_expert_up_proj.weight"]),
        shared_down_proj=b.matrix([M + "shared_experts.down_proj.weight"]), num_experts=E,
        top_k=cfg.num_experts_per_token, latent_size=l, renormalize=bool(cfg.moe_renormalize),
        routed_scaling_factor=float(cfg.routed_scaling_factor), use_latent_norm=bool(cfg.latent_moe_use_norm),
        eps=cfg.rms_norm_eps, situ_beta=float(cfg.activation_situ_beta),
        situ_linear_beta=None if cfg.activation_situ_linear_beta is None else float(cfg.activation_situ_linear_beta),
    )


def _score(b: _Builder, norm: str, proj: str):
    """Fuse an attn-res RMSNorm gain and its [1, d] projection into the score vector (in float64, then cast)."""
    g = b.host(norm, np.float64)
    p = b.host(proj, np.float64).reshape(-1)
    return b.dev((g * p).astype(b.dtype))


def _layer(b: _Builder, cfg: KimiDecoderConfig, i: int, experts: str, cache_size: int) -> KimiDecoderLayerWeights:
    L = f"model.layers.{i}."
    attention = _kda(b, cfg, i) if cfg.is_kda_layer(i) else _mla(b, cfg, i)
    if cfg.is_moe_layer(i):
        ffn = _moe(b, cfg, i, experts, cache_size)
    else:
        ffn = DenseMlpWeights(b.matrix([L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"]),
                              b.matrix([L + "mlp.down_proj.weight"]))
    return KimiDecoderLayerWeights(
        index=i, input_layernorm=b.one(L + "input_layernorm.weight"),
        post_attention_layernorm=b.one(L + "post_attention_layernorm.weight"),
        attn_res_score=_score(b, L + "self_attention_res_norm.weight", L + "self_attention_res_proj.weight"),
        mlp_res_score=_score(b, L + "mlp_res_norm.weight", L + "mlp_res_proj.weight"),
        attention=attention, ffn=ffn, is_block_boundary=cfg.is_block_boundary(i),
    )


# ---------------------------------------------------------------- options

EXPERT_MODES = ("auto", "packed", "dense")
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


def plan_tensors(cfg: KimiDecoderConfig, layer_ids: list[int], ckpt: CheckpointDir) -> dict[str, tuple]:
    plan = _global_tensors(cfg)
    for i in layer_ids:
        plan.update(_layer_tensors(cfg, i, ckpt))
    return plan


def load_weights(path, *, layers=None, device: str = "auto", dtype: str = "float32", weight_dtype: str | None = None,
                 experts: str = "auto", expert_cache_size: int | None = None, revision: str | None = None,
                 cache_dir=None, local_files_only: bool | None = None, token=None, progress: bool = True) -> KimiDecoderWeights:
    """Load a K3 checkpoint (all layers, or the 0-based `layers` chosen) onto `device`.

    path: a checkpoint directory, or a Hub repo id ('org/name'): then only config, index, tokenizer
        files and the shards of the requested layers are fetched (`kimi_explore.weights.hub`; `revision`,
        `cache_dir`, `local_files_only`, `token` go to huggingface_hub; HF_HUB_OFFLINE=1 works).
    dtype: compute dtype of activations and widened weights ("float32" | "float64").
    weight_dtype: None keeps every matrix in `dtype`; "bfloat16" keeps the matrices stored as BF16 on
        disk as bf16 bits, widened per use (same logits bit for bit, half the memory, slower on CPU).
    experts: "dense" dequantises every routed expert at load; "packed" keeps the MXFP4 bytes and
        dequantises the selected ones per token (same logits bit for bit) or, with no cache on the
        CPU, multiplies them fused (see expert_cache_size); "auto" (default) is dense
        when all requested experts dequantised fit in 1 GiB (the tiny models), else packed (K3).
    expert_cache_size: with packed experts, dequantised experts kept PER LAYER in an LRU cache;
        0 = no cache: on the CPU in float32 the selected experts are then multiplied straight from
        their packed bytes by the compiled kernel (`mxfp4_matvec`, when built; the same weights,
        float32 sums in another order), else dequantised per token. None = all of a layer's
        experts if they fit in 512 MiB (the tiny models); otherwise 0 on the CPU with the kernel
        (K3: reading 280 MB packed beats reading 2.1 GB dequantised), else as many as fit (3 of K3's).
    """
    from .hub import resolve_checkpoint

    xp, dev = resolve_device(device)
    dt = resolve_dtype(dtype)
    bf16 = _resolve_weight_dtype(weight_dtype, dt)
    path = resolve_checkpoint(path, layers=layers, revision=revision, cache_dir=cache_dir,
                              local_files_only=local_files_only, token=token, progress=progress)
    cfg = KimiDecoderConfig.from_file(path / "config.json")
    layer_ids = resolve_layers(layers, cfg.num_hidden_layers)
    ckpt = CheckpointDir(path)
    b = None
    try:
        _check(ckpt, plan_tensors(cfg, layer_ids, ckpt), cfg)
        mode = _resolve_experts(experts, cfg, layer_ids, ckpt, dt)
        cache_size = _resolve_cache_size(expert_cache_size, cfg, dt, xp)
        b = _Builder(ckpt, xp, dt, bf16)
        embed = b.matrix(["model.embed_tokens.weight"])
        return KimiDecoderWeights(
            config=cfg, embed_tokens=embed, layers=[_layer(b, cfg, i, mode, cache_size) for i in layer_ids],
            output_attn_res_score=_score(b, "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight"),
            norm=b.one("model.norm.weight"),
            lm_head=embed if cfg.tie_word_embeddings else b.matrix(["lm_head.weight"]),
            xp=xp, device=dev, dtype=dt, source=str(path),
            extra={"experts": mode, "expert_cache_size": cache_size if mode == "packed" else None,
                   "weight_dtype": "bfloat16" if bf16 else np.dtype(dt).name, "widening_scratch": b.scratch},
        )
    finally:
        if b is not None:
            b.reader.close()
        ckpt.close()
