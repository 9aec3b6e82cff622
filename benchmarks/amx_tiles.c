/* What AMX tile products cost around the forward's Q K^T, and whether vector work overlaps them
 * (issue #23; benchmarks/README.md, "AMX: where the tile products' time goes").
 *
 *   gcc -O2 -march=sapphirerapids benchmarks/amx_tiles.c -o /tmp/amx_tiles && /tmp/amx_tiles
 *
 * Part 1 times one 256-key x 128-row tile of S^T = K Q^T at D = 64 the way flash_amx.h's
 * tile_scores runs it (2 x 2 blocks of C tiles, two 32-deep steps a block), its 16 x 16 float32
 * results stored into a score buffer [key][128 rows]:
 *   - into the whole 128 KiB buffer (the kernel's), which lives in L2;
 *   - into 16 KiB reused for every pair of key blocks, which stays in L1;
 *   - not stored at all (the products alone).
 * Part 2 interleaves a 2 x 2 step (four tile loads, four tdpbf16ps, operands in L1) with n
 * vectors of exponential-like work (a load, an FMA polynomial, vscalefps, a sum, a bfloat16
 * pack and store: the softmax's per-vector work) and compares the time with the two run apart.
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
static uint16_t operands[4][512] __attribute__((aligned(64)));
static float work_in[8192 * 16] __attribute__((aligned(64)));
static uint16_t work_out[8192 * 16] __attribute__((aligned(64)));

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

static inline void tile_step(void) {
    _tile_loadd(4, operands[0], 64);
    _tile_loadd(5, operands[1], 64);
    _tile_loadd(6, operands[2], 64);
    _tile_loadd(7, operands[3], 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

static inline __m512 vector_work(int j, __m512 sum) {
    const int at = (j & 8191) * 16;
    const __m512 x = _mm512_sub_ps(_mm512_load_ps(work_in + at), _mm512_set1_ps(3.0f));
    const __m512 whole = _mm512_roundscale_ps(x, 0), f = _mm512_sub_ps(x, whole);
    __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(0.0013f), _mm512_set1_ps(0.0096f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_scalef_ps(p, whole);
    _mm256_store_si256((__m256i*)(work_out + at), (__m256i)_mm512_cvtneps_pbh(p));
    return _mm512_add_ps(sum, p);
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
    for (int i = 0; i < 4 * 512; ++i) ((uint16_t*)operands)[i] = 0x3f80;
    for (int i = 0; i < 8192 * 16; ++i) work_in[i] = (float)(i % 97) * 0.01f;

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

    printf("a 2 x 2 step (4 tile loads, 4 tdpbf16ps) with n vectors of softmax-like work:\n");
    const int steps = 200000;
    for (int n = 4; n <= 32; n *= 2) {
        double tiles = 1e9, vectors = 1e9, both = 1e9;
        for (int round = 0; round < 5; ++round) {
            __m512 sum = _mm512_setzero_ps();
            const double t0 = now();
            for (int i = 0; i < steps; ++i) tile_step();
            _tile_stored(0, scores, 64);
            const double t1 = now();
            for (int i = 0; i < steps; ++i)
                for (int j = 0; j < n; ++j) sum = vector_work(i * n + j, sum);
            const double t2 = now();
            for (int i = 0; i < steps; ++i) {
                tile_step();
                for (int j = 0; j < n; ++j) sum = vector_work(i * n + j, sum);
            }
            _tile_stored(0, scores, 64);
            const double t3 = now();
            volatile float keep = _mm512_reduce_add_ps(sum);
            (void)keep;
            if (t1 - t0 < tiles) tiles = t1 - t0;
            if (t2 - t1 < vectors) vectors = t2 - t1;
            if (t3 - t2 < both) both = t3 - t2;
        }
        printf("  n = %2d: step %5.1f ns, vectors %6.1f ns, interleaved %6.1f ns (apart: %6.1f)\n", n,
               tiles / steps * 1e9, vectors / steps * 1e9, both / steps * 1e9, (tiles + vectors) / steps * 1e9);
    }
    _tile_release();
    return 0;
}
