"""The ``cuda`` backend: CuPy RawKernel flash attention, and ``cuda-emulated``, the same on the CPU.

The kernels are declared in one table (``fastattn/_gpu/ops.py``), which drives dispatch, the
reasons to decline and ``explain``'s kernel names: the tensor-core forward (float16/bfloat16,
head_dim 32/64/96/128/256, Dv = D, ``flash_forward.cu``) and backward (delta pre-pass, dK/dV per
block of keys over the GQA group, dQ by float32 atomics or, deterministic, a pass over query
blocks, ``flash_backward.cu``); decode forwards (Sq <= 16, no dropout, see
``fastattn._gpu.decode.declines``) on the split-KV kernel ``flash_decode.cu``; float32 on the exact
SIMT kernels of ``flash_fp32.cu``.  Attention dropout runs in the tensor-core and float32 kernels,
with the CPU's Philox mask bit for bit.  All of them pass the conformance suite in the SIMT
emulator (``EmulatedCudaBackend``); only the tensor-core forward has run on a GPU so far (before
its dropout and argument-struct form).  What the kernels decline (float64, other head dims, Dv != D)
runs on the reference backend, and ``explain`` says why.
"""

from __future__ import annotations

import importlib
from typing import Any

from .. import _arrays
from .._gpu import _launch as gpu_launch
from .._gpu import ops as gpu_ops
from .._problem import AttentionExtras, AttentionProblem


def unavailable_reason() -> str | None:
    """Return why the cuda backend cannot be used here, or None when it can."""
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
    return None


class CudaBackend:
    """Tensor-core kernels on CuPy arrays (and torch CUDA tensors through DLPack)."""

    name = "cuda"
    devices: tuple[str, ...] = ("cuda",)
    priority = 30
    description = (
        "CuPy/NVRTC kernels: tensor-core (mma.sync) float16/bfloat16 forward and backward, split-KV "
        "decode, exact float32 forward and backward"
    )

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        """Why this call cannot run on the GPU kernels (empty when it can), from the kernel table."""
        return gpu_ops.reasons(problem)

    def kernels(self, problem: AttentionProblem) -> tuple[str, ...]:
        """The kernel instances that run ``problem`` (for ``explain``), given 16-byte aligned arrays."""
        return gpu_ops.kernel_names(problem)

    def forward(
        self, problem: AttentionProblem, q: Any, k: Any, v: Any, extras: AttentionExtras
    ) -> tuple[Any, Any]:
        """Return ``(out, lse)`` from the kernel the table selects."""
        xp = gpu_launch.array_module()
        out = _arrays.empty_bhsd(
            xp, (problem.batch, problem.heads_q, problem.seq_q, problem.head_dim_v), q.dtype, problem.layout
        )
        lse = xp.empty((problem.batch, problem.heads_q, problem.seq_q), dtype=xp.float32)
        gpu_ops.for_arrays(problem, q, k, v).launch(problem, q, k, v, out, lse, extras)
        return out, lse

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
        """Return ``(dq, dk, dv)`` from the kernels the table selects (float32: the exact SIMT
        backward; float16/bfloat16: the tensor-core kernels).

        dk and dv are summed over each kv head's query group; ``problem.deterministic`` makes the
        half-precision dq bit-reproducible (the float32 kernels always are).
        """
        return gpu_ops.for_arrays(problem, q, k, v).launch(problem, dout, q, k, v, out, lse, extras)


class EmulatedCudaBackend(CudaBackend):
    """The cuda backend's own code and kernels, run by the SIMT emulator on host numpy arrays.

    For testing the GPU kernels where there is no GPU (``fastattn/_gpu/emulator``): exact but
    thousands of times slower than a GPU, so never chosen automatically (its priority is below
    the reference's, which runs every host call); ask for it with ``backend="cuda-emulated"``.
    """

    name = "cuda-emulated"
    devices: tuple[str, ...] = ("cpu",)
    priority = -10
    #: Not timed by ``python -m fastattn bench`` (the benchmarks skip backends for testing).
    for_testing = True
    description = "the cuda backend's kernels run by the SIMT emulator on the CPU (for tests; slow)"

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        """The cuda backend's reasons, for the emulated device (an H100's shared memory)."""
        with gpu_launch.emulated():
            return super().not_supported_reasons(problem)

    def kernels(self, problem: AttentionProblem) -> tuple[str, ...]:
        """The cuda backend's kernels for ``problem`` on the emulated device."""
        with gpu_launch.emulated():
            return super().kernels(problem)

    def forward(
        self, problem: AttentionProblem, q: Any, k: Any, v: Any, extras: AttentionExtras
    ) -> tuple[Any, Any]:
        """The cuda backend's forward, on the emulator."""
        with gpu_launch.emulated():
            return super().forward(problem, q, k, v, extras)

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
        """The cuda backend's backward, on the emulator."""
        with gpu_launch.emulated():
            return super().backward(problem, dout, q, k, v, out, lse, extras)


def emulator_unavailable_reason() -> str | None:
    """Why the emulated cuda backend cannot run here (no C++ compiler), or None."""
    from .._gpu import emulator

    try:
        emulator.compiler()
    except emulator.EmulationError as error:
        return str(error)
    return None
