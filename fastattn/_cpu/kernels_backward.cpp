/* One instruction-set level's backward entry points (kernel_entries.h): delta, the gradient pass
 * and the dQ pass.  The arithmetic is in flash_backward.h and flash_backward_bf16.h.
 */
#include "flash_backward_bf16.h"
#include "kernel_entries.h"

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

/* Whether pass 2 runs on the bfloat16 pairs (flash_backward_bf16.h: AMX tiles or vdpbf16ps; float16
 * as bfloat16 parts, on AMX tiles only: on vdpbf16ps vectors, at half the tiles' rate and a third of
 * their products, the parts would cost what they save); pass 3 must then read its dQ^T tiles with
 * that path's row padding. */
static bool backward_on_pairs(const BwdParams* p) {
#if defined(FASTATTN_HAS_AMX)
    return (p->f.dtype == DTYPE_BFLOAT16 || p->f.dtype == DTYPE_FLOAT16) && pairs_backward_applies(p->f);
#elif defined(FASTATTN_HAS_AVX512BF16)
    return p->f.dtype == DTYPE_BFLOAT16 && pairs_backward_applies(p->f);
#else
    (void)p;
    return false;
#endif
}

/* Which kernel runs the backward's gradient pass: "vector", "dpbf16" or "amx". */
const char* backward_kernel(const BwdParams* p) {
    if (!backward_on_pairs(p)) return "vector";
#if defined(FASTATTN_HAS_AMX)
    return "amx";
#else
    return "dpbf16";
#endif
}

size_t backward_scratch_bytes(const BwdParams* p) {
    if (p->f.dtype == DTYPE_FLOAT64) return sizeof(double) * backward_scratch_elements<double>(*p);
    const size_t vectors = sizeof(float) * backward_scratch_elements<float>(*p);
#if defined(FASTATTN_HAS_AVX512BF16)
    if (backward_on_pairs(p)) return std::max(vectors, (size_t)PairsBackwardBuffers::bytes(p->f));
#endif
    return vectors;
}

void backward_delta(const void* params, char*, int64_t index) {
    const BwdParams& p = *static_cast<const BwdParams*>(params);
#define FASTATTN_CALL(T, In) delta_row<T, In>(p, index)
    FASTATTN_BY_DTYPE(p.f.dtype, FASTATTN_CALL)
#undef FASTATTN_CALL
}

void backward_gradients(const void* params, char* scratch, int64_t item) {
    const BwdParams& p = *static_cast<const BwdParams*>(params);
#if defined(FASTATTN_HAS_AVX512BF16)
    if (backward_on_pairs(&p)) {
        const KeyChunk where = key_chunk_of(p, item);
        gradient_block_pairs(p, scratch, where.b, where.kvh, where.chunk);
        return;
    }
#endif
#define FASTATTN_CALL(T, In) gradient_item<T, In>(p, scratch, item)
    FASTATTN_BY_DTYPE(p.f.dtype, FASTATTN_CALL)
#undef FASTATTN_CALL
}

void backward_dq(const void* params, char* scratch, int64_t item) {
    const BwdParams& p = *static_cast<const BwdParams*>(params);
#if defined(FASTATTN_HAS_AVX512BF16)
    if (backward_on_pairs(&p)) {
        if (p.f.dtype == DTYPE_FLOAT16)
            dq_item<float, half_bits>(p, scratch, item, kPairsRowAlign);
        else
            dq_item<float, bfloat16_bits>(p, scratch, item, kPairsRowAlign);
        return;
    }
#endif
#define FASTATTN_CALL(T, In) dq_item<T, In>(p, scratch, item, vector_row_align<T>(p.f))
    FASTATTN_BY_DTYPE(p.f.dtype, FASTATTN_CALL)
#undef FASTATTN_CALL
}

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn
