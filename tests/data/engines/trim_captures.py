"""Trim the shared llama.cpp decode captures (and set d's prefill capture) (../shared/reference/engines/<set>/llamacpp/) to what
the tests and notebook 07 use: run from the repository root, `python tests/data/engines/trim_captures.py [DIR]`."""

import os
import sys

import numpy as np

from kimi_explore.engines.name_maps import parse_llamacpp_name

SOURCE = sys.argv[1] if len(sys.argv) > 1 else "../shared/reference/engines/"
KEEP = {"inp_embd", "attn_norm", "kda_q_conv", "kda_k_conv", "kda_v_conv", "kda_beta", "kda_g1", "kda_g2", "new_state",
        "attn_output", "kda_out", "mla_out", "prefix_sum_attn", "res_probs", "ffn_norm", "ffn_moe_probs", "ffn_moe_topk",
        "ffn_moe_weights_scaled", "ffn_moe_out", "ffn_shexp", "ffn_out", "l_out", "kq_soft_max", "kqv_mla", "result_norm", "norm"}
MLA_LAYERS = (2, 6, 9, 12, 13)
STATE_LAYERS = (0, 1)


def keep(base: str, layer, k) -> bool:
    if base not in KEEP:
        return False
    if base == "norm":
        return k in (1, 2) and layer in MLA_LAYERS  # the MLA q_a / kv_a latents
    return base != "new_state" or layer in STATE_LAYERS


for st, kind, mode in (("d", "f32experts", "decode"), ("d", "mxfp4", "decode"), ("e", "f32experts", "decode"),
                       ("d", "f32experts", "prefill")):
    z = np.load(os.path.join(SOURCE, f"{st}/llamacpp/llamacpp_{kind}_{mode}.npz"))
    T = z["tokens"].shape[0]
    out = {"tokens": z["tokens"], "logits": z["logits"]}
    for name in z.files:
        if name not in out and keep(*parse_llamacpp_name(name)):
            a = z[name]
            out[name] = a[..., :T] if name.startswith("kq_soft_max") else a  # (decode [T, H, 1, 256], prefill [H, T, 256])
    path = f"tests/data/engines/{st}/llamacpp/llamacpp_{kind}_{mode}.npz"
    np.savez_compressed(path, **out)
    print(path, f"{os.path.getsize(path) / 1e6:.2f} MB", len(out), "arrays")
