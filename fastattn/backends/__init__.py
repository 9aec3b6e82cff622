"""Backends and their registry.

``available()`` lists every backend with whether it can be used here and why (not);
``register()`` adds a third-party backend; ``use_backend()`` picks one for a block of code.
"""

from __future__ import annotations

from .reference import ReferenceBackend
from .registry import (
    Backend,
    BackendStatus,
    Explanation,
    UnsupportedError,
    available,
    get,
    names,
    register,
    register_unavailable,
    unregister,
    use_backend,
)

register(ReferenceBackend())

try:
    from .cpu import CpuBackend
except ImportError as _error:  # the compiled extension is missing or broken
    register_unavailable("cpu", f"the compiled extension fastattn._cpu failed to import: {_error}")
else:
    register(CpuBackend())

from .cuda import CudaBackend, EmulatedCudaBackend, emulator_unavailable_reason, unavailable_reason  # noqa: E402

_cuda_reason = unavailable_reason()
if _cuda_reason is None:
    register(CudaBackend())
else:
    register_unavailable("cuda", _cuda_reason)

_emulator_reason = emulator_unavailable_reason()
if _emulator_reason is None:
    register(EmulatedCudaBackend())
else:
    register_unavailable("cuda-emulated", _emulator_reason)

__all__ = [
    "Backend",
    "BackendStatus",
    "Explanation",
    "UnsupportedError",
    "available",
    "get",
    "names",
    "register",
    "register_unavailable",
    "unregister",
    "use_backend",
]
