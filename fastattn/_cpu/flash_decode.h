/* The forward's items of few rows (decodes).  With R <= kDotMaxRows query rows, rows-as-lanes would
 * leave most lanes idle.  Here the vectors run along the head dimension instead: S[r][j] =
 * dot(K[j], q[r]) (blocks of rows x keys, each K vector loaded once for a block's rows, L dot
 * products reduced together), the softmax runs along keys, and O[r][:] += P[r][j] V[j][:] keeps
 * R x CB vectors of O in registers while the tile's V rows stream past.  Same masking, key range
 * and output conventions as forward_block (flash_forward.h). */
#ifndef FASTATTN_FLASH_DECODE_H
#define FASTATTN_FLASH_DECODE_H

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "forward_tiles.h"
#include "micro_kernels.h"

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

constexpr int kDotMaxRows = 8;

/* Rows whose scores share each K vector: RB x KB = L dot products a block (4 x 4 with 16 lanes),
 * so a step loads KB + RB vectors for L FMAs, not L + 1. */
template <typename T> constexpr int kDotRowBlock = Vec<T>::lanes >= 8 ? 4 : Vec<T>::lanes / 2;

/* Whether a score block hands its D / L shares of the spread prefetch over one per step of L depths
 * rather than all before its first step.  float32: all at once; a call per step put the prefetch
 * walk's dozen instructions beside every L FMAs (C6's shape, one kv head's 512 keys in cache, one
 * thread: 22.7 -> 27.8 ns a key, and no gain streamed).  float16/bfloat16, whose steps also widen
 * K: one per step, so that a block's burst of prefetches no longer waits ahead of its arithmetic.
 * 2-core Xeon model 207, C6's shape (B8, Hkv 8, 4096 keys, GQA 4) streamed on 2 threads, builds
 * alternated, paired medians of the old time over the new: bfloat16 1.07, 0.99 and 1.01 (10, 10
 * and 16 pairs; benchmarks/kernel_ab.py or the like), 1.01 through fastattn.attention (8 pairs of
 * processes); float16 1.04, 0.93, 1.06 and 1.06 (the longest series faster in 13 of 16 pairs).  A
 * small gain, at times inside the host's noise; one head in cache unchanged. */
template <typename T, typename In> constexpr bool kPrefetchEachStep = !std::is_same<T, In>::value;

/* s[r][u] = q[r] . keys[u] for RB rows and KB = L / RB keys (keys' rows key_stride apart, converted
 * to T as they are loaded; Pairs: read in pair order, q's rows in pair order too): L accumulators
 * along D, reduced together; s's rows N apart.  q in depth blocks (DotHead::q_blocks): row r's
 * vector of depths d .. d + L at q + r * L + (d / L) * QStep, so one register walks every row's q
 * and the rows' offsets are constants (with a pointer a row, GCC spilled the general registers of
 * the loop, the prefetch walk's among them).  The block's D / L shares of the spread prefetch go to
 * between() as kPrefetchEachStep says. */
template <typename T, int RB, typename In, bool Pairs, int64_t QStep, typename Between>
static inline void dot_scores_block(const T* q, int64_t D, const In* keys, int64_t key_stride, T* s, int64_t N,
                                    Between&& between) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes, KB = L / RB;
    constexpr bool each_step = kPrefetchEachStep<T, In>;
    V acc[L];
    FASTATTN_UNROLL for (int u = 0; u < L; ++u) acc[u] = V{};
    if constexpr (!each_step) between(D / L);
    if constexpr (Pairs) {
        /* Each parity's q vectors a loop of their own, so that RB q vectors, not 2 RB, are live beside
         * the accumulators and K's vectors: within 16 registers, held there by hold_in_register.
         * With both at once GCC read q from memory at every FMA (twice as many loads, on Zen 1's
         * 128-bit load ports; the split alone made the 4-row bfloat16 decode in cache 1.04x faster on
         * a 2-core Zen 1).  The same FMAs in the same order per accumulator. */
        for (int64_t d = 0; d < D; d += 2 * L, q += 2 * QStep) {
            if constexpr (each_step) between(2);
            V even[KB], odd[KB];
            FASTATTN_UNROLL for (int u = 0; u < KB; ++u) load_pair_order<T>(keys + u * key_stride + d, even[u], odd[u]);
            FASTATTN_UNROLL for (int r = 0; r < RB; ++r) {
                V q_even = vload<V>(q + r * L);
                hold_in_register(q_even);
                FASTATTN_UNROLL for (int u = 0; u < KB; ++u) acc[r * KB + u] += even[u] * q_even;
            }
            FASTATTN_UNROLL for (int r = 0; r < RB; ++r) {
                V q_odd = vload<V>(q + QStep + r * L);
                hold_in_register(q_odd);
                FASTATTN_UNROLL for (int u = 0; u < KB; ++u) acc[r * KB + u] += odd[u] * q_odd;
            }
        }
    } else {
        for (int64_t d = 0; d < D; d += L, q += QStep) {
            if constexpr (each_step) between(1);
            V k[KB];
            FASTATTN_UNROLL for (int u = 0; u < KB; ++u) k[u] = load_vector<T>(keys + u * key_stride + d);
            FASTATTN_UNROLL for (int r = 0; r < RB; ++r) {
                V qv = vload<V>(q + r * L);
                hold_in_register(qv);
                FASTATTN_UNROLL for (int u = 0; u < KB; ++u) acc[r * KB + u] += k[u] * qv;
            }
        }
    }
    /* Lane r * KB + u is row r's score of key u: each row's KB scores go out as one copy. */
    alignas(64) T sums[L];
    vstore(sums, reduce_lanes_in_order<T>(acc));
    FASTATTN_UNROLL for (int r = 0; r < RB; ++r) std::memcpy(s + r * N, sums + r * KB, KB * sizeof(T));
}

/* The scores of `rows` rows against L keys: groups of RB rows, the rest in groups of RB / 2, ...
 * (q in depth blocks QStep apart, as dot_scores_block reads it). */
template <typename T, int RB, typename In, bool Pairs, int64_t QStep, typename Between>
static void dot_scores(int64_t rows, const T* q, int64_t D, const In* keys, int64_t key_stride, T* s, int64_t N,
                       Between&& between) {
    constexpr int L = Vec<T>::lanes, KB = L / RB;
    int64_t r = 0;
    for (; r + RB <= rows; r += RB)
        for (int u = 0; u < L; u += KB)
            dot_scores_block<T, RB, In, Pairs, QStep>(q + r * L, D, keys + u * key_stride, key_stride, s + r * N + u,
                                                      N, between);
    if constexpr (RB > 1)
        if (r < rows)
            dot_scores<T, RB / 2, In, Pairs, QStep>(rows - r, q + r * L, D, keys, key_stride, s + r * N, N, between);
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
 * softmax along each row, rescale(r, alpha) where row r's running maximum moved (its O times
 * alpha), and dropout. */
template <typename T, typename Rescale>
static inline void softmax_rows_rescaled(const FwdParams& p, T* s, int64_t N, int rows, int64_t n, int64_t kt,
                                         int64_t b, int64_t kvh, int64_t q0, int64_t qn, const int64_t* head,
                                         const int64_t* query, const T* position, T* row_max, T* row_sum,
                                         Rescale&& rescale) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    const T neg_inf = -std::numeric_limits<T>::infinity();
    const Band band(p);
    const BandEdges edges = band.edges(kt, n, q0 + p.offset, q0 + qn - 1 + p.offset);
    const T left = (T)band.left, right = (T)band.right;
    if (p.softcap > 0)
        for (int r = 0; r < rows; ++r)
            for (int64_t j = 0; j < n; ++j) s[r * N + j] = (T)p.softcap * std::tanh(s[r * N + j] / (T)p.softcap);
    if (p.mask_kind != MASK_NONE) mask_rows<T>(p, s, N, head, query, rows, n, kt, b);
    for (int r = 0; r < rows; ++r) {
        T* row = s + r * N;
        for (int64_t j = 0; edges.any() && j < n; ++j) {
            const T key = (T)(kt + j);
            const bool visible = (!edges.left || Band::within_left(key, position[r], left)) &&
                                 (!edges.right || Band::within_right(key, position[r], right));
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
        if (alpha != T(1)) rescale(r, alpha);
    }
    if (p.dropout_p > 0) dropout_tile<T>(p, s, 1, N, rows, n, kt, b, kvh, q0, qn, false);
}

/* softmax_rows_rescaled with O's rows at o + r * Dv. */
template <typename T>
static inline void softmax_rows(const FwdParams& p, T* s, int64_t N, int rows, int64_t n, int64_t kt, int64_t b,
                                int64_t kvh, int64_t q0, int64_t qn, const int64_t* head, const int64_t* query,
                                const T* position, T* row_max, T* row_sum, T* o) {
    const int64_t Dv = p.head_dim_v;
    softmax_rows_rescaled<T>(p, s, N, rows, n, kt, b, kvh, q0, qn, head, query, position, row_max, row_sum,
                             [o, Dv](int r, T alpha) {
                                 for (int64_t c = 0; c < Dv; ++c) o[r * Dv + c] *= alpha;
                             });
}

/* One kv head's rows of a decode item: scratch (q [R][D] scaled, s [R][N], o [R][Dv], q's and o's
 * rows in pair order where reads_kv_in_pairs, k_block [L][D], K rows converted where the level
 * converts element by element, and q_blocks [D / L][R][L], q again in depth blocks for the scores'
 * blocks of L keys, filled where L divides D) and the running softmax. */
template <typename T, int R> struct DotHead {
    T* q;
    T* q_blocks;
    T* s;
    T* o;
    T* k_block;
    int64_t kvh;
    T row_max[R], row_sum[R], position[R];
    int64_t head[R], query[R];
};

template <typename T, typename In, int R>
static void dot_start(const FwdParams& p, DotHead<T, R>& h, T* scratch, int64_t b, int64_t kvh, int64_t q0,
                      int64_t qn) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v;
    h.q = scratch;
    h.s = h.q + R * D;
    h.o = h.s + R * p.key_tile;
    h.k_block = h.o + R * Dv;
    h.q_blocks = h.k_block + Vec<T>::lanes * D;
    h.kvh = kvh;
    start_rows<T>(p, kvh, q0, qn, R, h.head, h.query, h.position, h.row_max, h.row_sum);
    const T scale = (T)p.scale;
    for (int r = 0; r < R; ++r) {
        convert_row(at<In>(p.q, b * p.q_stride[0] + h.head[r] * p.q_stride[1] + h.query[r] * p.q_stride[2]),
                    h.q + r * D, D);
        for (int64_t d = 0; d < D; ++d) h.q[r * D + d] *= scale;
        if (reads_kv_in_pairs<T, In>(p)) reorder_pairs(h.q + r * D, D, false);
    }
    constexpr int L = Vec<T>::lanes;
    if (D % L == 0)
        for (int64_t block = 0; block < D / L; ++block)
            for (int r = 0; r < R; ++r)
                std::memcpy(h.q_blocks + (block * R + r) * L, h.q + r * D + block * L, sizeof(T) * L);
    std::memset(h.o, 0, sizeof(T) * R * Dv);
}

/* The decode's P.V holds rows x CB vectors of O in registers while V's rows stream past
 * (add_weighted_values), CB value vectors beside them.  With 32 vector registers, all R rows at
 * once, CB = 2 (8 rows), 4 (4-7 rows) or 8.  With 16, CB = 2 (3 rows or more), 4 (2 rows) or 8:
 * the 4 x 4 block of 32 registers spilled its accumulators to the stack around every FMA there (a
 * 4-row bfloat16 decode, C6's shape streamed: 1.14x faster as 4 x 2 on a 2-core Zen 1, EPYC family
 * 23 model 1; float32 1.06x, float16 1.05x).  float32 rows past 4 go in a second pass (8 x 2
 * spills too: 8-row float32 decodes 1.05x faster so); float16/bfloat16 keep one pass of 8 x 2,
 * as a second pass converts V's rows again (0.97x bfloat16, 0.89x float16). */
template <typename T, typename In, int R>
constexpr int kDotPassRows = FASTATTN_VECTOR_BYTES == 64 || R <= 4 || !std::is_same<T, In>::value ? R : 4;
template <int Rows> constexpr int kDotValueVectors =
    FASTATTN_VECTOR_BYTES == 64 ? (Rows >= 8 ? 2 : Rows >= 4 ? 4 : 8) : (Rows >= 3 ? 2 : Rows == 2 ? 4 : 8);

/* Vector passes of dot_values over Dv columns (value_passes per block of rows). */
template <typename T, typename In, int R> constexpr int64_t dot_value_passes(int64_t Dv) {
    constexpr int rows = kDotPassRows<T, In, R>;
    if constexpr (rows < R)
        return value_passes<T, kDotValueVectors<rows>>(Dv) + dot_value_passes<T, In, R - rows>(Dv);
    else
        return value_passes<T, kDotValueVectors<rows>>(Dv);
}

/* Value rows per call of between() in dot_values: 4 from AVX2 up, so that the prefetch walk's tests
 * and branches come once per 4 rows' 4 x 8 FMAs, not beside every row's (C6's shape on a 2-core
 * Zen 1, EPYC family 23 model 1, benchmarks/kernel_ab.py against 1 a row, paired medians at the
 * avx2 level: streamed float32 1.021-1.042, bfloat16 1.012-1.016, float16 1.015-1.024, 8 rows
 * float32 1.11; in cache float32 1.036, bfloat16 1.018; 8 a call gained nothing more).  The generic
 * level (SSE pairs for each vector) measured 0.975-0.981 streamed with 4: 1 there.  At the avx512
 * level on a 2-core Xeon (family 6 model 167), 4 against 1 a row, streamed, 8-10 paired rounds:
 * bfloat16 1.026-1.030, float32 1.014, 8-row float32 0.972-0.981, float16 0.948-0.965; in cache
 * float32 0.979, bfloat16 1.002.  Mixed within a few percent, so AVX-512 keeps AVX2's 4 rather than
 * a constant per dtype fitted to one machine. */
#if defined(__AVX2__)
constexpr int kDotValueShare = 4;
#else
constexpr int kDotValueShare = 1;
#endif

/* O[r][:] += P[r][j] V[j][:] for R rows (O's rows Dv apart, P's N apart), kDotPassRows rows at a
 * time; between as add_weighted_values takes it, kDotValueShare rows a call. */
template <typename T, typename In, int R, bool Pairs, typename Between>
static void dot_values(T* o, int64_t Dv, const T* s, int64_t N, const In* v, int64_t v_stride, int64_t n, bool skip,
                       Between&& between) {
    constexpr int rows = kDotPassRows<T, In, R>;
    add_weighted_values<T, In, rows, kDotValueVectors<rows>, Pairs, kDotValueShare>(o, Dv, s, N, 1, v, v_stride, n,
                                                                                    skip, between);
    if constexpr (rows < R)
        dot_values<T, In, R - rows, Pairs>(o + rows * Dv, Dv, s + rows * N, N, v, v_stride, n, skip, between);
}

/* Keys kt..kt+n of head h: scores, softmax, O += P V; `ahead` (SpreadPrefetch) hands its lines to
 * the prefetcher spread over the tile's work. */
template <typename T, typename In, int R>
static void dot_tile(const FwdParams& p, DotHead<T, R>& h, int64_t b, int64_t q0, int64_t qn, int64_t kt, int64_t n,
                     const SpreadPrefetch<In>& next) {
    SpreadPrefetch<In> ahead = next; /* a local: its cursors stay in registers */
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
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
     * per L keys), 1 for each value row (kDotValueShare at a time). */
    const int64_t calls = std::max<int64_t>(1, R * (n / L) * (D / L) + dot_value_passes<T, In, R>(Dv) * n);
    int64_t upfront;
    const int64_t lines_per_call = prefetch_share(ahead.total_lines(), calls, &upfront);
    ahead.issue(upfront);
    auto issue = [&](int64_t steps) __attribute__((always_inline)) { ahead.issue(lines_per_call * steps); };

    /* Scores: dot products along D.  Full blocks of L keys run as blocks of rows x keys whose L
     * accumulators are reduced together (dot_scores); the rest take one horizontal sum per score. */
    int64_t j_done = 0;
    if (d_main == D) {
        for (; j_done + L <= n; j_done += L) {
            const In* keys = k_rows + j_done * k_row_stride;
            if constexpr (reads_in_pair_order<T, In>()) {
                if (pairs) {
                    dot_scores<T, kDotRowBlock<T>, In, true, R * L>(R, h.q_blocks, D, keys, k_row_stride, s + j_done, N,
                                                                  issue);
                    continue;
                }
            }
            if constexpr (converts_in_registers<T, In>()) {
                dot_scores<T, kDotRowBlock<T>, In, false, R * L>(R, h.q_blocks, D, keys, k_row_stride, s + j_done, N,
                                                                   issue);
            } else {
                for (int jj = 0; jj < L; ++jj) convert_row(keys + jj * k_row_stride, h.k_block + jj * D, D);
                dot_scores<T, kDotRowBlock<T>, T, false, R * L>(R, h.q_blocks, D, h.k_block, D, s + j_done, N, issue);
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

    /* O[r][:] += P[r][j] V[j][:] (dot_values). */
    if (pairs)
        dot_values<T, In, R, reads_in_pair_order<T, In>()>(o, Dv, s, N, v_rows, v_row_stride, n, skip, issue);
    else
        dot_values<T, In, R, false>(o, Dv, s, N, v_rows, v_row_stride, n, skip, issue);
}

template <typename T, typename In, int R>
static void dot_finish(const FwdParams& p, DotHead<T, R>& h, int64_t b, T* partial_out, T* partial_lse) {
    for (int r = 0; r < R; ++r) {
        if (reads_kv_in_pairs<T, In>(p)) reorder_pairs(h.o + r * p.head_dim_v, p.head_dim_v, true);
        write_row<T, In>(p, b, h.head[r], h.query[r], r, h.o + r * p.head_dim_v, h.row_max[r], h.row_sum[r],
                         partial_out, partial_lse);
    }
}

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
