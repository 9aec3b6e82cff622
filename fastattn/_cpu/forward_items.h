/* The forward's work items and their dispatch: the items' order (decode_item), which kernel runs an
 * item (forward_kernel_of), float16/bfloat16 K and V converted once per call, the head-group decode
 * (forward_heads), one item (run_item) and the split-KV combine (combine_item).
 *
 * Decode (few query rows, few items): the keys are split across threads (`splits`), each split
 * writes its normalised partial output and lse, and `fa_forward_combine` merges them by lse.
 */
#ifndef FASTATTN_FORWARD_ITEMS_H
#define FASTATTN_FORWARD_ITEMS_H

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "flash_decode.h"
#include "flash_forward.h"

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

struct ItemIndex {
    int64_t b, kvh, qb, split;
};

/* The items of one (b, kv head) are consecutive, so the threads, which take items in order, work
 * on one head's K and V together and find them in cache (all heads' K/V together can be several
 * times L3: sweeping every head for each query block would read them from memory again and again).
 * Within a head the heaviest come first: under causal masking the last query blocks see the most
 * keys. */
static inline ItemIndex decode_item(const FwdParams& p, int64_t item) {
    ItemIndex index;
    index.split = item % p.splits;
    item /= p.splits;
    index.qb = p.query_blocks - 1 - item % p.query_blocks;
    item /= p.query_blocks;
    index.kvh = item % forward_head_groups(p) * forward_head_group(p); /* the group's first head */
    index.b = item / forward_head_groups(p);
    return index;
}

static inline int64_t split_length(const FwdParams& p) {
    return round_up((p.seq_k + p.splits - 1) / p.splits, p.key_tile);
}

#if defined(FASTATTN_HAS_AVX512BF16)
/* bfloat16 items on AVX512_BF16 vectors: flash_bf16.h, which the kernels_forward*.cpp include. */
static bool dpbf16_forward_applies(const FwdParams& p, int64_t rows);
static void forward_block_dpbf16(const FwdParams& p, char* scratch, int64_t b, int64_t kvh, int64_t q0, int64_t qn,
                                 int64_t k_begin, int64_t k_end, float* partial_out, float* partial_lse);
static bool dpbf16_decode_applies(const FwdParams& p, int64_t rows);
static void forward_decode_dpbf16(const FwdParams& p, char* scratch, int64_t b, int64_t kvh, int64_t q0, int64_t qn,
                                  int64_t k_begin, int64_t k_end, float* partial_out, float* partial_lse);
#endif
#if defined(FASTATTN_HAS_AMX)
/* bfloat16 items on AMX tiles, and float16 forward items as bfloat16 parts: flash_amx.h, which the
 * kernels_forward*.cpp include (active at the AMX level). */
static bool amx_forward_applies(const FwdParams& p, int64_t rows);
static void forward_block_amx(const FwdParams& p, char* scratch, int64_t b, int64_t kvh, int64_t q0, int64_t qn,
                              int64_t k_begin, int64_t k_end, float* partial_out, float* partial_lse);
static bool amx_decode_applies(const FwdParams& p, int64_t rows);
static void forward_decode_amx(const FwdParams& p, char* scratch, int64_t b, int64_t kvh, int64_t q0, int64_t qn,
                               int64_t k_begin, int64_t k_end, float* partial_out, float* partial_lse);
#endif

/* Which kernel runs a forward item of `rows` stacked query rows: the one rule, which the kernel
 * table also answers (the planner picks its tile sizes by it, the tests check it). */
enum ForwardKernel {
    KERNEL_VECTOR,
    KERNEL_VECTOR_DECODE,
    KERNEL_DPBF16,
    KERNEL_DPBF16_DECODE,
    KERNEL_AMX,
    KERNEL_AMX_DECODE
};

static inline ForwardKernel forward_kernel_of(const FwdParams& p, int64_t rows) {
#if defined(FASTATTN_HAS_AMX)
    if (p.dtype == DTYPE_BFLOAT16 && amx_decode_applies(p, rows)) return KERNEL_AMX_DECODE;
    if ((p.dtype == DTYPE_BFLOAT16 || p.dtype == DTYPE_FLOAT16) && amx_forward_applies(p, rows)) return KERNEL_AMX;
#elif defined(FASTATTN_HAS_AVX512BF16)
    if (p.dtype == DTYPE_BFLOAT16 && dpbf16_forward_applies(p, rows)) return KERNEL_DPBF16;
    if (p.dtype == DTYPE_BFLOAT16 && dpbf16_decode_applies(p, rows)) return KERNEL_DPBF16_DECODE;
#endif
    return rows <= kDotMaxRows ? KERNEL_VECTOR_DECODE : KERNEL_VECTOR;
}

/* ---- K and V converted once per call ----------------------------------------------------------
 *
 * forward_block converts float16/bfloat16 K tiles (and, without kValuesByRow, V tiles) into its
 * scratch, so every query block of a kv head converted the same tiles again: float16 and bfloat16
 * C1-C5 ran 3-20% slower than float32 (2-core Zen 3, AVX2; after, 2-3% in one process for C1/C2,
 * 0.85-1.14x of float32's time in bench_cpu.py for C1-C5, within that host's noise).  With
 * kValuesByRow, reading V rows in place by row and converting K per tile ran 9-18% slower than
 * float32 (2-core Xeon, family 6 model 207, AVX-512: C1, C3, C4; one process, dtypes interleaved);
 * converted once and read as float32 tiles, 0.92-1.07 of float32's time.  Where those items run
 * and a kv head has several query blocks, a pass before the items converts each (b, kv head, key
 * tile) once into packed_kv (converted_keys, converted_values), and the items read float32 rows in
 * place, as for float32 inputs.  Keys at or past the batch row's key_lengths are never read and are
 * not converted.  The copies take 4 B Hkv Sk (D + Dv) bytes, twice the inputs' K and V, and the
 * calling thread keeps the block for its next call (thread_scratch.h): above kConvertedKvMaxBytes
 * the items convert per tile as before. */
constexpr size_t kConvertedKvMaxBytes = size_t(64) << 20;

static inline size_t converted_kv_bytes(const FwdParams& p) {
    return sizeof(float) * (size_t)(p.batch * p.heads_kv * p.seq_k * (p.head_dim + p.head_dim_v));
}

static inline bool converts_kv_once(const FwdParams& p) {
    if (!kConvertsKvOnce || (p.dtype != DTYPE_FLOAT16 && p.dtype != DTYPE_BFLOAT16)) return false;
    if (p.splits != 1 || forward_head_group(p) > 1 || p.query_blocks < 2) return false;
    return forward_kernel_of(p, p.group * std::min(p.block_queries, p.seq_q)) == KERNEL_VECTOR &&
           converted_kv_bytes(p) <= kConvertedKvMaxBytes;
}

static inline int64_t converted_tiles(const FwdParams& p) { return (p.seq_k + p.key_tile - 1) / p.key_tile; }

/* The pass's item: one (b, kv head, key tile). */
template <typename T, typename In> static void convert_kv_item(const FwdParams& p, int64_t item) {
    if constexpr (!std::is_same<T, In>::value) {
        const int64_t tile = item % converted_tiles(p), kvh = item / converted_tiles(p) % p.heads_kv;
        const int64_t b = item / (converted_tiles(p) * p.heads_kv), kt = tile * p.key_tile;
        const int64_t end = p.key_lengths ? std::min(p.seq_k, p.key_lengths[b]) : p.seq_k;
        const int64_t n = std::min(p.key_tile, end - kt), D = p.head_dim, Dv = p.head_dim_v;
        const In* k = at<In>(p.k, b * p.k_stride[0] + kvh * p.k_stride[1] + kt * p.k_stride[2]);
        const In* v = at<In>(p.v, b * p.v_stride[0] + kvh * p.v_stride[1] + kt * p.v_stride[2]);
        T* k_out = converted_keys<T>(p, b, kvh) + kt * D;
        T* v_out = converted_values<T>(p, b, kvh) + kt * Dv;
        for (int64_t j = 0; j < n; ++j) {
            convert_row(k + j * p.k_stride[2], k_out + j * D, D);
            convert_row(v + j * p.v_stride[2], v_out + j * Dv, Dv);
        }
    } else {
        (void)p;
        (void)item;
    }
}

/* Where head kvh's rows of item `index` go when the keys are split (slot (b, kvh, qb, split) of the
 * partials, their lse reset to -inf), else nullptr. */
template <typename T>
static inline void split_partials(const FwdParams& p, const ItemIndex& index, int64_t kvh, T** out, T** lse) {
    *out = *lse = nullptr;
    if (p.splits <= 1) return;
    const int64_t rows = p.group * p.block_queries;
    const int64_t slot = ((index.b * p.heads_kv + kvh) * p.query_blocks + index.qb) * p.splits + index.split;
    *out = reinterpret_cast<T*>(p.partial_out) + slot * rows * p.head_dim_v;
    *lse = reinterpret_cast<T*>(p.partial_lse) + slot * rows;
    for (int64_t r = 0; r < rows; ++r) (*lse)[r] = -std::numeric_limits<T>::infinity();
}

/* The decode over a group of kv heads (p.head_group > 1), for token-major K and V, (B, S, H, D):
 * there a head's consecutive tokens lie H * D elements apart, and a head-by-head sweep reads a
 * few lines of every token row: on a 2-core Zen 5 a plain streaming read in that pattern (one
 * head's 256-byte rows 2 KB apart) reaches 29-33 GB/s where a contiguous one reaches 48-65.  Here
 * each key tile runs head after head (a Kernel::Head apiece: its rows' scratch and softmax state,
 * the head's state in the first kHeadStateBytes of its room), and while head g computes, the
 * prefetcher takes the g-th share of the next tile's token rows, which hold every head of the group
 * back to back: the memory sees one contiguous run per tile.  Where the group's rows are not one
 * run (other strides) each head prefetches the next head's tile.  Kernel: DotKernel (float32 vectors)
 * or PairKernel (flash_bf16.h, `vdpbf16ps`), each with start / tile / finish and its scratch bytes. */
template <typename Kernel>
static void forward_heads(const FwdParams& p, char* scratch, const ItemIndex& index, int64_t heads, int64_t q0,
                          int64_t qn, int64_t k_begin, int64_t k_end) {
    typedef typename Kernel::Head Head;
    typedef typename Kernel::In In;
    typedef typename Kernel::T T;
    static_assert(sizeof(Head) <= (size_t)kHeadStateBytes, "a head's state outgrew its room");
    const int64_t N = p.key_tile, element = (int64_t)sizeof(In), b = index.b, first = index.kvh;
    const int64_t room = kHeadStateBytes + Kernel::scratch_bytes(p);
    Head* group[kMaxHeadGroup];
    for (int64_t g = 0; g < heads; ++g) {
        group[g] = new (scratch + g * room) Head();
        Kernel::start(p, *group[g], scratch + g * room + kHeadStateBytes, b, first + g, q0, qn);
    }
    const bool one_run = p.k_stride[1] == p.head_dim && p.v_stride[1] == p.head_dim_v &&
                         p.k_stride[2] == heads * p.head_dim && p.v_stride[2] == heads * p.head_dim_v;
    for (int sweep = 0; sweep < key_sweeps(p); ++sweep) {
        if (sweep > 0)
            for (int64_t g = 0; g < heads; ++g) Kernel::restart(p, *group[g]);
        int64_t lo, hi;
        sweep_visible_keys(p, sweep, b, q0, qn, k_begin, k_end, &lo, &hi);
        for (int64_t kt = lo; kt < hi; kt += N) {
            const int64_t n = std::min(N, hi - kt), next_n = kt + N < hi ? std::min(N, hi - kt - N) : 0;
            const char* k_next = p.k + (b * p.k_stride[0] + first * p.k_stride[1] + (kt + N) * p.k_stride[2]) * element;
            const char* v_next = p.v + (b * p.v_stride[0] + first * p.v_stride[1] + (kt + N) * p.v_stride[2]) * element;
            const int64_t k_bytes = next_n * p.k_stride[2] * element, v_bytes = next_n * p.v_stride[2] * element;
            for (int64_t g = 0; g < heads; ++g) {
                if (p.mask_kind != MASK_NONE && mask_hides_tile(p, b, first + g, q0, qn, kt, n)) continue;
                if (one_run) {
                    Kernel::tile(p, *group[g], b, q0, qn, kt, n,
                                 SpreadPrefetch<In>(k_next + k_bytes * g / heads, k_next + k_bytes * (g + 1) / heads,
                                                    v_next + v_bytes * g / heads, v_next + v_bytes * (g + 1) / heads));
                } else {
                    const bool last = g + 1 == heads;
                    Kernel::tile(p, *group[g], b, q0, qn, kt, n,
                                 SpreadPrefetch<In>(p, b, last ? first : first + g + 1, last ? kt + N : kt,
                                                    last ? next_n : n));
                }
            }
        }
    }
    for (int64_t g = 0; g < heads; ++g) {
        T* partial_out;
        T* partial_lse;
        split_partials(p, index, first + g, &partial_out, &partial_lse);
        Kernel::finish(p, *group[g], b, partial_out, partial_lse);
    }
}

/* forward_heads' view of the vector decode (dot_start, dot_tile, dot_finish). */
template <typename T_, typename In_, int R> struct DotKernel {
    typedef T_ T;
    typedef In_ In;
    typedef DotHead<T, R> Head;
    static int64_t scratch_bytes(const FwdParams& p) {
        return round_up(dot_head_elements<T>(p, R) * (int64_t)sizeof(T), 64);
    }
    static void start(const FwdParams& p, Head& h, char* room, int64_t b, int64_t kvh, int64_t q0, int64_t qn) {
        dot_start<T, In, R>(p, h, reinterpret_cast<T*>(room), b, kvh, q0, qn);
    }
    static void tile(const FwdParams& p, Head& h, int64_t b, int64_t q0, int64_t qn, int64_t kt, int64_t n,
                     const SpreadPrefetch<In>& next) {
        dot_tile<T, In, R>(p, h, b, q0, qn, kt, n, next);
    }
    /* Empty sums and accumulators, the running maxima kept (key_sweeps' second walk). */
    static void restart(const FwdParams& p, Head& h) {
        std::memset(h.o, 0, sizeof(T) * R * p.head_dim_v);
        std::fill(h.row_sum, h.row_sum + R, T(0));
    }
    static void finish(const FwdParams& p, Head& h, int64_t b, T* partial_out, T* partial_lse) {
        dot_finish<T, In, R>(p, h, b, partial_out, partial_lse);
    }
};

#if defined(FASTATTN_HAS_AVX512BF16) && !defined(FASTATTN_HAS_AMX)
/* A group of kv heads on `vdpbf16ps` (flash_bf16.h: forward_heads with PairKernel). */
static void forward_heads_dpbf16(const FwdParams& p, char* scratch, const ItemIndex& index, int64_t heads, int64_t q0,
                                 int64_t qn, int64_t k_begin, int64_t k_end);
#endif

/* One kv head's rows of an item on Kernel's steps (DotKernel, PairKernel), each tile prefetching the
 * next tile's rows over its work. */
template <typename Kernel>
static void forward_head(const FwdParams& p, char* scratch, int64_t b, int64_t kvh, int64_t q0, int64_t qn,
                         int64_t k_begin, int64_t k_end, typename Kernel::T* partial_out,
                         typename Kernel::T* partial_lse) {
    typedef typename Kernel::In In;
    const int64_t N = p.key_tile;
    typename Kernel::Head h;
    Kernel::start(p, h, scratch, b, kvh, q0, qn);
    for (int sweep = 0; sweep < key_sweeps(p); ++sweep) {
        if (sweep > 0) Kernel::restart(p, h);
        int64_t lo, hi;
        sweep_visible_keys(p, sweep, b, q0, qn, k_begin, k_end, &lo, &hi);
        for (int64_t kt = lo; kt < hi; kt += N) {
            const int64_t n = std::min(N, hi - kt);
            if (p.mask_kind != MASK_NONE && mask_hides_tile(p, b, kvh, q0, qn, kt, n)) continue;
            Kernel::tile(p, h, b, q0, qn, kt, n,
                         SpreadPrefetch<In>(p, b, kvh, kt + N, kt + N < hi ? std::min(N, hi - kt - N) : 0));
        }
    }
    Kernel::finish(p, h, b, partial_out, partial_lse);
}

/* One kv head's rows of an item, on the kernel the rule picks (the pair kernels take bfloat16, and
 * at the AMX level float16 forward items: forward_kernel_of says which). */
template <typename T, typename In>
static void run_head(const FwdParams& p, char* scratch, int64_t b, int64_t kvh, int64_t q0, int64_t qn,
                     int64_t k_begin, int64_t k_end, T* partial_out, T* partial_lse) {
#if defined(FASTATTN_HAS_AVX512BF16)
    if constexpr (std::is_same<In, bfloat16_bits>::value || std::is_same<In, half_bits>::value) {
        switch (forward_kernel_of(p, p.group * qn)) {
#if defined(FASTATTN_HAS_AMX)
            case KERNEL_AMX:
                return forward_block_amx(p, scratch, b, kvh, q0, qn, k_begin, k_end, partial_out, partial_lse);
            case KERNEL_AMX_DECODE:
                return forward_decode_amx(p, scratch, b, kvh, q0, qn, k_begin, k_end, partial_out, partial_lse);
#else
            case KERNEL_DPBF16:
                return forward_block_dpbf16(p, scratch, b, kvh, q0, qn, k_begin, k_end, partial_out, partial_lse);
            case KERNEL_DPBF16_DECODE:
                return forward_decode_dpbf16(p, scratch, b, kvh, q0, qn, k_begin, k_end, partial_out, partial_lse);
#endif
            default: break;
        }
    }
#endif
    T* buffer = reinterpret_cast<T*>(scratch);
    switch (p.group * qn) {
#define FASTATTN_DOT_CASE(R) \
    case R:                  \
        return forward_head<DotKernel<T, In, R>>(p, scratch, b, kvh, q0, qn, k_begin, k_end, partial_out, partial_lse);
        FASTATTN_DOT_CASE(1) FASTATTN_DOT_CASE(2) FASTATTN_DOT_CASE(3) FASTATTN_DOT_CASE(4)
        FASTATTN_DOT_CASE(5) FASTATTN_DOT_CASE(6) FASTATTN_DOT_CASE(7) FASTATTN_DOT_CASE(8)
#undef FASTATTN_DOT_CASE
        default: break;
    }
    if (RowShape<T>(p.group * qn).nv == 1)
        forward_block<T, In, 1>(p, buffer, b, kvh, q0, qn, k_begin, k_end, partial_out, partial_lse);
    else
        forward_block<T, In, 2>(p, buffer, b, kvh, q0, qn, k_begin, k_end, partial_out, partial_lse);
}

template <typename T, typename In>
static void run_item(const FwdParams& p, char* scratch, int64_t item) {
    const ItemIndex index = decode_item(p, item);
    const int64_t q0 = index.qb * p.block_queries;
    const int64_t qn = std::min(p.block_queries, p.seq_q - q0);
    int64_t k_begin = 0, k_end = p.seq_k;
    if (p.splits > 1) {
        k_begin = index.split * split_length(p);
        k_end = std::min(p.seq_k, k_begin + split_length(p));
    }
    const int64_t heads = std::min(forward_head_group(p), p.heads_kv - index.kvh);
#if defined(FASTATTN_HAS_AVX512BF16) && !defined(FASTATTN_HAS_AMX)
    if constexpr (std::is_same<In, bfloat16_bits>::value)
        if (heads > 1 && forward_kernel_of(p, p.group * qn) == KERNEL_DPBF16_DECODE)
            return forward_heads_dpbf16(p, scratch, index, heads, q0, qn, k_begin, k_end);
#endif
    if (heads > 1 && forward_kernel_of(p, p.group * qn) == KERNEL_VECTOR_DECODE) {
        switch (p.group * qn) {
#define FASTATTN_HEADS_CASE(R) \
    case R: return forward_heads<DotKernel<T, In, R>>(p, scratch, index, heads, q0, qn, k_begin, k_end);
            FASTATTN_HEADS_CASE(1) FASTATTN_HEADS_CASE(2) FASTATTN_HEADS_CASE(3) FASTATTN_HEADS_CASE(4)
            FASTATTN_HEADS_CASE(5) FASTATTN_HEADS_CASE(6) FASTATTN_HEADS_CASE(7) FASTATTN_HEADS_CASE(8)
#undef FASTATTN_HEADS_CASE
            default: break;
        }
    }
    for (int64_t kvh = index.kvh; kvh < index.kvh + heads; ++kvh) {
        T* partial_out;
        T* partial_lse;
        split_partials(p, index, kvh, &partial_out, &partial_lse);
        run_head<T, In>(p, scratch, index.b, kvh, q0, qn, k_begin, k_end, partial_out, partial_lse);
    }
}

/* Merge the splits of one (b, kv head, query block) by their lse. */
template <typename T, typename In>
static void combine_item(const FwdParams& p, int64_t index) {
    const int64_t qb = index % p.query_blocks, bk = index / p.query_blocks;
    const int64_t b = bk / p.heads_kv, kvh = bk % p.heads_kv;
    const int64_t q0 = qb * p.block_queries, qn = std::min(p.block_queries, p.seq_q - q0);
    const int64_t rows_alloc = p.group * p.block_queries, Dv = p.head_dim_v;
    T* parts = reinterpret_cast<T*>(p.partial_out) + index * p.splits * rows_alloc * Dv;
    const T* lses = reinterpret_cast<const T*>(p.partial_lse) + index * p.splits * rows_alloc;
    for (int64_t r = 0; r < p.group * qn; ++r) {
        const int64_t g = r / qn, i = q0 + r % qn, h = kvh * p.group + g;
        T top = -std::numeric_limits<T>::infinity();
        bool nan = false;
        for (int64_t sp = 0; sp < p.splits; ++sp) {
            top = std::max(top, lses[sp * rows_alloc + r]);
            nan = nan || std::isnan(lses[sp * rows_alloc + r]);
        }
        In* dst = reinterpret_cast<In*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
        T* lse_out = reinterpret_cast<T*>(p.lse) + b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2];
        if (nan) { /* a split saw a NaN score: the whole row is NaN, as without splits */
            for (int64_t c = 0; c < Dv; ++c) dst[c] = Store<In>::from(std::numeric_limits<T>::quiet_NaN());
            *lse_out = std::numeric_limits<T>::quiet_NaN();
            note_stored(p, *lse_out);
            continue;
        }
        if (top == -std::numeric_limits<T>::infinity()) {
            for (int64_t c = 0; c < Dv; ++c) dst[c] = Store<In>::from(T(0));
            *lse_out = top;
            continue;
        }
        /* Each split's share exp(lse - top) / total once a row; the merged row builds up in split 0's
         * partial (scratch), a vector pass per split.  A split that saw no key (share 0) is skipped:
         * its partial row may hold 0 * inf. */
        T total = 0;
        for (int64_t sp = 0; sp < p.splits; ++sp) total += std::exp(lses[sp * rows_alloc + r] - top);
        T* merged = parts + r * Dv;
        const T first = std::exp(lses[r] - top) / total;
        for (int64_t c = 0; c < Dv; ++c) merged[c] = first > 0 ? first * merged[c] : T(0);
        for (int64_t sp = 1; sp < p.splits; ++sp) {
            const T share = std::exp(lses[sp * rows_alloc + r] - top) / total;
            const T* part = parts + (sp * rows_alloc + r) * Dv;
            if (share > 0)
                for (int64_t c = 0; c < Dv; ++c) merged[c] += share * part[c];
        }
        for (int64_t c = 0; c < Dv; ++c) {
            note_stored(p, merged[c]);
            dst[c] = Store<In>::from(merged[c]);
        }
        *lse_out = top + std::log(total);
    }
}

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
