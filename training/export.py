"""From the trainer's float weights to the released layout, and back.

`released_tensors(model)` gives every UNPREFIXED released tensor name -> float array in its on-disk
shape (routed experts dense, per expert, as `experts.{e}.w{1,2,3}.weight` [out, in]); the package's
writer (`kimi_explore.weights.tiny_model.save_checkpoint`) casts to BF16 / F32 and packs the experts
to MXFP4. `exported_values(model)` applies the same rounding in torch (what the checkpoint will hold),
and `load_exported(dir)` reads a written checkpoint back into a trainer model: the parity test
runs the trainer on exactly the weights `kimi_explore` decodes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .model import Cfg, KimiK3, mxfp4_round

# tensors kept in F32 on disk (spec 8.1); every other non-expert tensor is BF16
F32_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")


def _is_f32(name: str) -> bool:
    return name.endswith(F32_SUFFIXES)


def released_tensors(model: KimiK3) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        a = t.detach().to(torch.float32).cpu().numpy()
        base, _, leaf = name.rpartition(".")
        if base.endswith("block_sparse_moe") and leaf in ("w1", "w2", "w3"):
            for e in range(a.shape[0]):
                out[f"{base}.experts.{e}.{leaf}.weight"] = np.ascontiguousarray(a[e])
        else:
            out[name] = a
    return out


@torch.no_grad()
def round_to_released(model: KimiK3) -> None:
    """In place: round every tensor as the checkpoint stores it (BF16 matrices and norms, F32 small
    vectors kept, MXFP4 experts)."""
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        leaf = name.rpartition(".")[2]
        if leaf in ("w1", "w2", "w3"):
            p.copy_(mxfp4_round(p.to(torch.bfloat16).to(torch.float32)))
        elif not _is_f32(name):
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def save(model: KimiK3, path, shards: int = 3) -> Path:
    """Write the checkpoint through the package's writer."""
    tensors = released_tensors(model)
    text_config = model.cfg.text_config()
    from kimi_explore.weights.tiny_model import save_checkpoint

    return Path(save_checkpoint(path, text_config, tensors, shards=shards))


def cfg_from_text_config(tc: dict) -> Cfg:
    la = tc["linear_attn_config"]
    return Cfg(
        vocab_size=tc["vocab_size"], hidden_size=tc["hidden_size"], num_hidden_layers=tc["num_hidden_layers"],
        intermediate_size=tc["intermediate_size"], kda_heads=la["num_heads"], kda_head_dim=la["head_dim"],
        conv_size=la["short_conv_kernel_size"], gate_lower_bound=la["gate_lower_bound"],
        num_attention_heads=tc["num_attention_heads"], q_lora_rank=tc["q_lora_rank"], kv_lora_rank=tc["kv_lora_rank"],
        qk_nope_head_dim=tc["qk_nope_head_dim"], qk_rope_head_dim=tc["qk_rope_head_dim"], v_head_dim=tc["v_head_dim"],
        num_experts=tc["num_experts"], num_experts_per_token=tc["num_experts_per_token"],
        num_shared_experts=tc["num_shared_experts"], moe_intermediate_size=tc["moe_intermediate_size"],
        routed_expert_hidden_size=tc["routed_expert_hidden_size"], routed_scaling_factor=tc["routed_scaling_factor"],
        attn_res_block_size=tc["attn_res_block_size"], rms_norm_eps=tc["rms_norm_eps"],
        situ_beta=tc["activation_situ_beta"], situ_linear_beta=tc["activation_situ_linear_beta"],
    )


def load_exported(path) -> KimiK3:
    """A trainer model holding exactly the values of a written checkpoint (BF16 widened, MXFP4
    dequantised), in float32."""
    import ml_dtypes  # noqa: F401  (lets safetensors hand out BF16 arrays)
    from safetensors import safe_open

    from kimi_explore.weights import mxfp4

    path = Path(path)
    tc = json.loads((path / "config.json").read_text())["text_config"]
    prefix = "language_model."
    raw: dict[str, np.ndarray] = {}
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(path / fname, framework="numpy") as f:
            for n in f.keys():
                raw[n[len(prefix):]] = f.get_tensor(n)
    model = KimiK3(cfg_from_text_config(tc))
    sd = model.state_dict()
    new = {}
    for name in sd:
        base, _, leaf = name.rpartition(".")
        if leaf in ("w1", "w2", "w3"):
            E = sd[name].shape[0]
            new[name] = torch.from_numpy(np.stack([
                mxfp4.dequantize(raw[f"{base}.experts.{e}.{leaf}.weight_packed"], raw[f"{base}.experts.{e}.{leaf}.weight_scale"])
                for e in range(E)]).astype(np.float32))
        else:
            new[name] = torch.from_numpy(np.asarray(raw[name]).astype(np.float32))
    model.load_state_dict(new)
    model.eval()
    return model
