/* multihead's CPU one-token projection: y = x W^T (+ b) for bf16 weights and 1 to 4 rows of bf16
 * input, the weights read once, at the memory's speed; per head too (x W_hᵀ and x W_h: MLA's
 * absorbed W_UV and W_UK).
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

/* For every (b, h) of B x H heads: y_bh[m, o] = bf16(Σ_i W_h[o, i] · x_bh[m, i] + bias[o]), m < rows,
 * o < out, i < in: x W_hᵀ, W_h's rows (stride ldw) at W + h·swh, x_bh's rows (stride ldx) at
 * x + b·sxb + h·sxh, y_bh's at y + b·syb + h·syh (stride ldy); bias may be NULL. A projection is
 * B = H = 1; MLA's W_UV is one W_h per head. Returns 0, or -1 for rows outside 1..MAX_ROWS. */
int mh_gemv_bf16(const uint16_t *W, long swh, long ldw, const uint16_t *x, long sxb, long sxh, long ldx, int rows,
                 const uint16_t *bias, uint16_t *y, long syb, long syh, long ldy, int out, int in, int B, int H,
                 int threads) {
    if (rows < 1 || rows > MAX_ROWS) return -1;
    const int full = in / 32 * 32, per = (out + 3) / 4;
    const __mmask32 tail = (__mmask32)((1ull << (in - full)) - 1);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long item = 0; item < (long)B * H * per; item++) {
        const int bh = (int)(item / per), b = bh / H, h = bh % H, o0 = 4 * (int)(item % per);
        const int ob = out - o0 < 4 ? out - o0 : 4;
        const uint16_t *xb = x + b * sxb + h * sxh, *w[4];
        for (int j = 0; j < 4; j++) w[j] = W + h * swh + (long)(o0 + (j < ob ? j : 0)) * ldw; /* past out: unused */
        __m512 acc[MAX_ROWS][4];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
        for (int c = 0; c < in; c += 32) {
            const __mmask32 k = c < full ? (__mmask32)~0u : tail; /* 32 features, or the last few */
            __m512bh wv[4];
            for (int j = 0; j < 4; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(k, w[j] + c);
            for (int m = 0; m < rows; m++) {
                const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(k, xb + (long)m * ldx + c);
                for (int j = 0; j < 4; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xv);
            }
        }
        uint16_t *yb = y + b * syb + h * syh;
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < ob; j++) {
                const float sum = _mm512_reduce_add_ps(acc[m][j]);
                yb[(long)m * ldy + o0 + j] = to_bf16(bias ? sum + from_bf16(bias[o0 + j]) : sum);
            }
    }
    return 0;
}

/* For every (b, h): y_bh[m, c] = bf16(Σ_n x_bh[m, n] · W_h[n, c]), m < rows, c < out, n < in: x W_h, the
 * weight's rows (stride ldw) contracted (MLA's q_nope W_UK per head). Each row of W_h is read once:
 * 64 columns at a time, widened to fp32 and multiplied by each x_bh[m, n] (fp32 FMAs: the pairs of
 * vdpbf16ps would pair rows n, n + 1, which do not lie side by side). Strides as mh_gemv_bf16. */
int mh_vecmat_bf16(const uint16_t *W, long swh, long ldw, const uint16_t *x, long sxb, long sxh, long ldx, int rows,
                   uint16_t *y, long syb, long syh, long ldy, int out, int in, int B, int H, int threads) {
    if (rows < 1 || rows > MAX_ROWS) return -1;
    const int per = (out + 63) / 64;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long item = 0; item < (long)B * H * per; item++) {
        const int bh = (int)(item / per), b = bh / H, h = bh % H, c0 = 64 * (int)(item % per);
        const int cols = out - c0 < 64 ? out - c0 : 64;
        const uint16_t *xb = x + b * sxb + h * sxh, *wh = W + h * swh + c0;
        __mmask16 k[4];
        for (int j = 0; j < 4; j++) {
            const int left = cols - 16 * j;
            k[j] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        }
        __m512 acc[MAX_ROWS][4];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
        for (int n = 0; n < in; n++) {
            __m512 wv[4];
            for (int j = 0; j < 4; j++) /* bf16 -> fp32: the 16 bits moved up */
                wv[j] = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k[j], wh + (long)n * ldw + 16 * j)), 16));
            for (int m = 0; m < rows; m++) {
                const __m512 xv = _mm512_set1_ps(from_bf16(xb[(long)m * ldx + n]));
                for (int j = 0; j < 4; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
            }
        }
        uint16_t *yb = y + b * syb + h * syh + c0;
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < 4; j++) {
                float v[16];
                _mm512_storeu_ps(v, acc[m][j]);
                for (int i = 0; i < 16 && 16 * j + i < cols; i++) yb[(long)m * ldy + 16 * j + i] = to_bf16(v[i]);
            }
    }
    return 0;
}
#else
int mh_gemv_takes(void) { return 0; }

int mh_gemv_bf16(const uint16_t *W, long swh, long ldw, const uint16_t *x, long sxb, long sxh, long ldx, int rows,
                 const uint16_t *bias, uint16_t *y, long syb, long syh, long ldy, int out, int in, int B, int H,
                 int threads) {
    (void)W, (void)swh, (void)ldw, (void)x, (void)sxb, (void)sxh, (void)ldx, (void)rows, (void)bias, (void)y;
    (void)syb, (void)syh, (void)ldy, (void)out, (void)in, (void)B, (void)H, (void)threads;
    return -1;
}

int mh_vecmat_bf16(const uint16_t *W, long swh, long ldw, const uint16_t *x, long sxb, long sxh, long ldx, int rows,
                   uint16_t *y, long syb, long syh, long ldy, int out, int in, int B, int H, int threads) {
    (void)W, (void)swh, (void)ldw, (void)x, (void)sxb, (void)sxh, (void)ldx, (void)rows, (void)y;
    (void)syb, (void)syh, (void)ldy, (void)out, (void)in, (void)B, (void)H, (void)threads;
    return -1;
}
#endif
