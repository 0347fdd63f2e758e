/* 16-lane fp32 vectors shared by multihead's CPU kernels (cpu_decode.c, cpu_sparse.c): GCC/Clang
 * vector extensions, AVX-512 where the build has it, plain vector code otherwise. Included by
 * the kernels' sources; native_build.py hashes it with them, so a change here rebuilds both. */
#ifndef MULTIHEAD_CPU_VECTOR_H
#define MULTIHEAD_CPU_VECTOR_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

/* lanes of a where m is set, of b elsewhere */
static inline v16f sel(v16i m, v16f a, v16f b) { return (v16f)(((v16i)a & m) | ((v16i)b & ~m)); }

#ifdef __AVX512F__
static inline float hsum(v16f v) { return _mm512_reduce_add_ps((__m512)v); }

/* r[i] lane j -> r[j] lane i (16 x 16 fp32) */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + j], 128-bit lane L: column 4L + j of rows i..i+3 */
        __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int j = 0; j < 4; j++) {
        __m512 x0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44), x1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
        __m512 y0 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44), y1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
        r[j] = _mm512_shuffle_f32x4(x0, y0, 0x88);
        r[4 + j] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
        r[8 + j] = _mm512_shuffle_f32x4(x1, y1, 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
    }
}
#else
static inline float hsum(v16f v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}
#endif

/* exp(x) for x <= 0 (scores minus their max), 0 below -87: Cody-Waite reduction, degree-6
 * polynomial (relative error ~2e-7, as fp32's own expf) */
static inline v16f vexp(v16f x) {
    const v16i under = x < -87.0f;
    x = sel(under, (v16f){0} - 87.0f, x);
    v16f t = x * 1.44269504088896341f;  /* <= 0: round to nearest as -trunc(0.5 - t) */
    v16f n = -__builtin_convertvector(__builtin_convertvector(0.5f - t, v16i), v16f);
    v16f r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16f p = (v16f){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    return sel(under, (v16f){0}, p * (v16f)e);
}

#endif
