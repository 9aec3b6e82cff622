// The base header of every kernel: the launch's argument struct (Params), element conversion,
// the contract's one key-visibility rule (DESIGN.md §3), softcap and its slope, the zero-weight
// rules of non-finite inputs, and attention dropout (the Philox mask of fastattn/_shared/philox.h,
// bit for bit the CPU's).
//
// Every kernel takes one argument, `const __grid_constant__ Params p`, filled once per call by
// fastattn/_gpu/params.py (a numpy structured scalar with this exact layout; tests/emulator checks
// the offsets of every field against the compiled struct).  CuPy passes it by value; on sm_70+
// __grid_constant__ keeps it in the constant parameter bank, so reading a field costs what reading
// a scalar parameter did.
//
// NVRTC sees this header inlined into each source by fastattn/_gpu/_launch.py (so CuPy's kernel
// cache keys on the full text); nvcc and the emulator find it on their include paths.  Only
// cuda_fp16.h and cuda_bf16.h are included (by ptx.cuh, with the PTX helpers): NVRTC has no <cmath>.
#pragma once
#include "philox.h"
#include "ptx.cuh"

namespace fastattn_gpu {

// The numbers of fastattn/_codes.py's MASK_CODES (tests/test_codes.py checks them); the GPU kernels
// read no float64 mask (the launchers decline it), so 3 is unused here.
enum MaskKind { MASK_NONE = 0, MASK_BOOL = 1, MASK_FLOAT32 = 2, MASK_FLOAT64 = 3, MASK_FLOAT16 = 4, MASK_BFLOAT16 = 5 };

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// -inf and +inf without <cmath>'s INFINITY, which NVRTC does not provide.
__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float positive_infinity() { return __int_as_float(0x7f800000); }
// x is +-inf or NaN (x - x is NaN exactly then; without <cmath>'s isfinite, as above).
__device__ __forceinline__ bool not_finite(float x) { return x - x != 0.f; }

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

// One (B, H, S, ...) array: its address and the element strides of its first three axes (the last
// axis is contiguous).  lse-shaped (B, H, S) float32 arrays use it too.
struct Operand {
    void* data;
    long long sb, sh, ss;

    template <typename T> __device__ __forceinline__ T* row(long long b, long long h, long long i) const {
        return static_cast<T*>(data) + b * sb + h * sh + i * ss;
    }
};

// The mask and the rules that hide keys from a query row.
struct Visibility {
    int causal;            // nonzero: key j visible iff j <= position
    int offset;            // key position of query 0 (Sk - Sq for bottom-right, else 0)
    int window_left;       // -1: unbounded
    int window_right;      // -1: unbounded
    const void* mask;      // bool or float mask read by element strides (null: none)
    int mask_kind;         // MaskKind
    long long m_sb, m_sh, m_sq, m_sk;
    const long long* key_lengths;  // (B,) or null

    // Keys below this bound exist for batch row b (key_lengths, clamped to seq_k).
    __device__ __forceinline__ int key_end(int b, int seq_k) const {
        return key_lengths ? static_cast<int>(min(key_lengths[b], static_cast<long long>(seq_k))) : seq_k;
    }

    // Keys [lo, hi) that query positions [first, last] can see at all (causal, window, lengths).
    __device__ __forceinline__ void key_range(int b, int seq_k, int first, int last, int* lo, int* hi) const {
        int low = 0, high = key_end(b, seq_k);
        if (causal) high = min(high, last + offset + 1);
        if (window_left >= 0) low = max(low, first + offset - window_left);
        if (window_right >= 0) high = min(high, last + offset + window_right + 1);
        *lo = max(low, 0);
        *hi = high;
    }

    // Keys [*lo, *hi) that every query position of [first, last] sees by causal, window and key
    // lengths (empty when lo >= hi): the tiles inside need no masking unless a dense mask is given.
    __device__ __forceinline__ void common_key_range(int b, int seq_k, int first, int last, int* lo, int* hi) const {
        int low = 0, high = key_end(b, seq_k);
        if (causal) high = min(high, first + offset + 1);
        if (window_left >= 0) low = max(low, last + offset - window_left);
        if (window_right >= 0) high = min(high, first + offset + window_right + 1);
        *lo = max(low, 0);
        *hi = high;
    }

    // Query rows [*lo, *hi) of [0, seq_q) that see every key of [first_key, last_key] by causal
    // and window (key_lengths and masks are the caller's to check): the rows of a key block's
    // interior query tiles (empty when lo >= hi).
    __device__ __forceinline__ void common_query_range(int seq_q, int first_key, int last_key, int* lo, int* hi) const {
        *lo = 0;
        *hi = seq_q;
        if (causal) *lo = max(*lo, last_key - offset);
        if (window_right >= 0) *lo = max(*lo, last_key - window_right - offset);
        if (window_left >= 0) *hi = min(*hi, first_key + window_left - offset + 1);
    }

    // Query rows [*lo, *hi) of [0, seq_q) that may see some key of [first_key, last_key].
    __device__ __forceinline__ void query_range(int seq_q, int first_key, int last_key, int* lo, int* hi) const {
        *lo = 0;
        *hi = seq_q;
        if (causal) *lo = max(*lo, first_key - offset);
        if (window_right >= 0) *lo = max(*lo, first_key - window_right - offset);
        if (window_left >= 0) *hi = min(*hi, last_key + window_left - offset + 1);
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

// Attention dropout: the multiplier of probability (b, h, i, j) is keep_scale where Philox's word
// for it is >= threshold, else 0 (philox.h gives the counter layout; fastattn/_dropout.py the same
// in numpy).  The kernels read it only in their DROPOUT instances.
struct Dropout {
    unsigned int key[2];           // the seed's low and high words
    unsigned int offset;           // Philox counter word 3
    float keep_scale;              // 1 / (1 - p); 0 at p = 1
    unsigned long long threshold;  // floor(p 2^32); 2^32 (nothing kept) at p = 1

    // The multipliers of keys j and j + 1 (j even, so one Philox block holds both) for query row i
    // of head h, batch row b.
    __device__ __forceinline__ void pair(int b, int heads_q, int h, int i, int j, float* factors) const {
        unsigned int words[4];
        fastattn_philox::dropout_words(key, offset, static_cast<unsigned int>(b * heads_q + h),
                                       static_cast<unsigned int>(i), static_cast<unsigned int>(j) >> 2, words);
        const bool high = (j & 2) != 0;  // selects, not a run-time index: words stays in registers
        factors[0] = (high ? words[2] : words[0]) >= threshold ? keep_scale : 0.f;
        factors[1] = (high ? words[3] : words[1]) >= threshold ? keep_scale : 0.f;
    }

    // The multiplier of key j for query row i of head h, batch row b.
    __device__ __forceinline__ float factor(int b, int heads_q, int h, int i, int j) const {
        unsigned int words[4];
        fastattn_philox::dropout_words(key, offset, static_cast<unsigned int>(b * heads_q + h),
                                       static_cast<unsigned int>(i), static_cast<unsigned int>(j) >> 2, words);
        const unsigned int low_pair = (j & 1) ? words[1] : words[0], high_pair = (j & 1) ? words[3] : words[2];
        return ((j & 2) ? high_pair : low_pair) >= threshold ? keep_scale : 0.f;
    }
};

// The argument of every launch (fastattn/_gpu/params.py fills it; fields a kernel does not use are
// zero).  q, k, v: (B, Hq|Hkv, Sq|Sk, D|Dv) inputs; out, lse: the forward's results (lse float32,
// natural log); dout, dq, dk, dv: the backward's; the float32 scratch is contiguous.
struct Params {
    Operand q, k, v, out, lse, dout, dq, dk, dv;
    float* lse2;         // backward: lse in log2 units, +inf where a row saw no key, (B, Hq, Sq)
    float* delta;        // backward: rowsum(dO * O), (B, Hq, Sq)
    float* dq_accum;     // tensor-core backward with atomics: float32 dQ, (B, Hq, Sq, D)
    float* partial_out;  // split decode: (splits, B Hq Sq, D) normalised partial outputs
    float* partial_lse;  // split decode: (splits, B Hq Sq)
    long long rows;      // B * Hq * Sq
    int batch, heads_q, heads_kv, seq_q, seq_k, head_dim, head_dim_v, group;
    int keys_per_split;  // split decode: keys of one split (a whole number of tiles)
    float scale, softcap;
    Visibility rules;
    Dropout dropout;
};

// A compile-time flag as a value, for generic lambdas: body(Flag<true>{}) instantiates the body with
// decltype(flag)::value true.
template <bool B> struct Flag {
    static constexpr bool value = B;
};

// exp results below the smallest normal float count as exactly 0 (the reference's rule, so that
// which keys have zero weight does not depend on denormal support); NaN stays NaN.
__device__ __forceinline__ float flush_tiny(float p) { return p < 1.17549435e-38f ? 0.f : p; }

// weight * value + acc, where a weight of exactly 0 contributes 0 even against an infinite or NaN
// value (DESIGN.md / README "NaN and infinity": a key a row cannot see never reaches it).
__device__ __forceinline__ float weighted_add(float weight, float value, float acc) {
    return fmaf(weight, weight != 0.f ? value : 0.f, acc);
}

// softcap * tanh(score / softcap) when softcap > 0.  The division is a multiplication by 1 / softcap,
// which a loop hoists: an IEEE division inside a tile loop leaves a slow-path call there.
__device__ __forceinline__ float soft_cap(float score, float softcap) {
    return softcap > 0.f ? softcap * tanhf(score * (1.f / softcap)) : score;
}

// d soft_cap(score) / d score: 1, or sech^2(score / softcap) computed from e = exp(-2|x|) as
// 4e / (1 + e)^2, not as 1 - tanh^2, which cancels in float32 as tanh nears +-1 (at |x| = 6 it
// keeps no correct digit; the backward's dS inherits the error).
__device__ __forceinline__ float soft_cap_slope(float score, float softcap) {
    if (softcap <= 0.f) return 1.f;
    const float e = expf(-2.f * fabsf(score * (1.f / softcap)));
    return 4.f * e / ((1.f + e) * (1.f + e));
}

// dS of one score from its probability (exactly 0 where hidden or underflowed), dP = dO . v, the
// row's delta, the dropout multiplier (1 without dropout) and the softcap slope:
// P (dP Z - delta) slope scale.  A dropped (Z = 0) or zero-probability element gives exactly 0
// even when dP is infinite or NaN (the reference's rule).
__device__ __forceinline__ float score_grad(float prob, float dp, float row_delta, float factor, float slope,
                                            float scale) {
    if (prob == 0.f) return 0.f;
    const float kept = factor != 0.f ? dp * factor : 0.f;
    return prob * (kept - row_delta) * slope * scale;
}

}  // namespace fastattn_gpu
