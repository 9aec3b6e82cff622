// Flash attention backward for NVIDIA tensor cores (sm_80+), float16 / bfloat16 in, float32 math.
//
// STATUS: compiled by nvcc for sm_80 and sm_90 (CI's check instantiates every configuration of the
// kernel table, fastattn/_gpu/ops.py) and passes the conformance suite in the SIMT emulator.  It has
// NOT yet run on a GPU (benchmarks/gpu_check.sh owes the runs: tests, compute-sanitizer, benchmark).
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
// float32 dQ accumulator takes 128 registers a thread; 32 keys spilled on sm_90), 32 for head_dim 96
// (64 spilled with softcap and dropout).  flash_backward_kv is bounded to one block of 8 warps per
// SM (__launch_bounds__(256, 1)): left to itself ptxas capped head_dim 96 and 256 at 128 registers
// and spilled.
//
// Masking is specialised at compile time, as in the forward (issue #21): softcap is a template
// option, and the tiles every row sees whole (flash_backward_dq: key tiles, as the forward's;
// flash_backward_kv: each head's query tiles whose rows all see every key of the block) run
// without the contract's per-score rule, the scale folded into the exponent's FFMA
// (prob_and_grad).  The DROPOUT instances keep one masked loop: their Philox state leaves no
// registers for a second loop body (it spilled).
//
// Dropout (the DROPOUT instances): Z = the forward's multipliers (0 or 1 / (1 - p), regenerated from
// the same Philox counters); P^T Z goes into dV and dS = P (dP Z - delta) [softcap'] scale, with
// delta = rowsum(dO * O) of the dropped output, as in the CPU backward.
//
// Rows that see no key (lse = -inf) and padding keys (>= key_lengths) get exactly zero gradients:
// P is exactly 0 for them, dS is set to exactly 0 wherever P is 0 (so a NaN or inf in dO V^T at a
// hidden key does not leak in), K/V rows past key_lengths are zero-filled, and blocks no query can
// see still write their zero dK/dV.  Not done (as in the tensor-core forward): skipping the
// zero-weight products inside the mma tiles, so a NaN/inf in K, V, Q or dO at a hidden position of
// a loaded tile still reaches the rows of that tile (README "NaN and infinity").
#include "mma_tiles.cuh"

namespace fastattn_gpu {

constexpr int kBwdWarps = 8;       // flash_backward_kv
constexpr int kDqWarps = 4;        // flash_backward_dq: 16 query rows each
constexpr int kDqBlockM = 16 * kDqWarps;
constexpr int kPrepareThreads = 256;

// P and dS of one score of a backward tile, from its dot product q.k, dP = dO.v, the row's lse2 and
// delta, and the dropout multiplier.  MASKED: the contract's exact rule (key `key` of row `row`,
// head h); else the tile is interior (every row sees every key) and needs only the scale, folded
// into the exponent's FFMA unless SOFTCAP.  Either way P is exactly 0 where hidden or underflowed,
// and so is dS (score_grad), whatever dP holds.
template <bool MASKED, bool SOFTCAP>
__device__ __forceinline__ void prob_and_grad(const ScoreRule& rule, float dot, float dp, int b, int h, int row,
                                              int key, int key_end, float lse2, float delta, float factor, float* prob,
                                              float* grad) {
    float slope = 1.f;
    if constexpr (MASKED)
        *prob = fast_exp2(rule.template log2_score<SOFTCAP>(dot, b, h, row, key, key_end, &slope) - lse2);
    else if constexpr (SOFTCAP)
        *prob = fast_exp2(rule.softcapped_log2_score(dot, &slope) - lse2);
    else
        *prob = fast_exp2(fmaf(dot, rule.scale_log2, -lse2));
    *grad = score_grad(*prob, dp, delta, factor, slope, rule.p.scale);
}

// ---------------------------------------------------------------------------------------------
// 1. delta = rowsum(dO * O), lse in log2 units, and the cleared dQ accumulator.
template <typename Elem, int HEAD_DIM>
__global__ void __launch_bounds__(kPrepareThreads) flash_backward_prepare(const __grid_constant__ Params p) {
    constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks per row, one per thread
    constexpr int kLanes = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;  // power of 2
    constexpr int kRowsPerBlock = kPrepareThreads / kLanes;
    const long long row = static_cast<long long>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
    const int chunk = threadIdx.x % kLanes;
    const bool valid_row = row < p.rows;
    const long long i = valid_row ? row % p.seq_q : 0, bh = valid_row ? row / p.seq_q : 0;
    const long long h = bh % p.heads_q, b = bh / p.heads_q;
    float sum = 0.f;
    if (valid_row && chunk < kChunks) {
        const uint4 d = *reinterpret_cast<const uint4*>(p.dout.row<const Elem>(b, h, i) + chunk * 8);
        const uint4 o = *reinterpret_cast<const uint4*>(p.out.row<const Elem>(b, h, i) + chunk * 8);
        const Elem* de = reinterpret_cast<const Elem*>(&d);
        const Elem* oe = reinterpret_cast<const Elem*>(&o);
#pragma unroll
        for (int e = 0; e < 8; ++e) sum += Convert<Elem>::to_float(de[e]) * Convert<Elem>::to_float(oe[e]);
        if (p.dq_accum) {
            float4* dst = reinterpret_cast<float4*>(p.dq_accum + row * HEAD_DIM + chunk * 8);
            dst[0] = make_float4(0.f, 0.f, 0.f, 0.f);
            dst[1] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
#pragma unroll
    for (int width = kLanes / 2; width > 0; width /= 2) sum += __shfl_xor_sync(0xffffffff, sum, width);
    if (valid_row && chunk == 0) {
        p.delta[row] = sum;
        const float value = *p.lse.row<const float>(b, h, i);
        p.lse2[row] = value == negative_infinity() ? positive_infinity() : value * kLog2e;
    }
}

// ---------------------------------------------------------------------------------------------
// 2. dK, dV (and dQ through atomics) for one block of keys, over its kv head's GQA group.
template <typename Elem, int HEAD_DIM, int BLOCK_M, int KEY_WARPS, bool ATOMIC_DQ, bool SOFTCAP, bool DROPOUT>
__global__ void __launch_bounds__(kBwdWarps * 32, 1) flash_backward_kv(const __grid_constant__ Params p) {
    constexpr int kThreads = kBwdWarps * 32;
    constexpr int kDimWarps = kBwdWarps / KEY_WARPS;
    constexpr int kBlockN = 16 * KEY_WARPS;
    constexpr int kRow = HEAD_DIM + kPad;        // Q, dO, K, V tiles: [row][head_dim]
    constexpr int kProbRow = BLOCK_M + kPad;     // P^T, dS^T tiles: [key][query]
    constexpr int kQueryCols = BLOCK_M / kDimWarps;  // query columns of S^T per warp
    constexpr int kQueryBlocks = kQueryCols / 8;
    constexpr int kDimCols = HEAD_DIM / kDimWarps;   // dK/dV columns per warp
    constexpr int kDimBlocks = kDimCols / 8;
    constexpr int kRowGroups = BLOCK_M / 16;         // dQ: warps along the tile's rows ...
    constexpr int kDqCols = HEAD_DIM / (kBwdWarps / kRowGroups);  // ... and along head_dim
    static_assert(kBwdWarps % KEY_WARPS == 0 && kBwdWarps % kRowGroups == 0, "warp split");
    static_assert(kQueryCols % 8 == 0, "S^T tiles");

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
    const int group = p.group, seq_q = p.seq_q;
    const ScoreRule rule{p};
    const int key_end = p.rules.key_end(b, p.seq_k);

    // Query tiles of each head that can see a key of this block; items = (head of the group, tile).
    int m_lo = 0, m_hi = 0;
    if (n0 < key_end) p.rules.query_range(seq_q, n0, min(n0 + kBlockN, key_end) - 1, &m_lo, &m_hi);
    m_lo = max(m_lo, 0) / BLOCK_M * BLOCK_M;
    const int tiles = m_hi > m_lo ? (m_hi - m_lo + BLOCK_M - 1) / BLOCK_M : 0;
    const int items = tiles * group;
    int interior_lo, interior_hi;  // each head's query tiles that see every key of the block whole
    rule.template interior_query_tiles<BLOCK_M>(n0, n0 + kBlockN - 1, key_end, m_lo, tiles, &interior_lo,
                                                &interior_hi);

    auto load_item = [&](int item, int stage) {
        const int h = kvh * group + item / tiles, m0 = m_lo + (item % tiles) * BLOCK_M;
        load_tile<Elem, HEAD_DIM, BLOCK_M, kThreads>(q_tiles + stage * BLOCK_M * kRow, p.q.row<const Elem>(b, h, 0),
                                                     p.q.ss, m0, seq_q);
        load_tile<Elem, HEAD_DIM, BLOCK_M, kThreads>(do_tiles + stage * BLOCK_M * kRow,
                                                     p.dout.row<const Elem>(b, h, 0), p.dout.ss, m0, seq_q);
        if (threadIdx.x < BLOCK_M) {
            const int row = m0 + threadIdx.x;
            const bool valid = row < seq_q;
            const long long element = (static_cast<long long>(b) * p.heads_q + h) * seq_q + (valid ? row : 0);
            cp_async_4(lse_tiles + stage * BLOCK_M + threadIdx.x, p.lse2 + element, valid);
            cp_async_4(delta_tiles + stage * BLOCK_M + threadIdx.x, p.delta + element, valid);
        }
    };

    if (items > 0) {
        load_tile<Elem, HEAD_DIM, kBlockN, kThreads>(k_tile, p.k.row<const Elem>(b, kvh, 0), p.k.ss, n0, key_end);
        load_tile<Elem, HEAD_DIM, kBlockN, kThreads>(v_tile, p.v.row<const Elem>(b, kvh, 0), p.v.ss, n0, key_end);
        load_item(0, 0);
    }
    cp_async_commit();

    const int group_id = lane / 4, pair = (lane % 4) * 2;
    const int key_row = key_warp * 16;                 // this warp's keys within the block
    const int q0 = dim_warp * kQueryCols;              // its query columns of S^T
    const int c0 = dim_warp * kDimCols;                // its columns of dK, dV
    float dk_acc[kDimBlocks][4], dv_acc[kDimBlocks][4];
    zero(dk_acc);
    zero(dv_acc);

    // One item (query tile of one head); MASKED as in prob_and_grad.
    auto step = [&](auto masked, int item, int stage) {
        constexpr bool MASKED = decltype(masked)::value;
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
        zero(s);
        zero(dp);
        warp_product_nt<Elem, HEAD_DIM, kQueryBlocks>(s, k_tile + key_row * kRow, q_tile + q0 * kRow, kRow, lane);
        warp_product_nt<Elem, HEAD_DIM, kQueryBlocks>(dp, v_tile + key_row * kRow, do_tile + q0 * kRow, kRow, lane);

        // P^T (times the dropout multipliers) and dS^T, exactly the forward's scores and masks;
        // into shared memory, key-major.
#pragma unroll
        for (int nb = 0; nb < kQueryBlocks; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int column = q0 + nb * 8 + pair + (e % 2), key = n0 + key_row + group_id + (e / 2) * 8;
                const float factor = DROPOUT ? p.dropout.factor(b, p.heads_q, h, m0 + column, key) : 1.f;
                float prob;
                prob_and_grad<MASKED, SOFTCAP>(rule, s[nb][e], dp[nb][e], b, h, m0 + column, key, key_end,
                                               lse_tile[column], delta_tile[column], factor, &prob, &dp[nb][e]);
                s[nb][e] = prob * factor;
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
            const int a_at = key_row * kProbRow + a_offset(lane, kProbRow) + ks * 16;
            ldmatrix_x4(a_p, shared_address(p_tile + a_at));
            ldmatrix_x4(a_ds, shared_address(ds_tile + a_at));
            const int b_at = ks * 16 * kRow + c0 + bt_offset(lane, kRow);
            warp_product_step<Elem, kDimBlocks>(dv_acc, a_p, shared_address(do_tile + b_at));
            warp_product_step<Elem, kDimBlocks>(dk_acc, a_ds, shared_address(q_tile + b_at));
        }

        // dQ += dS K, A = dS read from the key-major dS^T with ldmatrix.trans; float32 atomics.
        if constexpr (ATOMIC_DQ) {
            const int r0 = (warp % kRowGroups) * 16, d0 = (warp / kRowGroups) * kDqCols;
            float dq[kDqCols / 8][4];
            zero(dq);
#pragma unroll
            for (int ks = 0; ks < kBlockN / 16; ++ks) {
                unsigned int a_ds[4];
                ldmatrix_x4_trans(a_ds, shared_address(ds_tile + ks * 16 * kProbRow + r0 + at_offset(lane, kProbRow)));
                warp_product_step<Elem, kDqCols / 8>(dq, a_ds,
                                                     shared_address(k_tile + ks * 16 * kRow + d0 + bt_offset(lane, kRow)));
            }
            float* dq_head = p.dq_accum + (static_cast<long long>(b) * p.heads_q + h) * seq_q * HEAD_DIM;
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
    };

    // Per head: edge tiles (window end), interior tiles, edge tiles (diagonal, sequence end).
    int item = 0, stage = 0;
    if constexpr (DROPOUT) {
        for (; item < items; ++item, stage ^= 1) step(Flag<true>{}, item, stage);
    } else {
        for (int g = 0; g < group; ++g) {
            const int first = g * tiles;
            for (; item < first + interior_lo; ++item, stage ^= 1) step(Flag<true>{}, item, stage);
            for (; item < first + interior_hi; ++item, stage ^= 1) step(Flag<false>{}, item, stage);
            for (; item < first + tiles; ++item, stage ^= 1) step(Flag<true>{}, item, stage);
        }
    }
    cp_async_wait<0>();

    // dK, dV once, in the input dtype; zero for keys no query saw.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = n0 + key_row + group_id + r * 8;
        if (key >= p.seq_k) continue;
        store_row_pairs<Elem, kDimBlocks>(p.dk.row<Elem>(b, kvh, key) + c0, dk_acc, r, 1.f, lane);
        store_row_pairs<Elem, kDimBlocks>(p.dv.row<Elem>(b, kvh, key) + c0, dv_acc, r, 1.f, lane);
    }
}

// ---------------------------------------------------------------------------------------------
// 3a. dQ from the float32 accumulator into the input dtype, 8 elements per thread.
template <typename Elem> __global__ void flash_backward_dq_convert(const __grid_constant__ Params p) {
    const long long chunk = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (chunk >= p.rows * p.head_dim / 8) return;
    const long long element = chunk * 8, row = element / p.head_dim, col = element % p.head_dim;
    const long long i = row % p.seq_q, h = (row / p.seq_q) % p.heads_q, b = row / p.seq_q / p.heads_q;
    const float4 lo = reinterpret_cast<const float4*>(p.dq_accum + element)[0];
    const float4 hi = reinterpret_cast<const float4*>(p.dq_accum + element)[1];
    uint4 packed;
    packed.x = Pack<Elem>::two(lo.x, lo.y);
    packed.y = Pack<Elem>::two(lo.z, lo.w);
    packed.z = Pack<Elem>::two(hi.x, hi.y);
    packed.w = Pack<Elem>::two(hi.z, hi.w);
    *reinterpret_cast<uint4*>(p.dq.row<Elem>(b, h, i) + col) = packed;
}

// 3b. Deterministic dQ: one block per (64 query rows, query head, batch row), no atomics; the key
// walk of the forward (KeyValueStream), S and dP recomputed, dQ += dS K in registers.
template <typename Elem, int HEAD_DIM, int BLOCK_N, bool SOFTCAP, bool DROPOUT>
__global__ void __launch_bounds__(kDqWarps * 32) flash_backward_dq(const __grid_constant__ Params p) {
    constexpr int kThreads = kDqWarps * 32;
    constexpr int kRow = HEAD_DIM + kPad;
    constexpr int kKeyBlocks = BLOCK_N / 8;
    constexpr int kOutBlocks = HEAD_DIM / 8;
    static_assert(kKeyBlocks % 2 == 0 && kOutBlocks % 2 == 0, "tile shapes");
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Elem* q_tile = reinterpret_cast<Elem*>(shared_bytes);  // [kDqBlockM][kRow]
    Elem* do_tile = q_tile + kDqBlockM * kRow;             // [kDqBlockM][kRow], then the K/V stages

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * kDqBlockM, h = blockIdx.y, b = blockIdx.z, kvh = h / p.group;  // heavy first
    const ScoreRule rule{p};
    int lo;  // the keys any row of this block can see: [lo, hi)
    const auto stream = KeyValueStream<Elem, HEAD_DIM, BLOCK_N, kThreads>::template visible_to<kDqBlockM>(
        p, do_tile + kDqBlockM * kRow, b, kvh, m0, &lo);
    const int hi = stream.hi;
    int interior_lo, interior_hi;  // tiles every row sees whole: no masking there
    rule.template interior_tiles<BLOCK_N>(b, p.seq_k, m0, min(m0 + kDqBlockM, p.seq_q) - 1, lo, hi, &interior_lo,
                                          &interior_hi);

    load_tile<Elem, HEAD_DIM, kDqBlockM, kThreads>(q_tile, p.q.row<const Elem>(b, h, 0), p.q.ss, m0, p.seq_q);
    load_tile<Elem, HEAD_DIM, kDqBlockM, kThreads>(do_tile, p.dout.row<const Elem>(b, h, 0), p.dout.ss, m0, p.seq_q);
    if (lo < hi) stream.load(0, lo);
    cp_async_commit();

    const int group_id = lane / 4, pair = (lane % 4) * 2;
    const int rows[2] = {m0 + warp * 16 + group_id, m0 + warp * 16 + group_id + 8};
    float row_lse2[2], row_delta[2];
    const long long head_rows = (static_cast<long long>(b) * p.heads_q + h) * p.seq_q;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_lse2[r] = rows[r] < p.seq_q ? p.lse2[head_rows + rows[r]] : 0.f;  // rows past the end: P = 0
        row_delta[r] = rows[r] < p.seq_q ? p.delta[head_rows + rows[r]] : 0.f;
    }
    float acc[kOutBlocks][4];
    zero(acc);

    // One key tile; MASKED as in prob_and_grad.
    auto tile = [&](auto masked, int kt, int stage) {
        constexpr bool MASKED = decltype(masked)::value;
        stream.next(kt, stage);
        const Elem* k_tile = stream.k_tile(stage);

        // S = Q K^T and dP = dO V^T for this warp's 16 rows, one product after the other (fewer
        // fragments live at once keeps head_dim 256 within the register file).
        float s[kKeyBlocks][4], dp[kKeyBlocks][4];
        zero(s);
        zero(dp);
        warp_product_nt<Elem, HEAD_DIM, kKeyBlocks>(s, q_tile + warp * 16 * kRow, k_tile, kRow, lane);
        warp_product_nt<Elem, HEAD_DIM, kKeyBlocks>(dp, do_tile + warp * 16 * kRow, stream.v_tile(stage), kRow, lane);

        // dS = P (dP Z - delta) softcap' scale, re-packed as the A fragments of dS K.
        unsigned int a_ds[kKeyBlocks / 2][4];
#pragma unroll
        for (int nb = 0; nb < kKeyBlocks; ++nb) {
            float factors[2][2] = {{1.f, 1.f}, {1.f, 1.f}};
            if constexpr (DROPOUT) {
                p.dropout.pair(b, p.heads_q, h, rows[0], kt + nb * 8 + pair, factors[0]);
                p.dropout.pair(b, p.heads_q, h, rows[1], kt + nb * 8 + pair, factors[1]);
            }
            float grad[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float prob;
                prob_and_grad<MASKED, SOFTCAP>(rule, s[nb][e], dp[nb][e], b, h, rows[e / 2], kt + nb * 8 + pair + (e % 2),
                                               hi, row_lse2[e / 2], row_delta[e / 2], factors[e / 2][e % 2], &prob,
                                               &grad[e]);
            }
            a_ds[nb / 2][(nb % 2) * 2 + 0] = Pack<Elem>::two(grad[0], grad[1]);
            a_ds[nb / 2][(nb % 2) * 2 + 1] = Pack<Elem>::two(grad[2], grad[3]);
        }

        // dQ += dS K: k = keys, n = head_dim.
        warp_product_registers<Elem, kKeyBlocks / 2, kOutBlocks>(acc, a_ds, k_tile, kRow, lane);
        __syncthreads();  // this stage is overwritten by the prefetch of the tile after next
    };

    // Edge tiles (window start), interior tiles, edge tiles (diagonal, key_lengths, sequence end).
    int kt = lo, stage = 0;
    if constexpr (!DROPOUT) {
        for (; kt < interior_lo; kt += BLOCK_N, stage ^= 1) tile(Flag<true>{}, kt, stage);
        for (; kt < interior_hi; kt += BLOCK_N, stage ^= 1) tile(Flag<false>{}, kt, stage);
    }
    for (; kt < hi; kt += BLOCK_N, stage ^= 1) tile(Flag<true>{}, kt, stage);
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (rows[r] < p.seq_q) store_row_pairs<Elem, kOutBlocks>(p.dq.row<Elem>(b, h, rows[r]), acc, r, 1.f, lane);
}

}  // namespace fastattn_gpu
