/* Float32 panels times many inputs, as BLAS multiplies (AVX2+FMA), shared by _mxfp4_matvec.c and _bf16_matvec.c.

   A caller decodes a tile of its weights (PANEL_ROWS rows x PANEL_K columns: MXFP4 codes, bf16 bits) once into
   float32 PANELS of 8 rows: the vector at column k holds the panel's 8 rows' weights there. `panel_fma_avx2`
   then adds, for up to 5 inputs at once, weight vector x broadcast input, column after column, into 8-row
   output vectors: 2 panels x 5 inputs = 10 independent accumulators, which keep both FMA units busy (a dot
   product per output waits on its own chain of dependent FMAs; 12 accumulators spill a register). Each output is the float32 sum of its
   products in column order. */

#ifndef KX_PANELS_AVX2_H
#define KX_PANELS_AVX2_H

#ifdef KX_X86
#define PANEL_ROWS 64     /* weight rows per tile: 8 panels */
#define PANEL_K 256       /* columns per tile: [8, PANEL_K, 8] floats = 64 KB */
#define PANEL_INPUTS 5    /* inputs per kernel call */

/* r[k] <- column k of the 8 x 8 matrix whose rows are r[0..7] */
__attribute__((always_inline, target("avx2,fma"))) static inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* lanes a < m set: the rows of a panel that are real */
__attribute__((always_inline, target("avx2,fma"))) static inline __m256i rows_mask(int m) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Y[i * ldy + 8q + a] (+)= sum over columns k < n of P[q * PANEL_K + k][a] * X[i * ldx + k], for panels q < NQ,
   inputs i < NI, rows 8q + a < nr only; `first`: from 0, not from Y. NQ and NI are constants at every call, so the
   lines past them vanish and the 10 accumulators are registers. */
__attribute__((always_inline, target("avx2,fma"))) static inline void panel_fma_n(const float *P, const float *X, Py_ssize_t ldx,
        Py_ssize_t n, float *Y, Py_ssize_t ldy, int nr, int first, const int NQ, const int NI) {
    const float *x0 = X, *x1 = NI > 1 ? X + ldx : X, *x2 = NI > 2 ? X + 2 * ldx : X, *x3 = NI > 3 ? X + 3 * ldx : X;
    const float *x4 = NI > 4 ? X + 4 * ldx : X;
    const float *p0 = P, *p1 = NQ > 1 ? P + PANEL_K * 8 : P;
    __m256 a0, a1, a2, a3, a4, b0, b1, b2, b3, b4;
    a0 = a1 = a2 = a3 = a4 = b0 = b1 = b2 = b3 = b4 = _mm256_setzero_ps();
#define KX_EACH_INPUT(F) F(0) if (NI > 1) F(1) if (NI > 2) F(2) if (NI > 3) F(3) if (NI > 4) F(4)
#define KX_LOAD(i)                                                                                                    \
    {                                                                                                                 \
        a##i = _mm256_maskload_ps(Y + (i) * ldy, m0);                                                                 \
        if (NQ > 1) b##i = _mm256_maskload_ps(Y + (i) * ldy + 8, m1);                                                 \
    }
#define KX_FMA(i)                                                                                                     \
    {                                                                                                                 \
        const __m256 v = _mm256_broadcast_ss(x##i + k);                                                               \
        a##i = _mm256_fmadd_ps(w0, v, a##i);                                                                          \
        if (NQ > 1) b##i = _mm256_fmadd_ps(w1, v, b##i);                                                              \
    }
#define KX_STORE(i)                                                                                                   \
    {                                                                                                                 \
        _mm256_maskstore_ps(Y + (i) * ldy, m0, a##i);                                                                 \
        if (NQ > 1) _mm256_maskstore_ps(Y + (i) * ldy + 8, m1, b##i);                                                 \
    }
    if (!first) {
        const __m256i m0 = rows_mask(nr), m1 = rows_mask(nr - 8);
        KX_EACH_INPUT(KX_LOAD)
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        const __m256 w0 = _mm256_loadu_ps(p0 + 8 * k), w1 = NQ > 1 ? _mm256_loadu_ps(p1 + 8 * k) : w0;
        KX_EACH_INPUT(KX_FMA)
    }
    {
        const __m256i m0 = rows_mask(nr), m1 = rows_mask(nr - 8);  /* made here, not kept in 2 registers over the loop */
        KX_EACH_INPUT(KX_STORE)
    }
#undef KX_EACH_INPUT
#undef KX_LOAD
#undef KX_FMA
#undef KX_STORE
}

#define KX_PANEL_SHAPES(NQ)                                                                                      \
    switch (ni) {                                                                                                     \
        case 5: panel_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 5); return;                                  \
        case 4: panel_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 4); return;                                  \
        case 3: panel_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 3); return;                                  \
        case 2: panel_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 2); return;                                  \
        default: panel_fma_n(P, X, ldx, n, Y, ldy, nr, first, NQ, 1); return;                                 \
    }

/* panel_fma_n for panels P (nq = 1 or 2 of them, 8 rows each, nr of their rows real), ni = 1..PANEL_INPUTS inputs:
   each shape compiled on its own */
__attribute__((target("avx2,fma"))) static void panel_fma_avx2(const float *P, int nq, const float *X, Py_ssize_t ldx, int ni,
                                                              Py_ssize_t n, float *Y, Py_ssize_t ldy, int nr, int first) {
    if (nq == 2) KX_PANEL_SHAPES(2)
    KX_PANEL_SHAPES(1)
}
#undef KX_PANEL_SHAPES

/* Y[i * ldy + r] (+)= the tile's panels (rows r < nr <= PANEL_ROWS, n <= PANEL_K columns) times inputs i < ni (X: the
   tile's first column of input 0, inputs ldx apart): PANEL_INPUTS inputs and 2 panels per call */
__attribute__((target("avx2,fma"))) static void panels_times_inputs_avx2(const float *P, int nr, const float *X, Py_ssize_t ldx,
                                                                        Py_ssize_t ni, Py_ssize_t n, float *Y, Py_ssize_t ldy,
                                                                        int first) {
    for (Py_ssize_t i = 0; i < ni; i += PANEL_INPUTS) {
        const int m = (int)(ni - i < PANEL_INPUTS ? ni - i : PANEL_INPUTS);
        for (int q = 0; 8 * q < nr; q += 2)
            panel_fma_avx2(P + (Py_ssize_t)q * PANEL_K * 8, 8 * (q + 1) < nr ? 2 : 1, X + i * ldx, ldx, m, n,
                           Y + i * ldy + 8 * q, ldy, nr - 8 * q, first);
    }
}
#endif /* KX_X86 */

#endif /* KX_PANELS_AVX2_H */
