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
#define AMX8_MAX_ROWS 4 /* three terms of four rows: 12 of the 16 columns */
#define AMX8_MAX_D 256  /* the query's tiles stay in tmm2..tmm5 */

/* whether an int8 call of `rows` query rows per KV head and keys of D features takes the score tiles */
static int amx8_takes(int kind, int rows, int D) {
    return kind == 3 && rows <= AMX8_MAX_ROWS && D % 64 == 0 && D <= AMX8_MAX_D && amx_granted();
}

/* q' (R rows of D, fp32) as three int8 terms a row, packed as tdpbssd's B operand, one 1 KiB tile
 * per 64 features: T[c][k4][col][i] = term[col][64c + 4·k4 + i], col = t·4 + r; sc[col] its scale
 * (0 for unused columns). Returns 0 where q' holds a non-finite value. */
static int amx8_query(int8_t *T, float *sc, const float *qs, int R, int D) {
    memset(T, 0, (size_t)D * 16);
    memset(sc, 0, sizeof(float) * 16);
    for (int r = 0; r < R; r++) {
        float m = 0.f;
        for (int c = 0; c < D; c++) {
            const float x = qs[(long)r * D + c];
            if (!isfinite(x)) return 0;
            m = fabsf(x) > m ? fabsf(x) : m;
        }
        if (m == 0.f) continue; /* a zero row: zero terms, zero scales */
        const float s0 = m / 127.f, s1 = s0 / 254.f, s2 = s1 / 254.f;
        sc[r] = s0, sc[4 + r] = s1, sc[8 + r] = s2;
        for (int c = 0; c < D; c++) {
            float x = qs[(long)r * D + c];
            const float t0 = rintf(x / s0);
            x = fmaf(-t0, s0, x);
            const float t1 = fminf(fmaxf(rintf(x / s1), -127.f), 127.f);
            x = fmaf(-t1, s1, x);
            const float t2 = fminf(fmaxf(rintf(x / s2), -127.f), 127.f);
            int8_t *at = T + (c / 64) * 1024 + ((c % 64) / 4) * 64 + (c % 4);
            at[4 * r] = (int8_t)t0, at[4 * (4 + r)] = (int8_t)t1, at[4 * (8 + r)] = (int8_t)t2;
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
#endif
