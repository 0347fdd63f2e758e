/* int8 scores on the AMX tiles for a few query rows (cpu_decode.c's FMA kernel, int8 slots, R <= 4
 * rows per KV head: GQA's 32 query heads over 8 KV heads, one token). There the FMA path converts
 * every int8 key to fp32 (two instructions per 16 features) and multiplies it with each row: the
 * step is bound by that arithmetic, not by reading the slots. Here the slots' codes are multiplied
 * as stored, 16 slots by 64 features a tile, by tdpbssd (int8 x int8, exact int32 sums):
 *
 *   q' = q · scale · kc[span]      (fp32, as the FMA path folds it) = s0·t0 + s1·t1 + s2·t2
 *        three int8 terms per row: t0 = rint(q' / s0), s0 = max|q'| / 127, each next term the
 *        remainder at a scale 254 times finer (the remainder of a rint is at most half a step):
 *        |q' - Σ s·t| <= max|q'| / (2 · 127 · 254²) = 2^-24 · max|q'|, fp32's precision
 *   C (16 slots x 16 columns) = K_codes (16 x D) · Tᵀ   column t·4 + r: term t of row r, exact in int32
 *   s[r, slot] = (s0·C[t0] + s1·C[t1] + s2·C[t2]) · kt[slot]
 *
 * so the error is fp32's, as on the FMA path. Where q' holds a non-finite value (an infinite query,
 * a NaN scale) the FMA path takes the span; a run of 16 slots that a page breaks, the FMA path
 * takes that run. The softmax and P V stay the FMA path's. Compiled where the build has AMX-INT8
 * (cpu_amx.h), used where the OS grants the tiles; -DMH_NO_AMX builds without it. */
#if defined(HAVE_AMX_TILES) && defined(__AMX_INT8__)
#define HAVE_AMX8 1
#define AMX8_MAX_ROWS 4   /* three terms of four rows: 12 of a tile's 16 columns; P V on the tiles too */
#define AMX8_WIDE_ROWS 16 /* 5..16 rows: one C tile per term (amx8_scores16_wide), P V on the FMA path */
#define AMX8_MAX_D 256    /* the query's tiles stay in tmm2..tmm5 (four rows), 12 KiB of terms (wide) */

/* whether an int8 call of `rows` query rows per KV head and keys of D features takes the score tiles */
static int amx8_takes(int kind, int rows, int D) {
    return kind == 3 && rows <= AMX8_WIDE_ROWS && D % 64 == 0 && D <= AMX8_MAX_D && amx_granted();
}

/* q' (R rows of D, fp32) as three int8 terms a row, packed as tdpbssd's B operand, 1 KiB tiles of 64
 * features. Up to four rows (wide = 0): one tile per 64 features, T[c][k4][col][i] = term[col][64c +
 * 4·k4 + i], col = t·4 + r, sc[col] its scale. 5..16 rows (wide = 1): one group of tiles per term,
 * the rows as columns, T[t][c][k4][r][i], sc[16·t + r]. Unused columns 0, their scales 0. Returns 0
 * where q' holds a non-finite value. */
static int amx8_query(int8_t *T, float *sc, const float *qs, int R, int D, int wide) {
    const int CS = D / 64;
    const size_t term_at = wide ? (size_t)CS * 1024 : 16; /* bytes from one term to the next */
    const int scale_at = wide ? 16 : 4;
    memset(T, 0, (size_t)(wide ? 3 : 1) * CS * 1024);
    memset(sc, 0, sizeof(float) * 3 * scale_at);
    for (int r = 0; r < R; r++) {
        float m = 0.f;
        for (int c = 0; c < D; c++) {
            const float x = qs[(long)r * D + c];
            if (!isfinite(x)) return 0;
            m = fabsf(x) > m ? fabsf(x) : m;
        }
        if (m == 0.f) continue; /* a zero row: zero terms, zero scales */
        const float s0 = m / 127.f, s1 = s0 / 254.f, s2 = s1 / 254.f;
        sc[r] = s0, sc[scale_at + r] = s1, sc[2 * scale_at + r] = s2;
        for (int c = 0; c < D; c++) {
            float x = qs[(long)r * D + c];
            const float t0 = rintf(x / s0);
            x = fmaf(-t0, s0, x);
            const float t1 = fminf(fmaxf(rintf(x / s1), -127.f), 127.f);
            x = fmaf(-t1, s1, x);
            const float t2 = fminf(fmaxf(rintf(x / s2), -127.f), 127.f);
            int8_t *at = T + (c / 64) * 1024 + ((c % 64) / 4) * 64 + 4 * r + (c % 4);
            at[0] = (int8_t)t0, at[term_at] = (int8_t)t1, at[2 * term_at] = (int8_t)t2;
        }
    }
    return 1;
}

/* The query's tiles into tmm2.. (one per 64 features), before a block of slots (another tile path
 * may have run on this thread since the span's tiles were built) */
static inline void amx8_load_query(const int8_t *T, int D) {
    _tile_loadd(2, T, 64);
    if (D > 64) _tile_loadd(3, T + 1024, 64);
    if (D > 128) _tile_loadd(4, T + 2048, 64);
    if (D > 192) _tile_loadd(5, T + 3072, 64);
}

/* Scores of 16 slots whose codes lie `stride` bytes apart from k0, for R <= 4 rows: s[r·n + j] for
 * j < 16, times kf[j] (kt) */
static inline void amx8_scores16(const int8_t *k0, long stride, int D, const float *sc, const float *kf, float *s,
                                 long n, int R) {
    int32_t C[16][16] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_loadd(1, k0, stride);
    _tile_dpbssd(0, 1, 2);
    if (D > 64) {
        _tile_loadd(6, k0 + 64, stride);
        _tile_dpbssd(0, 6, 3);
    }
    if (D > 128) {
        _tile_loadd(7, k0 + 128, stride);
        _tile_dpbssd(0, 7, 4);
    }
    if (D > 192) {
        _tile_loadd(1, k0 + 192, stride);
        _tile_dpbssd(0, 1, 5);
    }
    _tile_stored(0, C, 64);
    const __m512 scv = _mm512_loadu_ps(sc);
    for (int j0 = 0; j0 < 16; j0 += 4) {
        __m128 x[4];
        for (int j = 0; j < 4; j++) { /* slot j0 + j: row r's score in lane r */
            const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(C[j0 + j])), scv);
            const __m128 a = _mm512_castps512_ps128(v), b = _mm512_extractf32x4_ps(v, 1), c = _mm512_extractf32x4_ps(v, 2);
            x[j] = _mm_mul_ps(_mm_add_ps(_mm_add_ps(a, b), c), _mm_set1_ps(kf[j0 + j]));
        }
        _MM_TRANSPOSE4_PS(x[0], x[1], x[2], x[3]); /* x[r]: row r over the four slots */
        for (int r = 0; r < R; r++) _mm_storeu_ps(s + (long)r * n + j0, x[r]);
    }
}

/* The products of 16 slots' codes (rows `stride` bytes apart from k0) with the three terms' tiles T
 * (amx8_query's wide layout): C[t][slot][row], one C tile per term (tmm0, tmm3, tmm4) */
static inline void amx8_products(const int8_t *k0, long stride, int D, const int8_t *T, int32_t (*C)[16][16]) {
    const int CS = D / 64;
    _tile_zero(0);
    _tile_zero(3);
    _tile_zero(4);
    for (int c = 0; c < CS; c++) {
        _tile_loadd(1, k0 + 64 * c, stride);
        _tile_loadd(2, T + (size_t)c * 1024, 64);
        _tile_loadd(5, T + (size_t)(CS + c) * 1024, 64);
        _tile_loadd(6, T + (size_t)(2 * CS + c) * 1024, 64);
        _tile_dpbssd(0, 1, 2);
        _tile_dpbssd(3, 1, 5);
        _tile_dpbssd(4, 1, 6);
    }
    _tile_stored(0, C[0], 64);
    _tile_stored(3, C[1], 64);
    _tile_stored(4, C[2], 64);
}

/* slot j's scores, row r in lane r: the three terms at their scales, the small ones first */
static inline __m512 amx8_combine(int32_t (*C)[16][16], const float *sc, int j) {
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sc + 32), _mm512_cvtepi32_ps(_mm512_load_si512(C[2][j])));
    v = _mm512_fmadd_ps(_mm512_loadu_ps(sc + 16), _mm512_cvtepi32_ps(_mm512_load_si512(C[1][j])), v);
    return _mm512_fmadd_ps(_mm512_loadu_ps(sc), _mm512_cvtepi32_ps(_mm512_load_si512(C[0][j])), v);
}

/* Scores of 16 slots for 5..16 rows, times kt, transposed to the rows' order: s[r·n + j] */
static inline void amx8_scores16_wide(const int8_t *k0, long stride, int D, const int8_t *T, const float *sc,
                                      const float *kf, float *s, long n, int R) {
    int32_t C[3][16][16] __attribute__((aligned(64)));
    amx8_products(k0, stride, D, T, C);
    __m512 x[16];
    for (int j = 0; j < 16; j++) x[j] = _mm512_mul_ps(amx8_combine(C, sc, j), _mm512_set1_ps(kf[j]));
    transpose16(x); /* x[r]: row r over the 16 slots */
    for (int r = 0; r < R; r++) _mm512_storeu_ps(s + (long)r * n, x[r]);
}

/* The same products for the bf16 tile path's online softmax (cpu_decode_amx.h, 16+ rows): Sᵀ of 16
 * slots, slot-major, a row to a lane (dst[16·j + r]), without kt or the scale (applied there) */
static inline void amx8_scores_slot_major(const int8_t *k0, long stride, int D, const int8_t *T, const float *sc,
                                          float *dst) {
    int32_t C[3][16][16] __attribute__((aligned(64)));
    amx8_products(k0, stride, D, T, C);
    for (int j = 0; j < 16; j++) _mm512_storeu_ps(dst + 16 * j, amx8_combine(C, sc, j));
}
#endif

#ifdef HAVE_AMX8
/* P V of int8 values for R <= 4 rows on the int8 tiles, the weights w = p · vt (s, R rows of n, the
 * FMA path's softmax) as fixed point at one scale per row for the whole call, four 7-bit digits:
 *
 *   W = rint(w / max_t w · F) = t0·2^21 + t1·2^14 + t2·2^7 + t3   (0 <= t < 128: int8), F = 2^28 - 256
 *       (fp32 cannot hold 2^28 - 1: it rounds to 2^28, whose first digit is 128), W < 2^28 enforced;
 *       W is w to fp32's precision (its product rounds at 2^-24; the digits hold it exactly)
 *   A (16 x 64 slots) = the digits, row d·4 + r;  B (16 x 64 bytes) = 64 slots of V interleaved
 *   four slots to a 32-bit lane (vpunpck), per 16 features;  C (16 x 16) += A · B in int32, exact,
 *   kept for the whole call (n · 127 · 127 < 2^31 for n <= 131072: flushed every AMX8_FLUSH slots)
 *   out[r, f] += Σ_d max w / F · 2^(21 - 7d) · C[d·4 + r, f]
 *
 * Slots go four chunks of TB (256) to a round of tile products, so that each C tile is loaded and
 * stored once per 256 slots. A slot no row sees has w = 0 and an int8 value, so it adds exactly 0
 * (the FMA path leaves it out: the same). Returns 0 (nothing done: the FMA path runs) where a weight
 * is not finite. The interleave puts feature 64h + 16L + 4k + j of block h·4 + k in column 4L + j;
 * the flush puts it back. */
#define AMX8_FLUSH 65536
#define AMX8_MAX_DV 256
#define AMX8_CHUNKS 4 /* chunks of TB slots per round of tile products */
#define AMX8_FULL 268435200.f /* F = 2^28 - 256: the largest weight's fixed point, exact in fp32 */

static inline void amx8_flush(int32_t (*acc)[16][16], int blocks, int R, int Dv, const float *sc, float *out) {
    for (int fb = 0; fb < blocks; fb++) {
        const int h = fb / 4, k = fb % 4;
        for (int r = 0; r < R; r++) {
            __m512 o = _mm512_mul_ps(_mm512_set1_ps(sc[12 + r]), _mm512_cvtepi32_ps(_mm512_load_si512(acc[fb][12 + r])));
            o = _mm512_fmadd_ps(_mm512_set1_ps(sc[8 + r]), _mm512_cvtepi32_ps(_mm512_load_si512(acc[fb][8 + r])), o);
            o = _mm512_fmadd_ps(_mm512_set1_ps(sc[4 + r]), _mm512_cvtepi32_ps(_mm512_load_si512(acc[fb][4 + r])), o);
            o = _mm512_fmadd_ps(_mm512_set1_ps(sc[r]), _mm512_cvtepi32_ps(_mm512_load_si512(acc[fb][r])), o);
            float lanes[16];
            _mm512_storeu_ps(lanes, o);
            for (int L = 0; L < 4; L++) {
                float *at = out + (long)r * Dv + 64 * h + 16 * L + 4 * k;
                _mm_storeu_ps(at, _mm_add_ps(_mm_loadu_ps(at), _mm_loadu_ps(lanes + 4 * L)));
            }
        }
        memset(acc[fb], 0, sizeof acc[fb]);
    }
}

/* A and B of one chunk of cnt <= TB slots at t: the weights' digits, the values interleaved */
static inline void amx8_chunk(int8_t (*A)[64], int8_t (*B)[16][64], const char **rows, long t, long cnt, long got,
                              int R, int halves, int PF, int Dv, const float *s, long n, const float *inv) {
    static const int8_t zero_row[AMX8_MAX_DV] __attribute__((aligned(64)));
    for (long i = cnt; i < TB; i++) rows[i] = (const char *)zero_row; /* past the end: zero values */
    const __m512i seven = _mm512_set1_epi32(127), most = _mm512_set1_epi32((1 << 28) - 1);
    for (int r = 0; r < R; r++) {
        const __m512 scale = _mm512_set1_ps(inv[r]);
        for (int c = 0; c < TB; c += 16) {
            const __mmask16 in = c >= cnt ? 0 : cnt - c >= 16 ? 0xFFFF : (__mmask16)((1u << (cnt - c)) - 1);
            const __m512 w = _mm512_maskz_loadu_ps(in, s + (long)r * n + t + c);
            const __m512i W = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(w, scale)), most);
            _mm512_mask_cvtepi32_storeu_epi8(&A[r][c], 0xFFFF, _mm512_srli_epi32(W, 21));
            _mm512_mask_cvtepi32_storeu_epi8(&A[4 + r][c], 0xFFFF, _mm512_and_si512(_mm512_srli_epi32(W, 14), seven));
            _mm512_mask_cvtepi32_storeu_epi8(&A[8 + r][c], 0xFFFF, _mm512_and_si512(_mm512_srli_epi32(W, 7), seven));
            _mm512_mask_cvtepi32_storeu_epi8(&A[12 + r][c], 0xFFFF, _mm512_and_si512(W, seven));
        }
    }
    for (int g = 0; g < TB / 4; g++) { /* four slots to a lane, per 16 features */
        const char *const *v4 = rows + 4 * g;
        for (int j = 0; j < 4; j++) if (4 * g + j + PF < got) prefetch_row(rows[4 * g + j + PF], Dv);
        for (int hh = 0; hh < halves; hh++) {
            const __m512i v0 = _mm512_loadu_si512(v4[0] + 64 * hh), v1 = _mm512_loadu_si512(v4[1] + 64 * hh);
            const __m512i v2 = _mm512_loadu_si512(v4[2] + 64 * hh), v3 = _mm512_loadu_si512(v4[3] + 64 * hh);
            const __m512i a = _mm512_unpacklo_epi8(v0, v1), b = _mm512_unpackhi_epi8(v0, v1);
            const __m512i c = _mm512_unpacklo_epi8(v2, v3), d = _mm512_unpackhi_epi8(v2, v3);
            _mm512_store_si512(B[4 * hh + 0][g], _mm512_unpacklo_epi16(a, c));
            _mm512_store_si512(B[4 * hh + 1][g], _mm512_unpackhi_epi16(a, c));
            _mm512_store_si512(B[4 * hh + 2][g], _mm512_unpacklo_epi16(b, d));
            _mm512_store_si512(B[4 * hh + 3][g], _mm512_unpackhi_epi16(b, d));
        }
    }
}

static int amx8_values(const char *V, const int64_t *table, long ps, long vpb, long vtb, long lo, long n, int R,
                       int Dv, int PF, const float *s, float *out) {
    float sc[16] = {0}, inv[4] = {0};
    for (int r = 0; r < R; r++) { /* the weights' scale per row; a non-finite weight: the FMA path */
        __m512 m = _mm512_setzero_ps();
        __mmask16 bad = 0;
        long t = 0;
        for (; t + 16 <= n; t += 16) {
            const __m512 w = _mm512_loadu_ps(s + (long)r * n + t);
            bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(w, w), _mm512_setzero_ps(), _CMP_NEQ_UQ); /* inf - inf, NaN */
            m = _mm512_max_ps(m, w);
        }
        float mx = _mm512_reduce_max_ps(m);
        for (; t < n; t++) {
            const float w = s[(long)r * n + t];
            bad |= !isfinite(w);
            mx = w > mx ? w : mx;
        }
        if (bad) return 0;
        if (mx > 0.f) {
            const float unit = mx / AMX8_FULL;
            sc[r] = unit * 2097152.f, sc[4 + r] = unit * 16384.f, sc[8 + r] = unit * 128.f, sc[12 + r] = unit;
            inv[r] = AMX8_FULL / mx;
        }
    }
    const int blocks = Dv / 16, halves = Dv / 64;
    int8_t A[AMX8_CHUNKS][16][64] __attribute__((aligned(64)));
    int8_t B[AMX8_CHUNKS][AMX8_MAX_DV / 16][16][64] __attribute__((aligned(64)));
    int32_t acc[AMX8_MAX_DV / 16][16][16] __attribute__((aligned(64)));
    const char *rows[TB + PF_MAX];
    memset(A, 0, sizeof A);
    memset(acc, 0, sizeof(acc[0]) * blocks);
    for (long t0 = 0; t0 < n; t0 += AMX8_CHUNKS * TB) {
        for (int u = 0; u < AMX8_CHUNKS; u++) {
            const long t = t0 + u * TB;
            if (t >= n) { /* a chunk past the end: zero weights (its B is left as it was: int8, finite) */
                memset(A[u], 0, sizeof A[u]);
                continue;
            }
            const long cnt = n - t < TB ? n - t : TB, got = n - t < cnt + PF ? n - t : cnt + PF;
            rows_of(rows, got, V, table, ps, vpb, vtb, lo + t);
            amx8_chunk(A[u], B[u], rows, t, cnt, got, R, halves, PF, Dv, s, n, inv);
        }
        _tile_loadd(1, A[0], 64);
        _tile_loadd(5, A[1], 64);
        _tile_loadd(6, A[2], 64);
        _tile_loadd(7, A[3], 64);
        for (int fb = 0; fb < blocks; fb++) {
            _tile_loadd(0, acc[fb], 64);
            _tile_loadd(2, B[0][fb], 64);
            _tile_loadd(3, B[1][fb], 64);
            _tile_dpbssd(0, 1, 2);
            _tile_loadd(4, B[2][fb], 64);
            _tile_dpbssd(0, 5, 3);
            _tile_loadd(2, B[3][fb], 64);
            _tile_dpbssd(0, 6, 4);
            _tile_dpbssd(0, 7, 2);
            _tile_stored(0, acc[fb], 64);
        }
        if ((t0 + AMX8_CHUNKS * TB) % AMX8_FLUSH == 0) amx8_flush(acc, blocks, R, Dv, sc, out);
    }
    amx8_flush(acc, blocks, R, Dv, sc, out);
    return 1;
}
#endif
