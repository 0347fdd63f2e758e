/* The tile (AMX) path of cpu_decode.c: bf16, int8 or fp8 keys and values read by many query rows per
 * KV head (MLA's 16 heads over its one latent head; MQA), where the FMA path is bound by arithmetic.
 * 8-bit slots are converted to bf16 as they are read (exactly: int8 codes and e4m3 values are bf16
 * values), their scales applied as on the FMA path: kc folded into the query per span of slots
 * (three bf16 terms), kt on each slot's score, vt on each slot's weight.
 *
 * Included by cpu_decode.c after its job_t, rows_of and prefetch_row; compiled only where the build
 * has AMX-BF16 and AVX512-BF16 (-march=native on a CPU that has them) and used only where Linux
 * grants the process the tile state (arch_prctl). Per chunk of AMX_TC slots of one (b, h) piece:
 *
 *   Sᵀ (slots x 16 rows) = K_chunk · Q_gᵀ   tdpbf16ps: the cache's rows as stored (16 slots x 32
 *                                            features a tile), the query rows in pairs (VNNI) once
 *   online softmax in fp32, 16 rows to a vector (one lane a row): max, exp, sum, rescale
 *   O (16 rows x Dv) += P · V_chunk           tdpbf16ps: P transposed to rows x slots, split into
 *                                            three bf16 terms (p = h + m + l; two for a
 *                                            half-precision call), V interleaved two slots to a
 *                                            pair (VNNI) on the fly
 *
 * The products of bf16 values are exact in fp32 and accumulated in fp32; the scale is applied to the
 * fp32 scores, not to the query (a query that is not bf16 is three bf16 terms); the weights are
 * three bf16 terms (24 bits, fp32's precision): the error is fp32's, as on the FMA path. A call whose
 * query is bf16 or fp16 (job_t.half: its output is rounded to 8 or 11 bits) carries the weights in
 * two terms (16 bits: each within 2^-16 of itself, the output within 2^-16 of the largest |value|,
 * 2^8 below a bf16 output's rounding), a third fewer products in P V (A/B of builds in one process,
 * MLA's shape at 32k: 1.92-2.25 against 2.29-2.50 ms, with the prefetch below). The tiles
 * treat bf16 subnormals (below 1.2e-38) as zero. A row mask is taken only as bands, one range of
 * slots per row (causal multi-token steps, windows; job_t.band), and only where every slot read is
 * seen by some row: a slot one row sees and another does not gives the other 0 · v (NaN for a NaN
 * value, as on the fused kernels), where the FMA path leaves it out. Other masks run the FMA path.
 */
#if defined(HAVE_AMX_TILES) && defined(__AVX512BF16__) && defined(__AMX_BF16__)
#define HAVE_AMX 1

#define AMX_MIN_ROWS 8 /* bf16: query rows per KV head from which the tiles beat the FMAs (measured: 4 rows 0.71-0.76x, 8 rows 1.18x, 16 rows 2.1x) */
#define AMX_MIN_ROWS_8BIT 16 /* int8 / fp8, whose rows are converted first and whose q · kc is three terms (8 rows 0.83x, 16 rows 1.64x) */
#define AMX_TC 64      /* slots per chunk: 4 groups of 16 for Sᵀ, 2 blocks of 32 for P V */
#define AMX_TB (AMX_TC / 32) /* blocks of 32 slots per chunk */

/* whether a call of this storage kind, query rows per KV head, head sizes and mask runs on the tiles
 * (masked: a row mask that is not a band of slots per row, see job_t.band) */
static int amx_takes(int kind, int rows, int D, int Dv, int masked) {
    const int enough = kind == 1 ? rows >= AMX_MIN_ROWS : (kind == 3 || kind == 4) && rows >= AMX_MIN_ROWS_8BIT;
    return enough && !masked && D % 32 == 0 && Dv % 32 == 0 && amx_granted();
}

static inline __m512 vexp512(__m512 x) { return (__m512)vexp((v16f)x); }

/* Slots [32·kb, 32·kb + 32) of P (slot-major, a row to a lane) as ``terms`` A tiles of P V: rows x 32
 * slots in bf16, each term the rest of the ones before rounded to bf16: p = h + m + l to fp32's
 * precision (three terms), or p = h + m to 16 bits (two terms: within 2^-16 of p) */
static inline __m512 bf16_near(__m512 p) { /* p rounded to bf16, as fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p)), 16));
}

static inline void amx_weights(const float *P, uint16_t *tiles, int terms) {
    __m512 x0[16], x1[16];
    for (int i = 0; i < 16; i++) x0[i] = _mm512_loadu_ps(P + 16 * i), x1[i] = _mm512_loadu_ps(P + 16 * (16 + i));
    transpose16(x0), transpose16(x1); /* x0[r], x1[r]: row r's slots 0..15, 16..31 */
    for (int term = 0; term < terms; term++)
        for (int r = 0; r < 16; r++) {
            const __m512 t0 = bf16_near(x0[r]), t1 = bf16_near(x1[r]);
            _mm512_storeu_si512(tiles + 512 * term + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(t1, t0));
            x0[r] = _mm512_sub_ps(x0[r], t0), x1[r] = _mm512_sub_ps(x1[r], t1);
        }
}

/* 32 stored values from p as 32 bf16, exactly (int8 codes and fp8 e4m3 values are all bf16 values) */
static inline __m512i load32_as_bf16(const char *p, int kind) {
    if (kind == 1) return _mm512_loadu_si512(p);
    __m512 lo, hi;
    if (kind == 3) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)p);
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    } else {
        lo = (__m512)load_f8((const uint8_t *)p), hi = (__m512)load_f8((const uint8_t *)p + 16);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* Features [32·e, 32·e + 32) of the chunk's values as four B tiles of P V, slots in pairs (VNNI):
 * tiles 2·kb and 2·kb + 1 hold slots [32·kb, 32·kb + 32), row kk the pair 32·kb + 2·kk + (0, 1).
 * The pairs are interleaved by unpacklo/unpackhi, one cheap shuffle per 32 features (a full
 * interleave costs three times as many), which leaves the features in the order of their 128-bit
 * lanes: column 4·L + i of tile 2·kb + h is feature 32·e + 8·L + 4·h + i (L < 4, i < 4, h < 2). P V
 * carries this order into O's columns; the last loop of one_bf16_amx puts it back. 0 past cnt. */
static inline void amx_values(const char *const *vrows, int cnt, int blocks, int e, uint16_t *tiles, int kind) {
    const int es = kind == 1 ? 2 : 1; /* bytes per stored value */
    for (int kb = 0; kb < blocks; kb++) {
        uint16_t *t0 = tiles + 1024 * kb, *t1 = t0 + 512;
        if (32 * kb + 32 <= cnt) { /* a full block */
            for (int kk = 0; kk < 16; kk++) {
                const __m512i a = load32_as_bf16(vrows[32 * kb + 2 * kk] + 32 * e * es, kind);
                const __m512i c = load32_as_bf16(vrows[32 * kb + 2 * kk + 1] + 32 * e * es, kind);
                _mm512_store_si512(t0 + 32 * kk, _mm512_unpacklo_epi16(a, c));
                _mm512_store_si512(t1 + 32 * kk, _mm512_unpackhi_epi16(a, c));
            }
            continue;
        }
        for (int kk = 0; kk < 16; kk++) {
            const int ta = 32 * kb + 2 * kk, tb = ta + 1;
            const __m512i a = ta < cnt ? load32_as_bf16(vrows[ta] + 32 * e * es, kind) : _mm512_setzero_si512();
            const __m512i c = tb < cnt ? load32_as_bf16(vrows[tb] + 32 * e * es, kind) : _mm512_setzero_si512();
            _mm512_store_si512(t0 + 32 * kk, _mm512_unpacklo_epi16(a, c));
            _mm512_store_si512(t1 + 32 * kk, _mm512_unpackhi_epi16(a, c));
        }
    }
}

/* q' = q (kc_at < 0) or q · kc[kc_at + c] as the B tiles of Sᵀ = K·q'ᵀ, in ``terms`` bf16 terms (1 when
 * q' holds bf16 values, else 3: q' = h + m + l to fp32's precision): tile (term, g, ks) row kk,
 * column 2·j + i = that term of q'[16g + j, 32·ks + 2·kk + i], 0 past the R rows. Each 16 rows x 32
 * features of a term is 16 x 16 pairs of bf16, transposed as 32-bit lanes (built once per piece of
 * a call: element by element it cost ~23 us a piece for a bf16 query, ~100 us for an fp32 one). */
static void amx_query_tiles(uint16_t *QT, const job_t *J, const float *q, int R, int terms, long kc_at) {
    const int D = J->D, RG = (R + 15) / 16, KS = D / 32;
    for (int g = 0; g < RG; g++)
        for (int ks = 0; ks < KS; ks++) {
            __m512 sc0 = _mm512_set1_ps(1.f), sc1 = sc0, x0[16], x1[16];
            if (kc_at >= 0) {
                float s[32];
                for (int c = 0; c < 32; c++) s[c] = load_scale(J->kc, kc_at + 32 * ks + c, J->sdt);
                sc0 = _mm512_loadu_ps(s), sc1 = _mm512_loadu_ps(s + 16);
            }
            for (int j = 0; j < 16; j++) {
                const float *row = q + (long)(16 * g + j) * D + 32 * ks;
                const int in = 16 * g + j < R;
                x0[j] = in ? _mm512_mul_ps(_mm512_loadu_ps(row), sc0) : _mm512_setzero_ps();
                x1[j] = in ? _mm512_mul_ps(_mm512_loadu_ps(row + 16), sc1) : _mm512_setzero_ps();
            }
            for (int term = 0; term < terms; term++) {
                __m512 w[16];
                for (int j = 0; j < 16; j++) { /* row j's 32 features of this term, in order: lane kk = pair kk */
                    const __m512 h0 = bf16_near(x0[j]), h1 = bf16_near(x1[j]);
                    w[j] = (__m512)_mm512_cvtne2ps_pbh(h1, h0);
                    x0[j] = _mm512_sub_ps(x0[j], h0), x1[j] = _mm512_sub_ps(x1[j], h1); /* what the next term holds */
                }
                transpose16(w); /* w[kk] lane j: row j's pair kk */
                uint16_t *tile = QT + (((size_t)term * RG + g) * KS + ks) * 512;
                for (int kk = 0; kk < 16; kk++) _mm512_storeu_ps((float *)(tile + 32 * kk), w[kk]);
            }
        }
}


static inline void amx_core(const job_t *J, int bh, float *s_fma, float *qs_fma, const int kind) {
    const int es = kind == 1 ? 2 : 1, quant = kind != 1; /* bytes per stored value; 8-bit with scales */
    const int b = bh / J->H, h = bh % J->H, R = J->G * J->Lq, D = J->D, Dv = J->Dv;
    const int RG = (R + 15) / 16, KS = D / 32, DB = Dv / 16;
    const long n = J->n, lo = J->lo, ps = J->ps;
    const char *K = (const char *)J->K + h * J->k_h * es, *V = (const char *)J->V + h * J->v_h * es;
    const long kpb = J->k_page * es, ktb = J->k_t * es, vpb = J->v_page * es, vtb = J->v_t * es;
    const int64_t *table = J->table + b * J->width;
    const float *q = J->q + (long)bh * R * D;
    const __m512 scale = _mm512_set1_ps(J->scale);
    float *out = J->out + (long)bh * R * Dv, *lse = J->lse + (long)bh * R;
    /* one block of 64-byte aligned buffers: Qᵀ tiles, Sᵀ/P per row group, P tiles, V tiles, O,
     * staged key rows, the softmax state */
    const int wterms = J->half ? 2 : 3; /* the weights' bf16 terms (amx_weights) */
    const size_t n_qt = (size_t)3 * RG * KS * 512, n_pt = (size_t)RG * AMX_TB * 1536, n_vt = (size_t)AMX_TB * 2048; /* u16 */
    const size_t n_st = (size_t)RG * AMX_TC * 16, n_o = (size_t)RG * 16 * Dv, n_k = (size_t)2 * 16 * D; /* f32, u16 */
#ifdef HAVE_AMX8
    /* int8 slots with head sizes a multiple of 64: the scores on the int8 tiles (cpu_decode_amx8.h),
     * the codes as stored, q · kc in three int8 terms per row group; else (and for a span whose
     * q · kc is not finite) the codes converted to bf16 and q · kc in three bf16 terms */
    const int int8_qk = kind == 3 && D % 64 == 0;
#else
    const int int8_qk = 0;
#endif
    const size_t n_t8 = int8_qk ? (size_t)RG * 3 * D * 16 + (size_t)16 * D * 4 + (size_t)RG * 48 * 4 : 0; /* bytes */
    const size_t bytes = 2 * (n_qt + n_pt + n_vt + n_k) + 4 * (n_st + n_o) + 4 * 3 * 16 * (size_t)RG + n_t8 + 64 * 9;
    char *block = (char *)aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (!block) { /* the FMA path needs no more than the buffers it was given */
        (kind == 1 ? one_bf16 : kind == 3 ? one_i8 : one_f8)(J, bh, s_fma, qs_fma);
        return;
    }
    char *at = block;
    uint16_t *QT = (uint16_t *)at; at += (2 * n_qt + 63) & ~(size_t)63;
    uint16_t *PT = (uint16_t *)at; at += (2 * n_pt + 63) & ~(size_t)63;
    uint16_t *VT = (uint16_t *)at; at += (2 * n_vt + 63) & ~(size_t)63;
    uint16_t *KR = (uint16_t *)at; at += (2 * n_k + 63) & ~(size_t)63;
    float *ST = (float *)at; at += (4 * n_st + 63) & ~(size_t)63;
    float *O = (float *)at; at += (4 * n_o + 63) & ~(size_t)63;
    float *Mx = (float *)at, *Sum = Mx + 16 * RG, *Nan = Sum + 16 * RG;
    at += (4 * 3 * 16 * (size_t)RG + 63) & ~(size_t)63;
    int8_t *T8 = (int8_t *)at; /* int8_qk: per row group, the three terms' tiles, then their scales */
    float *Q8 = (float *)(at + (size_t)RG * 3 * D * 16), *S8 = Q8 + (size_t)16 * D;
    int int8_on = 0; /* this span's q · kc is finite: its scores on the int8 tiles */
    (void)T8, (void)Q8, (void)S8;
    /* the query's tiles (amx_query_tiles): one term where q holds bf16 values (a bf16 call), three
     * otherwise and for 8-bit slots, whose q · kc is built again when a chunk starts a new span */
    int terms = quant ? 3 : 1;
    for (long i = 0; i < (long)R * D && terms == 1; i++) {
        uint32_t u;
        memcpy(&u, q + i, 4);
        if (u & 0xFFFF) terms = 3;
    }
    long span_now = -1;
    for (int i = 0; i < 16 * RG; i++) Mx[i] = -INFINITY, Sum[i] = 0.f, Nan[i] = 0.f;
    memset(O, 0, 4 * n_o);
    const char *krows[2 * AMX_TC], *vrows[AMX_TC];
    amx_configure();
    for (long t0 = 0, cnt; t0 < n; t0 += cnt) {
        cnt = n - t0 < AMX_TC ? n - t0 : AMX_TC;
        {
            long j = 0; /* 8-bit: chunks end at span boundaries (one row of channel scales each) */
            if (quant) {
                const long qi = J->first + t0, end = (qi / J->span + 1) * J->span - qi;
                j = qi / J->span;
                cnt = cnt < end ? cnt : end;
            }
            if (j != span_now) { /* this span's q' = q · kc[j] (8-bit), or q once */
                span_now = j;
                const long kc_at = quant ? b * J->kc_b + h * J->kc_h + j * J->kc_j : -1;
                int8_on = 0;
#ifdef HAVE_AMX8
                if (int8_qk) {
                    int8_on = 1;
                    for (int g = 0; g < RG && int8_on; g++) {
                        const int rows_g = R - 16 * g < 16 ? R - 16 * g : 16;
                        for (int r = 0; r < rows_g; r++)
                            for (int c = 0; c < D; c++)
                                Q8[(size_t)r * D + c] = q[(size_t)(16 * g + r) * D + c] * load_scale(J->kc, kc_at + c, J->sdt);
                        int8_on = amx8_query(T8 + (size_t)g * 3 * D * 16, S8 + 48 * g, Q8, rows_g, D, 1);
                    }
                }
#endif
                if (!int8_on) amx_query_tiles(QT, J, q, R, terms, kc_at);
            }
        }
        const long ahead = n - t0 < 2 * AMX_TC ? n - t0 : 2 * AMX_TC; /* this chunk and the next's rows */
        rows_of(krows, ahead, K, table, ps, kpb, ktb, lo + t0);
        rows_of(vrows, cnt, V, table, ps, vpb, vtb, lo + t0);
        /* the next chunk's rows prefetched only where they do not follow these in memory (pages): the
         * hardware prefetcher streams evenly spaced rows, and prefetches on top of it cost (measured);
         * a group ahead into L1 as the groups go, or (whole chunks) a chunk ahead into L2 */
        const int jumps = krows[ahead - 1] != krows[0] + (ahead - 1) * ktb;
        /* Sᵀ. A whole bf16 chunk of evenly spaced rows: its four groups of 16 slots accumulate in tmm0..3
         * side by side, so that each query tile is loaded once a chunk, not once a group (A/B of builds
         * in one process: measured: docs/inference.md#tile-path). Else a group at a time, rows as stored
         * where evenly spaced, else staged. */
        int whole = cnt == AMX_TC && kind == 1;
        for (int i = 1; i < cnt && whole; i++) whole = krows[i] == krows[0] + i * ktb;
        for (int g = 0; g < RG && whole; g++) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int ks = 0; ks < KS; ks++) {
                for (int i = AMX_TC; i < ahead && jumps && g == 0; i++) _mm_prefetch(krows[i] + 64 * ks, _MM_HINT_T1);
                for (int term = 0; term < terms; term++) {
                    const char *k = krows[0] + 64 * ks;
                    _tile_loadd(4, QT + (((size_t)term * RG + g) * KS + ks) * 512, 64);
                    _tile_loadd(5, k, ktb);
                    _tile_dpbf16ps(0, 5, 4);
                    _tile_loadd(6, k + 16 * ktb, ktb);
                    _tile_dpbf16ps(1, 6, 4);
                    _tile_loadd(7, k + 32 * ktb, ktb);
                    _tile_dpbf16ps(2, 7, 4);
                    _tile_loadd(5, k + 48 * ktb, ktb);
                    _tile_dpbf16ps(3, 5, 4);
                }
            }
            float *st = ST + (size_t)g * AMX_TC * 16;
            _tile_stored(0, st, 64);
            _tile_stored(1, st + 256, 64);
            _tile_stored(2, st + 512, 64);
            _tile_stored(3, st + 768, 64);
        }
        for (int g16 = 0; 16 * g16 < cnt && !whole; g16++) {
            const int first = 16 * g16, rows_in = cnt - first < 16 ? cnt - first : 16;
            for (int i = 0; i < 16 && jumps; i++)
                if (AMX_TC + first + i < ahead) prefetch_row(krows[AMX_TC + first + i], es * D);
            int even = rows_in == 16 && (kind == 1 || int8_on); /* other 8-bit rows are converted to bf16 first */
            for (int i = 1; i < rows_in && even; i++) even = krows[first + i] == krows[first] + i * ktb;
            const char *base = krows[first];
            long stride = ktb;
#ifdef HAVE_AMX8
            if (int8_on) { /* the codes as stored (rows a page breaks staged as they are), three C tiles */
                if (!even) {
                    int8_t *st = (int8_t *)KR;
                    for (int i = 0; i < 16; i++) {
                        if (i >= rows_in)
                            memset(st + (size_t)i * D, 0, (size_t)D);
                        else
                            memcpy(st + (size_t)i * D, krows[first + i], (size_t)D);
                    }
                    base = (const char *)st, stride = D;
                }
                for (int g = 0; g < RG; g++) {
                    float *dst = ST + ((size_t)g * AMX_TC + first) * 16;
                    amx8_scores_slot_major((const int8_t *)base, stride, D, T8 + (size_t)g * 3 * D * 16, S8 + 48 * g, dst);
                }
                continue;
            }
#endif
            if (!even) {
                uint16_t *st = KR + (size_t)(g16 & 1) * 16 * D;
                for (int i = 0; i < 16; i++) {
                    if (i >= rows_in)
                        memset(st + (size_t)i * D, 0, 2 * (size_t)D);
                    else if (kind == 1)
                        memcpy(st + (size_t)i * D, krows[first + i], 2 * (size_t)D);
                    else
                        for (int c = 0; c < D; c += 32)
                            _mm512_storeu_si512(st + (size_t)i * D + c, load32_as_bf16(krows[first + i] + c, kind));
                }
                base = (const char *)st, stride = 2L * D;
            }
            for (int g = 0; g < RG; g++) {
                _tile_zero(0);
                for (int ks = 0; ks < KS; ks++) {
                    _tile_loadd(2, base + 64 * ks, stride);
                    for (int term = 0; term < terms; term++) {
                        _tile_loadd(4, QT + (((size_t)term * RG + g) * KS + ks) * 512, 64);
                        _tile_dpbf16ps(0, 2, 4);
                    }
                }
                _tile_stored(0, ST + ((size_t)g * AMX_TC + first) * 16, 64);
            }
        }
        const int blocks = (cnt + 31) / 32;
        for (int g = 0; g < RG; g++) {
            /* online softmax of the chunk, lanes = the group's 16 rows */
            float *P = ST + (size_t)g * AMX_TC * 16;
            __m512 m = _mm512_loadu_ps(Mx + 16 * g), chunk_max = _mm512_set1_ps(-INFINITY);
            __mmask16 nan = (__mmask16)_mm512_cmpneq_ps_mask(_mm512_loadu_ps(Nan + 16 * g), _mm512_setzero_ps());
            __m512i first = _mm512_setzero_si512(), end = _mm512_set1_epi32(0x7FFFFFFF);
            if (J->band) { /* rows past R: an empty band */
                int32_t f16[16], e16[16];
                for (int j = 0; j < 16; j++) {
                    const int r = 16 * g + j;
                    f16[j] = r < R ? J->band[2 * r] : 0, e16[j] = r < R ? J->band[2 * r + 1] : 0;
                }
                first = _mm512_loadu_si512(f16), end = _mm512_loadu_si512(e16);
            }
            const long at = J->band_at + t0; /* slot t of this chunk is the call's slot at + t */
            const long kt0 = quant ? b * J->kt_b + h * J->kt_h + J->first + t0 : 0;
            const long vt0 = quant ? b * J->vt_b + h * J->vt_h + J->first + t0 : 0;
            for (int t = 0; t < cnt; t++) {
                __m512 x = _mm512_mul_ps(_mm512_load_ps(P + 16 * t), scale);
                if (quant) x = _mm512_mul_ps(x, _mm512_set1_ps(load_scale(J->kt, kt0 + t, J->sdt)));
                if (J->band) { /* -inf outside each row's band (a NaN score there too, as masked_fill) */
                    const __m512i slot = _mm512_set1_epi32((int)(at + t));
                    const __mmask16 outside = _mm512_cmp_epi32_mask(slot, first, _MM_CMPINT_LT) |
                                          _mm512_cmp_epi32_mask(slot, end, _MM_CMPINT_NLT);
                    x = _mm512_mask_mov_ps(x, outside, _mm512_set1_ps(-INFINITY));
                }
                _mm512_store_ps(P + 16 * t, x);
                nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
                chunk_max = _mm512_max_ps(x, chunk_max); /* a NaN x leaves chunk_max as it was */
            }
            const __m512 m_new = _mm512_max_ps(m, chunk_max);
            const __m512 m_safe = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                                     _mm512_setzero_ps());
            const __m512 alpha = vexp512(_mm512_sub_ps(m, m_safe)); /* 0 where m was -inf */
            __m512 total = _mm512_setzero_ps();
            for (int t = 0; t < cnt; t++) {
                const __m512 p = vexp512(_mm512_sub_ps(_mm512_load_ps(P + 16 * t), m_safe));
                total = _mm512_add_ps(total, p);
                /* 8-bit: the weights times the slot's value scale (v = V8 · vt); 0 stays 0 (a NaN scale
                 * of a slot no row sees stays out) */
                _mm512_store_ps(P + 16 * t, quant ? _mm512_maskz_mul_ps(_mm512_cmpneq_ps_mask(p, _mm512_setzero_ps()), p,
                                                                        _mm512_set1_ps(load_scale(J->vt, vt0 + t, J->sdt)))
                                                  : p);
            }
            for (int t = cnt; t < 32 * blocks; t++) _mm512_store_ps(P + 16 * t, _mm512_setzero_ps());
            _mm512_storeu_ps(Sum + 16 * g, _mm512_fmadd_ps(_mm512_loadu_ps(Sum + 16 * g), alpha, total));
            _mm512_storeu_ps(Mx + 16 * g, m_new);
            _mm512_storeu_ps(Nan + 16 * g, _mm512_maskz_mov_ps(nan, _mm512_set1_ps(1.f)));
            float *Og = O + (size_t)g * 16 * Dv;
            if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ)) { /* the rows whose max moved */
                float al[16];
                _mm512_storeu_ps(al, alpha);
                for (int r = 0; r < 16; r++)
                    if (al[r] != 1.f)
                        for (int c = 0; c < Dv; c += 16)
                            _mm512_store_ps(Og + (size_t)r * Dv + c, _mm512_mul_ps(_mm512_load_ps(Og + (size_t)r * Dv + c),
                                                                                   _mm512_set1_ps(al[r])));
            }
            uint16_t *Pt = PT + (size_t)g * AMX_TB * 1536; /* P's terms for each block of 32 slots */
            for (int kb = 0; kb < blocks; kb++) amx_weights(P + 32 * 16 * kb, Pt + 1536 * kb, wterms);
        }
        /* P V on the tiles, 32 features of V at a time (amx_values), the tiles of the next 32 built while
         * these are multiplied (a tile load right after the stores that wrote it would wait for them).
         * The two 16-feature halves accumulate in tmm0 and tmm1 in turn; P's terms of a block in
         * tmm2..tmm4 (tmm2, tmm3 for two), V's two halves in tmm6, tmm7. */
        /* The memory is idle while P V runs on data in the caches: the first half of the next chunk's key
         * rows is fetched into L2 in steps over the loop, the hardware prefetcher streams the rest once
         * the scores read them. Measured against no prefetch (A/B of builds in one process, MLA's
         * shape at 32k, an fp32 query): 2.02-2.04 against 2.24-2.35 ms; the whole chunk, a quarter,
         * or into L1 (T0) gained less or lost. */
        const int row_lines = es * D / 64, pf_lines = jumps ? 0 : (int)(ahead - cnt) * row_lines / 2; /* pages: prefetched above */
        const int pf_step = (pf_lines + DB / 2 - 1) / (DB / 2);
        int pf_row = 0, pf_line = 0; /* the next line to prefetch: row, line in it */
        /* one row group whose weights are two terms in two blocks: their four tiles stay in tmm2..5 for
         * the whole loop (else loaded for every 32 features: measured: docs/inference.md#tile-path) */
        const int resident = RG == 1 && wterms == 2 && blocks == 2;
        if (resident) {
            _tile_loadd(2, PT, 64);
            _tile_loadd(3, PT + 512, 64);
            _tile_loadd(4, PT + 1536, 64);
            _tile_loadd(5, PT + 2048, 64);
        }
        amx_values(vrows, cnt, blocks, 0, VT, kind);
        for (int e = 0; e < DB / 2; e++) {
            const uint16_t *vt = VT + (size_t)(e & 1) * AMX_TB * 1024;
            if (e + 1 < DB / 2) amx_values(vrows, cnt, blocks, e + 1, VT + (size_t)((e + 1) & 1) * AMX_TB * 1024, kind);
            for (int i = e * pf_step; i < (e + 1) * pf_step && i < pf_lines; i++) { /* the next chunk's first rows */
                _mm_prefetch(krows[cnt + pf_row] + 64 * pf_line, _MM_HINT_T1);
                if (++pf_line == row_lines) pf_line = 0, pf_row++; /* (no division in the loop) */
            }
            if (resident) {
                float *Og = O + 32 * e;
                _tile_loadd(0, Og, 4L * Dv);
                _tile_loadd(1, Og + 16, 4L * Dv);
                for (int kb = 0; kb < 2; kb++) {
                    _tile_loadd(6, vt + 1024 * kb, 64);
                    _tile_loadd(7, vt + 1024 * kb + 512, 64);
                    if (kb == 0) {
                        _tile_dpbf16ps(0, 2, 6);
                        _tile_dpbf16ps(1, 2, 7);
                        _tile_dpbf16ps(0, 3, 6);
                        _tile_dpbf16ps(1, 3, 7);
                    } else {
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(0, 5, 6);
                        _tile_dpbf16ps(1, 5, 7);
                    }
                }
                _tile_stored(0, Og, 4L * Dv);
                _tile_stored(1, Og + 16, 4L * Dv);
            }
            for (int g = 0; g < RG && !resident; g++) {
                float *Og = O + (size_t)g * 16 * Dv + 32 * e;
                _tile_loadd(0, Og, 4L * Dv);
                _tile_loadd(1, Og + 16, 4L * Dv);
                for (int kb = 0; kb < blocks; kb++) {
                    const uint16_t *Pt = PT + (size_t)g * AMX_TB * 1536 + 1536 * kb;
                    _tile_loadd(2, Pt, 64);
                    _tile_loadd(3, Pt + 512, 64);
                    if (wterms == 3) _tile_loadd(4, Pt + 1024, 64);
                    _tile_loadd(6, vt + 1024 * kb, 64);
                    _tile_loadd(7, vt + 1024 * kb + 512, 64);
                    _tile_dpbf16ps(0, 2, 6);
                    _tile_dpbf16ps(1, 2, 7);
                    _tile_dpbf16ps(0, 3, 6);
                    _tile_dpbf16ps(1, 3, 7);
                    if (wterms == 3) {
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                }
                _tile_stored(0, Og, 4L * Dv);
                _tile_stored(1, Og + 16, 4L * Dv);
            }
        }
    }
    _tile_release();
    for (int r = 0; r < R; r++) {
        const float *o = O + (size_t)r * Dv;
        float *dst = out + (long)r * Dv;
        /* O's columns in amx_values' order: column 32·e + 16·h + 4·L + i is feature 32·e + 8·L + 4·h + i */
        if (Nan[r] != 0.f || Mx[r] == -INFINITY) { /* a NaN score; or no slot (a score of -inf everywhere) */
            const float fill = Nan[r] != 0.f ? NAN : 0.f;
            for (int c = 0; c < Dv; c++) dst[c] = fill;
            lse[r] = Nan[r] != 0.f ? NAN : -INFINITY;
            continue;
        }
        const float norm = 1.f / Sum[r];
        for (int e = 0; e < Dv; e += 32)
            for (int h = 0; h < 2; h++)
                for (int L = 0; L < 4; L++)
                    for (int i = 0; i < 4; i++) dst[e + 8 * L + 4 * h + i] = o[e + 16 * h + 4 * L + i] * norm;
        lse[r] = Mx[r] + logf(Sum[r]);
    }
    free(block);
}

static void one_amx_bf16(const job_t *J, int bh, float *s, float *qs) { amx_core(J, bh, s, qs, 1); }
static void one_amx_i8(const job_t *J, int bh, float *s, float *qs) { amx_core(J, bh, s, qs, 3); }
static void one_amx_f8(const job_t *J, int bh, float *s, float *qs) { amx_core(J, bh, s, qs, 4); }
#endif
