"""Every model component and weight kernel against a naive float64 twin written HERE, from the architecture
notes (../shared/docs/k3-architecture.md beside a checkout; the section is named at each twin), reading its
own raw operands.

The package's own `naive_*` references (ops, block_residual, kda, kda_chunk, mla, latent_moe, mxfp4,
ggml_quants) are not used: a twin that lives beside the fast path shares its module, its imports and
its reading of the operand layout. The twins below take the operands as the release names them
(q_proj, ..., A_log head_dim wide, conv [P, 1, W], experts w1/w3/w2 or their MXFP4 bytes). The module
tests fuse them into the package's weight records by the layout those records document; the decoder
test reads the checkpoint's bytes itself while the package loads it, so a loader's fusion is checked
too. Loops and formulas are plain float64 (math.exp / math.tanh per element where the formula is
elementwise). `test_*_sequence*` / rows checks compare the sequence forms to the same twin the token
form meets: the sequence form equals stepping to the stated tolerance.

Tolerances, relative to the largest |value| of the reference (measured on these operands in brackets):
- float64 package routes: TOL64 = 1e-12. Both sides compute the same exact formula in float64 and differ
  only in summation order and fused operations [2e-16 .. 3e-14 per module, 1.4e-13 for the chunked rule
  over 150 tokens, 1.3e-13 for the 16-layer decoder]; a wrong formula moves values by >= 1e-3.
- float32 routes (compiled kernels, float32 BLAS): TOL32 = 1e-5, a few hundred float32 epsilons
  (6e-8) over sums of tens of terms [8e-8 .. 2.6e-6]. KDA's float32 outputs: TOL32_KDA = 3e-5, since
  the per-head gated RMSNorm rescales each head's read-out o = S^T q to O(1), amplifying float32
  cancellation in a small o (float32 STEPPING is itself 4.5e-6 off the twin with every gate at the
  bound) [8.6e-6]. The 16-layer decoder in float32: 1e-4 [1.6e-5].
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from naive_decoder import read_safetensors  # (the tests' own reader of the bytes, not the package's)

import kimi_explore as ke
from kimi_explore.model import kda_recurrence
from kimi_explore.model.block_residual import SourceBuffer, apply_attn_res
from kimi_explore.model.config import FFN_SITES
from kimi_explore.model.kda import KdaState, KdaWeights, kda_sequence, kda_step
from kimi_explore.model.kda_chunk import chunked_delta_rule
from kimi_explore.model.kimi_sequence import kimi_forward_sequence
from kimi_explore.model.latent_moe import DenseExperts, LatentMoeWeights, latent_moe
from kimi_explore.model.latent_moe_sequence import latent_moe_sequence
from kimi_explore.model.mla import MlaState, MlaWeights, mla_sequence, mla_step
from kimi_explore.model.ops import DenseMlpWeights, dense_mlp, dense_mlp_sequence, rms_norm, situ_and_mul, situ_inv_caps
from kimi_explore.model.sequence_ops import situ_and_mul_rows
from kimi_explore.weights import ggml_quants, mxfp4, mxfp4_matvec
from kimi_explore.weights.bf16_weights import Bf16Matrix, WideningScratch
from kimi_explore.weights.experts import PackedExperts
from kimi_explore.weights.tiny_model import random_tiny_checkpoint

TOL64, TOL32, TOL32_KDA = 1e-12, 1e-5, 3e-5
E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # section 8.3


def rel_err(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(float(np.max(np.abs(want))), 1e-300))


def assert_close(got, want, tol, what=""):
    assert np.shape(got) == np.shape(want), (what, np.shape(got), np.shape(want))
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.0e}"


# ================================================================ the twins (float64, from the document)


def sig(z: float) -> float:
    """Logistic sigmoid of a float, without overflow for either sign."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def twin_rms(x, g, eps):
    """Section 2.1: x / sqrt(mean(x^2) + eps) * g (float32/64: the bf16 casts are the identity)."""
    x = [float(v) for v in x]
    r = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
    return np.array([v * r * float(gi) for v, gi in zip(x, g, strict=True)])


def twin_situ(gate_up, beta1, beta2):
    """Section 2.2: [gate | up] -> beta1 tanh(g / beta1) sigmoid(g) * beta2 tanh(u / beta2), element by element
    (the sigmoid reads the UNCAPPED gate; beta2 None leaves up uncapped)."""
    gu = [float(v) for v in gate_up]
    n = len(gu) // 2
    out = []
    for g, u in zip(gu[:n], gu[n:], strict=True):
        a = beta1 * math.tanh(g / beta1) * sig(g)
        out.append(a * (u if beta2 is None else beta2 * math.tanh(u / beta2)))
    return np.array(out)


def twin_mlp(x, gate, up, down, beta1, beta2):
    """Section 2.2: down(SiTU(cat(gate x, up x)))."""
    return np.asarray(down, np.float64) @ twin_situ(np.concatenate([gate @ x, up @ x]), beta1, beta2)


def twin_attn_res(prefix, blocks, norm_w, proj_w, eps):
    """Section 6.1: candidates [blocks..., prefix]; keys RMS-normalised without gain, scored against
    norm.weight * proj.weight[0]; softmax; the mix of the RAW candidates. Returns (mix, p)."""
    V = [np.asarray(b, np.float64) for b in blocks] + [np.asarray(prefix, np.float64)]
    w = np.asarray(norm_w, np.float64) * np.asarray(proj_w, np.float64).reshape(-1)
    scores = []
    for v in V:
        inv = 1.0 / math.sqrt(sum(float(t) * float(t) for t in v) / len(v) + eps)
        scores.append(sum(float(t) * inv * float(wt) for t, wt in zip(v, w, strict=True)))
    top = max(scores)
    e = [math.exp(s - top) for s in scores]
    p = [x / sum(e) for x in e]
    mix = np.zeros(len(V[0]))
    for pi, v in zip(p, V, strict=True):
        mix += pi * v
    return mix, np.array(p)


def twin_delta_rule(q, k, v, log_alpha, beta, S0):
    """Section 3.3 steps 1-4 on already normalised q (scaled) and k, per token, head and key row:
    decay, read u = S^T k, write S += k (beta (v - u))^T, read out o = S^T q. Returns (o, S, ||S_h||_F per token)."""
    T, H, K = k.shape
    V = v.shape[-1]
    S = np.array(S0, np.float64)
    o, norms = np.zeros((T, H, V)), np.zeros((T, H))
    for t in range(T):
        for h in range(H):
            for j in range(K):
                a = math.exp(float(log_alpha[t, h, j]))  # exp(-inf) = 0: a decay of 0
                for c in range(V):
                    S[h, j, c] *= a
            u = [sum(S[h, j, c] * k[t, h, j] for j in range(K)) for c in range(V)]
            for j in range(K):
                for c in range(V):
                    S[h, j, c] += k[t, h, j] * beta[t, h] * (v[t, h, c] - u[c])
            for c in range(V):
                o[t, h, c] = sum(S[h, j, c] * q[t, h, j] for j in range(K))
            norms[t, h] = math.sqrt(float(np.sum(S[h] * S[h])))
    return o, S, norms


class TwinKda:
    """Section 3: one KDA layer, one token at a time, from the released operands (names as in section 8.1)."""

    def __init__(self, r, H, K, lower_bound, eps):
        self.r, self.H, self.K, self.lb, self.eps = r, H, K, lower_bound, eps
        P, W = H * K, r["q_conv1d"].shape[-1]
        self.windows = {s: np.zeros((P, W)) for s in "qkv"}  # oldest first
        self.S = np.zeros((H, K, K))  # S_h[k, v]

    def step(self, x):
        r, H, K, P = self.r, self.H, self.K, self.H * self.K
        x = np.asarray(x, np.float64)
        streams = {}
        for s in "qkv":  # 3.2: Linear -> shift the window, write the new value last -> conv -> SiLU
            win = self.windows[s]
            win[:, :-1] = win[:, 1:].copy()
            win[:, -1] = r[f"{s}_proj"] @ x
            taps = r[f"{s}_conv1d"][:, 0, :]
            pre = [sum(taps[c, w] * win[c, w] for w in range(win.shape[1])) for c in range(P)]
            streams[s] = np.array([p * sig(p) for p in pre])
        graw = r["f_b_proj"] @ (r["f_a_proj"] @ x)
        b = r["b_proj"] @ x
        gate = r["g_proj"] @ x
        heads = []
        for h in range(H):
            sl = slice(h * K, (h + 1) * K)
            q, k, v = streams["q"][sl], streams["k"][sl], streams["v"][sl]
            q = q / math.sqrt(float(q @ q) + 1e-6) * K**-0.5  # eps inside the sqrt of the SUM; then the scale
            k = k / math.sqrt(float(k @ k) + 1e-6)
            A = math.exp(float(r["A_log"][h]))  # per HEAD: the first H of the head_dim-wide tensor
            g = [self.lb * sig(A * (graw[h * K + j] + r["dt_bias"][h * K + j])) for j in range(K)]
            o, self.S[h : h + 1], _ = twin_delta_rule(q[None, None], k[None, None], v[None, None], np.array(g)[None, None],
                                                      np.array([[sig(float(b[h]))]]), self.S[h : h + 1])
            o = o[0, 0]
            # 3.4: per head o / sqrt(mean(o^2) + eps) * o_norm * sigmoid(gate): norm first, the gate not normalised
            o = twin_rms(o, r["o_norm"], self.eps) * np.array([sig(float(z)) for z in gate[sl]])
            heads.append(o)
        return r["o_proj"] @ np.concatenate(heads)


class TwinMla:
    """Section 4: one gated NoPE MLA layer with its own K/V cache (per head, decompressed)."""

    def __init__(self, r, nh, dn, dr, dv, gated=True):
        self.r, self.nh, self.dn, self.dr, self.dv, self.gated = r, nh, dn, dr, dv, gated
        self.keys, self.values = [], []  # per position: [nh, dn + dr], [nh, dv]

    def step(self, x):
        r, nh, dn, dr, dv = self.r, self.nh, self.dn, self.dr, self.dv
        x = np.asarray(x, np.float64)
        q = (r["q_b_proj"] @ twin_rms(r["q_a_proj"] @ x, r["q_a_layernorm"], 1e-6)).reshape(nh, dn + dr)
        ckv = r["kv_a_proj_with_mqa"] @ x
        kl = len(r["kv_a_layernorm"])
        kv = (r["kv_b_proj"] @ twin_rms(ckv[:kl], r["kv_a_layernorm"], 1e-6)).reshape(nh, dn + dv)
        k_pe = ckv[kl:]  # not normalised, shared by every head
        self.keys.append(np.stack([np.concatenate([kv[h, :dn], k_pe]) for h in range(nh)]))
        self.values.append(kv[:, dn:].copy())
        scale = (dn + dr) ** -0.5  # over the FULL q/k width
        o = []
        for h in range(nh):
            s = [float(q[h] @ key[h]) * scale for key in self.keys]
            top = max(s)
            e = [math.exp(v - top) for v in s]
            o.append(sum(ei / sum(e) * val[h] for ei, val in zip(e, self.values, strict=True)))
        o = np.concatenate(o)
        if self.gated:
            o = o * np.array([sig(float(z)) for z in r["g_proj"] @ x])
        return r["o_proj"] @ o


def twin_moe(x, r, top_k, renormalize, scaling, use_norm, eps, beta1, beta2):
    """Sections 5.2 and 5.3: sigmoid router (bias for the selection only), renormalised weights, experts in the latent
    space, ONE RMSNorm on the weighted sum, shared experts on the full-width x. Returns (out, {expert: weight})."""
    x = np.asarray(x, np.float64)
    s = [sig(float(z)) for z in r["gate"] @ x]
    choice = [si + float(bi) for si, bi in zip(s, r["bias"], strict=True)]
    ids = sorted(range(len(s)), key=lambda e: (-choice[e], e))[:top_k]
    w = [s[e] for e in ids]
    if renormalize:
        total = sum(w)
        w = [wi / (total + 1e-20) for wi in w]
    w = [wi * scaling for wi in w]
    z = r["down"] @ x
    u = np.zeros(len(z))
    for e, we in zip(ids, w, strict=True):
        u += we * (r["w2"][e] @ twin_situ(np.concatenate([r["w1"][e] @ z, r["w3"][e] @ z]), beta1, beta2))
    if use_norm:
        u = twin_rms(u, r["norm"], eps)
    out = r["up"] @ u + twin_mlp(x, r["shared_gate"], r["shared_up"], r["shared_down"], beta1, beta2)
    return out, dict(zip(ids, w, strict=True))


def twin_mxfp4(packed, scale):
    """Section 8.3, element by element: W[r, c] = E2M1(code) 2^(scale[r, c // 32] - 127), code the LOW nibble of
    byte c // 2 for an even c, the high one for an odd c."""
    packed, scale = np.asarray(packed), np.asarray(scale)
    R, C = packed.shape[0], 2 * packed.shape[1]
    W = np.empty((R, C))
    for r in range(R):
        for c in range(C):
            byte = int(packed[r, c // 2])
            code = byte & 0x0F if c % 2 == 0 else byte >> 4
            W[r, c] = (-1.0 if code & 8 else 1.0) * E2M1_MAGNITUDES[code & 7] * 2.0 ** (int(scale[r, c // 32]) - 127)
    return W


def twin_mxfp4_fast(packed, scale):
    """The same rule on whole arrays (for the decoder's experts): [..., R, C/2], [..., R, C/32] -> [..., R, C]."""
    packed, scale = np.asarray(packed), np.asarray(scale)
    mags = np.array(E2M1_MAGNITUDES)
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.int64)
    codes[..., 0::2], codes[..., 1::2] = packed & 0x0F, packed >> 4
    vals = np.where(codes & 8, -1.0, 1.0) * mags[codes & 7]
    return vals * np.repeat(2.0 ** (scale.astype(np.int64) - 127), 32, axis=-1)


def twin_ggml_mxfp4(blocks):
    """Section 9: per 32 values 17 bytes, the E8M0 byte then 16 bytes, byte j holding value j (low nibble) and value
    j + 16 (high nibble). blocks [G, 17] -> [32 G]."""
    out = []
    for blk in np.asarray(blocks):
        f = 2.0 ** (int(blk[0]) - 127)
        for j in range(32):
            byte = int(blk[1 + j % 16])
            code = byte & 0x0F if j < 16 else byte >> 4
            out.append((-1.0 if code & 8 else 1.0) * E2M1_MAGNITUDES[code & 7] * f)
    return np.array(out)


# ================================================================ operands


def kda_operands(rng, d=24, H=3, K=8, W=4, A_log=(-1.0, 1.5), dt=(-1.0, 1.0)):
    """Released KDA tensors (section 8.1), A_log head_dim wide with zeros after the first H (the release's padding)."""
    P = H * K
    n = lambda *s, scale=1.0: rng.standard_normal(s) * scale  # noqa: E731
    A = np.zeros(K)
    A[:H] = rng.uniform(*A_log, H)
    return {"q_proj": n(P, d, scale=0.4), "k_proj": n(P, d, scale=0.4), "v_proj": n(P, d, scale=0.4),
            "q_conv1d": n(P, 1, W, scale=0.6), "k_conv1d": n(P, 1, W, scale=0.6), "v_conv1d": n(P, 1, W, scale=0.6),
            "f_a_proj": n(K, d, scale=0.3), "f_b_proj": n(P, K, scale=0.3), "A_log": A, "dt_bias": rng.uniform(*dt, P),
            "b_proj": n(H, d, scale=0.4), "g_proj": n(P, d, scale=0.4), "o_norm": rng.uniform(0.5, 1.5, K),
            "o_proj": n(d, P, scale=0.3)}


def kda_record(r, H, K, dtype, lower_bound=-5.0, eps=1e-5):
    """The package's KdaWeights, fused by the layout its docstring gives."""
    c = lambda a: np.ascontiguousarray(a, dtype=dtype)  # noqa: E731
    in_proj = np.concatenate([r[n] for n in ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_a_proj")])
    conv = np.stack([r[f"{s}_conv1d"][:, 0, :] for s in "qkv"])
    return KdaWeights(in_proj=c(in_proj), f_b_proj=c(r["f_b_proj"]), conv=c(conv),
                      A=c(np.exp(r["A_log"][:H]).reshape(H, 1)), dt_bias=c(r["dt_bias"].reshape(H, K)),
                      o_norm=c(r["o_norm"]), o_proj=c(r["o_proj"]), num_heads=H, head_dim=K, lower_bound=lower_bound,
                      eps=eps)


def mla_operands(rng, d=24, nh=3, ql=16, kl=12, dn=8, dr=4, dv=6):
    n = lambda *s, scale=1.0: rng.standard_normal(s) * scale  # noqa: E731
    return {"q_a_proj": n(ql, d, scale=0.5), "q_a_layernorm": rng.uniform(0.5, 1.5, ql),
            "q_b_proj": n(nh * (dn + dr), ql, scale=0.5), "kv_a_proj_with_mqa": n(kl + dr, d, scale=0.5),
            "kv_a_layernorm": rng.uniform(0.5, 1.5, kl), "kv_b_proj": n(nh * (dn + dv), kl, scale=0.5),
            "g_proj": n(nh * dv, d, scale=0.5), "o_proj": n(d, nh * dv, scale=0.5)}


def mla_record(r, nh, dn, dr, dv, dtype, gated=True):
    c = lambda a: np.ascontiguousarray(a, dtype=dtype)  # noqa: E731
    rows = [r["q_a_proj"], r["kv_a_proj_with_mqa"]] + ([r["g_proj"]] if gated else [])
    return MlaWeights(in_proj=c(np.concatenate(rows)), q_a_layernorm=c(r["q_a_layernorm"]), q_b_proj=c(r["q_b_proj"]),
                      kv_a_layernorm=c(r["kv_a_layernorm"]), kv_b_proj=c(r["kv_b_proj"]), o_proj=c(r["o_proj"]),
                      num_heads=nh, q_lora_rank=len(r["q_a_layernorm"]), kv_lora_rank=len(r["kv_a_layernorm"]),
                      qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=dv, use_output_gate=gated)


def moe_operands(rng, d=32, E=12, l=64, I=32, Ish=64, packed=False):
    """Released MoE tensors; with packed=True the experts are MXFP4 bytes (and their twin-decoded values)."""
    n = lambda *s, scale=1.0: rng.standard_normal(s) * scale  # noqa: E731
    r = {"gate": n(E, d, scale=0.4), "bias": n(E, scale=0.2), "down": n(l, d, scale=0.4),
         "norm": rng.uniform(0.5, 1.5, l), "up": n(d, l, scale=0.3), "shared_gate": n(Ish, d, scale=0.3),
         "shared_up": n(Ish, d, scale=0.3), "shared_down": n(d, Ish, scale=0.3)}
    if packed:
        for name, (R, C) in (("w1", (I, l)), ("w3", (I, l)), ("w2", (l, I))):
            r[name + "_packed"] = rng.integers(0, 256, (E, R, C // 2), dtype=np.uint8)
            r[name + "_scale"] = rng.integers(120, 127, (E, R, C // 32), dtype=np.uint8)
            r[name] = np.stack([twin_mxfp4_fast(p, s) for p, s in zip(r[name + "_packed"], r[name + "_scale"], strict=True)])
    else:
        r["w1"], r["w3"], r["w2"] = n(E, I, l, scale=0.3), n(E, I, l, scale=0.3), n(E, l, I, scale=0.3)
    return r


def moe_record(r, dtype, bank=None, top_k=4, renormalize=True, scaling=1.0, use_norm=True, eps=1e-5, beta2=25.0):
    c = lambda a: np.ascontiguousarray(a, dtype=dtype)  # noqa: E731
    if bank is None:
        bank = DenseExperts(c(np.concatenate([r["w1"], r["w3"]], axis=1)), c(r["w2"]))
    E, l = r["gate"].shape[0], r["down"].shape[0]
    return LatentMoeWeights(in_proj=c(np.concatenate([r["gate"], r["down"], r["shared_gate"], r["shared_up"]])),
                            e_score_correction_bias=c(r["bias"]), experts=bank, routed_expert_norm=c(r["norm"]),
                            routed_expert_up_proj=c(r["up"]), shared_down_proj=c(r["shared_down"]), num_experts=E,
                            top_k=top_k, latent_size=l, renormalize=renormalize, routed_scaling_factor=scaling,
                            use_latent_norm=use_norm, eps=eps, situ_beta=4.0, situ_linear_beta=beta2)


class Grab:
    """Token-form hooks that keep a copy of what they see and change nothing."""

    def __init__(self):
        self.seen = {}

    def fire(self, name, value):
        self.seen[name] = np.array(value, copy=True)
        return value


# ================================================================ norms and activations


def test_rms_norm_both_routes_against_the_twin():
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((3, 50)) * [[1e-3], [1.0], [40.0]], rng.uniform(0.5, 2.0, 50)
    want = np.stack([twin_rms(row, g, 1e-5) for row in x])
    assert_close(rms_norm(x, g, 1e-5), want, TOL64, "rows float64")
    for i in range(3):
        assert_close(rms_norm(x[i], g, 1e-5), want[i], TOL64, "vector float64")
        assert_close(rms_norm(x[i].astype(np.float32), g.astype(np.float32), 1e-5), want[i], TOL32, "vector float32")
    assert_close(rms_norm(x.astype(np.float32), g.astype(np.float32), 1e-5), want, TOL32, "rows float32")


@pytest.mark.parametrize("beta2", [25.0, None], ids=["capped-up", "uncapped-up"])
def test_situ_every_route_against_the_twin(beta2):
    """ops.situ_and_mul (float64 NumPy, with and without the folded 1/caps; float32 compiled) and
    sequence_ops.situ_and_mul_rows (the sequence path's rows, float32 compiled), gates and ups past both caps."""
    rng = np.random.default_rng(1)
    gu = rng.standard_normal((6, 2 * 20)) * np.array([[0.01], [1.0], [3.0], [8.0], [30.0], [80.0]])
    want = np.stack([twin_situ(row, 4.0, beta2) for row in gu])
    assert_close(situ_and_mul(gu, 4.0, beta2), want, TOL64, "float64")
    for i in range(len(gu)):
        assert_close(situ_and_mul(gu[i], 4.0, beta2), want[i], TOL64, "float64 vector")
    if beta2 is not None:
        inv = situ_inv_caps(np, 20, 4.0, beta2, np.float64)
        assert_close(situ_and_mul(gu, 4.0, beta2, inv), want, TOL64, "float64, folded caps")
    g32 = gu.astype(np.float32)
    want32 = np.stack([twin_situ(row, 4.0, beta2) for row in g32.astype(np.float64)])
    assert_close(situ_and_mul(g32, 4.0, beta2), want32, TOL32, "float32")
    rows = situ_and_mul_rows(g32, 4.0, beta2, lambda a: situ_and_mul(a, 4.0, beta2))
    assert_close(rows, want32, TOL32, "float32 rows")


@pytest.mark.parametrize("dtype,tol", [(np.float64, TOL64), (np.float32, TOL32)], ids=["float64", "float32"])
def test_dense_mlp_token_and_rows_against_the_twin(dtype, tol):
    """Section 5.1 / the shared experts: down(SiTU(cat(gate x, up x))), gate rows first in the fused gate_up."""
    rng = np.random.default_rng(2)
    d, I = 24, 40
    gate, up, down = rng.standard_normal((I, d)) * 0.6, rng.standard_normal((I, d)) * 0.6, rng.standard_normal((d, I)) * 0.4
    w = DenseMlpWeights(np.concatenate([gate, up]).astype(dtype), down.astype(dtype))
    xs = (rng.standard_normal((7, d)) * 2).astype(dtype)
    want = np.stack([twin_mlp(x.astype(np.float64), gate.astype(dtype), up.astype(dtype), down.astype(dtype), 4.0, 25.0)
                     for x in xs])
    assert_close(np.stack([dense_mlp(x, w, 4.0, 25.0) for x in xs]), want, tol, "token form")
    assert_close(dense_mlp_sequence(xs, w, 4.0, 25.0), want, tol, "rows")


# ================================================================ block attention residuals


@pytest.mark.parametrize("n_blocks", [0, 1, 6])
def test_attn_res_every_route_against_the_twin(n_blocks):
    """apply_attn_res (HF form) and the decoder's SourceBuffer: float64 with host scalars and device-style arrays,
    float32 on the compiled route; sources of very different sizes (their keys are normalised, their values not)."""
    rng = np.random.default_rng(3 + n_blocks)
    d = 40
    blocks = rng.standard_normal((n_blocks, d)) * rng.uniform(0.05, 20.0, (n_blocks, 1))
    prefix = rng.standard_normal(d) * 3
    norm_w, proj_w = rng.uniform(0.5, 2.0, d), rng.standard_normal((1, d))
    want, want_p = twin_attn_res(prefix, blocks, norm_w, proj_w, 1e-5)
    out, p = apply_attn_res(prefix, blocks, norm_w, proj_w, 1e-5)
    assert_close(p, want_p, TOL64, "weights")
    assert_close(out, want, TOL64, "mix")
    for dtype, tol, host in ((np.float64, TOL64, True), (np.float64, TOL64, False), (np.float32, TOL32, None)):
        src = SourceBuffer(np, n_blocks + 2, d, dtype, 1e-5, host_scalars=host)
        for b in blocks.astype(dtype):
            src.set_current(b)
            src.seal()
        src.set_current(prefix.astype(dtype))
        q = src.weights((norm_w * proj_w[0]).astype(dtype))
        w64, p64 = twin_attn_res(prefix.astype(dtype), blocks.astype(dtype), norm_w.astype(dtype),
                                 proj_w.astype(dtype), 1e-5)
        assert_close(q, p64, tol, f"SourceBuffer weights {np.dtype(dtype).name} host={host}")
        assert_close(src.mix(q), w64, tol, f"SourceBuffer mix {np.dtype(dtype).name} host={host}")


# ================================================================ KDA


def _kda_inputs(rng, T, d, scale=1.5):
    return rng.standard_normal((T, d)) * scale


@pytest.mark.parametrize("dtype,tol", [(np.float64, TOL64), (np.float32, TOL32_KDA)], ids=["float64", "float32"])
def test_kda_step_against_the_twin(dtype, tol):
    """Section 3 token by token over 12 tokens (the conv window fills and slides): outputs, the recurrent state
    S_h[k, v] and the conv window after every token. float32 runs the compiled token steps."""
    rng = np.random.default_rng(4)
    H, K, d = 3, 8, 24
    r = kda_operands(rng, d=d, H=H, K=K)
    w = kda_record(r, H, K, dtype)
    state, twin = KdaState.zeros(w, np, dtype), TwinKda(r, H, K, -5.0, 1e-5)
    if dtype == np.float32:  # the twin reads the operands the package holds (rounded to float32)
        twin = TwinKda({k: v.astype(np.float32).astype(np.float64) for k, v in r.items()}, H, K, -5.0, 1e-5)
    for x in _kda_inputs(rng, 12, d):
        x = x.astype(dtype)
        assert_close(kda_step(x, w, state), twin.step(x), tol, "output")
        assert_close(state.recurrent, twin.S, tol, "recurrent state")
        assert_close(state.conv, np.stack([twin.windows[s] for s in "qkv"]), tol, "conv window")


@pytest.mark.parametrize("gates", ["random", "at-the-bound"])
@pytest.mark.parametrize("dtype,tol", [(np.float64, TOL64), (np.float32, TOL32_KDA)], ids=["float64", "float32"])
def test_kda_sequence_against_the_twin(gates, dtype, tol):
    """kda_sequence (chunked rule at chunks 1, 7, 64; the compiled recurrent rule in float32) over 90 tokens from a
    state 5 twin steps made, against the twin stepping the same tokens; "at-the-bound": exp(A_log) = e^9 and
    dt_bias = +10 put every decay at the lower bound (-5 per token: a 64-token chunk spans e^-320)."""
    rng = np.random.default_rng(5)
    H, K, d, T = 3, 8, 24, 90
    bound = gates == "at-the-bound"
    r = kda_operands(rng, d=d, H=H, K=K, A_log=(9.0, 9.0) if bound else (-1.0, 1.5), dt=(10.0, 10.0) if bound else (-1.0, 1.0))
    r = {k: v.astype(dtype).astype(np.float64) for k, v in r.items()}
    w = kda_record(r, H, K, dtype)
    xs = _kda_inputs(rng, 5 + T, d).astype(dtype)
    twin = TwinKda(r, H, K, -5.0, 1e-5)
    start = KdaState.zeros(w, np, dtype)
    for x in xs[:5]:
        twin.step(x)
        kda_step(x, w, start)
    want = np.stack([twin.step(x) for x in xs[5:]])
    if bound:
        A = np.exp(r["A_log"][:H])[:, None]
        z = A * ((r["f_b_proj"] @ (r["f_a_proj"] @ xs[5:].T.astype(np.float64))).T.reshape(T, H, K) + r["dt_bias"].reshape(H, K))
        assert z.min() > 200  # sigmoid(z) = 1: g = -5 exactly, every channel, every token
    rules = [("chunked", c) for c in (1, 7, 64)]
    if dtype == np.float32 and kda_recurrence.AVAILABLE:
        rules.append(("recurrent", 64))
    for rule, chunk in rules:
        state = KdaState(start.conv.copy(), start.recurrent.copy())
        out, norms = kda_sequence(xs[5:], w, state, chunk=chunk, rule=rule, state_norms=True)
        assert np.isfinite(out).all() and np.isfinite(norms["kda.state"]).all()
        assert_close(out, want, tol, f"{rule} chunk {chunk}: outputs")
        assert_close(state.recurrent, twin.S, tol, f"{rule} chunk {chunk}: state")
        assert_close(state.conv, np.stack([twin.windows[s] for s in "qkv"]), tol, f"{rule} chunk {chunk}: window")
        assert_close(norms["kda.state"][-1], np.linalg.norm(twin.S.reshape(H, -1), axis=-1), tol, "last state norm")


def _delta_operands(rng, T, H, K, V, log_alpha):
    k = rng.standard_normal((T, H, K))
    k /= np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q = rng.standard_normal((T, H, K))
    q /= np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * math.sqrt(K)
    return q, k, rng.standard_normal((T, H, V)) * 2, log_alpha, rng.uniform(0, 1, (T, H)), rng.standard_normal((H, K, V))


@pytest.mark.parametrize("case", ["bound", "bound-and-near-1", "random", "decay-0"])
def test_chunked_delta_rule_against_the_twin(case):
    """chunked_delta_rule (and the compiled recurrence) over 150 tokens at chunks 1, 7, 16, 64 and 150: outputs, the
    final state and ||S_h||_F after every token. "bound": every log decay -5 (K3's lower bound per token; 64 tokens
    span e^-320, 150 e^-750: past float32 and float64 as one factor); "bound-and-near-1": each channel -5 or -1e-3
    (decay differences of both sizes inside one chunk); "decay-0": some decays exactly 0 (log -inf)."""
    rng = np.random.default_rng(6)
    T, H, K, V = 150, 2, 8, 6
    la = {"bound": np.full((T, H, K), -5.0),
          "bound-and-near-1": np.where(rng.random((T, H, K)) < 0.5, -5.0, -1e-3),
          "random": rng.uniform(-5.0, 0.0, (T, H, K)),
          "decay-0": np.where(rng.random((T, H, K)) < 0.05, -np.inf, -0.05)}[case]
    q, k, v, la, beta, S0 = _delta_operands(rng, T, H, K, V, la)
    want_o, want_S, want_n = twin_delta_rule(q, k, v, la, beta, S0)
    for dtype, tol in ((np.float64, TOL64), (np.float32, TOL32)):
        for chunk in (1, 7, 16, 64, T):
            S = S0.astype(dtype)
            with np.errstate(divide="ignore"):
                o, n = chunked_delta_rule(*(a.astype(dtype) for a in (q, k, v, la, beta)), S, chunk=chunk, state_norms=True)
            tag = f"{np.dtype(dtype).name} chunk {chunk}"
            assert_close(o, want_o, tol, tag + " outputs")
            assert_close(S, want_S, tol, tag + " state")
            assert_close(n, want_n, tol, tag + " norms")
    if kda_recurrence.AVAILABLE:
        for isa in kda_recurrence.isas():
            S = S0.astype(np.float32)
            o, n = kda_recurrence.recurrent_delta_rule(q, k, v, la, beta, S, state_norms=True, isa=isa)
            assert_close(o, want_o, TOL32, f"recurrent {isa} outputs")
            assert_close(S, want_S, TOL32, f"recurrent {isa} state")
            assert_close(n, want_n, TOL32, f"recurrent {isa} norms")


# ================================================================ MLA


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("dtype,tol", [(np.float64, TOL64), (np.float32, TOL32)], ids=["float64", "float32"])
def test_mla_step_and_sequence_against_the_twin(dtype, tol, gated):
    """Section 4 over 40 tokens (past the cache's first doubling, 16): mla_step token by token, and mla_sequence in
    chunks of 5, 1, 17 and 17 (the compiled fused attention in float32), against the twin's cache and softmax."""
    rng = np.random.default_rng(7)
    nh, dn, dr, dv, d, T = 3, 8, 4, 6, 24, 40
    r = {k: v.astype(dtype).astype(np.float64) for k, v in mla_operands(rng, d=d, nh=nh, dn=dn, dr=dr, dv=dv).items()}
    w = mla_record(r, nh, dn, dr, dv, dtype, gated)
    xs = (rng.standard_normal((T, d)) * 1.5).astype(dtype)
    twin = TwinMla(r, nh, dn, dr, dv, gated)
    want = np.stack([twin.step(x) for x in xs])
    state = MlaState.empty(w, np, dtype)
    assert_close(np.stack([mla_step(x, w, state) for x in xs]), want, tol, "mla_step")
    assert_close(state.keys[:, :T].swapaxes(0, 1), np.stack(twin.keys), tol, "cached keys")
    assert_close(state.values[:, :T].swapaxes(0, 1), np.stack(twin.values), tol, "cached values")
    state, got, a = MlaState.empty(w, np, dtype), [], 0
    for c in (5, 1, 17, 17):
        got.append(mla_sequence(xs[a : a + c], w, state))
        a += c
    assert_close(np.concatenate(got), want, tol, "mla_sequence")


# ================================================================ latent MoE


@pytest.mark.parametrize("use_norm,scaling", [(True, 1.0), (False, 2.5)], ids=["latent-norm", "no-norm-scaled"])
@pytest.mark.parametrize("dtype,tol", [(np.float64, TOL64), (np.float32, TOL32)], ids=["float64", "float32"])
def test_latent_moe_token_and_rows_against_the_twin(dtype, tol, use_norm, scaling):
    """Sections 5.2-5.3 with dense experts: the token form's output and its recorded router ids and weights (the
    weights are checked directly: with the latent norm on, a factor common to them cancels in the output), and
    latent_moe_sequence's rows (float32: the compiled grouped experts)."""
    rng = np.random.default_rng(8)
    r = {k: v.astype(dtype).astype(np.float64) for k, v in moe_operands(rng).items()}
    w = moe_record(r, dtype, use_norm=use_norm, scaling=scaling)
    xs = (rng.standard_normal((9, 32)) * 2).astype(dtype)
    names = {k: k for k in FFN_SITES["moe"]}
    wants = []
    for x in xs:
        want, picked = twin_moe(x, r, 4, True, scaling, use_norm, 1e-5, 4.0, 25.0)
        hooks = Grab()
        assert_close(latent_moe(x, w, hooks, names), want, tol, "latent_moe")
        ids, weights = hooks.seen["moe.router.topk_ids"], hooks.seen["moe.router.topk_weights"]
        assert sorted(ids.tolist()) == sorted(picked)
        assert_close(weights, [picked[e] for e in ids.tolist()], tol, "routing weights")
        wants.append(want)
    assert_close(latent_moe_sequence(xs, w), np.stack(wants), tol, "latent_moe_sequence")


@pytest.mark.parametrize("fused", [False, True], ids=["dequantising", "fused-kernel"])
def test_latent_moe_on_packed_experts_against_the_twin(fused):
    """The routed experts as MXFP4 bytes (PackedExperts): the twin decodes them itself (section 8.3). The dequantising
    route in float64; the fused kernel (float32, straight from the bytes) on both the token form and the rows."""
    if fused and not mxfp4_matvec.AVAILABLE:
        pytest.skip("the compiled MXFP4 kernel was not built")
    rng = np.random.default_rng(9)
    r = moe_operands(rng, packed=True)
    dtype, tol = (np.float32, TOL32) if fused else (np.float64, TOL64)
    r = {k: v if v.dtype == np.uint8 else v.astype(dtype).astype(np.float64) for k, v in r.items()}
    bank = PackedExperts(np.concatenate([r["w1_packed"], r["w3_packed"]], axis=1),
                         np.concatenate([r["w1_scale"], r["w3_scale"]], axis=1), r["w2_packed"], r["w2_scale"],
                         dtype=dtype, capacity=0 if fused else 3, fused=fused)
    w = moe_record(r, dtype, bank=bank)
    xs = (rng.standard_normal((8, 32)) * 2).astype(dtype)
    want = np.stack([twin_moe(x, r, 4, True, 1.0, True, 1e-5, 4.0, 25.0)[0] for x in xs])
    assert_close(np.stack([latent_moe(x, w) for x in xs]), want, tol, "token form")
    assert_close(latent_moe_sequence(xs, w), want, tol, "rows")


# ================================================================ weight formats and kernels


def test_mxfp4_dequantize_against_the_twin():
    """Every byte value in both nibbles, scale bytes from 1 (2^-126: x 0.5 is a float32 subnormal) to 251 (2^124: x 6
    stays finite in float32): exact in float32 and float64, the sign of -0.0 (code 8) included."""
    rng = np.random.default_rng(10)
    packed = rng.integers(0, 256, (6, 48), dtype=np.uint8)
    packed.reshape(-1)[:256] = np.arange(256)
    scale = rng.integers(100, 150, (6, 3), dtype=np.uint8)
    scale[0, 0], scale[1, 1], scale[2, 2] = 1, 251, 127
    want = twin_mxfp4(packed, scale)
    for dtype in (np.float32, np.float64):
        got = mxfp4.dequantize(packed, scale, dtype=dtype)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.astype(np.float64), want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_ggml_mxfp4_blocks_against_the_twin():
    """ggml's 17-byte blocks (section 9), read by ggml_quants.dequantize_mxfp4 and ggml_quants.dequantize: exact."""
    rng = np.random.default_rng(11)
    blocks = rng.integers(0, 256, (4, 3, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(110, 140, (4, 3))
    blocks[0, 0, 1:] = np.arange(16) * 17  # codes 0..15 in both nibbles
    want = np.stack([twin_ggml_mxfp4(row) for row in blocks])
    for dtype in (np.float32, np.float64):
        np.testing.assert_array_equal(ggml_quants.dequantize_mxfp4(blocks, dtype=dtype).astype(np.float64), want)
        got = ggml_quants.dequantize(blocks.reshape(-1), "MXFP4", (4, 96), dtype)
        np.testing.assert_array_equal(got.astype(np.float64), want)


@pytest.mark.skipif(not mxfp4_matvec.AVAILABLE, reason="the compiled MXFP4 kernel was not built")
def test_mxfp4_matvec_entries_against_the_twin():
    """expert_matvec, ggml_expert_matvec (blocks built here by section 9's layout), parts_matvec and grouped_matmat on
    every kernel the CPU has, against the twin's decoded matrices times x in float64: within float32 summation
    rounding, |error| <= 1e-6 sum |W| |x| (C = 224: 7 groups of 32)."""
    rng = np.random.default_rng(12)
    E, R, C = 4, 19, 224
    packed = rng.integers(0, 256, (E, R, C // 2), dtype=np.uint8)
    scale = rng.integers(115, 135, (E, R, C // 32), dtype=np.uint8)
    W = np.stack([twin_mxfp4(packed[e], scale[e]) for e in range(E)])
    codes = np.empty((E, R, C), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = packed & 0x0F, packed >> 4
    codes = codes.reshape(E, R, C // 32, 32)
    blocks = np.concatenate([scale[..., None], codes[..., :16] | (codes[..., 16:] << 4)], axis=-1).astype(np.uint8)
    ids = [3, 0, 3, 2]
    x = rng.standard_normal((4, C)).astype(np.float32)
    x64 = x.astype(np.float64)
    want = np.stack([W[e] @ xi for e, xi in zip(ids, x64, strict=True)])
    mag = np.stack([np.abs(W[e]) @ np.abs(xi) for e, xi in zip(ids, x64, strict=True)])

    def check(got, what):
        assert got.shape == want.shape and np.all(np.abs(got - want) <= 1e-6 * mag + 1e-30), what

    for isa in mxfp4_matvec.isas():
        check(mxfp4_matvec.expert_matvec(packed, scale, ids, x, isa=isa, threads=1), f"expert_matvec {isa}")
        check(mxfp4_matvec.ggml_expert_matvec(blocks, ids, x, isa=isa, threads=1), f"ggml_expert_matvec {isa}")
        parts_p = [(packed[e, :7], packed[e, 7:]) for e in ids]
        parts_s = [(scale[e, :7], scale[e, 7:]) for e in ids]
        check(mxfp4_matvec.parts_matvec(parts_p, parts_s, (7, R - 7), x, isa=isa, threads=1), f"parts_matvec {isa}")
        grouped = mxfp4_matvec.grouped_matmat(packed, scale, ids, np.arange(5), x, isa=isa, threads=1)
        check(grouped, f"grouped_matmat {isa}")


def test_bf16_matrix_both_routes_against_the_bits():
    """Bf16Matrix (weight_dtype="bfloat16"): bf16 bits widened here (the high half of a float32) then a float64
    product; the kernel route (float32 vectors and rows) and the widening route (float64) within their rounding."""
    rng = np.random.default_rng(13)
    R, C = 23, 77
    bits = (rng.standard_normal((R, C)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    W = np.array([[float(np.array([int(b) << 16], np.uint32).view(np.float32)[0]) for b in row] for row in bits])
    x = rng.standard_normal((3, C))
    for dtype, tol in ((np.float32, TOL32), (np.float64, TOL64)):
        M = Bf16Matrix(bits, WideningScratch(np), dtype=dtype)
        assert_close(M @ x[0].astype(dtype), W @ x[0].astype(dtype).astype(np.float64), tol, "vector")
        assert_close(M.matmul_rows(x.astype(dtype)), x.astype(dtype).astype(np.float64) @ W.T, tol, "rows")


# ================================================================ the whole decoder, from the checkpoint's bytes




class TwinDecoder:
    """Sections 1.1, 6.2 and 7 over the module twins above, every operand read from the safetensors files by its
    released name (experts decoded from their MXFP4 bytes by the twin rule)."""

    def __init__(self, path: Path):
        raw = json.loads((path / "config.json").read_text())
        self.c = c = raw.get("text_config", raw)
        t = {}
        for f in sorted(path.glob("*.safetensors")):
            t.update(read_safetensors(f))
        self.t = {k.removeprefix("language_model."): v for k, v in t.items()}
        la = c["linear_attn_config"]
        self.layers = []
        for i in range(c["num_hidden_layers"]):
            L = f"model.layers.{i}."
            g = lambda n, L=L: np.asarray(self.t[L + n], np.float64)  # noqa: E731
            layer = {"in_ln": g("input_layernorm.weight"), "post_ln": g("post_attention_layernorm.weight"),
                     "attn_res": (g("self_attention_res_norm.weight"), g("self_attention_res_proj.weight")),
                     "mlp_res": (g("mlp_res_norm.weight"), g("mlp_res_proj.weight"))}
            A = L + "self_attn."
            if i + 1 in la["kda_layers"]:  # 1-based list
                names = ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj", "f_b_proj",
                         "b_proj", "g_proj", "o_norm", "o_proj")
                r = {n: np.asarray(self.t[A + n + ".weight"], np.float64) for n in names}
                r["A_log"], r["dt_bias"] = g("self_attn.A_log"), g("self_attn.dt_bias")
                layer["attn"] = TwinKda(r, la["num_heads"], la["head_dim"], la["gate_lower_bound"], c["rms_norm_eps"])
            else:
                names = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                         "g_proj", "o_proj")
                r = {n: np.asarray(self.t[A + n + ".weight"], np.float64) for n in names}
                layer["attn"] = TwinMla(r, c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                                        c["v_head_dim"], c["mla_use_output_gate"])
            if i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0:
                M = L + "block_sparse_moe."
                m = lambda n, M=M: np.asarray(self.t[M + n], np.float64)  # noqa: E731
                r = {"gate": m("gate.weight"), "bias": m("gate.e_score_correction_bias"),
                     "down": m("routed_expert_down_proj.weight"), "norm": m("routed_expert_norm.weight"),
                     "up": m("routed_expert_up_proj.weight"), "shared_gate": m("shared_experts.gate_proj.weight"),
                     "shared_up": m("shared_experts.up_proj.weight"), "shared_down": m("shared_experts.down_proj.weight")}
                for n in ("w1", "w2", "w3"):
                    r[n] = np.stack([twin_mxfp4_fast(self.t[f"{M}experts.{e}.{n}.weight_packed"],
                                                     self.t[f"{M}experts.{e}.{n}.weight_scale"])
                                     for e in range(c["num_experts"])])
                layer["moe"] = r
            else:
                layer["mlp"] = (g("mlp.gate_proj.weight"), g("mlp.up_proj.weight"), g("mlp.down_proj.weight"))
            self.layers.append(layer)

    def step(self, token: int):
        c, eps, b1, b2 = self.c, self.c["rms_norm_eps"], self.c["activation_situ_beta"], self.c["activation_situ_linear_beta"]
        get = lambda n: np.asarray(self.t[n], np.float64)  # noqa: E731
        h = get("model.embed_tokens.weight")[token]
        stack = []  # per token: empty at every forward call
        for i, layer in enumerate(self.layers):
            prefix = h
            a_in = twin_attn_res(prefix, stack, *layer["attn_res"], eps)[0] if stack else h
            if i % c["attn_res_block_size"] == 0:
                stack.append(prefix)  # the RAW input, after this layer's attention-site mix
                prefix = None
            a = layer["attn"].step(twin_rms(a_in, layer["in_ln"], eps))
            prefix = a if prefix is None else prefix + a
            f_in = twin_attn_res(prefix, stack, *layer["mlp_res"], eps)[0]
            y = twin_rms(f_in, layer["post_ln"], eps)
            if "moe" in layer:
                k = c["num_experts_per_token"]
                f = twin_moe(y, layer["moe"], k, c["moe_renormalize"] and k > 1, c["routed_scaling_factor"],
                             c["latent_moe_use_norm"], eps, b1, b2)[0]
            else:
                f = twin_mlp(y, *layer["mlp"], b1, b2)
            h = prefix + f
        out = twin_attn_res(h, stack, get("model.output_attn_res_norm.weight"), get("model.output_attn_res_proj.weight"),
                            eps)[0]
        return get("lm_head.weight") @ twin_rms(out, get("model.norm.weight"), eps)


@pytest.fixture(scope="module")
def twin_logits():
    tokens = np.random.default_rng(14).integers(0, 256, 9).tolist()
    twin = TwinDecoder(random_tiny_checkpoint())
    return tokens, np.stack([twin.step(t) for t in tokens])


@pytest.mark.parametrize("dtype,tol", [("float64", TOL64), ("float32", 1e-4)])
def test_decoder_token_and_sequence_against_the_twin(twin_logits, dtype, tol):
    """The random tiny model (16 layers: KDA + dense layer 0, KDA and MLA layers with latent MoE, block size 4, the
    final MLA pair), loaded by the package: kimi_forward_token step by step and kimi_forward_sequence at chunks 1, 4
    and 9 (all tokens), each against the twin decoder reading the checkpoint itself; so the sequence form equals
    stepping to the same tolerance."""
    tokens, want = twin_logits
    w = ke.from_pretrained(random_tiny_checkpoint(), device="cpu", dtype=dtype)
    state = ke.KimiDecodeState.new(w)
    assert_close(np.stack([ke.kimi_forward_token(w, state, t) for t in tokens]), want, tol, "kimi_forward_token")
    for chunk in (1, 4, len(tokens)):
        got = kimi_forward_sequence(w, ke.KimiDecodeState.new(w), tokens, chunk=chunk)
        assert_close(got, want, tol, f"kimi_forward_sequence chunk {chunk}")
