"""Building the weight records (`KimiDecoderWeights` and its layers) from a `TensorSource`.

    weights = build_weights(source, layer_ids, options)

One function per record, in data-flow order (`_layer` -> `_kda` | `_mla`, `_moe` | dense MLP),
each reading the table's rows (`checkpoint_table`) through the source, never a file format:

    matrices   row-concatenated where the table fuses them (KDA in_proj = q, k, v, g, b, f_a rows;
               MLA in_proj = q_a, kv_a, g; MoE in_proj = router, latent down, shared gate, shared up),
               each part read straight into its rows of the final buffer; in the compute dtype, or
               kept as bf16 bits (`Bf16Matrix`) with weight_dtype="bfloat16" when every part is BF16
    scores     attn-res score vectors [d], float64 from the source, then cast (`source.score`)
    KDA        A [H, 1] = exp(A_log) (`source.kda_decay`, float64 then cast); conv windows [3, P, W]
    experts    the source's bank for the resolved mode (`source.experts`)

Arrays go to the weights' device (`xp`) once built; the scratch every record shares (bf16
widening, dequantised experts, host threads) is one `Workspace` owned by the returned weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.kda import KdaWeights
from ..model.kimi_decoder import KimiDecoderLayerWeights, KimiDecoderWeights
from ..model.latent_moe import LatentMoeWeights
from ..model.mla import MlaWeights
from ..model.ops import DenseMlpWeights
from . import checkpoint_table as table
from .bf16_weights import Bf16Matrix, WideningScratch
from .tensor_source import TensorSource
from .workspace import Workspace


@dataclass(frozen=True)
class BuildOptions:
    """How the records are built (resolved by `load_options` from `from_pretrained`'s arguments)."""

    xp: object  # numpy or cupy
    device: str
    dtype: object  # compute dtype (np.float32 | np.float64)
    bf16: bool  # keep BF16 matrices as bf16 bits
    bf16_kernel: bool | None  # Bf16Matrix's `kernel`
    experts: str  # "dense" | "packed" | "mapped"
    cache_size: int  # dequantised experts kept per layer (packed/mapped)
    embedding: bool = True
    head: bool = True


class _Builder:
    """Reads tensors from the source into device buffers in the compute dtype (or bf16 bits)."""

    def __init__(self, source: TensorSource, o: BuildOptions):
        self.source, self.cfg, self.o, self.xp, self.dtype = source, source.config, o, o.xp, o.dtype
        self.workspace = Workspace(o.xp, widening=WideningScratch(o.xp) if o.bf16 else None)
        self.scratch = self.workspace.widening

    def host(self, name: str, dtype=None) -> np.ndarray:
        return self.source.read(name, self.dtype if dtype is None else dtype)

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
        infos = [self.source.info(n) for n in names]
        bits = self.scratch is not None and all(code == "BF16" for code, _ in infos)
        out = np.empty((sum(shape[0] for _, shape in infos), infos[0][1][1]), np.uint16 if bits else self.dtype)
        r = 0
        for n, (_, shape) in zip(names, infos, strict=True):
            self.source.read(n, out.dtype, out=out[r : r + shape[0]])
            r += shape[0]
        dev = self.dev(out)
        if not bits:
            return dev
        m = Bf16Matrix(dev, self.scratch, self.dtype, kernel=self.o.bf16_kernel, pool=self.workspace.pool)
        if not by_rows and m.uses_scratch:  # the widening route in float32 needs the scratch; reserve it now
            self.scratch.reserve(dev.size)
        return m


class _At:
    """The builder's reads for one table at one layer, by row key or fused record field."""

    def __init__(self, b: _Builder, kind: table.Kind, i: int | None = None):
        self.b, self.kind, self.i = b, kind, i

    def one(self, key: str, shape=None):
        return self.b.one(self.kind.name(key, self.i), shape)

    def matrix(self, field: str, by_rows: bool = False):
        return self.b.matrix(self.kind.parts(self.b.cfg, field, self.i), by_rows)

    def score(self, field: str):
        """An attn-res score vector: the RMSNorm gain times its [1, d] projection (float64, then cast)."""
        return self.b.dev(self.b.source.score(self.kind, field, self.i).astype(self.b.dtype))


def _kda(b: _Builder, i: int) -> KdaWeights:
    cfg, t = b.cfg, _At(b, table.KDA, i)
    la = cfg.linear_attn_config
    H, K = la.num_heads, la.head_dim
    conv = np.stack([b.host(n)[:, 0, :] for n in table.KDA.parts(cfg, "conv", i)])  # [3, P, W]: q, k, v
    return KdaWeights(
        in_proj=t.matrix("in_proj"), f_b_proj=t.matrix("f_b_proj"), conv=b.dev(conv),
        A=b.dev(b.source.kda_decay(i).astype(b.dtype).reshape(H, 1)),
        dt_bias=t.one("dt_bias", (H, K)), o_norm=t.one("o_norm"), o_proj=t.matrix("o_proj"),
        num_heads=H, head_dim=K, lower_bound=float(la.gate_lower_bound), eps=cfg.rms_norm_eps,
    )


def _mla(b: _Builder, i: int) -> MlaWeights:
    cfg, t = b.cfg, _At(b, table.MLA, i)
    return MlaWeights(
        in_proj=t.matrix("in_proj"), q_a_layernorm=t.one("q_a_layernorm"), q_b_proj=t.matrix("q_b_proj"),
        kv_a_layernorm=t.one("kv_a_layernorm"), kv_b_proj=t.matrix("kv_b_proj"),
        o_proj=t.matrix("o_proj"), num_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, use_output_gate=cfg.mla_use_output_gate,
    )


def _moe(b: _Builder, i: int) -> LatentMoeWeights:
    cfg, t, o = b.cfg, _At(b, table.MOE, i), b.o
    bank = b.source.experts(i, o.experts, dtype=b.dtype, xp=b.xp, capacity=o.cache_size, workspace=b.workspace)
    return LatentMoeWeights(
        in_proj=t.matrix("in_proj"), e_score_correction_bias=t.one("bias"), experts=bank,
        routed_expert_norm=(t.one("latent_norm") if cfg.latent_moe_use_norm  # else not released; unread (gain 1)
                            else b.dev(np.ones(cfg.routed_expert_hidden_size, b.dtype))),
        routed_expert_up_proj=t.matrix("latent_up"),
        shared_down_proj=t.matrix("shared_down"), num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_token, latent_size=cfg.routed_expert_hidden_size,
        renormalize=bool(cfg.moe_renormalize) and cfg.num_experts_per_token > 1,  # (the release: "top_k > 1 and ...")
        routed_scaling_factor=float(cfg.routed_scaling_factor), use_latent_norm=bool(cfg.latent_moe_use_norm),
        eps=cfg.rms_norm_eps, situ_beta=float(cfg.activation_situ_beta),
        situ_linear_beta=None if cfg.activation_situ_linear_beta is None else float(cfg.activation_situ_linear_beta),
    )


def _layer(b: _Builder, i: int) -> KimiDecoderLayerWeights:
    cfg = b.cfg
    _, attn, ffn = table.layer_kinds(cfg, i)
    t = _At(b, table.LAYER, i)
    if ffn is table.MOE:
        mlp = _moe(b, i)
    else:
        d = _At(b, table.DENSE_MLP, i)
        mlp = DenseMlpWeights(d.matrix("gate_up"), d.matrix("down_proj"))
    return KimiDecoderLayerWeights(
        index=i, input_layernorm=t.one("input_layernorm"), post_attention_layernorm=t.one("post_attention_layernorm"),
        attn_res_score=t.score("attn_res_score"), mlp_res_score=t.score("mlp_res_score"),
        attention=(_kda if attn is table.KDA else _mla)(b, i), ffn=mlp, is_block_boundary=cfg.is_block_boundary(i),
    )


def build_weights(source: TensorSource, layer_ids: list[int], o: BuildOptions, extra: dict) -> KimiDecoderWeights:
    """The weights of the global part (as `o.embedding`/`o.head` ask) and of layers `layer_ids`, read
    from `source` (already checked: `source.check`). `extra` is stored as `weights.extra`."""
    b = _Builder(source, o)
    cfg, g = source.config, _At(b, table.GLOBAL)
    tied = cfg.tie_word_embeddings
    # read by rows, unless it is the tied head too (multiplied whole: its widening scratch is reserved at load)
    embed = g.matrix("embed_tokens", by_rows=not (o.head and tied)) if o.embedding or (o.head and tied) else None
    return KimiDecoderWeights(
        # tied: the head reads the table, but a stage loaded with embedding=False still refuses token ids
        config=cfg, embed_tokens=embed if o.embedding else None, layers=[_layer(b, i) for i in layer_ids],
        output_attn_res_score=g.score("output_attn_res_score") if o.head else None,
        norm=g.one("norm") if o.head else None,
        lm_head=None if not o.head else embed if tied else g.matrix("lm_head"),
        xp=o.xp, device=o.device, dtype=o.dtype, source=str(source.path), workspace=b.workspace, extra=extra,
    )
