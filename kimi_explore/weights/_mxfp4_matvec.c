/* Matrix-vector products straight from MXFP4-packed routed experts (CPU).

   For expert e = ids[n] and output row r (see mxfp4.py for the format):

       out[n, r] = sum_g 2^(scale[e, r, g] - 127) * sum_{c in group g} E2M1(code[e, r, c]) * x[n, c]

   Each weight is the exact dequantised value (E2M1 value x power of two), applied as a power of
   two to the group's partial sum (the same product, exactly, barring under/overflow of the partial
   sum). Only the float32 summation order differs from a BLAS matvec on the dequantised matrix.

   x arrives deinterleaved per row of inputs: xeo[m] = [x[0::2] | x[1::2]] (H floats each), so that
   the LOW nibble of byte j (column 2j) meets xe[j] and the HIGH nibble (column 2j + 1) meets xo[j].

   Kernels: AVX-512F (16-entry float table in one register, vpermps), AVX2+FMA (8-entry magnitude
   table plus the sign bit), portable C. The best one this CPU has is used unless one is asked for.
   The GIL is released while computing; callers split [start, stop) over threads. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KX_X86 1
#include <immintrin.h>
#endif

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

static const char *const ISA_NAMES[] = {"portable", "avx2", "avx512f"};

static int best_isa(void) {
#ifdef KX_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
}

static row_fn kernel_for(int isa) {
#ifdef KX_X86
    if (isa == 2) return row_avx512;
    if (isa == 1) return row_avx2;
#endif
    return row_portable;
}

static int isa_index(const char *name) {
    for (int i = 0; i < 3; i++)
        if (strcmp(name, ISA_NAMES[i]) == 0) return i;
    return -1;
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
    int isa = *isa_name ? isa_index(isa_name) : best_isa();
    if (R <= 0 || H <= 0 || H % 16) err = "R must be > 0 and H a positive multiple of 16 (whole 32-value groups)";
    else if (isa < 0 || isa > best_isa()) err = "isa: not one of isas() on this CPU";
    else if (ids.len % 8 || k == 0) err = "ids: expected a non-empty int64 buffer";
    else if (packed.len % (R * H) || (E = packed.len / (R * H)) == 0) err = "packed: size is not E * R * H bytes";
    else if (scale.len != E * R * G) err = "scale: size is not E * R * H/16 bytes";
    else if (xeo.len % (8 * H) || ((nx = xeo.len / (8 * H)) != 1 && nx != k)) err = "xeo: expected float32 [1 or k, 2, H]";
    else if (out.len != 4 * k * R) err = "out: expected float32 [k, R]";
    else if (start < 0 || start > stop || stop > k * R) err = "start/stop: outside 0..k*R";
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
    row_fn row = kernel_for(isa);
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

static PyObject *isas(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    int best = best_isa();
    PyObject *names = PyTuple_New(best + 1);
    if (names == NULL) return NULL;
    for (int i = 0; i <= best; i++) PyTuple_SET_ITEM(names, i, PyUnicode_FromString(ISA_NAMES[i]));
    return names;
}

static PyMethodDef methods[] = {
    {"expert_matvec", expert_matvec, METH_VARARGS, expert_matvec_doc},
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
