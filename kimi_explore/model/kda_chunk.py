"""The gated delta rule over T tokens at once (chunked WY / UT form): the KDA prefill path.

Per head, S is [K, V]; q (pre-scaled) and k are l2-normalised; alpha_t = exp(g_t) in (0, 1] per key channel:

    S_t = Diag(alpha_t) S_{t-1};  w_t = beta_t (v_t - S_t^T k_t);  S_t += k_t w_t^T;  o_t = S_t^T q_t

which is the token form (`kda.delta_rule_update`, then `kda.delta_rule_read`). Inside a chunk of C
tokens that starts from S_0, with e(t, s) = alpha_{s+1} ... alpha_t <= 1 the decay from s to t (e(t, 0)
from the chunk's start):

    S_t = e(t, 0) S_0 + sum_{s<=t} (e(t, s) k_s) w_s^T
    (I + A) W = Beta (V - (e(., 0) k) S_0),    A[t, s] = beta_t k_t . (e(t, s) k_s)      s < t
    o_t = S_0^T (e(t, 0) q_t) + sum_{s<=t} M[t, s] w_s,    M[t, s] = q_t . (e(t, s) k_s)   s <= t
    S_C = e(C, 0) S_0 + sum_s (e(C, s) k_s) w_s^T

A, M and (I + A)^{-1} do not depend on S_0, so they are built for a group of chunks at once, and
W = U - Wk S_0 with U = (I + A)^{-1} Beta V, Wk = (I + A)^{-1} Beta e(., 0) k (fla `chunk_kda`'s u
and w); only four matmuls per chunk run one chunk after the other.

The trap: the textbook factorisation e(t, s) = e(t, 0) / e(s, 0) divides by a cumulative decay, and
the gate's lower bound is -5 per token, so a 64-token chunk spans exp(-320) (float32 underflows
below exp(-104)). Here the chunk is cut into sub-blocks of SUB tokens and every factor stays in range:

- decays are products of alphas (`cumprod` inside a sub-block: the token form's own rounding), or
  exp of float64 sums of logs between sub-blocks (never a float32 sum of 256 gates);
- across sub-blocks, through the position r before the later one: e(t, s) = e(t, r) e(r, s), two
  factors <= 1, one matmul per sub-block;
- inside a sub-block, through its start: e(t, s) = e(t, r) / e(s, r). The divisor is at least
  exp(-80) with K3's bound (16 x -5), a normal float32. A sub-block whose decay leaves that range
  (a hook's decay of 0) is done pairwise instead ([SUB, SUB, K], float64 log differences).

A factor that underflows to 0 stands for a true value below 1e-38 next to terms of order 1.

state_norms: ||S_t||_F after EVERY token without building the [T, H, K, V] states. From the state S_r
at the sub-block's start, with d = e(t, r), kR_s = k_s / e(s, r), P_s = S_r w_s:

    ||S_t||^2 = sum_k d[k]^2 (||S_r[k, :]||^2 + 2 sum_{s<=t} kR_s[k] P_s[k] + sum_{s,s'<=t} kR_s[k] kR_s'[k] w_s.w_s')

(float64 for the terms, prefix sums over t). Sub-blocks out of range are materialised instead
(`norms_block` states at a time).

Padding: the last chunk (and every chunk when C is not a multiple of SUB) is padded with tokens
k = v = q = 0, alpha = 1, beta = 0, which leave S unchanged. Temporaries are bounded (`BUDGET` bytes),
so K3 width (H = 96, K = V = 128) at chunk 256 fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._xp import array_namespace
from ..backend import to_numpy

SUB = 16  # sub-block length: decays relative to its start inside, one matmul through a reference point across
BUDGET = 1 << 25  # bytes of one pairwise temporary (a slice of sub-blocks, or of per-token states)
LOG_DECAY_FLOOR = -1000.0  # log of a decay of 0 (exp(-1000) is 0 in float32 and float64), without -inf - -inf = nan
# the smallest decay over a sub-block that `gram_norms` takes: its float64 terms hold (1 / decay)^2 (below: built states)
GRAM_DECAY_FLOOR = float(np.finfo(np.float32).tiny)


def chunked_delta_rule(q, k, v, log_alpha, beta, S, chunk: int = 64, state_norms: bool = False):
    """q, k: [T, H, K]; v: [T, H, V]; log_alpha: [T, H, K] (<= 0); beta: [T, H]; S: [H, K, V], updated in place.

    Returns (o [T, H, V], norms [T, H] or None): norms[t, h] = ||S_h||_F after token t (state_norms=True).
    """
    xp = array_namespace(S)
    T, H, K = k.shape
    V = v.shape[-1]
    if isinstance(chunk, bool) or int(chunk) != chunk or chunk < 1:
        raise ValueError(f"chunk={chunk!r}: expected a number of tokens >= 1")
    for name, a, want in (("q", q, (T, H, K)), ("v", v, (T, H, V)), ("log_alpha", log_alpha, (T, H, K)),
                          ("beta", beta, (T, H)), ("S", S, (H, K, V))):
        if tuple(a.shape) != want:
            raise ValueError(f"chunked_delta_rule: {name} has shape {tuple(a.shape)}, expected {want} (from k {tuple(k.shape)})")
    dt = S.dtype
    if T == 0:
        return xp.empty((0, H, V), dt), xp.empty((0, H), dt) if state_norms else None
    cut = first_non_finite(k, v, log_alpha, beta)
    if 0 < cut < T:  # the tokens before it, then the rest: its NaN must not reach them (below)
        o0, n0 = chunked_delta_rule(q[:cut], k[:cut], v[:cut], log_alpha[:cut], beta[:cut], S, chunk, state_norms)
        o1, n1 = chunked_delta_rule(q[cut:], k[cut:], v[cut:], log_alpha[cut:], beta[cut:], S, chunk, state_norms)
        return xp.concatenate((o0, o1)), xp.concatenate((n0, n1)) if state_norms else None
    C = min(int(chunk), T)
    b = min(SUB, C)
    Cp = -(-C // b) * b  # a whole number of sub-blocks
    nc = -(-T // C)

    def blocked(a):  # [T, H, ...] -> [nc, H, Cp, ...], each chunk's tokens padded with no-ops (zeros; log alpha 0)
        rest = tuple(a.shape[2:])
        if nc * C == T and Cp == C:
            return xp.ascontiguousarray(xp.moveaxis(a.reshape((nc, C, H) + rest), 2, 1), dtype=dt)
        flat = xp.zeros((nc * C, H) + rest, dt)
        flat[:T] = a
        out = xp.zeros((nc, Cp, H) + rest, dt)
        out[:, :C] = flat.reshape((nc, C, H) + rest)
        return xp.ascontiguousarray(xp.moveaxis(out, 2, 1))

    qb, kb, vb, bb, lb = blocked(q), blocked(k), blocked(v), blocked(beta), blocked(log_alpha)
    o = xp.empty((nc, H, Cp, V), dt)
    norms = xp.empty((nc, H, Cp), dt) if state_norms else None
    group = max(1, BUDGET // (4 * H * Cp * (Cp + K + V) * np.dtype(dt).itemsize))
    for c0 in range(0, nc, group):
        c1 = min(nc, c0 + group)
        ops = chunk_operators(qb[c0:c1], kb[c0:c1], vb[c0:c1], lb[c0:c1], bb[c0:c1], b)
        for c in range(c1 - c0):
            W = ops.U[c] - xp.matmul(ops.Wk[c], S)  # [H, Cp, V]
            o[c0 + c] = xp.matmul(ops.QG[c], S) + xp.matmul(ops.M[c], W)
            if state_norms:
                norms[c0 + c] = chunk_state_norms(S, kb[c0 + c], W, ops.eL[c], ops.kt[c], ops.tot[c], lb[c0 + c])
            S *= ops.dend[c][:, :, None]
            S += xp.matmul(ops.Kend[c].swapaxes(-1, -2), W)
    o = xp.moveaxis(o, 1, 2)[:, :C].reshape(nc * C, H, V)[:T]
    if state_norms:
        norms = xp.moveaxis(norms, 1, 2)[:, :C].reshape(nc * C, H)[:T]
    return o, norms


def first_non_finite(k, v, log_alpha, beta) -> int:
    """The first token whose k, v, beta or log alpha holds a NaN or +inf (-inf, a decay of 0, is fine), else T.

    The chunked form multiplies by the zeros above its triangles (A, M, (I + A)^{-1}): 0 times a later
    token's NaN is NaN, so that token would poison every earlier output and state norm of its chunk, which
    the token form never shows (q only reaches its own row). `chunked_delta_rule` runs the tokens before it
    on their own. One reduction per call (one transfer on a GPU)."""
    xp = array_namespace(k)
    ok = xp.isfinite(k).all(axis=(1, 2)) & xp.isfinite(v).all(axis=(1, 2)) & xp.isfinite(beta).all(axis=1)
    ok &= xp.isfinite(xp.maximum(log_alpha, LOG_DECAY_FLOOR)).all(axis=(1, 2))  # NaN stays NaN in maximum
    bad = np.flatnonzero(~np.asarray(to_numpy(ok)))
    return int(bad[0]) if bad.size else int(k.shape[0])


@dataclass
class ChunkOperators:
    """What a group of g chunks needs, none of it depending on the state (n sub-blocks of b tokens):

    QG, Wk: [g, H, Cp, K]  e(t, 0) q_t;  (I + A)^{-1} Beta e(., 0) k      U: [g, H, Cp, V]  (I + A)^{-1} Beta V
    M:      [g, H, Cp, Cp] Kend: [g, H, Cp, K]  e(C, s) k_s                dend: [g, H, K]  e(C, 0)
    eL:     [g, H, n, b, K] e(t, r) from the position r before t's sub-block
    kt:     [g, H, n, b, K] e(end of the sub-block, s) k_s                tot: [g, H, n, K] each sub-block's decay
    """

    QG: object
    Wk: object
    U: object
    M: object
    Kend: object
    dend: object
    eL: object
    kt: object
    tot: object


def chunk_operators(q, k, v, log_alpha, beta, b: int) -> ChunkOperators:
    """The state-independent operators of a group of chunks ([g, H, Cp, .]; sub-blocks of b tokens)."""
    xp = array_namespace(k)
    dt = k.dtype
    g, H, Cp, K = k.shape
    n = Cp // b
    six = (g, H, n, b, K)
    a6 = xp.exp(log_alpha).reshape(six)
    eL, tail = xp.empty_like(a6), xp.empty_like(a6)  # e(t, r); e(end, s) = alpha_{s+1} ... alpha_end
    eL[:, :, :, 0], tail[:, :, :, -1] = a6[:, :, :, 0], 1.0
    for j in range(1, b):  # running products over the b tokens (a cumprod over a middle axis is slower)
        xp.multiply(eL[:, :, :, j - 1], a6[:, :, :, j], out=eL[:, :, :, j])
        xp.multiply(tail[:, :, :, b - j], a6[:, :, :, b - j], out=tail[:, :, :, b - j - 1])
    tot = eL[:, :, :, -1]
    with np.errstate(divide="ignore"):  # float64 sums of logs between sub-blocks
        lt = xp.maximum(xp.log(tot.astype(xp.float64)), LOG_DECAY_FLOOR)
    Lc = xp.cumsum(lt, axis=2)  # log e(end of sub-block J, 0)
    Lx = Lc - lt  # log e(r_J, 0): before sub-block J
    k6, q6 = k.reshape(six), q.reshape(six)
    left = xp.concatenate((k6 * eL, q6 * eL), axis=3)  # [g, H, n, 2b, K]: e(t, r) k_t | e(t, r) q_t
    kt = k6 * tail

    A, M = xp.zeros((g, H, Cp, Cp), dt), xp.zeros((g, H, Cp, Cp), dt)
    dA, dM = diagonal_blocks(left, k6, eL, log_alpha.reshape(six), q6)
    A6, M6 = A.reshape(g, H, n, b, n, b), M.reshape(g, H, n, b, n, b)  # views
    for i in range(n):
        A6[:, :, i, :, i, :] = dA[:, :, i]
        M6[:, :, i, :, i, :] = dM[:, :, i]
    for i in range(1, n):  # sub-block i against every earlier token s, through r = the position before it
        a = i * b
        between = xp.exp(Lx[:, :, i : i + 1] - Lc[:, :, :i]).astype(dt)  # e(r, end of s's sub-block) [g, H, i, K]
        right = (kt[:, :, :i] * between[:, :, :, None, :]).reshape(g, H, a, K)  # e(r, s) k_s
        prod = xp.matmul(left[:, :, i], right.swapaxes(-1, -2))  # [g, H, 2b, a]
        A[:, :, a : a + b, :a] = prod[:, :, :b]
        M[:, :, a : a + b, :a] = prod[:, :, b:]
    A *= beta[:, :, :, None]
    Linv = unit_lower_inverse(A, b)
    eG = (eL * xp.exp(Lx).astype(dt)[:, :, :, None, :]).reshape(g, H, Cp, K)  # e(t, 0)
    Kend = (kt * xp.exp(Lc[:, :, -1:] - Lc).astype(dt)[:, :, :, None, :]).reshape(g, H, Cp, K)
    bt = beta[:, :, :, None]
    WkU = xp.matmul(Linv, xp.concatenate((bt * k * eG, bt * v), axis=-1))  # one solve for both right-hand sides
    return ChunkOperators(q * eG, WkU[..., :K], WkU[..., K:], M, Kend, xp.exp(Lc[:, :, -1]).astype(dt), eL, kt, tot)


def diagonal_blocks(left, k, eL, log_alpha, q):
    """A (strictly lower, not yet times beta) and M (lower with the diagonal) inside each sub-block:
    [g, H, n, b, b] each. e(t, s) = e(t, r) / e(s, r): one matmul of `left` [., 2b, K] with k / e(., r);
    sub-blocks whose decay leaves the normal float range (or whose product is not finite) pairwise."""
    xp = array_namespace(k)
    dt = k.dtype
    g, H, n, b, K = k.shape
    rows = g * H * n
    tot = eL[..., -1, :].reshape(rows, K)
    ok = tot.min(axis=-1) >= float(np.finfo(dt).tiny)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # out-of-range rows are redone below
        both = xp.matmul(left.reshape(rows, 2 * b, K), (k / eL).reshape(rows, b, K).swapaxes(-1, -2))  # [rows, 2b, b]
        dA = both[:, :b] * xp.tril(xp.ones((b, b), dtype=dt), -1)
        dM = both[:, b:] * xp.tril(xp.ones((b, b), dtype=dt))
    bad = xp.flatnonzero(~ok | ~xp.isfinite(both).all(axis=(1, 2)))
    if bad.size:
        G = xp.cumsum(xp.maximum(log_alpha.reshape(rows, b, K)[bad].astype(xp.float64), LOG_DECAY_FLOOR), axis=1)
        dA[bad], dM[bad] = pairwise_blocks(q.reshape(rows, b, K)[bad], k.reshape(rows, b, K)[bad], G)
    return dA.reshape(g, H, n, b, b), dM.reshape(g, H, n, b, b)


def pairwise_blocks(q, k, G):
    """A (strict, without beta) and M of sub-blocks q, k [m, b, K] from G float64 (log decays summed from the
    sub-block's start), one pair of tokens at a time: exp(G_t - G_s), for any decay (BUDGET bytes at once)."""
    xp = array_namespace(k)
    dt = k.dtype
    m, b, K = k.shape
    lower = xp.tril(xp.ones((b, b), dtype=bool))  # s <= t
    strict = xp.tril(xp.ones((b, b), dtype=dt), -1)
    dA, dM = xp.empty((m, b, b), dt), xp.empty((m, b, b), dt)
    step = max(1, BUDGET // (b * b * K * 8))
    for a in range(0, m, step):
        s = slice(a, a + step)
        D = xp.where(lower[:, :, None], G[s, :, None, :] - G[s, None, :, :], -math.inf)  # [., t, s, K]: G_t - G_s
        X = xp.exp(D.astype(dt)) * k[s, None, :, :]  # e(t, s) k_s
        both = xp.matmul(X, xp.stack((k[s], q[s]), axis=-1))  # [., t, s, 2]: . k_t, . q_t
        dA[s] = both[..., 0] * strict
        dM[s] = both[..., 1]
    return dA, dM


def unit_lower_inverse(A, b: int):
    """(I + A)^{-1} for A strictly lower triangular [..., C, C] (C a multiple of b): the b x b diagonal
    blocks by forward substitution (all at once), then block row by block row."""
    xp = array_namespace(A)
    C = A.shape[-1]
    n = C // b
    lead = A.shape[:-2]
    A6 = A.reshape(lead + (n, b, n, b))
    Ad = xp.stack([A6[..., i, :, i, :] for i in range(n)], axis=-3)  # [..., n, b, b]
    Bi = xp.zeros_like(Ad)
    Bi[..., 0, 0] = 1.0
    for i in range(1, b):  # row i of the inverse: e_i - A[i, :i] Bi[:i, :]
        Bi[..., i, :] = -xp.matmul(Ad[..., i : i + 1, :i], Bi[..., :i, :])[..., 0, :]
        Bi[..., i, i] = 1.0
    Linv = xp.zeros_like(A)
    L6 = Linv.reshape(lead + (n, b, n, b))
    for i in range(n):
        L6[..., i, :, i, :] = Bi[..., i, :, :]
    for i in range(1, n):
        a = i * b
        Linv[..., a : a + b, :a] = -xp.matmul(Bi[..., i, :, :], xp.matmul(A[..., a : a + b, :a], Linv[..., :a, :a]))
    return Linv


def norms_block(H: int, K: int, V: int, dtype) -> int:
    """Tokens whose states `materialised_norms` builds at once ([n, H, K, V] within BUDGET)."""
    return max(1, min(SUB, BUDGET // (2 * H * K * V * np.dtype(dtype).itemsize)))


def chunk_state_norms(S0, k, W, eL, kt, tot, log_alpha):
    """||S_t||_F [H, Cp] after every token of one chunk (S0 [H, K, V] before it; k [H, Cp, K]; W [H, Cp, V];
    eL, kt [H, n, b, K] and tot [H, n, K] from `ChunkOperators`; log_alpha [H, Cp, K] for out-of-range
    sub-blocks). Sub-block by sub-block from the state at its start, carried with the same W."""
    xp = array_namespace(S0)
    dt = S0.dtype
    H, n, b, K = eL.shape
    out = xp.empty((H, n * b), dt)
    # which sub-blocks decay within range of the Gram route, whose float64 terms hold 1 / decay squared: float32's
    # tiny (1e-38) for float64 states too (float64's own, 1e-308, overflowed those squares to inf, then NaN norms).
    # One explicit device -> host copy for the chunk.
    exact = to_numpy(tot.min(axis=(0, 2)) >= GRAM_DECAY_FLOOR).tolist()
    Sr = S0
    for i in range(n):
        a = i * b
        Wb = W[:, a : a + b]
        if exact[i]:
            out[:, a : a + b] = gram_norms(Sr, k[:, a : a + b], Wb, eL[:, i])
        else:
            G = xp.cumsum(xp.maximum(log_alpha[:, a : a + b].astype(xp.float64), LOG_DECAY_FLOOR), axis=1)
            out[:, a : a + b] = materialised_norms(Sr, k[:, a : a + b], G, Wb, norms_block(H, K, Wb.shape[-1], dt))
        if i + 1 < n:
            Sr = tot[:, i][:, :, None] * Sr + xp.matmul(kt[:, i].swapaxes(-1, -2), Wb)
    return out


def gram_norms(Sr, k, W, eL):
    """||S_t||_F [H, m] for the m tokens of one sub-block from the state Sr at its start (module docstring):
    no state built, float64 terms; the prefix sums over tokens as matmuls with a lower triangle of ones."""
    xp = array_namespace(Sr)
    f64 = xp.float64
    m = k.shape[1]
    eL64 = eL.astype(f64)
    kR = k.astype(f64) / eL64  # k_s / e(s, r)
    R = xp.matmul(Sr[:, :, None, :], Sr[:, :, :, None])[:, :, 0, 0].astype(f64)  # ||S_r[k, :]||^2 [H, K]
    P = xp.matmul(W, Sr.swapaxes(-1, -2)).astype(f64)  # [H, m, K]: (S_r w_s)[k]
    W64 = W.astype(f64)
    Wg = xp.matmul(W64, W64.swapaxes(-1, -2))  # [H, m, m]: w_s . w_s'
    Y = xp.matmul(xp.tril(Wg), kR)  # sum_{s<=t} (w_t . w_s) kR_s
    # per token s: 2 kR_s P_s (the cross term) + 2 kR_s Y_s - kR_s^2 w_s.w_s (the new pairs of the square)
    inc = kR * (2.0 * (P + Y) - kR * xp.diagonal(Wg, axis1=1, axis2=2)[:, :, None])
    acc = xp.matmul(xp.tril(xp.ones((m, m), f64)), inc) + R[:, None, :]  # [H, m, K]
    n2 = xp.matmul((eL64 * eL64)[:, :, None, :], acc[:, :, :, None])[:, :, 0, 0]
    return xp.sqrt(xp.maximum(n2, 0.0)).astype(Sr.dtype)


def materialised_norms(S0, k, G, W, nb: int):
    """||S_t||_F [H, m] for the m tokens of one sub-block, the states built nb at a time from S0 at its start
    (k [H, m, K]; G float64 [H, m, K], log decays summed from the start; W [H, m, V]): any decay."""
    xp = array_namespace(S0)
    dt = S0.dtype
    H, m, K = k.shape
    V = W.shape[-1]
    out = xp.empty((H, m), dt)
    Sr, Gr = S0, xp.zeros((H, 1, K), xp.float64)
    for a in range(0, m, nb):
        e = min(m, a + nb)
        Gs = G[:, a:e]
        lower = xp.tril(xp.ones((e - a, e - a), dtype=bool))
        D = xp.where(lower[:, :, None], Gs[:, :, None, :] - Gs[:, None, :, :], -math.inf)  # [H, t, s, K]
        coef = xp.exp(D.astype(dt)) * k[:, None, a:e, :]  # e(t, s) k_s
        St = xp.exp((Gs - Gr).astype(dt))[..., None] * Sr[:, None] + xp.matmul(coef.swapaxes(-1, -2), W[:, None, a:e])
        flat = St.reshape(H, e - a, 1, K * V)
        out[:, a:e] = xp.sqrt(xp.matmul(flat, flat.swapaxes(-1, -2))[..., 0, 0])
        Sr, Gr = St[:, -1], Gs[:, -1:]
    return out


def naive_recurrent_delta_rule(q, k, v, alpha, beta, S):
    """Float64 reference, token by token, head by head, key channel by key channel (fla `naive_recurrent_kda`).

    q, k: [T, H, K]; v: [T, H, V]; alpha: [T, H, K] decay in (0, 1]; beta: [T, H]; S: [H, K, V] (not modified).
    Returns (o [T, H, V], S after the last token, norms [T, H] = ||S_h||_F after each token).
    """
    q, k, v, alpha, beta = (np.asarray(a, dtype=np.float64) for a in (q, k, v, alpha, beta))
    S = np.array(S, dtype=np.float64)
    T, H, K = k.shape
    o, norms = np.zeros((T, H, v.shape[-1])), np.zeros((T, H))
    for t in range(T):
        for h in range(H):
            for j in range(K):
                S[h, j, :] *= alpha[t, h, j]
            u = S[h].T @ k[t, h]
            S[h] += np.outer(k[t, h], beta[t, h] * (v[t, h] - u))
            o[t, h] = S[h].T @ q[t, h]
            norms[t, h] = math.sqrt(float(np.sum(S[h] * S[h])))
    return o, S, norms
