// Split-KV decode attention (Sq <= 16, the KV-cache step): float16 / bfloat16 on tensor cores
// (`flash_decode`), float32 in SIMT float32 math (`flash_decode_fp32`); float32 accumulation in both.
//
// STATUS: compiled by nvcc for sm_80 and sm_90 and passes the conformance suite in the SIMT emulator;
// it has NOT yet run on a GPU (benchmarks/gpu_check.sh owes the device tests, compute-sanitizer and
// the G7 benchmark).  No dropout: inference does not use it, and the kernel table sends decode
// calls with dropout to the tensor-core or float32 forward.
//
// Both kernels read every K/V byte once and do little arithmetic per byte, so they are built to
// stream K/V at the memory bandwidth with as few instructions per byte as the math allows:
//  * Packing: the query rows of a whole GQA group (group x Sq rows, packed row p = g * Sq + i for
//    query head kv_head * group + g and query position i) share one block, so each K/V byte is read
//    once per group (FlashAttention's "seqlenq_ngroups_swapped").  ROWS rows per block (16: one
//    m16 fragment, for the tensor cores; 4 or 8 for float32); a bigger pack is cut into chunks of
//    ROWS rows (grid.y = Hkv x chunks), each re-reading K/V (speculative decoding, large groups).
//  * Split-KV: grid.x = splits; split s owns keys [s * keys_per_split, (s + 1) * keys_per_split)
//    (a multiple of the key tile), clipped to what the rows can see (causal, window, key_lengths);
//    a split with nothing left only writes lse = -inf.  The launcher picks the split count from
//    B x Hkv x chunks and the SM count (fastattn/_gpu/decode.py).  With one split the kernel writes
//    out and lse directly; otherwise it writes a float32 partial output (normalised) and a partial
//    lse per split, and `decode_combine` merges them by lse.
//  * Streaming: K and V tiles are double-buffered in shared memory with 16-byte cp.async copies
//    (zero-filled past the range, so 0-probability keys never multiply garbage), rows padded by 16
//    bytes so that 8 row addresses of 16-byte reads (or ldmatrix rows) fall in distinct banks.
//
// Contract features, all in-kernel: GQA, causal (both alignments through `offset`), sliding window,
// key_lengths (splits past the length are skipped), bool or float masks read by strides, softcap,
// any strides with a contiguous last axis (K/V rows 16-byte aligned).  A row that sees no key writes
// 0 and lse = -inf.
#include "mma_tiles.cuh"

namespace fastattn_gpu {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;

// ---- float16 / bfloat16: tensor cores -----------------------------------------------------------
//
// One block: the 16 packed rows (zero past the pack; their results are never written) against a
// key split.  Each key tile of BLOCK_N keys is cut among the 4 warps, WARP_KEYS each, and every warp
// keeps its own online softmax over the keys it sees (row max, row sum and the 16 x HEAD_DIM output
// in registers), so the key loop has no block-wide step but the stage barrier; the warps' partial
// results merge by their row maxima once, after the loop, in a fixed order (deterministic).  Per
// warp and tile, as in the forward (flash_forward.cu, the same fragment layouts and helpers):
//   S = Q K_w^T   mma.sync.m16n8k16, Q (16 rows) and K_w (the warp's WARP_KEYS keys) by ldmatrix
//   P = exp2(S scale log2e - m) in registers, repacked as the A fragment of
//   O += P V_w    mma.sync, V_w by ldmatrix.trans
// Tiles every packed row sees whole (no mask, causal/window/key_lengths clear of the tile) skip the
// contract's per-score rule and fold the scale into the exponent's FFMA, as the forward's do.
// Tile sizes: WARP_KEYS = 64 (BLOCK_N 256) at head_dim 32, 32 (BLOCK_N 128) at 64, else 16
// (BLOCK_N 64): a stage of K (or V) is then 17-20 KiB up to head_dim 128 and 34 KiB at 256, so a
// block has 35-67 KiB of K/V in flight while it computes the other stage, more than the ~25 KiB an
// H100 SM needs in flight to stream at its share of the bandwidth; the whole block is 74-140 KiB.
// The per-tile work that does not scale with head_dim (the softmax's per-score steps, softcap's
// tanh) is what the wider tiles of the small head dims amortise.  __launch_bounds__(128, 1): left
// to itself ptxas capped head_dim 32 at 128 registers and spilled.  Four warps m16 rows each
// waste 12 of 16 rows on G7 (group 4, Sq 1): the tensor cores have ~50x the throughput decode needs,
// and instructions per K/V byte, not FLOPs, bound it (gpu_static.py counts them per 16 bytes).
template <int HEAD_DIM> struct MmaDecodeShape {
    static constexpr int kRows = 16;
    static constexpr int kWarpKeys = HEAD_DIM <= 32 ? 64 : HEAD_DIM <= 64 ? 32 : 16;
    static constexpr int kBlockN = kDecodeWarps * kWarpKeys;
    static constexpr int kRow = HEAD_DIM + kPad;
};

template <typename Elem, int HEAD_DIM, bool SOFTCAP>
__global__ void __launch_bounds__(kDecodeThreads, 1) flash_decode(const __grid_constant__ Params p) {
    using Shape = MmaDecodeShape<HEAD_DIM>;
    constexpr int kRows = Shape::kRows, kRow = Shape::kRow, kWarpKeys = Shape::kWarpKeys, kBlockN = Shape::kBlockN;
    constexpr int kKeyBlocks = kWarpKeys / 8, kOutBlocks = HEAD_DIM / 8;
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Elem* q_tile = reinterpret_cast<Elem*>(shared_bytes);  // [kRows][kRow], then the K/V stages
    Elem* stages = q_tile + kRows * kRow;
    // After the key loop the stages hold the merge: the warps' outputs and row statistics.
    float* merged = reinterpret_cast<float*>(stages);                // [warps][kRows][HEAD_DIM]
    float* warp_max = merged + kDecodeWarps * kRows * HEAD_DIM;      // [warps][kRows]
    float* warp_sum = warp_max + kDecodeWarps * kRows;               // [warps][kRows]
    float* weight = warp_sum + kDecodeWarps * kRows;                 // [warps][kRows]: exp2(m_w - M) / total
    float* row_lse = weight + kDecodeWarps * kRows;                  // [kRows], natural log
    static_assert((4 * kDecodeWarps * kRows * (HEAD_DIM + 4) + 4 * kRows) <= 4 * kBlockN * kRow * sizeof(Elem),
                  "the merge fits in the K/V stages");

    const int split = blockIdx.x, b = blockIdx.z, group = p.group, seq_q = p.seq_q;
    const int chunks = (group * seq_q + kRows - 1) / kRows;
    const int kvh = blockIdx.y / chunks, row0 = (blockIdx.y % chunks) * kRows;
    const int packed_rows = min(kRows, group * seq_q - row0);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    int lo, hi;
    p.rules.key_range(b, p.seq_k, 0, seq_q - 1, &lo, &hi);
    lo = max(lo, split * p.keys_per_split);
    hi = min(hi, (split + 1) * p.keys_per_split);
    const ScoreRule rule{p};
    int interior_lo, interior_hi;  // tiles every row sees whole: no masking there
    rule.template interior_tiles<kBlockN>(b, p.seq_k, 0, seq_q - 1, lo, hi, &interior_lo, &interior_hi);
    const KeyValueStream<Elem, HEAD_DIM, kBlockN, kDecodeThreads> stream{p, stages, b, kvh, hi};
    if (lo < hi) stream.load(0, lo);
    cp_async_commit();

    // The packed queries, element by element (Q rows need no alignment; this runs once per block).
    for (int index = threadIdx.x; index < kRows * HEAD_DIM; index += kDecodeThreads) {
        const int r = index / HEAD_DIM, d = index % HEAD_DIM, packed = row0 + r;
        Elem value = Convert<Elem>::from_float(0.f);
        if (r < packed_rows) value = p.q.row<const Elem>(b, kvh * group + packed / seq_q, packed % seq_q)[d];
        q_tile[r * kRow + d] = value;
    }

    // This lane's two packed rows (m16 accumulator rows lane / 4 and lane / 4 + 8) as (head,
    // position); a row past the pack gets position seq_q, which the score rule hides.
    const int group_id = lane / 4, pair = (lane % 4) * 2;
    int heads[2], positions[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int packed = row0 + group_id + 8 * r;
        const bool real = group_id + 8 * r < packed_rows;
        heads[r] = real ? kvh * group + packed / seq_q : kvh * group;
        positions[r] = real ? packed % seq_q : seq_q;
    }
    float row_max[2] = {negative_infinity(), negative_infinity()}, row_sum[2] = {0.f, 0.f};
    float acc[kOutBlocks][4];
    zero(acc);

    // One key tile, this warp's WARP_KEYS keys of it; MASKED and RAW as in flash_forward.
    auto tile = [&](auto masked, int kt, int stage) {
        constexpr bool MASKED = decltype(masked)::value;
        constexpr bool RAW = !MASKED && !SOFTCAP;
        stream.next(kt, stage);
        const int key0 = kt + warp * kWarpKeys;

        float s[kKeyBlocks][4];
        zero(s);
        warp_product_nt<Elem, HEAD_DIM, kKeyBlocks>(s, q_tile, stream.k_tile(stage) + warp * kWarpKeys * kRow, kRow,
                                                    lane);
        rule.template tile_log2_scores<MASKED, SOFTCAP>(s, b, heads, positions, key0 + pair, hi);
        unsigned int probs[kKeyBlocks / 2][4];
        online_softmax_tile<Elem, RAW>(s, rule.scale_log2, row_max, row_sum, acc, probs, [](int, float(&)[4]) {});
        warp_product_registers<Elem, kKeyBlocks / 2, kOutBlocks>(acc, probs, stream.v_tile(stage) + warp * kWarpKeys * kRow,
                                                                kRow, lane);
        __syncthreads();  // this stage is overwritten by the prefetch of the tile after next
    };

    // Edge tiles (window start), interior tiles, edge tiles (diagonal, key_lengths, split end).
    int kt = lo, stage = 0;
    for (; kt < interior_lo; kt += kBlockN, stage ^= 1) tile(Flag<true>{}, kt, stage);
    for (; kt < interior_hi; kt += kBlockN, stage ^= 1) tile(Flag<false>{}, kt, stage);
    for (; kt < hi; kt += kBlockN, stage ^= 1) tile(Flag<true>{}, kt, stage);
    cp_async_wait<0>();
    __syncthreads();  // the stages become the merge buffer

    // Each warp's rows: statistics (row sums over the quad) and its unnormalised output.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float total = row_sum[r];
        total += __shfl_xor_sync(0xffffffff, total, 1);
        total += __shfl_xor_sync(0xffffffff, total, 2);
        const int row = group_id + 8 * r;
        if ((lane % 4) == 0) {
            warp_max[warp * kRows + row] = row_max[r];
            warp_sum[warp * kRows + row] = total;
        }
#pragma unroll
        for (int nb = 0; nb < kOutBlocks; ++nb)
            *reinterpret_cast<float2*>(merged + (warp * kRows + row) * HEAD_DIM + nb * 8 + pair) =
                make_float2(acc[nb][2 * r], acc[nb][2 * r + 1]);
    }
    __syncthreads();
    // out = sum_w exp2(m_w - M) O_w / sum_w exp2(m_w - M) l_w, M = max_w m_w: one thread a row.
    if (threadIdx.x < kRows) {
        const int row = threadIdx.x;
        float top = negative_infinity();
#pragma unroll
        for (int w = 0; w < kDecodeWarps; ++w) top = fmaxf(top, warp_max[w * kRows + row]);
        const float shift = top == negative_infinity() ? 0.f : top;
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < kDecodeWarps; ++w) total += warp_sum[w * kRows + row] * fast_exp2(warp_max[w * kRows + row] - shift);
#pragma unroll
        for (int w = 0; w < kDecodeWarps; ++w)
            weight[w * kRows + row] = total > 0.f ? fast_exp2(warp_max[w * kRows + row] - shift) / total : 0.f;
        row_lse[row] = total > 0.f ? (top + log2f(total)) * kLn2 : negative_infinity();
    }
    __syncthreads();

    const int splits = gridDim.x;
    for (int index = threadIdx.x; index < packed_rows * HEAD_DIM; index += kDecodeThreads) {
        const int r = index / HEAD_DIM, d = index % HEAD_DIM, packed = row0 + r;
        const int h = kvh * group + packed / seq_q, i = packed % seq_q;
        float value = 0.f;
#pragma unroll
        for (int w = 0; w < kDecodeWarps; ++w)
            value = weighted_add(weight[w * kRows + r], merged[(w * kRows + r) * HEAD_DIM + d], value);
        if (splits == 1) {
            p.out.row<Elem>(b, h, i)[d] = Convert<Elem>::from_float(value);
            if (d == 0) *p.lse.row<float>(b, h, i) = row_lse[r];
        } else {
            const long long row = split * p.rows + (static_cast<long long>(b) * p.heads_q + h) * seq_q + i;
            if (row_lse[r] != negative_infinity()) p.partial_out[row * HEAD_DIM + d] = value;
            if (d == 0) p.partial_lse[row] = row_lse[r];
        }
    }
}

// ---- float32: SIMT ------------------------------------------------------------------------------
//
// Exact float32 math (tensor cores would round to tf32).  BLOCK_N = 64 keys, or 32 when a row is
// over 256 bytes (head_dim 128 and 256): the four stages (K, V x 2) stay <= 69 KiB (head_dim 256:
// 133 KiB, one block an SM).  Scores: thread t takes key t % BLOCK_N and ROWS / (128 / BLOCK_N)
// rows, 16-byte K reads, Q broadcast from shared memory.  Softmax: warp w owns rows w, w + 4
// (running max and sum in registers, exp2 with scale * log2(e) folded in, rescale factors through
// shared memory).  P V: thread t owns one 16-byte column group of V and every BLOCK_N / KG-th key
// (KG = 128 / column groups), all ROWS rows in registers; the KG partial sums are added in a fixed
// order at the end (deterministic).  Its floor is the FMAs themselves: 16 bytes of K (or of V) meet
// ROWS rows x 4 floats, ROWS / 8 warp instructions; with one row per thread in the scores, each K
// element is read from shared memory once per row set, which keeps it well above that (issue #21's
// table: 1.57 per 16 bytes at head_dim 128, 4 rows).  Non-finite inputs follow the reference: a
// probability of exactly 0 (hidden key, or exp below the smallest normal float) contributes 0 even
// against an inf/NaN value.
template <int HEAD_DIM> struct DecodeShape {
    static constexpr int kVec = 4;                                        // floats per 16 bytes
    static constexpr int kBlockN = HEAD_DIM * 4 <= 256 ? 64 : 32;
    static constexpr int kRow = HEAD_DIM + kVec;                          // padded smem row (floats)
    static constexpr int kColumnGroups = HEAD_DIM / kVec;                 // 16-byte groups per row
    static constexpr int kKeyGroups = kDecodeThreads / kColumnGroups;     // P V: threads per column group
    static constexpr int kRowSets = kDecodeThreads / kBlockN;             // scores: threads per key
};

// Rows [first, first + BLOCK_N) of K or V (rows >= limit zero-filled) into a padded tile.
template <int HEAD_DIM>
__device__ __forceinline__ void decode_load_tile(float* tile, const float* base, long long row_stride, int first,
                                                 int limit) {
    using Shape = DecodeShape<HEAD_DIM>;
    for (int chunk = threadIdx.x; chunk < Shape::kBlockN * Shape::kColumnGroups; chunk += kDecodeThreads) {
        const int row = chunk / Shape::kColumnGroups, col = (chunk % Shape::kColumnGroups) * Shape::kVec;
        const bool valid = first + row < limit;
        const float* src = base + (valid ? static_cast<long long>(first + row) * row_stride : 0) + col;
        cp_async_16(tile + row * Shape::kRow + col, src, valid);
    }
}

// The four floats of a 16-byte group in shared memory.
__device__ __forceinline__ void unpack16(const float* source, float* values) {
    const float4 raw = *reinterpret_cast<const float4*>(source);
    values[0] = raw.x;
    values[1] = raw.y;
    values[2] = raw.z;
    values[3] = raw.w;
}

template <int HEAD_DIM, int ROWS>
__global__ void __launch_bounds__(kDecodeThreads) flash_decode_fp32(const __grid_constant__ Params p) {
    using Shape = DecodeShape<HEAD_DIM>;
    constexpr int kBlockN = Shape::kBlockN, kRow = Shape::kRow, kVec = Shape::kVec;
    constexpr int kRowsPerThread = ROWS / Shape::kRowSets;
    constexpr int kWarps = kDecodeWarps;
    static_assert(ROWS % Shape::kRowSets == 0 && ROWS % kWarps == 0, "ROWS must cover the row sets and warps");
    static_assert(kDecodeThreads % Shape::kColumnGroups == 0, "head_dim must split into the threads");

    extern __shared__ __align__(16) unsigned char shared_bytes[];
    float* q_s = reinterpret_cast<float*>(shared_bytes);             // [ROWS][HEAD_DIM]
    float* p_s = q_s + ROWS * HEAD_DIM;                              // [ROWS][kBlockN] scores, then P
    float* alpha_s = p_s + ROWS * kBlockN;                           // [ROWS] rescale of this tile
    float* stat_s = alpha_s + ROWS;                                  // [2][ROWS] final max and sum
    float* k_tiles = reinterpret_cast<float*>(stat_s + 2 * ROWS);      // [2][kBlockN][kRow]
    float* v_tiles = k_tiles + 2 * kBlockN * kRow;                    // [2][kBlockN][kRow]
    float* reduce_s = reinterpret_cast<float*>(k_tiles);             // after the loop: [KG][ROWS][HEAD_DIM]

    const int split = blockIdx.x, b = blockIdx.z, group = p.group, seq_q = p.seq_q;
    const int chunks = (group * seq_q + ROWS - 1) / ROWS;
    const int kvh = blockIdx.y / chunks, row0 = (blockIdx.y % chunks) * ROWS;
    const int packed_rows = min(ROWS, group * seq_q - row0);

    int lo, hi;
    p.rules.key_range(b, p.seq_k, 0, seq_q - 1, &lo, &hi);
    lo = max(lo, split * p.keys_per_split);
    hi = min(hi, (split + 1) * p.keys_per_split);

    const float* k_base = p.k.row<const float>(b, kvh, 0);
    const float* v_base = p.v.row<const float>(b, kvh, 0);
    const long long k_ss = p.k.ss, v_ss = p.v.ss;
    if (lo < hi) {
        decode_load_tile<HEAD_DIM>(k_tiles, k_base, k_ss, lo, hi);
        decode_load_tile<HEAD_DIM>(v_tiles, v_base, v_ss, lo, hi);
    }
    cp_async_commit();
    for (int index = threadIdx.x; index < ROWS * HEAD_DIM; index += kDecodeThreads) {
        const int r = index / HEAD_DIM, d = index % HEAD_DIM, packed = row0 + r;
        float value = 0.f;
        if (r < packed_rows) {
            const int h = kvh * group + packed / seq_q, i = packed % seq_q;
            value = p.q.row<const float>(b, h, i)[d];
        }
        q_s[index] = value;
    }

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int key = threadIdx.x % kBlockN, row_set = threadIdx.x / kBlockN;
    const int column = (threadIdx.x % Shape::kColumnGroups) * kVec, key_group = threadIdx.x / Shape::kColumnGroups;
    float row_max[ROWS / kWarps], row_sum[ROWS / kWarps];
#pragma unroll
    for (int r = 0; r < ROWS / kWarps; ++r) row_max[r] = negative_infinity(), row_sum[r] = 0.f;
    float acc[ROWS][kVec];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[r][e] = 0.f;

    int stage = 0;
    for (int kt = lo; kt < hi; kt += kBlockN, stage ^= 1) {
        if (kt + kBlockN < hi) {
            decode_load_tile<HEAD_DIM>(k_tiles + (stage ^ 1) * kBlockN * kRow, k_base, k_ss, kt + kBlockN, hi);
            decode_load_tile<HEAD_DIM>(v_tiles + (stage ^ 1) * kBlockN * kRow, v_base, v_ss, kt + kBlockN, hi);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const float* k_tile = k_tiles + stage * kBlockN * kRow;
        const float* v_tile = v_tiles + stage * kBlockN * kRow;

        // Scores of key `kt + key` for this thread's rows, in log2 units, -inf where hidden.
        {
            float dot[kRowsPerThread];
#pragma unroll
            for (int r = 0; r < kRowsPerThread; ++r) dot[r] = 0.f;
#pragma unroll 4
            for (int d = 0; d < HEAD_DIM; d += kVec) {
                float kv[kVec];
                unpack16(k_tile + key * kRow + d, kv);
#pragma unroll
                for (int r = 0; r < kRowsPerThread; ++r) {
                    const float* q_row = q_s + (row_set * kRowsPerThread + r) * HEAD_DIM + d;
#pragma unroll
                    for (int e = 0; e < kVec; e += 4) {
                        const float4 qv = *reinterpret_cast<const float4*>(q_row + e);
                        dot[r] += qv.x * kv[e] + qv.y * kv[e + 1] + qv.z * kv[e + 2] + qv.w * kv[e + 3];
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < kRowsPerThread; ++r) {
                const int local = row_set * kRowsPerThread + r, packed = row0 + local, j = kt + key;
                float score = negative_infinity();
                if (local < packed_rows && j < hi) {
                    const int h = kvh * group + packed / seq_q, i = packed % seq_q;
                    score = p.rules.apply(soft_cap(dot[r] * p.scale, p.softcap), b, h, i, j) * kLog2e;
                }
                p_s[local * kBlockN + key] = score;
            }
        }
        __syncthreads();

        // Online softmax: warp w updates rows w, w + kWarps, ...
#pragma unroll
        for (int r = 0; r < ROWS / kWarps; ++r) {
            float* scores = p_s + (warp + r * kWarps) * kBlockN;
            float tile_max = negative_infinity();
#pragma unroll
            for (int j = lane; j < kBlockN; j += 32) tile_max = fmaxf(tile_max, scores[j]);
#pragma unroll
            for (int step = 16; step > 0; step /= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, step));
            const float new_max = fmaxf(row_max[r], tile_max);
            const float shift = new_max == negative_infinity() ? 0.f : new_max;
            const float alpha = flush_tiny(exp2f(row_max[r] - shift));
            float tile_sum = 0.f;
#pragma unroll
            for (int j = lane; j < kBlockN; j += 32) {
                const float prob = flush_tiny(exp2f(scores[j] - shift));
                scores[j] = prob;
                tile_sum += prob;
            }
#pragma unroll
            for (int step = 16; step > 0; step /= 2) tile_sum += __shfl_xor_sync(0xffffffff, tile_sum, step);
            row_max[r] = new_max;
            row_sum[r] = row_sum[r] * alpha + tile_sum;
            if (lane == 0) alpha_s[warp + r * kWarps] = alpha;
        }
        __syncthreads();

        // acc = acc * alpha + P V for this thread's column group and keys key_group + KG * n.
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float alpha = alpha_s[r];
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[r][e] = weighted_add(alpha, acc[r][e], 0.f);
        }
#pragma unroll 2
        for (int j = key_group; j < kBlockN; j += Shape::kKeyGroups) {
            float vv[kVec];
            unpack16(v_tile + j * kRow + column, vv);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float prob = p_s[r * kBlockN + j];
#pragma unroll
                for (int e = 0; e < kVec; ++e) acc[r][e] = weighted_add(prob, vv[e], acc[r][e]);
            }
        }
        __syncthreads();  // this stage is overwritten by the prefetch of the tile after next
    }
    cp_async_wait<0>();
    __syncthreads();  // the K/V tiles become the reduction buffer

    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < ROWS / kWarps; ++r) {
            stat_s[warp + r * kWarps] = row_max[r];
            stat_s[ROWS + warp + r * kWarps] = row_sum[r];
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int e = 0; e < kVec; ++e) reduce_s[(key_group * ROWS + r) * HEAD_DIM + column + e] = acc[r][e];
    __syncthreads();

    // Sum the key groups in order, normalise, write out + lse (one split) or the partials.
    const int splits = gridDim.x;
    for (int index = threadIdx.x; index < packed_rows * HEAD_DIM; index += kDecodeThreads) {
        const int r = index / HEAD_DIM, d = index % HEAD_DIM, packed = row0 + r;
        const int h = kvh * group + packed / seq_q, i = packed % seq_q;
        float total = 0.f;
#pragma unroll 4
        for (int g = 0; g < Shape::kKeyGroups; ++g) total += reduce_s[(g * ROWS + r) * HEAD_DIM + d];
        const float sum = stat_s[ROWS + r];
        const float value = sum > 0.f ? total / sum : 0.f;
        const float row_lse = sum > 0.f ? (stat_s[r] + log2f(sum)) * kLn2 : negative_infinity();
        if (splits == 1) {
            p.out.row<float>(b, h, i)[d] = value;
            if (d == 0) *p.lse.row<float>(b, h, i) = row_lse;
        } else {
            const long long row = split * p.rows + (static_cast<long long>(b) * p.heads_q + h) * seq_q + i;
            if (sum > 0.f) p.partial_out[row * HEAD_DIM + d] = value;
            if (d == 0) p.partial_lse[row] = row_lse;
        }
    }
}

// Merge the splits of one query row: out = sum_s exp(lse_s - M) out_s / sum_s exp(lse_s - M),
// lse = M + log(sum_s exp(lse_s - M)), M = max_s lse_s; splits with lse_s = -inf are skipped
// (their partial output is never written), and a row with no split seeing a key gets 0 and -inf.
template <typename Elem>
__global__ void __launch_bounds__(kDecodeThreads) decode_combine(const __grid_constant__ Params p) {
    const long long row = blockIdx.x, rows = p.rows;
    const int i = static_cast<int>(row % p.seq_q), h = static_cast<int>((row / p.seq_q) % p.heads_q);
    const int b = static_cast<int>(row / (static_cast<long long>(p.seq_q) * p.heads_q));
    const int splits = p.keys_per_split > 0 ? (p.seq_k + p.keys_per_split - 1) / p.keys_per_split : 1;
    float top = negative_infinity();
    for (int s = 0; s < splits; ++s) top = fmaxf(top, p.partial_lse[s * rows + row]);
    Elem* dst = p.out.row<Elem>(b, h, i);
    if (top == negative_infinity()) {
        for (int d = threadIdx.x; d < p.head_dim; d += kDecodeThreads) dst[d] = Convert<Elem>::from_float(0.f);
        if (threadIdx.x == 0) *p.lse.row<float>(b, h, i) = negative_infinity();
        return;
    }
    float total = 0.f;
    for (int s = 0; s < splits; ++s) total += flush_tiny(expf(p.partial_lse[s * rows + row] - top));
    for (int d = threadIdx.x; d < p.head_dim; d += kDecodeThreads) {
        float value = 0.f;
        for (int s = 0; s < splits; ++s) {
            const float part_lse = p.partial_lse[s * rows + row];
            if (part_lse != negative_infinity())
                value = weighted_add(flush_tiny(expf(part_lse - top)), p.partial_out[(s * rows + row) * p.head_dim + d],
                                     value);
        }
        dst[d] = Convert<Elem>::from_float(value / total);
    }
    if (threadIdx.x == 0) *p.lse.row<float>(b, h, i) = top + logf(total);
}

}  // namespace fastattn_gpu
