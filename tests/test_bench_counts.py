"""The counts behind bench/prefill.py's floor, against a count by hand from the embedded model's config.json.

No timing here: the benchmarks time; this checks the yardstick they divide by.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kimi_explore import from_pretrained
from kimi_explore.weights.tiny_model import tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import prefill  # noqa: E402  (bench/prefill.py)


def hand_count(c: dict, T: int) -> tuple[int, int]:
    """(multiply-adds, exp/tanh) per token, mean over a T-token text, from the text_config alone."""
    d, V, la = c["hidden_size"], c["vocab_size"], c["linear_attn_config"]
    H, K = la["num_heads"], la["head_dim"]
    P = H * K
    nh, dn, dr, dv = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    E, k, I, lat = c["num_experts"], c["num_experts_per_token"], c["moe_intermediate_size"], c["routed_expert_hidden_size"]
    Ish, Id = c["num_shared_experts"] * I, c["intermediate_size"]
    n_kda, n_mla = len(la["kda_layers"]), len(la["full_attn_layers"])
    n_dense = c["first_k_dense_replace"]
    n_moe = c["num_hidden_layers"] - n_dense
    mean_len = (T + 1) // 2  # token t (0-based) of a fresh text sees t + 1 positions
    kda = (4 * P + H + K) * d + P * K + d * P  # q | k | v | g | b | f_a, f_b, o_proj
    mla = (c["q_lora_rank"] + c["kv_lora_rank"] + dr + nh * dv) * d + nh * (dn + dr) * c["q_lora_rank"] \
        + nh * (dn + dv) * c["kv_lora_rank"] + d * nh * dv + nh * (dn + dr + dv) * mean_len
    dense = 3 * Id * d
    # router | latent down | shared gate, up; k experts (w1, w3, w2); latent up; shared down
    moe = (E + lat + 2 * Ish) * d + k * 3 * I * lat + d * lat + d * Ish
    macs = V * d + n_kda * kda + n_mla * mla + n_dense * dense + n_moe * moe
    trans = n_kda * (6 * P + H) + n_mla * (nh * mean_len + nh * dv) + n_dense * 3 * Id + n_moe * (E + k * 3 * I + 3 * Ish) + V
    return macs, trans


@pytest.mark.parametrize("T,macs,trans", [(1024, 1_659_904, 14_536), (256, 1_414_144, 11_464)], ids=["T1024", "T256"])
def test_prefill_floor_counts_match_a_count_by_hand(T, macs, trans):
    """The embedded model: 6 KDA layers (P = 128: SiLU on q, k, v, the gate's and the decay's sigmoids and
    alpha = exp(g) make 6 P, plus beta), 2 MLA, 1 dense, 7 MoE layers, vocabulary 256."""
    path = tiny_checkpoint()
    cfg = json.loads((Path(path) / "config.json").read_text())["text_config"]
    assert hand_count(cfg, T) == (macs, trans)
    assert prefill.floor_counts(from_pretrained(path, device="cpu"), T) == (macs, trans)


def test_the_pipeline_plans_scratch_is_the_largest_matrix_the_loader_widens():
    """bench/pipeline.py sized each stage's widening scratch from unfused shapes (a KDA projection, the dense MLP's
    gate), while the loader widens its fused matrices (KDA's in_proj, gate_up): ~1 GB per GPU low at K3. Its count,
    against the scratch the loader reserves for the same layers."""
    import pipeline  # bench/pipeline.py

    from kimi_explore import memory_report
    from kimi_explore.weights.tiny_model import random_tiny_checkpoint

    for layers in ([0], [1, 2], [3], [4, 5]):  # dense, KDA + MoE, MLA + MoE
        w = from_pretrained(random_tiny_checkpoint(), device="cpu", layers=layers, head=False, weight_dtype="bfloat16",
                            bf16_matvec="widen")
        assert 4 * pipeline.largest_bf16_matrix(w.config, layers) == memory_report(w)["bf16 widening scratch"], layers


def test_the_pipeline_plans_mla_cache_is_what_a_decode_state_holds_per_position():
    """bench/pipeline.py's plans left out the MLA caches (2.95 MB a position at K3: 24 GB at 8,192 tokens). Its
    count per position, against the caches of a real decode state of the embedded model after 40 tokens."""
    import pipeline  # bench/pipeline.py

    from kimi_explore import Session

    w = from_pretrained(tiny_checkpoint(), device="cpu")
    s = Session(w, recorder=False)
    s.feed(list(range(40)))
    caches = [ls.attention for ls in s.state.layers if ls.attention.kind == "mla"]
    assert len(caches) == 2
    for c in caches:
        per_position = (c.keys.nbytes + c.values.nbytes) // c.keys.shape[1]  # [heads, capacity, ...]
        assert c.length == 40 and pipeline.mla_cache_bytes_per_position(w.config) == per_position
