/* multihead's CPU one-token projection: y = x W^T (+ b) for bf16 weights and 1 to 4 rows of bf16
 * input, the weights read once, at the memory's speed.
 *
 * A decode step multiplies each projection's weights by one token. In bf16 on the CPU PyTorch's
 * F.linear takes that through oneDNN's GEMM and reads the weights at about half the rate it reads
 * fp32 ones, so a bf16 step spent as long on its projections as an fp32 step (measured:
 * docs/inference.md#one-token-projections). Here each output row is a dot product of the weight
 * row with the inputs by vdpbf16ps (pairs of bf16 products summed in fp32), four weight rows at a
 * time against every input row, so each weight is loaded once per call; the sums are fp32, the
 * bias added in fp32, each output rounded once to bf16 (nearest even), as F.linear does.
 * vdpbf16ps treats bf16 subnormals (below 1.2e-38) as zero.
 *
 * Threads: OpenMP over blocks of output rows, on PyTorch's own libgomp (as cpu_decode.c).
 * Built by multihead/backends/cpu_gemv.py with the host's compiler (-O3 -march=native); without
 * AVX512-BF16 it builds to mh_gemv_takes() == 0 and the callers run F.linear.
 */
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 4 /* input rows a call takes: a decode step of a few tokens (more: a GEMM's work) */

int mh_gemv_max_rows(void) { return MAX_ROWS; }

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

int mh_gemv_takes(void) { return 1; }

static inline uint16_t to_bf16(float f) { /* nearest even; a NaN stays a (quiet) NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* y[m·ldy + o] = bf16(Σ_i W[o·ldw + i] · x[m·ldx + i] + bias[o]) for m < rows, o < out, i < in;
 * bias may be NULL. Returns 0, or -1 for rows outside 1..MAX_ROWS. */
int mh_gemv_bf16(const uint16_t *W, long ldw, const uint16_t *x, long ldx, int rows, const uint16_t *bias,
                 uint16_t *y, long ldy, int out, int in, int threads) {
    if (rows < 1 || rows > MAX_ROWS) return -1;
    const int full = in / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (in - full)) - 1);
    const int blocks = (out + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int blk = 0; blk < blocks; blk++) {
        const int o0 = 4 * blk, ob = out - o0 < 4 ? out - o0 : 4;
        const uint16_t *w[4];
        for (int j = 0; j < 4; j++) w[j] = W + (long)(o0 + (j < ob ? j : 0)) * ldw; /* past out: row o0 again, unused */
        __m512 acc[MAX_ROWS][4];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
        for (int c = 0; c < in; c += 32) {
            const __mmask32 k = c < full ? (__mmask32)~0u : tail; /* 32 features, or the last few */
            __m512bh wv[4];
            for (int j = 0; j < 4; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(k, w[j] + c);
            for (int m = 0; m < rows; m++) {
                const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(k, x + (long)m * ldx + c);
                for (int j = 0; j < 4; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xv);
            }
        }
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < ob; j++) {
                const float sum = _mm512_reduce_add_ps(acc[m][j]);
                y[(long)m * ldy + o0 + j] = to_bf16(bias ? sum + from_bf16(bias[o0 + j]) : sum);
            }
    }
    return 0;
}
#else
int mh_gemv_takes(void) { return 0; }

int mh_gemv_bf16(const uint16_t *W, long ldw, const uint16_t *x, long ldx, int rows, const uint16_t *bias,
                 uint16_t *y, long ldy, int out, int in, int threads) {
    (void)W, (void)ldw, (void)x, (void)ldx, (void)rows, (void)bias, (void)y, (void)ldy, (void)out, (void)in;
    (void)threads;
    return -1;
}
#endif
