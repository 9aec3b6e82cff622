# cython: language_level=3
# distutils: language = c++
"""Cython entry points of the CPU flash kernels.

A plan (:class:`ForwardPlan`, :class:`BackwardPlan`) fills the kernels' parameter struct once from an
:class:`~fastattn._problem.AttentionProblem` and its tiles: sizes, options, codes.  The backend keeps
one plan per problem, so a repeated call only copies that struct, sets the arrays' addresses and
strides (numpy's C API: no Python objects are made), and runs the work items in OpenMP ``prange``
loops with the GIL released, on scratch the calling thread keeps (``thread_scratch.h``).  The arithmetic lives in
``flash_forward.h`` (forward; the decode in ``flash_decode.h``, items and the split-KV merge in
``forward_items.h``) and ``flash_backward.h``, compiled once per
instruction-set level (``kernels_forward.cpp``, ``kernels_forward_half.cpp``, ``kernels_backward.cpp``); a plan runs the table (``kernel_table.h``) of the level that
was active when it was built (:func:`use_isa`; ``fastattn._cpu.isa`` chooses at import).
"""

cimport numpy as cnp
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memset
from cython.parallel cimport prange

import numpy as np

from .. import _arrays
from .._codes import DTYPE_CODES, MASK_CODES

cnp.import_array()

cdef extern from "_omp_shim.h" nogil:
    int omp_get_thread_num()

cdef extern from "thread_scratch.h" namespace "fastattn" nogil:
    cdef enum ScratchSlot:
        SCRATCH_TILES
        SCRATCH_ROWS
        SCRATCH_PARTIALS
        SCRATCH_VALUES

    char* thread_scratch(int slot, size_t size)

cdef extern from "params.h" namespace "fastattn" nogil:
    cdef enum DtypeCode:
        DTYPE_FLOAT64

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
        int64_t head_group
        char* partial_out
        char* partial_lse
        char* packed_kv
        int skip_zero_weights
        int* nonfinite_output
        double dropout_p
        unsigned int dropout_key[2]
        unsigned int dropout_offset
        unsigned long long dropout_threshold

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
        int64_t chunks
        int64_t chunk_blocks
        char* dq_partial

    int64_t forward_items(const FwdParams& p)
    int64_t forward_partial_rows(const FwdParams& p)
    int64_t backward_partial_elements(const BwdParams& p, int64_t lanes)

cdef extern from "kernel_table.h" namespace "fastattn" nogil:
    ctypedef void (*ItemFunction)(const void* params, char* scratch, int64_t item) noexcept nogil

    cdef struct KernelTable:
        const char* name
        int vector_bytes
        size_t (*forward_scratch_bytes)(const FwdParams* params) noexcept nogil
        ItemFunction forward_item
        ItemFunction forward_combine
        size_t (*forward_packed_bytes)(const FwdParams* params) noexcept nogil
        ItemFunction forward_pack
        size_t (*backward_scratch_bytes)(const BwdParams* params) noexcept nogil
        ItemFunction backward_delta
        ItemFunction backward_gradients
        ItemFunction backward_dq
        const char* (*forward_kernel)(const FwdParams* params, int64_t rows) noexcept nogil
        const char* (*backward_kernel)(const BwdParams* params) noexcept nogil

cdef extern from "result_blocks.h" namespace "fastattn" nogil:
    size_t kCachedMinBytes
    void* take_result_block(size_t bytes, size_t* size)
    void give_result_block(void* block, size_t size)

cdef extern from "dispatch.h" namespace "fastattn" nogil:
    cdef struct IsaLevel:
        const KernelTable* table
        bint runs

    int build_levels(IsaLevel* levels)


cdef IsaLevel _levels[8]
cdef int _level_count = build_levels(_levels)
#: The level new plans run (use_isa); the highest the CPU runs until fastattn._cpu.isa chooses.
cdef const KernelTable* _active = NULL
for _index in range(_level_count):
    if _levels[_index].runs:
        _active = _levels[_index].table


def isa_levels():
    """Return the kernels' instruction-set levels in this build, lowest first.

    Returns
    -------
    list of (str, int, bool)
        ``(name, vector_bytes, runs)``: the level's name (``"generic"``, ``"avx2"``, ``"avx512"``,
        ``"avx512bf16"``, ``"amx"``, or ``"native"`` for a ``FASTATTN_NATIVE=1`` build), the width of its vectors in bytes, and
        whether this CPU can run it.
    """
    return [
        (_levels[i].table.name.decode("ascii"), _levels[i].table.vector_bytes, bool(_levels[i].runs))
        for i in range(_level_count)
    ]


def use_isa(str name):
    """Make plans built from now on run the kernels of level ``name``.

    Raises
    ------
    ValueError
        When the build has no such level or this CPU cannot run it.
    """
    global _active
    cdef int i
    for i in range(_level_count):
        if _levels[i].table.name.decode("ascii") == name:
            if not _levels[i].runs:
                raise ValueError(f"instruction-set level {name!r}: this CPU cannot run it")
            _active = _levels[i].table
            return
    built = ", ".join(level[0] for level in isa_levels())
    raise ValueError(f"instruction-set level: expected one of this build's ({built}), received {name!r}")


def active_isa():
    """Return the name of the level new plans run."""
    return _active.name.decode("ascii")


def forward_kernel(problem, int64_t block_queries, int64_t key_tile):
    """Which kernel of the active level runs ``problem``'s forward items of ``block_queries``
    positions and ``key_tile`` keys (the kernels' own rule, ``forward_kernel_of``): ``"vector"``,
    ``"vector-decode"``, ``"dpbf16"``, ``"dpbf16-decode"``, ``"amx"`` or ``"amx-decode"``."""
    cdef FwdParams p
    _fill_from_problem(&p, problem, block_queries, key_tile)
    return _active.forward_kernel(&p, p.group * min(block_queries, p.seq_q)).decode("ascii")


def backward_kernel(problem, int64_t block_queries, int64_t key_tile):
    """Which kernel of the active level runs ``problem``'s backward gradient pass, with query blocks
    of ``block_queries`` positions and ``key_tile`` keys (the kernels' own rule): ``"vector"``,
    ``"dpbf16"`` or ``"amx"``."""
    cdef BwdParams p
    memset(&p, 0, sizeof(BwdParams))
    _fill_from_problem(&p.f, problem, block_queries, key_tile)
    return _active.backward_kernel(&p).decode("ascii")


cdef inline char* _data(array):
    return <char*> cnp.PyArray_DATA(<cnp.ndarray> array)


cdef void _strides(int64_t* dst, array, int count):
    """The first ``count`` strides of a numpy array, in elements."""
    cdef cnp.ndarray a = <cnp.ndarray> array
    cdef int64_t itemsize = cnp.PyArray_ITEMSIZE(a)
    cdef cnp.npy_intp* strides = cnp.PyArray_STRIDES(a)
    cdef int axis
    for axis in range(count):
        dst[axis] = strides[axis] // itemsize


cdef void _bind(const char** address, int64_t* strides, array, int count):
    """Point a parameter at an array: its address and its first ``count`` strides."""
    address[0] = _data(array)
    _strides(strides, array, count)


cdef void _fill_from_problem(FwdParams* p, problem, int64_t block_queries, int64_t key_tile) except *:
    """Every field that follows from the problem and the tiles; the addresses are left null."""
    memset(p, 0, sizeof(FwdParams))
    p.batch = problem.batch
    p.heads_q = problem.heads_q
    p.heads_kv = problem.heads_kv
    p.seq_q = problem.seq_q
    p.seq_k = problem.seq_k
    p.head_dim = problem.head_dim
    p.head_dim_v = problem.head_dim_v
    p.group = problem.group_size
    p.dtype = DTYPE_CODES[problem.dtype]
    p.scale = problem.scale
    p.softcap = problem.softcap or 0.0
    p.causal = problem.causal is not None
    p.offset = problem.key_offset
    if problem.window is None:
        p.window_left = p.window_right = -1
    else:
        p.window_left, p.window_right = problem.window
    p.mask_kind = MASK_CODES[problem.mask_dtype]
    p.block_queries = block_queries
    p.query_blocks = (p.seq_q + block_queries - 1) // block_queries
    p.key_tile = key_tile
    p.splits = 1
    p.head_group = 1
    p.dropout_p = problem.dropout_p
    p.dropout_threshold = <unsigned long long> (problem.dropout_p * 4294967296.0)


cdef void _set_call_inputs(FwdParams* p, q, k, v, lse, extras) except *:
    """The per-call fields: input addresses and strides, the mask, key_lengths, the Philox key."""
    cdef int axis
    cdef uint64_t seed
    mask, key_lengths, dropout = extras
    _bind(&p.q, p.q_stride, q, 3)
    _bind(&p.k, p.k_stride, k, 3)
    _bind(&p.v, p.v_stride, v, 3)
    _bind(<const char**> &p.lse, p.lse_stride, lse, 3)
    if mask is not None:
        p.mask = _data(mask)
        _strides(p.mask_stride, mask, 4)
        for axis in range(4):
            if cnp.PyArray_DIMS(<cnp.ndarray> mask)[axis] == 1:
                p.mask_stride[axis] = 0
    if key_lengths is not None:
        p.key_lengths = <const int64_t*> _data(key_lengths)
    if dropout is not None:
        seed = dropout.seed
        p.dropout_key[0] = <unsigned int> (seed & 0xFFFFFFFF)
        p.dropout_key[1] = <unsigned int> (seed >> 32)
        p.dropout_offset = <uint32_t> dropout.offset


#: Whether _empty fills its results with NaN (poison_results: the tests' setting).
cdef bint _poisoned = False
#: bfloat16's quiet NaN, as the uint16 bits _empty allocates bfloat16 results as.
cdef int _BFLOAT16_NAN_BITS = 0x7FC0


def poison_results(bint enabled):
    """Fill every result the kernels return (outputs, lse, gradients) with NaN before the kernels
    write it, so that an element they never write fails every comparison instead of passing with
    whatever the memory held (zeros from the OS, or an earlier result).  For tests: the conformance
    suite's poisoned allocator (``_arrays.empty_bhsd``) does not see the ``cpu`` backend's results,
    which this module allocates itself.  Returns the previous setting."""
    global _poisoned
    previous = _poisoned
    _poisoned = enabled
    return previous


cdef class _ResultMemory:
    """The memory under a result of at least ``kCachedMinBytes`` (the array's ``base``): it goes
    back to the block cache of ``result_blocks.h`` when the last array over it goes, and the next
    call's result of about its size takes it, where fresh memory would cost page faults."""
    cdef void* block
    cdef size_t size

    def __dealloc__(self):
        if self.block != NULL:
            give_result_block(self.block, self.size)


cdef _empty(tuple shape, object dtype, int typenum, bint swap):
    """An uninitialised result of ``shape`` (allocation order), viewed (B, H, S, D) when ``swap``
    (NaN throughout under ``poison_results``); from the block cache where it is large enough.

    ``typenum`` is numpy's number for the dtype, or -1 for bfloat16, which has none: its bits are
    allocated as uint16 and viewed.
    """
    cdef cnp.npy_intp dims[4]
    cdef int axis, ndim = len(shape)
    cdef size_t bytes = dtype.itemsize
    cdef _ResultMemory memory
    for axis in range(ndim):
        dims[axis] = shape[axis]
        bytes *= <size_t> dims[axis]
    cdef int allocated = cnp.NPY_UINT16 if typenum < 0 else typenum
    if bytes < kCachedMinBytes:
        result = cnp.PyArray_EMPTY(ndim, dims, allocated, 0)
    else:
        memory = _ResultMemory.__new__(_ResultMemory)
        memory.block = take_result_block(bytes, &memory.size)
        if memory.block == NULL:
            raise MemoryError(f"fastattn: could not allocate a result of {bytes} bytes")
        result = cnp.PyArray_SimpleNewFromData(ndim, dims, allocated, memory.block)
        cnp.set_array_base(result, memory)
    if _poisoned:
        result.fill(_BFLOAT16_NAN_BITS if typenum < 0 else np.nan)
    if typenum < 0:
        result = result.view(dtype)
    return result.swapaxes(1, 2) if swap else result


cdef int _typenum(dtype):
    return -1 if _arrays.is_bfloat16(dtype) else dtype.num


cdef char* _scratch(int slot, size_t size) except NULL:
    cdef char* block = thread_scratch(slot, size)
    if block == NULL:
        raise MemoryError(f"fastattn: could not allocate {size} bytes of kernel scratch")
    return block


cdef void _for_items(ItemFunction run, const void* params, char* scratch, size_t scratch_bytes, int64_t items,
                     int threads, bint dynamic) noexcept nogil:
    """``run(params, this thread's scratch, item)`` for every item, on ``threads`` OpenMP threads.

    One thread runs the loop without a parallel region: starting one costs more than a small call's
    whole kernel (libgomp wakes its pooled threads).
    """
    cdef int64_t index
    if threads == 1:
        for index in range(items):
            run(params, scratch, index)
    elif dynamic:
        for index in prange(items, schedule="dynamic", num_threads=threads):
            run(params, scratch + omp_get_thread_num() * scratch_bytes, index)
    else:
        for index in prange(items, schedule="static", num_threads=threads):
            run(params, scratch + omp_get_thread_num() * scratch_bytes, index)


cdef class ForwardPlan:
    """The forward kernel's parameters for one problem: fill once, run many times.

    Parameters
    ----------
    problem : AttentionProblem
        A validated forward problem on host arrays.
    block_queries, key_tile, splits : int
        Query positions per work item, keys per tile, key splits per item (decode).
    threads : int
        OpenMP threads for the parallel regions (capped at the number of work items).
    head_group : int
        Kv heads per decode item (1, or all of them for token-major K/V: see forward_items.h).
    """

    cdef FwdParams template
    cdef const KernelTable* kernels
    cdef int64_t items
    cdef int thread_count
    cdef size_t scratch_bytes
    cdef size_t partial_elements
    cdef size_t packed_bytes
    cdef int64_t packed_tiles
    cdef tuple out_shape, lse_shape
    cdef object dtype, lse_dtype
    cdef int typenum, lse_typenum
    cdef bint swap

    def __init__(self, problem, int64_t block_queries, int64_t key_tile, int64_t splits, int threads,
                 int64_t head_group=1):
        _fill_from_problem(&self.template, problem, block_queries, key_tile)
        self.template.splits = splits
        self.template.head_group = head_group
        self.kernels = _active
        self.items = forward_items(self.template)
        self.thread_count = max(1, min(threads, self.items))
        self.scratch_bytes = (self.kernels.forward_scratch_bytes(&self.template) + 63) // 64 * 64
        self.partial_elements = forward_partial_rows(self.template) if splits > 1 else 0
        self.packed_bytes = self.kernels.forward_packed_bytes(&self.template)
        self.packed_tiles = self.template.batch * self.template.heads_kv * (
            (self.template.seq_k + key_tile - 1) // key_tile)
        self.swap = problem.layout == "bshd"
        shape = (problem.batch, problem.heads_q, problem.seq_q, problem.head_dim_v)
        self.out_shape = (shape[0], shape[2], shape[1], shape[3]) if self.swap else shape
        self.lse_shape = shape[:3]
        self.dtype = _arrays.numpy_dtype(problem.dtype)
        self.lse_dtype = _arrays.accumulation_dtype(problem.dtype)
        self.typenum = _typenum(self.dtype)
        self.lse_typenum = _typenum(self.lse_dtype)

    @property
    def threads(self):
        """The OpenMP threads a run uses."""
        return self.thread_count

    @property
    def isa(self):
        """The instruction-set level whose kernels a run calls."""
        return self.kernels.name.decode("ascii")

    @property
    def packs_kv(self):
        """Whether a run prepares K/V once for all query blocks before its items: V^T for bfloat16 on
        AMX tiles, K and V^T as bfloat16 parts for float16 on AMX tiles, float32 copies of
        float16/bfloat16 K and V for the vector kernels at the other levels."""
        return self.packed_bytes > 0

    def run(self, q, k, v, extras):
        """Run the flash forward.

        Parameters
        ----------
        q, k, v : numpy.ndarray
            (B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv) of the problem's dtype, any strides with
            a contiguous last axis.
        extras : AttentionExtras
            ``mask``: four-axis (B|1, Hq|1, Sq|1, Sk|1) bool or float array, read by strides, or None;
            ``key_lengths``: C-contiguous int64 (B,) or None; ``dropout``: the call's seed and
            offset (the probability is the problem's) or None.

        Returns
        -------
        out : numpy.ndarray
            (B, Hq, Sq, Dv) of q's dtype, contiguous in the problem's layout.
        lse : numpy.ndarray
            (B, Hq, Sq) float32 (float64 for float64 inputs).
        """
        cdef FwdParams p = self.template
        cdef size_t compute_bytes = 8 if p.dtype == DTYPE_FLOAT64 else 4
        cdef char* scratch = _scratch(SCRATCH_TILES, self.scratch_bytes * self.thread_count)
        cdef int nonfinite = 0
        out = _empty(self.out_shape, self.dtype, self.typenum, self.swap)
        lse = _empty(self.lse_shape, self.lse_dtype, self.lse_typenum, False)
        _set_call_inputs(&p, q, k, v, lse, extras)
        _bind(<const char**> &p.out, p.out_stride, out, 3)
        p.nonfinite_output = &nonfinite
        if p.splits > 1:
            p.partial_out = _scratch(SCRATCH_ROWS, self.partial_elements * (p.head_dim_v + 1) * compute_bytes)
            p.partial_lse = p.partial_out + self.partial_elements * p.head_dim_v * compute_bytes
        if self.packed_bytes:
            p.packed_kv = _scratch(SCRATCH_VALUES, self.packed_bytes)
        with nogil:
            self._pass(&p, scratch)
            if nonfinite:  # see note_stored in forward_tiles.h: rerun skipping zero-weight products
                p.skip_zero_weights = 1
                self._pass(&p, scratch)
        return out, lse

    cdef void _pass(self, FwdParams* p, char* scratch) noexcept nogil:
        if p.packed_kv != NULL and not p.skip_zero_weights:
            _for_items(self.kernels.forward_pack, p, NULL, 0, self.packed_tiles, self.thread_count, False)
        _for_items(self.kernels.forward_item, p, scratch, self.scratch_bytes, self.items, self.thread_count, True)
        if p.splits > 1:
            _for_items(self.kernels.forward_combine, p, NULL, 0, p.batch * p.heads_kv * p.query_blocks, self.thread_count, False)


cdef class BackwardPlan:
    """The backward kernels' parameters for one problem: fill once, run many times.

    Parameters
    ----------
    problem : AttentionProblem
        A validated backward problem on host arrays.
    block_queries, key_tile : int
        Query positions per tile (all heads of a group stacked), keys per block.
    chunks : int
        Chunks of key blocks per kv head (at most the key blocks): the gradient pass's items per kv
        head, each summing its own dQ partial (see ``flash_backward.h``).
    threads : int
        OpenMP threads.
    """

    cdef BwdParams template
    cdef const KernelTable* kernels
    cdef int thread_count
    cdef size_t scratch_bytes
    cdef tuple shapes
    cdef object dtype
    cdef int typenum
    cdef bint swap

    def __init__(self, problem, int64_t block_queries, int64_t key_tile, int64_t chunks, int threads):
        memset(&self.template, 0, sizeof(BwdParams))
        _fill_from_problem(&self.template.f, problem, block_queries, key_tile)
        cdef int64_t key_blocks = (self.template.f.seq_k + key_tile - 1) // key_tile
        if not 1 <= chunks <= max(1, key_blocks):
            raise ValueError(f"chunks: expected 1 to {max(1, key_blocks)} (the key blocks), received {chunks}")
        self.template.key_blocks = key_blocks
        # Without keys one chunk still runs: it zeroes the dQ partial that pass 3 reads.
        self.template.chunk_blocks = max(1, (key_blocks + chunks - 1) // chunks)
        self.template.chunks = max(1, (key_blocks + self.template.chunk_blocks - 1) // self.template.chunk_blocks)
        self.kernels = _active
        self.thread_count = max(1, threads)
        self.scratch_bytes = (self.kernels.backward_scratch_bytes(&self.template) + 63) // 64 * 64
        self.swap = problem.layout == "bshd"
        b, hq, hkv, sq, sk = problem.batch, problem.heads_q, problem.heads_kv, problem.seq_q, problem.seq_k
        shapes = ((b, hq, sq, problem.head_dim), (b, hkv, sk, problem.head_dim), (b, hkv, sk, problem.head_dim_v))
        self.shapes = tuple((x[0], x[2], x[1], x[3]) if self.swap else x for x in shapes)
        self.dtype = _arrays.numpy_dtype(problem.dtype)
        self.typenum = _typenum(self.dtype)

    @property
    def threads(self):
        """The OpenMP threads a run uses."""
        return self.thread_count

    @property
    def isa(self):
        """The instruction-set level whose kernels a run calls."""
        return self.kernels.name.decode("ascii")

    @property
    def kernel(self):
        """Which kernel runs the gradient pass: ``"amx"`` or ``"dpbf16"`` for bfloat16 on those
        levels, else ``"vector"`` (as does a rerun that must skip zero weights)."""
        return self.kernels.backward_kernel(&self.template).decode("ascii")

    def run(self, dout, q, k, v, out, lse, extras):
        """Run the flash backward.

        Parameters
        ----------
        dout, out : numpy.ndarray
            (B, Hq, Sq, Dv) in q's dtype: the output's gradient and the forward's output.
        q, k, v, lse
            The forward's inputs and its saved lse (float32; float64 for float64 inputs).
        extras : AttentionExtras
            As for :meth:`ForwardPlan.run`.

        Returns
        -------
        dq, dk, dv : numpy.ndarray
            Shaped and typed like q, k, v, contiguous in the problem's layout (dk, dv summed over
            each kv head's group).
        """
        cdef BwdParams p = self.template
        cdef int64_t rows = p.f.batch * p.f.heads_q * p.f.seq_q
        cdef size_t compute_bytes = 8 if p.f.dtype == DTYPE_FLOAT64 else 4
        cdef char* scratch = _scratch(SCRATCH_TILES, self.scratch_bytes * self.thread_count)
        cdef int nonfinite = 0
        dq, dk, dv = [_empty(shape, self.dtype, self.typenum, self.swap) for shape in self.shapes]
        _set_call_inputs(&p.f, q, k, v, lse, extras)
        _bind(&p.dout, p.dout_stride, dout, 3)
        _bind(&p.out, p.o_stride, out, 3)
        _bind(<const char**> &p.dq, p.dq_stride, dq, 3)
        _bind(<const char**> &p.dk, p.dk_stride, dk, 3)
        _bind(<const char**> &p.dv, p.dv_stride, dv, 3)
        p.delta = _scratch(SCRATCH_ROWS, rows * compute_bytes)
        p.dq_partial = _scratch(
            SCRATCH_PARTIALS, backward_partial_elements(p, self.kernels.vector_bytes // compute_bytes) * compute_bytes
        )
        p.f.nonfinite_output = &nonfinite
        with nogil:
            _for_items(self.kernels.backward_delta, &p, NULL, 0, rows, self.thread_count, False)
            self._gradient_passes(&p, scratch)
            if nonfinite:  # see note_stored in forward_tiles.h: rerun skipping zero-weight products
                p.f.skip_zero_weights = 1
                self._gradient_passes(&p, scratch)
        return dq, dk, dv

    cdef void _gradient_passes(self, BwdParams* p, char* scratch) noexcept nogil:
        cdef int64_t key_items = p.f.batch * p.f.heads_kv * p.chunks
        cdef int64_t query_items = p.f.batch * p.f.heads_kv * p.f.query_blocks
        _for_items(self.kernels.backward_gradients, p, scratch, self.scratch_bytes, key_items, self.thread_count, True)
        _for_items(self.kernels.backward_dq, p, scratch, self.scratch_bytes, query_items, self.thread_count, True)
