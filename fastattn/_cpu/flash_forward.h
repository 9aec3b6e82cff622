/* Flash attention forward on the CPU: tiled online softmax, never an Sq x Sk buffer.
 *
 * Work item = (batch b, kv head, block of query positions, key split).  The query rows of the
 * whole GQA group that reads this kv head are stacked into one tile of M = group x block_queries
 * rows, so each K/V tile is loaded once per group, not once per query head.
 *
 * Layout trick: query rows are the SIMD lanes of the scores.  Q is packed once per item,
 * pre-multiplied by scale, as Qp[M/RB][D][RB] (RB = NV vectors of rows), and the scores are kept
 * transposed, S[key][row]:
 *   S[j][rows] = sum_d K[j][d] * Qp[d][rows]     (micro-kernel: MR keys x RB rows in registers,
 *                                                  K[j][d] broadcast, Qp row loaded)
 * so every per-row quantity of the online softmax (running max m, running sum l, rescale factor
 * alpha, causal/window positions) is a plain vector over rows: no horizontal reductions anywhere.
 * The output accumulator is kept one of two ways.  Transposed, O[Dv][rows]:
 *   O[c][rows] += sum_j V[j][c] * P[j][rows]     (micro-kernel: MR columns x RB rows, V[j][c]
 *                                                  broadcast, P row loaded; V in the compute type,
 *                                                  float16/bfloat16 tiles converted into scratch)
 * or, with 32 vector registers, for tiles of one row block not converted once (one query block
 * per kv head, or float32), by row:
 *   O[r][c:c+CB*L] += sum_j P[j][r] * V[j][c:c+CB*L]   (add_weighted_values: R = 8 rows x CB = 2
 *                                                       vectors, P[j][r] broadcast, V row loaded)
 * which reads V rows where they lie, converted in registers once per 8 rows: no converted V tile,
 * and 10 loads per 16 FMAs where a single row block's transposed P.V takes 17.  On a 2-core Zen 5
 * (B8 H32/8 Sk4096 D128 decodes, C1-C5): float16 Sq=4 (16 rows) 7.5 -> 5.8-6.1 ms, Sq=8 11.0 ->
 * 10.1-10.4, float32 Sq=4 9.5 -> 8.2-8.7, Sq=8 12.5 -> 11.3, float16 C5 88 -> 83; by row was 6-8%
 * slower for fp32 tiles of two row blocks (C3, C5, 64-row decodes), and with 16 registers (4 x 2
 * or 4 x 3 blocks) 8-35% slower everywhere (forward_block's o_by_row).  K is read in place when the
 * input is the compute type; float16/bfloat16 K and V are converted once per call for all query
 * blocks where a kv head has several (converts_kv_once), else K tiles are converted into scratch,
 * a block of kMainMR keys at a time where O is kept by row (qk_converting_blocks) (the decode path,
 * DotKernel, converts K and V in registers).  bfloat16 rows whose D and Dv are
 * pair blocks are read in pair order by the decode and by forward_block's O-by-row tiles
 * (load_pair_order, reads_kv_in_pairs: one instruction per vector where widening takes two, q or
 * Qp's depths and O's columns held in that order).  On a 2-core Xeon model 207: C6 bfloat16 ~5%
 * faster by the best of 9 calls, the decode's arithmetic being what its memory stream waits for;
 * 16-row decodes (B1 Sq4, in cache) 1.338 -> 1.252 ms by the best of 11 processes, streamed (B8)
 * 12.48 -> 11.85 ms by the best of 9.
 *
 * Tile sizes: RB = 2 vectors of rows (32 floats with AVX-512, 16 with AVX2), 1 vector when the
 * tile has that few rows (decode); MR = 8 (AVX-512, 32 registers: 16 accumulators) or 6 (AVX2,
 * 16 registers: 12 accumulators) so the FMA pipes stay busy; key tiles of `key_tile` keys (128
 * by default) keep S (key_tile x M) and the K/V tile in L1/L2.
 *
 * Skipped work: the key range of an item is cut to what any of its rows can see (causal, window,
 * key_lengths), so fully masked tiles cost nothing, and on a tile astride a causal or right-window
 * edge each row block stops at its own last visible key (row_block_keys); per-element masking runs
 * only on tiles that straddle a causal or window edge, or when a mask array is given (mask_tiles.h:
 * vectorised, and tiles a bool mask hides entirely are skipped too).
 *
 * Decode (few query rows, few items): the keys are split across threads (`splits`), each split
 * writes its normalised partial output and lse, and `fa_forward_combine` merges them by lse.
 *
 * Scratch per thread: O((M + key_tile) * (D + Dv) + key_tile * M) elements, independent of Sq, Sk.
 */
#ifndef FASTATTN_FLASH_FORWARD_H
#define FASTATTN_FLASH_FORWARD_H

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

#if FASTATTN_VECTOR_BYTES == 64
constexpr int kMainMR = 8;
#else
constexpr int kMainMR = 6;
#endif

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

/* Enough for forward_block (rows-as-lanes) and DotKernel (<= 8 rows) alike, and for a group
 * of kv heads' states and scratch (forward_heads with DotKernel). */
template <typename T> static size_t scratch_elements(const FwdParams& p) {
    RowShape<T> shape(p.group * p.block_queries);
    int64_t mp = std::max<int64_t>(shape.padded, 8), n = p.key_tile;
    const int64_t one = mp * p.head_dim + n * mp + p.head_dim_v * mp + 3 * mp + n * (p.head_dim + p.head_dim_v) +
                        lanes<T>() * p.head_dim_v + 4 * lanes<T>();
    const int64_t rows = p.group * p.block_queries;
    const int64_t per_head = round_up(rows * (p.head_dim + n + p.head_dim_v) + lanes<T>() * p.head_dim,
                                      64 / (int64_t)sizeof(T)) +
                             kHeadStateBytes / (int64_t)sizeof(T);
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

    /* One line into L2 (see above). */
    static inline void fetch(const char* line) { __builtin_prefetch(line, 0, 2); }

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

/* ---- micro-kernels ------------------------------------------------------------------------- */

/* S[m][rows] = sum_d K[m][d] * Qp[d][rows] for MR keys and NV vectors of rows. */
template <typename T, int MR, int NV>
static inline void qk_kernel(const T* k, int64_t k_stride, const T* qp, int64_t depth, T* s, int64_t mp) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    V acc[MR][NV];
    FASTATTN_UNROLL for (int m = 0; m < MR; ++m)
        FASTATTN_UNROLL for (int v = 0; v < NV; ++v) acc[m][v] = V{};
    for (int64_t d = 0; d < depth; ++d) {
        V qv[NV];
        FASTATTN_UNROLL for (int v = 0; v < NV; ++v) qv[v] = vload<V>(qp + d * NV * L + v * L);
        FASTATTN_UNROLL for (int m = 0; m < MR; ++m) {
            V kb = vbroadcast<T>(k[m * k_stride + d]);
            FASTATTN_UNROLL for (int v = 0; v < NV; ++v) acc[m][v] += kb * qv[v];
        }
    }
    FASTATTN_UNROLL for (int m = 0; m < MR; ++m)
        FASTATTN_UNROLL for (int v = 0; v < NV; ++v) vstore(s + m * mp + v * L, acc[m][v]);
}

/* qk_kernel for 8 keys and one vector of rows with between() before each kDepthChunk steps of the
 * depth (forward_block's spread prefetch: a few lines every 128 FMAs).  The 8 key rows are two base
 * pointers and two strides (k_stride, 3 k_stride) in x86's base + index * scale: with one index
 * register a row, the prefetch walk's registers spilled them. */
constexpr int64_t kDepthChunk = 16;
template <typename T, typename Between>
static inline void qk_kernel_spread(const T* k, int64_t k_stride, const T* qp, int64_t depth, T* s, int64_t mp,
                                    Between&& between) {
    typedef typename Vec<T>::type V;
    V acc[8];
    FASTATTN_UNROLL for (int m = 0; m < 8; ++m) acc[m] = V{};
    const T* first = k;
    const T* fifth = k + 4 * k_stride;
    const int64_t one = k_stride, three = 3 * k_stride;
    for (int64_t d0 = 0; d0 < depth; d0 += kDepthChunk) {
        between();
        const int64_t d1 = std::min(depth, d0 + kDepthChunk);
        for (int64_t d = d0; d < d1; ++d, ++first, ++fifth) {
            const V qv = vload<V>(qp + d * Vec<T>::lanes);
            const T values[8] = {first[0], first[one], first[2 * one], first[three],
                                 fifth[0], fifth[one], fifth[2 * one], fifth[three]};
            FASTATTN_UNROLL for (int m = 0; m < 8; ++m) acc[m] += vbroadcast<T>(values[m]) * qv;
        }
    }
    FASTATTN_UNROLL for (int m = 0; m < 8; ++m) vstore(s + m * mp, acc[m]);
}

/* O[m][rows] += sum_j V[j][m] * P[j][rows] for MR output columns and NV vectors of rows. */
template <typename T, int MR, int NV, bool Skip>
static inline void pv_kernel(const T* vt, int64_t v_stride, const T* p, int64_t mp, int64_t keys, T* o) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    V acc[MR][NV];
    FASTATTN_UNROLL for (int m = 0; m < MR; ++m)
        FASTATTN_UNROLL for (int v = 0; v < NV; ++v) acc[m][v] = vload<V>(o + m * mp + v * L);
    for (int64_t j = 0; j < keys; ++j) {
        V pv[NV];
        FASTATTN_UNROLL for (int v = 0; v < NV; ++v) pv[v] = vload<V>(p + j * mp + v * L);
        const T* row = vt + j * v_stride;
        FASTATTN_UNROLL for (int m = 0; m < MR; ++m) {
            V vb = vbroadcast<T>(row[m]);
            FASTATTN_UNROLL for (int v = 0; v < NV; ++v) {
                if constexpr (Skip)
                    acc[m][v] += vselect(pv[v] != V{}, vb * pv[v], V{});
                else
                    acc[m][v] += vb * pv[v];
            }
        }
    }
    FASTATTN_UNROLL for (int m = 0; m < MR; ++m)
        FASTATTN_UNROLL for (int v = 0; v < NV; ++v) vstore(o + m * mp + v * L, acc[m][v]);
}

/* Run a micro-kernel over `count` keys/columns: full MR blocks, then one remainder block. */
template <typename T, int NV, int MR = kMainMR> struct Blocked {
    template <int R> static inline void qk(const T* k, int64_t ks, const T* qp, int64_t depth, T* s, int64_t mp) {
        qk_kernel<T, R, NV>(k, ks, qp, depth, s, mp);
    }
    static void qk_all(int64_t count, const T* k, int64_t ks, const T* qp, int64_t depth, T* s, int64_t mp) {
        qk_all(count, k, ks, qp, depth, s, mp, [] {});
    }
    /* between() runs before each full block of MR keys (forward_block's spread prefetch). */
    template <typename Between>
    static void qk_all(int64_t count, const T* k, int64_t ks, const T* qp, int64_t depth, T* s, int64_t mp,
                       Between&& between) {
        int64_t j = 0;
        for (; j + MR <= count; j += MR) {
            between();
            qk<MR>(k + j * ks, ks, qp, depth, s + j * mp, mp);
        }
        switch (count - j) {
#define FASTATTN_QK_CASE(R) \
    case R:                 \
        if constexpr (R < MR) qk<R>(k + j * ks, ks, qp, depth, s + j * mp, mp); \
        break;
            FASTATTN_QK_CASE(1) FASTATTN_QK_CASE(2) FASTATTN_QK_CASE(3) FASTATTN_QK_CASE(4)
            FASTATTN_QK_CASE(5) FASTATTN_QK_CASE(6) FASTATTN_QK_CASE(7)
#undef FASTATTN_QK_CASE
            default: break;
        }
    }
    /* O[c][rows] += sum_j V[j][c] P[j][rows], MR columns a kernel.  Column c of key j is at
     * vt[c * column_step + j * vs] for c a multiple of MR: column_step 1 and vs the row stride where
     * V is [keys][columns] rows, column_step keys and vs MR for panels [columns / MR][keys][MR]
     * (the backward's key_panels). */
    static void pv_all(int64_t columns, const T* vt, int64_t vs, int64_t column_step, const T* p, int64_t mp,
                       int64_t keys, T* o, bool skip_zero_weights) {
        if (skip_zero_weights)
            pv_blocks<true>(columns, vt, vs, column_step, p, mp, keys, o);
        else
            pv_blocks<false>(columns, vt, vs, column_step, p, mp, keys, o);
    }
    template <bool Skip>
    static void pv_blocks(int64_t columns, const T* vt, int64_t vs, int64_t column_step, const T* p, int64_t mp,
                          int64_t keys, T* o) {
        int64_t c = 0;
        for (; c + MR <= columns; c += MR) pv_kernel<T, MR, NV, Skip>(vt + c * column_step, vs, p, mp, keys, o + c * mp);
        switch (columns - c) {
#define FASTATTN_PV_CASE(R) \
    case R:                 \
        if constexpr (R < MR) pv_kernel<T, R, NV, Skip>(vt + c * column_step, vs, p, mp, keys, o + c * mp); \
        break;
            FASTATTN_PV_CASE(1) FASTATTN_PV_CASE(2) FASTATTN_PV_CASE(3) FASTATTN_PV_CASE(4)
            FASTATTN_PV_CASE(5) FASTATTN_PV_CASE(6) FASTATTN_PV_CASE(7)
#undef FASTATTN_PV_CASE
            default: break;
        }
    }
};

/* o[r][0 : CB*L] += sum_j P[r][j] v[j][0 : CB*L] for R rows (row r of o at o + r * o_stride; P[r][j]
 * at s[r * s_row + j * s_key]: by row in the decode, S[key][row] in forward_block), the R x CB
 * output vectors in registers while the n value rows stream past once, converted to T as they are
 * loaded (Pairs: read in pair order, load_pair_order, so o's columns are in pair order too).  Skip
 * leaves out weights that are exactly 0 (the rerun after a non-finite output, note_stored): a test
 * per weight, which the usual pass does not pay.  between(Share) before every Share-th value row. */
template <typename T, typename In, int R, int CB, bool Skip, bool Pairs, int Share, typename Between>
static inline void accumulate_pv(T* o, int64_t o_stride, const T* s, int64_t s_row, int64_t s_key, const In* v,
                                 int64_t v_stride, int64_t n, Between&& between) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    V acc[R][CB];
    FASTATTN_UNROLL for (int r = 0; r < R; ++r)
        FASTATTN_UNROLL for (int cb = 0; cb < CB; ++cb) acc[r][cb] = vload<V>(o + r * o_stride + cb * L);
    for (int64_t j = 0; j < n; ++j) {
        if (j % Share == 0) between(Share);
        const In* value = v + j * v_stride;
        const T* weights = s + j * s_key;
        V vv[CB];
        if constexpr (Pairs) {
            static_assert(CB % 2 == 0, "pair order reads two vectors at a time");
            FASTATTN_UNROLL for (int cb = 0; cb < CB; cb += 2) load_pair_order<T>(value + cb * L, vv[cb], vv[cb + 1]);
        } else {
            FASTATTN_UNROLL for (int cb = 0; cb < CB; ++cb) vv[cb] = load_vector<T>(value + cb * L);
        }
        FASTATTN_UNROLL for (int r = 0; r < R; ++r) {
            const T w = weights[r * s_row];
            if (Skip && w == T(0)) continue;
            const V weight = vbroadcast(w);
            FASTATTN_UNROLL for (int cb = 0; cb < CB; ++cb) acc[r][cb] += weight * vv[cb];
        }
    }
    FASTATTN_UNROLL for (int r = 0; r < R; ++r)
        FASTATTN_UNROLL for (int cb = 0; cb < CB; ++cb) vstore(o + r * o_stride + cb * L, acc[r][cb]);
}

/* Value passes of add_weighted_values over Dv columns: blocks of CB vectors, then of CB / 2, ..., 1. */
template <typename T, int CB> constexpr int64_t value_passes(int64_t Dv) {
    constexpr int L = Vec<T>::lanes;
    if constexpr (CB == 1)
        return Dv / L;
    else
        return Dv / (CB * L) + value_passes<T, CB / 2>(Dv % (CB * L));
}

/* O[r][:] += sum_j P[r][j] V[j][:] for R rows over all Dv columns (row r of O at o + r * Dv, P as in
 * accumulate_pv): blocks of CB vectors of columns, the rest in blocks of CB / 2, ..., one vector,
 * then element by element.  between(Share) before every Share-th value row of each vector pass
 * (value_passes).  Pairs (pair order, Dv a multiple of 2L) stops at blocks of two vectors. */
template <typename T, typename In, int R, int CB, bool Pairs = false, int Share = 1, typename Between>
static void add_weighted_values(T* o, int64_t Dv, const T* s, int64_t s_row, int64_t s_key, const In* v,
                                int64_t v_stride, int64_t n, bool skip, Between&& between, int64_t c = 0) {
    constexpr int L = Vec<T>::lanes;
    for (; c + CB * L <= Dv; c += CB * L) {
        if (skip)
            accumulate_pv<T, In, R, CB, true, Pairs, Share>(o + c, Dv, s, s_row, s_key, v + c, v_stride, n, between);
        else
            accumulate_pv<T, In, R, CB, false, Pairs, Share>(o + c, Dv, s, s_row, s_key, v + c, v_stride, n, between);
    }
    if constexpr (CB > (Pairs ? 2 : 1)) {
        add_weighted_values<T, In, R, CB / 2, Pairs, Share>(o, Dv, s, s_row, s_key, v, v_stride, n, skip, between, c);
    } else if constexpr (!Pairs) {
        for (int64_t j = 0; c < Dv && j < n; ++j) {
            const In* value = v + j * v_stride;
            for (int r = 0; r < R; ++r) {
                const T w = s[r * s_row + j * s_key];
                if (skip && w == T(0)) continue;
                for (int64_t e = c; e < Dv; ++e) o[r * Dv + e] += w * load_as<T>(value[e]);
            }
        }
    }
}

/* ---- element access -------------------------------------------------------------------------- */

template <typename In> static inline const In* at(const char* base, int64_t element) {
    return reinterpret_cast<const In*>(base) + element;
}

/* Keys in [k_begin, k_end) that some query of positions q0..q0+qn-1 can see: cut by key_lengths,
 * causal and window, so that tiles nobody sees are never visited. */
static inline void visible_keys(const FwdParams& p, int64_t b, int64_t q0, int64_t qn, int64_t k_begin,
                                int64_t k_end, int64_t* lo, int64_t* hi) {
    const int64_t first_pos = q0 + p.offset, last_pos = q0 + qn - 1 + p.offset;
    *lo = k_begin;
    *hi = std::min(k_end, p.key_lengths ? p.key_lengths[b] : p.seq_k);
    if (p.causal) *hi = std::min(*hi, last_pos + 1);
    if (p.window_left >= 0) *lo = std::max(*lo, first_pos - p.window_left);
    if (p.window_right >= 0) *hi = std::min(*hi, last_pos + p.window_right + 1);
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
    if (!p.causal && p.window_right < 0) return n;
    const int64_t last_row = std::min(first + count, rows) - 1;
    if (last_row < first) return 0;
    /* r % qn is largest at the last row, unless the block runs past a multiple of qn (GQA stacking). */
    const int64_t last_pos = q0 + p.offset + (last_row / qn != first / qn ? qn - 1 : last_row % qn);
    int64_t end = kt + n;
    if (p.causal) end = std::min(end, last_pos + 1);
    if (p.window_right >= 0) end = std::min(end, last_pos + p.window_right + 1);
    return std::max<int64_t>(0, end - kt);
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
    const int64_t first_pos = q0 + p.offset, last_pos = q0 + qn - 1 + p.offset;
    const bool causal_edge = p.causal && kt + n - 1 > first_pos;
    const bool left_edge = p.window_left >= 0 && kt < last_pos - p.window_left;
    const bool right_edge = p.window_right >= 0 && kt + n - 1 > first_pos + p.window_right;
    if (causal_edge || left_edge || right_edge) {
        const V minus_infinity = vbroadcast(neg_inf);
        const V left = vbroadcast((T)p.window_left), right = vbroadcast((T)p.window_right);
        for (int64_t j = 0; j < n; ++j) {
            const V key = vbroadcast((T)(kt + j));
            for (int64_t r = 0; r < mp; r += L) {
                const V pos = vload<V>(position + r);
                I visible = key == key;
                if (causal_edge) visible &= key <= pos;
                if (left_edge) visible &= key >= pos - left;
                if (right_edge) visible &= key <= pos + right;
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

/* ---- one work item ----------------------------------------------------------------------------- */

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
 * O is O[c][rows] (c * mp + r), or with o_by_row O[r][c] (r * Dv + c: forward_block's). */
template <typename T> struct StoreProbabilities {
    T* s;
    int64_t n, mp;
    inline void operator()(int64_t j, int64_t r, typename Vec<T>::type p0, typename Vec<T>::type p1) const {
        vstore(s + j * mp + r, p0);
        if (j + 1 < n) vstore(s + (j + 1) * mp + r, p1);
    }
};

/* online_softmax's step for RV vectors of rows from r0, the loops over keys outside: each key's
 * RV vectors lie side by side in S, so the passes read S in order.  Rows as the outer loop (one
 * vector at a time) read one vector of each 256-byte key row of S per step, and the 2-core Zen 3
 * took 7-8% longer per score on a tile of 64 rows x 128 keys (a loop of that tile alone).  Each
 * vector's maximum and sums run in the same order as with rows outside: the results are the same. */
template <typename T, int RV, typename Keep>
static inline void softmax_row_vectors(T* s, int64_t n, int64_t mp, int64_t r0, T* row_max, T* row_sum, T* o,
                                       int64_t Dv, T score_scale, const Keep& keep, bool o_by_row) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    const T log2e = kLog2e<T>, score_log2e = score_scale * kLog2e<T>;
    const V neg_inf = vbroadcast(-std::numeric_limits<T>::infinity());
    V max0[RV], max1[RV]; /* two chains a vector: max has latency */
    FASTATTN_UNROLL for (int u = 0; u < RV; ++u) max0[u] = max1[u] = n > 0 ? vload<V>(s + r0 + u * L) : neg_inf;
    int64_t j = 1;
    for (; j + 2 <= n; j += 2)
        FASTATTN_UNROLL for (int u = 0; u < RV; ++u) {
            max0[u] = vmax(max0[u], vload<V>(s + j * mp + r0 + u * L));
            max1[u] = vmax(max1[u], vload<V>(s + (j + 1) * mp + r0 + u * L));
        }
    if (j < n)
        FASTATTN_UNROLL for (int u = 0; u < RV; ++u) max0[u] = vmax(max0[u], vload<V>(s + j * mp + r0 + u * L));
    V shift[RV], alpha[RV], total0[RV], total1[RV]; /* two sums a vector: the adds would wait on each other */
    FASTATTN_UNROLL for (int u = 0; u < RV; ++u) {
        const V running = vload<V>(row_max + r0 + u * L);
        const V new_max = vmax(running, vmax(max0[u], max1[u]) * score_scale);
        shift[u] = vselect(new_max == neg_inf, V{}, new_max) * log2e;
        alpha[u] = vexp2_softmax(running * log2e - shift[u]);
        vstore(row_max + r0 + u * L, new_max);
        total0[u] = total1[u] = V{};
    }
    for (j = 0; j < n; j += 2)
        FASTATTN_UNROLL for (int u = 0; u < RV; ++u) {
            const int64_t r = r0 + u * L;
            const V p0 = vexp2_softmax(vload<V>(s + j * mp + r) * score_log2e - shift[u]);
            const V p1 = j + 1 < n ? vexp2_softmax(vload<V>(s + (j + 1) * mp + r) * score_log2e - shift[u]) : V{};
            keep(j, r, p0, p1);
            total0[u] += p0;
            total1[u] += p1;
        }
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

template <typename T, typename Keep>
static inline void online_softmax(T* s, int64_t n, int64_t mp, T* row_max, T* row_sum, T* o, int64_t Dv,
                                  T score_scale, const Keep& keep, bool o_by_row = false) {
    constexpr int L = Vec<T>::lanes;
    int64_t r = 0;
    for (; r + 2 * L <= mp; r += 2 * L)
        softmax_row_vectors<T, 2>(s, n, mp, r, row_max, row_sum, o, Dv, score_scale, keep, o_by_row);
    if (r < mp) softmax_row_vectors<T, 1>(s, n, mp, r, row_max, row_sum, o, Dv, score_scale, keep, o_by_row);
}

/* One vector of rows' scores of a tile, between() every kDepthChunk steps (forward_block's
 * spread_scores), out of line: forward_block's other paths keep the code they had without it. */
template <typename T, typename Between>
__attribute__((noinline)) static void spread_scores_tile(int64_t n, const T* k, int64_t k_stride, const T* qp,
                                                         int64_t D, T* s, int64_t mp, Between between) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) qk_kernel_spread<T>(k + j * k_stride, k_stride, qp, D, s + j * mp, mp, between);
    if (j < n) Blocked<T, 1>::qk_all(n - j, k + j * k_stride, k_stride, qp, D, s + j * mp, mp);
}

/* S[j][rows] = K Qp^T for `count` float16/bfloat16 keys (k, rows k_stride apart) of one block of
 * rows, each block of kMainMR keys converted into k_block (kMainMR x D, in pair order with `pairs`)
 * just before its scores.  A whole converted tile (64 KiB at D=128, 128 keys) outgrew L1: the
 * conversion's stores waited on L2 (12% of a 16-row decode's samples, 2-core Xeon model 207), and
 * the scores read the tile back from L2.  In cache (B1, 16 rows, 128 against 384 keys, one thread,
 * 25 builds alternated): 115.8 -> 108.5 ns a key by the median, 51.8 -> 38.5 by the best.
 * between() runs before each full block. */
template <typename T, typename In, int NV, typename Between>
static void qk_converting_blocks(int64_t count, const In* k, int64_t k_stride, bool pairs, T* k_block, const T* qp,
                                 int64_t D, T* s, int64_t mp, Between&& between) {
    auto convert = [&](int64_t first, int64_t keys) {
        for (int64_t m = 0; m < keys; ++m) {
            if constexpr (reads_in_pair_order<T, In>()) {
                if (pairs) {
                    convert_row_in_pairs(k + (first + m) * k_stride, k_block + m * D, D);
                    continue;
                }
            }
            convert_row(k + (first + m) * k_stride, k_block + m * D, D);
        }
    };
    int64_t j = 0;
    for (; j + kMainMR <= count; j += kMainMR) {
        between();
        convert(j, kMainMR);
        Blocked<T, NV>::template qk<kMainMR>(k_block, D, qp, D, s + j * mp, mp);
    }
    if (j < count) {
        convert(j, count - j);
        Blocked<T, NV>::qk_all(count - j, k_block, D, qp, D, s + j * mp, mp);
    }
}

template <typename T, typename In, int NV>
static void forward_block(const FwdParams& p, T* scratch, int64_t b, int64_t kvh, int64_t q0, int64_t qn,
                          int64_t k_begin, int64_t k_end, T* partial_out, T* partial_lse) {
    constexpr int64_t RB = NV * Vec<T>::lanes;
    static_assert(!kValuesByRow || RB % kValueRows == 0, "P.V's row blocks must tile the padded rows");
    const T neg_inf = -std::numeric_limits<T>::infinity();
    const int64_t D = p.head_dim, Dv = p.head_dim_v, G = p.group, N = p.key_tile;
    const int64_t rows = G * qn;
    const int64_t mp = round_up(rows, RB), value_rows = round_up(rows, kValueRows);
    const bool skip = p.skip_zero_weights != 0;
    /* O by row (add_weighted_values) for tiles of one row block, reading float16/bfloat16 V rows
     * where they lie; O[c][rows] (Blocked::pv_all) for larger tiles, where by row was 6-8% slower
     * for float32 (2-core Zen 5: C3, C5 and the Sq=16 decode with 64 rows; its 8 row passes per
     * column block fetch the V tile from L2 more often than the 2 row blocks of rows-as-lanes) and
     * 8-9% slower for float16/bfloat16, which it also widens once per pass (2-core Xeon model 207:
     * B2 Sq16 decodes, 64 rows, converted V tiles 8.8 against 9.7 ms bfloat16, 8.6 against 9.3
     * float16, best of 5 processes), and for K and V converted once per call, which this reads as
     * float32 tiles. */
    const bool o_by_row = kValuesByRow && !KvTile<T, In>::converted_once(p) && mp == RB;
    /* bfloat16 K and V rows by row in pair order (1 instruction per L elements where widening takes
     * 2), Qp's depths and O's columns held in it. */
    const bool pairs = o_by_row && reads_kv_in_pairs<T, In>(p);
    /* Half-precision K of one row block converted kMainMR keys at a time (qk_converting_blocks). */
    const bool keys_by_block = o_by_row && !std::is_same<T, In>::value;

    T* qp = scratch;
    T* s = qp + mp * D;
    T* o = s + N * mp; /* O[mp][Dv] by row, or O[Dv][mp] */
    T* row_max = o + Dv * mp;
    T* row_sum = row_max + mp;
    T* position = row_sum + mp;
    T* k_converted = position + mp;
    T* v_converted = k_converted + N * D;

    /* Pack Q (scaled) as [mp/RB][D][RB], L rows at a time; zero rows pad the last block. */
    constexpr int L = Vec<T>::lanes;
    const T scale = (T)p.scale;
    for (int64_t r0 = 0; r0 < mp; r0 += L) {
        const In* src[L];
        for (int u = 0; u < L; ++u) {
            const int64_t r = r0 + u, g = r / qn, i = q0 + r % qn, h = kvh * G + g;
            src[u] = r < rows ? at<In>(p.q, b * p.q_stride[0] + h * p.q_stride[1] + i * p.q_stride[2]) : nullptr;
            position[r] = (T)((r < rows ? i : q0) + p.offset);
            row_max[r] = neg_inf;
        }
        pack_rows<T, In>(src, scale, D, qp + (r0 / RB) * D * RB + r0 % RB, RB);
    }
    if (pairs) reorder_pair_depths(qp, D, RB);

    for (int sweep = 0; sweep < key_sweeps(p); ++sweep) {
        /* Each walk from empty sums and accumulators; the rerun's second keeps the first's maxima. */
        std::memset(o, 0, sizeof(T) * Dv * mp);
        std::fill(row_sum, row_sum + mp, T(0));
        int64_t lo, hi;
        sweep_visible_keys(p, sweep, b, q0, qn, k_begin, k_end, &lo, &hi);

        for (int64_t kt = lo; kt < hi; kt += N) {
            const int64_t n = std::min(N, hi - kt);
            if (p.mask_kind != MASK_NONE && mask_hides_tile(p, b, kvh, q0, qn, kt, n)) continue;
            KvTile<T, In> tile;
            if (!o_by_row)
                tile.load(p, b, kvh, kt, n, k_converted, v_converted);
            else if (!keys_by_block)
                tile.load_keys(p, b, kvh, kt, n, k_converted);
            const In* v_rows = at<In>(p.v, b * p.v_stride[0] + kvh * p.v_stride[1] + kt * p.v_stride[2]);

            /* The next tile's K and V rows and this tile's mask rows go to the prefetcher spread over
             * the tile's work: shares during the scores (the mask's there alone) and before each value
             * row of each P.V pass.  float32 tiles of one vector of rows with O by row, decodes that wait
             * on memory, split the lines between the two in proportion to their FMAs and issue the
             * scores' share every kDepthChunk steps (spread_scores_tile): with a share before each block
             * of 8 keys the lines came almost all during P.V, and memory idled through the scores
             * (bench_cpu.py C6q4 float32 on a 2-core Zen 5: 8.35 -> 7.07 ms, 66-73% -> 72-75% of the read).
             * The others keep the scores' loop free of the prefetch walk, a share before each block of
             * scores (as many lines a call as P.V's): half precision inputs are bound by their FMAs
             * (the spread made C6q4 float16 4-9% slower), and with two vectors of rows the walk's
             * registers spill the loop's. */
            const int64_t next_n = kt + N < hi ? std::min(N, hi - kt - N) : 0;
            SpreadPrefetch<In> ahead = KvTile<T, In>::next_lines(p, b, kvh, kt + N, next_n);
            MaskPrefetch mask_lines(p, b, kvh, q0, qn, rows, kt, n);
            int64_t score_calls = std::max<int64_t>(1, mp / RB * (n / kMainMR));
            const int64_t value_calls = o_by_row ? value_rows / kValueRows * value_passes<T, kValueVectors>(Dv) * n : 0;
            constexpr bool spread_capable = kValuesByRow && std::is_same<T, In>::value && NV == 1;
            const bool spread_scores = spread_capable && value_calls > 0; /* Dv of a vector or more */
            int64_t lines_per_score_call = (ahead.total_lines() + score_calls + value_calls - 1) / (score_calls + value_calls);
            int64_t lines_per_value_call = lines_per_score_call;
            if constexpr (spread_capable) {
                if (spread_scores) {
                    score_calls = std::max<int64_t>(1, n / 8 * ((D + kDepthChunk - 1) / kDepthChunk));
                    const int64_t score_lines = ahead.total_lines() * D / (D + Dv * value_rows / mp);
                    lines_per_score_call = (score_lines + score_calls - 1) / score_calls;
                    lines_per_value_call = (ahead.total_lines() - score_lines + value_calls - 1) / value_calls;
                }
            }
            const int64_t mask_lines_per_call = (mask_lines.total_lines() + score_calls - 1) / score_calls;

            /* S[j][rows] = K Qp^T (scale already in Qp). */
            auto issue_scores_share = [&] {
                ahead.issue(lines_per_score_call);
                mask_lines.issue(mask_lines_per_call);
            };
            if constexpr (spread_capable) {
                if (spread_scores) {
                    /* Without a mask, a hook without the mask's walk: the loop keeps its registers. */
                    if (mask_lines.total_lines() > 0)
                        spread_scores_tile<T>(n, tile.k, tile.k_stride, qp, D, s, mp, issue_scores_share);
                    else
                        spread_scores_tile<T>(n, tile.k, tile.k_stride, qp, D, s, mp,
                                              [&] { ahead.issue(lines_per_score_call); });
                }
            }
            if (keys_by_block) {
                const In* keys = at<In>(p.k, b * p.k_stride[0] + kvh * p.k_stride[1] + kt * p.k_stride[2]);
                qk_converting_blocks<T, In, NV>(row_block_keys(p, q0, qn, rows, 0, RB, kt, n), keys, p.k_stride[2],
                                                pairs, k_converted, qp, D, s, mp, issue_scores_share);
            } else if (!spread_scores) {
                for (int64_t rb = 0; rb < mp; rb += RB)
                    Blocked<T, NV>::qk_all(row_block_keys(p, q0, qn, rows, rb, RB, kt, n), tile.k, tile.k_stride,
                                           qp + rb * D, D, s + rb, mp, issue_scores_share);
            }

            finish_scores<T>(p, s, nullptr, mp, rows, n, kt, b, kvh, q0, qn, position, T(1));

            online_softmax<T>(s, n, mp, row_max, row_sum, o, Dv, T(1), StoreProbabilities<T>{s, n, mp}, o_by_row);

            /* O += (P o dropout)^T V; row_sum above took P before dropout. */
            if (p.dropout_p > 0) dropout_tile<T>(p, s, mp, 1, rows, n, kt, b, kvh, q0, qn, false);
            if (o_by_row) {
                auto issue = [&](int64_t steps) __attribute__((always_inline)) { ahead.issue(lines_per_value_call * steps); };
                for (int64_t r = 0; r < value_rows; r += kValueRows) {
                    const int64_t keys = row_block_keys(p, q0, qn, rows, r, kValueRows, kt, n);
                    if constexpr (reads_in_pair_order<T, In>()) {
                        if (pairs) {
                            add_weighted_values<T, In, kValueRows, kValueVectors, true, kValueShare>(
                                o + r * Dv, Dv, s + r, 1, mp, v_rows, p.v_stride[2], keys, skip, issue);
                            continue;
                        }
                    }
                    add_weighted_values<T, In, kValueRows, kValueVectors, false, kValueShare>(
                        o + r * Dv, Dv, s + r, 1, mp, v_rows, p.v_stride[2], keys, skip, issue);
                }
            } else {
                for (int64_t rb = 0; rb < mp; rb += RB) {
                    const int64_t keys = row_block_keys(p, q0, qn, rows, rb, RB, kt, n);
                    Blocked<T, NV>::pv_all(Dv, tile.v, tile.v_stride, 1, s + rb, mp, keys, o + rb, skip);
                }
            }
        }
    }

    /* Normalise and write: rows that saw no key get 0 and lse -inf.  O[Dv][rows] comes back to rows
     * L at a time (unpack_rows). */
    T* o_rows = v_converted + N * Dv; /* [L][Dv] */
    for (int64_t r0 = 0; r0 < rows; r0 += L) {
        if (!o_by_row) unpack_rows<T>(o + r0, mp, Dv, o_rows);
        for (int64_t r = r0; r < std::min<int64_t>(r0 + L, rows); ++r) {
            const int64_t g = r / qn, i = q0 + r % qn, h = kvh * G + g;
            if (pairs) reorder_pairs(o + r * Dv, Dv, true);
            write_row<T, In>(p, b, h, i, r, o_by_row ? o + r * Dv : o_rows + (r - r0) * Dv, row_max[r], row_sum[r],
                             partial_out, partial_lse);
        }
    }
}

/* ---- one work item with few rows (decode) -------------------------------------------------------- */

/* With R <= kDotMaxRows query rows, rows-as-lanes would leave most lanes idle.  Here the vectors
 * run along the head dimension instead: S[r][j] = dot(K[j], q[r]) (blocks of rows x keys, each K
 * vector loaded once for a block's rows, L dot products reduced together), the softmax runs along
 * keys, and O[r][:] += P[r][j] V[j][:] keeps R x CB vectors of O in registers while the tile's V
 * rows stream past.  Same masking, key range
 * and output conventions as forward_block. */
constexpr int kDotMaxRows = 8;

/* Rows whose scores share each K vector: RB x KB = L dot products a block (4 x 4 with 16 lanes),
 * so a step loads KB + RB vectors for L FMAs, not L + 1. */
template <typename T> constexpr int kDotRowBlock = Vec<T>::lanes >= 8 ? 4 : Vec<T>::lanes / 2;

/* s[r][u] = q[r] . keys[u] for RB rows (q's rows D apart) and KB = L / RB keys (keys' rows
 * key_stride apart, converted to T as they are loaded; Pairs: read in pair order, q's rows in pair
 * order too): L accumulators along D, reduced together; s's rows N apart.  between(D / L) first:
 * the block's share of the spread prefetch in one go (a call per step put the prefetch walk's dozen
 * instructions beside every L FMAs). */
template <typename T, int RB, typename In, bool Pairs, typename Between>
static inline void dot_scores_block(const T* q, int64_t D, const In* keys, int64_t key_stride, T* s, int64_t N,
                                    Between&& between) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes, KB = L / RB;
    V acc[L];
    FASTATTN_UNROLL for (int u = 0; u < L; ++u) acc[u] = V{};
    between(D / L);
    if constexpr (Pairs) {
        for (int64_t d = 0; d < D; d += 2 * L) {
            V even[KB], odd[KB];
            FASTATTN_UNROLL for (int u = 0; u < KB; ++u) load_pair_order<T>(keys + u * key_stride + d, even[u], odd[u]);
            FASTATTN_UNROLL for (int r = 0; r < RB; ++r) {
                const V q_even = vload<V>(q + r * D + d), q_odd = vload<V>(q + r * D + d + L);
                FASTATTN_UNROLL for (int u = 0; u < KB; ++u) {
                    acc[r * KB + u] += even[u] * q_even;
                    acc[r * KB + u] += odd[u] * q_odd;
                }
            }
        }
    } else {
        for (int64_t d = 0; d < D; d += L) {
            V k[KB];
            FASTATTN_UNROLL for (int u = 0; u < KB; ++u) k[u] = load_vector<T>(keys + u * key_stride + d);
            FASTATTN_UNROLL for (int r = 0; r < RB; ++r) {
                const V qv = vload<V>(q + r * D + d);
                FASTATTN_UNROLL for (int u = 0; u < KB; ++u) acc[r * KB + u] += k[u] * qv;
            }
        }
    }
    /* Lane r * KB + u is row r's score of key u: each row's KB scores go out as one copy. */
    alignas(64) T sums[L];
    vstore(sums, reduce_lanes_in_order<T>(acc));
    FASTATTN_UNROLL for (int r = 0; r < RB; ++r) std::memcpy(s + r * N, sums + r * KB, KB * sizeof(T));
}

/* The scores of `rows` rows against L keys: groups of RB rows, the rest in groups of RB / 2, ... */
template <typename T, int RB, typename In, bool Pairs, typename Between>
static void dot_scores(int64_t rows, const T* q, int64_t D, const In* keys, int64_t key_stride, T* s, int64_t N,
                       Between&& between) {
    constexpr int KB = Vec<T>::lanes / RB;
    int64_t r = 0;
    for (; r + RB <= rows; r += RB)
        for (int u = 0; u < Vec<T>::lanes; u += KB)
            dot_scores_block<T, RB, In, Pairs>(q + r * D, D, keys + u * key_stride, key_stride, s + r * N + u, N,
                                               between);
    if constexpr (RB > 1)
        if (r < rows) dot_scores<T, RB / 2, In, Pairs>(rows - r, q + r * D, D, keys, key_stride, s + r * N, N, between);
}

/* The decode rows' heads, queries and key positions (row r: head kvh * G + r / qn, query q0 + r % qn)
 * and their softmax state before the first key. */
template <typename T>
static inline void start_rows(const FwdParams& p, int64_t kvh, int64_t q0, int64_t qn, int rows, int64_t* head,
                              int64_t* query, T* position, T* row_max, T* row_sum) {
    for (int r = 0; r < rows; ++r) {
        head[r] = kvh * p.group + r / qn;
        query[r] = q0 + r % qn;
        position[r] = (T)(query[r] + p.offset);
        row_max[r] = -std::numeric_limits<T>::infinity();
        row_sum[r] = T(0);
    }
}

/* One key tile's scores of `rows` rows held along the keys (row r at s + r * N; n keys from kt)
 * become probabilities, in finish_scores' order: softcap, the mask, then causal/window hiding
 * (per-element work only where this tile needs it, forward_block's edge tests); then the online
 * softmax along each row, with its O row (o + r * Dv) rescaled, and dropout. */
template <typename T>
static inline void softmax_rows(const FwdParams& p, T* s, int64_t N, int rows, int64_t n, int64_t kt, int64_t b,
                                int64_t kvh, int64_t q0, int64_t qn, const int64_t* head, const int64_t* query,
                                const T* position, T* row_max, T* row_sum, T* o) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    const T neg_inf = -std::numeric_limits<T>::infinity();
    const int64_t Dv = p.head_dim_v, first_pos = q0 + p.offset, last_pos = q0 + qn - 1 + p.offset;
    const bool edges = (p.causal && kt + n - 1 > first_pos) || (p.window_left >= 0 && kt < last_pos - p.window_left) ||
                       (p.window_right >= 0 && kt + n - 1 > first_pos + p.window_right);
    if (p.softcap > 0)
        for (int r = 0; r < rows; ++r)
            for (int64_t j = 0; j < n; ++j) s[r * N + j] = (T)p.softcap * std::tanh(s[r * N + j] / (T)p.softcap);
    if (p.mask_kind != MASK_NONE) mask_rows<T>(p, s, N, head, query, rows, n, kt, b);
    for (int r = 0; r < rows; ++r) {
        T* row = s + r * N;
        for (int64_t j = 0; edges && j < n; ++j) {
            const T key = (T)(kt + j);
            const bool visible = !(p.causal && key > position[r]) &&
                                 !(p.window_left >= 0 && key < position[r] - (T)p.window_left) &&
                                 !(p.window_right >= 0 && key > position[r] + (T)p.window_right);
            if (!visible) row[j] = neg_inf;
        }
        /* Online softmax along the keys of this row. */
        T tile_max = neg_inf;
        int64_t j = 0;
        if (n >= L) {
            V lane_max = vload<V>(row);
            for (j = L; j + L <= n; j += L) lane_max = vmax(lane_max, vload<V>(row + j));
            for (int lane = 0; lane < L; ++lane) tile_max = std::max(tile_max, lane_max[lane]);
        }
        for (; j < n; ++j) tile_max = std::max(tile_max, row[j]);
        const T new_max = std::max(row_max[r], tile_max);
        const T shift = new_max == neg_inf ? T(0) : new_max;
        const T alpha = row_max[r] == neg_inf ? T(0) : std::exp(row_max[r] - shift);
        /* exp(s - shift) = 2^(s log2(e) - shift log2(e)): one FMA and vexp2_softmax. */
        const T shift2 = shift * kLog2e<T>;
        const V log2e = vbroadcast(kLog2e<T>), vshift2 = vbroadcast(shift2);
        V total = V{};
        for (j = 0; j + L <= n; j += L) {
            const V prob = vexp2_softmax(vload<V>(row + j) * log2e - vshift2);
            vstore(row + j, prob);
            total += prob;
        }
        T tail = 0;
        for (; j < n; ++j) {
            row[j] = row[j] == neg_inf ? T(0) : std::exp2(row[j] * kLog2e<T> - shift2);
            tail += row[j];
        }
        row_sum[r] = row_sum[r] * alpha + vsum<T>(total) + tail;
        row_max[r] = new_max;
        if (alpha != T(1))
            for (int64_t c = 0; c < Dv; ++c) o[r * Dv + c] *= alpha;
    }
    if (p.dropout_p > 0) dropout_tile<T>(p, s, 1, N, rows, n, kt, b, kvh, q0, qn, false);
}

/* One kv head's rows of a decode item: scratch (q [R][D] scaled, s [R][N], o [R][Dv], q's and o's
 * rows in pair order where reads_kv_in_pairs, and k_block [L][D], K rows converted where the level
 * converts element by element) and the running softmax. */
template <typename T, int R> struct DotHead {
    T* q;
    T* s;
    T* o;
    T* k_block;
    int64_t kvh;
    T row_max[R], row_sum[R], position[R];
    int64_t head[R], query[R];
};

/* Elements of one DotHead's scratch. */
template <typename T> static inline int64_t dot_head_elements(const FwdParams& p, int64_t rows) {
    return rows * (p.head_dim + p.key_tile + p.head_dim_v) + Vec<T>::lanes * p.head_dim;
}

template <typename T, typename In, int R>
static void dot_start(const FwdParams& p, DotHead<T, R>& h, T* scratch, int64_t b, int64_t kvh, int64_t q0,
                      int64_t qn) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v;
    h.q = scratch;
    h.s = h.q + R * D;
    h.o = h.s + R * p.key_tile;
    h.k_block = h.o + R * Dv;
    h.kvh = kvh;
    start_rows<T>(p, kvh, q0, qn, R, h.head, h.query, h.position, h.row_max, h.row_sum);
    const T scale = (T)p.scale;
    for (int r = 0; r < R; ++r) {
        convert_row(at<In>(p.q, b * p.q_stride[0] + h.head[r] * p.q_stride[1] + h.query[r] * p.q_stride[2]),
                    h.q + r * D, D);
        for (int64_t d = 0; d < D; ++d) h.q[r * D + d] *= scale;
        if (reads_kv_in_pairs<T, In>(p)) reorder_pairs(h.q + r * D, D, false);
    }
    std::memset(h.o, 0, sizeof(T) * R * Dv);
}

/* Keys kt..kt+n of head h: scores, softmax, O += P V; `ahead` (SpreadPrefetch) hands its lines to
 * the prefetcher spread over the tile's work. */
template <typename T, typename In, int R>
static void dot_tile(const FwdParams& p, DotHead<T, R>& h, int64_t b, int64_t q0, int64_t qn, int64_t kt, int64_t n,
                     const SpreadPrefetch<In>& next) {
    SpreadPrefetch<In> ahead = next; /* a local: its cursors stay in registers */
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    constexpr int CB = R >= 8 ? 2 : R >= 4 ? 4 : 8; /* O columns (vectors) held per row */
    const int64_t D = p.head_dim, Dv = p.head_dim_v, N = p.key_tile;
    const int64_t d_main = D / L * L;
    const bool skip = p.skip_zero_weights != 0, pairs = reads_kv_in_pairs<T, In>(p);
    T* q = h.q;
    T* s = h.s;
    T* o = h.o;

    /* K and V are read where they are; half-precision rows are converted as they are used, in
     * registers (once per score block of rows; bfloat16 in pair order where D and Dv allow), or
     * where the level converts element by element, K a block of L rows at a time into L1 scratch,
     * as every row reads it. */
    const In* k_rows = at<In>(p.k, b * p.k_stride[0] + h.kvh * p.k_stride[1] + kt * p.k_stride[2]);
    const In* v_rows = at<In>(p.v, b * p.v_stride[0] + h.kvh * p.v_stride[1] + kt * p.v_stride[2]);
    const int64_t k_row_stride = p.k_stride[2], v_row_stride = p.v_stride[2];
    /* issue(steps) hands over `steps` calls' share of `ahead`: D / L for a score block (R / RB blocks
     * per L keys), 1 for each value row. */
    const int64_t calls = std::max<int64_t>(1, R * (n / L) * (D / L) + value_passes<T, CB>(Dv) * n);
    const int64_t lines_per_call = (ahead.total_lines() + calls - 1) / calls;
    auto issue = [&](int64_t steps) __attribute__((always_inline)) { ahead.issue(lines_per_call * steps); };

    /* Scores: dot products along D.  Full blocks of L keys run as blocks of rows x keys whose L
     * accumulators are reduced together (dot_scores); the rest take one horizontal sum per score. */
    int64_t j_done = 0;
    if (d_main == D) {
        for (; j_done + L <= n; j_done += L) {
            const In* keys = k_rows + j_done * k_row_stride;
            if constexpr (reads_in_pair_order<T, In>()) {
                if (pairs) {
                    dot_scores<T, kDotRowBlock<T>, In, true>(R, q, D, keys, k_row_stride, s + j_done, N, issue);
                    continue;
                }
            }
            if constexpr (converts_in_registers<T, In>()) {
                dot_scores<T, kDotRowBlock<T>, In, false>(R, q, D, keys, k_row_stride, s + j_done, N, issue);
            } else {
                for (int jj = 0; jj < L; ++jj) convert_row(keys + jj * k_row_stride, h.k_block + jj * D, D);
                dot_scores<T, kDotRowBlock<T>, T, false>(R, q, D, h.k_block, D, s + j_done, N, issue);
            }
        }
    }
    for (int64_t j = j_done; j < n; ++j) {
        const In* key = k_rows + j * k_row_stride;
        V acc[R];
        for (int r = 0; r < R; ++r) acc[r] = V{};
        for (int64_t d = 0; d < d_main; d += L) {
            if constexpr (reads_in_pair_order<T, In>()) {
                if (pairs) { /* q in pair order: the block's even elements at d, its odd ones at d + L */
                    V even, odd;
                    load_pair_order<T>(key + d, even, odd);
                    for (int r = 0; r < R; ++r) {
                        acc[r] += even * vload<V>(q + r * D + d);
                        acc[r] += odd * vload<V>(q + r * D + d + L);
                    }
                    d += L;
                    continue;
                }
            }
            const V kv = load_vector<T>(key + d);
            for (int r = 0; r < R; ++r) acc[r] += kv * vload<V>(q + r * D + d);
        }
        for (int r = 0; r < R; ++r) {
            T total = vsum<T>(acc[r]);
            for (int64_t d = d_main; d < D; ++d) total += load_as<T>(key[d]) * q[r * D + d];
            s[r * N + j] = total;
        }
    }

    softmax_rows<T>(p, s, N, R, n, kt, b, h.kvh, q0, qn, h.head, h.query, h.position, h.row_max, h.row_sum, o);

    /* O[r][:] += P[r][j] V[j][:], CB vectors of each row's O in registers. */
    if (pairs)
        add_weighted_values<T, In, R, CB, reads_in_pair_order<T, In>()>(o, Dv, s, N, 1, v_rows, v_row_stride, n,
                                                                        skip, issue);
    else
        add_weighted_values<T, In, R, CB>(o, Dv, s, N, 1, v_rows, v_row_stride, n, skip, issue);
}

template <typename T, typename In, int R>
static void dot_finish(const FwdParams& p, DotHead<T, R>& h, int64_t b, T* partial_out, T* partial_lse) {
    for (int r = 0; r < R; ++r) {
        if (reads_kv_in_pairs<T, In>(p)) reorder_pairs(h.o + r * p.head_dim_v, p.head_dim_v, true);
        write_row<T, In>(p, b, h.head[r], h.query[r], r, h.o + r * p.head_dim_v, h.row_max[r], h.row_sum[r],
                         partial_out, partial_lse);
    }
}

/* ---- items, dispatch and the split-KV combine ------------------------------------------------------ */

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
/* bfloat16 items on AMX tiles: flash_amx.h, which the kernels_forward*.cpp include (active at the AMX level). */
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
    if (p.dtype == DTYPE_BFLOAT16 && amx_forward_applies(p, rows)) return KERNEL_AMX;
    if (p.dtype == DTYPE_BFLOAT16 && amx_decode_applies(p, rows)) return KERNEL_AMX_DECODE;
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

/* One kv head's rows of an item, on the kernel the rule picks. */
template <typename T, typename In>
static void run_head(const FwdParams& p, char* scratch, int64_t b, int64_t kvh, int64_t q0, int64_t qn,
                     int64_t k_begin, int64_t k_end, T* partial_out, T* partial_lse) {
#if defined(FASTATTN_HAS_AVX512BF16)
    if constexpr (std::is_same<In, bfloat16_bits>::value) {
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
