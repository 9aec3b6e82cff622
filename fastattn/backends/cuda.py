"""The ``cuda`` backend: CuPy RawKernel flash attention on tensor cores (issue #6).

The forward kernel (float16/bfloat16, head_dim 32/64/96/128/256, Dv = D) is in
``fastattn/_gpu/kernels/flash_forward.cu``.  It compiles in CI but has not yet run on a GPU:
issue #6 owes the H100 runs.  Decode forwards (Sq <= 16, see ``fastattn._gpu.decode.eligible``) go
to the split-KV kernel ``flash_decode.cu``; float32 runs the exact SIMT kernels of
``flash_fp32.cu`` (forward and backward, head_dim and Dv up to 256), both compiled but not yet run
on a GPU (issue #13).  What it declines (float64, other head dims, Dv != D, the half-precision
backward) runs on the reference backend, and ``explain`` says why.
"""

from __future__ import annotations

import importlib
from typing import Any

from .. import _arrays
from .._gpu import decode as gpu_decode
from .._gpu import forward as gpu_forward
from .._gpu import fp32 as gpu_fp32
from .._problem import AttentionExtras, AttentionProblem
from .registry import UnsupportedError

_NO_DROPOUT = (
    "attention dropout is not in the GPU kernels yet (issue #15); the reference runs it through CuPy "
    "with the same Philox mask"
)
_NO_BACKWARD = "the GPU backward is not built yet; the reference runs it"
_FLOAT64 = "float64 runs on the reference backend through CuPy"


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
        "CuPy/NVRTC kernels: tensor-core (mma.sync) float16/bfloat16 forward, split-KV decode, "
        "exact float32 forward and backward"
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
        if problem.direction == "backward":
            reasons.append(_NO_BACKWARD)
        if problem.head_dim not in gpu_forward.HEAD_DIMS:
            reasons.append(f"takes head_dim in {gpu_forward.HEAD_DIMS}, not {problem.head_dim}")
        if problem.head_dim_v != problem.head_dim:
            reasons.append(f"needs Dv == D, received Dv={problem.head_dim_v}, D={problem.head_dim}")
        row_strides = (*problem.q_strides[:3], *problem.k_strides[:3], *problem.v_strides[:3])
        if any(stride % 8 for stride in row_strides):
            reasons.append("needs row strides that are multiples of 8 elements (16-byte copies)")
        if problem.mask == "float" and problem.mask_dtype not in gpu_forward.MASK_KINDS:
            reasons.append(f"takes float masks in float32/float16/bfloat16, not {problem.mask_dtype}")
        return reasons

    def forward(
        self, problem: AttentionProblem, q: Any, k: Any, v: Any, extras: AttentionExtras
    ) -> tuple[Any, Any]:
        """Return ``(out, lse)``: the decode kernel for Sq <= 16, else the float32 or tensor-core kernel."""
        cupy = importlib.import_module("cupy")
        out = _arrays.empty_bhsd(
            cupy, (problem.batch, problem.heads_q, problem.seq_q, problem.head_dim_v), q.dtype, problem.layout
        )
        lse = cupy.empty((problem.batch, problem.heads_q, problem.seq_q), dtype=cupy.float32)
        if gpu_decode.eligible(problem) and gpu_decode.aligned(k, v):
            gpu_decode.forward(problem, q, k, v, out, lse, extras)
        elif problem.dtype == "float32":
            gpu_fp32.forward(problem, q, k, v, out, lse, extras)
        else:
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
        """float32: the exact SIMT backward; float16/bfloat16: not built yet (raises :class:`UnsupportedError`)."""
        if problem.dtype == "float32":
            return gpu_fp32.backward(problem, dout, q, k, v, out, lse, extras)
        raise UnsupportedError("backend 'cuda' cannot run the backward", [_NO_BACKWARD])
