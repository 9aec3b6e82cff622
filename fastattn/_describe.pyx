# cython: language_level=3
"""The description of an attention call, built in C: the key ``_validation.prepare`` remembers
validated calls under.

A call's problem (DESIGN.md §3) follows from its arrays' descriptions and its scalar options, so
the key holds exactly those:

* for a ``numpy.ndarray`` (the exact type), its dtype number, byte order and item size, number of
  axes, shape and strides, packed as int64s into one ``bytes`` (hashed and compared in C, hash
  cached by the object); any other native array (CuPy, a numpy subclass) adds its
  ``(type, dtype, shape, strides)`` as Python objects;
* each scalar option as the caller passed it (a float subclass, numpy's float64, as its float),
  but only where its type makes equal values validate the same way.  ``1 == True == 1.0`` in
  Python, so a key that held ``causal=1`` would find the entry of ``causal=True`` and skip the
  error ``causal=1`` must raise.  An option of any other type (a numpy float32 for ``scale``, a
  list for ``window``, ``1`` for ``causal``) gives no key: that call is validated in full, every
  time, and raises where it must.

The options checked on every call anyway (``backend``, ``dropout_seed``, ``dropout_offset``, host
``key_lengths`` values) are not part of the key.
"""

cimport numpy as cnp
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int64_t

cnp.import_array()

cdef int _FIELDS_PER_ARRAY = 4  # dtype number, byte-swapped, item size, number of axes


cdef inline bint _number(object value):
    """A float or an int that is not a bool: equal values normalise to the same float."""
    return type(value) is float or type(value) is int


cdef inline object _keyed_number(object value):
    """``value`` as it enters the key: a float subclass (numpy's float64) as its float."""
    return value if type(value) is float or type(value) is int else float(value)


cdef inline bint _keyed_window(object window):
    if window is None:
        return True
    return (
        type(window) is tuple
        and len(<tuple> window) == 2
        and type((<tuple> window)[0]) is int
        and type((<tuple> window)[1]) is int
    )


cdef bytes _pack_numpy(list arrays):
    """One bytes object describing every numpy array of ``arrays`` (in order)."""
    cdef Py_ssize_t words = 0
    cdef cnp.ndarray array
    cdef int axis, ndim
    for item in arrays:
        words += _FIELDS_PER_ARRAY + 2 * cnp.PyArray_NDIM(<cnp.ndarray> item)
    cdef bytes packed = PyBytes_FromStringAndSize(NULL, words * sizeof(int64_t))
    cdef int64_t* out = <int64_t*> PyBytes_AS_STRING(packed)
    cdef cnp.npy_intp* dims
    cdef cnp.npy_intp* strides
    for item in arrays:
        array = <cnp.ndarray> item
        ndim = cnp.PyArray_NDIM(array)
        dims = cnp.PyArray_DIMS(array)
        strides = cnp.PyArray_STRIDES(array)
        out[0] = cnp.PyArray_TYPE(array)
        out[1] = cnp.PyArray_ISBYTESWAPPED(array)
        out[2] = cnp.PyArray_ITEMSIZE(array)
        out[3] = ndim
        out += _FIELDS_PER_ARRAY
        for axis in range(ndim):
            out[axis] = dims[axis]
            out[ndim + axis] = strides[axis]
        out += 2 * ndim
    return packed


def call_key(str direction, dict natives, object origins, object options, object deterministic):
    """The key of a call's description, or None when an option's type keeps it from having one.

    Parameters
    ----------
    direction : {"forward", "backward"}
    natives : dict of str to array
        The call's native arrays (numpy or CuPy): q, k, v (then dout, out, lse for a backward),
        then the mask and key_lengths where given, in the order the caller's code builds them.
    origins : ArrayOrigin, dict of str to ArrayOrigin, or None
        One origin shared by every native, each native's own, or None when every one is a numpy
        array of the caller's.
    options : AttentionOptions
    deterministic : bool
        The backward's ``deterministic`` argument (False for a forward).

    Returns
    -------
    tuple or None
        Hashable, equal for two calls exactly when their descriptions are equal.
    """
    layout = options.layout
    scale = options.scale
    causal = options.causal
    window = options.window
    softcap = options.softcap
    dropout_p = options.dropout_p
    return_lse = options.return_lse
    if not (
        type(layout) is str
        and (scale is None or _number(scale) or isinstance(scale, float))
        and (causal is None or type(causal) is bool or type(causal) is str)
        and _keyed_window(window)
        and (softcap is None or _number(softcap) or isinstance(softcap, float))
        and (_number(dropout_p) or isinstance(dropout_p, float))
        and type(return_lse) is bool
        and type(deterministic) is bool
    ):
        return None
    cdef list numpy_arrays = []
    cdef list others = []
    cdef Py_ssize_t index = 0
    for native in natives.values():
        if type(native) is cnp.ndarray:
            numpy_arrays.append(native)
        else:
            others.append((index, type(native), native.dtype, native.shape, native.strides))
        index += 1
    return (
        direction,
        tuple(natives),
        layout,
        None if scale is None else _keyed_number(scale),
        causal,
        window,
        None if softcap is None else _keyed_number(softcap),
        _keyed_number(dropout_p),
        return_lse,
        deterministic,
        tuple((<dict> origins).values()) if type(origins) is dict else origins,
        _pack_numpy(numpy_arrays),
        tuple(others) if others else None,
    )
