/* What storing the forward's score tiles costs the AMX products (issue #23; benchmarks/README.md,
 * 2026-11-29, fifth session).
 *
 *   gcc -O2 -march=sapphirerapids benchmarks/amx_tiles.c -o /tmp/amx_tiles && /tmp/amx_tiles
 *
 * Times one 256-key x 128-row tile of S^T = K Q^T at D = 64 the way flash_amx.h's tile_scores runs
 * it (2 x 2 blocks of C tiles, two 32-deep steps a block), its 16 x 16 float32 results stored into
 * a score buffer [key][128 rows]:
 *   - into the whole 128 KiB buffer (the kernel's), which lives in L2;
 *   - into 16 KiB reused for every pair of key blocks, which stays in L1;
 *   - not stored at all (the products alone).
 * Whether vector work overlaps the products is benchmarks/amx_overlap.c's question.
 * Needs Linux 5.16+ (the AMX state is requested with arch_prctl) and AMX-BF16. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define ROWS 128 /* the item's rows (mp) */

struct __attribute__((aligned(64))) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

static uint16_t keys[256 * 64] __attribute__((aligned(64)));      /* 256 keys x 64 dims: rows 128 B */
static uint16_t queries[8][2][512] __attribute__((aligned(64)));   /* row tile x step x B tile */
static float scores[256 * ROWS] __attribute__((aligned(64)));      /* S^T[key][row]: 128 KiB */
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* 2 x 2 blocks over the tile; store: 0 none, 1 the whole buffer, 2 one 32-key slice. */
static void scores_tile(int store) {
    for (int kb = 0; kb < 16; kb += 2)
        for (int rt = 0; rt < 8; rt += 2) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int step = 0; step < 2; ++step) {
                _tile_loadd(4, keys + kb * 16 * 64 + step * 32, 128);
                _tile_loadd(5, keys + (kb + 1) * 16 * 64 + step * 32, 128);
                _tile_loadd(6, queries[rt][step], 64);
                _tile_loadd(7, queries[rt + 1][step], 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            if (!store) continue;
            float* first = scores + (store == 1 ? kb * 16 * ROWS : 0) + rt * 16;
            _tile_stored(0, first, ROWS * 4);
            _tile_stored(1, first + 16, ROWS * 4);
            _tile_stored(2, first + 16 * ROWS, ROWS * 4);
            _tile_stored(3, first + 16 * ROWS + 16, ROWS * 4);
        }
}

int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        fprintf(stderr, "amx_tiles: the kernel refused the AMX tile state\n");
        return 1;
    }
    struct TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
    for (int i = 0; i < 256 * 64; ++i) keys[i] = 0x3f80;

    const char* names[3] = {"products alone", "stored into 128 KiB (L2)", "stored into 16 KiB (L1)"};
    const int modes[3] = {0, 1, 2};
    printf("S^T of 256 keys x 128 rows, D = 64 (256 tdpbf16ps):\n");
    for (int m = 0; m < 3; ++m) {
        double best = 1e9;
        for (int round = 0; round < 7; ++round) {
            const double t0 = now();
            for (int i = 0; i < 2000; ++i) scores_tile(modes[m]);
            const double t = (now() - t0) / 2000;
            if (t < best) best = t;
        }
        printf("  %-26s %6.0f ns a tile, %5.2f ns a tdpbf16ps\n", names[m], best * 1e9, best * 1e9 / 256);
    }

    _tile_release();
    return 0;
}
