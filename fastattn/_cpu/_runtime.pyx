# cython: language_level=3
"""What the compiled CPU extension was built with, and its OpenMP thread count.

The registry reports these facts (``fastattn.backends.available()``, ``python -m fastattn info``).
setup.py compiles this module with the flash kernels' own flags and headers (``_omp_shim.h``,
``simd.h``), so the compiler, OpenMP and vector width it reports are those of the kernels.
"""

cdef extern from "_omp_shim.h":
    int FASTATTN_OPENMP
    int FASTATTN_OPENMP_VERSION
    int omp_get_max_threads() nogil
    void omp_set_num_threads(int n) nogil

cdef extern from *:
    """
    #include "simd.h"
    #if defined(__clang__)
    static const char *fastattn_compiler = "Clang " __clang_version__;
    #elif defined(__GNUC__)
    static const char *fastattn_compiler = "GCC " __VERSION__;
    #else
    static const char *fastattn_compiler = "an unidentified compiler";
    #endif
    static const int fastattn_vector_bytes = FASTATTN_VECTOR_BYTES;
    """
    const char *fastattn_compiler
    const int fastattn_vector_bytes


def openmp_enabled():
    """Return True when the extension was compiled with OpenMP."""
    return bool(FASTATTN_OPENMP)


def openmp_version():
    """Return the ``_OPENMP`` date macro the extension was compiled with (0 without OpenMP)."""
    return FASTATTN_OPENMP_VERSION


def compiler():
    """Return the compiler and version that built the kernels, e.g. ``"GCC 12.2.0"``."""
    return fastattn_compiler.decode("utf-8", "replace")


def vector_bytes():
    """Return the SIMD vector width the kernels were compiled for, in bytes (32: AVX2, 64: AVX-512)."""
    return fastattn_vector_bytes


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
