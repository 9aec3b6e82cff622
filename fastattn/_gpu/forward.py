"""Launcher of the tensor-core flash forward (``kernels/flash_forward.cu``).

Each (dtype, head_dim, dropout) configuration is compiled once per process by NVRTC through
``cupy.RawModule`` with its template instance named in ``name_expressions``; CuPy keeps the
compiled binary in its on-disk kernel cache, so later processes skip the compilation.  Kernels run
on the caller's current stream: CuPy's, or torch's for torch tensors.
"""

from __future__ import annotations

import math
from typing import Any

from .._problem import AttentionExtras, AttentionProblem
from . import _launch, params
from ._launch import ELEMENTS, compiled, stream

SOURCE = "flash_forward.cu"
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (32, 64, 96, 128, 256)
BLOCK_M = 64
WARPS = 4


def block_keys(head_dim: int) -> int:
    """Keys per shared-memory tile: 64, or 32 for head_dim 256 (two stages must fit one block)."""
    return 32 if head_dim > 128 else 64


def shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of one block: Q tile plus two K and two V stages, rows padded by 8."""
    row = (head_dim + 8) * 2
    return BLOCK_M * row + 4 * block_keys(head_dim) * row


def problem_shared_bytes(problem: AttentionProblem) -> int:
    """:func:`shared_bytes` of ``problem``'s head_dim (the kernel table's form)."""
    return shared_bytes(problem.head_dim)


def declines(problem: AttentionProblem) -> list[str]:
    """Why the tensor-core kernels (this forward and ``backward.py``'s) cannot run ``problem``."""
    reasons = []
    if problem.head_dim not in HEAD_DIMS:
        reasons.append(f"takes head_dim in {HEAD_DIMS}, not {problem.head_dim}")
    if problem.head_dim_v != problem.head_dim:
        reasons.append(f"needs Dv == D, received Dv={problem.head_dim_v}, D={problem.head_dim}")
    row_strides = (*problem.q_strides[:3], *problem.k_strides[:3], *problem.v_strides[:3])
    if any(stride % 8 for stride in row_strides):
        reasons.append("needs row strides that are multiples of 8 elements (16-byte copies)")
    if problem.mask == "float" and problem.mask_dtype not in params.MASK_KINDS:
        reasons.append(f"takes float masks in float32/float16/bfloat16, not {problem.mask_dtype}")
    return reasons


def kernel_name(dtype: str, head_dim: int, softcap: bool, dropout: bool) -> str:
    """The template instance of one configuration (softcap and dropout are compile-time options)."""
    flags = ", ".join("true" if flag else "false" for flag in (softcap, dropout))
    return f"fastattn_gpu::flash_forward<{ELEMENTS[dtype]}, {head_dim}, {block_keys(head_dim)}, {flags}>"


def instances(problem: AttentionProblem) -> tuple[str, ...]:
    """The kernel instance that runs ``problem``."""
    return (kernel_name(problem.dtype, problem.head_dim, problem.softcap is not None, problem.dropout_p > 0),)


def all_instances() -> tuple[str, ...]:
    """Every instance :func:`instances` can name (CI's nvcc compiles each)."""
    return tuple(
        kernel_name(dtype, head_dim, softcap, dropout)
        for dtype in DTYPES
        for head_dim in HEAD_DIMS
        for softcap in (False, True)
        for dropout in (False, True)
    )


def forward(problem: AttentionProblem, q: Any, k: Any, v: Any, out: Any, lse: Any, extras: AttentionExtras) -> None:
    """Launch the forward on (B, H, S, D)-ordered CuPy arrays, writing ``out`` and ``lse``.

    cp.async copies 16-byte chunks: inputs whose base address is off 16 bytes (a view into a
    buffer) are copied first (their row strides were checked by :func:`declines`).
    """
    with stream(problem.framework):
        q, k, v = (_launch.aligned(array) for array in (q, k, v))
    record = params.from_problem(problem, extras)
    for name, array in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        params.set_operand(record, name, array)
    grid = (math.ceil(problem.seq_q / BLOCK_M), problem.heads_q, problem.batch)
    (name,) = instances(problem)
    with stream(problem.framework):
        compiled(SOURCE, name, shared_bytes(problem.head_dim))(
            grid, (WARPS * 32,), params.argument(record), shared_mem=shared_bytes(problem.head_dim)
        )
