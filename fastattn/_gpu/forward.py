"""Launcher of the tensor-core flash forward (``kernels/flash_forward.cu``).

Each (dtype, head_dim) configuration is compiled once per process by NVRTC through
``cupy.RawModule`` with its template instance named in ``name_expressions``; CuPy keeps the
compiled binary in its on-disk kernel cache, so later processes skip the compilation.  Kernels run
on the caller's current stream: CuPy's, or torch's for torch tensors.
"""

from __future__ import annotations

import functools
import importlib
import math
from pathlib import Path
from typing import Any

import numpy as np

from .._problem import AttentionExtras, AttentionProblem

SOURCE = Path(__file__).with_name("kernels") / "flash_forward.cu"
HEAD_DIMS = (32, 64, 96, 128, 256)
BLOCK_M = 64
WARPS = 4
MASK_KINDS = {"bool": 1, "float32": 2, "float16": 3, "bfloat16": 4}
_ELEMENTS = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


def block_keys(head_dim: int) -> int:
    """Keys per shared-memory tile: 64, or 32 for head_dim 256 (two stages must fit one block)."""
    return 32 if head_dim > 128 else 64


def shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of one block: Q tile plus two K and two V stages, rows padded by 8."""
    row = (head_dim + 8) * 2
    return BLOCK_M * row + 4 * block_keys(head_dim) * row


@functools.cache
def kernel(dtype: str, head_dim: int) -> Any:
    """The compiled kernel for one configuration (compiled on first use, then cached)."""
    cupy = importlib.import_module("cupy")
    name = f"fastattn_gpu::flash_forward<{_ELEMENTS[dtype]}, {head_dim}, {block_keys(head_dim)}>"
    module = cupy.RawModule(code=SOURCE.read_text(), options=("--std=c++17",), name_expressions=(name,))
    function = module.get_function(name)
    function.max_dynamic_shared_size_bytes = shared_bytes(head_dim)
    return function


def _strides(array: Any) -> list[np.int64]:
    return [np.int64(stride // array.itemsize) for stride in array.strides[:3]]


def _stream(framework: str) -> Any:
    """The caller's current stream: torch's for torch tensors, else CuPy's."""
    cupy = importlib.import_module("cupy")
    if framework == "torch":
        import torch

        return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    return cupy.cuda.get_current_stream()


def forward(problem: AttentionProblem, q: Any, k: Any, v: Any, out: Any, lse: Any, extras: AttentionExtras) -> None:
    """Launch the forward on (B, H, S, D)-ordered CuPy arrays, writing ``out`` and ``lse``."""
    left, right = problem.window if problem.window is not None else (-1, -1)
    mask = extras.mask
    null = np.uint64(0)
    if mask is None:
        mask_arguments = [null, np.int32(0)] + [np.int64(0)] * 4
    else:
        mask_strides = [0 if size == 1 else stride // mask.itemsize for size, stride in zip(mask.shape, mask.strides)]
        mask_arguments = [mask, np.int32(MASK_KINDS[mask.dtype.name])] + [np.int64(s) for s in mask_strides]
    arguments = [
        q, k, v, out, lse,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        np.int64(lse.strides[0] // lse.itemsize), np.int64(lse.strides[1] // lse.itemsize),
        np.int32(problem.seq_q), np.int32(problem.seq_k), np.int32(problem.group_size),
        np.float32(problem.scale), np.float32(problem.softcap or 0.0),
        np.int32(problem.causal is not None), np.int32(problem.key_offset),
        np.int32(left), np.int32(right),
        *mask_arguments,
        null if extras.key_lengths is None else extras.key_lengths,
    ]  # fmt: skip
    grid = (math.ceil(problem.seq_q / BLOCK_M), problem.heads_q, problem.batch)
    with _stream(problem.framework):
        kernel(problem.dtype, problem.head_dim)(
            grid, (WARPS * 32,), tuple(arguments), shared_mem=shared_bytes(problem.head_dim)
        )
