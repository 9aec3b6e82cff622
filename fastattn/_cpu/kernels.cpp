/* One instruction-set level's CPU kernels and their table (kernel_table.h).
 *
 * setup.py compiles this file once per level, with that level's target flags and
 * -DFASTATTN_ISA_NAMESPACE=isa_<level> -DFASTATTN_ISA_NAME="<level>" (isa.h), and links the objects
 * into fastattn._cpu._flash, whose dispatch (dispatch.h) calls the table of the level it chose.
 */
#include "flash_amx.h"
#include "flash_bf16.h"
#include "flash_backward.h"
#include "flash_backward_bf16.h"
#include "kernel_table.h"

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

#define FASTATTN_BY_DTYPE(CODE, CALL)                             \
    switch (CODE) {                                               \
        case DTYPE_FLOAT32: CALL(float, float); break;            \
        case DTYPE_FLOAT64: CALL(double, double); break;          \
        case DTYPE_FLOAT16: CALL(float, half_bits); break;        \
        case DTYPE_BFLOAT16: CALL(float, bfloat16_bits); break;   \
        default: break;                                           \
    }

static size_t forward_scratch_bytes(const FwdParams* p) {
    if (p->dtype == DTYPE_FLOAT64) return sizeof(double) * scratch_elements<double>(*p);
    const size_t vectors = sizeof(float) * scratch_elements<float>(*p);
#if defined(FASTATTN_HAS_AVX512BF16)
    if (p->dtype == DTYPE_BFLOAT16) /* one head's buffers, or a group's (forward_heads with PairKernel) */
        return std::max(vectors, (size_t)(forward_head_group(*p) * (kHeadStateBytes + PairBuffers::bytes(*p))));
#endif
    return vectors;
}

static void forward_item(const void* params, char* scratch, int64_t item) {
    const FwdParams& p = *static_cast<const FwdParams*>(params);
#define FASTATTN_CALL(T, In) run_item<T, In>(p, scratch, item)
    FASTATTN_BY_DTYPE(p.dtype, FASTATTN_CALL)
#undef FASTATTN_CALL
}

/* K/V prepared once per call before the items: V^T tiles on AMX (flash_amx.h), float16/bfloat16 K
 * and V in float32 at 16-register levels (flash_forward.h: converts_kv_once); 0 where no pass runs. */
static size_t forward_packed_bytes(const FwdParams* p) {
#if defined(FASTATTN_HAS_AMX)
    return packed_values_bytes(*p);
#else
    return converts_kv_once(*p) ? converted_kv_bytes(*p) : 0;
#endif
}

static void forward_pack(const void* params, char*, int64_t item) {
    const FwdParams& p = *static_cast<const FwdParams*>(params);
#if defined(FASTATTN_HAS_AMX)
    pack_value_item(p, item);
#else
#define FASTATTN_CALL(T, In) convert_kv_item<T, In>(p, item)
    FASTATTN_BY_DTYPE(p.dtype, FASTATTN_CALL)
#undef FASTATTN_CALL
#endif
}

static void forward_combine(const void* params, char*, int64_t index) {
    const FwdParams& p = *static_cast<const FwdParams*>(params);
#define FASTATTN_CALL(T, In) combine_item<T, In>(p, index)
    FASTATTN_BY_DTYPE(p.dtype, FASTATTN_CALL)
#undef FASTATTN_CALL
}

/* Whether pass 2 runs on the bfloat16 pairs (flash_backward_bf16.h: AMX tiles or vdpbf16ps); pass 3
 * must then read its dQ^T tiles with that path's row padding. */
static bool backward_on_pairs(const BwdParams* p) {
#if defined(FASTATTN_HAS_AVX512BF16)
    return p->f.dtype == DTYPE_BFLOAT16 && pairs_backward_applies(p->f);
#else
    (void)p;
    return false;
#endif
}

/* Which kernel runs the backward's gradient pass: "vector", "dpbf16" or "amx". */
static const char* backward_kernel(const BwdParams* p) {
    if (!backward_on_pairs(p)) return "vector";
#if defined(FASTATTN_HAS_AMX)
    return "amx";
#else
    return "dpbf16";
#endif
}

static size_t backward_scratch_bytes(const BwdParams* p) {
    if (p->f.dtype == DTYPE_FLOAT64) return sizeof(double) * backward_scratch_elements<double>(*p);
    const size_t vectors = sizeof(float) * backward_scratch_elements<float>(*p);
#if defined(FASTATTN_HAS_AVX512BF16)
    if (backward_on_pairs(p)) return std::max(vectors, (size_t)PairsBackwardBuffers::bytes(p->f));
#endif
    return vectors;
}

static void backward_delta(const void* params, char*, int64_t index) {
    const BwdParams& p = *static_cast<const BwdParams*>(params);
#define FASTATTN_CALL(T, In) delta_row<T, In>(p, index)
    FASTATTN_BY_DTYPE(p.f.dtype, FASTATTN_CALL)
#undef FASTATTN_CALL
}

static void backward_gradients(const void* params, char* scratch, int64_t item) {
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

static void backward_dq(const void* params, char* scratch, int64_t item) {
    const BwdParams& p = *static_cast<const BwdParams*>(params);
#if defined(FASTATTN_HAS_AVX512BF16)
    if (backward_on_pairs(&p)) {
        dq_item<float, bfloat16_bits>(p, scratch, item, kPairsRowAlign);
        return;
    }
#endif
#define FASTATTN_CALL(T, In) dq_item<T, In>(p, scratch, item, vector_row_align<T>(p.f))
    FASTATTN_BY_DTYPE(p.f.dtype, FASTATTN_CALL)
#undef FASTATTN_CALL
}

static const char* forward_kernel(const FwdParams* p, int64_t rows) {
    static const char* const names[] = {"vector", "vector-decode", "dpbf16", "dpbf16-decode", "amx", "amx-decode"};
    return names[forward_kernel_of(*p, rows)];
}

#undef FASTATTN_BY_DTYPE

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
