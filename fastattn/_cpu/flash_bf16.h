/* bfloat16 attention on the CPUs' bfloat16 dot-product units: the operands in pairs, and the forward
 * and the decode on AVX512_BF16 vectors (AMD Zen 4 and later, Intel Cooper Lake and later).
 *
 * `vdpbf16ps` adds, in each of 16 float32 lanes, the products of two bfloat16 pairs: a vector of
 * pairs (x[2i], x[2i+1]) against a vector of (y[2i], y[2i+1]).  So a product of depth k runs k/2
 * instructions of 32 multiply-adds, twice FMA's 16, reading bfloat16 as it lies in memory with no
 * conversion.  The operands go in pairs along the depth:
 *   - "column pairs" (pack_column_pairs): rows of 16 as one vector per pair of columns,
 *     Out[row tile][dims/2][16][2];
 *   - "row pairs" (pack_row_pairs): two rows interleaved, Out[rows/2][dims][2].
 * These are also the layouts of AMX's B tiles ("VNNI"): flash_amx.h takes the packing, the buffers
 * and the output writing from here and runs the products on tiles instead.  The backward on either
 * (flash_backward_bf16.h) runs its products through pairs_dot too at this level.
 *
 * The forward (forward_block_dpbf16) keeps forward_block's work item and rows-as-lanes layout
 * (flash_forward.h): the softmax, masks, dropout and the lse are the same code, on float32 S and O.
 *   S^T[j][rows] = K Q^T       Q in column pairs, packed once per item: Qb[row tile][D/2][16][2];
 *                              K read in place, pair (K[j][2p], K[j][2p+1]) broadcast as one dword;
 *   O^T[c][rows] += V^T P^T    P in column pairs, rounded to bfloat16 as the GPU kernels do (the row
 *                              sums take the float32 P): Pb[row tile][N/2][16][2], packed by the
 *                              softmax as it computes P; V in row pairs, packed per key tile
 *                              (an interleave, no transpose), pair (V[2i][c], V[2i+1][c]) broadcast;
 *                              one row tile (9-16 rows) keeps O by rows instead, V as it lies
 *                              (decode_values; see "one work item").
 * Q is not pre-scaled (a bfloat16 Q times scale would round again): the scale rides in the softmax's
 * exponent, or, where masks or softcap need scaled scores, one pass scales S first.
 *
 * Micro-kernel (pairs_dot): MR = 8 rows of S^T (keys) or O^T (columns) x NV = 2 vectors of 16 rows,
 * 16 float32 accumulators, two vector loads and 8 broadcasts a step, as forward_block's FMA kernel
 * (on a Zen 5 the forward so runs at 68-81% of torch's bf16 gemm).  Key tiles and row blocks are
 * forward_block's (the planner's TILE_ROWS / KEY_TILE: 128 x 256 measured within 3-5% of them).
 *
 * Taken when: bfloat16 inputs, D and Dv multiples of 32, key_tile of 32, more rows than the decode
 * path's, and no rerun that must skip zero weights; otherwise forward_block runs on float32
 * conversions.  At the amx level the AMX kernels (flash_amx.h) run the same items instead.
 */
#ifndef FASTATTN_FLASH_BF16_H
#define FASTATTN_FLASH_BF16_H

#include "forward_items.h"

#if defined(FASTATTN_HAS_AVX512BF16)

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

static inline int64_t align64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* The item's buffers, carved from the thread's scratch (64-byte aligned).  float16 inputs on AMX
 * (flash_amx.h) hold two parts of each packed operand (split_floats): qb, pb, vt and k_block twice
 * the size, and a key tile's V rows, then its K rows, split in kv_parts where no pass before the
 * items split them. */
struct PairBuffers {
    float *s, *o, *row_max, *row_sum, *position, *key_mask;
    uint16_t *mask_rows, *qb, *pb, *vt, *k_block, *kv_parts;

    static int64_t bytes(const FwdParams& p) { return PairBuffers().carve(p, nullptr); }

    int64_t carve(const FwdParams& p, char* base) {
        const int64_t mp = round_up(p.group * p.block_queries, 32), N = p.key_tile;
        const int64_t D = p.head_dim, Dv = p.head_dim_v, parts = p.dtype == DTYPE_FLOAT16 ? 2 : 1;
        /* pb: P's pairs, or the AMX decode's P in parity pairs (flash_amx.h), two 16 x 32 tiles per
         * 16 keys above 8 rows: 64 elements a key. */
        const int64_t sizes[] = {4 * N * mp,
                                 4 * Dv * mp,
                                 4 * mp,
                                 4 * mp,
                                 4 * mp,
                                 4 * N,
                                 2 * N * mp,
                                 2 * parts * mp * D,
                                 2 * N * std::max<int64_t>(parts * mp, 64),
                                 2 * parts * Dv * N,
                                 2 * parts * 16 * D,
                                 parts > 1 ? 2 * N * 2 * std::max(D, Dv) : 0};
        void** slots[] = {(void**)&s,        (void**)&o,        (void**)&row_max,      (void**)&row_sum,
                          (void**)&position, (void**)&key_mask, (void**)&mask_rows,    (void**)&qb,
                          (void**)&pb,       (void**)&vt,       (void**)&k_block,      (void**)&kv_parts};
        static_assert(sizeof(sizes) / sizeof(sizes[0]) == sizeof(slots) / sizeof(slots[0]), "one size a slot");
        int64_t offset = 0;
        for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
            if (base) *slots[i] = base + offset;
            offset += align64(sizes[i]);
        }
        return offset;
    }
};

/* ---- float16 as two bfloat16 parts ------------------------------------------------------------------
 *
 * A float16 x is hi + lo exactly: hi, x rounded to bfloat16, keeps the top 8 of its 11 significant
 * bits, and lo = x - hi is a multiple of x's last place no larger than 4 of them, 3 bits, which
 * bfloat16 holds (float16's range lies inside bfloat16's, subnormals included).  So x y = hi hi' +
 * hi lo' + lo hi' + lo lo', each product exact in float32; the AMX forward (flash_amx.h) runs the
 * first three on bfloat16 tiles (the fourth is below 2^-16 of x y) with float32 accumulation: the
 * products of float16 inputs without float16's rounding, on AMX's bfloat16 units (AVX512_FP16's
 * FMAs accumulate in float16; the Xeons with AMX have no float16 tiles before AMX-FP16).  A float32
 * P splits the same way to 16 significant bits (error below 2^-17 of P), finer than the float16 P
 * the GPU kernels multiply V by. */

/* Bfloat16 values (a vector of 16 in the low words of each dword pair) back to float32. */
static inline __m512 widen_bf16(__m256i words) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
}

/* 16 floats as bfloat16 parts hi (x rounded) and lo (x - hi rounded); lo is 0 where hi is infinite
 * (inf - inf would make it NaN), NaN where x is. */
static inline void split_floats(__m512 x, __m256i* hi, __m256i* lo) {
    const __m256i high = (__m256i)_mm512_cvtneps_pbh(x);
    const __m512 widened = widen_bf16(high);
    const __mmask16 finite = (__mmask16)~_mm512_fpclass_ps_mask(widened, 0x18); /* 0x18: +inf, -inf */
    *hi = high;
    *lo = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_sub_ps(finite, x, widened));
}

/* How the packers read a row's bfloat16 operand: 32 (row32) or 16 (row16) values from `src`.
 * Bf16Rows: bfloat16 inputs as they lie; HalfPart<High>: float16 inputs' hi or lo part. */
struct Bf16Rows {
    static inline __m512i row32(const uint16_t* src) { return _mm512_loadu_si512(src); }
    static inline __m256i row16(const uint16_t* src) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    }
};

template <bool High> struct HalfPart {
    static inline __m256i row16(const uint16_t* src) {
        __m256i hi, lo;
        split_floats(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), &hi, &lo);
        return High ? hi : lo;
    }
    static inline __m512i row32(const uint16_t* src) {
        return _mm512_inserti64x4(_mm512_castsi256_si512(row16(src)), row16(src + 16), 1);
    }
};

/* n float16 rows of `dims` values (x, x_stride elements apart) as rows [hi (dims) | lo (dims)] in out. */
static void split_rows(const uint16_t* x, int64_t x_stride, int64_t n, int64_t dims, uint16_t* out) {
    for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < dims; d += 16) {
            __m256i hi, lo;
            split_floats(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j * x_stride + d))),
                         &hi, &lo);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * 2 * dims + d), hi);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * 2 * dims + dims + d), lo);
        }
}

/* ---- packing ------------------------------------------------------------------------------------ */

/* Rows r[0..15] of 16 dwords become their transpose (three shuffle stages, 64 instructions). */
static inline void transpose_16x16_dwords(__m512i r[16]) {
    __m512i a[16], c[16];
    for (int k = 0; k < 16; k += 2) {
        a[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
        a[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
    }
    for (int k = 0; k < 16; k += 4) { /* c[k + m], lane L: rows k..k+3 at column 4L + m */
        c[k] = _mm512_unpacklo_epi64(a[k], a[k + 2]);
        c[k + 1] = _mm512_unpackhi_epi64(a[k], a[k + 2]);
        c[k + 2] = _mm512_unpacklo_epi64(a[k + 1], a[k + 3]);
        c[k + 3] = _mm512_unpackhi_epi64(a[k + 1], a[k + 3]);
    }
    for (int m = 0; m < 4; ++m) {
        const __m512i even0 = _mm512_shuffle_i32x4(c[m], c[4 + m], 0x88), odd0 = _mm512_shuffle_i32x4(c[m], c[4 + m], 0xDD);
        const __m512i even1 = _mm512_shuffle_i32x4(c[8 + m], c[12 + m], 0x88),
                      odd1 = _mm512_shuffle_i32x4(c[8 + m], c[12 + m], 0xDD);
        r[m] = _mm512_shuffle_i32x4(even0, even1, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(odd0, odd1, 0x88);
        r[8 + m] = _mm512_shuffle_i32x4(even0, even1, 0xDD);
        r[12 + m] = _mm512_shuffle_i32x4(odd0, odd1, 0xDD);
    }
}

/* Out[rt][dims/2][16][2]: rows 0..mp-1 (row(r): a pointer to its `dims` values, or null for a zero
 * row, read by Rows) as B tiles whose K dimension is the columns, in pairs: per 16 rows and 32
 * columns, the rows' 16 dwords transposed in registers.  dims: a multiple of 32. */
template <typename Rows = Bf16Rows, typename RowOf>
static void pack_column_pairs(RowOf row, int64_t mp, int64_t dims, uint16_t* out) {
    for (int64_t rt = 0; rt < mp / 16; ++rt) {
        const uint16_t* src[16];
        for (int i = 0; i < 16; ++i) src[i] = row(rt * 16 + i);
        for (int64_t step = 0; step < dims / 32; ++step) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i)
                r[i] = src[i] ? Rows::row32(src[i] + step * 32) : _mm512_setzero_si512();
            transpose_16x16_dwords(r);
            uint16_t* tile = out + (rt * (dims / 2) + step * 16) * 32;
            for (int pair = 0; pair < 16; ++pair) _mm512_storeu_si512(tile + pair * 32, r[pair]);
        }
    }
}

/* Out[mp/2][dims][2]: rows 0..mp-1 (row(r) as for pack_column_pairs, read by Rows) as B tiles whose
 * K dimension is the rows, in pairs: row i of the result interleaves rows 2i and 2i + 1; between()
 * runs before each (the decode spreads its prefetches there). */
template <typename Rows = Bf16Rows, typename RowOf, typename Between>
static void pack_row_pairs(RowOf row, int64_t mp, int64_t dims, uint16_t* out, Between&& between) {
    alignas(64) static const uint16_t low_index[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i low = _mm512_load_si512(low_index), high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t i = 0; i < mp / 2; ++i) {
        between();
        const uint16_t *even = row(2 * i), *odd = row(2 * i + 1);
        uint16_t* dst = out + i * dims * 2;
        for (int64_t c = 0; c < dims; c += 32) {
            const __m512i a = even ? Rows::row32(even + c) : _mm512_setzero_si512();
            const __m512i b = odd ? Rows::row32(odd + c) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(a, low, b));
            _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(a, high, b));
        }
    }
}

template <typename Rows = Bf16Rows, typename RowOf>
static void pack_row_pairs(RowOf row, int64_t mp, int64_t dims, uint16_t* out) {
    pack_row_pairs<Rows>(row, mp, dims, out, [] {});
}

/* Qb[rt][D/2][16][2]: the B tiles of S^T = K Q^T, row tile rt, 32 dims a step (16 pair-rows);
 * float16 Q's hi part there and its lo part mp * D elements on. */
static void pack_queries(const FwdParams& p, int64_t b, int64_t kvh, int64_t q0, int64_t qn, int64_t mp,
                         uint16_t* qb) {
    const int64_t rows = p.group * qn;
    auto row = [&](int64_t r) -> const uint16_t* {
        if (r >= rows) return nullptr;
        const int64_t h = kvh * p.group + r / qn, i = q0 + r % qn;
        return at<uint16_t>(p.q, b * p.q_stride[0] + h * p.q_stride[1] + i * p.q_stride[2]);
    };
    if (p.dtype == DTYPE_FLOAT16) {
        pack_column_pairs<HalfPart<true>>(row, mp, p.head_dim, qb);
        pack_column_pairs<HalfPart<false>>(row, mp, p.head_dim, qb + mp * p.head_dim);
    } else {
        pack_column_pairs(row, mp, p.head_dim, qb);
    }
}

/* Word index that interleaves the two halves of a 32-word vector: (w0, w16, w1, w17, ...). */
static inline __m512i interleave_halves_index() {
    alignas(64) static const uint16_t index[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_load_si512(index);
}

/* Pb[rt][N/2][16][2]: the B tiles of O^T += V^T P^T, P rounded to bfloat16 (for float16 inputs,
 * lo_offset > 0: P's hi part, and its lo part lo_offset elements on).  online_softmax hands over keys
 * j and j + 1 of 16 rows (r, a multiple of 16) as they are computed, so P never returns to S;
 * `zero_tail` then clears the pairs from n up to the next multiple of 32 keys. */
struct PackProbabilities {
    static constexpr bool leaves_scores = true; /* online_softmax may skip a settled tile's maximum */
    uint16_t* pb;
    int64_t N;
    __m512i interleave;
    int64_t lo_offset = 0;

    inline void operator()(int64_t j, int64_t r, __m512 p0, __m512 p1) const {
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0); /* words 0-15: p0, 16-31: p1 */
        uint16_t* at = pb + (r / 16) * N * 16 + j * 16;
        _mm512_storeu_si512(at, _mm512_permutexvar_epi16(interleave, both));
        if (lo_offset) { /* P is finite or NaN: no infinite hi part to guard */
            const __m512 rest0 = _mm512_sub_ps(p0, widen_bf16(_mm512_castsi512_si256(both)));
            const __m512 rest1 = _mm512_sub_ps(p1, widen_bf16(_mm512_extracti64x4_epi64(both, 1)));
            _mm512_storeu_si512(at + lo_offset,
                                _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(rest1, rest0)));
        }
    }

    void zero_tail(int64_t n, int64_t mp) const {
        for (int64_t rt = 0; rt < mp / 16; ++rt)
            for (int64_t j = round_up(n, 2); j < round_up(n, 32); j += 2) {
                _mm512_storeu_si512(pb + rt * N * 16 + j * 16, _mm512_setzero_si512());
                if (lo_offset) _mm512_storeu_si512(pb + lo_offset + rt * N * 16 + j * 16, _mm512_setzero_si512());
            }
    }

    /* From P already in S[j][rows] (the dropout path, which scales P after the row sums took it). */
    void pack(const float* s, int64_t n, int64_t mp) const {
        for (int64_t r = 0; r < mp; r += 16)
            for (int64_t j = 0; j < n; j += 2)
                (*this)(j, r, _mm512_loadu_ps(s + j * mp + r),
                        j + 1 < n ? _mm512_loadu_ps(s + (j + 1) * mp + r) : _mm512_setzero_ps());
        zero_tail(n, mp);
    }
};

/* Normalise and write the item's rows from O^T[Dv][rows]: 16 x 16 blocks transposed in registers,
 * each row scaled by 1 / row_sum, rounded to the inputs' bfloat16 or float16 (or kept float32 for a
 * key split's partial output) and stored whole; then each row's lse.  Same conventions as write_row. */
static void write_rows(const FwdParams& p, int64_t b, int64_t kvh, int64_t q0, int64_t qn, int64_t rows, int64_t mp,
                       const float* o, const float* row_max, const float* row_sum, float* partial_out,
                       float* partial_lse) {
    const int64_t Dv = p.head_dim_v;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    __mmask16 nonfinite = 0;
    for (int64_t rt = 0; rt < mp / 16 && rt * 16 < rows; ++rt) {
        float inverse[16];
        for (int i = 0; i < 16; ++i) {
            const int64_t r = std::min(rt * 16 + i, rows - 1);
            inverse[i] = row_sum[r] != 0.0f ? 1.0f / row_sum[r] : 0.0f;
        }
        for (int64_t cb = 0; cb < Dv / 16; ++cb) {
            __m512i block[16];
            for (int c = 0; c < 16; ++c) block[c] = _mm512_castps_si512(_mm512_loadu_ps(o + (cb * 16 + c) * mp + rt * 16));
            transpose_16x16_dwords(block);
            for (int i = 0; i < 16 && rt * 16 + i < rows; ++i) {
                const int64_t r = rt * 16 + i;
                const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(block[i]), _mm512_set1_ps(inverse[i]));
                if (partial_out) {
                    _mm512_storeu_ps(partial_out + r * Dv + cb * 16, value);
                    continue;
                }
                nonfinite |= _mm512_cmp_ps_mask(_mm512_sub_ps(value, value), _mm512_setzero_ps(), _CMP_NEQ_UQ);
                const int64_t h = kvh * p.group + r / qn, i_query = q0 + r % qn;
                uint16_t* dst = reinterpret_cast<uint16_t*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] +
                                i_query * p.out_stride[2] + cb * 16;
                const __m256i rounded = p.dtype == DTYPE_FLOAT16
                                            ? _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                            : (__m256i)_mm512_cvtneps_pbh(value);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), rounded);
            }
        }
    }
    if (nonfinite) note_stored(p, std::numeric_limits<double>::quiet_NaN());
    for (int64_t r = 0; r < rows; ++r) {
        const bool saw_key = row_sum[r] != 0.0f; /* NaN is not "no key": it poisons the row */
        const float lse = saw_key ? row_max[r] + std::log(row_sum[r]) : neg_inf;
        if (partial_out) {
            partial_lse[r] = lse;
            continue;
        }
        const int64_t h = kvh * p.group + r / qn, i = q0 + r % qn;
        *(reinterpret_cast<float*>(p.lse) + b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]) = lse;
    }
}

/* Decode: each of `rows` rows' probabilities (row r at s + r * N, n keys) rounded to bfloat16 into
 * out + r * N, keys from n up to `keys` (a multiple of 16, <= N) zero. */
static inline void round_probability_rows(const float* s, int64_t N, int rows, int64_t n, int64_t keys,
                                          uint16_t* out) {
    for (int r = 0; r < rows; ++r)
        for (int64_t j = 0; j < keys; j += 16) {
            const __mmask16 live = j + 16 <= n ? (__mmask16)0xffff : j < n ? (__mmask16)((1u << (n - j)) - 1) : 0;
            const __m512 weights = _mm512_maskz_loadu_ps(live, s + r * N + j);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N + j), (__m256i)_mm512_cvtneps_pbh(weights));
        }
}

/* ---- a forward item's steps, on either product kind ------------------------------------------------- */

/* The item's rows padded to whole row tiles (mp), Q of rows 0..mp-1 in column pairs, each row's
 * position and softmax state, O^T zero.  Returns mp. */
static int64_t start_pairs_item(const FwdParams& p, const PairBuffers& buffers, int64_t b, int64_t kvh, int64_t q0,
                                int64_t qn) {
    const int64_t rows = p.group * qn, mp = round_up(rows, rows <= 16 ? 16 : 32);
    pack_queries(p, b, kvh, q0, qn, mp, buffers.qb);
    for (int64_t r = 0; r < mp; ++r) {
        buffers.position[r] = (float)((r < rows ? q0 + r % qn : q0) + p.offset);
        buffers.row_max[r] = -std::numeric_limits<float>::infinity();
        buffers.row_sum[r] = 0.0f;
    }
    std::memset(buffers.o, 0, sizeof(float) * p.head_dim_v * mp);
    return mp;
}

/* Whether a tile's mask goes to the softmax as it reads the scores rather than through a pass over
 * the tile: one mask row for all its rows (mask_rows_shared; mask_tiles.h: KeysHidden, KeysBiased),
 * or a bool or bfloat16 mask whose keys lie contiguous, in mask_rows as bits (full_mask_bits,
 * RowsHidden) or transposed words (full_mask_words, RowsBiased).  No softcap (which comes before
 * the mask) and no dropout (whose P returns to S).  A causal/window edge on the tile hides keys
 * after the mask: bool masks fold it into their bits (hide_band_bits), the others keep the pass
 * there.  On the 2-core Xeon model 167 (AMX) the pass cost the bfloat16 forward 11-20% with a
 * (B,1,1,Sk) mask and 26-32% with a (B,H,Sq,Sk) bool one (benchmarks/README). */
static bool softmax_takes_mask(const FwdParams& p, int64_t q0, int64_t qn, int64_t kt, int64_t n) {
    if (p.mask_kind == MASK_NONE || p.softcap > 0 || p.dropout_p > 0) return false;
    if (p.mask_kind == MASK_BOOL && p.mask_stride[3] == 1) return true;
    return !Band(p).edges(kt, n, q0 + p.offset, q0 + qn - 1 + p.offset).any() &&
           (mask_rows_shared(p) || (p.mask_kind == MASK_BFLOAT16 && p.mask_stride[3] == 1));
}

/* Clear the bits (full_mask_bits' layout, n keys from kt) of the keys the causal/window band hides
 * from each row (position: the rows' query positions; edges: the sides that cut this tile), with
 * finish_scores' comparisons. */
static void hide_band_bits(const Band& band, BandEdges edges, const float* position, int64_t mp, int64_t kt,
                           int64_t n, uint16_t* bits) {
    const __m512 left = _mm512_set1_ps((float)band.left), right = _mm512_set1_ps((float)band.right);
    for (int64_t r0 = 0; r0 < mp; r0 += 16) {
        const __m512 pos = _mm512_loadu_ps(position + r0);
        const __m512 first = _mm512_sub_ps(pos, left), last = _mm512_add_ps(pos, right);
        uint16_t* row_bits = bits + (r0 / 16) * n;
        for (int64_t j = 0; j < n; ++j) {
            const __m512 key = _mm512_set1_ps((float)(kt + j));
            __mmask16 visible = 0xffff;
            if (edges.left) visible &= _mm512_cmp_ps_mask(key, first, _CMP_GE_OQ);
            if (edges.right) visible &= _mm512_cmp_ps_mask(key, last, _CMP_LE_OQ);
            row_bits[j] &= visible;
        }
    }
}

/* One key tile's S^T (n keys from kt, unscaled, in buffers.s) to P in column pairs (packer), the
 * keys from n up to the next multiple of 32 zero: edges and masks, the online softmax (O^T rescaled,
 * or O's rows with o_by_row), dropout.  Masks and softcap see scaled scores, so S is scaled first
 * for them, unless the softmax takes the mask; otherwise the scale rides in the softmax's exponent. */
static void scores_to_pairs(const FwdParams& p, const PairBuffers& buffers, const PackProbabilities& packer, int64_t b,
                            int64_t kvh, int64_t q0, int64_t qn, int64_t mp, int64_t kt, int64_t n, bool o_by_row) {
    const int64_t rows = p.group * qn, Dv = p.head_dim_v;
    float* s = buffers.s;
    if (softmax_takes_mask(p, q0, qn, kt, n)) {
        const Band band(p);
        const BandEdges edges = band.edges(kt, n, q0 + p.offset, q0 + qn - 1 + p.offset);
        if (p.mask_kind == MASK_BOOL && (!mask_rows_shared(p) || edges.any())) {
            full_mask_bits(p, b, kvh, q0, qn, rows, mp, kt, n, buffers.mask_rows);
            if (edges.any()) hide_band_bits(band, edges, buffers.position, mp, kt, n, buffers.mask_rows);
            online_softmax<float>(s, n, mp, buffers.row_max, buffers.row_sum, buffers.o, Dv, (float)p.scale, packer,
                                  o_by_row, RowsHidden{buffers.mask_rows, n});
        } else if (!mask_rows_shared(p)) {
            full_mask_words(p, b, kvh, q0, qn, rows, mp, kt, n, buffers.mask_rows);
            online_softmax<float>(s, n, mp, buffers.row_max, buffers.row_sum, buffers.o, Dv, 1.0f, packer, o_by_row,
                                  RowsBiased{buffers.mask_rows, (n + 1) / 2, (float)p.scale});
        } else {
            shared_mask_values<float>(p, b, kvh, q0, qn, kt, n, buffers.key_mask);
            if (p.mask_kind == MASK_BOOL)
                online_softmax<float>(s, n, mp, buffers.row_max, buffers.row_sum, buffers.o, Dv, (float)p.scale,
                                      packer, o_by_row, KeysHidden<float>{buffers.key_mask});
            else
                online_softmax<float>(s, n, mp, buffers.row_max, buffers.row_sum, buffers.o, Dv, 1.0f, packer, o_by_row,
                                      KeysBiased<float>{buffers.key_mask, (float)p.scale});
        }
        packer.zero_tail(n, mp);
        return;
    }
    const bool scale_first = p.softcap > 0 || p.mask_kind != MASK_NONE; /* finish_scores scales on the way */
    finish_scores<float>(p, s, nullptr, mp, rows, n, kt, b, kvh, q0, qn, buffers.position, (float)p.scale);
    const float score_scale = scale_first ? 1.0f : (float)p.scale;
    if (p.dropout_p > 0) {
        online_softmax<float>(s, n, mp, buffers.row_max, buffers.row_sum, buffers.o, Dv, score_scale,
                              StoreProbabilities<float>{s, n, mp}, o_by_row);
        dropout_tile<float>(p, s, mp, 1, rows, n, kt, b, kvh, q0, qn, false);
        packer.pack(s, n, mp);
    } else {
        online_softmax<float>(s, n, mp, buffers.row_max, buffers.row_sum, buffers.o, Dv, score_scale, packer, o_by_row);
        packer.zero_tail(n, mp);
    }
}

/* ---- products on AVX512_BF16 vectors ------------------------------------------------------------ */

/* Two bfloat16 values as one dword in every lane (memcpy: `at` may be only 2-byte aligned). */
static inline __m512bh broadcast_pair(const uint16_t* at) {
    uint32_t word;
    std::memcpy(&word, at, sizeof(word));
    return (__m512bh)_mm512_set1_epi32((int)word);
}

/* C[m][lanes] (+)= sum_p X[m][p] . Y[p][lanes] for MR rows m of C and NV vectors of 16 lanes: pair p
 * of X's row m at x + m * x_m + p * x_p (bfloat16 elements), broadcast; Y's pairs of 16 lanes at
 * y + v * y_v + p * y_p; C's rows mp floats apart, overwritten or accumulated into.  between() runs
 * before each step (the decode spreads its prefetches there).  In the forward C is S^T or O^T, its
 * lanes the rows of the item (Y in column pairs: y_v a row tile, y_p 32). */
template <int MR, int NV, bool Accumulate, typename Between>
static inline void pairs_dot(const uint16_t* x, int64_t x_m, int64_t x_p, const uint16_t* y, int64_t y_v, int64_t y_p,
                             int64_t pairs, float* c, int64_t mp, Between&& between) {
    /* With one vector of lanes, MR accumulators are MR chains of vdpbf16ps, fewer than its latency
     * times its two pipes: even and odd pairs then add into separate accumulators (CH = 2). */
    constexpr int CH = NV == 1 ? 2 : 1;
    __m512 acc[CH][MR][NV];
    FASTATTN_UNROLL for (int m = 0; m < MR; ++m)
        FASTATTN_UNROLL for (int v = 0; v < NV; ++v) {
            acc[0][m][v] = Accumulate ? _mm512_loadu_ps(c + m * mp + v * 16) : _mm512_setzero_ps();
            FASTATTN_UNROLL for (int h = 1; h < CH; ++h) acc[h][m][v] = _mm512_setzero_ps();
        }
    int64_t p = 0;
    for (; p + CH <= pairs; p += CH) {
        between();
        FASTATTN_UNROLL for (int h = 0; h < CH; ++h) {
            __m512bh yv[NV];
            FASTATTN_UNROLL for (int v = 0; v < NV; ++v) yv[v] = (__m512bh)_mm512_loadu_si512(y + v * y_v + (p + h) * y_p);
            FASTATTN_UNROLL for (int m = 0; m < MR; ++m) {
                const __m512bh xb = broadcast_pair(x + m * x_m + (p + h) * x_p);
                FASTATTN_UNROLL for (int v = 0; v < NV; ++v) acc[h][m][v] = _mm512_dpbf16_ps(acc[h][m][v], yv[v], xb);
            }
        }
    }
    for (; p < pairs; ++p) {
        between();
        __m512bh yv[NV];
        FASTATTN_UNROLL for (int v = 0; v < NV; ++v) yv[v] = (__m512bh)_mm512_loadu_si512(y + v * y_v + p * y_p);
        FASTATTN_UNROLL for (int m = 0; m < MR; ++m) {
            const __m512bh xb = broadcast_pair(x + m * x_m + p * x_p);
            FASTATTN_UNROLL for (int v = 0; v < NV; ++v) acc[0][m][v] = _mm512_dpbf16_ps(acc[0][m][v], yv[v], xb);
        }
    }
    FASTATTN_UNROLL for (int m = 0; m < MR; ++m)
        FASTATTN_UNROLL for (int v = 0; v < NV; ++v) {
            FASTATTN_UNROLL for (int h = 1; h < CH; ++h) acc[0][m][v] = _mm512_add_ps(acc[0][m][v], acc[h][m][v]);
            _mm512_storeu_ps(c + m * mp + v * 16, acc[0][m][v]);
        }
}

constexpr int kPairsMR = 8;

/* pairs_dot over `count` rows of C: full blocks of kPairsMR (between() before each), then one
 * remainder block. */
template <int NV, bool Accumulate, typename Between>
static void pairs_dot_rows(int64_t count, const uint16_t* x, int64_t x_m, int64_t x_p, const uint16_t* y, int64_t y_v,
                           int64_t y_p, int64_t pairs, float* c, int64_t mp, Between&& between) {
    int64_t m = 0;
    for (; m + kPairsMR <= count; m += kPairsMR) {
        between();
        pairs_dot<kPairsMR, NV, Accumulate>(x + m * x_m, x_m, x_p, y, y_v, y_p, pairs, c + m * mp, mp, [] {});
    }
    switch (count - m) {
#define FASTATTN_PAIRS_CASE(R) \
    case R: pairs_dot<R, NV, Accumulate>(x + m * x_m, x_m, x_p, y, y_v, y_p, pairs, c + m * mp, mp, [] {}); break;
        FASTATTN_PAIRS_CASE(1) FASTATTN_PAIRS_CASE(2) FASTATTN_PAIRS_CASE(3) FASTATTN_PAIRS_CASE(4)
        FASTATTN_PAIRS_CASE(5) FASTATTN_PAIRS_CASE(6) FASTATTN_PAIRS_CASE(7)
#undef FASTATTN_PAIRS_CASE
        default: break;
    }
}

/* The products for all mp rows: row tiles two at a time (one at the end, or for mp = 16). */
template <bool Accumulate, typename Between>
static void pairs_dot_tiles(int64_t count, const uint16_t* x, int64_t x_m, int64_t x_p, const uint16_t* y,
                            int64_t y_tile, int64_t pairs, float* c, int64_t mp, Between&& between) {
    int64_t rt = 0;
    for (; rt + 2 <= mp / 16; rt += 2)
        pairs_dot_rows<2, Accumulate>(count, x, x_m, x_p, y + rt * y_tile, y_tile, 32, pairs, c + rt * 16, mp, between);
    if (rt < mp / 16)
        pairs_dot_rows<1, Accumulate>(count, x, x_m, x_p, y + rt * y_tile, y_tile, 32, pairs, c + rt * 16, mp, between);
}

static bool dpbf16_forward_applies(const FwdParams& p, int64_t rows) {
    return p.head_dim % 32 == 0 && p.head_dim_v % 32 == 0 && p.key_tile % 32 == 0 && !p.skip_zero_weights &&
           rows > kDotMaxRows;
}

/* ---- decode: a few rows ------------------------------------------------------------------------------
 *
 * With rows <= kDotMaxRows the vector path, DotKernel, converts every K and V element to
 * float32 and runs R x (D + Dv) FMAs per key: for bfloat16 its arithmetic, not the memory, sets the
 * pace.  Here its layout stays (vectors along D for the scores, the softmax along each row's keys,
 * O rows [r][Dv]) and the products take bfloat16 as it lies, K and V read in place:
 *   S[r][j] = K[j] . q[r]   blocks of RB rows x KB keys (RB x KB = 16: 4 x 4, or 2 x 8, 1 x 16 for
 *                           the last rows), 16 accumulators of `vdpbf16ps` along D, each K vector
 *                           loaded once for the RB rows (half a load per vdpbf16ps at 4 x 4), the
 *                           16 dot products folded together by reduce_lanes, then scaled;
 *   O[r][:] += P[r] V       P rounded to bfloat16, a pair of keys a step: V rows j and j + 1
 *                           interleaved in registers (vpunpck{l,h}wd, in-lane: one instruction per
 *                           16 columns and no store), O's R x NV vectors in registers.  The
 *                           interleave leaves each 32 columns of O in the order [c0-3, c8-11,
 *                           c16-19, c24-27 | c4-7, ...], which the rescales ignore and the end undoes.
 * On a 2-core Zen 5 (K and V in cache, one thread) this reads 34 GB/s where the version that
 * interleaved V through memory and took K once per row read 20: that version, not the memory, set
 * the decode's pace.
 * Prefetch (RowPrefetch): where the head's next tile follows this one in memory (K and V rows one
 * run, as (B, H, S, D) lays them: forward_head's items), each K or V line the products load
 * prefetches, into L2, the same line a key tile on, so that the prefetches go out as fast as the
 * products consume lines, never faster.  The walk DotKernel takes (SpreadPrefetch: the next tile's
 * lines handed out over the tile's steps) goes out as fast as the products run, and these
 * products, with K and V in L2, run twice as fast as the memory streams: on a 2-core Zen 4 (EPYC
 * family 25 model 17), where PREFETCHT1 fills L2 and drops prefetches the L2 cannot take, the
 * decode on that walk streamed C6 at 53% of the read, its arithmetic and its misses one after the
 * other (benchmarks/README.md, 2026-12-02 Zen 4).  Other layouts keep the walk.
 * Taken when: bfloat16, D and Dv multiples of 32, key_tile of 32, no rerun that skips zero weights.
 */
static bool dpbf16_decode_applies(const FwdParams& p, int64_t rows) {
    return rows <= kDotMaxRows && p.head_dim % 32 == 0 && p.head_dim_v % 32 == 0 && p.key_tile % 32 == 0 &&
           !p.skip_zero_weights;
}

/* The prefetches of a tile's K or V rows (see above): for a line at row j and column c (elements),
 * the line a key tile on (`ahead` rows: the line the next tile will load in its place); rows
 * `stride` elements apart, `rows` of them in this tile and the head's next together.  The callers
 * test reaches() once per block of rows.  Zen 4, C6's shape streamed (128-key tiles,
 * benchmarks/kernel_ab.py, paired medians against the walk): 1.14x; half a tile or two tiles on
 * instead, 0.996x and 0.93x of that; a second prefetch a quarter tile on beside it (for a line the
 * first lost) 1.04x more streamed, but with K and V in L2 the two cost 0.75x where one cost 0.86x
 * (tested a line at a time; once a block, one costs 0.98x), so not taken. */
struct RowPrefetch {
    const uint16_t* first;
    int64_t stride, rows, ahead;
    /* Whether rows up to `last` have a row `ahead` on to prefetch. */
    bool reaches(int64_t last) const { return last + ahead < rows; }
    __attribute__((always_inline)) inline void issue(int64_t j, int64_t c) const {
        SpreadPrefetch<uint16_t>::fetch(reinterpret_cast<const char*>(first + (j + ahead) * stride + c));
    }
};

/* The rows a RowPrefetch over this tile's K and V (n rows at k and v) spans: the tile's and the
 * head's next tile's, where that tile follows this one in memory (one run of rows each for K and V,
 * the next tile's first line right after this tile's last; `next`, the walk over the next tile,
 * holds this head's rows, not a share of a head group's token rows, whose k_stride is 0); 0 where
 * it does not, and the walk prefetches. */
static int64_t prefetch_rows(const FwdParams& p, const SpreadPrefetch<uint16_t>& next, const uint16_t* k,
                             const uint16_t* v, int64_t n) {
    const int64_t row_bytes = p.k_stride[2] * (int64_t)sizeof(uint16_t);
    const bool follows = next.runs && next.k_stride == row_bytes &&
                         next.k == reinterpret_cast<const char*>(k + n * p.k_stride[2]) &&
                         next.v == reinterpret_cast<const char*>(v + n * p.v_stride[2]);
    return follows ? n + (next.k_end - next.k) / row_bytes : 0;
}

/* s[r][u] = scale * q[r] . k[u] for RB rows (q's rows D apart) and KB = 16 / RB keys (k's rows
 * k_stride apart); s's rows N apart.  With `ahead` (the first row group's pass over the tile), each
 * key line loaded prefetches its own (RowPrefetch), the keys j0 .. j0 + KB of the tile. */
template <int RB, typename Between>
static inline void decode_scores_block(const uint16_t* q, int64_t D, const uint16_t* k, int64_t k_stride, float* s,
                                       int64_t N, __m512 scale, const RowPrefetch* ahead, int64_t j0,
                                       Between&& between) {
    constexpr int KB = 16 / RB;
    __m512 acc[16];
    FASTATTN_UNROLL for (int u = 0; u < 16; ++u) acc[u] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
        between();
        __m512bh keys[KB];
        FASTATTN_UNROLL for (int u = 0; u < KB; ++u) keys[u] = (__m512bh)_mm512_loadu_si512(k + u * k_stride + d);
        if (ahead != nullptr)
            FASTATTN_UNROLL for (int u = 0; u < KB; ++u) ahead->issue(j0 + u, d);
        FASTATTN_UNROLL for (int r = 0; r < RB; ++r) {
            const __m512bh query = (__m512bh)_mm512_loadu_si512(q + r * D + d);
            FASTATTN_UNROLL for (int u = 0; u < KB; ++u) acc[r * KB + u] = _mm512_dpbf16_ps(acc[r * KB + u], keys[u], query);
        }
    }
    /* Lane r * KB + u of `sums` is row r's score of key u: row r takes lanes [r KB, (r + 1) KB). */
    const __m512 sums = _mm512_mul_ps(reduce_lanes_in_order<float>(acc), scale);
    FASTATTN_UNROLL for (int r = 0; r < RB; ++r)
        _mm512_mask_storeu_ps(s + r * N - r * KB, (__mmask16)(((1u << KB) - 1) << (r * KB)), sums);
}

/* The scores of RB rows for the tile's n keys: blocks of KB keys, then one key at a time. */
template <int RB, typename Between>
static void decode_scores_rows(const uint16_t* q, int64_t D, const uint16_t* k, int64_t k_stride, int64_t n, float* s,
                               int64_t N, float scale, const RowPrefetch* ahead, Between&& between) {
    constexpr int KB = 16 / RB;
    const __m512 scales = _mm512_set1_ps(scale);
    int64_t j = 0;
    for (; j + KB <= n; j += KB)
        decode_scores_block<RB>(q, D, k + j * k_stride, k_stride, s + j, N, scales,
                                ahead != nullptr && ahead->reaches(j + KB - 1) ? ahead : nullptr, j, between);
    for (; j < n; ++j)
        for (int r = 0; r < RB; ++r) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(k + j * k_stride + d),
                                       (__m512bh)_mm512_loadu_si512(q + r * D + d));
            s[r * N + j] = _mm512_reduce_add_ps(acc) * scale;
        }
}

/* All R rows' scores: groups of 4 rows, then 2, then 1; the first group's pass prefetches (`ahead`,
 * or none). */
template <int R, typename Between>
static void decode_scores(const uint16_t* q, int64_t D, const uint16_t* k, int64_t k_stride, int64_t n, float* s,
                          int64_t N, float scale, const RowPrefetch* ahead, Between&& between) {
    constexpr int fours = R / 4 * 4, twos = fours + (R - fours) / 2 * 2;
    for (int r = 0; r < fours; r += 4)
        decode_scores_rows<4>(q + r * D, D, k, k_stride, n, s + r * N, N, scale, r == 0 ? ahead : nullptr, between);
    if (twos > fours)
        decode_scores_rows<2>(q + fours * D, D, k, k_stride, n, s + fours * N, N, scale, fours == 0 ? ahead : nullptr,
                              between);
    if (R > twos)
        decode_scores_rows<1>(q + twos * D, D, k, k_stride, n, s + twos * N, N, scale, twos == 0 ? ahead : nullptr,
                              between);
}

/* The V lines a decode_values step prefetches a tile on (RowPrefetch `rows`; none where null): of
 * the step's keys j and j + 1, rows j + first .. j + first + count - 1, `lines` lines each from
 * column `column` (elements; lines 32 elements apart). */
struct ValuePrefetch {
    const RowPrefetch* rows;
    int first, count;
    int64_t column, lines;
};

/* O[r][c .. c + 16 NV) += sum_j P[r][j] V[j][c ..) over the tile's n keys, a pair of keys a step
 * (an odd n's last pair: V[n] zero, P[n] zero); P[r][j], bfloat16, at probabilities + r * row_step
 * + j * key_step, keys j and j + 1 (j even) side by side: round_probability_rows' rows (N, 1), or
 * the forward's P in column pairs (2, 16); O in the interleaved column order (see above), rows Dv
 * apart.  Each step prefetches `ahead`'s lines: the lines it loads, a tile on (PairKernel, both
 * rows; the forward's 16 rows, one row a pass).  PairKernel's first pass once prefetched every
 * line of both rows, a burst the later passes did not share: spread over the passes, 1.065x
 * streamed and 1.02x in L2 (2-core Zen 4, C6's shape, benchmarks/kernel_ab.py). */
template <int R, int NV, typename Between>
static inline void decode_values(const uint16_t* probabilities, int64_t row_step, int64_t key_step, const uint16_t* v,
                                 int64_t v_stride, int64_t n, float* o, int64_t Dv, const ValuePrefetch& ahead,
                                 Between&& between) {
    static_assert(NV % 2 == 0, "O is held in whole 32-column chunks");
    __m512 acc[R][NV];
    FASTATTN_UNROLL for (int r = 0; r < R; ++r)
        FASTATTN_UNROLL for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_loadu_ps(o + r * Dv + i * 16);
    for (int64_t j = 0; j < n; j += 2) {
        between();
        const bool pair = j + 1 < n;
        if (ahead.rows != nullptr && ahead.rows->reaches(j + 1))
            for (int u = ahead.first; u < ahead.first + ahead.count; ++u)
                for (int64_t line = 0; line < ahead.lines; ++line) ahead.rows->issue(j + u, ahead.column + 32 * line);
        __m512bh values[NV];
        FASTATTN_UNROLL for (int c = 0; c < NV / 2; ++c) {
            const __m512i even = _mm512_loadu_si512(v + j * v_stride + 32 * c);
            const __m512i odd = pair ? _mm512_loadu_si512(v + (j + 1) * v_stride + 32 * c) : _mm512_setzero_si512();
            values[2 * c] = (__m512bh)_mm512_unpacklo_epi16(even, odd);
            values[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(even, odd);
        }
        FASTATTN_UNROLL for (int r = 0; r < R; ++r) {
            const __m512bh weights = broadcast_pair(probabilities + r * row_step + j * key_step);
            FASTATTN_UNROLL for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], values[i], weights);
        }
    }
    FASTATTN_UNROLL for (int r = 0; r < R; ++r)
        FASTATTN_UNROLL for (int i = 0; i < NV; ++i) _mm512_storeu_ps(o + r * Dv + i * 16, acc[r][i]);
}

/* Undoes decode_values' column order in one row of O (Dv a multiple of 32). */
static inline void deinterleave_columns(float* o, int64_t Dv) {
    alignas(64) static const int32_t first_index[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
    const __m512i first = _mm512_load_si512(first_index), second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int64_t c = 0; c < Dv; c += 32) {
        const __m512 low = _mm512_loadu_ps(o + c), high = _mm512_loadu_ps(o + c + 16);
        _mm512_storeu_ps(o + c, _mm512_permutex2var_ps(low, first, high));
        _mm512_storeu_ps(o + c + 16, _mm512_permutex2var_ps(low, second, high));
    }
}

/* Normalise and write `rows` rows of O held by rows (o + r * Dv, decode_values' column order: undone
 * here, in place), row r of head heads[r] at query queries[r]; write_row's conventions. */
static void write_rows_by_row(const FwdParams& p, int64_t b, const int64_t* heads, const int64_t* queries, int64_t rows,
                              float* o, const float* row_max, const float* row_sum, float* partial_out,
                              float* partial_lse) {
    const int64_t Dv = p.head_dim_v;
    for (int64_t r = 0; r < rows; ++r) {
        deinterleave_columns(o + r * Dv, Dv);
        write_row<float, bfloat16_bits>(p, b, heads[r], queries[r], r, o + r * Dv, row_max[r], row_sum[r],
                                        partial_out, partial_lse);
    }
}

/* One kv head's rows of a `vdpbf16ps` decode item: its buffers (PairBuffers, carved from its room)
 * and the running softmax. */
template <int R> struct PairHead {
    PairBuffers buffers;
    int64_t kvh;
    float position[R], row_max[R], row_sum[R];
    int64_t head[R], query[R];
};

/* The decode's steps on one head (forward_head runs them in turn; forward_heads, a group of kv heads
 * tile by tile). */
template <int R> struct PairKernel {
    typedef float T;
    typedef uint16_t In;
    typedef PairHead<R> Head;
    static constexpr int NV = R > 4 ? 2 : R > 2 ? 4 : 8; /* O vectors of 16 columns per row in registers */

    static int64_t scratch_bytes(const FwdParams& p) { return PairBuffers::bytes(p); }

    static void start(const FwdParams& p, Head& h, char* room, int64_t b, int64_t kvh, int64_t q0, int64_t qn) {
        const int64_t D = p.head_dim;
        h.buffers.carve(p, room);
        h.kvh = kvh;
        start_rows<float>(p, kvh, q0, qn, R, h.head, h.query, h.position, h.row_max, h.row_sum);
        for (int r = 0; r < R; ++r)
            std::memcpy(h.buffers.qb + r * D,
                        at<uint16_t>(p.q, b * p.q_stride[0] + h.head[r] * p.q_stride[1] + h.query[r] * p.q_stride[2]),
                        sizeof(uint16_t) * D);
        std::memset(h.buffers.o, 0, sizeof(float) * R * p.head_dim_v);
    }

    /* Empty sums and accumulators, the running maxima kept (forward_tiles.h: key_sweeps).  Not
     * reached: the rerun that walks the keys twice declines these kernels (dpbf16_decode_applies);
     * forward_head and forward_heads, shared with DotKernel, call it for that rerun only. */
    static void restart(const FwdParams& p, Head& h) {
        std::memset(h.buffers.o, 0, sizeof(float) * R * p.head_dim_v);
        std::fill(h.row_sum, h.row_sum + R, 0.0f);
    }

    static void tile(const FwdParams& p, Head& h, int64_t b, int64_t q0, int64_t qn, int64_t kt, int64_t n,
                     const SpreadPrefetch<uint16_t>& next) {
        SpreadPrefetch<uint16_t> ahead = next; /* a local: its cursors stay in registers */
        const int64_t D = p.head_dim, Dv = p.head_dim_v, N = p.key_tile, pairs = (n + 1) / 2;
        const int64_t dv_main = Dv / (16 * NV) * (16 * NV);
        float* s = h.buffers.s;
        float* o = h.buffers.o;
        const uint16_t* k = at<uint16_t>(p.k, b * p.k_stride[0] + h.kvh * p.k_stride[1] + kt * p.k_stride[2]);
        const uint16_t* v = at<uint16_t>(p.v, b * p.v_stride[0] + h.kvh * p.v_stride[1] + kt * p.v_stride[2]);
        /* RowPrefetch where the head's next tile follows this one, else the walk. */
        const int64_t rows = prefetch_rows(p, ahead, k, v, n);
        const bool rows_follow = rows > 0;
        const RowPrefetch k_ahead{k, p.k_stride[2], rows, N}, v_ahead{v, p.v_stride[2], rows, N};
        const int64_t calls = std::max<int64_t>(1, R * (n / 16) * (D / 32) + pairs * (Dv / (16 * NV)));
        const int64_t lines_per_call = rows_follow ? 0 : (ahead.total_lines() + calls - 1) / calls;
        auto issue = [&]() __attribute__((always_inline)) { ahead.issue(lines_per_call); };
        const RowPrefetch* k_rows = rows_follow ? &k_ahead : nullptr;
        const RowPrefetch* v_rows = rows_follow ? &v_ahead : nullptr;

        decode_scores<R>(h.buffers.qb, D, k, p.k_stride[2], n, s, N, (float)p.scale, k_rows, issue);
        softmax_rows<float>(p, s, N, R, n, kt, b, h.kvh, q0, qn, h.head, h.query, h.position, h.row_max, h.row_sum, o);
        round_probability_rows(s, N, R, n, round_up(2 * pairs, 16), h.buffers.pb); /* an odd n's key n: 0 */
        for (int64_t c = 0; c < dv_main; c += 16 * NV)
            decode_values<R, NV>(h.buffers.pb, N, 1, v + c, p.v_stride[2], n, o + c, Dv,
                                 ValuePrefetch{v_rows, 0, 2, c, NV / 2}, issue);
        for (int64_t c = dv_main; c < Dv; c += 32)
            decode_values<R, 2>(h.buffers.pb, N, 1, v + c, p.v_stride[2], n, o + c, Dv,
                                ValuePrefetch{v_rows, 0, 2, c, 1}, issue);
    }

    static void finish(const FwdParams& p, const Head& h, int64_t b, float* partial_out, float* partial_lse) {
        write_rows_by_row(p, b, h.head, h.query, R, h.buffers.o, h.row_max, h.row_sum, partial_out, partial_lse);
    }
};

static void forward_decode_dpbf16(const FwdParams& p, char* scratch, int64_t b, int64_t kvh, int64_t q0, int64_t qn,
                                  int64_t k_begin, int64_t k_end, float* partial_out, float* partial_lse) {
    switch (p.group * qn) {
#define FASTATTN_DECODE_CASE(R) \
    case R: return forward_head<PairKernel<R>>(p, scratch, b, kvh, q0, qn, k_begin, k_end, partial_out, partial_lse);
        FASTATTN_DECODE_CASE(1) FASTATTN_DECODE_CASE(2) FASTATTN_DECODE_CASE(3) FASTATTN_DECODE_CASE(4)
        FASTATTN_DECODE_CASE(5) FASTATTN_DECODE_CASE(6) FASTATTN_DECODE_CASE(7) FASTATTN_DECODE_CASE(8)
#undef FASTATTN_DECODE_CASE
        default: break;
    }
}

static void forward_heads_dpbf16(const FwdParams& p, char* scratch, const ItemIndex& index, int64_t heads, int64_t q0,
                                 int64_t qn, int64_t k_begin, int64_t k_end) {
    switch (p.group * qn) {
#define FASTATTN_DECODE_CASE(R) \
    case R: return forward_heads<PairKernel<R>>(p, scratch, index, heads, q0, qn, k_begin, k_end);
        FASTATTN_DECODE_CASE(1) FASTATTN_DECODE_CASE(2) FASTATTN_DECODE_CASE(3) FASTATTN_DECODE_CASE(4)
        FASTATTN_DECODE_CASE(5) FASTATTN_DECODE_CASE(6) FASTATTN_DECODE_CASE(7) FASTATTN_DECODE_CASE(8)
#undef FASTATTN_DECODE_CASE
        default: break;
    }
}

/* ---- one work item ---------------------------------------------------------------------------------
 *
 * One row tile (mp = 16: 9-16 rows, a decode's draft positions or a small GQA group's) keeps O by
 * rows, O[r][Dv], and takes V as it lies, its rows interleaved in registers by decode_values (8 rows
 * of O and 32 columns in registers, two passes over each 32-column strip of the tile's V: the
 * second from L1), P broadcast from the packer's column pairs.  The V^T P^T product would pack V's
 * rows first, a pass of loads and stores with no arithmetic to hide the loads' misses in, whose
 * 32 KB (D 128, 128 keys) fill the L1 for every 16 rows. */
constexpr int kValuesRows = 8;

static void forward_block_dpbf16(const FwdParams& p, char* scratch, int64_t b, int64_t kvh, int64_t q0, int64_t qn,
                                 int64_t k_begin, int64_t k_end, float* partial_out, float* partial_lse) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v, N = p.key_tile;
    const int64_t rows = p.group * qn;
    PairBuffers buffers;
    buffers.carve(p, scratch);
    const int64_t mp = start_pairs_item(p, buffers, b, kvh, q0, qn);
    const bool o_by_row = mp == 16;
    const int64_t k_lines = (D * 2 + 63) / 64;
    float* s = buffers.s;
    float* o = buffers.o;

    int64_t lo, hi;
    visible_keys(p, b, q0, qn, k_begin, k_end, &lo, &hi);
    const PackProbabilities packer{buffers.pb, N, interleave_halves_index()};
    for (int64_t kt = lo; kt < hi; kt += N) {
        const int64_t n = std::min(N, hi - kt);
        if (p.mask_kind != MASK_NONE && mask_hides_tile(p, b, kvh, q0, qn, kt, n)) continue;
        const uint16_t* k = at<uint16_t>(p.k, b * p.k_stride[0] + kvh * p.k_stride[1] + kt * p.k_stride[2]);
        const uint16_t* v = at<uint16_t>(p.v, b * p.v_stride[0] + kvh * p.v_stride[1] + kt * p.v_stride[2]);

        /* S^T = K Q^T, the next tile's K and V rows and this tile's mask lines prefetched a few at a
         * time on the way: with O by rows, where the head's next tile follows, each block of keys
         * the scores take and each V row the values take prefetches its rows a tile on
         * (RowPrefetch, as the decode's); otherwise the walk. */
        const int64_t next_n = kt + N < hi ? std::min(N, hi - kt - N) : 0;
        SpreadPrefetch<uint16_t> ahead(p, b, kvh, kt + N, next_n);
        MaskPrefetch mask_lines(p, b, kvh, q0, qn, rows, kt, n);
        const int64_t row_span = o_by_row ? prefetch_rows(p, ahead, k, v, n) : 0;
        const RowPrefetch k_ahead{k, p.k_stride[2], row_span, N}, v_ahead{v, p.v_stride[2], row_span, N};
        const int64_t calls = std::max<int64_t>(1, (mp + 31) / 32 * (n / kPairsMR));
        const int64_t lines_per_call = row_span > 0 ? 0 : (ahead.total_lines() + calls - 1) / calls;
        const int64_t mask_lines_per_call = (mask_lines.total_lines() + calls - 1) / calls;
        int64_t block = 0; /* the key block the scores take next (mp 16: one row tile, between() before each) */
        auto prefetch = [&]() __attribute__((always_inline)) {
            if (row_span > 0 && k_ahead.reaches(block + kPairsMR - 1))
                for (int u = 0; u < kPairsMR; ++u)
                    for (int64_t line = 0; line < k_lines; ++line) k_ahead.issue(block + u, 32 * line);
            block += kPairsMR;
            ahead.issue(lines_per_call);
        };
        if (mask_lines.total_lines() > 0) {
            pairs_dot_tiles<false>(n, k, p.k_stride[2], 2, buffers.qb, D * 16, D / 2, s, mp, [&] {
                prefetch();
                mask_lines.issue(mask_lines_per_call);
            });
        } else { /* without the mask's cursor in the products' loop */
            pairs_dot_tiles<false>(n, k, p.k_stride[2], 2, buffers.qb, D * 16, D / 2, s, mp, prefetch);
        }
        scores_to_pairs(p, buffers, packer, b, kvh, q0, qn, mp, kt, n, o_by_row);

        /* O += P V, or O^T += V^T P^T, over the tile's pairs of keys; an odd n's last pair: P[n] = 0,
         * V[n] zero. */
        if (o_by_row) {
            for (int64_t c = 0; c < Dv; c += 32)
                for (int64_t r = 0; r < mp; r += kValuesRows)
                    decode_values<kValuesRows, 2>(buffers.pb + 2 * r, 2, 16, v + c, p.v_stride[2], n, o + r * Dv + c,
                                                  Dv,
                                                  ValuePrefetch{row_span > 0 ? &v_ahead : nullptr,
                                                                (int)(r / kValuesRows), 1, c, 1},
                                                  [] {});
            continue;
        }
        const int64_t key_pairs = (n + 1) / 2;
        auto value_row = [&](int64_t j) -> const uint16_t* { return j < n ? v + j * p.v_stride[2] : nullptr; };
        pack_row_pairs(value_row, 2 * key_pairs, Dv, buffers.vt);
        pairs_dot_tiles<true>(Dv, buffers.vt, 2, 2 * Dv, buffers.pb, N * 16, key_pairs, o, mp, [] {});
    }
    if (!o_by_row) {
        write_rows(p, b, kvh, q0, qn, rows, mp, o, buffers.row_max, buffers.row_sum, partial_out, partial_lse);
        return;
    }
    int64_t heads[16], queries[16]; /* O by rows: one row tile, at most 16 rows */
    for (int64_t r = 0; r < rows; ++r) {
        heads[r] = kvh * p.group + r / qn;
        queries[r] = q0 + r % qn;
    }
    write_rows_by_row(p, b, heads, queries, rows, o, buffers.row_max, buffers.row_sum, partial_out, partial_lse);
}

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
#endif
