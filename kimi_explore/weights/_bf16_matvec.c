/* A bf16-resident matrix times a float32 vector (CPU): weight_dtype="bfloat16" at speed.

       y[r] = sum_c f32(W[r, c]) * x[c]       W: uint16 bf16 bits [R, C], x: float32 [C]

   f32(b) puts the 16 bits in the high half of a float32 (exact: bf16 is truncated float32), so
   every product is the one the widened float32 matrix gives; only the float32 summation order
   differs from BLAS on that matrix (tests bound it against float64). Each row is one dot product
   split over independent accumulators (4 vectors in the SIMD kernels, 8 lanes in the portable one)
   then summed pairwise, the columns past the last whole vector added one by one.

   Kernels: AVX-512F (16 columns per vector), AVX2+FMA (8), portable C, chosen at run time
   (_kernel_isa.h). The GIL is released; callers split the rows [start, stop) over threads.

   `bf16_matmat` (the sequence path) multiplies n input rows at once, out[i, r] = W[r] . x[i]: tiles of
   4 weight rows x 4 inputs, each weight vector widened once per tile and multiplied into the 4 inputs
   (16 accumulators), so W's bytes come from memory once per call; from 5 inputs on (AVX2; AVX-512 from 12), float32
   panels widened once per tile of 64 rows x 256 columns and multiplied as BLAS does (_panels_avx2.h,
   _panels_avx512.h). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#include "_kernel_isa.h"
#include "_panels_avx2.h"
#include "_panels_avx512.h"

typedef void (*row_fn)(const uint16_t *w, const float *x, Py_ssize_t C, float *y);

static inline float widen(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void row_portable(const uint16_t *w, const float *x, Py_ssize_t C, float *y) {
    float a[8] = {0};
    Py_ssize_t c = 0;
    for (; c + 8 <= C; c += 8)
        for (int j = 0; j < 8; j++) a[j] += widen(w[c + j]) * x[c + j];
    float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    for (; c < C; c++) s += widen(w[c]) * x[c];
    *y = s;
}

#ifdef KX_X86
__attribute__((target("avx2,fma"))) static inline __m256 widen8(const uint16_t *w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}

__attribute__((target("avx2,fma"))) static void row_avx2(const uint16_t *w, const float *x, Py_ssize_t C, float *y) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    Py_ssize_t c = 0;
    for (; c + 32 <= C; c += 32) {
        a0 = _mm256_fmadd_ps(widen8(w + c), _mm256_loadu_ps(x + c), a0);
        a1 = _mm256_fmadd_ps(widen8(w + c + 8), _mm256_loadu_ps(x + c + 8), a1);
        a2 = _mm256_fmadd_ps(widen8(w + c + 16), _mm256_loadu_ps(x + c + 16), a2);
        a3 = _mm256_fmadd_ps(widen8(w + c + 24), _mm256_loadu_ps(x + c + 24), a3);
    }
    for (; c + 8 <= C; c += 8) a0 = _mm256_fmadd_ps(widen8(w + c), _mm256_loadu_ps(x + c), a0);
    __m256 v = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    float s = _mm_cvtss_f32(t);
    for (; c < C; c++) s += widen(w[c]) * x[c];
    *y = s;
}

__attribute__((target("avx512f"))) static inline __m512 widen16(const uint16_t *w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16));
}

__attribute__((target("avx512f"))) static void row_avx512(const uint16_t *w, const float *x, Py_ssize_t C, float *y) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    Py_ssize_t c = 0;
    for (; c + 64 <= C; c += 64) {
        a0 = _mm512_fmadd_ps(widen16(w + c), _mm512_loadu_ps(x + c), a0);
        a1 = _mm512_fmadd_ps(widen16(w + c + 16), _mm512_loadu_ps(x + c + 16), a1);
        a2 = _mm512_fmadd_ps(widen16(w + c + 32), _mm512_loadu_ps(x + c + 32), a2);
        a3 = _mm512_fmadd_ps(widen16(w + c + 48), _mm512_loadu_ps(x + c + 48), a3);
    }
    for (; c + 16 <= C; c += 16) a0 = _mm512_fmadd_ps(widen16(w + c), _mm512_loadu_ps(x + c), a0);
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    for (; c < C; c++) s += widen(w[c]) * x[c];
    *y = s;
}
#endif


PyDoc_STRVAR(bf16_matvec_doc,
             "bf16_matvec(w, x, out, R, C, start, stop, isa)\n\n"
             "w uint16 [R, C] (bf16 bits), x float32 [C], out float32 [R] (rows start..stop-1 written):\n"
             "C-contiguous buffers. isa: a name from isas() or '' for the best this CPU has.");

static PyObject *bf16_matvec(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer w, x, out;
    Py_ssize_t R, C, start, stop;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*y*w*nnnns", &w, &x, &out, &R, &C, &start, &stop, &isa_name)) return NULL;
    PyObject *result = NULL;
    const char *err = NULL;
    int isa = isa_index(isa_name);
    if (R <= 0 || C <= 0) err = "R and C must be > 0";
    else if (isa < 0) err = "isa: not one of isas() on this CPU";
    else if (w.len != 2 * R * C) err = "w: size is not R * C uint16";
    else if (x.len != 4 * C) err = "x: expected float32 [C]";
    else if (out.len != 4 * R) err = "out: expected float32 [R]";
    else if (start < 0 || start > stop || stop > R) err = "start/stop: outside 0..R";
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
    } else {
        row_fn row = KX_ROW_KERNEL(isa);
        const uint16_t *W = (const uint16_t *)w.buf;
        const float *X = (const float *)x.buf;
        float *Y = (float *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = start; r < stop; r++) row(W + r * C, X, C, Y + r);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return result;
}


/* ---------------------------------------------------------------- several input rows per pass over W */

#define MM_ROWS 4
#define MM_INPUTS 4

/* out[i * ldo + a] = W[a] . x_i for a < nr <= MM_ROWS, i < ni <= MM_INPUTS (W rows at w + a * C, inputs at X + i * C). */
typedef void (*tile_fn)(const uint16_t *w, int nr, const float *X, int ni, Py_ssize_t C, float *out, Py_ssize_t ldo);

static void tile_portable(const uint16_t *w, int nr, const float *X, int ni, Py_ssize_t C, float *out, Py_ssize_t ldo) {
    float acc[MM_ROWS][MM_INPUTS][4] = {{{0.0f}}};
    Py_ssize_t c = 0;
    for (; c + 4 <= C; c += 4)
        for (int a = 0; a < nr; a++) {
            float v[4];
            for (int j = 0; j < 4; j++) v[j] = widen(w[a * C + c + j]);
            for (int i = 0; i < ni; i++)
                for (int j = 0; j < 4; j++) acc[a][i][j] += v[j] * X[i * C + c + j];
        }
    for (int a = 0; a < nr; a++)
        for (int i = 0; i < ni; i++) {
            float s = (acc[a][i][0] + acc[a][i][1]) + (acc[a][i][2] + acc[a][i][3]);
            for (Py_ssize_t k = c; k < C; k++) s += widen(w[a * C + k]) * X[i * C + k];
            out[i * ldo + a] = s;
        }
}

#ifdef KX_X86
__attribute__((always_inline, target("avx2,fma"))) static inline void tile_avx2_n(const uint16_t *w, const int nr, const float *X,
                                                                                const int ni, Py_ssize_t C, float *out, Py_ssize_t ldo) {
    __m256 acc[MM_ROWS][MM_INPUTS];
    for (int a = 0; a < nr; a++)
        for (int i = 0; i < ni; i++) acc[a][i] = _mm256_setzero_ps();
    Py_ssize_t c = 0;
    for (; c + 8 <= C; c += 8) {
        __m256 v[MM_ROWS];
        for (int a = 0; a < nr; a++) v[a] = widen8(w + a * C + c);
        for (int i = 0; i < ni; i++) {
            const __m256 x = _mm256_loadu_ps(X + i * C + c);
            for (int a = 0; a < nr; a++) acc[a][i] = _mm256_fmadd_ps(v[a], x, acc[a][i]);
        }
    }
    for (int a = 0; a < nr; a++)
        for (int i = 0; i < ni; i++) {
            __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc[a][i]), _mm256_extractf128_ps(acc[a][i], 1));
            t = _mm_add_ps(t, _mm_movehl_ps(t, t));
            t = _mm_add_ss(t, _mm_movehdup_ps(t));
            float s = _mm_cvtss_f32(t);
            for (Py_ssize_t k = c; k < C; k++) s += widen(w[a * C + k]) * X[i * C + k];
            out[i * ldo + a] = s;
        }
}

__attribute__((target("avx2,fma"))) static void tile_avx2(const uint16_t *w, int nr, const float *X, int ni, Py_ssize_t C,
                                                         float *out, Py_ssize_t ldo) {
    /* 2 rows x the ni <= 4 inputs in one pass (3 inputs: one pass, not three): 8 accumulators, 2 weights and an input in
       the 16 ymm registers. Per (row, input) the same products in the same order whatever the pass holds. */
#define KX_TILE(NR, NI) tile_avx2_n(w + a * C, NR, X, NI, C, out + a, ldo)
    for (int a = 0; a < nr; a += 2) {
        const int two = nr - a >= 2;
        switch (ni) {
            case 4: if (two) KX_TILE(2, 4); else KX_TILE(1, 4); break;
            case 3: if (two) KX_TILE(2, 3); else KX_TILE(1, 3); break;
            case 2: if (two) KX_TILE(2, 2); else KX_TILE(1, 2); break;
            default: if (two) KX_TILE(2, 1); else KX_TILE(1, 1); break;
        }
    }
#undef KX_TILE
}

__attribute__((always_inline, target("avx512f"))) static inline void tile_avx512_n(const uint16_t *w, const int nr, const float *X,
                                                                                  const int ni, Py_ssize_t C, float *out,
                                                                                  Py_ssize_t ldo) {
    __m512 acc[MM_ROWS][MM_INPUTS];
    for (int a = 0; a < nr; a++)
        for (int i = 0; i < ni; i++) acc[a][i] = _mm512_setzero_ps();
    Py_ssize_t c = 0;
    for (; c + 16 <= C; c += 16) {
        __m512 v[MM_ROWS];
        for (int a = 0; a < nr; a++) v[a] = widen16(w + a * C + c);
        for (int i = 0; i < ni; i++) {
            const __m512 x = _mm512_loadu_ps(X + i * C + c);
            for (int a = 0; a < nr; a++) acc[a][i] = _mm512_fmadd_ps(v[a], x, acc[a][i]);
        }
    }
    for (int a = 0; a < nr; a++)
        for (int i = 0; i < ni; i++) {
            float s = _mm512_reduce_add_ps(acc[a][i]);
            for (Py_ssize_t k = c; k < C; k++) s += widen(w[a * C + k]) * X[i * C + k];
            out[i * ldo + a] = s;
        }
}

__attribute__((target("avx512f"))) static void tile_avx512(const uint16_t *w, int nr, const float *X, int ni, Py_ssize_t C,
                                                          float *out, Py_ssize_t ldo) {
    /* 4 rows (fewer: one at a time) x the ni <= 4 inputs in one pass, as tile_avx2 */
#define KX_TILE(NR, NI) tile_avx512_n(w + a * C, NR, X, NI, C, out + a, ldo)
    for (int a = 0; a < nr;) {
        const int four = nr - a >= MM_ROWS;
        switch (ni) {
            case 4: if (four) KX_TILE(MM_ROWS, 4); else KX_TILE(1, 4); break;
            case 3: if (four) KX_TILE(MM_ROWS, 3); else KX_TILE(1, 3); break;
            case 2: if (four) KX_TILE(MM_ROWS, 2); else KX_TILE(1, 2); break;
            default: if (four) KX_TILE(MM_ROWS, 1); else KX_TILE(1, 1); break;
        }
        a += four ? MM_ROWS : 1;
    }
#undef KX_TILE
}
#define KX_TILE_KERNEL(isa) ((isa) == 2 ? tile_avx512 : (isa) == 1 ? tile_avx2 : tile_portable)

/* BF16_PANEL_MIN_INPUTS or more inputs (AVX2, AVX-512): the weights widened once per tile of PANEL_ROWS rows x
   PANEL_K columns into float32 panels of `width` rows (8: _panels_avx2.h, 16: _panels_avx512.h), multiplied as BLAS
   does; each output the float32 sum of its products in column order (the same floats on either width). Panels:
   P[(q * PANEL_K + k) * width + a] = f32(W[r0 + width q + a, c0 + k]), rows past nr 0. */
#define BF16_PANEL_MIN_INPUTS 5     /* fewer inputs: the tiles (no transposes) */
#define BF16_PANEL16_MIN_INPUTS 12  /* AVX-512's tiles are faster up to here (a Xeon, K3's 4096 x 7168: tiles 49-52
                                       GFLOP/s at 5-16 inputs, 16-row panels 20-25 at 5-8, 65-74 at 12-16, 90-98 at
                                       24-64) */

__attribute__((target("avx2,fma"))) static void widen_panels(const uint16_t *W, Py_ssize_t C, Py_ssize_t r0, int nr,
                                                            Py_ssize_t c0, Py_ssize_t c1, float *P, int width) {
    const int padded = (nr + width - 1) / width * width;
    for (int q = 0; 8 * q < padded; q++) {  /* 8 rows: row 8q + a, stored at panel 8q / width, lane 8q % width + a */
        const uint16_t *row[8];
        for (int a = 0; a < 8; a++) row[a] = 8 * q + a < nr ? W + (r0 + 8 * q + a) * C : NULL;
        float *panel = P + (Py_ssize_t)(8 * q / width) * PANEL_K * width + 8 * q % width - c0 * width;
        Py_ssize_t c = c0;
        for (; c + 8 <= c1; c += 8) {
            __m256 v[8];
            for (int a = 0; a < 8; a++) v[a] = row[a] ? widen8(row[a] + c) : _mm256_setzero_ps();
            transpose8(v);
            for (int k = 0; k < 8; k++) _mm256_storeu_ps(panel + (c + k) * width, v[k]);
        }
        for (; c < c1; c++)
            for (int a = 0; a < 8; a++) panel[c * width + a] = row[a] ? widen(row[a][c]) : 0.0f;
    }
}

/* out[i * R + r] = W[r] . x_i for rows start..stop-1, every input, on panels of 8 rows (isa 1) or 16 (isa 2); P:
   PANEL_ROWS x PANEL_K floats (scratch) */
__attribute__((target("avx2,fma"))) static void panels_run(const uint16_t *W, Py_ssize_t R, Py_ssize_t C, const float *X,
                                                          Py_ssize_t n, float *Y, Py_ssize_t start, Py_ssize_t stop, float *P,
                                                          int isa) {
    for (Py_ssize_t rb = start; rb < stop; rb += PANEL_ROWS) {
        const int nr = (int)(stop - rb < PANEL_ROWS ? stop - rb : PANEL_ROWS);
        for (Py_ssize_t c0 = 0; c0 < C; c0 += PANEL_K) {
            const Py_ssize_t c1 = C - c0 < PANEL_K ? C : c0 + PANEL_K;
            widen_panels(W, C, rb, nr, c0, c1, P, isa == 2 ? 16 : 8);
            if (isa == 2)
                panels16_times_inputs_avx512(P, nr, X + c0, C, n, c1 - c0, Y + rb, R, c0 == 0);
            else
                panels_times_inputs_avx2(P, nr, X + c0, C, n, c1 - c0, Y + rb, R, c0 == 0);
        }
    }
}
#else
#define KX_TILE_KERNEL(isa) tile_portable
#endif

PyDoc_STRVAR(bf16_matmat_doc,
             "bf16_matmat(w, x, out, R, C, n, start, stop, isa)\n\n"
             "w uint16 [R, C] (bf16 bits), x float32 [n, C], out float32 [n, R] (columns start..stop-1, i.e. the\n"
             "weight rows, written): C-contiguous buffers. isa: a name from isas() or '' for the best.");

static PyObject *bf16_matmat(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer w, x, out;
    Py_ssize_t R, C, n, start, stop;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*y*w*nnnnns", &w, &x, &out, &R, &C, &n, &start, &stop, &isa_name)) return NULL;
    PyObject *result = NULL;
    const char *err = NULL;
    int isa = isa_index(isa_name);
    if (R <= 0 || C <= 0 || n < 0) err = "R and C must be > 0, n >= 0";
    else if (isa < 0) err = "isa: not one of isas() on this CPU";
    else if (w.len != 2 * R * C) err = "w: size is not R * C uint16";
    else if (x.len != 4 * n * C) err = "x: expected float32 [n, C]";
    else if (out.len != 4 * n * R) err = "out: expected float32 [n, R]";
    else if (start < 0 || start > stop || stop > R) err = "start/stop: outside 0..R";
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
    } else {
        tile_fn tile = KX_TILE_KERNEL(isa);
        const uint16_t *W = (const uint16_t *)w.buf;
        const float *X = (const float *)x.buf;
        float *Y = (float *)out.buf;
        float *P = NULL;
#ifdef KX_X86
        if (isa >= 1 && n >= (isa == 2 ? BF16_PANEL16_MIN_INPUTS : BF16_PANEL_MIN_INPUTS))
            P = malloc(sizeof(float) * PANEL_ROWS * PANEL_K);  /* NULL: the tiles */
#endif
        Py_BEGIN_ALLOW_THREADS
#ifdef KX_X86
        if (P != NULL) {
            panels_run(W, R, C, X, n, Y, start, stop, P, isa);
            start = stop;  /* done: no tiles below */
        }
#endif
        for (Py_ssize_t r = start; r < stop; r += MM_ROWS) {
            const int nr = stop - r < MM_ROWS ? (int)(stop - r) : MM_ROWS;
            for (Py_ssize_t i = 0; i < n; i += MM_INPUTS)
                tile(W + r * C, nr, X + i * C, n - i < MM_INPUTS ? (int)(n - i) : MM_INPUTS, C, Y + i * R + r, R);
        }
        Py_END_ALLOW_THREADS
        free(P);
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"bf16_matvec", bf16_matvec, METH_VARARGS, bf16_matvec_doc},
    {"bf16_matmat", bf16_matmat, METH_VARARGS, bf16_matmat_doc},
    {"isas", isas, METH_NOARGS, "The kernels this CPU can run, best last."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_bf16_matvec", .m_doc = "bf16 matrix times float32 vector kernels.", .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__bf16_matvec(void) { return PyModule_Create(&module); }
