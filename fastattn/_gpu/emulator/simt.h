// The SIMT emulator: CUDA C++ kernels compiled by the host C++ compiler and run on the CPU, exactly.
//
// Every thread of a block is a fiber with its own stack, so a thread's registers are its own locals,
// as on the device (x86-64: a switch of the callee-saved registers and the stack pointer, no system
// call; elsewhere ucontext).  One block runs at a time.  Between two __syncthreads its warps run
// one after another, in an order drawn by the launch's seed afresh for every interval, each as far
// as it can go alone, and the lanes of a warp run in a shuffled order between collectives: a read
// that a missing __syncthreads leaves unordered with its write sees the wrong data (or the poison).
//   - __syncthreads (and __syncthreads_or): a block barrier.  A barrier some threads never reach, or
//     a thread that exits while others wait, is an error (never a hang).
//   - Warp collectives (__shfl_xor_sync, __shfl_sync, __any_sync, __syncwarp, mma.sync, ldmatrix):
//     the 32 lanes meet at a warp barrier and exchange through per-warp slots.  A lane missing from
//     a collective is an error.
//   - mma.sync.m16n8k16 and ldmatrix.x4 follow the PTX ISA's register-fragment layouts lane by lane
//     ("Matrix Fragments for mma.m16n8k16 with floating point type"; "Warp-level matrix load
//     instruction: ldmatrix"); products are exact in float and accumulate in float.
//   - cp.async: the destination holds poison (all bits set: NaN in every float format) until the
//     wait_group that completes its group copies the data in.  A misaligned cp.async or ldmatrix
//     address is an error, as it is a fault on the device.
//   - Dynamic shared memory starts as poison for every block, between guard zones that are checked
//     when the block ends.
// The kernels' sources stay as they are: ptx.cuh calls the functions below in place of inline PTX
// when FASTATTN_EMULATE is defined, and the driver (fastattn/_gpu/emulator/__init__.py) rewrites
// each `extern __shared__ T name[];` into a pointer to the block's dynamic shared memory.
//
// This header is what a kernel compiles against: CUDA's types, conversions and intrinsics, each
// intrinsic a call into the runtime (simt_runtime.cpp: fibers, the scheduler, the collectives),
// which the driver compiles once per set of flags into a shared library that every kernel library
// links.  A kernel's build then compiles the kernel alone: with the runtime inline in every unit,
// parsing and generating it was ~60% of each of the ~100 builds a test run makes.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __grid_constant__

// ---------------------------------------------------------------------------------------------
// Vector types and dim3
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
    unsigned int x, y, z;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

// ---------------------------------------------------------------------------------------------
// Half and bfloat16: bit patterns with round-to-nearest-even conversions.
struct __half {
    unsigned short bits;
};
struct __half2 {
    __half x, y;
};
struct __nv_bfloat16 {
    unsigned short bits;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

namespace fastattn_emu {

inline unsigned int float_bits(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float bits_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline unsigned short float_to_half_bits(float f) {
    const unsigned int x = float_bits(f);
    const unsigned int sign = (x >> 16) & 0x8000u, magnitude = x & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) return sign | (magnitude > 0x7f800000u ? 0x7e00u : 0x7c00u);
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // rounds to at least 65520: infinity
    if (magnitude < 0x38800000u) {                         // below 2^-14: subnormal half (or zero)
        // f * 2^24 is exact in float here; nearbyint rounds half to even (the default mode).
        return static_cast<unsigned short>(sign | static_cast<unsigned int>(std::nearbyint(bits_float(magnitude) * 16777216.0f)));
    }
    unsigned int h = ((((magnitude >> 23) - 127 + 15) << 10) | ((magnitude & 0x7fffffu) >> 13));
    const unsigned int rest = magnitude & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
    return static_cast<unsigned short>(sign | h);
}

inline float half_bits_to_float(unsigned short h) {
    const unsigned int sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0) return bits_float(sign) + (sign ? -1.f : 1.f) * std::ldexp(static_cast<float>(mantissa), -24);
    if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));
    return bits_float(sign | ((exponent - 15 + 127) << 23) | (mantissa << 13));
}

inline unsigned short float_to_bfloat16_bits(float f) {
    const unsigned int x = float_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((x >> 16) | 0x40u);  // quiet NaN
    return static_cast<unsigned short>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bfloat16_bits_to_float(unsigned short b) { return bits_float(static_cast<unsigned int>(b) << 16); }

}  // namespace fastattn_emu

inline float __half2float(__half h) { return fastattn_emu::half_bits_to_float(h.bits); }
inline __half __float2half_rn(float f) { return __half{fastattn_emu::float_to_half_bits(f)}; }
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2{__float2half_rn(lo), __float2half_rn(hi)}; }
inline __half __ushort_as_half(unsigned short bits) { return __half{bits}; }
inline float __bfloat162float(__nv_bfloat16 b) { return fastattn_emu::bfloat16_bits_to_float(b.bits); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{fastattn_emu::float_to_bfloat16_bits(f)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    return __nv_bfloat162{__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
inline float __uint_as_float(unsigned int u) { return fastattn_emu::bits_float(u); }
inline float __int_as_float(int i) { return fastattn_emu::bits_float(static_cast<unsigned int>(i)); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline size_t __cvta_generic_to_shared(const void* pointer) { return reinterpret_cast<size_t>(pointer); }

// CUDA's min and max take mixed integer types.
template <typename A, typename B> inline std::common_type_t<A, B> min(A a, B b) {
    return b < a ? static_cast<std::common_type_t<A, B>>(b) : static_cast<std::common_type_t<A, B>>(a);
}
template <typename A, typename B> inline std::common_type_t<A, B> max(A a, B b) {
    return a < b ? static_cast<std::common_type_t<A, B>>(b) : static_cast<std::common_type_t<A, B>>(a);
}

// ---------------------------------------------------------------------------------------------
// The runtime's entry points (simt_runtime.cpp).
namespace fastattn_emu {

constexpr int kWarpSize = 32;

// The running thread's threadIdx and lane, and the launch's blockIdx, blockDim and gridDim.
const uint3& thread_index();
int lane_index();
const uint3& block_index();
const dim3& block_dim();
const dim3& grid_dim();
// The first byte of the block's dynamic shared memory.
unsigned char* dynamic_shared_bytes();

// Run body(context) as the kernel of every thread of every block of the grid.  Returns 0, or 1
// with the first error (a kernel's failure or a scheduling error) written to `error`.
int run_grid(dim3 grid, dim3 block, size_t shared_bytes, unsigned long long seed, void (*body)(void*), void* context,
             char* error, size_t error_bytes);

// __syncthreads, __syncthreads_or, __any_sync and __syncwarp.
void block_barrier();
bool block_vote_any(bool predicate);
bool vote_any(unsigned int mask, bool predicate);
void sync_warp(unsigned int mask);
// A shuffle of `bytes` (at most 8) bytes: every lane gives *value and receives lane source's in
// *result (`what` names the intrinsic, for errors).
void warp_exchange(unsigned int mask, const void* value, void* result, size_t bytes, int source, int width,
                   const char* what);

enum class Operand { f16, bf16 };

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: lane l (group g = l/4, t = l%4) holds
//   A: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B: b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C/D: c0,c1 = (g, 2t), (g, 2t+1); c2,c3 = (g+8, 2t), (g+8, 2t+1)
// A 32-bit register's low half is the element of the lower index.
void mma_m16n8k16(float* c, const unsigned int* a, const unsigned int* b, Operand kind);
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8j..8j+7 give the addresses of rows
// 0..7 of matrix j; lane l receives in r[j] the elements (l/4, 2(l%4)) and (l/4, 2(l%4)+1) of
// matrix j, or of its transpose with .trans.
void ldmatrix_x4(unsigned int* r, const void* pointer, bool transpose);

// cp.async: poison now, data at the wait_group that completes the group.
void cp_async(void* dst, const void* src, int bytes, int source_bytes);
void cp_async_commit();
void cp_async_wait(int in_flight);

// ex2.approx.ftz.f32: 2^x with subnormal inputs read as 0 and subnormal results flushed to 0 (the
// device's few-ulp approximation error is not modelled: the emulator computes 2^x exactly rounded).
inline float ex2_approx_ftz(float x) {
    if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.f;
    const float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}

// rcp.approx.ftz.f32: 1 / x with subnormal inputs and results flushed to zero (the device's is
// within 1 ulp; this one is exact, which the kernels' tolerances cover).
inline float rcp_approx_ftz(float x) {
    if (std::fpclassify(x) == FP_SUBNORMAL) x = std::copysign(0.f, x);
    const float y = 1.f / x;
    return std::fpclassify(y) == FP_SUBNORMAL ? std::copysign(0.f, y) : y;
}

// Run `kernel(args...)` over the grid (see run_grid).  `arguments[i]` points to the value of the
// kernel's i-th parameter (as cuLaunchKernel's kernelParams do).
template <typename... Params>
int launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, void** arguments,
                  unsigned long long seed, char* error, size_t error_bytes) {
    struct Call {
        void (*kernel)(Params...);
        std::tuple<std::decay_t<Params>...> values;
    } call{kernel, {}};
    size_t position = 0;
    std::apply([&](auto&... value) { ((std::memcpy(&value, arguments[position++], sizeof(value))), ...); },
               call.values);
    const auto body = [](void* context) {
        Call& the = *static_cast<Call*>(context);
        std::apply(the.kernel, the.values);
    };
    return run_grid(grid, block, shared_bytes, seed, body, &call, error, error_bytes);
}

// The byte size of each of a kernel's parameters, for the driver to check its arguments against.
template <typename... Params> int parameter_sizes(void (*)(Params...), unsigned long long* sizes, int capacity) {
    const unsigned long long all[] = {sizeof(std::decay_t<Params>)..., 0};
    const int count = static_cast<int>(sizeof...(Params));
    for (int i = 0; i < count && i < capacity; ++i) sizes[i] = all[i];
    return count;
}

template <typename T> T* dynamic_shared() { return reinterpret_cast<T*>(dynamic_shared_bytes()); }

template <typename T> T warp_shuffle(unsigned int mask, T value, int source, int width, const char* what) {
    static_assert(sizeof(T) <= 8, "a shuffle of a value wider than 8 bytes");
    T result;
    warp_exchange(mask, &value, &result, sizeof(T), source, width, what);
    return result;
}

}  // namespace fastattn_emu

#define threadIdx (fastattn_emu::thread_index())
#define blockIdx (fastattn_emu::block_index())
#define blockDim (fastattn_emu::block_dim())
#define gridDim (fastattn_emu::grid_dim())

inline void __syncthreads() { fastattn_emu::block_barrier(); }

template <typename T> inline T __shfl_xor_sync(unsigned int mask, T value, int lane_mask, int width = 32) {
    return fastattn_emu::warp_shuffle(mask, value, fastattn_emu::lane_index() ^ lane_mask, width, "__shfl_xor_sync");
}

template <typename T> inline T __shfl_sync(unsigned int mask, T value, int source, int width = 32) {
    return fastattn_emu::warp_shuffle(mask, value, source, width, "__shfl_sync");
}
inline int __syncthreads_or(int predicate) { return fastattn_emu::block_vote_any(predicate != 0); }
inline int __any_sync(unsigned int mask, int predicate) { return fastattn_emu::vote_any(mask, predicate != 0); }
inline void __syncwarp(unsigned int mask = 0xffffffffu) { fastattn_emu::sync_warp(mask); }

// One block runs at a time and its threads take turns only at barriers: a plain add is atomic.
template <typename T> inline T atomicAdd(T* address, T value) {
    const T old = *address;
    *address = old + value;
    return old;
}
