// Split-KV decode attention (Sq <= 16, the KV-cache step): float16 / bfloat16 / float32 in,
// float32 math.
//
// STATUS: compiled by nvcc for sm_80 and sm_90 and passes the conformance suite in the SIMT emulator;
// it has NOT yet run on a GPU (benchmarks/gpu_check.sh owes the device tests, compute-sanitizer and
// the G7 benchmark).  No dropout: inference does not use it, and the kernel table sends decode
// calls with dropout to the tensor-core or float32 forward.
//
// Algorithm.  Decode reads every K/V byte once and does little arithmetic per byte, so the kernel
// is built to stream K/V at the memory bandwidth:
//  * Packing: the query rows of a whole GQA group (group x Sq rows, packed row p = g * Sq + i for
//    query head kv_head * group + g and query position i) share one block, so each K/V byte is read
//    once per group.  ROWS (4 or 8) rows per block; a bigger pack is cut into chunks of ROWS rows
//    (grid.y = Hkv x chunks), each re-reading K/V (speculative decoding with large groups).
//  * Split-KV: grid.x = splits; split s owns keys [s * keys_per_split, (s + 1) * keys_per_split)
//    (a multiple of the key tile), clipped to what the rows can see (causal, window, key_lengths);
//    a split with nothing left only writes lse = -inf.  The launcher picks the split count from
//    B x Hkv x chunks and the SM count (fastattn/_gpu/decode.py).  With one split the kernel writes
//    out and lse directly; otherwise it writes a float32 partial output (normalised) and a partial
//    lse per split, and `decode_combine` merges them by lse.
//  * Streaming: K and V tiles of BLOCK_N keys are double-buffered in shared memory with 16-byte
//    cp.async copies (zero-filled past the range, so 0-probability keys never multiply garbage);
//    rows padded by 16 bytes so that the 8 row addresses of a quarter-warp's 16-byte reads fall in
//    distinct banks.  BLOCK_N = 64 keys, or 32 when a row is over 256 bytes (float32 head_dim 128,
//    head_dim 256): a 16-bit tile is <= 17 KiB and the four (K, V x 2 stages) <= 69 KiB, leaving
//    room for three blocks per SM on an H100 to keep enough bytes in flight (float32 head_dim 256:
//    133 KiB, one block).
//  * Arithmetic (SIMT float32; decode is bandwidth-bound: G7 does 4 rows x 2 flops per 2 bytes):
//    scores: thread t takes key t % BLOCK_N and ROWS / (128 / BLOCK_N) rows, 16-byte K reads,
//    Q broadcast from shared memory as float.  Softmax: warp w owns rows w, w + 4 (running max and
//    sum in registers, exp2 with scale * log2(e) folded in, rescale factors through shared memory).
//    P V: thread t owns one 16-byte column group of V and every BLOCK_N / KG-th key (KG = 128 / column
//    groups), all ROWS rows in registers; the KG partial sums are added in a fixed order at the end
//    (deterministic).  Non-finite inputs follow the reference: a probability of exactly 0 (hidden
//    key, or exp below the smallest normal float) contributes 0 even against an inf/NaN value.
//
// Contract features, all in-kernel: GQA, causal (both alignments through `offset`), sliding window,
// key_lengths (splits past the length are skipped), bool or float masks read by strides, softcap,
// any strides with a contiguous last axis (K/V rows 16-byte aligned).  A row that sees no key writes
// 0 and lse = -inf.
#include "common.cuh"

namespace fastattn_gpu {

constexpr int kDecodeThreads = 128;

template <typename Elem, int HEAD_DIM> struct DecodeShape {
    static constexpr int kVec = 16 / sizeof(Elem);                        // elements per 16 bytes
    static constexpr int kBlockN = HEAD_DIM * sizeof(Elem) <= 256 ? 64 : 32;
    static constexpr int kRow = HEAD_DIM + kVec;                          // padded smem row (elements)
    static constexpr int kColumnGroups = HEAD_DIM / kVec;                 // 16-byte groups per row
    static constexpr int kKeyGroups = kDecodeThreads / kColumnGroups;     // P V: threads per column group
    static constexpr int kRowSets = kDecodeThreads / kBlockN;             // scores: threads per key
};

// Rows [first, first + BLOCK_N) of K or V (rows >= limit zero-filled) into a padded tile.
template <typename Elem, int HEAD_DIM>
__device__ __forceinline__ void decode_load_tile(Elem* tile, const Elem* base, long long row_stride, int first,
                                                 int limit) {
    using Shape = DecodeShape<Elem, HEAD_DIM>;
    for (int chunk = threadIdx.x; chunk < Shape::kBlockN * Shape::kColumnGroups; chunk += kDecodeThreads) {
        const int row = chunk / Shape::kColumnGroups, col = (chunk % Shape::kColumnGroups) * Shape::kVec;
        const bool valid = first + row < limit;
        const Elem* src = base + (valid ? static_cast<long long>(first + row) * row_stride : 0) + col;
        cp_async_16(tile + row * Shape::kRow + col, src, valid);
    }
}

// The floats of one 16-byte group of Elem, from the four 32-bit words (no local-memory round trip).
template <typename Elem> struct Unpack16;
template <> struct Unpack16<float> {
    static __device__ __forceinline__ void words(unsigned int w, float* values) { values[0] = __uint_as_float(w); }
};
template <> struct Unpack16<__half> {
    static __device__ __forceinline__ void words(unsigned int w, float* values) {
        values[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
        values[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
    }
};
template <> struct Unpack16<__nv_bfloat16> {
    static __device__ __forceinline__ void words(unsigned int w, float* values) {
        values[0] = __uint_as_float(w << 16);
        values[1] = __uint_as_float(w & 0xffff0000u);
    }
};
template <typename Elem> __device__ __forceinline__ void unpack16(const Elem* source, float* values) {
    constexpr int kPerWord = 4 / sizeof(Elem);
    const uint4 raw = *reinterpret_cast<const uint4*>(source);
    Unpack16<Elem>::words(raw.x, values);
    Unpack16<Elem>::words(raw.y, values + kPerWord);
    Unpack16<Elem>::words(raw.z, values + 2 * kPerWord);
    Unpack16<Elem>::words(raw.w, values + 3 * kPerWord);
}

template <typename Elem, int HEAD_DIM, int ROWS>
__global__ void __launch_bounds__(kDecodeThreads) flash_decode(const __grid_constant__ Params p) {
    using Shape = DecodeShape<Elem, HEAD_DIM>;
    constexpr int kBlockN = Shape::kBlockN, kRow = Shape::kRow, kVec = Shape::kVec;
    constexpr int kRowsPerThread = ROWS / Shape::kRowSets;
    constexpr int kWarps = kDecodeThreads / 32;
    static_assert(ROWS % Shape::kRowSets == 0 && ROWS % kWarps == 0, "ROWS must cover the row sets and warps");
    static_assert(kDecodeThreads % Shape::kColumnGroups == 0, "head_dim must split into the threads");

    extern __shared__ __align__(16) unsigned char shared_bytes[];
    float* q_s = reinterpret_cast<float*>(shared_bytes);             // [ROWS][HEAD_DIM]
    float* p_s = q_s + ROWS * HEAD_DIM;                              // [ROWS][kBlockN] scores, then P
    float* alpha_s = p_s + ROWS * kBlockN;                           // [ROWS] rescale of this tile
    float* stat_s = alpha_s + ROWS;                                  // [2][ROWS] final max and sum
    Elem* k_tiles = reinterpret_cast<Elem*>(stat_s + 2 * ROWS);      // [2][kBlockN][kRow]
    Elem* v_tiles = k_tiles + 2 * kBlockN * kRow;                    // [2][kBlockN][kRow]
    float* reduce_s = reinterpret_cast<float*>(k_tiles);             // after the loop: [KG][ROWS][HEAD_DIM]

    const int split = blockIdx.x, b = blockIdx.z, group = p.group, seq_q = p.seq_q;
    const int chunks = (group * seq_q + ROWS - 1) / ROWS;
    const int kvh = blockIdx.y / chunks, row0 = (blockIdx.y % chunks) * ROWS;
    const int packed_rows = min(ROWS, group * seq_q - row0);

    int lo, hi;
    p.rules.key_range(b, p.seq_k, 0, seq_q - 1, &lo, &hi);
    lo = max(lo, split * p.keys_per_split);
    hi = min(hi, (split + 1) * p.keys_per_split);

    const Elem* k_base = p.k.row<const Elem>(b, kvh, 0);
    const Elem* v_base = p.v.row<const Elem>(b, kvh, 0);
    const long long k_ss = p.k.ss, v_ss = p.v.ss;
    if (lo < hi) {
        decode_load_tile<Elem, HEAD_DIM>(k_tiles, k_base, k_ss, lo, hi);
        decode_load_tile<Elem, HEAD_DIM>(v_tiles, v_base, v_ss, lo, hi);
    }
    cp_async_commit();
    for (int index = threadIdx.x; index < ROWS * HEAD_DIM; index += kDecodeThreads) {
        const int r = index / HEAD_DIM, d = index % HEAD_DIM, packed = row0 + r;
        float value = 0.f;
        if (r < packed_rows) {
            const int h = kvh * group + packed / seq_q, i = packed % seq_q;
            value = Convert<Elem>::to_float(p.q.row<const Elem>(b, h, i)[d]);
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
            decode_load_tile<Elem, HEAD_DIM>(k_tiles + (stage ^ 1) * kBlockN * kRow, k_base, k_ss, kt + kBlockN, hi);
            decode_load_tile<Elem, HEAD_DIM>(v_tiles + (stage ^ 1) * kBlockN * kRow, v_base, v_ss, kt + kBlockN, hi);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const Elem* k_tile = k_tiles + stage * kBlockN * kRow;
        const Elem* v_tile = v_tiles + stage * kBlockN * kRow;

        // Scores of key `kt + key` for this thread's rows, in log2 units, -inf where hidden.
        {
            float dot[kRowsPerThread];
#pragma unroll
            for (int r = 0; r < kRowsPerThread; ++r) dot[r] = 0.f;
#pragma unroll 4
            for (int d = 0; d < HEAD_DIM; d += kVec) {
                float kv[kVec];
                unpack16<Elem>(k_tile + key * kRow + d, kv);
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
            unpack16<Elem>(v_tile + j * kRow + column, vv);
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
            p.out.row<Elem>(b, h, i)[d] = Convert<Elem>::from_float(value);
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
