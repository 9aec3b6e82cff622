/* Mask arrays on score tiles, vectorised.
 *
 * Mask element (b, h, i, j) sits at b*st0 + h*st1 + i*st2 + j*st3 of p.mask, in elements, with
 * stride 0 on the axes it broadcasts (params.h).  A bool mask hides a key (score -> -inf, whatever
 * the score was); a float mask is added to the score.  The kernels keep score tiles in two layouts:
 *
 *  - transposed, S[j][rows] (forward_block, the backward, the AMX forward): rows are the lanes.
 *    A mask whose tile rows all read one mask row ((B,1,1,Sk), or (B,Hq,1,Sk) without GQA: the
 *    common padding and ALiBi-free bias masks) costs one scalar read and one broadcast per key.
 *    A mask whose rows differ ((B,Hq,Sq,Sk)) is read as blocks of L rows x L keys (the keys of a
 *    row are contiguous in memory), transposed and applied L keys at a time: float32 blocks
 *    through 128-bit loads of four rows into one register and in-lane unpacks
 *    (load_transposed_floats), a bfloat16 mask over float scores (AVX-512) as 16-bit words before
 *    it is widened (transpose_bfloat16_block), a bool mask (AVX-512BW) as one 16-bit row mask per
 *    key for a masked multiply (hide_bool_block), other kinds as L vector loads transposed in
 *    registers (log2 L rounds of L two-input shuffles).  The half-precision forwards keep a bool
 *    mask's bits (full_mask_bits, RowsHidden) and a bfloat16 mask's transposed words
 *    (full_mask_words, RowsBiased) for their softmax to read instead of the pass.  Key
 *    tails, and masks whose key axis is not contiguous, read element by element.  Kernels whose
 *    products leave the scores unscaled scale them in the same pass (one pass over the tile
 *    instead of two).
 *  - row-major, S[r][j] (DotKernel, the decode path): a mask row is contiguous along the
 *    keys, so it is read L keys per vector load.
 *
 * Before a tile is computed at all, mask_hides_tile says whether a bool mask hides every (row, key)
 * of it: such tiles are skipped, as tiles outside the causal, window and key_lengths range are.
 */
#ifndef FASTATTN_MASK_TILES_H
#define FASTATTN_MASK_TILES_H

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "isa.h"
#include "params.h"
#include "simd.h"

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

/* One mask element as T: a bool byte as 0 or 1, a float as its value. */
template <typename T, typename M> static inline T mask_scalar(const M* m) {
    if constexpr (std::is_arithmetic<M>::value)
        return (T)*m;
    else
        return (T)to_float(*m);
}

/* L bool bytes as 0 / 1 in T's lanes: one zero-extending load and a conversion (GCC 12 turns
 * __builtin_convertvector from bytes into per-lane scalar conversions). */
template <typename T> static inline typename Vec<T>::type bytes_as(const uint8_t* m) {
    typedef typename Vec<T>::type V;
#if defined(__AVX512F__)
    if constexpr (std::is_same<T, float>::value)
        return (V)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m))));
    else
        return (V)_mm512_cvtepi32_pd(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m))));
#elif defined(__AVX2__)
    if constexpr (std::is_same<T, float>::value) {
        return (V)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m))));
    } else {
        int32_t four;
        std::memcpy(&four, m, sizeof(four));
        return (V)_mm256_cvtepi32_pd(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(four)));
    }
#else
    T converted[Vec<T>::lanes];
    for (int i = 0; i < Vec<T>::lanes; ++i) converted[i] = (T)m[i];
    return vload<V>(converted);
#endif
}

/* L consecutive mask elements as one vector of T. */
template <typename T, typename M> static inline typename Vec<T>::type mask_vector(const M* m) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    if constexpr (std::is_same<M, uint8_t>::value) {
        return bytes_as<T>(m);
    } else if constexpr (std::is_arithmetic<M>::value && !std::is_same<M, T>::value) {
        typedef M Stored __attribute__((vector_size(sizeof(M) * L)));
        return __builtin_convertvector(vload<Stored>(m), V);
    } else {
        return load_vector<T>(m);
    }
}

/* A score vector under a mask vector: bool hides where the mask is 0, float adds. */
template <typename T, typename M>
static inline typename Vec<T>::type masked(typename Vec<T>::type score, typename Vec<T>::type mask) {
    typedef typename Vec<T>::type V;
    if constexpr (std::is_same<M, uint8_t>::value)
        return vselect(mask != V{}, score, vbroadcast(-std::numeric_limits<T>::infinity()));
    else
        return score + mask;
}

/* What a padded row (beyond the tile's rows) reads: a mask value that changes nothing. */
template <typename T, typename M> constexpr T neutral_mask() { return std::is_same<M, uint8_t>::value ? T(1) : T(0); }

/* ---- L x L transpose in registers --------------------------------------------------------------
 *
 * Round h (h = 1, 2, ..., L/2) swaps, in every 2h x 2h block, the upper-right and lower-left h x h
 * blocks: rows i and i + h (bit h of i clear) exchange their lanes l with bit h set / clear.  After
 * all rounds x[t][u] holds the old x[u][t]. */
template <int L, int H, int I> constexpr int swap_upper() { return (I & H) ? L + I - H : I; }
template <int L, int H, int I> constexpr int swap_lower() { return (I & H) ? L + I : I + H; }

template <typename V, int L, int H, int... I>
static inline void swap_blocks(V* x, std::integer_sequence<int, I...>) {
    for (int i = 0; i < L; ++i) {
        if (i & H) continue;
        const V upper = __builtin_shufflevector(x[i], x[i + H], swap_upper<L, H, I>()...);
        const V lower = __builtin_shufflevector(x[i], x[i + H], swap_lower<L, H, I>()...);
        x[i] = upper;
        x[i + H] = lower;
    }
}

template <typename V, int L, int H> struct TransposeRounds {
    static inline void run(V* x) {
        swap_blocks<V, L, H>(x, std::make_integer_sequence<int, L>{});
        TransposeRounds<V, L, H * 2>::run(x);
    }
};
template <typename V, int L> struct TransposeRounds<V, L, L> {
    static inline void run(V*) {}
};

template <typename T> static inline void transpose_lanes(typename Vec<T>::type* x) {
    TransposeRounds<typename Vec<T>::type, Vec<T>::lanes, 1>::run(x);
}

/* ---- an L x L float block transposed on its way from memory ---------------------------------------
 *
 * block[t] = rows[0..L-1][j0 + t] for float rows and L = 16 (AVX-512) or 8 (AVX2).  Register g of a
 * step holds, in its 128-bit lane l, keys 4k..4k+3 of row g + 4l: one load and L/4 - 1 inserts from
 * memory, which the load ports and the vector ALUs serve.  What remains is a 4 x 4 transpose within
 * each lane (four in-lane unpacks of floats, four of doubles), after which lane l of output c holds
 * rows 4l..4l+3 of key 4k + c: 2L unpacks for the block.  Transposing L loaded rows in registers
 * takes L log2(L) shuffles, most of them across lanes (64 for 16 x 16).  On the 16 x 16 block, data
 * in L1, Zen 5: 0.10 ns a score against 0.19, of which 0.07 is loading, adding and storing. */
#if defined(__AVX512F__)
/* 16 bytes from each of a, b, c, d as the four 128-bit lanes of one register. */
static inline __m512i four_lanes(const void* a, const void* b, const void* c, const void* d) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(static_cast<const __m128i*>(a)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(static_cast<const __m128i*>(b)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(static_cast<const __m128i*>(c)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128(static_cast<const __m128i*>(d)), 3);
}

/* The loads go row group by row group (the four rows of one register, all four steps), not step by
 * step: rows a multiple of 4 KiB apart (a mask of 1024 or 2048 keys) share one L1 set, whose 8 ways
 * the block's 16 lines outnumber, and step by step (16 lines a step) the lines left L1 between
 * steps.  Zen 4, 64 x 128 tiles of a mask of 1024 keys in L2, the pass with its load, add and store
 * of each score vector: 0.27 -> 0.21 ns a score (0.12-0.15 at a stride of 1040 keys, either order);
 * C1's shape with a float (1,8,1024,1024) mask, kernel_ab.cpp forward on 2 threads: 2.4% faster. */
static inline void load_transposed_floats(const float* const* row, int64_t j0, __m512* block) {
    __m512 z[4][4]; /* [step k][register g] */
    for (int g = 0; g < 4; ++g)
        for (int k = 0; k < 4; ++k)
            z[k][g] = _mm512_castsi512_ps(four_lanes(row[g] + j0 + 4 * k, row[g + 4] + j0 + 4 * k,
                                                     row[g + 8] + j0 + 4 * k, row[g + 12] + j0 + 4 * k));
    for (int k = 0; k < 4; ++k) {
        const __m512d low01 = _mm512_castps_pd(_mm512_unpacklo_ps(z[k][0], z[k][1]));
        const __m512d high01 = _mm512_castps_pd(_mm512_unpackhi_ps(z[k][0], z[k][1]));
        const __m512d low23 = _mm512_castps_pd(_mm512_unpacklo_ps(z[k][2], z[k][3]));
        const __m512d high23 = _mm512_castps_pd(_mm512_unpackhi_ps(z[k][2], z[k][3]));
        block[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(low01, low23));
        block[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(low01, low23));
        block[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(high01, high23));
        block[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(high01, high23));
    }
}
#elif defined(__AVX2__)
static inline void load_transposed_floats(const float* const* row, int64_t j0, __m256* block) {
    for (int k = 0; k < 2; ++k) {
        __m256 z[4];
        for (int g = 0; g < 4; ++g)
            z[g] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(row[g] + j0 + 4 * k)),
                                        _mm_loadu_ps(row[g + 4] + j0 + 4 * k), 1);
        const __m256d low01 = _mm256_castps_pd(_mm256_unpacklo_ps(z[0], z[1]));
        const __m256d high01 = _mm256_castps_pd(_mm256_unpackhi_ps(z[0], z[1]));
        const __m256d low23 = _mm256_castps_pd(_mm256_unpacklo_ps(z[2], z[3]));
        const __m256d high23 = _mm256_castps_pd(_mm256_unpackhi_ps(z[2], z[3]));
        block[4 * k] = _mm256_castpd_ps(_mm256_unpacklo_pd(low01, low23));
        block[4 * k + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(low01, low23));
        block[4 * k + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(high01, high23));
        block[4 * k + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(high01, high23));
    }
}
#endif

/* ---- a 16 x 16 bfloat16 block, transposed before it is widened ----------------------------------
 *
 * out[t] = rows[0..15][t] as float32 lanes.  Transposing the 16-bit words first moves half the bytes
 * of transposing the widened floats: rows u and u + 8 share a register (8 loads), two rounds of
 * in-lane unpacks (epi16, epi32) leave every 128-bit lane holding 4 rows x 2 keys, one two-source
 * qword permute per pair of keys puts the row groups in order, and the widening itself is an
 * unpack with zero (a bfloat16 is a float's high half) that leaves each key's 16 rows in lane order:
 * 56 instructions where widening first (32) and transposing floats (64) took 112.
 * transpose_word_pairs stops before the widening: key_pairs[i] holds keys 2i and 2i + 1, in each
 * 128-bit lane l the words of rows 4l..4l+3 for key 2i, then for key 2i + 1 (widen_first_key,
 * widen_second_key). */
#if defined(__AVX512BW__)
static inline void transpose_word_pairs(const uint16_t* const* rows, __m512i* key_pairs) {
    __m512i pairs[8]; /* rows u and u + 8 */
    for (int u = 0; u < 8; ++u)
        pairs[u] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[u]))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[u + 8])), 1);
    /* keys[g][i]: lanes [4 rows of group g's first half, keys 2i, 2i+1 | keys 8+2i, 9+2i | the same
     * for rows + 8]; group 0 holds rows 0-3 (and 8-11), group 1 rows 4-7 (and 12-15). */
    __m512i keys[2][4];
    for (int g = 0; g < 2; ++g) {
        const __m512i* r = pairs + 4 * g;
        const __m512i low01 = _mm512_unpacklo_epi16(r[0], r[1]), high01 = _mm512_unpackhi_epi16(r[0], r[1]);
        const __m512i low23 = _mm512_unpacklo_epi16(r[2], r[3]), high23 = _mm512_unpackhi_epi16(r[2], r[3]);
        keys[g][0] = _mm512_unpacklo_epi32(low01, low23);
        keys[g][1] = _mm512_unpackhi_epi32(low01, low23);
        keys[g][2] = _mm512_unpacklo_epi32(high01, high23);
        keys[g][3] = _mm512_unpackhi_epi32(high01, high23);
    }
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int i = 0; i < 4; ++i) {
        key_pairs[i] = _mm512_permutex2var_epi64(keys[0][i], first, keys[1][i]);      /* keys 2i, 2i+1 */
        key_pairs[4 + i] = _mm512_permutex2var_epi64(keys[0][i], second, keys[1][i]); /* keys 8+2i, 9+2i */
    }
}

/* A pair of keys' 16-bit words (transpose_word_pairs) as the first key's 16 floats, or the second's. */
static inline __m512 widen_first_key(__m512i key_pair) {
    return _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), key_pair));
}
static inline __m512 widen_second_key(__m512i key_pair) {
    return _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), key_pair));
}

static inline void transpose_bfloat16_block(const uint16_t* const* rows, __m512* out) {
    __m512i key_pairs[8];
    transpose_word_pairs(rows, key_pairs);
    for (int i = 0; i < 8; ++i) {
        out[2 * i] = widen_first_key(key_pairs[i]);
        out[2 * i + 1] = widen_second_key(key_pairs[i]);
    }
}
#endif

/* ---- a 16 x 16 bool block as one row mask per key --------------------------------------------------
 *
 * bool_block_bits: bits 16 m .. 16 m + 15 of visible[c] say which of rows row[0..15] see key
 * j0 + 4 c + m.  The bytes are not widened to floats: lane l of register g holds row g + 4l's 16
 * bytes (one load and three inserts from memory), two rounds of in-lane unpacks (bytes, then words)
 * leave lane l of register c with rows 4l..4l+3 of keys 4c..4c+3, a dword per key, one dword permute
 * per register gathers each key's 16 rows into one lane, and a byte test turns the register into
 * 64 mask bits, 16 per key.  12 shuffles and 4 tests for 256 mask bytes.
 * hide_bool_block: scores s[t * mp + u] (16 keys t, 16 rows u) multiplied by `factor`, or -inf
 * where row u does not see key j0 + t, one masked multiply a key, where widening (32 conversions), a
 * float transpose (64 shuffles) and a compare and blend per key took 160 instructions. */
#if defined(__AVX512BW__)
static inline void bool_block_bits(const uint8_t* const* row, int64_t j0, uint64_t* visible) {
    __m512i z[4];
    for (int g = 0; g < 4; ++g) z[g] = four_lanes(row[g] + j0, row[g + 4] + j0, row[g + 8] + j0, row[g + 12] + j0);
    const __m512i low01 = _mm512_unpacklo_epi8(z[0], z[1]), high01 = _mm512_unpackhi_epi8(z[0], z[1]);
    const __m512i low23 = _mm512_unpacklo_epi8(z[2], z[3]), high23 = _mm512_unpackhi_epi8(z[2], z[3]);
    const __m512i keys[4] = {_mm512_unpacklo_epi16(low01, low23), _mm512_unpackhi_epi16(low01, low23),
                             _mm512_unpacklo_epi16(high01, high23), _mm512_unpackhi_epi16(high01, high23)};
    const __m512i by_key = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int c = 0; c < 4; ++c) {
        const __m512i rows_by_key = _mm512_permutexvar_epi32(by_key, keys[c]);
        visible[c] = _mm512_test_epi8_mask(rows_by_key, rows_by_key);
    }
}

static inline void hide_bool_block(const uint8_t* const* row, int64_t j0, float* s, int64_t mp, __m512 factor) {
    uint64_t visible[4];
    bool_block_bits(row, j0, visible);
    const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int c = 0; c < 4; ++c)
        for (int m = 0; m < 4; ++m) {
            float* scores = s + (4 * c + m) * mp;
            _mm512_storeu_ps(scores, _mm512_mask_mul_ps(minus_infinity, (__mmask16)(visible[c] >> (16 * m)),
                                                        _mm512_loadu_ps(scores), factor));
        }
}
#endif

/* ---- the transposed layout S[j][rows] ---------------------------------------------------------- */

/* A tile's rows in order (row r is head kvh * G + r / qn, query q0 + r % qn) and the offset of
 * each one's mask row (key 0), stepped without a division per row. */
struct MaskRows {
    int64_t offset, query, qn, query_step, head_step;
    MaskRows(const FwdParams& p, int64_t b, int64_t kvh, int64_t q0, int64_t qn_, int64_t r)
        : query(r % qn_), qn(qn_), query_step(p.mask_stride[2]), head_step(p.mask_stride[1]) {
        offset = b * p.mask_stride[0] + (kvh * p.group + r / qn) * head_step + (q0 + query) * query_step;
    }
    void next() {
        if (++query == qn) {
            query = 0;
            offset += head_step - (qn - 1) * query_step;
        } else {
            offset += query_step;
        }
    }
};

/* Bytes of one mask element. */
static inline int64_t mask_element_bytes(const FwdParams& p) {
    static const int bytes[] = {0, 1, 4, 8, 2, 2}; /* by MaskKind */
    return bytes[p.mask_kind];
}

/* Whether every row of the tile reads the same mask row. */
static inline bool mask_rows_shared(const FwdParams& p) {
    return p.mask_stride[2] == 0 && (p.mask_stride[1] == 0 || p.group == 1);
}

/* Mask rows row[0..L-1] (null past the tile's rows, which read a neutral value; all_rows: none is
 * null) at keys j0..j0+L-1, contiguous, as L vectors: block[t] holds the L rows' entries of key
 * j0 + t. */
template <typename T, typename M>
static inline void mask_block_transposed(const M* const* row, bool all_rows, int64_t j0, typename Vec<T>::type* block) {
    constexpr int L = Vec<T>::lanes;
    if (all_rows) {
#if defined(__AVX512F__)
        if constexpr (std::is_same<T, float>::value && std::is_same<M, float>::value) {
            load_transposed_floats(row, j0, reinterpret_cast<__m512*>(block));
            return;
        }
#elif defined(__AVX2__)
        if constexpr (std::is_same<T, float>::value && std::is_same<M, float>::value) {
            load_transposed_floats(row, j0, reinterpret_cast<__m256*>(block));
            return;
        }
#endif
#if defined(__AVX512BW__)
        if constexpr (std::is_same<T, float>::value && std::is_same<M, bfloat16_bits>::value) {
            const uint16_t* words[16];
            for (int u = 0; u < 16; ++u) words[u] = reinterpret_cast<const uint16_t*>(row[u] + j0);
            transpose_bfloat16_block(words, reinterpret_cast<__m512*>(block));
            return;
        }
#endif
    }
    for (int u = 0; u < L; ++u) block[u] = row[u] ? mask_vector<T>(row[u] + j0) : vbroadcast(neutral_mask<T, M>());
    transpose_lanes<T>(block);
}

template <typename T, typename M>
static void mask_transposed_as(const FwdParams& p, T* s, int64_t mp, int64_t rows, int64_t n, int64_t kt,
                               int64_t b, int64_t kvh, int64_t q0, int64_t qn, T scale) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    const V factor = vbroadcast(scale);
    const M* mask = reinterpret_cast<const M*>(p.mask);
    const int64_t key_stride = p.mask_stride[3];
    if (mask_rows_shared(p)) {
        const M* row = mask + MaskRows(p, b, kvh, q0, qn, 0).offset + kt * key_stride;
        for (int64_t j = 0; j < n; ++j) {
            const V value = vbroadcast(mask_scalar<T>(row + j * key_stride));
            for (int64_t r = 0; r < mp; r += L)
                vstore(s + j * mp + r, masked<T, M>(vload<V>(s + j * mp + r) * factor, value));
        }
        return;
    }
    MaskRows cursor(p, b, kvh, q0, qn, 0);
    for (int64_t r0 = 0; r0 < mp; r0 += L) {
        const M* row[L];
        for (int u = 0; u < L; ++u, cursor.next())
            row[u] = r0 + u < rows ? mask + cursor.offset + kt * key_stride : nullptr;
        int64_t j0 = 0;
        if (key_stride == 1) {
            bool all_rows = true;
            for (int u = 0; u < L; ++u) all_rows &= row[u] != nullptr;
            for (; j0 + L <= n; j0 += L) {
#if defined(__AVX512BW__)
                if constexpr (std::is_same<T, float>::value && std::is_same<M, uint8_t>::value) {
                    if (all_rows) {
                        hide_bool_block(row, j0, s + j0 * mp + r0, mp, (__m512)factor);
                        continue;
                    }
                }
#endif
                V block[L];
                mask_block_transposed<T, M>(row, all_rows, j0, block);
                for (int t = 0; t < L; ++t) {
                    T* scores = s + (j0 + t) * mp + r0;
                    vstore(scores, masked<T, M>(vload<V>(scores) * factor, block[t]));
                }
            }
        }
        for (int64_t j = j0; j < n; ++j) {
            V column;
            for (int u = 0; u < L; ++u)
                column[u] = row[u] ? mask_scalar<T>(row[u] + j * key_stride) : neutral_mask<T, M>();
            T* scores = s + j * mp + r0;
            vstore(scores, masked<T, M>(vload<V>(scores) * factor, column));
        }
    }
}

/* ---- one mask row for the whole tile, taken by the softmax ------------------------------------------
 *
 * Where a tile's rows all read one mask row (mask_rows_shared), the mask is one value per key, and
 * the softmax can apply it as it reads the scores (online_softmax's `columns`) instead of a pass
 * that reads and writes the whole score tile first.  A bool mask hides its keys (-inf whatever the
 * score, NaN included) and leaves the scale to the softmax's exponent, as an unmasked tile does; a
 * float mask's value is added to the scaled score, as the mask pass adds it. */

/* The mask values of keys kt .. kt + n - 1 of a shared mask row, as T: a bool mask's 0 / 1, a
 * float mask's value. */
template <typename T, typename M>
static void shared_mask_values_as(const FwdParams& p, int64_t b, int64_t kvh, int64_t q0, int64_t qn, int64_t kt,
                                  int64_t n, T* values) {
    const M* row = reinterpret_cast<const M*>(p.mask) + MaskRows(p, b, kvh, q0, qn, 0).offset + kt * p.mask_stride[3];
    for (int64_t j = 0; j < n; ++j) values[j] = mask_scalar<T>(row + j * p.mask_stride[3]);
}

template <typename T>
static void shared_mask_values(const FwdParams& p, int64_t b, int64_t kvh, int64_t q0, int64_t qn, int64_t kt,
                               int64_t n, T* values) {
    switch (p.mask_kind) {
        case MASK_BOOL: shared_mask_values_as<T, uint8_t>(p, b, kvh, q0, qn, kt, n, values); break;
        case MASK_FLOAT32: shared_mask_values_as<T, float>(p, b, kvh, q0, qn, kt, n, values); break;
        case MASK_FLOAT64: shared_mask_values_as<T, double>(p, b, kvh, q0, qn, kt, n, values); break;
        case MASK_FLOAT16: shared_mask_values_as<T, half_bits>(p, b, kvh, q0, qn, kt, n, values); break;
        case MASK_BFLOAT16: shared_mask_values_as<T, bfloat16_bits>(p, b, kvh, q0, qn, kt, n, values); break;
        default: break;
    }
}

/* Key j's score vector (rows from r), -inf where a bool mask hides the key (values 0 / 1; the
 * softmax scales). */
template <typename T> struct KeysHidden {
    const T* values;
    inline typename Vec<T>::type operator()(typename Vec<T>::type score, int64_t j, int64_t) const {
#if defined(__AVX512F__)
        /* one blend on a mask register: the generic bitwise select took two instructions a vector,
         * and the bool-masked softmax 22% longer than a float-masked one (perf, C1 bfloat16) */
        if constexpr (std::is_same<T, float>::value)
            return (typename Vec<T>::type)_mm512_mask_blend_ps(
                values[j] != 0.0f ? (__mmask16)0xffff : (__mmask16)0,
                _mm512_set1_ps(-std::numeric_limits<float>::infinity()), (__m512)score);
#endif
        return masked<T, uint8_t>(score, vbroadcast(values[j]));
    }
};

/* Key j's score vector scaled, plus a float mask's value (the softmax then takes scale 1). */
template <typename T> struct KeysBiased {
    const T* values;
    T scale;
    inline typename Vec<T>::type operator()(typename Vec<T>::type score, int64_t j, int64_t) const {
        return masked<T, float>(score * vbroadcast(scale), vbroadcast(values[j]));
    }
};

/* ---- a bool mask whose rows differ, taken by the softmax as bits --------------------------------------
 *
 * A full (B,Hq,Sq,Sk) bool mask, its keys contiguous, becomes one 16-bit row mask per key and
 * vector of 16 rows (bool_block_bits), bits[(r / 16) * n + j] for row r and key j of the tile:
 * n * mp / 8 bytes that the softmax reads as it reads the scores (RowsHidden), where the mask pass
 * read and wrote the whole score tile (n * mp floats) once more.  Rows past the tile's own (the
 * padding up to mp, whole vectors of it where mp rounds rows up to 32) read row 0's mask: their
 * outputs are never written. */
#if defined(__AVX512BW__)
static void full_mask_bits(const FwdParams& p, int64_t b, int64_t kvh, int64_t q0, int64_t qn, int64_t rows,
                           int64_t mp, int64_t kt, int64_t n, uint16_t* bits) {
    const uint8_t* mask = reinterpret_cast<const uint8_t*>(p.mask);
    MaskRows cursor(p, b, kvh, q0, qn, 0);
    const uint8_t* first_row = mask + cursor.offset + kt;
    for (int64_t r0 = 0; r0 < mp; r0 += 16) {
        const uint8_t* row[16];
        for (int u = 0; u < 16; ++u, cursor.next()) row[u] = r0 + u < rows ? mask + cursor.offset + kt : first_row;
        uint16_t* out = bits + (r0 / 16) * n;
        int64_t j0 = 0;
        for (; j0 + 16 <= n; j0 += 16) {
            uint64_t visible[4];
            bool_block_bits(row, j0, visible);
            std::memcpy(out + j0, visible, sizeof(visible));
        }
        for (int64_t j = j0; j < n; ++j) {
            unsigned word = 0;
            for (int u = 0; u < 16; ++u) word |= (row[u][j] != 0 ? 1u : 0u) << u;
            out[j] = (uint16_t)word;
        }
    }
}

/* Key j's scores of rows r .. r + 15, -inf where bits (full_mask_bits) hide them. */
struct RowsHidden {
    const uint16_t* bits;
    int64_t n;
    inline Vec<float>::type operator()(Vec<float>::type score, int64_t j, int64_t r) const {
        return (Vec<float>::type)_mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                                    (__mmask16)bits[(r >> 4) * n + j], (__m512)score);
    }
};

/* A full bfloat16 mask, its keys contiguous, as the words transpose_word_pairs leaves for each
 * vector of 16 rows and pair of keys: 64 bytes at words + ((r / 16) * pairs + j / 2) * 32 (pairs:
 * (n + 1) / 2), n * mp * 2 bytes in all, half the score tile, which the softmax widens as it reads
 * the scores, one unpack a key (RowsBiased), where the mask pass read and wrote the whole score tile
 * once more.  Rows past the tile's own read zeros. */
static void full_mask_words(const FwdParams& p, int64_t b, int64_t kvh, int64_t q0, int64_t qn, int64_t rows,
                            int64_t mp, int64_t kt, int64_t n, uint16_t* words) {
    const uint16_t* mask = reinterpret_cast<const uint16_t*>(p.mask);
    const int64_t pairs = (n + 1) / 2;
    MaskRows cursor(p, b, kvh, q0, qn, 0);
    for (int64_t r0 = 0; r0 < mp; r0 += 16) {
        const uint16_t* row[16];
        bool all_rows = true;
        for (int u = 0; u < 16; ++u, cursor.next()) {
            row[u] = r0 + u < rows ? mask + cursor.offset + kt : nullptr;
            all_rows &= row[u] != nullptr;
        }
        uint16_t* out = words + (r0 / 16) * pairs * 32;
        int64_t j0 = 0;
        for (; all_rows && j0 + 16 <= n; j0 += 16) {
            const uint16_t* block[16];
            for (int u = 0; u < 16; ++u) block[u] = row[u] + j0;
            __m512i key_pairs[8];
            transpose_word_pairs(block, key_pairs);
            for (int i = 0; i < 8; ++i) _mm512_storeu_si512(out + (j0 / 2 + i) * 32, key_pairs[i]);
        }
        for (int64_t j = j0; j < n; ++j)
            for (int u = 0; u < 16; ++u)
                out[(j / 2) * 32 + (u / 4) * 8 + (j % 2) * 4 + u % 4] = row[u] ? row[u][j] : uint16_t(0);
    }
}

/* Key j's scores of rows r .. r + 15 scaled, plus their bfloat16 mask values (full_mask_words; the
 * softmax then takes scale 1). */
struct RowsBiased {
    const uint16_t* words;
    int64_t pairs;
    float scale;
    inline Vec<float>::type operator()(Vec<float>::type score, int64_t j, int64_t r) const {
        const __m512i pair = _mm512_loadu_si512(words + ((r >> 4) * pairs + (j >> 1)) * 32);
        const __m512 value = (j & 1) ? widen_second_key(pair) : widen_first_key(pair);
        return masked<float, float>(score * vbroadcast(scale), (Vec<float>::type)value);
    }
};
#endif

/* Apply the mask to a transposed score tile S[j][rows] (n keys from kt; row r is head
 * kvh * G + r / qn, query q0 + r % qn; mp padded rows, a multiple of L), each score multiplied by
 * `scale` first (the kernels whose products leave the scores unscaled fold that pass in here). */
template <typename T>
static void mask_transposed(const FwdParams& p, T* s, int64_t mp, int64_t rows, int64_t n, int64_t kt, int64_t b,
                            int64_t kvh, int64_t q0, int64_t qn, T scale) {
    switch (p.mask_kind) {
        case MASK_BOOL: mask_transposed_as<T, uint8_t>(p, s, mp, rows, n, kt, b, kvh, q0, qn, scale); break;
        case MASK_FLOAT32: mask_transposed_as<T, float>(p, s, mp, rows, n, kt, b, kvh, q0, qn, scale); break;
        case MASK_FLOAT64: mask_transposed_as<T, double>(p, s, mp, rows, n, kt, b, kvh, q0, qn, scale); break;
        case MASK_FLOAT16: mask_transposed_as<T, half_bits>(p, s, mp, rows, n, kt, b, kvh, q0, qn, scale); break;
        case MASK_BFLOAT16: mask_transposed_as<T, bfloat16_bits>(p, s, mp, rows, n, kt, b, kvh, q0, qn, scale); break;
        default: break;
    }
}

/* ---- the row-major layout S[r][j] --------------------------------------------------------------- */

template <typename T, typename M>
static void mask_rows_as(const FwdParams& p, T* s, int64_t row_stride, const int64_t* head, const int64_t* query,
                         int rows, int64_t n, int64_t kt, int64_t b) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    const M* mask = reinterpret_cast<const M*>(p.mask);
    const int64_t key_stride = p.mask_stride[3];
    for (int r = 0; r < rows; ++r) {
        const M* row = mask + b * p.mask_stride[0] + head[r] * p.mask_stride[1] + query[r] * p.mask_stride[2] +
                       kt * key_stride;
        T* scores = s + r * row_stride;
        int64_t j = 0;
        if (key_stride == 1)
            for (; j + L <= n; j += L) vstore(scores + j, masked<T, M>(vload<V>(scores + j), mask_vector<T>(row + j)));
        for (; j < n; ++j) {
            const T value = mask_scalar<T>(row + j * key_stride);
            if constexpr (std::is_same<M, uint8_t>::value) {
                if (value == T(0)) scores[j] = -std::numeric_limits<T>::infinity();
            } else {
                scores[j] += value;
            }
        }
    }
}

/* Apply the mask to a row-major score tile S[r][j] (row r is head[r], query[r]; n keys from kt). */
template <typename T>
static void mask_rows(const FwdParams& p, T* s, int64_t row_stride, const int64_t* head, const int64_t* query,
                      int rows, int64_t n, int64_t kt, int64_t b) {
    switch (p.mask_kind) {
        case MASK_BOOL: mask_rows_as<T, uint8_t>(p, s, row_stride, head, query, rows, n, kt, b); break;
        case MASK_FLOAT32: mask_rows_as<T, float>(p, s, row_stride, head, query, rows, n, kt, b); break;
        case MASK_FLOAT64: mask_rows_as<T, double>(p, s, row_stride, head, query, rows, n, kt, b); break;
        case MASK_FLOAT16: mask_rows_as<T, half_bits>(p, s, row_stride, head, query, rows, n, kt, b); break;
        case MASK_BFLOAT16: mask_rows_as<T, bfloat16_bits>(p, s, row_stride, head, query, rows, n, kt, b); break;
        default: break;
    }
}

/* ---- the tile's mask rows, prefetched while its scores are computed ----------------------------------
 *
 * A full mask gives each row of a tile its own run of n entries, Sk entries apart: more streams than
 * the hardware prefetcher follows.  Like SpreadPrefetch for K and V, this hands a tile's runs (rows
 * of a per-row mask with contiguous keys; nothing otherwise) to the prefetcher a few cache lines per
 * call, between the score blocks of Q K^T.  The kernels prefetch the tile they are computing, whose
 * mask pass follows that product: on Zen 5 (C2 float32, C3 bfloat16) a float (B,H,Sq,Sk) mask then
 * cost 12-13% and 18-19% of the unmasked call, against 16-17% and 23-24% when each tile prefetched
 * the next tile's mask (a tile earlier), and 19% and 29% when the lines went out in one burst. */
struct MaskPrefetch {
    const char* mask = nullptr;
    MaskRows cursor;
    int64_t rows = 0, row = 0, start = 0, bytes = 0, element = 1;
    const char* line = nullptr; /* the current row's next line */
    const char* end = nullptr;  /* and the end of its run */

    MaskPrefetch(const FwdParams& p, int64_t b, int64_t kvh, int64_t q0, int64_t qn, int64_t rows_, int64_t kt,
                 int64_t n)
        : cursor(p, b, kvh, q0, qn, 0) {
        if (p.mask_kind == MASK_NONE || n <= 0 || mask_rows_shared(p) || p.mask_stride[3] != 1) return;
        element = mask_element_bytes(p);
        mask = p.mask;
        rows = rows_;
        start = kt * element;
        bytes = n * element;
        start_row();
    }

    /* At most this many lines (a run need not start on a line): what the kernels spread. */
    int64_t total_lines() const { return rows * ((bytes + 63) / 64 + 1); }

    /* Locality: __builtin_prefetch's, 3 (every level, prefetcht0) by default; the AMX forward and
     * forward_block take 2 (L2 and out, prefetcht1): a bool (B,H,Sq,Sk) tile prefetched that way ran
     * 1-3% faster in the AMX forward than into L1, where a tile's lines (32 KiB) would crowd out its
     * operands, and forward_block with a float32 (1,8,1024,1024) mask 1.6% (C1's shape) and 3.6%
     * (C2's) faster, a bool one within noise (-0.8%; Zen 4, kernel_ab.cpp forward, 12 rounds). */
    template <int Locality = 3> __attribute__((always_inline)) inline void issue(int64_t count) {
        while (count > 0 && row < rows) {
            for (; count > 0 && line < end; --count, line += 64) __builtin_prefetch(line, 0, Locality);
            if (line >= end && ++row < rows) {
                cursor.next();
                start_row();
            }
        }
    }

  private:
    void start_row() {
        const char* first = mask + cursor.offset * element + start;
        line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(first) & ~uintptr_t(63));
        end = first + bytes;
    }
};

/* ---- tiles the mask hides entirely ------------------------------------------------------------- */

/* Whether a bool mask hides every key kt..kt+n-1 from every row of the tile (rows G x qn queries
 * from q0, kv head kvh): then the tile need not be computed.  Stops at the first visible key, so a
 * mask that hides keys here and there costs one byte per tile.  Float masks are never skipped:
 * a -inf entry added to a NaN score is NaN, which must reach the row (the contract's arithmetic). */
static inline bool mask_hides_tile(const FwdParams& p, int64_t b, int64_t kvh, int64_t q0, int64_t qn, int64_t kt,
                                   int64_t n) {
    if (p.mask_kind != MASK_BOOL) return false;
    const uint8_t* mask = reinterpret_cast<const uint8_t*>(p.mask);
    const int64_t key_stride = p.mask_stride[3];
    const int64_t rows = mask_rows_shared(p) ? 1 : p.group * qn;
    MaskRows cursor(p, b, kvh, q0, qn, 0);
    for (int64_t r = 0; r < rows; ++r, cursor.next()) {
        const uint8_t* row = mask + cursor.offset + kt * key_stride;
        for (int64_t j = 0; j < n; ++j)
            if (row[j * key_stride] != 0) return false;
    }
    return true;
}

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
