/* The float32 exp and tanh of the compiled element-wise kernels (_sequence_ops.c, _token_ops.c): Cephes
   `expf` (range reduction by ln 2 in two parts, a degree-6 polynomial, the exponent put in by bits) and
   `tanhf` (an odd polynomial below |x| = 0.625, 1 - 2 / (exp(2|x|) + 1) above), branch-free for the
   vectoriser. ~1-2 ulp against the exact value. exp(x) is 0 below x = -87 and +inf above 88; exp(-inf) = 0;
   NaN propagates. Include after <math.h>, <stdint.h> and <string.h>. */

#ifndef KX_MATH_H
#define KX_MATH_H

#define KX_INLINE __attribute__((always_inline)) static inline

KX_INLINE float kx_expf(float x) {
    float xc = x < -87.0f ? -87.0f : x;
    xc = xc > 88.0f ? 88.0f : xc;
    float fx = xc * 1.44269504088896341f;
    fx = (fx + 12582912.0f) - 12582912.0f; /* round to nearest (1.5 * 2^23) */
    float r = xc - fx * 0.693359375f;
    r = r - fx * -2.12194440e-4f;
    const float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    const int32_t n = (int32_t)fx + 127;
    const uint32_t bits = (uint32_t)n << 23;
    float p;
    memcpy(&p, &bits, sizeof p);
    const float out = y * p;
    return x < -87.0f ? 0.0f : (x > 88.0f ? INFINITY : out);
}

KX_INLINE float kx_tanhf(float x) {
    const float a = x < 0.0f ? -x : x;
    const float e = kx_expf(2.0f * (a > 44.0f ? 44.0f : a));
    const float big = 1.0f - 2.0f / (e + 1.0f);
    const float z = a * a;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const float small = p * z * a + a;
    const float r = a < 0.625f ? small : big;
    return x < 0.0f ? -r : r;
}

/* SiTU-GLU of one gate g and up u: tanh(g inv_b) / (1 + exp(-g)) * tanh(u inv_lb) * c (has_lb), else
   tanh(g inv_b) / (1 + exp(-g)) * u * c: the NumPy route's operations in its order (ops.situ_and_mul). */
KX_INLINE float kx_situ(float g, float u, float inv_b, float inv_lb, float c, int has_lb) {
    const float a = kx_tanhf(g * inv_b) / (1.0f + kx_expf(-g));
    return has_lb ? a * kx_tanhf(u * inv_lb) * c : a * u * c;
}

#endif
