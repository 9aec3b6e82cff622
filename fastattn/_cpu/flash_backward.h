/* Flash attention backward on the CPU (FlashAttention-2 recomputation), never an Sq x Sk buffer.
 *
 * Three parallel passes, each output element written by exactly one work item in a fixed order,
 * so gradients are bit-identical whatever the thread count:
 *   1. delta[row] = sum_c dO[row][c] * O[row][c]                         (one item per query row)
 *   2. one item per (b, kv head, chunk of key blocks): for each key block of the chunk, every query
 *      block of the kv head's GQA group that can see it is visited; P = exp(S - lse) is recomputed
 *      from the saved lse,
 *        dP = dO V^T,  dS = P (dP - delta) [* softcap'],
 *        dV += P^T dO,  dK += dS^T (scale Q),  dQ^T_chunk += K^T dS
 *      so dK/dV are summed over the group in the thread that owns the block (K/V never repeated)
 *      and each chunk sums its own dQ partial (compute type, transposed tiles [qb][D][rows]).
 *   3. dQ for one (b, kv head, query block): the chunks' partials added in chunk order, times scale.
 * On a tile astride a causal or right-window edge, S, dP and dQ^T stop at each row block's last
 * visible key, as the forward's products do (row_block_keys: C2's backward ~3.6% faster on a 2-core
 * Zen 3, 16 alternations), and without GQA dK/dV sum each key over the rows that see it alone
 * (VisibleRows).
 * Five tile products per (query tile, key tile), the fewest there are; an earlier version recomputed
 * S and dP in a dQ pass over query blocks (seven) to spare the partials' memory.  The number of
 * chunks is chosen from the problem alone (fastattn/backends/cpu.py), never from the thread count,
 * so the sums' order, and every bit of dQ, is the same on any machine and thread count.
 *
 * It reuses the forward's pieces: Q and dO packed rows-as-lanes (Qp[d][rows], dOp[c][rows]), the
 * transposed score tile S[key][row] from qk_kernel (dP comes from the same kernel with V and dOp),
 * finish_scores for softcap/causal/window/mask, and pv_kernel for dQ^T (K^T read from panels packed
 * once a key tile).  dV and dK need "key x column" products summed over rows, done by outer_kernel:
 * vectors along the head dimension, P[j][r] (or dS[j][r]) broadcast, dO / Q rows loaded from column
 * panels of the query tile.
 */
#ifndef FASTATTN_FLASH_BACKWARD_H
#define FASTATTN_FLASH_BACKWARD_H

#include "forward_items.h"

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {


/* C[m][cols] += sum_r A[m][r] * B[r][cols] for MR rows of A (stride mp) and NV vectors of columns. */
template <typename T, int MR, int NV, bool Skip>
static inline void outer_kernel(const T* a, int64_t mp, const T* bm, int64_t b_stride, int64_t rows, T* c,
                                int64_t c_stride) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    V acc[MR][NV];
    FASTATTN_UNROLL for (int m = 0; m < MR; ++m)
        FASTATTN_UNROLL for (int v = 0; v < NV; ++v) acc[m][v] = vload<V>(c + m * c_stride + v * L);
    for (int64_t r = 0; r < rows; ++r) {
        V bv[NV];
        FASTATTN_UNROLL for (int v = 0; v < NV; ++v) bv[v] = vload<V>(bm + r * b_stride + v * L);
        FASTATTN_UNROLL for (int m = 0; m < MR; ++m) {
            const V weight = vbroadcast<T>(a[m * mp + r]);
            if (Skip && a[m * mp + r] == T(0)) continue; /* see note_stored in forward_tiles.h */
            FASTATTN_UNROLL for (int v = 0; v < NV; ++v) acc[m][v] += weight * bv[v];
        }
    }
    FASTATTN_UNROLL for (int m = 0; m < MR; ++m)
        FASTATTN_UNROLL for (int v = 0; v < NV; ++v) vstore(c + m * c_stride + v * L, acc[m][v]);
}

/* Rows [lo, hi) of a query tile's `rows` that causal/window let see some of the keys kt+j ..
 * kt+j+m-1, where the rows are one head's positions in order (a group of one; with GQA all rows):
 * the dK/dV products leave out the others, whose P and dS are 0 (finish_scores), so on a tile
 * astride an edge they do about half the work (B4 H16 S256 D64 causal: outer_kernel's samples
 * -32%, 2-core Zen 3).  A row left out also keeps a non-finite Q or dO row from the keys it
 * cannot see. */
struct VisibleRows {
    int64_t rows, first_key_row, last_key_row; /* row of key kt seen first / last (window) */
    bool cut_low, cut_high;

    VisibleRows(const FwdParams& p, int64_t rows_, int64_t q0, int64_t kt)
        : rows(rows_), first_key_row(0), last_key_row(0), cut_low(false), cut_high(false) {
        if (p.group != 1) return;
        /* Row r is position q0 + offset + r: key kt is seen by the rows key_row - right .. key_row + left. */
        const Band band(p);
        const int64_t key_row = kt - q0 - p.offset; /* the row at key kt's own position */
        cut_low = band.has_right;
        cut_high = band.has_left;
        if (cut_low) first_key_row = band.first_position(key_row);
        if (cut_high) last_key_row = band.last_position(key_row);
    }
    int64_t lo(int64_t j) const { return cut_low ? std::min(rows, std::max<int64_t>(0, first_key_row + j)) : 0; }
    int64_t hi(int64_t j, int64_t m) const {
        return cut_high ? std::max<int64_t>(0, std::min(rows, last_key_row + j + m)) : rows;
    }
};

template <typename T, int NV, bool Skip>
static void outer_rows(int64_t keys, const T* a, int64_t mp, const T* bm, int64_t b_stride, T* c, int64_t c_stride,
                       const VisibleRows& visible) {
    int64_t j = 0;
    for (; j + kMainMR <= keys; j += kMainMR) {
        const int64_t lo = visible.lo(j), hi = visible.hi(j, kMainMR);
        if (lo < hi)
            outer_kernel<T, kMainMR, NV, Skip>(a + j * mp + lo, mp, bm + lo * b_stride, b_stride, hi - lo,
                                               c + j * c_stride, c_stride);
    }
    const int64_t lo = visible.lo(j), hi = visible.hi(j, keys - j);
    if (lo >= hi) return;
    switch (keys - j) {
#define FASTATTN_OUTER_CASE(R) \
    case R:                    \
        if constexpr (R < kMainMR) \
            outer_kernel<T, R, NV, Skip>(a + j * mp + lo, mp, bm + lo * b_stride, b_stride, hi - lo, \
                                         c + j * c_stride, c_stride);                                \
        break;
        FASTATTN_OUTER_CASE(1) FASTATTN_OUTER_CASE(2) FASTATTN_OUTER_CASE(3) FASTATTN_OUTER_CASE(4)
        FASTATTN_OUTER_CASE(5) FASTATTN_OUTER_CASE(6) FASTATTN_OUTER_CASE(7)
#undef FASTATTN_OUTER_CASE
        default: break;
    }
}

/* Column panels of a [rows][cols] tile, the B operand of outer_columns: blocks of two vectors of
 * columns, then one of one vector, then one of the remaining columns (outer_columns' blocks); the
 * block at column c0, w columns wide, holds [panel_rows][w] from element c0 * panel_rows.  The walk
 * over rows then reads one run of memory a block: from [rows][cols] (D=128: a 64-byte piece of each
 * 512-byte row) the dK/dV products ran ~11% slower (perf samples, C4 backward, 2-core Zen 3). */
template <typename T>
static inline void unpack_panels(const T* columns, int64_t stride, int64_t cols, T* panels, int64_t panel_rows,
                                 int64_t r0) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    int64_t c0 = 0;
    for (; c0 + L <= cols; c0 += L) {
        /* The second vector of a two-vector block, or the first of one that fits, else a one-vector block. */
        const bool paired = c0 % (2 * L) != 0 || c0 + 2 * L <= cols;
        const int64_t first = paired ? c0 - c0 % (2 * L) : c0, width = paired ? 2 * L : L;
        V block[L];
        for (int t = 0; t < L; ++t) block[t] = vload<V>(columns + (c0 + t) * stride);
        transpose_lanes<T>(block);
        for (int u = 0; u < L; ++u) vstore(panels + first * panel_rows + (r0 + u) * width + (c0 - first), block[u]);
    }
    const int64_t rest = cols - c0;
    for (int64_t c = c0; c < cols; ++c)
        for (int u = 0; u < L; ++u) panels[c0 * panel_rows + (r0 + u) * rest + (c - c0)] = columns[c * stride + u];
}

/* C[keys][cols] += A[keys][rows] B[rows][cols], B in column panels of panel_rows rows (unpack_panels),
 * key j summed over the rows `visible` gives it: two-vector column blocks, one-vector blocks, then a
 * scalar tail for head dimensions that are not a multiple of the vector width. */
template <typename T, bool Skip>
static void outer_columns(int64_t keys, int64_t cols, const T* a, int64_t mp, const T* panels, int64_t panel_rows,
                          T* c, int64_t c_stride, const VisibleRows& visible) {
    constexpr int L = Vec<T>::lanes;
    int64_t col = 0;
    for (; col + 2 * L <= cols; col += 2 * L)
        outer_rows<T, 2, Skip>(keys, a, mp, panels + col * panel_rows, 2 * L, c + col, c_stride, visible);
    for (; col + L <= cols; col += L)
        outer_rows<T, 1, Skip>(keys, a, mp, panels + col * panel_rows, L, c + col, c_stride, visible);
    const int64_t rest = cols - col;
    const T* bm = panels + col * panel_rows;
    for (int64_t t = 0; t < rest; ++t)
        for (int64_t j = 0; j < keys; ++j) {
            T total = 0;
            for (int64_t r = visible.lo(j); r < visible.hi(j, 1); ++r)
                if (!Skip || a[j * mp + r] != T(0)) total += a[j * mp + r] * bm[r * rest + t];
            c[j * c_stride + col + t] += total;
        }
}

template <typename T>
static void outer_product(int64_t keys, int64_t cols, const T* a, int64_t mp, const T* panels, int64_t panel_rows,
                          T* c, int64_t c_stride, const VisibleRows& visible, bool skip_zero_weights) {
    if (skip_zero_weights)
        outer_columns<T, true>(keys, cols, a, mp, panels, panel_rows, c, c_stride, visible);
    else
        outer_columns<T, false>(keys, cols, a, mp, panels, panel_rows, c, c_stride, visible);
}

/* K^T of a key tile as panels [D / kMainMR][keys][kMainMR] (the last zero-padded), for the dQ^T
 * product: Blocked::pv_all then walks one run of memory a block of kMainMR columns, where from K's
 * rows it read a piece of every row (C4: dQ^T's product ~12% fewer samples on a 2-core Zen 3).
 * Packed once a key tile, read by every query tile that sees it. */
template <typename T>
static void pack_key_panels(const T* k, int64_t k_stride, int64_t keys, int64_t D, T* panels) {
    const int64_t whole = D - D % kMainMR;
    for (int64_t j = 0; j < keys; ++j) {
        const T* row = k + j * k_stride;
        for (int64_t c0 = 0; c0 < whole; c0 += kMainMR)
            std::memcpy(panels + c0 * keys + j * kMainMR, row + c0, sizeof(T) * kMainMR);
        if (whole < D) {
            T* last = panels + whole * keys + j * kMainMR;
            std::memcpy(last, row + whole, sizeof(T) * (D - whole));
            std::memset(last + (D - whole), 0, sizeof(T) * (kMainMR - (D - whole)));
        }
    }
}

/* Scratch for either pass, in compute-type elements. */
template <typename T> static size_t backward_scratch_elements(const BwdParams& bp) {
    const FwdParams& p = bp.f;
    const int64_t mp = round_up(p.group * p.block_queries, 2 * lanes<T>());
    const int64_t n = p.key_tile, width = 2 * p.head_dim + 2 * p.head_dim_v;
    const int64_t key_panels = n * round_up(p.head_dim, kMainMR);
    return (size_t)(n * width + key_panels + mp * width + 4 * n * mp + 3 * mp + p.head_dim * mp + 4 * lanes<T>());
}

/* Pack the rows of one query tile: scale*Q as Qp[d][rows] (and in column panels, for dK), dO as
 * dOp[c][rows] (and in column panels, for dV), lse log2(e) (+inf for rows that saw no key, so that
 * their P is 0), delta, and each row's key position. */
template <typename T, typename In, int NV> struct TilePack {
    T *qp, *q_panels, *dop, *do_panels, *lse, *delta, *position;
    int64_t rows, mp;

    void fill(const BwdParams& bp, int64_t b, int64_t kvh, int64_t q0, int64_t qn) {
        const FwdParams& p = bp.f;
        constexpr int64_t RB = NV * Vec<T>::lanes;
        const int64_t D = p.head_dim, Dv = p.head_dim_v, G = p.group;
        const T scale = (T)p.scale;
        rows = G * qn;
        mp = round_up(rows, RB);
        /* L rows at a time: packed by pack_rows, the panels unpacked from the packed tiles. */
        constexpr int L = Vec<T>::lanes;
        for (int64_t r0 = 0; r0 < mp; r0 += L) {
            const In *qsrc[L], *osrc[L];
            for (int u = 0; u < L; ++u) {
                const int64_t r = r0 + u;
                if (r < rows) {
                    const int64_t g = r / qn, i = q0 + r % qn, h = kvh * G + g;
                    qsrc[u] = at<In>(p.q, b * p.q_stride[0] + h * p.q_stride[1] + i * p.q_stride[2]);
                    osrc[u] = at<In>(bp.dout, b * bp.dout_stride[0] + h * bp.dout_stride[1] + i * bp.dout_stride[2]);
                    const T saved = *(reinterpret_cast<const T*>(p.lse) + b * p.lse_stride[0] + h * p.lse_stride[1] +
                                      i * p.lse_stride[2]);
                    lse[r] = saved == -std::numeric_limits<T>::infinity() ? std::numeric_limits<T>::infinity()
                                                                          : saved * kLog2e<T>;
                    delta[r] = reinterpret_cast<const T*>(bp.delta)[(b * p.heads_q + h) * p.seq_q + i];
                    position[r] = (T)(i + p.offset);
                } else {
                    qsrc[u] = osrc[u] = nullptr;
                    lse[r] = std::numeric_limits<T>::infinity();
                    delta[r] = T(0);
                    position[r] = (T)(q0 + p.offset);
                }
            }
            T* qdst = qp + (r0 / RB) * D * RB + r0 % RB;
            T* odst = dop + (r0 / RB) * Dv * RB + r0 % RB;
            pack_rows<T, In>(qsrc, scale, D, qdst, RB);
            pack_rows<T, In>(osrc, T(1), Dv, odst, RB);
            unpack_panels<T>(qdst, RB, D, q_panels, mp, r0);
            unpack_panels<T>(odst, RB, Dv, do_panels, mp, r0);
        }
    }
};

/* The scratch of one backward work item after its `reserved` accumulator elements: K/V
 * conversion tiles, K^T's panels (pack_key_panels), the packed query tile, and the S/P, dP/dS,
 * softcap' and dropout tiles. */
template <typename T, typename In, int NV> struct BackwardTiles {
    T *k_converted, *v_converted, *key_panels, *s, *dp, *cap_grad, *keep;
    TilePack<T, In, NV> pack;

    BackwardTiles(const FwdParams& p, T* scratch, int64_t reserved) {
        const int64_t D = p.head_dim, Dv = p.head_dim_v, N = p.key_tile;
        const int64_t mp_max = round_up(p.group * p.block_queries, 2 * lanes<T>());
        k_converted = scratch + reserved;
        v_converted = k_converted + N * D;
        key_panels = v_converted + N * Dv;
        pack.qp = key_panels + N * round_up(D, kMainMR);
        pack.q_panels = pack.qp + mp_max * D;
        pack.dop = pack.q_panels + mp_max * D;
        pack.do_panels = pack.dop + mp_max * Dv;
        s = pack.do_panels + mp_max * Dv;
        dp = s + N * mp_max;
        cap_grad = dp + N * mp_max;
        keep = cap_grad + N * mp_max;
        pack.lse = keep + N * mp_max;
        pack.delta = pack.lse + mp_max;
        pack.position = pack.delta + mp_max;
    }
};

/* P and dS of one vector of rows for one key: P = exp(S - lse) = 2^(S score_log2e - lse2) by the
 * forward's vexp2_softmax (lse2 = lse log2(e), TilePack; score_log2e = log2(e), or scale log2(e)
 * where S is not yet scaled), P o dropout in `kept` (what dV needs; `keep` points at this vector's
 * multipliers or is null), dS = P (dP o dropout - delta) [* softcap'] in `grad`. */
template <typename T>
static inline void probability_gradient(typename Vec<T>::type score, typename Vec<T>::type dprob,
                                        typename Vec<T>::type lse2, typename Vec<T>::type delta, T score_log2e,
                                        const T* keep, const T* cap_grad, typename Vec<T>::type* kept,
                                        typename Vec<T>::type* grad) {
    typedef typename Vec<T>::type V;
    /* A hidden key (-inf) has P = 0 even in a row whose lse is NaN. */
    const V prob = vselect(score == vbroadcast(-std::numeric_limits<T>::infinity()), V{},
                           vexp2_softmax(score * score_log2e - lse2));
    *kept = prob;
    if (keep) {
        const V factor = vload<V>(keep);
        dprob = vselect(factor != V{}, dprob * factor, V{});
        *kept = prob * factor;
    }
    V gradient = prob * (dprob - delta);
    if (cap_grad) gradient *= vload<V>(cap_grad);
    /* A key of zero weight has dS = 0 exactly, even if its dP (V) is not finite. */
    *grad = vselect(prob != V{}, gradient, V{});
}

/* S -> P and dP -> dS for one (key tile, query tile): s holds S[j][rows] on entry and P on exit
 * (P o dropout with `keep`, the dropout multipliers: what dV needs), dp holds dP on entry and
 * dS = P (dP o dropout - delta) [* softcap'] on exit (probability_gradient).  Dropout and softcap
 * are template arguments, so the loop of a call without them tests neither (with the tests in the
 * loop, ~15 cycles a vector on a Zen 3, C1). */
template <typename T, bool Dropout, bool Softcap>
static void softmax_gradient_tile(T* s, T* dp, const T* cap_grad, const T* keep, const T* lse2, const T* delta,
                                  int64_t n, int64_t mp) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    for (int64_t j = 0; j < n; ++j)
        for (int64_t r = 0; r < mp; r += L) {
            const int64_t e = j * mp + r;
            V kept, grad;
            probability_gradient<T>(vload<V>(s + e), vload<V>(dp + e), vload<V>(lse2 + r), vload<V>(delta + r),
                                    kLog2e<T>, Dropout ? keep + e : nullptr, Softcap ? cap_grad + e : nullptr,
                                    &kept, &grad);
            vstore(s + e, kept);
            vstore(dp + e, grad);
        }
}

template <typename T>
static void softmax_gradient(const FwdParams& p, T* s, T* dp, const T* cap_grad, const T* keep, const T* lse2,
                             const T* delta, int64_t n, int64_t mp) {
    if (keep && p.softcap > 0)
        softmax_gradient_tile<T, true, true>(s, dp, cap_grad, keep, lse2, delta, n, mp);
    else if (keep)
        softmax_gradient_tile<T, true, false>(s, dp, cap_grad, keep, lse2, delta, n, mp);
    else if (p.softcap > 0)
        softmax_gradient_tile<T, false, true>(s, dp, cap_grad, keep, lse2, delta, n, mp);
    else
        softmax_gradient_tile<T, false, false>(s, dp, cap_grad, keep, lse2, delta, n, mp);
}

/* P and dS of one (key tile, query tile), left in t.s and t.dp: S = K Qp^T and dP = V dOp^T by the
 * forward's kernel (the tile's mask rows prefetched on the way, as the forward does), the forward's
 * masking, then softmax_gradient. */
template <typename T, typename In, int NV>
static void tile_gradients(const FwdParams& p, const KvTile<T, In>& tile, BackwardTiles<T, In, NV>& t, int64_t n,
                           int64_t kt, int64_t b, int64_t kvh, int64_t q0, int64_t qn) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v, mp = t.pack.mp, RB = NV * lanes<T>();
    MaskPrefetch mask_lines(p, b, kvh, q0, qn, t.pack.rows, kt, n);
    const int64_t calls = std::max<int64_t>(1, 2 * (mp / RB) * (n / kMainMR));
    const int64_t mask_lines_per_call = (mask_lines.total_lines() + calls - 1) / calls;
    auto issue = [&] { mask_lines.issue(mask_lines_per_call); };
    const bool prefetch = mask_lines.total_lines() > 0; /* else no hook: the products keep their registers */
    for (int64_t rb = 0; rb < mp; rb += RB) {
        /* Keys past the row block's last visible one (row_block_keys) are left out of S and dP:
         * finish_scores hides them (-inf), so their P and dS are 0 whatever dP holds. */
        const int64_t keys = row_block_keys(p, q0, qn, t.pack.rows, rb, RB, kt, n);
        if (prefetch) {
            Blocked<T, NV>::qk_all(keys, tile.k, tile.k_stride, t.pack.qp + rb * D, D, t.s + rb, mp, issue);
            Blocked<T, NV>::qk_all(keys, tile.v, tile.v_stride, t.pack.dop + rb * Dv, Dv, t.dp + rb, mp, issue);
        } else {
            Blocked<T, NV>::qk_all(keys, tile.k, tile.k_stride, t.pack.qp + rb * D, D, t.s + rb, mp);
            Blocked<T, NV>::qk_all(keys, tile.v, tile.v_stride, t.pack.dop + rb * Dv, Dv, t.dp + rb, mp);
        }
    }
    finish_scores<T>(p, t.s, t.cap_grad, mp, t.pack.rows, n, kt, b, kvh, q0, qn, t.pack.position, T(1));
    const T* keep = nullptr;
    if (p.dropout_p > 0) {
        std::memset(t.keep, 0, sizeof(T) * n * mp);
        dropout_tile<T>(p, t.keep, mp, 1, t.pack.rows, n, kt, b, kvh, q0, qn, true);
        keep = t.keep;
    }
    softmax_gradient<T>(p, t.s, t.dp, t.cap_grad, keep, t.pack.lse, t.pack.delta, n, mp);
}

/* Vectors of rows per row block (NV of the kernels): one when a whole query block's rows fit in a
 * vector, else two.  Fixed per problem, so pass 2 and pass 3 lay out a block's dQ tile alike. */
template <typename T> static inline int row_vectors(const FwdParams& p) {
    return p.group * p.block_queries <= lanes<T>() ? 1 : 2;
}

/* Padded rows of a query block's dQ^T tile slot: the most any block uses. */
template <typename T> static inline int64_t dq_tile_rows(const FwdParams& p) {
    return round_up(p.group * p.block_queries, 2 * lanes<T>());
}

/* The dQ^T tile ([D][rows], rows padded to the block's mp) of query block qb in chunk's partial. */
template <typename T>
static inline T* dq_partial_tile(const BwdParams& bp, int64_t chunk, int64_t b, int64_t kvh, int64_t qb) {
    const FwdParams& p = bp.f;
    const int64_t slot = ((chunk * p.batch + b) * p.heads_kv + kvh) * p.query_blocks + qb;
    return reinterpret_cast<T*>(bp.dq_partial) + slot * p.head_dim * dq_tile_rows<T>(p);
}

/* Keys of the block at k0 (n of them) below key_lengths: the rest are padding, of zero gradient. */
static inline int64_t live_keys(const FwdParams& p, int64_t b, int64_t k0, int64_t n) {
    return std::min(n, (p.key_lengths ? p.key_lengths[b] : p.seq_k) - k0);
}

/* Query positions [*i_lo, *i_hi) that causal/window let see some of the keys k0..k0+live-1. */
static inline void seeing_queries(const FwdParams& p, int64_t k0, int64_t live, int64_t* i_lo, int64_t* i_hi) {
    int64_t lo = p.offset, hi = p.seq_q + p.offset; /* positions of queries 0..seq_q */
    Band(p).cut_positions(k0, k0 + live - 1, &lo, &hi);
    *i_lo = lo - p.offset;
    *i_hi = hi - p.offset;
}

/* Write the n keys' gradients from k0: dK = dk_scale dk ([n][D]) and dV = dv ([n][Dv]). */
template <typename T, typename In>
static void write_key_gradients(const BwdParams& bp, int64_t b, int64_t kvh, int64_t k0, int64_t n, const T* dk,
                                const T* dv, T dk_scale) {
    const FwdParams& p = bp.f;
    const int64_t D = p.head_dim, Dv = p.head_dim_v;
    for (int64_t j = 0; j < n; ++j) {
        In* dk_row = reinterpret_cast<In*>(bp.dk) + b * bp.dk_stride[0] + kvh * bp.dk_stride[1] + (k0 + j) * bp.dk_stride[2];
        In* dv_row = reinterpret_cast<In*>(bp.dv) + b * bp.dv_stride[0] + kvh * bp.dv_stride[1] + (k0 + j) * bp.dv_stride[2];
        const bool finite = store_row<T, In>(dk + j * D, dk_scale, dk_row, D) & store_row<T, In>(dv + j * Dv, T(1), dv_row, Dv);
        if (!finite) note_stored(p, std::numeric_limits<double>::quiet_NaN());
    }
}

/* Whether pass 2's chunk visits query block qb of batch row b: some key block of the chunk has live
 * keys that the block's queries can see (seeing_queries).  Only those dQ^T tiles of the chunk are
 * cleared in pass 2 and summed in pass 3 (under causal masking a chunk of late keys leaves the early
 * query blocks alone: 3/8 of the tiles with four chunks). */
static inline bool chunk_visits(const BwdParams& bp, int64_t b, int64_t chunk, int64_t qb) {
    const FwdParams& p = bp.f;
    const int64_t N = p.key_tile, BQ = p.block_queries;
    const int64_t kb_end = std::min(bp.key_blocks, (chunk + 1) * bp.chunk_blocks);
    for (int64_t kb = chunk * bp.chunk_blocks; kb < kb_end; ++kb) {
        const int64_t k0 = kb * N, live = live_keys(p, b, k0, std::min(N, p.seq_k - k0));
        if (live <= 0) continue;
        int64_t i_lo, i_hi;
        seeing_queries(p, k0, live, &i_lo, &i_hi);
        if (qb >= std::max<int64_t>(i_lo, 0) / BQ && qb * BQ < i_hi) return true;
    }
    return false;
}

/* Clear the dQ^T tiles that the chunk will add to (chunk_visits). */
template <typename T> static void clear_dq_partials(const BwdParams& bp, int64_t b, int64_t kvh, int64_t chunk) {
    const FwdParams& p = bp.f;
    for (int64_t qb = 0; qb < p.query_blocks; ++qb)
        if (chunk_visits(bp, b, chunk, qb))
            std::memset(dq_partial_tile<T>(bp, chunk, b, kvh, qb), 0, sizeof(T) * p.head_dim * dq_tile_rows<T>(p));
}

/* Pass 2: dK and dV of the key blocks of one chunk of one kv head, and the chunk's dQ partial. */
template <typename T, typename In, int NV>
static void gradient_block(const BwdParams& bp, T* scratch, int64_t b, int64_t kvh, int64_t chunk) {
    const FwdParams& p = bp.f;
    const int64_t D = p.head_dim, Dv = p.head_dim_v, N = p.key_tile, BQ = p.block_queries;
    T* dk = scratch;
    T* dv = dk + N * D;
    BackwardTiles<T, In, NV> t(p, scratch, N * (D + Dv));
    TilePack<T, In, NV>& pack = t.pack;
    clear_dq_partials<T>(bp, b, kvh, chunk);
    const int64_t kb_end = std::min(bp.key_blocks, (chunk + 1) * bp.chunk_blocks);
    for (int64_t kb = chunk * bp.chunk_blocks; kb < kb_end; ++kb) {
        const int64_t k0 = kb * N, n = std::min(N, p.seq_k - k0);
        std::memset(dk, 0, sizeof(T) * N * D);
        std::memset(dv, 0, sizeof(T) * N * Dv);
        const int64_t live = live_keys(p, b, k0, n);
        if (live > 0) {
            int64_t i_lo, i_hi;
            seeing_queries(p, k0, live, &i_lo, &i_hi);
            KvTile<T, In> tile;
            tile.load(p, b, kvh, k0, live, t.k_converted, t.v_converted);
            pack_key_panels<T>(tile.k, tile.k_stride, live, D, t.key_panels);
            /* Whole query blocks (pass 3's), so rows of a block outside [i_lo, i_hi) get P = dS = 0. */
            for (int64_t qb = std::max<int64_t>(i_lo, 0) / BQ; qb * BQ < i_hi; ++qb) {
                const int64_t q0 = qb * BQ, qn = std::min(BQ, p.seq_q - q0);
                if (p.mask_kind != MASK_NONE && mask_hides_tile(p, b, kvh, q0, qn, k0, live)) continue;
                pack.fill(bp, b, kvh, q0, qn);
                const int64_t mp = pack.mp;
                tile_gradients<T, In, NV>(p, tile, t, live, k0, b, kvh, q0, qn);
                const VisibleRows visible(p, pack.rows, q0, k0);
                outer_product<T>(live, Dv, t.s, mp, pack.do_panels, mp, dv, Dv, visible, p.skip_zero_weights);
                outer_product<T>(live, D, t.dp, mp, pack.q_panels, mp, dk, D, visible, p.skip_zero_weights);
                T* dqt = dq_partial_tile<T>(bp, chunk, b, kvh, qb);
                for (int64_t rb = 0; rb < mp; rb += NV * lanes<T>()) {
                    const int64_t keys = row_block_keys(p, q0, qn, pack.rows, rb, NV * lanes<T>(), k0, live);
                    Blocked<T, NV>::pv_all(D, t.key_panels, kMainMR, live, t.dp + rb, mp, keys, dqt + rb,
                                           p.skip_zero_weights);
                }
            }
        }
        write_key_gradients<T, In>(bp, b, kvh, k0, n, dk, dv, T(1));
    }
}

/* Pass 3: dQ of one (b, kv head, query block), all heads of the group stacked: the chunks' dQ^T
 * tiles (rows padded to a multiple of row_align, as pass 2 laid them out) of the chunks that visit
 * it added in chunk order, then scaled and written. */
template <typename T, typename In>
static void dq_block(const BwdParams& bp, T* scratch, int64_t b, int64_t kvh, int64_t qb, int64_t row_align) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    const FwdParams& p = bp.f;
    const int64_t D = p.head_dim, q0 = qb * p.block_queries, qn = std::min(p.block_queries, p.seq_q - q0);
    const int64_t rows = p.group * qn, mp = round_up(rows, row_align);
    T* dqt = scratch; /* [D][mp] */
    bool first = true;
    for (int64_t chunk = 0; chunk < bp.chunks; ++chunk) {
        if (!chunk_visits(bp, b, chunk, qb)) continue;
        const T* part = dq_partial_tile<T>(bp, chunk, b, kvh, qb);
        if (first)
            std::memcpy(dqt, part, sizeof(T) * D * mp);
        else
            for (int64_t e = 0; e < D * mp; e += L) vstore(dqt + e, vload<V>(dqt + e) + vload<V>(part + e));
        first = false;
    }
    if (first) std::memset(dqt, 0, sizeof(T) * D * mp); /* no chunk sees these queries: dQ = 0 */
    /* L rows at a time back to [rows][D] (unpack_rows), then stored. */
    T* block_rows = dqt + D * mp; /* [L][D] */
    bool finite = true;
    for (int64_t r0 = 0; r0 < rows; r0 += L) {
        unpack_rows<T>(dqt + r0, mp, D, block_rows);
        for (int64_t r = r0; r < std::min<int64_t>(r0 + L, rows); ++r) {
            const int64_t g = r / qn, i = q0 + r % qn, h = kvh * p.group + g;
            In* dst = reinterpret_cast<In*>(bp.dq) + b * bp.dq_stride[0] + h * bp.dq_stride[1] + i * bp.dq_stride[2];
            finite &= store_row<T, In>(block_rows + (r - r0) * D, (T)p.scale, dst, D);
        }
    }
    if (!finite) note_stored(p, std::numeric_limits<double>::quiet_NaN());
}

template <typename T, typename In>
static void delta_row(const BwdParams& bp, int64_t index) {
    const FwdParams& p = bp.f;
    const int64_t i = index % p.seq_q, h = (index / p.seq_q) % p.heads_q, b = index / (p.seq_q * p.heads_q);
    const In* grad = at<In>(bp.dout, b * bp.dout_stride[0] + h * bp.dout_stride[1] + i * bp.dout_stride[2]);
    const In* out = at<In>(bp.out, b * bp.o_stride[0] + h * bp.o_stride[1] + i * bp.o_stride[2]);
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    V sums{};
    int64_t c = 0;
    for (; c + L <= p.head_dim_v; c += L) sums += load_vector<T>(grad + c) * load_vector<T>(out + c);
    T total = 0;
    for (int l = 0; l < L; ++l) total += sums[l];
    for (; c < p.head_dim_v; ++c) total += load_as<T>(grad[c]) * load_as<T>(out[c]);
    reinterpret_cast<T*>(bp.delta)[index] = total;
}

/* Items of one kv head consecutive (its Q and dO shared in cache, as decode_item orders the
 * forward's), chunk 0 first: under causal masking the first keys are seen by the most queries. */
struct KeyChunk {
    int64_t b, kvh, chunk;
};

static inline KeyChunk key_chunk_of(const BwdParams& bp, int64_t item) {
    return KeyChunk{item / (bp.chunks * bp.f.heads_kv), (item / bp.chunks) % bp.f.heads_kv, item % bp.chunks};
}

template <typename T, typename In>
static void gradient_item(const BwdParams& bp, char* scratch, int64_t item) {
    const KeyChunk where = key_chunk_of(bp, item);
    T* buffer = reinterpret_cast<T*>(scratch);
    if (row_vectors<T>(bp.f) == 1)
        gradient_block<T, In, 1>(bp, buffer, where.b, where.kvh, where.chunk);
    else
        gradient_block<T, In, 2>(bp, buffer, where.b, where.kvh, where.chunk);
}

/* Pass 3's item; row_align: the padding of pass 2's dQ^T tiles (vector_row_align for its vector
 * kernels). */
template <typename T, typename In>
static void dq_item(const BwdParams& bp, char* scratch, int64_t item, int64_t row_align) {
    const FwdParams& p = bp.f;
    const int64_t qb = item % p.query_blocks, kvh = (item / p.query_blocks) % p.heads_kv;
    const int64_t b = item / (p.query_blocks * p.heads_kv);
    dq_block<T, In>(bp, reinterpret_cast<T*>(scratch), b, kvh, qb, row_align);
}

template <typename T> static inline int64_t vector_row_align(const FwdParams& p) {
    return row_vectors<T>(p) * lanes<T>();
}

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
