"""A llama.cpp `kimi-k3` GGUF's metadata as a `KimiDecoderConfig` (the same config the released config.json gives).

Keys read (after `kimi-k3.`), each required unless said:

    block_count                  num_hidden_layers          embedding_length     hidden_size
    feed_forward_length          intermediate_size          attention.head_count num_attention_heads
    attention.q_lora_rank        q_lora_rank                attention.kv_lora_rank  kv_lora_rank
    rope.dimension_count         qk_rope_head_dim           attention.value_length_mla  v_head_dim
    attention.key_length_mla     qk_nope_head_dim + qk_rope_head_dim
    attention.layer_norm_rms_epsilon  rms_norm_eps
    attention.head_count_kv      per layer: 0 = KDA, 1 = MLA (-> linear_attn_config.kda_layers /
                                 full_attn_layers, 1-based as in config.json)
    kda.head_dim, kda.gate_lower_bound, ssm.conv_kernel    linear_attn_config.head_dim,
                                 .gate_lower_bound, .short_conv_kernel_size
    expert_count, expert_used_count, expert_shared_count, expert_feed_forward_length,
    expert_latent_length         num_experts, num_experts_per_token, num_shared_experts,
                                 moe_intermediate_size, routed_expert_hidden_size
    expert_weights_scale, expert_weights_norm, expert_gating_func (2 = sigmoid, 1 = softmax)
                                 routed_scaling_factor, moe_renormalize, moe_router_activation_func
    leading_dense_block_count    first_k_dense_replace
    activation.situ_beta, activation.situ_linear_beta, attn_res.block_size
    expert_group_count, expert_group_used_count (optional, default 1)   num_expert_group, topk_group
    vocab_size (optional: else the rows of token_embd)
    tokenizer.ggml.bos/eos/padding_token_id (optional)                 bos/eos/pad_token_id

Not carried by the GGUF, derived (a different model would show in a tensor shape, and `GgufSource.check`
checks every shape against the config built here):

    linear_attn_config.num_heads  the length of the first KDA layer's ssm_a ([H]; ne (1, H) too); llama.cpp itself
                                  assumes it equals attention.head_count
    use_full_rank_gate = true     ssm_g is one [P, d] matrix (checked by its shape)
    mla_use_nope = true           kimi-k3 never rotates (rope.dimension_count only sizes the dims)
    mla_use_output_gate           whether MLA layers have attn_gate: all of them or none (some only: the
                                  missing ones are named, not the others called extra)
    latent_moe_use_norm           whether MoE layers have ffn_routed_norm
    tie_word_embeddings = false   output.weight must be there: llama.cpp's kimi-k3 loader requires it (no
                                  fallback to token_embd), so a file without it is refused
    routed_scaling_factor         expert_weights_scale, where 0.0 means 1.0: llama.cpp scales only by a
                                  factor other than 0 and 1 (`build_moe_ffn`), and 0.0 is its default
    hidden_act = "situ", moe_layer_freq = 1   K3's fixed conventions (llama.cpp's kimi-k3 graph has
                                  no other activation and makes every layer from the leading dense
                                  ones on MoE)

Trap: float keys are stored as F32 (rms_norm_eps 1e-5 reads 9.99999974e-06). They are taken as the
shortest decimal that rounds to the stored float32 (1e-05), which is what config.json holds where it
has at most 7-8 significant digits (K3's constants: 1e-5, 2.827, 4.0). A config value with more digits
than float32 holds (2.8271234567891) cannot come back from the GGUF; the scalars used in double
(routing weights' scale, the SiTU betas, the token path's gate bound) then differ from the checkpoint's,
and so do the logits, by ~1e-5.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..model.config import KimiDecoderConfig

ARCH = "kimi-k3"
F32_TYPE = 6
# config.json key (or linear_attn_config.key) -> GGUF key after "kimi-k3."
KEYS = {
    "num_hidden_layers": "block_count", "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count", "q_lora_rank": "attention.q_lora_rank",
    "kv_lora_rank": "attention.kv_lora_rank", "qk_rope_head_dim": "rope.dimension_count",
    "v_head_dim": "attention.value_length_mla", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "num_experts": "expert_count", "num_experts_per_token": "expert_used_count", "num_shared_experts": "expert_shared_count",
    "moe_intermediate_size": "expert_feed_forward_length", "routed_expert_hidden_size": "expert_latent_length",
    "routed_scaling_factor": "expert_weights_scale", "moe_renormalize": "expert_weights_norm",
    "first_k_dense_replace": "leading_dense_block_count", "activation_situ_beta": "activation.situ_beta",
    "activation_situ_linear_beta": "activation.situ_linear_beta", "attn_res_block_size": "attn_res.block_size",
    "linear_attn_config.head_dim": "kda.head_dim", "linear_attn_config.gate_lower_bound": "kda.gate_lower_bound",
    "linear_attn_config.short_conv_kernel_size": "ssm.conv_kernel",
}
DERIVED_FROM = ("attention.key_length_mla", "attention.head_count_kv", "expert_gating_func")  # also required
GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE


def _value(meta: dict, types: dict, key: str):
    """A metadata value; F32 floats as the shortest decimal that rounds to them (see the module docstring)."""
    v = meta[key]
    return float(str(np.float32(v))) if types.get(key) == F32_TYPE else v


def _head_count(shape: tuple, name: str, source: str) -> int:
    """The KDA head count: the one axis of ssm_a [H] that is not 1 (a writer may give it ne (1, H) or (H, 1))."""
    axes = [int(d) for d in shape if d != 1]
    if len(axes) > 1:
        raise ConfigError(f"{source}: tensor '{name}' has shape {list(shape)}; expected one value per KDA head ([H]), "
                          "which gives the KDA head count")
    return axes[0] if axes else 1


def config_from_gguf(meta: dict, types: dict, tensors: dict, source: str) -> KimiDecoderConfig:
    """The config of a `kimi-k3` GGUF from its metadata ({key: value}, {key: value type}) and its tensors'
    {name: (ggml type, NumPy shape)}. Refuses another architecture, and lists every missing key at once."""
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise ConfigError(f"{source}: general.architecture is {arch!r}; kimi_explore reads llama.cpp's {ARCH!r} GGUFs only")
    need = [f"{ARCH}.{k}" for k in list(KEYS.values()) + list(DERIVED_FROM)]
    missing = [k for k in need if k not in meta]
    if missing:
        raise ConfigError(f"{source}: missing GGUF metadata key(s): {', '.join(missing)}")
    get = lambda k: _value(meta, types, f"{ARCH}.{k}")  # noqa: E731
    raw = {c: get(g) for c, g in KEYS.items() if "." not in c}
    if raw["routed_scaling_factor"] == 0.0:  # llama.cpp's "unscaled" (see the module docstring)
        raw["routed_scaling_factor"] = 1.0
    if "output.weight" not in tensors:
        raise ConfigError(f"{source}: no tensor 'output.weight' (the output head): llama.cpp's {ARCH} loader requires it "
                          "and never falls back to token_embd, so this file is not a model llama.cpp runs")
    la = {c.split(".", 1)[1]: get(g) for c, g in KEYS.items() if "." in c}
    n = raw["num_hidden_layers"]
    if type(n) is not int or n < 1:  # (used below, before the config checks every value's type)
        raise ConfigError(f"{source}: {ARCH}.block_count is {n!r} ({type(n).__name__}), expected a positive integer "
                          "(the number of layers)")
    kinds = get("attention.head_count_kv")
    if not isinstance(kinds, list) or len(kinds) != n or any(k not in (0, 1) for k in kinds):
        raise ConfigError(f"{source}: {ARCH}.attention.head_count_kv must list 0 (KDA) or 1 (MLA) for each of the "
                          f"{n} layers; found {kinds!r}")
    kda = [i for i in range(n) if kinds[i] == 0]
    mla = [i for i in range(n) if kinds[i] == 1]
    gated = [i for i in mla if f"blk.{i}.attn_gate.weight" in tensors]
    if gated and len(gated) < len(mla):
        absent = [f"blk.{i}.attn_gate.weight" for i in mla if i not in gated]
        raise ConfigError(f"{source}: {len(absent)} MLA output gate tensor(s) missing: {', '.join(absent)}; the gate "
                          f"(attn_gate) is in MLA layers {gated} and a K3 GGUF has it in every MLA layer {mla} or in none")
    gating = get("expert_gating_func")
    raw.update(
        qk_nope_head_dim=get("attention.key_length_mla") - raw["qk_rope_head_dim"],
        moe_router_activation_func=GATING.get(gating, f"ggml gating function {gating}"),
        vocab_size=meta.get(f"{ARCH}.vocab_size", tensors.get("token_embd.weight", (None, (None,)))[1][0]),
        mla_use_nope=True, hidden_act="situ", moe_layer_freq=1,
        mla_use_output_gate=bool(gated),
        latent_moe_use_norm=any(name.endswith(".ffn_routed_norm.weight") for name in tensors),
        tie_word_embeddings=False,
        num_expert_group=meta.get(f"{ARCH}.expert_group_count", 1), topk_group=meta.get(f"{ARCH}.expert_group_used_count", 1),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    ssm_a = tensors.get(f"blk.{kda[0]}.ssm_a") if kda else None
    if kda and ssm_a is None:
        raise ConfigError(f"{source}: layer {kda[0]} is KDA (head_count_kv 0) but has no tensor 'blk.{kda[0]}.ssm_a', "
                          "which gives the KDA head count")
    la.update(num_heads=_head_count(ssm_a[1], f"blk.{kda[0]}.ssm_a", source) if kda else raw["num_attention_heads"],
              use_full_rank_gate=True, kda_layers=[i + 1 for i in kda], full_attn_layers=[i + 1 for i in mla])
    raw["linear_attn_config"] = la
    try:
        return KimiDecoderConfig.from_dict(raw, source=source)
    except ConfigError as e:  # it names config.json's keys: add the GGUF keys they were read from
        named = [f"{c} is {ARCH}.{g}" for c, g in KEYS.items() if f"{c}=" in str(e)]
        if not named:
            raise
        raise ConfigError(f"{e} (in the GGUF: {'; '.join(named)})") from None
