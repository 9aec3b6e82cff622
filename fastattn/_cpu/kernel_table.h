/* The entry points of one instruction-set level's kernels, as a table of function pointers.
 *
 * kernels.cpp defines `const KernelTable* fastattn::isa_<level>::kernel_table()` for each level it
 * is compiled for; dispatch.h lists the levels of the build and says which the CPU can run.  The
 * item functions share one signature so the Cython plans hand them straight to their OpenMP loops.
 */
#ifndef FASTATTN_KERNEL_TABLE_H
#define FASTATTN_KERNEL_TABLE_H

#include <cstddef>
#include <cstdint>

#include "params.h"

namespace fastattn {

/* run(params, this thread's scratch, item): params is a FwdParams (forward_*) or BwdParams (backward_*). */
typedef void (*ItemFunction)(const void* params, char* scratch, int64_t item);

struct KernelTable {
    const char* name; /* "generic", "avx2", "avx512", "avx512bf16", "amx" or "native" */
    int vector_bytes; /* the width of the kernels' vectors: 32, or 64 with AVX-512 */
    size_t (*forward_scratch_bytes)(const FwdParams* params); /* per thread */
    ItemFunction forward_item;                                 /* one (b, kv head, query block, split) */
    ItemFunction forward_combine;                              /* merge one item's splits by lse */
    /* Bytes of the K/V prepared once per call before the items (0: no such pass), and the pass's
     * item, one (b, kv head, key tile) (params.h: packed_kv). */
    size_t (*forward_packed_bytes)(const FwdParams* params);
    ItemFunction forward_pack;
    size_t (*backward_scratch_bytes)(const BwdParams* params);
    ItemFunction backward_delta; /* one query row's delta = dO . O */
    ItemFunction backward_gradients; /* one (b, kv head, chunk of key blocks): dK, dV, a dQ partial */
    ItemFunction backward_dq;        /* one (b, kv head, query block): dQ, the partials summed */
    /* Which kernel runs a forward item of `rows` stacked query rows (forward_items.h: forward_kernel_of):
     * "vector", "vector-decode", "dpbf16" or "dpbf16-decode" (avx512bf16 level), "amx" or "amx-decode"
     * (amx level).  The
     * Python planner asks it to pick the AMX tile sizes. */
    const char* (*forward_kernel)(const FwdParams* params, int64_t rows);
    /* Which kernel runs the backward's gradient pass: "vector", "dpbf16" (avx512bf16 level) or "amx". */
    const char* (*backward_kernel)(const BwdParams* params);
};

}  // namespace fastattn

#endif
