"""A float64 decoder that reads the checkpoint itself and runs the naive_* reference functions.

Nothing of the fast path's loading is used (`kimi_explore.weights.load`, `records`, `safetensors_io`,
`tensor_reader`, `model.config`): the safetensors files are parsed here (bf16 is the top half of
an f32), the released names are spelled here, the routed experts go through
`mxfp4.naive_dequantize`, and config.json is read as plain JSON. From those raw tensors it builds
the operands the naive twins take, fused in the order the fast path's weight classes document
(fla's style: the twin takes the same operands as the kernel). So a loader mistake (rows of a fused
projection swapped, an attn-res score fused wrongly, A_log sliced wrongly) is not shared: the fast
decoder gets different numbers from these, and the float64 comparison (1e-9) fails.

The flow is HF's, literally: a Python list as the block stack, the attn-res norm and projection
applied separately (`naive_apply_attn_res`), one expert at a time, full causal attention recomputed
over every past MLA input.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kimi_explore.model.block_residual import naive_apply_attn_res
from kimi_explore.model.kda import KdaState, naive_kda_step
from kimi_explore.model.latent_moe import naive_latent_moe
from kimi_explore.model.mla import naive_mla_prefill
from kimi_explore.model.ops import naive_situ_and_mul
from kimi_explore.weights.mxfp4 import naive_dequantize

SAFETENSORS_DTYPES = {"F32": "<f4", "F64": "<f8", "U8": "u1"}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """u64 header length, a JSON header {name: dtype, shape, data_offsets}, then the raw bytes."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        buf = raw[8 + n + a : 8 + n + b]
        if h["dtype"] == "BF16":
            arr = (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(buf, SAFETENSORS_DTYPES[h["dtype"]])
        out[name] = arr.reshape(h["shape"])
    return out


class NaiveExperts:
    """The routed experts of one layer, dequantised one element at a time: the twin's `gather`."""

    def __init__(self, w1, w2, w3):
        self.w13 = np.concatenate([np.stack(w1), np.stack(w3)], axis=1)  # [E, 2I, l]: gate rows, then up rows
        self.w2 = np.stack(w2)  # [E, l, I]

    def gather(self, ids):
        return self.w13[ids], self.w2[ids]


class NaiveDecoder:
    """`NaiveDecoder(checkpoint_dir).step(token) -> (logits [vocab], record)`, float64 throughout."""

    def __init__(self, path):
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        self.cfg = cfg = SimpleNamespace(**raw.get("text_config", raw))
        self.la = SimpleNamespace(**cfg.linear_attn_config)
        t = {}
        for f in sorted(path.glob("*.safetensors")):
            t.update(read_safetensors(f))
        self.t = {k.removeprefix("language_model."): v for k, v in t.items()}
        self.layers = [self._layer(i) for i in range(cfg.num_hidden_layers)]
        self.embed = self.get("model.embed_tokens.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else self.get("lm_head.weight")
        self.kda_state = {}  # layer index -> KdaState (float64)
        self.mla_inputs = {}  # layer index -> every attention input so far
        for layer in self.layers:
            if layer.kind == "kda":
                H, K, W = self.la.num_heads, self.la.head_dim, self.la.short_conv_kernel_size
                self.kda_state[layer.index] = KdaState(np.zeros((3, H * K, W)), np.zeros((H, K, K)))
            else:
                self.mla_inputs[layer.index] = []

    def get(self, name):
        return np.asarray(self.t[name], dtype=np.float64)

    # ---------------------------------------------------------------- operands, from the released names

    def _layer(self, i):
        cfg, L = self.cfg, f"model.layers.{i}."
        g = lambda n: self.get(L + n)  # noqa: E731
        layer = SimpleNamespace(index=i, input_layernorm=g("input_layernorm.weight"),
                                post_attention_layernorm=g("post_attention_layernorm.weight"),
                                attn_res=(g("self_attention_res_norm.weight"), g("self_attention_res_proj.weight")),
                                mlp_res=(g("mlp_res_norm.weight"), g("mlp_res_proj.weight")))
        layer.kind = "kda" if i + 1 in self.la.kda_layers else "mla"
        layer.attention = self._kda(L + "self_attn.") if layer.kind == "kda" else self._mla(L + "self_attn.")
        is_moe = i >= cfg.first_k_dense_replace and i % cfg.moe_layer_freq == 0
        layer.ffn = self._moe(L + "block_sparse_moe.") if is_moe else SimpleNamespace(
            gate_up_proj=np.concatenate([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]),
            down_proj=g("mlp.down_proj.weight"))
        return layer

    def _kda(self, A):
        la, g = self.la, lambda n: self.get(A + n)  # noqa: E731
        H, K = la.num_heads, la.head_dim
        return SimpleNamespace(
            in_proj=np.concatenate([g(f"{n}_proj.weight") for n in ("q", "k", "v", "g", "b", "f_a")]),
            f_b_proj=g("f_b_proj.weight"),
            conv=np.stack([g(f"{s}_conv1d.weight")[:, 0, :] for s in "qkv"]),
            A=np.exp(g("A_log")[:H]).reshape(H, 1),  # per head; stored head_dim wide
            dt_bias=g("dt_bias").reshape(H, K), o_norm=g("o_norm.weight"), o_proj=g("o_proj.weight"),
            num_heads=H, head_dim=K, lower_bound=la.gate_lower_bound, eps=self.cfg.rms_norm_eps)

    def _mla(self, A):
        cfg, g = self.cfg, lambda n: self.get(A + n)  # noqa: E731
        rows = [g("q_a_proj.weight"), g("kv_a_proj_with_mqa.weight")]
        if cfg.mla_use_output_gate:
            rows.append(g("g_proj.weight"))
        return SimpleNamespace(
            in_proj=np.concatenate(rows), q_a_layernorm=g("q_a_layernorm.weight"), q_b_proj=g("q_b_proj.weight"),
            kv_a_layernorm=g("kv_a_layernorm.weight"), kv_b_proj=g("kv_b_proj.weight"), o_proj=g("o_proj.weight"),
            num_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
            use_output_gate=cfg.mla_use_output_gate)

    def _expert(self, base):
        if base + "weight_packed" in self.t:
            return naive_dequantize(self.t[base + "weight_packed"], self.t[base + "weight_scale"])
        return self.get(base + "weight")

    def _moe(self, M):
        cfg, g = self.cfg, lambda n: self.get(M + n)  # noqa: E731
        E = range(cfg.num_experts)
        w1, w2, w3 = ([self._expert(M + f"experts.{e}.{n}.") for e in E] for n in ("w1", "w2", "w3"))
        return SimpleNamespace(
            in_proj=np.concatenate([g("gate.weight"), g("routed_expert_down_proj.weight"),
                                    g("shared_experts.gate_proj.weight"), g("shared_experts.up_proj.weight")]),
            e_score_correction_bias=g("gate.e_score_correction_bias"), experts=NaiveExperts(w1, w2, w3),
            routed_expert_norm=(g("routed_expert_norm.weight") if cfg.latent_moe_use_norm
                                else np.ones(cfg.routed_expert_hidden_size)),  # not released when off
            routed_expert_up_proj=g("routed_expert_up_proj.weight"),
            shared_down_proj=g("shared_experts.down_proj.weight"), num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_token, latent_size=cfg.routed_expert_hidden_size,
            renormalize=cfg.moe_renormalize and cfg.num_experts_per_token > 1,  # KimiMoEGate: "if self.top_k > 1 and ..."
            routed_scaling_factor=cfg.routed_scaling_factor,
            use_latent_norm=cfg.latent_moe_use_norm, eps=cfg.rms_norm_eps, situ_beta=cfg.activation_situ_beta,
            situ_linear_beta=cfg.activation_situ_linear_beta)

    # ---------------------------------------------------------------- one token

    def step(self, token: int):
        """Returns (logits, record): record holds, per layer index, the attn-res weights of both sites
        ("attn", "ffn"), the router's ids and weights, the layer output ("prefix_sum"), the KDA state
        and conv window after this token ("kda_state" S_h[k, v], "kda_conv"); then the output mix
        weights ("final"), the final norm's output ("hidden") and the block stack ("blocks")."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        record = {key: {} for key in ("attn", "ffn", "ids", "weights", "prefix_sum", "kda_state", "kda_conv")}
        h = self.embed[token]
        stack = []
        for layer in self.layers:
            i = layer.index
            prefix, a_in = h, h
            if stack:
                a_in, record["attn"][i] = naive_apply_attn_res(prefix, stack, *layer.attn_res, eps)
            if i % cfg.attn_res_block_size == 0:
                stack.append(prefix)  # the raw input; this layer's own sum restarts from its attention output
                prefix = 0.0
            x = rms(a_in, layer.input_layernorm, eps)
            if layer.kind == "kda":
                a, self.kda_state[i] = naive_kda_step(x, layer.attention, self.kda_state[i])
                record["kda_state"][i], record["kda_conv"][i] = self.kda_state[i].recurrent, self.kda_state[i].conv
            else:
                self.mla_inputs[i].append(x)
                a = naive_mla_prefill(np.array(self.mla_inputs[i]), layer.attention)[-1]
            prefix = prefix + a
            f_in, record["ffn"][i] = naive_apply_attn_res(prefix, stack, *layer.mlp_res, eps)
            y = rms(f_in, layer.post_attention_layernorm, eps)
            if hasattr(layer.ffn, "experts"):
                f, record["ids"][i], record["weights"][i] = naive_latent_moe(y, layer.ffn)
            else:
                act = naive_situ_and_mul(layer.ffn.gate_up_proj @ y, cfg.activation_situ_beta,
                                         cfg.activation_situ_linear_beta)
                f = layer.ffn.down_proj @ act
            h = record["prefix_sum"][i] = prefix + f
        out, record["final"] = naive_apply_attn_res(h, stack, self.get("model.output_attn_res_norm.weight"),
                                                    self.get("model.output_attn_res_proj.weight"), eps)
        record["hidden"] = rms(out, self.get("model.norm.weight"), eps)
        record["blocks"] = np.array(stack)
        return self.lm_head @ record["hidden"], record


def rms(x, g, eps):
    return x / np.sqrt(np.mean(x * x) + eps) * g


class Collect:
    """A minimal hook object: keeps a copy of every value it sees, changes nothing."""

    def __init__(self):
        self.values: dict[str, list] = {}

    def fire(self, name, value):
        self.values.setdefault(name, []).append(np.array(value, copy=True))
        return value

    def stacked(self, name):
        return np.stack(self.values[name])


# the fast decoder's hook name -> the naive record key, for every per-layer value compared
PER_LAYER = {"prefix_sum": "prefix_sum", "attn_res.attn.weights": "attn", "attn_res.ffn.weights": "ffn",
             "moe.router.topk_weights": "weights", "kda.state": "kda_state", "kda.conv": "kda_conv"}


def assert_matches_naive(logits, hooks: Collect, naive_steps, tol: float = 1e-9) -> None:
    """A float64 fast decode (its logits [T, vocab] and a `Collect` of its hooks) against the
    NaiveDecoder's (logits, record) of the same tokens: every value to `tol` (rtol and atol), the
    router's ids exactly. Every value the naive record has must be there on the fast side too."""
    want = np.stack([lg for lg, _ in naive_steps])
    records = [r for _, r in naive_steps]
    np.testing.assert_allclose(logits, want, rtol=tol, atol=tol, err_msg="logits")
    for hook, key in (("final.hidden", "hidden"), ("final.attn_res.weights", "final"),
                      ("final.block_residual", "blocks")):
        np.testing.assert_allclose(hooks.stacked(hook), [r[key] for r in records], rtol=tol, atol=tol, err_msg=hook)
    for hook, key in PER_LAYER.items():
        for i in records[0][key]:
            name = f"layers.{i}.{hook}"
            np.testing.assert_allclose(hooks.stacked(name), [r[key][i] for r in records], rtol=tol, atol=tol,
                                       err_msg=name)
    for i in records[0]["ids"]:
        np.testing.assert_array_equal(hooks.stacked(f"layers.{i}.moe.router.topk_ids"),
                                      [r["ids"][i] for r in records], err_msg=f"layers.{i} router ids")
