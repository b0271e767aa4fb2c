/* Float32 panels of 16 rows times many inputs (AVX-512F): the product of _panels_avx2.h with 16-row vectors and up
   to 12 inputs at once (2 panels x 12 inputs = 24 accumulators of AVX-512's 32 registers).

   A caller decodes a tile of its weights (PANEL_ROWS rows x PANEL_K columns) once into PANELS OF 16 ROWS: the
   vector at column k holds the panel's 16 rows' weights there, P[(q * PANEL_K + k) * 16 + a]. Each output is
   the float32 sum of its products in column order, one FMA after another as in _panels_avx2.h: the AVX2
   panels' floats, bit for bit (tests/test_mxfp4_matvec.py). */

#ifndef KX_PANELS_AVX512_H
#define KX_PANELS_AVX512_H

#ifdef KX_X86
#define PANEL16_INPUTS 12 /* inputs per kernel call */

/* lanes a < m set */
static inline __mmask16 rows_mask16(int m) { return m >= 16 ? (__mmask16)0xFFFF : m <= 0 ? 0 : (__mmask16)((1u << m) - 1); }

/* Y[i * ldy + 16q + a] (+)= sum over columns k < n of P[(q * PANEL_K + k) * 16 + a] * X[i * ldx + k], for panels
   q < NQ, inputs i < NI, rows 16q + a < nr only; `first`: from 0, not from Y. NQ and NI are constants at every call:
   the loops over them unroll and the accumulators are registers. */
__attribute__((always_inline, target("avx512f"))) static inline void panel16_fma_n(const float *P, const float *X,
        Py_ssize_t ldx, Py_ssize_t n, float *Y, Py_ssize_t ldy, int nr, int first, const int NQ, const int NI) {
    const __mmask16 m0 = rows_mask16(nr), m1 = rows_mask16(nr - 16);
    const float *p1 = NQ > 1 ? P + PANEL_K * 16 : P;
    __m512 a[PANEL16_INPUTS], b[PANEL16_INPUTS];
    for (int i = 0; i < NI; i++) {
        a[i] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, Y + i * ldy);
        b[i] = first || NQ < 2 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, Y + i * ldy + 16);
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        const __m512 w0 = _mm512_loadu_ps(P + 16 * k), w1 = _mm512_loadu_ps(p1 + 16 * k);
        for (int i = 0; i < NI; i++) {
            const __m512 v = _mm512_set1_ps(X[i * ldx + k]);
            a[i] = _mm512_fmadd_ps(w0, v, a[i]);
            if (NQ > 1) b[i] = _mm512_fmadd_ps(w1, v, b[i]);
        }
    }
    for (int i = 0; i < NI; i++) {
        _mm512_mask_storeu_ps(Y + i * ldy, m0, a[i]);
        if (NQ > 1) _mm512_mask_storeu_ps(Y + i * ldy + 16, m1, b[i]);
    }
}

#define KX_PANEL16_SHAPES(NQ)                                                                  \
    switch (ni) {                                                                                \
        case 12: panel16_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 12); return;               \
        case 11: panel16_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 11); return;               \
        case 10: panel16_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 10); return;               \
        case 9: panel16_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 9); return;                 \
        case 8: panel16_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 8); return;                 \
        case 7: panel16_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 7); return;                 \
        case 6: panel16_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 6); return;                 \
        case 5: panel16_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 5); return;                 \
        case 4: panel16_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 4); return;                 \
        case 3: panel16_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 3); return;                 \
        case 2: panel16_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 2); return;                 \
        default: panel16_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 1); return;                \
    }

/* panel16_fma_n for panels P (nq = 1 or 2 of them, 16 rows each, nr of their rows real), ni = 1..PANEL16_INPUTS
   inputs: each shape compiled on its own */
__attribute__((target("avx512f"))) static void panel16_fma_avx512(const float *P, int nq, const float *X, Py_ssize_t ldx,
                                                                  int ni, Py_ssize_t n, float *Y, Py_ssize_t ldy, int nr,
                                                                  int first) {
    if (nq == 2) KX_PANEL16_SHAPES(2)
    KX_PANEL16_SHAPES(1)
}
#undef KX_PANEL16_SHAPES

/* Y[i * ldy + r] (+)= the tile's 16-row panels (rows r < nr <= PANEL_ROWS, n <= PANEL_K columns) times inputs i < ni
   (X: the tile's first column of input 0, inputs ldx apart): 2 panels and up to PANEL16_INPUTS inputs per call, the
   inputs cut as evenly as that allows (16: 8 + 8, not 12 + 4, whose call would spend its loads on 4 inputs) */
__attribute__((target("avx512f"))) static void panels16_times_inputs_avx512(const float *P, int nr, const float *X,
                                                                           Py_ssize_t ldx, Py_ssize_t ni, Py_ssize_t n,
                                                                           float *Y, Py_ssize_t ldy, int first) {
    const Py_ssize_t calls = (ni + PANEL16_INPUTS - 1) / PANEL16_INPUTS;
    for (Py_ssize_t c = 0, i = 0; c < calls; c++) {
        const int m = (int)((ni - i + (calls - c) - 1) / (calls - c));
        for (int q = 0; 16 * q < nr; q += 2)
            panel16_fma_avx512(P + (Py_ssize_t)q * PANEL_K * 16, 16 * (q + 1) < nr ? 2 : 1, X + i * ldx, ldx, m, n,
                               Y + i * ldy + 16 * q, ldy, nr - 16 * q, first);
        i += m;
    }
}
#endif /* KX_X86 */

#endif /* KX_PANELS_AVX512_H */
