# cython: language_level=3
"""What the compiled CPU extension was built with, and its OpenMP thread count.

The registry reports these facts (``fastattn.backends.available()``, ``python -m fastattn info``);
the flash kernels that will live beside this module use the same shim header, so a build without
OpenMP is serial everywhere rather than broken.
"""

cdef extern from "_omp_shim.h":
    int FASTATTN_OPENMP
    int FASTATTN_OPENMP_VERSION
    int omp_get_max_threads() nogil
    void omp_set_num_threads(int n) nogil


def openmp_enabled():
    """Return True when the extension was compiled with OpenMP."""
    return bool(FASTATTN_OPENMP)


def openmp_version():
    """Return the ``_OPENMP`` date macro the extension was compiled with (0 without OpenMP)."""
    return FASTATTN_OPENMP_VERSION


def max_threads():
    """Return the number of threads the next parallel region would use (1 without OpenMP)."""
    return omp_get_max_threads()


def set_max_threads(int n):
    """Set the OpenMP thread count for the kernels of this extension.

    Parameters
    ----------
    n : int
        Number of threads, at least 1.
    """
    if n < 1:
        raise ValueError(f"n: expected a thread count >= 1, received {n}")
    omp_set_num_threads(n)
