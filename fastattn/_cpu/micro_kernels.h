/* The forward's register-blocked products on flash_forward.h's layouts (the backward reuses them):
 *   qk_kernel           S[m][rows] = K[m][:] . Qp[:][rows] for MR keys x NV vectors of rows,
 *                       K broadcast, Qp loaded (qk_kernel_spread: 8 keys, prefetch between steps);
 *   pv_kernel           O[m][rows] += V^T[m][:] . P[:][rows], the same block on columns;
 *   Blocked             runs either over a tile's keys or columns: MR blocks, then one remainder;
 *   add_weighted_values O[r][:] += P[r][j] V[j][:] with R rows x CB vectors of O in registers,
 *                       V rows converted as they are loaded (accumulate_pv).
 * MR = kMainMR: 8 keys x 2 vectors (16 accumulators) with 32 vector registers, 6 x 2 (12) with
 * 16, so that the FMA pipes stay busy and the accumulators, a row of Qp and a broadcast fit. */
#ifndef FASTATTN_MICRO_KERNELS_H
#define FASTATTN_MICRO_KERNELS_H

#include <cstdint>

#include "isa.h"
#include "simd.h"

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

/* Keys of a Q.K^T block, columns of a P.V block: MR x 2 vectors of accumulators in registers. */
#if FASTATTN_VECTOR_BYTES == 64
constexpr int kMainMR = 8;
#else
constexpr int kMainMR = 6;
#endif

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

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
