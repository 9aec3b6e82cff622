/* Flash attention backward for bfloat16 inputs on the bfloat16 dot-product units: AMX tiles (Intel
 * Sapphire Rapids and later) or AVX512_BF16 vectors (`vdpbf16ps`: AMD Zen 4 and later, Intel Cooper
 * Lake and later).
 *
 * The same three passes, work items, chunks and summation order as flash_backward.h; in pass 2
 * the five products move from float32 FMA vectors to `tdpbf16ps` tiles (flash_amx.h says what one
 * does and what it costs) or `vdpbf16ps` vectors (flash_bf16.h), so the float32 work between them,
 * the scores' finishing and P and dS, takes a larger share.  Per (key block of n keys, query tile of
 * mp rows, mp a multiple of 32):
 *
 *   S^T[keys][rows]  = K Q^T      K read in place, Q in pairs of dims              (scores_product)
 *   dP^T[keys][rows] = V dO^T     V read in place, dO in pairs of columns          (scores_product)
 *   P, dS in float32 from S, dP by the vector path's probability_gradient; then rounded to
 *   bfloat16, as FlashAttention's GPU backward rounds them, in two layouts:
 *     [keys][rows], the A operands of the next two products, and dS in pairs of keys, of the last
 *   dV[keys][cols] += P^T dO      A = P [keys][rows], B = dO in pairs of rows      (rows_product)
 *   dK[keys][dims] += dS^T Q      A = dS,             B = Q in pairs of rows       (rows_product)
 *   dQ^T[dims][rows] += K^T dS^T  K packed once per key block (AMX: K^T tiles; vectors: K in pairs of
 *                                 keys, broadcast), dS in pairs of keys           (dq_product)
 *
 * Q is not pre-scaled (a bfloat16 Q times scale would round again): S is scaled where masks or
 * softcap need scaled scores, else the scale rides in P's exponent; dK is scaled when written and
 * dQ in pass 3, as for the vector kernels.  dV, dK and dQ^T accumulate in float32 buffers: on AMX
 * one 2 x 2 block of C tiles at a time (two A and two B tiles feed four products, as in the
 * forward), on vectors pairs_dot's 8 x 2 register blocks.  dQ^T's tiles have mp rows (pass 3 reads them so).
 * Keys past the block's live keys and rows past the tile's are zero in every packed operand.
 *
 * Taken when: bfloat16 inputs, D and Dv multiples of 32 (the products' K dimension in steps of
 * 32), key_tile of 32, and no rerun that must skip zero weights; otherwise the vector kernels run.
 */
#ifndef FASTATTN_FLASH_BACKWARD_BF16_H
#define FASTATTN_FLASH_BACKWARD_BF16_H

#include "flash_amx.h"
#include "flash_backward.h"

#if defined(FASTATTN_HAS_AVX512BF16)

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

/* ---- the products, on the level's units ----------------------------------------------------------- */

#if defined(FASTATTN_HAS_AMX)
static inline void begin_products() { configure_tiles(); }
static inline void end_products() { _tile_release(); }

/* out^T[n][mp] = X Y^T: X's n rows (x_stride apart) read in place, Y in column pairs of `depth`.
 * The tile products have no step between blocks, so `between` (the vector level's prefetch hook)
 * is not called: the AMX backward prefetches no mask rows. */
template <typename Between>
static inline void scores_product(const uint16_t* x, int64_t x_stride, int64_t n, const uint16_t* y_columns,
                                  int64_t depth, float* out, int64_t mp, uint16_t* pad, Between&&) {
    tile_scores(x, x_stride, n, y_columns, depth, out, mp, pad);
}

/* C[m][cols] += A[m][k] B[k][cols], k = steps of 32, B in row pairs. */
static inline void rows_product(const uint16_t* a, int64_t a_stride, int64_t m, int64_t steps, const uint16_t* b_pairs,
                                int64_t cols, float* c) {
    pairs_product(a, a_stride, m, steps, b_pairs, cols, c);
}

/* The key block's `live` K rows as dq_product reads them. */
static inline void pack_keys_for_dq(const uint16_t* k, int64_t k_stride, int64_t live, int64_t D, uint16_t* out) {
    pack_values_transposed(k, k_stride, live, D, out);
}

/* dQ^T[D][mp] += K^T dS^T over the block's live keys, dS in pairs of keys (row tiles N * 16 apart). */
static inline void dq_product(const uint16_t* k_packed, int64_t live, const uint16_t* ds_pairs, int64_t N, int64_t D,
                              float* dq, int64_t mp) {
    tile_output(k_packed, (live + 31) / 32, ds_pairs, N, (live + 31) / 32, D, dq, mp);
}
#else
static inline void begin_products() {}
static inline void end_products() {}

/* between() runs before each block of kPairsMR rows of X (the tile's mask rows are prefetched there). */
template <typename Between>
static inline void scores_product(const uint16_t* x, int64_t x_stride, int64_t n, const uint16_t* y_columns,
                                  int64_t depth, float* out, int64_t mp, uint16_t*, Between&& between) {
    pairs_dot_tiles<false>(n, x, x_stride, 2, y_columns, depth * 16, depth / 2, out, mp, between);
}

/* C's columns two vectors at a time, its rows kPairsMR at a time: A's pairs broadcast. */
static inline void rows_product(const uint16_t* a, int64_t a_stride, int64_t m, int64_t steps, const uint16_t* b_pairs,
                                int64_t cols, float* c) {
    for (int64_t cb = 0; cb < cols / 16; cb += 2)
        pairs_dot_rows<2, true>(m, a, a_stride, 2, b_pairs + cb * 32, 32, 2 * cols, steps * 16, c + cb * 16, cols,
                                [] {});
}

/* K in row pairs [live/2][D][2] (a key past `live` zero): pair (K[2i][d], K[2i+1][d]) is broadcast. */
static inline void pack_keys_for_dq(const uint16_t* k, int64_t k_stride, int64_t live, int64_t D, uint16_t* out) {
    auto key_row = [&](int64_t j) -> const uint16_t* { return j < live ? k + j * k_stride : nullptr; };
    pack_row_pairs(key_row, round_up(live, 2), D, out);
}

static inline void dq_product(const uint16_t* k_packed, int64_t live, const uint16_t* ds_pairs, int64_t N, int64_t D,
                              float* dq, int64_t mp) {
    pairs_dot_tiles<true>(D, k_packed, 2, 2 * D, ds_pairs, N * 16, (live + 1) / 2, dq, mp, [] {});
}
#endif

static bool pairs_backward_applies(const FwdParams& p) {
    return p.head_dim % 32 == 0 && p.head_dim_v % 32 == 0 && p.key_tile % 32 == 0 && !p.skip_zero_weights;
}

/* Rows of the dQ^T tiles pass 2 writes on pairs are padded to this (pass 3 must read them so). */
constexpr int64_t kPairsRowAlign = 32;

/* One gradient item's buffers, carved from the thread's scratch (64-byte aligned). */
struct PairsBackwardBuffers {
    float *dk, *dv, *s, *dp, *cap_grad, *keep, *lse2, *delta, *position;
    uint16_t *k_transposed, *pad, *q_columns, *do_columns, *q_rows, *do_rows, *p_keys, *ds_keys, *ds_pairs;

    static int64_t bytes(const FwdParams& p) { return PairsBackwardBuffers().carve(p, nullptr); }

    int64_t carve(const FwdParams& p, char* base) {
        const int64_t mp = round_up(p.group * p.block_queries, kPairsRowAlign), N = p.key_tile;
        const int64_t D = p.head_dim, Dv = p.head_dim_v;
        const int64_t sizes[] = {4 * N * D,  4 * N * Dv, 4 * N * mp,  4 * N * mp,  4 * N * mp,
                                 4 * N * mp, 4 * mp,     4 * mp,      4 * mp,      2 * D * N,
                                 2 * 16 * std::max(D, Dv), 2 * mp * D, 2 * mp * Dv, 2 * mp * D, 2 * mp * Dv,
                                 2 * N * mp, 2 * N * mp, 2 * N * mp};
        void** slots[] = {(void**)&dk,           (void**)&dv,        (void**)&s,          (void**)&dp,
                          (void**)&cap_grad,     (void**)&keep,      (void**)&lse2,       (void**)&delta,
                          (void**)&position,     (void**)&k_transposed, (void**)&pad,     (void**)&q_columns,
                          (void**)&do_columns,   (void**)&q_rows,    (void**)&do_rows,    (void**)&p_keys,
                          (void**)&ds_keys,      (void**)&ds_pairs};
        static_assert(sizeof(sizes) / sizeof(sizes[0]) == sizeof(slots) / sizeof(slots[0]), "one size a slot");
        int64_t offset = 0;
        for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
            if (base) *slots[i] = base + offset;
            offset += align64(sizes[i]);
        }
        return offset;
    }
};

/* Pack one query tile's rows (heads of the group stacked, as everywhere): Q and dO in pairs of
 * columns (B of S and dP) and in pairs of rows (B of dK and dV); lse log2(e) (+inf for a row that
 * saw no key or pads the tile, so that its P is 0), delta and key position per row.  Returns mp. */
static int64_t pack_query_tile(const BwdParams& bp, int64_t b, int64_t kvh, int64_t q0, int64_t qn,
                               const PairsBackwardBuffers& t) {
    const FwdParams& p = bp.f;
    const int64_t rows = p.group * qn, mp = round_up(rows, kPairsRowAlign);
    auto head = [&](int64_t r) { return kvh * p.group + r / qn; };
    auto q_row = [&](int64_t r) -> const uint16_t* {
        if (r >= rows) return nullptr;
        return at<uint16_t>(p.q, b * p.q_stride[0] + head(r) * p.q_stride[1] + (q0 + r % qn) * p.q_stride[2]);
    };
    auto do_row = [&](int64_t r) -> const uint16_t* {
        if (r >= rows) return nullptr;
        return at<uint16_t>(bp.dout, b * bp.dout_stride[0] + head(r) * bp.dout_stride[1] + (q0 + r % qn) * bp.dout_stride[2]);
    };
    pack_column_pairs(q_row, mp, p.head_dim, t.q_columns);
    pack_column_pairs(do_row, mp, p.head_dim_v, t.do_columns);
    pack_row_pairs(q_row, mp, p.head_dim, t.q_rows);
    pack_row_pairs(do_row, mp, p.head_dim_v, t.do_rows);
    const float inf = std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < mp; ++r) {
        if (r >= rows) {
            t.lse2[r] = inf;
            t.delta[r] = 0.0f;
            t.position[r] = (float)(q0 + p.offset);
            continue;
        }
        const int64_t h = head(r), i = q0 + r % qn;
        const float saved = *(reinterpret_cast<const float*>(p.lse) + b * p.lse_stride[0] + h * p.lse_stride[1] +
                              i * p.lse_stride[2]);
        t.lse2[r] = saved == -inf ? inf : saved * kLog2e<float>;
        t.delta[r] = reinterpret_cast<const float*>(bp.delta)[(b * p.heads_q + h) * p.seq_q + i];
        t.position[r] = (float)(i + p.offset);
    }
    return mp;
}

/* P and dS of one (key block, query tile) from S (s) and dP (dp), rounded to bfloat16 as the
 * products read them: P o dropout and dS as [keys][rows] up to the next multiple of 16 keys, dS in
 * pairs of keys ([mp/16][N/2][16][2]) up to the next multiple of 32; keys from `live` on are 0.
 * Row blocks outer, so each block's lse and delta stay in registers; the features are template
 * arguments, so the inner loop has no test of them. */
template <bool Dropout, bool Softcap>
static void gradients_to_bfloat16_as(const float* s, const float* dp, const float* keep, const float* cap_grad,
                                     const float* lse2, const float* delta, float score_log2e, int64_t live,
                                     int64_t mp, int64_t N, uint16_t* p_keys, uint16_t* ds_keys, uint16_t* ds_pairs) {
    typedef Vec<float>::type V;
    const int64_t keys16 = round_up(live, 16), keys32 = round_up(live, 32);
    const __m512i interleave = interleave_halves_index();
    for (int64_t r = 0; r < mp; r += 16) {
        const V row_lse2 = vload<V>(lse2 + r), row_delta = vload<V>(delta + r);
        uint16_t* pairs = ds_pairs + (r / 16) * N * 16;
        for (int64_t j = 0; j < keys32; j += 2) {
            __m512 kept[2], grad[2];
            for (int u = 0; u < 2; ++u) {
                const int64_t e = (j + u) * mp + r;
                if (j + u >= live) {
                    kept[u] = grad[u] = _mm512_setzero_ps();
                    continue;
                }
                V k, g;
                probability_gradient<float>(vload<V>(s + e), vload<V>(dp + e), row_lse2, row_delta, score_log2e,
                                            Dropout ? keep + e : nullptr, Softcap ? cap_grad + e : nullptr, &k, &g);
                kept[u] = (__m512)k;
                grad[u] = (__m512)g;
            }
            const __m512i ds_both = (__m512i)_mm512_cvtne2ps_pbh(grad[1], grad[0]);
            _mm512_storeu_si512(pairs + j * 16, _mm512_permutexvar_epi16(interleave, ds_both));
            if (j >= keys16) continue;
            const __m512i p_both = (__m512i)_mm512_cvtne2ps_pbh(kept[1], kept[0]);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_keys + j * mp + r), _mm512_castsi512_si256(p_both));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_keys + (j + 1) * mp + r), _mm512_extracti64x4_epi64(p_both, 1));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(ds_keys + j * mp + r), _mm512_castsi512_si256(ds_both));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(ds_keys + (j + 1) * mp + r),
                                _mm512_extracti64x4_epi64(ds_both, 1));
        }
    }
}

static void gradients_to_bfloat16(const FwdParams& p, const PairsBackwardBuffers& t, float score_log2e, int64_t live,
                                  int64_t mp) {
#define FASTATTN_GRADIENTS(DROPOUT, SOFTCAP)                                                                   \
    gradients_to_bfloat16_as<DROPOUT, SOFTCAP>(t.s, t.dp, t.keep, t.cap_grad, t.lse2, t.delta, score_log2e, live, \
                                               mp, p.key_tile, t.p_keys, t.ds_keys, t.ds_pairs)
    const bool dropout = p.dropout_p > 0, softcap = p.softcap > 0;
    if (dropout && softcap)
        FASTATTN_GRADIENTS(true, true);
    else if (dropout)
        FASTATTN_GRADIENTS(true, false);
    else if (softcap)
        FASTATTN_GRADIENTS(false, true);
    else
        FASTATTN_GRADIENTS(false, false);
#undef FASTATTN_GRADIENTS
}

/* Pass 2 on pairs: dK and dV of the key blocks of one chunk of one kv head, and the chunk's dQ
 * partial, as gradient_block (flash_backward.h) computes them. */
static void gradient_block_pairs(const BwdParams& bp, char* scratch, int64_t b, int64_t kvh, int64_t chunk) {
    const FwdParams& p = bp.f;
    const int64_t D = p.head_dim, Dv = p.head_dim_v, N = p.key_tile, BQ = p.block_queries;
    PairsBackwardBuffers t;
    t.carve(p, scratch);
    clear_dq_partials<float>(bp, b, kvh, chunk);
    /* Masks and softcap see scaled scores; otherwise the scale rides in P's exponent. */
    const bool scale_first = p.softcap > 0 || p.mask_kind != MASK_NONE;
    const float scale = (float)p.scale, score_log2e = (scale_first ? 1.0f : scale) * kLog2e<float>;
    begin_products();
    const int64_t kb_end = std::min(bp.key_blocks, (chunk + 1) * bp.chunk_blocks);
    for (int64_t kb = chunk * bp.chunk_blocks; kb < kb_end; ++kb) {
        const int64_t k0 = kb * N, n = std::min(N, p.seq_k - k0);
        std::memset(t.dk, 0, sizeof(float) * N * D);
        std::memset(t.dv, 0, sizeof(float) * N * Dv);
        const int64_t live = live_keys(p, b, k0, n);
        if (live > 0) {
            int64_t i_lo, i_hi;
            seeing_queries(p, k0, live, &i_lo, &i_hi);
            const uint16_t* k = at<uint16_t>(p.k, b * p.k_stride[0] + kvh * p.k_stride[1] + k0 * p.k_stride[2]);
            const uint16_t* v = at<uint16_t>(p.v, b * p.v_stride[0] + kvh * p.v_stride[1] + k0 * p.v_stride[2]);
            pack_keys_for_dq(k, p.k_stride[2], live, D, t.k_transposed);
            const int64_t keys16 = round_up(live, 16);
            /* Whole query blocks (pass 3's), so rows of a block outside [i_lo, i_hi) get P = dS = 0. */
            for (int64_t qb = std::max<int64_t>(i_lo, 0) / BQ; qb * BQ < i_hi; ++qb) {
                const int64_t q0 = qb * BQ, qn = std::min(BQ, p.seq_q - q0), rows = p.group * qn;
                if (p.mask_kind != MASK_NONE && mask_hides_tile(p, b, kvh, q0, qn, k0, live)) continue;
                const int64_t mp = pack_query_tile(bp, b, kvh, q0, qn, t);
                MaskPrefetch mask_lines(p, b, kvh, q0, qn, rows, k0, live);
                const int64_t calls = std::max<int64_t>(1, 2 * ((mp + 31) / 32) * (live / kPairsMR));
                const int64_t mask_lines_per_call = (mask_lines.total_lines() + calls - 1) / calls;
                auto issue = [&] { mask_lines.issue(mask_lines_per_call); };
                if (mask_lines.total_lines() > 0) { /* else no hook: the products keep their registers */
                    scores_product(k, p.k_stride[2], live, t.q_columns, D, t.s, mp, t.pad, issue);
                    scores_product(v, p.v_stride[2], live, t.do_columns, Dv, t.dp, mp, t.pad, issue);
                } else {
                    scores_product(k, p.k_stride[2], live, t.q_columns, D, t.s, mp, t.pad, [] {});
                    scores_product(v, p.v_stride[2], live, t.do_columns, Dv, t.dp, mp, t.pad, [] {});
                }
                finish_scores<float>(p, t.s, t.cap_grad, mp, rows, live, k0, b, kvh, q0, qn, t.position, scale);
                if (p.dropout_p > 0) {
                    std::memset(t.keep, 0, sizeof(float) * live * mp);
                    dropout_tile<float>(p, t.keep, mp, 1, rows, live, k0, b, kvh, q0, qn, true);
                }
                gradients_to_bfloat16(p, t, score_log2e, live, mp);
                rows_product(t.p_keys, mp, keys16, mp / 32, t.do_rows, Dv, t.dv);
                rows_product(t.ds_keys, mp, keys16, mp / 32, t.q_rows, D, t.dk);
                dq_product(t.k_transposed, live, t.ds_pairs, N, D, dq_partial_tile<float>(bp, chunk, b, kvh, qb), mp);
            }
        }
        write_key_gradients<float, bfloat16_bits>(bp, b, kvh, k0, n, t.dk, t.dv, scale);
    }
    end_products();
}

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
#endif
