/* Flash attention forward for bfloat16 inputs on AMX (Intel Sapphire Rapids and later), and for
 * float16 inputs as bfloat16 parts (flash_bf16.h: split_floats; the Xeons with AMX-BF16 have no
 * float16 tiles before AMX-FP16, and AVX512_FP16's FMAs would accumulate in float16).
 *
 * The same work item, rows-as-lanes layout and online softmax as forward_block (flash_forward.h):
 * only the two products move from FMA vectors to AMX tiles.  `tdpbf16ps` multiplies a 16 x 32
 * bfloat16 tile A by a 32 x 16 tile B held in pairs ("VNNI": row i of B holds the pairs
 * (B[2i][c], B[2i+1][c])) into a 16 x 16 float32 tile C, 16384 flops an instruction, one every 16
 * cycles: 3.4 TFLOP/s on one core of the Xeon this was measured on (family 6 model 167), against
 * 0.24 for float32 FMA and 0.12 for `vdpbf16ps`, which runs at half rate there.  So the products
 * cost little and the float32 softmax between them sets the pace.
 *
 *   S^T[keys][rows] = K Q^T   A = 16 keys x 32 dims, read in place from K (its rows are A's rows);
 *                             B = Q^T in pairs of dims, packed once per item: Qb[row tile][D/2][16][2]
 *   O^T[cols][rows] += V^T P^T  A = V^T, 16 columns x 32 keys: V transposed per key tile into
 *                             Vt[column block][key step][16][32] (the one transpose either order of
 *                             the products needs: K or V is the transposed operand);
 *                             B = P in pairs of keys: Pb[row tile][N/2][16][2], P rounded to bfloat16
 *                             as the GPU kernels do (the row sums take the float32 P)
 * The pair layouts, their packing, the buffers and the output writing are flash_bf16.h's, whose
 * `vdpbf16ps` forward runs the same items where the CPU has AVX512_BF16 but no AMX.
 * S^T and O^T land in forward_block's float32 buffers S[j][rows] and O[Dv][rows], so the score
 * finishing (causal/window edges, masks, softcap), the online softmax, dropout and the output
 * writing are forward_block's own.  Q is not pre-scaled (a bfloat16 Q times scale would round
 * again): online_softmax folds the scale into its exponent, or, where masks or softcap need scaled
 * scores, one pass scales S first.
 *
 * Tiles: all eight are 16 rows x 64 bytes (one configuration for the whole item).  Both products
 * run 2 x 2 blocks: four C tiles (0-3) accumulate while two A tiles (4, 5) and two B tiles (6, 7)
 * are loaded per 32-deep step, so each loaded tile feeds two products.  Keys past the tile's end are
 * zero in the packed operands (zero P times zero V: a NaN past the end cannot leak in); K's last
 * partial block of 16 rows is copied into a zero-padded block rather than read past the array.
 *
 * float16: Q, K, V and P as hi + lo bfloat16 parts, each product three tdpbf16ps (hi.hi, hi.lo,
 * lo.hi: step_2x2), K and V split once per call by the pass before the items (split_halves_item)
 * where a kv head has several query blocks, else per key tile by the item, Q per item, P as the
 * softmax hands it over.  float32's accuracy (the output error equals the float32 kernels' rounded
 * to float16) at three times the tile work: on the Xeon above float16 C1-C5 ran 1.6-2.4x faster
 * than float32 (the float32 vector kernels on float16 copies before).
 *
 * Taken when: bfloat16 or float16 inputs, D a multiple of 32, Dv of 16, key_tile of 32, more rows
 * than the decode path's (float16: more than kHalfAmxMinRows), and no rerun that must skip zero
 * weights (a product inside a tile cannot be skipped); otherwise forward_block runs on float32
 * conversions as before.  (float16 decodes and items of few rows stay on the float32 vector
 * kernels: the split would cost what it saves where K and V are read once per few rows.)
 */
#ifndef FASTATTN_FLASH_AMX_H
#define FASTATTN_FLASH_AMX_H

#include "flash_bf16.h"

#if defined(FASTATTN_HAS_AMX)

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

/* The 64-byte operand of LDTILECFG, palette 1. */
struct alignas(64) TileConfig {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

static inline void configure_tiles() {
    TileConfig config;
    std::memset(&config, 0, sizeof(config));
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

/* float16 items of at most this many rows stay on the float32 vector kernels.  An item whose kv head
 * has one query block (a few queries over a long cache) splits every key tile it reads (see "float16
 * K and V as bfloat16 parts" below), and for few rows that costs more than the vector products it
 * saves: B8 Hq32 Hkv8 Sk4096 D128 with 4 / 8 / 16 queries (16 / 32 / 64 rows) took 11.0 / 16.9 /
 * 35.7 ms on the vector kernels and 15.4 / 17.7 / 23.2 on AMX with the split per tile (Xeon model
 * 167, 2 threads). */
constexpr int64_t kHalfAmxMinRows = 32;

static bool amx_forward_applies(const FwdParams& p, int64_t rows) {
    return p.head_dim % 32 == 0 && p.head_dim_v % 16 == 0 && p.key_tile % 32 == 0 && !p.skip_zero_weights &&
           rows > (p.dtype == DTYPE_FLOAT16 ? kHalfAmxMinRows : kDotMaxRows);
}

/* Vt[cb][ks][16][32]: the A tiles of O^T += V^T P^T for the tile's n keys (rows v, v_stride
 * elements apart, read by Rows: flash_bf16.h), keys from n up to the next multiple of 32 zero.  Per
 * 32 keys x 16 columns: rows 2i and 2i+1 interleave into dwords (V[2i][c], V[2i+1][c]), then a
 * 16 x 16 dword transpose makes row c = (V[0][c], V[1][c], ..., V[31][c]). */
template <typename Rows = Bf16Rows>
static void pack_values_transposed(const uint16_t* v, int64_t v_stride, int64_t n, int64_t Dv, uint16_t* vt) {
    const __m512i interleave = interleave_halves_index();
    const int64_t steps = (n + 31) / 32;
    for (int64_t ks = 0; ks < steps; ++ks) {
        const int64_t keys = std::min<int64_t>(32, n - ks * 32);
        for (int64_t cb = 0; cb < Dv / 16; ++cb) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i) {
                const int64_t k0 = 2 * i, k1 = 2 * i + 1;
                const uint16_t* row0 = v + (ks * 32 + k0) * v_stride + cb * 16;
                const __m256i low = k0 < keys ? Rows::row16(row0) : _mm256_setzero_si256();
                const __m256i high = k1 < keys ? Rows::row16(row0 + v_stride) : _mm256_setzero_si256();
                r[i] = _mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1));
            }
            transpose_16x16_dwords(r);
            uint16_t* tile = vt + (cb * steps + ks) * 16 * 32;
            for (int c = 0; c < 16; ++c) _mm512_storeu_si512(tile + c * 32, r[c]);
        }
    }
}


/* ---- the two products -----------------------------------------------------------------------------
 *
 * Each runs 2 x 2 blocks of C tiles 0-3 += A tiles 4, 5 times B tiles 6, 7.  With Split (float16
 * inputs as bfloat16 parts: flash_bf16.h, split_floats) every step runs three products, A's hi by
 * B's lo, A's hi by B's hi, A's lo by B's hi, the lo parts a_lo and b_lo elements after the hi ones:
 * 12 tdpbf16ps for 8 tile loads. */

/* C tiles 0-3 += the 2 x 2 (MB x NB) products of the loaded A tiles 4, 5 and B tiles 6, 7. */
template <int MB, int NB> static inline void products_2x2() {
    _tile_dpbf16ps(0, 4, 6);
    if (NB > 1) _tile_dpbf16ps(1, 4, 7);
    if (MB > 1) _tile_dpbf16ps(2, 5, 6);
    if (MB > 1 && NB > 1) _tile_dpbf16ps(3, 5, 7);
}

/* One step of a 2 x 2 block: a0/a1 the A tiles' first elements (a1 read only for MB > 1), b0/b1 the
 * B tiles' (b1 for NB > 1), each part's lo part a_lo / b_lo elements on when Split. */
template <int MB, int NB, bool Split>
static inline void step_2x2(const uint16_t* a0, const uint16_t* a1, int64_t a_bytes, int64_t a_lo, const uint16_t* b0,
                            const uint16_t* b1, int64_t b_bytes, int64_t b_lo) {
    _tile_loadd(4, a0, a_bytes);
    if (MB > 1) _tile_loadd(5, a1, a_bytes);
    if (Split) {
        _tile_loadd(6, b0 + b_lo, b_bytes);
        if (NB > 1) _tile_loadd(7, b1 + b_lo, b_bytes);
        products_2x2<MB, NB>();
    }
    _tile_loadd(6, b0, b_bytes);
    if (NB > 1) _tile_loadd(7, b1, b_bytes);
    products_2x2<MB, NB>();
    if (Split) {
        _tile_loadd(4, a0 + a_lo, a_bytes);
        if (MB > 1) _tile_loadd(5, a1 + a_lo, a_bytes);
        products_2x2<MB, NB>();
    }
}

/* One 2 x 2 (or smaller) block of S^T: key blocks k0 (and k0 + 16), row tiles rt (and rt + 1);
 * with Split, K's lo part k_lo elements after each row's hi part, Q's q_lo after its hi packing.
 * between() before each step of 32 dims. */
template <int KB, int RT, bool Split, typename Between>
static inline void scores_block(const uint16_t* k_rows0, const uint16_t* k_rows1, int64_t k_bytes, const uint16_t* qb,
                                int64_t D, int64_t rt, float* s, int64_t mp, int64_t k_lo, int64_t q_lo,
                                Between&& between) {
    _tile_zero(0);
    if (RT > 1) _tile_zero(1);
    if (KB > 1) _tile_zero(2);
    if (KB > 1 && RT > 1) _tile_zero(3);
    for (int64_t step = 0; step < D / 32; ++step) {
        between();
        const uint16_t* q0 = qb + (rt * (D / 2) + step * 16) * 32;
        step_2x2<KB, RT, Split>(k_rows0 + step * 32, KB > 1 ? k_rows1 + step * 32 : nullptr, k_bytes, k_lo, q0,
                                RT > 1 ? q0 + (D / 2) * 32 : nullptr, 64, q_lo);
    }
    const int64_t s_bytes = mp * 4;
    float* first = s + rt * 16;
    _tile_stored(0, first, s_bytes);
    if (RT > 1) _tile_stored(1, first + 16, s_bytes);
    if (KB > 1) _tile_stored(2, first + 16 * mp, s_bytes);
    if (KB > 1 && RT > 1) _tile_stored(3, first + 16 * mp + 16, s_bytes);
}

/* tile_scores on one kind of operand (Split: float16 parts); between() before each step of each
 * block's product. */
template <bool Split, typename Between>
static void tile_scores_as(const uint16_t* k, int64_t k_stride, int64_t n, const uint16_t* qb, int64_t D, float* s,
                           int64_t mp, uint16_t* k_block, int64_t k_lo, int64_t q_lo, Between&& between) {
    const int64_t blocks = (n + 15) / 16, row_tiles = mp / 16, k_bytes = k_stride * 2;
    const int64_t tail = n % 16, row = D + k_lo; /* a key's elements: its hi part, and its lo part */
    if (tail) { /* the last block's missing rows: zeros, not whatever follows K */
        std::memset(k_block, 0, sizeof(uint16_t) * 16 * row);
        for (int64_t j = 0; j < tail; ++j) std::memcpy(k_block + j * row, k + (n - tail + j) * k_stride, 2 * row);
    }
    auto rows_of = [&](int64_t block, int64_t* bytes) -> const uint16_t* {
        if (tail && block == blocks - 1) {
            *bytes = row * 2;
            return k_block;
        }
        *bytes = k_bytes;
        return k + block * 16 * k_stride;
    };
    for (int64_t kb = 0; kb < blocks; kb += 2) {
        int64_t bytes0, bytes1 = 0;
        const uint16_t* rows0 = rows_of(kb, &bytes0);
        const bool pair = kb + 1 < blocks;
        const uint16_t* rows1 = pair ? rows_of(kb + 1, &bytes1) : nullptr;
        float* block_s = s + kb * 16 * mp;
        if (pair && bytes0 != bytes1) { /* the padded block has its own stride: one block at a time */
            for (int64_t rt = 0; rt < row_tiles; ++rt) {
                scores_block<1, 1, Split>(rows0, nullptr, bytes0, qb, D, rt, block_s, mp, k_lo, q_lo, between);
                scores_block<1, 1, Split>(rows1, nullptr, bytes1, qb, D, rt, block_s + 16 * mp, mp, k_lo, q_lo, between);
            }
            continue;
        }
        int64_t rt = 0;
        for (; rt + 2 <= row_tiles; rt += 2) {
            if (pair)
                scores_block<2, 2, Split>(rows0, rows1, bytes0, qb, D, rt, block_s, mp, k_lo, q_lo, between);
            else
                scores_block<1, 2, Split>(rows0, nullptr, bytes0, qb, D, rt, block_s, mp, k_lo, q_lo, between);
        }
        if (rt < row_tiles) {
            if (pair)
                scores_block<2, 1, Split>(rows0, rows1, bytes0, qb, D, rt, block_s, mp, k_lo, q_lo, between);
            else
                scores_block<1, 1, Split>(rows0, nullptr, bytes0, qb, D, rt, block_s, mp, k_lo, q_lo, between);
        }
    }
}

/* S^T[j][rows] for the tile's n keys (rounded up to 16; the padded keys' scores are never read).
 * k_lo > 0: float16 inputs' parts, K's rows [hi (D) | lo (D)] (k_lo = D), Q's lo packing q_lo
 * elements after its hi.  between() before each step of 32 dims of each block (tile_scores_steps
 * of them). */
template <typename Between>
static void tile_scores(const uint16_t* k, int64_t k_stride, int64_t n, const uint16_t* qb, int64_t D, float* s,
                        int64_t mp, uint16_t* k_block, int64_t k_lo, int64_t q_lo, Between&& between) {
    if (k_lo)
        tile_scores_as<true>(k, k_stride, n, qb, D, s, mp, k_block, k_lo, q_lo, between);
    else
        tile_scores_as<false>(k, k_stride, n, qb, D, s, mp, k_block, 0, 0, between);
}

static void tile_scores(const uint16_t* k, int64_t k_stride, int64_t n, const uint16_t* qb, int64_t D, float* s,
                        int64_t mp, uint16_t* k_block, int64_t k_lo = 0, int64_t q_lo = 0) {
    tile_scores(k, k_stride, n, qb, D, s, mp, k_block, k_lo, q_lo, [] {});
}

/* How many times tile_scores calls between(): a step of 32 dims per block of up to 2 x 2 tiles. */
static inline int64_t tile_scores_steps(int64_t n, int64_t mp, int64_t D) {
    return std::max<int64_t>(1, ((n + 15) / 16 + 1) / 2 * ((mp / 16 + 1) / 2) * (D / 32));
}

/* One 2 x 2 (or smaller) block of O^T: column blocks cb (and cb + 1), row tiles rt (and rt + 1);
 * with Split, V^T's lo part v_lo elements after its hi, P's p_lo after its hi. */
template <int CB, int RT, bool Split>
static inline void output_block(const uint16_t* vt, int64_t steps, int64_t cb, const uint16_t* pb, int64_t N,
                                int64_t rt, int64_t key_steps, float* o, int64_t mp, int64_t v_lo, int64_t p_lo) {
    const int64_t o_bytes = mp * 4;
    float* first = o + cb * 16 * mp + rt * 16;
    _tile_loadd(0, first, o_bytes);
    if (RT > 1) _tile_loadd(1, first + 16, o_bytes);
    if (CB > 1) _tile_loadd(2, first + 16 * mp, o_bytes);
    if (CB > 1 && RT > 1) _tile_loadd(3, first + 16 * mp + 16, o_bytes);
    for (int64_t ks = 0; ks < key_steps; ++ks) {
        const uint16_t* v0 = vt + (cb * steps + ks) * 512;
        const uint16_t* p0 = pb + rt * N * 16 + ks * 512;
        step_2x2<CB, RT, Split>(v0, CB > 1 ? v0 + steps * 512 : nullptr, 64, v_lo, p0,
                                RT > 1 ? p0 + N * 16 : nullptr, 64, p_lo);
    }
    _tile_stored(0, first, o_bytes);
    if (RT > 1) _tile_stored(1, first + 16, o_bytes);
    if (CB > 1) _tile_stored(2, first + 16 * mp, o_bytes);
    if (CB > 1 && RT > 1) _tile_stored(3, first + 16 * mp + 16, o_bytes);
}

/* tile_output on one kind of operand (Split: float16 parts). */
template <bool Split>
static void tile_output_as(const uint16_t* vt, int64_t steps, const uint16_t* pb, int64_t N, int64_t key_steps,
                           int64_t Dv, float* o, int64_t mp, int64_t v_lo, int64_t p_lo) {
    const int64_t column_blocks = Dv / 16, row_tiles = mp / 16;
    for (int64_t cb = 0; cb < column_blocks; cb += 2) {
        const bool pair = cb + 1 < column_blocks;
        int64_t rt = 0;
        for (; rt + 2 <= row_tiles; rt += 2) {
            if (pair)
                output_block<2, 2, Split>(vt, steps, cb, pb, N, rt, key_steps, o, mp, v_lo, p_lo);
            else
                output_block<1, 2, Split>(vt, steps, cb, pb, N, rt, key_steps, o, mp, v_lo, p_lo);
        }
        if (rt < row_tiles) {
            if (pair)
                output_block<2, 1, Split>(vt, steps, cb, pb, N, rt, key_steps, o, mp, v_lo, p_lo);
            else
                output_block<1, 1, Split>(vt, steps, cb, pb, N, rt, key_steps, o, mp, v_lo, p_lo);
        }
    }
}

/* O^T[Dv][rows] += V^T P^T over the tile's first key_steps of 32 keys; vt packed with `steps` of them
 * (pack_values_transposed's layout: a packed tile may hold more keys than an item reads).  v_lo > 0:
 * float16 inputs' parts, V^T's lo part v_lo elements after its hi, P's p_lo after its hi. */
static void tile_output(const uint16_t* vt, int64_t steps, const uint16_t* pb, int64_t N, int64_t key_steps,
                        int64_t Dv, float* o, int64_t mp, int64_t v_lo = 0, int64_t p_lo = 0) {
    if (v_lo)
        tile_output_as<true>(vt, steps, pb, N, key_steps, Dv, o, mp, v_lo, p_lo);
    else
        tile_output_as<false>(vt, steps, pb, N, key_steps, Dv, o, mp, 0, 0);
}

/* One 2 x 2 (or smaller) block of C[m][cols] += A[m][k] B[k][cols] over `steps` of 32 in k: row
 * blocks mb (and mb + 1) of 16, column blocks cb (and cb + 1) of 16; A bfloat16, its rows a_stride
 * elements apart; B in pairs of its rows ([k/2][cols][2], pack_row_pairs); C float32 [m][cols].
 * With Split, A's lo part a_lo elements after its hi, B's b_lo after its hi. */
template <int MB, int CB, bool Split>
static inline void pairs_block(const uint16_t* a, int64_t a_stride, int64_t steps, const uint16_t* b_pairs,
                               int64_t cols, int64_t mb, int64_t cb, float* c, int64_t a_lo, int64_t b_lo) {
    const int64_t c_bytes = cols * 4, a_bytes = a_stride * 2;
    float* first = c + mb * 16 * cols + cb * 16;
    _tile_loadd(0, first, c_bytes);
    if (CB > 1) _tile_loadd(1, first + 16, c_bytes);
    if (MB > 1) _tile_loadd(2, first + 16 * cols, c_bytes);
    if (MB > 1 && CB > 1) _tile_loadd(3, first + 16 * cols + 16, c_bytes);
    for (int64_t step = 0; step < steps; ++step) {
        const uint16_t* a0 = a + mb * 16 * a_stride + step * 32;
        const uint16_t* b0 = b_pairs + step * 16 * cols * 2 + cb * 32;
        step_2x2<MB, CB, Split>(a0, MB > 1 ? a0 + 16 * a_stride : nullptr, a_bytes, a_lo, b0,
                                CB > 1 ? b0 + 32 : nullptr, c_bytes, b_lo);
    }
    _tile_stored(0, first, c_bytes);
    if (CB > 1) _tile_stored(1, first + 16, c_bytes);
    if (MB > 1) _tile_stored(2, first + 16 * cols, c_bytes);
    if (MB > 1 && CB > 1) _tile_stored(3, first + 16 * cols + 16, c_bytes);
}

/* pairs_product on one kind of operand (Split: float16 parts). */
template <bool Split>
static void pairs_product_as(const uint16_t* a, int64_t a_stride, int64_t m, int64_t steps, const uint16_t* b_pairs,
                             int64_t cols, float* c, int64_t a_lo, int64_t b_lo) {
    const int64_t row_blocks = m / 16, column_blocks = cols / 16;
    for (int64_t mb = 0; mb < row_blocks; mb += 2) {
        const bool row_pair = mb + 1 < row_blocks;
        int64_t cb = 0;
        for (; cb + 2 <= column_blocks; cb += 2) {
            if (row_pair)
                pairs_block<2, 2, Split>(a, a_stride, steps, b_pairs, cols, mb, cb, c, a_lo, b_lo);
            else
                pairs_block<1, 2, Split>(a, a_stride, steps, b_pairs, cols, mb, cb, c, a_lo, b_lo);
        }
        if (cb < column_blocks) {
            if (row_pair)
                pairs_block<2, 1, Split>(a, a_stride, steps, b_pairs, cols, mb, cb, c, a_lo, b_lo);
            else
                pairs_block<1, 1, Split>(a, a_stride, steps, b_pairs, cols, mb, cb, c, a_lo, b_lo);
        }
    }
}

/* C[m][cols] += A[m][k] B[k][cols] for m (a multiple of 16) rows, k = 32 steps: the backward's dV
 * and dK, the decode's P V.  a_lo > 0: float16 inputs' parts, A's lo part a_lo elements after its
 * hi, B's b_lo after its hi. */
static void pairs_product(const uint16_t* a, int64_t a_stride, int64_t m, int64_t steps, const uint16_t* b_pairs,
                          int64_t cols, float* c, int64_t a_lo = 0, int64_t b_lo = 0) {
    if (a_lo)
        pairs_product_as<true>(a, a_stride, m, steps, b_pairs, cols, c, a_lo, b_lo);
    else
        pairs_product_as<false>(a, a_stride, m, steps, b_pairs, cols, c, 0, 0);
}

/* ---- V packed once per call ----------------------------------------------------------------------
 *
 * Every query block of a kv head transposes the same V tiles (pack_values_transposed, 6-10% of the
 * forward's time).  Where the items run forward_block_amx and a kv head has several query blocks, a
 * pass before the items packs each (b, kv head, key tile) once into packed_kv; the items read it.
 * A tile holds the keys below its batch row's key_lengths (the rest never are read, and may be
 * anything); a slot is N x Dv elements whatever the tile's keys. */
static bool amx_packs_values(const FwdParams& p) {
    return p.dtype == DTYPE_BFLOAT16 && p.splits == 1 && p.query_blocks > 1 && !p.skip_zero_weights &&
           forward_kernel_of(p, p.group * std::min(p.block_queries, p.seq_q)) == KERNEL_AMX;
}

static inline int64_t packed_value_tiles(const FwdParams& p) { return (p.seq_k + p.key_tile - 1) / p.key_tile; }

static inline int64_t packed_value_keys(const FwdParams& p, int64_t b, int64_t tile) {
    const int64_t kt = tile * p.key_tile, end = p.key_lengths ? std::min(p.seq_k, p.key_lengths[b]) : p.seq_k;
    return std::max<int64_t>(0, std::min(p.key_tile, end - kt));
}

static size_t packed_values_bytes(const FwdParams& p) {
    if (!amx_packs_values(p)) return 0;
    return (size_t)(p.batch * p.heads_kv * packed_value_tiles(p) * p.key_tile * p.head_dim_v * 2);
}

/* The packed V^T of (b, kvh, tile) and its steps of 32 keys. */
static inline const uint16_t* packed_value_tile(const FwdParams& p, int64_t b, int64_t kvh, int64_t tile,
                                                int64_t* steps) {
    *steps = (packed_value_keys(p, b, tile) + 31) / 32;
    const int64_t slot = (b * p.heads_kv + kvh) * packed_value_tiles(p) + tile;
    return reinterpret_cast<const uint16_t*>(p.packed_kv) + slot * p.key_tile * p.head_dim_v;
}

/* The pass's item: one (b, kv head, key tile). */
static void pack_value_item(const FwdParams& p, int64_t item) {
    const int64_t tile = item % packed_value_tiles(p), kvh = (item / packed_value_tiles(p)) % p.heads_kv;
    const int64_t b = item / (packed_value_tiles(p) * p.heads_kv), n = packed_value_keys(p, b, tile);
    if (n == 0) return;
    const int64_t slot = (b * p.heads_kv + kvh) * packed_value_tiles(p) + tile;
    const uint16_t* v = at<uint16_t>(p.v, b * p.v_stride[0] + kvh * p.v_stride[1] + tile * p.key_tile * p.v_stride[2]);
    pack_values_transposed(v, p.v_stride[2], n, p.head_dim_v,
                           reinterpret_cast<uint16_t*>(p.packed_kv) + slot * p.key_tile * p.head_dim_v);
}

/* ---- float16 K and V as bfloat16 parts, once per call ----------------------------------------------
 *
 * float16 items run the bfloat16 products three times over the inputs' parts (flash_bf16.h:
 * split_floats).  Where a kv head has several query blocks, a pass before the items writes, for
 * each (b, kv head), K's rows as [hi (D) | lo (D)] ([Sk][2 D]), then, per key tile, V^T's hi part
 * and its lo part, N x Dv elements each (pack_values_transposed's layout), and the items read them.
 * Keys at or past the batch row's key_lengths are not written and never read.  The copies take
 * 4 B Hkv Sk (D + Dv) bytes, twice the inputs' K and V, as the float32 copies of the levels below
 * (converts_kv_once) do, and under the same cap.  Otherwise (one query block a kv head: a few
 * queries over a long cache, whose K and V each item reads once; or copies past the cap) each item
 * splits its key tiles itself, into its own buffers: a pass would write and read back twice the
 * cache through memory (the C6 shape with 4 queries, B8 Hkv8 Sk4096 D128: 268 MB, 33 ms where the
 * float32 kernels take 15 on the Xeon above). */
static bool amx_splits_halves(const FwdParams& p) {
    return p.dtype == DTYPE_FLOAT16 && p.query_blocks > 1 && converted_kv_bytes(p) <= kConvertedKvMaxBytes &&
           forward_kernel_of(p, p.group * std::min(p.block_queries, p.seq_q)) == KERNEL_AMX;
}

static size_t split_halves_bytes(const FwdParams& p) {
    if (!amx_splits_halves(p)) return 0;
    const int64_t keys = p.seq_k * 2 * p.head_dim, values = packed_value_tiles(p) * p.key_tile * 2 * p.head_dim_v;
    return (size_t)(p.batch * p.heads_kv * (keys + values) * 2);
}

static inline uint16_t* split_keys(const FwdParams& p, int64_t b, int64_t kvh) {
    return reinterpret_cast<uint16_t*>(p.packed_kv) + (b * p.heads_kv + kvh) * p.seq_k * 2 * p.head_dim;
}

/* V^T's parts of (b, kvh, tile): hi, then lo key_tile x Dv elements on; *steps its steps of 32 keys. */
static inline uint16_t* split_value_tile(const FwdParams& p, int64_t b, int64_t kvh, int64_t tile, int64_t* steps) {
    *steps = (packed_value_keys(p, b, tile) + 31) / 32;
    const int64_t slot = (b * p.heads_kv + kvh) * packed_value_tiles(p) + tile;
    return reinterpret_cast<uint16_t*>(p.packed_kv) + p.batch * p.heads_kv * p.seq_k * 2 * p.head_dim +
           slot * p.key_tile * 2 * p.head_dim_v;
}

/* The pass's item: one (b, kv head, key tile). */
static void split_halves_item(const FwdParams& p, int64_t item) {
    const int64_t tile = item % packed_value_tiles(p), kvh = (item / packed_value_tiles(p)) % p.heads_kv;
    const int64_t b = item / (packed_value_tiles(p) * p.heads_kv), n = packed_value_keys(p, b, tile);
    if (n == 0) return;
    const int64_t D = p.head_dim, Dv = p.head_dim_v, kt = tile * p.key_tile;
    const uint16_t* k = at<uint16_t>(p.k, b * p.k_stride[0] + kvh * p.k_stride[1] + kt * p.k_stride[2]);
    const uint16_t* v = at<uint16_t>(p.v, b * p.v_stride[0] + kvh * p.v_stride[1] + kt * p.v_stride[2]);
    split_rows(k, p.k_stride[2], n, D, split_keys(p, b, kvh) + kt * 2 * D);
    int64_t steps;
    uint16_t* vt = split_value_tile(p, b, kvh, tile, &steps);
    pack_values_transposed<HalfPart<true>>(v, p.v_stride[2], n, Dv, vt);
    pack_values_transposed<HalfPart<false>>(v, p.v_stride[2], n, Dv, vt + p.key_tile * Dv);
}

/* The AMX level's pass before the items: its bytes and its item. */
static size_t amx_packed_bytes(const FwdParams& p) {
    return p.dtype == DTYPE_FLOAT16 ? split_halves_bytes(p) : packed_values_bytes(p);
}

static void amx_pack_item(const FwdParams& p, int64_t item) {
    if (p.dtype == DTYPE_FLOAT16)
        split_halves_item(p, item);
    else
        pack_value_item(p, item);
}

/* ---- one work item --------------------------------------------------------------------------------- */

static void forward_block_amx(const FwdParams& p, char* scratch, int64_t b, int64_t kvh, int64_t q0, int64_t qn,
                              int64_t k_begin, int64_t k_end, float* partial_out, float* partial_lse) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v, G = p.group, N = p.key_tile;
    const int64_t rows = G * qn;
    PairBuffers buffers;
    buffers.carve(p, scratch);
    const int64_t mp = start_pairs_item(p, buffers, b, kvh, q0, qn);
    float* s = buffers.s;
    float* o = buffers.o;

    int64_t lo, hi;
    visible_keys(p, b, q0, qn, k_begin, k_end, &lo, &hi);
    /* Packed tiles start at multiples of N: a window's first tile starts there too (its keys before
     * the window are hidden by finish_scores' edge test). */
    if (p.packed_kv) lo = lo / N * N;

    /* float16: K and V split into bfloat16 parts once per call (split_halves_item) or here per key
     * tile, their lo parts D (K's rows), N x Dv (V^T) and N x mp (P) elements after the hi ones; Q's
     * mp x D after. */
    const bool split = p.dtype == DTYPE_FLOAT16;
    const PackProbabilities packer{buffers.pb, N, interleave_halves_index(), split ? N * mp : 0};
    configure_tiles();
    for (int64_t kt = lo; kt < hi; kt += N) {
        const int64_t n = std::min(N, hi - kt);
        if (p.mask_kind != MASK_NONE && mask_hides_tile(p, b, kvh, q0, qn, kt, n)) continue;
        const uint16_t* k = at<uint16_t>(p.k, b * p.k_stride[0] + kvh * p.k_stride[1] + kt * p.k_stride[2]);
        const uint16_t* v = at<uint16_t>(p.v, b * p.v_stride[0] + kvh * p.v_stride[1] + kt * p.v_stride[2]);
        const uint16_t* vt = buffers.vt;
        int64_t steps = (n + 31) / 32;
        if (split && p.packed_kv) { /* split once for all query blocks: split_halves_item */
            k = split_keys(p, b, kvh) + kt * 2 * D;
            vt = split_value_tile(p, b, kvh, kt / N, &steps);
        } else if (split) { /* V's rows split once, then each part transposed */
            split_rows(v, p.v_stride[2], n, Dv, buffers.kv_parts);
            pack_values_transposed(buffers.kv_parts, 2 * Dv, n, Dv, buffers.vt);
            pack_values_transposed(buffers.kv_parts + Dv, 2 * Dv, n, Dv, buffers.vt + N * Dv);
            split_rows(k, p.k_stride[2], n, D, buffers.kv_parts);
            k = buffers.kv_parts;
        } else if (p.packed_kv) { /* packed once for all query blocks: packed_value_tile */
            vt = packed_value_tile(p, b, kvh, kt / N, &steps);
        } else {
            pack_values_transposed(v, p.v_stride[2], n, Dv, buffers.vt);
        }
        /* The lines of a bool or bfloat16 mask whose rows differ go to the prefetcher a few at a time
         * during the tile's scores, before full_mask_bits or full_mask_words reads them: B1 H8 S4096
         * D128 causal, bfloat16, 12% faster with a bool mask, 10% hidden (4 processes alternated).
         * A float mask's pass over the tile (mask_transposed) ran 2% slower with them. */
        const bool prefetch_mask = p.mask_kind == MASK_BOOL || p.mask_kind == MASK_BFLOAT16;
        MaskPrefetch mask_lines(p, b, kvh, q0, qn, rows, kt, prefetch_mask ? n : 0);
        if (mask_lines.total_lines() > 0) {
            const int64_t per_step = (mask_lines.total_lines() + tile_scores_steps(n, mp, D) - 1) /
                                     tile_scores_steps(n, mp, D);
            tile_scores(k, split ? 2 * D : p.k_stride[2], n, buffers.qb, D, s, mp, buffers.k_block, split ? D : 0,
                        split ? mp * D : 0, [&] { mask_lines.issue<2>(per_step); });
        } else {
            tile_scores(k, split ? 2 * D : p.k_stride[2], n, buffers.qb, D, s, mp, buffers.k_block, split ? D : 0,
                        split ? mp * D : 0);
        }
        scores_to_pairs(p, buffers, packer, b, kvh, q0, qn, mp, kt, n, false);
        tile_output(vt, steps, buffers.pb, N, (n + 31) / 32, Dv, o, mp, split ? N * Dv : 0, split ? N * mp : 0);
    }
    _tile_release();
    write_rows(p, b, kvh, q0, qn, rows, mp, o, buffers.row_max, buffers.row_sum, partial_out, partial_lse);
}

/* ---- decode: a few rows ------------------------------------------------------------------------------
 *
 * With rows <= kAmxDecodeMaxRows (decodes, GQA groups times a few queries) K and V are read once for
 * R rows, so the kernel must keep up with memory.  The layout and softmax are the vector decode's
 * (each row's scores along the keys, softmax_rows_rescaled); the products:
 *   S^T[keys][16] = K Q^T  tile_scores: A = 16 keys x 32 dims read in place from K, B = Q^T in
 *                          pairs of dims (rows past R zero); the R live columns go to the rows,
 *                          scaled (Q is not): by 4 x 4 transposes up to 8 rows
 *                          (score_rows_from_columns), else a 16 x 16 one;
 *   O += P V               A = P "in parity pairs", 16 keys a tile: O[r]'s even columns come from a
 *                          row holding (P[r][j], 0), its odd ones from a row holding (0, P[r][j]),
 *                          with B = V's 16 rows as they lie (each row 16 pairs of adjacent columns):
 *                          V is read in place, never interleaved or transposed.  Up to 8 rows both
 *                          parities share one A tile (row r even, row R + r odd), which the idle
 *                          rows had left free: the tdpbf16ps count equals the interleaved layout's.
 *                          Above 8 rows each parity has a tile of its own (twice the products,
 *                          against the interleave or transpose of V for every key tile).
 * The price of the zero half of each pair: it multiplies the neighbouring column's V, so a NaN or
 * infinity in V reaches its neighbour column too.  Either way the row's output is non-finite, so
 * the rerun that skips zero weights (forward_tiles.h, note_stored) recomputes it, on the vector
 * decode (this kernel declines that rerun).
 * Tiles, all 16 rows x 64 bytes as configure_tiles sets them: for O += P V, C tiles 0-3 hold O over a
 * key tile (loaded and stored once per tile: the online softmax's rescales run on the buffer between
 * tiles): four 32-column chunks up to 8 rows, else two chunks' even and odd tiles; A tiles 4 (and 5,
 * the odd one, above 8 rows) a key block's P, B tiles V's chunks.  ParityLayout says where each
 * row's even and odd parts lie in the P tiles and the O buffer.
 * Before, P V ran on V interleaved in pairs of keys through memory (pack_row_pairs: a load, two
 * permutes and two stores per 64 bytes of V, then a tile load of the result), S^T went to the rows
 * by whole 16 x 16 transposes, and the prefetches came in bursts of ~64 lines per 16 keys.  2-core
 * Xeon model 167, kernel_ab.py decode bfloat16, paired medians: in L2 (one thread) 30.6 -> 20.7 ns a
 * key, streamed (C6, 2 threads) 30.2 -> 23.5; bench_cpu.py C6 3.72 ms, 0.68 of the prefetched read
 * (0.46 before, benchmarks/README).  9-16 rows ran on forward_block_amx, which transposes V per key
 * tile: C6q4 (16 rows) streamed 1.27x faster here (7.90 -> 6.30 ms in bench_cpu.py), though in L2 it
 * is 0.85x (37 -> 43 ns a key: sixteen rows' softmax along the keys and twice the P V products);
 * a decode streams its cache, so the decode kernel takes them.  Running each tile's P V after the
 * next tile's Q K^T (so that no tile load reads what vector stores had just written) was 3-5%
 * slower both ways and was dropped.
 * Taken when: bfloat16, D and Dv multiples of 32, key_tile of 32, no rerun that skips zero weights.
 */
constexpr int kAmxDecodeMaxRows = 16;

static bool amx_decode_applies(const FwdParams& p, int64_t rows) {
    return rows <= kAmxDecodeMaxRows && p.head_dim % 32 == 0 && p.head_dim_v % 32 == 0 && p.key_tile % 32 == 0 &&
           !p.skip_zero_weights;
}

/* Where the decode's parity pairs lie for R rows: in a key block's P tiles (p_block elements a block)
 * row r's even pairs at 32 r, its odd ones p_odd further; in O's buffer (o_chunk floats a 32-column
 * chunk) row r's even columns at 16 r, its odd ones o_odd further. */
struct ParityLayout {
    int rows;
    bool split; /* even and odd rows in tiles of their own (more than 8 rows) */
    int64_t p_block, p_odd, o_chunk, o_odd;

    explicit ParityLayout(int rows_)
        : rows(rows_),
          split(rows_ > 8),
          p_block(split ? 1024 : 512),
          p_odd(split ? 512 : 32 * rows_),
          o_chunk(split ? 512 : 256),
          o_odd(split ? 256 : 16 * rows_) {}
};

/* Rows r < rows of s (N apart) take the first `rows` columns of one 16 x 16 block of S^T (16 keys,
 * rows of 16 floats), times scale.  Up to 8 rows: per 4 columns, four 4 x 4 transposes side by side
 * (one per 128-bit lane of 4 keys), where a whole 16 x 16 transpose would shuffle 16 columns to keep
 * 4 or 8. */
static inline void score_rows_from_columns(const float* scores_t, int rows, float* s, int64_t N, __m512 scale) {
    if (rows > 8) {
        __m512i block[16];
        for (int i = 0; i < 16; ++i) block[i] = _mm512_castps_si512(_mm512_loadu_ps(scores_t + i * 16));
        transpose_16x16_dwords(block);
        for (int r = 0; r < rows; ++r) _mm512_storeu_ps(s + r * N, _mm512_mul_ps(_mm512_castsi512_ps(block[r]), scale));
        return;
    }
    for (int c = 0; c < rows; c += 4) {
        __m512 z[4]; /* z[q], lane l: S^T[4 l + q][c .. c + 3] */
        for (int q = 0; q < 4; ++q) {
            z[q] = _mm512_castps128_ps512(_mm_loadu_ps(scores_t + q * 16 + c));
            z[q] = _mm512_insertf32x4(z[q], _mm_loadu_ps(scores_t + (4 + q) * 16 + c), 1);
            z[q] = _mm512_insertf32x4(z[q], _mm_loadu_ps(scores_t + (8 + q) * 16 + c), 2);
            z[q] = _mm512_insertf32x4(z[q], _mm_loadu_ps(scores_t + (12 + q) * 16 + c), 3);
        }
        const __m512 t0 = _mm512_unpacklo_ps(z[0], z[1]), t1 = _mm512_unpackhi_ps(z[0], z[1]);
        const __m512 t2 = _mm512_unpacklo_ps(z[2], z[3]), t3 = _mm512_unpackhi_ps(z[2], z[3]);
        const __m512 column[4] = {
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2))),
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)))};
        for (int i = 0; i < 4 && c + i < rows; ++i) _mm512_storeu_ps(s + (c + i) * N, _mm512_mul_ps(column[i], scale));
    }
}

/* The A tiles of O += P V in parity pairs (see above) for the tile's n keys, 16 keys a block at
 * pa + layout.p_block kb: P rounded to bfloat16 as the GPU kernels do, keys from n on zero; the
 * tiles' other rows are left as they are (zero, from the item's start). */
static inline void pack_parity_probabilities(const float* s, int64_t N, const ParityLayout& layout, int64_t n,
                                             uint16_t* pa) {
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = j + 16 <= n ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        uint16_t* block = pa + j / 16 * layout.p_block;
        for (int r = 0; r < layout.rows; ++r) {
            const __m512 weights = _mm512_maskz_loadu_ps(live, s + r * N + j);
            const __m512i even = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(weights));
            _mm512_storeu_si512(block + r * 32, even);
            _mm512_storeu_si512(block + r * 32 + layout.p_odd, _mm512_slli_epi32(even, 16));
        }
    }
}

/* Where parity_output's steps read V: a key block's 16 rows from v (row_bytes apart), or, for the
 * last block where it is partial, from v_block (tail_bytes apart). */
struct ValueBlocks {
    const uint16_t* v;
    int64_t row_bytes;
    const uint16_t* v_block;
    int64_t tail_bytes, blocks;

    const uint16_t* rows(int64_t kb, int64_t* bytes) const {
        const bool padded = v_block != nullptr && kb == blocks - 1;
        *bytes = padded ? tail_bytes : row_bytes;
        return padded ? v_block : v + kb * 16 * (row_bytes / 2);
    }
};

/* Up to 8 rows: O's chunks c0 .. c0 + C - 1 (C <= 4, tiles o_chunk apart from o) += P V over the
 * tile's key blocks: A tile 4 = pa's block kb, B tiles = V's chunks.  between() after each product. */
template <int C, typename Between>
static inline void parity_chunks(const uint16_t* pa, const ValueBlocks& values, float* o, Between&& between) {
    _tile_loadd(0, o, 64);
    if (C > 1) _tile_loadd(1, o + 256, 64);
    if (C > 2) _tile_loadd(2, o + 512, 64);
    if (C > 3) _tile_loadd(3, o + 768, 64);
    for (int64_t kb = 0; kb < values.blocks; ++kb) {
        int64_t bytes;
        const uint16_t* rows = values.rows(kb, &bytes);
        _tile_loadd(4, pa + kb * 512, 64);
        _tile_loadd(5, rows, bytes);
        _tile_dpbf16ps(0, 4, 5);
        between();
        if (C > 1) {
            _tile_loadd(6, rows + 32, bytes);
            _tile_dpbf16ps(1, 4, 6);
            between();
        }
        if (C > 2) {
            _tile_loadd(7, rows + 64, bytes);
            _tile_dpbf16ps(2, 4, 7);
            between();
        }
        if (C > 3) {
            _tile_loadd(5, rows + 96, bytes);
            _tile_dpbf16ps(3, 4, 5);
            between();
        }
    }
    _tile_stored(0, o, 64);
    if (C > 1) _tile_stored(1, o + 256, 64);
    if (C > 2) _tile_stored(2, o + 512, 64);
    if (C > 3) _tile_stored(3, o + 768, 64);
}

/* Above 8 rows: O's chunks c0 (and c0 + 1 for C = 2; even tile, then odd, 256 floats apart, 512 a
 * chunk) += P V: A tiles 4 and 5 = pa's even and odd tiles of block kb, B tiles 6, 7 = V's chunks.
 * between() after each pair of products. */
template <int C, typename Between>
static inline void parity_chunk_pairs(const uint16_t* pa, const ValueBlocks& values, float* o, Between&& between) {
    _tile_loadd(0, o, 64);
    _tile_loadd(1, o + 256, 64);
    if (C > 1) {
        _tile_loadd(2, o + 512, 64);
        _tile_loadd(3, o + 768, 64);
    }
    for (int64_t kb = 0; kb < values.blocks; ++kb) {
        int64_t bytes;
        const uint16_t* rows = values.rows(kb, &bytes);
        _tile_loadd(4, pa + kb * 1024, 64);
        _tile_loadd(5, pa + kb * 1024 + 512, 64);
        _tile_loadd(6, rows, bytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        between();
        if (C > 1) {
            _tile_loadd(7, rows + 32, bytes);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
            between();
        }
    }
    _tile_stored(0, o, 64);
    _tile_stored(1, o + 256, 64);
    if (C > 1) {
        _tile_stored(2, o + 512, 64);
        _tile_stored(3, o + 768, 64);
    }
}

/* O += P V for the tile's n keys (V's rows v_stride elements apart); a partial last block of keys is
 * copied into v_block with zero rows after it (zero P times zero V: what follows V in memory is never
 * read). */
template <typename Between>
static void parity_output(const uint16_t* pa, const ParityLayout& layout, const uint16_t* v, int64_t v_stride,
                          int64_t n, int64_t Dv, float* o, uint16_t* v_block, Between&& between) {
    const int64_t blocks = (n + 15) / 16, tail = n % 16, chunks = Dv / 32;
    if (tail) {
        std::memset(v_block, 0, sizeof(uint16_t) * 16 * Dv);
        for (int64_t j = 0; j < tail; ++j) std::memcpy(v_block + j * Dv, v + (n - tail + j) * v_stride, 2 * Dv);
    }
    const int64_t step = layout.split ? 2 : 4; /* chunks a pass: four C tiles */
    for (int64_t c = 0; c < chunks; c += step) {
        const ValueBlocks values{v + c * 32, v_stride * 2, tail ? v_block + c * 32 : nullptr, Dv * 2, blocks};
        float* chunk = o + c * layout.o_chunk;
        switch (layout.split ? -std::min<int64_t>(2, chunks - c) : std::min<int64_t>(4, chunks - c)) {
            case -1: parity_chunk_pairs<1>(pa, values, chunk, between); break;
            case -2: parity_chunk_pairs<2>(pa, values, chunk, between); break;
            case 1: parity_chunks<1>(pa, values, chunk, between); break;
            case 2: parity_chunks<2>(pa, values, chunk, between); break;
            case 3: parity_chunks<3>(pa, values, chunk, between); break;
            default: parity_chunks<4>(pa, values, chunk, between); break;
        }
    }
}

static void forward_decode_amx(const FwdParams& p, char* scratch, int64_t b, int64_t kvh, int64_t q0, int64_t qn,
                               int64_t k_begin, int64_t k_end, float* partial_out, float* partial_lse) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v, N = p.key_tile, chunks = Dv / 32;
    const int rows = (int)(p.group * qn);
    const ParityLayout layout(rows);
    PairBuffers buffers;
    buffers.carve(p, scratch);
    float* scores_t = buffers.s;                  /* [N][16]: S^T as the tiles leave it */
    float* s = scores_t + N * 16;                 /* [rows][N] */
    float* o = buffers.o;                         /* [Dv/32][o_chunk]: O's chunks in parity rows */
    float* o_rows = o + chunks * layout.o_chunk;  /* [rows][Dv]: O in order, for write_row */
    uint16_t* pa = buffers.pb;                    /* [N/16][p_block]: P in parity pairs */
    uint16_t* v_block = buffers.vt;               /* [16][Dv]: a partial last block of V */
    int64_t head[kAmxDecodeMaxRows], query[kAmxDecodeMaxRows];
    float position[kAmxDecodeMaxRows], row_max[kAmxDecodeMaxRows], row_sum[kAmxDecodeMaxRows];
    start_rows<float>(p, kvh, q0, qn, rows, head, query, position, row_max, row_sum);
    pack_queries(p, b, kvh, q0, qn, 16, buffers.qb);
    std::memset(o, 0, sizeof(float) * chunks * layout.o_chunk);
    std::memset(pa, 0, sizeof(uint16_t) * N / 16 * layout.p_block);
    auto rescale = [&](int r, float alpha) {
        const __m512 by = _mm512_set1_ps(alpha);
        for (int64_t c = 0; c < chunks; ++c)
            for (float* part : {o + c * layout.o_chunk + r * 16, o + c * layout.o_chunk + layout.o_odd + r * 16})
                _mm512_storeu_ps(part, _mm512_mul_ps(_mm512_loadu_ps(part), by));
    };

    int64_t lo, hi;
    visible_keys(p, b, q0, qn, k_begin, k_end, &lo, &hi);
    const __m512 scale = _mm512_set1_ps((float)p.scale);
    configure_tiles();
    for (int64_t kt = lo; kt < hi; kt += N) {
        const int64_t n = std::min(N, hi - kt), blocks = (n + 15) / 16;
        if (p.mask_kind != MASK_NONE && mask_hides_tile(p, b, kvh, q0, qn, kt, n)) continue;
        const uint16_t* k = at<uint16_t>(p.k, b * p.k_stride[0] + kvh * p.k_stride[1] + kt * p.k_stride[2]);
        const uint16_t* v = at<uint16_t>(p.v, b * p.v_stride[0] + kvh * p.v_stride[1] + kt * p.v_stride[2]);
        /* The next tile's rows, a few lines at a time after each of this tile's products (as
         * DotKernel spreads them: a burst would stall the core on full fill buffers). */
        SpreadPrefetch<uint16_t> ahead(p, b, kvh, kt + N, kt + N < hi ? std::min(N, hi - kt - N) : 0);
        const int64_t calls = (blocks + 1) / 2 * (D / 32) + blocks * chunks;
        const int64_t lines_per_call = (ahead.total_lines() + calls - 1) / calls;
        auto issue = [&]() __attribute__((always_inline)) { ahead.issue(lines_per_call); };

        tile_scores_as<false>(k, p.k_stride[2], n, buffers.qb, D, scores_t, 16, buffers.k_block, 0, 0, issue);
        for (int64_t kb = 0; kb < blocks; ++kb)
            score_rows_from_columns(scores_t + kb * 256, rows, s + kb * 16, N, scale);
        softmax_rows_rescaled<float>(p, s, N, rows, n, kt, b, kvh, q0, qn, head, query, position, row_max, row_sum,
                                     rescale);
        pack_parity_probabilities(s, N, layout, n, pa);
        parity_output(pa, layout, v, p.v_stride[2], n, Dv, o, v_block, issue);
    }
    _tile_release();
    const __m512i even_first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i even_second = _mm512_add_epi32(even_first, _mm512_set1_epi32(8));
    for (int r = 0; r < rows; ++r) {
        float* row = o_rows + r * Dv;
        for (int64_t c = 0; c < chunks; ++c) {
            const float* even = o + c * layout.o_chunk + r * 16;
            const __m512 evens = _mm512_loadu_ps(even), odds = _mm512_loadu_ps(even + layout.o_odd);
            _mm512_storeu_ps(row + c * 32, _mm512_permutex2var_ps(evens, even_first, odds));
            _mm512_storeu_ps(row + c * 32 + 16, _mm512_permutex2var_ps(evens, even_second, odds));
        }
        write_row<float, bfloat16_bits>(p, b, head[r], query[r], r, row, row_max[r], row_sum[r], partial_out,
                                        partial_lse);
    }
}

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
#endif
