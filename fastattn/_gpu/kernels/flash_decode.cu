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

// The last step of both decode kernels.  Every warp keeps its own online softmax over its keys of
// each tile; after the key loop the K/V stages hold, per warp w and packed row r, the warp's
// unnormalised output O_w, row maximum m_w (log2 units) and row sum l_w.  The warps merge in a
// fixed order (deterministic):
//   out = sum_w 2^(m_w - M) O_w / L,   L = sum_w 2^(m_w - M) l_w,   M = max_w m_w,   lse = (M + log2 L) ln 2
// written to out and lse (one split) or to the split's partial output and lse (a row that sees no
// key of the split writes only lse = -inf there).
template <int HEAD_DIM, int ROWS> struct DecodeMerge {
    float* output;   // [warps][ROWS][HEAD_DIM]
    float* row_max;  // [warps][ROWS]
    float* row_sum;  // [warps][ROWS]
    float* weight;   // [warps][ROWS]: 2^(m_w - M) / L
    float* row_lse;  // [ROWS], natural log
    static constexpr int kBytes = 4 * (kDecodeWarps * ROWS * (HEAD_DIM + 3) + ROWS);

    __device__ __forceinline__ explicit DecodeMerge(void* base)
        : output(static_cast<float*>(base)),
          row_max(output + kDecodeWarps * ROWS * HEAD_DIM),
          row_sum(row_max + kDecodeWarps * ROWS),
          weight(row_sum + kDecodeWarps * ROWS),
          row_lse(weight + kDecodeWarps * ROWS) {}

    // After every warp has written its output, maxima and sums (this starts with the block barrier).
    template <typename Elem>
    __device__ __forceinline__ void finish(const Params& p, int b, int kvh, int row0, int packed_rows) const {
        __syncthreads();
        if (threadIdx.x < ROWS) {
            const int row = threadIdx.x;
            float top = negative_infinity();
#pragma unroll
            for (int w = 0; w < kDecodeWarps; ++w) top = fmaxf(top, row_max[w * ROWS + row]);
            const float shift = top == negative_infinity() ? 0.f : top;
            float total = 0.f;
#pragma unroll
            for (int w = 0; w < kDecodeWarps; ++w) total += row_sum[w * ROWS + row] * fast_exp2(row_max[w * ROWS + row] - shift);
#pragma unroll
            for (int w = 0; w < kDecodeWarps; ++w)
                weight[w * ROWS + row] = total > 0.f ? fast_exp2(row_max[w * ROWS + row] - shift) / total : 0.f;
            row_lse[row] = total > 0.f ? (top + log2f(total)) * kLn2 : negative_infinity();
        }
        __syncthreads();

        const int splits = gridDim.x, group = p.group, seq_q = p.seq_q;
        for (int index = threadIdx.x; index < packed_rows * HEAD_DIM; index += kDecodeThreads) {
            const int r = index / HEAD_DIM, d = index % HEAD_DIM, packed = row0 + r;
            const int h = kvh * group + packed / seq_q, i = packed % seq_q;
            float value = 0.f;
#pragma unroll
            for (int w = 0; w < kDecodeWarps; ++w)
                value = weighted_add(weight[w * ROWS + r], output[(w * ROWS + r) * HEAD_DIM + d], value);
            if (splits == 1) {
                p.out.row<Elem>(b, h, i)[d] = Convert<Elem>::from_float(value);
                if (d == 0) *p.lse.row<float>(b, h, i) = row_lse[r];
            } else {
                const long long row = partial_row(p, b, h, i);
                if (row_lse[r] != negative_infinity()) p.partial_out[row * HEAD_DIM + d] = value;
                if (d == 0) p.partial_lse[row] = row_lse[r];
            }
        }
    }

    // The row of this block's split of (b, h, i) in partial_out and partial_lse.
    static __device__ __forceinline__ long long partial_row(const Params& p, int b, int h, int i) {
        return blockIdx.x * p.rows + (static_cast<long long>(b) * p.heads_q + h) * p.seq_q + i;
    }

    // Whether every output a float32 block wrote (out, or its split's partial_out where the split saw
    // a key) is finite; the block's threads together, all of them reaching it.
    static __device__ __forceinline__ bool written_finite(const Params& p, int b, int kvh, int row0, int packed_rows) {
        bool bad = false;
#pragma unroll 4
        for (int index = threadIdx.x; index < packed_rows * HEAD_DIM; index += kDecodeThreads) {
            const int r = index / HEAD_DIM, d = index % HEAD_DIM, packed = row0 + r;
            const int h = kvh * p.group + packed / p.seq_q, i = packed % p.seq_q;
            float value = 0.f;
            if (gridDim.x == 1) {
                value = p.out.row<const float>(b, h, i)[d];
            } else {
                const long long row = partial_row(p, b, h, i);
                if (p.partial_lse[row] != negative_infinity()) value = p.partial_out[row * HEAD_DIM + d];
            }
            bad |= not_finite(value);
        }
        return !__syncthreads_or(bad);
    }
};

// The second walks' scores-only pass over a row's keys: streams the K/V tiles of keys [first, last)
// through the two stages at `stages` and calls visit(kt, stage) on each once it is loaded, a block
// barrier after each; returns with every copy landed and the stages free.
template <typename Elem, int HEAD_DIM, int BLOCK_N, typename Visit>
__device__ __forceinline__ void visit_key_tiles(const Params& p, Elem* stages, int b, int kvh, int first, int last,
                                                Visit visit) {
    const KeyValueStream<Elem, HEAD_DIM, BLOCK_N, kDecodeThreads> every_key{p, stages, b, kvh, last};
    if (first < last) every_key.load(0, first);
    cp_async_commit();
    int stage = 0;
    for (int kt = first; kt < last; kt += BLOCK_N, stage ^= 1) {
        every_key.next(kt, stage);
        visit(kt, stage);
        __syncthreads();
    }
    cp_async_wait<0>();
    __syncthreads();
}

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
    const DecodeMerge<HEAD_DIM, kRows> merge(stages);  // after the key loop
    static_assert(DecodeMerge<HEAD_DIM, kRows>::kBytes <= 4 * kBlockN * kRow * sizeof(Elem), "the merge fits in the K/V stages");

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

    // One key tile, this warp's WARP_KEYS keys of it; MASKED and RAW as in flash_forward; EXACT, P V
    // in SIMT float math with the zero-weight rule (exact_product_registers).
    auto tile = [&](auto masked, auto exact, int kt, int stage) {
        constexpr bool MASKED = decltype(masked)::value, EXACT = decltype(exact)::value;
        constexpr bool RAW = !MASKED && !SOFTCAP;
        stream.next(kt, stage);
        const int key0 = kt + warp * kWarpKeys;

        float s[kKeyBlocks][4];
        zero(s);
        warp_product_nt<Elem, HEAD_DIM, kKeyBlocks>(s, q_tile, stream.k_tile(stage) + warp * kWarpKeys * kRow, kRow,
                                                    lane);
        rule.template tile_log2_scores<MASKED, SOFTCAP>(s, b, heads, positions, key0 + pair, hi);
        unsigned int probs[kKeyBlocks / 2][4];
        online_softmax_tile<Elem, RAW, EXACT>(s, rule.scale_log2, row_max, row_sum, acc, probs, [](int, float(&)[4]) {});
        const Elem* v_rows = stream.v_tile(stage) + warp * kWarpKeys * kRow;
        if constexpr (EXACT)
            exact_product_registers<Elem, kKeyBlocks / 2, kOutBlocks>(acc, probs, v_rows, kRow, lane);
        else
            warp_product_registers<Elem, kKeyBlocks / 2, kOutBlocks>(acc, probs, v_rows, kRow, lane);
        __syncthreads();  // this stage is overwritten by the prefetch of the tile after next
    };

    // Before a second walk (an output not finite), every row's maximum over all of its keys: a warp's
    // maxima cover its share of its split's keys, the reference weighs against the row's.  A walk of
    // the scores alone over the row's whole key range (every tile masked: this path is rare), then
    // the maxima over the quad and the warps through the idle stages.
    auto row_maxima = [&] {
        int first, last;
        p.rules.key_range(b, p.seq_k, 0, seq_q - 1, &first, &last);
        visit_key_tiles<Elem, HEAD_DIM, kBlockN>(p, stages, b, kvh, first, last, [&](int kt, int stage) {
            float s[kKeyBlocks][4];
            zero(s);
            warp_product_nt<Elem, HEAD_DIM, kKeyBlocks>(s, q_tile, stream.k_tile(stage) + warp * kWarpKeys * kRow, kRow,
                                                        lane);
            rule.template tile_log2_scores<true, SOFTCAP>(s, b, heads, positions, kt + warp * kWarpKeys + pair, last);
#pragma unroll
            for (int nb = 0; nb < kKeyBlocks; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) row_max[e / 2] = fmaxf(row_max[e / 2], s[nb][e]);
        });
        float* maxima = reinterpret_cast<float*>(stages);  // [warps][kRows]
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffff, row_max[r], 1));
            row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffff, row_max[r], 2));
            if (lane % 4 == 0) maxima[warp * kRows + group_id + 8 * r] = row_max[r];
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int w = 0; w < kDecodeWarps; ++w) row_max[r] = fmaxf(row_max[r], maxima[w * kRows + group_id + 8 * r]);
        __syncthreads();  // the stages are loaded again next
    };

    // Edge tiles (window start), interior tiles, edge tiles (diagonal, key_lengths, split end); then
    // the stages become the merge buffer.
    walk_keys_under_zero_weight_rule<kBlockN>(stream, lo, interior_lo, interior_hi, hi, row_max, row_sum, acc, tile,
                                              row_maxima);

    // Each warp's rows: statistics (row sums over the quad) and its unnormalised output.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float total = row_sum[r];
        total += __shfl_xor_sync(0xffffffff, total, 1);
        total += __shfl_xor_sync(0xffffffff, total, 2);
        const int row = group_id + 8 * r;
        if ((lane % 4) == 0) {
            merge.row_max[warp * kRows + row] = row_max[r];
            merge.row_sum[warp * kRows + row] = total;
        }
#pragma unroll
        for (int nb = 0; nb < kOutBlocks; ++nb)
            *reinterpret_cast<float2*>(merge.output + (warp * kRows + row) * HEAD_DIM + nb * 8 + pair) =
                make_float2(acc[nb][2 * r], acc[nb][2 * r + 1]);
    }
    merge.template finish<Elem>(p, b, kvh, row0, packed_rows);
}

// ---- float32: SIMT -------------------------------------------------------------------------------
//
// Exact float32 math (tensor cores would round to tf32), in the tensor-core kernel's shape: each
// key tile is cut among the 4 warps, WARP_KEYS keys each, and every warp keeps its own online
// softmax over the keys it sees, for all ROWS packed rows at once, merged by DecodeMerge after the
// loop.  The arithmetic floor is the FMAs: 16 bytes of K (or V) meet ROWS rows x 4 floats, ROWS / 8
// warp instructions (0.5 per 16 bytes at 4 rows, 1.0 at 8), so every K and V element is read from
// shared memory once per tile, for all rows, and little else runs per key:
//  * S = Q K^T: lane (part, key) takes key `key` of the warp's WARP_KEYS and the part-th of
//    KEY_LANES slices of head_dim (KEY_LANES = 1, 2, 4 at head_dim 32, 64, >= 128, and 2 at head_dim
//    32 with 8 rows: WARP_KEYS = 32 / KEY_LANES), reads its slice of K as 16-byte chunks and
//    multiplies each with every row's Q chunk (16-byte reads of the queries in shared memory,
//    broadcast: the 8 lanes of a bank phase share a part).  A key's KEY_LANES partial dot products
//    are joined by a reduce-scatter over shuffles, which leaves lane (part, key) with the scores of
//    rows part * ROWS / KEY_LANES ... of its key, so the per-score steps run once per score.
//  * Lazy softmax (FlashAttention-4's conditional rescaling): each row keeps a shift, its running
//    maximum m.  A tile whose scores all stay below shift + kRescaleSlack (8 in log2 units, so P
//    <= 256) keeps the shift: P = 2^(s - shift) on the SFU (ex2.approx.ftz; its flush to zero is the
//    contract's tiny-probability rule), O += P V, no row maximum over the warp, no rescale of O.
//    Otherwise (the first visible key, a score past the slack, a NaN below) the warp redoes the
//    tile as a rescaling tile: the row maxima by shuffles, every row shifted to its new maximum, O
//    and the sums rescaled by alpha = 2^(m_old - m_new).  The result does not depend on the shifts
//    (they cancel in O / l); after the first tiles most rows' maxima stop rising past the slack.
//    The sums are kept per lane and added up once after the loop; P (and alpha) go through a small
//    per-warp buffer in shared memory ([WARP_KEYS][ROWS]: one 16-byte broadcast read, 4 rows' P).
//  * O += P V: lane (value key, column chunk) owns one or two 16-byte column chunks of V
//    (head_dim 32 and 64 put 4 and 2 keys side by side, added up after the loop) and all ROWS rows,
//    in plain FMAs.  A weight of exactly 0 must contribute 0 even against an inf/NaN value (or
//    output), which plain FMAs break only by making a NaN: when any lane's new O holds one, the
//    warp redoes the tile as a rescaling tile and, if a NaN comes out again, with the exact rule
//    (weighted_add).  An overflow of P would show the same way.  The lazy loop holds neither path:
//    they run outside it, so that the loop that streams the cache is only the lazy tile.
//  * Tiles every row sees whole (no mask, no softcap, causal/window/key_lengths clear) skip the
//    contract's per-score rule and fold the scale into the exponent's FFMA; softcap keeps tanhf
//    (exact float32) and the masked path.
// Tiles: BLOCK_N = 4 WARP_KEYS = 128, 64, 32, 32 keys at head_dim 32, 64, 128, 256 (64 at 32 with
// 8 rows): a stage of K and V is 33-37 KiB (66 KiB at 256), the block 70-77 KiB (142 KiB at 256),
// so an SM holds 2-3 blocks (1 at 256) with ~70-100 KiB of K/V in flight, more than it needs to
// stream at its share of the bandwidth.  K/V rows are padded by 16 bytes, so 8 consecutive keys'
// chunks hit distinct banks.  Registers 106-184 (ptxas's own choice; head_dim 256 is allowed 255,
// where it capped itself at 128 and spilled), no spills.
constexpr float kRescaleSlack = 8.f;

template <int HEAD_DIM, int ROWS> struct Fp32DecodeShape {
    static constexpr int kVec = 4;                                   // floats per 16 bytes
    static constexpr int kChunks = HEAD_DIM / kVec;                  // 16-byte chunks per K/V row
    static constexpr int kKeyLanes = HEAD_DIM <= 32 ? ROWS / 4 : HEAD_DIM <= 64 ? 2 : 4;
    static constexpr int kWarpKeys = 32 / kKeyLanes;
    static constexpr int kBlockN = kDecodeWarps * kWarpKeys;
    static constexpr int kLaneChunks = kChunks / kKeyLanes;          // K chunks a lane reads a tile
    static constexpr int kLaneRows = ROWS / kKeyLanes;               // scores a lane holds
    static constexpr int kValueLanes = kChunks < 32 ? kChunks : 32;  // lanes across a V row
    static constexpr int kValueKeys = 32 / kValueLanes;              // V rows side by side
    static constexpr int kValueChunks = kChunks / kValueLanes;       // V chunks a lane owns
    static constexpr int kOut = kValueChunks * kVec;                 // output columns a lane owns
    static constexpr int kRow = HEAD_DIM + kVec;                     // padded K/V row (floats)
};

// N floats by value (what a lambda returns: nvcc 13's front end crashes on a generic lambda that
// takes an array by reference).
template <int N> struct Floats {
    float values[N];
    __device__ __forceinline__ float& operator[](int i) { return values[i]; }
    __device__ __forceinline__ float operator[](int i) const { return values[i]; }
};

// Four floats of `values` from `at` to or from 16-byte aligned shared memory, in one access.
template <int N> __device__ __forceinline__ void load4(float (&values)[N], int at, const float* source) {
    const float4 raw = *reinterpret_cast<const float4*>(source);
    values[at] = raw.x, values[at + 1] = raw.y, values[at + 2] = raw.z, values[at + 3] = raw.w;
}
template <int N> __device__ __forceinline__ void store4(float* dst, const float (&values)[N], int at) {
    *reinterpret_cast<float4*>(dst) = make_float4(values[at], values[at + 1], values[at + 2], values[at + 3]);
}
// N floats (1, 2 or a multiple of 4) to shared memory aligned to their size, in 4-, 8- or 16-byte stores.
template <int N> __device__ __forceinline__ void store_floats(float* dst, const float (&values)[N]) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 4) store4(dst + i, values, i);
    } else if constexpr (N == 2) {
        *reinterpret_cast<float2*>(dst) = make_float2(values[0], values[1]);
    } else {
        static_assert(N == 1, "1, 2 or a multiple of 4 floats");
        dst[0] = values[0];
    }
}

// RERUN: the second launch of a float32 decode (the same grid, before the combine).  The first
// weighs each key against the maximum of the keys before it in the warp's share of the split; where
// a key's weight is 0 against its row's maximum over all of its keys (an exp below the smallest
// normal) but was not then, a NaN or inf in its V stays in the output, where the reference has none.
// A RERUN block exits unless an output it wrote is non-finite; then it takes every row's maximum over
// all of its keys (all splits) from a walk of the masked scores alone, reduced over the key's lanes
// and the warps through the stages, and walks its split's keys once more shifted by it, writing its
// results again (as the tensor-core decode's row_maxima and walk_keys_under_zero_weight_rule do
// within the kernel; here that walk in the same kernel took flash_decode_fp32<64, 8> from 168
// registers to 255 and spilled).  The RERUN instances are bounded to one block an SM: left to itself
// ptxas held flash_decode_fp32<128, 8, true> at 168 registers and spilled 60 bytes (sm_90).
template <int HEAD_DIM, int ROWS, bool RERUN>
__global__ void __launch_bounds__(kDecodeThreads, RERUN || HEAD_DIM == 256 ? 1 : 0) flash_decode_fp32(const __grid_constant__ Params p) {
    using Shape = Fp32DecodeShape<HEAD_DIM, ROWS>;
    constexpr int kVec = Shape::kVec, kRow = Shape::kRow, kBlockN = Shape::kBlockN, kWarpKeys = Shape::kWarpKeys;
    constexpr int kKeyLanes = Shape::kKeyLanes, kLaneRows = Shape::kLaneRows, kOut = Shape::kOut;
    static_assert(ROWS % 4 == 0 && ROWS >= kKeyLanes, "4 or 8 rows, at least one a lane after the reduce-scatter");
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    float* q_tile = reinterpret_cast<float*>(shared_bytes);       // [ROWS][HEAD_DIM]
    float* p_tile = q_tile + ROWS * HEAD_DIM;                      // [warps][WARP_KEYS][ROWS]: this tile's P
    float* alpha_tile = p_tile + kDecodeWarps * kWarpKeys * ROWS;  // [warps][ROWS]: this tile's rescale
    float* stages = alpha_tile + kDecodeWarps * ROWS;              // K/V stages, then the merge
    const DecodeMerge<HEAD_DIM, ROWS> merge(stages);
    static_assert(DecodeMerge<HEAD_DIM, ROWS>::kBytes <= 4 * kBlockN * kRow * 4, "the merge fits in the K/V stages");

    const int split = blockIdx.x, b = blockIdx.z, group = p.group, seq_q = p.seq_q;
    const int chunks = (group * seq_q + ROWS - 1) / ROWS;
    const int kvh = blockIdx.y / chunks, row0 = (blockIdx.y % chunks) * ROWS;
    const int packed_rows = min(ROWS, group * seq_q - row0);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if constexpr (RERUN) {
        if (DecodeMerge<HEAD_DIM, ROWS>::written_finite(p, b, kvh, row0, packed_rows)) return;
    }

    int lo, hi;
    p.rules.key_range(b, p.seq_k, 0, seq_q - 1, &lo, &hi);
    lo = max(lo, split * p.keys_per_split);
    hi = min(hi, (split + 1) * p.keys_per_split);
    const ScoreRule rule{p};
    int interior_lo, interior_hi;  // tiles every row sees whole: no masking there
    rule.template interior_tiles<kBlockN>(b, p.seq_k, 0, seq_q - 1, lo, hi, &interior_lo, &interior_hi);
    if (p.softcap > 0.f) interior_hi = interior_lo;
    const KeyValueStream<float, HEAD_DIM, kBlockN, kDecodeThreads> stream{p, stages, b, kvh, hi};
    if constexpr (!RERUN) {  // (a RERUN block loads it after its walk of the scores)
        if (lo < hi) stream.load(0, lo);
        cp_async_commit();
    }

    for (int index = threadIdx.x; index < ROWS * HEAD_DIM; index += kDecodeThreads) {
        const int r = index / HEAD_DIM, d = index % HEAD_DIM, packed = row0 + r;
        float value = 0.f;
        if (r < packed_rows) value = p.q.row<const float>(b, kvh * group + packed / seq_q, packed % seq_q)[d];
        q_tile[index] = value;
    }

    // Scores: lane (part, key); after the reduce-scatter its rows part * kLaneRows + i as (head,
    // position), position seq_q past the pack (hidden).
    const int key = lane % kWarpKeys, part = lane / kWarpKeys;
    int heads[kLaneRows], positions[kLaneRows];
#pragma unroll
    for (int i = 0; i < kLaneRows; ++i) {
        const int local = part * kLaneRows + i, packed = row0 + local;
        heads[i] = local < packed_rows ? kvh * group + packed / seq_q : kvh * group;
        positions[i] = local < packed_rows ? packed % seq_q : seq_q;
    }
    // P V: lane (value key, column chunk).
    const int value_key = lane / Shape::kValueLanes, value_chunk = lane % Shape::kValueLanes;
    float* warp_p = p_tile + warp * kWarpKeys * ROWS;
    float* warp_alpha = alpha_tile + warp * ROWS;

    // Per row of the lane (after the reduce-scatter): the running maximum m (log2 units, -inf before
    // any visible key), the shift its probabilities are taken against (m, or 0 while m = -inf), the
    // bound on a score's excess over the shift that a lazy tile accepts (kRescaleSlack; -inf while
    // m = -inf, so that the first visible key rescales), and the lane's part of the row sum.
    float row_max[kLaneRows], shift[kLaneRows], bound[kLaneRows], row_sum[kLaneRows];
#pragma unroll
    for (int i = 0; i < kLaneRows; ++i) {
        row_max[i] = bound[i] = negative_infinity();
        shift[i] = row_sum[i] = 0.f;
    }
    float acc[ROWS][kOut];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int x = 0; x < kOut; ++x) acc[r][x] = 0.f;

    // The tile's scores of the lane's rows for key `key`: MASKED, in log2 units under the contract's
    // rule (-inf where hidden); else the raw dot products (the caller scales them).
    auto tile_scores = [&](auto masked, int kt, int stage) {
        constexpr bool MASKED = decltype(masked)::value;
        float dot[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) dot[r] = 0.f;
        const float* k_slice = stream.k_tile(stage) + (warp * kWarpKeys + key) * kRow + part * Shape::kLaneChunks * kVec;
        const float* q_slice = q_tile + part * Shape::kLaneChunks * kVec;
#pragma unroll
        for (int c = 0; c < Shape::kLaneChunks; ++c) {
            const float4 k4 = *reinterpret_cast<const float4*>(k_slice + c * kVec);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float4 q4 = *reinterpret_cast<const float4*>(q_slice + r * HEAD_DIM + c * kVec);
                dot[r] = fmaf(q4.w, k4.w, fmaf(q4.z, k4.z, fmaf(q4.y, k4.y, fmaf(q4.x, k4.x, dot[r]))));
            }
        }
        // Reduce-scatter over the key's lanes (xor step * WARP_KEYS): each step halves the rows a
        // lane keeps, the lane with the step's part bit set keeping the upper half.
#pragma unroll
        for (int step = kKeyLanes / 2; step > 0; step /= 2) {
            const int half = ROWS * step / kKeyLanes;
            const bool upper = (part & step) != 0;
#pragma unroll
            for (int i = 0; i < half; ++i) {
                const float send = upper ? dot[i] : dot[i + half];
                const float keep = upper ? dot[i + half] : dot[i];
                dot[i] = keep + __shfl_xor_sync(0xffffffff, send, step * kWarpKeys);
            }
        }
        const int j = kt + warp * kWarpKeys + key;
        Floats<kLaneRows> score;
#pragma unroll
        for (int i = 0; i < kLaneRows; ++i) {
            score[i] = dot[i];
            if constexpr (MASKED)
                score[i] = positions[i] < seq_q && j < hi
                               ? p.rules.apply(soft_cap(dot[i] * p.scale, p.softcap), b, heads[i], positions[i], j) * kLog2e
                               : negative_infinity();
        }
        return score;
    };

    // O = alpha O + P V (RESCALE) or O + P V for this lane's columns, from the tile's V and the
    // warp's P and alpha.  EXACT: with weighted_add's zero-weight rule.  Else plain FMAs, and false
    // (O left as it was) when that made a NaN in any lane's output: the caller redoes it exactly.
    auto update_output = [&](auto exact, auto rescale, int stage) -> bool {
        constexpr bool EXACT = decltype(exact)::value, RESCALE = decltype(rescale)::value;
        const float* v_rows = stream.v_tile(stage) + warp * kWarpKeys * kRow;
        float next[ROWS][kOut];
        if constexpr (RESCALE) {
            float alpha[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; r += 4) load4(alpha, r, warp_alpha + r);
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int x = 0; x < kOut; ++x) next[r][x] = EXACT ? weighted_add(alpha[r], acc[r][x], 0.f) : alpha[r] * acc[r][x];
        } else {
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int x = 0; x < kOut; ++x) next[r][x] = acc[r][x];
        }
#pragma unroll
        for (int n = 0; n < kWarpKeys / Shape::kValueKeys; ++n) {
            const int v_key = value_key + n * Shape::kValueKeys;
            float v[kOut], weights[ROWS];
#pragma unroll
            for (int c = 0; c < Shape::kValueChunks; ++c)
                load4(v, c * kVec, v_rows + v_key * kRow + (value_chunk + c * Shape::kValueLanes) * kVec);
#pragma unroll
            for (int r = 0; r < ROWS; r += 4) load4(weights, r, warp_p + v_key * ROWS + r);
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int x = 0; x < kOut; ++x)
                    next[r][x] = EXACT ? weighted_add(weights[r], v[x], next[r][x]) : fmaf(weights[r], v[x], next[r][x]);
        }
        if constexpr (!EXACT) {
            float probe = 0.f;
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int x = 0; x < kOut; ++x) probe += next[r][x];
            if (__any_sync(0xffffffff, probe != probe)) return false;
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int x = 0; x < kOut; ++x) acc[r][x] = next[r][x];
        return true;
    };

    // A tile that keeps every row's shift: false (nothing changed) when a score of the warp is over
    // its row's shift by more than the bound, or the plain FMAs made a NaN.
    auto lazy_tile = [&](auto masked, int kt, int stage) -> bool {
        constexpr bool MASKED = decltype(masked)::value;
        const Floats<kLaneRows> score = tile_scores(masked, kt, stage);
        float excess[kLaneRows], prob[kLaneRows];
        bool over = false;
#pragma unroll
        for (int i = 0; i < kLaneRows; ++i) {
            excess[i] = MASKED ? score[i] - shift[i] : fmaf(score[i], rule.scale_log2, -shift[i]);
            over = over || excess[i] > bound[i];
        }
        if (__any_sync(0xffffffff, over)) return false;
#pragma unroll
        for (int i = 0; i < kLaneRows; ++i) prob[i] = fast_exp2(excess[i]);
        store_floats(warp_p + key * ROWS + part * kLaneRows, prob);
        __syncwarp();
        if (!update_output(Flag<false>{}, Flag<false>{}, stage)) return false;
#pragma unroll
        for (int i = 0; i < kLaneRows; ++i) row_sum[i] += prob[i];
        return true;
    };

    // The online softmax step with the tile's row maxima (the first tile, a score over the bound, a
    // NaN): every row shifted to its new maximum, O and the sums rescaled.
    auto rescaling_tile = [&](auto masked, int kt, int stage) {
        constexpr bool MASKED = decltype(masked)::value;
        const Floats<kLaneRows> score = tile_scores(masked, kt, stage);
        float prob[kLaneRows], alpha[kLaneRows];
#pragma unroll
        for (int i = 0; i < kLaneRows; ++i) {
            float tile_max = score[i];
#pragma unroll
            for (int width = kWarpKeys / 2; width > 0; width /= 2)
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, width));
            if constexpr (!MASKED) tile_max *= rule.scale_log2;
            const float new_max = fmaxf(row_max[i], tile_max);
            const bool none = new_max == negative_infinity();
            alpha[i] = fast_exp2(row_max[i] - (none ? 0.f : new_max));
            row_max[i] = new_max;
            shift[i] = none ? 0.f : new_max;
            bound[i] = none ? negative_infinity() : kRescaleSlack;
            prob[i] = fast_exp2(MASKED ? score[i] - shift[i] : fmaf(score[i], rule.scale_log2, -shift[i]));
            row_sum[i] = fmaf(row_sum[i], alpha[i], prob[i]);
        }
        store_floats(warp_p + key * ROWS + part * kLaneRows, prob);
        if (key == 0) store_floats(warp_alpha + part * kLaneRows, alpha);
        __syncwarp();
        if (!update_output(Flag<false>{}, Flag<true>{}, stage)) {
            __syncwarp();  // reread V and P rather than keep them live
            update_output(Flag<true>{}, Flag<true>{}, stage);
        }
    };

    if constexpr (RERUN) {
        // Every row's maximum over all of its keys: the masked scores of [first, last) (hi, which
        // tile_scores hides keys from, is last meanwhile), over the key's lanes, then the warps.
        int first, last;
        p.rules.key_range(b, p.seq_k, 0, seq_q - 1, &first, &last);
        const int split_hi = hi;
        hi = last;
        visit_key_tiles<float, HEAD_DIM, kBlockN>(p, stages, b, kvh, first, last, [&](int kt, int stage) {
            const Floats<kLaneRows> score = tile_scores(Flag<true>{}, kt, stage);
#pragma unroll
            for (int i = 0; i < kLaneRows; ++i) row_max[i] = fmaxf(row_max[i], score[i]);
        });
        hi = split_hi;
        float* maxima = stages;  // [warps][ROWS]
#pragma unroll
        for (int i = 0; i < kLaneRows; ++i) {
#pragma unroll
            for (int width = kWarpKeys / 2; width > 0; width /= 2)
                row_max[i] = fmaxf(row_max[i], __shfl_xor_sync(0xffffffff, row_max[i], width));
            if (key == 0) maxima[warp * ROWS + part * kLaneRows + i] = row_max[i];
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < kLaneRows; ++i) {
#pragma unroll
            for (int w = 0; w < kDecodeWarps; ++w) row_max[i] = fmaxf(row_max[i], maxima[w * ROWS + part * kLaneRows + i]);
            const bool none = row_max[i] == negative_infinity();
            shift[i] = none ? 0.f : row_max[i];
            bound[i] = none ? negative_infinity() : kRescaleSlack;
        }
        __syncthreads();  // the stages are loaded next
        if (lo < hi) stream.load(0, lo);
        cp_async_commit();
    }

    // Tiles [kt, end): lazy tiles in the loop that streams the cache; a tile that needs more is
    // redone as a rescaling tile outside it.  The barrier at each tile's end: its stage (and the
    // warp's P) is overwritten by the tile after next.
    int kt = lo, stage = 0;
    auto walk = [&](auto masked, int end) {
        while (kt < end) {
            for (; kt < end; kt += kBlockN, stage ^= 1) {
                stream.next(kt, stage);
                if (!lazy_tile(masked, kt, stage)) break;
                __syncthreads();
            }
            if (kt >= end) break;
            __syncwarp();  // the lazy tile's reads of the warp's P are done
            rescaling_tile(masked, kt, stage);
            __syncthreads();
            kt += kBlockN, stage ^= 1;
        }
    };
    // Edge tiles (window start), interior tiles, edge tiles (diagonal, key_lengths, split end).
    walk(Flag<true>{}, interior_lo);
    walk(Flag<false>{}, interior_hi);
    walk(Flag<true>{}, hi);
    cp_async_wait<0>();
    __syncthreads();  // the stages become the merge buffer

    // Row sums over the warp's keys; outputs over the V rows side by side.
#pragma unroll
    for (int i = 0; i < kLaneRows; ++i) {
#pragma unroll
        for (int width = kWarpKeys / 2; width > 0; width /= 2) row_sum[i] += __shfl_xor_sync(0xffffffff, row_sum[i], width);
        if (key == 0) {
            merge.row_max[warp * ROWS + part * kLaneRows + i] = row_max[i];
            merge.row_sum[warp * ROWS + part * kLaneRows + i] = row_sum[i];
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int width = Shape::kValueLanes; width < 32; width *= 2)
#pragma unroll
            for (int x = 0; x < kOut; ++x) acc[r][x] += __shfl_xor_sync(0xffffffff, acc[r][x], width);
        if (value_key == 0)
#pragma unroll
            for (int c = 0; c < Shape::kValueChunks; ++c)
                store4(merge.output + (warp * ROWS + r) * HEAD_DIM + (value_chunk + c * Shape::kValueLanes) * kVec, acc[r],
                       c * kVec);
    }
    merge.template finish<float>(p, b, kvh, row0, packed_rows);
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
