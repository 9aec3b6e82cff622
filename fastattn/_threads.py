"""The thread count of fastattn's CPU kernels.

Defaults to OpenMP's (so ``OMP_NUM_THREADS`` is respected); ``set_num_threads`` changes it for
every Python thread at once.  The count is handed to each parallel region explicitly rather than
through ``omp_set_num_threads``, whose setting would hold only for the thread that made it.  The
kernels call no BLAS, so no BLAS thread pool is ever started inside them.
"""

from __future__ import annotations

import numbers


def _openmp_default() -> int:
    """OpenMP's thread count (``OMP_NUM_THREADS`` or the cores), 1 without the compiled extension."""
    try:
        from ._cpu import _runtime
    except ImportError:  # the compiled extension is missing: the cpu backend is unavailable anyway
        return 1
    return _runtime.max_threads()


_threads: int = _openmp_default()


def set_num_threads(n: int) -> None:
    """Set the number of threads the CPU kernels use.

    Parameters
    ----------
    n : int
        At least 1.  More threads than cores only adds overhead.
    """
    global _threads
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"n: expected an int >= 1, received {n!r}")
    if n < 1:
        raise ValueError(f"n: expected an int >= 1, received {n}")
    _threads = int(n)


def get_num_threads() -> int:
    """Return the number of threads the CPU kernels use (``OMP_NUM_THREADS`` by default)."""
    return _threads
