# cython: language_level=3
"""A numpy view of a host DLPack tensor, made in C.

``Tensor.numpy()`` costs about 0.65 us a call and numpy's ``from_dlpack`` about 2 us; reading the
capsule of ``torch.utils.dlpack.to_dlpack`` (0.2 us) and making the view here costs well under half
of the first.  The view is read-only (fastattn never writes into an input) and keeps the capsule
as its base: when the view dies, the unconsumed capsule's own destructor calls the producer's
deleter, which releases the tensor.  Anything this module does not view (another device, a dtype
numpy has no exact match for, vector lanes) gives None, and the caller takes the general path.
"""

cimport numpy as cnp
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint64_t

import numpy as np

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    object PyArray_NewFromDescr(
        type subtype, cnp.dtype descr, int nd, cnp.npy_intp* dims, cnp.npy_intp* strides,
        void* data, int flags, object obj,
    )

# The DLPack ABI (dlpack.h, version 0.8 and later, unversioned capsules named "dltensor").
cdef struct DLDevice:
    int32_t device_type
    int32_t device_id

cdef struct DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

cdef struct DLTensor:
    void* data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t* shape
    int64_t* strides
    uint64_t byte_offset

cdef struct DLManagedTensor:
    DLTensor dl_tensor
    void* manager_ctx
    void* deleter

cdef int _DL_CPU = 1
cdef int _DL_INT = 0
cdef int _DL_UINT = 1
cdef int _DL_FLOAT = 2
cdef int _DL_BFLOAT = 4
cdef int _DL_BOOL = 6
cdef int _MAX_AXES = 32

cdef object _FLOAT16 = np.dtype(np.float16)
cdef object _FLOAT32 = np.dtype(np.float32)
cdef object _FLOAT64 = np.dtype(np.float64)
cdef object _BFLOAT16 = None  # ml_dtypes' bfloat16, imported by the first bfloat16 tensor
cdef object _BOOL = np.dtype(np.bool_)
cdef object _INT8 = np.dtype(np.int8)
cdef object _INT16 = np.dtype(np.int16)
cdef object _INT32 = np.dtype(np.int32)
cdef object _INT64 = np.dtype(np.int64)
cdef object _UINT8 = np.dtype(np.uint8)


cdef object _numpy_dtype(DLDataType dtype):
    """The numpy dtype of a DLPack (type code, bits) viewed here, or None."""
    global _BFLOAT16
    if dtype.code == _DL_FLOAT:
        return _FLOAT32 if dtype.bits == 32 else _FLOAT16 if dtype.bits == 16 else _FLOAT64 if dtype.bits == 64 else None
    if dtype.code == _DL_BFLOAT:
        if dtype.bits != 16:
            return None
        if _BFLOAT16 is None:
            from fastattn._arrays import bfloat16_dtype

            _BFLOAT16 = bfloat16_dtype()
        return _BFLOAT16
    if dtype.code == _DL_BOOL:
        return _BOOL if dtype.bits == 8 else None
    if dtype.code == _DL_INT:
        if dtype.bits == 64:
            return _INT64
        return _INT32 if dtype.bits == 32 else _INT16 if dtype.bits == 16 else _INT8 if dtype.bits == 8 else None
    if dtype.code == _DL_UINT:
        return _UINT8 if dtype.bits == 8 else None
    return None


def host_view(object capsule):
    """A read-only numpy view of an unconsumed host DLPack capsule, or None.

    Parameters
    ----------
    capsule : PyCapsule named "dltensor"
        As returned by a producer's legacy export (``torch.utils.dlpack.to_dlpack``); not consumed
        by anyone else.

    Returns
    -------
    numpy.ndarray or None
        The same memory, shape and strides, with the capsule as its base; None for a capsule of
        another name, a tensor off the host, vector lanes, more than 32 axes or a dtype other
        than float16/32/64, bfloat16, bool, int8/16/32/64 and uint8.
    """
    if not PyCapsule_IsValid(capsule, "dltensor"):
        return None
    cdef DLTensor* tensor = &(<DLManagedTensor*> PyCapsule_GetPointer(capsule, "dltensor")).dl_tensor
    if tensor.device.device_type != _DL_CPU or tensor.dtype.lanes != 1 or tensor.ndim > _MAX_AXES:
        return None
    descr = _numpy_dtype(tensor.dtype)
    if descr is None:
        return None
    cdef int ndim = tensor.ndim
    cdef int64_t itemsize = tensor.dtype.bits // 8
    cdef cnp.npy_intp dims[32]
    cdef cnp.npy_intp strides[32]
    cdef int axis
    cdef int64_t step = itemsize
    for axis in range(ndim - 1, -1, -1):
        dims[axis] = tensor.shape[axis]
        if tensor.strides == NULL:  # compact row-major
            strides[axis] = step
            step *= tensor.shape[axis]
        else:
            strides[axis] = tensor.strides[axis] * itemsize
    Py_INCREF(descr)  # PyArray_NewFromDescr steals a reference to the dtype
    view = PyArray_NewFromDescr(
        cnp.ndarray, <cnp.dtype> descr, ndim, dims, strides, <char*> tensor.data + tensor.byte_offset, 0, None
    )
    cnp.set_array_base(view, capsule)
    return view


cdef object _tensor_view(object tensor, object tensor_type, object to_dlpack):
    if type(tensor) is not tensor_type or tensor.is_neg():
        return None
    try:
        capsule = to_dlpack(tensor)
    except (BufferError, RuntimeError, TypeError, ValueError):  # not exportable (sparse, meta, ...):
        # the general path names the problem
        return None
    return host_view(capsule)  # None off the host: the capsule says where the memory is


def tensor_view(object tensor, object tensor_type, object to_dlpack):
    """A read-only numpy view of a torch CPU tensor, or None.

    Parameters
    ----------
    tensor : torch.Tensor
    tensor_type : type
        ``torch.Tensor``: only a tensor of exactly this type is viewed here.
    to_dlpack : callable
        ``torch.utils.dlpack.to_dlpack``.

    Returns
    -------
    numpy.ndarray or None
        None unless ``tensor`` is a ``tensor_type`` on the CPU, without a negative bit (DLPack
        would export its memory un-negated), that DLPack exports (not a sparse one), of a dtype
        viewed here.
    """
    return _tensor_view(tensor, tensor_type, to_dlpack)


def tensor_views(dict arrays, object tensor_type, object to_dlpack):
    """:func:`tensor_view` of every tensor of a call, or None if one of them has none.

    Parameters
    ----------
    arrays : dict of str to torch.Tensor
        The call's arrays, by name.
    tensor_type, to_dlpack
        As for :func:`tensor_view`.

    Returns
    -------
    dict of str to numpy.ndarray, or None
    """
    cdef dict views = {}
    for name, tensor in arrays.items():
        view = _tensor_view(tensor, tensor_type, to_dlpack)
        if view is None:
            return None
        views[name] = view
    return views
