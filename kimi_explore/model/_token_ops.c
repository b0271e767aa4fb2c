/* The token form's small steps, compiled (CPU, float32): token_ops.py.

   On the tiny models a decode step is a few hundred NumPy calls on vectors of 8 to 384 floats, and each
   call (argument parsing, a temporary, a dispatch) costs more than its arithmetic. Each function here is
   one of those steps in one call: an RMSNorm, a SiTU-GLU, the softmax of a block-residual mix, the
   router's sigmoid, selection and weights, KDA's gates. exp and tanh are _kx_math.h's (the sequence
   path's); sums of squares and the softmaxes run in double. Float32 results agree with NumPy's
   formulation of the same step to rounding (~1-2 ulp), not bit for bit; the route is the same for every
   token with and without hooks (they fire between the steps), so a replay is exact.

   Portable C (no ISA variants: at these sizes the call, not the loop, is the cost). The buffers are
   checked by size here; their dtype (float32, int64 ids) and C order by the caller (token_ops.runs). */

/* Vectorising the selects of _kx_math.h needs it; FP exception flags only, values unchanged. */
#pragma GCC optimize("no-trapping-math")

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_kx_math.h"

#define DONE(ok)              \
    do {                      \
        if (ok) {             \
            result = Py_None; \
            Py_INCREF(result); \
        }                     \
    } while (0)

/* sum(x^2) in double, in four lanes (vectorised; the same order every call) */
static double sum_squares(const float *x, Py_ssize_t n) {
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) s[j] += (double)x[i + j] * x[i + j];
    for (; i < n; i++) s[0] += (double)x[i] * x[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

static PyObject *size_error(const char *what) {
    PyErr_SetString(PyExc_ValueError, what);
    return NULL;
}

PyDoc_STRVAR(rms_norm_doc, "rms_norm(x, weight, eps, out)\n\n"
                           "out = x * (weight * r), r = float32(1 / sqrt(sum(x^2) / n + eps)) (sum in double); x, weight, out [n].");

static PyObject *rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer x, w, out;
    double eps;
    if (!PyArg_ParseTuple(args, "y*y*dw*", &x, &w, &eps, &out)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = x.len / 4;
    if (n == 0 || w.len != x.len || out.len != x.len)
        size_error("rms_norm: x, weight, out float32 [n] expected");
    else {
        const float *xx = x.buf, *ww = w.buf;
        float *o = out.buf;
        const float r = (float)(1.0 / sqrt(sum_squares(xx, n) / (double)n + eps));
        for (Py_ssize_t i = 0; i < n; i++) o[i] = xx[i] * (ww[i] * r);
        DONE(1);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(situ_doc, "situ(gate_up, out, rows, n, inv_b, inv_lb, c, has_lb)\n\n"
                       "SiTU-GLU (_kx_math.h kx_situ) of rows [gate | up]: gate_up [rows, 2n], out [rows, n].");

static PyObject *situ(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer gu, out;
    float inv_b, inv_lb, c;
    int has_lb;
    Py_ssize_t rows, n;
    if (!PyArg_ParseTuple(args, "y*w*nnfffp", &gu, &out, &rows, &n, &inv_b, &inv_lb, &c, &has_lb)) return NULL;
    PyObject *result = NULL;
    if (rows < 0 || n < 0 || out.len != 4 * rows * n || gu.len != 2 * out.len)
        size_error("situ: gate_up float32 [rows, 2n] and out float32 [rows, n] expected");
    else {
        for (Py_ssize_t r = 0; r < rows; r++) {
            const float *g = (const float *)gu.buf + r * 2 * n, *u = g + n;
            float *o = (float *)out.buf + r * n;
            if (has_lb)
                for (Py_ssize_t i = 0; i < n; i++) o[i] = kx_situ(g[i], u[i], inv_b, inv_lb, c, 1);
            else
                for (Py_ssize_t i = 0; i < n; i++) o[i] = kx_situ(g[i], u[i], inv_b, inv_lb, c, 0);
        }
        DONE(1);
    }
    PyBuffer_Release(&gu);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(set_row_doc, "set_row(rows, n, v, inv_rms, inv_d, eps)\n\n"
                          "rows[n] = v and inv_rms[n] = 1 / sqrt(sum(v^2) inv_d + eps) (double): rows float32 [R, d], "
                          "v float32 [d], inv_rms float64 [R].");

static PyObject *set_row(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer rows, v, inv;
    Py_ssize_t n;
    double inv_d, eps;
    if (!PyArg_ParseTuple(args, "w*ny*w*dd", &rows, &n, &v, &inv, &inv_d, &eps)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t d = v.len / 4, R = inv.len / 8;
    if (d == 0 || rows.len != 4 * R * d || n < 0 || n >= R)
        size_error("set_row: rows float32 [R, d], v float32 [d], inv_rms float64 [R], 0 <= n < R expected");
    else {
        const float *vv = v.buf;
        float *row = (float *)rows.buf + n * d;
        memcpy(row, vv, (size_t)d * sizeof(float));
        ((double *)inv.buf)[n] = 1.0 / sqrt(sum_squares(vv, d) * inv_d + eps);
        DONE(1);
    }
    PyBuffer_Release(&rows);
    PyBuffer_Release(&v);
    PyBuffer_Release(&inv);
    return result;
}

PyDoc_STRVAR(source_softmax_doc, "source_softmax(s, inv_rms, out)\n\n"
                                 "out = softmax(s * inv_rms) over m = len(out) sources, in double (exp: libm), rounded once: "
                                 "s float32 [m], inv_rms float64 [>= m].");

static PyObject *source_softmax(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer s, inv, out;
    if (!PyArg_ParseTuple(args, "y*y*w*", &s, &inv, &out)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t m = out.len / 4;
    if (m == 0 || m > 64 || s.len != out.len || inv.len < 8 * m)
        size_error("source_softmax: s, out float32 [m] (1 <= m <= 64), inv_rms float64 [>= m] expected");
    else {
        const float *ss = s.buf;
        const double *ir = inv.buf;
        double z[64], top = -INFINITY, total = 0.0;
        for (Py_ssize_t i = 0; i < m; i++) {
            z[i] = (double)ss[i] * ir[i];
            top = z[i] > top ? z[i] : top;
        }
        for (Py_ssize_t i = 0; i < m; i++) total += (z[i] = exp(z[i] - top));
        for (Py_ssize_t i = 0; i < m; i++) ((float *)out.buf)[i] = (float)(z[i] / total);
        DONE(1);
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&inv);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(sigmoid_doc, "sigmoid(x, out)\n\nout = 1 / (1 + exp(-x)) (kx_expf): x, out float32 [n].");

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
        for (Py_ssize_t i = 0; i < x.len / 4; i++) o[i] = 1.0f / (1.0f + kx_expf(-xx[i]));
        DONE(1);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(select_doc, "select_experts(scores, bias, ids)\n\n"
                         "The top k = len(ids) experts of scores + bias (float32 sums), ties to the lower id, then ordered by "
                         "unbiased score (descending; ties keep that order): scores, bias float32 [E], ids int64 [k], k <= E.");

static PyObject *select_experts(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer sc, bias, ids;
    if (!PyArg_ParseTuple(args, "y*y*w*", &sc, &bias, &ids)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t E = sc.len / 4, k = ids.len / 8;
    if (E == 0 || bias.len != sc.len || k == 0 || k > E || ids.len != 8 * k)
        size_error("select_experts: scores, bias float32 [E], ids int64 [k] with 1 <= k <= E expected");
    else {
        const float *s = sc.buf, *b = bias.buf;
        int64_t *top = ids.buf;
        Py_ssize_t have = 0;
        /* insertion into the k best so far, kept in (choice descending, id ascending) order: an expert goes
           before the first kept one it beats strictly, so an equal choice stays behind the lower id */
        for (Py_ssize_t e = 0; e < E; e++) {
            const float c = s[e] + b[e];
            if (have == k && !(c > s[top[k - 1]] + b[top[k - 1]])) continue;
            Py_ssize_t j = have < k ? have++ : k - 1;
            while (j > 0 && c > s[top[j - 1]] + b[top[j - 1]]) {
                top[j] = top[j - 1];
                j--;
            }
            top[j] = e;
        }
        for (Py_ssize_t i = 1; i < k; i++) { /* stable insertion sort by unbiased score, descending */
            const int64_t e = top[i];
            Py_ssize_t j = i;
            while (j > 0 && s[e] > s[top[j - 1]]) {
                top[j] = top[j - 1];
                j--;
            }
            top[j] = e;
        }
        DONE(1);
    }
    PyBuffer_Release(&sc);
    PyBuffer_Release(&bias);
    PyBuffer_Release(&ids);
    return result;
}

PyDoc_STRVAR(weights_doc, "routing_weights(scores, ids, renormalize, scaling, eps, out)\n\n"
                          "out[j] = scores[ids[j]] * c in double, c = scaling / (sum + eps) when renormalize else scaling: "
                          "scores float32 [E], ids int64 [k] (each in 0..E-1), out float32 [k].");

static PyObject *routing_weights(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer sc, ids, out;
    int renorm;
    double scaling, eps;
    if (!PyArg_ParseTuple(args, "y*y*pddw*", &sc, &ids, &renorm, &scaling, &eps, &out)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t E = sc.len / 4, k = ids.len / 8;
    const int64_t *id = ids.buf;
    int ok = ids.len == 8 * k && out.len == 4 * k;
    for (Py_ssize_t j = 0; ok && j < k; j++) ok = id[j] >= 0 && id[j] < E;
    if (!ok)
        size_error("routing_weights: scores float32 [E], ids int64 [k] in 0..E-1, out float32 [k] expected");
    else {
        const float *s = sc.buf;
        double sum = 0.0;
        for (Py_ssize_t j = 0; j < k; j++) sum += s[id[j]];
        const double c = renorm ? scaling / (sum + eps) : scaling;
        for (Py_ssize_t j = 0; j < k; j++) ((float *)out.buf)[j] = (float)(s[id[j]] * c);
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
    float lb;
    Py_ssize_t H;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*fnw*", &win, &conv, &y, &raw, &dt, &A, &lb, &H, &out)) return NULL;
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
            float acc = e[0] * t[0];
            for (Py_ssize_t j = 1; j < W; j++) acc += e[j] * t[j];
            o[c] = acc;
        }
        for (Py_ssize_t c = 0; c < 3 * P; c++) o[c] = o[c] / (1.0f + kx_expf(-o[c])); /* (a pass of its own: vectorised) */
        for (Py_ssize_t i = 3 * P; i < 4 * P + H; i++) o[i] = 1.0f / (1.0f + kx_expf(-yy[i]));
        float *alpha = o + 4 * P + H;
        for (Py_ssize_t i = 0; i < P; i++) {
            const float g = (rw[i] + db[i]) * aa[i];
            alpha[i] = kx_expf(1.0f / (1.0f + kx_expf(-g)) * lb);
        }
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
    {"situ", situ, METH_VARARGS, situ_doc},
    {"set_row", set_row, METH_VARARGS, set_row_doc},
    {"source_softmax", source_softmax, METH_VARARGS, source_softmax_doc},
    {"sigmoid", sigmoid, METH_VARARGS, sigmoid_doc},
    {"select_experts", select_experts, METH_VARARGS, select_doc},
    {"routing_weights", routing_weights, METH_VARARGS, weights_doc},
    {"kda_gates", kda_gates, METH_VARARGS, kda_gates_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_token_ops", "The token form's small steps, compiled (CPU, float32): token_ops.py.", -1, methods,
};

PyMODINIT_FUNC PyInit__token_ops(void) { return PyModule_Create(&module); }
