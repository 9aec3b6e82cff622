/* What the half-precision softmax's exponentials and bfloat16 packing cost per vector of 16 scores
 * (issue #23: on AMX the softmax, not the tile products, was the larger part of a bfloat16 forward
 * at D = 64).
 *
 * One thread runs the settled softmax's inner loop (forward_tiles.h: softmax_exponentials) over one
 * tile of 256 keys x 32 rows held in L1: per vector a load, the FMA forming t, vexp2_softmax (the
 * AVX-512 version: 32-entry table, degree-2 polynomial, vscalefps), the row sum's add, and per pair
 * of keys the packing of P into the AMX B layout; ns per vector, best of 50 runs of 200 sweeps.
 *   current    vcvtne2ps2bf16 (round to nearest even) and vpermw interleaving the two keys' words
 *              (flash_bf16.h: PackProbabilities);
 *   no-pack    the float32 P of the even key stored as it is: the loop without the packing (a floor,
 *              not a kernel);
 *   int-round  the rounding in integer instructions (bits + 0x7fff + the lowest kept bit) and vpermt2w
 *              taking the high words of both keys;
 *   fma-round  P rounded to bfloat16 inside the exponential (2^r (1 + poly) + 3 * 2^15 in its last FMA
 *              puts y on bfloat16's grid, the subtraction takes the 3 * 2^15 away, vscalefps is exact),
 *              then the two keys' high words merged with a shift and a vpternlogd: the row sums would
 *              take the rounded P;
 *   degree-1   the current packing after an exponential whose polynomial is 1 + f ln 2 (relative error
 *              6e-5 on |f| <= 1/64).
 *
 *     gcc -O2 -march=native -o /tmp/softmax_pack benchmarks/softmax_pack.c && /tmp/softmax_pack
 *
 * Needs AVX-512 F/BW and AVX512_BF16.  Measured on a 2-core Xeon (family 6 model 167), two runs:
 * current 2.20-2.23 ns, no-pack 1.70-1.71, int-round 2.63-2.65, fma-round 1.95-1.96, degree-1
 * 1.95-1.97 (an earlier draft of this loop on the same host, an hour before: current 1.90-2.05,
 * fma-round 1.84-1.88, degree-1 1.89-1.90).  In the kernel, degree-1 was within this host's noise
 * (benchmarks/README.md, 2026-11-29, fourth session). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

enum Variant { CURRENT, NO_PACK, INT_ROUND, FMA_ROUND, DEGREE_1, VARIANTS };
static const char* const kNames[VARIANTS] = {"current", "no-pack", "int-round", "fma-round", "degree-1"};

#define KEYS 256
#define ROWS 32

static float scores[KEYS * ROWS] __attribute__((aligned(64)));
static uint16_t packed[KEYS * ROWS] __attribute__((aligned(64)));
static const float kPowers[32] __attribute__((aligned(64))) = {
    1.000000000e+00f, 1.021897197e+00f, 1.044273734e+00f, 1.067140460e+00f, 1.090507746e+00f, 1.114386797e+00f,
    1.138788581e+00f, 1.163724899e+00f, 1.189207077e+00f, 1.215247393e+00f, 1.241857767e+00f, 1.269050956e+00f,
    1.296839595e+00f, 1.325236678e+00f, 1.354255557e+00f, 1.383909941e+00f, 1.414213538e+00f, 1.445180774e+00f,
    1.476826191e+00f, 1.509164453e+00f, 1.542210817e+00f, 1.575980902e+00f, 1.610490322e+00f, 1.645755529e+00f,
    1.681792855e+00f, 1.718619347e+00f, 1.756252170e+00f, 1.794709086e+00f, 1.834008098e+00f, 1.874167681e+00f,
    1.915206552e+00f, 1.957144141e+00f};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* 2^x as vexp2_softmax computes it; variant FMA_ROUND rounds the result to bfloat16's grid and
 * DEGREE_1 uses the shorter polynomial. */
static inline __attribute__((always_inline)) __m512 exp2_as(__m512 x, enum Variant variant) {
    const __m512 magic = _mm512_set1_ps(393216.0f);
    const __m512 shifted = _mm512_add_ps(x, magic);
    const __m512 r = _mm512_sub_ps(shifted, magic);
    const __m512 f = _mm512_sub_ps(x, r);
    const __m512 power = _mm512_permutex2var_ps(_mm512_load_ps(kPowers), _mm512_castps_si512(shifted),
                                                _mm512_load_ps(kPowers + 16));
    const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    const __m512 c1 = _mm512_set1_ps(0.6931573f), c2 = _mm512_set1_ps(0.24022676f);
    if (variant == DEGREE_1) {
        const __m512 poly = _mm512_mul_ps(c1, f);
        return _mm512_maskz_scalef_ps(kept, _mm512_fmadd_ps(poly, power, power), r);
    }
    if (variant == FMA_ROUND) {
        const __m512 grid = _mm512_set1_ps(98304.0f); /* 3 * 2^15: its ulp is 2^-7, bfloat16's on [1, 2) */
        const __m512 poly1 = _mm512_fmadd_ps(_mm512_fmadd_ps(c2, f, c1), f, _mm512_set1_ps(1.0f));
        const __m512 y = _mm512_sub_ps(_mm512_fmadd_ps(power, poly1, grid), grid);
        return _mm512_maskz_scalef_ps(kept, y, r);
    }
    const __m512 poly = _mm512_mul_ps(_mm512_fmadd_ps(c2, f, c1), f);
    return _mm512_maskz_scalef_ps(kept, _mm512_fmadd_ps(poly, power, power), r);
}

static inline __m512i round_to_bfloat16_bits(__m512 p) {
    const __m512i bits = _mm512_castps_si512(p);
    const __m512i lowest_kept = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(bits, _mm512_add_epi32(lowest_kept, _mm512_set1_epi32(0x7fff)));
}

/* The two keys' P in the B tile's pairs: words (p0[i], p1[i]) for i = 0..15. */
static inline __attribute__((always_inline)) __m512i pack_pair(__m512 p0, __m512 p1, enum Variant variant) {
    static const uint16_t interleave[32] __attribute__((aligned(64))) = {
        0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    static const uint16_t high_words[32] __attribute__((aligned(64))) = {
        1, 33, 3, 35, 5, 37, 7, 39, 9, 41, 11, 43, 13, 45, 15, 47, 17, 49, 19, 51, 21, 53, 23, 55, 25, 57, 27, 59, 29, 61, 31, 63};
    switch (variant) {
        case NO_PACK:
            return _mm512_castps_si512(p0);
        case INT_ROUND:
            return _mm512_permutex2var_epi16(round_to_bfloat16_bits(p0), _mm512_load_si512(high_words),
                                             round_to_bfloat16_bits(p1));
        case FMA_ROUND: /* p0's high word into the low half of each dword, p1's high half kept (0xd8: c ? b : a) */
            return _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(p0), 16), _mm512_castps_si512(p1),
                                             _mm512_set1_epi32((int)0xffff0000u), 0xd8);
        default:
            return _mm512_permutexvar_epi16(_mm512_load_si512(interleave), (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
}

static inline __attribute__((always_inline)) double ns_per_vector(enum Variant variant, float* checksum) {
    const __m512 scale = _mm512_set1_ps(0.18f), shift = _mm512_set1_ps(0.5f);
    __m512 total0 = _mm512_setzero_ps(), total1 = _mm512_setzero_ps();
    double best = 1e30;
    for (int run = 0; run < 50; ++run) {
        const double start = now();
        for (int sweep = 0; sweep < 200; ++sweep)
            for (int j = 0; j < KEYS; j += 2)
                for (int u = 0; u < ROWS / 16; ++u) {
                    const __m512 p0 = exp2_as(_mm512_fmsub_ps(_mm512_load_ps(scores + j * ROWS + u * 16), scale, shift), variant);
                    const __m512 p1 = exp2_as(_mm512_fmsub_ps(_mm512_load_ps(scores + (j + 1) * ROWS + u * 16), scale, shift), variant);
                    _mm512_store_si512(packed + (j / 2) * 2 * ROWS + u * 32, pack_pair(p0, p1, variant));
                    total0 = _mm512_add_ps(total0, p0);
                    total1 = _mm512_add_ps(total1, p1);
                }
        const double seconds = now() - start;
        if (seconds < best) best = seconds;
    }
    *checksum = _mm512_reduce_add_ps(_mm512_add_ps(total0, total1));
    return best * 1e9 / (200.0 * KEYS * ROWS / 16);
}

/* Each variant's loop compiled on its own (a constant variant), so no branch stays in it. */
static void report(enum Variant variant) {
    float checksum = 0.0f;
    double ns = 0.0;
    switch (variant) {
        case CURRENT: ns = ns_per_vector(CURRENT, &checksum); break;
        case NO_PACK: ns = ns_per_vector(NO_PACK, &checksum); break;
        case INT_ROUND: ns = ns_per_vector(INT_ROUND, &checksum); break;
        case FMA_ROUND: ns = ns_per_vector(FMA_ROUND, &checksum); break;
        default: ns = ns_per_vector(DEGREE_1, &checksum); break;
    }
    printf("%-10s %.3f ns a vector (sum of P %.6g)\n", kNames[variant], ns, checksum);
}

int main(void) {
    for (int i = 0; i < KEYS * ROWS; ++i) scores[i] = -0.1f * (float)(i % 97); /* t from -0.5 to -2.2 */
    for (int variant = 0; variant < VARIANTS; ++variant) report((enum Variant)variant);
    return 0;
}
