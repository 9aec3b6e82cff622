// Device helpers shared by flash_decode.cu and flash_fp32.cu: element conversion, -inf, the mask
// read by strides and the contract's key visibility rule (DESIGN.md §3).
//
// NVRTC sees this header inlined into each source by fastattn/_gpu/_launch.py (so CuPy's kernel
// cache keys on the full text); nvcc finds it next to the source.  Only cuda_fp16.h and
// cuda_bf16.h are included (by ptx.cuh, with the PTX helpers): NVRTC has no <cmath>.
#pragma once
#include "ptx.cuh"

namespace fastattn_gpu {

// The numbers of fastattn/_codes.py's MASK_CODES (tests/test_codes.py checks them); the GPU kernels
// read no float64 mask (the launchers decline it), so 3 is unused here.
enum MaskKind { MASK_NONE = 0, MASK_BOOL = 1, MASK_FLOAT32 = 2, MASK_FLOAT64 = 3, MASK_FLOAT16 = 4, MASK_BFLOAT16 = 5 };

// -inf without <cmath>'s INFINITY, which NVRTC does not provide.
__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }

template <typename Elem> struct Convert;
template <> struct Convert<float> {
    static __device__ __forceinline__ float to_float(float x) { return x; }
    static __device__ __forceinline__ float from_float(float x) { return x; }
};
template <> struct Convert<__half> {
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};
template <> struct Convert<__nv_bfloat16> {
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// The mask and the rules that hide keys from a query row, as passed by the launchers.
struct Visibility {
    int causal;            // nonzero: key j visible iff j <= position
    int offset;            // key position of query 0 (Sk - Sq for bottom-right, else 0)
    int window_left;       // -1: unbounded
    int window_right;      // -1: unbounded
    const void* mask;      // bool or float mask read by element strides (null: none)
    int mask_kind;         // MaskKind
    long long m_sb, m_sh, m_sq, m_sk;
    const long long* key_lengths;  // (B,) or null

    // Keys [lo, hi) that query positions [first, last] can see at all (causal, window, lengths).
    __device__ __forceinline__ void key_range(int b, int seq_k, int first, int last, int* lo, int* hi) const {
        int low = 0, high = key_lengths ? static_cast<int>(min(key_lengths[b], static_cast<long long>(seq_k))) : seq_k;
        if (causal) high = min(high, last + offset + 1);
        if (window_left >= 0) low = max(low, first + offset - window_left);
        if (window_right >= 0) high = min(high, last + offset + window_right + 1);
        *lo = max(low, 0);
        *hi = high;
    }

    // The score after the additive mask, or -inf when (b, h, row, key) is hidden.  `key < hi` must
    // already hold for the key_lengths bound (key_range's hi).
    __device__ __forceinline__ float apply(float score, int b, int h, int row, int key) const {
        const int position = row + offset;
        bool visible = true;
        if (causal) visible = key <= position;
        if (window_left >= 0) visible = visible && key >= position - window_left;
        if (window_right >= 0) visible = visible && key <= position + window_right;
        if (!visible) return negative_infinity();
        if (mask_kind == MASK_NONE) return score;
        const long long element = b * m_sb + h * m_sh + row * m_sq + key * m_sk;
        switch (mask_kind) {
            case MASK_BOOL: return static_cast<const unsigned char*>(mask)[element] ? score : negative_infinity();
            case MASK_FLOAT32: return score + static_cast<const float*>(mask)[element];
            case MASK_FLOAT16: return score + __half2float(static_cast<const __half*>(mask)[element]);
            default: return score + __bfloat162float(static_cast<const __nv_bfloat16*>(mask)[element]);  // MASK_BFLOAT16
        }
    }
};

// exp results below the smallest normal float count as exactly 0 (the reference's rule, so that
// which keys have zero weight does not depend on denormal support); NaN stays NaN.
__device__ __forceinline__ float flush_tiny(float p) { return p < 1.17549435e-38f ? 0.f : p; }

// weight * value + acc, where a weight of exactly 0 contributes 0 even against an infinite or NaN
// value (DESIGN.md / README "NaN and infinity": a key a row cannot see never reaches it).
__device__ __forceinline__ float weighted_add(float weight, float value, float acc) {
    return fmaf(weight, weight != 0.f ? value : 0.f, acc);
}

// softcap * tanh(score / softcap) when softcap > 0.
__device__ __forceinline__ float soft_cap(float score, float softcap) {
    return softcap > 0.f ? softcap * tanhf(score / softcap) : score;
}

// d soft_cap(score) / d score: 1, or sech^2(score / softcap) computed from e = exp(-2|x|) as
// 4e / (1 + e)^2, not as 1 - tanh^2, which cancels in float32 as tanh nears +-1 (at |x| = 6 it
// keeps no correct digit; the backward's dS inherits the error).
__device__ __forceinline__ float soft_cap_slope(float score, float softcap) {
    if (softcap <= 0.f) return 1.f;
    const float e = expf(-2.f * fabsf(score / softcap));
    return 4.f * e / ((1.f + e) * (1.f + e));
}

}  // namespace fastattn_gpu
