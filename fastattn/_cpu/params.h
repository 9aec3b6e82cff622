/* The CPU kernels' parameters: plain data, the same at every instruction-set level.
 *
 * The Cython plans (_flash.pyx) fill these once per problem and hand them, by pointer, to the
 * kernel table of the level chosen at import (kernel_table.h, dispatch.h); every level's
 * translation units (kernels*.cpp) read the same layout.
 */
#ifndef FASTATTN_PARAMS_H
#define FASTATTN_PARAMS_H

#include <cstdint>

namespace fastattn {

// The numbers of fastattn/_codes.py (tests/test_codes.py checks them against it and the CUDA headers).
enum DtypeCode { DTYPE_FLOAT32 = 0, DTYPE_FLOAT64 = 1, DTYPE_FLOAT16 = 2, DTYPE_BFLOAT16 = 3 };
enum MaskKind { MASK_NONE = 0, MASK_BOOL = 1, MASK_FLOAT32 = 2, MASK_FLOAT64 = 3, MASK_FLOAT16 = 4, MASK_BFLOAT16 = 5 };

struct FwdParams {
    const char* q;
    const char* k;
    const char* v;
    char* out;
    char* lse;
    int64_t q_stride[3], k_stride[3], v_stride[3], out_stride[3], lse_stride[3]; /* b, h, s; in elements */
    int64_t batch, heads_q, heads_kv, seq_q, seq_k, head_dim, head_dim_v, group;
    int dtype;
    double scale;
    double softcap; /* 0: none */
    int causal;
    int64_t offset; /* query i sits at key position i + offset (Sk - Sq for bottom-right) */
    int64_t window_left, window_right; /* -1: unbounded */
    const char* mask;
    int mask_kind;
    int64_t mask_stride[4]; /* b, h, i, j; 0 on broadcast axes */
    const int64_t* key_lengths; /* NULL: all Sk keys */
    int64_t block_queries;      /* query positions per item */
    int64_t query_blocks;       /* ceil(Sq / block_queries) */
    int64_t key_tile;
    int64_t splits;       /* key splits per (b, kv head, query block); > 1 only for decode */
    int64_t head_group;   /* kv heads per decode item (0 or 1: one; token-major K/V: all, forward_items.h) */
    char* partial_out;    /* splits > 1: [items][splits][rows][Dv] in the compute type */
    char* partial_lse;    /* splits > 1: [items][splits][rows] */
    char* packed_kv;      /* K/V prepared once per call before the items, or NULL: bfloat16 on AMX, V^T
                           * of every key tile (flash_amx.h); float16/bfloat16 at the other levels,
                           * K and V in float32 (forward_items.h: converts_kv_once) */
    int skip_zero_weights; /* products whose weight (P or dS) is exactly 0 are skipped, not added */
    int* nonfinite_output; /* set to 1 (relaxed atomic) when a NaN or infinity is stored in a result */
    double dropout_p;      /* 0: no dropout */
    unsigned int dropout_key[2];
    unsigned int dropout_offset;
    unsigned long long dropout_threshold; /* keep iff word >= threshold (2^32 for p = 1) */
};

/* The most kv heads one forward item takes (forward_heads keeps a state pointer per head). */
constexpr int64_t kMaxHeadGroup = 64;

/* Kv heads per forward item and the items' kv-head groups. */
static inline int64_t forward_head_group(const FwdParams& p) {
    return p.head_group > kMaxHeadGroup ? kMaxHeadGroup : p.head_group > 1 ? p.head_group : 1;
}
static inline int64_t forward_head_groups(const FwdParams& p) {
    return (p.heads_kv + forward_head_group(p) - 1) / forward_head_group(p);
}

/* Work items of the forward: (batch, group of kv heads, query block, key split). */
static inline int64_t forward_items(const FwdParams& p) {
    return p.batch * forward_head_groups(p) * p.query_blocks * p.splits;
}

/* Rows of the split partials the decode path needs ([b][kv head][query block][split][rows] of Dv
 * outputs and one lse). */
static inline int64_t forward_partial_rows(const FwdParams& p) {
    return p.batch * p.heads_kv * p.query_blocks * p.splits * p.group * p.block_queries;
}

struct BwdParams {
    FwdParams f; /* q, k, v, the saved lse (read), sizes, flags, mask, key_lengths, tiles */
    const char* dout;
    const char* out;
    char* dq;
    char* dk;
    char* dv;
    int64_t dout_stride[3], o_stride[3], dq_stride[3], dk_stride[3], dv_stride[3]; /* b, h, s */
    char* delta; /* compute type, [B][Hq][Sq] */
    int64_t key_blocks;
    int64_t chunks;       /* key-block chunks per kv head: pass 2's items, each with its dQ partial */
    int64_t chunk_blocks; /* key blocks per chunk */
    char* dq_partial;     /* compute type, [chunks][B][Hkv][query_blocks][D][padded rows] (flash_backward.h) */
};

/* Elements of the backward's dQ partials (dq_partial) for vectors of `lanes` compute-type elements. */
static inline int64_t backward_partial_elements(const BwdParams& p, int64_t lanes) {
    const int64_t block = 2 * lanes, rows = (p.f.group * p.f.block_queries + block - 1) / block * block;
    return p.chunks * p.f.batch * p.f.heads_kv * p.f.query_blocks * p.f.head_dim * rows;
}

}  // namespace fastattn

#endif
