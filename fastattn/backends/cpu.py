"""The ``cpu`` backend: Cython + OpenMP flash attention on numpy arrays.

At this stage the compiled extension (``fastattn._cpu._runtime``) holds only what the registry
reports: whether it was built with OpenMP and how many threads it would use.  The flash forward,
decode and backward kernels arrive with the CPU issues (#4 forward and decode, #5 backward); until
then this backend is available but declines every problem with that reason, so automatic selection
runs the reference and ``explain`` says why.
"""

from __future__ import annotations

from typing import Any

from .._cpu import _runtime
from .._problem import AttentionExtras, AttentionProblem
from .registry import UnsupportedError

_NOT_YET = "the CPU flash kernels are not built yet (issue #4 forward, #5 backward)"


def build_summary() -> str:
    """Return e.g. ``"OpenMP 201511, 2 threads"`` or ``"serial build (no OpenMP), 1 thread"``."""
    threads = _runtime.max_threads()
    plural = "thread" if threads == 1 else "threads"
    if _runtime.openmp_enabled():
        return f"OpenMP {_runtime.openmp_version()}, {threads} {plural}"
    return f"serial build (no OpenMP), {threads} {plural}"


class CpuBackend:
    """Cython/OpenMP kernels on numpy arrays (host memory)."""

    name = "cpu"
    devices = ("cpu",)
    priority = 20

    @property
    def description(self) -> str:
        """The build line shown by ``fastattn.backends.available()``."""
        return f"Cython kernels, {build_summary()}"

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        """Every problem is declined until the kernels land."""
        return [_NOT_YET]

    def forward(
        self, problem: AttentionProblem, q: Any, k: Any, v: Any, extras: AttentionExtras
    ) -> tuple[Any, Any]:
        """Not implemented yet: raises :class:`UnsupportedError`."""
        raise UnsupportedError("backend 'cpu' cannot run this call", [_NOT_YET])

    def backward(
        self,
        problem: AttentionProblem,
        dout: Any,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        extras: AttentionExtras,
    ) -> tuple[Any, Any, Any]:
        """Not implemented yet: raises :class:`UnsupportedError`."""
        raise UnsupportedError("backend 'cpu' cannot run this call", [_NOT_YET])
