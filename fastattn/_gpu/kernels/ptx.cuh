// Every inline-PTX helper of the kernels, in one place, with the form the SIMT emulator
// (fastattn/_gpu/emulator/simt.h) runs in its place when FASTATTN_EMULATE is defined:
//   mma.sync.m16n8k16 (f16 and bf16 inputs, f32 accumulators), ldmatrix.x4 (plain and .trans),
//   cp.async (16 and 4 bytes, zero-fill) with commit_group / wait_group, ex2.approx.ftz, rcp.approx.ftz.
// The emulated forms follow the PTX ISA's fragment layouts lane by lane (tests/emulator checks
// them against a numpy model of the documented layouts).  The CUDA headers come from here too: the
// emulator brings its own half and bfloat16 types, so it needs no CUDA toolkit.
#pragma once
#ifdef FASTATTN_EMULATE
#include <simt.h>  // fastattn/_gpu/emulator, on the emulated build's include path
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace fastattn_gpu {

#ifndef FASTATTN_EMULATE
__device__ __forceinline__ unsigned int smem_address(const void* pointer) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(pointer));
}
#endif

// d = a b + d for one 16x16 (A, row-major) by 16x8 (B, column-major) tile, f32 accumulators.
__device__ __forceinline__ void mma_m16n8k16_f16(float* c, const unsigned int* a, const unsigned int* b) {
#ifdef FASTATTN_EMULATE
    fastattn_emu::mma_m16n8k16(c, a, b, fastattn_emu::Operand::f16);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

__device__ __forceinline__ void mma_m16n8k16_bf16(float* c, const unsigned int* a, const unsigned int* b) {
#ifdef FASTATTN_EMULATE
    fastattn_emu::mma_m16n8k16(c, a, b, fastattn_emu::Operand::bf16);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// A shared-memory address as ldmatrix takes it: 32 bits in the shared window on the device (one
// conversion per tile base; the per-fragment offsets then fold into the instructions' immediates),
// a host byte pointer on the emulator.  Offsets are added in bytes.
#ifdef FASTATTN_EMULATE
using SharedAddress = const unsigned char*;
__device__ __forceinline__ SharedAddress shared_address(const void* pointer) {
    return static_cast<SharedAddress>(pointer);
}
#else
using SharedAddress = unsigned int;
__device__ __forceinline__ SharedAddress shared_address(const void* pointer) { return smem_address(pointer); }
#endif

// Four 8x8 matrices of 16-bit elements from shared memory; lanes 8j..8j+7 give matrix j's rows.
__device__ __forceinline__ void ldmatrix_x4(unsigned int* r, SharedAddress address) {
#ifdef FASTATTN_EMULATE
    fastattn_emu::ldmatrix_x4(r, address, false);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int* r, SharedAddress address) {
#ifdef FASTATTN_EMULATE
    fastattn_emu::ldmatrix_x4(r, address, true);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
#endif
}

// 2^x on the SFU: ex2.approx.ftz.f32, one MUFU.EX2 (exp2f without fast math is four instructions).
// A few ulp of error, far inside the 16-bit kernels' tolerance; subnormal results flush to 0, which
// is the kernels' tiny-probability rule anyway (flush_tiny).
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef FASTATTN_EMULATE
    return fastattn_emu::ex2_approx_ftz(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
#endif
}

// 1 / x on the SFU: rcp.approx.ftz.f32, one MUFU.RCP (within 1 ulp; subnormals flush to 0).
__device__ __forceinline__ float fast_reciprocal(float x) {
#ifdef FASTATTN_EMULATE
    return fastattn_emu::rcp_approx_ftz(x);
#else
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
#endif
}

// 16-byte global -> shared copy; `valid` false zero-fills the destination.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
#ifdef FASTATTN_EMULATE
    fastattn_emu::cp_async(dst, src, 16, valid ? 16 : 0);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
#endif
}

// 4-byte global -> shared copy; `valid` false zero-fills the destination.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
#ifdef FASTATTN_EMULATE
    fastattn_emu::cp_async(dst, src, 4, valid ? 4 : 0);
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef FASTATTN_EMULATE
    fastattn_emu::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
#ifdef FASTATTN_EMULATE
    fastattn_emu::cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

}  // namespace fastattn_gpu
