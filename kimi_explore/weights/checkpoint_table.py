"""The checkpoint table: every released tensor of Kimi K3, one table per layer kind.

A row is one released tensor: the key the loader asks for, its released name (after
`model.layers.{i}.` for a layer's tensors; the release prefixes every name with `language_model.`),
its on-disk shape in the symbols of `dims`, its on-disk dtype, and how synthetic writers fill it:

    BF16   matrices and most vectors (norm gains, the attn-res projections)
    F32    KDA's small tensors (conv windows, A_log, dt_bias, o_norm) and the router bias
    MXFP4  a routed expert: a logical [r, c] weight released as the U8 pair `...weight_packed`
           [r, c/2] + `...weight_scale` [r, c/32] (`mxfp4.py`); a dense `...weight` loads too

Each kind's `fused` says which rows are concatenated into one buffer of its weights record, in
order: KDA `in_proj` = rows of q, k, v, g, b, f_a (one matmul reads the layer input once).

Everything else derives from these tables, as mlx-lm's one `sanitize` per architecture: the load
plan and its checks (`checkpoint.py`), the reads into fused buffers (`records.py`), and every writer
(`tiny_model.save_checkpoint` and its random generator, `bench/k3_shapes.py`). A new tensor is
one row. Rows are in the order the tiny-model generator draws them: reordering them changes the
random tiny fixture `tests/data/tiny_k3` (test_tiny_model says so).

Each row also names the tensor in llama.cpp's GGUF (`kimi-k3`, after `blk.{i}.`): the same tensor
in ggml's reversed axis order, except where the converter changed it (`gguf_source.py` says how):
the attn-res norm and projection are ONE fused score, kv_b_proj is split into attn_k_b/attn_v_b,
A_log is stored as -exp(A_log[:H]), and the routed experts are stacked [E, ...].

Traps: A_log is per head but stored head_dim wide, zero-padded (a head-wide one loads too);
`kv_a_proj_with_mqa` holds the latent AND the shared rope key (kl + dr rows); the attn-res
`*_res_proj` are [1, d] rows that the loader folds into their norm gains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..model.config import KimiDecoderConfig
from . import mxfp4

BF16, F32, MXFP4 = "BF16", "F32", "MXFP4"
RELEASE_PREFIX = "language_model."  # before every released name (the multimodal shell's language model)
LAYER_PREFIX = "model.layers.{i}."


def dims(cfg: KimiDecoderConfig) -> dict[str, int]:
    """The symbols the shapes are written in."""
    la, nh = cfg.linear_attn_config, cfg.num_attention_heads
    return {
        "d": cfg.hidden_size, "V": cfg.vocab_size, "I": cfg.intermediate_size,  # trunk, dense MLP
        "H": la.num_heads, "K": la.head_dim, "P": cfg.kda_proj_width, "W": la.short_conv_kernel_size,  # KDA, P = H K
        "ql": cfg.q_lora_rank, "kl": cfg.kv_lora_rank,  # MLA latents
        "q": nh * cfg.qk_head_dim, "kv_a": cfg.kv_lora_rank + cfg.qk_rope_head_dim,  # MLA query heads; latent + rope key
        "kv_b": nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), "o": nh * cfg.v_head_dim,  # MLA key/value heads; output
        "E": cfg.num_experts, "l": cfg.routed_expert_hidden_size, "Ie": cfg.moe_intermediate_size,  # routed experts
        "Ish": cfg.shared_intermediate_size,  # the shared experts, as one MLP
    }


# init (for synthetic checkpoints only):
#   ("normal", g)   normal, std g / sqrt(last dim)    ("std", s)  normal, std s
#   ("gain",)       1 + 0.1 normal (a norm gain)      ("uniform", lo, hi)
#   ("per_head", lo, hi)  uniform on the first H entries, zeros after (A_log's padding)
#   ("spread", a)   a permutation of linspace(-a, a)  (the router bias: distinct values)
def N(gain: float = 1.0) -> tuple:
    return ("normal", gain)


GAIN = ("gain",)


@dataclass(frozen=True)
class Row:
    key: str  # the loader's name for it
    name: str  # released name after the kind's prefix; "{e}" = the expert index
    shape: tuple  # on disk, in `dims` symbols (or ints)
    dtype: str  # on disk: BF16 | F32 | MXFP4
    init: tuple = ("normal", 1.0)
    when: Callable[[KimiDecoderConfig], bool] | None = None  # released only when when(cfg)
    also: tuple | None = None  # another shape the loader accepts
    gguf: str | tuple = ""  # llama.cpp's `kimi-k3` name after the kind's `gguf_prefix` (`gguf_source` says how it differs)


@dataclass(frozen=True)
class Kind:
    title: str
    prefix: str  # LAYER_PREFIX, or "" for the global tensors
    rows: tuple[Row, ...]
    fused: dict  # record field -> keys of the rows concatenated into it, in order (attn-res: gain x row)
    gguf_prefix: str = "blk.{i}."  # GGUF names: "blk.{i}." + row.gguf ("" for the global tensors)

    def row(self, key: str) -> Row:
        for r in self.rows:
            if r.key == key:
                return r
        raise KeyError(f"{self.title} has no tensor {key!r}: it has {', '.join(r.key for r in self.rows)}")

    def present(self, cfg: KimiDecoderConfig) -> list[Row]:
        return [r for r in self.rows if r.when is None or r.when(cfg)]

    def name(self, key: str, i: int | None = None, e: int | None = None) -> str:
        """The released name (unprefixed) of row `key` in layer i (expert e)."""
        return self.prefix.format(i=i) + self.row(key).name.format(e=e)

    def keys(self, field: str) -> tuple[str, ...]:
        """The rows a record field is made of, in fusion order (a row key alone stands for itself)."""
        return self.fused.get(field, (field,))

    def parts(self, cfg: KimiDecoderConfig, field: str, i: int | None = None, e: int | None = None) -> list[str]:
        """The released names fused into record field `field`, in order (rows absent in `cfg` left out)."""
        return [self.name(k, i, e) for k in self.keys(field) if (r := self.row(k)).when is None or r.when(cfg)]

    def shape(self, cfg: KimiDecoderConfig, key: str) -> tuple[int, ...]:
        sym = dims(cfg)
        return tuple(d if isinstance(d, int) else sym[d] for d in self.row(key).shape)

    @property
    def expert_keys(self) -> list[str]:
        """Keys of the per-expert rows (names with "{e}")."""
        return [r.key for r in self.rows if "{e}" in r.name]


LAYER = Kind("per-layer norms and attn-res", LAYER_PREFIX, (
    Row("input_layernorm", "input_layernorm.weight", ("d",), BF16, GAIN, gguf="attn_norm.weight"),
    Row("post_attention_layernorm", "post_attention_layernorm.weight", ("d",), BF16, GAIN, gguf="ffn_norm.weight"),
    Row("attn_res_norm", "self_attention_res_norm.weight", ("d",), BF16, GAIN, gguf="attn_res_score.weight"),
    Row("mlp_res_norm", "mlp_res_norm.weight", ("d",), BF16, GAIN, gguf="ffn_res_score.weight"),
    Row("attn_res_proj", "self_attention_res_proj.weight", (1, "d"), BF16, N(3.0), gguf="attn_res_score.weight"),
    Row("mlp_res_proj", "mlp_res_proj.weight", (1, "d"), BF16, N(3.0), gguf="ffn_res_score.weight"),
), fused={"attn_res_score": ("attn_res_norm", "attn_res_proj"), "mlp_res_score": ("mlp_res_norm", "mlp_res_proj")})

KDA = Kind("KDA attention", LAYER_PREFIX, (
    Row("q_proj", "self_attn.q_proj.weight", ("P", "d"), BF16, N(1.5), gguf="attn_q.weight"),
    Row("q_conv", "self_attn.q_conv1d.weight", ("P", 1, "W"), F32, ("std", 0.6), gguf="ssm_conv1d_q.weight"),
    Row("k_proj", "self_attn.k_proj.weight", ("P", "d"), BF16, N(1.5), gguf="attn_k.weight"),
    Row("k_conv", "self_attn.k_conv1d.weight", ("P", 1, "W"), F32, ("std", 0.6), gguf="ssm_conv1d_k.weight"),
    Row("v_proj", "self_attn.v_proj.weight", ("P", "d"), BF16, N(1.5), gguf="attn_v.weight"),
    Row("v_conv", "self_attn.v_conv1d.weight", ("P", 1, "W"), F32, ("std", 0.6), gguf="ssm_conv1d_v.weight"),
    Row("f_a_proj", "self_attn.f_a_proj.weight", ("K", "d"), BF16, gguf="ssm_f_a.weight"),
    Row("f_b_proj", "self_attn.f_b_proj.weight", ("P", "K"), BF16, N(2.0), gguf="ssm_f_b.weight"),
    Row("b_proj", "self_attn.b_proj.weight", ("H", "d"), BF16, N(2.0), gguf="ssm_beta.weight"),
    Row("g_proj", "self_attn.g_proj.weight", ("P", "d"), BF16, N(2.0), gguf="ssm_g.weight"),
    Row("o_proj", "self_attn.o_proj.weight", ("d", "P"), BF16, gguf="attn_output.weight"),
    Row("o_norm", "self_attn.o_norm.weight", ("K",), F32, GAIN, gguf="ssm_norm.weight"),
    Row("A_log", "self_attn.A_log", ("K",), F32, ("per_head", -1.0, 1.5), also=("H",), gguf="ssm_a"),
    Row("dt_bias", "self_attn.dt_bias", ("P",), F32, ("uniform", -1.0, 1.0), gguf="ssm_dt.bias"),
), fused={"in_proj": ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_a_proj"),
          "conv": ("q_conv", "k_conv", "v_conv")})

MLA = Kind("MLA attention", LAYER_PREFIX, (
    Row("q_a_proj", "self_attn.q_a_proj.weight", ("ql", "d"), BF16, gguf="attn_q_a.weight"),
    Row("q_a_layernorm", "self_attn.q_a_layernorm.weight", ("ql",), BF16, GAIN, gguf="attn_q_a_norm.weight"),
    Row("q_b_proj", "self_attn.q_b_proj.weight", ("q", "ql"), BF16, N(2.0), gguf="attn_q_b.weight"),
    Row("kv_a_proj", "self_attn.kv_a_proj_with_mqa.weight", ("kv_a", "d"), BF16, N(2.0), gguf="attn_kv_a_mqa.weight"),
    Row("kv_a_layernorm", "self_attn.kv_a_layernorm.weight", ("kl",), BF16, GAIN, gguf="attn_kv_a_norm.weight"),
    Row("kv_b_proj", "self_attn.kv_b_proj.weight", ("kv_b", "kl"), BF16, N(1.5), gguf=("attn_k_b.weight", "attn_v_b.weight")),
    Row("g_proj", "self_attn.g_proj.weight", ("o", "d"), BF16, N(2.0), when=lambda c: c.mla_use_output_gate,
        gguf="attn_gate.weight"),
    Row("o_proj", "self_attn.o_proj.weight", ("d", "o"), BF16, gguf="attn_output.weight"),
), fused={"in_proj": ("q_a_proj", "kv_a_proj", "g_proj")})

DENSE_MLP = Kind("dense MLP", LAYER_PREFIX, (
    Row("gate_proj", "mlp.gate_proj.weight", ("I", "d"), BF16, N(4.0), gguf="ffn_gate.weight"),
    Row("up_proj", "mlp.up_proj.weight", ("I", "d"), BF16, N(4.0), gguf="ffn_up.weight"),
    Row("down_proj", "mlp.down_proj.weight", ("d", "I"), BF16, gguf="ffn_down.weight"),
), fused={"gate_up": ("gate_proj", "up_proj")})

MOE = Kind("latent MoE", LAYER_PREFIX, (
    Row("gate", "block_sparse_moe.gate.weight", ("E", "d"), BF16, N(2.0), gguf="ffn_gate_inp.weight"),
    Row("bias", "block_sparse_moe.gate.e_score_correction_bias", ("E",), F32, ("spread", 0.15), gguf="exp_probs_b.bias"),
    Row("latent_down", "block_sparse_moe.routed_expert_down_proj.weight", ("l", "d"), BF16, N(2.0),
        gguf="ffn_routed_down.weight"),
    Row("latent_norm", "block_sparse_moe.routed_expert_norm.weight", ("l",), BF16, GAIN, when=lambda c: c.latent_moe_use_norm,
        gguf="ffn_routed_norm.weight"),
    Row("latent_up", "block_sparse_moe.routed_expert_up_proj.weight", ("d", "l"), BF16, gguf="ffn_routed_up.weight"),
    Row("shared_gate", "block_sparse_moe.shared_experts.gate_proj.weight", ("Ish", "d"), BF16, N(4.0),
        gguf="ffn_gate_shexp.weight"),
    Row("shared_up", "block_sparse_moe.shared_experts.up_proj.weight", ("Ish", "d"), BF16, N(4.0), gguf="ffn_up_shexp.weight"),
    Row("shared_down", "block_sparse_moe.shared_experts.down_proj.weight", ("d", "Ish"), BF16, gguf="ffn_down_shexp.weight"),
    # per expert (the "{e}" rows come last: the generator draws them expert by expert)
    Row("w1", "block_sparse_moe.experts.{e}.w1.weight", ("Ie", "l"), MXFP4, N(4.0), gguf="ffn_gate_exps.weight"),
    Row("w3", "block_sparse_moe.experts.{e}.w3.weight", ("Ie", "l"), MXFP4, N(4.0), gguf="ffn_up_exps.weight"),
    Row("w2", "block_sparse_moe.experts.{e}.w2.weight", ("l", "Ie"), MXFP4, gguf="ffn_down_exps.weight"),
), fused={"in_proj": ("gate", "latent_down", "shared_gate", "shared_up"), "w13": ("w1", "w3")})

GLOBAL = Kind("global", "", (
    Row("embed_tokens", "model.embed_tokens.weight", ("V", "d"), BF16, ("std", 1.0), gguf="token_embd.weight"),
    Row("lm_head", "lm_head.weight", ("V", "d"), BF16, N(2.0), when=lambda c: not c.tie_word_embeddings, gguf="output.weight"),
    Row("norm", "model.norm.weight", ("d",), BF16, GAIN, gguf="output_norm.weight"),
    Row("output_res_norm", "model.output_attn_res_norm.weight", ("d",), BF16, GAIN, gguf="output_res_score.weight"),
    Row("output_res_proj", "model.output_attn_res_proj.weight", (1, "d"), BF16, N(3.0), gguf="output_res_score.weight"),
), fused={"output_attn_res_score": ("output_res_norm", "output_res_proj")}, gguf_prefix="")


def layer_kinds(cfg: KimiDecoderConfig, i: int) -> tuple[Kind, Kind, Kind]:
    """(norms + attn-res, attention, FFN) tables of layer i, from the config's one layer-kind rule."""
    return LAYER, KDA if cfg.is_kda_layer(i) else MLA, MOE if cfg.is_moe_layer(i) else DENSE_MLP


@dataclass(frozen=True)
class Tensor:
    """One released tensor of a concrete config: an entry of the plan."""

    name: str  # unprefixed released name
    shape: tuple[int, ...]  # on disk (MXFP4: the logical [r, c])
    row: Row
    layer: int | None  # None for the global tensors
    expert: int | None = None
    also: tuple[int, ...] | None = None  # another shape the loader accepts

    @property
    def dtype(self) -> str:
        return self.row.dtype


@dataclass(frozen=True)
class DiskTensor:
    """What one planned name must be on disk."""

    name: str
    dtype: str  # the safetensors code: BF16 | F32 | U8 (the loader accepts BF16, F32 or F64 for BF16/F32, not F16)
    shape: tuple[int, ...]
    also: tuple[int, ...] | None = None
    mxfp4_of: tuple[int, int] | None = None  # for the halves of an MXFP4 pair: the logical [r, c]


def _kind_tensors(kind: Kind, cfg: KimiDecoderConfig, i: int | None, sym: dict) -> list[Tensor]:
    ints = lambda s: tuple(d if isinstance(d, int) else sym[d] for d in s)  # noqa: E731
    rows = kind.present(cfg)
    experts = [r for r in rows if "{e}" in r.name]
    per_expert = [(r, e) for e in range(sym["E"] if experts else 0) for r in experts]
    return [Tensor(kind.prefix.format(i=i) + r.name.format(e=e), ints(r.shape), r, i, e,
                   None if r.also is None else ints(r.also))
            for r, e in [(r, None) for r in rows if r not in experts] + per_expert]


HEAD_ROWS = ("lm_head", "norm", "output_res_norm", "output_res_proj")  # what `finish_token` reads


def plan(cfg: KimiDecoderConfig, layer_ids=None, embedding: bool = True, head: bool = True) -> list[Tensor]:
    """Every released tensor of the global part and of layers `layer_ids` (None = all), in table order.

    embedding=False / head=False leave out the token embedding / the output mix, final norm and
    lm_head (a pipeline stage after the first / before the last); tied embeddings are the head's too.
    """
    sym = dims(cfg)
    wanted = {"embed_tokens"} if embedding or (head and cfg.tie_word_embeddings) else set()
    wanted |= set(HEAD_ROWS) if head else set()
    out = [t for t in _kind_tensors(GLOBAL, cfg, None, sym) if t.row.key in wanted]
    for i in range(cfg.num_hidden_layers) if layer_ids is None else layer_ids:
        for kind in layer_kinds(cfg, i):
            out += _kind_tensors(kind, cfg, i, sym)
    return out


def mxfp4_names(name: str) -> tuple[str, str]:
    """`...w1.weight` -> (`...w1.weight_packed`, `...w1.weight_scale`)."""
    return name + "_packed", name + "_scale"


def on_disk(t: Tensor, packed: bool = True) -> list[DiskTensor]:
    """The names a planned tensor takes on disk: an MXFP4 one as its U8 pair, or dense (packed=False)."""
    if t.dtype != MXFP4:
        return [DiskTensor(t.name, t.dtype, t.shape, t.also)]
    if not packed:
        return [DiskTensor(t.name, BF16, t.shape)]
    (r, c), (p, s) = t.shape, mxfp4_names(t.name)
    return [DiskTensor(p, "U8", (r, c // 2), mxfp4_of=(r, c)), DiskTensor(s, "U8", (r, c // mxfp4.GROUP), mxfp4_of=(r, c))]
