/* Memory for the results the kernels return (outputs, lse, gradients), kept for the next call.
 *
 * glibc serves a request of at least its mmap threshold (128 KiB, rising with the sizes freed up to
 * 32 MiB) with fresh pages, and trims the heap top again once more than twice that lies free, so a
 * call that returns a few MiB gets pages the OS must fault in and zero on the kernel's first write.
 * On the 2-core Xeon model 167 (KVM) that was 5-10% of a float32 C5 forward (B1 Hq32 Hkv8 S2048
 * D128 causal, a 32 MiB output) and ~2.5% of a bfloat16 C1 one (B1 H8 S1024 D64, 1 MiB; kernel
 * samples 4.7% -> 2.2% with glibc's thresholds raised).  Here a result's block, once its array is
 * gone, waits for the next request it fits.
 *
 * Blocks of at least kCachedMinBytes (smaller ones stay with malloc, which reuses them); a request
 * takes the smallest cached block that holds it and is at most twice its size (so a large block is
 * not held by a small result), the last kept of equal ones; at most kCacheSlots blocks and
 * kCacheMaxBytes in all are kept, the longest-kept freed first to make room.  A block keeps its
 * contents: the caller must not rely on fresh memory (the tests' poison_results fills every result
 * with NaN).  Not thread-safe: callers hold the GIL. */
#ifndef FASTATTN_RESULT_BLOCKS_H
#define FASTATTN_RESULT_BLOCKS_H

#include <cstddef>
#include <cstdlib>

namespace fastattn {

constexpr size_t kCachedMinBytes = size_t(256) << 10;
constexpr size_t kCacheMaxBytes = size_t(256) << 20;
constexpr int kCacheSlots = 8;

struct ResultBlockCache {
    void* data[kCacheSlots] = {};
    size_t size[kCacheSlots] = {};
    int count = 0;      /* slots [0, count) hold blocks, the longest-kept first */
    size_t bytes = 0;   /* their sizes' sum */

    void drop(int slot) {
        bytes -= size[slot];
        for (int i = slot; i + 1 < count; ++i) {
            data[i] = data[i + 1];
            size[i] = size[i + 1];
        }
        --count;
    }
};

static inline ResultBlockCache& result_block_cache() {
    static ResultBlockCache cache;
    return cache;
}

/* A 64-byte aligned block of at least `bytes`, cached or new, its size in *size (what
 * give_result_block takes back); null if out of memory. */
static inline void* take_result_block(size_t bytes, size_t* size) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    ResultBlockCache& cache = result_block_cache();
    int best = -1; /* among blocks of one size the last kept: the one most likely still in cache */
    for (int i = cache.count - 1; i >= 0; --i)
        if (cache.size[i] >= rounded && cache.size[i] / 2 <= rounded && (best < 0 || cache.size[i] < cache.size[best]))
            best = i;
    if (best < 0) {
        *size = rounded;
        return std::aligned_alloc(64, rounded);
    }
    void* block = cache.data[best];
    *size = cache.size[best];
    cache.drop(best);
    return block;
}

/* Give back a block of take_result_block (`size` as it said): kept for reuse, or freed. */
static inline void give_result_block(void* block, size_t size) {
    ResultBlockCache& cache = result_block_cache();
    if (size < kCachedMinBytes || size > kCacheMaxBytes) {
        std::free(block);
        return;
    }
    while (cache.count > 0 && (cache.count == kCacheSlots || cache.bytes + size > kCacheMaxBytes)) {
        std::free(cache.data[0]);
        cache.drop(0);
    }
    cache.data[cache.count] = block;
    cache.size[cache.count] = size;
    ++cache.count;
    cache.bytes += size;
}

}  // namespace fastattn

#endif
