/* Flash attention backward for bfloat16 inputs on the bfloat16 dot-product units: AMX tiles (Intel
 * Sapphire Rapids and later) or AVX512_BF16 vectors (`vdpbf16ps`: AMD Zen 4 and later, Intel Cooper
 * Lake and later); for float16 inputs on AMX tiles, as bfloat16 parts.
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
 * float16 (AMX only): every operand as two bfloat16 parts, hi + lo, and every product as three
 * tdpbf16ps (hi.hi, hi.lo, lo.hi: flash_amx.h's step_2x2), so the gradients keep float32's accuracy
 * (their error equals the float32 kernels' gradients rounded to float16) at three times the tile
 * work.  Q and dO split as they are packed (HalfPart: exact for float16 values), K and V rows per
 * key block into [hi | lo] rows (split_rows: S^T and dP^T read them so, and K^T for dQ is
 * transposed from them), and P and dS as gradients_to_bfloat16 rounds them (hi the
 * truncation, lo the rest rounded: 17 bits, finer than the GPU kernels' float16 P and dS).  On the
 * Xeon of flash_amx.h, C1-C5 backward ran 1.5-1.9x faster than on the float32 vectors before.
 *
 * Taken when: bfloat16 inputs (float16 on AMX), D and Dv multiples of 32 (the products' K dimension
 * in steps of 32), key_tile of 32, and no rerun that must skip zero weights; otherwise the vector
 * kernels run.
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
 * is not called: the AMX backward prefetches no mask rows.  Each product's lo offsets (x_lo, y_lo
 * and so on) place float16 inputs' lo parts after their hi parts (Parts); 0 for bfloat16. */
template <typename Between>
static inline void scores_product(const uint16_t* x, int64_t x_stride, int64_t n, const uint16_t* y_columns,
                                  int64_t depth, float* out, int64_t mp, uint16_t* pad, Between&&, int64_t x_lo,
                                  int64_t y_lo) {
    tile_scores(x, x_stride, n, y_columns, depth, out, mp, pad, x_lo, y_lo);
}

/* C[m][cols] += A[m][k] B[k][cols], k = steps of 32, B in row pairs. */
static inline void rows_product(const uint16_t* a, int64_t a_stride, int64_t m, int64_t steps, const uint16_t* b_pairs,
                                int64_t cols, float* c, int64_t a_lo, int64_t b_lo) {
    pairs_product(a, a_stride, m, steps, b_pairs, cols, c, a_lo, b_lo);
}

/* The key block's `live` K rows (float16: split rows, each row's lo part k_lo elements after its hi)
 * as dq_product reads them: K^T, its lo part out_lo elements after its hi. */
static inline void pack_keys_for_dq(const uint16_t* k, int64_t k_stride, int64_t k_lo, int64_t live, int64_t D,
                                    uint16_t* out, int64_t out_lo) {
    pack_values_transposed(k, k_stride, live, D, out);
    if (k_lo) pack_values_transposed(k + k_lo, k_stride, live, D, out + out_lo);
}

/* dQ^T[D][mp] += K^T dS^T over the block's live keys, dS in pairs of keys (row tiles N * 16 apart). */
static inline void dq_product(const uint16_t* k_packed, int64_t live, const uint16_t* ds_pairs, int64_t N, int64_t D,
                              float* dq, int64_t mp, int64_t k_lo, int64_t ds_lo) {
    tile_output(k_packed, (live + 31) / 32, ds_pairs, N, (live + 31) / 32, D, dq, mp, k_lo, ds_lo);
}
#else
static inline void begin_products() {}
static inline void end_products() {}

/* between() runs before each block of kPairsMR rows of X (the tile's mask rows are prefetched there).
 * float16 runs on pairs on the AMX level only (backward_on_pairs): the lo offsets are 0 here. */
template <typename Between>
static inline void scores_product(const uint16_t* x, int64_t x_stride, int64_t n, const uint16_t* y_columns,
                                  int64_t depth, float* out, int64_t mp, uint16_t*, Between&& between, int64_t,
                                  int64_t) {
    pairs_dot_tiles<false>(n, x, x_stride, 2, y_columns, depth * 16, depth / 2, out, mp, between);
}

/* C's columns two vectors at a time, its rows kPairsMR at a time: A's pairs broadcast. */
static inline void rows_product(const uint16_t* a, int64_t a_stride, int64_t m, int64_t steps, const uint16_t* b_pairs,
                                int64_t cols, float* c, int64_t, int64_t) {
    for (int64_t cb = 0; cb < cols / 16; cb += 2)
        pairs_dot_rows<2, true>(m, a, a_stride, 2, b_pairs + cb * 32, 32, 2 * cols, steps * 16, c + cb * 16, cols,
                                [] {});
}

/* K in row pairs [live/2][D][2] (a key past `live` zero): pair (K[2i][d], K[2i+1][d]) is broadcast. */
static inline void pack_keys_for_dq(const uint16_t* k, int64_t k_stride, int64_t, int64_t live, int64_t D,
                                    uint16_t* out, int64_t) {
    auto key_row = [&](int64_t j) -> const uint16_t* { return j < live ? k + j * k_stride : nullptr; };
    pack_row_pairs(key_row, round_up(live, 2), D, out);
}

static inline void dq_product(const uint16_t* k_packed, int64_t live, const uint16_t* ds_pairs, int64_t N, int64_t D,
                              float* dq, int64_t mp, int64_t, int64_t) {
    pairs_dot_tiles<true>(D, k_packed, 2, 2 * D, ds_pairs, N * 16, (live + 1) / 2, dq, mp, [] {});
}
#endif

static bool pairs_backward_applies(const FwdParams& p) {
    return p.head_dim % 32 == 0 && p.head_dim_v % 32 == 0 && p.key_tile % 32 == 0 && !p.skip_zero_weights;
}

/* Rows of the dQ^T tiles pass 2 writes on pairs are padded to this (pass 3 must read them so). */
constexpr int64_t kPairsRowAlign = 32;

/* One gradient item's buffers, carved from the thread's scratch (64-byte aligned).  float16 inputs
 * (on AMX: backward_on_pairs) hold each packed operand as two bfloat16 parts (split_floats), the lo
 * part `*_lo` elements after the hi one, and their K and V rows split ([hi | lo]) per key block. */
struct PairsBackwardBuffers {
    float *dk, *dv, *s, *dp, *cap_grad, *keep, *lse2, *delta, *position;
    uint16_t *k_transposed, *pad, *q_columns, *do_columns, *q_rows, *do_rows, *p_keys, *ds_keys, *ds_pairs;
    uint16_t *k_split, *v_split;
    int64_t q_lo = 0, do_lo = 0, keys_lo = 0, k_transposed_lo = 0; /* 0: bfloat16, one part */

    static int64_t bytes(const FwdParams& p) { return PairsBackwardBuffers().carve(p, nullptr); }

    int64_t carve(const FwdParams& p, char* base) {
        const int64_t mp = round_up(p.group * p.block_queries, kPairsRowAlign), N = p.key_tile;
        const int64_t D = p.head_dim, Dv = p.head_dim_v;
        const bool split = p.dtype == DTYPE_FLOAT16;
        const int64_t parts = split ? 2 : 1;
        if (split) {
            q_lo = mp * D;
            do_lo = mp * Dv;
            keys_lo = N * mp;
            k_transposed_lo = N * D;
        }
        const int64_t sizes[] = {4 * N * D,  4 * N * Dv, 4 * N * mp,  4 * N * mp,  4 * N * mp,
                                 4 * N * mp, 4 * mp,     4 * mp,      4 * mp,      parts * 2 * D * N,
                                 parts * 2 * 16 * std::max(D, Dv), parts * 2 * mp * D, parts * 2 * mp * Dv,
                                 parts * 2 * mp * D, parts * 2 * mp * Dv, parts * 2 * N * mp, parts * 2 * N * mp,
                                 parts * 2 * N * mp, split ? 2 * N * 2 * D : 0, split ? 2 * N * 2 * Dv : 0};
        void** slots[] = {(void**)&dk,           (void**)&dv,        (void**)&s,          (void**)&dp,
                          (void**)&cap_grad,     (void**)&keep,      (void**)&lse2,       (void**)&delta,
                          (void**)&position,     (void**)&k_transposed, (void**)&pad,     (void**)&q_columns,
                          (void**)&do_columns,   (void**)&q_rows,    (void**)&do_rows,    (void**)&p_keys,
                          (void**)&ds_keys,      (void**)&ds_pairs,  (void**)&k_split,    (void**)&v_split};
        static_assert(sizeof(sizes) / sizeof(sizes[0]) == sizeof(slots) / sizeof(slots[0]), "one size a slot");
        int64_t offset = 0;
        for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
            if (base) *slots[i] = base + offset;
            offset += align64(sizes[i]);
        }
        return offset;
    }
};

/* Rows 0..mp-1 (row(r) as for pack_column_pairs) in pairs of columns and in pairs of rows; float16
 * rows (lo > 0) as their two parts, the lo ones lo elements after the hi. */
template <typename RowOf>
static void pack_rows_both_ways(RowOf row, int64_t mp, int64_t dims, uint16_t* columns, uint16_t* row_pairs,
                                int64_t lo) {
    if (lo) {
        pack_column_pairs<HalfPart<true>>(row, mp, dims, columns);
        pack_column_pairs<HalfPart<false>>(row, mp, dims, columns + lo);
        pack_row_pairs<HalfPart<true>>(row, mp, dims, row_pairs);
        pack_row_pairs<HalfPart<false>>(row, mp, dims, row_pairs + lo);
    } else {
        pack_column_pairs(row, mp, dims, columns);
        pack_row_pairs(row, mp, dims, row_pairs);
    }
}

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
    pack_rows_both_ways(q_row, mp, p.head_dim, t.q_columns, t.q_rows, t.q_lo);
    pack_rows_both_ways(do_row, mp, p.head_dim_v, t.do_columns, t.do_rows, t.do_lo);
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

/* Word index of _mm512_permutex2var_epi16 that takes the high words of two vectors' dwords, the
 * first's 16, then the second's. */
static inline __m512i high_words_index() {
    alignas(64) static const uint16_t index[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                                   33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    return _mm512_load_si512(index);
}

/* Two vectors of floats x0, x1 as 32 bfloat16 (x0's in the low half, as _mm512_cvtne2ps_pbh leaves
 * them), rounded to nearest; with Split, as two parts: hi = x truncated to bfloat16 (its high 16
 * bits: one permute for both vectors) and lo = x - hi rounded, in *lo alike.  x = hi + lo to 17
 * significant bits (lo holds the 16 bits hi drops, to 8).  P and dS are finite (P <= 1 / (1 -
 * dropout_p); |dS| is bounded by float16 inputs' dP and delta), so no inf - inf to mind, and the
 * split costs 6 instructions for 32 values where split_floats' would take 14. */
template <bool Split> static inline __m512i round_pair(__m512 x0, __m512 x1, __m512i* lo) {
    if (!Split) return (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
    const __m512i high_bits = _mm512_set1_epi32((int)0xffff0000u);
    const __m512 rest0 = _mm512_sub_ps(x0, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x0), high_bits)));
    const __m512 rest1 = _mm512_sub_ps(x1, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x1), high_bits)));
    *lo = (__m512i)_mm512_cvtne2ps_pbh(rest1, rest0);
    return _mm512_permutex2var_epi16(_mm512_castps_si512(x0), high_words_index(), _mm512_castps_si512(x1));
}

/* Two keys' (j, j + 1) 16 rows of P (p_both) or dS (ds_both), as round_pair leaves them, at row r:
 * dS in pairs of keys, and, for keys below keys16, both as [keys][rows]. */
static inline void store_gradient_pair(__m512i p_both, __m512i ds_both, int64_t j, int64_t r, int64_t mp,
                                       int64_t keys16, __m512i interleave, uint16_t* pairs, uint16_t* p_keys,
                                       uint16_t* ds_keys) {
    _mm512_storeu_si512(pairs + j * 16, _mm512_permutexvar_epi16(interleave, ds_both));
    if (j >= keys16) return;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_keys + j * mp + r), _mm512_castsi512_si256(p_both));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_keys + (j + 1) * mp + r), _mm512_extracti64x4_epi64(p_both, 1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ds_keys + j * mp + r), _mm512_castsi512_si256(ds_both));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ds_keys + (j + 1) * mp + r), _mm512_extracti64x4_epi64(ds_both, 1));
}

/* P and dS of one (key block, query tile) from S (s) and dP (dp), rounded to bfloat16 as the
 * products read them: P o dropout and dS as [keys][rows] up to the next multiple of 16 keys, dS in
 * pairs of keys ([mp/16][N/2][16][2]) up to the next multiple of 32; keys from `live` on are 0.
 * With Split (float16 inputs) their lo parts too, lo elements after each.  Row blocks outer, so
 * each block's lse and delta stay in registers; the features are template arguments, so the inner
 * loop has no test of them. */
template <bool Dropout, bool Softcap, bool Split>
static void gradients_to_bfloat16_as(const float* s, const float* dp, const float* keep, const float* cap_grad,
                                     const float* lse2, const float* delta, float score_log2e, int64_t live,
                                     int64_t mp, int64_t N, uint16_t* p_keys, uint16_t* ds_keys, uint16_t* ds_pairs,
                                     int64_t lo) {
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
            __m512i p_lo, ds_lo;
            const __m512i p_both = round_pair<Split>(kept[0], kept[1], &p_lo);
            const __m512i ds_both = round_pair<Split>(grad[0], grad[1], &ds_lo);
            store_gradient_pair(p_both, ds_both, j, r, mp, keys16, interleave, pairs, p_keys, ds_keys);
            if (Split)
                store_gradient_pair(p_lo, ds_lo, j, r, mp, keys16, interleave, pairs + lo, p_keys + lo, ds_keys + lo);
        }
    }
}

static void gradients_to_bfloat16(const FwdParams& p, const PairsBackwardBuffers& t, float score_log2e, int64_t live,
                                  int64_t mp) {
#define FASTATTN_GRADIENTS(DROPOUT, SOFTCAP, SPLIT)                                                             \
    gradients_to_bfloat16_as<DROPOUT, SOFTCAP, SPLIT>(t.s, t.dp, t.keep, t.cap_grad, t.lse2, t.delta, score_log2e, \
                                                      live, mp, p.key_tile, t.p_keys, t.ds_keys, t.ds_pairs,   \
                                                      t.keys_lo)
#define FASTATTN_GRADIENTS_SPLIT(DROPOUT, SOFTCAP) \
    if (t.keys_lo)                                 \
        FASTATTN_GRADIENTS(DROPOUT, SOFTCAP, true); \
    else                                           \
        FASTATTN_GRADIENTS(DROPOUT, SOFTCAP, false)
    const bool dropout = p.dropout_p > 0, softcap = p.softcap > 0;
    if (dropout && softcap) {
        FASTATTN_GRADIENTS_SPLIT(true, true);
    } else if (dropout) {
        FASTATTN_GRADIENTS_SPLIT(true, false);
    } else if (softcap) {
        FASTATTN_GRADIENTS_SPLIT(false, true);
    } else {
        FASTATTN_GRADIENTS_SPLIT(false, false);
    }
#undef FASTATTN_GRADIENTS_SPLIT
#undef FASTATTN_GRADIENTS
}

/* Pass 2 on pairs: dK and dV of the key blocks of one chunk of one kv head, and the chunk's dQ
 * partial, as gradient_block (flash_backward.h) computes them. */
static void gradient_block_pairs(const BwdParams& bp, char* scratch, int64_t b, int64_t kvh, int64_t chunk) {
    const FwdParams& p = bp.f;
    const int64_t D = p.head_dim, Dv = p.head_dim_v, N = p.key_tile, BQ = p.block_queries;
    PairsBackwardBuffers t;
    t.carve(p, scratch);
    const bool split = p.dtype == DTYPE_FLOAT16;
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
            /* S^T's and dP^T's A operands (and K^T's source): K and V rows in place, or float16's rows
             * split per block, a row's lo part k_lo (v_lo) elements after its hi. */
            const int64_t k_lo = split ? D : 0, v_lo = split ? Dv : 0;
            const uint16_t *k_rows = k, *v_rows = v;
            int64_t k_rows_stride = p.k_stride[2], v_rows_stride = p.v_stride[2];
            if (split) {
                split_rows(k, p.k_stride[2], live, D, t.k_split);
                split_rows(v, p.v_stride[2], live, Dv, t.v_split);
                k_rows = t.k_split;
                v_rows = t.v_split;
                k_rows_stride = 2 * D;
                v_rows_stride = 2 * Dv;
            }
            pack_keys_for_dq(k_rows, k_rows_stride, k_lo, live, D, t.k_transposed, t.k_transposed_lo);
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
                    scores_product(k_rows, k_rows_stride, live, t.q_columns, D, t.s, mp, t.pad, issue, k_lo, t.q_lo);
                    scores_product(v_rows, v_rows_stride, live, t.do_columns, Dv, t.dp, mp, t.pad, issue, v_lo,
                                   t.do_lo);
                } else {
                    scores_product(k_rows, k_rows_stride, live, t.q_columns, D, t.s, mp, t.pad, [] {}, k_lo, t.q_lo);
                    scores_product(v_rows, v_rows_stride, live, t.do_columns, Dv, t.dp, mp, t.pad, [] {}, v_lo,
                                   t.do_lo);
                }
                finish_scores<float>(p, t.s, t.cap_grad, mp, rows, live, k0, b, kvh, q0, qn, t.position, scale);
                if (p.dropout_p > 0) {
                    std::memset(t.keep, 0, sizeof(float) * live * mp);
                    dropout_tile<float>(p, t.keep, mp, 1, rows, live, k0, b, kvh, q0, qn, true);
                }
                gradients_to_bfloat16(p, t, score_log2e, live, mp);
                rows_product(t.p_keys, mp, keys16, mp / 32, t.do_rows, Dv, t.dv, t.keys_lo, t.do_lo);
                rows_product(t.ds_keys, mp, keys16, mp / 32, t.q_rows, D, t.dk, t.keys_lo, t.q_lo);
                dq_product(t.k_transposed, live, t.ds_pairs, N, D, dq_partial_tile<float>(bp, chunk, b, kvh, qb), mp,
                           t.k_transposed_lo, t.keys_lo);
            }
        }
        if (split)
            write_key_gradients<float, half_bits>(bp, b, kvh, k0, n, t.dk, t.dv, scale);
        else
            write_key_gradients<float, bfloat16_bits>(bp, b, kvh, k0, n, t.dk, t.dv, scale);
    }
    end_products();
}

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
#endif
