/* One instruction-set level's forward entry points for float16 and bfloat16 (kernel_entries.h):
 * the items, the split-KV merge and the K/V pass before the items (V^T tiles on AMX, K and V in
 * float32 at the other levels: it runs for these dtypes only), and the entries that read no data.
 * The arithmetic is in flash_forward.h, flash_decode.h, flash_bf16.h and flash_amx.h.
 */
#include "flash_amx.h"
#include "kernel_entries.h"

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

void forward_item_half(const void* params, char* scratch, int64_t item) {
    const FwdParams& p = *static_cast<const FwdParams*>(params);
#define FASTATTN_CALL(T, In) run_item<T, In>(p, scratch, item)
    FASTATTN_BY_HALF_DTYPE(p.dtype, FASTATTN_CALL)
#undef FASTATTN_CALL
}

void forward_combine_half(const void* params, char*, int64_t index) {
    const FwdParams& p = *static_cast<const FwdParams*>(params);
#define FASTATTN_CALL(T, In) combine_item<T, In>(p, index)
    FASTATTN_BY_HALF_DTYPE(p.dtype, FASTATTN_CALL)
#undef FASTATTN_CALL
}

size_t forward_scratch_bytes(const FwdParams* p) {
    if (p->dtype == DTYPE_FLOAT64) return sizeof(double) * scratch_elements<double>(*p);
    const size_t vectors = sizeof(float) * scratch_elements<float>(*p);
#if defined(FASTATTN_HAS_AVX512BF16)
    if (p->dtype == DTYPE_BFLOAT16) /* one head's buffers, or a group's (forward_heads with PairKernel) */
        return std::max(vectors, (size_t)(forward_head_group(*p) * (kHeadStateBytes + PairBuffers::bytes(*p))));
#endif
#if defined(FASTATTN_HAS_AMX)
    if (p->dtype == DTYPE_FLOAT16) return std::max(vectors, (size_t)PairBuffers::bytes(*p)); /* its AMX items */
#endif
    return vectors;
}

/* K/V prepared once per call before the items: on AMX (flash_amx.h) bfloat16 V^T tiles, or float16
 * K and V as bfloat16 parts; float16/bfloat16 K and V in float32 at the other levels
 * (forward_items.h: converts_kv_once); 0 where no pass runs. */
size_t forward_packed_bytes(const FwdParams* p) {
#if defined(FASTATTN_HAS_AMX)
    return amx_packed_bytes(*p);
#else
    return converts_kv_once(*p) ? converted_kv_bytes(*p) : 0;
#endif
}

void forward_pack(const void* params, char*, int64_t item) {
    const FwdParams& p = *static_cast<const FwdParams*>(params);
#if defined(FASTATTN_HAS_AMX)
    amx_pack_item(p, item);
#else
#define FASTATTN_CALL(T, In) convert_kv_item<T, In>(p, item)
    FASTATTN_BY_HALF_DTYPE(p.dtype, FASTATTN_CALL)
#undef FASTATTN_CALL
#endif
}

const char* forward_kernel(const FwdParams* p, int64_t rows) {
    static const char* const names[] = {"vector", "vector-decode", "dpbf16", "dpbf16-decode", "amx", "amx-decode"};
    return names[forward_kernel_of(*p, rows)];
}

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn
