/* multihead's CPU decode kernel: attention of a few query rows over K/V read once, as stored.
 *
 * One partial attention per (batch row b, KV head h): the R = G·Lq folded query rows against the
 * n slots [lo, hi) of a cache, each slot's key and value read from memory once and converted to
 * fp32 in registers (fp32, bf16, fp16, int8 or fp8 e4m3 storage; the 8-bit kinds with per-token and
 * per-channel scales).
 *
 *   s[r, t] = scale · Σ_c q[r, c] · k[t, c]           (8-bit: k = K8 · kc[span(t)] · kt[t])
 *   s[r, t] = -inf where blocked[r, t]
 *   m = max_t s, p = exp(s - m), l = Σ p, lse = m + log l
 *   o[r, :] = Σ_t p[r, t] · v[t, :] / l               (8-bit: v = V8 · vt[t])
 *
 * The slots go in blocks of about 1 MiB of rows (superblock): a block's scores, then m, l and p
 * with the running max and sum carried from the blocks before (o rescaled where m grows), then its
 * P V while its rows are in L2. Before (2026-11-28) the scores of every slot came first and P V
 * read the slots again: MLA's values are its keys' first features, so its fp32 step read the cache
 * twice from memory (A/B of builds in one process at 32k: 7.5 against 8.8 ms).
 *
 * Slot t lies in page table[b, t / ps] at t % ps: a paged pool, or a dense (B, H, n, D) tensor as
 * one page per row. Rows that see no slot give o = 0 and lse = -inf; a slot no row of a (b, h)
 * sees is never read in P V (a NaN value there stays out, as the decode path promises).
 * Threads: OpenMP over the (b, h) pairs, on PyTorch's own OpenMP runtime (mh_decode).
 * Built by multihead/backends/cpu_kernels.py with the host's compiler (-O3 -march=native).
 */
#include <stdlib.h>

#include "cpu_vector.h"

typedef int8_t v16b __attribute__((vector_size(16)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef _Float16 v16fp16 __attribute__((vector_size(32)));

#ifdef __AVX512F__
#include <immintrin.h>
/* AVX-512: one widening load and one conversion per 16 elements (GCC scalarises the int8 one) */
static inline v16f load_f32(const float *p) { return (v16f)_mm512_loadu_ps(p); }
static inline v16f load_bf16(const uint16_t *p) {
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
static inline v16f load_f16(const _Float16 *p) { return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline v16f load_i8(const int8_t *p) {
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* fp8 e4m3fn: the byte's exponent and mantissa moved to fp32's places (so e = 0 lands on fp32's
 * subnormals, which are e4m3's), rebiased by one multiply by 2^120; S.1111.111 is NaN (no inf) */
static inline v16f load_f8(const uint8_t *p) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(mag, 20), sign)),
                                   _mm512_set1_ps(0x1p120f));
    return (v16f)_mm512_mask_mov_ps(f, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), _mm512_set1_ps(NAN));
}
#else
static inline v16f load_f32(const float *p) { v16f v; memcpy(&v, p, 64); return v; }
static inline v16f load_bf16(const uint16_t *p) {
    v16h h; memcpy(&h, p, 32);
    v16u w = __builtin_convertvector(h, v16u) << 16;
    return (v16f)w;
}
static inline v16f load_f16(const _Float16 *p) { v16fp16 h; memcpy(&h, p, 32); return __builtin_convertvector(h, v16f); }
static inline v16f load_i8(const int8_t *p) { v16b b; memcpy(&b, p, 16); return __builtin_convertvector(__builtin_convertvector(b, v16i), v16f); }
typedef uint8_t v16ub __attribute__((vector_size(16)));
static inline v16f load_f8(const uint8_t *p) {
    v16ub b; memcpy(&b, p, 16);
    const v16u w = __builtin_convertvector(b, v16u), mag = w & 0x7F;
    const v16f f = (v16f)((mag << 20) | ((w & 0x80) << 24)) * 0x1p120f;
    const v16i nan = (v16i)(mag == 0x7F);
    return (v16f)(((v16i)((v16f){0} + NAN) & nan) | ((v16i)f & ~nan));
}
#endif

static inline float bf16_to_f32(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
/* a scale of the cache's dtype: 0 fp32, 1 bf16, 2 fp16 */
static inline float load_scale(const void *p, long i, int dt) {
    if (dt == 0) return ((const float *)p)[i];
    if (dt == 1) return bf16_to_f32(((const uint16_t *)p)[i]);
    return (float)((const _Float16 *)p)[i];
}

/* 16 scales of the cache's dtype from p[i..i+16) */
static inline v16f load_scales16(const void *p, long i, int dt) {
    if (dt == 0) return load_f32((const float *)p + i);
    if (dt == 1) return load_bf16((const uint16_t *)p + i);
    return load_f16((const _Float16 *)p + i);
}

#ifdef __AVX512F__
/* four vectors -> their four sums, [Σ v0, Σ v1, Σ v2, Σ v3] */
static inline __m128 hsum4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
    __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
    __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
    __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
    __m256 w = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
    return _mm_add_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1));
}
#endif
typedef struct {
    int B, H, G, Lq, D, Dv;
    long lo, n;                 /* slots [lo, lo + n) */
    const float *q;             /* (B, H, R, D) fp32, contiguous */
    float scale;
    const void *K, *V;          /* storage */
    long k_h, k_page, k_t, v_h, v_page, v_t;
    const int64_t *table;       /* (B, width) */
    long width, ps;
    const uint8_t *blocked;     /* NULL or bool with strides (b, h, g, l, t) */
    long m_b, m_h, m_g, m_l, m_t;
    /* int8 and fp8 only */
    const void *kc, *kt, *vt;   /* kc (B, H, spans, D) strides kc_b, kc_h, kc_j; kt, vt (B, H, N) strides */
    long kc_b, kc_h, kc_j, kt_b, kt_h, vt_b, vt_h;
    long first, span;           /* slot lo + t is quantized slot first + t */
    int sdt;
    float *out, *lse;           /* (B, H, R, Dv), (B, H, R) */
    /* NULL, or row r's visible slots [band[2r], band[2r + 1]) of the call's [0, n), the same for
     * every (b, h), which `blocked` spells out too: the tile path reads the band, the FMA path the
     * mask. band_at: this job's first slot in the call's (a piece starts past 0). */
    const int32_t *band;
    long band_at;
    /* the weights' precision on the tile path's P V (cpu_decode_amx.h): 0, fp32's (a call whose query
     * is fp32), or 1, 16 bits (a half-precision call, whose output is rounded to 8 or 11 bits) */
    int half;
} job_t;

#ifndef PF_BYTES
#define PF_BYTES 2048 /* how far ahead rows are prefetched: the loads of a step stream from memory */
#endif
#define PF_MAX 32 /* keys ahead, at most (int8 rows of 64 features: 2 KiB is 32 of them) */
#define TB 64 /* keys per block: their row pointers found once (pages crossed), V rows stay in L1 */

/* Pointers to the rows of slots [slot, slot + count), with `count` at most TB + PF: the page
 * table followed, one division per block. */
static inline void rows_of(const char **rows, long count, const char *base, const int64_t *table, long ps,
                           long page_bytes, long t_bytes, long slot) {
    long page = slot / ps, off = slot % ps;
    const char *p = base + table[page] * page_bytes + off * t_bytes;
    for (long i = 0; i < count; i++, off++, p += t_bytes) {
        if (off == ps) { /* the next page (looked up only when a slot lies in it) */
            off = 0;
            p = base + table[++page] * page_bytes;
        }
        rows[i] = p;
    }
}

static inline void prefetch_row(const char *row, int bytes) {
    for (int c = 0; c < bytes; c += 64) __builtin_prefetch(row + c);
}

/* The next block's rows fetched into L2 while this block's P V runs on rows already there (the memory
 * idles otherwise): a cursor over the lines of TB rows of keys, then of values where they are not the
 * keys' own rows (MLA's values are its keys' first features), one line a step
 * (measured: docs/inference.md#fma-blocks) */
#ifndef AHEAD_MIN_ROWS
#define AHEAD_MIN_ROWS 8 /* query rows per KV head from which P V takes long enough (fewer: the prefetcher keeps up) */
#endif
typedef struct { /* small: a loop that copies it into a local keeps it in registers */
    const char **rows; /* 2 · TB of them: keys' rows [0, keys), values' [keys, count) */
    int keys, count, k_lines, v_lines, r, l;
} ahead_t;

static inline void ahead_start(ahead_t *a, const char **rows, const char *K, const char *V, const int64_t *table,
                               long ps, long kpb, long ktb, long vpb, long vtb, int kbytes, int vbytes, long slot,
                               long count) {
    const int in_keys = V == K && vpb == kpb && vtb == ktb && vbytes <= kbytes;
    a->rows = rows, a->keys = (int)count, a->count = in_keys ? (int)count : 2 * (int)count, a->r = 0, a->l = 0;
    a->k_lines = (kbytes + 63) / 64, a->v_lines = (vbytes + 63) / 64;
    if (count < 1) return;
    rows_of(a->rows, count, K, table, ps, kpb, ktb, slot);
    if (!in_keys) rows_of(a->rows + count, count, V, table, ps, vpb, vtb, slot);
}

static inline void ahead_step(ahead_t *a) {
    if (a->r >= a->count) return;
    __builtin_prefetch(a->rows[a->r] + 64 * a->l, 0, 2); /* into L2 */
    if (++a->l == (a->r < a->keys ? a->k_lines : a->v_lines)) a->l = 0, a->r++;
}

/* Slots per block of the FMA path (DEFINE_KERNEL): a block's key and value rows (row_bytes a slot) within
 * SB_BYTES, so that P V finds them in L2 after the scores read them (MLA's values are its keys' first
 * features: read twice from memory without), a multiple of TB, at least 4·TB */
#ifndef SB_BYTES
#define SB_BYTES (1L << 20)
#endif
static inline long superblock(long n, int row_bytes) {
    long sb = SB_BYTES / row_bytes / TB * TB;
    sb = sb < 4 * TB ? 4 * TB : sb;
    return sb < n ? sb : n;
}

/* 4 query rows (zero rows past R) x one key: the four scores */
#define DOT4(LOAD, kr, qs, D, out4)                                                                      \
    do {                                                                                                 \
        v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                     \
        for (int c = 0; c < (D); c += 16) {                                                              \
            v16f kv = LOAD((kr) + c);                                                                    \
            a0 += load_f32((qs) + c) * kv;                                                               \
            a1 += load_f32((qs) + (D) + c) * kv;                                                         \
            a2 += load_f32((qs) + 2 * (D) + c) * kv;                                                     \
            a3 += load_f32((qs) + 3 * (D) + c) * kv;                                                     \
        }                                                                                                \
        (out4)[0] = hsum(a0); (out4)[1] = hsum(a1); (out4)[2] = hsum(a2); (out4)[3] = hsum(a3);          \
    } while (0)

#ifdef __AVX512F__
/* 4 keys x 4 query rows at a time (each group of 4 rows in turn): 16 accumulators, reduced by hsum4.
 * Many rows (MLA's 16) go 8 at a time over the block's keys: 8 fp32 rows of 576 features (18 KiB)
 * stay in L1 with the 4 keys, where all 16 (36 KiB) did not (A/B of builds in one process, MLA's fp32
 * call at 32k: 7.8-8.9 against 8.4-10.0 ms, the same bits) */
#define BLOCK4(T, LOAD)                                                                                  \
    { /* the keys in fours: [i0, i_end) */                                                             \
    const long i0 = i, i_end = i0 + (cnt - i0) / 4 * 4;                                                  \
    for (int rh = RT; rh < R4; rh += 8)                                                                  \
    for (i = i0; i < i_end; i += 4) {                                                                    \
        const T *k0r = (const T *)rows[i], *k1r = (const T *)rows[i + 1];                                \
        const T *k2r = (const T *)rows[i + 2], *k3r = (const T *)rows[i + 3];                            \
        if (rh == RT) for (int j = 0; j < 4; j++) if (i + j + PF < got) prefetch_row(rows[i + j + PF], kbytes); \
        const __m128 f4 = _mm_loadu_ps(kf + i);                                                          \
        for (int r0 = rh; r0 < rh + 8 && r0 < R4; r0 += 4) {                                             \
            const float *qg4 = qs + (long)r0 * D;                                                        \
            __m512 a[4][4];                                                                              \
            for (int r = 0; r < 4; r++) for (int j = 0; j < 4; j++) a[r][j] = _mm512_setzero_ps();       \
            for (int c = 0; c < D; c += 16) {                                                            \
                __m512 k0 = (__m512)LOAD(k0r + c), k1 = (__m512)LOAD(k1r + c);                           \
                __m512 k2 = (__m512)LOAD(k2r + c), k3 = (__m512)LOAD(k3r + c);                           \
                for (int r = 0; r < 4; r++) {                                                            \
                    __m512 qv = _mm512_loadu_ps(qg4 + r * D + c);                                        \
                    a[r][0] = _mm512_fmadd_ps(qv, k0, a[r][0]); a[r][1] = _mm512_fmadd_ps(qv, k1, a[r][1]); \
                    a[r][2] = _mm512_fmadd_ps(qv, k2, a[r][2]); a[r][3] = _mm512_fmadd_ps(qv, k3, a[r][3]); \
                }                                                                                        \
            }                                                                                            \
            for (int r = 0; r < 4 && r0 + r < R; r++)                                                    \
                _mm_storeu_ps(s_blk + (long)(r0 + r) * n_s + t_s + i, _mm_mul_ps(hsum4(a[r][0], a[r][1], a[r][2], a[r][3]), f4)); \
        }                                                                                                \
    }                                                                                                    \
    i = i_end;                                                                                           \
    }
#else
#define BLOCK4(T, LOAD)
#endif

#ifdef __AVX512F__
/* fp32 keys against 16 query rows held transposed (qt[c · 16 + r]): a vector per key, lane r its score
 * for row r, each key's element broadcast from memory against one vector of qt, features 4 at a time.
 * No horizontal sums, and qt is read in order once per 16 keys, where the 4 keys x 4 rows blocks
 * reduced every score across a vector and kept 8 rows beside 4 keys in L1 (measured:
 * docs/inference.md#fma-transposed). m keys (fewer than 16: the last repeated, its lanes not stored);
 * keys that lie at one stride are walked by it, others through their pointers. s[r · n_s + j]. */
#define T16_FEATURES 32 /* scores summed in blocks of this many features: summed in one lane over all of D they
                          * lost about 3x the precision of the 16-lane partial sums they replaced; in blocks
                          * of 32 their error is the partial sums' again */
/* features [c, c + 4) of the 16 keys KEY(j, c) into a[j] */
#define T16_STEP(KEY, c)                                                                                 \
    do {                                                                                                 \
        const __m512 q0 = _mm512_loadu_ps(qt + 16 * (c)), q1 = _mm512_loadu_ps(qt + 16 * (c) + 16);      \
        const __m512 q2 = _mm512_loadu_ps(qt + 16 * (c) + 32), q3 = _mm512_loadu_ps(qt + 16 * (c) + 48); \
        _Pragma("GCC unroll 16") for (int j = 0; j < 16; j++) {                                          \
            const float *p = KEY(j, c);                                                                  \
            a[j] = _mm512_fmadd_ps(q0, _mm512_set1_ps(p[0]), a[j]), a[j] = _mm512_fmadd_ps(q1, _mm512_set1_ps(p[1]), a[j]); \
            a[j] = _mm512_fmadd_ps(q2, _mm512_set1_ps(p[2]), a[j]), a[j] = _mm512_fmadd_ps(q3, _mm512_set1_ps(p[3]), a[j]); \
        }                                                                                                \
    } while (0)
/* 16 keys' scores (sum[j] lane r: key j, row r) in blocks of T16_FEATURES features, each unrolled whole (a
 * loop of 8 steps and its exit cost the blocks ~10%). KEY(j, c): key j's features from c. A function per
 * way of finding the keys (one function with both spilled the keys' pointers to the stack: calls ~20% slower) */
#define T16_SCORES(NAME, KEY, ...)                                                                       \
    static __attribute__((noinline)) void NAME(__m512 sum[16], __VA_ARGS__, const float *qt, int D) {    \
        __m512 a[16];                                                                                    \
        for (int c0 = 0; c0 < D; c0 += T16_FEATURES) {                                                   \
            for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();                                     \
            if (D - c0 >= T16_FEATURES) {                                                                \
                _Pragma("GCC unroll 8") for (int c = c0; c < c0 + T16_FEATURES; c += 4) T16_STEP(KEY, c); \
            } else                                                                                       \
                for (int c = c0; c < D; c += 4) T16_STEP(KEY, c);                                        \
            for (int j = 0; j < 16; j++) sum[j] = c0 == 0 ? a[j] : _mm512_add_ps(sum[j], a[j]);          \
        }                                                                                                \
    }
#define T16_EVEN(j, c) (k0 + (j) * st + (c))
#define T16_ROWS_AT(j, c) (k[j] + (c))
T16_SCORES(scores_t16_even, T16_EVEN, const float *k0, long st)
T16_SCORES(scores_t16_rows, T16_ROWS_AT, const float *const *k)
#undef T16_EVEN
#undef T16_ROWS_AT
#undef T16_SCORES
#undef T16_STEP
static inline __mmask16 first_lanes(int m) { return (__mmask16)(m >= 16 ? 0xFFFF : (1u << m) - 1); }
static inline void scores_t16(const char *const *rows, long ktb, int m, const float *qt, int D, float *s, long n_s) {
    __m512 a[16];
    int even = m == 16;
    for (int j = 1; j < 16 && even; j++) even = rows[j] == rows[0] + j * ktb;
    if (even)
        scores_t16_even(a, (const float *)rows[0], ktb / (long)sizeof(float), qt, D);
    else {
        const float *k[16];
        for (int j = 0; j < 16; j++) k[j] = (const float *)rows[j < m ? j : m - 1];
        scores_t16_rows(a, k, qt, D);
    }
    transpose16(a); /* a[r] lane j: key j's score for row r */
    for (int r = 0; r < 16; r++) _mm512_mask_storeu_ps(s + r * n_s, first_lanes(m), a[r]);
}

/* O[r][f] += Σ_k P[r][k] V[k][f] for 16 rows, cnt slots: pt[k · 16 + r] the weights transposed, 16
 * features at a time with one accumulator each (lanes: the rows), each value element broadcast against
 * its slot's 16 weights. Each value line is read once a block, where 4 rows x 64 features read it once
 * per 4 rows (measured: docs/inference.md#fma-transposed). out: 16 rows at stride Dv. masked (a row
 * mask): a row takes nothing from a slot whose weight it has at 0, NaN included, and a slot no row
 * weighs is not read (as the 4-row blocks do); unmasked, every product is added (0 · v as SDPA). */
static inline void values_t16(const char *const *rows, int cnt, const float *pt, int Dv, float *out, ahead_t *ahead,
                              int masked) {
    const float *v[TB]; /* the rows at feature f0: each value element a displacement from its row's pointer */
    for (int k = 0; k < cnt; k++) v[k] = (const float *)rows[k];
    ahead_t next = *ahead; /* in registers */
    for (int f0 = 0; f0 < Dv; f0 += 16) {
        __m512 a[16];
        for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
        if (masked)
            for (int k = 0; k < cnt; k++) {
                ahead_step(&next);
                const __m512 w = _mm512_loadu_ps(pt + 16 * k);
                const __mmask16 seen = _mm512_cmpneq_ps_mask(w, _mm512_setzero_ps());
                const float *vk = v[k];
                v[k] = vk + 16;
                if (!seen) continue;
                for (int j = 0; j < 16; j++) a[j] = _mm512_mask3_fmadd_ps(w, _mm512_set1_ps(vk[j]), a[j], seen);
            }
        else
            for (int k = 0; k < cnt; k++) {
                ahead_step(&next);
                const __m512 w = _mm512_loadu_ps(pt + 16 * k);
                const float *vk = v[k];
                for (int j = 0; j < 16; j++) a[j] = _mm512_fmadd_ps(w, _mm512_set1_ps(vk[j]), a[j]);
                v[k] = vk + 16;
            }
        transpose16(a); /* a[r] lane j: feature f0 + j of row r */
        for (int r = 0; r < 16; r++) {
            float *o = out + (long)r * Dv + f0;
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), a[r]));
        }
    }
    *ahead = next;
}

/* pt[k · 16 + r] = s[r · n_s + k] for 16 rows, k < cnt */
static inline void weights_t16(const float *s, long n_s, int cnt, float *pt) {
    for (int k0 = 0; k0 < cnt; k0 += 16) {
        const int m = cnt - k0 < 16 ? cnt - k0 : 16;
        __m512 x[16];
        for (int r = 0; r < 16; r++) x[r] = _mm512_maskz_loadu_ps(first_lanes(m), s + r * n_s + k0);
        transpose16(x);
        for (int j = 0; j < m; j++) _mm512_storeu_ps(pt + 16 * (k0 + j), x[j]);
    }
}
/* qt[(g · D + c) · 16 + r] = qs[(16 g + r) · D + c]: rows [0, RT) in groups g of 16, transposed 16 x 16 */
static inline void query_t16(const float *qs, int RT, int D, float *qt) {
    for (int g = 0; g < RT / 16; g++)
        for (int c0 = 0; c0 < D; c0 += 16) {
            __m512 x[16];
            for (int r = 0; r < 16; r++) x[r] = _mm512_loadu_ps(qs + (long)(16 * g + r) * D + c0);
            transpose16(x); /* x[c] lane r: row r's feature c0 + c */
            for (int c = 0; c < 16; c++) _mm512_storeu_ps(qt + ((long)g * D + c0 + c) * 16, x[c]);
        }
}
#define T16_QUERY(ON) if (ON) query_t16(qs, RT, D, qt);
/* rows [0, RT) of a TB block of keys 16 at a time (the rest of the rows take BLOCK4 and DOT4) */
#define T16_ROWS(ON, R) ((ON) ? (R) / 16 * 16 : 0)
#define T16_BLOCK(ON)                                                                                    \
    if (ON)                                                                                              \
        for (long i16 = i; i16 < cnt; i16 += 16)                                                         \
            for (int g = 0; g < RT; g += 16)                                                             \
                scores_t16(rows + i16, ktb, cnt - i16 < 16 ? (int)(cnt - i16) : 16, qt + (long)g * D, D,  \
                           s_blk + (long)g * n_s + t_s + i16, n_s);
/* P V of rows [0, RT) 16 at a time; the 4-row groups take the rest */
#define V16_BLOCK(ON)                                                                                    \
    if (ON) {                                                                                            \
        float pt[TB * 16] __attribute__((aligned(64)));                                                  \
        for (int g = 0; g < RT; g += 16) {                                                               \
            weights_t16(s + (long)g * SB + (t - t_lo), SB, (int)cnt, pt);                                \
            values_t16(rows, (int)cnt, pt, Dv, out + (long)g * Dv, &ahead, J->blocked != NULL);          \
        }                                                                                                \
        g4_first = RT / 4;                                                                               \
    }
#else
#define T16_ROWS(ON, R) 0
#define T16_QUERY(ON) (void)qt;
#define T16_BLOCK(ON)
#define V16_BLOCK(ON)
#endif

#include "cpu_amx.h"
#include "cpu_decode_amx8.h"

#ifdef HAVE_AMX8
/* int8 scores on the tiles (cpu_decode_amx8.h): the query's terms when a span starts, then 16 slots
 * at a time while their rows lie at one stride (BLOCK4 and the loop after it take the rest) */
#define AMX8_SPAN(ON) if (ON) amx8_on = amx8_query(T8, sc8, qs, R, D, R > AMX8_MAX_ROWS);
#define AMX8_BLOCK(ON)                                                                                   \
    if (ON && amx8_on) {                                                                                 \
        if (R <= AMX8_MAX_ROWS) amx8_load_query(T8, D);                                                  \
        for (; i + 16 <= cnt && rows[i + 15] == rows[i] + 15 * ktb; i += 16) {                           \
            for (int j = 0; j < 16; j++) if (i + j + PF < got) prefetch_row(rows[i + j + PF], kbytes);  \
            if (R <= AMX8_MAX_ROWS)                                                                      \
                amx8_scores16((const int8_t *)rows[i], ktb, D, sc8, kf + i, s_blk + t_s + i, n_s, R);           \
            else                                                                                         \
                amx8_scores16_wide((const int8_t *)rows[i], ktb, D, T8, sc8, kf + i, s_blk + t_s + i, n_s, R);  \
        }                                                                                                \
    }
#define AMX8_PV_TAKES(ON) ((ON) && R <= AMX8_MAX_ROWS && Dv % 64 == 0 && Dv <= AMX8_MAX_DV)
#define AMX8_PV(ON) if (ON) pv_done = amx8_values(V, table, ps, vpb, vtb, lo, n, R, Dv, PF, s, out);
#define AMX8_START(ON) if (ON) amx_configure();
#define AMX8_END(ON) if (ON) _tile_release();
#else
#define AMX8_SPAN(ON)
#define AMX8_BLOCK(ON)
#define AMX8_PV_TAKES(ON) 0
#define AMX8_PV(ON)
#define AMX8_START(ON)
#define AMX8_END(ON)
#endif

#define DEFINE_KERNEL(SUFFIX, T, LOAD, QUANT, AMX8, TRANS)                                                 \
static void one_##SUFFIX(const job_t *J, int bh, float *s, float *qs) {                                  \
    const int b = bh / J->H, h = bh % J->H, R = J->G * J->Lq, D = J->D, Dv = J->Dv;                      \
    const int R4 = (R + 3) & ~3; /* rows padded to a multiple of 4 (zero rows) */                        \
    const int RT = T16_ROWS(TRANS, R); /* rows whose scores run 16 to a vector (scores_t16) */           \
    const int kbytes = D * (int)sizeof(T), vbytes = Dv * (int)sizeof(T);                                 \
    const long n = J->n, lo = J->lo, ps = J->ps;                                                         \
    const char *K = (const char *)((const T *)J->K + h * J->k_h);                                        \
    const char *V = (const char *)((const T *)J->V + h * J->v_h);                                        \
    const long kpb = J->k_page * (long)sizeof(T), ktb = J->k_t * (long)sizeof(T);                        \
    const long vpb = J->v_page * (long)sizeof(T), vtb = J->v_t * (long)sizeof(T);                        \
    const int64_t *table = J->table + b * J->width;                                                      \
    const float *q = J->q + (long)bh * R * D;                                                            \
    const float scale = J->scale;                                                                        \
    float *out = J->out + (long)bh * R * Dv, *lse = J->lse + (long)bh * R;                               \
    const char *rows[TB + PF_MAX];                                                                       \
    /* keys ahead to prefetch: at least 8, and PF_BYTES of short rows (16 int8 rows of 128 features) */ \
    const int PF = PF_BYTES / kbytes < 8 ? 8 : PF_BYTES / kbytes > PF_MAX ? PF_MAX : PF_BYTES / kbytes;   \
    float kf[TB];                                                                                        \
    long span_now = -1;                                                                                  \
    int8_t T8[AMX8 ? 3 * 4096 : 1] __attribute__((aligned(64))); /* the query's int8 terms (AMX8) */    \
    float sc8[48];                                                                                       \
    int amx8_on = 0;                                                                                     \
    (void)T8, (void)sc8, (void)amx8_on;                                                                  \
    AMX8_START(AMX8)                                                                                     \
    memset(qs, 0, sizeof(float) * R4 * D);                                                               \
    for (int i = 0; i < R * D; i++) qs[i] = q[i] * scale;                                                \
    for (int i = 0; i < TB; i++) kf[i] = 1.0f;                                                           \
    /* the slots in blocks of SB (superblock), each read from memory once: its scores, the online        \
     * softmax (each row's running max m, sum tot; out rescaled where m grows), then its P V while       \
     * its rows are still in L2. The int8 P V on the tiles (AMX8_PV) wants every weight first: one block */ \
    const int amx8_pv = AMX8_PV_TAKES(AMX8);                                                             \
    const long SB = amx8_pv ? n : superblock(n, kbytes + vbytes);                                        \
    float *m_run = qs + (long)R4 * D, *tot = m_run + R; /* past the query rows in qs */                \
    int any_nan[R];                                                                                      \
    for (int r = 0; r < R; r++) m_run[r] = -INFINITY, tot[r] = 0.f, any_nan[r] = 0;                      \
    float *const qt = tot + R; /* rows [0, RT) transposed, 16 at a time (query_t16) */                  \
    T16_QUERY(TRANS)                                                                                     \
    /* rows R..R4 of the weights: zero (P V reads the rows 4 at a time) */                               \
    memset(s + (long)R * SB, 0, sizeof(float) * (R4 - R) * SB);                                          \
    memset(out, 0, sizeof(float) * R * Dv);                                                              \
    int pv_done = 0;                                                                                     \
    for (long t_lo = 0; t_lo < n; t_lo += SB) {                                                          \
    const long sn = n - t_lo < SB ? n - t_lo : SB; /* this block's slots [t_lo, t_lo + sn) */            \
    /* scores, TB keys at a time (int8: blocks end at span boundaries); s[r · SB + t - t_lo] */          \
    for (long t = t_lo, cnt; t < t_lo + sn; t += cnt) {                                                  \
        cnt = t_lo + sn - t < TB ? t_lo + sn - t : TB;                                                   \
        if (QUANT) {                                                                                     \
            long qi = J->first + t, j = qi / J->span, end = (j + 1) * J->span - qi;                      \
            cnt = cnt < end ? cnt : end;                                                                 \
            if (j != span_now) { /* q' = q · scale · kc[j] */                                            \
                span_now = j;                                                                            \
                for (int r = 0; r < R; r++)                                                              \
                    for (int c = 0; c < D; c++)                                                          \
                        qs[r * D + c] = q[r * D + c] * scale *                                           \
                            load_scale(J->kc, b * J->kc_b + h * J->kc_h + j * J->kc_j + c, J->sdt);      \
                AMX8_SPAN(AMX8)                                                                          \
            }                                                                                            \
            const long k0 = b * J->kt_b + h * J->kt_h + qi;                                              \
            long i = 0;                                                                                  \
            for (; i + 16 <= cnt; i += 16) { v16f f = load_scales16(J->kt, k0 + i, J->sdt); memcpy(kf + i, &f, 64); } \
            for (; i < cnt; i++) kf[i] = load_scale(J->kt, k0 + i, J->sdt);                              \
        }                                                                                                \
        const long got = n - t < cnt + PF ? n - t : cnt + PF; /* the block and the keys to prefetch */   \
        rows_of(rows, got, K, table, ps, kpb, ktb, lo + t);                                              \
        long i = 0;                                                                                      \
        {                                                                                                \
        float *const s_blk = s; /* the scores' row stride SB, the block's slot t - t_lo */               \
        const long n_s = SB, t_s = t - t_lo;                                                             \
        AMX8_BLOCK(AMX8)                                                              \
        T16_BLOCK(TRANS)                                                              \
        BLOCK4(T, LOAD)                                                               \
        for (; i < cnt; i++) {                                                                           \
            const T *kr = (const T *)rows[i];                                                            \
            if (i + PF < got) prefetch_row(rows[i + PF], kbytes);                                        \
            for (int r0 = RT; r0 < R4; r0 += 4) {                                                        \
                float d4[4];                                                                             \
                DOT4(LOAD, kr, qs + (long)r0 * D, D, d4);                                                \
                for (int r = 0; r < 4 && r0 + r < R; r++) s_blk[(long)(r0 + r) * n_s + t_s + i] = d4[r] * kf[i]; \
            }                                                                                            \
        }                                                                                                \
        }                                                                                                \
    }                                                                                                    \
    /* mask, block max, rescale, exp, sum */                                                             \
    for (int r = 0; r < R; r++) {                                                                        \
        float *sr = s + (long)r * SB;                                                                    \
        if (J->blocked) {                                                                                \
            int g = r / J->Lq, l = r % J->Lq;                                                            \
            const uint8_t *m = J->blocked + b * J->m_b + h * J->m_h + g * J->m_g + l * J->m_l;           \
            const long m_t = J->m_t;                                                                     \
            for (long t = 0; t < sn; t++) if (m[(t_lo + t) * m_t]) sr[t] = -INFINITY;                    \
        }                                                                                                \
        float mx = -INFINITY;                                                                            \
        {                                                                                                \
            v16f vm = (v16f){0} - INFINITY;                                                              \
            v16i vn = {0};                                                                               \
            long t = 0;                                                                                  \
            for (; t + 16 <= sn; t += 16) {                                                              \
                v16f x = load_f32(sr + t);                                                               \
                vm = sel(x > vm, x, vm);                                                                 \
                vn |= x != x;                                                                            \
            }                                                                                            \
            for (int i = 0; i < 16; i++) { mx = vm[i] > mx ? vm[i] : mx; any_nan[r] |= vn[i] != 0; }     \
            for (; t < sn; t++) { mx = sr[t] > mx ? sr[t] : mx; any_nan[r] |= sr[t] != sr[t]; }          \
        }                                                                                                \
        mx = mx > m_run[r] ? mx : m_run[r];                                                              \
        if (mx == -INFINITY) { /* no slot visible yet */                                                 \
            memset(sr, 0, sizeof(float) * sn);                                                           \
            continue;                                                                                    \
        }                                                                                                \
        if (mx != m_run[r] && m_run[r] != -INFINITY) { /* the max grew: what is summed so far scales down */ \
            const float alpha = expf(m_run[r] - mx);                                                     \
            tot[r] *= alpha;                                                                             \
            for (int c = 0; c < Dv; c++) out[(long)r * Dv + c] *= alpha;                                 \
        }                                                                                                \
        m_run[r] = mx;                                                                                   \
        /* the weights p = exp(s - m), stored times vt for int8 (0 where p is: a NaN scale of a slot the \
         * row does not see stays out) */                                                                \
        const long vt0 = QUANT ? b * J->vt_b + h * J->vt_h + J->first + t_lo : 0;                        \
        v16f sum = {0};                                                                                  \
        long t = 0;                                                                                      \
        for (; t + 16 <= sn; t += 16) {                                                                  \
            v16f e = vexp(load_f32(sr + t) - mx);                                                        \
            sum += e;                                                                                    \
            if (QUANT) e = sel(e != 0.f, e * load_scales16(J->vt, vt0 + t, J->sdt), (v16f){0});          \
            memcpy(sr + t, &e, 64);                                                                      \
        }                                                                                                \
        float blk = hsum(sum);                                                                           \
        for (; t < sn; t++) {                                                                            \
            float e = sr[t] == -INFINITY ? 0.f : expf(sr[t] - mx);                                       \
            blk += e;                                                                                    \
            sr[t] = QUANT && e != 0.f ? e * load_scale(J->vt, vt0 + t, J->sdt) : e;                      \
        }                                                                                                \
        tot[r] += blk;                                                                                   \
    }                                                                                                    \
    const int groups = R4 / 4;                                                                           \
    /* o += P V: 4 rows x 64 features of accumulators in registers, TB keys at a time */                 \
    AMX8_PV(amx8_pv)                                                                                     \
    for (long t = t_lo, cnt; t < t_lo + sn && !pv_done; t += cnt) {                                      \
        cnt = t_lo + sn - t < TB ? t_lo + sn - t : TB;                                                   \
        const long got = n - t < cnt + PF ? n - t : cnt + PF;                                            \
        rows_of(rows, got, V, table, ps, vpb, vtb, lo + t);                                              \
        const char *ahead_rows[2 * TB];                                                                  \
        ahead_t ahead; /* the next block's slots as far into it as this chunk is into this one */        \
        ahead_start(&ahead, ahead_rows, K, V, table, ps, kpb, ktb, vpb, vtb, kbytes, vbytes, lo + t + SB, \
                    R < AHEAD_MIN_ROWS || t + SB >= n ? 0 : n - (t + SB) < cnt ? n - (t + SB) : cnt);   \
        int g4_first = 0;                                                                                \
        V16_BLOCK(TRANS)                                                                                 \
        for (int g4 = g4_first; g4 < groups; g4++) {                                                     \
            const int rb = R - 4 * g4 < 4 ? R - 4 * g4 : 4;                                              \
            const float *p0 = s + (long)4 * g4 * SB + (t - t_lo), *p1 = p0 + SB, *p2 = p1 + SB, *p3 = p2 + SB; \
            for (int c0 = 0; c0 < Dv; c0 += 64) {                                                        \
                const int cb = Dv - c0 < 64 ? (Dv - c0) / 16 : 4;                                        \
                const int first_pass = g4 == 0 && c0 == 0;                                               \
                v16f a[4][4] = {{{0}}};                                                                  \
                if (!J->blocked) { /* every slot seen: no per-slot test (an underflowed weight adds 0 · v, as SDPA) */ \
                    for (long i = 0; i < cnt; i++) {                                                     \
                        if (first_pass && i + PF < got) prefetch_row(rows[i + PF], vbytes);              \
                        ahead_step(&ahead);                                                              \
                        const float w0 = p0[i], w1 = p1[i], w2 = p2[i], w3 = p3[i];                      \
                        const T *vr = (const T *)rows[i] + c0;                                           \
                        for (int c = 0; c < cb; c++) {                                                   \
                            v16f vv = LOAD(vr + 16 * c);                                                 \
                            a[0][c] += w0 * vv; a[1][c] += w1 * vv; a[2][c] += w2 * vv; a[3][c] += w3 * vv; \
                        }                                                                                \
                    }                                                                                    \
                } else                                                                                   \
                for (long i = 0; i < cnt; i++) {                                                         \
                    if (first_pass && i + PF < got) prefetch_row(rows[i + PF], vbytes);                  \
                    ahead_step(&ahead);                                                                  \
                    const float w0 = p0[i], w1 = p1[i], w2 = p2[i], w3 = p3[i];                          \
                    const int seen = (w0 != 0.f) + (w1 != 0.f) + (w2 != 0.f) + (w3 != 0.f);              \
                    if (!seen) continue; /* no row sees it: its value is never touched */                \
                    const T *vr = (const T *)rows[i] + c0;                                               \
                    if (seen == rb || !J->blocked) {                                                     \
                        for (int c = 0; c < cb; c++) {                                                   \
                            v16f vv = LOAD(vr + 16 * c);                                                 \
                            a[0][c] += w0 * vv; a[1][c] += w1 * vv; a[2][c] += w2 * vv; a[3][c] += w3 * vv; \
                        }                                                                                \
                    } else { /* rows that do not see it take nothing from it, NaN included */            \
                        const float wr[4] = {w0, w1, w2, w3};                                            \
                        for (int c = 0; c < cb; c++) {                                                   \
                            v16f vv = LOAD(vr + 16 * c);                                                 \
                            for (int r = 0; r < 4; r++) if (wr[r] != 0.f) a[r][c] += wr[r] * vv;         \
                        }                                                                                \
                    }                                                                                    \
                }                                                                                        \
                for (int r = 0; r < rb; r++)                                                             \
                    for (int c = 0; c < cb; c++) {                                                       \
                        float *o = out + (long)(4 * g4 + r) * Dv + c0 + 16 * c;                          \
                        v16f cur = load_f32(o) + a[r][c];                                                \
                        memcpy(o, &cur, 64);                                                             \
                    }                                                                                    \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    }                                                                                                    \
    /* out / tot and lse: NaN where a score was NaN; 0 · out and -inf where no slot was seen */          \
    for (int r = 0; r < R; r++) {                                                                        \
        const float nr = any_nan[r] ? NAN : m_run[r] == -INFINITY ? 0.f : 1.0f / tot[r];                 \
        lse[r] = any_nan[r] ? NAN : m_run[r] == -INFINITY ? -INFINITY : m_run[r] + logf(tot[r]);         \
        for (int c = 0; c < Dv; c++) out[(long)r * Dv + c] *= nr;                                        \
    }                                                                                                    \
    AMX8_END(AMX8)                                                                                       \
}

DEFINE_KERNEL(f32, float, load_f32, 0, 0, 1)
DEFINE_KERNEL(bf16, uint16_t, load_bf16, 0, 0, 0)
DEFINE_KERNEL(f16, _Float16, load_f16, 0, 0, 0)
DEFINE_KERNEL(i8, int8_t, load_i8, 1, 0, 0)
DEFINE_KERNEL(f8, uint8_t, load_f8, 1, 0, 0)
#ifdef HAVE_AMX8
DEFINE_KERNEL(i8_amx8, int8_t, load_i8, 1, 1, 0)
#endif

#include "cpu_decode_amx.h"

typedef void (*one_fn)(const job_t *, int, float *, float *);

#ifndef PIECE_MIN
#define PIECE_MIN 1024 /* slots: a (b, h) pair is split only into pieces at least this long */
#endif
#ifndef SPLIT_PAIRS
#define SPLIT_PAIRS 4 /* calls of fewer (b, h) pairs than this are split ... */
#endif
#ifndef SPLIT_ITEMS
#define SPLIT_ITEMS 8 /* ... into this many items in all, at most */
#endif

/* Join the partials of one (b, h) pair's pieces by their log-sum-exp, as merge_partials does: out
 * and lse of piece p at po + p·stride_o, pl + p·stride_l. A NaN LSE makes the row NaN; rows no piece
 * sees anything of give 0 and -inf. */
static void join_pieces(const float *po, const float *pl, long stride_o, long stride_l, int pieces, int R, int Dv,
                        float *out, float *lse) {
    for (int r = 0; r < R; r++) {
        float m = -INFINITY;
        int nan = 0;
        for (int p = 0; p < pieces; p++) {
            const float l = pl[p * stride_l + r];
            nan |= l != l;
            m = l > m ? l : m;
        }
        float *o = out + (long)r * Dv;
        if (nan || m == -INFINITY) {
            for (int c = 0; c < Dv; c++) o[c] = nan ? NAN : 0.f;
            lse[r] = nan ? NAN : -INFINITY;
            continue;
        }
        float tot = 0.f;
        for (int c = 0; c < Dv; c++) o[c] = 0.f;
        for (int p = 0; p < pieces; p++) {
            const float w = expf(pl[p * stride_l + r] - m); /* 0 for a piece of -inf */
            if (w == 0.f) continue;
            tot += w;
            const float *op = po + p * stride_o + (long)r * Dv;
            for (int c = 0; c < Dv; c++) o[c] += w * op[c];
        }
        for (int c = 0; c < Dv; c++) o[c] /= tot;
        lse[r] = m + logf(tot);
    }
}

/* kind: 0 fp32, 1 bf16, 2 fp16, 3 int8, 4 fp8 e4m3fn. The (b, h) pairs are shared out by OpenMP: in a process
 * that has loaded PyTorch, `libgomp.so.1` is PyTorch's own (one runtime, one pool of threads:
 * threads of our own would compete with its workers, which spin a while after each of its ops).
 * With few pairs (MQA, MLA's one latent head, a batch of one), each pair's slots are split into
 * pieces of at least PIECE_MIN (split-K, as flash-decoding does), up to SPLIT_ITEMS items, so that
 * every thread has work and a thread descheduled on a busy machine leaves its pieces to the others;
 * the pieces' partials are joined by their LSE. The split depends on the shape alone, not on the
 * number of threads: a call gives the same bits on one thread or many. Built without OpenMP, the work runs one item after the other.
 *
 * mh_decode_joined: `count` jobs over disjoint slots of the same query rows, each in its own storage
 * (a quantized cache's full-precision sinks, its 8-bit slots, its full-precision residual window),
 * run in one parallel region and joined by their LSE into the first job's out and lse: one call,
 * where three calls and a merge in PyTorch cost 0.8 ms a step. Every job has the first's B, H, G,
 * Lq, D, Dv, q and scale.
 * Returns 0, or -1 when a buffer could not be allocated (the work of its thread is then not done). */
int mh_decode_joined(job_t *const *in, const int *kinds, int count, int threads) {
    const one_fn fns[5] = {one_f32, one_bf16, one_f16, one_i8, one_f8};
    const job_t *J = in[0];
    const int pairs = J->B * J->H, R = J->G * J->Lq, Dv = J->Dv;
    int split[count > 0 ? count : 1], total = 0;
    if (count < 1) return 0;
    for (int i = 0; i < count; i++) {
        int pieces = 1;
        if (pairs < SPLIT_PAIRS) { /* pieces from the shape alone: the same bits on any number of threads */
            const long most = in[i]->n / PIECE_MIN;
            pieces = (SPLIT_ITEMS + pairs - 1) / pairs;
            if (pieces > most) pieces = most < 1 ? 1 : (int)most;
        }
        split[i] = pieces, total += pieces;
    }
    job_t *jobs = (job_t *)malloc(sizeof(job_t) * total);
    one_fn *fn = (one_fn *)malloc(sizeof(one_fn) * total);
    float *po = NULL, *pl = NULL;
    int failed = 0;
    long longest = 0;
    if (!jobs || !fn) {
        free(jobs), free(fn);
        return -1;
    }
    if (total > 1) {
        po = (float *)malloc(sizeof(float) * (size_t)total * pairs * R * Dv);
        pl = (float *)malloc(sizeof(float) * (size_t)total * pairs * R);
        if (!po || !pl) {
            free(jobs), free(fn), free(po), free(pl);
            return -1;
        }
    }
    for (int i = 0, at = 0; i < count; at += split[i++]) {
        const job_t *Ji = in[i];
        one_fn f = fns[kinds[i]];
#ifdef HAVE_AMX
        if (amx_takes(kinds[i], R, J->D, Dv, Ji->blocked != NULL && Ji->band == NULL)) /* many rows: the tiles */
            f = kinds[i] == 1 ? one_amx_bf16 : kinds[i] == 3 ? one_amx_i8 : one_amx_f8;
#endif
#ifdef HAVE_AMX8
        if (f == one_i8 && amx8_takes(kinds[i], R, J->D)) f = one_i8_amx8; /* a few rows: int8 scores on the tiles */
#endif
        for (int p = 0; p < split[i]; p++) { /* piece p: slots [t0, t1) of every pair */
            const long t0 = Ji->n * p / split[i], t1 = Ji->n * (p + 1) / split[i];
            job_t *Jp = &jobs[at + p];
            *Jp = *Ji;
            Jp->lo = Ji->lo + t0, Jp->n = t1 - t0, Jp->first = Ji->first + t0;
            if (Ji->blocked) Jp->blocked = Ji->blocked + t0 * Ji->m_t;
            Jp->band_at = Ji->band_at + t0;
            if (total > 1) Jp->out = po + (long)(at + p) * pairs * R * Dv, Jp->lse = pl + (long)(at + p) * pairs * R;
            fn[at + p] = f;
            longest = Jp->n > longest ? Jp->n : longest;
        }
    }
    const int items = pairs * total;
    if (threads < 1) threads = 1;
    if (threads > items) threads = items;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *s = (float *)malloc(sizeof(float) * ((size_t)(R + 3) * longest + 16)); /* R4 rows */
        float *qs = (float *)malloc(sizeof(float) * ((size_t)(2 * R + 3) * J->D + 2 * (size_t)R + 16)); /* + m, tot, qt */
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items; it++) {
            if (s && qs)
                fn[it % total](&jobs[it % total], it / total, s, qs);
            else
                failed = 1;
        }
        free(s);
        free(qs);
        if (total > 1) { /* after the loop's barrier: every piece done */
#pragma omp for schedule(static)
            for (int bh = 0; bh < pairs; bh++)
                join_pieces(po + (long)bh * R * Dv, pl + (long)bh * R, (long)pairs * R * Dv, (long)pairs * R, total, R,
                            Dv, J->out + (long)bh * R * Dv, J->lse + (long)bh * R);
        }
    }
    free(jobs), free(fn), free(po), free(pl);
    return failed ? -1 : 0;
}

int mh_decode(job_t *J, int kind, int threads) { return mh_decode_joined(&J, &kind, 1, threads); }

/* 1 where a call of this storage kind, query rows per KV head, head sizes and mask (0/1) runs on the
 * AMX tiles (cpu_decode_amx.h: built with them and granted by the OS), 0 elsewhere */
int mh_decode_tiles(int kind, int rows, int D, int Dv, int masked) {
#ifdef HAVE_AMX
    return amx_takes(kind, rows, D, Dv, masked);
#else
    (void)kind, (void)rows, (void)D, (void)Dv, (void)masked;
    return 0;
#endif
}

/* 1 where an int8 call of this many query rows per KV head and key size takes its scores on the AMX
 * int8 tiles (cpu_decode_amx8.h), 0 elsewhere */
int mh_decode_int8_tiles(int rows, int D) {
#ifdef HAVE_AMX8
    return amx8_takes(3, rows, D);
#else
    (void)rows, (void)D;
    return 0;
#endif
}

/* sizeof(job_t), which cpu_kernels.py compares with its ctypes mirror before any call */
long mh_job_size(void) { return (long)sizeof(job_t); }
