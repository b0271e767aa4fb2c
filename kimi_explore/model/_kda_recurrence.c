/* The gated delta rule token by token, every head, compiled (CPU, float32): the KDA sequence path's
   recurrent route (kda_recurrence.py).

   Per head h and token t, with S_h [K, V] (row kk = key channel):

       S[kk, :] *= alpha[t, h, kk];   u = sum_kk k[kk] S[kk, :]          (decay, read with the decayed state)
       w = beta[t, h] (v - u);        S[kk, :] += k[kk] w                 (write)
       o[t, h] = sum_kk q[kk] S[kk, :];  norm[t, h] = ||S||_F             (output from the updated state)

   the token form's order (`kda.delta_rule_update`, `delta_rule_read`). One pass over S_h per token:
   each row gets token t's write, read-out and square sum, then token t+1's decay and read. A head's
   state (64 KB at K3 width) stays in cache through all T tokens, so S crosses memory once per call.
   Only the float32 summation order differs from the token form's BLAS calls.

   The loops over V are written for the compiler's vectoriser; the same body is compiled for AVX-512F,
   AVX2+FMA and portable C (_kernel_isa.h picks at run time), and with V a multiple of 8 (the models' heads)
   it runs column-blocked with intrinsics: heads_avx2_cols, heads_avx512_cols where V is a multiple of 16
   (the same floats). The GIL is released; callers split the
   heads [h0, h1) over threads. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

#include "../weights/_kernel_isa.h"

typedef void (*heads_fn)(const float *q, const float *k, const float *v, const float *alpha, const float *beta, float *S,
                         float *o, float *norms, Py_ssize_t T, Py_ssize_t H, Py_ssize_t K, Py_ssize_t V, Py_ssize_t h0,
                         Py_ssize_t h1, float *scratch);

/* The sum of V floats in 8 lanes (lane i: x[i], x[i + 8], ... in order; the tail past a multiple of 8 in lane 0),
   the lanes then added as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)): one order for every ISA, whose vectoriser keeps each
   lane's chain (a single running sum was a chain of V dependent adds per token and head). */
__attribute__((always_inline)) static inline float sum_lanes(const float *restrict x, Py_ssize_t V) {
    float p[8] = {0.0f};
    Py_ssize_t j = 0;
    for (; j + 8 <= V; j += 8)
        for (int i = 0; i < 8; i++) p[i] += x[j + i];
    for (; j < V; j++) p[0] += x[j];
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

/* Token 0's decay and read of one head's state Sh [K, V]: rows scaled by a[r], u = sum_r k[r] Sh[r, :]. */
__attribute__((always_inline)) static inline void first_decay_read(float *restrict Sh, const float *restrict a,
        const float *restrict k, float *restrict u, Py_ssize_t K, Py_ssize_t V) {
    for (Py_ssize_t j = 0; j < V; j++) u[j] = 0.0f;
    for (Py_ssize_t r = 0; r < K; r++) {
        float *restrict row = Sh + r * V;
        for (Py_ssize_t j = 0; j < V; j++) {
            row[j] *= a[r];
            u[j] += k[r] * row[j];
        }
    }
}

/* scratch: 4 V floats (u | w | sums of squares per column | the next token's u). norms may be NULL.
   One pass over S_h per token: token t's write and read-out, then token t+1's decay and read. */
__attribute__((always_inline)) static inline void heads_body(const float *restrict q, const float *restrict k,
        const float *restrict v, const float *restrict alpha, const float *restrict beta, float *restrict S,
        float *restrict o, float *restrict norms, Py_ssize_t T, Py_ssize_t H, Py_ssize_t K, Py_ssize_t V, Py_ssize_t h0,
        Py_ssize_t h1, float *restrict scratch) {
    float *restrict u = scratch, *restrict w = scratch + V, *restrict sq = scratch + 2 * V, *restrict un = scratch + 3 * V;
    for (Py_ssize_t h = h0; h < h1 && T > 0; h++) {
        float *restrict Sh = S + h * K * V;
        first_decay_read(Sh, alpha + h * K, k + h * K, u, K, V);
        for (Py_ssize_t t = 0; t < T; t++) {
            const Py_ssize_t at = (t * H + h) * K, nx = ((t + 1) * H + h) * K;
            const float *restrict vt = v + (t * H + h) * V;
            float *restrict ot = o + (t * H + h) * V;
            const float b = beta[t * H + h];
            for (Py_ssize_t j = 0; j < V; j++) {
                w[j] = b * (vt[j] - u[j]);
                ot[j] = 0.0f;
                sq[j] = 0.0f;
                un[j] = 0.0f;
            }
            if (t + 1 < T) {
                for (Py_ssize_t r = 0; r < K; r++) {  /* token t: write, read out; token t+1: decay, read */
                    float *restrict row = Sh + r * V;
                    const float kr = k[at + r], qr = q[at + r], a = alpha[nx + r], kn = k[nx + r];
                    for (Py_ssize_t j = 0; j < V; j++) {
                        const float x = row[j] + kr * w[j];
                        ot[j] += qr * x;
                        sq[j] += x * x;
                        row[j] = x * a;
                        un[j] += kn * row[j];
                    }
                }
            } else {
                for (Py_ssize_t r = 0; r < K; r++) {
                    float *restrict row = Sh + r * V;
                    const float kr = k[at + r], qr = q[at + r];
                    for (Py_ssize_t j = 0; j < V; j++) {
                        row[j] += kr * w[j];
                        ot[j] += qr * row[j];
                        sq[j] += row[j] * row[j];
                    }
                }
            }
            if (norms != NULL) norms[t * H + h] = sqrtf(sum_lanes(sq, V));
            float *restrict swap = u;  /* the next token's u */
            u = un;
            un = swap;
        }
    }
}

static void heads_portable(const float *q, const float *k, const float *v, const float *alpha, const float *beta, float *S,
                           float *o, float *norms, Py_ssize_t T, Py_ssize_t H, Py_ssize_t K, Py_ssize_t V, Py_ssize_t h0,
                           Py_ssize_t h1, float *scratch) {
    heads_body(q, k, v, alpha, beta, S, o, norms, T, H, K, V, h0, h1, scratch);
}

#ifdef KX_X86
__attribute__((target("avx2,fma"))) static void heads_avx2(const float *q, const float *k, const float *v, const float *alpha,
        const float *beta, float *S, float *o, float *norms, Py_ssize_t T, Py_ssize_t H, Py_ssize_t K, Py_ssize_t V,
        Py_ssize_t h0, Py_ssize_t h1, float *scratch) {
    heads_body(q, k, v, alpha, beta, S, o, norms, T, H, K, V, h0, h1, scratch);
}

/* heads_body for V a multiple of the vector width W (AVX2: 8, AVX-512F: 16): the same operations per column in the
   same order, 2W columns at a time (W at the end), each column's sums over the K rows (o, the square sum, the next
   token's u) kept in registers rather than in the scratch rows, which heads_body loads and stores at every row (AVX2:
   2.5x at the embedded model's 32 x 32 heads, 3.4x at K3's 128 x 128, an AVX2 VM; AVX-512: 1.8x and 1.3x the
   compiler's vectorisation of heads_body, which it had run, on a Xeon). Both widths give the same floats, bit for bit
   (tests/test_kda_recurrence.py). One definition, instantiated per width: VEC the vector type, PFX its intrinsics'
   prefix. */
#define KX_COLS(name, attr, VEC, PFX, W)                                                                                  \
    __attribute__((always_inline, attr)) static inline void name(float *restrict Sh, const float *restrict w,               \
            const float *restrict kt, const float *restrict qt, const float *restrict an, const float *restrict kn,         \
            float *restrict ot, float *restrict sq, float *restrict un, Py_ssize_t K, Py_ssize_t V, Py_ssize_t j,           \
            const int next, const int two) {                                                                                \
        const VEC w0 = PFX##_loadu_ps(w + j), w1 = two ? PFX##_loadu_ps(w + j + W) : w0;                                   \
        VEC o0 = PFX##_setzero_ps(), o1 = o0, s0 = o0, s1 = o0, u0 = o0, u1 = o0;                                           \
        for (Py_ssize_t r = 0; r < K; r++) {                                                                                \
            float *restrict row = Sh + r * V + j;                                                                           \
            const VEC kr = PFX##_set1_ps(kt[r]), qr = PFX##_set1_ps(qt[r]);                                                 \
            const VEC x0 = PFX##_fmadd_ps(kr, w0, PFX##_loadu_ps(row));                                                     \
            o0 = PFX##_fmadd_ps(qr, x0, o0);                                                                                \
            s0 = PFX##_fmadd_ps(x0, x0, s0);                                                                                \
            VEC x1 = x0;                                                                                                    \
            if (two) {                                                                                                      \
                x1 = PFX##_fmadd_ps(kr, w1, PFX##_loadu_ps(row + W));                                                       \
                o1 = PFX##_fmadd_ps(qr, x1, o1);                                                                            \
                s1 = PFX##_fmadd_ps(x1, x1, s1);                                                                            \
            }                                                                                                               \
            if (next) {                                                                                                     \
                const VEC a = PFX##_set1_ps(an[r]), k = PFX##_set1_ps(kn[r]);                                               \
                const VEC y0 = PFX##_mul_ps(x0, a);                                                                         \
                PFX##_storeu_ps(row, y0);                                                                                   \
                u0 = PFX##_fmadd_ps(k, y0, u0);                                                                             \
                if (two) {                                                                                                  \
                    const VEC y1 = PFX##_mul_ps(x1, a);                                                                     \
                    PFX##_storeu_ps(row + W, y1);                                                                           \
                    u1 = PFX##_fmadd_ps(k, y1, u1);                                                                         \
                }                                                                                                           \
            } else {                                                                                                        \
                PFX##_storeu_ps(row, x0);                                                                                   \
                if (two) PFX##_storeu_ps(row + W, x1);                                                                      \
            }                                                                                                               \
        }                                                                                                                   \
        PFX##_storeu_ps(ot + j, o0);                                                                                        \
        PFX##_storeu_ps(sq + j, s0);                                                                                        \
        PFX##_storeu_ps(un + j, u0);                                                                                        \
        if (two) {                                                                                                          \
            PFX##_storeu_ps(ot + j + W, o1);                                                                                \
            PFX##_storeu_ps(sq + j + W, s1);                                                                                \
            PFX##_storeu_ps(un + j + W, u1);                                                                                \
        }                                                                                                                   \
    }

#define KX_HEADS_COLS(name, attr, cols, W)                                                                                \
    __attribute__((attr)) static void name(const float *q, const float *k, const float *v, const float *alpha,               \
            const float *beta, float *S, float *o, float *norms, Py_ssize_t T, Py_ssize_t H, Py_ssize_t K, Py_ssize_t V,    \
            Py_ssize_t h0, Py_ssize_t h1, float *scratch) {                                                                 \
        float *u = scratch, *w = scratch + V, *sq = scratch + 2 * V, *un = scratch + 3 * V;                                 \
        for (Py_ssize_t h = h0; h < h1 && T > 0; h++) {                                                                     \
            float *Sh = S + h * K * V;                                                                                      \
            first_decay_read(Sh, alpha + h * K, k + h * K, u, K, V);                                                        \
            for (Py_ssize_t t = 0; t < T; t++) {                                                                            \
                const Py_ssize_t at = (t * H + h) * K, nx = ((t + 1) * H + h) * K;                                          \
                const float *vt = v + (t * H + h) * V;                                                                      \
                float *ot = o + (t * H + h) * V;                                                                            \
                const float b = beta[t * H + h];                                                                            \
                for (Py_ssize_t j = 0; j < V; j++) w[j] = b * (vt[j] - u[j]);                                               \
                const int next = t + 1 < T;                                                                                 \
                const float *an = next ? alpha + nx : NULL, *kn = next ? k + nx : NULL;                                     \
                Py_ssize_t j = 0;                                                                                           \
                for (; j + 2 * W <= V; j += 2 * W)                                                                          \
                    if (next) cols(Sh, w, k + at, q + at, an, kn, ot, sq, un, K, V, j, 1, 1);                               \
                    else cols(Sh, w, k + at, q + at, an, kn, ot, sq, un, K, V, j, 0, 1);                                    \
                if (j < V) {                                                                                                \
                    if (next) cols(Sh, w, k + at, q + at, an, kn, ot, sq, un, K, V, j, 1, 0);                               \
                    else cols(Sh, w, k + at, q + at, an, kn, ot, sq, un, K, V, j, 0, 0);                                    \
                }                                                                                                           \
                if (norms != NULL) norms[t * H + h] = sqrtf(sum_lanes(sq, V));                                              \
                float *swap = u; /* the next token's u */                                                                   \
                u = un;                                                                                                     \
                un = swap;                                                                                                  \
            }                                                                                                               \
        }                                                                                                                   \
    }

KX_COLS(cols_avx2, target("avx2,fma"), __m256, _mm256, 8)
KX_HEADS_COLS(heads_avx2_cols, target("avx2,fma"), cols_avx2, 8)
KX_COLS(cols_avx512, target("avx512f"), __m512, _mm512, 16)
KX_HEADS_COLS(heads_avx512_cols, target("avx512f"), cols_avx512, 16)

__attribute__((target("avx512f"))) static void heads_avx512(const float *q, const float *k, const float *v, const float *alpha,
        const float *beta, float *S, float *o, float *norms, Py_ssize_t T, Py_ssize_t H, Py_ssize_t K, Py_ssize_t V,
        Py_ssize_t h0, Py_ssize_t h1, float *scratch) {
    heads_body(q, k, v, alpha, beta, S, o, norms, T, H, K, V, h0, h1, scratch);
}

#define KX_HEADS_KERNEL(isa) ((isa) == 2 ? heads_avx512 : (isa) == 1 ? heads_avx2 : heads_portable)
#else
#define KX_HEADS_KERNEL(isa) heads_portable
#endif

PyDoc_STRVAR(delta_rule_doc,
             "delta_rule(q, k, v, alpha, beta, S, o, norms, T, H, K, V, h0, h1, isa)\n\n"
             "q, k, alpha float32 [T, H, K]; v float32 [T, H, V]; beta float32 [T, H]; S float32 [H, K, V] (updated);\n"
             "o float32 [T, H, V] and norms float32 [T, H] (or None) written for heads h0..h1-1: C-contiguous\n"
             "buffers. isa: a name from isas() or '' for the best this CPU has.");

static PyObject *delta_rule(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer q, k, v, alpha, beta, S, o, nb = {0};
    PyObject *norms_obj;
    Py_ssize_t T, H, K, V, h0, h1;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*w*Onnnnnns", &q, &k, &v, &alpha, &beta, &S, &o, &norms_obj, &T, &H, &K, &V, &h0,
                          &h1, &isa_name))
        return NULL;
    PyObject *result = NULL;
    const char *err = NULL;
    const int has_norms = norms_obj != Py_None;
    if (has_norms && PyObject_GetBuffer(norms_obj, &nb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto release;
    int isa = isa_index(isa_name);
    if (T < 0 || H <= 0 || K <= 0 || V <= 0) err = "T >= 0 and H, K, V > 0 expected";
    else if (isa < 0) err = "isa: not one of isas() on this CPU";
    else if (q.len != 4 * T * H * K || k.len != q.len || alpha.len != q.len) err = "q, k, alpha: expected float32 [T, H, K]";
    else if (v.len != 4 * T * H * V || o.len != v.len) err = "v, o: expected float32 [T, H, V]";
    else if (beta.len != 4 * T * H || (has_norms && nb.len != beta.len)) err = "beta, norms: expected float32 [T, H]";
    else if (S.len != 4 * H * K * V) err = "S: expected float32 [H, K, V]";
    else if (h0 < 0 || h0 > h1 || h1 > H) err = "h0/h1: outside 0..H";
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        goto release;
    }
    float *scratch = PyMem_Malloc(4 * V * sizeof(float));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto release;
    }
    heads_fn run = KX_HEADS_KERNEL(isa);
#ifdef KX_X86
    if (isa == 2 && V % 16 == 0) run = heads_avx512_cols;
    else if (isa >= 1 && V % 8 == 0) run = heads_avx2_cols;  /* (an AVX-512 CPU runs AVX2 too) */
#endif
    Py_BEGIN_ALLOW_THREADS
    run(q.buf, k.buf, v.buf, alpha.buf, beta.buf, S.buf, o.buf, has_norms ? nb.buf : NULL, T, H, K, V, h0, h1, scratch);
    Py_END_ALLOW_THREADS
    PyMem_Free(scratch);
    result = Py_None;
    Py_INCREF(result);
release:
    PyBuffer_Release(&q);
    PyBuffer_Release(&k);
    PyBuffer_Release(&v);
    PyBuffer_Release(&alpha);
    PyBuffer_Release(&beta);
    PyBuffer_Release(&S);
    PyBuffer_Release(&o);
    if (has_norms && nb.obj != NULL) PyBuffer_Release(&nb);
    return result;
}

/* The token form's elementwise delta-rule steps (kda.delta_rule_update), float32, rounded exactly as NumPy's
   `S *= alpha[:, :, None]` and `S += k[:, :, None] * (beta[:, None] * (v - u))[:, None, :]` round them: each product, then each sum,
   rounded on its own (no fused multiply-add), so the results are bit for bit NumPy's. One call each instead
   of NumPy's broadcasts over a short inner axis, which cost more than the arithmetic on a tiny model. */
#if defined(__clang__)
#define KX_NO_CONTRACT
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#define KX_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define KX_NO_CONTRACT
#endif

KX_NO_CONTRACT static void scale_rows_f32(float *restrict S, const float *restrict alpha, Py_ssize_t rows, Py_ssize_t V) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float a = alpha[r];
        float *restrict row = S + r * V;
        for (Py_ssize_t j = 0; j < V; j++) row[j] = row[j] * a;
    }
}

KX_NO_CONTRACT static void write_delta_f32(float *restrict S, const float *restrict k, const float *restrict v,
                                           const float *restrict u, const float *restrict beta, Py_ssize_t H, Py_ssize_t K,
                                           Py_ssize_t V, float *restrict w) {
    for (Py_ssize_t h = 0; h < H; h++) {
        const float b = beta[h];
        for (Py_ssize_t j = 0; j < V; j++) {
            const float d = v[h * V + j] - u[h * V + j];
            w[j] = b * d;
        }
        for (Py_ssize_t r = 0; r < K; r++) {
            const float kr = k[h * K + r];
            float *restrict row = S + (h * K + r) * V;
            for (Py_ssize_t j = 0; j < V; j++) {
                const float prod = kr * w[j];
                row[j] = row[j] + prod;
            }
        }
    }
}

/* out[r, :] = x[r, :] * (scale[r] / sqrt(sq[r] + eps)): the l2 norm of q and k with q's scale folded in. */
KX_NO_CONTRACT static void l2_scale_f32(const float *restrict x, const float *restrict sq, const float *restrict scale, float eps,
                                        float *restrict out, Py_ssize_t rows, Py_ssize_t K) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float f = scale[r] / sqrtf(sq[r] + eps);
        for (Py_ssize_t j = 0; j < K; j++) out[r * K + j] = x[r * K + j] * f;
    }
}

/* out[h, :] = o[h, :] * (gain[:] * gate[h, :]) / sqrt(sq[h] + eps): the gated RMSNorm of the read-out. */
KX_NO_CONTRACT static void gated_norm_f32(const float *restrict o, const float *restrict sq, const float *restrict gain,
                                          const float *restrict gate, float eps, float *restrict out, Py_ssize_t H,
                                          Py_ssize_t V) {
    for (Py_ssize_t h = 0; h < H; h++) {
        const float d = sqrtf(sq[h] + eps);
        for (Py_ssize_t j = 0; j < V; j++) {
            const float g = gain[j] * gate[h * V + j];
            const float p = o[h * V + j] * g;
            out[h * V + j] = p / d;
        }
    }
}

static PyObject *l2_scale(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer x, sq, scale, out;
    float eps;
    if (!PyArg_ParseTuple(args, "y*y*y*fw*", &x, &sq, &scale, &eps, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t rows = sq.len / 4, K = rows > 0 ? x.len / (4 * rows) : 0;
    if (K == 0 || x.len != 4 * rows * K || scale.len != sq.len || out.len != x.len)
        PyErr_SetString(PyExc_ValueError, "l2_scale: x, out float32 [R, K]; sq, scale float32 [R] expected");
    else {
        l2_scale_f32(x.buf, sq.buf, scale.buf, eps, out.buf, rows, K);
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&sq);
    PyBuffer_Release(&scale);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *gated_norm(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer o, sq, gain, gate, out;
    float eps;
    if (!PyArg_ParseTuple(args, "y*y*y*y*fw*", &o, &sq, &gain, &gate, &eps, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t H = sq.len / 4, V = gain.len / 4;
    if (H == 0 || V == 0 || o.len != 4 * H * V || gate.len != o.len || out.len != o.len)
        PyErr_SetString(PyExc_ValueError, "gated_norm: o, gate, out float32 [H, V]; sq float32 [H]; gain float32 [V] expected");
    else {
        gated_norm_f32(o.buf, sq.buf, gain.buf, gate.buf, eps, out.buf, H, V);
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&o);
    PyBuffer_Release(&sq);
    PyBuffer_Release(&gain);
    PyBuffer_Release(&gate);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *shift_in(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer window, y;
    Py_ssize_t W;
    if (!PyArg_ParseTuple(args, "w*y*n", &window, &y, &W)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t C = W > 0 ? window.len / (4 * W) : 0;
    if (C == 0 || window.len != 4 * C * W || y.len < 4 * C)
        PyErr_SetString(PyExc_ValueError, "shift_in: window float32 [C, W] and y float32 [>= C] expected");
    else {
        float *win = window.buf;
        const float *yy = y.buf;
        /* NumPy's way: the whole buffer one float left (a tap crossing into the previous row lands in its last
           tap), then every row's last tap set */
        memmove(win, win + 1, (size_t)(C * W - 1) * sizeof(float));
        for (Py_ssize_t c = 0; c < C; c++) win[c * W + W - 1] = yy[c];
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&window);
    PyBuffer_Release(&y);
    return result;
}

static PyObject *scale_rows(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer S, alpha;
    if (!PyArg_ParseTuple(args, "w*y*", &S, &alpha)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t rows = alpha.len / 4;
    if (alpha.len % 4 || rows == 0 || S.len % (4 * rows))
        PyErr_SetString(PyExc_ValueError, "scale_rows: S float32 [rows, V] and alpha float32 [rows] expected");
    else {
        scale_rows_f32(S.buf, alpha.buf, rows, S.len / (4 * rows));
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&S);
    PyBuffer_Release(&alpha);
    return result;
}

static PyObject *write_delta(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer S, k, v, u, beta;
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*", &S, &k, &v, &u, &beta)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t H = beta.len / 4, K = H > 0 ? k.len / (4 * H) : 0, V = H > 0 ? v.len / (4 * H) : 0;
    if (K == 0 || V == 0 || k.len != 4 * H * K || v.len != 4 * H * V || u.len != v.len || S.len != 4 * H * K * V)
        PyErr_SetString(PyExc_ValueError,
                        "write_delta: S float32 [H, K, V], k float32 [H, K], v, u float32 [H, V], beta float32 [H] expected");
    else {
        float *w = PyMem_Malloc(V * sizeof(float));
        if (w == NULL) PyErr_NoMemory();
        else {
            write_delta_f32(S.buf, k.buf, v.buf, u.buf, beta.buf, H, K, V, w);
            PyMem_Free(w);
            result = Py_None;
            Py_INCREF(result);
        }
    }
    PyBuffer_Release(&S);
    PyBuffer_Release(&k);
    PyBuffer_Release(&v);
    PyBuffer_Release(&u);
    PyBuffer_Release(&beta);
    return result;
}

static PyMethodDef methods[] = {
    {"delta_rule", delta_rule, METH_VARARGS, delta_rule_doc},
    {"l2_scale", l2_scale, METH_VARARGS, "l2_scale(x, sq, scale, eps, out): out[r] = x[r] * (scale[r] / sqrt(sq[r] + eps))."},
    {"gated_norm", gated_norm, METH_VARARGS,
     "gated_norm(o, sq, gain, gate, eps, out): out[h] = o[h] * (gain * gate[h]) / sqrt(sq[h] + eps)."},
    {"shift_in", shift_in, METH_VARARGS,
     "shift_in(window, y, W): each row of window [C, W] shifted left one tap, y[c] its last (float32, C-contiguous)."},
    {"scale_rows", scale_rows, METH_VARARGS, "scale_rows(S, alpha): S[r, :] *= alpha[r] (float32, C-contiguous; exact)."},
    {"write_delta", write_delta, METH_VARARGS,
     "write_delta(S, k, v, u, beta): S[h, r, :] += k[h, r] * (beta[h] * (v[h, :] - u[h, :])) (float32, C-contiguous;\n"
     "each operation rounded on its own)."},
    {"isas", isas, METH_NOARGS, "The kernels this CPU can run, best last."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_kda_recurrence", .m_doc = "The KDA delta rule, token by token, compiled.", .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kda_recurrence(void) { return PyModule_Create(&module); }
