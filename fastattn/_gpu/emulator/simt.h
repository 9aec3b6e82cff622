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
#pragma once

#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

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
// Threads, blocks and the scheduler.
namespace fastattn_emu {

constexpr int kWarpSize = 32;
constexpr size_t kStackBytes = 256 * 1024;  // the kernels keep register tiles of a few KiB per thread
constexpr size_t kGuardBytes = 256;         // around dynamic shared memory, checked at block end
constexpr unsigned char kPoison = 0xff;     // all bits set: NaN as float, half and bfloat16

struct Failure {
    std::string message;
};

[[noreturn]] inline void fail(const std::string& message) { throw Failure{message}; }

inline void check_aligned(const void* pointer, int bytes, const char* what) {
    if (reinterpret_cast<uintptr_t>(pointer) % bytes != 0) {
        fail(std::string(what) + ": address " + std::to_string(reinterpret_cast<uintptr_t>(pointer)) +
             " is not aligned to " + std::to_string(bytes) + " bytes (the device faults)");
    }
}

enum class Wait { none, block, warp, done };

// ---------------------------------------------------------------------------------------------
// Fibers.  A switch happens at every barrier and collective (two per lane per collective), so it
// must be cheap: glibc's swapcontext makes a sigprocmask system call each time, which took ~40% of
// an emulated launch.  On x86-64 a fiber is its saved stack pointer, and a switch pushes the
// callee-saved registers and the SSE/x87 control words, swaps stacks and pops them (the System V
// ABI's callee-saved state, all a call may assume preserved).  With AddressSanitizer the switches
// are announced (__sanitizer_start/finish_switch_fiber), so it checks each fiber against its own
// stack.
struct Fiber {
#if defined(__x86_64__)
    void* stack_pointer = nullptr;
#else
    ucontext_t context;
#endif
    char* stack_bottom = nullptr;  // the lowest address of the fiber's stack (none: the OS thread's)
    size_t stack_bytes = 0;
};

#if defined(__x86_64__)
// switch_stacks(save, load): saves this fiber's registers on its stack and its stack pointer in
// *save, then resumes the fiber whose stack pointer is load.
extern "C" void fastattn_emu_switch_stacks(void** save, void* load);
asm(R"(
    .text
    .p2align 4
    .type fastattn_emu_switch_stacks, @function
fastattn_emu_switch_stacks:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size fastattn_emu_switch_stacks, .-fastattn_emu_switch_stacks
)");
#endif

// Make `fiber` start `entry` on `stack` (stack_bytes, both multiples of 16) at its first switch.
inline void start_fiber(Fiber& fiber, char* stack, size_t stack_bytes, void (*entry)()) {
    fiber.stack_bottom = stack;
    fiber.stack_bytes = stack_bytes;
#if defined(__SANITIZE_ADDRESS__)
    // A stack reused from an earlier block keeps the redzones of the frames it was left in.
    __asan_unpoison_memory_region(stack, stack_bytes);
#endif
#if defined(__x86_64__)
    // From the top: a zero return address (entry never returns), entry's address for the switch's
    // ret (so entry starts with the stack a call would leave), six registers, the control words.
    auto* top = reinterpret_cast<uint64_t*>(stack + stack_bytes);
    uint64_t* frame = top - 2 - 6 - 1;
    uint32_t control_words[2];
    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(control_words[0]), "=m"(control_words[1]));
    std::memcpy(&frame[0], control_words, sizeof(control_words));
    for (int i = 1; i <= 6; ++i) frame[i] = 0;
    frame[7] = reinterpret_cast<uint64_t>(entry);
    frame[8] = 0;
    fiber.stack_pointer = frame;
#else
    getcontext(&fiber.context);
    fiber.context.uc_stack.ss_sp = stack;
    fiber.context.uc_stack.ss_size = stack_bytes;
    fiber.context.uc_link = nullptr;
    makecontext(&fiber.context, entry, 0);
#endif
}

// Suspend `from` and resume `to`.  `from_ends`: `from` never runs again (its thread exited).
inline void switch_fiber(Fiber& from, Fiber& to, bool from_ends = false) {
#if defined(__SANITIZE_ADDRESS__)
    void* fake_stack = nullptr;
    __sanitizer_start_switch_fiber(from_ends ? nullptr : &fake_stack, to.stack_bottom, to.stack_bytes);
#else
    (void)from_ends;
#endif
#if defined(__x86_64__)
    fastattn_emu_switch_stacks(&from.stack_pointer, to.stack_pointer);
#else
    swapcontext(&from.context, &to.context);
#endif
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
}

// The first thing a new fiber does: tell AddressSanitizer that the switch into it is complete, and
// learn the stack of the fiber that started it (the scheduler's, on the OS thread).
inline void enter_fiber(Fiber& starter) {
#if defined(__SANITIZE_ADDRESS__)
    const void* bottom = nullptr;
    size_t bytes = 0;
    __sanitizer_finish_switch_fiber(nullptr, &bottom, &bytes);
    starter.stack_bottom = static_cast<char*>(const_cast<void*>(bottom));
    starter.stack_bytes = bytes;
#else
    (void)starter;
#endif
}

struct PendingCopy {
    void* dst;
    const void* src;
    int bytes, source_bytes;
};

struct Thread {
    Fiber fiber;
    uint3 index;
    int linear, lane, warp;
    Wait wait = Wait::none;
    std::vector<std::vector<PendingCopy>> copy_groups;  // committed groups, oldest first
    std::vector<PendingCopy> open_group;                // issued since the last commit
};

// What the lanes of one warp exchange in a collective: up to 16 words each.
struct WarpSlots {
    unsigned int words[kWarpSize][16];
    const void* pointers[kWarpSize];
    // mma.sync: the operands A (16x16) and B (16x8), decoded from the lanes' words once per warp.
    float matrix_a[16][16], matrix_b[16][8];
    bool decoded;
};

struct Launch {
    dim3 grid, block;
    uint3 block_index;
    std::vector<Thread> threads;
    std::vector<WarpSlots> warps;
    std::vector<int> warp_order;  // rank of each warp in the current interval between block barriers
    std::vector<unsigned char> shared;  // guard | dynamic shared memory | guard
    size_t shared_bytes = 0;
    std::function<void()> body;
    Fiber scheduler;
    std::vector<std::unique_ptr<char[]>> stacks;  // kept from block to block: one per thread
    Thread* current = nullptr;
    std::string error;
    std::mt19937_64 order_random;
    std::vector<int> votes;  // __syncthreads_or: each thread's predicate
};

// The launch running on this OS thread (its fibers all run on the thread that launched them), so
// that Python threads may launch at the same time (ctypes releases the GIL during a launch).
inline Launch*& launch_state() {
    static thread_local Launch* state = nullptr;
    return state;
}

inline Thread& this_thread() { return *launch_state()->current; }

// Give the scheduler back control until this thread's wait is released.
inline void yield_to_scheduler() {
    Launch& launch = *launch_state();
    switch_fiber(this_thread().fiber, launch.scheduler);
}

inline void block_barrier() {
    this_thread().wait = Wait::block;
    yield_to_scheduler();
}

inline void warp_barrier() {
    this_thread().wait = Wait::warp;
    yield_to_scheduler();
}

inline void thread_entry() {
    Launch& launch = *launch_state();
    enter_fiber(launch.scheduler);
    try {
        launch.body();
        if (!this_thread().open_group.empty() || !this_thread().copy_groups.empty()) {
            // The device completes them anyway; the kernels never leave copies unread, so it is a bug.
            fail("a thread exited with cp.async copies it never waited for");
        }
    } catch (const Failure& failure) {
        if (launch.error.empty()) launch.error = failure.message;
    }
    this_thread().wait = Wait::done;
    switch_fiber(this_thread().fiber, launch.scheduler, true);
}

inline std::string thread_name(const Thread& thread) {
    return "thread (" + std::to_string(thread.index.x) + "," + std::to_string(thread.index.y) + "," +
           std::to_string(thread.index.z) + ")";
}

inline std::string block_name(const Launch& launch) {
    return "block (" + std::to_string(launch.block_index.x) + "," + std::to_string(launch.block_index.y) + "," +
           std::to_string(launch.block_index.z) + ")";
}

// A new order of the warps for the next interval between block barriers, drawn by the seed.
inline void shuffle_warp_order(Launch& launch) {
    std::shuffle(launch.warp_order.begin(), launch.warp_order.end(), launch.order_random);
}

// Release the threads waiting at a barrier every live thread has reached; fail when none can be.
inline void release_or_fail(Launch& launch) {
    size_t at_block = 0, done = 0;
    for (const Thread& thread : launch.threads) {
        at_block += thread.wait == Wait::block;
        done += thread.wait == Wait::done;
    }
    if (done == launch.threads.size()) return;
    if (at_block + done == launch.threads.size()) {
        if (done) {
            fail(block_name(launch) + ": " + std::to_string(done) + " threads exited while " + std::to_string(at_block) +
                 " wait at __syncthreads");
        }
        for (Thread& thread : launch.threads) thread.wait = Wait::none;
        shuffle_warp_order(launch);
        return;
    }
    // Warps whose lanes all wait in a collective: the first of them in this interval's order goes on
    // alone, so each warp runs ahead of the later ones up to the next __syncthreads (warps advancing
    // in lockstep would hide every missing barrier between them).
    std::vector<int> ready;
    const int warps = static_cast<int>(launch.warps.size());
    for (int warp = 0; warp < warps; ++warp) {
        int waiting = 0, members = 0, finished = 0;
        for (const Thread& thread : launch.threads) {
            if (thread.warp != warp) continue;
            ++members;
            waiting += thread.wait == Wait::warp;
            finished += thread.wait == Wait::done;
        }
        if (waiting == 0) continue;
        if (waiting == members) {
            ready.push_back(warp);
        } else if (waiting + finished == members) {
            fail(block_name(launch) + ", warp " + std::to_string(warp) + ": " + std::to_string(finished) +
                 " lanes exited while " + std::to_string(waiting) + " wait in a warp collective");
        }
    }
    if (ready.empty()) {
        fail(block_name(launch) + ": deadlock: " + std::to_string(at_block) +
             " threads wait at __syncthreads while others wait in a warp collective their warp never completes");
    }
    const int chosen = *std::min_element(ready.begin(), ready.end(),
                                         [&](int a, int b) { return launch.warp_order[a] < launch.warp_order[b]; });
    for (Thread& thread : launch.threads) {
        if (thread.warp == chosen) thread.wait = Wait::none;
    }
}

inline void check_guards(const Launch& launch) {
    const unsigned char* bytes = launch.shared.data();
    const size_t end = kGuardBytes + launch.shared_bytes;
    for (size_t i = 0; i < kGuardBytes; ++i) {
        if (bytes[i] != kPoison || bytes[end + i] != kPoison) {
            fail(block_name(launch) + ": a write outside the " + std::to_string(launch.shared_bytes) +
                 " bytes of dynamic shared memory");
        }
    }
}

inline void run_block(Launch& launch) {
    const unsigned int count = launch.block.x * launch.block.y * launch.block.z;
    launch.threads.assign(count, Thread{});
    launch.warps.assign((count + kWarpSize - 1) / kWarpSize, WarpSlots{});
    launch.warp_order.resize(launch.warps.size());
    for (size_t warp = 0; warp < launch.warp_order.size(); ++warp) launch.warp_order[warp] = static_cast<int>(warp);
    shuffle_warp_order(launch);
    launch.shared.assign(launch.shared_bytes + 2 * kGuardBytes, kPoison);
    for (unsigned int linear = 0; linear < count; ++linear) {
        Thread& thread = launch.threads[linear];
        thread.linear = static_cast<int>(linear);
        thread.lane = static_cast<int>(linear % kWarpSize);
        thread.warp = static_cast<int>(linear / kWarpSize);
        thread.index = uint3{linear % launch.block.x, (linear / launch.block.x) % launch.block.y,
                             linear / (launch.block.x * launch.block.y)};
        if (launch.stacks.size() <= linear) launch.stacks.emplace_back(new char[kStackBytes]);
        start_fiber(thread.fiber, launch.stacks[linear].get(), kStackBytes, thread_entry);
    }
    std::vector<Thread*> order;
    while (true) {
        order.clear();
        for (Thread& thread : launch.threads) {
            if (thread.wait == Wait::none) order.push_back(&thread);
        }
        if (order.empty()) {
            bool all_done = true;
            for (const Thread& thread : launch.threads) all_done = all_done && thread.wait == Wait::done;
            if (all_done) break;
            release_or_fail(launch);
            continue;
        }
        std::shuffle(order.begin(), order.end(), launch.order_random);
        for (Thread* thread : order) {
            launch.current = thread;
            switch_fiber(launch.scheduler, thread->fiber);
            if (!launch.error.empty()) fail(launch.error);
        }
    }
    check_guards(launch);
}

// Run `kernel(args...)` over the grid; returns "" or the first error.  `arguments[i]` points to
// the value of the kernel's i-th parameter (as cuLaunchKernel's kernelParams do).
template <typename... Params>
std::string launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, void** arguments,
                          unsigned long long seed) {
    Launch launch;
    launch.grid = grid;
    launch.block = block;
    launch.shared_bytes = shared_bytes;
    launch.order_random.seed(seed);
    std::tuple<std::decay_t<Params>...> values;
    size_t position = 0;
    std::apply([&](auto&... value) { ((std::memcpy(&value, arguments[position++], sizeof(value))), ...); }, values);
    launch.body = [&] { std::apply(kernel, values); };
    launch_state() = &launch;
    try {
        for (unsigned int z = 0; z < grid.z; ++z) {
            for (unsigned int y = 0; y < grid.y; ++y) {
                for (unsigned int x = 0; x < grid.x; ++x) {
                    launch.block_index = uint3{x, y, z};
                    run_block(launch);
                }
            }
        }
    } catch (const Failure& failure) {
        launch_state() = nullptr;
        return failure.message;
    }
    launch_state() = nullptr;
    return "";
}

// The byte size of each of a kernel's parameters, for the driver to check its arguments against.
template <typename... Params> int parameter_sizes(void (*)(Params...), unsigned long long* sizes, int capacity) {
    const unsigned long long all[] = {sizeof(std::decay_t<Params>)..., 0};
    const int count = static_cast<int>(sizeof...(Params));
    for (int i = 0; i < count && i < capacity; ++i) sizes[i] = all[i];
    return count;
}

template <typename T> T* dynamic_shared() {
    return reinterpret_cast<T*>(launch_state()->shared.data() + kGuardBytes);
}

// ---------------------------------------------------------------------------------------------
// Warp collectives.
inline WarpSlots& warp_slots() { return launch_state()->warps[this_thread().warp]; }

inline void check_full_mask(unsigned int mask, const char* what) {
    if (mask != 0xffffffffu) fail(std::string(what) + ": only the full-warp mask is emulated");
}

// A shuffle: every lane gives `value` and receives lane source's (`what` names the intrinsic).
template <typename T> T warp_shuffle(unsigned int mask, T value, int source, int width, const char* what) {
    static_assert(sizeof(T) <= 8, "a shuffle of a value wider than 8 bytes");
    check_full_mask(mask, what);
    if (width != kWarpSize) fail(std::string(what) + ": only width 32 is emulated");
    Thread& thread = this_thread();
    WarpSlots& slots = warp_slots();
    std::memcpy(slots.words[thread.lane], &value, sizeof(T));
    warp_barrier();
    T result;
    std::memcpy(&result, slots.words[source & (kWarpSize - 1)], sizeof(T));
    warp_barrier();  // every lane has read before the slots are written again
    return result;
}

// __syncthreads_or: a block barrier that gives every thread whether any thread's predicate holds.
inline bool block_vote_any(bool predicate) {
    Launch& launch = *launch_state();
    if (launch.votes.size() != launch.threads.size()) launch.votes.assign(launch.threads.size(), 0);
    launch.votes[this_thread().linear] = predicate ? 1 : 0;
    block_barrier();
    const bool any = std::any_of(launch.votes.begin(), launch.votes.end(), [](int vote) { return vote != 0; });
    block_barrier();  // every thread has read before a later vote writes
    return any;
}

// __any_sync: whether any lane's predicate holds, given to every lane.
inline bool vote_any(unsigned int mask, bool predicate) {
    check_full_mask(mask, "__any_sync");
    Thread& thread = this_thread();
    WarpSlots& slots = warp_slots();
    slots.words[thread.lane][0] = predicate ? 1u : 0u;
    warp_barrier();
    bool any = false;
    for (int lane = 0; lane < kWarpSize; ++lane) any = any || slots.words[lane][0] != 0;
    warp_barrier();  // every lane has read before the slots are written again
    return any;
}

// __syncwarp: the lanes meet, so that shared-memory writes before it are seen by every lane after.
inline void sync_warp(unsigned int mask) {
    check_full_mask(mask, "__syncwarp");
    warp_barrier();
}

enum class Operand { f16, bf16 };

inline float operand_value(unsigned int word, int half, Operand kind) {
    const unsigned short bits = static_cast<unsigned short>(half ? word >> 16 : word & 0xffffu);
    return kind == Operand::f16 ? half_bits_to_float(bits) : bfloat16_bits_to_float(bits);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: lane l (group g = l/4, t = l%4) holds
//   A: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B: b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C/D: c0,c1 = (g, 2t), (g, 2t+1); c2,c3 = (g+8, 2t), (g+8, 2t+1)
// A 32-bit register's low half is the element of the lower index.
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

inline void mma_m16n8k16(float* c, const unsigned int* a, const unsigned int* b, Operand kind) {
    Thread& thread = this_thread();
    WarpSlots& slots = warp_slots();
    unsigned int* mine = slots.words[thread.lane];
    for (int i = 0; i < 4; ++i) mine[i] = a[i];
    mine[4] = b[0];
    mine[5] = b[1];
    slots.decoded = false;
    warp_barrier();
    // The first lane to run after the barrier decodes the operands for the warp; no lane writes the
    // slots again before the barrier below.
    if (!slots.decoded) {
        for (int lane = 0; lane < kWarpSize; ++lane) {
            const int g = lane / 4, t = lane % 4;
            const unsigned int* words = slots.words[lane];
            for (int half = 0; half < 2; ++half) {
                slots.matrix_a[g][2 * t + half] = operand_value(words[0], half, kind);
                slots.matrix_a[g + 8][2 * t + half] = operand_value(words[1], half, kind);
                slots.matrix_a[g][2 * t + 8 + half] = operand_value(words[2], half, kind);
                slots.matrix_a[g + 8][2 * t + 8 + half] = operand_value(words[3], half, kind);
                slots.matrix_b[2 * t + half][g] = operand_value(words[4], half, kind);
                slots.matrix_b[2 * t + 8 + half][g] = operand_value(words[5], half, kind);
            }
        }
        slots.decoded = true;
    }
    const int g = thread.lane / 4, t = thread.lane % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        float sum = c[i];
        for (int k = 0; k < 16; ++k) sum += slots.matrix_a[row][k] * slots.matrix_b[k][col];
        c[i] = sum;
    }
    warp_barrier();  // every lane has read the operands before the slots are written again
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8j..8j+7 give the addresses of rows
// 0..7 of matrix j; lane l receives in r[j] the elements (l/4, 2(l%4)) and (l/4, 2(l%4)+1) of
// matrix j, or of its transpose with .trans.
inline void ldmatrix_x4(unsigned int* r, const void* pointer, bool transpose) {
    Thread& thread = this_thread();
    WarpSlots& slots = warp_slots();
    check_aligned(pointer, 16, "ldmatrix row");
    slots.pointers[thread.lane] = pointer;
    warp_barrier();
    const int g = thread.lane / 4, t = thread.lane % 4;
    for (int j = 0; j < 4; ++j) {
        unsigned short element[2];
        for (int half = 0; half < 2; ++half) {
            const int row = transpose ? 2 * t + half : g, col = transpose ? g : 2 * t + half;
            const unsigned char* row_start = static_cast<const unsigned char*>(slots.pointers[8 * j + row]);
            std::memcpy(&element[half], row_start + 2 * col, 2);
        }
        r[j] = static_cast<unsigned int>(element[0]) | (static_cast<unsigned int>(element[1]) << 16);
    }
    warp_barrier();
}

// ---------------------------------------------------------------------------------------------
// cp.async: poison now, data at the wait_group that completes the group.
inline void cp_async(void* dst, const void* src, int bytes, int source_bytes) {
    check_aligned(dst, bytes, "cp.async destination");
    if (source_bytes > 0) check_aligned(src, bytes, "cp.async source");
    std::memset(dst, kPoison, bytes);
    this_thread().open_group.push_back(PendingCopy{dst, src, bytes, source_bytes});
}

inline void cp_async_commit() {
    Thread& thread = this_thread();
    thread.copy_groups.push_back(std::move(thread.open_group));
    thread.open_group.clear();
}

inline void cp_async_wait(int in_flight) {
    Thread& thread = this_thread();
    while (static_cast<int>(thread.copy_groups.size()) > in_flight) {
        for (const PendingCopy& copy : thread.copy_groups.front()) {
            std::memcpy(copy.dst, copy.src, copy.source_bytes);
            std::memset(static_cast<char*>(copy.dst) + copy.source_bytes, 0, copy.bytes - copy.source_bytes);
        }
        thread.copy_groups.erase(thread.copy_groups.begin());
    }
}

}  // namespace fastattn_emu

#define threadIdx (fastattn_emu::this_thread().index)
#define blockIdx (fastattn_emu::launch_state()->block_index)
#define blockDim (fastattn_emu::launch_state()->block)
#define gridDim (fastattn_emu::launch_state()->grid)

inline void __syncthreads() { fastattn_emu::block_barrier(); }

template <typename T> inline T __shfl_xor_sync(unsigned int mask, T value, int lane_mask, int width = 32) {
    return fastattn_emu::warp_shuffle(mask, value, fastattn_emu::this_thread().lane ^ lane_mask, width, "__shfl_xor_sync");
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
