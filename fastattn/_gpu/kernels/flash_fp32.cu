// Exact float32 flash attention, forward and backward, on the CUDA cores (SIMT, no TF32).
//
// STATUS: compiled by nvcc for sm_80 and sm_90; passes the conformance suite in the SIMT emulator and
// on an H100 and an H200 (benchmarks/results/gpu-check-*: tests, compute-sanitizer, G1-G7 benchmark).
//
// Every product is a float32 FMA and exp/log/tanh are the accurate expf/logf/tanhf, so results
// match float64 to float32 rounding (the contract's 1e-5).  One head-dimension bucket DMAX in
// {32, 64, 128, 256} covers both D and Dv (runtime sizes <= DMAX; shared tiles are zero-padded to
// DMAX, so any head_dim works).  Global loads are scalar, coalesced along the contiguous last axis,
// so any element strides work.
//
// Thread layout: 256 threads as 16 x 16 (ty, tx).  Every tile product C[R][C] += A[R][K] B[K][C]
// is done by `tile_mac`: thread (ty, tx) owns rows ty + 16 i and columns tx + 16 j (interleaved,
// so the 16 threads of a half-warp read 16 consecutive words of a row, or 16 rows of an odd-strided
// tile: conflict-free either way).  Shared tiles have odd row strides (DMAX + 1, BLOCK + 1).  A row
// of a score tile lives in one half-warp, so row max/sum are 4 shuffles.
//
// Forward (FlashAttention-2): one block per (64 query rows, query head, batch row); key tiles of
// BN = 64 keys (32 for DMAX 256, to stay within the 163 KiB an A100 block may use); S = Q K^T,
// online softmax in natural units, P through shared memory, O += P V; tiles outside the rows'
// visible key range (causal, window, key_lengths) are never loaded.
// Backward: (1) `fp32_delta`: delta = rowsum(dO * O), one warp per row.  (2) `fp32_backward_kv`: one
// block per (BN keys, kv head, batch row) looping over the GQA group's query heads and 32-row query
// blocks, recomputing P = exp(S - lse), dV += P^T dO, dS = P (dO V^T - delta) (softcap derivative,
// scale), dK += dS^T Q; dK/dV stay in registers and are summed over the group in a fixed order.
// Non-finite inputs follow the reference: a weight (probability or dS) of exactly 0, including exp
// results below the smallest normal float, contributes 0 even against an inf/NaN operand.
// (3) `fp32_backward_q`: one block per (query rows, query head, batch row) looping over 32-key
// tiles, recomputing P and dS, dQ += dS K.  dQ by a second pass instead of float32 atomics:
// deterministic at the cost of recomputing S and dP (the choice the CPU backend made too).
// Dropout (the DROPOUT instances): the forward's P V takes P Z, Z = 0 or 1 / (1 - p) from the Philox
// counters of (b, h, i, j) while the row sum takes P; the backward regenerates Z: dV += (P Z)^T dO,
// dS = P (dP Z - delta) [softcap'] scale.
#include "common.cuh"

namespace fastattn_gpu {

constexpr int kFp32Threads = 256;

// acc[TM][TN] += sum_{k < count} A(ty + 16 i, k) * B(k, tx + 16 j), with A(i, k) = a[i * a_row + k * a_k]
// and B(k, j) = b[k * b_k + j * b_col] in shared memory.  WEIGHTS: A holds probabilities or dS,
// and a product with a weight of exactly 0 counts 0 whatever B holds (inf/NaN semantics).
template <bool WEIGHTS, int TM, int TN>
__device__ __forceinline__ void tile_mac(float (&acc)[TM][TN], const float* a, int a_row, int a_k, const float* b,
                                         int b_k, int b_col, int count) {
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const float* a_base = a + ty * a_row;
    const float* b_base = b + tx * b_col;
#pragma unroll 4
    for (int kk = 0; kk < count; ++kk) {
        float a_values[TM], b_values[TN];
#pragma unroll
        for (int i = 0; i < TM; ++i) a_values[i] = a_base[16 * i * a_row + kk * a_k];
#pragma unroll
        for (int j = 0; j < TN; ++j) b_values[j] = b_base[kk * b_k + 16 * j * b_col];
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j)
                acc[i][j] = WEIGHTS ? weighted_add(a_values[i], b_values[j], acc[i][j])
                                    : fmaf(a_values[i], b_values[j], acc[i][j]);
    }
}

template <int TM, int TN> __device__ __forceinline__ void tile_zero(float (&acc)[TM][TN]) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;
}

// Rows [first, first + rows) x columns [0, width) of a (S, D) slice into a tile with row stride
// `stride`; rows >= limit and columns in [cols, width) are zero.
__device__ __forceinline__ void load_rows(float* tile, int stride, const float* base, long long row_stride, int first,
                                          int rows, int limit, int cols, int width) {
    for (int index = threadIdx.x; index < rows * width; index += kFp32Threads) {
        const int row = index / width, col = index % width;
        tile[row * stride + col] = first + row < limit && col < cols ? base[(first + row) * row_stride + col] : 0.f;
    }
}

// Max then sum over the 16 threads of a half-warp (one tile row).
__device__ __forceinline__ float row_max16(float x) {
#pragma unroll
    for (int step = 8; step > 0; step /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, step));
    return x;
}
__device__ __forceinline__ float row_sum16(float x) {
#pragma unroll
    for (int step = 8; step > 0; step /= 2) x += __shfl_xor_sync(0xffffffff, x, step);
    return x;
}

template <int DMAX> struct Fp32Shape {
    static constexpr int kStride = DMAX + 1;
    static constexpr int kForwardM = 64;
    static constexpr int kForwardN = DMAX <= 128 ? 64 : 32;
    static constexpr int kKvN = DMAX <= 128 ? 64 : 32;  // keys per backward_kv block
    static constexpr int kKvM = 32;                     // query rows per backward_kv step
    static constexpr int kQM = DMAX <= 128 ? 64 : 32;   // query rows per backward_q block
    static constexpr int kQN = 32;                      // keys per backward_q step
};

// The DROPOUT instances of fp32_forward and fp32_backward_q are bounded to one block an SM: left to
// itself ptxas capped them at 128 registers and spilled (head_dim 128 and 32); their Philox state
// needs more.  The others keep ptxas's own choice (a minimum of 0 blocks is no bound; 2 made
// fp32_forward<256> spill).
//
// RERUN: the second launch of a call (the same grid, after the first).  The first weighs each key
// against its row's maximum so far; where a key's weight is 0 against the row's final maximum (an
// exp below the smallest normal) but was not against an earlier one, a NaN or inf in its V stays in
// the output, where the reference has none.  A RERUN block exits unless its rows' outputs hold a
// non-finite value; then it takes the rows' final maxima from a walk of the scores alone and
// walks the keys once more against them, writing out and lse again (the tensor-core kernels' second
// walk, walk_keys_under_zero_weight_rule, does this within the kernel; here that walk in the same
// kernel took fp32_forward<128, false> on sm_80 from 98 registers to 128 and spilled).
template <int DMAX, bool DROPOUT, bool RERUN>
__global__ void __launch_bounds__(kFp32Threads, DROPOUT ? 1 : 0) fp32_forward(const __grid_constant__ Params p) {
    using Shape = Fp32Shape<DMAX>;
    constexpr int BM = Shape::kForwardM, BN = Shape::kForwardN, S = Shape::kStride;
    constexpr int TM = BM / 16, TN = BN / 16, TD = DMAX / 16;
    extern __shared__ float fp32_shared[];
    float* q_s = fp32_shared;        // [BM][S]
    float* k_s = q_s + BM * S;       // [BN][S]
    float* v_s = k_s + BN * S;       // [BN][S]
    float* p_s = v_s + BN * S;       // [BM][BN + 1]

    const int m0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z, kvh = h / p.group;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    if constexpr (RERUN) {
        const int rows = min(BM, p.seq_q - m0);
        // (No short-circuit: each load is issued whatever the ones before it held.)
        bool bad = false;
#pragma unroll 4
        for (int index = threadIdx.x; index < rows * p.head_dim_v; index += kFp32Threads)
            bad |= not_finite(p.out.row<const float>(b, h, m0 + index / p.head_dim_v)[index % p.head_dim_v]);
        if (!__syncthreads_or(bad)) return;
    }
    int lo, hi;
    p.rules.key_range(b, p.seq_k, m0, min(m0 + BM, p.seq_q) - 1, &lo, &hi);
    load_rows(q_s, S, p.q.row<const float>(b, h, 0), p.q.ss, m0, BM, p.seq_q, p.head_dim, DMAX);

    float row_max[TM], row_sum[TM], acc[TM][TD];
#pragma unroll
    for (int i = 0; i < TM; ++i) row_max[i] = negative_infinity(), row_sum[i] = 0.f;
    tile_zero(acc);
    // A walk over the key tiles; SCORES_ONLY: the rows' maxima alone (no V, no P V).
    auto walk = [&](auto scores_only) {
        constexpr bool SCORES_ONLY = decltype(scores_only)::value;
        for (int kt = lo; kt < hi; kt += BN) {
            __syncthreads();  // the previous tile's P V is done with k_s, v_s and p_s
            load_rows(k_s, S, p.k.row<const float>(b, kvh, 0), p.k.ss, kt, BN, hi, p.head_dim, DMAX);
            if constexpr (!SCORES_ONLY)
                load_rows(v_s, S, p.v.row<const float>(b, kvh, 0), p.v.ss, kt, BN, hi, p.head_dim_v, DMAX);
            __syncthreads();
            float s[TM][TN];
            tile_zero(s);
            tile_mac<false>(s, q_s, S, 1, k_s, 1, S, p.head_dim);
#pragma unroll
            for (int i = 0; i < TM; ++i) {
                const int row = m0 + ty + 16 * i;
                float tile_max = negative_infinity();
#pragma unroll
                for (int j = 0; j < TN; ++j) {
                    const int key = kt + tx + 16 * j;
                    s[i][j] = row < p.seq_q && key < hi
                                  ? p.rules.apply(soft_cap(s[i][j] * p.scale, p.softcap), b, h, row, key)
                                  : negative_infinity();
                    tile_max = fmaxf(tile_max, s[i][j]);
                }
                const float new_max = fmaxf(row_max[i], row_max16(tile_max));
                if constexpr (SCORES_ONLY) {
                    row_max[i] = new_max;
                    continue;
                }
                const float shift = new_max == negative_infinity() ? 0.f : new_max;
                const float alpha = flush_tiny(expf(row_max[i] - shift));
                float tile_sum = 0.f;
#pragma unroll
                for (int j = 0; j < TN; ++j) {
                    const float prob = flush_tiny(expf(s[i][j] - shift));
                    const float factor = DROPOUT ? p.dropout.factor(b, p.heads_q, h, row, kt + tx + 16 * j) : 1.f;
                    p_s[(ty + 16 * i) * (BN + 1) + tx + 16 * j] = prob * factor;
                    tile_sum += prob;
                }
                row_max[i] = new_max;
                row_sum[i] = row_sum[i] * alpha + row_sum16(tile_sum);
#pragma unroll
                for (int d = 0; d < TD; ++d) acc[i][d] = weighted_add(alpha, acc[i][d], 0.f);
            }
            if constexpr (!SCORES_ONLY) {
                __syncthreads();
                tile_mac<true>(acc, p_s, BN + 1, 1, v_s, S, 1, BN);
            }
        }
    };
    if constexpr (RERUN) walk(Flag<true>{});
    walk(Flag<false>{});

#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = m0 + ty + 16 * i;
        if (row >= p.seq_q) continue;
        const float inverse = row_sum[i] > 0.f ? 1.f / row_sum[i] : 0.f;
        float* dst = p.out.row<float>(b, h, row);
#pragma unroll
        for (int d = 0; d < TD; ++d)
            if (tx + 16 * d < p.head_dim_v) dst[tx + 16 * d] = acc[i][d] * inverse;
        if (tx == 0) *p.lse.row<float>(b, h, row) = row_sum[i] > 0.f ? row_max[i] + logf(row_sum[i]) : negative_infinity();
    }
}

// delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d]; one warp per row, delta contiguous (B, Hq, Sq).
__global__ void __launch_bounds__(kFp32Threads) fp32_delta(const __grid_constant__ Params p) {
    const long long row = static_cast<long long>(blockIdx.x) * (kFp32Threads / 32) + threadIdx.x / 32;
    if (row >= p.rows) return;
    const int lane = threadIdx.x % 32;
    const long long i = row % p.seq_q, h = (row / p.seq_q) % p.heads_q;
    const long long b = row / (static_cast<long long>(p.seq_q) * p.heads_q);
    const float* dout_row = p.dout.row<const float>(b, h, i);
    const float* out_row = p.out.row<const float>(b, h, i);
    float sum = 0.f;
    for (int d = lane; d < p.head_dim_v; d += 32) sum = fmaf(dout_row[d], out_row[d], sum);
#pragma unroll
    for (int step = 16; step > 0; step /= 2) sum += __shfl_xor_sync(0xffffffff, sum, step);
    if (lane == 0) p.delta[row] = sum;
}

// Shared memory of both backward kernels, in order: K and V tiles of `keys` rows, Q and dO tiles
// of `rows` rows (row stride `stride`), `grads` floats of score tiles (P^T and dS^T, or dS), then
// lse and delta of the `rows` query rows.
struct BackwardTiles {
    float *k, *v, *q, *dout, *grads, *lse, *delta;

    __device__ __forceinline__ BackwardTiles(float* base, int keys, int rows, int stride, int grads_floats)
        : k(base), v(k + keys * stride), q(v + keys * stride), dout(q + rows * stride), grads(dout + rows * stride),
          lse(grads + grads_floats), delta(lse + rows) {}

    // lse and delta of query rows [m0, m0 + count) of head h (-inf and 0 past seq_q).
    __device__ __forceinline__ void load_row_stats(const Params& p, int b, int h, int m0, int count) const {
        for (int r = threadIdx.x; r < count; r += kFp32Threads) {
            const bool inside = m0 + r < p.seq_q;
            lse[r] = inside ? *p.lse.row<const float>(b, h, m0 + r) : negative_infinity();
            delta[r] = inside ? p.delta[(static_cast<long long>(b) * p.heads_q + h) * p.seq_q + m0 + r] : 0.f;
        }
    }
};

// P Z and dS of one (query, key) pair from the raw score s = q.k, dp = dO.v, the row's lse and
// delta (Z = the dropout multiplier, 1 without dropout).
struct Gradient {
    float p, ds;
};
template <bool DROPOUT>
__device__ __forceinline__ Gradient score_gradient(const Params& p, float raw, float dp, float row_lse,
                                                   float row_delta, bool inside, int b, int h, int row, int key) {
    if (!inside || row_lse == negative_infinity()) return {0.f, 0.f};
    const float score = p.rules.apply(soft_cap(raw * p.scale, p.softcap), b, h, row, key);
    if (score == negative_infinity()) return {0.f, 0.f};
    const float prob = flush_tiny(expf(score - row_lse));
    const float factor = DROPOUT ? p.dropout.factor(b, p.heads_q, h, row, key) : 1.f;
    return {prob * factor, score_grad(prob, dp, row_delta, factor, soft_cap_slope(raw * p.scale, p.softcap), p.scale)};
}

template <int DMAX, bool DROPOUT>
__global__ void __launch_bounds__(kFp32Threads) fp32_backward_kv(const __grid_constant__ Params p) {
    using Shape = Fp32Shape<DMAX>;
    constexpr int BN = Shape::kKvN, BM = Shape::kKvM, S = Shape::kStride, SP = BM + 1;
    constexpr int TN = BN / 16, TM = BM / 16, TD = DMAX / 16;
    extern __shared__ float fp32_shared[];
    const BackwardTiles tiles(fp32_shared, BN, BM, S, 2 * BN * SP);
    float *k_s = tiles.k, *v_s = tiles.v, *q_s = tiles.q, *do_s = tiles.dout, *lse_s = tiles.lse, *delta_s = tiles.delta;
    float* p_s = tiles.grads;       // [BN][SP]  P^T
    float* ds_s = p_s + BN * SP;    // [BN][SP]  dS^T

    const int n0 = blockIdx.x * BN, kvh = blockIdx.y, b = blockIdx.z;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const int key_limit = p.rules.key_end(b, p.seq_k);
    load_rows(k_s, S, p.k.row<const float>(b, kvh, 0), p.k.ss, n0, BN, key_limit, p.head_dim, DMAX);
    load_rows(v_s, S, p.v.row<const float>(b, kvh, 0), p.v.ss, n0, BN, key_limit, p.head_dim_v, DMAX);

    float dk_acc[TN][TD], dv_acc[TN][TD];
    tile_zero(dk_acc);
    tile_zero(dv_acc);
    for (int g = 0; g < p.group; ++g) {
        const int h = kvh * p.group + g;
        for (int m0 = 0; m0 < p.seq_q; m0 += BM) {
            int lo, hi;
            p.rules.key_range(b, p.seq_k, m0, min(m0 + BM, p.seq_q) - 1, &lo, &hi);
            if (max(lo, n0) >= min(hi, n0 + BN)) continue;  // no row of this block sees these keys
            __syncthreads();  // the previous step is done with q_s, do_s, p_s, ds_s
            load_rows(q_s, S, p.q.row<const float>(b, h, 0), p.q.ss, m0, BM, p.seq_q, p.head_dim, DMAX);
            load_rows(do_s, S, p.dout.row<const float>(b, h, 0), p.dout.ss, m0, BM, p.seq_q, p.head_dim_v, DMAX);
            tiles.load_row_stats(p, b, h, m0, BM);
            __syncthreads();
            float s[TN][TM], dp[TN][TM];
            tile_zero(s);
            tile_zero(dp);
            tile_mac<false>(s, k_s, S, 1, q_s, 1, S, p.head_dim);      // S^T[n][m] = K[n] . Q[m]
            tile_mac<false>(dp, v_s, S, 1, do_s, 1, S, p.head_dim_v);  // dP^T[n][m] = V[n] . dO[m]
#pragma unroll
            for (int i = 0; i < TN; ++i) {
                const int key = n0 + ty + 16 * i;
#pragma unroll
                for (int j = 0; j < TM; ++j) {
                    const int local = tx + 16 * j, row = m0 + local;
                    const Gradient grad = score_gradient<DROPOUT>(p, s[i][j], dp[i][j], lse_s[local], delta_s[local],
                                                                  row < p.seq_q && key < key_limit, b, h, row, key);
                    p_s[(ty + 16 * i) * SP + local] = grad.p;
                    ds_s[(ty + 16 * i) * SP + local] = grad.ds;
                }
            }
            __syncthreads();
            tile_mac<true>(dv_acc, p_s, SP, 1, do_s, S, 1, BM);   // dV[n] += sum_m (P Z)^T[n][m] dO[m]
            tile_mac<true>(dk_acc, ds_s, SP, 1, q_s, S, 1, BM);   // dK[n] += sum_m dS^T[n][m] Q[m]
        }
    }

#pragma unroll
    for (int i = 0; i < TN; ++i) {
        const int key = n0 + ty + 16 * i;
        if (key >= p.seq_k) continue;
        float* dk_row = p.dk.row<float>(b, kvh, key);
        float* dv_row = p.dv.row<float>(b, kvh, key);
#pragma unroll
        for (int d = 0; d < TD; ++d) {
            if (tx + 16 * d < p.head_dim) dk_row[tx + 16 * d] = dk_acc[i][d];
            if (tx + 16 * d < p.head_dim_v) dv_row[tx + 16 * d] = dv_acc[i][d];
        }
    }
}

template <int DMAX, bool DROPOUT>
__global__ void __launch_bounds__(kFp32Threads, DROPOUT ? 1 : 0) fp32_backward_q(const __grid_constant__ Params p) {
    using Shape = Fp32Shape<DMAX>;
    constexpr int BM = Shape::kQM, BN = Shape::kQN, S = Shape::kStride, SD = BN + 1;
    constexpr int TM = BM / 16, TN = BN / 16, TD = DMAX / 16;
    extern __shared__ float fp32_shared[];
    const BackwardTiles tiles(fp32_shared, BN, BM, S, BM * SD);
    float *k_s = tiles.k, *v_s = tiles.v, *q_s = tiles.q, *do_s = tiles.dout, *lse_s = tiles.lse, *delta_s = tiles.delta;
    float* ds_s = tiles.grads;      // [BM][SD]

    const int m0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z, kvh = h / p.group;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    int lo, hi;
    p.rules.key_range(b, p.seq_k, m0, min(m0 + BM, p.seq_q) - 1, &lo, &hi);
    load_rows(q_s, S, p.q.row<const float>(b, h, 0), p.q.ss, m0, BM, p.seq_q, p.head_dim, DMAX);
    load_rows(do_s, S, p.dout.row<const float>(b, h, 0), p.dout.ss, m0, BM, p.seq_q, p.head_dim_v, DMAX);
    tiles.load_row_stats(p, b, h, m0, BM);

    float dq_acc[TM][TD];
    tile_zero(dq_acc);
    for (int kt = lo; kt < hi; kt += BN) {
        __syncthreads();  // the previous step is done with k_s, v_s, ds_s
        load_rows(k_s, S, p.k.row<const float>(b, kvh, 0), p.k.ss, kt, BN, hi, p.head_dim, DMAX);
        load_rows(v_s, S, p.v.row<const float>(b, kvh, 0), p.v.ss, kt, BN, hi, p.head_dim_v, DMAX);
        __syncthreads();
        float s[TM][TN], dp[TM][TN];
        tile_zero(s);
        tile_zero(dp);
        tile_mac<false>(s, q_s, S, 1, k_s, 1, S, p.head_dim);      // S[m][n] = Q[m] . K[n]
        tile_mac<false>(dp, do_s, S, 1, v_s, 1, S, p.head_dim_v);  // dP[m][n] = dO[m] . V[n]
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int local = ty + 16 * i, row = m0 + local;
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                const int key = kt + tx + 16 * j;
                ds_s[local * SD + tx + 16 * j] = score_gradient<DROPOUT>(p, s[i][j], dp[i][j], lse_s[local],
                                                                         delta_s[local], row < p.seq_q && key < hi, b,
                                                                         h, row, key)
                                                     .ds;
            }
        }
        __syncthreads();
        tile_mac<true>(dq_acc, ds_s, SD, 1, k_s, S, 1, BN);  // dQ[m] += sum_n dS[m][n] K[n]
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = m0 + ty + 16 * i;
        if (row >= p.seq_q) continue;
        float* dq_row = p.dq.row<float>(b, h, row);
#pragma unroll
        for (int d = 0; d < TD; ++d)
            if (tx + 16 * d < p.head_dim) dq_row[tx + 16 * d] = dq_acc[i][d];
    }
}

}  // namespace fastattn_gpu
