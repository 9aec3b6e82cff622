"""Launcher of the tensor-core flash forward (``kernels/flash_forward.cu``).

Each (dtype, head_dim) configuration is compiled once per process by NVRTC through
``cupy.RawModule`` with its template instance named in ``name_expressions``; CuPy keeps the
compiled binary in its on-disk kernel cache, so later processes skip the compilation.  Kernels run
on the caller's current stream: CuPy's, or torch's for torch tensors.
"""

from __future__ import annotations

import math
from typing import Any

from .._problem import AttentionExtras, AttentionProblem
from ._launch import ELEMENTS, MASK_KINDS, compiled, contract_arguments, stream, strides2, strides3

SOURCE = "flash_forward.cu"
HEAD_DIMS = (32, 64, 96, 128, 256)
BLOCK_M = 64
WARPS = 4
__all__ = ["HEAD_DIMS", "MASK_KINDS", "SOURCE", "block_keys", "forward", "kernel", "shared_bytes"]


def block_keys(head_dim: int) -> int:
    """Keys per shared-memory tile: 64, or 32 for head_dim 256 (two stages must fit one block)."""
    return 32 if head_dim > 128 else 64


def shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of one block: Q tile plus two K and two V stages, rows padded by 8."""
    row = (head_dim + 8) * 2
    return BLOCK_M * row + 4 * block_keys(head_dim) * row


def kernel(dtype: str, head_dim: int) -> Any:
    """The compiled kernel for one configuration (compiled on first use, then cached)."""
    name = f"fastattn_gpu::flash_forward<{ELEMENTS[dtype]}, {head_dim}, {block_keys(head_dim)}>"
    return compiled(SOURCE, name, shared_bytes(head_dim))


def forward(problem: AttentionProblem, q: Any, k: Any, v: Any, out: Any, lse: Any, extras: AttentionExtras) -> None:
    """Launch the forward on (B, H, S, D)-ordered CuPy arrays, writing ``out`` and ``lse``."""
    arguments = [
        q, k, v, out, lse,
        *strides3(q), *strides3(k), *strides3(v), *strides3(out), *strides2(lse),
        *contract_arguments(problem, extras),
    ]  # fmt: skip
    grid = (math.ceil(problem.seq_q / BLOCK_M), problem.heads_q, problem.batch)
    with stream(problem.framework):
        kernel(problem.dtype, problem.head_dim)(
            grid, (WARPS * 32,), tuple(arguments), shared_mem=shared_bytes(problem.head_dim)
        )
