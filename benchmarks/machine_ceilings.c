/* The machine's own ceilings for bench_cpu.py, compiled there with -O2 -march=native -fopenmp.
 *
 * fma_peak_gflops: float32 multiply-adds on registers only, on every thread.  Each thread runs
 * CHAINS independent chains acc = acc * a + b on the widest vectors the compiler targets; CHAINS
 * covers FMA latency x FMA pipes on the cores we meet (4 cycles x 2 pipes = 8 in flight) and fits
 * the register file (12 of 32 zmm with AVX-512, 10 of 16 ymm or xmm otherwise), so nothing waits on
 * memory or on a previous result.
 *
 * read_gbytes_per_s: every thread sums its share of a buffer far larger than the caches, vector
 * loads with several accumulators: the DRAM read bandwidth a K/V-streaming decode can reach.  With
 * ahead_bytes > 0 each step also prefetches, into L2, the line that far ahead of its loads: the
 * hardware's prefetchers alone can leave bandwidth unused (2-core Xeon model 207: 19-20 GB/s
 * without, 22-29 GB/s with 16 KiB ahead), and a decode that prefetches would then outrun its
 * ceiling.  bench_cpu.py takes the faster of the two.
 *
 * read_with_fmas_gbytes_per_s: the same walk (prefetching ahead_bytes ahead), each loaded vector
 * also feeding fmas_per_vector multiply-adds (stream, below), so they wait on the load and on the
 * FMA pipes but not on one another.  It is what a one-pass kernel that does that much arithmetic
 * per byte could stream at best: a decode's ceiling that counts its arithmetic (bench_cpu.py gives
 * a decode the FMAs its FLOPs need per vector of its K and V, 2 FLOPs / bytes).
 * Cores that overlap arithmetic and memory only in part show it below the plain read even where
 * the FMAs alone would take far less time than the bytes (2-core Xeon model 207: 8 FMAs a 64-byte
 * vector, a bfloat16 C6's, a third of the read's time at the FMA peak, streamed at ~0.85 of it).
 */
#include <omp.h>
#include <stddef.h>

#if defined(__AVX512F__)
#define VECTOR_BYTES 64
#define CHAINS 12
#elif defined(__AVX__)
#define VECTOR_BYTES 32
#define CHAINS 10
#else
#define VECTOR_BYTES 16
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

/* The lines ahead_bytes past one step's block into L2 (none where ahead_bytes is 0). */
static inline void prefetch_ahead(const char* block_start, size_t block_bytes, long ahead_bytes, const char* end) {
    if (ahead_bytes <= 0) return;
    const char* step = block_start + ahead_bytes;
    for (size_t line = 0; line < block_bytes; line += 64)
        if (step + line < end) __builtin_prefetch(step + line, 0, 2);
}

/* The FMAs of read_with_fmas_gbytes_per_s go round WORK_CHAINS chains in fixed registers (with the
 * step's four vectors and the scale: 17 of 32 zmm, 13 of 16 ymm), enough to keep two FMA pipes of
 * 4-cycle latency busy.  A step's 4 fmas FMAs run as rounds over all chains (each vector on a
 * fixed share), then four or eight more (one or two on each vector: fma_walk).  With each vector's
 * FMAs on three chains of its own instead, the first vector's ran one after another while the
 * scheduler had not yet reached the next one's, and 128 FMAs a vector ran at half the FMA peak. */
#if defined(__AVX512F__)
enum { WORK_CHAINS = 12 };
#else
enum { WORK_CHAINS = 8 };
#endif

/* The vector at `at` (unaligned), and one of four by a constant index: a step's vectors held as an
 * array went through the stack. */
static inline __attribute__((always_inline)) vec load_vec(const float* at) {
    vec v;
    __builtin_memcpy(&v, at, sizeof(vec));
    return v;
}
static inline __attribute__((always_inline)) vec pick(int i, vec a, vec b, vec c, vec d) {
    return i == 0 ? a : i == 1 ? b : i == 2 ? c : d;
}

/* One thread's blocks [first, last) of the buffer ending at `end`, a step at a time, with `rounds`
 * rounds of FMAs over the chains and `rest` more (0, 4 or 8, a constant where it is inlined: a
 * run-time count left the chains in memory between steps); the chains' sum into *total. */
static inline void fma_walk(const float* data, size_t first, size_t last, const char* end, long ahead_bytes,
                            int rounds, int rest, vec* total) {
    const size_t block_bytes = 4 * VECTOR_BYTES;
    const char* bytes = (const char*)data;
    vec work[WORK_CHAINS];
    for (int c = 0; c < WORK_CHAINS; ++c) work[c] = (vec){};
    const vec scale = (vec){} + 0.999999f;
    for (size_t block = first; block < last; ++block) {
        prefetch_ahead(bytes + block * block_bytes, block_bytes, ahead_bytes, end);
        const float* at = data + 4 * block * LANES;
        const vec v0 = load_vec(at), v1 = load_vec(at + LANES);
        const vec v2 = load_vec(at + 2 * LANES), v3 = load_vec(at + 3 * LANES);
        for (int r = 0; r < rounds; ++r) {
#pragma GCC unroll 12
            for (int c = 0; c < WORK_CHAINS; ++c) work[c] = work[c] * scale + pick(c % 4, v0, v1, v2, v3);
        }
#pragma GCC unroll 8
        for (int c = 0; c < rest; ++c) work[c] = work[c] * scale + pick(c % 4, v0, v1, v2, v3);
    }
    for (int c = 0; c < WORK_CHAINS; ++c) *total += work[c];
}

/* Every thread's share of the buffer in steps of four vectors: summed (fmas 0), or each vector
 * feeding `fmas` multiply-adds; bytes per second over all threads. */
static inline double stream(const float* data, size_t count, int threads, long ahead_bytes, int fmas) {
    float sink = 0.0f;
    const size_t blocks = count / (4 * LANES); /* four vectors per step */
    const size_t block_bytes = 4 * VECTOR_BYTES;
    const int rounds = 4 * fmas / WORK_CHAINS, rest = 4 * fmas % WORK_CHAINS; /* rest: 0, 4 or 8 */
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        const size_t n = (size_t)omp_get_num_threads(), t = (size_t)omp_get_thread_num();
        const size_t first = blocks * t / n, last = blocks * (t + 1) / n;
        const char* bytes = (const char*)data;
        const char* end = bytes + blocks * block_bytes;
        vec total = (vec){};
        if (fmas == 0) {
            vec acc[4] = {{}, {}, {}, {}}; /* four accumulators */
            for (size_t block = first; block < last; ++block) {
                prefetch_ahead(bytes + block * block_bytes, block_bytes, ahead_bytes, end);
                for (int u = 0; u < 4; ++u) acc[u] += load_vec(data + (4 * block + u) * LANES);
            }
            total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        } else if (rest == 0) {
            fma_walk(data, first, last, end, ahead_bytes, rounds, 0, &total);
        } else if (rest == 4) {
            fma_walk(data, first, last, end, ahead_bytes, rounds, 4, &total);
        } else {
            fma_walk(data, first, last, end, ahead_bytes, rounds, 8, &total);
        }
        for (int lane = 0; lane < LANES; ++lane) sink += total[lane];
    }
    const double seconds = omp_get_wtime() - start;
    if (sink == 12345.0f) return 0.0;
    return (double)(blocks * 4 * LANES * sizeof(float)) / seconds / 1e9;
}

double read_gbytes_per_s(const float* data, size_t count, int threads, long ahead_bytes) {
    return stream(data, count, threads, ahead_bytes, 0);
}

double read_with_fmas_gbytes_per_s(const float* data, size_t count, int threads, long ahead_bytes,
                                   int fmas_per_vector) {
    return stream(data, count, threads, ahead_bytes, fmas_per_vector);
}
