// The SIMT emulator's runtime (the execution model is described in simt.h): fibers, the scheduler
// of a block's threads, the warp collectives and cp.async.  The driver (__init__.py) compiles it once
// per set of flags into a shared library that every emulated kernel library links, so a kernel's
// own build compiles the kernel alone.
#include "simt.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

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

namespace fastattn_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;  // the kernels keep register tiles of a few KiB per thread
constexpr size_t kGuardBytes = 256;         // around dynamic shared memory, checked at block end
constexpr unsigned char kPoison = 0xff;     // all bits set: NaN as float, half and bfloat16

struct Failure {
    std::string message;
};

[[noreturn]] void fail(const std::string& message) { throw Failure{message}; }

void check_aligned(const void* pointer, int bytes, const char* what) {
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


// Make `fiber` start `entry` on `stack` (stack_bytes, both multiples of 16) at its first switch.
void start_fiber(Fiber& fiber, char* stack, size_t stack_bytes, void (*entry)()) {
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
void switch_fiber(Fiber& from, Fiber& to, bool from_ends = false) {
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
void enter_fiber(Fiber& starter) {
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
    void (*body)(void*) = nullptr;  // the kernel with its arguments (launch_kernel in simt.h)
    void* context = nullptr;
    Fiber scheduler;
    std::vector<std::unique_ptr<char[]>> stacks;  // kept from block to block: one per thread
    Thread* current = nullptr;
    std::string error;
    std::mt19937_64 order_random;
    std::vector<int> votes;  // __syncthreads_or: each thread's predicate
};

// The launch running on this OS thread (its fibers all run on the thread that launched them), so
// that Python threads may launch at the same time (ctypes releases the GIL during a launch).
Launch*& launch_state() {
    static thread_local Launch* state = nullptr;
    return state;
}

Thread& this_thread() { return *launch_state()->current; }

// Give the scheduler back control until this thread's wait is released.
void yield_to_scheduler() {
    Launch& launch = *launch_state();
    switch_fiber(this_thread().fiber, launch.scheduler);
}

void warp_barrier() {
    this_thread().wait = Wait::warp;
    yield_to_scheduler();
}

void thread_entry() {
    Launch& launch = *launch_state();
    enter_fiber(launch.scheduler);
    try {
        launch.body(launch.context);
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

std::string block_name(const Launch& launch) {
    return "block (" + std::to_string(launch.block_index.x) + "," + std::to_string(launch.block_index.y) + "," +
           std::to_string(launch.block_index.z) + ")";
}

// A new order of the warps for the next interval between block barriers, drawn by the seed.
void shuffle_warp_order(Launch& launch) {
    std::shuffle(launch.warp_order.begin(), launch.warp_order.end(), launch.order_random);
}

// Release the threads waiting at a barrier every live thread has reached; fail when none can be.
void release_or_fail(Launch& launch) {
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

void check_guards(const Launch& launch) {
    const unsigned char* bytes = launch.shared.data();
    const size_t end = kGuardBytes + launch.shared_bytes;
    for (size_t i = 0; i < kGuardBytes; ++i) {
        if (bytes[i] != kPoison || bytes[end + i] != kPoison) {
            fail(block_name(launch) + ": a write outside the " + std::to_string(launch.shared_bytes) +
                 " bytes of dynamic shared memory");
        }
    }
}

void run_block(Launch& launch) {
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

// ---------------------------------------------------------------------------------------------
// Warp collectives.
WarpSlots& warp_slots() { return launch_state()->warps[this_thread().warp]; }

void check_full_mask(unsigned int mask, const char* what) {
    if (mask != 0xffffffffu) fail(std::string(what) + ": only the full-warp mask is emulated");
}

float operand_value(unsigned int word, int half, Operand kind) {
    const unsigned short bits = static_cast<unsigned short>(half ? word >> 16 : word & 0xffffu);
    return kind == Operand::f16 ? half_bits_to_float(bits) : bfloat16_bits_to_float(bits);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The running thread and launch, as the kernels see them.
const uint3& thread_index() { return this_thread().index; }
int lane_index() { return this_thread().lane; }
const uint3& block_index() { return launch_state()->block_index; }
const dim3& block_dim() { return launch_state()->block; }
const dim3& grid_dim() { return launch_state()->grid; }
unsigned char* dynamic_shared_bytes() { return launch_state()->shared.data() + kGuardBytes; }

int run_grid(dim3 grid, dim3 block, size_t shared_bytes, unsigned long long seed, void (*body)(void*), void* context,
             char* error, size_t error_bytes) {
    Launch launch;
    launch.grid = grid;
    launch.block = block;
    launch.shared_bytes = shared_bytes;
    launch.order_random.seed(seed);
    launch.body = body;
    launch.context = context;
    launch_state() = &launch;
    std::string message;
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
        message = failure.message;
    }
    launch_state() = nullptr;
    std::snprintf(error, error_bytes, "%s", message.c_str());
    return message.empty() ? 0 : 1;
}

// ---------------------------------------------------------------------------------------------
// Barriers and warp collectives.
void block_barrier() {
    this_thread().wait = Wait::block;
    yield_to_scheduler();
}

void warp_exchange(unsigned int mask, const void* value, void* result, size_t bytes, int source, int width,
                   const char* what) {
    check_full_mask(mask, what);
    if (width != kWarpSize) fail(std::string(what) + ": only width 32 is emulated");
    Thread& thread = this_thread();
    WarpSlots& slots = warp_slots();
    std::memcpy(slots.words[thread.lane], value, bytes);
    warp_barrier();
    std::memcpy(result, slots.words[source & (kWarpSize - 1)], bytes);
    warp_barrier();  // every lane has read before the slots are written again
}

// __syncthreads_or: a block barrier that gives every thread whether any thread's predicate holds.
bool block_vote_any(bool predicate) {
    Launch& launch = *launch_state();
    if (launch.votes.size() != launch.threads.size()) launch.votes.assign(launch.threads.size(), 0);
    launch.votes[this_thread().linear] = predicate ? 1 : 0;
    block_barrier();
    const bool any = std::any_of(launch.votes.begin(), launch.votes.end(), [](int vote) { return vote != 0; });
    block_barrier();  // every thread has read before a later vote writes
    return any;
}

// __any_sync: whether any lane's predicate holds, given to every lane.
bool vote_any(unsigned int mask, bool predicate) {
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
void sync_warp(unsigned int mask) {
    check_full_mask(mask, "__syncwarp");
    warp_barrier();
}

void mma_m16n8k16(float* c, const unsigned int* a, const unsigned int* b, Operand kind) {
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

void ldmatrix_x4(unsigned int* r, const void* pointer, bool transpose) {
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
void cp_async(void* dst, const void* src, int bytes, int source_bytes) {
    check_aligned(dst, bytes, "cp.async destination");
    if (source_bytes > 0) check_aligned(src, bytes, "cp.async source");
    std::memset(dst, kPoison, bytes);
    this_thread().open_group.push_back(PendingCopy{dst, src, bytes, source_bytes});
}

void cp_async_commit() {
    Thread& thread = this_thread();
    thread.copy_groups.push_back(std::move(thread.open_group));
    thread.open_group.clear();
}

void cp_async_wait(int in_flight) {
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
