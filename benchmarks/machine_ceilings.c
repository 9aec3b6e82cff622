/* The machine's own ceilings for bench_cpu.py, compiled there with -O2 -march=native -fopenmp.
 *
 * fma_peak_gflops: float32 multiply-adds on registers only, on every thread.  Each thread runs
 * CHAINS independent chains acc = acc * a + b on the widest vectors the compiler targets; CHAINS
 * covers FMA latency x FMA pipes on the cores we meet (4 cycles x 2 pipes = 8 in flight) and fits
 * the register file (12 of 32 zmm with AVX-512, 10 of 16 ymm otherwise), so nothing waits on memory
 * or on a previous result.
 *
 * read_gbytes_per_s: every thread sums its share of a buffer far larger than the caches, vector
 * loads with several accumulators: the DRAM read bandwidth a K/V-streaming decode can reach.  With
 * ahead_bytes > 0 each step also prefetches, into L2, the line that far ahead of its loads: the
 * hardware's prefetchers alone can leave bandwidth unused (2-core Xeon model 207: 19-20 GB/s
 * without, 22-29 GB/s with 16 KiB ahead), and a decode that prefetches would then outrun its
 * ceiling.  bench_cpu.py takes the faster of the two.
 */
#include <omp.h>
#include <stddef.h>

#if defined(__AVX512F__)
#define VECTOR_BYTES 64
#define CHAINS 12
#else
#define VECTOR_BYTES 32
#define CHAINS 10
#endif

typedef float vec __attribute__((vector_size(VECTOR_BYTES)));
#define LANES (VECTOR_BYTES / 4)

double fma_peak_gflops(long iterations, int threads) {
    float sink = 0.0f;
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        vec acc[CHAINS];
        const vec a = (vec){} + 0.999999f, b = (vec){} + 1e-7f;
        for (int c = 0; c < CHAINS; ++c) acc[c] = (vec){} + (float)(c + omp_get_thread_num());
        for (long i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
            for (int c = 0; c < CHAINS; ++c) acc[c] = acc[c] * a + b; /* float rules forbid a closed form */
        }
        for (int c = 0; c < CHAINS; ++c)
            for (int lane = 0; lane < LANES; ++lane) sink += acc[c][lane];
    }
    const double seconds = omp_get_wtime() - start;
    if (sink == 12345.0f) return 0.0; /* uses sink */
    return 2.0 * LANES * CHAINS * (double)iterations * threads / seconds / 1e9;
}

double read_gbytes_per_s(const float* data, size_t count, int threads, long ahead_bytes) {
    float sink = 0.0f;
    const size_t blocks = count / (4 * LANES); /* four vectors per step, four accumulators */
    const size_t block_bytes = 4 * VECTOR_BYTES;
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        const size_t n = (size_t)omp_get_num_threads(), t = (size_t)omp_get_thread_num();
        vec acc[4] = {{}, {}, {}, {}};
        const char* bytes = (const char*)data;
        const char* end = bytes + blocks * block_bytes;
        for (size_t block = blocks * t / n; block < blocks * (t + 1) / n; ++block) {
            if (ahead_bytes > 0) {
                const char* step = bytes + block * block_bytes + ahead_bytes;
                for (size_t line = 0; line < block_bytes; line += 64)
                    if (step + line < end) __builtin_prefetch(step + line, 0, 2);
            }
            for (int u = 0; u < 4; ++u) {
                vec v;
                __builtin_memcpy(&v, data + (4 * block + u) * LANES, sizeof(vec));
                acc[u] += v;
            }
        }
        const vec total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        for (int lane = 0; lane < LANES; ++lane) sink += total[lane];
    }
    const double seconds = omp_get_wtime() - start;
    if (sink == 12345.0f) return 0.0;
    return (double)(blocks * 4 * LANES * sizeof(float)) / seconds / 1e9;
}
