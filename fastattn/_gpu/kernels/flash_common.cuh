// Device code shared by the flash kernels (forward, backward): element packing and mma.sync,
// ldmatrix, cp.async, padded tile loads, and the contract's visibility rules (DESIGN.md §3).
//
// NVRTC has no <cmath> and no INFINITY: only cuda_fp16.h and cuda_bf16.h are included, and -inf is
// built from its bit pattern.  The launchers (fastattn/_gpu/_launch.py) paste this header into each
// source in place of its #include line, so that CuPy's kernel cache, keyed on the source text, sees
// every change to it; nvcc (CI's compile check) reads it through the #include.
#ifndef FASTATTN_FLASH_COMMON_CUH
#define FASTATTN_FLASH_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fastattn_gpu {

constexpr int kPad = 8;  // elements of padding per shared-memory row: ldmatrix rows hit distinct banks
constexpr float kLog2e = 1.4426950408889634f;

enum MaskKind { MASK_NONE = 0, MASK_BOOL = 1, MASK_FLOAT32 = 2, MASK_FLOAT16 = 3, MASK_BFLOAT16 = 4 };

template <typename Elem> struct Pack;
template <> struct Pack<__half> {
    static __device__ __forceinline__ unsigned int two(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<unsigned int*>(&v);
    }
    static __device__ __forceinline__ void mma(float* c, const unsigned int* a, const unsigned int* b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
    static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
};
template <> struct Pack<__nv_bfloat16> {
    static __device__ __forceinline__ unsigned int two(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<unsigned int*>(&v);
    }
    static __device__ __forceinline__ void mma(float* c, const unsigned int* a, const unsigned int* b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
};

// -inf without <cmath>'s INFINITY, which NVRTC does not provide.
__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float positive_infinity() { return __int_as_float(0x7f800000); }

__device__ __forceinline__ unsigned int smem_address(const void* pointer) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned int* r, const void* pointer) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(pointer)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int* r, const void* pointer) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(pointer)));
}

// 16-byte global -> shared copy; `valid` false zero-fills the destination.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
// 4-byte global -> shared copy; `valid` false zero-fills the destination.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

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

__device__ __forceinline__ float mask_value(const void* mask, int kind, long long element, bool* visible) {
    switch (kind) {
        case MASK_BOOL: *visible = static_cast<const unsigned char*>(mask)[element] != 0; return 0.f;
        case MASK_FLOAT32: return static_cast<const float*>(mask)[element];
        case MASK_FLOAT16: return __half2float(static_cast<const __half*>(mask)[element]);
        case MASK_BFLOAT16: return __bfloat162float(static_cast<const __nv_bfloat16*>(mask)[element]);
        default: return 0.f;
    }
}

// The contract's score transform and visibility for one call: scale, softcap, causal (either
// alignment through `offset`, the key position of query 0), sliding window, key_lengths and the
// bool or float mask read by strides (0 along broadcast axes).
struct ScoreRule {
    int seq_q, causal, offset, window_left, window_right;
    float scale, softcap;
    const void* mask;
    int mask_kind;
    long long m_sb, m_sh, m_sq, m_sk;

    // Finish the raw dot product of query `row` (head h, batch b) with key `key`: keys at or past
    // `key_end` are hidden.  Returns the score times log2(e), or -inf where the key is hidden.
    // `slope` gets d score / d (dot * scale): 1, or sech^2(dot * scale / softcap) under softcap,
    // from exp(-2|x|) rather than as 1 - tanh^2, which cancels to nothing in float32 once tanh
    // rounds to +-1.  (The forward ignores it and the compiler drops it there.)
    __device__ __forceinline__ float log2_score(float dot, int b, int h, int row, int key, int key_end,
                                                float* slope) const {
        const int pos = row + offset;
        float score = dot * scale;
        *slope = 1.f;
        if (softcap > 0.f) {
            const float x = score / softcap;
            score = softcap * tanhf(x);
            const float e = __expf(-2.f * fabsf(x));
            *slope = 4.f * e / ((1.f + e) * (1.f + e));
        }
        bool visible = row < seq_q && key < key_end;
        if (causal) visible = visible && key <= pos;
        if (window_left >= 0) visible = visible && key >= pos - window_left;
        if (window_right >= 0) visible = visible && key <= pos + window_right;
        if (mask_kind != MASK_NONE && visible) {
            bool allowed = true;
            score += mask_value(mask, mask_kind, b * m_sb + h * m_sh + row * m_sq + key * m_sk, &allowed);
            visible = allowed;
        }
        return visible ? score * kLog2e : negative_infinity();
    }

    // Keys [*lo, *hi) that some query of rows [first_row, last_row] may see, with keys at or past
    // `key_end` hidden; *lo is not rounded to a tile.
    __device__ __forceinline__ void key_range(int first_row, int last_row, int key_end, int* lo, int* hi) const {
        const int first_pos = first_row + offset, last_pos = last_row + offset;
        *lo = 0;
        *hi = key_end;
        if (causal) *hi = min(*hi, last_pos + 1);
        if (window_left >= 0) *lo = max(*lo, first_pos - window_left);
        if (window_right >= 0) *hi = min(*hi, last_pos + window_right + 1);
    }

    // Query rows [*lo, *hi) that may see some key of [first_key, last_key] (all below key_end).
    __device__ __forceinline__ void query_range(int first_key, int last_key, int* lo, int* hi) const {
        *lo = 0;
        *hi = seq_q;
        if (causal) *lo = max(*lo, first_key - offset);
        if (window_right >= 0) *lo = max(*lo, first_key - window_right - offset);
        if (window_left >= 0) *hi = min(*hi, last_key + window_left - offset + 1);
    }
};

}  // namespace fastattn_gpu

#endif  // FASTATTN_FLASH_COMMON_CUH
