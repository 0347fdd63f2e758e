/* multihead's CPU kernel for block-selected attention: each query row reads only the key blocks
 * its row of a block_select table names, query-major, no row copied through memory.
 *
 * A unit e is Gp query heads sharing one row of the table and one KV head (block_gather.py's
 * Selection.units). Query block n of a unit (qbs tokens) reads key blocks idx[b, row(e), n, :]
 * (-1: none; a block named twice counts once), each of bs keys. With s = scale · q · k:
 *
 *   visible(i, t) = t in a selected block of i's query block, t < Lk, and (causal) t <= i + d
 *   m_i = max_t s_it, p_it = exp(s_it - m_i), l_i = Σ_t p_it, lse_i = m_i + log l_i
 *   o_i = Σ_t p_it · v_t / l_i                       (no visible key: o_i = 0, lse_i = -inf)
 *
 * Forward, one tile (up to TILE_ROWS rows: a few query blocks of one unit) at a time: the tile's
 * (key block, query block) pairs are sorted by key block, so each selected key block is read
 * once for all the rows of the tile that chose it; those rows go through it 4 at a time, an
 * online softmax (running max m and sum l per row in fp32, exp by the polynomial vexp) carrying
 * o from block to block. Register tiles: S = Q Kᵀ as 4 rows x 64 keys (q broadcast, K packed
 * transposed per block so 16 keys are one vector), O += P V as 4 rows x 64 features.
 *
 * Backward from (o, lse, do) with delta_i = Σ_c do_ic · o_ic (− dlse_i), the same pairs:
 *
 *   p = exp(s - lse), dp = do · vᵀ, ds = p ∘ (dp - delta)
 *   dv_t += Σ_i p_it do_i, dk_t += Σ_i ds_it (scale · q_i), dq_i += scale · Σ_t ds_it k_t
 *
 * dk, dv of a key block gather a tile's rows in a block-sized buffer, then are added to the
 * block's rows. No two threads write the same dk/dv rows: threads share out the (batch, KV head)
 * pairs when there are enough of them, else each thread sums into a buffer of its own, added up
 * after. Threads: OpenMP, on PyTorch's own libgomp (as cpu_decode.c: one pool of threads).
 * Built by multihead/backends/cpu_sparse.py with the host's compiler (-O3 -march=native).
 */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_vector.h"

#ifndef TILE_ROWS
#define TILE_ROWS 1024 /* rows per tile: each key block read once for the ~TILE_ROWS·k/nK rows that chose it (512: 5-10% slower at 16k, 2048: NSA slower) */
#endif
#define RG 4 /* rows per register tile */
#ifndef CB
#define CB 64 /* keys per chunk of the backward (a multiple of 16, at most 64; 16 and 32 measured the same at 16k) */
#endif

static inline v16f load(const float *p) { v16f v; memcpy(&v, p, 64); return v; }
static inline void store(float *p, v16f v) { memcpy(p, &v, 64); }
static inline v16f bcast(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#ifdef __AVX512F__
static inline float hmax(v16f v) { return _mm512_reduce_max_ps((__m512)v); }
#else
static inline float hmax(v16f v) {
    float m = v[0];
    for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m;
    return m;
}
#endif

#define LOG2E 1.44269504088896341f
#define LN2 0.69314718055994531f

#ifdef __AVX512F__
/* 2^x for x <= 0 (scores in base 2 minus their max; a little above 0 is fine), exactly 0 below
 * -150 and for -inf (2^-160 rounds to 0), NaN kept: x = n + f with n an integer and |f| <= 1/2, 2^f by its Taylor
 * polynomial of degree 6 (relative error below 2e-7, as fp32's own exp2f), 2^n by vscalefps */
static inline v16f vexp2(v16f x) {
    const __m512 z = _mm512_max_ps(_mm512_set1_ps(-160.f), (__m512)x); /* NaN in x stays NaN */
    const __m512 n = _mm512_roundscale_ps(z, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(z, n);
    __m512 p = _mm512_set1_ps(1.5403530393e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return (v16f)_mm512_scalef_ps(p, n);
}
#else
static inline v16f vexp2(v16f x) { return vexp(x * LN2); } /* cpu_vector.h's exp */
#endif

typedef struct {
    int B, Hq, Hkv, Lq, Lk, D, Dv;
    int He, Gp, qbs, bs, ksel;
    int causal;
    long d;                     /* causal: key t visible to query i iff t <= i + d */
    float scale;
    const float *q;             /* (B, Hq, Lq, D), features contiguous */
    long q_b, q_h, q_l;
    const float *kt, *vt;       /* (B, Hkv, nK, D|Dv, bs) contiguous: the blocks transposed */
    const float *k, *v;         /* (B, Hkv, Lk, D|Dv), features contiguous */
    long k_b, k_h, k_l, v_b, v_h, v_l;
    const int64_t *idx;         /* (B, Hs, nQ, ksel), any strides (batch stride 0 for one row) */
    long i_b, i_h, i_n, i_s;
    const int64_t *row, *kv;    /* (He,): each unit's row of idx, its KV head */
    float *out, *lse;           /* (B, Hq, Lq, Dv), (B, Hq, Lq) contiguous */
    /* backward */
    const float *dout, *delta, *lse_in; /* (B, Hq, Lq, Dv), (B, Hq, Lq), (B, Hq, Lq) contiguous */
    float *dq, *dk, *dv;        /* (B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv) fp32, zeroed */
} sparse_t;

/* ------------------------------------------------------------------------------- a tile's plan */
typedef struct {
    int tokens;                 /* query tokens of the tile */
    int R;                      /* rows: tokens x Gp (row r: token r / Gp, head g = r % Gp) */
    long tok0;                  /* the tile's first query position */
    int npairs;
    int64_t *pairs;             /* (key block << 32) | query block, sorted, unique */
} plan_t;


static inline int tile_blocks(const sparse_t *J) { /* query blocks per tile */
    int per = TILE_ROWS / (J->Gp * J->qbs);
    return per < 1 ? 1 : per;
}

/* The pairs (key block, query block) of query blocks [n0, n1) of unit e in batch row b, sorted
 * by key block (a counting sort over the nK blocks: `raw` holds them in query order, `count` nK + 1
 * zeros, left zero): -1, a repeat and a block no row of the query block may see (causal) dropped. */
static void plan_tile(const sparse_t *J, int b, int e, int n0, int n1, plan_t *P, int64_t *raw, int *count) {
    const int64_t *base = J->idx + b * J->i_b + J->row[e] * J->i_h;
    const long nK = (J->Lk + J->bs - 1) / J->bs;
    int np = 0;
    for (int n = n0; n < n1; n++) {
        long last = (long)(n + 1) * J->qbs - 1;
        if (last >= J->Lq) last = J->Lq - 1;
        for (int s = 0; s < J->ksel; s++) {
            int64_t j = base[n * J->i_n + s * J->i_s];
            if (j < 0 || j >= nK) continue;
            if (J->causal && j * J->bs > last + J->d) continue;
            raw[np++] = (j << 32) | n;
            count[j + 1]++;
        }
    }
    for (long j = 0; j < nK; j++) count[j + 1] += count[j]; /* count[j]: where block j's pairs start */
    for (int i = 0; i < np; i++) P->pairs[count[raw[i] >> 32]++] = raw[i]; /* stable: n ascending */
    memset(count, 0, sizeof(int) * (nK + 1));
    int u = 0;
    for (int i = 0; i < np; i++)
        if (u == 0 || P->pairs[i] != P->pairs[u - 1]) P->pairs[u++] = P->pairs[i];
    P->npairs = u;
    P->tok0 = (long)n0 * J->qbs;
    long end = (long)n1 * J->qbs;
    P->tokens = (int)((end < J->Lq ? end : J->Lq) - P->tok0);
    P->R = P->tokens * J->Gp;
}

/* The rows (of the tile) that read key block j through pairs [p0, p1) (all of block j), in
 * order, those that see none of its keys (causal) left out. Returns their count. */
static int rows_of_block(const sparse_t *J, const plan_t *P, int p0, int p1, long key0, int *rows) {
    int nr = 0;
    for (int p = p0; p < p1; p++) {
        long n = P->pairs[p] & 0xffffffffL;
        long t0 = n * J->qbs, t1 = t0 + J->qbs;
        if (t1 > J->Lq) t1 = J->Lq;
        if (J->causal && t0 + J->d < key0) t0 = key0 - J->d; /* queries before the block see none of it */
        for (long t = t0; t < t1; t++)
            for (int g = 0; g < J->Gp; g++) rows[nr++] = (int)(t - P->tok0) * J->Gp + g;
    }
    return nr;
}

/* ------------------------------------------------------------------------- register tiles */
/* S[r][:] = Σ_c x_r[c] · kt[c][:] for RG rows (pointers xs[r], length C) x NV·16 keys of a packed
 * transposed block (row stride ld): 4 x 64 accumulators at most */
static inline __attribute__((always_inline)) void scores_tile(const float *const *xs, const float *kt, long ld, int C,
                                                              int NV, v16f S[RG][4]) {
    v16f a[RG][4];
    for (int r = 0; r < RG; r++)
        for (int j = 0; j < 4; j++) a[r][j] = (v16f){0};
    for (int c = 0; c < C; c++) {
        const float *kr = kt + c * ld;
        v16f k0 = load(kr), k1 = NV > 1 ? load(kr + 16) : (v16f){0};
        v16f k2 = NV > 2 ? load(kr + 32) : (v16f){0}, k3 = NV > 3 ? load(kr + 48) : (v16f){0};
        for (int r = 0; r < RG; r++) {
            v16f x = bcast(xs[r][c]);
            a[r][0] += x * k0;
            if (NV > 1) a[r][1] += x * k1;
            if (NV > 2) a[r][2] += x * k2;
            if (NV > 3) a[r][3] += x * k3;
        }
    }
    for (int r = 0; r < RG; r++)
        for (int j = 0; j < 4; j++) S[r][j] = a[r][j];
}

static void scores_any(const float *const *xs, const float *kt, long ld, int C, int NV, v16f S[RG][4]) {
    switch (NV) { /* each a specialised copy: the accumulators stay in registers */
    case 4: scores_tile(xs, kt, ld, C, 4, S); break;
    case 3: scores_tile(xs, kt, ld, C, 3, S); break;
    case 2: scores_tile(xs, kt, ld, C, 2, S); break;
    default: scores_tile(xs, kt, ld, C, 1, S); break;
    }
}

/* acc_r[f0 .. f0 + 64) += Σ_t w[r][t] · y_t[f0 ..] for RG rows, keys t < cnt (rows of y with
 * stride ly), NF·16 features: the P V (and dS K) tile, 4 x 64 accumulators */
static inline __attribute__((always_inline)) void update_tile(float *const *acc, const float w[RG][64], const float *y,
                                                              long ly, int cnt, int NF) {
    v16f a[RG][4];
    for (int r = 0; r < RG; r++)
        for (int f = 0; f < NF; f++) a[r][f] = load(acc[r] + 16 * f);
    for (int t = 0; t < cnt; t++) {
        const float *yr = y + t * ly;
        v16f y0 = load(yr), y1 = NF > 1 ? load(yr + 16) : (v16f){0};
        v16f y2 = NF > 2 ? load(yr + 32) : (v16f){0}, y3 = NF > 3 ? load(yr + 48) : (v16f){0};
        for (int r = 0; r < RG; r++) {
            v16f x = bcast(w[r][t]);
            a[r][0] += x * y0;
            if (NF > 1) a[r][1] += x * y1;
            if (NF > 2) a[r][2] += x * y2;
            if (NF > 3) a[r][3] += x * y3;
        }
    }
    for (int r = 0; r < RG; r++)
        for (int f = 0; f < NF; f++) store(acc[r] + 16 * f, a[r][f]);
}

/* acc over a row of F features: every 64 (and the 16s left) */
static void update_rows(float *const *acc, const float w[RG][64], const float *y, long ly, int cnt, int F) {
    for (int f0 = 0; f0 < F; f0 += 64) {
        float *ac[RG];
        for (int r = 0; r < RG; r++) ac[r] = acc[r] + f0;
        int NF = F - f0 >= 64 ? 4 : (F - f0) / 16;
        switch (NF) {
        case 4: update_tile(ac, w, y + f0, ly, cnt, 4); break;
        case 3: update_tile(ac, w, y + f0, ly, cnt, 3); break;
        case 2: update_tile(ac, w, y + f0, ly, cnt, 2); break;
        default: update_tile(ac, w, y + f0, ly, cnt, 1); break;
        }
    }
}

/* out_t[f] += Σ_r w[r][t] · x_r[f] for keys t < cnt, F features (rows of out with stride lo):
 * dV and dK of a block; the RG rows x 64 features of x stay in registers across the keys */
static inline __attribute__((always_inline)) void outer_tile(float *out, long lo, const float w[RG][64],
                                                             const float *const *xs, int cnt, int NF) {
    v16f x[RG][4];
    for (int r = 0; r < RG; r++)
        for (int f = 0; f < NF; f++) x[r][f] = load(xs[r] + 16 * f);
    int t = 0;
    for (; t + 2 <= cnt; t += 2) { /* two keys at once: 2·NF chains of RG dependent FMAs in flight */
        float *o0 = out + t * lo, *o1 = o0 + lo;
        v16f a[4], b[4];
        for (int f = 0; f < NF; f++) a[f] = load(o0 + 16 * f), b[f] = load(o1 + 16 * f);
        for (int r = 0; r < RG; r++) {
            v16f p0 = bcast(w[r][t]), p1 = bcast(w[r][t + 1]);
            for (int f = 0; f < NF; f++) a[f] += p0 * x[r][f], b[f] += p1 * x[r][f];
        }
        for (int f = 0; f < NF; f++) store(o0 + 16 * f, a[f]), store(o1 + 16 * f, b[f]);
    }
    for (; t < cnt; t++) {
        float *o = out + t * lo;
        v16f a[4];
        for (int f = 0; f < NF; f++) a[f] = load(o + 16 * f);
        for (int r = 0; r < RG; r++) {
            v16f p = bcast(w[r][t]);
            for (int f = 0; f < NF; f++) a[f] += p * x[r][f];
        }
        for (int f = 0; f < NF; f++) store(o + 16 * f, a[f]);
    }
}

static void outer_rows(float *out, long lo, const float w[RG][64], const float *const *xs, int cnt, int F) {
    for (int f0 = 0; f0 < F; f0 += 64) {
        const float *xc[RG];
        for (int r = 0; r < RG; r++) xc[r] = xs[r] + f0;
        int NF = F - f0 >= 64 ? 4 : (F - f0) / 16;
        switch (NF) {
        case 4: outer_tile(out + f0, lo, w, xc, cnt, 4); break;
        case 3: outer_tile(out + f0, lo, w, xc, cnt, 3); break;
        case 2: outer_tile(out + f0, lo, w, xc, cnt, 2); break;
        default: outer_tile(out + f0, lo, w, xc, cnt, 1); break;
        }
    }
}

/* Scores of a register tile set to -inf where a key is past Lk or (causal) after the row's query. */
static void mask_tile(const sparse_t *J, v16f S[RG][4], const long qpos[RG], long key0, int NV) {
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16f ninf = (v16f){0} - INFINITY;
    for (int j = 0; j < NV; j++) {
        v16i kpos = lane + (int)(key0 + 16 * j);
        v16i ok = kpos < J->Lk;
        for (int r = 0; r < RG; r++) {
            v16i vis = ok;
            if (J->causal) vis &= kpos <= (int)(qpos[r] + J->d);
            S[r][j] = sel(vis, S[r][j], ninf);
        }
    }
}

/* ---------------------------------------------------------------------------------- forward */
typedef struct {
    float *qs, *o, *m, *l; /* rows x D (q · scale), rows x Dv, rows, rows (+RG scratch rows) */
    int64_t *pairs, *raw;
    int *rows, *count;
} fwd_buf;

/* The online softmax of RG rows over one chunk of scores (base 2): the running max m and sum l of
 * each row moved to the chunk, what its output holds rescaled when the max grows, the chunk's
 * weights p = 2^(s - m) written to pw (0 for a row that has seen no key yet) */
static inline __attribute__((always_inline)) void softmax_tile(v16f S[RG][4], int NV, const int *rr, float *const *os,
                                                               int Dv, float *M, float *Lsum, float pw[RG][64]) {
    for (int r = 0; r < RG; r++) {
        v16f mv = S[r][0];
        for (int v = 1; v < NV; v++) mv = sel(S[r][v] > mv, S[r][v], mv);
        const float mx = hmax(mv), m0 = M[rr[r]];
        const float mn = mx > m0 ? mx : m0;
        if (mn == -INFINITY) { /* the row sees no key yet */
            memset(pw[r], 0, sizeof(pw[r]));
            continue;
        }
        const v16f mnv = bcast(mn);
        v16f sum = {0};
        for (int v = 0; v < NV; v++) {
            v16f e = vexp2(S[r][v] - mnv);
            store(pw[r] + 16 * v, e);
            sum += e;
        }
        if (mn > m0) { /* a new maximum: what the row holds is rescaled to it */
            const float alpha = exp2f(m0 - mn);
            float *o = os[r];
            for (int c = 0; c < Dv; c++) o[c] *= alpha;
            Lsum[rr[r]] *= alpha;
            M[rr[r]] = mn;
        }
        Lsum[rr[r]] += hsum(sum);
    }
}

static void softmax_step(v16f S[RG][4], int NV, const int *rr, float *const *os, int Dv, float *M, float *Lsum,
                         float pw[RG][64]) {
    switch (NV) { /* each a specialised copy, unrolled */
    case 4: softmax_tile(S, 4, rr, os, Dv, M, Lsum, pw); break;
    case 3: softmax_tile(S, 3, rr, os, Dv, M, Lsum, pw); break;
    case 2: softmax_tile(S, 2, rr, os, Dv, M, Lsum, pw); break;
    default: softmax_tile(S, 1, rr, os, Dv, M, Lsum, pw); break;
    }
}

static void forward_tile(const sparse_t *J, int b, int e, int n0, int n1, fwd_buf *W) {
    const int D = J->D, Dv = J->Dv, Gp = J->Gp, bs = J->bs;
    const int kvh = (int)J->kv[e];
    plan_t P = {.pairs = W->pairs};
    plan_tile(J, b, e, n0, n1, &P, W->raw, W->count);
    const int R = P.R;
    for (int r = 0; r < R + RG; r++) {
        float *qs = W->qs + (long)r * D;
        if (r < R) {
            const float *q = J->q + b * J->q_b + (long)(e * Gp + r % Gp) * J->q_h + (P.tok0 + r / Gp) * J->q_l;
            const float f = J->scale * LOG2E; /* scores in base 2: exp2 is cheaper than exp */
            for (int c = 0; c < D; c++) qs[c] = q[c] * f;
        } else
            memset(qs, 0, sizeof(float) * D); /* the scratch rows that pad a register tile */
        W->m[r] = -INFINITY;
        W->l[r] = 0.f;
        memset(W->o + (long)r * Dv, 0, sizeof(float) * Dv);
    }
    const long nK = (J->Lk + bs - 1) / bs;
    const float *KT = J->kt + ((long)b * J->Hkv + kvh) * nK * D * bs;
    const float *V = J->v + b * J->v_b + kvh * J->v_h;
    float pw[RG][64];
    for (int p0 = 0, p1; p0 < P.npairs; p0 = p1) {
        const long j = P.pairs[p0] >> 32;
        for (p1 = p0; p1 < P.npairs && P.pairs[p1] >> 32 == j; p1++) {}
        const long key0 = j * bs;
        const int nr = rows_of_block(J, &P, p0, p1, key0, W->rows);
        for (int g0 = 0; g0 < nr; g0 += RG) {
            int rr[RG];
            long qpos[RG];
            for (int r = 0; r < RG; r++) {
                rr[r] = g0 + r < nr ? W->rows[g0 + r] : R + r;
                qpos[r] = g0 + r < nr ? P.tok0 + rr[r] / Gp : P.tok0 + W->rows[nr - 1] / Gp;
            }
            const float *xs[RG];
            float *os[RG];
            for (int r = 0; r < RG; r++) xs[r] = W->qs + (long)rr[r] * D, os[r] = W->o + (long)rr[r] * Dv;
            long qmin = qpos[0], qmax = qpos[RG - 1]; /* rows in order: the first sees the fewest keys */
            for (int c0 = 0; c0 < bs; c0 += 64) {
                const long k0 = key0 + c0;
                if (k0 >= J->Lk || (J->causal && k0 > qmax + J->d)) break; /* no row sees these keys */
                const int NV = bs - c0 >= 64 ? 4 : (bs - c0) / 16;
                long kend = k0 + 16 * NV; /* keys of the chunk read, and whether all rows see all */
                if (kend > J->Lk) kend = J->Lk;
                if (J->causal && kend > qmax + J->d + 1) kend = qmax + J->d + 1;
                const int whole = k0 + 16 * NV <= J->Lk && (!J->causal || k0 + 16 * NV - 1 <= qmin + J->d);
                v16f S[RG][4];
                scores_any(xs, KT + j * D * bs + c0, bs, D, NV, S);
                if (!whole) mask_tile(J, S, qpos, k0, NV);
                softmax_step(S, NV, rr, os, Dv, W->m, W->l, pw);
                update_rows(os, (const float(*)[64])pw, V + k0 * J->v_l, J->v_l, (int)(kend - k0), Dv);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const int h = e * Gp + r % Gp;
        const long i = P.tok0 + r / Gp;
        const long at = ((long)b * J->Hq + h) * J->Lq + i;
        float *out = J->out + at * Dv;
        const float l = W->l[r], *o = W->o + (long)r * Dv;
        if (l > 0.f) {
            const float inv = 1.0f / l;
            for (int c = 0; c < Dv; c++) out[c] = o[c] * inv;
            J->lse[at] = (W->m[r] + log2f(l)) * LN2; /* back from base 2 */
        } else {
            memset(out, 0, sizeof(float) * Dv);
            J->lse[at] = -INFINITY;
        }
    }
}

static long tiles_per_unit(const sparse_t *J) {
    const long nQ = (J->Lq + J->qbs - 1) / J->qbs;
    const int per = tile_blocks(J);
    return (nQ + per - 1) / per;
}

static long max_rows(const sparse_t *J) { return (long)tile_blocks(J) * J->qbs * J->Gp; }

/* kind 0: fp32. Returns 0, or -1 when a thread could not allocate its buffers. */
int mh_sparse_forward(const sparse_t *J, int threads) {
    const long tiles = tiles_per_unit(J), work = (long)J->B * J->He * tiles;
    const long R = max_rows(J) + RG, nb = tile_blocks(J), nK = (J->Lk + J->bs - 1) / J->bs;
    int failed = 0;
    if (threads < 1) threads = 1;
    if (threads > work) threads = (int)(work > 0 ? work : 1);
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        fwd_buf W;
        W.qs = malloc(sizeof(float) * R * J->D);
        W.o = malloc(sizeof(float) * R * J->Dv);
        W.m = malloc(sizeof(float) * R);
        W.l = malloc(sizeof(float) * R);
        W.pairs = malloc(sizeof(int64_t) * nb * J->ksel + 8);
        W.raw = malloc(sizeof(int64_t) * nb * J->ksel + 8);
        W.count = calloc(nK + 1, sizeof(int));
        W.rows = malloc(sizeof(int) * R);
        const int ok = W.qs && W.o && W.m && W.l && W.pairs && W.raw && W.count && W.rows;
        /* the latest tiles first: under a causal mask they read the most blocks */
#pragma omp for schedule(dynamic, 1)
        for (long w = 0; w < work; w++) {
            const long tile = tiles - 1 - w % tiles, be = w / tiles;
            const int n0 = (int)(tile * nb), nQ = (int)((J->Lq + J->qbs - 1) / J->qbs);
            if (ok)
                forward_tile(J, (int)(be / J->He), (int)(be % J->He), n0, n0 + nb < nQ ? n0 + (int)nb : nQ, &W);
            else
                failed = 1;
        }
        free(W.qs); free(W.o); free(W.m); free(W.l); free(W.pairs); free(W.raw); free(W.count); free(W.rows);
    }
    return failed ? -1 : 0;
}

/* --------------------------------------------------------------------------------- backward */
typedef struct {
    float *qs, *go, *dq, *lse, *delta; /* rows x D, rows x Dv, rows x D, rows, rows (+RG scratch) */
    float *dkb, *dvb;                  /* bs x D, bs x Dv: one key block's share of this tile */
    int64_t *pairs, *raw;
    int *rows, *count;
} bwd_buf;

/* The gradients of tile [n0, n1) of unit e: dq of its rows written, dk and dv of the key blocks
 * it read added into dk, dv (the (b, KV head) slice: Lk x D, Lk x Dv). */
static void backward_tile(const sparse_t *J, int b, int e, int n0, int n1, float *dk, float *dv, bwd_buf *W) {
    const int D = J->D, Dv = J->Dv, Gp = J->Gp, bs = J->bs;
    const int kvh = (int)J->kv[e];
    plan_t P = {.pairs = W->pairs};
    plan_tile(J, b, e, n0, n1, &P, W->raw, W->count);
    const int R = P.R;
    for (int r = 0; r < R + RG; r++) {
        float *qs = W->qs + (long)r * D, *go = W->go + (long)r * Dv;
        memset(W->dq + (long)r * D, 0, sizeof(float) * D);
        if (r < R) {
            const int h = e * Gp + r % Gp;
            const long i = P.tok0 + r / Gp, at = ((long)b * J->Hq + h) * J->Lq + i;
            const float *q = J->q + b * J->q_b + h * J->q_h + i * J->q_l;
            const float f = J->scale * LOG2E; /* scores in base 2, as the forward's */
            for (int c = 0; c < D; c++) qs[c] = q[c] * f;
            memcpy(go, J->dout + at * Dv, sizeof(float) * Dv);
            const float l = J->lse_in[at];
            W->lse[r] = l == -INFINITY ? INFINITY : l * LOG2E; /* a row that saw nothing: p = 2^(s - inf) = 0 */
            W->delta[r] = J->delta[at];
        } else {
            memset(qs, 0, sizeof(float) * D);
            memset(go, 0, sizeof(float) * Dv);
            W->lse[r] = INFINITY;
            W->delta[r] = 0.f;
        }
    }
    const long nK = (J->Lk + bs - 1) / bs;
    const float *KT = J->kt + ((long)b * J->Hkv + kvh) * nK * D * bs;
    const float *VT = J->vt + ((long)b * J->Hkv + kvh) * nK * Dv * bs;
    const float *K = J->k + b * J->k_b + kvh * J->k_h;
    float pw[RG][64], dsw[RG][64];
    for (int p0 = 0, p1; p0 < P.npairs; p0 = p1) {
        const long j = P.pairs[p0] >> 32;
        for (p1 = p0; p1 < P.npairs && P.pairs[p1] >> 32 == j; p1++) {}
        const long key0 = j * bs;
        const int cnt = (int)(J->Lk - key0 < bs ? J->Lk - key0 : bs);
        memset(W->dkb, 0, sizeof(float) * bs * D);
        memset(W->dvb, 0, sizeof(float) * bs * Dv);
        const int nr = rows_of_block(J, &P, p0, p1, key0, W->rows);
        /* chunks of CB keys outside, the row groups inside: every group goes through a chunk's K, Kᵀ,
         * Vᵀ, dK and dV while they are in cache */
        for (int c0 = 0; c0 < bs; c0 += CB) {
            const long k0 = key0 + c0;
            if (k0 >= J->Lk) break;
            const int NV = bs - c0 >= CB ? CB / 16 : (bs - c0) / 16;
            for (int g0 = 0; g0 < nr; g0 += RG) {
                int rr[RG];
                long qpos[RG];
                for (int r = 0; r < RG; r++) {
                    rr[r] = g0 + r < nr ? W->rows[g0 + r] : R + r;
                    qpos[r] = g0 + r < nr ? P.tok0 + rr[r] / Gp : P.tok0 + W->rows[nr - 1] / Gp;
                }
                const long qmin = qpos[0], qmax = qpos[RG - 1];
                if (J->causal && k0 > qmax + J->d) continue; /* no row of the group sees the chunk; later groups may */
                const float *xs[RG], *gs[RG];
                float *dqs[RG];
                for (int r = 0; r < RG; r++) {
                    xs[r] = W->qs + (long)rr[r] * D, gs[r] = W->go + (long)rr[r] * Dv;
                    dqs[r] = W->dq + (long)rr[r] * D;
                }
                long kend = k0 + 16 * NV;
                if (kend > J->Lk) kend = J->Lk;
                if (J->causal && kend > qmax + J->d + 1) kend = qmax + J->d + 1;
                const int n = (int)(kend - k0);
                const int whole = k0 + 16 * NV <= J->Lk && (!J->causal || k0 + 16 * NV - 1 <= qmin + J->d);
                v16f S[RG][4], dP[RG][4];
                scores_any(xs, KT + j * D * bs + c0, bs, D, NV, S);
                if (!whole) mask_tile(J, S, qpos, k0, NV);
                scores_any(gs, VT + j * Dv * bs + c0, bs, Dv, NV, dP);
                for (int r = 0; r < RG; r++) {
                    const float l = W->lse[rr[r]], dl = W->delta[rr[r]];
                    for (int v = 0; v < NV; v++) {
                        v16f p = vexp2(S[r][v] - l);
                        store(pw[r] + 16 * v, p);
                        store(dsw[r] + 16 * v, p * (dP[r][v] - dl));
                    }
                }
                outer_rows(W->dvb + (long)c0 * Dv, Dv, (const float(*)[64])pw, gs, n, Dv);
                outer_rows(W->dkb + (long)c0 * D, D, (const float(*)[64])dsw, xs, n, D);
                update_rows(dqs, (const float(*)[64])dsw, K + k0 * J->k_l, J->k_l, n, D);
            }
        }
        float *dkr = dk + key0 * D, *dvr = dv + key0 * Dv;
        for (long i = 0; i < (long)cnt * D; i++) dkr[i] += W->dkb[i] * LN2; /* Σ ds q·scale, from q·scale·log2 e */
        for (long i = 0; i < (long)cnt * Dv; i++) dvr[i] += W->dvb[i];
    }
    for (int r = 0; r < R; r++) {
        const int h = e * Gp + r % Gp;
        const long i = P.tok0 + r / Gp, at = ((long)b * J->Hq + h) * J->Lq + i;
        float *dq = J->dq + at * D;
        const float *acc = W->dq + (long)r * D;
        for (int c = 0; c < D; c++) dq[c] = acc[c] * J->scale;
    }
}

static int alloc_bwd(const sparse_t *J, bwd_buf *W) {
    const long R = max_rows(J) + RG;
    W->qs = malloc(sizeof(float) * R * J->D);
    W->dq = malloc(sizeof(float) * R * J->D);
    W->go = malloc(sizeof(float) * R * J->Dv);
    W->lse = malloc(sizeof(float) * R);
    W->delta = malloc(sizeof(float) * R);
    W->dkb = malloc(sizeof(float) * J->bs * J->D);
    W->dvb = malloc(sizeof(float) * J->bs * J->Dv);
    W->pairs = malloc(sizeof(int64_t) * tile_blocks(J) * J->ksel + 8);
    W->raw = malloc(sizeof(int64_t) * tile_blocks(J) * J->ksel + 8);
    W->count = calloc((J->Lk + J->bs - 1) / J->bs + 1, sizeof(int));
    W->rows = malloc(sizeof(int) * R);
    return W->qs && W->dq && W->go && W->lse && W->delta && W->dkb && W->dvb && W->pairs && W->raw && W->count &&
           W->rows;
}

static void free_bwd(bwd_buf *W) {
    free(W->qs); free(W->dq); free(W->go); free(W->lse); free(W->delta);
    free(W->dkb); free(W->dvb); free(W->pairs); free(W->raw); free(W->count); free(W->rows);
}

/* The units of KV head kvh, their tiles: work item w -> (unit, first query block) */
static int units_of(const sparse_t *J, int kvh, int *units) {
    int n = 0;
    for (int e = 0; e < J->He; e++)
        if (J->kv[e] == kvh) units[n++] = e;
    return n;
}

int mh_sparse_backward(const sparse_t *J, int threads) {
    const long tiles = tiles_per_unit(J), nb = tile_blocks(J);
    const int nQ = (int)((J->Lq + J->qbs - 1) / J->qbs), pairs = J->B * J->Hkv;
    const long kslice = (long)J->Lk * J->D, vslice = (long)J->Lk * J->Dv;
    int failed = 0;
    int *units = malloc(sizeof(int) * (J->He + 1));
    if (!units) return -1;
    if (threads < 1) threads = 1;
    if (pairs >= threads) { /* each (batch row, KV head) pair to one thread: it alone writes its dk, dv */
#pragma omp parallel num_threads(threads) reduction(| : failed)
        {
            bwd_buf W;
            const int ok = alloc_bwd(J, &W);
            int *mine = malloc(sizeof(int) * (J->He + 1));
#pragma omp for schedule(dynamic, 1)
            for (int p = 0; p < pairs; p++) {
                if (!ok || !mine) { failed = 1; continue; }
                const int b = p / J->Hkv, kvh = p % J->Hkv, nu = units_of(J, kvh, mine);
                for (int u = 0; u < nu; u++)
                    for (long t = 0; t < tiles; t++) {
                        const int n0 = (int)(t * nb), n1 = n0 + nb < nQ ? n0 + (int)nb : nQ;
                        backward_tile(J, b, mine[u], n0, n1, J->dk + p * kslice, J->dv + p * vslice, &W);
                    }
            }
            free(mine);
            free_bwd(&W);
        }
    } else { /* few pairs: the tiles of one pair shared out, each thread summing into its own dk, dv */
        float **parts = calloc(threads, sizeof(float *));
        for (int t = 0; parts && t < threads; t++) parts[t] = calloc(kslice + vslice, sizeof(float));
        for (int p = 0; p < pairs && parts && !failed; p++) {
            const int b = p / J->Hkv, kvh = p % J->Hkv, nu = units_of(J, kvh, units);
            const long work = nu * tiles;
#pragma omp parallel num_threads(threads) reduction(| : failed)
            {
                int me = 0;
#ifdef _OPENMP
                me = omp_get_thread_num();
#endif
                float *part = parts[me];
                bwd_buf W;
                const int ok = alloc_bwd(J, &W) && part;
                if (part) memset(part, 0, sizeof(float) * (kslice + vslice));
#pragma omp for schedule(dynamic, 1)
                for (long w = 0; w < work; w++) {
                    const long t = tiles - 1 - w % tiles;
                    const int n0 = (int)(t * nb), n1 = n0 + nb < nQ ? n0 + (int)nb : nQ;
                    if (ok)
                        backward_tile(J, b, units[w / tiles], n0, n1, part, part + kslice, &W);
                    else
                        failed = 1;
                }
                free_bwd(&W);
                float *dk = J->dk + p * kslice, *dv = J->dv + p * vslice;
#pragma omp for schedule(static)
                for (long i = 0; i < kslice + vslice; i++) {
                    float s = 0.f;
                    for (int u = 0; u < threads; u++) s += parts[u] ? parts[u][i] : 0.f;
                    if (i < kslice) dk[i] += s; else dv[i - kslice] += s;
                }
            }
        }
        for (int t = 0; parts && t < threads; t++) free(parts[t]);
        if (!parts) failed = 1;
        free(parts);
    }
    free(units);
    return failed ? -1 : 0;
}

/* sizeof(sparse_t), which cpu_sparse.py compares with its ctypes mirror before any call */
long mh_sparse_size(void) { return (long)sizeof(sparse_t); }
