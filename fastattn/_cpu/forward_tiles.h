/* What every forward path (forward_block, the decode, the bfloat16 and AMX kernels) and the backward
 * share, on flash_forward.h's layouts: the non-finite bookkeeping and the rerun that skips zero
 * weights, tile shapes and scratch sizes, the next tile's prefetch spread over the arithmetic
 * (SpreadPrefetch), the keys a block of rows can see, the scores' softcap, edges and masks
 * (finish_scores), dropout, the K and V tiles' sources (KvTile), the output row (write_row) and
 * the online softmax over rows-as-lanes tiles. */
#ifndef FASTATTN_FORWARD_TILES_H
#define FASTATTN_FORWARD_TILES_H

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>

#include "isa.h"
#include "mask_tiles.h"
#include "params.h"
#include "philox.h"
#include "simd.h"
#include "visibility.h"

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

/* Non-finite inputs.  A product weight * value with weight exactly 0 (a hidden key, or exp
 * underflow) is 0 in exact arithmetic, but 0 * inf and 0 * NaN are NaN: a NaN in V at a key a
 * row cannot see would leak into that row, and only when the key shares a tile with visible ones.
 * The contract (the reference backend) skips such products.  Skipping costs a select per product,
 * so the kernels run without it first and record whether any stored result is non-finite; a leak
 * can only add NaN or infinity, so a finite result is already exact, and a non-finite one makes
 * the caller rerun with skip_zero_weights = 1.
 * A weight is the reference's exp(s - m) with m the row's maximum over all its keys, flushed to 0
 * below the smallest normal float; the online softmax weighs a tile's keys against the maximum so
 * far, so a key that underflows against the final maximum can have a weight above 0 in its own tile
 * (the maximum came later), and a NaN it carries stays in the accumulator however small the
 * rescale.  So the rerun walks the keys twice (key_sweeps): the first walk, over all of the row's
 * keys (every split's), leaves the final maximum in the running one; the sums and accumulators
 * are cleared, and the second walk weighs each key against the final maximum from its first tile,
 * where every rescale is exactly 1. */
static inline void note_nonfinite(const FwdParams& p) { __atomic_store_n(p.nonfinite_output, 1, __ATOMIC_RELAXED); }
static inline void note_stored(const FwdParams& p, double value) {
    if (!std::isfinite(value)) note_nonfinite(p);
}

/* Walks of an item's keys: 2 in the rerun that skips zero weights (see above), else 1. */
static inline int key_sweeps(const FwdParams& p) { return p.skip_zero_weights ? 2 : 1; }

template <typename T> constexpr int lanes() { return Vec<T>::lanes; }

/* exp(x) = 2^(x log2(e)): the softmax's exponentials go through vexp2_softmax. */
template <typename T> constexpr T kLog2e = (T)1.44269504088896340736;

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Rows of the tile (M) and their padded count (Mp, a multiple of the row block RB). */
template <typename T> struct RowShape {
    int64_t rows, padded, nv;
    RowShape(int64_t rows_) : rows(rows_) {
        nv = rows <= lanes<T>() ? 1 : 2;
        padded = round_up(rows, nv * lanes<T>());
    }
};

/* Bytes before each kv head's scratch in a head group's room (its state: forward_heads). */
constexpr int64_t kHeadStateBytes = 512;

/* Elements of one DotHead's scratch (flash_decode.h): q and q_blocks [rows][D] each, s [rows][N],
 * o [rows][Dv], k_block [L][D]. */
template <typename T> static inline int64_t dot_head_elements(const FwdParams& p, int64_t rows) {
    return rows * (2 * p.head_dim + p.key_tile + p.head_dim_v) + lanes<T>() * p.head_dim;
}

/* Enough for forward_block (rows-as-lanes) and DotKernel (<= 8 rows) alike, and for a group
 * of kv heads' states and scratch (forward_heads with DotKernel). */
template <typename T> static size_t scratch_elements(const FwdParams& p) {
    RowShape<T> shape(p.group * p.block_queries);
    int64_t mp = std::max<int64_t>(shape.padded, 8), n = p.key_tile;
    const int64_t one = mp * p.head_dim + n * mp + p.head_dim_v * mp + 3 * mp + n * (p.head_dim + p.head_dim_v) +
                        lanes<T>() * p.head_dim_v + 4 * lanes<T>();
    const int64_t rows = p.group * p.block_queries;
    const int64_t per_head =
        round_up(dot_head_elements<T>(p, rows), 64 / (int64_t)sizeof(T)) + kHeadStateBytes / (int64_t)sizeof(T);
    return (size_t)std::max(one, forward_head_group(p) * per_head);
}

/* The K and V rows of a tile, handed to the prefetcher a few cache lines per call, so that the
 * prefetches of the next tile interleave with the current tile's arithmetic.  Issued in one burst
 * they stall the core once the line fill buffers are full (the decode profile showed most of its
 * time on that burst): memory and arithmetic then take turns instead of overlapping.  Rows packed
 * back to back (a contiguous (B, H, S, D) cache) make the tile's K and its V one run of bytes each,
 * walked by a cursor apiece: a few instructions a line, where the row-by-row walk took a dozen and
 * a branch per line (the float32 decode spent ~15% of its time in cache on it).
 * The lines go to L2 (prefetcht1), not L1: a tile's K and V (64 KiB for 128 keys of D=Dv=128 in
 * bfloat16, 128 KiB in float32) outgrow L1, so the next tile's lines evicted the current tile's
 * before the arithmetic reached them; from L2 the L1's own prefetcher brings them in as the loops
 * walk the rows.  2-core Xeon model 207, builds alternated process by process, best of 5-7 calls
 * after a flush: C6 decodes 6-7% faster (bfloat16 6.87 -> 6.48 ms, float16 7.19 -> 6.67, float32
 * 11.37 -> 10.68), C6q4 4-5%, the token-major C6 16%; the forward of C1 and of a causal S=4096
 * D=128 (one thread) within 2%. */
template <typename In> struct SpreadPrefetch {
    const char* k;
    const char* v;
    int64_t k_stride, v_stride, k_lines, v_lines, keys;
    int64_t key = 0, line = 0;
    bool runs;
    const char* k_cursor;
    const char* k_end;
    const char* v_cursor;
    const char* v_end;

    SpreadPrefetch(const FwdParams& p, int64_t b, int64_t kvh, int64_t kt, int64_t n)
        : k(p.k + (b * p.k_stride[0] + kvh * p.k_stride[1] + kt * p.k_stride[2]) * (int64_t)sizeof(In)),
          v(p.v + (b * p.v_stride[0] + kvh * p.v_stride[1] + kt * p.v_stride[2]) * (int64_t)sizeof(In)),
          k_stride(p.k_stride[2] * (int64_t)sizeof(In)),
          v_stride(p.v_stride[2] * (int64_t)sizeof(In)),
          k_lines(row_lines(k, k_stride, p.head_dim * (int64_t)sizeof(In))),
          v_lines(row_lines(v, v_stride, p.head_dim_v * (int64_t)sizeof(In))),
          keys(n),
          runs(k_stride == p.head_dim * (int64_t)sizeof(In) && v_stride == p.head_dim_v * (int64_t)sizeof(In)),
          k_cursor(line_start(k)),
          k_end(k + n * k_stride),
          v_cursor(line_start(v)),
          v_end(v + n * v_stride) {}

    /* Two explicit runs of bytes, [k_first, k_last) and [v_first, v_last): a share of a token block. */
    SpreadPrefetch(const char* k_first, const char* k_last, const char* v_first, const char* v_last)
        : k(k_first),
          v(v_first),
          k_stride(0),
          v_stride(0),
          k_lines(0),
          v_lines(0),
          keys(k_last > k_first || v_last > v_first ? 1 : 0),
          runs(true),
          k_cursor(line_start(k_first)),
          k_end(k_last),
          v_cursor(line_start(v_first)),
          v_end(v_last) {}

    static const char* line_start(const char* address) {
        return reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(address) & ~uintptr_t(63));
    }

    /* Lines a row of `bytes` may span: one more than whole lines hold where rows need not start on a
     * line (numpy places large arrays 16 bytes past one: a (B, S, H, D) cache's 256-byte float16
     * rows then span 5 lines each, and prefetching 4 left one demand miss a row, 1.65x slower). */
    static int64_t row_lines(const char* first, int64_t stride, int64_t bytes) {
        const bool aligned = reinterpret_cast<uintptr_t>(first) % 64 == 0 && stride % 64 == 0;
        return (bytes + 63) / 64 + (aligned ? 0 : 1);
    }

    int64_t total_lines() const {
        if (runs) return keys == 0 ? 0 : (k_end - k_cursor + 63) / 64 + (v_end - v_cursor + 63) / 64;
        return keys * (k_lines + v_lines);
    }

    /* One line into L2 (see above).  Always inlined: GCC 12's mod/ref analysis (-fipa-modref) takes
     * a function whose only statement is __builtin_prefetch for one with no effect, and deletes the
     * calls to it that stay out of line.  Where this function stayed out of line it deleted every
     * prefetch of forward_block_dpbf16's walk and of its row prefetches (the disassembly held 3 of
     * their 22; -fno-ipa-modref, or this attribute, kept all 22; PairKernel<4>::tile held 8, now
     * 20), and the 16-row bfloat16 decode streamed C6's shape 1.47x slower without them (2-core
     * Zen 4, benchmarks/kernel_ab.py).  Every prefetch goes through this function or
     * MaskPrefetch::issue (always inlined, the builtin in its body). */
    __attribute__((always_inline)) static inline void fetch(const char* line) { __builtin_prefetch(line, 0, 2); }

    /* The next `count` lines (K, then V: whole runs, or row after row, key after key); nothing once
     * all are asked for. */
    __attribute__((always_inline)) inline void issue(int64_t count) {
        if (runs) {
            for (; count > 0 && k_cursor < k_end; --count, k_cursor += 64) fetch(k_cursor);
            for (; count > 0 && v_cursor < v_end; --count, v_cursor += 64) fetch(v_cursor);
            return;
        }
        for (; count > 0 && key < keys; --count) {
            if (line < k_lines)
                fetch(line_start(k + key * k_stride) + line * 64);
            else
                fetch(line_start(v + key * v_stride) + (line - k_lines) * 64);
            if (++line == k_lines + v_lines) {
                line = 0;
                ++key;
            }
        }
    }
};

/* Lines a call of a tile's work hands to the prefetcher, for `lines` lines over `calls` calls, and
 * `*upfront`, the lines to hand over before the first call.  Where the lines pass a whole number
 * of lines a call by at most an eighth of the calls, that whole number a call and the rest up
 * front; else the share rounded up (the walk then ends before the last call), at least 1.
 * Rounded up alone, a share just past a whole number ended the walk in the first half of the tile:
 * numpy puts a large array 16 bytes past a line, so a float32 decode's tile of 128 keys of
 * D = Dv = 128 has 2050 lines for 2048 calls, took 2 a call, and prefetched nothing during its P.V
 * (C6's shape streamed on a 2-core Zen 1, EPYC family 23 model 1, benchmarks/kernel_ab.py: 1.34-1.39x
 * faster with 1 a call and 2 up front, 77 -> 56 ns a key; the bfloat16 and float16 decodes, 1026
 * lines for 2048 calls, 1 a call as before: 0.99 and 0.99, noise).  Pacing every call's share in
 * fixed point instead made those 0.94-0.99x: its running count cost the score loops' registers. */
static inline int64_t prefetch_share(int64_t lines, int64_t calls, int64_t* upfront) {
    calls = std::max<int64_t>(calls, 1);
    const int64_t whole = lines / calls, rest = lines - whole * calls;
    if (whole >= 1 && rest <= calls / 8) {
        *upfront = rest;
        return whole;
    }
    *upfront = 0;
    return std::max<int64_t>(1, (lines + calls - 1) / calls);
}

/* ---- element access -------------------------------------------------------------------------- */

template <typename In> static inline const In* at(const char* base, int64_t element) {
    return reinterpret_cast<const In*>(base) + element;
}

/* Keys in [k_begin, k_end) that some query of positions q0..q0+qn-1 can see: cut by key_lengths,
 * causal and window, so that tiles nobody sees are never visited. */
static inline void visible_keys(const FwdParams& p, int64_t b, int64_t q0, int64_t qn, int64_t k_begin,
                                int64_t k_end, int64_t* lo, int64_t* hi) {
    *lo = k_begin;
    *hi = std::min(k_end, p.key_lengths ? p.key_lengths[b] : p.seq_k);
    Band(p).cut_keys(q0 + p.offset, q0 + qn - 1 + p.offset, lo, hi);
}

/* visible_keys of walk `sweep` of key_sweeps: the first of two covers the keys 0..seq_k (every
 * split's), the last the item's own [k_begin, k_end). */
static inline void sweep_visible_keys(const FwdParams& p, int sweep, int64_t b, int64_t q0, int64_t qn,
                                      int64_t k_begin, int64_t k_end, int64_t* lo, int64_t* hi) {
    const bool all = sweep + 1 < key_sweeps(p);
    visible_keys(p, b, q0, qn, all ? 0 : k_begin, all ? p.seq_k : k_end, lo, hi);
}

/* How many keys of the tile [kt, kt + n), from kt, the rows [first, first + count) of a forward tile
 * need: up to the last key one of them sees (rows stacked as in forward_block, row r is query
 * q0 + r % qn; padding rows past `rows` add none).  On a causal or right-window edge each row block
 * stops there, in Q.K^T and in P.V: the keys past it are hidden from all of its rows, so
 * finish_scores makes them -inf whatever S holds there, and their P is 0.  On causal diagonal tiles
 * of 64 rows in 16-row blocks (AVX2) that skips 3/8 of a 64-key tile's products and 3/16 of a
 * 128-key tile's: ~4% of C2's work (2-core Zen 3, one thread, 8 alternations: C2 18.9 -> 17.8 ms
 * mean; B1 H64 S128 D64 causal 4.9 -> 4.3 ms). */
static inline int64_t row_block_keys(const FwdParams& p, int64_t q0, int64_t qn, int64_t rows, int64_t first,
                                     int64_t count, int64_t kt, int64_t n) {
    const Band band(p);
    if (!band.has_right) return n;
    const int64_t last_row = std::min(first + count, rows) - 1;
    if (last_row < first) return 0;
    /* r % qn is largest at the last row, unless the block runs past a multiple of qn (GQA stacking). */
    const int64_t last_pos = q0 + p.offset + (last_row / qn != first / qn ? qn - 1 : last_row % qn);
    return std::max<int64_t>(0, std::min(kt + n, band.key_end(last_pos)) - kt);
}

/* ---- scores: softcap, causal/window edges, mask arrays ----------------------------------------- */

/* Finish a transposed score tile S[j][rows] (n keys from kt, rows of query block q0..q0+qn):
 * softcap (its derivative 1 - tanh^2 saved to cap_grad when given, for the backward), the float
 * mask added or -inf where the bool mask hides a key, then -inf wherever causal/window hides a key
 * (only on tiles that straddle an edge).  Hiding comes last so that a hidden key is -inf even
 * where the float mask holds a NaN.  The first of the softcap and mask passes multiplies the scores
 * by `scale` on the way (1 where Q was scaled before the product; without either pass the scores
 * are left as they are, and the softmax takes the scale). */
template <typename T>
static void finish_scores(const FwdParams& p, T* s, T* cap_grad, int64_t mp, int64_t rows, int64_t n, int64_t kt,
                          int64_t b, int64_t kvh, int64_t q0, int64_t qn, const T* position, T scale) {
    typedef typename Vec<T>::type V;
    typedef typename Vec<T>::itype I;
    constexpr int L = Vec<T>::lanes;
    const T neg_inf = -std::numeric_limits<T>::infinity();
    if (p.softcap > 0) {
        /* tanh and its derivative sech^2 from one u = exp(-2|x|): tanh = sign(x) (1 - u) / (1 + u),
         * sech^2 = 4u / (1 + u)^2, accurate where tanh saturates (1 - tanh^2 would cancel to 0). */
        const V c = vbroadcast((T)p.softcap), ic = vbroadcast((T)(scale / p.softcap));
        for (int64_t e = 0; e < n * mp; e += L) {
            const V x = vload<V>(s + e) * ic;
            const V magnitude = vselect(x < V{}, -x, x);
            const V u = vexp(magnitude * T(-2));
            const V t = (T(1) - u) / (T(1) + u);
            vstore(s + e, c * vselect(x < V{}, -t, t));
            if (cap_grad) vstore(cap_grad + e, T(4) * u / ((T(1) + u) * (T(1) + u)));
        }
    }
    if (p.mask_kind != MASK_NONE)
        mask_transposed<T>(p, s, mp, rows, n, kt, b, kvh, q0, qn, p.softcap > 0 ? T(1) : scale);
    const Band band(p);
    const BandEdges edges = band.edges(kt, n, q0 + p.offset, q0 + qn - 1 + p.offset);
    if (edges.any()) {
        const V minus_infinity = vbroadcast(neg_inf);
        const V left = vbroadcast((T)band.left), right = vbroadcast((T)band.right);
        for (int64_t j = 0; j < n; ++j) {
            const V key = vbroadcast((T)(kt + j));
            for (int64_t r = 0; r < mp; r += L) {
                const V pos = vload<V>(position + r);
                I visible = key == key;
                if (edges.left) visible &= Band::within_left(key, pos, left);
                if (edges.right) visible &= Band::within_right(key, pos, right);
                vstore(s + j * mp + r, vselect(visible, vload<V>(s + j * mp + r), minus_infinity));
            }
        }
    }
}

/* ---- attention dropout ------------------------------------------------------------------------ */

/* Multiply each entry of a probability tile by its dropout multiplier, 0 or 1 / (1 - p), or with
 * `assign` store the multiplier itself.  Entry (key kt + j, row r) is tile[j * key_stride +
 * r * row_stride]; row r is head kvh * G + r / qn, query q0 + r % qn.  The decision comes from
 * philox.h's counter layout, one Philox call per row and block of four keys. */
template <typename T>
static void dropout_tile(const FwdParams& p, T* tile, int64_t key_stride, int64_t row_stride, int64_t rows,
                         int64_t n, int64_t kt, int64_t b, int64_t kvh, int64_t q0, int64_t qn, bool assign) {
    const T scale = p.dropout_p >= 1.0 ? T(0) : (T)(1.0 / (1.0 - p.dropout_p));
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = kvh * p.group + r / qn, i = q0 + r % qn;
        unsigned int words[4];
        int64_t block = -1;
        for (int64_t j = 0; j < n; ++j) {
            const int64_t key = kt + j;
            if ((key >> 2) != block) {
                block = key >> 2;
                fastattn_philox::dropout_words(p.dropout_key, p.dropout_offset, (unsigned int)(b * p.heads_q + h),
                                               (unsigned int)i, (unsigned int)block, words);
            }
            const T factor = (unsigned long long)words[key & 3] >= p.dropout_threshold ? scale : T(0);
            T& entry = tile[j * key_stride + r * row_stride];
            entry = assign ? factor : entry * factor;
        }
    }
}

/* ---- K and V tiles ---------------------------------------------------------------------------- */

/* Whether K and V may be read in pair order (load_pair_order), q (Qp's depths) and O held in it:
 * bfloat16 rows whose D and Dv are whole pair blocks (2L elements).  The decode (DotKernel) does
 * where this holds, forward_block where it also keeps O by row. */
template <typename T, typename In> static inline bool reads_kv_in_pairs(const FwdParams& p) {
    constexpr int64_t block = 2 * Vec<T>::lanes;
    return reads_in_pair_order<T, In>() && p.head_dim % block == 0 && p.head_dim_v % block == 0;
}

/* forward_block keeps O by row (add_weighted_values, blocks of kValueRows rows x kValueVectors
 * vectors of columns in registers) with 32 vector registers (AVX-512) only.  With 16 the blocks
 * are 4 x 2 or 4 x 3, and those ran 8-12% and ~35% slower than the rows-as-lanes P.V (the AVX2
 * level on a 2-core Zen 5: float16 C1-C5, decodes with 16-64 rows). */
#if FASTATTN_VECTOR_BYTES == 64
constexpr bool kValuesByRow = true;
#else
constexpr bool kValuesByRow = false;
#endif
constexpr int kValueRows = 8, kValueVectors = 2;
/* Value rows a share of the spread prefetch covers in forward_block's P.V: a share a row put the
 * walk's instructions beside every 16 FMAs.  2-core Xeon model 207, B1 Sq4 decodes (16 rows, in
 * cache), best of 9 processes: bfloat16 1.430 -> 1.376 ms, float16 1.407 -> 1.326, float32 1.410 ->
 * 1.362; 8 rows a share 1.385, 1.349, 1.340.  Streamed from memory (B8), within the noise. */
constexpr int kValueShare = 4;

/* Whether a level may convert float16/bfloat16 K and V once per call (converts_kv_once): all but
 * the AMX level, where packed_kv holds bfloat16 V^T tiles instead. */
#if defined(FASTATTN_HAS_AMX)
constexpr bool kConvertsKvOnce = false;
#else
constexpr bool kConvertsKvOnce = true;
#endif

/* Float32 copies of float16/bfloat16 K and V made once per call (converts_kv_once; not at the AMX
 * level, where packed_kv holds V^T instead): K [B][Hkv][Sk][D], then V [B][Hkv][Sk][Dv], in
 * packed_kv. */
template <typename T> static inline T* converted_keys(const FwdParams& p, int64_t b, int64_t kvh) {
    return reinterpret_cast<T*>(p.packed_kv) + (b * p.heads_kv + kvh) * p.seq_k * p.head_dim;
}
template <typename T> static inline T* converted_values(const FwdParams& p, int64_t b, int64_t kvh) {
    return reinterpret_cast<T*>(p.packed_kv) + p.batch * p.heads_kv * p.seq_k * p.head_dim +
           (b * p.heads_kv + kvh) * p.seq_k * p.head_dim_v;
}

/* K and V rows of a tile in the compute type: the caller's memory read in place, the copies made
 * once per call, or (float16 and bfloat16 inputs otherwise) a converted copy in scratch.
 * forward_block takes K alone (load_keys) where it reads V rows in place (add_weighted_values) and K
 * is in the compute type; float16/bfloat16 K there goes a block of keys at a time
 * (qk_converting_blocks). */
template <typename T, typename In> struct KvTile {
    const T* k;
    const T* v;
    int64_t k_stride, v_stride;

    /* Whether this call's K and V were converted once into packed_kv (converts_kv_once). */
    static bool converted_once(const FwdParams& p) {
        return kConvertsKvOnce && !std::is_same<T, In>::value && p.packed_kv != nullptr;
    }

    void load_keys(const FwdParams& p, int64_t b, int64_t kvh, int64_t kt, int64_t n, T* k_converted) {
        if (converted_once(p)) {
            k = converted_keys<T>(p, b, kvh) + kt * p.head_dim;
            k_stride = p.head_dim;
            return;
        }
        k = rows(p.k, p.k_stride, p.head_dim, b, kvh, kt, n, k_converted, &k_stride);
    }
    void load(const FwdParams& p, int64_t b, int64_t kvh, int64_t kt, int64_t n, T* k_converted, T* v_converted) {
        load_keys(p, b, kvh, kt, n, k_converted);
        if (converted_once(p)) {
            v = converted_values<T>(p, b, kvh) + kt * p.head_dim_v;
            v_stride = p.head_dim_v;
            return;
        }
        v = rows(p.v, p.v_stride, p.head_dim_v, b, kvh, kt, n, v_converted, &v_stride);
    }

    /* The lines that tile.load reads for keys kt..kt+n, for the prefetcher: the float32 copies where
     * K and V were converted once, else the caller's rows (which a per-tile conversion reads).
     * Prefetching the float16/bfloat16 inputs while reading the copies left every copied tile a
     * demand miss: the half-precision forward ran 4-7% slower than float32 (B1 H8 S2048 D128 causal,
     * 2-core Zen 3, 2 threads; float32 read from such copies ran as slowly). */
    static SpreadPrefetch<In> next_lines(const FwdParams& p, int64_t b, int64_t kvh, int64_t kt, int64_t n) {
        if (!converted_once(p)) return SpreadPrefetch<In>(p, b, kvh, kt, n);
        const char* k_first = reinterpret_cast<const char*>(converted_keys<T>(p, b, kvh) + kt * p.head_dim);
        const char* v_first = reinterpret_cast<const char*>(converted_values<T>(p, b, kvh) + kt * p.head_dim_v);
        return SpreadPrefetch<In>(k_first, k_first + n * p.head_dim * (int64_t)sizeof(T), v_first,
                                  v_first + n * p.head_dim_v * (int64_t)sizeof(T));
    }

  private:
    /* n rows of `width` elements from key kt of (b, kvh) in `base`, where they lie or converted. */
    static const T* rows(const char* base, const int64_t* stride, int64_t width, int64_t b, int64_t kvh, int64_t kt,
                         int64_t n, T* converted, int64_t* row_stride) {
        const In* first = at<In>(base, b * stride[0] + kvh * stride[1] + kt * stride[2]);
        if constexpr (std::is_same<T, In>::value) {
            *row_stride = stride[2];
            return first;
        } else {
            for (int64_t j = 0; j < n; ++j) convert_row(first + j * stride[2], converted + j * width, width);
            *row_stride = width;
            return converted;
        }
    }
};

/* dst[d * stride + u] = scale * src[u][d] for L = lanes rows u (a null row packs zeros) and D
 * depths, in the compute type: the Q pack into Qp[d][rows] (forward_block; the backward's TilePack,
 * dO too).  L x L blocks are loaded by rows (converted in registers where the level can) and
 * transposed in registers, so each store writes one depth's L rows.  Element by element, the pack
 * and forward_block's O write took ~8% of forward_block's samples at C2 (B1 H8 S1024 D64 causal),
 * and TilePack's ~75% of the backward's gradient_block (2-core Zen 3). */
template <typename T, typename In>
static inline void pack_rows(const In* const* src, T scale, int64_t D, T* dst, int64_t stride) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    int64_t d0 = 0;
    for (; d0 + L <= D; d0 += L) {
        V block[L];
        for (int u = 0; u < L; ++u) block[u] = src[u] ? load_vector<T>(src[u] + d0) * scale : V{};
        transpose_lanes<T>(block);
        for (int t = 0; t < L; ++t) vstore(dst + (d0 + t) * stride, block[t]);
    }
    for (; d0 < D; ++d0)
        for (int u = 0; u < L; ++u) dst[d0 * stride + u] = src[u] ? scale * load_as<T>(src[u][d0]) : T(0);
}

/* The depths of one row block of Qp ([D][RB], RB <= 2L) into pair order, the order of K rows read
 * in pair order: in each 2L-depth block the even depths first, then the odd ones. */
template <typename T> static inline void reorder_pair_depths(T* qp, int64_t D, int64_t RB) {
    constexpr int L = Vec<T>::lanes;
    T block[2 * L * 2 * L];
    for (int64_t c = 0; c < D; c += 2 * L) {
        std::memcpy(block, qp + c * RB, sizeof(T) * 2 * L * RB);
        for (int i = 0; i < L; ++i) {
            std::memcpy(qp + (c + i) * RB, block + 2 * i * RB, sizeof(T) * RB);
            std::memcpy(qp + (c + L + i) * RB, block + (2 * i + 1) * RB, sizeof(T) * RB);
        }
    }
}

/* rows[u * n + c] = columns[c * stride + u] for L = lanes rows u and n columns: pack_rows' way
 * back, from a transposed accumulator (O[Dv][rows], dQ^T[D][rows]) to L rows ready to store. */
template <typename T> static inline void unpack_rows(const T* columns, int64_t stride, int64_t n, T* rows) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    int64_t c0 = 0;
    for (; c0 + L <= n; c0 += L) {
        V block[L];
        for (int t = 0; t < L; ++t) block[t] = vload<V>(columns + (c0 + t) * stride);
        transpose_lanes<T>(block);
        for (int u = 0; u < L; ++u) vstore(rows + u * n + c0, block[u]);
    }
    for (; c0 < n; ++c0)
        for (int u = 0; u < L; ++u) rows[u * n + c0] = columns[c0 * stride + u];
}

/* Normalise one query row's accumulator acc[0 : Dv] and write it: to the partial buffers of a key
 * split (row r), or to out and lse.  A row that saw no key gets 0 and lse -inf. */
template <typename T, typename In>
static inline void write_row(const FwdParams& p, int64_t b, int64_t h, int64_t i, int64_t r, const T* acc, T row_max,
                             T row_sum, T* partial_out, T* partial_lse) {
    const int64_t Dv = p.head_dim_v;
    /* row_sum is 0 only without a key; NaN (a NaN score) is not "no key" and poisons the row. */
    const bool saw_key = row_sum != T(0);
    const T inverse = saw_key ? T(1) / row_sum : T(0);
    const T lse = saw_key ? row_max + std::log(row_sum) : -std::numeric_limits<T>::infinity();
    if (partial_out) {
        for (int64_t c = 0; c < Dv; ++c) partial_out[r * Dv + c] = acc[c] * inverse;
        partial_lse[r] = lse;
        return;
    }
    In* dst = reinterpret_cast<In*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
    /* by vectors (element by element it took 5% of a decode) */
    if (!store_row<T, In>(acc, inverse, dst, Dv)) note_nonfinite(p);
    *(reinterpret_cast<T*>(p.lse) + b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]) = lse;
}

/* row[0 : n] *= factor. */
template <typename T> static inline void scale_row(T* row, int64_t n, T factor) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    const V f = vbroadcast(factor);
    int64_t c = 0;
    for (; c + L <= n; c += L) vstore(row + c, vload<V>(row + c) * f);
    for (; c < n; ++c) row[c] *= factor;
}

/* ---- the online softmax over rows-as-lanes tiles ------------------------------------------------ */

/* One key tile's step of the online softmax, vectorised over rows: S[j][rows] (n keys) becomes
 * P = exp(S - m) with m the rows' new running maximum, the running sums take the tile's P (row_sum
 * l = l alpha + sum_j P, alpha = exp(m_old - m)), and the output accumulator O[c][rows] (Dv columns,
 * mp apart) is rescaled by alpha.  exp(s - m) = 2^(s log2(e) - m log2(e)), one FMA and vexp2_softmax.
 * A row whose keys so far are all hidden keeps m = -inf and exponent shift 0, so its P is 0.
 * The tile's scores are score_scale times S (1 where S is already scaled): S's maximum times
 * score_scale is the maximum of the scaled scores (rounding is monotone and score_scale > 0), and
 * the scale folds into the exponent's FMA, so an unscaled tile costs nothing more.
 * P goes to `keep(j, r, P[j], P[j + 1])`, two keys at a time (P[n] = 0 for an odd n's last pair):
 * by default back into S (StoreProbabilities); the AMX kernel packs it into its tiles instead.
 * O is O[c][rows] (c * mp + r), or with o_by_row O[r][c] (r * Dv + c: forward_block's).
 * `columns(x, j, r)` is what the softmax reads of key j's score vector x (rows r .. r + L - 1): S as
 * it lies by default, or S masked on the way (mask_tiles.h: KeysHidden, KeysBiased, RowsHidden).
 *
 * Settled rows skip the maximum's pass.  Where `keep` leaves S as it is (Keep::leaves_scores: the
 * half-precision kernels' packers) and every row of a vector has a finite running maximum, the
 * exponentials first run against that maximum as it stands, in one pass over S.  If each row's
 * sum of the tile's P stays below kSettledSumLimit, no P exceeded it either: the maximum stays,
 * alpha is 1, and the pass is the step (P may exceed 1 by that much, which float32 sums, bfloat16 P
 * and float32 O hold exactly as well; lse = m + log(l) holds for any m).  Otherwise (the maximum grew
 * by more than log2 of the limit, or a NaN or infinite P) the step runs again with the maximum's
 * pass, and its P replaces what was kept.  Once the maxima settle (on random scores after the first
 * tile) the maximum's pass, which re-read S from L2, is gone: it was ~1/6 of the bfloat16 softmax's
 * samples on the Xeon model 167. */
constexpr float kSettledSumLimit = 65536.0f;

struct ScoresAsStored {
    template <typename V> inline V operator()(V score, int64_t, int64_t) const { return score; }
};

template <typename T> struct StoreProbabilities {
    static constexpr bool leaves_scores = false; /* P overwrites S */
    T* s;
    int64_t n, mp;
    inline void operator()(int64_t j, int64_t r, typename Vec<T>::type p0, typename Vec<T>::type p1) const {
        vstore(s + j * mp + r, p0);
        if (j + 1 < n) vstore(s + (j + 1) * mp + r, p1);
    }
};

/* The exponential pass of softmax_row_vectors: P = 2^(S score_log2e - shift) for RV vectors of rows
 * from r0, handed to keep, its sums in total0 + total1 (two chains a vector: the adds would wait on
 * each other). */
template <typename T, int RV, typename Keep, typename Columns>
static inline void softmax_exponentials(const T* s, int64_t n, int64_t mp, int64_t r0, T score_log2e,
                                        const typename Vec<T>::type* shift, const Keep& keep, const Columns& columns,
                                        typename Vec<T>::type* total0, typename Vec<T>::type* total1) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    FASTATTN_UNROLL for (int u = 0; u < RV; ++u) total0[u] = total1[u] = V{};
    for (int64_t j = 0; j < n; j += 2)
        FASTATTN_UNROLL for (int u = 0; u < RV; ++u) {
            const int64_t r = r0 + u * L;
            const V p0 = vexp2_softmax(columns(vload<V>(s + j * mp + r), j, r) * score_log2e - shift[u]);
            const V p1 = j + 1 < n
                             ? vexp2_softmax(columns(vload<V>(s + (j + 1) * mp + r), j + 1, r) * score_log2e - shift[u])
                             : V{};
            keep(j, r, p0, p1);
            total0[u] += p0;
            total1[u] += p1;
        }
}

/* softmax_row_vectors' pass for rows whose maximum has settled (see online_softmax): true where it
 * took the step, false where the step must run with the maximum's pass. */
template <typename T, int RV, typename Keep, typename Columns>
static inline bool settled_softmax_step(const T* s, int64_t n, int64_t mp, int64_t r0, T* row_max, T* row_sum,
                                        T score_scale, const Keep& keep, const Columns& columns) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    V shift[RV], total0[RV], total1[RV];
    FASTATTN_UNROLL for (int u = 0; u < RV; ++u) {
        const V running = vload<V>(row_max + r0 + u * L);
        if (!vequal_all(running - running, V{})) return false; /* -inf (no key yet), or NaN */
        shift[u] = running * kLog2e<T>;
    }
    softmax_exponentials<T, RV>(s, n, mp, r0, score_scale * kLog2e<T>, shift, keep, columns, total0, total1);
    const V limit = vbroadcast((T)kSettledSumLimit);
    V sums[RV];
    FASTATTN_UNROLL for (int u = 0; u < RV; ++u) {
        sums[u] = total0[u] + total1[u];
        if (!vequal_all(vmax(limit, sums[u]), limit)) return false; /* a NaN sum fails too */
    }
    FASTATTN_UNROLL for (int u = 0; u < RV; ++u) vstore(row_sum + r0 + u * L, vload<V>(row_sum + r0 + u * L) + sums[u]);
    return true;
}

/* online_softmax's step for RV vectors of rows from r0, the loops over keys outside: each key's
 * RV vectors lie side by side in S, so the passes read S in order.  Rows as the outer loop (one
 * vector at a time) read one vector of each 256-byte key row of S per step, and the 2-core Zen 3
 * took 7-8% longer per score on a tile of 64 rows x 128 keys (a loop of that tile alone).  Each
 * vector's maximum and sums run in the same order as with rows outside: the results are the same. */
template <typename T, int RV, typename Keep, typename Columns>
static inline void softmax_row_vectors(T* s, int64_t n, int64_t mp, int64_t r0, T* row_max, T* row_sum, T* o,
                                       int64_t Dv, T score_scale, const Keep& keep_in, bool o_by_row,
                                       const Columns& columns_in) {
    typedef typename Vec<T>::type V;
    /* Local copies: P's stores could alias the callers' objects, whose fields would then be read
     * again after every store where this function is not inlined (the masked softmax). */
    const Keep keep = keep_in;
    const Columns columns = columns_in;
    if constexpr (Keep::leaves_scores)
        if (settled_softmax_step<T, RV>(s, n, mp, r0, row_max, row_sum, score_scale, keep, columns)) return;
    constexpr int L = Vec<T>::lanes;
    const T log2e = kLog2e<T>, score_log2e = score_scale * kLog2e<T>;
    const V neg_inf = vbroadcast(-std::numeric_limits<T>::infinity());
    V max0[RV], max1[RV]; /* two chains a vector: max has latency */
    FASTATTN_UNROLL for (int u = 0; u < RV; ++u) max0[u] = max1[u] =
        n > 0 ? columns(vload<V>(s + r0 + u * L), 0, r0 + u * L) : neg_inf;
    int64_t j = 1;
    for (; j + 2 <= n; j += 2)
        FASTATTN_UNROLL for (int u = 0; u < RV; ++u) {
            max0[u] = vmax(max0[u], columns(vload<V>(s + j * mp + r0 + u * L), j, r0 + u * L));
            max1[u] = vmax(max1[u], columns(vload<V>(s + (j + 1) * mp + r0 + u * L), j + 1, r0 + u * L));
        }
    if (j < n)
        FASTATTN_UNROLL for (int u = 0; u < RV; ++u) max0[u] =
            vmax(max0[u], columns(vload<V>(s + j * mp + r0 + u * L), j, r0 + u * L));
    V shift[RV], alpha[RV], total0[RV], total1[RV];
    FASTATTN_UNROLL for (int u = 0; u < RV; ++u) {
        const V running = vload<V>(row_max + r0 + u * L);
        const V new_max = vmax(running, vmax(max0[u], max1[u]) * score_scale);
        shift[u] = vselect(new_max == neg_inf, V{}, new_max) * log2e;
        alpha[u] = vexp2_softmax(running * log2e - shift[u]);
        vstore(row_max + r0 + u * L, new_max);
    }
    softmax_exponentials<T, RV>(s, n, mp, r0, score_log2e, shift, keep, columns, total0, total1);
    FASTATTN_UNROLL for (int u = 0; u < RV; ++u) {
        const int64_t r = r0 + u * L;
        vstore(row_sum + r, vload<V>(row_sum + r) * alpha[u] + (total0[u] + total1[u]));
        /* Once the rows' maxima settle, alpha is 1 in every lane and O stays as it is. */
        if (vequal_all(alpha[u], vbroadcast(T(1)))) continue;
        if (!o_by_row) {
            for (int64_t c = 0; c < Dv; ++c) vstore(o + c * mp + r, vload<V>(o + c * mp + r) * alpha[u]);
            continue;
        }
        alignas(64) T factors[L];
        vstore(factors, alpha[u]);
        for (int lane = 0; lane < L; ++lane)
            if (factors[lane] != T(1)) scale_row(o + (r + lane) * Dv, Dv, factors[lane]);
    }
}

template <typename T, typename Keep, typename Columns = ScoresAsStored>
static inline void online_softmax(T* s, int64_t n, int64_t mp, T* row_max, T* row_sum, T* o, int64_t Dv,
                                  T score_scale, const Keep& keep, bool o_by_row = false,
                                  const Columns& columns = Columns()) {
    constexpr int L = Vec<T>::lanes;
    int64_t r = 0;
    for (; r + 2 * L <= mp; r += 2 * L)
        softmax_row_vectors<T, 2>(s, n, mp, r, row_max, row_sum, o, Dv, score_scale, keep, o_by_row, columns);
    if (r < mp) softmax_row_vectors<T, 1>(s, n, mp, r, row_max, row_sum, o, Dv, score_scale, keep, o_by_row, columns);
}

/* One vector of rows' scores of a tile, between() every kDepthChunk steps (forward_block's
 * spread_scores), out of line: forward_block's other paths keep the code they had without it. */

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
