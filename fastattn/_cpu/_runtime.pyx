# cython: language_level=3
"""What the compiled CPU extension was built with, and its OpenMP thread count.

The registry reports these facts (``fastattn.backends.available()``, ``python -m fastattn info``).
setup.py compiles this module with the flash extension's compiler and OpenMP flags
(``_omp_shim.h``), so the compiler and OpenMP it reports are those of the kernels; the kernels'
instruction-set levels and vector widths are ``fastattn._cpu.isa``'s to report.
"""

cdef extern from "_omp_shim.h":
    int FASTATTN_OPENMP
    int FASTATTN_OPENMP_VERSION
    int omp_get_max_threads() nogil
    void omp_set_num_threads(int n) nogil

cdef extern from *:
    """
    #if defined(__clang__)
    static const char *fastattn_compiler = "Clang " __clang_version__;
    #elif defined(__GNUC__)
    static const char *fastattn_compiler = "GCC " __VERSION__;
    #else
    static const char *fastattn_compiler = "an unidentified compiler";
    #endif
    """
    const char *fastattn_compiler


def openmp_enabled():
    """Return True when the extension was compiled with OpenMP."""
    return bool(FASTATTN_OPENMP)


def openmp_version():
    """Return the ``_OPENMP`` date macro the extension was compiled with (0 without OpenMP)."""
    return FASTATTN_OPENMP_VERSION


def compiler():
    """Return the compiler and version that built the kernels, e.g. ``"GCC 12.2.0"``."""
    return fastattn_compiler.decode("utf-8", "replace")


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
