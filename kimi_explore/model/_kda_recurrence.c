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
   AVX2+FMA and portable C (_kernel_isa.h picks at run time). The GIL is released; callers split the
   heads [h0, h1) over threads. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#include "../weights/_kernel_isa.h"

typedef void (*heads_fn)(const float *q, const float *k, const float *v, const float *alpha, const float *beta, float *S,
                         float *o, float *norms, Py_ssize_t T, Py_ssize_t H, Py_ssize_t K, Py_ssize_t V, Py_ssize_t h0,
                         Py_ssize_t h1, float *scratch);

/* scratch: 4 V floats (u | w | sums of squares per column | the next token's u). norms may be NULL.
   One pass over S_h per token: token t's write and read-out, then token t+1's decay and read. */
__attribute__((always_inline)) static inline void heads_body(const float *restrict q, const float *restrict k,
        const float *restrict v, const float *restrict alpha, const float *restrict beta, float *restrict S,
        float *restrict o, float *restrict norms, Py_ssize_t T, Py_ssize_t H, Py_ssize_t K, Py_ssize_t V, Py_ssize_t h0,
        Py_ssize_t h1, float *restrict scratch) {
    float *restrict u = scratch, *restrict w = scratch + V, *restrict sq = scratch + 2 * V, *restrict un = scratch + 3 * V;
    for (Py_ssize_t h = h0; h < h1 && T > 0; h++) {
        float *restrict Sh = S + h * K * V;
        for (Py_ssize_t j = 0; j < V; j++) u[j] = 0.0f;
        for (Py_ssize_t r = 0; r < K; r++) {  /* token 0: decay, read */
            float *restrict row = Sh + r * V;
            const float a = alpha[h * K + r], kr = k[h * K + r];
            for (Py_ssize_t j = 0; j < V; j++) {
                row[j] *= a;
                u[j] += kr * row[j];
            }
        }
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
            if (norms != NULL) {
                float s = 0.0f;
                for (Py_ssize_t j = 0; j < V; j++) s += sq[j];
                norms[t * H + h] = sqrtf(s);
            }
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
   `S *= alpha[:, :, None]` and `S += k[:, :, None] * w[:, None, :]` round them: each product, then each sum,
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

KX_NO_CONTRACT static void add_outer_f32(float *restrict S, const float *restrict k, const float *restrict w, Py_ssize_t H,
                                         Py_ssize_t K, Py_ssize_t V) {
    for (Py_ssize_t h = 0; h < H; h++)
        for (Py_ssize_t r = 0; r < K; r++) {
            const float kr = k[h * K + r];
            const float *restrict wh = w + h * V;
            float *restrict row = S + (h * K + r) * V;
            for (Py_ssize_t j = 0; j < V; j++) {
                const float prod = kr * wh[j];
                row[j] = row[j] + prod;
            }
        }
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

static PyObject *add_outer(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer S, k, w;
    Py_ssize_t H;
    if (!PyArg_ParseTuple(args, "w*y*y*n", &S, &k, &w, &H)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t K = H > 0 ? k.len / (4 * H) : 0, V = H > 0 ? w.len / (4 * H) : 0;
    if (K == 0 || V == 0 || k.len != 4 * H * K || w.len != 4 * H * V || S.len != 4 * H * K * V)
        PyErr_SetString(PyExc_ValueError, "add_outer: S float32 [H, K, V], k float32 [H, K], w float32 [H, V] expected");
    else {
        add_outer_f32(S.buf, k.buf, w.buf, H, K, V);
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&S);
    PyBuffer_Release(&k);
    PyBuffer_Release(&w);
    return result;
}

static PyMethodDef methods[] = {
    {"delta_rule", delta_rule, METH_VARARGS, delta_rule_doc},
    {"scale_rows", scale_rows, METH_VARARGS, "scale_rows(S, alpha): S[r, :] *= alpha[r] (float32, C-contiguous; exact)."},
    {"add_outer", add_outer, METH_VARARGS,
     "add_outer(S, k, w, H): S[h, r, :] += k[h, r] * w[h, :] (float32, C-contiguous; each product rounded, then the sum)."},
    {"isas", isas, METH_NOARGS, "The kernels this CPU can run, best last."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_kda_recurrence", .m_doc = "The KDA delta rule, token by token, compiled.", .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kda_recurrence(void) { return PyModule_Create(&module); }
