"""The ``cuda`` backend: CuPy RawKernel flash attention (issue #6).

Until the kernels land this module only finds out why the backend is unavailable on this machine,
so that ``fastattn.backends.available()`` can say so: CuPy missing, no CUDA device, or kernels not
built yet.  On a machine with a device, cupy inputs run on the reference backend meanwhile.
"""

from __future__ import annotations

import importlib


def unavailable_reason() -> str:
    """Return why the cuda backend cannot be used here (it always has a reason at this stage)."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as error:
        return f"CuPy is not installed ({error}); pip install 'fastattn[gpu]'"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CUDA driver missing or broken: CuPy raises its own runtime errors
        return f"no usable CUDA device ({type(error).__name__}: {error})"
    if count == 0:
        return "no CUDA device found"
    return "the GPU kernels are not built yet (issue #6); cupy inputs run on the reference backend"
