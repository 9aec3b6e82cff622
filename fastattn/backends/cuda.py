"""The ``cuda`` backend: CuPy RawKernel flash attention, and ``cuda-emulated``, the same on the CPU.

Kernels (``fastattn/_gpu/kernels``): the tensor-core forward (float16/bfloat16, head_dim
32/64/96/128/256, Dv = D, ``flash_forward.cu``) and backward (delta pre-pass, dK/dV per block of keys
over the GQA group, dQ by float32 atomics or, deterministic, a pass over query blocks,
``flash_backward.cu``); decode forwards (Sq <= 16, see ``fastattn._gpu.decode.eligible``) on the
split-KV kernel ``flash_decode.cu``; float32 on the exact SIMT kernels of ``flash_fp32.cu``.  All of
them pass the conformance suite in the SIMT emulator (``EmulatedCudaBackend``, issue #19); only the
tensor-core forward has run on a GPU so far.  What the kernels decline (float64, other head dims,
Dv != D, dropout) runs on the reference backend, and ``explain`` says why.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from .. import _arrays
from .._gpu import _launch as gpu_launch
from .._gpu import backward as gpu_backward
from .._gpu import decode as gpu_decode
from .._gpu import forward as gpu_forward
from .._gpu import fp32 as gpu_fp32
from .._problem import AttentionExtras, AttentionProblem

_NO_DROPOUT = (
    "attention dropout is not in the GPU kernels yet (issue #15); the reference runs it through CuPy "
    "with the same Philox mask"
)
_FLOAT64 = "float64 runs on the reference backend through CuPy"
_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin


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
        """Why this call cannot run on the GPU kernels (empty when it can)."""
        if problem.dtype == "float64":
            return [_FLOAT64]
        if problem.dropout_p > 0:
            return [_NO_DROPOUT]
        if problem.dtype == "float32":
            return gpu_fp32.not_supported_reasons(problem)
        reasons = []
        if problem.head_dim not in gpu_forward.HEAD_DIMS:
            reasons.append(f"takes head_dim in {gpu_forward.HEAD_DIMS}, not {problem.head_dim}")
        if problem.head_dim_v != problem.head_dim:
            reasons.append(f"needs Dv == D, received Dv={problem.head_dim_v}, D={problem.head_dim}")
        row_strides = (*problem.q_strides[:3], *problem.k_strides[:3], *problem.v_strides[:3])
        if any(stride % 8 for stride in row_strides):
            reasons.append("needs row strides that are multiples of 8 elements (16-byte copies)")
        if problem.mask == "float" and problem.mask_dtype not in gpu_forward.MASK_KINDS:
            reasons.append(f"takes float masks in float32/float16/bfloat16, not {problem.mask_dtype}")
        if problem.direction == "backward" and problem.head_dim in gpu_backward.HEAD_DIMS:
            reasons.extend(_backward_shared_memory_reasons(problem))
        return reasons

    def forward(
        self, problem: AttentionProblem, q: Any, k: Any, v: Any, extras: AttentionExtras
    ) -> tuple[Any, Any]:
        """Return ``(out, lse)``: the decode kernel for Sq <= 16, else the float32 or tensor-core kernel."""
        xp = gpu_launch.array_module()
        out = _arrays.empty_bhsd(
            xp, (problem.batch, problem.heads_q, problem.seq_q, problem.head_dim_v), q.dtype, problem.layout
        )
        lse = xp.empty((problem.batch, problem.heads_q, problem.seq_q), dtype=xp.float32)
        if gpu_decode.eligible(problem) and gpu_decode.aligned(k, v):
            gpu_decode.forward(problem, q, k, v, out, lse, extras)
        elif problem.dtype == "float32":
            gpu_fp32.forward(problem, q, k, v, out, lse, extras)
        else:
            # cp.async copies 16-byte chunks: a base address off 16 bytes (a view into a buffer)
            # faults, so such inputs are copied (their strides were checked by not_supported_reasons).
            with gpu_launch.stream(problem.framework):
                q, k, v = (gpu_backward.aligned(array) for array in (q, k, v))
            gpu_forward.forward(problem, q, k, v, out, lse, extras)
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
        """float32: the exact SIMT backward; float16/bfloat16: the tensor-core kernels.

        dk and dv are summed over each kv head's query group; ``problem.deterministic`` makes the
        half-precision dq bit-reproducible (the float32 kernels always are).
        """
        if problem.dtype == "float32":
            return gpu_fp32.backward(problem, dout, q, k, v, out, lse, extras)
        xp = gpu_launch.array_module()
        inputs = {"q": q, "k": k, "v": v, "dout": dout, "out": out}
        b, hq, hkv, sq, sk = problem.batch, problem.heads_q, problem.heads_kv, problem.seq_q, problem.seq_k
        # Copies and outputs are made on the stream the kernels run on, so they are ordered with them.
        with gpu_launch.stream(problem.framework):
            arrays = {name: gpu_backward.aligned(array) for name, array in inputs.items()}
            arrays["lse"] = lse
            grads = (
                _arrays.empty_bhsd(xp, (b, hq, sq, problem.head_dim), q.dtype, problem.layout),
                _arrays.empty_bhsd(xp, (b, hkv, sk, problem.head_dim), k.dtype, problem.layout),
                _arrays.empty_bhsd(xp, (b, hkv, sk, problem.head_dim_v), v.dtype, problem.layout),
            )
            gpu_backward.backward(problem, arrays, grads, extras)
        return grads


def _backward_shared_memory_reasons(problem: AttentionProblem) -> list[str]:
    """The backward's blocks need more shared memory than this GPU grants one block (sm_86/sm_89)."""
    needed = gpu_backward.shared_bytes(problem.head_dim, problem.deterministic)
    if gpu_launch.is_emulated():
        granted = gpu_launch.EMULATED_SHARED_MEMORY_PER_BLOCK
    else:
        granted = _shared_memory_per_block(importlib.import_module("cupy").cuda.runtime.getDevice())
    if needed <= granted:
        return []
    return [
        f"the backward for head_dim {problem.head_dim} needs {needed} bytes of shared memory per block; "
        f"this GPU grants {granted}"
    ]


@functools.cache
def _shared_memory_per_block(device: int) -> int:
    """The most dynamic shared memory one block may opt into on ``device``."""
    cupy = importlib.import_module("cupy")
    return int(cupy.cuda.runtime.deviceGetAttribute(_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device))


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
