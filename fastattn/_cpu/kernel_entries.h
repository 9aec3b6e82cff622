/* The entry points of one instruction-set level's kernels, split across translation units.
 *
 * setup.py compiles each of kernels_forward.cpp, kernels_forward_half.cpp, kernels_backward.cpp and
 * kernels.cpp once per level (same flags, same -DFASTATTN_ISA_NAMESPACE), one compiler process each,
 * so a level's forward (in two halves by dtype) and backward build on several cores at once;
 * kernels.cpp gathers the functions below into the level's table (kernel_table.h).
 */
#ifndef FASTATTN_KERNEL_ENTRIES_H
#define FASTATTN_KERNEL_ENTRIES_H

#include <cstddef>
#include <cstdint>

#include "isa.h"
#include "params.h"

/* CALL(T, In) with the arithmetic type T and the stored element type In of a dtype code: the
 * dtypes stored as their compute type (float32, float64), the half-precision ones (float16,
 * bfloat16, computed in float32), or all four. */
#define FASTATTN_FULL_DTYPE_CASES(CALL)                    \
    case DTYPE_FLOAT32: CALL(float, float); break;         \
    case DTYPE_FLOAT64: CALL(double, double); break;
#define FASTATTN_HALF_DTYPE_CASES(CALL)                    \
    case DTYPE_FLOAT16: CALL(float, half_bits); break;     \
    case DTYPE_BFLOAT16: CALL(float, bfloat16_bits); break;
#define FASTATTN_BY_FULL_DTYPE(CODE, CALL) \
    switch (CODE) {                        \
        FASTATTN_FULL_DTYPE_CASES(CALL)    \
        default: break;                    \
    }
#define FASTATTN_BY_HALF_DTYPE(CODE, CALL) \
    switch (CODE) {                        \
        FASTATTN_HALF_DTYPE_CASES(CALL)    \
        default: break;                    \
    }
#define FASTATTN_BY_DTYPE(CODE, CALL)      \
    switch (CODE) {                        \
        FASTATTN_FULL_DTYPE_CASES(CALL)    \
        FASTATTN_HALF_DTYPE_CASES(CALL)    \
        default: break;                    \
    }

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

/* kernels_forward.cpp: float32 and float64 items and merges; float16 and bfloat16 ones go on to
 * the *_half functions. */
void forward_item(const void* params, char* scratch, int64_t item);
void forward_combine(const void* params, char* scratch, int64_t index);

/* kernels_forward_half.cpp: float16 and bfloat16 items and merges, the K/V pass before them (it
 * runs for those dtypes only), and the entries that read no data (scratch size, kernel name). */
void forward_item_half(const void* params, char* scratch, int64_t item);
void forward_combine_half(const void* params, char* scratch, int64_t index);
size_t forward_scratch_bytes(const FwdParams* p);
size_t forward_packed_bytes(const FwdParams* p);
void forward_pack(const void* params, char* scratch, int64_t item);
const char* forward_kernel(const FwdParams* p, int64_t rows);

/* kernels_backward.cpp */
size_t backward_scratch_bytes(const BwdParams* p);
void backward_delta(const void* params, char* scratch, int64_t index);
void backward_gradients(const void* params, char* scratch, int64_t item);
void backward_dq(const void* params, char* scratch, int64_t item);
const char* backward_kernel(const BwdParams* p);

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
