/* Scratch memory that a calling thread keeps from one kernel call to the next.
 *
 * A call needs scratch for its OpenMP threads (tiles, running max and sum, the output accumulator),
 * plus the decode path's split partials, the AMX forward's packed values, or the backward's delta
 * rows and dQ partials.  Allocating those per call
 * costs more than a small call's whole kernel: glibc consolidates its free lists for every block of
 * tens of KiB.  Instead each calling thread keeps one growing block per slot, reused while it is big
 * enough and freed when the thread exits, so a thread holds at most its largest call's scratch.
 * A call never nests inside another on the same thread (the kernels call no Python), so a slot is
 * never in use twice at once.
 */
#ifndef FASTATTN_THREAD_SCRATCH_H
#define FASTATTN_THREAD_SCRATCH_H

#include <cstddef>
#include <cstdlib>

namespace fastattn {

enum ScratchSlot { SCRATCH_TILES = 0, SCRATCH_ROWS = 1, SCRATCH_PARTIALS = 2, SCRATCH_VALUES = 3, SCRATCH_SLOTS = 4 };

struct ScratchBlock {
    void* data = nullptr;
    size_t size = 0;
    ~ScratchBlock() { std::free(data); }
};

/* At least `bytes` of 64-byte aligned memory for `slot`, or nullptr when it cannot be allocated. */
inline char* thread_scratch(int slot, size_t bytes) {
    static thread_local ScratchBlock blocks[SCRATCH_SLOTS];
    ScratchBlock& block = blocks[slot];
    if (block.size < bytes || block.data == nullptr) {
        const size_t rounded = (bytes + 63) / 64 * 64 + 64;
        std::free(block.data);
        block.data = std::aligned_alloc(64, rounded);
        block.size = block.data ? rounded : 0;
    }
    return static_cast<char*>(block.data);
}

}  // namespace fastattn

#endif
