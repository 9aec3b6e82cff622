// Flash attention backward for NVIDIA tensor cores (sm_80+), float16 / bfloat16 in, float32 math.
//
// STATUS: compiled by nvcc for sm_80 and sm_90 (CI's check instantiates every configuration) and
// by NVRTC 13 the way the launcher does; ptxas (CUDA 13.0) reports no spills: flash_backward_kv
// 128-239 registers a thread, flash_backward_dq 134-236.  It has NOT yet run on a GPU (issue #12
// owes the runs: tests, compute-sanitizer, benchmark).
//
// Algorithm (FlashAttention-2 backward, P recomputed from the forward's lse), three kernels:
//   1. flash_backward_prepare, one thread per 16-byte chunk of a row:
//        delta[row] = sum_c dO[row][c] * O[row][c]           (float32, (B, Hq, Sq))
//        lse2[row]  = lse[row] * log2(e), +inf for a row that saw no key (so that P = 0 there)
//      and, unless deterministic, clears the row of the float32 dQ accumulator (B, Hq, Sq, D).
//   2. flash_backward_kv, one block (8 warps) per (BLOCK_N keys, kv head, batch row).  K and V of
//      the block stay in shared memory; the block walks every query head of the kv head's GQA group
//      and every query tile of BLOCK_M rows that can see one of its keys (causal, window and
//      key_lengths bound the walk, so hidden tiles are never loaded), Q and dO tiles
//      double-buffered with cp.async.  Per tile, in the transposed frame (mma rows are keys):
//        S^T  = K Q^T,  dP^T = V dO^T                      mma.sync m16n8k16, f32 accumulate
//        P^T  = exp2(S^T scale log2e - lse2)   with softcap and every mask exactly as the forward
//        dS^T = P^T (dP^T - delta) sech^2 [softcap] scale
//      P^T and dS^T go to shared memory (key-major, in the input dtype), then
//        dV += P^T dO,  dK += dS^T Q                       (float32 registers, whole GQA group)
//        dQ += dS K     float32 atomicAdd into the accumulator (ATOMIC_DQ), read back from dS^T
//                       with ldmatrix.trans
//      dK and dV are written once, in the input dtype, after the last query tile: the GQA
//      reduction happens in registers, never through Hq-shaped buffers, and K/V are never repeated.
//   3. dQ out of the accumulator: flash_backward_dq_convert (float32 -> input dtype, caller's
//      strides); or, in deterministic mode, flash_backward_dq instead of the atomics: one block
//      (4 warps x 16 rows) per (64 query rows, query head, batch row) walks its visible key tiles
//      like the forward, recomputes S, P, dP and dS, and accumulates dQ = dS K in registers.  Every
//      element is then summed in a fixed order: gradients are bit-reproducible run to run.
//
// Tiles of flash_backward_kv (BLOCK_M query rows x BLOCK_N = 16 KEY_WARPS keys; the 8 warps are
// KEY_WARPS along the keys times 8 / KEY_WARPS along the head dimension for dK/dV, and along the
// query columns of S^T/dP^T; for dQ, BLOCK_M / 16 along the rows times the rest along head_dim):
//   head_dim 32, 64:  BLOCK_M 64, BLOCK_N 128   dK+dV registers/thread 2*D/2;   smem  77 / 109 KiB
//   head_dim 96, 128: BLOCK_M 64, BLOCK_N 64    dK+dV registers/thread 2*D/4;   smem  97 / 121 KiB
//   head_dim 256:     BLOCK_M 32, BLOCK_N 32    dK+dV registers/thread 2*64/2;  smem 105 KiB
// Why: dK and dV live in registers for the whole walk, so each warp keeps at most 16 keys x 64
// columns of each (64 registers for both); the warps that share 16 keys split the head dimension
// rather than duplicating rows.  The key block is as wide as that allows (fewer dQ atomics and
// fewer reloads of Q/dO per key); head_dim 256 halves BLOCK_M so that two Q and two dO stages plus
// K and V stay within the 163 KiB an sm_80 block may have.  Shared memory per block exceeds the
// 99 KiB of sm_86/sm_89 for head_dim 64, 128 and 256: the cuda backend declines there, saying so.
// flash_backward_dq: 64 rows (4 warps x 16) by 64 keys, 16 keys for head_dim 256 (its 16 x 256
// float32 dQ accumulator takes 128 registers a thread; 32 keys spilled on sm_90).
//
// Rows that see no key (lse = -inf) and padding keys (>= key_lengths) get exactly zero gradients:
// P is exactly 0 for them, dS is set to exactly 0 wherever P is 0 (so a NaN or inf in dO V^T at a
// hidden key does not leak in), K/V rows past key_lengths are zero-filled, and blocks no query can
// see still write their zero dK/dV.  Not done (as in the tensor-core forward): skipping the
// zero-weight products inside the mma tiles, so a NaN/inf in K, V, Q or dO at a hidden position of
// a loaded tile still reaches the rows of that tile (README "NaN and infinity").
#include "flash_common.cuh"

namespace fastattn_gpu {

constexpr int kBwdWarps = 8;       // flash_backward_kv
constexpr int kDqWarps = 4;        // flash_backward_dq: 16 query rows each
constexpr int kDqBlockM = 16 * kDqWarps;
constexpr int kPrepareThreads = 256;

// ---------------------------------------------------------------------------------------------
// 1. delta = rowsum(dO * O), lse in log2 units, and the cleared dQ accumulator.
template <typename Elem, int HEAD_DIM>
__global__ void __launch_bounds__(kPrepareThreads)
flash_backward_prepare(const Elem* __restrict__ dout, const Elem* __restrict__ out, const float* __restrict__ lse,
                       float* __restrict__ lse2, float* __restrict__ delta, float* __restrict__ dq_accum,
                       long long do_sb, long long do_sh, long long do_ss, long long o_sb, long long o_sh,
                       long long o_ss, long long lse_sb, long long lse_sh, long long lse_ss, int heads_q, int seq_q,
                       long long rows) {
    constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks per row, one per thread
    constexpr int kLanes = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;  // power of 2
    constexpr int kRowsPerBlock = kPrepareThreads / kLanes;
    const long long row = static_cast<long long>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
    const int chunk = threadIdx.x % kLanes;
    const bool valid_row = row < rows;
    const long long i = valid_row ? row % seq_q : 0, bh = valid_row ? row / seq_q : 0;
    const long long h = bh % heads_q, b = bh / heads_q;
    float sum = 0.f;
    if (valid_row && chunk < kChunks) {
        const uint4 d = *reinterpret_cast<const uint4*>(dout + b * do_sb + h * do_sh + i * do_ss + chunk * 8);
        const uint4 o = *reinterpret_cast<const uint4*>(out + b * o_sb + h * o_sh + i * o_ss + chunk * 8);
        const Elem* de = reinterpret_cast<const Elem*>(&d);
        const Elem* oe = reinterpret_cast<const Elem*>(&o);
#pragma unroll
        for (int e = 0; e < 8; ++e) sum += Convert<Elem>::to_float(de[e]) * Convert<Elem>::to_float(oe[e]);
        if (dq_accum) {
            float4* dst = reinterpret_cast<float4*>(dq_accum + row * HEAD_DIM + chunk * 8);
            dst[0] = make_float4(0.f, 0.f, 0.f, 0.f);
            dst[1] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
#pragma unroll
    for (int width = kLanes / 2; width > 0; width /= 2) sum += __shfl_xor_sync(0xffffffff, sum, width);
    if (valid_row && chunk == 0) {
        delta[row] = sum;
        const float value = lse[b * lse_sb + h * lse_sh + i * lse_ss];
        lse2[row] = value == negative_infinity() ? positive_infinity() : value * kLog2e;
    }
}

// ---------------------------------------------------------------------------------------------
// 2. dK, dV (and dQ through atomics) for one block of keys, over its kv head's GQA group.
template <typename Elem, int HEAD_DIM, int BLOCK_M, int KEY_WARPS, bool ATOMIC_DQ>
__global__ void __launch_bounds__(kBwdWarps * 32)
flash_backward_kv(const Elem* __restrict__ q, const Elem* __restrict__ k, const Elem* __restrict__ v,
                  const Elem* __restrict__ dout, const float* __restrict__ lse2, const float* __restrict__ delta,
                  float* __restrict__ dq_accum, Elem* __restrict__ dk, Elem* __restrict__ dv, long long q_sb,
                  long long q_sh, long long q_ss, long long k_sb, long long k_sh, long long k_ss, long long v_sb,
                  long long v_sh, long long v_ss, long long do_sb, long long do_sh, long long do_ss,
                  long long dk_sb, long long dk_sh, long long dk_ss, long long dv_sb, long long dv_sh,
                  long long dv_ss, int seq_q, int seq_k, int group, float scale, float softcap, int causal,
                  int offset, int window_left, int window_right, const void* __restrict__ mask, int mask_kind,
                  long long m_sb, long long m_sh, long long m_sq, long long m_sk,
                  const long long* __restrict__ key_lengths) {
    constexpr int kThreads = kBwdWarps * 32;
    constexpr int kDimWarps = kBwdWarps / KEY_WARPS;
    constexpr int kBlockN = 16 * KEY_WARPS;
    constexpr int kRow = HEAD_DIM + kPad;        // Q, dO, K, V tiles: [row][head_dim]
    constexpr int kProbRow = BLOCK_M + kPad;     // P^T, dS^T tiles: [key][query]
    constexpr int kSteps = HEAD_DIM / 16;        // k16 steps of S^T and dP^T
    constexpr int kQueryCols = BLOCK_M / kDimWarps;  // query columns of S^T per warp
    constexpr int kQueryBlocks = kQueryCols / 8;
    constexpr int kDimCols = HEAD_DIM / kDimWarps;   // dK/dV columns per warp
    constexpr int kDimBlocks = kDimCols / 8;
    constexpr int kRowGroups = BLOCK_M / 16;         // dQ: warps along the tile's rows ...
    constexpr int kDqCols = HEAD_DIM / (kBwdWarps / kRowGroups);  // ... and along head_dim
    static_assert(kBwdWarps % KEY_WARPS == 0 && kBwdWarps % kRowGroups == 0, "warp split");
    static_assert(kSteps % 2 == 0 && kQueryCols % 8 == 0, "S^T tiles");
    static_assert(kDimCols % 16 == 0 && kDqCols % 16 == 0, "pairs of n8 blocks per ldmatrix.x4.trans");

    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Elem* k_tile = reinterpret_cast<Elem*>(shared_bytes);  // [kBlockN][kRow]
    Elem* v_tile = k_tile + kBlockN * kRow;                // [kBlockN][kRow]
    Elem* q_tiles = v_tile + kBlockN * kRow;               // [2][BLOCK_M][kRow]
    Elem* do_tiles = q_tiles + 2 * BLOCK_M * kRow;         // [2][BLOCK_M][kRow]
    Elem* p_tile = do_tiles + 2 * BLOCK_M * kRow;          // [kBlockN][kProbRow]: P^T
    Elem* ds_tile = p_tile + kBlockN * kProbRow;           // [kBlockN][kProbRow]: dS^T
    float* lse_tiles = reinterpret_cast<float*>(ds_tile + kBlockN * kProbRow);  // [2][BLOCK_M]
    float* delta_tiles = lse_tiles + 2 * BLOCK_M;                               // [2][BLOCK_M]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int key_warp = warp / kDimWarps, dim_warp = warp % kDimWarps;
    const int n0 = blockIdx.x * kBlockN, kvh = blockIdx.y, b = blockIdx.z;
    const int heads_q = gridDim.y * group;
    const ScoreRule rule{{causal, offset, window_left, window_right, mask, mask_kind, m_sb, m_sh, m_sq, m_sk,
                          key_lengths},
                         seq_q, scale, softcap};
    const int key_end = rule.key_end(b, seq_k);

    // Query tiles of each head that can see a key of this block; items = (head of the group, tile).
    int m_lo = 0, m_hi = 0;
    if (n0 < key_end) rule.query_range(n0, min(n0 + kBlockN, key_end) - 1, &m_lo, &m_hi);
    m_lo = max(m_lo, 0) / BLOCK_M * BLOCK_M;
    const int tiles = m_hi > m_lo ? (m_hi - m_lo + BLOCK_M - 1) / BLOCK_M : 0;
    const int items = tiles * group;

    auto load_item = [&](int item, int stage) {
        const int h = kvh * group + item / tiles, m0 = m_lo + (item % tiles) * BLOCK_M;
        load_tile<Elem, HEAD_DIM, BLOCK_M, kThreads>(q_tiles + stage * BLOCK_M * kRow, q + b * q_sb + h * q_sh,
                                                     q_ss, m0, seq_q);
        load_tile<Elem, HEAD_DIM, BLOCK_M, kThreads>(do_tiles + stage * BLOCK_M * kRow,
                                                     dout + b * do_sb + h * do_sh, do_ss, m0, seq_q);
        if (threadIdx.x < BLOCK_M) {
            const int row = m0 + threadIdx.x;
            const bool valid = row < seq_q;
            const long long element = (static_cast<long long>(b) * heads_q + h) * seq_q + (valid ? row : 0);
            cp_async_4(lse_tiles + stage * BLOCK_M + threadIdx.x, lse2 + element, valid);
            cp_async_4(delta_tiles + stage * BLOCK_M + threadIdx.x, delta + element, valid);
        }
    };

    if (items > 0) {
        load_tile<Elem, HEAD_DIM, kBlockN, kThreads>(k_tile, k + b * k_sb + kvh * k_sh, k_ss, n0, key_end);
        load_tile<Elem, HEAD_DIM, kBlockN, kThreads>(v_tile, v + b * v_sb + kvh * v_sh, v_ss, n0, key_end);
        load_item(0, 0);
    }
    cp_async_commit();

    const int group_id = lane / 4, pair = (lane % 4) * 2;
    const int key_row = key_warp * 16;                 // this warp's keys within the block
    const int q0 = dim_warp * kQueryCols;              // its query columns of S^T
    const int c0 = dim_warp * kDimCols;                // its columns of dK, dV
    float dk_acc[kDimBlocks][4], dv_acc[kDimBlocks][4];
#pragma unroll
    for (int nb = 0; nb < kDimBlocks; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[nb][e] = dv_acc[nb][e] = 0.f;
    }

    int stage = 0;
    for (int item = 0; item < items; ++item, stage ^= 1) {
        if (item + 1 < items) load_item(item + 1, stage ^ 1);  // prefetch into the other stage
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const int h = kvh * group + item / tiles, m0 = m_lo + (item % tiles) * BLOCK_M;
        const Elem* q_tile = q_tiles + stage * BLOCK_M * kRow;
        const Elem* do_tile = do_tiles + stage * BLOCK_M * kRow;
        const float* lse_tile = lse_tiles + stage * BLOCK_M;
        const float* delta_tile = delta_tiles + stage * BLOCK_M;

        // S^T = K Q^T and dP^T = V dO^T: 16 keys x kQueryCols queries per warp.
        float s[kQueryBlocks][4], dp[kQueryBlocks][4];
#pragma unroll
        for (int nb = 0; nb < kQueryBlocks; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] = dp[nb][e] = 0.f;
        }
#pragma unroll
        for (int step = 0; step < kSteps; step += 2) {
            unsigned int a_k[2][4], a_v[2][4];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int column = (step + half) * 16 + (lane >> 4) * 8;
                ldmatrix_x4(a_k[half], k_tile + (key_row + (lane & 15)) * kRow + column);
                ldmatrix_x4(a_v[half], v_tile + (key_row + (lane & 15)) * kRow + column);
            }
#pragma unroll
            for (int nb = 0; nb < kQueryBlocks; ++nb) {
                const int offset_in_tile = (q0 + nb * 8 + (lane & 7)) * kRow + step * 16 + (lane >> 3) * 8;
                unsigned int b_q[4], b_o[4];  // k-steps `step` ([0..1]) and `step + 1` ([2..3])
                ldmatrix_x4(b_q, q_tile + offset_in_tile);
                Pack<Elem>::mma(s[nb], a_k[0], b_q);
                Pack<Elem>::mma(s[nb], a_k[1], b_q + 2);
                ldmatrix_x4(b_o, do_tile + offset_in_tile);
                Pack<Elem>::mma(dp[nb], a_v[0], b_o);
                Pack<Elem>::mma(dp[nb], a_v[1], b_o + 2);
            }
        }

        // P^T and dS^T, exactly the forward's scores and masks; into shared memory, key-major.
#pragma unroll
        for (int nb = 0; nb < kQueryBlocks; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int column = q0 + nb * 8 + pair + (e % 2);
                float slope;
                const float score = rule.log2_score(s[nb][e], b, h, m0 + column,
                                                    n0 + key_row + group_id + (e / 2) * 8, key_end, &slope);
                const float prob = exp2f(score - lse_tile[column]);
                s[nb][e] = prob;
                dp[nb][e] = prob != 0.f ? prob * (dp[nb][e] - delta_tile[column]) * slope * scale : 0.f;
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int at = (key_row + group_id + r * 8) * kProbRow + q0 + nb * 8 + pair;
                *reinterpret_cast<unsigned int*>(p_tile + at) = Pack<Elem>::two(s[nb][2 * r], s[nb][2 * r + 1]);
                *reinterpret_cast<unsigned int*>(ds_tile + at) = Pack<Elem>::two(dp[nb][2 * r], dp[nb][2 * r + 1]);
            }
        }
        __syncthreads();

        // dV += P^T dO and dK += dS^T Q: 16 keys x kDimCols columns per warp, k = the tile's queries.
#pragma unroll
        for (int ks = 0; ks < BLOCK_M / 16; ++ks) {
            unsigned int a_p[4], a_ds[4];
            const int a_offset = (key_row + (lane & 15)) * kProbRow + ks * 16 + (lane >> 4) * 8;
            ldmatrix_x4(a_p, p_tile + a_offset);
            ldmatrix_x4(a_ds, ds_tile + a_offset);
#pragma unroll
            for (int nb = 0; nb < kDimBlocks; nb += 2) {
                const int b_offset = (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kRow + c0 + nb * 8 + (lane >> 4) * 8;
                unsigned int b_o[4], b_q[4];  // n-blocks nb ([0..1]) and nb + 1 ([2..3])
                ldmatrix_x4_trans(b_o, do_tile + b_offset);
                Pack<Elem>::mma(dv_acc[nb], a_p, b_o);
                Pack<Elem>::mma(dv_acc[nb + 1], a_p, b_o + 2);
                ldmatrix_x4_trans(b_q, q_tile + b_offset);
                Pack<Elem>::mma(dk_acc[nb], a_ds, b_q);
                Pack<Elem>::mma(dk_acc[nb + 1], a_ds, b_q + 2);
            }
        }

        // dQ += dS K, A = dS read from the key-major dS^T with ldmatrix.trans; float32 atomics.
        if constexpr (ATOMIC_DQ) {
            const int r0 = (warp % kRowGroups) * 16, d0 = (warp / kRowGroups) * kDqCols;
            float dq[kDqCols / 8][4];
#pragma unroll
            for (int nb = 0; nb < kDqCols / 8; ++nb) dq[nb][0] = dq[nb][1] = dq[nb][2] = dq[nb][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < kBlockN / 16; ++ks) {
                unsigned int a_ds[4];
                ldmatrix_x4_trans(a_ds, ds_tile + (ks * 16 + (lane & 7) + ((lane >> 4) & 1) * 8) * kProbRow + r0 +
                                            ((lane >> 3) & 1) * 8);
#pragma unroll
                for (int nb = 0; nb < kDqCols / 8; nb += 2) {
                    unsigned int b_k[4];
                    ldmatrix_x4_trans(b_k, k_tile + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kRow + d0 +
                                               nb * 8 + (lane >> 4) * 8);
                    Pack<Elem>::mma(dq[nb], a_ds, b_k);
                    Pack<Elem>::mma(dq[nb + 1], a_ds, b_k + 2);
                }
            }
            float* dq_head = dq_accum + (static_cast<long long>(b) * heads_q + h) * seq_q * HEAD_DIM;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = m0 + r0 + group_id + r * 8;
                if (row >= seq_q) continue;
#pragma unroll
                for (int nb = 0; nb < kDqCols / 8; ++nb) {
                    float* dst = dq_head + static_cast<long long>(row) * HEAD_DIM + d0 + nb * 8 + pair;
                    atomicAdd(dst, dq[nb][2 * r]);
                    atomicAdd(dst + 1, dq[nb][2 * r + 1]);
                }
            }
        }
        __syncthreads();  // P^T, dS^T and this stage are overwritten next
    }
    cp_async_wait<0>();

    // dK, dV once, in the input dtype; zero for keys no query saw.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = n0 + key_row + group_id + r * 8;
        if (key >= seq_k) continue;
        Elem* dk_row = dk + b * dk_sb + kvh * dk_sh + key * dk_ss + c0 + pair;
        Elem* dv_row = dv + b * dv_sb + kvh * dv_sh + key * dv_ss + c0 + pair;
#pragma unroll
        for (int nb = 0; nb < kDimBlocks; ++nb) {
            *reinterpret_cast<unsigned int*>(dk_row + nb * 8) = Pack<Elem>::two(dk_acc[nb][2 * r], dk_acc[nb][2 * r + 1]);
            *reinterpret_cast<unsigned int*>(dv_row + nb * 8) = Pack<Elem>::two(dv_acc[nb][2 * r], dv_acc[nb][2 * r + 1]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3a. dQ from the float32 accumulator into the input dtype, 8 elements per thread.
template <typename Elem>
__global__ void flash_backward_dq_convert(const float* __restrict__ dq_accum, Elem* __restrict__ dq, long long dq_sb,
                                          long long dq_sh, long long dq_ss, int heads_q, int seq_q, int head_dim,
                                          long long chunks) {
    const long long chunk = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (chunk >= chunks) return;
    const long long element = chunk * 8, row = element / head_dim, col = element % head_dim;
    const long long i = row % seq_q, h = (row / seq_q) % heads_q, b = row / seq_q / heads_q;
    const float4 lo = reinterpret_cast<const float4*>(dq_accum + element)[0];
    const float4 hi = reinterpret_cast<const float4*>(dq_accum + element)[1];
    uint4 packed;
    packed.x = Pack<Elem>::two(lo.x, lo.y);
    packed.y = Pack<Elem>::two(lo.z, lo.w);
    packed.z = Pack<Elem>::two(hi.x, hi.y);
    packed.w = Pack<Elem>::two(hi.z, hi.w);
    *reinterpret_cast<uint4*>(dq + b * dq_sb + h * dq_sh + i * dq_ss + col) = packed;
}

// 3b. Deterministic dQ: one block per (64 query rows, query head, batch row), no atomics.
template <typename Elem, int HEAD_DIM, int BLOCK_N>
__global__ void __launch_bounds__(kDqWarps * 32)
flash_backward_dq(const Elem* __restrict__ q, const Elem* __restrict__ k, const Elem* __restrict__ v,
                  const Elem* __restrict__ dout, const float* __restrict__ lse2, const float* __restrict__ delta,
                  Elem* __restrict__ dq, long long q_sb, long long q_sh, long long q_ss, long long k_sb,
                  long long k_sh, long long k_ss, long long v_sb, long long v_sh, long long v_ss, long long do_sb,
                  long long do_sh, long long do_ss, long long dq_sb, long long dq_sh, long long dq_ss, int seq_q,
                  int seq_k, int group, float scale, float softcap, int causal, int offset, int window_left,
                  int window_right, const void* __restrict__ mask, int mask_kind, long long m_sb, long long m_sh,
                  long long m_sq, long long m_sk, const long long* __restrict__ key_lengths) {
    constexpr int kThreads = kDqWarps * 32;
    constexpr int kRow = HEAD_DIM + kPad;
    constexpr int kSteps = HEAD_DIM / 16;
    constexpr int kKeyBlocks = BLOCK_N / 8;
    constexpr int kOutBlocks = HEAD_DIM / 8;
    static_assert(kSteps % 2 == 0 && kKeyBlocks % 2 == 0 && kOutBlocks % 2 == 0, "tile shapes");
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Elem* q_tile = reinterpret_cast<Elem*>(shared_bytes);  // [kDqBlockM][kRow]
    Elem* do_tile = q_tile + kDqBlockM * kRow;             // [kDqBlockM][kRow]
    Elem* k_tiles = do_tile + kDqBlockM * kRow;            // [2][BLOCK_N][kRow]
    Elem* v_tiles = k_tiles + 2 * BLOCK_N * kRow;          // [2][BLOCK_N][kRow]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int m0 = blockIdx.x * kDqBlockM, h = blockIdx.y, b = blockIdx.z, kvh = h / group;
    const Elem* k_base = k + b * k_sb + kvh * k_sh;
    const Elem* v_base = v + b * v_sb + kvh * v_sh;
    const ScoreRule rule{{causal, offset, window_left, window_right, mask, mask_kind, m_sb, m_sh, m_sq, m_sk,
                          key_lengths},
                         seq_q, scale, softcap};
    int lo, hi;
    rule.rules.key_range(b, seq_k, m0, min(m0 + kDqBlockM, seq_q) - 1, &lo, &hi);
    lo = max(lo, 0) / BLOCK_N * BLOCK_N;

    load_tile<Elem, HEAD_DIM, kDqBlockM, kThreads>(q_tile, q + b * q_sb + h * q_sh, q_ss, m0, seq_q);
    load_tile<Elem, HEAD_DIM, kDqBlockM, kThreads>(do_tile, dout + b * do_sb + h * do_sh, do_ss, m0, seq_q);
    if (lo < hi) load_tile<Elem, HEAD_DIM, BLOCK_N, kThreads>(k_tiles, k_base, k_ss, lo, hi);
    if (lo < hi) load_tile<Elem, HEAD_DIM, BLOCK_N, kThreads>(v_tiles, v_base, v_ss, lo, hi);
    cp_async_commit();

    const int group_id = lane / 4, pair = (lane % 4) * 2;
    const int rows[2] = {m0 + warp * 16 + group_id, m0 + warp * 16 + group_id + 8};
    float row_lse2[2], row_delta[2];
    const long long head_rows = (static_cast<long long>(b) * gridDim.y + h) * seq_q;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_lse2[r] = rows[r] < seq_q ? lse2[head_rows + rows[r]] : 0.f;  // rows past the end: P = 0
        row_delta[r] = rows[r] < seq_q ? delta[head_rows + rows[r]] : 0.f;
    }
    float acc[kOutBlocks][4];
#pragma unroll
    for (int nb = 0; nb < kOutBlocks; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;

    int stage = 0;
    for (int kt = lo; kt < hi; kt += BLOCK_N, stage ^= 1) {
        if (kt + BLOCK_N < hi) {
            load_tile<Elem, HEAD_DIM, BLOCK_N, kThreads>(k_tiles + (stage ^ 1) * BLOCK_N * kRow, k_base, k_ss,
                                                         kt + BLOCK_N, hi);
            load_tile<Elem, HEAD_DIM, BLOCK_N, kThreads>(v_tiles + (stage ^ 1) * BLOCK_N * kRow, v_base, v_ss,
                                                         kt + BLOCK_N, hi);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const Elem* k_tile = k_tiles + stage * BLOCK_N * kRow;
        const Elem* v_tile = v_tiles + stage * BLOCK_N * kRow;

        // S = Q K^T and dP = dO V^T for this warp's 16 rows.
        float s[kKeyBlocks][4], dp[kKeyBlocks][4];
#pragma unroll
        for (int nb = 0; nb < kKeyBlocks; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nb][e] = dp[nb][e] = 0.f;
        }
        // One operand pair at a time (Q with K, then dO with V): fewer fragments live at once,
        // which keeps head_dim 256 within the register file.
#pragma unroll
        for (int step = 0; step < kSteps; step += 2) {
#pragma unroll
            for (int product = 0; product < 2; ++product) {
                const Elem* a_tile = product == 0 ? q_tile : do_tile;
                const Elem* b_tile = product == 0 ? k_tile : v_tile;
                float(*c)[4] = product == 0 ? s : dp;
                unsigned int a[2][4];
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    ldmatrix_x4(a[half], a_tile + (warp * 16 + (lane & 15)) * kRow + (step + half) * 16 + (lane >> 4) * 8);
#pragma unroll
                for (int nb = 0; nb < kKeyBlocks; ++nb) {
                    unsigned int b_frag[4];  // k-steps `step` ([0..1]) and `step + 1` ([2..3])
                    ldmatrix_x4(b_frag, b_tile + (nb * 8 + (lane & 7)) * kRow + step * 16 + (lane >> 3) * 8);
                    Pack<Elem>::mma(c[nb], a[0], b_frag);
                    Pack<Elem>::mma(c[nb], a[1], b_frag + 2);
                }
            }
        }

        // dS = P (dP - delta) softcap' scale, re-packed as the A fragments of dS K.
        unsigned int a_ds[kKeyBlocks / 2][4];
#pragma unroll
        for (int nb = 0; nb < kKeyBlocks; ++nb) {
            float grad[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float slope;
                const float score = rule.log2_score(s[nb][e], b, h, rows[e / 2], kt + nb * 8 + pair + (e % 2), hi,
                                                    &slope);
                const float prob = exp2f(score - row_lse2[e / 2]);
                grad[e] = prob != 0.f ? prob * (dp[nb][e] - row_delta[e / 2]) * slope * scale : 0.f;
            }
            a_ds[nb / 2][(nb % 2) * 2 + 0] = Pack<Elem>::two(grad[0], grad[1]);
            a_ds[nb / 2][(nb % 2) * 2 + 1] = Pack<Elem>::two(grad[2], grad[3]);
        }

        // dQ += dS K: k = keys, n = head_dim (two 8-column blocks per ldmatrix.x4.trans).
#pragma unroll
        for (int ks = 0; ks < kKeyBlocks / 2; ++ks) {
#pragma unroll
            for (int nb = 0; nb < kOutBlocks; nb += 2) {
                unsigned int b_k[4];
                ldmatrix_x4_trans(b_k, k_tile + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kRow + nb * 8 +
                                           (lane >> 4) * 8);
                Pack<Elem>::mma(acc[nb], a_ds[ks], b_k);
                Pack<Elem>::mma(acc[nb + 1], a_ds[ks], b_k + 2);
            }
        }
        __syncthreads();  // this stage is overwritten by the prefetch of the tile after next
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= seq_q) continue;
        Elem* dst = dq + b * dq_sb + h * dq_sh + rows[r] * dq_ss + pair;
#pragma unroll
        for (int nb = 0; nb < kOutBlocks; ++nb)
            *reinterpret_cast<unsigned int*>(dst + nb * 8) = Pack<Elem>::two(acc[nb][2 * r], acc[nb][2 * r + 1]);
    }
}

}  // namespace fastattn_gpu

#ifdef FASTATTN_INSTANTIATE
// nvcc compile check (CI): instantiate every configuration the launcher can request
// (fastattn/_gpu/backward.py: backward_tiles and dq_block_keys).
#define FASTATTN_PREPARE(ELEM, D) template __global__ void fastattn_gpu::flash_backward_prepare<ELEM, D>( \
    const ELEM*, const ELEM*, const float*, float*, float*, float*, long long, long long, long long, long long, \
    long long, long long, long long, long long, long long, int, int, long long);
#define FASTATTN_KV(ELEM, D, M, KW, ATOMIC) template __global__ void \
    fastattn_gpu::flash_backward_kv<ELEM, D, M, KW, ATOMIC>( \
    const ELEM*, const ELEM*, const ELEM*, const ELEM*, const float*, const float*, float*, ELEM*, ELEM*, \
    long long, long long, long long, long long, long long, long long, long long, long long, long long, long long, \
    long long, long long, long long, long long, long long, long long, long long, long long, int, int, int, float, \
    float, int, int, int, int, const void*, int, long long, long long, long long, long long, const long long*);
#define FASTATTN_DQ(ELEM, D, N) template __global__ void fastattn_gpu::flash_backward_dq<ELEM, D, N>( \
    const ELEM*, const ELEM*, const ELEM*, const ELEM*, const float*, const float*, ELEM*, long long, long long, \
    long long, long long, long long, long long, long long, long long, long long, long long, long long, long long, \
    long long, long long, long long, int, int, int, float, float, int, int, int, int, const void*, int, long long, \
    long long, long long, long long, const long long*);
#define FASTATTN_CONFIG(ELEM, D, M, KW, N) FASTATTN_PREPARE(ELEM, D) FASTATTN_KV(ELEM, D, M, KW, true) \
    FASTATTN_KV(ELEM, D, M, KW, false) FASTATTN_DQ(ELEM, D, N)
#define FASTATTN_CONFIGS(ELEM) FASTATTN_CONFIG(ELEM, 32, 64, 8, 64) FASTATTN_CONFIG(ELEM, 64, 64, 8, 64) \
    FASTATTN_CONFIG(ELEM, 96, 64, 4, 64) FASTATTN_CONFIG(ELEM, 128, 64, 4, 64) FASTATTN_CONFIG(ELEM, 256, 32, 2, 16) \
    template __global__ void fastattn_gpu::flash_backward_dq_convert<ELEM>( \
        const float*, ELEM*, long long, long long, long long, int, int, int, long long);
FASTATTN_CONFIGS(__half)
FASTATTN_CONFIGS(__nv_bfloat16)
#endif
