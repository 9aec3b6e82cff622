/* Does the core run AMX tile products and AVX-512 vector work at the same time?  (Issue #23: the AMX
 * forward's softmax, vector work, and its two products, tile work, run one after the other per key
 * tile; they could overlap only if the core runs both at once.)
 *
 * One thread times, in ns per round, median of 5 runs:
 *   vector      four independent softmax-like exponentials (about 60 instructions: the kernel's
 *               vexp2_softmax on a load, a sum and a store);
 *   tiles       four tdpbf16ps on tiles loaded once (16 cycles of the TMUL unit each);
 *   fine        one tdpbf16ps between every four exponentials;
 *   coarse      a block of 8 tdpbf16ps with their tile loads and stores, then 32 exponentials (as the
 *               forward's phases: products of a tile, then its softmax);
 * a round: 4 exponentials and (fine, coarse) one tdpbf16ps.
 * Overlap shows as a round near max(vector, tiles) rather than their sum.
 *
 *     gcc -O2 -march=native -o /tmp/amx_overlap benchmarks/amx_overlap.c && /tmp/amx_overlap
 *
 * Needs AMX-BF16 (Linux grants the tile registers on request, as fastattn's dispatch does).
 * Measured on a 2-core Xeon (family 6 model 167), two runs: vector 7.8, tiles 5.2, fine 8.7-9.0,
 * coarse 16.8 ns.  Finely interleaved, both run at once (near the larger); in blocks with their tile
 * loads and stores, more than their sum.  The forward with a step of the next tile's S^T and the
 * previous tile's P.V (each step loading its A and B tiles from L1/L2) run between the softmax's
 * pairs of keys was no faster there, bit-identical but 0-20% slower on C1/C2 (benchmarks/README.md,
 * 2026-11-28, eighth session). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct __attribute__((aligned(64))) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

static float scores[512 * 16] __attribute__((aligned(64)));
static uint16_t operand[16 * 32] __attribute__((aligned(64)));
static float accumulators[4][256] __attribute__((aligned(64)));

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* total += 2^(x log2(e) - shift), the kernel's exponential (a 32-entry table, a degree-2 polynomial). */
static inline __m512 exponential(__m512 x, __m512 shift, __m512 total) {
    const __m512 magic = _mm512_set1_ps(393216.0f);
    const __m512 t = _mm512_fmsub_ps(x, _mm512_set1_ps(1.44269504f), shift);
    const __m512 shifted = _mm512_add_ps(t, magic), r = _mm512_sub_ps(shifted, magic), f = _mm512_sub_ps(t, r);
    const __m512 power = _mm512_permutex2var_ps(_mm512_set1_ps(1.0f), _mm512_castps_si512(shifted), _mm512_set1_ps(1.1f));
    const __m512 poly = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_set1_ps(0.2402f), f, _mm512_set1_ps(0.6932f)), f);
    const __mmask16 kept = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    return _mm512_add_ps(total, _mm512_maskz_scalef_ps(kept, _mm512_fmadd_ps(poly, power, power), r));
}

static __m512 totals[4];

/* Four independent exponentials of scores from row b on, one vector stored. */
static inline void four_exponentials(long b) {
    const __m512 shift = _mm512_set1_ps(0.5f);
    for (int u = 0; u < 4; ++u) totals[u] = exponential(_mm512_load_ps(scores + ((b + u) & 511) * 16), shift, totals[u]);
    _mm512_store_ps(scores + ((b + 300) & 511) * 16, totals[0]);
}

/* A 2 x 2 block of 2 steps: C loaded, 8 tdpbf16ps (A and B tiles loaded per step), C stored. */
static void block_of_8(void) {
    _tile_loadd(0, accumulators[0], 64);
    _tile_loadd(1, accumulators[1], 64);
    _tile_loadd(2, accumulators[2], 64);
    _tile_loadd(3, accumulators[3], 64);
    for (int step = 0; step < 2; ++step) {
        _tile_loadd(4, operand, 64);
        _tile_loadd(5, operand, 64);
        _tile_loadd(6, operand, 64);
        _tile_loadd(7, operand, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, accumulators[0], 64);
    _tile_stored(1, accumulators[1], 64);
    _tile_stored(2, accumulators[2], 64);
    _tile_stored(3, accumulators[3], 64);
}

static int by_value(const void* a, const void* b) {
    const double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
        fprintf(stderr, "amx_overlap: Linux did not grant the AMX tile registers\n");
        return 1;
    }
    struct TileConfig config;
    memset(&config, 0, sizeof(config));
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
    for (int i = 0; i < 512 * 16; ++i) scores[i] = -(float)(i % 97) * 0.01f;
    const long rounds = 1000000;
    double results[4][5];
    for (int run = 0; run < 5; ++run) {
        for (int u = 0; u < 4; ++u) totals[u] = _mm512_setzero_ps();
        _tile_loadd(4, operand, 64);
        _tile_loadd(5, operand, 64);
        _tile_loadd(6, operand, 64);
        _tile_loadd(7, operand, 64);
        double t0 = seconds();
        for (long i = 0; i < rounds; ++i) four_exponentials(4 * i);
        double t1 = seconds();
        for (long i = 0; i < rounds; ++i) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        double t2 = seconds();
        for (long i = 0; i < rounds; i += 4) {
            _tile_dpbf16ps(0, 4, 6);
            four_exponentials(4 * i);
            _tile_dpbf16ps(1, 4, 7);
            four_exponentials(4 * i + 4);
            _tile_dpbf16ps(2, 5, 6);
            four_exponentials(4 * i + 8);
            _tile_dpbf16ps(3, 5, 7);
            four_exponentials(4 * i + 12);
        }
        double t3 = seconds();
        for (long i = 0; i < rounds; i += 8) { /* 8 tdpbf16ps, then 8 x 4 exponentials: 8 rounds */
            block_of_8();
            for (int k = 0; k < 8; ++k) four_exponentials(4 * (i + k));
        }
        double t4 = seconds();
        results[0][run] = (t1 - t0) / rounds * 1e9;
        results[1][run] = (t2 - t1) / rounds * 1e9 / 4; /* four tdpbf16ps an iteration */
        results[2][run] = (t3 - t2) / rounds * 1e9;
        results[3][run] = (t4 - t3) / rounds * 1e9;
    }
    _tile_release();
    const char* names[4] = {"vector", "tiles", "fine", "coarse"};
    for (int k = 0; k < 4; ++k) {
        qsort(results[k], 5, sizeof(double), by_value);
        printf("%-7s %6.2f ns a round\n", names[k], results[k][2]);
    }
    float sink[16];
    _mm512_storeu_ps(sink, _mm512_add_ps(_mm512_add_ps(totals[0], totals[1]), _mm512_add_ps(totals[2], totals[3])));
    return sink[0] == 12345.0f;
}
