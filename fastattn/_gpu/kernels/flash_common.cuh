// Device code shared by the tensor-core flash kernels (forward, backward): packed pairs for
// mma.sync (the PTX helpers themselves are in ptx.cuh), padded tile loads, and ScoreRule: the scores of the contract
// (DESIGN.md §3) on top of decode_common.cuh's Visibility, which the decode and float32 kernels use
// too, so that every kernel hides exactly the same keys.
//
// NVRTC has no <cmath> and no INFINITY: only cuda_fp16.h and cuda_bf16.h are included, and -inf is
// built from its bit pattern.  The launchers (fastattn/_gpu/_launch.py) paste this header, and the
// one it includes, into each source in place of the #include lines, so that CuPy's kernel cache,
// keyed on the source text, sees every change; nvcc (CI's compile check) reads them through the
// #include.
#pragma once
#include "decode_common.cuh"

namespace fastattn_gpu {

constexpr int kPad = 8;  // elements of padding per shared-memory row: ldmatrix rows hit distinct banks
constexpr float kLog2e = 1.4426950408889634f;

template <typename Elem> struct Pack;
template <> struct Pack<__half> {
    static __device__ __forceinline__ unsigned int two(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<unsigned int*>(&v);
    }
    static __device__ __forceinline__ void mma(float* c, const unsigned int* a, const unsigned int* b) {
        mma_m16n8k16_f16(c, a, b);
    }
};
template <> struct Pack<__nv_bfloat16> {
    static __device__ __forceinline__ unsigned int two(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<unsigned int*>(&v);
    }
    static __device__ __forceinline__ void mma(float* c, const unsigned int* a, const unsigned int* b) {
        mma_m16n8k16_bf16(c, a, b);
    }
};

__device__ __forceinline__ float positive_infinity() { return __int_as_float(0x7f800000); }

// Copy `ROWS` rows (from `first`, zero past `limit`) of HEAD_DIM elements into a padded smem tile,
// with THREADS threads of the block taking 16-byte chunks in turn.
template <typename Elem, int HEAD_DIM, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(Elem* tile, const Elem* base, long long row_stride, long long first,
                                          long long limit) {
    constexpr int chunks_per_row = HEAD_DIM / 8;
    for (int chunk = threadIdx.x; chunk < ROWS * chunks_per_row; chunk += THREADS) {
        const int row = chunk / chunks_per_row, col = (chunk % chunks_per_row) * 8;
        const bool valid = first + row < limit;
        const Elem* src = base + (valid ? (first + row) * row_stride : 0) + col;
        cp_async_16(tile + row * (HEAD_DIM + kPad) + col, src, valid);
    }
}

// The contract's scores for one call: scale and softcap, then Visibility's causal/window/
// key_lengths/mask rule; rows at or past seq_q are hidden too (tiles overhang the sequence).
struct ScoreRule {
    Visibility rules;
    int seq_q;
    float scale, softcap;

    // Keys below this bound exist for batch row b (key_lengths, clamped to seq_k).
    __device__ __forceinline__ int key_end(int b, int seq_k) const {
        return rules.key_lengths ? static_cast<int>(min(rules.key_lengths[b], static_cast<long long>(seq_k))) : seq_k;
    }

    // Finish the raw dot product of query `row` (head h, batch b) with key `key`: keys at or past
    // `key_end` are hidden.  Returns the score times log2(e), or -inf where the key is hidden.
    // `slope` gets d score / d (dot * scale): soft_cap_slope's sech^2 under softcap, else 1.
    // (The forward ignores it and the compiler drops it there.)
    __device__ __forceinline__ float log2_score(float dot, int b, int h, int row, int key, int key_end,
                                                float* slope) const {
        float score = dot * scale;
        *slope = soft_cap_slope(score, softcap);
        score = soft_cap(score, softcap);
        if (row >= seq_q || key >= key_end) return negative_infinity();
        return rules.apply(score, b, h, row, key) * kLog2e;
    }

    // Query rows [*lo, *hi) that may see some key of [first_key, last_key] (all below key_end).
    __device__ __forceinline__ void query_range(int first_key, int last_key, int* lo, int* hi) const {
        *lo = 0;
        *hi = seq_q;
        if (rules.causal) *lo = max(*lo, first_key - rules.offset);
        if (rules.window_right >= 0) *lo = max(*lo, first_key - rules.window_right - rules.offset);
        if (rules.window_left >= 0) *hi = min(*hi, last_key + rules.window_left - rules.offset + 1);
    }
};

}  // namespace fastattn_gpu
