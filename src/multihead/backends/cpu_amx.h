/* The AMX tile state shared by the tile paths of cpu_decode.c (cpu_decode_amx.h: bf16 tiles for many
 * query rows; cpu_decode_amx8.h: int8 scores for a few): compiled where the build has AMX tiles and
 * AVX-512 (-march=native on a CPU that has them), unless built with -DMH_NO_AMX; used only where
 * Linux grants the process the tile state. Included by cpu_decode.c before both. */
#if defined(__AVX512F__) && defined(__AMX_TILE__) && !defined(MH_NO_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX_TILES 1

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused */

/* Linux gives a process the tile registers' state only when asked (ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); asked once, from the calling thread, before any parallel region. */
static int amx_granted(void) {
    if (amx_state == 0) amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return amx_state == 1;
}

static void amx_configure(void) { /* eight tiles of 16 rows x 64 bytes */
    amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

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

#endif
