/* multihead's CPU best-first kernel: the n best of each row of fp32 scores, best first, equal
 * scores to the lower index, -inf never chosen (-1 in its place), as layers/ranking.best_first.
 *
 * The sparse layers rank a few hundred block scores per query and head to keep 16: PyTorch's CPU
 * topk takes about 3 µs for a row of 256 (a partial sort of (value, index) pairs per row). Here a
 * row is read once, left to right, against the n best so far kept sorted: a score enters only
 * when it beats the worst of them (strictly: an equal score comes later, so its index is higher),
 * and is moved up past the ones it beats. -0.0 and 0.0 are equal, as the rule asks.
 *
 * A row holding a NaN is flagged and left to the caller (its rule orders NaN above every score).
 * Threads: OpenMP over the rows, on PyTorch's own libgomp (as cpu_decode.c).
 * Built by multihead/backends/cpu_topk.py with the host's compiler (-O3 -march=native).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* score x at index j offered to the n best so far (val, idx: cnt of them, best first) */
static inline void offer(float x, long j, float *val, int64_t *idx, int *cnt, int n) {
    if (x == -INFINITY || (*cnt == n && !(x > val[n - 1]))) return;
    int at = *cnt < n ? (*cnt)++ : n - 1; /* the worst slot, or a new one */
    while (at > 0 && val[at - 1] < x) { /* strictly: an equal one came first and stays above */
        val[at] = val[at - 1];
        idx[at] = idx[at - 1];
        at--;
    }
    val[at] = x;
    idx[at] = j;
}

/* rows (R, m) with row stride ld; out (R, n) int64; nan (R,) set to 1 for rows with a NaN.
 * Two passes over a row. The first takes the max of each of the 16 lanes over the row's whole
 * vectors: 16 scores at 16 places, so for n <= 16 the least of them, T, is at most the n-th best
 * (a score below T is below 16 others: never chosen). The second offers the scores >= T (ties
 * with T included) in order, 16 compared at once: a few dozen offers per row, not one per score
 * that beats the n best so far. Returns the number of rows with a NaN. */
long mh_best_first(const float *s, long R, long m, long ld, int n, int64_t *out, uint8_t *nan, int threads) {
    long flagged = 0;
    const long m16 = m & ~15L;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : flagged)
    for (long r = 0; r < R; r++) {
        const float *row = s + r * ld;
        float val[256];
        int64_t *idx = out + r * n;
        int cnt = 0, bad = 0;
        v16f lanes = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
                      -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
        v16i odd = {0};
        for (long j = 0; j < m16; j += 16) {
            v16f x;
            memcpy(&x, row + j, 64);
            odd |= x != x;
            lanes = (v16f)(((v16i)x & (x > lanes)) | ((v16i)lanes & ~(x > lanes)));
        }
        float least = INFINITY;
        for (int l = 0; l < 16; l++) {
            bad |= odd[l] != 0;
            least = lanes[l] < least ? lanes[l] : least;
        }
        const float T = n <= 16 && m16 > 0 ? least : -INFINITY; /* scores below T are never chosen */
        long j = 0;
        for (; j < m16 && !bad; j += 16) {
            v16f x;
            memcpy(&x, row + j, 64);
            const float worst = cnt == n ? val[n - 1] : T;
            const v16f w = {worst, worst, worst, worst, worst, worst, worst, worst,
                            worst, worst, worst, worst, worst, worst, worst, worst};
            const v16i hit = x >= w;
            int any = 0;
            for (int l = 0; l < 16; l++) any |= hit[l];
            if (!any) continue;
            for (int l = 0; l < 16; l++)
                if (hit[l]) offer(x[l], j + l, val, idx, &cnt, n);
        }
        for (; j < m && !bad; j++) {
            if (row[j] != row[j]) bad = 1;
            else offer(row[j], j, val, idx, &cnt, n);
        }
        for (int i = cnt; i < n; i++) idx[i] = -1;
        nan[r] = (uint8_t)bad;
        flagged += bad;
    }
    return flagged;
}

/* the most n this kernel keeps per row (its stack array) */
int mh_best_first_max(void) { return 256; }
