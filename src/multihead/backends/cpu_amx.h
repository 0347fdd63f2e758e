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

#endif
