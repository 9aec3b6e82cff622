/* One instruction-set level's forward entry points for float32 and float64 (kernel_entries.h): the
 * items and the split-KV merge.  float16 and bfloat16 go to kernels_forward_half.cpp, a compiler
 * process of its own: the two halves of the forward build on two cores at once.  The arithmetic is
 * in flash_forward.h, flash_decode.h and forward_items.h (flash_amx.h includes them with the bfloat16
 * kernels, whose rule, forward_kernel_of, every dtype's items ask).
 */
#include "flash_amx.h"
#include "kernel_entries.h"

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

static inline bool is_half_dtype(int dtype) { return dtype == DTYPE_FLOAT16 || dtype == DTYPE_BFLOAT16; }

void forward_item(const void* params, char* scratch, int64_t item) {
    const FwdParams& p = *static_cast<const FwdParams*>(params);
    if (is_half_dtype(p.dtype)) return forward_item_half(params, scratch, item);
#define FASTATTN_CALL(T, In) run_item<T, In>(p, scratch, item)
    FASTATTN_BY_FULL_DTYPE(p.dtype, FASTATTN_CALL)
#undef FASTATTN_CALL
}

void forward_combine(const void* params, char* scratch, int64_t index) {
    const FwdParams& p = *static_cast<const FwdParams*>(params);
    if (is_half_dtype(p.dtype)) return forward_combine_half(params, scratch, index);
#define FASTATTN_CALL(T, In) combine_item<T, In>(p, index)
    FASTATTN_BY_FULL_DTYPE(p.dtype, FASTATTN_CALL)
#undef FASTATTN_CALL
}

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn
