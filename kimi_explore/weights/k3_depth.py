"""K3's configuration, and a random checkpoint with K3's depth and routing width but narrow matrices.

    K3_TEXT_CONFIG, k3_text_config(**overrides)              the released K3 text_config (the one copy)
    k3_layer_lists(layers)                                   K3's KDA / MLA pattern at any depth (1-based lists)
    kimi-explore make-tiny --layers 93 --experts 896 --top-k 16 --out DIR
    k3_depth_config(layers=93, experts=896, top_k=16)        # the text_config make-tiny writes

K3's layer pattern: MLA ("full attention") at every 4th layer, 1-based, and at the last one; KDA
everywhere else (K3: 93 layers, MLA at 4, 8, ..., 92 and 93, so 24 MLA and 69 KDA). The benchmark
at K3 widths, this K3-depth model and the trainer of the tiny model all take it from here.

K3's structure is kept: 93 layers with MLA at every 4th (1-based) layer and at the last one, the
first layer dense and every other MoE, Block Attention Residual blocks of 12 layers, 896 routed
experts top-16 with a selection bias. The widths are toy ones (hidden 64, 16 KDA heads of 16, MoE
latent 16 / hidden 8) so the whole model is ~150 MB, most of it the safetensors headers of its
~250k per-expert tensors (the released layout names every expert matrix). Experts are BF16 by
default (a variant of the layout the reader accepts; `--expert-format mxfp4` packs them as released,
~280 MB, as MXFP4 needs widths that are multiples of 32). The weights are random: the predictions
mean nothing, the shapes and the bookkeeping are K3's.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

from .tiny_model import make_text_config, write_checkpoint

__all__ = ["K3_TEXT_CONFIG", "k3_depth_config", "k3_layer_lists", "k3_text_config", "main", "write_k3_depth"]


def k3_layer_lists(layers: int) -> dict[str, list[int]]:
    """`linear_attn_config`'s 1-based lists for K3's pattern at `layers` depth: MLA at every 4th layer and
    at the last one (`full_attn_layers`), KDA elsewhere (`kda_layers`)."""
    full = sorted(set(range(4, layers + 1, 4)) | {layers})
    return {"full_attn_layers": full, "kda_layers": [i for i in range(1, layers + 1) if i not in full]}


# The released K3's text_config (config.json's `text_config`; `quantization_config` aside).
K3_TEXT_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
    "hidden_size": 7168, "intermediate_size": 33792, "num_hidden_layers": 93, "num_attention_heads": 96,
    "num_key_value_heads": 96, "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "mla_use_output_gate": True, "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
    "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 1.0,
    "num_expert_group": 1, "topk_group": 1, "use_grouped_topk": True, "topk_method": "noaux_tc",
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "attn_res_block_size": 12,
    "max_position_embeddings": 1048576, "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "linear_attn_config": {**k3_layer_lists(93), "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                           "gate_lower_bound": -5.0, "use_full_rank_gate": True},
    "dtype": "bfloat16",
}


def k3_text_config(**overrides) -> dict:
    """A copy of `K3_TEXT_CONFIG` with `overrides` (top-level keys)."""
    cfg = copy.deepcopy(K3_TEXT_CONFIG)
    cfg.update(copy.deepcopy(overrides))
    return cfg


def k3_depth_config(layers: int = 93, experts: int = 896, top_k: int = 16, kda_heads: int = 16, block_size: int = 12,
                    expert_format: str = "bf16") -> dict:
    """A text_config with K3's layer pattern at `layers` depth and narrow widths (see module docstring)."""
    if layers < 2:
        raise ValueError(f"--layers must be >= 2 (one dense layer, then MoE layers), got {layers}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"--top-k must be in 1..--experts ({experts}), got {top_k}")
    if kda_heads < 1:
        raise ValueError(f"--kda-heads must be >= 1, got {kda_heads}")
    wide = expert_format == "mxfp4"  # MXFP4 groups 32 values along each matrix's input axis
    base = make_text_config()
    return make_text_config(
        num_hidden_layers=layers, num_experts=experts, num_experts_per_token=top_k, attn_res_block_size=block_size,
        hidden_size=64, intermediate_size=64, num_shared_experts=1,
        moe_intermediate_size=32 if wide else 8, routed_expert_hidden_size=32 if wide else 16,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        # A_log is stored head_dim wide (padded), so head_dim >= the number of heads
        linear_attn_config={**base["linear_attn_config"], **k3_layer_lists(layers),
                            "num_heads": kda_heads, "head_dim": max(16, kda_heads)})


def write_k3_depth(out, layers: int = 93, experts: int = 896, top_k: int = 16, kda_heads: int = 16,
                   block_size: int = 12, expert_format: str = "bf16", seed: int = 0, shards: int = 8):
    """Write the checkpoint (released layout, byte tokenizer vocabulary); returns its path."""
    if expert_format not in ("bf16", "mxfp4"):
        raise ValueError(f"--expert-format must be 'bf16' or 'mxfp4', got {expert_format!r}")
    if shards < 1:
        raise ValueError(f"--shards must be >= 1, got {shards}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory; name a new or empty directory")
    if (out / "config.json").exists() or any(out.glob("*.safetensors*")) or any(out.glob("*.gguf")):
        raise ValueError(f"--out {out}: already holds a checkpoint (config.json or weight files), which this would "
                         "overwrite; name a new or empty directory")
    cfg = k3_depth_config(layers, experts, top_k, kda_heads, block_size, expert_format)
    return write_checkpoint(out, cfg, seed=seed, shards=shards, experts=expert_format)


def main(argv=None, parser_class=argparse.ArgumentParser) -> int:
    """`kimi-explore make-tiny` (the CLI passes its one-line-error parser as `parser_class`)."""
    p = parser_class(prog="kimi-explore make-tiny",
                                description="Write a random checkpoint with K3's depth and expert count but narrow "
                                "widths, in the released layout, routed experts BF16 unless --expert-format mxfp4 (try the "
                                "Explorer and the report at K3 scale).")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--layers", type=int, default=93, help="decoder layers (default 93, as K3)")
    p.add_argument("--experts", type=int, default=896, help="routed experts per MoE layer (default 896)")
    p.add_argument("--top-k", type=int, default=16, help="experts per token (default 16)")
    p.add_argument("--kda-heads", type=int, default=16, help="KDA heads (default 16; K3 has 96)")
    p.add_argument("--block-size", type=int, default=12, help="attention-residual block size (default 12)")
    p.add_argument("--expert-format", default="bf16", choices=["bf16", "mxfp4"],
                   help="bf16 (default, ~150 MB at K3 depth) or mxfp4 as released (~280 MB, slower to write)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=8)
    args = p.parse_args(argv)
    if args.seed < 0:  # (NumPy's own message names no argument)
        p.error(f"--seed: expected an integer >= 0, got {args.seed}")
    t0 = time.perf_counter()
    try:
        out = write_k3_depth(args.out, args.layers, args.experts, args.top_k, args.kda_heads, args.block_size,
                             args.expert_format, args.seed, args.shards)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s: {args.layers} layers, {args.experts} experts "
          f"top-{args.top_k}; try: kimi-explore --checkpoint {out}")
    return 0
