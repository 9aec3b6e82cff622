"""Launcher of the tensor-core flash backward (``kernels/flash_backward.cu``).

One call runs three kernels on the caller's current stream (CuPy's, or torch's for torch tensors):
``flash_backward_prepare`` (delta = rowsum(dO * O), lse in log2 units, the float32 dQ accumulator
cleared), ``flash_backward_kv`` (dK, dV per block of keys over the GQA group, and dQ through float32
atomics), then ``flash_backward_dq_convert`` (dQ into the input dtype).  With ``deterministic=True``
the kv kernel skips the atomics and ``flash_backward_dq`` computes dQ in a pass over query blocks,
so every gradient is summed in a fixed order.  Each (dtype, head_dim, deterministic) configuration
is compiled once per process, like the forward's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._problem import AttentionExtras, AttentionProblem
from . import _launch, forward
from ._launch import ELEMENTS, compiled, contract_arguments, stream, strides3

SOURCE = "flash_backward.cu"
HEAD_DIMS = forward.HEAD_DIMS
KV_WARPS = 8
DQ_WARPS = 4
DQ_BLOCK_M = 16 * DQ_WARPS
PREPARE_THREADS = 256
CONVERT_THREADS = 256


def backward_tiles(head_dim: int) -> tuple[int, int]:
    """``(BLOCK_M, KEY_WARPS)`` of ``flash_backward_kv``: query rows per tile, warps along the keys.

    A block holds ``16 * KEY_WARPS`` keys; its 8 warps split into KEY_WARPS along the keys times
    ``8 / KEY_WARPS`` along the head dimension, so that no warp keeps more than 16 keys x 64 columns
    of dK and dV in registers.
    """
    if head_dim <= 64:
        return 64, 8
    if head_dim <= 128:
        return 64, 4
    return 32, 2


def block_keys(head_dim: int) -> int:
    """Keys per block of ``flash_backward_kv`` (128, 64, or 32 for head_dim 256)."""
    return 16 * backward_tiles(head_dim)[1]


def dq_block_keys(head_dim: int) -> int:
    """Keys per tile of the deterministic ``flash_backward_dq``: 64, or 16 for head_dim 256.

    Each thread holds 16 rows x head_dim / 32 float32 of dQ; at head_dim 256 that is 128 registers,
    and 32-key tiles spilled on sm_90.
    """
    return 16 if head_dim > 128 else 64


def kv_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of ``flash_backward_kv``: K, V; two Q and two dO stages; P^T, dS^T; lse, delta."""
    block_m, _ = backward_tiles(head_dim)
    keys = block_keys(head_dim)
    row, prob_row = (head_dim + 8) * 2, (block_m + 8) * 2
    return 2 * keys * row + 4 * block_m * row + 2 * keys * prob_row + 4 * block_m * 4


def dq_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of ``flash_backward_dq``: Q and dO tiles, two K and two V stages."""
    row = (head_dim + 8) * 2
    return 2 * DQ_BLOCK_M * row + 4 * dq_block_keys(head_dim) * row


def shared_bytes(head_dim: int, deterministic: bool) -> int:
    """The most dynamic shared memory one block of a backward call asks for."""
    return max(kv_shared_bytes(head_dim), dq_shared_bytes(head_dim) if deterministic else 0)


def kernel_names(dtype: str, head_dim: int, deterministic: bool) -> tuple[str, str, str]:
    """Template instances of one configuration: prepare, kv, and the dQ kernel (pass or convert)."""
    element = ELEMENTS[dtype]
    block_m, key_warps = backward_tiles(head_dim)
    atomic = "false" if deterministic else "true"
    last = (
        f"fastattn_gpu::flash_backward_dq<{element}, {head_dim}, {dq_block_keys(head_dim)}>"
        if deterministic
        else f"fastattn_gpu::flash_backward_dq_convert<{element}>"
    )
    return (
        f"fastattn_gpu::flash_backward_prepare<{element}, {head_dim}>",
        f"fastattn_gpu::flash_backward_kv<{element}, {head_dim}, {block_m}, {key_warps}, {atomic}>",
        last,
    )


@dataclass(frozen=True)
class Kernels:
    """The compiled kernels of one configuration (``dq`` converts, or computes when deterministic)."""

    prepare: Any
    kv: Any
    dq: Any


def kernels(dtype: str, head_dim: int, deterministic: bool) -> Kernels:
    """The compiled kernels for one configuration (each compiled on first use, then cached)."""
    names = kernel_names(dtype, head_dim, deterministic)
    sizes = (0, kv_shared_bytes(head_dim), dq_shared_bytes(head_dim) if deterministic else 0)
    return Kernels(*(compiled(SOURCE, name, size) for name, size in zip(names, sizes)))


def aligned(array: Any) -> Any:
    """``array``, or a contiguous copy when its data or row strides are not 16-byte aligned.

    The kernels copy rows in 16-byte chunks (cp.async and vector loads).
    """
    xp = _launch.array_module()
    offsets = [
        _launch.address(array),
        *(stride for size, stride in zip(array.shape[:3], array.strides[:3]) if size > 1),
    ]
    if all(offset % 16 == 0 for offset in offsets):
        return array
    # A new buffer (the allocator aligns it): ascontiguousarray would hand back a contiguous view
    # whose only fault is its base address unchanged.
    return xp.array(array, order="C", copy=True)


def backward(
    problem: AttentionProblem,
    arrays: dict[str, Any],
    grads: tuple[Any, Any, Any],
    extras: AttentionExtras,
) -> None:
    """Launch the backward, writing ``grads``.

    Parameters
    ----------
    problem : AttentionProblem
        The validated call; ``problem.deterministic`` selects the dQ pass over the atomics.
    arrays : dict
        ``q, k, v, dout, out`` as (B, H, S, D)-ordered CuPy arrays of the input dtype with 16-byte
        aligned rows (see :func:`aligned`), and ``lse`` (B, Hq, Sq) float32.
    grads : tuple of arrays
        ``dq (B, Hq, Sq, D), dk (B, Hkv, Sk, D), dv (B, Hkv, Sk, D)`` to write, input dtype, last
        axis contiguous.
    extras : AttentionExtras
        Mask and key_lengths as given to the forward.
    """
    xp = _launch.array_module()
    q, k, v, dout, out, lse = (arrays[name] for name in ("q", "k", "v", "dout", "out", "lse"))
    dq, dk, dv = grads
    head_dim, deterministic = problem.head_dim, problem.deterministic
    launch = kernels(problem.dtype, head_dim, deterministic)
    rows = problem.batch * problem.heads_q * problem.seq_q
    contract = contract_arguments(problem, extras)
    null = np.uint64(0)
    with stream(problem.framework):
        # Scratch allocated on the launch stream, so that CuPy's pool cannot hand it to another
        # stream while these kernels still use it.
        lse2 = xp.empty(rows, dtype=xp.float32)
        delta = xp.empty(rows, dtype=xp.float32)
        dq_accum = None if deterministic else xp.empty(rows * head_dim, dtype=xp.float32)
        lanes = 1 << max(2, math.ceil(math.log2(head_dim // 8)))  # threads per row, a power of 2
        launch.prepare(
            (math.ceil(rows / (PREPARE_THREADS // lanes)),),
            (PREPARE_THREADS,),
            (
                dout, out, lse, lse2, delta, null if dq_accum is None else dq_accum,
                *strides3(dout), *strides3(out),
                *(np.int64(stride // lse.itemsize) for stride in lse.strides),
                np.int32(problem.heads_q), np.int32(problem.seq_q), np.int64(rows),
            ),
        )  # fmt: skip
        launch.kv(
            (math.ceil(problem.seq_k / block_keys(head_dim)), problem.heads_kv, problem.batch),
            (KV_WARPS * 32,),
            (
                q, k, v, dout, lse2, delta, null if dq_accum is None else dq_accum, dk, dv,
                *strides3(q), *strides3(k), *strides3(v), *strides3(dout),
                *strides3(dk), *strides3(dv),
                *contract,
            ),
            shared_mem=kv_shared_bytes(head_dim),
        )  # fmt: skip
        if deterministic:
            launch.dq(
                (math.ceil(problem.seq_q / DQ_BLOCK_M), problem.heads_q, problem.batch),
                (DQ_WARPS * 32,),
                (
                    q, k, v, dout, lse2, delta, dq,
                    *strides3(q), *strides3(k), *strides3(v), *strides3(dout), *strides3(dq),
                    *contract,
                ),
                shared_mem=dq_shared_bytes(head_dim),
            )  # fmt: skip
        else:
            chunks = rows * head_dim // 8
            launch.dq(
                (math.ceil(chunks / CONVERT_THREADS),),
                (CONVERT_THREADS,),
                (
                    dq_accum, dq, *strides3(dq),
                    np.int32(problem.heads_q), np.int32(problem.seq_q), np.int32(head_dim), np.int64(chunks),
                ),
            )  # fmt: skip
