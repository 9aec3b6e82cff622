/* The CPU kernels' work items timed without Python, for A/B tests of kernel changes (kernel_ab.py
 * builds this against two source trees and alternates them).  It includes the kernel headers of
 * one instruction-set level and calls run_item on items laid out as fastattn's planner lays them
 * out, so a change to a header shows in seconds of compiling instead of a build of every level.
 *
 *   decode DTYPE PLACE REPS [QUERIES]
 *                             C6's shape (64 (b, kv head) items of 4096 keys, GQA 4, D 128; QUERIES
 *                             positions, 1 by default: 4 is C6q4's 16 rows an item), DTYPE float32,
 *                             bfloat16 or float16; PLACE "stream": every item once on 2 OpenMP
 *                             threads, back to back as bench_cpu.py times C6 (K and V 134-268 MB,
 *                             on huge pages as numpy gives them, HugePages);
 *                             "cache": 2 kv heads of 512 keys, one thread, 200 times a repeat (K and
 *                             V in L2: the arithmetic alone); "l3": 16 kv heads of 1024 keys on 2
 *                             threads, 20 times a repeat (K and V 8-16 MB: in L3 after the first
 *                             call, out of both L2s, as a short context's cache lies when each
 *                             decode step reads it again).  Prints ns a key (median).
 *   forward H S D CAUSAL REPS [MASK [THREADS [DTYPE [GROUP]]]]
 *                             forward of B 1, H query heads (H / GROUP kv heads; GROUP 1 by
 *                             default, 4 for C5's GQA), S positions and keys, head size D, in DTYPE
 *                             (float32 by default, bfloat16 or float16), 64 query rows an item
 *                             (64 / GROUP positions of each head of a group) and 128-key tiles as
 *                             the planner takes them, on THREADS OpenMP threads (1 by default);
 *                             MASK "float" or "bool" adds a full (1, H, S, S) mask (a random bias
 *                             in DTYPE, or ~10% of keys hidden at random), "none" (the default)
 *                             none.  Prints GFLOP/s (median).
 *
 * Every line also prints a checksum of the output, which two trees that should agree bit for bit
 * must print alike. */
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <omp.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "flash_amx.h" /* with flash_bf16.h and forward_items.h: every level's kernels */

using namespace fastattn;
using namespace fastattn::FASTATTN_ISA_NAMESPACE;

namespace {

/* A deterministic value in [-1, 1) from a counter: inputs equal in every build. */
float draw(uint64_t i) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return (float)((x >> 40) * (2.0 / 16777216.0) - 1.0);
}

template <typename In> In stored(float x) {
    if constexpr (std::is_same<In, float>::value)
        return x;
    else
        return Store<In>::from(x);
}

template <typename In> double as_double(In x) {
    if constexpr (std::is_same<In, float>::value)
        return x;
    else
        return to_float(x);
}

/* numpy asks the kernel for transparent huge pages on blocks of 4 MiB or more (madvise
 * MADV_HUGEPAGE, where THP is "madvise"), and bench_cpu.py's K and V are numpy's: the decode's
 * streamed K and V get the same here, so that their TLB misses and prefetch reach match the
 * package's.  On a 2-core Zen 1 (EPYC family 23 model 1) 4 KiB pages made the float32 stream
 * 1.4-1.6x slower (72-88 against 49-56 ns a key) and a plain 2-thread streaming read 1.3x slower
 * (19.3 against 25 GB/s): the hardware prefetchers stop at each 4 KiB page. */
template <typename T> struct HugePages {
    typedef T value_type;
    HugePages() = default;
    template <typename U> HugePages(const HugePages<U>&) {}
    T* allocate(size_t n) {
        const size_t huge = size_t(2) << 20, bytes = (n * sizeof(T) + huge - 1) / huge * huge;
        void* block = std::aligned_alloc(huge, bytes);
        if (block == nullptr) throw std::bad_alloc();
        if (bytes >= (size_t(4) << 20)) madvise(block, bytes, MADV_HUGEPAGE);
        return static_cast<T*>(block);
    }
    void deallocate(T* block, size_t) { std::free(block); }
};
template <typename T, typename U> bool operator==(const HugePages<T>&, const HugePages<U>&) { return true; }
template <typename T, typename U> bool operator!=(const HugePages<T>&, const HugePages<U>&) { return false; }

double median(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    return values[values.size() / 2];
}

double seconds(const std::chrono::steady_clock::time_point& start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/* Strides of a contiguous (B, H, S, D) array, in elements, for FwdParams. */
void contiguous(int64_t* stride, int64_t heads, int64_t positions, int64_t dim) {
    stride[0] = heads * positions * dim;
    stride[1] = positions * dim;
    stride[2] = dim;
}

FwdParams params(int dtype, int64_t heads_kv, int64_t group, int64_t seq_q, int64_t seq_k, int64_t dim,
                 int64_t block_queries, const void* q, const void* k, const void* v, void* out, float* lse) {
    FwdParams p{};
    p.q = static_cast<const char*>(q);
    p.k = static_cast<const char*>(k);
    p.v = static_cast<const char*>(v);
    p.out = static_cast<char*>(out);
    p.lse = reinterpret_cast<char*>(lse);
    contiguous(p.q_stride, heads_kv * group, seq_q, dim);
    contiguous(p.out_stride, heads_kv * group, seq_q, dim);
    contiguous(p.k_stride, heads_kv, seq_k, dim);
    contiguous(p.v_stride, heads_kv, seq_k, dim);
    contiguous(p.lse_stride, heads_kv * group, seq_q, 1);
    p.batch = 1;
    p.heads_q = heads_kv * group;
    p.heads_kv = heads_kv;
    p.seq_q = seq_q;
    p.seq_k = seq_k;
    p.head_dim = p.head_dim_v = dim;
    p.group = group;
    p.dtype = dtype;
    p.scale = 1.0 / std::sqrt((double)dim);
    p.window_left = p.window_right = -1;
    p.offset = seq_k - seq_q;
    p.block_queries = block_queries;
    p.query_blocks = (seq_q + block_queries - 1) / block_queries;
    p.key_tile = 128;
    p.splits = 1;
    p.head_group = 1;
    return p;
}

/* Every work item of p once, on one OpenMP thread per scratch buffer (kept between calls, as the
 * package keeps it), dynamically scheduled as the package schedules them. */
template <typename In> void run_items(const FwdParams& p, std::vector<std::vector<char>>& scratch) {
#pragma omp parallel num_threads((int)scratch.size())
    {
        char* own = scratch[omp_get_thread_num()].data();
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < forward_items(p); ++item) run_item<float, In>(p, own, item);
    }
}

/* Where decode's K and V lie while it reads them (see the usage above): the kv heads and keys that
 * put them there, the calls a repeat and the threads. */
struct Place {
    int64_t heads, keys;
    int calls, threads;
};
constexpr Place kStream{64, 4096, 1, 2}, kCache{2, 512, 200, 1}, kL3{16, 1024, 20, 2};

template <typename In> void decode(int dtype, const Place& place, int repeats, int64_t queries) {
    const int64_t group = 4, dim = 128, heads = place.heads, keys = place.keys;
    const int calls = place.calls, threads = place.threads;
    std::vector<In> q(heads * group * queries * dim), out(q.size());
    /* K and V 16 bytes past a line, as numpy places large arrays (its allocation header): rows of
     * 128 elements then span one line more than they fill, as the package's do. */
    const int64_t elements = heads * keys * dim, past_line = 16 / (int64_t)sizeof(In);
    std::vector<In, HugePages<In>> k_memory(elements + past_line), v_memory(elements + past_line);
    In* const k = k_memory.data() + past_line;
    In* const v = v_memory.data() + past_line;
    std::vector<float> lse(heads * group * queries);
    for (size_t i = 0; i < q.size(); ++i) q[i] = stored<In>(draw(i));
    for (int64_t i = 0; i < elements; ++i) {
        k[i] = stored<In>(draw(i + q.size()));
        v[i] = stored<In>(draw(i + q.size() + elements));
    }
    int nonfinite = 0;
    FwdParams p = params(dtype, heads, group, queries, keys, dim, queries, q.data(), k, v, out.data(),
                         lse.data());
    p.nonfinite_output = &nonfinite;
    std::vector<std::vector<char>> scratch(threads, std::vector<char>(4 << 20)); /* kept, as the package keeps it */
    std::vector<double> times;
    for (int r = 0; r < repeats; ++r) {
        const auto start = std::chrono::steady_clock::now();
        for (int c = 0; c < calls; ++c) {
            run_items<In>(p, scratch);
        }
        times.push_back(seconds(start) / calls);
    }
    double checksum = 0;
    for (const In& x : out) checksum += as_double(x);
    std::printf("%.3f ns a key  checksum %.9g\n", median(times) / (heads * keys) * 1e9, checksum);
}

/* The mask kind of a float mask in the inputs' dtype In. */
template <typename In> constexpr int float_mask_kind() {
    return std::is_same<In, float>::value ? MASK_FLOAT32 : std::is_same<In, bfloat16_bits>::value ? MASK_BFLOAT16 : MASK_FLOAT16;
}

/* A full (1, H, S, S) mask of `kind` ("float": values in [-1, 1) in the inputs' dtype In, as
 * bench_cpu.py's float-full; "bool": ~10% of keys hidden at random positions, its bool-full), its
 * keys contiguous, or none ("none"). */
template <typename In> struct FullMask {
    std::vector<In, HugePages<In>> values; /* on huge pages, as numpy gives a mask this large */
    std::vector<uint8_t, HugePages<uint8_t>> visible;
    int kind = MASK_NONE;

    FullMask(const std::string& name, int64_t elements, uint64_t seed) {
        if (name == "float") {
            kind = float_mask_kind<In>();
            values.resize(elements);
            for (int64_t i = 0; i < elements; ++i) values[i] = stored<In>(draw(i + seed));
        } else if (name == "bool") {
            kind = MASK_BOOL;
            visible.resize(elements);
            for (int64_t i = 0; i < elements; ++i) visible[i] = draw(i + seed) >= -0.8f;
        } else if (name != "none") {
            throw std::invalid_argument("mask: none, float or bool");
        }
    }

    void apply(FwdParams& p, int64_t heads, int64_t positions) const {
        p.mask_kind = kind;
        if (kind == MASK_NONE) return;
        p.mask = kind == MASK_BOOL ? reinterpret_cast<const char*>(visible.data())
                                   : reinterpret_cast<const char*>(values.data());
        p.mask_stride[0] = heads * positions * positions;
        p.mask_stride[1] = positions * positions;
        p.mask_stride[2] = positions;
        p.mask_stride[3] = 1;
    }
};

template <typename In>
void forward(int dtype, int64_t heads, int64_t positions, int64_t dim, bool causal, int repeats,
             const std::string& mask_name, int threads, int64_t group) {
    std::vector<In> q(heads * positions * dim), k(q.size() / group), v(k.size()), out(q.size());
    std::vector<float> lse(heads * positions);
    for (size_t i = 0; i < q.size(); ++i) q[i] = stored<In>(draw(i));
    for (size_t i = 0; i < k.size(); ++i) {
        k[i] = stored<In>(draw(i + q.size()));
        v[i] = stored<In>(draw(i + 2 * q.size()));
    }
    const FullMask<In> mask(mask_name, heads * positions * positions, 3 * q.size());
    int nonfinite = 0;
    FwdParams p = params(dtype, heads / group, group, positions, positions, dim, 64 / group, q.data(), k.data(),
                         v.data(), out.data(), lse.data());
    p.causal = causal;
    p.nonfinite_output = &nonfinite;
    mask.apply(p, heads, positions);
    std::vector<std::vector<char>> scratch(threads, std::vector<char>(8 << 20));
    std::vector<double> times;
    for (int r = 0; r < repeats; ++r) {
        const auto start = std::chrono::steady_clock::now();
        run_items<In>(p, scratch);
        times.push_back(seconds(start));
    }
    const double flops = 4.0 * heads * positions * positions * dim / (causal ? 2 : 1);
    double checksum = 0;
    for (const In& x : out) checksum += as_double(x);
    std::printf("%.2f GFLOP/s  checksum %.9g\n", flops / median(times) / 1e9, checksum);
}

int usage() {
    std::fprintf(stderr, "usage: kernel_ab decode float32|bfloat16|float16 stream|cache|l3 REPS [QUERIES]\n"
                         "       kernel_ab forward H S D CAUSAL(0|1) REPS [none|float|bool [THREADS [DTYPE [GROUP]]]]\n");
    return 2;
}

}  // namespace

int main(int argc, char** argv) {
#if defined(FASTATTN_HAS_AMX)
    /* Linux lends the tile registers to a process that asks (dispatch.h's os_grants_amx). */
    const long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
    if (syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) != 0) {
        std::fprintf(stderr, "the kernel did not grant the AMX tile registers\n");
        return 1;
    }
#endif
    if ((argc == 5 || argc == 6) && std::string(argv[1]) == "decode") {
        const std::string dtype = argv[2], place = argv[3];
        const int repeats = std::atoi(argv[4]);
        const int64_t queries = argc == 6 ? std::atoi(argv[5]) : 1;
        if (queries < 1) return usage();
        if (place != "stream" && place != "cache" && place != "l3") return usage();
        const Place& where = place == "stream" ? kStream : place == "cache" ? kCache : kL3;
        if (dtype == "float32")
            decode<float>(DTYPE_FLOAT32, where, repeats, queries);
        else if (dtype == "bfloat16")
            decode<bfloat16_bits>(DTYPE_BFLOAT16, where, repeats, queries);
        else if (dtype == "float16")
            decode<half_bits>(DTYPE_FLOAT16, where, repeats, queries);
        else
            return usage();
        return 0;
    }
    if (argc >= 7 && argc <= 11 && std::string(argv[1]) == "forward") {
        const std::string mask = argc >= 8 ? argv[7] : "none", dtype = argc >= 10 ? argv[9] : "float32";
        const int threads = argc >= 9 ? std::atoi(argv[8]) : 1;
        const int64_t group = argc == 11 ? std::atoi(argv[10]) : 1;
        if ((mask != "none" && mask != "float" && mask != "bool") || threads < 1) return usage();
        const int64_t heads = std::atoi(argv[2]), positions = std::atoi(argv[3]), dim = std::atoi(argv[4]);
        if (group < 1 || heads % group != 0 || 64 % group != 0) return usage();
        const bool causal = std::atoi(argv[5]) != 0;
        const int repeats = std::atoi(argv[6]);
        if (dtype == "float32")
            forward<float>(DTYPE_FLOAT32, heads, positions, dim, causal, repeats, mask, threads, group);
        else if (dtype == "bfloat16")
            forward<bfloat16_bits>(DTYPE_BFLOAT16, heads, positions, dim, causal, repeats, mask, threads, group);
        else if (dtype == "float16")
            forward<half_bits>(DTYPE_FLOAT16, heads, positions, dim, causal, repeats, mask, threads, group);
        else
            return usage();
        return 0;
    }
    return usage();
}
