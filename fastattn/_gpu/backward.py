"""Launcher of the tensor-core flash backward (``kernels/flash_backward.cu``).

One call runs three kernels on the caller's current stream (CuPy's, or torch's for torch tensors):
``flash_backward_prepare`` (delta = rowsum(dO * O), lse in log2 units, the float32 dQ accumulator
cleared), ``flash_backward_kv`` (dK, dV per block of keys over the GQA group, and dQ through float32
atomics), then ``flash_backward_dq_convert`` (dQ into the input dtype).  With ``deterministic=True``
the kv kernel skips the atomics and ``flash_backward_dq`` computes dQ in a pass over query blocks,
so every gradient is summed in a fixed order.  Each (dtype, head_dim, deterministic, softcap,
dropout) configuration is compiled once per process, like the forward's.  Every launch passes the call's one
``Params`` record (``params.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .. import _arrays
from .._problem import AttentionExtras, AttentionProblem
from . import _launch, forward, params
from ._launch import ELEMENTS, compiled, stream

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
    """Keys per tile of the deterministic ``flash_backward_dq``: 64, 32 for head_dim 96, 16 for 256.

    Each thread holds 16 rows x head_dim / 32 float32 of dQ; at head_dim 256 that is 128 registers,
    and 32-key tiles spilled on sm_90; at head_dim 96 (whose tile loads do not unroll) 64-key tiles
    spilled with softcap and dropout.
    """
    return 16 if head_dim > 128 else 32 if head_dim == 96 else 64


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


def problem_shared_bytes(problem: AttentionProblem) -> int:
    """:func:`shared_bytes` of ``problem`` (the kernel table's form)."""
    return shared_bytes(problem.head_dim, problem.deterministic)


def kernel_names(
    dtype: str, head_dim: int, deterministic: bool, dropout: bool, softcap: bool = False
) -> tuple[str, str, str]:
    """Template instances of one configuration: prepare, kv, and the dQ kernel (pass or convert);
    softcap and dropout are compile-time options, as in the forward."""
    element = ELEMENTS[dtype]
    block_m, key_warps = backward_tiles(head_dim)
    atomic = "false" if deterministic else "true"
    flags = ", ".join("true" if flag else "false" for flag in (softcap, dropout))
    last = (
        f"fastattn_gpu::flash_backward_dq<{element}, {head_dim}, {dq_block_keys(head_dim)}, {flags}>"
        if deterministic
        else f"fastattn_gpu::flash_backward_dq_convert<{element}>"
    )
    return (
        f"fastattn_gpu::flash_backward_prepare<{element}, {head_dim}>",
        f"fastattn_gpu::flash_backward_kv<{element}, {head_dim}, {block_m}, {key_warps}, {atomic}, {flags}>",
        last,
    )


def instances(problem: AttentionProblem) -> tuple[str, ...]:
    """The kernel instances that run ``problem``'s backward, in launch order."""
    return kernel_names(
        problem.dtype, problem.head_dim, problem.deterministic, problem.dropout_p > 0, problem.softcap is not None
    )


def all_instances() -> tuple[str, ...]:
    """Every instance :func:`instances` can name (CI's nvcc compiles each), without repeats."""
    names = (
        kernel_names(dtype, head_dim, deterministic, dropout, softcap)
        for dtype in forward.DTYPES
        for head_dim in HEAD_DIMS
        for deterministic in (False, True)
        for dropout in (False, True)
        for softcap in (False, True)
    )
    return tuple(dict.fromkeys(name for triple in names for name in triple))


def declines(problem: AttentionProblem) -> list[str]:
    """The forward's reasons (same operands and tiles), and a block the device cannot hold."""
    reasons = forward.declines(problem)
    if problem.head_dim not in HEAD_DIMS:
        return reasons
    needed = shared_bytes(problem.head_dim, problem.deterministic)
    granted = _launch.shared_memory_per_block()
    if needed > granted:
        reasons.append(
            f"the backward for head_dim {problem.head_dim} needs {needed} bytes of shared memory per block; "
            f"this GPU grants {granted}"
        )
    return reasons


@dataclass(frozen=True)
class Kernels:
    """The compiled kernels of one configuration (``dq`` converts, or computes when deterministic)."""

    prepare: Any
    kv: Any
    dq: Any


def kernels(problem: AttentionProblem) -> Kernels:
    """The compiled kernels for ``problem`` (each compiled on first use, then cached)."""
    head_dim = problem.head_dim
    sizes = (0, kv_shared_bytes(head_dim), dq_shared_bytes(head_dim) if problem.deterministic else 0)
    return Kernels(*(compiled(SOURCE, name, size) for name, size in zip(instances(problem), sizes)))


def run(
    problem: AttentionProblem, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, extras: AttentionExtras
) -> tuple[Any, Any, Any]:
    """Return ``(dq, dk, dv)`` (input dtype, the problem's layout) for (B, H, S, D)-ordered arrays.

    Inputs whose rows are not 16-byte aligned are copied first; copies and outputs are made on the
    stream the kernels run on, so they are ordered with them.
    """
    xp = _launch.array_module()
    inputs = {"q": q, "k": k, "v": v, "dout": dout, "out": out}
    b, hq, hkv, sq, sk = problem.batch, problem.heads_q, problem.heads_kv, problem.seq_q, problem.seq_k
    with stream(problem.framework):
        arrays = {name: _launch.aligned(array) for name, array in inputs.items()}
        arrays["lse"] = lse
        grads = (
            _arrays.empty_bhsd(xp, (b, hq, sq, problem.head_dim), q.dtype, problem.layout),
            _arrays.empty_bhsd(xp, (b, hkv, sk, problem.head_dim), k.dtype, problem.layout),
            _arrays.empty_bhsd(xp, (b, hkv, sk, problem.head_dim_v), v.dtype, problem.layout),
        )
    backward(problem, arrays, grads, extras)
    return grads


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
        aligned rows (see :func:`._launch.aligned`), and ``lse`` (B, Hq, Sq) float32.
    grads : tuple of arrays
        ``dq (B, Hq, Sq, D), dk (B, Hkv, Sk, D), dv (B, Hkv, Sk, D)`` to write, input dtype, last
        axis contiguous.
    extras : AttentionExtras
        Mask and key_lengths as given to the forward.
    """
    xp = _launch.array_module()
    dq, dk, dv = grads
    head_dim, deterministic = problem.head_dim, problem.deterministic
    launch = kernels(problem)
    record = params.from_problem(problem, extras)
    for name in ("q", "k", "v", "dout", "out", "lse"):
        params.set_operand(record, name, arrays[name])
    for name, array in (("dq", dq), ("dk", dk), ("dv", dv)):
        params.set_operand(record, name, array)
    rows = problem.batch * problem.heads_q * problem.seq_q
    with stream(problem.framework):
        # Scratch allocated on the launch stream, so that CuPy's pool cannot hand it to another
        # stream while these kernels still use it.
        scratch = {"lse2": xp.empty(rows, dtype=xp.float32), "delta": xp.empty(rows, dtype=xp.float32)}
        if not deterministic:
            scratch["dq_accum"] = xp.empty(rows * head_dim, dtype=xp.float32)
        for name, array in scratch.items():
            params.set_pointer(record, name, array)
        argument = params.argument(record)
        lanes = 1 << max(2, math.ceil(math.log2(head_dim // 8)))  # threads per row, a power of 2
        launch.prepare((math.ceil(rows / (PREPARE_THREADS // lanes)),), (PREPARE_THREADS,), argument)
        launch.kv(
            (math.ceil(problem.seq_k / block_keys(head_dim)), problem.heads_kv, problem.batch),
            (KV_WARPS * 32,),
            argument,
            shared_mem=kv_shared_bytes(head_dim),
        )
        if deterministic:
            launch.dq(
                (math.ceil(problem.seq_q / DQ_BLOCK_M), problem.heads_q, problem.batch),
                (DQ_WARPS * 32,),
                argument,
                shared_mem=dq_shared_bytes(head_dim),
            )
        else:
            launch.dq((math.ceil(rows * head_dim // 8 / CONVERT_THREADS),), (CONVERT_THREADS,), argument)
