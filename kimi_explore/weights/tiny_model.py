"""Deterministic tiny K3 checkpoints in the released layout (random weights, MXFP4 experts).

`python -m kimi_explore.weights.tiny_model --out data/tiny_k3` wrote the embedded model in `data/`; tests
use `write_checkpoint` with other shapes to make sure the decoder assumes nothing the released
config does not. The layout is the real one: the `kimi_k3` config shell, `language_model.` names,
BF16 matrices, F32 small vectors, `A_log` head_dim wide and zero-padded, MXFP4 routed experts,
sharded safetensors behind `model.safetensors.index.json`.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import ml_dtypes
import numpy as np

from ..model.config import KimiDecoderConfig
from . import mxfp4
from .safetensors_io import write_safetensors

BF16 = ml_dtypes.bfloat16

# The embedded model: K3's layer pattern (MLA every 4th layer plus a final MLA pair, a dense first
# layer, block size 4) at toy widths, with a byte-level vocabulary.
TINY_TEXT_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 192,
    "num_hidden_layers": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 16,
    "num_experts_per_token": 4,
    "num_shared_experts": 2,
    "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 64,
    "latent_moe_use_norm": True,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 1.0,
    "num_expert_group": 1,
    "topk_group": 1,
    "use_grouped_topk": True,
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "attn_res_block_size": 4,
    "max_position_embeddings": 4096,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": 0,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 15, 16],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14],
        "num_heads": 4,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
    },
    "dtype": "bfloat16",
}

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                        "dynamic": False, "scale_dtype": "torch.uint8"},
        }
    },
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}


def make_text_config(**overrides) -> dict:
    """The embedded model's text_config with `overrides` (use `linear_attn_config=` for the KDA part)."""
    cfg = copy.deepcopy(TINY_TEXT_CONFIG)
    cfg.update(copy.deepcopy(overrides))
    return cfg


def _tensors(text_config: dict, seed: int, experts: str) -> dict[str, np.ndarray]:
    """Every language-model tensor (unprefixed names), with scales that exercise each nonlinearity."""
    cfg = KimiDecoderConfig.from_dict(text_config)
    rng = np.random.default_rng(seed)
    d, V = cfg.hidden_size, cfg.vocab_size
    t: dict[str, np.ndarray] = {}

    def mat(name, rows, cols, gain=1.0):
        t[name] = (rng.standard_normal((rows, cols)) * (gain / np.sqrt(cols))).astype(BF16)

    def vec(name, n, mean=1.0, spread=0.1, dtype=BF16):
        t[name] = (mean + spread * rng.standard_normal(n)).astype(dtype)

    mat("model.embed_tokens.weight", V, d, gain=np.sqrt(d))
    mat("lm_head.weight", V, d, gain=2.0)
    vec("model.norm.weight", d)
    vec("model.output_attn_res_norm.weight", d)
    mat("model.output_attn_res_proj.weight", 1, d, gain=3.0)
    la = cfg.linear_attn_config
    H, K, W, P = la.num_heads, la.head_dim, la.short_conv_kernel_size, cfg.kda_proj_width
    for i in range(cfg.num_hidden_layers):
        L = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            vec(L + n + ".weight", d)
        mat(L + "self_attention_res_proj.weight", 1, d, gain=3.0)
        mat(L + "mlp_res_proj.weight", 1, d, gain=3.0)
        A = L + "self_attn."
        if cfg.is_kda_layer(i):
            for s in "qkv":
                mat(A + f"{s}_proj.weight", P, d, gain=1.5)
                t[A + f"{s}_conv1d.weight"] = (rng.standard_normal((P, 1, W)) * 0.6).astype(np.float32)
            mat(A + "f_a_proj.weight", K, d)
            mat(A + "f_b_proj.weight", P, K, gain=2.0)
            mat(A + "b_proj.weight", H, d, gain=2.0)
            mat(A + "g_proj.weight", P, d, gain=2.0)
            mat(A + "o_proj.weight", d, P)
            vec(A + "o_norm.weight", K, dtype=np.float32)
            a_log = np.zeros(K, np.float32)  # per head, zero-padded to head_dim as released
            a_log[:H] = rng.uniform(-1.0, 1.5, H)
            t[A + "A_log"] = a_log
            t[A + "dt_bias"] = rng.uniform(-1.0, 1.0, P).astype(np.float32)
        else:
            nh, dq, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
            mat(A + "q_a_proj.weight", cfg.q_lora_rank, d)
            vec(A + "q_a_layernorm.weight", cfg.q_lora_rank)
            mat(A + "q_b_proj.weight", nh * dq, cfg.q_lora_rank, gain=2.0)
            mat(A + "kv_a_proj_with_mqa.weight", cfg.kv_lora_rank + cfg.qk_rope_head_dim, d, gain=2.0)
            vec(A + "kv_a_layernorm.weight", cfg.kv_lora_rank)
            mat(A + "kv_b_proj.weight", nh * (cfg.qk_nope_head_dim + dv), cfg.kv_lora_rank, gain=1.5)
            if cfg.mla_use_output_gate:
                mat(A + "g_proj.weight", nh * dv, d, gain=2.0)
            mat(A + "o_proj.weight", d, nh * dv)
        if cfg.is_moe_layer(i):
            M, E, lat, I = L + "block_sparse_moe.", cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
            mat(M + "gate.weight", E, d, gain=2.0)
            t[M + "gate.e_score_correction_bias"] = rng.permutation(np.linspace(-0.15, 0.15, E)).astype(np.float32)
            mat(M + "routed_expert_down_proj.weight", lat, d, gain=2.0)
            vec(M + "routed_expert_norm.weight", lat)
            mat(M + "routed_expert_up_proj.weight", d, lat)
            Ish = cfg.shared_intermediate_size
            mat(M + "shared_experts.gate_proj.weight", Ish, d, gain=4.0)
            mat(M + "shared_experts.up_proj.weight", Ish, d, gain=4.0)
            mat(M + "shared_experts.down_proj.weight", d, Ish)
            for e in range(E):
                for wn, (r, c), gain in (("w1", (I, lat), 4.0), ("w3", (I, lat), 4.0), ("w2", (lat, I), 1.0)):
                    w = rng.standard_normal((r, c)) * (gain / np.sqrt(c))
                    base = M + f"experts.{e}.{wn}."
                    t[base + "weight"] = w if experts == "mxfp4" else w.astype(BF16)  # float: packed on save
        else:
            I = cfg.intermediate_size
            mat(L + "mlp.gate_proj.weight", I, d, gain=4.0)
            mat(L + "mlp.up_proj.weight", I, d, gain=4.0)
            mat(L + "mlp.down_proj.weight", d, I)
    return t


def _shard_key(name: str, n_layers: int, shards: int) -> int:
    """Shard 0 holds the global tensors; layers are spread evenly over the others (as the release does)."""
    parts = name.split(".")
    if shards == 1 or parts[1] != "layers":
        return 0
    return 1 + int(parts[2]) * (shards - 1) // n_layers


def write_checkpoint(path, text_config: dict | None = None, *, seed: int = 0, shards: int = 1,
                     experts: str = "mxfp4", prefix: str = "language_model.", index: bool = True) -> Path:
    """Write a checkpoint of random weights; returns its path. `experts` is "mxfp4" or "bf16"."""
    text_config = make_text_config() if text_config is None else text_config
    if experts not in ("mxfp4", "bf16"):
        raise ValueError(f"experts={experts!r}: expected 'mxfp4' or 'bf16'")
    return save_checkpoint(path, text_config, _tensors(text_config, seed, experts), shards=shards, prefix=prefix,
                           index=index)


F32_SUFFIXES = ("A_log", "dt_bias", "_conv1d.weight", "o_norm.weight", "e_score_correction_bias")  # F32 on disk


def save_checkpoint(path, text_config: dict, tensors: dict[str, np.ndarray], *, shards: int = 1,
                    prefix: str = "language_model.", index: bool = True) -> Path:
    """Write `tensors` (unprefixed released names -> arrays in their on-disk shapes) in the released layout.

    Each float tensor is cast to its released dtype (F32 for the small vectors, BF16 for the rest);
    a routed expert given dense as `...experts.{e}.w{1,2,3}.weight` (float) is packed to MXFP4
    (`weight_packed` / `weight_scale`) when the experts are quantised (no `experts="bf16"` marker:
    pass BF16 arrays to keep them dense). Writes config.json (the `kimi_k3` shell with
    `quantization_config` when any expert is MXFP4), the shards and `model.safetensors.index.json`.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out: dict[str, np.ndarray] = {}
    for name, a in tensors.items():
        a = np.asarray(a)
        if ".experts." in name and name.endswith(".weight") and a.dtype != BF16:
            out[name[: -len("weight")] + "weight_packed"], out[name[: -len("weight")] + "weight_scale"] = mxfp4.quantize(a)
        elif a.dtype == np.uint8:
            out[name] = a
        else:
            out[name] = a.astype(np.float32 if name.endswith(F32_SUFFIXES) else BF16)
    quantised = any(n.endswith("weight_packed") for n in out)
    tensors = {prefix + k: v for k, v in out.items()}
    tc = dict(text_config)
    if quantised:
        tc["quantization_config"] = QUANTIZATION_CONFIG
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "dtype": "bfloat16",
              "bos_token_id": tc.get("bos_token_id"), "eos_token_id": tc.get("eos_token_id"),
              "pad_token_id": tc.get("pad_token_id"), "tie_word_embeddings": False, "text_config": tc,
              "vision_config": None}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if shards == 1 and not index:
        write_safetensors(path / "model.safetensors", tensors)
        return path
    n_layers = text_config["num_hidden_layers"]
    groups: dict[int, dict] = {}
    for name, a in tensors.items():
        groups.setdefault(_shard_key(name[len(prefix):], n_layers, shards), {})[name] = a
    names = {k: "model.safetensors" if shards == 1 else f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in groups}
    weight_map = {}
    for k, group in sorted(groups.items()):
        write_safetensors(path / names[k], group)
        weight_map.update({n: names[k] for n in group})
    total = sum(a.nbytes for a in tensors.values())
    index_doc = {"metadata": {"total_size": int(total)}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n")
    return path


def default_checkpoint() -> Path:
    """The embedded tiny model: `data/tiny_k3` in a source checkout, else generated once into a cache dir."""
    repo = Path(__file__).resolve().parent.parent / "data" / "tiny_k3"
    if (repo / "config.json").exists():
        return repo
    cache = Path.home() / ".cache" / "kimi_explore" / "tiny_k3"
    if not (cache / "config.json").exists():
        write_checkpoint(cache, seed=EMBEDDED_SEED, shards=EMBEDDED_SHARDS)
    return cache


tiny_checkpoint = default_checkpoint
EMBEDDED_SEED = 2026
EMBEDDED_SHARDS = 5


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Write the embedded tiny K3 checkpoint (deterministic random weights).")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=EMBEDDED_SEED)
    p.add_argument("--shards", type=int, default=EMBEDDED_SHARDS)
    args = p.parse_args(argv)
    out = write_checkpoint(args.out, seed=args.seed, shards=args.shards)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
