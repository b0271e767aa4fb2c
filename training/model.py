"""A second, independent implementation of the K3 text model, in PyTorch and in sequence (prefill) form.

Its math is written from the released model's description (Hugging Face `modeling_kimi_linear.py`),
not from `kimi_explore`'s decode code, so that agreement between the two is evidence that both are
K3: `python -m training.parity` compares them on an exported checkpoint and stores the trainer's
logits, which tests/test_trained_model.py checks the package against without torch. What it shares
with the package is data, not math: the config record (`KimiDecoderConfig`, the `config.json` keys)
and K3's layer pattern (`kimi_explore.weights.k3_depth.k3_layer_lists`).
Parameter names are the released tensor names (without `language_model.`), so export is a rename-free
walk over `state_dict()` (the routed experts are stacked here and split per expert at export).

Shapes: B batch, T time, d hidden, H KDA heads, K = V KDA head dim, P = H K, nh MLA heads,
E routed experts, l latent width, I expert width.

Per layer i (block attention residuals, as the release's decoder layer runs them):
    prefix = h; a_in = attn_res(prefix, stack) if stack else h
    if i % block_size == 0: push prefix; prefix = None
    a = Attn_i(input_layernorm(a_in)); prefix = a if prefix is None else prefix + a
    f = FFN_i(post_attention_layernorm(attn_res(prefix, stack))); h = prefix + f
    logits = lm_head(norm(attn_res(h, stack, output)))
Dropout (training only) acts on the sublayer outputs a and f, before they join the residual sums.

KDA is computed in chunks (`chunk_kda`) with the WY form of the gated delta rule; `naive_recurrent_kda`
is the per-step twin the tests compare it against.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kimi_explore.model.config import KimiDecoderConfig
from kimi_explore.weights.k3_depth import k3_layer_lists
from kimi_explore.weights.tiny_model import make_text_config

L2NORM_EPS = 1e-6  # KDA q/k l2norm: inside the sqrt of the SUM of squares
LATENT_NORM_EPS = 1e-6  # MLA q_a / kv_a RMSNorms use the class default, not rms_norm_eps
RENORM_EPS = 1e-20

# The shipped model's sizes where they differ from the package's tiny config (`make_text_config`).
PYDOC_SIZES = {"intermediate_size": 384, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 64,
               "routed_scaling_factor": 2.5, "attn_res_block_size": 3}


def text_config(num_hidden_layers: int = 8, linear_attn_config: dict | None = None, **overrides) -> dict:
    """The released `text_config` of a trainer model: the package's tiny config with the shipped model's
    sizes, K3's layer pattern at this depth, then `overrides` (top-level keys; `linear_attn_config`
    entries are merged into the KDA part). The defaults are the shipped model's config."""
    base = make_text_config()
    la = {**base["linear_attn_config"], **k3_layer_lists(num_hidden_layers), **(linear_attn_config or {})}
    return make_text_config(**{**PYDOC_SIZES, **overrides}, num_hidden_layers=num_hidden_layers, linear_attn_config=la)


# ---------------------------------------------------------------------------------------------
# norms and activations


def rms(x, eps: float):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return self.weight * rms(x, self.eps)


def situ(gate, up, beta: float, linear_beta: float):
    """SiTU-GLU: the sigmoid reads the UNCAPPED gate."""
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(up / linear_beta))


def linear(n_in: int, n_out: int, std: float | None = None) -> nn.Linear:
    m = nn.Linear(n_in, n_out, bias=False)
    nn.init.normal_(m.weight, std=(1.0 / math.sqrt(n_in)) if std is None else std)
    return m


def fake_mxfp4(w):
    """Round to MXFP4 along the last axis (groups of 32, power-of-two scale with max|w| <= 6, nearest
    E2M1 value), with a straight-through gradient. Same rule as `kimi_explore.mxfp4.quantize`."""
    q = mxfp4_round(w.detach())
    return w + (q - w).detach()


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_round(w):
    shape = w.shape
    g = w.reshape(*shape[:-1], shape[-1] // 32, 32).to(torch.float64)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(1 - 127, 254 - 127)
    x = g / torch.exp2(e)
    mags = _E2M1.to(torch.float64)
    idx = (x.abs().unsqueeze(-1) - mags).abs().argmin(-1)
    q = mags[idx] * torch.sign(x) * torch.exp2(e)
    return q.reshape(shape).to(w.dtype)


# ---------------------------------------------------------------------------------------------
# KDA


def kda_gate(graw, A_log, dt_bias, lower_bound: float):
    """Log-space decay g = lower_bound * sigmoid(exp(A_log[h]) * (graw + dt_bias)): [B, T, H, K]."""
    H, K = graw.shape[-2:]
    return lower_bound * torch.sigmoid(A_log[:H].exp()[:, None] * (graw + dt_bias.view(H, K)))


def naive_recurrent_kda(q, k, v, g, beta, S0=None):
    """The gated delta rule one step at a time (the twin of `chunk_kda`).

    q, k, v: [B, H, T, K] (q pre-scaled, q/k l2-normalised); g: [B, H, T, K] log decay; beta: [B, H, T].
    Per step: S = Diag(exp(g)) S; S += k (beta (v - S^T k))^T; o = S^T q.  S: [B, H, K, V].
    Returns (o [B, H, T, V], S).
    """
    B, H, T, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if S0 is None else S0
    out = []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None]
        u = torch.einsum("bhk,bhkv->bhv", k[:, :, t], S)
        S = S + k[:, :, t, :, None] * (beta[:, :, t, None] * (v[:, :, t] - u))[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(out, 2), S


def chunk_kda(q, k, v, g, beta, chunk: int = 16):
    """The same recurrence in chunks of C steps (WY form). Same arguments and result as the naive twin.

    Within a chunk with inclusive cumulative log decay G_t (per key channel) and initial state S0:
        delta_t = beta_t (v_t - S0^T (e^{G_t} k_t) - sum_{s<t} A_ts delta_s),  A_ts = sum_j k_t k_s e^{G_t - G_s}
        o_t     = S0^T (e^{G_t} q_t) + sum_{s<=t} (sum_j q_t k_s e^{G_t - G_s}) delta_s
        S_C     = e^{G_C} S0 + sum_s (e^{G_C - G_s} k_s) delta_s^T
    The pairwise factors e^{G_t - G_s} are split around the chunk's middle, (k e^{G_t - G_m}) . (k e^{G_m - G_s}),
    so that both halves stay inside float32 for any decay the lower bound allows (|G_t - G_m| <= 5 C / 2).
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    C = chunk
    pad = (-T) % C
    if pad:
        q, k, v, g = (F.pad(a, (0, 0, 0, pad)) for a in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v, g = (a.reshape(B, H, N, C, -1) for a in (q, k, v, g))
    beta = beta.reshape(B, H, N, C)
    G = g.cumsum(3)  # [B, H, N, C, K]
    Gm = G[..., C // 2 : C // 2 + 1, :]
    up, down = (G - Gm).exp(), (Gm - G).exp()
    incl = torch.ones(C, C, dtype=q.dtype, device=q.device).tril()
    strict = incl.tril(-1)
    kd = k * down
    Akk = ((k * up) @ kd.transpose(-1, -2)) * strict  # [.., t, s]
    Aqk = ((q * up) @ kd.transpose(-1, -2)) * incl
    # (I + diag(beta) Akk) delta = diag(beta) (v - e^G k S0)  ->  delta = U - W S0
    L = torch.eye(C, dtype=q.dtype, device=q.device) + beta[..., None] * Akk
    rhs = torch.cat([v, k * G.exp()], -1) * beta[..., None]
    sol = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    U, W = sol[..., :V], sol[..., V:]
    qg = q * G.exp()
    k_end = k * (G[..., -1:, :] - G).exp()  # e^{G_C - G_s} k_s
    g_end = G[..., -1, :].exp()  # [B, H, N, K]
    S = q.new_zeros(B, H, K, V)
    outs = []
    for n in range(N):
        delta = U[:, :, n] - W[:, :, n] @ S
        outs.append(qg[:, :, n] @ S + Aqk[:, :, n] @ delta)
        S = g_end[:, :, n, :, None] * S + k_end[:, :, n].transpose(-1, -2) @ delta
    o = torch.stack(outs, 2).reshape(B, H, N * C, V)[:, :, :T]
    return o, S


class KDA(nn.Module):
    def __init__(self, c: KimiDecoderConfig):
        super().__init__()
        la = c.linear_attn_config
        d, H, K, W = c.hidden_size, la.num_heads, la.head_dim, la.short_conv_kernel_size
        P = H * K
        self.H, self.K, self.lb, self.eps = H, K, la.gate_lower_bound, c.rms_norm_eps
        self.q_proj, self.k_proj, self.v_proj = linear(d, P), linear(d, P), linear(d, P)
        for s in "qkv":  # depthwise causal conv [P, 1, W]; w = W-1 multiplies the current token
            w = torch.zeros(P, 1, W)
            w[:, 0, -1] = 1.0
            w += 0.1 * torch.randn(P, 1, W)
            setattr(self, f"{s}_conv1d", nn.Module())
            getattr(self, f"{s}_conv1d").weight = nn.Parameter(w)
        self.f_a_proj = linear(d, K)
        self.f_b_proj = linear(K, P)
        # A_log per head, zero-padded to head_dim as released (only the first H entries are read)
        a = torch.zeros(max(K, H))
        a[:H] = torch.linspace(-1.0, 1.0, H)
        self.A_log = nn.Parameter(a)
        # per-channel offsets spread so that some key channels start with long memory (g near 0)
        self.dt_bias = nn.Parameter(torch.linspace(-4.0, 1.0, K).repeat(H))
        self.b_proj = linear(d, H)
        self.g_proj = linear(d, P)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(K))
        self.o_proj = linear(P, d, std=0.5 / math.sqrt(P))
        self.chunk = 16

    def conv(self, x, name):
        """x [B, T, P] -> silu(causal depthwise conv): [B, T, P]."""
        w = getattr(self, f"{name}_conv1d").weight
        y = F.conv1d(x.transpose(1, 2), w, padding=w.shape[-1] - 1, groups=w.shape[0])[..., : x.shape[1]]
        return F.silu(y).transpose(1, 2)

    def qkvgb(self, x):
        """The kernel operands for x [B, T, d]: q, k, v [B, H, T, K] (q scaled, q/k normalised), g, beta."""
        B, T, _ = x.shape
        H, K = self.H, self.K
        heads = lambda a: a.view(B, T, H, K).transpose(1, 2)  # noqa: E731
        q, k, v = (heads(self.conv(getattr(self, f"{s}_proj")(x), s)) for s in "qkv")
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + L2NORM_EPS) * (K**-0.5)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K), self.A_log, self.dt_bias, self.lb)
        beta = torch.sigmoid(self.b_proj(x)).transpose(1, 2)  # [B, H, T]
        return q, k, v, g.transpose(1, 2), beta

    def forward(self, x, naive: bool = False, record=None):
        B, T, _ = x.shape
        q, k, v, g, beta = self.qkvgb(x)
        o, _ = (naive_recurrent_kda if naive else lambda *a: chunk_kda(*a, chunk=self.chunk))(q, k, v, g, beta)
        if record is not None:
            record["g"] = g
        o = o.transpose(1, 2)  # [B, T, H, V]
        gate = torch.sigmoid(self.g_proj(x)).view(B, T, self.H, self.K)
        o = rms(o, self.eps) * self.o_norm.weight * gate  # gate is not normalised
        return self.o_proj(o.reshape(B, T, -1))


# ---------------------------------------------------------------------------------------------
# MLA


class MLA(nn.Module):
    def __init__(self, c: KimiDecoderConfig):
        super().__init__()
        d, nh = c.hidden_size, c.num_attention_heads
        self.nh, self.dn, self.dr, self.dv = nh, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kl = c.kv_lora_rank
        self.q_a_proj = linear(d, c.q_lora_rank)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
        self.q_b_proj = linear(c.q_lora_rank, nh * (self.dn + self.dr))
        self.kv_a_proj_with_mqa = linear(d, c.kv_lora_rank + self.dr)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = linear(c.kv_lora_rank, nh * (self.dn + self.dv))
        self.g_proj = linear(d, nh * self.dv)
        self.o_proj = linear(nh * self.dv, d, std=0.5 / math.sqrt(nh * self.dv))

    def forward(self, x):
        B, T, _ = x.shape
        nh, dn, dr, dv = self.nh, self.dn, self.dr, self.dv
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, nh, dn + dr).transpose(1, 2)
        ckv = self.kv_a_proj_with_mqa(x)
        kv = self.kv_b_proj(self.kv_a_layernorm(ckv[..., : self.kl])).view(B, T, nh, dn + dv).transpose(1, 2)
        k_pe = ckv[..., self.kl :][:, None].expand(B, nh, T, dr)  # NoPE: never rotated, not normalised
        k = torch.cat([kv[..., :dn], k_pe], -1)
        v = kv[..., dn:]
        s = (q @ k.transpose(-1, -2)) * (dn + dr) ** -0.5  # scale over the full q/k width
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        o = (p @ v).transpose(1, 2).reshape(B, T, nh * dv)
        return self.o_proj(o * torch.sigmoid(self.g_proj(x)))


# ---------------------------------------------------------------------------------------------
# FFN


class MLP(nn.Module):
    """down(SiTU(gate(x), up(x))): the dense layer-0 MLP and the fused shared experts."""

    def __init__(self, d: int, inter: int, c: KimiDecoderConfig):
        super().__init__()
        self.gate_proj, self.up_proj = linear(d, inter), linear(d, inter)
        self.down_proj = linear(inter, d, std=0.5 / math.sqrt(inter))
        self.b1, self.b2 = c.activation_situ_beta, c.activation_situ_linear_beta

    def forward(self, x):
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), self.b1, self.b2))


class Gate(nn.Module):
    def __init__(self, c: KimiDecoderConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c.num_experts, c.hidden_size) / math.sqrt(c.hidden_size))
        # selection-only bias, trained without gradients (auxiliary-loss-free balancing)
        self.register_buffer("e_score_correction_bias", torch.zeros(c.num_experts))


class LatentMoE(nn.Module):
    """Sigmoid router (bias for selection only), experts in a latent space, one RMSNorm on the
    aggregate, shared experts on the full-width input added unweighted."""

    def __init__(self, c: KimiDecoderConfig):
        super().__init__()
        d, E, lat, inter = c.hidden_size, c.num_experts, c.routed_expert_hidden_size, c.moe_intermediate_size
        self.E, self.k, self.scale = E, c.num_experts_per_token, c.routed_scaling_factor
        self.b1, self.b2 = c.activation_situ_beta, c.activation_situ_linear_beta
        self.gate = Gate(c)
        self.routed_expert_down_proj = linear(d, lat)
        self.routed_expert_norm = RMSNorm(lat, c.rms_norm_eps)
        self.routed_expert_up_proj = linear(lat, d, std=0.5 / math.sqrt(lat))
        self.shared_experts = MLP(d, c.num_shared_experts * inter, c)
        # routed experts stacked: w1 (gate) / w3 (up) [E, I, l], w2 (down) [E, l, I], nn.Linear [out, in]
        self.w1 = nn.Parameter(torch.randn(E, inter, lat) / math.sqrt(lat))
        self.w3 = nn.Parameter(torch.randn(E, inter, lat) / math.sqrt(lat))
        self.w2 = nn.Parameter(torch.randn(E, lat, inter) / math.sqrt(inter))
        self.fake_quant = False
        self.last_load = None  # [E] tokens per expert in the last forward (for the bias update)
        self.last_ids = None

    def forward(self, x):
        B, T, d = x.shape
        xf = x.reshape(-1, d)
        scores = torch.sigmoid(xf @ self.gate.weight.T)  # [N, E]
        ids = torch.topk(scores + self.gate.e_score_correction_bias, self.k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + RENORM_EPS) * self.scale
        self.last_ids = ids.detach()
        self.last_load = torch.bincount(ids.reshape(-1), minlength=self.E)
        z = self.routed_expert_down_proj(xf)  # [N, l]
        w1, w2, w3 = self.w1, self.w2, self.w3
        if self.fake_quant:
            w1, w2, w3 = fake_mxfp4(w1), fake_mxfp4(w2), fake_mxfp4(w3)
        # group the (token, expert) pairs by expert and run each expert on its own tokens
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // self.k
        zs, ws = z[tok], w.reshape(-1)[order]
        u = torch.zeros_like(z)
        start = 0
        for e, n in enumerate(self.last_load.tolist()):
            if n == 0:
                continue
            sl = slice(start, start + n)
            ze = zs[sl]
            y = situ(ze @ w1[e].T, ze @ w3[e].T, self.b1, self.b2) @ w2[e].T
            u = u.index_add(0, tok[sl], y * ws[sl, None])
            start += n
        routed = self.routed_expert_up_proj(self.routed_expert_norm(u))
        return (routed + self.shared_experts(xf)).view(B, T, d)


# ---------------------------------------------------------------------------------------------
# Block attention residuals and the decoder


class AttnRes(nn.Module):
    """The `<site>_res_norm` / `<site>_res_proj` pair: softmax over sources of (rms-normalised V_i) . w,
    mixing the RAW sources. w = norm.weight * proj.weight[0]."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(d))
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.zeros(1, d))
        self.eps = eps

    def forward(self, sources, record=None, key=None):
        V = torch.stack(sources, -2)  # [B, T, n+1, d]
        s = (rms(V, self.eps) * (self.norm.weight * self.proj.weight[0])).sum(-1)
        p = s.softmax(-1)
        if record is not None:
            record[key] = p.detach()
        return (p.unsqueeze(-1) * V).sum(-2)


class Layer(nn.Module):
    def __init__(self, c: KimiDecoderConfig, i: int):
        super().__init__()
        d = c.hidden_size
        self.i, self.boundary = i, i % c.attn_res_block_size == 0
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.self_attn = KDA(c) if c.is_kda_layer(i) else MLA(c)
        if c.is_moe_layer(i):
            self.block_sparse_moe = LatentMoE(c)
        else:
            self.mlp = MLP(d, c.intermediate_size, c)
        sa, mr = AttnRes(d, c.rms_norm_eps), AttnRes(d, c.rms_norm_eps)
        self.self_attention_res_norm, self.self_attention_res_proj = sa.norm, sa.proj
        self.mlp_res_norm, self.mlp_res_proj = mr.norm, mr.proj
        self._sa, self._mr = [sa], [mr]  # not registered twice

    @property
    def ffn(self):
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, h, stack, drop, record=None, naive=False):
        prefix = h
        a_in = self._sa[0](stack + [prefix], record, f"{self.i}.attn") if stack else h
        if self.boundary:
            stack.append(prefix)
            prefix = None
        x = self.input_layernorm(a_in)
        if isinstance(self.self_attn, KDA):
            a = self.self_attn(x, naive=naive, record=None if record is None else record.setdefault(f"{self.i}.kda", {}))
        else:
            a = self.self_attn(x)
        a = drop(a)
        prefix = a if prefix is None else prefix + a
        f_in = self._mr[0](stack + [prefix], record, f"{self.i}.ffn")
        return prefix + drop(self.ffn(self.post_attention_layernorm(f_in)))


class KimiK3(nn.Module):
    def __init__(self, text_config: dict, dropout: float = 0.0):
        """text_config: the released `text_config` (see `text_config()`); exported as it is."""
        super().__init__()
        self.text_config = text_config
        self.cfg = c = KimiDecoderConfig.from_dict(text_config, source="text_config")
        d = c.hidden_size
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, d)
        nn.init.normal_(self.model.embed_tokens.weight, std=1.0)
        self.model.layers = nn.ModuleList([Layer(c, i) for i in range(c.num_hidden_layers)])
        self.model.norm = RMSNorm(d, c.rms_norm_eps)
        out = AttnRes(d, c.rms_norm_eps)
        self.model.output_attn_res_norm, self.model.output_attn_res_proj = out.norm, out.proj
        self._out = [out]
        self.lm_head = linear(d, c.vocab_size, std=0.02)
        self.drop = nn.Dropout(dropout)
        # rebind the AttnRes modules to the registered parameters (one object per site)
        for layer in self.model.layers:
            layer._sa[0].norm, layer._sa[0].proj = layer.self_attention_res_norm, layer.self_attention_res_proj
            layer._mr[0].norm, layer._mr[0].proj = layer.mlp_res_norm, layer.mlp_res_proj

    def moe_layers(self):
        return [m.block_sparse_moe for m in self.model.layers if hasattr(m, "block_sparse_moe")]

    def set_fake_quant(self, on: bool):
        for m in self.moe_layers():
            m.fake_quant = on

    def forward(self, ids, record=None, naive=False):
        """ids [B, T] int64 -> logits [B, T, vocab]."""
        h = self.drop(self.model.embed_tokens(ids))
        stack: list = []
        for layer in self.model.layers:
            h = layer(h, stack, self.drop, record, naive)
        return self.lm_head(self.model.norm(self._out[0](stack + [h], record, "final")))

    @torch.no_grad()
    def update_router_bias(self, rate: float):
        """Auxiliary-loss-free balancing (DeepSeek-V3): nudge each expert's selection bias against its
        load in the last step, by `rate` times the sign of (mean load - load)."""
        for m in self.moe_layers():
            load = m.last_load.to(torch.float32)
            m.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
