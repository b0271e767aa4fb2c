/* The token form's small steps, compiled (CPU, float32): token_ops.py.

   On the tiny models a decode step is a few hundred NumPy calls on vectors of 8 to 384 floats, and each
   call (argument parsing, a temporary, a dispatch) costs more than its arithmetic. Each function here is
   one of those steps in one call: an RMSNorm, a SiTU-GLU, the block-residual rows and softmax, the
   router's sigmoid, selection and weights, KDA's gates, an attention softmax.

   Each step is evaluated in double precision from its float32 inputs (libm's exp and tanh) and each
   output rounded to float32 once: within an ulp or so of the exact value, at least as close as NumPy's
   float32 formulation of the same step, to which it agrees to rounding, not bit for bit. The route is the
   same for a token with and without hooks (they fire between the steps), so replays stay exact.

   Portable C (at these sizes the call, not the loop, is the cost), but for the RMSNorm and the block stack's rows
   (set_row), which the sequence path runs on a chunk's rows: AVX-512F, AVX2 and portable C, the same values. The
   buffers are checked by size here; their dtype (float32, int64 ids) and C order by the caller (token_ops.runs). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../weights/_kernel_isa.h"

static inline double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }

/* SiTU-GLU of one gate g and up u: beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta)
   (has_lb), else * u; inv_b = 1 / beta, inv_lb = 1 / linear_beta, c = beta linear_beta (or beta). */
static inline float situ_d(double g, double u, double inv_b, double inv_lb, double c, int has_lb) {
    const double a = tanh(g * inv_b) * sigmoid_d(g);
    return (float)(has_lb ? a * tanh(u * inv_lb) * c : a * u * c);
}

#define DONE(ok)              \
    do {                      \
        if (ok) {             \
            result = Py_None; \
            Py_INCREF(result); \
        }                     \
    } while (0)

/* 4 floats and 4 doubles as vectors: a row's squares summed in 4 lanes of double, one vector per row (the
   vectoriser assembled the lanes of an array of 4 sums from scalars, across rows) */
typedef float kx_f4 __attribute__((vector_size(16)));
typedef double kx_d4 __attribute__((vector_size(32)));

/* 4 floats from anywhere, in double; and 4 doubles rounded to floats, stored anywhere. With AVX, by its intrinsics
   (GCC 12 converts a vector of 4 by halves: twice the instructions) */
#if defined(KX_X86)
#include <immintrin.h>
#endif
#define KX_LOAD_D4_VEC(p)                                                                      \
    ({                                                                                         \
        kx_f4 f_;                                                                              \
        memcpy(&f_, (p), sizeof f_);                                                           \
        __builtin_convertvector(f_, kx_d4);                                                    \
    })
#define KX_STORE_F4_VEC(p, d)                                                                  \
    do {                                                                                       \
        const kx_f4 f_ = __builtin_convertvector((d), kx_f4);                                  \
        memcpy((p), &f_, sizeof f_);                                                           \
    } while (0)
#define KX_LOAD_D4_AVX(p) ((kx_d4)_mm256_cvtps_pd(_mm_loadu_ps(p)))
#define KX_STORE_F4_AVX(p, d) _mm_storeu_ps((p), _mm256_cvtpd_ps((__m256d)(d)))

/* sum(x^2) in double of M rows of n at once (x [M, n], M a constant 1 to 4): each row in four lanes (lane j: elements
   j, j + 4, ...; the tail in lane 0; then (0 + 1) + (2 + 3)), the same order every call, whatever M (a square of a
   float is exact in double: a fused multiply-add is the multiply and the add, the same value); 4 rows' independent
   sums hide the adds' latency, which bounds one row's */
#define KX_SUM_SQUARES_ROWS(LOAD_D4, x, n, M, out)                                             \
    do {                                                                                       \
        kx_d4 s_[(M)] = {{0.0}};                                                               \
        Py_ssize_t i_ = 0;                                                                     \
        for (; i_ + 4 <= (n); i_ += 4)                                                         \
            for (int r_ = 0; r_ < (M); r_++) {                                                 \
                const kx_d4 d_ = LOAD_D4((x) + r_ * (n) + i_);                                 \
                s_[r_] += d_ * d_;                                                             \
            }                                                                                  \
        for (int r_ = 0; r_ < (M); r_++) {                                                     \
            double t_ = s_[r_][0];                                                             \
            for (Py_ssize_t j_ = i_; j_ < (n); j_++) t_ += (double)(x)[r_ * (n) + j_] * (x)[r_ * (n) + j_]; \
            (out)[r_] = (t_ + s_[r_][1]) + (s_[r_][2] + s_[r_][3]);                            \
        }                                                                                      \
    } while (0)

static PyObject *size_error(const char *what) {
    PyErr_SetString(PyExc_ValueError, what);
    return NULL;
}

/* RMSNorm of rows [rows, n]: out = x * w * r, r = 1 / sqrt(sum(x^2) / n + eps), in double, rounded once. Compiled
   for AVX-512F, AVX2 and portable C (_kernel_isa.h; a chunk's rows: on AVX-512 ~3x portable C's SSE2): the same
   values on each, as every operation is the same (the squares of floats are exact in double, so a fused
   multiply-add of one is the multiply and the add). 4 rows at a time, their sums of squares and products in
   vectors of 4 doubles: 1.7x the vectoriser's code on a chunk's [512, 128] rows, AVX2 (set_row: 2x its SSE2). */
#define RMS_BODY(LOAD_D4, STORE_F4)                                                            \
    {                                                                                          \
        for (Py_ssize_t r0 = 0; r0 < rows; r0 += 4) {                                          \
            const Py_ssize_t m = rows - r0 < 4 ? rows - r0 : 4;                                \
            double sq[4], r[4];                                                                \
            if (m == 4) KX_SUM_SQUARES_ROWS(LOAD_D4, x + r0 * n, n, 4, sq);                    \
            else                                                                               \
                for (Py_ssize_t j = 0; j < m; j++) KX_SUM_SQUARES_ROWS(LOAD_D4, x + (r0 + j) * n, n, 1, sq + j); \
            for (Py_ssize_t j = 0; j < m; j++) r[j] = 1.0 / sqrt(sq[j] / (double)n + eps);     \
            Py_ssize_t i = 0;                                                                  \
            if (m == 4) /* (x w) r, 4 columns of the 4 rows at a time (w's converted once for them) */ \
                for (; i + 4 <= n; i += 4) {                                                   \
                    const kx_d4 wd = LOAD_D4(w + i);                                           \
                    for (int j = 0; j < 4; j++) {                                              \
                        STORE_F4(out + (r0 + j) * n + i, LOAD_D4(x + (r0 + j) * n + i) * wd * r[j]); \
                    }                                                                          \
                }                                                                              \
            for (Py_ssize_t j = 0; j < m; j++) { /* fewer rows than 4: one at a time; then the columns left */ \
                Py_ssize_t c = i;                                                              \
                for (; c + 4 <= n; c += 4)                                                     \
                    STORE_F4(out + (r0 + j) * n + c, LOAD_D4(x + (r0 + j) * n + c) * LOAD_D4(w + c) * r[j]); \
                for (; c < n; c++) out[(r0 + j) * n + c] = (float)((double)x[(r0 + j) * n + c] * w[c] * r[j]); \
            }                                                                                  \
        }                                                                                      \
    }

/* set_row's rows (its docstring), 4 tokens at a time (src: their values, out = v + b when sum) */
#define SET_ROW_BODY(LOAD_D4)                                                                  \
    {                                                                                          \
        KX_CONTRACT_OFF                                                                        \
        const float *src = sum ? out : v;                                                      \
        for (Py_ssize_t t0 = 0; t0 < T; t0 += 4) { /* 4 tokens' sums at once where there are (the same values) */ \
            const Py_ssize_t m = T - t0 < 4 ? T - t0 : 4;                                      \
            if (sum) { /* these tokens' a + b first (NumPy's float32 add), read again below while in cache */ \
                const float *x = v + t0 * d, *y = b + t0 * d;                                  \
                float *o = out + t0 * d;                                                       \
                for (Py_ssize_t i = 0; i < m * d; i++) o[i] = x[i] + y[i];                     \
            }                                                                                  \
            double sq[4];                                                                      \
            if (m == 4) KX_SUM_SQUARES_ROWS(LOAD_D4, src + t0 * d, d, 4, sq);                  \
            else                                                                               \
                for (Py_ssize_t j = 0; j < m; j++) KX_SUM_SQUARES_ROWS(LOAD_D4, src + (t0 + j) * d, d, 1, sq + j); \
            for (Py_ssize_t j = 0; j < m; j++) {                                               \
                const Py_ssize_t t = t0 + j;                                                   \
                memcpy(rows + (t * R + n) * d, src + t * d, (size_t)d * sizeof(float));        \
                inv[t * R + n] = 1.0 / sqrt(sq[j] * inv_d + eps);                              \
            }                                                                                  \
        }                                                                                      \
    }

/* set_row's kernels do not fuse sq inv_d + eps (an FMA target would: one rounding, where the token form's Python
   floats take two): GCC by the function's option, clang by its pragma at the body's start */
#if defined(__clang__)
#define KX_NO_CONTRACT_FN
#define KX_CONTRACT_OFF _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define KX_NO_CONTRACT_FN __attribute__((optimize("fp-contract=off")))
#define KX_CONTRACT_OFF
#else
#define KX_NO_CONTRACT_FN
#define KX_CONTRACT_OFF
#endif

#define DEFINE_ROW_KERNELS(suffix, attr, LOAD, STORE)                                                                \
    attr static void rms_##suffix(const float *x, const float *w, double eps, float *out, Py_ssize_t rows,           \
                                  Py_ssize_t n) RMS_BODY(LOAD, STORE)                                                \
    attr KX_NO_CONTRACT_FN static void set_row_##suffix(                                                             \
        float *rows, Py_ssize_t n, const float *v, double *inv, double inv_d, double eps, Py_ssize_t T, Py_ssize_t R, \
        Py_ssize_t d, const float *b, float *out, int sum) SET_ROW_BODY(LOAD)

DEFINE_ROW_KERNELS(portable, , KX_LOAD_D4_VEC, KX_STORE_F4_VEC)
#ifdef KX_X86
DEFINE_ROW_KERNELS(avx2, __attribute__((target("avx2,fma"))), KX_LOAD_D4_AVX, KX_STORE_F4_AVX)
DEFINE_ROW_KERNELS(avx512, __attribute__((target("avx512f"))), KX_LOAD_D4_AVX, KX_STORE_F4_AVX)
#define RMS_KERNEL(isa) ((isa) == 2 ? rms_avx512 : (isa) == 1 ? rms_avx2 : rms_portable)
#define SET_ROW_KERNEL(isa) ((isa) == 2 ? set_row_avx512 : (isa) == 1 ? set_row_avx2 : set_row_portable)
#else
#define RMS_KERNEL(isa) rms_portable
#define SET_ROW_KERNEL(isa) set_row_portable
#endif

PyDoc_STRVAR(rms_norm_doc, "rms_norm(x, weight, eps, out, isa='')\n\n"
                           "out = x * weight / sqrt(sum(x^2) / n + eps) for each row of x, in double, rounded once; "
                           "weight float32 [n], x and out float32 [rows, n] (one row: the token form's vector); isa: one "
                           "of isas() ('' the best), each the same values.");

static PyObject *rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer x, w, out;
    double eps;
    const char *isa_name = "";
    if (!PyArg_ParseTuple(args, "y*y*dw*|s", &x, &w, &eps, &out, &isa_name)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = w.len / 4;
    const int isa = isa_index(isa_name);
    if (isa < 0)
        PyErr_SetString(PyExc_ValueError, "isa: not one of isas() on this CPU");
    else if (n == 0 || x.len % w.len != 0 || out.len != x.len)
        size_error("rms_norm: weight float32 [n], x and out float32 [rows, n] expected");
    else {
        RMS_KERNEL(isa)(x.buf, w.buf, eps, out.buf, x.len / w.len, n);
        DONE(1);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(situ_doc, "situ(gate_up, out, rows, n, inv_b, inv_lb, c, has_lb)\n\n"
                       "SiTU-GLU (situ_d) of rows [gate | up]: gate_up [rows, 2n], out [rows, n].");

static PyObject *situ(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer gu, out;
    double inv_b, inv_lb, c;
    int has_lb;
    Py_ssize_t rows, n;
    if (!PyArg_ParseTuple(args, "y*w*nndddp", &gu, &out, &rows, &n, &inv_b, &inv_lb, &c, &has_lb)) return NULL;
    PyObject *result = NULL;
    if (rows < 0 || n < 0 || out.len != 4 * rows * n || gu.len != 2 * out.len)
        size_error("situ: gate_up float32 [rows, 2n] and out float32 [rows, n] expected");
    else {
        for (Py_ssize_t r = 0; r < rows; r++) {
            const float *g = (const float *)gu.buf + r * 2 * n, *u = g + n;
            float *o = (float *)out.buf + r * n;
            if (has_lb)
                for (Py_ssize_t i = 0; i < n; i++) o[i] = situ_d(g[i], u[i], inv_b, inv_lb, c, 1);
            else
                for (Py_ssize_t i = 0; i < n; i++) o[i] = situ_d(g[i], u[i], inv_b, inv_lb, c, 0);
        }
        DONE(1);
    }
    PyBuffer_Release(&gu);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(set_row_doc, "set_row(rows, n, v, inv_rms, inv_d, eps, tokens, b=None, out=None, isa='')\n\n"
                          "For each token t: rows[t, n] = v[t] and inv_rms[t, n] = 1 / sqrt(sum(v[t]^2) inv_d + eps) "
                          "(double): rows float32 [tokens, R, d], v float32 [tokens, d], inv_rms float64 [tokens, R]. With b "
                          "and out (float32 [tokens, d]): out = v + b (float32), and out is what is set. isa: one of isas() "
                          "('' the best), each the same values.");

static PyObject *set_row(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer rows, v, inv, b = {0}, out = {0};
    PyObject *b_obj = Py_None, *out_obj = Py_None, *result = NULL;
    Py_ssize_t n, T;
    double inv_d, eps;
    const char *isa_name = "";
    if (!PyArg_ParseTuple(args, "w*ny*w*ddn|OOs", &rows, &n, &v, &inv, &inv_d, &eps, &T, &b_obj, &out_obj, &isa_name))
        return NULL;
    const int isa = isa_index(isa_name), sum = b_obj != Py_None;
    if ((sum && PyObject_GetBuffer(b_obj, &b, PyBUF_SIMPLE) < 0) ||
        (out_obj != Py_None && PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE) < 0))
        goto release;
    const Py_ssize_t d = T > 0 ? v.len / (4 * T) : 0, R = T > 0 ? inv.len / (8 * T) : 0;
    if (isa < 0)
        PyErr_SetString(PyExc_ValueError, "isa: not one of isas() on this CPU");
    else if (d == 0 || v.len != 4 * T * d || inv.len != 8 * T * R || rows.len != 4 * T * R * d || n < 0 || n >= R ||
             sum != (out.buf != NULL) || (sum && (b.len != v.len || out.len != v.len)))
        size_error("set_row: rows float32 [tokens, R, d], v float32 [tokens, d], inv_rms float64 [tokens, R], "
                   "0 <= n < R, b and out (both or neither) float32 [tokens, d] expected");
    else {
        SET_ROW_KERNEL(isa)(rows.buf, n, v.buf, inv.buf, inv_d, eps, T, R, d, b.buf, out.buf, sum);
        DONE(1);
    }
release:
    PyBuffer_Release(&rows);
    PyBuffer_Release(&v);
    PyBuffer_Release(&inv);
    if (b.obj) PyBuffer_Release(&b);
    if (out.obj) PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(source_softmax_doc, "source_softmax(s, inv_rms, out, rows)\n\n"
                                 "out = softmax(s * inv_rms) over m sources, for each of `rows` rows, in double (exp: libm), "
                                 "rounded once: s, out float32 [rows, m] (1 <= m <= 64), inv_rms float64 [rows, S >= m].");

static PyObject *source_softmax(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer s, inv, out;
    Py_ssize_t rows;
    if (!PyArg_ParseTuple(args, "y*y*w*n", &s, &inv, &out, &rows)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t m = rows > 0 ? out.len / (4 * rows) : 0, S = rows > 0 ? inv.len / (8 * rows) : 0;
    if (m == 0 || m > 64 || out.len != 4 * rows * m || s.len != out.len || S < m || inv.len != 8 * rows * S)
        size_error("source_softmax: s, out float32 [rows, m] (1 <= m <= 64), inv_rms float64 [rows, S >= m] expected");
    else {
        for (Py_ssize_t r = 0; r < rows; r++) {
            const float *ss = (const float *)s.buf + r * m;
            const double *ir = (const double *)inv.buf + r * S;
            float *o = (float *)out.buf + r * m;
            double z[64], top = -INFINITY, total = 0.0;
            for (Py_ssize_t i = 0; i < m; i++) {
                z[i] = (double)ss[i] * ir[i];
                top = z[i] > top ? z[i] : top;
            }
            for (Py_ssize_t i = 0; i < m; i++) total += (z[i] = exp(z[i] - top));
            for (Py_ssize_t i = 0; i < m; i++) o[i] = (float)(z[i] / total);
        }
        DONE(1);
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&inv);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(softmax_doc, "softmax_rows(s, rows, scale)\n\n"
                          "In place on s float32 [rows, L]: each row softmax(s * scale), in double, rounded once.");

static PyObject *softmax_rows(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer sb;
    Py_ssize_t rows;
    double scale;
    if (!PyArg_ParseTuple(args, "w*nd", &sb, &rows, &scale)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t L = rows > 0 ? sb.len / (4 * rows) : 0;
    double *e = L > 0 ? PyMem_Malloc((size_t)L * sizeof(double)) : NULL;
    if (L == 0 || sb.len != 4 * rows * L)
        size_error("softmax_rows: s float32 [rows, L] expected");
    else if (e == NULL)
        PyErr_NoMemory();
    else {
        for (Py_ssize_t r = 0; r < rows; r++) {
            float *row = (float *)sb.buf + r * L;
            double top = -INFINITY, total = 0.0;
            for (Py_ssize_t j = 0; j < L; j++) {
                e[j] = row[j] * scale;
                top = e[j] > top ? e[j] : top;
            }
            for (Py_ssize_t j = 0; j < L; j++) total += (e[j] = exp(e[j] - top));
            for (Py_ssize_t j = 0; j < L; j++) row[j] = (float)(e[j] / total);
        }
        DONE(1);
    }
    PyMem_Free(e);
    PyBuffer_Release(&sb);
    return result;
}

PyDoc_STRVAR(sigmoid_doc, "sigmoid(x, out)\n\nout = 1 / (1 + exp(-x)): x, out float32 [n].");

static PyObject *sigmoid(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer x, out;
    if (!PyArg_ParseTuple(args, "y*w*", &x, &out)) return NULL;
    PyObject *result = NULL;
    if (out.len != x.len || x.len % 4)
        size_error("sigmoid: x, out float32 [n] expected");
    else {
        const float *xx = x.buf;
        float *o = out.buf;
        for (Py_ssize_t i = 0; i < x.len / 4; i++) o[i] = (float)sigmoid_d(xx[i]);
        DONE(1);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return result;
}

/* A selection key: NaN ranks as +inf, above every number (torch.topk ranks NaN first too), so a NaN score is
   selected and its NaN weight reaches the output instead of being passed over; a NaN in the comparisons below
   would also leave the kept list unsorted (every later comparison false), selecting experts that are not the top. */
static inline float rank_key(float c) { return c != c ? INFINITY : c; }

PyDoc_STRVAR(select_doc, "select_experts(scores, bias, ids)\n\n"
                         "Each row's top k experts of scores + bias (float32 sums), ties to the lower id, then ordered by "
                         "unbiased score (descending; ties keep that order); NaN ranks as +inf: bias float32 [E], scores "
                         "float32 [R, E] (R >= 1 rows: one token's [E], or a chunk's), ids int64 [R, k], 1 <= k <= E.");

static PyObject *select_experts(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer sc, bias, ids;
    if (!PyArg_ParseTuple(args, "y*y*w*", &sc, &bias, &ids)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t E = bias.len / 4, R = E > 0 ? sc.len / bias.len : 0, k = R > 0 ? ids.len / (8 * R) : 0;
    if (E == 0 || R == 0 || sc.len != R * bias.len || k == 0 || k > E || ids.len != 8 * R * k)
        size_error("select_experts: bias float32 [E], scores float32 [R, E], ids int64 [R, k] with 1 <= k <= E expected");
    else {
        const float *b = bias.buf;
        for (Py_ssize_t row = 0; row < R; row++) {
            const float *s = (const float *)sc.buf + row * E;
            int64_t *top = (int64_t *)ids.buf + row * k;
            Py_ssize_t have = 0;
            /* insertion into the k best so far, kept in (choice descending, id ascending) order: an expert goes
               before the first kept one it beats strictly, so an equal choice stays behind the lower id */
            for (Py_ssize_t e = 0; e < E; e++) {
                const float c = rank_key(s[e] + b[e]);
                if (have == k && !(c > rank_key(s[top[k - 1]] + b[top[k - 1]]))) continue;
                Py_ssize_t j = have < k ? have++ : k - 1;
                while (j > 0 && c > rank_key(s[top[j - 1]] + b[top[j - 1]])) {
                    top[j] = top[j - 1];
                    j--;
                }
                top[j] = e;
            }
            for (Py_ssize_t i = 1; i < k; i++) { /* stable insertion sort by unbiased score, descending */
                const int64_t e = top[i];
                Py_ssize_t j = i;
                while (j > 0 && rank_key(s[e]) > rank_key(s[top[j - 1]])) {
                    top[j] = top[j - 1];
                    j--;
                }
                top[j] = e;
            }
        }
        DONE(1);
    }
    PyBuffer_Release(&sc);
    PyBuffer_Release(&bias);
    PyBuffer_Release(&ids);
    return result;
}

PyDoc_STRVAR(weights_doc, "routing_weights(scores, ids, k, renormalize, scaling, eps, out)\n\n"
                          "Each row's out[j] = scores[ids[j]] * c in double, c = scaling / (sum + eps) (the k summed left to "
                          "right) when renormalize else scaling: scores float32 [R, E], ids int64 [R, k] (each in 0..E-1), "
                          "out float32 [R, k].");

static PyObject *routing_weights(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer sc, ids, out;
    Py_ssize_t k;
    int renorm;
    double scaling, eps;
    if (!PyArg_ParseTuple(args, "y*y*npddw*", &sc, &ids, &k, &renorm, &scaling, &eps, &out)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t R = k > 0 ? ids.len / (8 * k) : 0, E = R > 0 ? sc.len / (4 * R) : 0;
    const int64_t *id = ids.buf;
    int ok = R > 0 && E > 0 && ids.len == 8 * R * k && sc.len == 4 * R * E && out.len == 4 * R * k;
    for (Py_ssize_t j = 0; ok && j < R * k; j++) ok = id[j] >= 0 && id[j] < E;
    if (!ok)
        size_error("routing_weights: scores float32 [R, E], ids int64 [R, k] in 0..E-1, out float32 [R, k] expected");
    else {
        for (Py_ssize_t row = 0; row < R; row++) {
            const float *s = (const float *)sc.buf + row * E;
            const int64_t *ir = id + row * k;
            float *o = (float *)out.buf + row * k;
            double sum = 0.0;
            for (Py_ssize_t j = 0; j < k; j++) sum += s[ir[j]];
            const double c = renorm ? scaling / (sum + eps) : scaling;
            for (Py_ssize_t j = 0; j < k; j++) o[j] = (float)(s[ir[j]] * c);
        }
        DONE(1);
    }
    PyBuffer_Release(&sc);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(kda_gates_doc,
             "kda_gates(window, conv, y, decay_raw, dt_bias, A, lower_bound, H, out)\n\n"
             "KDA's element-wise step between the projections and the L2 norm, for one token (P = H K, W taps):\n"
             "  out[:3P]       q, k, v = silu(sum_w window[c, w] conv[c, w])     (window, conv [3P, W])\n"
             "  out[3P:4P]     gate = sigmoid(y[3P:4P])                          (y: the fused projection)\n"
             "  out[4P:4P+H]   beta = sigmoid(y[4P:4P+H])\n"
             "  out[4P+H:]     alpha = exp(lower_bound sigmoid((decay_raw + dt_bias) A))   (decay_raw, dt_bias, A [P])\n"
             "as the sequence path computes them (kda.kda_sequence).");

static PyObject *kda_gates(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer win, conv, y, raw, dt, A, out;
    double lb;
    Py_ssize_t H;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*dnw*", &win, &conv, &y, &raw, &dt, &A, &lb, &H, &out)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t P = raw.len / 4, W = P > 0 ? win.len / (4 * 3 * P) : 0;
    if (P == 0 || W == 0 || H <= 0 || win.len != 4 * 3 * P * W || conv.len != win.len || y.len < 4 * (4 * P + H) ||
        dt.len != raw.len || A.len != raw.len || out.len != 4 * (5 * P + H))
        size_error("kda_gates: window, conv float32 [3P, W]; y float32 [>= 4P + H]; decay_raw, dt_bias, A float32 [P]; "
                   "out float32 [5P + H] expected");
    else {
        const float *wn = win.buf, *cv = conv.buf, *yy = y.buf, *rw = raw.buf, *db = dt.buf, *aa = A.buf;
        float *o = out.buf;
        for (Py_ssize_t c = 0; c < 3 * P; c++) {
            const float *e = wn + c * W, *t = cv + c * W;
            double acc = 0.0;
            for (Py_ssize_t j = 0; j < W; j++) acc += (double)e[j] * t[j];
            o[c] = (float)(acc * sigmoid_d(acc));
        }
        for (Py_ssize_t i = 3 * P; i < 4 * P + H; i++) o[i] = (float)sigmoid_d(yy[i]);
        float *alpha = o + 4 * P + H;
        for (Py_ssize_t i = 0; i < P; i++) alpha[i] = (float)exp(lb * sigmoid_d(((double)rw[i] + db[i]) * aa[i]));
        DONE(1);
    }
    PyBuffer_Release(&win);
    PyBuffer_Release(&conv);
    PyBuffer_Release(&y);
    PyBuffer_Release(&raw);
    PyBuffer_Release(&dt);
    PyBuffer_Release(&A);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS, rms_norm_doc},
    {"isas", isas, METH_NOARGS, "The kernels this CPU can run (rms_norm's isa), best last."},
    {"situ", situ, METH_VARARGS, situ_doc},
    {"set_row", set_row, METH_VARARGS, set_row_doc},
    {"source_softmax", source_softmax, METH_VARARGS, source_softmax_doc},
    {"sigmoid", sigmoid, METH_VARARGS, sigmoid_doc},
    {"softmax_rows", softmax_rows, METH_VARARGS, softmax_doc},
    {"select_experts", select_experts, METH_VARARGS, select_doc},
    {"routing_weights", routing_weights, METH_VARARGS, weights_doc},
    {"kda_gates", kda_gates, METH_VARARGS, kda_gates_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_token_ops", "The token form's small steps, compiled (CPU, float32): token_ops.py.", -1, methods,
};

PyMODINIT_FUNC PyInit__token_ops(void) { return PyModule_Create(&module); }
