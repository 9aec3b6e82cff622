/* One instruction-set level's table of kernels (kernel_table.h).
 *
 * setup.py compiles this file, kernels_forward.cpp, kernels_forward_half.cpp and kernels_backward.cpp
 * once per level, with that level's target flags and -DFASTATTN_ISA_NAMESPACE=isa_<level>
 * -DFASTATTN_ISA_NAME="<level>" (isa.h), and links the objects into fastattn._cpu._flash, whose
 * dispatch (dispatch.h) calls the table of the level it chose.
 */
#include "kernel_entries.h"
#include "kernel_table.h"
#include "simd.h"

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

const KernelTable* kernel_table() {
    static const KernelTable table = {
        FASTATTN_ISA_NAME,      FASTATTN_VECTOR_BYTES, forward_scratch_bytes, forward_item, forward_combine,
        forward_packed_bytes,   forward_pack,
        backward_scratch_bytes, backward_delta,        backward_gradients,    backward_dq,     forward_kernel,
        backward_kernel,
    };
    return &table;
}

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn
