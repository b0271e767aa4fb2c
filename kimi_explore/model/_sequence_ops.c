/* Element-wise kernels of the sequence (prefill) path, and its fused ones (MLA's attention, the dense routed experts,
   the recorder's top-k of a chunk's logits), compiled (CPU, float32): sequence_ops.py.

   NumPy's float32 exp and tanh cost ~1.4 ns per element on this project's machines (AVX2), and a
   softmax or a SiTU-GLU is five to eight NumPy passes with their temporaries. These kernels take one
   pass each with a polynomial exp (Cephes `expf`: range reduction by ln 2 in two parts, a degree-6
   polynomial, the exponent put in by bits) and tanh (Cephes `tanhf`: an odd polynomial below
   |x| = 0.625, 1 - 2 / (exp(2|x|) + 1) above), written for the compiler's vectoriser (no branches:
   both sides computed, then selected). Their error is ~1-2 float32 ulp against the exact value (NumPy's
   own is ~1 ulp): results agree with the NumPy route to float32 rounding, not bit for bit.

   The same goes for the short passes between the matmuls (KDA's decay, q/k L2 norm and gated output norm; the
   block residuals' scores and mix over a chunk's stacks): each is several NumPy passes, or a batched matmul
   of [1, m] x [m, d] per token that NumPy runs at ~2 GFLOP/s, in one.

   Edges: exp(x) is 0 below x = -87 (the exact value is under 1.7e-38; NumPy gives a subnormal) and +inf
   above x = 88; exp(-inf) = 0 exactly (a masked score); NaN propagates.

   The same bodies are compiled for AVX-512F, AVX2+FMA and portable C (_kernel_isa.h picks at run time).
   The GIL is released. */

/* Vectorising the selects needs it; FP exception flags only, values unchanged. */
#pragma GCC optimize("no-trapping-math")

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#include "../weights/_kernel_isa.h"

#define KX_INLINE __attribute__((always_inline)) static inline

/* 8 floats (and their compare masks) as one vector: the softmax's running max, which the vectoriser leaves
   scalar when written lane by lane (a select, not a max: NaN and signed-zero order kept). */
typedef float kx_v8f __attribute__((vector_size(32)));
typedef int32_t kx_v8i __attribute__((vector_size(32)));
/* 16 floats: the fused kernels' lanes on AVX-512 (kx_v8f elsewhere) */
typedef float kx_v16f __attribute__((vector_size(64)));
typedef int32_t kx_v16i __attribute__((vector_size(64)));

/* a vector from / to floats anywhere (a load or store: memcpy of a named vector, which the compiler keeps in a register) */
#define KX_LOAD(VF, p)                                                                        \
    ({                                                                                        \
        VF t_;                                                                                \
        memcpy(&t_, (p), sizeof t_);                                                          \
        t_;                                                                                   \
    })
#define KX_STORE(VF, p, v)                                                                    \
    do {                                                                                      \
        const VF t_ = (v);                                                                    \
        memcpy((p), &t_, sizeof t_);                                                          \
    } while (0)

/* exp's polynomial and exponent bits, before the edge selects: valid for x in [-87, 88] (or NaN). */
KX_INLINE float kx_expf_core(float xc) {
    float fx = xc * 1.44269504088896341f;
    fx = (fx + 12582912.0f) - 12582912.0f; /* round to nearest (1.5 * 2^23) */
    float r = xc - fx * 0.693359375f;
    r = r - fx * -2.12194440e-4f;
    const float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    const int32_t n = (int32_t)fx + 127;
    const uint32_t bits = (uint32_t)n << 23;
    float p;
    memcpy(&p, &bits, sizeof p);
    return y * p;
}

KX_INLINE float kx_expf_clamped(float x) {
    float xc = x < -87.0f ? -87.0f : x;
    xc = xc > 88.0f ? 88.0f : xc;
    return kx_expf_core(xc);
}

KX_INLINE float kx_expf(float x) {
    const float out = kx_expf_clamped(x);
    return x < -87.0f ? 0.0f : (x > 88.0f ? INFINITY : out);
}

/* 1 + exp(x): kx_expf's edges selected after the add (1 + 0 = 1, 1 + inf = inf: the same values), so that a
   division by it compiles to one divide, not one per edge (3.7 -> 2.7 ns per SiTU element, AVX2). */
KX_INLINE float kx_one_plus_expf(float x) {
    const float e = kx_expf_clamped(x);
    return x < -87.0f ? 1.0f : (x > 88.0f ? INFINITY : 1.0f + e);
}

/* tanh(a) for 0 <= a < 0.625: Cephes' odd polynomial */
KX_INLINE float kx_tanh_small_abs(float a) {
    const float z = a * a;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    return p * z * a + a;
}

KX_INLINE float kx_tanhf(float x) {
    const float a = x < 0.0f ? -x : x;
    const float e = kx_expf_core(2.0f * (a > 44.0f ? 44.0f : a)); /* in [0, 88] or NaN: kx_expf's clamps and selects are no-ops */
    const float big = 1.0f - 2.0f / (e + 1.0f);
    const float r = a < 0.625f ? kx_tanh_small_abs(a) : big;
    return x < 0.0f ? -r : r;
}

/* SiTU-GLU of one gate g and up u: tanh(g inv_b) / (1 + exp(-g)) * tanh(u inv_lb) * c (has_lb), else
   tanh(g inv_b) / (1 + exp(-g)) * u * c: the NumPy route's operations in its order (ops.situ_and_mul). */
KX_INLINE float kx_situ(float g, float u, float inv_b, float inv_lb, float c, int has_lb) {
    const float a = kx_tanhf(g * inv_b) / kx_one_plus_expf(-g);
    return has_lb ? a * kx_tanhf(u * inv_lb) * c : a * u * c;
}

/* kx_tanhf where |x| < 0.625: its small branch alone (the same operations), without the exp and divide of
   the other branch, which kx_tanhf's select would discard. */
KX_INLINE float kx_tanhf_small(float x) {
    const float small = kx_tanh_small_abs(x < 0.0f ? -x : x);
    return x < 0.0f ? -small : small;
}

/* a . b of n floats in 8 or 16 lanes (the vectoriser's shape; a float sum is not reordered for it) */
#define DEFINE_DOT(LANES)                                                                     \
    KX_INLINE float kx_dot_##LANES(const float *restrict a, const float *restrict b, Py_ssize_t n) { \
        float part[LANES] = {0.0f};                                                           \
        Py_ssize_t j = 0;                                                                     \
        for (; j + LANES <= n; j += LANES)                                                    \
            for (int k = 0; k < LANES; k++) part[k] += a[j + k] * b[j + k];                   \
        float sum = 0.0f;                                                                     \
        for (; j < n; j++) sum += a[j] * b[j];                                                \
        for (int k = 0; k < LANES; k++) sum += part[k];                                       \
        return sum;                                                                           \
    }
DEFINE_DOT(8)
DEFINE_DOT(16)

/* what: 0 exp, 1 sigmoid 1 / (1 + exp(-x)), 2 SiLU x / (1 + exp(-x)); in place on n floats */
#define MAP_BODY                                                                              \
    {                                                                                         \
        if (what == 0)                                                                        \
            for (Py_ssize_t i = 0; i < n; i++) a[i] = kx_expf(a[i]);                          \
        else if (what == 1)                                                                   \
            for (Py_ssize_t i = 0; i < n; i++) a[i] = 1.0f / kx_one_plus_expf(-a[i]);         \
        else                                                                                  \
            for (Py_ssize_t i = 0; i < n; i++) a[i] = a[i] / kx_one_plus_expf(-a[i]);         \
    }

/* SiTU-GLU: gu [rows, 2n] (gate | up) -> out [rows, n]:
   tanh(g inv_b) / (1 + exp(-g)) * tanh(u inv_lb) * c   (has_lb), else  tanh(g inv_b) / (1 + exp(-g)) * u * c,
   the NumPy route's operations in its order (ops.situ_and_mul). */
#define SITU_BODY                                                                             \
    {                                                                                         \
        for (Py_ssize_t r = 0; r < rows; r++) {                                               \
            const float *restrict g = gu + r * 2 * n, *restrict u = g + n;                     \
            float *restrict o = out + r * n;                                                  \
            if (has_lb)                                                                       \
                for (Py_ssize_t i = 0; i < n; i++) o[i] = kx_situ(g[i], u[i], inv_b, inv_lb, c, 1); \
            else                                                                              \
                for (Py_ssize_t i = 0; i < n; i++) o[i] = kx_situ(g[i], u[i], inv_b, inv_lb, c, 0); \
        }                                                                                     \
    }

/* SiTU-GLU (has_lb) of one row whose ups all have |u inv_lb| < 0.625: kx_situ's value, the up's tanh by its
   small branch alone (the embedded model: every row; a third fewer exps and divides). */
#define SITU_SMALL_UP_BODY                                                                    \
    {                                                                                         \
        for (Py_ssize_t i = 0; i < n; i++) {                                                  \
            const float a = kx_tanhf(g[i] * inv_b) / kx_one_plus_expf(-g[i]);                 \
            o[i] = a * kx_tanhf_small(u[i] * inv_lb) * c;                                     \
        }                                                                                     \
    }

/* 1 when |u[i] inv| < 0.625 for all n (each up's tanh takes its small branch; NaN does not). */
#define ALL_SMALL_BODY                                                                        \
    {                                                                                         \
        int big = 0;                                                                          \
        for (Py_ssize_t i = 0; i < n; i++) {                                                  \
            const float x = u[i] * inv;                                                       \
            big |= !((x < 0.0f ? -x : x) < 0.625f);                                           \
        }                                                                                     \
        return !big;                                                                          \
    }

/* Causal softmax, in place on s [rows, L] (row i is query t = i mod T of a chunk after L0 cached
   positions): x = s * scale over the row's visible positions 0 .. L0 + t, then exp(x - max) / sum; the
   positions after them set to 0. Maxima in 8 lanes, sums in LANES (8; AVX-512 16: with 8 its exp pass
   ran at 1.24 ns per element against AVX2's 0.82 on a Xeon, the whole row 1.85 against 1.28 ns; with 16
   1.07). */
#define SOFTMAX_BODY(LANES)                                                                   \
    {                                                                                         \
        for (Py_ssize_t i = 0; i < rows; i++) {                                               \
            float *restrict s = S + i * L;                                                    \
            Py_ssize_t valid = L0 + i % T + 1;                                                \
            if (valid > L) valid = L;                                                         \
            float lane[8];                                                                    \
            kx_v8f vlane = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,                       \
                            -INFINITY, -INFINITY, -INFINITY, -INFINITY};                      \
            Py_ssize_t j = 0;                                                                 \
            for (; j + 8 <= valid; j += 8) { /* lane k: x > lane[k] ? x : lane[k], as a vector */ \
                kx_v8f x;                                                                     \
                memcpy(&x, s + j, sizeof x);                                                  \
                x = x * scale;                                                                \
                memcpy(s + j, &x, sizeof x);                                                  \
                const kx_v8i gt = x > vlane;                                                  \
                vlane = (kx_v8f)(((kx_v8i)x & gt) | ((kx_v8i)vlane & ~gt));                   \
            }                                                                                 \
            memcpy(lane, &vlane, sizeof lane);                                                \
            float m = -INFINITY;                                                              \
            for (int k = 0; k < 8; k++) m = lane[k] > m ? lane[k] : m;                        \
            for (; j < valid; j++) {                                                          \
                const float x = s[j] * scale;                                                 \
                s[j] = x;                                                                     \
                m = x > m ? x : m;                                                            \
            }                                                                                 \
            float part[LANES] = {0.0f};                                                       \
            for (j = 0; j + LANES <= valid; j += LANES)                                       \
                for (int k = 0; k < LANES; k++) {                                             \
                    const float e = kx_expf(s[j + k] - m);                                    \
                    s[j + k] = e;                                                             \
                    part[k] += e;                                                             \
                }                                                                             \
            float sum = 0.0f;                                                                 \
            for (; j < valid; j++) {                                                          \
                const float e = kx_expf(s[j] - m);                                            \
                s[j] = e;                                                                     \
                sum += e;                                                                     \
            }                                                                                 \
            for (int k = 0; k < LANES; k++) sum += part[k];                                   \
            for (j = 0; j < valid; j++) s[j] = s[j] / sum;                                    \
            for (; j < L; j++) s[j] = 0.0f;                                                   \
        }                                                                                     \
    }

/* KDA's short conv and SiLU over a chunk: out[t, c] = silu(sum_j ext[t + 1 + j, c] taps[j, c]) for t < T, where
   ext's rows are the W stored window rows (head [W, C], oldest first), then the chunk's T rows (y, row stride ys: the
   input projection's rows, their first C columns), never concatenated. Then the window advanced: window [C, W]
   (the state's layout) = ext's last W rows (head is the caller's copy of the old window: those it still needs are
   read from there). With K > 0, norms [T, C / K]: each group of K channels' norm over token t's window (ext rows
   t + 1 .. t + W; each row's sum of squares in lanes, the W rows' sums added oldest first), what a recorder keeps
   of the kda.conv site. */
#define KX_EXT_ROW(r) ((r) < W ? head + (r) * C : y + ((r) - W) * ys)
#define CONV_BODY(LANES, FUSED)                                                               \
    {                                                                                         \
        for (Py_ssize_t t = 0; t < T; t++) {                                                  \
            float *restrict o = out + t * C;                                                  \
            const float *restrict e = KX_EXT_ROW(t + 1);                                      \
            if ((FUSED) && W == 4) { /* K3's and the embedded model's, where the ISA fuses multiply-adds: the */ \
                /* taps summed in registers, one store; the general loop's operations (the first product rounded, */ \
                /* then one fused add per tap, as its contracted `o[c] += ...`) */            \
                const float *restrict e1 = KX_EXT_ROW(t + 2), *restrict e2 = KX_EXT_ROW(t + 3), \
                                      *restrict e3 = KX_EXT_ROW(t + 4);                       \
                for (Py_ssize_t c = 0; c < C; c++) {                                          \
                    float x = e[c] * taps[c];                                                 \
                    x = fmaf(e1[c], taps[C + c], x);                                          \
                    x = fmaf(e2[c], taps[2 * C + c], x);                                      \
                    x = fmaf(e3[c], taps[3 * C + c], x);                                      \
                    o[c] = x / kx_one_plus_expf(-x);                                          \
                }                                                                             \
                continue;                                                                     \
            }                                                                                 \
            for (Py_ssize_t c = 0; c < C; c++) o[c] = e[c] * taps[c];                         \
            for (Py_ssize_t j = 1; j < W; j++) {                                              \
                const float *restrict ej = KX_EXT_ROW(t + 1 + j), *restrict tj = taps + j * C; \
                for (Py_ssize_t c = 0; c < C; c++) o[c] += ej[c] * tj[c];                     \
            }                                                                                 \
            for (Py_ssize_t c = 0; c < C; c++) o[c] = o[c] / kx_one_plus_expf(-o[c]);         \
        }                                                                                     \
        if (K > 0) {                                                                          \
            const Py_ssize_t G = C / K;                                                       \
            for (Py_ssize_t r = 1; r < W + T; r++) {                                          \
                const float *restrict e = KX_EXT_ROW(r);                                      \
                for (Py_ssize_t g = 0; g < G; g++) sq[r * G + g] = kx_dot_##LANES(e + g * K, e + g * K, K); \
            }                                                                                 \
            for (Py_ssize_t t = 0; t < T; t++)                                                \
                for (Py_ssize_t g = 0; g < G; g++) {                                          \
                    float s = sq[(t + 1) * G + g];                                            \
                    for (Py_ssize_t j = 1; j < W; j++) s += sq[(t + 1 + j) * G + g];          \
                    norms[t * G + g] = sqrtf(s);                                              \
                }                                                                             \
        }                                                                                     \
        for (Py_ssize_t r = 0; r < W; r++) {                                                  \
            const float *restrict e = KX_EXT_ROW(T + r);                                      \
            for (Py_ssize_t c = 0; c < C; c++) window[c * W + r] = e[c];                      \
        }                                                                                     \
    }

/* KDA's decay over rows of P channels, raw [rows, P] (f_b_proj's output) -> g (log alpha, in place) and alpha:
   g = lower_bound * sigmoid((raw + dt_bias) A), alpha = exp(g): the NumPy route's operations in its order (add,
   multiply, map's sigmoid, multiply, map's exp). Per row of P, so a chunk's size does not move the loop's
   vectorised body and tail (whose exp may contract differently: 1 ulp); g, then alpha from it, in two passes over
   the row (one pass, the two polynomials' registers spilled: 1.3x slower, the same values). */
#define DECAY_BODY                                                                            \
    {                                                                                         \
        for (Py_ssize_t r = 0; r < rows; r++) {                                               \
            float *restrict x = g + r * P, *restrict a = alpha + r * P;                       \
            for (Py_ssize_t i = 0; i < P; i++) {                                              \
                const float z = (x[i] + dt[i]) * A[i];                                        \
                x[i] = (1.0f / kx_one_plus_expf(-z)) * lb;                                    \
            }                                                                                 \
            for (Py_ssize_t i = 0; i < P; i++) a[i] = kx_expf(x[i]);                          \
        }                                                                                     \
    }

/* q's and k's L2 norm, q's scale folded in: x = qkv [T, 3, H, K] (q, k, v streams), out [2, T, H, K] with
   out[s, t, h] = x[t, s, h] * (scale[s H + h] / sqrt(sum(x[t, s, h]^2) + eps)); the sum in LANES lanes. */
#define L2_BODY(LANES)                                                                        \
    {                                                                                         \
        for (Py_ssize_t t = 0; t < T; t++)                                                    \
            for (Py_ssize_t r = 0; r < 2 * H; r++) {                                          \
                const float *restrict x = qkv + (t * 3 * H + r) * K;                          \
                float *restrict o = out + ((r / H) * T * H + t * H + r % H) * K;             \
                const float f = scale[r] / sqrtf(kx_dot_##LANES(x, x, K) + eps);         \
                for (Py_ssize_t j = 0; j < K; j++) o[j] = x[j] * f;                           \
            }                                                                                 \
    }

/* KDA's gated RMSNorm of the read-out, rows of V: out = o * (gain * gate) / sqrt(sum(o^2) + eps) (eps = V
   rms_norm_eps, gain = o_norm sqrt(V)), the NumPy route's operations in its order; the sum in LANES lanes. */
#define GATED_NORM_BODY(LANES)                                                                \
    {                                                                                         \
        for (Py_ssize_t r = 0; r < rows; r++) {                                               \
            const float *restrict x = o + r * V, *restrict gt = gate + r * V;                 \
            float *restrict y = out + r * V;                                                  \
            const float d = sqrtf(kx_dot_##LANES(x, x, V) + eps);                        \
            for (Py_ssize_t j = 0; j < V; j++) y[j] = x[j] * (gain[j] * gt[j]) / d;           \
        }                                                                                     \
    }

/* The block residuals' scores and mix over a chunk's stacks rows [T, S, d] (S: the stack's capacity; the first m
   sources used). Scores: s[t, i] = rows[t, i] . w (float32, in LANES lanes). Mix: out[t] = sum_i p[t, i] rows[t, i],
   i ascending. */
#define SCORES_BODY(LANES)                                                                    \
    {                                                                                         \
        for (Py_ssize_t t = 0; t < T; t++)                                                    \
            for (Py_ssize_t i = 0; i < m; i++) s[t * m + i] = kx_dot_##LANES(rows + (t * S + i) * d, w, d); \
    }

#define MIX_BODY                                                                              \
    {                                                                                         \
        for (Py_ssize_t t = 0; t < T; t++) {                                                  \
            float *restrict o = out + t * d;                                                  \
            const float *restrict v = rows + t * S * d, *restrict pt = p + t * m;             \
            for (Py_ssize_t j = 0; j < d; j++) o[j] = pt[0] * v[j];                           \
            for (Py_ssize_t i = 1; i < m; i++)                                                \
                for (Py_ssize_t j = 0; j < d; j++) o[j] += pt[i] * v[i * d + j];              \
        }                                                                                     \
    }

/* kx_expf of each lane of a vector x <= 0 or NaN (VF floats, VI int32 of the same width; the attention's x - max):
   its steps as vector operations (the vectoriser does not keep a loop of kx_expf's in registers across the
   attention's passes); its lower edge by select (its upper, x > 88, never applies here: the same values). */
#define KX_EXPF_NONPOS_V(VF, VI, x)                                                           \
    ({                                                                                        \
        const VF x_ = (x), zero_ = {0.0f}, lo_ = zero_ - 87.0f;                               \
        const VI below_ = x_ < lo_;                                                           \
        const VF xc_ = (VF)(((VI)x_ & ~below_) | ((VI)lo_ & below_));                        \
        VF fx_ = xc_ * 1.44269504088896341f;                                                  \
        fx_ = (fx_ + 12582912.0f) - 12582912.0f;                                              \
        VF r_ = xc_ - fx_ * 0.693359375f;                                                     \
        r_ = r_ - fx_ * -2.12194440e-4f;                                                      \
        const VF z_ = r_ * r_;                                                                \
        VF y_ = r_ * 1.9875691500e-4f + 1.3981999507e-3f;                                     \
        y_ = y_ * r_ + 8.3334519073e-3f;                                                      \
        y_ = y_ * r_ + 4.1665795894e-2f;                                                      \
        y_ = y_ * r_ + 1.6666665459e-1f;                                                      \
        y_ = y_ * r_ + 5.0000001201e-1f;                                                      \
        y_ = y_ * z_ + r_ + 1.0f;                                                             \
        const VF e_ = y_ * (VF)((__builtin_convertvector(fx_, VI) + 127) << 23);              \
        (VF)((VI)e_ & ~below_);                                                               \
    })

/* MLA's causal attention over a chunk, fused (the sequence path where no hook reads the probabilities): for head h
   and query t (position L0 + t), o[t, h] = sum_j (p_j / sum_i p_i) values[h, j] over j, i = 0 .. L0 + t, with
   p_j = exp(x_j - max x) and x_j = (q[t, h] . keys[h, j]) scale: SOFTMAX_BODY's steps (scale, max by select, exp of
   the difference, sum, each probability normalised before the mix: times 1 / sum, not divided, rounding apart).
   Queries go QB = 2 LANES at a time, one per vector lane, so that the scores, their max, exp and sum are vertical:
   kept in a scratch p [L0 + T, QB] that stays in cache (the unfused route writes [nh, T, L0 + T] and reads it three
   times). The scores take NK = 6 positions per pass over q's dims: 12 accumulators, enough for the FMA units, beside
   the 2 query vectors and a broadcast key in AVX2's 16 registers (4 query vectors x 3 positions spill); a position
   after a lane's own is masked there (score -inf: exp gives 0). The mix goes R queries x CV = 2 value vectors at a time
   (R = 4 in 8 lanes, AVX2's and portable C's; 8 in AVX-512's 16: 6 loads per 8 FMAs, where 8 queries x 1 vector
   took 9, a 5% faster kernel on an AVX2 VM), each probability broadcast and the values in the lanes, each query over exactly the
   positions it sees, so a later token's value never reaches it (0 times its NaN or inf would be NaN; the token form
   never sees that value). The denominators and the mix are summed by blocks of ATTENTION_BLOCK positions, the blocks'
   sums then added: within a few float32 ulps of the token form's sums at any cache length. 1.2x the 2 x 4 score and
   masked mix blocks before, at the embedded model's widths and K3's. Lanes past the chunk's last query compute on
   zero queries and are not written. */
#define ATTENTION_BLOCK 128 /* positions per partial sum of the softmax's denominator and of the mix */
#define ATTENTION_BODY(LANES)                                                                 \
    {                                                                                         \
        typedef kx_v##LANES##f VF;                                                            \
        typedef kx_v##LANES##i VI;                                                            \
        enum { NVQ = 2, NK = 6, QB = NVQ * LANES, R = LANES == 16 ? 8 : 4, CV = 2 };          \
        VI lane;                                                                              \
        for (int i = 0; i < LANES; i++) lane[i] = i;                                          \
        const VF zero = {0.0f}, neg_inf = zero - INFINITY;                                    \
        for (Py_ssize_t h = 0; h < nh; h++) {                                                 \
            const float *restrict K = keys + h * cap * dq, *restrict V = values + h * cap * dv; \
            for (Py_ssize_t a = 0; a < T; a += QB) {                                          \
                const Py_ssize_t nq = T - a < QB ? T - a : QB, first = L0 + a, Lv = first + nq; \
                for (Py_ssize_t d = 0; d < dq; d++)                                           \
                    for (int i = 0; i < QB; i++)                                              \
                        qt[d * QB + i] = i < nq ? q[((a + i) * nh + h) * dq + d] : 0.0f;      \
                /* scores, scaled, masked and stored, and each lane's max (SOFTMAX_BODY's select) */ \
                VF m[NVQ];                                                                    \
                for (int v = 0; v < NVQ; v++) m[v] = neg_inf;                                 \
                for (Py_ssize_t j = 0; j < Lv; j += NK) {                                     \
                    const int nj = Lv - j < NK ? (int)(Lv - j) : NK;                          \
                    VF s[NK][NVQ];                                                            \
                    for (int u = 0; u < NK; u++)                                              \
                        for (int v = 0; v < NVQ; v++) s[u][v] = zero;                         \
                    const float *restrict kj = K + j * dq;                                    \
                    if (nj == NK)                                                             \
                        for (Py_ssize_t d = 0; d < dq; d++) {                                 \
                            VF qv[NVQ];                                                       \
                            for (int v = 0; v < NVQ; v++) qv[v] = KX_LOAD(VF, qt + d * QB + v * LANES); \
                            for (int u = 0; u < NK; u++) {                                    \
                                const float k = kj[u * dq + d];                               \
                                for (int v = 0; v < NVQ; v++) s[u][v] += qv[v] * k;           \
                            }                                                                 \
                        }                                                                     \
                    else                                                                      \
                        for (int u = 0; u < nj; u++)                                          \
                            for (Py_ssize_t d = 0; d < dq; d++) {                             \
                                const float k = kj[u * dq + d];                               \
                                for (int v = 0; v < NVQ; v++) s[u][v] += KX_LOAD(VF, qt + d * QB + v * LANES) * k; \
                            }                                                                 \
                    for (int u = 0; u < nj; u++) {                                            \
                        const Py_ssize_t lo = j + u - first; /* lanes below lo come before position j + u */ \
                        for (int v = 0; v < NVQ; v++) {                                       \
                            VF x = s[u][v] * scale;                                           \
                            if (lo > v * LANES) {                                             \
                                const VI ok = lane + v * LANES >= (int)lo;                    \
                                x = (VF)(((VI)x & ok) | ((VI)neg_inf & ~ok));                 \
                            }                                                                 \
                            const VI g = x > m[v];                                            \
                            m[v] = (VF)(((VI)x & g) | ((VI)m[v] & ~g));                       \
                            KX_STORE(VF, p + (j + u) * QB + v * LANES, x);                    \
                        }                                                                     \
                    }                                                                         \
                }                                                                             \
                /* exp(x - max) in place, and each lane's sum (by blocks of ATTENTION_BLOCK positions) */ \
                VF sum[NVQ];                                                                  \
                for (int v = 0; v < NVQ; v++) sum[v] = zero;                                  \
                for (Py_ssize_t j0 = 0; j0 < Lv; j0 += ATTENTION_BLOCK) {                     \
                    const Py_ssize_t j1 = j0 + ATTENTION_BLOCK < Lv ? j0 + ATTENTION_BLOCK : Lv; \
                    VF part[NVQ];                                                             \
                    for (int v = 0; v < NVQ; v++) part[v] = zero;                             \
                    for (Py_ssize_t j = j0; j < j1; j++)                                      \
                        for (int v = 0; v < NVQ; v++) {                                       \
                            const VF e = KX_EXPF_NONPOS_V(VF, VI, KX_LOAD(VF, p + j * QB + v * LANES) - m[v]); \
                            KX_STORE(VF, p + j * QB + v * LANES, e);                          \
                            part[v] += e;                                                     \
                        }                                                                     \
                    for (int v = 0; v < NVQ; v++) sum[v] += part[v];                          \
                }                                                                             \
                /* the probabilities (times 1 / sum: within 1 ulp of the token form's division), before the mix: mixed \
                   unnormalised, values near the float32 maximum would overflow where the token form's stay finite */ \
                VF r[NVQ];                                                                    \
                for (int v = 0; v < NVQ; v++) r[v] = 1.0f / sum[v];                           \
                for (Py_ssize_t j = 0; j < Lv; j++)                                           \
                    for (int v = 0; v < NVQ; v++)                                             \
                        KX_STORE(VF, p + j * QB + v * LANES, KX_LOAD(VF, p + j * QB + v * LANES) * r[v]); \
                /* the mix: R queries (lanes i0 .. i0 + R - 1 of p; QB is a multiple of R, those past nq not written) \
                   x CV value vectors, then one vector, then single columns */                \
                for (Py_ssize_t i0 = 0; i0 < nq; i0 += R) {                                   \
                    const Py_ssize_t common = first + i0 + 1, /* positions all R queries see */ \
                        own = first + i0 + R < Lv ? first + i0 + R : Lv;                      \
                    Py_ssize_t c = 0;                                                         \
                    for (; c + CV * LANES <= dv; c += CV * LANES)                             \
                        ATTENTION_MIX_TILE(CV, LANES);                                        \
                    if (CV > 1)                                                               \
                        for (; c + LANES <= dv; c += LANES)                                   \
                            ATTENTION_MIX_TILE(1, LANES);                                     \
                    for (; c < dv; c++)                                                       \
                        for (Py_ssize_t i = i0; i < i0 + R && i < nq; i++) {                  \
                            float o = 0.0f;                                                   \
                            for (Py_ssize_t j0 = 0; j0 <= first + i; j0 += ATTENTION_BLOCK) { \
                                float part = 0.0f;                                            \
                                for (Py_ssize_t j = j0; j < j0 + ATTENTION_BLOCK && j <= first + i; j++) \
                                    part += p[j * QB + i] * V[j * dv + c];                    \
                                o += part;                                                    \
                            }                                                                 \
                            out[((a + i) * nh + h) * dv + c] = o;                             \
                        }                                                                     \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

/* ATTENTION_BODY's mix of queries i0 .. i0 + R - 1 over value columns c .. c + CVN LANES - 1: the positions all of
   them see, then each query's own positions in the chunk (query i0 + r sees first + i0 + r and before), summed by
   blocks of ATTENTION_BLOCK positions, each block's sums added to the total (one float32 sum over every position
   drifted with the cache's length: 5.5e-5 at 7,936 cached against the token form's 3.7e-6). */
#define ATTENTION_MIX_TILE(CVN, LANES)                                                \
    do {                                                                                      \
        VF tot[R][CVN];                                                                       \
        for (int r_ = 0; r_ < R; r_++)                                                        \
            for (int w_ = 0; w_ < (CVN); w_++) tot[r_][w_] = zero;                            \
        for (Py_ssize_t j0 = 0; j0 < own; j0 += ATTENTION_BLOCK) {                            \
            const Py_ssize_t j1 = j0 + ATTENTION_BLOCK < own ? j0 + ATTENTION_BLOCK : own,    \
                             jc = j1 < common ? j1 : common;                                  \
            VF acc[R][CVN];                                                                   \
            for (int r_ = 0; r_ < R; r_++)                                                    \
                for (int w_ = 0; w_ < (CVN); w_++) acc[r_][w_] = zero;                        \
            for (Py_ssize_t j = j0; j < jc; j++) {                                            \
                VF vv[CVN];                                                                   \
                for (int w_ = 0; w_ < (CVN); w_++) vv[w_] = KX_LOAD(VF, V + j * dv + c + w_ * LANES); \
                for (int r_ = 0; r_ < R; r_++) {                                              \
                    const float pr = p[j * QB + i0 + r_];                                     \
                    for (int w_ = 0; w_ < (CVN); w_++) acc[r_][w_] += vv[w_] * pr;            \
                }                                                                             \
            }                                                                                 \
            for (Py_ssize_t j = jc > j0 ? jc : j0; j < j1; j++)                               \
                for (int r_ = 0; r_ < R; r_++)                                                \
                    if (j <= first + i0 + r_)                                                 \
                        for (int w_ = 0; w_ < (CVN); w_++)                                    \
                            acc[r_][w_] += KX_LOAD(VF, V + j * dv + c + w_ * LANES) * p[j * QB + i0 + r_]; \
            for (int r_ = 0; r_ < R; r_++)                                                    \
                for (int w_ = 0; w_ < (CVN); w_++) tot[r_][w_] += acc[r_][w_];                \
        }                                                                                     \
        for (int r_ = 0; r_ < R && i0 + r_ < nq; r_++)                                        \
            for (int w_ = 0; w_ < (CVN); w_++)                                                \
                KX_STORE(VF, out + ((a + i0 + r_) * nh + h) * dv + c + w_ * LANES, tot[r_][w_]); \
    } while (0)

/* Out^T [ncols, NV LANES] = W [ncols, K] x^T, x^T [K, NV LANES] (rows in vector lanes, NV vectors of them): CB columns
   per pass over K (NV CB accumulators: 8, enough for the FMA units), then one at a time; each column's sum over k
   ascending, in every lane. */
#define KX_ROWS_GEMM(VF, LANES, NV, CB, xt, W, K, ncols, outT)                                \
    do {                                                                                      \
        const VF zero_ = {0.0f};                                                              \
        Py_ssize_t c_ = 0;                                                                    \
        for (; c_ + (CB) <= (ncols); c_ += (CB)) {                                            \
            VF acc_[CB][NV];                                                                  \
            for (int u_ = 0; u_ < (CB); u_++)                                                 \
                for (int v_ = 0; v_ < (NV); v_++) acc_[u_][v_] = zero_;                       \
            const float *restrict w_ = (W) + c_ * (K);                                        \
            for (Py_ssize_t k_ = 0; k_ < (K); k_++) {                                         \
                VF x_[NV];                                                                    \
                for (int v_ = 0; v_ < (NV); v_++) x_[v_] = KX_LOAD(VF, (xt) + (k_ * (NV) + v_) * LANES); \
                for (int u_ = 0; u_ < (CB); u_++) {                                           \
                    const float wk_ = w_[u_ * (K) + k_];                                      \
                    for (int v_ = 0; v_ < (NV); v_++) acc_[u_][v_] += x_[v_] * wk_;           \
                }                                                                             \
            }                                                                                 \
            for (int u_ = 0; u_ < (CB); u_++)                                                 \
                for (int v_ = 0; v_ < (NV); v_++)                                             \
                    KX_STORE(VF, (outT) + ((c_ + u_) * (NV) + v_) * LANES, acc_[u_][v_]);     \
        }                                                                                     \
        for (; c_ < (ncols); c_++) {                                                          \
            VF acc_[NV];                                                                      \
            for (int v_ = 0; v_ < (NV); v_++) acc_[v_] = zero_;                               \
            const float *restrict w_ = (W) + c_ * (K);                                        \
            for (Py_ssize_t k_ = 0; k_ < (K); k_++)                                           \
                for (int v_ = 0; v_ < (NV); v_++)                                             \
                    acc_[v_] += KX_LOAD(VF, (xt) + (k_ * (NV) + v_) * LANES) * w_[k_];        \
            for (int v_ = 0; v_ < (NV); v_++) KX_STORE(VF, (outT) + (c_ * (NV) + v_) * LANES, acc_[v_]); \
        }                                                                                     \
    } while (0)

/* One block of nr <= QB = NV LANES selections r0 .. r0 + nr - 1 of expert e (EXPERTS_BODY), one per lane: the latents
   gathered transposed [l, QB] (lanes past nr 0), the up projection [2I, QB], the SiTU-GLU of each (gate, up) pair
   [I, QB] (kx_situ; where every up of the block is small, ALL_SMALL_BODY's test, the up's tanh by its small branch
   alone, as the row kernel `situ` does: the same values), the down projection [l, QB], the rows of y written back. */
#define KX_EXPERT_BLOCK(VF, LANES, NV, CB)                                                    \
    do {                                                                                      \
        enum { QB_ = (NV) * LANES };                                                          \
        for (Py_ssize_t i = 0; i < QB_; i++) {                                                \
            const float *restrict zr = z + rows[r0 + (i < nr ? i : 0)] * l;                   \
            for (Py_ssize_t k = 0; k < l; k++) zt[k * QB_ + i] = i < nr ? zr[k] : 0.0f;       \
        }                                                                                     \
        KX_ROWS_GEMM(VF, LANES, NV, CB, zt, W13, l, 2 * I, ht);                               \
        const float *restrict up = ht + I * QB_;                                              \
        int big = !has_lb;                                                                    \
        for (Py_ssize_t j = 0; j < I * QB_; j++) {                                            \
            const float x = up[j] * inv_lb;                                                   \
            big |= !((x < 0.0f ? -x : x) < 0.625f);                                           \
        }                                                                                     \
        if (big)                                                                              \
            for (Py_ssize_t j = 0; j < I * QB_; j++) at[j] = kx_situ(ht[j], up[j], inv_b, inv_lb, c, has_lb); \
        else                                                                                  \
            for (Py_ssize_t j = 0; j < I * QB_; j++) {                                        \
                const float a = kx_tanhf(ht[j] * inv_b) / kx_one_plus_expf(-ht[j]);           \
                at[j] = a * kx_tanhf_small(up[j] * inv_lb) * c;                               \
            }                                                                                 \
        KX_ROWS_GEMM(VF, LANES, NV, CB, at, W2, I, l, yt);                                    \
        for (Py_ssize_t i = 0; i < nr; i++) {                                                 \
            float *restrict yr = y + (r0 + i) * l;                                            \
            for (Py_ssize_t k = 0; k < l; k++) yr[k] = yt[k * QB_ + i];                       \
        }                                                                                     \
    } while (0)

/* The routed experts of a chunk, dense float32 (the sequence path's `DenseExperts.outputs_grouped`): the selections
   sorted by expert, rows[i] the token of selection i, expert e's selections bounds[g] .. bounds[g + 1] - 1 for
   e = experts[g]; y[i] = w2_e SiTU-GLU(w13_e z[rows[i]]) (w13 [E, 2I, l] gate rows then up rows, w2 [E, l, I]).
   2 LANES selections at a time (a last block of at most LANES: one vector of them), one per vector lane
   (KX_EXPERT_BLOCK), each product register-blocked with every step vertical (KX_ROWS_GEMM). The products' sums run
   over k ascending, BLAS's in some other order: float32 rounding apart from the matmul route; the SiTU-GLU's values
   are the row kernel's. */
#define EXPERTS_BODY(LANES)                                                                   \
    {                                                                                         \
        typedef kx_v##LANES##f VF;                                                            \
        for (Py_ssize_t g = 0; g < m; g++) {                                                  \
            const Py_ssize_t e = experts[g];                                                  \
            const float *restrict W13 = w13 + e * 2 * I * l, *restrict W2 = w2 + e * l * I;   \
            for (Py_ssize_t r0 = bounds[g]; r0 < bounds[g + 1]; r0 += 2 * LANES) {            \
                const Py_ssize_t nr = bounds[g + 1] - r0 < 2 * LANES ? bounds[g + 1] - r0 : 2 * LANES; \
                if (nr > LANES)                                                               \
                    KX_EXPERT_BLOCK(VF, LANES, 2, 4);                                         \
                else                                                                          \
                    KX_EXPERT_BLOCK(VF, LANES, 1, 8);                                         \
            }                                                                                 \
        }                                                                                     \
    }

/* Top-k of rows with their softmax probabilities (the recorder's predictions, `topk.top_predictions`): x [R, V] ->
   ids [R, k] by value descending, ties by the lower id, NaN after every number (NumPy's stable argsort of -x), and
   probs [R, k] = exp(x[id] - x[ids[0]]) / sum_j exp(x[j] - x[ids[0]]) (a NaN anywhere in the row, or a top value
   of +-inf, makes them NaN, as NumPy's formula does).
   The k best are kept in order, positions taken in index order, each entering only by beating the k-th (a later
   equal value never does). Where k <= 2 LANES (`top_rows` asks for k <= 16 only: the kept list's shifts grow with
   k), a bound first: each of 2 LANES lanes' max over the row's full blocks (NaN never wins), and t0 the k-th largest
   of those maxima (by counting, not sorting them: an insertion sort of 32 made the kernel 3x slower than NumPy); k of
   the row's values reach t0, so the top k do, and only values >= t0 are looked at (~11 of the embedded model's 256;
   an ascending row: k). NaN ids fill what numbers leave empty, in index order. The exps are summed in LANES lanes of double (in float32 a K3 vocabulary's 163,840 drifted ~1e-6). */
#define KX_TOPK_PUT(v, j)                                                                     \
    do {                                                                                      \
        Py_ssize_t p_ = n < k ? n++ : k - 1;                                                  \
        for (; p_ > 0 && KX_BEATS((v), best[p_ - 1]); p_--) {                                 \
            best[p_] = best[p_ - 1];                                                          \
            id[p_] = id[p_ - 1];                                                              \
        }                                                                                     \
        best[p_] = (v);                                                                       \
        id[p_] = (j);                                                                         \
    } while (0)

#define TOPK_BODY(LANES)                                                                      \
    {                                                                                         \
        typedef kx_v##LANES##f VF;                                                            \
        typedef kx_v##LANES##i VI;                                                            \
        for (Py_ssize_t r = 0; r < R; r++) {                                                  \
            const float *restrict x = X + r * V;                                              \
            int64_t *restrict id = ids + r * k;                                               \
            float *restrict best = probs + r * k; /* the values kept, until the probabilities */ \
            Py_ssize_t n = 0;                                                                 \
            float t0 = -INFINITY;                                                             \
            if (k <= 2 * LANES && V >= 2 * LANES) {                                           \
                const VF none = (VF){0.0f} - INFINITY;                                        \
                VF mx0 = none, mx1 = none;                                                    \
                for (Py_ssize_t j = 0; j + 2 * LANES <= V; j += 2 * LANES) {                  \
                    const VF v0 = KX_LOAD(VF, x + j), v1 = KX_LOAD(VF, x + j + LANES);        \
                    const VI g0 = v0 > mx0, g1 = v1 > mx1;                                    \
                    mx0 = (VF)(((VI)v0 & g0) | ((VI)mx0 & ~g0));                              \
                    mx1 = (VF)(((VI)v1 & g1) | ((VI)mx1 & ~g1));                              \
                }                                                                             \
                float lane[2 * LANES];                                                        \
                KX_STORE(VF, lane, mx0);                                                      \
                KX_STORE(VF, lane + LANES, mx1);                                              \
                t0 = INFINITY; /* the k-th largest: the least of the maxima with fewer than k above them */ \
                for (int i = 0; i < 2 * LANES; i++) {                                         \
                    int above = 0;                                                            \
                    for (int q = 0; q < 2 * LANES; q++) above += lane[q] > lane[i];           \
                    t0 = above < k && lane[i] < t0 ? lane[i] : t0;                            \
                }                                                                             \
            }                                                                                 \
            for (Py_ssize_t j = 0; j < V; j++)                                                \
                if (x[j] >= t0 && (n < k || KX_BEATS(x[j], best[k - 1]))) KX_TOPK_PUT(x[j], j); \
            for (Py_ssize_t j = 0; j < V && n < k; j++) /* fewer than k numbers: NaN next */  \
                if (x[j] != x[j]) KX_TOPK_PUT(x[j], j);                                       \
            const float m = best[0];                                                          \
            double part[LANES] = {0.0};                                                       \
            Py_ssize_t j = 0;                                                                 \
            for (; j + LANES <= V; j += LANES)                                                \
                for (int i = 0; i < LANES; i++) part[i] += (double)kx_expf(x[j + i] - m);     \
            double sum = 0.0;                                                                 \
            for (; j < V; j++) sum += (double)kx_expf(x[j] - m);                              \
            for (int i = 0; i < LANES; i++) sum += part[i];                                   \
            for (Py_ssize_t i = 0; i < k; i++) best[i] = (float)((double)kx_expf(best[i] - m) / sum); \
        }                                                                                     \
    }

/* a ranks before b: a number above b, or any number before NaN */
#define KX_BEATS(a, b) ((a) == (a) && ((b) != (b) || (a) > (b)))

#define DEFINE_KERNELS(suffix, attr, lanes, fused)                                                                 \
    attr static void map_##suffix(float *restrict a, Py_ssize_t n, int what) MAP_BODY                          \
    attr static void situ_##suffix(const float *restrict gu, float *restrict out, Py_ssize_t rows, Py_ssize_t n, \
                                   float inv_b, float inv_lb, float c, int has_lb) SITU_BODY                  \
    attr static void situ_small_up_##suffix(const float *restrict g, const float *restrict u, float *restrict o,   \
                                            Py_ssize_t n, float inv_b, float inv_lb, float c) SITU_SMALL_UP_BODY \
    attr static int all_small_##suffix(const float *restrict u, Py_ssize_t n, float inv) ALL_SMALL_BODY         \
    attr static void softmax_##suffix(float *restrict S, Py_ssize_t rows, Py_ssize_t L, Py_ssize_t T,           \
                                      Py_ssize_t L0, float scale) SOFTMAX_BODY(lanes)                             \
    attr static void conv_##suffix(const float *restrict head, const float *restrict y, Py_ssize_t ys,           \
                                   const float *restrict taps, float *restrict out, float *restrict window,     \
                                   float *restrict norms, float *restrict sq, Py_ssize_t T, Py_ssize_t W,       \
                                   Py_ssize_t C, Py_ssize_t K) CONV_BODY(lanes, fused)                          \
    attr static void decay_##suffix(float *restrict g, float *restrict alpha, const float *restrict dt,         \
                                    const float *restrict A, float lb, Py_ssize_t rows, Py_ssize_t P) DECAY_BODY \
    attr static void l2_##suffix(const float *restrict qkv, const float *restrict scale, float eps,              \
                                 float *restrict out, Py_ssize_t T, Py_ssize_t H, Py_ssize_t K) L2_BODY(lanes)   \
    attr static void gated_norm_##suffix(const float *restrict o, const float *restrict gate,                   \
                                         const float *restrict gain, float eps, float *restrict out,            \
                                         Py_ssize_t rows, Py_ssize_t V) GATED_NORM_BODY(lanes)                \
    attr static void scores_##suffix(const float *restrict rows, const float *restrict w, float *restrict s,     \
                                     Py_ssize_t T, Py_ssize_t S, Py_ssize_t m, Py_ssize_t d) SCORES_BODY(lanes)   \
    attr static void mix_##suffix(const float *restrict rows, const float *restrict p, float *restrict out,      \
                                  Py_ssize_t T, Py_ssize_t S, Py_ssize_t m, Py_ssize_t d) MIX_BODY                                                          \
    attr static void attention_##suffix(const float *restrict q, const float *restrict keys,                    \
                                        const float *restrict values, float *restrict out, float *restrict qt,  \
                                        float *restrict p, Py_ssize_t T, Py_ssize_t nh, Py_ssize_t dq,           \
                                        Py_ssize_t dv, Py_ssize_t cap, Py_ssize_t L0, float scale) ATTENTION_BODY(lanes) \
    attr static void experts_##suffix(const float *restrict z, const int64_t *restrict rows,                      \
                                      const int64_t *restrict bounds, const int64_t *restrict experts, Py_ssize_t m, \
                                      const float *restrict w13, const float *restrict w2, float *restrict y,      \
                                      float *restrict zt, float *restrict ht, float *restrict at, float *restrict yt, \
                                      Py_ssize_t l, Py_ssize_t I, float inv_b, float inv_lb, float c, int has_lb)   \
        EXPERTS_BODY(lanes)                                                                                      \
    attr static void topk_##suffix(const float *restrict X, int64_t *restrict ids, float *restrict probs, Py_ssize_t R, \
                                   Py_ssize_t V, Py_ssize_t k) TOPK_BODY(lanes)

DEFINE_KERNELS(portable, , 8, 0)
#ifdef KX_X86
DEFINE_KERNELS(avx2, __attribute__((target("avx2,fma"))), 8, 1)
DEFINE_KERNELS(avx512, __attribute__((target("avx512f"))), 16, 1)
#define PICK(name, isa) ((isa) == 2 ? name##_avx512 : (isa) == 1 ? name##_avx2 : name##_portable)
#else
#define PICK(name, isa) name##_portable
#endif

/* A binding's kernel call (statements), with the GIL released; the binding then returns None. */
#define RUN_WITHOUT_GIL(...)                                                                  \
    do {                                                                                      \
        Py_BEGIN_ALLOW_THREADS __VA_ARGS__;                                                   \
        Py_END_ALLOW_THREADS                                                                  \
        result = Py_None;                                                                     \
        Py_INCREF(result);                                                                    \
    } while (0)

static int get_isa(const char *name) {
    int isa = isa_index(name);
    if (isa < 0) PyErr_SetString(PyExc_ValueError, "isa: not one of isas() on this CPU");
    return isa;
}

PyDoc_STRVAR(map_doc, "map(a, what, isa)\n\na: writable C-contiguous float32 buffer, in place: what 0 exp, 1 sigmoid, 2 SiLU.");

static PyObject *map(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer a;
    int what;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "w*is", &a, &what, &isa_name)) return NULL;
    PyObject *result = NULL;
    int isa = get_isa(isa_name);
    if (isa >= 0 && (what < 0 || what > 2)) PyErr_SetString(PyExc_ValueError, "what: 0 (exp), 1 (sigmoid) or 2 (SiLU)");
    else if (isa >= 0 && a.len % 4) PyErr_SetString(PyExc_ValueError, "a: expected float32");
    else if (isa >= 0)
        RUN_WITHOUT_GIL(PICK(map, isa)(a.buf, a.len / 4, what));
    PyBuffer_Release(&a);
    return result;
}

PyDoc_STRVAR(map_cols_doc, "map_cols(src, out, col, rows, n, what, isa)\n\n"
                           "src float32 [rows, stride] and out [rows, n], C-contiguous: out = map's what of src[:, col:col + n], "
                           "row by row (each copied, then mapped in place while in cache: map's values).");

static PyObject *map_cols(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src, out;
    Py_ssize_t col, rows, n;
    int what;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*w*nnnis", &src, &out, &col, &rows, &n, &what, &isa_name)) return NULL;
    PyObject *result = NULL;
    int isa = get_isa(isa_name);
    const Py_ssize_t stride = rows > 0 ? src.len / 4 / rows : 0;
    if (isa >= 0 && (what < 0 || what > 2)) PyErr_SetString(PyExc_ValueError, "what: 0 (exp), 1 (sigmoid) or 2 (SiLU)");
    else if (isa >= 0 && (rows < 0 || n < 0 || col < 0 || out.len != 4 * rows * n ||
                          (rows > 0 && (src.len != 4 * rows * stride || col + n > stride))))
        PyErr_SetString(PyExc_ValueError, "map_cols: expected src float32 [rows, stride >= col + n], out [rows, n]");
    else if (isa >= 0) {
        void (*run)(float *, Py_ssize_t, int) = PICK(map, isa);
        RUN_WITHOUT_GIL(for (Py_ssize_t r = 0; r < rows; r++) {
            float *o = (float *)out.buf + r * n;
            memcpy(o, (const float *)src.buf + r * stride + col, 4 * n);
            run(o, n, what);
        });
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(situ_doc, "situ(gu, out, rows, n, inv_b, inv_lb, c, has_lb, isa)\n\n"
                       "gu float32 [rows, 2n] and out float32 [rows, n], C-contiguous.");

static PyObject *situ(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer gu, out;
    Py_ssize_t rows, n;
    float inv_b, inv_lb, c;
    int has_lb;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*w*nnfffps", &gu, &out, &rows, &n, &inv_b, &inv_lb, &c, &has_lb, &isa_name)) return NULL;
    PyObject *result = NULL;
    int isa = get_isa(isa_name);
    if (isa >= 0 && (rows < 0 || n < 0 || gu.len != 8 * rows * n || out.len != 4 * rows * n))
        PyErr_SetString(PyExc_ValueError, "situ: expected gu float32 [rows, 2n] and out float32 [rows, n]");
    else if (isa >= 0) {
        void (*run)(const float *, float *, Py_ssize_t, Py_ssize_t, float, float, float, int) = PICK(situ, isa);
        void (*run_small)(const float *, const float *, float *, Py_ssize_t, float, float, float) = PICK(situ_small_up, isa);
        int (*small)(const float *, Py_ssize_t, float) = PICK(all_small, isa);
        /* row by row: where every up's tanh takes its small branch, the kernel that skips the other branch;
           else the general one (its own code: the same bits, a NaN's payload included) */
        RUN_WITHOUT_GIL(for (Py_ssize_t r = 0; r < rows; r++) {
            const float *g = (const float *)gu.buf + r * 2 * n;
            float *o = (float *)out.buf + r * n;
            if (has_lb && small(g + n, n, inv_lb))
                run_small(g, g + n, o, n, inv_b, inv_lb, c);
            else
                run(g, o, 1, n, inv_b, inv_lb, c, has_lb);
        });
    }
    PyBuffer_Release(&gu);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(softmax_doc, "causal_softmax(s, rows, L, T, L0, scale, isa)\n\n"
                          "s: writable C-contiguous float32 [rows, L], in place; row i sees positions 0 .. L0 + i % T.");

static PyObject *causal_softmax(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer s;
    Py_ssize_t rows, L, T, L0;
    float scale;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "w*nnnnfs", &s, &rows, &L, &T, &L0, &scale, &isa_name)) return NULL;
    PyObject *result = NULL;
    int isa = get_isa(isa_name);
    if (isa >= 0 && (rows < 0 || L < 1 || T < 1 || L0 < 0 || s.len != 4 * rows * L))
        PyErr_SetString(PyExc_ValueError, "causal_softmax: expected s float32 [rows, L], T >= 1, L0 >= 0");
    else if (isa >= 0)
        RUN_WITHOUT_GIL(PICK(softmax, isa)(s.buf, rows, L, T, L0, scale));
    PyBuffer_Release(&s);
    return result;
}

PyDoc_STRVAR(attention_doc, "causal_attention(q, keys, values, out, T, nh, dq, dv, cap, L0, scale, isa)\n\n"
                            "q float32 [T, nh, dq], keys [nh, cap, dq], values [nh, cap, dv], out (written) [T, nh, dv], "
                            "all C-contiguous; query t sees positions 0 .. L0 + t (L0 + T <= cap).");

static PyObject *causal_attention(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer q, keys, values, out;
    Py_ssize_t T, nh, dq, dv, cap, L0;
    float scale;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnnnnnfs", &q, &keys, &values, &out, &T, &nh, &dq, &dv, &cap, &L0, &scale,
                          &isa_name))
        return NULL;
    PyObject *result = NULL;
    int isa = get_isa(isa_name);
    if (isa >= 0 && (T < 1 || nh < 1 || dq < 1 || dv < 1 || L0 < 0 || L0 + T > cap || q.len != 4 * T * nh * dq ||
                     keys.len != 4 * nh * cap * dq || values.len != 4 * nh * cap * dv || out.len != 4 * T * nh * dv))
        PyErr_SetString(PyExc_ValueError, "causal_attention: expected q float32 [T, nh, dq], keys [nh, cap, dq], values "
                                          "[nh, cap, dv], out [T, nh, dv], T >= 1, L0 + T <= cap");
    else if (isa >= 0) {
        /* scratch: the block's queries [dq, 32] and its scores [L0 + T, 32] (32: the widest block) */
        float *qt = PyMem_RawMalloc(sizeof(float) * 32 * (size_t)dq), *p = PyMem_RawMalloc(sizeof(float) * 32 * (size_t)(L0 + T));
        if (qt == NULL || p == NULL)
            PyErr_NoMemory();
        else
            RUN_WITHOUT_GIL(PICK(attention, isa)(q.buf, keys.buf, values.buf, out.buf, qt, p, T, nh, dq, dv, cap, L0, scale));
        PyMem_RawFree(qt);
        PyMem_RawFree(p);
    }
    PyBuffer_Release(&q);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&values);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(experts_doc, "experts(z, rows, bounds, experts, w13, w2, y, T, l, I, E, inv_b, inv_lb, c, has_lb, isa)\n\n"
                          "z float32 [T, l]; rows int64 [n] (tokens, sorted by expert), bounds int64 [m + 1], experts int64 [m]; "
                          "w13 float32 [E, 2I, l], w2 [E, l, I]; y (written) [n, l]; all C-contiguous.");

static PyObject *experts(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer z, rows, bounds, ex, w13, w2, y;
    Py_ssize_t T, l, I, E;
    float inv_b, inv_lb, c;
    int has_lb;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*w*nnnnfffps", &z, &rows, &bounds, &ex, &w13, &w2, &y, &T, &l, &I, &E, &inv_b,
                          &inv_lb, &c, &has_lb, &isa_name))
        return NULL;
    PyObject *result = NULL;
    int isa = get_isa(isa_name);
    const Py_ssize_t n = rows.len / 8, m = ex.len / 8;
    int ok = isa >= 0 && T >= 0 && l >= 1 && I >= 1 && E >= 1 && rows.len % 8 == 0 && ex.len % 8 == 0 &&
             bounds.len == 8 * (m + 1) && z.len == 4 * T * l && w13.len == 4 * E * 2 * I * l && w2.len == 4 * E * l * I &&
             y.len == 4 * n * l;
    if (ok) { /* every index in range (a wrong one would read outside the buffers) */
        const int64_t *r = rows.buf, *b = bounds.buf, *e = ex.buf;
        ok = b[0] == 0 && b[m] == n;
        for (Py_ssize_t i = 0; ok && i < n; i++) ok = r[i] >= 0 && r[i] < T;
        for (Py_ssize_t g = 0; ok && g < m; g++) ok = e[g] >= 0 && e[g] < E && b[g] <= b[g + 1];
    }
    if (isa >= 0 && !ok)
        PyErr_SetString(PyExc_ValueError, "experts: expected z float32 [T, l], rows int64 [n] in 0..T-1, bounds int64 [m + 1] "
                                          "from 0 to n, experts int64 [m] in 0..E-1, w13 [E, 2I, l], w2 [E, l, I], y [n, l]");
    else if (isa >= 0) {
        /* scratch, 32 rows (the widest block): latents [l, 32], up projection [2I, 32], SiTU [I, 32], down [l, 32] */
        float *buf = PyMem_RawMalloc(sizeof(float) * 32 * (size_t)(2 * l + 3 * I));
        if (buf == NULL)
            PyErr_NoMemory();
        else
            RUN_WITHOUT_GIL(PICK(experts, isa)(z.buf, rows.buf, bounds.buf, ex.buf, m, w13.buf, w2.buf, y.buf, buf,
                                               buf + 32 * l, buf + 32 * (l + 2 * I), buf + 32 * (l + 3 * I), l, I, inv_b,
                                               inv_lb, c, has_lb));
        PyMem_RawFree(buf);
    }
    Py_buffer *all[] = {&z, &rows, &bounds, &ex, &w13, &w2, &y};
    for (int i = 0; i < 7; i++) PyBuffer_Release(all[i]);
    return result;
}

PyDoc_STRVAR(top_rows_doc, "top_rows(x, ids, probs, R, V, k, isa)\n\n"
                           "x float32 [R, V]; ids (written) int64 [R, k], probs (written) float32 [R, k]; C-contiguous, 1 <= k <= V.");

static PyObject *top_rows(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer x, ids, probs;
    Py_ssize_t R, V, k;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*w*w*nnns", &x, &ids, &probs, &R, &V, &k, &isa_name)) return NULL;
    PyObject *result = NULL;
    int isa = get_isa(isa_name);
    if (isa >= 0 && (R < 0 || k < 1 || k > V || x.len != 4 * R * V || ids.len != 8 * R * k || probs.len != 4 * R * k))
        PyErr_SetString(PyExc_ValueError, "top_rows: expected x float32 [R, V], ids int64 [R, k], probs float32 [R, k], "
                                          "1 <= k <= V");
    else if (isa >= 0)
        RUN_WITHOUT_GIL(PICK(topk, isa)(x.buf, ids.buf, probs.buf, R, V, k));
    PyBuffer_Release(&x);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&probs);
    return result;
}

PyDoc_STRVAR(conv_doc, "kda_conv(head, y, taps, out, window, norms, T, W, C, ys, K, isa)\n\n"
                       "head float32 [W, C] (the stored window rows, oldest first), y [T, ys] (the chunk's rows: their first C "
                       "columns), taps [W, C], out (written) [T, C], window [C, W] (in place: advanced by the chunk), norms "
                       "(written where K > 0) [T, C / K], all C-contiguous.");

static PyObject *kda_conv(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer head, y, taps, out, window, norms;
    Py_ssize_t T, W, C, ys, K;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*w*nnnnns", &head, &y, &taps, &out, &window, &norms, &T, &W, &C, &ys, &K,
                          &isa_name))
        return NULL;
    PyObject *result = NULL;
    int isa = get_isa(isa_name);
    float *sq = NULL;
    if (isa >= 0 && (T < 0 || W < 1 || C < 0 || ys < C || K < 0 || (K > 0 && C % K) || head.len != 4 * W * C ||
                     y.len != 4 * T * ys || taps.len != 4 * W * C || out.len != 4 * T * C || window.len != 4 * C * W ||
                     norms.len != (K > 0 ? 4 * T * (C / K) : 0)))
        PyErr_SetString(PyExc_ValueError, "kda_conv: expected head float32 [W, C], y [T, ys >= C], taps [W, C], out [T, C], "
                                          "window [C, W], norms [T, C / K] (K > 0) or empty");
    else if (isa >= 0 && K > 0 && !(sq = PyMem_RawMalloc(sizeof(float) * (W + T) * (C / K) + 1)))
        PyErr_NoMemory();
    else if (isa >= 0)
        RUN_WITHOUT_GIL(PICK(conv, isa)(head.buf, y.buf, ys, taps.buf, out.buf, window.buf, norms.buf, sq, T, W, C, K));
    PyMem_RawFree(sq);
    PyBuffer_Release(&head);
    PyBuffer_Release(&y);
    PyBuffer_Release(&taps);
    PyBuffer_Release(&out);
    PyBuffer_Release(&window);
    PyBuffer_Release(&norms);
    return result;
}

PyDoc_STRVAR(decay_doc, "kda_decay(g, alpha, dt_bias, A, lower_bound, rows, P, isa)\n\n"
                        "g float32 [rows, P] (f_b_proj's output; in place: log alpha), alpha [rows, P] (written), dt_bias and "
                        "A [P], C-contiguous: g = lower_bound sigmoid((g + dt_bias) A), alpha = exp(g).");

static PyObject *kda_decay(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer g, alpha, dt, A;
    Py_ssize_t rows, P;
    float lb;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "w*w*y*y*fnns", &g, &alpha, &dt, &A, &lb, &rows, &P, &isa_name)) return NULL;
    PyObject *result = NULL;
    int isa = get_isa(isa_name);
    if (isa >= 0 && (rows < 0 || P < 0 || g.len != 4 * rows * P || alpha.len != g.len || dt.len != 4 * P || A.len != 4 * P))
        PyErr_SetString(PyExc_ValueError, "kda_decay: expected g, alpha float32 [rows, P], dt_bias and A [P]");
    else if (isa >= 0)
        RUN_WITHOUT_GIL(PICK(decay, isa)(g.buf, alpha.buf, dt.buf, A.buf, lb, rows, P));
    PyBuffer_Release(&g);
    PyBuffer_Release(&alpha);
    PyBuffer_Release(&dt);
    PyBuffer_Release(&A);
    return result;
}

PyDoc_STRVAR(l2_doc, "l2_scale_qk(qkv, scale, eps, out, T, H, K, isa)\n\n"
                     "qkv float32 [T, 3, H, K], scale [2H], out [2, T, H, K] (written: q, then k), C-contiguous: q's and k's rows "
                     "times scale / sqrt(sum of squares + eps).");

static PyObject *l2_scale_qk(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer qkv, scale, out;
    float eps;
    Py_ssize_t T, H, K;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*y*fw*nnns", &qkv, &scale, &eps, &out, &T, &H, &K, &isa_name)) return NULL;
    PyObject *result = NULL;
    int isa = get_isa(isa_name);
    if (isa >= 0 && (T < 0 || H < 0 || K < 0 || qkv.len != 12 * T * H * K || scale.len != 8 * H || out.len != 8 * T * H * K))
        PyErr_SetString(PyExc_ValueError, "l2_scale_qk: expected qkv float32 [T, 3, H, K], scale [2H], out [2, T, H, K]");
    else if (isa >= 0)
        RUN_WITHOUT_GIL(PICK(l2, isa)(qkv.buf, scale.buf, eps, out.buf, T, H, K));
    PyBuffer_Release(&qkv);
    PyBuffer_Release(&scale);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(gated_norm_doc, "gated_norm(o, gate, gain, eps, out, rows, V, isa)\n\n"
                             "o, gate, out float32 [rows, V] (out written), gain [V], C-contiguous: "
                             "out = o * (gain * gate) / sqrt(sum(o^2) + eps) per row.");

static PyObject *gated_norm(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer o, gate, gain, out;
    float eps;
    Py_ssize_t rows, V;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*y*y*fw*nns", &o, &gate, &gain, &eps, &out, &rows, &V, &isa_name)) return NULL;
    PyObject *result = NULL;
    int isa = get_isa(isa_name);
    if (isa >= 0 && (rows < 0 || V < 0 || o.len != 4 * rows * V || gate.len != o.len || out.len != o.len || gain.len != 4 * V))
        PyErr_SetString(PyExc_ValueError, "gated_norm: expected o, gate, out float32 [rows, V], gain [V]");
    else if (isa >= 0)
        RUN_WITHOUT_GIL(PICK(gated_norm, isa)(o.buf, gate.buf, gain.buf, eps, out.buf, rows, V));
    PyBuffer_Release(&o);
    PyBuffer_Release(&gate);
    PyBuffer_Release(&gain);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(sources_doc, "sources(rows, x, out, T, S, m, d, what, isa)\n\n"
                          "rows float32 [T, S, d] (the first m of each token's S used), C-contiguous; what 0 (scores): x [d], "
                          "out [T, m], out[t, i] = rows[t, i] . x; what 1 (mix): x [T, m], out [T, d], out[t] = "
                          "sum_i x[t, i] rows[t, i].");

static PyObject *sources(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer rows, x, out;
    Py_ssize_t T, S, m, d;
    int what;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*y*w*nnnnis", &rows, &x, &out, &T, &S, &m, &d, &what, &isa_name)) return NULL;
    PyObject *result = NULL;
    int isa = get_isa(isa_name);
    const int ok = T >= 0 && d >= 0 && m >= 1 && S >= m && rows.len == 4 * T * S * d &&
                   (what == 0 ? x.len == 4 * d && out.len == 4 * T * m : what == 1 && x.len == 4 * T * m && out.len == 4 * T * d);
    if (isa >= 0 && !ok)
        PyErr_SetString(PyExc_ValueError, "sources: expected rows float32 [T, S, d], 1 <= m <= S; scores: x [d], out [T, m]; "
                                          "mix: x [T, m], out [T, d]");
    else if (isa >= 0)
        RUN_WITHOUT_GIL((what == 0 ? PICK(scores, isa) : PICK(mix, isa))(rows.buf, x.buf, out.buf, T, S, m, d));
    PyBuffer_Release(&rows);
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(group_doc, "group(ids, order, experts, bounds) -> m\n\n"
                        "A chunk's selections grouped by expert (a counting sort, stable): ids int64 [n], each -1 (dropped) or "
                        "an expert 0 .. E - 1, with experts int64 [E] and bounds int64 [E + 1] (E >= 1), order int64 [n], "
                        "all C-contiguous. Writes order[:kept] (the selections sorted by expert, ascending within one; the "
                        "dropped left out), experts[:m] (the experts selected, ascending) and bounds[:m + 1] (their segments of "
                        "order); returns m, or -1 where an id is out of range (nothing meaningful written).");

static PyObject *group(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer ids, order, experts, bounds;
    if (!PyArg_ParseTuple(args, "y*w*w*w*", &ids, &order, &experts, &bounds)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = ids.len / 8, E = experts.len / 8;
    int64_t *count = NULL;
    if (ids.len % 8 || order.len != ids.len || E < 1 || experts.len % 8 || bounds.len != 8 * (E + 1))
        PyErr_SetString(PyExc_ValueError, "group: expected ids, order int64 [n], experts int64 [E >= 1], bounds [E + 1]");
    else if (!(count = PyMem_RawCalloc(E + 1, sizeof(int64_t))))
        PyErr_NoMemory();
    else {
        const int64_t *id = ids.buf;
        int64_t *o = order.buf, *ex = experts.buf, *b = bounds.buf;
        Py_ssize_t m = 0, bad = 0;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            const int64_t e = id[i];
            if (e < -1 || e >= E) bad = 1;
            else count[e + 1]++;
        }
        if (!bad) {
            int64_t at = 0; /* each expert's first slot in order; count[e + 1] becomes it */
            b[0] = 0;
            for (Py_ssize_t e = 0; e < E; e++) {
                const int64_t c = count[e + 1];
                count[e + 1] = at;
                if (c) {
                    ex[m] = e;
                    b[++m] = at + c;
                }
                at += c;
            }
            for (Py_ssize_t i = 0; i < n; i++)
                if (id[i] >= 0) o[count[id[i] + 1]++] = i;
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(bad ? -1 : m);
    }
    PyMem_RawFree(count);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&order);
    PyBuffer_Release(&experts);
    PyBuffer_Release(&bounds);
    return result;
}

static PyMethodDef methods[] = {
    {"kda_conv", kda_conv, METH_VARARGS, conv_doc},
    {"group", group, METH_VARARGS, group_doc},
    {"map", map, METH_VARARGS, map_doc},
    {"map_cols", map_cols, METH_VARARGS, map_cols_doc},
    {"situ", situ, METH_VARARGS, situ_doc},
    {"causal_softmax", causal_softmax, METH_VARARGS, softmax_doc},
    {"causal_attention", causal_attention, METH_VARARGS, attention_doc},
    {"experts", experts, METH_VARARGS, experts_doc},
    {"top_rows", top_rows, METH_VARARGS, top_rows_doc},
    {"kda_decay", kda_decay, METH_VARARGS, decay_doc},
    {"l2_scale_qk", l2_scale_qk, METH_VARARGS, l2_doc},
    {"gated_norm", gated_norm, METH_VARARGS, gated_norm_doc},
    {"sources", sources, METH_VARARGS, sources_doc},
    {"isas", isas, METH_NOARGS, "The kernels this CPU can run, best last."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_sequence_ops", .m_doc = "Element-wise kernels of the sequence path, compiled.",
    .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__sequence_ops(void) { return PyModule_Create(&module); }
