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
 *
 * read_half_with_fmas_gbytes_per_s: the same for a buffer of bfloat16 or float16, each vector of
 * halves converted to float32 as the decode's converting levels do (bfloat16: a shift and a mask,
 * the two float vectors in pair order; float16: F16C's vcvtph2ps or AVX-512's, none where the
 * compiler targets neither: the function then returns 0) and every float vector feeding
 * fmas_per_vector multiply-adds.  What a one-pass kernel that converts each element once could
 * stream: on cores where the conversion takes the FMA pipes (Zen 1: vcvtph2ps), below the row
 * without it.
 */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

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

/* The formats a step's four float vectors come from (fma_walk's `format`, a constant where inlined). */
enum { FLOAT32 = 0, BFLOAT16 = 1, FLOAT16 = 2 };

/* Bytes of one step's four float vectors in `format`. */
static inline size_t step_bytes(int format) { return format == FLOAT32 ? 4 * VECTOR_BYTES : 2 * VECTOR_BYTES; }

typedef uint32_t pairs_vec __attribute__((vector_size(VECTOR_BYTES)));

/* Two vectors of bfloat16 pairs as four float vectors, even elements then odd (pair order). */
static inline __attribute__((always_inline)) void split_bfloat16(const char* at, vec* even, vec* odd) {
    pairs_vec raw;
    __builtin_memcpy(&raw, at, sizeof(raw));
    *even = (vec)(raw << 16);
    *odd = (vec)(raw & 0xffff0000u);
}

/* LANES float16 values at `at` as one float vector (F16C or AVX-512; zeros where neither exists,
 * and read_half_with_fmas_gbytes_per_s does not run). */
static inline __attribute__((always_inline)) vec widen_float16(const char* at) {
#if VECTOR_BYTES == 64 && defined(__AVX512F__)
    return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)at));
#elif VECTOR_BYTES == 32 && defined(__F16C__)
    return (vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)at));
#elif VECTOR_BYTES == 16 && defined(__F16C__)
    return (vec)_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)at));
#else
    (void)at;
    return (vec){};
#endif
}

/* One step's four float vectors from `at` in `format`. */
static inline __attribute__((always_inline)) void load_step(int format, const char* at, vec* v0, vec* v1, vec* v2,
                                                            vec* v3) {
    if (format == FLOAT32) {
        const float* floats = (const float*)at;
        *v0 = load_vec(floats);
        *v1 = load_vec(floats + LANES);
        *v2 = load_vec(floats + 2 * LANES);
        *v3 = load_vec(floats + 3 * LANES);
    } else if (format == BFLOAT16) {
        split_bfloat16(at, v0, v1);
        split_bfloat16(at + VECTOR_BYTES, v2, v3);
    } else {
        const size_t half_vector = VECTOR_BYTES / 2;
        *v0 = widen_float16(at);
        *v1 = widen_float16(at + half_vector);
        *v2 = widen_float16(at + 2 * half_vector);
        *v3 = widen_float16(at + 3 * half_vector);
    }
}

/* One thread's blocks [first, last) of the buffer ending at `end`, a step at a time (four float
 * vectors, loaded from `format`), with `rounds` rounds of FMAs over the chains and `rest` more
 * (0, 4 or 8; rest and format constants where it is inlined: a run-time count left the chains in
 * memory between steps); the chains' sum into *total. */
static inline __attribute__((always_inline)) void fma_walk(const char* bytes, size_t first, size_t last,
                                                           const char* end, long ahead_bytes, int format, int rounds,
                                                           int rest, vec* total) {
    const size_t block_bytes = step_bytes(format);
    vec work[WORK_CHAINS];
    for (int c = 0; c < WORK_CHAINS; ++c) work[c] = (vec){};
    const vec scale = (vec){} + 0.999999f;
    for (size_t block = first; block < last; ++block) {
        prefetch_ahead(bytes + block * block_bytes, block_bytes, ahead_bytes, end);
        vec v0, v1, v2, v3;
        load_step(format, bytes + block * block_bytes, &v0, &v1, &v2, &v3);
        for (int r = 0; r < rounds; ++r) {
#pragma GCC unroll 12
            for (int c = 0; c < WORK_CHAINS; ++c) work[c] = work[c] * scale + pick(c % 4, v0, v1, v2, v3);
        }
#pragma GCC unroll 8
        for (int c = 0; c < rest; ++c) work[c] = work[c] * scale + pick(c % 4, v0, v1, v2, v3);
    }
    for (int c = 0; c < WORK_CHAINS; ++c) *total += work[c];
}

/* fma_walk with `rest` as a constant for each value it takes. */
static inline __attribute__((always_inline)) void fma_walk_rest(const char* bytes, size_t first, size_t last,
                                                                const char* end, long ahead_bytes, int format,
                                                                int rounds, int rest, vec* total) {
    if (rest == 0)
        fma_walk(bytes, first, last, end, ahead_bytes, format, rounds, 0, total);
    else if (rest == 4)
        fma_walk(bytes, first, last, end, ahead_bytes, format, rounds, 4, total);
    else
        fma_walk(bytes, first, last, end, ahead_bytes, format, rounds, 8, total);
}

/* Every thread's share of the buffer of `count` elements in `format`, in steps of four float vectors:
 * summed (fmas 0, float32 only), or each vector feeding `fmas` multiply-adds; bytes per second over
 * all threads. */
static inline double stream(const char* data, size_t count, int format, int threads, long ahead_bytes, int fmas) {
    float sink = 0.0f;
    const size_t blocks = count / (4 * LANES); /* four float vectors per step */
    const size_t block_bytes = step_bytes(format);
    const int rounds = 4 * fmas / WORK_CHAINS, rest = 4 * fmas % WORK_CHAINS; /* rest: 0, 4 or 8 */
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        const size_t n = (size_t)omp_get_num_threads(), t = (size_t)omp_get_thread_num();
        const size_t first = blocks * t / n, last = blocks * (t + 1) / n;
        const char* end = data + blocks * block_bytes;
        vec total = (vec){};
        if (fmas == 0) {
            const float* floats = (const float*)data;
            vec acc[4] = {{}, {}, {}, {}}; /* four accumulators */
            for (size_t block = first; block < last; ++block) {
                prefetch_ahead(data + block * block_bytes, block_bytes, ahead_bytes, end);
                for (int u = 0; u < 4; ++u) acc[u] += load_vec(floats + (4 * block + u) * LANES);
            }
            total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        } else if (format == FLOAT32) {
            fma_walk_rest(data, first, last, end, ahead_bytes, FLOAT32, rounds, rest, &total);
        } else if (format == BFLOAT16) {
            fma_walk_rest(data, first, last, end, ahead_bytes, BFLOAT16, rounds, rest, &total);
        } else {
            fma_walk_rest(data, first, last, end, ahead_bytes, FLOAT16, rounds, rest, &total);
        }
        for (int lane = 0; lane < LANES; ++lane) sink += total[lane];
    }
    const double seconds = omp_get_wtime() - start;
    if (sink == 12345.0f) return 0.0;
    return (double)(blocks * block_bytes) / seconds / 1e9;
}

double read_gbytes_per_s(const float* data, size_t count, int threads, long ahead_bytes) {
    return stream((const char*)data, count, FLOAT32, threads, ahead_bytes, 0);
}

double read_with_fmas_gbytes_per_s(const float* data, size_t count, int threads, long ahead_bytes,
                                   int fmas_per_vector) {
    return stream((const char*)data, count, FLOAT32, threads, ahead_bytes, fmas_per_vector);
}

/* `count` 16-bit elements at `data`; float16 (is_float16 != 0) or bfloat16; at least one FMA a
 * vector (stream's plain sum reads float32). */
double read_half_with_fmas_gbytes_per_s(const uint16_t* data, size_t count, int is_float16, int threads,
                                        long ahead_bytes, int fmas_per_vector) {
#if !defined(__F16C__) && !defined(__AVX512F__)
    if (is_float16) return 0.0;
#endif
    return stream((const char*)data, count, is_float16 ? FLOAT16 : BFLOAT16, threads, ahead_bytes,
                  fmas_per_vector < 1 ? 1 : fmas_per_vector);
}
