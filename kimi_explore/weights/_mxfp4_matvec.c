/* Matrix-vector products straight from MXFP4-packed routed experts (CPU).

   For expert e = ids[n] and output row r (see mxfp4.py for the format):

       out[n, r] = sum_g 2^(scale[e, r, g] - 127) * sum_{c in group g} E2M1(code[e, r, c]) * x[n, c]

   Each weight is the exact dequantised value (E2M1 value x power of two), applied as a power of
   two to the group's partial sum (the same product, exactly, barring under/overflow of the partial
   sum; a scale byte from EDGE_SCALE on, where decoded weights overflow to inf, decodes them one at a
   time). Only the float32 summation order differs from a BLAS matvec on the dequantised matrix.

   x arrives deinterleaved per row of inputs: xeo[m] = [x[0::2] | x[1::2]] (H floats each), so that
   the LOW nibble of byte j (column 2j) meets xe[j] and the HIGH nibble (column 2j + 1) meets xo[j].

   Kernels: AVX-512F (16-entry float table in one register, vpermps), AVX2+FMA (8-entry magnitude
   table plus the sign bit), portable C (_kernel_isa.h picks). The GIL is released while computing;
   callers split [start, stop) over threads.

   Two entry points, the same row kernels: `expert_matvec` reads experts from [E, R, H] banks (the
   bytes copied into RAM at load); `parts_matvec` reads each selected expert from its own buffers,
   one per row block (w1 and w3 of w13), wherever they lie: views of the memory-mapped shards
   (experts="mapped"). The same bytes through the same row kernel give the same floats, bit for bit.
   Every size is checked here, before any byte is read.

   Two more (the sequence path, at the end of this file): `grouped_matmat` and `grouped_parts_matmat`
   multiply GROUPS of input rows, each by its own expert, decoding every weight once per tile of
   input rows, or (groups of 12 or more, AVX2 and AVX-512) once per tile of weights into float32 panels
   multiplied as BLAS does (the expert's bytes come from memory once per call). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_kernel_isa.h"
#include "_panels_avx2.h"
#include "_panels_avx512.h"

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static float POW2[256]; /* 2^(s - 127) as float32 (s = 0: 2^-127, subnormal; s = 255: inf), as mxfp4.py */

typedef void (*row_fn)(const uint8_t *row, const uint8_t *srow, const float *xe, const float *xo, Py_ssize_t G, float *y);

/* From this scale byte on a decoded weight overflows float32: 4 x 2^126 and 6 x 2^126 are past FLT_MAX, and byte 255
   is 2^128 = inf, where a zero code decodes to 0 x inf = NaN. mxfp4.dequantize (the dense route) and the grouped
   kernels below hold those inf and NaN weights; the power of two applied to the group's partial sum would instead
   give finite outputs from weights that do not exist in float32 (a finite token path where the sequence path and
   the dense route give NaN). Such a group (never in a real checkpoint: K3's scales are 120..122) takes the dense
   route's decoded weights, one at a time. */
#define EDGE_SCALE 253

static float edge_group(const uint8_t *bytes, uint8_t sbyte, const float *xe, const float *xo) {
    const float p = POW2[sbyte];
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s += (E2M1[bytes[j] & 15] * p) * xe[j] + (E2M1[bytes[j] >> 4] * p) * xo[j];
    return s;
}

static void row_portable(const uint8_t *row, const uint8_t *srow, const float *xe, const float *xo, Py_ssize_t G, float *y) {
    float acc = 0.0f;
    for (Py_ssize_t g = 0; g < G; g++) {
        if (srow[g] >= EDGE_SCALE) {
            acc += edge_group(row + 16 * g, srow[g], xe + 16 * g, xo + 16 * g);
            continue;
        }
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
/* The 16 E2M1 values of 8 bytes (AVX2): *lo the low nibbles' (columns 2j), *hi the high nibbles' (2j + 1); the
   magnitude from an 8-entry table (vpermps reads 3 index bits), the sign bit put in by xor. Unscaled. */
__attribute__((always_inline, target("avx2,fma"))) static inline void e2m1_avx2(const uint8_t *bytes, __m256 *lo, __m256 *hi) {
    const __m256 mag = _mm256_loadu_ps(E2M1);
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    *lo = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, d), _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 28), sign)));
    *hi = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, _mm256_srli_epi32(d, 4)),
                        _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 24), sign)));
}

__attribute__((target("avx2,fma"))) static void row_avx2(const uint8_t *row, const uint8_t *srow, const float *xe,
                                                        const float *xo, Py_ssize_t G, float *y) {
    __m256 acc = _mm256_setzero_ps();
    for (Py_ssize_t g = 0; g < G; g++) {
        if (srow[g] >= EDGE_SCALE) {  /* into lane 0 */
            acc = _mm256_add_ps(acc, _mm256_setr_ps(edge_group(row + 16 * g, srow[g], xe + 16 * g, xo + 16 * g),
                                                    0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f));
            continue;
        }
        __m256 s = _mm256_setzero_ps();
        for (int h = 0; h < 16; h += 8) {
            const Py_ssize_t i = 16 * g + h;
            __m256 lo, hi;
            e2m1_avx2(row + i, &lo, &hi);
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
        if (srow[g] >= EDGE_SCALE || srow[g + 1] >= EDGE_SCALE) {  /* both groups one at a time, into lane 0 */
            for (int h = 0; h < 2; h++) {
                const Py_ssize_t gh = g + h, ih = 16 * gh;
                float part;
                if (srow[gh] >= EDGE_SCALE)
                    part = edge_group(row + ih, srow[gh], xe + ih, xo + ih);
                else
                    row_portable(row + ih, srow + gh, xe + ih, xo + ih, 1, &part);
                acc0 = _mm512_add_ps(acc0, _mm512_maskz_mov_ps((__mmask16)1, _mm512_set1_ps(part)));
            }
            continue;
        }
        __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + i)));
        __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + i + 16)));
        __m512 s0 = _mm512_mul_ps(_mm512_permutexvar_ps(d0, lut), _mm512_loadu_ps(xe + i));
        __m512 s1 = _mm512_mul_ps(_mm512_permutexvar_ps(d1, lut), _mm512_loadu_ps(xe + i + 16));
        s0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d0, 4), lut), _mm512_loadu_ps(xo + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d1, 4), lut), _mm512_loadu_ps(xo + i + 16), s1);
        acc0 = _mm512_fmadd_ps(s0, _mm512_set1_ps(POW2[srow[g]]), acc0);
        acc1 = _mm512_fmadd_ps(s1, _mm512_set1_ps(POW2[srow[g + 1]]), acc1);
    }
    if (g < G && srow[g] >= EDGE_SCALE)
        acc0 = _mm512_add_ps(acc0, _mm512_maskz_mov_ps((__mmask16)1, _mm512_set1_ps(edge_group(row + 16 * g, srow[g], xe + 16 * g,
                                                                                                xo + 16 * g))));
    else if (g < G) {
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

/* Whether every expert id id[0..n-1] is in 0..E-1; else an IndexError naming the first that is not. */
static int ids_in_range(const int64_t *id, Py_ssize_t n, Py_ssize_t E) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (id[i] < 0 || id[i] >= E) {
            PyErr_Format(PyExc_IndexError, "expert id %lld outside 0..%zd", (long long)id[i], E - 1);
            return 0;
        }
    }
    return 1;
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
    if (!ids_in_range(id, k, E)) goto done;
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


/* ---------------------------------------------------------------- several input rows per weight pass

   For group j (expert e = experts[j], input rows i = bounds[j] .. bounds[j+1]-1):

       out[i, r] = sum_c Wd_e[r, c] * x[i, c],     Wd = E2M1 value * 2^(scale - 127)

   Here the power of two multiplies each decoded weight (exactly the float32 `mxfp4.dequantize` value:
   the product of a power of two and a 2-bit-mantissa value is exact down to 2^-149), so each output is
   an ordinary float32 dot product with the dequantised matrix, in the kernel's own order. A tile is a
   few weight rows x a few input rows (portable 4 x 4, AVX2 2 x 5, AVX-512 4 x 5: 20 accumulators in
   AVX-512's registers): each 16-byte group of each row is decoded once, then multiplied into every input
   of the tile; the rows stay in L1 while the next tiles of inputs pass. Threads split the flat (group, row) range [start, stop). */

/* Where the weight rows of a group come from: one [E, R, H] bank, or P row blocks per group (parts). */
typedef struct {
    const uint8_t *P, *S;          /* bank: packed [E, R, H], scale [E, R, G] */
    const uint8_t *B;              /* ggml: blocks [E, R, G, 17] (llama.cpp's layout), read through group_row */
    const int64_t *experts;        /* bank: group j's expert */
    const Py_buffer *bufs;         /* parts: group j's block p at j * nparts + p (packed), then m * nparts more (scales) */
    Py_ssize_t nparts, m, off[MAX_PARTS + 1];
    Py_ssize_t R, H, G;
} row_source;

static inline void source_row(const row_source *src, Py_ssize_t j, Py_ssize_t r, const uint8_t **row, const uint8_t **srow) {
    if (src->bufs == NULL) {
        const Py_ssize_t at = (Py_ssize_t)src->experts[j] * src->R + r;
        *row = src->P + at * src->H;
        *srow = src->S + at * src->G;
        return;
    }
    Py_ssize_t p = 0;
    while (r >= src->off[p + 1]) p++;
    const Py_ssize_t rr = r - src->off[p];
    *row = (const uint8_t *)src->bufs[j * src->nparts + p].buf + rr * src->H;
    *srow = (const uint8_t *)src->bufs[src->m * src->nparts + j * src->nparts + p].buf + rr * src->G;
}

static void ggml_row_to_ct(const uint8_t *blocks, Py_ssize_t G, uint8_t *qs, uint8_t *sc, int isa);

/* source_row for the tiles, where the expert may be in ggml blocks (src->B): then the row is put in compressed-tensors
   order into `slot` (16 G code bytes, then G scale bytes; `ggml_row_to_ct`), which stands for the row: the same bytes
   the bank would hold, so the same floats. (The panels reorder a tile's rows in `panels_run`.) */
static inline void group_row(const row_source *src, uint8_t *slot, Py_ssize_t j, Py_ssize_t r, int isa, const uint8_t **row,
                             const uint8_t **srow) {
    if (src->B == NULL) {
        source_row(src, j, r, row, srow);
        return;
    }
    const Py_ssize_t G = src->G;
    ggml_row_to_ct(src->B + ((Py_ssize_t)src->experts[j] * src->R + r) * G * 17, G, slot, slot + 16 * G, isa);
    *row = slot;
    *srow = slot + 16 * G;
}
#define GGML_SLOTS 64 /* rows reordered at once: a panel tile's 64 (a tile's 4) */

#define MM_ROWS 4   /* weight rows per tile */
#define MM_INPUTS 4 /* input rows per tile */

/* out[i * ldo + a] = row a . input i, for a < nr <= MM_ROWS and every i < ni (inputs at X + i * ldx: [xe | xo],
   H floats each), in passes of at most MM_INPUTS (portable), AVX2_INPUTS or AVX512_INPUTS inputs. */
typedef void (*tile_fn)(const uint8_t *const *rows, const uint8_t *const *srows, int nr, const float *X, Py_ssize_t ldx,
                        int ni, Py_ssize_t H, float *out, Py_ssize_t ldo);

static void tile_portable_n(const uint8_t *const *rows, const uint8_t *const *srows, int nr, const float *X, Py_ssize_t ldx,
                            int ni, Py_ssize_t H, float *out, Py_ssize_t ldo) {
    float acc[MM_ROWS][MM_INPUTS] = {{0.0f}};
    for (Py_ssize_t g = 0; g < H / 16; g++) {
        for (int a = 0; a < nr; a++) {
            float lo[16], hi[16], p = POW2[srows[a][g]];
            for (int j = 0; j < 16; j++) {
                const uint8_t b = rows[a][16 * g + j];
                lo[j] = E2M1[b & 15] * p;
                hi[j] = E2M1[b >> 4] * p;
            }
            for (int i = 0; i < ni; i++) {
                const float *xe = X + i * ldx + 16 * g, *xo = xe + H;
                float s = 0.0f;
                for (int j = 0; j < 16; j++) s += lo[j] * xe[j] + hi[j] * xo[j];
                acc[a][i] += s;
            }
        }
    }
    for (int a = 0; a < nr; a++)
        for (int i = 0; i < ni; i++) out[i * ldo + a] = acc[a][i];
}

static void tile_portable(const uint8_t *const *rows, const uint8_t *const *srows, int nr, const float *X, Py_ssize_t ldx,
                          int ni, Py_ssize_t H, float *out, Py_ssize_t ldo) {
    for (int i = 0; i < ni; i += MM_INPUTS)
        tile_portable_n(rows, srows, nr, X + i * ldx, ldx, ni - i < MM_INPUTS ? ni - i : MM_INPUTS, H, out + i * ldo, ldo);
}

#ifdef KX_X86
/* nr, ni are constants at every call (tile_avx2 / tile_avx512 below), so the loops unroll into registers. */
#define AVX2_INPUTS 5 /* inputs per AVX2 tile: 2 rows x 5 inputs are 10 accumulators, 4 decoded weights and an input */
__attribute__((always_inline, target("avx2,fma"))) static inline void tile_avx2_n(const uint8_t *const *rows,
        const uint8_t *const *srows, const int nr, const float *X, Py_ssize_t ldx, const int ni, Py_ssize_t H, float *out,
        Py_ssize_t ldo) {
    __m256 acc[2][AVX2_INPUTS];
    for (int a = 0; a < nr; a++)
        for (int i = 0; i < ni; i++) acc[a][i] = _mm256_setzero_ps();
    for (Py_ssize_t c = 0; c < H; c += 8) {  /* half a group: 8 bytes, 16 weights */
        __m256 lo[2], hi[2];
        for (int a = 0; a < nr; a++) {
            const __m256 p = _mm256_set1_ps(POW2[srows[a][c / 16]]);
            e2m1_avx2(rows[a] + c, &lo[a], &hi[a]);
            lo[a] = _mm256_mul_ps(lo[a], p);
            hi[a] = _mm256_mul_ps(hi[a], p);
        }
        for (int i = 0; i < ni; i++) {
            const __m256 xe = _mm256_loadu_ps(X + i * ldx + c), xo = _mm256_loadu_ps(X + i * ldx + H + c);
            for (int a = 0; a < nr; a++) acc[a][i] = _mm256_fmadd_ps(hi[a], xo, _mm256_fmadd_ps(lo[a], xe, acc[a][i]));
        }
    }
    for (int a = 0; a < nr; a++)
        for (int i = 0; i < ni; i++) {
            __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc[a][i]), _mm256_extractf128_ps(acc[a][i], 1));
            t = _mm_add_ps(t, _mm_movehl_ps(t, t));
            t = _mm_add_ss(t, _mm_movehdup_ps(t));
            out[i * ldo + a] = _mm_cvtss_f32(t);
        }
}

__attribute__((target("avx2,fma"))) static void tile_avx2(const uint8_t *const *rows, const uint8_t *const *srows, int nr,
                                                         const float *X, Py_ssize_t ldx, int ni, Py_ssize_t H, float *out,
                                                         Py_ssize_t ldo) {
    /* 2 rows (a last odd row alone) x up to 5 inputs, the inputs cut into as few passes as that allows, as even as
       possible (each pass decodes the rows again): K3's experts get ~4.6 of a chunk's rows each (at 256), so a group of
       5 is one pass, not 4 + 1; 9 is 5 + 4, 11 is 4 + 4 + 3. Per (row, input) the same products in the same order as
       one input at a time. */
#define KX_TILE(NR, NI) tile_avx2_n(rows + a, srows + a, NR, X + i * ldx, ldx, NI, H, out + i * ldo + a, ldo)
    const int passes = (ni + AVX2_INPUTS - 1) / AVX2_INPUTS;
    for (int a = 0; a < nr;) {
        const int two = nr - a >= 2;
        for (int p = 0, i = 0; p < passes; p++) {
            const int n = (ni - i + passes - p - 1) / (passes - p);
            switch (n) {
                case 5: if (two) KX_TILE(2, 5); else KX_TILE(1, 5); break;
                case 4: if (two) KX_TILE(2, 4); else KX_TILE(1, 4); break;
                case 3: if (two) KX_TILE(2, 3); else KX_TILE(1, 3); break;
                case 2: if (two) KX_TILE(2, 2); else KX_TILE(1, 2); break;
                default: if (two) KX_TILE(2, 1); else KX_TILE(1, 1); break;
            }
            i += n;
        }
        a += two ? 2 : 1;
    }
#undef KX_TILE
}

#define AVX512_INPUTS 5 /* inputs per AVX-512 tile: 4 rows x 5 inputs are 20 accumulators, 8 decoded weights, 2 inputs
                           and the table: 31 of the 32 registers */
__attribute__((always_inline, target("avx512f"))) static inline void tile_avx512_n(const uint8_t *const *rows,
        const uint8_t *const *srows, const int nr, const float *X, Py_ssize_t ldx, const int ni, Py_ssize_t H, float *out,
        Py_ssize_t ldo) {
    const __m512 lut = _mm512_loadu_ps(E2M1);  /* vpermps reads the low 4 bits of each lane */
    __m512 acc[MM_ROWS][AVX512_INPUTS];
    for (int a = 0; a < nr; a++)
        for (int i = 0; i < ni; i++) acc[a][i] = _mm512_setzero_ps();
    for (Py_ssize_t c = 0; c < H; c += 16) {  /* one group: 16 bytes, 32 weights */
        __m512 lo[MM_ROWS], hi[MM_ROWS];
        for (int a = 0; a < nr; a++) {
            const __m512 p = _mm512_set1_ps(POW2[srows[a][c / 16]]);
            const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rows[a] + c)));
            lo[a] = _mm512_mul_ps(_mm512_permutexvar_ps(d, lut), p);
            hi[a] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), lut), p);
        }
        for (int i = 0; i < ni; i++) {
            const __m512 xe = _mm512_loadu_ps(X + i * ldx + c), xo = _mm512_loadu_ps(X + i * ldx + H + c);
            for (int a = 0; a < nr; a++) acc[a][i] = _mm512_fmadd_ps(hi[a], xo, _mm512_fmadd_ps(lo[a], xe, acc[a][i]));
        }
    }
    for (int a = 0; a < nr; a++)
        for (int i = 0; i < ni; i++) out[i * ldo + a] = _mm512_reduce_add_ps(acc[a][i]);
}

__attribute__((target("avx512f"))) static void tile_avx512(const uint8_t *const *rows, const uint8_t *const *srows, int nr,
                                                          const float *X, Py_ssize_t ldx, int ni, Py_ssize_t H, float *out,
                                                          Py_ssize_t ldo) {
    /* 4 rows (fewer: one at a time) x up to 5 inputs, the inputs cut into as few passes as that allows, as even as
       possible (each pass decodes the rows again), as tile_avx2 does: a group of 5 is one pass, 7 is 4 + 3 (it was
       4 + 1 + 1 + 1). Per (row, input) the same products in the same order as one input at a time. */
#define KX_TILE(NR, NI) tile_avx512_n(rows + a, srows + a, NR, X + i * ldx, ldx, NI, H, out + i * ldo + a, ldo)
#define KX_TILES(NR)                      \
    switch (n) {                          \
        case 5: KX_TILE(NR, 5); break;    \
        case 4: KX_TILE(NR, 4); break;    \
        case 3: KX_TILE(NR, 3); break;    \
        case 2: KX_TILE(NR, 2); break;    \
        default: KX_TILE(NR, 1); break;   \
    }
    const int passes = (ni + AVX512_INPUTS - 1) / AVX512_INPUTS;
    for (int a = 0; a < nr;) {
        const int four = nr - a >= MM_ROWS;
        for (int p = 0, i = 0; p < passes; p++) {
            const int n = (ni - i + passes - p - 1) / (passes - p);
            if (four) KX_TILES(MM_ROWS) else KX_TILES(1)
            i += n;
        }
        a += four ? MM_ROWS : 1;
    }
#undef KX_TILES
#undef KX_TILE
}
#define KX_TILE_KERNEL(isa) ((isa) == 2 ? tile_avx512 : (isa) == 1 ? tile_avx2 : tile_portable)

/* A group of MXFP4_PANEL_MIN_INPUTS or more input rows (AVX2, AVX-512) is multiplied as BLAS does (_panels_avx2.h,
   _panels_avx512.h): the weights of a tile of PANEL_ROWS rows x PANEL_K columns (PANEL_K / 2 bytes) are decoded once
   into float32 panels in the columns' own order, which stay in L2 while all the group's inputs (as given: x, not xeo)
   meet them; a row's outputs wait in `out` between column tiles. Each output is the float32 sum, in column order, of
   the exact dequantised weights times the inputs: another order than the tiles', within the same float64 bound
   (tests/test_mxfp4_matvec.py), and the same floats on panels of 8 rows (AVX2) and 16 (AVX-512). At K3's expert
   shape (6144 x 3584; a Xeon with AVX-512, one core) the 16-row panels reach 100-133 GFLOP/s from 36 inputs on
   (sgemm 129-133 in the same runs), the 8-row ones 62-76 and AVX-512's tiles 56-77. */

#define MXFP4_PANEL_MIN_INPUTS 12  /* fewer: the tiles, which decode each weight once per 4-5 inputs but skip the panels'
                                      transposes, stores and loads (as fast at 12 inputs, faster below, on an AVX2 VM;
                                      on the Xeon, 4-10 inputs: tiles 73-99 GFLOP/s, 16-row panels 27-51) */

/* The tile of rows r0 .. r0 + nr - 1 (nr <= PANEL_ROWS), bytes c0 .. c1 - 1 (c1 - c0 <= PANEL_K / 2) of group j's
   expert, as panels of `width` rows (8: _panels_avx2.h's, 16: _panels_avx512.h's): P[(q * PANEL_K + 2 (c - c0) + h)
   * width + a] = the weight of row r0 + width q + a in byte c's low (h = 0, column 2c) or high nibble (h = 1, column
   2c + 1); rows past nr are 0. Decoded 8 rows at a time (AVX2: the values are exact, whatever the vectors). */
__attribute__((target("avx2,fma"))) static void decode_panels(const row_source *src, Py_ssize_t j, Py_ssize_t r0, int nr,
                                                             Py_ssize_t c0, Py_ssize_t c1, float *P, int width) {
    const int padded = (nr + width - 1) / width * width;
    for (int q = 0; q * 8 < padded; q++) {  /* 8 rows: row 8q + a, stored at panel 8q / width, lane 8q % width + a */
        const uint8_t *row[8], *srow[8];
        for (int a = 0; a < 8; a++) {
            if (8 * q + a < nr)
                source_row(src, j, r0 + 8 * q + a, &row[a], &srow[a]);
            else row[a] = srow[a] = NULL;
        }
        for (Py_ssize_t c = c0; c < c1; c += 8) {
            __m256 lo[8], hi[8];
            for (int a = 0; a < 8; a++) {
                if (row[a] == NULL) {
                    lo[a] = hi[a] = _mm256_setzero_ps();
                    continue;
                }
                const __m256 p = _mm256_set1_ps(POW2[srow[a][c / 16]]);
                e2m1_avx2(row[a] + c, &lo[a], &hi[a]);
                lo[a] = _mm256_mul_ps(lo[a], p);
                hi[a] = _mm256_mul_ps(hi[a], p);
            }
            transpose8(lo);
            transpose8(hi);
            float *dst = P + ((Py_ssize_t)(8 * q / width) * PANEL_K + 2 * (c - c0)) * width + 8 * q % width;
            for (int k = 0; k < 8; k++) {
                _mm256_storeu_ps(dst + 2 * k * width, lo[k]);
                _mm256_storeu_ps(dst + (2 * k + 1) * width, hi[k]);
            }
        }
    }
}

/* Rows r0..r1-1 of group j's expert times its ni inputs X [ni, 2H] (x as given) -> Y[i * ldy + r], on panels of 8 rows
   (isa 1, AVX2) or 16 (isa 2, AVX-512F): the same floats. P: PANEL_ROWS x PANEL_K floats (scratch). */
__attribute__((target("avx2,fma"))) static void panels_run(const row_source *src, uint8_t *slots, Py_ssize_t j, Py_ssize_t r0,
                                                          Py_ssize_t r1, const float *X, Py_ssize_t ni, float *Y, Py_ssize_t ldy,
                                                          float *P, int isa) {
    const Py_ssize_t H = src->H, G = src->G;
    const int64_t first = 0;
    for (Py_ssize_t rb = r0; rb < r1; rb += PANEL_ROWS) {
        const int nr = (int)(r1 - rb < PANEL_ROWS ? r1 - rb : PANEL_ROWS);
        /* ggml blocks: the tile's rows reordered once, whole (codes [nr, H] then scales [nr, G] in `slots`), and the
           panels decoded from there as from a bank of one expert */
        const row_source ct = {.P = slots, .S = slots + GGML_SLOTS * H, .experts = &first, .R = nr, .H = H, .G = G};
        if (src->B != NULL)
            for (int a = 0; a < nr; a++)
                ggml_row_to_ct(src->B + ((Py_ssize_t)src->experts[j] * src->R + rb + a) * G * 17, G, slots + a * H,
                               slots + GGML_SLOTS * H + a * G, isa);
        const row_source *from = src->B != NULL ? &ct : src;
        for (Py_ssize_t c0 = 0; c0 < H; c0 += PANEL_K / 2) {
            const Py_ssize_t c1 = H - c0 < PANEL_K / 2 ? H : c0 + PANEL_K / 2;
            decode_panels(from, src->B != NULL ? 0 : j, src->B != NULL ? 0 : rb, nr, c0, c1, P, isa == 2 ? 16 : 8);
            if (isa == 2)
                panels16_times_inputs_avx512(P, nr, X + 2 * c0, 2 * H, ni, 2 * (c1 - c0), Y + rb, ldy, c0 == 0);
            else
                panels_times_inputs_avx2(P, nr, X + 2 * c0, 2 * H, ni, 2 * (c1 - c0), Y + rb, ldy, c0 == 0);
        }
    }
}
#else
#define KX_TILE_KERNEL(isa) tile_portable
#endif

/* The flat (group, row) range [start, stop), MM_ROWS rows per tile (never across a group); X: the inputs as xeo, Xin: as
   given (the panels'). GIL released by the caller. */
static void grouped_run(const row_source *src, uint8_t *slots, const int64_t *bounds, const float *X, const float *Xin,
                        float *Y, Py_ssize_t start, Py_ssize_t stop, int isa) {
    const Py_ssize_t R = src->R, H = src->H;
    const tile_fn tile = KX_TILE_KERNEL(isa);
#ifdef KX_X86
    float *P = NULL;  /* the panel route's scratch, made at its first group */
    int panels = isa >= 1;
#endif
    for (Py_ssize_t t = start; t < stop;) {
        const Py_ssize_t j = t / R, r = t - j * R, i0 = (Py_ssize_t)bounds[j], ni = (Py_ssize_t)bounds[j + 1] - i0;
#ifdef KX_X86
        if (panels && ni >= MXFP4_PANEL_MIN_INPUTS) {
            if (P == NULL) panels = (P = malloc(sizeof(float) * PANEL_ROWS * PANEL_K)) != NULL;  /* no memory: the tiles */
            if (panels) {
                const Py_ssize_t r1 = stop - j * R < R ? stop - j * R : R;
                panels_run(src, slots, j, r, r1, Xin + i0 * 2 * H, ni, Y + i0 * R, R, P, isa);
                t += r1 - r;
                continue;
            }
        }
#endif
        Py_ssize_t nr = R - r < stop - t ? R - r : stop - t;
        if (nr > MM_ROWS) nr = MM_ROWS;
        const uint8_t *rows[MM_ROWS], *srows[MM_ROWS];
        for (Py_ssize_t a = 0; a < nr; a++) group_row(src, slots + a * 17 * src->G, j, r + a, isa, &rows[a], &srows[a]);
        for (Py_ssize_t i = 0; i < ni; i += 1 << 20)  /* ni fits an int */
            tile(rows, srows, (int)nr, X + (i0 + i) * 2 * H, 2 * H, (int)(ni - i < (1 << 20) ? ni - i : 1 << 20), H,
                 Y + (i0 + i) * R + r, R);
        t += nr;
    }
#ifdef KX_X86
    free(P);
#endif
}

/* Checks of bounds, x, out and the range shared by both entry points (NULL: fine). */
static const char *check_groups(const Py_buffer *bounds, Py_ssize_t m, const Py_buffer *xeo, const Py_buffer *x,
                                const Py_buffer *out, Py_ssize_t R, Py_ssize_t H, Py_ssize_t start, Py_ssize_t stop) {
    if (bounds->len != 8 * (m + 1)) return "bounds: expected int64 [m + 1] (m groups)";
    const int64_t *b = (const int64_t *)bounds->buf;
    if (b[0] != 0) return "bounds: must start at 0";
    for (Py_ssize_t j = 0; j < m; j++)
        if (b[j + 1] < b[j]) return "bounds: must not decrease";
    if (xeo->len != 8 * H * b[m]) return "xeo: expected float32 [n, 2, H], n = bounds[-1]";
    if (x->len != 8 * H * b[m]) return "x: expected float32 [n, 2H], n = bounds[-1]";
    if (out->len != 4 * R * b[m]) return "out: expected float32 [n, R], n = bounds[-1]";
    if (start < 0 || start > stop || stop > m * R) return "start/stop: outside 0..m*R";
    return NULL;
}

PyDoc_STRVAR(grouped_matmat_doc,
             "grouped_matmat(packed, scale, experts, bounds, xeo, x, out, R, H, start, stop, isa)\n\n"
             "packed uint8 [E, R, H], scale uint8 [E, R, H/16], experts int64 [m], bounds int64 [m + 1] (group j:\n"
             "input rows bounds[j]..bounds[j+1]-1), xeo float32 [n, 2, H], x float32 [n, 2H] (the same inputs, as given:\n"
             "xeo[i] = [x[i, 0::2] | x[i, 1::2]]), out float32 [n, R] (flat (group, row)\n"
             "units start..stop-1 written): C-contiguous buffers. isa: a name from isas() or '' for the best.\n"
             "scale None: packed is ggml's MXFP4 blocks, uint8 [E, R, H/16, 17], read in place (a bank or the mapped\n"
             "GGUF); each row is put in compressed-tensors order as it is needed (a tile's 4 rows, a panel tile's 64,\n"
             "each once), so the same floats as on the compressed-tensors bytes of the same weights.");

static PyObject *grouped_matmat(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer packed, scale = {0}, experts, bounds, xeo, x, out;
    PyObject *scale_obj;
    Py_ssize_t R, H, start, stop;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "y*Oy*y*y*y*w*nnnns", &packed, &scale_obj, &experts, &bounds, &xeo, &x, &out, &R, &H,
                          &start, &stop, &isa_name))
        return NULL;
    PyObject *result = NULL;
    const char *err = NULL;
    uint8_t *slots = NULL;
    const int ggml = scale_obj == Py_None;
    const Py_ssize_t m = experts.len / 8, G = H / 16, row_bytes = ggml ? 17 * G : H;
    Py_ssize_t E = 0;
    if (!ggml && PyObject_GetBuffer(scale_obj, &scale, PyBUF_C_CONTIGUOUS) < 0) goto done;
    int isa = isa_index(isa_name);
    if (R <= 0 || H <= 0 || H % 16) err = "R must be > 0 and H a positive multiple of 16 (whole 32-value groups)";
    else if (isa < 0) err = "isa: not one of isas() on this CPU";
    else if (experts.len % 8) err = "experts: expected an int64 buffer";
    else if (packed.len % (R * row_bytes) || (E = packed.len / (R * row_bytes)) == 0)
        err = ggml ? "blocks: size is not E * R * H/16 * 17 bytes" : "packed: size is not E * R * H bytes";
    else if (!ggml && scale.len != E * R * G) err = "scale: size is not E * R * H/16 bytes";
    else err = check_groups(&bounds, m, &xeo, &x, &out, R, H, start, stop);
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    const int64_t *id = (const int64_t *)experts.buf;
    if (!ids_in_range(id, m, E)) goto done;
    if (ggml && (slots = PyMem_Malloc((size_t)GGML_SLOTS * G * 17)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    row_source src = {.experts = id, .m = m, .R = R, .H = H, .G = G};
    if (ggml) src.B = packed.buf;
    else src.P = packed.buf, src.S = scale.buf;
    Py_BEGIN_ALLOW_THREADS
    grouped_run(&src, slots, (const int64_t *)bounds.buf, (const float *)xeo.buf, (const float *)x.buf, (float *)out.buf,
                start, stop, isa);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(slots);
    PyBuffer_Release(&packed);
    if (scale.obj != NULL) PyBuffer_Release(&scale);
    PyBuffer_Release(&experts);
    PyBuffer_Release(&bounds);
    PyBuffer_Release(&xeo);
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(grouped_parts_matmat_doc,
             "grouped_parts_matmat(packed, scale, rows, bounds, xeo, x, out, H, start, stop, isa)\n\n"
             "packed, scale: sequences of m * P buffers, group j's expert's row block p at j * P + p: uint8\n"
             "[rows[p], H] and [rows[p], H/16], C-contiguous; rows: the P block heights (R = their sum); bounds\n"
             "int64 [m + 1]; xeo float32 [n, 2, H], x float32 [n, 2H]: as grouped_matmat; out float32 [n, R] (flat (group, row)\n"
             "units start..stop-1).");

static PyObject *grouped_parts_matmat(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *packed_seq, *scale_seq, *rows_seq;
    Py_buffer bounds, xeo, x, out;
    Py_ssize_t H, start, stop;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "OOOy*y*y*w*nnns", &packed_seq, &scale_seq, &rows_seq, &bounds, &xeo, &x, &out, &H, &start,
                          &stop, &isa_name))
        return NULL;
    PyObject *result = NULL, *pf = NULL, *sf = NULL, *rf = NULL;
    Py_buffer *bufs = NULL; /* [2 * m * P]: packed blocks, then scale blocks */
    row_source src = {.H = H, .G = H / 16};
    Py_ssize_t acquired = 0, P = 0, m = 0, G = H / 16;
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
        Py_ssize_t r = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(rf, p));
        if (r == -1 && PyErr_Occurred()) goto done;
        if (r <= 0) err = "rows: every block needs at least one row";
        src.off[p + 1] = src.off[p] + r;
    }
    src.R = src.off[P];
    m = PySequence_Fast_GET_SIZE(pf) / P;
    if (err != NULL) {
    } else if (H <= 0 || H % 16) err = "H must be a positive multiple of 16 (whole 32-value groups)";
    else if (isa < 0) err = "isa: not one of isas() on this CPU";
    else if (m == 0 || PySequence_Fast_GET_SIZE(pf) != m * P || PySequence_Fast_GET_SIZE(sf) != m * P)
        err = "packed/scale: expected m * P buffers each (m >= 1 groups, P row blocks)";
    else err = check_groups(&bounds, m, &xeo, &x, &out, src.R, H, start, stop);
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    bufs = PyMem_Calloc(2 * m * P, sizeof(Py_buffer));
    if (bufs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < 2 * m * P; j++) {
        const int is_scale = j >= m * P;
        const Py_ssize_t i = j % (m * P), p = i % P, want = (src.off[p + 1] - src.off[p]) * (is_scale ? G : H);
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(is_scale ? sf : pf, i), &bufs[j], PyBUF_SIMPLE) < 0) goto done;
        acquired++;
        if (bufs[j].len != want) {
            PyErr_Format(PyExc_ValueError, "%s block %zd of group %zd: %zd bytes, expected %zd ([%zd, %zd] uint8)",
                         is_scale ? "scale" : "packed", p, i / P, bufs[j].len, want, src.off[p + 1] - src.off[p],
                         is_scale ? G : H);
            goto done;
        }
    }
    src.bufs = bufs;
    src.nparts = P;
    src.m = m;
    Py_BEGIN_ALLOW_THREADS
    grouped_run(&src, NULL, (const int64_t *)bounds.buf, (const float *)xeo.buf, (const float *)x.buf, (float *)out.buf, start,
                stop, isa);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t j = 0; j < acquired; j++) PyBuffer_Release(&bufs[j]);
    PyMem_Free(bufs);
    Py_XDECREF(pf);
    Py_XDECREF(sf);
    Py_XDECREF(rf);
    PyBuffer_Release(&bounds);
    PyBuffer_Release(&xeo);
    PyBuffer_Release(&x);
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
static void ggml_row_to_ct_portable(const uint8_t *blocks, Py_ssize_t G, uint8_t *qs, uint8_t *sc) {
    for (Py_ssize_t g = 0; g < G; g++) {
        const uint8_t *b = blocks + 17 * g, *q = b + 1;
        uint8_t *o = qs + 16 * g;
        sc[g] = b[0];
        for (int m = 0; m < 8; m++) o[m] = (uint8_t)((q[2 * m] & 15) | ((q[2 * m + 1] & 15) << 4));
        for (int m = 8; m < 16; m++) o[m] = (uint8_t)((q[2 * m - 16] >> 4) | (q[2 * m - 15] & 0xF0));
    }
}

#ifdef KX_X86
/* The same bytes, 16 at a time (SSSE3): the block's 32 codes as nibbles [low nibbles | high nibbles], then output byte
   m = nibble 2m | nibble 2m + 1 << 4 (two byte shuffles). The grouped kernels reorder a row per tile (and per column
   tile of a panel), where the scalar loop was half the time at 5 rows of K3's experts. */
__attribute__((target("ssse3"))) static void ggml_row_to_ct_ssse3(const uint8_t *blocks, Py_ssize_t G, uint8_t *qs,
                                                                 uint8_t *sc) {
    const __m128i nib = _mm_set1_epi8(15);
    const __m128i even = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i odd = _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    for (Py_ssize_t g = 0; g < G; g++) {
        const uint8_t *b = blocks + 17 * g;
        sc[g] = b[0];
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 1));
        const __m128i lo = _mm_and_si128(q, nib), hi = _mm_and_si128(_mm_srli_epi16(q, 4), nib);  /* codes 0-15, 16-31 */
        const __m128i e = _mm_unpacklo_epi64(_mm_shuffle_epi8(lo, even), _mm_shuffle_epi8(hi, even));  /* codes 2m */
        const __m128i o = _mm_unpacklo_epi64(_mm_shuffle_epi8(lo, odd), _mm_shuffle_epi8(hi, odd));    /* codes 2m + 1 */
        _mm_storeu_si128((__m128i *)(qs + 16 * g), _mm_or_si128(e, _mm_slli_epi16(o, 4)));  /* (o < 16: no carry) */
    }
}
#endif

/* isa 0 (the portable kernels) the scalar loop, else SSSE3 (every AVX2 CPU has it): both run in the tests */
static void ggml_row_to_ct(const uint8_t *blocks, Py_ssize_t G, uint8_t *qs, uint8_t *sc, int isa) {
#ifdef KX_X86
    if (isa >= 1) {
        ggml_row_to_ct_ssse3(blocks, G, qs, sc);
        return;
    }
#endif
    (void)isa;
    ggml_row_to_ct_portable(blocks, G, qs, sc);
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
    if (!ids_in_range(id, k, E)) goto done;
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
        ggml_row_to_ct(B + (e * R + r) * G * 17, G, scratch, scratch + 16 * G, isa);
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
    {"grouped_matmat", grouped_matmat, METH_VARARGS, grouped_matmat_doc},
    {"grouped_parts_matmat", grouped_parts_matmat, METH_VARARGS, grouped_parts_matmat_doc},
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
