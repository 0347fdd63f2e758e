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
