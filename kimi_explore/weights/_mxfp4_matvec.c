/* Matrix-vector products straight from MXFP4-packed routed experts (CPU).

   For expert e = ids[n] and output row r (see mxfp4.py for the format):

       out[n, r] = sum_g 2^(scale[e, r, g] - 127) * sum_{c in group g} E2M1(code[e, r, c]) * x[n, c]

   Each weight is the exact dequantised value (E2M1 value x power of two), applied as a power of
   two to the group's partial sum (the same product, exactly, barring under/overflow of the partial
   sum). Only the float32 summation order differs from a BLAS matvec on the dequantised matrix.

   x arrives deinterleaved per row of inputs: xeo[m] = [x[0::2] | x[1::2]] (H floats each), so that
   the LOW nibble of byte j (column 2j) meets xe[j] and the HIGH nibble (column 2j + 1) meets xo[j].

   Kernels: AVX-512F (16-entry float table in one register, vpermps), AVX2+FMA (8-entry magnitude
   table plus the sign bit), portable C (_kernel_isa.h picks). The GIL is released while computing;
   callers split [start, stop) over threads.

   Two entry points, the same row kernels: `expert_matvec` reads experts from [E, R, H] banks (the
   bytes copied into RAM at load); `parts_matvec` reads each selected expert from its own buffers,
   one per row block (w1 and w3 of w13), wherever they lie: views of the memory-mapped shards
   (experts="mapped"). The same bytes through the same row kernel give the same floats, bit for bit.
   Every size is checked here, before any byte is read. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#include "_kernel_isa.h"

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static float POW2[256]; /* 2^(s - 127) as float32 (s = 0: 2^-127, subnormal; s = 255: inf), as mxfp4.py */

typedef void (*row_fn)(const uint8_t *row, const uint8_t *srow, const float *xe, const float *xo, Py_ssize_t G, float *y);

static void row_portable(const uint8_t *row, const uint8_t *srow, const float *xe, const float *xo, Py_ssize_t G, float *y) {
    float acc = 0.0f;
    for (Py_ssize_t g = 0; g < G; g++) {
        float s = 0.0f;
        for (int j = 0; j < 16; j++) {
            Py_ssize_t i = 16 * g + j;
            s += E2M1[row[i] & 15] * xe[i] + E2M1[row[i] >> 4] * xo[i];
        }
        acc += s * POW2[srow[g]];
    }
    *y = acc;
}

#ifdef KX_X86
__attribute__((target("avx2,fma"))) static void row_avx2(const uint8_t *row, const uint8_t *srow, const float *xe,
                                                        const float *xo, Py_ssize_t G, float *y) {
    const __m256 mag = _mm256_loadu_ps(E2M1);  /* entries 0..7: the magnitudes; vpermps reads 3 index bits */
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    __m256 acc = _mm256_setzero_ps();
    for (Py_ssize_t g = 0; g < G; g++) {
        __m256 s = _mm256_setzero_ps();
        for (int h = 0; h < 16; h += 8) {
            const Py_ssize_t i = 16 * g + h;
            __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + i)));
            __m256 lo = _mm256_permutevar8x32_ps(mag, d);
            __m256 hi = _mm256_permutevar8x32_ps(mag, _mm256_srli_epi32(d, 4));
            lo = _mm256_xor_ps(lo, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 28), sign)));
            hi = _mm256_xor_ps(hi, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 24), sign)));
            s = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xe + i), s);
            s = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xo + i), s);
        }
        acc = _mm256_fmadd_ps(s, _mm256_set1_ps(POW2[srow[g]]), acc);
    }
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    *y = _mm_cvtss_f32(t);
}

__attribute__((target("avx512f"))) static void row_avx512(const uint8_t *row, const uint8_t *srow, const float *xe,
                                                         const float *xo, Py_ssize_t G, float *y) {
    const __m512 lut = _mm512_loadu_ps(E2M1);  /* vpermps reads the low 4 bits of each lane: byte & 15 */
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    Py_ssize_t g = 0;
    for (; g + 1 < G; g += 2) {  /* two groups in flight */
        const Py_ssize_t i = 16 * g;
        __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + i)));
        __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + i + 16)));
        __m512 s0 = _mm512_mul_ps(_mm512_permutexvar_ps(d0, lut), _mm512_loadu_ps(xe + i));
        __m512 s1 = _mm512_mul_ps(_mm512_permutexvar_ps(d1, lut), _mm512_loadu_ps(xe + i + 16));
        s0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d0, 4), lut), _mm512_loadu_ps(xo + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d1, 4), lut), _mm512_loadu_ps(xo + i + 16), s1);
        acc0 = _mm512_fmadd_ps(s0, _mm512_set1_ps(POW2[srow[g]]), acc0);
        acc1 = _mm512_fmadd_ps(s1, _mm512_set1_ps(POW2[srow[g + 1]]), acc1);
    }
    if (g < G) {
        const Py_ssize_t i = 16 * g;
        __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + i)));
        __m512 s0 = _mm512_mul_ps(_mm512_permutexvar_ps(d0, lut), _mm512_loadu_ps(xe + i));
        s0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d0, 4), lut), _mm512_loadu_ps(xo + i), s0);
        acc0 = _mm512_fmadd_ps(s0, _mm512_set1_ps(POW2[srow[g]]), acc0);
    }
    *y = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif


/* The checks both entry points make of x, out and the flat row range (NULL: all good; *nx: rows of x). */
static const char *check_x_out(const Py_buffer *xeo, const Py_buffer *out, Py_ssize_t H, Py_ssize_t k, Py_ssize_t R,
                               Py_ssize_t start, Py_ssize_t stop, Py_ssize_t *nx) {
    if (xeo->len % (8 * H) || ((*nx = xeo->len / (8 * H)) != 1 && *nx != k)) return "xeo: expected float32 [1 or k, 2, H]";
    if (out->len != 4 * k * R) return "out: expected float32 [k, R]";
    if (start < 0 || start > stop || stop > k * R) return "start/stop: outside 0..k*R";
    return NULL;
}

PyDoc_STRVAR(expert_matvec_doc,
             "expert_matvec(packed, scale, ids, xeo, out, R, H, start, stop, isa)\n\n"
             "packed uint8 [E, R, H], scale uint8 [E, R, H/16], ids int64 [k], xeo float32 [1 or k, 2, H],\n"
             "out float32 [k, R] (written at flat rows start..stop-1): C-contiguous buffers. isa: a name\n"
             "from isas() or '' for the best this CPU has.");

static PyObject *expert_matvec(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer packed, scale, ids, xeo, out;
    Py_ssize_t R, H, start, stop;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*nnnns", &packed, &scale, &ids, &xeo, &out, &R, &H, &start, &stop, &isa_name))
        return NULL;
    PyObject *result = NULL;
    const char *err = NULL;
    Py_ssize_t k = ids.len / 8, G = H / 16, E = 0, nx = 0;
    int isa = isa_index(isa_name);
    if (R <= 0 || H <= 0 || H % 16) err = "R must be > 0 and H a positive multiple of 16 (whole 32-value groups)";
    else if (isa < 0) err = "isa: not one of isas() on this CPU";
    else if (ids.len % 8 || k == 0) err = "ids: expected a non-empty int64 buffer";
    else if (packed.len % (R * H) || (E = packed.len / (R * H)) == 0) err = "packed: size is not E * R * H bytes";
    else if (scale.len != E * R * G) err = "scale: size is not E * R * H/16 bytes";
    else err = check_x_out(&xeo, &out, H, k, R, start, stop, &nx);
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    const int64_t *id = (const int64_t *)ids.buf;
    for (Py_ssize_t n = 0; n < k; n++) {
        if (id[n] < 0 || id[n] >= E) {
            PyErr_Format(PyExc_IndexError, "expert id %lld outside 0..%zd", (long long)id[n], E - 1);
            goto done;
        }
    }
    row_fn row = KX_ROW_KERNEL(isa);
    const uint8_t *P = (const uint8_t *)packed.buf, *S = (const uint8_t *)scale.buf;
    const float *X = (const float *)xeo.buf;
    float *Y = (float *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = start; t < stop; t++) {
        const Py_ssize_t n = t / R, r = t - n * R, e = (Py_ssize_t)id[n];
        const float *xe = X + (nx == 1 ? 0 : n) * 2 * H;
        row(P + (e * R + r) * H, S + (e * R + r) * G, xe, xe + H, G, Y + t);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&packed);
    PyBuffer_Release(&scale);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&xeo);
    PyBuffer_Release(&out);
    return result;
}

#define MAX_PARTS 8 /* row blocks per expert matrix (w13 has 2) */

PyDoc_STRVAR(parts_matvec_doc,
             "parts_matvec(packed, scale, rows, xeo, out, H, start, stop, isa)\n\n"
             "packed, scale: sequences of k * P buffers, selected expert n's row block p at n * P + p: uint8\n"
             "[rows[p], H] and [rows[p], H/16], C-contiguous (e.g. read-only views of a mapped shard);\n"
             "rows: the P block heights (R = their sum); xeo float32 [1 or k, 2, H]; out float32 [k, R]\n"
             "(written at flat rows start..stop-1). isa: a name from isas() or '' for the best.");

static PyObject *parts_matvec(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *packed_seq, *scale_seq, *rows_seq;
    Py_buffer xeo, out;
    Py_ssize_t H, start, stop;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "OOOy*w*nnns", &packed_seq, &scale_seq, &rows_seq, &xeo, &out, &H, &start, &stop, &isa_name))
        return NULL;
    PyObject *result = NULL, *pf = NULL, *sf = NULL, *rf = NULL;
    Py_buffer *bufs = NULL; /* [2 * k * P]: packed blocks, then scale blocks */
    Py_ssize_t acquired = 0, rows[MAX_PARTS], off[MAX_PARTS + 1] = {0}, P = 0, k = 0, R = 0, G = H / 16, nx = 0;
    const char *err = NULL;
    int isa = isa_index(isa_name);
    if (!(pf = PySequence_Fast(packed_seq, "packed: expected a sequence of buffers")) ||
        !(sf = PySequence_Fast(scale_seq, "scale: expected a sequence of buffers")) ||
        !(rf = PySequence_Fast(rows_seq, "rows: expected a sequence of ints")))
        goto done;
    P = PySequence_Fast_GET_SIZE(rf);
    if (P < 1 || P > MAX_PARTS) {
        PyErr_Format(PyExc_ValueError, "rows: expected 1..%d row blocks, got %zd", MAX_PARTS, P);
        goto done;
    }
    for (Py_ssize_t p = 0; p < P; p++) {
        rows[p] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(rf, p));
        if (rows[p] == -1 && PyErr_Occurred()) goto done;
        if (rows[p] <= 0) err = "rows: every block needs at least one row";
        off[p + 1] = off[p] + rows[p];
    }
    R = off[P];
    k = PySequence_Fast_GET_SIZE(pf) / P;
    if (err != NULL) {
    } else if (H <= 0 || H % 16) err = "H must be a positive multiple of 16 (whole 32-value groups)";
    else if (isa < 0) err = "isa: not one of isas() on this CPU";
    else if (k == 0 || PySequence_Fast_GET_SIZE(pf) != k * P || PySequence_Fast_GET_SIZE(sf) != k * P)
        err = "packed/scale: expected k * P buffers each (k >= 1 selected experts, P row blocks)";
    else err = check_x_out(&xeo, &out, H, k, R, start, stop, &nx);
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    bufs = PyMem_Calloc(2 * k * P, sizeof(Py_buffer));
    if (bufs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < 2 * k * P; j++) {
        const int is_scale = j >= k * P;
        const Py_ssize_t i = j % (k * P), p = i % P, want = rows[p] * (is_scale ? G : H);
        PyObject *obj = PySequence_Fast_GET_ITEM(is_scale ? sf : pf, i);
        if (PyObject_GetBuffer(obj, &bufs[j], PyBUF_SIMPLE) < 0) goto done; /* NumPy refuses non-contiguous */
        acquired++;
        if (bufs[j].len != want) {
            PyErr_Format(PyExc_ValueError, "%s block %zd of expert %zd: %zd bytes, expected %zd ([%zd, %zd] uint8)",
                         is_scale ? "scale" : "packed", p, i / P, bufs[j].len, want, rows[p], is_scale ? G : H);
            goto done;
        }
    }
    row_fn row = KX_ROW_KERNEL(isa);
    const float *X = (const float *)xeo.buf;
    float *Y = (float *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = start; t < stop; t++) {
        const Py_ssize_t n = t / R, r = t - n * R;
        Py_ssize_t p = 0;
        while (r >= off[p + 1]) p++;
        const Py_ssize_t rr = r - off[p];
        const float *xe = X + (nx == 1 ? 0 : n) * 2 * H;
        row((const uint8_t *)bufs[n * P + p].buf + rr * H, (const uint8_t *)bufs[k * P + n * P + p].buf + rr * G, xe, xe + H,
            G, Y + t);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t j = 0; j < acquired; j++) PyBuffer_Release(&bufs[j]);
    PyMem_Free(bufs);
    Py_XDECREF(pf);
    Py_XDECREF(sf);
    Py_XDECREF(rf);
    PyBuffer_Release(&xeo);
    PyBuffer_Release(&out);
    return result;
}

/* ggml's MXFP4 block layout (llama.cpp GGUF): per 32 values one 17-byte block, e (the E8M0 scale
   byte, as compressed-tensors') then qs[16], byte j holding value j's code in its LOW nibble and
   value j + 16's in its HIGH nibble. The row is read in place from the bank (or the mapped file);
   its nibbles are put in compressed-tensors order (byte m = values 2m | 2m + 1) in a row-sized
   scratch of G * 17 bytes that stays in L1, and the SAME row kernel runs on it: the same products
   in the same order as `expert_matvec` on the compressed-tensors bytes of the same weights, so
   the same floats, bit for bit. */
static void ggml_row_to_ct(const uint8_t *blocks, Py_ssize_t G, uint8_t *qs, uint8_t *sc) {
    for (Py_ssize_t g = 0; g < G; g++) {
        const uint8_t *b = blocks + 17 * g, *q = b + 1;
        uint8_t *o = qs + 16 * g;
        sc[g] = b[0];
        for (int m = 0; m < 8; m++) o[m] = (uint8_t)((q[2 * m] & 15) | ((q[2 * m + 1] & 15) << 4));
        for (int m = 8; m < 16; m++) o[m] = (uint8_t)((q[2 * m - 16] >> 4) | (q[2 * m - 15] & 0xF0));
    }
}

PyDoc_STRVAR(ggml_matvec_doc,
             "ggml_matvec(blocks, ids, xeo, out, R, H, start, stop, isa)\n\n"
             "blocks uint8 [E, R, H/16, 17] (ggml MXFP4 blocks of R rows of 2H values), ids int64 [k],\n"
             "xeo float32 [1 or k, 2, H] (as expert_matvec), out float32 [k, R] (written at flat rows\n"
             "start..stop-1): C-contiguous buffers. isa: a name from isas() or '' for the best.");

static PyObject *ggml_matvec(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer blocks, ids, xeo, out;
    Py_ssize_t R, H, start, stop;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnnns", &blocks, &ids, &xeo, &out, &R, &H, &start, &stop, &isa_name)) return NULL;
    PyObject *result = NULL;
    const char *err = NULL;
    uint8_t *scratch = NULL;
    Py_ssize_t k = ids.len / 8, G = H / 16, E = 0, nx = 0;
    int isa = isa_index(isa_name);
    if (R <= 0 || H <= 0 || H % 16) err = "R must be > 0 and H a positive multiple of 16 (whole 32-value blocks)";
    else if (isa < 0) err = "isa: not one of isas() on this CPU";
    else if (ids.len % 8 || k == 0) err = "ids: expected a non-empty int64 buffer";
    else if (blocks.len % (R * G * 17) || (E = blocks.len / (R * G * 17)) == 0) err = "blocks: size is not E * R * H/16 * 17 bytes";
    else err = check_x_out(&xeo, &out, H, k, R, start, stop, &nx);
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    const int64_t *id = (const int64_t *)ids.buf;
    for (Py_ssize_t n = 0; n < k; n++) {
        if (id[n] < 0 || id[n] >= E) {
            PyErr_Format(PyExc_IndexError, "expert id %lld outside 0..%zd", (long long)id[n], E - 1);
            goto done;
        }
    }
    if ((scratch = PyMem_Malloc((size_t)G * 17)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    row_fn row = KX_ROW_KERNEL(isa);
    const uint8_t *B = (const uint8_t *)blocks.buf;
    const float *X = (const float *)xeo.buf;
    float *Y = (float *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = start; t < stop; t++) {
        const Py_ssize_t n = t / R, r = t - n * R, e = (Py_ssize_t)id[n];
        const float *xe = X + (nx == 1 ? 0 : n) * 2 * H;
        ggml_row_to_ct(B + (e * R + r) * G * 17, G, scratch, scratch + 16 * G);
        row(scratch, scratch + 16 * G, xe, xe + H, G, Y + t);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(scratch);
    PyBuffer_Release(&blocks);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&xeo);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"expert_matvec", expert_matvec, METH_VARARGS, expert_matvec_doc},
    {"parts_matvec", parts_matvec, METH_VARARGS, parts_matvec_doc},
    {"ggml_matvec", ggml_matvec, METH_VARARGS, ggml_matvec_doc},
    {"isas", isas, METH_NOARGS, "The kernels this CPU can run, best last."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_mxfp4_matvec", .m_doc = "MXFP4 expert matvec kernels.", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__mxfp4_matvec(void) {
    for (int s = 0; s < 256; s++) POW2[s] = ldexpf(1.0f, s - 127);
    return PyModule_Create(&module);
}
