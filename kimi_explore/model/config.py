"""K3 text-model configuration: a frozen record whose field names are the `config.json` keys.

The released `config.json` is the multimodal `kimi_k3` shell; the language model's fields live in
its `text_config` (a `kimi_linear` config). A bare `kimi_linear` config is accepted too.

Every field the forward pass reads is required: a silent default would give a different model that
still produces plausible numbers. The layer lists stay 1-based, as in the file; whether 0-based
layer `i` is KDA / MoE / a block boundary is decided here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, DuplicateKeyError, unique_keys

# The hook sites each component fires, in firing order (the decoder fires exactly these; `hook_names`,
# the grammar of hook names and every outline of a layer derive from this table).
ATTENTION_SITES = {
    "kda": ("kda.conv", "kda.conv_out", "kda.q", "kda.k", "kda.v", "kda.beta", "kda.decay", "kda.gate", "kda.state", "kda.o"),
    "mla": ("mla.q_latent", "mla.kv_latent", "mla.probs", "mla.o"),
}
FFN_SITES = {
    "dense": (),
    "moe": ("moe.router.scores", "moe.router.topk_ids", "moe.router.topk_weights", "moe.experts_out", "moe.routed_out",
            "moe.shared_out"),
}
FIRST_SITES = ("embed",)
FINAL_SITES = ("final.block_residual", "final.attn_res.weights", "final.hidden", "logits")


@dataclass(frozen=True)
class LayerSpec:
    """One layer's outline: what a model (weights here, or a pipeline's stages) says of layer `index`
    without its arrays. The decoder, `hook_names`, a Trace's labels and a pipeline all read it."""

    index: int  # 0-based layer index in the full model
    attention: str  # "kda" | "mla"
    ffn: str  # "dense" | "moe"
    is_block_boundary: bool  # pushes its raw input onto the block stack (after its attention-site mix)

    @property
    def kind(self) -> str:
        """'kda+dense', 'kda+moe', 'mla+moe', ..."""
        return f"{self.attention}+{self.ffn}"

    @property
    def hook_prefix(self) -> str:
        return f"layers.{self.index}."

    def site_kinds(self, mixes_attention: bool) -> tuple[str, ...]:
        """The layer's sites (without the "layers.{i}." prefix), in firing order. `mixes_attention`: a block
        is sealed before this layer, so its attention-site mix runs (every layer after the first pushing one)."""
        return (("attn_res.attn.weights",) if mixes_attention else ()) + ("attn.in",) + ATTENTION_SITES[self.attention] + \
            ("attn.out", "attn_res.ffn.weights", "ffn.in") + FFN_SITES[self.ffn] + ("ffn.out", "prefix_sum")


def site_names(specs) -> list[str]:
    """Every hook site a model with these layer specs fires, in firing order."""
    return list(_site_names(tuple(specs)))


@functools.lru_cache(maxsize=64)
def _site_names(specs: tuple) -> tuple:
    """`site_names` of frozen specs (a session asks at every chunk it feeds: built once per layer layout)."""
    names, sealed = list(FIRST_SITES), False
    for spec in specs:
        names += [spec.hook_prefix + s for s in spec.site_kinds(sealed)]
        sealed = sealed or spec.is_block_boundary
    return tuple(names + list(FINAL_SITES))


@dataclass(frozen=True)
class LinearAttnConfig:
    """`text_config.linear_attn_config`: the KDA layers."""

    num_heads: int  # H, KDA heads
    head_dim: int  # K = V, KDA head width; projection width P = H * K
    short_conv_kernel_size: int  # W, depthwise causal conv width
    kda_layers: tuple[int, ...]  # 1-based
    full_attn_layers: tuple[int, ...]  # 1-based (the complement; not consulted by the math)
    gate_lower_bound: float | None  # g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)); None refused
    use_full_rank_gate: bool


@dataclass(frozen=True)
class KimiDecoderConfig:
    """The language model's `text_config`. Field names are the JSON keys."""

    vocab_size: int
    hidden_size: int  # d
    num_hidden_layers: int
    num_attention_heads: int  # MLA heads
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # "rope" dims are never rotated (NoPE) but are scored and cached
    v_head_dim: int
    mla_use_nope: bool
    mla_use_output_gate: bool
    intermediate_size: int  # dense MLP width
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int  # latent width of the routed experts
    latent_moe_use_norm: bool
    moe_renormalize: bool
    moe_router_activation_func: str
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    hidden_act: str
    activation_situ_beta: float
    activation_situ_linear_beta: float | None  # None: no linear cap (ops.situ)
    attn_res_block_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    linear_attn_config: LinearAttnConfig
    num_expert_group: int = 1
    topk_group: int = 1
    num_nextn_predict_layers: int = 0  # MTP layers stored after the decoder's (not read: a speculative-decoding draft)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    # ---- the one place that maps a 0-based layer index to its kind ----
    def layer_spec(self, i: int) -> LayerSpec:
        """What layer i is, without its arrays: its kinds, whether it seals a block, its hook sites."""
        return LayerSpec(i, "kda" if self.is_kda_layer(i) else "mla", "moe" if self.is_moe_layer(i) else "dense",
                         self.is_block_boundary(i))

    def is_kda_layer(self, i: int) -> bool:
        return (i + 1) in self.linear_attn_config.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def is_block_boundary(self, i: int) -> bool:
        """Layer i pushes its raw input onto the block-residual stack (after its attention mix)."""
        return i % self.attn_res_block_size == 0

    def layer_kind(self, i: int) -> str:
        """'kda+dense', 'kda+moe', 'mla+moe', ... for tables and plots."""
        return self.layer_spec(i).kind

    # ---- derived widths ----
    @property
    def kda_proj_width(self) -> int:
        return self.linear_attn_config.num_heads * self.linear_attn_config.head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    # ---- construction ----
    @classmethod
    def from_dict(cls, raw: dict, *, source: str = "config.json") -> KimiDecoderConfig:
        if "text_config" in raw:
            raw = raw["text_config"]
            if not isinstance(raw, dict):
                raise ConfigError(f"{source}: 'text_config' is {raw!r}; expected an object, the language model's config")
        return _build(cls, raw, source)

    @classmethod
    def from_file(cls, path: str | Path) -> KimiDecoderConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file; a checkpoint needs its config.json") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02X} at offset {e.start}); JSON "
                              "is UTF-8") from None
        except IsADirectoryError:
            raise ConfigError(f"{path}: a directory, expected the checkpoint's config.json file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        except DuplicateKeyError as e:
            raise ConfigError(f"{path}: key '{e.args[0]}' is given twice in one object{e.args[1]}; JSON readers keep "
                              "either value (Python's the last, silently), so which model the file means cannot be "
                              "told: keep one") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object, found {type(raw).__name__}")
        return cls.from_dict(raw, source=str(path))


def _required(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]


# the DeepSeek-V3 / Kimi K2 names of keys this config reads under the Kimi-Linear names
_ALIAS_OF = {"num_experts_per_token": "num_experts_per_tok", "num_experts": "n_routed_experts",
             "num_shared_experts": "n_shared_experts"}


# what a missing key means, where the file may be another model's on purpose
_MISSING_MEANS = {"attn_res_block_size": "without it the model has plain pre-norm residuals, not K3's Block Attention "
                                         "Residuals: not implemented here"}


def _build(cls, raw: dict, source: str) -> KimiDecoderConfig:
    if "activation_situ_beta" in raw and raw["activation_situ_beta"] is None:  # HF's SituAndMul: beta1 then 1.0
        raw = {**raw, "activation_situ_beta": 1.0}
    missing = [k for k in _required(cls) if k not in raw]
    la_raw = raw.get("linear_attn_config")
    if isinstance(la_raw, dict):
        missing += [f"linear_attn_config.{k}" for k in _required(LinearAttnConfig) if k not in la_raw]
    if missing:
        named = [f"{k} (the file has {a!r}, another model family's name for it)" if a in raw else
                 f"{k} ({_MISSING_MEANS[k]})" if k in _MISSING_MEANS else k for k in missing for a in [_ALIAS_OF.get(k)]]
        raise ConfigError(f"{source}: missing required key(s): {', '.join(named)}")
    # another family's name for a key beside ours: which one the file's author edited cannot be told
    clash = [f"{a}={raw[a]!r} but {k}={raw[k]!r}" for k, a in _ALIAS_OF.items() if a in raw and raw[a] != raw[k]]
    if clash:
        raise ConfigError(f"{source}: contradicting keys: {'; '.join(clash)} (this decoder reads {', '.join(_ALIAS_OF)})")
    if not isinstance(la_raw, dict):
        raise ConfigError(f"{source}: 'linear_attn_config' must be an object, found {la_raw!r}")

    _check_types(cls, raw, source, "")
    _check_types(LinearAttnConfig, la_raw, source, "linear_attn_config.")
    la_kwargs = {f.name: la_raw[f.name] for f in dataclasses.fields(LinearAttnConfig)}
    la_kwargs["kda_layers"] = tuple(la_kwargs["kda_layers"])
    la_kwargs["full_attn_layers"] = tuple(la_kwargs["full_attn_layers"])
    kwargs = {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw}
    kwargs["linear_attn_config"] = LinearAttnConfig(**la_kwargs)
    for key in ("num_expert_group", "topk_group", "num_nextn_predict_layers"):
        if kwargs.get(key) is None:
            kwargs.pop(key, None)
    cfg = cls(**kwargs)
    _check_supported(cfg, source)
    return cfg


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


# JSON type each annotation needs: a string where a number belongs (or "false" where a bool does, which
# is truthy) would otherwise load and run another model, or fail later with an error naming nothing
_TYPES = {
    "int": ("an integer", _is_int),
    "float": ("a number", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)),
    "float | None": ("a number or null", lambda v: v is None or isinstance(v, numbers.Real) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "tuple[int, ...]": ("a list of integers", lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) for x in v)),
}


def _check_types(cls, raw: dict, source: str, prefix: str) -> None:
    """Every present field of `cls` in `raw` has its JSON type; lists every one that has not."""
    bad = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING and raw.get(f.name) is None:
            continue  # null = the default (num_expert_group, topk_group); the token ids are not checked
        if f.name in raw and f.type in _TYPES:
            what, ok = _TYPES[f.type]
            if not ok(raw[f.name]):
                bad.append(f"{prefix}{f.name}={raw[f.name]!r} (expected {what})")
    if bad:
        raise ConfigError(f"{source}: wrong value type: " + "; ".join(bad))


_POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
             "qk_nope_head_dim", "v_head_dim", "intermediate_size", "num_experts", "moe_intermediate_size",
             "routed_expert_hidden_size", "moe_layer_freq")


def _check_supported(cfg: KimiDecoderConfig, source: str) -> None:
    """Refuse configs whose math this decoder does not implement, rather than run a wrong model."""
    la = cfg.linear_attn_config
    problems = []
    if cfg.hidden_act != "situ":
        problems.append(f"hidden_act={cfg.hidden_act!r} (expected 'situ')")
    if cfg.moe_router_activation_func != "sigmoid":
        problems.append(f"moe_router_activation_func={cfg.moe_router_activation_func!r} (expected 'sigmoid')")
    if not cfg.mla_use_nope:
        problems.append("mla_use_nope=false (rotary MLA is not K3)")
    if not la.use_full_rank_gate:
        problems.append("linear_attn_config.use_full_rank_gate=false (expected true)")
    if la.gate_lower_bound is None:
        problems.append("linear_attn_config.gate_lower_bound=null (the softplus gate is Kimi-Linear, not K3)")
    if cfg.num_expert_group != 1:
        problems.append(f"num_expert_group={cfg.num_expert_group} (grouped top-k is not implemented; K3 uses 1)")
    if cfg.topk_group != 1:  # 0 would choose no group, > 1 more groups than there are: not the one-group router run here
        problems.append(f"topk_group={cfg.topk_group} (with num_expert_group=1 the one group is chosen: expected 1, "
                        "as K3)")
    if cfg.attn_res_block_size is None or cfg.attn_res_block_size < 1:
        problems.append(f"attn_res_block_size={cfg.attn_res_block_size!r} (expected a positive integer)")
    if not 1 <= cfg.num_experts_per_token <= cfg.num_experts:
        problems.append(f"num_experts_per_token={cfg.num_experts_per_token} with num_experts={cfg.num_experts}")
    problems += [f"{k}={getattr(cfg, k)} (expected > 0)" for k in _POSITIVE if getattr(cfg, k) < 1]
    problems += [f"linear_attn_config.{k}={getattr(la, k)} (expected > 0)"
                 for k in ("num_heads", "head_dim", "short_conv_kernel_size") if getattr(la, k) < 1]
    problems += [f"{k}={getattr(cfg, k)} (expected >= 0)" for k in ("qk_rope_head_dim", "num_shared_experts",
                                                                     "first_k_dense_replace", "num_nextn_predict_layers")
                 if getattr(cfg, k) < 0]
    # the constants: a NaN or infinite one (JSON's NaN and Infinity parse) gives NaN or all-zero logits, not an error
    # (a routed_scaling_factor <= 0 zeroes or flips the routed experts' sum through the latent norm)
    positive = {"rms_norm_eps": cfg.rms_norm_eps, "activation_situ_beta": cfg.activation_situ_beta,
                "activation_situ_linear_beta": cfg.activation_situ_linear_beta,
                "routed_scaling_factor": cfg.routed_scaling_factor}
    problems += [f"{k}={v} (expected a finite number > 0)" for k, v in positive.items()
                 if v is not None and not 0 < v < math.inf]
    # g = lower_bound * sigmoid(...) must be < 0: the decay exp(g) <= 1 (K3: -5); at 0 the state never decays, above
    # it grows by up to e^lower_bound per token (NaN logits within ~20 tokens)
    lb = la.gate_lower_bound
    if lb is not None and not -math.inf < lb < 0:
        problems.append(f"linear_attn_config.gate_lower_bound={lb} (expected a finite number < 0: the gate's floor, "
                        "K3's is -5.0)")
    n = cfg.num_hidden_layers
    bad = [x for x in la.kda_layers if not 1 <= x <= n]
    if bad:
        problems.append(f"linear_attn_config.kda_layers has entries outside 1..{n}: {bad}")
    # full_attn_layers is not read by the math, but a config whose two lists disagree is not one model
    kda, full = sorted(la.kda_layers), sorted(la.full_attn_layers)
    if sorted(kda + full) != list(range(1, n + 1)):
        problems.append(f"linear_attn_config.kda_layers {list(kda)} and full_attn_layers {list(full)} do not split "
                        f"layers 1..{n} between them (each layer exactly once)")
    if problems:
        raise ConfigError(f"{source}: unsupported configuration: " + "; ".join(problems))
