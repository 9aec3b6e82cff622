// Flash attention forward for NVIDIA tensor cores (sm_80+), float16 / bfloat16 in, float32 math.
//
// STATUS: ran on an H100 before issue #20 (issue #6; at 0.44-0.47x of FlashAttention-2,
// see issue #21).  Issue #20's form (one Params argument, dropout, the shared tile pipeline of
// mma_tiles.cuh) has run only in the SIMT emulator (fastattn/_gpu/emulator) and compiled with nvcc
// for sm_80/sm_90; benchmarks/gpu_check.sh owes the device run.
//
// Algorithm (FlashAttention-2): one thread block per (64 query rows, query head, batch row), the
// query blocks of a head launched last-first (under causal masking the heaviest first);
// 4 warps, each owning 16 query rows for the whole key loop, so the online softmax needs only
// shuffles inside a quad of lanes.  Per key tile of BLOCK_N keys:
//   S = Q K^T      mma.sync.m16n8k16 (A = Q rows via ldmatrix, B = K rows via ldmatrix)
//   online softmax in registers: running max m, sum l, exp2 with scale*log2(e) folded in
//   O += P V       (A = P re-packed from the S accumulators, B = V via ldmatrix.trans)
// K and V tiles are double-buffered in shared memory with cp.async (16-byte copies, zero-filled
// past the sequence end), so the next tile loads while the tensor cores work on this one.
// Shared-memory rows are padded by 8 elements so that ldmatrix's 8 row addresses hit distinct
// banks.  Tile sizes: BLOCK_M = 64 (4 warps x m16), BLOCK_N = 64 keys (32 for head_dim 256, to
// keep two K/V stages within the shared memory an SM can give one block).
//
// Contract features, all in-kernel: GQA (query head h reads kv head h / group), causal with both
// alignments (`offset` = key position of query 0), sliding window, key_lengths (the key loop stops
// at the last visible tile; fully masked tiles are never loaded), bool or float mask read by
// strides, softcap, any strides with a contiguous last axis (16-byte aligned rows), and attention
// dropout in the DROPOUT instances (the kept probabilities, times 1 / (1 - p), enter P V; the row
// sum and lse are those of the undropped probabilities, as the reference defines them).  A row that
// sees no key writes 0 and lse = -inf.
#include "mma_tiles.cuh"

namespace fastattn_gpu {

constexpr int kWarps = 4;
constexpr int kBlockM = 16 * kWarps;

template <typename Elem, int HEAD_DIM, int BLOCK_N, bool SOFTCAP, bool DROPOUT>
__global__ void __launch_bounds__(kWarps * 32, 2) flash_forward(const __grid_constant__ Params p) {
    constexpr int kRow = HEAD_DIM + kPad;
    constexpr int kKeyBlocks = BLOCK_N / 8;
    constexpr int kOutBlocks = HEAD_DIM / 8;
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Elem* q_tile = reinterpret_cast<Elem*>(shared_bytes);  // [kBlockM][kRow], then the K/V stages

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // Query blocks in reverse: under causal masking the last see the most keys, and the blocks launched
    // last (the tail of the grid) are then the lightest.
    const int m0 = (gridDim.x - 1 - blockIdx.x) * kBlockM, h = blockIdx.y, b = blockIdx.z, kvh = h / p.group;
    const ScoreRule rule{p};
    int lo;  // the keys any row of this block can see: [lo, hi)
    const auto stream = KeyValueStream<Elem, HEAD_DIM, BLOCK_N, kWarps * 32>::template visible_to<kBlockM>(
        p, q_tile + kBlockM * kRow, b, kvh, m0, &lo);
    const int hi = stream.hi;
    int interior_lo, interior_hi;  // tiles every row sees whole: no masking there
    rule.template interior_tiles<BLOCK_N>(b, p.seq_k, m0, min(m0 + kBlockM, p.seq_q) - 1, lo, hi, &interior_lo,
                                          &interior_hi);

    load_tile<Elem, HEAD_DIM, kBlockM, kWarps * 32>(q_tile, p.q.row<const Elem>(b, h, 0), p.q.ss, m0, p.seq_q);
    if (lo < hi) stream.load(0, lo);
    cp_async_commit();

    const int group_id = lane / 4, pair = (lane % 4) * 2;
    const int rows[2] = {m0 + warp * 16 + group_id, m0 + warp * 16 + group_id + 8}, heads[2] = {h, h};
    float row_max[2] = {negative_infinity(), negative_infinity()}, row_sum[2] = {0.f, 0.f};
    float acc[kOutBlocks][4];
    zero(acc);

    // One key tile; MASKED applies the contract's exact rule to every score, else the tile is
    // interior (every row sees every key) and the scores are only scaled (and softcapped).  RAW: an
    // interior tile without softcap keeps the raw dot products, takes their maximum, and folds the
    // scale into the exponent's FFMA (exp2(dot scale log2e - max)); interior tiles need scale > 0.
    // EXACT: P V in SIMT float math with the zero-weight rule (exact_product_registers).
    auto tile = [&](auto masked, auto exact, int kt, int stage) {
        constexpr bool MASKED = decltype(masked)::value, EXACT = decltype(exact)::value;
        constexpr bool RAW = !MASKED && !SOFTCAP;
        stream.next(kt, stage);

        // S = Q K^T for this warp's 16 rows and BLOCK_N keys.
        float s[kKeyBlocks][4];
        zero(s);
        warp_product_nt<Elem, HEAD_DIM, kKeyBlocks>(s, q_tile + warp * 16 * kRow, stream.k_tile(stage), kRow, lane);

        // Scores in log2 units, then the online softmax.
        rule.template tile_log2_scores<MASKED, SOFTCAP>(s, b, heads, rows, kt + pair, hi);
        unsigned int probs[kKeyBlocks / 2][4];
        online_softmax_tile<Elem, RAW, EXACT>(s, rule.scale_log2, row_max, row_sum, acc, probs, [&](int nb, float (&prob)[4]) {
            if constexpr (DROPOUT) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    float factors[2];
                    p.dropout.pair(b, p.heads_q, h, rows[r], kt + nb * 8 + pair, factors);
                    prob[2 * r] *= factors[0];
                    prob[2 * r + 1] *= factors[1];
                }
            }
        });

        // O += P V: k = keys (16 per step), n = head_dim.
        if constexpr (EXACT)
            exact_product_registers<Elem, kKeyBlocks / 2, kOutBlocks>(acc, probs, stream.v_tile(stage), kRow, lane);
        else
            warp_product_registers<Elem, kKeyBlocks / 2, kOutBlocks>(acc, probs, stream.v_tile(stage), kRow, lane);
        __syncthreads();  // this stage is overwritten by the prefetch of the tile after next
    };

    // Edge tiles (window start), interior tiles, edge tiles (diagonal, key_lengths, sequence end);
    // then every thread's copies into the Q tile have landed (also in a block with no key tile).
    walk_keys_under_zero_weight_rule<BLOCK_N>(stream, lo, interior_lo, interior_hi, hi, row_max, row_sum, acc, tile,
                                              [] {});

    // Normalise into this warp's own rows of the Q tile (no warp reads Q any more), then write out
    // as whole rows, 16 bytes a lane and store (FlashAttention-2 stages O the same way), and lse in
    // natural log; rows that saw nothing get 0 and -inf.
    Elem* staged = q_tile + warp * 16 * kRow;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float total = row_sum[r];
        total += __shfl_xor_sync(0xffffffff, total, 1);
        total += __shfl_xor_sync(0xffffffff, total, 2);
        // __fdividef: an approximate reciprocal (2 ulp, far below a 16-bit output's rounding) with no
        // IEEE slow-path call, whose calling convention made ptxas spill.
        store_row_pairs<Elem, kOutBlocks>(staged + (group_id + 8 * r) * kRow, acc, r,
                                          total > 0.f ? __fdividef(1.f, total) : 0.f, lane);
        if (rows[r] < p.seq_q && (lane % 4) == 0)
            *p.lse.row<float>(b, h, rows[r]) = total > 0.f ? (row_max[r] + log2f(total)) * kLn2 : negative_infinity();
    }
    __syncthreads();  // each warp reads back rows its other lanes wrote
    constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks of a row
#pragma unroll
    for (int index = lane; index < 16 * kChunks; index += 32) {
        const int r = index / kChunks, chunk = index % kChunks, row = m0 + warp * 16 + r;
        if (row < p.seq_q)
            *reinterpret_cast<uint4*>(p.out.row<Elem>(b, h, row) + chunk * 8) =
                *reinterpret_cast<const uint4*>(staged + r * kRow + chunk * 8);
    }
}

}  // namespace fastattn_gpu
