/* What a decode's memory walk reaches with arithmetic beside it (issue #23): a model, not a kernel.
 *
 * K and V are [64 heads][4096 keys][128] float32 (C6's 268 MB).  Threads take heads as OpenMP
 * dynamic items, like the forward's items; per tile of 128 keys a thread sums the K tile, then the V
 * tile (the decode's order: scores over K, then P.V over V).  WORK extra FMAs per loaded vector stand
 * for the decode's arithmetic (C6 float32 has 4 query rows a kv head: 4 FMAs per K or V vector); a
 * prefetch of PF bytes ahead in the current run (0: none, the hardware prefetchers alone) with HINT
 * 0 = T0, 1 = T1, 2 = T2, 3 = NTA tests what software prefetching buys.  Prints the best of 7
 * passes in GB/s of K and V read.
 *
 *   gcc -O2 -march=native -fopenmp benchmarks/decode_stream_model.c -o /tmp/decode_stream_model
 *   /tmp/decode_stream_model WORK PF THREADS [HINT]
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

enum { HEADS = 64, KEYS = 4096, DIM = 128, TILE = 128, VECTORS_PER_STEP = 8 };

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Four lines from `address` on, with the hint chosen at run time. */
static inline void prefetch_lines(const char* address, int hint) {
    for (int line = 0; line < 4; ++line) {
        const char* at = address + 64 * line;
        switch (hint) {
            case 1: _mm_prefetch(at, _MM_HINT_T1); break;
            case 2: _mm_prefetch(at, _MM_HINT_T2); break;
            case 3: _mm_prefetch(at, _MM_HINT_NTA); break;
            default: _mm_prefetch(at, _MM_HINT_T0); break;
        }
    }
}

/* `bytes` in 2 MiB pages where the kernel grants them (madvise), as numpy allocates large arrays on
 * Linux: the model then walks memory laid out as a decode's K and V are. */
static float* huge_page_array(size_t bytes) {
    const size_t page = (size_t)2 << 20, rounded = (bytes + page - 1) / page * page;
    float* array = aligned_alloc(page, rounded);
    if (array) madvise(array, rounded, MADV_HUGEPAGE);
    return array;
}

int main(int argc, char** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s WORK PF THREADS [HINT]\n", argv[0]);
        return 2;
    }
    const int work = atoi(argv[1]), threads = atoi(argv[3]), hint = argc > 4 ? atoi(argv[4]) : 0;
    const long ahead = atol(argv[2]);
    const long elements = (long)HEADS * KEYS * DIM;
    float* keys = huge_page_array(elements * sizeof(float));
    float* values = huge_page_array(elements * sizeof(float));
    if (!keys || !values) return 1;
    for (long i = 0; i < elements; ++i) {
        keys[i] = 1e-3f * (float)(i % 7);
        values[i] = 1e-3f * (float)(i % 5);
    }
    double best = 1e9;
    float sink = 0;
    for (int pass = 0; pass < 7; ++pass) {
        const double start = seconds_now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            __m256 acc[VECTORS_PER_STEP];
            for (int u = 0; u < VECTORS_PER_STEP; ++u) acc[u] = _mm256_setzero_ps();
            const __m256 weight = _mm256_set1_ps(0.999f);
#pragma omp for schedule(dynamic, 1)
            for (long head = 0; head < HEADS; ++head)
                for (long tile = 0; tile < KEYS; tile += TILE)
                    for (int which = 0; which < 2; ++which) {
                        const float* run = (which ? values : keys) + (head * KEYS + tile) * DIM;
                        for (long i = 0; i < TILE * DIM; i += 8 * VECTORS_PER_STEP) {
                            if (ahead) prefetch_lines((const char*)(run + i) + ahead, hint);
                            for (int u = 0; u < VECTORS_PER_STEP; ++u) {
                                const __m256 x = _mm256_load_ps(run + i + 8 * u);
                                acc[u] = _mm256_add_ps(acc[u], x);
                                for (int r = 0; r < work; ++r) acc[u] = _mm256_fmadd_ps(acc[u], weight, x);
                            }
                        }
                    }
            float lanes[8];
            for (int u = 0; u < VECTORS_PER_STEP; ++u) {
                _mm256_storeu_ps(lanes, acc[u]);
                sink += lanes[0];
            }
        }
        const double elapsed = seconds_now() - start;
        if (elapsed < best) best = elapsed;
    }
    printf("work=%d ahead=%ld threads=%d hint=%d: %.2f ms, %.1f GB/s (checksum %g)\n", work, ahead, threads, hint,
           best * 1e3, 2.0 * elements * sizeof(float) / best / 1e9, sink);
    free(keys);
    free(values);
    return 0;
}
