/* The entry points of one instruction-set level's kernels, split across translation units.
 *
 * setup.py compiles each of kernels_forward.cpp, kernels_backward.cpp and kernels.cpp once per level
 * (same flags, same -DFASTATTN_ISA_NAMESPACE), one compiler process each, so a level's forward and
 * backward build on two cores at once; kernels.cpp gathers the functions below into the level's
 * table (kernel_table.h).
 */
#ifndef FASTATTN_KERNEL_ENTRIES_H
#define FASTATTN_KERNEL_ENTRIES_H

#include <cstddef>
#include <cstdint>

#include "isa.h"
#include "params.h"

/* CALL(T, In) with the arithmetic type T and the stored element type In of a dtype code. */
#define FASTATTN_BY_DTYPE(CODE, CALL)                             \
    switch (CODE) {                                               \
        case DTYPE_FLOAT32: CALL(float, float); break;            \
        case DTYPE_FLOAT64: CALL(double, double); break;          \
        case DTYPE_FLOAT16: CALL(float, half_bits); break;        \
        case DTYPE_BFLOAT16: CALL(float, bfloat16_bits); break;   \
        default: break;                                           \
    }

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

/* kernels_forward.cpp */
size_t forward_scratch_bytes(const FwdParams* p);
void forward_item(const void* params, char* scratch, int64_t item);
void forward_combine(const void* params, char* scratch, int64_t index);
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
