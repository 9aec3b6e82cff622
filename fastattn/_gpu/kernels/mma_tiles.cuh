// The tile pipeline of the tensor-core kernels (flash_forward.cu, flash_backward.cu): packed pairs
// for mma.sync (the PTX helpers themselves are in ptx.cuh), padded cp.async tile loads, the
// double-buffered stream of K/V tiles, the two warp-level products every pass is made of, and
// ScoreRule: the contract's scores (DESIGN.md §3) on top of common.cuh's Visibility, which the
// decode and float32 kernels use too, so that every kernel hides exactly the same keys.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with 16-bit inputs): a warp's A operand is 16 rows x 16
// k, loaded by one ldmatrix.x4 from a row-major tile; its B operand is 16 k x 8 columns, loaded
// two k-steps (or two column blocks) per ldmatrix.x4.  The *_offset helpers give each lane's
// ldmatrix row address for those loads, in elements from the tile's first row.
#pragma once
#include "common.cuh"

namespace fastattn_gpu {

constexpr int kPad = 8;  // elements of padding per shared-memory row: ldmatrix rows hit distinct banks

// Elements of one 16-byte chunk (a cp.async copy); the K/V tiles of any element type are padded by
// one chunk a row (kPad for the 16-bit ones), so that 8 rows' 16-byte reads hit distinct banks.
template <typename Elem> constexpr int kChunk = 16 / static_cast<int>(sizeof(Elem));

template <typename Elem> struct Pack;
template <> struct Pack<__half> {
    // The smallest weight a packed P keeps above 0: float16's smallest subnormal, 2^-24 (float32
    // weights reach down to 2^-126; bfloat16 keeps every one of them, so its value is 0: no floor).
    static constexpr float kSmallestWeight = 5.9604645e-8f;
    static __device__ __forceinline__ unsigned int two(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<unsigned int*>(&v);
    }
    static __device__ __forceinline__ void mma(float* c, const unsigned int* a, const unsigned int* b) {
        mma_m16n8k16_f16(c, a, b);
    }
    // Element `index` (0: the low half) of a packed pair.
    static __device__ __forceinline__ float element(unsigned int pair, int index) {
        return __half2float(__ushort_as_half(static_cast<unsigned short>(index ? pair >> 16 : pair & 0xffffu)));
    }
};
template <> struct Pack<__nv_bfloat16> {
    static constexpr float kSmallestWeight = 0.f;
    static __device__ __forceinline__ unsigned int two(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<unsigned int*>(&v);
    }
    static __device__ __forceinline__ void mma(float* c, const unsigned int* a, const unsigned int* b) {
        mma_m16n8k16_bf16(c, a, b);
    }
    static __device__ __forceinline__ float element(unsigned int pair, int index) {
        return __uint_as_float(index ? pair & 0xffff0000u : pair << 16);
    }
};

// A operand (16 rows x 16 k) of a row-major tile with `stride` elements per row.
__device__ __forceinline__ int a_offset(int lane, int stride) { return (lane & 15) * stride + (lane >> 4) * 8; }
// B operands of two k-steps (k = columns) from a row-major [n][k] tile: 8 rows n.
__device__ __forceinline__ int b_offset(int lane, int stride) { return (lane & 7) * stride + (lane >> 3) * 8; }
// B operands of two 8-column blocks from a row-major [k][n] tile (ldmatrix.trans): 16 rows k.
__device__ __forceinline__ int bt_offset(int lane, int stride) {
    return ((lane & 7) + ((lane >> 3) & 1) * 8) * stride + (lane >> 4) * 8;
}
// A operand (16 rows x 16 k) read transposed (ldmatrix.trans) from a [k][row] tile.
__device__ __forceinline__ int at_offset(int lane, int stride) {
    return ((lane & 7) + ((lane >> 4) & 1) * 8) * stride + ((lane >> 3) & 1) * 8;
}

// Copy `ROWS` rows (from `first`, zero past `limit`) of HEAD_DIM elements into a smem tile padded by
// one 16-byte chunk a row,
// with THREADS threads of the block taking 16-byte chunks in turn.  When a thread's chunks stay in
// one column (THREADS a multiple of the chunks per row: every head_dim but 96) the trip count is a
// constant, the loop unrolls, and each copy costs its cp.async and an address add: the row pointer
// is formed once and advances by THREADS / (HEAD_DIM / 8) rows a trip.
template <typename Elem, int HEAD_DIM, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(Elem* tile, const Elem* base, long long row_stride, long long first,
                                          long long limit) {
    constexpr int kVec = kChunk<Elem>, kRow = HEAD_DIM + kVec;
    constexpr int kChunksPerRow = HEAD_DIM / kVec;
    constexpr int kChunks = ROWS * kChunksPerRow;
    if constexpr (THREADS % kChunksPerRow == 0) {
        constexpr int kRowStep = THREADS / kChunksPerRow;
        const int row0 = threadIdx.x / kChunksPerRow, col = (threadIdx.x % kChunksPerRow) * kVec;
        const Elem* src = base + (first + row0) * row_stride + col;
        Elem* dst = tile + row0 * kRow + col;
        const long long step = kRowStep * row_stride;
        const int rows_left = static_cast<int>(min(limit - first - row0, static_cast<long long>(ROWS)));
#pragma unroll
        for (int trip = 0; trip < (kChunks + THREADS - 1) / THREADS; ++trip) {
            // A row past `limit` is zero-filled: cp.async reads no byte of its (unused) address.
            if (kChunks % THREADS == 0 || row0 + trip * kRowStep < ROWS)
                cp_async_16(dst + trip * kRowStep * kRow, src + trip * step, trip * kRowStep < rows_left);
        }
    } else {
        for (int chunk = threadIdx.x; chunk < kChunks; chunk += THREADS) {
            const int row = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * kVec;
            const bool valid = first + row < limit;
            const Elem* src = base + (valid ? (first + row) * row_stride : 0) + col;
            cp_async_16(tile + row * kRow + col, src, valid);
        }
    }
}

// K and V tiles of BLOCK_N keys streamed through two shared-memory stages: while one stage is
// computed on, cp.async fills the other with the next tile (zero past `hi`).  Used as
//   stream.load(0, lo); cp_async_commit();
//   for (kt = lo, stage = 0; kt < hi; kt += BLOCK_N, stage ^= 1) { stream.next(kt, stage); ...; __syncthreads(); }
//   cp_async_wait<0>();
template <typename Elem, int HEAD_DIM, int BLOCK_N, int THREADS> struct KeyValueStream {
    static constexpr int kRow = HEAD_DIM + kChunk<Elem>;
    // Only what the call's Params cannot give: the rest (addresses, strides) is read from the
    // constant bank at each load, so no register holds it across the key loop.
    const Params& p;
    Elem* stages;  // [2][BLOCK_N][kRow] K, then [2][BLOCK_N][kRow] V
    int b, kvh, hi;

    // The stream over the keys that query rows [m0, m0 + ROWS) of batch row b can see, from kv head
    // kvh, with its stages at `stages` (4 BLOCK_N kRow elements); *lo gets the first tile's first
    // key (rounded down to a whole tile).
    template <int ROWS>
    static __device__ __forceinline__ KeyValueStream visible_to(const Params& p, Elem* stages, int b, int kvh, int m0,
                                                                int* lo) {
        int first, hi;
        p.rules.key_range(b, p.seq_k, m0, min(m0 + ROWS, p.seq_q) - 1, &first, &hi);
        *lo = max(first, 0) / BLOCK_N * BLOCK_N;
        return {p, stages, b, kvh, hi};
    }

    __device__ __forceinline__ void load(int stage, int first) const {
        load_tile<Elem, HEAD_DIM, BLOCK_N, THREADS>(k_tile(stage), p.k.row<const Elem>(b, kvh, 0), p.k.ss, first, hi);
        load_tile<Elem, HEAD_DIM, BLOCK_N, THREADS>(v_tile(stage), p.v.row<const Elem>(b, kvh, 0), p.v.ss, first, hi);
    }
    // Prefetch the tile after `kt` into the other stage, then wait for this stage's tile.
    __device__ __forceinline__ void next(int kt, int stage) const {
        if (kt + BLOCK_N < hi) load(stage ^ 1, kt + BLOCK_N);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
    }
    __device__ __forceinline__ Elem* k_tile(int stage) const { return stages + stage * BLOCK_N * kRow; }
    __device__ __forceinline__ Elem* v_tile(int stage) const { return stages + (2 + stage) * BLOCK_N * kRow; }
};

// c[n] += A B^T for one warp: A = 16 rows of `a_rows` (row-major, K_DIM columns), B = the N_BLOCKS * 8
// rows of `b_rows`; both with `stride` elements per row.  c[n] is the m16n8 accumulator of columns
// 8n .. 8n + 7.
template <typename Elem, int K_DIM, int N_BLOCKS>
__device__ __forceinline__ void warp_product_nt(float (&c)[N_BLOCKS][4], const Elem* a_rows, const Elem* b_rows,
                                                int stride, int lane) {
    static_assert(K_DIM % 32 == 0, "k-steps come in pairs");
    constexpr int kBytes = sizeof(Elem);
    const SharedAddress a_base = shared_address(a_rows + a_offset(lane, stride));
    const SharedAddress b_base = shared_address(b_rows + b_offset(lane, stride));
#pragma unroll
    for (int step = 0; step < K_DIM / 16; step += 2) {
        unsigned int a[2][4];
        ldmatrix_x4(a[0], a_base + step * 16 * kBytes);
        ldmatrix_x4(a[1], a_base + (step + 1) * 16 * kBytes);
#pragma unroll
        for (int nb = 0; nb < N_BLOCKS; ++nb) {
            unsigned int b[4];  // b fragments for k-steps `step` (b[0..1]) and `step + 1` (b[2..3])
            ldmatrix_x4(b, b_base + (nb * 8 * stride + step * 16) * kBytes);
            Pack<Elem>::mma(c[nb], a[0], b);
            Pack<Elem>::mma(c[nb], a[1], b + 2);
        }
    }
}

// c[n] += A B for one 16-step of k: A in registers (an m16k16 fragment), B = 16 rows at `b_base`, the
// shared address of a row-major [k][n] tile plus bt_offset(lane, stride), read with ldmatrix.trans;
// columns 8n .. 8n + 7 for n < N_BLOCKS.
template <typename Elem, int N_BLOCKS>
__device__ __forceinline__ void warp_product_step(float (&c)[N_BLOCKS][4], const unsigned int* a, SharedAddress b_base) {
    static_assert(N_BLOCKS % 2 == 0, "pairs of n8 blocks per ldmatrix.x4.trans");
#pragma unroll
    for (int nb = 0; nb < N_BLOCKS; nb += 2) {
        unsigned int b[4];  // n-blocks nb (b[0..1]) and nb + 1 (b[2..3])
        ldmatrix_x4_trans(b, b_base + nb * 8 * static_cast<int>(sizeof(Elem)));
        Pack<Elem>::mma(c[nb], a, b);
        Pack<Elem>::mma(c[nb + 1], a, b + 2);
    }
}

// c[n] += A B over K_STEPS 16-steps of k: A in registers (a[s] is the m16k16 fragment of step s,
// as built from S accumulators), B = the K_STEPS * 16 rows of `b_rows` (row-major [k][n]).
template <typename Elem, int K_STEPS, int N_BLOCKS>
__device__ __forceinline__ void warp_product_registers(float (&c)[N_BLOCKS][4], const unsigned int (&a)[K_STEPS][4],
                                                       const Elem* b_rows, int stride, int lane) {
    const SharedAddress b_base = shared_address(b_rows + bt_offset(lane, stride));
#pragma unroll
    for (int ks = 0; ks < K_STEPS; ++ks)
        warp_product_step<Elem, N_BLOCKS>(c, a[ks], b_base + ks * 16 * stride * static_cast<int>(sizeof(Elem)));
}

// What warp_product_registers computes, c += A B, in SIMT float math with weighted_add's rule (a
// weight of exactly 0 contributes 0 even against an inf/NaN element of B), where the tensor cores
// would make 0 x inf = NaN: the slow path of the rare call whose tensor-core result came out NaN.
// Lane (g, t) = (lane / 4, lane % 4) owns rows g and g + 8 of c and columns 8n + 2t + {0, 1}; row
// g's weights for keys 2t, 2t + 1, 2t + 8, 2t + 9 of each 16-key step sit in lane 4g + t's A
// fragment (a0/a2, row g + 8's in a1/a3), whence the shuffles.  B's elements are read one by one.
// A cold path: the loop over a half step's 8 keys stays a loop (unrolled, it made the kernels'
// code several times larger, and their compile time with it).
template <typename Elem, int K_STEPS, int N_BLOCKS>
__device__ void exact_product_registers(float (&c)[N_BLOCKS][4], const unsigned int (&a)[K_STEPS][4],
                                        const Elem* b_rows, int stride, int lane) {
    const int quad = lane & ~3, column = (lane % 4) * 2;
#pragma unroll
    for (int ks = 0; ks < K_STEPS; ++ks) {
#pragma unroll
        for (int reg = 0; reg < 4; reg += 2) {  // keys 0-7 of the step in a0/a1, keys 8-15 in a2/a3
#pragma unroll 1
            for (int k8 = 0; k8 < 8; ++k8) {
                const int owner = quad + k8 / 2, kk = reg * 4 + k8;
                const float top = Pack<Elem>::element(__shfl_sync(0xffffffff, a[ks][reg], owner), k8 % 2);
                const float bottom = Pack<Elem>::element(__shfl_sync(0xffffffff, a[ks][reg + 1], owner), k8 % 2);
                const Elem* b_row = b_rows + (ks * 16 + kk) * stride + column;
#pragma unroll
                for (int nb = 0; nb < N_BLOCKS; ++nb)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float value = Convert<Elem>::to_float(b_row[nb * 8 + e]);
                        c[nb][e] = weighted_add(top, value, c[nb][e]);
                        c[nb][2 + e] = weighted_add(bottom, value, c[nb][2 + e]);
                    }
            }
        }
    }
}

// Accumulator row r (0: the lane's row lane / 4, 1: that row + 8) of c, times `factor`, into the
// 16-bit elements dst[8n + (lane % 4) * 2 + {0, 1}] as packed pairs.
template <typename Elem, int N_BLOCKS>
__device__ __forceinline__ void store_row_pairs(Elem* dst, const float (&c)[N_BLOCKS][4], int r, float factor,
                                                int lane) {
    const int pair = (lane % 4) * 2;
#pragma unroll
    for (int nb = 0; nb < N_BLOCKS; ++nb)
        *reinterpret_cast<unsigned int*>(dst + nb * 8 + pair) =
            Pack<Elem>::two(c[nb][2 * r] * factor, c[nb][2 * r + 1] * factor);
}

template <int N_BLOCKS> __device__ __forceinline__ void zero(float (&c)[N_BLOCKS][4]) {
#pragma unroll
    for (int nb = 0; nb < N_BLOCKS; ++nb) c[nb][0] = c[nb][1] = c[nb][2] = c[nb][3] = 0.f;
}

// One key tile of the online softmax (FlashAttention-2) of a warp's 16 rows, in registers: from the
// tile's scores s (log2 units; RAW: raw dot products, whose scale enters the exponent's FFMA, and
// then the maximum is taken of raw dots, which needs scale > 0), update the running max and sum of
// the lane's two rows (lane / 4 and lane / 4 + 8; the quad's shuffles make them the whole row's),
// rescale the output accumulator, and pack P = exp2(score - max) as the A fragments of P V.
// `weigh(nb, prob)` may change key block nb's four probabilities after they entered the row sum
// (dropout: lse and the normaliser stay undropped).  EXACT: the rescale by weighted_add's rule (a
// rescale of 0 clears an inf/NaN output; see exact_product_registers), and a weight above 0 that
// float16 would round to 0 packs as float16's smallest (Pack::kSmallestWeight), so that the exact
// products skip only the weights that are 0 in float32, as the reference does (a NaN/inf in the V
// row of a key weighing ~1e-9 reaches the row; the floor adds at most 6e-8 |V| where V is finite).
template <typename Elem, bool RAW, bool EXACT = false, int KEY_BLOCKS, int OUT_BLOCKS, typename Weigh>
__device__ __forceinline__ void online_softmax_tile(const float (&s)[KEY_BLOCKS][4], float scale_log2,
                                                    float (&row_max)[2], float (&row_sum)[2],
                                                    float (&acc)[OUT_BLOCKS][4],
                                                    unsigned int (&probs)[KEY_BLOCKS / 2][4], Weigh weigh) {
    float tile_max[2] = {negative_infinity(), negative_infinity()};
#pragma unroll
    for (int nb = 0; nb < KEY_BLOCKS; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) tile_max[e / 2] = fmaxf(tile_max[e / 2], s[nb][e]);
    float alpha[2], shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 2));
        if constexpr (RAW) tile_max[r] *= scale_log2;
        const float new_max = fmaxf(row_max[r], tile_max[r]);
        shift[r] = new_max == negative_infinity() ? 0.f : new_max;
        alpha[r] = fast_exp2(row_max[r] - shift[r]);
        row_max[r] = new_max;
        row_sum[r] *= alpha[r];
    }
#pragma unroll
    for (int nb = 0; nb < OUT_BLOCKS; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nb][e] = EXACT ? weighted_add(alpha[e / 2], acc[nb][e], 0.f) : acc[nb][e] * alpha[e / 2];
#pragma unroll
    for (int nb = 0; nb < KEY_BLOCKS; ++nb) {
        float prob[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            prob[e] = RAW ? fast_exp2(fmaf(s[nb][e], scale_log2, -shift[e / 2])) : fast_exp2(s[nb][e] - shift[e / 2]);
            row_sum[e / 2] += prob[e];
        }
        weigh(nb, prob);
        if constexpr (EXACT)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (prob[e] > 0.f && prob[e] < Pack<Elem>::kSmallestWeight) prob[e] = Pack<Elem>::kSmallestWeight;
        // S accumulators (m16n8) -> A fragment (m16k16) of P: block 2t fills a0/a1, 2t+1 a2/a3.
        probs[nb / 2][(nb % 2) * 2 + 0] = Pack<Elem>::two(prob[0], prob[1]);
        probs[nb / 2][(nb % 2) * 2 + 1] = Pack<Elem>::two(prob[2], prob[3]);
    }
}

// The key walk of the tensor-core forward and decode, under the zero-weight rule: tiles [lo, hi) of
// BLOCK_N keys, masked (edge) tiles before interior_lo and from interior_hi, each run as
// `tile(masked, exact, kt, stage)` (Flag arguments), the first tile's copy already in flight; at the
// end the stream's copies have landed and the block is synchronised.  On the tensor cores a weight
// of 0 times an inf/NaN value (a key hidden from a row but in a tile with keys other rows see:
// mask, window, the causal diagonal) is NaN, and a NaN stays in the accumulator.  And a weight is
// the reference's exp(s - m) against the row's final maximum m, flushed below the smallest normal
// float: a key weighed against the maximum so far (the maximum came in a later tile) can get a
// weight above 0 that the final maximum flushes, and its inf/NaN stays too.  So when any
// accumulator of the block is not finite after the walk, the sums and accumulators start over
// from the walk's final maxima, and the block walks its keys again with exact products, every
// weight against the final maximum (inputs without inf/NaN never do; an inf/NaN the rule keeps
// comes out again).  Before the second walk `settle()` may raise the maxima to the row's over keys
// the block's first walk did not weigh in this thread: the forward's warps see every key of their
// rows (nothing to do); a decode warp sees its share of its split's keys (flash_decode's
// row_maxima).
template <int BLOCK_N, int OUT_BLOCKS, typename Stream, typename Tile, typename Settle>
__device__ __forceinline__ void walk_keys_under_zero_weight_rule(const Stream& stream, int lo, int interior_lo,
                                                                 int interior_hi, int hi, float (&row_max)[2],
                                                                 float (&row_sum)[2], float (&acc)[OUT_BLOCKS][4],
                                                                 Tile tile, Settle settle) {
    auto walk = [&](auto exact) {
        int kt = lo, stage = 0;
        for (; kt < interior_lo; kt += BLOCK_N, stage ^= 1) tile(Flag<true>{}, exact, kt, stage);
        for (; kt < interior_hi; kt += BLOCK_N, stage ^= 1) tile(Flag<false>{}, exact, kt, stage);
        for (; kt < hi; kt += BLOCK_N, stage ^= 1) tile(Flag<true>{}, exact, kt, stage);
        cp_async_wait<0>();
        __syncthreads();
    };
    walk(Flag<false>{});
    float probe = 0.f;
#pragma unroll
    for (int nb = 0; nb < OUT_BLOCKS; ++nb) probe += (acc[nb][0] + acc[nb][1]) + (acc[nb][2] + acc[nb][3]);
    if (__syncthreads_or(not_finite(probe))) {
#pragma unroll
        for (int r = 0; r < 2; ++r) row_sum[r] = 0.f;
        zero(acc);
        settle();
        if (lo < hi) stream.load(0, lo);
        cp_async_commit();
        walk(Flag<true>{});
    }
}

// The contract's scores for one call: scale and softcap, then Visibility's causal/window/
// key_lengths/mask rule; rows at or past seq_q are hidden too (tiles overhang the sequence).
struct ScoreRule {
    // A copy of the fields the scores need, not a reference to the kernel's Params: held through a
    // reference, ptxas kept more of them live across the key loop (flash_backward_dq at head_dim
    // 128 went from 242 registers to 255 and spilled).
    struct Fields {
        float scale, softcap;
        int seq_q;
        Visibility rules;
    } p;

    float scale_log2;  // scale * log2(e)
    float cap_log2;    // softcap * log2(e)
    float tanh_log2;   // 2 log2(e) / softcap: a score -> the exponent of tanh's exp form
    float dot_tanh_log2;  // scale * tanh_log2: a raw dot product -> the same

    __device__ __forceinline__ explicit ScoreRule(const Params& params)
        : p{params.scale, params.softcap, params.seq_q, params.rules},
          scale_log2(params.scale * kLog2e),
          cap_log2(params.softcap * kLog2e),
          tanh_log2(2.f * kLog2e / params.softcap),
          dot_tanh_log2(params.scale * (2.f * kLog2e / params.softcap)) {}

    // softcap * tanh(x) * log2(e) from exponent = 2 x log2(e), on the SFU: tanh(x) = 1 - 2 / (1 + E)
    // with E = 2^exponent (ex2.approx) and 1 / (1 + E) by rcp.approx: ~5 instructions instead of
    // tanhf's ~20, with an absolute error of a few 1e-7 softcap in the score (what the softmax
    // weights feel; the float32 kernels keep tanhf).  E = +inf gives softcap exactly, a NaN stays
    // NaN.  `slope` (when not null) gets d score / d (dot * scale) = sech^2(x) = 4 E / (1 + E)^2,
    // which does not cancel as 1 - tanh^2 does; for it the exponent is clamped at 126 so that E
    // stays finite (a NaN passes the clamp as NaN), and E / (1 + E) <= 1 is formed first: 4 E alone
    // overflows to +inf for E >= 2^126 (|x| > 43.7), which made dS infinite there.
    __device__ __forceinline__ float capped_log2(float exponent, float* slope) const {
        if (slope) exponent = exponent > 126.f ? 126.f : exponent;
        const float big = fast_exp2(exponent);
        const float inverse = fast_reciprocal(1.f + big);
        if (slope) *slope = 4.f * (big * inverse) * inverse;
        return fmaf(-2.f * cap_log2, inverse, cap_log2);
    }

    // The log2-unit score of a dot product in a softcapped tile every row sees whole (no rule).
    __device__ __forceinline__ float softcapped_log2_score(float dot) const {
        return capped_log2(dot * dot_tanh_log2, nullptr);
    }

    // The same, with `slope` = d score / d (dot * scale) (the backward's sech^2).
    __device__ __forceinline__ float softcapped_log2_score(float dot, float* slope) const {
        return capped_log2(dot * dot_tanh_log2, slope);
    }

    // A warp's tile of S accumulators (m16n8 blocks) made scores in log2 units, in place: MASKED, the
    // contract's rule for the lane's rows, query positions rows[0] and rows[1] of heads heads[0]
    // and heads[1], and keys key0 + 8 nb + {0, 1} (key0 holds the lane's column pair); else an
    // interior tile, softcapped under SOFTCAP (neither: the raw dot products stay, online_softmax_tile
    // scales them).
    template <bool MASKED, bool SOFTCAP, int KEY_BLOCKS>
    __device__ __forceinline__ void tile_log2_scores(float (&s)[KEY_BLOCKS][4], int b, const int (&heads)[2],
                                                     const int (&rows)[2], int key0, int key_end) const {
#pragma unroll
        for (int nb = 0; nb < KEY_BLOCKS; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if constexpr (MASKED) {
                    float slope;
                    s[nb][e] = log2_score<SOFTCAP>(s[nb][e], b, heads[e / 2], rows[e / 2], key0 + nb * 8 + (e % 2),
                                                   key_end, &slope);
                } else if constexpr (SOFTCAP) {
                    s[nb][e] = softcapped_log2_score(s[nb][e]);
                }
            }
        }
    }

    // Keys [*lo, *hi) in whole tiles of BLOCK_N from `lo` that rows [first, last] all see and that
    // need no masking (empty under a dense mask, or for scale <= 0): the interior tiles of a key walk
    // over [lo, hi).
    template <int BLOCK_N>
    __device__ __forceinline__ void interior_tiles(int b, int seq_k, int first, int last, int lo, int hi, int* begin,
                                                   int* end) const {
        int common_lo, common_hi;
        p.rules.common_key_range(b, seq_k, first, last, &common_lo, &common_hi);
        const int tile_lo = lo + (max(common_lo - lo, 0) + BLOCK_N - 1) / BLOCK_N * BLOCK_N;
        const int tile_hi = lo + max(min(common_hi, hi) - lo, 0) / BLOCK_N * BLOCK_N;
        // A scale <= 0 would turn the raw scores' maximum into the minimum (see flash_forward).
        const bool none = p.rules.mask_kind != MASK_NONE || p.scale <= 0.f || tile_hi <= tile_lo;
        *begin = none ? lo : tile_lo;
        *end = none ? lo : tile_hi;
    }

    // Tiles [*begin, *end) of the `tiles` query tiles of BLOCK_M rows from `m_lo` whose rows all see
    // every key of [first_key, last_key] (a key block of the backward) and need no masking: none
    // under a dense mask, for scale <= 0, or when the block reaches past key_end.
    template <int BLOCK_M>
    __device__ __forceinline__ void interior_query_tiles(int first_key, int last_key, int key_end, int m_lo, int tiles,
                                                         int* begin, int* end) const {
        int common_lo, common_hi;
        p.rules.common_query_range(p.seq_q, first_key, last_key, &common_lo, &common_hi);
        const int tile_lo = (max(common_lo - m_lo, 0) + BLOCK_M - 1) / BLOCK_M;
        const int tile_hi = min(max(common_hi - m_lo, 0) / BLOCK_M, tiles);
        const bool none = p.rules.mask_kind != MASK_NONE || p.scale <= 0.f || last_key >= key_end || tile_hi <= tile_lo;
        *begin = none ? tiles : tile_lo;
        *end = none ? tiles : tile_hi;
    }

    // Finish the raw dot product of query `row` (head h, batch b) with key `key`: keys at or past
    // `key_end` are hidden.  Returns the score times log2(e), or -inf where the key is hidden.
    // `slope` gets d score / d (dot * scale): capped_log2's sech^2 under softcap, else 1.  (The
    // forward ignores it and the compiler drops it there.)  SOFTCAP: the kernel's compile-time
    // choice (softcap given, so > 0; or off, and no softcap code at all).
    template <bool SOFTCAP>
    __device__ __forceinline__ float log2_score(float dot, int b, int h, int row, int key, int key_end,
                                                float* slope) const {
        float score = dot * p.scale;
        *slope = 1.f;
        if constexpr (SOFTCAP) score = capped_log2(score * tanh_log2, slope) * kLn2;
        if (row >= p.seq_q || key >= key_end) return negative_infinity();
        return p.rules.apply(score, b, h, row, key) * kLog2e;
    }
};

}  // namespace fastattn_gpu
