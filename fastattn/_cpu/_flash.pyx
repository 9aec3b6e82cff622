# cython: language_level=3
# distutils: language = c++
"""Cython entry points of the CPU flash kernels: fill the kernels' parameters, run the work items
in OpenMP ``prange`` loops with the GIL released and one scratch slab per thread.  The arithmetic
lives in ``flash_forward.h`` (forward, decode, split-KV merge) and ``flash_backward.h``.
"""

from libc.stdint cimport int64_t, uint32_t, uint64_t
from cython.parallel cimport prange

import ml_dtypes
import numpy as np

cdef extern from "_omp_shim.h" nogil:
    int omp_get_thread_num()

cdef extern from "flash_forward.h" namespace "fastattn" nogil:
    cdef struct FwdParams:
        const char* q
        const char* k
        const char* v
        char* out
        char* lse
        int64_t q_stride[3]
        int64_t k_stride[3]
        int64_t v_stride[3]
        int64_t out_stride[3]
        int64_t lse_stride[3]
        int64_t batch, heads_q, heads_kv, seq_q, seq_k, head_dim, head_dim_v, group
        int dtype
        double scale
        double softcap
        int causal
        int64_t offset
        int64_t window_left, window_right
        const char* mask
        int mask_kind
        int64_t mask_stride[4]
        const int64_t* key_lengths
        int64_t block_queries
        int64_t query_blocks
        int64_t key_tile
        int64_t splits
        char* partial_out
        char* partial_lse
        int skip_zero_weights
        int* nonfinite_output
        double dropout_p
        unsigned int dropout_key[2]
        unsigned int dropout_offset
        unsigned long long dropout_threshold

cdef extern from "flash_backward.h" namespace "fastattn" nogil:
    cdef struct BwdParams:
        FwdParams f
        const char* dout
        const char* out
        char* dq
        char* dk
        char* dv
        int64_t dout_stride[3]
        int64_t o_stride[3]
        int64_t dq_stride[3]
        int64_t dk_stride[3]
        int64_t dv_stride[3]
        char* delta
        int64_t key_blocks

cdef extern from "flash_backward.h" nogil:
    size_t fa_backward_scratch_bytes(const BwdParams* p)
    void fa_backward_delta(const BwdParams* p, int64_t index)
    void fa_backward_dkdv(const BwdParams* p, char* scratch, int64_t item)
    void fa_backward_dq(const BwdParams* p, char* scratch, int64_t item)

cdef extern from "flash_forward.h" nogil:
    size_t fa_forward_scratch_bytes(const FwdParams* p)
    size_t fa_forward_partial_elements(const FwdParams* p)
    int64_t fa_forward_items(const FwdParams* p)
    void fa_forward_item(const FwdParams* p, char* scratch, int64_t item)
    void fa_forward_combine(const FwdParams* p, int64_t index)

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_DTYPE_CODES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2, _BFLOAT16: 3}
_MASK_CODES = {
    np.dtype(np.bool_): 1,
    np.dtype(np.float32): 2,
    np.dtype(np.float64): 3,
    np.dtype(np.float16): 4,
    _BFLOAT16: 5,
}


cdef inline size_t _address(array):
    return <size_t> array.__array_interface__["data"][0]


cdef void _strides(int64_t* dst, array, int count):
    cdef int axis
    for axis in range(count):
        dst[axis] = array.strides[axis] // array.itemsize


cdef void _fill(FwdParams* p, q, k, v, lse, double scale, double softcap, bint causal, int64_t offset,
                int64_t window_left, int64_t window_right, mask, key_lengths, int64_t block_queries,
                int64_t key_tile) except *:
    """The fields forward and backward share: inputs, lse, sizes, options, tiles."""
    cdef int axis
    p.q = <const char*> _address(q)
    p.k = <const char*> _address(k)
    p.v = <const char*> _address(v)
    p.lse = <char*> _address(lse)
    _strides(p.q_stride, q, 3)
    _strides(p.k_stride, k, 3)
    _strides(p.v_stride, v, 3)
    _strides(p.lse_stride, lse, 3)
    p.batch, p.heads_q, p.seq_q, p.head_dim = q.shape
    p.heads_kv, p.seq_k = k.shape[1], k.shape[2]
    p.head_dim_v = v.shape[3]
    p.group = p.heads_q // p.heads_kv
    p.dtype = _DTYPE_CODES[q.dtype]
    p.scale = scale
    p.softcap = softcap
    p.causal = causal
    p.offset = offset
    p.window_left = window_left
    p.window_right = window_right
    p.mask = NULL
    p.mask_kind = 0
    if mask is not None:
        p.mask = <const char*> _address(mask)
        p.mask_kind = _MASK_CODES[mask.dtype]
        _strides(p.mask_stride, mask, 4)
        for axis in range(4):
            if mask.shape[axis] == 1:
                p.mask_stride[axis] = 0
    p.key_lengths = NULL
    if key_lengths is not None:
        p.key_lengths = <const int64_t*> _address(key_lengths)
    p.block_queries = block_queries
    p.query_blocks = (p.seq_q + block_queries - 1) // block_queries
    p.key_tile = key_tile
    p.splits = 1
    p.partial_out = p.partial_lse = NULL
    p.out = NULL
    p.skip_zero_weights = 0
    p.nonfinite_output = NULL
    p.dropout_p = 0.0
    p.dropout_key[0] = p.dropout_key[1] = 0
    p.dropout_offset = 0
    p.dropout_threshold = 0


cdef void _fill_dropout(FwdParams* p, double dropout_p, uint64_t seed, uint32_t offset):
    """Dropout fields: the Philox key from the seed and the keep threshold (philox.h's layout)."""
    p.dropout_p = dropout_p
    p.dropout_key[0] = <unsigned int> (seed & 0xFFFFFFFF)
    p.dropout_key[1] = <unsigned int> (seed >> 32)
    p.dropout_offset = offset
    p.dropout_threshold = <unsigned long long> (dropout_p * 4294967296.0)


cdef char* _slab(size_t per_thread, int threads, list keep) except NULL:
    """One scratch slab per thread, 64-byte aligned; allocated here so failure is a MemoryError."""
    slab = np.empty(threads * per_thread + 64, dtype=np.uint8)
    keep.append(slab)
    return <char*> ((_address(slab) + 63) // 64 * 64)


def forward(q, k, v, out, lse, *, double scale, double softcap, bint causal, int64_t offset,
            int64_t window_left, int64_t window_right, mask, key_lengths,
            int64_t block_queries, int64_t key_tile, int64_t splits, int threads,
            double dropout_p=0.0, uint64_t dropout_seed=0, uint32_t dropout_offset=0):
    """Run the flash forward on (B, H, S, D)-ordered numpy arrays, writing ``out`` and ``lse``.

    Parameters
    ----------
    q, k, v : numpy.ndarray
        (B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv); one dtype among float32, float64,
        float16, bfloat16; any strides with a contiguous last axis.
    out : numpy.ndarray
        (B, Hq, Sq, Dv) of q's dtype, written.
    lse : numpy.ndarray
        (B, Hq, Sq) float32 (float64 for float64 inputs), written.
    scale, softcap : float
        Score multiplier; softcap 0 means none.
    causal : bool
        Hide keys right of the query's position ``i + offset``.
    offset : int
        Key position of query 0 (``Sk - Sq`` for bottom-right alignment, else 0).
    window_left, window_right : int
        Sliding window sides, -1 for unbounded.
    mask : numpy.ndarray or None
        Four-axis (B|1, Hq|1, Sq|1, Sk|1) bool or float array, read by strides.
    key_lengths : numpy.ndarray or None
        C-contiguous int64 (B,).
    block_queries, key_tile, splits : int
        Query positions per work item, keys per tile, key splits per item (decode).
    threads : int
        OpenMP threads for the parallel regions (capped at the number of work items).
    dropout_p, dropout_seed, dropout_offset : float, int, int
        Attention dropout (philox.h's mask); p = 0 for none.
    """
    cdef FwdParams p
    cdef int64_t items
    cdef size_t scratch_bytes
    cdef char* scratch
    keep = []
    _fill(&p, q, k, v, lse, scale, softcap, causal, offset, window_left, window_right, mask,
          key_lengths, block_queries, key_tile)
    _fill_dropout(&p, dropout_p, dropout_seed, dropout_offset)
    p.out = <char*> _address(out)
    _strides(p.out_stride, out, 3)
    p.splits = splits
    if splits > 1:
        compute = np.float64 if p.dtype == 1 else np.float32
        partial_lse = np.empty(fa_forward_partial_elements(&p), dtype=compute)
        partial_out = np.empty(fa_forward_partial_elements(&p) * p.head_dim_v, dtype=compute)
        keep += [partial_lse, partial_out]
        p.partial_out = <char*> _address(partial_out)
        p.partial_lse = <char*> _address(partial_lse)

    items = fa_forward_items(&p)
    threads = max(1, min(threads, items))
    scratch_bytes = (fa_forward_scratch_bytes(&p) + 63) // 64 * 64
    scratch = _slab(scratch_bytes, threads, keep)
    cdef int nonfinite = 0
    p.nonfinite_output = &nonfinite
    with nogil:
        _forward_pass(&p, scratch, scratch_bytes, items, threads)
        if nonfinite:  # see note_stored in flash_forward.h: rerun skipping zero-weight products
            p.skip_zero_weights = 1
            _forward_pass(&p, scratch, scratch_bytes, items, threads)


cdef void _forward_pass(FwdParams* p, char* scratch, size_t scratch_bytes, int64_t items, int threads) noexcept nogil:
    cdef int64_t index, combines
    for index in prange(items, schedule="dynamic", num_threads=threads):
        fa_forward_item(p, scratch + omp_get_thread_num() * scratch_bytes, index)
    if p.splits > 1:
        combines = p.batch * p.heads_kv * p.query_blocks
        for index in prange(combines, schedule="static", num_threads=threads):
            fa_forward_combine(p, index)


def backward(dout, q, k, v, out, lse, dq, dk, dv, *, double scale, double softcap, bint causal,
             int64_t offset, int64_t window_left, int64_t window_right, mask, key_lengths,
             int64_t block_queries, int64_t key_tile, int threads,
             double dropout_p=0.0, uint64_t dropout_seed=0, uint32_t dropout_offset=0):
    """Run the flash backward, writing ``dq``, ``dk`` and ``dv``.

    Parameters
    ----------
    dout, out : numpy.ndarray
        (B, Hq, Sq, Dv) in q's dtype: the output's gradient and the forward's output.
    q, k, v, lse
        The forward's inputs and its saved lse (float32; float64 for float64 inputs).
    dq, dk, dv : numpy.ndarray
        Shaped and typed like q, k, v; written (dk, dv summed over each kv head's group).
    scale, softcap, causal, offset, window_left, window_right, mask, key_lengths
        As for :func:`forward`.
    block_queries, key_tile : int
        Query positions per tile (all heads of a group stacked), keys per block.
    threads : int
        OpenMP threads.
    dropout_p, dropout_seed, dropout_offset : float, int, int
        The forward's dropout, regenerated.
    """
    cdef BwdParams p
    cdef int64_t index, rows, key_items, query_items
    cdef size_t scratch_bytes
    cdef char* scratch
    cdef int used
    keep = []
    _fill(&p.f, q, k, v, lse, scale, softcap, causal, offset, window_left, window_right, mask,
          key_lengths, block_queries, key_tile)
    _fill_dropout(&p.f, dropout_p, dropout_seed, dropout_offset)
    p.dout = <const char*> _address(dout)
    p.out = <const char*> _address(out)
    p.dq = <char*> _address(dq)
    p.dk = <char*> _address(dk)
    p.dv = <char*> _address(dv)
    _strides(p.dout_stride, dout, 3)
    _strides(p.o_stride, out, 3)
    _strides(p.dq_stride, dq, 3)
    _strides(p.dk_stride, dk, 3)
    _strides(p.dv_stride, dv, 3)
    delta = np.empty(q.shape[0] * q.shape[1] * q.shape[2], dtype=lse.dtype)
    keep.append(delta)
    p.delta = <char*> _address(delta)
    p.key_blocks = (p.f.seq_k + key_tile - 1) // key_tile

    rows = p.f.batch * p.f.heads_q * p.f.seq_q
    key_items = p.f.batch * p.f.heads_kv * p.key_blocks
    query_items = p.f.batch * p.f.heads_kv * p.f.query_blocks
    used = max(1, threads)
    scratch_bytes = (fa_backward_scratch_bytes(&p) + 63) // 64 * 64
    scratch = _slab(scratch_bytes, used, keep)
    cdef int nonfinite = 0
    p.f.nonfinite_output = &nonfinite
    with nogil:
        for index in prange(rows, schedule="static", num_threads=used):
            fa_backward_delta(&p, index)
        _gradient_passes(&p, scratch, scratch_bytes, key_items, query_items, used)
        if nonfinite:  # see note_stored in flash_forward.h: rerun skipping zero-weight products
            p.f.skip_zero_weights = 1
            _gradient_passes(&p, scratch, scratch_bytes, key_items, query_items, used)


cdef void _gradient_passes(BwdParams* p, char* scratch, size_t scratch_bytes, int64_t key_items,
                           int64_t query_items, int threads) noexcept nogil:
    cdef int64_t index
    for index in prange(key_items, schedule="dynamic", num_threads=threads):
        fa_backward_dkdv(p, scratch + omp_get_thread_num() * scratch_bytes, index)
    for index in prange(query_items, schedule="dynamic", num_threads=threads):
        fa_backward_dq(p, scratch + omp_get_thread_num() * scratch_bytes, index)
