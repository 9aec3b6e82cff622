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
 * Scratch per thread: O((M + key_tile) * (D + Dv) + key_tile * M) elements, independent of Sq, Sk.
 *
 * The forward's files, each one job: visibility.h (the causal/window rule, Band, whose projections
 * every key range, edge test and hidden key comes from), forward_tiles.h (what every forward path
 * and the backward share: non-finite bookkeeping, the spread prefetch, visible keys, the scores'
 * finishing, dropout, K/V tile sources, the row output, the online softmax), micro_kernels.h (the
 * register-blocked products), this file (forward_block, one work item), flash_decode.h (items of
 * few rows, DotKernel) and forward_items.h (the items' order, the kernel rule, K and V converted
 * once per call, the head-group decode and the split-KV combine).
 */
#ifndef FASTATTN_FLASH_FORWARD_H
#define FASTATTN_FLASH_FORWARD_H

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "forward_tiles.h"
#include "micro_kernels.h"

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

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
                mask_lines.issue<2>(mask_lines_per_call);
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

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
